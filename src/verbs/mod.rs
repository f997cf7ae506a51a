//! The backend seam: what the NVMe-oF host needs from an RDMA device, and nothing about how
//! a device provides it. `src/transport/` and `src/reconnect/` are written against these
//! traits and names only, so the same host (its recovery path included) runs on the
//! soft-HCA (on UDP, or on the seeded simulated network of `crate::driver::SimNet` in
//! virtual time) and on a kernel verbs device.
//!
//! - [`DeviceContext`]: one open context of a device (identity, liveness, PD, MRs over host
//!   memory the host keeps across contexts, CQ, RC QP, batched post, CQ poll and wait).
//! - [`DeviceSource`]: where the host finds a device's current context again after a reset
//!   or a re-plug, and how it learns that the device list changed.
//! - [`CmPort`]: the connection manager of a context (active connect with private data,
//!   abort, disconnect, the peer's disconnect); [`CmListen`] its passive side (listen,
//!   accept, reject), for the built-in target.
//!
//! The vocabulary (QPN, PSN, work requests and completions, access flags, ...) is defined by
//! the soft-HCA today and re-exported here; the host names it through this module so that
//! moving the definitions here later touches no host code.

mod cm;
mod device;
mod source;

pub use cm::{CmError, CmListen, CmPort, Incoming, INCOMING_BACKLOG};
pub use device::{DeviceContext, HostBuffer, Identity, RcAttr};
pub use source::{DeviceSource, Opened};

pub use crate::hca::device::roce_peer;
pub use crate::hca::rc::PeerInfo;
pub use crate::hca::registry::DeviceInfo;
pub use crate::hca::{
    Access, AsyncEvent, CqId, DeviceIdentity, Guid, Instant, Lifecycle, MemKey, MrInfo, Mtu,
    PciAddr, PdId, Psn, QpCaps, Qpn, RecvWr, SendOp, SendWr, Sge, Sgl, VerbsError, WcOpcode,
    WcStatus, WorkCompletion,
};

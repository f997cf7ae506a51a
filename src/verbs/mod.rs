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
//! - [`FaultInjector`]: not part of the seam; a wrapper around a source that resets its
//!   devices by hand ([`ResetHook`]), for chaos tools and tests.
//!
//! The vocabulary (QPN, PSN, work requests and completions, access flags, lifecycle, errors,
//! ...) is defined here, and every backend speaks it.

mod cm;
mod device;
mod error;
mod event;
mod fault;
mod mr;
mod source;
mod types;
mod wc;
mod wr;

pub use cm::{CmError, CmListen, CmPort, Incoming, INCOMING_BACKLOG};
pub use device::{DeviceContext, HostBuffer, Identity, RcAttr};
pub use error::VerbsError;
pub use event::{AsyncEvent, Lifecycle};
pub use fault::{DeviceFaults, FaultInjector, ResetHook};
pub use mr::{Access, MrInfo, PdId};
pub use source::{DeviceSource, Opened};
pub use types::{Guid, Instant, MemKey, PciAddr, PciAddrParseError, PeerInfo, Psn, Qpn};
pub use wc::{CqId, WcOpcode, WcStatus, WorkCompletion};
pub use wr::{Mtu, QpCaps, RecvWr, SendOp, SendWr, Sge, Sgl, MAX_SGE};

pub use crate::hca::device::roce_peer;

pub use crate::hca::registry::DeviceInfo;
pub use crate::hca::DeviceIdentity;

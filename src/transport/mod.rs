//! The NVMe-oF RDMA host: queues with capsules and keyed SGLs into pre-registered buffers
//! ([`queue`]), and the controller with its block API ([`controller`]), brought up by
//! `bringup` and kept alive by `recovery` (one entry for every cause, and its executor).
//! What they share (status, device, connect options) is in `state` and [`options`].
//! It runs on any backend of the seam in [`crate::verbs`] and names none.

mod bringup;
pub mod controller;
pub mod error;
pub mod fixed;
mod inbox;
pub mod namespaces;
pub mod options;
pub mod queue;
mod recovery;
pub mod saferetry;
mod state;

pub use controller::{discover, Controller};
pub use error::HostError;
pub use fixed::Fixed;
pub use namespaces::{AsyncEvent, NsInfo};
pub use options::{default_hostid, ConnectOptions, SOFT_INLINE_DEPTH};
pub use queue::{IoBuffer, QueueHandle, QueueSpec, QueueStats};
pub use saferetry::{
    CcrOutcome, CtrlInstance, HoldStatus, Losses, ReleasedBy, SafeRetry, SafeRetryStatus,
};
pub use state::{CtrlStatus, RecoveryTrace};

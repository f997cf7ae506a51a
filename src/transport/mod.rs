//! The NVMe-oF RDMA host: queues with capsules and keyed SGLs into pre-registered buffers
//! ([`queue`]), and the controller with its block API ([`controller`]). It runs on any
//! backend of the seam in [`crate::verbs`] and names none.

pub mod controller;
pub mod error;
pub mod fixed;
pub mod queue;

pub use controller::{
    default_hostid, discover, AsyncEvent, ConnectOptions, Controller, CtrlStatus, NsInfo,
    RecoveryTrace, SOFT_INLINE_DEPTH,
};
pub use error::HostError;
pub use fixed::Fixed;
pub use queue::{IoBuffer, QueueHandle, QueueSpec, QueueStats};

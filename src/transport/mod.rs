//! The NVMe-oF RDMA host: queues with capsules and keyed SGLs into pre-registered buffers
//! ([`queue`]), and the controller with its block API ([`controller`]).

pub mod controller;
pub mod error;
pub mod queue;

pub use controller::{
    default_hostid, discover, ConnectOptions, Controller, CtrlStatus, HostDevice, NsInfo,
    SOFT_INLINE_DEPTH,
};
pub use error::HostError;
pub use queue::{QueueHandle, QueueSpec, QueueStats};

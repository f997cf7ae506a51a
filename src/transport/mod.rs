//! The NVMe-oF RDMA host: CM over the soft-HCA's QP1 ([`fabric`]), queues with capsules and
//! keyed SGLs into pre-registered buffers ([`queue`]), and the controller with its block API
//! ([`controller`]).

pub mod controller;
pub mod error;
pub mod fabric;
pub mod queue;

pub use controller::{
    default_hostid, discover, ConnectOptions, Controller, CtrlStatus, HostDevice, NsInfo,
    SOFT_INLINE_DEPTH,
};
pub use error::HostError;
pub use fabric::CmService;
pub use queue::{QueueHandle, QueueSpec, QueueStats};

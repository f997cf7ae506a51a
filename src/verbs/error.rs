//! Errors of verbs calls.

// The transition table that refuses a modify is the soft-HCA's; a kernel device reports its
// refusals as other variants.
use crate::hca::qp::state::{ModifyError, QpState};

/// Errors from verbs calls. `DeviceGone` is permanent for this context (open the device
/// again once it is back); the others are the caller's mistakes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerbsError {
    #[error("device is gone (fatal error or removed); only release calls are allowed")]
    DeviceGone,
    #[error("no such {0}")]
    InvalidHandle(&'static str),
    #[error("{0} is still in use")]
    Busy(&'static str),
    #[error(transparent)]
    Modify(#[from] ModifyError),
    #[error("cannot post to a QP in state {}", .0.name())]
    InvalidQpState(QpState),
    #[error("{0} queue is full")]
    QueueFull(&'static str),
    #[error("invalid argument: {0}")]
    InvalidArgument(&'static str),
}

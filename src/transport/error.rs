//! Errors of the host side, each documented as transient (recovery may fix it) or permanent.

use crate::nvme::{NvmeError, NvmeWireError, Status};
use crate::verbs::{CmError, VerbsError};

#[derive(Debug, Clone, thiserror::Error)]
pub enum HostError {
    /// The controller answered with an error status. Permanent when DNR is set.
    #[error("{0}")]
    Nvme(#[from] NvmeError),
    /// The RDMA transport failed under the request (flush, retry exhausted, device gone).
    /// Transient: the recovery path reconnects and resubmits.
    #[error("transport error: {0}")]
    Transport(String),
    /// The target could not be reached or refused the connection. Transient unless the
    /// reason says otherwise.
    #[error("connect failed: {0}")]
    Connect(String),
    /// The target sent something that breaks the protocol (bad completion, wrong size).
    /// The request is failed; other requests are unaffected.
    #[error("protocol violation by the target: {0}")]
    Protocol(String),
    /// The caller asked for something impossible (unaligned I/O, too large, no such
    /// namespace). Permanent.
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The controller was disconnected or deleted. Permanent for this handle.
    #[error("controller is gone: {0}")]
    Gone(String),
    /// The namespace a user opened is no longer behind its NSID: removed, or replaced by a
    /// different namespace (another NGUID, EUI-64 or UUID). Permanent for that user: the
    /// new namespace, if any, is used by opening it again.
    #[error("{0}")]
    NamespaceGone(String),
    /// The path to the controller is down and the policy gave up on this request:
    /// fast_io_fail_tmo passed (the controller keeps reconnecting), or ctrl_loss_tmo,
    /// max_reconnects or the replug window ended it (the controller is deleted).
    #[error("host path error: {}", .0.name())]
    Path(crate::reconnect::FailReason),
    /// A step of connecting or recovering failed; the message is static so the recovery
    /// path allocates nothing even when an attempt fails. Transient.
    #[error("reconnect step failed: {0}")]
    Step(&'static str),
    /// A command did not complete in time. Transient.
    #[error("timed out: {0}")]
    Timeout(String),
}

impl HostError {
    pub fn from_status(status: Status, opcode: u8) -> HostError {
        match status.into_result(Some(opcode)) {
            Ok(()) => HostError::Protocol("success status treated as error".into()),
            Err(e) => HostError::Nvme(e),
        }
    }
}

impl From<NvmeWireError> for HostError {
    fn from(e: NvmeWireError) -> Self {
        HostError::Invalid(e.to_string())
    }
}

impl From<VerbsError> for HostError {
    fn from(e: VerbsError) -> Self {
        HostError::Transport(e.to_string())
    }
}

impl From<CmError> for HostError {
    fn from(e: CmError) -> Self {
        match e {
            CmError::Refused(why) => HostError::Connect(why),
            CmError::DeviceGone(why) => HostError::Step(why),
        }
    }
}

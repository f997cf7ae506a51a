//! What a failed command does next: sent again on another path, or its error goes to the
//! caller. Sans-I/O: the error and what is known about the failed controller's commands in,
//! a decision out.
//!
//! Linux's rule (`nvme_decide_disposition`, `nvme_failover_req`): a path-related status
//! (SCT 3) without DNR means the controller did not execute the command, so any command may
//! go to another path at once; an ANA status also makes the host read the ANA log again. A
//! command whose connection failed under it is another matter: it may still be executing in
//! the target. A read sent again elsewhere is harmless; a write (or Write Zeroes, a
//! deallocate, a flush) is not, because the stale original could land after a newer write
//! to the same blocks. It is sent elsewhere only once its controller's commands are known to
//! be finished (Cross-Controller Reset, or KATO + CQT since the last contact: TP8028 and
//! TP4129); until then its own controller keeps it and resends it under its own rule.

use crate::nvme::ana::status as ana_status;
use crate::transport::HostError;

/// A command as the retry rule sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CmdKind {
    /// May be executed twice with no harm.
    Read,
    /// Changes the namespace: write, Write Zeroes, deallocate, flush.
    Write,
}

/// What to do after a command failed on a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterError {
    /// Send it on another path (chosen afresh); with `reread_ana`, the failed path's ANA
    /// state is read again first.
    Elsewhere { reread_ana: bool },
    /// Hand the error to the caller.
    Fail,
}

/// Decide what happens to a `kind` command that failed with `err`. `old_commands_dead`:
/// the failed controller's commands are known to be finished.
pub fn after_error(kind: CmdKind, err: &HostError, old_commands_dead: bool) -> AfterError {
    match err {
        HostError::Nvme(e) if e.status.sct == 3 => {
            if e.status.dnr {
                return AfterError::Fail;
            }
            let s = crate::nvme::Status::new(e.status.sct, e.status.sc);
            AfterError::Elsewhere {
                reread_ana: [
                    ana_status::ANA_PERSISTENT_LOSS,
                    ana_status::ANA_INACCESSIBLE,
                    ana_status::ANA_TRANSITION,
                ]
                .contains(&s),
            }
        }
        // The connection under the command failed and the controller gave up on it
        // (fast_io_fail_tmo, ctrl_loss_tmo, delete), or the queue went away.
        HostError::Transport(_)
        | HostError::Path(_)
        | HostError::Gone(_)
        | HostError::Step(_)
        | HostError::Timeout(_) => match kind {
            CmdKind::Read => AfterError::Elsewhere { reread_ana: false },
            CmdKind::Write if old_commands_dead => AfterError::Elsewhere { reread_ana: false },
            CmdKind::Write => AfterError::Fail,
        },
        HostError::Nvme(_)
        | HostError::Connect(_)
        | HostError::Protocol(_)
        | HostError::Invalid(_)
        | HostError::NamespaceGone(_) => AfterError::Fail,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nvme::{NvmeError, Status};
    use crate::reconnect::FailReason;

    fn nvme(status: Status, dnr: bool) -> HostError {
        let mut status = status;
        status.dnr = dnr;
        HostError::Nvme(NvmeError {
            status,
            opcode: Some(0x01),
        })
    }

    #[test]
    fn an_ana_status_sends_any_command_elsewhere_and_rereads_the_ana_log() {
        for kind in [CmdKind::Read, CmdKind::Write] {
            for st in [
                ana_status::ANA_INACCESSIBLE,
                ana_status::ANA_PERSISTENT_LOSS,
                ana_status::ANA_TRANSITION,
            ] {
                assert_eq!(
                    after_error(kind, &nvme(st, false), false),
                    AfterError::Elsewhere { reread_ana: true }
                );
                assert_eq!(after_error(kind, &nvme(st, true), false), AfterError::Fail);
            }
            assert_eq!(
                after_error(kind, &nvme(ana_status::INTERNAL_PATH_ERROR, false), false),
                AfterError::Elsewhere { reread_ana: false }
            );
            // A media error is the namespace's, not the path's.
            assert_eq!(
                after_error(kind, &nvme(Status::new(2, 0x81), false), false),
                AfterError::Fail
            );
        }
    }

    #[test]
    fn a_write_whose_connection_failed_stays_until_its_commands_are_known_dead() {
        let errs = [
            HostError::Transport("flushed".into()),
            HostError::Path(FailReason::FastIoFail),
            HostError::Gone("deleted".into()),
        ];
        for e in &errs {
            assert_eq!(
                after_error(CmdKind::Read, e, false),
                AfterError::Elsewhere { reread_ana: false }
            );
            assert_eq!(after_error(CmdKind::Write, e, false), AfterError::Fail);
            assert_eq!(
                after_error(CmdKind::Write, e, true),
                AfterError::Elsewhere { reread_ana: false }
            );
        }
        assert_eq!(
            after_error(CmdKind::Read, &HostError::Invalid("x".into()), true),
            AfterError::Fail
        );
    }
}

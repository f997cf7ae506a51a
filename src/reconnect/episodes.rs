//! The recovery episodes of a controller as an observer sees them through its status
//! snapshots: how many started, their causes, how many recovered. The fio plugin prints it at
//! the end of a run; anything watching [`Status`] can use it.

use super::machine::{CtrlState, Status};

/// Causes kept for the summary; the count goes on past it.
pub const MAX_CAUSES: usize = 16;

/// Episodes seen so far. Feed it every status snapshot ([`RecoveryLog::observe`]); a snapshot
/// that skipped episodes (a watch channel keeps only the newest) still counts them all, with
/// the newest one's cause.
#[derive(Debug, Clone, Default)]
pub struct RecoveryLog {
    seen: u64,
    causes: Vec<&'static str>,
}

impl RecoveryLog {
    pub fn observe(&mut self, st: &Status) {
        if st.episodes > self.seen {
            self.seen = st.episodes;
            if let (Some(c), true) = (st.cause, self.causes.len() < MAX_CAUSES) {
                self.causes.push(c.name());
            }
        }
    }

    /// Episodes started, as far as the snapshots showed.
    pub fn episodes(&self) -> u64 {
        self.seen
    }

    /// One line: "2 recovery episodes (device-removed, keep-alive-lost): 1 recovered, 1 not
    /// recovered (ctrl_loss_tmo expired)"; "no recovery" when there was none. `st` is the
    /// controller's status now.
    pub fn summary(&self, st: &Status) -> String {
        let episodes = self.seen.max(st.episodes);
        if episodes == 0 {
            return "no recovery".into();
        }
        let in_progress = matches!(st.state, CtrlState::Resetting | CtrlState::Connecting);
        let open = episodes.saturating_sub(st.recoveries);
        let (running, lost) = if in_progress {
            (1, open.saturating_sub(1))
        } else {
            (0, open)
        };
        let mut s = format!(
            "{episodes} recovery episode{} ({}): {} recovered",
            if episodes == 1 { "" } else { "s" },
            self.causes.join(", "),
            st.recoveries
        );
        if lost > 0 {
            s += &format!(", {lost} not recovered");
            if let Some(r) = st.fail_reason {
                s += &format!(" ({})", r.name());
            }
        }
        if running > 0 {
            s += ", 1 in progress";
        }
        s
    }
}

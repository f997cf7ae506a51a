//! What the target promises a host about a dead controller's commands, sans I/O (time is
//! passed in): Command Quiesce Time (TP4129) and Cross-Controller Reset (TP8028).
//!
//! A controller dies when its admin queue goes (connection lost, keep-alive expiry, or a
//! CCR). Its commands the backend still holds then either run or are dropped, and all of
//! them are over within CQT of the death: a held command that is not yet due when CQT runs
//! out is dropped, one that is fenced by a CCR is dropped at once. A command that cannot be
//! stopped (it is in the backend's hands) keeps its controller ID out of reuse until it
//! ends, so a CCR naming that instance still finds it.
//!
//! A CCR names an instance by CNTLID, CIU and CIRN. It fences the instance; if nothing of
//! it can still run, the reset is over at once (IRS); otherwise it is in progress until the
//! last such command ends, and the source controller is told then (log page and event).

use rustc_hash::FxHashMap;

use crate::nvme::ccr::{CcrLogEntry, CcrState, CtrlInstance, CCRF_CTRL_RESET, CCRF_VALIDATED};
use crate::verbs::Instant;
use std::sync::Arc;

use super::Namespace;

/// How many CCRs one source controller may have in progress at once (CCRL).
pub(super) const CCR_LIMIT: u8 = 4;
/// Entries a source controller's CCR log page keeps; a CCR past it is refused (Log Page
/// Full) until the host reads the log with Remove Completed.
pub(super) const CCR_LOG_MAX: usize = 16;

/// A dead controller instance, kept while its commands may still run and, after that, for
/// as long as a host could still name it in a CCR (the TP4129 hold: 3 x KATO + CQT).
#[derive(Debug, Clone)]
pub(super) struct Dead {
    pub inst: CtrlInstance,
    pub subsys: usize,
    pub hostnqn: String,
    pub died: Instant,
    /// Held commands that may still run (dropped at CQT or at a fence).
    pub held: usize,
    /// Commands that cannot be stopped: each keeps the controller ID out of reuse.
    pub running: usize,
    pub fenced: bool,
    /// When the record may go, once nothing of it runs.
    pub forget_at: Instant,
}

impl Dead {
    fn pending(&self) -> usize {
        self.held + self.running
    }
}

/// A controller's death: the instance, whose it was, and what of it the backend still has:
/// `held` commands that may still run (stoppable), `running` ones it cannot stop.
#[derive(Debug, Clone, Copy)]
pub(super) struct Death<'a> {
    pub inst: CtrlInstance,
    pub subsys: usize,
    pub hostnqn: &'a str,
    pub kato_ms: u32,
    pub held: usize,
    pub running: usize,
}

/// A CCR in progress: the source controller that runs it and the instance it resets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Reset {
    pub source: u16,
    pub impacted: CtrlInstance,
}

/// What becomes of a held command of a dead controller, now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Verdict {
    Run,
    Drop,
    Wait,
}

/// Why a CCR is refused, as its status says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Refusal {
    /// No controller of this host and subsystem is that instance (or it names the source).
    Unknown,
    InProgress,
    LogFull,
    LimitExceeded,
}

/// The dead controllers and the CCRs in progress.
#[derive(Debug, Default)]
pub(super) struct Quiesce {
    cqt_ns: u64,
    dead: FxHashMap<u16, Dead>,
    resets: Vec<Reset>,
}

const MS: u64 = 1_000_000;

impl Quiesce {
    pub fn new(cqt_ms: u16) -> Quiesce {
        Quiesce {
            cqt_ns: u64::from(cqt_ms) * MS,
            ..Quiesce::default()
        }
    }

    /// A controller died at `now` (see [`Death`]). A CCR that fenced it while it was live
    /// still holds.
    pub fn died(&mut self, death: Death, now: Instant) {
        let Death {
            inst,
            subsys,
            hostnqn,
            kato_ms,
            held,
            running,
        } = death;
        let keep = 3 * u64::from(kato_ms) * MS + self.cqt_ns;
        let fenced = self
            .dead
            .get(&inst.cntlid)
            .is_some_and(|d| d.inst == inst && d.fenced);
        self.dead.insert(
            inst.cntlid,
            Dead {
                inst,
                subsys,
                hostnqn: hostnqn.to_string(),
                died: now,
                held,
                running,
                fenced,
                forget_at: Instant(now.0.saturating_add(keep)),
            },
        );
    }

    /// Is controller ID `id` kept out of reuse (a command of its last instance may still run)?
    pub fn holds(&self, id: u16) -> bool {
        self.dead.get(&id).is_some_and(|d| d.pending() > 0)
    }

    /// Controller ID `id` is given to a new instance: the old one's record goes.
    pub fn reused(&mut self, id: u16) {
        self.dead.remove(&id);
    }

    /// The dead instance a CCR names, if it is one of `hostnqn`'s in `subsys`.
    pub fn find(&self, inst: &CtrlInstance, subsys: usize, hostnqn: &str) -> Option<&Dead> {
        self.dead
            .get(&inst.cntlid)
            .filter(|d| d.inst == *inst && d.subsys == subsys && d.hostnqn == hostnqn)
    }

    /// What becomes of a held command of `inst`, due to run at `due`.
    pub fn verdict(&self, inst: &CtrlInstance, due: Instant, now: Instant) -> Verdict {
        let Some(d) = self.dead.get(&inst.cntlid).filter(|d| d.inst == *inst) else {
            // Not dead (a live controller's held command) runs when due.
            return if now.0 >= due.0 {
                Verdict::Run
            } else {
                Verdict::Wait
            };
        };
        if d.fenced || now.0 >= d.died.0.saturating_add(self.cqt_ns) {
            Verdict::Drop
        } else if now.0 >= due.0 {
            Verdict::Run
        } else {
            Verdict::Wait
        }
    }

    /// When the next held command of `inst` due at `due` needs a look: when it is due or
    /// when CQT runs out, whichever is first.
    pub fn wake_at(&self, inst: &CtrlInstance, due: Instant) -> Instant {
        match self.dead.get(&inst.cntlid).filter(|d| d.inst == *inst) {
            Some(d) => Instant(due.0.min(d.died.0.saturating_add(self.cqt_ns))),
            None => due,
        }
    }

    /// A held command of `inst` ran or was dropped; the CCRs it finished come back.
    pub fn held_ended(&mut self, inst: &CtrlInstance) -> Vec<Reset> {
        self.ended(inst, |d| d.held = d.held.saturating_sub(1))
    }

    /// A command of `inst` that could not be stopped ended; the CCRs it finished come back.
    pub fn running_ended(&mut self, inst: &CtrlInstance) -> Vec<Reset> {
        self.ended(inst, |d| d.running = d.running.saturating_sub(1))
    }

    fn ended(&mut self, inst: &CtrlInstance, f: impl FnOnce(&mut Dead)) -> Vec<Reset> {
        let Some(d) = self.dead.get_mut(&inst.cntlid).filter(|d| d.inst == *inst) else {
            return Vec::new();
        };
        f(d);
        if d.pending() > 0 {
            return Vec::new();
        }
        let (done, rest) = self.resets.iter().partition(|r| r.impacted == *inst);
        self.resets = rest;
        done
    }

    /// Check a CCR from `source` (whose log holds `logged` entries) for `inst`, known
    /// (live or dead) as `known`.
    pub fn admit(
        &self,
        source: u16,
        inst: &CtrlInstance,
        known: bool,
        logged: usize,
    ) -> Result<(), Refusal> {
        if !known || inst.cntlid == source {
            return Err(Refusal::Unknown);
        }
        let mine = self.resets.iter().filter(|r| r.source == source);
        if mine.clone().any(|r| r.impacted == *inst) {
            return Err(Refusal::InProgress);
        }
        if mine.count() >= usize::from(CCR_LIMIT) {
            return Err(Refusal::LimitExceeded);
        }
        if logged >= CCR_LOG_MAX {
            return Err(Refusal::LogFull);
        }
        Ok(())
    }

    /// Fence instance `inst` for a CCR from `source`: its held commands are dropped (they
    /// show as ended through [`Quiesce::held_ended`]); the log entry comes back, in
    /// progress while a command that cannot be stopped still runs (the reset finishes when
    /// the last one ends), a success otherwise. A live instance is fenced ahead of its
    /// teardown ([`Quiesce::died`] keeps the fence), which stops everything it holds.
    pub fn fence(&mut self, source: u16, inst: CtrlInstance) -> CcrLogEntry {
        let d = self.dead.entry(inst.cntlid).or_insert_with(|| Dead {
            inst,
            subsys: usize::MAX,
            hostnqn: String::new(),
            died: Instant(0),
            held: 0,
            running: 0,
            fenced: true,
            forget_at: Instant(0),
        });
        d.fenced = true;
        let running = d.running;
        let state = if running > 0 {
            self.resets.push(Reset {
                source,
                impacted: inst,
            });
            CcrState::InProgress
        } else {
            CcrState::Success
        };
        entry(source, inst, state)
    }

    /// After a CCR from `source` fenced live instance `inst` and its teardown: if a command
    /// of it could not be stopped, the reset is in progress until that ends (true).
    pub fn still_running(&mut self, source: u16, inst: CtrlInstance) -> bool {
        let running = self
            .dead
            .get(&inst.cntlid)
            .is_some_and(|d| d.inst == inst && d.running > 0);
        let known = self
            .resets
            .iter()
            .any(|r| r.source == source && r.impacted == inst);
        if running && !known {
            self.resets.push(Reset {
                source,
                impacted: inst,
            });
        }
        running
    }

    /// Dead records with nothing pending whose time is up go.
    pub fn forget(&mut self, now: Instant) {
        self.dead
            .retain(|_, d| d.pending() > 0 || now.0 < d.forget_at.0);
    }
}

/// The CCR log entry for a reset of `inst` run by `source`.
pub(super) fn entry(source: u16, inst: CtrlInstance, state: CcrState) -> CcrLogEntry {
    CcrLogEntry {
        icid: inst.cntlid,
        ciu: inst.ciu,
        acid: source,
        state,
        flags: CCRF_VALIDATED | CCRF_CTRL_RESET,
    }
}

/// A write of a dead controller held for the late-writes fault: its data stays in its
/// queue's staging (kept alive by this reference), and it runs at `due` unless a CCR or
/// CQT stops it first.
pub(super) struct LateWrite<M> {
    pub inst: CtrlInstance,
    pub due: Instant,
    pub ns: Arc<Namespace>,
    pub off: u64,
    pub len: usize,
    pub staging: Arc<M>,
    pub at: usize,
}

/// No wake-up wanted (the engine's `late_wake`).
pub(super) const NO_WAKE: u64 = u64::MAX;

#[cfg(test)]
mod tests {
    use super::*;

    const A: CtrlInstance = CtrlInstance {
        cntlid: 5,
        ciu: 9,
        cirn: 0xABCD,
    };
    const HOST: &str = "nqn.host";

    fn death(inst: CtrlInstance, held: usize, running: usize) -> Death<'static> {
        Death {
            inst,
            subsys: 0,
            hostnqn: HOST,
            kato_ms: 5000,
            held,
            running,
        }
    }

    fn ms(v: u64) -> Instant {
        Instant(v * MS)
    }

    #[test]
    fn held_commands_run_when_due_within_cqt_and_are_dropped_past_it() {
        let mut q = Quiesce::new(1000);
        q.died(death(A, 2, 0), ms(100));
        assert_eq!(q.verdict(&A, ms(400), ms(399)), Verdict::Wait);
        assert_eq!(q.verdict(&A, ms(400), ms(400)), Verdict::Run);
        // Due after CQT has run out: dropped when it does, never run.
        assert_eq!(q.wake_at(&A, ms(5000)), ms(1100));
        assert_eq!(q.verdict(&A, ms(5000), ms(1099)), Verdict::Wait);
        assert_eq!(q.verdict(&A, ms(5000), ms(1100)), Verdict::Drop);
    }

    #[test]
    fn fence_drops_held_commands_and_succeeds_at_once() {
        let mut q = Quiesce::new(1000);
        q.died(death(A, 1, 0), ms(0));
        assert!(q.holds(A.cntlid));
        let e = q.fence(7, A);
        assert_eq!(e.state, CcrState::Success);
        assert_eq!(q.verdict(&A, ms(10), ms(10)), Verdict::Drop);
        assert!(q.held_ended(&A).is_empty());
        assert!(!q.holds(A.cntlid));
    }

    #[test]
    fn unstoppable_command_keeps_the_id_and_the_reset_in_progress_until_it_ends() {
        let mut q = Quiesce::new(1000);
        q.died(death(A, 0, 1), ms(0));
        let e = q.fence(7, A);
        assert_eq!(e.state, CcrState::InProgress);
        assert_eq!(q.admit(7, &A, true, 1), Err(Refusal::InProgress));
        // Past every deadline, the ID stays out of reuse while the command runs.
        q.forget(ms(1_000_000));
        assert!(q.holds(A.cntlid));
        let done = q.running_ended(&A);
        assert_eq!(
            done,
            vec![Reset {
                source: 7,
                impacted: A
            }]
        );
        assert!(!q.holds(A.cntlid));
        q.forget(ms(1_000_000));
        assert!(q.find(&A, 0, HOST).is_none());
    }

    #[test]
    fn a_live_instance_fenced_before_its_teardown_stays_fenced_and_may_still_run() {
        let mut q = Quiesce::new(1000);
        assert_eq!(q.fence(7, A).state, CcrState::Success);
        // The teardown finds a held write and a started job.
        q.died(death(A, 1, 1), ms(0));
        assert_eq!(q.verdict(&A, ms(0), ms(0)), Verdict::Drop);
        assert!(q.still_running(7, A));
        assert_eq!(q.admit(7, &A, true, 1), Err(Refusal::InProgress));
        assert!(q.held_ended(&A).is_empty());
        assert_eq!(q.running_ended(&A).len(), 1);
    }

    #[test]
    fn admit_refuses_unknown_self_limit_and_full_log() {
        let mut q = Quiesce::new(1000);
        assert_eq!(q.admit(7, &A, false, 0), Err(Refusal::Unknown));
        assert_eq!(q.admit(5, &A, true, 0), Err(Refusal::Unknown));
        assert_eq!(q.admit(7, &A, true, CCR_LOG_MAX), Err(Refusal::LogFull));
        for i in 0..CCR_LIMIT {
            let inst = CtrlInstance {
                cntlid: 100 + u16::from(i),
                ..A
            };
            q.died(death(inst, 0, 1), ms(0));
            q.fence(7, inst);
        }
        assert_eq!(q.admit(7, &A, true, 0), Err(Refusal::LimitExceeded));
        // Another source has its own limit.
        assert_eq!(q.admit(8, &A, true, 0), Ok(()));
    }

    #[test]
    fn find_matches_the_whole_instance_host_and_subsystem() {
        let mut q = Quiesce::new(1000);
        q.died(death(A, 0, 0), ms(0));
        assert!(q.find(&A, 0, HOST).is_some());
        assert!(q.find(&CtrlInstance { ciu: 8, ..A }, 0, HOST).is_none());
        assert!(q.find(&CtrlInstance { cirn: 1, ..A }, 0, HOST).is_none());
        assert!(q.find(&A, 1, HOST).is_none());
        assert!(q.find(&A, 0, "nqn.other").is_none());
        // Kept for 3 x KATO + CQT, then forgotten.
        q.forget(ms(15_999));
        assert!(q.find(&A, 0, HOST).is_some());
        q.forget(ms(16_000));
        assert!(q.find(&A, 0, HOST).is_none());
    }
}

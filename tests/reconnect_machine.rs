//! The controller state machine in virtual time: every timing rule of recovery, to the tick.

#[path = "common/snapshot.rs"]
mod snapshot;

use std::time::Duration;

use nvmf_rdma::reconnect::{
    describe, Action, Actions, Cause, CtrlState, Event, FailReason, Identity, IdentityMatch,
    Machine, Policy, TRANSITIONS,
};
use nvmf_rdma::verbs::{Guid, Instant, PciAddr};
use snapshot::check_snapshot;

const MS: u64 = 1_000_000;
const S: u64 = 1_000 * MS;

fn ours() -> Identity {
    Identity {
        guid: Guid::from_mac([2, 0, 0, 0, 0, 1]),
        pci: PciAddr::new(0, 3, 0, 0),
    }
}

fn other_guid() -> Identity {
    Identity {
        guid: Guid::from_mac([2, 0, 0, 0, 0, 9]),
        ..ours()
    }
}

fn other_pci() -> Identity {
    Identity {
        pci: PciAddr::new(0, 4, 0, 0),
        ..ours()
    }
}

fn policy() -> Policy {
    Policy {
        ctrl_loss_tmo: Some(Duration::from_secs(60)),
        reconnect_delay: Duration::from_secs(10),
        fast_io_fail_tmo: Some(Duration::from_secs(5)),
        keep_alive_tmo: Duration::from_secs(4),
        replug_window: Duration::from_secs(30),
        identity: IdentityMatch::Both,
    }
}

/// Drives a machine, checking every transition against the declared table and answering
/// TearDown / FailAll like the controller does.
struct Drive {
    m: Machine,
    now: u64,
    log: Vec<(u64, Action)>,
}

impl Drive {
    fn new(p: Policy) -> Drive {
        let mut d = Drive {
            m: Machine::new(p, ours()),
            now: 0,
            log: Vec::new(),
        };
        d.ev(Event::Connected);
        assert_eq!(d.m.state(), CtrlState::Live);
        d
    }

    fn record(&mut self, a: Actions) {
        if let Some(t) = self.m.last {
            assert!(TRANSITIONS.contains(&t), "undeclared transition {t:?}");
        }
        let mut follow = Vec::new();
        for x in a.iter() {
            self.log.push((self.now, x));
            match x {
                Action::TearDown => follow.push(Event::TornDown),
                Action::FailAll(_) => follow.push(Event::Deleted),
                _ => {}
            }
        }
        for e in follow {
            if self.m.state() != CtrlState::Dead {
                let a = self.m.handle(Instant(self.now), e);
                self.record(a);
            }
        }
    }

    fn ev(&mut self, e: Event) {
        let a = self.m.handle(Instant(self.now), e);
        self.record(a);
    }

    /// Advance to `t` firing every timeout on its exact tick.
    fn run_to(&mut self, t: u64) {
        while let Some(next) = self.m.poll_timeout() {
            if next.0 > t {
                break;
            }
            self.now = self.now.max(next.0);
            let a = self.m.handle_timeout(Instant(self.now));
            self.record(a);
        }
        self.now = t;
    }

    fn when(&self, want: impl Fn(&Action) -> bool) -> Vec<u64> {
        self.log
            .iter()
            .filter(|(_, a)| want(a))
            .map(|(t, _)| *t)
            .collect()
    }

    fn attempts(&self) -> Vec<u64> {
        self.when(|a| matches!(a, Action::Connect { .. }))
    }
}

#[test]
fn the_transition_table() {
    // Every state but DEAD can be left, and DEAD can be reached from every state.
    for s in CtrlState::ALL {
        let leaves = TRANSITIONS.iter().any(|(f, _, _)| *f == s);
        assert_eq!(leaves, s != CtrlState::Dead, "{s:?}");
    }
    let text = describe();
    assert_eq!(text.lines().count(), TRANSITIONS.len());
    check_snapshot("reconnect_transitions.txt", &text);
}

#[test]
fn every_cause_takes_the_same_path() {
    for c in Cause::ALL {
        let mut d = Drive::new(policy());
        d.now = 100 * S;
        d.ev(Event::Failed(c));
        let acts: Vec<Action> = d.log.iter().map(|(_, a)| *a).collect();
        assert_eq!(
            &acts[..2],
            &[Action::StopKeepAlive, Action::TearDown],
            "{c:?}"
        );
        assert_eq!(d.m.state(), CtrlState::Connecting, "{c:?}");
        assert_eq!(d.m.status(Instant(d.now)).cause, Some(c));
    }
}

#[test]
fn reset_then_same_device_reconnects_after_reconnect_delay() {
    let mut d = Drive::new(policy());
    d.now = 7 * S;
    d.ev(Event::DeviceDown { removed: false });
    d.run_to(12 * S);
    assert!(d.attempts().is_empty(), "no device, no attempt");
    d.ev(Event::DeviceUp(ours()));
    // The delay runs from the failure: the device came back at 12 s, the attempt is at 17 s.
    d.run_to(17 * S - 1);
    assert!(d.attempts().is_empty());
    d.run_to(17 * S);
    assert_eq!(d.attempts(), vec![17 * S]);
    d.ev(Event::Connected);
    assert_eq!(d.m.state(), CtrlState::Live);
    assert!(d.log.iter().any(|(_, a)| *a == Action::Resubmit));
    assert_eq!(d.m.status(Instant(d.now)).recoveries, 1);
}

#[test]
fn fast_io_fail_then_ctrl_loss_to_the_tick() {
    let mut d = Drive::new(policy());
    d.now = 3 * S;
    d.ev(Event::Failed(Cause::DeviceFatal)); // the device never returns
    d.run_to(3 * S + 5 * S - 1);
    assert!(d.when(|a| matches!(a, Action::FailHeld(_))).is_empty());
    assert!(!d.m.failing_fast());
    d.run_to(3 * S + 5 * S);
    assert_eq!(
        d.when(|a| *a == Action::FailHeld(FailReason::FastIoFail)),
        vec![8 * S]
    );
    assert!(d.m.failing_fast());
    assert_eq!(d.m.state(), CtrlState::Connecting, "still trying");
    d.run_to(63 * S - 1);
    assert_eq!(d.m.state(), CtrlState::Connecting);
    assert_eq!(
        d.m.status(Instant(d.now)).loss_in,
        Some(Duration::from_nanos(1))
    );
    d.run_to(63 * S);
    assert_eq!(
        d.when(|a| *a == Action::FailAll(FailReason::CtrlLoss)),
        vec![63 * S]
    );
    assert_eq!(d.m.state(), CtrlState::Dead);
}

/// A path of a subsystem with other paths gives its held I/O back as its connection is
/// lost (and when another path joins while it is down), without failing fast for its own
/// sake; with no other path it holds I/O until the reconnect again.
#[test]
fn with_other_paths_held_io_is_handed_back_at_the_loss() {
    let mut d = Drive::new(policy());
    d.ev(Event::OtherPaths(true));
    d.now = 3 * S;
    d.ev(Event::Failed(Cause::DeviceFatal));
    assert_eq!(d.when(|a| *a == Action::HandBack), vec![3 * S]);
    assert!(!d.m.failing_fast());
    d.ev(Event::DeviceUp(ours()));
    d.run_to(8 * S);
    d.ev(Event::Connected);
    assert_eq!(d.m.state(), CtrlState::Live);
    d.ev(Event::OtherPaths(false));
    d.now = 10 * S;
    d.ev(Event::Failed(Cause::DeviceFatal));
    assert_eq!(d.when(|a| *a == Action::HandBack), vec![3 * S]);
    d.now = 11 * S;
    d.ev(Event::OtherPaths(true));
    d.ev(Event::OtherPaths(true));
    assert_eq!(d.when(|a| *a == Action::HandBack), vec![3 * S, 11 * S]);
}

#[test]
fn a_different_device_is_not_ours_and_the_controller_is_lost() {
    for (imposter, rule, accepted) in [
        (other_guid(), IdentityMatch::Both, false),
        (other_pci(), IdentityMatch::Both, false),
        (other_guid(), IdentityMatch::Guid, false),
        (other_pci(), IdentityMatch::Pci, false),
        (other_pci(), IdentityMatch::Guid, true),
        (other_guid(), IdentityMatch::Pci, true),
        (other_guid(), IdentityMatch::Any, true),
    ] {
        let p = Policy {
            identity: rule,
            ..policy()
        };
        let mut d = Drive::new(p);
        d.ev(Event::Failed(Cause::DeviceRemoved));
        d.now = 2 * S;
        d.ev(Event::DeviceUp(imposter));
        let st = d.m.status(Instant(d.now));
        assert_eq!(st.foreign_device, !accepted, "{rule:?}");
        d.run_to(60 * S);
        if accepted {
            assert_eq!(d.attempts(), vec![10 * S], "{rule:?}");
        } else {
            assert!(d.attempts().is_empty(), "{rule:?}: no attempt through it");
            // The replug window (30 s) ends it before ctrl_loss_tmo (60 s).
            assert_eq!(
                d.when(|a| *a == Action::FailAll(FailReason::ReplugWindow)),
                vec![30 * S],
                "{rule:?}"
            );
            assert_eq!(d.m.state(), CtrlState::Dead);
        }
    }
}

#[test]
fn a_reset_device_that_comes_back_foreign_fails_at_ctrl_loss() {
    let mut d = Drive::new(Policy {
        fast_io_fail_tmo: None,
        ..policy()
    });
    d.ev(Event::Failed(Cause::DeviceFatal));
    d.now = S;
    d.ev(Event::DeviceUp(other_guid()));
    d.run_to(120 * S);
    assert!(d.attempts().is_empty());
    assert_eq!(
        d.when(|a| matches!(a, Action::FailAll(_))),
        vec![60 * S],
        "ctrl_loss_tmo, no replug window for a reset"
    );
    assert!(d.when(|a| matches!(a, Action::FailHeld(_))).is_empty());
}

#[test]
fn replug_within_the_window_reconnects() {
    let mut d = Drive::new(Policy {
        keep_alive_tmo: Duration::ZERO,
        ..policy()
    });
    d.ev(Event::Failed(Cause::DeviceRemoved));
    d.now = 29 * S;
    d.ev(Event::DeviceUp(ours()));
    d.run_to(29 * S);
    assert_eq!(
        d.attempts(),
        vec![29 * S],
        "reconnect_delay (10 s) already passed"
    );
    d.ev(Event::Connected);
    d.run_to(100 * S);
    assert_eq!(d.m.state(), CtrlState::Live);
    assert!(d.when(|a| matches!(a, Action::FailAll(_))).is_empty());
}

#[test]
fn failed_attempts_are_spaced_by_reconnect_delay_and_bounded() {
    // ctrl_loss_tmo 35 s, delay 10 s: max_reconnects = 4 (Linux DIV_ROUND_UP).
    let p = Policy {
        ctrl_loss_tmo: Some(Duration::from_secs(35)),
        fast_io_fail_tmo: None,
        ..policy()
    };
    assert_eq!(p.max_reconnects(), Some(4));
    let mut d = Drive::new(p);
    d.ev(Event::Failed(Cause::CmDisconnect));
    let mut fails = 0;
    for _ in 0..10 {
        let before = d.attempts().len();
        d.run_to(d.now + 10 * S);
        if d.attempts().len() > before {
            d.now += S; // the attempt takes a second and fails
            d.ev(Event::ConnectFailed);
            fails += 1;
        }
        if d.m.state() == CtrlState::Dead {
            break;
        }
    }
    assert_eq!(d.attempts(), vec![10 * S, 21 * S, 32 * S]);
    // ctrl_loss_tmo (35 s) comes before the fourth attempt (43 s).
    assert_eq!(fails, 3);
    assert_eq!(
        d.when(|a| matches!(a, Action::FailAll(FailReason::CtrlLoss))),
        vec![35 * S]
    );
}

/// With reconnect_delay 0, ctrl_loss_tmo is a time, not an attempt count. Failed attempts
/// are paced (10 ms, doubling, at most 1 s) and only the loss timeout ends the controller,
/// not three instant refusals.
#[test]
fn zero_delay_paces_failed_attempts_and_only_time_ends_the_controller() {
    let p = Policy {
        ctrl_loss_tmo: Some(Duration::from_secs(3)),
        reconnect_delay: Duration::ZERO,
        fast_io_fail_tmo: None,
        ..policy()
    };
    assert_eq!(
        p.max_reconnects(),
        None,
        "no attempt budget with a zero delay"
    );
    let mut d = Drive::new(p);
    d.ev(Event::Failed(Cause::Transport));
    // Every attempt is refused 1 ms after it starts.
    let mut answered = 0;
    while d.m.state() != CtrlState::Dead {
        if d.attempts().len() == answered {
            let next = d.m.poll_timeout().expect("a deadline while recovering");
            d.run_to(next.0);
        }
        if d.attempts().len() > answered && d.m.state() != CtrlState::Dead {
            answered += 1;
            let st = d.m.status(Instant(d.now));
            assert_eq!(st.next_attempt_in, None, "an attempt is running");
            d.now += MS;
            d.ev(Event::ConnectFailed);
            if d.m.state() == CtrlState::Connecting {
                let st = d.m.status(Instant(d.now));
                assert!(st.next_attempt_in.is_some(), "list shows the gap: {st:?}");
            }
        }
    }
    let at = d.attempts();
    let gaps: Vec<u64> = at.windows(2).map(|w| (w[1] - w[0] - MS) / MS).collect();
    // First at once, then 10 ms after the failure, doubling, capped at 1 s.
    assert_eq!(at[0], 0);
    assert_eq!(&gaps[..7], &[10, 20, 40, 80, 160, 320, 640]);
    assert!(gaps[7..].iter().all(|g| *g == 1000), "{gaps:?}");
    assert_eq!(
        d.when(|a| matches!(a, Action::FailAll(_))),
        vec![3 * S],
        "ended by ctrl_loss_tmo, to the tick"
    );
    assert!(d
        .when(|a| matches!(a, Action::FailAll(FailReason::CtrlLoss)))
        .contains(&(3 * S)));
    assert!(at.len() >= 9 && at.len() <= 12, "{} attempts", at.len());
}

/// A target that refuses us for 3 s and then comes back is reconnected within
/// a pacing gap of its return, with reconnect_delay 0 and ctrl_loss_tmo 10 s.
#[test]
fn zero_delay_waits_out_a_target_that_refuses_for_a_while() {
    let p = Policy {
        ctrl_loss_tmo: Some(Duration::from_secs(10)),
        reconnect_delay: Duration::ZERO,
        fast_io_fail_tmo: None,
        ..policy()
    };
    let mut d = Drive::new(p);
    d.ev(Event::Failed(Cause::CmDisconnect));
    let mut answered = 0;
    while d.m.state() != CtrlState::Live {
        assert_ne!(d.m.state(), CtrlState::Dead, "gave up at {} ms", d.now / MS);
        if d.attempts().len() == answered {
            let next = d.m.poll_timeout().expect("a deadline while recovering");
            d.run_to(next.0);
        }
        if d.attempts().len() > answered {
            answered += 1;
            d.now += 2 * MS;
            d.ev(if d.now < 3 * S {
                Event::ConnectFailed
            } else {
                Event::Connected
            });
        }
    }
    assert!(
        d.now >= 3 * S && d.now <= 4 * S + 2 * MS,
        "live at {} ms",
        d.now / MS
    );
    assert_eq!(d.when(|a| *a == Action::Resubmit).len(), 1);
}

/// Attempts cut short by the device going away count against nothing but
/// time: with delay 1 s and ctrl_loss_tmo 3 s (max_reconnects 3), a hundred cut attempts
/// do not end the controller, and real failures still do.
#[test]
fn attempts_cut_by_the_device_count_against_nothing_but_time() {
    let p = Policy {
        ctrl_loss_tmo: Some(Duration::from_secs(3)),
        reconnect_delay: Duration::from_secs(1),
        fast_io_fail_tmo: None,
        ..policy()
    };
    assert_eq!(p.max_reconnects(), Some(3));
    let mut d = Drive::new(p);
    d.ev(Event::Failed(Cause::DeviceFatal));
    d.ev(Event::DeviceUp(ours()));
    d.run_to(S);
    for _ in 0..100 {
        assert_eq!(d.m.state(), CtrlState::Connecting);
        d.now += MS;
        d.ev(Event::ConnectCut);
        // The device is back at once; the next attempt waits reconnect_delay.
        d.run_to(d.now + S);
        if d.now >= 2 * S {
            break;
        }
    }
    let st = d.m.status(Instant(d.now));
    assert_eq!(st.failed_attempts, 0, "{st:?}");
    assert_eq!(d.m.state(), CtrlState::Connecting);
    // Now the target refuses: the budget (3) is spent by refusals only; ctrl_loss_tmo
    // (3 s after the failure) comes first.
    d.now += MS;
    d.ev(Event::ConnectFailed);
    assert_eq!(d.m.status(Instant(d.now)).failed_attempts, 1);
    d.run_to(10 * S);
    assert_eq!(
        d.when(|a| matches!(a, Action::FailAll(FailReason::CtrlLoss))),
        vec![3 * S]
    );
}

#[test]
fn a_reset_storm_makes_bounded_attempts_and_every_recovery_resubmits() {
    let p = Policy {
        reconnect_delay: Duration::ZERO,
        ..policy()
    };
    let mut d = Drive::new(p);
    for i in 0..1000u64 {
        d.now = i * 10 * MS;
        d.ev(Event::DeviceDown { removed: false });
        d.ev(Event::DeviceUp(ours()));
        let st = d.m.status(Instant(d.now));
        assert_eq!(st.attempt, 1, "one attempt per episode");
        d.ev(Event::Connected);
        assert_eq!(d.m.state(), CtrlState::Live);
    }
    assert_eq!(d.attempts().len(), 1000);
    assert_eq!(d.when(|a| *a == Action::Resubmit).len(), 1000);
    assert_eq!(d.m.status(Instant(d.now)).recoveries, 1000);
}

#[test]
fn keep_alive_every_half_kato_and_lost_after_kato() {
    let mut d = Drive::new(policy()); // kato 4 s
    d.run_to(2 * S - 1);
    assert!(d.when(|a| *a == Action::SendKeepAlive).is_empty());
    d.run_to(2 * S);
    assert_eq!(d.when(|a| *a == Action::SendKeepAlive), vec![2 * S]);
    d.now = 2 * S + 3 * MS;
    d.ev(Event::KeepAliveOk);
    d.run_to(4 * S);
    assert_eq!(d.when(|a| *a == Action::SendKeepAlive), vec![2 * S, 4 * S]);
    // No answer: lost exactly kato after it went out.
    d.run_to(8 * S - 1);
    assert_eq!(d.m.state(), CtrlState::Live);
    d.run_to(8 * S);
    assert_eq!(d.m.state(), CtrlState::Connecting);
    assert_eq!(d.m.status(Instant(d.now)).cause, Some(Cause::KeepAliveLost));
}

#[test]
fn delete_fails_everything_and_is_final() {
    let mut d = Drive::new(policy());
    d.ev(Event::Delete);
    let acts: Vec<Action> = d.log.iter().map(|(_, a)| *a).collect();
    assert_eq!(
        acts,
        vec![
            Action::StopKeepAlive,
            Action::Shutdown,
            Action::TearDown,
            Action::FailAll(FailReason::Deleted)
        ]
    );
    assert_eq!(d.m.state(), CtrlState::Dead);
    d.ev(Event::Connected);
    d.ev(Event::Failed(Cause::DeviceFatal));
    assert_eq!(d.m.state(), CtrlState::Dead);
    assert_eq!(d.m.poll_timeout(), None);
}

#[test]
fn forever_means_forever() {
    let mut d = Drive::new(Policy {
        ctrl_loss_tmo: None,
        fast_io_fail_tmo: None,
        ..policy()
    });
    d.ev(Event::Failed(Cause::DeviceFatal));
    d.run_to(365 * 24 * 3600 * S);
    assert_eq!(d.m.state(), CtrlState::Connecting);
    d.ev(Event::DeviceUp(ours()));
    d.run_to(d.now);
    assert_eq!(d.attempts().len(), 1);
}

/// The episode log a watcher keeps (the fio plugin's end-of-run line): a recovered episode
/// followed by one that ends at ctrl_loss_tmo gives two episodes with both causes, one
/// recovered and one not, whatever the stale cause of the status says in between.
#[test]
fn the_recovery_log_counts_every_episode_and_the_one_not_recovered() {
    use nvmf_rdma::reconnect::RecoveryLog;
    let p = Policy {
        ctrl_loss_tmo: Some(Duration::from_secs(3)),
        reconnect_delay: Duration::from_secs(1),
        fast_io_fail_tmo: None,
        ..policy()
    };
    let mut d = Drive::new(p);
    let mut log = RecoveryLog::default();
    let mut look = |d: &Drive| {
        let st = d.m.status(Instant(d.now));
        log.observe(&st);
        (st, log.clone())
    };
    assert_eq!(look(&d).1.summary(&look(&d).0), "no recovery");
    d.ev(Event::DeviceDown { removed: true });
    look(&d);
    d.ev(Event::DeviceUp(ours()));
    d.run_to(S);
    d.ev(Event::Connected);
    let (st, l) = look(&d);
    assert_eq!(d.m.state(), CtrlState::Live);
    assert_eq!(
        l.summary(&st),
        "1 recovery episode (device-removed): 1 recovered"
    );
    d.now += S;
    d.ev(Event::Failed(Cause::KeepAliveLost));
    let (st, l) = look(&d);
    assert_eq!(
        l.summary(&st),
        "2 recovery episodes (device-removed, keep-alive-lost): 1 recovered, 1 in progress"
    );
    d.run_to(20 * S);
    let (st, l) = look(&d);
    assert_eq!(d.m.state(), CtrlState::Dead);
    assert_eq!(
        l.summary(&st),
        "2 recovery episodes (device-removed, keep-alive-lost): 1 recovered, \
         1 not recovered (ctrl_loss_tmo expired)"
    );
}

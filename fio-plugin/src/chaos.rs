//! Device chaos while fio runs: each path's host device gets its fault (`chaos_reset_every`
//! on the first path, `chaos_unplug_every` on the second) on its own schedule, through the
//! fault injector that wraps the device source.
//!
//! Never two paths down at once: a fault that falls due while another path is not LIVE
//! waits until it is (its device back and its controller reconnected), and one task
//! inflicts the faults one after the other. So the schedules may overlap in any way; the
//! guard, not their arithmetic, keeps one path up. [`Schedule`] is that rule without I/O or
//! clock; [`run`] puts it to work.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use nvmf_rdma::driver::SoftHca;
use nvmf_rdma::nvmet::Target;
use nvmf_rdma::reconnect::CtrlState;
use nvmf_rdma::transport::Controller;
use nvmf_rdma::verbs::DeviceFaults;
use tokio::time::Instant;

use crate::options::{Chaos, FaultKind};

/// What to do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Inflict path `i`'s fault now.
    Inflict(usize),
    /// A fault is due, but path `i` is down: wait until it is up again.
    WaitFor(usize),
    /// Nothing is due before this.
    Sleep(Instant),
    /// No path has a fault.
    Idle,
}

/// When each path's next fault is due.
#[derive(Debug)]
pub struct Schedule {
    plans: Vec<Option<Chaos>>,
    due: Vec<Option<Instant>>,
}

impl Schedule {
    /// Path `i`'s first fault is due one period after `start`.
    pub fn new(plans: Vec<Option<Chaos>>, start: Instant) -> Schedule {
        let due = plans.iter().map(|p| p.map(|p| start + p.every)).collect();
        Schedule { plans, due }
    }

    /// What to do at `now`, with `up[i]` saying whether path `i` is LIVE. The earliest due
    /// fault goes first, once every other path is up. Inflicting one moves its path's next
    /// fault a period on (past `now`: faults that fell due while waiting are not made up).
    pub fn poll(&mut self, now: Instant, up: &[bool]) -> Step {
        let earliest = self
            .due
            .iter()
            .enumerate()
            .filter_map(|(i, d)| d.map(|d| (d, i)))
            .min();
        let Some((due, i)) = earliest else {
            return Step::Idle;
        };
        if due > now {
            return Step::Sleep(due);
        }
        if let Some(j) = (0..up.len()).find(|&j| j != i && !up[j]) {
            return Step::WaitFor(j);
        }
        if let (Some(p), Some(d)) = (self.plans[i], self.due[i].as_mut()) {
            while *d <= now {
                *d += p.every;
            }
        }
        Step::Inflict(i)
    }
}

/// One path as chaos sees it.
pub struct ChaosPath {
    pub ctrl: Weak<Controller>,
    pub faults: DeviceFaults,
    /// The built-in target's port the path goes to, and its ID there, for a freeze.
    pub port: Option<(Target<SoftHca>, u16)>,
    pub plan: Option<Chaos>,
    /// Faults inflicted on it so far.
    pub count: Arc<AtomicU64>,
}

fn is_up(p: &ChaosPath) -> Option<bool> {
    p.ctrl.upgrade().map(|c| c.state() == CtrlState::Live)
}

/// Inflict the paths' faults on schedule until a controller is dropped (the job is over).
pub async fn run(paths: Vec<ChaosPath>) {
    let mut sched = Schedule::new(paths.iter().map(|p| p.plan).collect(), Instant::now());
    loop {
        let up: Option<Vec<bool>> = paths.iter().map(is_up).collect();
        let Some(up) = up else { return };
        match sched.poll(Instant::now(), &up) {
            Step::Idle => return,
            Step::Sleep(t) => tokio::time::sleep_until(t).await,
            Step::WaitFor(j) => {
                let Some(c) = paths[j].ctrl.upgrade() else {
                    return;
                };
                let mut rx = c.watch_status();
                drop(c);
                // Bounded, so a path that never comes back does not keep chaos waiting on a
                // controller the job has dropped.
                let _ = tokio::time::timeout(
                    Duration::from_secs(1),
                    rx.wait_for(|s| s.state() == CtrlState::Live),
                )
                .await;
            }
            Step::Inflict(i) => {
                let p = &paths[i];
                let Some(plan) = p.plan else { continue };
                let r = match plan.kind {
                    FaultKind::Reset => p.faults.reset(plan.down_for).await,
                    FaultKind::Unplug => p.faults.unplug(plan.down_for).await,
                    FaultKind::Freeze => freeze(p.port.as_ref(), plan.down_for).await,
                };
                match r {
                    Ok(()) => {
                        p.count.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => eprintln!("nvmf-rdma: chaos {} failed: {e}", plan.kind.name()),
                }
            }
        }
    }
}

/// Freeze the target port for `down_for`.
async fn freeze(port: Option<&(Target<SoftHca>, u16)>, down_for: Duration) -> Result<(), String> {
    let (t, id) = port.ok_or(
        "chaos_freeze_every freezes a port of a built-in target this process started \
         (thread=1, or the job that started it)",
    )?;
    t.freeze_port(*id, true);
    tokio::time::sleep(down_for).await;
    t.freeze_port(*id, false);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(kind: FaultKind, every_ms: u64) -> Option<Chaos> {
        Some(Chaos {
            kind,
            every: Duration::from_millis(every_ms),
            down_for: Duration::ZERO,
        })
    }

    #[test]
    fn each_path_on_its_own_period() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut s = Schedule::new(
            vec![plan(FaultKind::Reset, 2000), plan(FaultKind::Unplug, 3000)],
            t0,
        );
        let up = [true, true];
        assert_eq!(s.poll(ms(0), &up), Step::Sleep(ms(2000)));
        assert_eq!(s.poll(ms(2000), &up), Step::Inflict(0));
        assert_eq!(s.poll(ms(2001), &up), Step::Sleep(ms(3000)));
        assert_eq!(s.poll(ms(3000), &up), Step::Inflict(1));
        assert_eq!(s.poll(ms(3500), &up), Step::Sleep(ms(4000)));
        assert_eq!(s.poll(ms(4000), &up), Step::Inflict(0));
        assert_eq!(s.poll(ms(4000), &up), Step::Sleep(ms(6000)));
    }

    #[test]
    fn a_fault_waits_while_the_other_path_is_down() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut s = Schedule::new(
            vec![plan(FaultKind::Reset, 2000), plan(FaultKind::Unplug, 1000)],
            t0,
        );
        assert_eq!(s.poll(ms(1000), &[true, true]), Step::Inflict(1));
        // Path 2 still away when path 1's reset falls due: the reset waits.
        assert_eq!(s.poll(ms(2000), &[true, false]), Step::WaitFor(1));
        assert_eq!(s.poll(ms(2600), &[true, false]), Step::WaitFor(1));
        // Back: the overdue faults go one at a time, the earliest first ...
        assert_eq!(s.poll(ms(2700), &[true, true]), Step::Inflict(0));
        // ... and the next only once the path just faulted is up again.
        assert_eq!(s.poll(ms(2700), &[false, true]), Step::WaitFor(0));
        assert_eq!(s.poll(ms(2800), &[true, true]), Step::Inflict(1));
        // Missed periods are not made up.
        assert_eq!(s.poll(ms(2800), &[true, true]), Step::Sleep(ms(3000)));
    }

    #[test]
    fn never_two_paths_down_whatever_the_periods() {
        // Simulated time: a fault keeps its path down for `down` ms; the guard must never
        // inflict one while the other path is down.
        let t0 = Instant::now();
        for (a, b, down) in [
            (2000, 3000, 700),
            (100, 150, 90),
            (500, 500, 499),
            (7, 5, 30),
        ] {
            let mut s = Schedule::new(
                vec![plan(FaultKind::Reset, a), plan(FaultKind::Unplug, b)],
                t0,
            );
            let mut back = [t0, t0];
            let mut faults = [0, 0];
            let mut now = t0;
            while now < t0 + Duration::from_secs(30) {
                let up = [back[0] <= now, back[1] <= now];
                match s.poll(now, &up) {
                    Step::Inflict(i) => {
                        assert!(up[1 - i], "{a}/{b}/{down}: both down at once");
                        back[i] = now + Duration::from_millis(down);
                        faults[i] += 1;
                    }
                    Step::WaitFor(j) => now = now.max(back[j]),
                    Step::Sleep(t) => now = t,
                    Step::Idle => unreachable!(),
                }
            }
            assert!(faults[0] > 0 && faults[1] > 0, "{a}/{b}/{down}: {faults:?}");
        }
    }

    #[test]
    fn no_plans_is_idle() {
        let mut s = Schedule::new(vec![None, None], Instant::now());
        assert_eq!(s.poll(Instant::now(), &[true, true]), Step::Idle);
    }
}

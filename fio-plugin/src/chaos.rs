//! Device chaos while fio runs: each path's host device gets its fault (`chaos_reset_every`
//! on the first path, `chaos_unplug_every` on the second) on its own schedule, through the
//! fault injector that wraps the device source.
//!
//! Never two paths down at once: a fault that falls due while another path is not LIVE
//! waits until it is (its device back and its controller reconnected), and one task
//! inflicts the faults one after the other. A path just reset or unplugged counts as down
//! until its controller is seen leaving LIVE: the controller learns of the fault a moment
//! after it is inflicted, and until then still says LIVE. So the schedules may overlap in
//! any way; the guard, not their arithmetic, keeps one path up. [`Schedule`] is that rule
//! without I/O or clock; [`run`] puts it to work.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use nvmf_rdma::driver::SoftHca;
use nvmf_rdma::nvmet::Target;
use nvmf_rdma::reconnect::CtrlState;
use nvmf_rdma::transport::{Controller, CtrlStatus};
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
    /// Path `i` was just faulted and its controller has not noticed yet: wait until it
    /// leaves LIVE, or this deadline passes.
    Settle(usize, Instant),
    /// Nothing is due before this.
    Sleep(Instant),
    /// No path has a fault.
    Idle,
}

/// What chaos sees of a path's controller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seen {
    pub live: bool,
    /// Recovery episodes it has started ([`nvmf_rdma::reconnect::CtrlStatus`]'s
    /// `machine.episodes`): one more once it has noticed a fault, even if it is back.
    pub episodes: u64,
}

/// How long a reset or unplugged path may still look LIVE before chaos stops waiting for
/// its controller to notice. A fatal device event reaches it within milliseconds; this
/// bounds a fault the controller never sees (a device it no longer uses).
pub const SETTLE_MAX: Duration = Duration::from_secs(2);

/// When each path's next fault is due.
#[derive(Debug)]
pub struct Schedule {
    plans: Vec<Option<Chaos>>,
    due: Vec<Option<Instant>>,
    /// The path last reset or unplugged, its episodes then, and until when it counts as
    /// down while it still looks LIVE.
    settling: Option<(usize, u64, Instant)>,
}

impl Schedule {
    /// Path `i`'s first fault is due one period after `start`.
    pub fn new(plans: Vec<Option<Chaos>>, start: Instant) -> Schedule {
        let due = plans.iter().map(|p| p.map(|p| start + p.every)).collect();
        Schedule {
            plans,
            due,
            settling: None,
        }
    }

    /// What to do at `now`, with `seen[i]` what path `i`'s controller says. The earliest
    /// due fault goes first, once every other path is up, and not before the path faulted
    /// last has been seen leaving LIVE. Inflicting one moves its path's next fault a period
    /// on (past `now`: faults that fell due while waiting are not made up).
    pub fn poll(&mut self, now: Instant, seen: &[Seen]) -> Step {
        if let Some((i, episodes, until)) = self.settling {
            let unnoticed = seen[i].live && seen[i].episodes == episodes;
            if unnoticed && now < until {
                return Step::Settle(i, until);
            }
            self.settling = None;
        }
        let up: Vec<bool> = seen.iter().map(|s| s.live).collect();
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
            // A freeze leaves the controller LIVE until its keep-alive fails, and is over
            // when it returns; a reset or an unplug takes the path out at once.
            if p.kind != FaultKind::Freeze {
                self.settling = Some((i, seen[i].episodes, now + p.down_for + SETTLE_MAX));
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

fn look(p: &ChaosPath) -> Option<Seen> {
    p.ctrl.upgrade().map(|c| {
        let s = c.status();
        Seen {
            live: s.state() == CtrlState::Live,
            episodes: s.machine.episodes,
        }
    })
}

/// Wait until path `p`'s controller says `done`, at most until `until`, holding its status
/// only, not the controller, which the job may drop meanwhile. False when it is gone.
async fn wait_until(p: &ChaosPath, until: Instant, done: impl Fn(&CtrlStatus) -> bool) -> bool {
    let Some(c) = p.ctrl.upgrade() else {
        return false;
    };
    let mut rx = c.watch_status();
    drop(c);
    let _ = tokio::time::timeout_at(until, rx.wait_for(|s| done(s))).await;
    true
}

/// Inflict the paths' faults on schedule until a controller is dropped (the job is over).
pub async fn run(paths: Vec<ChaosPath>) {
    let mut sched = Schedule::new(paths.iter().map(|p| p.plan).collect(), Instant::now());
    loop {
        let seen: Option<Vec<Seen>> = paths.iter().map(look).collect();
        let Some(seen) = seen else { return };
        match sched.poll(Instant::now(), &seen) {
            Step::Idle => return,
            Step::Sleep(t) => tokio::time::sleep_until(t).await,
            Step::WaitFor(j) => {
                // Bounded, so a path that never comes back does not keep chaos waiting on a
                // controller the job has dropped.
                let until = Instant::now() + Duration::from_secs(1);
                if !wait_until(&paths[j], until, |s| s.state() == CtrlState::Live).await {
                    return;
                }
            }
            Step::Settle(i, until) => {
                let episodes = seen[i].episodes;
                let noticed =
                    |s: &CtrlStatus| s.state() != CtrlState::Live || s.machine.episodes != episodes;
                if !wait_until(&paths[i], until, noticed).await {
                    return;
                }
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

    /// Paths seen LIVE or not, each having started `episodes[i]` recoveries.
    fn seen(live: &[bool], episodes: &[u64]) -> Vec<Seen> {
        live.iter()
            .zip(episodes)
            .map(|(&live, &episodes)| Seen { live, episodes })
            .collect()
    }

    #[test]
    fn each_path_on_its_own_period() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut s = Schedule::new(
            vec![plan(FaultKind::Reset, 2000), plan(FaultKind::Unplug, 3000)],
            t0,
        );
        let up = |e0, e1| seen(&[true, true], &[e0, e1]);
        assert_eq!(s.poll(ms(0), &up(0, 0)), Step::Sleep(ms(2000)));
        assert_eq!(s.poll(ms(2000), &up(0, 0)), Step::Inflict(0));
        // Each fault noticed and recovered from by the next look.
        assert_eq!(s.poll(ms(2001), &up(1, 0)), Step::Sleep(ms(3000)));
        assert_eq!(s.poll(ms(3000), &up(1, 0)), Step::Inflict(1));
        assert_eq!(s.poll(ms(3500), &up(1, 1)), Step::Sleep(ms(4000)));
        assert_eq!(s.poll(ms(4000), &up(1, 1)), Step::Inflict(0));
        assert_eq!(s.poll(ms(4000), &up(2, 1)), Step::Sleep(ms(6000)));
    }

    #[test]
    fn a_fault_waits_while_the_other_path_is_down() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut s = Schedule::new(
            vec![plan(FaultKind::Reset, 2000), plan(FaultKind::Unplug, 1000)],
            t0,
        );
        assert_eq!(
            s.poll(ms(1000), &seen(&[true, true], &[0, 0])),
            Step::Inflict(1)
        );
        // Path 2 still away when path 1's reset falls due: the reset waits.
        assert_eq!(
            s.poll(ms(2000), &seen(&[true, false], &[0, 1])),
            Step::WaitFor(1)
        );
        assert_eq!(
            s.poll(ms(2600), &seen(&[true, false], &[0, 1])),
            Step::WaitFor(1)
        );
        // Back: the overdue faults go one at a time, the earliest first ...
        assert_eq!(
            s.poll(ms(2700), &seen(&[true, true], &[0, 1])),
            Step::Inflict(0)
        );
        // ... and the next only once the path just faulted is up again.
        assert_eq!(
            s.poll(ms(2700), &seen(&[false, true], &[1, 1])),
            Step::WaitFor(0)
        );
        assert_eq!(
            s.poll(ms(2800), &seen(&[true, true], &[1, 1])),
            Step::Inflict(1)
        );
        // Missed periods are not made up.
        assert_eq!(
            s.poll(ms(2800), &seen(&[true, true], &[1, 2])),
            Step::Sleep(ms(3000))
        );
    }

    /// Path 1's fault (`first`) and path 2's unplug both due at 1 s, and path 1's inflicted.
    fn after_first(first: FaultKind, t0: Instant) -> Schedule {
        let mut s = Schedule::new(vec![plan(first, 1000), plan(FaultKind::Unplug, 1000)], t0);
        let at = t0 + Duration::from_millis(1000);
        assert_eq!(s.poll(at, &seen(&[true, true], &[0, 0])), Step::Inflict(0));
        s
    }

    /// Both faults fall due at once. Path 1 is reset, but its controller learns of it only
    /// a moment later and meanwhile still says LIVE: path 2's fault waits until path 1 is
    /// seen leaving LIVE (and then until it is back), not only while it says it is down.
    #[test]
    fn a_fault_counts_as_down_until_its_controller_notices() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let up = |episodes| seen(&[true, true], &[episodes, 0]);
        let until = ms(1000) + SETTLE_MAX;
        let mut s = after_first(FaultKind::Reset, t0);
        assert_eq!(s.poll(ms(1000), &up(0)), Step::Settle(0, until));
        let down = seen(&[false, true], &[1, 0]);
        assert_eq!(s.poll(ms(1001), &down), Step::WaitFor(0));
        assert_eq!(s.poll(ms(1300), &up(1)), Step::Inflict(1));
        // Noticed and recovered from before the next look (a short reset): nothing to wait
        // for.
        let mut s = after_first(FaultKind::Reset, t0);
        assert_eq!(s.poll(ms(1020), &up(1)), Step::Inflict(1));
        // Never noticed: it stops counting as down after SETTLE_MAX.
        let mut s = after_first(FaultKind::Reset, t0);
        assert_eq!(s.poll(until, &up(0)), Step::Inflict(1));
        // A freeze leaves its controller LIVE (until keep-alive fails) and is over when it
        // returns: the next fault does not wait for it.
        let mut s = after_first(FaultKind::Freeze, t0);
        assert_eq!(s.poll(ms(1000), &up(0)), Step::Inflict(1));
    }

    #[test]
    fn never_two_paths_down_whatever_the_periods() {
        // Simulated time: a fault takes its path's device away at once, its controller
        // says so only `notice` ms later, and the path is back `down` ms after that; the
        // guard must never inflict a fault while another path's device is away.
        let t0 = Instant::now();
        for (a, b, down, notice) in [
            (2000, 3000, 700, 0),
            (100, 150, 90, 3),
            (500, 500, 499, 1),
            (7, 5, 30, 2),
            (1000, 1000, 50, 5),
        ] {
            let mut s = Schedule::new(
                vec![plan(FaultKind::Reset, a), plan(FaultKind::Unplug, b)],
                t0,
            );
            let ms = |n| Duration::from_millis(n);
            // When each path's device went away and came back, and its episodes.
            let mut hit = [None::<Instant>; 2];
            let mut back = [t0, t0];
            let mut episodes = [0u64, 0];
            let mut faults = [0, 0];
            let mut now = t0;
            while now < t0 + Duration::from_secs(30) {
                let view: Vec<Seen> = (0..2)
                    .map(|i| {
                        let noticed = hit[i].is_some_and(|h| now >= h + ms(notice));
                        Seen {
                            live: back[i] <= now || !noticed,
                            episodes: episodes[i] - u64::from(!noticed && hit[i].is_some()),
                        }
                    })
                    .collect();
                match s.poll(now, &view) {
                    Step::Inflict(i) => {
                        let j = 1 - i;
                        assert!(back[j] <= now, "{a}/{b}/{down}/{notice}: both down at once");
                        hit[i] = Some(now);
                        back[i] = now + ms(notice + down);
                        episodes[i] += 1;
                        faults[i] += 1;
                    }
                    Step::WaitFor(j) => now = now.max(back[j]),
                    Step::Settle(i, until) => {
                        now = until.min(hit[i].expect("settling on a faulted path") + ms(notice))
                    }
                    Step::Sleep(t) => now = t,
                    Step::Idle => unreachable!(),
                }
            }
            assert!(
                faults[0] > 0 && faults[1] > 0,
                "{a}/{b}/{down}/{notice}: {faults:?}"
            );
        }
    }

    #[test]
    fn no_plans_is_idle() {
        let mut s = Schedule::new(vec![None, None], Instant::now());
        assert_eq!(
            s.poll(Instant::now(), &seen(&[true, true], &[0, 0])),
            Step::Idle
        );
    }
}

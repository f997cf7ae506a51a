//! Which path an I/O goes to: sans-I/O, no clock. The caller describes each path as it is
//! now ([`PathView`]) and asks [`Selector::choose`]; the selector only remembers which path
//! it used last (for `failover`'s stickiness and `round-robin`'s turn).
//!
//! The rules are Linux's (`drivers/nvme/host/multipath.c`: `nvme_find_path`,
//! `__nvme_find_path`, `nvme_round_robin_path`, `nvme_queue_depth_path`,
//! `nvme_available_path`) and SPDK's (`bdev_nvme_find_io_path`):
//! - only a LIVE controller whose ANA state for the namespace's group is optimized or
//!   non-optimized carries I/O; inaccessible, persistent loss and change never do;
//! - a non-optimized path only when no optimized path is usable;
//! - among the usable paths of the best kind, the policy picks: `failover` keeps the
//!   current one while it is among them, `round-robin` takes the next after the last one
//!   used, `queue-depth` the one with the fewest commands in flight (ties: the next after
//!   the last one used, so equal paths share);
//! - with no usable path, I/O is held while some path may still become usable (its
//!   controller is reconnecting and has not given up, or its ANA state may change), and
//!   fails once none can.

use std::time::Duration;

use crate::nvme::ana::AnaState;

/// How a namespace's I/O is spread over its usable paths (Linux `iopolicy`, SPDK
/// `bdev_nvme_set_multipath_policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IoPolicy {
    /// One path at a time; another only when it stops being usable (Linux `numa`'s
    /// single-node case, SPDK `active_passive`).
    #[default]
    Failover,
    /// Each I/O to the next usable path (Linux `round-robin`, SPDK `active_active` with
    /// `round_robin`).
    RoundRobin,
    /// Each I/O to the usable path with the fewest commands in flight (Linux `queue-depth`,
    /// SPDK `active_active` with `queue_depth`).
    QueueDepth,
}

impl IoPolicy {
    pub const ALL: [IoPolicy; 3] = [
        IoPolicy::Failover,
        IoPolicy::RoundRobin,
        IoPolicy::QueueDepth,
    ];

    pub fn name(self) -> &'static str {
        match self {
            IoPolicy::Failover => "failover",
            IoPolicy::RoundRobin => "round-robin",
            IoPolicy::QueueDepth => "queue-depth",
        }
    }
}

impl std::fmt::Display for IoPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for IoPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<IoPolicy, String> {
        IoPolicy::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                format!("unknown iopolicy {s:?}: use failover, round-robin or queue-depth")
            })
    }
}

/// One path as the selector sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PathView {
    /// Its controller is LIVE.
    pub live: bool,
    /// Its controller gave up, for now (fast_io_fail_tmo passed) or for good (deleted), or
    /// the namespace behind its NSID is another one: I/O held for it would only fail.
    pub failed: bool,
    /// The ANA state of the namespace's group through this path, as [`effective_ana`] makes
    /// it (optimized when the controller does not report ANA).
    pub ana: AnaState,
    /// Commands of this namespace in flight on it.
    pub inflight: u32,
}

impl PathView {
    /// 0 for optimized, 1 for non-optimized, none when it may not carry I/O now.
    fn tier(&self) -> Option<u8> {
        if !self.live || self.failed {
            return None;
        }
        match self.ana {
            AnaState::Optimized => Some(0),
            AnaState::NonOptimized => Some(1),
            _ => None,
        }
    }

    /// Could this path carry I/O later without the host doing anything: its controller is
    /// reconnecting and has not given up, and its ANA state is not a permanent loss.
    fn may_become_usable(&self) -> bool {
        !self.failed && self.ana != AnaState::PersistentLoss
    }
}

/// What to do with an I/O.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Choice {
    /// Send it on path `i` (an index into the slice given).
    Path(usize),
    /// Hold it: no path is usable now, but one may become usable.
    Hold,
    /// Fail it: no path can carry it.
    Fail,
}

/// The state of one namespace's path choice.
#[derive(Debug, Clone, Default)]
pub struct Selector {
    policy: IoPolicy,
    /// The path used last.
    last: Option<usize>,
}

impl Selector {
    pub fn new(policy: IoPolicy) -> Selector {
        Selector { policy, last: None }
    }

    pub fn policy(&self) -> IoPolicy {
        self.policy
    }

    pub fn set_policy(&mut self, policy: IoPolicy) {
        self.policy = policy;
    }

    /// The path the next I/O goes to, given the paths as they are now.
    pub fn choose(&mut self, paths: &[PathView]) -> Choice {
        let Some(best) = paths.iter().filter_map(PathView::tier).min() else {
            return if paths.iter().any(PathView::may_become_usable) {
                Choice::Hold
            } else {
                Choice::Fail
            };
        };
        let usable = |i: usize| paths[i].tier() == Some(best);
        let n = paths.len();
        // Candidates in turn, starting after the last one used.
        let start = self.last.map_or(0, |l| l + 1);
        let in_turn = (0..n).map(|k| (start + k) % n).filter(|&i| usable(i));
        let pick = match self.policy {
            IoPolicy::Failover => match self.last {
                Some(l) if l < n && usable(l) => Some(l),
                _ => (0..n).find(|&i| usable(i)),
            },
            IoPolicy::RoundRobin => {
                let mut turn = in_turn;
                turn.next()
            }
            // `min_by_key` keeps the first of equals: the next in turn.
            IoPolicy::QueueDepth => in_turn.min_by_key(|&i| paths[i].inflight),
        };
        match pick {
            Some(i) => {
                self.last = Some(i);
                Choice::Path(i)
            }
            // Unreachable: `best` came from a usable path.
            None => Choice::Hold,
        }
    }

    /// The path used last (an index into the slice last given).
    pub fn last(&self) -> Option<usize> {
        self.last
    }

    /// Carry on from path `last` of the slice given next: the caller's paths were
    /// renumbered since the last choice (one came or went).
    pub fn resume_from(&mut self, last: Option<usize>) {
        self.last = last;
    }
}

/// A group in ANA change for longer than ANATT is treated as inaccessible: the controller
/// did not finish its transition in the time it promised (Linux resets the controller then;
/// the caller reads the ANA log again).
pub fn effective_ana(state: AnaState, in_state_for: Duration, anatt: Duration) -> AnaState {
    if state == AnaState::Change && in_state_for > anatt {
        AnaState::Inaccessible
    } else {
        state
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ana() -> impl Strategy<Value = AnaState> {
        prop_oneof![
            Just(AnaState::Optimized),
            Just(AnaState::NonOptimized),
            Just(AnaState::Inaccessible),
            Just(AnaState::PersistentLoss),
            Just(AnaState::Change),
        ]
    }

    fn path() -> impl Strategy<Value = PathView> {
        (any::<bool>(), any::<bool>(), ana(), 0u32..8).prop_map(|(live, failed, ana, inflight)| {
            PathView {
                live,
                failed,
                ana,
                inflight,
            }
        })
    }

    fn policy() -> impl Strategy<Value = IoPolicy> {
        prop_oneof![
            Just(IoPolicy::Failover),
            Just(IoPolicy::RoundRobin),
            Just(IoPolicy::QueueDepth),
        ]
    }

    fn usable(p: &PathView) -> bool {
        p.live && !p.failed && p.ana.is_usable()
    }

    proptest! {
        /// Whatever came before, a choice is a live path in the best ANA state there is:
        /// never inaccessible, persistent loss or change, never non-optimized while an
        /// optimized path is usable; with none usable, held exactly while one may become
        /// usable.
        #[test]
        fn the_choice_is_a_usable_path_of_the_best_kind(
            policy in policy(),
            history in proptest::collection::vec(proptest::collection::vec(path(), 0..5), 1..6),
        ) {
            let mut s = Selector::new(policy);
            for paths in history {
                let any_opt = paths.iter().any(|p| usable(p) && p.ana == AnaState::Optimized);
                match s.choose(&paths) {
                    Choice::Path(i) => {
                        prop_assert!(usable(&paths[i]), "{:?}", paths[i]);
                        if any_opt {
                            prop_assert_eq!(paths[i].ana, AnaState::Optimized);
                        }
                    }
                    Choice::Hold => {
                        prop_assert!(!paths.iter().any(usable));
                        prop_assert!(paths
                            .iter()
                            .any(|p| !p.failed && p.ana != AnaState::PersistentLoss));
                    }
                    Choice::Fail => {
                        prop_assert!(paths
                            .iter()
                            .all(|p| p.failed || p.ana == AnaState::PersistentLoss));
                    }
                }
            }
        }

        /// `failover` stays on its path while that path stays usable and of the best kind.
        #[test]
        fn failover_sticks_to_its_path(paths in proptest::collection::vec(path(), 1..6), n in 1usize..10) {
            let mut s = Selector::new(IoPolicy::Failover);
            if let Choice::Path(first) = s.choose(&paths) {
                for _ in 0..n {
                    prop_assert_eq!(s.choose(&paths), Choice::Path(first));
                }
            }
        }

        /// `round-robin` visits each usable path of the best kind once per turn.
        #[test]
        fn round_robin_takes_every_best_path_in_turn(paths in proptest::collection::vec(path(), 1..6)) {
            let mut s = Selector::new(IoPolicy::RoundRobin);
            let best: Vec<usize> = {
                let opt: Vec<usize> = (0..paths.len())
                    .filter(|&i| usable(&paths[i]) && paths[i].ana == AnaState::Optimized)
                    .collect();
                if opt.is_empty() {
                    (0..paths.len()).filter(|&i| usable(&paths[i])).collect()
                } else {
                    opt
                }
            };
            let mut got: Vec<usize> = (0..best.len())
                .filter_map(|_| match s.choose(&paths) {
                    Choice::Path(i) => Some(i),
                    _ => None,
                })
                .collect();
            got.sort_unstable();
            prop_assert_eq!(got, best);
        }

        /// `queue-depth` takes a path with the fewest commands in flight among the best.
        #[test]
        fn queue_depth_takes_the_least_busy_best_path(paths in proptest::collection::vec(path(), 1..6)) {
            let mut s = Selector::new(IoPolicy::QueueDepth);
            if let Choice::Path(i) = s.choose(&paths) {
                let least = paths
                    .iter()
                    .filter(|p| usable(p) && p.ana == paths[i].ana)
                    .map(|p| p.inflight)
                    .min();
                prop_assert_eq!(Some(paths[i].inflight), least);
            }
        }
    }

    #[test]
    fn an_inaccessible_path_gets_no_io_and_a_non_optimized_one_only_alone() {
        let p = |live, ana| PathView {
            live,
            failed: false,
            ana,
            inflight: 0,
        };
        for policy in IoPolicy::ALL {
            let mut s = Selector::new(policy);
            let paths = [
                p(true, AnaState::Inaccessible),
                p(true, AnaState::NonOptimized),
            ];
            for _ in 0..4 {
                assert_eq!(s.choose(&paths), Choice::Path(1), "{policy}");
            }
            let paths = [
                p(true, AnaState::Inaccessible),
                p(true, AnaState::NonOptimized),
                p(true, AnaState::Optimized),
            ];
            for _ in 0..4 {
                assert_eq!(s.choose(&paths), Choice::Path(2), "{policy}");
            }
            // The optimized path is reconnecting: the non-optimized one carries the I/O.
            let paths = [
                p(true, AnaState::Inaccessible),
                p(true, AnaState::NonOptimized),
                p(false, AnaState::Optimized),
            ];
            assert_eq!(s.choose(&paths), Choice::Path(1), "{policy}");
            // Only inaccessible or changing: held, as the state may change.
            let paths = [p(true, AnaState::Inaccessible), p(true, AnaState::Change)];
            assert_eq!(s.choose(&paths), Choice::Hold, "{policy}");
            let paths = [p(true, AnaState::PersistentLoss)];
            assert_eq!(s.choose(&paths), Choice::Fail, "{policy}");
        }
    }

    #[test]
    fn failover_moves_when_its_path_goes_and_queue_depth_follows_the_load() {
        let p = |live, inflight| PathView {
            live,
            failed: false,
            ana: AnaState::Optimized,
            inflight,
        };
        let mut s = Selector::new(IoPolicy::Failover);
        assert_eq!(s.choose(&[p(true, 0), p(true, 0)]), Choice::Path(0));
        assert_eq!(s.choose(&[p(false, 0), p(true, 0)]), Choice::Path(1));
        // Back: it stays where it is (sticky).
        assert_eq!(s.choose(&[p(true, 0), p(true, 0)]), Choice::Path(1));
        let mut s = Selector::new(IoPolicy::QueueDepth);
        assert_eq!(s.choose(&[p(true, 3), p(true, 1)]), Choice::Path(1));
        assert_eq!(s.choose(&[p(true, 0), p(true, 1)]), Choice::Path(0));
        // Equal: they take turns.
        assert_eq!(s.choose(&[p(true, 0), p(true, 0)]), Choice::Path(1));
        assert_eq!(s.choose(&[p(true, 0), p(true, 0)]), Choice::Path(0));
        // Path 0 left: the one that was path 1 is the only one, and the last used.
        s.resume_from(None);
        assert_eq!(s.choose(&[p(true, 0)]), Choice::Path(0));
        assert_eq!(s.last(), Some(0));
    }

    #[test]
    fn a_change_longer_than_anatt_counts_as_inaccessible() {
        let anatt = Duration::from_secs(10);
        let ch = AnaState::Change;
        assert_eq!(effective_ana(ch, Duration::from_secs(10), anatt), ch);
        assert_eq!(
            effective_ana(ch, Duration::from_secs(11), anatt),
            AnaState::Inaccessible
        );
        let opt = AnaState::Optimized;
        assert_eq!(effective_ana(opt, Duration::from_secs(99), anatt), opt);
        assert_eq!("queue-depth".parse::<IoPolicy>(), Ok(IoPolicy::QueueDepth));
        assert!("numa".parse::<IoPolicy>().is_err());
    }
}

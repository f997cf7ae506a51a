//! One path of a subsystem: a controller (through one host device to one target port), its
//! ANA view, and its counters (what `list` and the metrics show, as nvme-cli's `nvme top`).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::time::Instant;

use crate::nvme::ana::AnaState;
use crate::reconnect::CtrlState;
use crate::transport::{Controller, HostError, NsInfo};

use super::ana::{read_ctrl_ana, read_group_states, read_ns_group, CtrlAna};
use super::selector::{effective_ana, PathView};

/// A path's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PathStats {
    /// Commands sent on it.
    pub ios: u64,
    /// Commands that left it for another path (its connection failed under them, or it
    /// answered with a path status).
    pub failovers: u64,
    /// Its controller's completed recoveries.
    pub reconnects: u64,
    /// Commands in flight on it now.
    pub inflight: u32,
}

/// What is known about ANA through the path; bounded by the log's size and the
/// controller's namespace list.
#[derive(Debug, Default)]
struct PathAna {
    ctrl: CtrlAna,
    /// Group, state, since when in that state.
    groups: Vec<(u32, AnaState, Instant)>,
    /// Namespace, its group.
    ns_groups: Vec<(u32, u32)>,
}

pub struct Path {
    /// Unique within its subsystem, never reused.
    pub id: u64,
    pub ctrl: Arc<Controller>,
    /// The target port's address, as the user gave it.
    pub address: String,
    /// The host device it runs on.
    pub device: String,
    ana: Mutex<PathAna>,
    ios: AtomicU64,
    failovers: AtomicU64,
    inflight: AtomicU32,
    m_ios: metrics::Counter,
    m_failovers: metrics::Counter,
}

/// A command in flight on a path, counted until dropped.
pub(super) struct InFlight<'a>(&'a Path);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Ordering::Relaxed);
    }
}

impl std::fmt::Debug for Path {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Path")
            .field("id", &self.id)
            .field("address", &self.address)
            .field("device", &self.device)
            .field("stats", &self.stats())
            .finish()
    }
}

impl Path {
    pub(super) fn new(id: u64, ctrl: Arc<Controller>, address: String, device: String) -> Path {
        let labels = [
            ("subsys", ctrl.opts.subnqn.clone()),
            ("path", address.clone()),
        ];
        Path {
            id,
            m_ios: metrics::counter!("nvmf_mp_path_io_total", &labels),
            m_failovers: metrics::counter!("nvmf_mp_path_failovers_total", &labels),
            ctrl,
            address,
            device,
            ana: Mutex::new(PathAna::default()),
            ios: AtomicU64::new(0),
            failovers: AtomicU64::new(0),
            inflight: AtomicU32::new(0),
        }
    }

    fn ana(&self) -> std::sync::MutexGuard<'_, PathAna> {
        self.ana.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Read the ANA state through this path again: whether the controller reports it, each
    /// group's state, each namespace's group. A controller that does not report ANA has
    /// every namespace optimized.
    pub async fn refresh_ana(&self) -> Result<(), HostError> {
        let ctrl = read_ctrl_ana(&self.ctrl).await?;
        let (groups, ns_groups) = if ctrl.reports {
            let groups = read_group_states(&self.ctrl).await?;
            let mut ns_groups = Vec::new();
            for ns in self.ctrl.namespaces() {
                ns_groups.push((ns.nsid, read_ns_group(&self.ctrl, ns.nsid).await?));
            }
            (groups, ns_groups)
        } else {
            (Vec::new(), Vec::new())
        };
        let now = Instant::now();
        let mut a = self.ana();
        let since = |grp: u32, st: AnaState| {
            a.groups
                .iter()
                .find(|g| g.0 == grp && g.1 == st)
                .map_or(now, |g| g.2)
        };
        let groups = groups
            .into_iter()
            .map(|(g, st)| (g, st, since(g, st)))
            .collect();
        *a = PathAna {
            ctrl,
            groups,
            ns_groups,
        };
        Ok(())
    }

    /// The ANA state of namespace `nsid` through this path at `now` (a change longer than
    /// ANATT counts as inaccessible). Optimized when the controller does not report ANA or
    /// does not list the namespace's group.
    pub fn ana_state(&self, nsid: u32, now: Instant) -> AnaState {
        let a = self.ana();
        if !a.ctrl.reports {
            return AnaState::Optimized;
        }
        let Some(&(_, grp)) = a.ns_groups.iter().find(|n| n.0 == nsid) else {
            return AnaState::Optimized;
        };
        match a.groups.iter().find(|g| g.0 == grp) {
            Some(&(_, st, since)) => effective_ana(st, now.duration_since(since), a.ctrl.anatt),
            None => AnaState::Optimized,
        }
    }

    /// When a group of namespace `nsid` in change would count as inaccessible, if it is in
    /// change.
    pub(super) fn change_deadline(&self, nsid: u32) -> Option<Instant> {
        let a = self.ana();
        let &(_, grp) = a.ns_groups.iter().find(|n| n.0 == nsid)?;
        a.groups
            .iter()
            .find(|g| g.0 == grp && g.1 == AnaState::Change)
            .map(|g| g.2 + a.ctrl.anatt)
    }

    /// The path as the selector sees it for namespace `ns`.
    pub(super) fn view(&self, ns: &NsInfo, now: Instant) -> PathView {
        let st = self.ctrl.status();
        PathView {
            live: st.state() == CtrlState::Live,
            failed: st.state() == CtrlState::Dead
                || st.machine.failfast
                || self.ctrl.same_namespace(ns).is_err(),
            ana: self.ana_state(ns.nsid, now),
            inflight: self.inflight.load(Ordering::Relaxed),
        }
    }

    pub(super) fn begin(&self) -> InFlight<'_> {
        self.inflight.fetch_add(1, Ordering::Relaxed);
        self.ios.fetch_add(1, Ordering::Relaxed);
        self.m_ios.increment(1);
        InFlight(self)
    }

    pub(super) fn failed_over(&self) {
        self.failovers.fetch_add(1, Ordering::Relaxed);
        self.m_failovers.increment(1);
    }

    pub fn stats(&self) -> PathStats {
        PathStats {
            ios: self.ios.load(Ordering::Relaxed),
            failovers: self.failovers.load(Ordering::Relaxed),
            reconnects: self.ctrl.status().machine.recoveries,
            inflight: self.inflight.load(Ordering::Relaxed),
        }
    }
}

//! A subsystem as the host sees it: the paths (controllers) to one subsystem NQN, through
//! different host devices or target ports, the I/O policy, and the held-I/O bound. Its
//! namespaces ([`MpNamespace`](super::MpNamespace)) send each command on a path chosen by the policy.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};

use tokio::sync::watch;

use crate::reconnect::CtrlState;
use crate::transport::{AsyncEvent, Controller, HostError, NsInfo};

use super::path::{Path, PathStats};
use super::selector::IoPolicy;

/// Commands a subsystem holds at most while no path is usable (Linux's `queue_if_no_path`
/// holds them in the block layer's queue, bounded by its tags); past it, a command fails at
/// once.
pub const DEFAULT_MAX_HELD: usize = 4096;

/// Why a path may not join.
#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    #[error("the controller belongs to subsystem {got}, not {want}: connect it as a subsystem of its own")]
    OtherSubsystem { want: String, got: String },
    #[error("namespace {nsid} through the new path is a different namespace (another NGUID, EUI-64 or UUID) than through the subsystem's other paths: the target's ports disagree; fix the target or connect the path as a separate subsystem")]
    OtherNamespace { nsid: u32 },
    #[error("the controller is already a path of this subsystem")]
    Duplicate,
}

/// A path as `list` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathInfo {
    pub id: u64,
    pub address: String,
    pub device: String,
    pub state: CtrlState,
    /// ANA state of each namespace through the path.
    pub ana: Vec<(u32, crate::nvme::ana::AnaState)>,
    pub stats: PathStats,
}

pub struct Subsystem {
    pub nqn: String,
    paths: RwLock<Vec<Arc<Path>>>,
    next_id: AtomicU64,
    policy: Mutex<IoPolicy>,
    /// Counts changes any path's state went through (status, ANA, joins, leaves): held
    /// commands look again at each.
    changed: watch::Sender<u64>,
    held: AtomicUsize,
    max_held: usize,
    watchers: Mutex<Vec<(u64, tokio::task::JoinHandle<()>)>>,
}

/// A held command, counted until dropped.
pub(super) struct Held<'a>(&'a Subsystem);

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.0.held.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Subsystem {
    pub fn new(nqn: &str, policy: IoPolicy) -> Arc<Subsystem> {
        Self::with_max_held(nqn, policy, DEFAULT_MAX_HELD)
    }

    pub fn with_max_held(nqn: &str, policy: IoPolicy, max_held: usize) -> Arc<Subsystem> {
        Arc::new(Subsystem {
            nqn: nqn.to_string(),
            paths: RwLock::new(Vec::new()),
            next_id: AtomicU64::new(1),
            policy: Mutex::new(policy),
            changed: watch::channel(0).0,
            held: AtomicUsize::new(0),
            max_held,
            watchers: Mutex::new(Vec::new()),
        })
    }

    /// A subsystem of one path, with the default policy: what a single controller's export
    /// runs on. Its ANA state is not read (one path has no other to prefer).
    pub fn single(ctrl: Arc<Controller>) -> Arc<Subsystem> {
        let sub = Self::new(&ctrl.opts.subnqn, IoPolicy::default());
        let id = sub.next_id.fetch_add(1, Ordering::Relaxed);
        let path = Arc::new(Path::new(id, ctrl, String::new(), String::new()));
        sub.paths_mut().push(path);
        sub
    }

    pub fn policy(&self) -> IoPolicy {
        *self.policy.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn set_policy(&self, p: IoPolicy) {
        *self.policy.lock().unwrap_or_else(|e| e.into_inner()) = p;
        self.bump();
    }

    pub fn paths(&self) -> Vec<Arc<Path>> {
        self.paths.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn paths_mut(&self) -> std::sync::RwLockWriteGuard<'_, Vec<Arc<Path>>> {
        self.paths.write().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn bump(&self) {
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
    }

    pub(super) fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// Count one more held command, unless the bound is reached.
    pub(super) fn hold(&self) -> Result<Held<'_>, HostError> {
        let n = self.held.fetch_add(1, Ordering::Relaxed);
        if n >= self.max_held {
            self.held.fetch_sub(1, Ordering::Relaxed);
            return Err(HostError::Transport(format!(
                "no path to {} is usable and {} commands already wait for one: retry once a path is back",
                self.nqn, self.max_held
            )));
        }
        Ok(Held(self))
    }

    /// Commands held now, waiting for a usable path.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    /// Add `ctrl` as a path (as `nvme connect` to another portal of a connected subsystem):
    /// its subsystem NQN must be this one, and each of its namespaces that shares an NSID
    /// with a namespace of the other paths must be the same namespace (NGUID, EUI-64, UUID).
    /// Its ANA state is read now, and again after each of its reconnects.
    pub async fn add_path(
        self: &Arc<Self>,
        ctrl: Arc<Controller>,
        address: String,
        device: String,
    ) -> Result<Arc<Path>, anyhow::Error> {
        if ctrl.opts.subnqn != self.nqn {
            return Err(JoinError::OtherSubsystem {
                want: self.nqn.clone(),
                got: ctrl.opts.subnqn.clone(),
            }
            .into());
        }
        let others = self.paths();
        if others.iter().any(|p| Arc::ptr_eq(&p.ctrl, &ctrl)) {
            return Err(JoinError::Duplicate.into());
        }
        if let Some(nsid) = conflicting_namespace(&ctrl.namespaces(), &others) {
            return Err(JoinError::OtherNamespace { nsid }.into());
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let path = Arc::new(Path::new(id, ctrl, address, device));
        path.refresh_ana().await?;
        let watcher = tokio::spawn(watch_path(Arc::downgrade(self), path.clone()));
        self.watchers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((id, watcher));
        self.paths_mut().push(path.clone());
        self.tell_paths();
        self.bump();
        Ok(path)
    }

    /// Take path `id` out (its controller is the caller's to disconnect); commands in flight
    /// on it finish there. Returns it, if it was a path.
    pub fn remove_path(&self, id: u64) -> Option<Arc<Path>> {
        let path = {
            let mut ps = self.paths_mut();
            let i = ps.iter().position(|p| p.id == id)?;
            ps.remove(i)
        };
        self.watchers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|(pid, t)| {
                if *pid == id {
                    t.abort();
                }
                *pid != id
            });
        path.ctrl.set_other_paths(false);
        self.tell_paths();
        self.bump();
        Some(path)
    }

    /// Tell each path's controller whether another path can carry its I/O: with two or more,
    /// a path that loses its connection gives its held I/O back at once, reads to go to a
    /// live path now and writes once the failed controller's commands are known dead
    /// (`old_commands_dead`), instead of waiting for its reconnect.
    fn tell_paths(&self) {
        let paths = self.paths();
        let on = paths.len() >= 2;
        for p in &paths {
            p.ctrl.set_other_paths(on);
        }
    }

    /// Tell the subsystem of an Asynchronous Event a path's controller reported: an ANA
    /// change makes the path's ANA state read again.
    pub async fn handle_async_event(&self, path: &Path, ev: AsyncEvent) {
        if crate::nvme::ana::aen_reports_ana_change(ev.to_result()) {
            refresh(self, path).await;
        }
    }

    /// Every path as `list` shows it.
    pub fn info(&self) -> Vec<PathInfo> {
        let now = tokio::time::Instant::now();
        self.paths()
            .iter()
            .map(|p| PathInfo {
                id: p.id,
                address: p.address.clone(),
                device: p.device.clone(),
                state: p.ctrl.state(),
                ana: p
                    .ctrl
                    .namespaces()
                    .iter()
                    .map(|n| (n.nsid, p.ana_state(n.nsid, now)))
                    .collect(),
                stats: p.stats(),
            })
            .collect()
    }
}

impl Drop for Subsystem {
    fn drop(&mut self) {
        for (_, t) in self.watchers.get_mut().unwrap_or_else(|e| e.into_inner()) {
            t.abort();
        }
    }
}

/// The first NSID `new` shares with a namespace of `paths` that has another identity.
fn conflicting_namespace(new: &[NsInfo], paths: &[Arc<Path>]) -> Option<u32> {
    new.iter()
        .find(|n| {
            paths
                .iter()
                .any(|p| p.ctrl.namespace(n.nsid).is_ok_and(|o| o.ident != n.ident))
        })
        .map(|n| n.nsid)
}

/// Read a path's ANA state again; held commands look again whatever came of it.
pub(super) async fn refresh(sub: &Subsystem, path: &Path) {
    if let Err(e) = path.refresh_ana().await {
        tracing::warn!(subnqn = %sub.nqn, path = %path.address, error = %e,
            "reading the ANA state failed; kept the previous one until the next change");
    }
    sub.bump();
}

/// Follow a path's controller: each state change wakes held commands, and after each
/// reconnect its ANA state is read again (it may have changed while the path was down).
/// Ends with the controller or the subsystem.
/// How often a path whose ANA state keeps some namespace from it reads the state again. The
/// change notice is the usual way back, but it reaches the host only where something keeps an
/// Asynchronous Event Request outstanding (the daemon does; an embedding application or the
/// fio plugin may not), so a path is never left unused for good.
const ANA_POLL: std::time::Duration = std::time::Duration::from_secs(1);

async fn watch_path(sub: Weak<Subsystem>, path: Arc<Path>) {
    let mut rx = path.ctrl.watch_status();
    let mut seen = rx.borrow().machine.recoveries;
    loop {
        tokio::select! {
            r = rx.changed() => {
                if r.is_err() {
                    return;
                }
                let s = *rx.borrow();
                let Some(sub) = sub.upgrade() else { return };
                if s.state() == CtrlState::Live && s.machine.recoveries > seen {
                    seen = s.machine.recoveries;
                    refresh(&sub, &path).await;
                } else {
                    sub.bump();
                }
            }
            _ = tokio::time::sleep(ANA_POLL) => {
                let Some(sub) = sub.upgrade() else { return };
                let now = tokio::time::Instant::now();
                let shut_out = path
                    .ctrl
                    .namespaces()
                    .iter()
                    .any(|n| !path.ana_state(n.nsid, now).is_usable());
                if shut_out && path.ctrl.state() == CtrlState::Live {
                    refresh(&sub, &path).await;
                }
            }
        }
    }
}

//! The daemon's registry: the controllers it owns, their exports and the names they go by,
//! the in-use check that guards a disconnect, and the requests of the control protocol
//! decoded into calls ([`Daemon::handle`]). A front end (the `nvmf-rdma daemon` process, a
//! test, an embedding application) makes one with [`Daemon::new`] and serves it
//! ([`Daemon::serve`]) or calls it.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};

use crate::cli::args::Subsys;
use crate::cli::device::{self, DeviceChoice};
use crate::cli::host::{ctrl_info, device_config, HOST_HCA};
use crate::cli::support::{host_bind_addr, roce_peer};
use crate::daemon::config::ConfigLine;
use crate::daemon::exports::Exports;
use crate::daemon::proto::{
    ConnectParams, ControllerInfo, ErrorCode, ExportInfo, PathDetail, ProtoError,
};
use crate::daemon::usage::{holders, in_use_message, Probe};
use crate::daemon::{say, Report};
use crate::driver::DeviceManager;
use crate::export::DevSet;
use crate::multipath::Subsystem;
use crate::reconnect::CtrlState;
use crate::transport::Controller;

/// Identity of a connection for duplicate checks: subsystem, target, service, host NQN.
pub(super) type Key = (String, String, u16, String);

/// Tasks by line key, one each.
pub(super) type KeyedTasks = Mutex<HashMap<Key, tokio::task::JoinHandle<()>>>;

/// One controller the daemon owns.
pub(super) struct Entry {
    pub(super) name: String,
    pub(super) key: Key,
    pub(super) sub: Subsys,
    pub(super) ctrl: Arc<Controller>,
    /// The subsystem it is a path of (with the daemon's other controllers to the same
    /// subsystem NQN and host NQN), and its path's id there.
    pub(super) mp: Arc<Subsystem>,
    pub(super) path: u64,
    pub(super) exports: Exports,
    pub(super) tasks: Vec<tokio::task::JoinHandle<()>>,
    /// Held (read) by each I/O request on the controller; a disconnect takes it (write).
    pub(super) io_gate: Arc<tokio::sync::RwLock<()>>,
    /// The soft-HCA it runs on (none on a kernel device).
    pub(super) device: Option<HostDevice>,
}

/// The soft-HCA a controller runs on: one of its own (loopback, on a free port) goes with
/// the controller; a shared one (a fixed port, towards RoCEv2 peers) stays for the others.
pub(super) struct HostDevice {
    mgr: DeviceManager,
    own: bool,
}

impl HostDevice {
    /// Let the device go: one of our own stops and frees its UDP socket and memory.
    pub(super) async fn release(self) {
        if self.own {
            if let Some((hca, _)) = self.mgr.open(HOST_HCA) {
                crate::driver::CmService::for_device(&hca)
                    .settle_disconnects(Duration::from_secs(1))
                    .await;
            }
            let _ = self.mgr.unplug(HOST_HCA).await;
        }
    }
}

impl Entry {
    pub(super) fn info(&self) -> ControllerInfo {
        let c = ctrl_info(&self.name, &self.sub, &self.ctrl);
        let mut info: ControllerInfo = serde_json::from_str(&c.to_json()).unwrap_or_default();
        info.address = Some(self.sub.fabric.traddr.to_string());
        info.exports = exports_info(&self.exports);
        info.iopolicy = Some(self.mp.policy().name().to_string());
        info.path = self
            .mp
            .info()
            .into_iter()
            .find(|p| p.id == self.path)
            .map(|p| PathDetail {
                device: p.device,
                ana_state: p
                    .ana
                    .iter()
                    .map(|(nsid, st)| (*nsid, st.name().to_string()))
                    .collect(),
                ios: p.stats.ios,
                inflight: p.stats.inflight,
                failovers: p.stats.failovers,
                reconnects: p.stats.reconnects,
            });
        info
    }

    pub(super) async fn stop(self) {
        // Aborted and awaited: a task's hold on the controller is gone before it is deleted.
        for t in self.tasks {
            t.abort();
            let _ = t.await;
        }
        // `read`/`write`/`verify` requests in flight end first (each holds the gate).
        let _gate = self.io_gate.write().await;
        self.mp.remove_path(self.path);
        // Only a forced disconnect (or an unexpected busy mount) gets here with a user left:
        // the export is fenced and the controller deleted, whoever still holds them, so the
        // controller's own soft-HCA can go with it: nothing waits on it any more.
        self.exports.release(&self.ctrl, true).await;
        if let Some(d) = self.device {
            d.release().await;
        }
    }
}

fn exports_info(x: &Exports) -> Vec<ExportInfo> {
    let mut v = Vec::new();
    if let Some((a, stats)) = &x.nbd_at {
        v.push(ExportInfo::Nbd {
            nsid: x.nsid,
            address: a.to_string(),
            uri: a.uri(),
            names: x.set.as_ref().map(DevSet::names).unwrap_or_default(),
            clients: stats.connections.load(Ordering::SeqCst),
        });
    }
    if let Some(m) = &x.fuse {
        let files = m.files().names();
        v.push(ExportInfo::Fuse {
            nsid: x.nsid,
            mountpoint: m.mountpoint().display().to_string(),
            file: m.file().display().to_string(),
            files: files
                .iter()
                .map(|n| m.mountpoint().join(n).display().to_string())
                .collect(),
            open_handles: m.open_files(),
        });
    }
    v
}

#[derive(Default)]
pub(super) struct Inner {
    pub(super) ctrls: BTreeMap<u32, Entry>,
    /// Names being connected, with their key, exports' paths.
    pub(super) reserved: BTreeMap<u32, (Key, Vec<String>)>,
}

/// A `stop` request handed to the serving loop, and where its answer goes.
pub(super) type StopAsk = (bool, tokio::sync::oneshot::Sender<Result<(), ProtoError>>);

/// Where and how a daemon runs.
#[derive(Clone)]
pub struct DaemonConfig {
    /// Its socket, and `connect --foreground` processes' sockets, live here.
    pub run_dir: PathBuf,
    /// Where `discovery.conf` is.
    pub config_dir: PathBuf,
    /// Time a client has to send each complete request line.
    pub client_timeout: Duration,
    /// Where its log lines and service status go.
    pub report: Report,
}

pub(super) struct State {
    pub(super) cfg: DaemonConfig,
    pub(super) inner: Mutex<Inner>,
    /// Soft-HCAs bound to a fixed port (towards RoCEv2 peers), shared by their controllers.
    managers: tokio::sync::Mutex<HashMap<SocketAddr, DeviceManager>>,
    pub(super) stopping: AtomicBool,
    /// Discovery controllers watched for log changes, by address, service and host NQN.
    pub(super) watchers: KeyedTasks,
    /// Where a watcher sends a discovery line whose log changed (connect-all runs it).
    pub(super) rescan: tokio::sync::mpsc::Sender<ConnectParams>,
    /// Configured lines that failed, each tried again until it connects; by line key.
    pub(super) retries: KeyedTasks,
    pub(super) stop_req: tokio::sync::mpsc::Sender<StopAsk>,
    /// The config file's lines as last read, to tell what a reload adds and drops.
    pub(super) configured: Mutex<Vec<ConfigLine>>,
    /// Subsystems by subsystem NQN and host NQN: a connect to another portal of one adds a
    /// path to it.
    subsystems: Mutex<HashMap<(String, String), std::sync::Weak<Subsystem>>>,
}

impl State {
    /// A registry with no controller, the receiver of its `stop` requests and the receiver
    /// of the discovery lines whose log changed.
    pub(super) fn new(
        cfg: DaemonConfig,
    ) -> (
        State,
        tokio::sync::mpsc::Receiver<StopAsk>,
        tokio::sync::mpsc::Receiver<ConnectParams>,
    ) {
        let (stop_tx, stop_rx) = tokio::sync::mpsc::channel(4);
        // Bounded: a watcher that finds it full drops its request; one queued covers it.
        let (rescan_tx, rescan_rx) = tokio::sync::mpsc::channel(16);
        let st = State {
            cfg,
            inner: Mutex::new(Inner::default()),
            managers: tokio::sync::Mutex::new(HashMap::new()),
            stopping: AtomicBool::new(false),
            watchers: Mutex::new(HashMap::new()),
            rescan: rescan_tx,
            retries: Mutex::new(HashMap::new()),
            stop_req: stop_tx,
            configured: Mutex::new(Vec::new()),
            subsystems: Mutex::new(HashMap::new()),
        };
        (st, stop_rx, rescan_rx)
    }
}

impl State {
    /// The subsystem `nqn` as host `hostnqn` sees it: the one its other controllers are
    /// paths of, or a new one with `policy` (failover when none is given). A policy given
    /// for a subsystem that exists changes it.
    pub(super) fn subsystem(
        &self,
        nqn: &str,
        hostnqn: &str,
        policy: Option<crate::multipath::IoPolicy>,
    ) -> Arc<Subsystem> {
        let mut subs = self.subsystems.lock().unwrap_or_else(|e| e.into_inner());
        subs.retain(|_, s| s.strong_count() > 0);
        let key = (nqn.to_string(), hostnqn.to_string());
        if let Some(s) = subs.get(&key).and_then(std::sync::Weak::upgrade) {
            if let Some(p) = policy {
                s.set_policy(p);
            }
            return s;
        }
        let s = Subsystem::new(nqn, policy.unwrap_or_default());
        subs.insert(key, Arc::downgrade(&s));
        s
    }
}

pub(super) fn lock(m: &Mutex<Inner>) -> std::sync::MutexGuard<'_, Inner> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

pub(super) fn failed(e: impl std::fmt::Display) -> ProtoError {
    ProtoError::new(ErrorCode::Failed, e.to_string())
}

impl State {
    /// Export paths a request would use (a FUSE mount point, an NBD socket), for clash checks.
    pub(super) fn export_paths(p: &ConnectParams) -> Vec<String> {
        p.fuse.iter().chain(p.nbd.iter()).cloned().collect()
    }

    /// Pick the lowest free name (not ours, not a `connect --foreground` socket that
    /// answers) and reserve it, unless `key` duplicates a controller and `dup` is not set, or
    /// an export path is another controller's.
    pub(super) async fn reserve(
        &self,
        key: &Key,
        paths: Vec<String>,
        dup: bool,
    ) -> Result<u32, ProtoError> {
        let mut n = 0u32;
        loop {
            let foreign = {
                let inner = lock(&self.inner);
                if !dup {
                    let held = inner.ctrls.values().find(|e| &e.key == key);
                    let pending = inner.reserved.values().any(|(k, _)| k == key);
                    let already = |who: &str| {
                        format!(
                            "already connected to {} at {} (trsvcid {}) as {who}",
                            key.0, key.1, key.2
                        )
                    };
                    if let Some(e) = held.filter(|e| e.ctrl.state() == CtrlState::Dead) {
                        // Gave up (ctrl_loss_tmo) and kept while its export is in use.
                        return Err(ProtoError::new(
                            ErrorCode::Duplicate,
                            format!(
                                "{}, which is dead (it gave up reconnecting) and kept while its export is in use",
                                already(&e.name)
                            ),
                        )
                        .hint(format!(
                            "release its export (it goes then) or `nvmf-rdma disconnect -d {} --force`, then connect again",
                            e.name
                        )));
                    }
                    if held.is_some() || pending {
                        let who = held.map_or("a controller being connected", |e| &e.name);
                        return Err(ProtoError::new(ErrorCode::Duplicate, already(who))
                            .hint("pass -D (--duplicate-connect) for another controller"));
                    }
                }
                let used: Vec<String> = inner
                    .ctrls
                    .values()
                    .flat_map(|e| e.exports.paths())
                    .chain(inner.reserved.values().flat_map(|(_, p)| p.iter().cloned()))
                    .collect();
                if let Some(p) = paths.iter().find(|p| used.contains(p)) {
                    return Err(ProtoError::new(
                        ErrorCode::Failed,
                        format!("{p} is already an export of another controller"),
                    )
                    .hint("pick another mount point or socket"));
                }
                while inner.ctrls.contains_key(&n) || inner.reserved.contains_key(&n) {
                    n += 1;
                }
                self.cfg.run_dir.join(format!("nvmf{n}.sock"))
            };
            // A `connect --foreground` holding this name answers on its socket.
            if foreign.exists() && tokio::net::UnixStream::connect(&foreign).await.is_ok() {
                n += 1;
                continue;
            }
            let mut inner = lock(&self.inner);
            if inner.ctrls.contains_key(&n) || inner.reserved.contains_key(&n) {
                continue;
            }
            inner.reserved.insert(n, (key.clone(), paths));
            return Ok(n);
        }
    }

    /// The device a controller towards `target` runs on: a shared one on a fixed port, or a
    /// new one on a free port (loopback).
    async fn device(&self, s: &Subsys) -> anyhow::Result<HostDevice> {
        let target = s.fabric.traddr;
        let addr = host_bind_addr(target, s.fabric.host_traddr)
            .context("no route to the target address")?;
        let mut mgrs = self.managers.lock().await;
        let own = addr.port() == 0;
        if let Some(m) = mgrs.get(&addr).filter(|_| !own) {
            return Ok(HostDevice {
                mgr: m.clone(),
                own,
            });
        }
        let mgr = DeviceManager::new(!roce_peer(target.ip()));
        mgr.plug(device_config(HOST_HCA, addr, 1))
            .await
            .with_context(|| format!("cannot start the host soft-HCA on {addr}"))?;
        if !own {
            mgrs.insert(addr, mgr.clone());
        }
        Ok(HostDevice { mgr, own })
    }

    /// A controller as `sub` asks, on its soft-HCA (handed back with it) or a kernel
    /// device. A failed connect lets its device go.
    pub(super) async fn connect_on_device(
        &self,
        sub: &Subsys,
        o: crate::transport::ConnectOptions,
    ) -> anyhow::Result<(Controller, Option<HostDevice>)> {
        match &sub.fabric.device {
            DeviceChoice::Soft => {
                let d = self.device(sub).await?;
                match Controller::connect_managed(d.mgr.clone(), HOST_HCA, o).await {
                    Ok(c) => Ok((c, Some(d))),
                    Err(e) => {
                        d.release().await;
                        Err(e.into())
                    }
                }
            }
            DeviceChoice::Kernel(sel) => Ok((device::connect_kernel(sel, o).await?, None)),
        }
    }
}

impl State {
    /// The controller named `name`, for a request that does I/O on it, with its gate held
    /// (a disconnect waits for the I/O to end).
    pub(super) async fn controller(
        &self,
        name: &str,
    ) -> Result<(Arc<Controller>, tokio::sync::OwnedRwLockReadGuard<()>), ProtoError> {
        let find = || {
            lock(&self.inner)
                .ctrls
                .values()
                .find(|e| e.name == name)
                .map(|e| (e.ctrl.clone(), e.io_gate.clone()))
        };
        // Only the gate is kept across the wait (a controller clone would make a disconnect
        // that goes ahead meanwhile unable to take the controller).
        let gate = find().map(|(_, g)| g);
        if let Some(gate) = gate {
            // The gate first, then the controller: a disconnect that went ahead meanwhile
            // has taken the entry out (not found), and one that comes later waits for us.
            let guard = gate.clone().read_owned().await;
            if let Some((c, g)) = find() {
                if Arc::ptr_eq(&g, &gate) {
                    return Ok((c, guard));
                }
            }
        }
        Err({
            let e = ProtoError::new(ErrorCode::NotFound, format!("no controller {name}"));
            if self.cfg.run_dir.join(format!("{name}.sock")).exists() {
                e.hint(format!(
                    "{name} is held by `connect --foreground`: -d works on the daemon's controllers; give that process's -a/-n instead"
                ))
            } else {
                e.hint("`nvmf-rdma list` shows them")
            }
        })
    }

    /// Run `task` as the one task of `key` in `tasks`, unless one runs or the daemon stops.
    pub(super) fn spawn_once(
        &self,
        tasks: &KeyedTasks,
        key: Key,
        task: impl std::future::Future<Output = ()> + Send + 'static,
    ) {
        let mut t = tasks.lock().unwrap_or_else(|e| e.into_inner());
        if t.get(&key).is_some_and(|t| !t.is_finished()) || self.stopping.load(Ordering::SeqCst) {
            return;
        }
        t.insert(key, tokio::spawn(task));
    }
}

/// Abort every task of `tasks` and wait for each to end.
pub(super) async fn abort_all(tasks: &KeyedTasks) {
    let tasks: Vec<_> = tasks
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .drain()
        .map(|(_, t)| t)
        .collect();
    for t in tasks {
        t.abort();
        let _ = t.await;
    }
}

/// A configured line's identity: subsystem, address, service, host NQN as it gives them.
pub(super) fn line_key(p: &ConnectParams) -> Key {
    (
        p.nqn.clone(),
        p.traddr.clone(),
        p.trsvcid.unwrap_or(4420),
        p.hostnqn.clone().unwrap_or_default(),
    )
}

impl Exports {
    /// The mount point and socket this controller's exports use, as requests name them.
    pub(super) fn paths(&self) -> Vec<String> {
        let mut v = Vec::new();
        if let Some(m) = &self.fuse {
            v.push(m.mountpoint().display().to_string());
        }
        if let Some((a, _)) = &self.nbd_at {
            v.push(a.to_string());
        }
        v
    }
}

/// Stop and disconnect the controllers `pick` selects, unless an export is in use and not
/// `force`: then nothing is disconnected and the error names every holder.
pub(super) async fn op_disconnect(
    st: &Arc<State>,
    pick: impl Fn(&Entry) -> bool,
    force: bool,
    what: &str,
) -> Result<Vec<String>, ProtoError> {
    let picked: Vec<u32> = lock(&st.inner)
        .ctrls
        .iter()
        .filter(|(_, e)| pick(e))
        .map(|(n, _)| *n)
        .collect();
    hand_over_exports(st, &picked);
    if picked.is_empty() && !what.is_empty() {
        return Err(
            ProtoError::new(ErrorCode::NotFound, format!("no controller matches {what}"))
                .hint("`nvmf-rdma list` shows the controllers"),
        );
    }
    if !force {
        check_not_in_use(st, &picked).await?;
    } else if let Err(e) = check_not_in_use(st, &picked).await {
        // Forced: the users are told in the log (and systemd's status), not left to find
        // out from I/O errors.
        let msg = format!(
            "forced while in use: {}; its users get I/O errors from now on",
            e.message
        );
        say!(st.cfg.report, "{msg}");
        st.cfg.report.notify(&format!("STATUS={msg}"));
    }
    let entries: Vec<Entry> = {
        let mut inner = lock(&st.inner);
        picked
            .iter()
            .filter_map(|n| inner.ctrls.remove(n))
            .collect()
    };
    let mut names = Vec::new();
    for e in entries {
        names.push(e.name.clone());
        say!(
            st.cfg.report,
            "{}: disconnecting{}",
            e.name,
            if force { " (forced)" } else { "" }
        );
        e.stop().await;
        say!(
            st.cfg.report,
            "{}: disconnected",
            names.last().map_or("", |s| s)
        );
    }
    Ok(names)
}

/// Exports of a controller about to be disconnected go on over another path of its
/// subsystem (one that stays and has none of its own), as a namespace of Linux's native
/// multipath outlives any one of its controllers.
fn hand_over_exports(st: &State, picked: &[u32]) {
    let mut inner = lock(&st.inner);
    for n in picked {
        let Some(e) = inner.ctrls.get(n) else {
            continue;
        };
        if e.exports.is_empty() {
            continue;
        }
        let mp = e.mp.clone();
        let heir = inner
            .ctrls
            .iter()
            .find(|(m, o)| {
                !picked.contains(m)
                    && Arc::ptr_eq(&o.mp, &mp)
                    && o.exports.is_empty()
                    && o.ctrl.state() != CtrlState::Dead
            })
            .map(|(m, _)| *m);
        let Some(heir) = heir else { continue };
        let Some(e) = inner.ctrls.get_mut(n) else {
            continue;
        };
        let nsid = e.exports.nsid;
        let x = std::mem::replace(&mut e.exports, Exports::none(nsid));
        let from = e.name.clone();
        if let Some(h) = inner.ctrls.get_mut(&heir) {
            say!(
                st.cfg.report,
                "{from}: its exports go on through {} (another path of {})",
                h.name,
                mp.nqn
            );
            h.exports = x;
        }
    }
}

/// Holders of the exports of `picked`, as an `in-use` error.
async fn check_not_in_use(st: &Arc<State>, picked: &[u32]) -> Result<(), ProtoError> {
    let probes: Vec<(u32, Probe)> = {
        let inner = lock(&st.inner);
        picked
            .iter()
            .filter_map(|n| inner.ctrls.get(n).map(|e| (*n, e.exports.probe())))
            .collect()
    };
    let mut msgs = Vec::new();
    let mut hints = Vec::new();
    for (n, p) in probes {
        let h = holders(&p).await;
        if !h.is_empty() {
            let (m, r) = in_use_message(&format!("nvmf{n}"), &h);
            msgs.push(m);
            hints.push(r);
        }
    }
    if msgs.is_empty() {
        return Ok(());
    }
    Err(ProtoError::new(ErrorCode::InUse, msgs.join("; "))
        .hint(format!("{}; or disconnect --force", hints.join("; "))))
}

//! `nvmf-rdma daemon`: owns controllers, their recovery and their exports, so they outlive
//! the commands that made them. Clients speak the control protocol (`proto`,
//! `docs/control-protocol.md`) on RUN_DIR/daemon.sock.
//!
//! Stop signals (SIGINT, SIGTERM, SIGHUP) and the `stop` request behave the same: with no
//! export in use, every export is stopped, every controller disconnected, the socket removed
//! and the process exits 0. With an export in use (a loop device on a FUSE file, an open
//! file, NBD clients) the daemon refuses, logs what holds each export and how to let it go,
//! and keeps serving; a refused stop signal stays pending and completes once nothing holds
//! the exports (saying who still does every
//! [`PENDING_REPORT`](crate::signals::PENDING_REPORT)). A second stop signal within
//! [`FORCE_WINDOW`] (or `stop` with `force`) stops anyway.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use nvmf_rdma::cli::support::{host_bind_addr, roce_peer, run_dir};
use nvmf_rdma::driver::DeviceManager;
use nvmf_rdma::export::{bind_listener, BlockDev, DevSet};
use nvmf_rdma::nvme::fabrics::DISCOVERY_NQN;
use nvmf_rdma::reconnect::CtrlState;
use nvmf_rdma::transport::Controller;
use serde_json::{json, Map, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::OwnedReadHalf;
use tokio::sync::Semaphore;

use crate::args::{DaemonArgs, ExportArgs, Subsys};
use crate::config::{config_dir, parse_connect, read_config, ConfigLine};
use crate::connect::{report_state_changes, start_exports, Exports};
use crate::control::{make_run_dir, same_user};
use crate::host::{connect_hint, ctrl_info, device_config, discover_on, options, HOST_HCA};
use crate::proto::{
    err_line, ok_line, parse_request, ConnectParams, ErrorCode, ProtoError, Request, MAX_LINE,
    PROTOCOL_VERSION, SOCKET_NAME,
};
use crate::sdnotify;
use crate::signals::{PendingStop, StopSignals, FORCE_WINDOW, PENDING_POLL};
use crate::usage::{holders, in_use_message, Probe};
use nvmf_rdma::cli::device::{self, DeviceChoice};

/// A line of the daemon's log. Under `daemon --background` the log is a file of ours
/// (RUN_DIR/daemon.log), so each line gets the time in front, as the target's log has it;
/// under systemd journald adds the time itself.
macro_rules! say {
    ($($t:tt)*) => {
        $crate::daemon::log_line(format_args!($($t)*))
    };
}

/// Whether [`say!`] puts the time in front (set in the daemon started by `--background`).
static LOG_TIME: AtomicBool = AtomicBool::new(false);

/// The environment variable `--background` sets for the daemon it starts.
const LOG_TIME_ENV: &str = "NVMF_RDMA_LOG_TIME";

pub(crate) fn log_line(args: std::fmt::Arguments<'_>) {
    if LOG_TIME.load(Ordering::Relaxed) {
        println!(
            "{} {args}",
            nvmf_rdma::cli::units::utc_stamp(std::time::SystemTime::now())
        );
    } else {
        println!("{args}");
    }
}

/// Clients served at once; one more gets a `busy` answer and is closed.
const MAX_CLIENTS: usize = 64;
/// Time a client has to send each complete request line.
pub(crate) const CLIENT_TIMEOUT: Duration = Duration::from_secs(30);
/// How long `daemon --background` waits for the daemon it started to be ready.
const READY_TIMEOUT: Duration = Duration::from_secs(120);
/// A configured line that failed is tried again after this, doubling each time up to
/// [`RETRY_MAX`], until it connects.
const RETRY_FIRST: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(60);

/// Identity of a connection for duplicate checks: subsystem, target, service, host NQN.
type Key = (String, String, u16, String);

/// Tasks by line key, one each.
type KeyedTasks = Mutex<HashMap<Key, tokio::task::JoinHandle<()>>>;

/// One controller the daemon owns.
struct Entry {
    name: String,
    key: Key,
    sub: Subsys,
    ctrl: Arc<Controller>,
    exports: Exports,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    /// Held (read) by each I/O request on the controller; a disconnect takes it (write).
    io_gate: Arc<tokio::sync::RwLock<()>>,
    /// The soft-HCA it runs on (none on a kernel device).
    device: Option<HostDevice>,
}

/// The soft-HCA a controller runs on: one of its own (loopback, on a free port) goes with
/// the controller; a shared one (a fixed port, towards RoCEv2 peers) stays for the others.
struct HostDevice {
    mgr: DeviceManager,
    own: bool,
}

impl HostDevice {
    /// Let the device go: one of our own stops and frees its UDP socket and memory.
    async fn release(self) {
        if self.own {
            if let Some((hca, _)) = self.mgr.open(HOST_HCA) {
                nvmf_rdma::driver::CmService::for_device(&hca)
                    .settle_disconnects(Duration::from_secs(1))
                    .await;
            }
            let _ = self.mgr.unplug(HOST_HCA).await;
        }
    }
}

impl Entry {
    fn info(&self) -> Value {
        let info = ctrl_info(&self.name, &self.sub, &self.ctrl);
        let mut v: Value = serde_json::from_str(&info.to_json()).unwrap_or_else(|_| json!({}));
        if let Value::Object(m) = &mut v {
            m.insert("address".into(), json!(self.sub.fabric.traddr.to_string()));
            m.insert("exports".into(), exports_json(&self.exports));
        }
        v
    }

    async fn stop(self) {
        // Aborted and awaited: a task's hold on the controller is gone before it is deleted.
        for t in self.tasks {
            t.abort();
            let _ = t.await;
        }
        // `read`/`write`/`verify` requests in flight end first (each holds the gate).
        let _gate = self.io_gate.write().await;
        // Only a forced disconnect (or an unexpected busy mount) gets here with a user left:
        // the export is fenced and the controller deleted, whoever still holds them, so the
        // controller's own soft-HCA can go with it: nothing waits on it any more.
        self.exports.release(&self.ctrl, true).await;
        if let Some(d) = self.device {
            d.release().await;
        }
    }
}

fn exports_json(x: &Exports) -> Value {
    let mut v = Vec::new();
    if let Some((a, stats)) = &x.nbd_at {
        let names = x.set.as_ref().map(DevSet::names).unwrap_or_default();
        v.push(json!({
            "type": "nbd", "nsid": x.nsid, "address": a.to_string(), "uri": a.uri(),
            "names": names,
            "clients": stats.connections.load(Ordering::SeqCst),
        }));
    }
    if let Some(m) = &x.fuse {
        let files: Vec<String> = m
            .files()
            .names()
            .iter()
            .map(|n| m.mountpoint().join(n).display().to_string())
            .collect();
        v.push(json!({
            "type": "fuse", "nsid": x.nsid, "mountpoint": m.mountpoint().display().to_string(),
            "file": m.file().display().to_string(), "files": files, "open_handles": m.open_files(),
        }));
    }
    Value::Array(v)
}

#[derive(Default)]
struct Inner {
    ctrls: BTreeMap<u32, Entry>,
    /// Names being connected, with their key, exports' paths.
    reserved: BTreeMap<u32, (Key, Vec<String>)>,
}

struct State {
    run_dir: PathBuf,
    config_dir: PathBuf,
    inner: Mutex<Inner>,
    /// Soft-HCAs bound to a fixed port (towards RoCEv2 peers), shared by their controllers.
    managers: tokio::sync::Mutex<HashMap<SocketAddr, DeviceManager>>,
    stopping: AtomicBool,
    client_timeout: Duration,
    /// Discovery controllers watched for log changes, by address, service and host NQN.
    watchers: KeyedTasks,
    /// Where a watcher sends a discovery line whose log changed (connect-all runs it).
    rescan: tokio::sync::mpsc::Sender<ConnectParams>,
    /// Configured lines that failed, each tried again until it connects; by line key.
    retries: KeyedTasks,
    stop_req:
        tokio::sync::mpsc::Sender<(bool, tokio::sync::oneshot::Sender<Result<(), ProtoError>>)>,
}

fn lock(m: &Mutex<Inner>) -> std::sync::MutexGuard<'_, Inner> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn failed(e: impl std::fmt::Display) -> ProtoError {
    ProtoError::new(ErrorCode::Failed, e.to_string())
}

impl State {
    /// Export paths a request would use (a FUSE mount point, an NBD socket), for clash checks.
    fn export_paths(p: &ConnectParams) -> Vec<String> {
        p.fuse.iter().chain(p.nbd.iter()).cloned().collect()
    }

    /// Pick the lowest free name (not ours, not a `connect --foreground` socket that
    /// answers) and reserve it, unless `key` duplicates a controller and `dup` is not set, or
    /// an export path is another controller's.
    async fn reserve(&self, key: &Key, paths: Vec<String>, dup: bool) -> Result<u32, ProtoError> {
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
                self.run_dir.join(format!("nvmf{n}.sock"))
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
    async fn connect_on_device(
        &self,
        sub: &Subsys,
        o: nvmf_rdma::transport::ConnectOptions,
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
    async fn controller(
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
            if self.run_dir.join(format!("{name}.sock")).exists() {
                e.hint(format!(
                    "{name} is held by `connect --foreground`: -d works on the daemon's controllers; give that process's -a/-n instead"
                ))
            } else {
                e.hint("`nvmf-rdma list` shows them")
            }
        })
    }

    /// Keep a discovery controller for `p` (a discovery line) watched, once.
    fn watch(self: &Arc<Self>, p: &ConnectParams) {
        let task = watch_discovery(self.clone(), p.clone(), self.rescan.clone());
        self.spawn_once(&self.watchers, line_key(p), task);
    }

    /// Try the configured line `l` again until it connects, unless that already goes on.
    fn retry(self: &Arc<Self>, l: &ConfigLine) {
        let (st, line) = (self.clone(), l.clone());
        let task = async move { retry_until_ok(|n| retry_line(&st, &line, n)).await };
        self.spawn_once(&self.retries, line_key(&l.params), task);
    }

    /// Run `task` as the one task of `key` in `tasks`, unless one runs or the daemon stops.
    fn spawn_once(
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
async fn abort_all(tasks: &KeyedTasks) {
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
fn line_key(p: &ConnectParams) -> Key {
    (
        p.nqn.clone(),
        p.traddr.clone(),
        p.trsvcid.unwrap_or(4420),
        p.hostnqn.clone().unwrap_or_default(),
    )
}

/// The wait before try `n` (from 0) of a configured line that failed.
fn retry_delay(n: u32) -> Duration {
    RETRY_FIRST.saturating_mul(1u32 << n.min(16)).min(RETRY_MAX)
}

/// Call `attempt(n)` after [`retry_delay`]`(n)`, for n = 0, 1, ..., until it says done.
async fn retry_until_ok<F, Fut>(mut attempt: F)
where
    F: FnMut(u32) -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let mut n = 0u32;
    loop {
        tokio::time::sleep(retry_delay(n)).await;
        if attempt(n).await {
            return;
        }
        n = n.saturating_add(1);
    }
}

/// Try configured line `l` again (try `n`): done when everything it names is connected (or
/// the daemon stops). Each failure is one log line saying when the next try is.
async fn retry_line(st: &Arc<State>, l: &ConfigLine, n: u32) -> bool {
    if st.stopping.load(Ordering::SeqCst) {
        return true;
    }
    let r = op_connect_all(st, Some(l.params.clone())).await;
    let errors: Vec<String> = match &r {
        Ok(v) => v["results"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|r| r["status"] == "failed")
            .map(|r| {
                format!(
                    "{}: {}",
                    r["nqn"].as_str().unwrap_or(""),
                    r["error"].as_str().unwrap_or("")
                )
            })
            .collect(),
        Err(e) => vec![e.message.clone()],
    };
    let next = retry_delay(n + 1).as_secs();
    if let Ok(v) = &r {
        for r in v["results"].as_array().into_iter().flatten() {
            if r["status"] == "connected" {
                say!("connect-all: line {}: {r}", l.line);
            }
        }
    }
    for e in &errors {
        say!(
            "connect-all: line {}: {e}; trying again in {next} s",
            l.line
        );
    }
    errors.is_empty()
}

impl Exports {
    /// The mount point and socket this controller's exports use, as requests name them.
    fn paths(&self) -> Vec<String> {
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

/// Connect as `p` asks; runs in its own task so a client that goes away changes nothing.
async fn op_connect(st: Arc<State>, p: ConnectParams) -> Result<Value, ProtoError> {
    if st.stopping.load(Ordering::SeqCst) {
        return Err(ProtoError::new(
            ErrorCode::Stopping,
            "the daemon is stopping",
        ));
    }
    let (sub, x, mode) =
        parse_connect(&p.to_args()).map_err(|e| ProtoError::new(ErrorCode::BadRequest, e))?;
    let o = options(&sub).map_err(|e| ProtoError::new(ErrorCode::BadRequest, format!("{e:#}")))?;
    let key: Key = (
        sub.nqn.clone(),
        sub.fabric.traddr.to_string(),
        sub.fabric.trsvcid,
        o.hostnqn.clone(),
    );
    let n = st
        .reserve(&key, State::export_paths(&p), mode.duplicate_connect)
        .await?;
    let name = format!("nvmf{n}");
    let st2 = st.clone();
    let name2 = name.clone();
    let job = tokio::spawn(async move {
        let r = connect_entry(&st2, name2, key, sub, x, o).await;
        let late = {
            let mut inner = lock(&st2.inner);
            inner.reserved.remove(&n);
            match r {
                // A stop that went through while we connected has disconnected everything
                // else: this one goes too, or its exports would outlive the daemon.
                Ok(e) if st2.stopping.load(Ordering::SeqCst) => e,
                Ok(e) => {
                    let v = e.info();
                    inner.ctrls.insert(n, e);
                    return Ok(v);
                }
                Err(e) => return Err(e),
            }
        };
        late.stop().await;
        Err(ProtoError::new(
            ErrorCode::Stopping,
            "the daemon stopped while connecting",
        ))
    });
    let r = job
        .await
        .unwrap_or_else(|e| Err(failed(format!("connect task ended: {e}"))))?;
    say!("{name}: connected ({})", p.nqn);
    let mut m = Map::new();
    m.insert("device".into(), json!(name));
    m.insert("controller".into(), r);
    Ok(Value::Object(m))
}

async fn connect_entry(
    st: &Arc<State>,
    name: String,
    key: Key,
    sub: Subsys,
    x: ExportArgs,
    o: nvmf_rdma::transport::ConnectOptions,
) -> Result<Entry, ProtoError> {
    let what = format!("connect to {} at {}", sub.nqn, sub.fabric.traddr);
    let (c, device) = st
        .connect_on_device(&sub, o)
        .await
        .map_err(|e| failed(format!("{what}: {e:#}")).hint(connect_hint(&format!("{e:#}"))))?;
    let c = Arc::new(c);
    let exports = match start_exports(&c, &sub, &x).await {
        Ok(x) => x,
        Err(e) => {
            if let Ok(c) = Arc::try_unwrap(c) {
                c.disconnect().await;
            }
            if let Some(d) = device {
                d.release().await;
            }
            return Err(failed(format!("{name}: exports: {e:#}")));
        }
    };
    for l in exports.describe() {
        say!("{name}: {l}");
    }
    let tasks = vec![
        tokio::spawn(report_state_changes(name.clone(), c.watch_status())),
        tokio::spawn(reap_when_dead(st.clone(), name.clone(), c.watch_status())),
        tokio::spawn(watch_namespaces(
            name.clone(),
            c.clone(),
            exports.set.clone(),
        )),
    ];
    Ok(Entry {
        name,
        key,
        sub,
        ctrl: c,
        exports,
        tasks,
        io_gate: Arc::new(tokio::sync::RwLock::new(())),
        device,
    })
}

/// A controller's namespaces, followed: a Namespace Attribute Changed notice rescans them,
/// and the controller rescans them itself after each reconnect; after every rescan that
/// changed them, `list` shows the new ones and sizes and the exports follow
/// ([`follow_namespaces`]). Ends when the controller is deleted.
async fn watch_namespaces(name: String, c: Arc<Controller>, set: Option<DevSet>) {
    let mut changed = c.watch_namespaces();
    // Kept across turns: an Async Event Request stays outstanding until it completes.
    let events = next_namespace_event(&name, &c);
    tokio::pin!(events);
    loop {
        tokio::select! {
            go_on = &mut events => {
                if !go_on {
                    return;
                }
                events.set(next_namespace_event(&name, &c));
            }
            r = changed.changed() => {
                if r.is_err() {
                    return;
                }
                let ids: Vec<String> = c
                    .namespaces()
                    .iter()
                    .map(|n| format!("{} ({} blocks)", n.nsid, n.blocks))
                    .collect();
                say!("{name}: namespaces changed: {}", ids.join(", "));
                if let Some(set) = &set {
                    for l in follow_namespaces(&c, set) {
                        say!("{name}: {l}");
                    }
                }
            }
        }
    }
}

/// Wait for the controller's next Asynchronous Event and rescan on a Namespace Attribute
/// Changed notice. False once the controller is deleted.
async fn next_namespace_event(name: &str, c: &Arc<Controller>) -> bool {
    match c.next_async_event().await {
        Ok(ev) if ev.namespaces_changed() => {
            if let Err(e) = c.rescan_namespaces().await {
                say!("{name}: namespaces changed, rescan failed: {e}");
            }
        }
        Ok(ev) => say!(
            "{name}: async event type {} info {:#x} (log page {:#x})",
            ev.kind,
            ev.info,
            ev.log_page
        ),
        // Failed with the I/O of a recovery (fast_io_fail_tmo): ask again once the
        // controller is live; a deleted one ends the watch.
        Err(_) => {
            let mut st = c.watch_status();
            match st
                .wait_for(|s| matches!(s.state(), CtrlState::Live | CtrlState::Dead))
                .await
            {
                Ok(s) if s.state() == CtrlState::Live => {}
                _ => return false,
            }
            // A request that failed at once on a live controller is not retried in a
            // loop.
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
    true
}

/// Bring the exports' namespaces in line with the controller's after a rescan: an added
/// namespace becomes `ns<NSID>` (a FUSE file, an NBD export name), a resized one is served
/// at its new size (FUSE at once; NBD to clients that connect from now on: the protocol has
/// no way to tell a connected client). A removed namespace, or one replaced by a different
/// namespace (its identity changed), keeps its name and fails every request: its users
/// (an open FUSE file, a loop device, a connected NBD client) must not be handed another
/// disk's blocks; the new one is served after the controller is connected again. Returns
/// what changed, a line each.
fn follow_namespaces(c: &Arc<Controller>, set: &DevSet) -> Vec<String> {
    let mut said = Vec::new();
    let now = c.namespaces();
    for (file, old) in set.named() {
        let ns = old.namespace();
        match now.iter().find(|n| n.nsid == ns.nsid) {
            None => said.push(format!(
                "exports: namespace {} was removed; {file} fails every request",
                ns.nsid
            )),
            Some(n) if !n.same_as(&ns) => said.push(format!(
                "exports: namespace {} is a different namespace now (its identity changed); \
                 {file} fails every request; disconnect and connect again to serve the new one",
                ns.nsid
            )),
            Some(_) => {}
        }
    }
    for n in now {
        let file = format!("ns{}", n.nsid);
        let have = set.index_of(file.as_bytes()).and_then(|i| set.get(i));
        if have
            .as_ref()
            .is_some_and(|old| !old.namespace().same_as(&n) || old.size() == n.bytes())
        {
            continue;
        }
        let dev = match BlockDev::new(c.clone(), n.nsid) {
            Ok(d) => Arc::new(d),
            Err(e) => {
                said.push(format!("exports: {file}: {e}"));
                continue;
            }
        };
        let size = dev.size();
        match have {
            None => said.push(match set.add(&file, dev) {
                Ok(()) => format!("exports: namespace {} is {file}", n.nsid),
                Err(e) => format!("exports: {file}: {e}"),
            }),
            Some(old) => {
                set.replace(&file, dev);
                said.push(format!(
                    "exports: namespace {} resized from {} to {size} bytes ({file}; NBD clients connected before keep the old size until they reconnect)",
                    n.nsid,
                    old.size()
                ));
            }
        }
    }
    said
}

/// One discovery controller `connect-all` keeps connected per discovery line, so that a
/// Discovery Log Page Changed event brings its new subsystems in (sent to `rescan`).
async fn watch_discovery(
    st: Arc<State>,
    p: ConnectParams,
    rescan: tokio::sync::mpsc::Sender<ConnectParams>,
) {
    let what = format!("discovery controller at {}", p.traddr);
    loop {
        let c = async {
            let (sub, _, _) = parse_connect(&p.to_args()).map_err(anyhow::Error::msg)?;
            let mut o = options(&sub)?;
            // Held for good, so kept alive (a discovery controller without keep-alive is
            // expired by the target after two minutes).
            if o.keep_alive_tmo.is_zero() {
                o.keep_alive_tmo = Duration::from_secs(5);
            }
            st.connect_on_device(&sub, o).await
        }
        .await;
        let (c, device) = match c {
            Ok(c) => c,
            Err(e) => {
                say!("{what}: {e:#}; trying again in 10 s");
                tokio::time::sleep(Duration::from_secs(10)).await;
                continue;
            }
        };
        say!("{what}: watching its log for changes");
        loop {
            match c.next_async_event().await {
                Ok(ev) if ev.discovery_changed() => {
                    say!("{what}: discovery log changed; connect-all");
                    let _ = rescan.try_send(p.clone());
                }
                Ok(_) => {}
                Err(_) => break,
            }
        }
        c.disconnect().await;
        if let Some(d) = device {
            d.release().await;
        }
        if st.stopping.load(Ordering::SeqCst) {
            return;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// A controller that gave up (ctrl_loss_tmo) leaves the daemon as Linux deletes it. While an
/// export is in use it stays, listed as dead (its users get I/O errors), and goes once the
/// export is released.
async fn reap_when_dead(
    st: Arc<State>,
    name: String,
    mut rx: tokio::sync::watch::Receiver<nvmf_rdma::transport::CtrlStatus>,
) {
    if rx.wait_for(|s| s.state() == CtrlState::Dead).await.is_err() {
        return;
    }
    let n: Option<u32> = name.strip_prefix("nvmf").and_then(|n| n.parse().ok());
    let Some(n) = n else { return };
    let mut said = false;
    let mut e = loop {
        let probe = match lock(&st.inner).ctrls.get(&n) {
            Some(e) => e.exports.probe(),
            None => return,
        };
        // The counters first; the scan of holders runs once they read zero.
        if !probe.busy_now() && holders(&probe).await.is_empty() {
            // A `disconnect` meanwhile aborts this task with the entry; nothing else
            // takes it out.
            match lock(&st.inner).ctrls.remove(&n) {
                Some(e) => break e,
                None => return,
            }
        }
        if !said {
            say!("{name}: dead; kept while an export is in use (its users get I/O errors), until it is released or `disconnect --force`");
            said = true;
        }
        tokio::time::sleep(PENDING_POLL).await;
    };
    say!("{name}: dead; removed");
    // This task is one of the entry's: do not abort ourselves.
    e.tasks.clear();
    e.stop().await;
}

/// Stop and disconnect the controllers `pick` selects, unless an export is in use and not
/// `force`: then nothing is disconnected and the error names every holder.
async fn op_disconnect(
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
        say!("{msg}");
        let _ = sdnotify::notify(&format!("STATUS={msg}"));
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
            "{}: disconnecting{}",
            e.name,
            if force { " (forced)" } else { "" }
        );
        e.stop().await;
        say!("{}: disconnected", names.last().map_or("", |s| s));
    }
    Ok(names)
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

/// `connect-all`: each configured line (or the one given) connected; discovery lines expand
/// to every subsystem their discovery controller lists. Already connected ones are skipped.
async fn op_connect_all(
    st: &Arc<State>,
    given: Option<ConnectParams>,
) -> Result<Value, ProtoError> {
    let configured = given.is_none();
    let lines: Vec<ConfigLine> = match given {
        Some(p) => vec![ConfigLine {
            line: 0,
            discovery: p.nqn == DISCOVERY_NQN,
            params: p,
        }],
        None => read_config(&st.config_dir)
            .map_err(|e| ProtoError::new(ErrorCode::BadRequest, e).hint("fix the config file"))?,
    };
    let mut results = Vec::new();
    for l in lines {
        if l.discovery {
            st.watch(&l.params);
        }
        let first = results.len();
        let targets = if l.discovery {
            match discover_params(&l.params).await {
                Ok(v) => v,
                Err(e) => {
                    results.push(json!({"line": l.line, "traddr": l.params.traddr,
                        "nqn": l.params.nqn, "status": "failed", "error": format!("discovery: {e:#}")}));
                    if configured {
                        st.retry(&l);
                    }
                    continue;
                }
            }
        } else {
            vec![l.params.clone()]
        };
        for p in targets {
            let mut r =
                json!({"line": l.line, "traddr": p.traddr, "trsvcid": p.trsvcid, "nqn": p.nqn});
            match op_connect(st.clone(), p).await {
                Ok(v) => {
                    r["status"] = json!("connected");
                    r["device"] = v["device"].clone();
                }
                Err(e) if e.code == ErrorCode::Duplicate => {
                    r["status"] = json!("already-connected")
                }
                Err(e) => {
                    r["status"] = json!("failed");
                    r["error"] = json!(e.message);
                }
            }
            results.push(r);
        }
        if configured && results[first..].iter().any(|r| r["status"] == "failed") {
            st.retry(&l);
        }
    }
    let mut m = Map::new();
    m.insert("results".into(), Value::Array(results));
    Ok(Value::Object(m))
}

/// The subsystems the discovery controller of `p` lists, as connect requests with `p`'s
/// options. An entry at the discovery controller's own IP keeps its soft-HCA port.
async fn discover_params(p: &ConnectParams) -> Result<Vec<ConnectParams>> {
    let (sub, _, _) = parse_connect(&p.to_args()).map_err(anyhow::Error::msg)?;
    let o = options(&sub)?;
    let entries = discover_on(&sub.fabric, o, "no discovery log").await?;
    let mut out = Vec::new();
    for e in entries {
        let nqn = e.subnqn.text().trim().to_string();
        if nqn == DISCOVERY_NQN || nqn.is_empty() {
            continue;
        }
        let mut q = p.clone();
        q.nqn = nqn;
        if let Ok(s) = e.trsvcid.text().trim().parse::<u16>() {
            q.trsvcid = Some(s);
        }
        if let Ok(ip) = e.traddr.text().trim().parse::<std::net::IpAddr>() {
            if ip != sub.fabric.traddr.ip() {
                q.traddr = ip.to_string();
            }
        }
        out.push(q);
    }
    Ok(out)
}

async fn dispatch(st: &Arc<State>, req: Request) -> Result<Map<String, Value>, ProtoError> {
    let obj = |v: Value| match v {
        Value::Object(m) => m,
        _ => Map::new(),
    };
    match req {
        Request::Status => {
            let (n, connecting): (usize, Vec<String>) = {
                let inner = lock(&st.inner);
                (
                    inner.ctrls.len(),
                    inner.reserved.keys().map(|n| format!("nvmf{n}")).collect(),
                )
            };
            Ok(obj(json!({
                "pid": std::process::id(),
                "daemon_version": env!("CARGO_PKG_VERSION"),
                "protocol_version": PROTOCOL_VERSION,
                "run_dir": st.run_dir.display().to_string(),
                "config_dir": st.config_dir.display().to_string(),
                "controllers": n,
                "connecting": connecting,
                "stopping": st.stopping.load(Ordering::SeqCst),
            })))
        }
        Request::List => {
            let v: Vec<Value> = lock(&st.inner).ctrls.values().map(Entry::info).collect();
            Ok(obj(json!({ "controllers": v })))
        }
        Request::Connect(p) => op_connect(st.clone(), *p).await.map(obj),
        Request::ConnectAll(p) => op_connect_all(st, p.map(|p| *p)).await.map(obj),
        Request::Disconnect { device, nqn, force } => {
            let what = match (&device, &nqn) {
                (Some(d), _) => format!("device {d}"),
                (None, Some(q)) => format!("NQN {q}"),
                _ => String::new(),
            };
            let names = op_disconnect(
                st,
                |e| {
                    device.as_deref().is_some_and(|d| d == e.name)
                        || nqn.as_deref().is_some_and(|q| q == e.sub.nqn)
                },
                force,
                &what,
            )
            .await?;
            Ok(obj(json!({ "disconnected": names })))
        }
        Request::DisconnectAll { force } => {
            let names = op_disconnect(st, |_| true, force, "").await?;
            Ok(obj(json!({ "disconnected": names })))
        }
        Request::Io { device, io } => {
            let (c, _gate) = st.controller(&device).await?;
            crate::daemon_io::run_io(c, &device, io).await
        }
        Request::Stop { force } => {
            let (tx, rx) = tokio::sync::oneshot::channel();
            st.stop_req
                .send((force, tx))
                .await
                .map_err(|_| ProtoError::new(ErrorCode::Stopping, "the daemon is stopping"))?;
            rx.await
                .unwrap_or(Ok(()))
                .map(|_| obj(json!({ "stopping": true })))
        }
    }
}

/// Read one line of at most [`MAX_LINE`] bytes. `Ok(None)` at the end of the stream;
/// `Ok(Some(Err(())))` for a line that was too long (read to its end and dropped).
async fn read_line(
    r: &mut BufReader<OwnedReadHalf>,
    buf: &mut Vec<u8>,
) -> std::io::Result<Option<Result<(), ()>>> {
    buf.clear();
    let mut too_long = false;
    loop {
        let avail = r.fill_buf().await?;
        if avail.is_empty() {
            return Ok(if buf.is_empty() && !too_long {
                None
            } else if too_long {
                Some(Err(()))
            } else {
                Some(Ok(()))
            });
        }
        let (chunk, done) = match avail.iter().position(|&b| b == b'\n') {
            Some(i) => (&avail[..i], i + 1),
            None => (avail, avail.len()),
        };
        let end = done > chunk.len();
        if !too_long {
            if buf.len() + chunk.len() >= MAX_LINE {
                too_long = true;
                buf.clear();
            } else {
                buf.extend_from_slice(chunk);
            }
        }
        r.consume(done);
        if end {
            return Ok(Some(if too_long { Err(()) } else { Ok(()) }));
        }
    }
}

/// One client: request lines in, one answer line each, in order, until it closes, stays
/// silent past [`CLIENT_TIMEOUT`], or the daemon stops.
async fn serve_client(st: Arc<State>, stream: tokio::net::UnixStream) {
    let (r, mut w) = stream.into_split();
    let mut r = BufReader::with_capacity(4096, r);
    let mut buf = Vec::new();
    loop {
        let line = match tokio::time::timeout(st.client_timeout, read_line(&mut r, &mut buf)).await
        {
            Err(_) => {
                let e = ProtoError::new(
                    ErrorCode::Timeout,
                    format!(
                        "no complete request line within {} s",
                        st.client_timeout.as_secs()
                    ),
                );
                let _ = w
                    .write_all(format!("{}\n", err_line(&None, &e)).as_bytes())
                    .await;
                return;
            }
            Ok(Err(_)) | Ok(Ok(None)) => return,
            Ok(Ok(Some(l))) => l,
        };
        let answer = match line {
            Err(()) => err_line(
                &None,
                &ProtoError::new(
                    ErrorCode::LineTooLong,
                    format!("request line longer than {MAX_LINE} bytes"),
                ),
            ),
            Ok(()) => {
                let text = String::from_utf8_lossy(&buf);
                if text.trim().is_empty() {
                    continue;
                }
                let (id, req) = parse_request(text.trim());
                match req {
                    Err(e) => err_line(&id, &e),
                    Ok(req) => match dispatch(&st, req).await {
                        Ok(body) => ok_line(&id, body),
                        Err(e) => err_line(&id, &e),
                    },
                }
            }
        };
        if w.write_all(format!("{answer}\n").as_bytes()).await.is_err() {
            return;
        }
    }
}

/// The lock that makes one daemon per run directory: held (flock) for the daemon's life.
struct PidLock {
    path: PathBuf,
    _file: std::fs::File,
}

impl PidLock {
    fn take(dir: &Path) -> Result<PidLock> {
        use std::io::Write;
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::OpenOptionsExt;
        let path = dir.join("daemon.pid");
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            // A link in our directory is not ours to truncate.
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .with_context(|| format!("open {}", path.display()))?;
        // SAFETY: flock on a descriptor we own.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let pid = std::fs::read_to_string(&path).unwrap_or_default();
            bail!(
                "a daemon already runs in {} (pid {}); set NVMF_RDMA_RUN_DIR for another",
                dir.display(),
                pid.trim()
            );
        }
        f.set_len(0)?;
        writeln!(f, "{}", std::process::id())?;
        Ok(PidLock { path, _file: f })
    }
}

impl PidLock {
    /// The pid of the daemon that holds the lock in `dir`, if one does.
    fn holder(dir: &Path) -> Option<String> {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::OpenOptionsExt;
        let path = dir.join("daemon.pid");
        let f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .ok()?;
        // SAFETY: flock on a descriptor we own; a shared lock taken here goes with `f`.
        let free = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) } == 0;
        if free {
            return None;
        }
        Some(std::fs::read_to_string(&path).ok()?.trim().to_string())
    }
}

impl Drop for PidLock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// `nvmf-rdma daemon`.
pub(crate) fn run_daemon(a: DaemonArgs, global: Vec<String>) -> Result<()> {
    if a.stop {
        return stop_running(a.force);
    }
    if a.background {
        // Already running: what was asked for holds (provisioning scripts run this twice).
        if let Some(pid) = PidLock::holder(&run_dir()) {
            println!(
                "nvmf-rdma daemon already runs (pid {pid}); socket {}",
                run_dir().join(SOCKET_NAME).display()
            );
            return Ok(());
        }
        return start_background(&a, &global).map(|pid| {
            println!(
                "nvmf-rdma daemon running (pid {pid}); socket {}",
                run_dir().join(SOCKET_NAME).display()
            )
        });
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let r = rt.block_on(serve(a));
    if let Err(e) = &r {
        let _ = sdnotify::notify(&format!(
            "STATUS=error: {}",
            crate::proto::one_line(&format!("{e:#}"))
        ));
    }
    // FUSE threads and recovery tasks have been stopped; do not wait on stragglers.
    rt.shutdown_timeout(Duration::from_secs(2));
    r
}

/// `daemon --stop`: ask the daemon to stop and wait until its socket is gone.
fn stop_running(force: bool) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let sock = run_dir().join(SOCKET_NAME);
        crate::client::call(json!({"op": "stop", "force": force})).await?;
        let deadline = Instant::now() + Duration::from_secs(30);
        while sock.exists() {
            if Instant::now() > deadline {
                bail!("the daemon accepted the stop but its socket is still there after 30 s");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        println!("daemon stopped");
        Ok(())
    })
}

async fn serve(a: DaemonArgs) -> Result<()> {
    if std::env::var_os(LOG_TIME_ENV).is_some() {
        LOG_TIME.store(true, Ordering::Relaxed);
    }
    let dir = run_dir();
    make_run_dir(&dir)?;
    let _pid = PidLock::take(&dir)?;
    let sock = dir.join(SOCKET_NAME);
    // A crashed daemon's socket is taken over; the file goes when `_sock_file` drops.
    let (listener, _sock_file) =
        bind_listener(&sock).with_context(|| format!("bind {}", sock.display()))?;
    let mut signals = StopSignals::new()?;
    let (stop_tx, mut stop_rx) = tokio::sync::mpsc::channel(4);
    // Bounded: a watcher that finds it full drops its request; one queued covers it.
    let (rescan_tx, mut rescan_rx) = tokio::sync::mpsc::channel::<ConnectParams>(16);
    let st = Arc::new(State {
        run_dir: dir.clone(),
        config_dir: config_dir(a.config_dir.as_deref()),
        inner: Mutex::new(Inner::default()),
        managers: tokio::sync::Mutex::new(HashMap::new()),
        stopping: AtomicBool::new(false),
        client_timeout: a.client_timeout.map_or(CLIENT_TIMEOUT, Duration::from_secs),
        watchers: Mutex::new(HashMap::new()),
        rescan: rescan_tx,
        retries: Mutex::new(HashMap::new()),
        stop_req: stop_tx,
    });
    let rescans = {
        let st = st.clone();
        tokio::spawn(async move {
            while let Some(p) = rescan_rx.recv().await {
                if let Ok(v) = op_connect_all(&st, Some(p)).await {
                    for r in v["results"].as_array().into_iter().flatten() {
                        if r["status"] != "already-connected" {
                            say!("connect-all: {r}");
                        }
                    }
                }
            }
        })
    };
    let r = serve_until_stopped(&st, &listener, &mut signals, &mut stop_rx, a.connect_all).await;
    rescans.abort();
    let _ = rescans.await;
    // Retries first: one may start a watcher.
    abort_all(&st.retries).await;
    abort_all(&st.watchers).await;
    drop(listener);
    r
}

async fn serve_until_stopped(
    st: &Arc<State>,
    listener: &tokio::net::UnixListener,
    signals: &mut StopSignals,
    stop_rx: &mut tokio::sync::mpsc::Receiver<(
        bool,
        tokio::sync::oneshot::Sender<Result<(), ProtoError>>,
    )>,
    connect_all: bool,
) -> Result<()> {
    let clients = Arc::new(Semaphore::new(MAX_CLIENTS));
    let mut tasks = tokio::task::JoinSet::new();
    let startup = async {
        if connect_all {
            match op_connect_all(st, None).await {
                Ok(v) => {
                    for r in v["results"].as_array().into_iter().flatten() {
                        say!("connect-all: {r}");
                    }
                }
                Err(e) => say!("connect-all: {}", e.message),
            }
        }
    };
    // Serve clients while the configured controllers connect (list shows them as they come).
    tokio::pin!(startup);
    let mut started = false;
    let mut pending = PendingStop::default();
    say!(
        "nvmf-rdma daemon {} (protocol {PROTOCOL_VERSION}) on {}",
        env!("CARGO_PKG_VERSION"),
        st.run_dir.join(SOCKET_NAME).display()
    );
    loop {
        tokio::select! {
            _ = &mut startup, if !started => {
                started = true;
                let _ = sdnotify::notify(&format!("READY=1\nSTATUS=serving {} controller(s)", lock(&st.inner).ctrls.len()));
                say!("ready");
            }
            sig = signals.recv() => {
                let now = Instant::now();
                match try_stop(st, pending.forces(now), true).await {
                    Ok(()) => { say!("{sig}: stopped"); break; }
                    Err(e) => {
                        pending.refused(now);
                        say!("{sig}: not stopping: {}; {}; the stop completes once they are released; another stop signal within {} s forces it",
                            e.message, e.hint.as_deref().unwrap_or(""), FORCE_WINDOW.as_secs());
                        let _ = sdnotify::notify(&format!("STATUS=refusing to stop: {}", e.message));
                    }
                }
            }
            _ = pending.tick() => {
                // The counters first; the full look runs once they read zero, or when it is
                // time to say again who holds the exports.
                let due = pending.report_due(Instant::now());
                let busy = lock(&st.inner).ctrls.values().any(|e| e.exports.probe().busy_now());
                if busy && !due {
                    continue;
                }
                match try_stop(st, false, true).await {
                    Ok(()) => { say!("exports released: stopped"); break; }
                    Err(e) if due => {
                        say!("stop pending: {}; {}", e.message, e.hint.as_deref().unwrap_or(""));
                        let _ = sdnotify::notify(&format!("STATUS=stop pending: {}", e.message));
                    }
                    Err(_) => {}
                }
            }
            Some((force, reply)) = stop_rx.recv() => {
                let r = try_stop(st, force, pending.is_pending()).await;
                let done = r.is_ok();
                let _ = reply.send(r);
                if done { say!("stop request: stopped"); break; }
            }
            conn = listener.accept() => {
                let Ok((stream, _)) = conn else {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                };
                if !same_user(&stream) {
                    continue;
                }
                match clients.clone().try_acquire_owned() {
                    Ok(permit) => {
                        let st = st.clone();
                        tasks.spawn(async move { serve_client(st, stream).await; drop(permit); });
                    }
                    Err(_) => {
                        // Told without a task of its own (a fresh socket's buffer takes
                        // the line), so a flood of clients costs nothing that stays.
                        let e = ProtoError::new(ErrorCode::Busy, format!("{MAX_CLIENTS} clients already")).hint("try again");
                        let _ = stream.try_write(format!("{}\n", err_line(&None, &e)).as_bytes());
                    }
                }
            }
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
        }
    }
    // The client that asked for the stop still gets its answer; idle ones are cut off.
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    tasks.abort_all();
    Ok(())
}

/// Stop everything unless an export is in use (and not `force`). A refused stop that stays
/// `pending` keeps taking no new controller.
async fn try_stop(st: &Arc<State>, force: bool, pending: bool) -> Result<(), ProtoError> {
    // No new controller from here on; taken back if the stop is refused and not pending.
    st.stopping.store(true, Ordering::SeqCst);
    match op_disconnect(st, |_| true, force, "").await {
        Ok(_) => {
            let _ = sdnotify::notify("STOPPING=1");
            Ok(())
        }
        Err(e) => {
            st.stopping.store(pending, Ordering::SeqCst);
            Err(e)
        }
    }
}

/// `daemon --background`: start `nvmf-rdma daemon` detached (new session, log file) and wait
/// for its READY=1 on a private notify socket. Returns its pid.
pub(crate) fn start_background(a: &DaemonArgs, global: &[String]) -> Result<u32> {
    use std::os::unix::fs::OpenOptionsExt;
    use std::os::unix::process::CommandExt;
    let dir = run_dir();
    make_run_dir(&dir)?;
    let notify = dir.join(format!("ready-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&notify);
    let rx = std::os::unix::net::UnixDatagram::bind(&notify)
        .with_context(|| format!("bind {}", notify.display()))?;
    struct Rm(PathBuf);
    impl Drop for Rm {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
    let _rm = Rm(notify.clone());
    rx.set_read_timeout(Some(Duration::from_millis(100)))?;
    let log_path = dir.join("daemon.log");
    let log = std::fs::OpenOptions::new()
        .mode(0o600)
        .create(true)
        .append(true)
        .open(&log_path)
        .with_context(|| format!("open {}", log_path.display()))?;
    let exe = std::env::current_exe().context("cannot find the nvmf-rdma executable")?;
    let mut cmd = std::process::Command::new(exe);
    cmd.args(global).arg("daemon");
    if a.connect_all {
        cmd.arg("--connect-all");
    }
    if let Some(d) = &a.config_dir {
        cmd.arg("--config-dir").arg(d);
    }
    if let Some(t) = a.client_timeout {
        cmd.arg(format!("--client-timeout={t}"));
    }
    cmd.env("NOTIFY_SOCKET", &notify)
        .env(LOG_TIME_ENV, "1")
        .env("NVMF_RDMA_RUN_DIR", &dir)
        .env_remove("RUST_BACKTRACE")
        .stdin(std::process::Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    // SAFETY: setsid is async-signal-safe; it detaches the daemon from our terminal and
    // process group, so a closed terminal (SIGHUP) or Ctrl-C here does not reach it.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let mut child = cmd.spawn().context("cannot start the daemon")?;
    let deadline = Instant::now() + READY_TIMEOUT;
    let mut buf = [0u8; 4096];
    loop {
        if let Ok(n) = rx.recv(&mut buf) {
            let msg = String::from_utf8_lossy(&buf[..n]);
            if msg.lines().any(|l| l == "READY=1") {
                return Ok(child.id());
            }
            if let Some(e) = msg.lines().find_map(|l| l.strip_prefix("STATUS=error: ")) {
                let _ = child.wait();
                bail!("the daemon did not start: {e}");
            }
        }
        if let Some(s) = child.try_wait()? {
            bail!(
                "the daemon exited ({s}) before it was ready; see {}",
                log_path.display()
            );
        }
        if Instant::now() > deadline {
            bail!(
                "the daemon (pid {}) was not ready within {} s; see {}",
                child.id(),
                READY_TIMEOUT.as_secs(),
                log_path.display()
            );
        }
    }
}

#[cfg(test)]
mod retry_tests {
    use super::*;

    /// A line that keeps failing is tried after 1, 2, 4, ... s, then every 60 s.
    #[tokio::test(start_paused = true)]
    async fn a_failing_line_is_retried_at_1_s_doubling_to_60_s() {
        let start = tokio::time::Instant::now();
        let mut at = Vec::new();
        retry_until_ok(|n| {
            at.push((tokio::time::Instant::now() - start).as_secs());
            std::future::ready(n == 9)
        })
        .await;
        assert_eq!(at, [1, 3, 7, 15, 31, 63, 123, 183, 243, 303]);
    }
}

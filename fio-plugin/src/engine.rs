//! The engine's process-wide state: one tokio runtime, one controller per target (connected
//! once, shared by every job and thread that names it), the multipath subsystems over them, the
//! built-in targets started here, and the set of fio jobs still using them. The last job to
//! leave disconnects and stops it all.
//!
//! fio calls `setup` for every job in its main thread before it starts them, then runs each job
//! in a thread (`thread=1`) or a forked process (the default). A forked child inherits this
//! state without the runtime's threads, so a process notices it is not the one that built the
//! state (pid) and builds its own, leaving the parent's untouched; built-in targets keep
//! running in the parent, and the child connects to them like any remote target.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use nvmf_rdma::cli::device::{connect_kernel_with_faults, DeviceChoice};
use nvmf_rdma::cli::support::{local_ip_for, soft_device_config};
use nvmf_rdma::driver::{DeviceManager, SoftHca};
use nvmf_rdma::harness::nvmf_perf::LocalTarget;
use nvmf_rdma::multipath::Subsystem;
use nvmf_rdma::nvmet::Target;
use nvmf_rdma::reconnect::RecoveryLog;
use nvmf_rdma::transport::{ConnectOptions, Controller};
use nvmf_rdma::verbs::{DeviceFaults, FaultInjector};

use crate::chaos::{self, ChaosPath};
use crate::options::{Chaos, CtrlKey, CtrlOptions, SecondPath, TargetAddr};
use crate::runtime::{Driver, EngineRt};

/// Block size of the built-in RAM namespace (4 KiB, as `nvmf-rdma bench`).
const BUILTIN_LBADS: u8 = 12;

/// A connected controller and what the engine runs beside it.
pub struct Ctrl {
    pub ctrl: Arc<Controller>,
    /// Resets of the host device under `ctrl`, for `chaos_reset_every`.
    faults: DeviceFaults,
    pub key: CtrlKey,
    chaos: Option<Chaos>,
    chaos_task: Mutex<Option<tokio::task::JoinHandle<()>>>,
    pub resets: Arc<AtomicU64>,
    /// The recovery episodes so far, for the summary fio's log gets at the end.
    recoveries: Arc<Mutex<RecoveryLog>>,
}

/// Two controllers to one subsystem as the paths of a multipath [`Subsystem`], and the
/// chaos that faults their devices one at a time.
pub struct Multi {
    pub sub: Arc<Subsystem>,
    paths: Vec<Arc<Ctrl>>,
    /// The built-in target's port behind each path, when this process started it.
    ports: Vec<Option<(Target<SoftHca>, u16)>>,
    plans: Vec<Option<Chaos>>,
    /// Faults inflicted on each path.
    counts: Vec<Arc<AtomicU64>>,
    chaos_task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

/// A multipath subsystem is shared by the jobs naming the same paths and policy.
type MultiKey = (CtrlKey, CtrlKey, &'static str);

/// Keep the recovery episodes of `c`, for the summary fio's log gets at the end.
fn watch_recoveries(c: &Controller) -> Arc<Mutex<RecoveryLog>> {
    let log = Arc::new(Mutex::new(RecoveryLog::default()));
    let mut rx = c.watch_status();
    let l = log.clone();
    tokio::spawn(async move {
        while rx.changed().await.is_ok() {
            let st = rx.borrow_and_update().machine;
            l.lock().unwrap_or_else(|e| e.into_inner()).observe(&st);
        }
    });
    log
}

struct Engine {
    pid: u32,
    rt: EngineRt,
    ctrls: HashMap<CtrlKey, Arc<Ctrl>>,
    multis: HashMap<MultiKey, Arc<Multi>>,
    /// Built-in targets by size and ports: their ports' addresses, and the target itself
    /// when this process started it (a forked child only knows the addresses).
    targets: HashMap<(u64, u8), (Vec<SocketAddr>, Option<LocalTarget>)>,
    /// fio jobs (`thread_data` addresses) between their setup/init and their cleanup.
    users: HashSet<usize>,
    next_dev: u8,
}

static ENGINE: Mutex<Option<Engine>> = Mutex::new(None);

fn lock() -> MutexGuard<'static, Option<Engine>> {
    ENGINE.lock().unwrap_or_else(|e| e.into_inner())
}

/// The engine of this process, built on first use (or after a fork).
fn engine(g: &mut Option<Engine>, threads: usize) -> Result<&mut Engine, String> {
    let pid = std::process::id();
    if g.as_ref().is_some_and(|e| e.pid != pid) {
        // Inherited through fork: its runtime threads do not exist here, so nothing of it
        // may run or be dropped (dropping would join threads that are not there). Keep only
        // the addresses of the parent's built-in targets, which are still serving.
        if let Some(old) = g.take() {
            let targets = old
                .targets
                .iter()
                .map(|(k, (addrs, _))| (*k, (addrs.clone(), None)))
                .collect();
            std::mem::forget(old);
            *g = Some(Engine::new(pid, threads, targets)?);
        }
    }
    if g.is_none() {
        *g = Some(Engine::new(pid, threads, HashMap::new())?);
    }
    g.as_mut().ok_or_else(|| "engine state missing".to_string())
}

impl Engine {
    fn new(
        pid: u32,
        threads: usize,
        targets: HashMap<(u64, u8), (Vec<SocketAddr>, Option<LocalTarget>)>,
    ) -> Result<Engine, String> {
        let rt = EngineRt::start(threads)?;
        Ok(Engine {
            pid,
            rt,
            ctrls: HashMap::new(),
            multis: HashMap::new(),
            targets,
            users: HashSet::new(),
            next_dev: 1,
        })
    }

    fn target_addr(&mut self, t: TargetAddr) -> Result<SocketAddr, String> {
        match t {
            TargetAddr::Remote(a) => Ok(a),
            TargetAddr::Builtin { bytes, ports, port } => {
                let port_addr = |addrs: &[SocketAddr]| {
                    addrs
                        .get(port as usize)
                        .copied()
                        .ok_or_else(|| format!("the built-in target has no port {}", port + 1))
                };
                if let Some((a, _)) = self.targets.get(&(bytes, ports)) {
                    return port_addr(a);
                }
                let lt = LocalTarget::start_ports(bytes, BUILTIN_LBADS, ports)
                    .map_err(|e| format!("cannot start the built-in target: {e:#}"))?;
                let a = port_addr(&lt.addrs)?;
                self.targets
                    .insert((bytes, ports), (lt.addrs.clone(), Some(lt)));
                Ok(a)
            }
        }
    }

    fn controller(&mut self, o: &CtrlOptions) -> Result<Arc<Ctrl>, String> {
        if let Some(c) = self.ctrls.get(&o.key) {
            return Ok(c.clone());
        }
        let addr = self.target_addr(o.key.target)?;
        let n = self.next_dev;
        self.next_dev = self.next_dev.wrapping_add(1);
        let (c, faults, recoveries) = self.rt.driver.block_on(async {
            let (c, faults) = connect(o, addr, n).await?;
            let r = watch_recoveries(&c);
            Ok::<_, String>((c, faults, r))
        })?;
        let c = Arc::new(Ctrl {
            ctrl: Arc::new(c),
            faults,
            recoveries,
            key: o.key.clone(),
            chaos: o.chaos,
            chaos_task: Mutex::new(None),
            resets: Arc::new(AtomicU64::new(0)),
        });
        self.ctrls.insert(o.key.clone(), c.clone());
        Ok(c)
    }

    /// The multipath subsystem over `first` and `second`, its paths connected on first use.
    fn multipath(
        &mut self,
        first: &CtrlOptions,
        second: &SecondPath,
    ) -> Result<Arc<Multi>, String> {
        let key = (
            first.key.clone(),
            second.ctrl.key.clone(),
            second.iopolicy.name(),
        );
        if let Some(m) = self.multis.get(&key) {
            return Ok(m.clone());
        }
        let mut paths = Vec::new();
        let mut plans = Vec::new();
        let mut ports = Vec::new();
        for o in [first, &second.ctrl] {
            // Chaos on a path of a subsystem is the subsystem's, so the paths take turns.
            let mut o = o.clone();
            plans.push(o.chaos.take());
            paths.push(self.controller(&o)?);
            ports.push(self.builtin_port(o.key.target));
        }
        let sub = Subsystem::new(&first.key.subnqn, second.iopolicy);
        self.rt.driver.block_on(async {
            for c in &paths {
                sub.add_path(
                    c.ctrl.clone(),
                    c.key.target.to_string(),
                    c.faults.name().to_string(),
                )
                .await
                .map_err(|e| {
                    format!(
                        "{} at {} as a second path: {e:#}",
                        c.key.subnqn, c.key.target
                    )
                })?;
            }
            Ok::<_, String>(())
        })?;
        let m = Arc::new(Multi {
            sub,
            counts: paths.iter().map(|_| Arc::new(AtomicU64::new(0))).collect(),
            paths,
            ports,
            plans,
            chaos_task: Mutex::new(None),
        });
        self.multis.insert(key, m.clone());
        Ok(m)
    }

    /// The built-in target's port at `t` and its port ID, if this process started it.
    fn builtin_port(&self, t: TargetAddr) -> Option<(Target<SoftHca>, u16)> {
        let TargetAddr::Builtin { bytes, ports, port } = t else {
            return None;
        };
        let lt = self.targets.get(&(bytes, ports))?.1.as_ref()?;
        Some((lt.target.clone(), *lt.port_ids.get(port as usize)?))
    }

    /// Disconnect every controller, stop the runtime and the built-in targets.
    fn shutdown(self) {
        let Engine {
            rt,
            ctrls,
            multis,
            targets,
            ..
        } = self;
        rt.driver.block_on(async move {
            for (_, m) in multis {
                m.stop_chaos().await;
                m.report();
            }
            for (_, c) in ctrls {
                stop(&c.chaos_task).await;
                let resets = c.resets.load(Ordering::Relaxed);
                if c.chaos.is_some() {
                    eprintln!(
                        "nvmf-rdma: chaos: {resets} resets of the host device for {} at {}",
                        c.key.subnqn, c.key.target
                    );
                }
                // Host payload copies per completed I/O (0 with registered fio buffers).
                let (ios, copies) = c.ctrl.queue_stats()[1..]
                    .iter()
                    .fold((0, 0), |(n, k), q| (n + q.completed, k + q.copies));
                eprintln!(
                    "nvmf-rdma: {} at {}: host copies per I/O {:.2} ({copies} copies, {ios} I/Os)",
                    c.key.subnqn,
                    c.key.target,
                    copies as f64 / ios.max(1) as f64
                );
                let st = c.ctrl.status().machine;
                let mut log = c
                    .recoveries
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone();
                log.observe(&st);
                eprintln!(
                    "nvmf-rdma: {} at {}: {}",
                    c.key.subnqn,
                    c.key.target,
                    log.summary(&st)
                );
                let Ok(c) = Arc::try_unwrap(c) else { continue };
                if let Ok(ctrl) = Arc::try_unwrap(c.ctrl) {
                    let _ = tokio::time::timeout(Duration::from_secs(2), ctrl.disconnect()).await;
                }
            }
        });
        rt.stop();
        drop(targets);
    }
}

/// A host soft-HCA on the local address that routes to the target, and the controller on it.
/// (The same steps as `nvmf-rdma connect`.) The host device's source is wrapped in a fault
/// injector, whose handle comes back for `chaos_reset_every`.
async fn connect(
    o: &CtrlOptions,
    addr: SocketAddr,
    n: u8,
) -> Result<(Controller, DeviceFaults), String> {
    let mut c = ConnectOptions::new(addr, &o.key.subnqn);
    c.trsvcid = o.key.trsvcid;
    if let Some(h) = &o.key.hostnqn {
        c.hostnqn = h.clone();
    }
    c.nr_io_queues = o.nr_io_queues;
    c.queue_size = o.queue_size;
    c.keep_alive_tmo = o.keep_alive_tmo;
    c.policy.ctrl_loss_tmo = o.recovery.ctrl_loss_tmo;
    c.policy.reconnect_delay = o.recovery.reconnect_delay;
    c.policy.fast_io_fail_tmo = o.recovery.fast_io_fail_tmo;
    c.policy.identity = o.recovery.identity;
    c.policy.replug_window = o.recovery.replug_window;
    c.safe_retry.mode = o.recovery.safe_retry;
    let r = match &o.key.device {
        DeviceChoice::Soft => {
            let ip = local_ip_for(addr).map_err(|e| format!("no route to {addr}: {e}"))?;
            let cfg = soft_device_config(&format!("fio{n}"), SocketAddr::new(ip, 0), n);
            // The device lives in a device manager, so the controller survives its resets.
            let mgr = DeviceManager::new(addr.ip().is_loopback());
            let name = cfg.identity.name.clone();
            mgr.plug(cfg)
                .await
                .map_err(|e| format!("cannot start the host soft-HCA: {e}"))?;
            let src = FaultInjector::new(mgr);
            Controller::connect_managed(src.clone(), &name, c)
                .await
                .map(|c| (c, src.device(&name)))
        }
        DeviceChoice::Kernel(d) => connect_kernel_with_faults(d, c).await,
    };
    r.map_err(|e| {
        format!(
            "connect to {} (trsvcid {}) at {addr}: {e}",
            o.key.subnqn, o.key.trsvcid
        )
    })
}

type ChaosTask = Mutex<Option<tokio::task::JoinHandle<()>>>;

/// Start [`chaos::run`] on `paths` in `task`, unless it runs already. A device fault is
/// survived by the one recovery path: it holds the in-flight I/O and resubmits it once the
/// same device is back (or, with several paths, multipath moves it to another).
fn start(task: &ChaosTask, rt: &tokio::runtime::Handle, paths: Vec<ChaosPath>) {
    if paths.iter().all(|p| p.plan.is_none()) {
        return;
    }
    let mut t = task.lock().unwrap_or_else(|e| e.into_inner());
    if t.is_none() {
        *t = Some(rt.spawn(chaos::run(paths)));
    }
}

async fn stop(task: &ChaosTask) {
    let t = task.lock().unwrap_or_else(|e| e.into_inner()).take();
    if let Some(t) = t {
        t.abort();
        let _ = t.await;
    }
}

impl Ctrl {
    /// Start the chaos task if the options asked for one and it is not running yet.
    pub fn start_chaos(&self, rt: &tokio::runtime::Handle) {
        let path = ChaosPath {
            ctrl: Arc::downgrade(&self.ctrl),
            faults: self.faults.clone(),
            port: None,
            plan: self.chaos,
            count: self.resets.clone(),
        };
        start(&self.chaos_task, rt, vec![path]);
    }
}

impl Multi {
    /// Start the paths' fault schedules if the options asked for any and they do not run yet.
    pub fn start_chaos(&self, rt: &tokio::runtime::Handle) {
        let paths = self
            .paths
            .iter()
            .zip(&self.plans)
            .zip(&self.counts)
            .zip(&self.ports)
            .map(|(((c, plan), count), port)| ChaosPath {
                ctrl: Arc::downgrade(&c.ctrl),
                faults: c.faults.clone(),
                port: port.clone(),
                plan: *plan,
                count: count.clone(),
            })
            .collect();
        start(&self.chaos_task, rt, paths);
    }

    async fn stop_chaos(&self) {
        stop(&self.chaos_task).await;
    }

    /// What each path carried and went through, for fio's log (as `nvme top` shows it).
    fn report(&self) {
        let info = self.sub.info();
        for (i, (p, c)) in info.iter().zip(&self.paths).enumerate() {
            let faults = match self.plans[i] {
                Some(plan) => format!(
                    ", {} chaos {}s",
                    self.counts[i].load(Ordering::Relaxed),
                    plan.kind.name()
                ),
                None => String::new(),
            };
            eprintln!(
                "nvmf-rdma: {} path {} ({}, {}): {} I/Os, {} failovers, {} reconnects{faults}",
                self.sub.nqn,
                i + 1,
                c.key.target,
                self.sub.policy(),
                p.stats.ios,
                p.stats.failovers,
                p.stats.reconnects,
            );
        }
    }
}

/// Register fio job `td` as a user of the engine (idempotent); how to run its I/O.
pub fn register(td: usize, threads: usize) -> Result<Driver, String> {
    let mut g = lock();
    let e = engine(&mut g, threads)?;
    e.users.insert(td);
    Ok(e.rt.driver.clone())
}

/// The controller for `o`, connected on first use.
pub fn controller(o: &CtrlOptions, threads: usize) -> Result<Arc<Ctrl>, String> {
    let mut g = lock();
    engine(&mut g, threads)?.controller(o)
}

/// The multipath subsystem over `first` and `second`, connected on first use.
pub fn multipath(
    first: &CtrlOptions,
    second: &SecondPath,
    threads: usize,
) -> Result<Arc<Multi>, String> {
    let mut g = lock();
    engine(&mut g, threads)?.multipath(first, second)
}

/// Job `td` is done; the last one out shuts the engine down.
pub fn release(td: usize) {
    let mut g = lock();
    let Some(e) = g.as_mut() else { return };
    if e.pid != std::process::id() {
        return;
    }
    e.users.remove(&td);
    if e.users.is_empty() {
        if let Some(e) = g.take() {
            drop(g);
            e.shutdown();
        }
    }
}

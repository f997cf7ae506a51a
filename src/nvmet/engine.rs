//! The running target: its state (the command core, and the transport's queues and
//! budgets) under one lock, and the task that drives it from completions, finished
//! namespace work and the keep-alive tick. The pipeline a command follows is in
//! [`super::pipeline`], queue admission in [`super::queues`], the commands themselves in
//! [`super::exec`].
//!
//! It runs on any device behind the backend seam ([`crate::verbs`]): PD, MRs, CQ, QPs, posts
//! and completions go through [`DeviceContext`], queue memory is the device's
//! [`HostBuffer`], and time is tokio's clock (virtual on a simulated network), read once per
//! turn, so the state machines themselves read no clock.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use rustc_hash::FxHashMap;

use crate::verbs::{CqId, DeviceContext, Instant, Mtu, PdId, PeerInfo, Psn, Qpn, VerbsError};

use super::backend::{Finished, Pool};
use super::budget::{Ledger, Shares, Usage};
use super::command::{Core, AEN_DISCOVERY_CHANGED, AEN_NS_CHANGED};
use super::port::{port_index, PortInfo, QRef};
use super::quiesce::{LateWrite, NO_WAKE};
use super::rdma::{Io, NsRegions, TQueue};
use super::stats::{TargetStats, COUNTERS};
use super::{Namespace, Subsystem, TargetConfig, MAX_NAMESPACES};
use crate::nvme::ana::{self, AnaState};
use crate::published::Publisher;

/// Parameters of an incoming queue connection (from the CM REQ and its private data).
#[derive(Debug, Clone, Copy)]
pub struct ConnParams {
    pub peer: PeerInfo,
    pub qid: u16,
    /// Host receive queue size (responses it can take).
    pub hrqsize: u16,
    /// Host send queue size, 0's based.
    pub hsqsize: u16,
    /// The path MTU the host's REQ carries: what its HCA derived from its netdev (1024 on
    /// 1500-byte Ethernet for rxe). Our RDMA WRITEs and READ responses must not exceed it,
    /// and FIRST/MIDDLE packets must be exactly this long, or rxe drops them.
    pub path_mtu: Mtu,
    /// The PSN we send with: the REQ's starting PSN (see `ConnectRequest::local_psn`).
    pub local_psn: Psn,
}

/// Why a queue connection was refused (the NVMe-oF RDMA CM reject status).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ConnReject {
    #[error("invalid HSQSIZE")]
    InvalidHsqsize,
    #[error("invalid HRQSIZE")]
    InvalidHrqsize,
    #[error("invalid QID")]
    InvalidQid,
    #[error("no resources")]
    NoResources,
}

impl ConnReject {
    /// The `sts` value of `struct nvme_rdma_cm_rej`.
    pub fn status(self) -> u16 {
        match self {
            ConnReject::InvalidQid => 3,
            ConnReject::InvalidHsqsize => 4,
            ConnReject::InvalidHrqsize => 5,
            ConnReject::NoResources => 6,
        }
    }
}

/// The target's state: the command core (configuration, controllers, counters) and the
/// transport's queues and budgets.
pub(super) struct Engine<D: DeviceContext> {
    pub core: Core,
    /// Each port's PD, CQ and CM side (port `p` at `p - 1`).
    pub ports: Vec<PortRes>,
    pub queues: FxHashMap<QRef, TQueue<D::Mem>>,
    /// Established queues without a controller (no Fabrics Connect yet) per peer IP
    /// address, for `max_unconnected_per_ip`.
    pub per_ip: FxHashMap<IpAddr, usize>,
    /// Queues waiting for their RTU, per peer IP address and in all.
    pub pre_rtu_per_ip: FxHashMap<IpAddr, usize>,
    pub pre_rtu: usize,
    /// The most queues that may wait for their RTU (`max_pre_rtu`, less on a small CQ).
    pub pre_rtu_cap: usize,
    /// Who holds how much of the queue and CQ budgets.
    pub ledger: Ledger,
    /// A hung controller: commands are taken off the wire and never answered.
    pub frozen: bool,
    /// Ports whose controllers are hung so (one path of several dies silently).
    pub frozen_ports: Vec<u16>,
    /// A stalled backend: I/O commands are held until the stall ends, then executed.
    pub stall_io: bool,
    pub stalled: Vec<(QRef, usize)>,
    /// The late-writes fault ([`TargetConfig::late_writes_ms`]), and the writes it holds.
    pub late_writes_ms: Option<u32>,
    pub late: Vec<LateWrite<D::Mem>>,
    /// Started worker jobs of dead controllers, by queue incarnation: the instance and
    /// how many have yet to report.
    pub ending: FxHashMap<u64, (crate::nvme::ccr::CtrlInstance, usize)>,
    /// When the engine's task next looks at `late`, on its clock (`NO_WAKE`: never).
    pub late_wake: Arc<AtomicU64>,
    /// Ports whose device still serves completions: the engine's own work (keep-alive,
    /// namespace workers, late writes) goes on until the last one dies.
    pub live_ports: usize,
    /// A test's trap: after the target has executed this many commands in all, wake the
    /// test (and freeze, if asked) before anything else happens.
    pub trap: Option<(u64, bool, Arc<tokio::sync::Notify>)>,
    /// The engine's clock as of the current turn.
    pub now: Instant,
    /// Inside a batch of completions: response SENDs wait in `responses` until the batch
    /// ends, so the batch's RDMA WRITEs leave back to back, then its responses (each
    /// response still after its own data). Runs of equal-sized packets go out as one
    /// segmented send instead of alternating data/response sends.
    pub batching: bool,
    pub responses: Vec<(QRef, usize)>,
    /// Namespace work off the engine's task.
    pub pool: Arc<Pool<D::Mem>>,
    pub next_token: u64,
    /// Finished jobs being answered (kept, so a turn allocates nothing).
    pub finished: Vec<Finished>,
    /// `stats` as metrics, published on the keep-alive tick.
    pub metrics: Publisher<TargetStats>,
    /// RAM namespaces with their memory region on our PD.
    pub regions: NsRegions,
}

/// What a port has of its own: its device's PD and CQ, and its CM side.
pub(super) struct PortRes {
    pub pd: PdId,
    pub cq: CqId,
    /// Depth of `cq`, and how much of it the port's queues' slots can fill
    /// ([`CQES_PER_SLOT`] each): a queue that would overrun the CQ is refused.
    pub cqes: usize,
    pub cqes_used: usize,
    /// Queues the engine dropped on its own (keep-alive expiry, transport error): the
    /// port's CM side forgets their connections.
    pub dropped: Option<tokio::sync::mpsc::UnboundedSender<Qpn>>,
}

impl PortRes {
    /// A PD and the largest CQ `dev` gives (down to [`MIN_CQ`]).
    fn open<D: DeviceContext>(dev: &D) -> Result<PortRes, VerbsError> {
        let pd = dev.alloc_pd()?;
        let mut depth = MAX_CQ;
        let cq = loop {
            match dev.create_cq(depth) {
                Ok(cq) => break cq,
                Err(e) if depth <= MIN_CQ || e == VerbsError::DeviceGone => {
                    dev.dealloc_pd(pd);
                    return Err(e);
                }
                Err(_) => depth /= 2,
            }
        };
        Ok(PortRes {
            pd,
            cq,
            cqes: depth,
            cqes_used: 0,
            dropped: None,
        })
    }
}

impl<D: DeviceContext> Engine<D> {
    /// The resources of port `port` (one the engine has: queues name only those).
    pub fn port(&self, port: u16) -> &PortRes {
        &self.ports[port_index(port)]
    }

    pub fn port_mut(&mut self, port: u16) -> &mut PortRes {
        &mut self.ports[port_index(port)]
    }
}

/// The engine and the devices it posts to, under one lock.
struct Locked<D: DeviceContext> {
    e: Engine<D>,
    d: Io<D>,
}

/// A running target: its first port's device context, and any others added. Cheap to
/// clone.
pub struct Target<D: DeviceContext> {
    dev: D,
    engine: Arc<Mutex<Locked<D>>>,
    /// Zero of the engine's clock (tokio's, so virtual on a simulated network).
    epoch: tokio::time::Instant,
    pool: Arc<Pool<D::Mem>>,
    late_wake: Arc<AtomicU64>,
}

impl<D: DeviceContext> Clone for Target<D> {
    fn clone(&self) -> Self {
        Target {
            dev: self.dev.clone(),
            engine: self.engine.clone(),
            epoch: self.epoch,
            pool: self.pool.clone(),
            late_wake: self.late_wake.clone(),
        }
    }
}

/// The largest CQ the target asks for; a device that offers less gets asked for half, down
/// to [`MIN_CQ`].
const MAX_CQ: usize = 1 << 16;
const MIN_CQ: usize = 1 << 10;
/// Completions one command slot can have outstanding: its receive, an RDMA READ (or an
/// unsignaled WRITE, which completes only when flushed) and its response SEND.
pub(super) const CQES_PER_SLOT: usize = 3;
/// Worker threads for namespace work, at most (started as work first needs them).
const IO_WORKERS: usize = 4;
/// How often controllers are checked for keep-alive expiry.
const KATO_CHECK: std::time::Duration = std::time::Duration::from_millis(250);

impl<D: DeviceContext> Target<D> {
    /// Set up the target's first port (ID 1, at `cfg.advertise`) on `dev`, its PD and CQ,
    /// and start the task that serves completions.
    pub fn start(dev: D, cfg: TargetConfig) -> Result<Target<D>, VerbsError> {
        let first = PortRes::open(&dev)?;
        let depth = first.cqes;
        let pool = Pool::new(IO_WORKERS);
        let metrics = Publisher::new(COUNTERS, "port", &cfg.port.to_string());
        // Queues waiting for their RTU have their CQ entries set aside, so that however
        // many REQs come in, established queues can fill the rest.
        let pre_rtu_cap = cfg.max_pre_rtu.min(depth / (4 * CQES_PER_SLOT));
        let whole = Usage {
            queues: cfg.max_queues,
            cqes: depth - pre_rtu_cap * CQES_PER_SLOT,
        };
        let shares = Shares {
            address: cfg.address_share,
            network: cfg.network_share,
            host: cfg.host_share,
            reserved: cfg.reserved_share,
        };
        let late_wake = Arc::new(AtomicU64::new(NO_WAKE));
        let late_writes_ms = cfg.late_writes_ms;
        let e = Engine {
            core: Core::new(cfg),
            ports: vec![first],
            queues: FxHashMap::default(),
            per_ip: FxHashMap::default(),
            pre_rtu_per_ip: FxHashMap::default(),
            pre_rtu: 0,
            pre_rtu_cap,
            ledger: Ledger::new(whole, shares),
            frozen: false,
            frozen_ports: Vec::new(),
            stall_io: false,
            stalled: Vec::new(),
            late_writes_ms,
            late: Vec::new(),
            ending: FxHashMap::default(),
            late_wake: late_wake.clone(),
            live_ports: 1,
            trap: None,
            now: Instant(0),
            batching: false,
            responses: Vec::with_capacity(256),
            pool: pool.clone(),
            next_token: 0,
            finished: Vec::new(),
            metrics,
            regions: NsRegions::default(),
        };
        let d = Io::new(dev.clone());
        let t = Target {
            dev,
            engine: Arc::new(Mutex::new(Locked { e, d })),
            epoch: tokio::time::Instant::now(),
            pool,
            late_wake,
        };
        let task = t.clone();
        tokio::spawn(async move { task.serve().await });
        Ok(t)
    }

    /// The device context of the target's first port.
    pub fn device(&self) -> &D {
        &self.dev
    }

    /// Serve the same subsystems through `dev` as well: a new port, reached at `addr` (the
    /// discovery log's address for it), with its own PD, CQ and queues. Controllers on it
    /// share the target's controller IDs, namespaces and Cross-Controller Reset. Returns
    /// its port ID; its CM is served with [`super::serve_cm_on`].
    pub fn add_port(&self, dev: D, addr: Option<SocketAddr>) -> Result<u16, String> {
        let res = PortRes::open(&dev).map_err(|e| format!("cannot open the port's device: {e}"))?;
        let cq = res.cq;
        let id = {
            let mut g = self.lock();
            let Locked { e, d } = &mut *g;
            let Some(id) = e.core.add_port(addr) else {
                dev.destroy_cq(cq);
                dev.dealloc_pd(res.pd);
                return Err("no more ports: port IDs are 16 bits".into());
            };
            e.ports.push(res);
            e.live_ports += 1;
            d.add(dev.clone());
            id
        };
        tracing::info!(port = id, addr = ?addr, "port added");
        let task = self.clone();
        tokio::spawn(async move { task.serve_port(id, dev, cq).await });
        Ok(id)
    }

    /// The target's ports, in order.
    pub fn ports(&self) -> Vec<PortInfo> {
        self.lock().e.core.ports.clone()
    }

    /// Set ANA group `grpid`'s state through port `port`. The port's controllers that want
    /// ANA change notices get one (an outstanding Async Event Request completes, or the
    /// next one does). An unknown port or group is refused.
    pub fn set_ana_state(&self, port: u16, grpid: u32, state: AnaState) -> Result<(), String> {
        let mut g = self.lock();
        let Locked { e, d } = &mut *g;
        for id in e.core.set_ana_state(port, grpid, state)? {
            e.raise(d, id, ana::ana_change_aen_dw0());
        }
        Ok(())
    }

    /// Every ANA group and its state through each port: (port, group, state), by port
    /// then group.
    pub fn ana_states(&self) -> Vec<(u16, u32, AnaState)> {
        let g = self.lock();
        let core = &g.e.core;
        let groups = core.ana_groups();
        core.ports
            .iter()
            .flat_map(|p| groups.iter().map(move |grp| (p.id, *grp)))
            .map(|(p, grp)| (p, grp, core.ana.state(p, grp)))
            .collect()
    }

    pub fn config(&self) -> Arc<TargetConfig> {
        self.lock().e.core.cfg.clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Locked<D>> {
        self.engine.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn now(&self) -> Instant {
        Instant(self.epoch.elapsed().as_nanos() as u64)
    }

    pub fn stats(&self) -> TargetStats {
        self.lock().e.core.stats.clone()
    }

    /// Accept a queue connection: create its QP and rings, let `bind` tie the QP to its
    /// connection request ([`crate::verbs::CmListen::attach`]), bring the QP to RTS, post
    /// the receive ring. Returns our QPN and the receive queue size (crqsize).
    pub fn accept(
        &self,
        port: u16,
        p: ConnParams,
        bind: impl FnOnce(Qpn) -> bool,
    ) -> Result<(Qpn, u16), ConnReject> {
        let now = self.now();
        let mut g = self.lock();
        let Locked { e, d } = &mut *g;
        if usize::from(port) > e.ports.len() || port == 0 {
            return Err(ConnReject::NoResources);
        }
        e.now = now;
        e.add_queue(d, port, p, bind)
    }

    /// The peer of `qpn` on port `port` sent its CM RTU: the queue leaves the pre-RTU
    /// table and counts against its address's budgets (it goes if that is past them).
    pub fn established(&self, port: u16, qpn: Qpn) {
        let mut g = self.lock();
        let Locked { e, d } = &mut *g;
        e.establish(d, QRef { port, qpn });
    }

    /// The host went away (CM disconnect, transport error): drop the queue and, for an
    /// admin queue, its controller and every queue of it.
    pub fn drop_queue(&self, port: u16, qpn: Qpn) {
        let mut g = self.lock();
        let Locked { e, d } = &mut *g;
        e.remove_queue(d, QRef { port, qpn });
    }

    /// Add namespace `ns` to the running subsystem `subnqn`. Its controllers are told with a
    /// Namespace Attribute Changed event (and the Changed Namespace List log page).
    pub fn add_namespace(&self, subnqn: &str, ns: Namespace) -> Result<(), String> {
        let mut g = self.lock();
        let Locked { e, d } = &mut *g;
        let cfg = &e.core.cfg;
        let idx = cfg
            .subsystems
            .iter()
            .position(|s| s.nqn.as_str() == subnqn)
            .ok_or_else(|| format!("no subsystem {subnqn}"))?;
        let nsid = ns.nsid;
        if cfg.subsystems[idx]
            .namespaces
            .iter()
            .any(|n| n.nsid == nsid)
        {
            return Err(format!("namespace {nsid} exists in {subnqn}"));
        }
        if cfg.subsystems[idx].namespaces.len() >= MAX_NAMESPACES {
            return Err(format!(
                "{subnqn} has {MAX_NAMESPACES} namespaces, all a host can list"
            ));
        }
        Arc::make_mut(&mut e.core.cfg).subsystems[idx]
            .namespaces
            .push(Arc::new(ns));
        tracing::info!(subsystem = subnqn, nsid, "namespace added");
        for id in e.core.namespace_added(idx, nsid) {
            e.raise(d, id, AEN_NS_CHANGED);
        }
        Ok(())
    }

    /// Add subsystem `sub` to the running target. Discovery controllers are told with a
    /// Discovery Log Page Changed event.
    pub fn add_subsystem(&self, sub: Subsystem) -> Result<(), String> {
        let mut g = self.lock();
        let Locked { e, d } = &mut *g;
        if e.core.cfg.subsystems.iter().any(|s| s.nqn == sub.nqn) {
            return Err(format!("subsystem {} exists", sub.nqn.as_str()));
        }
        tracing::info!(subsystem = sub.nqn.as_str(), "subsystem added");
        Arc::make_mut(&mut e.core.cfg).subsystems.push(sub);
        for id in e.core.discovery_ctrls() {
            e.raise(d, id, AEN_DISCOVERY_CHANGED);
        }
        Ok(())
    }

    /// Play a hung controller (chaos and tests): while frozen, every command that arrives
    /// is dropped unanswered; the transport and CM keep working.
    pub fn freeze(&self, frozen: bool) {
        self.lock().e.frozen = frozen;
    }

    /// [`Target::freeze`] for the controllers of port `port` only: a path that dies
    /// silently while the others carry on.
    pub fn freeze_port(&self, port: u16, frozen: bool) {
        let ports = &mut self.lock().e.frozen_ports;
        ports.retain(|p| *p != port);
        if frozen {
            ports.push(port);
        }
    }

    /// Play a stalled backend (tests): I/O commands are received but held; when the stall
    /// ends, the held ones whose queue still exists run in arrival order.
    pub fn stall_io(&self, on: bool) {
        let now = self.now();
        let mut g = self.lock();
        let Locked { e, d } = &mut *g;
        e.stall_io = on;
        if !on {
            let held = std::mem::take(&mut e.stalled);
            e.now = now;
            for (qpn, c) in held {
                if e.queues.contains_key(&qpn) {
                    e.start(d, qpn, c);
                }
            }
        }
    }

    /// Play a lost connection (chaos and tests): controller `cntlid` goes with its queues,
    /// as when its host's connection dies. False if there is no such controller.
    pub fn lose_controller(&self, cntlid: u16) -> bool {
        let now = self.now();
        let mut g = self.lock();
        let Locked { e, d } = &mut *g;
        e.now = now;
        if !e.core.ctrls.contains_key(&cntlid) {
            return false;
        }
        e.core.tear_down.push(cntlid);
        e.tear_down(d);
        true
    }

    /// Set the late-writes fault ([`TargetConfig::late_writes_ms`]) for controllers that
    /// die from now on.
    pub fn late_writes(&self, ms: Option<u32>) {
        self.lock().e.late_writes_ms = ms;
    }

    /// Writes of dead controllers the late-writes fault still holds.
    pub fn late_writes_held(&self) -> usize {
        self.lock().e.late.len()
    }

    /// Tests: once the target has executed command number `after` (counted in
    /// [`TargetStats::commands`], from 1), the returned notifier fires, with the target
    /// frozen first if `freeze` (as [`Target::freeze`]). Faults can thus land between two
    /// given commands of a host's bring-up.
    pub fn trap_after(&self, after: u64, freeze: bool) -> Arc<tokio::sync::Notify> {
        let hit = Arc::new(tokio::sync::Notify::new());
        self.lock().e.trap = Some((after, freeze, hit.clone()));
        hit
    }

    /// I/O commands held by [`Target::stall_io`].
    pub fn stalled_io(&self) -> usize {
        self.lock().e.stalled.len()
    }

    /// Be told the QPN of every queue of port `port` that goes away (its CM side uses it
    /// to forget the connection of a queue the engine dropped by itself).
    pub fn on_drop(&self, port: u16, tx: tokio::sync::mpsc::UnboundedSender<Qpn>) {
        let mut g = self.lock();
        if let Some(p) = g.e.ports.get_mut(port_index(port)) {
            p.dropped = Some(tx);
        }
    }

    /// Number of live queues.
    pub fn queue_count(&self) -> usize {
        self.lock().e.queues.len()
    }

    /// Bytes of queue memory the target holds: receive, response and staging rings of
    /// every queue (what a peer makes us allocate).
    pub fn queue_memory(&self) -> usize {
        self.lock().e.queues.values().map(TQueue::footprint).sum()
    }

    /// One turn of the engine: `f` under the lock at this turn's time, its responses and
    /// work requests held and posted together at the end.
    fn turn(&self, f: impl FnOnce(&mut Engine<D>, &mut Io<D>)) {
        let now = self.now();
        let mut g = self.lock();
        let Locked { e, d } = &mut *g;
        e.now = now;
        e.batching = true;
        d.defer();
        f(e, d);
        e.batching = false;
        e.post_responses(d);
        d.flush();
    }

    async fn serve(self) {
        /// The workers stop with the engine (the device died, or the runtime went), and
        /// its namespace regions are deregistered.
        struct Close<D: DeviceContext>(Target<D>);
        impl<D: DeviceContext> Drop for Close<D> {
            fn drop(&mut self) {
                self.0.pool.close();
                let mut g = self.0.lock();
                let Locked { e, d } = &mut *g;
                e.regions.close(d);
            }
        }
        let _close = Close(self.clone());
        let cq = self.lock().e.port(1).cq;
        let mut first_live = true;
        let mut batch = Vec::with_capacity(256);
        // Keep-alive expiry is checked on this tick; KATO is at least a second in practice.
        let mut tick = tokio::time::interval(KATO_CHECK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            batch.clear();
            let wake = self.late_wake.load(Ordering::Acquire);
            // Biased, the tick first: it is ready four times a second, and a queue that is
            // never idle must not keep every other from being checked for keep-alive.
            tokio::select! {
                biased;
                _ = tick.tick() => {
                    let now = self.now();
                    let mut g = self.lock();
                    let Locked { e, d } = &mut *g;
                    e.now = now;
                    e.expire_controllers(d, now);
                    e.metrics.publish(&e.core.stats);
                    if e.live_ports == 0 {
                        return;
                    }
                }
                _ = self.pool.ready.notified() => self.turn(|e, d| e.answer_finished(d)),
                _ = tokio::time::sleep_until(self.epoch + std::time::Duration::from_nanos(wake)),
                    if wake != NO_WAKE => self.turn(|e, d| e.run_late(d)),
                n = self.dev.wait_cq(cq, 256, &mut batch), if first_live => {
                    if n == 0 {
                        // The first port's device died: the target ends with it unless
                        // another port still serves.
                        first_live = false;
                        if self.port_died(1) == 0 {
                            return;
                        }
                        continue;
                    }
                    self.turn(|e, d| {
                        for wc in &batch {
                            e.on_completion(d, 1, wc);
                        }
                    });
                    // The driver first: it was poked with what this turn posted, and on a
                    // runtime of one thread it runs only once this task is pending; the
                    // loop's next look at the CQ and its waiters can come after.
                    tokio::task::yield_now().await;
                }
            }
        }
    }

    /// Serve the completions of port `port` (one added after the first) until its device
    /// dies.
    async fn serve_port(self, port: u16, dev: D, cq: CqId) {
        let mut batch = Vec::with_capacity(256);
        loop {
            batch.clear();
            if dev.wait_cq(cq, 256, &mut batch).await == 0 {
                self.port_died(port);
                return;
            }
            self.turn(|e, d| {
                for wc in &batch {
                    e.on_completion(d, port, wc);
                }
            });
            tokio::task::yield_now().await;
        }
    }

    /// Port `port`'s device died: its queues go as their hosts do. How many ports still
    /// serve.
    fn port_died(&self, port: u16) -> usize {
        let mut g = self.lock();
        g.e.live_ports = g.e.live_ports.saturating_sub(1);
        if g.e.live_ports > 0 {
            tracing::warn!(port, "port's device died: the other ports serve on");
        }
        g.e.live_ports
    }
}

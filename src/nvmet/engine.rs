//! The target's command engine: queues, controllers, and the capsule → data → execute →
//! response pipeline, driven by completions, under one lock.
//!
//! It runs on any device behind the backend seam ([`crate::verbs`]): PD, MRs, CQ, QPs, posts
//! and completions go through [`DeviceContext`], queue memory is the device's
//! [`HostBuffer`], and time is tokio's clock (virtual on a simulated network), read once per
//! turn, so the state machines themselves read no clock.

use std::collections::VecDeque;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};

use rustc_hash::FxHashMap;
use std::sync::{Arc, Mutex};

use crate::nvme::admin::{cns, feature, opcode};
use crate::nvme::fabrics::{self, ConnectResult, CNTLID_DYNAMIC};
use crate::nvme::{
    Cap, Cc, ConnectData, Cqe, Csts, DiscoveryLogEntry, DiscoveryLogHeader, DsmRange, FabricsCmd,
    FixedStr, IdentifyController, IdentifyNamespace, SglDescriptor, Sqe, Status, Vs,
};
use crate::verbs::{
    Access, CqId, DeviceContext, HostBuffer, Instant, MemKey, MrInfo, Mtu, PdId, PeerInfo, Psn,
    QpCaps, Qpn, RcAttr, RecvWr, SendOp, SendWr, Sgl, VerbsError, WcOpcode, WcStatus,
    WorkCompletion,
};

use super::backend::{Finished, Job, Op, Pool};
use super::budget::{Holder, Ledger, Shares, Usage};
use super::{Namespace, Subsystem, TargetConfig, MAX_NAMESPACES};
use crate::published::{Published, Publisher};

const SQE_LEN: usize = 64;
const CQE_LEN: usize = 16;
/// Admin queues carry no in-capsule data (as Linux sets up).
const ADMIN_CAPSULE: usize = SQE_LEN;
/// Connect data is 1024 bytes; Identify and log pages are 4096.
const ADMIN_STAGING: usize = 8192;
/// Outstanding Async Event Requests we hold per controller (AERL + 1).
const AER_LIMIT: usize = 4;
/// Entries of the Changed Namespace List log page (1024 dwords).
const CHANGED_NS_MAX: usize = 1024;
/// Async event completion Dword 0: Notice (2), namespace attribute changed (0x00), log page
/// 0x04 (changed namespace list).
const AEN_NS_CHANGED: u32 = 0x2 | (0x04 << 16);
/// Notice, discovery log page changed (0xF0), log page 0x70.
const AEN_DISCOVERY_CHANGED: u32 = 0x2 | (0xF0 << 8) | (0x70 << 16);
/// Staging of a queue before Fabrics Connect: room for the Connect data only.
const CONNECT_DATA: usize = 1024;
/// Keep-alive of a discovery controller whose host asked for none (nvmet
/// `NVMET_DISC_KATO_MS`), and the most one may ask for: one left open must not live for
/// ever.
const DISCOVERY_KATO_MS: u32 = 120_000;
/// The largest admin (and discovery) queue a host may ask for: Linux nvmet refuses more
/// (`NVME_AQ_DEPTH`), and a host needs no more for admin commands.
const MAX_ADMIN_QUEUE: usize = 32;

const WR_RECV: u64 = 1;
const WR_RDMA_READ: u64 = 2;
const WR_RDMA_WRITE: u64 = 3;
const WR_SEND: u64 = 4;

fn wr_id(kind: u64, slot: usize) -> u64 {
    (kind << 32) | slot as u64
}

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

/// The target's counters as metrics, labelled with its service port: what a peer made it
/// refuse or drop (refused queues, malformed capsules, exhausted controller IDs, keep-alive
/// expiries) beside its traffic.
const COUNTERS: &[Published<TargetStats>] = &[
    ("nvmet_commands_total", None, |s| s.commands),
    ("nvmet_command_errors_total", None, |s| s.errors),
    ("nvmet_malformed_capsules_total", None, |s| {
        s.malformed_capsules
    }),
    ("nvmet_refused_queues_total", None, |s| s.refused_queues),
    ("nvmet_cntlid_exhausted_total", None, |s| s.cntlid_exhausted),
    ("nvmet_kato_expired_total", None, |s| s.kato_expired),
    ("nvmet_queues_connected_total", None, |s| s.queues_connected),
    ("nvmet_queues_dropped_total", None, |s| s.queues_dropped),
    ("nvmet_offloaded_commands_total", None, |s| s.offloaded),
    ("nvmet_read_bytes_total", None, |s| s.bytes_read),
    ("nvmet_written_bytes_total", None, |s| s.bytes_written),
    ("nvmet_io_copies_total", None, |s| s.io_copies),
];

/// Counters a person (or a test) can read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TargetStats {
    pub commands: u64,
    pub errors: u64,
    pub malformed_capsules: u64,
    /// Capsules that waited for a command slot (see `TQueue::held`).
    pub held_capsules: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub queues_connected: u64,
    pub queues_dropped: u64,
    /// Commands ignored while frozen.
    pub ignored_frozen: u64,
    /// Controllers torn down because their host went silent for KATO.
    pub kato_expired: u64,
    /// CM REQs refused for a queue cap or because memory ran out.
    pub refused_queues: u64,
    /// Fabrics Connects refused because no controller ID was free.
    pub cntlid_exhausted: u64,
    /// Commands whose namespace work ran on a worker thread, off the engine.
    pub offloaded: u64,
    /// Payload copies the target made for I/O commands (in-capsule data into a RAM
    /// namespace or into staging, staging to and from the namespace or a worker's buffer)
    /// and their bytes; what the kernel copies for a file namespace is not counted, nor
    /// RDMA straight from or into a RAM namespace (no copy).
    pub io_copies: u64,
    pub io_copied_bytes: u64,
}

/// One line for a person: what the target did (the `stopping` line of `nvmf-rdma target`).
impl std::fmt::Display for TargetStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} commands ({} failed, {} malformed), {} bytes read, {} written, \
             {} queues connected, {} dropped ({} for keep-alive), {} refused",
            self.commands,
            self.errors,
            self.malformed_capsules,
            self.bytes_read,
            self.bytes_written,
            self.queues_connected,
            self.queues_dropped,
            self.kato_expired,
            self.refused_queues,
        )
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Free,
    /// Waiting for RDMA READ of the host's data.
    Fetching,
    /// Response (and data) posted; waiting for the SEND completion.
    Responding,
    /// An Async Event Request, held until there is an event (or the queue goes).
    Parked,
    /// Its namespace work runs on a worker ([`super::backend`]).
    Executing,
}

struct Cmd {
    stage: Stage,
    sqe: Sqe,
    /// How long the capsule was, in-capsule data included (that data is in the slot's
    /// staging).
    capsule_len: usize,
    /// Where the data for the host is when not in the slot's staging: an address and lkey
    /// in a RAM namespace's memory region (a read sent without a copy). Taken by `respond`.
    src: Option<(u64, MemKey)>,
    /// Its data was fetched straight into a RAM namespace (a write without a copy).
    landed: bool,
    /// An in-capsule write's data, still in its receive buffer (offset, bytes there): set by
    /// `on_capsule` while it runs the command, which posts the buffer again only after. The
    /// write copies it into the namespace from there, or into staging for a worker.
    inline: Option<(usize, usize)>,
}

/// A queue is born small: until Fabrics Connect succeeds it has one command slot, one
/// receive buffer and staging for the Connect data, whatever size the REQ asked for, so a
/// peer that is not (yet) a host of ours costs a few KiB per queue. A successful Connect
/// gives it `size` slots and `max_transfer` of staging each (`Engine::grow`).
///
/// One slot, not a few: the single receive buffer is reposted only once the command it
/// carried is answered, and never after a Connect that succeeds, so when the rings are
/// replaced nothing posted (receive, READ or SEND) still points into the old ones.
struct TQueue<M> {
    qid: u16,
    /// Path MTU of its QP, bytes: the most one packet carries.
    mtu: u32,
    /// The queue size the host asked for (and gets after Connect).
    size: usize,
    /// Command slots and receive buffers allocated now: 1 before Connect, then `size`.
    slots: usize,
    cntlid: Option<u16>,
    capsule_len: usize,
    /// Staging per slot now: `CONNECT_DATA` before Connect, then `io_staging_len`.
    staging_len: usize,
    io_staging_len: usize,
    /// Full rings in place (Fabrics Connect succeeded).
    grown: bool,
    /// Before Connect: the one receive buffer holds a capsule not yet answered, so it is
    /// not posted.
    boot_held: bool,
    /// Counted against `max_unconnected_per_ip` from its RTU until Fabrics Connect
    /// succeeds, and against `max_pre_rtu_per_ip` before its RTU.
    peer_ip: IpAddr,
    /// Its RTU arrived (or its first capsule, which proves the same): before that it sits
    /// in the pre-RTU table and counts against no budget.
    established: bool,
    /// What it holds of the budgets ([`Ledger`]), and the host NQN that was charged for it
    /// (once Fabrics Connect named one): given back when it goes.
    charged: Usage,
    host: Option<Box<str>>,
    recv: Ring<M>,
    rsp: Ring<M>,
    data: Ring<M>,
    cmds: Vec<Cmd>,
    free: Vec<usize>,
    /// Capsules that arrived while every command slot was taken, by receive buffer (not
    /// reposted until they get a slot). A host may send its next command as soon as it has
    /// a response, before its ACK of that response reaches us and frees the slot; Linux
    /// nvmet keeps twice the queue's response contexts for the same reason. Bounded by the
    /// receive buffers, so it never grows past the queue size.
    held: VecDeque<(usize, usize)>,
    dead: bool,
    /// When the queue was accepted: one that never completes Fabrics Connect is dropped.
    born: Instant,
    /// This incarnation of the queue, for work finished on a worker after it went.
    token: u64,
    /// Cleared when the queue goes, so its jobs stop.
    alive: Arc<AtomicBool>,
}

impl<M: HostBuffer> TQueue<M> {
    fn footprint(&self) -> usize {
        self.recv.0.len() + self.rsp.0.len() + self.data.0.len()
    }

    /// Copy `len` bytes of in-capsule data, at `from` in the receive ring, into slot `c`'s
    /// staging.
    fn stage_from_recv(&self, c: usize, from: usize, len: usize) {
        let recv = &self.recv.0;
        self.data
            .0
            .with_range(c * self.staging_len, len, |g| recv.read(from, g));
    }

    /// Slot `c`'s staging as the device sees it: address and lkey.
    fn staging_at(&self, c: usize) -> (u64, MemKey) {
        (
            self.data.1.addr + (c * self.staging_len) as u64,
            self.data.1.lkey,
        )
    }
}

struct Ctrl {
    subsys: usize,
    hostnqn: String,
    hostid: [u8; 16],
    cc: Cc,
    csts: Csts,
    kato_ms: u32,
    io_queues: u16,
    queues: Vec<Qpn>,
    aers: usize,
    /// Asynchronous events not yet reported (no AER was outstanding), as completion Dword
    /// 0 values; at most one of each kind, so bounded by the kinds there are.
    events: Vec<u32>,
    /// Namespaces changed since the host last read the Changed Namespace List log page
    /// (at most [`CHANGED_NS_MAX`]; past it the list says "more than that": 0xFFFFFFFF).
    changed_ns: Vec<u32>,
    /// Last command seen from any of its queues (keep-alive is traffic based); `None`
    /// until the first expiry check.
    last_seen: Option<Instant>,
}

struct Engine<D: DeviceContext> {
    cfg: Arc<TargetConfig>,
    pd: PdId,
    cq: CqId,
    /// Depth of `cq`, and how much of it the queues' slots can fill
    /// ([`CQES_PER_SLOT`] each): a queue that would overrun the CQ is refused.
    cqes: usize,
    cqes_used: usize,
    queues: FxHashMap<Qpn, TQueue<D::Mem>>,
    ctrls: FxHashMap<u16, Ctrl>,
    next_cntlid: u16,
    /// Established queues without a controller (no Fabrics Connect yet) per peer IP
    /// address, for `max_unconnected_per_ip`.
    per_ip: FxHashMap<IpAddr, usize>,
    /// Queues waiting for their RTU, per peer IP address and in all.
    pre_rtu_per_ip: FxHashMap<IpAddr, usize>,
    pre_rtu: usize,
    /// The most queues that may wait for their RTU (`max_pre_rtu`, less on a small CQ).
    pre_rtu_cap: usize,
    /// Who holds how much of the queue and CQ budgets.
    ledger: Ledger,
    stats: TargetStats,
    /// A hung controller: commands are taken off the wire and never answered.
    frozen: bool,
    /// A stalled backend: I/O commands are held until the stall ends, then executed.
    stall_io: bool,
    stalled: Vec<(Qpn, usize)>,
    /// A test's trap: after the target has executed this many commands in all, wake the
    /// test (and freeze, if asked) before anything else happens.
    trap: Option<(u64, bool, Arc<tokio::sync::Notify>)>,
    /// The engine's clock as of the current turn.
    now: Instant,
    /// Queues the engine dropped on its own (keep-alive expiry, transport error): the CM
    /// side forgets their connections.
    dropped: Option<tokio::sync::mpsc::UnboundedSender<Qpn>>,
    /// Inside a batch of completions: response SENDs wait in `responses` until the batch
    /// ends, so the batch's RDMA WRITEs leave back to back, then its responses (each
    /// response still after its own data). Runs of equal-sized packets go out as one
    /// segmented send instead of alternating data/response sends.
    batching: bool,
    responses: Vec<(Qpn, usize)>,
    /// Namespace work off the engine's task.
    pool: Arc<Pool<D::Mem>>,
    next_token: u64,
    /// Finished jobs being answered (kept, so a turn allocates nothing).
    finished: Vec<Finished>,
    /// `stats` as metrics, published on the keep-alive tick.
    metrics: Publisher<TargetStats>,
    /// RAM namespaces read so far, with their memory region on our PD where the device
    /// registers their memory (`None`: it cannot, reads copy through staging). Registered
    /// on first use, deregistered when the namespace is gone from every subsystem or the
    /// engine closes.
    ns_mrs: Vec<(Arc<Namespace>, Option<MrInfo>)>,
}

/// The engine and the device it posts to, under one lock.
struct Locked<D: DeviceContext> {
    e: Engine<D>,
    d: Io<D>,
}

/// A running target on one device context. Cheap to clone.
pub struct Target<D: DeviceContext> {
    dev: D,
    engine: Arc<Mutex<Locked<D>>>,
    /// Zero of the engine's clock (tokio's, so virtual on a simulated network).
    epoch: tokio::time::Instant,
    pool: Arc<Pool<D::Mem>>,
}

impl<D: DeviceContext> Clone for Target<D> {
    fn clone(&self) -> Self {
        Target {
            dev: self.dev.clone(),
            engine: self.engine.clone(),
            epoch: self.epoch,
            pool: self.pool.clone(),
        }
    }
}

/// The largest CQ the target asks for; a device that offers less gets asked for half, down
/// to [`MIN_CQ`].
const MAX_CQ: usize = 1 << 16;
const MIN_CQ: usize = 1 << 10;
/// Completions one command slot can have outstanding: its receive, an RDMA READ (or an
/// unsignaled WRITE, which completes only when flushed) and its response SEND.
const CQES_PER_SLOT: usize = 3;
/// Worker threads for namespace work, at most (started as work first needs them).
const IO_WORKERS: usize = 4;

impl<D: DeviceContext> Target<D> {
    /// Set up the target's PD and CQ on `dev` and start the task that serves completions.
    pub fn start(dev: D, cfg: TargetConfig) -> Result<Target<D>, VerbsError> {
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
        let e = Engine {
            cfg: Arc::new(cfg),
            pd,
            cq,
            cqes: depth,
            cqes_used: 0,
            queues: FxHashMap::default(),
            ctrls: FxHashMap::default(),
            next_cntlid: 1,
            per_ip: FxHashMap::default(),
            pre_rtu_per_ip: FxHashMap::default(),
            pre_rtu: 0,
            pre_rtu_cap,
            ledger: Ledger::new(whole, shares),
            stats: TargetStats::default(),
            frozen: false,
            stall_io: false,
            stalled: Vec::new(),
            trap: None,
            now: Instant(0),
            dropped: None,
            batching: false,
            responses: Vec::with_capacity(256),
            pool: pool.clone(),
            next_token: 0,
            finished: Vec::new(),
            metrics,
            ns_mrs: Vec::new(),
        };
        let d = Io::new(dev.clone());
        let t = Target {
            dev,
            engine: Arc::new(Mutex::new(Locked { e, d })),
            epoch: tokio::time::Instant::now(),
            pool,
        };
        let task = t.clone();
        tokio::spawn(async move { task.serve().await });
        Ok(t)
    }

    /// The device context the target runs on.
    pub fn device(&self) -> &D {
        &self.dev
    }

    pub fn config(&self) -> Arc<TargetConfig> {
        self.lock().e.cfg.clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Locked<D>> {
        self.engine.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn now(&self) -> Instant {
        Instant(self.epoch.elapsed().as_nanos() as u64)
    }

    pub fn stats(&self) -> TargetStats {
        self.lock().e.stats.clone()
    }

    /// Accept a queue connection: create its QP and rings, let `bind` tie the QP to its
    /// connection request ([`crate::verbs::CmListen::attach`]), bring the QP to RTS, post
    /// the receive ring. Returns our QPN and the receive queue size (crqsize).
    pub fn accept(
        &self,
        p: ConnParams,
        bind: impl FnOnce(Qpn) -> bool,
    ) -> Result<(Qpn, u16), ConnReject> {
        let now = self.now();
        let mut g = self.lock();
        let Locked { e, d } = &mut *g;
        e.now = now;
        e.add_queue(d, p, bind)
    }

    /// The peer of `qpn` sent its CM RTU: the queue leaves the pre-RTU table and counts
    /// against its address's budgets (it goes if that is past them).
    pub fn established(&self, qpn: Qpn) {
        let mut g = self.lock();
        let Locked { e, d } = &mut *g;
        e.establish(d, qpn);
    }

    /// The host went away (CM disconnect, transport error): drop the queue and, for an
    /// admin queue, its controller and every queue of it.
    pub fn drop_queue(&self, qpn: Qpn) {
        let mut g = self.lock();
        let Locked { e, d } = &mut *g;
        e.remove_queue(d, qpn);
    }

    /// Add namespace `ns` to the running subsystem `subnqn`. Its controllers are told with a
    /// Namespace Attribute Changed event (and the Changed Namespace List log page).
    pub fn add_namespace(&self, subnqn: &str, ns: Namespace) -> Result<(), String> {
        let mut g = self.lock();
        let Locked { e, d } = &mut *g;
        let idx = e
            .cfg
            .subsystems
            .iter()
            .position(|s| s.nqn.as_str() == subnqn)
            .ok_or_else(|| format!("no subsystem {subnqn}"))?;
        let nsid = ns.nsid;
        if e.cfg.subsystems[idx]
            .namespaces
            .iter()
            .any(|n| n.nsid == nsid)
        {
            return Err(format!("namespace {nsid} exists in {subnqn}"));
        }
        if e.cfg.subsystems[idx].namespaces.len() >= MAX_NAMESPACES {
            return Err(format!(
                "{subnqn} has {MAX_NAMESPACES} namespaces, all a host can list"
            ));
        }
        Arc::make_mut(&mut e.cfg).subsystems[idx]
            .namespaces
            .push(Arc::new(ns));
        tracing::info!(subsystem = subnqn, nsid, "namespace added");
        let ids: Vec<u16> = e
            .ctrls
            .iter()
            .filter(|(_, c)| c.subsys == idx)
            .map(|(id, _)| *id)
            .collect();
        for id in &ids {
            if let Some(c) = e.ctrls.get_mut(id) {
                if c.changed_ns.len() < CHANGED_NS_MAX {
                    c.changed_ns.push(nsid);
                } else {
                    c.changed_ns = vec![0xFFFF_FFFF];
                }
            }
        }
        for id in ids {
            e.raise(d, id, AEN_NS_CHANGED);
        }
        Ok(())
    }

    /// Add subsystem `sub` to the running target. Discovery controllers are told with a
    /// Discovery Log Page Changed event.
    pub fn add_subsystem(&self, sub: Subsystem) -> Result<(), String> {
        let mut g = self.lock();
        let Locked { e, d } = &mut *g;
        if e.cfg.subsystems.iter().any(|s| s.nqn == sub.nqn) {
            return Err(format!("subsystem {} exists", sub.nqn.as_str()));
        }
        tracing::info!(subsystem = sub.nqn.as_str(), "subsystem added");
        Arc::make_mut(&mut e.cfg).subsystems.push(sub);
        let ids: Vec<u16> = e
            .ctrls
            .iter()
            .filter(|(_, c)| c.subsys == usize::MAX)
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            e.raise(d, id, AEN_DISCOVERY_CHANGED);
        }
        Ok(())
    }

    /// Play a hung controller (chaos and tests): while frozen, every command that arrives
    /// is dropped unanswered; the transport and CM keep working.
    pub fn freeze(&self, frozen: bool) {
        self.lock().e.frozen = frozen;
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

    /// Be told the QPN of every queue that goes away (the CM side uses it to forget the
    /// connection of a queue the engine dropped by itself).
    pub fn on_drop(&self, tx: tokio::sync::mpsc::UnboundedSender<Qpn>) {
        self.lock().e.dropped = Some(tx);
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
                for (_, mr) in e.ns_mrs.drain(..) {
                    if let Some(mr) = mr {
                        d.dev.dereg_mr(&mr);
                    }
                }
            }
        }
        let _close = Close(self.clone());
        let cq = self.lock().e.cq;
        let mut batch = Vec::with_capacity(256);
        // Keep-alive expiry is checked on this tick; KATO is at least a second in practice.
        let mut tick = tokio::time::interval(KATO_CHECK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            batch.clear();
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
                    e.metrics.publish(&e.stats);
                }
                _ = self.pool.ready.notified() => self.turn(|e, d| e.answer_finished(d)),
                n = self.dev.wait_cq(cq, 256, &mut batch) => {
                    if n == 0 {
                        return; // the device died
                    }
                    self.turn(|e, d| {
                        for wc in &batch {
                            e.on_completion(d, wc);
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
}

/// The smallest keyed write fetched straight into a RAM namespace; smaller ones land in
/// staging and are copied. Measured with the ext engine (`fio-plugin/cpu-ab.sh`, same
/// machine, alternated), straight into the namespace against staged: host + target CPU per
/// random write 1.10x at 16 KiB (and 15% fewer IOPS), 1.04x at 32 KiB, 0.98x at 64 KiB and
/// 0.95x at 128 KiB (9% more IOPS); 4 KiB keyed writes in the own loop ran 5% slower.
/// Landing in staging and copying to the namespace in one pass costs less than scattering
/// packets into cold namespace lines until the transfer is large.
const DIRECT_WRITE_MIN: usize = 64 << 10;

/// A queue without a controller this long after it was accepted is dropped.
const ORPHAN_QUEUE_NS: u64 = 10_000_000_000;

/// What an established queue holds before its Fabrics Connect: one slot.
const ONE_SLOT: Usage = Usage {
    queues: 1,
    cqes: CQES_PER_SLOT,
};

/// A queue's source address before its Connect names a host.
fn unnamed(ip: IpAddr) -> Holder<'static> {
    Holder {
        ip,
        host: None,
        listed: false,
    }
}

/// The keep-alive timeout a controller gets for the one its host `asked` for (ms), or
/// `None` past the most it may have: `max_kato_ms`, and for a discovery controller at most
/// [`DISCOVERY_KATO_MS`]. None asked for (0) gets that most: nvmet gives a discovery
/// controller one for the same reason, a controller whose host left must not live for
/// ever.
fn kato(asked: u32, discovery: bool, max_kato_ms: u32) -> Option<u32> {
    let most = if discovery {
        max_kato_ms.min(DISCOVERY_KATO_MS)
    } else {
        max_kato_ms
    };
    match asked {
        0 => Some(most),
        k if k <= most => Some(k),
        _ => None,
    }
}

/// How often controllers are checked for keep-alive expiry.
const KATO_CHECK: std::time::Duration = std::time::Duration::from_millis(250);

fn rc_attr(mtu: Mtu) -> RcAttr {
    RcAttr {
        mtu,
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        max_unacked: 256,
    }
}

/// The device as the engine uses it, with the lists a post goes through (kept, so that
/// posting allocates nothing).
struct Io<D> {
    dev: D,
    recvs: Vec<RecvWr>,
    sends: Vec<SendWr>,
    /// While a batch of completions is handled, work requests wait here and go to the device
    /// in one post per QP at the end of the turn ([`Io::flush`]): one device lock and one
    /// driver wake-up per QP and turn, not three per command.
    deferring: bool,
    /// Held requests with their QP and the order they were made in.
    pending: Vec<(Qpn, u32, Wr)>,
}

enum Wr {
    Send(SendWr),
    Recv(RecvWr),
}

impl<D: DeviceContext> Io<D> {
    fn new(dev: D) -> Io<D> {
        Io {
            dev,
            recvs: Vec::with_capacity(1),
            sends: Vec::with_capacity(1),
            deferring: false,
            pending: Vec::new(),
        }
    }

    /// Post `wr` on `qpn` (at the end of the turn while deferring: a QP that refuses it then
    /// is broken, and its queue goes with the completions that say so).
    fn post_send(&mut self, qpn: Qpn, wr: SendWr) -> Result<(), VerbsError> {
        if self.deferring {
            let n = self.pending.len() as u32;
            self.pending.push((qpn, n, Wr::Send(wr)));
            return Ok(());
        }
        self.sends.push(wr);
        self.dev.post(qpn, &mut self.recvs, &mut self.sends)
    }

    fn post_recv(&mut self, qpn: Qpn, wr: RecvWr) -> Result<(), VerbsError> {
        if self.deferring {
            let n = self.pending.len() as u32;
            self.pending.push((qpn, n, Wr::Recv(wr)));
            return Ok(());
        }
        self.recvs.push(wr);
        self.dev.post(qpn, &mut self.recvs, &mut self.sends)
    }

    /// Hold work requests until [`Io::flush`].
    fn defer(&mut self) {
        self.deferring = true;
    }

    /// Post what was held, one post per QP, each QP's requests in the order they were made.
    fn flush(&mut self) {
        self.deferring = false;
        // By QP, then in the order made (an RDMA WRITE before its response); an unstable
        // sort on both keys keeps that order without the merge buffer a stable sort
        // allocates every turn.
        self.pending
            .sort_unstable_by_key(|(qpn, n, _)| (qpn.get(), *n));
        let mut i = 0;
        while i < self.pending.len() {
            let qpn = self.pending[i].0;
            while i < self.pending.len() && self.pending[i].0 == qpn {
                match &self.pending[i].2 {
                    Wr::Send(w) => self.sends.push(*w),
                    Wr::Recv(w) => self.recvs.push(*w),
                }
                i += 1;
            }
            // A refusal means the QP is broken: its queue goes with its error completions.
            let _ = self.dev.post(qpn, &mut self.recvs, &mut self.sends);
            self.recvs.clear();
            self.sends.clear();
        }
        self.pending.clear();
    }
}

impl<D: DeviceContext> Engine<D> {
    /// Linux nvmet: a controller that hears nothing from its host for KATO is torn down with
    /// its queues (the host's recovery makes a new one). Any command counts as traffic.
    fn expire_controllers(&mut self, d: &mut Io<D>, now: Instant) {
        let mut dead = Vec::new();
        for (id, c) in self.ctrls.iter_mut() {
            let seen = *c.last_seen.get_or_insert(now);
            if c.kato_ms > 0 && now.0.saturating_sub(seen.0) > c.kato_ms as u64 * 1_000_000 {
                dead.push((*id, c.queues.first().copied()));
            }
        }
        // A queue whose host never sent Fabrics Connect (it died mid-connect) belongs to no
        // controller that could expire; give it the longest KATO we allow.
        let orphans: Vec<Qpn> = self
            .queues
            .iter()
            .filter(|(_, q)| q.cntlid.is_none() && now.0.saturating_sub(q.born.0) > ORPHAN_QUEUE_NS)
            .map(|(qpn, _)| *qpn)
            .collect();
        for qpn in orphans {
            self.remove_queue(d, qpn);
        }
        for (id, admin) in dead {
            tracing::info!(cntlid = id, "keep-alive timeout: controller torn down");
            self.stats.kato_expired += 1;
            match admin {
                Some(qpn) => self.remove_queue(d, qpn),
                None => {
                    self.ctrls.remove(&id);
                }
            }
        }
    }

    fn add_queue(
        &mut self,
        d: &mut Io<D>,
        p: ConnParams,
        bind: impl FnOnce(Qpn) -> bool,
    ) -> Result<(Qpn, u16), ConnReject> {
        let size = p.hsqsize as usize + 1;
        if p.qid == 0 && !(fabrics::MIN_ADMIN_SQ_ENTRIES as usize..=MAX_ADMIN_QUEUE).contains(&size)
        {
            return Err(ConnReject::InvalidHsqsize);
        }
        if size < 2 || size > self.cfg.max_queue_size as usize {
            return Err(ConnReject::InvalidHsqsize);
        }
        if (p.hrqsize as usize) < size {
            return Err(ConnReject::InvalidHrqsize);
        }
        // A REQ costs a queue of one slot in the pre-RTU table, never a share of the
        // budgets: its source address may be forged. A peer already holding its share of
        // established queues is refused here rather than after its RTU.
        let ip = p.peer.addr.ip();
        let of_ip = self.per_ip.get(&ip).copied().unwrap_or(0);
        let waiting = self.pre_rtu_per_ip.get(&ip).copied().unwrap_or(0);
        if of_ip >= self.cfg.max_unconnected_per_ip
            || waiting >= self.cfg.max_pre_rtu_per_ip
            || self.pre_rtu_cap == 0
            || self.ledger.admits(unnamed(ip), ONE_SLOT).is_err()
        {
            self.stats.refused_queues += 1;
            return Err(ConnReject::NoResources);
        }
        if self.pre_rtu >= self.pre_rtu_cap {
            self.evict_oldest_pre_rtu(d);
        }
        if self.cqes_used + CQES_PER_SLOT > self.cqes {
            self.stats.refused_queues += 1;
            return Err(ConnReject::NoResources);
        }
        let admin = p.qid == 0;
        let capsule_len = if admin {
            ADMIN_CAPSULE
        } else {
            SQE_LEN + self.cfg.inline_data as usize
        };
        let io_staging_len = if admin {
            ADMIN_STAGING
        } else {
            self.cfg.max_transfer as usize
        };
        let Some((rings, cmds)) = alloc_rings(d, self.pd, 1, capsule_len, CONNECT_DATA) else {
            self.stats.refused_queues += 1;
            return Err(ConnReject::NoResources);
        };
        let [recv, rsp, data] = rings;
        let caps = QpCaps {
            max_send_wr: (size * 3) as u32,
            max_recv_wr: size as u32,
        };
        let mrs = [recv.1, rsp.1, data.1];
        let cleanup = |d: &mut Io<D>| {
            for mr in &mrs {
                d.dev.dereg_mr(mr);
            }
        };
        let qpn = match d.dev.create_rc_qp(self.pd, self.cq, caps, Access::empty()) {
            Ok(q) => q,
            Err(_) => {
                cleanup(d);
                self.stats.refused_queues += 1;
                return Err(ConnReject::NoResources);
            }
        };
        let psn = p.local_psn;
        let recv_wr = RecvWr {
            wr_id: wr_id(WR_RECV, 0),
            sgl: Sgl::one(recv.1.addr, capsule_len as u32, recv.1.lkey),
        };
        let ok = bind(qpn)
            && d.dev
                .rc_to_rts(qpn, p.peer, psn, &rc_attr(p.path_mtu))
                .is_ok()
            && d.post_recv(qpn, recv_wr).is_ok();
        if !ok {
            d.dev.destroy_qp(qpn);
            cleanup(d);
            self.stats.refused_queues += 1;
            return Err(ConnReject::NoResources);
        }
        self.queues.insert(
            qpn,
            TQueue {
                qid: p.qid,
                mtu: p.path_mtu.bytes(),
                size,
                slots: 1,
                cntlid: None,
                born: self.now,
                capsule_len,
                staging_len: CONNECT_DATA,
                io_staging_len,
                grown: false,
                boot_held: false,
                peer_ip: ip,
                established: false,
                charged: Usage::default(),
                host: None,
                recv,
                rsp,
                data,
                cmds,
                free: vec![0],
                held: VecDeque::new(),
                dead: false,
                token: self.next_token,
                alive: Arc::new(AtomicBool::new(true)),
            },
        );
        self.next_token += 1;
        *self.pre_rtu_per_ip.entry(ip).or_insert(0) += 1;
        self.pre_rtu += 1;
        self.cqes_used += CQES_PER_SLOT;
        self.stats.queues_connected += 1;
        Ok((qpn, size as u16))
    }

    /// The oldest queue still waiting for its RTU goes, to make room in the pre-RTU table:
    /// a real host's RTU comes back within a round trip, so the oldest is the likeliest to
    /// be a forged REQ's.
    fn evict_oldest_pre_rtu(&mut self, d: &mut Io<D>) {
        let oldest = self
            .queues
            .iter()
            .filter(|(_, q)| !q.established)
            .min_by_key(|(_, q)| q.token)
            .map(|(qpn, _)| *qpn);
        if let Some(qpn) = oldest {
            self.remove_queue(d, qpn);
        }
    }

    /// The peer of `qpn` answered our REP (its RTU, or a first capsule, which it could
    /// send only after reading the REP): the queue leaves the pre-RTU table and counts
    /// against its address's share and `max_unconnected_per_ip`. Past them it goes, and
    /// `false` says so.
    fn establish(&mut self, d: &mut Io<D>, qpn: Qpn) -> bool {
        let Some(q) = self.queues.get(&qpn) else {
            return false;
        };
        if q.established {
            return true;
        }
        let ip = q.peer_ip;
        let unconnected = self.per_ip.get(&ip).copied().unwrap_or(0);
        let verdict = self.ledger.admits(unnamed(ip), ONE_SLOT);
        if unconnected >= self.cfg.max_unconnected_per_ip || verdict.is_err() {
            tracing::debug!(peer = %ip, "established queue dropped: over its address's share");
            self.stats.refused_queues += 1;
            self.remove_queue(d, qpn);
            return false;
        }
        self.leave_pre_rtu(ip);
        self.ledger.charge(unnamed(ip), ONE_SLOT);
        *self.per_ip.entry(ip).or_insert(0) += 1;
        if let Some(q) = self.queues.get_mut(&qpn) {
            q.established = true;
            q.charged = ONE_SLOT;
        }
        true
    }

    fn leave_pre_rtu(&mut self, ip: IpAddr) {
        self.pre_rtu = self.pre_rtu.saturating_sub(1);
        if let Some(n) = self.pre_rtu_per_ip.get_mut(&ip) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.pre_rtu_per_ip.remove(&ip);
            }
        }
    }

    /// Fabrics Connect is about to succeed on `qpn` for `host` (`listed`: named in its
    /// subsystem's allow-list): charge the queue's full size to its address, network and
    /// host, give it its full rings and post every receive buffer, before the Connect
    /// response tells the host it may send. The one pre-Connect slot is carried over (it
    /// holds the Connect). Past a share, or out of memory, is a Connect failure, not an
    /// abort.
    fn grow(&mut self, d: &mut Io<D>, qpn: Qpn, host: &str, listed: bool) -> Result<(), Status> {
        let no_mem = Status::INTERNAL_ERROR;
        let pd = self.pd;
        let q = self.queues.get(&qpn).ok_or(no_mem)?;
        if q.grown {
            return Ok(());
        }
        let (ip, had) = (q.peer_ip, q.charged);
        let full = Usage {
            queues: 1,
            cqes: q.size * CQES_PER_SLOT,
        };
        let named = Holder {
            ip,
            host: Some(host),
            listed,
        };
        self.ledger.refund(unnamed(ip), had);
        let verdict = self.ledger.admits(named, full);
        self.ledger.charge(unnamed(ip), had);
        if let Err(over) = verdict {
            tracing::info!(peer = %ip, host, "Fabrics Connect refused: {over}");
            self.stats.refused_queues += 1;
            return Err(Status::CONNECT_CONTROLLER_BUSY);
        }
        let q = self.queues.get_mut(&qpn).ok_or(no_mem)?;
        let (size, old) = (q.size, q.cmds.len());
        // The CQ is shared by every queue: one that could overrun it is not grown.
        let more = (size - q.slots) * CQES_PER_SLOT;
        if self.cqes_used + more > self.cqes {
            return Err(no_mem);
        }
        let (rings, extra) = alloc_rings(d, pd, size, q.capsule_len, q.io_staging_len)
            .map(|(r, c)| (r, c.into_iter().skip(old)))
            .ok_or(no_mem)?;
        let mut free = Vec::new();
        let fits = free.try_reserve_exact(size).is_ok()
            && q.held.try_reserve(size).is_ok()
            && q.cmds.try_reserve_exact(size - old).is_ok();
        let [recv, rsp, data] = rings;
        if !fits {
            for mr in [recv.1, rsp.1, data.1] {
                d.dev.dereg_mr(&mr);
            }
            return Err(no_mem);
        }
        q.cmds.extend(extra);
        free.extend((old..size).rev());
        free.extend_from_slice(&q.free);
        q.free = free;
        for (now, new) in [(&mut q.recv, recv), (&mut q.rsp, rsp), (&mut q.data, data)] {
            let gone = std::mem::replace(now, new);
            d.dev.dereg_mr(&gone.1);
        }
        q.slots = size;
        self.cqes_used += more;
        q.staging_len = q.io_staging_len;
        q.grown = true;
        q.charged = full;
        q.host = Some(host.into());
        self.ledger.refund(unnamed(ip), had);
        self.ledger.charge(named, full);
        for r in 0..size {
            if !repost(d, qpn, q, r) {
                return Err(no_mem);
            }
        }
        Ok(())
    }

    /// A queue of `ip` stops counting as unconnected (Connect succeeded, or it went).
    fn connected_or_gone(&mut self, ip: IpAddr) {
        if let Some(n) = self.per_ip.get_mut(&ip) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.per_ip.remove(&ip);
            }
        }
    }

    fn remove_queue(&mut self, d: &mut Io<D>, qpn: Qpn) {
        let Some(q) = self.queues.remove(&qpn) else {
            return;
        };
        q.alive.store(false, Ordering::Release);
        self.pool.purge(q.token);
        d.dev.destroy_qp(qpn);
        for mr in [q.recv.1, q.rsp.1, q.data.1] {
            d.dev.dereg_mr(&mr);
        }
        self.cqes_used = self.cqes_used.saturating_sub(q.slots * CQES_PER_SLOT);
        if !q.established {
            self.leave_pre_rtu(q.peer_ip);
        } else {
            let who = Holder {
                ip: q.peer_ip,
                host: q.host.as_deref(),
                listed: false,
            };
            self.ledger.refund(who, q.charged);
            if q.cntlid.is_none() {
                self.connected_or_gone(q.peer_ip);
            }
        }
        self.stats.queues_dropped += 1;
        if let Some(tx) = &self.dropped {
            let _ = tx.send(qpn);
        }
        if let Some(c) = q.cntlid {
            if q.qid == 0 {
                if let Some(ctrl) = self.ctrls.remove(&c) {
                    tracing::info!(
                        cntlid = c,
                        host = %ctrl.hostnqn,
                        "host disconnected: controller torn down"
                    );
                    for other in ctrl.queues {
                        if other != qpn {
                            self.remove_queue(d, other);
                        }
                    }
                }
            } else if let Some(ctrl) = self.ctrls.get_mut(&c) {
                ctrl.queues.retain(|x| *x != qpn);
            }
        }
    }

    fn on_completion(&mut self, d: &mut Io<D>, wc: &WorkCompletion) {
        let kind = wc.wr_id >> 32;
        let slot = (wc.wr_id & 0xFFFF_FFFF) as usize;
        if wc.status != WcStatus::Success {
            // A transport error ends the queue (and, for an admin queue, its controller);
            // the host's recovery reconnects.
            if let Some(q) = self.queues.get_mut(&wc.qpn) {
                if !q.dead {
                    q.dead = true;
                    self.remove_queue(d, wc.qpn);
                }
            }
            return;
        }
        match (kind, wc.opcode) {
            (WR_RECV, WcOpcode::Recv) => self.on_capsule(d, wc.qpn, slot, wc.byte_len as usize),
            (WR_RDMA_READ, _) => self.execute(d, wc.qpn, slot),
            (WR_SEND, _) => {
                if let Some(q) = self.queues.get_mut(&wc.qpn) {
                    if let Some(c) = q.cmds.get_mut(slot) {
                        if c.stage == Stage::Responding {
                            c.stage = Stage::Free;
                            q.free.push(slot);
                            if let Some((r, len)) = q.held.pop_front() {
                                self.on_capsule(d, wc.qpn, r, len);
                            }
                        }
                    }
                }
            }
            _ => {}
        }
    }

    fn on_capsule(&mut self, d: &mut Io<D>, qpn: Qpn, r: usize, len: usize) {
        let Some(q) = self.queues.get_mut(&qpn) else {
            return;
        };
        if !q.established {
            // The capsule may overtake the CM's word of the RTU (IB CM COMM_EST).
            if self.establish(d, qpn) {
                self.on_capsule(d, qpn, r, len);
            }
            return;
        }
        if r >= q.slots {
            return;
        }
        if self.frozen {
            self.stats.ignored_frozen += 1;
            repost(d, qpn, q, r);
            return;
        }
        if let Some(ctrl) = q.cntlid.and_then(|c| self.ctrls.get_mut(&c)) {
            ctrl.last_seen = Some(self.now);
        }
        let at = r * q.capsule_len;
        let len = len.min(q.capsule_len);
        let Some(c) = q.free.pop() else {
            // Every slot is busy, some only waiting for the ACK of their response: keep the
            // capsule in its buffer until one frees.
            self.stats.held_capsules += 1;
            q.held.push_back((r, len));
            return;
        };
        // The command is parsed from its 64 bytes here and kept parsed. An I/O queue's
        // in-capsule write is run with its data where it arrived: `exec_io` copies it from
        // the receive buffer into the namespace (one copy), and the buffer is posted again
        // after that. Other in-capsule data goes from the receive buffer to the slot's
        // staging, where fetched data lands too, and the buffer is posted again at once.
        // Staging holds at most `staging_len`; a capsule that claims more is refused at its
        // SGL.
        let sqe = len.min(SQE_LEN);
        let mut head = [0u8; SQE_LEN];
        q.recv.0.read(at, &mut head[..sqe]);
        q.cmds[c].capsule_len = len;
        let parsed = Sqe::parse(&head[..sqe]);
        let data = (len - sqe).min(q.staging_len);
        let in_place = data > 0
            && q.grown
            && q.qid > 0
            && !self.stall_io
            && parsed.as_ref().is_ok_and(|s| s.opcode == opcode::io::WRITE);
        q.cmds[c].inline = in_place.then_some((at + sqe, data));
        if data > 0 && !in_place {
            q.stage_from_recv(c, at + sqe, data);
            if q.qid > 0 {
                self.stats.io_copies += 1;
                self.stats.io_copied_bytes += data as u64;
            }
        }
        if !q.grown {
            q.boot_held = true;
        } else if !in_place {
            repost(d, qpn, q, r);
        }
        self.stats.commands += 1;
        match parsed {
            Ok(sqe) => {
                q.cmds[c].sqe = sqe;
                if self.stall_io && q.qid > 0 && sqe.opcode != opcode::FABRICS {
                    self.stalled.push((qpn, c));
                    return;
                }
                self.start(d, qpn, c);
                if in_place {
                    // The command has run (or failed) and its data was taken where needed;
                    // the buffer's requests go to the device with the response, at the end
                    // of the turn (`Io::flush`).
                    if let Some(q) = self.queues.get_mut(&qpn) {
                        q.cmds[c].inline = None;
                        repost(d, qpn, q, r);
                    }
                }
                if let Some((after, freeze, _)) = &self.trap {
                    if self.stats.commands >= *after {
                        self.frozen |= *freeze;
                        if let Some((_, _, hit)) = self.trap.take() {
                            hit.notify_one();
                        }
                    }
                }
            }
            Err(_) => {
                self.stats.malformed_capsules += 1;
                // Without a command ID there is nobody to answer: a completion for a made-up
                // ID could complete an unrelated command of the host.
                let Some(cid) = Sqe::peek_cid(&head[..sqe]) else {
                    q.free.push(c);
                    release_boot_recv(d, qpn, q);
                    return;
                };
                q.cmds[c].sqe = Sqe::new(0, cid);
                self.respond(d, qpn, c, Status::INVALID_FIELD.with_dnr(), 0, 0);
            }
        }
    }

    /// Begin a command: fetch host data if it brings any, else execute now.
    fn start(&mut self, d: &mut Io<D>, qpn: Qpn, c: usize) {
        let Some(q) = self.queues.get_mut(&qpn) else {
            return;
        };
        q.cmds[c].landed = false;
        let sqe = q.cmds[c].sqe;
        // Nothing but Connect on a queue without a controller, and no data moved for it
        // (NVMe-oF: Command Sequence Error).
        if q.cntlid.is_none() && sqe.opcode != opcode::FABRICS {
            return self.respond(d, qpn, c, Status::COMMAND_SEQUENCE_ERROR.with_dnr(), 0, 0);
        }
        let want = match self.data_in_len(qpn, &sqe) {
            Ok(Some(w)) => w,
            Ok(None) => return self.execute(d, qpn, c),
            Err(st) => return self.respond(d, qpn, c, st, 0, 0),
        };
        let Some(q) = self.queues.get_mut(&qpn) else {
            return;
        };
        let sgl = match SglDescriptor::parse(&sqe.dptr) {
            Ok(s) => s,
            Err(_) => {
                return self.respond(
                    d,
                    qpn,
                    c,
                    Status::SGL_DESCRIPTOR_TYPE_INVALID.with_dnr(),
                    0,
                    0,
                )
            }
        };
        let len = sgl.data_len() as usize;
        if len < want || want > q.staging_len {
            return self.respond(d, qpn, c, Status::SGL_DATA_LENGTH_INVALID.with_dnr(), 0, 0);
        }
        match sgl {
            SglDescriptor::InCapsule { offset, .. } => {
                // `offset` comes off the wire: only 0 is valid, so test it before adding.
                let end = SQE_LEN as u64 + want as u64;
                if offset != 0 || end > q.cmds[c].capsule_len as u64 {
                    return self.respond(d, qpn, c, Status::SGL_OFFSET_INVALID.with_dnr(), 0, 0);
                }
                // The data is in staging already (on_capsule put it there), where fetched
                // data lands: execution has one source.
                self.execute(d, qpn, c);
            }
            SglDescriptor::Keyed { addr, key, .. } => {
                let (at, lkey) = q.staging_at(c);
                let mut local = Sgl::one(at, want as u32, lkey);
                let mut landed = false;
                // A large write to a RAM namespace the device registers is fetched straight
                // into it, its range checked first. As with staging, what lands is the
                // host's data for this command only, and a failed fetch leaves the range
                // part written, which NVMe allows of a failed write.
                if sqe.opcode == opcode::io::WRITE && q.qid > 0 && want >= DIRECT_WRITE_MIN {
                    match self.direct_write(d, qpn, &sqe) {
                        Ok(Some((at, lkey))) => {
                            local = Sgl::one(at, want as u32, lkey);
                            landed = true;
                        }
                        Ok(None) => {}
                        Err(st) => {
                            self.stats.errors += 1;
                            return self.respond(d, qpn, c, st, 0, 0);
                        }
                    }
                }
                let Some(q) = self.queues.get_mut(&qpn) else {
                    return;
                };
                q.cmds[c].landed = landed;
                let wr = SendWr::signaled(
                    wr_id(WR_RDMA_READ, c),
                    SendOp::Read {
                        remote_addr: addr,
                        rkey: MemKey(key),
                    },
                    local,
                );
                q.cmds[c].stage = Stage::Fetching;
                if d.post_send(qpn, wr).is_err() {
                    q.cmds[c].stage = Stage::Free;
                    q.free.push(c);
                    release_boot_recv(d, qpn, q);
                }
            }
        }
    }

    /// Tell controller `id` about event `ev`: complete an outstanding Async Event Request,
    /// or keep the event (once) for the next one.
    fn raise(&mut self, d: &mut Io<D>, id: u16, ev: u32) {
        let Some(ctrl) = self.ctrls.get(&id) else {
            return;
        };
        let admin = ctrl
            .queues
            .iter()
            .copied()
            .find(|q| self.queues.get(q).is_some_and(|q| q.qid == 0));
        let parked = admin.and_then(|qpn| {
            let q = self.queues.get(&qpn)?;
            let c = q.cmds.iter().position(|c| {
                c.stage == Stage::Parked && c.sqe.opcode == opcode::admin::ASYNC_EVENT_REQUEST
            })?;
            Some((qpn, c))
        });
        match parked {
            Some((qpn, c)) => {
                if let Some(ctrl) = self.ctrls.get_mut(&id) {
                    ctrl.aers = ctrl.aers.saturating_sub(1);
                }
                tracing::info!(
                    cntlid = id,
                    event = format_args!("{ev:#x}"),
                    "async event sent"
                );
                self.respond(d, qpn, c, Status::SUCCESS, ev as u64, 0);
            }
            None => {
                if let Some(ctrl) = self.ctrls.get_mut(&id) {
                    if !ctrl.events.contains(&ev) {
                        ctrl.events.push(ev);
                    }
                }
            }
        }
    }

    /// Run the command whose data (if any) sits in its staging slot.
    fn execute(&mut self, d: &mut Io<D>, qpn: Qpn, c: usize) {
        let Some(q) = self.queues.get(&qpn) else {
            return;
        };
        let sqe = q.cmds[c].sqe;
        let qid = q.qid;
        let r = if sqe.opcode == opcode::FABRICS {
            self.exec_fabrics(d, qpn, c, &sqe)
        } else if q.cntlid.is_none() {
            Err(Status::COMMAND_SEQUENCE_ERROR.with_dnr())
        } else if qid == 0 {
            self.exec_admin(qpn, c, &sqe)
        } else {
            self.exec_io(d, qpn, c, &sqe)
        };
        match r {
            Ok(Done::Respond { result, data_out }) => {
                self.respond(d, qpn, c, Status::SUCCESS, result, data_out)
            }
            Ok(Done::Park) => {
                if let Some(q) = self.queues.get_mut(&qpn) {
                    q.cmds[c].stage = Stage::Parked;
                }
            }
            Ok(Done::Offload(ns, op)) => {
                if let Some(q) = self.queues.get_mut(&qpn) {
                    q.cmds[c].stage = Stage::Executing;
                    self.stats.offloaded += 1;
                    self.pool.submit(Job {
                        qpn,
                        token: q.token,
                        slot: c,
                        ns,
                        staging: q.data.0.clone(),
                        at: c * q.staging_len,
                        op,
                        alive: q.alive.clone(),
                    });
                }
            }
            Err(st) => {
                self.stats.errors += 1;
                self.respond(d, qpn, c, st, 0, 0)
            }
        }
    }

    /// Answer the commands whose namespace work finished on a worker (if their queue is
    /// still the one that asked).
    fn answer_finished(&mut self, d: &mut Io<D>) {
        let mut done = std::mem::take(&mut self.finished);
        self.pool.take_done(&mut done);
        for f in done.drain(..) {
            let Some(q) = self.queues.get(&f.qpn) else {
                continue;
            };
            let ours =
                q.token == f.token && q.cmds.get(f.slot).map(|c| c.stage) == Some(Stage::Executing);
            if !ours {
                continue;
            }
            // A worker's read or write copied the payload once, between staging and its
            // own buffer.
            let copied = f.written + *f.result.as_ref().unwrap_or(&0);
            if copied > 0 {
                self.stats.io_copies += 1;
                self.stats.io_copied_bytes += copied as u64;
            }
            match f.result {
                Ok(data_out) => {
                    self.stats.bytes_written += f.written as u64;
                    self.respond(d, f.qpn, f.slot, Status::SUCCESS, 0, data_out)
                }
                Err(st) => {
                    self.stats.errors += 1;
                    self.respond(d, f.qpn, f.slot, st, 0, 0)
                }
            }
        }
        self.finished = done;
    }

    /// RDMA WRITE `data_out` bytes to the host (if any: staged, or from the namespace where
    /// the command's `src` says), then SEND the response.
    fn respond(
        &mut self,
        d: &mut Io<D>,
        qpn: Qpn,
        c: usize,
        mut status: Status,
        result: u64,
        data_out: usize,
    ) {
        let Some(q) = self.queues.get_mut(&qpn) else {
            return;
        };
        let sqe = q.cmds[c].sqe;
        let src = q.cmds[c].src.take();
        if data_out > 0 && status.is_success() {
            match SglDescriptor::parse(&sqe.dptr) {
                // A buffer shorter than the data: refuse rather than write part of it.
                Ok(SglDescriptor::Keyed { len, .. }) if (len as usize) < data_out => {
                    status = Status::SGL_DATA_LENGTH_INVALID.with_dnr()
                }
                Ok(SglDescriptor::Keyed { addr, key, .. }) => {
                    let n = data_out as u32;
                    let (at, lkey) = src.unwrap_or_else(|| q.staging_at(c));
                    let wr = SendWr::unsignaled(
                        wr_id(WR_RDMA_WRITE, c),
                        SendOp::Write {
                            remote_addr: addr,
                            rkey: MemKey(key),
                        },
                        Sgl::one(at, n, lkey),
                    );
                    if d.post_send(qpn, wr).is_err() {
                        status = Status::DATA_TRANSFER_ERROR;
                    } else {
                        self.stats.bytes_read += n as u64;
                    }
                }
                _ => status = Status::SGL_DESCRIPTOR_TYPE_INVALID.with_dnr(),
            }
        }
        let cqe = Cqe::new(sqe.cid, status, result);
        let mut c16 = [0u8; CQE_LEN];
        cqe.emit(&mut c16);
        // sq_head is advisory with SQ flow control on; we consume in order, so report the slot.
        q.rsp.0.write(c * CQE_LEN, &c16);
        q.cmds[c].stage = Stage::Responding;
        release_boot_recv(d, qpn, q);
        if self.batching {
            self.responses.push((qpn, c));
            return;
        }
        send_response(d, qpn, q, c);
    }

    /// Post the response SENDs held back during a batch, in the order they were made.
    fn post_responses(&mut self, d: &mut Io<D>) {
        for i in 0..self.responses.len() {
            let (qpn, c) = self.responses[i];
            // The queue may have gone (a transport error later in the batch).
            let Some(q) = self.queues.get_mut(&qpn) else {
                continue;
            };
            if q.cmds[c].stage == Stage::Responding {
                send_response(d, qpn, q, c);
            }
        }
        self.responses.clear();
    }

    fn staged(&self, qpn: Qpn, c: usize, len: usize) -> Vec<u8> {
        let q = &self.queues[&qpn];
        let mut v = vec![0u8; len];
        q.data.0.read(c * q.staging_len, &mut v);
        v
    }

    fn stage_out(&self, qpn: Qpn, c: usize, bytes: &[u8]) {
        let q = &self.queues[&qpn];
        q.data.0.write(c * q.staging_len, bytes);
    }

    fn exec_fabrics(
        &mut self,
        d: &mut Io<D>,
        qpn: Qpn,
        c: usize,
        sqe: &Sqe,
    ) -> Result<Done, Status> {
        let cmd = FabricsCmd::from_sqe(sqe).map_err(|_| Status::INVALID_FIELD.with_dnr())?;
        match cmd {
            FabricsCmd::Connect {
                recfmt,
                qid,
                sqsize,
                kato_ms,
                ..
            } => self.exec_connect(d, qpn, c, recfmt, qid, sqsize, kato_ms),
            FabricsCmd::PropertyGet { size8, offset } => {
                let ctrl = self.ctrl_of(qpn, true)?;
                let v = match (offset, size8) {
                    (fabrics::reg::CAP, true) => self.cap().0,
                    (fabrics::reg::VS, false) => Vs::new(1, 3, 0).0 as u64,
                    (fabrics::reg::CC, false) => ctrl.cc.0 as u64,
                    (fabrics::reg::CSTS, false) => ctrl.csts.0 as u64,
                    _ => return Err(Status::INVALID_FIELD.with_dnr()),
                };
                Ok(Done::Respond {
                    result: v,
                    data_out: 0,
                })
            }
            FabricsCmd::PropertySet {
                size8,
                offset,
                value,
            } => {
                if offset != fabrics::reg::CC || size8 {
                    return Err(Status::INVALID_FIELD.with_dnr());
                }
                let cntlid = self.queues[&qpn]
                    .cntlid
                    .ok_or(Status::COMMAND_SEQUENCE_ERROR.with_dnr())?;
                let ctrl = self
                    .ctrls
                    .get_mut(&cntlid)
                    .ok_or(Status::COMMAND_SEQUENCE_ERROR.with_dnr())?;
                let cc = Cc(value as u32);
                let mut csts = Csts(0);
                if cc.en() {
                    csts = csts.with_rdy(true);
                }
                if cc.shn() != 0 {
                    csts = csts.with_shst(2);
                }
                ctrl.cc = cc;
                ctrl.csts = csts;
                Ok(Done::Respond {
                    result: 0,
                    data_out: 0,
                })
            }
        }
    }

    /// How many bytes of host data a command brings, if any.
    fn data_in_len(&self, qpn: Qpn, sqe: &Sqe) -> Result<Option<usize>, Status> {
        let q = &self.queues[&qpn];
        if sqe.opcode == opcode::FABRICS {
            return Ok(
                matches!(FabricsCmd::from_sqe(sqe), Ok(FabricsCmd::Connect { .. })).then_some(1024),
            );
        }
        if q.qid == 0 {
            return Ok(None);
        }
        match sqe.opcode {
            opcode::io::WRITE => Ok(Some((nlb(sqe) as usize) << self.io_ns_ref(qpn, sqe)?.lbads)),
            opcode::io::DATASET_MANAGEMENT => Ok(Some(((sqe.cdw10 & 0xFF) as usize + 1) * 16)),
            _ => Ok(None),
        }
    }

    fn cap(&self) -> Cap {
        Cap(0)
            .with_mqes(self.cfg.max_queue_size - 1)
            .with_cqr(true)
            .with_to(10)
            .with_css(1)
    }

    fn ctrl_of(&self, qpn: Qpn, admin_only: bool) -> Result<&Ctrl, Status> {
        let q = &self.queues[&qpn];
        if admin_only && q.qid != 0 {
            return Err(Status::INVALID_FIELD.with_dnr());
        }
        q.cntlid
            .and_then(|c| self.ctrls.get(&c))
            .ok_or(Status::COMMAND_SEQUENCE_ERROR.with_dnr())
    }

    #[allow(clippy::too_many_arguments)]
    fn exec_connect(
        &mut self,
        d: &mut Io<D>,
        qpn: Qpn,
        c: usize,
        recfmt: u16,
        qid: u16,
        sqsize: u16,
        kato_ms: u32,
    ) -> Result<Done, Status> {
        let q = &self.queues[&qpn];
        if recfmt != fabrics::RECFMT_0 {
            return Err(Status::CONNECT_INCOMPATIBLE_FORMAT.with_dnr());
        }
        if q.cntlid.is_some() {
            return Err(Status::COMMAND_SEQUENCE_ERROR.with_dnr());
        }
        if qid != q.qid || sqsize as usize + 1 != q.size {
            return Err(Status::CONNECT_INVALID_PARAMETERS.with_dnr());
        }
        let data = self.staged(qpn, c, 1024);
        let cd =
            ConnectData::parse(&data).map_err(|_| Status::CONNECT_INVALID_PARAMETERS.with_dnr())?;
        let subsys = self
            .cfg
            .subsystems
            .iter()
            .position(|s| s.nqn == cd.subnqn)
            .or_else(|| cd.subnqn.is_discovery().then_some(usize::MAX))
            .ok_or(Status::CONNECT_INVALID_PARAMETERS.with_dnr())?;
        if subsys != usize::MAX && !self.cfg.subsystems[subsys].allows(cd.hostnqn.as_str()) {
            return Err(Status::new(1, 0x84).with_dnr()); // Connect Invalid Host
        }
        let discovery = subsys == usize::MAX;
        let listed = !discovery && self.cfg.subsystems[subsys].allowed_hosts.is_some();
        let host = cd.hostnqn.as_str();
        // Every check first, then the queue's full rings, then the controller: a Connect that
        // fails leaves no controller behind and the queue as small as it was.
        let cntlid = if qid == 0 {
            if cd.cntlid != CNTLID_DYNAMIC {
                return Err(Status::CONNECT_INVALID_PARAMETERS.with_dnr());
            }
            let kato_ms = kato(kato_ms, discovery, self.cfg.max_kato_ms)
                .ok_or(Status::CONNECT_INVALID_PARAMETERS.with_dnr())?;
            let Some(id) = self.alloc_cntlid() else {
                self.stats.cntlid_exhausted += 1;
                return Err(Status::CONNECT_CONTROLLER_BUSY);
            };
            self.grow(d, qpn, host, listed)?;
            tracing::info!(
                cntlid = id,
                host = %cd.hostnqn.as_str(),
                subsystem = %cd.subnqn.as_str(),
                peer = %self.queues.get(&qpn).map_or("?".to_string(), |q| q.peer_ip.to_string()),
                kato_ms,
                "host connected"
            );
            self.ctrls.insert(
                id,
                Ctrl {
                    subsys,
                    hostnqn: cd.hostnqn.as_str().to_string(),
                    hostid: cd.hostid,
                    cc: Cc(0),
                    csts: Csts(0),
                    kato_ms,
                    io_queues: 0,
                    queues: vec![qpn],
                    aers: 0,
                    events: Vec::new(),
                    changed_ns: Vec::new(),
                    last_seen: None,
                },
            );
            id
        } else {
            let ctrl = self
                .ctrls
                .get(&cd.cntlid)
                .ok_or(Status::CONNECT_INVALID_PARAMETERS.with_dnr())?;
            if ctrl.hostnqn != cd.hostnqn.as_str()
                || ctrl.hostid != cd.hostid
                || ctrl.subsys != subsys
            {
                return Err(Status::CONNECT_INVALID_PARAMETERS.with_dnr());
            }
            // A discovery controller has no I/O queues (nvmet: the discovery subsystem's
            // max_qid is 0).
            if ctrl.subsys == usize::MAX {
                return Err(Status::INVALID_QUEUE_ID.with_dnr());
            }
            if !ctrl.csts.rdy() {
                return Err(Status::COMMAND_SEQUENCE_ERROR.with_dnr());
            }
            if qid > ctrl.io_queues.max(1) {
                return Err(Status::CONNECT_INVALID_PARAMETERS.with_dnr());
            }
            // nvmet_install_queue: a qid the controller has is not installed twice.
            let taken = ctrl
                .queues
                .iter()
                .any(|x| self.queues.get(x).is_some_and(|q| q.qid == qid));
            if taken {
                return Err(Status::COMMAND_SEQUENCE_ERROR.with_dnr());
            }
            self.grow(d, qpn, host, listed)?;
            if let Some(ctrl) = self.ctrls.get_mut(&cd.cntlid) {
                ctrl.queues.push(qpn);
            }
            cd.cntlid
        };
        if let Some(q) = self.queues.get_mut(&qpn) {
            q.cntlid = Some(cntlid);
            let ip = q.peer_ip;
            self.connected_or_gone(ip);
        }
        let r = ConnectResult::Ok { cntlid, authreq: 0 };
        Ok(Done::Respond {
            result: r.to_result(),
            data_out: 0,
        })
    }

    /// A controller ID in `cntlid_min..=cntlid_max` that no live controller has, searched
    /// round-robin from the last one given (so a freed ID is not handed out again at once);
    /// `None` when every ID is taken. Controllers never outnumber queues, so the search is
    /// at most `max_queues` + 1 steps.
    fn alloc_cntlid(&mut self) -> Option<u16> {
        let lo = self.cfg.cntlid_min.max(1);
        let hi = self.cfg.cntlid_max.min(0xFFEF);
        if lo > hi {
            return None;
        }
        let span = (hi - lo) as u32 + 1;
        let from = (self.next_cntlid.clamp(lo, hi) - lo) as u32;
        let id = (0..span)
            .map(|i| lo + ((from + i) % span) as u16)
            .find(|id| !self.ctrls.contains_key(id))?;
        self.next_cntlid = if id >= hi { lo } else { id + 1 };
        Some(id)
    }

    fn subsystem(&self, ctrl: &Ctrl) -> Option<&Subsystem> {
        self.cfg.subsystems.get(ctrl.subsys)
    }

    fn exec_admin(&mut self, qpn: Qpn, c: usize, sqe: &Sqe) -> Result<Done, Status> {
        let cntlid = self.queues[&qpn].cntlid.unwrap_or(0);
        match sqe.opcode {
            opcode::admin::IDENTIFY => {
                let ctrl = self.ctrl_of(qpn, true)?;
                let mut page = [0u8; 4096];
                match (sqe.cdw10 & 0xFF) as u8 {
                    cns::CONTROLLER => {
                        let id = self.identify_controller(ctrl, cntlid);
                        id.emit(&mut page);
                    }
                    cns::NAMESPACE => {
                        let ns = self
                            .subsystem(ctrl)
                            .and_then(|s| s.namespaces.iter().find(|n| n.nsid == sqe.nsid))
                            .ok_or(Status::INVALID_NAMESPACE_OR_FORMAT.with_dnr())?;
                        let mut id = IdentifyNamespace::simple(ns.blocks, ns.lbads);
                        id.nguid = ns.ident.nguid;
                        id.eui64 = ns.ident.eui64;
                        id.emit(&mut page);
                    }
                    cns::NS_ID_DESCRIPTORS => {
                        let ns = self
                            .subsystem(ctrl)
                            .and_then(|s| s.namespaces.iter().find(|n| n.nsid == sqe.nsid))
                            .ok_or(Status::INVALID_NAMESPACE_OR_FORMAT.with_dnr())?;
                        crate::nvme::identify::emit_ns_id_descriptors(&ns.ident, &mut page);
                    }
                    cns::ACTIVE_NAMESPACE_LIST => {
                        let ids: Vec<u32> = self
                            .subsystem(ctrl)
                            .map(|s| {
                                s.namespaces
                                    .iter()
                                    .map(|n| n.nsid)
                                    .filter(|&n| n > sqe.nsid)
                                    .collect()
                            })
                            .unwrap_or_default();
                        crate::nvme::identify::emit_active_namespace_ids(&ids, &mut page);
                    }
                    _ => return Err(Status::INVALID_FIELD.with_dnr()),
                }
                self.stage_out(qpn, c, &page);
                Ok(Done::Respond {
                    result: 0,
                    data_out: 4096,
                })
            }
            opcode::admin::SET_FEATURES => {
                let fid = (sqe.cdw10 & 0xFF) as u8;
                let max = self.cfg.max_io_queues as u32;
                let ctrl_id = self.queues[&qpn]
                    .cntlid
                    .ok_or(Status::COMMAND_SEQUENCE_ERROR)?;
                let ctrl = self
                    .ctrls
                    .get_mut(&ctrl_id)
                    .ok_or(Status::COMMAND_SEQUENCE_ERROR)?;
                match fid {
                    feature::NUMBER_OF_QUEUES => {
                        let nsqr = (sqe.cdw11 & 0xFFFF) + 1;
                        let ncqr = (sqe.cdw11 >> 16) + 1;
                        if nsqr == 0x10000 || ncqr == 0x10000 {
                            return Err(Status::INVALID_FIELD.with_dnr());
                        }
                        let n = nsqr.min(ncqr).min(max);
                        ctrl.io_queues = n as u16;
                        let r = (n - 1) | ((n - 1) << 16);
                        Ok(Done::Respond {
                            result: r as u64,
                            data_out: 0,
                        })
                    }
                    feature::KEEP_ALIVE_TIMER => {
                        let discovery = ctrl.subsys == usize::MAX;
                        ctrl.kato_ms = kato(sqe.cdw11, discovery, self.cfg.max_kato_ms)
                            .ok_or(Status::KEEP_ALIVE_INVALID.with_dnr())?;
                        Ok(Done::Respond {
                            result: 0,
                            data_out: 0,
                        })
                    }
                    feature::ASYNC_EVENT_CONFIG | feature::VOLATILE_WRITE_CACHE => {
                        Ok(Done::Respond {
                            result: 0,
                            data_out: 0,
                        })
                    }
                    _ => Err(Status::INVALID_FIELD.with_dnr()),
                }
            }
            opcode::admin::GET_FEATURES => {
                let ctrl = self.ctrl_of(qpn, true)?;
                let fid = (sqe.cdw10 & 0xFF) as u8;
                let v = match fid {
                    feature::NUMBER_OF_QUEUES => {
                        let n = ctrl.io_queues.max(1) as u32 - 1;
                        n | (n << 16)
                    }
                    feature::KEEP_ALIVE_TIMER => ctrl.kato_ms,
                    feature::ASYNC_EVENT_CONFIG | feature::VOLATILE_WRITE_CACHE => 0,
                    _ => return Err(Status::INVALID_FIELD.with_dnr()),
                };
                Ok(Done::Respond {
                    result: v as u64,
                    data_out: 0,
                })
            }
            opcode::admin::KEEP_ALIVE => Ok(Done::Respond {
                result: 0,
                data_out: 0,
            }),
            opcode::admin::ASYNC_EVENT_REQUEST => {
                let ctrl_id = self.queues[&qpn]
                    .cntlid
                    .ok_or(Status::COMMAND_SEQUENCE_ERROR)?;
                let ctrl = self
                    .ctrls
                    .get_mut(&ctrl_id)
                    .ok_or(Status::COMMAND_SEQUENCE_ERROR)?;
                if !ctrl.events.is_empty() {
                    // An event came while no request was outstanding: report it now.
                    let ev = ctrl.events.remove(0);
                    return Ok(Done::Respond {
                        result: ev as u64,
                        data_out: 0,
                    });
                }
                if ctrl.aers >= AER_LIMIT {
                    return Err(Status::ASYNC_EVENT_LIMIT_EXCEEDED.with_dnr());
                }
                ctrl.aers += 1;
                Ok(Done::Park)
            }
            opcode::admin::GET_LOG_PAGE => {
                let lid = (sqe.cdw10 & 0xFF) as u8;
                let numd =
                    (((sqe.cdw10 >> 16) & 0xFFFF) | ((sqe.cdw11 & 0xFFFF) << 16)) as usize + 1;
                let offset = sqe.cdw12 as u64 | ((sqe.cdw13 as u64) << 32);
                let len = numd * 4;
                let page = match lid {
                    // Changed Namespace List: reading it clears it (and re-arms the event).
                    0x04 => {
                        let ctrl_id = self.queues[&qpn]
                            .cntlid
                            .ok_or(Status::COMMAND_SEQUENCE_ERROR)?;
                        let ctrl = self
                            .ctrls
                            .get_mut(&ctrl_id)
                            .ok_or(Status::COMMAND_SEQUENCE_ERROR)?;
                        let mut page = vec![0u8; 4096];
                        let list = std::mem::take(&mut ctrl.changed_ns);
                        for (i, id) in list.iter().enumerate() {
                            page[i * 4..i * 4 + 4].copy_from_slice(&id.to_le_bytes());
                        }
                        page
                    }
                    0x70 => {
                        let host = self.ctrl_of(qpn, true)?.hostnqn.clone();
                        self.discovery_log(&host)
                    }
                    // Error information, SMART / health, firmware slot: all zeroes here.
                    0x01..=0x03 => vec![0u8; 4096],
                    _ => return Err(Status::INVALID_LOG_PAGE.with_dnr()),
                };
                let staging = self.queues[&qpn].staging_len;
                if len > staging {
                    return Err(Status::SGL_DATA_LENGTH_INVALID.with_dnr());
                }
                let mut out = vec![0u8; len];
                let off = (offset as usize).min(page.len());
                let n = (page.len() - off).min(len);
                out[..n].copy_from_slice(&page[off..off + n]);
                self.stage_out(qpn, c, &out);
                Ok(Done::Respond {
                    result: 0,
                    data_out: len,
                })
            }
            _ => Err(Status::INVALID_OPCODE.with_dnr()),
        }
    }

    fn identify_controller(&self, ctrl: &Ctrl, cntlid: u16) -> IdentifyController {
        let s = self.subsystem(ctrl);
        let nqn = s.map(|s| s.nqn.as_str()).unwrap_or(fabrics::DISCOVERY_NQN);
        IdentifyController {
            vid: 0x1de5,
            ssvid: 0x1de5,
            sn: spaced(s.map(|s| s.serial.as_str()).unwrap_or("DISCOVERY")),
            mn: spaced(s.map(|s| s.model.as_str()).unwrap_or("nvmf-rdma discovery")),
            fr: spaced(env!("CARGO_PKG_VERSION")),
            // MDTS in units of the minimum page size (4 KiB), as a power of two.
            mdts: (self.cfg.max_transfer / 4096).max(1).ilog2() as u8,
            cntlid,
            ver: Vs::new(1, 3, 0).0,
            kas: 1, // 100 ms granularity
            sqes: 0x66,
            cqes: 0x44,
            maxcmd: self.cfg.max_queue_size,
            nn: s
                .map(|s| s.namespaces.iter().map(|n| n.nsid).max().unwrap_or(0))
                .unwrap_or(0),
            oncs: (1 << 2) | (1 << 3), // DSM, Write Zeroes
            vwc: 0,
            // SGLs supported, keyed SGL data block, offset addressing for in-capsule data.
            sgls: 1 | (1 << 2) | (1 << 20),
            subnqn: FixedStr::new(nqn).unwrap_or_else(|_| FixedStr::zeroed()),
            ioccsz: ((SQE_LEN as u32) + self.cfg.inline_data) / 16,
            iorcsz: 1,
            icdoff: 0,
            msdbd: 1,
            ..IdentifyController::default()
        }
    }

    /// The discovery log as `hostnqn` sees it: only subsystems that allow it (nvmet
    /// `nvmet_host_allowed`), so the log does not tell anyone what exists beyond that.
    fn discovery_log(&self, hostnqn: &str) -> Vec<u8> {
        let visible: Vec<&Subsystem> = self
            .cfg
            .subsystems
            .iter()
            .filter(|s| s.allows(hostnqn))
            .collect();
        let recs = visible.len();
        let mut page = vec![0u8; 1024 * (recs + 1)];
        let hdr = DiscoveryLogHeader {
            genctr: 1,
            numrec: recs as u64,
            recfmt: 0,
        };
        let mut h = [0u8; 1024];
        hdr.emit(&mut h);
        page[..1024].copy_from_slice(&h);
        let addr = self
            .cfg
            .advertise
            .map(|a| a.ip().to_string())
            .unwrap_or_else(|| "127.0.0.1".into());
        for (i, s) in visible.iter().enumerate() {
            let port = self.cfg.port.to_string();
            let ipv6 = self.cfg.advertise.is_some_and(|a| a.is_ipv6());
            if let Ok(e) = DiscoveryLogEntry::rdma(&s.nqn, &addr, &port, ipv6, 1) {
                page[1024 * (i + 1)..1024 * (i + 2)].copy_from_slice(&e.to_bytes());
            }
        }
        page
    }

    /// The memory region of RAM namespace `ns` on our PD, registered the first time it is
    /// asked for: `None` where the device cannot register the namespace's memory (another
    /// device's memory type, or the registration failed), and reads copy through staging.
    /// Local access only (reads from it, RDMA READ responses into it): we post the RDMA, no
    /// peer ever gets a key to the namespace.
    fn ns_mr(&mut self, d: &mut Io<D>, ns: &Arc<Namespace>) -> Option<MrInfo> {
        if let Some((_, mr)) = self.ns_mrs.iter().find(|(n, _)| Arc::ptr_eq(n, ns)) {
            return *mr;
        }
        // A namespace no subsystem has any more (only this list holds it) gives its
        // region back, so the list is bounded by the namespaces that exist.
        self.ns_mrs.retain(|(n, mr)| {
            let gone = Arc::strong_count(n) == 1;
            if let (true, Some(mr)) = (gone, mr) {
                d.dev.dereg_mr(mr);
            }
            !gone
        });
        let mem = ns
            .ram_store()
            .and_then(|s| s.as_any().downcast_ref::<D::Mem>());
        let mr = mem.and_then(|m| {
            d.dev
                .reg_mr(self.pd, m, 0, m.len(), Access::LOCAL_WRITE)
                .ok()
        });
        self.ns_mrs.push((ns.clone(), mr));
        mr
    }

    /// The region to move queue `qpn`'s data to or from RAM namespace `ns` without a copy,
    /// if there is one. Only where a packet carries whole blocks (path MTU at least the
    /// block size): each packet is gathered or scattered under the memory's lock, as every
    /// other access to it is made, so a read that races a write to the same blocks (NVMe
    /// leaves their order open) sees each block whole, old or new, as the one-block atomic
    /// write unit promises. Nothing is held while data crosses the network, so a dead
    /// queue still retrying its RDMA keeps no live host waiting.
    fn direct_mr(&mut self, d: &mut Io<D>, qpn: Qpn, ns: &Arc<Namespace>) -> Option<MrInfo> {
        let mtu = self.queues.get(&qpn)?.mtu;
        if !ns.is_ram() || mtu < ns.block_size() {
            return None;
        }
        self.ns_mr(d, ns)
    }

    /// Where write `sqe` on queue `qpn` can be fetched straight into its namespace: the
    /// address and lkey, `None` if it goes through staging, or the command's error (a
    /// range outside the namespace is refused before anything moves).
    fn direct_write(
        &mut self,
        d: &mut Io<D>,
        qpn: Qpn,
        sqe: &Sqe,
    ) -> Result<Option<(u64, MemKey)>, Status> {
        let ns = self.io_ns(qpn, sqe)?;
        let (off, _) = ns.range(lba(sqe), nlb(sqe))?;
        Ok(self
            .direct_mr(d, qpn, &ns)
            .map(|mr| (mr.addr + off, mr.lkey)))
    }

    /// The namespace I/O command `sqe` on queue `qpn` names.
    fn io_ns(&self, qpn: Qpn, sqe: &Sqe) -> Result<Arc<Namespace>, Status> {
        self.io_ns_ref(qpn, sqe).cloned()
    }

    fn io_ns_ref(&self, qpn: Qpn, sqe: &Sqe) -> Result<&Arc<Namespace>, Status> {
        let ctrl = self.ctrl_of(qpn, false)?;
        let subsys = self
            .subsystem(ctrl)
            .ok_or(Status::INVALID_OPCODE.with_dnr())?;
        subsys
            .namespaces
            .iter()
            .find(|n| n.nsid == sqe.nsid)
            .ok_or(Status::INVALID_NAMESPACE_OR_FORMAT.with_dnr())
    }

    fn exec_io(&mut self, d: &mut Io<D>, qpn: Qpn, c: usize, sqe: &Sqe) -> Result<Done, Status> {
        let ns = self.io_ns(qpn, sqe)?;
        let (slba, nlb) = (lba(sqe), nlb(sqe));
        let staging = self.queues[&qpn].staging_len;
        // A RAM namespace's reads and writes are a copy of at most `staging` bytes and stay
        // here; what a host can make long goes to a worker.
        let offload = !ns.is_ram();
        match sqe.opcode {
            opcode::io::READ => {
                let (off, len) = ns.range(slba, nlb)?;
                if len > staging {
                    return Err(Status::INVALID_FIELD.with_dnr());
                }
                if offload {
                    return Ok(Done::Offload(ns, Op::Read { off, len }));
                }
                // Where the device registers the namespace's memory, the RDMA WRITE reads
                // it: no copy, and nothing held meanwhile (see `direct_mr`).
                if let Some(mr) = self.direct_mr(d, qpn, &ns) {
                    if let Some(q) = self.queues.get_mut(&qpn) {
                        q.cmds[c].src = Some((mr.addr + off, mr.lkey));
                    }
                } else {
                    let q = &self.queues[&qpn];
                    q.data.0.with_range(c * staging, len, |g| ns.read(off, g))?;
                    self.stats.io_copies += 1;
                    self.stats.io_copied_bytes += len as u64;
                }
                Ok(Done::Respond {
                    result: 0,
                    data_out: len,
                })
            }
            opcode::io::WRITE => {
                let (off, len) = ns.range(slba, nlb)?;
                if len > staging {
                    return Err(Status::INVALID_FIELD.with_dnr());
                }
                let q = &self.queues[&qpn];
                let inline = q.cmds[c].inline;
                if inline.is_some_and(|(_, n)| len > n) {
                    // `start` checked the capsule against the SGL, and the SGL against the
                    // namespace range: this does not happen.
                    return Err(Status::SGL_DATA_LENGTH_INVALID.with_dnr());
                }
                if offload {
                    // A worker reads it from staging, after this buffer is posted again.
                    if let Some((from, _)) = inline {
                        q.stage_from_recv(c, from, len);
                        self.stats.io_copies += 1;
                        self.stats.io_copied_bytes += len as u64;
                    }
                    return Ok(Done::Offload(ns, Op::Write { off, len }));
                }
                if !q.cmds[c].landed {
                    // In-capsule data from its receive buffer, anything else from staging.
                    let (mem, at) = match inline {
                        Some((from, _)) => (&q.recv.0, from),
                        None => (&q.data.0, c * staging),
                    };
                    mem.with_range(at, len, |g| ns.write(off, g))?;
                    self.stats.io_copies += 1;
                    self.stats.io_copied_bytes += len as u64;
                }
                self.stats.bytes_written += len as u64;
                Ok(Done::Respond {
                    result: 0,
                    data_out: 0,
                })
            }
            opcode::io::FLUSH if offload => Ok(Done::Offload(ns, Op::Flush)),
            opcode::io::FLUSH => {
                ns.flush()?;
                Ok(Done::Respond {
                    result: 0,
                    data_out: 0,
                })
            }
            opcode::io::WRITE_ZEROES => {
                let (off, len) = ns.range(slba, nlb)?;
                let ranges = VecDeque::from([(off, len)]);
                Ok(Done::Offload(ns, Op::Zero { ranges }))
            }
            opcode::io::DATASET_MANAGEMENT => {
                let nr = (sqe.cdw10 & 0xFF) as usize + 1;
                let deallocate = sqe.cdw11 & (1 << 2) != 0;
                let raw = self.staged(qpn, c, nr * 16);
                let ranges: Vec<DsmRange> = DsmRange::parse_all(&raw).collect();
                if ranges.len() != nr {
                    return Err(Status::INVALID_FIELD.with_dnr());
                }
                if !deallocate {
                    return Ok(Done::Respond {
                        result: 0,
                        data_out: 0,
                    });
                }
                // Every range is checked before any is zeroed.
                let mut zero = VecDeque::new();
                for r in &ranges {
                    let (off, len) = ns.range(r.slba, r.nlb as u64)?;
                    if len > 0 {
                        zero.push_back((off, len));
                    }
                }
                Ok(Done::Offload(ns, Op::Zero { ranges: zero }))
            }
            _ => Err(Status::INVALID_OPCODE.with_dnr()),
        }
    }
}

/// The starting LBA of a read or write (CDW10-11).
fn lba(sqe: &Sqe) -> u64 {
    sqe.cdw10 as u64 | ((sqe.cdw11 as u64) << 32)
}

/// The number of blocks of a read or write (CDW12 bits 15:0, 0's based).
fn nlb(sqe: &Sqe) -> u64 {
    (sqe.cdw12 & 0xFFFF) as u64 + 1
}

enum Done {
    Respond {
        result: u64,
        data_out: usize,
    },
    Park,
    /// Run `Op` on a worker; the response follows when it finishes.
    Offload(Arc<Namespace>, Op),
}

/// An ASCII identify field, space padded; text that does not fit is cut.
fn spaced<const N: usize>(v: &str) -> FixedStr<N> {
    let cut = &v[..v.len().min(N)];
    FixedStr::new_spaced(cut).unwrap_or_else(|_| FixedStr::zeroed())
}

/// SEND command slot `c`'s response capsule (already in its buffer); a slot whose SEND
/// cannot be posted is free again.
///
/// A command whose keyed SGL asked for it (subtype 0xF) gets a SEND with Invalidate of its
/// key, as nvmet-rdma answers: the host's buffer is shut to us the moment the response
/// lands, with no local invalidation on the host's side. A device that cannot send with
/// invalidate answers with a plain SEND: the host then invalidates the key itself.
fn send_response<D: DeviceContext>(d: &mut Io<D>, qpn: Qpn, q: &mut TQueue<D::Mem>, c: usize) {
    let op = match SglDescriptor::parse(&q.cmds[c].sqe.dptr) {
        Ok(SglDescriptor::Keyed {
            key,
            invalidate: true,
            ..
        }) if d.dev.send_with_invalidate() => SendOp::SendWithInv(MemKey(key)),
        _ => SendOp::Send,
    };
    let wr = SendWr::signaled(
        wr_id(WR_SEND, c),
        op,
        Sgl::one(
            q.rsp.1.addr + (c * CQE_LEN) as u64,
            CQE_LEN as u32,
            q.rsp.1.lkey,
        ),
    );
    if d.post_send(qpn, wr).is_err() {
        q.cmds[c].stage = Stage::Free;
        q.free.push(c);
    }
}

/// Post receive buffer `r` again; false if the QP refused it.
fn repost<D: DeviceContext>(d: &mut Io<D>, qpn: Qpn, q: &TQueue<D::Mem>, r: usize) -> bool {
    let sgl = Sgl::one(
        q.recv.1.addr + (r * q.capsule_len) as u64,
        q.capsule_len as u32,
        q.recv.1.lkey,
    );
    d.post_recv(
        qpn,
        RecvWr {
            wr_id: wr_id(WR_RECV, r),
            sgl,
        },
    )
    .is_ok()
}

/// Before Connect: the one receive buffer goes back once its command is answered.
fn release_boot_recv<D: DeviceContext>(d: &mut Io<D>, qpn: Qpn, q: &mut TQueue<D::Mem>) {
    if !q.grown && q.boot_held {
        q.boot_held = false;
        repost(d, qpn, q, 0);
    }
}

type Ring<M> = (Arc<M>, MrInfo);
/// A queue's receive, response and staging rings, and its command slots.
type Rings<M> = ([Ring<M>; 3], Vec<Cmd>);

/// Receive, response and staging rings of `slots` slots, registered, and a command per
/// slot; `None` (nothing left allocated or registered) if memory or the device refuses.
fn alloc_rings<D: DeviceContext>(
    d: &mut Io<D>,
    pd: PdId,
    slots: usize,
    capsule_len: usize,
    staging_len: usize,
) -> Option<Rings<D::Mem>> {
    let mut cmds = Vec::new();
    cmds.try_reserve_exact(slots).ok()?;
    for _ in 0..slots {
        cmds.push(Cmd {
            stage: Stage::Free,
            sqe: Sqe::new(0, 0),
            capsule_len: 0,
            src: None,
            landed: false,
            inline: None,
        });
    }
    // Staging is the big one (slots x max_transfer): its pages come in as commands use
    // them, so accepting a queue (and a host's reconnect) costs no page faults up front.
    let specs = [
        (slots.checked_mul(capsule_len)?, Access::LOCAL_WRITE, false),
        (slots.checked_mul(CQE_LEN)?, Access::empty(), false),
        (slots.checked_mul(staging_len)?, Access::LOCAL_WRITE, true),
    ];
    let mut rings: Vec<Ring<D::Mem>> = Vec::with_capacity(3);
    for (len, access, lazy) in specs {
        let mem = if lazy {
            D::Mem::try_alloc_lazy(len)
        } else {
            D::Mem::try_alloc(len)
        };
        let mr = mem.and_then(|m| {
            let mr = d.dev.reg_mr(pd, &m, 0, len, access).ok()?;
            Some((Arc::new(m), mr))
        });
        match mr {
            Some(r) => rings.push(r),
            None => {
                for (_, mr) in rings {
                    d.dev.dereg_mr(&mr);
                }
                return None;
            }
        }
    }
    let rings: [Ring<D::Mem>; 3] = rings.try_into().ok()?;
    Some((rings, cmds))
}

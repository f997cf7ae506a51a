//! The host controller: admin queue bring-up (Fabrics Connect, Property Get/Set, enable,
//! Identify, Set Features Number of Queues), I/O queues, keep-alive, a block API, and the
//! one recovery path.
//!
//! Recovery: a supervisor task per controller runs the [`Machine`] of `src/reconnect`. Every
//! cause (device reset, hot-remove, CM disconnect, keep-alive loss, a failed work completion,
//! an I/O timeout) reaches it as one event and takes the same road: drop every HCA resource,
//! hold in-flight I/O in its own slot, wait for the same device (GUID / PCI address, per
//! policy), register the same buffers under a new PD, reconnect admin then I/O queues,
//! resubmit, LIVE. From the failure to the resubmission the host allocates nothing: every
//! buffer, slot and table was sized at the first connect (`tests/recovery_alloc.rs`).
//!
//! Namespaces: read at connect, and read again after every reconnect (once LIVE, outside
//! the recovery path; Linux scans on every reconnect too) and whenever the caller asks
//! (after a Namespace Attribute Changed event). Each carries its identity (NGUID, EUI-64,
//! UUID): a namespace whose identity changed behind the same NSID is a different one, and
//! [`Controller::same_namespace`] fails for users of the old one.

use std::any::Any;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, watch, Notify};

use crate::cm::{ConnId, ConnectParams, NvmeCmRequest};
use crate::nvme::admin;
use crate::nvme::fabrics::{self, ConnectResult, CNTLID_DYNAMIC};
use crate::nvme::{
    Cap, Cc, ConnectData, Csts, DiscoveryLogEntry, DiscoveryLogHeader, DsmRange, FabricsCmd,
    IdentifyController, IdentifyNamespace, Nqn, NsIdentity, Sqe,
};
use crate::reconnect::{Action, Cause, CtrlState, Event, Identity, Machine, Policy, Status};
use crate::verbs::{
    roce_peer, CmPort, DeviceContext, DeviceSource, Instant, Lifecycle, Mtu, Opened, PdId, PeerInfo,
};

use super::fixed::Fixed;
use super::queue::{
    self, Alarm, Clock, IoBuffer, QueueCore, QueueCtl, QueueHandle, QueueSpec, QueueStats,
};
use super::HostError;

/// Everything `connect` needs, with nvme-cli's names where there is one.
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    /// The target device's address (`-a`, with the soft-HCA's UDP port).
    pub traddr: SocketAddr,
    /// NVMe-oF service port (`-s`, default 4420).
    pub trsvcid: u16,
    /// Subsystem NQN (`-n`).
    pub subnqn: String,
    /// Host NQN (`-q`).
    pub hostnqn: String,
    /// Host ID (`-I`), a UUID.
    pub hostid: [u8; 16],
    /// I/O queues (`-i`, default: one per core).
    pub nr_io_queues: usize,
    /// Entries per I/O queue (`-Q`, default 128, 16..=1024). One is reserved for the
    /// controller's own commands, as in Linux.
    pub queue_size: usize,
    /// Keep-alive timeout (`-k`, default 5 s; zero turns keep-alive off).
    pub keep_alive_tmo: Duration,
    /// Largest transfer per command we set up buffers for.
    pub max_io: usize,
    pub mtu: Mtu,
    /// Bound on one CM connect and on each bring-up command.
    pub connect_timeout: Duration,
    /// Reconnect policy (`-l`, `-c`, `--fast_io_fail_tmo`, replug window, identity).
    /// Its `keep_alive_tmo` is taken from the field above.
    pub policy: Policy,
    /// A command with no response after this long starts recovery (Linux `io_timeout`).
    pub io_timeout: Duration,
    /// How often a command failing with a retryable status (DNR clear) is sent again.
    pub max_retries: u8,
    /// A write that fits the target's in-capsule data size goes inside its command capsule
    /// while at most this many commands are in flight on its queue, and as a keyed SGL
    /// (the target reads the data) when the queue is deeper. In the capsule saves a round
    /// trip, which is what a shallow queue waits on. On a soft-HCA it also makes each write
    /// a full packet plus a short one, and since only a run of equal-size packets leaves in
    /// one GSO send, deep queues of such writes cost a kernel send per write; as keyed SGLs
    /// the commands, data and responses of many writes go out in a few sends each
    /// (4 KiB randwrite at QD32 through fio: about 170 K -> 290 K IOPS).
    /// `None` (the default) chooses by the path, when the queues are made: unlimited
    /// (Linux's rule: always in the capsule when it fits) towards RoCEv2 devices and towards
    /// a peer the host's device reaches in memory (a target in this process, on the
    /// soft-HCA's loopback path, where there are no GSO runs to keep and the round trip is
    /// what costs: 4 KiB randwrite QD32 through fio 205-213 K -> 268-305 K IOPS), and
    /// [`SOFT_INLINE_DEPTH`] towards other soft-HCAs.
    pub inline_depth: Option<usize>,
}

/// In-flight commands up to which a soft-HCA host puts fitting writes in the capsule
/// towards a soft-HCA reached over UDP ([`ConnectOptions::inline_depth`]). fio 4 KiB
/// randwrite through the plugin: in the capsule wins at QD2 and QD4, keyed SGLs from QD8.
pub const SOFT_INLINE_DEPTH: usize = 4;

/// [`ConnectOptions::inline_depth`]'s choice by the path, for a host whose device reaches
/// the target over a network (`in_memory` false) or in memory.
fn inline_depth_for(traddr: SocketAddr, in_memory: bool) -> usize {
    if roce_peer(traddr.ip()) || in_memory {
        usize::MAX
    } else {
        SOFT_INLINE_DEPTH
    }
}

impl ConnectOptions {
    pub fn new(traddr: SocketAddr, subnqn: &str) -> ConnectOptions {
        let hostid = default_hostid();
        ConnectOptions {
            traddr,
            trsvcid: 4420,
            subnqn: subnqn.to_string(),
            hostnqn: Nqn::from_uuid(&hostid).as_str().to_string(),
            hostid,
            nr_io_queues: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            queue_size: 128,
            keep_alive_tmo: Duration::from_secs(5),
            max_io: 128 << 10,
            // rxe on 1500-byte Ethernet uses 1024; soft-HCAs on loopback take 4096.
            mtu: if roce_peer(traddr.ip()) {
                Mtu::Mtu1024
            } else {
                Mtu::Mtu4096
            },
            connect_timeout: Duration::from_secs(5),
            policy: Policy::default(),
            io_timeout: crate::reconnect::policy::DEFAULT_IO_TIMEOUT,
            max_retries: crate::reconnect::policy::DEFAULT_MAX_RETRIES,
            inline_depth: None,
        }
    }
}

/// A stable host ID for this machine: from /etc/machine-id when there is one.
pub fn default_hostid() -> [u8; 16] {
    let mut id = [0u8; 16];
    if let Ok(s) = std::fs::read_to_string("/etc/machine-id") {
        let hex: Vec<u8> = s.trim().bytes().collect();
        for (i, chunk) in hex.chunks(2).take(16).enumerate() {
            if let Ok(b) = u8::from_str_radix(std::str::from_utf8(chunk).unwrap_or("0"), 16) {
                id[i] = b;
            }
        }
    }
    if id == [0u8; 16] {
        id = *b"nvmf-rdma-host-1";
    }
    id[6] = (id[6] & 0x0F) | 0x40; // UUID version 4 layout
    id[8] = (id[8] & 0x3F) | 0x80;
    id
}

/// A namespace as the host sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NsInfo {
    pub nsid: u32,
    pub block_size: u32,
    pub blocks: u64,
    /// What tells it apart from another namespace the controller may later show under the
    /// same NSID.
    pub ident: NsIdentity,
}

impl NsInfo {
    pub fn bytes(&self) -> u64 {
        self.blocks * self.block_size as u64
    }

    /// Is `other` this namespace (the same NSID and identity; its size may differ)?
    pub fn same_as(&self, other: &NsInfo) -> bool {
        self.nsid == other.nsid && self.ident == other.ident
    }
}

/// The active namespaces as last read, shared by the controller and its rescans.
struct NsTable {
    list: std::sync::RwLock<Vec<NsInfo>>,
    /// Counts the rescans that changed `list`.
    version: watch::Sender<u64>,
    /// One rescan at a time, so that a slow one cannot put back a list older than the last.
    scanning: tokio::sync::Mutex<()>,
}

impl NsTable {
    fn new() -> NsTable {
        NsTable {
            list: std::sync::RwLock::new(Vec::new()),
            version: watch::channel(0).0,
            scanning: tokio::sync::Mutex::new(()),
        }
    }

    fn get(&self) -> std::sync::RwLockReadGuard<'_, Vec<NsInfo>> {
        self.list.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Read the namespaces from the controller behind `admin` and keep them; say what
    /// changed (logged, and by `version`).
    async fn rescan(
        &self,
        admin: &QueueHandle,
        timeout: Duration,
        subnqn: &str,
    ) -> Result<Vec<NsInfo>, HostError> {
        let _one = self.scanning.lock().await;
        let new = identify_namespaces(admin, timeout).await?;
        let old = std::mem::replace(
            &mut *self.list.write().unwrap_or_else(|e| e.into_inner()),
            new.clone(),
        );
        if old != new {
            for l in ns_changes(&old, &new) {
                tracing::info!(subnqn, "{l}");
            }
            self.version.send_modify(|v| *v += 1);
        }
        Ok(new)
    }
}

/// What differs between two namespace lists, a line each.
fn ns_changes(old: &[NsInfo], new: &[NsInfo]) -> Vec<String> {
    let mut out = Vec::new();
    for n in new {
        match old.iter().find(|o| o.nsid == n.nsid) {
            None => out.push(format!("namespace {} added ({} bytes)", n.nsid, n.bytes())),
            Some(o) if !o.same_as(n) => out.push(format!(
                "namespace {} is a different namespace now (its identity changed): users of \
                 the old one get errors",
                n.nsid
            )),
            Some(o) if o.bytes() != n.bytes() => out.push(format!(
                "namespace {} resized from {} to {} bytes",
                n.nsid,
                o.bytes(),
                n.bytes()
            )),
            Some(_) => {}
        }
    }
    for o in old.iter().filter(|o| !new.iter().any(|n| n.nsid == o.nsid)) {
        out.push(format!(
            "namespace {} removed: its users get errors",
            o.nsid
        ));
    }
    out
}

/// An Asynchronous Event the controller reported (NVMe base spec, Asynchronous Event
/// Request completion, Dword 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AsyncEvent {
    /// 0 error, 1 SMART / health, 2 notice, 6 I/O command set specific, 7 vendor.
    pub kind: u8,
    /// For a notice: 0x00 namespace attribute changed, 0xF0 discovery log page changed.
    pub info: u8,
    /// The log page that tells more (0x04 changed namespace list, 0x70 discovery log).
    pub log_page: u8,
}

impl AsyncEvent {
    pub const NOTICE: u8 = 2;
    pub const NS_ATTR_CHANGED: u8 = 0x00;
    pub const DISCOVERY_LOG_CHANGED: u8 = 0xF0;

    pub fn from_result(dw0: u32) -> AsyncEvent {
        AsyncEvent {
            kind: (dw0 & 0x7) as u8,
            info: (dw0 >> 8) as u8,
            log_page: (dw0 >> 16) as u8,
        }
    }

    pub fn to_result(self) -> u32 {
        u32::from(self.kind & 7) | u32::from(self.info) << 8 | u32::from(self.log_page) << 16
    }

    pub fn namespaces_changed(&self) -> bool {
        self.kind == Self::NOTICE && self.info == Self::NS_ATTR_CHANGED
    }

    pub fn discovery_changed(&self) -> bool {
        self.kind == Self::NOTICE && self.info == Self::DISCOVERY_LOG_CHANGED
    }
}

/// What `list` and the metrics show.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CtrlStatus {
    pub machine: Status,
    pub cntlid: u16,
    /// When `machine` was taken, on the controller's clock.
    pub at: Instant,
    /// Duration of the last completed recovery (failure → LIVE).
    pub last_recovery: Option<Duration>,
    /// Where the last completed recovery's time went.
    pub last_trace: Option<RecoveryTrace>,
}

/// Where the time of one recovery went: instants on the controller's clock, taken by the
/// supervisor as each step ends (the marks of the attempt that connected; earlier attempts
/// are counted). Fixed size, so recording allocates nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RecoveryTrace {
    /// The failure reached the supervisor (it started tearing down).
    pub failed: Option<Instant>,
    /// Every HCA resource was dropped.
    pub torn_down: Option<Instant>,
    /// The attempt that connected started.
    pub attempt_start: Option<Instant>,
    /// It had the device open.
    pub device_open: Option<Instant>,
    /// Its admin queue's CM connection was established.
    pub admin_cm: Option<Instant>,
    /// Its admin queue was connected (Fabrics Connect) and the controller enabled.
    pub admin_ready: Option<Instant>,
    /// Every I/O queue was connected and held I/O resubmitted: LIVE.
    pub live: Option<Instant>,
    /// Attempts in the episode (the last one connected).
    pub attempts: u32,
}

impl CtrlStatus {
    pub fn state(&self) -> CtrlState {
        self.machine.state
    }
}

struct CtrlShared {
    /// Deletion was asked for. A state, not a wake-up: the supervisor looks at it at the top
    /// of every turn and while an attempt runs, so no request is lost to a race.
    deleting: AtomicBool,
    /// Wakes the supervisor when `deleting` is set.
    delete: Notify,
    alarm: Arc<Alarm>,
    status: watch::Sender<CtrlStatus>,
    clock: Clock,
}

/// Where the controller finds its device, and the context it runs on now.
struct DevShared<S: DeviceSource> {
    source: S,
    name: String,
    current: Mutex<S::Device>,
}

/// [`DevShared`] without its backend type: the public [`Controller`] has none, so exports and
/// the fio plugin hold one controller type whatever the backend.
trait Backing: Send + Sync {
    fn as_any(&self) -> &dyn Any;
    /// The current context, as `&Mutex<D>`.
    fn current(&self) -> &dyn Any;
    fn inflict_reset(
        &self,
        down_for: Duration,
    ) -> Pin<Box<dyn Future<Output = Result<(), String>> + Send + '_>>;
}

impl<S: DeviceSource> Backing for DevShared<S> {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn current(&self) -> &dyn Any {
        &self.current
    }

    fn inflict_reset(
        &self,
        down_for: Duration,
    ) -> Pin<Box<dyn Future<Output = Result<(), String>> + Send + '_>> {
        Box::pin(self.source.inflict_reset(&self.name, down_for))
    }
}

/// A connected NVMe-oF controller that survives its HCA.
pub struct Controller {
    pub cntlid: u16,
    pub opts: ConnectOptions,
    pub ident: IdentifyController,
    admin: QueueHandle,
    io: Vec<QueueHandle>,
    /// Read at connect, after each reconnect, and when the caller asks (Async Events).
    namespaces: Arc<NsTable>,
    /// Rescans the namespaces each time the controller is LIVE again after a reconnect.
    rescans: Option<tokio::task::JoinHandle<()>>,
    next: AtomicUsize,
    max_io: usize,
    shared: Arc<CtrlShared>,
    backing: Arc<dyn Backing>,
    sup: Option<tokio::task::JoinHandle<()>>,
}

/// The device context the controller currently runs on.
struct DevCtx<D: DeviceContext> {
    dev: D,
    cm: D::Cm,
    pd: Option<PdId>,
    generation: u64,
}

/// Labels are fixed at connect; handles update without allocating.
struct CtrlMetrics {
    state: metrics::Gauge,
    attempts: metrics::Counter,
    recoveries: metrics::Counter,
    requeued: metrics::Counter,
    failed: metrics::Counter,
    completed: metrics::Counter,
    copies: metrics::Counter,
    copied_bytes: metrics::Counter,
    recovery_secs: metrics::Histogram,
}

impl CtrlMetrics {
    fn new(subnqn: &str) -> CtrlMetrics {
        let l = [("subnqn", subnqn.to_string())];
        CtrlMetrics {
            state: metrics::gauge!("nvmf_ctrl_state", &l),
            attempts: metrics::counter!("nvmf_ctrl_reconnect_attempts_total", &l),
            recoveries: metrics::counter!("nvmf_ctrl_recoveries_total", &l),
            requeued: metrics::counter!("nvmf_ctrl_requeued_io_total", &l),
            failed: metrics::counter!("nvmf_ctrl_failed_io_total", &l),
            completed: metrics::counter!("nvmf_ctrl_completed_io_total", &l),
            copies: metrics::counter!("nvmf_ctrl_io_copies_total", &l),
            copied_bytes: metrics::counter!("nvmf_ctrl_io_copied_bytes_total", &l),
            recovery_secs: metrics::histogram!("nvmf_ctrl_recovery_seconds", &l),
        }
    }
}

/// A small fixed queue of events produced while executing actions.
#[derive(Default)]
struct EventQueue {
    buf: [Option<Event>; 16],
    head: usize,
    len: usize,
}

impl EventQueue {
    fn push(&mut self, e: Event) {
        if self.len < self.buf.len() {
            self.buf[(self.head + self.len) % self.buf.len()] = Some(e);
            self.len += 1;
        }
    }
    fn pop(&mut self) -> Option<Event> {
        if self.len == 0 {
            return None;
        }
        let e = self.buf[self.head].take();
        self.head = (self.head + 1) % self.buf.len();
        self.len -= 1;
        e
    }
}

/// The recovery side of a controller: owns the state machine, the device context and the
/// controller view of every queue.
struct Supervisor<S: DeviceSource> {
    sm: Machine,
    clock: Clock,
    opts: ConnectOptions,
    devs: Arc<DevShared<S>>,
    dev: Option<DevCtx<S::Device>>,
    ours: Identity,
    admin: QueueCtl<S::Device>,
    io: Vec<QueueCtl<S::Device>>,
    /// CM connection of each queue (admin first), preallocated.
    conns: Vec<Option<ConnId>>,
    connect_data: [u8; 1024],
    shared: Arc<CtrlShared>,
    disc_tx: mpsc::UnboundedSender<ConnId>,
    disc_rx: mpsc::UnboundedReceiver<ConnId>,
    changed: Arc<Notify>,
    cntlid: u16,
    nr_io: usize,
    /// The recovery under way (empty while LIVE).
    trace: RecoveryTrace,
    last_recovery: Option<Duration>,
    last_trace: Option<RecoveryTrace>,
    metrics: CtrlMetrics,
}

impl CtrlShared {
    fn request_delete(&self) {
        self.deleting.store(true, Ordering::SeqCst);
        // Every registered waiter (the turn loop's and an attempt's may both be): a single
        // permit could go to one that is no longer polled. A waiter not registered yet sees
        // the flag when it registers.
        self.delete.notify_waiters();
    }

    fn delete_requested(&self) -> bool {
        self.deleting.load(Ordering::SeqCst)
    }

    /// Resolves once deletion has been asked for (at once if it already was).
    async fn deleted(&self) {
        loop {
            let n = self.delete.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            if self.delete_requested() {
                return;
            }
            n.await;
        }
    }

    /// Resolves with the first cause raised on the current connection.
    async fn alarmed(&self) -> Cause {
        loop {
            let n = self.alarm.notify.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            if let Some(c) = self.alarm.take() {
                return c;
            }
            n.await;
        }
    }
}

/// How a reconnect attempt ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Attempt {
    Connected,
    /// The target refused or did not answer, or a step failed.
    Failed,
    /// The device went away under it, or a deadline of the machine fired while it ran.
    Cut,
    /// Deletion was asked for: the attempt was abandoned.
    Deleted,
}

impl<S: DeviceSource> Supervisor<S> {
    fn now(&self) -> Instant {
        self.clock.now()
    }

    fn queue(&self, qi: usize) -> QueueCtl<S::Device> {
        if qi == 0 {
            self.admin.clone()
        } else {
            self.io[qi - 1].clone()
        }
    }

    /// Why a connection was torn down under us: the device's death when it died (a removed
    /// device drops its connections, and rdma_cm may say so before anything else does), else
    /// the peer's or the fabric's disconnect.
    fn disconnect_cause(&self) -> Cause {
        match self.dev.as_ref().map(|d| d.dev.lifecycle()) {
            Some(Lifecycle::Removed) => Cause::DeviceRemoved,
            Some(Lifecycle::Fatal) => Cause::DeviceFatal,
            _ => Cause::CmDisconnect,
        }
    }

    /// Find our device: the live current context of the source's device.
    fn find_device(&self) -> Option<Opened<S::Device>> {
        self.devs.source.open(&self.devs.name)
    }

    /// What the device list says about our device, as events for the machine.
    fn scan(&self, q: &mut EventQueue) {
        let cur_gen = self.dev.as_ref().map(|d| d.generation);
        let cur_live = self
            .dev
            .as_ref()
            .is_some_and(|d| d.dev.lifecycle() == Lifecycle::Live);
        match self.find_device() {
            Some(Opened {
                identity,
                generation,
                ..
            }) => {
                if cur_gen.is_some_and(|g| g != generation) || (cur_gen.is_some() && !cur_live) {
                    // Ours died and another context took its place.
                    q.push(Event::DeviceDown { removed: false });
                }
                q.push(Event::DeviceUp(identity));
            }
            None => {
                let removed = !self.devs.source.present(&self.devs.name);
                q.push(Event::DeviceDown { removed });
            }
        }
    }

    /// Open the device for an attempt: a new CM service on a new context.
    fn open_device(&mut self) -> Result<(), HostError> {
        if self
            .dev
            .as_ref()
            .is_some_and(|d| d.dev.lifecycle() == Lifecycle::Live)
        {
            return Ok(());
        }
        self.dev = None;
        let Some(Opened {
            dev,
            identity,
            generation,
        }) = self.find_device()
        else {
            return Err(HostError::Step("device is not present"));
        };
        if !self.sm.policy().identity.accepts(&self.ours, &identity) {
            return Err(HostError::Transport(
                "a different device took our place".into(),
            ));
        }
        let cm = self.devs.source.cm(&dev);
        *self.devs.current.lock().unwrap_or_else(|e| e.into_inner()) = dev.clone();
        self.dev = Some(DevCtx {
            dev,
            cm,
            pd: None,
            generation,
        });
        Ok(())
    }

    /// A new PD on the current context.
    fn alloc_pd(&mut self) -> Result<PdId, HostError> {
        let d = self.dev.as_mut().ok_or(HostError::Step("no device"))?;
        if let Some(pd) = d.pd {
            return Ok(pd);
        }
        let pd = d.dev.alloc_pd()?;
        d.pd = Some(pd);
        Ok(pd)
    }

    /// Connect queue `qi` (0 = admin): verbs over the same buffers, CM, Fabrics Connect on
    /// the reserved slot.
    async fn connect_queue(&mut self, qi: usize) -> Result<(), HostError> {
        let pd = self.alloc_pd()?;
        let (dev, cm) = match &self.dev {
            Some(d) => (d.dev.clone(), d.cm.clone()),
            None => return Err(HostError::Step("no device")),
        };
        let ctl = self.queue(qi);
        let qpn = ctl.lock().attach(&dev, pd)?;
        ctl.poke();
        let spec = ctl.lock().spec;
        let mut params = ConnectParams::new(qpn, self.opts.trsvcid);
        params.path_mtu = self.opts.mtu;
        let cntlid = if qi == 0 { CNTLID_DYNAMIC } else { self.cntlid };
        let private = NvmeCmRequest {
            qid: spec.qid,
            hrqsize: spec.size as u16,
            hsqsize: spec.size as u16 - 1,
            cntlid,
        }
        .emit();
        let est = cm
            .connect(
                self.opts.traddr,
                params,
                &private,
                self.opts.connect_timeout,
            )
            .await?;
        self.conns[qi] = Some(est.id);
        if qi == 0 {
            self.trace.admin_cm = Some(self.now());
        }
        cm.watch(est.id, self.disc_tx.clone());
        let peer = PeerInfo {
            addr: est.peer,
            qpn: est.remote_qpn,
            psn: est.remote_psn,
        };
        ctl.lock().connected(peer, est.local_psn)?;
        ctl.poke();
        self.connect_data[16..18].copy_from_slice(&cntlid.to_le_bytes());
        let kato_ms = if qi == 0 {
            self.opts.keep_alive_tmo.as_millis().min(u32::MAX as u128) as u32
        } else {
            0
        };
        let sqe = FabricsCmd::Connect {
            recfmt: fabrics::RECFMT_0,
            qid: spec.qid,
            sqsize: spec.size as u16 - 1,
            cattr: 0,
            kato_ms,
        }
        .to_sqe(0);
        let cqe = ctl
            .control(sqe, &self.connect_data, 0, self.opts.connect_timeout)
            .await?;
        match ConnectResult::from_result(cqe.result, true) {
            ConnectResult::Ok { cntlid, .. } => {
                if qi == 0 {
                    self.cntlid = cntlid;
                }
                Ok(())
            }
            ConnectResult::InvalidParameter { ipo, iattr } => Err(HostError::Connect(format!(
                "Connect refused parameter at offset {ipo} (attr {iattr})"
            ))),
        }
    }

    async fn admin_cmd(&self, sqe: Sqe) -> Result<u64, HostError> {
        let cqe = self
            .admin
            .control(sqe, &[], 0, self.opts.connect_timeout)
            .await?;
        Ok(cqe.result)
    }

    /// Connect the admin queue and enable the controller (CC.EN, wait for CSTS.RDY).
    async fn connect_admin(&mut self) -> Result<Cap, HostError> {
        self.connect_queue(0).await?;
        let cap = Cap(self
            .admin_cmd(FabricsCmd::get(fabrics::reg::CAP).to_sqe(0))
            .await?);
        self.admin_cmd(FabricsCmd::set(fabrics::reg::CC, Cc::enable_default().0 as u64).to_sqe(0))
            .await?;
        let deadline =
            tokio::time::Instant::now() + Duration::from_millis(cap.timeout_ms().max(500) as u64);
        let mut pause = Duration::from_millis(1);
        loop {
            let csts = Csts(
                self.admin_cmd(FabricsCmd::get(fabrics::reg::CSTS).to_sqe(0))
                    .await? as u32,
            );
            if csts.cfs() {
                return Err(HostError::Step("controller fatal status while enabling"));
            }
            if csts.rdy() {
                return Ok(cap);
            }
            if tokio::time::Instant::now() > deadline {
                return Err(HostError::Step(
                    "controller did not become ready (CSTS.RDY)",
                ));
            }
            // CAP.TO is the bound; poll quickly first, then back off.
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(50));
        }
    }

    /// Set Features Number of Queues; how many I/O queues the controller grants.
    async fn negotiate_queues(&self, want: u32) -> Result<u32, HostError> {
        let dw0 = self
            .admin_cmd(admin::set_num_queues(0, want, want)?)
            .await? as u32;
        let (sq, cq) = admin::num_queues_allocated(dw0);
        Ok(want.min(sq).min(cq))
    }

    /// A reconnect attempt: admin, then the I/O queues, on the same buffers.
    async fn reconnect(&mut self) -> Result<(), HostError> {
        self.trace.attempt_start = Some(self.now());
        self.open_device()?;
        self.trace.device_open = Some(self.now());
        self.connect_admin().await?;
        self.trace.admin_ready = Some(self.now());
        if self.nr_io > 0 {
            let n = self.negotiate_queues(self.nr_io as u32).await?;
            if (n as usize) < self.nr_io {
                return Err(HostError::Step(
                    "the controller now grants fewer I/O queues",
                ));
            }
            for qi in 1..=self.nr_io {
                self.connect_queue(qi).await?;
            }
        }
        Ok(())
    }

    /// Drop every HCA resource, whatever state it is in. In-flight I/O stays held in its
    /// slot. Releases on a zombie device always succeed.
    fn teardown(&mut self) {
        // Whatever the old connection's queues still report is about the old connection.
        self.shared.alarm.new_epoch();
        for q in self.io.iter().rev() {
            q.lock().teardown();
            q.poke();
        }
        self.admin.lock().teardown();
        self.admin.poke();
        if let Some(d) = self.dev.take() {
            for c in self.conns.iter_mut() {
                if let Some(id) = c.take() {
                    d.cm.abort(id);
                }
            }
            if let Some(pd) = d.pd {
                d.dev.dealloc_pd(pd);
            }
            // A context that is still live (CM disconnect, keep-alive loss) is reused on
            // the next attempt; a dead one is let go.
            if d.dev.lifecycle() == Lifecycle::Live {
                self.dev = Some(DevCtx { pd: None, ..d });
            }
        }
        for c in self.conns.iter_mut() {
            *c = None;
        }
    }

    /// Orderly shutdown on delete: CC.SHN, then DREQ on every queue.
    async fn shutdown(&mut self) {
        if self.admin.lock().is_live() {
            let shn = Cc::enable_default().with_shn(1).0 as u64;
            let sqe = FabricsCmd::set(fabrics::reg::CC, shn).to_sqe(0);
            let _ = self
                .admin
                .control(sqe, &[], 0, Duration::from_secs(1))
                .await;
        }
        if let Some(d) = &self.dev {
            for c in self.conns.iter_mut() {
                if let Some(id) = c.take() {
                    d.cm.disconnect(id);
                }
            }
        }
    }

    fn all_queues(&self) -> impl Iterator<Item = &QueueCtl<S::Device>> {
        std::iter::once(&self.admin).chain(self.io.iter())
    }

    fn sum_stats(&self, f: impl Fn(&QueueStats) -> u64) -> u64 {
        self.all_queues().map(|q| f(&q.lock().stats)).sum()
    }

    fn publish(&mut self) {
        let now = self.now();
        let m = self.sm.status(now);
        self.metrics.state.set(m.state.index() as f64);
        self.metrics
            .requeued
            .absolute(self.sum_stats(|s| s.requeued));
        self.metrics.failed.absolute(self.sum_stats(|s| s.failed));
        // The I/O queues' data-path counters (what `Controller::io_copies` reports) are read
        // here, at each event (keep-alive included), not counted per I/O: the hot path
        // stays free of the metrics facade.
        let (mut done, mut copies, mut bytes) = (0, 0, 0);
        for q in &self.io {
            let s = &q.lock().stats;
            (done, copies, bytes) = (
                done + s.completed,
                copies + s.copies,
                bytes + s.copied_bytes,
            );
        }
        self.metrics.completed.absolute(done);
        self.metrics.copies.absolute(copies);
        self.metrics.copied_bytes.absolute(bytes);
        let st = CtrlStatus {
            machine: m,
            cntlid: self.cntlid,
            at: now,
            last_recovery: self.last_recovery,
            last_trace: self.last_trace,
        };
        self.shared.status.send_if_modified(|old| {
            let changed = old.machine != st.machine || old.cntlid != st.cntlid;
            *old = st;
            changed
        });
    }

    /// Execute one action; the events it produces go to `q`.
    async fn execute(&mut self, a: Action, q: &mut EventQueue) {
        let now = self.now();
        match a {
            Action::StopKeepAlive => {}
            Action::SendKeepAlive => {
                let _ = self
                    .admin
                    .lock()
                    .post_control(now, admin::keep_alive(0), &[], 0);
                self.admin.poke();
            }
            Action::Shutdown => self.shutdown().await,
            Action::TearDown => {
                if self.trace.failed.is_none() && self.sm.state() == CtrlState::Resetting {
                    self.trace = RecoveryTrace {
                        failed: Some(now),
                        ..RecoveryTrace::default()
                    };
                }
                tracing::info!(
                    subnqn = %self.opts.subnqn,
                    cause = self.sm.status(now).cause.map_or("-", |c| c.name()),
                    "controller resetting: dropping HCA resources"
                );
                self.teardown();
                self.trace.torn_down = Some(self.now());
                q.push(Event::TornDown);
                self.scan(q);
            }
            Action::Connect { attempt } => {
                self.metrics.attempts.increment(1);
                // `list` shows the attempt while it runs.
                self.publish();
                tracing::info!(subnqn = %self.opts.subnqn, attempt, "reconnecting");
                match self.attempt().await {
                    Attempt::Connected => q.push(Event::Connected),
                    Attempt::Failed => q.push(Event::ConnectFailed),
                    Attempt::Cut => q.push(Event::ConnectCut),
                    // The turn loop feeds Delete before anything else.
                    Attempt::Deleted => {}
                }
            }
            Action::Resubmit => {
                for c in self.all_queues() {
                    c.lock().resume(now);
                    c.poke();
                }
                if let Some(t) = self.trace.failed {
                    let d = now.saturating_since(t);
                    self.trace.live = Some(now);
                    self.trace.attempts = self.sm.status(now).attempt;
                    self.last_recovery = Some(d);
                    self.last_trace = Some(self.trace);
                    self.metrics.recovery_secs.record(d.as_secs_f64());
                }
                self.trace = RecoveryTrace::default();
                self.metrics.recoveries.increment(1);
                tracing::info!(subnqn = %self.opts.subnqn, "controller live again");
            }
            Action::FailHeld(why) => {
                for c in self.all_queues() {
                    c.lock().fail_held(why, false);
                    c.poke();
                }
            }
            Action::FailAll(why) => {
                self.teardown();
                self.dev = None;
                // The controller is DEAD before anyone hears of it: whoever gets the error
                // and then asks for the status sees the end, not DELETING.
                let more = self.sm.handle(now, Event::Deleted);
                debug_assert!(more.is_empty());
                self.publish();
                for c in self.all_queues() {
                    c.lock().fail_held(why, true);
                    c.poke();
                }
                tracing::warn!(subnqn = %self.opts.subnqn, reason = why.name(), "controller deleted");
            }
        }
    }

    /// Run a reconnect attempt while still honouring the machine's deadlines and deletion.
    /// A deadline or a delete request abandons it.
    async fn attempt(&mut self) -> Attempt {
        // The attempt borrows `self`; deadlines are watched from a copy of the machine's
        // next timeout, and the machine fires them once the attempt is abandoned.
        let deadline = self.sm.poll_timeout();
        let shared = self.shared.clone();
        let clock = self.clock;
        let sleep = async move {
            match deadline {
                Some(t) => {
                    let d = t.saturating_since(clock.now());
                    tokio::time::sleep(d).await
                }
                None => std::future::pending().await,
            }
        };
        let r = {
            let fut = self.reconnect();
            tokio::pin!(fut);
            tokio::select! {
                biased;
                _ = shared.deleted() => return Attempt::Deleted,
                r = &mut fut => Some(r),
                _ = sleep => None,
            }
        };
        match r {
            Some(Ok(())) => Attempt::Connected,
            Some(Err(e)) => {
                tracing::info!(subnqn = %self.opts.subnqn, error = %e, "reconnect attempt failed");
                // An attempt the device's death cut short says nothing about the target.
                let device_gone = self
                    .dev
                    .as_ref()
                    .is_none_or(|d| d.dev.lifecycle() != Lifecycle::Live);
                if device_gone {
                    Attempt::Cut
                } else {
                    Attempt::Failed
                }
            }
            None => Attempt::Cut,
        }
    }

    async fn run(mut self) {
        let mut q = EventQueue::default();
        loop {
            let changed = self.changed.clone();
            let changed_fut = changed.notified();
            tokio::pin!(changed_fut);
            changed_fut.as_mut().enable();
            let shared = self.shared.clone();
            let delete_fut = shared.deleted();
            tokio::pin!(delete_fut);
            let alarm = self.shared.alarm.clone();
            let alarm_fut = alarm.notify.notified();
            tokio::pin!(alarm_fut);
            alarm_fut.as_mut().enable();
            let ka_done = self.admin.control_done.clone();
            let ka_fut = ka_done.notified();
            tokio::pin!(ka_fut);
            ka_fut.as_mut().enable();

            // Gather inputs.
            if let Some(c) = alarm.take() {
                q.push(Event::Failed(c));
            }
            while let Ok(id) = self.disc_rx.try_recv() {
                if self.conns.contains(&Some(id)) {
                    q.push(Event::Failed(self.disconnect_cause()));
                }
            }
            if self.sm.state() == CtrlState::Live {
                let done = self.admin.lock().take_control();
                if let Some(queue::ControlDone::Completed(c)) = done {
                    if c.nvme_status().is_success() {
                        q.push(Event::KeepAliveOk);
                    }
                }
            }
            if self.sm.state() != CtrlState::Live {
                self.scan(&mut q);
            }
            // Feed and act until quiet. A delete request goes before anything queued, and is
            // looked at again after every action (an attempt with no delay never leaves
            // this loop on its own).
            loop {
                let now = self.now();
                let deleting = matches!(self.sm.state(), CtrlState::Deleting | CtrlState::Dead);
                let acts = if self.shared.delete_requested() && !deleting {
                    while q.pop().is_some() {}
                    self.sm.handle(now, Event::Delete)
                } else {
                    match q.pop() {
                        Some(ev) => self.sm.handle(now, ev),
                        None => {
                            let a = self.sm.handle_timeout(now);
                            if a.is_empty() {
                                break;
                            }
                            a
                        }
                    }
                };
                for a in acts.iter() {
                    self.execute(a, &mut q).await;
                }
                self.publish();
            }
            if self.sm.state() == CtrlState::Dead {
                self.publish();
                return;
            }
            let sleep_for = self
                .sm
                .poll_timeout()
                .map(|t| t.saturating_since(self.now()));
            // Biased, so that a simulated run replays (tokio's unbiased choice is random).
            tokio::select! {
                biased;
                _ = &mut changed_fut => {}
                _ = &mut delete_fut => {}
                _ = &mut alarm_fut => {}
                _ = &mut ka_fut => {}
                id = self.disc_rx.recv() => {
                    if let Some(id) = id {
                        if self.conns.contains(&Some(id)) {
                            q.push(Event::Failed(self.disconnect_cause()));
                        }
                    }
                }
                _ = async {
                    match sleep_for {
                        Some(d) => tokio::time::sleep(d).await,
                        None => std::future::pending().await,
                    }
                } => {}
            }
        }
    }
}

impl Controller {
    /// Connect admin and I/O queues to `o.subnqn` through one device context and identify
    /// the controller. Recovery works for CM disconnects and keep-alive loss; if the device
    /// itself dies the controller waits for ctrl_loss_tmo (use [`Controller::connect_managed`]
    /// to survive resets and re-plugs).
    pub async fn connect<D: DeviceContext>(
        dev: D,
        cm: D::Cm,
        o: ConnectOptions,
    ) -> Result<Controller, HostError> {
        // The context is ours even if it is already dead: bring-up then fails on it.
        let first = Some(dev.clone());
        Self::connect_with(Fixed::new(dev, cm), String::new(), first, o).await
    }

    /// Connect through device `name` of `source`, and come back through it after resets and
    /// re-plugs.
    pub async fn connect_managed<S: DeviceSource>(
        source: S,
        name: &str,
        o: ConnectOptions,
    ) -> Result<Controller, HostError> {
        let first = source.open(name).map(|d| d.dev);
        Self::connect_with(source, name.to_string(), first, o).await
    }

    /// Connect through `name` of `source`, starting on context `first`.
    async fn connect_with<S: DeviceSource>(
        source: S,
        name: String,
        first: Option<S::Device>,
        o: ConnectOptions,
    ) -> Result<Controller, HostError> {
        if !(16..=1024).contains(&o.queue_size) {
            return Err(HostError::Invalid(format!(
                "queue size {} not in 16..=1024",
                o.queue_size
            )));
        }
        if o.nr_io_queues == 0 {
            return Err(HostError::Invalid(
                "at least one I/O queue is needed".into(),
            ));
        }
        // Refuse bad NQNs before a connection exists that an early return would leak.
        let subnqn = Nqn::new(&o.subnqn)?;
        let hostnqn = Nqn::new(&o.hostnqn)?;
        let discovery = subnqn.is_discovery();
        let clock = Clock(tokio::time::Instant::now());
        let alarm = Arc::new(Alarm::default());
        let admin_spec = QueueSpec {
            qid: 0,
            size: 32,
            inline: 0,
            inline_depth: 0,
            max_io: 64 << 10,
            mtu: o.mtu,
        };
        let admin_core: QueueCore<S::Device> =
            QueueCore::new(admin_spec, alarm.clone(), o.io_timeout, o.max_retries)?;
        let (admin_h, admin_ctl, _admin_task) = queue::spawn(admin_core, clock);
        let changed = source.changed();
        let Some(first) = first else {
            return Err(HostError::Connect(
                "no such device, or it is not live".into(),
            ));
        };
        let ours = first.identity();
        let mut policy = o.policy;
        policy.keep_alive_tmo = if discovery {
            Duration::ZERO
        } else {
            o.keep_alive_tmo
        };
        let shared = Arc::new(CtrlShared {
            deleting: AtomicBool::new(false),
            delete: Notify::new(),
            alarm: alarm.clone(),
            status: watch::channel(CtrlStatus {
                machine: Machine::new(policy, ours).status(Instant(0)),
                cntlid: 0,
                at: Instant(0),
                last_recovery: None,
                last_trace: None,
            })
            .0,
            clock,
        });
        let devs = Arc::new(DevShared {
            source,
            name,
            current: Mutex::new(first),
        });
        let (disc_tx, disc_rx) = mpsc::unbounded_channel();
        let connect_data = ConnectData {
            hostid: o.hostid,
            cntlid: CNTLID_DYNAMIC,
            subnqn,
            hostnqn,
        }
        .to_bytes();
        let mut sup = Supervisor {
            sm: Machine::new(policy, ours),
            clock,
            devs: devs.clone(),
            dev: None,
            ours,
            admin: admin_ctl,
            io: Vec::new(),
            conns: vec![None; o.nr_io_queues + 1],
            connect_data,
            shared: shared.clone(),
            disc_tx,
            disc_rx,
            changed,
            cntlid: 0,
            nr_io: 0,
            trace: RecoveryTrace::default(),
            last_recovery: None,
            last_trace: None,
            metrics: CtrlMetrics::new(&o.subnqn),
            opts: o.clone(),
        };
        let mut c = Controller {
            cntlid: 0,
            opts: o,
            ident: IdentifyController::default(),
            admin: admin_h,
            io: Vec::new(),
            namespaces: Arc::new(NsTable::new()),
            rescans: None,
            next: AtomicUsize::new(0),
            max_io: 0,
            shared,
            backing: devs,
            sup: None,
        };
        // Bring-up runs under the rules of recovery: each step has a deadline, and a failure
        // of the connection under it (device reset, transport error, I/O timeout) ends it
        // at once. Nobody is recovering this controller yet, so that is a failed connect,
        // as in Linux, with the cause; never a command held for a recovery that never comes.
        let watch = sup.shared.clone();
        // Biased (a simulated run must replay), the alarm first: a connection that failed
        // while its bring-up finished is a failed connect.
        let r = tokio::select! {
            biased;
            cause = watch.alarmed() => Err(HostError::Connect(format!(
                "the connection failed while it was being set up ({}); nothing is connected, \
                 try again",
                cause.name()
            ))),
            r = c.bring_up(&mut sup, discovery) => r,
        };
        let now = clock.now();
        if let Err(e) = r {
            let acts = sup.sm.handle(now, Event::ConnectFailed);
            let mut q = EventQueue::default();
            for a in acts.iter() {
                sup.execute(a, &mut q).await;
            }
            return Err(e);
        }
        sup.sm.handle(now, Event::Connected);
        c.cntlid = sup.cntlid;
        sup.publish();
        if !discovery {
            c.rescans = Some(tokio::spawn(crate::harness::alloc_audit::after_recovery(
                rescan_after_reconnects(
                    c.admin.clone(),
                    c.opts.connect_timeout,
                    c.namespaces.clone(),
                    c.watch_status(),
                    c.opts.subnqn.clone(),
                ),
            )));
        }
        c.sup = Some(tokio::spawn(sup.run()));
        Ok(c)
    }

    async fn bring_up<S: DeviceSource>(
        &mut self,
        sup: &mut Supervisor<S>,
        discovery: bool,
    ) -> Result<(), HostError> {
        sup.open_device()?;
        let cap = sup.connect_admin().await?;
        sup.admin.lock().resume(sup.now());
        let r = self
            .bring_up_cmd(admin::identify_controller(0), 4096)
            .await?;
        self.ident =
            IdentifyController::parse(&r.data).map_err(|e| HostError::Protocol(e.to_string()))?;
        self.max_io = self.opts.max_io;
        if let Some(m) = self.ident.max_transfer_bytes(cap.min_page_size()) {
            self.max_io = self.max_io.min(m as usize);
        }
        if discovery {
            return Ok(());
        }
        let inline = (self.ident.in_capsule_data_bytes() as usize).min(16 << 10);
        let n = sup
            .negotiate_queues(self.opts.nr_io_queues as u32)
            .await?
            .max(1);
        let size = (cap.max_queue_entries() as usize).min(self.opts.queue_size);
        let inline_depth = self.opts.inline_depth.unwrap_or_else(|| {
            let in_memory = sup
                .dev
                .as_ref()
                .is_some_and(|d| d.dev.reaches_in_memory(self.opts.traddr));
            inline_depth_for(self.opts.traddr, in_memory)
        });
        for qid in 1..=n as u16 {
            let spec = QueueSpec {
                qid,
                size,
                inline,
                inline_depth,
                max_io: self.max_io,
                mtu: self.opts.mtu,
            };
            let core = QueueCore::new(
                spec,
                sup.shared.alarm.clone(),
                self.opts.io_timeout,
                self.opts.max_retries,
            )?;
            let (h, ctl, _task) = queue::spawn(core, sup.clock);
            sup.io.push(ctl);
            self.io.push(h);
            sup.nr_io = sup.io.len();
            sup.connect_queue(qid as usize).await?;
            sup.io[qid as usize - 1].lock().resume(sup.now());
        }
        let ns = identify_namespaces(&self.admin, self.opts.connect_timeout).await?;
        *self
            .namespaces
            .list
            .write()
            .unwrap_or_else(|e| e.into_inner()) = ns;
        Ok(())
    }

    /// Read the namespaces again (after a Namespace Attribute Changed event; the controller
    /// does it itself after each reconnect): added ones appear in
    /// [`namespaces`](Self::namespaces), removed ones go, sizes and identities are updated.
    pub async fn rescan_namespaces(&self) -> Result<Vec<NsInfo>, HostError> {
        self.namespaces
            .rescan(&self.admin, self.opts.connect_timeout, &self.opts.subnqn)
            .await
    }

    /// A receiver that sees each rescan that changed the namespaces (a count of them).
    pub fn watch_namespaces(&self) -> watch::Receiver<u64> {
        self.namespaces.version.subscribe()
    }

    /// Wait for the controller's next Asynchronous Event: one Async Event Request stays
    /// outstanding on the admin queue (exempt from the I/O timeout) until the target has
    /// something to say. For a Notice, the log page it names is read, as the spec asks
    /// before the controller reports that kind of event again. Fails when the controller
    /// is deleted.
    pub async fn next_async_event(&self) -> Result<AsyncEvent, HostError> {
        let r = self
            .admin
            .submit(admin::async_event_request(0), None, 0)
            .await?;
        let ev = AsyncEvent::from_result(r.cqe.result as u32);
        if ev.kind == 2 && ev.log_page != 0 && ev.log_page != crate::nvme::admin::lid::DISCOVERY {
            // Re-arms the event; its contents (the changed namespaces) are not needed, as
            // the caller rescans.
            let _ = tokio::time::timeout(
                self.opts.connect_timeout,
                self.admin.submit(
                    admin::get_log_page(0, 0xFFFF_FFFF, ev.log_page, 0, 4096)?,
                    None,
                    4096,
                ),
            )
            .await;
        }
        Ok(ev)
    }

    /// An admin command of bring-up, bounded by `connect_timeout`.
    async fn bring_up_cmd(&self, sqe: Sqe, data_in: usize) -> Result<queue::Response, HostError> {
        bounded_admin(&self.admin, self.opts.connect_timeout, sqe, data_in).await
    }

    /// The device context this controller currently runs on, if it is a `D`.
    pub fn device<D: DeviceContext>(&self) -> Option<D> {
        let m = self.backing.current().downcast_ref::<Mutex<D>>()?;
        Some(m.lock().unwrap_or_else(|e| e.into_inner()).clone())
    }

    /// Now on the controller's clock, the one [`CtrlStatus::at`] and [`RecoveryTrace`] use.
    pub fn now(&self) -> Instant {
        self.shared.clock.now()
    }

    /// State, attempts, time left, as of now.
    pub fn status(&self) -> CtrlStatus {
        let mut s = *self.shared.status.borrow();
        let now = self.shared.clock.now();
        let passed = now.saturating_since(s.at);
        s.machine.loss_in = s.machine.loss_in.map(|d| d.saturating_sub(passed));
        s.at = now;
        s
    }

    /// A receiver that sees every state change.
    pub fn watch_status(&self) -> watch::Receiver<CtrlStatus> {
        self.shared.status.subscribe()
    }

    /// Wait until the status satisfies `f`, at most `timeout`.
    pub async fn wait_status(
        &self,
        timeout: Duration,
        f: impl Fn(&CtrlStatus) -> bool,
    ) -> Result<CtrlStatus, HostError> {
        let mut rx = self.watch_status();
        let r =
            tokio::time::timeout(timeout, async { rx.wait_for(|s| f(s)).await.map(|s| *s) }).await;
        match r {
            Ok(Ok(s)) => Ok(s),
            Ok(Err(_)) => Err(HostError::Gone("controller ended".into())),
            Err(_) => Err(HostError::Timeout(format!(
                "status condition not reached; now {:?}",
                self.status().machine
            ))),
        }
    }

    /// Chaos: reset the HCA under this controller (a fatal error; the device comes back
    /// after `down_for`). Needs a managed device ([`Controller::connect_managed`]).
    pub async fn reset_device(&self, down_for: Duration) -> Result<(), HostError> {
        self.backing
            .inflict_reset(down_for)
            .await
            .map_err(HostError::Invalid)
    }

    /// The device source and device name the controller runs on, if the source is an `S`.
    pub fn device_source<S: DeviceSource>(&self) -> Option<(S, String)> {
        let d = self.backing.as_any().downcast_ref::<DevShared<S>>()?;
        Some((d.source.clone(), d.name.clone()))
    }

    /// Start recovery now, as on any failure (nvme-cli `reset`).
    pub fn reset(&self) {
        self.shared.alarm.raise(Cause::UserReset);
    }

    pub fn state(&self) -> CtrlState {
        self.shared.status.borrow().machine.state
    }

    /// True once a keep-alive went unanswered (the controller then recovers).
    pub fn keep_alive_failed(&self) -> bool {
        self.shared.status.borrow().machine.cause == Some(Cause::KeepAliveLost)
    }

    /// The active namespaces (a copy: a rescan may change them).
    pub fn namespaces(&self) -> Vec<NsInfo> {
        self.namespaces.get().clone()
    }

    pub fn namespace(&self, nsid: u32) -> Result<NsInfo, HostError> {
        self.namespaces
            .get()
            .iter()
            .find(|n| n.nsid == nsid)
            .copied()
            .ok_or_else(|| HostError::Invalid(format!("no namespace {nsid}")))
    }

    /// The namespace `ns` as it is now (its size may have changed), if it is still behind
    /// its NSID: a user that opened `ns` checks here before each request, so that after a
    /// rescan found it removed or replaced by a different namespace (another identity) the
    /// user gets errors, never the other namespace's blocks.
    pub fn same_namespace(&self, ns: &NsInfo) -> Result<NsInfo, HostError> {
        let nsid = ns.nsid;
        match self.namespace(nsid) {
            Ok(now) if now.same_as(ns) => Ok(now),
            Ok(_) => Err(HostError::NamespaceGone(format!(
                "namespace {nsid} was replaced by a different namespace (its identity \
                 changed): open it again to use the new one"
            ))),
            Err(_) => Err(HostError::NamespaceGone(format!(
                "namespace {nsid} was removed from the controller"
            ))),
        }
    }

    pub fn io_queue_count(&self) -> usize {
        self.io.len()
    }

    pub fn max_transfer(&self) -> usize {
        self.max_io
    }

    /// Payload copies the host made on its I/O queues so far, and their bytes
    /// ([`QueueStats::copies`]).
    pub fn io_copies(&self) -> (u64, u64) {
        self.io
            .iter()
            .map(|q| q.stats())
            .fold((0, 0), |(n, b), s| (n + s.copies, b + s.copied_bytes))
    }

    /// Counters of every queue, admin first.
    pub fn queue_stats(&self) -> Vec<QueueStats> {
        std::iter::once(&self.admin)
            .chain(self.io.iter())
            .map(|q| q.stats())
            .collect()
    }

    fn pick(&self) -> &QueueHandle {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.io.len();
        &self.io[i]
    }

    /// The I/O queue a caller pinned itself to (`queue % count`), for per-core submission.
    pub fn queue(&self, queue: usize) -> &QueueHandle {
        &self.io[queue % self.io.len()]
    }

    /// The admin queue, for commands of the caller's own.
    pub fn admin_queue(&self) -> &QueueHandle {
        &self.admin
    }

    fn check(&self, nsid: u32, lba: u64, bytes: usize) -> Result<(NsInfo, u64), HostError> {
        let ns = self.namespace(nsid)?;
        let bs = ns.block_size as usize;
        if bytes == 0 || bytes % bs != 0 {
            return Err(HostError::Invalid(format!(
                "length {bytes} is not a positive multiple of the {bs}-byte block size"
            )));
        }
        let blocks = (bytes / bs) as u64;
        if lba.checked_add(blocks).is_none_or(|end| end > ns.blocks) {
            return Err(HostError::Invalid(format!(
                "blocks {lba}..{} are beyond the namespace end ({} blocks)",
                lba.saturating_add(blocks),
                ns.blocks
            )));
        }
        Ok((ns, blocks))
    }

    /// Read `bytes` starting at block `lba`.
    pub async fn read(&self, nsid: u32, lba: u64, bytes: usize) -> Result<Vec<u8>, HostError> {
        let mut out = Vec::with_capacity(bytes);
        self.read_chunks(nsid, lba, bytes, |d| out.extend_from_slice(d))
            .await?;
        Ok(out)
    }

    /// Read `out.len()` bytes starting at block `lba` into `out`, with no buffer of its own
    /// per request: each command's data is copied from its slot into a recycled response
    /// buffer and from there into `out` (two copies, counted in [`QueueStats::copies`]).
    /// A length that is not a positive multiple of the block size is `HostError::Invalid`
    /// (nothing is sent). On an error `out` may hold part of the data.
    pub async fn read_into(&self, nsid: u32, lba: u64, out: &mut [u8]) -> Result<(), HostError> {
        let mut done = 0;
        self.read_chunks(nsid, lba, out.len(), |d| {
            out[done..done + d.len()].copy_from_slice(d);
            done += d.len();
        })
        .await
    }

    /// Read `bytes` at `lba` in commands of at most the transfer limit, handing each one's
    /// data to `sink` in order.
    async fn read_chunks(
        &self,
        nsid: u32,
        lba: u64,
        bytes: usize,
        mut sink: impl FnMut(&[u8]),
    ) -> Result<(), HostError> {
        let (ns, _) = self.check(nsid, lba, bytes)?;
        let bs = ns.block_size as usize;
        let chunk = (self.max_io / bs).max(1) * bs;
        let mut done = 0;
        while done < bytes {
            let n = chunk.min(bytes - done);
            let slba = lba + (done / bs) as u64;
            let sqe = admin::read(0, nsid, slba, (n / bs) as u32)?;
            let q = self.pick();
            let r = q.submit_slice(sqe, None, n).await?;
            if r.data.len() != n {
                return Err(HostError::Transport(format!(
                    "read of {n} bytes returned {}",
                    r.data.len()
                )));
            }
            sink(&r.data);
            q.recycle_copied(r.data, n);
            done += n;
        }
        Ok(())
    }

    /// Write `data` starting at block `lba`.
    pub async fn write(&self, nsid: u32, lba: u64, data: &[u8]) -> Result<(), HostError> {
        let (ns, _) = self.check(nsid, lba, data.len())?;
        let bs = ns.block_size as usize;
        let chunk = (self.max_io / bs).max(1) * bs;
        for (i, part) in data.chunks(chunk).enumerate() {
            let slba = lba + (i * chunk / bs) as u64;
            let sqe = admin::write(0, nsid, slba, (part.len() / bs) as u32, false)?;
            self.pick().submit_slice(sqe, Some(part), 0).await?;
        }
        Ok(())
    }

    /// Host memory for I/O with no copy: `chunks` chunks of `chunk` bytes (at most
    /// [`Controller::max_transfer`]), registered with one I/O queue, used by
    /// [`Controller::read_to`] and [`Controller::write_from`].
    pub fn io_buffer(&self, chunk: usize, chunks: usize) -> Result<IoBuffer, HostError> {
        self.pick().register_buffer(chunk, chunks)
    }

    /// Read `len` bytes at block `lba` into chunk `chunk` of `buf`: the target writes them
    /// there, nothing is copied. One command, so `len` is at most the chunk's length; one
    /// command at a time per chunk.
    pub async fn read_to(
        &self,
        buf: &IoBuffer,
        chunk: usize,
        nsid: u32,
        lba: u64,
        len: usize,
    ) -> Result<(), HostError> {
        self.registered_io(buf, chunk, nsid, lba, len, false).await
    }

    /// Write the first `len` bytes of chunk `chunk` of `buf` at block `lba`: the target
    /// reads them from there, nothing is copied. As [`Controller::read_to`].
    pub async fn write_from(
        &self,
        buf: &IoBuffer,
        chunk: usize,
        nsid: u32,
        lba: u64,
        len: usize,
    ) -> Result<(), HostError> {
        self.registered_io(buf, chunk, nsid, lba, len, true).await
    }

    /// One command of [`Controller::read_to`] or [`Controller::write_from`].
    async fn registered_io(
        &self,
        buf: &IoBuffer,
        chunk: usize,
        nsid: u32,
        lba: u64,
        len: usize,
        write: bool,
    ) -> Result<(), HostError> {
        let (ns, _) = self.check_registered(buf, nsid, lba, len)?;
        let blocks = (len / ns.block_size as usize) as u32;
        let sqe = if write {
            admin::write(0, nsid, lba, blocks, false)?
        } else {
            admin::read(0, nsid, lba, blocks)?
        };
        buf.queue()
            .submit_region(sqe, buf.io(chunk, len, write))
            .await
            .map(|_| ())
    }

    /// [`Controller::check`] for a command on a registered buffer of this controller.
    fn check_registered(
        &self,
        buf: &IoBuffer,
        nsid: u32,
        lba: u64,
        len: usize,
    ) -> Result<(NsInfo, u64), HostError> {
        if !self.io.iter().any(|q| q.same(buf.queue())) {
            return Err(HostError::Invalid(
                "the registered buffer belongs to another controller".into(),
            ));
        }
        if len > buf.chunk_len() {
            return Err(HostError::Invalid(format!(
                "{len} bytes do not fit a {}-byte chunk of the registered buffer",
                buf.chunk_len()
            )));
        }
        self.check(nsid, lba, len)
    }

    pub async fn flush(&self, nsid: u32) -> Result<(), HostError> {
        self.namespace(nsid)?;
        self.pick()
            .submit(admin::flush(0, nsid), None, 0)
            .await
            .map(|_| ())
    }

    pub async fn write_zeroes(&self, nsid: u32, lba: u64, blocks: u32) -> Result<(), HostError> {
        let ns = self.namespace(nsid)?;
        self.check(nsid, lba, blocks as usize * ns.block_size as usize)?;
        self.pick()
            .submit(admin::write_zeroes(0, nsid, lba, blocks, false)?, None, 0)
            .await
            .map(|_| ())
    }

    /// Dataset Management, deallocate (TRIM).
    pub async fn deallocate(&self, nsid: u32, ranges: &[(u64, u32)]) -> Result<(), HostError> {
        let ns = self.namespace(nsid)?;
        let mut rs = Vec::with_capacity(ranges.len());
        for &(slba, nlb) in ranges {
            self.check(nsid, slba, nlb as usize * ns.block_size as usize)?;
            rs.push(DsmRange {
                cattr: 0,
                nlb,
                slba,
            });
        }
        let mut buf = vec![0u8; rs.len() * 16];
        DsmRange::emit_all(&rs, &mut buf)?;
        let sqe = admin::dsm_deallocate(0, nsid, rs.len())?;
        self.pick().submit(sqe, Some(buf), 0).await.map(|_| ())
    }

    /// [`disconnect`](Self::disconnect) whoever else still holds the controller (an export
    /// a user keeps open): shut down, queues torn down, pending I/O failed, and every request
    /// after it fails at once. Returns once the controller is DEAD.
    pub async fn delete(&self) {
        self.shared.request_delete();
        let mut rx = self.watch_status();
        let _ = rx.wait_for(|s| s.state() == CtrlState::Dead).await;
    }

    /// Orderly disconnect: shut the controller down (CC.SHN), tear the queues down, release
    /// every resource. Pending I/O fails with "controller deleted".
    pub async fn disconnect(mut self) {
        if let Some(t) = self.rescans.take() {
            t.abort();
        }
        self.shared.request_delete();
        if let Some(t) = self.sup.take() {
            let _ = t.await;
        }
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        if let Some(t) = self.rescans.take() {
            t.abort();
        }
        if self.sup.is_some() {
            // The supervisor tears everything down in the background.
            self.shared.request_delete();
        }
    }
}

/// An admin command bounded by `timeout` (a bring-up step, or a rescan).
async fn bounded_admin(
    admin: &QueueHandle,
    timeout: Duration,
    sqe: Sqe,
    data_in: usize,
) -> Result<queue::Response, HostError> {
    let what = match sqe.opcode {
        admin::opcode::admin::IDENTIFY => "Identify",
        _ => "an admin command",
    };
    tokio::time::timeout(timeout, admin.submit(sqe, None, data_in))
        .await
        .map_err(|_| {
            HostError::Timeout(format!(
                "{what} got no answer within the connect timeout ({} ms)",
                timeout.as_millis()
            ))
        })?
}

/// The active namespaces, their sizes and identities, as the controller reports them now.
async fn identify_namespaces(
    admin: &QueueHandle,
    timeout: Duration,
) -> Result<Vec<NsInfo>, HostError> {
    let r = bounded_admin(
        admin,
        timeout,
        admin::identify_active_namespaces(0, 0),
        4096,
    )
    .await?;
    let ids: Vec<u32> = crate::nvme::identify::active_namespace_ids(&r.data).collect();
    let mut out = Vec::with_capacity(ids.len());
    for nsid in ids {
        let r = bounded_admin(admin, timeout, admin::identify_namespace(0, nsid), 4096).await?;
        let ns =
            IdentifyNamespace::parse(&r.data).map_err(|e| HostError::Protocol(e.to_string()))?;
        let bs = ns.block_size().ok_or_else(|| {
            HostError::Protocol(format!("namespace {nsid} has no valid LBA format"))
        })?;
        // A controller without descriptor lists (before NVMe 1.3) answers with an error
        // status: its namespaces are told apart by the Identify Namespace fields alone.
        let descs = match bounded_admin(
            admin,
            timeout,
            admin::identify(0, admin::cns::NS_ID_DESCRIPTORS, nsid, 0),
            4096,
        )
        .await
        {
            Ok(r) => Some(r.data),
            Err(HostError::Nvme(_)) => None,
            Err(e) => return Err(e),
        };
        out.push(NsInfo {
            nsid,
            block_size: bs,
            blocks: ns.nsze,
            ident: NsIdentity::from_identify(&ns, descs.as_deref()),
        });
    }
    Ok(out)
}

/// Rescan the namespaces each time the controller is LIVE again after a reconnect: a
/// namespace added, resized, removed or replaced while the association was down is seen at
/// once, not at the next unrelated event. Runs beside the recovery path, after it, so that
/// path stays free of allocations. Ends when the controller does.
async fn rescan_after_reconnects(
    admin: QueueHandle,
    timeout: Duration,
    table: Arc<NsTable>,
    mut status: watch::Receiver<CtrlStatus>,
    subnqn: String,
) {
    let mut seen = status.borrow().machine.recoveries;
    loop {
        let s = status
            .wait_for(|s| {
                s.state() == CtrlState::Dead
                    || (s.state() == CtrlState::Live && s.machine.recoveries > seen)
            })
            .await
            .map(|s| *s);
        let s = match s {
            Ok(s) if s.state() == CtrlState::Live => s,
            _ => return,
        };
        seen = s.machine.recoveries;
        if let Err(e) = table.rescan(&admin, timeout, &subnqn).await {
            // The association failed again (the next reconnect rescans) or the target did
            // not answer: the list stays as it was until the next event.
            tracing::warn!(
                subnqn,
                error = %e,
                "reading the namespaces after a reconnect failed; kept the previous list"
            );
        }
    }
}

/// Ask a discovery controller which subsystems it offers.
pub async fn discover<D: DeviceContext>(
    dev: D,
    cm: D::Cm,
    mut o: ConnectOptions,
) -> Result<Vec<DiscoveryLogEntry>, HostError> {
    o.subnqn = fabrics::DISCOVERY_NQN.to_string();
    o.keep_alive_tmo = Duration::ZERO;
    let c = Controller::connect(dev, cm, o).await?;
    let a = c.admin.clone();
    let entries = async {
        let head = a
            .submit(admin::get_discovery_log(0, 0, 1024)?, None, 1024)
            .await?;
        let hdr = DiscoveryLogHeader::parse(&head.data)
            .map_err(|e| HostError::Protocol(e.to_string()))?;
        let len = DiscoveryLogHeader::log_len(hdr.numrec.min(63)).unwrap_or(1024);
        let page = a
            .submit(admin::get_discovery_log(0, 0, len)?, None, len as usize)
            .await?;
        let hdr = DiscoveryLogHeader::parse(&page.data)
            .map_err(|e| HostError::Protocol(e.to_string()))?;
        Ok::<_, HostError>(hdr.entries(&page.data).collect())
    }
    .await;
    c.disconnect().await;
    entries
}

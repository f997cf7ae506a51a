//! The host controller's public face: connect options, status, and the block API over the
//! I/O queues. Bring-up is in [`super::bringup`], the recovery path (one entry for every
//! cause, and its executor) in [`super::recovery`], namespaces and Asynchronous Events in
//! [`super::namespaces`].

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

use crate::nvme::admin;
use crate::nvme::fabrics;
use crate::nvme::{DiscoveryLogEntry, DiscoveryLogHeader, DsmRange, IdentifyController, Nqn, Sqe};
use crate::reconnect::{Cause, CtrlState, Event, Policy, Status};
use crate::verbs::{roce_peer, DeviceContext, DeviceSource, Instant, Mtu};

use super::namespaces::{NsInfo, NsTable};
use super::queue::{self, IoBuffer, QueueHandle, QueueStats};
use super::recovery::{Backing, CtrlShared, DevShared};
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
pub(super) fn inline_depth_for(traddr: SocketAddr, in_memory: bool) -> usize {
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
    /// The cause the executor acted on: the first report that took the controller out of
    /// LIVE.
    pub cause: Option<Cause>,
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

impl RecoveryTrace {
    /// The marks of the one path in the order it takes them: failed, torn down, attempt
    /// started, device open, admin CM connection, admin ready, LIVE.
    pub fn steps(&self) -> [Option<Instant>; 7] {
        [
            self.failed,
            self.torn_down,
            self.attempt_start,
            self.device_open,
            self.admin_cm,
            self.admin_ready,
            self.live,
        ]
    }
}

/// A connected NVMe-oF controller that survives its HCA.
pub struct Controller {
    pub cntlid: u16,
    pub opts: ConnectOptions,
    pub ident: IdentifyController,
    pub(super) admin: QueueHandle,
    pub(super) io: Vec<QueueHandle>,
    /// Read at connect, after each reconnect, and when the caller asks (Async Events).
    pub(super) namespaces: Arc<NsTable>,
    /// Rescans the namespaces each time the controller is LIVE again after a reconnect.
    pub(super) rescans: Option<tokio::task::JoinHandle<()>>,
    pub(super) next: AtomicUsize,
    pub(super) max_io: usize,
    pub(super) shared: Arc<CtrlShared>,
    pub(super) backing: Arc<dyn Backing>,
    pub(super) sup: Option<tokio::task::JoinHandle<()>>,
}

impl Controller {
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

    /// The device source and device name the controller runs on, if the source is an `S`.
    pub fn device_source<S: DeviceSource>(&self) -> Option<(S, String)> {
        let d = self.backing.as_any().downcast_ref::<DevShared<S>>()?;
        Some((d.source.clone(), d.name.clone()))
    }

    /// Start recovery now, as on any failure (nvme-cli `reset`).
    pub fn reset(&self) {
        self.report_failure(Cause::UserReset);
    }

    /// Report a failure of the current connection to recovery, through the one entry that
    /// the queues, the connection manager and the device watcher report to: recovery starts
    /// if the controller is LIVE and the connection is still the one it was. For tools and
    /// tests that stand in for a cause.
    pub fn report_failure(&self, cause: Cause) {
        let inbox = &self.shared.inbox;
        inbox.report_in(inbox.epoch(), Event::Failed(cause));
    }

    pub fn state(&self) -> CtrlState {
        self.shared.status.borrow().machine.state
    }

    /// True once a keep-alive went unanswered (the controller then recovers).
    pub fn keep_alive_failed(&self) -> bool {
        self.shared.status.borrow().machine.cause == Some(Cause::KeepAliveLost)
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
        self.shared.inbox.request_delete();
        let mut rx = self.watch_status();
        let _ = rx.wait_for(|s| s.state() == CtrlState::Dead).await;
    }

    /// Orderly disconnect: shut the controller down (CC.SHN), tear the queues down, release
    /// every resource. Pending I/O fails with "controller deleted".
    pub async fn disconnect(mut self) {
        if let Some(t) = self.rescans.take() {
            t.abort();
        }
        self.shared.inbox.request_delete();
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
            self.shared.inbox.request_delete();
        }
    }
}

/// An admin command bounded by `timeout` (a bring-up step, or a rescan).
pub(super) async fn bounded_admin(
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

//! The host controller's public face: connect options, status, and the block API over the
//! I/O queues. Bring-up is in [`super::bringup`], the recovery path (one entry for every
//! cause, and its executor) in [`super::recovery`], namespaces and Asynchronous Events in
//! [`super::namespaces`].

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

use crate::nvme::admin;
use crate::nvme::fabrics;
use crate::nvme::{DiscoveryLogEntry, DiscoveryLogHeader, DsmRange, IdentifyController};
use crate::reconnect::{Cause, CtrlState, Event};
use crate::verbs::{DeviceContext, DeviceSource, Instant};

use super::namespaces::{AsyncEvent, NsInfo, NsTable};
use super::options::ConnectOptions;
use super::queue::{IoBuffer, QueueHandle, QueueStats};
use super::saferetry::{self, CcrOutcome, CtrlInstance, Losses, SafeRetryStatus, SafeShared};
use super::state::{Backing, CtrlShared, CtrlStatus, DevShared};
use super::HostError;

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
    /// Sends the Cross-Controller Resets safe retry asks for.
    pub(super) ccr: Option<tokio::task::JoinHandle<()>>,
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

    /// The controller instance of the current association (CNTLID, CIU, CIRN from its
    /// Identify data); `None` while no association is live. A multipath host names it in a
    /// [`Controller::cross_reset`] sent through another controller when this one's
    /// connection dies.
    pub fn instance(&self) -> Option<CtrlInstance> {
        self.shared.safe.current()
    }

    /// Send a Cross-Controller Reset (TP8028) through this live controller for `impacted`,
    /// a dead controller of the same subsystem, and wait for its end: the completion's IRS
    /// bit, else the CCR log (LID 0x1E) until its entry is complete, at most KATO + CQT
    /// (this controller's; `--cqt-default` when it reports none). `Succeeded`: nothing of
    /// `impacted` can execute any more. `Failed` (refused, limit reached, still running at
    /// the bound): the time rule decides. An error is the command's own: Invalid Opcode means
    /// the target does not offer CCR.
    pub async fn cross_reset(&self, impacted: CtrlInstance) -> Result<CcrOutcome, HostError> {
        let cqt = match self.ident.cqt {
            0 => self.opts.safe_retry.default_cqt,
            ms => Duration::from_millis(u64::from(ms)),
        };
        let deadline = self.now() + self.opts.keep_alive_tmo + cqt;
        saferetry::cross_reset_until(&self.admin, self.shared.clock, impacted, deadline).await
    }

    /// What a command of this controller that failed by now may still have running in the
    /// target: its dead associations so far, and its live one (whose loss may not be
    /// recorded yet).
    pub fn losses(&self) -> Losses {
        self.shared.safe.losses()
    }

    /// Resolves once no command of an association of this controller that died before the
    /// call can still execute in the target: each one's CCR succeeded or its time rule
    /// (`k x KATO + CQT` after the last contact) passed; at once with `--safe-retry off` or
    /// when none died.
    pub async fn quiesced(&self) {
        self.quiesced_upto(self.losses()).await
    }

    /// [`Controller::quiesced`] for the associations of `upto`, a snapshot taken when a
    /// command failed: later losses do not hold it (it was not in flight on them).
    pub async fn quiesced_upto(&self, upto: Losses) {
        self.shared.safe.quiesced(self.shared.clock, upto).await
    }

    /// [`Controller::quiesced_upto`], sooner where a CCR can tell: for each dead association
    /// of `upto` that no CCR was asked for yet (`ccr` mode, a target that offers it), as it
    /// dies, a Cross-Controller Reset through `via`, a live controller of the same subsystem
    /// (a multipath host's other path, or this controller once it is live again).
    pub async fn quiesced_via(&self, via: &Controller, upto: Losses) {
        let safe = &self.shared.safe;
        let ccrs = async {
            loop {
                let changed = safe.changed();
                tokio::pin!(changed);
                changed.as_mut().enable();
                for impacted in safe.claim_for_ccr(self.now(), upto).into_iter().flatten() {
                    // Dropped half way (the caller stopped waiting on `via`), the claim is
                    // let go, so the CCR can be asked through another controller.
                    let claim = Claim {
                        safe,
                        impacted,
                        open: true,
                    };
                    let r = via.cross_reset(impacted).await;
                    claim.settle(r);
                    self.shared.inbox.wake.notify_one();
                }
                changed.await;
            }
        };
        tokio::select! {
            _ = self.quiesced_upto(upto) => {}
            _ = ccrs => {}
        }
    }

    /// The safe-retry mode and each hold in force (for `list`).
    pub fn safe_retry(&self) -> SafeRetryStatus {
        self.shared.safe.status(self.now())
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

    /// Tell recovery whether another path of the subsystem can carry this controller's I/O:
    /// while it can, I/O held by a lost connection is given back at once (failing with
    /// [`FailReason::Failover`](crate::reconnect::FailReason::Failover)) for the multipath
    /// layer to send elsewhere; admin commands wait for the reconnect as always.
    pub fn set_other_paths(&self, on: bool) {
        self.shared.inbox.report(Event::OtherPaths(on));
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
        if let Some(t) = self.ccr.take() {
            t.abort();
        }
        self.shared.inbox.request_delete();
        if let Some(t) = self.sup.take() {
            let _ = t.await;
        }
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
        self.namespaces.watch()
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
}

impl Drop for Controller {
    fn drop(&mut self) {
        if let Some(t) = self.rescans.take() {
            t.abort();
        }
        if let Some(t) = self.ccr.take() {
            t.abort();
        }
        if self.sup.is_some() {
            // The supervisor tears everything down in the background.
            self.shared.inbox.request_delete();
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

/// A CCR claimed for one of a controller's dead associations, sent through another
/// controller: settled with its outcome, or given back if dropped before its end.
struct Claim<'a> {
    safe: &'a SafeShared,
    impacted: CtrlInstance,
    open: bool,
}

impl Claim<'_> {
    fn settle(mut self, r: Result<CcrOutcome, HostError>) {
        self.open = false;
        self.safe.on_peer_ccr(self.impacted, r);
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        if self.open {
            self.safe.unclaim(self.impacted);
        }
    }
}

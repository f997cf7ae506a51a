//! One host NVMe-oF RDMA queue (admin or I/O): an RC QP with a command-capsule ring, a
//! response ring and one data buffer per command slot.
//!
//! The host memory of a queue (rings, data buffers, slot table) is allocated once, when the
//! controller is first connected, and lives as long as the controller. The verbs objects
//! over it (CQ, QP, MRs) belong to one device context: the recovery path drops them
//! whatever state they are in ([`QueueCore::teardown`]), registers the *same* buffers again
//! under a new PD ([`QueueCore::attach`]) and resubmits what was in flight
//! ([`QueueCore::resume`]). An in-flight command's retry slot is its own slot: its SQE and
//! its data stay where they are, so requeueing allocates nothing.
//!
//! Command IDs index the slot table (low bits) and carry a generation (high bits), so a
//! late or duplicate completion from a confused target can never complete the request that
//! reused the slot. A request completes only when both its SEND completion and its response
//! capsule are in (Linux `nvme_end_request`). Every data buffer has its own MR, keyed afresh
//! for each command over the transfer's length with only the access its direction needs: a
//! target can only read what a command sends and write what it reads, in the buffer of the
//! command it was handed.
//!
//! The last slot is reserved for the controller's own commands (Fabrics Connect, Property
//! Get/Set, keep-alive), like Linux's reserved tags; it can be used while user I/O is held.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, Notify};

use crate::nvme::{Cqe, SglDescriptor, Sqe};
use crate::reconnect::{Cause, FailReason};
use crate::verbs::{
    Access, CqId, DeviceContext, HostBuffer, Instant, Lifecycle, MemKey, MrInfo, Mtu, PdId,
    PeerInfo, Psn, QpCaps, Qpn, RcAttr, RecvWr, SendOp, SendWr, Sge, Sgl, VerbsError, WcOpcode,
    WcStatus, WorkCompletion,
};

use super::HostError;
use crate::timer::EarliestTimer;

pub const SQE_LEN: usize = 64;
pub const CQE_LEN: usize = 16;
/// Slot index bits of a command ID; queue sizes stop at 1024.
const SLOT_BITS: u16 = 10;
pub const MAX_QUEUE_SIZE: usize = 1 << SLOT_BITS;

const WR_SEND: u64 = 1;
const WR_RECV: u64 = 2;

/// What a caller asks of a queue.
pub struct Request {
    pub sqe: Sqe,
    /// Host → target data.
    pub data_out: Option<Vec<u8>>,
    /// Target → host data length.
    pub data_in: usize,
    /// The data is in a chunk of a registered buffer instead ([`IoBuffer`]).
    pub region: Option<RegionIo>,
    pub reply: oneshot::Sender<Result<Response, HostError>>,
    /// Sent by code the allocation audit counts apart (see [`Slot`]).
    pub audit_apart: bool,
}

/// A command's data in chunk `chunk` of registered buffer `id` ([`IoBuffer`]): `len` bytes
/// sent from it (`write`) or read into it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionIo {
    id: u32,
    chunk: u32,
    len: usize,
    write: bool,
}

/// Alignment of the first chunk of a registered buffer: fio aligns its I/O buffers to the
/// page, and a page-aligned start keeps its buffers on chunk boundaries.
const REGION_ALIGN: usize = 4096;

/// Chunks a registered buffer may have (one MR each).
pub const MAX_REGION_CHUNKS: usize = 4096;

/// Caller memory registered with a queue ([`IoBuffer`]): `busy.len()` chunks of `chunk`
/// bytes from `pad` into `mem`, each its own MR with a key per command, like the slots' own
/// data buffers. The memory is ours, so recovery registers it again on the new device
/// context ([`QueueCore::attach`]) without allocating.
struct Region<M> {
    mem: Arc<M>,
    pad: usize,
    chunk: usize,
    /// The whole memory for local access only: in-capsule writes are gathered from it.
    local: MrInfo,
    mrs: Box<[MrInfo]>,
    /// How many of `mrs` are registered on the current verbs.
    nreg: usize,
    /// Chunks a command is using.
    busy: Box<[bool]>,
    /// Its [`IoBuffer`] is gone but commands were still out: dropped when the last ends.
    orphan: bool,
}

#[derive(Debug)]
pub struct Response {
    pub cqe: Cqe,
    pub data: Vec<u8>,
}

/// Counters of one queue.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QueueStats {
    pub submitted: u64,
    pub completed: u64,
    /// Commands held across a recovery and sent again.
    pub requeued: u64,
    /// Commands sent again after a retryable NVMe error status.
    pub retried: u64,
    /// Commands failed by fast_io_fail_tmo, ctrl_loss_tmo or deletion.
    pub failed: u64,
    pub timeouts: u64,
    /// Held commands (counted in `requeued`) whose answer from the failed connection came
    /// in before they were sent again: completed with that answer, not run twice.
    pub late_answers: u64,
    pub unknown_cid: u64,
    pub duplicate_completion: u64,
    pub bad_response_len: u64,
    /// Capsules sent with their data inside (shallow writes, an I/O queue's Fabrics
    /// Connect); the other data went as keyed SGLs.
    pub in_capsule: u64,
    /// Commands whose data buffer's key the target invalidated with its response (SEND
    /// with Invalidate), and those whose key the host invalidated itself at completion.
    pub remote_invalidations: u64,
    pub local_invalidations: u64,
    /// Responses that invalidated a key other than their command's: the connection is
    /// failed and recovered, as Linux does.
    pub bogus_invalidations: u64,
    /// Payload copies the host made on the data path (a write's data into its slot, a
    /// read's data out of it, a read's data into the caller's buffer), and their bytes.
    /// Controller commands on the reserved slot (Fabrics Connect, properties) are not I/O
    /// and are not counted.
    pub copies: u64,
    pub copied_bytes: u64,
}

impl QueueStats {
    fn count_copy(&mut self, bytes: usize) {
        self.copies += 1;
        self.copied_bytes += bytes as u64;
    }
}

/// Sizes of one queue.
#[derive(Debug, Clone, Copy)]
pub struct QueueSpec {
    pub qid: u16,
    /// Entries (hsqsize + 1), including the reserved slot.
    pub size: usize,
    /// Bytes of in-capsule data allowed (0 on the admin queue).
    pub inline: usize,
    /// Writes that fit `inline` go in the capsule while at most this many commands are
    /// in flight on the queue; deeper, as keyed SGLs ([`ConnectOptions::inline_depth`]).
    ///
    /// [`ConnectOptions::inline_depth`]: super::ConnectOptions::inline_depth
    pub inline_depth: usize,
    /// Largest data transfer of one command.
    pub max_io: usize,
    pub mtu: Mtu,
}

/// Where recovery is told that something broke: the first cause wins until taken.
///
/// Every cause is stamped with the connection epoch it was seen under. Recovery starts a new
/// epoch when it drops the HCA resources, so a cause raised by another queue of the old
/// connection (the same reset seen by several queues at once, on other threads) is dropped
/// instead of breaking the new connection a second time.
#[derive(Default)]
pub struct Alarm {
    /// `epoch << 8 | cause code`; code 0 is "nothing raised".
    pending: AtomicU64,
    epoch: AtomicU32,
    pub notify: Notify,
}

impl Alarm {
    /// The current connection epoch; a queue stamps its causes with the epoch it attached in.
    pub fn epoch(&self) -> u32 {
        self.epoch.load(Ordering::SeqCst)
    }

    /// Start a new epoch: whatever the old connection still raises is stale.
    pub fn new_epoch(&self) -> u32 {
        self.epoch.fetch_add(1, Ordering::SeqCst).wrapping_add(1)
    }

    /// Raise `c` for the current epoch (the user's reset, the supervisor's own findings).
    pub fn raise(&self, c: Cause) {
        self.raise_in(self.epoch(), c);
    }

    /// Raise `c`, seen on the connection of `epoch`. A cause from an older connection is
    /// dropped here, or at [`take`](Self::take) if the epoch moved on in between.
    pub fn raise_in(&self, epoch: u32, c: Cause) {
        let current = self.epoch();
        if epoch != current {
            return;
        }
        let code = Cause::ALL.iter().position(|x| *x == c).unwrap_or(0) as u64 + 1;
        let stamped = (epoch as u64) << 8 | code;
        let _ = self
            .pending
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |old| {
                let (old_epoch, old_code) = ((old >> 8) as u32, old & 0xFF);
                // The first cause of an epoch wins; a stale pending one is replaced.
                (old_code == 0 || old_epoch != current).then_some(stamped)
            });
        self.notify.notify_one();
    }

    /// The pending cause of the current epoch, if any; stale ones are discarded.
    pub fn take(&self) -> Option<Cause> {
        let v = self.pending.swap(0, Ordering::SeqCst);
        let (epoch, code) = ((v >> 8) as u32, v & 0xFF);
        if code == 0 || epoch != self.epoch() {
            return None;
        }
        Cause::ALL.get(code as usize - 1).copied()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotState {
    Free,
    /// Waiting for the controller to be LIVE (new while down, or requeued by recovery).
    Held,
    Posted,
}

struct Slot {
    state: SlotState,
    gen: u16,
    send_done: bool,
    cqe: Option<Cqe>,
    /// The command as the caller gave it; CID and data pointer are filled at each post.
    sqe: Sqe,
    data_out: usize,
    data_in: usize,
    retries: u8,
    posted_at: Instant,
    /// Held by a failure after it was posted: the old connection may still deliver its
    /// answer (until its QP is destroyed), and that answer completes it.
    held_out: bool,
    /// The slot's data region answers to a key the target was given for this command, and
    /// nobody has invalidated it yet.
    key_live: bool,
    /// The command's data is in chunk `.1` of registered buffer `.0`, not in the slot.
    region: Option<(u32, u32)>,
    /// Submitted by code the allocation audit counts apart (the namespace rescan after a
    /// reconnect): the copy of its answer is counted with it.
    audit_apart: bool,
    reply: Option<oneshot::Sender<Result<Response, HostError>>>,
}

/// An Async Event Request waits for the target to have something to say, however long:
/// no I/O timeout applies to it.
fn waits_for_an_event(qid: u16, sqe: &Sqe) -> bool {
    qid == 0 && sqe.opcode == crate::nvme::admin::opcode::admin::ASYNC_EVENT_REQUEST
}

/// The verbs objects of one device context over the queue's buffers.
struct Verbs<D> {
    dev: D,
    /// The PD everything is registered under (registered buffers added while connected).
    pd: PdId,
    qpn: Qpn,
    cq: CqId,
    cmd_mr: MrInfo,
    rsp_mr: MrInfo,
    /// The whole data area for local access only: in-capsule data is gathered under this
    /// key, so that the per-slot regions the target may reach need no valid key then.
    data_local: MrInfo,
    /// How many of `QueueCore::data_mrs` are registered.
    data_mrs: usize,
    /// Each keyed command gets its own key, invalidated at completion
    /// ([`DeviceContext::per_use_keys`]).
    per_use_keys: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// No usable connection: new I/O is held.
    Down,
    /// Connected; only the reserved slot is used (Fabrics Connect, bring-up commands).
    Attached,
    Live,
    /// Deleted: everything fails with the reason.
    Closed(FailReason),
}

/// The reserved slot's last completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ControlDone {
    Completed(Cqe),
    /// The connection broke under it.
    Lost,
}

/// Everything of a queue except its task.
pub struct QueueCore<D: DeviceContext> {
    pub spec: QueueSpec,
    cmd: D::Mem,
    rsp: D::Mem,
    data: D::Mem,
    data_mrs: Box<[MrInfo]>,
    /// Registered buffers by id ([`IoBuffer`]); `None` is a free id.
    regions: Vec<Option<Region<D::Mem>>>,
    slots: Box<[Slot]>,
    free: Vec<usize>,
    verbs: Option<Verbs<D>>,
    phase: Phase,
    /// New and held I/O fails at once with this (fast_io_fail_tmo) until LIVE again.
    failfast: Option<FailReason>,
    control: Option<ControlDone>,
    /// `control` was set since the task last told the controller.
    control_fresh: bool,
    /// The device behind `verbs` died and its CQ is drained: stop polling it.
    cq_gone: bool,
    pub stats: QueueStats,
    /// Work requests gathered during one turn and posted under one device lock.
    sends: Vec<SendWr>,
    recvs: Vec<RecvWr>,
    alarm: Arc<Alarm>,
    /// The alarm epoch this queue attached in; its causes are stamped with it.
    epoch: u32,
    io_timeout: Duration,
    max_retries: u8,
    /// The task holds a request that found no free slot: direct submissions wait behind it.
    backlog: bool,
    /// Completions taken from the CQ at teardown ([`QueueCore::drain_answers`]), sized once.
    drain: Vec<WorkCompletion>,
    /// Buffers of read data that callers gave back ([`QueueHandle::recycle`]), reused for
    /// the next reads so a large read does not allocate (and fault in) fresh memory.
    spare: Vec<Vec<u8>>,
}

/// Completions polled per call when draining a CQ at teardown.
const DRAIN_BATCH: usize = 64;

/// Read buffers a queue keeps for reuse.
const SPARE_BUFFERS: usize = 8;

impl<D: DeviceContext> QueueCore<D> {
    /// Allocate the queue's host memory: rings, data buffers, slots. Nothing is registered.
    pub fn new(
        spec: QueueSpec,
        alarm: Arc<Alarm>,
        io_timeout: Duration,
        max_retries: u8,
    ) -> Result<QueueCore<D>, HostError> {
        if spec.size < 2 || spec.size > MAX_QUEUE_SIZE {
            return Err(HostError::Invalid(format!(
                "queue size {} not in 2..={MAX_QUEUE_SIZE}",
                spec.size
            )));
        }
        let capsule = SQE_LEN + spec.inline;
        let n = spec.size;
        let slots: Box<[Slot]> = (0..n)
            .map(|_| Slot {
                state: SlotState::Free,
                gen: 0,
                send_done: false,
                cqe: None,
                sqe: Sqe::default(),
                data_out: 0,
                data_in: 0,
                retries: 0,
                posted_at: Instant(0),
                held_out: false,
                key_live: false,
                region: None,
                audit_apart: false,
                reply: None,
            })
            .collect();
        Ok(QueueCore {
            spec,
            cmd: D::Mem::alloc(n * capsule),
            rsp: D::Mem::alloc(n * CQE_LEN),
            data: D::Mem::alloc(n * spec.max_io),
            data_mrs: vec![MrInfo::default(); n].into_boxed_slice(),
            regions: Vec::new(),
            slots,
            // The last slot is the reserved one; user slots pop from the end of `free`.
            free: (0..n - 1).rev().collect(),
            verbs: None,
            phase: Phase::Down,
            failfast: None,
            control: None,
            control_fresh: false,
            cq_gone: false,
            stats: QueueStats::default(),
            sends: Vec::with_capacity(n),
            recvs: Vec::with_capacity(n),
            alarm,
            epoch: 0,
            io_timeout,
            max_retries,
            backlog: false,
            drain: Vec::with_capacity(DRAIN_BATCH),
            spare: Vec::with_capacity(SPARE_BUFFERS),
        })
    }

    fn control_slot(&self) -> usize {
        self.spec.size - 1
    }

    fn capsule(&self) -> usize {
        SQE_LEN + self.spec.inline
    }

    pub fn is_live(&self) -> bool {
        self.phase == Phase::Live
    }

    /// Requests the queue holds or has out.
    pub fn outstanding(&self) -> usize {
        self.spec.size - 1 - self.free.len()
    }

    /// Can the task take another request from its channel?
    fn accepting(&self) -> bool {
        !self.free.is_empty() || matches!(self.phase, Phase::Closed(_)) || self.failfast.is_some()
    }

    /// Register the queue's buffers on `dev` under `pd` and create a CQ and a QP in INIT.
    /// Returns the QP number for the CM request. On error nothing is left behind.
    pub fn attach(&mut self, dev: &D, pd: PdId) -> Result<Qpn, HostError> {
        self.teardown();
        self.epoch = self.alarm.epoch();
        match self.make_verbs(dev, pd) {
            Ok(v) => {
                let qpn = v.qpn;
                self.verbs = Some(v);
                self.cq_gone = false;
                Ok(qpn)
            }
            Err((partial, e)) => {
                self.verbs = partial;
                self.teardown();
                Err(e)
            }
        }
    }

    /// The CQ, the QP and the MRs of [`QueueCore::attach`]; on error, what was made so far.
    #[allow(clippy::result_large_err)] // the error carries the partial objects back out
    fn make_verbs(&mut self, dev: &D, pd: PdId) -> Result<Verbs<D>, (Option<Verbs<D>>, HostError)> {
        let size = self.spec.size;
        let max_io = self.spec.max_io;
        let cq = dev.create_cq(size * 4 + 1).map_err(|e| (None, e.into()))?;
        let caps = QpCaps {
            max_send_wr: size as u32 * 2 + 1,
            max_recv_wr: size as u32 + 1,
        };
        let access = Access::REMOTE_READ | Access::REMOTE_WRITE | Access::LOCAL_WRITE;
        let qpn = match dev.create_rc_qp(pd, cq, caps, access) {
            Ok(q) => q,
            Err(e) => {
                dev.destroy_cq(cq);
                return Err((None, e.into()));
            }
        };
        let mut v = Verbs {
            dev: dev.clone(),
            pd,
            qpn,
            cq,
            cmd_mr: MrInfo::default(),
            rsp_mr: MrInfo::default(),
            data_local: MrInfo::default(),
            data_mrs: 0,
            per_use_keys: dev.per_use_keys(),
        };
        let bad = |v: Verbs<D>, e: VerbsError| (Some(v), HostError::from(e));
        match dev.reg_mr(pd, &self.cmd, 0, self.cmd.len(), Access::empty()) {
            Ok(m) => v.cmd_mr = m,
            Err(e) => return Err(bad(v, e)),
        }
        match dev.reg_mr(pd, &self.rsp, 0, self.rsp.len(), Access::LOCAL_WRITE) {
            Ok(m) => v.rsp_mr = m,
            Err(e) => return Err(bad(v, e)),
        }
        match dev.reg_mr(pd, &self.data, 0, self.data.len(), Access::empty()) {
            Ok(m) => v.data_local = m,
            Err(e) => return Err(bad(v, e)),
        }
        let rw = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE;
        for i in 0..size {
            match dev.reg_mr(pd, &self.data, i * max_io, max_io, rw) {
                Ok(m) => {
                    if v.per_use_keys {
                        // Reachable by no one until a command hands out a fresh key for it.
                        dev.invalidate_mr(&m);
                    }
                    self.data_mrs[i] = m;
                    v.data_mrs = i + 1;
                }
                Err(e) => return Err(bad(v, e)),
            }
        }
        for r in self.regions.iter_mut().flatten() {
            if let Err(e) = register_region(&v, r) {
                return Err(bad(v, e));
            }
        }
        Ok(v)
    }

    /// The peer answered (CM REP): QP to RTS and post the response ring. Only the reserved
    /// slot may be used until [`QueueCore::resume`].
    pub fn connected(&mut self, peer: PeerInfo, psn: Psn) -> Result<(), HostError> {
        let Some(v) = &self.verbs else {
            return Err(HostError::Step("queue has no QP"));
        };
        let attr = RcAttr {
            mtu: self.spec.mtu,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_unacked: 256,
        };
        v.dev.rc_to_rts(v.qpn, peer, psn, &attr)?;
        // `teardown` in `attach` emptied the turn's lists, and nothing is posted before RTS.
        self.recvs
            .extend((0..self.spec.size).map(|r| recv_wr(&v.rsp_mr, r)));
        v.dev.post(v.qpn, &mut self.recvs, &mut Vec::new())?;
        self.phase = Phase::Attached;
        self.control = None;
        Ok(())
    }

    /// Drop every verbs object of the queue, whatever state it is in (on a zombie device
    /// every release succeeds). Posted commands without a response are held for
    /// resubmission; those whose response arrived complete with it.
    pub fn teardown(&mut self) {
        self.drain_answers();
        self.go_down(false);
        self.sends.clear();
        self.recvs.clear();
        for s in self.slots.iter_mut() {
            // The QP goes now: nothing more can be answered on it, and the regions go too.
            s.held_out = false;
            s.key_live = false;
        }
        if let Some(v) = self.verbs.take() {
            let d = &v.dev;
            d.destroy_qp(v.qpn);
            d.destroy_cq(v.cq);
            if v.cmd_mr.lkey.0 != 0 {
                d.dereg_mr(&v.cmd_mr);
            }
            if v.rsp_mr.lkey.0 != 0 {
                d.dereg_mr(&v.rsp_mr);
            }
            if v.data_local.lkey.0 != 0 {
                d.dereg_mr(&v.data_local);
            }
            for m in &self.data_mrs[..v.data_mrs] {
                d.dereg_mr(m);
            }
            for r in self.regions.iter_mut().flatten() {
                deregister_region(d, r);
            }
        }
    }

    /// Take the successful completions still in the CQ before the QP goes: an answer that
    /// arrived is a command that ran, and it completes instead of running again after
    /// recovery. Failed completions say nothing new here (the connection is going anyway).
    fn drain_answers(&mut self) {
        let Some((dev, cq)) = self.cq() else { return };
        let mut wcs = std::mem::take(&mut self.drain);
        loop {
            wcs.clear();
            let n = dev.poll_cq(cq, DRAIN_BATCH, &mut wcs);
            for wc in wcs.iter().filter(|wc| wc.status == WcStatus::Success) {
                self.on_wc(wc);
            }
            if n < DRAIN_BATCH {
                break;
            }
        }
        wcs.clear();
        self.drain = wcs;
    }

    /// Stop using the connection: posted commands are held (or completed, if their
    /// response is in), the reserved slot's command is lost. With `charge` (the connection
    /// failed while they were out, not the device) each posted command uses up a retry, so a
    /// command that breaks its connection every time (a target that answers it with a
    /// protection error) fails after `max_retries` instead of looping, as in Linux.
    fn go_down(&mut self, charge: bool) {
        if matches!(self.phase, Phase::Down | Phase::Closed(_)) {
            return;
        }
        self.phase = Phase::Down;
        let ctl = self.control_slot();
        for i in 0..self.slots.len() {
            if self.slots[i].state != SlotState::Posted {
                continue;
            }
            if i == ctl {
                self.slots[i].state = SlotState::Free;
                self.control = Some(ControlDone::Lost);
                self.control_fresh = true;
                continue;
            }
            let s = &mut self.slots[i];
            if s.cqe.is_some() {
                // The target answered: the command ran. Complete it with its answer.
                s.send_done = true;
                self.try_finish(i);
            } else if charge && s.retries >= self.max_retries {
                self.stats.failed += 1;
                self.finish(
                    i,
                    Err(HostError::Transport(
                        "the connection failed under this command on every retry".into(),
                    )),
                );
            } else {
                if charge {
                    s.retries += 1;
                }
                s.state = SlotState::Held;
                s.send_done = false;
                s.held_out = true;
                self.stats.requeued += 1;
            }
        }
    }

    /// Post a controller command on the reserved slot. Its completion shows up in
    /// [`QueueCore::take_control`].
    pub fn post_control(
        &mut self,
        now: Instant,
        sqe: Sqe,
        data_out: &[u8],
        data_in: usize,
    ) -> Result<(), HostError> {
        if self.verbs.is_none() || matches!(self.phase, Phase::Down | Phase::Closed(_)) {
            return Err(HostError::Step("queue is not connected"));
        }
        let i = self.control_slot();
        if self.slots[i].state != SlotState::Free {
            return Err(HostError::Invalid(
                "a controller command is already out".into(),
            ));
        }
        if data_out.len() > self.spec.max_io || data_in > self.spec.max_io {
            return Err(HostError::Step("controller command too large"));
        }
        self.control = None;
        let off = i * self.spec.max_io;
        if !data_out.is_empty() {
            self.data.write(off, data_out);
        } else if data_in > 0 {
            self.data.with_range(off, data_in, |b| b.fill(0));
        }
        let s = &mut self.slots[i];
        s.sqe = sqe;
        s.data_out = data_out.len();
        s.data_in = data_in;
        s.retries = 0;
        self.post(i, now);
        self.flush_posts();
        Ok(())
    }

    /// The reserved slot's completion, once.
    pub fn take_control(&mut self) -> Option<ControlDone> {
        self.control.take()
    }

    /// Copy the reserved slot's data (what the last controller command read).
    pub fn control_data(&self, out: &mut [u8]) {
        let n = out.len().min(self.spec.max_io);
        self.data
            .read(self.control_slot() * self.spec.max_io, &mut out[..n]);
    }

    /// The controller is LIVE again: send every held command.
    pub fn resume(&mut self, now: Instant) {
        if self.verbs.is_none() || matches!(self.phase, Phase::Closed(_)) {
            return;
        }
        self.phase = Phase::Live;
        self.failfast = None;
        for i in 0..self.slots.len() {
            if self.slots[i].state == SlotState::Held {
                self.post(i, now);
            }
        }
        self.flush_posts();
    }

    /// fast_io_fail_tmo or deletion: fail what is held; with `close`, everything from now
    /// on too. With `FastIoFail` new I/O fails at once until the controller is LIVE again.
    pub fn fail_held(&mut self, why: FailReason, close: bool) {
        if close {
            self.teardown();
            self.phase = Phase::Closed(why);
        } else if self.phase != Phase::Live {
            self.failfast = Some(why);
        }
        for i in 0..self.slots.len() {
            if self.slots[i].state == SlotState::Held {
                self.stats.failed += 1;
                self.finish(i, Err(HostError::Path(why)));
            }
        }
    }

    /// Take a caller's request: it is sent now if LIVE, held otherwise.
    pub fn submit(&mut self, now: Instant, req: Request) {
        self.submit_parts(
            now,
            req.sqe,
            req.data_out.as_deref(),
            req.data_in,
            req.region,
            req.reply,
            req.audit_apart,
        );
    }

    /// [`QueueCore::submit`] with the outgoing data borrowed: it is copied into the slot.
    /// With `region` the data stays in the caller's registered buffer (`data_out` and
    /// `data_in` are then unused): no copy.
    // The request's parts, one argument each, so the fast path borrows its data.
    #[allow(clippy::too_many_arguments)]
    fn submit_parts(
        &mut self,
        now: Instant,
        sqe: Sqe,
        data_out: Option<&[u8]>,
        data_in: usize,
        region: Option<RegionIo>,
        reply: oneshot::Sender<Result<Response, HostError>>,
        audit_apart: bool,
    ) {
        if let Phase::Closed(why) = self.phase {
            let _ = reply.send(Err(HostError::Path(why)));
            return;
        }
        if let (Some(why), false) = (self.failfast, self.is_live()) {
            let _ = reply.send(Err(HostError::Path(why)));
            return;
        }
        let max_io = self.spec.max_io;
        let (out_len, data_in) = match region {
            Some(r) => {
                if let Err(e) = self.check_region(r) {
                    let _ = reply.send(Err(e));
                    return;
                }
                if r.write {
                    (r.len, 0)
                } else {
                    (0, r.len)
                }
            }
            None => (data_out.map_or(0, |v| v.len()), data_in),
        };
        if out_len > max_io || data_in > max_io {
            let _ = reply.send(Err(HostError::Invalid(format!(
                "transfer larger than {max_io} bytes"
            ))));
            return;
        }
        let Some(i) = self.free.pop() else {
            let _ = reply.send(Err(HostError::Invalid("queue full".into())));
            return;
        };
        let off = i * max_io;
        if let Some(r) = region {
            // The data is the caller's, in place: nothing to copy, nothing to clear (a read
            // lands where the caller's own bytes were, never another request's).
            if let Some(g) = self.regions.get_mut(r.id as usize).and_then(Option::as_mut) {
                g.busy[r.chunk as usize] = true;
            }
            self.slots[i].region = Some((r.id, r.chunk));
        } else if let Some(data) = data_out {
            self.data.write(off, data);
            self.stats.count_copy(data.len());
        } else if data_in > 0 {
            // A target that reports success without writing the data must not hand this
            // caller the bytes of the slot's previous request.
            self.data.with_range(off, data_in, |b| b.fill(0));
        }
        let s = &mut self.slots[i];
        s.sqe = sqe;
        s.data_out = out_len;
        s.data_in = data_in;
        s.retries = 0;
        s.audit_apart = audit_apart;
        s.reply = Some(reply);
        s.state = SlotState::Held;
        self.stats.submitted += 1;
        if self.is_live() {
            self.post(i, now);
        }
    }

    /// Build slot `i`'s capsule with a fresh command ID and the current keys, and queue its
    /// SEND for [`QueueCore::flush_posts`].
    fn post(&mut self, i: usize, now: Instant) {
        let Some(v) = &self.verbs else { return };
        let spec = self.spec;
        let capsule = self.capsule();
        // User slots in flight, this one included (the last slot is the reserved one).
        let in_flight = self.slots.len() - 1 - self.free.len();
        let (out, inn) = (self.slots[i].data_out, self.slots[i].data_in);
        let in_capsule =
            out > 0 && spec.qid > 0 && out <= spec.inline && in_flight <= spec.inline_depth;
        let keyed = (out > 0 && !in_capsule) || (out == 0 && inn > 0);
        let invalidate = keyed && v.per_use_keys;
        if invalidate {
            // A key of its own for this command, the previous one refused from now on: it
            // reaches the transfer's bytes only, and only the way the data goes (a target
            // reads what the host sends and writes what it reads).
            let mut access = Access::empty();
            if out > 0 {
                access |= Access::REMOTE_READ;
            }
            if inn > 0 {
                access |= Access::REMOTE_WRITE | Access::LOCAL_WRITE;
            }
            let mr = slot_mr(
                &mut self.data_mrs,
                &mut self.regions,
                i,
                self.slots[i].region,
            );
            if v.dev.rekey_mr(mr, out.max(inn), access).is_err() {
                let s = &mut self.slots[i];
                s.state = SlotState::Held;
                s.cqe = None;
                s.send_done = false;
                let c = self.device_cause().unwrap_or(Cause::Transport);
                self.fail_connection(c);
                return;
            }
            self.slots[i].key_live = true;
        }
        let mr = self.slot_mr(i);
        let local = match self.slots[i].region {
            Some((id, _)) => self.region(id).map(|r| r.local.lkey),
            None => None,
        };
        let Some(v) = &self.verbs else { return };
        let local = local.unwrap_or(v.data_local.lkey);
        let s = &mut self.slots[i];
        s.gen = (s.gen + 1) & ((1 << (16 - SLOT_BITS)) - 1);
        let mut sqe = s.sqe;
        sqe.cid = (i as u16) | (s.gen << SLOT_BITS);
        let mut sges = [Sge::default(); 2];
        sges[0] = Sge {
            addr: v.cmd_mr.addr + (i * capsule) as u64,
            len: SQE_LEN as u32,
            lkey: v.cmd_mr.lkey,
        };
        let mut nsge = 1;
        let sgl = if in_capsule {
            self.stats.in_capsule += 1;
            sges[1] = Sge {
                addr: mr.addr,
                len: s.data_out as u32,
                lkey: local,
            };
            nsge = 2;
            SglDescriptor::InCapsule {
                offset: 0,
                len: s.data_out as u32,
            }
        } else if keyed {
            SglDescriptor::keyed(mr.addr, out.max(inn) as u64, mr.rkey.0, invalidate)
                .unwrap_or(SglDescriptor::NULL)
        } else {
            SglDescriptor::NULL
        };
        let _ = sgl.emit(&mut sqe.dptr);
        let mut bytes = [0u8; SQE_LEN];
        sqe.emit(&mut bytes);
        self.cmd.write(i * capsule, &bytes);
        s.state = SlotState::Posted;
        s.send_done = false;
        s.cqe = None;
        s.posted_at = now;
        self.sends.push(SendWr::signaled(
            (WR_SEND << 32) | i as u64,
            SendOp::Send,
            Sgl::new(&sges[..nsge]).unwrap_or_default(),
        ));
    }

    /// Post the turn's sends and receive re-posts under one lock, with one driver kick. A
    /// post the device refuses means the connection is gone: recovery takes over.
    pub fn flush_posts(&mut self) {
        if self.sends.is_empty() && self.recvs.is_empty() {
            return;
        }
        let Some(v) = &self.verbs else {
            self.sends.clear();
            self.recvs.clear();
            return;
        };
        if v.dev.post(v.qpn, &mut self.recvs, &mut self.sends).is_err() {
            let c = self.device_cause().unwrap_or(Cause::Transport);
            self.fail_connection(c);
        }
    }

    /// The connection broke under the queue: hold what is out and tell recovery.
    fn fail_connection(&mut self, c: Cause) {
        if matches!(self.phase, Phase::Attached | Phase::Live) {
            self.go_down(c == Cause::Transport);
            self.alarm.raise_in(self.epoch, c);
        }
    }

    /// Feed one work completion.
    pub fn on_wc(&mut self, wc: &WorkCompletion) {
        if self.verbs.is_none() {
            return;
        }
        let kind = wc.wr_id >> 32;
        let idx = (wc.wr_id & 0xFFFF_FFFF) as usize;
        if wc.status != WcStatus::Success {
            // A flush on a dead device is the device's failure; any other error (and a flush
            // on a live device: the QP went to error, e.g. the target broke an MR's rules)
            // is this connection's.
            let c = match self.device_cause() {
                Some(dev) if wc.status == WcStatus::WrFlushErr => dev,
                _ => Cause::Transport,
            };
            self.fail_connection(c);
            return;
        }
        match (kind, wc.opcode) {
            (WR_SEND, WcOpcode::Send) => {
                if let Some(s) = self.slots.get_mut(idx) {
                    if s.state == SlotState::Posted {
                        s.send_done = true;
                        self.try_finish(idx);
                    }
                }
            }
            (WR_RECV, WcOpcode::Recv) => {
                self.on_response(idx, wc.byte_len as usize, wc.invalidated)
            }
            _ => {}
        }
    }

    /// The device behind the CQ is dead and drained.
    pub fn on_device_gone(&mut self) {
        self.cq_gone = true;
        let c = self.device_cause().unwrap_or(Cause::DeviceFatal);
        self.fail_connection(c);
    }

    /// If the device under the queue is dead: why (reset or hot-remove).
    fn device_cause(&self) -> Option<Cause> {
        match self.verbs.as_ref()?.dev.lifecycle() {
            Lifecycle::Live => None,
            Lifecycle::Removed => Some(Cause::DeviceRemoved),
            _ => Some(Cause::DeviceFatal),
        }
    }

    fn on_response(&mut self, r: usize, len: usize, invalidated: Option<MemKey>) {
        let Some(v) = &self.verbs else { return };
        if r >= self.spec.size {
            return;
        }
        let mut b = [0u8; CQE_LEN];
        self.rsp.read(r * CQE_LEN, &mut b);
        // The buffer is copied out: give it back to the target this turn.
        self.recvs.push(recv_wr(&v.rsp_mr, r));
        if len != CQE_LEN {
            self.stats.bad_response_len += 1;
            tracing::warn!(len, "response capsule of the wrong size ignored");
            return;
        }
        let Ok(cqe) = Cqe::parse(&b) else {
            self.bogus_invalidation(invalidated);
            return;
        };
        let slot = (cqe.cid & ((1 << SLOT_BITS) - 1)) as usize;
        let gen = cqe.cid >> SLOT_BITS;
        let Some(s) = self.slots.get(slot) else {
            self.stats.unknown_cid += 1;
            self.bogus_invalidation(invalidated);
            return;
        };
        let answers = s.gen == gen
            && (s.state == SlotState::Posted || (s.state == SlotState::Held && s.held_out));
        if let Some(k) = invalidated {
            if answers && s.key_live && k == self.slot_mr(slot).rkey {
                self.slots[slot].key_live = false;
                self.stats.remote_invalidations += 1;
            } else {
                // The target shut a key that is not this command's (maybe another one's in
                // flight): this connection can no longer be trusted with its keys.
                self.bogus_invalidation(invalidated);
                return;
            }
        }
        let s = &mut self.slots[slot];
        if s.state == SlotState::Held && s.held_out && s.gen == gen {
            // The connection failed while this command was out, but the target had run it:
            // complete it with its answer rather than send it again.
            s.state = SlotState::Posted;
            s.send_done = true;
            s.held_out = false;
            s.cqe = Some(cqe);
            self.stats.late_answers += 1;
            self.try_finish(slot);
            return;
        }
        if s.state != SlotState::Posted || s.gen != gen {
            self.stats.unknown_cid += 1;
            tracing::warn!(
                cid = cqe.cid,
                "completion for a command ID not in flight ignored"
            );
            return;
        }
        if s.cqe.is_some() {
            self.stats.duplicate_completion += 1;
            tracing::warn!(cid = cqe.cid, "duplicate completion ignored");
            return;
        }
        s.cqe = Some(cqe);
        self.try_finish(slot);
    }

    /// A response invalidated a key that was not its command's (or came with no command):
    /// fail the connection; recovery sends what is out again on a new one.
    fn bogus_invalidation(&mut self, invalidated: Option<MemKey>) {
        if let Some(k) = invalidated {
            self.stats.bogus_invalidations += 1;
            tracing::warn!(
                rkey = k.0,
                "the target invalidated a key of no command in flight"
            );
            self.fail_connection(Cause::Transport);
        }
    }

    /// The command in slot `i` is done with its data region: the target must not reach it
    /// any more (Linux nvme-rdma posts a LOCAL_INV unless the target sent with invalidate).
    fn release_key(&mut self, i: usize) {
        if !std::mem::take(&mut self.slots[i].key_live) {
            return;
        }
        if let Some(v) = &self.verbs {
            v.dev.invalidate_mr(&self.slot_mr(i));
            self.stats.local_invalidations += 1;
        }
    }

    fn try_finish(&mut self, i: usize) {
        let s = &self.slots[i];
        if !(s.state == SlotState::Posted && s.send_done) {
            return;
        }
        let Some(cqe) = s.cqe else { return };
        // Before the data is read out: nothing the target writes later lands in it.
        self.release_key(i);
        let s = &self.slots[i];
        if i == self.control_slot() {
            self.slots[i].state = SlotState::Free;
            self.slots[i].cqe = None;
            self.control = Some(ControlDone::Completed(cqe));
            self.control_fresh = true;
            return;
        }
        let st = cqe.nvme_status();
        let (retries, posted_at, data_in) = (s.retries, s.posted_at, s.data_in);
        if !st.is_success() && !st.dnr && retries < self.max_retries {
            // A retryable error: send it again (Linux nvme_decide_disposition), now if the
            // queue is live, else when it is again.
            self.stats.retried += 1;
            let s = &mut self.slots[i];
            s.retries += 1;
            if self.phase == Phase::Live {
                self.post(i, posted_at);
            } else {
                s.state = SlotState::Held;
                s.cqe = None;
                s.send_done = false;
                s.held_out = false;
            }
            return;
        }
        let mut data = Vec::new();
        if st.is_success() && data_in > 0 && self.slots[i].region.is_none() {
            let off = i * self.spec.max_io;
            let _apart = self.slots[i]
                .audit_apart
                .then(crate::harness::alloc_audit::enter);
            data = self.spare.pop().unwrap_or_default();
            data.clear();
            self.data
                .with_range(off, data_in, |b| data.extend_from_slice(b));
            self.stats.count_copy(data_in);
        }
        self.stats.completed += 1;
        self.finish(i, Ok(Response { cqe, data }));
    }

    fn finish(&mut self, i: usize, r: Result<Response, HostError>) {
        self.release_key(i);
        if let Some((id, chunk)) = self.slots[i].region.take() {
            if let Some(g) = self.regions.get_mut(id as usize).and_then(Option::as_mut) {
                g.busy[chunk as usize] = false;
                if g.orphan {
                    self.unregister(id);
                }
            }
        }
        let s = &mut self.slots[i];
        if let Some(tx) = s.reply.take() {
            let _ = tx.send(r);
        }
        s.state = SlotState::Free;
        s.cqe = None;
        s.send_done = false;
        s.held_out = false;
        self.free.push(i);
    }

    /// A posted command older than the I/O timeout means the connection is stuck: recover.
    /// The command counts one retry, so a command that always hangs fails in the end.
    pub fn check_timeouts(&mut self, now: Instant) {
        if self.io_timeout.is_zero() || !matches!(self.phase, Phase::Live | Phase::Attached) {
            return;
        }
        let mut expired = false;
        for i in 0..self.slots.len() {
            let s = &mut self.slots[i];
            if s.state == SlotState::Posted
                && s.cqe.is_none()
                && !waits_for_an_event(self.spec.qid, &s.sqe)
                && s.posted_at + self.io_timeout <= now
            {
                expired = true;
                self.stats.timeouts += 1;
                s.retries += 1;
                if s.retries > self.max_retries && i != self.control_slot() {
                    self.stats.failed += 1;
                    self.finish(
                        i,
                        Err(HostError::Timeout("command timed out too often".into())),
                    );
                }
            }
        }
        if expired {
            self.fail_connection(Cause::IoTimeout);
        }
    }

    /// Allocate `chunks` chunks of `chunk` bytes of host memory and register them with this
    /// queue (now if connected, and again on every new connection): an [`IoBuffer`]'s
    /// memory. Returns its id, memory and the offset of its first chunk.
    fn register(
        &mut self,
        chunk: usize,
        chunks: usize,
    ) -> Result<(u32, Arc<D::Mem>, usize), HostError> {
        if chunk == 0 || chunk > self.spec.max_io {
            return Err(HostError::Invalid(format!(
                "a registered buffer's chunk must be 1..={} bytes (the queue's transfer limit), not {chunk}",
                self.spec.max_io
            )));
        }
        if chunks == 0 || chunks > MAX_REGION_CHUNKS {
            return Err(HostError::Invalid(format!(
                "a registered buffer has 1..={MAX_REGION_CHUNKS} chunks, not {chunks}"
            )));
        }
        let mem = D::Mem::try_alloc(chunk * chunks + REGION_ALIGN).ok_or_else(|| {
            HostError::Invalid(format!(
                "no memory for a registered buffer of {chunks} x {chunk} bytes"
            ))
        })?;
        let pad = (REGION_ALIGN - mem.as_mut_ptr() as usize % REGION_ALIGN) % REGION_ALIGN;
        let mem = Arc::new(mem);
        let mut r = Region {
            mem: mem.clone(),
            pad,
            chunk,
            local: MrInfo::default(),
            mrs: vec![MrInfo::default(); chunks].into_boxed_slice(),
            nreg: 0,
            busy: vec![false; chunks].into_boxed_slice(),
            orphan: false,
        };
        if let Some(v) = &self.verbs {
            if let Err(e) = register_region(v, &mut r) {
                deregister_region(&v.dev, &mut r);
                return Err(e.into());
            }
        }
        let id = match self.regions.iter().position(Option::is_none) {
            Some(id) => {
                self.regions[id] = Some(r);
                id
            }
            None => {
                self.regions.push(Some(r));
                self.regions.len() - 1
            }
        };
        Ok((id as u32, mem, pad))
    }

    /// The [`IoBuffer`] of `id` is gone: deregister its memory, or, while commands still use
    /// it, once the last of them ends.
    fn unregister(&mut self, id: u32) {
        let Some(slot) = self.regions.get_mut(id as usize) else {
            return;
        };
        let Some(r) = slot.as_mut() else { return };
        if r.busy.iter().any(|b| *b) {
            r.orphan = true;
            return;
        }
        if let Some(v) = &self.verbs {
            deregister_region(&v.dev, r);
        }
        *slot = None;
    }

    fn region(&self, id: u32) -> Option<&Region<D::Mem>> {
        self.regions.get(id as usize).and_then(Option::as_ref)
    }

    /// Can a command use `r` now?
    fn check_region(&self, r: RegionIo) -> Result<(), HostError> {
        let g = self.region(r.id).filter(|g| !g.orphan).ok_or_else(|| {
            HostError::Invalid("registered buffer not known to this queue".into())
        })?;
        if r.chunk as usize >= g.busy.len() || r.len == 0 || r.len > g.chunk {
            return Err(HostError::Invalid(format!(
                "chunk {} of {} bytes is not in a registered buffer of {} chunks of {} bytes",
                r.chunk,
                r.len,
                g.busy.len(),
                g.chunk
            )));
        }
        if g.busy[r.chunk as usize] {
            return Err(HostError::Invalid(format!(
                "chunk {} of the registered buffer has a command in flight; wait for it",
                r.chunk
            )));
        }
        Ok(())
    }

    /// The MR of slot `i`'s data: its own, or its registered buffer chunk's.
    fn slot_mr(&self, i: usize) -> MrInfo {
        match self.slots[i].region {
            Some((id, chunk)) => self
                .region(id)
                .map_or(self.data_mrs[i], |r| r.mrs[chunk as usize]),
            None => self.data_mrs[i],
        }
    }

    /// The earliest moment a posted command can time out.
    pub fn next_timeout(&self) -> Option<Instant> {
        if self.io_timeout.is_zero() {
            return None;
        }
        self.slots
            .iter()
            .filter(|s| {
                s.state == SlotState::Posted
                    && s.cqe.is_none()
                    && !waits_for_an_event(self.spec.qid, &s.sqe)
            })
            .map(|s| s.posted_at + self.io_timeout)
            .min()
    }

    fn cq(&self) -> Option<(D, CqId)> {
        if self.cq_gone {
            return None;
        }
        self.verbs.as_ref().map(|v| (v.dev.clone(), v.cq))
    }

    /// The current CQ, whether or not it is still polled.
    fn cq_any(&self) -> Option<(D, CqId)> {
        self.verbs.as_ref().map(|v| (v.dev.clone(), v.cq))
    }

    /// Whether the controller should hear about a new reserved-slot completion.
    fn take_control_fresh(&mut self) -> bool {
        std::mem::take(&mut self.control_fresh)
    }

    /// Are all user slots idle?
    fn idle(&self) -> bool {
        self.free.len() == self.spec.size - 1
    }
}

fn recv_wr(rsp_mr: &MrInfo, r: usize) -> RecvWr {
    RecvWr {
        wr_id: (WR_RECV << 32) | r as u64,
        sgl: Sgl::one(
            rsp_mr.addr + (r * CQE_LEN) as u64,
            CQE_LEN as u32,
            rsp_mr.lkey,
        ),
    }
}

/// The MR of a slot's data, to re-key ([`QueueCore::slot_mr`]).
fn slot_mr<'a, M>(
    data_mrs: &'a mut [MrInfo],
    regions: &'a mut [Option<Region<M>>],
    i: usize,
    region: Option<(u32, u32)>,
) -> &'a mut MrInfo {
    match region.and_then(|(id, c)| Some((regions.get_mut(id as usize)?.as_mut()?, c))) {
        Some((r, c)) => &mut r.mrs[c as usize],
        None => &mut data_mrs[i],
    }
}

/// Register `r` on `v`: a local key over all of it, and one MR per chunk, reachable by no
/// one until a command hands out a key for it (where keys are per use). On error what was
/// made is recorded in `r` for [`deregister_region`].
fn register_region<D: DeviceContext>(
    v: &Verbs<D>,
    r: &mut Region<D::Mem>,
) -> Result<(), VerbsError> {
    let d = &v.dev;
    r.local = d.reg_mr(v.pd, &r.mem, 0, r.mem.len(), Access::empty())?;
    let rw = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE;
    for k in 0..r.mrs.len() {
        let m = d.reg_mr(v.pd, &r.mem, r.pad + k * r.chunk, r.chunk, rw)?;
        if v.per_use_keys {
            d.invalidate_mr(&m);
        }
        r.mrs[k] = m;
        r.nreg = k + 1;
    }
    Ok(())
}

/// Drop `r`'s MRs on `d` (all of them succeed on a dead device).
fn deregister_region<D: DeviceContext>(d: &D, r: &mut Region<D::Mem>) {
    if r.local.lkey.0 != 0 {
        d.dereg_mr(&r.local);
    }
    for m in &r.mrs[..r.nreg] {
        d.dereg_mr(m);
    }
    r.local = MrInfo::default();
    r.nreg = 0;
}

/// The controller's side of a queue: its core, and the notifier of its task.
pub struct QueueCtl<D: DeviceContext> {
    core: Arc<Mutex<QueueCore<D>>>,
    /// Wakes the task after the controller changed the core (new CQ, phase).
    task: Arc<Notify>,
    /// Wakes the controller when the reserved slot completes.
    pub control_done: Arc<Notify>,
    clock: Clock,
}

/// The controller's monotonic clock, shared by its queues (device contexts come and go,
/// each with its own epoch). Tokio's clock, so that a paused runtime (a simulated network)
/// runs the controller in virtual time.
#[derive(Clone, Copy)]
pub struct Clock(pub tokio::time::Instant);

impl Clock {
    pub fn now(&self) -> Instant {
        Instant(self.0.elapsed().as_nanos() as u64)
    }
}

impl<D: DeviceContext> Clone for QueueCtl<D> {
    fn clone(&self) -> Self {
        QueueCtl {
            core: self.core.clone(),
            task: self.task.clone(),
            control_done: self.control_done.clone(),
            clock: self.clock,
        }
    }
}

impl<D: DeviceContext> QueueCtl<D> {
    pub fn lock(&self) -> MutexGuard<'_, QueueCore<D>> {
        self.core.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Tell the task that the core changed.
    pub fn poke(&self) {
        self.task.notify_one();
    }

    pub fn now(&self) -> Instant {
        self.clock.now()
    }

    /// Run a controller command on the reserved slot and wait for its completion, at most
    /// `timeout`. Read data, if any, is left in the slot ([`QueueCore::control_data`]).
    pub async fn control(
        &self,
        sqe: Sqe,
        data_out: &[u8],
        data_in: usize,
        timeout: Duration,
    ) -> Result<Cqe, HostError> {
        let done = self.control_done.notified();
        tokio::pin!(done);
        done.as_mut().enable();
        self.lock()
            .post_control(self.now(), sqe, data_out, data_in)?;
        self.poke();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(d) = self.lock().take_control() {
                return match d {
                    ControlDone::Completed(cqe) => {
                        let st = cqe.nvme_status();
                        if st.is_success() {
                            Ok(cqe)
                        } else {
                            Err(HostError::from_status(st, sqe.opcode))
                        }
                    }
                    ControlDone::Lost => Err(HostError::Step("connection lost under command")),
                };
            }
            if tokio::time::timeout_at(deadline, done.as_mut())
                .await
                .is_err()
            {
                return Err(HostError::Step("controller command timed out"));
            }
            done.set(self.control_done.notified());
            done.as_mut().enable();
        }
    }
}

/// What a [`QueueHandle`] does on the queue's core itself, without its task. A trait object,
/// so that handles (and the controller's public API) do not carry the backend's type: one
/// indirect call per submission, against a lock and a post.
trait Direct: Send + Sync {
    /// Take the command here and post it if the queue has a free slot and nothing waits in
    /// its channel `tx` (so requests keep their order); else hand `reply` back.
    #[allow(clippy::too_many_arguments)]
    fn try_submit(
        &self,
        tx: &mpsc::Sender<Request>,
        clock: &Clock,
        sqe: Sqe,
        data_out: Option<&[u8]>,
        data_in: usize,
        region: Option<RegionIo>,
        reply: oneshot::Sender<Result<Response, HostError>>,
    ) -> Option<oneshot::Sender<Result<Response, HostError>>>;
    /// [`QueueCore::register`], with the memory type erased.
    fn register(
        &self,
        chunk: usize,
        chunks: usize,
    ) -> Result<(u32, Arc<dyn MemView>, usize), HostError>;
    fn unregister(&self, id: u32);
    /// Keep `buf` for a later read (if `keep`), and count `copied` bytes the caller copied
    /// out of it on the data path.
    fn recycle(&self, buf: Vec<u8>, keep: bool, copied: usize);
    fn stats(&self) -> QueueStats;
}

impl<D: DeviceContext> Direct for Mutex<QueueCore<D>> {
    fn try_submit(
        &self,
        tx: &mpsc::Sender<Request>,
        clock: &Clock,
        sqe: Sqe,
        data_out: Option<&[u8]>,
        data_in: usize,
        region: Option<RegionIo>,
        reply: oneshot::Sender<Result<Response, HostError>>,
    ) -> Option<oneshot::Sender<Result<Response, HostError>>> {
        let mut c = self.lock().unwrap_or_else(|e| e.into_inner());
        if c.accepting() && !c.backlog && tx.capacity() == tx.max_capacity() {
            let apart = crate::harness::alloc_audit::in_platform();
            c.submit_parts(clock.now(), sqe, data_out, data_in, region, reply, apart);
            c.flush_posts();
            None
        } else {
            Some(reply)
        }
    }

    fn recycle(&self, buf: Vec<u8>, keep: bool, copied: usize) {
        let mut c = self.lock().unwrap_or_else(|e| e.into_inner());
        if copied > 0 {
            c.stats.count_copy(copied);
        }
        if keep && c.spare.len() < SPARE_BUFFERS {
            c.spare.push(buf);
        }
    }

    fn stats(&self) -> QueueStats {
        self.lock().unwrap_or_else(|e| e.into_inner()).stats.clone()
    }

    fn register(
        &self,
        chunk: usize,
        chunks: usize,
    ) -> Result<(u32, Arc<dyn MemView>, usize), HostError> {
        let (id, mem, pad) = self
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .register(chunk, chunks)?;
        Ok((id, mem, pad))
    }

    fn unregister(&self, id: u32) {
        self.lock()
            .unwrap_or_else(|e| e.into_inner())
            .unregister(id);
    }
}

/// A registered buffer's memory, whatever the backend's type.
trait MemView: Send + Sync {
    fn view_ptr(&self) -> *mut u8;
    fn view_read(&self, offset: usize, out: &mut [u8]);
    fn view_write(&self, offset: usize, data: &[u8]);
}

impl<M: HostBuffer> MemView for M {
    fn view_ptr(&self) -> *mut u8 {
        self.as_mut_ptr()
    }
    fn view_read(&self, offset: usize, out: &mut [u8]) {
        self.read(offset, out)
    }
    fn view_write(&self, offset: usize, data: &[u8]) {
        self.write(offset, data)
    }
}

/// Host memory registered with one I/O queue, for I/O with no copy: a write's data leaves
/// from it and a read's data lands in it ([`Controller::write_from`],
/// [`Controller::read_to`]). It is `chunks()` chunks of `chunk_len()` bytes, each with its
/// own memory region and a fresh key per command, so one command at a time may use a chunk;
/// the first chunk starts on a page boundary. The memory belongs to the queue and is
/// registered again on the new device after a recovery; it is freed once this handle is
/// dropped and no command uses it.
///
/// [`Controller::write_from`]: super::Controller::write_from
/// [`Controller::read_to`]: super::Controller::read_to
pub struct IoBuffer {
    queue: QueueHandle,
    id: u32,
    mem: Arc<dyn MemView>,
    pad: usize,
    chunk: usize,
    chunks: usize,
}

impl IoBuffer {
    pub fn chunk_len(&self) -> usize {
        self.chunk
    }

    pub fn chunks(&self) -> usize {
        self.chunks
    }

    /// Bytes of all chunks.
    pub fn len(&self) -> usize {
        self.chunk * self.chunks
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The first byte of chunk 0 (chunk `k` starts `k * chunk_len()` after it). For code
    /// that fills and reads the buffer itself (fio's I/O buffers): it must not touch a chunk
    /// while a command on it is out, as with DMA.
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.mem.view_ptr().wrapping_add(self.pad)
    }

    /// Copy `data` into the buffer at `offset` (from chunk 0's start).
    pub fn write(&self, offset: usize, data: &[u8]) {
        assert!(offset + data.len() <= self.len(), "write past the buffer");
        self.mem.view_write(self.pad + offset, data)
    }

    /// Copy the buffer's bytes at `offset` into `out`.
    pub fn read(&self, offset: usize, out: &mut [u8]) {
        assert!(offset + out.len() <= self.len(), "read past the buffer");
        self.mem.view_read(self.pad + offset, out)
    }

    /// The chunk that holds all of `len` bytes at `ptr`, starting at its beginning, if any.
    pub fn chunk_at(&self, ptr: *const u8, len: usize) -> Option<usize> {
        let off = (ptr as usize).checked_sub(self.as_mut_ptr() as usize)?;
        let k = off / self.chunk;
        (off % self.chunk == 0 && k < self.chunks && len > 0 && len <= self.chunk).then_some(k)
    }

    /// The queue it is registered with.
    pub fn queue(&self) -> &QueueHandle {
        &self.queue
    }

    pub(crate) fn io(&self, chunk: usize, len: usize, write: bool) -> RegionIo {
        RegionIo {
            id: self.id,
            chunk: chunk.min(u32::MAX as usize) as u32,
            len,
            write,
        }
    }
}

impl Drop for IoBuffer {
    fn drop(&mut self) {
        self.queue.core.unregister(self.id);
    }
}

/// A cheap handle for submitting to a queue.
#[derive(Clone)]
pub struct QueueHandle {
    tx: mpsc::Sender<Request>,
    pub qid: u16,
    pub spec: QueueSpec,
    core: Arc<dyn Direct>,
    /// The queue task's notifier, and the clock it stamps posts with.
    task: Arc<Notify>,
    clock: Clock,
}

impl QueueHandle {
    /// Give back the data buffer of a read's [`Response`] once its bytes are used, for the
    /// queue to fill with a later read. Keeps a few, of at most the queue's transfer size.
    pub fn recycle(&self, buf: Vec<u8>) {
        self.recycle_copied(buf, 0);
    }

    /// [`QueueHandle::recycle`] after the caller copied `copied` bytes out of the buffer on
    /// its data path: counted in [`QueueStats::copies`] under the same lock.
    pub(crate) fn recycle_copied(&self, buf: Vec<u8>, copied: usize) {
        let keep = buf.capacity() != 0 && buf.capacity() <= self.spec.max_io;
        if keep || copied > 0 {
            self.core.recycle(buf, keep, copied);
        }
    }

    /// The queue's counters.
    pub fn stats(&self) -> QueueStats {
        self.core.stats()
    }

    /// Submit a command and wait for its completion. An error status comes back as
    /// `HostError::Nvme`.
    pub async fn submit(
        &self,
        sqe: Sqe,
        data_out: Option<Vec<u8>>,
        data_in: usize,
    ) -> Result<Response, HostError> {
        let opcode = sqe.opcode;
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Request {
                sqe,
                data_out,
                data_in,
                region: None,
                reply,
                audit_apart: crate::harness::alloc_audit::in_platform(),
            })
            .await
            .map_err(|_| HostError::Gone(format!("queue {} stopped", self.qid)))?;
        self.finish(opcode, rx).await
    }

    /// [`QueueHandle::submit`] with the outgoing data borrowed. When the queue has a free
    /// slot and nothing waits in its channel (so requests keep their order), the command is
    /// taken right here: `data_out` is copied once, straight into the slot's registered
    /// buffer, and posted, with no buffer of its own and no hop through the queue task.
    /// Otherwise it queues like `submit`.
    pub async fn submit_slice(
        &self,
        sqe: Sqe,
        data_out: Option<&[u8]>,
        data_in: usize,
    ) -> Result<Response, HostError> {
        self.submit_direct(sqe, data_out, data_in, None).await
    }

    /// Submit a command whose data is in a registered buffer ([`IoBuffer`]) of this queue:
    /// nothing is copied. Taken here or queued as [`QueueHandle::submit_slice`].
    pub(crate) async fn submit_region(
        &self,
        sqe: Sqe,
        region: RegionIo,
    ) -> Result<Response, HostError> {
        self.submit_direct(sqe, None, 0, Some(region)).await
    }

    /// Allocate and register an [`IoBuffer`] of `chunks` chunks of `chunk` bytes (at most
    /// the queue's transfer size) with this queue.
    pub fn register_buffer(&self, chunk: usize, chunks: usize) -> Result<IoBuffer, HostError> {
        let (id, mem, pad) = self.core.register(chunk, chunks)?;
        Ok(IoBuffer {
            queue: self.clone(),
            id,
            mem,
            pad,
            chunk,
            chunks,
        })
    }

    /// Is `other` a handle of this very queue?
    pub fn same(&self, other: &QueueHandle) -> bool {
        Arc::ptr_eq(&self.task, &other.task)
    }

    async fn submit_direct(
        &self,
        sqe: Sqe,
        data_out: Option<&[u8]>,
        data_in: usize,
        region: Option<RegionIo>,
    ) -> Result<Response, HostError> {
        let opcode = sqe.opcode;
        let (reply, rx) = oneshot::channel();
        let reply =
            self.core
                .try_submit(&self.tx, &self.clock, sqe, data_out, data_in, region, reply);
        match reply {
            // The task re-arms its I/O timeout for the new command.
            None => self.task.notify_one(),
            Some(reply) => {
                if let Some(d) = data_out {
                    // The queued request carries a copy of the data.
                    self.core.recycle(Vec::new(), false, d.len());
                }
                self.tx
                    .send(Request {
                        sqe,
                        data_out: data_out.map(<[u8]>::to_vec),
                        data_in,
                        region,
                        reply,
                        audit_apart: crate::harness::alloc_audit::in_platform(),
                    })
                    .await
                    .map_err(|_| HostError::Gone(format!("queue {} stopped", self.qid)))?
            }
        }
        self.finish(opcode, rx).await
    }

    async fn finish(
        &self,
        opcode: u8,
        rx: oneshot::Receiver<Result<Response, HostError>>,
    ) -> Result<Response, HostError> {
        let r = rx
            .await
            .map_err(|_| HostError::Gone(format!("queue {} stopped", self.qid)))??;
        let st = r.cqe.nvme_status();
        if st.is_success() {
            Ok(r)
        } else {
            Err(HostError::from_status(st, opcode))
        }
    }
}

/// Start a queue's task over `core`. The task lives as long as the controller: across
/// recoveries it only changes which CQ it polls.
pub fn spawn<D: DeviceContext>(
    core: QueueCore<D>,
    clock: Clock,
) -> (QueueHandle, QueueCtl<D>, tokio::task::JoinHandle<()>) {
    let spec = core.spec;
    let (tx, rx) = mpsc::channel(spec.size);
    let core = Arc::new(Mutex::new(core));
    let ctl = QueueCtl {
        core: core.clone(),
        task: Arc::new(Notify::new()),
        control_done: Arc::new(Notify::new()),
        clock,
    };
    let handle = QueueHandle {
        tx,
        qid: spec.qid,
        spec,
        core,
        task: ctl.task.clone(),
        clock,
    };
    let jh = tokio::spawn(run(ctl.clone(), rx));
    (handle, ctl, jh)
}

async fn run<D: DeviceContext>(ctl: QueueCtl<D>, mut rx: mpsc::Receiver<Request>) {
    let mut wcs: Vec<WorkCompletion> = Vec::with_capacity(256);
    let mut open = true;
    // A request taken from the channel after callers filled the last free slot directly
    // (`QueueHandle::submit_slice`): it goes first once a slot is free.
    let mut stash: Option<Request> = None;
    // One timer for the life of the task, moved only earlier (see `EarliestTimer`): an
    // early fire finds nothing expired and is armed again.
    let timer = EarliestTimer::new();
    tokio::pin!(timer);
    loop {
        // Completions were handed to their callers this iteration.
        let mut reaped = false;
        let (cq, accepting, next_timeout, closed) = {
            let mut c = ctl.lock();
            if c.accepting() {
                if let Some(r) = stash.take() {
                    c.backlog = false;
                    let now = ctl.now();
                    c.submit(now, r);
                    c.flush_posts();
                }
            }
            (
                c.cq(),
                c.accepting() && stash.is_none(),
                c.next_timeout(),
                matches!(c.phase, Phase::Closed(_)),
            )
        };
        if closed && !open {
            break;
        }
        if let Some(t) = next_timeout {
            let at = tokio::time::Instant::now() + t.saturating_since(ctl.now());
            timer.as_mut().arm(at);
        }
        wcs.clear();
        // Biased, so that a simulated run replays (tokio's unbiased choice is random), with
        // the timer first: a deadline is ready once, and a queue whose completions never
        // stop must still see the commands that stopped.
        tokio::select! {
            biased;
            _ = &mut timer => {
                ctl.lock().check_timeouts(ctl.now());
            }
            req = rx.recv(), if open && accepting => match req {
                Some(r) => {
                    let mut c = ctl.lock();
                    let now = ctl.now();
                    if !c.accepting() {
                        // Direct submissions took the slots since the loop looked.
                        c.backlog = true;
                        stash = Some(r);
                    } else {
                        c.submit(now, r);
                    }
                    while c.accepting() && stash.is_none() {
                        match rx.try_recv() {
                            Ok(r) => c.submit(now, r),
                            Err(_) => break,
                        }
                    }
                }
                None => {
                    open = false;
                    // Every handle is gone: nobody waits for the held requests.
                    if ctl.lock().idle() {
                        break;
                    }
                }
            },
            _ = ctl.task.notified() => {}
            n = async {
                match &cq {
                    Some((dev, cq)) => dev.wait_cq(*cq, 256, &mut wcs).await,
                    None => std::future::pending().await,
                }
            } => {
                let mut c = ctl.lock();
                // The controller may have swapped the verbs while we waited: what came from
                // an old CQ belongs to a connection that is already gone.
                let current = match (&cq, c.cq_any()) {
                    (Some((h0, q0)), Some((h1, q1))) => h0.same(&h1) && *q0 == q1,
                    _ => false,
                };
                if current {
                    if n == 0 {
                        c.on_device_gone();
                    } else {
                        for wc in &wcs {
                            c.on_wc(wc);
                        }
                        reaped = true;
                    }
                }
            }
        }
        {
            let mut c = ctl.lock();
            c.flush_posts();
            if c.take_control_fresh() {
                // Every enabled waiter: the controller's keep-alive watch and a bring-up
                // command can both be registered; a single permit could go to the wrong one.
                ctl.control_done.notify_waiters();
            }
        }
        if reaped {
            // The callers first: on a runtime of one thread they run only once this task
            // is pending, and what the loop does next (its timer, its waiters made again,
            // a look at the CQ) would stand between a completion and its caller. The
            // runtime keeps yielded tasks in a list of its own that grows (once, amortized)
            // the first time more tasks yield in one tick than before: the runtime's
            // bookkeeping, counted with the platform's by the allocation audit.
            crate::harness::alloc_audit::Platform::new(tokio::task::yield_now()).await;
        }
    }
}

#[cfg(test)]
mod alarm_tests {
    use super::*;

    #[test]
    fn a_cause_from_the_old_connection_does_not_break_the_new_one() {
        let a = Alarm::default();
        let old = a.epoch();
        a.raise_in(old, Cause::DeviceFatal);
        assert_eq!(a.take(), Some(Cause::DeviceFatal));
        // A second queue of the same connection saw the same reset, after it was taken.
        a.raise_in(old, Cause::DeviceFatal);
        // Recovery drops the resources: a new epoch. The late report is stale.
        let new = a.new_epoch();
        assert_ne!(new, old);
        assert_eq!(a.take(), None);
        // One raised now is about the new connection; a stale one cannot displace it.
        a.raise_in(new, Cause::CmDisconnect);
        a.raise_in(old, Cause::Transport);
        assert_eq!(a.take(), Some(Cause::CmDisconnect));
        a.raise_in(old, Cause::Transport);
        assert_eq!(a.take(), None);
        a.raise(Cause::UserReset);
        a.raise(Cause::IoTimeout);
        assert_eq!(a.take(), Some(Cause::UserReset), "the first cause wins");
        assert_eq!(a.take(), None);
    }
}

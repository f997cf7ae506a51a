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

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, Notify};

use crate::nvme::{Cqe, SglDescriptor, Sqe};
use crate::reconnect::{Cause, Event, FailReason};
use crate::verbs::{
    Access, CqId, DeviceContext, HostBuffer, Instant, Lifecycle, MemKey, MrInfo, Mtu, PdId,
    PeerInfo, Psn, QpCaps, Qpn, RcAttr, RecvWr, SendOp, SendWr, Sge, Sgl, VerbsError, WcOpcode,
    WcStatus, WorkCompletion,
};

use super::inbox::Inbox;
use super::HostError;
use crate::timer::EarliestTimer;

mod complete;
mod handle;
mod region;
mod submit;

pub use handle::{spawn, Clock, IoBuffer, QueueCtl, QueueHandle};

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
    /// Posted on a connection that died and not posted since: a copy of it may still execute
    /// in the target.
    stale: bool,
    /// Held back by safe retry until the dead association's commands are known finished
    /// ([`QueueCore::gate_stale`], [`QueueCore::ungate`]).
    gated: bool,
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
    /// Recovery's entry: where the queue reports that its connection broke.
    inbox: Arc<Inbox>,
    /// The connection epoch this queue attached in; its reports are stamped with it.
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
    /// The last exchange on this queue: a command posted or a batch of completions taken,
    /// on the controller's clock. Safe retry counts the dead controller's quiesce time from
    /// the latest of its queues'.
    last_contact: Instant,
    /// Answers were taken from the CQ at teardown: contact lasted until then.
    heard_at_teardown: bool,
}

/// Completions polled per call when draining a CQ at teardown.
const DRAIN_BATCH: usize = 64;

/// Read buffers a queue keeps for reuse.
const SPARE_BUFFERS: usize = 8;

impl<D: DeviceContext> QueueCore<D> {
    /// Allocate the queue's host memory: rings, data buffers, slots. Nothing is registered.
    pub(super) fn new(
        spec: QueueSpec,
        inbox: Arc<Inbox>,
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
                stale: false,
                gated: false,
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
            inbox,
            epoch: 0,
            io_timeout,
            max_retries,
            backlog: false,
            drain: Vec::with_capacity(DRAIN_BATCH),
            spare: Vec::with_capacity(SPARE_BUFFERS),
            last_contact: Instant(0),
            heard_at_teardown: false,
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
        self.heard_at_teardown = false;
        self.epoch = self.inbox.epoch();
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
            if let Err(e) = r.register(&v) {
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
                r.deregister(d);
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
                self.heard_at_teardown = true;
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
                s.stale = true;
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

    /// The controller is LIVE again: send every held command safe retry does not hold
    /// back.
    pub fn resume(&mut self, now: Instant) {
        if self.verbs.is_none() || matches!(self.phase, Phase::Closed(_)) {
            return;
        }
        self.phase = Phase::Live;
        self.failfast = None;
        for i in 0..self.slots.len() {
            if self.slots[i].state == SlotState::Held && !self.slots[i].gated {
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

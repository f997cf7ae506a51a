//! One host NVMe-oF RDMA queue (admin or I/O): an RC QP with a command-capsule ring, a
//! response ring and one data buffer per command slot, all registered once at connect time.
//!
//! Command IDs index a preallocated slot table (low bits) and carry a generation (high bits),
//! so a late or duplicate completion from a confused target can never complete the request
//! that reused the slot. A request completes only when both its SEND completion and its
//! response capsule are in (Linux `nvme_rdma_end_request`). Every data buffer has its own
//! MR: a target can only touch the buffer of the command it was handed.

use std::sync::{Arc, Mutex};

use tokio::sync::{mpsc, oneshot, Notify};

use crate::driver::SoftHca;
use crate::hca::rc::{create_qp_init, qp_to_rts, PeerInfo, RcOptions};
use crate::hca::{
    Access, AttrMask, CqId, HostMem, MrInfo, Mtu, PdId, Psn, QpAttr, QpCaps, QpState, Qpn, RecvWr,
    SendOp, SendWr, Sge, Sgl, WcOpcode, WcStatus, WorkCompletion,
};
use crate::nvme::{Cqe, SglDescriptor, Sqe};

use super::HostError;

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
    pub reply: oneshot::Sender<Result<Response, HostError>>,
}

#[derive(Debug)]
pub struct Response {
    pub cqe: Cqe,
    pub data: Vec<u8>,
}

/// Counters of protocol oddities (a target that lies).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QueueStats {
    pub submitted: u64,
    pub completed: u64,
    pub unknown_cid: u64,
    pub duplicate_completion: u64,
    pub bad_response_len: u64,
}

/// Sizes of one queue.
#[derive(Debug, Clone, Copy)]
pub struct QueueSpec {
    pub qid: u16,
    /// Entries (hsqsize + 1).
    pub size: usize,
    /// Bytes of in-capsule data allowed (0 on the admin queue).
    pub inline: usize,
    /// Largest data transfer of one command.
    pub max_io: usize,
    pub mtu: Mtu,
}

struct Slot {
    busy: bool,
    gen: u16,
    send_done: bool,
    cqe: Option<Cqe>,
    data_in: usize,
    opcode: u8,
    reply: Option<oneshot::Sender<Result<Response, HostError>>>,
}

/// The verbs resources of a queue, created before CM connects it.
pub struct QueueRes {
    pub spec: QueueSpec,
    pub qpn: Qpn,
    pub psn: Psn,
    pub cq: CqId,
    cmd: (HostMem, MrInfo),
    rsp: (HostMem, MrInfo),
    data: HostMem,
    data_mrs: Vec<MrInfo>,
}

impl QueueRes {
    /// Allocate CQ, QP (INIT) and register the rings and data buffers under `pd`.
    pub fn create(
        hca: &SoftHca,
        pd: PdId,
        spec: QueueSpec,
        psn: Psn,
    ) -> Result<QueueRes, HostError> {
        if spec.size < 2 || spec.size > MAX_QUEUE_SIZE {
            return Err(HostError::Invalid(format!(
                "queue size {} not in 2..={MAX_QUEUE_SIZE}",
                spec.size
            )));
        }
        let capsule = SQE_LEN + spec.inline;
        hca.with(|d, _| -> Result<QueueRes, HostError> {
            let cq = d.create_cq(spec.size * 4 + 1)?;
            let caps = QpCaps {
                max_send_wr: spec.size as u32 * 2 + 1,
                max_recv_wr: spec.size as u32 + 1,
            };
            let qpn = match create_qp_init(
                d,
                pd,
                cq,
                caps,
                Access::REMOTE_READ | Access::REMOTE_WRITE | Access::LOCAL_WRITE,
            ) {
                Ok(q) => q,
                Err(e) => {
                    let _ = d.destroy_cq(cq);
                    return Err(e.into());
                }
            };
            let cmd = HostMem::new(spec.size * capsule);
            let rsp = HostMem::new(spec.size * CQE_LEN);
            let data = HostMem::new(spec.size * spec.max_io);
            let cmd_mr = d.reg_mr(pd, &cmd, 0, cmd.len(), Access::empty())?;
            let rsp_mr = d.reg_mr(pd, &rsp, 0, rsp.len(), Access::LOCAL_WRITE)?;
            let rw = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE;
            let mut data_mrs = Vec::with_capacity(spec.size);
            for i in 0..spec.size {
                data_mrs.push(d.reg_mr(pd, &data, i * spec.max_io, spec.max_io, rw)?);
            }
            Ok(QueueRes {
                spec,
                qpn,
                psn,
                cq,
                cmd: (cmd, cmd_mr),
                rsp: (rsp, rsp_mr),
                data,
                data_mrs,
            })
        })
    }

    /// The peer answered (CM REP): QP to RTS and post the response ring.
    pub fn connected(&self, hca: &SoftHca, peer: PeerInfo) -> Result<(), HostError> {
        let o = RcOptions {
            mtu: self.spec.mtu,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_unacked: 256,
            ..RcOptions::default()
        };
        hca.with(|d, _| -> Result<(), HostError> {
            qp_to_rts(d, self.qpn, peer, self.psn, &o)?;
            for r in 0..self.spec.size {
                d.post_recv(self.qpn, self.recv_wr(r))?;
            }
            Ok(())
        })
    }

    fn recv_wr(&self, r: usize) -> RecvWr {
        RecvWr {
            wr_id: (WR_RECV << 32) | r as u64,
            sgl: Sgl::one(
                self.rsp.1.addr + (r * CQE_LEN) as u64,
                CQE_LEN as u32,
                self.rsp.1.lkey,
            ),
        }
    }

    /// Release every verbs object of the queue; on a zombie device this always succeeds.
    pub fn destroy(&self, hca: &SoftHca) {
        hca.with(|d, _| {
            let _ = d.destroy_qp(self.qpn);
            let _ = d.destroy_cq(self.cq);
            let _ = d.dereg_mr(self.cmd.1.lkey);
            let _ = d.dereg_mr(self.rsp.1.lkey);
            for m in &self.data_mrs {
                let _ = d.dereg_mr(m.lkey);
            }
        });
    }
}

/// The running queue: slot table plus the task that feeds it.
pub struct Queue {
    res: QueueRes,
    hca: SoftHca,
    slots: Vec<Slot>,
    free: Vec<usize>,
    pub stats: QueueStats,
    /// What [`QueueHandle::stats`] reads: `stats` as of the task's last turn.
    published: Arc<Mutex<QueueStats>>,
    stop: Arc<Notify>,
    wcs: Vec<WorkCompletion>,
    /// Work requests gathered during one turn and posted under one device lock.
    sends: Vec<(usize, SendWr)>,
    recvs: Vec<RecvWr>,
}

/// A cheap handle for submitting to a queue.
#[derive(Clone)]
pub struct QueueHandle {
    tx: mpsc::Sender<Request>,
    pub qid: u16,
    pub spec: QueueSpec,
    stats: Arc<Mutex<QueueStats>>,
    stop: Arc<Notify>,
}

impl QueueHandle {
    /// Tear the queue down now (after the CM disconnect, as Linux drains the QP): commands
    /// still out complete with a transport error instead of waiting for a target that may
    /// never answer, and no new ones are taken. The task then releases its resources.
    pub fn stop(&self) {
        self.stop.notify_one();
    }

    /// The queue's counters as of its task's last turn (what a lying target made it count).
    pub fn stats(&self) -> QueueStats {
        self.stats.lock().unwrap_or_else(|e| e.into_inner()).clone()
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
                reply,
            })
            .await
            .map_err(|_| HostError::Gone(format!("queue {} stopped", self.qid)))?;
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

impl Queue {
    /// Start the queue's task. The queue must be connected (QP in RTS, ring posted).
    pub fn spawn(
        res: QueueRes,
        hca: SoftHca,
    ) -> (QueueHandle, tokio::task::JoinHandle<QueueStats>) {
        let size = res.spec.size;
        let (tx, rx) = mpsc::channel(size);
        let published = Arc::new(Mutex::new(QueueStats::default()));
        let stop = Arc::new(Notify::new());
        let handle = QueueHandle {
            tx,
            qid: res.spec.qid,
            spec: res.spec,
            stats: published.clone(),
            stop: stop.clone(),
        };
        let q = Queue {
            slots: (0..size)
                .map(|_| Slot {
                    busy: false,
                    gen: 0,
                    send_done: false,
                    cqe: None,
                    data_in: 0,
                    opcode: 0,
                    reply: None,
                })
                .collect(),
            free: (0..size).rev().collect(),
            res,
            hca,
            stats: QueueStats::default(),
            published,
            stop,
            wcs: Vec::with_capacity(size * 2),
            sends: Vec::with_capacity(size),
            recvs: Vec::with_capacity(size),
        };
        let jh = tokio::spawn(q.run(rx));
        (handle, jh)
    }

    async fn run(mut self, mut rx: mpsc::Receiver<Request>) -> QueueStats {
        let cq = self.res.cq;
        let hca = self.hca.clone();
        let stop = self.stop.clone();
        let mut open = true;
        loop {
            let mut wcs = std::mem::take(&mut self.wcs);
            wcs.clear();
            tokio::select! {
                req = rx.recv(), if open && !self.free.is_empty() => match req {
                    Some(r) => {
                        self.submit(r);
                        // Take whatever else is queued while there are free slots.
                        while !self.free.is_empty() {
                            match rx.try_recv() {
                                Ok(r) => self.submit(r),
                                Err(_) => break,
                            }
                        }
                    }
                    // Every handle is gone: nobody waits for what is still out.
                    None => {
                        open = false;
                        self.drain();
                    }
                },
                _ = stop.notified(), if open => {
                    open = false;
                    self.drain();
                }
                n = hca.wait_cq(cq, 256, &mut wcs) => {
                    if n == 0 {
                        self.fail_all("device is gone");
                        self.wcs = wcs;
                        break;
                    }
                    for wc in &wcs {
                        self.on_wc(wc);
                    }
                }
            }
            self.wcs = wcs;
            self.flush_posts();
            *self.published.lock().unwrap_or_else(|e| e.into_inner()) = self.stats.clone();
            if !open && self.free.len() == self.slots.len() {
                break;
            }
        }
        self.res.destroy(&self.hca);
        self.stats.clone()
    }

    /// Move the QP to the error state: every outstanding work request is flushed, and the
    /// flush completions fail the commands still out, so the task can end.
    fn drain(&self) {
        if self.free.len() == self.slots.len() {
            return;
        }
        let qpn = self.res.qpn;
        let attr = QpAttr {
            state: QpState::Err,
            ..QpAttr::default()
        };
        let _ = self
            .hca
            .with(|d, _| d.modify_qp(qpn, &attr, AttrMask::STATE));
    }

    fn cid(slot: usize, gen: u16) -> u16 {
        (slot as u16) | (gen << SLOT_BITS)
    }

    fn submit(&mut self, mut req: Request) {
        let Some(slot) = self.free.pop() else {
            let _ = req.reply.send(Err(HostError::Invalid("queue full".into())));
            return;
        };
        let spec = self.res.spec;
        let out_len = req.data_out.as_ref().map_or(0, |v| v.len());
        if out_len > spec.max_io || req.data_in > spec.max_io {
            self.free.push(slot);
            let _ = req.reply.send(Err(HostError::Invalid(format!(
                "transfer larger than {} bytes",
                spec.max_io
            ))));
            return;
        }
        let s = &mut self.slots[slot];
        s.gen = (s.gen + 1) & ((1 << (16 - SLOT_BITS)) - 1);
        let cid = Self::cid(slot, s.gen);
        req.sqe.cid = cid;
        let mr = self.res.data_mrs[slot];
        let mut sges = [Sge::default(); 2];
        let capsule = SQE_LEN + spec.inline;
        sges[0] = Sge {
            addr: self.res.cmd.1.addr + (slot * capsule) as u64,
            len: SQE_LEN as u32,
            lkey: self.res.cmd.1.lkey,
        };
        let mut nsge = 1;
        let sgl = if let Some(data) = &req.data_out {
            self.res.data.write(slot * spec.max_io, data);
            if spec.qid > 0 && data.len() <= spec.inline {
                sges[1] = Sge {
                    addr: mr.addr,
                    len: data.len() as u32,
                    lkey: mr.lkey,
                };
                nsge = 2;
                SglDescriptor::InCapsule {
                    offset: 0,
                    len: data.len() as u32,
                }
            } else {
                SglDescriptor::keyed(mr.addr, data.len() as u64, mr.rkey.0, false)
                    .unwrap_or(SglDescriptor::NULL)
            }
        } else if req.data_in > 0 {
            // A target that reports success without writing the data must not hand this
            // caller the bytes of the slot's previous request.
            self.res.data.lock()[slot * spec.max_io..][..req.data_in].fill(0);
            SglDescriptor::keyed(mr.addr, req.data_in as u64, mr.rkey.0, false)
                .unwrap_or(SglDescriptor::NULL)
        } else {
            SglDescriptor::NULL
        };
        let _ = sgl.emit(&mut req.sqe.dptr);
        let mut bytes = [0u8; SQE_LEN];
        req.sqe.emit(&mut bytes);
        self.res.cmd.0.write(slot * capsule, &bytes);
        s.busy = true;
        s.send_done = false;
        s.cqe = None;
        s.data_in = req.data_in;
        s.opcode = req.sqe.opcode;
        s.reply = Some(req.reply);
        let wr = SendWr {
            wr_id: (WR_SEND << 32) | slot as u64,
            op: SendOp::Send,
            sgl: Sgl::new(&sges[..nsge]).unwrap_or_default(),
            signaled: true,
            solicited: false,
        };
        self.sends.push((slot, wr));
        self.stats.submitted += 1;
    }

    /// Post the turn's sends and receive re-posts under one lock, with one driver kick.
    fn flush_posts(&mut self) {
        if self.sends.is_empty() && self.recvs.is_empty() {
            return;
        }
        let qpn = self.res.qpn;
        let mut sends = std::mem::take(&mut self.sends);
        let mut recvs = std::mem::take(&mut self.recvs);
        let mut failed: Vec<(usize, String)> = Vec::new();
        self.hca.with(|d, now| {
            for r in recvs.drain(..) {
                let _ = d.post_recv(qpn, r);
            }
            for (slot, wr) in sends.drain(..) {
                if let Err(e) = d.post_send(now, qpn, wr) {
                    failed.push((slot, e.to_string()));
                }
            }
        });
        self.sends = sends;
        self.recvs = recvs;
        for (slot, e) in failed {
            self.finish(slot, Err(HostError::Transport(e)));
        }
    }

    fn on_wc(&mut self, wc: &WorkCompletion) {
        let kind = wc.wr_id >> 32;
        let idx = (wc.wr_id & 0xFFFF_FFFF) as usize;
        if wc.status != WcStatus::Success {
            // The QP is in error: every outstanding command is lost with it.
            self.fail_all(&format!("work completion: {}", wc.status.as_str()));
            return;
        }
        match (kind, wc.opcode) {
            (WR_SEND, WcOpcode::Send) => {
                if let Some(s) = self.slots.get_mut(idx) {
                    if s.busy {
                        s.send_done = true;
                        self.try_finish(idx);
                    }
                }
            }
            (WR_RECV, WcOpcode::Recv) => self.on_response(idx, wc.byte_len as usize),
            _ => {}
        }
    }

    fn on_response(&mut self, r: usize, len: usize) {
        if r >= self.res.spec.size {
            return;
        }
        let mut b = [0u8; CQE_LEN];
        self.res.rsp.0.read(r * CQE_LEN, &mut b);
        // The buffer is copied out: give it back to the target this turn.
        let wr = self.res.recv_wr(r);
        self.recvs.push(wr);
        if len != CQE_LEN {
            self.stats.bad_response_len += 1;
            tracing::warn!(len, "response capsule of the wrong size ignored");
            return;
        }
        let Ok(cqe) = Cqe::parse(&b) else { return };
        let slot = (cqe.cid & ((1 << SLOT_BITS) - 1)) as usize;
        let gen = cqe.cid >> SLOT_BITS;
        let Some(s) = self.slots.get_mut(slot) else {
            self.stats.unknown_cid += 1;
            return;
        };
        if !s.busy || s.gen != gen {
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

    fn try_finish(&mut self, slot: usize) {
        let s = &self.slots[slot];
        if !(s.busy && s.send_done) {
            return;
        }
        let Some(cqe) = s.cqe else { return };
        let mut data = Vec::new();
        if cqe.nvme_status().is_success() && s.data_in > 0 {
            data = vec![0u8; s.data_in];
            self.res.data.read(slot * self.res.spec.max_io, &mut data);
        }
        self.stats.completed += 1;
        self.finish(slot, Ok(Response { cqe, data }));
    }

    fn finish(&mut self, slot: usize, r: Result<Response, HostError>) {
        let s = &mut self.slots[slot];
        if let Some(tx) = s.reply.take() {
            let _ = tx.send(r);
        }
        s.busy = false;
        s.cqe = None;
        s.send_done = false;
        self.free.push(slot);
    }

    fn fail_all(&mut self, why: &str) {
        for i in 0..self.slots.len() {
            if self.slots[i].busy {
                self.finish(i, Err(HostError::Transport(why.to_string())));
            }
        }
    }
}

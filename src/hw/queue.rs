//! One NVMe-oF RDMA queue on a hardware device: an RC QP connected through rdma_cm with the
//! NVMe-oF private data, a CQ with a completion channel watched by tokio, and three registered
//! buffers: `depth` 64-byte command capsules (SEND), `depth` 16-byte response capsules (RECV),
//! and `depth` data slots of `max_io` bytes that the target reads / writes through the keyed
//! SGL of each command (NVMe-oF RDMA transport: the host never posts RDMA READ/WRITE itself).
//!
//! Command slot `i` uses CID `i`, capsule `i` and data slot `i`; a slot is free again once both
//! its SEND completed and its response arrived.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::collections::VecDeque;
use std::ptr::NonNull;
use std::time::Duration;

use rdma_mummy_sys::{ibv_ack_cq_events, ibv_get_cq_event, ibv_req_notify_cq};
use sideway::ibverbs::completion::PollCompletionQueueError;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, PostSendGuard, QueuePair, SetScatterGatherEntry, WorkRequestFlags,
};
use tokio::io::unix::AsyncFd;

use super::cm::{ev, CmId};
use super::device::{HwCq, HwDevice, HwMr};
use super::{map, watch, BorrowedRawFd, HwError};
use crate::cm::private::{NvmeCmAccept, NvmeCmRequest};
use crate::hca::{Access, WcOpcode, WcStatus};
use crate::nvme::cqe::Cqe;
use crate::nvme::sgl::SglDescriptor;
use crate::nvme::sqe::Sqe;

const RECV_TAG: u64 = 1 << 63;

/// Page-aligned, zeroed memory that does not move (it is registered with the device).
pub(crate) struct AlignedBuf {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: plain owned memory.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    pub(crate) fn new(len: usize) -> Result<AlignedBuf, HwError> {
        let layout = Layout::from_size_align(len.max(1), 4096)
            .map_err(|e| HwError::Invalid(format!("buffer of {len} bytes: {e}")))?;
        // SAFETY: non-zero size.
        let p = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(p)
            .ok_or_else(|| HwError::Invalid(format!("out of memory ({len} bytes)")))?;
        Ok(AlignedBuf { ptr, layout })
    }
    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    pub(crate) fn len(&self) -> usize {
        self.layout.size()
    }
    pub(crate) fn slice(&self, off: usize, len: usize) -> &[u8] {
        assert!(off + len <= self.len());
        // SAFETY: in bounds; the device writes only into slots we are not handing out.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(off), len) }
    }
    pub(crate) fn slice_mut(&mut self, off: usize, len: usize) -> &mut [u8] {
        assert!(off + len <= self.len());
        // SAFETY: in bounds, exclusive borrow.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(off), len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Free,
    Busy { sent: bool, resp: Option<Cqe> },
}

/// A finished command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Done {
    pub cid: u16,
    pub cqe: Cqe,
}

/// Queue geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueConfig {
    pub qid: u16,
    /// Command slots (host SQ entries); the NVMe-oF request says hsqsize = depth - 1.
    pub depth: u16,
    /// Bytes per data slot (largest transfer of one command).
    pub max_io: u32,
    pub timeout: Duration,
}

pub struct HwQueue {
    // Field order is drop order: the fd watch before the channel, the QP before its CQ, the
    // MRs before their memory.
    cq_fd: AsyncFd<BorrowedRawFd>,
    qp: BasicQueuePair,
    cq: HwCq,
    cmd_mr: HwMr,
    rsp_mr: HwMr,
    data_mr: HwMr,
    cmd: AlignedBuf,
    rsp: AlignedBuf,
    data: AlignedBuf,
    cm: CmId,
    cfg: QueueConfig,
    slots: Vec<Slot>,
    done: VecDeque<Done>,
    unacked: u32,
    crqsize: u16,
    busy: usize,
}

impl HwQueue {
    /// Build the queue on `dev` and connect it through `cm` (already resolved to `dev`).
    pub async fn connect(dev: &HwDevice, cm: CmId, cfg: QueueConfig) -> Result<HwQueue, HwError> {
        if cfg.depth < 2 {
            return Err(HwError::Invalid(format!("queue depth {} < 2", cfg.depth)));
        }
        let depth = usize::from(cfg.depth);
        let cq = dev.create_cq(u32::from(cfg.depth) * 2 + 2)?;
        let mut qp = dev.create_rc_qp(&cq, u32::from(cfg.depth), u32::from(cfg.depth))?;
        cm.modify_qp(&mut qp, 1)?;
        let cmd = AlignedBuf::new(depth * Sqe::LEN)?;
        let rsp = AlignedBuf::new(depth * Cqe::LEN)?;
        let data = AlignedBuf::new(depth * cfg.max_io as usize)?;
        // SAFETY: the buffers live in the same struct as their MRs and are dropped after them.
        let (cmd_mr, rsp_mr, data_mr) = unsafe {
            (
                dev.reg_mr(cmd.as_ptr(), cmd.len(), Access::empty())?,
                dev.reg_mr(rsp.as_ptr(), rsp.len(), Access::LOCAL_WRITE)?,
                dev.reg_mr(
                    data.as_ptr(),
                    data.len(),
                    Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE,
                )?,
            )
        };
        let fd = std::os::fd::AsRawFd::as_raw_fd(cq.chan.as_ref());
        // SAFETY: the channel lives in `cq`, which is dropped after `cq_fd`.
        let cq_fd = unsafe { watch(fd)? };
        let mut q = HwQueue {
            qp,
            cq,
            cmd_mr,
            rsp_mr,
            data_mr,
            cmd,
            rsp,
            data,
            cq_fd,
            cm,
            cfg,
            slots: vec![Slot::Free; depth],
            done: VecDeque::with_capacity(depth),
            unacked: 0,
            crqsize: 0,
            busy: 0,
        };
        for i in 0..cfg.depth {
            q.post_recv(i)?;
        }
        q.arm()?;
        let req = NvmeCmRequest {
            qid: cfg.qid,
            hrqsize: cfg.depth,
            hsqsize: cfg.depth - 1,
            cntlid: 0,
        }
        .emit();
        let rd_atom = dev.max_qp_rd_atom()?.clamp(1, 16);
        let accept = q.cm.connect(&mut q.qp, &req, rd_atom, cfg.timeout).await?;
        q.crqsize = NvmeCmAccept::parse(&accept)
            .map_err(|e| HwError::PrivateData(e.to_string()))?
            .crqsize;
        Ok(q)
    }

    pub fn qid(&self) -> u16 {
        self.cfg.qid
    }
    pub fn depth(&self) -> u16 {
        self.cfg.depth
    }
    pub fn max_io(&self) -> u32 {
        self.cfg.max_io
    }
    /// The controller's receive queue size from the accept.
    pub fn crqsize(&self) -> u16 {
        self.crqsize
    }
    /// Commands submitted and not yet handed back by [`HwQueue::take`].
    pub fn busy(&self) -> usize {
        self.busy
    }
    pub fn qp_num(&self) -> u32 {
        self.qp.qp_number()
    }

    /// A free slot (CID), if any.
    pub fn free_slot(&self) -> Option<u16> {
        self.slots
            .iter()
            .position(|s| *s == Slot::Free)
            .map(|i| i as u16)
    }

    fn check_slot(&self, cid: u16) -> Result<usize, HwError> {
        let i = usize::from(cid);
        if i >= self.slots.len() {
            return Err(HwError::Invalid(format!(
                "cid {cid} >= depth {}",
                self.slots.len()
            )));
        }
        Ok(i)
    }

    /// The data slot of `cid` (read it after a read completes).
    pub fn data(&self, cid: u16, len: usize) -> &[u8] {
        let len = len.min(self.cfg.max_io as usize);
        self.data
            .slice(usize::from(cid) * self.cfg.max_io as usize, len)
    }

    /// The data slot of `cid`, to fill before submitting a write. Only for a free slot.
    pub fn data_mut(&mut self, cid: u16, len: usize) -> &mut [u8] {
        let len = len.min(self.cfg.max_io as usize);
        let off = usize::from(cid) * self.cfg.max_io as usize;
        self.data.slice_mut(off, len)
    }

    /// Send `sqe` in slot `cid` (its CID is overwritten); with `data_len > 0` the command gets
    /// a keyed SGL for that many bytes of the slot's data buffer.
    pub fn submit(&mut self, mut sqe: Sqe, cid: u16, data_len: u32) -> Result<(), HwError> {
        let i = self.check_slot(cid)?;
        if self.slots[i] != Slot::Free {
            return Err(HwError::Invalid(format!("slot {cid} is busy")));
        }
        if data_len > self.cfg.max_io {
            return Err(HwError::Invalid(format!(
                "{data_len} bytes > max_io {}",
                self.cfg.max_io
            )));
        }
        sqe.cid = cid;
        let sgl = if data_len == 0 {
            SglDescriptor::NULL
        } else {
            let addr = self.data.as_ptr() as u64 + (i as u64) * u64::from(self.cfg.max_io);
            SglDescriptor::keyed(addr, u64::from(data_len), self.data_mr.rkey().0, false)?
        };
        sqe.set_sgl(&sgl)?;
        let mut bytes = [0u8; 64];
        sqe.emit(&mut bytes);
        self.cmd
            .slice_mut(i * Sqe::LEN, Sqe::LEN)
            .copy_from_slice(&bytes);
        let addr = self.cmd.as_ptr() as u64 + (i * Sqe::LEN) as u64;
        let lkey = self.cmd_mr.lkey().0;
        let mut g = self.qp.start_post_send();
        let wr = g.construct_wr(u64::from(cid), WorkRequestFlags::Signaled);
        // SAFETY: the capsule stays put until the SEND completes (slot is busy until then).
        unsafe { wr.setup_send().setup_sge(lkey, addr, Sqe::LEN as u32) };
        g.post().map_err(|e| HwError::sideway("ibv_post_send", e))?;
        self.slots[i] = Slot::Busy {
            sent: false,
            resp: None,
        };
        self.busy += 1;
        Ok(())
    }

    fn post_recv(&mut self, idx: u16) -> Result<(), HwError> {
        let addr = self.rsp.as_ptr() as u64 + u64::from(idx) * Cqe::LEN as u64;
        let lkey = self.rsp_mr.lkey().0;
        let mut g = self.qp.start_post_recv();
        let wr = g.construct_wr(RECV_TAG | u64::from(idx));
        // SAFETY: response slot memory is registered and owned by self.
        unsafe { wr.setup_sge(lkey, addr, Cqe::LEN as u32) };
        g.post().map_err(|e| HwError::sideway("ibv_post_recv", e))
    }

    fn arm(&mut self) -> Result<(), HwError> {
        // SAFETY: live CQ.
        let ret = unsafe { ibv_req_notify_cq(self.cq.raw_cq(), 0) };
        if ret != 0 {
            return Err(HwError::errno("ibv_req_notify_cq", ret));
        }
        Ok(())
    }

    /// Reap work completions without waiting; returns how many commands finished.
    pub fn poll(&mut self) -> Result<usize, HwError> {
        let before = self.done.len();
        let mut wcs = Vec::new();
        match self.cq.cq.start_poll() {
            Ok(p) => {
                for wc in p {
                    wcs.push((
                        wc.wr_id(),
                        wc.status(),
                        wc.opcode(),
                        wc.byte_len(),
                        wc.vendor_err(),
                    ));
                }
            }
            Err(PollCompletionQueueError::CompletionQueueEmpty) => {}
            Err(e) => return Err(HwError::sideway("ibv_poll_cq", e)),
        }
        for (wr_id, status, opcode, byte_len, vendor_err) in wcs {
            let st = map::wc_status(status);
            if st != WcStatus::Success {
                return Err(HwError::Completion {
                    status: st,
                    opcode: map::wc_opcode(opcode),
                    wr_id,
                    vendor_err,
                });
            }
            if wr_id & RECV_TAG != 0 {
                let idx = (wr_id & 0xFFFF) as u16;
                if usize::from(idx) >= self.slots.len() || byte_len < Cqe::LEN as u32 {
                    return Err(HwError::Invalid(format!(
                        "receive {idx} of {byte_len} bytes"
                    )));
                }
                let cqe = Cqe::parse(self.rsp.slice(usize::from(idx) * Cqe::LEN, Cqe::LEN))?;
                self.post_recv(idx)?;
                let i = usize::from(cqe.cid);
                match self.slots.get_mut(i) {
                    Some(Slot::Busy { resp, .. }) if resp.is_none() => *resp = Some(cqe),
                    _ => return Err(HwError::StrayCompletion(cqe.cid)),
                }
                self.finish(i);
            } else {
                if map::wc_opcode(opcode) != Some(WcOpcode::Send) {
                    return Err(HwError::Invalid(format!(
                        "unexpected send-side opcode {opcode}"
                    )));
                }
                let i = (wr_id & 0xFFFF) as usize;
                match self.slots.get_mut(i) {
                    Some(Slot::Busy { sent, .. }) if !*sent => *sent = true,
                    _ => return Err(HwError::Invalid(format!("stray send completion {wr_id}"))),
                }
                self.finish(i);
            }
        }
        Ok(self.done.len() - before)
    }

    fn finish(&mut self, i: usize) {
        if let Slot::Busy {
            sent: true,
            resp: Some(cqe),
        } = self.slots[i]
        {
            self.slots[i] = Slot::Free;
            self.done.push_back(Done { cid: i as u16, cqe });
        }
    }

    /// A finished command, if any (the slot is free again).
    pub fn take(&mut self) -> Option<Done> {
        let d = self.done.pop_front()?;
        self.busy -= 1;
        Some(d)
    }

    /// Wait until at least one command has finished (then [`HwQueue::take`] it). Fails on a
    /// work-completion error or when rdma_cm reports the connection gone.
    pub async fn wait(&mut self) -> Result<(), HwError> {
        loop {
            if !self.done.is_empty() || self.poll()? > 0 {
                return Ok(());
            }
            self.arm()?;
            if self.poll()? > 0 {
                return Ok(());
            }
            tokio::select! {
                g = self.cq_fd.readable() => {
                    let mut g = g?;
                    loop {
                        let mut cq = std::ptr::null_mut();
                        let mut ctx = std::ptr::null_mut();
                        // SAFETY: non-blocking channel owned by self.cq.
                        let ret = unsafe { ibv_get_cq_event(self.cq.raw_channel(), &mut cq, &mut ctx) };
                        if ret != 0 {
                            break;
                        }
                        self.unacked += 1;
                    }
                    g.clear_ready();
                    if self.unacked >= 64 {
                        // SAFETY: acking events we got from this CQ.
                        unsafe { ibv_ack_cq_events(self.cq.raw_cq(), self.unacked) };
                        self.unacked = 0;
                    }
                }
                e = self.cm.event(Duration::from_secs(3600), "connection event") => {
                    let e = e?;
                    if matches!(e.kind, ev::DISCONNECTED | ev::DEVICE_REMOVAL) {
                        // The target drops its queues when the device goes, so DISCONNECTED
                        // often comes first; a DEVICE_REMOVAL right behind it says why.
                        let mut device_removed = e.kind == ev::DEVICE_REMOVAL;
                        if !device_removed {
                            // bounded: a plain disconnect costs this much extra, once
                            if let Ok(more) = self.cm.event(Duration::from_millis(250), "DEVICE_REMOVAL").await {
                                device_removed = more.kind == ev::DEVICE_REMOVAL;
                            }
                        }
                        return Err(HwError::ConnectionLost { event: e.name(), device_removed });
                    }
                }
            }
        }
    }

    /// Submit and wait for one command (for admin use: the queue must be otherwise idle).
    pub async fn exec(
        &mut self,
        sqe: Sqe,
        data_len: u32,
        timeout: Duration,
    ) -> Result<Cqe, HwError> {
        let cid = self
            .free_slot()
            .ok_or_else(|| HwError::Invalid("queue full".into()))?;
        self.submit(sqe, cid, data_len)?;
        let r = tokio::time::timeout(timeout, async {
            loop {
                self.wait().await?;
                while let Some(d) = self.take() {
                    if d.cid == cid {
                        return Ok::<_, HwError>(d.cqe);
                    }
                }
            }
        })
        .await;
        r.map_err(|_| HwError::Timeout("NVMe command"))?
    }

    /// Send a DREQ; the target tears its queue down.
    pub fn disconnect(&self) -> Result<(), HwError> {
        self.cm.disconnect()
    }
}

impl Drop for HwQueue {
    fn drop(&mut self) {
        if self.unacked > 0 {
            // SAFETY: unacked events of this CQ must be acked before it is destroyed.
            unsafe { ibv_ack_cq_events(self.cq.raw_cq(), self.unacked) };
        }
    }
}

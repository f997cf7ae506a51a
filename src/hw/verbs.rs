//! [`Verbs`] on a kernel RDMA device: QPs and CQs of one [`HwDevice`] addressed by our
//! [`Qpn`] / [`CqId`], work requests translated from [`SendWr`] / [`RecvWr`], completions into
//! [`WorkCompletion`]. [`HwLoopPair`] connects two of its QPs to each other by hand (GID +
//! QPN, as `ibv_rc_pingpong` does) so that [`conformance`](crate::hca::verbs::conformance) can
//! run on real hardware or rxe.

use std::collections::HashMap;
use std::mem::MaybeUninit;
use std::path::Path;
use std::time::Duration;

use rdma_mummy_sys::{ibv_poll_cq, ibv_sge, ibv_wc};
use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::device_context::Mtu;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, PostSendGuard, QueuePair, QueuePairAttribute, QueuePairState,
    SetScatterGatherEntry, WorkRequestFlags,
};
use sideway::ibverbs::AccessFlags;

use super::backend::HwMem;
use super::device::{HwCq, HwDevice, HwMr};
use super::events::AsyncEvents;
use super::map::{self, HwEvent};
use super::HwError;
use crate::hca::qp::MAX_SGE;
use crate::hca::verbs::{EndInfo, Verbs, VerbsPair};
use crate::hca::{
    Access, AsyncEvent, CqId, Instant, MemKey, Qpn, RecvWr, SendOp, SendWr, Sgl, WcOpcode,
    WcStatus, WorkCompletion,
};
use crate::verbs::HostBuffer;

const IBV_WC_WITH_IMM: u32 = 2;
const IBV_WC_WITH_INV: u32 = 4;

/// QPs and CQs of one device behind the [`Verbs`] trait.
pub struct HwVerbs {
    // QPs before the CQs they use.
    qps: HashMap<u32, BasicQueuePair>,
    cqs: HashMap<u32, HwCq>,
    /// Opcode of each signaled send / each receive still outstanding, for error completions
    /// (ibverbs leaves `opcode` undefined when the status is not success).
    posted: HashMap<(u32, u64), WcOpcode>,
    events: Option<AsyncEvents>,
    next_cq: u32,
    pub dev: HwDevice,
}

impl HwVerbs {
    pub fn new(dev: HwDevice) -> HwVerbs {
        HwVerbs {
            qps: HashMap::new(),
            cqs: HashMap::new(),
            posted: HashMap::new(),
            events: None,
            next_cq: 1,
            dev,
        }
    }

    /// Watch the device's async events (needs a tokio runtime with I/O); until then
    /// [`Verbs::poll_event`] reports nothing.
    pub fn watch_events(&mut self) -> Result<(), HwError> {
        self.events = Some(AsyncEvents::new(&self.dev)?);
        Ok(())
    }

    pub fn create_cq(&mut self, cqe: u32) -> Result<CqId, HwError> {
        let cq = self.dev.create_cq(cqe)?;
        let id = CqId(self.next_cq);
        self.next_cq += 1;
        self.cqs.insert(id.0, cq);
        Ok(id)
    }

    /// An RC QP in RESET on `cq` (send and receive).
    pub fn create_rc_qp(&mut self, cq: CqId, max_wr: u32) -> Result<Qpn, HwError> {
        let c = self
            .cqs
            .get(&cq.0)
            .ok_or_else(|| HwError::Invalid(format!("no CQ {}", cq.0)))?;
        let qp = self.dev.create_rc_qp_sge(c, max_wr, max_wr, 4)?;
        let n = qp.qp_number();
        self.qps.insert(n, qp);
        Ok(Qpn::new(n))
    }

    fn qp(&mut self, qpn: Qpn) -> Result<&mut BasicQueuePair, HwError> {
        self.qps
            .get_mut(&qpn.get())
            .ok_or_else(|| HwError::Invalid(format!("no QP {qpn}")))
    }

    /// Bring `qpn` to RTS towards `remote` (QPN) at `gid` through port 1, GID index `sgid`.
    pub fn connect_rc(
        &mut self,
        qpn: Qpn,
        remote: Qpn,
        gid: [u8; 16],
        sgid: u8,
    ) -> Result<(), HwError> {
        let qp = self.qp(qpn)?;
        let mut a = QueuePairAttribute::new();
        a.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(1)
            .setup_access_flags(
                AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead,
            );
        qp.modify(&a)
            .map_err(|e| HwError::sideway("modify QP to INIT", e))?;
        let mut a = QueuePairAttribute::new();
        a.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(Mtu::Mtu1024)
            .setup_dest_qp_num(remote.get())
            .setup_rq_psn(0)
            .setup_max_dest_read_atomic(4)
            .setup_min_rnr_timer(12);
        let mut ah = AddressHandleAttribute::new();
        ah.setup_dest_lid(0)
            .setup_port(1)
            .setup_service_level(0)
            .setup_grh_src_gid_index(sgid)
            .setup_grh_dest_gid(&Gid { raw: gid })
            .setup_grh_hop_limit(1);
        a.setup_address_vector(&ah);
        qp.modify(&a)
            .map_err(|e| HwError::sideway("modify QP to RTR", e))?;
        let mut a = QueuePairAttribute::new();
        a.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(0)
            .setup_timeout(14)
            .setup_retry_cnt(7)
            .setup_rnr_retry(7)
            .setup_max_read_atomic(4);
        qp.modify(&a)
            .map_err(|e| HwError::sideway("modify QP to RTS", e))
    }
}

/// The SGEs of `sgl` as ibverbs wants them, on the stack.
fn sges(sgl: &Sgl) -> ([ibv_sge; MAX_SGE], usize) {
    let mut out = [ibv_sge {
        addr: 0,
        length: 0,
        lkey: 0,
    }; MAX_SGE];
    let e = sgl.entries();
    for (o, s) in out.iter_mut().zip(e) {
        *o = ibv_sge {
            addr: s.addr,
            length: s.len,
            lkey: s.lkey.0,
        };
    }
    (out, e.len())
}

fn send_opcode(op: SendOp) -> WcOpcode {
    match op {
        SendOp::Send | SendOp::SendWithImm(_) | SendOp::SendWithInv(_) => WcOpcode::Send,
        SendOp::Write { .. } | SendOp::WriteWithImm { .. } => WcOpcode::RdmaWrite,
        SendOp::Read { .. } => WcOpcode::RdmaRead,
    }
}

/// Post one send work request on `qp`. Shared by [`HwVerbs`] and the backend of the seam.
pub(crate) fn post_send_wr(qp: &mut BasicQueuePair, wr: &SendWr) -> Result<(), HwError> {
    if let SendOp::SendWithInv(_) = wr.op {
        // sideway 0.4.3's legacy post path has no SEND_WITH_INV setter.
        return Err(HwError::Invalid(
            "SEND with invalidate is not supported".into(),
        ));
    }
    let (list, n) = sges(&wr.sgl);
    let mut flags = WorkRequestFlags::none();
    if wr.signaled {
        flags |= WorkRequestFlags::Signaled;
    }
    if wr.solicited {
        flags |= WorkRequestFlags::Solicited;
    }
    let mut g = qp.start_post_send();
    let h = g.construct_wr(wr.wr_id, flags);
    // ibverbs carries immediates in network byte order.
    let local = match wr.op {
        SendOp::Send | SendOp::SendWithInv(_) => h.setup_send(),
        SendOp::SendWithImm(imm) => h.setup_send_imm(imm.to_be()),
        SendOp::Write { remote_addr, rkey } => h.setup_write(rkey.0, remote_addr),
        SendOp::WriteWithImm {
            remote_addr,
            rkey,
            imm,
        } => h.setup_write_imm(rkey.0, remote_addr, imm.to_be()),
        SendOp::Read { remote_addr, rkey } => h.setup_read(rkey.0, remote_addr),
    };
    // SAFETY: the SGEs name registered memory the caller keeps alive until completion.
    unsafe { local.setup_sge_list(&list[..n]) };
    g.post().map_err(|e| HwError::sideway("ibv_post_send", e))
}

/// Post one receive work request on `qp`.
pub(crate) fn post_recv_wr(qp: &mut BasicQueuePair, wr: &RecvWr) -> Result<(), HwError> {
    let (list, n) = sges(&wr.sgl);
    let mut g = qp.start_post_recv();
    let h = g.construct_wr(wr.wr_id);
    // SAFETY: as for sends.
    unsafe { h.setup_sge_list(&list[..n]) };
    g.post().map_err(|e| HwError::sideway("ibv_post_recv", e))
}

/// Move up to `max` (at most 32 per call) completions of `cq` into `out`. ibverbs leaves the
/// opcode of a failed completion undefined: `failed_op` names it from the QP and wr_id.
///
/// # Safety
/// `cq` must be a live CQ.
pub(crate) unsafe fn poll_raw(
    cq: *mut rdma_mummy_sys::ibv_cq,
    max: usize,
    out: &mut Vec<WorkCompletion>,
    mut failed_op: impl FnMut(u32, u64) -> WcOpcode,
) -> Result<usize, HwError> {
    const BATCH: usize = 32;
    let mut wcs = [const { MaybeUninit::<ibv_wc>::uninit() }; BATCH];
    let n = max.min(BATCH);
    // SAFETY: the CQ is live (caller); at most `n` entries are written.
    let got = unsafe { ibv_poll_cq(cq, n as i32, wcs.as_mut_ptr().cast()) };
    if got < 0 {
        return Err(HwError::errno("ibv_poll_cq", got));
    }
    for w in &wcs[..got as usize] {
        // SAFETY: ibv_poll_cq initialised the first `got` entries.
        let wc = unsafe { w.assume_init_ref() };
        let status = map::wc_status(wc.status);
        let opcode = if status == WcStatus::Success {
            map::wc_opcode(wc.opcode)
                .ok_or_else(|| HwError::Invalid(format!("completion with opcode {}", wc.opcode)))?
        } else {
            failed_op(wc.qp_num, wc.wr_id)
        };
        // SAFETY: plain union of two u32s.
        let raw = unsafe { wc.imm_data_invalidated_rkey_union.imm_data };
        out.push(WorkCompletion {
            wr_id: wc.wr_id,
            status,
            opcode,
            qpn: Qpn::new(wc.qp_num),
            byte_len: wc.byte_len,
            imm: (wc.wc_flags & IBV_WC_WITH_IMM != 0).then(|| u32::from_be(raw)),
            invalidated: (wc.wc_flags & IBV_WC_WITH_INV != 0).then_some(MemKey(raw)),
        });
    }
    Ok(got as usize)
}

impl Verbs for HwVerbs {
    type Error = HwError;

    fn post_send(&mut self, _now: Instant, qpn: Qpn, wr: SendWr) -> Result<(), HwError> {
        post_send_wr(self.qp(qpn)?, &wr)?;
        if wr.signaled {
            self.posted
                .insert((qpn.get(), wr.wr_id), send_opcode(wr.op));
        }
        Ok(())
    }

    fn post_recv(&mut self, qpn: Qpn, wr: RecvWr) -> Result<(), HwError> {
        post_recv_wr(self.qp(qpn)?, &wr)?;
        self.posted.insert((qpn.get(), wr.wr_id), WcOpcode::Recv);
        Ok(())
    }

    fn poll_cq(
        &mut self,
        cq: CqId,
        max: usize,
        out: &mut Vec<WorkCompletion>,
    ) -> Result<usize, HwError> {
        let c = self
            .cqs
            .get(&cq.0)
            .ok_or_else(|| HwError::Invalid(format!("no CQ {}", cq.0)))?;
        let posted = &mut self.posted;
        let start = out.len();
        // SAFETY: the CQ is live while `self.cqs` holds it.
        let n = unsafe {
            poll_raw(c.raw_cq(), max.min(64), out, |qpn, wr_id| {
                // unsignaled sends are not recorded: their failures read as Send
                posted.remove(&(qpn, wr_id)).unwrap_or(WcOpcode::Send)
            })?
        };
        for wc in &out[start..] {
            if wc.status == WcStatus::Success {
                posted.remove(&(wc.qpn.get(), wc.wr_id));
            }
        }
        Ok(n)
    }

    fn poll_event(&mut self) -> Option<AsyncEvent> {
        let ev = self.events.as_ref()?;
        loop {
            match ev.try_next() {
                Ok(Some(HwEvent::Known(e))) => return Some(e),
                Ok(Some(HwEvent::Other(_))) => continue,
                Ok(None) | Err(_) => return None,
            }
        }
    }
}

/// The GID index of the first RoCE v2 GID holding an IPv4-mapped address on port 1 of
/// `ibdev`, from sysfs under `sysfs` (ibverbs' own GID-type query panics in sideway on types
/// it does not know, so sysfs is read instead).
pub fn roce_v2_ipv4_gid(sysfs: &Path, ibdev: &str) -> Option<(u8, [u8; 16])> {
    let port = sysfs.join("class/infiniband").join(ibdev).join("ports/1");
    (0u8..=254).find_map(|i| {
        let ty = std::fs::read_to_string(port.join(format!("gid_attrs/types/{i}"))).ok()?;
        if ty.trim() != "RoCE v2" {
            return None;
        }
        let g = std::fs::read_to_string(port.join(format!("gids/{i}"))).ok()?;
        let ip: std::net::Ipv6Addr = g.trim().parse().ok()?;
        ip.to_ipv4_mapped().map(|_| (i, ip.octets()))
    })
}

/// Two RC QPs of one device connected to each other, each with a 128 KiB buffer.
pub struct HwLoopPair {
    ends: [EndInfo; 2],
    // MRs before the memory they register.
    _mrs: Vec<HwMr>,
    bufs: [HwMem; 2],
    pub v: HwVerbs,
    deadline: std::time::Instant,
}

impl HwLoopPair {
    pub fn new(dev: HwDevice) -> Result<HwLoopPair, HwError> {
        let (sgid, gid) =
            roce_v2_ipv4_gid(Path::new("/sys"), &dev.info().name).ok_or_else(|| {
                HwError::NoSuchDevice(format!("{}: no RoCE v2 IPv4 GID", dev.info().name))
            })?;
        let mut v = HwVerbs::new(dev);
        let len = 128 * 1024;
        let bufs = [HwMem::alloc(len), HwMem::alloc(len)];
        let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
        let mut mrs = Vec::new();
        let mut ends = Vec::new();
        for b in &bufs {
            // SAFETY: `bufs` lives in the pair next to `_mrs`, which is dropped first.
            let mr = unsafe { v.dev.reg_mr(b.as_mut_ptr(), len, all)? };
            let cq = v.create_cq(64)?;
            let qpn = v.create_rc_qp(cq, 32)?;
            ends.push(EndInfo {
                qpn,
                cq,
                addr: b.as_mut_ptr() as u64,
                len,
                lkey: mr.lkey(),
                rkey: mr.rkey(),
            });
            mrs.push(mr);
        }
        let ends = [ends[0], ends[1]];
        v.connect_rc(ends[0].qpn, ends[1].qpn, gid, sgid)?;
        v.connect_rc(ends[1].qpn, ends[0].qpn, gid, sgid)?;
        Ok(HwLoopPair {
            ends,
            _mrs: mrs,
            bufs,
            v,
            deadline: std::time::Instant::now() + Duration::from_secs(30),
        })
    }
}

impl VerbsPair for HwLoopPair {
    type V = HwVerbs;
    fn end(&self, side: usize) -> EndInfo {
        self.ends[side.min(1)]
    }
    fn dev(&mut self, _side: usize) -> &mut HwVerbs {
        &mut self.v
    }
    fn now(&self) -> Instant {
        Instant::ZERO
    }
    fn write_buf(&mut self, side: usize, off: usize, data: &[u8]) {
        self.bufs[side.min(1)].write(off, data);
    }
    fn read_buf(&mut self, side: usize, off: usize, len: usize) -> Vec<u8> {
        let mut out = vec![0; len];
        self.bufs[side.min(1)].read(off, &mut out);
        out
    }
    fn progress(&mut self) -> bool {
        std::thread::sleep(Duration::from_micros(200));
        std::time::Instant::now() < self.deadline
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_roce_v2_ipv4_gid_in_sysfs() {
        let root = std::env::temp_dir().join(format!("nvmf-hw-gid-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let port = root.join("class/infiniband/rxe0/ports/1");
        std::fs::create_dir_all(port.join("gid_attrs/types")).unwrap();
        std::fs::create_dir_all(port.join("gids")).unwrap();
        let put = |i: u8, ty: &str, gid: &str| {
            std::fs::write(port.join(format!("gid_attrs/types/{i}")), format!("{ty}\n")).unwrap();
            std::fs::write(port.join(format!("gids/{i}")), format!("{gid}\n")).unwrap();
        };
        put(0, "RoCE v2", "fe80:0000:0000:0000:5054:00ff:fe12:3456");
        put(1, "IB/RoCE v1", "0000:0000:0000:0000:0000:ffff:0a00:020f");
        put(2, "RoCE v2", "0000:0000:0000:0000:0000:ffff:0a00:020f");
        let (i, gid) = roce_v2_ipv4_gid(&root, "rxe0").unwrap();
        assert_eq!(i, 2);
        assert_eq!(&gid[12..], &[10, 0, 2, 15]);
        assert_eq!(roce_v2_ipv4_gid(&root, "mlx5_0"), None);
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn send_ops_map_to_completion_opcodes() {
        assert_eq!(send_opcode(SendOp::Send), WcOpcode::Send);
        assert_eq!(send_opcode(SendOp::SendWithImm(1)), WcOpcode::Send);
        let w = SendOp::Write {
            remote_addr: 0,
            rkey: MemKey(1),
        };
        assert_eq!(send_opcode(w), WcOpcode::RdmaWrite);
        let r = SendOp::Read {
            remote_addr: 0,
            rkey: MemKey(1),
        };
        assert_eq!(send_opcode(r), WcOpcode::RdmaRead);
        let s = sges(&Sgl::one(0x1000, 64, MemKey(7)));
        assert_eq!(
            (s.1, s.0[0].addr, s.0[0].length, s.0[0].lkey),
            (1, 0x1000, 64, 7)
        );
    }
}

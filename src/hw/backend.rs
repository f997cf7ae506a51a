//! A kernel RDMA device's context as the backend seam's [`DeviceContext`]: PD, MRs, CQs and
//! RC QPs through sideway, completions through each CQ's completion channel, QPs brought to
//! RTS on the path rdma_cm gave them.

use std::sync::atomic::AtomicU32;
use std::sync::Arc;

use rdma_mummy_sys::{ibv_ack_cq_events, ibv_get_cq_event, ibv_req_notify_cq};
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, QueuePair, QueuePairAttribute, QueuePairState, QueuePairType,
};

use super::cm_port::HwCm;
use super::context::{verr, CqEntry, HwContext, QpEntry};
use super::device::access_flags;
use super::map::{ib_mtu, mtu_of};
use super::mem::HwMem;
use super::wr::{poll_raw, post_recv_wr, post_send_wr};
use super::{watch, HwError};
use crate::harness::alloc_audit;
use crate::verbs::{
    Access, CqId, DeviceContext, HostBuffer, Identity, Lifecycle, MemKey, MrInfo, PdId, PeerInfo,
    Psn, QpCaps, Qpn, RcAttr, RecvWr, SendWr, VerbsError, WcOpcode, WorkCompletion,
};

impl DeviceContext for HwContext {
    type Mem = HwMem;
    type Cm = HwCm;

    fn identity(&self) -> Identity {
        self.ctx.identity
    }

    fn lifecycle(&self) -> Lifecycle {
        self.ctx.lifecycle()
    }

    fn same(&self, other: &HwContext) -> bool {
        Arc::ptr_eq(&self.ctx, &other.ctx)
    }

    fn alloc_pd(&self) -> Result<PdId, VerbsError> {
        self.with(|r| {
            let pd = r
                .dev
                .context()
                .alloc_pd()
                .map_err(|e| verr("ibv_alloc_pd", HwError::sideway("ibv_alloc_pd", e)))?;
            let id = r.next_pd;
            r.next_pd += 1;
            r.pds.insert(id, pd);
            Ok(PdId(id))
        })
    }

    fn dealloc_pd(&self, pd: PdId) {
        self.release(|r| {
            r.pds.remove(&pd.0);
        })
    }

    fn reg_mr(
        &self,
        pd: PdId,
        mem: &HwMem,
        offset: usize,
        len: usize,
        access: Access,
    ) -> Result<MrInfo, VerbsError> {
        if offset.checked_add(len).is_none_or(|end| end > mem.len()) {
            return Err(VerbsError::InvalidArgument("MR past the end of its buffer"));
        }
        self.with(|r| {
            let p = r.pds.get(&pd.0).ok_or(VerbsError::InvalidHandle("PD"))?;
            let addr = mem.addr() + offset as u64;
            // SAFETY: the host keeps `mem` (allocated, not moving) until it deregisters.
            let mr = unsafe { p.reg_mr(addr as usize, len, access_flags(access)) }
                .map_err(|e| verr("ibv_reg_mr", HwError::sideway("ibv_reg_mr", e)))?;
            let info = MrInfo {
                lkey: MemKey(mr.lkey()),
                rkey: if access.intersects(Access::REMOTE_READ | Access::REMOTE_WRITE) {
                    MemKey(mr.rkey())
                } else {
                    MemKey(0)
                },
                addr,
                len: len as u64,
                access,
            };
            r.mrs.insert(mr.lkey(), mr);
            Ok(info)
        })
    }

    fn dereg_mr(&self, mr: &MrInfo) {
        self.release(|r| {
            r.mrs.remove(&mr.lkey.0);
        })
    }

    /// User-space verbs have no fast registration (IB_WR_REG_MR is a kernel verb); memory
    /// windows of type 2 would be the way, and sideway does not bind them yet. So a region
    /// keeps its key for the life of the connection here, as with Linux nvme-rdma's
    /// `register_always=N`.
    fn per_use_keys(&self) -> bool {
        false
    }

    /// sideway 0.4.3's post path has no SEND_WITH_INV setter (see `post_send_wr`).
    fn send_with_invalidate(&self) -> bool {
        false
    }

    fn rekey_mr(&self, _mr: &mut MrInfo, _len: usize, _access: Access) -> Result<(), VerbsError> {
        Ok(())
    }

    fn invalidate_mr(&self, _mr: &MrInfo) {}

    fn create_cq(&self, depth: usize) -> Result<CqId, VerbsError> {
        self.with(|r| {
            let cqe = u32::try_from(depth).map_err(|_| VerbsError::InvalidArgument("CQ depth"))?;
            let cq = r.dev.create_cq(cqe).map_err(|e| verr("ibv_create_cq", e))?;
            // SAFETY: the channel's fd lives as long as `cq`, which the entry drops after it.
            let afd = unsafe { watch((*cq.raw_channel()).fd) }
                .map_err(|e| verr("watch CQ channel", e.into()))?;
            let id = r.next_cq;
            r.next_cq += 1;
            r.cqs.insert(
                id,
                Arc::new(CqEntry {
                    afd,
                    cq,
                    unacked: AtomicU32::new(0),
                }),
            );
            Ok(CqId(id))
        })
    }

    fn destroy_cq(&self, cq: CqId) {
        self.release(|r| {
            r.cqs.remove(&cq.0);
        })
    }

    fn create_rc_qp(
        &self,
        pd: PdId,
        cq: CqId,
        caps: QpCaps,
        access: Access,
    ) -> Result<Qpn, VerbsError> {
        self.with(|r| {
            let p = r
                .pds
                .get(&pd.0)
                .ok_or(VerbsError::InvalidHandle("PD"))?
                .clone();
            let c = r.cqs.get(&cq.0).ok_or(VerbsError::InvalidHandle("CQ"))?;
            let mut qp = p
                .create_qp_builder()
                .setup_qp_type(QueuePairType::ReliableConnection)
                .setup_max_send_wr(caps.max_send_wr)
                .setup_max_recv_wr(caps.max_recv_wr)
                .setup_max_send_sge(crate::verbs::MAX_SGE as u32)
                .setup_max_recv_sge(crate::verbs::MAX_SGE as u32)
                .setup_max_inline_data(0)
                .setup_send_cq(c.cq.cq.clone())
                .setup_recv_cq(c.cq.cq.clone())
                .build()
                .map_err(|e| verr("ibv_create_qp", HwError::sideway("ibv_create_qp", e)))?;
            // INIT on port 1 (what rdma_cm picks on the single-port devices we support; the
            // connect checks it); the CM's own INIT attributes are applied again at RTR.
            let mut a = QueuePairAttribute::new();
            a.setup_state(QueuePairState::Init)
                .setup_pkey_index(0)
                .setup_port(1)
                .setup_access_flags(access_flags(access));
            qp.modify(&a)
                .map_err(|e| verr("modify QP to INIT", HwError::sideway("ibv_modify_qp", e)))?;
            let n = qp.qp_number();
            r.qps.insert(n, QpEntry { qp, pending: None });
            Ok(Qpn::new(n))
        })
    }

    fn rc_to_rts(
        &self,
        qpn: Qpn,
        peer: PeerInfo,
        _local_psn: Psn,
        attr: &RcAttr,
    ) -> Result<(), VerbsError> {
        let conn = self.with(|r| {
            let e = r
                .qps
                .get_mut(&qpn.get())
                .ok_or(VerbsError::InvalidHandle("QP"))?;
            let p = e
                .pending
                .take()
                .ok_or(VerbsError::InvalidArgument("QP has no rdma_cm connection"))?;
            let [init, rtr, rts] = p.path;
            if rtr.0.dest_qp_num != peer.qpn.get() {
                return Err(VerbsError::InvalidArgument(
                    "peer QPN differs from the CM's",
                ));
            }
            let modify = |qp: &mut BasicQueuePair, a: &QueuePairAttribute, what| {
                qp.modify(a)
                    .map_err(|e| verr(what, HwError::sideway("ibv_modify_qp", e)))
            };
            // INIT -> INIT first, as librdmacm's ucma_modify_qp_rtr does: now that the
            // responder resources are agreed the CM grants the remote access the target's
            // RDMA READ/WRITE need.
            let init = QueuePairAttribute::from(&init.0, init.1);
            modify(&mut e.qp, &init, "modify QP to INIT")?;
            let cm_mtu = mtu_of(rtr.0.path_mtu);
            let mut rtr = QueuePairAttribute::from(&rtr.0, rtr.1);
            rtr.setup_path_mtu(ib_mtu(cm_mtu.min(attr.mtu)));
            modify(&mut e.qp, &rtr, "modify QP to RTR")?;
            let mut rts = QueuePairAttribute::from(&rts.0, rts.1);
            rts.setup_timeout(attr.timeout)
                .setup_retry_cnt(attr.retry_cnt)
                .setup_rnr_retry(attr.rnr_retry);
            modify(&mut e.qp, &rts, "modify QP to RTS")?;
            Ok(p.establish)
        })?;
        match conn {
            Some(c) => {
                alloc_audit::platform(|| c.id.establish()).map_err(|e| verr("rdma_establish", e))
            }
            None => Ok(()),
        }
    }

    fn destroy_qp(&self, qpn: Qpn) {
        self.release(|r| {
            r.qps.remove(&qpn.get());
        })
    }

    fn post(
        &self,
        qpn: Qpn,
        recvs: &mut Vec<RecvWr>,
        sends: &mut Vec<SendWr>,
    ) -> Result<(), VerbsError> {
        let out = self.with(|r| {
            let Some(e) = r.qps.get_mut(&qpn.get()) else {
                return Err(VerbsError::InvalidHandle("QP"));
            };
            let mut first = Ok(());
            for wr in recvs.iter() {
                if let Err(err) = post_recv_wr(&mut e.qp, wr) {
                    first = first.and(Err(verr("ibv_post_recv", err)));
                }
            }
            for wr in sends.iter() {
                if let Err(err) = post_send_wr(&mut e.qp, wr) {
                    first = first.and(Err(verr("ibv_post_send", err)));
                }
            }
            first
        });
        recvs.clear();
        sends.clear();
        out
    }

    fn poll_cq(&self, cq: CqId, max: usize, out: &mut Vec<WorkCompletion>) -> usize {
        alloc_audit::platform(|| {
            let Some(e) = self.cq_entry(cq) else { return 0 };
            // SAFETY: `e` keeps the CQ alive.
            unsafe { poll_raw(e.cq.raw_cq(), max, out, |_, _| WcOpcode::Send) }.unwrap_or(0)
        })
    }

    async fn wait_cq(&self, cq: CqId, max: usize, out: &mut Vec<WorkCompletion>) -> usize {
        let Some(e) = alloc_audit::platform(|| self.cq_entry(cq)) else {
            return 0;
        };
        loop {
            let died = self.ctx.died.notified();
            tokio::pin!(died);
            died.as_mut().enable();
            if self.ctx.gone() {
                return 0;
            }
            let poll = |out: &mut Vec<WorkCompletion>| {
                alloc_audit::platform(|| {
                    // SAFETY: `e` keeps the CQ alive.
                    unsafe { poll_raw(e.cq.raw_cq(), max, out, |_, _| WcOpcode::Send) }.unwrap_or(0)
                })
            };
            let n = poll(out);
            if n > 0 {
                return n;
            }
            // Arm, then poll again: a completion that landed in between raises no event.
            // SAFETY: live CQ.
            if unsafe { ibv_req_notify_cq(e.cq.raw_cq(), 0) } != 0 {
                return 0;
            }
            let n = poll(out);
            if n > 0 {
                return n;
            }
            tokio::select! {
                g = e.afd.readable() => {
                    let Ok(mut g) = g else { return 0 };
                    let mut got = 0;
                    loop {
                        let mut c = std::ptr::null_mut();
                        let mut cctx = std::ptr::null_mut();
                        // SAFETY: non-blocking channel owned by the entry.
                        if unsafe { ibv_get_cq_event(e.cq.raw_channel(), &mut c, &mut cctx) } != 0 {
                            break;
                        }
                        got += 1;
                    }
                    g.clear_ready();
                    if got > 0 {
                        // SAFETY: acking events we got from this CQ.
                        unsafe { ibv_ack_cq_events(e.cq.raw_cq(), got) };
                    }
                }
                _ = &mut died => return 0,
            }
        }
    }
}

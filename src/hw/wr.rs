//! Work requests and completions between our types and ibverbs': SGE lists on the stack,
//! sends and receives posted through sideway, completions polled in batches.

use std::mem::MaybeUninit;

use rdma_mummy_sys::{ibv_poll_cq, ibv_sge, ibv_wc};
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, PostSendGuard, QueuePair, SetScatterGatherEntry, WorkRequestFlags,
};

use super::map;
use super::HwError;
use crate::verbs::MAX_SGE;
use crate::verbs::{MemKey, Qpn, RecvWr, SendOp, SendWr, Sgl, WcOpcode, WcStatus, WorkCompletion};

const IBV_WC_WITH_IMM: u32 = 2;
const IBV_WC_WITH_INV: u32 = 4;

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

/// Post one send work request on `qp`.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_sgl_becomes_ibverbs_sges() {
        let s = sges(&Sgl::one(0x1000, 64, MemKey(7)));
        assert_eq!(
            (s.1, s.0[0].addr, s.0[0].length, s.0[0].lkey),
            (1, 0x1000, 64, 7)
        );
    }
}

//! Bring an RC QP up by hand (what CM does on the wire, done out of band): used by the
//! simulator tests, the loopback driver tests and the benchmarks.

use crate::verbs::PeerInfo;
use std::net::SocketAddr;

use super::device::Device;
use super::mr::HostMem;
use super::qp::{AttrMask, QpAttr, QpState};
use crate::verbs::CqId;
use crate::verbs::VerbsError;
use crate::verbs::{Access, MrInfo, PdId};
use crate::verbs::{Mtu, QpCaps};
use crate::verbs::{Psn, Qpn};

#[derive(Debug, Clone, Copy)]
pub struct RcOptions {
    pub mtu: Mtu,
    pub buf_len: usize,
    pub cqe: usize,
    pub caps: QpCaps,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub min_rnr_timer: u8,
    pub max_unacked: u32,
    pub max_rd_atomic: u8,
    /// Payload per packet on the in-memory path (`QpAttr::in_memory_seg`; 0: the MTU).
    pub in_memory_seg: u32,
}

impl Default for RcOptions {
    fn default() -> Self {
        RcOptions {
            mtu: Mtu::Mtu1024,
            buf_len: 1 << 20,
            cqe: 4096,
            caps: QpCaps::default(),
            // 4.096 µs × 2^10 ≈ 4 ms: quick retries in virtual time.
            timeout: 10,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 1,
            max_unacked: 128,
            max_rd_atomic: 16,
            in_memory_seg: 0,
        }
    }
}

/// One side of an RC connection: its objects and its registered buffer.
#[derive(Debug, Clone)]
pub struct RcEnd {
    pub pd: PdId,
    pub cq: CqId,
    pub qpn: Qpn,
    pub mem: HostMem,
    pub mr: MrInfo,
    pub psn: Psn,
}

/// Allocate PD, CQ, a buffer + MR with full access, and a QP in INIT.
pub fn create_end(dev: &mut Device, o: &RcOptions, psn: Psn) -> Result<RcEnd, VerbsError> {
    let pd = dev.alloc_pd()?;
    let cq = dev.create_cq(o.cqe)?;
    let mem = HostMem::new(o.buf_len);
    let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
    let mr = dev.reg_mr(pd, &mem, 0, o.buf_len, all)?;
    let qpn = dev.create_qp(pd, cq, cq, o.caps)?;
    let attr = QpAttr {
        state: QpState::Init,
        access: all,
        ..QpAttr::default()
    };
    dev.modify_qp(
        qpn,
        &attr,
        AttrMask::STATE | AttrMask::PKEY_INDEX | AttrMask::PORT | AttrMask::ACCESS_FLAGS,
    )?;
    Ok(RcEnd {
        pd,
        cq,
        qpn,
        mem,
        mr,
        psn,
    })
}

/// INIT → RTR → RTS towards `(remote_addr, remote_qpn)` whose send PSN is `remote_psn`.
pub fn connect_end(
    dev: &mut Device,
    end: &RcEnd,
    remote_addr: SocketAddr,
    remote_qpn: Qpn,
    remote_psn: Psn,
    o: &RcOptions,
) -> Result<(), VerbsError> {
    let peer = PeerInfo {
        addr: remote_addr,
        qpn: remote_qpn,
        psn: remote_psn,
    };
    qp_to_rts(dev, end.qpn, peer, end.psn, o)
}

/// Create and connect a QP on each of two devices.
pub fn connect_pair(
    a: &mut Device,
    b: &mut Device,
    o: &RcOptions,
    psn_a: Psn,
    psn_b: Psn,
) -> Result<(RcEnd, RcEnd), VerbsError> {
    let ea = create_end(a, o, psn_a)?;
    let eb = create_end(b, o, psn_b)?;
    connect_end(a, &ea, b.addr(), eb.qpn, eb.psn, o)?;
    connect_end(b, &eb, a.addr(), ea.qpn, ea.psn, o)?;
    Ok((ea, eb))
}

/// Create an RC QP in INIT with `access` for remote peers.
pub fn create_qp_init(
    dev: &mut Device,
    pd: PdId,
    cq: CqId,
    caps: QpCaps,
    access: Access,
) -> Result<Qpn, VerbsError> {
    let qpn = dev.create_qp(pd, cq, cq, caps)?;
    let attr = QpAttr {
        state: QpState::Init,
        access,
        ..QpAttr::default()
    };
    if let Err(e) = dev.modify_qp(
        qpn,
        &attr,
        AttrMask::STATE | AttrMask::PKEY_INDEX | AttrMask::PORT | AttrMask::ACCESS_FLAGS,
    ) {
        let _ = dev.destroy_qp(qpn);
        return Err(e);
    }
    Ok(qpn)
}

/// INIT → RTR → RTS towards `peer`, sending from `local_psn`.
pub fn qp_to_rts(
    dev: &mut Device,
    qpn: Qpn,
    peer: PeerInfo,
    local_psn: Psn,
    o: &RcOptions,
) -> Result<(), VerbsError> {
    let attr = QpAttr {
        state: QpState::Rtr,
        dest: Some(peer.addr),
        path_mtu: o.mtu,
        dest_qpn: peer.qpn,
        rq_psn: peer.psn,
        max_dest_rd_atomic: o.max_rd_atomic,
        min_rnr_timer: o.min_rnr_timer,
        max_unacked: o.max_unacked,
        in_memory_seg: o.in_memory_seg,
        ..QpAttr::default()
    };
    dev.modify_qp(
        qpn,
        &attr,
        AttrMask::STATE
            | AttrMask::AV
            | AttrMask::PATH_MTU
            | AttrMask::DEST_QPN
            | AttrMask::RQ_PSN
            | AttrMask::MAX_DEST_RD_ATOMIC
            | AttrMask::MIN_RNR_TIMER,
    )?;
    let attr = QpAttr {
        state: QpState::Rts,
        timeout: o.timeout,
        retry_cnt: o.retry_cnt,
        rnr_retry: o.rnr_retry,
        sq_psn: local_psn,
        max_rd_atomic: o.max_rd_atomic,
        ..QpAttr::default()
    };
    dev.modify_qp(
        qpn,
        &attr,
        AttrMask::STATE
            | AttrMask::TIMEOUT
            | AttrMask::RETRY_CNT
            | AttrMask::RNR_RETRY
            | AttrMask::SQ_PSN
            | AttrMask::MAX_QP_RD_ATOMIC,
    )
}

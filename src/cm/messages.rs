//! The connected-mode CM messages of IBA §12.6 (Tables 106-113) over the MAD header of
//! [`super::mad`]: REQ, MRA, REJ, REP, RTU, DREQ and DREP, each a `Repr` that parses from a
//! [`Mad`] view and emits into 256 bytes, and [`CmMad`], a whole MAD with one of them. Field
//! positions are absolute offsets into the MAD, as in [`super::mad`].

use super::mad::{
    attr, mtu_from_ib, Mad, MadError, MadHdrRepr, MsgRef, RejectReason, TransportType, MAD_HDR_LEN,
    MAD_LEN,
};
use super::{rd16, rd24, rd32, rd64, wr16, wr24, wr32, wr64};
use crate::verbs::Mtu;
use crate::verbs::{Guid, Psn, Qpn};
use std::net::Ipv6Addr;

const H: usize = MAD_HDR_LEN;

// ---------------------------------------------------------------------------------------------
// REQ (IBA Table 106; ibta_vol1_c12.h CM_REQ_*)

mod req_field {
    use super::H;
    pub const LOCAL_COMM_ID: usize = H;
    // 4 reserved bytes at 4.
    pub const SERVICE_ID: usize = H + 8;
    pub const LOCAL_CA_GUID: usize = H + 16;
    // 4 reserved bytes at 24.
    pub const LOCAL_QKEY: usize = H + 28;
    /// 24 bits.
    pub const LOCAL_QPN: usize = H + 32;
    pub const RESPONDER_RESOURCES: usize = H + 35;
    /// Local EECN, 24 bits (RD only; zero for RC).
    pub const LOCAL_EECN: usize = H + 36;
    pub const INITIATOR_DEPTH: usize = H + 39;
    /// Remote EECN, 24 bits (RD only).
    pub const REMOTE_EECN: usize = H + 40;
    /// Remote CM response timeout [7:3], transport service type [2:1], E2E flow control [0].
    pub const B43: usize = H + 43;
    /// 24 bits.
    pub const STARTING_PSN: usize = H + 44;
    /// Local CM response timeout [7:3], retry count [2:0].
    pub const B47: usize = H + 47;
    pub const PKEY: usize = H + 48;
    /// Path MTU [7:4], RDC exists [3], RNR retry count [2:0].
    pub const B50: usize = H + 50;
    /// Max CM retries [7:4], SRQ [3], extended transport type [2:0].
    pub const B51: usize = H + 51;
    pub const PRIMARY_LOCAL_LID: usize = H + 52;
    pub const PRIMARY_REMOTE_LID: usize = H + 54;
    pub const PRIMARY_LOCAL_GID: usize = H + 56;
    pub const PRIMARY_REMOTE_GID: usize = H + 72;
    /// Flow label in the top 20 bits of the 32-bit word; packet rate in the low 6.
    pub const PRIMARY_FLOW: usize = H + 88;
    pub const PRIMARY_TRAFFIC_CLASS: usize = H + 92;
    pub const PRIMARY_HOP_LIMIT: usize = H + 93;
    /// SL [7:4], subnet local [3].
    pub const B94: usize = H + 94;
    /// Local ACK timeout [7:3].
    pub const B95: usize = H + 95;
    /// Alternate path fields 96..=139 (never set by rdma_cm on RoCE: cm.c `cm_lap_handler`
    /// says alternate paths are unsupported on the RoCE link layer).
    pub const ALTERNATE: usize = H + 96;
    pub const PRIVATE_DATA: usize = H + 140;
}

/// A REQ: the active side asks to connect (IBA §12.6.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReqRepr {
    pub local_comm_id: u32,
    pub service_id: u64,
    pub local_ca_guid: Guid,
    pub local_qkey: u32,
    pub local_qpn: Qpn,
    pub responder_resources: u8,
    pub initiator_depth: u8,
    /// 5 bits: how long the sender expects the peer to take to answer (4.096 µs × 2^n).
    pub remote_cm_response_timeout: u8,
    pub transport: TransportType,
    pub flow_control: bool,
    pub starting_psn: Psn,
    /// 5 bits: how long the sender takes to answer the peer's messages.
    pub local_cm_response_timeout: u8,
    /// 3 bits.
    pub retry_count: u8,
    pub pkey: u16,
    pub path_mtu: Mtu,
    /// 3 bits.
    pub rnr_retry_count: u8,
    /// 4 bits.
    pub max_cm_retries: u8,
    pub srq: bool,
    /// 0xFFFF (permissive) on RoCE, where there are no LIDs (cm.c `cm_format_req` with
    /// hop limit > 1).
    pub primary_local_lid: u16,
    pub primary_remote_lid: u16,
    /// For IPv4 the IPv4-mapped address `::ffff:a.b.c.d` (ib_addr.h `rdma_ip2gid`).
    pub primary_local_gid: Ipv6Addr,
    pub primary_remote_gid: Ipv6Addr,
    /// 20 bits.
    pub flow_label: u32,
    /// 6 bits.
    pub packet_rate: u8,
    pub traffic_class: u8,
    pub hop_limit: u8,
    /// 4 bits.
    pub sl: u8,
    pub subnet_local: bool,
    /// 5 bits.
    pub local_ack_timeout: u8,
    pub private_data: [u8; ReqRepr::PRIVATE_LEN],
}

impl ReqRepr {
    pub const ATTR_ID: u16 = attr::REQ;
    /// `IB_CM_REQ_PRIVATE_DATA_SIZE`.
    pub const PRIVATE_LEN: usize = 92;

    /// Parse the REQ fields of a MAD whose header was already checked. The alternate path,
    /// the EECNs, RDC-exists and the extended transport type are not represented: rdma_cm
    /// over RoCE never sets them.
    pub fn parse<T: AsRef<[u8]>>(v: &Mad<T>) -> Result<ReqRepr, MadError> {
        use req_field as f;
        let b = v.b();
        let mtu_code = b[f::B50] >> 4;
        let path_mtu = mtu_from_ib(mtu_code).ok_or(MadError::BadMtu(mtu_code))?;
        let flow = rd32(b, f::PRIMARY_FLOW);
        let mut private_data = [0u8; Self::PRIVATE_LEN];
        private_data.copy_from_slice(&b[f::PRIVATE_DATA..f::PRIVATE_DATA + Self::PRIVATE_LEN]);
        Ok(ReqRepr {
            local_comm_id: rd32(b, f::LOCAL_COMM_ID),
            service_id: rd64(b, f::SERVICE_ID),
            local_ca_guid: Guid(rd64(b, f::LOCAL_CA_GUID)),
            local_qkey: rd32(b, f::LOCAL_QKEY),
            local_qpn: Qpn::new(rd24(b, f::LOCAL_QPN)),
            responder_resources: b[f::RESPONDER_RESOURCES],
            initiator_depth: b[f::INITIATOR_DEPTH],
            remote_cm_response_timeout: b[f::B43] >> 3,
            transport: TransportType::from_bits(b[f::B43] >> 1),
            flow_control: b[f::B43] & 1 != 0,
            starting_psn: Psn::new(rd24(b, f::STARTING_PSN)),
            local_cm_response_timeout: b[f::B47] >> 3,
            retry_count: b[f::B47] & 7,
            pkey: rd16(b, f::PKEY),
            path_mtu,
            rnr_retry_count: b[f::B50] & 7,
            max_cm_retries: b[f::B51] >> 4,
            srq: b[f::B51] & 0x08 != 0,
            primary_local_lid: rd16(b, f::PRIMARY_LOCAL_LID),
            primary_remote_lid: rd16(b, f::PRIMARY_REMOTE_LID),
            primary_local_gid: gid_at(b, f::PRIMARY_LOCAL_GID),
            primary_remote_gid: gid_at(b, f::PRIMARY_REMOTE_GID),
            flow_label: flow >> 12,
            packet_rate: (flow & 0x3F) as u8,
            traffic_class: b[f::PRIMARY_TRAFFIC_CLASS],
            hop_limit: b[f::PRIMARY_HOP_LIMIT],
            sl: b[f::B94] >> 4,
            subnet_local: b[f::B94] & 0x08 != 0,
            local_ack_timeout: b[f::B95] >> 3,
            private_data,
        })
    }

    /// Write the REQ body into `out` (header untouched). Out-of-range values are masked to
    /// their field widths; reserved bits and the alternate path are zeroed.
    pub fn emit(&self, out: &mut [u8; MAD_LEN]) {
        use req_field as f;
        out[H..].fill(0);
        wr32(out, f::LOCAL_COMM_ID, self.local_comm_id);
        wr64(out, f::SERVICE_ID, self.service_id);
        wr64(out, f::LOCAL_CA_GUID, self.local_ca_guid.0);
        wr32(out, f::LOCAL_QKEY, self.local_qkey);
        wr24(out, f::LOCAL_QPN, self.local_qpn.get());
        out[f::RESPONDER_RESOURCES] = self.responder_resources;
        wr24(out, f::LOCAL_EECN, 0);
        out[f::INITIATOR_DEPTH] = self.initiator_depth;
        wr24(out, f::REMOTE_EECN, 0);
        out[f::B43] = ((self.remote_cm_response_timeout & 0x1F) << 3)
            | ((self.transport as u8) << 1)
            | self.flow_control as u8;
        wr24(out, f::STARTING_PSN, self.starting_psn.get());
        out[f::B47] = ((self.local_cm_response_timeout & 0x1F) << 3) | (self.retry_count & 7);
        wr16(out, f::PKEY, self.pkey);
        out[f::B50] = (self.path_mtu.ib_enum() << 4) | (self.rnr_retry_count & 7);
        out[f::B51] = ((self.max_cm_retries & 0x0F) << 4) | ((self.srq as u8) << 3);
        wr16(out, f::PRIMARY_LOCAL_LID, self.primary_local_lid);
        wr16(out, f::PRIMARY_REMOTE_LID, self.primary_remote_lid);
        out[f::PRIMARY_LOCAL_GID..f::PRIMARY_LOCAL_GID + 16]
            .copy_from_slice(&self.primary_local_gid.octets());
        out[f::PRIMARY_REMOTE_GID..f::PRIMARY_REMOTE_GID + 16]
            .copy_from_slice(&self.primary_remote_gid.octets());
        wr32(
            out,
            f::PRIMARY_FLOW,
            ((self.flow_label & 0xF_FFFF) << 12) | (self.packet_rate & 0x3F) as u32,
        );
        out[f::PRIMARY_TRAFFIC_CLASS] = self.traffic_class;
        out[f::PRIMARY_HOP_LIMIT] = self.hop_limit;
        out[f::B94] = ((self.sl & 0x0F) << 4) | ((self.subnet_local as u8) << 3);
        out[f::B95] = (self.local_ack_timeout & 0x1F) << 3;
        const { assert!(f::ALTERNATE + 44 == f::PRIVATE_DATA) };
        out[f::PRIVATE_DATA..f::PRIVATE_DATA + Self::PRIVATE_LEN]
            .copy_from_slice(&self.private_data);
    }
}

fn gid_at(b: &[u8], at: usize) -> Ipv6Addr {
    let mut g = [0u8; 16];
    g.copy_from_slice(&b[at..at + 16]);
    Ipv6Addr::from(g)
}

// ---------------------------------------------------------------------------------------------
// MRA (IBA Table 107; CM_MRA_*)

mod mra_field {
    use super::H;
    pub const LOCAL_COMM_ID: usize = H;
    pub const REMOTE_COMM_ID: usize = H + 4;
    /// Message MRAed [7:6].
    pub const B8: usize = H + 8;
    /// Service timeout [7:3].
    pub const B9: usize = H + 9;
    pub const PRIVATE_DATA: usize = H + 10;
}

/// An MRA: "message received, answer will take longer" (IBA §12.6.6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MraRepr {
    pub local_comm_id: u32,
    pub remote_comm_id: u32,
    pub message_mraed: MsgRef,
    /// 5 bits: the extra time the sender needs (4.096 µs × 2^n).
    pub service_timeout: u8,
    pub private_data: [u8; MraRepr::PRIVATE_LEN],
}

impl MraRepr {
    pub const ATTR_ID: u16 = attr::MRA;
    /// `IB_CM_MRA_PRIVATE_DATA_SIZE`.
    pub const PRIVATE_LEN: usize = 222;

    pub fn parse<T: AsRef<[u8]>>(v: &Mad<T>) -> Result<MraRepr, MadError> {
        use mra_field as f;
        let b = v.b();
        let mut private_data = [0u8; Self::PRIVATE_LEN];
        private_data.copy_from_slice(&b[f::PRIVATE_DATA..f::PRIVATE_DATA + Self::PRIVATE_LEN]);
        Ok(MraRepr {
            local_comm_id: rd32(b, f::LOCAL_COMM_ID),
            remote_comm_id: rd32(b, f::REMOTE_COMM_ID),
            message_mraed: MsgRef::from_bits(b[f::B8] >> 6)?,
            service_timeout: b[f::B9] >> 3,
            private_data,
        })
    }
    pub fn emit(&self, out: &mut [u8; MAD_LEN]) {
        use mra_field as f;
        out[H..].fill(0);
        wr32(out, f::LOCAL_COMM_ID, self.local_comm_id);
        wr32(out, f::REMOTE_COMM_ID, self.remote_comm_id);
        out[f::B8] = (self.message_mraed as u8) << 6;
        out[f::B9] = (self.service_timeout & 0x1F) << 3;
        out[f::PRIVATE_DATA..f::PRIVATE_DATA + Self::PRIVATE_LEN]
            .copy_from_slice(&self.private_data);
    }
}

// ---------------------------------------------------------------------------------------------
// REJ (IBA Table 108; CM_REJ_*)

mod rej_field {
    use super::H;
    pub const LOCAL_COMM_ID: usize = H;
    pub const REMOTE_COMM_ID: usize = H + 4;
    /// Message rejected [7:6].
    pub const B8: usize = H + 8;
    /// Rejected info length [7:1].
    pub const B9: usize = H + 9;
    pub const REASON: usize = H + 10;
    pub const ARI: usize = H + 12;
    pub const PRIVATE_DATA: usize = H + 84;
}

/// A REJ: the connection attempt is refused (IBA §12.6.7).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RejRepr {
    /// Zero when the rejecter never allocated an ID (cm.c `cm_issue_rej` answering a REQ).
    pub local_comm_id: u32,
    pub remote_comm_id: u32,
    pub message_rejected: MsgRef,
    /// 7 bits; how much of `ari` is meaningful. The wire allows up to 127, the field holds 72:
    /// use [`RejRepr::ari`] for the meaningful part.
    pub ari_length: u8,
    pub reason: RejectReason,
    /// Additional rejection information.
    pub ari_bytes: [u8; RejRepr::ARI_LEN],
    pub private_data: [u8; RejRepr::PRIVATE_LEN],
}

impl RejRepr {
    pub const ATTR_ID: u16 = attr::REJ;
    /// `IB_CM_REJ_ARI_LENGTH`.
    pub const ARI_LEN: usize = 72;
    /// `IB_CM_REJ_PRIVATE_DATA_SIZE`.
    pub const PRIVATE_LEN: usize = 148;

    pub fn parse<T: AsRef<[u8]>>(v: &Mad<T>) -> Result<RejRepr, MadError> {
        use rej_field as f;
        let b = v.b();
        let mut ari_bytes = [0u8; Self::ARI_LEN];
        ari_bytes.copy_from_slice(&b[f::ARI..f::ARI + Self::ARI_LEN]);
        let mut private_data = [0u8; Self::PRIVATE_LEN];
        private_data.copy_from_slice(&b[f::PRIVATE_DATA..f::PRIVATE_DATA + Self::PRIVATE_LEN]);
        Ok(RejRepr {
            local_comm_id: rd32(b, f::LOCAL_COMM_ID),
            remote_comm_id: rd32(b, f::REMOTE_COMM_ID),
            message_rejected: MsgRef::from_bits(b[f::B8] >> 6)?,
            ari_length: b[f::B9] >> 1,
            reason: RejectReason(rd16(b, f::REASON)),
            ari_bytes,
            private_data,
        })
    }
    pub fn emit(&self, out: &mut [u8; MAD_LEN]) {
        use rej_field as f;
        out[H..].fill(0);
        wr32(out, f::LOCAL_COMM_ID, self.local_comm_id);
        wr32(out, f::REMOTE_COMM_ID, self.remote_comm_id);
        out[f::B8] = (self.message_rejected as u8) << 6;
        out[f::B9] = (self.ari_length & 0x7F) << 1;
        wr16(out, f::REASON, self.reason.0);
        out[f::ARI..f::ARI + Self::ARI_LEN].copy_from_slice(&self.ari_bytes);
        out[f::PRIVATE_DATA..f::PRIVATE_DATA + Self::PRIVATE_LEN]
            .copy_from_slice(&self.private_data);
    }
    /// The meaningful additional rejection information.
    pub fn ari(&self) -> &[u8] {
        &self.ari_bytes[..(self.ari_length as usize).min(Self::ARI_LEN)]
    }
}

// ---------------------------------------------------------------------------------------------
// REP (IBA Table 110; CM_REP_*)

mod rep_field {
    use super::H;
    pub const LOCAL_COMM_ID: usize = H;
    pub const REMOTE_COMM_ID: usize = H + 4;
    pub const LOCAL_QKEY: usize = H + 8;
    /// 24 bits.
    pub const LOCAL_QPN: usize = H + 12;
    /// Local EECN, 24 bits (XRC/RD only).
    pub const LOCAL_EECN: usize = H + 16;
    /// 24 bits.
    pub const STARTING_PSN: usize = H + 20;
    pub const RESPONDER_RESOURCES: usize = H + 24;
    pub const INITIATOR_DEPTH: usize = H + 25;
    /// Target ACK delay [7:3], failover accepted [2:1], E2E flow control [0].
    pub const B26: usize = H + 26;
    /// RNR retry count [7:5], SRQ [4].
    pub const B27: usize = H + 27;
    pub const LOCAL_CA_GUID: usize = H + 28;
    pub const PRIVATE_DATA: usize = H + 36;
}

/// A REP: the passive side accepts (IBA §12.6.8).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RepRepr {
    pub local_comm_id: u32,
    pub remote_comm_id: u32,
    pub local_qkey: u32,
    pub local_qpn: Qpn,
    pub starting_psn: Psn,
    pub responder_resources: u8,
    pub initiator_depth: u8,
    /// 5 bits: the sender HCA's ACK delay (`local_ca_ack_delay`).
    pub target_ack_delay: u8,
    /// 2 bits: 0 accepted, 1 not supported, 2 rejected.
    pub failover: u8,
    pub flow_control: bool,
    /// 3 bits.
    pub rnr_retry_count: u8,
    pub srq: bool,
    pub local_ca_guid: Guid,
    pub private_data: [u8; RepRepr::PRIVATE_LEN],
}

impl RepRepr {
    pub const ATTR_ID: u16 = attr::REP;
    /// `IB_CM_REP_PRIVATE_DATA_SIZE`.
    pub const PRIVATE_LEN: usize = 196;

    pub fn parse<T: AsRef<[u8]>>(v: &Mad<T>) -> Result<RepRepr, MadError> {
        use rep_field as f;
        let b = v.b();
        let mut private_data = [0u8; Self::PRIVATE_LEN];
        private_data.copy_from_slice(&b[f::PRIVATE_DATA..f::PRIVATE_DATA + Self::PRIVATE_LEN]);
        Ok(RepRepr {
            local_comm_id: rd32(b, f::LOCAL_COMM_ID),
            remote_comm_id: rd32(b, f::REMOTE_COMM_ID),
            local_qkey: rd32(b, f::LOCAL_QKEY),
            local_qpn: Qpn::new(rd24(b, f::LOCAL_QPN)),
            starting_psn: Psn::new(rd24(b, f::STARTING_PSN)),
            responder_resources: b[f::RESPONDER_RESOURCES],
            initiator_depth: b[f::INITIATOR_DEPTH],
            target_ack_delay: b[f::B26] >> 3,
            failover: (b[f::B26] >> 1) & 3,
            flow_control: b[f::B26] & 1 != 0,
            rnr_retry_count: b[f::B27] >> 5,
            srq: b[f::B27] & 0x10 != 0,
            local_ca_guid: Guid(rd64(b, f::LOCAL_CA_GUID)),
            private_data,
        })
    }
    pub fn emit(&self, out: &mut [u8; MAD_LEN]) {
        use rep_field as f;
        out[H..].fill(0);
        wr32(out, f::LOCAL_COMM_ID, self.local_comm_id);
        wr32(out, f::REMOTE_COMM_ID, self.remote_comm_id);
        wr32(out, f::LOCAL_QKEY, self.local_qkey);
        wr24(out, f::LOCAL_QPN, self.local_qpn.get());
        wr24(out, f::LOCAL_EECN, 0);
        wr24(out, f::STARTING_PSN, self.starting_psn.get());
        out[f::RESPONDER_RESOURCES] = self.responder_resources;
        out[f::INITIATOR_DEPTH] = self.initiator_depth;
        out[f::B26] = ((self.target_ack_delay & 0x1F) << 3)
            | ((self.failover & 3) << 1)
            | self.flow_control as u8;
        out[f::B27] = ((self.rnr_retry_count & 7) << 5) | ((self.srq as u8) << 4);
        wr64(out, f::LOCAL_CA_GUID, self.local_ca_guid.0);
        out[f::PRIVATE_DATA..f::PRIVATE_DATA + Self::PRIVATE_LEN]
            .copy_from_slice(&self.private_data);
    }
}

// ---------------------------------------------------------------------------------------------
// RTU, DREQ, DREP (IBA Tables 111-113; CM_RTU_*, CM_DREQ_*, CM_DREP_*)

const COMM_LOCAL: usize = H;
const COMM_REMOTE: usize = H + 4;

/// RTU and DREP share one layout: the two communication IDs, then 224 bytes of private
/// data. One type serves both, told apart by the attribute ID it is sent under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdsPrivateRepr<const ATTR: u16> {
    pub local_comm_id: u32,
    pub remote_comm_id: u32,
    pub private_data: [u8; IDS_PRIVATE_LEN],
}

/// `IB_CM_RTU_PRIVATE_DATA_SIZE` and `IB_CM_DREP_PRIVATE_DATA_SIZE`.
const IDS_PRIVATE_LEN: usize = 224;
const IDS_PRIVATE: usize = H + 8;

/// An RTU: the active side is ready to use the connection (IBA §12.6.9).
pub type RtuRepr = IdsPrivateRepr<{ attr::RTU }>;
/// A DREP: the disconnect is acknowledged (IBA §12.6.11).
pub type DrepRepr = IdsPrivateRepr<{ attr::DREP }>;

impl<const ATTR: u16> IdsPrivateRepr<ATTR> {
    pub const ATTR_ID: u16 = ATTR;
    pub const PRIVATE_LEN: usize = IDS_PRIVATE_LEN;

    pub fn parse<T: AsRef<[u8]>>(v: &Mad<T>) -> Result<Self, MadError> {
        let b = v.b();
        let mut private_data = [0u8; IDS_PRIVATE_LEN];
        private_data.copy_from_slice(&b[IDS_PRIVATE..IDS_PRIVATE + IDS_PRIVATE_LEN]);
        Ok(IdsPrivateRepr {
            local_comm_id: rd32(b, COMM_LOCAL),
            remote_comm_id: rd32(b, COMM_REMOTE),
            private_data,
        })
    }
    pub fn emit(&self, out: &mut [u8; MAD_LEN]) {
        wr32(out, COMM_LOCAL, self.local_comm_id);
        wr32(out, COMM_REMOTE, self.remote_comm_id);
        out[IDS_PRIVATE..].copy_from_slice(&self.private_data);
    }
}

/// A DREQ: one side asks to disconnect (IBA §12.6.10).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DreqRepr {
    pub local_comm_id: u32,
    pub remote_comm_id: u32,
    /// The receiver's QPN; the receiver ignores a DREQ naming another QP (cm.c
    /// `cm_dreq_handler`).
    pub remote_qpn: Qpn,
    pub private_data: [u8; DreqRepr::PRIVATE_LEN],
}

impl DreqRepr {
    pub const ATTR_ID: u16 = attr::DREQ;
    /// `IB_CM_DREQ_PRIVATE_DATA_SIZE`.
    pub const PRIVATE_LEN: usize = 220;
    /// 24 bits, then a reserved byte.
    const REMOTE_QPN: usize = H + 8;
    const PRIVATE_DATA: usize = H + 12;

    pub fn parse<T: AsRef<[u8]>>(v: &Mad<T>) -> Result<DreqRepr, MadError> {
        let b = v.b();
        let mut private_data = [0u8; Self::PRIVATE_LEN];
        private_data.copy_from_slice(&b[Self::PRIVATE_DATA..]);
        Ok(DreqRepr {
            local_comm_id: rd32(b, COMM_LOCAL),
            remote_comm_id: rd32(b, COMM_REMOTE),
            remote_qpn: Qpn::new(rd24(b, Self::REMOTE_QPN)),
            private_data,
        })
    }
    pub fn emit(&self, out: &mut [u8; MAD_LEN]) {
        wr32(out, COMM_LOCAL, self.local_comm_id);
        wr32(out, COMM_REMOTE, self.remote_comm_id);
        wr32(out, Self::REMOTE_QPN, self.remote_qpn.get() << 8);
        out[Self::PRIVATE_DATA..].copy_from_slice(&self.private_data);
    }
}

// ---------------------------------------------------------------------------------------------
// A whole CM MAD

/// One connected-mode CM message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CmMessage {
    Req(ReqRepr),
    Mra(MraRepr),
    Rej(RejRepr),
    Rep(RepRepr),
    Rtu(RtuRepr),
    Dreq(DreqRepr),
    Drep(DrepRepr),
}

impl CmMessage {
    pub fn attribute_id(&self) -> u16 {
        match self {
            CmMessage::Req(_) => attr::REQ,
            CmMessage::Mra(_) => attr::MRA,
            CmMessage::Rej(_) => attr::REJ,
            CmMessage::Rep(_) => attr::REP,
            CmMessage::Rtu(_) => attr::RTU,
            CmMessage::Dreq(_) => attr::DREQ,
            CmMessage::Drep(_) => attr::DREP,
        }
    }
    pub fn name(&self) -> &'static str {
        match self {
            CmMessage::Req(_) => "REQ",
            CmMessage::Mra(_) => "MRA",
            CmMessage::Rej(_) => "REJ",
            CmMessage::Rep(_) => "REP",
            CmMessage::Rtu(_) => "RTU",
            CmMessage::Dreq(_) => "DREQ",
            CmMessage::Drep(_) => "DREP",
        }
    }
}

/// A CM MAD: transaction ID and message. Status, class-specific and attribute modifier are
/// zero on everything a CM sends and ignored on receipt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CmMad {
    pub transaction_id: u64,
    pub message: CmMessage,
}

impl CmMad {
    /// Parse 256 bytes: the header must say CM / version 2 / SEND, the attribute must be one
    /// of the seven connected-mode messages (SIDR, LAP and APR are not handled; Linux does not
    /// do LAP/APR on RoCE either).
    pub fn parse(bytes: &[u8]) -> Result<CmMad, MadError> {
        let v = Mad::new_checked(bytes)?;
        v.check_cm_header()?;
        let message = match v.attribute_id() {
            attr::REQ => CmMessage::Req(ReqRepr::parse(&v)?),
            attr::MRA => CmMessage::Mra(MraRepr::parse(&v)?),
            attr::REJ => CmMessage::Rej(RejRepr::parse(&v)?),
            attr::REP => CmMessage::Rep(RepRepr::parse(&v)?),
            attr::RTU => CmMessage::Rtu(RtuRepr::parse(&v)?),
            attr::DREQ => CmMessage::Dreq(DreqRepr::parse(&v)?),
            attr::DREP => CmMessage::Drep(DrepRepr::parse(&v)?),
            other => return Err(MadError::UnknownAttribute(other)),
        };
        Ok(CmMad {
            transaction_id: v.transaction_id(),
            message,
        })
    }

    pub fn emit(&self) -> [u8; MAD_LEN] {
        let mut out = [0u8; MAD_LEN];
        MadHdrRepr::cm(self.message.attribute_id(), self.transaction_id).emit(&mut out);
        match &self.message {
            CmMessage::Req(r) => r.emit(&mut out),
            CmMessage::Mra(r) => r.emit(&mut out),
            CmMessage::Rej(r) => r.emit(&mut out),
            CmMessage::Rep(r) => r.emit(&mut out),
            CmMessage::Rtu(r) => r.emit(&mut out),
            CmMessage::Dreq(r) => r.emit(&mut out),
            CmMessage::Drep(r) => r.emit(&mut out),
        }
        out
    }
}

#[cfg(test)]
mod tests;

//! Communication Management MADs: the 256-byte management datagram, its 24-byte common header
//! (IBA §13.4.3; Linux `struct ib_mad_hdr`, include/rdma/ib_mad.h) and the connected-mode CM
//! messages of IBA §12.6 (Tables 106-113).
//!
//! Field positions follow include/rdma/ibta_vol1_c12.h (`CM_REQ_*`, `CM_REP_*`, ...), whose
//! offsets count from the end of the MAD header; the `field` modules below add the 24 header
//! bytes so every constant is an absolute offset into the MAD. Sub-byte fields are written
//! `[hi:lo]` with bit 7 the most significant, i.e. the GENMASK that the Linux `IBA_FIELD*_LOC`
//! macros (include/rdma/iba.h) derive from the IBA tables' `Byte[Bit]` offsets, which count
//! from the most significant bit: REQ `43[7:3]` is the top five bits of byte 43. Cross-checked
//! against the older accessor form in drivers/infiniband/core/cm_msgs.h (`cm_req_get_*`).
//!
//! Everything is big-endian. A [`Mad`] view is only constructed over exactly 256 bytes, so no
//! accessor and no `parse` can index out of range, whatever the bytes.

use super::{rd16, rd24, rd32, rd64, wr16, wr24, wr32, wr64};
use crate::verbs::Mtu;
use crate::verbs::{Guid, Psn, Qpn};
use std::fmt;
use std::net::Ipv6Addr;

/// Every MAD is exactly this long (IBA §13.4.2; `IB_MGMT_MAD_SIZE`).
pub const MAD_LEN: usize = 256;
/// The common MAD header (`struct ib_mad_hdr`).
pub const MAD_HDR_LEN: usize = 24;
/// The CM data area after the header.
pub const CM_DATA_LEN: usize = MAD_LEN - MAD_HDR_LEN;

/// `IB_MGMT_BASE_VERSION`.
pub const BASE_VERSION: u8 = 1;
/// `IB_MGMT_CLASS_CM`.
pub const MGMT_CLASS_CM: u8 = 0x07;
/// `IB_CM_CLASS_VERSION` (cm_msgs.h: "IB specification 1.2").
pub const CM_CLASS_VERSION: u8 = 2;
/// `IB_MGMT_METHOD_SEND`: every CM message is a SEND; the CM matches replies by comm ID, not
/// by transaction ID.
pub const METHOD_SEND: u8 = 0x03;

/// CM attribute IDs (IBA Table 104; cm_msgs.h `CM_*_ATTR_ID`, anchors §7.5).
pub mod attr {
    pub const REQ: u16 = 0x0010;
    pub const MRA: u16 = 0x0011;
    pub const REJ: u16 = 0x0012;
    pub const REP: u16 = 0x0013;
    pub const RTU: u16 = 0x0014;
    pub const DREQ: u16 = 0x0015;
    pub const DREP: u16 = 0x0016;
    pub const SIDR_REQ: u16 = 0x0017;
    pub const SIDR_REP: u16 = 0x0018;
    pub const LAP: u16 = 0x0019;
    pub const APR: u16 = 0x001A;
}

/// Why 256 bytes were not a CM message we understand. Every variant is permanent for the MAD
/// at hand: the endpoint drops it and counts it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MadError {
    #[error("MAD truncated: need 256 bytes, have {0}")]
    Truncated(usize),
    #[error("MAD of {0} bytes is longer than 256")]
    TooLong(usize),
    #[error("MAD base version {0} is not 1")]
    BadBaseVersion(u8),
    #[error("management class {0:#04x} is not CM (0x07)")]
    NotCm(u8),
    #[error("CM class version {0} is not 2")]
    BadClassVersion(u8),
    #[error("method {0:#04x} is not SEND (0x03)")]
    BadMethod(u8),
    #[error("attribute {0:#06x} is not a connected-mode CM message")]
    UnknownAttribute(u16),
    #[error("path MTU code {0} is not one of 1 (256) ..= 5 (4096)")]
    BadMtu(u8),
    #[error("message-reference code {0} is reserved")]
    BadMsgRef(u8),
}

mod hdr_field {
    pub const BASE_VERSION: usize = 0;
    pub const MGMT_CLASS: usize = 1;
    pub const CLASS_VERSION: usize = 2;
    pub const METHOD: usize = 3;
    pub const STATUS: usize = 4;
    pub const CLASS_SPECIFIC: usize = 6;
    pub const TID: usize = 8;
    pub const ATTR_ID: usize = 16;
    /// 16 reserved bits at 18.
    pub const RESERVED: usize = 18;
    pub const ATTR_MOD: usize = 20;
}

/// A checked view of a 256-byte MAD.
#[derive(Debug, Clone, Copy)]
pub struct Mad<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Mad<T> {
    pub const LEN: usize = MAD_LEN;

    /// Accept exactly 256 bytes: a MAD on QP1 never has more or less (IBA §13.4.2).
    pub fn new_checked(buffer: T) -> Result<Self, MadError> {
        let n = buffer.as_ref().len();
        if n < MAD_LEN {
            return Err(MadError::Truncated(n));
        }
        if n > MAD_LEN {
            return Err(MadError::TooLong(n));
        }
        Ok(Mad { buffer })
    }
    fn b(&self) -> &[u8] {
        self.buffer.as_ref()
    }
    pub fn base_version(&self) -> u8 {
        self.b()[hdr_field::BASE_VERSION]
    }
    pub fn mgmt_class(&self) -> u8 {
        self.b()[hdr_field::MGMT_CLASS]
    }
    pub fn class_version(&self) -> u8 {
        self.b()[hdr_field::CLASS_VERSION]
    }
    pub fn method(&self) -> u8 {
        self.b()[hdr_field::METHOD]
    }
    pub fn status(&self) -> u16 {
        rd16(self.b(), hdr_field::STATUS)
    }
    pub fn class_specific(&self) -> u16 {
        rd16(self.b(), hdr_field::CLASS_SPECIFIC)
    }
    pub fn transaction_id(&self) -> u64 {
        rd64(self.b(), hdr_field::TID)
    }
    pub fn attribute_id(&self) -> u16 {
        rd16(self.b(), hdr_field::ATTR_ID)
    }
    pub fn attribute_modifier(&self) -> u32 {
        rd32(self.b(), hdr_field::ATTR_MOD)
    }
    /// The 232 bytes after the header.
    pub fn data(&self) -> &[u8] {
        &self.b()[MAD_HDR_LEN..]
    }
    /// The checks the Linux MAD layer makes before it hands a MAD to the CM agent
    /// (registration for class CM, version 2, method SEND: cm.c `cm_add_one`).
    pub fn check_cm_header(&self) -> Result<(), MadError> {
        if self.base_version() != BASE_VERSION {
            return Err(MadError::BadBaseVersion(self.base_version()));
        }
        if self.mgmt_class() != MGMT_CLASS_CM {
            return Err(MadError::NotCm(self.mgmt_class()));
        }
        if self.class_version() != CM_CLASS_VERSION {
            return Err(MadError::BadClassVersion(self.class_version()));
        }
        if self.method() != METHOD_SEND {
            return Err(MadError::BadMethod(self.method()));
        }
        Ok(())
    }
}

/// The common MAD header as plain values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MadHdrRepr {
    pub base_version: u8,
    pub mgmt_class: u8,
    pub class_version: u8,
    pub method: u8,
    pub status: u16,
    pub class_specific: u16,
    pub transaction_id: u64,
    pub attribute_id: u16,
    pub attribute_modifier: u32,
}

impl MadHdrRepr {
    /// The header every CM message carries (cm.c `cm_format_mad_hdr`): status, class-specific
    /// and attribute modifier zero.
    pub const fn cm(attribute_id: u16, transaction_id: u64) -> MadHdrRepr {
        MadHdrRepr {
            base_version: BASE_VERSION,
            mgmt_class: MGMT_CLASS_CM,
            class_version: CM_CLASS_VERSION,
            method: METHOD_SEND,
            status: 0,
            class_specific: 0,
            transaction_id,
            attribute_id,
            attribute_modifier: 0,
        }
    }
    pub fn parse<T: AsRef<[u8]>>(v: &Mad<T>) -> MadHdrRepr {
        MadHdrRepr {
            base_version: v.base_version(),
            mgmt_class: v.mgmt_class(),
            class_version: v.class_version(),
            method: v.method(),
            status: v.status(),
            class_specific: v.class_specific(),
            transaction_id: v.transaction_id(),
            attribute_id: v.attribute_id(),
            attribute_modifier: v.attribute_modifier(),
        }
    }
    pub fn emit(&self, out: &mut [u8; MAD_LEN]) {
        out[hdr_field::BASE_VERSION] = self.base_version;
        out[hdr_field::MGMT_CLASS] = self.mgmt_class;
        out[hdr_field::CLASS_VERSION] = self.class_version;
        out[hdr_field::METHOD] = self.method;
        wr16(out, hdr_field::STATUS, self.status);
        wr16(out, hdr_field::CLASS_SPECIFIC, self.class_specific);
        wr64(out, hdr_field::TID, self.transaction_id);
        wr16(out, hdr_field::ATTR_ID, self.attribute_id);
        wr16(out, hdr_field::RESERVED, 0);
        wr32(out, hdr_field::ATTR_MOD, self.attribute_modifier);
    }
}

/// Which message a REJ or MRA refers to (cm_msgs.h `enum cm_msg_response`); two bits on the
/// wire, the fourth code is reserved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MsgRef {
    Req = 0,
    Rep = 1,
    Other = 2,
}

impl MsgRef {
    fn from_bits(b: u8) -> Result<MsgRef, MadError> {
        match b {
            0 => Ok(MsgRef::Req),
            1 => Ok(MsgRef::Rep),
            2 => Ok(MsgRef::Other),
            n => Err(MadError::BadMsgRef(n)),
        }
    }
}

/// REQ transport service type, byte 43 bits `[2:1]` (cm_msgs.h `cm_req_get_qp_type`): 3 means
/// "see the extended transport type" (XRC).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransportType {
    Rc = 0,
    Uc = 1,
    Rd = 2,
    Extended = 3,
}

impl TransportType {
    fn from_bits(b: u8) -> TransportType {
        match b & 3 {
            0 => TransportType::Rc,
            1 => TransportType::Uc,
            2 => TransportType::Rd,
            _ => TransportType::Extended,
        }
    }
}

/// The IBA path-MTU code (1 = 256 ... 5 = 4096; IBA Table 207, `enum ib_mtu`).
pub fn mtu_from_ib(code: u8) -> Option<Mtu> {
    Some(match code {
        1 => Mtu::Mtu256,
        2 => Mtu::Mtu512,
        3 => Mtu::Mtu1024,
        4 => Mtu::Mtu2048,
        5 => Mtu::Mtu4096,
        _ => return None,
    })
}

/// A REJ reason code (IBA Table 109; Linux `enum ib_cm_rej_reason`, include/rdma/ib_cm.h).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RejectReason(pub u16);

impl RejectReason {
    pub const NO_QP: RejectReason = RejectReason(1);
    pub const NO_EEC: RejectReason = RejectReason(2);
    pub const NO_RESOURCES: RejectReason = RejectReason(3);
    pub const TIMEOUT: RejectReason = RejectReason(4);
    pub const UNSUPPORTED: RejectReason = RejectReason(5);
    pub const INVALID_COMM_ID: RejectReason = RejectReason(6);
    pub const INVALID_COMM_INSTANCE: RejectReason = RejectReason(7);
    pub const INVALID_SERVICE_ID: RejectReason = RejectReason(8);
    pub const INVALID_TRANSPORT_TYPE: RejectReason = RejectReason(9);
    pub const STALE_CONN: RejectReason = RejectReason(10);
    pub const RDC_NOT_EXIST: RejectReason = RejectReason(11);
    pub const INVALID_GID: RejectReason = RejectReason(12);
    pub const INVALID_LID: RejectReason = RejectReason(13);
    pub const INVALID_SL: RejectReason = RejectReason(14);
    pub const INVALID_TRAFFIC_CLASS: RejectReason = RejectReason(15);
    pub const INVALID_HOP_LIMIT: RejectReason = RejectReason(16);
    pub const INVALID_PACKET_RATE: RejectReason = RejectReason(17);
    pub const INVALID_ALT_GID: RejectReason = RejectReason(18);
    pub const INVALID_ALT_LID: RejectReason = RejectReason(19);
    pub const INVALID_ALT_SL: RejectReason = RejectReason(20);
    pub const INVALID_ALT_TRAFFIC_CLASS: RejectReason = RejectReason(21);
    pub const INVALID_ALT_HOP_LIMIT: RejectReason = RejectReason(22);
    pub const INVALID_ALT_PACKET_RATE: RejectReason = RejectReason(23);
    pub const PORT_CM_REDIRECT: RejectReason = RejectReason(24);
    pub const PORT_REDIRECT: RejectReason = RejectReason(25);
    pub const INVALID_MTU: RejectReason = RejectReason(26);
    pub const INSUFFICIENT_RESP_RESOURCES: RejectReason = RejectReason(27);
    /// The consumer (rdma_cm user) rejected; its private data says why. NVMe-oF puts a
    /// `nvme_rdma_cm_rej` there ([`crate::cm::NvmeCmReject`]).
    pub const CONSUMER_DEFINED: RejectReason = RejectReason(28);
    pub const INVALID_RNR_RETRY: RejectReason = RejectReason(29);
    pub const DUPLICATE_LOCAL_COMM_ID: RejectReason = RejectReason(30);
    pub const INVALID_CLASS_VERSION: RejectReason = RejectReason(31);
    pub const INVALID_FLOW_LABEL: RejectReason = RejectReason(32);
    pub const INVALID_ALT_FLOW_LABEL: RejectReason = RejectReason(33);
    pub const VENDOR_OPTION_NOT_SUPPORTED: RejectReason = RejectReason(35);

    /// A short description for logs.
    pub fn describe(self) -> &'static str {
        match self.0 {
            1 => "no QP available",
            2 => "no EE context available",
            3 => "no resources",
            4 => "timed out",
            5 => "unsupported request",
            6 => "invalid communication ID",
            7 => "invalid communication instance",
            8 => "invalid service ID (nobody listens)",
            9 => "invalid transport type",
            10 => "stale connection",
            11 => "RDC does not exist",
            12 => "invalid GID",
            13 => "invalid LID",
            14 => "invalid SL",
            15 => "invalid traffic class",
            16 => "invalid hop limit",
            17 => "invalid packet rate",
            18 => "invalid alternate GID",
            19 => "invalid alternate LID",
            20 => "invalid alternate SL",
            21 => "invalid alternate traffic class",
            22 => "invalid alternate hop limit",
            23 => "invalid alternate packet rate",
            24 => "port CM redirect",
            25 => "port redirect",
            26 => "invalid path MTU",
            27 => "insufficient responder resources",
            28 => "consumer defined",
            29 => "invalid RNR retry count",
            30 => "duplicate local communication ID",
            31 => "invalid class version",
            32 => "invalid flow label",
            33 => "invalid alternate flow label",
            35 => "vendor option not supported",
            _ => "unrecognised reason",
        }
    }
}

impl fmt::Display for RejectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.0, self.describe())
    }
}

impl fmt::Debug for RejectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RejectReason({self})")
    }
}

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
mod tests {
    use super::*;

    const TID: u64 = 0x0102_0304_0506_0708;

    /// A MAD with a CM SEND header for `attr` and transaction ID `TID`.
    fn hdr(attr: u16) -> [u8; MAD_LEN] {
        let mut b = [0u8; MAD_LEN];
        b[..4].copy_from_slice(&[1, 0x07, 2, 0x03]);
        b[8..16].copy_from_slice(&TID.to_be_bytes());
        b[16..18].copy_from_slice(&attr.to_be_bytes());
        b
    }

    fn pattern<const N: usize>(seed: u8) -> [u8; N] {
        let mut a = [0u8; N];
        for (i, x) in a.iter_mut().enumerate() {
            *x = seed.wrapping_add(i as u8);
        }
        a
    }

    // --- header ------------------------------------------------------------------------------

    #[test]
    fn header_deconstruct_construct() {
        let mut b = hdr(attr::REQ);
        b[4..6].copy_from_slice(&0x1234u16.to_be_bytes());
        b[6..8].copy_from_slice(&0x5678u16.to_be_bytes());
        b[20..24].copy_from_slice(&0x9ABC_DEF0u32.to_be_bytes());
        let v = Mad::new_checked(&b[..]).unwrap();
        assert_eq!(
            (
                v.base_version(),
                v.mgmt_class(),
                v.class_version(),
                v.method()
            ),
            (1, 0x07, 2, 0x03)
        );
        assert_eq!(v.status(), 0x1234);
        assert_eq!(v.class_specific(), 0x5678);
        assert_eq!(v.transaction_id(), TID);
        assert_eq!(v.attribute_id(), 0x0010);
        assert_eq!(v.attribute_modifier(), 0x9ABC_DEF0);
        assert_eq!(v.data().len(), CM_DATA_LEN);
        let r = MadHdrRepr::parse(&v);
        let mut out = [0u8; MAD_LEN];
        r.emit(&mut out);
        assert_eq!(out[..24], b[..24]);
        assert!(v.check_cm_header().is_ok());
    }

    #[test]
    fn header_rejects_wrong_class_version_method_and_length() {
        assert_eq!(
            Mad::new_checked(&[0u8; 255][..]).unwrap_err(),
            MadError::Truncated(255)
        );
        assert_eq!(
            Mad::new_checked(&[0u8; 257][..]).unwrap_err(),
            MadError::TooLong(257)
        );
        for (at, val, want) in [
            (0, 2, MadError::BadBaseVersion(2)),
            (1, 0x03, MadError::NotCm(0x03)),
            (2, 1, MadError::BadClassVersion(1)),
            (3, 0x81, MadError::BadMethod(0x81)),
        ] {
            let mut b = hdr(attr::RTU);
            b[at] = val;
            assert_eq!(CmMad::parse(&b).unwrap_err(), want);
        }
        for a in [0u16, 0x0F, attr::SIDR_REQ, attr::LAP, attr::APR, 0xFFFF] {
            assert_eq!(
                CmMad::parse(&hdr(a)).unwrap_err(),
                MadError::UnknownAttribute(a)
            );
        }
    }

    // --- REQ -----------------------------------------------------------------------------------

    fn req_repr() -> ReqRepr {
        ReqRepr {
            local_comm_id: 0xA1B2_C3D4,
            service_id: 0x0000_0000_0106_1144,
            local_ca_guid: Guid(0x5054_00FF_FE12_3456),
            local_qkey: 0,
            local_qpn: Qpn::new(0x00_0011),
            responder_resources: 16,
            initiator_depth: 8,
            remote_cm_response_timeout: 20,
            transport: TransportType::Rc,
            flow_control: true,
            starting_psn: Psn::new(0xAB_CDEF),
            local_cm_response_timeout: 20,
            retry_count: 7,
            pkey: 0xFFFF,
            path_mtu: Mtu::Mtu1024,
            rnr_retry_count: 7,
            max_cm_retries: 15,
            srq: false,
            primary_local_lid: 0xFFFF,
            primary_remote_lid: 0xFFFF,
            primary_local_gid: "::ffff:192.168.1.10".parse().unwrap(),
            primary_remote_gid: "::ffff:192.168.1.20".parse().unwrap(),
            flow_label: 0xF_1234,
            packet_rate: 0x3F,
            traffic_class: 0x20,
            hop_limit: 64,
            sl: 3,
            subnet_local: false,
            local_ack_timeout: 18,
            private_data: pattern(0x40),
        }
    }

    fn req_bytes() -> [u8; MAD_LEN] {
        let mut b = hdr(attr::REQ);
        let d = &mut b[24..];
        d[0..4].copy_from_slice(&[0xA1, 0xB2, 0xC3, 0xD4]);
        d[8..16].copy_from_slice(&[0, 0, 0, 0, 0x01, 0x06, 0x11, 0x44]);
        d[16..24].copy_from_slice(&[0x50, 0x54, 0x00, 0xFF, 0xFE, 0x12, 0x34, 0x56]);
        d[32..36].copy_from_slice(&[0x00, 0x00, 0x11, 16]); // QPN | responder resources
        d[39] = 8; // initiator depth
        d[43] = (20 << 3) | 1; // remote CM timeout | RC (0) | flow control
        d[44..48].copy_from_slice(&[0xAB, 0xCD, 0xEF, (20 << 3) | 7]);
        d[48..50].copy_from_slice(&[0xFF, 0xFF]);
        d[50] = (3 << 4) | 7; // MTU 1024 | RNR retry
        d[51] = 15 << 4; // max CM retries
        d[52..56].copy_from_slice(&[0xFF; 4]);
        d[56..72].copy_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xFF, 0xFF, 192, 168, 1, 10]);
        d[72..88].copy_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xFF, 0xFF, 192, 168, 1, 20]);
        d[88..92].copy_from_slice(&[0xF1, 0x23, 0x40, 0x3F]); // flow label | rate
        d[92] = 0x20;
        d[93] = 64;
        d[94] = 3 << 4;
        d[95] = 18 << 3;
        d[140..232].copy_from_slice(&pattern::<92>(0x40));
        b
    }

    #[test]
    fn req_deconstruct() {
        let b = req_bytes();
        let v = Mad::new_checked(&b[..]).unwrap();
        assert_eq!(v.attribute_id(), ReqRepr::ATTR_ID);
        let r = ReqRepr::parse(&v).unwrap();
        assert_eq!(r.local_comm_id, 0xA1B2_C3D4);
        assert_eq!(r.service_id, 0x0106_1144);
        assert_eq!(r.local_qpn, Qpn::new(0x11));
        assert_eq!((r.responder_resources, r.initiator_depth), (16, 8));
        assert_eq!(r.starting_psn, Psn::new(0xAB_CDEF));
        assert_eq!(r.path_mtu, Mtu::Mtu1024);
        assert_eq!(r.flow_label, 0xF_1234);
        assert_eq!(r.packet_rate, 0x3F);
        assert_eq!(
            r.primary_remote_gid.to_ipv4_mapped(),
            Some([192, 168, 1, 20].into())
        );
    }

    #[test]
    fn req_construct() {
        let m = CmMad {
            transaction_id: TID,
            message: CmMessage::Req(req_repr()),
        };
        assert_eq!(m.emit(), req_bytes());
    }

    #[test]
    fn req_parse() {
        assert_eq!(
            CmMad::parse(&req_bytes()).unwrap(),
            CmMad {
                transaction_id: TID,
                message: CmMessage::Req(req_repr()),
            }
        );
    }

    #[test]
    fn req_emit_round_trips_and_masks() {
        let mut r = req_repr();
        r.transport = TransportType::Uc;
        r.srq = true;
        r.subnet_local = true;
        r.path_mtu = Mtu::Mtu4096;
        let mut out = [0u8; MAD_LEN];
        MadHdrRepr::cm(attr::REQ, 1).emit(&mut out);
        r.emit(&mut out);
        assert_eq!(
            ReqRepr::parse(&Mad::new_checked(&out[..]).unwrap()).unwrap(),
            r
        );
        // Oversized values are masked to their widths instead of spilling into neighbours.
        r.retry_count = 0xFF;
        r.remote_cm_response_timeout = 0xFF;
        r.flow_label = u32::MAX;
        r.emit(&mut out);
        let p = ReqRepr::parse(&Mad::new_checked(&out[..]).unwrap()).unwrap();
        assert_eq!((p.retry_count, p.remote_cm_response_timeout), (7, 31));
        assert_eq!((p.flow_label, p.packet_rate), (0xF_FFFF, r.packet_rate));
        assert_eq!(p.local_cm_response_timeout, r.local_cm_response_timeout);
    }

    #[test]
    fn req_bad_length_and_mtu() {
        let b = req_bytes();
        assert_eq!(CmMad::parse(&b[..200]), Err(MadError::Truncated(200)));
        let mut b = req_bytes();
        b[24 + 50] = 0x67; // MTU code 6
        assert_eq!(CmMad::parse(&b), Err(MadError::BadMtu(6)));
    }

    // --- REP -----------------------------------------------------------------------------------

    fn rep_repr() -> RepRepr {
        RepRepr {
            local_comm_id: 0x1111_2222,
            remote_comm_id: 0xA1B2_C3D4,
            local_qkey: 0,
            local_qpn: Qpn::new(0x12_3456),
            starting_psn: Psn::new(0x65_4321),
            responder_resources: 4,
            initiator_depth: 2,
            target_ack_delay: 15,
            failover: 1,
            flow_control: true,
            rnr_retry_count: 6,
            srq: true,
            local_ca_guid: Guid(0x0002_C903_0000_0001),
            private_data: pattern(0x80),
        }
    }

    fn rep_bytes() -> [u8; MAD_LEN] {
        let mut b = hdr(attr::REP);
        let d = &mut b[24..];
        d[0..4].copy_from_slice(&[0x11, 0x11, 0x22, 0x22]);
        d[4..8].copy_from_slice(&[0xA1, 0xB2, 0xC3, 0xD4]);
        d[12..15].copy_from_slice(&[0x12, 0x34, 0x56]);
        d[20..23].copy_from_slice(&[0x65, 0x43, 0x21]);
        d[24] = 4;
        d[25] = 2;
        d[26] = (15 << 3) | (1 << 1) | 1;
        d[27] = (6 << 5) | 0x10;
        d[28..36].copy_from_slice(&[0x00, 0x02, 0xC9, 0x03, 0, 0, 0, 1]);
        d[36..232].copy_from_slice(&pattern::<196>(0x80));
        b
    }

    #[test]
    fn rep_deconstruct() {
        let b = rep_bytes();
        let r = RepRepr::parse(&Mad::new_checked(&b[..]).unwrap()).unwrap();
        assert_eq!(r.local_qpn, Qpn::new(0x12_3456));
        assert_eq!(r.starting_psn, Psn::new(0x65_4321));
        assert_eq!(
            (r.target_ack_delay, r.failover, r.flow_control),
            (15, 1, true)
        );
        assert_eq!((r.rnr_retry_count, r.srq), (6, true));
    }
    #[test]
    fn rep_construct() {
        let m = CmMad {
            transaction_id: TID,
            message: CmMessage::Rep(rep_repr()),
        };
        assert_eq!(m.emit(), rep_bytes());
    }
    #[test]
    fn rep_parse() {
        assert_eq!(
            CmMad::parse(&rep_bytes()).unwrap().message,
            CmMessage::Rep(rep_repr())
        );
    }
    #[test]
    fn rep_emit_round_trip() {
        let mut r = rep_repr();
        r.failover = 2;
        r.srq = false;
        r.local_qpn = Qpn::new(0xFF_FFFF);
        let m = CmMad {
            transaction_id: 7,
            message: CmMessage::Rep(r),
        };
        assert_eq!(CmMad::parse(&m.emit()).unwrap(), m);
    }
    #[test]
    fn rep_bad_length() {
        assert_eq!(
            CmMad::parse(&rep_bytes()[..MAD_LEN - 1]),
            Err(MadError::Truncated(255))
        );
    }

    // --- RTU -----------------------------------------------------------------------------------

    fn rtu_bytes() -> [u8; MAD_LEN] {
        let mut b = hdr(attr::RTU);
        b[24..28].copy_from_slice(&[0, 0, 0, 5]);
        b[28..32].copy_from_slice(&[0, 0, 0, 9]);
        b[32..].copy_from_slice(&pattern::<224>(3));
        b
    }
    fn rtu_repr() -> RtuRepr {
        RtuRepr {
            local_comm_id: 5,
            remote_comm_id: 9,
            private_data: pattern(3),
        }
    }
    #[test]
    fn rtu_deconstruct() {
        let b = rtu_bytes();
        let r = RtuRepr::parse(&Mad::new_checked(&b[..]).unwrap()).unwrap();
        assert_eq!((r.local_comm_id, r.remote_comm_id), (5, 9));
        assert_eq!(r.private_data[0], 3);
    }
    #[test]
    fn rtu_construct() {
        let m = CmMad {
            transaction_id: TID,
            message: CmMessage::Rtu(rtu_repr()),
        };
        assert_eq!(m.emit(), rtu_bytes());
    }
    #[test]
    fn rtu_parse() {
        assert_eq!(
            CmMad::parse(&rtu_bytes()).unwrap().message,
            CmMessage::Rtu(rtu_repr())
        );
    }
    #[test]
    fn rtu_emit_round_trip() {
        let m = CmMad {
            transaction_id: u64::MAX,
            message: CmMessage::Rtu(rtu_repr()),
        };
        assert_eq!(CmMad::parse(&m.emit()).unwrap(), m);
    }
    #[test]
    fn rtu_bad_length() {
        assert!(CmMad::parse(&rtu_bytes()[..24]).is_err());
        assert!(CmMad::parse(&[]).is_err());
    }

    // --- REJ -----------------------------------------------------------------------------------

    fn rej_repr() -> RejRepr {
        let mut ari_bytes = [0u8; 72];
        ari_bytes[..8].copy_from_slice(&0x0002_C903_0000_0001u64.to_be_bytes());
        let mut private_data = [0u8; 148];
        private_data[..4].copy_from_slice(&[0, 0, 6, 0]); // nvme_rdma_cm_rej: NO_RSC
        RejRepr {
            local_comm_id: 0,
            remote_comm_id: 0xA1B2_C3D4,
            message_rejected: MsgRef::Req,
            ari_length: 8,
            reason: RejectReason::CONSUMER_DEFINED,
            ari_bytes,
            private_data,
        }
    }
    fn rej_bytes() -> [u8; MAD_LEN] {
        let mut b = hdr(attr::REJ);
        b[28..32].copy_from_slice(&[0xA1, 0xB2, 0xC3, 0xD4]);
        b[32] = 0; // REQ
        b[33] = 8 << 1;
        b[34..36].copy_from_slice(&[0, 28]);
        b[36..44].copy_from_slice(&[0x00, 0x02, 0xC9, 0x03, 0, 0, 0, 1]);
        b[108..112].copy_from_slice(&[0, 0, 6, 0]);
        b
    }
    #[test]
    fn rej_deconstruct() {
        let b = rej_bytes();
        let r = RejRepr::parse(&Mad::new_checked(&b[..]).unwrap()).unwrap();
        assert_eq!(r.reason, RejectReason::CONSUMER_DEFINED);
        assert_eq!(r.message_rejected, MsgRef::Req);
        assert_eq!(r.ari().len(), 8);
        assert_eq!(&r.private_data[..4], &[0, 0, 6, 0]);
        assert_eq!(r.reason.to_string(), "28 (consumer defined)");
    }
    #[test]
    fn rej_construct() {
        let m = CmMad {
            transaction_id: TID,
            message: CmMessage::Rej(rej_repr()),
        };
        assert_eq!(m.emit(), rej_bytes());
    }
    #[test]
    fn rej_parse() {
        assert_eq!(
            CmMad::parse(&rej_bytes()).unwrap().message,
            CmMessage::Rej(rej_repr())
        );
    }
    #[test]
    fn rej_emit_round_trip_and_long_ari_length() {
        let mut r = rej_repr();
        r.message_rejected = MsgRef::Other;
        r.ari_length = 127; // longer than the field: ari() clamps
        r.reason = RejectReason::STALE_CONN;
        let m = CmMad {
            transaction_id: 1,
            message: CmMessage::Rej(r),
        };
        let p = CmMad::parse(&m.emit()).unwrap();
        assert_eq!(p, m);
        let CmMessage::Rej(p) = p.message else {
            unreachable!()
        };
        assert_eq!(p.ari().len(), 72);
    }
    #[test]
    fn rej_bad_length_and_reserved_msg_ref() {
        assert!(CmMad::parse(&rej_bytes()[..100]).is_err());
        let mut b = rej_bytes();
        b[32] = 3 << 6;
        assert_eq!(CmMad::parse(&b), Err(MadError::BadMsgRef(3)));
    }

    // --- DREQ / DREP ----------------------------------------------------------------------------

    fn dreq_bytes() -> [u8; MAD_LEN] {
        let mut b = hdr(attr::DREQ);
        b[24..28].copy_from_slice(&[0, 0, 1, 0]);
        b[28..32].copy_from_slice(&[0, 0, 2, 0]);
        b[32..36].copy_from_slice(&[0xAB, 0xCD, 0xEF, 0]);
        b[36..].copy_from_slice(&pattern::<220>(9));
        b
    }
    fn dreq_repr() -> DreqRepr {
        DreqRepr {
            local_comm_id: 0x100,
            remote_comm_id: 0x200,
            remote_qpn: Qpn::new(0xAB_CDEF),
            private_data: pattern(9),
        }
    }
    #[test]
    fn dreq_deconstruct() {
        let b = dreq_bytes();
        let r = DreqRepr::parse(&Mad::new_checked(&b[..]).unwrap()).unwrap();
        assert_eq!(r.remote_qpn, Qpn::new(0xAB_CDEF));
        assert_eq!((r.local_comm_id, r.remote_comm_id), (0x100, 0x200));
    }
    #[test]
    fn dreq_construct() {
        let m = CmMad {
            transaction_id: TID,
            message: CmMessage::Dreq(dreq_repr()),
        };
        assert_eq!(m.emit(), dreq_bytes());
    }
    #[test]
    fn dreq_parse() {
        assert_eq!(
            CmMad::parse(&dreq_bytes()).unwrap().message,
            CmMessage::Dreq(dreq_repr())
        );
    }
    #[test]
    fn dreq_emit_round_trip() {
        let m = CmMad {
            transaction_id: 3,
            message: CmMessage::Dreq(dreq_repr()),
        };
        assert_eq!(CmMad::parse(&m.emit()).unwrap(), m);
    }
    #[test]
    fn dreq_bad_length() {
        assert_eq!(
            CmMad::parse(&dreq_bytes()[..255]),
            Err(MadError::Truncated(255))
        );
    }

    fn drep_bytes() -> [u8; MAD_LEN] {
        let mut b = hdr(attr::DREP);
        b[24..28].copy_from_slice(&[0, 0, 2, 0]);
        b[28..32].copy_from_slice(&[0, 0, 1, 0]);
        b[32..].copy_from_slice(&pattern::<224>(1));
        b
    }
    fn drep_repr() -> DrepRepr {
        DrepRepr {
            local_comm_id: 0x200,
            remote_comm_id: 0x100,
            private_data: pattern(1),
        }
    }
    #[test]
    fn drep_deconstruct() {
        let b = drep_bytes();
        let r = DrepRepr::parse(&Mad::new_checked(&b[..]).unwrap()).unwrap();
        assert_eq!((r.local_comm_id, r.remote_comm_id), (0x200, 0x100));
    }
    #[test]
    fn drep_construct() {
        let m = CmMad {
            transaction_id: TID,
            message: CmMessage::Drep(drep_repr()),
        };
        assert_eq!(m.emit(), drep_bytes());
    }
    #[test]
    fn drep_parse() {
        assert_eq!(
            CmMad::parse(&drep_bytes()).unwrap().message,
            CmMessage::Drep(drep_repr())
        );
    }
    #[test]
    fn drep_emit_round_trip() {
        let m = CmMad {
            transaction_id: 4,
            message: CmMessage::Drep(drep_repr()),
        };
        assert_eq!(CmMad::parse(&m.emit()).unwrap(), m);
    }
    #[test]
    fn drep_bad_length() {
        assert!(CmMad::parse(&drep_bytes()[..128]).is_err());
    }

    // --- MRA -----------------------------------------------------------------------------------

    fn mra_bytes() -> [u8; MAD_LEN] {
        let mut b = hdr(attr::MRA);
        b[24..28].copy_from_slice(&[0, 0, 0, 7]);
        b[28..32].copy_from_slice(&[0, 0, 0, 8]);
        b[32] = 1 << 6; // REP MRAed
        b[33] = 24 << 3;
        b[34..].copy_from_slice(&pattern::<222>(5));
        b
    }
    fn mra_repr() -> MraRepr {
        MraRepr {
            local_comm_id: 7,
            remote_comm_id: 8,
            message_mraed: MsgRef::Rep,
            service_timeout: 24,
            private_data: pattern(5),
        }
    }
    #[test]
    fn mra_deconstruct() {
        let b = mra_bytes();
        let r = MraRepr::parse(&Mad::new_checked(&b[..]).unwrap()).unwrap();
        assert_eq!((r.message_mraed, r.service_timeout), (MsgRef::Rep, 24));
    }
    #[test]
    fn mra_construct() {
        let m = CmMad {
            transaction_id: TID,
            message: CmMessage::Mra(mra_repr()),
        };
        assert_eq!(m.emit(), mra_bytes());
    }
    #[test]
    fn mra_parse() {
        assert_eq!(
            CmMad::parse(&mra_bytes()).unwrap().message,
            CmMessage::Mra(mra_repr())
        );
    }
    #[test]
    fn mra_emit_round_trip() {
        let mut r = mra_repr();
        r.message_mraed = MsgRef::Req;
        let m = CmMad {
            transaction_id: 5,
            message: CmMessage::Mra(r),
        };
        assert_eq!(CmMad::parse(&m.emit()).unwrap(), m);
    }
    #[test]
    fn mra_bad_length_and_reserved_msg_ref() {
        assert!(CmMad::parse(&mra_bytes()[..30]).is_err());
        let mut b = mra_bytes();
        b[32] = 0xC0;
        assert_eq!(CmMad::parse(&b), Err(MadError::BadMsgRef(3)));
    }

    #[test]
    fn reject_reason_names() {
        assert_eq!(RejectReason::INVALID_SERVICE_ID.0, 8);
        assert_eq!(RejectReason::STALE_CONN.0, 10);
        assert_eq!(RejectReason(34).describe(), "unrecognised reason");
    }
}

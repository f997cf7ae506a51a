//! Communication Management MADs: the 256-byte management datagram, its 24-byte common header
//! (IBA §13.4.3; Linux `struct ib_mad_hdr`, include/rdma/ib_mad.h) and the values the
//! connected-mode CM messages of IBA §12.6 share (message references, transport types, MTU
//! codes, reject reasons); the messages themselves are in [`super::messages`].
//!
//! Field positions follow include/rdma/ibta_vol1_c12.h (`CM_REQ_*`, `CM_REP_*`, ...), whose
//! offsets count from the end of the MAD header; the `field` modules add the 24 header
//! bytes so every constant is an absolute offset into the MAD. Sub-byte fields are written
//! `[hi:lo]` with bit 7 the most significant, i.e. the GENMASK that the Linux `IBA_FIELD*_LOC`
//! macros (include/rdma/iba.h) derive from the IBA tables' `Byte[Bit]` offsets, which count
//! from the most significant bit: REQ `43[7:3]` is the top five bits of byte 43. Cross-checked
//! against the older accessor form in drivers/infiniband/core/cm_msgs.h (`cm_req_get_*`).
//!
//! Everything is big-endian. A [`Mad`] view is only constructed over exactly 256 bytes, so no
//! accessor and no `parse` can index out of range, whatever the bytes.

use super::{rd16, rd32, rd64, wr16, wr32, wr64};
use crate::verbs::Mtu;
use std::fmt;

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
    pub(super) fn b(&self) -> &[u8] {
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
    pub(super) fn from_bits(b: u8) -> Result<MsgRef, MadError> {
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
    pub(super) fn from_bits(b: u8) -> TransportType {
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

//! NVMe over Fabrics: the Fabrics commands (Connect, Property Get/Set) overlaid on the SQE,
//! the 1024-byte Connect data, NQNs, and the offsets of the controller properties
//! ([`super::registers`]) the host reads and writes through Property Get/Set.
//!
//! Layouts (all little-endian), checked against Linux `include/linux/nvme.h` and SPDK
//! `include/spdk/nvmf_spec.h`:
//! - `struct nvmf_connect_command` / `spdk_nvmf_fabric_connect_cmd`: opcode 0x7F, fctype at
//!   byte 4, dptr 24..40, recfmt le16 @40, qid le16 @42, sqsize le16 @44, cattr u8 @46,
//!   kato le32 @48.
//! - `struct nvmf_property_set_command` / `spdk_nvmf_fabric_prop_set_cmd`: attrib u8 @40,
//!   offset le32 @44, value le64 @48. `nvmf_property_get_command`: attrib @40, offset @44.
//! - `struct nvmf_connect_data` / `spdk_nvmf_fabric_connect_data` (1024 B): `hostid[16]` @0,
//!   cntlid le16 @16, `subsysnqn[256]` @256, `hostnqn[256]` @512.
//! - Register offsets: Linux `NVME_REG_CAP` 0x00, `NVME_REG_VS` 0x08, `NVME_REG_CC` 0x14,
//!   `NVME_REG_CSTS` 0x1C.

use std::fmt;

use super::admin::opcode;
use super::sqe::Sqe;
use super::{array, check_len, le16, put16, NvmeWireError};

/// Fabrics command types (the fctype byte).
pub mod fctype {
    pub const PROPERTY_SET: u8 = 0x00;
    pub const CONNECT: u8 = 0x01;
    pub const PROPERTY_GET: u8 = 0x04;
    pub const AUTH_SEND: u8 = 0x05;
    pub const AUTH_RECEIVE: u8 = 0x06;
    pub const DISCONNECT: u8 = 0x08;
}

mod cmd_field {
    /// Byte 0 of the NSID field.
    pub const FCTYPE: usize = 4;
}

/// Connect attribute bit 2: the host asks for SQ flow control to be disabled (Linux
/// `NVME_CONNECT_DISABLE_SQFLOW`).
pub const CATTR_DISABLE_SQ_FLOW_CONTROL: u8 = 1 << 2;
/// CNTLID in the admin queue's Connect data: "any controller" (dynamic controller model).
pub const CNTLID_DYNAMIC: u16 = 0xFFFF;
/// Connect record format 0 (the only one defined).
pub const RECFMT_0: u16 = 0;
/// The smallest admin submission queue a Fabrics controller must accept (Linux sends
/// sqsize 31 = 32 entries, "the minimum size specified by the Fabrics standard").
pub const MIN_ADMIN_SQ_ENTRIES: u16 = 32;

/// A Fabrics command (opcode 0x7F) decoded from, or encoded into, an [`Sqe`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FabricsCmd {
    /// Create a queue (qid 0 = admin) and bind it to a controller; the Connect data (1024 B,
    /// [`ConnectData`]) travels through the SGL.
    Connect {
        recfmt: u16,
        qid: u16,
        /// Submission queue size, 0's based.
        sqsize: u16,
        cattr: u8,
        /// Keep-alive timeout in milliseconds (admin queue only; 0 = off).
        kato_ms: u32,
    },
    /// Read a controller property; the value comes back in the CQE result.
    PropertyGet { size8: bool, offset: u32 },
    /// Write a controller property. A 4-byte property uses the low 32 bits of `value`.
    PropertySet {
        size8: bool,
        offset: u32,
        value: u64,
    },
}

const ATTRIB_SIZE_MASK: u8 = 0x07;

impl FabricsCmd {
    /// Read property `offset` with the size the register has ([`reg::size8`]).
    pub fn get(offset: u32) -> FabricsCmd {
        FabricsCmd::PropertyGet {
            size8: reg::size8(offset),
            offset,
        }
    }

    /// Write `value` to property `offset` with the size the register has.
    pub fn set(offset: u32, value: u64) -> FabricsCmd {
        FabricsCmd::PropertySet {
            size8: reg::size8(offset),
            offset,
            value,
        }
    }

    /// The fctype byte of this command.
    pub fn fctype(&self) -> u8 {
        match self {
            FabricsCmd::Connect { .. } => fctype::CONNECT,
            FabricsCmd::PropertyGet { .. } => fctype::PROPERTY_GET,
            FabricsCmd::PropertySet { .. } => fctype::PROPERTY_SET,
        }
    }

    /// Decode a Fabrics command from a parsed SQE. Reserved bytes are ignored.
    pub fn from_sqe(s: &Sqe) -> Result<FabricsCmd, NvmeWireError> {
        if s.opcode != opcode::FABRICS {
            return Err(NvmeWireError::NotFabrics {
                cid: s.cid,
                opcode: s.opcode,
            });
        }
        // fctype is byte 4 of the SQE, the low byte of the (little-endian) NSID field.
        let fct = s.nsid.to_le_bytes()[cmd_field::FCTYPE - 4];
        let attrib = s.cdw10 as u8;
        let size8 = || match attrib & ATTRIB_SIZE_MASK {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(NvmeWireError::BadPropertySize { cid: s.cid, attrib }),
        };
        match fct {
            fctype::CONNECT => Ok(FabricsCmd::Connect {
                recfmt: s.cdw10 as u16,
                qid: (s.cdw10 >> 16) as u16,
                sqsize: s.cdw11 as u16,
                cattr: (s.cdw11 >> 16) as u8,
                kato_ms: s.cdw12,
            }),
            fctype::PROPERTY_GET => Ok(FabricsCmd::PropertyGet {
                size8: size8()?,
                offset: s.cdw11,
            }),
            fctype::PROPERTY_SET => Ok(FabricsCmd::PropertySet {
                size8: size8()?,
                offset: s.cdw11,
                value: u64::from(s.cdw12) | u64::from(s.cdw13) << 32,
            }),
            f => Err(NvmeWireError::UnknownFctype {
                cid: s.cid,
                fctype: f,
            }),
        }
    }

    /// Parse a Fabrics command straight from capsule bytes.
    pub fn parse(b: &[u8]) -> Result<FabricsCmd, NvmeWireError> {
        FabricsCmd::from_sqe(&Sqe::parse(b)?)
    }

    /// Encode into an SQE with a NULL SGL; a Connect needs its data's SGL set afterwards.
    pub fn to_sqe(&self, cid: u16) -> Sqe {
        let mut s = Sqe::new(opcode::FABRICS, cid);
        s.nsid = u32::from(self.fctype());
        match *self {
            FabricsCmd::Connect {
                recfmt,
                qid,
                sqsize,
                cattr,
                kato_ms,
            } => {
                s.cdw10 = u32::from(recfmt) | u32::from(qid) << 16;
                s.cdw11 = u32::from(sqsize) | u32::from(cattr) << 16;
                s.cdw12 = kato_ms;
            }
            FabricsCmd::PropertyGet { size8, offset } => {
                s.cdw10 = u32::from(size8);
                s.cdw11 = offset;
            }
            FabricsCmd::PropertySet {
                size8,
                offset,
                value,
            } => {
                s.cdw10 = u32::from(size8);
                s.cdw11 = offset;
                s.cdw12 = value as u32;
                s.cdw13 = (value >> 32) as u32;
            }
        }
        s
    }
}

/// What the CQE result of a Connect says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectResult {
    /// Success: the controller ID (bits 15:0) and AUTHREQ (bits 31:16).
    Ok { cntlid: u16, authreq: u16 },
    /// Connect Invalid Parameters: which byte (IPO) of the SQE (IATTR 0) or of the Connect
    /// data (IATTR 1) was refused.
    InvalidParameter { ipo: u16, iattr: u8 },
}

impl ConnectResult {
    /// Read the result field given the completion's success.
    pub fn from_result(result: u64, success: bool) -> ConnectResult {
        let dw0 = result as u32;
        if success {
            ConnectResult::Ok {
                cntlid: dw0 as u16,
                authreq: (dw0 >> 16) as u16,
            }
        } else {
            ConnectResult::InvalidParameter {
                ipo: dw0 as u16,
                iattr: (dw0 >> 16) as u8,
            }
        }
    }

    pub fn to_result(&self) -> u64 {
        match *self {
            ConnectResult::Ok { cntlid, authreq } => u64::from(cntlid) | u64::from(authreq) << 16,
            ConnectResult::InvalidParameter { ipo, iattr } => {
                u64::from(ipo) | u64::from(iattr) << 16
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Fixed-width text fields and NQNs
// ---------------------------------------------------------------------------------------

/// A fixed-width text field as it sits in a data structure (serial number, model, transport
/// address, ...), kept byte for byte so that parse -> emit reproduces it. [`FixedStr::text`]
/// reads it the way people mean it: up to the first NUL, trailing spaces trimmed.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct FixedStr<const N: usize>(pub [u8; N]);

impl<const N: usize> FixedStr<N> {
    /// `s` NUL-padded; fails if it does not fit.
    pub fn new(s: &str) -> Result<Self, NvmeWireError> {
        Self::padded(s, 0)
    }

    /// `s` space-padded, as Identify SN/MN/FR are.
    pub fn new_spaced(s: &str) -> Result<Self, NvmeWireError> {
        Self::padded(s, b' ')
    }

    fn padded(s: &str, pad: u8) -> Result<Self, NvmeWireError> {
        if s.len() > N {
            return Err(NvmeWireError::OutOfRange {
                what: "text field length",
                value: s.len() as u64,
                min: 0,
                max: N as u64,
            });
        }
        let mut a = [pad; N];
        a[..s.len()].copy_from_slice(s.as_bytes());
        Ok(FixedStr(a))
    }

    pub fn zeroed() -> Self {
        FixedStr([0; N])
    }

    /// The text up to the first NUL, trailing spaces trimmed; if the bytes are not UTF-8,
    /// the longest valid prefix.
    pub fn text(&self) -> &str {
        let end = self.0.iter().position(|&c| c == 0).unwrap_or(N);
        let raw = &self.0[..end];
        let s = match std::str::from_utf8(raw) {
            Ok(s) => s,
            // `valid_up_to` is a char boundary, so this cannot fail.
            Err(e) => std::str::from_utf8(&raw[..e.valid_up_to()]).unwrap_or(""),
        };
        s.trim_end_matches(' ')
    }
}

impl<const N: usize> fmt::Debug for FixedStr<N> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.text())
    }
}

/// Longest NQN (Linux `NVMF_NQN_SIZE`, SPDK `SPDK_NVMF_NQN_MAX_LEN`).
pub const NQN_MAX_LEN: usize = 223;
/// Width of an NQN field in Connect data, Identify and the discovery log
/// (`NVMF_NQN_FIELD_LEN`).
pub const NQN_FIELD_LEN: usize = 256;
/// The well-known discovery subsystem (Linux `NVME_DISC_SUBSYS_NAME`).
pub const DISCOVERY_NQN: &str = "nqn.2014-08.org.nvmexpress.discovery";
/// Prefix of a UUID-based NQN (SPDK `SPDK_NVMF_NQN_UUID_PRE`).
pub const UUID_NQN_PREFIX: &str = "nqn.2014-08.org.nvmexpress:uuid:";

/// An NVMe Qualified Name: 1..=223 bytes of printable ASCII, stored inline (no heap, so a
/// reconnect can rebuild Connect data without allocating).
#[derive(Clone, Copy)]
pub struct Nqn {
    len: u8,
    buf: [u8; NQN_MAX_LEN],
}

impl Nqn {
    /// Validate and store `s`.
    pub fn new(s: &str) -> Result<Nqn, NvmeWireError> {
        Nqn::from_bytes("NQN", s.as_bytes())
    }

    fn from_bytes(field: &'static str, b: &[u8]) -> Result<Nqn, NvmeWireError> {
        let bad = |reason| Err(NvmeWireError::BadNqn { field, reason });
        if b.is_empty() {
            return bad("empty");
        }
        if b.len() > NQN_MAX_LEN {
            return bad("longer than 223 bytes");
        }
        if !b.iter().all(|c| (0x20..=0x7E).contains(c)) {
            return bad("not printable ASCII");
        }
        let mut buf = [0u8; NQN_MAX_LEN];
        buf[..b.len()].copy_from_slice(b);
        Ok(Nqn {
            len: b.len() as u8,
            buf,
        })
    }

    /// `nqn.2014-08.org.nvmexpress.discovery`.
    pub fn discovery() -> Nqn {
        Nqn::from_bytes("NQN", DISCOVERY_NQN.as_bytes()).unwrap_or_else(|_| unreachable!())
    }

    /// `nqn.2014-08.org.nvmexpress:uuid:<uuid>`, the default host NQN form (lower-case
    /// 8-4-4-4-12 hex, as `nvme gen-hostnqn` writes it).
    pub fn from_uuid(uuid: &[u8; 16]) -> Nqn {
        let mut buf = [0u8; NQN_MAX_LEN];
        let p = UUID_NQN_PREFIX.len();
        buf[..p].copy_from_slice(UUID_NQN_PREFIX.as_bytes());
        let u = format_uuid(uuid);
        buf[p..p + u.len()].copy_from_slice(&u);
        Nqn {
            len: (p + u.len()) as u8,
            buf,
        }
    }

    pub fn as_str(&self) -> &str {
        // Only printable ASCII is ever stored.
        std::str::from_utf8(self.as_bytes()).unwrap_or("")
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.buf[..usize::from(self.len)]
    }

    pub fn is_discovery(&self) -> bool {
        self.as_str() == DISCOVERY_NQN
    }

    /// Read a 256-byte NQN field: the name must be NUL-terminated inside the field (so at
    /// most 223 bytes followed by a NUL); what follows the NUL is ignored.
    pub fn parse_field(field: &'static str, b: &[u8]) -> Result<Nqn, NvmeWireError> {
        check_len(field, b, NQN_FIELD_LEN)?;
        let b = &b[..NQN_FIELD_LEN];
        match b.iter().position(|&c| c == 0) {
            Some(end) => Nqn::from_bytes(field, &b[..end]),
            None => Err(NvmeWireError::BadNqn {
                field,
                reason: "not NUL-terminated",
            }),
        }
    }

    /// Write the name NUL-padded into a 256-byte field.
    pub fn emit_field(&self, out: &mut [u8; NQN_FIELD_LEN]) {
        *out = [0; NQN_FIELD_LEN];
        out[..usize::from(self.len)].copy_from_slice(self.as_bytes());
    }
}

impl PartialEq for Nqn {
    fn eq(&self, other: &Nqn) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}
impl Eq for Nqn {}
impl std::hash::Hash for Nqn {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        self.as_bytes().hash(h)
    }
}
impl fmt::Debug for Nqn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Nqn({:?})", self.as_str())
    }
}
impl fmt::Display for Nqn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
impl std::str::FromStr for Nqn {
    type Err = NvmeWireError;
    fn from_str(s: &str) -> Result<Nqn, NvmeWireError> {
        Nqn::new(s)
    }
}

/// A UUID as 36 bytes of lower-case 8-4-4-4-12 hex.
pub fn format_uuid(u: &[u8; 16]) -> [u8; 36] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut out = [0u8; 36];
    let mut o = 0;
    for (i, byte) in u.iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            out[o] = b'-';
            o += 1;
        }
        out[o] = HEX[usize::from(byte >> 4)];
        out[o + 1] = HEX[usize::from(byte & 0xF)];
        o += 2;
    }
    out
}

// ---------------------------------------------------------------------------------------
// Connect data
// ---------------------------------------------------------------------------------------

mod connect_field {
    pub const HOSTID: usize = 0;
    pub const CNTLID: usize = 16;
    pub const SUBNQN: usize = 256;
    pub const HOSTNQN: usize = 512;
    pub const SIZE: usize = 1024;
}

/// The data of a Connect command (1024 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConnectData {
    /// Host identifier (a UUID); a target refuses the same host NQN with another host ID.
    pub hostid: [u8; 16],
    /// [`CNTLID_DYNAMIC`] on the admin queue; the CNTLID the admin Connect returned on I/O
    /// queues.
    pub cntlid: u16,
    pub subnqn: Nqn,
    pub hostnqn: Nqn,
}

impl ConnectData {
    pub const LEN: usize = connect_field::SIZE;

    /// Parse and validate both NQNs (non-empty, <= 223 bytes, printable ASCII,
    /// NUL-terminated in their fields). Reserved bytes are ignored.
    pub fn parse(b: &[u8]) -> Result<ConnectData, NvmeWireError> {
        check_len("Connect data", b, connect_field::SIZE)?;
        Ok(ConnectData {
            hostid: array(b, connect_field::HOSTID),
            cntlid: le16(b, connect_field::CNTLID),
            subnqn: Nqn::parse_field("SUBNQN", &b[connect_field::SUBNQN..])?,
            hostnqn: Nqn::parse_field("HOSTNQN", &b[connect_field::HOSTNQN..])?,
        })
    }

    /// Write the 1024 bytes, reserved ones zeroed.
    pub fn emit(&self, out: &mut [u8; 1024]) {
        *out = [0; 1024];
        out[connect_field::HOSTID..connect_field::HOSTID + 16].copy_from_slice(&self.hostid);
        put16(out, connect_field::CNTLID, self.cntlid);
        let mut f = [0u8; NQN_FIELD_LEN];
        self.subnqn.emit_field(&mut f);
        out[connect_field::SUBNQN..connect_field::SUBNQN + NQN_FIELD_LEN].copy_from_slice(&f);
        self.hostnqn.emit_field(&mut f);
        out[connect_field::HOSTNQN..connect_field::HOSTNQN + NQN_FIELD_LEN].copy_from_slice(&f);
    }

    pub fn to_bytes(&self) -> [u8; 1024] {
        let mut out = [0u8; 1024];
        self.emit(&mut out);
        out
    }
}

// ---------------------------------------------------------------------------------------
// Controller properties (registers)
// ---------------------------------------------------------------------------------------

/// Controller property offsets for Property Get/Set.
pub mod reg {
    /// Controller Capabilities, 8 bytes.
    pub const CAP: u32 = 0x00;
    /// Version, 4 bytes.
    pub const VS: u32 = 0x08;
    /// Controller Configuration, 4 bytes.
    pub const CC: u32 = 0x14;
    /// Controller Status, 4 bytes.
    pub const CSTS: u32 = 0x1C;
    /// NVM Subsystem Reset, 4 bytes.
    pub const NSSR: u32 = 0x20;

    /// Whether the property at `offset` is 8 bytes wide (CAP, ASQ 0x28, ACQ 0x30).
    pub fn size8(offset: u32) -> bool {
        matches!(offset, CAP | 0x28 | 0x30)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host_uuid() -> [u8; 16] {
        [
            0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab,
            0xcd, 0xef,
        ]
    }

    #[test]
    fn connect_sqe_offsets() {
        // The byte offsets of Linux `struct nvmf_connect_command`.
        let c = FabricsCmd::Connect {
            recfmt: 0,
            qid: 3,
            sqsize: 127,
            cattr: CATTR_DISABLE_SQ_FLOW_CONTROL,
            kato_ms: 5000,
        };
        let b = c.to_sqe(7).to_bytes();
        assert_eq!(b[0], 0x7F);
        assert_eq!(b[1], 0x40);
        assert_eq!(&b[2..4], &[7, 0]);
        assert_eq!(b[4], 0x01, "fctype");
        assert_eq!(&b[40..42], &[0, 0], "recfmt");
        assert_eq!(&b[42..44], &[3, 0], "qid");
        assert_eq!(&b[44..46], &[127, 0], "sqsize");
        assert_eq!(b[46], 0x04, "cattr");
        assert_eq!(b[47], 0);
        assert_eq!(&b[48..52], &5000u32.to_le_bytes(), "kato");
        assert!(b[52..64].iter().all(|&x| x == 0));
        assert_eq!(FabricsCmd::parse(&b).unwrap(), c);
    }

    #[test]
    fn property_sqe_offsets() {
        let s = FabricsCmd::set(reg::CC, 0x0046_0001);
        assert_eq!(
            s,
            FabricsCmd::PropertySet {
                size8: false,
                offset: 0x14,
                value: 0x0046_0001
            }
        );
        let b = s.to_sqe(1).to_bytes();
        assert_eq!(b[4], 0x00, "fctype property set");
        assert_eq!(b[40], 0, "attrib: 4 bytes");
        assert_eq!(&b[44..48], &[0x14, 0, 0, 0]);
        assert_eq!(&b[48..56], &0x0046_0001u64.to_le_bytes());
        assert_eq!(FabricsCmd::parse(&b).unwrap(), s);

        let g = FabricsCmd::get(reg::CAP);
        let b = g.to_sqe(2).to_bytes();
        assert_eq!(b[4], 0x04, "fctype property get");
        assert_eq!(b[40], 1, "attrib: 8 bytes");
        assert_eq!(&b[44..48], &[0, 0, 0, 0]);
        assert_eq!(FabricsCmd::parse(&b).unwrap(), g);

        let s8 = FabricsCmd::PropertySet {
            size8: true,
            offset: 0x28,
            value: u64::MAX - 1,
        };
        assert_eq!(FabricsCmd::parse(&s8.to_sqe(3).to_bytes()).unwrap(), s8);
    }

    #[test]
    fn fabrics_errors() {
        let mut s = FabricsCmd::get(reg::CSTS).to_sqe(9);
        s.cdw10 = 2;
        assert_eq!(
            FabricsCmd::from_sqe(&s),
            Err(NvmeWireError::BadPropertySize { cid: 9, attrib: 2 })
        );
        s.nsid = u32::from(fctype::AUTH_SEND);
        assert_eq!(
            FabricsCmd::from_sqe(&s),
            Err(NvmeWireError::UnknownFctype {
                cid: 9,
                fctype: 0x05
            })
        );
        s.opcode = 0x06;
        assert_eq!(
            FabricsCmd::from_sqe(&s),
            Err(NvmeWireError::NotFabrics { cid: 9, opcode: 6 })
        );
        assert!(FabricsCmd::parse(&[0x7F; 63]).is_err());
    }

    #[test]
    fn connect_result() {
        let r = ConnectResult::Ok {
            cntlid: 0x0102,
            authreq: 0,
        };
        assert_eq!(r.to_result(), 0x0102);
        assert_eq!(ConnectResult::from_result(r.to_result(), true), r);
        let e = ConnectResult::InvalidParameter { ipo: 512, iattr: 1 };
        assert_eq!(ConnectResult::from_result(e.to_result(), false), e);
    }

    fn connect_data() -> ConnectData {
        ConnectData {
            hostid: host_uuid(),
            cntlid: CNTLID_DYNAMIC,
            subnqn: Nqn::new("nqn.2024-01.io.example:disk1").unwrap(),
            hostnqn: Nqn::from_uuid(&host_uuid()),
        }
    }

    fn connect_bytes() -> [u8; 1024] {
        let mut b = [0u8; 1024];
        b[..16].copy_from_slice(&host_uuid());
        b[16] = 0xFF;
        b[17] = 0xFF;
        let sub = b"nqn.2024-01.io.example:disk1";
        b[256..256 + sub.len()].copy_from_slice(sub);
        let host = b"nqn.2014-08.org.nvmexpress:uuid:12345678-9abc-def0-0123-456789abcdef";
        b[512..512 + host.len()].copy_from_slice(host);
        b
    }

    #[test]
    fn connect_data_deconstruct() {
        let d = ConnectData::parse(&connect_bytes()).unwrap();
        assert_eq!(d.hostid, host_uuid());
        assert_eq!(d.cntlid, 0xFFFF);
        assert_eq!(d.subnqn.as_str(), "nqn.2024-01.io.example:disk1");
        assert_eq!(
            d.hostnqn.as_str(),
            "nqn.2014-08.org.nvmexpress:uuid:12345678-9abc-def0-0123-456789abcdef"
        );
    }

    #[test]
    fn connect_data_construct() {
        assert_eq!(connect_data().to_bytes(), connect_bytes());
    }

    #[test]
    fn connect_data_round_trip() {
        let d = connect_data();
        assert_eq!(ConnectData::parse(&d.to_bytes()).unwrap(), d);
        let mut long = [b'a'; NQN_MAX_LEN];
        long[..4].copy_from_slice(b"nqn.");
        let d = ConnectData {
            hostid: [0; 16],
            cntlid: 1,
            subnqn: Nqn::discovery(),
            hostnqn: Nqn::new(std::str::from_utf8(&long).unwrap()).unwrap(),
        };
        assert_eq!(ConnectData::parse(&d.to_bytes()).unwrap(), d);
    }

    #[test]
    fn connect_data_bad() {
        assert!(ConnectData::parse(&connect_bytes()[..1023]).is_err());
        let mut b = connect_bytes();
        b[256..512].fill(0);
        assert_eq!(
            ConnectData::parse(&b),
            Err(NvmeWireError::BadNqn {
                field: "SUBNQN",
                reason: "empty"
            })
        );
        let mut b = connect_bytes();
        b[512..768].fill(b'x');
        assert_eq!(
            ConnectData::parse(&b),
            Err(NvmeWireError::BadNqn {
                field: "HOSTNQN",
                reason: "not NUL-terminated"
            })
        );
        let mut b = connect_bytes();
        b[512..512 + 224].fill(b'x');
        assert_eq!(
            ConnectData::parse(&b).unwrap_err(),
            NvmeWireError::BadNqn {
                field: "HOSTNQN",
                reason: "longer than 223 bytes"
            }
        );
        let mut b = connect_bytes();
        b[260] = 0x07;
        assert!(ConnectData::parse(&b).is_err());
        assert!(Nqn::new("nqn.é").is_err());
    }

    #[test]
    fn nqns() {
        assert!(Nqn::discovery().is_discovery());
        assert_eq!(
            Nqn::discovery().as_str(),
            "nqn.2014-08.org.nvmexpress.discovery"
        );
        let n = Nqn::from_uuid(&[0; 16]);
        assert_eq!(
            n.to_string(),
            "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-000000000000"
        );
        assert_eq!("nqn.x".parse::<Nqn>().unwrap().as_bytes(), b"nqn.x");
    }

    #[test]
    fn fixed_str() {
        let s = FixedStr::<20>::new_spaced("SN123").unwrap();
        assert_eq!(&s.0[..7], b"SN123  ");
        assert_eq!(s.text(), "SN123");
        assert_eq!(FixedStr::<8>::new("1.0").unwrap().text(), "1.0");
        assert!(FixedStr::<4>::new("12345").is_err());
        assert_eq!(FixedStr([b'a', 0xFF, b'b', 0]).text(), "a");
        assert_eq!(FixedStr::<4>::zeroed().text(), "");
    }
}

//! NVMe and NVMe-oF data structures, as plain values that parse from and emit to
//! little-endian bytes. No I/O, no clock, no async, nothing from `crate::hca`: the transport
//! puts these bytes into RDMA SENDs, the built-in target takes them apart again.
//!
//! Which file implements which part of which spec (NVMe Base 2.0 = "Base", NVMe-oF 1.1 =
//! "Fabrics"; layouts cross-checked against Linux `include/linux/nvme.h` and SPDK
//! `include/spdk/nvme_spec.h` / `nvmf_spec.h`, cited next to each `field` module):
//!
//! - `sqe.rs`: the 64-byte submission queue entry, PSDT/FUSE flags (Base: Common Command
//!   Format).
//! - `cqe.rs`: the 16-byte completion queue entry (Base: Common Completion Queue Entry).
//! - `sgl.rs`: keyed, in-capsule (offset subtype) and NULL SGL descriptors (Base: SGL
//!   Descriptor formats; Fabrics: RDMA transport binding, keyed SGL).
//! - `status.rs`: the status field, human messages, status values a target produces (Base:
//!   Status Field and the Generic / Command Specific / Media / Path status code tables;
//!   Fabrics: Connect status codes).
//! - `fabrics.rs`: Fabrics commands (Connect, Property Get/Set), Connect data, NQNs,
//!   property offsets (Fabrics: Fabrics Command Set).
//! - `registers.rs`: the CAP/VS/CC/CSTS properties and their bit fields (Base: Controller
//!   Registers / Properties).
//! - `admin.rs`: admin and NVM I/O opcodes, command builders, DSM ranges (Base: Admin
//!   Command Set; NVM Command Set: Read, Write, Write Zeroes, Dataset Management, Flush).
//! - `identify.rs`: Identify Controller data; `identify/namespace.rs`: Identify Namespace
//!   data, the active namespace list and namespace identification descriptors (Base:
//!   Identify command data structures).
//! - `discovery.rs`: the Discovery Log Page header and entries (Fabrics: Discovery Log Page).
//! - `ccr.rs`: Cross-Controller Reset: the command, its completion, the CCR log page and its
//!   asynchronous event (TP8028; CQT and CIU/CIRN live in `identify.rs`).
//!
//! Parsers take `&[u8]`, check the length first and never panic, whatever the bytes (the
//! property tests in `tests/suite/nvme_props.rs` and the `capsule` fuzz target hold them to
//! that).
//! Emitters take fixed-size arrays, so a short buffer is a compile error, not a panic.
//! A completion status is data ([`Status`]), never an `Err` of these parsers.

pub mod admin;
pub mod ana;
pub mod ccr;
pub mod cqe;
pub mod discovery;
pub mod fabrics;
pub mod identify;
pub mod registers;
pub mod sgl;
pub mod sqe;
pub mod status;

pub use admin::{opcode, DsmRange};
pub use cqe::Cqe;
pub use discovery::{DiscoveryLogEntry, DiscoveryLogHeader, RdmaTsas};
pub use fabrics::{ConnectData, FabricsCmd, FixedStr, Nqn};
pub use identify::{IdentifyController, IdentifyNamespace, LbaFormat, NsIdentity};
pub use registers::{Cap, Cc, Csts, Vs};
pub use sgl::SglDescriptor;
pub use sqe::{Fuse, Sqe};
pub use status::{NvmeError, Status, StatusType};

/// Why bytes handed to a parser here (or values handed to a builder) do not make a valid NVMe
/// structure. Every variant is permanent for the input at hand: retrying the same bytes gives
/// the same answer. A target answers most of them with a status, see [`NvmeWireError::cid`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NvmeWireError {
    #[error("{what} truncated: need {need} bytes, have {have}")]
    Truncated {
        what: &'static str,
        need: usize,
        have: usize,
    },
    /// PSDT is not "SGL, MPTR is one buffer" (01b) or FUSE is the reserved 11b. Fabrics
    /// requires SGLs on every command; Linux nvmet answers Invalid Field with DNR.
    #[error("command {cid:#06x}: flags {flags:#04x} are not PSDT=SGL (0x40) with a valid FUSE")]
    BadFlags { cid: u16, flags: u8 },
    #[error("command {cid:#06x}: opcode {opcode:#04x} is not a Fabrics command (0x7f)")]
    NotFabrics { cid: u16, opcode: u8 },
    #[error("command {cid:#06x}: Fabrics command type {fctype:#04x} is not supported")]
    UnknownFctype { cid: u16, fctype: u8 },
    #[error("command {cid:#06x}: property attribute {attrib:#04x} has a reserved size")]
    BadPropertySize { cid: u16, attrib: u8 },
    #[error("SGL descriptor type {0:#04x} is not keyed (0x40, 0x4f) or in-capsule (0x01)")]
    BadSglType(u8),
    #[error("keyed SGL length {0} exceeds 16 MiB - 1")]
    SglTooLong(u64),
    #[error("{field}: {reason}")]
    BadNqn {
        field: &'static str,
        reason: &'static str,
    },
    #[error("{what}: {value} is out of range {min}..={max}")]
    OutOfRange {
        what: &'static str,
        value: u64,
        min: u64,
        max: u64,
    },
}

impl NvmeWireError {
    /// The command identifier, when the error is about a command whose CID could be read: a
    /// target completes that command with Invalid Field instead of dropping it.
    pub fn cid(&self) -> Option<u16> {
        match *self {
            NvmeWireError::BadFlags { cid, .. }
            | NvmeWireError::NotFabrics { cid, .. }
            | NvmeWireError::UnknownFctype { cid, .. }
            | NvmeWireError::BadPropertySize { cid, .. } => Some(cid),
            _ => None,
        }
    }
}

// Little-endian field access. Callers have checked the length (parsers through `check_len`,
// emitters through their fixed-size array types), so the slicing below cannot fail.

#[inline]
pub(crate) fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
#[inline]
pub(crate) fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
#[inline]
pub(crate) fn le64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}
#[inline]
pub(crate) fn put16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_le_bytes());
}
#[inline]
pub(crate) fn put32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
#[inline]
pub(crate) fn put64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

#[inline]
pub(crate) fn check_len(what: &'static str, b: &[u8], need: usize) -> Result<(), NvmeWireError> {
    if b.len() < need {
        Err(NvmeWireError::Truncated {
            what,
            need,
            have: b.len(),
        })
    } else {
        Ok(())
    }
}

/// Copy `N` bytes starting at `at`; the caller has checked the length.
#[inline]
pub(crate) fn array<const N: usize>(b: &[u8], at: usize) -> [u8; N] {
    let mut a = [0u8; N];
    a.copy_from_slice(&b[at..at + N]);
    a
}

//! RoCEv2 wire format: checked zero-copy views and `Repr` types for the InfiniBand transport
//! headers carried in UDP port 4791, the opcode table, and the invariant CRC.
//!
//! Nothing here does I/O or reads a clock. Every accessor on a view is only reachable after a
//! `new_checked` length check, so no input can make it panic.

mod aeth;
mod bth;
mod deth;
mod icrc;
mod imm;
mod ipv4;
mod opcode;
mod packet;
mod reth;

pub use aeth::{Aeth, AethRepr, AethSyndrome, NakCode};
pub use bth::{Bth, BthRepr};
pub use deth::{Deth, DethRepr, GSI_QKEY};
pub use icrc::{icrc, IcrcContext};
pub use imm::{Ieth, ImmDt};
pub use ipv4::Ipv4Udp;
pub use opcode::{HdrMask, MsgPos, OpClass, Opcode, OpcodeInfo, OPCODE_TABLE};
pub use packet::{emit_packet, fill_icrc, finish_packet, PacketHeaders, ParsedPacket, MAX_PAYLOAD};
pub use reth::{Reth, RethRepr};

/// The UDP destination port IANA assigned to RoCEv2.
pub const ROCEV2_PORT: u16 = 4791;
/// The invariant CRC trailer on every RoCEv2 packet.
pub const ICRC_LEN: usize = 4;

/// Why a received datagram was not a valid RoCEv2 packet. Every variant is permanent for the
/// packet at hand: the caller drops it and counts it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("{what} truncated: need {need} bytes, have {have}")]
    Truncated {
        what: &'static str,
        need: usize,
        have: usize,
    },
    #[error("opcode {0:#04x} is reserved or unsupported")]
    BadOpcode(u8),
    #[error("transport header version {0} is not 0")]
    BadTver(u8),
    #[error("pad count {pad} exceeds payload length {payload}")]
    BadPad { pad: usize, payload: usize },
    #[error("ICRC mismatch: computed {computed:#010x}, packet carries {carried:#010x}")]
    IcrcMismatch { computed: u32, carried: u32 },
    #[error("packet of {0} bytes exceeds the largest RoCEv2 packet")]
    TooLong(usize),
    #[error("IPv4 datagram not a RoCEv2 carrier: {0}")]
    BadIpHeader(&'static str),
}

/// Read a big-endian field; callers have already checked the length.
#[inline]
pub(crate) fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}
#[inline]
pub(crate) fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
#[inline]
pub(crate) fn be64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(a)
}

#[inline]
pub(crate) fn check_len(what: &'static str, b: &[u8], need: usize) -> Result<(), WireError> {
    if b.len() < need {
        Err(WireError::Truncated {
            what,
            need,
            have: b.len(),
        })
    } else {
        Ok(())
    }
}

//! The 256-entry opcode table (IBA 9.2.1 table 38; rxe_opcode.c `rxe_opcode[]`), kept as
//! data: for each opcode, which extension headers follow the BTH, whether it carries a
//! payload, and where it sits in a message. Parsers and the QP engine look here instead of
//! matching on opcodes in many places.

use bitflags::bitflags;

/// A BTH opcode byte that names a supported operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Opcode(pub u8);

#[allow(missing_docs)]
impl Opcode {
    pub const RC_SEND_FIRST: Opcode = Opcode(0x00);
    pub const RC_SEND_MIDDLE: Opcode = Opcode(0x01);
    pub const RC_SEND_LAST: Opcode = Opcode(0x02);
    pub const RC_SEND_LAST_WITH_IMMEDIATE: Opcode = Opcode(0x03);
    pub const RC_SEND_ONLY: Opcode = Opcode(0x04);
    pub const RC_SEND_ONLY_WITH_IMMEDIATE: Opcode = Opcode(0x05);
    pub const RC_RDMA_WRITE_FIRST: Opcode = Opcode(0x06);
    pub const RC_RDMA_WRITE_MIDDLE: Opcode = Opcode(0x07);
    pub const RC_RDMA_WRITE_LAST: Opcode = Opcode(0x08);
    pub const RC_RDMA_WRITE_LAST_WITH_IMMEDIATE: Opcode = Opcode(0x09);
    pub const RC_RDMA_WRITE_ONLY: Opcode = Opcode(0x0A);
    pub const RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE: Opcode = Opcode(0x0B);
    pub const RC_RDMA_READ_REQUEST: Opcode = Opcode(0x0C);
    pub const RC_RDMA_READ_RESPONSE_FIRST: Opcode = Opcode(0x0D);
    pub const RC_RDMA_READ_RESPONSE_MIDDLE: Opcode = Opcode(0x0E);
    pub const RC_RDMA_READ_RESPONSE_LAST: Opcode = Opcode(0x0F);
    pub const RC_RDMA_READ_RESPONSE_ONLY: Opcode = Opcode(0x10);
    pub const RC_ACKNOWLEDGE: Opcode = Opcode(0x11);
    pub const RC_ATOMIC_ACKNOWLEDGE: Opcode = Opcode(0x12);
    pub const RC_COMPARE_SWAP: Opcode = Opcode(0x13);
    pub const RC_FETCH_ADD: Opcode = Opcode(0x14);
    pub const RC_SEND_LAST_WITH_INVALIDATE: Opcode = Opcode(0x16);
    pub const RC_SEND_ONLY_WITH_INVALIDATE: Opcode = Opcode(0x17);
    pub const UD_SEND_ONLY: Opcode = Opcode(0x64);
    pub const UD_SEND_ONLY_WITH_IMMEDIATE: Opcode = Opcode(0x65);

    /// `Some` only for opcodes the table marks valid.
    pub fn from_u8(v: u8) -> Option<Opcode> {
        OPCODE_TABLE[v as usize].valid.then_some(Opcode(v))
    }
    pub fn info(self) -> &'static OpcodeInfo {
        &OPCODE_TABLE[self.0 as usize]
    }
}

bitflags! {
    /// Which extension headers follow the BTH, in wire order (IBA 9.2: DETH, RETH,
    /// AtomicETH, AETH, AtomicAckETH, ImmDt, IETH), and whether a payload may follow them.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct HdrMask: u16 {
        const DETH = 1 << 0;
        const RETH = 1 << 1;
        const ATMETH = 1 << 2;
        const AETH = 1 << 3;
        const ATMACK = 1 << 4;
        const IMMDT = 1 << 5;
        const IETH = 1 << 6;
        const PAYLOAD = 1 << 7;
    }
}

impl HdrMask {
    /// Bytes of extension headers after the BTH.
    pub const fn ext_len(self) -> usize {
        let b = self.bits();
        let mut n = 0;
        if b & HdrMask::DETH.bits() != 0 {
            n += 8;
        }
        if b & HdrMask::RETH.bits() != 0 {
            n += 16;
        }
        if b & HdrMask::ATMETH.bits() != 0 {
            n += 28;
        }
        if b & HdrMask::AETH.bits() != 0 {
            n += 4;
        }
        if b & HdrMask::ATMACK.bits() != 0 {
            n += 8;
        }
        if b & HdrMask::IMMDT.bits() != 0 {
            n += 4;
        }
        if b & HdrMask::IETH.bits() != 0 {
            n += 4;
        }
        n
    }
}

/// Where a packet sits within a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MsgPos {
    First,
    Middle,
    Last,
    Only,
}

impl MsgPos {
    pub fn starts(self) -> bool {
        matches!(self, MsgPos::First | MsgPos::Only)
    }
    pub fn ends(self) -> bool {
        matches!(self, MsgPos::Last | MsgPos::Only)
    }
}

/// The operation an opcode belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpClass {
    Send,
    Write,
    ReadRequest,
    ReadResponse,
    Ack,
    AtomicAck,
    Atomic,
    UdSend,
}

#[derive(Debug, Clone, Copy)]
pub struct OpcodeInfo {
    pub name: &'static str,
    pub valid: bool,
    pub hdrs: HdrMask,
    pub class: OpClass,
    pub pos: MsgPos,
}

impl OpcodeInfo {
    const INVALID: OpcodeInfo = OpcodeInfo {
        name: "RESERVED",
        valid: false,
        hdrs: HdrMask::empty(),
        class: OpClass::Send,
        pos: MsgPos::Only,
    };
    /// True for packets a requester sends and a responder consumes.
    pub fn is_request(&self) -> bool {
        matches!(
            self.class,
            OpClass::Send | OpClass::Write | OpClass::ReadRequest | OpClass::Atomic
        )
    }
}

const fn op(name: &'static str, hdrs: HdrMask, class: OpClass, pos: MsgPos) -> OpcodeInfo {
    OpcodeInfo {
        name,
        valid: true,
        hdrs,
        class,
        pos,
    }
}

const P: HdrMask = HdrMask::PAYLOAD;
const fn h(a: HdrMask, b: HdrMask) -> HdrMask {
    HdrMask::from_bits_truncate(a.bits() | b.bits())
}

/// The table itself. UC and RD opcodes are left invalid: this HCA offers RC and UD only.
pub static OPCODE_TABLE: [OpcodeInfo; 256] = {
    use MsgPos::*;
    use OpClass::*;
    let mut t = [OpcodeInfo::INVALID; 256];
    t[0x00] = op("RC_SEND_FIRST", P, Send, First);
    t[0x01] = op("RC_SEND_MIDDLE", P, Send, Middle);
    t[0x02] = op("RC_SEND_LAST", P, Send, Last);
    t[0x03] = op(
        "RC_SEND_LAST_WITH_IMMEDIATE",
        h(P, HdrMask::IMMDT),
        Send,
        Last,
    );
    t[0x04] = op("RC_SEND_ONLY", P, Send, Only);
    t[0x05] = op(
        "RC_SEND_ONLY_WITH_IMMEDIATE",
        h(P, HdrMask::IMMDT),
        Send,
        Only,
    );
    t[0x06] = op("RC_RDMA_WRITE_FIRST", h(P, HdrMask::RETH), Write, First);
    t[0x07] = op("RC_RDMA_WRITE_MIDDLE", P, Write, Middle);
    t[0x08] = op("RC_RDMA_WRITE_LAST", P, Write, Last);
    t[0x09] = op(
        "RC_RDMA_WRITE_LAST_WITH_IMMEDIATE",
        h(P, HdrMask::IMMDT),
        Write,
        Last,
    );
    t[0x0A] = op("RC_RDMA_WRITE_ONLY", h(P, HdrMask::RETH), Write, Only);
    t[0x0B] = op(
        "RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE",
        h(h(P, HdrMask::RETH), HdrMask::IMMDT),
        Write,
        Only,
    );
    t[0x0C] = op("RC_RDMA_READ_REQUEST", HdrMask::RETH, ReadRequest, Only);
    t[0x0D] = op(
        "RC_RDMA_READ_RESPONSE_FIRST",
        h(P, HdrMask::AETH),
        ReadResponse,
        First,
    );
    t[0x0E] = op("RC_RDMA_READ_RESPONSE_MIDDLE", P, ReadResponse, Middle);
    t[0x0F] = op(
        "RC_RDMA_READ_RESPONSE_LAST",
        h(P, HdrMask::AETH),
        ReadResponse,
        Last,
    );
    t[0x10] = op(
        "RC_RDMA_READ_RESPONSE_ONLY",
        h(P, HdrMask::AETH),
        ReadResponse,
        Only,
    );
    t[0x11] = op("RC_ACKNOWLEDGE", HdrMask::AETH, Ack, Only);
    t[0x12] = op(
        "RC_ATOMIC_ACKNOWLEDGE",
        h(HdrMask::AETH, HdrMask::ATMACK),
        AtomicAck,
        Only,
    );
    t[0x13] = op("RC_COMPARE_SWAP", HdrMask::ATMETH, Atomic, Only);
    t[0x14] = op("RC_FETCH_ADD", HdrMask::ATMETH, Atomic, Only);
    t[0x16] = op(
        "RC_SEND_LAST_WITH_INVALIDATE",
        h(P, HdrMask::IETH),
        Send,
        Last,
    );
    t[0x17] = op(
        "RC_SEND_ONLY_WITH_INVALIDATE",
        h(P, HdrMask::IETH),
        Send,
        Only,
    );
    t[0x64] = op("UD_SEND_ONLY", h(P, HdrMask::DETH), UdSend, Only);
    t[0x65] = op(
        "UD_SEND_ONLY_WITH_IMMEDIATE",
        h(h(P, HdrMask::DETH), HdrMask::IMMDT),
        UdSend,
        Only,
    );
    t
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_lengths_match_rxe() {
        // rxe_opcode.c `length` minus the 12-byte BTH.
        assert_eq!(
            Opcode::RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE
                .info()
                .hdrs
                .ext_len(),
            20
        );
        assert_eq!(Opcode::RC_RDMA_READ_REQUEST.info().hdrs.ext_len(), 16);
        assert_eq!(
            Opcode::RC_RDMA_READ_RESPONSE_MIDDLE.info().hdrs.ext_len(),
            0
        );
        assert_eq!(Opcode::RC_ATOMIC_ACKNOWLEDGE.info().hdrs.ext_len(), 12);
        assert_eq!(Opcode::RC_COMPARE_SWAP.info().hdrs.ext_len(), 28);
        assert_eq!(Opcode::UD_SEND_ONLY.info().hdrs.ext_len(), 8);
    }

    #[test]
    fn only_supported_opcodes_are_valid() {
        let valid: Vec<u8> = (0..=255u8)
            .filter(|&o| Opcode::from_u8(o).is_some())
            .collect();
        assert_eq!(valid.len(), 25);
        assert!(Opcode::from_u8(0x15).is_none());
        assert!(Opcode::from_u8(0x20).is_none(), "UC is not offered");
        for o in valid {
            let i = Opcode(o).info();
            assert!(i.name.starts_with("RC_") || i.name.starts_with("UD_"));
        }
    }
}

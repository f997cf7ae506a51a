//! Base Transport Header (IBA 9.2; rxe_hdr.h `struct rxe_bth`), 12 bytes.

use super::{be16, be32, check_len, Opcode, WireError};
use crate::verbs::{Psn, Qpn};

mod field {
    pub const OPCODE: usize = 0;
    pub const FLAGS: usize = 1;
    pub const PKEY: usize = 2;
    /// FECN | BECN | resv6a | DestQP
    pub const QPN: usize = 4;
    /// AckReq | resv7 | PSN
    pub const APSN: usize = 8;
    pub const LEN: usize = 12;
}

const SE: u8 = 0x80;
const MIG: u8 = 0x40;
const PAD_MASK: u8 = 0x30;
const TVER_MASK: u8 = 0x0F;
const FECN: u32 = 0x8000_0000;
const BECN: u32 = 0x4000_0000;
const ACK_REQ: u32 = 0x8000_0000;

/// A checked view of a BTH at the start of `buffer`.
#[derive(Debug, Clone, Copy)]
pub struct Bth<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Bth<T> {
    pub const LEN: usize = field::LEN;

    pub fn new_checked(buffer: T) -> Result<Self, WireError> {
        check_len("BTH", buffer.as_ref(), field::LEN)?;
        Ok(Bth { buffer })
    }
    fn b(&self) -> &[u8] {
        self.buffer.as_ref()
    }
    pub fn opcode(&self) -> u8 {
        self.b()[field::OPCODE]
    }
    pub fn solicited(&self) -> bool {
        self.b()[field::FLAGS] & SE != 0
    }
    pub fn mig_req(&self) -> bool {
        self.b()[field::FLAGS] & MIG != 0
    }
    pub fn pad_count(&self) -> u8 {
        (self.b()[field::FLAGS] & PAD_MASK) >> 4
    }
    pub fn tver(&self) -> u8 {
        self.b()[field::FLAGS] & TVER_MASK
    }
    pub fn pkey(&self) -> u16 {
        be16(self.b(), field::PKEY)
    }
    pub fn fecn(&self) -> bool {
        be32(self.b(), field::QPN) & FECN != 0
    }
    pub fn becn(&self) -> bool {
        be32(self.b(), field::QPN) & BECN != 0
    }
    pub fn dest_qp(&self) -> Qpn {
        Qpn::new(be32(self.b(), field::QPN))
    }
    pub fn ack_req(&self) -> bool {
        be32(self.b(), field::APSN) & ACK_REQ != 0
    }
    pub fn psn(&self) -> Psn {
        Psn::new(be32(self.b(), field::APSN))
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Bth<T> {
    /// Rewrite the pad count in place; the emitter learns it only after the payload is laid.
    pub fn set_pad_count(&mut self, pad: u8) {
        let f = &mut self.buffer.as_mut()[field::FLAGS];
        *f = (*f & !PAD_MASK) | ((pad & 3) << 4);
    }
}

/// The BTH as plain values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BthRepr {
    pub opcode: Opcode,
    pub solicited: bool,
    pub mig_req: bool,
    pub pad_count: u8,
    pub pkey: u16,
    pub fecn: bool,
    pub becn: bool,
    pub dest_qp: Qpn,
    pub ack_req: bool,
    pub psn: Psn,
}

impl BthRepr {
    /// A BTH with the defaults RoCEv2 uses: default P_Key, no congestion bits, TVer 0.
    pub fn new(opcode: Opcode, dest_qp: Qpn, psn: Psn) -> BthRepr {
        BthRepr {
            opcode,
            solicited: false,
            mig_req: true,
            pad_count: 0,
            pkey: 0xFFFF,
            fecn: false,
            becn: false,
            dest_qp,
            ack_req: false,
            psn,
        }
    }

    pub fn parse<T: AsRef<[u8]>>(v: &Bth<T>) -> Result<BthRepr, WireError> {
        if v.tver() != 0 {
            return Err(WireError::BadTver(v.tver()));
        }
        let opcode = Opcode::from_u8(v.opcode()).ok_or(WireError::BadOpcode(v.opcode()))?;
        Ok(BthRepr {
            opcode,
            solicited: v.solicited(),
            mig_req: v.mig_req(),
            pad_count: v.pad_count(),
            pkey: v.pkey(),
            fecn: v.fecn(),
            becn: v.becn(),
            dest_qp: v.dest_qp(),
            ack_req: v.ack_req(),
            psn: v.psn(),
        })
    }

    pub const fn buffer_len(&self) -> usize {
        field::LEN
    }

    /// Write the header into the first 12 bytes of `out`.
    pub fn emit(&self, out: &mut [u8]) {
        let out = &mut out[..field::LEN];
        out[field::OPCODE] = self.opcode.0;
        out[field::FLAGS] = if self.solicited { SE } else { 0 }
            | if self.mig_req { MIG } else { 0 }
            | ((self.pad_count & 3) << 4);
        out[field::PKEY..field::PKEY + 2].copy_from_slice(&self.pkey.to_be_bytes());
        let qpn = self.dest_qp.get()
            | if self.fecn { FECN } else { 0 }
            | if self.becn { BECN } else { 0 };
        out[field::QPN..field::QPN + 4].copy_from_slice(&qpn.to_be_bytes());
        let apsn = self.psn.get() | if self.ack_req { ACK_REQ } else { 0 };
        out[field::APSN..field::APSN + 4].copy_from_slice(&apsn.to_be_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // RDMA WRITE ONLY to QP 0x000011, PSN 0x123456, AckReq, SE, pad 2, default P_Key.
    const BYTES: [u8; 12] = [
        0x0A, 0xE0, 0xFF, 0xFF, 0x00, 0x00, 0x00, 0x11, 0x80, 0x12, 0x34, 0x56,
    ];

    fn repr() -> BthRepr {
        BthRepr {
            opcode: Opcode::RC_RDMA_WRITE_ONLY,
            solicited: true,
            mig_req: true,
            pad_count: 2,
            pkey: 0xFFFF,
            fecn: false,
            becn: false,
            dest_qp: Qpn::new(0x11),
            ack_req: true,
            psn: Psn::new(0x123456),
        }
    }

    #[test]
    fn deconstruct() {
        let v = Bth::new_checked(&BYTES[..]).unwrap();
        assert_eq!(v.opcode(), 0x0A);
        assert!(v.solicited() && v.mig_req() && v.ack_req());
        assert_eq!(v.pad_count(), 2);
        assert_eq!(v.tver(), 0);
        assert_eq!(v.pkey(), 0xFFFF);
        assert_eq!(v.dest_qp(), Qpn::new(0x11));
        assert_eq!(v.psn(), Psn::new(0x123456));
        assert!(!v.fecn() && !v.becn());
    }

    #[test]
    fn construct() {
        let mut out = [0u8; 12];
        repr().emit(&mut out);
        assert_eq!(out, BYTES);
    }

    #[test]
    fn parse_and_round_trip() {
        let v = Bth::new_checked(&BYTES[..]).unwrap();
        assert_eq!(BthRepr::parse(&v).unwrap(), repr());
        let mut r = repr();
        r.fecn = true;
        r.becn = true;
        r.dest_qp = Qpn::new(0xFF_FFFF);
        let mut out = [0u8; 12];
        r.emit(&mut out);
        assert_eq!(
            BthRepr::parse(&Bth::new_checked(&out[..]).unwrap()).unwrap(),
            r
        );
    }

    #[test]
    fn bad_length_and_version() {
        assert!(matches!(
            Bth::new_checked(&BYTES[..11]),
            Err(WireError::Truncated {
                need: 12,
                have: 11,
                ..
            })
        ));
        let mut b = BYTES;
        b[1] |= 0x01;
        assert_eq!(
            BthRepr::parse(&Bth::new_checked(&b[..]).unwrap()),
            Err(WireError::BadTver(1))
        );
        b = BYTES;
        b[0] = 0x15; // reserved RC opcode
        assert_eq!(
            BthRepr::parse(&Bth::new_checked(&b[..]).unwrap()),
            Err(WireError::BadOpcode(0x15))
        );
    }
}

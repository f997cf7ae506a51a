//! ACK Extended Transport Header (IBA 9.3.5), 4 bytes: syndrome and MSN.

use super::{be32, check_len, WireError};

const LEN: usize = 4;

#[derive(Debug, Clone, Copy)]
pub struct Aeth<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Aeth<T> {
    pub const LEN: usize = LEN;
    pub fn new_checked(buffer: T) -> Result<Self, WireError> {
        check_len("AETH", buffer.as_ref(), LEN)?;
        Ok(Aeth { buffer })
    }
    pub fn syndrome(&self) -> u8 {
        self.buffer.as_ref()[0]
    }
    pub fn msn(&self) -> u32 {
        be32(self.buffer.as_ref(), 0) & 0x00FF_FFFF
    }
}

/// NAK codes (IBA table 45), the low five bits of a NAK syndrome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NakCode {
    PsnSequenceError,
    InvalidRequest,
    RemoteAccessError,
    RemoteOperationalError,
    InvalidRdRequest,
    /// A reserved code; kept so that a peer's oddity is reported, not dropped silently.
    Reserved(u8),
}

impl NakCode {
    fn from_bits(v: u8) -> NakCode {
        match v {
            0 => NakCode::PsnSequenceError,
            1 => NakCode::InvalidRequest,
            2 => NakCode::RemoteAccessError,
            3 => NakCode::RemoteOperationalError,
            4 => NakCode::InvalidRdRequest,
            n => NakCode::Reserved(n),
        }
    }
    fn bits(self) -> u8 {
        match self {
            NakCode::PsnSequenceError => 0,
            NakCode::InvalidRequest => 1,
            NakCode::RemoteAccessError => 2,
            NakCode::RemoteOperationalError => 3,
            NakCode::InvalidRdRequest => 4,
            NakCode::Reserved(n) => n & 0x1F,
        }
    }
}

/// The meaning of the syndrome byte (IBA 9.7.5.1.1): bits 6:5 select the kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AethSyndrome {
    /// Credit count in the low five bits; 0x1F means "no flow control".
    Ack {
        credits: u8,
    },
    /// Receiver not ready; the low five bits encode the RNR timer.
    RnrNak {
        timer: u8,
    },
    Nak(NakCode),
    /// Syndrome kind 0b01 is reserved.
    Reserved(u8),
}

impl AethSyndrome {
    pub fn from_byte(b: u8) -> AethSyndrome {
        let low = b & 0x1F;
        match b & 0x60 {
            0x00 => AethSyndrome::Ack { credits: low },
            0x20 => AethSyndrome::RnrNak { timer: low },
            0x60 => AethSyndrome::Nak(NakCode::from_bits(low)),
            _ => AethSyndrome::Reserved(b),
        }
    }
    pub fn to_byte(self) -> u8 {
        match self {
            AethSyndrome::Ack { credits } => credits & 0x1F,
            AethSyndrome::RnrNak { timer } => 0x20 | (timer & 0x1F),
            AethSyndrome::Nak(c) => 0x60 | c.bits(),
            AethSyndrome::Reserved(b) => b,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AethRepr {
    pub syndrome: AethSyndrome,
    /// Message sequence number, 24 bits.
    pub msn: u32,
}

impl AethRepr {
    pub fn ack(msn: u32) -> AethRepr {
        AethRepr {
            syndrome: AethSyndrome::Ack { credits: 0x1F },
            msn: msn & 0x00FF_FFFF,
        }
    }
    pub fn parse<T: AsRef<[u8]>>(v: &Aeth<T>) -> AethRepr {
        AethRepr {
            syndrome: AethSyndrome::from_byte(v.syndrome()),
            msn: v.msn(),
        }
    }
    pub const fn buffer_len(&self) -> usize {
        LEN
    }
    pub fn emit(&self, out: &mut [u8]) {
        let v = ((self.syndrome.to_byte() as u32) << 24) | (self.msn & 0x00FF_FFFF);
        out[..LEN].copy_from_slice(&v.to_be_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deconstruct() {
        let v = Aeth::new_checked(&[0x62u8, 0x00, 0x01, 0x02][..]).unwrap();
        assert_eq!(v.syndrome(), 0x62);
        assert_eq!(v.msn(), 0x102);
    }
    #[test]
    fn construct() {
        let mut out = [0u8; 4];
        AethRepr {
            syndrome: AethSyndrome::RnrNak { timer: 14 },
            msn: 0xABCDEF,
        }
        .emit(&mut out);
        assert_eq!(out, [0x2E, 0xAB, 0xCD, 0xEF]);
    }
    #[test]
    fn parse_round_trip_every_syndrome() {
        for b in 0..=255u8 {
            let s = AethSyndrome::from_byte(b);
            // The top bit is reserved and not preserved by the kinds it does not belong to.
            if !matches!(s, AethSyndrome::Reserved(_)) {
                assert_eq!(s.to_byte(), b & 0x7F, "{b:#x}");
            }
            let r = AethRepr {
                syndrome: s,
                msn: 7,
            };
            let mut out = [0u8; 4];
            r.emit(&mut out);
            assert_eq!(
                AethRepr::parse(&Aeth::new_checked(&out[..]).unwrap()).syndrome,
                AethSyndrome::from_byte(out[0])
            );
        }
        assert_eq!(
            AethSyndrome::from_byte(0x60),
            AethSyndrome::Nak(NakCode::PsnSequenceError)
        );
        assert_eq!(
            AethSyndrome::from_byte(0x1F),
            AethSyndrome::Ack { credits: 31 }
        );
    }
    #[test]
    fn bad_length() {
        assert!(Aeth::new_checked(&[0u8; 3][..]).is_err());
    }
}

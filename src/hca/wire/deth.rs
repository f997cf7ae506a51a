//! Datagram Extended Transport Header (IBA 9.3.2), 8 bytes: Q_Key and source QP. Carried by
//! UD packets, which is how CM MADs travel to QP1.

use super::{be32, check_len, WireError};
use crate::verbs::Qpn;

/// The well-known Q_Key of the GSI QP (IBA 13.4.6.1; rxe `GSI_QKEY`).
pub const GSI_QKEY: u32 = 0x8001_0000;
const LEN: usize = 8;

#[derive(Debug, Clone, Copy)]
pub struct Deth<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Deth<T> {
    pub const LEN: usize = LEN;
    pub fn new_checked(buffer: T) -> Result<Self, WireError> {
        check_len("DETH", buffer.as_ref(), LEN)?;
        Ok(Deth { buffer })
    }
    pub fn qkey(&self) -> u32 {
        be32(self.buffer.as_ref(), 0)
    }
    pub fn src_qp(&self) -> Qpn {
        Qpn::new(be32(self.buffer.as_ref(), 4))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DethRepr {
    pub qkey: u32,
    pub src_qp: Qpn,
}

impl DethRepr {
    pub fn parse<T: AsRef<[u8]>>(v: &Deth<T>) -> DethRepr {
        DethRepr {
            qkey: v.qkey(),
            src_qp: v.src_qp(),
        }
    }
    pub const fn buffer_len(&self) -> usize {
        LEN
    }
    pub fn emit(&self, out: &mut [u8]) {
        out[..4].copy_from_slice(&self.qkey.to_be_bytes());
        out[4..8].copy_from_slice(&self.src_qp.get().to_be_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    const BYTES: [u8; 8] = [0x80, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01];
    const REPR: DethRepr = DethRepr {
        qkey: GSI_QKEY,
        src_qp: Qpn::GSI,
    };

    #[test]
    fn deconstruct() {
        let v = Deth::new_checked(&BYTES[..]).unwrap();
        assert_eq!(v.qkey(), GSI_QKEY);
        assert_eq!(v.src_qp(), Qpn::GSI);
    }
    #[test]
    fn construct() {
        let mut out = [0u8; 8];
        REPR.emit(&mut out);
        assert_eq!(out, BYTES);
    }
    #[test]
    fn parse_round_trip() {
        assert_eq!(
            DethRepr::parse(&Deth::new_checked(&BYTES[..]).unwrap()),
            REPR
        );
    }
    #[test]
    fn bad_length() {
        assert!(Deth::new_checked(&BYTES[..7]).is_err());
    }
}

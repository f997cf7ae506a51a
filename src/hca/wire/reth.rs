//! RDMA Extended Transport Header (IBA 9.3.3), 16 bytes: virtual address, R_Key, DMA length.

use super::{be32, be64, check_len, WireError};
use crate::verbs::MemKey;

mod field {
    pub const VA: usize = 0;
    pub const RKEY: usize = 8;
    pub const LEN: usize = 12;
    pub const SIZE: usize = 16;
}

#[derive(Debug, Clone, Copy)]
pub struct Reth<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Reth<T> {
    pub const LEN: usize = field::SIZE;
    pub fn new_checked(buffer: T) -> Result<Self, WireError> {
        check_len("RETH", buffer.as_ref(), field::SIZE)?;
        Ok(Reth { buffer })
    }
    pub fn va(&self) -> u64 {
        be64(self.buffer.as_ref(), field::VA)
    }
    pub fn rkey(&self) -> MemKey {
        MemKey(be32(self.buffer.as_ref(), field::RKEY))
    }
    pub fn dma_len(&self) -> u32 {
        be32(self.buffer.as_ref(), field::LEN)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RethRepr {
    pub va: u64,
    pub rkey: MemKey,
    pub dma_len: u32,
}

impl RethRepr {
    pub fn parse<T: AsRef<[u8]>>(v: &Reth<T>) -> RethRepr {
        RethRepr {
            va: v.va(),
            rkey: v.rkey(),
            dma_len: v.dma_len(),
        }
    }
    pub const fn buffer_len(&self) -> usize {
        field::SIZE
    }
    pub fn emit(&self, out: &mut [u8]) {
        out[field::VA..field::VA + 8].copy_from_slice(&self.va.to_be_bytes());
        out[field::RKEY..field::RKEY + 4].copy_from_slice(&self.rkey.0.to_be_bytes());
        out[field::LEN..field::LEN + 4].copy_from_slice(&self.dma_len.to_be_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BYTES: [u8; 16] = [
        0x00, 0x00, 0x7f, 0x12, 0x34, 0x56, 0x78, 0x00, 0xde, 0xad, 0xbe, 0xef, 0x00, 0x02, 0x00,
        0x00,
    ];
    const REPR: RethRepr = RethRepr {
        va: 0x7f12_3456_7800,
        rkey: MemKey(0xdead_beef),
        dma_len: 0x20000,
    };

    #[test]
    fn deconstruct() {
        let v = Reth::new_checked(&BYTES[..]).unwrap();
        assert_eq!(v.va(), 0x7f12_3456_7800);
        assert_eq!(v.rkey(), MemKey(0xdead_beef));
        assert_eq!(v.dma_len(), 0x20000);
    }
    #[test]
    fn construct() {
        let mut out = [0u8; 16];
        REPR.emit(&mut out);
        assert_eq!(out, BYTES);
    }
    #[test]
    fn parse_round_trip() {
        let r = RethRepr::parse(&Reth::new_checked(&BYTES[..]).unwrap());
        assert_eq!(r, REPR);
    }
    #[test]
    fn bad_length() {
        assert!(Reth::new_checked(&BYTES[..15]).is_err());
    }
}

//! The two 4-byte extension headers that carry one opaque word: Immediate Data (IBA 9.3.4)
//! and the Invalidate ETH (IBA 9.3.6), which names the R_Key the responder must invalidate.

use super::{be32, check_len, WireError};
use crate::verbs::MemKey;

const LEN: usize = 4;

/// Immediate data. It is opaque to the transport, so it is kept in network byte order as
/// `u32::from_be_bytes` of the four wire bytes, the way verbs hand it to consumers.
#[derive(Debug, Clone, Copy)]
pub struct ImmDt<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> ImmDt<T> {
    pub const LEN: usize = LEN;
    pub fn new_checked(buffer: T) -> Result<Self, WireError> {
        check_len("ImmDt", buffer.as_ref(), LEN)?;
        Ok(ImmDt { buffer })
    }
    pub fn imm(&self) -> u32 {
        be32(self.buffer.as_ref(), 0)
    }
    pub fn emit(imm: u32, out: &mut [u8]) {
        out[..LEN].copy_from_slice(&imm.to_be_bytes());
    }
}

/// Invalidate ETH: the R_Key to invalidate at the responder.
#[derive(Debug, Clone, Copy)]
pub struct Ieth<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Ieth<T> {
    pub const LEN: usize = LEN;
    pub fn new_checked(buffer: T) -> Result<Self, WireError> {
        check_len("IETH", buffer.as_ref(), LEN)?;
        Ok(Ieth { buffer })
    }
    pub fn rkey(&self) -> MemKey {
        MemKey(be32(self.buffer.as_ref(), 0))
    }
    pub fn emit(rkey: MemKey, out: &mut [u8]) {
        out[..LEN].copy_from_slice(&rkey.0.to_be_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deconstruct_construct_round_trip() {
        let bytes = [0x12u8, 0x34, 0x56, 0x78];
        assert_eq!(ImmDt::new_checked(&bytes[..]).unwrap().imm(), 0x1234_5678);
        assert_eq!(
            Ieth::new_checked(&bytes[..]).unwrap().rkey(),
            MemKey(0x1234_5678)
        );
        let mut out = [0u8; 4];
        ImmDt::<&[u8]>::emit(0x1234_5678, &mut out);
        assert_eq!(out, bytes);
        out = [0; 4];
        Ieth::<&[u8]>::emit(MemKey(0x1234_5678), &mut out);
        assert_eq!(out, bytes);
    }
    #[test]
    fn bad_length() {
        assert!(ImmDt::new_checked(&[0u8; 3][..]).is_err());
        assert!(Ieth::new_checked(&[0u8; 0][..]).is_err());
    }
}

//! The 64-byte submission queue entry (NVMe Base "Common Command Format"), the first 64 bytes
//! of every NVMe-oF command capsule.
//!
//! Layout: Linux `include/linux/nvme.h` `struct nvme_common_command` {opcode, flags,
//! command_id, nsid le32, `cdw2[2]`, metadata le64, dptr (16), cdw10..cdw15 le32}; SPDK
//! `struct spdk_nvme_cmd`. Fabrics commands overlay the same 64 bytes (fctype in byte 4,
//! see `fabrics.rs`).

use super::sgl::SglDescriptor;
use super::{array, check_len, le16, le32, le64, put16, put32, put64, NvmeWireError};

mod field {
    pub const OPCODE: usize = 0;
    /// FUSE bits 1:0, reserved 5:2, PSDT 7:6.
    pub const FLAGS: usize = 1;
    pub const CID: usize = 2;
    pub const NSID: usize = 4;
    pub const CDW2: usize = 8;
    pub const CDW3: usize = 12;
    pub const MPTR: usize = 16;
    pub const DPTR: usize = 24;
    pub const CDW10: usize = 40;
    pub const CDW11: usize = 44;
    pub const CDW12: usize = 48;
    pub const CDW13: usize = 52;
    pub const CDW14: usize = 56;
    pub const CDW15: usize = 60;
    pub const SIZE: usize = 64;
}

const FUSE_MASK: u8 = 0x03;
const PSDT_MASK: u8 = 0xC0;
/// PSDT 01b: "SGLs for data; MPTR is the address of one contiguous buffer" (Linux
/// `NVME_CMD_SGL_METABUF`). The only value NVMe-oF allows: Linux nvmet `nvmet_req_init`
/// fails any other PSDT, and any FUSE bit, with Invalid Field | DNR.
pub const PSDT_SGL_METABUF: u8 = 0x40;

/// Fused operation (flags bits 1:0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Fuse {
    #[default]
    Normal,
    First,
    Second,
}

impl Fuse {
    fn bits(self) -> u8 {
        match self {
            Fuse::Normal => 0,
            Fuse::First => 1,
            Fuse::Second => 2,
        }
    }
}

/// A submission queue entry as plain values. `dptr` stays raw so that a command whose SGL is
/// malformed still parses (the target must complete it, with its CID, and "SGL Descriptor
/// Type Invalid"); read it typed with [`Sqe::sgl`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Sqe {
    pub opcode: u8,
    pub fuse: Fuse,
    /// Command identifier, unique among the queue's outstanding commands.
    pub cid: u16,
    /// Namespace ID; for Fabrics commands byte 0 of this field is the fctype.
    pub nsid: u32,
    pub cdw2: u32,
    pub cdw3: u32,
    pub mptr: u64,
    pub dptr: [u8; 16],
    pub cdw10: u32,
    pub cdw11: u32,
    pub cdw12: u32,
    pub cdw13: u32,
    pub cdw14: u32,
    pub cdw15: u32,
}

impl Sqe {
    pub const LEN: usize = field::SIZE;

    /// An entry with every field zero and a NULL SGL (no data).
    pub fn new(opcode: u8, cid: u16) -> Sqe {
        let mut dptr = [0u8; 16];
        // NULL cannot exceed the keyed length limit.
        let _ = SglDescriptor::NULL.emit(&mut dptr);
        Sqe {
            opcode,
            fuse: Fuse::Normal,
            cid,
            nsid: 0,
            cdw2: 0,
            cdw3: 0,
            mptr: 0,
            dptr,
            cdw10: 0,
            cdw11: 0,
            cdw12: 0,
            cdw13: 0,
            cdw14: 0,
            cdw15: 0,
        }
    }

    /// Read the CID from the start of a capsule without parsing the rest; `None` if the
    /// buffer is too short to hold it.
    pub fn peek_cid(b: &[u8]) -> Option<u16> {
        (b.len() >= field::CID + 2).then(|| le16(b, field::CID))
    }

    /// Parse the first 64 bytes of `b` (a capsule may carry in-capsule data after them).
    /// Fails if PSDT is not SGL (01b) or FUSE is reserved; reserved flag bits 5:2 are ignored.
    pub fn parse(b: &[u8]) -> Result<Sqe, NvmeWireError> {
        check_len("SQE", b, field::SIZE)?;
        let cid = le16(b, field::CID);
        let flags = b[field::FLAGS];
        let fuse = match flags & FUSE_MASK {
            0 => Fuse::Normal,
            1 => Fuse::First,
            2 => Fuse::Second,
            _ => return Err(NvmeWireError::BadFlags { cid, flags }),
        };
        if flags & PSDT_MASK != PSDT_SGL_METABUF {
            return Err(NvmeWireError::BadFlags { cid, flags });
        }
        Ok(Sqe {
            opcode: b[field::OPCODE],
            fuse,
            cid,
            nsid: le32(b, field::NSID),
            cdw2: le32(b, field::CDW2),
            cdw3: le32(b, field::CDW3),
            mptr: le64(b, field::MPTR),
            dptr: array(b, field::DPTR),
            cdw10: le32(b, field::CDW10),
            cdw11: le32(b, field::CDW11),
            cdw12: le32(b, field::CDW12),
            cdw13: le32(b, field::CDW13),
            cdw14: le32(b, field::CDW14),
            cdw15: le32(b, field::CDW15),
        })
    }

    /// Write the entry, always with PSDT = SGL (flags 0x40 | FUSE).
    pub fn emit(&self, out: &mut [u8; 64]) {
        out[field::OPCODE] = self.opcode;
        out[field::FLAGS] = PSDT_SGL_METABUF | self.fuse.bits();
        put16(out, field::CID, self.cid);
        put32(out, field::NSID, self.nsid);
        put32(out, field::CDW2, self.cdw2);
        put32(out, field::CDW3, self.cdw3);
        put64(out, field::MPTR, self.mptr);
        out[field::DPTR..field::DPTR + 16].copy_from_slice(&self.dptr);
        put32(out, field::CDW10, self.cdw10);
        put32(out, field::CDW11, self.cdw11);
        put32(out, field::CDW12, self.cdw12);
        put32(out, field::CDW13, self.cdw13);
        put32(out, field::CDW14, self.cdw14);
        put32(out, field::CDW15, self.cdw15);
    }

    pub fn to_bytes(&self) -> [u8; 64] {
        let mut out = [0u8; 64];
        self.emit(&mut out);
        out
    }

    /// DPTR read as an SGL descriptor.
    pub fn sgl(&self) -> Result<SglDescriptor, NvmeWireError> {
        SglDescriptor::parse(&self.dptr)
    }

    /// Set DPTR; fails (leaving `self` unchanged) if a keyed length exceeds 24 bits.
    pub fn set_sgl(&mut self, d: &SglDescriptor) -> Result<(), NvmeWireError> {
        self.dptr = d.to_bytes()?;
        Ok(())
    }

    /// `self` with DPTR set to `d`.
    pub fn with_sgl(mut self, d: &SglDescriptor) -> Result<Sqe, NvmeWireError> {
        self.set_sgl(d)?;
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Read: cid 0x1234, nsid 1, keyed SGL (addr 0x1000, 4096 B, key 0x11223344),
    /// slba 0x0102030405060708, nlb 7 (8 blocks).
    fn bytes() -> [u8; 64] {
        let mut b = [0u8; 64];
        b[0] = 0x02;
        b[1] = 0x40;
        b[2..4].copy_from_slice(&[0x34, 0x12]);
        b[4..8].copy_from_slice(&[1, 0, 0, 0]);
        b[24..32].copy_from_slice(&[0x00, 0x10, 0, 0, 0, 0, 0, 0]);
        b[32..35].copy_from_slice(&[0x00, 0x10, 0x00]);
        b[35..39].copy_from_slice(&[0x44, 0x33, 0x22, 0x11]);
        b[39] = 0x40;
        b[40..48].copy_from_slice(&[0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01]);
        b[48..52].copy_from_slice(&[7, 0, 0, 0]);
        b
    }

    fn repr() -> Sqe {
        let mut s = Sqe::new(0x02, 0x1234);
        s.nsid = 1;
        s.set_sgl(&SglDescriptor::keyed(0x1000, 4096, 0x1122_3344, false).unwrap())
            .unwrap();
        s.cdw10 = 0x0506_0708;
        s.cdw11 = 0x0102_0304;
        s.cdw12 = 7;
        s
    }

    #[test]
    fn deconstruct() {
        let s = Sqe::parse(&bytes()).unwrap();
        assert_eq!(s.opcode, 0x02);
        assert_eq!(s.fuse, Fuse::Normal);
        assert_eq!(s.cid, 0x1234);
        assert_eq!(s.nsid, 1);
        assert_eq!(s.cdw10, 0x0506_0708);
        assert_eq!(s.cdw11, 0x0102_0304);
        assert_eq!(s.cdw12, 7);
        assert_eq!(
            s.sgl().unwrap(),
            SglDescriptor::Keyed {
                addr: 0x1000,
                len: 4096,
                key: 0x1122_3344,
                invalidate: false
            }
        );
        assert_eq!(Sqe::peek_cid(&bytes()), Some(0x1234));
        assert_eq!(Sqe::peek_cid(&[0, 0, 1]), None);
    }

    #[test]
    fn construct() {
        assert_eq!(repr().to_bytes(), bytes());
    }

    #[test]
    fn parse_round_trip() {
        let mut s = repr();
        s.fuse = Fuse::Second;
        s.cdw2 = 0xAABB_CCDD;
        s.cdw3 = 1;
        s.mptr = u64::MAX;
        s.cdw13 = 13;
        s.cdw14 = 14;
        s.cdw15 = 15;
        assert_eq!(Sqe::parse(&s.to_bytes()).unwrap(), s);
        // In-capsule data after the SQE is not part of it.
        let mut capsule = [0xEEu8; 100];
        capsule[..64].copy_from_slice(&s.to_bytes());
        assert_eq!(Sqe::parse(&capsule).unwrap(), s);
    }

    #[test]
    fn bad_flags() {
        for flags in [0x00u8, 0x80, 0xC0, 0x43] {
            let mut b = bytes();
            b[1] = flags;
            assert_eq!(
                Sqe::parse(&b),
                Err(NvmeWireError::BadFlags { cid: 0x1234, flags })
            );
            assert_eq!(Sqe::parse(&b).unwrap_err().cid(), Some(0x1234));
        }
        // Reserved bits 5:2 are ignored.
        let mut b = bytes();
        b[1] = 0x40 | 0x3C;
        assert!(Sqe::parse(&b).is_ok());
    }

    #[test]
    fn bad_length() {
        assert_eq!(
            Sqe::parse(&bytes()[..63]),
            Err(NvmeWireError::Truncated {
                what: "SQE",
                need: 64,
                have: 63
            })
        );
    }
}

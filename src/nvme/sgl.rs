//! SGL descriptors as the NVMe-oF RDMA binding uses them, 16 bytes in SQE bytes 24..40 (DPTR).
//!
//! Layouts: Linux `include/linux/nvme.h` `struct nvme_keyed_sgl_desc` {addr le64, `length[3]`,
//! `key[4]`, type} and `struct nvme_sgl_desc` {addr le64, length le32, `rsvd[3]`, type}; SPDK
//! `struct spdk_nvme_sgl_descriptor`. The identifier byte (15) carries the descriptor type in
//! bits 7:4 and the subtype in bits 3:0: Linux `NVME_KEY_SGL_FMT_DATA_DESC` (4),
//! `NVME_SGL_FMT_DATA_DESC` (0), `NVME_SGL_FMT_ADDRESS` (0), `NVME_SGL_FMT_OFFSET` (1),
//! `NVME_SGL_FMT_INVALIDATE` (0xF).

use super::{array, check_len, le32, le64, put32, put64, NvmeWireError};

mod field {
    pub const ADDR: usize = 0;
    /// Keyed: 24-bit length in bytes 8..11, then the 32-bit key in 11..15.
    pub const KEYED_LEN: usize = 8;
    pub const KEY: usize = 11;
    /// Unkeyed: 32-bit length in bytes 8..12, bytes 12..15 reserved.
    pub const LEN: usize = 8;
    pub const ID: usize = 15;
    pub const SIZE: usize = 16;
}

/// Keyed data block, address subtype: the target moves the data with RDMA READ/WRITE.
pub const TYPE_KEYED_ADDRESS: u8 = 0x40;
/// Keyed data block, "invalidate key" subtype: as 0x40, and the target answers with
/// SEND-with-invalidate of `key` (Linux uses it for its per-I/O fast-registered MRs).
pub const TYPE_KEYED_INVALIDATE: u8 = 0x4F;
/// Data block, offset subtype: the data rides in the command capsule after the SQE.
pub const TYPE_DATA_OFFSET: u8 = 0x01;
/// The largest length a keyed descriptor can carry (24 bits).
pub const MAX_KEYED_LEN: u32 = 0x00FF_FFFF;

/// One SGL descriptor (DPTR.SGL1). Construct keyed ones with [`SglDescriptor::keyed`] so the
/// 24-bit length limit is checked up front; [`SglDescriptor::emit`] checks it again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SglDescriptor {
    /// Keyed data block (type 4): `len` bytes at remote `addr` under R_Key `key`.
    Keyed {
        addr: u64,
        len: u32,
        key: u32,
        /// Subtype 0xF: ask the target to invalidate `key` remotely when it responds.
        invalidate: bool,
    },
    /// Data block with offset subtype (0x01): `len` bytes of in-capsule data starting
    /// `offset` bytes into the capsule's data area (Linux sends ICDOFF, i.e. 0).
    InCapsule { offset: u64, len: u32 },
}

impl SglDescriptor {
    pub const LEN: usize = field::SIZE;

    /// "No data": a keyed descriptor with zero address, length and key (Linux
    /// `nvme_rdma_set_sg_null`). It parses back as this same value.
    pub const NULL: SglDescriptor = SglDescriptor::Keyed {
        addr: 0,
        len: 0,
        key: 0,
        invalidate: false,
    };

    /// A keyed descriptor; fails if `len` does not fit the 24-bit length field.
    pub fn keyed(
        addr: u64,
        len: u64,
        key: u32,
        invalidate: bool,
    ) -> Result<SglDescriptor, NvmeWireError> {
        if len > u64::from(MAX_KEYED_LEN) {
            return Err(NvmeWireError::SglTooLong(len));
        }
        Ok(SglDescriptor::Keyed {
            addr,
            len: len as u32,
            key,
            invalidate,
        })
    }

    pub fn is_null(&self) -> bool {
        *self == SglDescriptor::NULL
    }

    /// Bytes this descriptor describes.
    pub fn data_len(&self) -> u32 {
        match *self {
            SglDescriptor::Keyed { len, .. } | SglDescriptor::InCapsule { len, .. } => len,
        }
    }

    /// The identifier byte (type << 4 | subtype).
    pub fn type_byte(&self) -> u8 {
        match *self {
            SglDescriptor::Keyed {
                invalidate: false, ..
            } => TYPE_KEYED_ADDRESS,
            SglDescriptor::Keyed {
                invalidate: true, ..
            } => TYPE_KEYED_INVALIDATE,
            SglDescriptor::InCapsule { .. } => TYPE_DATA_OFFSET,
        }
    }

    /// Parse the first 16 bytes of `b`. Only the three descriptor kinds the RDMA binding uses
    /// are accepted; any other identifier is [`NvmeWireError::BadSglType`] (a target answers
    /// it with "SGL Descriptor Type Invalid").
    pub fn parse(b: &[u8]) -> Result<SglDescriptor, NvmeWireError> {
        check_len("SGL descriptor", b, field::SIZE)?;
        let addr = le64(b, field::ADDR);
        match b[field::ID] {
            t @ (TYPE_KEYED_ADDRESS | TYPE_KEYED_INVALIDATE) => {
                let l: [u8; 3] = array(b, field::KEYED_LEN);
                Ok(SglDescriptor::Keyed {
                    addr,
                    len: u32::from_le_bytes([l[0], l[1], l[2], 0]),
                    key: le32(b, field::KEY),
                    invalidate: t == TYPE_KEYED_INVALIDATE,
                })
            }
            TYPE_DATA_OFFSET => Ok(SglDescriptor::InCapsule {
                offset: addr,
                len: le32(b, field::LEN),
            }),
            t => Err(NvmeWireError::BadSglType(t)),
        }
    }

    /// Write the descriptor into `out`; reserved bytes are zeroed.
    pub fn emit(&self, out: &mut [u8; 16]) -> Result<(), NvmeWireError> {
        *out = [0; 16];
        match *self {
            SglDescriptor::Keyed { addr, len, key, .. } => {
                if len > MAX_KEYED_LEN {
                    return Err(NvmeWireError::SglTooLong(u64::from(len)));
                }
                put64(out, field::ADDR, addr);
                out[field::KEYED_LEN..field::KEYED_LEN + 3]
                    .copy_from_slice(&len.to_le_bytes()[..3]);
                put32(out, field::KEY, key);
            }
            SglDescriptor::InCapsule { offset, len } => {
                put64(out, field::ADDR, offset);
                put32(out, field::LEN, len);
            }
        }
        out[field::ID] = self.type_byte();
        Ok(())
    }

    pub fn to_bytes(&self) -> Result<[u8; 16], NvmeWireError> {
        let mut out = [0u8; 16];
        self.emit(&mut out)?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // addr 0x0000_7f12_3456_7000, len 0x02_0000 (128 KiB), key 0xdeadbeef, type 0x4F.
    const KEYED: [u8; 16] = [
        0x00, 0x70, 0x56, 0x34, 0x12, 0x7f, 0x00, 0x00, 0x00, 0x00, 0x02, 0xef, 0xbe, 0xad, 0xde,
        0x4f,
    ];
    const KEYED_REPR: SglDescriptor = SglDescriptor::Keyed {
        addr: 0x7f12_3456_7000,
        len: 0x2_0000,
        key: 0xdead_beef,
        invalidate: true,
    };
    // offset 0, len 4096, type 0x01.
    const INLINE: [u8; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 0x00, 0x10, 0, 0, 0, 0, 0, 0x01];

    #[test]
    fn deconstruct() {
        assert_eq!(SglDescriptor::parse(&KEYED).unwrap(), KEYED_REPR);
        assert_eq!(
            SglDescriptor::parse(&INLINE).unwrap(),
            SglDescriptor::InCapsule {
                offset: 0,
                len: 4096
            }
        );
        let mut null = [0u8; 16];
        null[15] = 0x40;
        let n = SglDescriptor::parse(&null).unwrap();
        assert!(n.is_null());
        assert_eq!(n.data_len(), 0);
    }

    #[test]
    fn construct() {
        assert_eq!(KEYED_REPR.to_bytes().unwrap(), KEYED);
        let d = SglDescriptor::InCapsule {
            offset: 0,
            len: 4096,
        };
        assert_eq!(d.to_bytes().unwrap(), INLINE);
        let mut null = [0u8; 16];
        null[15] = 0x40;
        assert_eq!(SglDescriptor::NULL.to_bytes().unwrap(), null);
    }

    #[test]
    fn parse_round_trip() {
        for d in [
            KEYED_REPR,
            SglDescriptor::NULL,
            SglDescriptor::keyed(u64::MAX, u64::from(MAX_KEYED_LEN), 1, false).unwrap(),
            SglDescriptor::InCapsule {
                offset: 64,
                len: u32::MAX,
            },
        ] {
            assert_eq!(SglDescriptor::parse(&d.to_bytes().unwrap()).unwrap(), d);
        }
    }

    #[test]
    fn length_limit() {
        assert_eq!(
            SglDescriptor::keyed(0, 1 << 24, 0, false),
            Err(NvmeWireError::SglTooLong(1 << 24))
        );
        let bad = SglDescriptor::Keyed {
            addr: 0,
            len: 1 << 24,
            key: 0,
            invalidate: false,
        };
        assert!(bad.to_bytes().is_err());
    }

    #[test]
    fn bad_type_and_length() {
        assert!(SglDescriptor::parse(&KEYED[..15]).is_err());
        let mut b = KEYED;
        for t in [0x00u8, 0x02, 0x41, 0x50, 0x5a, 0xff] {
            b[15] = t;
            assert_eq!(SglDescriptor::parse(&b), Err(NvmeWireError::BadSglType(t)));
        }
    }
}

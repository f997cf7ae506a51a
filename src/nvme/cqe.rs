//! The 16-byte completion queue entry (NVMe Base "Common Completion Queue Entry"), the whole
//! NVMe-oF response capsule on RDMA (IORCSZ 1).
//!
//! Layout: Linux `include/linux/nvme.h` `struct nvme_completion` {union nvme_result (le64),
//! sq_head le16, sq_id le16, command_id, status le16}; SPDK `struct spdk_nvme_cpl`.

use super::status::Status;
use super::{check_len, le16, le64, put16, put64, NvmeWireError};

mod field {
    /// DW0 and DW1: command-specific result (Connect: CNTLID; Property Get: the value).
    pub const RESULT: usize = 0;
    pub const SQ_HEAD: usize = 8;
    pub const SQ_ID: usize = 10;
    pub const CID: usize = 12;
    /// Phase tag in bit 0, status field in 15:1.
    pub const STATUS: usize = 14;
    pub const SIZE: usize = 16;
}

/// A completion queue entry as plain values. `status` is the raw 16-bit word, phase tag
/// included; [`Cqe::nvme_status`] decodes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Cqe {
    pub result: u64,
    pub sq_head: u16,
    pub sq_id: u16,
    pub cid: u16,
    pub status: u16,
}

impl Cqe {
    pub const LEN: usize = field::SIZE;

    /// A completion for `cid` with `status` (phase tag 0: NVMe-oF has no phase to track).
    pub fn new(cid: u16, status: Status, result: u64) -> Cqe {
        Cqe {
            result,
            sq_head: 0,
            sq_id: 0,
            cid,
            status: status.to_word(false),
        }
    }

    pub fn parse(b: &[u8]) -> Result<Cqe, NvmeWireError> {
        check_len("CQE", b, field::SIZE)?;
        Ok(Cqe {
            result: le64(b, field::RESULT),
            sq_head: le16(b, field::SQ_HEAD),
            sq_id: le16(b, field::SQ_ID),
            cid: le16(b, field::CID),
            status: le16(b, field::STATUS),
        })
    }

    pub fn emit(&self, out: &mut [u8; 16]) {
        put64(out, field::RESULT, self.result);
        put16(out, field::SQ_HEAD, self.sq_head);
        put16(out, field::SQ_ID, self.sq_id);
        put16(out, field::CID, self.cid);
        put16(out, field::STATUS, self.status);
    }

    pub fn to_bytes(&self) -> [u8; 16] {
        let mut out = [0u8; 16];
        self.emit(&mut out);
        out
    }

    /// The phase tag (bit 0 of the status word).
    pub fn phase(&self) -> bool {
        self.status & 1 != 0
    }

    /// The decoded status field.
    pub fn nvme_status(&self) -> Status {
        Status::from_word(self.status)
    }

    /// DW0, where most commands put their result.
    pub fn dw0(&self) -> u32 {
        self.result as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // result 0x1122334455667788, sq_head 5, sq_id 1, cid 0xabcd,
    // status: DNR (bit 15) | SCT 0 | SC 0x80 (LBA out of range) | phase 1 -> 0x8101.
    const BYTES: [u8; 16] = [
        0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11, 0x05, 0x00, 0x01, 0x00, 0xcd, 0xab, 0x01,
        0x81,
    ];
    const REPR: Cqe = Cqe {
        result: 0x1122_3344_5566_7788,
        sq_head: 5,
        sq_id: 1,
        cid: 0xabcd,
        status: 0x8101,
    };

    #[test]
    fn deconstruct() {
        let c = Cqe::parse(&BYTES).unwrap();
        assert_eq!(c, REPR);
        assert!(c.phase());
        assert_eq!(c.dw0(), 0x5566_7788);
        let s = c.nvme_status();
        assert_eq!(
            (s.sct, s.sc, s.dnr, s.more, s.crd),
            (0, 0x80, true, false, 0)
        );
    }

    #[test]
    fn construct() {
        assert_eq!(REPR.to_bytes(), BYTES);
        let c = Cqe::new(0xabcd, Status::LBA_OUT_OF_RANGE.with_dnr(), 0);
        assert_eq!(c.status, 0x8100);
        assert!(!c.phase());
    }

    #[test]
    fn parse_round_trip() {
        assert_eq!(Cqe::parse(&REPR.to_bytes()).unwrap(), REPR);
    }

    #[test]
    fn bad_length() {
        assert!(Cqe::parse(&BYTES[..15]).is_err());
        assert!(Cqe::parse(&[]).is_err());
    }
}

//! The controller properties the host reads and writes through Property Get/Set (CAP, VS,
//! CC, CSTS) as values with their bit fields, as Linux `NVME_CAP_*` macros and `NVME_CC_*` /
//! `NVME_CSTS_*` enums (Base: Controller Registers / Properties). Their offsets are
//! [`super::fabrics::reg`].

use std::fmt;

#[inline]
fn bits64(v: u64, lo: u32, width: u32) -> u64 {
    (v >> lo) & ((1u64 << width) - 1)
}
#[inline]
fn bits32(v: u32, lo: u32, width: u32) -> u32 {
    (v >> lo) & ((1u32 << width) - 1)
}
#[inline]
fn set_bits32(v: u32, lo: u32, width: u32, x: u32) -> u32 {
    let mask = ((1u32 << width) - 1) << lo;
    (v & !mask) | ((x << lo) & mask)
}
#[inline]
fn set_bits64(v: u64, lo: u32, width: u32, x: u64) -> u64 {
    let mask = ((1u64 << width) - 1) << lo;
    (v & !mask) | ((x << lo) & mask)
}

/// Controller Capabilities (CAP, property 0x00, 8 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Cap(pub u64);

impl Cap {
    /// Maximum Queue Entries Supported, 0's based (bits 15:0).
    pub fn mqes(self) -> u16 {
        bits64(self.0, 0, 16) as u16
    }
    /// Largest queue the controller takes, in entries (MQES + 1).
    pub fn max_queue_entries(self) -> u32 {
        u32::from(self.mqes()) + 1
    }
    /// Contiguous Queues Required (bit 16).
    pub fn cqr(self) -> bool {
        bits64(self.0, 16, 1) != 0
    }
    /// Arbitration Mechanism Supported (bits 18:17).
    pub fn ams(self) -> u8 {
        bits64(self.0, 17, 2) as u8
    }
    /// Timeout (bits 31:24), in 500 ms units: the worst case for CSTS.RDY to follow CC.EN.
    pub fn to(self) -> u8 {
        bits64(self.0, 24, 8) as u8
    }
    pub fn timeout_ms(self) -> u32 {
        u32::from(self.to()) * 500
    }
    /// Doorbell Stride (bits 35:32); meaningless on Fabrics.
    pub fn dstrd(self) -> u8 {
        bits64(self.0, 32, 4) as u8
    }
    /// NVM Subsystem Reset Supported (bit 36).
    pub fn nssrs(self) -> bool {
        bits64(self.0, 36, 1) != 0
    }
    /// Command Sets Supported (bits 44:37); bit 0 (CAP bit 37) = NVM command set.
    pub fn css(self) -> u8 {
        bits64(self.0, 37, 8) as u8
    }
    /// Memory Page Size Minimum (bits 51:48): 2^(12 + MPSMIN) bytes.
    pub fn mpsmin(self) -> u8 {
        bits64(self.0, 48, 4) as u8
    }
    /// Memory Page Size Maximum (bits 55:52).
    pub fn mpsmax(self) -> u8 {
        bits64(self.0, 52, 4) as u8
    }
    pub fn min_page_size(self) -> u32 {
        1u32 << (12 + u32::from(self.mpsmin()))
    }

    pub fn with_mqes(self, v: u16) -> Cap {
        Cap(set_bits64(self.0, 0, 16, u64::from(v)))
    }
    pub fn with_cqr(self, v: bool) -> Cap {
        Cap(set_bits64(self.0, 16, 1, u64::from(v)))
    }
    pub fn with_to(self, v: u8) -> Cap {
        Cap(set_bits64(self.0, 24, 8, u64::from(v)))
    }
    pub fn with_css(self, v: u8) -> Cap {
        Cap(set_bits64(self.0, 37, 8, u64::from(v)))
    }
    pub fn with_mpsmin(self, v: u8) -> Cap {
        Cap(set_bits64(self.0, 48, 4, u64::from(v)))
    }
    pub fn with_mpsmax(self, v: u8) -> Cap {
        Cap(set_bits64(self.0, 52, 4, u64::from(v)))
    }
}

/// Version (VS, property 0x08): major 31:16, minor 15:8, tertiary 7:0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct Vs(pub u32);

impl Vs {
    pub const fn new(major: u16, minor: u8, tertiary: u8) -> Vs {
        Vs((major as u32) << 16 | (minor as u32) << 8 | tertiary as u32)
    }
    pub fn major(self) -> u16 {
        (self.0 >> 16) as u16
    }
    pub fn minor(self) -> u8 {
        (self.0 >> 8) as u8
    }
    pub fn tertiary(self) -> u8 {
        self.0 as u8
    }
}

impl fmt::Display for Vs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major(), self.minor(), self.tertiary())
    }
}

/// Shutdown notification values (CC.SHN).
pub mod shn {
    pub const NONE: u8 = 0;
    pub const NORMAL: u8 = 1;
    pub const ABRUPT: u8 = 2;
}

/// Controller Configuration (CC, property 0x14).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Cc(pub u32);

impl Cc {
    /// What Linux `nvme_enable_ctrl` writes: NVM command set, 4 KiB pages (MPS 0),
    /// round-robin arbitration, 64-byte SQEs (IOSQES 6), 16-byte CQEs (IOCQES 4), enabled.
    pub fn enable_default() -> Cc {
        Cc(0).with_iosqes(6).with_iocqes(4).with_en(true)
    }

    /// Enable (bit 0).
    pub fn en(self) -> bool {
        bits32(self.0, 0, 1) != 0
    }
    /// I/O Command Set Selected (bits 6:4).
    pub fn css(self) -> u8 {
        bits32(self.0, 4, 3) as u8
    }
    /// Memory Page Size (bits 10:7): 2^(12 + MPS) bytes.
    pub fn mps(self) -> u8 {
        bits32(self.0, 7, 4) as u8
    }
    /// Arbitration Mechanism Selected (bits 13:11).
    pub fn ams(self) -> u8 {
        bits32(self.0, 11, 3) as u8
    }
    /// Shutdown Notification (bits 15:14), see [`shn`].
    pub fn shn(self) -> u8 {
        bits32(self.0, 14, 2) as u8
    }
    /// I/O Submission Queue Entry Size (bits 19:16), log2 bytes.
    pub fn iosqes(self) -> u8 {
        bits32(self.0, 16, 4) as u8
    }
    /// I/O Completion Queue Entry Size (bits 23:20), log2 bytes.
    pub fn iocqes(self) -> u8 {
        bits32(self.0, 20, 4) as u8
    }

    pub fn with_en(self, v: bool) -> Cc {
        Cc(set_bits32(self.0, 0, 1, u32::from(v)))
    }
    pub fn with_css(self, v: u8) -> Cc {
        Cc(set_bits32(self.0, 4, 3, u32::from(v)))
    }
    pub fn with_mps(self, v: u8) -> Cc {
        Cc(set_bits32(self.0, 7, 4, u32::from(v)))
    }
    pub fn with_ams(self, v: u8) -> Cc {
        Cc(set_bits32(self.0, 11, 3, u32::from(v)))
    }
    pub fn with_shn(self, v: u8) -> Cc {
        Cc(set_bits32(self.0, 14, 2, u32::from(v)))
    }
    pub fn with_iosqes(self, v: u8) -> Cc {
        Cc(set_bits32(self.0, 16, 4, u32::from(v)))
    }
    pub fn with_iocqes(self, v: u8) -> Cc {
        Cc(set_bits32(self.0, 20, 4, u32::from(v)))
    }
}

/// Shutdown status values (CSTS.SHST).
pub mod shst {
    pub const NORMAL: u8 = 0;
    pub const OCCURRING: u8 = 1;
    pub const COMPLETE: u8 = 2;
}

/// Controller Status (CSTS, property 0x1C).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Csts(pub u32);

impl Csts {
    /// Ready (bit 0).
    pub fn rdy(self) -> bool {
        bits32(self.0, 0, 1) != 0
    }
    /// Controller Fatal Status (bit 1): the host must reset the controller.
    pub fn cfs(self) -> bool {
        bits32(self.0, 1, 1) != 0
    }
    /// Shutdown Status (bits 3:2), see [`shst`].
    pub fn shst(self) -> u8 {
        bits32(self.0, 2, 2) as u8
    }
    /// NVM Subsystem Reset Occurred (bit 4).
    pub fn nssro(self) -> bool {
        bits32(self.0, 4, 1) != 0
    }

    pub fn with_rdy(self, v: bool) -> Csts {
        Csts(set_bits32(self.0, 0, 1, u32::from(v)))
    }
    pub fn with_cfs(self, v: bool) -> Csts {
        Csts(set_bits32(self.0, 1, 1, u32::from(v)))
    }
    pub fn with_shst(self, v: u8) -> Csts {
        Csts(set_bits32(self.0, 2, 2, u32::from(v)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nvme::fabrics::reg;

    #[test]
    fn registers() {
        // MQES 127, CQR, TO 30 (15 s), CSS NVM, MPSMIN 0, MPSMAX 4.
        let cap = Cap(0)
            .with_mqes(127)
            .with_cqr(true)
            .with_to(30)
            .with_css(1)
            .with_mpsmax(4);
        assert_eq!(cap.0, 127 | 1 << 16 | 30 << 24 | 1 << 37 | 4 << 52);
        assert_eq!(cap.max_queue_entries(), 128);
        assert!(cap.cqr());
        assert_eq!(cap.timeout_ms(), 15_000);
        assert_eq!(cap.css(), 1);
        assert_eq!((cap.mpsmin(), cap.mpsmax()), (0, 4));
        assert_eq!(cap.min_page_size(), 4096);
        assert_eq!(Cap(u64::MAX).min_page_size(), 1 << 27);

        // Linux: NVME_CC_CSS_NVM | NVME_CC_IOSQES (6 << 16) | NVME_CC_IOCQES (4 << 20) | EN.
        let cc = Cc::enable_default();
        assert_eq!(cc.0, 6 << 16 | 4 << 20 | 1);
        assert!(cc.en());
        assert_eq!((cc.iosqes(), cc.iocqes(), cc.mps(), cc.css()), (6, 4, 0, 0));
        let cc = cc.with_shn(shn::NORMAL);
        assert_eq!(cc.0 & (3 << 14), 1 << 14);
        assert!(!cc.with_en(false).en());
        assert_eq!(Cc(0).with_ams(7).ams(), 7);
        assert_eq!(Cc(0).with_mps(15).with_css(7).0, 15 << 7 | 7 << 4);

        let csts = Csts(0).with_rdy(true).with_shst(shst::COMPLETE);
        assert_eq!(csts.0, 1 | 2 << 2);
        assert!(csts.rdy() && !csts.cfs() && !csts.nssro());
        assert!(Csts(2).cfs());
        assert_eq!(Csts(0).with_cfs(true).0, 2);

        let vs = Vs::new(1, 4, 0);
        assert_eq!(vs.0, 0x0001_0400);
        assert_eq!(vs.to_string(), "1.4.0");
        assert!(Vs::new(2, 0, 0) > vs);

        assert!(reg::size8(reg::CAP));
        assert!(!reg::size8(reg::VS) && !reg::size8(reg::CC) && !reg::size8(reg::CSTS));
    }
}

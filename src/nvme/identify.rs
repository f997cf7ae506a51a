//! Identify data, 4096 bytes a page, reduced to the fields an initiator and the built-in
//! target use: the controller (CNS 0x01) here, the namespace (CNS 0x00), the active
//! namespace ID list (CNS 0x02) and the namespace identification descriptors (CNS 0x03) in
//! [`namespace`].
//!
//! Offsets verified against Linux `include/linux/nvme.h` `struct nvme_id_ctrl` (v6.x layout:
//! the struct was transcribed and its `offsetof`s printed by a C compiler, 4096 bytes in
//! total) and SPDK `struct spdk_nvme_ctrlr_data` / `spdk_nvme_cdata_nvmf_specific`
//! (ioccsz, iorcsz, icdoff, ctrattr, msdbd at 1792). The safe-retry fields (CIU 135, CIRN
//! 136, CQT 386, CCRL 1807: NVMe 2.3, TP4129 and TP8028) from libnvme's `struct nvme_id_ctrl`,
//! checked the same way.

use super::fabrics::{FixedStr, Nqn};
use super::{array, check_len, le16, le32, le64, put16, put32, put64, NvmeWireError};

pub mod namespace;

pub use namespace::{
    active_namespace_ids, emit_active_namespace_ids, emit_ns_id_descriptors, ns_id_descriptors,
    IdentifyNamespace, LbaFormat, NsIdentity, LBAF_ENTRIES, NIDT_EUI64, NIDT_NGUID, NIDT_UUID,
};

mod ctrl_field {
    pub const VID: usize = 0;
    pub const SSVID: usize = 2;
    pub const SN: usize = 4;
    pub const MN: usize = 24;
    pub const FR: usize = 64;
    pub const MDTS: usize = 77;
    pub const CNTLID: usize = 78;
    pub const VER: usize = 80;
    pub const CTRATT: usize = 96;
    /// Controller Instance Uniquifier (TP8028; libnvme `nvme_id_ctrl.ciu`).
    pub const CIU: usize = 135;
    /// Controller Instance Random Number, 8 bytes (TP8028).
    pub const CIRN: usize = 136;
    pub const KAS: usize = 320;
    /// Command Quiesce Time in milliseconds (TP4129).
    pub const CQT: usize = 386;
    pub const SQES: usize = 512;
    pub const CQES: usize = 513;
    pub const MAXCMD: usize = 514;
    pub const NN: usize = 516;
    pub const ONCS: usize = 520;
    pub const VWC: usize = 525;
    pub const SGLS: usize = 536;
    pub const SUBNQN: usize = 768;
    // NVMe-oF specific (bytes 1792..2047).
    pub const IOCCSZ: usize = 1792;
    pub const IORCSZ: usize = 1796;
    pub const ICDOFF: usize = 1800;
    /// Fabrics Controller Attributes (FCATT; Linux `ctrattr`, later `fcatt`).
    pub const FCATT: usize = 1802;
    pub const MSDBD: usize = 1803;
    /// Cross-Controller Reset Limit (TP8028), after OFCS (1804) and DCTYPE (1806).
    pub const CCRL: usize = 1807;
    pub const SIZE: usize = 4096;
}

/// CTRATT bit 6: traffic-based keep alive (TBKAS). A controller that has it counts any
/// command as a keep alive, so it may wait up to 3 x KATO (not 2 x) before it calls the host
/// gone; the hold rule in `reconnect::hold` takes that factor.
pub const CTRATT_TBKAS: u32 = 1 << 6;
/// ONCS bit 2: Dataset Management supported.
pub const ONCS_DSM: u16 = 1 << 2;
/// ONCS bit 3: Write Zeroes supported.
pub const ONCS_WRITE_ZEROES: u16 = 1 << 3;
/// VWC bit 0: a volatile write cache is present.
pub const VWC_PRESENT: u8 = 1 << 0;
/// SGLS bit 2: keyed SGL data block descriptors supported (required for RDMA).
pub const SGLS_KEYED: u32 = 1 << 2;

/// Identify Controller data, the fields used here; everything else emits as zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IdentifyController {
    pub vid: u16,
    pub ssvid: u16,
    pub sn: FixedStr<20>,
    pub mn: FixedStr<40>,
    pub fr: FixedStr<8>,
    /// Maximum Data Transfer Size as a power of two in units of CAP.MPSMIN; 0 = no limit.
    pub mdts: u8,
    pub cntlid: u16,
    /// Version, as VS.
    pub ver: u32,
    pub ctratt: u32,
    /// Controller Instance Uniquifier: with `cntlid` and `cirn` it names one instance of a
    /// controller in a Cross-Controller Reset (TP8028); 0 when not reported.
    pub ciu: u8,
    /// Controller Instance Random Number (TP8028).
    pub cirn: u64,
    /// Keep Alive Support granularity in 100 ms units; 0 = keep alive not supported.
    pub kas: u16,
    /// Command Quiesce Time in milliseconds (TP4129): how long the controller may take, after
    /// it has noticed the host is gone, to finish or drop that host's commands. 0 = not
    /// reported.
    pub cqt: u16,
    /// Required (bits 3:0) and maximum (7:4) SQ entry size, log2 bytes.
    pub sqes: u8,
    pub cqes: u8,
    /// Maximum outstanding commands per queue (Fabrics); 0 = not reported.
    pub maxcmd: u16,
    /// Number of namespaces (largest valid NSID).
    pub nn: u32,
    pub oncs: u16,
    pub vwc: u8,
    pub sgls: u32,
    pub subnqn: FixedStr<256>,
    /// I/O queue command capsule size in 16-byte units (SQE included).
    pub ioccsz: u32,
    /// I/O queue response capsule size in 16-byte units.
    pub iorcsz: u32,
    /// In-capsule data offset in 16-byte units.
    pub icdoff: u16,
    pub fcatt: u8,
    /// Maximum SGL data block descriptors per command; 0 = no limit.
    pub msdbd: u8,
    /// Cross-Controller Reset Limit (TP8028): how many CCRs this controller runs at once;
    /// 0 = it does not offer CCR.
    pub ccrl: u8,
}

impl Default for IdentifyController {
    fn default() -> Self {
        IdentifyController {
            vid: 0,
            ssvid: 0,
            sn: FixedStr::zeroed(),
            mn: FixedStr::zeroed(),
            fr: FixedStr::zeroed(),
            mdts: 0,
            cntlid: 0,
            ver: 0,
            ctratt: 0,
            ciu: 0,
            cirn: 0,
            kas: 0,
            cqt: 0,
            sqes: 0,
            cqes: 0,
            maxcmd: 0,
            nn: 0,
            oncs: 0,
            vwc: 0,
            sgls: 0,
            subnqn: FixedStr::zeroed(),
            ioccsz: 0,
            iorcsz: 0,
            icdoff: 0,
            fcatt: 0,
            msdbd: 0,
            ccrl: 0,
        }
    }
}

impl IdentifyController {
    pub const LEN: usize = ctrl_field::SIZE;

    /// Parse the first 4096 bytes. Never fails on content: text fields are kept raw.
    pub fn parse(b: &[u8]) -> Result<IdentifyController, NvmeWireError> {
        use ctrl_field as f;
        check_len("Identify Controller data", b, f::SIZE)?;
        Ok(IdentifyController {
            vid: le16(b, f::VID),
            ssvid: le16(b, f::SSVID),
            sn: FixedStr(array(b, f::SN)),
            mn: FixedStr(array(b, f::MN)),
            fr: FixedStr(array(b, f::FR)),
            mdts: b[f::MDTS],
            cntlid: le16(b, f::CNTLID),
            ver: le32(b, f::VER),
            ctratt: le32(b, f::CTRATT),
            ciu: b[f::CIU],
            cirn: le64(b, f::CIRN),
            kas: le16(b, f::KAS),
            cqt: le16(b, f::CQT),
            sqes: b[f::SQES],
            cqes: b[f::CQES],
            maxcmd: le16(b, f::MAXCMD),
            nn: le32(b, f::NN),
            oncs: le16(b, f::ONCS),
            vwc: b[f::VWC],
            sgls: le32(b, f::SGLS),
            subnqn: FixedStr(array(b, f::SUBNQN)),
            ioccsz: le32(b, f::IOCCSZ),
            iorcsz: le32(b, f::IORCSZ),
            icdoff: le16(b, f::ICDOFF),
            fcatt: b[f::FCATT],
            msdbd: b[f::MSDBD],
            ccrl: b[f::CCRL],
        })
    }

    /// Write the 4096 bytes; fields not modelled here are zero.
    pub fn emit(&self, out: &mut [u8; 4096]) {
        use ctrl_field as f;
        *out = [0; 4096];
        put16(out, f::VID, self.vid);
        put16(out, f::SSVID, self.ssvid);
        out[f::SN..f::SN + 20].copy_from_slice(&self.sn.0);
        out[f::MN..f::MN + 40].copy_from_slice(&self.mn.0);
        out[f::FR..f::FR + 8].copy_from_slice(&self.fr.0);
        out[f::MDTS] = self.mdts;
        put16(out, f::CNTLID, self.cntlid);
        put32(out, f::VER, self.ver);
        put32(out, f::CTRATT, self.ctratt);
        out[f::CIU] = self.ciu;
        put64(out, f::CIRN, self.cirn);
        put16(out, f::KAS, self.kas);
        put16(out, f::CQT, self.cqt);
        out[f::SQES] = self.sqes;
        out[f::CQES] = self.cqes;
        put16(out, f::MAXCMD, self.maxcmd);
        put32(out, f::NN, self.nn);
        put16(out, f::ONCS, self.oncs);
        out[f::VWC] = self.vwc;
        put32(out, f::SGLS, self.sgls);
        out[f::SUBNQN..f::SUBNQN + 256].copy_from_slice(&self.subnqn.0);
        put32(out, f::IOCCSZ, self.ioccsz);
        put32(out, f::IORCSZ, self.iorcsz);
        put16(out, f::ICDOFF, self.icdoff);
        out[f::FCATT] = self.fcatt;
        out[f::MSDBD] = self.msdbd;
        out[f::CCRL] = self.ccrl;
    }

    pub fn to_bytes(&self) -> Box<[u8; 4096]> {
        let mut out = Box::new([0u8; 4096]);
        self.emit(&mut out);
        out
    }

    /// The subsystem NQN, validated; `None` if the field is empty (pre-1.2.1 controllers).
    pub fn subnqn(&self) -> Option<Result<Nqn, NvmeWireError>> {
        if self.subnqn.0[0] == 0 {
            return None;
        }
        Some(Nqn::parse_field("SUBNQN", &self.subnqn.0))
    }

    /// Largest transfer in bytes given the minimum page size (CAP.MPSMIN in bytes);
    /// `None` = no limit (MDTS 0) or beyond `u64`.
    pub fn max_transfer_bytes(&self, min_page_size: u32) -> Option<u64> {
        if self.mdts == 0 || self.mdts >= 64 {
            return None;
        }
        (1u64 << self.mdts).checked_mul(u64::from(min_page_size))
    }

    /// Keep-alive granularity in milliseconds.
    pub fn kas_ms(&self) -> u32 {
        u32::from(self.kas) * 100
    }

    /// In-capsule data bytes an I/O command capsule can carry after its 64-byte SQE.
    pub fn in_capsule_data_bytes(&self) -> u64 {
        (u64::from(self.ioccsz) * 16).saturating_sub(64)
    }

    /// In-capsule data offset in bytes.
    pub fn icdoff_bytes(&self) -> u32 {
        u32::from(self.icdoff) * 16
    }

    pub fn supports_dsm(&self) -> bool {
        self.oncs & ONCS_DSM != 0
    }
    pub fn supports_write_zeroes(&self) -> bool {
        self.oncs & ONCS_WRITE_ZEROES != 0
    }
    pub fn volatile_write_cache(&self) -> bool {
        self.vwc & VWC_PRESENT != 0
    }
    /// SGLS bits 1:0 non-zero: SGLs supported at all.
    pub fn supports_sgl(&self) -> bool {
        self.sgls & 0x3 != 0
    }
    pub fn supports_keyed_sgl(&self) -> bool {
        self.sgls & SGLS_KEYED != 0
    }
    /// The controller offers Cross-Controller Reset (TP8028: CCRL non-zero).
    pub fn offers_ccr(&self) -> bool {
        self.ccrl != 0
    }
    /// Traffic-based keep alive (CTRATT.TBKAS).
    pub fn traffic_based_keep_alive(&self) -> bool {
        self.ctratt & CTRATT_TBKAS != 0
    }
    /// This controller instance as a Cross-Controller Reset names it.
    pub fn instance(&self) -> super::ccr::CtrlInstance {
        super::ccr::CtrlInstance {
            cntlid: self.cntlid,
            ciu: self.ciu,
            cirn: self.cirn,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctrl() -> IdentifyController {
        IdentifyController {
            vid: 0x1b36,
            ssvid: 0x1af4,
            sn: FixedStr::new_spaced("0123456789abcdef").unwrap(),
            mn: FixedStr::new_spaced("nvmf-rdma soft target").unwrap(),
            fr: FixedStr::new_spaced("0.1").unwrap(),
            mdts: 5,
            cntlid: 0x0042,
            ver: 0x0002_0000,
            ctratt: CTRATT_TBKAS,
            ciu: 0x5A,
            cirn: 0x1122_3344_5566_7788,
            kas: 50,
            cqt: 3000,
            sqes: 0x66,
            cqes: 0x44,
            maxcmd: 128,
            nn: 1,
            oncs: ONCS_DSM | ONCS_WRITE_ZEROES,
            vwc: VWC_PRESENT,
            sgls: 0x0010_0005,
            subnqn: FixedStr::new("nqn.2024-01.io.example:disk1").unwrap(),
            ioccsz: 260,
            iorcsz: 1,
            icdoff: 0,
            fcatt: 0,
            msdbd: 1,
            ccrl: 4,
        }
    }

    fn ctrl_bytes() -> [u8; 4096] {
        let mut b = [0u8; 4096];
        b[0..2].copy_from_slice(&[0x36, 0x1b]);
        b[2..4].copy_from_slice(&[0xf4, 0x1a]);
        b[4..24].copy_from_slice(b"0123456789abcdef    ");
        b[24..64].copy_from_slice(b"nvmf-rdma soft target                   ");
        b[64..72].copy_from_slice(b"0.1     ");
        b[77] = 5;
        b[78] = 0x42;
        b[80..84].copy_from_slice(&[0, 0, 2, 0]);
        b[96] = 0x40;
        b[135] = 0x5A;
        b[136..144].copy_from_slice(&[0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11]);
        b[320] = 50;
        b[386..388].copy_from_slice(&[0xB8, 0x0B]);
        b[512] = 0x66;
        b[513] = 0x44;
        b[514] = 128;
        b[516] = 1;
        b[520] = 0x0C;
        b[525] = 1;
        b[536..540].copy_from_slice(&[0x05, 0x00, 0x10, 0x00]);
        b[768..768 + 28].copy_from_slice(b"nqn.2024-01.io.example:disk1");
        b[1792..1796].copy_from_slice(&260u32.to_le_bytes());
        b[1796] = 1;
        b[1803] = 1;
        b[1807] = 4;
        b
    }

    #[test]
    fn ctrl_deconstruct() {
        let c = IdentifyController::parse(&ctrl_bytes()).unwrap();
        assert_eq!(c, ctrl());
        assert_eq!(c.sn.text(), "0123456789abcdef");
        assert_eq!(c.mn.text(), "nvmf-rdma soft target");
        assert_eq!(c.fr.text(), "0.1");
        assert_eq!(
            c.subnqn().unwrap().unwrap().as_str(),
            "nqn.2024-01.io.example:disk1"
        );
        assert_eq!(c.max_transfer_bytes(4096), Some(128 * 1024));
        assert_eq!(c.kas_ms(), 5000);
        assert!(c.offers_ccr() && c.traffic_based_keep_alive());
        assert!(!IdentifyController::default().offers_ccr());
        assert_eq!(
            c.instance(),
            crate::nvme::ccr::CtrlInstance {
                cntlid: 0x42,
                ciu: 0x5A,
                cirn: 0x1122_3344_5566_7788
            }
        );
        assert_eq!(c.in_capsule_data_bytes(), 4096);
        assert_eq!(c.icdoff_bytes(), 0);
        assert!(c.supports_dsm() && c.supports_write_zeroes() && c.volatile_write_cache());
        assert!(c.supports_sgl() && c.supports_keyed_sgl());
    }

    #[test]
    fn ctrl_construct() {
        assert_eq!(*ctrl().to_bytes(), ctrl_bytes());
    }

    #[test]
    fn ctrl_round_trip() {
        let c = ctrl();
        assert_eq!(IdentifyController::parse(&c.to_bytes()[..]).unwrap(), c);
        let d = IdentifyController::default();
        assert_eq!(IdentifyController::parse(&d.to_bytes()[..]).unwrap(), d);
        assert!(d.subnqn().is_none());
        assert_eq!(d.max_transfer_bytes(4096), None);
        assert_eq!(d.in_capsule_data_bytes(), 0);
        let mut big = d;
        big.mdts = 63;
        assert_eq!(
            big.max_transfer_bytes(1 << 20),
            None,
            "overflow is no limit"
        );
    }

    #[test]
    fn ctrl_bad_length() {
        assert!(IdentifyController::parse(&ctrl_bytes()[..4095]).is_err());
    }
}

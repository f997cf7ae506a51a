//! Identify data: the controller (CNS 0x01) and namespace (CNS 0x00) structures, 4096 bytes
//! each, reduced to the fields an initiator and the built-in target use, the active
//! namespace ID list (CNS 0x02) and the namespace identification descriptors (CNS 0x03).
//!
//! Offsets verified against Linux `include/linux/nvme.h` `struct nvme_id_ctrl` (v6.x layout:
//! the struct was transcribed and its `offsetof`s printed by a C compiler, 4096 bytes in
//! total) and SPDK `struct spdk_nvme_ctrlr_data` / `spdk_nvme_cdata_nvmf_specific`
//! (ioccsz, iorcsz, icdoff, ctrattr, msdbd at 1792). The safe-retry fields (CIU 135, CIRN
//! 136, CQT 386, CCRL 1807: NVMe 2.3, TP4129 and TP8028) from libnvme's `struct nvme_id_ctrl`,
//! checked the same way. Namespace: `struct nvme_id_ns`
//! (nsze 0, ncap 8, nuse 16, nsfeat 24, nlbaf 25, flbas 26, nguid 104, eui64 120,
//! lbaf[] 128) and
//! `struct nvme_lbaf` {ms le16, ds u8, rp u8}.

use super::fabrics::{FixedStr, Nqn};
use super::{array, check_len, le16, le32, le64, put16, put32, put64, NvmeWireError};

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

mod ns_field {
    pub const NSZE: usize = 0;
    pub const NCAP: usize = 8;
    pub const NUSE: usize = 16;
    pub const NSFEAT: usize = 24;
    pub const NLBAF: usize = 25;
    pub const FLBAS: usize = 26;
    pub const NGUID: usize = 104;
    pub const EUI64: usize = 120;
    pub const LBAF: usize = 128;
    pub const SIZE: usize = 4096;
}

/// LBA format entries kept: 64, as NVMe 2.0 allows (older controllers use the first 16;
/// the rest of their table is reserved and reads as zero).
pub const LBAF_ENTRIES: usize = 64;

/// One LBA format (`struct nvme_lbaf`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct LbaFormat {
    /// Metadata bytes per block.
    pub ms: u16,
    /// LBA data size as log2 bytes; values below 9 mean "not supported".
    pub lbads: u8,
    /// Relative performance (bits 1:0).
    pub rp: u8,
}

impl LbaFormat {
    pub const LEN: usize = 4;

    pub fn from_bytes(b: [u8; 4]) -> LbaFormat {
        LbaFormat {
            ms: u16::from_le_bytes([b[0], b[1]]),
            lbads: b[2],
            rp: b[3],
        }
    }

    pub fn to_bytes(&self) -> [u8; 4] {
        let ms = self.ms.to_le_bytes();
        [ms[0], ms[1], self.lbads, self.rp]
    }

    /// Block size in bytes, if LBADS is a usable value (9..=31).
    pub fn block_size(&self) -> Option<u32> {
        (9..=31).contains(&self.lbads).then(|| 1u32 << self.lbads)
    }
}

/// Identify Namespace data, the fields used here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IdentifyNamespace {
    /// Namespace size in logical blocks.
    pub nsze: u64,
    pub ncap: u64,
    pub nuse: u64,
    pub nsfeat: u8,
    /// Number of LBA formats, 0's based.
    pub nlbaf: u8,
    /// Formatted LBA size: format index bits 3:0 (+ bits 6:5 as index bits 5:4), extended
    /// metadata bit 4.
    pub flbas: u8,
    /// Namespace Globally Unique Identifier; zero when the controller has none.
    pub nguid: [u8; 16],
    /// IEEE Extended Unique Identifier; zero when the controller has none.
    pub eui64: [u8; 8],
    pub lbaf: [LbaFormat; LBAF_ENTRIES],
}

impl Default for IdentifyNamespace {
    fn default() -> Self {
        IdentifyNamespace {
            nsze: 0,
            ncap: 0,
            nuse: 0,
            nsfeat: 0,
            nlbaf: 0,
            flbas: 0,
            nguid: [0; 16],
            eui64: [0; 8],
            lbaf: [LbaFormat::default(); LBAF_ENTRIES],
        }
    }
}

impl IdentifyNamespace {
    pub const LEN: usize = ns_field::SIZE;

    /// A namespace of `blocks` blocks of `2^lbads` bytes with one LBA format and no
    /// metadata, as the built-in target reports it.
    pub fn simple(blocks: u64, lbads: u8) -> IdentifyNamespace {
        let mut ns = IdentifyNamespace {
            nsze: blocks,
            ncap: blocks,
            nuse: blocks,
            ..IdentifyNamespace::default()
        };
        ns.lbaf[0] = LbaFormat {
            ms: 0,
            lbads,
            rp: 0,
        };
        ns
    }

    pub fn parse(b: &[u8]) -> Result<IdentifyNamespace, NvmeWireError> {
        use ns_field as f;
        check_len("Identify Namespace data", b, f::SIZE)?;
        let mut lbaf = [LbaFormat::default(); LBAF_ENTRIES];
        for (i, l) in lbaf.iter_mut().enumerate() {
            *l = LbaFormat::from_bytes(array(b, f::LBAF + i * LbaFormat::LEN));
        }
        Ok(IdentifyNamespace {
            nsze: le64(b, f::NSZE),
            ncap: le64(b, f::NCAP),
            nuse: le64(b, f::NUSE),
            nsfeat: b[f::NSFEAT],
            nlbaf: b[f::NLBAF],
            flbas: b[f::FLBAS],
            nguid: array(b, f::NGUID),
            eui64: array(b, f::EUI64),
            lbaf,
        })
    }

    pub fn emit(&self, out: &mut [u8; 4096]) {
        use ns_field as f;
        *out = [0; 4096];
        put64(out, f::NSZE, self.nsze);
        put64(out, f::NCAP, self.ncap);
        put64(out, f::NUSE, self.nuse);
        out[f::NSFEAT] = self.nsfeat;
        out[f::NLBAF] = self.nlbaf;
        out[f::FLBAS] = self.flbas;
        out[f::NGUID..f::NGUID + 16].copy_from_slice(&self.nguid);
        out[f::EUI64..f::EUI64 + 8].copy_from_slice(&self.eui64);
        for (i, l) in self.lbaf.iter().enumerate() {
            let at = f::LBAF + i * LbaFormat::LEN;
            out[at..at + LbaFormat::LEN].copy_from_slice(&l.to_bytes());
        }
    }

    pub fn to_bytes(&self) -> Box<[u8; 4096]> {
        let mut out = Box::new([0u8; 4096]);
        self.emit(&mut out);
        out
    }

    /// Index of the format in use: FLBAS bits 3:0, with bits 6:5 as index bits 5:4 (Linux
    /// `NVME_NS_FLBAS_LBA_MASK` | (`NVME_NS_FLBAS_LBA_UMASK` >> `NVME_NS_FLBAS_LBA_SHIFT`);
    /// bits 6:5 are reserved, hence zero, when there are at most 16 formats).
    pub fn format_index(&self) -> usize {
        usize::from(self.flbas & 0x0F) | usize::from(self.flbas & 0x60) >> 1
    }

    /// The format in use, if its index is within NLBAF.
    pub fn active_format(&self) -> Option<LbaFormat> {
        let i = self.format_index();
        (i <= usize::from(self.nlbaf)).then(|| self.lbaf[i])
    }

    /// Logical block size in bytes of the format in use.
    pub fn block_size(&self) -> Option<u32> {
        self.active_format()?.block_size()
    }

    /// Metadata is interleaved with the data (FLBAS bit 4).
    pub fn extended_lba(&self) -> bool {
        self.flbas & 0x10 != 0
    }

    /// Capacity in bytes, if the block size is known and the product fits.
    pub fn capacity_bytes(&self) -> Option<u64> {
        self.nsze.checked_mul(u64::from(self.block_size()?))
    }
}

/// The NSIDs in an Active Namespace ID list (CNS 0x02): little-endian u32s up to the first
/// zero or the end of the buffer (a trailing partial entry is ignored).
pub fn active_namespace_ids(b: &[u8]) -> impl Iterator<Item = u32> + '_ {
    b.chunks_exact(4)
        .map(|c| le32(c, 0))
        .take_while(|&n| n != 0)
}

/// Write `ids` as an Active Namespace ID list into `out`: as many as fit (at most 1024),
/// zero-terminated if there is room; returns how many were written.
pub fn emit_active_namespace_ids(ids: &[u32], out: &mut [u8; 4096]) -> usize {
    *out = [0; 4096];
    let n = ids.len().min(1024);
    for (i, id) in ids[..n].iter().enumerate() {
        put32(out, i * 4, *id);
    }
    n
}

/// Namespace identifier types (NIDT) of a descriptor list: IEEE EUI-64, NGUID, UUID.
pub const NIDT_EUI64: u8 = 1;
pub const NIDT_NGUID: u8 = 2;
pub const NIDT_UUID: u8 = 3;

/// What names a namespace apart from its NSID: the identifiers a controller reports for it
/// (zero where it reports none). Two namespaces behind the same NSID with different
/// identities are different namespaces (Linux `nvme_ns_ids_equal`), whatever their sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct NsIdentity {
    pub nguid: [u8; 16],
    pub eui64: [u8; 8],
    pub uuid: [u8; 16],
}

impl NsIdentity {
    /// No identifier at all: such a namespace can only be told apart by its NSID.
    pub fn is_empty(&self) -> bool {
        *self == NsIdentity::default()
    }

    /// The identity from Identify Namespace (`ns`) and a descriptor list (CNS 0x03, `descs`;
    /// `None` when the controller has none). A descriptor of a known type and length wins
    /// over the Identify Namespace field of the same kind.
    pub fn from_identify(ns: &IdentifyNamespace, descs: Option<&[u8]>) -> NsIdentity {
        let mut id = NsIdentity {
            nguid: ns.nguid,
            eui64: ns.eui64,
            uuid: [0; 16],
        };
        for (nidt, v) in descs.map(ns_id_descriptors).unwrap_or_default() {
            match nidt {
                NIDT_EUI64 => {
                    if let Ok(v) = v.try_into() {
                        id.eui64 = v;
                    }
                }
                NIDT_NGUID => {
                    if let Ok(v) = v.try_into() {
                        id.nguid = v;
                    }
                }
                NIDT_UUID => {
                    if let Ok(v) = v.try_into() {
                        id.uuid = v;
                    }
                }
                _ => {}
            }
        }
        id
    }

    /// The UUID in its text form (8-4-4-4-12 lowercase hex).
    pub fn uuid_text(&self) -> String {
        let h: String = self.uuid.iter().map(|b| format!("{b:02x}")).collect();
        format!(
            "{}-{}-{}-{}-{}",
            &h[..8],
            &h[8..12],
            &h[12..16],
            &h[16..20],
            &h[20..]
        )
    }
}

/// Write a Namespace Identification Descriptor list (CNS 0x03): a descriptor (NIDT, NIDL,
/// two reserved bytes, the identifier) for each identifier of `id` that is not zero, then a
/// zero NIDT.
pub fn emit_ns_id_descriptors(id: &NsIdentity, out: &mut [u8; 4096]) {
    *out = [0; 4096];
    let mut at = 0;
    for (nidt, v) in [
        (NIDT_EUI64, &id.eui64[..]),
        (NIDT_NGUID, &id.nguid[..]),
        (NIDT_UUID, &id.uuid[..]),
    ] {
        if v.iter().all(|&b| b == 0) {
            continue;
        }
        out[at] = nidt;
        out[at + 1] = v.len() as u8;
        out[at + 4..at + 4 + v.len()].copy_from_slice(v);
        at += 4 + v.len();
    }
}

/// The (NIDT, identifier) pairs of a descriptor list, up to the first zero NIDT or the end.
pub fn ns_id_descriptors(b: &[u8]) -> Vec<(u8, &[u8])> {
    let mut v = Vec::new();
    let mut at = 0;
    while at + 4 <= b.len() && b[at] != 0 {
        let len = b[at + 1] as usize;
        let Some(id) = b.get(at + 4..at + 4 + len) else {
            break;
        };
        v.push((b[at], id));
        at += 4 + len;
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ns_id_descriptor_list_round_trips() {
        let id = NsIdentity {
            nguid: [0x11; 16],
            eui64: [0; 8],
            uuid: [0x22; 16],
        };
        let mut page = [0u8; 4096];
        emit_ns_id_descriptors(&id, &mut page);
        assert_eq!(&page[..4], &[NIDT_NGUID, 16, 0, 0]);
        assert_eq!(&page[20..24], &[NIDT_UUID, 16, 0, 0]);
        assert_eq!(page[40], 0, "list ends");
        assert_eq!(
            ns_id_descriptors(&page),
            vec![(NIDT_NGUID, &id.nguid[..]), (NIDT_UUID, &id.uuid[..])]
        );
        let ns = IdentifyNamespace::simple(8, 9);
        assert_eq!(NsIdentity::from_identify(&ns, Some(&page)), id);
        assert!(ns_id_descriptors(&[0u8; 8]).is_empty());
        assert!(ns_id_descriptors(&[3, 16, 0, 0, 1]).is_empty());
        assert_eq!(id.uuid_text(), "22222222-2222-2222-2222-222222222222");
    }

    #[test]
    fn identity_from_identify_namespace_alone_and_odd_descriptors() {
        let mut ns = IdentifyNamespace::simple(8, 9);
        ns.nguid = [7; 16];
        ns.eui64 = [8; 8];
        let id = NsIdentity::from_identify(&ns, None);
        assert_eq!((id.nguid, id.eui64, id.uuid), ([7; 16], [8; 8], [0; 16]));
        // A UUID descriptor of the wrong length and an unknown type are ignored.
        let list = [3, 4, 0, 0, 1, 2, 3, 4, 9, 2, 0, 0, 5, 5, 0, 0];
        assert_eq!(NsIdentity::from_identify(&ns, Some(&list)), id);
        assert!(NsIdentity::default().is_empty() && !id.is_empty());
    }

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

    fn ns() -> IdentifyNamespace {
        let mut ns = IdentifyNamespace::simple(0x10_0000, 9);
        ns.nuse = 0x100;
        ns.nlbaf = 1;
        ns.flbas = 1;
        ns.nguid = [0xA5; 16];
        ns.eui64 = [1, 2, 3, 4, 5, 6, 7, 8];
        ns.lbaf[1] = LbaFormat {
            ms: 8,
            lbads: 12,
            rp: 2,
        };
        ns
    }

    fn ns_bytes() -> [u8; 4096] {
        let mut b = [0u8; 4096];
        b[0..8].copy_from_slice(&0x10_0000u64.to_le_bytes());
        b[8..16].copy_from_slice(&0x10_0000u64.to_le_bytes());
        b[16..24].copy_from_slice(&0x100u64.to_le_bytes());
        b[25] = 1;
        b[26] = 1;
        b[104..120].copy_from_slice(&[0xA5; 16]);
        b[120..128].copy_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
        b[128..132].copy_from_slice(&[0, 0, 9, 0]);
        b[132..136].copy_from_slice(&[8, 0, 12, 2]);
        b
    }

    #[test]
    fn ns_deconstruct() {
        let n = IdentifyNamespace::parse(&ns_bytes()).unwrap();
        assert_eq!(n, ns());
        assert_eq!(n.format_index(), 1);
        assert_eq!(n.block_size(), Some(4096));
        assert_eq!(n.active_format().unwrap().ms, 8);
        assert!(!n.extended_lba());
        assert_eq!(n.capacity_bytes(), Some(0x10_0000 * 4096));
    }

    #[test]
    fn ns_construct() {
        assert_eq!(*ns().to_bytes(), ns_bytes());
    }

    #[test]
    fn ns_round_trip() {
        let n = ns();
        assert_eq!(IdentifyNamespace::parse(&n.to_bytes()[..]).unwrap(), n);
    }

    #[test]
    fn ns_odd_values() {
        let mut n = IdentifyNamespace::simple(u64::MAX, 12);
        assert_eq!(n.capacity_bytes(), None, "overflow");
        n.lbaf[0].lbads = 40;
        assert_eq!(n.block_size(), None);
        n.lbaf[0].lbads = 8;
        assert_eq!(n.block_size(), None);
        n.flbas = 0x0F;
        assert_eq!(n.active_format(), None, "index beyond NLBAF");
        // More than 16 formats: FLBAS bits 6:5 extend the index.
        n.nlbaf = 63;
        n.flbas = 0x60 | 0x1F;
        assert_eq!(n.format_index(), 0x3F);
        assert!(n.extended_lba());
        n.flbas = 0xFF;
        assert!(n.format_index() < LBAF_ENTRIES);
        assert!(IdentifyNamespace::parse(&ns_bytes()[..100]).is_err());
    }

    #[test]
    fn ns_list() {
        let mut b = [0u8; 4096];
        assert_eq!(emit_active_namespace_ids(&[1, 2, 0x10], &mut b), 3);
        assert_eq!(&b[..12], &[1, 0, 0, 0, 2, 0, 0, 0, 0x10, 0, 0, 0]);
        assert_eq!(
            active_namespace_ids(&b).collect::<Vec<_>>(),
            vec![1, 2, 0x10]
        );
        assert_eq!(active_namespace_ids(&b[..6]).collect::<Vec<_>>(), vec![1]);
        let many: Vec<u32> = (1..=2000).collect();
        assert_eq!(emit_active_namespace_ids(&many, &mut b), 1024);
        assert_eq!(active_namespace_ids(&b).count(), 1024);
    }
}

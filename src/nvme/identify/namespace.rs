//! Identify Namespace data (CNS 0x00), the Active Namespace ID list (CNS 0x02) and the
//! Namespace Identification Descriptor list (CNS 0x03).
//!
//! Offsets from Linux `struct nvme_id_ns` (nsze 0, ncap 8, nuse 16, nsfeat 24, nlbaf 25,
//! flbas 26, nguid 104, eui64 120, lbaf[] 128) and `struct nvme_lbaf` {ms le16, ds u8, rp u8}.

use crate::nvme::{array, check_len, le32, le64, put32, put64, NvmeWireError};

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

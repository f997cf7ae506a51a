//! The Discovery Log Page (log identifier 0x70, NVMe-oF "Discovery Log Page"): a 1024-byte
//! header followed by 1024-byte entries, one per subsystem port a host may connect to.
//!
//! Layouts verified against Linux `include/linux/nvme.h` `struct nvmf_disc_rsp_page_hdr`
//! {genctr le64, numrec le64, recfmt le16} and `struct nvmf_disc_rsp_page_entry` (transcribed
//! and its `offsetof`s printed by a C compiler), and SPDK `struct
//! spdk_nvmf_discovery_log_page_entry`: trtype 0, adrfam 1, subtype 2, treq 3, portid le16 @4,
//! cntlid le16 @6, asqsz le16 @8, `trsvcid[32]` @32, `subnqn[256]` @256, `traddr[256]` @512,
//! `tsas[256]` @768. Note SUBNQN comes before TRADDR. RDMA TSAS: `struct rdma` in the same
//! Linux union / SPDK `spdk_nvmf_rdma_transport_specific_address_subtype` {qptype, prtype,
//! cms, `resv[5]`, pkey le16}.

use super::fabrics::{FixedStr, Nqn};
use super::{array, check_len, le16, le64, put16, put64, NvmeWireError};

mod hdr_field {
    pub const GENCTR: usize = 0;
    pub const NUMREC: usize = 8;
    pub const RECFMT: usize = 16;
    pub const SIZE: usize = 1024;
}

mod entry_field {
    pub const TRTYPE: usize = 0;
    pub const ADRFAM: usize = 1;
    pub const SUBTYPE: usize = 2;
    pub const TREQ: usize = 3;
    pub const PORTID: usize = 4;
    pub const CNTLID: usize = 6;
    pub const ASQSZ: usize = 8;
    pub const TRSVCID: usize = 32;
    pub const SUBNQN: usize = 256;
    pub const TRADDR: usize = 512;
    pub const TSAS: usize = 768;
    pub const SIZE: usize = 1024;
}

/// Transport types (TRTYPE).
pub mod trtype {
    pub const RDMA: u8 = 1;
    pub const FC: u8 = 2;
    pub const TCP: u8 = 3;
}

/// Address families (ADRFAM).
pub mod adrfam {
    pub const IPV4: u8 = 1;
    pub const IPV6: u8 = 2;
    pub const IB: u8 = 3;
    pub const FC: u8 = 4;
}

/// Subsystem types (SUBTYPE).
pub mod subtype {
    /// A referral to another discovery service.
    pub const DISCOVERY_REFERRAL: u8 = 1;
    /// An NVM subsystem (I/O controllers).
    pub const NVME: u8 = 2;
    /// This discovery controller itself.
    pub const CURRENT_DISCOVERY: u8 = 3;
}

/// RDMA TSAS values.
pub mod rdma {
    /// QPTYPE: reliable connected.
    pub const QPTYPE_RC: u8 = 1;
    /// QPTYPE: reliable datagram.
    pub const QPTYPE_RD: u8 = 2;
    pub const PRTYPE_NONE: u8 = 1;
    pub const PRTYPE_IB: u8 = 2;
    pub const PRTYPE_ROCE: u8 = 3;
    pub const PRTYPE_ROCEV2: u8 = 4;
    pub const PRTYPE_IWARP: u8 = 5;
    /// CMS: RDMA-CM (sockets-style addressing).
    pub const CMS_RDMA_CM: u8 = 1;
}

/// The discovery log header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct DiscoveryLogHeader {
    /// Generation counter: changes whenever the log changes; a host re-reads until two reads
    /// agree.
    pub genctr: u64,
    /// Number of records (entries) in the log.
    pub numrec: u64,
    pub recfmt: u16,
}

impl DiscoveryLogHeader {
    pub const LEN: usize = hdr_field::SIZE;

    /// Parse the header from the first 1024 bytes (16 are enough to read it; a short read
    /// of the log still has to cover the reserved rest before any entry).
    pub fn parse(b: &[u8]) -> Result<DiscoveryLogHeader, NvmeWireError> {
        check_len("discovery log header", b, hdr_field::SIZE)?;
        Ok(DiscoveryLogHeader {
            genctr: le64(b, hdr_field::GENCTR),
            numrec: le64(b, hdr_field::NUMREC),
            recfmt: le16(b, hdr_field::RECFMT),
        })
    }

    pub fn emit(&self, out: &mut [u8; 1024]) {
        *out = [0; 1024];
        put64(out, hdr_field::GENCTR, self.genctr);
        put64(out, hdr_field::NUMREC, self.numrec);
        put16(out, hdr_field::RECFMT, self.recfmt);
    }

    /// Bytes of a log with `numrec` entries, or `None` if that overflows.
    pub fn log_len(numrec: u64) -> Option<u64> {
        numrec
            .checked_mul(entry_field::SIZE as u64)?
            .checked_add(hdr_field::SIZE as u64)
    }

    /// The entries of a whole log page `page` (header included): at most NUMREC, and only
    /// as many as `page` holds completely.
    pub fn entries<'a>(&self, page: &'a [u8]) -> impl Iterator<Item = DiscoveryLogEntry> + 'a {
        let body = page.get(hdr_field::SIZE..).unwrap_or(&[]);
        let n = usize::try_from(self.numrec).unwrap_or(usize::MAX);
        body.chunks_exact(entry_field::SIZE)
            .take(n)
            .filter_map(|c| DiscoveryLogEntry::parse(c).ok())
    }
}

/// One discovery log entry. Text fields are kept byte for byte; read them with
/// [`FixedStr::text`] or [`DiscoveryLogEntry::subnqn`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DiscoveryLogEntry {
    pub trtype: u8,
    pub adrfam: u8,
    pub subtype: u8,
    pub treq: u8,
    pub portid: u16,
    /// 0xFFFF: dynamic controller model.
    pub cntlid: u16,
    /// Admin max SQ size (entries).
    pub asqsz: u16,
    /// Transport service ID: the port number as text for RDMA/TCP ("4420").
    pub trsvcid: FixedStr<32>,
    pub subnqn: FixedStr<256>,
    /// Transport address: the IP address as text for RDMA/TCP.
    pub traddr: FixedStr<256>,
    /// Transport-specific address subtype; [`RdmaTsas`] reads it for RDMA.
    pub tsas: [u8; 256],
}

impl DiscoveryLogEntry {
    pub const LEN: usize = entry_field::SIZE;

    /// An entry for an NVM subsystem reachable over RDMA (RoCEv2, RC, RDMA-CM) at an IPv4
    /// or IPv6 `traddr` and `trsvcid` port.
    pub fn rdma(
        subnqn: &Nqn,
        traddr: &str,
        trsvcid: &str,
        ipv6: bool,
        portid: u16,
    ) -> Result<DiscoveryLogEntry, NvmeWireError> {
        let mut sub = [0u8; 256];
        subnqn.emit_field(&mut sub);
        Ok(DiscoveryLogEntry {
            trtype: trtype::RDMA,
            adrfam: if ipv6 { adrfam::IPV6 } else { adrfam::IPV4 },
            subtype: subtype::NVME,
            treq: 0,
            portid,
            cntlid: 0xFFFF,
            asqsz: 32,
            trsvcid: FixedStr::new(trsvcid)?,
            subnqn: FixedStr(sub),
            traddr: FixedStr::new(traddr)?,
            tsas: RdmaTsas {
                qptype: rdma::QPTYPE_RC,
                prtype: rdma::PRTYPE_ROCEV2,
                cms: rdma::CMS_RDMA_CM,
                pkey: 0,
            }
            .to_tsas(),
        })
    }

    /// Parse the first 1024 bytes. Never fails on content.
    pub fn parse(b: &[u8]) -> Result<DiscoveryLogEntry, NvmeWireError> {
        use entry_field as f;
        check_len("discovery log entry", b, f::SIZE)?;
        Ok(DiscoveryLogEntry {
            trtype: b[f::TRTYPE],
            adrfam: b[f::ADRFAM],
            subtype: b[f::SUBTYPE],
            treq: b[f::TREQ],
            portid: le16(b, f::PORTID),
            cntlid: le16(b, f::CNTLID),
            asqsz: le16(b, f::ASQSZ),
            trsvcid: FixedStr(array(b, f::TRSVCID)),
            subnqn: FixedStr(array(b, f::SUBNQN)),
            traddr: FixedStr(array(b, f::TRADDR)),
            tsas: array(b, f::TSAS),
        })
    }

    pub fn emit(&self, out: &mut [u8; 1024]) {
        use entry_field as f;
        *out = [0; 1024];
        out[f::TRTYPE] = self.trtype;
        out[f::ADRFAM] = self.adrfam;
        out[f::SUBTYPE] = self.subtype;
        out[f::TREQ] = self.treq;
        put16(out, f::PORTID, self.portid);
        put16(out, f::CNTLID, self.cntlid);
        put16(out, f::ASQSZ, self.asqsz);
        out[f::TRSVCID..f::TRSVCID + 32].copy_from_slice(&self.trsvcid.0);
        out[f::SUBNQN..f::SUBNQN + 256].copy_from_slice(&self.subnqn.0);
        out[f::TRADDR..f::TRADDR + 256].copy_from_slice(&self.traddr.0);
        out[f::TSAS..f::TSAS + 256].copy_from_slice(&self.tsas);
    }

    pub fn to_bytes(&self) -> [u8; 1024] {
        let mut out = [0u8; 1024];
        self.emit(&mut out);
        out
    }

    /// The subsystem NQN, validated.
    pub fn subnqn(&self) -> Result<Nqn, NvmeWireError> {
        Nqn::parse_field("SUBNQN", &self.subnqn.0)
    }

    /// The RDMA TSAS, if this is an RDMA entry.
    pub fn rdma_tsas(&self) -> Option<RdmaTsas> {
        (self.trtype == trtype::RDMA).then(|| RdmaTsas::from_tsas(&self.tsas))
    }
}

/// The RDMA transport-specific address subtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct RdmaTsas {
    pub qptype: u8,
    pub prtype: u8,
    pub cms: u8,
    /// Partition key (AF_IB only).
    pub pkey: u16,
}

impl RdmaTsas {
    pub fn from_tsas(t: &[u8; 256]) -> RdmaTsas {
        RdmaTsas {
            qptype: t[0],
            prtype: t[1],
            cms: t[2],
            pkey: le16(t, 8),
        }
    }

    pub fn to_tsas(&self) -> [u8; 256] {
        let mut t = [0u8; 256];
        t[0] = self.qptype;
        t[1] = self.prtype;
        t[2] = self.cms;
        put16(&mut t, 8, self.pkey);
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SUBNQN: &str = "nqn.2024-01.io.example:disk1";

    fn entry() -> DiscoveryLogEntry {
        DiscoveryLogEntry::rdma(&Nqn::new(SUBNQN).unwrap(), "192.168.1.20", "4420", false, 1)
            .unwrap()
    }

    fn entry_bytes() -> [u8; 1024] {
        let mut b = [0u8; 1024];
        b[0] = 1; // RDMA
        b[1] = 1; // IPv4
        b[2] = 2; // NVMe subsystem
        b[4] = 1; // portid
        b[6..8].copy_from_slice(&[0xFF, 0xFF]);
        b[8] = 32;
        b[32..36].copy_from_slice(b"4420");
        b[256..256 + SUBNQN.len()].copy_from_slice(SUBNQN.as_bytes());
        b[512..524].copy_from_slice(b"192.168.1.20");
        b[768..771].copy_from_slice(&[1, 4, 1]); // RC, RoCEv2, RDMA-CM
        b
    }

    #[test]
    fn deconstruct() {
        let e = DiscoveryLogEntry::parse(&entry_bytes()).unwrap();
        assert_eq!(e, entry());
        assert_eq!(e.traddr.text(), "192.168.1.20");
        assert_eq!(e.trsvcid.text(), "4420");
        assert_eq!(e.subnqn().unwrap().as_str(), SUBNQN);
        assert_eq!(
            e.rdma_tsas().unwrap(),
            RdmaTsas {
                qptype: 1,
                prtype: 4,
                cms: 1,
                pkey: 0
            }
        );
    }

    #[test]
    fn construct() {
        assert_eq!(entry().to_bytes(), entry_bytes());
    }

    #[test]
    fn round_trip() {
        let mut e = entry();
        e.treq = 3;
        e.tsas[255] = 9;
        e.traddr = FixedStr::new("fe80::1").unwrap();
        e.adrfam = adrfam::IPV6;
        assert_eq!(DiscoveryLogEntry::parse(&e.to_bytes()).unwrap(), e);
        let t = RdmaTsas {
            qptype: 2,
            prtype: 2,
            cms: 1,
            pkey: 0xFFFF,
        };
        assert_eq!(RdmaTsas::from_tsas(&t.to_tsas()), t);
        let mut tcp = e;
        tcp.trtype = trtype::TCP;
        assert_eq!(tcp.rdma_tsas(), None);
    }

    #[test]
    fn bad_length() {
        assert!(DiscoveryLogEntry::parse(&entry_bytes()[..1023]).is_err());
        assert!(DiscoveryLogHeader::parse(&[0u8; 1023]).is_err());
        assert!(
            DiscoveryLogEntry::rdma(&Nqn::discovery(), "x", &"9".repeat(33), false, 0).is_err()
        );
    }

    #[test]
    fn header_and_page() {
        let h = DiscoveryLogHeader {
            genctr: 7,
            numrec: 2,
            recfmt: 0,
        };
        let mut page = vec![0u8; 3 * 1024];
        let mut hb = [0u8; 1024];
        h.emit(&mut hb);
        assert_eq!(
            &hb[..18],
            &[7, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0]
        );
        page[..1024].copy_from_slice(&hb);
        page[1024..2048].copy_from_slice(&entry_bytes());
        page[2048..].copy_from_slice(&entry_bytes());
        let h2 = DiscoveryLogHeader::parse(&page).unwrap();
        assert_eq!(h2, h);
        assert_eq!(h2.entries(&page).count(), 2);
        // NUMREC larger than the buffer: only complete entries.
        assert_eq!(h2.entries(&page[..3071]).count(), 1);
        assert_eq!(h2.entries(&page[..2047]).count(), 0);
        let big = DiscoveryLogHeader {
            numrec: u64::MAX,
            ..h
        };
        assert_eq!(big.entries(&page).count(), 2);
        assert_eq!(big.entries(&page[..10]).count(), 0);
        assert_eq!(DiscoveryLogHeader::log_len(2), Some(3072));
        assert_eq!(DiscoveryLogHeader::log_len(u64::MAX), None);
    }
}

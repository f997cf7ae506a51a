//! Admin and NVM I/O opcodes, and builders that return a ready [`Sqe`] for the commands an
//! NVMe-oF initiator sends. Every builder leaves DPTR as the NULL SGL; the transport sets
//! the real descriptor (keyed or in-capsule) with [`Sqe::set_sgl`].
//!
//! Field positions (Linux `include/linux/nvme.h`: `struct nvme_rw_command`, `nvme_dsm_cmd`,
//! `nvme_dsm_range`, `nvme_write_zeroes_cmd`, `nvme_identify`, `nvme_features`,
//! `nvme_get_log_page_command`; SPDK `nvme_spec.h`):
//! - Read/Write/Write Zeroes: SLBA in CDW10 (low) / CDW11 (high), NLB 0's based in CDW12
//!   bits 15:0, FUA CDW12 bit 30, DEAC (Write Zeroes) CDW12 bit 25.
//! - Dataset Management: NR 0's based in CDW10 bits 7:0, AD in CDW11 bit 2; data = NR+1
//!   16-byte ranges {cattr le32, nlb le32 (not 0's based), slba le64}.
//! - Identify: CNS CDW10 bits 7:0, CNTID CDW10 bits 31:16.
//! - Get Log Page: LID CDW10 bits 7:0, NUMDL CDW10 bits 31:16, NUMDU CDW11 bits 15:0 (NUMD
//!   = dwords - 1), LPOL CDW12, LPOU CDW13.
//! - Set/Get Features: FID CDW10 bits 7:0; Number of Queues: NSQR CDW11 15:0, NCQR 31:16,
//!   both 0's based, and the same layout (NSQA/NCQA) in the completion's DW0.

use super::sqe::Sqe;
use super::{check_len, le32, le64, put32, put64, NvmeWireError};

/// Opcodes. Admin and I/O opcodes overlap (0x02 is Get Log Page on the admin queue and Read
/// on an I/O queue), hence two modules.
pub mod opcode {
    /// Fabrics commands (Connect, Property Get/Set), on any queue.
    pub const FABRICS: u8 = 0x7F;

    pub mod admin {
        pub const GET_LOG_PAGE: u8 = 0x02;
        pub const IDENTIFY: u8 = 0x06;
        pub const ABORT: u8 = 0x08;
        pub const SET_FEATURES: u8 = 0x09;
        pub const GET_FEATURES: u8 = 0x0A;
        pub const ASYNC_EVENT_REQUEST: u8 = 0x0C;
        pub const KEEP_ALIVE: u8 = 0x18;
        /// Cross-Controller Reset (TP8028), see `nvme::ccr`.
        pub const CROSS_CTRL_RESET: u8 = 0x38;
    }

    pub mod io {
        pub const FLUSH: u8 = 0x00;
        pub const WRITE: u8 = 0x01;
        pub const READ: u8 = 0x02;
        pub const WRITE_ZEROES: u8 = 0x08;
        pub const DATASET_MANAGEMENT: u8 = 0x09;
    }
}

/// Identify CNS values.
pub mod cns {
    pub const NAMESPACE: u8 = 0x00;
    pub const CONTROLLER: u8 = 0x01;
    pub const ACTIVE_NAMESPACE_LIST: u8 = 0x02;
    /// Namespace Identification Descriptor list (NVMe 1.3). Linux reads it from every
    /// controller that reports version 1.3 or later and drops the namespace if it fails.
    pub const NS_ID_DESCRIPTORS: u8 = 0x03;
}

/// Feature identifiers.
pub mod feature {
    pub const VOLATILE_WRITE_CACHE: u8 = 0x06;
    pub const NUMBER_OF_QUEUES: u8 = 0x07;
    pub const ASYNC_EVENT_CONFIG: u8 = 0x0B;
    pub const KEEP_ALIVE_TIMER: u8 = 0x0F;
}

/// Log page identifiers.
pub mod lid {
    pub const ERROR_INFO: u8 = 0x01;
    pub const SMART: u8 = 0x02;
    pub const CHANGED_NS_LIST: u8 = 0x04;
    /// Cross-Controller Reset log (TP8028), see `nvme::ccr`.
    pub const CROSS_CTRL_RESET: u8 = 0x1E;
    /// Discovery log page, on a discovery controller.
    pub const DISCOVERY: u8 = 0x70;
}

/// NSID meaning "all namespaces".
pub const NSID_ALL: u32 = 0xFFFF_FFFF;
/// Most blocks one Read/Write/Write Zeroes can name (NLB is 16 bits, 0's based).
pub const MAX_BLOCKS: u32 = 1 << 16;
/// Most ranges one Dataset Management command can carry (NR is 8 bits, 0's based).
pub const MAX_DSM_RANGES: usize = 256;
/// Size of the data an Identify returns.
pub const IDENTIFY_DATA_LEN: usize = 4096;

const CDW12_FUA: u32 = 1 << 30;
const CDW12_DEAC: u32 = 1 << 25;
const CDW11_DSM_AD: u32 = 1 << 2;

fn blocks_0s_based(blocks: u32) -> Result<u32, NvmeWireError> {
    if blocks == 0 || blocks > MAX_BLOCKS {
        return Err(NvmeWireError::OutOfRange {
            what: "block count",
            value: u64::from(blocks),
            min: 1,
            max: u64::from(MAX_BLOCKS),
        });
    }
    Ok(blocks - 1)
}

fn lba_cmd(opc: u8, cid: u16, nsid: u32, slba: u64, blocks: u32) -> Result<Sqe, NvmeWireError> {
    let nlb = blocks_0s_based(blocks)?;
    let mut s = Sqe::new(opc, cid);
    s.nsid = nsid;
    s.cdw10 = slba as u32;
    s.cdw11 = (slba >> 32) as u32;
    s.cdw12 = nlb;
    Ok(s)
}

/// Read `blocks` (1..=65536) logical blocks starting at `slba`.
pub fn read(cid: u16, nsid: u32, slba: u64, blocks: u32) -> Result<Sqe, NvmeWireError> {
    lba_cmd(opcode::io::READ, cid, nsid, slba, blocks)
}

/// Write `blocks` (1..=65536) logical blocks at `slba`; `fua` forces them to media first.
pub fn write(cid: u16, nsid: u32, slba: u64, blocks: u32, fua: bool) -> Result<Sqe, NvmeWireError> {
    let mut s = lba_cmd(opcode::io::WRITE, cid, nsid, slba, blocks)?;
    if fua {
        s.cdw12 |= CDW12_FUA;
    }
    Ok(s)
}

/// Zero `blocks` (1..=65536) logical blocks at `slba` without a data transfer;
/// `deallocate` lets the controller deallocate them (DEAC).
pub fn write_zeroes(
    cid: u16,
    nsid: u32,
    slba: u64,
    blocks: u32,
    deallocate: bool,
) -> Result<Sqe, NvmeWireError> {
    let mut s = lba_cmd(opcode::io::WRITE_ZEROES, cid, nsid, slba, blocks)?;
    if deallocate {
        s.cdw12 |= CDW12_DEAC;
    }
    Ok(s)
}

/// Flush the volatile write cache of `nsid`.
pub fn flush(cid: u16, nsid: u32) -> Sqe {
    let mut s = Sqe::new(opcode::io::FLUSH, cid);
    s.nsid = nsid;
    s
}

/// Dataset Management with the Deallocate attribute (discard / TRIM) over `ranges`
/// (1..=256) [`DsmRange`]s sent as data (`ranges * 16` bytes).
pub fn dsm_deallocate(cid: u16, nsid: u32, ranges: usize) -> Result<Sqe, NvmeWireError> {
    if ranges == 0 || ranges > MAX_DSM_RANGES {
        return Err(NvmeWireError::OutOfRange {
            what: "DSM range count",
            value: ranges as u64,
            min: 1,
            max: MAX_DSM_RANGES as u64,
        });
    }
    let mut s = Sqe::new(opcode::io::DATASET_MANAGEMENT, cid);
    s.nsid = nsid;
    s.cdw10 = (ranges - 1) as u32;
    s.cdw11 = CDW11_DSM_AD;
    Ok(s)
}

/// Identify with any CNS; 4096 bytes of data come back.
pub fn identify(cid: u16, cns: u8, nsid: u32, cntid: u16) -> Sqe {
    let mut s = Sqe::new(opcode::admin::IDENTIFY, cid);
    s.nsid = nsid;
    s.cdw10 = u32::from(cns) | u32::from(cntid) << 16;
    s
}

/// Identify Controller (CNS 0x01).
pub fn identify_controller(cid: u16) -> Sqe {
    identify(cid, cns::CONTROLLER, 0, 0)
}

/// Identify Namespace (CNS 0x00) for `nsid`.
pub fn identify_namespace(cid: u16, nsid: u32) -> Sqe {
    identify(cid, cns::NAMESPACE, nsid, 0)
}

/// Active Namespace ID list (CNS 0x02): up to 1024 active NSIDs greater than `after`.
pub fn identify_active_namespaces(cid: u16, after: u32) -> Sqe {
    identify(cid, cns::ACTIVE_NAMESPACE_LIST, after, 0)
}

/// Get Log Page: `len` bytes (a non-zero multiple of 4, at most 16 GiB) of log `lid` from
/// byte `offset` (a multiple of 4).
pub fn get_log_page(
    cid: u16,
    nsid: u32,
    lid: u8,
    offset: u64,
    len: u64,
) -> Result<Sqe, NvmeWireError> {
    const MAX: u64 = 4 << 32;
    if len == 0 || len % 4 != 0 || len > MAX {
        return Err(NvmeWireError::OutOfRange {
            what: "log page length (dword multiple)",
            value: len,
            min: 4,
            max: MAX,
        });
    }
    if offset % 4 != 0 {
        return Err(NvmeWireError::OutOfRange {
            what: "log page offset (dword multiple)",
            value: offset,
            min: 0,
            max: !3,
        });
    }
    let numd = (len / 4 - 1) as u32;
    let mut s = Sqe::new(opcode::admin::GET_LOG_PAGE, cid);
    s.nsid = nsid;
    s.cdw10 = u32::from(lid) | (numd & 0xFFFF) << 16;
    s.cdw11 = numd >> 16;
    s.cdw12 = offset as u32;
    s.cdw13 = (offset >> 32) as u32;
    Ok(s)
}

/// Read the discovery log (`len` bytes from `offset`) from a discovery controller.
pub fn get_discovery_log(cid: u16, offset: u64, len: u64) -> Result<Sqe, NvmeWireError> {
    get_log_page(cid, 0, lid::DISCOVERY, offset, len)
}

/// Set Features `fid` with CDW11 `value`.
pub fn set_features(cid: u16, fid: u8, value: u32) -> Sqe {
    let mut s = Sqe::new(opcode::admin::SET_FEATURES, cid);
    s.cdw10 = u32::from(fid);
    s.cdw11 = value;
    s
}

/// Get Features `fid` (current value).
pub fn get_features(cid: u16, fid: u8) -> Sqe {
    let mut s = Sqe::new(opcode::admin::GET_FEATURES, cid);
    s.cdw10 = u32::from(fid);
    s
}

/// Ask for `sq` submission and `cq` completion I/O queues (each 1..=65535); the controller
/// answers with what it allocated, see [`num_queues_allocated`].
pub fn set_num_queues(cid: u16, sq: u32, cq: u32) -> Result<Sqe, NvmeWireError> {
    let check = |what, n: u32| {
        if n == 0 || n > 0xFFFF {
            Err(NvmeWireError::OutOfRange {
                what,
                value: u64::from(n),
                min: 1,
                max: 0xFFFF,
            })
        } else {
            Ok(n - 1)
        }
    };
    let nsqr = check("submission queue count", sq)?;
    let ncqr = check("completion queue count", cq)?;
    Ok(set_features(
        cid,
        feature::NUMBER_OF_QUEUES,
        nsqr | ncqr << 16,
    ))
}

/// (submission, completion) I/O queues allocated, from the Number of Queues result DW0.
pub fn num_queues_allocated(dw0: u32) -> (u32, u32) {
    ((dw0 & 0xFFFF) + 1, (dw0 >> 16) + 1)
}

/// Asynchronous Event Request: completes when the controller has something to report.
pub fn async_event_request(cid: u16) -> Sqe {
    Sqe::new(opcode::admin::ASYNC_EVENT_REQUEST, cid)
}

/// Keep Alive.
pub fn keep_alive(cid: u16) -> Sqe {
    Sqe::new(opcode::admin::KEEP_ALIVE, cid)
}

mod dsm_field {
    pub const CATTR: usize = 0;
    pub const NLB: usize = 4;
    pub const SLBA: usize = 8;
    pub const SIZE: usize = 16;
}

/// One Dataset Management range (16 bytes, Linux `struct nvme_dsm_range`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct DsmRange {
    /// Context attributes.
    pub cattr: u32,
    /// Length in logical blocks (a count, not 0's based).
    pub nlb: u32,
    pub slba: u64,
}

impl DsmRange {
    pub const LEN: usize = dsm_field::SIZE;

    pub fn parse(b: &[u8]) -> Result<DsmRange, NvmeWireError> {
        check_len("DSM range", b, dsm_field::SIZE)?;
        Ok(DsmRange {
            cattr: le32(b, dsm_field::CATTR),
            nlb: le32(b, dsm_field::NLB),
            slba: le64(b, dsm_field::SLBA),
        })
    }

    pub fn emit(&self, out: &mut [u8; 16]) {
        put32(out, dsm_field::CATTR, self.cattr);
        put32(out, dsm_field::NLB, self.nlb);
        put64(out, dsm_field::SLBA, self.slba);
    }

    pub fn to_bytes(&self) -> [u8; 16] {
        let mut out = [0u8; 16];
        self.emit(&mut out);
        out
    }

    /// The ranges in a DSM data buffer; a trailing partial range is ignored.
    pub fn parse_all(b: &[u8]) -> impl Iterator<Item = DsmRange> + '_ {
        b.chunks_exact(dsm_field::SIZE)
            .filter_map(|c| DsmRange::parse(c).ok())
    }

    /// Write `ranges` back to back into `out`; returns the bytes written, or an error if
    /// `out` is too small or there are more than 256 ranges.
    pub fn emit_all(ranges: &[DsmRange], out: &mut [u8]) -> Result<usize, NvmeWireError> {
        if ranges.is_empty() || ranges.len() > MAX_DSM_RANGES {
            return Err(NvmeWireError::OutOfRange {
                what: "DSM range count",
                value: ranges.len() as u64,
                min: 1,
                max: MAX_DSM_RANGES as u64,
            });
        }
        let need = ranges.len() * dsm_field::SIZE;
        check_len("DSM range buffer", out, need)?;
        for (r, chunk) in ranges.iter().zip(out.chunks_exact_mut(dsm_field::SIZE)) {
            let mut b = [0u8; 16];
            r.emit(&mut b);
            chunk.copy_from_slice(&b);
        }
        Ok(need)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nvme::sgl::SglDescriptor;

    #[test]
    fn read_write() {
        let r = read(5, 1, 0x1_0000_0010, 8).unwrap();
        assert_eq!(r.opcode, 0x02);
        assert_eq!((r.cid, r.nsid), (5, 1));
        assert_eq!((r.cdw10, r.cdw11, r.cdw12), (0x10, 1, 7));
        assert!(r.sgl().unwrap().is_null());
        let b = r.to_bytes();
        assert_eq!(
            &b[40..48],
            &0x1_0000_0010u64.to_le_bytes(),
            "slba at byte 40"
        );
        assert_eq!(&b[48..50], &[7, 0], "nlb at byte 48");

        let w = write(6, 2, 0, MAX_BLOCKS, true).unwrap();
        assert_eq!(w.opcode, 0x01);
        assert_eq!(w.cdw12, 0xFFFF | 1 << 30);
        assert_eq!(w.to_bytes()[51], 0x40, "FUA is control bit 14");
        assert!(read(0, 1, 0, 0).is_err());
        assert!(write(0, 1, 0, MAX_BLOCKS + 1, false).is_err());

        let z = write_zeroes(7, 1, 100, 1, true).unwrap();
        assert_eq!(z.opcode, 0x08);
        assert_eq!(z.cdw12, 1 << 25);
        assert_eq!(z.to_bytes()[51], 0x02, "DEAC is control bit 9");
    }

    #[test]
    fn dsm() {
        let d = dsm_deallocate(1, 1, 3).unwrap();
        assert_eq!((d.opcode, d.cdw10, d.cdw11), (0x09, 2, 4));
        assert!(dsm_deallocate(1, 1, 0).is_err());
        assert!(dsm_deallocate(1, 1, 257).is_err());
        assert_eq!(dsm_deallocate(1, 1, 256).unwrap().cdw10, 255);
    }

    #[test]
    fn dsm_range() {
        let r = DsmRange {
            cattr: 0x0A0B_0C0D,
            nlb: 0x1000,
            slba: 0x0102_0304_0506_0708,
        };
        let bytes = [
            0x0D, 0x0C, 0x0B, 0x0A, 0x00, 0x10, 0x00, 0x00, 0x08, 0x07, 0x06, 0x05, 0x04, 0x03,
            0x02, 0x01,
        ];
        assert_eq!(r.to_bytes(), bytes);
        assert_eq!(DsmRange::parse(&bytes).unwrap(), r);
        assert!(DsmRange::parse(&bytes[..15]).is_err());
        let mut buf = [0u8; 40];
        assert_eq!(DsmRange::emit_all(&[r, r], &mut buf).unwrap(), 32);
        assert_eq!(
            DsmRange::parse_all(&buf[..32]).collect::<Vec<_>>(),
            vec![r, r]
        );
        assert_eq!(DsmRange::parse_all(&buf[..31]).count(), 1);
        assert!(DsmRange::emit_all(&[r, r, r], &mut buf).is_err());
        assert!(DsmRange::emit_all(&[], &mut buf).is_err());
    }

    #[test]
    fn identify_cmds() {
        let c = identify_controller(1);
        assert_eq!((c.opcode, c.nsid, c.cdw10), (0x06, 0, 1));
        let n = identify_namespace(2, 7);
        assert_eq!((n.nsid, n.cdw10), (7, 0));
        let l = identify_active_namespaces(3, 0);
        assert_eq!(l.cdw10, 2);
        assert_eq!(identify(4, 0x01, 0, 0x1234).cdw10, 0x1234_0001);
    }

    #[test]
    fn log_page() {
        // 4096 bytes = 1024 dwords -> NUMD 1023.
        let g = get_discovery_log(9, 0, 4096).unwrap();
        assert_eq!(g.opcode, 0x02);
        assert_eq!(g.cdw10, 0x70 | 1023 << 16);
        assert_eq!(g.cdw11, 0);
        // NUMD spills into NUMDU above 64 K dwords; offset splits across CDW12/13.
        let g = get_log_page(9, NSID_ALL, lid::SMART, 0x1_0000_0004, 4 << 16).unwrap();
        assert_eq!(g.cdw10 >> 16, 0xFFFF);
        assert_eq!(g.cdw11, 0);
        let g = get_log_page(9, 0, 1, 8, (4 << 16) + 4).unwrap();
        assert_eq!((g.cdw10 >> 16, g.cdw11), (0, 1));
        assert_eq!((g.cdw12, g.cdw13), (8, 0));
        let g = get_log_page(9, 0, 1, 0x1_0000_0004, 4).unwrap();
        assert_eq!((g.cdw12, g.cdw13), (4, 1));
        assert!(get_log_page(9, 0, 1, 0, 0).is_err());
        assert!(get_log_page(9, 0, 1, 0, 6).is_err());
        assert!(get_log_page(9, 0, 1, 2, 4).is_err());
        assert!(get_log_page(9, 0, 1, 0, (4 << 32) + 4).is_err());
        assert_eq!(get_log_page(9, 0, 1, 0, 4 << 32).unwrap().cdw11, 0xFFFF);
    }

    #[test]
    fn features_and_queues() {
        let s = set_num_queues(1, 4, 4).unwrap();
        assert_eq!((s.opcode, s.cdw10, s.cdw11), (0x09, 0x07, 3 | 3 << 16));
        assert!(set_num_queues(1, 0, 1).is_err());
        assert!(set_num_queues(1, 1, 0x1_0000).is_err());
        assert_eq!(num_queues_allocated(0x0001_0003), (4, 2));
        assert_eq!(num_queues_allocated(u32::MAX), (0x1_0000, 0x1_0000));
        let g = get_features(2, feature::KEEP_ALIVE_TIMER);
        assert_eq!((g.opcode, g.cdw10), (0x0A, 0x0F));
        assert_eq!(keep_alive(3).opcode, 0x18);
        assert_eq!(async_event_request(4).opcode, 0x0C);
        assert_eq!(flush(5, 1).opcode, 0x00);
        assert_eq!(flush(5, 1).nsid, 1);
    }

    #[test]
    fn builders_parse_back() {
        let keyed = SglDescriptor::keyed(0x2000, 512, 0x55, false).unwrap();
        for s in [
            read(1, 1, 42, 1).unwrap(),
            write(2, 1, 42, 3, false).unwrap(),
            dsm_deallocate(3, 1, 1).unwrap(),
            identify_controller(4),
            get_discovery_log(5, 1024, 1024).unwrap(),
            set_num_queues(6, 2, 2).unwrap(),
            keep_alive(7),
        ] {
            let s = s.with_sgl(&keyed).unwrap();
            assert_eq!(Sqe::parse(&s.to_bytes()).unwrap(), s);
        }
    }
}

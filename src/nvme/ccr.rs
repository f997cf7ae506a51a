//! Cross-Controller Reset (NVMe TP8028, "Rapid Path Failure Recovery"): the admin command a
//! host sends to a live controller of a subsystem to reset another controller of the same
//! subsystem (the impacted one, whose connection died), its completion, the CCR log page that
//! reports how each reset ended, and the asynchronous event that says the log changed.
//!
//! Layouts: libnvme `nvme-types-base.h` (`nvme_admin_cross_ctrl_reset` 0x38,
//! `enum nvme_cross_ctrl_reset_cdw10`, `nvme_cross_ctrl_reset_cqe_dw0`,
//! `struct nvme_cross_ctrl_reset_log` / `_entry`, LID 0x1E, status codes 0x3F..0x41), as in
//! the Linux host and nvmet series that implement TP8028.
//! - Command: CDW10 bits 15:0 ICID (the impacted controller's CNTLID), bits 23:16 its CIU,
//!   bits 31:24 reserved; CDW11 reserved; CDW12/CDW13 its CIRN (low, high). No data.
//! - Completion DW0: bit 0 IRS (the reset already finished), bit 1 V (validated), bit 2 CLRI
//!   (controller level reset initiated); V and CLRI mean nothing without IRS.
//! - Log page: NE le16 at 0, 6 reserved bytes, then NE entries of 8 bytes {ICID le16, CIU,
//!   reserved, ACID le16, CCRS, CCRF}.

use super::sqe::Sqe;
use super::status::Status;
use super::{check_len, le16, put16, NvmeWireError};
use crate::nvme::admin::{lid, opcode};

/// One instance of a controller: CNTLID alone is not enough, a new association may reuse it;
/// CIU and CIRN change with every instance, so a CCR cannot reset a newer controller by
/// mistake.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct CtrlInstance {
    pub cntlid: u16,
    pub ciu: u8,
    pub cirn: u64,
}

const CDW10_RESERVED: u32 = 0xFF00_0000;

/// The Cross-Controller Reset command that resets `impacted`.
pub fn cross_ctrl_reset(cid: u16, impacted: CtrlInstance) -> Sqe {
    let mut s = Sqe::new(opcode::admin::CROSS_CTRL_RESET, cid);
    s.cdw10 = u32::from(impacted.cntlid) | u32::from(impacted.ciu) << 16;
    s.cdw12 = impacted.cirn as u32;
    s.cdw13 = (impacted.cirn >> 32) as u32;
    s
}

/// The controller a Cross-Controller Reset names (target side). Reserved bits set are an
/// Invalid Field, as for any command.
pub fn parse_cross_ctrl_reset(s: &Sqe) -> Result<CtrlInstance, NvmeWireError> {
    if s.opcode != opcode::admin::CROSS_CTRL_RESET {
        return Err(NvmeWireError::OutOfRange {
            what: "Cross-Controller Reset opcode",
            value: u64::from(s.opcode),
            min: u64::from(opcode::admin::CROSS_CTRL_RESET),
            max: u64::from(opcode::admin::CROSS_CTRL_RESET),
        });
    }
    if s.cdw10 & CDW10_RESERVED != 0 || s.cdw11 != 0 {
        return Err(NvmeWireError::OutOfRange {
            what: "Cross-Controller Reset reserved bits (CDW10 31:24, CDW11)",
            value: u64::from(s.cdw10 & CDW10_RESERVED) | u64::from(s.cdw11) << 32,
            min: 0,
            max: 0,
        });
    }
    Ok(CtrlInstance {
        cntlid: s.cdw10 as u16,
        ciu: (s.cdw10 >> 16) as u8,
        cirn: u64::from(s.cdw12) | u64::from(s.cdw13) << 32,
    })
}

/// Command specific status codes of Cross-Controller Reset.
pub mod status {
    use super::Status;
    /// This controller already runs a CCR for the impacted controller.
    pub const IN_PROGRESS: Status = Status::new(1, 0x3F);
    /// The CCR log page has no room for another entry.
    pub const LOG_FULL: Status = Status::new(1, 0x40);
    /// As many CCRs run as CCRL allows.
    pub const LIMIT_EXCEEDED: Status = Status::new(1, 0x41);
}

const DW0_IRS: u32 = 1 << 0;
const DW0_V: u32 = 1 << 1;
const DW0_CLRI: u32 = 1 << 2;

/// What a successful Cross-Controller Reset completion says (DW0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CcrResult {
    /// Immediate Reset Successful: the impacted controller's commands are already finished;
    /// nothing to wait for. Clear: the reset is under way, its end shows in the CCR log.
    pub immediate: bool,
    /// Validated (meaningful with `immediate`).
    pub validated: bool,
    /// Controller level reset initiated (meaningful with `immediate`).
    pub ctrl_reset: bool,
}

impl CcrResult {
    /// Decode DW0; bits this version does not know are ignored, so it never fails.
    pub fn from_dw0(dw0: u32) -> CcrResult {
        let immediate = dw0 & DW0_IRS != 0;
        CcrResult {
            immediate,
            validated: immediate && dw0 & DW0_V != 0,
            ctrl_reset: immediate && dw0 & DW0_CLRI != 0,
        }
    }

    pub fn to_dw0(self) -> u32 {
        if !self.immediate {
            return 0;
        }
        DW0_IRS
            | if self.validated { DW0_V } else { 0 }
            | if self.ctrl_reset { DW0_CLRI } else { 0 }
    }
}

/// How a reset listed in the CCR log stands (CCRS).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CcrState {
    InProgress,
    /// The impacted controller's commands are finished: held commands may be resent.
    Success,
    /// The reset did not happen: the host falls back to time (KATO + CQT).
    Failed,
}

impl CcrState {
    fn from_byte(b: u8) -> Result<CcrState, NvmeWireError> {
        match b {
            0 => Ok(CcrState::InProgress),
            1 => Ok(CcrState::Success),
            2 => Ok(CcrState::Failed),
            _ => Err(NvmeWireError::OutOfRange {
                what: "CCR log entry status (CCRS)",
                value: u64::from(b),
                min: 0,
                max: 2,
            }),
        }
    }
    fn byte(self) -> u8 {
        match self {
            CcrState::InProgress => 0,
            CcrState::Success => 1,
            CcrState::Failed => 2,
        }
    }
}

/// CCRF bit 0: validated.
pub const CCRF_VALIDATED: u8 = 1 << 0;
/// CCRF bit 1: controller level reset initiated.
pub const CCRF_CTRL_RESET: u8 = 1 << 1;

/// One entry of the CCR log page.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CcrLogEntry {
    /// The impacted controller (ICID).
    pub icid: u16,
    pub ciu: u8,
    /// The controller that carried out the reset (ACID).
    pub acid: u16,
    pub state: CcrState,
    /// CCRF: [`CCRF_VALIDATED`], [`CCRF_CTRL_RESET`], RETRY in bits 3:2.
    pub flags: u8,
}

impl CcrLogEntry {
    pub const LEN: usize = 8;

    /// Does this entry report on `impacted`? The log carries no CIRN: CNTLID and CIU decide.
    pub fn is_for(&self, impacted: &CtrlInstance) -> bool {
        self.icid == impacted.cntlid && self.ciu == impacted.ciu
    }

    pub fn parse(b: &[u8]) -> Result<CcrLogEntry, NvmeWireError> {
        check_len("CCR log entry", b, Self::LEN)?;
        Ok(CcrLogEntry {
            icid: le16(b, 0),
            ciu: b[2],
            acid: le16(b, 4),
            state: CcrState::from_byte(b[6])?,
            flags: b[7],
        })
    }

    pub fn emit(&self, out: &mut [u8; 8]) {
        put16(out, 0, self.icid);
        out[2] = self.ciu;
        out[3] = 0;
        put16(out, 4, self.acid);
        out[6] = self.state.byte();
        out[7] = self.flags;
    }
}

/// Size of the log page header (NE and reserved bytes).
pub const LOG_HEADER_LEN: usize = 8;

/// A view of CCR log page bytes, checked once at construction: the header is there and every
/// entry NE announces is inside the buffer, so no accessor can fail on length afterwards.
#[derive(Debug, Clone, Copy)]
pub struct CcrLog<T: AsRef<[u8]>> {
    buf: T,
    entries: usize,
}

impl<T: AsRef<[u8]>> CcrLog<T> {
    /// Check `buf` (the bytes a Get Log Page returned, from offset 0). A buffer shorter than
    /// NE entries is an error: a host that asked for fewer bytes must ask again for more.
    pub fn new_checked(buf: T) -> Result<CcrLog<T>, NvmeWireError> {
        let b = buf.as_ref();
        check_len("CCR log page header", b, LOG_HEADER_LEN)?;
        let entries = usize::from(le16(b, 0));
        check_len(
            "CCR log page entries",
            b,
            LOG_HEADER_LEN + entries * CcrLogEntry::LEN,
        )?;
        Ok(CcrLog { buf, entries })
    }

    /// Number of entries (NE).
    pub fn len(&self) -> usize {
        self.entries
    }

    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }

    /// Entry `i`; `None` past the end, `Some(Err)` for an entry with a reserved status.
    pub fn entry(&self, i: usize) -> Option<Result<CcrLogEntry, NvmeWireError>> {
        if i >= self.entries {
            return None;
        }
        let at = LOG_HEADER_LEN + i * CcrLogEntry::LEN;
        Some(CcrLogEntry::parse(&self.buf.as_ref()[at..]))
    }

    pub fn entries(&self) -> impl Iterator<Item = Result<CcrLogEntry, NvmeWireError>> + '_ {
        (0..self.entries).filter_map(|i| self.entry(i))
    }

    /// How the reset of `impacted` stands, if the log lists it. Entries with a reserved
    /// status are skipped: they say nothing about any controller this host knows.
    pub fn state_of(&self, impacted: &CtrlInstance) -> Option<CcrState> {
        self.entries()
            .filter_map(Result::ok)
            .find(|e| e.is_for(impacted))
            .map(|e| e.state)
    }
}

/// Write a CCR log page with `entries` into `out`; returns the bytes used. Fails if `out` is
/// too small or there are more entries than NE can count.
pub fn emit_log(entries: &[CcrLogEntry], out: &mut [u8]) -> Result<usize, NvmeWireError> {
    let ne = u16::try_from(entries.len()).map_err(|_| NvmeWireError::OutOfRange {
        what: "CCR log entries",
        value: entries.len() as u64,
        min: 0,
        max: u64::from(u16::MAX),
    })?;
    let need = LOG_HEADER_LEN + entries.len() * CcrLogEntry::LEN;
    if out.len() < need {
        return Err(NvmeWireError::Truncated {
            what: "CCR log page buffer",
            need,
            have: out.len(),
        });
    }
    out[..LOG_HEADER_LEN].fill(0);
    put16(out, 0, ne);
    for (i, e) in entries.iter().enumerate() {
        let at = LOG_HEADER_LEN + i * CcrLogEntry::LEN;
        let mut b = [0u8; CcrLogEntry::LEN];
        e.emit(&mut b);
        out[at..at + CcrLogEntry::LEN].copy_from_slice(&b);
    }
    Ok(need)
}

/// Get Log Page LSP bit 0 (RMC): the controller drops completed entries once returned.
pub const LSP_REMOVE_COMPLETED: u8 = 1 << 0;

/// Get Log Page for the CCR log: `entries` entries' worth from offset 0, with Remove
/// Completed when `remove_completed`.
pub fn get_ccr_log(cid: u16, entries: usize, remove_completed: bool) -> Result<Sqe, NvmeWireError> {
    let len = (LOG_HEADER_LEN + entries * CcrLogEntry::LEN) as u64;
    let mut s = crate::nvme::admin::get_log_page(cid, 0, lid::CROSS_CTRL_RESET, 0, len)?;
    if remove_completed {
        // LSP is CDW10 bits 14:8.
        s.cdw10 |= u32::from(LSP_REMOVE_COMPLETED) << 8;
    }
    Ok(s)
}

/// Asynchronous event type Notice.
pub const AEN_TYPE_NOTICE: u8 = 2;
/// Asynchronous Event Information the target reports with a finished CCR. The public sources
/// name the event (Linux `NVME_AER_NOTICE_CCR_COMPLETED`) but not its number; this value is
/// one no other notice uses. The host does not depend on it: it recognises the event by the
/// log page it names, see [`aen_reports_ccr`].
pub const AEN_INFO_CCR_COMPLETED: u8 = 0x09;

/// Does an Asynchronous Event Request completion (DW0) tell the host to read the CCR log?
/// Type bits 2:0, information 15:8, log page identifier 23:16.
pub fn aen_reports_ccr(dw0: u32) -> bool {
    (dw0 & 0x7) as u8 == AEN_TYPE_NOTICE && (dw0 >> 16) as u8 == lid::CROSS_CTRL_RESET
}

/// DW0 of the Asynchronous Event Request completion that reports a finished CCR.
pub fn ccr_aen_dw0() -> u32 {
    u32::from(AEN_TYPE_NOTICE)
        | u32::from(AEN_INFO_CCR_COMPLETED) << 8
        | u32::from(lid::CROSS_CTRL_RESET) << 16
}

#[cfg(test)]
mod tests {
    use super::*;

    const X: CtrlInstance = CtrlInstance {
        cntlid: 0x1234,
        ciu: 0xA5,
        cirn: 0x0102_0304_0506_0708,
    };

    #[test]
    fn command_deconstructs_to_libnvme_layout() {
        let s = cross_ctrl_reset(7, X);
        assert_eq!(s.opcode, 0x38);
        assert_eq!(s.cdw10, 0x00A5_1234);
        assert_eq!(s.cdw11, 0);
        assert_eq!(s.cdw12, 0x0506_0708);
        assert_eq!(s.cdw13, 0x0102_0304);
    }

    #[test]
    fn command_round_trips_through_bytes() {
        let mut b = [0u8; 64];
        cross_ctrl_reset(9, X).emit(&mut b);
        let back = Sqe::parse(&b).unwrap();
        assert_eq!(parse_cross_ctrl_reset(&back), Ok(X));
    }

    #[test]
    fn command_with_reserved_bits_or_wrong_opcode_is_an_error() {
        let mut s = cross_ctrl_reset(1, X);
        s.cdw10 |= 1 << 24;
        assert!(parse_cross_ctrl_reset(&s).is_err());
        let mut s = cross_ctrl_reset(1, X);
        s.cdw11 = 1;
        assert!(parse_cross_ctrl_reset(&s).is_err());
        let mut s = cross_ctrl_reset(1, X);
        s.opcode = 0x06;
        assert!(parse_cross_ctrl_reset(&s).is_err());
    }

    #[test]
    fn result_bits_follow_irs() {
        assert_eq!(CcrResult::from_dw0(0), CcrResult::default());
        // V and CLRI without IRS mean nothing.
        assert_eq!(CcrResult::from_dw0(0b110), CcrResult::default());
        let r = CcrResult::from_dw0(0b111);
        assert!(r.immediate && r.validated && r.ctrl_reset);
        assert_eq!(r.to_dw0(), 0b111);
        assert_eq!(CcrResult::from_dw0(0b1).to_dw0(), 1);
        assert_eq!(status::LIMIT_EXCEEDED.sc, 0x41);
    }

    #[test]
    fn log_page_round_trips() {
        let entries = [
            CcrLogEntry {
                icid: 3,
                ciu: 1,
                acid: 4,
                state: CcrState::InProgress,
                flags: 0,
            },
            CcrLogEntry {
                icid: X.cntlid,
                ciu: X.ciu,
                acid: 5,
                state: CcrState::Success,
                flags: CCRF_VALIDATED | CCRF_CTRL_RESET,
            },
        ];
        let mut page = [0xEEu8; 64];
        let n = emit_log(&entries, &mut page).unwrap();
        assert_eq!(n, 24);
        assert_eq!(&page[..8], &[2, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(&page[16..24], &[0x34, 0x12, 0xA5, 0, 5, 0, 1, 3]);
        let log = CcrLog::new_checked(&page[..n]).unwrap();
        assert_eq!(log.len(), 2);
        let back: Vec<_> = log.entries().map(Result::unwrap).collect();
        assert_eq!(back, entries);
        assert_eq!(log.state_of(&X), Some(CcrState::Success));
        let other = CtrlInstance { ciu: 0xA6, ..X };
        assert_eq!(log.state_of(&other), None);
        assert!(log.entry(2).is_none());
    }

    #[test]
    fn log_page_bad_input_is_an_error() {
        assert!(CcrLog::new_checked(&[0u8; 7][..]).is_err());
        // NE says 3 entries, the buffer holds 2.
        let mut page = [0u8; 24];
        page[0] = 3;
        assert!(CcrLog::new_checked(&page[..]).is_err());
        // A reserved CCRS value: the entry is an error, the view is fine.
        page[0] = 1;
        page[14] = 7;
        let log = CcrLog::new_checked(&page[..]).unwrap();
        assert!(log.entry(0).unwrap().is_err());
        assert_eq!(log.state_of(&CtrlInstance::default()), None);
        let mut small = [0u8; 15];
        assert!(emit_log(&[log_entry()], &mut small).is_err());
    }

    fn log_entry() -> CcrLogEntry {
        CcrLogEntry {
            icid: 1,
            ciu: 1,
            acid: 2,
            state: CcrState::Failed,
            flags: 0,
        }
    }

    #[test]
    fn get_ccr_log_sets_lid_length_and_rmc() {
        let s = get_ccr_log(3, 2, true).unwrap();
        assert_eq!(s.opcode, 0x02);
        assert_eq!(s.cdw10 & 0xFF, 0x1E);
        assert_eq!((s.cdw10 >> 8) & 0x7F, 1);
        // 24 bytes = 6 dwords, 0's based.
        assert_eq!(s.cdw10 >> 16, 5);
        // The header alone (8 bytes = 2 dwords), no Remove Completed.
        assert_eq!(get_ccr_log(3, 0, false).unwrap().cdw10 >> 8, 1 << 8);
    }

    #[test]
    fn aen_is_recognised_by_its_log_page() {
        assert!(aen_reports_ccr(ccr_aen_dw0()));
        // Same log page, any information value: still the CCR log.
        assert!(aen_reports_ccr(0x001E_0702));
        // Namespace attribute changed (log 0x04) and an error event naming 0x1E are not.
        assert!(!aen_reports_ccr(0x0004_0002));
        assert!(!aen_reports_ccr(0x001E_0000));
    }

    proptest::proptest! {
        #[test]
        fn log_parse_never_panics(b in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..80)) {
            if let Ok(log) = CcrLog::new_checked(&b[..]) {
                for e in log.entries() {
                    let _ = e;
                }
                let _ = log.state_of(&X);
            }
        }

        #[test]
        fn command_round_trips(cntlid: u16, ciu: u8, cirn: u64, cid: u16) {
            let x = CtrlInstance { cntlid, ciu, cirn };
            proptest::prop_assert_eq!(parse_cross_ctrl_reset(&cross_ctrl_reset(cid, x)), Ok(x));
        }
    }
}

//! Asymmetric Namespace Access (ANA): how a controller tells a host which of its paths to a
//! namespace are best, usable, or not usable at all. Shared by the host (multipath path
//! choice) and the built-in target (several ports, ANA groups whose state changes at run
//! time).
//!
//! Layouts: NVMe Base 2.0 section 8.1.3 and figure "Asymmetric Namespace Access log page", as
//! transcribed by libnvme (`struct nvme_ana_log`, `struct nvme_ana_group_desc`,
//! `enum nvme_ana_state`, `NVME_LOG_LID_ANA` 0x0C, `NVME_AER_NOTICE_ANA` 0x03) and used by
//! Linux `drivers/nvme/host/multipath.c` (`nvme_parse_ana_log`).
//! - Log page: CHGCNT le64 at 0, NGRPS le16 at 8, 6 reserved bytes, then NGRPS group
//!   descriptors.
//! - Group descriptor: ANAGRPID le32 at 0, NNSIDS le32 at 4, CHGCNT le64 at 8, state (bits
//!   3:0) at 16, 15 reserved bytes, then NNSIDS namespace IDs (le32 each).
//! - Identify Controller: CMIC at 76 (bit 3: ANA reporting), OAES le32 at 92 (bit 11: ANA
//!   change notices), ANATT at 342 (seconds), ANACAP at 343, ANAGRPMAX le32 at 344,
//!   NANAGRPID le32 at 348 (libnvme `struct nvme_id_ctrl`, after ENDGIDMAX at 340), MNAN
//!   le32 at 540. Linux refuses a controller that reports ANA with MNAN 0 or MNAN above NN,
//!   and sizes its ANA log buffer from NANAGRPID and MNAN.
//!   Identify Namespace: NMIC at 30 (bit 0: shared), ANAGRPID le32 at 92.

use super::sqe::Sqe;
use super::status::Status;
use super::{check_len, le16, le32, le64, put16, put32, put64, NvmeWireError};

/// Log page identifier of the ANA log.
pub const LID_ANA: u8 = 0x0C;
/// Get Log Page LSP bit 0 (RGO): return the groups only, without namespace lists.
pub const LSP_GROUPS_ONLY: u8 = 1 << 0;
/// Asynchronous Event Information (type Notice) of an ANA change.
pub const AEN_INFO_ANA_CHANGE: u8 = 0x03;

/// Identify Controller byte offsets.
pub mod id_ctrl {
    /// Controller Multi-Path I/O and Namespace Sharing Capabilities.
    pub const CMIC: usize = 76;
    /// CMIC bit 0: the subsystem may have more than one port.
    pub const CMIC_MULTI_PORT: u8 = 1 << 0;
    /// CMIC bit 1: the subsystem may have more than one controller.
    pub const CMIC_MULTI_CTRL: u8 = 1 << 1;
    /// CMIC bit 3: the controller reports ANA.
    pub const CMIC_ANA: u8 = 1 << 3;
    /// Optional Asynchronous Events Supported (le32).
    pub const OAES: usize = 92;
    /// OAES bit 8: Namespace Attribute Changed notices.
    pub const OAES_NS_ATTR: u32 = 1 << 8;
    /// OAES bit 11: ANA change notices.
    pub const OAES_ANA_CHANGE: u32 = 1 << 11;
    /// ANA Transition Time, seconds.
    pub const ANATT: usize = 342;
    /// ANA Capabilities.
    pub const ANACAP: usize = 343;
    /// ANACAP bits 0..4: the states the controller can report (optimized, non-optimized,
    /// inaccessible, persistent loss, change).
    pub const ANACAP_ALL_STATES: u8 = 0x1F;
    /// ANACAP bit 6: ANAGRPID does not change while the namespace is attached.
    pub const ANACAP_GRPID_STATIC: u8 = 1 << 6;
    /// ANA Group Identifier Maximum (le32).
    pub const ANAGRPMAX: usize = 344;
    /// Number of ANA Group Identifiers (le32).
    pub const NANAGRPID: usize = 348;
    /// Maximum Number of Allowed Namespaces (le32).
    pub const MNAN: usize = 540;
}

/// The longest ANA log page a controller with `nanagrpid` groups and `mnan` namespaces can
/// return: the header, one descriptor per group and one NSID per namespace.
pub const fn max_log_len(nanagrpid: u32, mnan: u32) -> usize {
    16 + nanagrpid as usize * 32 + mnan as usize * 4
}

/// Identify Namespace byte offsets.
pub mod id_ns {
    /// Namespace Multi-path I/O and Namespace Sharing Capabilities; bit 0: shared.
    pub const NMIC: usize = 30;
    pub const NMIC_SHARED: u8 = 1 << 0;
    /// The namespace's ANA group (le32).
    pub const ANAGRPID: usize = 92;
}

/// The access state of an ANA group through one controller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AnaState {
    Optimized,
    NonOptimized,
    Inaccessible,
    PersistentLoss,
    /// Changing: commands get "ANA Transition"; the host waits up to ANATT.
    Change,
}

impl AnaState {
    pub fn from_code(code: u8) -> Result<AnaState, NvmeWireError> {
        Ok(match code & 0x0F {
            0x1 => AnaState::Optimized,
            0x2 => AnaState::NonOptimized,
            0x3 => AnaState::Inaccessible,
            0x4 => AnaState::PersistentLoss,
            0xF => AnaState::Change,
            v => {
                return Err(NvmeWireError::OutOfRange {
                    what: "ANA state",
                    value: u64::from(v),
                    min: 1,
                    max: 0xF,
                })
            }
        })
    }

    pub fn code(self) -> u8 {
        match self {
            AnaState::Optimized => 0x1,
            AnaState::NonOptimized => 0x2,
            AnaState::Inaccessible => 0x3,
            AnaState::PersistentLoss => 0x4,
            AnaState::Change => 0xF,
        }
    }

    /// Linux's names (`nvme list-subsys`, sysfs `ana_state`).
    pub fn name(self) -> &'static str {
        match self {
            AnaState::Optimized => "optimized",
            AnaState::NonOptimized => "non-optimized",
            AnaState::Inaccessible => "inaccessible",
            AnaState::PersistentLoss => "persistent-loss",
            AnaState::Change => "change",
        }
    }

    /// May I/O be sent through a path in this state at all?
    pub fn is_usable(self) -> bool {
        matches!(self, AnaState::Optimized | AnaState::NonOptimized)
    }
}

impl std::str::FromStr for AnaState {
    type Err = String;
    fn from_str(s: &str) -> Result<AnaState, String> {
        [
            AnaState::Optimized,
            AnaState::NonOptimized,
            AnaState::Inaccessible,
            AnaState::PersistentLoss,
            AnaState::Change,
        ]
        .into_iter()
        .find(|st| st.name() == s)
        .ok_or_else(|| {
            format!(
                "unknown ANA state {s:?}: use optimized, non-optimized, inaccessible, persistent-loss or change"
            )
        })
    }
}

/// The multipath and ANA fields of Identify Controller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CtrlAna {
    pub cmic: u8,
    pub oaes: u32,
    /// ANA Transition Time, seconds.
    pub anatt: u8,
    pub anacap: u8,
    pub anagrpmax: u32,
    pub nanagrpid: u32,
    /// Maximum Number of Allowed Namespaces: at least 1 and at most NN when ANA is reported.
    pub mnan: u32,
}

impl CtrlAna {
    /// Read the fields from an Identify Controller page (4096 bytes).
    pub fn parse(page: &[u8]) -> Result<CtrlAna, NvmeWireError> {
        check_len("Identify Controller", page, id_ctrl::MNAN + 4)?;
        Ok(CtrlAna {
            cmic: page[id_ctrl::CMIC],
            oaes: le32(page, id_ctrl::OAES),
            anatt: page[id_ctrl::ANATT],
            anacap: page[id_ctrl::ANACAP],
            anagrpmax: le32(page, id_ctrl::ANAGRPMAX),
            nanagrpid: le32(page, id_ctrl::NANAGRPID),
            mnan: le32(page, id_ctrl::MNAN),
        })
    }

    /// Write the fields into an Identify Controller page the rest of which is emitted.
    pub fn emit(&self, page: &mut [u8; 4096]) {
        page[id_ctrl::CMIC] = self.cmic;
        put32(page, id_ctrl::OAES, self.oaes);
        page[id_ctrl::ANATT] = self.anatt;
        page[id_ctrl::ANACAP] = self.anacap;
        put32(page, id_ctrl::ANAGRPMAX, self.anagrpmax);
        put32(page, id_ctrl::NANAGRPID, self.nanagrpid);
        put32(page, id_ctrl::MNAN, self.mnan);
    }
}

/// The multipath and ANA fields of Identify Namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NsAna {
    pub nmic: u8,
    pub anagrpid: u32,
}

impl NsAna {
    /// Read the fields from an Identify Namespace page (4096 bytes).
    pub fn parse(page: &[u8]) -> Result<NsAna, NvmeWireError> {
        check_len("Identify Namespace", page, id_ns::ANAGRPID + 4)?;
        Ok(NsAna {
            nmic: page[id_ns::NMIC],
            anagrpid: le32(page, id_ns::ANAGRPID),
        })
    }

    /// Write the fields into an Identify Namespace page the rest of which is emitted.
    pub fn emit(&self, page: &mut [u8; 4096]) {
        page[id_ns::NMIC] = self.nmic;
        put32(page, id_ns::ANAGRPID, self.anagrpid);
    }
}

/// Path-related status codes (SCT 3) a controller answers when a path cannot serve I/O.
pub mod status {
    use super::Status;
    pub const INTERNAL_PATH_ERROR: Status = Status::new(3, 0x00);
    pub const ANA_PERSISTENT_LOSS: Status = Status::new(3, 0x01);
    pub const ANA_INACCESSIBLE: Status = Status::new(3, 0x02);
    pub const ANA_TRANSITION: Status = Status::new(3, 0x03);
}

/// Size of the log page header.
pub const LOG_HEADER_LEN: usize = 16;
/// Size of a group descriptor before its namespace list.
pub const DESC_HEADER_LEN: usize = 32;

/// One group as a log page reports it; `nsids` borrows the page's bytes.
#[derive(Debug, Clone, Copy)]
pub struct AnaGroup<'a> {
    pub grpid: u32,
    pub chgcnt: u64,
    pub state: AnaState,
    nsids: &'a [u8],
}

impl<'a> AnaGroup<'a> {
    pub fn nsid_count(&self) -> usize {
        self.nsids.len() / 4
    }

    pub fn nsids(&self) -> impl Iterator<Item = u32> + 'a {
        self.nsids.chunks_exact(4).map(|c| le32(c, 0))
    }
}

/// A view of ANA log page bytes, checked once at construction: every descriptor NGRPS
/// announces, and every namespace list, is inside the buffer and has a defined state, so
/// iterating cannot fail afterwards.
#[derive(Debug, Clone, Copy)]
pub struct AnaLog<'a> {
    buf: &'a [u8],
    pub chgcnt: u64,
    groups: usize,
}

impl<'a> AnaLog<'a> {
    /// Check `buf`, the bytes a Get Log Page for [`LID_ANA`] returned from offset 0. A page
    /// read with [`LSP_GROUPS_ONLY`] has NNSIDS 0 in every descriptor.
    pub fn new_checked(buf: &'a [u8]) -> Result<AnaLog<'a>, NvmeWireError> {
        check_len("ANA log page header", buf, LOG_HEADER_LEN)?;
        let groups = usize::from(le16(buf, 8));
        let mut at = LOG_HEADER_LEN;
        for _ in 0..groups {
            check_len("ANA group descriptor", &buf[at..], DESC_HEADER_LEN)?;
            let n = le32(buf, at + 4) as usize;
            AnaState::from_code(buf[at + 16])?;
            let len = n
                .checked_mul(4)
                .and_then(|l| l.checked_add(DESC_HEADER_LEN))
                .ok_or(NvmeWireError::Truncated {
                    what: "ANA group namespace list",
                    need: usize::MAX,
                    have: buf.len() - at,
                })?;
            check_len("ANA group namespace list", &buf[at..], len)?;
            at += len;
        }
        Ok(AnaLog {
            buf,
            chgcnt: le64(buf, 0),
            groups,
        })
    }

    pub fn group_count(&self) -> usize {
        self.groups
    }

    pub fn groups(&self) -> impl Iterator<Item = AnaGroup<'a>> + 'a {
        let buf = self.buf;
        let mut at = LOG_HEADER_LEN;
        (0..self.groups).map(move |_| {
            let n = le32(buf, at + 4) as usize;
            let g = AnaGroup {
                grpid: le32(buf, at),
                chgcnt: le64(buf, at + 8),
                // Checked in `new_checked`.
                state: AnaState::from_code(buf[at + 16]).unwrap_or(AnaState::Inaccessible),
                nsids: &buf[at + DESC_HEADER_LEN..at + DESC_HEADER_LEN + n * 4],
            };
            at += DESC_HEADER_LEN + n * 4;
            g
        })
    }

    /// The state of group `grpid`, if the page lists it.
    pub fn state_of(&self, grpid: u32) -> Option<AnaState> {
        self.groups().find(|g| g.grpid == grpid).map(|g| g.state)
    }
}

/// One group to write into a log page.
#[derive(Debug, Clone, Copy)]
pub struct GroupDesc<'a> {
    pub grpid: u32,
    pub chgcnt: u64,
    pub state: AnaState,
    pub nsids: &'a [u32],
}

/// Bytes a log page with `groups` takes (namespace lists included unless `groups_only`).
pub fn log_len(groups: &[GroupDesc<'_>], groups_only: bool) -> usize {
    LOG_HEADER_LEN
        + groups
            .iter()
            .map(|g| DESC_HEADER_LEN + if groups_only { 0 } else { g.nsids.len() * 4 })
            .sum::<usize>()
}

/// Write an ANA log page into `out`; returns the bytes used. Fails if `out` is too small or
/// a count does not fit its field.
pub fn emit_log(
    chgcnt: u64,
    groups: &[GroupDesc<'_>],
    groups_only: bool,
    out: &mut [u8],
) -> Result<usize, NvmeWireError> {
    let ngrps = u16::try_from(groups.len()).map_err(|_| NvmeWireError::OutOfRange {
        what: "ANA groups",
        value: groups.len() as u64,
        min: 0,
        max: u64::from(u16::MAX),
    })?;
    let need = log_len(groups, groups_only);
    if out.len() < need {
        return Err(NvmeWireError::Truncated {
            what: "ANA log page buffer",
            need,
            have: out.len(),
        });
    }
    out[..need].fill(0);
    put64(out, 0, chgcnt);
    put16(out, 8, ngrps);
    let mut at = LOG_HEADER_LEN;
    for g in groups {
        let n = if groups_only { 0 } else { g.nsids.len() };
        put32(out, at, g.grpid);
        put32(out, at + 4, n as u32);
        put64(out, at + 8, g.chgcnt);
        out[at + 16] = g.state.code();
        at += DESC_HEADER_LEN;
        for &nsid in &g.nsids[..n] {
            put32(out, at, nsid);
            at += 4;
        }
    }
    Ok(need)
}

/// Get Log Page for the ANA log, `len` bytes from offset 0.
pub fn get_ana_log(cid: u16, len: usize, groups_only: bool) -> Result<Sqe, NvmeWireError> {
    let mut s = crate::nvme::admin::get_log_page(cid, 0, LID_ANA, 0, len as u64)?;
    if groups_only {
        // LSP is CDW10 bits 14:8.
        s.cdw10 |= u32::from(LSP_GROUPS_ONLY) << 8;
    }
    Ok(s)
}

/// Does an Asynchronous Event Request completion (DW0) report an ANA change?
pub fn aen_reports_ana_change(dw0: u32) -> bool {
    (dw0 & 0x7) as u8 == crate::nvme::ccr::AEN_TYPE_NOTICE
        && ((dw0 >> 8) as u8 == AEN_INFO_ANA_CHANGE || (dw0 >> 16) as u8 == LID_ANA)
}

/// DW0 of the Asynchronous Event Request completion that reports an ANA change.
pub fn ana_change_aen_dw0() -> u32 {
    u32::from(crate::nvme::ccr::AEN_TYPE_NOTICE)
        | u32::from(AEN_INFO_ANA_CHANGE) << 8
        | u32::from(LID_ANA) << 16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_log_page_round_trips_with_and_without_namespace_lists() {
        let groups = [
            GroupDesc {
                grpid: 1,
                chgcnt: 7,
                state: AnaState::Optimized,
                nsids: &[1, 2],
            },
            GroupDesc {
                grpid: 2,
                chgcnt: 9,
                state: AnaState::Inaccessible,
                nsids: &[3],
            },
        ];
        let mut buf = [0u8; 256];
        let n = emit_log(42, &groups, false, &mut buf).unwrap();
        assert_eq!(n, 16 + 32 + 8 + 32 + 4);
        let log = AnaLog::new_checked(&buf[..n]).unwrap();
        assert_eq!(log.chgcnt, 42);
        assert_eq!(log.group_count(), 2);
        let got: Vec<_> = log
            .groups()
            .map(|g| (g.grpid, g.chgcnt, g.state, g.nsids().collect::<Vec<_>>()))
            .collect();
        assert_eq!(
            got,
            vec![
                (1, 7, AnaState::Optimized, vec![1, 2]),
                (2, 9, AnaState::Inaccessible, vec![3])
            ]
        );
        let n = emit_log(42, &groups, true, &mut buf).unwrap();
        let log = AnaLog::new_checked(&buf[..n]).unwrap();
        assert!(log.groups().all(|g| g.nsid_count() == 0));
        assert_eq!(log.state_of(2), Some(AnaState::Inaccessible));
        assert_eq!(log.state_of(3), None);
    }

    #[test]
    fn a_page_that_lies_about_its_lengths_or_states_is_refused() {
        let groups = [GroupDesc {
            grpid: 1,
            chgcnt: 0,
            state: AnaState::NonOptimized,
            nsids: &[1, 2, 3],
        }];
        let mut buf = [0u8; 128];
        let n = emit_log(1, &groups, false, &mut buf).unwrap();
        assert!(AnaLog::new_checked(&buf[..n - 1]).is_err(), "short list");
        let mut many = buf;
        many[8] = 2;
        assert!(
            AnaLog::new_checked(&many[..n]).is_err(),
            "NGRPS past the end"
        );
        let mut huge = buf;
        huge[16 + 4..16 + 8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(
            AnaLog::new_checked(&huge[..n]).is_err(),
            "NNSIDS past the end"
        );
        let mut bad = buf;
        bad[16 + 16] = 0x5;
        assert!(AnaLog::new_checked(&bad[..n]).is_err(), "reserved state");
    }

    #[test]
    fn identify_fields_round_trip_and_a_short_page_is_refused() {
        let c = CtrlAna {
            cmic: id_ctrl::CMIC_ANA | id_ctrl::CMIC_MULTI_PORT,
            oaes: id_ctrl::OAES_ANA_CHANGE,
            anatt: 10,
            anacap: id_ctrl::ANACAP_ALL_STATES,
            anagrpmax: 128,
            nanagrpid: 128,
            mnan: 1024,
        };
        let mut page = [0u8; 4096];
        c.emit(&mut page);
        assert_eq!(page[76], c.cmic);
        assert_eq!(page[342], 10);
        assert_eq!(&page[348..352], &128u32.to_le_bytes());
        assert_eq!(&page[540..544], &1024u32.to_le_bytes());
        assert_eq!(CtrlAna::parse(&page).unwrap(), c);
        assert!(CtrlAna::parse(&page[..543]).is_err());
        let n = NsAna {
            nmic: id_ns::NMIC_SHARED,
            anagrpid: 7,
        };
        let mut page = [0u8; 4096];
        n.emit(&mut page);
        assert_eq!(&page[92..96], &7u32.to_le_bytes());
        assert_eq!(NsAna::parse(&page).unwrap(), n);
        assert!(NsAna::parse(&page[..95]).is_err());
    }

    #[test]
    fn the_change_notice_is_recognised() {
        assert!(aen_reports_ana_change(ana_change_aen_dw0()));
        assert!(!aen_reports_ana_change(crate::nvme::ccr::ccr_aen_dw0()));
        for st in [
            "optimized",
            "non-optimized",
            "inaccessible",
            "persistent-loss",
            "change",
        ] {
            assert_eq!(st.parse::<AnaState>().unwrap().name(), st);
        }
        assert!("fast".parse::<AnaState>().is_err());
    }
}

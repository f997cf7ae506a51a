//! The completion status field (NVMe Base "Status Field" and the Status Code Type tables):
//! decoding, human messages, and the values a target puts in its completions.
//!
//! Bit layout of the 16-bit word at CQE bytes 14..16 (Linux `NVME_SC_*` values are bits 15:1
//! shifted down by one, with `NVME_SC_CRD` 0x1800, `NVME_SC_MORE` 0x2000, `NVME_SC_DNR`
//! 0x4000): P bit 0, SC bits 8:1, SCT bits 11:9, CRD bits 13:12, M bit 14, DNR bit 15.
//! Code values: Linux `include/linux/nvme.h` (`NVME_SC_*`), SPDK `nvme_spec.h` /
//! `nvmf_spec.h` (`SPDK_NVMF_FABRIC_SC_*`).

use std::fmt;

use super::admin::opcode;

const SC_SHIFT: u16 = 1;
const SCT_SHIFT: u16 = 9;
const CRD_SHIFT: u16 = 12;
const MORE: u16 = 1 << 14;
const DNR: u16 = 1 << 15;

/// Status Code Type (SCT).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StatusType {
    Generic,
    CommandSpecific,
    MediaError,
    Path,
    VendorSpecific,
    Reserved(u8),
}

impl StatusType {
    pub fn from_sct(sct: u8) -> StatusType {
        match sct {
            0 => StatusType::Generic,
            1 => StatusType::CommandSpecific,
            2 => StatusType::MediaError,
            3 => StatusType::Path,
            7 => StatusType::VendorSpecific,
            n => StatusType::Reserved(n),
        }
    }

    fn noun(self) -> &'static str {
        match self {
            StatusType::Generic => "generic",
            StatusType::CommandSpecific => "command-specific",
            StatusType::MediaError => "media error",
            StatusType::Path => "path-related",
            StatusType::VendorSpecific => "vendor-specific",
            StatusType::Reserved(_) => "reserved-type",
        }
    }
}

/// A decoded status field, without the phase tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Status {
    /// Status Code Type, 3 bits.
    pub sct: u8,
    /// Status Code.
    pub sc: u8,
    /// More: the Error Information log page has more about this command.
    pub more: bool,
    /// Do Not Retry: the same command will fail again.
    pub dnr: bool,
    /// Command Retry Delay: which of CRDT1..3 (Identify Controller) to wait before
    /// retrying; 0 = retry at once. 2 bits.
    pub crd: u8,
}

impl Status {
    pub const fn new(sct: u8, sc: u8) -> Status {
        Status {
            sct,
            sc,
            more: false,
            dnr: false,
            crd: 0,
        }
    }
    const fn generic(sc: u8) -> Status {
        Status::new(0, sc)
    }
    const fn specific(sc: u8) -> Status {
        Status::new(1, sc)
    }

    /// The same status with Do Not Retry set.
    pub const fn with_dnr(mut self) -> Status {
        self.dnr = true;
        self
    }

    /// Decode the CQE status word; the phase tag (bit 0) is ignored. Never fails.
    pub const fn from_word(w: u16) -> Status {
        Status {
            sct: ((w >> SCT_SHIFT) & 0x7) as u8,
            sc: ((w >> SC_SHIFT) & 0xFF) as u8,
            more: w & MORE != 0,
            dnr: w & DNR != 0,
            crd: ((w >> CRD_SHIFT) & 0x3) as u8,
        }
    }

    /// Encode with the given phase tag. SCT is masked to 3 bits and CRD to 2.
    pub const fn to_word(self, phase: bool) -> u16 {
        (self.sc as u16) << SC_SHIFT
            | ((self.sct as u16) & 0x7) << SCT_SHIFT
            | ((self.crd as u16) & 0x3) << CRD_SHIFT
            | if self.more { MORE } else { 0 }
            | if self.dnr { DNR } else { 0 }
            | phase as u16
    }

    pub const fn is_success(&self) -> bool {
        self.sct == 0 && self.sc == 0
    }

    pub fn kind(&self) -> StatusType {
        StatusType::from_sct(self.sct)
    }

    /// `Ok` on success, otherwise the error a person can read. `opcode` is the command's
    /// opcode: command-specific codes 0x80.. mean different things for Fabrics and NVM I/O.
    pub fn into_result(self, opcode: Option<u8>) -> Result<(), NvmeError> {
        if self.is_success() {
            Ok(())
        } else {
            Err(NvmeError {
                status: self,
                opcode,
            })
        }
    }

    /// What the status means. For command-specific codes 0x80..=0xBF the meaning depends on
    /// the command set: Fabrics commands (opcode 0x7F) read them as Connect / discovery
    /// errors, other commands as NVM command set errors; without an opcode both are named.
    pub fn message(&self, opcode: Option<u8>) -> &'static str {
        match self.kind() {
            StatusType::Generic => generic_message(self.sc),
            StatusType::CommandSpecific => match (self.sc, opcode) {
                (0x80..=0xBF, Some(opcode::FABRICS)) => fabrics_message(self.sc),
                (0x80..=0xBF, Some(_)) => nvm_message(self.sc),
                (0x80..=0xBF, None) => either_message(self.sc),
                (sc, _) => admin_specific_message(sc),
            },
            StatusType::MediaError => media_message(self.sc),
            StatusType::Path => path_message(self.sc),
            StatusType::VendorSpecific => "vendor-specific error",
            StatusType::Reserved(_) => "status with a reserved status code type",
        }
    }

    // Values a target produces. DNR is not included: set it with `with_dnr()` where a retry
    // of the same command cannot succeed (Linux nvmet sets it on invalid opcode/field/NS,
    // LBA range and Connect parameter errors).
    pub const SUCCESS: Status = Status::generic(0x00);
    pub const INVALID_OPCODE: Status = Status::generic(0x01);
    pub const INVALID_FIELD: Status = Status::generic(0x02);
    pub const COMMAND_ID_CONFLICT: Status = Status::generic(0x03);
    pub const DATA_TRANSFER_ERROR: Status = Status::generic(0x04);
    pub const ABORTED_POWER_LOSS: Status = Status::generic(0x05);
    pub const INTERNAL_ERROR: Status = Status::generic(0x06);
    pub const ABORT_REQUESTED: Status = Status::generic(0x07);
    pub const ABORTED_SQ_DELETION: Status = Status::generic(0x08);
    pub const INVALID_NAMESPACE_OR_FORMAT: Status = Status::generic(0x0B);
    pub const COMMAND_SEQUENCE_ERROR: Status = Status::generic(0x0C);
    pub const INVALID_SGL_SEGMENT_DESCRIPTOR: Status = Status::generic(0x0D);
    pub const INVALID_SGL_DESCRIPTOR_COUNT: Status = Status::generic(0x0E);
    pub const SGL_DATA_LENGTH_INVALID: Status = Status::generic(0x0F);
    pub const SGL_DESCRIPTOR_TYPE_INVALID: Status = Status::generic(0x11);
    pub const SGL_OFFSET_INVALID: Status = Status::generic(0x16);
    pub const HOST_ID_INCONSISTENT_FORMAT: Status = Status::generic(0x18);
    pub const KEEP_ALIVE_EXPIRED: Status = Status::generic(0x19);
    pub const KEEP_ALIVE_INVALID: Status = Status::generic(0x1A);
    pub const TRANSIENT_TRANSPORT_ERROR: Status = Status::generic(0x22);
    pub const LBA_OUT_OF_RANGE: Status = Status::generic(0x80);
    pub const CAPACITY_EXCEEDED: Status = Status::generic(0x81);
    pub const NAMESPACE_NOT_READY: Status = Status::generic(0x82);

    pub const INVALID_QUEUE_ID: Status = Status::specific(0x01);
    pub const INVALID_QUEUE_SIZE: Status = Status::specific(0x02);
    pub const ASYNC_EVENT_LIMIT_EXCEEDED: Status = Status::specific(0x05);
    pub const INVALID_LOG_PAGE: Status = Status::specific(0x09);
    pub const FEATURE_NOT_SAVEABLE: Status = Status::specific(0x0D);
    pub const FEATURE_NOT_CHANGEABLE: Status = Status::specific(0x0E);
    pub const CONFLICTING_ATTRIBUTES: Status = Status::specific(0x80);
    pub const WRITE_TO_READ_ONLY_RANGE: Status = Status::specific(0x82);
    pub const CONNECT_INCOMPATIBLE_FORMAT: Status = Status::specific(0x80);
    pub const CONNECT_CONTROLLER_BUSY: Status = Status::specific(0x81);
    pub const CONNECT_INVALID_PARAMETERS: Status = Status::specific(0x82);
    pub const CONNECT_RESTART_DISCOVERY: Status = Status::specific(0x83);
    pub const CONNECT_INVALID_HOST: Status = Status::specific(0x84);
    pub const DISCOVERY_RESTART: Status = Status::specific(0x90);
    pub const AUTH_REQUIRED: Status = Status::specific(0x91);

    pub const WRITE_FAULT: Status = Status::new(2, 0x80);
    pub const UNRECOVERED_READ_ERROR: Status = Status::new(2, 0x81);
    pub const ACCESS_DENIED: Status = Status::new(2, 0x86);

    pub const INTERNAL_PATH_ERROR: Status = Status::new(3, 0x00);
    pub const ANA_PERSISTENT_LOSS: Status = Status::new(3, 0x01);
    pub const ANA_INACCESSIBLE: Status = Status::new(3, 0x02);
    pub const ANA_TRANSITION: Status = Status::new(3, 0x03);
    pub const CONTROLLER_PATHING_ERROR: Status = Status::new(3, 0x60);
    /// What an initiator reports for I/O it fails itself because the path is gone (Linux
    /// `NVME_SC_HOST_PATH_ERROR`, used by `nvme_host_path_error`).
    pub const HOST_PATHING_ERROR: Status = Status::new(3, 0x70);
    pub const ABORTED_BY_HOST: Status = Status::new(3, 0x71);
}

fn generic_message(sc: u8) -> &'static str {
    match sc {
        0x00 => "successful completion",
        0x01 => "invalid command opcode",
        0x02 => "invalid field in command",
        0x03 => "command ID conflict",
        0x04 => "data transfer error",
        0x05 => "command aborted due to power loss notification",
        0x06 => "internal error",
        0x07 => "command abort requested",
        0x08 => "command aborted due to SQ deletion",
        0x09 => "command aborted due to failed fused command",
        0x0A => "command aborted due to missing fused command",
        0x0B => "invalid namespace or format",
        0x0C => "command sequence error",
        0x0D => "invalid SGL segment descriptor",
        0x0E => "invalid number of SGL descriptors",
        0x0F => "data SGL length invalid",
        0x10 => "metadata SGL length invalid",
        0x11 => "SGL descriptor type invalid",
        0x12 => "invalid use of controller memory buffer",
        0x13 => "PRP offset invalid",
        0x14 => "atomic write unit exceeded",
        0x15 => "operation denied",
        0x16 => "SGL offset invalid",
        0x18 => "host identifier inconsistent format",
        0x19 => "keep alive timer expired",
        0x1A => "keep alive timeout invalid",
        0x1B => "command aborted due to preempt and abort",
        0x1C => "sanitize failed",
        0x1D => "sanitize in progress",
        0x1E => "SGL data block granularity invalid",
        0x1F => "command not supported for queue in CMB",
        0x20 => "namespace is write protected",
        0x21 => "command interrupted",
        0x22 => "transient transport error",
        0x23 => "command prohibited by command and feature lockdown",
        0x24 => "admin command media not ready",
        0x80 => "LBA out of range",
        0x81 => "capacity exceeded",
        0x82 => "namespace not ready",
        0x83 => "reservation conflict",
        0x84 => "format in progress",
        _ => "unknown generic status",
    }
}

fn admin_specific_message(sc: u8) -> &'static str {
    match sc {
        0x00 => "completion queue invalid",
        0x01 => "invalid queue identifier",
        0x02 => "invalid queue size",
        0x03 => "abort command limit exceeded",
        0x05 => "asynchronous event request limit exceeded",
        0x06 => "invalid firmware slot",
        0x07 => "invalid firmware image",
        0x08 => "invalid interrupt vector",
        0x09 => "invalid log page",
        0x0A => "invalid format",
        0x0B => "firmware activation requires conventional reset",
        0x0C => "invalid queue deletion",
        0x0D => "feature identifier not saveable",
        0x0E => "feature not changeable",
        0x0F => "feature not namespace specific",
        0x10 => "firmware activation requires NVM subsystem reset",
        0x11 => "firmware activation requires controller level reset",
        0x12 => "firmware activation requires maximum time violation",
        0x13 => "firmware activation prohibited",
        0x14 => "overlapping range",
        0x15 => "namespace insufficient capacity",
        0x16 => "namespace identifier unavailable",
        0x18 => "namespace already attached",
        0x19 => "namespace is private",
        0x1A => "namespace not attached",
        0x1B => "thin provisioning not supported",
        0x1C => "controller list invalid",
        0x1D => "device self-test in progress",
        0x1E => "boot partition write prohibited",
        0x1F => "invalid controller identifier",
        0x20 => "invalid secondary controller state",
        0x21 => "invalid number of controller resources",
        0x22 => "invalid resource identifier",
        0x23 => "sanitize prohibited while persistent memory region is enabled",
        0x24 => "ANA group identifier invalid",
        0x25 => "ANA attach failed",
        _ => "unknown command-specific status",
    }
}

/// NVM command set specific codes 0x80.. (Linux `NVME_SC_BAD_ATTRIBUTES` ..).
fn nvm_message(sc: u8) -> &'static str {
    match sc {
        0x80 => "conflicting attributes",
        0x81 => "invalid protection information",
        0x82 => "attempted write to read only range",
        0x83 => "command size limit exceeded",
        _ => "unknown I/O command set specific status",
    }
}

/// Fabrics command specific codes (Linux `NVME_SC_CONNECT_*`, SPDK
/// `SPDK_NVMF_FABRIC_SC_*`).
fn fabrics_message(sc: u8) -> &'static str {
    match sc {
        0x80 => "Connect: incompatible format",
        0x81 => "Connect: controller busy",
        0x82 => "Connect: invalid parameters",
        0x83 => "Connect: restart discovery",
        0x84 => "Connect: invalid host",
        0x85 => "invalid queue type",
        0x90 => "discovery restart",
        0x91 => "authentication required",
        _ => "unknown Fabrics command specific status",
    }
}

fn either_message(sc: u8) -> &'static str {
    match sc {
        0x80 => "conflicting attributes (NVM) or Connect: incompatible format (Fabrics)",
        0x81 => "invalid protection information (NVM) or Connect: controller busy (Fabrics)",
        0x82 => "write to read only range (NVM) or Connect: invalid parameters (Fabrics)",
        0x83 => "command size limit exceeded (NVM) or Connect: restart discovery (Fabrics)",
        0x84 => "Connect: invalid host (Fabrics)",
        0x90 => "discovery restart (Fabrics)",
        0x91 => "authentication required (Fabrics)",
        _ => "unknown I/O command set specific status",
    }
}

fn media_message(sc: u8) -> &'static str {
    match sc {
        0x80 => "write fault",
        0x81 => "unrecovered read error",
        0x82 => "end-to-end guard check error",
        0x83 => "end-to-end application tag check error",
        0x84 => "end-to-end reference tag check error",
        0x85 => "compare failure",
        0x86 => "access denied",
        0x87 => "deallocated or unwritten logical block",
        _ => "unknown media or data integrity error",
    }
}

fn path_message(sc: u8) -> &'static str {
    match sc {
        0x00 => "internal path error",
        0x01 => "asymmetric access persistent loss",
        0x02 => "asymmetric access inaccessible",
        0x03 => "asymmetric access transition",
        0x60 => "controller pathing error",
        0x70 => "host pathing error",
        0x71 => "command aborted by host",
        _ => "unknown path-related status",
    }
}

/// A command that completed with a non-success status, for callers that want a `Result`.
/// Transient or permanent is the status's own DNR bit: [`NvmeError::is_retryable`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub struct NvmeError {
    pub status: Status,
    /// The failed command's opcode, when known; it selects the meaning of
    /// command-specific codes.
    pub opcode: Option<u8>,
}

impl NvmeError {
    /// The controller did not set DNR: the same command may succeed if sent again (after
    /// the delay CRD names, on this or another path).
    pub fn is_retryable(&self) -> bool {
        !self.status.dnr
    }
}

impl fmt::Display for NvmeError {
    /// "LBA out of range (generic status 0x80, do not retry)".
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.status;
        write!(
            f,
            "{} ({} status {:#04x}",
            s.message(self.opcode),
            s.kind().noun(),
            s.sc
        )?;
        if let StatusType::Reserved(t) = s.kind() {
            write!(f, ", type {t}")?;
        }
        if s.dnr {
            f.write_str(", do not retry")?;
        } else if s.crd != 0 {
            write!(f, ", retry after delay CRDT{}", s.crd)?;
        } else {
            f.write_str(", may retry")?;
        }
        if s.more {
            f.write_str(", more in error log")?;
        }
        f.write_str(")")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deconstruct() {
        // DNR | M | CRD 2 | SCT 3 | SC 0x70 | P
        let w: u16 = 0x8000 | 0x4000 | (2 << 12) | (3 << 9) | (0x70 << 1) | 1;
        let s = Status::from_word(w);
        assert_eq!(
            s,
            Status {
                sct: 3,
                sc: 0x70,
                more: true,
                dnr: true,
                crd: 2
            }
        );
        assert_eq!(s.kind(), StatusType::Path);
        assert!(!s.is_success());
        assert!(
            Status::from_word(0x0001).is_success(),
            "phase alone is success"
        );
    }

    #[test]
    fn construct() {
        // Linux: NVME_SC_LBA_RANGE 0x80 | NVME_SC_DNR 0x4000, shifted left by one on the wire.
        assert_eq!(
            Status::LBA_OUT_OF_RANGE.with_dnr().to_word(false),
            (0x80 | 0x4000) << 1
        );
        // NVME_SC_CONNECT_INVALID_PARAM 0x182, NVME_SC_HOST_PATH_ERROR 0x370.
        assert_eq!(
            Status::CONNECT_INVALID_PARAMETERS.to_word(false),
            0x182 << 1
        );
        assert_eq!(Status::HOST_PATHING_ERROR.to_word(true), (0x370 << 1) | 1);
        assert_eq!(Status::SUCCESS.to_word(false), 0);
    }

    #[test]
    fn round_trip() {
        for w in 0..=u16::MAX {
            let s = Status::from_word(w);
            assert_eq!(s.to_word(w & 1 != 0), w);
        }
    }

    #[test]
    fn messages() {
        let e = Status::LBA_OUT_OF_RANGE
            .with_dnr()
            .into_result(Some(0x02))
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "LBA out of range (generic status 0x80, do not retry)"
        );
        assert!(!e.is_retryable());
        let e = NvmeError {
            status: Status::CONNECT_INVALID_HOST,
            opcode: Some(opcode::FABRICS),
        };
        assert_eq!(
            e.to_string(),
            "Connect: invalid host (command-specific status 0x84, may retry)"
        );
        let e = NvmeError {
            status: Status::CONNECT_INVALID_PARAMETERS,
            opcode: Some(opcode::io::WRITE),
        };
        assert!(e
            .to_string()
            .starts_with("attempted write to read only range"));
        let mut s = Status::ANA_TRANSITION;
        s.crd = 1;
        assert_eq!(
            s.into_result(None).unwrap_err().to_string(),
            "asymmetric access transition (path-related status 0x03, retry after delay CRDT1)"
        );
        assert_eq!(Status::new(2, 0x81).message(None), "unrecovered read error");
        assert_eq!(Status::new(1, 0x82).message(None), either_message(0x82));
        assert!(Status::SUCCESS.into_result(None).is_ok());
        // Every code of every type has some message and formats without panicking.
        for w in (0..=u16::MAX).step_by(2) {
            let s = Status::from_word(w);
            for op in [None, Some(0x7F), Some(0x01)] {
                assert!(!s.message(op).is_empty());
                let _ = NvmeError {
                    status: s,
                    opcode: op,
                }
                .to_string();
            }
        }
    }
}

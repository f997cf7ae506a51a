//! Hardware verbs backend (cargo feature `hw`): the seam's vocabulary ([`crate::verbs`]:
//! [`Access`](crate::verbs::Access), [`Sge`](crate::verbs::Sge),
//! [`SendOp`](crate::verbs::SendOp), [`WorkCompletion`](crate::verbs::WorkCompletion),
//! [`AsyncEvent`](crate::verbs::AsyncEvent), ...) served by a kernel RDMA device through
//! libibverbs/librdmacm.
//!
//! Layers:
//! - the device behind the backend seam ([`crate::verbs`]), split as the soft-HCA's driver
//!   is: [`context`] (a device context, [`context::HwContext`]), [`source`] (a source that
//!   finds the device again after it is removed and re-added, [`source::HwSource`]),
//!   [`cm_port`] (rdma_cm as the connection manager, [`cm_port::HwCm`]) and [`mem`] (host
//!   memory the device registers, [`mem::HwMem`]). The NVMe-oF host and its one recovery
//!   path run on it unchanged. [`reset`]: a reset inflicted by hand, for chaos and tests.
//! - [`device`]: enumeration (name, node GUID, PCI address from sysfs), selection by GUID / PCI /
//!   name, and an opened device ([`device::HwDevice`]: context, PD, MRs, CQs with completion
//!   channels, RC QPs) built on the `sideway` crate.
//! - [`events`]: the device's async events (DEVICE_FATAL, PORT_ERR, QP_FATAL, ...) as a tokio
//!   stream over the context's `async_fd` (`AsyncFd`).
//! - [`cm`]: rdma_cm over our own FFI calls (through `rdma-mummy-sys`, the loader crate
//!   sideway uses), because sideway 0.4.3 can neither put private data into `rdma_conn_param`
//!   nor read it from an event, and NVMe-oF needs both (request: qid/hrqsize/hsqsize; accept:
//!   crqsize; reject: NVMe status).
//! - [`wr`]: work requests and completions translated both ways.
//! - [`map`]: pure conversions between ibverbs values and our types (unit-tested without a device).
//! - [`cli`]: `nvmf-rdma hw list|events` (device diagnostics).

pub mod backend;
pub mod cli;
pub mod cm;
pub mod cm_port;
pub mod context;
pub mod device;
pub mod events;
pub mod map;
pub mod mem;
pub mod reset;
pub mod source;
pub mod wr;

use std::io;

use crate::cm::private::NvmeRejectStatus;
use crate::nvme::status::Status;
use crate::nvme::NvmeWireError;
use crate::verbs::{WcOpcode, WcStatus};

/// Errors of the hardware backend.
#[derive(Debug, thiserror::Error)]
pub enum HwError {
    #[error("libibverbs could not list RDMA devices: {0}")]
    NoVerbs(io::Error),
    #[error("no RDMA device matches {0}")]
    NoSuchDevice(String),
    #[error("{call} failed: {source}")]
    Verbs {
        call: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("{call} failed: {msg}")]
    Sideway { call: &'static str, msg: String },
    #[error("rdma_cm: expected {expected}, got {got} (status {status})")]
    CmUnexpected {
        expected: &'static str,
        got: &'static str,
        status: i32,
    },
    #[error("rdma_cm: connect rejected (status {status}){}", nvme.map(|s| format!(": NVMe-oF {}", s.message())).unwrap_or_default())]
    Rejected {
        status: i32,
        nvme: Option<NvmeRejectStatus>,
    },
    #[error("connection lost: rdma_cm reported {event}{}", if *device_removed { " (the RDMA device was removed)" } else { "" })]
    ConnectionLost {
        event: &'static str,
        device_removed: bool,
    },
    #[error("fatal device async event: {0:?}")]
    DeviceEvent(map::HwEvent),
    #[error("rdma_cm: {0} timed out")]
    CmTimeout(&'static str),
    #[error("rdma_cm bound the address to device {got}, not the selected {want}")]
    WrongDevice { want: String, got: String },
    #[error("malformed private data: {0}")]
    PrivateData(String),
    #[error("work completion {status:?} ({}) for {opcode:?} wr_id {wr_id:#x} (vendor error {vendor_err:#x})", status.as_str())]
    Completion {
        status: WcStatus,
        opcode: Option<WcOpcode>,
        wr_id: u64,
        vendor_err: u32,
    },
    #[error("malformed NVMe completion: {0}")]
    Wire(#[from] NvmeWireError),
    #[error("completion for cid {0} that is not outstanding")]
    StrayCompletion(u16),
    #[error("NVMe command {what} failed: {status:?}")]
    Nvme { what: &'static str, status: Status },
    #[error("{0} timed out")]
    Timeout(&'static str),
    #[error("controller reports fatal status (CSTS.CFS)")]
    ControllerFatal,
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error(
        "data mismatch at byte {offset} (LBA {lba}): expected {expected:#04x}, read {got:#04x}"
    )]
    Mismatch {
        offset: u64,
        lba: u64,
        expected: u8,
        got: u8,
    },
    #[error("I/O error: {0}")]
    Io(#[from] io::Error),
}

impl HwError {
    pub(crate) fn verbs(call: &'static str) -> HwError {
        HwError::Verbs {
            call,
            source: io::Error::last_os_error(),
        }
    }
    pub(crate) fn errno(call: &'static str, ret: i32) -> HwError {
        HwError::Verbs {
            call,
            source: io::Error::from_raw_os_error(ret.abs()),
        }
    }
    pub(crate) fn sideway(call: &'static str, e: impl std::fmt::Display) -> HwError {
        HwError::Sideway {
            call,
            msg: e.to_string(),
        }
    }
}

/// A raw fd that tokio's `AsyncFd` may watch but must not close (its owner is libibverbs or
/// librdmacm).
#[derive(Debug, Clone, Copy)]
pub(crate) struct BorrowedRawFd(pub std::os::fd::RawFd);

impl std::os::fd::AsRawFd for BorrowedRawFd {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.0
    }
}

/// Register `fd` (read interest) with tokio.
///
/// # Safety
/// `fd` must stay open until the returned `AsyncFd` is dropped; owners drop it first.
pub(crate) unsafe fn watch(
    fd: std::os::fd::RawFd,
) -> io::Result<tokio::io::unix::AsyncFd<BorrowedRawFd>> {
    // SAFETY: upheld by the caller.
    unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(
            BorrowedRawFd(fd),
            tokio::io::Interest::READABLE,
        )
    }
    .map_err(|e| e.into_parts().1)
}

pub(crate) fn set_nonblocking(fd: std::os::fd::RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor we were handed; failures come back as -1.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags < 0 {
            return Err(io::Error::last_os_error());
        }
        if libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

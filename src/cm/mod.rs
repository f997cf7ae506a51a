//! InfiniBand Communication Management (IBA vol. 1 ch. 12) as rdma_cm speaks it over RoCEv2,
//! as sans-I/O code: no sockets, no clock, no async.
//!
//! - [`mad`]: the 256-byte MAD with its 24-byte common header and the connected-mode CM
//!   messages (REQ, MRA, REJ, REP, RTU, DREQ, DREP) as checked views and `Repr` types.
//! - [`private`]: what rides in the private data: the rdma_cm IP header (`struct cma_hdr`) at
//!   the start of a REQ, the NVMe-oF RDMA connect request / accept / reject records, and the
//!   RDMA_PS_TCP service IDs.
//! - [`CmEndpoint`]: one per device; the active and passive connection state machines keyed
//!   by local communication ID, driven quinn-style by `handle_mad` / `handle_timeout` and
//!   the `connect` / `accept` / `reject` / `disconnect` commands, drained with
//!   `poll_transmit` / `poll_timeout` / `poll_event`.
//! - [`state`]: the transition table those machines follow, written once as data.
//!
//! A CM MAD travels to QP1 as the payload of a UD SEND (BTH + DETH, Q_Key 0x80010000); that
//! wrapping belongs to the HCA and the driver. This module sees only the 256 MAD bytes and
//! the peer's address (anchors §7.5).

mod api;
mod conn;
pub mod mad;
pub mod messages;
pub mod private;
pub mod state;

pub use api::{
    iba_time, AcceptParams, CmConfig, CmError, CmEvent, CmStats, ConnId, ConnectParams,
    ConnectRequest, Established, Rejected, MAX_MRA_TIMEOUT_EXP, MAX_PEER_TIMEOUT_EXP,
    MAX_TIMEWAIT_EXP,
};
pub use conn::CmEndpoint;
pub use mad::{MadError, RejectReason, MAD_LEN};
pub use messages::{CmMad, CmMessage};
pub use private::{
    service_id, CmaHdrRepr, NvmeCmAccept, NvmeCmReject, NvmeCmRequest, NvmeRejectStatus,
    PrivateError,
};
pub use state::ConnState;

// Big-endian field access for the MAD (IBA fields are network order). Callers index only
// inside buffers whose length a `new_checked` or a fixed-size array type already guarantees.
#[inline]
fn rd16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}
#[inline]
fn rd24(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([0, b[at], b[at + 1], b[at + 2]])
}
#[inline]
fn rd32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
#[inline]
fn rd64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(a)
}
#[inline]
fn wr16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_be_bytes());
}
#[inline]
fn wr24(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 3].copy_from_slice(&v.to_be_bytes()[1..]);
}
#[inline]
fn wr32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_be_bytes());
}
#[inline]
fn wr64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_be_bytes());
}

/// Copy `src` into the front of `dst`, zero the rest. `src` longer than `dst` is cut; the
/// commands check lengths first and report [`CmError::PrivateDataTooLong`].
fn fill_private(dst: &mut [u8], src: &[u8]) {
    let n = src.len().min(dst.len());
    dst[..n].copy_from_slice(&src[..n]);
    dst[n..].fill(0);
}

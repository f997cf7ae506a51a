//! The soft-HCA: a software RDMA device speaking RoCEv2, as a sans-I/O core (`device`, `qp`,
//! `mr`, `cq`, `wire`) that the tokio driver and the simulator both drive.

pub mod copy;
pub mod cq;
pub mod device;
pub mod mr;
pub mod qp;
pub mod rc;
pub mod registry;
pub mod sim;
pub mod wire;

pub use device::{Device, DeviceConfig, DeviceIdentity, IcrcCheck};
pub use mr::HostMem;
pub use qp::{AttrMask, QpAttr, QpState, MAX_IN_MEMORY_SEG};
pub use registry::{DeviceInfo, DeviceList, RegistryError};

/// Counters of one context. The driver publishes them through `metrics`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    pub tx_packets: u64,
    pub tx_bytes: u64,
    pub rx_packets: u64,
    pub rx_bytes: u64,
    pub rx_malformed: u64,
    pub rx_icrc_errors: u64,
    /// Packets whose ICRC was checked and right.
    pub rx_icrc_verified: u64,
    /// Packets accepted without an ICRC check (`IcrcCheck::Skip`, or an IPv4 peer's
    /// packet whose IP header the driver could not read).
    pub rx_icrc_unchecked: u64,
    /// Packets from a context of this process by the loopback path (in memory, never on a
    /// wire; their ICRC is not checked).
    pub rx_loopback: u64,
    /// Packets for this context the loopback path dropped because its inbox was full (on
    /// UDP the kernel counts the same thing as receive-buffer errors). Set by the driver.
    pub rx_loopback_full: u64,
    pub rx_unknown_qp: u64,
    pub rx_dropped: u64,
    /// Packets for a connected QP from an address other than its peer's (dropped).
    pub rx_foreign_source: u64,
    pub rx_ghost: u64,
    pub rx_duplicates: u64,
    /// Duplicate RDMA READ requests dropped: not part of a READ we still remember, or over
    /// `max_dest_rd_atomic` queued.
    pub dup_reads_dropped: u64,
    /// Go-back-N rewinds, whatever triggered them.
    pub retransmits: u64,
    /// IBA local ACK timeouts: expiries of the retransmit timer that each spend one of the
    /// QP's `retry_cnt` retries.
    pub timeouts: u64,
    /// Expiries of the adaptive retransmit timer before the local ACK timeout: a resend that
    /// spends no retry.
    pub rto_timeouts: u64,
    /// Resends at once on the peer's word (a sequence NAK, or READ responses showing earlier
    /// ones were lost), once per loss.
    pub fast_retransmits: u64,
    /// Tail-loss probes: the last packet resent with AckReq after ~2 RTT without an ACK.
    pub tail_probes: u64,
    /// The retransmit timeout last armed on any QP of the context, in ns (a gauge).
    pub rto_ns: u64,
    pub acks_tx: u64,
    pub seq_naks_tx: u64,
    pub seq_naks_rx: u64,
    pub rnr_naks_tx: u64,
    pub rnr_naks_rx: u64,
    pub naks_tx: u64,
    pub naks_rx: u64,
    pub access_errors: u64,
    pub flushed: u64,
    pub cq_overflows: u64,
    pub gsi_overflows: u64,
}

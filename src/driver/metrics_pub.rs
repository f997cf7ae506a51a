//! The soft-HCA's counters as metrics ([`crate::published`]).
//!
//! Besides traffic, the counters an operator watches for abuse: received packets dropped,
//! in total and by reason (malformed, bad ICRC, unknown QP, from a source that is not the
//! QP's peer, for a QP that is gone, other), remote access errors (a peer touching memory it
//! may not), and completion / MAD queue overflows. ICRCs: packets verified
//! (`softhca_rx_icrc_verified_total`), accepted unchecked (`softhca_rx_icrc_unchecked_total`:
//! `IcrcCheck::Skip`, or an IPv4 RoCEv2 peer without the raw socket), and mismatches, which
//! are drops (`softhca_rx_dropped_by_reason_total{reason="icrc"}`).

use crate::hca::Stats;
use crate::published::{Published, Publisher};

const COUNTERS: &[Published<Stats>] = &[
    ("softhca_tx_packets_total", None, |s| s.tx_packets),
    ("softhca_rx_packets_total", None, |s| s.rx_packets),
    ("softhca_tx_bytes_total", None, |s| s.tx_bytes),
    ("softhca_rx_bytes_total", None, |s| s.rx_bytes),
    ("softhca_rx_dropped_total", None, dropped),
    (
        "softhca_rx_dropped_by_reason_total",
        Some("malformed"),
        |s| s.rx_malformed,
    ),
    ("softhca_rx_dropped_by_reason_total", Some("icrc"), |s| {
        s.rx_icrc_errors
    }),
    (
        "softhca_rx_dropped_by_reason_total",
        Some("unknown_qp"),
        |s| s.rx_unknown_qp,
    ),
    (
        "softhca_rx_dropped_by_reason_total",
        Some("foreign_source"),
        |s| s.rx_foreign_source,
    ),
    ("softhca_rx_dropped_by_reason_total", Some("ghost"), |s| {
        s.rx_ghost
    }),
    (
        "softhca_rx_dropped_by_reason_total",
        Some("dup_read"),
        |s| s.dup_reads_dropped,
    ),
    ("softhca_rx_dropped_by_reason_total", Some("other"), |s| {
        s.rx_dropped
    }),
    ("softhca_rx_icrc_verified_total", None, |s| {
        s.rx_icrc_verified
    }),
    ("softhca_rx_icrc_unchecked_total", None, |s| {
        s.rx_icrc_unchecked
    }),
    ("softhca_retransmits_total", None, |s| s.retransmits),
    ("softhca_naks_sent_total", None, |s| {
        s.seq_naks_tx + s.rnr_naks_tx + s.naks_tx
    }),
    ("softhca_naks_received_total", None, |s| {
        s.seq_naks_rx + s.rnr_naks_rx + s.naks_rx
    }),
    ("softhca_flushed_total", None, |s| s.flushed),
    ("softhca_timeouts_total", None, |s| s.timeouts),
    ("softhca_rx_foreign_source_total", None, |s| {
        s.rx_foreign_source
    }),
    ("softhca_access_errors_total", None, |s| s.access_errors),
    ("softhca_cq_overflows_total", None, |s| s.cq_overflows),
    ("softhca_gsi_overflows_total", None, |s| s.gsi_overflows),
];

fn dropped(s: &Stats) -> u64 {
    s.rx_malformed
        + s.rx_icrc_errors
        + s.rx_unknown_qp
        + s.rx_dropped
        + s.rx_ghost
        + s.rx_foreign_source
        + s.dup_reads_dropped
}

/// The publisher of device `device`'s counters.
pub fn publisher(device: &str) -> Publisher<Stats> {
    Publisher::new(COUNTERS, "device", device)
}

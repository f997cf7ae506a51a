//! The soft-HCA's counters as metrics ([`crate::published`]).
//!
//! Besides traffic, the counters an operator watches for abuse: received packets dropped,
//! in total and by reason (malformed, bad ICRC, unknown QP, from a source that is not the
//! QP's peer, for a QP that is gone, the loopback path's inbox full, other), remote access
//! errors (a peer touching memory it may not), and completion / MAD queue overflows. ICRCs: packets verified
//! (`softhca_rx_icrc_verified_total`), accepted unchecked (`softhca_rx_icrc_unchecked_total`:
//! `IcrcCheck::Skip`, an IPv4 RoCEv2 peer without the raw socket, or a datagram from a
//! loopback address, which crossed no wire), and mismatches, which
//! are drops (`softhca_rx_dropped_by_reason_total{reason="icrc"}`). Packets from a context
//! of the same process by the loopback path (`driver::local`) are counted apart
//! (`softhca_rx_loopback_total`): they never crossed a wire and are not checked.
//!
//! Loss recovery: resends in total (`softhca_retransmits_total`) and by what triggered them:
//! local ACK timeouts that spend a retry (`softhca_timeouts_total`), earlier expiries of the
//! adaptive timer (`softhca_rto_timeouts_total`), fast retransmits on a sequence NAK
//! (`softhca_fast_retransmits_total`), tail-loss probes (`softhca_tail_probes_total`); and
//! the retransmit timeout last armed (`softhca_rto_seconds`, a gauge).

use metrics::{gauge, Gauge};

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
    (
        "softhca_rx_dropped_by_reason_total",
        Some("loopback_full"),
        |s| s.rx_loopback_full,
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
    ("softhca_rx_loopback_total", None, |s| s.rx_loopback),
    ("softhca_retransmits_total", None, |s| s.retransmits),
    ("softhca_naks_sent_total", None, |s| {
        s.seq_naks_tx + s.rnr_naks_tx + s.naks_tx
    }),
    ("softhca_naks_received_total", None, |s| {
        s.seq_naks_rx + s.rnr_naks_rx + s.naks_rx
    }),
    ("softhca_flushed_total", None, |s| s.flushed),
    ("softhca_timeouts_total", None, |s| s.timeouts),
    ("softhca_rto_timeouts_total", None, |s| s.rto_timeouts),
    ("softhca_fast_retransmits_total", None, |s| {
        s.fast_retransmits
    }),
    ("softhca_tail_probes_total", None, |s| s.tail_probes),
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
        + s.rx_loopback_full
}

/// A device's counters, and the retransmit timeout last armed as a gauge.
pub struct DevicePublisher {
    counters: Publisher<Stats>,
    /// `Stats::rto_ns`, in seconds.
    rto: Gauge,
    last_rto: u64,
}

/// The publisher of device `device`'s counters.
pub fn publisher(device: &str) -> DevicePublisher {
    DevicePublisher {
        counters: Publisher::new(COUNTERS, "device", device),
        rto: gauge!("softhca_rto_seconds", "device" => device.to_string()),
        last_rto: 0,
    }
}

impl DevicePublisher {
    pub fn publish(&mut self, s: &Stats) {
        self.counters.publish(s);
        if s.rto_ns != self.last_rto {
            self.rto.set(s.rto_ns as f64 * 1e-9);
            self.last_rto = s.rto_ns;
        }
    }
}

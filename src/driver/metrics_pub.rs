//! Publish a device's counters through the `metrics` facade as deltas since the last call,
//! so the core stays free of any metrics dependency.
//!
//! Besides traffic, the counters an operator watches for abuse: received packets dropped,
//! in total and by reason (malformed, bad ICRC, unknown QP, from a source that is not the
//! QP's peer, for a QP that is gone, other), remote access errors (a peer touching memory it
//! may not), and completion / MAD queue overflows. ICRCs: packets verified
//! (`softhca_rx_icrc_verified_total`), accepted unchecked (`softhca_rx_icrc_unchecked_total`:
//! `IcrcCheck::Skip`, or an IPv4 RoCEv2 peer without the raw socket), and mismatches, which
//! are drops (`softhca_rx_dropped_by_reason_total{reason="icrc"}`).
//!
//! Loss recovery: resends in total (`softhca_retransmits_total`) and by what triggered them:
//! local ACK timeouts that spend a retry (`softhca_timeouts_total`), earlier expiries of the
//! adaptive timer (`softhca_rto_timeouts_total`), fast retransmits on a sequence NAK
//! (`softhca_fast_retransmits_total`), tail-loss probes (`softhca_tail_probes_total`); and
//! the retransmit timeout last armed (`softhca_rto_seconds`, a gauge).

use metrics::{counter, gauge, Counter, Gauge};

use crate::hca::Stats;

/// One published counter: its name, a `reason` label where it has one, and how it is read
/// from the device's stats.
type Published = (&'static str, Option<&'static str>, fn(&Stats) -> u64);

const COUNTERS: &[Published] = &[
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
}

pub struct Publisher {
    last: Stats,
    c: Vec<Counter>,
    /// The retransmit timeout last armed (`Stats::rto_ns`), in seconds.
    rto: Gauge,
}

impl Publisher {
    pub fn new(device: &str) -> Publisher {
        let c = COUNTERS
            .iter()
            .map(|(name, reason, _)| match reason {
                Some(r) => counter!(*name, "device" => device.to_string(), "reason" => *r),
                None => counter!(*name, "device" => device.to_string()),
            })
            .collect();
        Publisher {
            last: Stats::default(),
            c,
            rto: gauge!("softhca_rto_seconds", "device" => device.to_string()),
        }
    }

    pub fn publish(&mut self, s: &Stats) {
        if *s == self.last {
            return;
        }
        for (c, (_, _, read)) in self.c.iter().zip(COUNTERS) {
            let d = read(s).saturating_sub(read(&self.last));
            if d > 0 {
                c.increment(d);
            }
        }
        if s.rto_ns != self.last.rto_ns {
            self.rto.set(s.rto_ns as f64 * 1e-9);
        }
        self.last = s.clone();
    }
}

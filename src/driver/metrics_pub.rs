//! Publish a device's counters through the `metrics` facade as deltas since the last call,
//! so the core stays free of any metrics dependency.

use metrics::{counter, Counter};

use crate::hca::Stats;

pub struct Publisher {
    last: Stats,
    c: [Counter; 11],
}

impl Publisher {
    pub fn new(device: &str) -> Publisher {
        let d = device.to_string();
        let mk = |name: &'static str| counter!(name, "device" => d.clone());
        Publisher {
            last: Stats::default(),
            c: [
                mk("softhca_tx_packets_total"),
                mk("softhca_rx_packets_total"),
                mk("softhca_tx_bytes_total"),
                mk("softhca_rx_bytes_total"),
                mk("softhca_rx_dropped_total"),
                mk("softhca_retransmits_total"),
                mk("softhca_naks_sent_total"),
                mk("softhca_naks_received_total"),
                mk("softhca_flushed_total"),
                mk("softhca_timeouts_total"),
                mk("softhca_rx_foreign_source_total"),
            ],
        }
    }

    pub fn publish(&mut self, s: &Stats) {
        if *s == self.last {
            return;
        }
        let l = &self.last;
        let dropped = |x: &Stats| {
            x.rx_malformed
                + x.rx_icrc_errors
                + x.rx_unknown_qp
                + x.rx_dropped
                + x.rx_ghost
                + x.rx_foreign_source
        };
        let naks_tx = |x: &Stats| x.seq_naks_tx + x.rnr_naks_tx + x.naks_tx;
        let naks_rx = |x: &Stats| x.seq_naks_rx + x.rnr_naks_rx + x.naks_rx;
        let deltas = [
            s.tx_packets - l.tx_packets,
            s.rx_packets - l.rx_packets,
            s.tx_bytes - l.tx_bytes,
            s.rx_bytes - l.rx_bytes,
            dropped(s) - dropped(l),
            s.retransmits - l.retransmits,
            naks_tx(s) - naks_tx(l),
            naks_rx(s) - naks_rx(l),
            s.flushed - l.flushed,
            s.timeouts - l.timeouts,
            s.rx_foreign_source - l.rx_foreign_source,
        ];
        for (c, d) in self.c.iter().zip(deltas) {
            if d > 0 {
                c.increment(d);
            }
        }
        self.last = s.clone();
    }
}

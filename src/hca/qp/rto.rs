//! The requester's adaptive retransmit timer: a round-trip estimate from ACKs in the manner
//! of RFC 6298 (SRTT, RTTVAR, Karn's rule: the caller samples only packets sent once),
//! exponential backoff on repeated expiries, and the tail-loss probe delay of RFC 8985.
//!
//! The timer is local to the requester and never on the wire, so it changes nothing a peer
//! (Linux rxe, a NIC) can see except how soon a lost packet is sent again. Every value is
//! bounded above by the QP's local ACK timeout (the IBA `timeout` attribute): with no sample
//! yet, or once backed off far enough, the timer is exactly the IBA one. No clock in here:
//! samples and results are nanoseconds the caller measured.

/// Smallest retransmit timeout. Below the noise of a software RTT on a shared host (a
/// scheduler hiccup is a few hundred µs), above what a loopback round trip with ACK
/// coalescing takes when the host is calm (tens of µs to ~100 µs).
pub const MIN_RTO_NS: u64 = 200_000;

/// Most doublings of the timeout; the local ACK timeout caps it long before that.
const MAX_BACKOFF: u32 = 16;

/// Round-trip estimate and backoff of one requester.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RttEstimator {
    /// Smoothed RTT in ns; `None` until the first sample.
    srtt: Option<u64>,
    /// RTT variation in ns.
    rttvar: u64,
    /// Expiries since the last forward progress: the timeout is doubled this many times.
    backoff: u32,
}

impl RttEstimator {
    /// Take one RTT measurement (RFC 6298 2.2, 2.3 with alpha 1/8, beta 1/4).
    pub fn sample(&mut self, rtt_ns: u64) {
        match self.srtt {
            None => {
                self.srtt = Some(rtt_ns);
                self.rttvar = rtt_ns / 2;
            }
            Some(srtt) => {
                // In u128: a 64-bit sum could overflow on absurd samples.
                let var = (3 * self.rttvar as u128 + srtt.abs_diff(rtt_ns) as u128) / 4;
                let s = (7 * srtt as u128 + rtt_ns as u128) / 8;
                self.rttvar = var as u64;
                self.srtt = Some(s as u64);
            }
        }
    }

    pub fn srtt(&self) -> Option<u64> {
        self.srtt
    }

    /// The timeout before backoff: SRTT + 4·RTTVAR, at least [`MIN_RTO_NS`], at most `max`
    /// (the local ACK timeout); `max` itself before the first sample.
    pub fn base_rto(&self, max: u64) -> u64 {
        match self.srtt {
            None => max,
            Some(s) => s
                .saturating_add(self.rttvar.saturating_mul(4))
                .clamp(MIN_RTO_NS.min(max), max),
        }
    }

    /// The timeout to arm now: [`Self::base_rto`] doubled once per expiry since the last
    /// progress, capped at `max`.
    pub fn rto(&self, max: u64) -> u64 {
        self.base_rto(max)
            .saturating_mul(1u64 << self.backoff)
            .min(max)
    }

    /// The timer expired: the next one waits twice as long (RFC 6298 5.5).
    pub fn back_off(&mut self) {
        self.backoff = (self.backoff + 1).min(MAX_BACKOFF);
    }

    /// An ACK moved the oldest unacknowledged PSN forward.
    pub fn reset_backoff(&mut self) {
        self.backoff = 0;
    }

    pub fn backoff(&self) -> u32 {
        self.backoff
    }

    /// How long after the last new packet, with no ACK progress since, a tail-loss probe
    /// goes out (RFC 8985 7.2): 2·SRTT plus the time the peer may hold its ACK back
    /// (`ack_delay`, its coalescing window). `None` before the first sample: without an
    /// estimate the local ACK timeout is all there is.
    pub fn pto(&self, ack_delay: u64) -> Option<u64> {
        self.srtt
            .map(|s| s.saturating_mul(2).saturating_add(ack_delay))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;
    const T14: u64 = 4096 << 14; // the usual local ACK timeout, 67 ms

    #[test]
    fn no_sample_means_the_local_ack_timeout() {
        let r = RttEstimator::default();
        assert_eq!(r.rto(T14), T14);
        assert_eq!(r.pto(100_000), None);
    }

    #[test]
    fn first_sample_sets_srtt_and_half_variation() {
        let mut r = RttEstimator::default();
        r.sample(MS);
        assert_eq!(r.srtt(), Some(MS));
        // SRTT + 4 · RTT/2 = 3 RTT.
        assert_eq!(r.base_rto(T14), 3 * MS);
        assert_eq!(r.pto(100_000), Some(2 * MS + 100_000));
    }

    #[test]
    fn smoothing_follows_rfc6298() {
        let mut r = RttEstimator::default();
        r.sample(800_000);
        r.sample(1_600_000);
        // rttvar = 3/4·400 µs + 1/4·|800 − 1600| µs = 500 µs; srtt = 7/8·800 + 1/8·1600 = 900 µs.
        assert_eq!(r.srtt(), Some(900_000));
        assert_eq!(r.base_rto(T14), 900_000 + 4 * 500_000);
        // A steady RTT makes the variation decay towards zero and the RTO towards the floor
        // or SRTT, whichever is larger.
        for _ in 0..200 {
            r.sample(50_000);
        }
        assert_eq!(r.srtt(), Some(50_000));
        assert_eq!(r.base_rto(T14), MIN_RTO_NS);
        for _ in 0..200 {
            r.sample(5 * MS);
        }
        assert!((5 * MS..5 * MS + 10_000).contains(&r.base_rto(T14)));
    }

    #[test]
    fn bounded_by_the_local_ack_timeout() {
        let mut r = RttEstimator::default();
        r.sample(T14);
        assert_eq!(r.base_rto(T14), T14);
        // A local ACK timeout below the floor wins over the floor.
        assert_eq!(r.base_rto(100_000), 100_000);
        let mut small = RttEstimator::default();
        small.sample(1_000);
        assert_eq!(small.base_rto(100_000), 100_000);
        assert_eq!(small.base_rto(T14), MIN_RTO_NS);
    }

    #[test]
    fn backoff_doubles_up_to_the_cap_and_resets() {
        let mut r = RttEstimator::default();
        for _ in 0..100 {
            r.sample(100_000);
        }
        let base = r.base_rto(T14);
        assert_eq!(base, MIN_RTO_NS);
        let mut seen = vec![r.rto(T14)];
        for _ in 0..40 {
            r.back_off();
            seen.push(r.rto(T14));
        }
        assert_eq!(&seen[..4], &[base, 2 * base, 4 * base, 8 * base]);
        // Never above the local ACK timeout, and there for good once reached.
        assert!(seen.iter().all(|&t| t <= T14));
        let first_cap = seen
            .iter()
            .position(|&t| t == T14)
            .expect("reaches the cap");
        assert!(seen[first_cap..].iter().all(|&t| t == T14));
        // 200 µs · 2^9 = 102 ms > 67 ms: capped from the ninth expiry on.
        assert_eq!(first_cap, 9);
        assert_eq!(r.backoff(), MAX_BACKOFF);
        r.reset_backoff();
        assert_eq!(r.rto(T14), base);
    }

    #[test]
    fn huge_values_saturate() {
        let mut r = RttEstimator::default();
        r.sample(u64::MAX / 2);
        r.sample(u64::MAX / 2);
        for _ in 0..40 {
            r.back_off();
        }
        assert_eq!(r.rto(u64::MAX), u64::MAX);
        assert!(r.pto(u64::MAX).is_some());
    }
}

//! The rule a stop (a stop signal, `stop`, `disconnect`) follows while an export is in use.

use std::time::{Duration, Instant};

/// A second stop signal within this time of a refused one stops anyway.
pub const FORCE_WINDOW: Duration = Duration::from_secs(10);
/// How often a pending stop (or a dead controller kept for its export) looks whether the
/// exports were released: a look at counters; the full scan of holders runs only once they
/// read zero.
pub const PENDING_POLL: Duration = Duration::from_millis(250);
/// How often a pending stop says who still holds the exports.
pub const PENDING_REPORT: Duration = Duration::from_secs(10);

/// A stop refused because an export is in use. It stays pending and completes as soon as
/// nothing holds the exports (systemd's `stop` waits for it); a second stop signal within
/// [`FORCE_WINDOW`] of a refusal forces it. Time comes in as `now`.
#[derive(Debug, Default)]
pub struct PendingStop {
    /// The last refused stop signal.
    refused_at: Option<Instant>,
    /// When the holders were last told.
    told_at: Option<Instant>,
}

impl PendingStop {
    /// A stop signal arrived at `now`: does it force the stop?
    pub fn forces(&self, now: Instant) -> bool {
        self.refused_at
            .is_some_and(|t| now.saturating_duration_since(t) < FORCE_WINDOW)
    }

    /// The stop was refused at `now` (and the holders told): it is pending from now on.
    pub fn refused(&mut self, now: Instant) {
        self.refused_at = Some(now);
        self.told_at = Some(now);
    }

    /// Held for another reason than a signal (a dead controller whose export is in use):
    /// pending, without making the next signal a forcing one.
    pub fn hold(&mut self, now: Instant) {
        self.told_at.get_or_insert(now);
    }

    pub fn is_pending(&self) -> bool {
        self.told_at.is_some()
    }

    /// Time to say again who holds the exports (every [`PENDING_REPORT`]); marks it told.
    pub fn report_due(&mut self, now: Instant) -> bool {
        match self.told_at {
            Some(t) if now.saturating_duration_since(t) >= PENDING_REPORT => {
                self.told_at = Some(now);
                true
            }
            _ => false,
        }
    }

    /// Resolves after [`PENDING_POLL`] while a stop is pending; never otherwise.
    pub async fn tick(&self) {
        if self.is_pending() {
            tokio::time::sleep(PENDING_POLL).await
        } else {
            std::future::pending().await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_stop_stays_pending_reports_every_period_and_a_second_signal_forces() {
        let t0 = Instant::now();
        let mut p = PendingStop::default();
        assert!(!p.is_pending() && !p.forces(t0));
        p.refused(t0);
        assert!(p.is_pending());
        assert!(p.forces(t0 + FORCE_WINDOW - Duration::from_millis(1)));
        assert!(!p.forces(t0 + FORCE_WINDOW));
        assert!(!p.report_due(t0 + PENDING_REPORT - Duration::from_millis(1)));
        assert!(p.report_due(t0 + PENDING_REPORT));
        assert!(!p.report_due(t0 + PENDING_REPORT + Duration::from_secs(1)));
        assert!(p.report_due(t0 + 2 * PENDING_REPORT));
        // Held by a dead controller's export: pending, but a signal is only refused.
        let mut h = PendingStop::default();
        h.hold(t0);
        assert!(h.is_pending() && !h.forces(t0));
    }
}

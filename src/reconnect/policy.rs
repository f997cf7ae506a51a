//! The reconnect policy: nvme-cli's knobs with Linux's defaults, plus ours (`replug_window`,
//! `identity`).

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

pub use crate::verbs::Identity;

/// Linux `NVMF_DEF_CTRL_LOSS_TMO`.
pub const DEFAULT_CTRL_LOSS_TMO: Duration = Duration::from_secs(600);
/// Linux `NVMF_DEF_RECONNECT_DELAY`.
pub const DEFAULT_RECONNECT_DELAY: Duration = Duration::from_secs(10);
/// Linux `NVME_DEFAULT_KATO`.
pub const DEFAULT_KEEP_ALIVE_TMO: Duration = Duration::from_secs(5);
/// How long a hot-removed device may take to come back.
pub const DEFAULT_REPLUG_WINDOW: Duration = Duration::from_secs(600);
/// Linux `nvme_max_retries`: how often a command that failed with a retryable NVMe status
/// (DNR clear) is sent again.
pub const DEFAULT_MAX_RETRIES: u8 = 5;
/// With `reconnect_delay` 0: the gap after the first failed attempt of an episode.
pub const RETRY_GAP_MIN: Duration = Duration::from_millis(10);
/// With `reconnect_delay` 0: the longest gap between failed attempts.
pub const RETRY_GAP_MAX: Duration = Duration::from_secs(1);
/// Linux `NVME_IO_TIMEOUT`.
pub const DEFAULT_IO_TIMEOUT: Duration = Duration::from_secs(30);

/// Which properties a device that comes back must share with the one the controller was
/// connected through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IdentityMatch {
    /// Same node GUID.
    Guid,
    /// Same PCI address (a replacement card in the same slot).
    Pci,
    /// Same GUID and same PCI address.
    #[default]
    Both,
    /// Any device (in the same slot name): the user allows a different card.
    Any,
}

impl IdentityMatch {
    pub fn name(self) -> &'static str {
        match self {
            IdentityMatch::Guid => "guid",
            IdentityMatch::Pci => "pci",
            IdentityMatch::Both => "both",
            IdentityMatch::Any => "any",
        }
    }

    /// Is `seen` the device `ours` was, under this rule?
    pub fn accepts(self, ours: &Identity, seen: &Identity) -> bool {
        match self {
            IdentityMatch::Guid => ours.guid == seen.guid,
            IdentityMatch::Pci => ours.pci == seen.pci,
            IdentityMatch::Both => ours.guid == seen.guid && ours.pci == seen.pci,
            IdentityMatch::Any => true,
        }
    }
}

impl FromStr for IdentityMatch {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "guid" => Ok(IdentityMatch::Guid),
            "pci" => Ok(IdentityMatch::Pci),
            "both" => Ok(IdentityMatch::Both),
            "any" => Ok(IdentityMatch::Any),
            _ => Err(format!(
                "identity must be guid, pci, both or any, not {s:?}"
            )),
        }
    }
}

impl fmt::Display for IdentityMatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The reconnect policy of one controller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// How long to keep trying after a failure before the controller is deleted and
    /// everything pending fails. `None` is nvme-cli's `-1`: forever.
    pub ctrl_loss_tmo: Option<Duration>,
    /// Wait between a failure (or a failed attempt) and the next attempt.
    pub reconnect_delay: Duration,
    /// After this long without a connection, held and new I/O fails with a host path error
    /// instead of waiting. `None`: off (Linux default).
    pub fast_io_fail_tmo: Option<Duration>,
    /// Keep-alive timeout; a keep-alive goes out every half of it. Zero: off.
    pub keep_alive_tmo: Duration,
    /// How long a hot-removed device may take to come back before we give up.
    pub replug_window: Duration,
    /// Which returning device counts as ours.
    pub identity: IdentityMatch,
}

impl Default for Policy {
    fn default() -> Policy {
        Policy {
            ctrl_loss_tmo: Some(DEFAULT_CTRL_LOSS_TMO),
            reconnect_delay: DEFAULT_RECONNECT_DELAY,
            fast_io_fail_tmo: None,
            keep_alive_tmo: DEFAULT_KEEP_ALIVE_TMO,
            replug_window: DEFAULT_REPLUG_WINDOW,
            identity: IdentityMatch::Both,
        }
    }
}

impl Policy {
    /// `max_reconnects` as Linux derives it: `DIV_ROUND_UP(ctrl_loss_tmo, reconnect_delay)`,
    /// unbounded when ctrl_loss_tmo is -1. Linux refuses a zero delay; we allow it (reconnect
    /// at once, then paced by [`Policy::retry_gap`]) and then there is no attempt budget at
    /// all: ctrl_loss_tmo is a time, and only time ends the controller.
    pub fn max_reconnects(&self) -> Option<u32> {
        let loss = self.ctrl_loss_tmo?;
        if self.reconnect_delay.is_zero() {
            return None;
        }
        let n = loss.as_nanos().div_ceil(self.reconnect_delay.as_nanos());
        Some(n.clamp(1, u32::MAX as u128) as u32)
    }

    /// The wait before the next attempt after `failures` consecutive failed attempts (0: the
    /// first attempt of an episode). A positive `reconnect_delay` is the wait every time, as
    /// in Linux. With a zero delay the first attempt goes at once and failed ones are paced:
    /// [`RETRY_GAP_MIN`] after the first failure, doubling with each further one, at most
    /// [`RETRY_GAP_MAX`]; so a target that refuses us for a while is neither hammered nor
    /// given up on before ctrl_loss_tmo.
    pub fn retry_gap(&self, failures: u32) -> Duration {
        if !self.reconnect_delay.is_zero() {
            return self.reconnect_delay;
        }
        if failures == 0 {
            return Duration::ZERO;
        }
        let doublings = (failures - 1).min(16);
        (RETRY_GAP_MIN * (1u32 << doublings)).min(RETRY_GAP_MAX)
    }

    /// Parse nvme-cli's seconds value where `-1` means forever (`ctrl_loss_tmo`).
    pub fn parse_tmo(s: &str) -> Result<Option<Duration>, String> {
        let v: i64 = s
            .trim()
            .parse()
            .map_err(|_| format!("{s:?} is not a whole number of seconds"))?;
        match v {
            -1 => Ok(None),
            v if v >= 0 => Ok(Some(Duration::from_secs(v as u64))),
            v => Err(format!(
                "{v} is not valid: use -1 (forever) or seconds >= 0"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linux_defaults_and_max_reconnects() {
        let p = Policy::default();
        assert_eq!(p.ctrl_loss_tmo, Some(Duration::from_secs(600)));
        assert_eq!(p.reconnect_delay, Duration::from_secs(10));
        assert_eq!(p.fast_io_fail_tmo, None);
        assert_eq!(p.keep_alive_tmo, Duration::from_secs(5));
        assert_eq!(p.max_reconnects(), Some(60));
        let p = Policy {
            ctrl_loss_tmo: Some(Duration::from_secs(25)),
            ..Policy::default()
        };
        assert_eq!(p.max_reconnects(), Some(3), "rounds up like DIV_ROUND_UP");
        let p = Policy {
            ctrl_loss_tmo: None,
            ..Policy::default()
        };
        assert_eq!(p.max_reconnects(), None);
        let p = Policy {
            reconnect_delay: Duration::ZERO,
            ..Policy::default()
        };
        assert_eq!(
            p.max_reconnects(),
            None,
            "a zero delay has no attempt budget"
        );
    }

    #[test]
    fn retry_gaps() {
        let p = Policy::default();
        for f in [0, 1, 7, 1000] {
            assert_eq!(p.retry_gap(f), Duration::from_secs(10));
        }
        let p = Policy {
            reconnect_delay: Duration::ZERO,
            ..Policy::default()
        };
        let ms = |f| p.retry_gap(f).as_millis();
        assert_eq!(
            (0..10).map(ms).collect::<Vec<_>>(),
            vec![0, 10, 20, 40, 80, 160, 320, 640, 1000, 1000]
        );
        assert_eq!(ms(u32::MAX), 1000);
    }

    #[test]
    fn tmo_parsing() {
        assert_eq!(Policy::parse_tmo("-1"), Ok(None));
        assert_eq!(Policy::parse_tmo("0"), Ok(Some(Duration::ZERO)));
        assert_eq!(Policy::parse_tmo("600"), Ok(Some(Duration::from_secs(600))));
        assert!(Policy::parse_tmo("-2").is_err());
        assert!(Policy::parse_tmo("ten").is_err());
        assert_eq!("pci".parse(), Ok(IdentityMatch::Pci));
        assert!("serial".parse::<IdentityMatch>().is_err());
    }
}

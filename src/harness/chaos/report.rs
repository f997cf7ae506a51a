//! What a chaos run reports: each fault's outcome, the I/O rate and latency per interval,
//! and the summary, as text and as JSON (`chaos -o json`).

use std::time::Duration;

use crate::cli::support::Health;
use crate::cli::units::{human_bytes, human_dur, ms};
use crate::cli::wire_json::{quote, JsonObj};
use crate::harness::chaos::config::{ChaosConfig, FaultKind};
use crate::harness::chaos::{pct, IoSample, WorkerReport, CHAOS_NQN};

/// What one fault did.
#[derive(Debug, Clone)]
pub struct FaultOutcome {
    pub kind: FaultKind,
    /// Since the start of the run.
    pub at: Duration,
    /// How long the HCA stayed away (reset, replug) or the foreign card stayed in.
    pub down: Duration,
    /// From inflicting the fault to LIVE again; `None`: the controller did not recover.
    pub to_live: Option<Duration>,
    /// The controller's own measure of the recovery (failure noticed → LIVE).
    pub ctrl_recovery: Option<Duration>,
    /// replug-other: the controller saw the foreign card...
    pub foreign_seen: bool,
    /// ...and reconnected through it (wrong unless `--identity any`).
    pub through_foreign: bool,
    /// The policy accepts the other card (`--identity any`).
    pub foreign_allowed: bool,
    /// The fault itself could not be inflicted.
    pub error: Option<String>,
}

impl FaultOutcome {
    pub fn describe(&self) -> String {
        let mut s = format!(
            "[{:>7.2} s] {:<14}",
            self.at.as_secs_f64(),
            self.kind.name()
        );
        match self.kind {
            FaultKind::Reset | FaultKind::Replug => s += &format!(" down {:>8}", ms(self.down)),
            FaultKind::ReplugOther => s += &format!(" in   {:>8}", ms(self.down)),
            _ => s += &format!(" {:>13}", ""),
        }
        if let Some(e) = &self.error {
            return s + &format!("  FAILED TO INFLICT: {e}");
        }
        match self.to_live {
            Some(d) => s += &format!("  live again after {:>9}", ms(d)),
            None => s += "  NOT RECOVERED",
        }
        if self.kind == FaultKind::ReplugOther {
            s += match (
                self.foreign_allowed,
                self.foreign_seen,
                self.through_foreign,
            ) {
                (true, _, true) => "; came back on the other card (--identity any)",
                (true, _, false) => "; did not come back on the other card in time",
                (false, _, true) => "; RECONNECTED THROUGH THE FOREIGN CARD",
                (false, true, false) => "; foreign card seen, not used",
                (false, false, false) => "; foreign card not noticed",
            };
        }
        s
    }

    /// One entry of the JSON summary's fault log.
    pub fn json(&self) -> String {
        let mut o = JsonObj::new();
        o.raw("at_s", &format!("{:.3}", self.at.as_secs_f64()))
            .str("kind", self.kind.name())
            .raw("down_ms", &opt_ms(Some(self.down)))
            .raw("to_live_ms", &opt_ms(self.to_live))
            .raw("ctrl_recovery_ms", &opt_ms(self.ctrl_recovery));
        if self.kind == FaultKind::ReplugOther {
            o.raw(
                "foreign_seen",
                if self.foreign_seen { "true" } else { "false" },
            )
            .raw(
                "through_foreign",
                if self.through_foreign {
                    "true"
                } else {
                    "false"
                },
            );
        }
        if let Some(e) = &self.error {
            o.str("error", e);
        }
        o.finish()
    }
}

/// One `--interval` of the run: the I/Os that completed in it.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    /// The end of the interval, since the start of the run.
    pub at: Duration,
    /// Its length: `--interval`; longer after a sampler that was kept off the CPU, and
    /// the next one then at least half as long; the last one up to half as long again.
    pub len: Duration,
    pub io: IoSample,
}

impl Sample {
    pub fn start(&self) -> Duration {
        self.at.saturating_sub(self.len)
    }
    pub fn iops(&self) -> f64 {
        self.io.ios as f64 / self.len.as_secs_f64().max(1e-9)
    }
    pub fn mb_s(&self) -> f64 {
        self.io.bytes as f64 / self.len.as_secs_f64().max(1e-9) / 1e6
    }
    /// Mean latency of the I/Os completed in the interval; `None`: none completed.
    pub fn lat_mean(&self) -> Option<Duration> {
        (self.io.ios > 0).then(|| Duration::from_nanos(self.io.lat_sum_ns / self.io.ios))
    }
    pub fn lat_max(&self) -> Option<Duration> {
        (self.io.ios > 0).then(|| Duration::from_nanos(self.io.lat_max_ns))
    }

    pub fn describe(&self) -> String {
        let lat = match (self.lat_mean(), self.lat_max()) {
            (Some(m), Some(x)) => format!("latency mean {}, max {}", ms(m), ms(x)),
            _ => "no I/O completed".into(),
        };
        format!(
            "[{:>7.2} s] {:>9.0} IO/s {:>8.1} MB/s  {lat}",
            self.at.as_secs_f64(),
            self.iops(),
            self.mb_s()
        )
    }

    pub fn json(&self) -> String {
        let mut o = JsonObj::new();
        o.raw("t_s", &format!("{:.3}", self.at.as_secs_f64()))
            .raw("len_s", &format!("{:.3}", self.len.as_secs_f64()))
            .num("ios", self.io.ios)
            .raw("iops", &format!("{:.1}", self.iops()))
            .raw("mb_s", &format!("{:.3}", self.mb_s()))
            .raw("lat_mean_ms", &opt_ms(self.lat_mean()))
            .raw("lat_max_ms", &opt_ms(self.lat_max()));
        o.finish()
    }
}

/// Milliseconds for the JSON summary; `null` for none.
fn opt_ms(d: Option<Duration>) -> String {
    d.map_or("null".into(), |d| format!("{:.3}", d.as_secs_f64() * 1e3))
}

/// nvme-cli's seconds-or-off for the summary.
pub fn tmo_text(t: Option<Duration>, none: &str) -> String {
    t.map_or(none.to_string(), |d| format!("{} s", d.as_secs()))
}

/// p50, p99 and max of durations.
pub fn spread(mut v: Vec<Duration>) -> Option<(Duration, Duration, Duration)> {
    if v.is_empty() {
        return None;
    }
    v.sort();
    let ns: Vec<u64> = v.iter().map(|d| d.as_nanos() as u64).collect();
    let d = |p| Duration::from_nanos(pct(&ns, p));
    Some((d(0.5), d(0.99), v[v.len() - 1]))
}

pub fn spread_text(s: Option<(Duration, Duration, Duration)>) -> String {
    match s {
        Some((p50, p99, max)) => format!("p50 {}, p99 {}, max {}", ms(p50), ms(p99), ms(max)),
        None => "-".into(),
    }
}

pub fn spread_json(s: Option<(Duration, Duration, Duration)>, unit: f64) -> String {
    match s {
        Some((p50, p99, max)) => {
            let f = |d: Duration| format!("{:.3}", d.as_secs_f64() * unit);
            let mut o = JsonObj::new();
            o.raw("p50", &f(p50))
                .raw("p99", &f(p99))
                .raw("max", &f(max));
            o.finish()
        }
        None => "null".into(),
    }
}

/// What a run saw, and what went wrong (`problems`: none is a pass).
#[derive(Debug, Clone)]
pub struct ChaosSummary {
    pub seed: u64,
    pub elapsed: Duration,
    pub io: WorkerReport,
    pub lat: Option<(Duration, Duration, Duration)>,
    pub faults: Vec<FaultOutcome>,
    pub recoveries: u64,
    pub requeued: u64,
    pub final_state: String,
    pub final_health: Health,
    pub failed_by_reason: std::collections::BTreeMap<String, u64>,
    pub unexpected_failures: u64,
    pub problems: Vec<String>,
    pub interval: Duration,
    pub series: Vec<Sample>,
}

impl ChaosSummary {
    pub fn to_live(&self) -> Option<(Duration, Duration, Duration)> {
        spread(self.faults.iter().filter_map(|f| f.to_live).collect())
    }
    pub fn ctrl(&self) -> Option<(Duration, Duration, Duration)> {
        spread(self.faults.iter().filter_map(|f| f.ctrl_recovery).collect())
    }
    pub fn count(&self, k: FaultKind) -> usize {
        self.faults.iter().filter(|f| f.kind == k).count()
    }
    pub fn unrecovered(&self) -> usize {
        self.faults.iter().filter(|f| f.to_live.is_none()).count()
    }
    pub fn ios(&self) -> u64 {
        self.io.reads + self.io.writes
    }
    pub fn failed(&self) -> u64 {
        self.io.failed()
    }

    /// The summary as text: a blank line, then one row per line.
    pub fn text(&self, a: &ChaosConfig) -> String {
        let mut out = String::from("\n");
        for (k, v) in [self.io_rows(), self.fault_rows(a), self.verdict_rows()].concat() {
            out += &format!("{k:<20} {v}\n");
        }
        out
    }

    /// Rows of the summary: the I/O done.
    fn io_rows(&self) -> Vec<(&'static str, String)> {
        let secs = self.elapsed.as_secs_f64();
        let mut rows = Vec::new();
        let mut row = |k, v| rows.push((k, v));
        row("elapsed", format!("{secs:.2} s"));
        row(
            "I/Os",
            format!(
                "{} (reads {}, writes {}), {:.0}/s",
                self.ios(),
                self.io.reads,
                self.io.writes,
                self.ios() as f64 / secs
            ),
        );
        row(
            "verified",
            format!(
                "{} read back and compared",
                human_bytes(self.io.bytes_verified)
            ),
        );
        row("I/O latency", spread_text(self.lat));
        let mut rates: Vec<f64> = self.series.iter().map(Sample::iops).collect();
        rates.sort_by(f64::total_cmp);
        if let (Some(lo), Some(hi)) = (rates.first(), rates.last()) {
            row(
                "I/O rate",
                format!(
                    "per {}: lowest {lo:.0}/s, median {:.0}/s, highest {hi:.0}/s",
                    human_dur(self.interval),
                    rates[(rates.len() - 1) / 2]
                ),
            );
        }
        rows
    }

    /// Rows of the summary: the faults and the recoveries.
    fn fault_rows(&self, a: &ChaosConfig) -> Vec<(&'static str, String)> {
        let mut rows = Vec::new();
        let mut row = |k, v| rows.push((k, v));
        let kinds: Vec<String> = FaultKind::ALL
            .iter()
            .filter(|k| a.faults.contains(k))
            .map(|&k| format!("{} {}", k.name(), self.count(k)))
            .collect();
        row(
            "faults",
            format!("{}: {}", self.faults.len(), kinds.join(", ")),
        );
        row(
            "recoveries",
            format!(
                "{} ({} I/Os held across failures{})",
                self.recoveries,
                self.requeued,
                match self.unrecovered() {
                    0 => String::new(),
                    n => format!("; {n} faults NOT recovered"),
                }
            ),
        );
        row(
            "recovery time",
            format!(
                "{} (from the fault until live again)",
                spread_text(self.to_live())
            ),
        );
        if a.faults.contains(&FaultKind::ReplugOther) {
            let n = self.count(FaultKind::ReplugOther);
            let seen = self.faults.iter().filter(|f| f.foreign_seen).count();
            let used = self.faults.iter().filter(|f| f.through_foreign).count();
            row(
                "foreign card",
                format!(
                    "in the slot {n} times: seen {seen}, reconnected through it {used} \
                     (--identity {})",
                    a.policy.identity
                ),
            );
        }
        rows
    }

    /// Rows of the summary: what failed, and the verdict.
    fn verdict_rows(&self) -> Vec<(&'static str, String)> {
        let mut rows = Vec::new();
        let mut row = |k, v| rows.push((k, v));
        let reasons: Vec<String> = self
            .failed_by_reason
            .iter()
            .map(|(r, n)| format!("{r}: {n}"))
            .collect();
        row(
            "failed I/Os",
            if reasons.is_empty() {
                "0".into()
            } else {
                format!(
                    "{} ({}); {} within ctrl_loss_tmo",
                    self.failed(),
                    reasons.join(", "),
                    self.unexpected_failures
                )
            },
        );
        row(
            "mismatches",
            format!(
                "{} (acknowledged writes lost or corrupted)",
                self.io.mismatches
            ),
        );
        row("hangs", self.io.hangs.to_string());
        row(
            "controller",
            format!(
                "{}; {}",
                self.final_state,
                self.final_health.describe(&self.final_state)
            ),
        );
        row(
            "result",
            if self.problems.is_empty() {
                "PASS".into()
            } else {
                format!("FAIL: {}", self.problems.join("; "))
            },
        );
        rows
    }

    pub fn to_json(&self, a: &ChaosConfig) -> String {
        let mut faults = JsonObj::new();
        faults.num("total", self.faults.len() as u64);
        for k in FaultKind::ALL {
            faults.num(k.name(), self.count(k) as u64);
        }
        let log: Vec<String> = self.faults.iter().map(FaultOutcome::json).collect();
        let series: Vec<String> = self.series.iter().map(Sample::json).collect();
        let mut by_reason = JsonObj::new();
        for (k, n) in &self.failed_by_reason {
            by_reason.num(k, *n);
        }
        let mut failed = JsonObj::new();
        failed
            .num("total", self.failed())
            .num("within_ctrl_loss_tmo", self.unexpected_failures)
            .raw("by_reason", &by_reason.finish());
        let p = &a.policy;
        let mut policy = JsonObj::new();
        policy
            .num("reconnect_delay_s", p.reconnect_delay.as_secs())
            .raw(
                "ctrl_loss_tmo_s",
                &p.ctrl_loss_tmo
                    .map_or("-1".into(), |d| d.as_secs().to_string()),
            )
            .raw(
                "fast_io_fail_tmo_s",
                &p.fast_io_fail_tmo
                    .map_or("-1".into(), |d| d.as_secs().to_string()),
            )
            .num("replug_window_s", p.replug_window.as_secs())
            .str("identity", p.identity.name())
            .num("keep_alive_tmo_s", p.keep_alive_tmo.as_secs())
            .num("io_timeout_s", a.io_timeout.as_secs());
        let problems: Vec<String> = self.problems.iter().map(|p| quote(p)).collect();
        let mut o = JsonObj::new();
        o.num("seed", self.seed)
            .raw("elapsed_s", &format!("{:.3}", self.elapsed.as_secs_f64()))
            .num("workers", a.workers)
            .num("size", a.size as u64)
            .raw("policy", &policy.finish())
            .num("ios", self.ios())
            .num("reads", self.io.reads)
            .num("writes", self.io.writes)
            .num("verified_bytes", self.io.bytes_verified)
            .raw("latency_ms", &spread_json(self.lat, 1e3))
            .raw("faults", &faults.finish())
            .num("recoveries", self.recoveries)
            .num("unrecovered", self.unrecovered() as u64)
            .num("requeued", self.requeued)
            .raw("recovery_ms", &spread_json(self.to_live(), 1e3))
            .raw("ctrl_recovery_ms", &spread_json(self.ctrl(), 1e3))
            .num(
                "foreign_seen",
                self.faults.iter().filter(|f| f.foreign_seen).count() as u64,
            )
            .num(
                "through_foreign",
                self.faults.iter().filter(|f| f.through_foreign).count() as u64,
            )
            .raw("failed", &failed.finish())
            .num("mismatches", self.io.mismatches)
            .num("hangs", self.io.hangs)
            .str("state", &self.final_state)
            .raw(
                "pass",
                if self.problems.is_empty() {
                    "true"
                } else {
                    "false"
                },
            )
            .raw("problems", &format!("[{}]", problems.join(",")))
            .raw("fault_log", &format!("[{}]", log.join(",")))
            .raw("interval_s", &format!("{:.3}", self.interval.as_secs_f64()))
            .raw("series", &format!("[{}]", series.join(",")));
        o.finish()
    }
}

/// The lines a run starts with: what runs, which faults how often, and the policy.
pub fn header(a: &ChaosConfig) -> String {
    let fault_names: Vec<&str> = a.faults.iter().map(|f| f.name()).collect();
    let p = &a.policy;
    format!(
        "nvmf-rdma chaos: {} workers on {}, {} I/O queues of {}\n\
         faults {} every {} (HCA down 0..={}), seed {}\n\
         policy: reconnect_delay {} s, ctrl_loss_tmo {}, fast_io_fail_tmo {}, replug_window {} s, \
         identity {}, keep-alive {} s, io_timeout {} s",
        a.workers,
        match (a.traddr, &a.nqn) {
            (None, _) => format!(
                "a {} RAM namespace over loopback",
                human_bytes(a.size as u64)
            ),
            (Some(t), n) => format!(
                "{} of namespace 1 of {} at {t}",
                human_bytes(a.size as u64),
                n.as_deref().unwrap_or(CHAOS_NQN)
            ),
        },
        a.nr_io_queues,
        a.queue_size,
        fault_names.join(","),
        human_dur(a.every),
        human_dur(a.down_max),
        a.seed,
        p.reconnect_delay.as_secs(),
        tmo_text(p.ctrl_loss_tmo, "-1 (forever)"),
        tmo_text(p.fast_io_fail_tmo, "off"),
        p.replug_window.as_secs(),
        p.identity,
        p.keep_alive_tmo.as_secs(),
        a.io_timeout.as_secs()
    )
}

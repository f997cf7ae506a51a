//! `chaos`: faults on loopback while workers write and verify.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::{args::*, host::*};
use nvmf_rdma::cli::units::*;
use anyhow::{bail, Context, Result};
use nvmf_rdma::cli::device::{connect_kernel, DeviceChoice};
use nvmf_rdma::cli::support::{host_bind_addr, roce_peer, Health};
use nvmf_rdma::cli::wire_json::JsonObj;
use nvmf_rdma::driver::DeviceManager;
use nvmf_rdma::harness::chaos::{self, IoCounters, IoSample, TargetRig, WorkerReport};
use nvmf_rdma::reconnect::{CtrlState, IdentityMatch, Policy};
use nvmf_rdma::transport::Controller;

mod plot;

pub(crate) const CHAOS_IP: [u8; 4] = [127, 0, 0, 1];
/// The most samples a run keeps (a day at one a second fits).
const MAX_SAMPLES: f64 = 100_000.0;

/// What one fault did.
#[derive(Debug, Clone)]
pub(crate) struct FaultOutcome {
    pub(crate) kind: FaultKind,
    /// Since the start of the run.
    pub(crate) at: Duration,
    /// How long the HCA stayed away (reset, replug) or the foreign card stayed in.
    pub(crate) down: Duration,
    /// From inflicting the fault to LIVE again; `None`: the controller did not recover.
    pub(crate) to_live: Option<Duration>,
    /// The controller's own measure of the recovery (failure noticed → LIVE).
    pub(crate) ctrl_recovery: Option<Duration>,
    /// replug-other: the controller saw the foreign card...
    pub(crate) foreign_seen: bool,
    /// ...and reconnected through it (wrong unless `--identity any`).
    pub(crate) through_foreign: bool,
    /// The policy accepts the other card (`--identity any`).
    pub(crate) foreign_allowed: bool,
    /// The fault itself could not be inflicted.
    pub(crate) error: Option<String>,
}

impl FaultOutcome {
    pub(crate) fn describe(&self) -> String {
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
}

/// One `--interval` of the run: the I/Os that completed in it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sample {
    /// The end of the interval, since the start of the run.
    pub(crate) at: Duration,
    /// Its length: `--interval`; longer after a sampler that was kept off the CPU, and
    /// the next one then at least half as long; the last one up to half as long again.
    pub(crate) len: Duration,
    pub(crate) io: IoSample,
}

impl Sample {
    pub(crate) fn start(&self) -> Duration {
        self.at.saturating_sub(self.len)
    }
    pub(crate) fn iops(&self) -> f64 {
        self.io.ios as f64 / self.len.as_secs_f64().max(1e-9)
    }
    pub(crate) fn mb_s(&self) -> f64 {
        self.io.bytes as f64 / self.len.as_secs_f64().max(1e-9) / 1e6
    }
    /// Mean latency of the I/Os completed in the interval; `None`: none completed.
    pub(crate) fn lat_mean(&self) -> Option<Duration> {
        (self.io.ios > 0).then(|| Duration::from_nanos(self.io.lat_sum_ns / self.io.ios))
    }
    pub(crate) fn lat_max(&self) -> Option<Duration> {
        (self.io.ios > 0).then(|| Duration::from_nanos(self.io.lat_max_ns))
    }

    pub(crate) fn describe(&self) -> String {
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

    fn json(&self) -> String {
        let opt_ms = |d: Option<Duration>| {
            d.map_or("null".into(), |d| format!("{:.3}", d.as_secs_f64() * 1e3))
        };
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

/// Take a [`Sample`] from `counters` at the end of every `every` from `t0` until `end`
/// fires; then the last, partial one (folded into the one before when shorter than half an
/// interval, so that a sliver of time does not read as a rate). `print`: each to stderr.
async fn sample(
    counters: Arc<IoCounters>,
    t0: tokio::time::Instant,
    every: Duration,
    print: bool,
    mut end: tokio::sync::oneshot::Receiver<()>,
) -> Vec<Sample> {
    let mut v: Vec<Sample> = Vec::new();
    let mut last = Duration::ZERO;
    let mut k = 1u32;
    loop {
        let ended = tokio::select! {
            _ = tokio::time::sleep_until(t0 + every * k) => false,
            _ = &mut end => true,
        };
        // The time read, not the one asked for: a sampler kept off the CPU divides by the
        // time that passed, and the next sample is on the grid again, half an interval
        // away or more.
        let at = t0.elapsed();
        while every * k < at + every / 2 {
            k += 1;
        }
        let s = Sample {
            at,
            len: at.saturating_sub(last),
            io: counters.take(),
        };
        last = at;
        match v.last_mut() {
            Some(p) if ended && s.len < every / 2 => {
                p.at = s.at;
                p.len += s.len;
                p.io.ios += s.io.ios;
                p.io.bytes += s.io.bytes;
                p.io.lat_sum_ns += s.io.lat_sum_ns;
                p.io.lat_max_ns = p.io.lat_max_ns.max(s.io.lat_max_ns);
            }
            _ if s.len.is_zero() => {}
            _ => {
                if print {
                    eprintln!("{}", s.describe());
                }
                v.push(s);
            }
        }
        if ended {
            return v;
        }
    }
}

/// `--interval`, else a quarter of `--every` within 100ms..=1s (a stall between two faults
/// shows in the rate), longer only if the run would take more than [`MAX_SAMPLES`].
fn interval(a: &ChaosArgs) -> Duration {
    a.interval.unwrap_or_else(|| {
        (a.every / 4)
            .clamp(Duration::from_millis(100), Duration::from_secs(1))
            .max(Duration::from_secs_f64(a.seconds / MAX_SAMPLES))
    })
}

/// Refuse a `--plot` path that the run could not write at its end, before the run.
fn check_plot_path(path: &std::path::Path) -> Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if !m.file_type().is_file() => bail!(
            "--plot {}: not a regular file; give the path of a new or regular file",
            path.display()
        ),
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            bail!("--plot {}: {e}", path.display())
        }
        _ => {}
    }
    let dir = plot_dir(path);
    if !dir.is_dir() {
        bail!(
            "--plot {}: no directory {}; create it first",
            path.display(),
            dir.display()
        );
    }
    Ok(())
}

fn plot_dir(path: &std::path::Path) -> &std::path::Path {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => std::path::Path::new("."),
    }
}

/// Write `data` to `path` through a temporary file beside it and a rename: a reader sees
/// the old file or the whole new one, never half.
fn write_atomic(path: &std::path::Path, data: &[u8]) -> Result<()> {
    check_plot_path(path)?;
    let name = path
        .file_name()
        .map_or("plot".into(), |n| n.to_string_lossy());
    let tmp = plot_dir(path).join(format!(".{name}.{}.tmp", std::process::id()));
    let r = std::fs::write(&tmp, data).and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = r {
        let _ = std::fs::remove_file(&tmp);
        bail!("cannot write {}: {e}", path.display());
    }
    Ok(())
}

/// nvme-cli's seconds-or-off for the summary.
pub(crate) fn tmo_text(t: Option<Duration>, none: &str) -> String {
    t.map_or(none.to_string(), |d| format!("{} s", d.as_secs()))
}

/// p50, p99 and max of durations.
pub(crate) fn spread(mut v: Vec<Duration>) -> Option<(Duration, Duration, Duration)> {
    if v.is_empty() {
        return None;
    }
    v.sort();
    let ns: Vec<u64> = v.iter().map(|d| d.as_nanos() as u64).collect();
    let d = |p| Duration::from_nanos(chaos::pct(&ns, p));
    Some((d(0.5), d(0.99), v[v.len() - 1]))
}

pub(crate) fn spread_text(s: Option<(Duration, Duration, Duration)>) -> String {
    match s {
        Some((p50, p99, max)) => format!("p50 {}, p99 {}, max {}", ms(p50), ms(p99), ms(max)),
        None => "-".into(),
    }
}

pub(crate) fn spread_json(s: Option<(Duration, Duration, Duration)>, unit: f64) -> String {
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

/// Inflict `kind` and wait until the controller is LIVE again (or gives up, or `bound`).
/// `mgr` is the soft-HCA's device manager; without one (a kernel RDMA device) only the
/// faults of [`KERNEL_FAULTS`] can be inflicted.
pub(crate) async fn inflict(
    kind: FaultKind,
    down: Duration,
    mgr: Option<&DeviceManager>,
    c: &Controller,
    target: Option<&mut TargetRig>,
    bound: Duration,
    other_is_ours: bool,
) -> FaultOutcome {
    let before = c.status();
    let t0 = Instant::now();
    let mut out = FaultOutcome {
        kind,
        at: Duration::ZERO,
        down,
        to_live: None,
        ctrl_recovery: None,
        foreign_seen: false,
        through_foreign: false,
        foreign_allowed: other_is_ours,
        error: None,
    };
    let mut base = before.machine.recoveries;
    let r: Result<()> = async {
        let Some(mgr) = mgr else {
            return match kind {
                // The device source drops the context as on DEVICE_FATAL and opens it anew.
                FaultKind::Reset => Ok(c.reset_device(down).await?),
                FaultKind::UserReset => {
                    c.reset();
                    Ok(())
                }
                k => bail!("--faults {} needs the soft-HCA", k.name()),
            };
        };
        match kind {
            FaultKind::Reset => chaos::Fault::Reset { down }.inflict(mgr, c, target).await,
            FaultKind::Replug => chaos::Fault::Replug { down }.inflict(mgr, c, target).await,
            FaultKind::TargetRestart => chaos::Fault::TargetRestart.inflict(mgr, c, target).await,
            FaultKind::UserReset => chaos::Fault::UserReset.inflict(mgr, c, target).await,
            FaultKind::ReplugOther => {
                mgr.unplug(chaos::HOST_DEV).await?;
                mgr.replug(chaos::host_identity(1)).await?;
                if other_is_ours {
                    // `--identity any`: the controller may (and should) come back on it.
                    let _ = c
                        .wait_status(bound, |s| {
                            s.state() == CtrlState::Live && s.machine.recoveries > base
                        })
                        .await;
                } else {
                    out.foreign_seen = c
                        .wait_status(Duration::from_secs(2), |s| s.machine.foreign_device)
                        .await
                        .is_ok();
                }
                tokio::time::sleep(down.max(Duration::from_millis(50))).await;
                let during = c.status();
                out.through_foreign =
                    during.machine.recoveries > base || during.state() == CtrlState::Live;
                if out.through_foreign && !other_is_ours {
                    tracing::error!("the controller reconnected through a foreign card");
                }
                // Ours back; a controller that (allowed to) went through the other card
                // recovers once more.
                base = during.machine.recoveries;
                mgr.unplug(chaos::HOST_DEV).await?;
                mgr.replug(chaos::host_identity(0)).await?;
                Ok(())
            }
        }
    }
    .await;
    if let Err(e) = r {
        out.error = Some(format!("{e:#}"));
        return out;
    }
    let st = c
        .wait_status(bound, |s| {
            (s.state() == CtrlState::Live && s.machine.recoveries > base)
                || s.state() == CtrlState::Dead
        })
        .await;
    if let Ok(st) = st {
        if st.state() == CtrlState::Live {
            out.to_live = Some(t0.elapsed());
            out.ctrl_recovery = st.last_recovery;
        }
    }
    out
}

/// Failed I/Os that the policy allows: after the controller gave up (ctrl_loss_tmo,
/// max_reconnects, replug_window), or past fast_io_fail_tmo when one is set.
pub(crate) fn allowed_failures(p: &Policy) -> Vec<String> {
    use nvmf_rdma::reconnect::FailReason;
    use nvmf_rdma::transport::HostError;
    let mut v = vec![
        FailReason::CtrlLoss,
        FailReason::MaxReconnects,
        FailReason::ReplugWindow,
    ];
    if p.fast_io_fail_tmo.is_some() {
        v.push(FailReason::FastIoFail);
    }
    v.into_iter()
        .map(|r| chaos::error_kind(&HostError::Path(r)))
        .collect()
}

pub(crate) struct ChaosSummary {
    pub(crate) seed: u64,
    pub(crate) elapsed: Duration,
    pub(crate) io: WorkerReport,
    pub(crate) lat: Option<(Duration, Duration, Duration)>,
    pub(crate) faults: Vec<FaultOutcome>,
    pub(crate) recoveries: u64,
    pub(crate) requeued: u64,
    pub(crate) final_state: String,
    pub(crate) final_health: Health,
    pub(crate) failed_by_reason: std::collections::BTreeMap<String, u64>,
    pub(crate) unexpected_failures: u64,
    pub(crate) problems: Vec<String>,
    pub(crate) interval: Duration,
    pub(crate) series: Vec<Sample>,
}

impl ChaosSummary {
    pub(crate) fn to_live(&self) -> Option<(Duration, Duration, Duration)> {
        spread(self.faults.iter().filter_map(|f| f.to_live).collect())
    }
    pub(crate) fn ctrl(&self) -> Option<(Duration, Duration, Duration)> {
        spread(self.faults.iter().filter_map(|f| f.ctrl_recovery).collect())
    }
    pub(crate) fn count(&self, k: FaultKind) -> usize {
        self.faults.iter().filter(|f| f.kind == k).count()
    }
    pub(crate) fn unrecovered(&self) -> usize {
        self.faults.iter().filter(|f| f.to_live.is_none()).count()
    }
    pub(crate) fn ios(&self) -> u64 {
        self.io.reads + self.io.writes
    }
    pub(crate) fn failed(&self) -> u64 {
        self.io.failed()
    }

    pub(crate) fn print(&self, a: &ChaosArgs) {
        let secs = self.elapsed.as_secs_f64();
        let row = |k: &str, v: String| println!("{k:<20} {v}");
        println!();
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
                    IdentityMatch::from(a.policy.identity.unwrap_or(IdentityArg::Both))
                ),
            );
        }
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
    }

    pub(crate) fn to_json(&self, a: &ChaosArgs, r: &Resolved) -> String {
        let mut faults = JsonObj::new();
        faults.num("total", self.faults.len() as u64);
        for k in FaultKind::ALL {
            faults.num(k.name(), self.count(k) as u64);
        }
        let log: Vec<String> = self
            .faults
            .iter()
            .map(|f| {
                let mut o = JsonObj::new();
                let opt_ms = |d: Option<Duration>| {
                    d.map_or("null".into(), |d| format!("{:.3}", d.as_secs_f64() * 1e3))
                };
                o.raw("at_s", &format!("{:.3}", f.at.as_secs_f64()))
                    .str("kind", f.kind.name())
                    .raw("down_ms", &opt_ms(Some(f.down)))
                    .raw("to_live_ms", &opt_ms(f.to_live))
                    .raw("ctrl_recovery_ms", &opt_ms(f.ctrl_recovery));
                if f.kind == FaultKind::ReplugOther {
                    o.raw(
                        "foreign_seen",
                        if f.foreign_seen { "true" } else { "false" },
                    )
                    .raw(
                        "through_foreign",
                        if f.through_foreign { "true" } else { "false" },
                    );
                }
                if let Some(e) = &f.error {
                    o.str("error", e);
                }
                o.finish()
            })
            .collect();
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
        let p = &r.policy;
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
            .num("io_timeout_s", r.io_timeout.as_secs());
        let problems: Vec<String> = self.problems.iter().map(|p| wire_quote(p)).collect();
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

pub(crate) fn wire_quote(s: &str) -> String {
    nvmf_rdma::cli::wire_json::quote(s)
}

/// The faults chaos can inflict on a kernel RDMA device: a reset of our context of it (every
/// verbs object dropped as on DEVICE_FATAL, the device opened anew after the down time) and
/// the controller reset a user asks for. Unplugging one is `rdma link delete` (rxe) or a
/// PCI remove, done from outside.
pub(crate) const KERNEL_FAULTS: [FaultKind; 2] = [FaultKind::Reset, FaultKind::UserReset];

/// The faults to inflict: those given, else the default for the target and device
/// (target-restart only where chaos runs the target; a kernel device cannot be unplugged
/// from here).
pub(crate) fn chosen_faults(a: &ChaosArgs) -> Vec<FaultKind> {
    if !a.faults.is_empty() {
        a.faults.clone()
    } else if matches!(a.ext.device, DeviceChoice::Kernel(_)) {
        KERNEL_FAULTS.to_vec()
    } else if a.ext.traddr.is_some() {
        vec![FaultKind::Reset, FaultKind::Replug]
    } else {
        vec![
            FaultKind::Reset,
            FaultKind::Replug,
            FaultKind::TargetRestart,
        ]
    }
}

pub(crate) fn check_chaos_args(a: &ChaosArgs) -> Result<()> {
    let faults = chosen_faults(a);
    if !(a.seconds > 0.0 && a.seconds <= 86_400.0) {
        bail!("--seconds must be more than 0 and at most 86400");
    }
    if a.every < Duration::from_millis(10) {
        bail!("--every must be at least 10ms");
    }
    let interval = interval(a);
    if interval < Duration::from_millis(100) {
        bail!("--interval must be at least 100ms");
    }
    if a.seconds / interval.as_secs_f64() > MAX_SAMPLES {
        bail!(
            "--interval too short for --seconds: at most {MAX_SAMPLES} samples \
             (--interval {}s or longer)",
            (a.seconds / MAX_SAMPLES).ceil()
        );
    }
    if a.down_max > Duration::from_secs(600) {
        bail!("--down-max must be at most 600s");
    }
    if a.ext.traddr.is_some() && a.ext.nqn.is_none() {
        bail!(
            "-a needs -n NQN: the subsystem to test on that target (`discover -a ADDR` lists them)"
        );
    }
    if a.ext.traddr.is_some() && faults.contains(&FaultKind::TargetRestart) {
        bail!("--faults target-restart needs the built-in target (no --traddr)");
    }
    // (clap makes --device need --traddr: the built-in target of chaos is on the soft-HCA.)
    if let DeviceChoice::Kernel(d) = &a.ext.device {
        if let Some(k) = faults.iter().find(|k| !KERNEL_FAULTS.contains(k)) {
            bail!(
                "--faults {}: on kernel RDMA device {d} chaos can inflict reset and user-reset; \
                 unplug it from outside (rxe: `rdma link delete {d}`, then `rdma link add`)",
                k.name()
            );
        }
    }
    if !(16..=1024).contains(&a.queue_size) {
        bail!("--queue-size must be between 16 and 1024");
    }
    if a.nr_io_queues == 0 || a.nr_io_queues > 64 {
        bail!("--nr-io-queues must be between 1 and 64");
    }
    if a.size > 16 << 30 {
        bail!("--size at most 16G (the namespace and the workers' models are in RAM)");
    }
    if (a.size / 512) < a.workers as usize * 8 {
        bail!("--size too small: each worker needs at least 8 blocks of 512 B");
    }
    Ok(())
}

pub(crate) async fn run_chaos(mut a: ChaosArgs) -> Result<()> {
    use rand::{Rng, SeedableRng};
    a.faults = chosen_faults(&a);
    check_chaos_args(&a)?;
    if let Some(p) = &a.plot {
        check_plot_path(p)?;
    }
    let interval = interval(&a);
    let r = a
        .policy
        .resolve(Duration::ZERO, Some(Duration::from_secs(60)));
    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let json = a.output == OutputFormat::Json;
    let fault_names: Vec<&str> = a.faults.iter().map(|f| f.name()).collect();
    let p = &r.policy;
    let header = format!(
        "nvmf-rdma chaos: {} workers on {}, {} I/O queues of {}\n\
         faults {} every {} (HCA down 0..={}), seed {seed}\n\
         policy: reconnect_delay {} s, ctrl_loss_tmo {}, fast_io_fail_tmo {}, replug_window {} s, \
         identity {}, keep-alive {} s, io_timeout {} s",
        a.workers,
        match (a.ext.traddr, &a.ext.nqn) {
            (None, _) => format!(
                "a {} RAM namespace over loopback",
                human_bytes(a.size as u64)
            ),
            (Some(t), n) => format!(
                "{} of namespace 1 of {} at {t}",
                human_bytes(a.size as u64),
                n.as_deref().unwrap_or(chaos::CHAOS_NQN)
            ),
        },
        a.nr_io_queues,
        a.queue_size,
        fault_names.join(","),
        human_dur(a.every),
        human_dur(a.down_max),
        p.reconnect_delay.as_secs(),
        tmo_text(p.ctrl_loss_tmo, "-1 (forever)"),
        tmo_text(p.fast_io_fail_tmo, "off"),
        p.replug_window.as_secs(),
        p.identity,
        p.keep_alive_tmo.as_secs(),
        r.io_timeout.as_secs()
    );
    if json {
        eprintln!("{header}");
    } else {
        println!("{header}");
    }

    let (mut target, mgr, c) = match (a.ext.traddr, &a.ext.device) {
        (Some(traddr), DeviceChoice::Kernel(d)) => {
            let mut o = chaos::host_options(traddr, a.nr_io_queues, a.queue_size, r.policy);
            o.io_timeout = r.io_timeout;
            o.trsvcid = a.ext.trsvcid;
            if let Some(n) = &a.ext.nqn {
                o.subnqn = n.clone();
            }
            let c = connect_kernel(d, o)
                .await
                .with_context(|| format!("the host cannot connect to {traddr} through {d}"))?;
            (None, None, c)
        }
        (None, _) => {
            let target = TargetRig::start(CHAOS_IP, a.size as u64)
                .await
                .context("cannot start the built-in target")?;
            let mgr = DeviceManager::new(true);
            let mut o = chaos::host_options(target.addr, a.nr_io_queues, a.queue_size, r.policy);
            o.io_timeout = r.io_timeout;
            let c = chaos::connect_host(&mgr, CHAOS_IP, o)
                .await
                .context("the host cannot connect to the built-in target")?;
            (Some(target), Some(mgr), c)
        }
        (Some(traddr), DeviceChoice::Soft) => {
            let addr = host_bind_addr(traddr, a.ext.host_traddr)
                .context("no route to the target address")?;
            let mgr = DeviceManager::new(!roce_peer(traddr.ip()));
            let mut cfg = device_config(chaos::HOST_DEV, addr, 1);
            cfg.identity = chaos::host_identity(0);
            mgr.plug(cfg)
                .await
                .with_context(|| format!("cannot start the host soft-HCA on {addr}"))?;
            let mut o = chaos::host_options(traddr, a.nr_io_queues, a.queue_size, r.policy);
            o.io_timeout = r.io_timeout;
            o.trsvcid = a.ext.trsvcid;
            if let Some(n) = &a.ext.nqn {
                o.subnqn = n.clone();
            }
            let c = Controller::connect_managed(mgr.clone(), chaos::HOST_DEV, o)
                .await
                .with_context(|| format!("the host cannot connect to {traddr}"))?;
            (None, Some(mgr), c)
        }
    };
    let c = Arc::new(c);
    let ready = format!("connected; verifying I/O for {} s", a.seconds);
    if json {
        eprintln!("{ready}");
    } else {
        println!("{ready}");
    }
    let ns = c.namespaces()[0];
    // Against an external target, only the first --size bytes of its namespace.
    let blocks = ns.blocks.min(a.size as u64 / ns.block_size as u64);
    let per = blocks / a.workers;
    if per == 0 {
        bail!("the namespace is too small for {} workers", a.workers);
    }
    let max_blocks = (a.max_io as u64 / ns.block_size as u64).clamp(1, per);
    // An I/O may wait as long as the policy lets the controller try, and then some.
    let hang_after = p.ctrl_loss_tmo.unwrap_or(Duration::from_secs(120)) + Duration::from_secs(10);
    let ours = chaos::host_identity(0);
    let other = chaos::host_identity(1);
    let other_is_ours = p.identity.accepts(
        &nvmf_rdma::reconnect::Identity {
            guid: ours.guid,
            pci: ours.pci,
        },
        &nvmf_rdma::reconnect::Identity {
            guid: other.guid,
            pci: other.pci,
        },
    );

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let counters = Arc::new(IoCounters::default());
    let t0 = Instant::now();
    let workers = chaos::Verifiers {
        workers: a.workers,
        blocks: per,
        max_blocks,
        hang_after,
    }
    .spawn_counted(&c, &stop, Some(&counters), |w| {
        (seed ^ (w + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15), None)
    });
    let (end_sampler, ended) = tokio::sync::oneshot::channel();
    let sampler = tokio::spawn(sample(
        counters,
        t0.into(),
        interval,
        a.interval.is_some(),
        ended,
    ));

    let run_for = Duration::from_secs_f64(a.seconds);
    let mut faults = Vec::new();
    let mut next = t0 + a.every;
    // A controller that gave up (ctrl_loss_tmo) ends the run at once: nothing after that
    // can recover, and the workers have stopped.
    let mut status = c.watch_status();
    loop {
        let end = next >= t0 + run_for;
        let wake = if end { t0 + run_for } else { next };
        tokio::select! {
            _ = tokio::time::sleep_until(wake.into()) => {}
            _ = status.wait_for(|s| s.machine.state == CtrlState::Dead) => break,
        }
        if end {
            break;
        }
        if c.state() != CtrlState::Live {
            // Lost (or still recovering from the last fault past its bound): stop.
            break;
        }
        let kind = a.faults[rng.random_range(0..a.faults.len())];
        let down = Duration::from_micros(rng.random_range(0..=a.down_max.as_micros() as u64));
        let at = t0.elapsed();
        let mut f = inflict(
            kind,
            down,
            mgr.as_ref(),
            &c,
            target.as_mut(),
            hang_after,
            other_is_ours,
        )
        .await;
        f.at = at;
        eprintln!("{}", f.describe());
        let bad = f.to_live.is_none();
        faults.push(f);
        if bad {
            break;
        }
        // On schedule, but never before the controller has been live for half an interval:
        // when recoveries take longer than --every the workers still get to run.
        next = (next + a.every).max(Instant::now() + a.every / 2);
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut io = WorkerReport::default();
    for w in workers {
        io.absorb(w.await.context("a worker panicked")?);
    }
    let _ = end_sampler.send(());
    let series = sampler.await.context("the I/O sampler panicked")?;
    let lat: Vec<Duration> = io.lat_ns.iter().map(|&n| Duration::from_nanos(n)).collect();
    let elapsed = t0.elapsed();
    let st = c.status();
    let (final_state, final_health) = Health::from_status(&st);
    let failed_by_reason = io.errors.clone();
    let allowed = allowed_failures(p);
    let unexpected_failures = io
        .errors
        .iter()
        .filter(|(e, _)| !allowed.contains(e))
        .map(|(_, n)| n)
        .sum();
    let mut s = ChaosSummary {
        seed,
        elapsed,
        lat: spread(lat),
        faults,
        recoveries: st.machine.recoveries,
        requeued: c.queue_stats().iter().map(|q| q.requeued).sum(),
        final_state,
        final_health,
        failed_by_reason,
        unexpected_failures,
        problems: Vec::new(),
        io,
        interval,
        series,
    };
    if s.io.mismatches > 0 {
        s.problems.push(format!(
            "{} blocks read back differ from acknowledged writes",
            s.io.mismatches
        ));
    }
    if s.io.hangs > 0 {
        s.problems.push(format!(
            "{} I/Os hung (no answer within {} s)",
            s.io.hangs,
            hang_after.as_secs()
        ));
    }
    if s.unexpected_failures > 0 {
        s.problems.push(format!(
            "{} I/Os failed while within ctrl_loss_tmo",
            s.unexpected_failures
        ));
    }
    let inflict_errors = s.faults.iter().filter(|f| f.error.is_some()).count();
    if inflict_errors > 0 {
        s.problems
            .push(format!("{inflict_errors} faults could not be inflicted"));
    }
    let unrecovered = s.unrecovered() - inflict_errors;
    if unrecovered > 0 || st.state() != CtrlState::Live {
        s.problems.push(format!(
            "the controller did not recover ({}{})",
            s.final_state,
            st.machine
                .fail_reason
                .map_or(String::new(), |r| format!(": {}", r.name()))
        ));
    }
    let used = s.faults.iter().filter(|f| f.through_foreign).count();
    if used > 0 && !other_is_ours {
        s.problems.push(format!(
            "the controller reconnected through a foreign card {used} times"
        ));
    }
    if json {
        println!("{}", s.to_json(&a, &r));
    } else {
        s.print(&a);
    }
    if let Some(path) = &a.plot {
        let title = format!(
            "nvmf-rdma chaos, seed {seed}: {} faults, {}",
            s.faults.len(),
            if s.problems.is_empty() {
                "PASS"
            } else {
                "FAIL"
            }
        );
        write_atomic(
            path,
            plot::svg(&title, &s.faults, &s.series, s.elapsed)?.as_bytes(),
        )?;
        eprintln!("plot: {}", path.display());
    }
    if let Ok(c) = Arc::try_unwrap(c) {
        // Best effort; a controller already dead returns at once.
        let _ = tokio::time::timeout(Duration::from_secs(5), c.disconnect()).await;
    }
    drop(target);
    if !s.problems.is_empty() {
        bail!("chaos: {}", s.problems.join("; "));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sample per interval on the grid from the start, each with the I/Os completed in
    /// it; the last, partial one folded into the one before when under half an interval,
    /// kept when longer.
    #[tokio::test(start_paused = true)]
    async fn the_sampler_takes_one_sample_per_interval_and_folds_a_sliver_at_the_end() {
        for (end_ms, want_ends) in [
            (1100, vec![250, 500, 750, 1100]),
            (1200, vec![250, 500, 750, 1000, 1200]),
        ] {
            let c = Arc::new(IoCounters::default());
            let (tx, rx) = tokio::sync::oneshot::channel();
            let every = Duration::from_millis(250);
            let t0 = tokio::time::Instant::now();
            let h = tokio::spawn(sample(c.clone(), t0, every, false, rx));
            // One I/O every 10 ms of 1 ms latency, and one slow one at 600 ms.
            let mut t = Duration::ZERO;
            while t < Duration::from_millis(end_ms) {
                t += Duration::from_millis(10);
                tokio::time::sleep_until(t0 + t).await;
                let lat = if t == Duration::from_millis(600) {
                    40
                } else {
                    1
                };
                c.record(4096, Duration::from_millis(lat));
            }
            tx.send(()).unwrap();
            let v = h.await.unwrap();
            let ends: Vec<u64> = v.iter().map(|s| s.at.as_millis() as u64).collect();
            assert_eq!(ends, want_ends);
            assert_eq!(v.iter().map(|s| s.io.ios).sum::<u64>(), end_ms / 10);
            assert!((v[0].iops() - 100.0).abs() < 5.0, "{:?}", v[0]);
            assert_eq!(v[2].lat_max(), Some(Duration::from_millis(40)));
            // The max is the interval's own: zeroed by each sample.
            assert_eq!(v[1].lat_max(), Some(Duration::from_millis(1)));
            assert_eq!(v[3].lat_max(), Some(Duration::from_millis(1)));
            assert!(v.iter().all(|s| s.len >= every / 2));
        }
    }
}

//! A chaos run: a host (on the soft-HCA or a kernel RDMA device) against the built-in target
//! or another one, verifying workers, and faults at random on a schedule until the time is
//! up or the controller is lost. The `chaos` command parses flags into a [`ChaosConfig`] and
//! prints what [`run`] reports.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rand::{Rng, SeedableRng};

use crate::cli::device::{connect_kernel_with_faults, DeviceChoice};
use crate::cli::support::{host_bind_addr, roce_peer, soft_device_config, Health};
use crate::driver::DeviceManager;
use crate::harness::chaos::config::{ChaosConfig, FaultKind, CHAOS_IP};
use crate::harness::chaos::report::{spread, ChaosSummary, FaultOutcome, Sample};
use crate::harness::chaos::{self, IoCounters, TargetRig, WorkerReport};
use crate::reconnect::{CtrlState, Identity, Policy};
use crate::transport::{Controller, NsInfo};
use crate::verbs::DeviceFaults;

/// What a run tells as it goes.
pub enum Progress<'a> {
    /// Connected; the workers start.
    Connected,
    /// A fault was inflicted and its outcome is known.
    Fault(&'a FaultOutcome),
    /// An interval's I/O.
    Sample(&'a Sample),
}

/// Where a run's [`Progress`] goes.
pub type OnProgress = Arc<dyn Fn(Progress<'_>) + Send + Sync>;

/// Take a [`Sample`] from `counters` at the end of every `every` from `t0` until `end`
/// fires; then the last, partial one (folded into the one before when shorter than half an
/// interval, so that a sliver of time does not read as a rate), each told to `progress`.
pub async fn sample(
    counters: Arc<IoCounters>,
    t0: tokio::time::Instant,
    every: Duration,
    progress: OnProgress,
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
                progress(Progress::Sample(&s));
                v.push(s);
            }
        }
        if ended {
            return v;
        }
    }
}

/// Run `a`: connect, start the workers, inflict a fault every `a.every` until the time is
/// up or the controller is lost, then stop the workers and judge. `Err` only when the run
/// could not start; what went wrong during it is in the summary's `problems`.
pub async fn run(a: &ChaosConfig, progress: OnProgress) -> Result<ChaosSummary> {
    let (mut target, faults, c) = connect(a).await?;
    let c = Arc::new(c);
    progress(Progress::Connected);
    let p = &a.policy;
    let verifiers = verifiers(a, &c.namespaces()[0])?;
    let hang_after = verifiers.hang_after;
    let other_is_ours = other_device_is_ours(p);

    let stop = Arc::new(AtomicBool::new(false));
    let counters = Arc::new(IoCounters::default());
    let t0 = Instant::now();
    let seed = a.seed;
    let workers = verifiers.spawn_counted(&c, &stop, Some(&counters), |w| {
        (seed ^ (w + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15), None)
    });
    let (end_sampler, ended) = tokio::sync::oneshot::channel();
    let interval = a.sample_interval();
    let sampler = tokio::spawn(sample(
        counters,
        t0.into(),
        interval,
        progress.clone(),
        ended,
    ));
    let run = FaultRun {
        faults: &faults,
        c: &c,
        hang_after,
        other_is_ours,
        t0,
    };
    let faults = run.faults(a, target.as_mut(), &progress).await;
    stop.store(true, Ordering::Relaxed);
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
    s.problems = judge(
        &s,
        st.state(),
        st.machine.fail_reason,
        hang_after,
        other_is_ours,
    );
    if let Ok(c) = Arc::try_unwrap(c) {
        // Best effort; a controller already dead returns at once.
        let _ = tokio::time::timeout(Duration::from_secs(5), c.disconnect()).await;
    }
    drop(target);
    Ok(s)
}

/// The verifying workers `a` asks for, each over its own share of namespace `ns`.
fn verifiers(a: &ChaosConfig, ns: &NsInfo) -> Result<chaos::Verifiers> {
    // Against an external target, only the first --size bytes of its namespace.
    let blocks = ns.blocks.min(a.size as u64 / ns.block_size as u64);
    let per = blocks / a.workers;
    if per == 0 {
        bail!("the namespace is too small for {} workers", a.workers);
    }
    Ok(chaos::Verifiers {
        workers: a.workers,
        blocks: per,
        max_blocks: (a.max_io as u64 / ns.block_size as u64).clamp(1, per),
        // An I/O may wait as long as the policy lets the controller try, and then some.
        hang_after: a.policy.ctrl_loss_tmo.unwrap_or(Duration::from_secs(120))
            + Duration::from_secs(10),
    })
}

/// Does policy `p` take another card in the host's slot (other GUID and PCI address) for the
/// host's own?
fn other_device_is_ours(p: &Policy) -> bool {
    let [ours, other] = [0, 1].map(|v| {
        let id = chaos::host_identity(v);
        Identity {
            guid: id.guid,
            pci: id.pci,
        }
    });
    p.identity.accepts(&ours, &other)
}

/// The host's controller, on the device and against the target `a` names; the built-in
/// target when the run has one, and how to inflict faults on the host's device.
async fn connect(a: &ChaosConfig) -> Result<(Option<TargetRig>, HostFaults, Controller)> {
    let options = |traddr| {
        let mut o = chaos::host_options(traddr, a.nr_io_queues, a.queue_size, a.policy);
        o.io_timeout = a.io_timeout;
        o
    };
    let external = |traddr| {
        let mut o = options(traddr);
        o.trsvcid = a.trsvcid;
        if let Some(n) = &a.nqn {
            o.subnqn = n.clone();
        }
        o
    };
    Ok(match (a.traddr, &a.device) {
        (Some(traddr), DeviceChoice::Kernel(d)) => {
            let (c, faults) = connect_kernel_with_faults(d, external(traddr))
                .await
                .with_context(|| format!("the host cannot connect to {traddr} through {d}"))?;
            (None, HostFaults::Kernel(faults), c)
        }
        (None, _) => {
            let target = TargetRig::start(CHAOS_IP, a.size as u64)
                .await
                .context("cannot start the built-in target")?;
            let mgr = DeviceManager::new(true);
            let c = chaos::connect_host(&mgr, CHAOS_IP, options(target.addr))
                .await
                .context("the host cannot connect to the built-in target")?;
            (Some(target), HostFaults::Soft(mgr), c)
        }
        (Some(traddr), DeviceChoice::Soft) => {
            let addr =
                host_bind_addr(traddr, a.host_traddr).context("no route to the target address")?;
            let mgr = DeviceManager::new(!roce_peer(traddr.ip()));
            let mut cfg = soft_device_config(chaos::HOST_DEV, addr, 1);
            cfg.identity = chaos::host_identity(0);
            mgr.plug(cfg)
                .await
                .with_context(|| format!("cannot start the host soft-HCA on {addr}"))?;
            let c = Controller::connect_managed(mgr.clone(), chaos::HOST_DEV, external(traddr))
                .await
                .with_context(|| format!("the host cannot connect to {traddr}"))?;
            (None, HostFaults::Soft(mgr), c)
        }
    })
}

/// How chaos reaches the host's device.
pub enum HostFaults {
    /// The soft-HCA's device manager: every fault.
    Soft(DeviceManager),
    /// A kernel RDMA device, behind a fault injector: the faults of [`KERNEL_FAULTS`].
    ///
    /// [`KERNEL_FAULTS`]: crate::harness::chaos::config::KERNEL_FAULTS
    Kernel(DeviceFaults),
}

/// What the fault schedule works on.
struct FaultRun<'a> {
    faults: &'a HostFaults,
    c: &'a Controller,
    /// How long a fault may take to recover before the run counts it lost.
    hang_after: Duration,
    other_is_ours: bool,
    t0: Instant,
}

impl FaultRun<'_> {
    /// Inflict faults on schedule until the run's time is up, the controller is not live
    /// when the next is due, or one is not recovered; their outcomes.
    async fn faults(
        &self,
        a: &ChaosConfig,
        mut target: Option<&mut TargetRig>,
        progress: &OnProgress,
    ) -> Vec<FaultOutcome> {
        let (c, t0) = (self.c, self.t0);
        let mut rng = rand::rngs::SmallRng::seed_from_u64(a.seed);
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
                self.faults,
                c,
                target.as_deref_mut(),
                self.hang_after,
                self.other_is_ours,
            )
            .await;
            f.at = at;
            progress(Progress::Fault(&f));
            let bad = f.to_live.is_none();
            faults.push(f);
            if bad {
                break;
            }
            // On schedule, but never before the controller has been live for half an
            // interval: when recoveries take longer than --every the workers still get to run.
            next = (next + a.every).max(Instant::now() + a.every / 2);
        }
        faults
    }
}

/// What went wrong in the run `s` summarises, ending with the controller in `state`
/// (`fail_reason` if it gave up): each a line of the verdict; none is a pass.
fn judge(
    s: &ChaosSummary,
    state: CtrlState,
    fail_reason: Option<crate::reconnect::FailReason>,
    hang_after: Duration,
    other_is_ours: bool,
) -> Vec<String> {
    let mut problems = Vec::new();
    if s.io.mismatches > 0 {
        problems.push(format!(
            "{} blocks read back differ from acknowledged writes",
            s.io.mismatches
        ));
    }
    if s.io.hangs > 0 {
        problems.push(format!(
            "{} I/Os hung (no answer within {} s)",
            s.io.hangs,
            hang_after.as_secs()
        ));
    }
    if s.unexpected_failures > 0 {
        problems.push(format!(
            "{} I/Os failed while within ctrl_loss_tmo",
            s.unexpected_failures
        ));
    }
    let inflict_errors = s.faults.iter().filter(|f| f.error.is_some()).count();
    if inflict_errors > 0 {
        problems.push(format!("{inflict_errors} faults could not be inflicted"));
    }
    let unrecovered = s.unrecovered() - inflict_errors;
    if unrecovered > 0 || state != CtrlState::Live {
        problems.push(format!(
            "the controller did not recover ({}{})",
            s.final_state,
            fail_reason.map_or(String::new(), |r| format!(": {}", r.name()))
        ));
    }
    let used = s.faults.iter().filter(|f| f.through_foreign).count();
    if used > 0 && !other_is_ours {
        problems.push(format!(
            "the controller reconnected through a foreign card {used} times"
        ));
    }
    problems
}

/// Inflict `kind` through `faults` and wait until the controller is LIVE again (or gives up,
/// or `bound`). On a kernel RDMA device only the faults of [`KERNEL_FAULTS`] can be inflicted.
///
/// [`KERNEL_FAULTS`]: crate::harness::chaos::config::KERNEL_FAULTS
pub async fn inflict(
    kind: FaultKind,
    down: Duration,
    faults: &HostFaults,
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
        let mgr = match faults {
            HostFaults::Soft(mgr) => mgr,
            HostFaults::Kernel(dev) => {
                return match kind {
                    // The device source drops the context as on DEVICE_FATAL and opens it anew.
                    FaultKind::Reset => dev.reset(down).await.map_err(anyhow::Error::msg),
                    FaultKind::UserReset => {
                        c.reset();
                        Ok(())
                    }
                    k => bail!("--faults {} needs the soft-HCA", k.name()),
                };
            }
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
pub fn allowed_failures(p: &Policy) -> Vec<String> {
    use crate::reconnect::FailReason;
    use crate::transport::HostError;
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
            let h = tokio::spawn(sample(c.clone(), t0, every, Arc::new(|_| {}), rx));
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

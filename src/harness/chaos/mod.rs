//! Chaos: verified I/O against the built-in target while the soft-HCA is reset, unplugged and
//! re-plugged (same or other identity), the target restarted or frozen. Used by the `chaos`
//! command ([`run`], configured by [`config`], reported by [`report`] and [`plot`]), the
//! recovery tests, the seed sweeps and the recovery benchmark. Host and target run on UDP
//! sockets or on a simulated network ([`crate::driver::SimNet`]), as the [`Fabric`] they are
//! given says.
//!
//! Verification: each worker owns a range of blocks and a model of it. A write that was
//! acknowledged updates the model; every read must match the model block for block. A write
//! that failed leaves its blocks unknown (old or new data) until they are written again.

pub mod args;
pub mod config;
pub mod plot;
pub mod report;
pub mod run;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::driver::{CmService, DeviceManager, Fabric, SoftHca};
use crate::hca::device::{DeviceConfig, DeviceIdentity, IcrcCheck};
use crate::nvme::Nqn;
use crate::nvmet::{serve_cm, Namespace, Subsystem, Target, TargetConfig};
use crate::reconnect::{CtrlState, Policy};
use crate::transport::{ConnectOptions, Controller, CtrlStatus, HostError};
use crate::verbs::PciAddr;

pub const CHAOS_NQN: &str = "nqn.2026-11.io.nvmf-rdma:chaos";
/// The host device's slot name in the device manager.
pub const HOST_DEV: &str = "host0";

/// A built-in RAM target on the current runtime, restartable on the same address with the
/// same namespace (its data survives a restart, as a disk's would).
pub struct TargetRig {
    pub addr: SocketAddr,
    pub ns: Arc<Namespace>,
    pub target: Target<SoftHca>,
    hca: SoftHca,
    generation: u64,
    fabric: Fabric,
}

fn target_config(addr: SocketAddr, generation: u64) -> DeviceConfig {
    DeviceConfig {
        identity: DeviceIdentity::from_mac(
            "tgt0",
            [0x52, 0x54, 0, 0x30, 0, 1],
            PciAddr::new(0, 0x30, 1, 0),
        ),
        addr,
        icrc: IcrcCheck::Verify,
        peer_port: None,
        seed: 0x7A46E7 + generation,
    }
}

impl TargetRig {
    /// Start on `ip` (port 0 picks one) with a RAM namespace of `bytes`, 512-byte blocks.
    pub async fn start(ip: [u8; 4], bytes: u64) -> anyhow::Result<TargetRig> {
        Self::start_on(&Fabric::UDP, ip, bytes).await
    }

    /// [`TargetRig::start`] on `fabric` (UDP, or a simulated network).
    pub async fn start_on(fabric: &Fabric, ip: [u8; 4], bytes: u64) -> anyhow::Result<TargetRig> {
        let ns = Arc::new(Namespace::ram(1, bytes, 9));
        Self::start_with(fabric, SocketAddr::from((ip, 0)), ns, 0).await
    }

    async fn start_with(
        fabric: &Fabric,
        addr: SocketAddr,
        ns: Arc<Namespace>,
        generation: u64,
    ) -> anyhow::Result<TargetRig> {
        let hca = SoftHca::start_on(target_config(addr, generation), fabric).await?;
        let cfg = TargetConfig {
            subsystems: vec![Subsystem::new(Nqn::new(CHAOS_NQN)?, vec![ns.clone()])],
            ..TargetConfig::default()
        };
        let target = Target::start(hca.clone(), cfg)?;
        serve_cm(target.clone(), CmService::for_device(&hca))?;
        Ok(TargetRig {
            addr: hca.addr(),
            ns,
            target,
            hca,
            generation,
            fabric: fabric.clone(),
        })
    }

    /// Kill the target's device and start a new target on the same address and namespace.
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.restart_after(Duration::ZERO).await
    }

    /// [`TargetRig::restart`] with the target away for `down` in between: nothing answers
    /// on its address meanwhile.
    pub async fn restart_after(&mut self, down: Duration) -> anyhow::Result<()> {
        self.hca.fatal();
        self.hca.stopped().await;
        if !down.is_zero() {
            tokio::time::sleep(down).await;
        }
        let next = Self::start_with(
            &self.fabric,
            self.addr,
            self.ns.clone(),
            self.generation + 1,
        )
        .await?;
        *self = next;
        Ok(())
    }

    pub fn hca(&self) -> &SoftHca {
        &self.hca
    }
}

impl Drop for TargetRig {
    fn drop(&mut self) {
        self.hca.fatal();
    }
}

/// The host's device as plugged in the device manager.
pub fn host_config(ip: [u8; 4]) -> DeviceConfig {
    DeviceConfig {
        identity: host_identity(0),
        addr: SocketAddr::from((ip, 0)),
        icrc: IcrcCheck::Verify,
        peer_port: None,
        seed: 0x4057,
    }
}

/// The host card (`variant` 0), or another card in its slot (other GUID and PCI address).
pub fn host_identity(variant: u8) -> DeviceIdentity {
    DeviceIdentity::from_mac(
        HOST_DEV,
        [0x52, 0x54, 0, 0x31, variant, 1],
        PciAddr::new(0, 0x31 + variant, 0, 0),
    )
}

/// Host options for chaos: reconnect at once, the rest from `policy`.
pub fn host_options(
    target: SocketAddr,
    queues: usize,
    qsize: usize,
    policy: Policy,
) -> ConnectOptions {
    let mut o = ConnectOptions::new(target, CHAOS_NQN);
    o.nr_io_queues = queues;
    o.queue_size = qsize;
    o.connect_timeout = Duration::from_secs(2);
    o.keep_alive_tmo = policy.keep_alive_tmo;
    o.policy = policy;
    o
}

/// A host device in a device manager plus a controller through it.
pub async fn connect_host(
    mgr: &DeviceManager,
    ip: [u8; 4],
    o: ConnectOptions,
) -> anyhow::Result<Controller> {
    plug_and_connect(mgr, host_config(ip), o).await
}

/// [`connect_host`] for seed `seed` of a sweep, on a card of its own (its MAC from the
/// seed) in the host's slot: each seed's host is a new machine to a target that may still
/// hold an earlier seed's connections.
pub async fn connect_seeded_host(
    mgr: &DeviceManager,
    ip: [u8; 4],
    seed: u64,
    o: ConnectOptions,
) -> anyhow::Result<Controller> {
    let mut cfg = host_config(ip);
    let b = seed.to_be_bytes();
    cfg.identity = DeviceIdentity::from_mac(
        HOST_DEV,
        [0x52, 0x55, b[4], b[5], b[6], b[7]],
        PciAddr::new(0, 0x31, 0, 0),
    );
    plug_and_connect(mgr, cfg, o).await
}

async fn plug_and_connect(
    mgr: &DeviceManager,
    cfg: DeviceConfig,
    o: ConnectOptions,
) -> anyhow::Result<Controller> {
    mgr.plug(cfg).await?;
    Ok(Controller::connect_managed(mgr.clone(), HOST_DEV, o).await?)
}

/// One thing chaos does to the system.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Fatal reset of the host HCA; it comes back after the delay.
    Reset { down: Duration },
    /// Hot-remove the host HCA and plug the same card back after the delay.
    Replug { down: Duration },
    /// Restart the target (its device dies; a new one comes up on the same address).
    TargetRestart,
    /// The controller reset the user asks for.
    UserReset,
    /// A storm: host HCA resets every 20-50 ms (gaps drawn from `seed`) for `lasting`,
    /// whether or not the controller is live again in between.
    Storm { lasting: Duration, seed: u64 },
}

impl Fault {
    pub fn name(&self) -> &'static str {
        match self {
            Fault::Reset { .. } => "reset",
            Fault::Replug { .. } => "unplug+replug",
            Fault::TargetRestart => "target restart",
            Fault::UserReset => "controller reset",
            Fault::Storm { .. } => "reset storm",
        }
    }

    /// A random fault; `down` bounds how long the device stays away.
    pub fn random(rng: &mut impl Rng, down: Duration) -> Fault {
        let d = Duration::from_micros(rng.random_range(0..=down.as_micros() as u64));
        match rng.random_range(0..12) {
            0..=4 => Fault::Reset { down: d },
            5..=6 => Fault::Replug { down: d },
            7..=8 => Fault::UserReset,
            9..=10 => Fault::TargetRestart,
            _ => Fault::Storm {
                lasting: Duration::from_millis(rng.random_range(200..=800)),
                seed: rng.random(),
            },
        }
    }

    /// Do it. `target` is the built-in target, if the run has one (a target restart needs it).
    pub async fn inflict(
        &self,
        mgr: &DeviceManager,
        ctrl: &Controller,
        target: Option<&mut TargetRig>,
    ) -> anyhow::Result<()> {
        match *self {
            Fault::Reset { down } => {
                mgr.reset(HOST_DEV, down).await?;
            }
            Fault::Replug { down } => {
                // The same card goes back in: whatever identity is plugged now.
                let id = mgr
                    .open(HOST_DEV)
                    .map(|(h, _)| h.with_quiet(|d, _| d.identity().clone()))
                    .unwrap_or_else(|| host_identity(0));
                mgr.unplug(HOST_DEV).await?;
                if !down.is_zero() {
                    tokio::time::sleep(down).await;
                }
                mgr.replug(id).await?;
            }
            Fault::TargetRestart => match target {
                Some(t) => t.restart().await?,
                None => anyhow::bail!("no built-in target to restart"),
            },
            Fault::UserReset => ctrl.reset(),
            Fault::Storm { lasting, seed } => {
                let mut rng = SmallRng::seed_from_u64(seed);
                let t0 = tokio::time::Instant::now();
                while t0.elapsed() < lasting {
                    mgr.reset(HOST_DEV, Duration::ZERO).await?;
                    tokio::time::sleep(Duration::from_millis(rng.random_range(20..=50))).await;
                }
            }
        }
        Ok(())
    }
}

/// What a verifying worker saw.
#[derive(Debug, Clone, Default)]
pub struct WorkerReport {
    pub writes: u64,
    pub reads: u64,
    pub bytes_verified: u64,
    /// Reads that did not match acknowledged data: lost or corrupted writes.
    pub mismatches: u64,
    /// Failed I/Os, counted by reason (a map, not a list: a worker that meets a dead
    /// controller must not grow without bound).
    pub errors: BTreeMap<String, u64>,
    /// Requests that did not complete within the hang bound.
    pub hangs: u64,
    /// Latency of every I/O, nanoseconds.
    pub lat_ns: Vec<u64>,
}

impl WorkerReport {
    /// Failed I/Os, all reasons.
    pub fn failed(&self) -> u64 {
        self.errors.values().sum()
    }

    fn fail(&mut self, e: &HostError) {
        *self.errors.entry(error_kind(e)).or_insert(0) += 1;
    }

    /// Add another worker's report to this one.
    pub fn absorb(&mut self, r: WorkerReport) {
        self.writes += r.writes;
        self.reads += r.reads;
        self.bytes_verified += r.bytes_verified;
        self.mismatches += r.mismatches;
        self.hangs += r.hangs;
        for (k, n) in r.errors {
            *self.errors.entry(k).or_insert(0) += n;
        }
        self.lat_ns.extend(r.lat_ns);
    }
}

/// I/Os completed since the last [`IoCounters::take`], shared by the workers that update
/// them and the sampler that reads them: a run's I/O rate and latency over time.
#[derive(Debug, Default)]
pub struct IoCounters {
    ios: AtomicU64,
    bytes: AtomicU64,
    lat_sum_ns: AtomicU64,
    lat_max_ns: AtomicU64,
}

/// What [`IoCounters::take`] read: the I/Os completed in one interval.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IoSample {
    pub ios: u64,
    pub bytes: u64,
    pub lat_sum_ns: u64,
    pub lat_max_ns: u64,
}

impl IoCounters {
    /// One I/O of `bytes` completed after `lat`.
    pub fn record(&self, bytes: u64, lat: Duration) {
        let ns = lat.as_nanos().min(u64::MAX as u128) as u64;
        self.ios.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        self.lat_sum_ns.fetch_add(ns, Ordering::Relaxed);
        self.lat_max_ns.fetch_max(ns, Ordering::Relaxed);
    }

    /// The counts since the last take, and zero them. The fields are read one by one: an
    /// I/O recorded meanwhile may land half in this interval and half in the next, which
    /// moves one I/O between neighbouring samples and loses none.
    pub fn take(&self) -> IoSample {
        IoSample {
            ios: self.ios.swap(0, Ordering::Relaxed),
            bytes: self.bytes.swap(0, Ordering::Relaxed),
            lat_sum_ns: self.lat_sum_ns.swap(0, Ordering::Relaxed),
            lat_max_ns: self.lat_max_ns.swap(0, Ordering::Relaxed),
        }
    }
}

/// A worker's range: `blocks` blocks from `first`.
#[derive(Debug, Clone, Copy)]
pub struct Region {
    pub first: u64,
    pub blocks: u64,
}

/// Verify workers side by side on namespace 1: worker `w` of `workers` gets `blocks`
/// blocks from `w * blocks`, I/Os of up to `max_blocks`, and `hang_after` (see
/// [`verify_worker`]).
#[derive(Debug, Clone, Copy)]
pub struct Verifiers {
    pub workers: u64,
    pub blocks: u64,
    pub max_blocks: u64,
    pub hang_after: Duration,
}

impl Verifiers {
    /// Spawn them on the current runtime, in order; `seed_ops(w)` gives worker `w`'s seed
    /// and how many I/Os it does (`None`: until `stop`).
    pub fn spawn(
        &self,
        ctrl: &Arc<Controller>,
        stop: &Arc<AtomicBool>,
        seed_ops: impl FnMut(u64) -> (u64, Option<u64>),
    ) -> Vec<tokio::task::JoinHandle<WorkerReport>> {
        self.spawn_counted(ctrl, stop, None, seed_ops)
    }

    /// [`Verifiers::spawn`], each completed I/O also recorded in `counters` (the same I/Os
    /// in the same order: counting draws nothing from the workers' seeds).
    pub fn spawn_counted(
        &self,
        ctrl: &Arc<Controller>,
        stop: &Arc<AtomicBool>,
        counters: Option<&Arc<IoCounters>>,
        mut seed_ops: impl FnMut(u64) -> (u64, Option<u64>),
    ) -> Vec<tokio::task::JoinHandle<WorkerReport>> {
        (0..self.workers)
            .map(|w| {
                let (seed, ops) = seed_ops(w);
                tokio::spawn(verify_worker(
                    ctrl.clone(),
                    Region {
                        first: w * self.blocks,
                        blocks: self.blocks,
                    },
                    seed,
                    self.max_blocks,
                    ops,
                    stop.clone(),
                    self.hang_after,
                    counters.cloned(),
                ))
            })
            .collect()
    }

    /// The recovery seed sweeps' I/O, on sockets (tests/reconnect_sweep.rs) and on the
    /// simulator alike: two workers of 512 blocks, each doing 20-60 verified I/Os of up to
    /// 32 blocks, the counts drawn from `rng`.
    pub fn spawn_sweep(
        ctrl: &Arc<Controller>,
        stop: &Arc<AtomicBool>,
        seed: u64,
        rng: &mut impl Rng,
        hang_after: Duration,
    ) -> Vec<tokio::task::JoinHandle<WorkerReport>> {
        Verifiers {
            workers: 2,
            blocks: 512,
            max_blocks: 32,
            hang_after,
        }
        .spawn(ctrl, stop, |w| {
            let ops = rng.random_range(20..60);
            (seed.wrapping_mul(31).wrapping_add(w), Some(ops))
        })
    }
}

/// Verified random I/O on `region` until `stop`, or `ops` operations if given. Each I/O
/// must finish within `hang_after` (ctrl_loss_tmo plus a margin), or it counts as a hang.
/// Each I/O that completes is recorded in `counters`, if given.
#[allow(clippy::too_many_arguments)]
pub async fn verify_worker(
    ctrl: Arc<Controller>,
    region: Region,
    seed: u64,
    max_blocks: u64,
    ops: Option<u64>,
    stop: Arc<AtomicBool>,
    hang_after: Duration,
    counters: Option<Arc<IoCounters>>,
) -> WorkerReport {
    let mut rng = SmallRng::seed_from_u64(seed);
    let bs = ctrl.namespaces()[0].block_size as usize;
    let mut model = vec![0u8; region.blocks as usize * bs];
    // Blocks whose content is known (read at the start, or written and acknowledged).
    let mut known = vec![false; region.blocks as usize];
    let chunk = (ctrl.max_transfer() / bs).max(1);
    let mut b = 0usize;
    while b < known.len() {
        let nb = chunk.min(known.len() - b);
        let lba = region.first + b as u64;
        if let Ok(Ok(d)) = tokio::time::timeout(hang_after, ctrl.read(1, lba, nb * bs)).await {
            model[b * bs..(b + nb) * bs].copy_from_slice(&d);
            known[b..b + nb].fill(true);
        }
        b += nb;
    }
    let mut r = WorkerReport::default();
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) && ops.is_none_or(|o| n < o) {
        n += 1;
        let nb = rng.random_range(1..=max_blocks.min(region.blocks));
        let off = rng.random_range(0..=region.blocks - nb);
        let lba = region.first + off;
        let range = off as usize * bs..(off + nb) as usize * bs;
        // Tokio's clock: virtual time on a simulated network.
        let t0 = tokio::time::Instant::now();
        let mut done = false;
        if rng.random_bool(0.5) {
            let mut data = vec![0u8; range.len()];
            rng.fill(&mut data[..]);
            match tokio::time::timeout(hang_after, ctrl.write(1, lba, &data)).await {
                Ok(Ok(())) => {
                    model[range.clone()].copy_from_slice(&data);
                    known[off as usize..(off + nb) as usize].fill(true);
                    r.writes += 1;
                    done = true;
                }
                Ok(Err(e)) => {
                    known[off as usize..(off + nb) as usize].fill(false);
                    r.fail(&e);
                }
                Err(_) => {
                    known[off as usize..(off + nb) as usize].fill(false);
                    r.hangs += 1;
                }
            }
        } else {
            match tokio::time::timeout(hang_after, ctrl.read(1, lba, range.len())).await {
                Ok(Ok(got)) => {
                    r.reads += 1;
                    done = true;
                    for b in 0..nb as usize {
                        if !known[off as usize + b] {
                            continue;
                        }
                        let m = &model[range.start + b * bs..range.start + (b + 1) * bs];
                        if &got[b * bs..(b + 1) * bs] != m {
                            r.mismatches += 1;
                        } else {
                            r.bytes_verified += bs as u64;
                        }
                    }
                }
                Ok(Err(e)) => r.fail(&e),
                Err(_) => r.hangs += 1,
            }
        }
        let lat = t0.elapsed();
        r.lat_ns.push(lat.as_nanos() as u64);
        if let (true, Some(c)) = (done, &counters) {
            c.record(range.len() as u64, lat);
        }
        if ctrl.state() == CtrlState::Dead {
            // Given up for good: every further I/O would fail at once, and spinning on
            // them only burns the CPU the rest of the run needs.
            break;
        }
    }
    r
}

/// The end of a storm test: join the workers (each within `bound`), then hold the run to
/// what recovery promises: no acknowledged write lost, no hang, no failure (the storm stays
/// within ctrl_loss_tmo), no stray or double completion, every submitted command accounted
/// for, and the controller live again within 10 s without having given up. The workers'
/// merged report and the final status, or what broke the promise.
pub async fn judge_storm(
    ctrl: &Controller,
    workers: Vec<tokio::task::JoinHandle<WorkerReport>>,
    bound: Duration,
) -> Result<(WorkerReport, CtrlStatus), String> {
    let mut all = WorkerReport::default();
    for w in workers {
        let r = tokio::time::timeout(bound, w)
            .await
            .map_err(|_| "a worker hung past ctrl_loss_tmo".to_string())?
            .map_err(|e| format!("worker panicked: {e}"))?;
        all.absorb(r);
    }
    if all.mismatches > 0 {
        return Err(format!(
            "{} reads did not match acknowledged writes",
            all.mismatches
        ));
    }
    if all.hangs > 0 {
        return Err(format!("{} I/Os hung", all.hangs));
    }
    if !all.errors.is_empty() {
        return Err(format!("I/O failed within ctrl_loss_tmo: {:?}", all.errors));
    }
    // A storm may have just ended: recovery gets its time, bounded well below "forever".
    let st = ctrl
        .wait_status(Duration::from_secs(10), |s| s.state() == CtrlState::Live)
        .await
        .map_err(|e| format!("controller not live at the end: {e}"))?;
    // The controller's own commands after a reconnect (its namespace rescan) may still be
    // in flight on the admin queue: they get a bounded time to end.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let stats = ctrl.queue_stats();
        for s in &stats {
            if s.duplicate_completion != 0 || s.unknown_cid != 0 {
                return Err(format!("stray or double completion: {s:?}"));
            }
        }
        match stats.iter().find(|s| s.submitted != s.completed + s.failed) {
            None => break,
            Some(s) if tokio::time::Instant::now() >= deadline => {
                return Err(format!("submitted != completed + failed: {s:?}"));
            }
            Some(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
    if st.machine.fail_reason.is_some() {
        return Err(format!("the controller gave up: {st:?}"));
    }
    Ok((all, st))
}

/// A short, stable name for an error, for summaries.
pub fn error_kind(e: &HostError) -> String {
    match e {
        HostError::Path(why) => format!("host path error ({})", why.name()),
        HostError::Nvme(n) => format!("nvme status: {n}"),
        HostError::Transport(_) => "transport error".into(),
        HostError::Connect(_) => "connect error".into(),
        HostError::Protocol(_) => "protocol error".into(),
        HostError::Invalid(_) => "invalid request".into(),
        HostError::Gone(_) => "controller gone".into(),
        HostError::NamespaceGone(_) => "namespace gone".into(),
        HostError::Timeout(_) => "timeout".into(),
        HostError::Step(_) => "reconnect step".into(),
    }
}

/// Percentile of sorted values, by nearest rank: the smallest value that at least `p` of
/// them do not exceed (the 99th of 100 for p99, not the largest).
pub fn pct(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = (sorted.len() as f64 * p.clamp(0.0, 1.0)).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

#[cfg(test)]
mod tests {
    use super::pct;

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(pct(&v, 0.99), 99, "p99 of 100 is the 99th, not the largest");
        assert_eq!(pct(&v, 0.50), 50);
        assert_eq!(pct(&v, 1.0), 100);
        assert_eq!(pct(&v, 0.0), 1);
        assert_eq!(pct(&[7], 0.99), 7);
        assert_eq!(pct(&[], 0.5), 0);
        let v: Vec<u64> = (1..=1000).collect();
        assert_eq!(pct(&v, 0.99), 990);
    }
}

//! NVMe-oF workloads over loopback for the demo, the `bench` subcommand and `cargo bench`:
//! the built-in target (RAM namespace) on one soft-HCA and thread, the host on another.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant as StdInstant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::cli::args::{Fabric, PolicyArgs, Queues, Subsys};
use crate::cli::device::DeviceChoice;
use crate::daemon::io::{verify, Progress};
use crate::driver::{CmService, SoftHca};
use crate::hca::device::{DeviceConfig, DeviceIdentity, IcrcCheck};
use crate::nvme::Nqn;
use crate::nvmet::{serve_cm, serve_cm_on, Namespace, Subsystem, Target, TargetConfig};
use crate::transport::{ConnectOptions, Controller, HostError};
use crate::verbs::{DeviceFaults, FaultInjector, PciAddr};

pub const DEMO_NQN: &str = "nqn.2026-11.io.nvmf-rdma:demo";

fn dev_config(name: &str, i: u8, ip: [u8; 4]) -> DeviceConfig {
    DeviceConfig {
        identity: DeviceIdentity::from_mac(
            name,
            [0x52, 0x54, 0, 0x20, 0, i],
            PciAddr::new(0, 0x20, i, 0),
        ),
        addr: SocketAddr::from((ip, 0)),
        icrc: IcrcCheck::Verify,
        peer_port: None,
        seed: 0xC0FFEE + i as u64,
    }
}

/// A built-in target with one RAM namespace, running on its own thread and runtime.
pub struct LocalTarget {
    /// Where its first port is reached.
    pub addr: SocketAddr,
    /// Where each of its ports is reached, the first one first.
    pub addrs: Vec<SocketAddr>,
    /// Each port's ID, in the same order (for [`Target::freeze_port`] and ANA states).
    pub port_ids: Vec<u16>,
    pub target: Target<SoftHca>,
    /// The soft-HCAs of its ports after the first.
    more_ports: Vec<SoftHca>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl LocalTarget {
    pub fn start(bytes: u64, lbads: u8) -> anyhow::Result<LocalTarget> {
        Self::start_ports(bytes, lbads, 1)
    }

    /// The target serving its subsystem on `ports` ports (1..=16), each a soft-HCA of its own:
    /// one subsystem, several paths to it.
    pub fn start_ports(bytes: u64, lbads: u8, ports: u8) -> anyhow::Result<LocalTarget> {
        anyhow::ensure!(
            (1..=16).contains(&ports),
            "{ports} ports: the built-in target serves on 1 to 16"
        );
        let (tx, rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("nvmf-target".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(r) => r,
                    Err(e) => {
                        let _ = tx.send(Err(anyhow::Error::from(e)));
                        return;
                    }
                };
                rt.block_on(async move {
                    let r = async {
                        let hca = SoftHca::start(dev_config("tgt0", 1, [127, 0, 0, 1])).await?;
                        let ns = Arc::new(Namespace::ram(1, bytes, lbads));
                        let cfg = TargetConfig {
                            subsystems: vec![Subsystem::new(Nqn::new(DEMO_NQN)?, vec![ns])],
                            ..TargetConfig::default()
                        };
                        let t = Target::start(hca.clone(), cfg)?;
                        serve_cm(t.clone(), CmService::for_device(&hca))?;
                        let mut addrs = vec![hca.addr()];
                        let mut ids = vec![1];
                        let mut more = Vec::new();
                        for i in 1..ports {
                            let name = format!("tgt{i}");
                            let h =
                                SoftHca::start(dev_config(&name, 0x10 + i, [127, 0, 0, 1])).await?;
                            let id = t
                                .add_port(h.clone(), Some(h.addr()))
                                .map_err(anyhow::Error::msg)?;
                            serve_cm_on(t.clone(), id, CmService::for_device(&h))?;
                            addrs.push(h.addr());
                            ids.push(id);
                            more.push(h);
                        }
                        anyhow::Ok((addrs, ids, t, more))
                    }
                    .await;
                    let ok = r.is_ok();
                    let _ = tx.send(r);
                    if ok {
                        let _ = stop_rx.await;
                    }
                });
            })?;
        let (addrs, port_ids, target, more_ports) = rx
            .recv()
            .map_err(|_| anyhow::anyhow!("target thread died"))??;
        Ok(LocalTarget {
            addr: addrs[0],
            addrs,
            port_ids,
            target,
            more_ports,
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }
}

impl LocalTarget {
    /// The fabrics flags a front end would give to reach this target's subsystem.
    pub fn subsys(&self) -> Subsys {
        Subsys {
            fabric: Fabric {
                transport: "rdma".into(),
                traddr: self.addr,
                trsvcid: 4420,
                hostnqn: None,
                hostid: None,
                host_traddr: None,
                device: DeviceChoice::Soft,
            },
            nqn: DEMO_NQN.into(),
            queues: Queues {
                nr_io_queues: 1,
                queue_size: 128,
            },
            policy: PolicyArgs::default(),
            nsid: 1,
            iopolicy: None,
            safe_retry: Default::default(),
            cqt_default: crate::reconnect::hold::DEFAULT_CQT.as_millis() as u64,
        }
    }
}

impl Drop for LocalTarget {
    fn drop(&mut self) {
        self.target.device().fatal();
        for h in &self.more_ports {
            h.fatal();
        }
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Connect a host (its own soft-HCA on this runtime, in a device manager so the controller
/// survives resets of it) to `addr`.
pub async fn connect_host(
    addr: SocketAddr,
    subnqn: &str,
    queues: usize,
    queue_size: usize,
) -> Result<Controller, HostError> {
    let mut o = ConnectOptions::new(addr, subnqn);
    o.nr_io_queues = queues;
    o.queue_size = queue_size;
    connect_host_with(o).await
}

/// [`connect_host`] with every option.
pub async fn connect_host_with(o: ConnectOptions) -> Result<Controller, HostError> {
    Controller::connect_managed(host_manager().await?, HOST_DEV, o).await
}

/// [`connect_host_with`] for tests that reset the host's device: its device manager is
/// wrapped in a [`FaultInjector`], and the handle that resets the device comes back beside
/// the controller.
pub async fn connect_host_with_faults(
    o: ConnectOptions,
) -> Result<(Controller, DeviceFaults), HostError> {
    let src = FaultInjector::new(host_manager().await?);
    let c = Controller::connect_managed(src.clone(), HOST_DEV, o).await?;
    Ok((c, src.device(HOST_DEV)))
}

const HOST_DEV: &str = "host0";

/// A device manager with the host's soft-HCA plugged in as [`HOST_DEV`].
async fn host_manager() -> Result<crate::driver::DeviceManager, HostError> {
    let mgr = crate::driver::DeviceManager::new(true);
    mgr.plug(dev_config(HOST_DEV, 2, [127, 0, 0, 1]))
        .await
        .map_err(|e| HostError::Connect(e.to_string()))?;
    Ok(mgr)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pattern {
    RandRead,
    RandWrite,
    SeqRead,
    SeqWrite,
}

impl Pattern {
    pub fn name(self) -> &'static str {
        match self {
            Pattern::RandRead => "randread",
            Pattern::RandWrite => "randwrite",
            Pattern::SeqRead => "read",
            Pattern::SeqWrite => "write",
        }
    }
    fn is_read(self) -> bool {
        matches!(self, Pattern::RandRead | Pattern::SeqRead)
    }
}

impl Job {
    /// The row's name as `fio-plugin/bench.sh` names its fio jobs: `randread-4k-qd32`.
    pub fn name(&self) -> String {
        format!(
            "{}-{}k-qd{}",
            self.pattern.name(),
            self.bs >> 10,
            self.iodepth
        )
    }
}

#[derive(Debug, Clone, Copy)]
pub struct Job {
    pub pattern: Pattern,
    pub bs: usize,
    pub iodepth: usize,
    pub runtime: Duration,
}

#[derive(Debug, Clone)]
pub struct JobResult {
    pub job: Job,
    pub ios: u64,
    pub elapsed: Duration,
    pub p50: Duration,
    pub p99: Duration,
    pub errors: u64,
    /// Payload copies the host made per I/O during the job ([`Controller::io_copies`]).
    pub copies_per_io: f64,
    /// The same on the target's side, where its counters say (the in-process target's
    /// `TargetStats` has no copy count yet: `None`, shown as `-`).
    pub target_copies_per_io: Option<f64>,
}

impl JobResult {
    pub fn iops(&self) -> f64 {
        self.ios as f64 / self.elapsed.as_secs_f64()
    }
    pub fn mbps(&self) -> f64 {
        self.iops() * self.job.bs as f64 / 1e6
    }
}

/// One interval of a running job, as `bench` streams it.
#[derive(Debug, Clone, Copy)]
pub struct Tick {
    pub job: Job,
    /// Time since the job began, at the end of the interval.
    pub at: Duration,
    /// The interval's length.
    pub span: Duration,
    /// I/Os completed and failed in the interval.
    pub ios: u64,
    pub errors: u64,
}

impl Tick {
    pub fn iops(&self) -> f64 {
        self.ios as f64 / self.span.as_secs_f64().max(1e-9)
    }
    pub fn mbps(&self) -> f64 {
        self.iops() * self.job.bs as f64 / 1e6
    }
}

/// Who hears each interval of a job, and how long an interval is.
pub type Ticker<'a, 'f> = (Duration, &'a mut (dyn FnMut(&Tick) + Send + 'f));

/// Run `job` against namespace 1 of `c` with `iodepth` concurrent workers.
pub async fn run_job(c: Arc<Controller>, job: Job) -> JobResult {
    run_job_ticking(c, job, None).await
}

/// [`run_job`], telling `tick` what each interval did while it runs.
pub async fn run_job_ticking(
    c: Arc<Controller>,
    job: Job,
    tick: Option<Ticker<'_, '_>>,
) -> JobResult {
    use std::sync::atomic::{AtomicU64, Ordering};
    let ns = c.namespaces()[0];
    // Completed and failed I/Os so far, for the interval rows.
    let counts = Arc::new((AtomicU64::new(0), AtomicU64::new(0)));
    let blocks_per_io = (job.bs as u64 / ns.block_size as u64).max(1);
    let slots = (ns.blocks / blocks_per_io).max(1);
    let copies_before = c.io_copies().0;
    let start = StdInstant::now();
    let mut tasks = Vec::new();
    for w in 0..job.iodepth {
        let c = c.clone();
        let counts = counts.clone();
        tasks.push(tokio::spawn(async move {
            let mut rng = SmallRng::seed_from_u64(w as u64 + 1);
            let mut lat = Vec::with_capacity(1 << 16);
            let mut errors = 0u64;
            let data = vec![0x5Au8; job.bs];
            // The worker's I/O buffer is registered memory: no host copy per I/O. (Plain
            // memory, copied, if the block is over the transfer limit.)
            let buf = c.io_buffer(job.bs, 1).ok();
            if let Some(b) = &buf {
                b.write(0, &data);
            }
            let mut seq = (w as u64 * slots / job.iodepth.max(1) as u64) % slots;
            while start.elapsed() < job.runtime {
                let slot = match job.pattern {
                    Pattern::RandRead | Pattern::RandWrite => rng.random_range(0..slots),
                    _ => {
                        seq = (seq + 1) % slots;
                        seq
                    }
                };
                let lba = slot * blocks_per_io;
                let t0 = StdInstant::now();
                let r = match (&buf, job.pattern.is_read()) {
                    (Some(b), true) => c.read_to(b, 0, 1, lba, job.bs).await,
                    (Some(b), false) => c.write_from(b, 0, 1, lba, job.bs).await,
                    (None, true) => c.read(1, lba, job.bs).await.map(|_| ()),
                    (None, false) => c.write(1, lba, &data).await,
                };
                if r.is_err() {
                    errors += 1;
                    counts.1.fetch_add(1, Ordering::Relaxed);
                }
                counts.0.fetch_add(1, Ordering::Relaxed);
                lat.push(t0.elapsed().as_nanos() as u64);
            }
            (lat, errors)
        }));
    }
    if let Some(tick) = tick {
        report_intervals(job, start, &counts, tick).await;
    }
    let mut all = Vec::new();
    let mut errors = 0;
    for t in tasks {
        if let Ok((l, e)) = t.await {
            all.extend(l);
            errors += e;
        }
    }
    let elapsed = start.elapsed();
    all.sort_unstable();
    let pct = |p: f64| Duration::from_nanos(super::chaos::pct(&all, p));
    let copies = c.io_copies().0 - copies_before;
    JobResult {
        job,
        ios: all.len() as u64,
        elapsed,
        p50: pct(0.50),
        p99: pct(0.99),
        errors,
        copies_per_io: copies as f64 / (all.len() as f64).max(1.0),
        target_copies_per_io: None,
    }
}

/// Tell `f` what each whole interval of `every` since `start` did, by the completed and
/// failed counts `counts`, until `job`'s runtime is up (the summary covers the rest).
async fn report_intervals(
    job: Job,
    start: StdInstant,
    counts: &(std::sync::atomic::AtomicU64, std::sync::atomic::AtomicU64),
    (every, f): Ticker<'_, '_>,
) {
    use std::sync::atomic::Ordering;
    let every = every.max(Duration::from_millis(10));
    let (mut ios, mut errs, mut last) = (0, 0, Duration::ZERO);
    let mut n = 1u32;
    while every * n <= job.runtime {
        tokio::time::sleep_until(tokio::time::Instant::from_std(start + every * n)).await;
        let (now_ios, now_errs) = (
            counts.0.load(Ordering::Relaxed),
            counts.1.load(Ordering::Relaxed),
        );
        let at = start.elapsed();
        f(&Tick {
            job,
            at,
            span: at - last,
            ios: now_ios - ios,
            errors: now_errs - errs,
        });
        (ios, errs, last) = (now_ios, now_errs, at);
        n += 1;
    }
}

/// The jobs of `tests/vm/run.sh bench` against a remote target: 4 KiB random reads at QD1
/// and QD32, 128 KiB sequential reads at QD16.
pub fn remote_jobs(runtime: Duration) -> Vec<Job> {
    [
        (Pattern::RandRead, 4096, 1),
        (Pattern::RandRead, 4096, 32),
        (Pattern::SeqRead, 128 << 10, 16),
    ]
    .into_iter()
    .map(|(pattern, bs, iodepth)| Job {
        pattern,
        bs,
        iodepth,
        runtime,
    })
    .collect()
}

/// The jobs of [`remote_jobs`] on namespace 1 of the controller `sub` names (a target of
/// someone else's), one after the other on a runtime of their own; `tick` hears each
/// interval. The controller is disconnected at the end.
pub fn remote_bench(
    sub: &Subsys,
    runtime: Duration,
    mut tick: Option<Ticker<'_, '_>>,
) -> anyhow::Result<Vec<JobResult>> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let c = Arc::new(crate::cli::host::connect(sub).await?);
        let mut rows = Vec::new();
        for job in remote_jobs(runtime) {
            let t = tick.as_mut().map(|(d, f)| (*d, &mut **f));
            rows.push(run_job_ticking(c.clone(), job, t).await);
        }
        if let Ok(c) = Arc::try_unwrap(c) {
            c.disconnect().await;
        }
        Ok(rows)
    })
}

/// What [`demo`] tells as it goes.
pub enum DemoStep<'a> {
    /// The target is about to serve a RAM namespace of this many bytes.
    Starting { ns_bytes: u64 },
    /// The host is connected to the target's subsystem [`DEMO_NQN`].
    Connected(&'a Controller),
    /// The verify wrote and read back `bytes` and every byte matched, in `took`.
    Verified { bytes: usize, took: Duration },
}

/// `demo`: the built-in target with a RAM namespace (256 MiB, or `size` if larger), a host
/// on loopback, a write and read-back of `size` bytes (whole 4 KiB blocks) in 128 KiB
/// pieces, then `seconds` of 4 KiB random reads at QD32: their row.
pub fn demo(
    size: usize,
    seconds: f64,
    progress: Progress<'_>,
    step: &mut dyn FnMut(DemoStep<'_>),
) -> anyhow::Result<JobResult> {
    let ns_bytes = (size as u64).max(256 << 20);
    step(DemoStep::Starting { ns_bytes });
    let t = LocalTarget::start(ns_bytes, 9)?;
    let addr = t.addr;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let row = rt.block_on(async move {
        let c = connect_host(addr, DEMO_NQN, 1, 128).await;
        let c = Arc::new(anyhow::Context::context(c, "connect")?);
        step(DemoStep::Connected(&c));
        let t0 = StdInstant::now();
        let n = size - size % 4096;
        verify(&c, 1, 0, n, 128 << 10, 42, progress).await?;
        step(DemoStep::Verified {
            bytes: n,
            took: t0.elapsed(),
        });
        let job = Job {
            pattern: Pattern::RandRead,
            bs: 4096,
            iodepth: 32,
            runtime: Duration::from_secs_f64(seconds),
        };
        let r = run_job(c.clone(), job).await;
        match Arc::try_unwrap(c) {
            Ok(c) => c.disconnect().await,
            Err(_) => tracing::warn!("controller still shared; not disconnecting cleanly"),
        }
        anyhow::Ok(r)
    })?;
    tracing::debug!("stopping the target");
    drop(t);
    Ok(row)
}

/// The standard table: 4 KiB random read/write at QD1 and QD32, 128 KiB sequential.
pub fn standard_jobs(runtime: Duration) -> Vec<Job> {
    let mut v = Vec::new();
    for (pattern, bs, qd) in [
        (Pattern::RandRead, 4096, 1),
        (Pattern::RandRead, 4096, 32),
        (Pattern::RandWrite, 4096, 1),
        (Pattern::RandWrite, 4096, 32),
        (Pattern::SeqRead, 128 << 10, 8),
        (Pattern::SeqWrite, 128 << 10, 8),
    ] {
        v.push(Job {
            pattern,
            bs,
            iodepth: qd,
            runtime,
        });
    }
    v
}

pub fn print_results(rows: &[JobResult]) {
    println!(
        "{:<10} {:>7} {:>4} {:>10} {:>9} {:>9} {:>9} {:>6} {:>11} {:>11}",
        "rw", "bs", "qd", "IOPS", "MB/s", "p50 us", "p99 us", "errors", "host cp/IO", "tgt cp/IO"
    );
    for r in rows {
        println!(
            "{:<10} {:>7} {:>4} {:>10.0} {:>9.1} {:>9.1} {:>9.1} {:>6} {:>11.2} {:>11}",
            r.job.pattern.name(),
            crate::harness::hca_perf::human(r.job.bs),
            r.job.iodepth,
            r.iops(),
            r.mbps(),
            r.p50.as_secs_f64() * 1e6,
            r.p99.as_secs_f64() * 1e6,
            r.errors,
            r.copies_per_io,
            r.target_copies_per_io
                .map_or("-".to_string(), |t| format!("{t:.2}"))
        );
    }
}

/// The standard jobs whose names are in `only` (all of them when it is empty). An unknown
/// name is an error that lists the known ones.
pub fn select_jobs(runtime: Duration, only: &[String]) -> anyhow::Result<Vec<Job>> {
    let all = standard_jobs(runtime);
    if let Some(bad) = only.iter().find(|n| !all.iter().any(|j| &j.name() == *n)) {
        let known: Vec<String> = all.iter().map(Job::name).collect();
        anyhow::bail!("no bench job {bad:?}; the jobs are {}", known.join(", "));
    }
    Ok(all
        .into_iter()
        .filter(|j| only.is_empty() || only.contains(&j.name()))
        .collect())
}

/// Run `jobs` against a fresh in-process target, one I/O queue.
pub fn bench(jobs: Vec<Job>, queues: usize) -> anyhow::Result<Vec<JobResult>> {
    bench_ticking(jobs, queues, None)
}

/// [`bench`], telling `tick` about each interval of each job as it runs.
pub fn bench_ticking(
    jobs: Vec<Job>,
    queues: usize,
    mut tick: Option<Ticker<'_, '_>>,
) -> anyhow::Result<Vec<JobResult>> {
    let t = LocalTarget::start(1 << 30, 12)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let addr = t.addr;
    let target = t.target.clone();
    let rows = rt.block_on(async move {
        let c = Arc::new(connect_host(addr, DEMO_NQN, queues, 128).await?);
        let mut rows = Vec::new();
        for job in jobs {
            let t = tick.as_mut().map(|(d, f)| (*d, &mut **f));
            let before = target.stats().io_copies;
            let mut row = run_job_ticking(c.clone(), job, t).await;
            let copies = target.stats().io_copies - before;
            row.target_copies_per_io = Some(copies as f64 / (row.ios as f64).max(1.0));
            rows.push(row);
            if std::env::var_os("NVMF_DEBUG_STATS").is_some() {
                if let Some(h) = c.device::<SoftHca>() {
                    eprintln!("host {:?}", h.with(|d, _| d.stats().clone()));
                }
                let d = target.device();
                eprintln!("target {:?}", d.with(|d, _| d.stats().clone()));
            }
        }
        anyhow::Ok(rows)
    })?;
    drop(t);
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_bench_runs_the_remote_jobs_on_the_target_it_is_given_and_ticks() {
        let t = LocalTarget::start(16 << 20, 9).unwrap();
        let sub = t.subsys();
        let runtime = Duration::from_millis(100);
        let mut ticks = 0;
        let mut tick = |_: &Tick| ticks += 1;
        let rows =
            remote_bench(&sub, runtime, Some((Duration::from_millis(20), &mut tick))).unwrap();
        let names = |jobs: Vec<Job>| jobs.iter().map(Job::name).collect::<Vec<_>>();
        let ran = names(rows.iter().map(|r| r.job).collect());
        assert_eq!(ran, names(remote_jobs(runtime)));
        assert!(rows.iter().all(|r| r.ios > 0 && r.errors == 0), "{rows:?}");
        assert!(ticks >= rows.len(), "{ticks} ticks");
    }
}

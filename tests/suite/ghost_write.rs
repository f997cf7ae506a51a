//! The ghost write on the real stack: the controller, its recovery, the multipath layer and
//! the built-in target (late-writes fault, CQT, CCR) on the simulated network in tokio's
//! paused time, one world per seed, over one path and over two.
//!
//! Each block has one writer that writes, waits for the acknowledgement, and writes again.
//! The target's backend stalls, so every writer has a write held in it; the controller is
//! lost; the dead controller's held writes execute `late` ms later (less than CQT, so the
//! target's promise holds). Each writer goes on for a few writes and stops. Once the late
//! writes are over, each block must hold its last acknowledged write. With `--safe-retry
//! off` the resent write is acknowledged, overwritten by the next one, and then by the
//! stale original: corrupted blocks. With `cqt` (time rule) and `ccr` (a live association
//! resets the old one) none.
//!
//! One path: the host reconnects and resends on the new association. Two paths (two ports of
//! one subsystem, a controller through each, I/O through the multipath namespace, failover
//! policy so every write is on path A), default path settings: path A's controller, a path of
//! a subsystem with another, gives its held writes back at once and they go to path B.
//!
//! Each sweep also measures, per fault, how long the writes held across it wait: virtual
//! time from the loss to the last of them completing. Once a topology's `off`, `cqt` and
//! `ccr` sweeps are all done, one line says what `ccr` and `cqt` add to it over `off`, seed
//! by seed (run with `--nocapture` to see it).
//!
//! The two-path world also runs under steady I/O from 32 blocks (round-robin) while path A's
//! HCA is reset and path B's unplugged, each on a seeded schedule, never both down: every
//! I/O must end in a bounded time with its data (`FAILOVER_SEEDS=n`, `SIM_SEED=<seed>`).
//!
//! `GHOST_SEEDS=n` sets the number of seeds per mode (default 200); a failure prints
//! `GHOST_SEED=<seed>`, which runs that seed alone.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nvmf_rdma::driver::{CmService, SimNet, SoftHca};
use nvmf_rdma::harness::chaos::{connect_seeded_host, host_options, CHAOS_NQN, HOST_DEV};
use nvmf_rdma::hca::sim::Faults;
use nvmf_rdma::multipath::{IoPolicy, MpNamespace};
use nvmf_rdma::nvme::Nqn;
use nvmf_rdma::nvmet::{serve_cm, serve_cm_on, Namespace, Subsystem, Target, TargetConfig};
use nvmf_rdma::reconnect::hold::{HoldPolicy, SafeRetry};
use nvmf_rdma::reconnect::CtrlState;
use nvmf_rdma::transport::{CcrOutcome, Controller, HostError};
use nvmf_rdma::verbs::{DeviceFaults, FaultInjector};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const HOST_IP: [u8; 4] = [127, 0, 1, 1];
/// Path B's host device.
const HOST_IP_B: [u8; 4] = [127, 0, 1, 2];
/// The target's ports.
const TARGET_IPS: [[u8; 4]; 2] = [[127, 0, 2, 1], [127, 0, 2, 2]];
const KATO: Duration = Duration::from_millis(500);
const CQT_MS: u16 = 300;
const BLOCK: usize = 512;

/// Where the workload's I/O goes: one controller, or a namespace over every path.
enum Io {
    Ctrl(Arc<Controller>),
    Paths(MpNamespace),
}

impl Io {
    async fn write(&self, b: usize, data: &[u8]) -> Result<(), HostError> {
        match self {
            Io::Ctrl(c) => c.write(1, b as u64, data).await,
            Io::Paths(ns) => ns.write(b as u64, data).await,
        }
    }

    async fn read(&self, b: usize, out: &mut [u8]) -> Result<(), HostError> {
        match self {
            Io::Ctrl(c) => c.read_into(1, b as u64, out).await,
            Io::Paths(ns) => ns.read_into(b as u64, out).await,
        }
    }
}

struct World {
    _net: SimNet,
    hcas: Vec<SoftHca>,
    target: Target<SoftHca>,
    ns: Arc<Namespace>,
    /// The controller whose connection is lost (path A); then path B's, if any.
    ctrls: Vec<Arc<Controller>>,
    /// Each controller's host device, to reset or unplug.
    faults: Vec<DeviceFaults>,
    io: Arc<Io>,
}

impl World {
    /// The controller of the single path, or path A.
    fn c(&self) -> &Arc<Controller> {
        &self.ctrls[0]
    }
}

impl Drop for World {
    fn drop(&mut self) {
        for h in &self.hcas {
            h.fatal();
        }
    }
}

/// What a world is made of, besides its seed.
#[derive(Debug, Clone, Copy)]
struct Setup {
    mode: SafeRetry,
    /// 1: a single controller; 2: two ports, a path through each.
    paths: usize,
    queues: usize,
    late_ms: u32,
    /// The target offers CCR.
    ccr: bool,
    /// How two paths share the I/O.
    policy: IoPolicy,
}

async fn world(seed: u64, s: Setup) -> World {
    let net = SimNet::new(seed, Faults::NONE);
    let mut hcas = Vec::new();
    for (i, ip) in TARGET_IPS[..s.paths].iter().enumerate() {
        let dev = crate::rig::device_on(45, "tgt", 1 + i as u8, *ip);
        hcas.push(SoftHca::start_on(dev, &net.fabric()).await.unwrap());
    }
    let ns = Arc::new(Namespace::ram(1, 1 << 20, 9));
    let tc = TargetConfig {
        subsystems: vec![Subsystem::new(
            Nqn::new(CHAOS_NQN).unwrap(),
            vec![ns.clone()],
        )],
        cqt_ms: CQT_MS,
        late_writes_ms: Some(s.late_ms),
        offer_ccr: s.ccr,
        ..TargetConfig::default()
    };
    let target = Target::start(hcas[0].clone(), tc).unwrap();
    serve_cm(target.clone(), CmService::for_device(&hcas[0])).unwrap();
    for h in &hcas[1..] {
        let port = target.add_port(h.clone(), Some(h.addr())).unwrap();
        serve_cm_on(target.clone(), port, CmService::for_device(h)).unwrap();
    }
    let mut ctrls = Vec::new();
    let mut faults = Vec::new();
    for (i, h) in hcas.iter().enumerate() {
        let mut p =
            crate::rig::reconnect_at_once(Some(Duration::from_secs(60)), Duration::from_secs(60));
        p.keep_alive_tmo = KATO;
        let mut o = host_options(h.addr(), s.queues, 32, p);
        o.safe_retry = HoldPolicy {
            mode: s.mode,
            ..HoldPolicy::default()
        };
        let mgr = net.device_manager();
        let (c, name) = if i == 0 {
            let c = connect_seeded_host(&mgr, HOST_IP, seed, o).await.unwrap();
            (c, HOST_DEV)
        } else {
            mgr.plug(crate::rig::device_on(45, "hostB", 10, HOST_IP_B))
                .await
                .unwrap();
            let c = Controller::connect_managed(mgr.clone(), "hostB", o)
                .await
                .unwrap();
            (c, "hostB")
        };
        ctrls.push(Arc::new(c));
        faults.push(FaultInjector::new(mgr).device(name));
    }
    let io = if s.paths == 1 {
        Io::Ctrl(ctrls[0].clone())
    } else {
        let sub = nvmf_rdma::multipath::Subsystem::new(CHAOS_NQN, s.policy);
        for (c, h) in ctrls.iter().zip(&hcas) {
            sub.add_path(c.clone(), h.addr().to_string(), String::new())
                .await
                .unwrap();
        }
        Io::Paths(sub.namespace(1).unwrap())
    };
    World {
        _net: net,
        hcas,
        target,
        ns,
        ctrls,
        faults,
        io: Arc::new(io),
    }
}

/// Block `b`'s content for its write number `seq`.
fn pattern(b: usize, seq: u64) -> [u8; BLOCK] {
    let mut d = [(b as u8) ^ (seq as u8); BLOCK];
    d[..8].copy_from_slice(&seq.to_le_bytes());
    d
}

/// What one seed saw.
#[derive(Debug, Default)]
struct Outcome {
    blocks: usize,
    corrupted: Vec<usize>,
    failed_writes: u64,
    /// Virtual time from the loss to the last writer's end.
    settle: Duration,
    /// Virtual time from the loss to the last write held across it completing.
    held_wait: Duration,
}

/// Wait in virtual time (sampled each ms) until `cond`, at most `limit`.
async fn until(limit: Duration, cond: impl Fn() -> bool) -> bool {
    let end = tokio::time::Instant::now() + limit;
    while !cond() {
        if tokio::time::Instant::now() > end {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    true
}

/// What the writers share.
#[derive(Default)]
struct Tally {
    /// Last acknowledged write of each block (None: a write failed, the block is unknown).
    acked: Mutex<Vec<Option<u64>>>,
    writes: AtomicU64,
    failed: AtomicU64,
    /// The connection was lost.
    lost: AtomicBool,
    /// When the last write in flight across the loss completed.
    held_done: Mutex<Option<tokio::time::Instant>>,
}

/// Block `b`'s writer: writes, waits for the acknowledgement, writes again, until `extra`
/// of its writes began after the loss.
async fn writer(io: Arc<Io>, t: Arc<Tally>, b: usize, extra: u32) {
    let mut seq = 0;
    let mut after = 0;
    while after < extra {
        let past = t.lost.load(Ordering::Acquire);
        seq += 1;
        match io.write(b, &pattern(b, seq)).await {
            Ok(()) => t.acked.lock().unwrap()[b] = Some(seq),
            Err(_) => {
                t.failed.fetch_add(1, Ordering::Relaxed);
                t.acked.lock().unwrap()[b] = None;
            }
        }
        if !past && t.lost.load(Ordering::Acquire) {
            let now = tokio::time::Instant::now();
            let mut d = t.held_done.lock().unwrap();
            *d = Some(d.map_or(now, |x| x.max(now)));
        }
        t.writes.fetch_add(1, Ordering::Relaxed);
        if past {
            after += 1;
        }
    }
}

async fn run_seed(seed: u64, mode: SafeRetry, paths: usize, ccr: bool) -> Result<Outcome, String> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let queues = rng.random_range(1..=2);
    // Late enough to land after the resend and the next write; within CQT.
    let late_ms = rng.random_range(60..=u32::from(CQT_MS) - 20);
    let setup = Setup {
        mode,
        paths,
        queues,
        late_ms,
        ccr,
        policy: IoPolicy::Failover,
    };
    let w = world(seed, setup).await;
    let blocks = rng.random_range(2..=8);
    let t = Arc::new(Tally {
        acked: Mutex::new(vec![Some(0); blocks]),
        ..Tally::default()
    });
    for b in 0..blocks {
        w.io.write(b, &pattern(b, 0))
            .await
            .map_err(|e| e.to_string())?;
    }
    let writers: Vec<_> = (0..blocks)
        .map(|b| {
            let extra = rng.random_range(1..=4u32);
            tokio::spawn(writer(w.io.clone(), t.clone(), b, extra))
        })
        .collect();
    let at = rng.random_range(1..40u64);
    until(Duration::from_secs(5), || {
        t.writes.load(Ordering::Relaxed) >= at
    })
    .await;
    // The backend stalls with writes in it; the connection is lost.
    w.target.stall_io(true);
    if !until(Duration::from_secs(5), || w.target.stalled_io() >= 1).await {
        return Err("no write reached the stalled backend".into());
    }
    tokio::time::sleep(Duration::from_micros(rng.random_range(0..200))).await;
    let cntlid = w.c().instance().ok_or("no live association")?.cntlid;
    let died = tokio::time::Instant::now();
    if !w.target.lose_controller(cntlid) {
        return Err(format!("no controller {cntlid} to lose"));
    }
    w.target.stall_io(false);
    t.lost.store(true, Ordering::Release);
    let done = until(Duration::from_secs(30), || {
        writers.iter().all(|h| h.is_finished())
    })
    .await;
    if !done {
        return Err(format!("writers hung; status {:?}", w.c().status().machine));
    }
    let settle = died.elapsed();
    let held_wait = t
        .held_done
        .lock()
        .unwrap()
        .map_or(Duration::ZERO, |t| t.duration_since(died));
    if !until(Duration::from_secs(30), || w.target.late_writes_held() == 0).await {
        return Err("the late writes never ended".into());
    }
    let acked = t.acked.lock().unwrap().clone();
    let mut corrupted = Vec::new();
    for (b, a) in acked.iter().enumerate() {
        let mut d = [0u8; BLOCK];
        w.ns.read((b * BLOCK) as u64, &mut d).unwrap();
        if let Some(seq) = a {
            if d != pattern(b, *seq) {
                corrupted.push(b);
            }
        }
    }
    // Path A may still be coming back (with the new I/O on path B, nothing waits for it).
    if !until(Duration::from_secs(30), || {
        w.ctrls.iter().all(|c| c.state() == CtrlState::Live)
    })
    .await
    {
        return Err(format!("controller {:?}", w.c().state()));
    }
    for c in &w.ctrls {
        let held = c.safe_retry().holds;
        if !held.is_empty() {
            return Err(format!("holds left over: {held:?}"));
        }
    }
    Ok(Outcome {
        blocks,
        corrupted,
        failed_writes: t.failed.load(Ordering::Relaxed),
        settle,
        held_wait,
    })
}

fn topology(paths: usize) -> &'static str {
    if paths == 1 {
        "single path"
    } else {
        "two paths"
    }
}

/// Run the seeds of `mode` (or the one in `GHOST_SEED`); what they found in total.
fn sweep(mode: SafeRetry, paths: usize, ccr: bool) -> Vec<(u64, Outcome)> {
    let seeds: Vec<u64> = match std::env::var("GHOST_SEED") {
        Ok(s) => vec![s.parse().expect("GHOST_SEED is a number")],
        Err(_) => {
            let n = std::env::var("GHOST_SEEDS")
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(200);
            (0..n).collect()
        }
    };
    let mut out = Vec::new();
    for seed in seeds {
        let r = crate::rig::sim_runtime().block_on(run_seed(seed, mode, paths, ccr));
        match r {
            Ok(o) => out.push((seed, o)),
            Err(e) => panic!("GHOST_SEED={seed} (mode {mode}, {}): {e}", topology(paths)),
        }
    }
    out
}

fn report(mode: SafeRetry, paths: usize, runs: &[(u64, Outcome)]) -> usize {
    let corrupted: usize = runs.iter().map(|(_, o)| o.corrupted.len()).sum();
    let blocks: usize = runs.iter().map(|(_, o)| o.blocks).sum();
    let failed: u64 = runs.iter().map(|(_, o)| o.failed_writes).sum();
    let worst = runs.iter().map(|(_, o)| o.settle).max().unwrap_or_default();
    println!(
        "safe-retry {mode}, {}: {} seeds, {blocks} blocks, {corrupted} corrupted, {failed} \
         failed writes, longest loss-to-settled {worst:?} (virtual)",
        topology(paths),
        runs.len()
    );
    corrupted
}

/// Each topology's held-write waits per mode, seed by seed, from the sweeps done so far
/// (against a target that offers CCR).
type Waits = BTreeMap<u64, Duration>;
static WAITS: Mutex<BTreeMap<(usize, &'static str), Waits>> = Mutex::new(BTreeMap::new());

/// Keep the held-write waits of a sweep; once `off`, `cqt` and `ccr` of its topology are
/// in, print what each safe mode adds per fault over `off`, seed by seed.
fn record_waits(mode: SafeRetry, paths: usize, runs: &[(u64, Outcome)]) {
    let mut all = WAITS.lock().unwrap_or_else(|e| e.into_inner());
    let waits = runs.iter().map(|(s, o)| (*s, o.held_wait)).collect();
    all.insert((paths, mode.name()), waits);
    let of = |m: SafeRetry| all.get(&(paths, m.name()));
    let (Some(off), Some(cqt), Some(ccr)) =
        (of(SafeRetry::Off), of(SafeRetry::Cqt), of(SafeRetry::Ccr))
    else {
        return;
    };
    println!(
        "ghost-write {}: ccr adds {} per fault; cqt {} ({} seeds, virtual time from the loss \
         to the held write's completion, over off)",
        topology(paths),
        added(off, ccr),
        added(off, cqt),
        off.len()
    );
}

/// The median and the largest of `mode`'s wait minus `off`'s, over the seeds both ran.
fn added(off: &Waits, mode: &Waits) -> String {
    let mut d: Vec<f64> = mode
        .iter()
        .filter_map(|(s, w)| Some(w.as_secs_f64() - off.get(s)?.as_secs_f64()))
        .collect();
    if d.is_empty() {
        return "nothing (no seed in common)".into();
    }
    d.sort_by(f64::total_cmp);
    let t = |x: f64| {
        if x.abs() >= 1.0 {
            format!("{x:.2} s")
        } else {
            format!("{:.0} ms", x * 1e3)
        }
    };
    format!("median {} (max {})", t(d[d.len() / 2]), t(d[d.len() - 1]))
}

fn ghost_detected(paths: usize) {
    let runs = sweep(SafeRetry::Off, paths, true);
    let corrupted = report(SafeRetry::Off, paths, &runs);
    record_waits(SafeRetry::Off, paths, &runs);
    assert!(
        corrupted > 0,
        "no ghost write in {} seeds: the test cannot tell",
        runs.len()
    );
}

fn no_ghost(mode: SafeRetry, paths: usize, ccr: bool) -> Vec<(u64, Outcome)> {
    let runs = sweep(mode, paths, ccr);
    report(mode, paths, &runs);
    for (seed, o) in &runs {
        assert!(
            o.corrupted.is_empty() && o.failed_writes == 0,
            "GHOST_SEED={seed} (mode {mode}, {}): blocks {:?} lost their last acknowledged \
             write, {} writes failed",
            topology(paths),
            o.corrupted,
            o.failed_writes
        );
    }
    if ccr {
        record_waits(mode, paths, &runs);
    }
    runs
}

/// A CCR settles the held writes well before the time rule would.
fn settles_by_ccr(runs: &[(u64, Outcome)]) {
    let worst = runs.iter().map(|(_, o)| o.settle).max().unwrap_or_default();
    assert!(
        worst < 2 * KATO,
        "a CCR should settle well before the time rule; the slowest seed took {worst:?}"
    );
}

#[test]
fn without_safe_retry_a_stale_write_overwrites_an_acknowledged_one() {
    ghost_detected(1);
}

#[test]
fn the_time_rule_leaves_no_ghost_write() {
    no_ghost(SafeRetry::Cqt, 1, true);
}

#[test]
fn a_cross_controller_reset_leaves_no_ghost_write() {
    settles_by_ccr(&no_ghost(SafeRetry::Ccr, 1, true));
}

/// Mode `ccr` against a target that does not offer CCR (CCRL 0, the command an Invalid
/// Opcode, as Linux nvmet): the host falls back to the time rule, so no ghost write, and
/// the held writes wait at least 2 x KATO + CQT after the loss.
#[test]
fn without_ccr_on_the_target_the_ccr_mode_falls_back_to_the_time_rule() {
    falls_back_to_the_time_rule(1);
}

fn falls_back_to_the_time_rule(paths: usize) {
    let runs = no_ghost(SafeRetry::Ccr, paths, false);
    let quickest = runs.iter().map(|(_, o)| o.settle).min().unwrap_or_default();
    assert!(
        quickest >= 2 * KATO + Duration::from_millis(u64::from(CQT_MS)) - Duration::from_millis(50),
        "a seed settled in {quickest:?}, sooner than the time rule allows"
    );
}

/// Two paths: path A's held writes fail over to path B at once, and the stale originals
/// land on blocks path B has written since.
#[test]
fn two_paths_without_safe_retry_a_write_moved_to_path_b_is_overwritten_by_its_ghost() {
    ghost_detected(2);
}

#[test]
fn two_paths_the_time_rule_leaves_no_ghost_write() {
    no_ghost(SafeRetry::Cqt, 2, true);
}

/// Two paths to a target that does not offer CCR: path B asks for none, and the moved
/// writes wait for the time rule.
#[test]
fn two_paths_without_ccr_on_the_target_the_ccr_mode_falls_back_to_the_time_rule() {
    falls_back_to_the_time_rule(2);
}

/// The CCR for path A's dead controller goes through a live controller (path B, or A's
/// new association), so the moved writes need not wait for the time rule.
#[test]
fn two_paths_a_cross_controller_reset_leaves_no_ghost_write() {
    settles_by_ccr(&no_ghost(SafeRetry::Ccr, 2, true));
}

/// A read and a write in flight when the controller is lost (time rule, no CCR): the read
/// is resent as soon as the controller is back, and so is new I/O; only the write waits,
/// and `list` shows its hold.
#[test]
fn the_hold_delays_only_the_writes_that_were_in_flight() {
    crate::rig::sim_runtime().block_on(async {
        let w = world(7, setup(SafeRetry::Cqt)).await;
        w.c().write(1, 1, &pattern(1, 1)).await.unwrap();
        w.target.stall_io(true);
        let (c1, c2) = (w.c().clone(), w.c().clone());
        let write = tokio::spawn(async move { c1.write(1, 0, &pattern(0, 9)).await });
        let read = tokio::spawn(async move { c2.read(1, 1, BLOCK).await });
        assert!(until(Duration::from_secs(5), || w.target.stalled_io() == 2).await);
        let died = tokio::time::Instant::now();
        let cntlid = w.c().instance().unwrap().cntlid;
        assert!(w.target.lose_controller(cntlid));
        w.target.stall_io(false);
        assert!(until(Duration::from_secs(5), || read.is_finished()).await);
        let read_after = died.elapsed();
        assert_eq!(read.await.unwrap().unwrap(), pattern(1, 1));
        // New I/O goes while the old write is held.
        w.c().write(1, 2, &pattern(2, 1)).await.unwrap();
        assert!(!write.is_finished(), "the write was not held");
        let s = w.c().safe_retry();
        assert_eq!(s.mode, SafeRetry::Cqt);
        assert_eq!(s.holds.len(), 1, "{s:?}");
        let h = s.holds[0];
        assert_eq!((h.held, h.by.name()), (1, "time"));
        assert!(h.time_left > Duration::from_millis(1000), "{h:?}");
        assert_ne!(
            Some(h.instance),
            w.c().instance(),
            "the hold names the dead instance"
        );
        assert!(until(Duration::from_secs(5), || write.is_finished()).await);
        let write_after = died.elapsed();
        write.await.unwrap().unwrap();
        // 2 x KATO + CQT after the last contact, which was just before the loss.
        let rule = KATO * 2 + Duration::from_millis(u64::from(CQT_MS));
        assert!(
            read_after < Duration::from_millis(100),
            "read resent after {read_after:?}"
        );
        assert!(
            write_after + Duration::from_millis(50) >= rule && write_after < rule * 2,
            "write resent after {write_after:?}, rule {rule:?}"
        );
        assert!(w.c().safe_retry().holds.is_empty());
    });
}

/// `quiesced` resolves once the dead association can run nothing: at the CCR's success in
/// `ccr` mode, at the time rule in `cqt` mode, at once (once the loss is known) with `off`.
#[test]
fn quiesced_follows_the_mode() {
    for (mode, lo, hi) in [
        (SafeRetry::Ccr, 0, 100),
        (SafeRetry::Cqt, 1200, 1400),
        (SafeRetry::Off, 0, 0),
    ] {
        crate::rig::sim_runtime().block_on(async {
            let w = world(11, setup(mode)).await;
            w.target.stall_io(true);
            let c = w.c().clone();
            let write = tokio::spawn(async move { c.write(1, 0, &pattern(0, 1)).await });
            assert!(until(Duration::from_secs(5), || w.target.stalled_io() == 1).await);
            let old = w.c().instance().unwrap();
            let died = tokio::time::Instant::now();
            assert!(w.target.lose_controller(old.cntlid));
            w.target.stall_io(false);
            // Once the host knows of the loss.
            assert!(until(Duration::from_secs(5), || w.c().instance() != Some(old)).await);
            let known = tokio::time::Instant::now();
            w.c().quiesced().await;
            let q = if mode == SafeRetry::Off {
                known.elapsed()
            } else {
                died.elapsed()
            };
            assert!(
                q >= Duration::from_millis(lo) && q <= Duration::from_millis(hi),
                "{mode}: quiesced after {q:?}"
            );
            write.await.unwrap().unwrap();
        });
    }
}

/// One path, one queue, writes late by 100 ms, a target that offers CCR.
fn setup(mode: SafeRetry) -> Setup {
    Setup {
        mode,
        paths: 1,
        queues: 1,
        late_ms: 100,
        ccr: true,
        policy: IoPolicy::Failover,
    }
}

/// The log an operator reads: in mode `ccr`, a connection lost to a target that offers no
/// CCR (as Linux nvmet) says that safe retry falls back to the time rule, with the hold and
/// where its CQT came from; against a target with CCR there is no such line.
#[test]
fn the_log_names_the_fallback_to_the_time_rule() {
    #[derive(Clone, Default)]
    struct Log(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Log {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    for ccr in [false, true] {
        let log = Log::default();
        let writer = log.clone();
        let sub = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_max_level(tracing::Level::INFO)
            .with_ansi(false)
            .finish();
        tracing::subscriber::with_default(sub, || {
            crate::rig::sim_runtime().block_on(async {
                let w = world(
                    13,
                    Setup {
                        ccr,
                        ..setup(SafeRetry::Ccr)
                    },
                )
                .await;
                w.c().write(1, 0, &pattern(0, 1)).await.unwrap();
                let cntlid = w.c().instance().unwrap().cntlid;
                assert!(w.target.lose_controller(cntlid));
                // Completes on the next association: the loss has been handled.
                w.c().write(1, 1, &pattern(1, 1)).await.unwrap();
                // A deleted controller resends nothing: no line for its end.
                w.c().delete().await;
            })
        });
        let text = String::from_utf8_lossy(&log.0.lock().unwrap()).into_owned();
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| l.contains("safe retry falls back to the time rule"))
            .collect();
        if ccr {
            assert!(lines.is_empty(), "{text}");
        } else {
            let [line] = lines[..] else {
                panic!("one fallback line expected, for the loss:\n{text}")
            };
            let rule = KATO * 2 + Duration::from_millis(u64::from(CQT_MS));
            for field in [
                format!("hold_ms={}", rule.as_millis()),
                format!("cqt_ms={CQT_MS}"),
                "cqt_from=\"target\"".to_string(),
            ] {
                assert!(line.contains(&field), "{field} missing in: {line}");
            }
        }
    }
}

/// The longest any one I/O may take while paths fail under it one at a time: a moved write
/// waits for the CCR through the live path, or at worst for the time rule of the
/// association it was on (2 x KATO + CQT after its last contact) and one more path change.
const IO_BOUND: Duration = Duration::from_millis(2 * (2 * 500 + CQT_MS as u64));

/// Block `b`'s I/O until `stop`: a write of the next pattern, or a read that must find the
/// last acknowledged one; each bounded by [`IO_BOUND`]. Returns the I/O done and the
/// slowest, or what went wrong.
async fn steady_io(
    io: Arc<Io>,
    b: usize,
    seed: u64,
    stop: Arc<AtomicBool>,
) -> Result<(u64, Duration), String> {
    let mut rng = SmallRng::seed_from_u64(seed ^ b as u64);
    let (mut seq, mut acked) = (0u64, None);
    let (mut n, mut slowest) = (0u64, Duration::ZERO);
    let mut got = [0u8; BLOCK];
    while !stop.load(Ordering::Relaxed) {
        let t0 = tokio::time::Instant::now();
        let write = rng.random_bool(0.7);
        let r = if write {
            seq += 1;
            tokio::time::timeout(IO_BOUND, io.write(b, &pattern(b, seq))).await
        } else {
            tokio::time::timeout(IO_BOUND, io.read(b, &mut got)).await
        };
        let what = if write { "write" } else { "read" };
        match r {
            Err(_) => return Err(format!("block {b}: a {what} took more than {IO_BOUND:?}")),
            Ok(Err(e)) => return Err(format!("block {b}: a {what} failed: {e}")),
            Ok(Ok(())) if write => acked = Some(seq),
            Ok(Ok(())) => {
                if let Some(a) = acked.filter(|a| got != pattern(b, *a)) {
                    return Err(format!(
                        "block {b}: read back another write than its last acknowledged ({a})"
                    ));
                }
            }
        }
        slowest = slowest.max(t0.elapsed());
        n += 1;
    }
    Ok((n, slowest))
}

/// Path A's host device reset every `periods[0]`, path B's unplugged every `periods[1]`
/// (jittered), until `stop`; a fault waits until the other path is LIVE, so one path is
/// always up. Returns the faults inflicted.
async fn faults_one_path_at_a_time(
    w: (&[DeviceFaults], &[Arc<Controller>]),
    seed: u64,
    stop: Arc<AtomicBool>,
) -> Result<[u32; 2], String> {
    let (faults, ctrls) = w;
    let mut rng = SmallRng::seed_from_u64(seed);
    let periods = [
        rng.random_range(80..=250u64),
        rng.random_range(1500..=3000u64),
    ];
    let now = tokio::time::Instant::now();
    let mut due = periods.map(|p| now + Duration::from_millis(p));
    let mut count = [0u32; 2];
    loop {
        let i = usize::from(due[1] < due[0]);
        tokio::time::sleep_until(due[i]).await;
        if stop.load(Ordering::Relaxed) {
            return Ok(count);
        }
        let other = &ctrls[1 - i];
        if !until(Duration::from_secs(10), || other.state() == CtrlState::Live).await {
            return Err(format!(
                "path {} stayed down: {:?}",
                2 - i,
                other.status().machine
            ));
        }
        let down = Duration::from_millis(rng.random_range(0..=300));
        if i == 0 {
            faults[0].reset(down.min(Duration::from_millis(50))).await?;
        } else {
            faults[1].unplug(down).await?;
        }
        count[i] += 1;
        let jitter = rng.random_range(0..=periods[i] / 4);
        due[i] = tokio::time::Instant::now() + Duration::from_millis(periods[i] + jitter);
    }
}

async fn io_under_faults(seed: u64) -> Result<String, String> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let setup = Setup {
        mode: SafeRetry::Ccr,
        paths: 2,
        queues: 2,
        late_ms: rng.random_range(20..=u32::from(CQT_MS) - 20),
        ccr: true,
        policy: IoPolicy::RoundRobin,
    };
    let w = world(seed, setup).await;
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..32)
        .map(|b| tokio::spawn(steady_io(w.io.clone(), b, seed, stop.clone())))
        .collect();
    let chaos = {
        let (f, c, stop) = (w.faults.clone(), w.ctrls.clone(), stop.clone());
        tokio::spawn(async move { faults_one_path_at_a_time((&f, &c), seed, stop).await })
    };
    tokio::time::sleep(Duration::from_secs(8)).await;
    stop.store(true, Ordering::Relaxed);
    let count = chaos.await.map_err(|e| e.to_string())??;
    let (mut ios, mut slowest) = (0, Duration::ZERO);
    for h in workers {
        let (n, s) = h.await.map_err(|e| e.to_string())??;
        ios += n;
        slowest = slowest.max(s);
    }
    if count[0] == 0 || count[1] == 0 {
        return Err(format!("faults {count:?}: a path never failed"));
    }
    Ok(format!(
        "{ios} I/Os, {} resets, {} unplugs, slowest I/O {slowest:?}",
        count[0], count[1]
    ))
}

/// Two paths (round-robin) under 32 blocks' steady writes and reads, path A's HCA reset and
/// path B's unplugged on seeded schedules of their own, never both down, each lost
/// connection's writes executing late in the target: every I/O completes within
/// [`IO_BOUND`] and reads back the last acknowledged write. A write moved off a failed path
/// waits only for the association it was in flight on, not for the later losses of its path.
#[test]
fn two_paths_under_resets_and_unplugs_every_io_completes_in_time() {
    for seed in crate::rig::sweep_seeds("FAILOVER_SEEDS", 8) {
        match crate::rig::sim_runtime().block_on(io_under_faults(seed)) {
            Ok(s) => println!("SIM_SEED={seed}: {s}"),
            Err(e) => panic!("SIM_SEED={seed}: {e}"),
        }
    }
}

/// A live controller's CCR log keeps the resets it ran, those answered at once too, and the
/// target refuses the next once it holds 16: the host clears it (Remove Completed) and asks
/// again, so every loss of path A is settled by a CCR through path B, however many there are.
#[test]
fn many_cross_controller_resets_through_one_controller_all_succeed() {
    crate::rig::sim_runtime().block_on(async {
        let s = Setup {
            paths: 2,
            ..setup(SafeRetry::Ccr)
        };
        let w = world(17, s).await;
        let (a, b) = (&w.ctrls[0], &w.ctrls[1]);
        for i in 0..24 {
            let old = a.instance().expect("path A live");
            assert!(w.target.lose_controller(old.cntlid));
            assert!(
                until(Duration::from_secs(5), || a
                    .instance()
                    .is_some_and(|n| n != old))
                .await,
                "path A did not come back"
            );
            let r = b.cross_reset(old).await;
            assert!(
                matches!(r, Ok(CcrOutcome::Succeeded)),
                "CCR {i} through path B: {r:?}"
            );
        }
    });
}

//! The ghost write on the real stack, single path: the controller, its recovery and the
//! built-in target (late-writes fault, CQT, CCR) on the simulated network in tokio's paused
//! time, one world per seed.
//!
//! Each block has one writer that writes, waits for the acknowledgement, and writes again.
//! The target's backend stalls, so every writer has a write held in it; the controller is
//! lost; the dead controller's held writes execute `late` ms later (less than CQT, so the
//! target's promise holds). The host reconnects; each writer goes on for a few writes and
//! stops. Once the late writes are over, each block must hold its last acknowledged write.
//! With `--safe-retry off` the resent write is acknowledged, overwritten by the next one, and
//! then by the stale original: corrupted blocks. With `cqt` (time rule) and `ccr` (the new
//! association resets the old one) none.
//!
//! `GHOST_SEEDS=n` sets the number of seeds per mode (default 200); a failure prints
//! `GHOST_SEED=<seed>`, which runs that seed alone.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nvmf_rdma::driver::{CmService, SimNet, SoftHca};
use nvmf_rdma::harness::chaos::{connect_seeded_host, host_options, CHAOS_NQN};
use nvmf_rdma::hca::sim::Faults;
use nvmf_rdma::nvme::Nqn;
use nvmf_rdma::nvmet::{serve_cm, Namespace, Subsystem, Target, TargetConfig};
use nvmf_rdma::reconnect::hold::{HoldPolicy, SafeRetry};
use nvmf_rdma::reconnect::CtrlState;
use nvmf_rdma::transport::Controller;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const HOST_IP: [u8; 4] = [127, 0, 1, 1];
const TARGET_IP: [u8; 4] = [127, 0, 2, 1];
const KATO: Duration = Duration::from_millis(500);
const CQT_MS: u16 = 300;
const BLOCK: usize = 512;

struct World {
    _net: SimNet,
    hca: SoftHca,
    target: Target<SoftHca>,
    ns: Arc<Namespace>,
    c: Arc<Controller>,
}

impl Drop for World {
    fn drop(&mut self) {
        self.hca.fatal();
    }
}

async fn world(seed: u64, mode: SafeRetry, queues: usize, late_ms: u32, ccr: bool) -> World {
    let net = SimNet::new(seed, Faults::NONE);
    let hca = SoftHca::start_on(
        crate::rig::device_on(45, "tgt", 1, TARGET_IP),
        &net.fabric(),
    )
    .await
    .unwrap();
    let ns = Arc::new(Namespace::ram(1, 1 << 20, 9));
    let tc = TargetConfig {
        subsystems: vec![Subsystem::new(
            Nqn::new(CHAOS_NQN).unwrap(),
            vec![ns.clone()],
        )],
        cqt_ms: CQT_MS,
        late_writes_ms: Some(late_ms),
        offer_ccr: ccr,
        ..TargetConfig::default()
    };
    let target = Target::start(hca.clone(), tc).unwrap();
    serve_cm(target.clone(), CmService::for_device(&hca)).unwrap();
    let mut p =
        crate::rig::reconnect_at_once(Some(Duration::from_secs(60)), Duration::from_secs(60));
    p.keep_alive_tmo = KATO;
    let mut o = host_options(hca.addr(), queues, 32, p);
    o.safe_retry = HoldPolicy {
        mode,
        ..HoldPolicy::default()
    };
    let c = connect_seeded_host(&net.device_manager(), HOST_IP, seed, o)
        .await
        .unwrap();
    World {
        _net: net,
        hca,
        target,
        ns,
        c: Arc::new(c),
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

async fn run_seed(seed: u64, mode: SafeRetry, ccr: bool) -> Result<Outcome, String> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let queues = rng.random_range(1..=2);
    // Late enough to land after the resend and the next write; within CQT.
    let late = rng.random_range(60..=u32::from(CQT_MS) - 20);
    let w = world(seed, mode, queues, late, ccr).await;
    let blocks = rng.random_range(2..=8);
    // Last acknowledged write of each block (None: a write failed, the block is unknown).
    let acked: Arc<Mutex<Vec<Option<u64>>>> = Arc::new(Mutex::new(vec![Some(0); blocks]));
    for b in 0..blocks {
        w.c.write(1, b as u64, &pattern(b, 0))
            .await
            .map_err(|e| e.to_string())?;
    }
    let writes = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let lost = Arc::new(AtomicBool::new(false));
    let mut writers = Vec::new();
    for b in 0..blocks {
        let extra = rng.random_range(1..=4u32);
        let (c, acked, writes, failed, lost) = (
            w.c.clone(),
            acked.clone(),
            writes.clone(),
            failed.clone(),
            lost.clone(),
        );
        writers.push(tokio::spawn(async move {
            let mut seq = 0;
            let mut after = 0;
            while after < extra {
                let past = lost.load(Ordering::Acquire);
                seq += 1;
                match c.write(1, b as u64, &pattern(b, seq)).await {
                    Ok(()) => acked.lock().unwrap()[b] = Some(seq),
                    Err(_) => {
                        failed.fetch_add(1, Ordering::Relaxed);
                        acked.lock().unwrap()[b] = None;
                    }
                }
                writes.fetch_add(1, Ordering::Relaxed);
                if past {
                    after += 1;
                }
            }
        }));
    }
    let at = rng.random_range(1..40u64);
    until(Duration::from_secs(5), || {
        writes.load(Ordering::Relaxed) >= at
    })
    .await;
    // The backend stalls with writes in it; the connection is lost.
    w.target.stall_io(true);
    if !until(Duration::from_secs(5), || w.target.stalled_io() >= 1).await {
        return Err("no write reached the stalled backend".into());
    }
    tokio::time::sleep(Duration::from_micros(rng.random_range(0..200))).await;
    let cntlid = w.c.instance().ok_or("no live association")?.cntlid;
    let died = tokio::time::Instant::now();
    if !w.target.lose_controller(cntlid) {
        return Err(format!("no controller {cntlid} to lose"));
    }
    w.target.stall_io(false);
    lost.store(true, Ordering::Release);
    let done = until(Duration::from_secs(30), || {
        writers.iter().all(|h| h.is_finished())
    })
    .await;
    if !done {
        return Err(format!("writers hung; status {:?}", w.c.status().machine));
    }
    let settle = died.elapsed();
    if !until(Duration::from_secs(30), || w.target.late_writes_held() == 0).await {
        return Err("the late writes never ended".into());
    }
    if w.c.state() != CtrlState::Live {
        return Err(format!("controller {:?}", w.c.state()));
    }
    let acked = acked.lock().unwrap().clone();
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
    let held = w.c.safe_retry().holds;
    if !held.is_empty() {
        return Err(format!("holds left over: {held:?}"));
    }
    Ok(Outcome {
        blocks,
        corrupted,
        failed_writes: failed.load(Ordering::Relaxed),
        settle,
    })
}

/// Run the seeds of `mode` (or the one in `GHOST_SEED`); what they found in total.
fn sweep(mode: SafeRetry, ccr: bool) -> Vec<(u64, Outcome)> {
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
        let r = crate::rig::sim_runtime().block_on(run_seed(seed, mode, ccr));
        match r {
            Ok(o) => out.push((seed, o)),
            Err(e) => panic!("GHOST_SEED={seed} (mode {mode}): {e}"),
        }
    }
    out
}

fn report(mode: SafeRetry, runs: &[(u64, Outcome)]) -> usize {
    let corrupted: usize = runs.iter().map(|(_, o)| o.corrupted.len()).sum();
    let blocks: usize = runs.iter().map(|(_, o)| o.blocks).sum();
    let failed: u64 = runs.iter().map(|(_, o)| o.failed_writes).sum();
    let worst = runs.iter().map(|(_, o)| o.settle).max().unwrap_or_default();
    println!(
        "safe-retry {mode}: {} seeds, {blocks} blocks, {corrupted} corrupted, {failed} failed \
         writes, longest loss-to-settled {worst:?} (virtual)",
        runs.len()
    );
    corrupted
}

#[test]
fn without_safe_retry_a_stale_write_overwrites_an_acknowledged_one() {
    let runs = sweep(SafeRetry::Off, true);
    let corrupted = report(SafeRetry::Off, &runs);
    assert!(
        corrupted > 0,
        "no ghost write in {} seeds: the test cannot tell",
        runs.len()
    );
}

fn no_ghost(mode: SafeRetry, ccr: bool) -> Vec<(u64, Outcome)> {
    let runs = sweep(mode, ccr);
    report(mode, &runs);
    for (seed, o) in &runs {
        assert!(
            o.corrupted.is_empty() && o.failed_writes == 0,
            "GHOST_SEED={seed} (mode {mode}): blocks {:?} lost their last acknowledged \
             write, {} writes failed",
            o.corrupted,
            o.failed_writes
        );
    }
    runs
}

#[test]
fn the_time_rule_leaves_no_ghost_write() {
    no_ghost(SafeRetry::Cqt, true);
}

#[test]
fn a_cross_controller_reset_leaves_no_ghost_write() {
    let runs = no_ghost(SafeRetry::Ccr, true);
    let worst = runs.iter().map(|(_, o)| o.settle).max().unwrap_or_default();
    assert!(
        worst < 2 * KATO,
        "a CCR should settle well before the time rule; the slowest seed took {worst:?}"
    );
}

/// Mode `ccr` against a target that does not offer CCR (CCRL 0, the command an Invalid
/// Opcode, as Linux nvmet): the host falls back to the time rule, so no ghost write, and
/// the held writes wait at least 2 x KATO + CQT after the loss.
#[test]
fn without_ccr_on_the_target_the_ccr_mode_falls_back_to_the_time_rule() {
    let runs = no_ghost(SafeRetry::Ccr, false);
    let quickest = runs.iter().map(|(_, o)| o.settle).min().unwrap_or_default();
    assert!(
        quickest >= 2 * KATO + Duration::from_millis(u64::from(CQT_MS)) - Duration::from_millis(50),
        "a seed settled in {quickest:?}, sooner than the time rule allows"
    );
}

/// A read and a write in flight when the controller is lost (time rule, no CCR): the read
/// is resent as soon as the controller is back, and so is new I/O; only the write waits,
/// and `list` shows its hold.
#[test]
fn the_hold_delays_only_the_writes_that_were_in_flight() {
    crate::rig::sim_runtime().block_on(async {
        let w = world(7, SafeRetry::Cqt, 1, 100, true).await;
        w.c.write(1, 1, &pattern(1, 1)).await.unwrap();
        w.target.stall_io(true);
        let (c1, c2) = (w.c.clone(), w.c.clone());
        let write = tokio::spawn(async move { c1.write(1, 0, &pattern(0, 9)).await });
        let read = tokio::spawn(async move { c2.read(1, 1, BLOCK).await });
        assert!(until(Duration::from_secs(5), || w.target.stalled_io() == 2).await);
        let died = tokio::time::Instant::now();
        let cntlid = w.c.instance().unwrap().cntlid;
        assert!(w.target.lose_controller(cntlid));
        w.target.stall_io(false);
        assert!(until(Duration::from_secs(5), || read.is_finished()).await);
        let read_after = died.elapsed();
        assert_eq!(read.await.unwrap().unwrap(), pattern(1, 1));
        // New I/O goes while the old write is held.
        w.c.write(1, 2, &pattern(2, 1)).await.unwrap();
        assert!(!write.is_finished(), "the write was not held");
        let s = w.c.safe_retry();
        assert_eq!(s.mode, SafeRetry::Cqt);
        assert_eq!(s.holds.len(), 1, "{s:?}");
        let h = s.holds[0];
        assert_eq!((h.held, h.by.name()), (1, "time"));
        assert!(h.time_left > Duration::from_millis(1000), "{h:?}");
        assert_ne!(
            Some(h.instance),
            w.c.instance(),
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
        assert!(w.c.safe_retry().holds.is_empty());
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
            let w = world(11, mode, 1, 100, true).await;
            w.target.stall_io(true);
            let c = w.c.clone();
            let write = tokio::spawn(async move { c.write(1, 0, &pattern(0, 1)).await });
            assert!(until(Duration::from_secs(5), || w.target.stalled_io() == 1).await);
            let old = w.c.instance().unwrap();
            let died = tokio::time::Instant::now();
            assert!(w.target.lose_controller(old.cntlid));
            w.target.stall_io(false);
            // Once the host knows of the loss.
            assert!(until(Duration::from_secs(5), || w.c.instance() != Some(old)).await);
            let known = tokio::time::Instant::now();
            w.c.quiesced().await;
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
                let w = world(13, SafeRetry::Ccr, 1, 100, ccr).await;
                w.c.write(1, 0, &pattern(0, 1)).await.unwrap();
                let cntlid = w.c.instance().unwrap().cntlid;
                assert!(w.target.lose_controller(cntlid));
                // Completes on the next association: the loss has been handled.
                w.c.write(1, 1, &pattern(1, 1)).await.unwrap();
                // A deleted controller resends nothing: no line for its end.
                w.c.delete().await;
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

//! The real controller and recovery supervisor, end to end on the simulated backend: the
//! soft-HCA driver, device manager, CM and built-in target over a seeded in-memory network
//! (`SimNet`, the link model of `hca::sim`), no sockets (the runtime has no I/O driver), in
//! tokio's paused time. Every seed builds a new world on a new runtime, so a seed replays
//! the same run, packet for packet.
//!
//! - The seed sweep: verified I/O while random faults hit (device reset, unplug + replug,
//!   user reset, target restart, reset storm, and here also a network partition), on a clean
//!   or a lossy link (drop, duplicate, reorder, corrupt). Every seed must end with zero lost
//!   or corrupted acknowledged writes, zero failed or hung I/Os, no double or stray
//!   completions and a live controller. `SIM_SWEEP_SEEDS=n` sets the number of seeds
//!   (default 500); a failure prints `SIM_SEED=<seed> cargo test --release --test
//!   sim_recovery recovery_seed_sweep` to replay it.
//! - The same seed twice gives the same summary: I/O counts, recoveries, link statistics,
//!   virtual time, and a hash of every delivery.
//! - Reset, unplug and replug of the same card, another card in the slot, with the timers
//!   checked to the millisecond (virtual time does not jitter).

use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use nvmf_rdma::driver::{DeviceManager, SimNet};
use nvmf_rdma::harness::chaos::{
    connect_host, connect_seeded_host, host_identity, host_options, judge_storm, Fault, TargetRig,
    Verifiers, WorkerReport, HOST_DEV,
};
use nvmf_rdma::hca::sim::{Faults, LinkStats};
use nvmf_rdma::reconnect::{Cause, CtrlState, FailReason, IdentityMatch, Policy};
use nvmf_rdma::transport::{Controller, HostError};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Loopback addresses, as on one host: the soft-HCA treats other peers as real RoCE devices.
const HOST_IP: [u8; 4] = [127, 0, 1, 1];
const TARGET_IP: [u8; 4] = [127, 0, 2, 1];
const NS_BYTES: u64 = 4 << 20;
const CTRL_LOSS: Duration = Duration::from_secs(30);

fn policy() -> Policy {
    crate::rig::reconnect_at_once(Some(CTRL_LOSS), CTRL_LOSS)
}

fn completed(c: &Controller) -> u64 {
    // The I/O queues' (the admin queue, first, has the controller's own commands).
    c.queue_stats().iter().skip(1).map(|s| s.completed).sum()
}

/// Wait (in virtual time) until `c` completed `n` more I/Os, or every worker ended.
async fn until_completed(
    c: &Controller,
    at: u64,
    workers: &[tokio::task::JoinHandle<WorkerReport>],
) {
    // Sampled each virtual millisecond: a spin would keep tokio's paused clock from moving.
    while completed(c) < at && !workers.iter().all(|w| w.is_finished()) {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// What one seed did; equal for equal seeds.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Summary {
    lossy: bool,
    ops: u64,
    writes: u64,
    bytes_verified: u64,
    faults: Vec<&'static str>,
    recoveries: u64,
    requeued: u64,
    link: LinkStats,
    trace: u64,
    virtual_ns: u128,
    lat_ns_sum: u64,
}

/// The link of a seed: clean for half the seeds, lossy (rarely enough that RC retransmits
/// keep up) for the other half. `SIM_LINK=lossy` makes that half `Faults::LOSSY` (10% loss,
/// duplication and reordering, 1% corruption), for exploring: not every seed can pass
/// there. A reconnect needs every CM REQ and REP of its queues through (six MADs for two I/O
/// queues), and a lost one is resent after the CM response timeout (4.3 s, as Linux), past
/// the attempt's 2 s connect timeout; so about one attempt in two fails, and once in a few
/// thousand recoveries (seed 972 of 2000) every attempt until ctrl_loss_tmo does.
fn link_faults(rng: &mut SmallRng) -> Faults {
    if rng.random_bool(0.5) {
        Faults::NONE
    } else if std::env::var("SIM_LINK").is_ok_and(|v| v == "lossy") {
        Faults::LOSSY
    } else {
        Faults {
            drop: 0.002,
            duplicate: 0.002,
            reorder: 0.01,
            reorder_window_ns: 20_000,
            corrupt: 0.0005,
            latency_ns: 2_000,
            ..Faults::NONE
        }
    }
}

/// One seed in a world of its own. Err says what broke.
async fn run_seed(seed: u64) -> Result<Summary, String> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let link = link_faults(&mut rng);
    // The link turns lossy once the host is connected: a first connect is not retried (as
    // in Linux), and a CM message lost then waits out a 4 s CM timeout, past the connect's.
    let net = SimNet::new(seed, Faults::NONE);
    let mut target = TargetRig::start_on(&net.fabric(), TARGET_IP, NS_BYTES)
        .await
        .map_err(|e| format!("target: {e}"))?;
    let mgr = net.device_manager();
    let queues = rng.random_range(1..=2);
    let o = host_options(target.addr, queues, 16, policy());
    let c = Arc::new(
        connect_seeded_host(&mgr, HOST_IP, seed, o)
            .await
            .map_err(|e| format!("connect: {e:#}"))?,
    );
    net.set_faults(link);
    let stop = Arc::new(AtomicBool::new(false));
    let workers = Verifiers::spawn_sweep(
        &c,
        &stop,
        seed,
        &mut rng,
        CTRL_LOSS + Duration::from_secs(5),
    );
    let nfaults = rng.random_range(1..=3);
    let mut faults = Vec::new();
    for _ in 0..nfaults {
        let at = completed(&c) + rng.random_range(1..30);
        until_completed(&c, at, &workers).await;
        if workers.iter().all(|w| w.is_finished()) {
            break;
        }
        if rng.random_range(0..8) == 0 {
            // The network's own fault: host and target cut off from each other for up to
            // 3 s (past the RC retry budget, short of keep-alive loss, or past it).
            let lasting = Duration::from_millis(rng.random_range(50..=3000));
            let (h, t) = (IpAddr::from(HOST_IP), IpAddr::from(TARGET_IP));
            net.partition(h, t);
            tokio::time::sleep(lasting).await;
            net.heal();
            faults.push("partition");
            continue;
        }
        let f = Fault::random(&mut rng, Duration::from_millis(20));
        f.inflict(&mgr, &c, Some(&mut target))
            .await
            .map_err(|e| format!("{}: {e}", f.name()))?;
        faults.push(f.name());
    }
    let (all, st) = judge_storm(&c, workers, CTRL_LOSS + Duration::from_secs(10)).await?;
    let requeued = c.queue_stats().iter().map(|s| s.requeued).sum();
    let summary = Summary {
        lossy: link != Faults::NONE,
        ops: all.reads + all.writes,
        writes: all.writes,
        bytes_verified: all.bytes_verified,
        faults,
        recoveries: st.machine.recoveries,
        requeued,
        link: net.stats(),
        trace: net.trace_hash(),
        virtual_ns: net.now().as_nanos(),
        lat_ns_sum: all.lat_ns.iter().sum(),
    };
    match Arc::try_unwrap(c) {
        Ok(c) => c.disconnect().await,
        Err(_) => return Err("controller still shared".into()),
    }
    Ok(summary)
}

fn replay(seed: u64) -> Result<Summary, String> {
    crate::rig::sim_runtime().block_on(run_seed(seed))
}

/// A seed whose virtual time stops moving (tasks that keep each other busy without ever
/// waiting for a timer) would spin forever in real time: after `WALL_LIMIT` of wall-clock
/// time on one seed, name it and abort.
fn watchdog(current: Arc<AtomicU64>) {
    const WALL_LIMIT: Duration = Duration::from_secs(30);
    std::thread::spawn(move || {
        let (mut seen, mut since) = (u64::MAX, std::time::Instant::now());
        loop {
            std::thread::sleep(Duration::from_millis(500));
            let now = current.load(Ordering::Relaxed);
            if now != seen {
                (seen, since) = (now, std::time::Instant::now());
            } else if since.elapsed() > WALL_LIMIT {
                eprintln!(
                    "seed {now} ran {WALL_LIMIT:?} of wall-clock time: virtual time is stuck \
                     (a livelock)\nreplay: SIM_SEED={now} cargo test --release --test \
                     sim_recovery recovery_seed_sweep -- --nocapture"
                );
                std::process::abort();
            }
        }
    });
}

#[test]
fn recovery_seed_sweep() {
    let seeds = crate::rig::sweep_seeds("SIM_SWEEP_SEEDS", 500);
    let t0 = std::time::Instant::now();
    let (mut ops, mut faults, mut recoveries, mut virt) = (0, 0, 0, 0u128);
    let mut lossy = 0;
    let current = Arc::new(AtomicU64::new(u64::MAX));
    watchdog(current.clone());
    for &seed in &seeds {
        current.store(seed, Ordering::Relaxed);
        match replay(seed) {
            Ok(s) => {
                if seeds.len() == 1 {
                    println!("seed {seed}: {s:?}");
                }
                ops += s.ops;
                faults += s.faults.len();
                recoveries += s.recoveries;
                virt += s.virtual_ns;
                lossy += u64::from(s.lossy);
            }
            Err(e) => panic!(
                "seed {seed} failed: {e}\nreplay: SIM_SEED={seed} cargo test --release --test suite sim_recovery::recovery_seed_sweep -- --nocapture"
            ),
        }
    }
    println!(
        "{} seeds ({lossy} on a lossy link): {ops} verified I/Os, {faults} faults, {recoveries} \
         recoveries, {:.1} s of virtual time in {:.1} s",
        seeds.len(),
        virt as f64 / 1e9,
        t0.elapsed().as_secs_f64()
    );
}

#[test]
fn the_same_seed_replays_the_same_run() {
    for seed in [3u64, 8, 21] {
        let a = replay(seed).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        let b = replay(seed).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        assert_eq!(a, b, "seed {seed} ran differently twice");
        assert!(a.ops > 0 && a.link.delivered > 0, "{a:?}");
    }
    // And the seed matters: another seed is another run.
    assert_ne!(replay(3).unwrap().trace, replay(4).unwrap().trace);
}

#[test]
fn a_replay_in_another_process_prints_the_same_summary() {
    // Another process: other heap addresses (they reach the wire as MR addresses), other
    // hash seeds, another tokio runtime seed. The replay command a failure prints must
    // still give the same run.
    let seed = 21u64;
    let here = replay(seed).unwrap();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "sim_recovery::recovery_seed_sweep",
            "--exact",
            "--nocapture",
        ])
        .env("SIM_SEED", seed.to_string())
        .env_remove("SIM_SWEEP_SEEDS")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    let want = format!("seed {seed}: {here:?}");
    assert!(
        stdout.lines().any(|l| l == want),
        "replayed differently:\n{stdout}\nwanted:\n{want}"
    );
}

/// A world with one controller on a clean link.
async fn rig(seed: u64, p: Policy) -> (SimNet, DeviceManager, TargetRig, Arc<Controller>) {
    let net = SimNet::new(seed, Faults::NONE);
    let t = TargetRig::start_on(&net.fabric(), TARGET_IP, NS_BYTES)
        .await
        .unwrap();
    let mgr = net.device_manager();
    let c = connect_host(&mgr, HOST_IP, host_options(t.addr, 2, 32, p))
        .await
        .unwrap();
    (net, mgr, t, Arc::new(c))
}

async fn recovered(c: &Controller, n: u64) {
    c.wait_status(Duration::from_secs(20), |s| {
        s.state() == CtrlState::Live && s.machine.recoveries >= n
    })
    .await
    .expect("controller recovered");
}

#[test]
fn resets_under_io_lose_nothing_acknowledged() {
    crate::rig::sim_runtime().block_on(async {
        let (_net, mgr, _t, c) = rig(1, policy()).await;
        let stop = Arc::new(AtomicBool::new(false));
        let ws = Verifiers {
            workers: 4,
            blocks: 1024,
            max_blocks: 64,
            hang_after: Duration::from_secs(40),
        }
        .spawn(&c, &stop, |w| (w + 1, None));
        for i in 1..=5 {
            let at = completed(&c) + 20;
            until_completed(&c, at, &ws).await;
            mgr.reset(HOST_DEV, Duration::from_millis(5 * i))
                .await
                .unwrap();
            recovered(&c, i).await;
        }
        let at = completed(&c) + 20;
        until_completed(&c, at, &ws).await;
        stop.store(true, Ordering::Relaxed);
        let mut r = WorkerReport::default();
        for w in ws {
            r.absorb(w.await.unwrap());
        }
        assert_eq!((r.mismatches, r.hangs), (0, 0), "{r:?}");
        assert!(r.errors.is_empty(), "{:?}", r.errors);
        assert!(r.writes > 50 && r.reads > 50, "{r:?}");
        let requeued: u64 = c.queue_stats().iter().map(|s| s.requeued).sum();
        assert!(requeued > 0, "resets hit in-flight I/O");
        let st = c.status();
        assert_eq!(st.machine.recoveries, 5);
        assert_eq!(st.machine.cause, Some(Cause::DeviceFatal));
        for s in c.queue_stats() {
            assert_eq!((s.unknown_cid, s.duplicate_completion), (0, 0), "{s:?}");
        }
    });
}

#[test]
fn unplug_and_replug_of_the_same_card_reconnects() {
    crate::rig::sim_runtime().block_on(async {
        let (_net, mgr, _t, c) = rig(2, policy()).await;
        let data = vec![0xA5u8; 64 << 10];
        c.write(1, 100, &data).await.unwrap();
        mgr.unplug(HOST_DEV).await.unwrap();
        c.wait_status(Duration::from_secs(5), |s| {
            s.state() == CtrlState::Connecting && !s.machine.device_present
        })
        .await
        .unwrap();
        // I/O issued while the card is out is held, then completes.
        let c2 = c.clone();
        let pending = tokio::spawn(async move { c2.read(1, 100, 64 << 10).await });
        let w = {
            let c = c.clone();
            tokio::spawn(async move { c.write(1, 500, &[0x3Cu8; 4096]).await })
        };
        // Out for a while: longer than keep-alive, well within the replug window.
        tokio::time::sleep(Duration::from_secs(7)).await;
        assert!(!pending.is_finished() && !w.is_finished(), "held while out");
        mgr.replug(host_identity(0)).await.unwrap();
        recovered(&c, 1).await;
        assert!(pending.await.unwrap().unwrap() == data);
        w.await.unwrap().unwrap();
        assert!(c.read(1, 500, 4096).await.unwrap() == vec![0x3Cu8; 4096]);
        assert_eq!(c.status().machine.cause, Some(Cause::DeviceRemoved));
    });
}

#[test]
fn another_card_in_the_slot_is_not_ours_and_io_fails_at_ctrl_loss_tmo() {
    crate::rig::sim_runtime().block_on(async {
        let p = Policy {
            ctrl_loss_tmo: Some(Duration::from_secs(2)),
            ..policy()
        };
        let (_net, mgr, _t, c) = rig(3, p).await;
        mgr.unplug(HOST_DEV).await.unwrap();
        let t0 = tokio::time::Instant::now();
        mgr.replug(host_identity(1)).await.unwrap(); // other GUID and PCI address
        let e = c.read(1, 0, 4096).await.expect_err("no path");
        let waited = t0.elapsed();
        assert!(matches!(e, HostError::Path(FailReason::CtrlLoss)), "{e:?}");
        // Virtual time: ctrl_loss_tmo to the millisecond, whatever the machine's load.
        assert!(
            waited >= Duration::from_millis(1999) && waited <= Duration::from_millis(2002),
            "{waited:?}"
        );
        let st = c.status();
        assert_eq!(st.state(), CtrlState::Dead);
        assert!(st.machine.foreign_device);
        assert_eq!(
            st.machine.attempt, 0,
            "never connected through the imposter"
        );
        assert!(matches!(
            c.write(1, 0, &[0u8; 512]).await,
            Err(HostError::Path(FailReason::CtrlLoss))
        ));
    });
}

#[test]
fn another_card_is_accepted_when_the_policy_allows_any() {
    crate::rig::sim_runtime().block_on(async {
        let p = Policy {
            identity: IdentityMatch::Any,
            ..policy()
        };
        let (_net, mgr, _t, c) = rig(4, p).await;
        c.write(1, 7, &[7u8; 512]).await.unwrap();
        mgr.unplug(HOST_DEV).await.unwrap();
        mgr.replug(host_identity(1)).await.unwrap();
        recovered(&c, 1).await;
        assert!(c.read(1, 7, 512).await.unwrap() == vec![7u8; 512]);
        assert_eq!(c.status().machine.cause, Some(Cause::DeviceRemoved));
    });
}

#[test]
fn a_partition_past_keep_alive_is_recovered_and_loses_nothing() {
    crate::rig::sim_runtime().block_on(async {
        let p = Policy {
            keep_alive_tmo: Duration::from_secs(1),
            ..policy()
        };
        let (net, _mgr, _t, c) = rig(5, p).await;
        c.write(1, 0, &[9u8; 4096]).await.unwrap();
        let (h, t) = (IpAddr::from(HOST_IP), IpAddr::from(TARGET_IP));
        net.partition(h, t);
        let c2 = c.clone();
        let write = tokio::spawn(async move { c2.write(1, 8, &[6u8; 4096]).await });
        c.wait_status(Duration::from_secs(10), |s| s.state() != CtrlState::Live)
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert!(!write.is_finished(), "held while the network is cut");
        net.heal();
        recovered(&c, 1).await;
        write.await.unwrap().unwrap();
        assert!(c.read(1, 0, 4096).await.unwrap() == vec![9u8; 4096]);
        assert!(c.read(1, 8, 4096).await.unwrap() == vec![6u8; 4096]);
        assert!(net.stats().dropped > 0);
    });
}

#[test]
fn a_device_that_never_returns_fails_fast_then_is_lost_on_time() {
    crate::rig::sim_runtime().block_on(async {
        let p = Policy {
            ctrl_loss_tmo: Some(Duration::from_secs(3)),
            fast_io_fail_tmo: Some(Duration::from_secs(1)),
            ..policy()
        };
        let (_net, mgr, _t, c) = rig(6, p).await;
        mgr.unplug(HOST_DEV).await.unwrap();
        let t0 = tokio::time::Instant::now();
        let e = c.read(1, 0, 4096).await.expect_err("held, then failed");
        let at = t0.elapsed();
        assert!(
            matches!(e, HostError::Path(FailReason::FastIoFail)),
            "{e:?}"
        );
        assert!(
            at >= Duration::from_millis(999) && at <= Duration::from_millis(1002),
            "{at:?}"
        );
        assert_eq!(c.state(), CtrlState::Connecting);
        let st = c
            .wait_status(Duration::from_secs(5), |s| s.state() == CtrlState::Dead)
            .await
            .unwrap();
        assert_eq!(st.machine.fail_reason, Some(FailReason::CtrlLoss));
        let lost_at = t0.elapsed();
        assert!(
            lost_at >= Duration::from_millis(2999) && lost_at <= Duration::from_millis(3002),
            "{lost_at:?}"
        );
    });
}

#[test]
fn a_target_restart_under_io_is_survived_with_its_data() {
    crate::rig::sim_runtime().block_on(async {
        let (_net, _mgr, mut t, c) = rig(7, policy()).await;
        let before = vec![0x42u8; 128 << 10];
        c.write(1, 6000, &before).await.unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let ws = Verifiers {
            workers: 2,
            blocks: 1024,
            max_blocks: 64,
            hang_after: Duration::from_secs(40),
        }
        .spawn(&c, &stop, |w| (w + 1, None));
        let at = completed(&c) + 20;
        until_completed(&c, at, &ws).await;
        t.restart().await.unwrap();
        recovered(&c, 1).await;
        let at = completed(&c) + 20;
        until_completed(&c, at, &ws).await;
        stop.store(true, Ordering::Relaxed);
        let mut r = WorkerReport::default();
        for w in ws {
            r.absorb(w.await.unwrap());
        }
        assert_eq!((r.mismatches, r.hangs), (0, 0), "{r:?}");
        assert!(r.errors.is_empty(), "{:?}", r.errors);
        assert!(c.read(1, 6000, 128 << 10).await.unwrap() == before);
    });
}

#[test]
fn the_recovery_trace_accounts_for_each_phase_in_virtual_time() {
    crate::rig::sim_runtime().block_on(async {
        let (_net, mgr, _t, c) = rig(6, policy()).await;
        c.write(1, 3, &[3u8; 4096]).await.unwrap();
        assert_eq!(c.status().last_trace, None, "no recovery yet");
        let t0 = c.now();
        // The device is down for 300 ms of virtual time: that is the wait, to the
        // millisecond, and every other phase is a few round trips of the simulated link.
        mgr.reset(HOST_DEV, Duration::from_millis(300))
            .await
            .unwrap();
        recovered(&c, 1).await;
        let st = c.status();
        let tr = st
            .last_trace
            .expect("a completed recovery leaves its trace");
        let marks: Vec<u64> = std::iter::once(Some(t0))
            .chain(tr.steps())
            .map(|m| m.expect("every phase is marked").0)
            .collect();
        assert!(marks.windows(2).all(|w| w[0] <= w[1]), "in order: {tr:?}");
        let ms = |a: u64, b: u64| Duration::from_nanos(b - a);
        let down = ms(marks[2], marks[4]);
        assert!(
            down >= Duration::from_millis(299) && down <= Duration::from_millis(302),
            "torn down -> device open is the 300 ms the device was down: {down:?}"
        );
        assert!(ms(marks[0], marks[2]) < Duration::from_millis(2), "{tr:?}");
        // CM connect, admin connect + enable, I/O queues: a few round trips each, and a
        // packet on the simulated link takes a millisecond of virtual time (tokio's timer
        // resolution rounds its 2 µs latency up), so no phase waits on a timer of its own.
        for w in marks[4..].windows(2) {
            assert!(ms(w[0], w[1]) <= Duration::from_millis(12), "{tr:?}");
        }
        assert_eq!(tr.attempts, 1, "the device came back once, whole");
        assert_eq!(st.last_recovery, Some(ms(marks[1], marks[7])));
        assert!(c.read(1, 3, 4096).await.unwrap() == vec![3u8; 4096]);
    });
}

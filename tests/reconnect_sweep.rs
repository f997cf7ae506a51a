//! Seed sweep of the recovery path: for each seed, a host connects to the built-in target and
//! runs verified I/O while random faults hit (device reset, unplug + replug, user reset,
//! target restart, a storm of resets 20-50 ms apart) at random points. Every seed must end with zero lost or corrupted
//! acknowledged writes, zero I/O failures (all within ctrl_loss_tmo), zero hangs and zero
//! double or stray completions.
//!
//! `SWEEP_SEEDS=n` sets how many seeds (default 500); a failure prints
//! `SWEEP_SEED=<seed> cargo test --test reconnect_sweep` to replay that seed alone. The
//! seeds run in [`SHARDS`] threads at once; within each, one thread runs host and target,
//! so the fault schedule (chosen from the seed and keyed on I/O counts) replays the same
//! way; socket timing still varies a little between runs. The same
//! sweep on the simulated backend, in virtual time and replayable exactly, is
//! `tests/suite/sim_recovery.rs`.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use nvmf_rdma::driver::DeviceManager;
use nvmf_rdma::harness::chaos::{
    connect_seeded_host, host_options, judge_storm, Fault, TargetRig, Verifiers,
};
use nvmf_rdma::reconnect::Policy;
use nvmf_rdma::transport::Controller;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const IP: [u8; 4] = [127, 0, 0, 1];
const CTRL_LOSS: Duration = Duration::from_secs(30);

fn policy() -> Policy {
    // Reconnect at once; the rest (keep-alive 5 s, both identities) as the defaults.
    Policy {
        ctrl_loss_tmo: Some(CTRL_LOSS),
        reconnect_delay: Duration::ZERO,
        replug_window: CTRL_LOSS,
        ..Policy::default()
    }
}

fn completed(c: &Controller) -> u64 {
    c.queue_stats().iter().map(|s| s.completed).sum()
}

/// One seed; Err describes what broke.
async fn run_seed(seed: u64, target: &mut TargetRig) -> Result<(u64, u64), String> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mgr = DeviceManager::new(true);
    let queues = rng.random_range(1..=2);
    // Each seed's host is a new machine: its own card (keys and QP numbers come from the OS
    // CSPRNG anyway; the target may still hold connections of an earlier seed's reset host
    // until their keep-alive expires).
    let o = host_options(target.addr, queues, 16, policy());
    let c = Arc::new(
        connect_seeded_host(&mgr, IP, seed, o)
            .await
            .map_err(|e| format!("connect: {e:#}"))?,
    );
    let stop = Arc::new(AtomicBool::new(false));
    let workers = Verifiers::spawn_sweep(
        &c,
        &stop,
        seed,
        &mut rng,
        CTRL_LOSS + Duration::from_secs(5),
    );
    let nfaults = rng.random_range(1..=3);
    let mut faults = 0;
    for _ in 0..nfaults {
        // Strike after a random number of completions.
        let at = completed(&c) + rng.random_range(1..30);
        while completed(&c) < at && !workers.iter().all(|w| w.is_finished()) {
            tokio::task::yield_now().await;
        }
        if workers.iter().all(|w| w.is_finished()) {
            break;
        }
        let f = Fault::random(&mut rng, Duration::from_millis(20));
        f.inflict(&mgr, &c, Some(&mut *target))
            .await
            .map_err(|e| format!("{}: {e}", f.name()))?;
        faults += 1;
    }
    let (all, _) = judge_storm(&c, workers, CTRL_LOSS + Duration::from_secs(10)).await?;
    let ops = all.reads + all.writes;
    match Arc::try_unwrap(c) {
        Ok(c) => c.disconnect().await,
        Err(_) => return Err("controller still shared".into()),
    }
    Ok((ops, faults))
}

/// Seeds run in this many shards at once, each on a thread of its own with its own runtime
/// and target. A seed spends most of its time waiting (reconnects, keep-alives, storms 20-50
/// ms apart), about a third of a core, so four shards take a quarter of the time on two
/// cores; within a shard one thread still runs host and target, as the replay needs.
const SHARDS: u64 = 4;

/// Run `seeds` in order on a new current-thread runtime with one target; the verified I/Os
/// and faults, or the first failure with its replay line.
fn run_shard(seeds: Vec<u64>) -> Result<(u64, u64), String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("runtime: {e}"))?;
    rt.block_on(async {
        let mut target = TargetRig::start(IP, 4 << 20)
            .await
            .map_err(|e| format!("target: {e}"))?;
        let (mut ops, mut faults) = (0, 0);
        for seed in seeds {
            let (o, f) = run_seed(seed, &mut target).await.map_err(|e| {
                format!(
                    "seed {seed} failed: {e}\nreplay: SWEEP_SEED={seed} cargo test --test reconnect_sweep"
                )
            })?;
            ops += o;
            faults += f;
        }
        Ok((ops, faults))
    })
}

#[test]
fn recovery_seed_sweep() {
    let seeds: Vec<u64> = match std::env::var("SWEEP_SEED") {
        Ok(s) => vec![s.parse().expect("SWEEP_SEED is a number")],
        Err(_) => {
            let n: u64 = std::env::var("SWEEP_SEEDS")
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(500);
            (1..=n).collect()
        }
    };
    let t0 = std::time::Instant::now();
    let n = seeds.len();
    let shards: Vec<_> = (0..SHARDS)
        .map(|k| {
            let mine: Vec<u64> = seeds.iter().copied().filter(|s| s % SHARDS == k).collect();
            std::thread::spawn(move || run_shard(mine))
        })
        .collect();
    let (mut ops, mut faults) = (0, 0);
    let mut failures = Vec::new();
    for s in shards {
        match s.join() {
            Ok(Ok((o, f))) => {
                ops += o;
                faults += f;
            }
            Ok(Err(e)) => failures.push(e),
            Err(_) => failures.push("a shard panicked (its message is above)".into()),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    println!(
        "{n} seeds in {SHARDS} shards, {ops} verified I/Os, {faults} faults, {:.1} s",
        t0.elapsed().as_secs_f64()
    );
}

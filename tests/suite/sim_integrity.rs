//! Data integrity under a bad link, end to end on the simulated backend: the real host and
//! built-in target over a seeded `SimNet` with loss, delay, duplication and reordering, in
//! tokio's paused time. Verifiers side by side (up to 32 commands in flight on a queue, as
//! fio's loss job) mix host reads and writes of 512 B to 128 KiB of random data over the
//! queues' reused buffers and keys, and every read must match the last acknowledged write. A host READ is the target's RDMA WRITEs and
//! a SEND; a host WRITE is the target's RDMA READ of host memory: both directions of every
//! retransmit path carry data here. `SIM_SEED=<seed>` replays one seed,
//! `SIM_INTEGRITY_SEEDS=n` sets how many run (default 40).

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use nvmf_rdma::driver::SimNet;
use nvmf_rdma::harness::chaos::{
    connect_seeded_host, host_options, judge_storm, TargetRig, Verifiers,
};
use nvmf_rdma::hca::sim::{Faults, LinkStats};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const HOST_IP: [u8; 4] = [127, 0, 1, 1];
const TARGET_IP: [u8; 4] = [127, 0, 2, 1];
const NS_BYTES: u64 = 8 << 20;
const CTRL_LOSS: Duration = Duration::from_secs(30);
/// 128 KiB of 512-byte blocks.
const MAX_BLOCKS: u64 = 256;

/// A link as bad as `LOSS=5` through nftables and worse, drawn per seed: 1-10% loss,
/// duplicates, and packets held back past later ones by up to 2 ms on a base latency of
/// up to 100 µs, so that retransmit timers meet responses that are late, not lost, and
/// late duplicates of old requests and responses arrive after their command completed and
/// its buffer and key went to the next one.
fn link(rng: &mut SmallRng) -> Faults {
    Faults {
        drop: rng.random_range(0.01..=0.10),
        duplicate: rng.random_range(0.0..=0.10),
        reorder: rng.random_range(0.0..=0.20),
        reorder_window_ns: rng.random_range(20_000..=2_000_000),
        corrupt: 0.0,
        latency_ns: rng.random_range(2_000..=100_000),
        byte_ns: 0,
    }
}

/// One seed: the verified I/Os, and what the link did.
async fn run_seed(seed: u64) -> Result<(u64, u64, LinkStats), String> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let net = SimNet::new(seed, Faults::NONE);
    let target = TargetRig::start_on(&net.fabric(), TARGET_IP, NS_BYTES)
        .await
        .map_err(|e| format!("target: {e}"))?;
    let mgr = net.device_manager();
    // As fio's loss job (QD32 of 4 KiB on one queue) or spread over two queues, with
    // transfers of one to eight blocks or up to 128 KiB.
    let queues = rng.random_range(1..=2);
    let workers = [4, 8, 16, 32][rng.random_range(0..4)];
    let max_blocks = if rng.random_bool(0.5) { 8 } else { MAX_BLOCKS };
    let o = host_options(
        target.addr,
        queues,
        32,
        crate::rig::reconnect_at_once(Some(CTRL_LOSS), CTRL_LOSS),
    );
    let c = Arc::new(
        connect_seeded_host(&mgr, HOST_IP, seed, o)
            .await
            .map_err(|e| format!("connect: {e:#}"))?,
    );
    net.set_faults(link(&mut rng));
    let stop = Arc::new(AtomicBool::new(false));
    // One verifier per command in flight over the namespace's first 4 MiB, each reusing
    // the buffers and keys its queue gives it.
    let blocks = ((NS_BYTES / 2) / 512 / workers).max(MAX_BLOCKS);
    let workers = Verifiers {
        workers,
        blocks,
        max_blocks,
        hang_after: CTRL_LOSS + Duration::from_secs(5),
    }
    .spawn(&c, &stop, |w| {
        (seed.wrapping_mul(131).wrapping_add(w), Some(40))
    });
    // Each I/O has `hang_after`; a worker's 40 of up to 128 KiB on the worst links take
    // longer than that in all.
    let (all, _) = judge_storm(&c, workers, Duration::from_secs(600)).await?;
    let stats = net.stats();
    match Arc::try_unwrap(c) {
        Ok(c) => c.disconnect().await,
        Err(_) => return Err("controller still shared".into()),
    }
    if std::env::var("SIM_SEED").is_ok() {
        println!("seed {seed}: {:?} of virtual time, {stats:?}", net.now());
    }
    Ok((all.reads + all.writes, all.bytes_verified, stats))
}

#[test]
fn reads_match_acknowledged_writes_over_a_lossy_reordering_link() {
    let seeds = crate::rig::sweep_seeds("SIM_INTEGRITY_SEEDS", 40);
    let (mut ops, mut verified, mut dropped) = (0, 0, 0);
    for &seed in &seeds {
        match crate::rig::sim_runtime().block_on(run_seed(seed)) {
            Ok((n, v, l)) => {
                ops += n;
                verified += v;
                dropped += l.dropped;
            }
            Err(e) => panic!(
                "seed {seed} failed: {e}\nreplay: SIM_SEED={seed} cargo test --test suite \
                 sim_integrity:: -- --nocapture"
            ),
        }
    }
    assert!(
        verified > 0 && dropped > 0,
        "{ops} I/Os, {verified} bytes verified, {dropped} dropped"
    );
    println!(
        "{} seeds: {ops} I/Os, {verified} bytes verified, {dropped} packets dropped",
        seeds.len()
    );
}

//! Seed sweep: every seed builds its own random scenario (link faults, path MTU, a mix of
//! SEND / WRITE / READ with and without immediate data, 0 B .. 256 KiB, both directions at
//! once) and checks that every completion succeeds, comes out in posting order per QP, and
//! every byte lands where it should.
//!
//! `SIM_SEEDS=N` sweeps seeds 0..N (default 200); `SIM_SEED=S` runs just seed S. A failure
//! names its seed and the command that replays it bit for bit.
//!
//! One outcome is correct protocol behaviour and still fails the sweep: `retry_cnt` 7 means
//! seven retries (as on hardware; rxe reads 7 as "forever"), and at the top of the fault
//! range (15% drop + 2% corruption each way) a stalled head — a re-sent READ request and its
//! first response, or a re-sent request and its ACK — is lost about a third of the time, so
//! eight losses in a row happen about once per 10^4 stalls. The default seeds contain no such
//! case; of seeds 0..25000, nine (1668, 2614, 4331, 7486, 15288, 16949, 19311, 20164, 21580,
//! all with drop >= 13.7%) end in RetryExcErr that way, and three of them were traced packet
//! by packet: every retry's request or first response was dropped or corrupted by the link.
//! No other kind of failure showed up in those 25000 seeds.

mod common;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

use common::*;
use nvmf_rdma::hca::rc::{RcEnd, RcOptions};
use nvmf_rdma::hca::sim::{Faults, LinkStats};
use nvmf_rdma::hca::*;
use nvmf_rdma::verbs::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const DEFAULT_SEEDS: u64 = 200;
const MAX_LEN: usize = 256 << 10;
/// The sweep runs as this many tests so the harness can spread it over the cores.
const SHARDS: u64 = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Send,
    SendImm,
    Write,
    WriteImm,
    Read,
}

impl Kind {
    fn uses_receive(self) -> bool {
        matches!(self, Kind::Send | Kind::SendImm | Kind::WriteImm)
    }
}

/// One operation of a scenario. `from` posts it; each op has its own byte ranges.
#[derive(Debug, Clone, Copy)]
struct Op {
    kind: Kind,
    from: usize,
    len: usize,
    /// Offset in the poster's buffer: the source (SEND/WRITE) or destination (READ).
    local: usize,
    /// Offset in the peer's buffer: the receive buffer (SEND), the target (WRITE) or the
    /// source (READ).
    remote: usize,
    imm: u32,
}

#[derive(Debug)]
struct Scenario {
    faults: Faults,
    mtu: Mtu,
    /// Payload per packet when the pair stands for two contexts on the in-memory path
    /// (`QpAttr::in_memory_seg`); 0: the MTU.
    in_memory_seg: u32,
    ops: Vec<Op>,
    buf_len: usize,
}

fn scenario(seed: u64) -> Scenario {
    let mut rng = SmallRng::seed_from_u64(seed ^ 0x5157_ee9d);
    let faults = Faults {
        drop: rng.random_range(0.0..=0.15),
        duplicate: rng.random_range(0.0..=0.15),
        reorder: rng.random_range(0.0..=0.15),
        reorder_window_ns: rng.random_range(1_000..=50_000),
        corrupt: rng.random_range(0.0..=0.02),
        latency_ns: rng.random_range(500..=20_000),
        byte_ns: 0,
    };
    let mtu = [
        Mtu::Mtu256,
        Mtu::Mtu512,
        Mtu::Mtu1024,
        Mtu::Mtu2048,
        Mtu::Mtu4096,
    ][rng.random_range(0..5)];
    let in_memory_seg = [0, 0, MAX_IN_MEMORY_SEG][rng.random_range(0..3)];
    let n = rng.random_range(5..=20);
    // A bump allocator per device; every range is 64-byte aligned and used by one op only.
    let mut next = [0usize; 2];
    let mut alloc = |dev: usize, len: usize| {
        let at = next[dev];
        next[dev] += len.next_multiple_of(64).max(64);
        at
    };
    let ops = (0..n)
        .map(|_| {
            let kind = [
                Kind::Send,
                Kind::SendImm,
                Kind::Write,
                Kind::WriteImm,
                Kind::Read,
            ][rng.random_range(0..5)];
            // Log-uniform sizes, so single packets, a few packets and long messages all
            // show up; a few zero-length ones and a few of the maximum.
            let len = match rng.random_range(0..20) {
                0 => 0,
                1 => MAX_LEN,
                _ => (rng.random_range(0.0..(MAX_LEN as f64).ln()).exp() as usize).min(MAX_LEN),
            };
            let from = rng.random_range(0..2);
            let local = alloc(from, len);
            let remote = alloc(1 - from, len);
            Op {
                kind,
                from,
                len,
                local,
                remote,
                imm: rng.random(),
            }
        })
        .collect();
    Scenario {
        faults,
        mtu,
        in_memory_seg,
        ops,
        buf_len: next[0].max(next[1]).max(4096),
    }
}

/// What a finished run leaves behind, for the determinism check.
#[derive(Debug, PartialEq, Eq)]
struct Trace {
    link: LinkStats,
    stats: [Stats; 2],
    end: Instant,
}

fn ends(p: &Pair, dev: usize) -> (&RcEnd, &RcEnd) {
    if dev == 0 {
        (&p.a, &p.b)
    } else {
        (&p.b, &p.a)
    }
}

fn run_seed(seed: u64) -> Trace {
    let sc = scenario(seed);
    let ctx = format!(
        "seed {seed}: mtu {:?}, in-memory segment {}, {:?}, {} ops",
        sc.mtu,
        sc.in_memory_seg,
        sc.faults,
        sc.ops.len()
    );
    let mut p = pair(
        seed,
        sc.faults,
        RcOptions {
            mtu: sc.mtu,
            buf_len: sc.buf_len,
            in_memory_seg: sc.in_memory_seg,
            ..RcOptions::default()
        },
    );

    // Data: what each op moves, written into its source range.
    let mut expect = Vec::with_capacity(sc.ops.len());
    for (i, op) in sc.ops.iter().enumerate() {
        let (me, peer) = ends(&p, op.from);
        let data_seed = seed.wrapping_mul(1_000_003).wrapping_add(i as u64);
        expect.push(match op.kind {
            Kind::Read => fill(&peer.mem, op.remote, op.len, data_seed),
            _ => fill(&me.mem, op.local, op.len, data_seed),
        });
    }

    // Receives first, on the peer of each op that consumes one, in the order the ops will
    // arrive (the poster's order).
    let mut want_recv: [Vec<usize>; 2] = [Vec::new(), Vec::new()];
    let mut want_send: [Vec<usize>; 2] = [Vec::new(), Vec::new()];
    for (i, op) in sc.ops.iter().enumerate() {
        want_send[op.from].push(i);
        if op.kind.uses_receive() {
            let to = 1 - op.from;
            let (_, peer) = ends(&p, op.from);
            // WRITE with immediate consumes a receive but puts nothing in it.
            let len = if op.kind == Kind::WriteImm { 0 } else { op.len };
            let wr = recv_wr(i as u64, peer, op.remote, len);
            let qpn = peer.qpn;
            post_recv(&mut p.sim, to, qpn, wr);
            want_recv[to].push(i);
        }
    }
    // Then every op, both directions interleaved, all at once.
    for (i, op) in sc.ops.iter().enumerate() {
        let (me, peer) = ends(&p, op.from);
        let remote_addr = peer.mr.addr + op.remote as u64;
        let rkey = peer.mr.rkey;
        let sop = match op.kind {
            Kind::Send => SendOp::Send,
            Kind::SendImm => SendOp::SendWithImm(op.imm),
            Kind::Write => SendOp::Write { remote_addr, rkey },
            Kind::WriteImm => SendOp::WriteWithImm {
                remote_addr,
                rkey,
                imm: op.imm,
            },
            Kind::Read => SendOp::Read { remote_addr, rkey },
        };
        let wr = send_wr(i as u64, sop, me, op.local, op.len);
        let qpn = me.qpn;
        post_send(&mut p.sim, op.from, qpn, wr);
    }

    let cqs = [p.a.cq, p.b.cq];
    let want = [
        want_send[0].len() + want_recv[0].len(),
        want_send[1].len() + want_recv[1].len(),
    ];
    let mut got: [Vec<WorkCompletion>; 2] = [Vec::new(), Vec::new()];
    let done = p.sim.run_until(Duration::from_secs(600), |s| {
        for d in 0..2 {
            s.devices[d].poll_cq(cqs[d], usize::MAX, &mut got[d]);
        }
        got[0].len() >= want[0] && got[1].len() >= want[1]
    });
    assert!(
        done,
        "{ctx}: stalled at {:?} with {}/{} and {}/{} completions: {:?} {:?}\nlink {:?}\na {:?}\nb {:?}",
        p.sim.now,
        got[0].len(),
        want[0],
        got[1].len(),
        want[1],
        ids(&got[0]),
        ids(&got[1]),
        p.sim.link,
        p.sim.devices[0].stats(),
        p.sim.devices[1].stats(),
    );

    for dev in 0..2 {
        let (sends, recvs): (Vec<_>, Vec<_>) = got[dev]
            .iter()
            .partition(|w| !matches!(w.opcode, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm));
        let order = |v: &[&WorkCompletion]| v.iter().map(|w| w.wr_id as usize).collect::<Vec<_>>();
        assert_eq!(
            order(&sends),
            want_send[dev],
            "{ctx}: device {dev} send order"
        );
        assert_eq!(
            order(&recvs),
            want_recv[dev],
            "{ctx}: device {dev} receive order"
        );
        for w in &got[dev] {
            let op = sc.ops[w.wr_id as usize];
            assert_eq!(
                w.status,
                WcStatus::Success,
                "{ctx}: device {dev} wr {} {op:?}\ncompletions {:?} / {:?}\nlink {:?}\na {:?}\nb {:?}",
                w.wr_id,
                ids(&got[0]),
                ids(&got[1]),
                p.sim.link,
                p.sim.devices[0].stats(),
                p.sim.devices[1].stats(),
            );
            let is_recv = matches!(w.opcode, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm);
            let (opcode, imm) = match (op.kind, is_recv) {
                (Kind::Send, false) | (Kind::SendImm, false) => (WcOpcode::Send, None),
                (Kind::Write, false) | (Kind::WriteImm, false) => (WcOpcode::RdmaWrite, None),
                (Kind::Read, false) => (WcOpcode::RdmaRead, None),
                (Kind::Send, true) => (WcOpcode::Recv, None),
                (Kind::SendImm, true) => (WcOpcode::Recv, Some(op.imm)),
                (Kind::WriteImm, true) => (WcOpcode::RecvRdmaWithImm, Some(op.imm)),
                (k, true) => panic!("{ctx}: {k:?} completed a receive"),
            };
            assert_eq!(
                (w.opcode, w.imm, w.byte_len as usize),
                (opcode, imm, op.len),
                "{ctx}: device {dev} wr {} {op:?}",
                w.wr_id
            );
        }
    }

    for (i, op) in sc.ops.iter().enumerate() {
        let (me, peer) = ends(&p, op.from);
        let landed = match op.kind {
            Kind::Read => read(&me.mem, op.local, op.len),
            _ => read(&peer.mem, op.remote, op.len),
        };
        if landed != expect[i] {
            let at = landed.iter().zip(&expect[i]).position(|(a, b)| a != b);
            panic!("{ctx}: op {i} {op:?}: bytes differ, first at {at:?}");
        }
    }

    // Nothing more may complete after the fact (no duplicate completions).
    run_quiet(&mut p.sim, Duration::from_secs(60));
    for (d, &cq) in cqs.iter().enumerate() {
        let late = drain(&mut p.sim, d, cq);
        assert!(late.is_empty(), "{ctx}: late completions {:?}", ids(&late));
    }

    Trace {
        link: p.sim.link.clone(),
        stats: [
            p.sim.devices[0].stats().clone(),
            p.sim.devices[1].stats().clone(),
        ],
        end: p.sim.now,
    }
}

fn replay_hint(seed: u64) -> String {
    format!("replay with: SIM_SEED={seed} cargo test --test sim_sweep")
}

/// Run one seed; a failure re-panics with the seed and the replay command.
fn check_seed(seed: u64) {
    guarded(seed, run_seed);
}

fn guarded<T>(seed: u64, run: impl FnOnce(u64) -> T) {
    if let Err(e) = catch_unwind(AssertUnwindSafe(|| run(seed))) {
        let msg = e
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        panic!(
            "sim sweep failed at seed {seed}: {msg}\n{}",
            replay_hint(seed)
        );
    }
}

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    Some(
        v.trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a number")),
    )
}

/// The seeds shard `k` of `SHARDS` owns.
fn seeds(shard: u64) -> Vec<u64> {
    if let Some(s) = env_u64("SIM_SEED") {
        return if s % SHARDS == shard { vec![s] } else { vec![] };
    }
    let n = env_u64("SIM_SEEDS").unwrap_or(DEFAULT_SEEDS);
    (0..n).filter(|s| s % SHARDS == shard).collect()
}

fn sweep(shard: u64) {
    for seed in seeds(shard) {
        check_seed(seed);
    }
}

#[test]
fn sweep_shard_0() {
    sweep(0);
}
#[test]
fn sweep_shard_1() {
    sweep(1);
}
#[test]
fn sweep_shard_2() {
    sweep(2);
}
#[test]
fn sweep_shard_3() {
    sweep(3);
}

#[test]
fn a_seed_replays_identically() {
    let seed = env_u64("SIM_SEED").unwrap_or(7);
    let first = run_seed(seed);
    let second = run_seed(seed);
    assert_eq!(first, second, "seed {seed} is not deterministic");
    assert!(first.link.sent > 0);
}

#[test]
fn scenarios_cover_the_space() {
    // The generator itself: over the default sweep every op kind, both directions, every
    // MTU, packets of the MTU and of the in-memory path, zero-length and maximum-length
    // messages all occur, and ranges never overlap.
    let mut kinds = std::collections::HashSet::new();
    let mut mtus = std::collections::HashSet::new();
    let mut segs = std::collections::HashSet::new();
    let (mut zero, mut max, mut dirs) = (false, false, [false; 2]);
    for seed in 0..DEFAULT_SEEDS {
        let sc = scenario(seed);
        assert!((5..=20).contains(&sc.ops.len()));
        let f = sc.faults;
        assert!(f.drop <= 0.15 && f.duplicate <= 0.15 && f.reorder <= 0.15 && f.corrupt <= 0.02);
        mtus.insert(sc.mtu.bytes());
        segs.insert(sc.in_memory_seg);
        let mut ranges: [Vec<(usize, usize)>; 2] = [Vec::new(), Vec::new()];
        for op in &sc.ops {
            kinds.insert(format!("{:?}", op.kind));
            zero |= op.len == 0;
            max |= op.len == MAX_LEN;
            dirs[op.from] = true;
            ranges[op.from].push((op.local, op.local + op.len));
            ranges[1 - op.from].push((op.remote, op.remote + op.len));
            assert!(op.local + op.len <= sc.buf_len && op.remote + op.len <= sc.buf_len);
        }
        for r in &mut ranges {
            r.sort();
            assert!(
                r.windows(2).all(|w| w[0].1 <= w[1].0),
                "seed {seed}: overlap"
            );
        }
    }
    assert_eq!(kinds.len(), 5);
    assert_eq!(mtus.len(), 5);
    assert_eq!(segs.len(), 2);
    assert!(zero && max && dirs == [true, true]);
}

#[test]
fn failure_message_names_the_seed_and_the_replay_command() {
    let e = catch_unwind(|| guarded(1234, |_| panic!("bytes differ"))).unwrap_err();
    let msg = e.downcast_ref::<String>().expect("a formatted message");
    assert!(msg.contains("seed 1234"), "{msg}");
    assert!(msg.contains("bytes differ"), "{msg}");
    assert!(
        msg.ends_with("replay with: SIM_SEED=1234 cargo test --test sim_sweep"),
        "{msg}"
    );
}

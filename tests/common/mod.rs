//! Shared helpers for the simulator tests.
#![allow(dead_code)]

use std::time::Duration;

use nvmf_rdma::hca::rc::{connect_pair, RcEnd, RcOptions};
use nvmf_rdma::hca::sim::{Faults, Sim};
use nvmf_rdma::hca::*;
use nvmf_rdma::verbs::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

pub struct Pair {
    pub sim: Sim,
    pub a: RcEnd,
    pub b: RcEnd,
    pub opts: RcOptions,
}

pub fn pair(seed: u64, faults: Faults, opts: RcOptions) -> Pair {
    let mut sim = Sim::new(seed, faults, 2);
    let mut rng = SmallRng::seed_from_u64(seed ^ 0x5eed);
    let (pa, pb) = (Psn::new(rng.random()), Psn::new(rng.random()));
    let (d0, d1) = sim.devices.split_at_mut(1);
    let (a, b) = connect_pair(&mut d0[0], &mut d1[0], &opts, pa, pb).expect("connect");
    Pair { sim, a, b, opts }
}

pub fn fill(mem: &HostMem, offset: usize, len: usize, seed: u64) -> Vec<u8> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut v = vec![0u8; len];
    rng.fill(&mut v[..]);
    mem.write(offset, &v);
    v
}

pub fn read(mem: &HostMem, offset: usize, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    mem.read(offset, &mut v);
    v
}

/// Run until device `dev` has `n` completions on `cq`, or fail with the seed.
pub fn wait_wcs(
    sim: &mut Sim,
    dev: usize,
    cq: CqId,
    n: usize,
    limit: Duration,
) -> Vec<WorkCompletion> {
    let mut got = Vec::new();
    let ok = sim.run_until(limit, |s| {
        s.devices[dev].poll_cq(cq, usize::MAX, &mut got);
        got.len() >= n
    });
    assert!(
        ok,
        "seed {}: timed out at {:?} waiting for {n} completions on device {dev}, got {}: {:?}\nlink {:?}\nstats a {:?}\nstats b {:?}",
        sim.seed,
        sim.now,
        got.len(),
        got.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        sim.link,
        sim.devices[0].stats(),
        sim.devices[1].stats()
    );
    got
}

pub fn send_wr(wr_id: u64, op: SendOp, end: &RcEnd, offset: usize, len: usize) -> SendWr {
    SendWr::signaled(
        wr_id,
        op,
        Sgl::one(end.mr.addr + offset as u64, len as u32, end.mr.lkey),
    )
}

pub fn recv_wr(wr_id: u64, end: &RcEnd, offset: usize, len: usize) -> RecvWr {
    RecvWr {
        wr_id,
        sgl: Sgl::one(end.mr.addr + offset as u64, len as u32, end.mr.lkey),
    }
}

/// Everything on `cq` right now, without moving time.
pub fn drain(sim: &mut Sim, dev: usize, cq: CqId) -> Vec<WorkCompletion> {
    let mut got = Vec::new();
    sim.devices[dev].poll_cq(cq, usize::MAX, &mut got);
    got
}

/// Run until nothing is in flight and no timer is armed, or `limit` of virtual time passes.
/// Returns whether the world went quiet.
pub fn run_quiet(sim: &mut Sim, limit: Duration) -> bool {
    let end = sim.now + limit;
    while sim.now < end {
        if !sim.step() {
            return true;
        }
    }
    false
}

/// Every async event device `dev` has queued.
pub fn events(sim: &mut Sim, dev: usize) -> Vec<AsyncEvent> {
    std::iter::from_fn(|| sim.devices[dev].poll_event()).collect()
}

pub fn qp_state(sim: &Sim, dev: usize, qpn: Qpn) -> QpState {
    sim.devices[dev].query_qp(qpn).expect("qp").state
}

/// (wr_id, status) of each completion, for readable assertions.
pub fn ids(wcs: &[WorkCompletion]) -> Vec<(u64, WcStatus)> {
    wcs.iter().map(|w| (w.wr_id, w.status)).collect()
}

pub fn post_send(sim: &mut Sim, dev: usize, qpn: Qpn, wr: SendWr) {
    let now = sim.now;
    sim.devices[dev]
        .post_send(now, qpn, wr)
        .unwrap_or_else(|e| panic!("seed {}: post_send on device {dev}: {e}", sim.seed));
}

pub fn post_recv(sim: &mut Sim, dev: usize, qpn: Qpn, wr: RecvWr) {
    sim.devices[dev]
        .post_recv(qpn, wr)
        .unwrap_or_else(|e| panic!("seed {}: post_recv on device {dev}: {e}", sim.seed));
}

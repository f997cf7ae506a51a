//! `hca::verbs::conformance` on the soft-HCA (two devices in the simulator, clean link and a
//! lossy one). `tests/hw_backend.rs` runs the same checks on a kernel RDMA device.

mod common;

use std::time::Duration;

use nvmf_rdma::hca::device::Device;
use nvmf_rdma::hca::rc::{RcEnd, RcOptions};
use nvmf_rdma::hca::sim::Faults;
use nvmf_rdma::hca::verbs::{conformance, EndInfo, VerbsPair};
use nvmf_rdma::hca::Instant;

struct SoftPair {
    p: common::Pair,
    deadline: Instant,
}

fn info(e: &RcEnd) -> EndInfo {
    EndInfo {
        qpn: e.qpn,
        cq: e.cq,
        addr: e.mr.addr,
        len: e.mr.len as usize,
        lkey: e.mr.lkey,
        rkey: e.mr.rkey,
    }
}

impl VerbsPair for SoftPair {
    type V = Device;
    fn end(&self, side: usize) -> EndInfo {
        info(if side == 0 { &self.p.a } else { &self.p.b })
    }
    fn dev(&mut self, side: usize) -> &mut Device {
        &mut self.p.sim.devices[side]
    }
    fn now(&self) -> Instant {
        self.p.sim.now
    }
    fn write_buf(&mut self, side: usize, off: usize, data: &[u8]) {
        let e = if side == 0 { &self.p.a } else { &self.p.b };
        e.mem.write(off, data);
    }
    fn read_buf(&mut self, side: usize, off: usize, len: usize) -> Vec<u8> {
        common::read(
            if side == 0 {
                &self.p.a.mem
            } else {
                &self.p.b.mem
            },
            off,
            len,
        )
    }
    fn progress(&mut self) -> bool {
        self.p.sim.step();
        self.p.sim.now < self.deadline
    }
}

fn run(seed: u64, faults: Faults) {
    let p = common::pair(seed, faults, RcOptions::default());
    let deadline = p.sim.now + Duration::from_secs(30);
    let mut sp = SoftPair { p, deadline };
    conformance(&mut sp).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
}

#[test]
fn soft_hca_passes_the_verbs_conformance_checks() {
    run(1, Faults::NONE);
}

#[test]
fn soft_hca_passes_them_on_a_lossy_link() {
    for seed in 0..5 {
        run(seed, Faults::LOSSY);
    }
}

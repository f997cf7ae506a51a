//! SEND, RDMA WRITE and RDMA READ of 1 B .. 8 MiB through the simulator with 10% loss,
//! duplication and reordering: every byte arrives exactly, messages complete in order.

mod common;

use std::time::Duration;

use common::*;
use nvmf_rdma::hca::rc::RcOptions;
use nvmf_rdma::hca::sim::Faults;
use nvmf_rdma::verbs::*;

const SIZES: [usize; 12] = [
    1,
    3,
    255,
    256,
    1023,
    1024,
    1025,
    4096,
    65_537,
    300_001,
    1 << 20,
    8 << 20,
];

fn opts(mtu: Mtu) -> RcOptions {
    RcOptions {
        mtu,
        buf_len: 8 << 20,
        ..RcOptions::default()
    }
}

fn one_way(kind: &str, mtu: Mtu, seed: u64) {
    let mut p = pair(seed, Faults::LOSSY, opts(mtu));
    for (i, &len) in SIZES.iter().enumerate() {
        let data = fill(&p.a.mem, 0, len, seed + i as u64);
        let wr_id = i as u64;
        match kind {
            "send" => {
                p.sim.devices[1]
                    .post_recv(p.b.qpn, recv_wr(wr_id, &p.b, 0, 8 << 20))
                    .unwrap();
                let now = p.sim.now;
                p.sim.devices[0]
                    .post_send(now, p.a.qpn, send_wr(wr_id, SendOp::Send, &p.a, 0, len))
                    .unwrap();
                let wa = wait_wcs(&mut p.sim, 0, p.a.cq, 1, Duration::from_secs(60));
                assert_eq!(wa[0].status, WcStatus::Success, "seed {seed} len {len}");
                let wb = wait_wcs(&mut p.sim, 1, p.b.cq, 1, Duration::from_secs(60));
                assert_eq!(
                    (wb[0].wr_id, wb[0].status, wb[0].byte_len as usize),
                    (wr_id, WcStatus::Success, len)
                );
                assert!(
                    read(&p.b.mem, 0, len) == data,
                    "seed {seed}: SEND {len} B corrupted"
                );
            }
            "write" => {
                let op = SendOp::Write {
                    remote_addr: p.b.mr.addr,
                    rkey: p.b.mr.rkey,
                };
                let now = p.sim.now;
                p.sim.devices[0]
                    .post_send(now, p.a.qpn, send_wr(wr_id, op, &p.a, 0, len))
                    .unwrap();
                let wa = wait_wcs(&mut p.sim, 0, p.a.cq, 1, Duration::from_secs(60));
                assert_eq!(
                    (wa[0].status, wa[0].opcode),
                    (WcStatus::Success, WcOpcode::RdmaWrite),
                    "seed {seed} len {len}"
                );
                assert!(
                    read(&p.b.mem, 0, len) == data,
                    "seed {seed}: WRITE {len} B corrupted"
                );
            }
            "read" => {
                // Read B's buffer into A's.
                let data = fill(&p.b.mem, 0, len, seed ^ len as u64);
                let op = SendOp::Read {
                    remote_addr: p.b.mr.addr,
                    rkey: p.b.mr.rkey,
                };
                let now = p.sim.now;
                p.sim.devices[0]
                    .post_send(now, p.a.qpn, send_wr(wr_id, op, &p.a, 0, len))
                    .unwrap();
                let wa = wait_wcs(&mut p.sim, 0, p.a.cq, 1, Duration::from_secs(60));
                assert_eq!(
                    (wa[0].status, wa[0].opcode, wa[0].byte_len as usize),
                    (WcStatus::Success, WcOpcode::RdmaRead, len),
                    "seed {seed}"
                );
                assert!(
                    read(&p.a.mem, 0, len) == data,
                    "seed {seed}: READ {len} B corrupted"
                );
            }
            _ => unreachable!(),
        }
    }
    let l = &p.sim.link;
    assert!(
        l.dropped > 0 && l.duplicated > 0 && l.reordered > 0,
        "faults did not happen: {l:?}"
    );
    assert!(p.sim.devices[0].stats().retransmits > 0);
}

#[test]
fn send_1b_to_8mib_lossy() {
    one_way("send", Mtu::Mtu1024, 11);
}

#[test]
fn write_1b_to_8mib_lossy() {
    one_way("write", Mtu::Mtu4096, 12);
}

#[test]
fn read_1b_to_8mib_lossy() {
    one_way("read", Mtu::Mtu2048, 13);
}

#[test]
fn small_mtu_multi_packet_messages() {
    one_way("send", Mtu::Mtu256, 14);
    one_way("read", Mtu::Mtu512, 15);
}

/// Many messages back to back: receives complete in posting order with their own bytes.
#[test]
fn pipelined_sends_arrive_in_order() {
    let seed = 21;
    let mut p = pair(
        seed,
        Faults::LOSSY,
        RcOptions {
            buf_len: 4 << 20,
            ..RcOptions::default()
        },
    );
    let n = 64;
    let slot = 40_000;
    let mut expect = Vec::new();
    for i in 0..n {
        let len = 1 + (i * 613) % slot;
        expect.push(fill(&p.a.mem, i * slot, len, i as u64));
        p.sim.devices[1]
            .post_recv(p.b.qpn, recv_wr(i as u64, &p.b, i * slot, slot))
            .unwrap();
    }
    for (i, e) in expect.iter().enumerate() {
        let now = p.sim.now;
        let op = if i % 3 == 0 {
            SendOp::SendWithImm(i as u32)
        } else {
            SendOp::Send
        };
        p.sim.devices[0]
            .post_send(now, p.a.qpn, send_wr(i as u64, op, &p.a, i * slot, e.len()))
            .unwrap();
    }
    let wb = wait_wcs(&mut p.sim, 1, p.b.cq, n, Duration::from_secs(120));
    for (i, wc) in wb.iter().enumerate() {
        assert_eq!(wc.wr_id, i as u64, "seed {seed}: out of order");
        assert_eq!(wc.status, WcStatus::Success);
        assert_eq!(wc.byte_len as usize, expect[i].len());
        assert_eq!(wc.imm, (i % 3 == 0).then_some(i as u32));
        assert!(read(&p.b.mem, i * slot, expect[i].len()) == expect[i]);
    }
    let wa = wait_wcs(&mut p.sim, 0, p.a.cq, n, Duration::from_secs(60));
    assert!(wa
        .iter()
        .enumerate()
        .all(|(i, w)| w.wr_id == i as u64 && w.status == WcStatus::Success));
}

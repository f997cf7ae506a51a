//! ACK coalescing in the responder, on virtual time: an owed ACK waits for a packet of ours
//! to the same peer and leaves right after it, or leaves alone once the device's ACK delay
//! has passed, or at once when many packets are owed one; a delay of zero acknowledges at
//! once.

mod common;

use std::time::Duration;

use common::*;
use nvmf_rdma::hca::qp::DEFAULT_ACK_DELAY;
use nvmf_rdma::hca::rc::RcOptions;
use nvmf_rdma::hca::sim::Faults;
use nvmf_rdma::verbs::*;

/// One-way link latency of `Faults::NONE`.
const LATENCY_NS: u64 = 2_000;
const DEFAULT_ACK_DELAY_NS: u64 = DEFAULT_ACK_DELAY.as_nanos() as u64;

fn fresh(seed: u64) -> Pair {
    pair(seed, Faults::NONE, RcOptions::default())
}

/// A sends one SEND to B; returns how long (virtual) A waited for its send completion.
fn lone_send(p: &mut Pair) -> u64 {
    post_recv(&mut p.sim, 1, p.b.qpn, recv_wr(1, &p.b, 0, 64));
    let t0 = p.sim.now;
    post_send(
        &mut p.sim,
        0,
        p.a.qpn,
        send_wr(1, SendOp::Send, &p.a, 0, 64),
    );
    let wa = wait_wcs(&mut p.sim, 0, p.a.cq, 1, Duration::from_secs(1));
    assert_eq!(wa[0].status, WcStatus::Success);
    p.sim.now.0 - t0.0
}

#[test]
fn a_lone_ack_waits_the_delay_then_leaves() {
    let mut p = fresh(1);
    let acks = p.sim.devices[1].stats().acks_tx;
    let waited = lone_send(&mut p);
    assert!(
        waited >= DEFAULT_ACK_DELAY_NS,
        "the ACK left after {waited} ns, before the {DEFAULT_ACK_DELAY_NS} ns delay"
    );
    assert!(
        waited <= DEFAULT_ACK_DELAY_NS + 4 * LATENCY_NS,
        "the ACK took {waited} ns"
    );
    assert_eq!(p.sim.devices[1].stats().acks_tx, acks + 1);
    // B received the message when it arrived, not when it acknowledged it.
    assert_eq!(drain(&mut p.sim, 1, p.b.cq).len(), 1);
}

#[test]
fn zero_delay_acknowledges_at_once() {
    let mut p = fresh(2);
    p.sim.devices[1].set_ack_delay(Duration::ZERO);
    let waited = lone_send(&mut p);
    assert!(
        waited <= 2 * LATENCY_NS + 1_000,
        "round trip of {waited} ns with ACKs at once"
    );
}

#[test]
fn an_owed_ack_rides_behind_the_answer() {
    // B answers A's SEND with a SEND of its own, as a target answers a command with its
    // response: the ACK of A's message leaves with B's answer, not after the delay.
    let mut p = fresh(3);
    post_recv(&mut p.sim, 1, p.b.qpn, recv_wr(1, &p.b, 0, 64));
    post_recv(&mut p.sim, 0, p.a.qpn, recv_wr(2, &p.a, 4096, 64));
    let t0 = p.sim.now;
    post_send(
        &mut p.sim,
        0,
        p.a.qpn,
        send_wr(1, SendOp::Send, &p.a, 0, 64),
    );
    let wb = wait_wcs(&mut p.sim, 1, p.b.cq, 1, Duration::from_secs(1));
    assert_eq!((wb[0].wr_id, wb[0].status), (1, WcStatus::Success));
    assert_eq!(
        p.sim.devices[1].stats().acks_tx,
        0,
        "ACK left before the answer"
    );
    post_send(
        &mut p.sim,
        1,
        p.b.qpn,
        send_wr(2, SendOp::Send, &p.b, 0, 64),
    );
    // A sees both its send completion (B's ACK) and B's answer within a round trip.
    let mut wa = wait_wcs(&mut p.sim, 0, p.a.cq, 2, Duration::from_secs(1));
    wa.sort_by_key(|w| w.wr_id);
    assert_eq!(
        ids(&wa),
        vec![(1, WcStatus::Success), (2, WcStatus::Success)]
    );
    let waited = p.sim.now.0 - t0.0;
    assert!(
        waited < DEFAULT_ACK_DELAY_NS / 2,
        "A waited {waited} ns: the ACK did not ride with the answer"
    );
    assert_eq!(p.sim.devices[1].stats().acks_tx, 1);
}

#[test]
fn many_packets_are_acknowledged_without_waiting() {
    // With a one-second delay, only the packet-count rule can move A's window: 200 SENDs
    // in a row must not stall for the delay (the last few may wait for it).
    let mut p = fresh(4);
    p.sim.devices[1].set_ack_delay(Duration::from_secs(1));
    for i in 0..200 {
        post_recv(&mut p.sim, 1, p.b.qpn, recv_wr(i, &p.b, 0, 64));
    }
    let t0 = p.sim.now;
    for i in 0..200 {
        post_send(
            &mut p.sim,
            0,
            p.a.qpn,
            send_wr(i, SendOp::Send, &p.a, 0, 64),
        );
    }
    let wa = wait_wcs(&mut p.sim, 0, p.a.cq, 128, Duration::from_millis(10));
    assert!(wa.iter().all(|w| w.status == WcStatus::Success));
    assert!(
        p.sim.now.0 - t0.0 < 1_000_000,
        "128 sends took {} ns",
        p.sim.now.0 - t0.0
    );
    // The rest complete once the delay passes, with nothing lost.
    let rest = wait_wcs(
        &mut p.sim,
        0,
        p.a.cq,
        200 - wa.len(),
        Duration::from_secs(2),
    );
    assert!(rest.iter().all(|w| w.status == WcStatus::Success));
    assert_eq!(drain(&mut p.sim, 1, p.b.cq).len(), 200);
}

//! Error paths of the RC transport through the simulator, each pinned to the exact completion
//! status IBA (and rxe) give it: RNR, retry exhaustion, remote access and length errors,
//! SEND with Invalidate, WRITE with immediate, unsignaled work, and garbage on the wire.
//!
//! The fatal-error cases run on a clean link on purpose: a responder that hits a class J
//! error (IBA 9.9.3.1) sends its NAK once and enters ERR, dropping everything after it. If
//! that one NAK is lost the requester can only time out, and the WQE at its head (possibly
//! an earlier, executed one that the NAK would have acknowledged) ends in RetryExcErr, as on
//! hardware. The RNR case, which is recoverable, also runs under loss.

mod common;

use std::time::Duration;

use common::*;
use nvmf_rdma::hca::rc::{RcEnd, RcOptions};
use nvmf_rdma::hca::sim::{sim_addr, Faults};
use nvmf_rdma::hca::wire::{
    emit_packet, BthRepr, IcrcContext, Opcode, PacketHeaders, ParsedPacket, RethRepr, WireError,
};
use nvmf_rdma::hca::*;
use nvmf_rdma::verbs::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const SEC: Duration = Duration::from_secs(1);

fn opts() -> RcOptions {
    RcOptions {
        buf_len: 1 << 20,
        ..RcOptions::default()
    }
}

fn write_op(to: &RcEnd, offset: u64) -> SendOp {
    SendOp::Write {
        remote_addr: to.mr.addr + offset,
        rkey: to.mr.rkey,
    }
}

fn unsignaled(mut wr: SendWr) -> SendWr {
    wr.signaled = false;
    wr
}

// ---- duplicate READs ----------------------------------------------------------------------

/// A READ request with b's QP as its destination, from a's address, as a's PSN `psn`.
fn forged_read(p: &Pair, psn: Psn, va: u64, len: u32) -> Vec<u8> {
    let ctx = IcrcContext::new(sim_addr(0), sim_addr(1));
    let mut h = PacketHeaders::new(BthRepr::new(Opcode::RC_RDMA_READ_REQUEST, p.b.qpn, psn));
    h.reth = Some(RethRepr {
        va,
        rkey: p.b.mr.rkey,
        dma_len: len,
    });
    let mut out = Vec::new();
    emit_packet(&h, &[], &ctx, &mut out);
    out
}

/// Packets b sends after taking in a forged READ request (`forged_read`) and letting the
/// link settle.
fn answered(p: &mut Pair, psn: Psn, va: u64, len: u32) -> u64 {
    let pkt = forged_read(p, psn, va, len);
    let before = p.sim.devices[1].stats().tx_packets;
    let now = p.sim.now;
    p.sim.devices[1].handle_datagram(now, sim_addr(0), &pkt);
    run_quiet(&mut p.sim, SEC);
    p.sim.devices[1].stats().tx_packets - before
}

/// A duplicate READ request is answered again only if it asks for a part of a READ the
/// responder executed (rxe's rule), so a peer cannot make it queue or send more than it
/// was given the first time: before, any "duplicate" PSN with a valid key was executed,
/// whatever its length, and queued without a cap.
#[test]
fn duplicate_reads_are_answered_only_for_what_was_read() {
    let mut p = pair(131, Faults::NONE, opts());
    let src = fill(&p.b.mem, 0, 4096, 5);
    let rd = SendOp::Read {
        remote_addr: p.b.mr.addr,
        rkey: p.b.mr.rkey,
    };
    post_send(&mut p.sim, 0, p.a.qpn, send_wr(1, rd, &p.a, 0, 4096));
    post_recv(&mut p.sim, 1, p.b.qpn, recv_wr(10, &p.b, 1 << 19, 100));
    post_send(
        &mut p.sim,
        0,
        p.a.qpn,
        send_wr(2, SendOp::Send, &p.a, 1 << 19, 10),
    );
    let wa = wait_wcs(&mut p.sim, 0, p.a.cq, 2, SEC);
    assert_eq!(ids(&wa), [(1, WcStatus::Success), (2, WcStatus::Success)]);
    assert!(read(&p.a.mem, 0, 4096) == src);
    let (va, read_psn) = (p.b.mr.addr, p.a.psn);
    // A READ takes one PSN per response packet: 4 KiB at MTU 1024 takes four.
    let send_psn = read_psn.add(4);

    // The READ's PSN, asking for more than it read: dropped, nothing sent.
    assert_eq!(answered(&mut p, read_psn, va, 1 << 20), 0);
    // A "duplicate" READ at the PSN of the SEND: no READ was executed there.
    assert_eq!(answered(&mut p, send_psn, va, 4096), 0);
    assert_eq!(p.sim.devices[1].stats().dup_reads_dropped, 2);
    // The true duplicate, and a part of it, are answered again (4 KiB at MTU 1024: 4
    // response packets, then 2).
    assert_eq!(answered(&mut p, read_psn, va, 4096), 4);
    assert_eq!(answered(&mut p, read_psn, va + 2048, 2048), 2);
    assert_eq!(p.sim.devices[1].stats().dup_reads_dropped, 2);
    assert_eq!(qp_state(&p.sim, 1, p.b.qpn), QpState::Rts);
}

/// A late duplicate of a READ the requester has completed, answered while still queued, is
/// owed to no one once the requester starts a READ past its `max_rd_atomic` window: it must
/// not count against the responder's READs in flight. Before, it did, and the new READ (legal:
/// the requester had only `max_rd_atomic` in flight) was NAKed as an invalid request and the
/// QP went to ERR; under 5% loss, once spurious resends made such duplicates common, that
/// failed the NVMe-oF queue in every few-second run of 4 KiB writes (the target's READs).
#[test]
fn answers_to_late_duplicate_reads_do_not_count_against_new_reads() {
    let mut p = pair(
        132,
        Faults::NONE,
        RcOptions {
            max_rd_atomic: 2,
            ..opts()
        },
    );
    fill(&p.b.mem, 0, 3 * 4096, 6);
    let rd = SendOp::Read {
        remote_addr: p.b.mr.addr,
        rkey: p.b.mr.rkey,
    };
    post_send(&mut p.sim, 0, p.a.qpn, send_wr(1, rd, &p.a, 0, 4096));
    let wa = wait_wcs(&mut p.sim, 0, p.a.cq, 1, SEC);
    assert_eq!(ids(&wa), [(1, WcStatus::Success)]);
    let (va, r1) = (p.b.mr.addr, p.a.psn);
    // Taken in back to back, before b sends anything: a late duplicate of READ 1, then
    // READs 2 and 3 (4 KiB at MTU 1024: four PSNs each).
    let before = p.sim.devices[1].stats().clone();
    let now = p.sim.now;
    for (psn, at) in [(r1, va), (r1.add(4), va + 4096), (r1.add(8), va + 8192)] {
        let pkt = forged_read(&p, psn, at, 4096);
        p.sim.devices[1].handle_datagram(now, sim_addr(0), &pkt);
    }
    run_quiet(&mut p.sim, SEC);
    let b = p.sim.devices[1].stats();
    assert_eq!(qp_state(&p.sim, 1, p.b.qpn), QpState::Rts, "{b:?}");
    assert_eq!(b.naks_tx, before.naks_tx, "{b:?}");
    // READs 2 and 3 answered; the duplicate's answer dropped with READ 1's slot.
    assert_eq!(b.tx_packets - before.tx_packets, 8, "{b:?}");
}

// ---- RNR --------------------------------------------------------------------------------

#[test]
fn send_without_receive_is_rnr_naked_until_one_is_posted() {
    let mut p = pair(101, Faults::NONE, opts());
    let data = fill(&p.a.mem, 0, 3000, 1);
    post_send(
        &mut p.sim,
        0,
        p.a.qpn,
        send_wr(1, SendOp::Send, &p.a, 0, 3000),
    );
    // 2 ms of virtual time with no receive: RNR NAK after RNR NAK, nothing completes.
    let end = p.sim.now + Duration::from_millis(2);
    p.sim.run_until(Duration::from_millis(2), |s| s.now >= end);
    assert!(drain(&mut p.sim, 0, p.a.cq).is_empty());
    assert!(drain(&mut p.sim, 1, p.b.cq).is_empty());
    let (sa, sb) = (p.sim.devices[0].stats(), p.sim.devices[1].stats());
    assert!(sb.rnr_naks_tx >= 10, "{sb:?}");
    assert_eq!(sa.rnr_naks_rx, sb.rnr_naks_tx);
    // RNR waits are not transport timeouts and spend no transport retries.
    assert_eq!((sa.timeouts, sa.retransmits), (0, 0), "{sa:?}");
    assert_eq!(qp_state(&p.sim, 0, p.a.qpn), QpState::Rts);

    post_recv(&mut p.sim, 1, p.b.qpn, recv_wr(10, &p.b, 0, 4096));
    let wb = wait_wcs(&mut p.sim, 1, p.b.cq, 1, SEC);
    assert_eq!(
        (wb[0].wr_id, wb[0].status, wb[0].byte_len),
        (10, WcStatus::Success, 3000)
    );
    assert!(read(&p.b.mem, 0, 3000) == data);
    let wa = wait_wcs(&mut p.sim, 0, p.a.cq, 1, SEC);
    assert_eq!(ids(&wa), [(1, WcStatus::Success)]);
}

/// RNR under loss, behind a WRITE and ahead of a READ: the RNR NAKs (or their loss) must not
/// disturb the work around the SEND, and nothing may complete twice.
#[test]
fn rnr_wait_under_loss_keeps_order() {
    for seed in 0..20 {
        let mut p = pair(seed, Faults::LOSSY, opts());
        let data = fill(&p.a.mem, 0, 9000, seed);
        let rdata = fill(&p.b.mem, 500_000, 3000, seed + 1);
        post_send(
            &mut p.sim,
            0,
            p.a.qpn,
            send_wr(0, write_op(&p.b, 100_000), &p.a, 0, 5000),
        );
        post_send(
            &mut p.sim,
            0,
            p.a.qpn,
            send_wr(1, SendOp::Send, &p.a, 0, 3000),
        );
        let rd = SendOp::Read {
            remote_addr: p.b.mr.addr + 500_000,
            rkey: p.b.mr.rkey,
        };
        post_send(&mut p.sim, 0, p.a.qpn, send_wr(2, rd, &p.a, 10_000, 3000));
        let end = p.sim.now + Duration::from_millis(3);
        p.sim.run_until(SEC, |s| s.now >= end);
        post_recv(&mut p.sim, 1, p.b.qpn, recv_wr(10, &p.b, 20_000, 4000));
        let wa = wait_wcs(&mut p.sim, 0, p.a.cq, 3, 20 * SEC);
        let ok = WcStatus::Success;
        assert_eq!(ids(&wa), [(0, ok), (1, ok), (2, ok)], "seed {seed}");
        let wb = wait_wcs(&mut p.sim, 1, p.b.cq, 1, 20 * SEC);
        assert_eq!(ids(&wb), [(10, ok)], "seed {seed}");
        assert!(read(&p.b.mem, 100_000, 5000) == data[..5000]);
        assert!(read(&p.b.mem, 20_000, 3000) == data[..3000]);
        assert!(read(&p.a.mem, 10_000, 3000) == rdata);
        assert!(run_quiet(&mut p.sim, 20 * SEC));
        assert!(drain(&mut p.sim, 0, p.a.cq).is_empty(), "seed {seed}");
        assert!(drain(&mut p.sim, 1, p.b.cq).is_empty(), "seed {seed}");
    }
}

#[test]
fn rnr_retry_zero_fails_with_rnr_retry_exceeded_and_flushes_the_rest() {
    let mut p = pair(
        102,
        Faults::NONE,
        RcOptions {
            rnr_retry: 0,
            ..opts()
        },
    );
    for i in 1..=3 {
        post_send(
            &mut p.sim,
            0,
            p.a.qpn,
            send_wr(i, SendOp::Send, &p.a, 0, 100),
        );
    }
    let wa = wait_wcs(&mut p.sim, 0, p.a.cq, 3, SEC);
    assert_eq!(
        ids(&wa),
        [
            (1, WcStatus::RnrRetryExcErr),
            (2, WcStatus::WrFlushErr),
            (3, WcStatus::WrFlushErr)
        ]
    );
    assert_eq!(qp_state(&p.sim, 0, p.a.qpn), QpState::Err);
    assert_eq!(p.sim.devices[0].stats().rnr_naks_rx, 1);
    // Work posted to a QP in ERR is flushed at once.
    post_send(
        &mut p.sim,
        0,
        p.a.qpn,
        send_wr(4, SendOp::Send, &p.a, 0, 100),
    );
    assert_eq!(
        ids(&drain(&mut p.sim, 0, p.a.cq)),
        [(4, WcStatus::WrFlushErr)]
    );
    // RNR is not the responder's error: it stays usable.
    assert_eq!(qp_state(&p.sim, 1, p.b.qpn), QpState::Rts);
    assert!(drain(&mut p.sim, 1, p.b.cq).is_empty());
}

// ---- transport retries --------------------------------------------------------------------

#[test]
fn partition_exhausts_retries_by_timer() {
    let retry_cnt = 2u8;
    let o = RcOptions {
        retry_cnt,
        ..opts()
    };
    let mut p = pair(103, Faults::NONE, o);
    p.sim.partitions.push((0, 1));
    let start = p.sim.now;
    post_send(
        &mut p.sim,
        0,
        p.a.qpn,
        send_wr(1, write_op(&p.b, 0), &p.a, 0, 4096),
    );
    post_send(
        &mut p.sim,
        0,
        p.a.qpn,
        send_wr(2, SendOp::Send, &p.a, 0, 10),
    );
    let wa = wait_wcs(&mut p.sim, 0, p.a.cq, 2, 10 * SEC);
    assert_eq!(
        ids(&wa),
        [(1, WcStatus::RetryExcErr), (2, WcStatus::WrFlushErr)]
    );
    assert_eq!(qp_state(&p.sim, 0, p.a.qpn), QpState::Err);
    let s = p.sim.devices[0].stats().clone();
    // The ACK timer drove it: one expiry per retry plus the one that found none left, and
    // nothing from the peer (no NAK of any kind) was involved.
    assert_eq!(s.timeouts, retry_cnt as u64 + 1, "{s:?}");
    assert_eq!(s.retransmits, retry_cnt as u64, "{s:?}");
    assert_eq!(
        (s.rx_packets, s.naks_rx, s.seq_naks_rx, s.rnr_naks_rx),
        (0, 0, 0, 0)
    );
    let timeout_ns = 4096u64 << o.timeout;
    assert!(p.sim.now.as_nanos() - start.as_nanos() >= (retry_cnt as u64 + 1) * timeout_ns);
    assert_eq!(p.sim.devices[1].stats().rx_packets, 0);
    // On the cut link: every packet of both messages, any tail-loss probe, then the oldest
    // packet alone at each retry (nothing came back to say the rest is wanted; it used to
    // be both messages again each time).
    let first = 4096u64.div_ceil(o.mtu.bytes() as u64) + 1;
    assert_eq!(
        p.sim.link.dropped,
        first + s.tail_probes + retry_cnt as u64,
        "{s:?}"
    );
}

// ---- remote access errors ----------------------------------------------------------------

/// Post `op` (then a SEND behind it) from A and check: the op fails with RemAccessErr, the
/// SEND is flushed, and B's QP is in ERR with a QP access error event and its receive flushed.
fn expect_remote_access_error(p: &mut Pair, op: SendOp, len: usize) {
    post_recv(&mut p.sim, 1, p.b.qpn, recv_wr(10, &p.b, 0, 100));
    post_send(&mut p.sim, 0, p.a.qpn, send_wr(1, op, &p.a, 0, len));
    post_send(
        &mut p.sim,
        0,
        p.a.qpn,
        send_wr(2, SendOp::Send, &p.a, 0, 10),
    );
    let wa = wait_wcs(&mut p.sim, 0, p.a.cq, 2, SEC);
    assert_eq!(
        ids(&wa),
        [(1, WcStatus::RemAccessErr), (2, WcStatus::WrFlushErr)],
        "{op:?}"
    );
    assert_eq!(qp_state(&p.sim, 0, p.a.qpn), QpState::Err);
    assert_eq!(qp_state(&p.sim, 1, p.b.qpn), QpState::Err);
    let ev = events(&mut p.sim, 1);
    assert!(
        ev.contains(&AsyncEvent::QpAccessError(p.b.qpn)),
        "{op:?}: {ev:?}"
    );
    assert!(!ev.contains(&AsyncEvent::QpFatal(p.b.qpn)), "{ev:?}");
    assert_eq!(p.sim.devices[1].stats().access_errors, 1);
    assert_eq!(
        ids(&drain(&mut p.sim, 1, p.b.cq)),
        [(10, WcStatus::WrFlushErr)]
    );
}

#[test]
fn write_with_wrong_rkey_is_a_remote_access_error() {
    let mut p = pair(104, Faults::NONE, opts());
    let op = SendOp::Write {
        remote_addr: p.b.mr.addr,
        rkey: MemKey(p.b.mr.rkey.0 ^ 0x0100),
    };
    expect_remote_access_error(&mut p, op, 2000);
}

#[test]
fn write_out_of_bounds_is_a_remote_access_error() {
    let mut p = pair(105, Faults::NONE, opts());
    let op = write_op(&p.b, p.b.mr.len - 10);
    expect_remote_access_error(&mut p, op, 100);
}

#[test]
fn write_to_region_without_remote_write_is_a_remote_access_error() {
    let mut p = pair(106, Faults::NONE, opts());
    let ro = p.sim.devices[1]
        .reg_mr(
            p.b.pd,
            &p.b.mem,
            0,
            4096,
            Access::LOCAL_WRITE | Access::REMOTE_READ,
        )
        .unwrap();
    let op = SendOp::Write {
        remote_addr: ro.addr,
        rkey: ro.rkey,
    };
    expect_remote_access_error(&mut p, op, 100);
    // Nothing was written.
    assert!(read(&p.b.mem, 0, 4096).iter().all(|&b| b == 0));
}

#[test]
fn read_from_region_without_remote_read_is_a_remote_access_error() {
    let mut p = pair(107, Faults::NONE, opts());
    let wo = p.sim.devices[1]
        .reg_mr(
            p.b.pd,
            &p.b.mem,
            0,
            4096,
            Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        )
        .unwrap();
    let op = SendOp::Read {
        remote_addr: wo.addr,
        rkey: wo.rkey,
    };
    expect_remote_access_error(&mut p, op, 100);
}

#[test]
fn zero_length_write_needs_no_valid_rkey() {
    // IBA 9.4.1.1: a zero-length RDMA WRITE checks no key.
    let mut p = pair(108, Faults::NONE, opts());
    let op = SendOp::Write {
        remote_addr: 0,
        rkey: MemKey(0xdead_beef),
    };
    post_send(&mut p.sim, 0, p.a.qpn, send_wr(1, op, &p.a, 0, 0));
    let wa = wait_wcs(&mut p.sim, 0, p.a.cq, 1, SEC);
    assert_eq!(ids(&wa), [(1, WcStatus::Success)]);
    assert_eq!(qp_state(&p.sim, 1, p.b.qpn), QpState::Rts);
}

// ---- length errors --------------------------------------------------------------------------

#[test]
fn send_longer_than_receive_is_loc_len_err_and_rem_inv_req_err() {
    // (receive buffer, message): one packet that does not fit, and a message whose first
    // packet fits and whose second does not.
    for (seed, recv_len, send_len) in [(109, 100, 200), (110, 1500, 3000)] {
        let mut p = pair(seed, Faults::NONE, opts());
        post_recv(&mut p.sim, 1, p.b.qpn, recv_wr(10, &p.b, 0, recv_len));
        post_recv(&mut p.sim, 1, p.b.qpn, recv_wr(11, &p.b, 8192, 8192));
        post_send(
            &mut p.sim,
            0,
            p.a.qpn,
            send_wr(1, SendOp::Send, &p.a, 0, send_len),
        );
        post_send(
            &mut p.sim,
            0,
            p.a.qpn,
            send_wr(2, SendOp::Send, &p.a, 0, 10),
        );
        let wb = wait_wcs(&mut p.sim, 1, p.b.cq, 2, SEC);
        assert_eq!(
            ids(&wb),
            [(10, WcStatus::LocLenErr), (11, WcStatus::WrFlushErr)],
            "recv {recv_len} send {send_len}"
        );
        let wa = wait_wcs(&mut p.sim, 0, p.a.cq, 2, SEC);
        assert_eq!(
            ids(&wa),
            [(1, WcStatus::RemInvReqErr), (2, WcStatus::WrFlushErr)]
        );
        assert_eq!(qp_state(&p.sim, 1, p.b.qpn), QpState::Err);
        assert_eq!(qp_state(&p.sim, 0, p.a.qpn), QpState::Err);
        assert!(events(&mut p.sim, 1).contains(&AsyncEvent::QpFatal(p.b.qpn)));
        // Nothing more completes later.
        run_quiet(&mut p.sim, SEC);
        assert!(drain(&mut p.sim, 0, p.a.cq).is_empty());
        assert!(drain(&mut p.sim, 1, p.b.cq).is_empty());
    }
}

// ---- SEND with Invalidate ---------------------------------------------------------------------

#[test]
fn send_with_invalidate_reports_the_key_and_kills_it() {
    let mut p = pair(111, Faults::NONE, opts());
    let target = p.sim.devices[1]
        .reg_mr(
            p.b.pd,
            &p.b.mem,
            65536,
            65536,
            Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        )
        .unwrap();
    let write_target = SendOp::Write {
        remote_addr: target.addr,
        rkey: target.rkey,
    };
    // The key works before the invalidate.
    fill(&p.a.mem, 0, 512, 5);
    post_send(
        &mut p.sim,
        0,
        p.a.qpn,
        send_wr(0, write_target, &p.a, 0, 512),
    );
    let wa = wait_wcs(&mut p.sim, 0, p.a.cq, 1, SEC);
    assert_eq!(ids(&wa), [(0, WcStatus::Success)]);

    post_recv(&mut p.sim, 1, p.b.qpn, recv_wr(10, &p.b, 0, 4096));
    let msg = fill(&p.a.mem, 4096, 1000, 6);
    post_send(
        &mut p.sim,
        0,
        p.a.qpn,
        send_wr(1, SendOp::SendWithInv(target.rkey), &p.a, 4096, 1000),
    );
    let wb = wait_wcs(&mut p.sim, 1, p.b.cq, 1, SEC);
    assert_eq!(
        (wb[0].wr_id, wb[0].status, wb[0].byte_len, wb[0].invalidated),
        (10, WcStatus::Success, 1000, Some(target.rkey))
    );
    assert!(read(&p.b.mem, 0, 1000) == msg);
    let wa = wait_wcs(&mut p.sim, 0, p.a.cq, 1, SEC);
    assert_eq!(ids(&wa), [(1, WcStatus::Success)]);

    post_send(
        &mut p.sim,
        0,
        p.a.qpn,
        send_wr(2, write_target, &p.a, 0, 512),
    );
    let wa = wait_wcs(&mut p.sim, 0, p.a.cq, 1, SEC);
    assert_eq!(ids(&wa), [(2, WcStatus::RemAccessErr)]);
    assert_eq!(qp_state(&p.sim, 1, p.b.qpn), QpState::Err);
    assert!(events(&mut p.sim, 1).contains(&AsyncEvent::QpAccessError(p.b.qpn)));
}

// ---- WRITE with immediate -----------------------------------------------------------------

#[test]
fn write_with_immediate_consumes_a_receive() {
    let mut p = pair(112, Faults::NONE, opts());
    let len = 5000; // several packets at MTU 1024; only the last carries the immediate
    let data = fill(&p.a.mem, 0, len, 7);
    let op = SendOp::WriteWithImm {
        remote_addr: p.b.mr.addr + 100_000,
        rkey: p.b.mr.rkey,
        imm: 0xfeed_f00d,
    };
    // No receive yet: the last packet is RNR NAKed, nothing completes.
    post_send(&mut p.sim, 0, p.a.qpn, send_wr(1, op, &p.a, 0, len));
    let end = p.sim.now + Duration::from_millis(1);
    p.sim.run_until(Duration::from_millis(1), |s| s.now >= end);
    assert!(drain(&mut p.sim, 0, p.a.cq).is_empty());
    assert!(p.sim.devices[1].stats().rnr_naks_tx > 0);

    post_recv(&mut p.sim, 1, p.b.qpn, recv_wr(10, &p.b, 0, 64));
    post_recv(&mut p.sim, 1, p.b.qpn, recv_wr(11, &p.b, 64, 64));
    let wb = wait_wcs(&mut p.sim, 1, p.b.cq, 1, SEC);
    assert_eq!(wb.len(), 1, "one receive consumed, not two");
    let w = wb[0];
    assert_eq!(
        (w.wr_id, w.status, w.opcode, w.imm, w.byte_len),
        (
            10,
            WcStatus::Success,
            WcOpcode::RecvRdmaWithImm,
            Some(0xfeed_f00d),
            len as u32
        )
    );
    assert!(read(&p.b.mem, 100_000, len) == data);
    // The receive buffer is not where the data goes.
    assert!(read(&p.b.mem, 0, 128).iter().all(|&b| b == 0));
    let wa = wait_wcs(&mut p.sim, 0, p.a.cq, 1, SEC);
    assert_eq!(
        (wa[0].wr_id, wa[0].status, wa[0].opcode),
        (1, WcStatus::Success, WcOpcode::RdmaWrite)
    );
    // The second receive is still there for the next message.
    post_send(
        &mut p.sim,
        0,
        p.a.qpn,
        send_wr(2, SendOp::SendWithImm(5), &p.a, 0, 10),
    );
    let wb = wait_wcs(&mut p.sim, 1, p.b.cq, 1, SEC);
    assert_eq!(
        (wb[0].wr_id, wb[0].opcode, wb[0].imm),
        (11, WcOpcode::Recv, Some(5))
    );
}

// ---- unsignaled work -------------------------------------------------------------------------

#[test]
fn unsignaled_work_completes_silently_until_a_signaled_one() {
    let mut p = pair(113, Faults::LOSSY, opts());
    let slot = 20_000;
    let mut expect = Vec::new();
    for i in 0..6u64 {
        let off = i as usize * slot;
        expect.push(fill(&p.a.mem, off, slot, 100 + i));
        let wr = send_wr(i, write_op(&p.b, off as u64), &p.a, off, slot);
        post_send(&mut p.sim, 0, p.a.qpn, unsignaled(wr));
    }
    // An unsignaled READ too.
    let rdata = fill(&p.b.mem, 500_000, 10_000, 9);
    let rd = send_wr(
        6,
        SendOp::Read {
            remote_addr: p.b.mr.addr + 500_000,
            rkey: p.b.mr.rkey,
        },
        &p.a,
        500_000,
        10_000,
    );
    post_send(&mut p.sim, 0, p.a.qpn, unsignaled(rd));
    assert!(run_quiet(&mut p.sim, 10 * SEC));
    assert!(drain(&mut p.sim, 0, p.a.cq).is_empty());
    for (i, e) in expect.iter().enumerate() {
        assert!(read(&p.b.mem, i * slot, slot) == *e, "write {i}");
    }
    assert!(read(&p.a.mem, 500_000, 10_000) == rdata);

    post_send(
        &mut p.sim,
        0,
        p.a.qpn,
        send_wr(7, write_op(&p.b, 0), &p.a, 0, 10),
    );
    let wa = wait_wcs(&mut p.sim, 0, p.a.cq, 1, 10 * SEC);
    assert_eq!(ids(&wa), [(7, WcStatus::Success)]);
    assert!(run_quiet(&mut p.sim, 10 * SEC));
    assert!(drain(&mut p.sim, 0, p.a.cq).is_empty());
}

// ---- garbage on the wire -------------------------------------------------------------------

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Junk {
    malformed: u64,
    icrc: u64,
    unknown_qp: u64,
}

/// A well-formed request packet with a correct ICRC for the flow `from` → `to`.
fn valid_packet(rng: &mut SmallRng, from: usize, to: usize, qpn: Qpn) -> Vec<u8> {
    let ctx = IcrcContext::new(sim_addr(from), sim_addr(to));
    let op = [
        Opcode::RC_SEND_ONLY,
        Opcode::RC_RDMA_WRITE_FIRST,
        Opcode::RC_RDMA_READ_REQUEST,
        Opcode::RC_SEND_ONLY_WITH_IMMEDIATE,
    ][rng.random_range(0..4)];
    let mut h = PacketHeaders::new(BthRepr::new(op, qpn, Psn::new(rng.random())));
    if op.info().hdrs.contains(nvmf_rdma::hca::wire::HdrMask::RETH) {
        h.reth = Some(RethRepr {
            va: rng.random(),
            rkey: MemKey(rng.random()),
            dma_len: rng.random_range(0..1 << 20),
        });
    }
    if op == Opcode::RC_SEND_ONLY_WITH_IMMEDIATE {
        h.imm = Some(rng.random());
    }
    let payload_len = if op == Opcode::RC_RDMA_WRITE_FIRST {
        1024
    } else if op == Opcode::RC_RDMA_READ_REQUEST {
        0
    } else {
        rng.random_range(0..1024)
    };
    let payload: Vec<u8> = (0..payload_len).map(|_| rng.random()).collect();
    let mut out = Vec::new();
    emit_packet(&h, &payload, &ctx, &mut out);
    out
}

/// One junk datagram for device `to` (whose live QPs are `live`), and what it must count as.
fn junk(rng: &mut SmallRng, from: usize, to: usize, live: &[Qpn]) -> Vec<u8> {
    let unknown = loop {
        let q = Qpn::new(rng.random_range(2..1 << 24));
        if !live.contains(&q) {
            break q;
        }
    };
    match rng.random_range(0..5) {
        // Random bytes of any length, up to a little past the largest packet.
        0 => {
            let n = rng.random_range(0..4300);
            (0..n).map(|_| rng.random()).collect()
        }
        // A valid packet cut short anywhere.
        1 => {
            let mut p = valid_packet(rng, from, to, unknown);
            let n = rng.random_range(0..p.len());
            p.truncate(n);
            p
        }
        // A bad ICRC on a packet aimed at a live QP.
        2 => {
            let qpn = live[rng.random_range(0..live.len())];
            let mut p = valid_packet(rng, from, to, qpn);
            let at = p.len() - 1 - rng.random_range(0..4);
            p[at] ^= 1 << rng.random_range(0..8);
            p
        }
        // A corrupted header or payload byte on a packet aimed at a live QP. BTH byte 4
        // (FECN, BECN, reserved) is variant, masked out of the ICRC on purpose, so a flip
        // there leaves a valid packet: skip it.
        3 => {
            let qpn = live[rng.random_range(0..live.len())];
            let mut p = valid_packet(rng, from, to, qpn);
            let mut at = rng.random_range(0..p.len() - 5);
            if at >= 4 {
                at += 1;
            }
            p[at] ^= 1 << rng.random_range(0..8);
            p
        }
        // Perfectly valid, for a QP that does not exist.
        _ => valid_packet(rng, from, to, unknown),
    }
}

/// How the device must classify `data` (the test's own parse, independent of the device).
fn classify(data: &[u8], from: usize, to: usize, live: &[Qpn], j: &mut Junk) {
    let ctx = IcrcContext::new(sim_addr(from), sim_addr(to));
    match ParsedPacket::parse(data, Some(&ctx)) {
        Err(WireError::IcrcMismatch { .. }) => j.icrc += 1,
        Err(_) => j.malformed += 1,
        Ok(p) => {
            assert!(
                !live.contains(&p.hdrs.bth.dest_qp),
                "junk generator made a valid packet for a live QP"
            );
            j.unknown_qp += 1;
        }
    }
}

struct Outcome {
    wcs: [Vec<(u64, WcStatus)>; 2],
    tx: [u64; 2],
    done_at: Instant,
}

/// Two-way traffic (WRITE and SEND one way, READ and SEND the other) on a clean link, with
/// `per_step` junk datagrams thrown at each device at every simulator step.
fn traffic_with_junk(per_step: usize) -> (Outcome, [Junk; 2], [Stats; 2]) {
    let mut p = pair(
        120,
        Faults::NONE,
        RcOptions {
            buf_len: 4 << 20,
            ..opts()
        },
    );
    let mut rng = SmallRng::seed_from_u64(0x6a6b);
    let wdata = fill(&p.a.mem, 0, 1 << 20, 1);
    let rdata = fill(&p.a.mem, 2 << 20, 300_000, 2);
    let sdata_a = fill(&p.a.mem, 3 << 20, 50_000, 3);
    let sdata_b = fill(&p.b.mem, 3 << 20, 70_000, 4);
    post_recv(&mut p.sim, 1, p.b.qpn, recv_wr(20, &p.b, 1 << 20, 100_000));
    post_recv(&mut p.sim, 0, p.a.qpn, recv_wr(30, &p.a, 1 << 20, 100_000));
    post_send(
        &mut p.sim,
        0,
        p.a.qpn,
        send_wr(1, write_op(&p.b, 0), &p.a, 0, 1 << 20),
    );
    post_send(
        &mut p.sim,
        0,
        p.a.qpn,
        send_wr(2, SendOp::Send, &p.a, 3 << 20, 50_000),
    );
    let rd = SendOp::Read {
        remote_addr: p.a.mr.addr + (2 << 20),
        rkey: p.a.mr.rkey,
    };
    post_send(
        &mut p.sim,
        1,
        p.b.qpn,
        send_wr(3, rd, &p.b, 2 << 20, 300_000),
    );
    post_send(
        &mut p.sim,
        1,
        p.b.qpn,
        send_wr(4, SendOp::Send, &p.b, 3 << 20, 70_000),
    );

    let live = [[p.a.qpn], [p.b.qpn]];
    let mut expect = [Junk::default(); 2];
    let mut got: [Vec<WorkCompletion>; 2] = [Vec::new(), Vec::new()];
    let cqs = [p.a.cq, p.b.cq];
    let limit = p.sim.now + 10 * SEC;
    while got[0].len() < 3 || got[1].len() < 3 {
        assert!(p.sim.now < limit, "transfer stalled: {:?}", got);
        for (dev, from) in [(0usize, 1usize), (1, 0)] {
            for _ in 0..per_step {
                let d = junk(&mut rng, from, dev, &live[dev]);
                classify(&d, from, dev, &live[dev], &mut expect[dev]);
                let now = p.sim.now;
                p.sim.devices[dev].handle_datagram(now, sim_addr(from), &d);
            }
        }
        if !p.sim.step() {
            break;
        }
        for d in 0..2 {
            p.sim.devices[d].poll_cq(cqs[d], usize::MAX, &mut got[d]);
        }
    }
    let done_at = p.sim.now;
    assert!(read(&p.b.mem, 0, 1 << 20) == wdata);
    assert!(read(&p.b.mem, 2 << 20, 300_000) == rdata);
    assert!(read(&p.b.mem, 1 << 20, 50_000) == sdata_a);
    assert!(read(&p.a.mem, 1 << 20, 70_000) == sdata_b);
    let stats = [
        p.sim.devices[0].stats().clone(),
        p.sim.devices[1].stats().clone(),
    ];
    let out = Outcome {
        wcs: [ids(&got[0]), ids(&got[1])],
        tx: [stats[0].tx_packets, stats[1].tx_packets],
        done_at,
    };
    (out, expect, stats)
}

#[test]
fn malformed_datagrams_are_counted_and_never_disturb_a_transfer() {
    let (clean, none, clean_stats) = traffic_with_junk(0);
    assert_eq!(none, [Junk::default(); 2]);
    let (dirty, expect, stats) = traffic_with_junk(40);
    for d in 0..2 {
        let s = &stats[d];
        let j = expect[d];
        assert!(
            j.malformed > 50 && j.icrc > 50 && j.unknown_qp > 20,
            "junk mix too thin: {j:?}"
        );
        assert_eq!(
            (s.rx_malformed, s.rx_icrc_errors, s.rx_unknown_qp),
            (j.malformed, j.icrc, j.unknown_qp),
            "device {d}: {s:?}"
        );
        // Nothing else noticed: no retries, no NAKs, no drops, no ghosts.
        assert_eq!(
            (
                s.retransmits,
                s.timeouts,
                s.seq_naks_tx,
                s.naks_tx,
                s.rx_dropped,
                s.rx_ghost
            ),
            (0, 0, 0, 0, 0, 0),
            "device {d}: {s:?}"
        );
        let c = &clean_stats[d];
        assert_eq!(
            s.rx_packets,
            c.rx_packets + j.malformed + j.icrc + j.unknown_qp
        );
    }
    // The same transfer, packet for packet and nanosecond for nanosecond.
    assert_eq!(dirty.wcs, clean.wcs);
    let mut sorted = dirty.wcs.clone();
    sorted.iter_mut().for_each(|v| v.sort_by_key(|w| w.0));
    let ok = WcStatus::Success;
    assert_eq!(
        sorted,
        [
            vec![(1, ok), (2, ok), (30, ok)],
            vec![(3, ok), (4, ok), (20, ok)]
        ]
    );
    assert_eq!(dirty.tx, clean.tx);
    assert_eq!(dirty.done_at, clean.done_at);
}

//! Loss-tolerant RC: random loss costs time in proportion, not a local ACK timeout per loss.
//! The requester's adaptive retransmit timer, its fast retransmit on a sequence NAK and its
//! tail-loss probe, in virtual time, with the local ACK timeout the real stack uses (67 ms).

mod common;

use std::time::Duration;

use common::*;
use nvmf_rdma::hca::rc::RcOptions;
use nvmf_rdma::hca::sim::Faults;
use nvmf_rdma::hca::*;
use nvmf_rdma::verbs::*;

const MS: Duration = Duration::from_millis(1);
/// What the NVMe-oF host and target give their QPs: 4.096 µs × 2^14 = 67 ms.
const TIMEOUT: u8 = 14;
const TIMEOUT_NS: u64 = 4096 << TIMEOUT;

fn opts() -> RcOptions {
    RcOptions {
        mtu: Mtu::Mtu4096,
        buf_len: 1 << 20,
        timeout: TIMEOUT,
        ..RcOptions::default()
    }
}

fn write_op(to: &rc::RcEnd, offset: usize) -> SendOp {
    SendOp::Write {
        remote_addr: to.mr.addr + offset as u64,
        rkey: to.mr.rkey,
    }
}

fn read_op(from: &rc::RcEnd, offset: usize) -> SendOp {
    SendOp::Read {
        remote_addr: from.mr.addr + offset as u64,
        rkey: from.mr.rkey,
    }
}

const BS: usize = 4096;
const SLOTS: usize = 64;
/// READs take their data from B's upper half, which nothing writes.
const READ_SRC: usize = 128 * BS;

/// `n` 4 KiB operations from A at queue depth `qd`, RDMA WRITEs (and READs in between with
/// `reads`), each checked byte for byte when it completes. Returns the virtual time it took.
fn run_qd(p: &mut Pair, n: usize, qd: usize, reads: bool) -> Duration {
    for s in 0..SLOTS {
        fill(&p.b.mem, READ_SRC + s * BS, BS, 0xB000 + s as u64);
    }
    let start = p.sim.now;
    let mut expect: Vec<Vec<u8>> = vec![Vec::new(); SLOTS];
    let (mut posted, mut done) = (0usize, 0usize);
    while done < n {
        while posted < n && posted - done < qd {
            let slot = posted % SLOTS;
            let op = if reads && posted % 2 == 1 {
                read_op(&p.b, READ_SRC + slot * BS)
            } else {
                expect[slot] = fill(&p.a.mem, slot * BS, BS, posted as u64);
                write_op(&p.b, slot * BS)
            };
            let wr = send_wr(posted as u64, op, &p.a, slot * BS, BS);
            post_send(&mut p.sim, 0, p.a.qpn, wr);
            posted += 1;
        }
        let wcs = wait_wcs(&mut p.sim, 0, p.a.cq, 1, Duration::from_secs(30));
        for wc in wcs {
            let i = done;
            assert_eq!(
                (wc.wr_id, wc.status),
                (i as u64, WcStatus::Success),
                "seed {}",
                p.sim.seed
            );
            let slot = i % SLOTS;
            if !(reads && i % 2 == 1) {
                assert!(
                    read(&p.b.mem, slot * BS, BS) == expect[slot],
                    "seed {}: WRITE {i} corrupted",
                    p.sim.seed
                );
            } else {
                assert!(
                    read(&p.a.mem, slot * BS, BS) == read(&p.b.mem, READ_SRC + slot * BS, BS),
                    "seed {}: READ {i} corrupted",
                    p.sim.seed
                );
            }
            done += 1;
        }
    }
    p.sim.now.saturating_since(start)
}

fn five_percent() -> Faults {
    Faults {
        drop: 0.05,
        ..Faults::NONE
    }
}

/// 5% random loss both ways at QD32: every byte arrives, and the losses are recovered by
/// fast retransmits, probes and the adaptive timer, not once by the 67 ms local ACK timeout,
/// which before the adaptive timer was what every loss no NAK reported cost (a lost tail, a
/// lost NAK, a lost resend): 2000 operations then took seconds. The simulator charges
/// nothing for processing, so a lossless run is all latency (a few hundred µs) and the
/// ratio to it says little; the bound is on what each loss costs: on average at most
/// 300 µs (60-200 µs here; 7.4 ms before the adaptive timer).
/// (RDMA WRITEs; READs: `reads_under_5pct_loss_do_not_wait_for_the_local_ack_timeout`.)
#[test]
fn qd32_under_5pct_loss_costs_time_in_proportion() {
    let n = 2000;
    for seed in [501, 502, 503] {
        let mut clean = pair(seed, Faults::NONE, opts());
        let t_clean = run_qd(&mut clean, n, 32, false);
        let mut lossy = pair(seed, five_percent(), opts());
        let t_lossy = run_qd(&mut lossy, n, 32, false);
        let (sa, sb) = (
            lossy.sim.devices[0].stats().clone(),
            lossy.sim.devices[1].stats().clone(),
        );
        let l = &lossy.sim.link;
        assert!(l.dropped > 100, "seed {seed}: too few losses {l:?}");
        let per_loss = t_lossy.saturating_sub(t_clean) / l.dropped as u32;
        assert!(
            per_loss <= Duration::from_micros(300),
            "seed {seed}: {t_lossy:?} under 5% loss vs {t_clean:?} without, {per_loss:?} per loss\n\
             link {l:?}\na {sa:?}\nb {sb:?}"
        );
        // The adaptive paths did the work; the IBA timeout never had to.
        for s in [&sa, &sb] {
            assert_eq!(s.timeouts, 0, "seed {seed}: {s:?}");
        }
        assert!(sa.fast_retransmits > 0, "seed {seed}: {sa:?}");
        assert!(sa.tail_probes > 0, "seed {seed}: {sa:?}");
        assert!(
            sa.rto_ns > 0 && sa.rto_ns < TIMEOUT_NS / 10,
            "seed {seed}: RTO {} ns not adapted",
            sa.rto_ns
        );
        // Without loss nothing was resent.
        let c = clean.sim.devices[0].stats();
        assert_eq!(
            (
                c.retransmits,
                c.timeouts,
                c.rto_timeouts,
                c.fast_retransmits
            ),
            (0, 0, 0, 0),
            "seed {seed}: {c:?}"
        );
    }
}

/// A few operations without loss, so the requester has an RTT estimate.
fn warm_up(p: &mut Pair) {
    run_qd(p, 16, 4, true);
}

/// Post one 4 KiB WRITE per wr_id in `ids` from A, and put what A sends on the link while
/// the two are cut apart: exactly those packets are lost.
fn post_lost(p: &mut Pair, ids: std::ops::Range<u64>) {
    p.sim.partitions.push((0, 1));
    for i in ids {
        let wr = send_wr(i, write_op(&p.b, 0), &p.a, 0, BS);
        post_send(&mut p.sim, 0, p.a.qpn, wr);
    }
    p.sim.pump_transmit();
    p.sim.partitions.clear();
}

fn post_writes(p: &mut Pair, ids: std::ops::Range<u64>) {
    for i in ids {
        let wr = send_wr(i, write_op(&p.b, 0), &p.a, 0, BS);
        post_send(&mut p.sim, 0, p.a.qpn, wr);
    }
    p.sim.pump_transmit();
}

fn assert_all_ok(wcs: &[WorkCompletion], want: std::ops::Range<u64>) {
    assert_eq!(
        ids(wcs),
        want.map(|i| (i, WcStatus::Success)).collect::<Vec<_>>()
    );
}

/// The last packets of a burst are lost: no later packet makes the responder NAK. A probe
/// (the last packet again, asking for an ACK) goes out after about two round trips and
/// recovers the tail, long before the local ACK timeout (which used to be the only way).
#[test]
fn tail_loss_is_recovered_by_a_probe() {
    let mut p = pair(601, Faults::NONE, opts());
    warm_up(&mut p);
    let before = p.sim.devices[0].stats().clone();
    let start = p.sim.now;
    post_writes(&mut p, 100..103);
    post_lost(&mut p, 103..105);
    let wcs = wait_wcs(&mut p.sim, 0, p.a.cq, 5, Duration::from_secs(1));
    let took = p.sim.now.saturating_since(start);
    assert_all_ok(&wcs, 100..105);
    let s = p.sim.devices[0].stats();
    let d = |f: fn(&Stats) -> u64| f(s) - f(&before);
    // The probe (PSN of WRITE 104) made the responder NAK the hole at 103: one probe, one
    // fast retransmit, no timer expiry at all.
    assert_eq!(
        (
            d(|s| s.tail_probes),
            d(|s| s.fast_retransmits),
            d(|s| s.rto_timeouts),
            d(|s| s.timeouts)
        ),
        (1, 1, 0, 0),
        "{s:?}"
    );
    assert!(took < MS, "tail recovered after {took:?}");
}

/// A sequence NAK resends at once, once: duplicated NAKs (every packet doubled on the
/// link) do not rewind twice.
#[test]
fn a_nak_resends_at_once_and_once() {
    let mut p = pair(
        602,
        Faults {
            duplicate: 1.0,
            ..Faults::NONE
        },
        opts(),
    );
    warm_up(&mut p);
    let before = p.sim.devices[0].stats().clone();
    let start = p.sim.now;
    post_lost(&mut p, 200..201);
    post_writes(&mut p, 201..204);
    let wcs = wait_wcs(&mut p.sim, 0, p.a.cq, 4, Duration::from_secs(1));
    let took = p.sim.now.saturating_since(start);
    assert_all_ok(&wcs, 200..204);
    let s = p.sim.devices[0].stats();
    let d = |f: fn(&Stats) -> u64| f(s) - f(&before);
    assert!(d(|s| s.seq_naks_rx) >= 2, "the NAK was not doubled: {s:?}");
    assert_eq!(
        (
            d(|s| s.fast_retransmits),
            d(|s| s.retransmits),
            d(|s| s.timeouts)
        ),
        (1, 1, 0),
        "{s:?}"
    );
    assert!(took < MS, "took {took:?}");
}

/// The resend after a NAK is lost too: the responder NAKs a gap once, so nothing more comes
/// from it, and the adaptive timer (a few RTTs, not 67 ms) resends without spending one of
/// the QP's retries.
#[test]
fn a_lost_resend_is_recovered_by_the_adaptive_timer() {
    let mut p = pair(603, Faults::NONE, opts());
    warm_up(&mut p);
    let before = p.sim.devices[0].stats().clone();
    let start = p.sim.now;
    let naks = p.sim.devices[1].stats().seq_naks_tx;
    post_lost(&mut p, 300..301);
    post_writes(&mut p, 301..303);
    // Run until B has NAKed the hole; then the step that brings A the NAK sends the resend
    // into a cut link.
    let ok = p.sim.run_until(Duration::from_secs(1), |s| {
        s.devices[1].stats().seq_naks_tx > naks
    });
    assert!(ok);
    p.sim.partitions.push((0, 1));
    while p.sim.devices[0].stats().fast_retransmits == before.fast_retransmits {
        assert!(p.sim.step());
    }
    p.sim.partitions.clear();
    let wcs = wait_wcs(&mut p.sim, 0, p.a.cq, 3, Duration::from_secs(1));
    let took = p.sim.now.saturating_since(start);
    assert_all_ok(&wcs, 300..303);
    let s = p.sim.devices[0].stats();
    let d = |f: fn(&Stats) -> u64| f(s) - f(&before);
    // The probe cannot help here (a responder NAKs a gap once and stays silent after); the
    // adaptive timer did it.
    assert_eq!(
        (
            d(|s| s.fast_retransmits),
            d(|s| s.rto_timeouts),
            d(|s| s.timeouts)
        ),
        (1, 1, 0),
        "{s:?}"
    );
    assert!(took < 5 * MS, "took {took:?}");
}

/// retry_cnt keeps its IBA meaning with the adaptive timer: cut off after RTT samples, the
/// QP resends early and often but fails only after retry_cnt + 1 local ACK timeouts without
/// progress, no sooner than the IBA says.
#[test]
fn retry_cnt_counts_local_ack_timeouts_only() {
    let retry_cnt = 2u8;
    let mut p = pair(
        604,
        Faults::NONE,
        RcOptions {
            retry_cnt,
            ..opts()
        },
    );
    warm_up(&mut p);
    let before = p.sim.devices[0].stats().clone();
    p.sim.partitions.push((0, 1));
    let start = p.sim.now;
    post_writes(&mut p, 400..401);
    let wcs = wait_wcs(&mut p.sim, 0, p.a.cq, 1, Duration::from_secs(10));
    assert_eq!(ids(&wcs), [(400, WcStatus::RetryExcErr)]);
    let took = p.sim.now.saturating_since(start);
    let s = p.sim.devices[0].stats();
    let d = |f: fn(&Stats) -> u64| f(s) - f(&before);
    assert_eq!(d(|s| s.timeouts), retry_cnt as u64 + 1, "{s:?}");
    assert!(d(|s| s.rto_timeouts) >= 3, "no early resends: {s:?}");
    let iba = Duration::from_nanos((retry_cnt as u64 + 1) * TIMEOUT_NS);
    assert!(
        took >= iba && took < iba + 5 * MS,
        "failed after {took:?}, the IBA says {iba:?}"
    );
}

/// A timer that fires early (the data arrived, only the ACKs were lost) resends the oldest
/// packet alone; the peer answers the duplicate with its latest ACK and nothing more is
/// sent. It used to resend the whole window (32 packets here), all duplicates, which under
/// a burst of large messages made the next ACKs late too and the timer fire early again.
#[test]
fn an_early_timer_resends_one_packet_not_the_window() {
    let mut p = pair(605, Faults::NONE, opts());
    warm_up(&mut p);
    let (a0, b0) = (
        p.sim.devices[0].stats().clone(),
        p.sim.devices[1].stats().clone(),
    );
    post_writes(&mut p, 500..532);
    // Everything is on the link and arrives; B's ACKs, and A's tail-loss probe, are lost.
    p.sim.partitions.push((0, 1));
    let ok = p.sim.run_until(Duration::from_secs(1), |s| {
        s.devices[0].stats().tail_probes > a0.tail_probes
    });
    assert!(ok, "no probe");
    p.sim.partitions.clear();
    let wcs = wait_wcs(&mut p.sim, 0, p.a.cq, 32, Duration::from_secs(1));
    assert_all_ok(&wcs, 500..532);
    let (a, b) = (p.sim.devices[0].stats(), p.sim.devices[1].stats());
    assert_eq!(
        b.rx_packets - b0.rx_packets,
        33,
        "B received the burst and one resend"
    );
    assert_eq!(b.rx_duplicates - b0.rx_duplicates, 1, "{b:?}");
    assert_eq!(
        (a.rto_timeouts - a0.rto_timeouts, a.timeouts - a0.timeouts),
        (1, 0),
        "{a:?}"
    );
}

/// A seed's run replays exactly: the timers add nothing that is not in virtual time.
#[test]
fn lossy_run_replays_from_its_seed() {
    let run = |seed| {
        let mut p = pair(seed, five_percent(), opts());
        let t = run_qd(&mut p, 300, 32, true);
        (t, p.sim.devices[0].stats().clone(), p.sim.link.clone())
    };
    assert_eq!(run(505), run(505));
}

/// RDMA READs under 5% loss both ways, WRITEs and READs alternating at QD32: every byte
/// arrives, and no loss waits for the 67 ms local ACK timeout. Before READs had the adaptive
/// timer, a lost READ request or response that nothing after it revealed (the last ones in
/// flight, or a resend lost again) cost exactly that, a dozen times in this run.
#[test]
fn reads_under_5pct_loss_do_not_wait_for_the_local_ack_timeout() {
    for seed in [506, 507, 508] {
        let mut p = pair(seed, five_percent(), opts());
        let took = run_qd(&mut p, 600, 32, true);
        let s = p.sim.devices[0].stats();
        let l = &p.sim.link;
        assert!(l.dropped > 30, "seed {seed}: {l:?}");
        assert_eq!(s.timeouts, 0, "seed {seed}: {s:?}");
        let per_loss = took / l.dropped as u32;
        assert!(
            per_loss <= Duration::from_micros(300),
            "seed {seed}: {took:?} for {} losses\n{s:?}",
            l.dropped
        );
    }
}

/// Post one READ of `len` bytes per wr_id in `ids` from A, reading B at `offset` into A at
/// the same offset.
fn post_reads(p: &mut Pair, ids: std::ops::Range<u64>, len: usize) {
    for i in ids {
        let wr = send_wr(i, read_op(&p.b, 0), &p.a, 0, len);
        post_send(&mut p.sim, 0, p.a.qpn, wr);
    }
    p.sim.pump_transmit();
}

/// The stats of device `dev` since `before`.
fn delta(p: &Pair, before: &Stats, f: fn(&Stats) -> u64) -> u64 {
    f(p.sim.devices[0].stats()) - f(before)
}

/// A READ loss case: a warmed-up pair, B's first 4 blocks filled, A's stats and the time at
/// the start.
struct ReadCase {
    p: Pair,
    want: Vec<u8>,
    before: Stats,
    start: Instant,
}

impl ReadCase {
    fn new(seed: u64) -> ReadCase {
        let mut p = pair(seed, Faults::NONE, opts());
        warm_up(&mut p);
        let want = fill(&p.b.mem, 0, 4 * BS, seed);
        let before = p.sim.devices[0].stats().clone();
        let start = p.sim.now;
        ReadCase {
            p,
            want,
            before,
            start,
        }
    }

    /// B answers what it was asked into a cut link: its next packets are lost.
    fn lose_bs_answers(&mut self) {
        let served = self.p.sim.devices[1].stats().tx_packets;
        self.p.sim.partitions.push((0, 1));
        while self.p.sim.devices[1].stats().tx_packets == served {
            assert!(self.p.sim.step());
        }
        self.p.sim.partitions.clear();
    }

    /// The READs `ids` all complete with B's bytes within a millisecond, and A's counters
    /// `fields` grew by `grew`.
    fn finish(&mut self, ids: std::ops::Range<u64>, fields: &[fn(&Stats) -> u64], grew: &[u64]) {
        let p = &mut self.p;
        let n = (ids.end - ids.start) as usize;
        let wcs = wait_wcs(&mut p.sim, 0, p.a.cq, n, Duration::from_secs(1));
        let took = p.sim.now.saturating_since(self.start);
        assert_all_ok(&wcs, ids);
        assert!(
            read(&p.a.mem, 0, 4 * BS) == self.want,
            "seed {}",
            p.sim.seed
        );
        let d: Vec<u64> = fields.iter().map(|f| delta(p, &self.before, *f)).collect();
        assert_eq!(
            d,
            grew,
            "seed {}: {:?}",
            p.sim.seed,
            p.sim.devices[0].stats()
        );
        assert!(took < MS, "seed {}: took {took:?}", p.sim.seed);
    }
}

/// A lost READ request with nothing after it: the responder never hears of it, so no NAK.
/// The adaptive timer resends it after a few round trips, not the 67 ms local ACK timeout
/// (which was the only way before).
#[test]
fn a_lost_read_request_is_resent_by_the_adaptive_timer() {
    let mut c = ReadCase::new(701);
    c.p.sim.partitions.push((0, 1));
    post_reads(&mut c.p, 700..701, 4 * BS);
    c.p.sim.partitions.clear();
    c.finish(700..701, &[|s| s.rto_timeouts, |s| s.timeouts], &[1, 0]);
}

/// The responses of one READ are lost, those of the READ after it arrive: that gap says the
/// first READ's responses were lost (IBA 9.7.5.1.3, rxe's out-of-sequence read response), and
/// the READ is resent at once for what is missing, once.
#[test]
fn lost_read_responses_before_others_are_resent_at_once() {
    let mut c = ReadCase::new(702);
    post_reads(&mut c.p, 710..711, 4 * BS);
    c.lose_bs_answers();
    post_reads(&mut c.p, 711..712, BS);
    c.finish(
        710..712,
        &[|s| s.fast_retransmits, |s| s.rto_timeouts, |s| s.timeouts],
        &[1, 0, 0],
    );
}

/// The last READ responses in flight are lost: nothing comes after them to show the gap.
/// The adaptive timer resends the READ after a few round trips; the responder, whose
/// responses all left, answers it again.
#[test]
fn lost_last_read_responses_are_resent_by_the_adaptive_timer() {
    let mut c = ReadCase::new(703);
    post_reads(&mut c.p, 720..721, 4 * BS);
    c.lose_bs_answers();
    c.finish(720..721, &[|s| s.rto_timeouts, |s| s.timeouts], &[1, 0]);
}

/// Long READs over a slow link (100 MB/s: 8 READs of 128 KiB stream in for about 10 ms, the
/// last one's first response some 9 ms after its request, 50 times the RTT measured before)
/// are not lost, and nothing is resent: each response packet that brings data re-arms the
/// timer.
#[test]
fn slow_long_reads_are_not_resent() {
    let slow = Faults {
        byte_ns: 10,
        ..Faults::NONE
    };
    let mut p = pair(704, slow, opts());
    warm_up(&mut p);
    let len = 128 << 10;
    let want = fill(&p.b.mem, 0, 8 * len, 704);
    let before = p.sim.devices[0].stats().clone();
    let before_b = p.sim.devices[1].stats().clone();
    let start = p.sim.now;
    for i in 0..8u64 {
        let off = i as usize * len;
        let wr = send_wr(730 + i, read_op(&p.b, off), &p.a, off, len);
        post_send(&mut p.sim, 0, p.a.qpn, wr);
    }
    let wcs = wait_wcs(&mut p.sim, 0, p.a.cq, 8, Duration::from_secs(1));
    let took = p.sim.now.saturating_since(start);
    assert_all_ok(&wcs, 730..738);
    assert!(read(&p.a.mem, 0, 8 * len) == want, "seed {}", p.sim.seed);
    assert!(took > 10 * MS, "the link was not slow: {took:?}");
    let d = |f| delta(&p, &before, f);
    assert_eq!(
        (
            d(|s| s.retransmits),
            d(|s| s.rto_timeouts),
            d(|s| s.timeouts),
            d(|s| s.tail_probes)
        ),
        (0, 0, 0, 0),
        "seed {}: {:?}",
        p.sim.seed,
        p.sim.devices[0].stats()
    );
    let b = p.sim.devices[1].stats();
    assert_eq!(b.rx_duplicates, before_b.rx_duplicates, "{b:?}");
}

/// 128 KiB READs eight at a time, as the target fetches a host's writes, over a link that
/// delays a few packets by up to 3 ms (a thread descheduled on a busy machine) and loses
/// none: a delay is not a loss, so nothing may wait for the 67 ms local ACK timeout.
#[test]
fn delayed_long_reads_never_wait_for_the_local_ack_timeout() {
    let delayed = Faults {
        reorder: 0.002,
        reorder_window_ns: 3_000_000,
        byte_ns: 1,
        ..Faults::NONE
    };
    for seed in 740..746 {
        let mut p = pair(seed, delayed, opts());
        warm_up(&mut p);
        let len = 128 << 10;
        let slots = 8usize;
        let want = fill(&p.b.mem, 0, slots * len, seed);
        let before = p.sim.devices[0].stats().clone();
        let n = 200u64;
        let (mut posted, mut done) = (0u64, 0u64);
        while done < n {
            while posted < n && posted - done < slots as u64 {
                let off = (posted as usize % slots) * len;
                let wr = send_wr(posted, read_op(&p.b, off), &p.a, off, len);
                post_send(&mut p.sim, 0, p.a.qpn, wr);
                posted += 1;
            }
            let wcs = wait_wcs(&mut p.sim, 0, p.a.cq, 1, Duration::from_secs(30));
            for wc in wcs {
                assert_eq!(
                    (wc.wr_id, wc.status),
                    (done, WcStatus::Success),
                    "seed {seed}"
                );
                done += 1;
            }
        }
        assert!(read(&p.a.mem, 0, slots * len) == want, "seed {seed}");
        let a = p.sim.devices[0].stats();
        assert_eq!(a.timeouts, before.timeouts, "seed {seed}: {a:?}");
    }
}

//! What an attacker who can reach the target's (or host's) UDP port can do, each case as
//! a test against the library over loopback (the security review's rows;
//! docs/security.md). Every test here failed on the code before its fix.
//!
//! - pre-Connect CM REQs cost a small fixed amount and are capped per peer IP and in total;
//! - comm IDs, PSNs and memory keys differ between two instances built identically;
//! - a capsule from another UDP port of the peer's IP is dropped and counted;
//! - controller IDs come from the free set and never replace a live controller;
//! - CM TimeWait is bounded whatever timeout the peer asks for;
//! - discovery lists only subsystems the host may use, and refuses I/O queues;
//! - one host's whole-device TRIMs do not stall another host's reads;
//! - one address, or forged REQs, take at most their share of the queue budget; a qid is
//!   installed once per controller.
//!
//! Every await that depends on a peer sits under a timeout.

use std::net::SocketAddr;
use std::time::Duration;

use nvmf_rdma::cm::{ConnectParams, NvmeCmRequest};
use nvmf_rdma::driver::CmService;
use nvmf_rdma::driver::SoftHca;
use nvmf_rdma::hca::device::DeviceConfig;
use nvmf_rdma::hca::rc::{create_qp_init, qp_to_rts, RcOptions};
use nvmf_rdma::hca::HostMem;
use nvmf_rdma::nvme::admin::{self, feature};
use nvmf_rdma::nvme::fabrics::{self, ConnectResult, CNTLID_DYNAMIC};
use nvmf_rdma::nvme::{Cc, FabricsCmd, Nqn, Status};
use nvmf_rdma::nvmet::{serve_cm, Namespace, Subsystem, Target, TargetConfig};
use nvmf_rdma::transport::{discover, ConnectOptions, Controller};
use nvmf_rdma::verbs::PeerInfo;
use nvmf_rdma::verbs::INCOMING_BACKLOG;
use nvmf_rdma::verbs::{Access, CqId, MrInfo, Qpn, RecvWr, SendOp, SendWr, Sgl, WcStatus};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::rig::within;
use crate::{counters, raw_queue};
use counters::Counters;
use raw_queue::Raw;

const NQN: &str = "nqn.2026-11.io.nvmf-rdma:adversarial";
const HOST: &str = "nqn.2026-11.io.nvmf-rdma:adv-host";
/// Long enough for one CM REQ retry (about 4.3 s).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(8);

fn cfg(name: &str, i: u8) -> DeviceConfig {
    cfg_on(name, i, [127, 0, 0, 1])
}

fn cfg_on(name: &str, i: u8, ip: [u8; 4]) -> DeviceConfig {
    crate::rig::device_on(9, name, i, ip)
}

fn subsystem(nqn: &str) -> Subsystem {
    let ns = Namespace::ram(1, 16 << 20, 9);
    Subsystem::new(Nqn::new(nqn).unwrap(), vec![std::sync::Arc::new(ns)])
}

/// A target on device `i` with `tc`, and the device's CM.
async fn target(i: u8, tc: TargetConfig) -> (Target<SoftHca>, SoftHca) {
    let hca = SoftHca::start(cfg("tgt", i)).await.unwrap();
    let t = Target::start(hca.clone(), tc).unwrap();
    serve_cm(t.clone(), CmService::for_device(&hca)).unwrap();
    (t, hca)
}

async fn host_dev(i: u8) -> (SoftHca, CmService) {
    host_dev_on(i, [127, 0, 0, 1]).await
}

async fn host_dev_on(i: u8, ip: [u8; 4]) -> (SoftHca, CmService) {
    let hca = SoftHca::start(cfg_on("host", i, ip)).await.unwrap();
    let cm = CmService::for_device(&hca);
    (hca, cm)
}

fn opts(target: &SoftHca, subnqn: &str, hostnqn: &str) -> ConnectOptions {
    let mut o = ConnectOptions::new(target.addr(), subnqn);
    o.hostnqn = hostnqn.to_string();
    o.nr_io_queues = 1;
    o.queue_size = 32;
    o.keep_alive_tmo = Duration::ZERO;
    o.connect_timeout = CONNECT_TIMEOUT;
    o
}

async fn connect(i: u8, target: &SoftHca, subnqn: &str, hostnqn: &str) -> Controller {
    let (hca, cm) = host_dev(i).await;
    within(
        30,
        "connect",
        Controller::connect(hca, cm, opts(target, subnqn, hostnqn)),
    )
    .await
    .expect("connect")
}

/// Wait (at most 5 s) for something the target does in its own time.
async fn until(what: &str, f: impl Fn() -> bool) {
    for _ in 0..500 {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{what}: not within 5 s");
}

/// Write a pattern and read it back through `c`.
async fn write_read(c: &Controller, lba: u64, seed: u64) {
    let mut data = vec![0u8; 64 << 10];
    SmallRng::seed_from_u64(seed).fill(&mut data[..]);
    within(10, "write", c.write(1, lba, &data)).await.unwrap();
    let back = within(10, "read", c.read(1, lba, data.len()))
        .await
        .unwrap();
    assert!(back == data, "read back differs");
}

/// The NVMe-oF private data of a CM REQ for queue `qid` of `size` entries.
fn queue_req(qid: u16, size: u16) -> Vec<u8> {
    NvmeCmRequest {
        qid,
        hrqsize: size,
        hsqsize: size - 1,
        cntlid: 0,
    }
    .emit()
    .to_vec()
}

// ---- 1. pre-Connect cost ----------------------------------------------------------------

/// What one queue may cost before Fabrics Connect: a receive buffer and a capsule copy of
/// an I/O capsule (64 + 8192 bytes each), a response slot and the Connect data.
const PRE_CONNECT_QUEUE_BYTES: usize = 32 << 10;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pre_connect_reqs_cost_a_small_fixed_amount_and_the_target_still_serves() {
    // Defaults: queues of up to 1024 entries, 1 MiB per command (1 GiB of staging per such
    // queue if it were allocated at REQ time).
    let tc = TargetConfig {
        subsystems: vec![subsystem(NQN)],
        ..TargetConfig::default()
    };
    let (t, thca) = target(1, tc).await;
    let (_hca, cm) = host_dev(2).await;
    for i in 0..64u32 {
        let params = ConnectParams::new(Qpn::new(0x100 + i), 4420);
        within(
            20,
            "pre-Connect REQ",
            cm.connect(thca.addr(), params, &queue_req(1, 1024), CONNECT_TIMEOUT),
        )
        .await
        .expect("a REQ under the caps is accepted");
        let held = t.queue_memory();
        assert!(
            held <= (i as usize + 1) * PRE_CONNECT_QUEUE_BYTES,
            "after {} pre-Connect REQs the target holds {held} bytes of queue memory",
            i + 1
        );
    }
    assert_eq!(t.queue_count(), 64);
    // A real host still gets in and moves data.
    let c = connect(3, &thca, NQN, HOST).await;
    write_read(&c, 0, 1).await;
    c.disconnect().await;
}

/// REQ for an I/O queue of `size` from `cm`, as QPN `qpn`.
async fn req(cm: &CmService, target: &SoftHca, qpn: u32, size: u16) -> Result<(), String> {
    let params = ConnectParams::new(Qpn::new(qpn), 4420);
    within(
        20,
        "REQ",
        cm.connect(target.addr(), params, &queue_req(1, size), CONNECT_TIMEOUT),
    )
    .await
    .map(|_| ())
    .map_err(|e| e.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reqs_over_the_per_ip_and_total_queue_caps_are_rejected_no_resources() {
    let tc = TargetConfig {
        subsystems: vec![subsystem(NQN)],
        max_queues: 8,
        max_unconnected_per_ip: 4,
        // The shares are another test's: here one address may take the whole budget.
        address_share: 100,
        network_share: 100,
        host_share: 100,
        reserved_share: 0,
        ..TargetConfig::default()
    };
    let (t, thca) = target(4, tc).await;
    // A host of ours on 127.0.0.1: its two queues are connected, so they count only
    // against the total.
    let c = connect(17, &thca, NQN, HOST).await;
    assert_eq!(t.queue_count(), 2);
    let (_a, cm_a) = host_dev_on(5, [127, 0, 0, 1]).await;
    let (_b, cm_b) = host_dev_on(6, [127, 0, 0, 2]).await;
    for i in 0..4 {
        req(&cm_a, &thca, 0x200 + i, 128)
            .await
            .expect("under the caps");
    }
    let e = req(&cm_a, &thca, 0x210, 128).await.unwrap_err();
    assert!(
        e.contains("no resources"),
        "5th unconnected REQ from one IP: {e}"
    );
    // Another IP has its own allowance, up to the total.
    for i in 0..2 {
        req(&cm_b, &thca, 0x300 + i, 128)
            .await
            .expect("under the caps");
    }
    let e = req(&cm_b, &thca, 0x310, 128).await.unwrap_err();
    assert!(e.contains("no resources"), "9th queue in total: {e}");
    assert_eq!(t.queue_count(), 8);
    assert_eq!(t.stats().refused_queues, 2);
    // The host that got in before works on.
    write_read(&c, 0, 7).await;
    c.disconnect().await;
}

/// A listener that does not keep up (here: one that never reads) holds at most
/// `INCOMING_BACKLOG` requests; the REQs beyond are refused "no resources" at once instead
/// of queueing without end (before, every REQ waited in an unbounded channel and none was
/// answered).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reqs_beyond_a_stalled_listeners_backlog_are_refused_no_resources() {
    const EXTRA: usize = 16;
    let thca = SoftHca::start(cfg("tgt", 40)).await.unwrap();
    let _held = CmService::for_device(&thca).listen(4420);
    let (_h, cm) = host_dev(41).await;
    let cm = std::sync::Arc::new(cm);
    let (tx, mut rx) = tokio::sync::mpsc::channel(INCOMING_BACKLOG + EXTRA);
    let mut tasks = Vec::new();
    for i in 0..(INCOMING_BACKLOG + EXTRA) as u32 {
        let (cm, thca, tx) = (cm.clone(), thca.clone(), tx.clone());
        tasks.push(tokio::spawn(async move {
            let r = req(&cm, &thca, 0x1000 + i, 32).await;
            let _ = tx.send(r).await;
        }));
    }
    // The refusals come back (the accepted ones wait for an answer that never comes).
    for _ in 0..EXTRA {
        let r = within(5, "a refusal", rx.recv()).await.expect("a result");
        let e = r.expect_err("no listener answers, so only refusals come back");
        assert!(e.contains("no resources"), "{e}");
    }
    for t in tasks {
        t.abort();
    }
}

/// Refused REQs are exported as a metric (`nvmet_refused_queues_total`), not only kept in
/// the target's stats (before, no target counter reached the metrics at all).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_reqs_are_exported_as_metrics() {
    let tc = TargetConfig {
        subsystems: vec![subsystem(NQN)],
        max_unconnected_per_ip: 1,
        ..TargetConfig::default()
    };
    let rec = Counters::default();
    let hca = SoftHca::start(cfg("tgt", 42)).await.unwrap();
    let t = metrics::with_local_recorder(&rec, || Target::start(hca.clone(), tc)).unwrap();
    serve_cm(t.clone(), CmService::for_device(&hca)).unwrap();
    let (_h, cm) = host_dev(43).await;
    req(&cm, &hca, 0x400, 32).await.expect("under the cap");
    let e = req(&cm, &hca, 0x401, 32).await.unwrap_err();
    assert!(e.contains("no resources"), "{e}");
    until("the refusal is published", || {
        rec.get("nvmet_refused_queues_total") == 1
    })
    .await;
    assert_eq!(rec.get("nvmet_queues_connected_total"), 1);
}

// ---- 4. controller IDs from the free set -------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cntlids_come_from_the_free_set_and_never_replace_a_live_controller() {
    // Three IDs stand for the 65,519 of the default range: the wrap comes sooner.
    let tc = TargetConfig {
        subsystems: vec![subsystem(NQN)],
        cntlid_min: 10,
        cntlid_max: 12,
        ..TargetConfig::default()
    };
    let (t, thca) = target(7, tc).await;
    let a = connect(8, &thca, NQN, HOST).await;
    let b = connect(9, &thca, NQN, HOST).await;
    let c = connect(10, &thca, NQN, HOST).await;
    let ids = [a.cntlid, b.cntlid, c.cntlid];
    assert_eq!(ids, [10, 11, 12]);
    // All taken: a fourth is refused, Controller Busy, and nobody is replaced.
    let (hca, cm) = host_dev(11).await;
    let e = within(
        30,
        "connect",
        Controller::connect(hca, cm, opts(&thca, NQN, HOST)),
    )
    .await
    .err()
    .expect("no free controller ID");
    assert!(e.to_string().contains("0x81"), "{e}");
    assert_eq!(t.stats().cntlid_exhausted, 1);
    write_read(&a, 0, 2).await;
    write_read(&c, 256, 3).await;
    // A freed ID is reused; the live ones keep theirs and keep working.
    b.disconnect().await;
    until("the target drops B's queues", || t.queue_count() == 4).await;
    let d = connect(12, &thca, NQN, HOST).await;
    assert_eq!(d.cntlid, 11);
    write_read(&a, 512, 4).await;
    write_read(&c, 768, 5).await;
    write_read(&d, 1024, 6).await;
    for x in [a, c, d] {
        x.disconnect().await;
    }
}

// ---- 10. one tenant's namespace work does not stall another's ------------------------------

/// Host A keeps the target zeroing: 8 Dataset Management commands at once, each of 256
/// ranges that are the whole 64 MiB namespace 1 (128 GiB of zeroing in all, a dozen
/// seconds of memset at the least). Host B, another controller of the subsystem, must get
/// its 4 KiB reads of namespace 2 answered meanwhile, before any of A's TRIMs is done.
/// Before the fix the engine zeroed under its lock, so none of B's reads came back until
/// A's TRIMs were done (the assertion, or B's read timing out, fails then).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_hosts_whole_device_trims_do_not_stall_another_hosts_reads() {
    const READS: usize = 20;
    const TRIMS: usize = 8;
    let trimmed = Namespace::ram(1, 64 << 20, 9);
    let blocks = trimmed.blocks;
    let read = Namespace::ram(2, 1 << 20, 9);
    let ns = vec![std::sync::Arc::new(trimmed), std::sync::Arc::new(read)];
    let sub = Subsystem::new(Nqn::new(NQN).unwrap(), ns);
    let tc = TargetConfig {
        subsystems: vec![sub],
        ..TargetConfig::default()
    };
    let (t, thca) = target(30, tc).await;
    let a = std::sync::Arc::new(connect(31, &thca, NQN, HOST).await);
    let b = connect(32, &thca, NQN, "nqn.2026-11.io.nvmf-rdma:adv-other").await;
    let probe = within(10, "B's first read", b.read(2, 0, 4096)).await;
    probe.expect("B reads namespace 2");

    let before = t.stats().commands;
    let trims: Vec<_> = (0..TRIMS)
        .map(|_| {
            let a = a.clone();
            let whole = vec![(0u64, blocks as u32); 256];
            tokio::spawn(async move { a.deallocate(1, &whole).await })
        })
        .collect();
    // The TRIMs are on the target (taken off the wire) before B starts.
    until("the TRIMs reach the target", || {
        t.stats().commands >= before + TRIMS as u64
    })
    .await;
    for i in 0..READS {
        within(
            10,
            "B's read during A's TRIMs",
            b.read(2, i as u64 * 8, 4096),
        )
        .await
        .expect("B's read");
        assert!(
            trims.iter().all(|t| !t.is_finished()),
            "one of A's TRIMs finished before B's read {i}: B's reads waited for it"
        );
    }
    for t in trims {
        t.abort();
    }
}

// ---- 6. discovery ------------------------------------------------------------------------

const NQN_CLOSED: &str = "nqn.2026-11.io.nvmf-rdma:adversarial-closed";
const EVIL: &str = "nqn.2026-11.io.nvmf-rdma:evil-host";

fn subnqns(log: &[nvmf_rdma::nvme::DiscoveryLogEntry]) -> Vec<String> {
    let mut v: Vec<String> = log.iter().map(|e| e.subnqn.text().to_string()).collect();
    v.sort();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discovery_lists_only_allowed_subsystems_and_refuses_io_queues() {
    let mut closed = subsystem(NQN_CLOSED);
    closed.allowed_hosts = Some(vec![HOST.to_string()]);
    let tc = TargetConfig {
        subsystems: vec![subsystem(NQN), closed],
        ..TargetConfig::default()
    };
    let (_t, thca) = target(13, tc).await;
    let discover_as = |i: u8, hostnqn: &'static str| {
        let thca = thca.clone();
        async move {
            let (hca, cm) = host_dev(i).await;
            let o = opts(&thca, NQN, hostnqn);
            within(30, "discover", discover(hca, cm, o))
                .await
                .expect("discover")
        }
    };
    assert_eq!(subnqns(&discover_as(14, HOST).await), [NQN, NQN_CLOSED]);
    assert_eq!(
        subnqns(&discover_as(15, EVIL).await),
        [NQN],
        "a host not on the allow-list learns nothing of the closed subsystem"
    );

    // A discovery controller, enabled, asked for an I/O queue: refused.
    let (hca, cm) = host_dev(16).await;
    let mut aq = Raw::open(&hca, &cm, thca.addr(), 0, 32).await;
    let c = aq
        .connect(0, CNTLID_DYNAMIC, (fabrics::DISCOVERY_NQN, EVIL))
        .await;
    assert!(c.nvme_status().is_success(), "{:?}", c.nvme_status());
    let ConnectResult::Ok { cntlid, .. } = ConnectResult::from_result(c.result, true) else {
        panic!("connect result");
    };
    let en = FabricsCmd::set(fabrics::reg::CC, Cc::enable_default().0 as u64).to_sqe(2);
    assert!(aq.cmd(&en.to_bytes(), 2).await.nvme_status().is_success());
    // It asked for no keep-alive; it gets nvmet's discovery default, so it cannot idle
    // for ever.
    let kato = aq
        .cmd(
            &admin::get_features(3, feature::KEEP_ALIVE_TIMER).to_bytes(),
            3,
        )
        .await;
    assert_eq!(kato.result as u32, 120_000);
    let off = admin::set_features(4, feature::KEEP_ALIVE_TIMER, 0);
    assert!(aq.cmd(&off.to_bytes(), 4).await.nvme_status().is_success());
    let kato = aq
        .cmd(
            &admin::get_features(5, feature::KEEP_ALIVE_TIMER).to_bytes(),
            5,
        )
        .await;
    assert_eq!(kato.result as u32, 120_000, "Set Features turned it off");
    let mut iq = Raw::open(&hca, &cm, thca.addr(), 1, 32).await;
    let c = iq.connect(1, cntlid, (fabrics::DISCOVERY_NQN, EVIL)).await;
    let st = c.nvme_status();
    assert!(
        !st.is_success(),
        "an I/O queue on a discovery controller was accepted"
    );
    assert_eq!((st.sct, st.sc, st.dnr), {
        let w = Status::INVALID_QUEUE_ID.with_dnr();
        (w.sct, w.sc, w.dnr)
    });
}

// ---- 3. source check ---------------------------------------------------------------------

/// An RC queue on `hca`: PD, CQ, QP, one 4 KiB buffer.
fn rc_end(hca: &SoftHca) -> (CqId, Qpn, HostMem, MrInfo) {
    hca.with(|d, _| {
        let pd = d.alloc_pd().unwrap();
        let cq = d.create_cq(64).unwrap();
        let caps = nvmf_rdma::verbs::QpCaps {
            max_send_wr: 16,
            max_recv_wr: 16,
        };
        let qpn = create_qp_init(d, pd, cq, caps, Access::LOCAL_WRITE).unwrap();
        let m = HostMem::new(4096);
        let mr = d.reg_mr(pd, &m, 0, 4096, Access::LOCAL_WRITE).unwrap();
        (cq, qpn, m, mr)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capsule_from_another_udp_port_of_the_peers_ip_is_dropped_and_counted() {
    use nvmf_rdma::hca::wire::{emit_packet, BthRepr, IcrcContext, Opcode, PacketHeaders};
    use nvmf_rdma::verbs::Psn;
    // Two soft-HCAs on one IP, as a host and a target on loopback are; an RC queue between
    // them with PSNs we know.
    let a = SoftHca::start(cfg("a", 20)).await.unwrap();
    let b = SoftHca::start(cfg("b", 21)).await.unwrap();
    let (_acq, aqpn, amem, amr) = rc_end(&a);
    let (bcq, bqpn, bmem, bmr) = rc_end(&b);
    let (apsn, bpsn) = (Psn::new(0x1000), Psn::new(0x2000));
    let o = RcOptions::default();
    let to_b = PeerInfo {
        addr: b.addr(),
        qpn: bqpn,
        psn: bpsn,
    };
    let to_a = PeerInfo {
        addr: a.addr(),
        qpn: aqpn,
        psn: apsn,
    };
    a.with(|d, _| qp_to_rts(d, aqpn, to_b, apsn, &o)).unwrap();
    b.with(|d, _| qp_to_rts(d, bqpn, to_a, bpsn, &o)).unwrap();
    b.with(|d, _| {
        d.post_recv(
            bqpn,
            RecvWr {
                wr_id: 7,
                sgl: Sgl::one(bmr.addr, 4096, bmr.lkey),
            },
        )
    })
    .unwrap();

    // Someone else on the same IP, another UDP port, sends B the SEND it expects next:
    // right QPN, right PSN, valid ICRC.
    let evil = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    assert_ne!(evil.local_addr().unwrap(), a.addr());
    let mut pkt = Vec::new();
    let h = PacketHeaders::new(BthRepr::new(Opcode::RC_SEND_ONLY, bqpn, apsn));
    let ctx = IcrcContext::new(evil.local_addr().unwrap(), b.addr());
    emit_packet(&h, b"injected capsule", &ctx, &mut pkt);
    let before = b.with(|d, _| d.stats().rx_packets);
    evil.send_to(&pkt, b.addr()).unwrap();
    until("B reads the injected datagram", || {
        b.with(|d, _| d.stats().rx_packets) > before
    })
    .await;

    // Then the real peer sends with the same PSN: B must take the real one.
    amem.write(0, b"the real capsule");
    let wr = SendWr::unsignaled(1, SendOp::Send, Sgl::one(amr.addr, 16, amr.lkey));
    a.with(|d, now| d.post_send(now, aqpn, wr)).unwrap();
    let mut wcs = Vec::new();
    within(5, "B's receive", b.wait_cq(bcq, 1, &mut wcs)).await;
    assert_eq!(wcs[0].status, WcStatus::Success);
    let mut got = [0u8; 16];
    bmem.read(0, &mut got);
    assert_eq!(&got, b"the real capsule", "B executed the injected capsule");
    assert_eq!(b.with(|d, _| d.stats().rx_foreign_source), 1);
}

// ---- 2. randomness -----------------------------------------------------------------------

/// What a peer learns of a target: the comm ID and starting PSN in its REP (and the host's
/// comm ID in the REQ), and a memory key the device hands out.
async fn what_a_peer_sees() -> (u32, u32, u32, u32) {
    // Built exactly alike each time: same device config (seed included), the CM the
    // `target` command starts, host CM alike too.
    let tc = TargetConfig {
        subsystems: vec![subsystem(NQN)],
        ..TargetConfig::default()
    };
    let hca = SoftHca::start(cfg("same", 30)).await.unwrap();
    let t = Target::start(hca.clone(), tc).unwrap();
    serve_cm(t.clone(), CmService::for_device(&hca)).unwrap();
    let (_h, cm) = host_dev(31).await;
    let params = ConnectParams::new(Qpn::new(0x400), 4420);
    let est = within(
        20,
        "REQ",
        cm.connect(hca.addr(), params, &queue_req(1, 32), CONNECT_TIMEOUT),
    )
    .await
    .expect("accepted");
    let rkey = hca.with(|d, _| {
        let pd = d.alloc_pd().unwrap();
        let m = HostMem::new(4096);
        d.reg_mr(pd, &m, 0, 4096, Access::REMOTE_READ)
            .unwrap()
            .rkey
            .0
    });
    (est.remote_id.0, est.local_psn.get(), est.id.0, rkey)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identical_instances_draw_different_comm_ids_psns_and_rkeys() {
    let a = what_a_peer_sees().await;
    let b = what_a_peer_sees().await;
    // Each pair collides by chance with probability 2^-24 or less.
    assert_ne!(a.0, b.0, "target CM comm IDs repeat");
    assert_ne!(a.1, b.1, "target starting PSNs repeat");
    assert_ne!(a.2, b.2, "host CM comm IDs repeat");
    assert_ne!(a.3, b.3, "rkeys repeat");
}

// ---- 5. CM TimeWait and timers bounded -------------------------------------------------

mod cm_timers {
    use super::*;
    use nvmf_rdma::cm::iba_time;
    use nvmf_rdma::cm::private::service_id;
    use nvmf_rdma::cm::{
        AcceptParams, CmConfig, CmEndpoint, CmEvent, ConnState, MAX_PEER_TIMEOUT_EXP,
        MAX_TIMEWAIT_EXP,
    };
    use nvmf_rdma::verbs::{Guid, Instant};

    /// Move every MAD between `a` (at `aa`) and `b` (at `ba`) until both are quiet; MADs
    /// from `a` for which `drop_a` says so are lost.
    fn pump(
        now: Instant,
        a: &mut CmEndpoint,
        aa: SocketAddr,
        b: &mut CmEndpoint,
        ba: SocketAddr,
        drop_a: impl Fn(&[u8]) -> bool,
    ) {
        loop {
            let mut moved = false;
            while let Some((_, m)) = a.poll_transmit() {
                moved = true;
                if !drop_a(&m) {
                    b.handle_mad(now, aa, &m);
                }
            }
            while let Some((_, m)) = b.poll_transmit() {
                moved = true;
                a.handle_mad(now, ba, &m);
            }
            if !moved {
                return;
            }
        }
    }

    fn is_rtu(m: &[u8]) -> bool {
        nvmf_rdma::cm::CmMad::parse(m).is_ok_and(|m| m.message.name() == "RTU")
    }

    /// An attacker whose REQs claim the longest timeouts the fields can carry (2^31 ×
    /// 4.096 µs ≈ 2.4 h), against a target's CM.
    fn endpoints() -> (CmEndpoint, SocketAddr, CmEndpoint, SocketAddr) {
        let aa: SocketAddr = "127.0.0.66:4791".parse().unwrap();
        let ba: SocketAddr = "127.0.0.1:4791".parse().unwrap();
        let mut evil = CmConfig::new(aa.ip(), Guid(0x66));
        evil.ack_delay = 31; // local ACK timeout 31 in the REQ
        evil.cm_response_timeout = 31; // local CM response timeout 31
        let a = CmEndpoint::from_seed(evil, 1);
        let mut b = CmEndpoint::from_seed(CmConfig::new(ba.ip(), Guid(0xB)), 2);
        b.listen(service_id(4420));
        (a, aa, b, ba)
    }

    /// Connect `a` to `b` (accepting on `b`); returns a's and b's connection IDs.
    fn handshake(
        now: Instant,
        a: &mut CmEndpoint,
        aa: SocketAddr,
        b: &mut CmEndpoint,
        ba: SocketAddr,
        qpn: u32,
        drop_rtu: bool,
    ) -> (nvmf_rdma::cm::ConnId, nvmf_rdma::cm::ConnId) {
        let ida = a
            .connect(
                now,
                ba,
                &ConnectParams::new(Qpn::new(qpn), 4420),
                &queue_req(1, 32),
            )
            .unwrap();
        pump(now, a, aa, b, ba, |_| false);
        let idb = loop {
            match b.poll_event() {
                Some(CmEvent::ConnectRequest(r)) => break r.id,
                Some(_) => continue,
                None => panic!("no REQ reached b"),
            }
        };
        b.accept(now, idb, &AcceptParams::new(Qpn::new(0x77)), &[])
            .unwrap();
        pump(now, a, aa, b, ba, |m| drop_rtu && is_rtu(m));
        (ida, idb)
    }

    #[test]
    fn timewait_and_rep_retries_are_bounded_whatever_timeout_the_peer_asks_for() {
        let (mut a, aa, mut b, ba) = endpoints();
        let t0 = Instant(1_000_000_000);
        let (ida, idb) = handshake(t0, &mut a, aa, &mut b, ba, 0x100, false);
        assert_eq!(b.state(idb), Some(ConnState::Established));
        // The attacker disconnects: b answers and enters TimeWait.
        a.disconnect(t0, ida, &[]).unwrap();
        pump(t0, &mut a, aa, &mut b, ba, |_| false);
        assert_eq!(b.state(idb), Some(ConnState::TimeWait));
        let cap = iba_time(MAX_TIMEWAIT_EXP);
        assert!(cap <= Duration::from_secs(5));
        let due = b.poll_timeout().expect("TimeWait timer");
        assert!(
            due <= t0 + cap,
            "TimeWait lasts {:?}",
            Duration::from_nanos(due.0 - t0.0)
        );
        b.handle_timeout(t0 + cap);
        assert_eq!(b.state(idb), None, "TimeWait over within the cap");

        // A REQ whose RTU never comes: each REP retry waits at most the cap, not 2.4 h.
        let (_, idb) = handshake(t0, &mut a, aa, &mut b, ba, 0x101, true);
        assert_eq!(b.state(idb), Some(ConnState::RepSent));
        let try_cap = iba_time(MAX_PEER_TIMEOUT_EXP);
        assert!(try_cap <= Duration::from_secs(10));
        let mut now = t0;
        for _ in 0..16 {
            let Some(due) = b.poll_timeout() else { break };
            assert!(
                due <= now + try_cap,
                "a REP retry waits {:?}",
                Duration::from_nanos(due.0 - now.0)
            );
            now = due;
            b.handle_timeout(now);
            while b.poll_transmit().is_some() {}
        }
        assert_eq!(b.state(idb), None, "REP retries ran out within 16 tries");
        assert_eq!(b.connections(), 0);
    }
}

// ---- 11. budgets: one peer cannot lock every host out ---------------------------------------

/// A Fabrics Connect capsule of `raw` for `qid` that asks for keep-alive timeout `kato_ms`.
fn connect_with_kato(raw: &Raw, cid: u16, qid: u16, kato_ms: u32, nqns: (&str, &str)) -> [u8; 64] {
    let mut cap = raw.connect_capsule(cid, qid, CNTLID_DYNAMIC, *b"raw-queue-host\0\0", nqns);
    // Connect's KATO field (Dword 12).
    cap[48..52].copy_from_slice(&kato_ms.to_le_bytes());
    cap
}

/// One address connects to the discovery subsystem (open to anyone) and takes all it can:
/// an admin queue of 1024 entries is refused (nvmet's 32 at most), a keep-alive timeout of
/// 49 days is refused, and admin queues of 32 entries stop at its address's share. A host
/// on another network still connects and moves data while the first holds its maximum.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_address_holding_its_most_of_discovery_queues_leaves_room_for_another_host() {
    const MAX_QUEUES: usize = 16;
    let tc = TargetConfig {
        subsystems: vec![subsystem(NQN)],
        max_queues: MAX_QUEUES,
        ..TargetConfig::default()
    };
    let (t, thca) = target(50, tc).await;
    let (hca, cm) = host_dev_on(51, [127, 0, 0, 5]).await;
    let params = ConnectParams::new(Qpn::new(0x600), 4420);
    let big = within(
        20,
        "REQ",
        cm.connect(thca.addr(), params, &queue_req(0, 1024), CONNECT_TIMEOUT),
    )
    .await;
    let e = big.expect_err("an admin queue of 1024 entries was accepted");
    assert!(e.to_string().contains("send queue size"), "{e}");

    let mut aq = Raw::open(&hca, &cm, thca.addr(), 0, 32).await;
    let nqns = (fabrics::DISCOVERY_NQN, HOST);
    let cap = connect_with_kato(&aq, 0x20, 0, u32::MAX, nqns);
    let st = aq.cmd(&cap, 0x20).await.nvme_status();
    assert_eq!((st.sct, st.sc), {
        let w = Status::CONNECT_INVALID_PARAMETERS;
        (w.sct, w.sc)
    });
    aq.close();

    // As many discovery controllers as it can get.
    let mut held = Vec::new();
    let mut refused = None;
    for _ in 0..MAX_QUEUES {
        let mut q = match Raw::try_open(&hca, &cm, thca.addr(), 0, 32).await {
            Ok(q) => q,
            Err(e) => {
                refused = Some(e);
                break;
            }
        };
        let st = q.connect(0, CNTLID_DYNAMIC, nqns).await.nvme_status();
        if !st.is_success() {
            refused = Some(format!("{st:?}"));
            break;
        }
        held.push(q);
    }
    let refused = refused.expect("one address took every queue of the target");
    // Nor can it lift its keep-alive timeout past the cap afterwards.
    let long = admin::set_features(0x30, feature::KEEP_ALIVE_TIMER, u32::MAX);
    let st = held[0].cmd(&long.to_bytes(), 0x30).await.nvme_status();
    assert_eq!((st.sct, st.sc), {
        let w = Status::KEEP_ALIVE_INVALID;
        (w.sct, w.sc)
    });
    // Its address's share (half by default): the rest stays for other hosts.
    assert!(
        held.len() <= MAX_QUEUES / 2,
        "one address holds {} of {MAX_QUEUES} queues ({refused})",
        held.len()
    );
    // Another host, on another network, still gets in.
    let (hca2, cm2) = host_dev_on(52, [127, 0, 1, 7]).await;
    let c = within(
        30,
        "connect",
        Controller::connect(
            hca2,
            cm2,
            opts(&thca, NQN, "nqn.2026-11.io.nvmf-rdma:second"),
        ),
    )
    .await
    .expect("a second host connects while the first holds its most");
    write_read(&c, 0, 11).await;
    assert!(t.stats().refused_queues >= 1);
    c.disconnect().await;
    for q in held {
        q.close();
    }
}

/// REQs for I/O queues of 32 entries from `ip`, as a peer that forged its source address
/// sends them: out of a UDP socket on `ip` that never reads, so the target's REPs go
/// unanswered and no RTU ever comes. The ICRC is valid (made by a device on `ip`).
fn forge_reqs(target: SocketAddr, ip: [u8; 4], n: u32, seed: u64) -> std::net::UdpSocket {
    use nvmf_rdma::cm::{CmConfig, CmEndpoint};
    use nvmf_rdma::hca::device::Device;
    use nvmf_rdma::verbs::Instant;
    let sock = std::net::UdpSocket::bind(SocketAddr::from((ip, 0))).unwrap();
    let from = sock.local_addr().unwrap();
    let mut dc = cfg_on("spoof", 60 + seed as u8, ip);
    dc.addr = from;
    let mut dev = Device::new(dc);
    let guid = dev.identity().guid;
    let mut cm = CmEndpoint::new(
        CmConfig::new(from.ip(), guid),
        SmallRng::seed_from_u64(seed),
    );
    for i in 0..n {
        let params = ConnectParams::new(Qpn::new(0x900 + i), 4420);
        cm.connect(Instant(0), target, &params, &queue_req(1, 32))
            .unwrap();
    }
    let mut buf = Vec::new();
    while let Some((to, mad)) = cm.poll_transmit() {
        dev.post_gsi(to, &mad).unwrap();
        while let Some(dst) = dev.poll_transmit(Instant(0), &mut buf) {
            sock.send_to(&buf, dst).unwrap();
            buf.clear();
        }
    }
    sock
}

/// REQs with forged source addresses (five invented ones, more REQs than the target has
/// queues) are answered but never completed: they wait in the pre-RTU table, which drops
/// its oldest when full, and count against no budget, so real hosts still connect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_reqs_from_invented_addresses_do_not_lock_hosts_out() {
    const SOURCES: u8 = 5;
    const PER_SOURCE: u32 = 8;
    let tc = TargetConfig {
        subsystems: vec![subsystem(NQN)],
        max_queues: 16,
        max_pre_rtu: 8,
        max_pre_rtu_per_ip: 4,
        ..TargetConfig::default()
    };
    let (t, thca) = target(53, tc).await;
    let mut socks = Vec::new();
    for s in 0..SOURCES {
        socks.push(forge_reqs(
            thca.addr(),
            [127, 0, 3, 10 + s],
            PER_SOURCE,
            s as u64,
        ));
    }
    let sent = (SOURCES as u32 * PER_SOURCE) as u64;
    until("every forged REQ is answered", || {
        let s = t.stats();
        s.queues_connected + s.refused_queues >= sent
    })
    .await;
    for i in 0..3 {
        let c = connect(54 + i, &thca, NQN, HOST).await;
        write_read(&c, 0, 20 + i as u64).await;
        c.disconnect().await;
    }
    drop(socks);
}

/// An I/O-queue Connect for a qid its controller already has is refused with Command
/// Sequence Error (nvmet_install_queue), whoever sends it: the live queue keeps working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_io_queue_connect_for_a_qid_the_controller_has_is_refused() {
    let tc = TargetConfig {
        subsystems: vec![subsystem(NQN)],
        ..TargetConfig::default()
    };
    let (t, thca) = target(56, tc).await;
    let (hca, cm) = host_dev(57).await;
    let mut o = opts(&thca, NQN, HOST);
    o.hostid = *b"raw-queue-host\0\0";
    let c = within(30, "connect", Controller::connect(hca, cm, o))
        .await
        .expect("connect");
    let (hca2, cm2) = host_dev_on(58, [127, 0, 0, 9]).await;
    let mut iq = Raw::open(&hca2, &cm2, thca.addr(), 1, 32).await;
    let st = iq.connect(1, c.cntlid, (NQN, HOST)).await.nvme_status();
    assert_eq!((st.sct, st.sc, st.dnr), {
        let w = Status::COMMAND_SEQUENCE_ERROR.with_dnr();
        (w.sct, w.sc, w.dnr)
    });
    write_read(&c, 0, 30).await;
    iq.close();
    assert_eq!(t.stats().queues_connected, 3);
    c.disconnect().await;
}

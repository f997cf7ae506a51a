//! Bad input in both directions, on loopback UDP.
//!
//! (a) A raw RC queue, connected to the built-in target through RDMA CM like any host's,
//!     sends malformed capsules: too short, PSDT not SGL, unknown opcodes, keyed SGLs with a
//!     bogus rkey or shorter than the command, I/O before Fabrics Connect, in-capsule data at
//!     bad offsets. Each gets the NVMe status a target must give (with DNR) when a command
//!     ID can be read; the target never falls over, and a well-behaved controller on the
//!     same target keeps doing verified I/O the whole time.
//! (b) A fake target (`tests/common/fake_target.rs`) answers Connect correctly and then lies: completions
//!     for command IDs not in flight, duplicates, 8-byte responses, garbage, success
//!     without data, RDMA WRITEs outside the buffer a command named, RDMA READs past a
//!     write's length and RDMA WRITEs into a write's data. The host fails only
//!     what is affected with a typed error or counts and ignores the bogus completion,
//!     completes nothing twice, mixes no request's data into another's, and never panics.
//!
//! Every await that depends on a peer sits under a timeout.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::rig::within;
use crate::{fake_target, raw_queue};
use fake_target::{FakeConfig, FakeTarget, Lie, Script};
use nvmf_rdma::driver::{CmService, SoftHca};
use nvmf_rdma::hca::device::DeviceConfig;
use nvmf_rdma::nvme::admin::{self, opcode};
use nvmf_rdma::nvme::fabrics::{self, ConnectResult, CNTLID_DYNAMIC};
use nvmf_rdma::nvme::{Cc, Cqe, FabricsCmd, Nqn, SglDescriptor, Sqe, Status};
use nvmf_rdma::nvmet::{serve_cm, Namespace, Subsystem, Target, TargetConfig};
use nvmf_rdma::reconnect::CtrlState;
use nvmf_rdma::transport::{ConnectOptions, Controller, HostError, QueueStats};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use raw_queue::Raw;

const NQN: &str = "nqn.2026-11.io.nvmf-rdma:bad-input";
const HOST_RAW: &str = "nqn.2026-11.io.nvmf-rdma:raw-host";
const HOST_OK: &str = "nqn.2026-11.io.nvmf-rdma:good-host";
const BS: usize = 512;
/// Long enough for one CM REQ retry (about 4.3 s): the first datagram a brand-new device
/// sends can be dropped by the driver (see the report on `TxBatch::flush`).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(8);

fn cfg(name: &str, i: u8) -> DeviceConfig {
    crate::rig::device(8, name, i)
}

async fn device(name: &str, i: u8) -> (SoftHca, CmService) {
    let hca = SoftHca::start(cfg(name, i)).await.unwrap();
    let cm = CmService::for_device(&hca);
    (hca, cm)
}

fn host_opts(target: SocketAddr, hostnqn: &str, queues: usize, size: usize) -> ConnectOptions {
    let mut o = ConnectOptions::new(target, NQN);
    o.hostnqn = hostnqn.to_string();
    o.nr_io_queues = queues;
    o.queue_size = size;
    o.keep_alive_tmo = Duration::ZERO;
    o.connect_timeout = CONNECT_TIMEOUT;
    // A lie that breaks a connection makes the controller recover; do it at once.
    o.policy.reconnect_delay = Duration::ZERO;
    o
}

fn status_of(cqe: &Cqe) -> (u8, u8, bool) {
    let s = cqe.nvme_status();
    (s.sct, s.sc, s.dnr)
}

fn expect(st: Status) -> (u8, u8, bool) {
    (st.sct, st.sc, true)
}

// ---- (a) a raw queue against the built-in target ----------------------------------------

fn io_sqe(op: u8, cid: u16, nsid: u32, slba: u64, blocks: u32) -> Sqe {
    let mut s = Sqe::new(op, cid);
    s.nsid = nsid;
    s.cdw10 = slba as u32;
    s.cdw11 = (slba >> 32) as u32;
    s.cdw12 = blocks - 1;
    s
}

/// Write `data` as in-capsule data (SGL offset `offset`, length `sgl_len`).
fn in_capsule_write(cid: u16, slba: u64, data: &[u8], offset: u64, sgl_len: u32) -> Vec<u8> {
    let mut s = io_sqe(opcode::io::WRITE, cid, 1, slba, (data.len() / BS) as u32);
    s.set_sgl(&SglDescriptor::InCapsule {
        offset,
        len: sgl_len,
    })
    .unwrap();
    let mut v = s.to_bytes().to_vec();
    v.extend_from_slice(data);
    v
}

/// A well-behaved controller doing verified write/read-back in a loop until told to stop.
fn keep_busy(c: Arc<Controller>, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<u64> {
    tokio::spawn(async move {
        let mut rng = SmallRng::seed_from_u64(77);
        let mut rounds = 0u64;
        while !stop.load(Ordering::SeqCst) {
            let blocks = rng.random_range(1..=64usize);
            let lba = rng.random_range(8192..(16384 - blocks as u64));
            let mut data = vec![0u8; blocks * BS];
            rng.fill(&mut data[..]);
            let io = async {
                c.write(1, lba, &data).await?;
                c.read(1, lba, data.len()).await
            };
            let back = tokio::time::timeout(Duration::from_secs(3), io)
                .await
                .unwrap_or_else(|_| panic!("good host: I/O hung in round {rounds}"))
                .unwrap_or_else(|e| panic!("good host: I/O failed in round {rounds}: {e}"));
            assert!(back == data, "good host: data differs in round {rounds}");
            rounds += 1;
        }
        rounds
    })
}

async fn builtin_target(i: u8) -> (Target<SoftHca>, SoftHca) {
    let (hca, cm) = device("tgt", i).await;
    let ns = Arc::new(Namespace::ram(1, 8 << 20, 9));
    let tc = TargetConfig {
        subsystems: vec![Subsystem::new(Nqn::new(NQN).unwrap(), vec![ns])],
        max_transfer: 128 << 10,
        ..TargetConfig::default()
    };
    let t = Target::start(hca.clone(), tc).unwrap();
    serve_cm(t.clone(), cm).unwrap();
    (t, hca)
}

/// Raw admin queue up to an enabled controller with one I/O queue; returns the CNTLID.
async fn raw_controller(admin_q: &mut Raw, hostid: [u8; 16]) -> u16 {
    let c = admin_q
        .cmd(
            &admin_q.connect_capsule(1, 0, CNTLID_DYNAMIC, hostid, (NQN, HOST_RAW)),
            1,
        )
        .await;
    assert!(c.nvme_status().is_success(), "{:?}", c.nvme_status());
    let ConnectResult::Ok { cntlid, .. } = ConnectResult::from_result(c.result, true) else {
        panic!("connect result");
    };
    let en = FabricsCmd::set(fabrics::reg::CC, Cc::enable_default().0 as u64).to_sqe(2);
    assert!(admin_q
        .cmd(&en.to_bytes(), 2)
        .await
        .nvme_status()
        .is_success());
    let nq = admin::set_num_queues(3, 1, 1).unwrap();
    assert!(admin_q
        .cmd(&nq.to_bytes(), 3)
        .await
        .nvme_status()
        .is_success());
    cntlid
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_capsules_get_typed_statuses_and_the_target_lives_on() {
    let (t, thca) = builtin_target(1).await;
    let (ghca, gcm) = device("good", 2).await;
    let good = Arc::new(
        within(
            20,
            "good host connect",
            Controller::connect(ghca, gcm, host_opts(thca.addr(), HOST_OK, 2, 32)),
        )
        .await
        .unwrap(),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let busy = keep_busy(good.clone(), stop.clone());

    let (rhca, rcm) = device("raw", 3).await;
    let hostid = *b"raw-host-id-0001";
    let mut aq = Raw::open(&rhca, &rcm, thca.addr(), 0, 32).await;

    // Admin queue, before Connect: anything but Connect is a command sequence error.
    let get = FabricsCmd::get(fabrics::reg::CAP).to_sqe(0x11);
    let c = aq.cmd(&get.to_bytes(), 0x11).await;
    assert_eq!(status_of(&c), expect(Status::COMMAND_SEQUENCE_ERROR));
    let c = aq
        .cmd(&admin::identify_controller(0x12).to_bytes(), 0x12)
        .await;
    assert_eq!(status_of(&c), expect(Status::COMMAND_SEQUENCE_ERROR));

    let cntlid = raw_controller(&mut aq, hostid).await;

    // Admin queue, connected: unknown opcode, short capsule, PSDT not SGL.
    let c = aq.cmd(&Sqe::new(0xC5, 0x21).to_bytes(), 0x21).await;
    assert_eq!(status_of(&c), expect(Status::INVALID_OPCODE));
    let c = aq.cmd(&Sqe::new(0x06, 0x22).to_bytes()[..10], 0x22).await;
    assert_eq!(status_of(&c), expect(Status::INVALID_FIELD));
    let mut prp = admin::identify_controller(0x23).to_bytes();
    prp[1] = 0x00; // PSDT = PRP
    let c = aq.cmd(&prp, 0x23).await;
    assert_eq!(status_of(&c), expect(Status::INVALID_FIELD));

    // An I/O queue: commands before its Connect.
    let mut iq = Raw::open(&rhca, &rcm, thca.addr(), 1, 16).await;
    let mut rd = io_sqe(opcode::io::READ, 0x31, 1, 0, 1);
    rd.set_sgl(&iq.keyed(4096, 512)).unwrap();
    let c = iq.cmd(&rd.to_bytes(), 0x31).await;
    assert_eq!(status_of(&c), expect(Status::COMMAND_SEQUENCE_ERROR));
    let w = in_capsule_write(0x32, 0, &[0xEE; 512], 0, 512);
    let c = iq.cmd(&w, 0x32).await;
    assert_eq!(status_of(&c), expect(Status::COMMAND_SEQUENCE_ERROR));
    let mut wk = io_sqe(opcode::io::WRITE, 0x33, 1, 0, 1);
    wk.set_sgl(&iq.keyed(4096, 512)).unwrap();
    let c = iq.cmd(&wk.to_bytes(), 0x33).await;
    assert_eq!(status_of(&c), expect(Status::COMMAND_SEQUENCE_ERROR));
    // A Connect naming a controller that is not ours.
    let cap = iq.connect_capsule(0x34, 1, cntlid.wrapping_add(100), hostid, (NQN, HOST_RAW));
    let c = iq.cmd(&cap, 0x34).await;
    assert_eq!(status_of(&c), expect(Status::CONNECT_INVALID_PARAMETERS));
    // The right Connect, then a second one.
    let c = iq
        .cmd(
            &iq.connect_capsule(0x35, 1, cntlid, hostid, (NQN, HOST_RAW)),
            0x35,
        )
        .await;
    assert!(c.nvme_status().is_success(), "{:?}", c.nvme_status());
    let c = iq
        .cmd(
            &iq.connect_capsule(0x36, 1, cntlid, hostid, (NQN, HOST_RAW)),
            0x36,
        )
        .await;
    assert_eq!(status_of(&c), expect(Status::COMMAND_SEQUENCE_ERROR));

    // Malformed capsules on a connected I/O queue.
    let c = iq.cmd(&rd.to_bytes()[..10], rd.cid).await;
    assert_eq!(
        status_of(&c),
        expect(Status::INVALID_FIELD),
        "10-byte capsule"
    );
    let mut b = io_sqe(opcode::io::READ, 0x41, 1, 0, 1);
    b.set_sgl(&iq.keyed(4096, 512)).unwrap();
    let mut b = b.to_bytes();
    b[1] = 0x00; // PSDT = PRP
    let c = iq.cmd(&b, 0x41).await;
    assert_eq!(status_of(&c), expect(Status::INVALID_FIELD), "PSDT PRP");
    b[1] = 0x80; // PSDT = SGL with a metadata segment: not what we speak either
    b[2] = 0x42;
    let c = iq.cmd(&b, 0x42).await;
    assert_eq!(status_of(&c), expect(Status::INVALID_FIELD), "PSDT 0x80");
    b[1] = 0x43; // SGL, FUSE = reserved value 3
    b[2] = 0x43;
    let c = iq.cmd(&b, 0x43).await;
    assert_eq!(status_of(&c), expect(Status::INVALID_FIELD), "FUSE 3");

    let c = iq.cmd(&io_sqe(0x7E, 0x44, 1, 0, 1).to_bytes(), 0x44).await;
    assert_eq!(status_of(&c), expect(Status::INVALID_OPCODE), "opcode 0x7e");
    let c = iq
        .cmd(&Sqe::new(opcode::admin::IDENTIFY, 0x45).to_bytes(), 0x45)
        .await;
    assert!(
        !c.nvme_status().is_success() && c.nvme_status().dnr,
        "an admin opcode on an I/O queue: {:?}",
        c.nvme_status()
    );

    // A Read whose keyed SGL is shorter than the command: refused, nothing written.
    let canary = vec![0xC3u8; 8192];
    iq.data.0.write(8192, &canary);
    let mut r = io_sqe(opcode::io::READ, 0x51, 1, 0, 8);
    r.set_sgl(&iq.keyed(8192, 1024)).unwrap();
    let c = iq.cmd(&r.to_bytes(), 0x51).await;
    assert_eq!(
        status_of(&c),
        expect(Status::SGL_DATA_LENGTH_INVALID),
        "short keyed SGL on a Read"
    );
    let mut now = vec![0u8; 8192];
    iq.data.0.read(8192, &mut now);
    assert!(now == canary, "a refused Read wrote into the host buffer");
    // The same for a Write.
    let mut w = io_sqe(opcode::io::WRITE, 0x52, 1, 0, 8);
    w.set_sgl(&iq.keyed(8192, 1024)).unwrap();
    let c = iq.cmd(&w.to_bytes(), 0x52).await;
    assert_eq!(status_of(&c), expect(Status::SGL_DATA_LENGTH_INVALID));
    // A Write larger than the target's largest transfer.
    let mut w = io_sqe(opcode::io::WRITE, 0x53, 1, 0, 1024);
    w.set_sgl(&iq.keyed(0, 512 << 10)).unwrap();
    let c = iq.cmd(&w.to_bytes(), 0x53).await;
    assert_eq!(status_of(&c), expect(Status::SGL_DATA_LENGTH_INVALID));
    // An SGL descriptor type we do not take (0x00: data block).
    let mut w = io_sqe(opcode::io::WRITE, 0x54, 1, 0, 1);
    w.dptr = [0; 16];
    w.dptr[8] = 0x00;
    w.dptr[15] = 0x00;
    let c = iq.cmd(&w.to_bytes(), 0x54).await;
    assert_eq!(status_of(&c), expect(Status::SGL_DESCRIPTOR_TYPE_INVALID));

    // In-capsule data at offsets that are out of range.
    let data = [0x5Au8; 512];
    for (cid, offset, len) in [
        (0x61u16, 16u64, 512u32),    // not at the start of the data area
        (0x62, 8192, 512),           // past the capsule
        (0x63, u64::MAX - 100, 512), // would wrap a 64-bit sum
        (0x64, 0, 4096 + 512),       // longer than what the capsule carries
    ] {
        let blocks = if len > 512 { 9 } else { 1 };
        let mut s = io_sqe(opcode::io::WRITE, cid, 1, 0, blocks);
        s.set_sgl(&SglDescriptor::InCapsule { offset, len })
            .unwrap();
        let mut v = s.to_bytes().to_vec();
        v.extend_from_slice(&data);
        let c = iq.cmd(&v, cid).await;
        assert_eq!(
            status_of(&c),
            expect(Status::SGL_OFFSET_INVALID),
            "in-capsule offset {offset:#x} len {len}"
        );
    }
    // Namespace and LBA checks.
    let mut r = io_sqe(opcode::io::READ, 0x71, 9, 0, 1);
    r.set_sgl(&iq.keyed(4096, 512)).unwrap();
    let c = iq.cmd(&r.to_bytes(), 0x71).await;
    assert_eq!(status_of(&c), expect(Status::INVALID_NAMESPACE_OR_FORMAT));
    let mut r = io_sqe(opcode::io::READ, 0x72, 1, (8 << 20) / 512, 1);
    r.set_sgl(&iq.keyed(4096, 512)).unwrap();
    let c = iq.cmd(&r.to_bytes(), 0x72).await;
    assert_eq!(status_of(&c), expect(Status::LBA_OUT_OF_RANGE));
    let mut r = io_sqe(opcode::io::READ, 0x73, 1, u64::MAX, 2);
    r.set_sgl(&iq.keyed(4096, 1024)).unwrap();
    let c = iq.cmd(&r.to_bytes(), 0x73).await;
    assert_eq!(
        status_of(&c),
        expect(Status::LBA_OUT_OF_RANGE),
        "wrapping LBA"
    );

    // After all that, the raw queue still does correct I/O.
    let payload: Vec<u8> = (0..1024).map(|i| (i * 7 % 251) as u8).collect();
    let c = iq
        .cmd(&in_capsule_write(0x81, 40, &payload, 0, 1024), 0x81)
        .await;
    assert!(c.nvme_status().is_success(), "{:?}", c.nvme_status());
    let mut r = io_sqe(opcode::io::READ, 0x82, 1, 40, 2);
    r.set_sgl(&iq.keyed(16384, 1024)).unwrap();
    let c = iq.cmd(&r.to_bytes(), 0x82).await;
    assert!(c.nvme_status().is_success(), "{:?}", c.nvme_status());
    let mut back = vec![0u8; 1024];
    iq.data.0.read(16384, &mut back);
    assert!(back == payload, "raw queue reads back what it wrote");

    // A capsule too short to carry a command ID gets no completion: one for a made-up
    // ID could complete an unrelated command.
    let before = t.stats().malformed_capsules;
    iq.send(&[0x02]);
    assert_eq!(iq.response(300).await, Err("timeout".into()));
    assert_eq!(t.stats().malformed_capsules, before + 1);

    // A Read whose rkey is bogus: our HCA refuses the target's RDMA WRITE. That is a
    // transport error: the queue dies on both sides, and only that queue.
    let queues = t.queue_count();
    let mut r = io_sqe(opcode::io::READ, 0x91, 1, 0, 1);
    r.set_sgl(
        &SglDescriptor::keyed(iq.data.1.addr, 512, iq.data.1.rkey.0 ^ 0x00FF_0000, false).unwrap(),
    )
    .unwrap();
    iq.send(&r.to_bytes());
    let e = iq
        .response(3000)
        .await
        .expect_err("no completion for a failed transfer");
    assert!(e.starts_with("transport"), "{e}");
    for _ in 0..300 {
        if t.queue_count() == queues - 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        t.queue_count(),
        queues - 1,
        "the target dropped just that queue"
    );

    // The raw admin queue is still served.
    let c = aq
        .cmd(
            &FabricsCmd::get(fabrics::reg::CSTS).to_sqe(0xA1).to_bytes(),
            0xA1,
        )
        .await;
    assert!(c.nvme_status().is_success());

    stop.store(true, Ordering::SeqCst);
    let rounds = within(10, "good host loop", busy).await.expect("good host");
    assert!(rounds > 5, "the good host kept working ({rounds} rounds)");
    let st = t.stats();
    assert!(st.malformed_capsules >= 6, "{st:?}");
    eprintln!("good host rounds {rounds}, target {st:?}");
    iq.close();
    aq.close();
    let good = Arc::into_inner(good).unwrap();
    within(10, "disconnect", good.disconnect()).await;
}

// ---- (b) a target that lies --------------------------------------------------------------

async fn fake(i: u8, mut fc: FakeConfig, script: Script) -> (FakeTarget, SoftHca) {
    let (hca, cm) = device("fake", i).await;
    fc.seed = i as u64;
    let f = FakeTarget::start(hca.clone(), cm, fc, script).expect("fake target");
    (f, hca)
}

fn fake_cfg() -> FakeConfig {
    FakeConfig::new(Nqn::new(NQN).unwrap())
}

async fn host_of(i: u8, target: &SoftHca, queues: usize) -> Controller {
    let (hca, cm) = device("host", i).await;
    within(
        20,
        "connect to the fake",
        Controller::connect(hca, cm, {
            let mut o = host_opts(target.addr(), HOST_OK, queues, 16);
            // The fake runs each command to its end before the next and a broken connection
            // ends its queue: nothing of a dead connection runs late, and it reports no CQT
            // (the hold would be 2 x KATO + the 10 s default).
            o.safe_retry.mode = nvmf_rdma::transport::SafeRetry::Off;
            o
        }),
    )
    .await
    .expect("a lying target still answers Connect correctly")
}

/// The fake's namespace content at `lba`, `len` bytes.
fn truth(lba: u64, len: usize) -> Vec<u8> {
    let at = lba as usize * BS;
    (at..at + len).map(FakeConfig::pattern).collect()
}

fn script(f: impl Fn(u64) -> Lie + Send + Sync + 'static) -> Script {
    Arc::new(move |sqe: &Sqe| f(sqe.cdw10 as u64 | (sqe.cdw11 as u64) << 32))
}

fn io_stats(c: &Controller) -> QueueStats {
    let mut s = QueueStats::default();
    for q in 0..c.io_queue_count() {
        let x = c.queue(q).stats();
        s.submitted += x.submitted;
        s.completed += x.completed;
        s.unknown_cid += x.unknown_cid;
        s.duplicate_completion += x.duplicate_completion;
        s.bad_response_len += x.bad_response_len;
        s.in_capsule += x.in_capsule;
        s.remote_invalidations += x.remote_invalidations;
        s.local_invalidations += x.local_invalidations;
        s.bogus_invalidations += x.bogus_invalidations;
    }
    s
}

/// Stats are published at the end of each turn of the queue task, just after it answered
/// its callers: wait for `f` to hold. `submitted` counts the queue's Fabrics Connect too.
async fn stats_settle(c: &Controller, f: impl Fn(&QueueStats) -> bool) -> QueueStats {
    for _ in 0..200 {
        let s = io_stats(c);
        if f(&s) {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    io_stats(c)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_for_ids_not_in_flight_are_counted_and_ignored() {
    // Odd LBAs: first a completion for the previous command's ID (same slot, older
    // generation); LBAs ≡ 2 mod 4: for an ID the host never used.
    let (_f, fhca) = fake(
        10,
        fake_cfg(),
        script(|lba| match lba % 4 {
            1 | 3 => Lie::UnknownCid(None),
            2 => Lie::UnknownCid(Some(0xFFFF)),
            _ => Lie::Honest,
        }),
    )
    .await;
    let c = host_of(11, &fhca, 1).await;
    for lba in 0..40u64 {
        let len = BS * (1 + (lba as usize % 8));
        let got = within(5, "read", c.read(1, lba * 8, len)).await;
        let got = got.unwrap_or_else(|e| panic!("lba {}: {e}", lba * 8));
        assert!(got == truth(lba * 8, len), "data of lba {}", lba * 8);
    }
    // lba*8 % 4 == 0 always: make the lies happen with other LBAs as well.
    for lba in [1u64, 2, 3, 5, 6, 7, 9, 10] {
        let got = within(5, "read", c.read(1, lba, BS)).await.unwrap();
        assert!(got == truth(lba, BS));
    }
    let s = stats_settle(&c, |s| s.completed == 48).await;
    assert_eq!(s.unknown_cid, 8, "{s:?}");
    assert_eq!((s.submitted, s.completed), (48, 48), "{s:?}");
    within(10, "disconnect", c.disconnect()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_and_short_responses_complete_each_request_once() {
    let (_f, fhca) = fake(
        12,
        fake_cfg(),
        script(|lba| match lba % 3 {
            0 => Lie::Duplicate,
            1 => Lie::ShortResponse,
            _ => Lie::Honest,
        }),
    )
    .await;
    let c = host_of(13, &fhca, 1).await;
    for lba in 0..30u64 {
        let got = within(5, "read", c.read(1, lba, 2 * BS)).await.unwrap();
        assert!(got == truth(lba, 2 * BS), "data of lba {lba}");
    }
    let s = stats_settle(&c, |s| s.completed == 30).await;
    // A duplicate that arrives after its request finished names a free slot (counted as
    // unknown); one that beats the SEND completion is counted as a duplicate.
    assert_eq!(s.duplicate_completion + s.unknown_cid, 10, "{s:?}");
    assert_eq!(s.bad_response_len, 10, "{s:?}");
    assert_eq!((s.submitted, s.completed), (30, 30), "{s:?}");
    within(10, "disconnect", c.disconnect()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_completions_do_not_complete_anything() {
    let (_f, fhca) = fake(14, fake_cfg(), script(|_| Lie::Garbage(6))).await;
    let c = host_of(15, &fhca, 1).await;
    let mut hit = 0;
    for lba in 0..20u64 {
        let got = within(5, "read", c.read(1, lba * 3, BS)).await;
        hit += !own_or_nothing(lba * 3, BS, got) as usize;
    }
    assert!(hit <= 1, "{hit} of 20 reads were completed by garbage");
    let s = stats_settle(&c, |s| s.completed == 20).await;
    // 140 completions arrived for 20 reads: every one but the first for each read was
    // ignored, whether garbage or the honest one that came after a garbage hit.
    assert_eq!(s.unknown_cid + s.duplicate_completion, 120, "{s:?}");
    assert_eq!((s.submitted, s.completed), (20, 20), "{s:?}");
    within(10, "disconnect", c.disconnect()).await;
}

/// What a read that a lying target may have disturbed can return: its own data (true), or
/// (false) a typed error or all zeroes — when random garbage happened to carry the ID of a
/// command in flight, which the host cannot tell from a real completion. Never the bytes
/// of some other request.
fn own_or_nothing(lba: u64, len: usize, got: Result<Vec<u8>, HostError>) -> bool {
    match got {
        Ok(d) if d == truth(lba, len) => true,
        Ok(d) if d.len() == len && d.iter().all(|&b| b == 0) => false,
        Ok(_) => panic!("lba {lba}: data that is neither its own nor zeroes"),
        Err(HostError::Nvme(_) | HostError::Protocol(_)) => false,
        Err(e) => panic!("lba {lba}: unexpected error {e:?}"),
    }
}

/// Many concurrent reads of different lengths, answered in batches of 8 in reverse order
/// with stale IDs, duplicates, short responses and garbage mixed in: every read gets
/// exactly the data of its own LBA range (see `own_or_nothing` for garbage).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_reads_under_reordered_lies_get_their_own_data() {
    let mut fc = fake_cfg();
    fc.batch = 8;
    let (f, fhca) = fake(
        16,
        fc,
        script(|lba| match (lba / 16) % 5 {
            0 => Lie::UnknownCid(None),
            1 => Lie::Duplicate,
            2 => Lie::ShortResponse,
            3 => Lie::Garbage(2),
            _ => Lie::Honest,
        }),
    )
    .await;
    let c = Arc::new(host_of(17, &fhca, 1).await);
    let mut hit = 0;
    for round in 0..4u64 {
        let mut tasks = Vec::new();
        for i in 0..16u64 {
            let c = c.clone();
            let lba = (round * 16 + i) * 16;
            let len = BS * (1 + ((i * 5 + round) % 16) as usize);
            tasks.push(tokio::spawn(async move {
                let got = c.read(1, lba, len).await;
                (lba, len, got)
            }));
        }
        for t in tasks {
            let (lba, len, got) = within(10, "concurrent read", t).await.unwrap();
            hit += !own_or_nothing(lba, len, got) as usize;
        }
    }
    assert!(hit <= 2, "{hit} of 64 reads were completed by garbage");
    let s = stats_settle(&c, |s| s.completed == 64).await;
    assert_eq!((s.submitted, s.completed), (64, 64), "{s:?}");
    assert!(f.stats().lies >= 40, "{:?}", f.stats());
    assert!(s.unknown_cid > 0 && s.bad_response_len > 0, "{s:?}");
    let c = Arc::into_inner(c).unwrap();
    within(10, "disconnect", c.disconnect()).await;
}

/// "Success" for a read whose data never came: the caller must not get the bytes of
/// whatever request used the buffer before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn success_without_data_does_not_leak_an_earlier_requests_bytes() {
    let (_f, fhca) = fake(
        18,
        fake_cfg(),
        script(|lba| {
            if lba >= 4000 {
                Lie::SuccessWithoutData
            } else {
                Lie::Honest
            }
        }),
    )
    .await;
    let c = host_of(19, &fhca, 1).await;
    let secret = vec![0x5Eu8; 64 << 10];
    within(5, "write", c.write(1, 1000, &secret)).await.unwrap();
    let earlier = within(5, "read", c.read(1, 200, 64 << 10)).await.unwrap();
    assert!(earlier == truth(200, 64 << 10));
    for len in [BS, 4096, 64 << 10] {
        let got = within(5, "lying read", c.read(1, 4000, len)).await.unwrap();
        assert!(
            got.iter().all(|&b| b == 0),
            "a read the target never wrote returned stale bytes (len {len}, first {:#x})",
            got[0]
        );
    }
    within(10, "disconnect", c.disconnect()).await;
}

/// RDMA WRITEs outside the buffer the command named: inside the command's own slot they
/// change nothing the caller sees; past the region the host registered they are refused by
/// the HCA, which fails that queue's requests with a transport error and nothing else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_outside_the_named_buffer_fail_only_their_queue() {
    for (i, lie) in [(20u8, Lie::WritePastBuffer), (22, Lie::WriteBogusRkey)] {
        let (f, fhca) = fake(
            i,
            fake_cfg(),
            script(move |lba| if lba == 1000 { lie } else { Lie::Honest }),
        )
        .await;
        let c = host_of(i + 1, &fhca, 2).await;
        let max = c.max_transfer();
        // Queue 0: the lie, with a transfer as large as a slot, so past its end is past
        // the registered region.
        let e = within(
            5,
            "lying read",
            c.queue(0).submit(
                admin::read(0, 1, 1000, (max / BS) as u32).unwrap(),
                None,
                max,
            ),
        )
        .await
        .expect_err("the HCA refused the write: the request cannot succeed");
        assert!(matches!(e, HostError::Transport(_)), "{lie:?}: {e:?}");
        // Each refusal broke the connection; the controller recovered every time and the
        // lying command used up its retries (Linux nvme_max_retries) instead of looping.
        c.wait_status(Duration::from_secs(10), |s| {
            s.state() == CtrlState::Live && s.machine.recoveries >= 6
        })
        .await
        .expect("the controller is live again");
        // Queue 0 works again after recovery.
        let r = within(
            5,
            "read on the recovered queue",
            c.queue(0)
                .submit(admin::read(0, 1, 0, 1).unwrap(), None, BS),
        )
        .await
        .expect("queue 0 recovered");
        assert!(r.data == truth(0, BS));
        // Queue 1 is untouched.
        for lba in [0u64, 7, 999] {
            let r = within(
                5,
                "read on the other queue",
                c.queue(1)
                    .submit(admin::read(0, 1, lba, 8).unwrap(), None, 8 * BS),
            )
            .await
            .expect("queue 1 still works");
            assert!(r.data == truth(lba, 8 * BS));
        }
        // The fake target counts its side of each refusal on its own task: the last one may
        // land just after the host has seen its failure.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while f.stats().transport_errors < 6 && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let fs = f.stats();
        assert_eq!(fs.transport_errors, 6, "one per try: {lie:?}: {fs:?}");
        within(10, "disconnect", c.disconnect()).await;
    }

    // A small read with its data aimed just past its length: past its key's reach, so
    // refused too. The reads beside it get their own data, or, where they were out on the
    // broken connection every time, a transport error: never the lie's bytes.
    let (_f, fhca) = fake(
        24,
        fake_cfg(),
        script(|lba| {
            if lba == 1000 {
                Lie::WritePastBuffer
            } else {
                Lie::Honest
            }
        }),
    )
    .await;
    let c = Arc::new(host_of(25, &fhca, 1).await);
    let mut tasks = Vec::new();
    for lba in [1000u64, 10, 20, 30, 40] {
        let c = c.clone();
        tasks.push(tokio::spawn(
            async move { (lba, c.read(1, lba, 4096).await) },
        ));
    }
    for t in tasks {
        let (lba, got) = within(10, "read", t).await.unwrap();
        if lba == 1000 {
            let e = got.expect_err("the HCA refused the write past the transfer");
            assert!(matches!(e, HostError::Transport(_)), "{e:?}");
        } else if let Ok(got) = got {
            assert!(got == truth(lba, 4096), "lba {lba} got foreign data");
        } else if let Err(e) = got {
            assert!(matches!(e, HostError::Transport(_)), "lba {lba}: {e:?}");
        }
    }
    let c = Arc::into_inner(c).unwrap();
    within(10, "disconnect", c.disconnect()).await;
}

/// A command's key reaches its transfer's bytes only, and only the way its data goes: an
/// RDMA READ of 64 KiB on a 1 KiB write (the rest of the slot may hold an earlier command's
/// data) and an RDMA WRITE into a write's data are NAKed by the host's HCA. Each refusal
/// breaks the connection; the lying command fails with a transport error once its retries
/// are used up, nothing of it is stored, and the controller serves the next I/O.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_read_and_a_write_into_a_writes_data_are_refused() {
    for (i, lie) in [(40u8, Lie::ReadPastTransfer), (42, Lie::WriteIntoWriteData)] {
        let (f, fhca) = fake(
            i,
            fake_cfg(),
            script(move |lba| if lba == 1000 { lie } else { Lie::Honest }),
        )
        .await;
        let c = host_of(i + 1, &fhca, 1).await;
        assert!(c.max_transfer() >= fake_target::OVERSIZED_READ);
        // An earlier command's data in the slot the lying write will use.
        let secret = vec![0xA5u8; fake_target::OVERSIZED_READ];
        within(5, "large write", c.write(1, 0, &secret))
            .await
            .unwrap();
        let data: Vec<u8> = (0..1024u32).map(|i| (i * 13 + 5) as u8).collect();
        let e = within(10, "lying write", c.write(1, 1000, &data))
            .await
            .expect_err("the HCA refused the target's access: the write cannot succeed");
        assert!(matches!(e, HostError::Transport(_)), "{lie:?}: {e:?}");
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while f.stats().transport_errors == 0 && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(f.stats().transport_errors >= 1, "{lie:?}: {:?}", f.stats());
        c.wait_status(Duration::from_secs(10), |s| s.state() == CtrlState::Live)
            .await
            .expect("the controller is live again");
        let back = within(5, "read back", c.read(1, 1000, 1024)).await.unwrap();
        assert!(
            back == truth(1000, 1024),
            "{lie:?}: the lying write was stored"
        );
        within(5, "write after", c.write(1, 2000, &data))
            .await
            .expect("the next write goes through");
        within(10, "disconnect", c.disconnect()).await;
    }
}

/// A target that never answers one command: the caller gives up on it with its own
/// timeout, the other requests are unaffected, and disconnect still completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_never_answered_does_not_block_others_or_disconnect() {
    let (_f, fhca) = fake(
        26,
        fake_cfg(),
        script(|lba| if lba == 77 { Lie::Silence } else { Lie::Honest }),
    )
    .await;
    let c = host_of(27, &fhca, 1).await;
    let r = tokio::time::timeout(Duration::from_millis(300), c.read(1, 77, BS)).await;
    assert!(r.is_err(), "no answer, so no completion");
    for lba in 0..10u64 {
        let got = within(5, "read", c.read(1, lba, BS)).await.unwrap();
        assert!(got == truth(lba, BS));
    }
    let s = stats_settle(&c, |s| s.completed == 10).await;
    assert_eq!((s.submitted, s.completed), (11, 10), "{s:?}");
    within(5, "disconnect with a command outstanding", c.disconnect()).await;
}

/// A command the target never answers times out after `io_timeout`: the host takes the
/// connection for stuck and recovers (reconnects and sends the command again), and once the
/// command has timed out more than `max_retries` times it fails with a timeout error instead
/// of hanging. Reads before and after are unaffected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_never_answered_times_out_and_fails_after_its_retries() {
    let (_f, fhca) = fake(
        28,
        fake_cfg(),
        script(|lba| if lba == 77 { Lie::Silence } else { Lie::Honest }),
    )
    .await;
    let (hca, cm) = device("host", 29).await;
    let mut o = host_opts(fhca.addr(), HOST_OK, 1, 16);
    o.io_timeout = Duration::from_millis(300);
    o.max_retries = 1;
    let c = within(20, "connect to the fake", Controller::connect(hca, cm, o))
        .await
        .unwrap();
    assert!(within(5, "read", c.read(1, 3, BS)).await.unwrap() == truth(3, BS));
    let r = within(20, "a read nobody answers", c.read(1, 77, BS)).await;
    assert!(matches!(r, Err(HostError::Timeout(_))), "{r:?}");
    let s = c.queue(0).stats();
    assert!(
        s.timeouts >= 2,
        "timed out once, retried on a new connection, timed out again: {s:?}"
    );
    for lba in 0..10u64 {
        let got = within(10, "read after the timeouts", c.read(1, lba, BS))
            .await
            .unwrap();
        assert!(got == truth(lba, BS), "lba {lba}");
    }
    within(5, "disconnect", c.disconnect()).await;
}

/// Per-command keys: a target that RDMA WRITEs into a command's buffer
/// after the host completed the command is refused by the host's HCA: the key that
/// command named was invalidated at completion (here by the host itself: the fake never
/// sends with invalidate). The refusal fails the connection, recovery sends the next
/// command again, and nothing is lost. Before per-command keys the late write landed in
/// the slot, now holding the next command's data, and the fake stored the junk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_rdma_write_after_completion_is_refused_and_loses_nothing() {
    let (f, fhca) = fake(
        30,
        fake_cfg(),
        script(|lba| {
            if lba == 1000 {
                Lie::LateWrite
            } else {
                Lie::Honest
            }
        }),
    )
    .await;
    let c = host_of(31, &fhca, 1).await;
    let got = within(5, "read", c.read(1, 1000, 4096)).await.unwrap();
    assert!(got == truth(1000, 4096));
    // 8 KiB does not fit the fake's 4 KiB of in-capsule data: a keyed write, whose data
    // the fake fetches from the very slot the read used, after its late write.
    let data: Vec<u8> = (0..8192u32).map(|i| (i * 7 + 3) as u8).collect();
    within(10, "write after the late write", c.write(1, 2000, &data))
        .await
        .expect("the write survives the late write");
    let back = within(5, "read back", c.read(1, 2000, 8192)).await.unwrap();
    assert!(
        back == data,
        "the late write reached the next command's data"
    );
    let fs = f.stats();
    assert_eq!(
        fs.transport_errors, 1,
        "the host refused the late write: {fs:?}"
    );
    let st = c.status();
    assert!(st.machine.recoveries >= 1, "the refusal was recovered from");
    let qs = io_stats(&c);
    assert!(qs.local_invalidations >= 3, "{qs:?}");
    assert_eq!(qs.remote_invalidations, 0, "{qs:?}");
    within(10, "disconnect", c.disconnect()).await;
}

/// Against the built-in target every keyed command's key is invalidated by the target's
/// SEND with Invalidate, so the host never has to invalidate one itself; in-capsule writes
/// hand out no remote key at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_target_invalidates_each_keyed_commands_key_with_its_response() {
    let (_t, thca) = builtin_target(32).await;
    let (hca, cm) = device("host", 33).await;
    let c = within(
        20,
        "connect",
        Controller::connect(hca, cm, host_opts(thca.addr(), HOST_OK, 1, 16)),
    )
    .await
    .unwrap();
    let small = vec![0x5Au8; 4096];
    let big: Vec<u8> = (0..65536u32).map(|i| (i ^ (i >> 8)) as u8).collect();
    within(5, "in-capsule write", c.write(1, 0, &small))
        .await
        .unwrap();
    within(5, "keyed write", c.write(1, 100, &big))
        .await
        .unwrap();
    assert!(within(5, "read", c.read(1, 0, 4096)).await.unwrap() == small);
    assert!(within(5, "read", c.read(1, 100, 65536)).await.unwrap() == big);
    let qs = io_stats(&c);
    // The small write, and the I/O queue's Fabrics Connect.
    assert_eq!(qs.in_capsule, 2, "{qs:?}");
    assert_eq!(qs.remote_invalidations, 3, "{qs:?}");
    assert_eq!(
        (qs.local_invalidations, qs.bogus_invalidations),
        (0, 0),
        "{qs:?}"
    );
    within(10, "disconnect", c.disconnect()).await;
}

//! The target's late-writes fault against what it promises a host: a dead controller's
//! held write lands late when nothing stops it (the ghost write a host that resends at
//! once meets), never after a Cross-Controller Reset reported success, and never past CQT.

use std::sync::Arc;
use std::time::{Duration, Instant};

use nvmf_rdma::driver::{CmService, SoftHca};
use nvmf_rdma::nvme::ccr::{cross_ctrl_reset, CcrResult};
use nvmf_rdma::nvme::Nqn;
use nvmf_rdma::nvmet::{serve_cm, Namespace, Subsystem, Target, TargetConfig};
use nvmf_rdma::transport::{ConnectOptions, Controller};

use crate::rig::within;

const NQN: &str = "nqn.2026-11.io.nvmf-rdma:late";
const OLD: u8 = 0xAA;
const NEW: u8 = 0x55;

struct Rig {
    t: Target<SoftHca>,
    thca: SoftHca,
    ns: Arc<Namespace>,
}

/// A target with the late-writes fault at `late_ms` and CQT `cqt_ms`.
async fn rig(late_ms: u32, cqt_ms: u16) -> Rig {
    let thca = SoftHca::start(crate::rig::device(40, "tgt", 1))
        .await
        .unwrap();
    let ns = Arc::new(Namespace::ram(1, 1 << 20, 9));
    let tc = TargetConfig {
        subsystems: vec![Subsystem::new(Nqn::new(NQN).unwrap(), vec![ns.clone()])],
        cqt_ms,
        late_writes_ms: Some(late_ms),
        ..TargetConfig::default()
    };
    let t = Target::start(thca.clone(), tc).unwrap();
    serve_cm(t.clone(), CmService::for_device(&thca)).unwrap();
    Rig { t, thca, ns }
}

/// Host `i` connected to the rig's target.
async fn host(r: &Rig, i: u8) -> Controller {
    let hca = SoftHca::start(crate::rig::device(40, "host", 1 + i))
        .await
        .unwrap();
    let cm = CmService::for_device(&hca);
    let mut o = ConnectOptions::new(r.thca.addr(), NQN);
    o.nr_io_queues = 1;
    o.queue_size = 32;
    within(20, "connect", Controller::connect(hca, cm, o))
        .await
        .unwrap()
}

/// Block 0 as the namespace holds it (its first byte).
fn block0(ns: &Namespace) -> u8 {
    let mut b = [0u8; 512];
    ns.read(0, &mut b).unwrap();
    b[0]
}

/// Wait for `cond` with a deadline.
async fn until(secs: u64, what: &str, cond: impl Fn() -> bool) {
    within(secs, what, async {
        while !cond() {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await
}

/// Host 1 writes OLD to block 0, then NEW while the backend stalls; its controller dies
/// with NEW held. Returns the host (its recovery may reconnect; the stall holds whatever it
/// resends) and the instant of the death.
async fn die_with_a_write_held(r: &Rig) -> (Arc<Controller>, Instant) {
    let c = Arc::new(host(r, 1).await);
    c.write(1, 0, &[OLD; 512]).await.unwrap();
    assert_eq!(block0(&r.ns), OLD);
    r.t.stall_io(true);
    let w = c.clone();
    tokio::spawn(async move { w.write(1, 0, &[NEW; 512]).await });
    until(10, "the write reaches the target", || r.t.stalled_io() == 1).await;
    assert!(r.t.lose_controller(c.ident.cntlid));
    let died = Instant::now();
    assert_eq!(
        r.t.late_writes_held(),
        1,
        "the dead controller's write is held"
    );
    (c, died)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_controllers_write_lands_late_when_nothing_stops_it() {
    let r = rig(300, 5000).await;
    let (_c, died) = die_with_a_write_held(&r).await;
    assert_eq!(block0(&r.ns), OLD, "not before its delay");
    until(5, "the late write lands", || block0(&r.ns) == NEW).await;
    let after = died.elapsed();
    assert!(
        after >= Duration::from_millis(300),
        "landed after {after:?}"
    );
    assert_eq!(r.t.stats().late_writes_run, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_write_is_dropped_when_cqt_runs_out_first() {
    let r = rig(60_000, 300).await;
    let (_c, died) = die_with_a_write_held(&r).await;
    until(5, "CQT runs out", || r.t.late_writes_held() == 0).await;
    let after = died.elapsed();
    assert!(
        after >= Duration::from_millis(300),
        "dropped after {after:?}"
    );
    assert!(after < Duration::from_secs(5), "dropped after {after:?}");
    assert_eq!(block0(&r.ns), OLD, "nothing of the dead controller ran");
    assert_eq!(r.t.stats().late_writes_dropped, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_write_never_lands_after_a_ccr_reported_success() {
    let r = rig(60_000, 60_000).await;
    let (c, _) = die_with_a_write_held(&r).await;
    let impacted = c.ident.instance();
    // A new controller of the same host and subsystem resets the dead one.
    let src = host(&r, 2).await;
    let rsp = within(
        10,
        "CCR",
        src.admin_queue()
            .submit(cross_ctrl_reset(0, impacted), None, 0),
    )
    .await
    .unwrap();
    let res = CcrResult::from_dw0(rsp.cqe.result as u32);
    assert!(res.immediate, "nothing of it can still run: {res:?}");
    // Once the success is reported nothing of the dead controller is left to run.
    assert_eq!(r.t.late_writes_held(), 0);
    assert_eq!(block0(&r.ns), OLD);
    assert_eq!(r.t.stats().late_writes_dropped, 1);
    assert_eq!(r.t.stats().late_writes_run, 0);
}

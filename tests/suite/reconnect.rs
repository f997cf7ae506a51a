//! The one recovery path, end to end on loopback: a host whose soft-HCA is reset,
//! hot-removed and re-plugged (same or other identity) under verified I/O, a target that
//! restarts or hangs, and the policy's timers honoured.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use nvmf_rdma::driver::DeviceManager;
use nvmf_rdma::harness::chaos::{
    connect_host, host_identity, host_options, TargetRig, Verifiers, WorkerReport, HOST_DEV,
};
use nvmf_rdma::harness::nvmf_perf::connect_host_with_faults;
use nvmf_rdma::reconnect::{Cause, CtrlState, FailReason, IdentityMatch, Policy};
use nvmf_rdma::transport::{Controller, HostError};

const IP: [u8; 4] = [127, 0, 0, 1];
const NS_BYTES: u64 = 16 << 20;

fn policy() -> Policy {
    crate::rig::reconnect_at_once(Some(Duration::from_secs(30)), Duration::from_secs(30))
}

async fn rig(p: Policy, queues: usize) -> (DeviceManager, TargetRig, Arc<Controller>) {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let t = TargetRig::start(IP, NS_BYTES).await.unwrap();
    let mgr = DeviceManager::new(true);
    let c = connect_host(&mgr, IP, host_options(t.addr, queues, 32, p))
        .await
        .unwrap();
    (mgr, t, Arc::new(c))
}

fn spawn_workers(
    c: &Arc<Controller>,
    n: u64,
    stop: &Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<WorkerReport>> {
    Verifiers {
        workers: n,
        blocks: 2048,
        max_blocks: 64,
        hang_after: Duration::from_secs(40),
    }
    .spawn(c, stop, |w| (w + 1, None))
}

async fn join(ws: Vec<tokio::task::JoinHandle<WorkerReport>>) -> WorkerReport {
    let mut all = WorkerReport::default();
    for w in ws {
        all.absorb(w.await.unwrap());
    }
    all
}

async fn live(c: &Controller) {
    c.wait_status(Duration::from_secs(20), |s| s.state() == CtrlState::Live)
        .await
        .expect("controller live");
}

async fn recovered(c: &Controller, n: u64) {
    c.wait_status(Duration::from_secs(20), |s| {
        s.state() == CtrlState::Live && s.machine.recoveries >= n
    })
    .await
    .expect("controller recovered");
}

/// Some I/O completes: the workers are making progress.
async fn progress(c: &Controller) {
    let before: u64 = c.queue_stats().iter().map(|s| s.completed).sum();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let now: u64 = c.queue_stats().iter().map(|s| s.completed).sum();
        if now >= before + 20 {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "no I/O progress");
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resets_mid_io_lose_nothing_acknowledged() {
    let (mgr, _t, c) = rig(policy(), 2).await;
    let stop = Arc::new(AtomicBool::new(false));
    let ws = spawn_workers(&c, 4, &stop);
    for i in 1..=5 {
        progress(&c).await;
        mgr.reset(HOST_DEV, Duration::ZERO).await.unwrap();
        recovered(&c, i).await;
    }
    progress(&c).await;
    stop.store(true, Ordering::Relaxed);
    let r = join(ws).await;
    assert_eq!(r.mismatches, 0, "{r:?}");
    assert_eq!(r.hangs, 0);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert!(r.writes > 50 && r.reads > 50, "{r:?}");
    let requeued: u64 = c.queue_stats().iter().map(|s| s.requeued).sum();
    assert!(requeued > 0, "resets hit in-flight I/O");
    let st = c.status();
    assert_eq!(st.machine.recoveries, 5);
    assert_eq!(st.machine.cause, Some(Cause::DeviceFatal));
    for s in c.queue_stats() {
        assert_eq!((s.unknown_cid, s.duplicate_completion), (0, 0), "{s:?}");
    }
}

/// Whoever builds a controller on a fault injector keeps its handle, and a reset through it
/// reaches the device under the controller: recovered like any device fault, nothing lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resets_through_a_fault_injector_are_recovered() {
    let t = TargetRig::start(IP, NS_BYTES).await.unwrap();
    let (c, faults) = connect_host_with_faults(host_options(t.addr, 1, 32, policy()))
        .await
        .unwrap();
    let c = Arc::new(c);
    let stop = Arc::new(AtomicBool::new(false));
    let ws = spawn_workers(&c, 2, &stop);
    for i in 1..=2 {
        progress(&c).await;
        faults.reset(Duration::ZERO).await.unwrap();
        recovered(&c, i).await;
    }
    stop.store(true, Ordering::Relaxed);
    let r = join(ws).await;
    assert_eq!((r.mismatches, r.hangs), (0, 0), "{r:?}");
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    let st = c.status();
    assert_eq!(st.machine.recoveries, 2);
    assert_eq!(st.machine.cause, Some(Cause::DeviceFatal));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unplug_and_replug_of_the_same_card_reconnects() {
    let (mgr, _t, c) = rig(policy(), 1).await;
    let data = vec![0xA5u8; 64 << 10];
    c.write(1, 100, &data).await.unwrap();
    mgr.unplug(HOST_DEV).await.unwrap();
    c.wait_status(Duration::from_secs(5), |s| {
        s.state() == CtrlState::Connecting && !s.machine.device_present
    })
    .await
    .unwrap();
    // I/O issued while the card is out is held, then completes.
    let c2 = c.clone();
    let pending = tokio::spawn(async move { c2.read(1, 100, 64 << 10).await });
    let w = {
        let c = c.clone();
        let d = vec![0x3Cu8; 4096];
        tokio::spawn(async move { c.write(1, 500, &d).await })
    };
    mgr.replug(host_identity(0)).await.unwrap();
    recovered(&c, 1).await;
    assert!(pending.await.unwrap().unwrap() == data);
    w.await.unwrap().unwrap();
    assert!(c.read(1, 500, 4096).await.unwrap() == vec![0x3Cu8; 4096]);
    assert_eq!(c.status().machine.cause, Some(Cause::DeviceRemoved));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_card_in_the_slot_is_not_ours_and_io_fails_at_ctrl_loss_tmo() {
    let p = Policy {
        ctrl_loss_tmo: Some(Duration::from_secs(2)),
        ..policy()
    };
    let (mgr, _t, c) = rig(p, 1).await;
    mgr.unplug(HOST_DEV).await.unwrap();
    mgr.replug(host_identity(1)).await.unwrap(); // other GUID and PCI address
    let t0 = tokio::time::Instant::now();
    let e = c.read(1, 0, 4096).await.expect_err("no path");
    let waited = t0.elapsed();
    assert!(matches!(e, HostError::Path(FailReason::CtrlLoss)), "{e:?}");
    assert!(
        waited >= Duration::from_millis(1900) && waited < Duration::from_secs(4),
        "{waited:?}"
    );
    let st = c.status();
    assert_eq!(st.state(), CtrlState::Dead);
    assert!(st.machine.foreign_device);
    assert_eq!(
        st.machine.attempt, 0,
        "never connected through the imposter"
    );
    // After deletion everything fails at once.
    assert!(matches!(
        c.write(1, 0, &[0u8; 512]).await,
        Err(HostError::Path(FailReason::CtrlLoss))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_card_is_accepted_when_the_policy_allows_any() {
    let p = Policy {
        identity: IdentityMatch::Any,
        ..policy()
    };
    let (mgr, _t, c) = rig(p, 1).await;
    c.write(1, 7, &[7u8; 512]).await.unwrap();
    mgr.unplug(HOST_DEV).await.unwrap();
    mgr.replug(host_identity(1)).await.unwrap();
    recovered(&c, 1).await;
    assert!(c.read(1, 7, 512).await.unwrap() == vec![7u8; 512]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_that_never_returns_fails_fast_then_is_lost() {
    let p = Policy {
        ctrl_loss_tmo: Some(Duration::from_secs(3)),
        fast_io_fail_tmo: Some(Duration::from_secs(1)),
        ..policy()
    };
    let (mgr, _t, c) = rig(p, 1).await;
    mgr.unplug(HOST_DEV).await.unwrap();
    let t0 = tokio::time::Instant::now();
    let e = c.read(1, 0, 4096).await.expect_err("held, then failed");
    let at = t0.elapsed();
    assert!(
        matches!(e, HostError::Path(FailReason::FastIoFail)),
        "{e:?}"
    );
    assert!(
        at >= Duration::from_millis(900) && at < Duration::from_secs(2),
        "{at:?}"
    );
    // Past fast_io_fail_tmo new I/O fails at once, and the controller is still trying.
    let t1 = tokio::time::Instant::now();
    assert!(matches!(
        c.read(1, 0, 4096).await,
        Err(HostError::Path(FailReason::FastIoFail))
    ));
    assert!(t1.elapsed() < Duration::from_millis(100));
    assert_eq!(c.state(), CtrlState::Connecting);
    let st = c
        .wait_status(Duration::from_secs(5), |s| s.state() == CtrlState::Dead)
        .await
        .unwrap();
    assert_eq!(st.machine.fail_reason, Some(FailReason::CtrlLoss));
    let lost_at = t0.elapsed();
    assert!(
        lost_at >= Duration::from_millis(2900) && lost_at < Duration::from_secs(4),
        "{lost_at:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_restart_is_survived_with_its_data() {
    let (mgr, mut t, c) = rig(policy(), 2).await;
    let _ = &mgr;
    let before = vec![0x42u8; 128 << 10];
    c.write(1, 10_000, &before).await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let ws = spawn_workers(&c, 2, &stop);
    progress(&c).await;
    t.restart().await.unwrap();
    recovered(&c, 1).await;
    progress(&c).await;
    stop.store(true, Ordering::Relaxed);
    let r = join(ws).await;
    assert_eq!((r.mismatches, r.hangs), (0, 0), "{r:?}");
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert!(
        c.read(1, 10_000, 128 << 10).await.unwrap() == before,
        "data written before the restart"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_alive_loss_recovers_once_the_target_answers_again() {
    let p = Policy {
        keep_alive_tmo: Duration::from_secs(1),
        ..policy()
    };
    let (_mgr, t, c) = rig(p, 1).await;
    c.write(1, 0, &[1u8; 4096]).await.unwrap();
    t.target.freeze(true);
    let st = c
        .wait_status(Duration::from_secs(5), |s| s.state() != CtrlState::Live)
        .await
        .unwrap();
    // The host misses its keep-alive; the frozen target, hearing nothing, also expires the
    // controller after KATO (as nvmet does) and may drop the connection first. Either way
    // the same recovery path runs.
    assert!(
        matches!(
            st.machine.cause,
            Some(Cause::KeepAliveLost | Cause::CmDisconnect)
        ),
        "{st:?}"
    );
    // Held while the target hangs.
    let c2 = c.clone();
    let read = tokio::spawn(async move { c2.read(1, 0, 4096).await });
    c.wait_status(Duration::from_secs(10), |s| s.machine.attempt >= 1)
        .await
        .unwrap();
    t.target.freeze(false);
    recovered(&c, 1).await;
    assert!(read.await.unwrap().unwrap() == vec![1u8; 4096]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_storm_is_survived_without_leaks() {
    let (mgr, t, c) = rig(policy(), 2).await;
    let counts = |h: &nvmf_rdma::driver::SoftHca| h.with_quiet(|d, _| d.object_counts());
    let first = counts(&c.device().expect("a soft-HCA controller"));
    let stop = Arc::new(AtomicBool::new(false));
    let ws = spawn_workers(&c, 4, &stop);
    // Back to back, without waiting for LIVE in between.
    for _ in 0..30 {
        mgr.reset(HOST_DEV, Duration::ZERO).await.unwrap();
    }
    live(&c).await;
    progress(&c).await;
    stop.store(true, Ordering::Relaxed);
    let r = join(ws).await;
    assert_eq!((r.mismatches, r.hangs), (0, 0), "{r:?}");
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    let st = c.status();
    assert!(
        st.machine.recoveries >= 1 && st.machine.recoveries <= 30,
        "{st:?}"
    );
    // Every recovery made one clean set of verbs objects on the new context.
    assert_eq!(counts(&c.device().expect("a soft-HCA controller")), first);
    // The target tore down the controllers of the dead contexts (keep-alive expiry) and
    // keeps only ours: admin + 2 I/O queues.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while t.target.queue_count() != 3 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "target queues: {}",
            t.target.queue_count()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_during_a_reconnect_attempt_does_not_wait_out_the_connect_timeout() {
    // A connect timeout far longer than the test may wait: an attempt that sat on a dead
    // device's CM request until its timeout would fail this test.
    let t = TargetRig::start(IP, NS_BYTES).await.unwrap();
    let mgr = DeviceManager::new(true);
    let mut o = host_options(t.addr, 2, 32, policy());
    o.connect_timeout = Duration::from_secs(60);
    let c = Arc::new(connect_host(&mgr, IP, o).await.unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let ws = spawn_workers(&c, 2, &stop);
    let mut hits = 0;
    for i in 0..20u64 {
        progress(&c).await;
        let before = c.status().machine.recoveries;
        mgr.reset(HOST_DEV, Duration::ZERO).await.unwrap();
        // Reset again while the controller is reconnecting, if we catch it there.
        let s = c
            .wait_status(Duration::from_secs(20), |s| {
                s.state() == CtrlState::Connecting
                    || (s.state() == CtrlState::Live && s.machine.recoveries > before)
            })
            .await
            .unwrap();
        if s.state() == CtrlState::Connecting {
            hits += 1;
            // At different points of the attempt: device open, CM request out, queues.
            tokio::time::sleep(Duration::from_micros(500 * (i % 5))).await;
            mgr.reset(HOST_DEV, Duration::ZERO).await.unwrap();
        }
        recovered(&c, before + 1).await;
        if hits >= 5 {
            break;
        }
    }
    assert!(hits > 0, "never caught the controller reconnecting");
    progress(&c).await;
    stop.store(true, Ordering::Relaxed);
    let r = join(ws).await;
    assert_eq!((r.mismatches, r.hangs), (0, 0), "{r:?}");
    assert!(r.errors.is_empty(), "{:?}", r.errors);
}

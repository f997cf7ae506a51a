//! Native multipath on loopback with the real driver: two host soft-HCAs, each with a path to
//! one subsystem served on two ports (two built-in targets with the same subsystem NQN and
//! the same namespace), I/O verified against a model while one path's HCA is reset; the
//! policies spreading I/O over the paths; a path whose namespace is another one refused.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::fake_target::{FakeConfig, FakeTarget, Lie, Script};
use nvmf_rdma::driver::{CmService, DeviceManager, SoftHca};
use nvmf_rdma::export::BlockDev;
use nvmf_rdma::multipath::{IoPolicy, JoinError, MpNamespace, Path, Subsystem};
use nvmf_rdma::nvme::admin::opcode;
use nvmf_rdma::nvme::{ana, Nqn};
use nvmf_rdma::nvmet::{serve_cm_on, Namespace, Target};
use nvmf_rdma::reconnect::{CtrlState, FailReason};
use nvmf_rdma::transport::{ConnectOptions, Controller, HostError};
use nvmf_rdma::verbs::{DeviceFaults, FaultInjector};

const NQN: &str = "nqn.2026-11.io.nvmf-rdma:multipath";
const NS_BYTES: u64 = 8 << 20;
const FILE: u8 = 44;

/// One port of the subsystem: a target on a soft-HCA of its own serving `ns`.
async fn port(i: u8, ns: Arc<Namespace>) -> (Target<SoftHca>, SoftHca) {
    crate::rig::serve(crate::rig::device(FILE, "tgt", i), NQN, vec![ns]).await
}

/// A path: a host soft-HCA of its own (behind a fault injector) connected to `target`.
async fn path(i: u8, target: SocketAddr) -> (Arc<Controller>, DeviceFaults) {
    let name = format!("host{i}");
    let mgr = DeviceManager::new(true);
    mgr.plug(crate::rig::device(FILE, &name, 10 + i))
        .await
        .unwrap();
    let src = FaultInjector::new(mgr);
    let mut o = ConnectOptions::new(target, NQN);
    o.nr_io_queues = 2;
    o.queue_size = 32;
    o.connect_timeout = Duration::from_secs(2);
    o.policy =
        crate::rig::reconnect_at_once(Some(Duration::from_secs(30)), Duration::from_secs(30));
    let c = crate::rig::within(
        20,
        "connect",
        Controller::connect_managed(src.clone(), &name, o),
    )
    .await
    .unwrap();
    (Arc::new(c), src.device(&name))
}

struct Rig {
    sub: Arc<Subsystem>,
    faults: Vec<DeviceFaults>,
    _ports: Vec<(Target<SoftHca>, SoftHca)>,
}

/// Two ports of one subsystem, a path to each.
async fn rig(policy: IoPolicy) -> Rig {
    let ns = Arc::new(Namespace::ram(1, NS_BYTES, 9));
    let ports = vec![port(1, ns.clone()).await, port(2, ns).await];
    let sub = Subsystem::new(NQN, policy);
    let mut faults = Vec::new();
    for (i, (_, hca)) in ports.iter().enumerate() {
        let (c, f) = path(i as u8, hca.addr()).await;
        sub.add_path(c, hca.addr().to_string(), f.name().to_string())
            .await
            .unwrap();
        faults.push(f);
    }
    Rig {
        sub,
        faults,
        _ports: ports,
    }
}

#[derive(Debug, Default)]
struct Report {
    ios: u64,
    errors: Vec<String>,
    mismatches: u64,
}

/// Verified random I/O on blocks `first..first + blocks` until `stop`: writes remembered,
/// reads checked against what was written.
async fn worker(
    dev: Arc<BlockDev>,
    first: u64,
    blocks: u64,
    seed: u64,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Report {
    let mut rng = SmallRng::seed_from_u64(seed);
    let bs = dev.block_size() as u64;
    let mut model = vec![0u8; (blocks * bs) as usize];
    let mut r = Report::default();
    dev.write_at(first * bs, &model, false).await.unwrap();
    while !*stop.borrow() {
        let nb = rng.random_range(1..=16u64);
        let off = rng.random_range(0..=blocks - nb);
        let range = (off * bs) as usize..((off + nb) * bs) as usize;
        let at = (first + off) * bs;
        let io = async {
            if rng.random_bool(0.5) {
                let mut data = vec![0u8; range.len()];
                rng.fill(&mut data[..]);
                dev.write_at(at, &data, false).await?;
                model[range.clone()].copy_from_slice(&data);
            } else {
                let got = dev.read_at(at, range.len()).await?;
                if got[..] != model[range.clone()] {
                    r.mismatches += 1;
                }
            }
            Ok::<_, nvmf_rdma::export::ExportError>(())
        };
        match tokio::time::timeout(Duration::from_secs(20), io).await {
            Ok(Ok(())) => r.ios += 1,
            Ok(Err(e)) => r.errors.push(e.to_string()),
            Err(_) => r.errors.push("an I/O hung".into()),
        }
    }
    r
}

/// The workers' reports, summed.
async fn joined(ws: Vec<tokio::task::JoinHandle<Report>>) -> Report {
    let mut all = Report::default();
    for w in ws {
        let r = w.await.unwrap();
        all.ios += r.ios;
        all.mismatches += r.mismatches;
        all.errors.extend(r.errors);
    }
    all
}

fn ios(sub: &Subsystem) -> Vec<u64> {
    sub.paths().iter().map(|p| p.stats().ios).collect()
}

/// Wait until `f` holds, at most 20 s.
async fn until(what: &str, f: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !f() {
        assert!(tokio::time::Instant::now() < deadline, "{what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Path A's HCA is reset (down for 400 ms) three times under verified I/O from eight
/// workers: I/O goes on through path B while A is down, every I/O succeeds and every read
/// matches what was written; reads in flight on A moved to B.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn io_flows_on_path_b_while_path_a_hca_is_reset_with_no_error() {
    let rig = rig(IoPolicy::RoundRobin).await;
    let dev = Arc::new(BlockDev::on(Arc::new(rig.sub.namespace(1).unwrap())));
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let ws: Vec<_> = (0..8u64)
        .map(|w| tokio::spawn(worker(dev.clone(), w * 256, 256, 40 + w, stop.clone())))
        .collect();
    let paths = rig.sub.paths();
    let (a, b) = (&paths[0], &paths[1]);
    for round in 1..=3u64 {
        let before = ios(&rig.sub);
        until("both paths carry I/O", || {
            let now = ios(&rig.sub);
            now[0] > before[0] + 20 && now[1] > before[1] + 20
        })
        .await;
        let reset = reset_in_background(&rig.faults[0], Duration::from_millis(400));
        until("path A down", || a.ctrl.state() != CtrlState::Live).await;
        let b_at_fault = b.stats().ios;
        // While A is down, B carries the I/O.
        until("I/O on path B during A's outage", || {
            b.stats().ios > b_at_fault + 50
        })
        .await;
        assert_ne!(
            a.ctrl.state(),
            CtrlState::Live,
            "the outage outlasted the I/O"
        );
        reset.await.unwrap().unwrap();
        until("path A back", || {
            a.ctrl.state() == CtrlState::Live && a.stats().reconnects >= round
        })
        .await;
    }
    stop_tx.send(true).unwrap();
    let all = joined(ws).await;
    assert!(all.errors.is_empty(), "{:?}", all.errors);
    assert_eq!(all.mismatches, 0);
    assert!(all.ios > 300, "{all:?}");
    assert_eq!(a.stats().reconnects, 3);
    eprintln!("path A {:?}, path B {:?}", a.stats(), b.stats());
    assert_eq!(rig.sub.held(), 0);
}

type TwoPorts = (Arc<Subsystem>, Vec<DeviceFaults>, Target<SoftHca>, u16);

/// One target serving the subsystem on two ports (so a controller through one port can
/// reset the other's: Cross-Controller Reset), a path to each.
/// Returns the second port's ID with the rest.
async fn one_target_two_ports(first: u8, policy: IoPolicy) -> TwoPorts {
    let ns = Arc::new(Namespace::ram(1, NS_BYTES, 9));
    let (target, hca_a) = port(first, ns).await;
    let hca_b = SoftHca::start(crate::rig::device(FILE, "tgt", first + 1))
        .await
        .unwrap();
    let p = target.add_port(hca_b.clone(), Some(hca_b.addr())).unwrap();
    serve_cm_on(target.clone(), p, CmService::for_device(&hca_b)).unwrap();
    let sub = Subsystem::new(NQN, policy);
    let mut faults = Vec::new();
    for (i, hca) in [hca_a, hca_b].iter().enumerate() {
        let (c, f) = path(first + i as u8, hca.addr()).await;
        sub.add_path(c, hca.addr().to_string(), f.name().to_string())
            .await
            .unwrap();
        faults.push(f);
    }
    (sub, faults, target, p)
}

/// Eight writers, each rewriting a block of its own with a counter until told to stop:
/// how many writes each had acknowledged, and at the end each block with its last value.
struct Writers {
    done: Arc<Vec<AtomicU64>>,
    stop: tokio::sync::watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<Result<(u64, u8), String>>>,
}

impl Writers {
    fn start(ns: &Arc<MpNamespace>) -> Writers {
        let done: Arc<Vec<AtomicU64>> = Arc::new((0..8).map(|_| AtomicU64::new(0)).collect());
        let (stop, rx) = tokio::sync::watch::channel(false);
        let tasks = (0..8u64)
            .map(|w| {
                let (ns, done, rx) = (ns.clone(), done.clone(), rx.clone());
                tokio::spawn(async move {
                    let mut last = 0u8;
                    while !*rx.borrow() {
                        let v = last.wrapping_add(1);
                        ns.write(w * 8, &[v; 4096])
                            .await
                            .map_err(|e| e.to_string())?;
                        last = v;
                        done[w as usize].fetch_add(1, Ordering::Relaxed);
                    }
                    Ok::<_, String>((w, last))
                })
            })
            .collect();
        Writers { done, stop, tasks }
    }

    fn counts(&self) -> Vec<u64> {
        self.done
            .iter()
            .map(|d| d.load(Ordering::Relaxed))
            .collect()
    }

    /// Wait until every writer has had two more writes acknowledged than at `then`.
    async fn past(&self, then: &[u64]) {
        until("every writer past its write in flight", || {
            self.counts().iter().zip(then).all(|(d, f)| *d >= f + 2)
        })
        .await;
    }

    /// Stop them; each block reads back its writer's last acknowledged value.
    async fn check(self, ns: &MpNamespace) {
        self.stop.send(true).unwrap();
        for t in self.tasks {
            let (blk, last) = t.await.unwrap().unwrap();
            assert_eq!(ns.read(blk * 8, 4096).await.unwrap(), vec![last; 4096]);
        }
    }
}

/// One target serving the subsystem on two ports, a failover-policy path to each, and
/// [`Writers`] whose writes all go to the first, A.
struct OnPathA {
    sub: Arc<Subsystem>,
    faults: Vec<DeviceFaults>,
    target: Target<SoftHca>,
    port_a: u16,
    port_b: u16,
    ns: Arc<MpNamespace>,
    writers: Writers,
    a: Arc<Path>,
    b: Arc<Path>,
}

async fn writers_on_path_a(first: u8) -> OnPathA {
    let (sub, faults, target, port_b) = one_target_two_ports(first, IoPolicy::Failover).await;
    let ns = Arc::new(sub.namespace(1).unwrap());
    let writers = Writers::start(&ns);
    let paths = sub.paths();
    let (a, b) = (paths[0].clone(), paths[1].clone());
    until("writes on path A", || a.stats().ios > 200).await;
    assert_eq!(b.stats().ios, 0, "the failover policy used path B");
    let port_a = target.ports()[0].id;
    OnPathA {
        sub,
        faults,
        target,
        port_a,
        port_b,
        ns,
        writers,
        a,
        b,
    }
}

/// Hold the writers' next writes on path A unanswered: port `port_a` of the target stops
/// answering until all eight writers wait on it. Whatever A's HCA does next, each has a
/// write in flight on A that the target never ran.
async fn strand_writes(target: &Target<SoftHca>, port_a: u16) {
    let ignored = target.stats().ignored_frozen;
    target.freeze_port(port_a, true);
    until("a write of each writer left unanswered on A", || {
        target.stats().ignored_frozen >= ignored + 8
    })
    .await;
}

impl OnPathA {
    /// Strand a write of each writer on A ([`strand_writes`]), reset A's HCA for
    /// `down_for` and wait until A has left LIVE: the writers' counts at the fault, and the
    /// reset's task.
    async fn fault_a(
        &self,
        down_for: Duration,
    ) -> (Vec<u64>, tokio::task::JoinHandle<Result<(), String>>) {
        strand_writes(&self.target, self.port_a).await;
        let at_fault = self.writers.counts();
        let reset = reset_in_background(&self.faults[0], down_for);
        until("path A down", || self.a.ctrl.state() != CtrlState::Live).await;
        (at_fault, reset)
    }
}

/// Reset `f`'s device, back after `down_for`, in a task of its own while the test goes on.
fn reset_in_background(
    f: &DeviceFaults,
    down_for: Duration,
) -> tokio::task::JoinHandle<Result<(), String>> {
    let f = f.clone();
    tokio::spawn(async move { f.reset(down_for).await })
}

/// Path A's HCA is reset and stays down 5 s while eight writers each have a write in flight
/// on it (failover policy: every command goes to A), with default path settings (no
/// fast_io_fail_tmo). A gives its held writes back at once; each goes to path B once a
/// Cross-Controller Reset through B has ended A's old commands, so every writer moves on
/// long before A is back, and each block reads back its last acknowledged write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_in_flight_on_a_failed_path_complete_through_the_other_path_before_it_reconnects() {
    let on = writers_on_path_a(7).await;
    let (at_fault, reset) = on.fault_a(Duration::from_secs(5)).await;
    let OnPathA {
        sub,
        target,
        port_a,
        ns,
        writers,
        a,
        b,
        ..
    } = on;
    target.freeze_port(port_a, false);
    let t0 = std::time::Instant::now();
    writers.past(&at_fault).await;
    let took = t0.elapsed();
    assert_ne!(a.ctrl.state(), CtrlState::Live, "A came back first");
    assert!(
        took < Duration::from_secs(2),
        "the writes in flight on A took {took:?} to move to B"
    );
    assert!(
        a.stats().failovers >= 8,
        "writes not moved: {:?}",
        a.stats()
    );
    assert!(b.stats().ios > 0);
    writers.check(&ns).await;
    reset.await.unwrap().unwrap();
    until("path A back", || a.ctrl.state() == CtrlState::Live).await;
    assert_eq!(sub.held(), 0);
}

/// Path A's HCA is reset (down 300 ms) with a write of each of eight writers in flight on
/// it, while port B of the target ignores every command, so the Cross-Controller Reset
/// sent through B for A's old association is never answered; then B's HCA goes down for
/// 10 s with that CCR out. The CCR is asked again through A once A is back, and every
/// writer moves on within 3 s: far sooner than B's return, the CCR's own deadline (KATO +
/// CQT) or A's time rule, each 5 s or more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ccr_whose_path_fails_is_asked_again_through_the_next_live_path() {
    let on = writers_on_path_a(11).await;
    on.target.freeze_port(on.port_b, true);
    let (at_fault, reset_a) = on.fault_a(Duration::from_millis(300)).await;
    let OnPathA {
        faults,
        target,
        port_a,
        port_b,
        ns,
        writers,
        b,
        ..
    } = on;
    let t0 = std::time::Instant::now();
    // Port B alone ignores commands now: the next one it ignores is the CCR.
    let ignored = target.stats().ignored_frozen;
    target.freeze_port(port_a, false);
    until("the CCR sent through B", || {
        target.stats().ignored_frozen > ignored
    })
    .await;
    let reset_b = reset_in_background(&faults[1], Duration::from_secs(10));
    until("path B down", || b.ctrl.state() != CtrlState::Live).await;
    target.freeze_port(port_b, false);
    writers.past(&at_fault).await;
    let took = t0.elapsed();
    assert!(
        took < Duration::from_secs(3),
        "the writes in flight on A took {took:?} to move on"
    );
    assert_ne!(b.ctrl.state(), CtrlState::Live, "B came back first");
    writers.check(&ns).await;
    reset_a.await.unwrap().unwrap();
    reset_b.abort();
}

/// Both paths' HCAs down at once: a write is held (counted) until a path is back and then
/// succeeds; beyond the subsystem's bound a command fails at once, saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn io_is_held_while_no_path_is_usable_and_the_hold_is_bounded() {
    let ns = Arc::new(Namespace::ram(1, NS_BYTES, 9));
    let ports = [port(5, ns.clone()).await, port(6, ns).await];
    let sub = Subsystem::with_max_held(NQN, IoPolicy::Failover, 1);
    let mut faults = Vec::new();
    for (i, (_, hca)) in ports.iter().enumerate() {
        let (c, f) = path(5 + i as u8, hca.addr()).await;
        sub.add_path(c, hca.addr().to_string(), f.name().to_string())
            .await
            .unwrap();
        faults.push(f);
    }
    let ns = Arc::new(sub.namespace(1).unwrap());
    ns.write(0, &[1; 4096]).await.unwrap();
    let resets: Vec<_> = faults
        .iter()
        .map(|f| reset_in_background(f, Duration::from_millis(500)))
        .collect();
    let paths = sub.paths();
    until("both paths down", || {
        paths.iter().all(|p| p.ctrl.state() != CtrlState::Live)
    })
    .await;
    let held = {
        let ns = ns.clone();
        tokio::spawn(async move { ns.write(0, &[2; 4096]).await })
    };
    until("the write held", || sub.held() == 1).await;
    let e = ns.read(0, 4096).await.unwrap_err();
    assert!(e.to_string().contains("already wait"), "{e}");
    for r in resets {
        r.await.unwrap().unwrap();
    }
    held.await.unwrap().unwrap();
    assert_eq!(sub.held(), 0);
    assert_eq!(ns.read(0, 4096).await.unwrap(), vec![2; 4096]);
}

/// `round-robin` and `queue-depth` spread a namespace's I/O over both paths (per-path
/// counters); `failover` keeps it on one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_robin_and_queue_depth_spread_io_and_failover_keeps_one_path() {
    let rig = rig(IoPolicy::Failover).await;
    let ns = Arc::new(rig.sub.namespace(1).unwrap());
    let run = |ns: Arc<MpNamespace>| async move {
        let ts: Vec<_> = (0..4u64)
            .map(|w| {
                let ns = ns.clone();
                tokio::spawn(async move {
                    for i in 0..100u64 {
                        let lba = w * 1024 + i * 8;
                        ns.write(lba, &[w as u8; 4096]).await.unwrap();
                        assert_eq!(ns.read(lba, 4096).await.unwrap(), vec![w as u8; 4096]);
                    }
                })
            })
            .collect();
        for t in ts {
            t.await.unwrap();
        }
    };
    let delta = |before: &[u64], sub: &Subsystem| -> Vec<u64> {
        ios(sub).iter().zip(before).map(|(n, b)| n - b).collect()
    };

    let before = ios(&rig.sub);
    run(ns.clone()).await;
    let d = delta(&before, &rig.sub);
    assert_eq!(d.iter().sum::<u64>(), 800);
    assert!(d.contains(&0), "failover used both paths: {d:?}");

    for policy in [IoPolicy::RoundRobin, IoPolicy::QueueDepth] {
        rig.sub.set_policy(policy);
        let before = ios(&rig.sub);
        run(ns.clone()).await;
        let d = delta(&before, &rig.sub);
        assert_eq!(d.iter().sum::<u64>(), 800, "{policy}");
        // Queue-depth rightly favours the path that completes sooner, which on a loaded
        // machine can be either; spread means each path carries a real share.
        assert!(
            d.iter().all(|&n| n >= 100),
            "{policy} did not spread the I/O: {d:?}"
        );
    }
}

/// A controller of the same subsystem NQN whose namespace 1 is another namespace (another
/// NGUID and UUID) does not join; one of another subsystem neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_path_whose_namespace_is_another_one_is_refused() {
    let rig = rig(IoPolicy::Failover).await;
    let (_t, hca) = port(3, Arc::new(Namespace::ram(1, NS_BYTES, 9))).await;
    let (c, _) = path(3, hca.addr()).await;
    let e = rig
        .sub
        .add_path(c.clone(), hca.addr().to_string(), "host3".into())
        .await
        .unwrap_err();
    assert!(
        matches!(
            e.downcast_ref::<JoinError>(),
            Some(JoinError::OtherNamespace { nsid: 1 })
        ),
        "{e}"
    );
    assert_eq!(rig.sub.paths().len(), 2);
    let other = Subsystem::new("nqn.2026-11.io.nvmf-rdma:other", IoPolicy::Failover);
    let e = other
        .add_path(c, hca.addr().to_string(), "host3".into())
        .await
        .unwrap_err();
    assert!(matches!(
        e.downcast_ref::<JoinError>(),
        Some(JoinError::OtherSubsystem { .. })
    ));
}

/// A path whose target answers every read with "ANA inaccessible" (a path status: the
/// command was not executed) while its ANA log, as far as the host read it, says the path
/// is fine: the read goes to the other path and returns the namespace's data, and the
/// failing path counts one failover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_answered_with_an_ana_status_goes_to_the_other_path() {
    let inaccessible: Script = Arc::new(|sqe| {
        if sqe.opcode == opcode::io::READ {
            Lie::Status(ana::status::ANA_INACCESSIBLE)
        } else {
            Lie::Honest
        }
    });
    let honest: Script = Arc::new(|_| Lie::Honest);
    let sub = Subsystem::new(NQN, IoPolicy::Failover);
    let mut fakes = Vec::new();
    for (i, script) in [(1u8, inaccessible), (2, honest)] {
        let hca = SoftHca::start(crate::rig::device(FILE, "fake", 20 + i))
            .await
            .unwrap();
        let cm = CmService::for_device(&hca);
        let mut fc = FakeConfig::new(Nqn::new(NQN).unwrap());
        fc.seed = i as u64;
        let f = FakeTarget::start(hca.clone(), cm, fc, script).unwrap();
        let (c, dev) = path(20 + i, hca.addr()).await;
        sub.add_path(c, hca.addr().to_string(), dev.name().to_string())
            .await
            .unwrap();
        fakes.push((f, hca));
    }
    let ns = sub.namespace(1).unwrap();
    let want: Vec<u8> = (0..4096).map(FakeConfig::pattern).collect();
    assert_eq!(ns.read(0, 4096).await.unwrap(), want);
    let p = sub.paths();
    assert_eq!((p[0].stats().ios, p[0].stats().failovers), (1, 1), "{p:?}");
    assert_eq!(p[1].stats().ios, 1, "{p:?}");
}

/// One built-in target serving the subsystem on two ports (one ANA group, optimized on
/// both), a round-robin path through each, verified I/O from four workers: when port 2's
/// group turns inaccessible, I/O moves to port 1 with no error and path B gets none; when it
/// turns optimized again, B carries I/O again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_set_inaccessible_moves_io_to_the_other_port_with_no_error() {
    let (sub, _, t, p2) = one_target_two_ports(5, IoPolicy::RoundRobin).await;
    let dev = Arc::new(BlockDev::on(Arc::new(sub.namespace(1).unwrap())));
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let ws: Vec<_> = (0..4u64)
        .map(|w| tokio::spawn(worker(dev.clone(), w * 256, 256, 70 + w, stop.clone())))
        .collect();
    let paths = sub.paths();
    let (a, b) = (paths[0].clone(), paths[1].clone());
    let before = ios(&sub);
    until("both ports carry I/O", || {
        let now = ios(&sub);
        now[0] > before[0] + 20 && now[1] > before[1] + 20
    })
    .await;

    t.set_ana_state(p2, 1, ana::AnaState::Inaccessible).unwrap();
    // The first commands through port 2 may still go (and be answered with the ANA status
    // and moved); once the host has seen the state, B gets nothing while A carries on.
    until("path B sees its group inaccessible", || {
        b.ana_state(1, tokio::time::Instant::now()) == ana::AnaState::Inaccessible
    })
    .await;
    let (a_then, b_then) = (a.stats().ios, b.stats().ios);
    until("I/O on port 1 only", || a.stats().ios > a_then + 200).await;
    assert_eq!(b.stats().ios, b_then, "an inaccessible path got I/O");

    t.set_ana_state(p2, 1, ana::AnaState::Optimized).unwrap();
    // No Asynchronous Event Request is outstanding here (no daemon): the path reads its
    // state again on its own while it is shut out.
    until("path B carries I/O again", || b.stats().ios > b_then + 20).await;

    stop_tx.send(true).unwrap();
    let all = joined(ws).await;
    assert!(all.errors.is_empty(), "{:?}", all.errors);
    assert_eq!(all.mismatches, 0);
    eprintln!("path A {:?}, path B {:?}", a.stats(), b.stats());
}

/// Path B's HCA stays down while path A's is reset again and again under reads from sixteen
/// tasks. Whoever gets a command back from A ("given to another path") sees A no longer LIVE:
/// a path that hands its I/O back never says LIVE meanwhile, or the reads it gives back would
/// be sent to it again at once, and after a few rounds fail. Every read through the
/// namespace succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_path_giving_its_io_back_is_not_live_to_those_it_gives_it_to() {
    let rig = rig(IoPolicy::RoundRobin).await;
    let ns = Arc::new(rig.sub.namespace(1).unwrap());
    let paths = rig.sub.paths();
    let a = paths[0].ctrl.clone();
    let b_down = reset_in_background(&rig.faults[1], Duration::from_secs(30));
    until("path B down", || paths[1].ctrl.state() != CtrlState::Live).await;
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let seen_live = Arc::new(AtomicU64::new(0));
    let handed = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for t in 0..16u64 {
        let (a, ns, stop) = (a.clone(), ns.clone(), stop.clone());
        let (seen_live, handed) = (seen_live.clone(), handed.clone());
        tasks.push(tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            let mut i = 0u64;
            while !*stop.borrow() {
                i += 1;
                let lba = (t * 64 + i % 64) * 8;
                // Half the tasks on A's controller, half through the namespace.
                if t % 2 == 0 {
                    // A LIVE seen after A came back again is no fault: that is a later
                    // recovery, counted.
                    let recoveries = a.status().machine.recoveries;
                    if let Err(e) = a.read_into(1, lba, &mut buf).await {
                        if matches!(e, HostError::Path(FailReason::Failover)) {
                            handed.fetch_add(1, Ordering::Relaxed);
                            let st = a.status();
                            if st.state() == CtrlState::Live && st.machine.recoveries == recoveries
                            {
                                seen_live.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        tokio::task::yield_now().await;
                    }
                } else {
                    ns.read_into(lba, &mut buf)
                        .await
                        .map_err(|e| format!("read at LBA {lba}: {e}"))?;
                }
            }
            Ok::<_, String>(())
        }));
    }
    for _ in 0..100 {
        until("reads on A", || paths[0].stats().ios > 0).await;
        rig.faults[0].reset(Duration::from_millis(5)).await.unwrap();
        until("path A back", || a.state() == CtrlState::Live).await;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop_tx.send(true).unwrap();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    assert!(
        handed.load(Ordering::Relaxed) > 0,
        "no command was given back"
    );
    assert_eq!(
        seen_live.load(Ordering::Relaxed),
        0,
        "A said LIVE to {} of the {} commands it gave back",
        seen_live.load(Ordering::Relaxed),
        handed.load(Ordering::Relaxed)
    );
    b_down.abort();
}

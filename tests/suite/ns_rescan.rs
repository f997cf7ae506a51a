//! Namespaces after a reconnect, on loopback with the real driver: the controller reads
//! them again each time it is LIVE after a reconnect, so a namespace added or resized while
//! the association was down is seen at once; and a namespace whose identity changed behind
//! the same NSID is a different namespace, whose predecessor's users get errors, never its
//! blocks.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use nvmf_rdma::driver::{CmService, SoftHca};
use nvmf_rdma::export::BlockDev;
use nvmf_rdma::nvme::Nqn;
use nvmf_rdma::nvmet::{serve_cm, Namespace, Subsystem, Target, TargetConfig};
use nvmf_rdma::reconnect::CtrlState;
use nvmf_rdma::transport::{ConnectOptions, Controller, HostError, NsInfo};

const NQN: &str = "nqn.2026-11.io.nvmf-rdma:ns-rescan";
const MIB: u64 = 1 << 20;

fn cfg(name: &str, i: u8, addr: SocketAddr) -> nvmf_rdma::hca::device::DeviceConfig {
    let mut c = crate::rig::device(21, name, i);
    c.addr = addr;
    c
}

/// A target serving `namespaces` on `addr` (port 0 picks one).
async fn target(addr: SocketAddr, namespaces: Vec<Namespace>) -> (Target<SoftHca>, SoftHca) {
    let hca = SoftHca::start(cfg("tgt", 1, addr)).await.unwrap();
    let tc = TargetConfig {
        subsystems: vec![Subsystem::new(
            Nqn::new(NQN).unwrap(),
            namespaces.into_iter().map(Arc::new).collect(),
        )],
        ..TargetConfig::default()
    };
    let t = Target::start(hca.clone(), tc).unwrap();
    serve_cm(t.clone(), CmService::for_device(&hca)).unwrap();
    (t, hca)
}

/// The target goes away (its device dies, nothing answers on its address).
async fn stop(hca: &SoftHca) {
    hca.fatal();
    hca.stopped().await;
}

/// A controller that reconnects at once and forever, each attempt bounded short.
async fn host(t: &SoftHca) -> Arc<Controller> {
    let hca = SoftHca::start(cfg("host", 2, SocketAddr::from(([127, 0, 0, 1], 0))))
        .await
        .unwrap();
    let cm = CmService::for_device(&hca);
    let mut o = ConnectOptions::new(t.addr(), NQN);
    o.nr_io_queues = 1;
    o.queue_size = 32;
    o.connect_timeout = Duration::from_millis(300);
    o.policy = crate::rig::reconnect_at_once(None, Duration::from_secs(30));
    let c = crate::rig::within(20, "connect", Controller::connect(hca, cm, o)).await;
    Arc::new(c.unwrap())
}

/// Take the association down: the target stops, the host resets and keeps trying.
async fn outage(c: &Controller, t: &SoftHca) {
    stop(t).await;
    c.reset();
    c.wait_status(Duration::from_secs(10), |s| s.state() != CtrlState::Live)
        .await
        .unwrap();
}

/// Wait until the controller's namespaces satisfy `f`.
async fn namespaces_until(c: &Controller, what: &str, f: impl Fn(&[NsInfo]) -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        if f(&c.namespaces()) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: namespaces now {:?}, state {:?}",
            c.namespaces(),
            c.status().machine
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("nvmf-ns-rescan-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Namespace 1 (a file) grows from 4 to 8 MiB and namespace 3 appears while the target is
/// down; both are seen once the controller is LIVE again, with no event from the target.
/// An export's device of namespace 1 made before the outage still serves it (the same
/// namespace: its identity is kept beside the file), and a new one has the new size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_added_and_one_resized_during_an_outage_are_seen_after_the_reconnect() {
    let dir = scratch("grow");
    let disk = dir.join("ns1.img");
    let ns1 = Namespace::file(1, &disk, Some(4 * MIB), 9).unwrap();
    let (_t, thca) = target(SocketAddr::from(([127, 0, 0, 1], 0)), vec![ns1]).await;
    let addr = thca.addr();
    let c = host(&thca).await;
    assert_eq!(c.namespace(1).unwrap().bytes(), 4 * MIB);
    assert!(c.namespace(3).is_err());
    let before = BlockDev::new(c.clone(), 1).unwrap();
    before.write_at(4096, &[0x5A; 4096], false).await.unwrap();

    outage(&c, &thca).await;
    let ns1 = Namespace::file(1, &disk, Some(8 * MIB), 9).unwrap();
    let ns3 = Namespace::ram(3, 2 * MIB, 9);
    let (_t2, thca2) = target(addr, vec![ns1, ns3]).await;

    namespaces_until(&c, "namespace 1 at 8 MiB and namespace 3", |ns| {
        ns.iter().any(|n| n.nsid == 1 && n.bytes() == 8 * MIB)
            && ns.iter().any(|n| n.nsid == 3 && n.bytes() == 2 * MIB)
    })
    .await;
    assert_eq!(c.state(), CtrlState::Live);
    // The same namespace: its users go on.
    assert_eq!(before.read_at(4096, 4096).await.unwrap(), vec![0x5A; 4096]);
    let grown = BlockDev::new(c.clone(), 1).unwrap();
    assert_eq!(grown.size(), 8 * MIB);
    grown.write_at(6 * MIB, &[0xA5; 4096], false).await.unwrap();
    assert_eq!(
        grown.read_at(6 * MIB, 4096).await.unwrap(),
        vec![0xA5; 4096]
    );
    let added = BlockDev::new(c.clone(), 3).unwrap();
    added.write_at(0, &[3; 512], false).await.unwrap();
    assert_eq!(added.read_at(0, 512).await.unwrap(), vec![3; 512]);

    drop((before, grown, added));
    Arc::try_unwrap(c).ok().unwrap().disconnect().await;
    stop(&thca2).await;
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Namespace 1 is replaced by another of the same size while the target is down (a RAM
/// namespace: a new identity). After the reconnect the controller shows the new identity;
/// the export's device made for the old namespace fails every request with EIO instead of
/// reading or writing the new one's blocks; a device made now serves the new namespace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_whose_identity_changed_behind_its_nsid_is_a_different_namespace() {
    let (_t, thca) = target(
        SocketAddr::from(([127, 0, 0, 1], 0)),
        vec![Namespace::ram(1, 2 * MIB, 9)],
    )
    .await;
    let addr = thca.addr();
    let c = host(&thca).await;
    let old_ns = c.namespace(1).unwrap();
    assert!(!old_ns.ident.is_empty(), "the target reports an identity");
    let old = BlockDev::new(c.clone(), 1).unwrap();
    old.write_at(0, &[0x11; 4096], false).await.unwrap();

    outage(&c, &thca).await;
    let other = Namespace::ram(1, 2 * MIB, 9);
    other.write(0, &[0x22; 4096]).unwrap();
    assert_ne!(other.ident, old_ns.ident);
    let new_ident = other.ident;
    let (_t2, thca2) = target(addr, vec![other]).await;

    namespaces_until(&c, "namespace 1 with its new identity", |ns| {
        ns.iter().any(|n| n.nsid == 1 && n.ident == new_ident)
    })
    .await;
    let now = c.namespace(1).unwrap();
    assert_eq!(
        now.bytes(),
        old_ns.bytes(),
        "same NSID and size, yet another disk"
    );
    match c.same_namespace(&old_ns) {
        Err(HostError::NamespaceGone(m)) => assert!(m.contains("different namespace"), "{m}"),
        r => panic!("the old namespace's users must be refused: {r:?}"),
    }
    // Its user gets errors, not the new namespace's blocks, and writes nothing there.
    let e = old.read_at(0, 4096).await.unwrap_err();
    assert_eq!(e.errno(), libc::EIO, "{e}");
    let e = old.write_at(0, &[0x33; 4096], false).await.unwrap_err();
    assert_eq!(e.errno(), libc::EIO, "{e}");
    assert!(old.flush().await.is_err());
    let new = BlockDev::new(c.clone(), 1).unwrap();
    assert_eq!(new.read_at(0, 4096).await.unwrap(), vec![0x22; 4096]);

    drop((old, new));
    Arc::try_unwrap(c).ok().unwrap().disconnect().await;
    stop(&thca2).await;
}

/// A namespace removed while the target is down is gone after the reconnect: its users
/// get errors; put back with the same identity (the same file), it serves them again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_removed_during_an_outage_fails_its_users_until_it_is_back() {
    let dir = scratch("remove");
    let disk = dir.join("ns2.img");
    let (_t, thca) = target(
        SocketAddr::from(([127, 0, 0, 1], 0)),
        vec![
            Namespace::ram(1, MIB, 9),
            Namespace::file(2, &disk, Some(MIB), 9).unwrap(),
        ],
    )
    .await;
    let addr = thca.addr();
    let c = host(&thca).await;
    let dev = BlockDev::new(c.clone(), 2).unwrap();
    dev.write_at(0, &[7; 512], false).await.unwrap();

    outage(&c, &thca).await;
    let (_t2, thca2) = target(addr, vec![Namespace::ram(1, MIB, 9)]).await;
    namespaces_until(&c, "namespace 2 gone", |ns| ns.iter().all(|n| n.nsid != 2)).await;
    let e = dev.read_at(0, 512).await.unwrap_err();
    assert_eq!(e.errno(), libc::EIO, "{e}");
    assert!(e.to_string().contains("removed"), "{e}");

    outage(&c, &thca2).await;
    let back = Namespace::file(2, &disk, None, 9).unwrap();
    let (_t3, thca3) = target(addr, vec![Namespace::ram(1, MIB, 9), back]).await;
    namespaces_until(&c, "namespace 2 back", |ns| ns.iter().any(|n| n.nsid == 2)).await;
    assert_eq!(dev.read_at(0, 512).await.unwrap(), vec![7; 512]);

    drop(dev);
    Arc::try_unwrap(c).ok().unwrap().disconnect().await;
    stop(&thca3).await;
    std::fs::remove_dir_all(&dir).unwrap();
}

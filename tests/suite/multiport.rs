//! The built-in target on two soft-HCAs (two ports) serving one subsystem, on loopback with
//! the real driver: a host connects through each port and finds one namespace behind two
//! controllers; data written through one port reads back through the other; an ANA group
//! set inaccessible on one port through the control socket reaches the host as an
//! asynchronous event and in the ANA log page, and its I/O there gets the path status; a
//! Cross-Controller Reset through one port resets the controller on the other.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use nvmf_rdma::driver::{CmService, SoftHca};
use nvmf_rdma::nvme::admin::identify_controller;
use nvmf_rdma::nvme::ana::{self, AnaLog, AnaState, CtrlAna};
use nvmf_rdma::nvme::ccr::{cross_ctrl_reset, CcrResult, CtrlInstance};
use nvmf_rdma::nvme::{IdentifyController, Nqn};
use nvmf_rdma::nvmet::control::{self, SetAnaState};
use nvmf_rdma::nvmet::{serve_cm, serve_cm_on, Namespace, Subsystem, Target, TargetConfig};
use nvmf_rdma::reconnect::CtrlState;
use nvmf_rdma::transport::{ConnectOptions, Controller, HostError};

const NQN: &str = "nqn.2026-11.io.nvmf-rdma:multiport";
const FILE: u8 = 23;

async fn hca(name: &str, i: u8) -> SoftHca {
    let mut c = crate::rig::device(FILE, name, i);
    c.addr = SocketAddr::from(([127, 0, 0, 1], 0));
    SoftHca::start(c).await.unwrap()
}

/// A controller through the target port at `addr`, from a host device of its own.
async fn host(name: &str, i: u8, addr: SocketAddr) -> Arc<Controller> {
    let h = hca(name, i).await;
    let cm = CmService::for_device(&h);
    let mut o = ConnectOptions::new(addr, NQN);
    o.nr_io_queues = 1;
    o.queue_size = 32;
    o.connect_timeout = Duration::from_secs(2);
    o.policy = crate::rig::reconnect_at_once(None, Duration::from_secs(30));
    let c = crate::rig::within(20, "connect", Controller::connect(h, cm, o)).await;
    Arc::new(c.unwrap())
}

/// Identify Controller through `c`'s admin queue: the whole page.
async fn identify(c: &Controller) -> Vec<u8> {
    let r = c
        .admin_queue()
        .submit(identify_controller(1), None, 4096)
        .await
        .unwrap();
    r.data
}

/// The ANA log page as `c`'s controller reads it (retaining the event).
async fn ana_log(c: &Controller) -> Vec<u8> {
    let mut sqe = ana::get_ana_log(2, 4096, false).unwrap();
    sqe.cdw10 |= 1 << 15;
    c.admin_queue().submit(sqe, None, 4096).await.unwrap().data
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_subsystem_through_two_ports_with_ana_and_a_reset_across_them() {
    let (ta, tb) = (hca("tgtA", 1).await, hca("tgtB", 2).await);
    let ns = Namespace::ram(1, 4 << 20, 9);
    let tc = TargetConfig {
        subsystems: vec![Subsystem::new(Nqn::new(NQN).unwrap(), vec![Arc::new(ns)])],
        advertise: Some(ta.addr()),
        ..TargetConfig::default()
    };
    let t = Target::start(ta.clone(), tc).unwrap();
    assert_eq!(t.add_port(tb.clone(), Some(tb.addr())), Ok(2));
    serve_cm(t.clone(), CmService::for_device(&ta)).unwrap();
    serve_cm_on(t.clone(), 2, CmService::for_device(&tb)).unwrap();
    let dir = std::env::temp_dir().join(format!("nvmf-multiport-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let sock = dir.join("control");
    let _control = control::serve(&sock, t.clone(), Arc::new(|_: &_, _| {})).unwrap();

    let a = host("hostA", 3, ta.addr()).await;
    let b = host("hostB", 4, tb.addr()).await;

    // One namespace, two controllers.
    let (na, nb) = (a.namespace(1).unwrap(), b.namespace(1).unwrap());
    assert_eq!(na.ident.nguid, nb.ident.nguid);
    let (ida, idb) = (identify(&a).await, identify(&b).await);
    let (ia, ib) = (
        IdentifyController::parse(&ida).unwrap(),
        IdentifyController::parse(&idb).unwrap(),
    );
    assert_ne!(ia.cntlid, ib.cntlid);
    let cmic = CtrlAna::parse(&ida).unwrap().cmic;
    assert_ne!(cmic & ana::id_ctrl::CMIC_MULTI_PORT, 0);

    // The same blocks through either port.
    let data: Vec<u8> = (0..8192).map(|i| (i * 13 + 5) as u8).collect();
    a.write(1, 40, &data).await.unwrap();
    assert_eq!(b.read(1, 40, data.len()).await.unwrap(), data);

    // Group 1 inaccessible through port 2: B's outstanding Async Event Request reports it.
    let waiter = {
        let b = b.clone();
        tokio::spawn(async move { b.next_async_event().await })
    };
    let set = SetAnaState {
        port: 2,
        group: 1,
        state: "inaccessible".into(),
    };
    control::set_ana_state(&sock, &set).await.unwrap();
    let ev = crate::rig::within(10, "ANA change event", waiter)
        .await
        .unwrap()
        .unwrap();
    assert!(ana::aen_reports_ana_change(ev.to_result()), "{ev:?}");
    let page = ana_log(&b).await;
    let log = AnaLog::new_checked(&page).unwrap();
    assert_eq!(log.state_of(1), Some(AnaState::Inaccessible));
    assert_eq!(log.chgcnt, 1);
    let page = ana_log(&a).await;
    let log = AnaLog::new_checked(&page).unwrap();
    assert_eq!(log.state_of(1), Some(AnaState::Optimized));
    match b.read(1, 40, 512).await {
        Err(HostError::Nvme(e)) => assert_eq!(e.status, ana::status::ANA_INACCESSIBLE),
        other => panic!("read through an inaccessible path: {other:?}"),
    }
    assert_eq!(a.read(1, 40, data.len()).await.unwrap(), data);
    let ports = control::status(&sock).await.unwrap();
    let states: Vec<(u16, u32, String)> = ports
        .iter()
        .flat_map(|p| p.groups.iter().map(|g| (p.id, g.group, g.state.clone())))
        .collect();
    assert_eq!(
        states,
        vec![
            (1, 1, "optimized".to_string()),
            (2, 1, "inaccessible".to_string())
        ]
    );
    assert_eq!(ports[1].addr, Some(tb.addr().to_string()));
    let bad = SetAnaState { port: 3, ..set };
    let e = control::set_ana_state(&sock, &bad).await.unwrap_err();
    assert!(e.to_string().contains("no port 3"), "{e}");

    // A Cross-Controller Reset through port 2 resets the controller on port 1: the host
    // there reconnects to a new controller.
    let impacted = CtrlInstance {
        cntlid: ia.cntlid,
        ciu: ia.ciu,
        cirn: ia.cirn,
    };
    let r = b
        .admin_queue()
        .submit(cross_ctrl_reset(3, impacted), None, 0)
        .await
        .unwrap();
    assert!(CcrResult::from_dw0(r.cqe.result as u32).immediate);
    assert_eq!(t.stats().ccr_resets, 1);
    a.wait_status(Duration::from_secs(20), |s| {
        s.state() == CtrlState::Live && s.cntlid != ia.cntlid
    })
    .await
    .unwrap();
    assert_eq!(a.read(1, 40, data.len()).await.unwrap(), data);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The first port's device dies; the other port serves on, work of the target's own
/// included: a file namespace's I/O (run on the target's workers) through port 2 completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_other_port_serves_on_when_the_first_ports_device_dies() {
    let dir = std::env::temp_dir().join(format!("nvmf-multiport-dies-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (ta, tb) = (hca("tgtA", 5).await, hca("tgtB", 6).await);
    let ns = Namespace::file(1, &dir.join("ns1.img"), Some(4 << 20), 9).unwrap();
    let tc = TargetConfig {
        subsystems: vec![Subsystem::new(Nqn::new(NQN).unwrap(), vec![Arc::new(ns)])],
        ..TargetConfig::default()
    };
    let t = Target::start(ta.clone(), tc).unwrap();
    assert_eq!(t.add_port(tb.clone(), Some(tb.addr())), Ok(2));
    serve_cm(t.clone(), CmService::for_device(&ta)).unwrap();
    serve_cm_on(t.clone(), 2, CmService::for_device(&tb)).unwrap();
    let b = host("hostB", 7, tb.addr()).await;
    let data: Vec<u8> = (0..4096).map(|i| (i * 3 + 1) as u8).collect();
    b.write(1, 8, &data).await.unwrap();

    ta.fatal();
    ta.stopped().await;
    let more: Vec<u8> = data.iter().map(|x| x ^ 0xFF).collect();
    crate::rig::within(10, "write through port 2", b.write(1, 16, &more))
        .await
        .unwrap();
    let got = crate::rig::within(10, "read through port 2", b.read(1, 8, 4096))
        .await
        .unwrap();
    assert_eq!(got, data);
    assert_eq!(b.read(1, 16, 4096).await.unwrap(), more);
    let _ = std::fs::remove_dir_all(&dir);
}

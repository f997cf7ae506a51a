//! Device lifecycle through the driver: reset, hot-remove and re-plug on real sockets, the
//! device list following along, and data moving again through the device that came back.

use std::net::SocketAddr;
use std::time::Duration;

use nvmf_rdma::driver::{DeviceManager, SoftHca};
use nvmf_rdma::hca::device::{DeviceConfig, DeviceIdentity, IcrcCheck};
use nvmf_rdma::hca::rc::{connect_end, create_end, RcEnd, RcOptions};
use nvmf_rdma::verbs::*;

fn cfg(i: u8) -> DeviceConfig {
    DeviceConfig {
        identity: DeviceIdentity::from_mac(
            &format!("srxe{i}"),
            [2, 0, 0, 0, 9, i],
            PciAddr::new(0, 0x3b, i, 0),
        ),
        addr: SocketAddr::from(([127, 0, 0, 1], 0)),
        icrc: IcrcCheck::Verify,
        peer_port: None,
        seed: i as u64,
    }
}

async fn connect(a: &SoftHca, b: &SoftHca) -> (RcEnd, RcEnd) {
    let o = RcOptions {
        buf_len: 1 << 20,
        timeout: 12,
        retry_cnt: 3,
        ..RcOptions::default()
    };
    let ea = a.with(|d, _| create_end(d, &o, Psn::new(1))).unwrap();
    let eb = b.with(|d, _| create_end(d, &o, Psn::new(2))).unwrap();
    a.with(|d, _| connect_end(d, &ea, b.addr(), eb.qpn, eb.psn, &o))
        .unwrap();
    b.with(|d, _| connect_end(d, &eb, a.addr(), ea.qpn, ea.psn, &o))
        .unwrap();
    (ea, eb)
}

async fn write_and_check(a: &SoftHca, ea: &RcEnd, eb: &RcEnd, byte: u8) {
    ea.mem.write(0, &[byte; 65536]);
    let op = SendOp::Write {
        remote_addr: eb.mr.addr,
        rkey: eb.mr.rkey,
    };
    let sgl = Sgl::one(ea.mr.addr, 65536, ea.mr.lkey);
    a.with(|d, now| d.post_send(now, ea.qpn, SendWr::signaled(1, op, sgl)))
        .unwrap();
    let mut v = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), a.wait_cq(ea.cq, 1, &mut v))
        .await
        .unwrap();
    assert_eq!(v[0].status, WcStatus::Success);
    let mut got = vec![0u8; 65536];
    eb.mem.read(0, &mut got);
    assert!(got.iter().all(|&x| x == byte));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_unplug_replug_through_the_manager() {
    let m = DeviceManager::new(true);
    let a = m.plug(cfg(0)).await.unwrap();
    let b = m.plug(cfg(1)).await.unwrap();
    let addr_a = a.addr();
    let (ea, eb) = connect(&a, &b).await;
    write_and_check(&a, &ea, &eb, 0x11).await;
    assert_eq!(
        m.refresh().iter().map(|d| d.generation).collect::<Vec<_>>(),
        vec![1, 1]
    );

    // Reset: the old context turns zombie, a new one with the same identity comes back.
    let id_a = cfg(0).identity;
    let a2 = m.reset("srxe0", Duration::from_millis(20)).await.unwrap();
    assert_eq!(a.lifecycle(), Lifecycle::Fatal);
    assert!(a.with(|d, _| d.alloc_pd()).is_err());
    let (found, info) = m
        .wait_for(Duration::from_secs(2), |i| i.same_hardware(&id_a))
        .await
        .expect("device back after reset");
    assert_eq!(info.generation, 2);
    assert_eq!(
        found.addr(),
        addr_a,
        "a reset device comes back on its address"
    );
    assert_eq!(a2.addr(), addr_a);
    // Fresh resources on both sides, and data moves again.
    let (ea2, eb2) = connect(&a2, &b).await;
    write_and_check(&a2, &ea2, &eb2, 0x22).await;

    // Hot-remove: gone from the list; a different card in its place is not "ours".
    m.unplug("srxe0").await.unwrap();
    assert_eq!(m.refresh().len(), 1);
    assert_eq!(a2.lifecycle(), Lifecycle::Removed);
    let other = DeviceIdentity::from_mac("srxe0", [2, 0, 0, 0, 9, 0x77], id_a.pci);
    let a3 = m.replug(other.clone()).await.unwrap();
    assert!(m
        .wait_for(Duration::from_millis(100), |i| i.same_hardware(&id_a))
        .await
        .is_none());
    let (_, info) = m
        .wait_for(Duration::from_secs(1), |i| i.name == "srxe0")
        .await
        .unwrap();
    assert_eq!(info.guid, other.guid);
    assert_eq!(info.generation, 3);
    let (ea3, eb3) = connect(&a3, &b).await;
    write_and_check(&a3, &ea3, &eb3, 0x33).await;
}

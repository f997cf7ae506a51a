//! The verbs conformance checks (`common/conformance.rs`) through the backend seam on the
//! soft-HCA: over UDP on loopback, and on the simulated network in virtual time (a clean link
//! and a lossy one). `tests/hw_backend.rs` runs the same checks on a kernel RDMA device.

#[path = "common/conformance.rs"]
mod conformance;

use std::net::SocketAddr;

use nvmf_rdma::driver::{DeviceManager, SimNet};
use nvmf_rdma::hca::device::{DeviceConfig, DeviceIdentity, IcrcCheck};
use nvmf_rdma::hca::sim::Faults;
use nvmf_rdma::verbs::PciAddr;

/// The service the passive side listens for (any port: the soft-HCA's CM names a service,
/// not a socket).
const SERVICE: u16 = 4420;

fn device(name: &str, i: u8, ip: [u8; 4], seed: u64) -> DeviceConfig {
    DeviceConfig {
        identity: DeviceIdentity::from_mac(
            name,
            [2, 0, 0, 0xc0, 0, i],
            PciAddr::new(0, 0xc0, i, 0),
        ),
        addr: SocketAddr::from((ip, 0)),
        icrc: IcrcCheck::Verify,
        peer_port: None,
        seed,
    }
}

/// Devices `a` and `b` plugged into `mgr`; the address of `b`.
async fn plug_two(mgr: &DeviceManager, ips: [[u8; 4]; 2], seed: u64) -> SocketAddr {
    mgr.plug(device("a", 1, ips[0], seed))
        .await
        .expect("plug a");
    let b = mgr
        .plug(device("b", 2, ips[1], seed + 1))
        .await
        .expect("plug b");
    b.addr()
}

#[test]
fn soft_hca_on_udp_passes_the_verbs_conformance_checks() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mgr = DeviceManager::new(false);
        let b = plug_two(&mgr, [[127, 0, 0, 1]; 2], 1).await;
        conformance::conformance(&mgr, "a", "b", b, SERVICE)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    });
}

/// In virtual time; the link turns `faults` once the QPs are connected (the CM's own
/// retries are not what is checked here).
fn on_simnet(seed: u64, faults: Faults) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(async {
        let net = SimNet::new(seed, Faults::NONE);
        let mgr = net.device_manager();
        let b = plug_two(&mgr, [[127, 0, 1, 1], [127, 0, 2, 1]], seed).await;
        let (ea, eb) = conformance::connect(&mgr, "a", "b", b, SERVICE)
            .await
            .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        net.set_faults(faults);
        let r = conformance::check(&ea, &eb).await;
        ea.close();
        eb.close();
        r.unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    });
}

#[test]
fn simulated_soft_hca_passes_the_verbs_conformance_checks() {
    on_simnet(1, Faults::NONE);
}

#[test]
fn simulated_soft_hca_passes_them_on_a_lossy_link() {
    for seed in 0..5 {
        on_simnet(seed, Faults::LOSSY);
    }
}

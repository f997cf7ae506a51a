//! What the suite's files share: a soft-HCA's configuration, and a bounded wait.
#![allow(dead_code)]

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use nvmf_rdma::driver::{CmService, SoftHca};
use nvmf_rdma::hca::device::{DeviceConfig, DeviceIdentity, IcrcCheck};
use nvmf_rdma::nvme::Nqn;
use nvmf_rdma::nvmet::{serve_cm, Namespace, Subsystem, Target, TargetConfig};
use nvmf_rdma::reconnect::Policy;
use nvmf_rdma::verbs::PciAddr;

/// Device `i` of the file numbered `file`, on `ip` with a port the OS picks. The file's
/// number keeps its devices' MACs, PCI addresses and seeds apart from the other files'.
pub fn device_on(file: u8, name: &str, i: u8, ip: [u8; 4]) -> DeviceConfig {
    DeviceConfig {
        identity: DeviceIdentity::from_mac(
            name,
            [2, 0, 0, file, 0, i],
            PciAddr::new(0, file, i, 0),
        ),
        addr: SocketAddr::from((ip, 0)),
        icrc: IcrcCheck::Verify,
        peer_port: None,
        seed: file as u64 * 100 + i as u64,
    }
}

/// The same on 127.0.0.1.
pub fn device(file: u8, name: &str, i: u8) -> DeviceConfig {
    device_on(file, name, i, [127, 0, 0, 1])
}

/// Reconnect at once, give up after `ctrl_loss_tmo`, wait `replug_window` for a card that
/// went; the rest (keep-alive 5 s, both identities) as the defaults.
pub fn reconnect_at_once(ctrl_loss_tmo: Option<Duration>, replug_window: Duration) -> Policy {
    Policy {
        ctrl_loss_tmo,
        reconnect_delay: Duration::ZERO,
        replug_window,
        ..Policy::default()
    }
}

/// Fail with `what` instead of hanging.
pub async fn within<T>(secs: u64, what: &str, f: impl Future<Output = T>) -> T {
    match tokio::time::timeout(Duration::from_secs(secs), f).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: no result within {secs} s"),
    }
}

/// A built-in target on a soft-HCA of `cfg` serving subsystem `nqn` with `namespaces`.
pub async fn serve(
    cfg: DeviceConfig,
    nqn: &str,
    namespaces: Vec<Arc<Namespace>>,
) -> (Target<SoftHca>, SoftHca) {
    let hca = SoftHca::start(cfg).await.unwrap();
    let tc = TargetConfig {
        subsystems: vec![Subsystem::new(Nqn::new(nqn).unwrap(), namespaces)],
        ..TargetConfig::default()
    };
    let t = Target::start(hca.clone(), tc).unwrap();
    serve_cm(t.clone(), CmService::for_device(&hca)).unwrap();
    (t, hca)
}

/// The seeds a seed sweep runs: `SIM_SEED` alone, to replay one, else 1 to `$count_var`
/// (`default` without it).
pub fn sweep_seeds(count_var: &str, default: u64) -> Vec<u64> {
    match std::env::var("SIM_SEED") {
        Ok(s) => vec![s.parse().expect("SIM_SEED is a number")],
        Err(_) => {
            let n: u64 = std::env::var(count_var)
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(default);
            (1..=n).collect()
        }
    }
}

/// A runtime for one simulated world: one thread, tokio's clock paused (it jumps to the
/// next timer whenever every task waits), and no I/O driver, so nothing can open a socket.
/// `RUST_LOG=nvmf_rdma=info` with a replayed seed shows what the host did, step by step.
pub fn sim_runtime() -> tokio::runtime::Runtime {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("runtime")
}

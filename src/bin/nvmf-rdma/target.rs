//! `target`: the built-in NVMe-oF target until a stop signal.

use std::sync::Arc;

use crate::{args::*, host::*, signals::*};
use anyhow::{Context, Result};
use nvmf_rdma::driver::{CmService, SoftHca};
use nvmf_rdma::nvme::Nqn;
use nvmf_rdma::nvmet::{serve_cm, Subsystem, Target, TargetConfig};

pub(crate) async fn run_target(a: TargetArgs) -> Result<()> {
    let nqn = Nqn::new(&a.nqn).map_err(|e| anyhow::anyhow!("bad --nqn: {e}"))?;
    let ns = a.ns.namespace(1)?;
    let mut sub = Subsystem::new(nqn, vec![Arc::new(ns)]);
    if !a.allow_host.is_empty() {
        sub.allowed_hosts = Some(a.allow_host.clone());
    }
    let hca = SoftHca::start_with(
        device_config("tgt0", a.listen, 9),
        a.listen.ip().is_loopback(),
    )
    .await
    .with_context(|| format!("cannot bind {}", a.listen))?;
    let cfg = TargetConfig {
        subsystems: vec![sub],
        port: a.trsvcid,
        advertise: Some(hca.addr()),
        ..TargetConfig::default()
    };
    let t = Target::start(hca.clone(), cfg)?;
    serve_cm(t.clone(), CmService::for_device(&hca));
    let _control = match &a.control {
        Some(p) => Some(crate::target_control::serve(p, t.clone())?),
        None => None,
    };
    println!(
        "target {} listening on {} (trsvcid {}); Ctrl-C stops it",
        a.nqn,
        hca.addr(),
        a.trsvcid
    );
    let sig = StopSignals::new()?.recv().await;
    println!("{sig}: stopping; {:?}", t.stats());
    Ok(())
}

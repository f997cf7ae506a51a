//! `target`: the built-in NVMe-oF target until a stop signal; `target-ns add` and
//! `target-ana`, its clients.

use std::net::SocketAddr;
use std::sync::Arc;

use crate::signals::*;
use anyhow::{bail, Result};
use nvmf_rdma::cli::device::{start_target_kernel, DeviceChoice};
use nvmf_rdma::cli::target::{start_soft, TargetAnaSet, TargetArgs, TargetNsAdd};
use nvmf_rdma::nvmet::control::{self, AddNamespace, SetAnaState};
use nvmf_rdma::nvmet::TargetConfig;

pub(crate) async fn run_target(a: TargetArgs) -> Result<()> {
    let cfg = a.config()?;
    match a.device.clone() {
        DeviceChoice::Soft => run_soft(a, cfg).await,
        DeviceChoice::Kernel(sel) => run_kernel(&sel, a, cfg).await,
    }
}

/// The target on one soft-HCA per --listen address, each a port.
async fn run_soft(a: TargetArgs, cfg: TargetConfig) -> Result<()> {
    let (t, hcas) = start_soft(&a.listen, cfg).await?;
    let _control = match &a.control {
        Some(p) => Some(control::serve(
            p,
            t.clone(),
            Arc::new(|a: &AddNamespace, blocks| {
                println!("namespace {} added to {} ({blocks} blocks)", a.nsid, a.nqn)
            }),
        )?),
        None => None,
    };
    let addrs: Vec<String> = hcas.iter().map(|h| h.addr().to_string()).collect();
    println!(
        "target {} listening on {} (trsvcid {}); Ctrl-C stops it",
        a.nqn,
        addrs.join(", "),
        a.trsvcid
    );
    let sig = StopSignals::new()?.recv().await;
    println!("{sig}: stopping; {}", t.stats());
    Ok(())
}

/// The target on a kernel RDMA device: until a stop signal, or until the device dies (one
/// line, exit status 1).
async fn run_kernel(sel: &str, a: TargetArgs, cfg: TargetConfig) -> Result<()> {
    if a.listen.len() > 1 {
        bail!(
            "--listen given {} times: several ports need the soft-HCA for now; give one \
             --listen with --device {sel}, or run one target per device",
            a.listen.len()
        );
    }
    if let Some(p) = &a.control {
        bail!(
            "--control {}: namespaces can be added at run time to the soft-HCA target only, \
             for now; leave --control out with --device {sel}",
            p.display()
        );
    }
    let ip = a.listen[0].ip();
    let cfg = TargetConfig {
        advertise: Some(SocketAddr::new(ip, a.trsvcid)),
        ..cfg
    };
    let t = start_target_kernel(sel, cfg).map_err(anyhow::Error::msg)?;
    println!(
        "target {} listening on {} (trsvcid {}) through RDMA device {sel}; Ctrl-C stops it",
        a.nqn, ip, a.trsvcid
    );
    let mut signals = StopSignals::new()?;
    tokio::select! {
        sig = signals.recv() => {
            println!("{sig}: stopping; {}", t.stats());
            Ok(())
        }
        why = t.died() => bail!("{why}"),
    }
}

/// `target-ns add`: one namespace for a running `target --control SOCKET`.
pub(crate) async fn run_target_ns_add(a: TargetNsAdd) -> Result<()> {
    let req = a.ns.add_request(a.nqn, a.nsid);
    let blocks = control::add_namespace(&a.control, &req).await?;
    println!(
        "namespace {} added to {} ({blocks} blocks)",
        req.nsid, req.nqn
    );
    Ok(())
}

/// `target-ana set`: an ANA group's state through a port of a running target.
pub(crate) async fn run_target_ana_set(a: TargetAnaSet) -> Result<()> {
    let req = SetAnaState {
        port: a.port,
        group: a.group,
        state: a.state,
    };
    control::set_ana_state(&a.control, &req).await?;
    println!(
        "ANA group {} is {} through port {}",
        req.group, req.state, req.port
    );
    Ok(())
}

/// `target-ana status`: each port of a running target and its ANA groups.
pub(crate) async fn run_target_ana_status(control: &std::path::Path) -> Result<()> {
    for p in control::status(control).await? {
        let groups: Vec<String> = p
            .groups
            .iter()
            .map(|g| format!("group {} {}", g.group, g.state))
            .collect();
        println!(
            "port {} {}: {}",
            p.id,
            p.addr.as_deref().unwrap_or("-"),
            groups.join(", ")
        );
    }
    Ok(())
}

//! The CLI as a client of the daemon: `connect`, `connect-all`, `list`, `list-subsys`,
//! `disconnect`, `disconnect-all`. Controllers held by `connect --foreground` (one socket each
//! in the run directory) are listed and disconnected too.

use anyhow::{bail, Result};
use std::time::Duration;

use nvmf_rdma::cli::support::{human_duration, run_dir};
use nvmf_rdma::daemon::client::Client;
use nvmf_rdma::daemon::config::params_of;
use nvmf_rdma::daemon::local::{self, all_controllers, by_subsystem, disconnect, disconnect_all};
use nvmf_rdma::daemon::proto::{ControllerInfo, ExportInfo, LineStatus, Request};
use serde::de::DeserializeOwned;
use serde_json::json;

use crate::args::{ConnectMode, DaemonArgs, ExportArgs, ListFormat, Subsys};
use crate::daemon::start_background;
use nvmf_rdma::cli::units::human_bytes;

pub(crate) async fn open() -> Result<Client> {
    Client::open(&run_dir()).await
}

/// `req` on a connection of its own, starting a daemon in the background when none runs.
async fn call_starting<T: DeserializeOwned>(req: &Request, global: Vec<String>) -> Result<T> {
    local::call_starting(&run_dir(), req, start_daemon(global)).await
}

/// Start a daemon in the background for a command that needs one.
async fn start_daemon(global: Vec<String>) -> Result<()> {
    let start = move || start_background(&DaemonArgs::default(), &global);
    let pid = tokio::task::spawn_blocking(start).await??;
    eprintln!(
        "started nvmf-rdma daemon (pid {pid}; log {})",
        run_dir().join("daemon.log").display()
    );
    Ok(())
}

/// `connect` through the daemon, starting one in the background when none runs. Returns
/// once the controller is LIVE and its exports are ready.
pub(crate) async fn run_connect_daemon(
    s: Subsys,
    x: ExportArgs,
    m: ConnectMode,
    global: Vec<String>,
) -> Result<()> {
    // The checks `connect` makes, here first so a typo needs no daemon.
    nvmf_rdma::cli::host::options(&s)?;
    let req = Request::Connect {
        params: Box::new(params_of(&s, &x, &m)),
    };
    let v: nvmf_rdma::daemon::proto::ConnectReply = call_starting(&req, global).await?;
    if m.format.output == ListFormat::Json {
        println!(
            "{}",
            json!({"device": v.device, "controller": v.controller})
        );
        return Ok(());
    }
    println!("connecting to device: {}", v.device);
    for x in &v.controller.exports {
        match x {
            ExportInfo::Nbd {
                nsid, address, uri, ..
            } => println!("nbd: namespace {nsid} at {address} ({uri})"),
            ExportInfo::Fuse { nsid, file, .. } => println!("fuse: namespace {nsid} is {file}"),
        }
    }
    Ok(())
}

pub(crate) async fn run_list(output: ListFormat) -> Result<()> {
    let (have_daemon, ctrls) = all_controllers(&run_dir()).await?;
    if output == ListFormat::Json {
        println!("{}", json!({ "controllers": ctrls }));
        return Ok(());
    }
    println!(
        "{:<8} {:<40} {:<22} {:>5} {:>6} {:<10} {:>3} {:>10}",
        "Name", "SubNQN", "Address", "Svc", "CNTLID", "State", "IOQ", "Capacity"
    );
    for c in &ctrls {
        for l in list_rows(c) {
            println!("{l}");
        }
    }
    if ctrls.is_empty() && !have_daemon {
        eprintln!(
            "no daemon runs in {} and no `connect --foreground` holds a controller there \
             (NVMF_RDMA_RUN_DIR picks another run directory)",
            run_dir().display()
        );
    }
    Ok(())
}

/// `list`'s lines for controller `c`: its row, its health, its exports.
fn list_rows(c: &ControllerInfo) -> Vec<String> {
    // The soft-HCA's UDP port only when it is not RoCEv2's 4791: the NVMe-oF port (what -s
    // gave) is the Svc column.
    let addr = match c.address.as_deref().map(str::parse::<std::net::SocketAddr>) {
        Some(Ok(a)) if a.port() != nvmf_rdma::hca::wire::ROCEV2_PORT => a.to_string(),
        Some(Ok(a)) => a.ip().to_string(),
        _ => c.traddr.clone(),
    };
    let mut out = vec![format!(
        "{:<8} {:<40} {:<22} {:>5} {:>6} {:<10} {:>3} {:>10}",
        c.name,
        c.subnqn,
        addr,
        c.trsvcid,
        c.cntlid,
        c.state,
        c.io_queues,
        human_bytes(c.capacity()),
    )];
    let health =
        nvmf_rdma::cli::support::Health::from_json(&serde_json::to_string(c).unwrap_or_default());
    let mut line = health.describe(&c.state);
    if !c.safe_retry.is_empty() {
        line += &format!("; safe-retry {}", c.safe_retry);
    }
    out.push(format!("{:<8} {line}", ""));
    for h in &c.holds {
        out.push(format!(
            "{:<8} safe-retry {}: holding {} command(s) of dead cntlid {} until {} ({} left at most)",
            "",
            c.safe_retry,
            h.held,
            h.cntlid,
            if h.released_by == "ccr" {
                "a cross-controller reset"
            } else {
                "the time rule"
            },
            human_duration(Duration::from_secs_f64(h.time_left_ms.max(0.0) / 1e3)),
        ));
    }
    for x in &c.exports {
        let what = match x {
            ExportInfo::Nbd { uri, clients, .. } => format!("nbd {uri} ({clients} client(s))"),
            ExportInfo::Fuse {
                file, open_handles, ..
            } => format!("fuse {file} ({open_handles} open)"),
        };
        out.push(format!("{:<8} export: {what}", ""));
    }
    if c.foreground {
        out.push(format!(
            "{:<8} held by a `connect --foreground` process",
            ""
        ));
    }
    out
}

/// `list-subsys`: controllers grouped by subsystem, as nvme-cli shows them.
pub(crate) async fn run_list_subsys(output: ListFormat) -> Result<()> {
    let (_, ctrls) = all_controllers(&run_dir()).await?;
    let subs = by_subsystem(&ctrls);
    let address = |c: &ControllerInfo| format!("traddr={},trsvcid={}", c.traddr, c.trsvcid);
    if output == ListFormat::Json {
        let v: Vec<serde_json::Value> = subs
            .iter()
            .enumerate()
            .map(|(i, (nqn, cs))| {
                let paths: Vec<serde_json::Value> = cs
                    .iter()
                    .map(|c| {
                        let mut v = json!({"Name": c.name, "Transport": "rdma",
                                           "Address": address(c), "State": c.state});
                        if let Some(p) = &c.path {
                            v["Device"] = json!(p.device);
                            v["ANAState"] = json!(p.ana_state.first().map(|(_, s)| s));
                            v["IOs"] = json!(p.ios);
                            v["Inflight"] = json!(p.inflight);
                            v["Failovers"] = json!(p.failovers);
                            v["Reconnects"] = json!(p.reconnects);
                        }
                        v
                    })
                    .collect();
                let policy = cs.iter().find_map(|c| c.iopolicy.clone());
                json!({"Name": format!("nvmf-subsys{i}"), "NQN": nqn, "IOPolicy": policy,
                       "Paths": paths})
            })
            .collect();
        println!("{}", json!({ "Subsystems": v }));
        return Ok(());
    }
    for (i, (nqn, cs)) in subs.iter().enumerate() {
        println!("nvmf-subsys{i} - NQN={nqn}");
        if let Some(p) = cs.iter().find_map(|c| c.iopolicy.as_deref()) {
            println!("               iopolicy={p}");
        }
        println!("\\");
        for c in cs {
            match &c.path {
                Some(p) => println!(
                    " +- {} rdma {} {} {} ios={} failovers={}",
                    c.name,
                    address(c),
                    c.state,
                    p.ana_state.first().map_or("", |(_, s)| s.as_str()),
                    p.ios,
                    p.failovers
                ),
                None => println!(" +- {} rdma {} {}", c.name, address(c), c.state),
            }
        }
    }
    Ok(())
}

/// `disconnect -n NQN | -d DEVICE [--force]`.
pub(crate) async fn run_disconnect(
    nqn: Option<String>,
    device: Option<String>,
    force: bool,
) -> Result<()> {
    let label = match (&nqn, &device) {
        (Some(q), _) => format!("NQN:{q}"),
        (None, Some(d)) => format!("Device:{d}"),
        (None, None) => bail!("give -n NQN or -d DEVICE"),
    };
    let n = disconnect(&run_dir(), nqn.as_deref(), device.as_deref(), force).await?;
    if n == 0 {
        let given = match (&nqn, &device) {
            (Some(q), _) => format!("-n {q}"),
            (None, d) => format!("-d {}", d.as_deref().unwrap_or_default()),
        };
        bail!("no controller matches {given} (`nvmf-rdma list` shows them)");
    }
    println!("{label} disconnected {n} controller(s)");
    Ok(())
}

/// `disconnect-all [--force]`.
pub(crate) async fn run_disconnect_all(force: bool) -> Result<()> {
    let n = disconnect_all(&run_dir(), force).await?;
    println!("disconnected {n} controller(s)");
    Ok(())
}

/// `connect-all`: with -a, every subsystem that discovery controller lists; without, what
/// the daemon's config file lists.
pub(crate) async fn run_connect_all(
    given: Option<(Subsys, ConnectMode)>,
    output: ListFormat,
    global: Vec<String>,
) -> Result<()> {
    if let Some((s, _)) = &given {
        nvmf_rdma::cli::host::options(s)?;
    }
    let req = Request::ConnectAll {
        params: given
            .as_ref()
            .map(|(s, m)| Box::new(params_of(s, &ExportArgs::default(), m))),
    };
    let v: nvmf_rdma::daemon::proto::ConnectAllReply = call_starting(&req, global).await?;
    if output == ListFormat::Json {
        println!("{}", json!({ "results": v.results }));
    } else {
        for r in &v.results {
            match r.status {
                LineStatus::Connected => println!(
                    "connecting to device: {} ({})",
                    r.device.as_deref().unwrap_or("?"),
                    r.nqn
                ),
                LineStatus::AlreadyConnected => println!("already connected: {}", r.nqn),
                LineStatus::Failed => eprintln!(
                    "failed: {} at {}: {}",
                    r.nqn,
                    r.traddr,
                    r.error.as_deref().unwrap_or("?")
                ),
            }
        }
    }
    if v.results.iter().any(|r| r.status == LineStatus::Failed) {
        bail!("some connections failed");
    }
    Ok(())
}

#[cfg(test)]
mod list_tests {
    use super::*;

    /// The Svc column is the service ID the user typed; the RoCEv2 UDP port stays out of the
    /// Address column.
    #[test]
    fn list_shows_the_service_id_typed_not_the_roce_port() {
        let c = ControllerInfo {
            name: "nvmf0".into(),
            subnqn: "nqn.2026-11.io.x:a".into(),
            traddr: "10.0.0.2".into(),
            address: Some("10.0.0.2:4791".into()),
            trsvcid: 4420,
            state: "live".into(),
            ..ControllerInfo::default()
        };
        let row = &list_rows(&c)[0];
        assert!(row.contains("10.0.0.2 ") && row.contains(" 4420 "), "{row}");
        assert!(!row.contains("4791"), "{row}");
        // A foreground controller has no soft-HCA address: the target's IP.
        let f = ControllerInfo {
            address: None,
            foreground: true,
            ..c
        };
        let rows = list_rows(&f);
        assert!(
            rows[0].contains("10.0.0.2 ") && !rows[0].contains("4791"),
            "{rows:?}"
        );
        assert!(rows.last().unwrap().contains("connect --foreground"));
    }

    /// The mode rides on the health line; each hold gets a line of its own with what lets
    /// it go and the time left.
    #[test]
    fn list_shows_the_safe_retry_mode_and_each_hold() {
        let c = ControllerInfo {
            name: "nvmf0".into(),
            state: "live".into(),
            safe_retry: "ccr".into(),
            holds: vec![nvmf_rdma::daemon::proto::HoldInfo {
                cntlid: 7,
                ciu: 2,
                held: 3,
                released_by: "time".into(),
                time_left_ms: 1500.0,
            }],
            ..ControllerInfo::default()
        };
        let rows = list_rows(&c);
        assert!(rows[1].ends_with("; safe-retry ccr"), "{rows:?}");
        assert!(
            rows[2].contains("holding 3 command(s) of dead cntlid 7 until the time rule (1.5 s"),
            "{rows:?}"
        );
    }
}

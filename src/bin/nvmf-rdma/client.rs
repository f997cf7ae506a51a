//! The CLI as a client of the daemon: `connect`, `connect-all`, `list`, `list-subsys`,
//! `disconnect`, `disconnect-all`. Controllers held by `connect --foreground` (one socket each
//! in the run directory) are listed and disconnected too.

use std::time::Duration;

use anyhow::{bail, Result};
use nvmf_rdma::cli::support::{human_duration, json_field, run_dir};
use nvmf_rdma::daemon::client::{socket_in, Client};
use nvmf_rdma::daemon::config::params_of;
use nvmf_rdma::daemon::control::{disconnect_foreground, foreground_controllers};
use nvmf_rdma::daemon::proto::{
    ControllerInfo, ErrorCode, ExportInfo, LineStatus, ProtoError, Request,
};
use serde::de::DeserializeOwned;
use serde_json::json;

use crate::args::{ConnectMode, DaemonArgs, ExportArgs, ListFormat, Subsys};
use crate::daemon::start_background;
use nvmf_rdma::cli::units::human_bytes;

/// A connection to the daemon of the run directory; `Ok(None)`: none answers.
pub(crate) async fn try_open() -> Result<Option<Client>> {
    Client::try_open(&socket_in(&run_dir())).await
}

pub(crate) async fn open() -> Result<Client> {
    Client::open(&run_dir()).await
}

/// One request on a connection of its own. `Ok(None)`: no daemon answers on the socket.
async fn try_call<T: DeserializeOwned>(req: &Request) -> Result<Option<T>> {
    match try_open().await? {
        Some(mut c) => c.call(req).await.map(Some),
        None => Ok(None),
    }
}

/// `req` on a connection of its own, starting a daemon in the background when none runs.
async fn call_starting<T: DeserializeOwned>(req: &Request, global: Vec<String>) -> Result<T> {
    match try_call(req).await? {
        Some(v) => Ok(v),
        None => {
            start_daemon(global).await?;
            open().await?.call(req).await
        }
    }
}

/// Names the daemon holds (for `connect --foreground` to avoid them); none without a daemon.
pub(crate) async fn daemon_controller_names() -> Vec<String> {
    let list = try_call::<nvmf_rdma::daemon::proto::ListReply>(&Request::List {});
    match tokio::time::timeout(Duration::from_secs(2), list).await {
        Ok(Ok(Some(v))) => v.controllers.into_iter().map(|c| c.name).collect(),
        _ => Vec::new(),
    }
}

/// Start a daemon in the background for a command that needs one. Another command may
/// start one at the same moment: if ours loses that race, the winner serves us.
async fn start_daemon(global: Vec<String>) -> Result<()> {
    let r = tokio::task::spawn_blocking(move || start_background(&DaemonArgs::default(), &global))
        .await?;
    match r {
        Ok(pid) => {
            eprintln!(
                "started nvmf-rdma daemon (pid {pid}; log {})",
                run_dir().join("daemon.log").display()
            );
            Ok(())
        }
        Err(e) => match try_call::<serde_json::Value>(&Request::Status {}).await {
            Ok(Some(_)) => Ok(()),
            _ => Err(e),
        },
    }
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
    if m.output == ListFormat::Json {
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

/// Every controller: the daemon's, then `connect --foreground` ones.
async fn all_controllers() -> Result<(bool, Vec<ControllerInfo>)> {
    let mut out = Vec::new();
    let daemon = try_call::<nvmf_rdma::daemon::proto::ListReply>(&Request::List {}).await?;
    let have_daemon = daemon.is_some();
    if let Some(v) = daemon {
        out.extend(v.controllers);
    }
    for (_, j) in foreground_controllers().await {
        if let Ok(mut c) = serde_json::from_str::<ControllerInfo>(&j) {
            c.foreground = true;
            out.push(c);
        }
    }
    Ok((have_daemon, out))
}

pub(crate) async fn run_list(output: ListFormat) -> Result<()> {
    let (have_daemon, ctrls) = all_controllers().await?;
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
    let (_, ctrls) = all_controllers().await?;
    let mut subs: Vec<(String, Vec<&ControllerInfo>)> = Vec::new();
    for c in &ctrls {
        match subs.iter_mut().find(|(n, _)| *n == c.subnqn) {
            Some((_, v)) => v.push(c),
            None => subs.push((c.subnqn.clone(), vec![c])),
        }
    }
    let address = |c: &ControllerInfo| format!("traddr={},trsvcid={}", c.traddr, c.trsvcid);
    if output == ListFormat::Json {
        let v: Vec<serde_json::Value> = subs
            .iter()
            .enumerate()
            .map(|(i, (nqn, cs))| {
                let paths: Vec<serde_json::Value> = cs
                    .iter()
                    .map(|c| {
                        json!({"Name": c.name, "Transport": "rdma", "Address": address(c),
                               "State": c.state})
                    })
                    .collect();
                json!({"Name": format!("nvmf-subsys{i}"), "NQN": nqn, "Paths": paths})
            })
            .collect();
        println!("{}", json!({ "Subsystems": v }));
        return Ok(());
    }
    for (i, (nqn, cs)) in subs.iter().enumerate() {
        println!("nvmf-subsys{i} - NQN={nqn}");
        println!("\\");
        for c in cs {
            println!(" +- {} rdma {} {}", c.name, address(c), c.state);
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
    let mut n = 0;
    let req = Request::Disconnect {
        device: device.clone(),
        nqn: nqn.clone(),
        force,
    };
    match try_call::<nvmf_rdma::daemon::proto::DisconnectReply>(&req).await {
        Ok(Some(v)) => n += v.disconnected.len(),
        Ok(None) => {}
        // Nothing of the daemon's matched: the foreground ones may.
        Err(e)
            if e.downcast_ref::<ProtoError>()
                .is_some_and(|r| r.code == ErrorCode::NotFound) => {}
        Err(e) => return Err(e),
    }
    let pick = |j: &str| {
        nqn.as_deref()
            .is_some_and(|q| json_field(j, "subnqn") == Some(q))
            || device
                .as_deref()
                .is_some_and(|d| json_field(j, "name") == Some(d))
    };
    n += disconnect_foreground(pick, force).await?;
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
    let mut n = 0;
    let req = Request::DisconnectAll { force };
    if let Some(v) = try_call::<nvmf_rdma::daemon::proto::DisconnectReply>(&req).await? {
        n += v.disconnected.len();
    }
    n += disconnect_foreground(|_| true, force).await?;
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

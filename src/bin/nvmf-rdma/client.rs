//! The CLI as a client of the daemon: `connect`, `connect-all`, `list`, `list-subsys`,
//! `disconnect`, `disconnect-all`. Controllers held by `connect --foreground` (one socket each
//! in the run directory) are listed and disconnected too.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use nvmf_rdma::cli::support::{json_field, run_dir, Health};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

use crate::args::{ConnectMode, DaemonArgs, ExportArgs, ListFormat, Subsys};
use crate::config::params_of;
use crate::control::{disconnect_foreground, foreground_controllers};
use crate::daemon::start_background;
use crate::proto::{PROTOCOL_VERSION, SOCKET_NAME};
use nvmf_rdma::cli::units::human_bytes;

/// Longest answer line read from the daemon (a `list` of many controllers fits).
const MAX_ANSWER: u64 = 16 << 20;

pub(crate) fn daemon_socket() -> PathBuf {
    run_dir().join(SOCKET_NAME)
}

/// Why there is no daemon to talk to, with what to do.
fn no_daemon() -> anyhow::Error {
    anyhow::anyhow!(
        "no daemon runs in {} (start one: `nvmf-rdma daemon --background` or `systemctl start \
         nvmf-rdma`; NVMF_RDMA_RUN_DIR picks another run directory)",
        run_dir().display()
    )
}

/// The daemon answered `ok: false`: its code and its one-line message with the hint.
#[derive(Debug)]
pub(crate) struct DaemonRefused {
    pub(crate) code: String,
    message: String,
}

impl std::fmt::Display for DaemonRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for DaemonRefused {}

/// One connection to the daemon carrying any number of requests, in order (as `read -d`
/// sends its pieces).
pub(crate) struct Session {
    r: BufReader<tokio::io::Take<tokio::net::unix::OwnedReadHalf>>,
    w: tokio::net::unix::OwnedWriteHalf,
}

impl Session {
    /// Connect to the daemon's socket; `Ok(None)`: no daemon answers there.
    pub(crate) async fn try_open() -> Result<Option<Session>> {
        let path = daemon_socket();
        let s = match tokio::net::UnixStream::connect(&path).await {
            Ok(s) => s,
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => bail!(
                "cannot reach the daemon at {}: permission denied (it runs as another user: run \
                 this as that user or root, or use NVMF_RDMA_RUN_DIR for a daemon of your own)",
                path.display()
            ),
            Err(_) => return Ok(None),
        };
        let (r, w) = s.into_split();
        Ok(Some(Session {
            r: BufReader::new(r.take(MAX_ANSWER)),
            w,
        }))
    }

    pub(crate) async fn open() -> Result<Session> {
        Session::try_open().await?.ok_or_else(no_daemon)
    }

    /// Send one request (the version is added) and return the answer object, or its error
    /// as one line with its hint.
    pub(crate) async fn call(&mut self, mut req: Value) -> Result<Value> {
        req["version"] = json!(PROTOCOL_VERSION);
        self.w
            .write_all(format!("{req}\n").as_bytes())
            .await
            .context("send to the daemon")?;
        // Each answer may be up to MAX_ANSWER long.
        self.r.get_mut().set_limit(MAX_ANSWER);
        let mut line = String::new();
        self.r
            .read_line(&mut line)
            .await
            .context("read the daemon's answer")?;
        if line.is_empty() {
            bail!(
                "the daemon closed the connection without an answer (it is stopping, or serves \
                 only root and its own user)"
            );
        }
        let v: Value =
            serde_json::from_str(line.trim()).context("the daemon's answer is not JSON")?;
        if v["ok"] != json!(true) {
            let msg = v["error"]
                .as_str()
                .unwrap_or("the daemon refused the request");
            let message = match v["hint"].as_str() {
                Some(h) => format!("{msg} ({h})"),
                None => msg.to_string(),
            };
            return Err(DaemonRefused {
                code: v["code"].as_str().unwrap_or("").to_string(),
                message,
            }
            .into());
        }
        Ok(v)
    }
}

/// One request on a connection of its own. `Ok(None)`: no daemon answers on the socket.
pub(crate) async fn try_call(req: Value) -> Result<Option<Value>> {
    match Session::try_open().await? {
        Some(mut s) => s.call(req).await.map(Some),
        None => Ok(None),
    }
}

pub(crate) async fn call(req: Value) -> Result<Value> {
    try_call(req).await?.ok_or_else(no_daemon)
}

/// Names the daemon holds (for `connect --foreground` to avoid them); none without a daemon.
pub(crate) async fn daemon_controller_names() -> Vec<String> {
    match tokio::time::timeout(Duration::from_secs(2), try_call(json!({"op": "list"}))).await {
        Ok(Ok(Some(v))) => v["controllers"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| c["name"].as_str().map(String::from))
            .collect(),
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
        Err(e) => match try_call(json!({"op": "status"})).await {
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
    crate::host::options(&s)?;
    let p = params_of(&s, &x, &m);
    let req = json!({"op": "connect", "params": p});
    let v = match try_call(req.clone()).await? {
        Some(v) => v,
        None => {
            start_daemon(global).await?;
            call(req).await?
        }
    };
    let dev = v["device"].as_str().unwrap_or("?");
    if m.output == ListFormat::Json {
        println!("{}", json!({"device": dev, "controller": v["controller"]}));
        return Ok(());
    }
    println!("connecting to device: {dev}");
    print_exports(&v["controller"]);
    Ok(())
}

fn print_exports(c: &Value) {
    for x in c["exports"].as_array().into_iter().flatten() {
        match x["type"].as_str() {
            Some("nbd") => println!(
                "nbd: namespace {} at {} ({})",
                x["nsid"],
                x["address"].as_str().unwrap_or("?"),
                x["uri"].as_str().unwrap_or("?")
            ),
            Some("fuse") => println!(
                "fuse: namespace {} is {}",
                x["nsid"],
                x["file"].as_str().unwrap_or("?")
            ),
            _ => {}
        }
    }
}

/// Every controller: the daemon's, then `connect --foreground` ones.
async fn all_controllers() -> Result<(bool, Vec<Value>)> {
    let mut out = Vec::new();
    let daemon = try_call(json!({"op": "list"})).await?;
    let have_daemon = daemon.is_some();
    if let Some(v) = daemon {
        out.extend(v["controllers"].as_array().cloned().unwrap_or_default());
    }
    for (_, j) in foreground_controllers().await {
        if let Ok(mut v) = serde_json::from_str::<Value>(&j) {
            v["foreground"] = json!(true);
            out.push(v);
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
        let st = |k: &str| match &c[k] {
            Value::String(s) => s.clone(),
            Value::Null => "?".into(),
            v => v.to_string(),
        };
        let state = st("state");
        // The soft-HCA's UDP port only when it is not RoCEv2's 4791: the NVMe-oF port (what
        // -s gave) is the Svc column.
        let addr = match c["address"]
            .as_str()
            .map(str::parse::<std::net::SocketAddr>)
        {
            Some(Ok(a)) if a.port() != nvmf_rdma::hca::wire::ROCEV2_PORT => a.to_string(),
            Some(Ok(a)) => a.ip().to_string(),
            _ => st("traddr"),
        };
        // What the namespaces hold together, as `nvme list` shows a device's size.
        let capacity: u64 = c["namespaces"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|n| n["blocks"].as_u64().unwrap_or(0) * n["block_size"].as_u64().unwrap_or(0))
            .sum();
        println!(
            "{:<8} {:<40} {:<22} {:>5} {:>6} {:<10} {:>3} {:>10}",
            st("name"),
            st("subnqn"),
            addr,
            st("trsvcid"),
            st("cntlid"),
            state,
            st("io_queues"),
            human_bytes(capacity),
        );
        println!(
            "{:<8} {}",
            "",
            Health::from_json(&c.to_string()).describe(&state)
        );
        for x in c["exports"].as_array().into_iter().flatten() {
            let what = match x["type"].as_str() {
                Some("nbd") => format!(
                    "nbd {} ({} client(s))",
                    x["uri"].as_str().unwrap_or("?"),
                    x["clients"]
                ),
                Some("fuse") => format!(
                    "fuse {} ({} open)",
                    x["file"].as_str().unwrap_or("?"),
                    x["open_handles"]
                ),
                _ => continue,
            };
            println!("{:<8} export: {what}", "");
        }
        if c["foreground"] == json!(true) {
            println!("{:<8} held by a `connect --foreground` process", "");
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

/// `list-subsys`: controllers grouped by subsystem, as nvme-cli shows them.
pub(crate) async fn run_list_subsys(output: ListFormat) -> Result<()> {
    let (_, ctrls) = all_controllers().await?;
    let mut subs: Vec<(String, Vec<&Value>)> = Vec::new();
    for c in &ctrls {
        let nqn = c["subnqn"].as_str().unwrap_or("?").to_string();
        match subs.iter_mut().find(|(n, _)| *n == nqn) {
            Some((_, v)) => v.push(c),
            None => subs.push((nqn, vec![c])),
        }
    }
    let path = |c: &Value| {
        json!({
            "Name": c["name"], "Transport": "rdma",
            "Address": format!("traddr={},trsvcid={}", c["traddr"].as_str().unwrap_or("?"), c["trsvcid"]),
            "State": c["state"],
        })
    };
    if output == ListFormat::Json {
        let v: Vec<Value> = subs
            .iter()
            .enumerate()
            .map(|(i, (nqn, cs))| {
                json!({"Name": format!("nvmf-subsys{i}"), "NQN": nqn,
                       "Paths": cs.iter().map(|c| path(c)).collect::<Vec<_>>()})
            })
            .collect();
        println!("{}", json!({ "Subsystems": v }));
        return Ok(());
    }
    for (i, (nqn, cs)) in subs.iter().enumerate() {
        println!("nvmf-subsys{i} - NQN={nqn}");
        println!("\\");
        for c in cs {
            let p = path(c);
            println!(
                " +- {} rdma {} {}",
                p["Name"].as_str().unwrap_or("?"),
                p["Address"].as_str().unwrap_or("?"),
                p["State"].as_str().unwrap_or("?")
            );
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
    let req = json!({"op": "disconnect", "nqn": nqn, "device": device, "force": force});
    match try_call(req).await {
        Ok(Some(v)) => n += v["disconnected"].as_array().map_or(0, |a| a.len()),
        Ok(None) => {}
        // Nothing of the daemon's matched: the foreground ones may.
        Err(e)
            if e.downcast_ref::<DaemonRefused>()
                .is_some_and(|r| r.code == "not-found") => {}
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
    if let Some(v) = try_call(json!({"op": "disconnect-all", "force": force})).await? {
        n += v["disconnected"].as_array().map_or(0, |a| a.len());
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
    let req = match &given {
        Some((s, m)) => {
            json!({"op": "connect-all", "params": params_of(s, &ExportArgs::default(), m)})
        }
        None => json!({"op": "connect-all"}),
    };
    let v = match try_call(req.clone()).await? {
        Some(v) => v,
        None => {
            start_daemon(global).await?;
            call(req).await?
        }
    };
    let results = v["results"].as_array().cloned().unwrap_or_default();
    if output == ListFormat::Json {
        println!("{}", json!({ "results": results }));
    } else {
        for r in &results {
            let nqn = r["nqn"].as_str().unwrap_or("?");
            match r["status"].as_str() {
                Some("connected") => println!(
                    "connecting to device: {} ({nqn})",
                    r["device"].as_str().unwrap_or("?")
                ),
                Some("already-connected") => println!("already connected: {nqn}"),
                _ => eprintln!(
                    "failed: {nqn} at {}: {}",
                    r["traddr"].as_str().unwrap_or("?"),
                    r["error"].as_str().unwrap_or("?")
                ),
            }
        }
    }
    if results.iter().any(|r| r["status"] == json!("failed")) {
        bail!("some connections failed");
    }
    Ok(())
}

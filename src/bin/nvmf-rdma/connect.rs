//! `connect`: hold a controller and its exports until a stop signal or `disconnect`.

use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::client::daemon_controller_names;
use crate::{args::*, signals::*};
use anyhow::{bail, Context, Result};
use nvmf_rdma::cli::host::*;
use nvmf_rdma::cli::support::run_dir;
use nvmf_rdma::daemon::control::{make_run_dir, same_user, serve_control_client, CONTROL_TIMEOUT};
use nvmf_rdma::daemon::exports::{report_state_changes, start_exports};
use nvmf_rdma::daemon::stop::{PendingStop, FORCE_WINDOW};
use nvmf_rdma::daemon::usage::{holders, in_use_message, Probe};
use nvmf_rdma::harness::hca_perf;
use nvmf_rdma::reconnect::CtrlState;
use nvmf_rdma::transport::{ConnectOptions, CtrlStatus};

pub(crate) async fn run_connect(s: Subsys, x: ExportArgs) -> Result<()> {
    let mut signals = StopSignals::new()?;
    let c = tokio::select! {
        c = connect(&s) => Arc::new(c?),
        sig = signals.recv() => bail!("{sig} while connecting to {}: nothing was connected", s.nqn),
    };
    // The control socket first: once the exports serve, clients may take every file
    // descriptor the process has (the NBD listener outlives that; a bind would not).
    let dir = run_dir();
    make_run_dir(&dir)?;
    // Names the daemon holds are taken too (it skips ours the same way).
    let daemon_names = daemon_controller_names().await;
    let mut n = 0;
    let (name, path) = loop {
        let name = format!("nvmf{n}");
        let p = dir.join(format!("{name}.sock"));
        if daemon_names.contains(&name) {
            n += 1;
            continue;
        }
        if !p.exists() || tokio::net::UnixStream::connect(&p).await.is_err() {
            let _ = std::fs::remove_file(&p);
            break (name, p);
        }
        n += 1;
    };
    let listener = tokio::net::UnixListener::bind(&path)
        .with_context(|| format!("bind {}", path.display()))?;
    // Whoever can open the socket can disconnect the controller: ours alone, whatever the
    // umask (and the directory is 0700 too).
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("chmod 0600 {}", path.display()))?;
    let exports =
        match start_exports(&nvmf_rdma::multipath::Subsystem::single(c.clone()), &s, &x).await {
            Ok(e) => e,
            Err(e) => {
                drop(listener);
                let _ = std::fs::remove_file(&path);
                return Err(e);
            }
        };
    for l in exports.describe() {
        println!("{l}");
    }
    println!(
        "{name}: connected to {} at {} (cntlid {})",
        s.nqn, s.fabric.traddr, c.cntlid
    );
    for ns in c.namespaces() {
        println!(
            "  namespace {}: {} blocks of {} B ({})",
            ns.nsid,
            ns.blocks,
            ns.block_size,
            hca_perf::human(ns.bytes() as usize)
        );
    }
    let info = || ctrl_info(&name, &s, &c);
    let watcher = tokio::spawn(report_state_changes(
        name.clone(),
        c.watch_status(),
        Arc::new(nvmf_rdma::daemon::Stdout),
    ));
    let (stop_tx, mut stop_rx) = tokio::sync::mpsc::channel(4);
    let mut clients = tokio::task::JoinSet::new();
    let mut status = c.watch_status();
    let probe = exports.probe();
    let mut pending = PendingStop::default();
    // The controller gave up (ctrl_loss_tmo): kept while its export is in use.
    let mut dead: Option<Option<CtrlStatus>> = None;
    // The same rule as the daemon's: a stop (signal or `disconnect`) is refused while an
    // export is in use, unless forced; a refused stop signal stays pending.
    let forced = loop {
        tokio::select! {
            sig = signals.recv() => {
                let now = Instant::now();
                let force = pending.forces(now);
                match in_use(&name, &probe).await {
                    Some((m, _)) if force => {
                        println!("{name}: {sig}: forced while in use: {m}; its users get I/O errors from now on");
                        break true;
                    }
                    Some((m, h)) => {
                        pending.refused(now);
                        println!("{name}: {sig}: not stopping: {m}; {h}; the stop completes once it is released; another stop signal within {} s forces it", FORCE_WINDOW.as_secs());
                    }
                    None => {
                        println!("{name}: {sig}: disconnecting");
                        break false;
                    }
                }
            }
            Some((force, reply)) = stop_rx.recv() => {
                let reply: tokio::sync::oneshot::Sender<Result<(), String>> = reply;
                match in_use(&name, &probe).await {
                    Some((m, _)) if force => {
                        println!("{name}: disconnect forced while in use: {m}; its users get I/O errors from now on");
                        let _ = reply.send(Ok(()));
                        break true;
                    }
                    Some((m, h)) => {
                        let _ = reply.send(Err(format!("{m} ({h}; or disconnect --force)")));
                    }
                    None => {
                        let _ = reply.send(Ok(()));
                        break false;
                    }
                }
            }
            _ = pending.tick() => {
                // The counters first; the scan of holders runs once they read zero, or
                // when it is time to say again who holds the exports.
                let due = pending.report_due(Instant::now());
                if probe.busy_now() && !due {
                    continue;
                }
                match in_use(&name, &probe).await {
                    None => {
                        println!("{name}: exports released; disconnecting");
                        break false;
                    }
                    Some((m, h)) if due => println!("{name}: stop pending: {m}; {h}"),
                    Some(_) => {}
                }
            }
            st = status.wait_for(|s| s.state() == CtrlState::Dead), if dead.is_none() => {
                dead = Some(st.map(|s| *s).ok());
                if !probe.busy_now() {
                    break false;
                }
                pending.hold(Instant::now());
                println!("{name}: dead; kept while its export is in use (its users get I/O errors), until it is released or `disconnect --force`");
            }
            conn = listener.accept() => {
                let Ok((stream, _)) = conn else {
                    // Out of descriptors and the like: pause rather than spin; a signal that
                    // comes meanwhile waits in its stream.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                };
                if !same_user(&stream) {
                    continue;
                }
                clients.spawn(serve_control_client(stream, info().to_json(), stop_tx.clone()));
            }
            Some(_) = clients.join_next(), if !clients.is_empty() => {}
        }
    };
    // The client that asked for the disconnect writes its "ok" now: let it (and any other,
    // each bounded by its own read timeout) finish rather than cut the answer off.
    let _ = tokio::time::timeout(CONTROL_TIMEOUT, async {
        while clients.join_next().await.is_some() {}
    })
    .await;
    clients.abort_all();
    watcher.abort();
    // Deleting ends at once whatever recovery is doing; a second signal still wins.
    tokio::select! {
        _ = exports.release(&c, forced) => {}
        sig = signals.recv() => {
            let _ = std::fs::remove_file(&path);
            bail!("{sig}: stopped before {name} finished disconnecting")
        }
    }
    // Last: `nvmf-rdma disconnect` waits for the socket to go as the sign that it is done.
    drop(listener);
    let _ = std::fs::remove_file(&path);
    match dead {
        None => {
            println!("{name}: disconnected");
            Ok(())
        }
        // Like Linux deleting a controller that gave up: the holder ends, with an error.
        Some(st) => {
            let why = st
                .and_then(|s| s.machine.fail_reason)
                .map_or("it gave up", |r| r.name());
            bail!("{name}: the controller is dead ({why}); its pending I/O failed. Connect again once the target is reachable")
        }
    }
}

/// Who holds the exports `p` looks at, as one line naming them and one saying how to
/// release them; `None` when nothing does.
async fn in_use(name: &str, p: &Probe) -> Option<(String, String)> {
    let h = holders(p).await;
    (!h.is_empty()).then(|| in_use_message(name, &h))
}

/// `discover`: the discovery log of a discovery controller, nvme-cli style.
pub(crate) async fn run_discover(f: Fabric, output: ListFormat) -> Result<()> {
    check_transport(&f)?;
    let mut o = ConnectOptions::new(f.traddr, nvmf_rdma::nvme::fabrics::DISCOVERY_NQN);
    o.trsvcid = f.trsvcid;
    apply_system_host_ids(&mut o, std::path::Path::new(NVME_CONF_DIR));
    if let Some(h) = &f.hostnqn {
        o.hostnqn = h.clone();
    }
    let entries = discover_on(&f, o, "discovery failed").await?;
    if output == ListFormat::Json {
        // nvme-cli's field names and words.
        let records: Vec<serde_json::Value> = entries
            .iter()
            .map(|e| {
                serde_json::json!({
                    "trtype": "rdma",
                    "adrfam": if e.adrfam == 2 { "ipv6" } else { "ipv4" },
                    "subtype": match e.subtype {
                        1 => "discovery subsystem referral",
                        3 => "current discovery subsystem",
                        _ => "nvme subsystem",
                    },
                    "portid": e.portid,
                    "trsvcid": e.trsvcid.text().trim(),
                    "subnqn": e.subnqn.text().trim(),
                    "traddr": e.traddr.text().trim(),
                })
            })
            .collect();
        println!("{}", serde_json::json!({ "records": records }));
        return Ok(());
    }
    println!("Discovery Log Number of Records {}", entries.len());
    for (i, e) in entries.iter().enumerate() {
        println!("=====Discovery Log Entry {i}======");
        println!("trtype:  rdma");
        println!("adrfam:  {}", if e.adrfam == 2 { "ipv6" } else { "ipv4" });
        println!("portid:  {}", e.portid);
        println!("trsvcid: {}", e.trsvcid.text().trim());
        println!("subnqn:  {}", e.subnqn.text());
        println!("traddr:  {}", e.traddr.text().trim());
    }
    Ok(())
}

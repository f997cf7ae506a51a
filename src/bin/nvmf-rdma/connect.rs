//! `connect`: hold a controller and its exports until a stop signal or `disconnect`.

use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::client::daemon_controller_names;
use crate::{args::*, control::*, host::*, signals::*};
use anyhow::{bail, Context, Result};
use nvmf_rdma::cli::support::{run_dir, Health};
use nvmf_rdma::cli::units::*;
use nvmf_rdma::export;
use nvmf_rdma::harness::hca_perf;
use nvmf_rdma::reconnect::CtrlState;
use nvmf_rdma::transport::{ConnectOptions, Controller, CtrlStatus};

use crate::usage::{holders, in_use_message, Probe};

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
    let exports = match start_exports(&c, &s, &x).await {
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
    let watcher = tokio::spawn(report_state_changes(name.clone(), c.watch_status()));
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

/// Print the controller's state changes as `connect` holds it: failures, attempts, LIVE
/// again, given up.
pub(crate) async fn report_state_changes(
    name: String,
    mut rx: tokio::sync::watch::Receiver<nvmf_rdma::transport::CtrlStatus>,
) {
    let mut last = (rx.borrow().machine.state, rx.borrow().machine.attempt);
    while rx.changed().await.is_ok() {
        let st = *rx.borrow_and_update();
        let m = st.machine;
        let (was, _) = last;
        if (m.state, m.attempt) == last {
            continue;
        }
        last = (m.state, m.attempt);
        let (state, h) = Health::from_status(&st);
        match m.state {
            CtrlState::Live if was != CtrlState::Live => println!(
                "{name}: live again (recovery {}{})",
                m.recoveries,
                st.last_recovery.map_or(String::new(), |d| format!(
                    ", {} after the failure",
                    human_dur(d)
                ))
            ),
            CtrlState::Resetting | CtrlState::Connecting => {
                if matches!(was, CtrlState::Live | CtrlState::New) {
                    println!(
                        "{name}: {}; recovering",
                        m.cause.map_or("failed", |c| c.name())
                    );
                }
                if m.attempt > 0 {
                    println!("{name}: reconnecting, {}", h.attempts());
                }
            }
            CtrlState::Deleting | CtrlState::Dead if was != m.state => {
                println!("{name}: {state}: {}", h.describe(&state));
            }
            _ => {}
        }
    }
}

/// The exports `connect` runs next to the controller (stopped before it disconnects).
pub(crate) struct Exports {
    pub(crate) nbd: Option<tokio::task::JoinHandle<()>>,
    /// Where the NBD export listens, and its counters (clients connected now).
    pub(crate) nbd_at: Option<(export::ExportAddr, Arc<export::NbdStats>)>,
    pub(crate) fuse: Option<export::FuseMount>,
    /// The namespace the exports serve first.
    pub(crate) nsid: u32,
    /// The namespaces both exports serve (`ns<NSID>`: a FUSE file, an NBD export name);
    /// namespaces the controller reports later join it.
    pub(crate) set: Option<export::DevSet>,
}

impl Exports {
    /// What `connect` prints about the exports once they are ready.
    pub(crate) fn describe(&self) -> Vec<String> {
        let mut v = Vec::new();
        if let Some((a, _)) = &self.nbd_at {
            v.push(format!(
                "nbd: serving namespace {} at {a} ({})",
                self.nsid,
                a.uri()
            ));
        }
        if let Some(m) = &self.fuse {
            v.push(format!(
                "fuse: namespace {} is {}",
                self.nsid,
                m.file().display()
            ));
        }
        v
    }

    /// Take the exports down and delete the controller, whoever still holds it (a lazily
    /// detached FUSE mount keeps its files until its last user lets go). The exports are
    /// fenced first: every request from then on fails with EIO at once, and nothing is
    /// acknowledged after this returns. With `force`, a FUSE mount still in use is detached
    /// lazily (MNT_DETACH): it leaves the mount table now instead of lingering dead.
    pub(crate) async fn release(self, c: &Controller, force: bool) {
        let set = self.set.clone();
        if let Some(s) = &set {
            s.close();
        }
        self.stop_with(force).await;
        c.delete().await;
        if let Some(s) = set {
            s.fence().await;
        }
    }

    /// Stop the NBD server and unmount the FUSE file system (detached lazily when busy and
    /// `detach_busy`).
    async fn stop_with(self, detach_busy: bool) {
        if let Some(t) = self.nbd {
            t.abort();
            let _ = t.await;
        }
        if let Some(m) = self.fuse {
            let _ = tokio::task::spawn_blocking(move || {
                let mp = m.mountpoint().to_path_buf();
                if let Err(e) = m.unmount() {
                    eprintln!("{e}");
                    if detach_busy {
                        detach(&mp);
                    }
                }
            })
            .await;
        }
    }
}

/// `umount -l MOUNTPOINT`.
fn detach(mp: &std::path::Path) {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(mp.as_os_str().as_bytes()) else {
        return;
    };
    // SAFETY: a valid NUL-terminated path; umount2 touches no memory of ours.
    if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } == 0 {
        eprintln!(
            "{}: detached (lazy unmount); it goes when its last user lets go",
            mp.display()
        );
    } else {
        eprintln!(
            "{}: lazy unmount failed: {}",
            mp.display(),
            std::io::Error::last_os_error()
        );
    }
}

pub(crate) async fn start_exports(
    c: &Arc<Controller>,
    s: &Subsys,
    x: &ExportArgs,
) -> Result<Exports> {
    let mut out = Exports {
        nbd: None,
        nbd_at: None,
        fuse: None,
        nsid: s.nsid,
        set: None,
    };
    if x.nbd.is_none() && x.fuse.is_none() {
        return Ok(out);
    }
    let dev = Arc::new(export::BlockDev::new(c.clone(), s.nsid)?);
    let set = export::DevSet::one(&format!("ns{}", s.nsid), dev)?;
    out.set = Some(set.clone());
    if let Some(addr) = &x.nbd {
        let l =
            export::NbdListener::bind_with(addr, export::NbdLimits::default(), x.nbd_allow_remote)
                .await?;
        out.nbd_at = Some((l.addr().clone(), l.stats()));
        let set = set.clone();
        out.nbd = Some(tokio::spawn(async move {
            if let Err(e) = l.serve_set(set).await {
                eprintln!("nbd: {e}");
            }
        }));
    }
    if let Some(mp) = &x.fuse {
        let m = export::mount_fuse_set(set, tokio::runtime::Handle::current(), mp)?;
        out.fuse = Some(m);
    }
    Ok(out)
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

//! A controller held by a process of its own (`connect --foreground`) instead of the daemon:
//! a control socket of its own in the run directory (`list` and `disconnect` find it there),
//! its exports, and the daemon's stop rule. A stop (a stop signal or `disconnect`) is refused
//! while an export is in use unless forced; a refused stop signal stays pending and completes
//! once the exports are released; a controller that gave up is kept while its export is in
//! use.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tokio::net::UnixListener;
use tokio::sync::{mpsc, oneshot, Semaphore};
use tokio::task::JoinSet;

use crate::cli::args::{ExportArgs, Subsys};
use crate::cli::host::ctrl_info;
use crate::daemon::control::{
    make_run_dir, same_user, serve_control_client, StopAsk, CONTROL_TIMEOUT,
};
use crate::daemon::exports::{report_state_changes, start_exports, Exports};
use crate::daemon::local::daemon_names;
use crate::daemon::server::MAX_CLIENTS;
use crate::daemon::stop::{PendingStop, FORCE_WINDOW};
use crate::daemon::usage::{holders, in_use_message, Probe};
use crate::daemon::{say, Report};
use crate::reconnect::CtrlState;
use crate::transport::{Controller, CtrlStatus};

/// A controller, its exports and its control socket, held until a stop.
pub struct Foreground {
    name: String,
    path: PathBuf,
    listener: UnixListener,
    ctrl: Arc<Controller>,
    sub: Subsys,
    exports: Exports,
}

/// How the hold ended: `forced` when an export was still in use (its users get I/O errors).
struct Stop {
    forced: bool,
}

/// What the hold carries from one turn to the next.
struct Holding {
    out: Report,
    probe: Probe,
    pending: PendingStop,
    /// The controller gave up (ctrl_loss_tmo): its last status, kept while an export is used.
    dead: Option<Option<CtrlStatus>>,
    clients: JoinSet<()>,
    /// One permit per client served now, at most [`MAX_CLIENTS`].
    slots: Arc<Semaphore>,
    stop_tx: mpsc::Sender<StopAsk>,
}

impl Foreground {
    /// Hold `ctrl` (connected to `sub`) under the first free name of `run_dir` (`nvmf0`,
    /// `nvmf1`, ...: not one the daemon there holds, nor one a live `connect --foreground`
    /// serves), its control socket bound (0600), and the exports `x` asks for started.
    pub async fn start(
        ctrl: Arc<Controller>,
        sub: &Subsys,
        x: &ExportArgs,
        run_dir: &Path,
    ) -> Result<Foreground> {
        // The control socket first: once the exports serve, clients may take every file
        // descriptor the process has (the NBD listener outlives that; a bind would not).
        make_run_dir(run_dir)?;
        let (name, path) = free_name(run_dir, &daemon_names(run_dir).await).await;
        let listener =
            UnixListener::bind(&path).with_context(|| format!("bind {}", path.display()))?;
        // Whoever can open the socket can disconnect the controller: ours alone, whatever the
        // umask (and the directory is 0700 too).
        let held = std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
            .with_context(|| format!("chmod 0600 {}", path.display()));
        let exports = match held {
            Ok(()) => {
                start_exports(&crate::multipath::Subsystem::single(ctrl.clone()), sub, x).await
            }
            Err(e) => Err(e),
        };
        match exports {
            Ok(exports) => Ok(Foreground {
                name,
                path,
                listener,
                ctrl,
                sub: sub.clone(),
                exports,
            }),
            Err(e) => {
                drop(listener);
                let _ = std::fs::remove_file(&path);
                Err(e)
            }
        }
    }

    /// The name `list` and `disconnect -d` know the controller by.
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn controller(&self) -> &Arc<Controller> {
        &self.ctrl
    }

    pub fn exports(&self) -> &Exports {
        &self.exports
    }

    /// Hold the controller until a stop: a stop signal (by name, from `signals`), a
    /// `disconnect` on the control socket, or its death once nothing uses its exports; then
    /// release the exports, delete the controller and remove the socket. State changes and
    /// refusals go to `out`. An error when the controller died (its pending I/O failed), or
    /// when another stop signal cut the disconnect short.
    pub async fn run(self, signals: &mut mpsc::Receiver<&'static str>, out: Report) -> Result<()> {
        let watcher = tokio::spawn(report_state_changes(
            self.name.clone(),
            self.ctrl.watch_status(),
            out.clone(),
        ));
        let (stop_tx, mut stop_rx) = mpsc::channel(4);
        let mut h = Holding {
            out,
            probe: self.exports.probe(),
            pending: PendingStop::default(),
            dead: None,
            clients: JoinSet::new(),
            slots: Arc::new(Semaphore::new(MAX_CLIENTS)),
            stop_tx,
        };
        let Stop { forced } = self.hold(signals, &mut stop_rx, &mut h).await;
        // The client that asked for the disconnect writes its "ok" now: let it (and any other,
        // each bounded by its own read timeout) finish rather than cut the answer off.
        let _ = tokio::time::timeout(CONTROL_TIMEOUT, async {
            while h.clients.join_next().await.is_some() {}
        })
        .await;
        h.clients.abort_all();
        watcher.abort();
        let Foreground {
            name,
            path,
            listener,
            ctrl,
            exports,
            ..
        } = self;
        // Deleting ends at once whatever recovery is doing; a second signal still wins.
        tokio::select! {
            _ = exports.release(&ctrl, forced) => {}
            Some(sig) = signals.recv() => {
                let _ = std::fs::remove_file(&path);
                bail!("{sig}: stopped before {name} finished disconnecting")
            }
        }
        // Last: `nvmf-rdma disconnect` waits for the socket to go as the sign that it is done.
        drop(listener);
        let _ = std::fs::remove_file(&path);
        match h.dead {
            None => {
                say!(h.out, "{name}: disconnected");
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

    /// The turns of the hold, each handled by one of the `on_*` functions, until one stops.
    async fn hold(
        &self,
        signals: &mut mpsc::Receiver<&'static str>,
        stop_rx: &mut mpsc::Receiver<StopAsk>,
        h: &mut Holding,
    ) -> Stop {
        let mut status = self.ctrl.watch_status();
        loop {
            let end = tokio::select! {
                Some(sig) = signals.recv() => self.on_signal(sig, h).await,
                Some((force, reply)) = stop_rx.recv() => self.on_disconnect(force, reply, h).await,
                _ = h.pending.tick() => self.on_tick(h).await,
                // The status is copied out at once: a watch guard held across the other arms'
                // awaits would keep this future from moving between threads.
                st = async { status.wait_for(|s| s.state() == CtrlState::Dead).await.map(|s| *s).ok() },
                    if h.dead.is_none() => self.on_dead(st, h),
                conn = self.listener.accept() => {
                    let Ok((stream, _)) = conn else {
                        // Out of descriptors and the like: pause rather than spin; a signal
                        // that comes meanwhile waits in its channel.
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    };
                    if same_user(&stream) {
                        self.serve_client(stream, h);
                    }
                    None
                }
                Some(_) = h.clients.join_next(), if !h.clients.is_empty() => None,
            };
            if let Some(end) = end {
                return end;
            }
        }
    }

    /// A control client in a task of its own, up to [`MAX_CLIENTS`] at once; one more is told
    /// it is busy (a fresh socket's buffer takes the line) and closed, so a flood of clients
    /// costs nothing that stays.
    fn serve_client(&self, stream: tokio::net::UnixStream, h: &mut Holding) {
        let Ok(permit) = h.slots.clone().try_acquire_owned() else {
            let busy = format!("error: busy: {MAX_CLIENTS} clients already; try again\n");
            let _ = stream.try_write(busy.as_bytes());
            return;
        };
        let info = ctrl_info(&self.name, &self.sub, &self.ctrl).to_json();
        let stop = h.stop_tx.clone();
        h.clients.spawn(async move {
            serve_control_client(stream, info, stop).await;
            drop(permit);
        });
    }

    /// A stop signal: stop, or refuse (an export is in use) and keep the stop pending; a
    /// second signal within [`FORCE_WINDOW`] of a refusal forces it.
    async fn on_signal(&self, sig: &str, h: &mut Holding) -> Option<Stop> {
        let name = &self.name;
        let now = Instant::now();
        let force = h.pending.forces(now);
        match in_use(name, &h.probe).await {
            Some((m, _)) if force => {
                say!(
                    h.out,
                    "{name}: {sig}: forced while in use: {m}; its users get I/O errors from now on"
                );
                Some(Stop { forced: true })
            }
            Some((m, r)) => {
                h.pending.refused(now);
                say!(h.out, "{name}: {sig}: not stopping: {m}; {r}; the stop completes once it is released; another stop signal within {} s forces it", FORCE_WINDOW.as_secs());
                None
            }
            None => {
                say!(h.out, "{name}: {sig}: disconnecting");
                Some(Stop { forced: false })
            }
        }
    }

    /// `disconnect` on the control socket: refused (the answer names the holders) while an
    /// export is in use, unless forced.
    async fn on_disconnect(
        &self,
        force: bool,
        reply: oneshot::Sender<Result<(), String>>,
        h: &mut Holding,
    ) -> Option<Stop> {
        let name = &self.name;
        match in_use(name, &h.probe).await {
            Some((m, _)) if force => {
                say!(h.out, "{name}: disconnect forced while in use: {m}; its users get I/O errors from now on");
                let _ = reply.send(Ok(()));
                Some(Stop { forced: true })
            }
            Some((m, r)) => {
                let _ = reply.send(Err(format!("{m} ({r}; or disconnect --force)")));
                None
            }
            None => {
                let _ = reply.send(Ok(()));
                Some(Stop { forced: false })
            }
        }
    }

    /// A pending stop looks again whether the exports were released: the counters first;
    /// the scan of holders runs once they read zero, or when it is time to say again who
    /// holds the exports.
    async fn on_tick(&self, h: &mut Holding) -> Option<Stop> {
        let name = &self.name;
        let due = h.pending.report_due(Instant::now());
        if h.probe.busy_now() && !due {
            return None;
        }
        match in_use(name, &h.probe).await {
            None => {
                say!(h.out, "{name}: exports released; disconnecting");
                Some(Stop { forced: false })
            }
            Some((m, r)) if due => {
                say!(h.out, "{name}: stop pending: {m}; {r}");
                None
            }
            Some(_) => None,
        }
    }

    /// The controller gave up: it goes now, or once its exports are released.
    fn on_dead(&self, st: Option<CtrlStatus>, h: &mut Holding) -> Option<Stop> {
        h.dead = Some(st);
        if !h.probe.busy_now() {
            return Some(Stop { forced: false });
        }
        h.pending.hold(Instant::now());
        say!(h.out, "{}: dead; kept while its export is in use (its users get I/O errors), until it is released or `disconnect --force`", self.name);
        None
    }
}

/// The first `nvmfN` of `run_dir` not in `taken` whose socket no live process serves (a
/// stale socket file is removed), with that socket's path.
async fn free_name(run_dir: &Path, taken: &[String]) -> (String, PathBuf) {
    let mut n = 0;
    loop {
        let name = format!("nvmf{n}");
        let p = run_dir.join(format!("{name}.sock"));
        n += 1;
        if taken.contains(&name) {
            continue;
        }
        if !p.exists() || tokio::net::UnixStream::connect(&p).await.is_err() {
            let _ = std::fs::remove_file(&p);
            return (name, p);
        }
    }
}

/// Who holds the exports `p` looks at, as one line naming them and one saying how to
/// release them; `None` when nothing does.
async fn in_use(name: &str, p: &Probe) -> Option<(String, String)> {
    let h = holders(p).await;
    (!h.is_empty()).then(|| in_use_message(name, &h))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::support::json_field;
    use crate::daemon::control::ask;
    use crate::daemon::Reporter;
    use crate::harness::nvmf_perf::{connect_host, LocalTarget, DEMO_NQN};
    use std::sync::Mutex;

    #[derive(Default)]
    struct Lines(Mutex<Vec<String>>);

    impl Reporter for Lines {
        fn say(&self, line: &str) {
            self.0.lock().unwrap().push(line.to_string());
        }
    }

    /// A controller of `t` held in `dir`, its hold running with `out`.
    async fn hold_in(
        t: &LocalTarget,
        dir: &Path,
        out: Report,
    ) -> (PathBuf, tokio::task::JoinHandle<Result<()>>) {
        let sub = t.subsys();
        let c = Arc::new(connect_host(t.addr, DEMO_NQN, 1, 32).await.unwrap());
        let held = Foreground::start(c, &sub, &ExportArgs::default(), dir)
            .await
            .unwrap();
        let sock = dir.join(format!("{}.sock", held.name()));
        let run = tokio::spawn(async move {
            let (_signal, mut signals) = mpsc::channel(1);
            held.run(&mut signals, out).await
        });
        (sock, run)
    }

    fn run_dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("nvmf-fg-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        make_run_dir(&dir).unwrap();
        dir
    }

    /// In process, no child: the hold takes the first free name (a stale socket file does
    /// not keep one), answers `info` and `disconnect` on its socket, and removes it at the end.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_held_controller_answers_on_its_socket_until_disconnect_ends_the_hold() {
        let t = LocalTarget::start(16 << 20, 9).unwrap();
        let dir = run_dir("answers");
        std::fs::write(dir.join("nvmf0.sock"), "").unwrap();
        let lines = Arc::new(Lines::default());
        let (sock, run) = hold_in(&t, &dir, lines.clone()).await;
        assert_eq!(sock, dir.join("nvmf0.sock"));
        let info = ask(&sock, "info").await.expect("an info answer");
        assert_eq!(json_field(&info, "name"), Some("nvmf0"), "{info}");
        assert_eq!(json_field(&info, "subnqn"), Some(DEMO_NQN), "{info}");
        assert_eq!(
            ask(&sock, "what").await.as_deref(),
            Some("error: unknown request")
        );
        assert_eq!(ask(&sock, "disconnect").await.as_deref(), Some("ok"));
        run.await.unwrap().unwrap();
        assert!(!sock.exists());
        assert_eq!(*lines.0.lock().unwrap(), ["nvmf0: disconnected"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Clients that connect and send nothing hold a task each until their line times out:
    /// past [`MAX_CLIENTS`] of them, the next is told at once and closed, and the hold
    /// still answers once they have gone.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn idle_control_clients_past_the_limit_are_told_busy_at_once() {
        use tokio::io::AsyncReadExt;
        let t = LocalTarget::start(16 << 20, 9).unwrap();
        let dir = run_dir("busy");
        let (sock, run) = hold_in(&t, &dir, Arc::new(Lines::default())).await;
        let mut idle = Vec::new();
        for _ in 0..MAX_CLIENTS {
            idle.push(tokio::net::UnixStream::connect(&sock).await.unwrap());
        }
        let mut s = tokio::net::UnixStream::connect(&sock).await.unwrap();
        let mut line = String::new();
        let read = s.read_to_string(&mut line);
        let closed = tokio::time::timeout(CONTROL_TIMEOUT / 2, read)
            .await
            .is_ok();
        assert!(
            closed && line.starts_with("error: busy"),
            "{closed} {line:?}"
        );
        // Gone, they free their places as their tasks end.
        drop(idle);
        let deadline = Instant::now() + 2 * CONTROL_TIMEOUT;
        while ask(&sock, "disconnect").await.as_deref() != Some("ok") {
            assert!(Instant::now() < deadline, "still busy");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        run.await.unwrap().unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

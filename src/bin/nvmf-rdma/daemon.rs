//! `nvmf-rdma daemon`: the process around the library's daemon ([`nvmf_rdma::daemon`]): one
//! per run directory (a lock), its socket, signals forwarded (SIGINT and SIGTERM stop it,
//! SIGHUP reloads the config file), the log with times, sd_notify, and `--background`.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use nvmf_rdma::cli::support::run_dir;
use nvmf_rdma::daemon::config::config_dir;
use nvmf_rdma::daemon::control::make_run_dir;
use nvmf_rdma::daemon::local::stop_daemon;
use nvmf_rdma::daemon::pid_lock::PidLock;
use nvmf_rdma::daemon::proto::{one_line, SOCKET_NAME};
use nvmf_rdma::daemon::{Daemon, DaemonConfig, Reporter, Signal, CLIENT_TIMEOUT};

use crate::args::DaemonArgs;
use crate::sdnotify;
use crate::signals::StopSignals;

/// Whether [`log_line`] puts the time in front (set in the daemon started by `--background`).
static LOG_TIME: AtomicBool = AtomicBool::new(false);

/// The environment variable `--background` sets for the daemon it starts.
const LOG_TIME_ENV: &str = "NVMF_RDMA_LOG_TIME";

pub(crate) fn log_line(args: std::fmt::Arguments<'_>) {
    if LOG_TIME.load(Ordering::Relaxed) {
        println!(
            "{} {args}",
            nvmf_rdma::cli::units::utc_stamp(std::time::SystemTime::now())
        );
    } else {
        println!("{args}");
    }
}

/// The daemon's [`Reporter`]: its log, and systemd's notify socket.
struct Log;

impl Reporter for Log {
    fn say(&self, line: &str) {
        log_line(format_args!("{line}"));
    }

    fn notify(&self, state: &str) {
        let _ = sdnotify::notify(state);
    }
}

/// How long `daemon --background` waits for the daemon it started to be ready.
const READY_TIMEOUT: Duration = Duration::from_secs(120);

/// `nvmf-rdma daemon`.
pub(crate) fn run_daemon(a: DaemonArgs, global: Vec<String>) -> Result<()> {
    if a.stop {
        return stop_running(a.force);
    }
    if a.background {
        // Already running: what was asked for holds (provisioning scripts run this twice).
        if let Some(pid) = PidLock::holder(&run_dir()) {
            println!(
                "nvmf-rdma daemon already runs (pid {pid}); socket {}",
                run_dir().join(SOCKET_NAME).display()
            );
            return Ok(());
        }
        return start_background(&a, &global).map(|pid| {
            println!(
                "nvmf-rdma daemon running (pid {pid}); socket {}",
                run_dir().join(SOCKET_NAME).display()
            )
        });
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let r = rt.block_on(serve(a));
    if let Err(e) = &r {
        let _ = sdnotify::notify(&format!("STATUS=error: {}", one_line(&format!("{e:#}"))));
    }
    // FUSE threads and recovery tasks have been stopped; do not wait on stragglers.
    rt.shutdown_timeout(Duration::from_secs(2));
    r
}

/// `daemon --stop`: ask the daemon to stop and wait until it is gone.
fn stop_running(force: bool) -> Result<()> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(stop_daemon(&run_dir(), force))?;
    println!("daemon stopped");
    Ok(())
}

async fn serve(a: DaemonArgs) -> Result<()> {
    if std::env::var_os(LOG_TIME_ENV).is_some() {
        LOG_TIME.store(true, Ordering::Relaxed);
    }
    // SIGHUP reloads the config file; SIGINT and SIGTERM stop.
    let mut signals = StopSignals::new()?.forward(|sig| match sig {
        "SIGHUP" => Signal::Reload,
        stop => Signal::Stop(stop),
    });
    let d = Daemon::new(DaemonConfig {
        run_dir: run_dir(),
        config_dir: config_dir(a.config_dir.as_deref()),
        client_timeout: a.client_timeout.map_or(CLIENT_TIMEOUT, Duration::from_secs),
        report: std::sync::Arc::new(Log),
    });
    d.serve_run_dir(&mut signals, a.connect_all).await
}

/// `daemon --background`: start `nvmf-rdma daemon` detached (new session, log file) and wait
/// for its READY=1 on a private notify socket. Returns its pid.
pub(crate) fn start_background(a: &DaemonArgs, global: &[String]) -> Result<u32> {
    use std::os::unix::fs::OpenOptionsExt;
    use std::os::unix::process::CommandExt;
    let dir = run_dir();
    make_run_dir(&dir)?;
    let notify = dir.join(format!("ready-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&notify);
    let rx = std::os::unix::net::UnixDatagram::bind(&notify)
        .with_context(|| format!("bind {}", notify.display()))?;
    struct Rm(PathBuf);
    impl Drop for Rm {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
    let _rm = Rm(notify.clone());
    rx.set_read_timeout(Some(Duration::from_millis(100)))?;
    let log_path = dir.join("daemon.log");
    let log = std::fs::OpenOptions::new()
        .mode(0o600)
        .create(true)
        .append(true)
        .open(&log_path)
        .with_context(|| format!("open {}", log_path.display()))?;
    let exe = std::env::current_exe().context("cannot find the nvmf-rdma executable")?;
    let mut cmd = std::process::Command::new(exe);
    cmd.args(global).arg("daemon");
    if a.connect_all {
        cmd.arg("--connect-all");
    }
    if let Some(d) = &a.config_dir {
        cmd.arg("--config-dir").arg(d);
    }
    if let Some(t) = a.client_timeout {
        cmd.arg(format!("--client-timeout={t}"));
    }
    cmd.env("NOTIFY_SOCKET", &notify)
        .env(LOG_TIME_ENV, "1")
        .env("NVMF_RDMA_RUN_DIR", &dir)
        .env_remove("RUST_BACKTRACE")
        .stdin(std::process::Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    // SAFETY: setsid is async-signal-safe; it detaches the daemon from our terminal and
    // process group, so a closed terminal (SIGHUP) or Ctrl-C here does not reach it.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let mut child = cmd.spawn().context("cannot start the daemon")?;
    let deadline = Instant::now() + READY_TIMEOUT;
    let mut buf = [0u8; 4096];
    loop {
        if let Ok(n) = rx.recv(&mut buf) {
            let msg = String::from_utf8_lossy(&buf[..n]);
            if msg.lines().any(|l| l == "READY=1") {
                return Ok(child.id());
            }
            if let Some(e) = msg.lines().find_map(|l| l.strip_prefix("STATUS=error: ")) {
                let _ = child.wait();
                bail!("the daemon did not start: {e}");
            }
        }
        if let Some(s) = child.try_wait()? {
            bail!(
                "the daemon exited ({s}) before it was ready; see {}",
                log_path.display()
            );
        }
        if Instant::now() > deadline {
            bail!(
                "the daemon (pid {}) was not ready within {} s; see {}",
                child.id(),
                READY_TIMEOUT.as_secs(),
                log_path.display()
            );
        }
    }
}

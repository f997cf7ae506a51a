//! The per-controller control socket: its server side (in `connect`) and its clients
//! (`list`, `disconnect`).

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::cli::support::{json_field, run_dir};
pub use crate::export::same_user;
use anyhow::{bail, Context, Result};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

/// Longest control-socket request line, and how long a client may take to send it.
pub const CONTROL_LINE_MAX: u64 = 1024;
pub const CONTROL_TIMEOUT: Duration = Duration::from_secs(2);

/// A `disconnect` asked of `connect` on its control socket: forced or not, and where the
/// answer goes (`Err` names what holds the exports).
pub type StopAsk = (bool, tokio::sync::oneshot::Sender<Result<(), String>>);

/// The request line that disconnects a `connect --foreground` controller.
fn disconnect_line(force: bool) -> &'static str {
    if force {
        "disconnect force"
    } else {
        "disconnect"
    }
}

/// One control-socket client: one request line, one answer. Runs in its own task, so a
/// client that sends nothing (or too much) never holds up the controller or a signal.
pub async fn serve_control_client(
    stream: tokio::net::UnixStream,
    info: String,
    stop: tokio::sync::mpsc::Sender<StopAsk>,
) {
    let (r, mut w) = stream.into_split();
    let mut line = String::new();
    let mut r = BufReader::new(r.take(CONTROL_LINE_MAX));
    let read = r.read_line(&mut line);
    let answer = match tokio::time::timeout(CONTROL_TIMEOUT, read).await {
        Ok(Ok(_)) => match line.trim() {
            "info" => info,
            l if l == disconnect_line(false) || l == disconnect_line(true) => {
                let (tx, rx) = tokio::sync::oneshot::channel();
                let force = l == disconnect_line(true);
                match stop.send((force, tx)).await {
                    Err(_) => "ok".into(),
                    Ok(()) => match rx.await {
                        Ok(Err(e)) => format!("error: {}", crate::cli::support::one_line(&e)),
                        _ => "ok".into(),
                    },
                }
            }
            _ => "error: unknown request".into(),
        },
        _ => "error: no request line within 2 s".into(),
    };
    let _ = w.write_all(format!("{answer}\n").as_bytes()).await;
}

/// The run directory, created 0700 whatever the umask; an existing one of ours is made 0700.
/// One of another user, or a symlink, is refused.
pub fn make_run_dir(dir: &std::path::Path) -> Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("create {}", dir.display()))?;
    let meta = std::fs::symlink_metadata(dir).with_context(|| format!("stat {}", dir.display()))?;
    // Whoever can change where the link points could move our sockets and pid file.
    if !meta.is_dir() {
        bail!(
            "{} is not a directory (a symlink?); set NVMF_RDMA_RUN_DIR to a directory of yours",
            dir.display()
        );
    }
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    if meta.uid() != euid {
        bail!(
            "{} belongs to another user (uid {}); set NVMF_RDMA_RUN_DIR to a directory of yours",
            dir.display(),
            meta.uid()
        );
    }
    if meta.mode() & 0o077 != 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .with_context(|| format!("chmod 0700 {}", dir.display()))?;
    }
    Ok(())
}

pub async fn ask(path: &std::path::Path, req: &str) -> Option<String> {
    ask_within(path, req, Duration::from_secs(2)).await
}

/// [`ask`], waiting up to `answer_within` for the answer.
async fn ask_within(path: &std::path::Path, req: &str, answer_within: Duration) -> Option<String> {
    let mut s = tokio::time::timeout(
        Duration::from_secs(2),
        tokio::net::UnixStream::connect(path),
    )
    .await
    .ok()?
    .ok()?;
    s.write_all(format!("{req}\n").as_bytes()).await.ok()?;
    let mut line = String::new();
    tokio::time::timeout(answer_within, BufReader::new(s).read_line(&mut line))
        .await
        .ok()?
        .ok()?;
    Some(line.trim().to_string())
}

/// Controllers held by `connect --foreground` processes: their socket and `info` JSON.
pub async fn foreground_controllers() -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(run_dir()) else {
        return out;
    };
    let mut paths: Vec<PathBuf> = rd
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.extension().is_some_and(|x| x == "sock")
                && p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("nvmf"))
        })
        .collect();
    paths.sort();
    for p in paths {
        if let Some(j) = ask(&p, "info").await {
            out.push((p, j));
        }
    }
    out
}

/// How long `disconnect` waits for a controller's `connect` to finish.
pub const DISCONNECT_WAIT: Duration = Duration::from_secs(10);

/// Disconnect the `connect --foreground` controllers whose `info` `pick` selects; how many.
/// One whose export is in use refuses (unless `force`): its error is returned.
pub async fn disconnect_foreground(pick: impl Fn(&str) -> bool, force: bool) -> Result<usize> {
    let mut n = 0;
    for (p, j) in foreground_controllers().await {
        if !pick(&j) {
            continue;
        }
        // The answer waits for the look at the exports' holders (up to RELEASE_GRACE).
        match ask_within(&p, disconnect_line(force), DISCONNECT_WAIT)
            .await
            .as_deref()
        {
            Some("ok") => {}
            Some(e) => match e.strip_prefix("error: ") {
                Some(e) => bail!("{e}"),
                None => continue,
            },
            None => continue,
        }
        // Done when its `connect` has let the controller go and removed its socket.
        let deadline = Instant::now() + DISCONNECT_WAIT;
        while p.exists() {
            if Instant::now() > deadline {
                bail!(
                    "{} was asked to disconnect but is still there after {} s; \
                     its `connect` process may be stuck: stop it with a signal",
                    json_field(&j, "name").unwrap_or("the controller"),
                    DISCONNECT_WAIT.as_secs()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        n += 1;
    }
    Ok(n)
}

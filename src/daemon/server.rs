//! The daemon's socket server: clients on RUN_DIR/daemon.sock, a request line in and an
//! answer line out, in order; stop requests and the signals its process forwards.
//!
//! Stop signals and the `stop` request behave the same: with no export in use, every export
//! is stopped, every controller disconnected, and [`Daemon::serve`] returns. With an export
//! in use (a loop device on a FUSE file, an open file, NBD clients) the daemon refuses, logs
//! what holds each export and how to let it go, and keeps serving; a refused stop signal
//! stays pending and completes once nothing holds the exports (saying who still does every
//! [`PENDING_REPORT`](crate::daemon::stop::PENDING_REPORT)). A second stop signal within
//! [`FORCE_WINDOW`] (or `stop` with `force`) stops anyway.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd};

use tokio::io::{AsyncWriteExt, Interest};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::Semaphore;

use crate::daemon::connect_all::op_connect_all;
use crate::daemon::control::{make_run_dir, same_user};
use crate::daemon::fdpass::recv_with_fds;
use crate::daemon::pid_lock::PidLock;
use crate::daemon::proto::{
    err_line, ok_line, parse_request, progress_line, ErrorCode, Progress, ProtoError, Reply,
    Request, MAX_LINE, PROTOCOL_VERSION, SOCKET_NAME,
};
use crate::daemon::registry::{lock, op_disconnect, State, StopAsk};
use crate::daemon::say;
use crate::daemon::service::{dispatch, Daemon};
use crate::daemon::stop::{PendingStop, FORCE_WINDOW};
use crate::export::bind_listener;

/// Clients served at once; one more gets a `busy` answer and is closed.
pub(crate) const MAX_CLIENTS: usize = 64;
/// Time a client has to send each complete request line.
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(30);

/// What the daemon's process tells it of the signals it gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// Stop (SIGINT, SIGTERM), with the signal's name for the log.
    Stop(&'static str),
    /// Read the config file again (SIGHUP).
    Reload,
}

impl Daemon {
    /// Serve clients on `listener` until a stop (a [`Signal::Stop`] or a `stop` request)
    /// goes through; with `connect_all`, connect what the config file lists first (clients
    /// are served meanwhile). Everything is disconnected when it returns.
    pub async fn serve(
        &self,
        listener: &tokio::net::UnixListener,
        signals: &mut tokio::sync::mpsc::Receiver<Signal>,
        connect_all: bool,
    ) -> Result<()> {
        let mut stop_rx = self
            .stop_rx
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| anyhow::anyhow!("this daemon is served already"))?;
        let r = serve_until_stopped(self, listener, signals, &mut stop_rx, connect_all).await;
        // The controllers are gone (the stop went through); the watchers and retries go too.
        let _ = self.shutdown(true).await;
        r
    }

    /// [`Daemon::serve`] in the run directory of its config: the directory made if missing
    /// (0700), its lock taken (one daemon per run directory), its socket bound (a crashed
    /// daemon's is taken over; the file goes when this returns).
    pub async fn serve_run_dir(
        &self,
        signals: &mut tokio::sync::mpsc::Receiver<Signal>,
        connect_all: bool,
    ) -> Result<()> {
        let dir = &self.st.cfg.run_dir;
        make_run_dir(dir)?;
        let _lock = PidLock::take(dir)?;
        let sock = dir.join(SOCKET_NAME);
        let (listener, _sock_file) =
            bind_listener(&sock).with_context(|| format!("bind {}", sock.display()))?;
        let r = self.serve(&listener, signals, connect_all).await;
        drop(listener);
        r
    }
}

/// A client's read side: its bytes, and the descriptors that came with them (kept for the
/// request that uses one, at most [`MAX_FDS`](crate::daemon::fdpass::MAX_FDS)).
struct Incoming {
    r: OwnedReadHalf,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    fds: VecDeque<OwnedFd>,
}

impl Incoming {
    fn new(r: OwnedReadHalf) -> Incoming {
        Incoming {
            r,
            buf: vec![0; 4096].into_boxed_slice(),
            start: 0,
            end: 0,
            fds: VecDeque::new(),
        }
    }

    /// The bytes received and not consumed yet; empty at the end of the stream.
    async fn fill_buf(&mut self) -> std::io::Result<&[u8]> {
        while self.start == self.end {
            let s = self.r.as_ref();
            s.readable().await?;
            let fd = s.as_raw_fd();
            let (buf, fds) = (&mut self.buf, &mut self.fds);
            match s.try_io(Interest::READABLE, || recv_with_fds(fd, buf, fds)) {
                Ok(n) => {
                    (self.start, self.end) = (0, n);
                    if n == 0 {
                        break;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
        Ok(&self.buf[self.start..self.end])
    }

    fn consume(&mut self, n: usize) {
        self.start = (self.start + n).min(self.end);
    }
}

/// Read one line of at most [`MAX_LINE`] bytes. `Ok(None)` at the end of the stream;
/// `Ok(Some(Err(())))` for a line that was too long (read to its end and dropped).
async fn read_line(r: &mut Incoming, buf: &mut Vec<u8>) -> std::io::Result<Option<Result<(), ()>>> {
    buf.clear();
    let mut too_long = false;
    loop {
        let avail = r.fill_buf().await?;
        if avail.is_empty() {
            return Ok(if buf.is_empty() && !too_long {
                None
            } else if too_long {
                Some(Err(()))
            } else {
                Some(Ok(()))
            });
        }
        let (chunk, done) = match avail.iter().position(|&b| b == b'\n') {
            Some(i) => (&avail[..i], i + 1),
            None => (avail, avail.len()),
        };
        let end = done > chunk.len();
        if !too_long {
            if buf.len() + chunk.len() >= MAX_LINE {
                too_long = true;
                buf.clear();
            } else {
                buf.extend_from_slice(chunk);
            }
        }
        r.consume(done);
        if end {
            return Ok(Some(if too_long { Err(()) } else { Ok(()) }));
        }
    }
}

/// One client: request lines in, one answer line each, in order, until it closes, stays
/// silent past [`CLIENT_TIMEOUT`], or the daemon stops.
async fn serve_client(st: Arc<State>, stream: tokio::net::UnixStream) {
    let (r, mut w) = stream.into_split();
    let mut r = Incoming::new(r);
    let mut buf = Vec::new();
    loop {
        let line =
            match tokio::time::timeout(st.cfg.client_timeout, read_line(&mut r, &mut buf)).await {
                Err(_) => {
                    let e = ProtoError::new(
                        ErrorCode::Timeout,
                        format!(
                            "no complete request line within {} s",
                            st.cfg.client_timeout.as_secs()
                        ),
                    );
                    let _ = w
                        .write_all(format!("{}\n", err_line(&None, &e)).as_bytes())
                        .await;
                    return;
                }
                Ok(Err(_)) | Ok(Ok(None)) => return,
                Ok(Ok(Some(l))) => l,
            };
        let answer = match line {
            Err(()) => err_line(
                &None,
                &ProtoError::new(
                    ErrorCode::LineTooLong,
                    format!("request line longer than {MAX_LINE} bytes"),
                ),
            ),
            Ok(()) => {
                let text = String::from_utf8_lossy(&buf);
                if text.trim().is_empty() {
                    continue;
                }
                let (id, req) = parse_request(text.trim());
                match req {
                    Err(e) => err_line(&id, &e),
                    Ok(req) => {
                        let fd = match req {
                            Request::ReadToFd { .. } | Request::WriteFromFd { .. } => {
                                r.fds.pop_front()
                            }
                            _ => None,
                        };
                        match answer_with_progress(&st, &id, req, fd, &mut w).await {
                            Ok(body) => ok_line(&id, &body),
                            Err(e) => err_line(&id, &e),
                        }
                    }
                }
            }
        };
        if w.write_all(format!("{answer}\n").as_bytes()).await.is_err() {
            return;
        }
    }
}

/// Do `req`, writing its progress lines to `w` while it runs (when it asked for them).
async fn answer_with_progress(
    st: &Arc<State>,
    id: &Option<serde_json::Value>,
    req: Request,
    fd: Option<OwnedFd>,
    w: &mut OwnedWriteHalf,
) -> Result<Reply, ProtoError> {
    // Bounded: a client slower than the progress drops some; the last one always goes.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Progress>(4);
    let mut on = |done: u64, total: u64| {
        let _ = tx.try_send(Progress { done, total });
    };
    let job = dispatch(st, req, fd, &mut on);
    tokio::pin!(job);
    loop {
        tokio::select! {
            r = &mut job => return r,
            Some(p) = rx.recv() => {
                // A client gone meanwhile finds out from the answer's write.
                let _ = w.write_all(format!("{}\n", progress_line(id, p)).as_bytes()).await;
            }
        }
    }
}

async fn serve_until_stopped(
    d: &Daemon,
    listener: &tokio::net::UnixListener,
    signals: &mut tokio::sync::mpsc::Receiver<Signal>,
    stop_rx: &mut tokio::sync::mpsc::Receiver<StopAsk>,
    connect_all: bool,
) -> Result<()> {
    let st = &d.st;
    let report = &st.cfg.report;
    let clients = Arc::new(Semaphore::new(MAX_CLIENTS));
    let mut tasks = tokio::task::JoinSet::new();
    let startup = async {
        if connect_all {
            match op_connect_all(st, None).await {
                Ok(v) => {
                    for r in v.results {
                        say!(report, "connect-all: {r}");
                    }
                }
                Err(e) => say!(report, "connect-all: {}", e.message),
            }
        }
    };
    // Serve clients while the configured controllers connect (list shows them as they come).
    tokio::pin!(startup);
    let mut started = false;
    let mut signals_open = true;
    let mut pending = PendingStop::default();
    say!(
        report,
        "nvmf-rdma daemon {} (protocol {PROTOCOL_VERSION}) on {}",
        env!("CARGO_PKG_VERSION"),
        st.cfg.run_dir.join(SOCKET_NAME).display()
    );
    loop {
        tokio::select! {
            _ = &mut startup, if !started => {
                started = true;
                report.notify(&format!("READY=1\nSTATUS=serving {} controller(s)", lock(&st.inner).ctrls.len()));
                say!(report, "ready");
            }
            sig = signals.recv(), if signals_open => {
                match sig {
                    Some(Signal::Stop(name)) => {
                        if on_stop_signal(st, name, &mut pending).await {
                            break;
                        }
                    }
                    Some(Signal::Reload) => {
                        let conf = st.cfg.config_dir.join(crate::daemon::config::CONFIG_FILE);
                        say!(report, "SIGHUP: reloading {}", conf.display());
                        d.reload().await;
                    }
                    // The process stopped forwarding signals: a stop request still stops.
                    None => signals_open = false,
                }
            }
            _ = pending.tick() => {
                if on_pending_tick(st, &mut pending).await {
                    break;
                }
            }
            Some((force, reply)) = stop_rx.recv() => {
                let r = try_stop(st, force, pending.is_pending()).await;
                let done = r.is_ok();
                let _ = reply.send(r);
                if done { say!(report, "stop request: stopped"); break; }
            }
            conn = listener.accept() => {
                let Ok((stream, _)) = conn else {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                };
                if !same_user(&stream) {
                    continue;
                }
                match clients.clone().try_acquire_owned() {
                    Ok(permit) => {
                        let st = st.clone();
                        tasks.spawn(async move { serve_client(st, stream).await; drop(permit); });
                    }
                    Err(_) => {
                        // Told without a task of its own (a fresh socket's buffer takes
                        // the line), so a flood of clients costs nothing that stays.
                        let e = ProtoError::new(ErrorCode::Busy, format!("{MAX_CLIENTS} clients already")).hint("try again");
                        let _ = stream.try_write(format!("{}\n", err_line(&None, &e)).as_bytes());
                    }
                }
            }
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
        }
    }
    // The client that asked for the stop still gets its answer; idle ones are cut off.
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    tasks.abort_all();
    Ok(())
}

/// A stop signal: stop, or refuse (an export is in use) and keep the stop pending; a second
/// signal within [`FORCE_WINDOW`] of a refusal forces it. True once stopped.
async fn on_stop_signal(st: &Arc<State>, sig: &str, pending: &mut PendingStop) -> bool {
    let report = &st.cfg.report;
    let now = Instant::now();
    match try_stop(st, pending.forces(now), true).await {
        Ok(()) => {
            say!(report, "{sig}: stopped");
            true
        }
        Err(e) => {
            pending.refused(now);
            say!(
                report,
                "{sig}: not stopping: {}; {}; the stop completes once they are released; \
                 another stop signal within {} s forces it",
                e.message,
                e.hint.as_deref().unwrap_or(""),
                FORCE_WINDOW.as_secs()
            );
            report.notify(&format!("STATUS=refusing to stop: {}", e.message));
            false
        }
    }
}

/// A pending stop looks again whether the exports were released: the counters first; the
/// full look runs once they read zero, or when it is time to say again who holds them. True
/// once stopped.
async fn on_pending_tick(st: &Arc<State>, pending: &mut PendingStop) -> bool {
    let report = &st.cfg.report;
    let due = pending.report_due(Instant::now());
    let busy = lock(&st.inner)
        .ctrls
        .values()
        .any(|e| e.exports.probe().busy_now());
    if busy && !due {
        return false;
    }
    match try_stop(st, false, true).await {
        Ok(()) => {
            say!(report, "exports released: stopped");
            true
        }
        Err(e) => {
            if due {
                say!(
                    report,
                    "stop pending: {}; {}",
                    e.message,
                    e.hint.as_deref().unwrap_or("")
                );
                report.notify(&format!("STATUS=stop pending: {}", e.message));
            }
            false
        }
    }
}

/// Stop everything unless an export is in use (and not `force`). A refused stop that stays
/// `pending` keeps taking no new controller.
async fn try_stop(st: &Arc<State>, force: bool, pending: bool) -> Result<(), ProtoError> {
    // No new controller from here on; taken back if the stop is refused and not pending.
    st.stopping.store(true, Ordering::SeqCst);
    match op_disconnect(st, |_| true, force, "").await {
        Ok(_) => {
            st.cfg.report.notify("STOPPING=1");
            Ok(())
        }
        Err(e) => {
            st.stopping.store(pending, Ordering::SeqCst);
            Err(e)
        }
    }
}

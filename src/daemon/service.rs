//! The daemon as its front ends see it: a [`Daemon`] made from a [`DaemonConfig`], the
//! requests of the control protocol decoded into calls ([`Daemon::handle`]), and its end
//! ([`Daemon::shutdown`]). The socket server ([`Daemon::serve`]) is one caller; a test or an
//! embedding application can be another.

use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use crate::daemon::connect_all::{op_connect, op_connect_all, reload};
use crate::daemon::io::{run_io, OnProgress};
use crate::daemon::proto::{
    DisconnectReply, ErrorCode, LineStatus, ListReply, ProtoError, Reply, Request, StatusReply,
    StopReply, PROTOCOL_VERSION,
};
use crate::daemon::registry::{
    abort_all, lock, op_disconnect, DaemonConfig, Entry, State, StopAsk,
};
use crate::daemon::{say, Report};

/// A daemon's registry. Dropping it leaves its controllers running; [`Daemon::shutdown`]
/// (or [`Daemon::serve`] ending) takes them down.
pub struct Daemon {
    pub(super) st: Arc<State>,
    pub(super) stop_rx: Mutex<Option<tokio::sync::mpsc::Receiver<StopAsk>>>,
    rescans: tokio::task::JoinHandle<()>,
}

impl Daemon {
    /// A registry with no controller. Needs a tokio runtime (it starts the task that runs
    /// `connect-all` for a discovery controller whose log changed).
    pub fn new(cfg: DaemonConfig) -> Daemon {
        let (st, stop_rx, mut rescan_rx) = State::new(cfg);
        let st = Arc::new(st);
        let rescans = {
            let st = st.clone();
            tokio::spawn(async move {
                while let Some(p) = rescan_rx.recv().await {
                    if let Ok(v) = op_connect_all(&st, Some(p)).await {
                        for r in v.results {
                            if r.status != LineStatus::AlreadyConnected {
                                say!(st.cfg.report, "connect-all: {r}");
                            }
                        }
                    }
                }
            })
        };
        Daemon {
            st,
            stop_rx: Mutex::new(Some(stop_rx)),
            rescans,
        }
    }

    /// Do what `req` asks, as the socket server does for a client.
    pub async fn handle(&self, req: Request) -> Result<Reply, ProtoError> {
        self.handle_fd(req, None, &mut |_, _| {}).await
    }

    /// [`Daemon::handle`] for a request that came with a descriptor (`read-to-fd`,
    /// `write-from-fd`); `progress` hears how far it got.
    pub async fn handle_fd(
        &self,
        req: Request,
        fd: Option<OwnedFd>,
        progress: OnProgress<'_>,
    ) -> Result<Reply, ProtoError> {
        req.check()?;
        dispatch(&self.st, req, fd, progress).await
    }

    /// Stop the watchers and retries, and disconnect every controller (forced when `force`,
    /// else refused while an export is in use, as a stop signal is).
    pub async fn shutdown(&self, force: bool) -> Result<(), ProtoError> {
        self.st.stopping.store(true, Ordering::SeqCst);
        self.rescans.abort();
        // Retries first: one may start a watcher.
        abort_all(&self.st.retries).await;
        abort_all(&self.st.watchers).await;
        op_disconnect(&self.st, |_| true, force, "")
            .await
            .map(|_| ())
    }

    /// Read the config file again: connect the lines that are new (and what their discovery
    /// controllers list), and report the lines that are gone with the controllers they made,
    /// which stay until they are disconnected.
    pub async fn reload(&self) {
        reload(&self.st).await
    }

    pub fn report(&self) -> &Report {
        &self.st.cfg.report
    }
}

/// Do `req`; `fd` is the descriptor that came with it (`read-to-fd`, `write-from-fd`), and
/// `progress` hears how far a request that moves data got.
pub(super) async fn dispatch(
    st: &Arc<State>,
    req: Request,
    fd: Option<OwnedFd>,
    progress: OnProgress<'_>,
) -> Result<Reply, ProtoError> {
    if let Some((device, io)) = req.io()? {
        let (c, _gate) = st.controller(&device).await?;
        return run_io(c, &device, io, fd, progress).await;
    }
    Ok(match req {
        Request::Status {} => {
            let inner = lock(&st.inner);
            Reply::Status(StatusReply {
                pid: std::process::id(),
                daemon_version: env!("CARGO_PKG_VERSION").into(),
                protocol_version: PROTOCOL_VERSION,
                run_dir: st.cfg.run_dir.display().to_string(),
                config_dir: st.cfg.config_dir.display().to_string(),
                controllers: inner.ctrls.len(),
                connecting: inner.reserved.keys().map(|n| format!("nvmf{n}")).collect(),
                stopping: st.stopping.load(Ordering::SeqCst),
            })
        }
        Request::List {} => Reply::List(ListReply {
            controllers: lock(&st.inner).ctrls.values().map(Entry::info).collect(),
        }),
        Request::Connect { params } => {
            Reply::Connect(Box::new(op_connect(st.clone(), *params).await?))
        }
        Request::ConnectAll { params } => {
            Reply::ConnectAll(op_connect_all(st, params.map(|p| *p)).await?)
        }
        Request::Disconnect { device, nqn, force } => {
            let what = match (&device, &nqn) {
                (Some(d), _) => format!("device {d}"),
                (None, Some(q)) => format!("NQN {q}"),
                _ => String::new(),
            };
            let pick = |e: &Entry| {
                device.as_deref().is_some_and(|d| d == e.name)
                    || nqn.as_deref().is_some_and(|q| q == e.sub.nqn)
            };
            Reply::Disconnect(DisconnectReply {
                disconnected: op_disconnect(st, pick, force, &what).await?,
            })
        }
        Request::DisconnectAll { force } => Reply::Disconnect(DisconnectReply {
            disconnected: op_disconnect(st, |_| true, force, "").await?,
        }),
        Request::Stop { force } => {
            let (tx, rx) = tokio::sync::oneshot::channel();
            st.stop_req
                .send((force, tx))
                .await
                .map_err(|_| ProtoError::new(ErrorCode::Stopping, "the daemon is stopping"))?;
            rx.await.unwrap_or(Ok(()))?;
            Reply::Stop(StopReply { stopping: true })
        }
        Request::Read { .. }
        | Request::Write { .. }
        | Request::Verify { .. }
        | Request::ReadToFd { .. }
        | Request::WriteFromFd { .. } => {
            unreachable!("I/O requests are answered above")
        }
    })
}

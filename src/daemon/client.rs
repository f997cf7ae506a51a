//! A typed client of the daemon's control protocol: one connection carrying any number of
//! requests, in order. A refusal comes back as the daemon's [`ProtoError`] (its code, one
//! line and a hint), inside the `anyhow::Error`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::de::DeserializeOwned;
use std::os::fd::{AsRawFd, BorrowedFd};

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader, Interest};

use crate::daemon::fdpass::send_with_fd;
use crate::daemon::proto::{
    parse_answer, parse_progress, request_line, AnswerError, ConnectAllReply, ConnectParams,
    ConnectReply, DisconnectReply, ListReply, Request, StatusReply, SOCKET_NAME,
};

/// Longest answer line read from the daemon (a `list` of many controllers fits).
const MAX_ANSWER: u64 = 16 << 20;

/// The daemon's socket in `run_dir`.
pub fn socket_in(run_dir: &Path) -> PathBuf {
    run_dir.join(SOCKET_NAME)
}

/// One connection to the daemon.
pub struct Client {
    r: BufReader<tokio::io::Take<tokio::net::unix::OwnedReadHalf>>,
    w: tokio::net::unix::OwnedWriteHalf,
}

impl Client {
    /// Connect to the daemon's socket at `path`; `Ok(None)`: no daemon answers there.
    pub async fn try_open(path: &Path) -> Result<Option<Client>> {
        let s = match tokio::net::UnixStream::connect(path).await {
            Ok(s) => s,
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => bail!(
                "cannot reach the daemon at {}: permission denied (it runs as another user: run \
                 this as that user or root, or use NVMF_RDMA_RUN_DIR for a daemon of your own)",
                path.display()
            ),
            Err(_) => return Ok(None),
        };
        Ok(Some(Client::on(s)))
    }

    /// Connect to the daemon of `run_dir`, with what to do when none runs.
    pub async fn open(run_dir: &Path) -> Result<Client> {
        Client::try_open(&socket_in(run_dir)).await?.ok_or_else(|| {
            anyhow::anyhow!(
                "no daemon runs in {} (start one: `nvmf-rdma daemon --background` or \
                 `systemctl start nvmf-rdma`; NVMF_RDMA_RUN_DIR picks another run directory)",
                run_dir.display()
            )
        })
    }

    /// A client on a connected stream.
    pub fn on(s: tokio::net::UnixStream) -> Client {
        let (r, w) = s.into_split();
        Client {
            r: BufReader::new(r.take(MAX_ANSWER)),
            w,
        }
    }

    /// Send `req` and read its answer as `T`.
    pub async fn call<T: DeserializeOwned>(&mut self, req: &Request) -> Result<T> {
        self.send(req).await?;
        self.answer().await
    }

    /// Send `req` without waiting for the answer.
    pub async fn send(&mut self, req: &Request) -> Result<()> {
        self.w
            .write_all(format!("{}\n", request_line(req)).as_bytes())
            .await
            .context("send to the daemon")
    }

    /// Send `req` with the descriptor `fd` (`read-to-fd`, `write-from-fd`) and read its
    /// answer; the progress lines before it go to `progress` (done, total).
    pub async fn call_with_fd<T: DeserializeOwned>(
        &mut self,
        req: &Request,
        fd: BorrowedFd<'_>,
        progress: &mut (dyn FnMut(u64, u64) + Send),
    ) -> Result<T> {
        let line = format!("{}\n", request_line(req));
        let s = self.w.as_ref();
        let sent = loop {
            s.writable().await.context("send to the daemon")?;
            let sock = s.as_raw_fd();
            match s.try_io(Interest::WRITABLE, || {
                send_with_fd(sock, line.as_bytes(), fd.as_raw_fd())
            }) {
                Ok(n) => break n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e).context("send to the daemon"),
            }
        };
        self.w
            .write_all(&line.as_bytes()[sent..])
            .await
            .context("send to the daemon")?;
        loop {
            let line = self.line().await?;
            match parse_progress(&line) {
                Some(p) => progress(p.done, p.total),
                None => return decode(&line),
            }
        }
    }

    /// Read the answer to the request sent last.
    pub async fn answer<T: DeserializeOwned>(&mut self) -> Result<T> {
        let line = self.line().await?;
        decode(&line)
    }

    /// The next line from the daemon.
    async fn line(&mut self) -> Result<String> {
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
        Ok(line)
    }

    pub async fn status(&mut self) -> Result<StatusReply> {
        self.call(&Request::Status {}).await
    }

    pub async fn list(&mut self) -> Result<ListReply> {
        self.call(&Request::List {}).await
    }

    pub async fn connect(&mut self, params: ConnectParams) -> Result<ConnectReply> {
        self.call(&Request::Connect {
            params: Box::new(params),
        })
        .await
    }

    pub async fn connect_all(&mut self, params: Option<ConnectParams>) -> Result<ConnectAllReply> {
        self.call(&Request::ConnectAll {
            params: params.map(Box::new),
        })
        .await
    }

    pub async fn disconnect(
        &mut self,
        device: Option<String>,
        nqn: Option<String>,
        force: bool,
    ) -> Result<DisconnectReply> {
        self.call(&Request::Disconnect { device, nqn, force }).await
    }
}

/// An answer line as `T`, or the daemon's refusal.
fn decode<T: DeserializeOwned>(line: &str) -> Result<T> {
    match parse_answer(line.trim()) {
        Ok(v) => Ok(v),
        Err(AnswerError::Refused(e)) => Err(e.into()),
        Err(e) => Err(e.into()),
    }
}

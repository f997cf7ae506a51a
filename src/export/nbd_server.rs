//! The NBD server on tokio: listeners (unix socket or TCP), one task per connection running the
//! [`nbd`](super::nbd) handshake and then the transmission phase with up to
//! [`MAX_INFLIGHT`] requests executing at once and replies sent as they finish (out of order,
//! which the protocol allows). Every connection serves the same [`BlockDev`], so flushes on
//! one cover writes completed on any (CAN_MULTI_CONN).

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufWriter};
use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinSet;

use super::nbd::{
    self, errno, read_reply_header, status_reply, tflag, Command, Decoded, ExportInfo, Negotiation,
    Outcome, Request, RequestDecoder,
};
use super::{BlockDev, ExportError};

/// Largest READ or WRITE accepted (advertised as the maximum block size); the NBD reference
/// server and qemu use the same 32 MiB.
pub const MAX_PAYLOAD: u32 = 32 << 20;
/// Requests executing at once per connection; the reader stops reading beyond that.
pub const MAX_INFLIGHT: usize = 64;

/// Where to serve: `unix:PATH` or `IP:PORT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExportAddr {
    Unix(PathBuf),
    Tcp(SocketAddr),
}

impl FromStr for ExportAddr {
    type Err = ExportError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(p) = s.strip_prefix("unix:") {
            if p.is_empty() {
                return Err(ExportError::BadAddr(s.into()));
            }
            return Ok(ExportAddr::Unix(PathBuf::from(p)));
        }
        s.parse()
            .map(ExportAddr::Tcp)
            .map_err(|_| ExportError::BadAddr(s.into()))
    }
}

impl fmt::Display for ExportAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExportAddr::Unix(p) => write!(f, "unix:{}", p.display()),
            ExportAddr::Tcp(a) => write!(f, "{a}"),
        }
    }
}

impl ExportAddr {
    /// The NBD URI clients such as `qemu-img` and `nbdinfo` take.
    pub fn uri(&self) -> String {
        match self {
            ExportAddr::Unix(p) => format!("nbd+unix:///?socket={}", p.display()),
            ExportAddr::Tcp(a) => format!("nbd://{a}/"),
        }
    }
}

enum Listener {
    Unix(tokio::net::UnixListener),
    Tcp(tokio::net::TcpListener),
}

/// A bound NBD listener. Dropping it removes its unix socket.
pub struct NbdListener {
    listener: Listener,
    addr: ExportAddr,
}

impl NbdListener {
    /// Bind `addr`. A leftover unix socket nobody answers on is replaced; a live one is an error.
    pub async fn bind(addr: &ExportAddr) -> Result<NbdListener, ExportError> {
        let listener = match addr {
            ExportAddr::Unix(p) => {
                if p.exists() {
                    if tokio::net::UnixStream::connect(p).await.is_ok() {
                        return Err(ExportError::io(
                            format!("bind {}", p.display()),
                            std::io::Error::new(
                                std::io::ErrorKind::AddrInUse,
                                "another server answers on this socket",
                            ),
                        ));
                    }
                    let _ = std::fs::remove_file(p);
                }
                let l = tokio::net::UnixListener::bind(p)
                    .map_err(|e| ExportError::io(format!("bind {}", p.display()), e))?;
                Listener::Unix(l)
            }
            ExportAddr::Tcp(a) => {
                let l = tokio::net::TcpListener::bind(a)
                    .await
                    .map_err(|e| ExportError::io(format!("bind {a}"), e))?;
                Listener::Tcp(l)
            }
        };
        let addr = match &listener {
            Listener::Tcp(l) => ExportAddr::Tcp(
                l.local_addr()
                    .map_err(|e| ExportError::io("local_addr", e))?,
            ),
            Listener::Unix(_) => addr.clone(),
        };
        Ok(NbdListener { listener, addr })
    }

    /// The bound address (with the real port when 0 was asked for).
    pub fn addr(&self) -> &ExportAddr {
        &self.addr
    }

    /// Accept connections forever, each served by its own task. Stop it by dropping (aborting)
    /// the future.
    pub async fn serve(self, dev: Arc<BlockDev>, name: String) -> Result<(), ExportError> {
        let info = export_info(&dev, name);
        let mut conns = JoinSet::new();
        loop {
            while conns.try_join_next().is_some() {}
            match &self.listener {
                Listener::Unix(l) => {
                    let (s, _) = l.accept().await.map_err(|e| ExportError::io("accept", e))?;
                    conns.spawn(run_logged(s, dev.clone(), info.clone()));
                }
                Listener::Tcp(l) => {
                    let (s, peer) = l.accept().await.map_err(|e| ExportError::io("accept", e))?;
                    let _ = s.set_nodelay(true);
                    tracing::debug!(%peer, "nbd connection");
                    conns.spawn(run_logged(s, dev.clone(), info.clone()));
                }
            }
        }
    }
}

impl Drop for NbdListener {
    fn drop(&mut self) {
        if let ExportAddr::Unix(p) = &self.addr {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// What the export advertises: every write-side command, multi-connection safety, any
/// alignment (partial blocks are read-modify-written), the namespace block as preferred size.
pub fn export_info(dev: &BlockDev, name: String) -> ExportInfo {
    ExportInfo {
        description: format!(
            "NVMe-oF namespace, {} blocks of {} B",
            dev.size() / dev.block_size() as u64,
            dev.block_size()
        ),
        name,
        size: dev.size(),
        flags: tflag::SEND_FLUSH
            | tflag::SEND_FUA
            | tflag::SEND_TRIM
            | tflag::SEND_WRITE_ZEROES
            | tflag::CAN_MULTI_CONN,
        min_block: 1,
        preferred_block: dev.block_size().max(4096),
        max_block: MAX_PAYLOAD,
    }
}

async fn run_logged<S>(stream: S, dev: Arc<BlockDev>, info: ExportInfo)
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    if let Err(e) = serve_connection(stream, dev, info).await {
        tracing::warn!("nbd connection closed: {e}");
    }
}

struct Reply {
    head: Vec<u8>,
    data: Vec<u8>,
}

/// Serve one client connection: handshake, then requests until NBD_CMD_DISC or end of stream.
/// Protocol violations close the connection with an error; nothing a client sends panics.
pub async fn serve_connection<S>(
    stream: S,
    dev: Arc<BlockDev>,
    info: ExportInfo,
) -> Result<(), ExportError>
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let (mut rd, mut wr) = tokio::io::split(stream);
    let io = |what: &'static str| move |e| ExportError::io(what, e);
    let mut buf = BytesMut::with_capacity(256 << 10);
    let mut neg = Negotiation::new(info);
    let structured = loop {
        let r = neg.handle_input(&mut buf);
        if let Some(out) = neg.poll_transmit() {
            wr.write_all(&out).await.map_err(io("nbd send"))?;
        }
        match r.map_err(ExportError::Nbd)? {
            Some(Outcome::Close) => {
                let _ = wr.shutdown().await;
                return Ok(());
            }
            Some(Outcome::Transmission { structured }) => break structured,
            None => {}
        }
        if rd.read_buf(&mut buf).await.map_err(io("nbd receive"))? == 0 {
            return Ok(());
        }
    };
    wr.flush().await.map_err(io("nbd send"))?;

    let (tx, mut rx) = mpsc::channel::<Reply>(MAX_INFLIGHT * 2);
    let writer = tokio::spawn(async move {
        let mut w = BufWriter::with_capacity(64 << 10, wr);
        while let Some(r) = rx.recv().await {
            w.write_all(&r.head).await?;
            w.write_all(&r.data).await?;
            if rx.is_empty() {
                w.flush().await?;
            }
        }
        w.flush().await?;
        w.shutdown().await
    });

    let size = dev.size();
    let slots = Arc::new(Semaphore::new(MAX_INFLIGHT));
    let mut dec = RequestDecoder::new(MAX_PAYLOAD);
    let mut tasks = JoinSet::new();
    let result = loop {
        while tasks.try_join_next().is_some() {}
        let (req, payload) = match dec.decode(&mut buf) {
            Err(e) => break Err(ExportError::Nbd(e)),
            Ok(None) => {
                if buf.capacity() - buf.len() < 64 << 10 {
                    buf.reserve(256 << 10);
                }
                match rd.read_buf(&mut buf).await {
                    Ok(0) => break Ok(()),
                    Ok(_) => continue,
                    Err(e) => break Err(ExportError::io("nbd receive", e)),
                }
            }
            Ok(Some(Decoded::Refused(req, e))) => {
                let head = status_reply(structured && req.command == Command::Read, req.cookie, e);
                let _ = tx
                    .send(Reply {
                        head,
                        data: Vec::new(),
                    })
                    .await;
                continue;
            }
            Ok(Some(Decoded::Request(req, payload))) => (req, payload),
        };
        if req.command == Command::Disc {
            break Ok(());
        }
        if let Some(e) = nbd::validate(&req, size, MAX_PAYLOAD, structured) {
            let head = status_reply(structured && req.command == Command::Read, req.cookie, e);
            let _ = tx
                .send(Reply {
                    head,
                    data: Vec::new(),
                })
                .await;
            continue;
        }
        let Ok(permit) = slots.clone().acquire_owned().await else {
            break Ok(());
        };
        let (dev, tx) = (dev.clone(), tx.clone());
        tasks.spawn(async move {
            let reply = execute(&dev, req, payload, structured).await;
            let _ = tx.send(reply).await;
            drop(permit);
        });
    };
    // "The server SHOULD wait for inflight requests to be serviced" before closing.
    while tasks.join_next().await.is_some() {}
    drop(tx);
    let w = writer.await;
    result?;
    match w {
        Ok(Ok(())) | Ok(Err(_)) => Ok(()),
        Err(e) => Err(ExportError::io("nbd writer", std::io::Error::other(e))),
    }
}

async fn execute(dev: &BlockDev, req: Request, payload: Bytes, structured: bool) -> Reply {
    let fua = req.flags & nbd::cflag::FUA != 0;
    let (off, len) = (req.offset, req.length as u64);
    let r = match req.command {
        Command::Read => match dev.read_at(off, len as usize).await {
            Ok(data) => {
                return Reply {
                    head: read_reply_header(structured, req.cookie, off, data.len()),
                    data,
                }
            }
            Err(e) => Err(e),
        },
        Command::Write => dev.write_at(off, &payload, fua).await,
        Command::Flush => dev.flush().await,
        Command::Trim => match dev.trim(off, len).await {
            Ok(()) if fua => dev.flush().await,
            r => r,
        },
        Command::WriteZeroes => dev.write_zeroes_at(off, len, fua).await,
        _ => {
            return Reply {
                head: status_reply(false, req.cookie, errno::EINVAL),
                data: Vec::new(),
            }
        }
    };
    let error = match r {
        Ok(()) => 0,
        Err(e) => {
            tracing::warn!(?req, "nbd request failed: {e}");
            errno::from_host(e.errno())
        }
    };
    Reply {
        head: status_reply(
            structured && req.command == Command::Read,
            req.cookie,
            error,
        ),
        data: Vec::new(),
    }
}

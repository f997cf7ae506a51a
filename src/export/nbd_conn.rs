//! One NBD client connection on tokio: the [`nbd_handshake`](super::nbd_handshake), then the
//! transmission phase with up to [`MAX_INFLIGHT`] requests executing at once and replies sent
//! as they finish (out of order, which the protocol allows), each request holding its bytes
//! of the budgets ([`super::nbd_budget`]) until its reply is written.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufWriter};
use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinSet;

use super::nbd::{
    self, errno, read_reply_header, status_reply, tflag, Command, Decoded, Request, RequestDecoder,
};
use super::nbd_budget::{
    under_pressure, Held, MemoryBudget, NbdLimits, NbdStats, MAX_INFLIGHT, MAX_PAYLOAD, MIN_BUDGET,
};
use super::nbd_handshake::{ExportInfo, Negotiation, Outcome};
use super::{BlockDev, ExportError};

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

/// What a client connecting now is offered: each device of `set` with what it advertises.
pub(super) fn offered(set: &super::DevSet) -> Vec<(ExportInfo, Arc<BlockDev>)> {
    set.named()
        .into_iter()
        .map(|(name, dev)| (export_info(&dev, name), dev))
        .collect()
}

/// What a connection is served under: its limits, its listener's counters, the memory budget.
pub struct Conn {
    pub limits: NbdLimits,
    pub stats: Arc<NbdStats>,
    pub memory: Arc<MemoryBudget>,
}

pub(super) async fn run_logged<S>(stream: S, exports: Vec<(ExportInfo, Arc<BlockDev>)>, c: Conn)
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    if let Err(e) = serve_connection_with(stream, exports, c).await {
        tracing::warn!("nbd connection closed: {e}");
    }
}

struct Reply {
    head: Vec<u8>,
    data: Vec<u8>,
    /// The request's share of the connection's byte budget, given back once the reply is
    /// written.
    held: Option<Held>,
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
    let c = Conn {
        limits: NbdLimits::default(),
        stats: Arc::new(NbdStats::default()),
        memory: MemoryBudget::process(),
    };
    serve_connection_with(stream, vec![(info, dev)], c).await
}

/// [`serve_connection`] offering `exports` (the client picks one by name; the first is the
/// default), under `c`.
pub async fn serve_connection_with<S>(
    stream: S,
    exports: Vec<(ExportInfo, Arc<BlockDev>)>,
    c: Conn,
) -> Result<(), ExportError>
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let (mut rd, mut wr) = tokio::io::split(stream);
    let mut buf = BytesMut::with_capacity(256 << 10);
    let Some((structured, dev)) = handshake(&mut rd, &mut wr, &mut buf, exports, &c).await? else {
        return Ok(());
    };
    let (tx, rx) = mpsc::channel::<Reply>(MAX_INFLIGHT * 2);
    let writer = tokio::spawn(write_replies(
        wr,
        rx,
        c.limits.idle_timeout,
        c.stats.clone(),
    ));
    let mut tasks = JoinSet::new();
    let result = serve_requests(&mut rd, &mut buf, dev, structured, &c, &tx, &mut tasks).await;
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

fn io_error(what: &'static str) -> impl Fn(std::io::Error) -> ExportError {
    move |e| ExportError::io(what, e)
}

/// The handshake, within the handshake timeout: whether the client asked for structured
/// replies and the device it chose; `None` if it aborted or went away.
async fn handshake<R, W>(
    rd: &mut R,
    wr: &mut W,
    buf: &mut BytesMut,
    exports: Vec<(ExportInfo, Arc<BlockDev>)>,
    c: &Conn,
) -> Result<Option<(bool, Arc<BlockDev>)>, ExportError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let (infos, mut devs): (Vec<ExportInfo>, Vec<Arc<BlockDev>>) = exports.into_iter().unzip();
    let mut neg = Negotiation::with_exports(infos);
    let steps = async {
        loop {
            let r = neg.handle_input(buf);
            if let Some(out) = neg.poll_transmit() {
                wr.write_all(&out).await.map_err(io_error("nbd send"))?;
            }
            match r.map_err(ExportError::Nbd)? {
                Some(Outcome::Close) => {
                    let _ = wr.shutdown().await;
                    return Ok(None);
                }
                Some(Outcome::Transmission { structured }) => return Ok(Some(structured)),
                None => {}
            }
            if rd.read_buf(buf).await.map_err(io_error("nbd receive"))? == 0 {
                return Ok(None);
            }
        }
    };
    let limit = c.limits.handshake_timeout;
    let structured = match tokio::time::timeout(limit, steps).await {
        Ok(Ok(Some(s))) => s,
        Ok(Ok(None)) => return Ok(None),
        Ok(Err(e)) => return Err(e),
        Err(_) => {
            c.stats.handshake_timeouts.fetch_add(1, Ordering::Relaxed);
            return Err(ExportError::io(
                "nbd handshake",
                std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("not finished within {} ms", limit.as_millis()),
                ),
            ));
        }
    };
    wr.flush().await.map_err(io_error("nbd send"))?;
    Ok(match neg.chosen() {
        i if i < devs.len() => Some((structured, devs.swap_remove(i))),
        _ => None,
    })
}

/// Write replies as they come. A reply the client does not take within the idle timeout ends
/// the connection (and so frees what its requests hold).
async fn write_replies<W>(
    wr: W,
    mut rx: mpsc::Receiver<Reply>,
    idle: Duration,
    stats: Arc<NbdStats>,
) -> std::io::Result<()>
where
    W: AsyncWrite + Unpin,
{
    let mut w = BufWriter::with_capacity(64 << 10, wr);
    while let Some(r) = rx.recv().await {
        let flush = rx.is_empty();
        let write = async {
            w.write_all(&r.head).await?;
            w.write_all(&r.data).await?;
            if flush {
                w.flush().await?;
            }
            Ok::<_, std::io::Error>(())
        };
        if tokio::time::timeout(idle, write).await.is_err() {
            stats.idle_closed.fetch_add(1, Ordering::Relaxed);
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the client took no reply data within the idle timeout",
            ));
        }
        drop(r.held);
    }
    w.flush().await?;
    w.shutdown().await
}

/// A status-only reply to `req`.
fn status_only(req: &Request, structured: bool, error: u32) -> Reply {
    Reply {
        head: status_reply(
            structured && req.command == Command::Read,
            req.cookie,
            error,
        ),
        data: Vec::new(),
        held: None,
    }
}

/// The transmission phase: decode requests and start each under its share of the budgets
/// until NBD_CMD_DISC, end of stream, an idle close or a protocol violation.
async fn serve_requests<R>(
    rd: &mut R,
    buf: &mut BytesMut,
    dev: Arc<BlockDev>,
    structured: bool,
    c: &Conn,
    tx: &mpsc::Sender<Reply>,
    tasks: &mut JoinSet<()>,
) -> Result<(), ExportError>
where
    R: AsyncRead + Unpin,
{
    let size = dev.size();
    let slots = Arc::new(Semaphore::new(MAX_INFLIGHT));
    // A request larger than the budget could never start: the budget is at least one.
    let budget = Arc::new(Semaphore::new(c.limits.conn_bytes.max(MIN_BUDGET)));
    let mut dec = RequestDecoder::new(MAX_PAYLOAD);
    loop {
        while tasks.try_join_next().is_some() {}
        let (req, payload) = match dec.decode(buf) {
            Err(e) => return Err(ExportError::Nbd(e)),
            Ok(None) => match read_more(rd, buf, c, tx, tasks).await? {
                true => continue,
                false => return Ok(()),
            },
            Ok(Some(Decoded::Refused(req, e))) => {
                let _ = tx.send(status_only(&req, structured, e)).await;
                continue;
            }
            Ok(Some(Decoded::Request(req, payload))) => (req, payload),
        };
        if req.command == Command::Disc {
            return Ok(());
        }
        if let Some(e) = nbd::validate(&req, size, MAX_PAYLOAD, structured) {
            let _ = tx.send(status_only(&req, structured, e)).await;
            continue;
        }
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return Ok(());
        };
        // The write's payload is in hand, the read's data is about to be: both count until
        // the reply is written. Nothing more is read from the client until there is room.
        let bytes = match req.command {
            Command::Read => dev.read_buffer_len(req.offset, req.length as usize),
            _ => payload.len(),
        };
        // A connection whose writer is gone (the client went or stalled) takes nothing more.
        let held = tokio::select! {
            h = Held::take(&budget, &c.memory, bytes, &c.stats) => h,
            _ = tx.closed() => None,
        };
        let Some(held) = held else {
            return Ok(());
        };
        let (dev, tx) = (dev.clone(), tx.clone());
        tasks.spawn(async move {
            let mut reply = execute(&dev, req, payload, structured).await;
            reply.held = Some(held);
            let _ = tx.send(reply).await;
            drop(permit);
        });
    }
}

/// Read more of the client's bytes into `buf`, finishing requests meanwhile: `false` when the
/// connection is done (end of stream, writer gone, closed for idleness under pressure).
async fn read_more<R>(
    rd: &mut R,
    buf: &mut BytesMut,
    c: &Conn,
    tx: &mpsc::Sender<Reply>,
    tasks: &mut JoinSet<()>,
) -> Result<bool, ExportError>
where
    R: AsyncRead + Unpin,
{
    let idle = c.limits.idle_timeout;
    if buf.capacity() - buf.len() < 64 << 10 {
        buf.reserve(256 << 10);
    }
    let got = loop {
        // Idle: nothing executing, nothing arriving.
        if tasks.is_empty() {
            tokio::select! {
                r = tokio::time::timeout(idle, rd.read_buf(buf)) => break r.ok(),
                _ = tx.closed() => break Some(Ok(0)),
            }
        }
        tokio::select! {
            r = rd.read_buf(buf) => break Some(r),
            _ = tx.closed() => break Some(Ok(0)),
            Some(_) = tasks.join_next() => {}
        }
    };
    match got {
        // Idle, but nobody else needs the place: an idle mount is normal.
        None if !under_pressure(&c.stats, &c.limits) => Ok(true),
        None => {
            c.stats.idle_closed.fetch_add(1, Ordering::Relaxed);
            tracing::info!(
                secs = idle.as_secs(),
                "nbd: closing a connection idle for the idle timeout"
            );
            Ok(false)
        }
        Some(Ok(0)) => Ok(false),
        Some(Ok(_)) => Ok(true),
        Some(Err(e)) => Err(ExportError::io("nbd receive", e)),
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
                    held: None,
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
        _ => return status_only(&req, false, errno::EINVAL),
    };
    let error = match r {
        Ok(()) => 0,
        Err(e) => {
            tracing::warn!(?req, "nbd request failed: {e}");
            errno::from_host(e.errno())
        }
    };
    status_only(&req, structured, error)
}

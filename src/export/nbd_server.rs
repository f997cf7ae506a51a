//! The NBD server on tokio: listeners (unix socket or TCP), one task per connection running the
//! [`nbd`](super::nbd) handshake and then the transmission phase with up to
//! [`MAX_INFLIGHT`] requests executing at once and replies sent as they finish (out of order,
//! which the protocol allows). Every connection serves the same [`BlockDev`], so flushes on
//! one cover writes completed on any (CAN_MULTI_CONN).
//!
//! NBD has no authentication, so what a client can make the server hold is bounded
//! ([`NbdLimits`], [`MemoryBudget`]): bytes per connection and for all connections of the
//! process together (taken before the next request is read), connections per listener and
//! per peer, time to finish the handshake, time a connection may sit idle. TCP is served on
//! loopback unless the user explicitly allows more; unix sockets are created 0600. The accept
//! loop outlives errors such as running out of file descriptors.

use std::collections::HashMap;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufWriter};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;

use super::nbd::{
    self, errno, read_reply_header, status_reply, tflag, Command, Decoded, ExportInfo, Negotiation,
    Outcome, Request, RequestDecoder,
};
use super::socket_file::{bind_listener, SocketFile};
use super::{BlockDev, ExportError};

/// Largest READ or WRITE accepted (advertised as the maximum block size); the NBD reference
/// server and qemu use the same 32 MiB.
pub const MAX_PAYLOAD: u32 = 32 << 20;
/// Requests executing at once per connection; the reader stops reading beyond that.
pub const MAX_INFLIGHT: usize = 64;

/// What one NBD listener lets its clients cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NbdLimits {
    /// Bytes of write payload and read data one connection may hold at once (requests being
    /// executed, replies not yet written to the client). The reader waits for room before it
    /// takes the next request, so a client that never reads its replies costs at most this
    /// plus the one request it is sending (at most [`MAX_PAYLOAD`]).
    pub conn_bytes: usize,
    /// Connections served at once; a client beyond is closed at accept.
    pub max_connections: usize,
    /// Connections one peer may hold at once (a TCP source address, a unix socket's peer
    /// uid); a client beyond is closed at accept, so one peer cannot take every place.
    pub max_per_peer: usize,
    /// Time a client has to finish the handshake.
    pub handshake_timeout: Duration,
    /// A reply that waits this long for the client to take it closes the connection. A
    /// connection with no request arriving while none executes for this long is closed only
    /// while the listener is under pressure (at least three quarters of `max_connections`
    /// taken): an idle kernel `nbd-client` mount is left alone, and connections a peer holds
    /// without using them give their places back when others need them. A request executing
    /// (the controller recovering under it, say) keeps a connection open.
    pub idle_timeout: Duration,
}

impl Default for NbdLimits {
    fn default() -> NbdLimits {
        NbdLimits {
            conn_bytes: 64 << 20,
            max_connections: 64,
            max_per_peer: 16,
            handshake_timeout: Duration::from_secs(10),
            // Longer than any pause of a working client (qemu, nbdcopy and nbd-client send
            // at least a flush every few seconds while in use); short enough that a peer
            // holding connections it does not use gives them back within minutes.
            idle_timeout: Duration::from_secs(300),
        }
    }
}

/// Bytes of write payload and read data every NBD connection of the process may hold
/// together: each request takes its bytes from its connection's share
/// ([`NbdLimits::conn_bytes`]) and from here, before it is read, and gives them back when its
/// reply is written. Listeners bound without one of their own share [`MemoryBudget::process`].
#[derive(Debug)]
pub struct MemoryBudget {
    sem: Arc<Semaphore>,
    bytes: usize,
    in_use: AtomicUsize,
    peak: AtomicUsize,
}

/// Bytes the process-wide budget holds: four connections' full shares.
pub const PROCESS_BYTES: usize = 256 << 20;

impl MemoryBudget {
    /// A budget of `bytes` (at least one largest request).
    pub fn new(bytes: usize) -> Arc<MemoryBudget> {
        let bytes = bytes.max(MIN_BUDGET);
        Arc::new(MemoryBudget {
            sem: Arc::new(Semaphore::new(bytes)),
            bytes,
            in_use: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
        })
    }

    /// The budget of the process ([`PROCESS_BYTES`]).
    pub fn process() -> Arc<MemoryBudget> {
        static PROCESS: OnceLock<Arc<MemoryBudget>> = OnceLock::new();
        PROCESS
            .get_or_init(|| MemoryBudget::new(PROCESS_BYTES))
            .clone()
    }

    /// Its size.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Bytes held now.
    pub fn in_use(&self) -> usize {
        self.in_use.load(Ordering::Relaxed)
    }

    /// The most bytes ever held at once.
    pub fn peak(&self) -> usize {
        self.peak.load(Ordering::Relaxed)
    }
}

/// The smallest budget: one largest request, read into whole blocks (up to 1 MiB) at both
/// ends.
const MIN_BUDGET: usize = MAX_PAYLOAD as usize + (2 << 20);

/// Counters of one listener, shared with its connections.
#[derive(Debug, Default)]
pub struct NbdStats {
    /// Connections being served now.
    pub connections: AtomicUsize,
    /// Clients closed at accept because `max_connections` were being served.
    pub refused: AtomicU64,
    /// Clients closed at accept because their peer held `max_per_peer` connections.
    pub refused_per_peer: AtomicU64,
    /// Connections closed after `idle_timeout` without progress.
    pub idle_closed: AtomicU64,
    /// Clients that did not finish the handshake in time.
    pub handshake_timeouts: AtomicU64,
    /// accept() failures (out of file descriptors, ...); the listener goes on.
    pub accept_errors: AtomicU64,
    /// Payload and reply bytes held by all connections now, and the most ever.
    pub bytes_held: AtomicUsize,
    pub peak_bytes_held: AtomicUsize,
    /// The process of each unix-socket client connected now (SO_PEERCRED at accept), so an
    /// export in use can name its holders; bounded by `max_connections`.
    pub client_pids: std::sync::Mutex<Vec<i32>>,
}

/// Bytes of its connection's share and of the process budget held by one request until its
/// reply is written.
struct Held {
    _conn: Option<OwnedSemaphorePermit>,
    _process: Option<OwnedSemaphorePermit>,
    n: usize,
    stats: Arc<NbdStats>,
    memory: Arc<MemoryBudget>,
}

impl Held {
    /// The connection's share first, so a connection waiting for its own room holds nothing
    /// of the process budget.
    async fn take(
        conn: &Arc<Semaphore>,
        memory: &Arc<MemoryBudget>,
        n: usize,
        stats: &Arc<NbdStats>,
    ) -> Option<Held> {
        let (c, p) = if n == 0 {
            (None, None)
        } else {
            let c = conn.clone().acquire_many_owned(n as u32).await.ok()?;
            let p = memory.sem.clone().acquire_many_owned(n as u32).await.ok()?;
            (Some(c), Some(p))
        };
        let now = stats.bytes_held.fetch_add(n, Ordering::Relaxed) + n;
        stats.peak_bytes_held.fetch_max(now, Ordering::Relaxed);
        let now = memory.in_use.fetch_add(n, Ordering::Relaxed) + n;
        memory.peak.fetch_max(now, Ordering::Relaxed);
        Some(Held {
            _conn: c,
            _process: p,
            n,
            stats: stats.clone(),
            memory: memory.clone(),
        })
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.stats.bytes_held.fetch_sub(self.n, Ordering::Relaxed);
        self.memory.in_use.fetch_sub(self.n, Ordering::Relaxed);
    }
}

/// Who a connection comes from, for [`NbdLimits::max_per_peer`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Peer {
    Ip(IpAddr),
    Uid(u32),
    /// A unix peer whose credentials could not be read: all such count as one.
    Unknown,
}

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Peer::Ip(a) => write!(f, "{a}"),
            Peer::Uid(u) => write!(f, "uid {u}"),
            Peer::Unknown => write!(f, "an unknown unix peer"),
        }
    }
}

/// Connections per peer now; a connection's place is given back when its task ends, however.
#[derive(Default)]
struct Peers(Mutex<HashMap<Peer, usize>>);

/// One connection's place in [`Peers`].
struct PeerSlot {
    peers: Arc<Peers>,
    peer: Peer,
}

impl Peers {
    fn take(self: &Arc<Self>, peer: Peer, max: usize) -> Option<PeerSlot> {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let n = m.entry(peer).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(PeerSlot {
            peers: self.clone(),
            peer,
        })
    }
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut m = self.peers.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = m.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.peer);
            }
        }
    }
}

/// Give freed heap back to the system: glibc keeps what a connection's large buffers used
/// in its arenas otherwise, and the process stays at its peak after the clients left.
fn return_freed_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim has no preconditions; it only releases free memory.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Wait after a failed accept (EMFILE and the like) before trying again.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

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

/// Three quarters of the listener's places are taken: idle connections give theirs back.
fn under_pressure(stats: &NbdStats, limits: &NbdLimits) -> bool {
    let max = limits.max_connections.max(1);
    stats.connections.load(Ordering::SeqCst) >= max - max / 4
}

/// A bound NBD listener. Dropping it removes its unix socket.
pub struct NbdListener {
    listener: Listener,
    addr: ExportAddr,
    limits: NbdLimits,
    stats: Arc<NbdStats>,
    /// The unix socket file, removed with the listener.
    _socket: Option<SocketFile>,
    memory: Arc<MemoryBudget>,
}

impl NbdListener {
    /// Bind `addr` (loopback TCP or a unix socket) with the default limits.
    pub async fn bind(addr: &ExportAddr) -> Result<NbdListener, ExportError> {
        Self::bind_with(addr, NbdLimits::default(), false).await
    }

    /// Bind `addr`. A leftover unix socket of ours nobody answers on is replaced; anything
    /// else at the path is an error that leaves it alone ([`bind_listener`]). The socket is made
    /// 0600 whatever the umask. TCP on an address other than
    /// loopback needs `allow_remote` (the user's explicit consent).
    pub async fn bind_with(
        addr: &ExportAddr,
        limits: NbdLimits,
        allow_remote: bool,
    ) -> Result<NbdListener, ExportError> {
        if let ExportAddr::Tcp(a) = addr {
            if !a.ip().is_loopback() && !allow_remote {
                return Err(ExportError::RemoteRefused(*a));
            }
        }
        let mut socket = None;
        let listener = match addr {
            ExportAddr::Unix(p) => {
                let (l, file) = bind_listener(p)
                    .map_err(|e| ExportError::io(format!("bind {}", p.display()), e))?;
                socket = Some(file);
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
        Ok(NbdListener {
            listener,
            addr,
            limits,
            stats: Arc::new(NbdStats::default()),
            _socket: socket,
            memory: MemoryBudget::process(),
        })
    }

    /// Charge this listener's connections to `memory` instead of the process budget.
    pub fn with_memory(mut self, memory: Arc<MemoryBudget>) -> NbdListener {
        self.memory = memory;
        self
    }

    /// The memory budget its connections are charged to.
    pub fn memory(&self) -> Arc<MemoryBudget> {
        self.memory.clone()
    }

    /// The listener's counters.
    pub fn stats(&self) -> Arc<NbdStats> {
        self.stats.clone()
    }

    /// The bound address (with the real port when 0 was asked for).
    pub fn addr(&self) -> &ExportAddr {
        &self.addr
    }

    /// Accept connections forever, each served by its own task. Stop it by dropping (aborting)
    /// the future.
    pub async fn serve(self, dev: Arc<BlockDev>, name: String) -> Result<(), ExportError> {
        self.serve_set(super::DevSet::one(&name, dev)?).await
    }

    /// [`NbdListener::serve`] for every device of `set`, each an export of its name (the
    /// first the default); a device added to the set (or replaced, resized) is offered to
    /// the clients that connect after it.
    pub async fn serve_set(self, set: super::DevSet) -> Result<(), ExportError> {
        let mut conns = JoinSet::new();
        let (limits, stats) = (self.limits, self.stats.clone());
        let peers = Arc::new(Peers::default());
        loop {
            let accepted = match &self.listener {
                Listener::Unix(l) => l.accept().await.map(|(s, _)| {
                    let cred = s.peer_cred().ok();
                    let peer = cred.map_or(Peer::Unknown, |c| Peer::Uid(c.uid()));
                    (Stream::Unix(s, cred.and_then(|c| c.pid())), peer)
                }),
                Listener::Tcp(l) => l.accept().await.map(|(s, peer)| {
                    let _ = s.set_nodelay(true);
                    tracing::debug!(%peer, "nbd connection");
                    (Stream::Tcp(s), Peer::Ip(peer.ip()))
                }),
            };
            let (stream, peer) = match accepted {
                Ok(s) => s,
                Err(e) => {
                    // Out of file descriptors, a client that reset before we took it: the
                    // listener must outlive it. Pause so a lasting error does not spin.
                    stats.accept_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!("nbd: accept failed: {e}; trying again");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            };
            // Connections that ended while we waited for this one no longer count.
            while conns.try_join_next().is_some() {}
            if conns.len() >= limits.max_connections {
                stats.refused.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    max = limits.max_connections,
                    "nbd: connection refused: the export serves its maximum of clients"
                );
                drop(stream);
                continue;
            }
            let Some(slot) = peers.take(peer, limits.max_per_peer) else {
                stats.refused_per_peer.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    %peer,
                    max = limits.max_per_peer,
                    "nbd: connection refused: this peer holds its maximum of connections"
                );
                drop(stream);
                continue;
            };
            let exports = offered(&set);
            let (stats, memory) = (stats.clone(), self.memory.clone());
            conns.spawn(async move {
                let _slot = slot;
                stats.connections.fetch_add(1, Ordering::Relaxed);
                let c = Conn {
                    limits,
                    stats: stats.clone(),
                    memory,
                };
                let pids = || stats.client_pids.lock().unwrap_or_else(|e| e.into_inner());
                match stream {
                    Stream::Unix(s, pid) => {
                        if let Some(p) = pid {
                            pids().push(p);
                        }
                        run_logged(s, exports, c).await;
                        if let Some(p) = pid {
                            let mut v = pids();
                            if let Some(i) = v.iter().position(|&q| q == p) {
                                v.swap_remove(i);
                            }
                        }
                    }
                    Stream::Tcp(s) => run_logged(s, exports, c).await,
                }
                stats.connections.fetch_sub(1, Ordering::Relaxed);
                // Not awaited: the connection's place is free now, the trim follows.
                drop(tokio::task::spawn_blocking(return_freed_memory));
            });
        }
    }
}

enum Stream {
    /// With the client's pid, when the kernel says it.
    Unix(tokio::net::UnixStream, Option<i32>),
    Tcp(tokio::net::TcpStream),
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

/// What a client connecting now is offered: each device of `set` with what it advertises.
fn offered(set: &super::DevSet) -> Vec<(ExportInfo, Arc<BlockDev>)> {
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

async fn run_logged<S>(stream: S, exports: Vec<(ExportInfo, Arc<BlockDev>)>, c: Conn)
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
    let Conn {
        limits,
        stats,
        memory,
    } = c;
    let (mut rd, mut wr) = tokio::io::split(stream);
    let io = |what: &'static str| move |e| ExportError::io(what, e);
    let mut buf = BytesMut::with_capacity(256 << 10);
    let (infos, mut devs): (Vec<ExportInfo>, Vec<Arc<BlockDev>>) = exports.into_iter().unzip();
    let mut neg = Negotiation::with_exports(infos);
    let handshake = async {
        loop {
            let r = neg.handle_input(&mut buf);
            if let Some(out) = neg.poll_transmit() {
                wr.write_all(&out).await.map_err(io("nbd send"))?;
            }
            match r.map_err(ExportError::Nbd)? {
                Some(Outcome::Close) => {
                    let _ = wr.shutdown().await;
                    return Ok(None);
                }
                Some(Outcome::Transmission { structured }) => return Ok(Some(structured)),
                None => {}
            }
            if rd.read_buf(&mut buf).await.map_err(io("nbd receive"))? == 0 {
                return Ok(None);
            }
        }
    };
    let structured = match tokio::time::timeout(limits.handshake_timeout, handshake).await {
        Ok(Ok(Some(s))) => s,
        Ok(Ok(None)) => return Ok(()),
        Ok(Err(e)) => return Err(e),
        Err(_) => {
            stats.handshake_timeouts.fetch_add(1, Ordering::Relaxed);
            return Err(ExportError::io(
                "nbd handshake",
                std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "not finished within {} ms",
                        limits.handshake_timeout.as_millis()
                    ),
                ),
            ));
        }
    };
    wr.flush().await.map_err(io("nbd send"))?;
    let dev = match neg.chosen() {
        i if i < devs.len() => devs.swap_remove(i),
        _ => return Ok(()),
    };

    let (tx, mut rx) = mpsc::channel::<Reply>(MAX_INFLIGHT * 2);
    let (idle, writer_stats) = (limits.idle_timeout, stats.clone());
    // A reply the client does not take within the idle timeout ends the connection (and so
    // frees what its requests hold).
    let writer = tokio::spawn(async move {
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
                writer_stats.idle_closed.fetch_add(1, Ordering::Relaxed);
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the client took no reply data within the idle timeout",
                ));
            }
            drop(r.held);
        }
        w.flush().await?;
        w.shutdown().await
    });

    let size = dev.size();
    let slots = Arc::new(Semaphore::new(MAX_INFLIGHT));
    // A request larger than the budget could never start: the budget is at least one.
    let budget = Arc::new(Semaphore::new(limits.conn_bytes.max(MIN_BUDGET)));
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
                let got = loop {
                    // Idle: nothing executing, nothing arriving.
                    if tasks.is_empty() {
                        tokio::select! {
                            r = tokio::time::timeout(idle, rd.read_buf(&mut buf)) => break r.ok(),
                            _ = tx.closed() => break Some(Ok(0)),
                        }
                    }
                    tokio::select! {
                        r = rd.read_buf(&mut buf) => break Some(r),
                        _ = tx.closed() => break Some(Ok(0)),
                        Some(_) = tasks.join_next() => {}
                    }
                };
                match got {
                    // Idle, but nobody else needs the place: an idle mount is normal.
                    None if !under_pressure(&stats, &limits) => continue,
                    None => {
                        stats.idle_closed.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(
                            secs = idle.as_secs(),
                            "nbd: closing a connection idle for the idle timeout"
                        );
                        break Ok(());
                    }
                    Some(Ok(0)) => break Ok(()),
                    Some(Ok(_)) => continue,
                    Some(Err(e)) => break Err(ExportError::io("nbd receive", e)),
                }
            }
            Ok(Some(Decoded::Refused(req, e))) => {
                let head = status_reply(structured && req.command == Command::Read, req.cookie, e);
                let _ = tx
                    .send(Reply {
                        head,
                        data: Vec::new(),
                        held: None,
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
                    held: None,
                })
                .await;
            continue;
        }
        let Ok(permit) = slots.clone().acquire_owned().await else {
            break Ok(());
        };
        // The write's payload is in hand, the read's data is about to be: both count until
        // the reply is written. Nothing more is read from the client until there is room.
        let bytes = match req.command {
            Command::Read => dev.read_buffer_len(req.offset, req.length as usize),
            _ => payload.len(),
        };
        // A connection whose writer is gone (the client went or stalled) takes nothing more.
        let held = tokio::select! {
            h = Held::take(&budget, &memory, bytes, &stats) => h,
            _ = tx.closed() => None,
        };
        let Some(held) = held else {
            break Ok(());
        };
        let (dev, tx) = (dev.clone(), tx.clone());
        tasks.spawn(async move {
            let mut reply = execute(&dev, req, payload, structured).await;
            reply.held = Some(held);
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
        _ => {
            return Reply {
                head: status_reply(false, req.cookie, errno::EINVAL),
                data: Vec::new(),
                held: None,
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
        held: None,
    }
}

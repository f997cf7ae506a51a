//! The NBD server on tokio: listeners (unix socket or TCP) that accept clients within the
//! connection limits and run each connection in a task of its own ([`super::nbd_conn`]).
//! Every connection serves the same [`BlockDev`], so flushes on one cover
//! writes completed on any (CAN_MULTI_CONN).
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
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::task::JoinSet;

use super::nbd_budget::{MemoryBudget, NbdLimits, NbdStats};
use super::nbd_conn::{offered, run_logged, Conn};
use super::socket_file::{bind_listener, SocketFile};
use super::{BlockDev, ExportError};

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

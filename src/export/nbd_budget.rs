//! What NBD clients may make the server hold, and its counters: the largest request,
//! requests in flight per connection, bytes per connection ([`NbdLimits`]) and for every
//! connection of the process together ([`MemoryBudget`]), taken per request ([`Held`]) before
//! the next one is read.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

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
pub(super) const MIN_BUDGET: usize = MAX_PAYLOAD as usize + (2 << 20);

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
pub(super) struct Held {
    _conn: Option<OwnedSemaphorePermit>,
    _process: Option<OwnedSemaphorePermit>,
    n: usize,
    stats: Arc<NbdStats>,
    memory: Arc<MemoryBudget>,
}

impl Held {
    /// The connection's share first, so a connection waiting for its own room holds nothing
    /// of the process budget.
    pub(super) async fn take(
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

/// Three quarters of the listener's places are taken: idle connections give theirs back.
pub(super) fn under_pressure(stats: &NbdStats, limits: &NbdLimits) -> bool {
    let max = limits.max_connections.max(1);
    stats.connections.load(Ordering::SeqCst) >= max - max / 4
}

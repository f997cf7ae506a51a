//! Block-device exports of a remote namespace: an NBD server ([`nbd`] and [`nbd_handshake`]
//! are the sans-I/O protocol; [`nbd_server`], [`nbd_conn`] and [`nbd_budget`] the tokio side)
//! and a single-file FUSE file system ([`fuse`]) that `losetup` turns into a block device where
//! the kernel has no NBD driver.
//!
//! Both sit on [`BlockDev`]: byte-addressed reads and writes over a namespace of a
//! [`Subsystem`](crate::multipath::Subsystem) (one controller, or several paths to the same
//! subsystem), with read-modify-write for requests that do not start or end on a block
//! boundary, large requests split at the paths' transfer limit and the pieces issued
//! concurrently. Whatever recovery or failover happens underneath shows up here only as
//! latency.

pub mod devset;
pub mod fuse;
pub mod nbd;
pub mod nbd_budget;
pub mod nbd_conn;
pub mod nbd_handshake;
pub mod nbd_server;
pub mod socket_file;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;

use tokio::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::multipath::MpNamespace;
use crate::transport::{Controller, HostError, NsInfo};

pub use devset::DevSet;
pub use fuse::{mount_fuse, mount_fuse_set, FuseFiles, FuseMount};
pub use nbd_budget::{MemoryBudget, NbdLimits, NbdStats};
pub use nbd_server::{ExportAddr, NbdListener};
pub use socket_file::{bind_listener, bind_socket, same_user, SocketFile};

/// NVMe Write Zeroes carries a 16-bit 0-based block count.
const MAX_ZERO_BLOCKS: u64 = 1 << 16;
/// A Dataset Management range carries a 32-bit block count.
const MAX_TRIM_BLOCKS: u64 = u32::MAX as u64;
/// Stripe locks of a device (block `lba` maps to stripe `lba % STRIPES`); see [`BlockDev`].
const STRIPES: usize = 64;

/// Errors of the export layer. `Host` errors are whatever the controller reported (transient
/// ones are retried underneath by the recovery path, so what reaches here is final).
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error(transparent)]
    Host(#[from] HostError),
    /// The request reaches past the end of the device. Permanent.
    #[error("{len} bytes at offset {offset} reach past the end of the {size}-byte device")]
    OutOfRange { offset: u64, len: u64, size: u64 },
    /// An export address that is neither `unix:PATH` nor `IP:PORT`.
    #[error("bad export address {0:?}: expected unix:PATH or IP:PORT")]
    BadAddr(String),
    /// A TCP export on an address other than loopback, without the user's explicit consent:
    /// NBD has no authentication, so anyone who can reach it can read and write the namespace.
    #[error("{0} is not a loopback address: NBD has no authentication; serve on 127.0.0.1 or a unix socket, or pass --nbd-allow-remote to expose the namespace to the network")]
    RemoteRefused(std::net::SocketAddr),
    /// The NBD client broke the protocol; its connection is closed.
    #[error("NBD protocol: {0}")]
    Nbd(#[from] nbd::NbdError),
    /// A buffer for a request could not be allocated. Transient: the request fails, the
    /// process and every other request go on.
    #[error("no memory for a {bytes}-byte buffer; retry later or send smaller requests")]
    NoMemory { bytes: usize },
    /// Socket or mount I/O.
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

impl ExportError {
    pub(crate) fn io(what: impl Into<String>, source: std::io::Error) -> ExportError {
        ExportError::Io {
            what: what.into(),
            source,
        }
    }

    /// The errno a block-device client should see (NBD reply error, FUSE reply).
    pub fn errno(&self) -> i32 {
        match self {
            ExportError::OutOfRange { .. } => libc::ENOSPC,
            ExportError::NoMemory { .. } => libc::ENOMEM,
            ExportError::BadAddr(_) | ExportError::RemoteRefused(_) | ExportError::Nbd(_) => {
                libc::EINVAL
            }
            ExportError::Host(HostError::Invalid(_)) => libc::EINVAL,
            ExportError::Host(_) | ExportError::Io { .. } => libc::EIO,
        }
    }
}

/// A namespace as a byte-addressed device.
///
/// Every request that changes blocks holds the stripe locks of the blocks it touches for as
/// long as it runs: shared for blocks it writes whole (such writes may overlap in time, the
/// device keeps one of them), exclusive for a block it read-modify-writes, because the bytes
/// it does not write are put back from its read and would undo any write that landed in
/// between. Locks are taken in ascending stripe order, so requests never wait on one another
/// in a cycle. Reads take none: a read that overlaps a write sees either.
pub struct BlockDev {
    /// The namespace over its paths: requests fail once another one is behind its NSID on
    /// every path.
    mp: Arc<MpNamespace>,
    ns: NsInfo,
    block: u64,
    size: u64,
    chunk: usize,
    stripes: Box<[RwLock<()>]>,
}

/// The blocks a byte range touches, and which of them it only partly covers.
#[derive(Clone, Copy)]
struct Span {
    first: u64,
    /// One past the last block.
    end: u64,
    /// The first block, when the range starts inside it.
    head: Option<u64>,
    /// The last block, when the range ends inside it (and it is not the partial head).
    tail: Option<u64>,
}

/// The stripe locks a request holds until it is dropped.
struct Locks<'a> {
    _shared: Vec<RwLockReadGuard<'a, ()>>,
    _exclusive: Vec<RwLockWriteGuard<'a, ()>>,
}

type Io<'a> = Pin<Box<dyn Future<Output = Result<(), HostError>> + Send + 'a>>;

/// Run `ios` concurrently on the calling task (they borrow its buffers, so they cannot be
/// spawned); the first error, after all have ended.
async fn all_of(ios: Vec<Io<'_>>) -> Result<(), HostError> {
    let mut ios: Vec<Option<Io<'_>>> = ios.into_iter().map(Some).collect();
    let mut first_err = None;
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for slot in ios.iter_mut() {
            if let Some(io) = slot {
                match io.as_mut().poll(cx) {
                    Poll::Ready(r) => {
                        if let Err(e) = r {
                            first_err.get_or_insert(e);
                        }
                        *slot = None;
                    }
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
    .await;
    first_err.map_or(Ok(()), Err)
}

impl BlockDev {
    /// Namespace `nsid` of one controller.
    pub fn new(ctrl: Arc<Controller>, nsid: u32) -> Result<BlockDev, ExportError> {
        Ok(Self::on(Arc::new(MpNamespace::single(ctrl, nsid)?)))
    }

    /// A namespace over every path of its subsystem.
    pub fn on(mp: Arc<MpNamespace>) -> BlockDev {
        let ns = mp.info();
        let block = ns.block_size as u64;
        let chunk = ((mp.max_transfer() as u64 / block).max(1) * block) as usize;
        BlockDev {
            mp,
            ns,
            block,
            size: ns.bytes(),
            chunk,
            stripes: (0..STRIPES).map(|_| RwLock::new(())).collect(),
        }
    }

    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Logical block size of the namespace.
    pub fn block_size(&self) -> u32 {
        self.block as u32
    }

    /// The namespace over its paths.
    pub fn multipath(&self) -> &Arc<MpNamespace> {
        &self.mp
    }

    /// The namespace this device serves, as it was when the device was made.
    pub fn namespace(&self) -> NsInfo {
        self.ns
    }

    fn check(&self, offset: u64, len: u64) -> Result<(), ExportError> {
        self.mp.same_namespace()?;
        match offset.checked_add(len) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(ExportError::OutOfRange {
                offset,
                len,
                size: self.size,
            }),
        }
    }

    /// The buffer [`BlockDev::read_at`] allocates for `len` bytes at `offset`: the whole
    /// blocks they lie in.
    pub fn read_buffer_len(&self, offset: u64, len: usize) -> usize {
        if len == 0 {
            return 0;
        }
        let first = offset / self.block;
        let end = (offset.saturating_add(len as u64)).div_ceil(self.block);
        (end.saturating_sub(first) * self.block) as usize
    }

    /// Read `len` bytes at `offset`, any alignment.
    pub async fn read_at(&self, offset: u64, len: usize) -> Result<Vec<u8>, ExportError> {
        self.check(offset, len as u64)?;
        if len == 0 {
            return Ok(Vec::new());
        }
        let first = offset / self.block;
        let mut data = zeroed(self.read_buffer_len(offset, len))?;
        self.read_blocks(first, &mut data).await?;
        let skip = (offset - first * self.block) as usize;
        if skip != 0 || data.len() != len {
            // In place: no second buffer.
            data.drain(..skip);
            data.truncate(len);
        }
        Ok(data)
    }

    /// Write `data` at `offset`, any alignment; `fua` returns only once it is durable.
    pub async fn write_at(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), ExportError> {
        self.modify(offset, data.len() as u64, fua, |span| async move {
            self.write_locked(offset, data, &span).await
        })
        .await
    }

    /// Run `op` over `offset..offset+len` holding the locks of its blocks; then, with `fua`,
    /// flush.
    async fn modify<F>(
        &self,
        offset: u64,
        len: u64,
        fua: bool,
        op: impl FnOnce(Span) -> F,
    ) -> Result<(), ExportError>
    where
        F: Future<Output = Result<(), ExportError>>,
    {
        self.check(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let span = self.span(offset, len);
        let locks = self.lock(&span).await;
        let r = op(span).await;
        drop(locks);
        r?;
        if fua {
            self.flush().await?;
        }
        Ok(())
    }

    fn span(&self, offset: u64, len: u64) -> Span {
        let bs = self.block;
        let end_byte = offset + len;
        let first = offset / bs;
        let end = end_byte.div_ceil(bs);
        let head = (offset % bs != 0).then_some(first);
        let tail = (end_byte % bs != 0 && (end - 1 != first || head.is_none())).then_some(end - 1);
        Span {
            first,
            end,
            head,
            tail,
        }
    }

    fn stripe(&self, lba: u64) -> usize {
        (lba % self.stripes.len() as u64) as usize
    }

    /// The stripe locks of `span`'s blocks: exclusive for its partial blocks, shared for the
    /// rest, in ascending stripe order.
    async fn lock(&self, span: &Span) -> Locks<'_> {
        #[derive(Clone, Copy, PartialEq)]
        enum Mode {
            Free,
            Shared,
            Exclusive,
        }
        let mut mode = [Mode::Free; STRIPES];
        if span.end - span.first >= STRIPES as u64 {
            mode = [Mode::Shared; STRIPES];
        } else {
            for lba in span.first..span.end {
                mode[self.stripe(lba)] = Mode::Shared;
            }
        }
        for lba in [span.head, span.tail].into_iter().flatten() {
            mode[self.stripe(lba)] = Mode::Exclusive;
        }
        let (mut shared, mut exclusive) = (Vec::new(), Vec::new());
        for (i, m) in mode.iter().enumerate() {
            match m {
                Mode::Free => {}
                Mode::Shared => shared.push(self.stripes[i].read().await),
                Mode::Exclusive => exclusive.push(self.stripes[i].write().await),
            }
        }
        Locks {
            _shared: shared,
            _exclusive: exclusive,
        }
    }

    /// [`BlockDev::write_at`] with `span`'s locks held: partial blocks merged with what they
    /// hold, whole blocks written straight from `data`, all in flight together.
    async fn write_locked(&self, offset: u64, data: &[u8], span: &Span) -> Result<(), ExportError> {
        let bs = self.block;
        let mut ios: Vec<Io<'_>> = Vec::with_capacity(3);
        let mut whole = span.first..span.end;
        let mut rest = data;
        if let Some(lba) = span.head {
            let at = (offset - lba * bs) as usize;
            let n = rest.len().min(bs as usize - at);
            ios.push(Box::pin(self.merge_block(lba, at, &rest[..n])));
            rest = &rest[n..];
            whole.start += 1;
        }
        if let Some(lba) = span.tail {
            let n = ((offset + data.len() as u64) - lba * bs) as usize;
            let (body, tail) = rest.split_at(rest.len() - n);
            ios.push(Box::pin(self.merge_block(lba, 0, tail)));
            rest = body;
            whole.end -= 1;
        }
        if !whole.is_empty() {
            ios.push(Box::pin(self.write_blocks(whole.start, rest)));
        }
        Ok(all_of(ios).await?)
    }

    /// Read block `lba`, put `bytes` at `at` in it, write it back. The caller holds its stripe
    /// exclusively.
    async fn merge_block(&self, lba: u64, at: usize, bytes: &[u8]) -> Result<(), HostError> {
        let mut b = self.mp.read(lba, self.block as usize).await?;
        b[at..at + bytes.len()].copy_from_slice(bytes);
        self.mp.write(lba, &b).await
    }

    /// Zero `len` bytes at `offset`: Write Zeroes for the whole blocks, read-modify-write for
    /// partial ones at either end.
    pub async fn write_zeroes_at(
        &self,
        offset: u64,
        len: u64,
        fua: bool,
    ) -> Result<(), ExportError> {
        self.modify(offset, len, fua, |span| async move {
            self.write_zeroes_locked(offset, len, &span).await
        })
        .await
    }

    async fn write_zeroes_locked(
        &self,
        offset: u64,
        len: u64,
        span: &Span,
    ) -> Result<(), ExportError> {
        let bs = self.block;
        let end = offset + len;
        let first_full = offset.div_ceil(bs);
        let end_full = end / bs;
        if first_full >= end_full {
            // Inside one block, or straddling two without covering either: under two blocks.
            return self
                .write_locked(offset, &vec![0u8; len as usize], span)
                .await;
        }
        let zeros = vec![0u8; bs as usize];
        let mut ios: Vec<Io<'_>> = Vec::with_capacity(3);
        if let Some(lba) = span.head {
            let at = (offset - lba * bs) as usize;
            ios.push(Box::pin(self.merge_block(lba, at, &zeros[at..])));
        }
        if let Some(lba) = span.tail {
            ios.push(Box::pin(self.merge_block(
                lba,
                0,
                &zeros[..(end - lba * bs) as usize],
            )));
        }
        ios.push(Box::pin(async move {
            let mut lba = first_full;
            while lba < end_full {
                let n = (end_full - lba).min(MAX_ZERO_BLOCKS);
                self.mp.write_zeroes(lba, n as u32).await?;
                lba += n;
            }
            Ok(())
        }));
        Ok(all_of(ios).await?)
    }

    /// Discard the whole blocks inside `offset..offset+len` (a hint: partial blocks are left
    /// as they are, which TRIM allows).
    pub async fn trim(&self, offset: u64, len: u64) -> Result<(), ExportError> {
        self.check(offset, len)?;
        let first = offset.div_ceil(self.block);
        let end = (offset + len) / self.block;
        if first >= end {
            return Ok(());
        }
        let span = Span {
            first,
            end,
            head: None,
            tail: None,
        };
        let _locks = self.lock(&span).await;
        let mut lba = first;
        while lba < end {
            let n = (end - lba).min(MAX_TRIM_BLOCKS);
            self.mp.deallocate(&[(lba, n as u32)]).await?;
            lba += n;
        }
        Ok(())
    }

    pub async fn flush(&self) -> Result<(), ExportError> {
        self.mp.same_namespace()?;
        Ok(self.mp.flush().await?)
    }

    /// Whole blocks from `lba` into `out`, split at the transfer limit, the pieces in flight
    /// together, each read straight into its part of `out`.
    async fn read_blocks(&self, lba: u64, out: &mut [u8]) -> Result<(), ExportError> {
        let per = self.chunk as u64 / self.block;
        let ios = out
            .chunks_mut(self.chunk)
            .enumerate()
            .map(|(i, part)| -> Io<'_> { Box::pin(self.mp.read_into(lba + i as u64 * per, part)) })
            .collect();
        Ok(all_of(ios).await?)
    }

    /// Whole blocks from `data` at `lba`, split and in flight together as [`Self::read_blocks`].
    async fn write_blocks(&self, lba: u64, data: &[u8]) -> Result<(), HostError> {
        let per = self.chunk as u64 / self.block;
        let ios = data
            .chunks(self.chunk)
            .enumerate()
            .map(|(i, part)| -> Io<'_> { Box::pin(self.mp.write(lba + i as u64 * per, part)) })
            .collect();
        all_of(ios).await
    }
}

/// A zero-filled buffer of `len` bytes, or [`ExportError::NoMemory`] when the allocator has
/// none: a peer's request must not abort the process.
pub(crate) fn zeroed(len: usize) -> Result<Vec<u8>, ExportError> {
    let mut v = Vec::new();
    v.try_reserve_exact(len)
        .map_err(|_| ExportError::NoMemory { bytes: len })?;
    v.resize(len, 0);
    Ok(v)
}

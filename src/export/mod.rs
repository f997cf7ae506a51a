//! Block-device exports of a remote namespace: an NBD server ([`nbd`] is the sans-I/O
//! protocol, [`nbd_server`] the tokio side) and a single-file FUSE file system ([`fuse`]) that
//! `losetup` turns into a block device where the kernel has no NBD driver.
//!
//! Both sit on [`BlockDev`]: byte-addressed reads and writes over a [`Controller`], with
//! read-modify-write for requests that do not start or end on a block boundary, large requests
//! split at [`Controller::max_transfer`] and the pieces issued concurrently. The exports hold the
//! same `Arc<Controller>` as everything else, so whatever recovery the controller does under a
//! device reset shows up here only as latency.

pub mod devset;
pub mod fuse;
pub mod nbd;
pub mod nbd_server;
pub mod socket_file;

use std::sync::Arc;

use tokio::task::JoinSet;

use crate::transport::{Controller, HostError, NsInfo};

pub use devset::DevSet;
pub use fuse::{mount_fuse, mount_fuse_set, FuseFiles, FuseMount};
pub use nbd_server::{ExportAddr, NbdLimits, NbdListener, NbdStats};
pub use socket_file::{bind_listener, bind_socket, SocketFile};

/// NVMe Write Zeroes carries a 16-bit 0-based block count.
const MAX_ZERO_BLOCKS: u64 = 1 << 16;
/// A Dataset Management range carries a 32-bit block count.
const MAX_TRIM_BLOCKS: u64 = u32::MAX as u64;
/// Read-modify-write locks: a partial write holds the stripe of each block it merges into, so
/// two partial writes into the same block cannot lose one another's bytes.
const RMW_STRIPES: usize = 64;

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
            ExportError::BadAddr(_) | ExportError::RemoteRefused(_) | ExportError::Nbd(_) => {
                libc::EINVAL
            }
            ExportError::Host(HostError::Invalid(_)) => libc::EINVAL,
            ExportError::Host(_) | ExportError::Io { .. } => libc::EIO,
        }
    }
}

/// A namespace as a byte-addressed device.
pub struct BlockDev {
    ctrl: Arc<Controller>,
    nsid: u32,
    /// The namespace as opened: requests fail once another one is behind `nsid`.
    ns: NsInfo,
    block: u64,
    size: u64,
    chunk: usize,
    stripes: Box<[tokio::sync::Mutex<()>]>,
}

impl BlockDev {
    pub fn new(ctrl: Arc<Controller>, nsid: u32) -> Result<BlockDev, ExportError> {
        let ns = ctrl.namespace(nsid)?;
        let block = ns.block_size as u64;
        let chunk = ((ctrl.max_transfer() as u64 / block).max(1) * block) as usize;
        Ok(BlockDev {
            ctrl,
            nsid,
            ns,
            block,
            size: ns.bytes(),
            chunk,
            stripes: (0..RMW_STRIPES)
                .map(|_| tokio::sync::Mutex::new(()))
                .collect(),
        })
    }

    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Logical block size of the namespace.
    pub fn block_size(&self) -> u32 {
        self.block as u32
    }

    pub fn controller(&self) -> &Arc<Controller> {
        &self.ctrl
    }

    /// The namespace this device serves, as it was when the device was made.
    pub fn namespace(&self) -> NsInfo {
        self.ns
    }

    fn check(&self, offset: u64, len: u64) -> Result<(), ExportError> {
        self.ctrl.same_namespace(&self.ns)?;
        match offset.checked_add(len) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(ExportError::OutOfRange {
                offset,
                len,
                size: self.size,
            }),
        }
    }

    /// Read `len` bytes at `offset`, any alignment.
    pub async fn read_at(&self, offset: u64, len: usize) -> Result<Vec<u8>, ExportError> {
        self.check(offset, len as u64)?;
        if len == 0 {
            return Ok(Vec::new());
        }
        let first = offset / self.block;
        let end = (offset + len as u64).div_ceil(self.block);
        let mut data = self.read_blocks(first, end - first).await?;
        let skip = (offset - first * self.block) as usize;
        if skip != 0 || data.len() != len {
            data.drain(..skip);
            data.truncate(len);
        }
        Ok(data)
    }

    /// Write `data` at `offset`, any alignment; `fua` returns only once it is durable.
    pub async fn write_at(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), ExportError> {
        self.check(offset, data.len() as u64)?;
        if data.is_empty() {
            return Ok(());
        }
        let end = offset + data.len() as u64;
        if offset % self.block == 0 && end % self.block == 0 {
            self.write_blocks(offset / self.block, data).await?;
        } else {
            self.write_unaligned(offset, data).await?;
        }
        if fua {
            self.flush().await?;
        }
        Ok(())
    }

    /// Read-modify-write of the partial first and last blocks, under their stripe locks.
    async fn write_unaligned(&self, offset: u64, data: &[u8]) -> Result<(), ExportError> {
        let bs = self.block;
        let end = offset + data.len() as u64;
        let first = offset / bs;
        let last = (end - 1) / bs;
        let head_partial = offset % bs != 0;
        let tail_partial = end % bs != 0;
        let mut locks: Vec<usize> = Vec::with_capacity(2);
        if head_partial {
            locks.push(self.stripe(first));
        }
        if tail_partial {
            locks.push(self.stripe(last));
        }
        locks.sort_unstable();
        locks.dedup();
        let mut guards = Vec::with_capacity(locks.len());
        for i in locks {
            guards.push(self.stripes[i].lock().await);
        }
        let mut buf = vec![0u8; ((last + 1 - first) * bs) as usize];
        if head_partial {
            let b = self.ctrl.read(self.nsid, first, bs as usize).await?;
            buf[..bs as usize].copy_from_slice(&b);
        }
        if tail_partial && (last != first || !head_partial) {
            let b = self.ctrl.read(self.nsid, last, bs as usize).await?;
            let at = buf.len() - bs as usize;
            buf[at..].copy_from_slice(&b);
        }
        let at = (offset - first * bs) as usize;
        buf[at..at + data.len()].copy_from_slice(data);
        self.write_blocks(first, &buf).await?;
        drop(guards);
        Ok(())
    }

    fn stripe(&self, lba: u64) -> usize {
        (lba % self.stripes.len() as u64) as usize
    }

    /// Zero `len` bytes at `offset`: Write Zeroes for the whole blocks, read-modify-write for
    /// partial ones at either end.
    pub async fn write_zeroes_at(
        &self,
        offset: u64,
        len: u64,
        fua: bool,
    ) -> Result<(), ExportError> {
        self.check(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let bs = self.block;
        let end = offset + len;
        let first_full = offset.div_ceil(bs);
        let end_full = end / bs;
        if first_full >= end_full {
            // Inside one block, or straddling two without covering either.
            let zeros = vec![0u8; len as usize];
            return self.write_at(offset, &zeros, fua).await;
        }
        if offset % bs != 0 {
            let n = first_full * bs - offset;
            self.write_unaligned(offset, &vec![0u8; n as usize]).await?;
        }
        if end % bs != 0 {
            let n = end - end_full * bs;
            self.write_unaligned(end_full * bs, &vec![0u8; n as usize])
                .await?;
        }
        let mut lba = first_full;
        while lba < end_full {
            let n = (end_full - lba).min(MAX_ZERO_BLOCKS);
            self.ctrl.write_zeroes(self.nsid, lba, n as u32).await?;
            lba += n;
        }
        if fua {
            self.flush().await?;
        }
        Ok(())
    }

    /// Discard the whole blocks inside `offset..offset+len` (a hint: partial blocks are left
    /// as they are, which TRIM allows).
    pub async fn trim(&self, offset: u64, len: u64) -> Result<(), ExportError> {
        self.check(offset, len)?;
        let first = offset.div_ceil(self.block);
        let end = (offset + len) / self.block;
        let mut lba = first;
        while lba < end {
            let n = (end - lba).min(MAX_TRIM_BLOCKS);
            self.ctrl.deallocate(self.nsid, &[(lba, n as u32)]).await?;
            lba += n;
        }
        Ok(())
    }

    pub async fn flush(&self) -> Result<(), ExportError> {
        self.ctrl.same_namespace(&self.ns)?;
        Ok(self.ctrl.flush(self.nsid).await?)
    }

    /// Whole blocks, split at the transfer limit, the pieces in flight together.
    async fn read_blocks(&self, lba: u64, blocks: u64) -> Result<Vec<u8>, ExportError> {
        let bytes = (blocks * self.block) as usize;
        if bytes <= self.chunk {
            return Ok(self.ctrl.read(self.nsid, lba, bytes).await?);
        }
        let per = (self.chunk as u64) / self.block;
        let mut set = JoinSet::new();
        let mut at = 0u64;
        while at < blocks {
            let n = (blocks - at).min(per);
            let (c, nsid, bs) = (self.ctrl.clone(), self.nsid, self.block);
            set.spawn(async move {
                let r = c.read(nsid, lba + at, (n * bs) as usize).await;
                (at, r)
            });
            at += n;
        }
        let mut out = vec![0u8; bytes];
        while let Some(j) = set.join_next().await {
            let (at, r) = j.map_err(|e| HostError::Transport(format!("read task: {e}")))?;
            let part = r?;
            let o = (at * self.block) as usize;
            out[o..o + part.len()].copy_from_slice(&part);
        }
        Ok(out)
    }

    async fn write_blocks(&self, lba: u64, data: &[u8]) -> Result<(), ExportError> {
        if data.len() <= self.chunk {
            return Ok(self.ctrl.write(self.nsid, lba, data).await?);
        }
        let mut set = JoinSet::new();
        for (i, part) in data.chunks(self.chunk).enumerate() {
            let (c, nsid) = (self.ctrl.clone(), self.nsid);
            let slba = lba + (i * self.chunk) as u64 / self.block;
            let part = part.to_vec();
            set.spawn(async move { c.write(nsid, slba, &part).await });
        }
        let mut first_err = None;
        while let Some(j) = set.join_next().await {
            let r = j.map_err(|e| HostError::Transport(format!("write task: {e}")));
            if let Err(e) = r.and_then(|r| r) {
                first_err.get_or_insert(e);
            }
        }
        match first_err {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }
}

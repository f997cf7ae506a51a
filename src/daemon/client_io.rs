//! Block I/O through the daemon's controllers, for any front end: the requests are split on
//! block boundaries into pieces the control protocol takes ([`MAX_READ`],
//! [`MAX_WRITE_PATTERN`]), and bulk data travels through a passed descriptor. Progress is
//! handed to the caller; nothing here prints.

use std::os::fd::{AsFd, BorrowedFd};

use anyhow::{bail, Context, Result};

use crate::daemon::client::Client;
use crate::daemon::io::OnProgress;
use crate::daemon::proto::{
    CopiedReply, ReadReply, Request, VerifyReply, WriteReply, MAX_READ, MAX_WRITE_PATTERN,
};

/// Bytes per `verify` request of [`Client::verify_pieces`] (progress is reported between
/// them, about a second's work each).
const VERIFY_PIECE: usize = 16 << 20;

/// Pieces of at most `max` bytes (whole blocks of `bs`) covering `size` bytes from `lba`:
/// `(lba, offset, len)`.
fn pieces(
    lba: u64,
    size: usize,
    max: usize,
    bs: usize,
) -> impl Iterator<Item = (u64, usize, usize)> {
    let step = (max / bs.max(1)).max(1) * bs.max(1);
    (0..size)
        .step_by(step)
        .map(move |off| (lba + (off / bs.max(1)) as u64, off, step.min(size - off)))
}

impl Client {
    /// The block size of controller `name`'s namespace `nsid` (to split I/O on block
    /// boundaries), with the one-line error a wrong name or namespace deserves.
    pub async fn block_size(&mut self, name: &str, nsid: u32) -> Result<usize> {
        let v = self.list().await?;
        let Some(c) = v.controllers.iter().find(|c| c.name == name) else {
            bail!("no controller {name}; `nvmf-rdma list` shows them");
        };
        let Some(ns) = c.namespaces.iter().find(|n| n.nsid == nsid) else {
            bail!("{name} has no namespace {nsid}; `nvmf-rdma list -o json` shows its namespaces");
        };
        match ns.block_size {
            0 => bail!("the daemon did not say {name}'s block size"),
            b => Ok(b as usize),
        }
    }

    /// `size` bytes from `lba`, in pieces of at most [`MAX_READ`].
    pub async fn read_blocks(
        &mut self,
        name: &str,
        nsid: u32,
        lba: u64,
        size: usize,
    ) -> Result<Vec<u8>> {
        use base64::Engine;
        let bs = self.block_size(name, nsid).await?;
        let mut data = Vec::with_capacity(size);
        for (at, _, len) in pieces(lba, size, MAX_READ, bs) {
            let req = Request::Read {
                device: name.into(),
                nsid,
                lba: at,
                size: len as u64,
            };
            let v: ReadReply = self.call(&req).await?;
            let piece = base64::engine::general_purpose::STANDARD
                .decode(v.data)
                .context("the daemon's data is not base64")?;
            if piece.len() != len {
                bail!("the daemon sent {} bytes for {len}", piece.len());
            }
            data.extend_from_slice(&piece);
        }
        Ok(data)
    }

    /// `size` bytes from `lba` into `out`: the daemon writes into the descriptor passed to
    /// it. `progress(done, total)` as it goes.
    pub async fn read_to(
        &mut self,
        name: &str,
        nsid: u32,
        lba: u64,
        size: usize,
        out: BorrowedFd<'_>,
        progress: OnProgress<'_>,
    ) -> Result<()> {
        self.block_size(name, nsid).await?;
        let req = Request::ReadToFd {
            device: name.into(),
            nsid,
            lba,
            size: size as u64,
            progress: true,
        };
        let _: CopiedReply = self.call_with_fd(&req, out, progress).await?;
        Ok(())
    }

    /// The whole of `file` at `lba`: the daemon reads it itself, through the descriptor
    /// passed to it. The bytes written.
    pub async fn write_file(
        &mut self,
        name: &str,
        nsid: u32,
        lba: u64,
        file: &std::fs::File,
        progress: OnProgress<'_>,
    ) -> Result<usize> {
        self.block_size(name, nsid).await?;
        let len = file.metadata().context("read the input file")?.len();
        if len == 0 {
            return Ok(0);
        }
        let req = Request::WriteFromFd {
            device: name.into(),
            nsid,
            lba,
            size: len,
            progress: true,
        };
        let r: CopiedReply = self.call_with_fd(&req, file.as_fd(), progress).await?;
        Ok(r.copied as usize)
    }

    /// `size` bytes of `pattern` at `lba`: nothing to send but the byte, the daemon fills.
    pub async fn write_pattern(
        &mut self,
        name: &str,
        nsid: u32,
        lba: u64,
        size: usize,
        pattern: u8,
    ) -> Result<()> {
        let bs = self.block_size(name, nsid).await?;
        for (at, _, len) in pieces(lba, size, MAX_WRITE_PATTERN, bs) {
            let req = Request::Write {
                device: name.into(),
                nsid,
                lba: at,
                data: None,
                size: Some(len as u64),
                pattern: Some(u64::from(pattern)),
            };
            let _: WriteReply = self.call(&req).await?;
        }
        Ok(())
    }

    /// The daemon writes a seeded pattern over `size` bytes in `chunk` pieces and reads it
    /// back, one request per [`VERIFY_PIECE`] (each piece its own seed), so
    /// `progress(done, total)` comes between them.
    #[allow(clippy::too_many_arguments)]
    pub async fn verify_pieces(
        &mut self,
        name: &str,
        nsid: u32,
        lba: u64,
        size: usize,
        chunk: usize,
        seed: u64,
        progress: OnProgress<'_>,
    ) -> Result<()> {
        let bs = self.block_size(name, nsid).await?;
        if chunk == 0 || chunk % bs != 0 || size % bs != 0 {
            bail!("--size and --chunk must be multiples of the {bs}-byte block size");
        }
        let piece = (VERIFY_PIECE / chunk).max(1) * chunk;
        for (i, (at, off, len)) in pieces(lba, size, piece, bs).enumerate() {
            let req = Request::Verify {
                device: name.into(),
                nsid,
                lba: at,
                size: len as u64,
                chunk: Some(chunk as u64),
                seed: Some(seed.wrapping_add(i as u64)),
            };
            let _: VerifyReply = self.call(&req).await?;
            progress((off + len) as u64, size as u64);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::pieces;

    #[test]
    fn pieces_are_whole_blocks_covering_the_range() {
        let p: Vec<_> = pieces(10, 10_000, 4096, 512).collect();
        assert_eq!(p, vec![(10, 0, 4096), (18, 4096, 4096), (26, 8192, 1808)]);
        // A limit below one block still moves a block at a time.
        let p: Vec<_> = pieces(0, 1024, 100, 512).collect();
        assert_eq!(p, vec![(0, 0, 512), (1, 512, 512)]);
    }
}

//! The daemon's block I/O requests: `read`, `write` and `verify` on a controller it holds,
//! so `nvmf-rdma read -d nvmf0` works as `nvme read` does on a device `nvme connect` made.
//! Sizes are bounded per request (`proto::MAX_READ`, ...); the CLI splits larger I/O. Bulk
//! data goes through a descriptor the client passes (`read-to-fd`, `write-from-fd`): the
//! daemon moves it between the namespace and that file or pipe in [`FD_PIECE`] pieces, the
//! next piece's file I/O overlapping the current one's NVMe I/O.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use crate::daemon::fdpass::wait_ready;
use crate::daemon::proto::{
    CopiedReply, ErrorCode, FdDir, IoRequest, ProtoError, ReadReply, Reply, VerifyReply, WriteReply,
};
use crate::transport::{Controller, HostError};
use base64::Engine;

/// Bytes per piece of `read-to-fd` and `write-from-fd`; two pieces are in memory at once.
pub const FD_PIECE: usize = 4 << 20;
/// How long the other end of a passed pipe may move no data before the request fails.
const FD_STALL: Duration = Duration::from_secs(30);
/// How often a request that asked for progress hears of it.
const PROGRESS_EVERY: Duration = Duration::from_millis(500);

/// Where the progress of a request goes: bytes done, bytes in all.
pub type OnProgress<'a> = &'a mut (dyn FnMut(u64, u64) + Send);

/// Do `io` on `c` (the controller named `name`); `fd` is the descriptor that came with the
/// request, if any.
pub async fn run_io(
    c: Arc<Controller>,
    name: &str,
    io: IoRequest,
    fd: Option<OwnedFd>,
    progress: OnProgress<'_>,
) -> Result<Reply, ProtoError> {
    let host = |what: &str, e: HostError| match e {
        HostError::Invalid(m) => {
            ProtoError::new(ErrorCode::BadRequest, format!("{name}: {what}: {m}")).hint(format!(
                "sizes are whole blocks within the namespace: `nvmf-rdma list -o json` shows \
                 {name}'s namespaces, their block size and blocks"
            ))
        }
        e => ProtoError::new(ErrorCode::Failed, format!("{name}: {what}: {e}")),
    };
    Ok(match io {
        IoRequest::Read { nsid, lba, size } => {
            let data = c.read(nsid, lba, size).await.map_err(|e| host("read", e))?;
            Reply::Read(ReadReply {
                data: base64::engine::general_purpose::STANDARD.encode(data),
            })
        }
        IoRequest::Write { nsid, lba, data } => {
            c.write(nsid, lba, &data)
                .await
                .map_err(|e| host("write", e))?;
            Reply::Write(WriteReply {
                written: data.len(),
            })
        }
        IoRequest::Verify {
            nsid,
            lba,
            size,
            chunk,
            seed,
        } => {
            // Bounded by proto::MAX_VERIFY, which fits a usize.
            let size = usize::try_from(size).unwrap_or(usize::MAX);
            verify(&c, nsid, lba, size, chunk, seed, &mut |_, _, _| {})
                .await
                .map_err(|e| match e.downcast::<HostError>() {
                    Ok(h) => host("verify", h),
                    Err(e) => ProtoError::new(ErrorCode::Failed, format!("{name}: verify: {e:#}")),
                })?;
            Reply::Verify(VerifyReply { verified: size })
        }
        IoRequest::Fd {
            dir,
            nsid,
            lba,
            size,
            progress: wanted,
        } => {
            let Some(fd) = fd else {
                return Err(ProtoError::new(
                    ErrorCode::BadRequest,
                    "no file descriptor came with the request",
                )
                .hint("send it with the request line (SCM_RIGHTS on the first byte)"));
            };
            let mut quiet = |_: u64, _: u64| {};
            let progress: OnProgress<'_> = if wanted { progress } else { &mut quiet };
            let what = match dir {
                FdDir::Read => "read",
                FdDir::Write => "write",
            };
            let copied = copy_fd(&c, dir, nsid, lba, size, fd, progress)
                .await
                .map_err(|e| match e {
                    FdError::Host(e) => host(what, e),
                    FdError::File(e) => ProtoError::new(
                        ErrorCode::Failed,
                        format!("{name}: {what}: the passed file: {e}"),
                    ),
                })?;
            Reply::Copied(CopiedReply { copied })
        }
    })
}

/// Why moving data through a passed descriptor failed.
enum FdError {
    Host(HostError),
    File(std::io::Error),
}

/// Move `size` bytes between namespace `nsid` of `c` (from `lba`) and `fd`.
async fn copy_fd(
    c: &Controller,
    dir: FdDir,
    nsid: u32,
    lba: u64,
    size: u64,
    fd: OwnedFd,
    progress: OnProgress<'_>,
) -> Result<u64, FdError> {
    let bs = u64::from(c.namespace(nsid).map_err(FdError::Host)?.block_size);
    let piece = (FD_PIECE as u64 / bs).max(1) * bs;
    let fd = Arc::new(fd);
    let mut done = 0u64;
    let mut told = Instant::now();
    // The file side of the piece before, still going.
    let mut pending: Option<tokio::task::JoinHandle<std::io::Result<Vec<u8>>>> = None;
    let mut spare = Vec::new();
    while done < size {
        let n = piece.min(size - done) as usize;
        let at = lba + done / bs;
        match dir {
            FdDir::Write => {
                let buf = match pending.take() {
                    Some(t) => join(t).await?,
                    None => file_read(fd.clone(), std::mem::take(&mut spare), n).await?,
                };
                let more = done + n as u64;
                if more < size {
                    let next = piece.min(size - more) as usize;
                    let (fd, b) = (fd.clone(), std::mem::take(&mut spare));
                    pending = Some(tokio::task::spawn_blocking(move || {
                        read_exact_fd(&fd, b, next)
                    }));
                }
                c.write(nsid, at, &buf).await.map_err(FdError::Host)?;
                spare = buf;
            }
            FdDir::Read => {
                let data = c.read(nsid, at, n).await.map_err(FdError::Host)?;
                if let Some(t) = pending.take() {
                    join(t).await?;
                }
                let fd = fd.clone();
                pending = Some(tokio::task::spawn_blocking(move || {
                    write_all_fd(&fd, &data).map(|_| data)
                }));
            }
        }
        done += n as u64;
        if told.elapsed() >= PROGRESS_EVERY {
            told = Instant::now();
            progress(done, size);
        }
    }
    if let Some(t) = pending.take() {
        join(t).await?;
    }
    progress(done, size);
    Ok(done)
}

async fn join(t: tokio::task::JoinHandle<std::io::Result<Vec<u8>>>) -> Result<Vec<u8>, FdError> {
    t.await
        .map_err(|e| FdError::File(std::io::Error::other(e.to_string())))?
        .map_err(FdError::File)
}

async fn file_read(fd: Arc<OwnedFd>, buf: Vec<u8>, n: usize) -> Result<Vec<u8>, FdError> {
    join(tokio::task::spawn_blocking(move || {
        read_exact_fd(&fd, buf, n)
    }))
    .await
}

/// `n` bytes from `fd` into `buf` (reused); an input that ends early is an error.
fn read_exact_fd(fd: &OwnedFd, mut buf: Vec<u8>, n: usize) -> std::io::Result<Vec<u8>> {
    buf.resize(n, 0);
    let mut got = 0;
    while got < n {
        wait_ready(fd, libc::POLLIN, FD_STALL)?;
        // SAFETY: reads into the initialized tail of `buf`, within its length.
        let r = unsafe {
            libc::read(
                fd.as_raw_fd(),
                buf[got..].as_mut_ptr() as *mut libc::c_void,
                n - got,
            )
        };
        match r {
            0 => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("it ended {} bytes short of the size asked for", n - got),
                ))
            }
            r if r > 0 => got += r as usize,
            _ => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(buf)
}

/// Most bytes written to a passed descriptor per call: a pipe whose reader stalls holds the
/// call at most until it takes this much.
const FD_WRITE_STEP: usize = 64 << 10;

/// All of `data` to `fd`.
fn write_all_fd(fd: &OwnedFd, data: &[u8]) -> std::io::Result<()> {
    let mut off = 0;
    while off < data.len() {
        wait_ready(fd, libc::POLLOUT, FD_STALL)?;
        let n = (data.len() - off).min(FD_WRITE_STEP);
        // SAFETY: writes from `data` within its bounds.
        let r = unsafe {
            libc::write(
                fd.as_raw_fd(),
                data[off..].as_ptr() as *const libc::c_void,
                n,
            )
        };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(e);
            }
        } else {
            off += r as usize;
        }
    }
    Ok(())
}

/// Progress of a verify: bytes done, bytes in all, time since it began.
pub type Progress<'a> = &'a mut (dyn FnMut(usize, usize, Duration) + Send);

/// Write a seeded random pattern over `size` bytes in `chunk` pieces, read it back, compare.
/// `progress` hears about it about every half second and at the end.
pub async fn verify(
    c: &Controller,
    nsid: u32,
    lba: u64,
    size: usize,
    chunk: usize,
    seed: u64,
    progress: Progress<'_>,
) -> Result<()> {
    use rand::{Rng, SeedableRng};
    let ns = c.namespace(nsid)?;
    let bs = ns.block_size as usize;
    if chunk % bs != 0 || size % bs != 0 {
        bail!("--size and --chunk must be multiples of the {bs}-byte block size");
    }
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let t0 = Instant::now();
    let mut done = 0usize;
    let mut last = Instant::now();
    let mut buf = vec![0u8; chunk];
    while done < size {
        let n = chunk.min(size - done);
        rng.fill(&mut buf[..n]);
        let at = lba + (done / bs) as u64;
        c.write(nsid, at, &buf[..n]).await?;
        let back = c.read(nsid, at, n).await?;
        if back != buf[..n] {
            let off = back
                .iter()
                .zip(&buf[..n])
                .position(|(a, b)| a != b)
                .unwrap_or(0);
            bail!(
                "MISMATCH at byte {} (lba {})",
                done + off,
                at + (off / bs) as u64
            );
        }
        done += n;
        if last.elapsed() > Duration::from_millis(500) || done == size {
            last = Instant::now();
            progress(done, size, t0.elapsed());
        }
    }
    Ok(())
}

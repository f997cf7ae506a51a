//! The daemon's block I/O requests: `read`, `write` and `verify` on a controller it holds,
//! so `nvmf-rdma read -d nvmf0` works as `nvme read` does on a device `nvme connect` made.
//! Sizes are bounded per request (`proto::MAX_READ`, ...); the CLI splits larger I/O.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use crate::daemon::proto::{
    ErrorCode, IoRequest, ProtoError, ReadReply, Reply, VerifyReply, WriteReply,
};
use crate::transport::{Controller, HostError};
use base64::Engine;

/// Do `io` on `c` (the controller named `name`).
pub async fn run_io(c: Arc<Controller>, name: &str, io: IoRequest) -> Result<Reply, ProtoError> {
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
    })
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

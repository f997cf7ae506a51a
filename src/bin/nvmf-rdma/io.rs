//! `read`, `write` and `verify`.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::{args::*, host::*};
use anyhow::{bail, Context, Result};
use nvmf_rdma::harness::hca_perf;
use nvmf_rdma::transport::Controller;

pub(crate) fn hexdump(data: &[u8]) {
    for (i, line) in data.chunks(16).enumerate() {
        let hex: Vec<String> = line.iter().map(|b| format!("{b:02x}")).collect();
        let txt: String = line
            .iter()
            .map(|&b| {
                if (0x20..0x7f).contains(&b) {
                    b as char
                } else {
                    '.'
                }
            })
            .collect();
        println!("{:08x}  {:<47}  {txt}", i * 16, hex.join(" "));
    }
}

/// Write a seeded random pattern over `size` bytes in `chunk` pieces, read it back, compare.
pub(crate) async fn verify(
    c: &Controller,
    nsid: u32,
    lba: u64,
    size: usize,
    chunk: usize,
    seed: u64,
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
            eprint!(
                "\rverified {} of {} ({:.0}%), {:.1} MB/s   ",
                hca_perf::human(done),
                hca_perf::human(size),
                done as f64 * 100.0 / size as f64,
                2.0 * done as f64 / t0.elapsed().as_secs_f64() / 1e6
            );
        }
    }
    eprintln!();
    println!("verified {} bytes: every byte read back matches", size);
    let (remote, local) = c.queue_stats().iter().fold((0, 0), |(r, l), q| {
        (r + q.remote_invalidations, l + q.local_invalidations)
    });
    if remote + local > 0 {
        // Per-command keys (a device that cannot re-key keeps one per connection).
        println!(
            "memory keys: one per command; {remote} invalidated by the target's response, {local} by this host"
        );
    }
    Ok(())
}

pub(crate) async fn run_read(
    sub: Subsys,
    lba: u64,
    size: usize,
    output: Option<PathBuf>,
) -> Result<()> {
    let c = connect(&sub).await?;
    let data = c.read(sub.nsid, lba, size).await?;
    match output {
        Some(p) if p.as_os_str() == "-" => {
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            out.write_all(&data)
                .and_then(|_| out.flush())
                .context("write to stdout")?
        }
        Some(p) => std::fs::write(&p, &data).with_context(|| format!("write {}", p.display()))?,
        None => hexdump(&data),
    }
    c.disconnect().await;
    Ok(())
}

pub(crate) async fn run_write(
    sub: Subsys,
    lba: u64,
    size: Option<usize>,
    input: Option<PathBuf>,
    pattern: u8,
) -> Result<()> {
    let data = match (&input, size) {
        (Some(p), _) => std::fs::read(p).with_context(|| format!("read {}", p.display()))?,
        (None, Some(n)) => vec![pattern; n],
        (None, None) => bail!("give --input FILE or --size with --pattern"),
    };
    let c = connect(&sub).await?;
    c.write(sub.nsid, lba, &data).await?;
    println!("wrote {} bytes at lba {lba}", data.len());
    c.disconnect().await;
    Ok(())
}

pub(crate) async fn run_verify(
    sub: Subsys,
    lba: u64,
    size: usize,
    chunk: usize,
    seed: u64,
) -> Result<()> {
    let (c, mgr) = connect_on(&sub).await?;
    let r = verify(&c, sub.nsid, lba, size, chunk, seed).await;
    if let Some((hca, _)) = mgr.and_then(|m| m.open(HOST_HCA)) {
        let s = hca.with_quiet(|d, _| d.stats().clone());
        // What the host's soft-HCA made of the target's ICRCs (since its last reset).
        println!(
            "icrc: {} verified, {} mismatched (dropped), {} unchecked",
            s.rx_icrc_verified, s.rx_icrc_errors, s.rx_icrc_unchecked
        );
    }
    c.disconnect().await;
    r
}

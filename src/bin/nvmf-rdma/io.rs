//! `read`, `write` and `verify`.

use std::os::fd::AsFd;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::{args::*, host::*};
use anyhow::{bail, Context, Result};
use nvmf_rdma::daemon::client::Client;
pub(crate) use nvmf_rdma::daemon::io::verify;
use nvmf_rdma::daemon::proto::{
    CopiedReply, ListReply, ReadReply, Request, VerifyReply, WriteReply, MAX_READ,
    MAX_WRITE_PATTERN,
};
use nvmf_rdma::harness::hca_perf;

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

/// The progress line `verify` keeps rewriting on stderr.
pub(crate) fn show_progress(done: usize, size: usize, took: Duration) {
    eprint!(
        "\rverified {} of {} ({:.0}%), {:.1} MB/s   ",
        hca_perf::human(done),
        hca_perf::human(size),
        done as f64 * 100.0 / size.max(1) as f64,
        2.0 * done as f64 / took.as_secs_f64().max(1e-9) / 1e6
    );
}

/// Where `read` puts its data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReadOut<'a> {
    Stdout,
    File(&'a std::path::Path),
    Hex,
}

impl<'a> ReadOut<'a> {
    pub(crate) fn of(output: Option<&'a std::path::Path>, hex: bool) -> Result<ReadOut<'a>> {
        Ok(match (output, hex) {
            (Some(_), true) => bail!("--hex prints on stdout: not with --output"),
            (_, true) => ReadOut::Hex,
            (Some(p), false) if p.as_os_str() == "-" => ReadOut::Stdout,
            (Some(p), false) => ReadOut::File(p),
            (None, false) => ReadOut::Stdout,
        })
    }

    fn put(self, data: &[u8]) -> Result<()> {
        use std::io::Write;
        match self {
            ReadOut::Stdout => {
                let mut out = std::io::stdout().lock();
                out.write_all(data)
                    .and_then(|_| out.flush())
                    .context("write to stdout")
            }
            ReadOut::File(p) => {
                std::fs::write(p, data).with_context(|| format!("write {}", p.display()))
            }
            ReadOut::Hex => {
                hexdump(data);
                Ok(())
            }
        }
    }
}

/// What `write` writes: a file's bytes or `size` bytes of `pattern`.
fn write_data(
    input: Option<&std::path::Path>,
    size: Option<usize>,
    pattern: u8,
) -> Result<Vec<u8>> {
    match (input, size) {
        (Some(p), _) => std::fs::read(p).with_context(|| format!("read {}", p.display())),
        (None, Some(n)) => Ok(vec![pattern; n]),
        (None, None) => bail!("give --input FILE or --size with --pattern"),
    }
}

pub(crate) async fn run_read(
    at: IoAt,
    lba: u64,
    size: usize,
    output: Option<PathBuf>,
    hex: bool,
) -> Result<()> {
    let out = ReadOut::of(output.as_deref(), hex)?;
    let data = match at.sub {
        None if out != ReadOut::Hex => {
            let name = at.controller.unwrap_or_default();
            return daemon_read_to(&name, at.nsid, lba, size, out).await;
        }
        None => daemon_read(&at.controller.unwrap_or_default(), at.nsid, lba, size).await?,
        Some(sub) => {
            let c = connect(&sub).await?;
            let r = c.read(sub.nsid, lba, size).await;
            c.disconnect().await;
            r?
        }
    };
    out.put(&data)
}

pub(crate) async fn run_write(
    at: IoAt,
    lba: u64,
    size: Option<usize>,
    input: Option<PathBuf>,
    pattern: u8,
) -> Result<()> {
    match at.sub {
        None => {
            let name = at.controller.unwrap_or_default();
            let n = daemon_write(&name, at.nsid, lba, input.as_deref(), size, pattern).await?;
            println!("{name}: wrote {n} bytes at lba {lba}");
        }
        Some(sub) => {
            let data = write_data(input.as_deref(), size, pattern)?;
            let c = connect(&sub).await?;
            let r = c.write(sub.nsid, lba, &data).await;
            c.disconnect().await;
            r?;
            println!("wrote {} bytes at lba {lba}", data.len());
        }
    }
    Ok(())
}

pub(crate) async fn run_verify(
    at: IoAt,
    lba: u64,
    size: usize,
    chunk: usize,
    seed: u64,
) -> Result<()> {
    match at.sub {
        None => {
            daemon_verify(
                &at.controller.unwrap_or_default(),
                at.nsid,
                lba,
                size,
                chunk,
                seed,
            )
            .await?;
            println!("verified {size} bytes: every byte read back matches");
        }
        Some(sub) => {
            let (c, mgr) = connect_on(&sub).await?;
            let r = verify(&c, sub.nsid, lba, size, chunk, seed, &mut show_progress).await;
            eprintln!();
            if r.is_ok() {
                println!("verified {size} bytes: every byte read back matches");
            }
            let (remote, local) = c.queue_stats().iter().fold((0, 0), |(r, l), q| {
                (r + q.remote_invalidations, l + q.local_invalidations)
            });
            if remote + local > 0 {
                // Per-command keys (a device that cannot re-key keeps one per connection).
                println!(
                    "memory keys: one per command; {remote} invalidated by the target's response, {local} by this host"
                );
            }
            if let Some((hca, _)) = mgr.and_then(|m| m.open(HOST_HCA)) {
                let s = hca.with_quiet(|d, _| d.stats().clone());
                // What the host's soft-HCA made of the target's ICRCs (since its last reset).
                println!(
                    "icrc: {} verified, {} mismatched (dropped), {} unchecked",
                    s.rx_icrc_verified, s.rx_icrc_errors, s.rx_icrc_unchecked
                );
                if s.rx_loopback > 0 {
                    println!(
                        "loopback path: {} packets from a target in this process (in memory, no ICRC)",
                        s.rx_loopback
                    );
                }
            }
            c.disconnect().await;
            r?;
        }
    }
    Ok(())
}

/// The block size of the daemon's controller `name`'s namespace `nsid` (to split I/O on
/// block boundaries), with the one-line error a wrong name or namespace deserves.
async fn daemon_block_size(s: &mut Client, name: &str, nsid: u32) -> Result<usize> {
    let v: ListReply = s.call(&Request::List {}).await?;
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

/// Pieces of at most `max` bytes (whole blocks of `bs`) covering `size` bytes from `lba`:
/// `(lba, offset, len)`.
fn pieces(
    lba: u64,
    size: usize,
    max: usize,
    bs: usize,
) -> impl Iterator<Item = (u64, usize, usize)> {
    let step = (max / bs).max(1) * bs;
    (0..size)
        .step_by(step)
        .map(move |off| (lba + (off / bs) as u64, off, step.min(size - off)))
}

async fn daemon_read(name: &str, nsid: u32, lba: u64, size: usize) -> Result<Vec<u8>> {
    use base64::Engine;
    let mut s = crate::client::open().await?;
    let bs = daemon_block_size(&mut s, name, nsid).await?;
    let mut data = Vec::with_capacity(size);
    for (at, _, len) in pieces(lba, size, MAX_READ, bs) {
        let req = Request::Read {
            device: name.into(),
            nsid,
            lba: at,
            size: len as u64,
        };
        let v: ReadReply = s.call(&req).await?;
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

async fn daemon_write(
    name: &str,
    nsid: u32,
    lba: u64,
    input: Option<&std::path::Path>,
    size: Option<usize>,
    pattern: u8,
) -> Result<usize> {
    let mut s = crate::client::open().await?;
    let bs = daemon_block_size(&mut s, name, nsid).await?;
    if let Some(path) = input {
        // The daemon reads the file itself, through the descriptor passed to it.
        let f = std::fs::File::open(path).with_context(|| format!("read {}", path.display()))?;
        let len = f
            .metadata()
            .with_context(|| format!("read {}", path.display()))?
            .len();
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
        let t0 = Instant::now();
        let mut shown = |done: u64, total: u64| show_copy("wrote", done, total, t0.elapsed());
        let r: Result<CopiedReply> = s.call_with_fd(&req, f.as_fd(), &mut shown).await;
        eprintln!();
        return Ok(r?.copied as usize);
    }
    let Some(n) = size else {
        bail!("give --input FILE or --size with --pattern");
    };
    // Nothing to send but the byte: the daemon fills.
    for (at, _, len) in pieces(lba, n, MAX_WRITE_PATTERN, bs) {
        let req = Request::Write {
            device: name.into(),
            nsid,
            lba: at,
            data: None,
            size: Some(len as u64),
            pattern: Some(u64::from(pattern)),
        };
        let _: WriteReply = s.call(&req).await?;
    }
    Ok(n)
}

/// `read -d` into a file or stdout: the daemon writes into the descriptor passed to it.
async fn daemon_read_to(
    name: &str,
    nsid: u32,
    lba: u64,
    size: usize,
    out: ReadOut<'_>,
) -> Result<()> {
    let mut s = crate::client::open().await?;
    daemon_block_size(&mut s, name, nsid).await?;
    let file;
    let stdout = std::io::stdout();
    let fd = match out {
        ReadOut::File(p) => {
            file = std::fs::File::create(p).with_context(|| format!("write {}", p.display()))?;
            file.as_fd()
        }
        _ => stdout.as_fd(),
    };
    let req = Request::ReadToFd {
        device: name.into(),
        nsid,
        lba,
        size: size as u64,
        progress: true,
    };
    let t0 = Instant::now();
    let mut shown = |done: u64, total: u64| show_copy("read", done, total, t0.elapsed());
    let r: Result<CopiedReply> = s.call_with_fd(&req, fd, &mut shown).await;
    eprintln!();
    r.map(|_| ())
}

/// The progress line `read -d` and `write -d` keep rewriting on stderr.
fn show_copy(verb: &str, done: u64, total: u64, took: Duration) {
    eprint!(
        "\r{verb} {} of {} ({:.0}%), {:.1} MB/s   ",
        hca_perf::human(done as usize),
        hca_perf::human(total as usize),
        done as f64 * 100.0 / total.max(1) as f64,
        done as f64 / took.as_secs_f64().max(1e-9) / 1e6
    );
}

/// `verify -d`: the daemon verifies piece by piece (each piece its own seed), so progress
/// shows here.
async fn daemon_verify(
    name: &str,
    nsid: u32,
    lba: u64,
    size: usize,
    chunk: usize,
    seed: u64,
) -> Result<()> {
    let mut s = crate::client::open().await?;
    let bs = daemon_block_size(&mut s, name, nsid).await?;
    if chunk % bs != 0 || size % bs != 0 {
        bail!("--size and --chunk must be multiples of the {bs}-byte block size");
    }
    let t0 = Instant::now();
    // Pieces of about a second's work, whole chunks.
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
        let _: VerifyReply = s.call(&req).await?;
        show_progress(off + len, size, t0.elapsed());
    }
    eprintln!();
    Ok(())
}

/// Bytes per `verify` request of `verify -d` (progress is shown between them).
const VERIFY_PIECE: usize = 16 << 20;

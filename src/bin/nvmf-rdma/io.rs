//! `read`, `write` and `verify`.

use std::os::fd::AsFd;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::args::*;
use anyhow::{bail, Context, Result};
use nvmf_rdma::cli::host::*;
pub(crate) use nvmf_rdma::daemon::io::verify;
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

/// The progress line `demo` and `verify` keep rewriting on stderr (each byte is written and
/// read).
pub(crate) fn show_progress(done: usize, size: usize, took: Duration) {
    show_rate("verified", 2, done as u64, size as u64, took);
}

/// A progress line: `done` of `total` bytes, at the rate of `passes` x `done` bytes moved
/// in `took`.
fn show_rate(verb: &str, passes: u64, done: u64, total: u64, took: Duration) {
    eprint!(
        "\r{verb} {} of {} ({:.0}%), {:.1} MB/s   ",
        hca_perf::human(done as usize),
        hca_perf::human(total as usize),
        done as f64 * 100.0 / total.max(1) as f64,
        (passes * done) as f64 / took.as_secs_f64().max(1e-9) / 1e6
    );
}

/// The progress line of a request the daemon works through on `-d`'s controller, from the
/// `(done, total)` it reports.
fn daemon_progress(verb: &'static str, passes: u64) -> impl FnMut(u64, u64) + Send {
    let t0 = Instant::now();
    move |done, total| show_rate(verb, passes, done, total, t0.elapsed())
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
        None => {
            let name = at.controller.unwrap_or_default();
            let mut s = crate::client::open().await?;
            s.read_blocks(&name, at.nsid, lba, size).await?
        }
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

/// `verify`; with `-d` the daemon verifies piece by piece (each piece its own seed), so
/// progress shows here.
pub(crate) async fn run_verify(
    at: IoAt,
    lba: u64,
    size: usize,
    chunk: usize,
    seed: u64,
) -> Result<()> {
    let Some(sub) = at.sub else {
        let name = at.controller.unwrap_or_default();
        let mut s = crate::client::open().await?;
        let mut shown = daemon_progress("verified", 2);
        let r = s
            .verify_pieces(&name, at.nsid, lba, size, chunk, seed, &mut shown)
            .await;
        eprintln!();
        r?;
        println!("verified {size} bytes: every byte read back matches");
        return Ok(());
    };
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
    r
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
    if let Some(path) = input {
        let f = std::fs::File::open(path).with_context(|| format!("read {}", path.display()))?;
        let mut shown = daemon_progress("wrote", 1);
        let r = s.write_file(name, nsid, lba, &f, &mut shown).await;
        eprintln!();
        return r;
    }
    let Some(n) = size else {
        bail!("give --input FILE or --size with --pattern");
    };
    s.write_pattern(name, nsid, lba, n, pattern).await?;
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
    let file;
    let stdout = std::io::stdout();
    let fd = match out {
        ReadOut::File(p) => {
            file = std::fs::File::create(p).with_context(|| format!("write {}", p.display()))?;
            file.as_fd()
        }
        _ => stdout.as_fd(),
    };
    let mut shown = daemon_progress("read", 1);
    let r = s.read_to(name, nsid, lba, size, fd, &mut shown).await;
    eprintln!();
    r
}

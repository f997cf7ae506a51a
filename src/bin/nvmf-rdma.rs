//! nvmf-rdma command line.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use nvmf_rdma::perf;

#[derive(Parser)]
#[command(
    name = "nvmf-rdma",
    version,
    about = "User-space NVMe-over-RDMA initiator with its own soft RoCEv2 HCA"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Start two soft-HCAs on loopback, RDMA WRITE a pattern, READ it back, verify, and
    /// print throughput.
    Demo {
        /// Bytes to move, e.g. 64M, 1G.
        #[arg(long, default_value = "64M", value_parser = parse_size)]
        size: usize,
        /// Message size, e.g. 128K.
        #[arg(long, default_value = "128K", value_parser = parse_size)]
        chunk: usize,
    },
    /// Soft-HCA throughput table over loopback UDP (one core per side).
    Bench {
        /// Seconds per row.
        #[arg(long, default_value_t = 2.0)]
        seconds: f64,
    },
    /// Print the RC QP state transition table (or a Graphviz graph with --dot).
    QpStates {
        #[arg(long)]
        dot: bool,
    },
}

/// Parse "4096", "4K", "128KiB", "64M", "1G".
fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: usize = num
        .parse()
        .map_err(|_| format!("'{s}' is not a size (try 4096, 128K, 64M)"))?;
    let mult = match unit.to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "K" | "KB" | "KIB" => 1 << 10,
        "M" | "MB" | "MIB" => 1 << 20,
        "G" | "GB" | "GIB" => 1 << 30,
        _ => return Err(format!("unknown size unit '{unit}' in '{s}'")),
    };
    n.checked_mul(mult)
        .filter(|&v| v > 0)
        .ok_or_else(|| format!("size '{s}' out of range"))
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Demo { size, chunk } => {
            if chunk > 1 << 30 || size > 8 << 30 {
                bail!("--size at most 8G and --chunk at most 1G");
            }
            println!(
                "soft-HCA demo: two RoCEv2 devices on 127.0.0.1, RC QP, {} in {} messages",
                perf::human(size),
                perf::human(chunk)
            );
            let r = perf::demo(size, chunk).context("demo failed")?;
            let gbs = |d: Duration| r.bytes as f64 / d.as_secs_f64() / 1e9;
            println!(
                "RDMA WRITE {:>10}  {:8.3} s  {:6.3} GB/s",
                perf::human(r.bytes),
                r.write.as_secs_f64(),
                gbs(r.write)
            );
            println!(
                "RDMA READ  {:>10}  {:8.3} s  {:6.3} GB/s",
                perf::human(r.bytes),
                r.read.as_secs_f64(),
                gbs(r.read)
            );
            println!("retransmits: {}", r.retransmits);
            if !r.verified {
                bail!("data read back does not match what was written");
            }
            println!("verified: every byte read back matches the pattern written");
        }
        Cmd::Bench { seconds } => {
            if !(0.05..=600.0).contains(&seconds) {
                bail!("--seconds must be between 0.05 and 600");
            }
            let rows = perf::standard_table(Duration::from_secs_f64(seconds))?;
            perf::print_table(&rows);
        }
        Cmd::QpStates { dot } => {
            if dot {
                print!("{}", nvmf_rdma::hca::qp::state::dot());
            } else {
                print!("{}", nvmf_rdma::hca::qp::state::describe());
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("128K"), Ok(128 << 10));
        assert_eq!(parse_size("64MiB"), Ok(64 << 20));
        assert_eq!(parse_size("1g"), Ok(1 << 30));
        assert!(parse_size("0").is_err());
        assert!(parse_size("12Q").is_err());
        assert!(parse_size("-1").is_err());
        assert!(parse_size("99999999999999999999G").is_err());
    }
}

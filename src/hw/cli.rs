//! `nvmf-rdma hw ...`: the command line of the hardware backend.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use super::bench::{self, Workload};
use super::device::{list_devices, HwDevice, Selector};
use super::events::AsyncEvents;
use super::host::{HostConfig, HwController};
use super::HwError;

#[derive(clap::Args, Debug)]
pub struct HwArgs {
    #[command(subcommand)]
    pub cmd: HwCmd,
}

#[derive(clap::Subcommand, Debug)]
pub enum HwCmd {
    /// List RDMA devices: name, node GUID, PCI address, netdev.
    List,
    /// Print a device's async events (DEVICE_FATAL, PORT_ERR, PORT_ACTIVE, GID_CHANGE, ...).
    Events {
        /// any, guid:<GUID>, pci:<dddd:bb:dd.f>, or a device name.
        #[arg(long, default_value = "any")]
        device: Selector,
        /// Stop after this many seconds.
        #[arg(long, default_value_t = 10.0)]
        seconds: f64,
    },
    /// Connect to an NVMe-oF/RDMA target through the kernel RDMA device, write and read back
    /// a verified pattern, then run 4 KiB random reads and 128 KiB sequential reads.
    Run(RunArgs),
}

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// Target IP address.
    #[arg(short = 'a', long)]
    pub traddr: IpAddr,
    #[arg(short = 's', long, default_value_t = 4420)]
    pub trsvcid: u16,
    /// Subsystem NQN.
    #[arg(short = 'n', long)]
    pub nqn: String,
    #[arg(long)]
    pub hostnqn: Option<String>,
    /// Which device must carry the connection (any = the one rdma_cm picks).
    #[arg(long, default_value = "any")]
    pub device: Selector,
    /// Namespace ID (0 = first active).
    #[arg(long, default_value_t = 0)]
    pub nsid: u32,
    /// Bytes to write and verify first (K/M/G suffixes; 0 skips).
    #[arg(long, default_value = "16M", value_parser = parse_size)]
    pub verify_size: u64,
    /// Seconds per benchmark workload (0 skips the benchmark).
    #[arg(long, default_value_t = 10.0)]
    pub seconds: f64,
    /// Queue depth of the 4 KiB random read.
    #[arg(long, default_value_t = 32)]
    pub rand_qd: u16,
    /// Queue depth of the 128 KiB sequential read.
    #[arg(long, default_value_t = 16)]
    pub seq_qd: u16,
    /// Keep-alive timeout to ask for, ms (0 = none).
    #[arg(long, default_value_t = 0)]
    pub kato_ms: u32,
}

/// `16M` -> 16 MiB. Plain numbers are bytes.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().last() {
        Some((i, 'k' | 'K')) => (&s[..i], 1u64 << 10),
        Some((i, 'm' | 'M')) => (&s[..i], 1 << 20),
        Some((i, 'g' | 'G')) => (&s[..i], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("bad size {s:?}"))
}

pub async fn run(a: HwArgs) -> Result<(), HwError> {
    match a.cmd {
        HwCmd::List => {
            let devs = list_devices()?;
            if devs.is_empty() {
                println!("no RDMA devices");
            }
            for d in devs {
                println!("{d}");
            }
            Ok(())
        }
        HwCmd::Events { device, seconds } => {
            let dev = HwDevice::open(&device)?;
            let ev = AsyncEvents::new(&dev)?;
            println!("watching {} for {seconds} s", dev.info());
            let until = tokio::time::Instant::now() + Duration::from_secs_f64(seconds.max(0.0));
            while let Ok(e) = tokio::time::timeout_at(until, ev.next()).await {
                println!("event: {:?}", e?);
            }
            Ok(())
        }
        HwCmd::Run(r) => run_target(r).await,
    }
}

async fn run_target(r: RunArgs) -> Result<(), HwError> {
    let mut cfg = HostConfig::new(SocketAddr::new(r.traddr, r.trsvcid), &r.nqn);
    if let Some(h) = r.hostnqn {
        cfg.hostnqn = h;
    }
    cfg.device = r.device;
    cfg.nsid = r.nsid;
    cfg.kato_ms = r.kato_ms;
    cfg.io_depth = r.rand_qd.max(r.seq_qd).max(2);
    let t0 = std::time::Instant::now();
    let mut c = HwController::connect(&cfg).await?;
    let id = c.dev.info().identity();
    println!(
        "connected in {:.3}s: device {} (guid {}, pci {}), cntlid {}, model {:?}, nsid {} = {} x {} B, \
         io queue depth {} (crqsize {}), max I/O {} B, qpn {:#x}",
        t0.elapsed().as_secs_f64(),
        id.name,
        id.guid,
        c.dev.info().pci.map(|p| p.to_string()).unwrap_or_else(|| "-".into()),
        c.cntlid,
        c.ctrl.mn.text().trim(),
        c.nsid,
        c.blocks,
        c.block_size,
        c.io.depth(),
        c.io.crqsize(),
        c.io.max_io(),
        c.io.qp_num(),
    );
    if r.verify_size > 0 {
        let seed: u64 = rand::random();
        for rep in bench::verify(&mut c, r.verify_size, seed).await? {
            println!("{rep}");
        }
        println!(
            "HW-VERIFY ok bytes={}",
            r.verify_size.min(c.blocks * u64::from(c.block_size))
        );
    }
    if r.seconds > 0.0 {
        let d = Duration::from_secs_f64(r.seconds);
        let all = c.blocks;
        let small = 4096u32.max(c.block_size);
        let big = (128 * 1024u32).min(c.io.max_io());
        let jobs = [
            Workload {
                name: format!("randread {}k qd{}", small / 1024, r.rand_qd),
                write: false,
                random: true,
                bytes: small,
                qd: r.rand_qd,
                start_lba: 0,
                range_blocks: all,
                duration: Some(d),
                count: None,
                verify_seed: None,
                rng_seed: 1,
            },
            Workload {
                name: format!("seqread {}k qd{}", big / 1024, r.seq_qd),
                write: false,
                random: false,
                bytes: big,
                qd: r.seq_qd,
                start_lba: 0,
                range_blocks: all,
                duration: Some(d),
                count: None,
                verify_seed: None,
                rng_seed: 2,
            },
        ];
        for j in &jobs {
            let rep = bench::run(&mut c, j).await?;
            println!("{rep}");
            println!(
                "HW-RESULT job={:?} iops={:.0} mibs={:.2} avg_us={:.0} p99_us={}",
                rep.name,
                rep.iops(),
                rep.mib_s(),
                rep.avg_us,
                rep.p99_us
            );
        }
    }
    c.shutdown().await?;
    println!("disconnected");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("16M"), Ok(16 << 20));
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("512"), Ok(512));
        assert_eq!(parse_size("0"), Ok(0));
        assert!(parse_size("M").is_err());
        assert!(parse_size("99999999999G").is_err());
        assert!(parse_size("-1").is_err());
    }
}

//! nvmf-rdma command line, following nvme-cli where it has a name for a thing.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};
use nvmf_rdma::cli_support::{
    json_field, local_ip_for, lock_all_memory, parse_pos_secs, parse_secs, parse_tmo, parse_traddr,
    run_dir, CtrlInfo, Health, Tmo,
};
use nvmf_rdma::driver::{DeviceManager, SoftHca};
use nvmf_rdma::export::{self, ExportAddr};
use nvmf_rdma::hca::device::{DeviceConfig, DeviceIdentity, IcrcCheck};
use nvmf_rdma::hca::PciAddr;
use nvmf_rdma::metrics_http;
use nvmf_rdma::nvme::Nqn;
use nvmf_rdma::nvmf_perf::{self, Job, LocalTarget, Pattern, DEMO_NQN};
use nvmf_rdma::perf;
use nvmf_rdma::reconnect::policy;
use nvmf_rdma::reconnect::{CtrlState, IdentityMatch, Policy};
use nvmf_rdma::target::{serve_cm, Namespace, Subsystem, Target, TargetConfig};
use nvmf_rdma::transport::{discover, CmService, ConnectOptions, Controller};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

#[derive(Parser)]
#[command(
    name = "nvmf-rdma",
    version,
    about = "User-space NVMe-over-RDMA initiator with its own soft RoCEv2 HCA"
)]
struct Cli {
    /// Serve Prometheus metrics (controller state, reconnects, recoveries, recovery time,
    /// device counters) over HTTP at IP:PORT, e.g. 127.0.0.1:9464; for connect, chaos, demo
    /// and target.
    #[arg(long, global = true, value_name = "IP:PORT")]
    metrics_addr: Option<SocketAddr>,
    /// Lock all of the process's memory, now and future (mlockall), so the I/O and recovery
    /// paths never wait on a page fault. Needs RLIMIT_MEMLOCK (ulimit -l) large enough, or
    /// CAP_IPC_LOCK.
    #[arg(long, global = true)]
    mlock: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

impl Cli {
    /// Start what the global options ask for, before any device or controller exists.
    fn setup(&self) -> Result<()> {
        if self.mlock {
            match lock_all_memory().map_err(anyhow::Error::msg)? {
                None => tracing::debug!("memory locked"),
                Some(limit) => eprintln!(
                    "--mlock: memory locked up to RLIMIT_MEMLOCK ({}); allocations past it \
                     will fail (ulimit -l unlimited lifts it)",
                    perf::human(limit.min(usize::MAX as u64) as usize)
                ),
            }
        }
        if let Some(addr) = self.metrics_addr {
            if !matches!(
                self.cmd,
                Cmd::Connect { .. } | Cmd::Demo { .. } | Cmd::Target(_)
            ) {
                bail!("--metrics-addr is for connect, demo and target");
            }
            metrics_http::install(addr)?;
            eprintln!("metrics: http://{addr}/metrics");
        }
        Ok(())
    }
}

/// Where the target is (nvme-cli's fabrics arguments).
#[derive(Args, Debug, Clone)]
struct Fabric {
    /// Transport type; only rdma.
    #[arg(short = 't', long = "transport", default_value = "rdma")]
    transport: String,
    /// Target address: IP (RoCEv2 UDP port 4791) or IP:PORT for a soft-HCA bound elsewhere.
    #[arg(short = 'a', long = "traddr", value_parser = parse_traddr)]
    traddr: SocketAddr,
    /// NVMe-oF service port.
    #[arg(short = 's', long = "trsvcid", default_value_t = 4420)]
    trsvcid: u16,
    /// Host NQN (default: from the host ID).
    #[arg(short = 'q', long = "hostnqn")]
    hostnqn: Option<String>,
}

#[derive(Args, Debug, Clone)]
struct Subsys {
    #[command(flatten)]
    fabric: Fabric,
    /// Subsystem NQN.
    #[arg(short = 'n', long = "nqn")]
    nqn: String,
    /// I/O queues (default: one per core).
    #[arg(short = 'i', long = "nr-io-queues", default_value_t = cores())]
    nr_io_queues: usize,
    /// Entries per I/O queue (16..=1024).
    #[arg(short = 'Q', long = "queue-size", default_value_t = 128)]
    queue_size: usize,
    #[command(flatten)]
    policy: PolicyArgs,
    /// Namespace to use for read/write/verify.
    #[arg(long, default_value_t = 1)]
    nsid: u32,
}

/// Keep-alive and the reconnect policy, with nvme-cli's names where it has them. Shared by
/// every command that connects; `chaos` has its own defaults for `-c` and `-l`.
#[derive(Args, Debug, Clone, Default)]
struct PolicyArgs {
    /// Keep-alive timeout in seconds, 0 = off [default: 5]
    #[arg(short = 'k', long = "keep-alive-tmo",
        value_name = "SECS",
        allow_hyphen_values = true,
        value_parser = parse_secs
    )]
    keep_alive_tmo: Option<u64>,
    /// Seconds between reconnect attempts; 0 = at once [default: 10; chaos: 0]
    #[arg(short = 'c', long = "reconnect-delay",
        value_name = "SECS",
        allow_hyphen_values = true,
        value_parser = parse_secs
    )]
    reconnect_delay: Option<u64>,
    /// Seconds to keep reconnecting before the controller is deleted and its I/O fails;
    /// -1 = forever [default: 600; chaos: 60]
    #[arg(
        short = 'l',
        long = "ctrl-loss-tmo",
        value_name = "SECS",
        allow_hyphen_values = true,
        value_parser = parse_tmo
    )]
    ctrl_loss_tmo: Option<Tmo>,
    /// Seconds of reconnecting after which held and new I/O fails (the controller keeps
    /// trying); -1 = off [default: -1]
    #[arg(
        long = "fast_io_fail_tmo",
        alias = "fast-io-fail-tmo",
        value_name = "SECS",
        allow_hyphen_values = true,
        value_parser = parse_tmo
    )]
    fast_io_fail_tmo: Option<Tmo>,
    /// Seconds a hot-removed HCA may take to come back before the controller gives up
    /// [default: 600]
    #[arg(long = "replug-window",
        value_name = "SECS",
        allow_hyphen_values = true,
        value_parser = parse_secs
    )]
    replug_window: Option<u64>,
    /// Which HCA that comes back counts as ours: same node GUID, same PCI address, both, or
    /// any card in the slot [default: both]
    #[arg(long, value_enum, value_name = "MATCH")]
    identity: Option<IdentityArg>,
    /// Seconds without a response after which a command starts recovery [default: 30]
    #[arg(
        long = "io-timeout",
        value_name = "SECS",
        allow_hyphen_values = true,
        value_parser = parse_pos_secs
    )]
    io_timeout: Option<u64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum IdentityArg {
    Guid,
    Pci,
    Both,
    Any,
}

impl From<IdentityArg> for IdentityMatch {
    fn from(i: IdentityArg) -> IdentityMatch {
        match i {
            IdentityArg::Guid => IdentityMatch::Guid,
            IdentityArg::Pci => IdentityMatch::Pci,
            IdentityArg::Both => IdentityMatch::Both,
            IdentityArg::Any => IdentityMatch::Any,
        }
    }
}

/// What `PolicyArgs` resolve to.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Resolved {
    policy: Policy,
    io_timeout: Duration,
}

impl PolicyArgs {
    /// The policy with `reconnect_delay` and `ctrl_loss_tmo` defaulting to the values given
    /// (connect: 10 s and 600 s, as Linux; chaos: 0 and 60 s).
    fn resolve(&self, reconnect_delay: Duration, ctrl_loss_tmo: Option<Duration>) -> Resolved {
        let policy = Policy {
            ctrl_loss_tmo: self.ctrl_loss_tmo.map_or(ctrl_loss_tmo, |t| t.0),
            reconnect_delay: self
                .reconnect_delay
                .map_or(reconnect_delay, Duration::from_secs),
            fast_io_fail_tmo: self.fast_io_fail_tmo.and_then(|t| t.0),
            keep_alive_tmo: self
                .keep_alive_tmo
                .map_or(policy::DEFAULT_KEEP_ALIVE_TMO, Duration::from_secs),
            replug_window: self
                .replug_window
                .map_or(policy::DEFAULT_REPLUG_WINDOW, Duration::from_secs),
            identity: self.identity.map_or(IdentityMatch::Both, Into::into),
        };
        Resolved {
            policy,
            io_timeout: self
                .io_timeout
                .map_or(policy::DEFAULT_IO_TIMEOUT, Duration::from_secs),
        }
    }

    /// Linux's defaults (`connect`, `read`, `write`, `verify`).
    fn resolve_default(&self) -> Resolved {
        self.resolve(
            policy::DEFAULT_RECONNECT_DELAY,
            Some(policy::DEFAULT_CTRL_LOSS_TMO),
        )
    }
}

/// Block-device exports of the namespace `--nsid` while `connect` holds the controller.
#[derive(Args, Debug, Clone)]
struct ExportArgs {
    /// Serve the namespace over NBD at unix:PATH or IP:PORT (e.g. 127.0.0.1:10809).
    #[arg(long, value_name = "ADDR")]
    nbd: Option<ExportAddr>,
    /// Expose the namespace as the file MOUNTPOINT/ns<NSID> in a FUSE mount (for losetup).
    #[arg(long, value_name = "MOUNTPOINT")]
    fuse: Option<PathBuf>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Start the built-in target in-process, connect to it, write and verify a pattern, and
    /// print IOPS and latency.
    Demo {
        /// Bytes to write and verify, e.g. 64M.
        #[arg(long, default_value = "64M", value_parser = parse_size)]
        size: usize,
        /// Seconds of 4 KiB random reads at QD32 after the verify.
        #[arg(long, default_value_t = 2.0)]
        seconds: f64,
    },
    /// Soft-HCA only: RDMA WRITE a pattern between two devices, READ it back, verify.
    HcaDemo {
        #[arg(long, default_value = "64M", value_parser = parse_size)]
        size: usize,
        #[arg(long, default_value = "128K", value_parser = parse_size)]
        chunk: usize,
    },
    /// Benchmark tables over loopback: NVMe-oF (default) or the raw soft-HCA (--hca).
    Bench {
        /// Seconds per row.
        #[arg(long, default_value_t = 3.0)]
        seconds: f64,
        #[arg(long)]
        hca: bool,
        /// I/O queues for the NVMe-oF table.
        #[arg(long, default_value_t = 1)]
        queues: usize,
    },
    /// Run the built-in NVMe-oF target until interrupted.
    Target(TargetArgs),
    /// Ask a discovery controller which subsystems it offers.
    Discover(Fabric),
    /// Connect to a subsystem and hold the controller until interrupted or `disconnect`.
    Connect {
        #[command(flatten)]
        sub: Subsys,
        #[command(flatten)]
        export: ExportArgs,
    },
    /// List the controllers held by running `connect` commands.
    List {
        /// Output format: normal or json.
        #[arg(short = 'o', long = "output-format", default_value = "normal")]
        output: String,
    },
    /// Disconnect a controller held by `connect`.
    Disconnect {
        /// By subsystem NQN.
        #[arg(short = 'n', long = "nqn")]
        nqn: Option<String>,
        /// By controller name (from `list`).
        #[arg(short = 'd', long = "device")]
        device: Option<String>,
    },
    /// Read blocks and write them to a file or stdout (hex).
    Read {
        #[command(flatten)]
        sub: Subsys,
        #[arg(long, default_value_t = 0)]
        lba: u64,
        #[arg(long, value_parser = parse_size)]
        size: usize,
        #[arg(long)]
        output: Option<PathBuf>,
    },
    /// Write a file, or a repeated byte, at a block address.
    Write {
        #[command(flatten)]
        sub: Subsys,
        #[arg(long, default_value_t = 0)]
        lba: u64,
        #[arg(long, value_parser = parse_size)]
        size: Option<usize>,
        #[arg(long)]
        input: Option<PathBuf>,
        /// Byte to fill with when no --input is given.
        #[arg(long, default_value_t = 0)]
        pattern: u8,
    },
    /// Write random data over a range, read it back and compare, with progress.
    Verify {
        #[command(flatten)]
        sub: Subsys,
        #[arg(long, default_value_t = 0)]
        lba: u64,
        #[arg(long, value_parser = parse_size)]
        size: usize,
        #[arg(long, default_value = "128K", value_parser = parse_size)]
        chunk: usize,
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// Print the RC QP state transition table (or a Graphviz graph with --dot).
    QpStates {
        #[arg(long)]
        dot: bool,
    },
}

#[derive(Args, Debug, Clone)]
struct TargetArgs {
    /// Address of the target's soft-HCA (IP or IP:PORT; RoCEv2 port 4791 by default).
    #[arg(long, default_value = "127.0.0.1", value_parser = parse_traddr)]
    listen: SocketAddr,
    /// NVMe-oF service port.
    #[arg(short = 's', long = "trsvcid", default_value_t = 4420)]
    trsvcid: u16,
    /// Subsystem NQN.
    #[arg(short = 'n', long = "nqn", default_value = DEMO_NQN)]
    nqn: String,
    /// RAM namespace size (e.g. 1G); default when no --file is given.
    #[arg(long, value_parser = parse_size)]
    ram: Option<usize>,
    /// File-backed namespace.
    #[arg(long)]
    file: Option<PathBuf>,
    /// Create or grow the file to this size.
    #[arg(long, value_parser = parse_size)]
    file_size: Option<usize>,
    /// Logical block size: 512 or 4096.
    #[arg(long, default_value_t = 512)]
    block_size: u32,
    /// Host NQNs allowed to connect (repeat); any host when none is given.
    #[arg(long = "allow-host")]
    allow_host: Vec<String>,
}

fn cores() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
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

fn device_config(name: &str, addr: SocketAddr, n: u8) -> DeviceConfig {
    let mac = [0x52, 0x54, 0x00, 0x30, (std::process::id() & 0xFF) as u8, n];
    DeviceConfig {
        identity: DeviceIdentity::from_mac(name, mac, PciAddr::new(0, 0x30, n, 0)),
        addr,
        icrc: IcrcCheck::Verify,
        seed: std::process::id() as u64 ^ ((n as u64) << 32),
    }
}

/// A host soft-HCA on the local address that routes to `target`.
async fn host_stack(target: SocketAddr) -> Result<(SoftHca, CmService)> {
    let ip = local_ip_for(target).context("no route to the target address")?;
    let hca = SoftHca::start_with(
        device_config("srxe0", SocketAddr::new(ip, 0), 1),
        target.ip().is_loopback(),
    )
    .await
    .context("cannot start the host soft-HCA")?;
    let cm = CmService::start(hca.clone(), std::process::id() as u64);
    Ok((hca, cm))
}

fn check_transport(f: &Fabric) -> Result<()> {
    if f.transport != "rdma" {
        bail!("transport '{}' is not supported: only rdma", f.transport);
    }
    Ok(())
}

fn options(s: &Subsys) -> Result<ConnectOptions> {
    check_transport(&s.fabric)?;
    Nqn::new(&s.nqn).map_err(|e| anyhow::anyhow!("bad subsystem NQN: {e}"))?;
    if !(16..=1024).contains(&s.queue_size) {
        bail!("--queue-size must be between 16 and 1024");
    }
    if s.nr_io_queues == 0 || s.nr_io_queues > 128 {
        bail!("--nr-io-queues must be between 1 and 128");
    }
    let mut o = ConnectOptions::new(s.fabric.traddr, &s.nqn);
    o.trsvcid = s.fabric.trsvcid;
    if let Some(h) = &s.fabric.hostnqn {
        Nqn::new(h).map_err(|e| anyhow::anyhow!("bad host NQN: {e}"))?;
        o.hostnqn = h.clone();
    }
    o.nr_io_queues = s.nr_io_queues;
    o.queue_size = s.queue_size;
    let r = s.policy.resolve_default();
    o.keep_alive_tmo = r.policy.keep_alive_tmo;
    o.policy = r.policy;
    o.io_timeout = r.io_timeout;
    Ok(o)
}

/// The name of the host HCA in the device manager of `connect`, `read`, `write`, `verify`.
const HOST_HCA: &str = "srxe0";

/// A host soft-HCA plugged into a device manager, on the local address that routes to
/// `target`. A controller on it comes back after the device is reset or re-plugged.
async fn host_device(target: SocketAddr) -> Result<DeviceManager> {
    let ip = local_ip_for(target).context("no route to the target address")?;
    let mgr = DeviceManager::new(target.ip().is_loopback());
    mgr.plug(device_config(HOST_HCA, SocketAddr::new(ip, 0), 1))
        .await
        .context("cannot start the host soft-HCA")?;
    Ok(mgr)
}

async fn connect(s: &Subsys) -> Result<Controller> {
    let o = options(s)?;
    let mgr = host_device(s.fabric.traddr).await?;
    Controller::connect_managed(mgr, HOST_HCA, o)
        .await
        .with_context(|| format!("connect to {} at {}", s.nqn, s.fabric.traddr))
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    cli.setup()?;
    match cli.cmd {
        Cmd::Demo { size, seconds } => demo(size, seconds),
        Cmd::HcaDemo { size, chunk } => hca_demo(size, chunk),
        Cmd::Bench {
            seconds,
            hca,
            queues,
        } => {
            if !(0.05..=600.0).contains(&seconds) {
                bail!("--seconds must be between 0.05 and 600");
            }
            if hca {
                perf::print_table(&perf::standard_table(Duration::from_secs_f64(seconds))?);
            } else {
                nvmf_perf::print_results(&nvmf_perf::bench(
                    Duration::from_secs_f64(seconds),
                    queues.clamp(1, 64),
                )?);
            }
            Ok(())
        }
        Cmd::QpStates { dot } => {
            if dot {
                print!("{}", nvmf_rdma::hca::qp::state::dot());
            } else {
                print!("{}", nvmf_rdma::hca::qp::state::describe());
            }
            Ok(())
        }
        cmd => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?
            .block_on(run_async(cmd)),
    }
}

async fn run_async(cmd: Cmd) -> Result<()> {
    match cmd {
        Cmd::Target(t) => run_target(t).await,
        Cmd::Discover(f) => {
            check_transport(&f)?;
            let (hca, cm) = host_stack(f.traddr).await?;
            let mut o = ConnectOptions::new(f.traddr, nvmf_rdma::nvme::fabrics::DISCOVERY_NQN);
            o.trsvcid = f.trsvcid;
            if let Some(h) = f.hostnqn {
                o.hostnqn = h;
            }
            let entries = discover(hca, cm, o).await.context("discovery failed")?;
            println!("Discovery Log Number of Records {}", entries.len());
            for (i, e) in entries.iter().enumerate() {
                println!("=====Discovery Log Entry {i}======");
                println!("trtype:  rdma");
                println!("adrfam:  {}", if e.adrfam == 2 { "ipv6" } else { "ipv4" });
                println!("portid:  {}", e.portid);
                println!("trsvcid: {}", e.trsvcid.text().trim());
                println!("subnqn:  {}", e.subnqn.text());
                println!("traddr:  {}", e.traddr.text().trim());
            }
            Ok(())
        }
        Cmd::Connect { sub, export } => run_connect(sub, export).await,
        Cmd::List { output } => run_list(&output).await,
        Cmd::Disconnect { nqn, device } => run_disconnect(nqn, device).await,
        Cmd::Read {
            sub,
            lba,
            size,
            output,
        } => {
            let c = connect(&sub).await?;
            let data = c.read(sub.nsid, lba, size).await?;
            match output {
                Some(p) => {
                    std::fs::write(&p, &data).with_context(|| format!("write {}", p.display()))?
                }
                None => hexdump(&data),
            }
            c.disconnect().await;
            Ok(())
        }
        Cmd::Write {
            sub,
            lba,
            size,
            input,
            pattern,
        } => {
            let data = match (&input, size) {
                (Some(p), _) => {
                    std::fs::read(p).with_context(|| format!("read {}", p.display()))?
                }
                (None, Some(n)) => vec![pattern; n],
                (None, None) => bail!("give --input FILE or --size with --pattern"),
            };
            let c = connect(&sub).await?;
            c.write(sub.nsid, lba, &data).await?;
            println!("wrote {} bytes at lba {lba}", data.len());
            c.disconnect().await;
            Ok(())
        }
        Cmd::Verify {
            sub,
            lba,
            size,
            chunk,
            seed,
        } => {
            let c = connect(&sub).await?;
            let r = verify(&c, sub.nsid, lba, size, chunk, seed).await;
            c.disconnect().await;
            r
        }
        _ => unreachable!("handled synchronously"),
    }
}

fn hexdump(data: &[u8]) {
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
async fn verify(
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
                perf::human(done),
                perf::human(size),
                done as f64 * 100.0 / size as f64,
                2.0 * done as f64 / t0.elapsed().as_secs_f64() / 1e6
            );
        }
    }
    eprintln!();
    println!("verified {} bytes: every byte read back matches", size);
    Ok(())
}

fn demo(size: usize, seconds: f64) -> Result<()> {
    if size > 1 << 30 {
        bail!("--size at most 1G");
    }
    let ns_bytes = (size as u64).max(256 << 20);
    println!("nvmf-rdma demo: built-in target ({} RAM namespace) and host, each on its own soft RoCEv2 HCA on 127.0.0.1", perf::human(ns_bytes as usize));
    let t = LocalTarget::start(ns_bytes, 9)?;
    let addr = t.addr;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let c = Arc::new(
            nvmf_perf::connect_host(addr, DEMO_NQN, 1, 128)
                .await
                .context("connect")?,
        );
        let ns = c.namespaces()[0];
        println!(
            "connected: {} cntlid {} model '{}', namespace 1: {} blocks of {} B",
            DEMO_NQN,
            c.cntlid,
            c.ident.mn.text().trim(),
            ns.blocks,
            ns.block_size
        );
        let t0 = Instant::now();
        verify(&c, 1, 0, size - size % 4096, 128 << 10, 42).await?;
        println!(
            "write+read-back of {} took {:.3} s",
            perf::human(size),
            t0.elapsed().as_secs_f64()
        );
        let job = Job {
            pattern: Pattern::RandRead,
            bs: 4096,
            iodepth: 32,
            runtime: Duration::from_secs_f64(seconds),
        };
        let r = nvmf_perf::run_job(c.clone(), job).await;
        nvmf_perf::print_results(std::slice::from_ref(&r));
        if r.errors > 0 {
            bail!("{} I/O errors", r.errors);
        }
        match Arc::try_unwrap(c) {
            Ok(c) => c.disconnect().await,
            Err(_) => tracing::warn!("controller still shared; not disconnecting cleanly"),
        }
        anyhow::Ok(())
    })?;
    tracing::debug!("stopping the target");
    drop(t);
    tracing::debug!("done");
    Ok(())
}

fn hca_demo(size: usize, chunk: usize) -> Result<()> {
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
    Ok(())
}

async fn run_target(a: TargetArgs) -> Result<()> {
    let nqn = Nqn::new(&a.nqn).map_err(|e| anyhow::anyhow!("bad --nqn: {e}"))?;
    let lbads = match a.block_size {
        512 => 9,
        4096 => 12,
        n => bail!("--block-size must be 512 or 4096, not {n}"),
    };
    let ns = match (&a.file, a.ram) {
        (Some(_), Some(_)) => bail!("give --ram or --file, not both"),
        (Some(p), None) => Namespace::file(1, p, a.file_size.map(|s| s as u64), lbads)
            .with_context(|| format!("open {}", p.display()))?,
        (None, r) => Namespace::ram(1, r.unwrap_or(256 << 20) as u64, lbads),
    };
    if ns.blocks == 0 {
        bail!("the namespace would have no blocks");
    }
    let mut sub = Subsystem::new(nqn, vec![Arc::new(ns)]);
    if !a.allow_host.is_empty() {
        sub.allowed_hosts = Some(a.allow_host.clone());
    }
    let hca = SoftHca::start_with(
        device_config("tgt0", a.listen, 9),
        a.listen.ip().is_loopback(),
    )
    .await
    .with_context(|| format!("cannot bind {}", a.listen))?;
    let cfg = TargetConfig {
        subsystems: vec![sub],
        port: a.trsvcid,
        advertise: Some(hca.addr()),
        ..TargetConfig::default()
    };
    let t = Target::start(hca.clone(), cfg)?;
    serve_cm(t.clone(), CmService::start(hca.clone(), 9));
    println!(
        "target {} listening on {} (trsvcid {}); Ctrl-C stops it",
        a.nqn,
        hca.addr(),
        a.trsvcid
    );
    tokio::signal::ctrl_c().await?;
    println!("stopping; {:?}", t.stats());
    Ok(())
}

async fn run_connect(s: Subsys, x: ExportArgs) -> Result<()> {
    let c = Arc::new(connect(&s).await?);
    let exports = start_exports(&c, &s, &x).await?;
    let dir = run_dir();
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    let mut n = 0;
    let (name, path) = loop {
        let name = format!("nvmf{n}");
        let p = dir.join(format!("{name}.sock"));
        if !p.exists() || tokio::net::UnixStream::connect(&p).await.is_err() {
            let _ = std::fs::remove_file(&p);
            break (name, p);
        }
        n += 1;
    };
    let listener = tokio::net::UnixListener::bind(&path)
        .with_context(|| format!("bind {}", path.display()))?;
    println!(
        "{name}: connected to {} at {} (cntlid {})",
        s.nqn, s.fabric.traddr, c.cntlid
    );
    for ns in c.namespaces() {
        println!(
            "  namespace {}: {} blocks of {} B ({})",
            ns.nsid,
            ns.blocks,
            ns.block_size,
            perf::human(ns.bytes() as usize)
        );
    }
    let info = || {
        let (state, health) = Health::from_status(&c.status());
        CtrlInfo {
            name: name.clone(),
            subnqn: s.nqn.clone(),
            hostnqn: c.opts.hostnqn.clone(),
            traddr: s.fabric.traddr.to_string(),
            trsvcid: s.fabric.trsvcid,
            cntlid: c.cntlid,
            state,
            io_queues: c.io_queue_count(),
            namespaces: c
                .namespaces()
                .iter()
                .map(|n| (n.nsid, n.block_size, n.blocks))
                .collect(),
            model: c.ident.mn.text().trim().to_string(),
            serial: c.ident.sn.text().trim().to_string(),
            health,
        }
    };
    let watcher = tokio::spawn(report_state_changes(name.clone(), c.watch_status()));
    let stop = tokio::sync::Notify::new();
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            _ = stop.notified() => break,
            conn = listener.accept() => {
                let Ok((stream, _)) = conn else { continue };
                let (r, mut w) = stream.into_split();
                let mut line = String::new();
                let _ = BufReader::new(r).read_line(&mut line).await;
                match line.trim() {
                    "info" => { let _ = w.write_all(format!("{}\n", info().to_json()).as_bytes()).await; }
                    "disconnect" => {
                        let _ = w.write_all(b"ok\n").await;
                        stop.notify_one();
                    }
                    _ => { let _ = w.write_all(b"error: unknown request\n").await; }
                }
            }
        }
    }
    let _ = std::fs::remove_file(&path);
    watcher.abort();
    exports.stop().await;
    if let Ok(c) = Arc::try_unwrap(c) {
        c.disconnect().await;
    }
    println!("{name}: disconnected");
    Ok(())
}

/// Print the controller's state changes as `connect` holds it: failures, attempts, LIVE
/// again, given up.
async fn report_state_changes(
    name: String,
    mut rx: tokio::sync::watch::Receiver<nvmf_rdma::transport::CtrlStatus>,
) {
    let mut last = (rx.borrow().machine.state, rx.borrow().machine.attempt);
    while rx.changed().await.is_ok() {
        let st = *rx.borrow_and_update();
        let m = st.machine;
        let (was, _) = last;
        if (m.state, m.attempt) == last {
            continue;
        }
        last = (m.state, m.attempt);
        let (state, h) = Health::from_status(&st);
        match m.state {
            CtrlState::Live if was != CtrlState::Live => println!(
                "{name}: live again (recovery {}{})",
                m.recoveries,
                st.last_recovery.map_or(String::new(), |d| format!(
                    ", {:.1} ms after the failure",
                    d.as_secs_f64() * 1e3
                ))
            ),
            CtrlState::Resetting | CtrlState::Connecting => {
                if matches!(was, CtrlState::Live | CtrlState::New) {
                    println!(
                        "{name}: {}; recovering",
                        m.cause.map_or("failed", |c| c.name())
                    );
                }
                if m.attempt > 0 {
                    println!("{name}: reconnecting, {}", h.attempts());
                }
            }
            CtrlState::Deleting | CtrlState::Dead if was != m.state => {
                println!("{name}: {state}: {}", h.describe(&state));
            }
            _ => {}
        }
    }
}

/// The exports `connect` runs next to the controller (stopped before it disconnects).
struct Exports {
    nbd: Option<tokio::task::JoinHandle<()>>,
    fuse: Option<export::FuseMount>,
}

impl Exports {
    async fn stop(self) {
        if let Some(t) = self.nbd {
            t.abort();
            let _ = t.await;
        }
        if let Some(m) = self.fuse {
            let _ = tokio::task::spawn_blocking(move || {
                if let Err(e) = m.unmount() {
                    eprintln!("{e}");
                }
            })
            .await;
        }
    }
}

async fn start_exports(c: &Arc<Controller>, s: &Subsys, x: &ExportArgs) -> Result<Exports> {
    let mut out = Exports {
        nbd: None,
        fuse: None,
    };
    if x.nbd.is_none() && x.fuse.is_none() {
        return Ok(out);
    }
    let dev = Arc::new(export::BlockDev::new(c.clone(), s.nsid)?);
    if let Some(addr) = &x.nbd {
        let l = export::NbdListener::bind(addr).await?;
        println!(
            "nbd: serving namespace {} at {} ({})",
            s.nsid,
            l.addr(),
            l.addr().uri()
        );
        let (dev, name) = (dev.clone(), format!("ns{}", s.nsid));
        out.nbd = Some(tokio::spawn(async move {
            if let Err(e) = l.serve(dev, name).await {
                eprintln!("nbd: {e}");
            }
        }));
    }
    if let Some(mp) = &x.fuse {
        let m = export::mount_fuse(
            dev,
            tokio::runtime::Handle::current(),
            mp,
            &format!("ns{}", s.nsid),
        )?;
        println!("fuse: namespace {} is {}", s.nsid, m.file().display());
        out.fuse = Some(m);
    }
    Ok(out)
}

async fn ask(path: &std::path::Path, req: &str) -> Option<String> {
    let mut s = tokio::time::timeout(
        Duration::from_secs(2),
        tokio::net::UnixStream::connect(path),
    )
    .await
    .ok()?
    .ok()?;
    s.write_all(format!("{req}\n").as_bytes()).await.ok()?;
    let mut line = String::new();
    tokio::time::timeout(
        Duration::from_secs(2),
        BufReader::new(s).read_line(&mut line),
    )
    .await
    .ok()?
    .ok()?;
    Some(line.trim().to_string())
}

async fn controllers() -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(run_dir()) else {
        return out;
    };
    let mut paths: Vec<PathBuf> = rd
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "sock"))
        .collect();
    paths.sort();
    for p in paths {
        if let Some(j) = ask(&p, "info").await {
            out.push((p, j));
        }
    }
    out
}

async fn run_list(output: &str) -> Result<()> {
    let ctrls = controllers().await;
    match output {
        "json" => {
            let items: Vec<&str> = ctrls.iter().map(|(_, j)| j.as_str()).collect();
            println!("{{\"controllers\":[{}]}}", items.join(","));
        }
        "normal" => {
            println!(
                "{:<8} {:<40} {:<22} {:>6} {:<10} {:>3}",
                "Name", "SubNQN", "Address", "CNTLID", "State", "IOQ"
            );
            for (_, j) in &ctrls {
                let state = json_field(j, "state").unwrap_or("?");
                println!(
                    "{:<8} {:<40} {:<22} {:>6} {:<10} {:>3}",
                    json_field(j, "name").unwrap_or("?"),
                    json_field(j, "subnqn").unwrap_or("?"),
                    json_field(j, "traddr").unwrap_or("?"),
                    json_field(j, "cntlid").unwrap_or("?"),
                    state,
                    json_field(j, "io_queues").unwrap_or("?"),
                );
                println!("{:<8} {}", "", Health::from_json(j).describe(state));
            }
        }
        o => bail!("unknown output format '{o}': use normal or json"),
    }
    Ok(())
}

async fn run_disconnect(nqn: Option<String>, device: Option<String>) -> Result<()> {
    if nqn.is_none() && device.is_none() {
        bail!("give -n NQN or -d DEVICE");
    }
    let mut n = 0;
    for (p, j) in controllers().await {
        let hit = nqn
            .as_deref()
            .is_some_and(|q| json_field(&j, "subnqn") == Some(q))
            || device
                .as_deref()
                .is_some_and(|d| json_field(&j, "name") == Some(d));
        if hit && ask(&p, "disconnect").await.as_deref() == Some("ok") {
            n += 1;
        }
    }
    println!(
        "NQN:{} disconnected {n} controller(s)",
        nqn.or(device).unwrap_or_default()
    );
    if n == 0 {
        bail!("no matching controller");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn cli_parses_nvme_cli_style_flags() {
        let c = Cli::try_parse_from([
            "nvmf-rdma",
            "connect",
            "-t",
            "rdma",
            "-a",
            "127.0.0.1",
            "-s",
            "4420",
            "-n",
            "nqn.a:b",
            "-i",
            "2",
            "-Q",
            "64",
            "-k",
            "5",
            "-c",
            "1",
            "-l",
            "-1",
            "--fast_io_fail_tmo",
            "3",
        ])
        .unwrap();
        let Cmd::Connect { sub: s, .. } = c.cmd else {
            panic!("not connect")
        };
        assert_eq!(s.fabric.traddr, "127.0.0.1:4791".parse().unwrap());
        assert_eq!((s.nr_io_queues, s.queue_size), (2, 64));
        let o = options(&s).unwrap();
        assert_eq!(o.policy.ctrl_loss_tmo, None, "-1 = forever");
        assert_eq!(o.policy.fast_io_fail_tmo, Some(Duration::from_secs(3)));
        assert_eq!(o.policy.reconnect_delay, Duration::from_secs(1));
        assert_eq!(o.policy.keep_alive_tmo, Duration::from_secs(5));
        assert_eq!(o.keep_alive_tmo, Duration::from_secs(5));
        let bad = Cli::try_parse_from(["nvmf-rdma", "connect", "-a", "nowhere", "-n", "x"]);
        assert!(bad.is_err());
        let c = Cli::try_parse_from([
            "nvmf-rdma",
            "connect",
            "-t",
            "tcp",
            "-a",
            "127.0.0.1",
            "-n",
            "nqn.a:b",
        ])
        .unwrap();
        let Cmd::Connect { sub: s, .. } = c.cmd else {
            panic!()
        };
        assert!(options(&s).unwrap_err().to_string().contains("only rdma"));
    }

    fn connect_args(extra: &[&str]) -> Result<Subsys, clap::Error> {
        let mut v = vec!["nvmf-rdma", "connect", "-a", "127.0.0.1", "-n", "nqn.a:b"];
        v.extend_from_slice(extra);
        match Cli::try_parse_from(v)?.cmd {
            Cmd::Connect { sub, .. } => Ok(sub),
            _ => panic!("not connect"),
        }
    }

    #[test]
    fn connect_policy_flags_fill_the_policy() {
        // Linux's defaults when nothing is given.
        let o = options(&connect_args(&[]).unwrap()).unwrap();
        assert_eq!(o.policy, Policy::default());
        assert_eq!(o.io_timeout, Duration::from_secs(30));
        let s = connect_args(&[
            "-c",
            "0",
            "-l",
            "60",
            "--fast-io-fail-tmo",
            "-1",
            "--replug-window",
            "5",
            "--identity",
            "pci",
            "--io-timeout",
            "7",
            "-k",
            "0",
        ])
        .unwrap();
        let o = options(&s).unwrap();
        assert_eq!(
            o.policy,
            Policy {
                ctrl_loss_tmo: Some(Duration::from_secs(60)),
                reconnect_delay: Duration::ZERO,
                fast_io_fail_tmo: None,
                keep_alive_tmo: Duration::ZERO,
                replug_window: Duration::from_secs(5),
                identity: IdentityMatch::Pci,
            }
        );
        assert_eq!(o.io_timeout, Duration::from_secs(7));
        // Chaos defaults apply only where no flag was given.
        let r = connect_args(&["-l", "-1"])
            .unwrap()
            .policy
            .resolve(Duration::ZERO, Some(Duration::from_secs(60)));
        assert_eq!(r.policy.ctrl_loss_tmo, None);
        assert_eq!(r.policy.reconnect_delay, Duration::ZERO);
    }

    #[test]
    fn bad_policy_values_are_clap_errors() {
        for (args, want) in [
            (&["-l", "-2"][..], "forever"),
            (&["-l", "ten"][..], "whole number"),
            (&["--fast_io_fail_tmo", "-5"][..], "forever"),
            (&["-c", "-1"][..], ">= 0"),
            (&["-k", "-1"][..], ">= 0"),
            (&["--identity", "serial"][..], "possible values"),
            (&["--io-timeout", "0"][..], ">= 1"),
            (&["--replug-window", "x"][..], "whole number"),
        ] {
            let e = connect_args(args).expect_err(&format!("{args:?} accepted"));
            let msg = e.to_string();
            assert!(
                msg.contains(want) && msg.contains("invalid value"),
                "{args:?}: {msg}"
            );
        }
    }

    /// GET `addr` over plain HTTP/1.1; the body.
    fn scrape(addr: SocketAddr) -> String {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        assert!(out.starts_with("HTTP/1.1 200"), "{out}");
        out
    }

    /// The only test here that installs the (process-global) recorder.
    #[test]
    fn metrics_addr_serves_the_controller_metrics() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let cli = Cli::try_parse_from(["nvmf-rdma", "demo", "--metrics-addr", &addr.to_string()])
            .unwrap();
        cli.setup().unwrap();
        // A second install is refused: the port is taken (and a recorder is in place).
        assert!(metrics_http::install(addr).is_err());
        let t = LocalTarget::start(16 << 20, 9).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let body = rt.block_on(async {
            let c = nvmf_perf::connect_host(t.addr, DEMO_NQN, 1, 32)
                .await
                .unwrap();
            c.write(1, 0, &[1u8; 4096]).await.unwrap();
            let body = tokio::task::spawn_blocking(move || scrape(addr))
                .await
                .unwrap();
            c.disconnect().await;
            body
        });
        let live = format!("nvmf_ctrl_state{{subnqn=\"{DEMO_NQN}\"}} 1");
        assert!(body.contains(&live), "{body}");
        assert!(body.contains("# HELP nvmf_ctrl_recoveries_total"), "{body}");
        assert!(
            body.contains("nvmf_ctrl_reconnect_attempts_total"),
            "{body}"
        );
        assert!(body.contains("softhca_tx_packets_total"), "{body}");
        // Other commands refuse the flag.
        let cli = Cli::try_parse_from(["nvmf-rdma", "list", "--metrics-addr", "127.0.0.1:1"]);
        assert!(cli.unwrap().setup().is_err());
    }

    #[test]
    fn connect_exports_parse() {
        let c = Cli::try_parse_from([
            "nvmf-rdma",
            "connect",
            "-a",
            "127.0.0.1",
            "-n",
            "nqn.a:b",
            "--nbd",
            "unix:/run/n.sock",
            "--fuse",
            "/mnt/x",
        ])
        .unwrap();
        let Cmd::Connect { export: x, .. } = c.cmd else {
            panic!()
        };
        assert_eq!(x.nbd, Some(ExportAddr::Unix("/run/n.sock".into())));
        assert_eq!(x.fuse, Some(PathBuf::from("/mnt/x")));
        let tcp = [
            "nvmf-rdma",
            "connect",
            "-a",
            "127.0.0.1",
            "-n",
            "x",
            "--nbd",
            "127.0.0.1:10809",
        ];
        assert!(Cli::try_parse_from(tcp).is_ok());
        let bad = [
            "nvmf-rdma",
            "connect",
            "-a",
            "127.0.0.1",
            "-n",
            "x",
            "--nbd",
            "10809",
        ];
        assert!(Cli::try_parse_from(bad).is_err());
    }
}

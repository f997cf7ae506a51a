//! nvmf-rdma command line, following nvme-cli where it has a name for a thing.

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};
use nvmf_rdma::cli::device::{self, DeviceChoice};
use nvmf_rdma::cli::metrics_http;
use nvmf_rdma::cli::support::{
    host_bind_addr, json_field, lock_all_memory, parse_duration, parse_pos_secs, parse_secs,
    parse_tmo, parse_traddr, roce_peer, run_dir, CtrlInfo, Health, Tmo, DEFAULT_ROCE_PORT,
};
use nvmf_rdma::cli::wire_json::JsonObj;
use nvmf_rdma::driver::{CmService, DeviceManager, SoftHca};
use nvmf_rdma::export::{self, ExportAddr};
use nvmf_rdma::harness::chaos::{self, Region, TargetRig, WorkerReport};
use nvmf_rdma::harness::hca_perf;
use nvmf_rdma::harness::nvmf_perf::{self, Job, LocalTarget, Pattern, DEMO_NQN};
use nvmf_rdma::hca::device::{DeviceConfig, DeviceIdentity, IcrcCheck};
use nvmf_rdma::hca::PciAddr;
use nvmf_rdma::nvme::Nqn;
use nvmf_rdma::nvmet::{serve_cm, Namespace, Subsystem, Target, TargetConfig};
use nvmf_rdma::reconnect::policy;
use nvmf_rdma::reconnect::{CtrlState, IdentityMatch, Policy};
use nvmf_rdma::transport::{discover, ConnectOptions, Controller};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

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
    /// After packets move, keep polling the soft-HCA's socket this long before sleeping
    /// (0 turns it off). Waking a sleeping thread is most of a queue-depth-1 round trip on a
    /// virtual machine; polling costs a core while I/O flows and nothing once it stops.
    #[arg(long, global = true, default_value = "50us", value_parser = parse_duration, value_name = "TIME")]
    busy_poll: Duration,
    #[command(subcommand)]
    cmd: Cmd,
}

impl Cli {
    /// Start what the global options ask for, before any device or controller exists.
    fn setup(&self) -> Result<()> {
        nvmf_rdma::driver::set_default_busy_poll(self.busy_poll);
        if self.mlock {
            match lock_all_memory().map_err(anyhow::Error::msg)? {
                None => tracing::debug!("memory locked"),
                Some(limit) => eprintln!(
                    "--mlock: memory locked up to RLIMIT_MEMLOCK ({}); allocations past it \
                     will fail (ulimit -l unlimited lifts it)",
                    hca_perf::human(limit.min(usize::MAX as u64) as usize)
                ),
            }
        }
        if let Some(addr) = self.metrics_addr {
            if !matches!(
                self.cmd,
                Cmd::Connect { .. } | Cmd::Chaos(_) | Cmd::Demo { .. } | Cmd::Target(_)
            ) {
                bail!("--metrics-addr is for connect, chaos, demo and target");
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
    /// Address of the host's soft-HCA (IP, port 4791, or IP:PORT). Default: the local
    /// address that routes to the target, on port 4791 unless the target is on loopback.
    #[arg(short = 'w', long = "host-traddr", value_parser = parse_traddr)]
    host_traddr: Option<SocketAddr>,
    /// RDMA device the host runs on: soft (the built-in soft-HCA), or a kernel RDMA device
    /// (a build with `--features hw`) by name (rxe0, mlx5_0), guid:<GUID> or pci:<address>.
    #[arg(long, default_value = "soft")]
    device: DeviceChoice,
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
    /// Allow --nbd on an address other than loopback. NBD has no authentication: whoever
    /// reaches the port can read and write the namespace.
    #[arg(long)]
    nbd_allow_remote: bool,
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
    /// Benchmark tables over loopback: NVMe-oF (default) or the raw soft-HCA (--hca). With
    /// --traddr: 4 KiB random reads at QD1 and QD32 and 128 KiB sequential reads at QD16 on
    /// namespace 1 of that target, the jobs `tests/vm/run.sh bench` gives fio through the
    /// Linux host.
    Bench {
        /// Seconds per row.
        #[arg(long, default_value_t = 3.0)]
        seconds: f64,
        #[arg(long)]
        hca: bool,
        /// I/O queues for the NVMe-oF table.
        #[arg(long, default_value_t = 1)]
        queues: usize,
        /// Run only this row of the NVMe-oF table (repeatable), named as fio-plugin/bench.sh
        /// names its fio jobs: randread-4k-qd1, randread-4k-qd32, randwrite-4k-qd1,
        /// randwrite-4k-qd32, read-128k-qd8, write-128k-qd8.
        #[arg(long = "job", value_name = "NAME")]
        jobs: Vec<String>,
        #[command(flatten)]
        ext: ExternalTarget,
    },
    /// Run the built-in NVMe-oF target until interrupted.
    Target(TargetArgs),
    /// Hardware verbs backend (built with `--features hw`): kernel RDMA devices through
    /// libibverbs/librdmacm instead of the soft-HCA.
    #[cfg(feature = "hw")]
    Hw(nvmf_rdma::hw::cli::HwArgs),
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
    /// Read blocks and write them to a file, raw to stdout (`--output -`), or as a hex dump.
    Read {
        #[command(flatten)]
        sub: Subsys,
        #[arg(long, default_value_t = 0)]
        lba: u64,
        #[arg(long, value_parser = parse_size)]
        size: usize,
        /// Where the data goes: a file, or `-` for the raw bytes on stdout. Without it, a hex
        /// dump on stdout.
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
    /// Chaos on loopback, no setup: a built-in RAM target and a host whose HCA is reset,
    /// unplugged and re-plugged (or replaced by another card), the target restarted, the
    /// controller reset, while workers write and verify. Prints what survived. With
    /// --traddr, against another target: only host-side faults are made (not
    /// target-restart); faults on the target side are yours to make.
    Chaos(ChaosArgs),
    /// Print the RC QP state transition table (or a Graphviz graph with --dot).
    QpStates {
        #[arg(long)]
        dot: bool,
    },
}

/// A target of someone else's for `bench` and `chaos`, instead of the built-in one.
#[derive(Args, Debug, Clone)]
struct ExternalTarget {
    /// Run against this target instead of a built-in one (IP, RoCEv2 port 4791, or
    /// IP:PORT): Linux nvmet-rdma, SPDK, another `nvmf-rdma target`.
    #[arg(short = 'a', long = "traddr", value_parser = parse_traddr)]
    traddr: Option<SocketAddr>,
    /// NVMe-oF service port of --traddr.
    #[arg(short = 's', long = "trsvcid", default_value_t = 4420)]
    trsvcid: u16,
    /// Subsystem NQN at --traddr.
    #[arg(short = 'n', long = "nqn", requires = "traddr")]
    nqn: Option<String>,
    /// Address of the host's soft-HCA towards --traddr (as connect's --host-traddr).
    #[arg(short = 'w', long = "host-traddr", value_parser = parse_traddr, requires = "traddr")]
    host_traddr: Option<SocketAddr>,
    /// RDMA device towards --traddr, as connect's --device.
    #[arg(long, default_value = "soft", requires = "traddr")]
    device: DeviceChoice,
}

#[derive(Args, Debug, Clone)]
struct ChaosArgs {
    /// RAM namespace size; the workers share it out. With --traddr: how much of the
    /// target's namespace 1 the workers use (from LBA 0; its data is overwritten).
    #[arg(long, default_value = "256M", value_parser = parse_size)]
    size: usize,
    #[command(flatten)]
    ext: ExternalTarget,
    /// Verifying workers, each on its own range of blocks.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=256))]
    workers: u64,
    /// How long to run, in seconds.
    #[arg(long, default_value_t = 20.0)]
    seconds: f64,
    /// Time between faults (500ms, 2s, ...); a fault waits until the controller has been
    /// live again for at least half of it.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    every: Duration,
    /// Faults to inflict, picked at random: reset (HCA fatal error), replug (hot-remove and
    /// the same card back), replug-other (another card in the slot, then ours again),
    /// target-restart, user-reset (controller reset).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_values = ["reset", "replug", "target-restart"]
    )]
    faults: Vec<FaultKind>,
    /// Seed of the fault order and down times (default: from the clock; printed).
    #[arg(long)]
    seed: Option<u64>,
    /// Longest time a reset or unplugged HCA stays away (each fault picks 0..=this).
    #[arg(long = "down-max", default_value = "200ms", value_parser = parse_duration)]
    down_max: Duration,
    /// I/O queues.
    #[arg(short = 'i', long = "nr-io-queues", default_value_t = 2)]
    nr_io_queues: usize,
    /// Entries per I/O queue (16..=1024).
    #[arg(short = 'Q', long = "queue-size", default_value_t = 128)]
    queue_size: usize,
    /// Largest I/O a worker issues (each picks 1 block..=this).
    #[arg(long = "max-io", default_value = "64K", value_parser = parse_size)]
    max_io: usize,
    #[command(flatten)]
    policy: PolicyArgs,
    /// Output format: normal or json (the summary; progress goes to stderr).
    #[arg(
        short = 'o',
        long = "output-format",
        value_enum,
        default_value = "normal"
    )]
    output: OutputFormat,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum OutputFormat {
    Normal,
    Json,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, ValueEnum)]
enum FaultKind {
    Reset,
    Replug,
    ReplugOther,
    TargetRestart,
    UserReset,
}

impl FaultKind {
    const ALL: [FaultKind; 5] = [
        FaultKind::Reset,
        FaultKind::Replug,
        FaultKind::ReplugOther,
        FaultKind::TargetRestart,
        FaultKind::UserReset,
    ];

    fn name(self) -> &'static str {
        match self {
            FaultKind::Reset => "reset",
            FaultKind::Replug => "replug",
            FaultKind::ReplugOther => "replug-other",
            FaultKind::TargetRestart => "target-restart",
            FaultKind::UserReset => "user-reset",
        }
    }
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

/// A device on `addr`; off loopback its peers may be rxe or NICs (see `roce_peer`).
fn device_config(name: &str, addr: SocketAddr, n: u8) -> DeviceConfig {
    // Locally administered, random per process: the MAC (and the GUID made from it) goes
    // out in every CM REQ and REP, so it must tell a peer nothing (it held the PID), yet
    // differ between processes on one IP, as the CM tells connections apart by it.
    let r: [u8; 3] = rand::random();
    let mac = [0x52, 0x54, r[0], r[1], r[2], n];
    let roce = roce_peer(addr.ip());
    DeviceConfig {
        identity: DeviceIdentity::from_mac(name, mac, PciAddr::new(0, 0x30, n, 0)),
        addr,
        icrc: if roce {
            IcrcCheck::Skip
        } else {
            IcrcCheck::Verify
        },
        peer_port: roce.then_some(DEFAULT_ROCE_PORT),
        // Only the simulator seeds a device; this one draws from the OS CSPRNG.
        seed: 0,
    }
}

/// A host soft-HCA on the local address that routes to `target`.
async fn host_stack(
    target: SocketAddr,
    host_traddr: Option<SocketAddr>,
) -> Result<(SoftHca, CmService)> {
    let addr = host_bind_addr(target, host_traddr).context("no route to the target address")?;
    let hca = SoftHca::start_with(device_config("srxe0", addr, 1), !roce_peer(target.ip()))
        .await
        .with_context(|| format!("cannot start the host soft-HCA on {addr}"))?;
    let cm = CmService::for_device(&hca);
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
    apply_system_host_ids(&mut o, std::path::Path::new(NVME_CONF_DIR));
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

/// Where nvme-cli keeps the system's host NQN and host ID.
const NVME_CONF_DIR: &str = "/etc/nvme";

/// The system's host identity, as nvme-cli has it: `hostnqn` and `hostid` in `dir` (one
/// line each), when present and valid. A target whose allow-list holds the system host NQN
/// then lets us in as it lets the kernel host in; `-q` still overrides. A host ID without a
/// host NQN also names the NQN (`nqn.2014-08.org.nvmexpress:uuid:<hostid>`).
fn apply_system_host_ids(o: &mut ConnectOptions, dir: &std::path::Path) {
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).ok();
    let id = read("hostid").and_then(|t| parse_uuid(t.trim()));
    if let Some(id) = id {
        o.hostid = id;
        o.hostnqn = Nqn::from_uuid(&id).as_str().to_string();
    }
    if let Some(n) = read("hostnqn") {
        let n = n.trim();
        if n.starts_with("nqn.") && Nqn::new(n).is_ok() {
            o.hostnqn = n.to_string();
        }
    }
}

/// `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` as 16 bytes.
fn parse_uuid(t: &str) -> Option<[u8; 16]> {
    let hex: String = t.chars().filter(|c| *c != '-').collect();
    if hex.len() != 32 || t.len() != 36 {
        return None;
    }
    let mut id = [0u8; 16];
    for (i, b) in id.iter_mut().enumerate() {
        *b = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(id)
}

/// The name of the host HCA in the device manager of `connect`, `read`, `write`, `verify`.
const HOST_HCA: &str = "srxe0";

/// A host soft-HCA plugged into a device manager, on the local address that routes to
/// `target`. A controller on it comes back after the device is reset or re-plugged.
async fn host_device(target: SocketAddr, host_traddr: Option<SocketAddr>) -> Result<DeviceManager> {
    let addr = host_bind_addr(target, host_traddr).context("no route to the target address")?;
    let mgr = DeviceManager::new(!roce_peer(target.ip()));
    mgr.plug(device_config(HOST_HCA, addr, 1))
        .await
        .with_context(|| format!("cannot start the host soft-HCA on {addr}"))?;
    Ok(mgr)
}

async fn connect(s: &Subsys) -> Result<Controller> {
    let o = options(s)?;
    let c = match &s.fabric.device {
        DeviceChoice::Soft => {
            let mgr = host_device(s.fabric.traddr, s.fabric.host_traddr).await?;
            Controller::connect_managed(mgr, HOST_HCA, o).await
        }
        DeviceChoice::Kernel(sel) => device::connect_kernel(sel, o).await,
    };
    c.with_context(|| format!("connect to {} at {}", s.nqn, s.fabric.traddr))
}

/// Errors end the process with one line: what failed and why, outermost first (anyhow's
/// `{:#}`), never Debug text or a backtrace.
fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nvmf-rdma: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
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
            jobs,
            ext:
                ExternalTarget {
                    traddr,
                    trsvcid,
                    nqn,
                    host_traddr,
                    device,
                },
        } => {
            if !(0.05..=600.0).contains(&seconds) {
                bail!("--seconds must be between 0.05 and 600");
            }
            if !jobs.is_empty() && (hca || traddr.is_some()) {
                bail!("--job picks rows of the built-in NVMe-oF table; not with --hca or --traddr");
            }
            if let Some(traddr) = traddr {
                let sub = Subsys {
                    fabric: Fabric {
                        transport: "rdma".into(),
                        traddr,
                        trsvcid,
                        hostnqn: None,
                        host_traddr,
                        device,
                    },
                    nqn: nqn.unwrap_or_else(|| DEMO_NQN.into()),
                    nr_io_queues: queues.clamp(1, 64),
                    queue_size: 128,
                    policy: PolicyArgs::default(),
                    nsid: 1,
                };
                return remote_bench(&sub, Duration::from_secs_f64(seconds));
            }
            if hca {
                hca_perf::print_table(&hca_perf::standard_table(Duration::from_secs_f64(seconds))?);
            } else {
                let jobs = nvmf_perf::select_jobs(Duration::from_secs_f64(seconds), &jobs)?;
                nvmf_perf::print_results(&nvmf_perf::bench(jobs, queues.clamp(1, 64))?);
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
        #[cfg(feature = "hw")]
        Cmd::Hw(a) => Ok(nvmf_rdma::hw::cli::run(a).await?),
        Cmd::Discover(f) => {
            check_transport(&f)?;
            let mut o = ConnectOptions::new(f.traddr, nvmf_rdma::nvme::fabrics::DISCOVERY_NQN);
            o.trsvcid = f.trsvcid;
            apply_system_host_ids(&mut o, std::path::Path::new(NVME_CONF_DIR));
            if let Some(h) = f.hostnqn {
                o.hostnqn = h;
            }
            let entries = match &f.device {
                DeviceChoice::Soft => {
                    let (hca, cm) = host_stack(f.traddr, f.host_traddr).await?;
                    discover(hca, cm, o).await
                }
                DeviceChoice::Kernel(sel) => device::discover_kernel(sel, o).await,
            }
            .context("discovery failed")?;
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
        Cmd::Chaos(a) => run_chaos(a).await,
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
                Some(p) if p.as_os_str() == "-" => {
                    use std::io::Write;
                    let mut out = std::io::stdout().lock();
                    out.write_all(&data)
                        .and_then(|_| out.flush())
                        .context("write to stdout")?
                }
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

/// `bench --traddr`: the fio jobs of `tests/vm/run.sh bench` through our host.
fn remote_bench(sub: &Subsys, runtime: Duration) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let c = Arc::new(connect(sub).await?);
        let mut rows = Vec::new();
        for (pattern, bs, iodepth) in [
            (Pattern::RandRead, 4096, 1),
            (Pattern::RandRead, 4096, 32),
            (Pattern::SeqRead, 128 << 10, 16),
        ] {
            let job = Job {
                pattern,
                bs,
                iodepth,
                runtime,
            };
            rows.push(nvmf_perf::run_job(c.clone(), job).await);
        }
        nvmf_perf::print_results(&rows);
        let errors: u64 = rows.iter().map(|r| r.errors).sum();
        if let Ok(c) = Arc::try_unwrap(c) {
            c.disconnect().await;
        }
        if errors > 0 {
            bail!("{errors} I/O errors");
        }
        Ok(())
    })
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
                hca_perf::human(done),
                hca_perf::human(size),
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
    println!("nvmf-rdma demo: built-in target ({} RAM namespace) and host, each on its own soft RoCEv2 HCA on 127.0.0.1", hca_perf::human(ns_bytes as usize));
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
            hca_perf::human(size),
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
        hca_perf::human(size),
        hca_perf::human(chunk)
    );
    let r = hca_perf::demo(size, chunk).context("demo failed")?;
    let gbs = |d: Duration| r.bytes as f64 / d.as_secs_f64() / 1e9;
    println!(
        "RDMA WRITE {:>10}  {:8.3} s  {:6.3} GB/s",
        hca_perf::human(r.bytes),
        r.write.as_secs_f64(),
        gbs(r.write)
    );
    println!(
        "RDMA READ  {:>10}  {:8.3} s  {:6.3} GB/s",
        hca_perf::human(r.bytes),
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
    serve_cm(t.clone(), CmService::for_device(&hca));
    println!(
        "target {} listening on {} (trsvcid {}); Ctrl-C stops it",
        a.nqn,
        hca.addr(),
        a.trsvcid
    );
    let sig = StopSignals::new()?.recv().await;
    println!("{sig}: stopping; {:?}", t.stats());
    Ok(())
}

/// SIGINT, SIGTERM and SIGHUP, registered once: a signal that arrives while the process is
/// busy elsewhere waits here and is never lost.
struct StopSignals {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

impl StopSignals {
    fn new() -> Result<StopSignals> {
        use tokio::signal::unix::{signal, SignalKind};
        let reg = |k| signal(k).context("cannot install signal handlers");
        Ok(StopSignals {
            int: reg(SignalKind::interrupt())?,
            term: reg(SignalKind::terminate())?,
            hup: reg(SignalKind::hangup())?,
        })
    }

    /// The next stop signal's name.
    async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.int.recv() => "SIGINT",
            _ = self.term.recv() => "SIGTERM",
            _ = self.hup.recv() => "SIGHUP",
        }
    }
}

/// Longest control-socket request line, and how long a client may take to send it.
const CONTROL_LINE_MAX: u64 = 1024;
const CONTROL_TIMEOUT: Duration = Duration::from_secs(2);

/// One control-socket client: one request line, one answer. Runs in its own task, so a
/// client that sends nothing (or too much) never holds up the controller or a signal.
async fn serve_control_client(
    stream: tokio::net::UnixStream,
    info: String,
    stop: Arc<tokio::sync::Notify>,
) {
    let (r, mut w) = stream.into_split();
    let mut line = String::new();
    let mut r = BufReader::new(r.take(CONTROL_LINE_MAX));
    let read = r.read_line(&mut line);
    let answer: &[u8] = match tokio::time::timeout(CONTROL_TIMEOUT, read).await {
        Ok(Ok(_)) => match line.trim() {
            "info" => {
                let _ = w.write_all(format!("{info}\n").as_bytes()).await;
                return;
            }
            "disconnect" => {
                stop.notify_one();
                b"ok\n"
            }
            _ => b"error: unknown request\n",
        },
        _ => b"error: no request line within 2 s\n",
    };
    let _ = w.write_all(answer).await;
}

/// The run directory, created 0700 whatever the umask; an existing one of ours is made 0700.
fn make_run_dir(dir: &std::path::Path) -> Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("create {}", dir.display()))?;
    let meta = std::fs::metadata(dir).with_context(|| format!("stat {}", dir.display()))?;
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    if meta.uid() != euid {
        bail!(
            "{} belongs to another user (uid {}); set NVMF_RDMA_RUN_DIR to a directory of yours",
            dir.display(),
            meta.uid()
        );
    }
    if meta.mode() & 0o077 != 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .with_context(|| format!("chmod 0700 {}", dir.display()))?;
    }
    Ok(())
}

/// Is the control-socket client our own user (or root)?
fn same_user(s: &tokio::net::UnixStream) -> bool {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    s.peer_cred().is_ok_and(|c| c.uid() == euid || c.uid() == 0)
}

async fn run_connect(s: Subsys, x: ExportArgs) -> Result<()> {
    let mut signals = StopSignals::new()?;
    let c = tokio::select! {
        c = connect(&s) => Arc::new(c?),
        sig = signals.recv() => bail!("{sig} while connecting to {}: nothing was connected", s.nqn),
    };
    let exports = start_exports(&c, &s, &x).await?;
    let dir = run_dir();
    make_run_dir(&dir)?;
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
    // Whoever can open the socket can disconnect the controller: ours alone, whatever the
    // umask (and the directory is 0700 too).
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("chmod 0600 {}", path.display()))?;
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
            hca_perf::human(ns.bytes() as usize)
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
    let stop = Arc::new(tokio::sync::Notify::new());
    let mut clients = tokio::task::JoinSet::new();
    let mut status = c.watch_status();
    let dead = loop {
        tokio::select! {
            sig = signals.recv() => {
                println!("{name}: {sig}: disconnecting");
                break None;
            }
            _ = stop.notified() => break None,
            st = status.wait_for(|s| s.state() == CtrlState::Dead) => {
                break Some(st.map(|s| *s).ok());
            }
            conn = listener.accept() => {
                let Ok((stream, _)) = conn else {
                    // Out of descriptors and the like: pause rather than spin; a signal that
                    // comes meanwhile waits in its stream.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                };
                if !same_user(&stream) {
                    continue;
                }
                clients.spawn(serve_control_client(stream, info().to_json(), stop.clone()));
            }
            Some(_) = clients.join_next(), if !clients.is_empty() => {}
        }
    };
    clients.abort_all();
    watcher.abort();
    exports.stop().await;
    if let Ok(c) = Arc::try_unwrap(c) {
        // Deleting ends at once whatever recovery is doing; a second signal still wins.
        tokio::select! {
            _ = c.disconnect() => {}
            sig = signals.recv() => {
                let _ = std::fs::remove_file(&path);
                bail!("{sig}: stopped before {name} finished disconnecting")
            }
        }
    }
    // Last: `nvmf-rdma disconnect` waits for the socket to go as the sign that it is done.
    drop(listener);
    let _ = std::fs::remove_file(&path);
    match dead {
        None => {
            println!("{name}: disconnected");
            Ok(())
        }
        // Like Linux deleting a controller that gave up: the holder ends, with an error.
        Some(st) => {
            let why = st
                .and_then(|s| s.machine.fail_reason)
                .map_or("it gave up", |r| r.name());
            bail!("{name}: the controller is dead ({why}); its pending I/O failed. Connect again once the target is reachable")
        }
    }
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
                    ", {} after the failure",
                    human_dur(d)
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
        let l =
            export::NbdListener::bind_with(addr, export::NbdLimits::default(), x.nbd_allow_remote)
                .await?;
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

// ---- chaos -------------------------------------------------------------------------------

const CHAOS_IP: [u8; 4] = [127, 0, 0, 1];

/// What one fault did.
#[derive(Debug, Clone)]
struct FaultOutcome {
    kind: FaultKind,
    /// Since the start of the run.
    at: Duration,
    /// How long the HCA stayed away (reset, replug) or the foreign card stayed in.
    down: Duration,
    /// From inflicting the fault to LIVE again; `None`: the controller did not recover.
    to_live: Option<Duration>,
    /// The controller's own measure of the recovery (failure noticed → LIVE).
    ctrl_recovery: Option<Duration>,
    /// replug-other: the controller saw the foreign card...
    foreign_seen: bool,
    /// ...and reconnected through it (wrong unless `--identity any`).
    through_foreign: bool,
    /// The policy accepts the other card (`--identity any`).
    foreign_allowed: bool,
    /// The fault itself could not be inflicted.
    error: Option<String>,
}

impl FaultOutcome {
    fn describe(&self) -> String {
        let mut s = format!(
            "[{:>7.2} s] {:<14}",
            self.at.as_secs_f64(),
            self.kind.name()
        );
        match self.kind {
            FaultKind::Reset | FaultKind::Replug => s += &format!(" down {:>8}", ms(self.down)),
            FaultKind::ReplugOther => s += &format!(" in   {:>8}", ms(self.down)),
            _ => s += &format!(" {:>13}", ""),
        }
        if let Some(e) = &self.error {
            return s + &format!("  FAILED TO INFLICT: {e}");
        }
        match self.to_live {
            Some(d) => {
                s += &format!("  live again in {:>9}", ms(d));
                if let Some(c) = self.ctrl_recovery {
                    s += &format!(" (controller: {})", ms(c));
                }
            }
            None => s += "  NOT RECOVERED",
        }
        if self.kind == FaultKind::ReplugOther {
            s += match (
                self.foreign_allowed,
                self.foreign_seen,
                self.through_foreign,
            ) {
                (true, _, true) => "; came back on the other card (--identity any)",
                (true, _, false) => "; did not come back on the other card in time",
                (false, _, true) => "; RECONNECTED THROUGH THE FOREIGN CARD",
                (false, true, false) => "; foreign card seen, not used",
                (false, false, false) => "; foreign card not noticed",
            };
        }
        s
    }
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

/// 2 s, 500 ms, 1.5 s, 250 us.
fn human_dur(d: Duration) -> String {
    if d >= Duration::from_secs(1) {
        let s = d.as_secs_f64();
        if s.fract() == 0.0 {
            format!("{s:.0} s")
        } else {
            format!("{s:.2} s")
        }
    } else if d >= Duration::from_millis(1) {
        format!("{} ms", d.as_millis())
    } else {
        format!("{} us", d.as_micros())
    }
}

/// 1.5 GiB, 388.2 MiB, 12.0 KiB.
fn human_bytes(b: u64) -> String {
    let f = b as f64;
    if f >= (1u64 << 30) as f64 {
        format!("{:.2} GiB", f / (1u64 << 30) as f64)
    } else if f >= (1u64 << 20) as f64 {
        format!("{:.1} MiB", f / (1u64 << 20) as f64)
    } else {
        format!("{:.1} KiB", f / 1024.0)
    }
}

/// nvme-cli's seconds-or-off for the summary.
fn tmo_text(t: Option<Duration>, none: &str) -> String {
    t.map_or(none.to_string(), |d| format!("{} s", d.as_secs()))
}

/// p50, p99 and max of durations.
fn spread(mut v: Vec<Duration>) -> Option<(Duration, Duration, Duration)> {
    if v.is_empty() {
        return None;
    }
    v.sort();
    let ns: Vec<u64> = v.iter().map(|d| d.as_nanos() as u64).collect();
    let d = |p| Duration::from_nanos(chaos::pct(&ns, p));
    Some((d(0.5), d(0.99), v[v.len() - 1]))
}

fn spread_text(s: Option<(Duration, Duration, Duration)>) -> String {
    match s {
        Some((p50, p99, max)) => format!("p50 {}, p99 {}, max {}", ms(p50), ms(p99), ms(max)),
        None => "-".into(),
    }
}

fn spread_json(s: Option<(Duration, Duration, Duration)>, unit: f64) -> String {
    match s {
        Some((p50, p99, max)) => {
            let f = |d: Duration| format!("{:.3}", d.as_secs_f64() * unit);
            let mut o = JsonObj::new();
            o.raw("p50", &f(p50))
                .raw("p99", &f(p99))
                .raw("max", &f(max));
            o.finish()
        }
        None => "null".into(),
    }
}

/// Inflict `kind` and wait until the controller is LIVE again (or gives up, or `bound`).
async fn inflict(
    kind: FaultKind,
    down: Duration,
    mgr: &DeviceManager,
    c: &Controller,
    target: Option<&mut TargetRig>,
    bound: Duration,
    other_is_ours: bool,
) -> FaultOutcome {
    let before = c.status();
    let t0 = Instant::now();
    let mut out = FaultOutcome {
        kind,
        at: Duration::ZERO,
        down,
        to_live: None,
        ctrl_recovery: None,
        foreign_seen: false,
        through_foreign: false,
        foreign_allowed: other_is_ours,
        error: None,
    };
    let mut base = before.machine.recoveries;
    let r: Result<()> = async {
        match kind {
            FaultKind::Reset => chaos::Fault::Reset { down }.inflict(mgr, c, target).await,
            FaultKind::Replug => chaos::Fault::Replug { down }.inflict(mgr, c, target).await,
            FaultKind::TargetRestart => chaos::Fault::TargetRestart.inflict(mgr, c, target).await,
            FaultKind::UserReset => chaos::Fault::UserReset.inflict(mgr, c, target).await,
            FaultKind::ReplugOther => {
                mgr.unplug(chaos::HOST_DEV).await?;
                mgr.replug(chaos::host_identity(1)).await?;
                if other_is_ours {
                    // `--identity any`: the controller may (and should) come back on it.
                    let _ = c
                        .wait_status(bound, |s| {
                            s.state() == CtrlState::Live && s.machine.recoveries > base
                        })
                        .await;
                } else {
                    out.foreign_seen = c
                        .wait_status(Duration::from_secs(2), |s| s.machine.foreign_device)
                        .await
                        .is_ok();
                }
                tokio::time::sleep(down.max(Duration::from_millis(50))).await;
                let during = c.status();
                out.through_foreign =
                    during.machine.recoveries > base || during.state() == CtrlState::Live;
                if out.through_foreign && !other_is_ours {
                    tracing::error!("the controller reconnected through a foreign card");
                }
                // Ours back; a controller that (allowed to) went through the other card
                // recovers once more.
                base = during.machine.recoveries;
                mgr.unplug(chaos::HOST_DEV).await?;
                mgr.replug(chaos::host_identity(0)).await?;
                Ok(())
            }
        }
    }
    .await;
    if let Err(e) = r {
        out.error = Some(format!("{e:#}"));
        return out;
    }
    let st = c
        .wait_status(bound, |s| {
            (s.state() == CtrlState::Live && s.machine.recoveries > base)
                || s.state() == CtrlState::Dead
        })
        .await;
    if let Ok(st) = st {
        if st.state() == CtrlState::Live {
            out.to_live = Some(t0.elapsed());
            out.ctrl_recovery = st.last_recovery;
        }
    }
    out
}

/// Failed I/Os that the policy allows: after the controller gave up (ctrl_loss_tmo,
/// max_reconnects, replug_window), or past fast_io_fail_tmo when one is set.
fn allowed_failures(p: &Policy) -> Vec<String> {
    use nvmf_rdma::reconnect::FailReason;
    use nvmf_rdma::transport::HostError;
    let mut v = vec![
        FailReason::CtrlLoss,
        FailReason::MaxReconnects,
        FailReason::ReplugWindow,
    ];
    if p.fast_io_fail_tmo.is_some() {
        v.push(FailReason::FastIoFail);
    }
    v.into_iter()
        .map(|r| chaos::error_kind(&HostError::Path(r)))
        .collect()
}

struct ChaosSummary {
    seed: u64,
    elapsed: Duration,
    io: WorkerReport,
    lat: Option<(Duration, Duration, Duration)>,
    faults: Vec<FaultOutcome>,
    recoveries: u64,
    requeued: u64,
    final_state: String,
    final_health: Health,
    failed_by_reason: std::collections::BTreeMap<String, u64>,
    unexpected_failures: u64,
    problems: Vec<String>,
}

impl ChaosSummary {
    fn to_live(&self) -> Option<(Duration, Duration, Duration)> {
        spread(self.faults.iter().filter_map(|f| f.to_live).collect())
    }
    fn ctrl(&self) -> Option<(Duration, Duration, Duration)> {
        spread(self.faults.iter().filter_map(|f| f.ctrl_recovery).collect())
    }
    fn count(&self, k: FaultKind) -> usize {
        self.faults.iter().filter(|f| f.kind == k).count()
    }
    fn unrecovered(&self) -> usize {
        self.faults.iter().filter(|f| f.to_live.is_none()).count()
    }
    fn ios(&self) -> u64 {
        self.io.reads + self.io.writes
    }
    fn failed(&self) -> u64 {
        self.io.errors.len() as u64
    }

    fn print(&self, a: &ChaosArgs) {
        let secs = self.elapsed.as_secs_f64();
        let row = |k: &str, v: String| println!("{k:<20} {v}");
        println!();
        row("elapsed", format!("{secs:.2} s"));
        row(
            "I/Os",
            format!(
                "{} (reads {}, writes {}), {:.0}/s",
                self.ios(),
                self.io.reads,
                self.io.writes,
                self.ios() as f64 / secs
            ),
        );
        row(
            "verified",
            format!(
                "{} read back and compared",
                human_bytes(self.io.bytes_verified)
            ),
        );
        row("I/O latency", spread_text(self.lat));
        let kinds: Vec<String> = FaultKind::ALL
            .iter()
            .filter(|k| a.faults.contains(k))
            .map(|&k| format!("{} {}", k.name(), self.count(k)))
            .collect();
        row(
            "faults",
            format!("{}: {}", self.faults.len(), kinds.join(", ")),
        );
        row(
            "recoveries",
            format!(
                "{} ({} I/Os held across failures{})",
                self.recoveries,
                self.requeued,
                match self.unrecovered() {
                    0 => String::new(),
                    n => format!("; {n} faults NOT recovered"),
                }
            ),
        );
        row(
            "recovery time",
            format!("fault -> live:     {}", spread_text(self.to_live())),
        );
        row(
            "",
            format!(
                "failure -> live:   {} (controller)",
                spread_text(self.ctrl())
            ),
        );
        if a.faults.contains(&FaultKind::ReplugOther) {
            let n = self.count(FaultKind::ReplugOther);
            let seen = self.faults.iter().filter(|f| f.foreign_seen).count();
            let used = self.faults.iter().filter(|f| f.through_foreign).count();
            row(
                "foreign card",
                format!(
                    "in the slot {n} times: seen {seen}, reconnected through it {used} \
                     (--identity {})",
                    IdentityMatch::from(a.policy.identity.unwrap_or(IdentityArg::Both))
                ),
            );
        }
        let reasons: Vec<String> = self
            .failed_by_reason
            .iter()
            .map(|(r, n)| format!("{r}: {n}"))
            .collect();
        row(
            "failed I/Os",
            if reasons.is_empty() {
                "0".into()
            } else {
                format!(
                    "{} ({}); {} within ctrl_loss_tmo",
                    self.failed(),
                    reasons.join(", "),
                    self.unexpected_failures
                )
            },
        );
        row(
            "mismatches",
            format!(
                "{} (acknowledged writes lost or corrupted)",
                self.io.mismatches
            ),
        );
        row("hangs", self.io.hangs.to_string());
        row(
            "controller",
            format!(
                "{}; {}",
                self.final_state,
                self.final_health.describe(&self.final_state)
            ),
        );
        row(
            "result",
            if self.problems.is_empty() {
                "PASS".into()
            } else {
                format!("FAIL: {}", self.problems.join("; "))
            },
        );
    }

    fn to_json(&self, a: &ChaosArgs, r: &Resolved) -> String {
        let mut faults = JsonObj::new();
        faults.num("total", self.faults.len() as u64);
        for k in FaultKind::ALL {
            faults.num(k.name(), self.count(k) as u64);
        }
        let log: Vec<String> = self
            .faults
            .iter()
            .map(|f| {
                let mut o = JsonObj::new();
                let opt_ms = |d: Option<Duration>| {
                    d.map_or("null".into(), |d| format!("{:.3}", d.as_secs_f64() * 1e3))
                };
                o.raw("at_s", &format!("{:.3}", f.at.as_secs_f64()))
                    .str("kind", f.kind.name())
                    .raw("down_ms", &opt_ms(Some(f.down)))
                    .raw("to_live_ms", &opt_ms(f.to_live))
                    .raw("ctrl_recovery_ms", &opt_ms(f.ctrl_recovery));
                if f.kind == FaultKind::ReplugOther {
                    o.raw(
                        "foreign_seen",
                        if f.foreign_seen { "true" } else { "false" },
                    )
                    .raw(
                        "through_foreign",
                        if f.through_foreign { "true" } else { "false" },
                    );
                }
                if let Some(e) = &f.error {
                    o.str("error", e);
                }
                o.finish()
            })
            .collect();
        let mut by_reason = JsonObj::new();
        for (k, n) in &self.failed_by_reason {
            by_reason.num(k, *n);
        }
        let mut failed = JsonObj::new();
        failed
            .num("total", self.failed())
            .num("within_ctrl_loss_tmo", self.unexpected_failures)
            .raw("by_reason", &by_reason.finish());
        let p = &r.policy;
        let mut policy = JsonObj::new();
        policy
            .num("reconnect_delay_s", p.reconnect_delay.as_secs())
            .raw(
                "ctrl_loss_tmo_s",
                &p.ctrl_loss_tmo
                    .map_or("-1".into(), |d| d.as_secs().to_string()),
            )
            .raw(
                "fast_io_fail_tmo_s",
                &p.fast_io_fail_tmo
                    .map_or("-1".into(), |d| d.as_secs().to_string()),
            )
            .num("replug_window_s", p.replug_window.as_secs())
            .str("identity", p.identity.name())
            .num("keep_alive_tmo_s", p.keep_alive_tmo.as_secs())
            .num("io_timeout_s", r.io_timeout.as_secs());
        let problems: Vec<String> = self.problems.iter().map(|p| wire_quote(p)).collect();
        let mut o = JsonObj::new();
        o.num("seed", self.seed)
            .raw("elapsed_s", &format!("{:.3}", self.elapsed.as_secs_f64()))
            .num("workers", a.workers)
            .num("size", a.size as u64)
            .raw("policy", &policy.finish())
            .num("ios", self.ios())
            .num("reads", self.io.reads)
            .num("writes", self.io.writes)
            .num("verified_bytes", self.io.bytes_verified)
            .raw("latency_ms", &spread_json(self.lat, 1e3))
            .raw("faults", &faults.finish())
            .num("recoveries", self.recoveries)
            .num("unrecovered", self.unrecovered() as u64)
            .num("requeued", self.requeued)
            .raw("recovery_ms", &spread_json(self.to_live(), 1e3))
            .raw("ctrl_recovery_ms", &spread_json(self.ctrl(), 1e3))
            .num(
                "foreign_seen",
                self.faults.iter().filter(|f| f.foreign_seen).count() as u64,
            )
            .num(
                "through_foreign",
                self.faults.iter().filter(|f| f.through_foreign).count() as u64,
            )
            .raw("failed", &failed.finish())
            .num("mismatches", self.io.mismatches)
            .num("hangs", self.io.hangs)
            .str("state", &self.final_state)
            .raw(
                "pass",
                if self.problems.is_empty() {
                    "true"
                } else {
                    "false"
                },
            )
            .raw("problems", &format!("[{}]", problems.join(",")))
            .raw("fault_log", &format!("[{}]", log.join(",")));
        o.finish()
    }
}

fn wire_quote(s: &str) -> String {
    nvmf_rdma::cli::wire_json::quote(s)
}

fn check_chaos_args(a: &ChaosArgs) -> Result<()> {
    if !(a.seconds > 0.0 && a.seconds <= 86_400.0) {
        bail!("--seconds must be more than 0 and at most 86400");
    }
    if a.every < Duration::from_millis(10) {
        bail!("--every must be at least 10ms");
    }
    if a.down_max > Duration::from_secs(600) {
        bail!("--down-max must be at most 600s");
    }
    if a.faults.is_empty() {
        bail!("--faults needs at least one fault");
    }
    if a.ext.traddr.is_some() && a.faults.contains(&FaultKind::TargetRestart) {
        bail!("--faults target-restart needs the built-in target (no --traddr)");
    }
    if !(16..=1024).contains(&a.queue_size) {
        bail!("--queue-size must be between 16 and 1024");
    }
    if a.nr_io_queues == 0 || a.nr_io_queues > 64 {
        bail!("--nr-io-queues must be between 1 and 64");
    }
    if a.size > 16 << 30 {
        bail!("--size at most 16G (the namespace and the workers' models are in RAM)");
    }
    if (a.size / 512) < a.workers as usize * 8 {
        bail!("--size too small: each worker needs at least 8 blocks of 512 B");
    }
    Ok(())
}

async fn run_chaos(a: ChaosArgs) -> Result<()> {
    use rand::{Rng, SeedableRng};
    check_chaos_args(&a)?;
    let r = a
        .policy
        .resolve(Duration::ZERO, Some(Duration::from_secs(60)));
    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let json = a.output == OutputFormat::Json;
    let fault_names: Vec<&str> = a.faults.iter().map(|f| f.name()).collect();
    let p = &r.policy;
    let header = format!(
        "nvmf-rdma chaos: {} workers on {}, {} I/O queues of {}\n\
         faults {} every {} (HCA down 0..={}), seed {seed}\n\
         policy: reconnect_delay {} s, ctrl_loss_tmo {}, fast_io_fail_tmo {}, replug_window {} s, \
         identity {}, keep-alive {} s, io_timeout {} s",
        a.workers,
        match (a.ext.traddr, &a.ext.nqn) {
            (None, _) => format!(
                "a {} RAM namespace over loopback",
                human_bytes(a.size as u64)
            ),
            (Some(t), n) => format!(
                "{} of namespace 1 of {} at {t}",
                human_bytes(a.size as u64),
                n.as_deref().unwrap_or(chaos::CHAOS_NQN)
            ),
        },
        a.nr_io_queues,
        a.queue_size,
        fault_names.join(","),
        human_dur(a.every),
        human_dur(a.down_max),
        p.reconnect_delay.as_secs(),
        tmo_text(p.ctrl_loss_tmo, "-1 (forever)"),
        tmo_text(p.fast_io_fail_tmo, "off"),
        p.replug_window.as_secs(),
        p.identity,
        p.keep_alive_tmo.as_secs(),
        r.io_timeout.as_secs()
    );
    if json {
        eprintln!("{header}");
    } else {
        println!("{header}");
    }

    if let DeviceChoice::Kernel(d) = &a.ext.device {
        bail!(
            "chaos injects faults into our own soft-HCA; on kernel RDMA device {d} fault it from \
             outside (rdma link delete/add) under fio's verify through the plugin (device={d})"
        );
    }
    let (mut target, mgr, c) = match a.ext.traddr {
        None => {
            let target = TargetRig::start(CHAOS_IP, a.size as u64)
                .await
                .context("cannot start the built-in target")?;
            let mgr = DeviceManager::new(true);
            let mut o = chaos::host_options(target.addr, a.nr_io_queues, a.queue_size, r.policy);
            o.io_timeout = r.io_timeout;
            let c = chaos::connect_host(&mgr, CHAOS_IP, o)
                .await
                .context("the host cannot connect to the built-in target")?;
            (Some(target), mgr, c)
        }
        Some(traddr) => {
            let addr = host_bind_addr(traddr, a.ext.host_traddr)
                .context("no route to the target address")?;
            let mgr = DeviceManager::new(!roce_peer(traddr.ip()));
            let mut cfg = device_config(chaos::HOST_DEV, addr, 1);
            cfg.identity = chaos::host_identity(0);
            mgr.plug(cfg)
                .await
                .with_context(|| format!("cannot start the host soft-HCA on {addr}"))?;
            let mut o = chaos::host_options(traddr, a.nr_io_queues, a.queue_size, r.policy);
            o.io_timeout = r.io_timeout;
            o.trsvcid = a.ext.trsvcid;
            if let Some(n) = &a.ext.nqn {
                o.subnqn = n.clone();
            }
            let c = Controller::connect_managed(mgr.clone(), chaos::HOST_DEV, o)
                .await
                .with_context(|| format!("the host cannot connect to {traddr}"))?;
            (None, mgr, c)
        }
    };
    let c = Arc::new(c);
    let ns = c.namespaces()[0];
    // Against an external target, only the first --size bytes of its namespace.
    let blocks = ns.blocks.min(a.size as u64 / ns.block_size as u64);
    let per = blocks / a.workers;
    if per == 0 {
        bail!("the namespace is too small for {} workers", a.workers);
    }
    let max_blocks = (a.max_io as u64 / ns.block_size as u64).clamp(1, per);
    // An I/O may wait as long as the policy lets the controller try, and then some.
    let hang_after = p.ctrl_loss_tmo.unwrap_or(Duration::from_secs(120)) + Duration::from_secs(10);
    let ours = chaos::host_identity(0);
    let other = chaos::host_identity(1);
    let other_is_ours = p.identity.accepts(
        &nvmf_rdma::reconnect::Identity {
            guid: ours.guid,
            pci: ours.pci,
        },
        &nvmf_rdma::reconnect::Identity {
            guid: other.guid,
            pci: other.pci,
        },
    );

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let t0 = Instant::now();
    let workers: Vec<_> = (0..a.workers)
        .map(|w| {
            tokio::spawn(chaos::verify_worker(
                c.clone(),
                Region {
                    first: w * per,
                    blocks: per,
                },
                seed ^ (w + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15),
                max_blocks,
                None,
                stop.clone(),
                hang_after,
            ))
        })
        .collect();

    let run_for = Duration::from_secs_f64(a.seconds);
    let mut faults = Vec::new();
    let mut next = t0 + a.every;
    loop {
        if next >= t0 + run_for {
            tokio::time::sleep_until((t0 + run_for).into()).await;
            break;
        }
        tokio::time::sleep_until(next.into()).await;
        if c.state() != CtrlState::Live {
            // Lost (or still recovering from the last fault past its bound): stop.
            break;
        }
        let kind = a.faults[rng.random_range(0..a.faults.len())];
        let down = Duration::from_micros(rng.random_range(0..=a.down_max.as_micros() as u64));
        let at = t0.elapsed();
        let mut f = inflict(
            kind,
            down,
            &mgr,
            &c,
            target.as_mut(),
            hang_after,
            other_is_ours,
        )
        .await;
        f.at = at;
        eprintln!("{}", f.describe());
        let bad = f.to_live.is_none();
        faults.push(f);
        if bad {
            break;
        }
        // On schedule, but never before the controller has been live for half an interval:
        // when recoveries take longer than --every the workers still get to run.
        next = (next + a.every).max(Instant::now() + a.every / 2);
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut io = WorkerReport::default();
    for w in workers {
        io.absorb(w.await.context("a worker panicked")?);
    }
    let lat: Vec<Duration> = io.lat_ns.iter().map(|&n| Duration::from_nanos(n)).collect();
    let elapsed = t0.elapsed();
    let st = c.status();
    let (final_state, final_health) = Health::from_status(&st);
    let mut failed_by_reason = std::collections::BTreeMap::new();
    for e in &io.errors {
        *failed_by_reason.entry(e.clone()).or_insert(0u64) += 1;
    }
    let allowed = allowed_failures(p);
    let unexpected_failures = io.errors.iter().filter(|e| !allowed.contains(e)).count() as u64;
    let mut s = ChaosSummary {
        seed,
        elapsed,
        lat: spread(lat),
        faults,
        recoveries: st.machine.recoveries,
        requeued: c.queue_stats().iter().map(|q| q.requeued).sum(),
        final_state,
        final_health,
        failed_by_reason,
        unexpected_failures,
        problems: Vec::new(),
        io,
    };
    if s.io.mismatches > 0 {
        s.problems.push(format!(
            "{} blocks read back differ from acknowledged writes",
            s.io.mismatches
        ));
    }
    if s.io.hangs > 0 {
        s.problems.push(format!(
            "{} I/Os hung (no answer within {} s)",
            s.io.hangs,
            hang_after.as_secs()
        ));
    }
    if s.unexpected_failures > 0 {
        s.problems.push(format!(
            "{} I/Os failed while within ctrl_loss_tmo",
            s.unexpected_failures
        ));
    }
    let inflict_errors = s.faults.iter().filter(|f| f.error.is_some()).count();
    if inflict_errors > 0 {
        s.problems
            .push(format!("{inflict_errors} faults could not be inflicted"));
    }
    let unrecovered = s.unrecovered() - inflict_errors;
    if unrecovered > 0 || st.state() != CtrlState::Live {
        s.problems.push(format!(
            "the controller did not recover ({}{})",
            s.final_state,
            st.machine
                .fail_reason
                .map_or(String::new(), |r| format!(": {}", r.name()))
        ));
    }
    let used = s.faults.iter().filter(|f| f.through_foreign).count();
    if used > 0 && !other_is_ours {
        s.problems.push(format!(
            "the controller reconnected through a foreign card {used} times"
        ));
    }
    if json {
        println!("{}", s.to_json(&a, &r));
    } else {
        s.print(&a);
    }
    if let Ok(c) = Arc::try_unwrap(c) {
        // Best effort; a controller already dead returns at once.
        let _ = tokio::time::timeout(Duration::from_secs(5), c.disconnect()).await;
    }
    drop(target);
    if !s.problems.is_empty() {
        bail!("chaos: {}", s.problems.join("; "));
    }
    Ok(())
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

/// How long `disconnect` waits for a controller's `connect` to finish.
const DISCONNECT_WAIT: Duration = Duration::from_secs(10);

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
            // Done when its `connect` has let the controller go and removed its socket.
            let deadline = Instant::now() + DISCONNECT_WAIT;
            while p.exists() {
                if Instant::now() > deadline {
                    bail!(
                        "{} was asked to disconnect but is still there after {} s; \
                         its `connect` process may be stuck: stop it with a signal",
                        json_field(&j, "name").unwrap_or("the controller"),
                        DISCONNECT_WAIT.as_secs()
                    );
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
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
    fn system_host_ids_as_nvme_cli_keeps_them() {
        let dir = std::env::temp_dir().join(format!("nvmf-hostids-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fresh = || ConnectOptions::new("127.0.0.1:4791".parse().unwrap(), "nqn.x:y");
        // Nothing there: our defaults stand.
        let mut o = fresh();
        apply_system_host_ids(&mut o, &dir);
        assert_eq!(o.hostnqn, fresh().hostnqn);
        // A host ID alone names the NQN too.
        std::fs::write(dir.join("hostid"), "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0\n").unwrap();
        let mut o = fresh();
        apply_system_host_ids(&mut o, &dir);
        assert_eq!(o.hostid[..4], [0x0f, 0x1e, 0x2d, 0x3c]);
        assert_eq!(
            o.hostnqn,
            "nqn.2014-08.org.nvmexpress:uuid:0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
        );
        // The host NQN file wins for the NQN; a bad one is ignored.
        std::fs::write(dir.join("hostnqn"), "nqn.2014-08.org.nvmexpress:uuid:sys\n").unwrap();
        let mut o = fresh();
        apply_system_host_ids(&mut o, &dir);
        assert_eq!(o.hostnqn, "nqn.2014-08.org.nvmexpress:uuid:sys");
        std::fs::write(dir.join("hostnqn"), "not an nqn").unwrap();
        std::fs::write(dir.join("hostid"), "zz").unwrap();
        let mut o = fresh();
        apply_system_host_ids(&mut o, &dir);
        assert_eq!(
            (o.hostnqn.clone(), o.hostid),
            (fresh().hostnqn, fresh().hostid)
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

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
    fn busy_poll_default_is_the_tools_default_and_flags_parse() {
        let c = Cli::try_parse_from(["nvmf-rdma", "list"]).unwrap();
        assert_eq!(c.busy_poll, nvmf_rdma::driver::TOOL_BUSY_POLL);
        let c = Cli::try_parse_from(["nvmf-rdma", "list", "--busy-poll", "0"]).unwrap();
        assert_eq!(c.busy_poll, Duration::ZERO);
        assert!(Cli::try_parse_from(["nvmf-rdma", "list", "--busy-poll", "fast"]).is_err());
        let c = Cli::try_parse_from(["nvmf-rdma", "bench", "--job", "randread-4k-qd1"]).unwrap();
        match c.cmd {
            Cmd::Bench { jobs, .. } => assert_eq!(jobs, ["randread-4k-qd1"]),
            _ => panic!("not bench"),
        }
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
        // Junk at the target's port is dropped and counted by reason.
        let junk = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        for _ in 0..3 {
            junk.send_to(b"not a RoCEv2 packet", t.addr).unwrap();
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        let malformed = loop {
            let body = scrape(addr);
            let n: u64 = body
                .lines()
                .filter(|l| {
                    l.starts_with("softhca_rx_dropped_by_reason_total")
                        && l.contains("reason=\"malformed\"")
                })
                .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
                .sum();
            if n >= 3 || Instant::now() > deadline {
                break n;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(malformed >= 3, "malformed drops counted: {malformed}");
        // Other commands refuse the flag.
        let cli = Cli::try_parse_from(["nvmf-rdma", "list", "--metrics-addr", "127.0.0.1:1"]);
        assert!(cli.unwrap().setup().is_err());
    }

    fn chaos_args(extra: &[&str]) -> Result<ChaosArgs, clap::Error> {
        let mut v = vec!["nvmf-rdma", "chaos"];
        v.extend_from_slice(extra);
        match Cli::try_parse_from(v)?.cmd {
            Cmd::Chaos(a) => Ok(a),
            _ => panic!("not chaos"),
        }
    }

    #[test]
    fn chaos_flags_and_defaults() {
        let a = chaos_args(&[]).unwrap();
        assert_eq!(
            (a.size, a.workers, a.seconds, a.every, a.down_max, a.seed),
            (
                256 << 20,
                8,
                20.0,
                Duration::from_secs(2),
                Duration::from_millis(200),
                None
            )
        );
        assert_eq!(
            a.faults,
            [
                FaultKind::Reset,
                FaultKind::Replug,
                FaultKind::TargetRestart
            ]
        );
        assert_eq!(a.output, OutputFormat::Normal);
        // Chaos defaults: reconnect at once, give up after a minute.
        let r = a
            .policy
            .resolve(Duration::ZERO, Some(Duration::from_secs(60)));
        assert_eq!(r.policy.reconnect_delay, Duration::ZERO);
        assert_eq!(r.policy.ctrl_loss_tmo, Some(Duration::from_secs(60)));
        assert!(check_chaos_args(&a).is_ok());
        let a = chaos_args(&[
            "--faults",
            "replug-other,user-reset",
            "--every",
            "500ms",
            "--seed",
            "9",
            "-l",
            "-1",
            "--identity",
            "any",
            "-o",
            "json",
        ])
        .unwrap();
        assert_eq!(a.faults, [FaultKind::ReplugOther, FaultKind::UserReset]);
        assert_eq!((a.every, a.seed), (Duration::from_millis(500), Some(9)));
        assert_eq!(a.output, OutputFormat::Json);
        assert_eq!(a.policy.ctrl_loss_tmo, Some(Tmo(None)));
        for bad in [
            &["--faults", "meteor"][..],
            &["--every", "soon"][..],
            &["--workers", "0"][..],
            &["-o", "xml"][..],
        ] {
            assert!(chaos_args(bad).is_err(), "{bad:?}");
        }
        let a = chaos_args(&["--every", "1ms"]).unwrap();
        assert!(check_chaos_args(&a).is_err());
        let a = chaos_args(&["--size", "4K", "--workers", "8"]).unwrap();
        assert!(check_chaos_args(&a).is_err());
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

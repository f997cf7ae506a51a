//! Command-line argument types shared by the subcommands.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
pub(crate) use nvmf_rdma::cli::args::*;
use nvmf_rdma::cli::device::DeviceChoice;
use nvmf_rdma::cli::support::{parse_pos_secs, parse_traddr};
pub(crate) use nvmf_rdma::cli::units::parse_size;
use nvmf_rdma::harness::nvmf_perf::DEMO_NQN;

#[derive(Args, Debug, Clone)]
pub(crate) struct TargetArgs {
    /// Address of the target's soft-HCA (IP or IP:PORT; RoCEv2 port 4791 by default); with
    /// a kernel --device, the IP of that device's network interface rdma_cm listens on.
    /// Repeat for more ports (soft-HCA only): each address is a soft-HCA of its own serving
    /// the same subsystem, port IDs 1, 2, ... in the order given.
    #[arg(long, default_value = "127.0.0.1", value_parser = parse_traddr)]
    pub(crate) listen: Vec<SocketAddr>,
    /// RDMA device the target runs on: soft (the built-in soft-HCA), or a kernel RDMA device
    /// (rxe0, guid:<GUID>, pci:<address>; needs a build with `--features hw`).
    #[arg(long, default_value = "soft")]
    pub(crate) device: DeviceChoice,
    /// NVMe-oF service port.
    #[arg(short = 's', long = "trsvcid", default_value_t = 4420)]
    pub(crate) trsvcid: u16,
    /// Subsystem NQN.
    #[arg(short = 'n', long = "nqn", default_value = DEMO_NQN)]
    pub(crate) nqn: String,
    #[command(flatten)]
    pub(crate) ns: NsArgs,
    /// Host NQNs allowed to connect (repeat); any host when none is given.
    #[arg(long = "allow-host")]
    pub(crate) allow_host: Vec<String>,
    /// Serve a control socket here (0600) for `nvmf-rdma target-ns add` while running.
    #[arg(long, value_name = "SOCKET")]
    pub(crate) control: Option<PathBuf>,
    /// Threads serving the soft-HCA and the hosts' queues. One (the default, like SPDK's
    /// one-core reactor mask) keeps every hand-off between the device and the queues on one
    /// thread, which costs the least CPU per I/O and answers QD1 I/O fastest; more spread
    /// many hosts' queues over cores.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub(crate) threads: u16,
    /// Largest keep-alive timeout a host may ask for, in seconds; a host that asks for none
    /// gets this one, so a controller whose host left goes within it (discovery controllers:
    /// at most 120 s whatever this says).
    #[arg(long = "max-kato", value_name = "SECS", default_value_t = 120,
          value_parser = clap::value_parser!(u32).range(1..=3600))]
    pub(crate) max_kato: u32,
    /// Command Quiesce Time the target reports (Identify CQT), in ms: a controller whose
    /// host is gone has its commands run or dropped within it (hosts add it to their wait
    /// before resending writes).
    #[arg(long = "cqt", value_name = "MS", default_value_t = nvmf_rdma::nvmet::DEFAULT_CQT_MS,
          value_parser = clap::value_parser!(u16).range(1..))]
    pub(crate) cqt: u16,
    /// Do not offer Cross-Controller Reset (CCRL 0, the command refused as Linux nvmet
    /// does), to test how hosts fall back to the time rule.
    #[arg(long = "no-ccr")]
    pub(crate) no_ccr: bool,
    /// Fault mode for testing hosts: writes the backend still holds when their controller
    /// dies (waiting for a file namespace's worker) run MS later instead of being dropped,
    /// as a slow backend's would, unless a Cross-Controller Reset or CQT stops them first.
    #[arg(long = "fault-late-writes", value_name = "MS")]
    pub(crate) fault_late_writes: Option<u32>,
    /// ANA Transition Time the target reports (Identify ANATT), in seconds: how long a host
    /// waits on a path whose ANA group is changing.
    #[arg(long = "anatt", value_name = "SECS", default_value_t = nvmf_rdma::nvmet::ana::DEFAULT_ANATT_S,
          value_parser = clap::value_parser!(u8).range(1..))]
    pub(crate) anatt: u8,
}

/// `target-ana set`: an ANA group's state through a port of a running `target --control`.
#[derive(Args, Debug, Clone)]
pub(crate) struct TargetAnaSet {
    /// The target's control socket (its --control).
    #[arg(long, value_name = "SOCKET")]
    pub(crate) control: PathBuf,
    /// Port ID (1 for the first --listen, 2 for the second, ...).
    #[arg(long)]
    pub(crate) port: u16,
    /// ANA group ID (1 unless the namespace was put in another).
    #[arg(long, default_value_t = 1)]
    pub(crate) group: u32,
    /// optimized, non-optimized, inaccessible, persistent-loss or change.
    pub(crate) state: String,
}

/// A namespace of the built-in target: `target`'s first, `target-ns add`'s.
#[derive(Args, Debug, Clone)]
pub(crate) struct NsArgs {
    /// RAM namespace size (e.g. 1G); default when no --file is given.
    #[arg(long, value_parser = parse_size)]
    pub(crate) ram: Option<usize>,
    /// File-backed namespace. Its identity (NGUID, UUID), which hosts tell it from other
    /// disks by, is kept beside it in FILE.nvmf-id (made on first use): keep the two together;
    /// without it the file is served as a new disk.
    #[arg(long)]
    pub(crate) file: Option<PathBuf>,
    /// Create or grow the file to this size.
    #[arg(long, value_parser = parse_size)]
    pub(crate) file_size: Option<usize>,
    /// Logical block size: 512 or 4096.
    #[arg(long, default_value_t = 512)]
    pub(crate) block_size: u32,
    /// ANA group of the namespace (1..=128): its access state through each port is that
    /// group's there (`target-ana set`).
    #[arg(long = "ana-group", value_name = "G", default_value_t = 1)]
    pub(crate) ana_group: u32,
}

impl NsArgs {
    /// The namespace these flags describe, as namespace `nsid`.
    pub(crate) fn namespace(&self, nsid: u32) -> Result<nvmf_rdma::nvmet::Namespace> {
        nvmf_rdma::nvmet::control::namespace_of(
            nsid,
            self.ram.map(|r| r as u64),
            self.file.as_deref(),
            self.file_size.map(|s| s as u64),
            self.block_size,
            0,
        )?
        .in_ana_group(self.ana_group)
        .map_err(anyhow::Error::msg)
    }
}

/// `target-ns add`: a namespace for a running `target --control SOCKET`.
#[derive(Args, Debug, Clone)]
pub(crate) struct TargetNsAdd {
    /// The target's control socket (its --control).
    #[arg(long, value_name = "SOCKET")]
    pub(crate) control: PathBuf,
    /// Subsystem NQN (the target's -n).
    #[arg(short = 'n', long = "nqn", default_value = DEMO_NQN)]
    pub(crate) nqn: String,
    /// Namespace ID (not yet used in the subsystem).
    #[arg(long)]
    pub(crate) nsid: u32,
    #[command(flatten)]
    pub(crate) ns: NsArgs,
}

/// `connect-all`: a discovery controller's address, or nothing (the config file).
#[derive(Args, Debug, Clone)]
pub(crate) struct ConnectAllArgs {
    /// Transport type; only rdma.
    #[arg(short = 't', long = "transport", default_value = "rdma")]
    pub(crate) transport: String,
    /// Discovery controller address (IP or IP:PORT); without it, the config file's lines.
    #[arg(short = 'a', long = "traddr", value_parser = parse_traddr)]
    pub(crate) traddr: Option<SocketAddr>,
    /// NVMe-oF service port of the discovery controller.
    #[arg(
        short = 's',
        long = "trsvcid",
        default_value_t = 4420,
        requires = "traddr"
    )]
    pub(crate) trsvcid: u16,
    #[arg(short = 'q', long = "hostnqn", requires = "traddr")]
    pub(crate) hostnqn: Option<String>,
    #[arg(short = 'I', long = "hostid", value_parser = parse_hostid, requires = "traddr")]
    pub(crate) hostid: Option<String>,
    #[arg(short = 'w', long = "host-traddr", value_parser = parse_traddr, requires = "traddr")]
    pub(crate) host_traddr: Option<SocketAddr>,
    /// RDMA device the host runs on, as connect's --device.
    #[arg(long, default_value = "soft", requires = "traddr")]
    pub(crate) device: DeviceChoice,
    /// I/O queues per controller (default: one per core).
    #[arg(short = 'i', long = "nr-io-queues", default_value_t = cores())]
    pub(crate) nr_io_queues: usize,
    /// Entries per I/O queue (16..=1024).
    #[arg(short = 'Q', long = "queue-size", default_value_t = 128)]
    pub(crate) queue_size: usize,
    #[command(flatten)]
    pub(crate) policy: PolicyArgs,
    #[command(flatten)]
    pub(crate) format: Format,
}

impl ConnectAllArgs {
    /// The discovery controller as connect arguments (with the discovery NQN), if -a given.
    pub(crate) fn into_subsys(self) -> Result<Option<(Subsys, ConnectMode)>> {
        let Some(traddr) = self.traddr else {
            return Ok(None);
        };
        let s = Subsys {
            fabric: Fabric {
                transport: self.transport,
                traddr,
                trsvcid: self.trsvcid,
                hostnqn: self.hostnqn,
                hostid: self.hostid,
                host_traddr: self.host_traddr,
                device: self.device,
            },
            nqn: nvmf_rdma::nvme::fabrics::DISCOVERY_NQN.into(),
            nr_io_queues: self.nr_io_queues,
            queue_size: self.queue_size,
            iopolicy: None,
            policy: self.policy,
            safe_retry: Default::default(),
            cqt_default: nvmf_rdma::reconnect::hold::DEFAULT_CQT.as_millis() as u64,
            nsid: 1,
        };
        nvmf_rdma::cli::host::options(&s)?;
        Ok(Some((s, ConnectMode::default())))
    }
}

/// `daemon`.
#[derive(Args, Debug, Clone, Default)]
pub(crate) struct DaemonArgs {
    /// Start in the background and return once it serves its socket (and `--connect-all`
    /// is done); the log goes to RUN_DIR/daemon.log.
    #[arg(long)]
    pub(crate) background: bool,
    /// At start, connect what the config file lists (CONFIG_DIR/discovery.conf).
    #[arg(long)]
    pub(crate) connect_all: bool,
    /// Stop the running daemon (refused while an export is in use, unless --force) and wait
    /// until it is gone.
    #[arg(long, conflicts_with_all = ["background", "connect_all"])]
    pub(crate) stop: bool,
    /// With --stop: stop even if exports are in use (their users get I/O errors).
    #[arg(long, requires = "stop")]
    pub(crate) force: bool,
    /// Where the config file is [default: $NVMF_RDMA_CONFIG_DIR, else /etc/nvmf-rdma].
    #[arg(long, value_name = "DIR")]
    pub(crate) config_dir: Option<PathBuf>,
    /// Seconds a control-socket client has to send each request line [default: 30].
    #[arg(long, value_name = "SECS", value_parser = parse_pos_secs, hide = true)]
    pub(crate) client_timeout: Option<u64>,
}

/// Where `read`, `write` and `verify` do their I/O: on a controller the daemon holds (`-d`,
/// the name `connect` printed, as nvme-cli names a device), or on one of their own made
/// with the fabrics flags (`-a`, `-n`, ...) and dropped at the end.
#[derive(Debug, Clone)]
pub(crate) struct IoAt {
    /// The daemon's controller (`-d nvmf0`).
    pub(crate) controller: Option<String>,
    /// The fabrics flags, when no `-d` is given.
    pub(crate) sub: Option<Subsys>,
    /// `--nsid` (with `-d` too).
    pub(crate) nsid: u32,
}

const CONTROLLER_ARG: &str = "controller";

impl clap::FromArgMatches for IoAt {
    fn from_arg_matches(m: &clap::ArgMatches) -> Result<Self, clap::Error> {
        let controller = m.get_one::<String>(CONTROLLER_ARG).cloned();
        let nsid = m.get_one::<u32>("nsid").copied().unwrap_or(1);
        // Without -d, -a and -n are required (clap checked it): the flags make a Subsys.
        let sub = if controller.is_none() {
            Some(Subsys::from_arg_matches(m)?)
        } else {
            None
        };
        Ok(IoAt {
            controller,
            sub,
            nsid,
        })
    }

    fn update_from_arg_matches(&mut self, m: &clap::ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(m)?;
        Ok(())
    }
}

impl clap::Args for IoAt {
    fn augment_args(cmd: clap::Command) -> clap::Command {
        let cmd = Subsys::augment_args(cmd)
            .mut_arg("traddr", |a| a.required(false).requires("nqn"))
            .mut_arg("nqn", |a| a.required(false).requires("traddr"));
        cmd.arg(
            clap::Arg::new(CONTROLLER_ARG)
                .short('d')
                .long(CONTROLLER_ARG)
                .value_name("NAME")
                .help(
                    "A controller the daemon holds, by the name `connect` printed (nvmf0); \
                     without it, -a and -n connect a controller of this command's own",
                )
                .conflicts_with_all(["traddr", "nqn"])
                .required_unless_present_all(["traddr", "nqn"]),
        )
    }

    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        Self::augment_args(cmd)
    }
}

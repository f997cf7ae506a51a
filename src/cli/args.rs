//! The arguments of `connect` as every front end takes them: nvme-cli's fabrics flags, the
//! reconnect policy and the exports. The daemon parses its `connect` requests and the lines
//! of `discovery.conf` with the same definitions, so defaults and messages are the CLI's.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, ValueEnum};

use crate::cli::device::DeviceChoice;
use crate::cli::support::{parse_pos_secs, parse_secs, parse_tmo, parse_traddr, Tmo};
use crate::export::ExportAddr;
use crate::reconnect::hold::{self, SafeRetry};
use crate::reconnect::policy;
use crate::reconnect::{IdentityMatch, Policy};

/// Where the target is (nvme-cli's fabrics arguments).
#[derive(Args, Debug, Clone)]
pub struct Fabric {
    /// Transport type; only rdma.
    #[arg(short = 't', long = "transport", default_value = "rdma")]
    pub transport: String,
    /// Target address: IP (RoCEv2 UDP port 4791) or IP:PORT for a soft-HCA bound elsewhere.
    #[arg(short = 'a', long = "traddr", value_parser = parse_traddr)]
    pub traddr: SocketAddr,
    /// NVMe-oF service port.
    #[arg(short = 's', long = "trsvcid", default_value_t = 4420)]
    pub trsvcid: u16,
    /// Host NQN (default: /etc/nvme/hostnqn, else from the host ID).
    #[arg(short = 'q', long = "hostnqn")]
    pub hostnqn: Option<String>,
    /// Host ID, a UUID (default: /etc/nvme/hostid, else from /etc/machine-id).
    #[arg(short = 'I', long = "hostid", value_parser = parse_hostid)]
    pub hostid: Option<String>,
    /// Address of the host's soft-HCA (IP, port 4791, or IP:PORT). Default: the local
    /// address that routes to the target, on port 4791 unless the target is on loopback.
    #[arg(short = 'w', long = "host-traddr", value_parser = parse_traddr)]
    pub host_traddr: Option<SocketAddr>,
    /// RDMA device the host runs on: soft (the built-in soft-HCA), or a kernel RDMA device
    /// (a build with `--features hw`) by name (rxe0, mlx5_0), guid:<GUID> or pci:<address>.
    #[arg(long, default_value = "soft")]
    pub device: DeviceChoice,
}

#[derive(Args, Debug, Clone)]
pub struct Subsys {
    #[command(flatten)]
    pub fabric: Fabric,
    /// Subsystem NQN.
    #[arg(short = 'n', long = "nqn")]
    pub nqn: String,
    #[command(flatten)]
    pub queues: Queues,
    #[command(flatten)]
    pub policy: PolicyArgs,
    /// When a write (or another command that changes state) that was in flight on a dead
    /// connection is sent again: ccr (after a Cross-Controller Reset where the target offers
    /// it, else as cqt), cqt (KATO x 2, or 3 with traffic-based keep alive, + CQT after the
    /// last contact), off (at once, as Linux and SPDK do: a stale write may land late)
    #[arg(long = "safe-retry", value_name = "MODE", default_value = "ccr")]
    pub safe_retry: SafeRetry,
    /// Command Quiesce Time in ms assumed for a target that reports none
    #[arg(long = "cqt-default", value_name = "MS",
        default_value_t = hold::DEFAULT_CQT.as_millis() as u64)]
    pub cqt_default: u64,
    /// Namespace to use for read/write/verify.
    #[arg(long, default_value_t = 1)]
    pub nsid: u32,
    /// How the subsystem's I/O is spread over its paths: failover, round-robin or
    /// queue-depth (Linux's `iopolicy`); given when adding a path, it changes the whole
    /// subsystem's [default: failover]
    #[arg(long = "iopolicy", value_name = "POLICY")]
    pub iopolicy: Option<crate::multipath::IoPolicy>,
}

/// A target of someone else's for `bench` and `chaos`, instead of the built-in one.
#[derive(Args, Debug, Clone)]
pub struct ExternalTarget {
    /// Run against this target instead of a built-in one (IP, RoCEv2 port 4791, or
    /// IP:PORT): Linux nvmet-rdma, SPDK, another `nvmf-rdma target`.
    #[arg(short = 'a', long = "traddr", value_parser = parse_traddr)]
    pub traddr: Option<SocketAddr>,
    /// NVMe-oF service port of --traddr.
    #[arg(short = 's', long = "trsvcid", default_value_t = 4420)]
    pub trsvcid: u16,
    /// Subsystem NQN at --traddr.
    #[arg(short = 'n', long = "nqn", requires = "traddr")]
    pub nqn: Option<String>,
    /// Address of the host's soft-HCA towards --traddr (as connect's --host-traddr).
    #[arg(short = 'w', long = "host-traddr", value_parser = parse_traddr, requires = "traddr")]
    pub host_traddr: Option<SocketAddr>,
    /// RDMA device towards --traddr, as connect's --device.
    #[arg(long, default_value = "soft", requires = "traddr")]
    pub device: DeviceChoice,
}

/// A controller's I/O queues (`connect`, `connect-all`).
#[derive(Args, Debug, Clone, Copy)]
pub struct Queues {
    /// I/O queues per controller (default: one per core).
    #[arg(short = 'i', long = "nr-io-queues", default_value_t = cores())]
    pub nr_io_queues: usize,
    /// Entries per I/O queue (16..=1024).
    #[arg(short = 'Q', long = "queue-size", default_value_t = 128)]
    pub queue_size: usize,
}

/// Keep-alive and the reconnect policy, with nvme-cli's names where it has them. Shared by
/// every command that connects; `chaos` has its own defaults for `-c` and `-l`.
#[derive(Args, Debug, Clone, Default)]
pub struct PolicyArgs {
    /// Keep-alive timeout in seconds, 0 = off [default: 5]
    #[arg(short = 'k', long = "keep-alive-tmo",
        value_name = "SECS",
        allow_hyphen_values = true,
        value_parser = parse_secs
    )]
    pub keep_alive_tmo: Option<u64>,
    /// Seconds between reconnect attempts; 0 = at once [default: 10; chaos: 0]
    #[arg(short = 'c', long = "reconnect-delay",
        value_name = "SECS",
        allow_hyphen_values = true,
        value_parser = parse_secs
    )]
    pub reconnect_delay: Option<u64>,
    /// Seconds to keep reconnecting before the controller is deleted and its I/O fails;
    /// -1 = forever [default: 600; chaos: 60]
    #[arg(
        short = 'l',
        long = "ctrl-loss-tmo",
        value_name = "SECS",
        allow_hyphen_values = true,
        value_parser = parse_tmo
    )]
    pub ctrl_loss_tmo: Option<Tmo>,
    /// Seconds of reconnecting after which held and new I/O fails (the controller keeps
    /// trying); -1 = off [default: -1]
    #[arg(
        short = 'F',
        long = "fast_io_fail_tmo",
        alias = "fast-io-fail-tmo",
        value_name = "SECS",
        allow_hyphen_values = true,
        value_parser = parse_tmo
    )]
    pub fast_io_fail_tmo: Option<Tmo>,
    /// Seconds a hot-removed HCA may take to come back before the controller gives up
    /// [default: 600]
    #[arg(long = "replug-window",
        value_name = "SECS",
        allow_hyphen_values = true,
        value_parser = parse_secs
    )]
    pub replug_window: Option<u64>,
    /// Which HCA that comes back counts as ours: same node GUID, same PCI address, both, or
    /// any card in the slot [default: both]
    #[arg(long, value_enum, value_name = "MATCH")]
    pub identity: Option<IdentityArg>,
    /// Seconds without a response after which a command starts recovery [default: 30]
    #[arg(
        long = "io-timeout",
        value_name = "SECS",
        allow_hyphen_values = true,
        value_parser = parse_pos_secs
    )]
    pub io_timeout: Option<u64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum IdentityArg {
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
pub struct Resolved {
    pub policy: Policy,
    pub io_timeout: Duration,
}

impl PolicyArgs {
    /// The policy with `reconnect_delay` and `ctrl_loss_tmo` defaulting to the values given
    /// (connect: 10 s and 600 s, as Linux; chaos: 0 and 60 s).
    pub fn resolve(&self, reconnect_delay: Duration, ctrl_loss_tmo: Option<Duration>) -> Resolved {
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
    pub fn resolve_default(&self) -> Resolved {
        self.resolve(
            policy::DEFAULT_RECONNECT_DELAY,
            Some(policy::DEFAULT_CTRL_LOSS_TMO),
        )
    }
}

/// Block-device exports of the namespace `--nsid` while `connect` holds the controller.
#[derive(Args, Debug, Clone, Default)]
pub struct ExportArgs {
    /// Serve the namespace over NBD at unix:PATH or IP:PORT (e.g. 127.0.0.1:10809).
    #[arg(long, value_name = "ADDR")]
    pub nbd: Option<ExportAddr>,
    /// Allow --nbd on an address other than loopback. NBD has no authentication: whoever
    /// reaches the port can read and write the namespace.
    #[arg(long)]
    pub nbd_allow_remote: bool,
    /// Expose the namespace as the file MOUNTPOINT/ns<NSID> in a FUSE mount (for losetup).
    #[arg(long, value_name = "MOUNTPOINT")]
    pub fuse: Option<PathBuf>,
}
/// A host ID as nvme-cli writes it: a UUID.
pub fn parse_hostid(s: &str) -> Result<String, String> {
    parse_uuid(s)
        .map(|_| s.to_string())
        .ok_or_else(|| format!("'{s}' is not a UUID (xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)"))
}

/// `-o`: nvme-cli's output formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, ValueEnum)]
pub enum ListFormat {
    #[default]
    Normal,
    Json,
}

/// `connect` besides the subsystem and its exports.
#[derive(Args, Debug, Clone, Default)]
pub struct ConnectMode {
    /// Connect even if a controller to the same subsystem, address and host NQN exists.
    #[arg(short = 'D', long = "duplicate-connect")]
    pub duplicate_connect: bool,
    /// Hold the controller in this process until a stop signal or `disconnect`, without the
    /// daemon (the controller and its exports end with the process).
    #[arg(long)]
    pub foreground: bool,
    #[command(flatten)]
    pub format: Format,
}

/// `-o`, for the commands whose output has no more to say about it.
#[derive(Args, Debug, Clone, Copy, Default)]
pub struct Format {
    /// Output format of the result: normal or json.
    #[arg(
        short = 'o',
        long = "output-format",
        value_enum,
        default_value = "normal"
    )]
    pub output: ListFormat,
}

/// `connect-all`: a discovery controller's address, or nothing (the config file).
#[derive(Args, Debug, Clone)]
pub struct ConnectAllArgs {
    /// Transport type; only rdma.
    #[arg(short = 't', long = "transport", default_value = "rdma")]
    pub transport: String,
    /// Discovery controller address (IP or IP:PORT); without it, the config file's lines.
    #[arg(short = 'a', long = "traddr", value_parser = parse_traddr)]
    pub traddr: Option<SocketAddr>,
    /// NVMe-oF service port of the discovery controller.
    #[arg(
        short = 's',
        long = "trsvcid",
        default_value_t = 4420,
        requires = "traddr"
    )]
    pub trsvcid: u16,
    #[arg(short = 'q', long = "hostnqn", requires = "traddr")]
    pub hostnqn: Option<String>,
    #[arg(short = 'I', long = "hostid", value_parser = parse_hostid, requires = "traddr")]
    pub hostid: Option<String>,
    #[arg(short = 'w', long = "host-traddr", value_parser = parse_traddr, requires = "traddr")]
    pub host_traddr: Option<SocketAddr>,
    /// RDMA device the host runs on, as connect's --device.
    #[arg(long, default_value = "soft", requires = "traddr")]
    pub device: DeviceChoice,
    #[command(flatten)]
    pub queues: Queues,
    #[command(flatten)]
    pub policy: PolicyArgs,
    #[command(flatten)]
    pub format: Format,
}

impl ConnectAllArgs {
    /// The discovery controller as connect arguments (with the discovery NQN), if -a given;
    /// unchecked (`cli::host::options` checks them).
    pub fn into_subsys(self) -> Option<(Subsys, ConnectMode)> {
        let traddr = self.traddr?;
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
            nqn: crate::nvme::fabrics::DISCOVERY_NQN.into(),
            queues: self.queues,
            iopolicy: None,
            policy: self.policy,
            safe_retry: Default::default(),
            cqt_default: hold::DEFAULT_CQT.as_millis() as u64,
            nsid: 1,
        };
        Some((s, ConnectMode::default()))
    }
}

pub fn cores() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// `connect`'s flags alone, as the daemon reads a request or a config line.
#[derive(Parser, Debug)]
#[command(name = "connect", no_binary_name = true)]
struct ConnectFlags {
    #[command(flatten)]
    sub: Subsys,
    #[command(flatten)]
    export: ExportArgs,
    #[command(flatten)]
    mode: ConnectMode,
}

/// Parse `connect`'s flags (without the command name). The error is clap's first line.
pub fn parse_connect(args: &[String]) -> Result<(Subsys, ExportArgs, ConnectMode), String> {
    ConnectFlags::try_parse_from(args)
        .map(|f| (f.sub, f.export, f.mode))
        .map_err(|e| clap_line(&e))
}

/// clap's message without its usage block and `error:` prefix.
pub fn clap_line(e: &clap::Error) -> String {
    let t = e.to_string();
    let first = t
        .lines()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("bad arguments");
    first.trim_start_matches("error: ").trim().to_string()
}

/// `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` as 16 bytes.
pub fn parse_uuid(t: &str) -> Option<[u8; 16]> {
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

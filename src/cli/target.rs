//! The built-in target as the command line starts it: `target`'s flags and the
//! configuration they ask for, the namespace flags `target` and `target-ns add` share, and a
//! target on one soft-HCA per listen address.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;

use crate::cli::device::DeviceChoice;
use crate::cli::host::device_config;
use crate::cli::support::parse_traddr;
use crate::cli::units::parse_size;
use crate::driver::{CmService, SoftHca};
use crate::harness::nvmf_perf::DEMO_NQN;
use crate::nvme::Nqn;
use crate::nvmet::control::AddNamespace;
use crate::nvmet::{serve_cm, serve_cm_on, Subsystem, Target, TargetConfig};

#[derive(Args, Debug, Clone)]
pub struct TargetArgs {
    /// Address of the target's soft-HCA (IP or IP:PORT; RoCEv2 port 4791 by default); with
    /// a kernel --device, the IP of that device's network interface rdma_cm listens on.
    /// Repeat for more ports (soft-HCA only): each address is a soft-HCA of its own serving
    /// the same subsystem, port IDs 1, 2, ... in the order given.
    #[arg(long, default_value = "127.0.0.1", value_parser = parse_traddr)]
    pub listen: Vec<SocketAddr>,
    /// RDMA device the target runs on: soft (the built-in soft-HCA), or a kernel RDMA device
    /// (rxe0, guid:<GUID>, pci:<address>; needs a build with `--features hw`).
    #[arg(long, default_value = "soft")]
    pub device: DeviceChoice,
    /// NVMe-oF service port.
    #[arg(short = 's', long = "trsvcid", default_value_t = 4420)]
    pub trsvcid: u16,
    /// Subsystem NQN.
    #[arg(short = 'n', long = "nqn", default_value = DEMO_NQN)]
    pub nqn: String,
    #[command(flatten)]
    pub ns: NsArgs,
    /// Host NQNs allowed to connect (repeat); any host when none is given.
    #[arg(long = "allow-host")]
    pub allow_host: Vec<String>,
    /// Serve a control socket here (0600) for `nvmf-rdma target-ns add` while running.
    #[arg(long, value_name = "SOCKET")]
    pub control: Option<PathBuf>,
    /// Threads serving the soft-HCA and the hosts' queues. One (the default, like SPDK's
    /// one-core reactor mask) keeps every hand-off between the device and the queues on one
    /// thread, which costs the least CPU per I/O and answers QD1 I/O fastest; more spread
    /// many hosts' queues over cores.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub threads: u16,
    /// Largest keep-alive timeout a host may ask for, in seconds; a host that asks for none
    /// gets this one, so a controller whose host left goes within it (discovery controllers:
    /// at most 120 s whatever this says).
    #[arg(long = "max-kato", value_name = "SECS", default_value_t = 120,
          value_parser = clap::value_parser!(u32).range(1..=3600))]
    pub max_kato: u32,
    /// Command Quiesce Time the target reports (Identify CQT), in ms: a controller whose
    /// host is gone has its commands run or dropped within it (hosts add it to their wait
    /// before resending writes).
    #[arg(long = "cqt", value_name = "MS", default_value_t = crate::nvmet::DEFAULT_CQT_MS,
          value_parser = clap::value_parser!(u16).range(1..))]
    pub cqt: u16,
    /// Do not offer Cross-Controller Reset (CCRL 0, the command refused as Linux nvmet
    /// does), to test how hosts fall back to the time rule.
    #[arg(long = "no-ccr")]
    pub no_ccr: bool,
    /// Fault mode for testing hosts: writes the backend still holds when their controller
    /// dies (waiting for a file namespace's worker) run MS later instead of being dropped,
    /// as a slow backend's would, unless a Cross-Controller Reset or CQT stops them first.
    #[arg(long = "fault-late-writes", value_name = "MS")]
    pub fault_late_writes: Option<u32>,
    /// ANA Transition Time the target reports (Identify ANATT), in seconds: how long a host
    /// waits on a path whose ANA group is changing.
    #[arg(long = "anatt", value_name = "SECS", default_value_t = crate::nvmet::ana::DEFAULT_ANATT_S,
          value_parser = clap::value_parser!(u8).range(1..))]
    pub anatt: u8,
}

/// `target-ana set`: an ANA group's state through a port of a running `target --control`.
#[derive(Args, Debug, Clone)]
pub struct TargetAnaSet {
    /// The target's control socket (its --control).
    #[arg(long, value_name = "SOCKET")]
    pub control: PathBuf,
    /// Port ID (1 for the first --listen, 2 for the second, ...).
    #[arg(long)]
    pub port: u16,
    /// ANA group ID (1 unless the namespace was put in another).
    #[arg(long, default_value_t = 1)]
    pub group: u32,
    /// optimized, non-optimized, inaccessible, persistent-loss or change.
    pub state: String,
}

/// A namespace of the built-in target: `target`'s first, `target-ns add`'s.
#[derive(Args, Debug, Clone)]
pub struct NsArgs {
    /// RAM namespace size (e.g. 1G); default when no --file is given.
    #[arg(long, value_parser = parse_size)]
    pub ram: Option<usize>,
    /// File-backed namespace. Its identity (NGUID, UUID), which hosts tell it from other
    /// disks by, is kept beside it in FILE.nvmf-id (made on first use): keep the two together;
    /// without it the file is served as a new disk.
    #[arg(long)]
    pub file: Option<PathBuf>,
    /// Create or grow the file to this size.
    #[arg(long, value_parser = parse_size)]
    pub file_size: Option<usize>,
    /// Logical block size: 512 or 4096.
    #[arg(long, default_value_t = 512)]
    pub block_size: u32,
    /// ANA group of the namespace (1..=128): its access state through each port is that
    /// group's there (`target-ana set`).
    #[arg(long = "ana-group", value_name = "G", default_value_t = 1)]
    pub ana_group: u32,
}

impl NsArgs {
    /// The namespace these flags describe, as namespace `nsid`.
    pub fn namespace(&self, nsid: u32) -> Result<crate::nvmet::Namespace> {
        crate::nvmet::control::namespace_of(
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

    /// The `target-ns add` request for this namespace as `nsid` of subsystem `nqn`.
    pub fn add_request(&self, nqn: String, nsid: u32) -> AddNamespace {
        AddNamespace {
            nqn,
            nsid,
            ram: self.ram.map(|r| r as u64),
            // The target has its own working directory.
            file: self
                .file
                .as_ref()
                .map(|f| std::path::absolute(f).unwrap_or(f.clone())),
            file_size: self.file_size.map(|s| s as u64),
            block_size: self.block_size,
            ana_group: Some(self.ana_group),
        }
    }
}

/// `target-ns add`: a namespace for a running `target --control SOCKET`.
#[derive(Args, Debug, Clone)]
pub struct TargetNsAdd {
    /// The target's control socket (its --control).
    #[arg(long, value_name = "SOCKET")]
    pub control: PathBuf,
    /// Subsystem NQN (the target's -n).
    #[arg(short = 'n', long = "nqn", default_value = DEMO_NQN)]
    pub nqn: String,
    /// Namespace ID (not yet used in the subsystem).
    #[arg(long)]
    pub nsid: u32,
    #[command(flatten)]
    pub ns: NsArgs,
}

impl TargetArgs {
    /// The target these flags describe: one subsystem with namespace 1, on no device yet.
    pub fn config(&self) -> Result<TargetConfig> {
        let nqn = Nqn::new(&self.nqn).map_err(|e| anyhow::anyhow!("bad --nqn: {e}"))?;
        let ns = self.ns.namespace(1)?;
        let mut sub = Subsystem::new(nqn, vec![Arc::new(ns)]);
        if !self.allow_host.is_empty() {
            sub.allowed_hosts = Some(self.allow_host.clone());
        }
        Ok(TargetConfig {
            subsystems: vec![sub],
            port: self.trsvcid,
            max_kato_ms: self.max_kato * 1000,
            cqt_ms: self.cqt,
            offer_ccr: !self.no_ccr,
            late_writes_ms: self.fault_late_writes,
            anatt_s: self.anatt,
            ..TargetConfig::default()
        })
    }
}

/// The target on one soft-HCA per address of `listen`, each a port (IDs 1, 2, ... in that
/// order), advertising the first; the devices, in the same order.
pub async fn start_soft(
    listen: &[SocketAddr],
    cfg: TargetConfig,
) -> Result<(Target<SoftHca>, Vec<SoftHca>)> {
    let mut hcas = Vec::new();
    for (i, addr) in listen.iter().enumerate() {
        let n = u8::try_from(9 + i).context("at most 200 --listen addresses")?;
        let hca = SoftHca::start_with(
            device_config(&format!("tgt{i}"), *addr, n),
            addr.ip().is_loopback(),
        )
        .await
        .with_context(|| format!("cannot bind {addr}"))?;
        hcas.push(hca);
    }
    let Some(first) = hcas.first().cloned() else {
        anyhow::bail!("give --listen at least once");
    };
    let cfg = TargetConfig {
        advertise: Some(first.addr()),
        ..cfg
    };
    let t = Target::start(first.clone(), cfg)?;
    serve_cm(t.clone(), CmService::for_device(&first))?;
    for hca in &hcas[1..] {
        let port = t
            .add_port(hca.clone(), Some(hca.addr()))
            .map_err(anyhow::Error::msg)
            .with_context(|| format!("port {}", hca.addr()))?;
        serve_cm_on(t.clone(), port, CmService::for_device(hca))?;
    }
    Ok((t, hcas))
}

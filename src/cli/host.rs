//! The host side of a command: its soft-HCA, connect options and controller.

use std::net::SocketAddr;
use std::time::Duration;

pub use crate::cli::args::parse_uuid;
use crate::cli::args::{Fabric, Subsys};
use crate::cli::device::{self, DeviceChoice};
use crate::cli::support::{error_line, host_bind_addr, roce_peer, CtrlInfo, Health};
use crate::driver::{CmService, DeviceManager, SoftHca};
use crate::nvme::discovery::DiscoveryLogEntry;
use crate::nvme::Nqn;
use crate::reconnect::hold::HoldPolicy;
use crate::transport::{discover, ConnectOptions, Controller};
use anyhow::{bail, Context, Result};

/// A device on `addr`; off loopback its peers may be rxe or NICs (see `roce_peer`).
pub use crate::cli::support::soft_device_config as device_config;

/// A host soft-HCA on the local address that routes to `target`.
pub async fn host_stack(
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

/// The discovery log of the discovery controller `o` names, through the device `f` names
/// (`what` says what failed if reading the log does).
pub async fn discover_on(
    f: &Fabric,
    o: ConnectOptions,
    what: &'static str,
) -> Result<Vec<DiscoveryLogEntry>> {
    let entries = match &f.device {
        DeviceChoice::Soft => {
            let (hca, cm) = host_stack(f.traddr, f.host_traddr).await?;
            let r = discover(hca.clone(), cm, o).await;
            // Its UDP socket and memory go now, not with the process (the daemon lives on).
            hca.remove();
            hca.stopped().await;
            r
        }
        DeviceChoice::Kernel(sel) => device::discover_kernel(sel, o).await,
    };
    entries.context(what)
}

/// The discovery log of the discovery controller at `f`, asked as this host (the system's
/// host IDs, or `-q`).
pub async fn discover_at(f: &Fabric) -> Result<Vec<DiscoveryLogEntry>> {
    check_transport(f)?;
    let mut o = ConnectOptions::new(f.traddr, crate::nvme::fabrics::DISCOVERY_NQN);
    o.trsvcid = f.trsvcid;
    apply_system_host_ids(&mut o, std::path::Path::new(NVME_CONF_DIR));
    if let Some(h) = &f.hostnqn {
        o.hostnqn = h.clone();
    }
    discover_on(f, o, "discovery failed").await
}

pub fn check_transport(f: &Fabric) -> Result<()> {
    if f.transport != "rdma" {
        bail!("transport '{}' is not supported: only rdma", f.transport);
    }
    Ok(())
}

pub fn options(s: &Subsys) -> Result<ConnectOptions> {
    check_transport(&s.fabric)?;
    Nqn::new(&s.nqn).map_err(|e| anyhow::anyhow!("bad subsystem NQN: {e}"))?;
    if !(16..=1024).contains(&s.queues.queue_size) {
        bail!("--queue-size must be between 16 and 1024");
    }
    if s.queues.nr_io_queues == 0 || s.queues.nr_io_queues > 128 {
        bail!("--nr-io-queues must be between 1 and 128");
    }
    let mut o = ConnectOptions::new(s.fabric.traddr, &s.nqn);
    o.trsvcid = s.fabric.trsvcid;
    apply_system_host_ids(&mut o, std::path::Path::new(NVME_CONF_DIR));
    if let Some(id) = s.fabric.hostid.as_deref().and_then(parse_uuid) {
        o.hostid = id;
        if s.fabric.hostnqn.is_none() {
            o.hostnqn = Nqn::from_uuid(&id).as_str().to_string();
        }
    }
    if let Some(h) = &s.fabric.hostnqn {
        Nqn::new(h).map_err(|e| anyhow::anyhow!("bad host NQN: {e}"))?;
        o.hostnqn = h.clone();
    }
    o.nr_io_queues = s.queues.nr_io_queues;
    o.queue_size = s.queues.queue_size;
    let r = s.policy.resolve_default();
    o.keep_alive_tmo = r.policy.keep_alive_tmo;
    o.policy = r.policy;
    o.io_timeout = r.io_timeout;
    o.safe_retry = HoldPolicy {
        mode: s.safe_retry,
        default_cqt: Duration::from_millis(s.cqt_default),
    };
    Ok(o)
}

/// Where nvme-cli keeps the system's host NQN and host ID.
pub const NVME_CONF_DIR: &str = "/etc/nvme";

/// The system's host identity, as nvme-cli has it: `hostnqn` and `hostid` in `dir` (one
/// line each), when present and valid. A target whose allow-list holds the system host NQN
/// then lets us in as it lets the kernel host in; `-q` still overrides. A host ID without a
/// host NQN also names the NQN (`nqn.2014-08.org.nvmexpress:uuid:<hostid>`).
pub fn apply_system_host_ids(o: &mut ConnectOptions, dir: &std::path::Path) {
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

/// The name of the host HCA in the device manager of `connect`, `read`, `write`, `verify`.
pub const HOST_HCA: &str = "srxe0";

/// A host soft-HCA plugged into a device manager, on the local address that routes to
/// `target`. A controller on it comes back after the device is reset or re-plugged.
pub async fn host_device(
    target: SocketAddr,
    host_traddr: Option<SocketAddr>,
) -> Result<DeviceManager> {
    let addr = host_bind_addr(target, host_traddr).context("no route to the target address")?;
    let mgr = DeviceManager::new(!roce_peer(target.ip()));
    mgr.plug(device_config(HOST_HCA, addr, 1))
        .await
        .with_context(|| format!("cannot start the host soft-HCA on {addr}"))?;
    Ok(mgr)
}

pub async fn connect(s: &Subsys) -> Result<Controller> {
    connect_on(s).await.map(|(c, _)| c)
}

/// As [`connect`], also handing back the soft-HCA's device manager (`None` on a kernel
/// device), whose counters a command may report.
pub async fn connect_on(s: &Subsys) -> Result<(Controller, Option<DeviceManager>)> {
    let o = options(s)?;
    let c = match &s.fabric.device {
        DeviceChoice::Soft => {
            let mgr = host_device(s.fabric.traddr, s.fabric.host_traddr).await?;
            Controller::connect_managed(mgr.clone(), HOST_HCA, o)
                .await
                .map(|c| (c, Some(mgr)))
        }
        DeviceChoice::Kernel(sel) => device::connect_kernel(sel, o).await.map(|c| (c, None)),
    };
    c.map_err(|e| {
        anyhow::anyhow!(
            "connect to {} at {}: {}; {}",
            s.nqn,
            s.fabric.traddr,
            error_line(&e),
            connect_hint(&e.to_string())
        )
    })
}

/// What to check when a connect failed, from its error text.
pub fn connect_hint(e: &str) -> String {
    if e.contains("invalid host") {
        "the target does not allow this host NQN: pass -q with one it allows".into()
    } else if e.contains("invalid parameters") {
        "check the subsystem NQN (-n) with `nvmf-rdma discover`".into()
    } else if e.contains("nobody listens") || e.contains("invalid service") {
        "nothing on that service port: `nvmf-rdma discover` lists the ports (-s)".into()
    } else {
        "check -a, -s and -n with `nvmf-rdma discover`".into()
    }
}

/// What `list` shows of controller `c`, connected to `s` under `name`: one builder for the
/// foreground `connect` and the daemon. `traddr` is the address alone, as nvme-cli shows it;
/// the port is `trsvcid`.
pub fn ctrl_info(name: &str, s: &Subsys, c: &Controller) -> CtrlInfo {
    let status = c.status();
    let (state, health) = Health::from_status(&status);
    CtrlInfo {
        name: name.to_string(),
        subnqn: s.nqn.clone(),
        hostnqn: c.opts.hostnqn.clone(),
        traddr: s.fabric.traddr.ip().to_string(),
        trsvcid: s.fabric.trsvcid,
        // The target assigns a new one at each reconnect.
        cntlid: status.cntlid,
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
        safe_retry: c.safe_retry(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::args::ExportArgs;
    use crate::export::ExportAddr;
    use crate::reconnect::{IdentityMatch, Policy};
    use clap::Parser;
    use std::path::PathBuf;
    use std::time::Duration;

    /// `connect`'s fabrics, policy and export flags, as a command line takes them.
    #[derive(Parser)]
    struct Connect {
        #[command(flatten)]
        sub: Subsys,
        #[command(flatten)]
        export: ExportArgs,
    }

    fn parse(extra: &[&str]) -> Result<Connect, clap::Error> {
        let base = ["connect", "-a", "127.0.0.1", "-n", "nqn.a:b"];
        Connect::try_parse_from(base.iter().chain(extra))
    }

    fn options_of(extra: &[&str]) -> ConnectOptions {
        options(&parse(extra).unwrap().sub).unwrap()
    }

    #[test]
    fn system_host_ids_as_nvme_cli_keeps_them() {
        let dir = std::env::temp_dir().join(format!("nvmf-hostids-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fresh = || ConnectOptions::new("127.0.0.1:4791".parse().unwrap(), "nqn.x:y");
        let applied = || {
            let mut o = fresh();
            apply_system_host_ids(&mut o, &dir);
            o
        };
        // Nothing there: our defaults stand.
        assert_eq!(applied().hostnqn, fresh().hostnqn);
        // A host ID alone names the NQN too.
        std::fs::write(dir.join("hostid"), "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0\n").unwrap();
        let o = applied();
        assert_eq!(o.hostid[..4], [0x0f, 0x1e, 0x2d, 0x3c]);
        assert_eq!(
            o.hostnqn,
            "nqn.2014-08.org.nvmexpress:uuid:0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
        );
        // The host NQN file wins for the NQN; a bad one is ignored.
        std::fs::write(dir.join("hostnqn"), "nqn.2014-08.org.nvmexpress:uuid:sys\n").unwrap();
        assert_eq!(applied().hostnqn, "nqn.2014-08.org.nvmexpress:uuid:sys");
        std::fs::write(dir.join("hostnqn"), "not an nqn").unwrap();
        std::fs::write(dir.join("hostid"), "zz").unwrap();
        let o = applied();
        assert_eq!((o.hostnqn, o.hostid), (fresh().hostnqn, fresh().hostid));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn connect_flags_with_nvme_cli_names_fill_the_options() {
        // Linux's defaults when nothing is given.
        let o = options_of(&[]);
        assert_eq!(
            (o.policy, o.io_timeout),
            (Policy::default(), Duration::from_secs(30))
        );
        let c = parse(&["-t", "rdma", "-s", "4420", "-i", "2", "-Q", "64"]).unwrap();
        assert_eq!(c.sub.fabric.traddr, "127.0.0.1:4791".parse().unwrap());
        assert_eq!(
            (c.sub.queues.nr_io_queues, c.sub.queues.queue_size),
            (2, 64)
        );
        let o = options_of(&["-k", "5", "-c", "1", "-l", "-1", "--fast_io_fail_tmo", "3"]);
        assert_eq!(o.policy.ctrl_loss_tmo, None, "-1 = forever");
        assert_eq!(o.policy.fast_io_fail_tmo, Some(Duration::from_secs(3)));
        assert_eq!(o.policy.reconnect_delay, Duration::from_secs(1));
        assert_eq!(o.policy.keep_alive_tmo, Duration::from_secs(5));
        assert_eq!(o.keep_alive_tmo, Duration::from_secs(5));
        let o = options_of(&[
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
        ]);
        let want = Policy {
            ctrl_loss_tmo: Some(Duration::from_secs(60)),
            reconnect_delay: Duration::ZERO,
            fast_io_fail_tmo: None,
            keep_alive_tmo: Duration::ZERO,
            replug_window: Duration::from_secs(5),
            identity: IdentityMatch::Pci,
        };
        assert_eq!((o.policy, o.io_timeout), (want, Duration::from_secs(7)));
        // A caller's defaults (chaos's) apply only where no flag was given.
        let r = parse(&["-l", "-1"])
            .unwrap()
            .sub
            .policy
            .resolve(Duration::ZERO, Some(Duration::from_secs(60)));
        assert_eq!(r.policy.ctrl_loss_tmo, None);
        assert_eq!(r.policy.reconnect_delay, Duration::ZERO);
        let tcp = parse(&["-t", "tcp"]).unwrap();
        assert!(options(&tcp.sub)
            .unwrap_err()
            .to_string()
            .contains("only rdma"));
    }

    #[test]
    fn export_flags_parse_an_nbd_address_and_a_mountpoint() {
        let c = parse(&["--nbd", "unix:/run/n.sock", "--fuse", "/mnt/x"]).unwrap();
        assert_eq!(c.export.nbd, Some(ExportAddr::Unix("/run/n.sock".into())));
        assert_eq!(c.export.fuse, Some(PathBuf::from("/mnt/x")));
        assert!(parse(&["--nbd", "127.0.0.1:10809"]).is_ok());
    }

    #[test]
    fn bad_connect_flags_are_clap_errors_that_say_what_is_wanted() {
        for (args, want) in [
            (&["-l", "-2"][..], "forever"),
            (&["-l", "ten"][..], "whole number"),
            (&["--fast_io_fail_tmo", "-5"][..], "forever"),
            (&["-c", "-1"][..], ">= 0"),
            (&["-k", "-1"][..], ">= 0"),
            (&["--identity", "serial"][..], "possible values"),
            (&["--io-timeout", "0"][..], ">= 1"),
            (&["--replug-window", "x"][..], "whole number"),
            (&["--nbd", "10809"][..], "10809"),
        ] {
            let Err(e) = parse(args) else {
                panic!("{args:?} accepted")
            };
            let msg = e.to_string();
            assert!(
                msg.contains(want) && msg.contains("invalid value"),
                "{args:?}: {msg}"
            );
        }
        let e = Connect::try_parse_from(["connect", "-a", "nowhere", "-n", "x"]);
        assert!(e.is_err_and(|e| e.to_string().contains("invalid value")));
    }
}

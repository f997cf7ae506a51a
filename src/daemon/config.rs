//! The config file `connect-all` reads: CONFIG_DIR/discovery.conf, one connection a line in
//! nvme-cli's flags (nvme-cli's own discovery.conf format, plus `connect`'s flags). A line
//! without `-n` names a discovery controller: every subsystem it lists is connected. A line
//! with `-n` connects that subsystem, with the exports the line asks for.

use std::path::{Path, PathBuf};

use crate::cli::args::{parse_connect, ConnectMode, ExportArgs, Subsys};
use crate::cli::support::Tmo;
use crate::daemon::proto::ConnectParams;
use crate::nvme::fabrics::DISCOVERY_NQN;

/// The config file's name in the config directory.
pub const CONFIG_FILE: &str = "discovery.conf";
/// Longest config file read; past it the file is refused (it is ours, not a peer's, but a
/// bound costs nothing).
const MAX_CONFIG: u64 = 1 << 20;

/// `--config-dir`, else `$NVMF_RDMA_CONFIG_DIR`, else `/etc/nvmf-rdma`.
pub fn config_dir(flag: Option<&Path>) -> PathBuf {
    if let Some(d) = flag {
        return d.to_path_buf();
    }
    std::env::var_os("NVMF_RDMA_CONFIG_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/etc/nvmf-rdma"))
}

/// The request `connect` sends for these arguments.
pub fn params_of(s: &Subsys, x: &ExportArgs, m: &ConnectMode) -> ConnectParams {
    let tmo = |t: Option<Tmo>| t.map(|t| t.0.map_or(-1, |d| d.as_secs() as i64));
    let abs = |p: &Path| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
    ConnectParams {
        transport: Some(s.fabric.transport.clone()),
        traddr: s.fabric.traddr.to_string(),
        trsvcid: Some(s.fabric.trsvcid),
        nqn: s.nqn.clone(),
        hostnqn: s.fabric.hostnqn.clone(),
        hostid: s.fabric.hostid.clone(),
        host_traddr: s.fabric.host_traddr.map(|a| a.to_string()),
        device: match &s.fabric.device {
            crate::cli::device::DeviceChoice::Soft => None,
            d => Some(d.to_string()),
        },
        nr_io_queues: Some(s.queues.nr_io_queues),
        queue_size: Some(s.queues.queue_size),
        keep_alive_tmo: s.policy.keep_alive_tmo,
        reconnect_delay: s.policy.reconnect_delay,
        ctrl_loss_tmo: tmo(s.policy.ctrl_loss_tmo),
        fast_io_fail_tmo: tmo(s.policy.fast_io_fail_tmo),
        replug_window: s.policy.replug_window,
        identity: s
            .policy
            .identity
            .map(|i| format!("{i:?}").to_ascii_lowercase()),
        io_timeout: s.policy.io_timeout,
        safe_retry: Some(s.safe_retry.name().to_string()),
        cqt_default: Some(s.cqt_default),
        nsid: Some(s.nsid),
        // The daemon has another working directory: paths go absolute.
        nbd: x.nbd.as_ref().map(|a| match a {
            crate::export::ExportAddr::Unix(p) => format!("unix:{}", abs(p).display()),
            a => a.to_string(),
        }),
        nbd_allow_remote: x.nbd_allow_remote,
        fuse: x.fuse.as_deref().map(|p| abs(p).display().to_string()),
        duplicate_connect: m.duplicate_connect,
        iopolicy: s.iopolicy.map(|p| p.name().to_string()),
    }
}

/// One configured connection: its line number and request.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigLine {
    pub line: usize,
    pub params: ConnectParams,
    /// No `-n`: a discovery controller whose subsystems are all connected.
    pub discovery: bool,
}

/// Read `dir/discovery.conf`: its lines, or `Ok(vec![])` when there is no file. A bad line
/// is an error naming it.
pub fn read_config(dir: &Path) -> Result<Vec<ConfigLine>, String> {
    let path = dir.join(CONFIG_FILE);
    let meta = match std::fs::metadata(&path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(format!("{}: {e}", path.display())),
    };
    if meta.len() > MAX_CONFIG {
        return Err(format!("{}: larger than 1 MiB", path.display()));
    }
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    parse_config(&text).map_err(|e| format!("{}: {e}", path.display()))
}

pub fn parse_config(text: &str) -> Result<Vec<ConfigLine>, String> {
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let mut args: Vec<String> = line.split_whitespace().map(String::from).collect();
        let has_nqn = args
            .iter()
            .any(|a| a == "-n" || a == "--nqn" || a.starts_with("--nqn="));
        if !has_nqn {
            args.extend(["-n".to_string(), DISCOVERY_NQN.to_string()]);
        }
        let (s, x, m) = parse_connect(&args).map_err(|e| format!("line {}: {e}", i + 1))?;
        if !has_nqn && (x.nbd.is_some() || x.fuse.is_some()) {
            return Err(format!(
                "line {}: --nbd and --fuse need -n (one subsystem), not a discovery line",
                i + 1
            ));
        }
        out.push(ConfigLine {
            line: i + 1,
            params: params_of(&s, &x, &m),
            discovery: !has_nqn,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_lines_parse_the_nvme_cli_way() {
        let c = parse_config(
            "# discovery controllers\n\
             -t rdma -a 127.0.0.1 -s 4420\n\
             \n\
             --transport=rdma --traddr=10.0.0.2 -n nqn.2026-11.io.x:vol1 --fuse /mnt/v1 -k 30 # vol1\n",
        )
        .unwrap();
        assert_eq!(c.len(), 2);
        assert!(c[0].discovery && c[0].params.nqn == DISCOVERY_NQN);
        assert_eq!((c[0].line, c[1].line), (2, 4));
        assert!(!c[1].discovery);
        assert_eq!(c[1].params.fuse.as_deref(), Some("/mnt/v1"));
        assert_eq!(c[1].params.keep_alive_tmo, Some(30));
        assert_eq!(c[1].params.traddr, "10.0.0.2:4791");
        let e = parse_config("-a 127.0.0.1\n-a nowhere -n x\n").unwrap_err();
        assert!(e.starts_with("line 2:"), "{e}");
        let e = parse_config("-a 127.0.0.1 --fuse /mnt/x\n").unwrap_err();
        assert!(e.contains("need -n"), "{e}");
    }
}

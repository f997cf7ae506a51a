//! Pieces of the command line that are worth testing on their own: address parsing, the
//! local address towards a peer, and the control socket of a running `connect`.

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::path::PathBuf;
use std::time::Duration;

use crate::reconnect::Policy;
use crate::wire_json::JsonObj;

/// The UDP port a soft-HCA (like any RoCEv2 device) listens on unless told otherwise.
pub const DEFAULT_ROCE_PORT: u16 = 4791;

/// Parse `-a/--traddr`: `IP` (RoCEv2 port 4791) or `IP:PORT` / `[IPv6]:PORT` for a soft-HCA
/// bound elsewhere.
pub fn parse_traddr(s: &str) -> Result<SocketAddr, String> {
    if let Ok(a) = s.parse::<SocketAddr>() {
        return Ok(a);
    }
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, DEFAULT_ROCE_PORT));
    }
    Err(format!(
        "'{s}' is not an address: use an IP (port {DEFAULT_ROCE_PORT}) or IP:PORT"
    ))
}

/// A timeout in nvme-cli's seconds where -1 means "never" (`None`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tmo(pub Option<Duration>);

impl std::fmt::Display for Tmo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            None => f.write_str("-1"),
            Some(d) => write!(f, "{}", d.as_secs()),
        }
    }
}

/// Parse `--ctrl-loss-tmo` / `--fast_io_fail_tmo`: whole seconds, or -1.
pub fn parse_tmo(s: &str) -> Result<Tmo, String> {
    Policy::parse_tmo(s).map(Tmo)
}

/// Parse whole seconds >= 0 (`--reconnect-delay`, `--keep-alive-tmo`, `--replug-window`).
pub fn parse_secs(s: &str) -> Result<u64, String> {
    match s.trim().parse::<i64>() {
        Ok(v) if v >= 0 => Ok(v as u64),
        Ok(v) => Err(format!("{v} is not valid: give whole seconds >= 0")),
        Err(_) => Err(format!("{s:?} is not a whole number of seconds")),
    }
}

/// Parse whole seconds >= 1 (`--io-timeout`).
pub fn parse_pos_secs(s: &str) -> Result<u64, String> {
    match parse_secs(s)? {
        0 => Err("0 is not valid: give whole seconds >= 1".into()),
        v => Ok(v),
    }
}

/// The local address the kernel would use to reach `peer` (no packet is sent).
pub fn local_ip_for(peer: SocketAddr) -> std::io::Result<IpAddr> {
    let bind: SocketAddr = if peer.is_ipv4() {
        "0.0.0.0:0".parse().expect("literal")
    } else {
        "[::]:0".parse().expect("literal")
    };
    let s = UdpSocket::bind(bind)?;
    s.connect(peer)?;
    Ok(s.local_addr()?.ip())
}

/// Where running controllers keep their control sockets.
pub fn run_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("NVMF_RDMA_RUN_DIR") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_RUNTIME_DIR") {
        return PathBuf::from(d).join("nvmf-rdma");
    }
    PathBuf::from("/run/nvmf-rdma")
}

/// What `list` shows about one controller.
#[derive(Debug, Clone, PartialEq)]
pub struct CtrlInfo {
    pub name: String,
    pub subnqn: String,
    pub hostnqn: String,
    pub traddr: String,
    pub trsvcid: u16,
    pub cntlid: u16,
    pub state: String,
    pub io_queues: usize,
    pub namespaces: Vec<(u32, u32, u64)>,
    pub model: String,
    pub serial: String,
}

impl CtrlInfo {
    pub fn to_json(&self) -> String {
        let mut o = JsonObj::new();
        o.str("name", &self.name)
            .str("subnqn", &self.subnqn)
            .str("hostnqn", &self.hostnqn)
            .str("transport", "rdma")
            .str("traddr", &self.traddr)
            .num("trsvcid", self.trsvcid as u64)
            .num("cntlid", self.cntlid as u64)
            .str("state", &self.state)
            .num("io_queues", self.io_queues as u64)
            .str("model", &self.model)
            .str("serial", &self.serial);
        let ns: Vec<String> = self
            .namespaces
            .iter()
            .map(|(id, bs, blocks)| {
                let mut n = JsonObj::new();
                n.num("nsid", *id as u64)
                    .num("block_size", *bs as u64)
                    .num("blocks", *blocks);
                n.finish()
            })
            .collect();
        o.raw("namespaces", &format!("[{}]", ns.join(",")));
        o.finish()
    }
}

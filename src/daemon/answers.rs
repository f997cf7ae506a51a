//! The answers of the control protocol: what each request gets after `"ok":true`, the
//! controller object `list` shows, and the progress lines of a request that moves data.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::daemon::proto::PROTOCOL_VERSION;

/// The answer to a request that succeeded: the fields after `"ok":true`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Reply {
    Status(StatusReply),
    List(ListReply),
    Connect(Box<ConnectReply>),
    ConnectAll(ConnectAllReply),
    Disconnect(DisconnectReply),
    Stop(StopReply),
    Read(ReadReply),
    Write(WriteReply),
    Verify(VerifyReply),
    Copied(CopiedReply),
}

/// `read-to-fd`, `write-from-fd`: the bytes moved.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CopiedReply {
    pub copied: u64,
}

/// A line the daemon sends before the answer of a request that asked for `progress`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Progress {
    pub done: u64,
    pub total: u64,
}

/// The progress line: `{"version":1,"id":...,"progress":{"done":N,"total":M}}`.
pub fn progress_line(id: &Option<Value>, p: Progress) -> String {
    #[derive(Serialize)]
    struct Line<'a> {
        version: u64,
        #[serde(skip_serializing_if = "Option::is_none")]
        id: &'a Option<Value>,
        progress: Progress,
    }
    serde_json::to_string(&Line {
        version: PROTOCOL_VERSION,
        id,
        progress: p,
    })
    .unwrap_or_default()
}

/// The progress a line reports, if it is a progress line.
pub fn parse_progress(line: &str) -> Option<Progress> {
    #[derive(Deserialize)]
    struct Line {
        progress: Progress,
    }
    serde_json::from_str::<Line>(line).ok().map(|l| l.progress)
}

/// `status`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatusReply {
    pub pid: u32,
    pub daemon_version: String,
    pub protocol_version: u64,
    pub run_dir: String,
    pub config_dir: String,
    pub controllers: usize,
    pub connecting: Vec<String>,
    pub stopping: bool,
}

/// `list`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ListReply {
    pub controllers: Vec<ControllerInfo>,
}

/// `connect`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConnectReply {
    pub device: String,
    pub controller: ControllerInfo,
}

/// `connect-all`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConnectAllReply {
    pub results: Vec<LineResult>,
}

/// What became of one subsystem of `connect-all`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LineResult {
    /// The config file's line (0: the request's `params`).
    pub line: usize,
    pub traddr: String,
    #[serde(default)]
    pub trsvcid: Option<u16>,
    pub nqn: String,
    pub status: LineStatus,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl std::fmt::Display for LineResult {
    /// As the daemon logs it: the result's JSON.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&serde_json::to_string(self).unwrap_or_default())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LineStatus {
    Connected,
    AlreadyConnected,
    Failed,
}

/// `disconnect`, `disconnect-all`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DisconnectReply {
    pub disconnected: Vec<String>,
}

/// `stop`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StopReply {
    pub stopping: bool,
}

/// `read`: the bytes, base64.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReadReply {
    pub data: String,
}

/// `write`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WriteReply {
    pub written: usize,
}

/// `verify`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VerifyReply {
    pub verified: usize,
}

/// A controller as `list` shows it (the controller object of `docs/control-protocol.md`).
/// Fields a `connect --foreground` or an older daemon does not send take their defaults.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct ControllerInfo {
    pub name: String,
    pub subnqn: String,
    pub hostnqn: String,
    pub transport: String,
    /// The target's IP, as nvme-cli shows it.
    pub traddr: String,
    /// The target's soft-HCA as `IP:PORT` (the daemon's controllers).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    /// The NVMe-oF service ID the connect named (`-s`).
    pub trsvcid: u16,
    pub cntlid: u16,
    pub state: String,
    pub io_queues: usize,
    pub model: String,
    pub serial: String,
    pub cause: Option<String>,
    pub attempt: u32,
    pub max_attempts: Option<u32>,
    pub ctrl_loss_in_ms: Option<f64>,
    pub recoveries: u64,
    pub last_recovery_ms: Option<f64>,
    #[serde(default = "yes")]
    pub device_present: bool,
    pub foreign_device: bool,
    pub failfast: bool,
    pub fail_reason: Option<String>,
    pub next_attempt_in_ms: Option<f64>,
    /// `--safe-retry`: ccr, cqt or off (empty from a host that does not say).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub safe_retry: String,
    /// Dead associations whose commands may still execute, and the commands held for them.
    pub holds: Vec<HoldInfo>,
    pub namespaces: Vec<NamespaceInfo>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub exports: Vec<ExportInfo>,
    /// The subsystem's I/O policy over its paths (the daemon's controllers).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub iopolicy: Option<String>,
    /// This controller as a path of its subsystem (the daemon's controllers).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<PathDetail>,
    /// Held by a `connect --foreground` process (set by the client that lists it).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub foreground: bool,
}

fn yes() -> bool {
    true
}

impl ControllerInfo {
    /// The bytes its namespaces hold together, as `nvme list` shows a device's size.
    pub fn capacity(&self) -> u64 {
        self.namespaces
            .iter()
            .map(|n| n.blocks * u64::from(n.block_size))
            .sum()
    }
}

/// A controller as a path of its subsystem: what nvme-cli's `list-subsys` and `nvme top`
/// show of a path.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct PathDetail {
    /// The host device it runs on.
    pub device: String,
    /// ANA state of each namespace through it (Linux's names).
    pub ana_state: Vec<(u32, String)>,
    /// Commands sent on it.
    pub ios: u64,
    /// Commands in flight on it now.
    pub inflight: u32,
    /// Commands that left it for another path.
    pub failovers: u64,
    /// Its controller's completed reconnects.
    pub reconnects: u64,
}

/// A safe-retry hold of a controller: commands that were in flight on a dead association and
/// wait until it can run nothing more.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct HoldInfo {
    /// The dead controller instance.
    pub cntlid: u16,
    pub ciu: u8,
    /// Commands held.
    pub held: usize,
    /// What is expected to let them go: `ccr` (a Cross-Controller Reset under way or
    /// done) or `time` (k x KATO + CQT after the last contact).
    pub released_by: String,
    /// Until the time rule lets them go in any case.
    pub time_left_ms: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct NamespaceInfo {
    pub nsid: u32,
    pub block_size: u32,
    pub blocks: u64,
}

/// An export of a controller the daemon holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum ExportInfo {
    Nbd {
        nsid: u32,
        address: String,
        uri: String,
        names: Vec<String>,
        clients: usize,
    },
    Fuse {
        nsid: u32,
        mountpoint: String,
        file: String,
        files: Vec<String>,
        open_handles: usize,
    },
}

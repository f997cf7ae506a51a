//! Engine options and filenames, parsed and checked here so a bad job file gets a clear
//! message instead of a crash.
//!
//! Options come from fio as strings (`traddr=...` in the job). The filename uses SPDK's
//! transport-ID style, `trtype=RDMA adrfam=IPv4 traddr=127.0.0.1 trsvcid=4420 subnqn=... ns=1`,
//! space separated; fio splits filenames on ':', so `filename=ns=1:ns=2` names two namespaces
//! and an address with a port belongs in the `traddr` option, not the filename. Keys in the
//! filename override the options of the same name.

use std::ffi::{c_char, CStr};
use std::net::SocketAddr;
use std::time::Duration;

use nvmf_rdma::cli::device::DeviceChoice;
use nvmf_rdma::cli::support::{parse_traddr, DEFAULT_ROCE_PORT};
use nvmf_rdma::harness::nvmf_perf::DEMO_NQN;
use nvmf_rdma::multipath::IoPolicy;
use nvmf_rdma::nvme::Nqn;
use nvmf_rdma::reconnect::policy::DEFAULT_REPLUG_WINDOW;
use nvmf_rdma::reconnect::IdentityMatch;

/// The option strings exactly as the C shim's `struct nvmf_rs_strs` lays them out.
#[repr(C)]
pub struct RawOptions {
    pub traddr: *const c_char,
    pub trsvcid: *const c_char,
    pub subnqn: *const c_char,
    pub hostnqn: *const c_char,
    pub ns: *const c_char,
    pub nr_io_queues: *const c_char,
    pub queue_size: *const c_char,
    pub keep_alive_tmo: *const c_char,
    pub ctrl_loss_tmo: *const c_char,
    pub reconnect_delay: *const c_char,
    pub fast_io_fail_tmo: *const c_char,
    pub builtin_target: *const c_char,
    pub runtime_threads: *const c_char,
    pub chaos_reset_every: *const c_char,
    pub chaos_down_for: *const c_char,
    pub busy_poll: *const c_char,
    pub device: *const c_char,
    pub identity: *const c_char,
    pub replug_window: *const c_char,
    pub registered_buffers: *const c_char,
    pub busy_poll_gate: *const c_char,
    pub safe_retry: *const c_char,
    pub traddr2: *const c_char,
    pub trsvcid2: *const c_char,
    pub builtin_ports: *const c_char,
    pub iopolicy: *const c_char,
    pub chaos_unplug_every: *const c_char,
    pub chaos_unplug_for: *const c_char,
    pub chaos_freeze_every: *const c_char,
    pub chaos_freeze_for: *const c_char,
}

/// Where the target is: an address, or a port of the built-in RAM target of this size (served
/// on `ports` ports) in this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TargetAddr {
    Remote(SocketAddr),
    Builtin { bytes: u64, ports: u8, port: u8 },
}

impl std::fmt::Display for TargetAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TargetAddr::Remote(a) => write!(f, "{a}"),
            TargetAddr::Builtin {
                bytes, ports: 1, ..
            } => {
                write!(f, "the built-in target ({} MiB)", bytes >> 20)
            }
            TargetAddr::Builtin { bytes, port, .. } => write!(
                f,
                "port {} of the built-in target ({} MiB)",
                port + 1,
                bytes >> 20
            ),
        }
    }
}

/// Everything that identifies one controller; jobs and threads naming the same key share it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CtrlKey {
    pub target: TargetAddr,
    pub trsvcid: u16,
    pub subnqn: String,
    pub hostnqn: Option<String>,
    /// The host's RDMA device: the soft-HCA or a kernel device (`device=`).
    pub device: DeviceChoice,
}

/// Recovery knobs with nvme-cli's names and Linux defaults; `None` = -1 (forever / off).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recovery {
    pub ctrl_loss_tmo: Option<Duration>,
    pub reconnect_delay: Duration,
    pub fast_io_fail_tmo: Option<Duration>,
    /// Which device that comes back is ours.
    pub identity: IdentityMatch,
    pub replug_window: Duration,
    /// Safe retry of writes in flight on a dead connection (`safe_retry=`).
    pub safe_retry: nvmf_rdma::reconnect::hold::SafeRetry,
}

/// What chaos does to a path's host device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// A fatal device error: the same device comes back (`chaos_reset_every`).
    Reset,
    /// A hot-remove: the same card is plugged back (`chaos_unplug_every`).
    Unplug,
    /// The target's port stops answering commands, nothing reported: the path dies
    /// silently, and only the keep-alive timeout tells (`chaos_freeze_every`).
    Freeze,
}

impl FaultKind {
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::Reset => "reset",
            FaultKind::Unplug => "unplug",
            FaultKind::Freeze => "freeze",
        }
    }
}

/// Device chaos while the job runs: a fault of the host device every `every`, the device
/// away for `down_for`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chaos {
    pub kind: FaultKind,
    pub every: Duration,
    pub down_for: Duration,
}

/// One controller's settings (what `connect` needs) and the engine-wide ones.
#[derive(Debug, Clone, PartialEq)]
pub struct CtrlOptions {
    pub key: CtrlKey,
    pub nr_io_queues: usize,
    pub queue_size: usize,
    pub keep_alive_tmo: Duration,
    pub recovery: Recovery,
    pub chaos: Option<Chaos>,
}

/// A second path to the subsystem (`traddr2=` or `builtin_ports=2`): its controller, and how
/// I/O is spread over the two.
#[derive(Debug, Clone, PartialEq)]
pub struct SecondPath {
    /// The second controller; its `chaos` is `chaos_unplug_every`'s or `chaos_freeze_every`'s.
    pub ctrl: CtrlOptions,
    pub iopolicy: IoPolicy,
}

/// A parsed filename: which controller (the first path), which namespace, and the second
/// path when there is one.
#[derive(Debug, Clone, PartialEq)]
pub struct FileTarget {
    pub ctrl: CtrlOptions,
    pub nsid: u32,
    pub second: Option<SecondPath>,
}

/// Options as `key -> value` text, before the filename's keys are laid over them.
#[derive(Debug, Clone, Default)]
pub struct OptionText {
    pairs: Vec<(&'static str, String)>,
}

const KEYS: [&str; 30] = [
    "traddr",
    "trsvcid",
    "subnqn",
    "hostnqn",
    "ns",
    "nr_io_queues",
    "queue_size",
    "keep_alive_tmo",
    "ctrl_loss_tmo",
    "reconnect_delay",
    "fast_io_fail_tmo",
    "builtin_target",
    "runtime_threads",
    "chaos_reset_every",
    "chaos_down_for",
    "busy_poll",
    "device",
    "identity",
    "replug_window",
    "registered_buffers",
    "busy_poll_gate",
    "safe_retry",
    "traddr2",
    "trsvcid2",
    "builtin_ports",
    "iopolicy",
    "chaos_unplug_every",
    "chaos_unplug_for",
    "chaos_freeze_every",
    "chaos_freeze_for",
];

/// Filename keys that only say what SPDK's transport ID says and we already are.
const ACCEPTED_AS_IS: [(&str, &[&str]); 2] = [("trtype", &["rdma"]), ("adrfam", &["ipv4", "ipv6"])];

impl OptionText {
    /// Read the shim's strings.
    ///
    /// # Safety
    /// `raw` must point to a `struct nvmf_rs_strs` whose non-null fields are NUL-terminated
    /// strings (fio's option parser stores them so).
    pub unsafe fn from_raw(raw: *const RawOptions) -> Result<OptionText, String> {
        let raw = raw.as_ref().ok_or("no engine options")?;
        let ptrs = [
            raw.traddr,
            raw.trsvcid,
            raw.subnqn,
            raw.hostnqn,
            raw.ns,
            raw.nr_io_queues,
            raw.queue_size,
            raw.keep_alive_tmo,
            raw.ctrl_loss_tmo,
            raw.reconnect_delay,
            raw.fast_io_fail_tmo,
            raw.builtin_target,
            raw.runtime_threads,
            raw.chaos_reset_every,
            raw.chaos_down_for,
            raw.busy_poll,
            raw.device,
            raw.identity,
            raw.replug_window,
            raw.registered_buffers,
            raw.busy_poll_gate,
            raw.safe_retry,
            raw.traddr2,
            raw.trsvcid2,
            raw.builtin_ports,
            raw.iopolicy,
            raw.chaos_unplug_every,
            raw.chaos_unplug_for,
            raw.chaos_freeze_every,
            raw.chaos_freeze_for,
        ];
        let mut t = OptionText::default();
        for (key, p) in KEYS.iter().zip(ptrs) {
            if p.is_null() {
                continue;
            }
            let v = CStr::from_ptr(p)
                .to_str()
                .map_err(|_| format!("option {key} is not UTF-8"))?;
            t.set(key, v)?;
        }
        Ok(t)
    }

    /// Set `key` (one of the engine's option names).
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), String> {
        let k = KEYS
            .iter()
            .find(|k| **k == key)
            .ok_or_else(|| format!("unknown key '{key}' (known: {})", KEYS.join(", ")))?;
        self.pairs.retain(|(x, _)| x != k);
        self.pairs.push((k, value.trim().to_string()));
        Ok(())
    }

    fn get(&self, key: &str) -> Option<&str> {
        self.pairs
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.as_str())
            .filter(|v| !v.is_empty())
    }

    /// These options with a filename's `key=value` words laid over them.
    pub fn with_filename(&self, name: &str) -> Result<OptionText, String> {
        let mut t = self.clone();
        for word in name.split_whitespace() {
            let (k, v) = word
                .split_once('=')
                .ok_or_else(|| format!("'{word}' is not key=value (example: ns=1)"))?;
            let k = k.to_ascii_lowercase();
            if let Some((_, ok)) = ACCEPTED_AS_IS.iter().find(|(a, _)| *a == k) {
                if !ok.contains(&v.to_ascii_lowercase().as_str()) {
                    return Err(format!(
                        "{k}={v} is not supported (use {})",
                        ok.join(" or ")
                    ));
                }
                continue;
            }
            t.set(&k, v)?;
        }
        Ok(t)
    }

    /// The file's controller and namespace.
    pub fn file_target(&self) -> Result<FileTarget, String> {
        let nsid = match self.get("ns") {
            None => 1,
            Some(v) => parse_int::<u32>("ns", v).and_then(|n| {
                if n == 0 || n == u32::MAX {
                    Err(format!("ns={v}: namespace IDs are 1..0xfffffffe"))
                } else {
                    Ok(n)
                }
            })?,
        };
        let ctrl = self.ctrl_options()?;
        let second = self.second_path(&ctrl)?;
        Ok(FileTarget { ctrl, nsid, second })
    }

    /// The second path, from `traddr2=` (a second portal of a remote target) or
    /// `builtin_ports=2` (the built-in target on two ports): the first path's settings with
    /// the other address, a host device of its own, and `chaos_unplug_every`'s fault.
    fn second_path(&self, first: &CtrlOptions) -> Result<Option<SecondPath>, String> {
        let ports = self
            .get("builtin_ports")
            .map(|v| parse_int::<u8>("builtin_ports", v))
            .transpose()?;
        let target = match (first.key.target, ports, self.get("traddr2")) {
            (_, Some(n), _) if !(1..=2).contains(&n) => {
                return Err(format!("builtin_ports={n}: use 1 or 2"));
            }
            (TargetAddr::Remote(_), Some(_), _) => {
                return Err(
                    "builtin_ports needs builtin_target, not traddr (use traddr2= for a \
                            second portal)"
                        .into(),
                );
            }
            (TargetAddr::Builtin { .. }, _, Some(_)) => {
                return Err(
                    "traddr2 needs traddr (use builtin_ports=2 for two ports of the \
                            built-in target)"
                        .into(),
                );
            }
            (TargetAddr::Remote(_), None, Some(a)) => TargetAddr::Remote(
                parse_traddr(a).map_err(|e| format!("traddr2: {e} (port {DEFAULT_ROCE_PORT})"))?,
            ),
            (TargetAddr::Builtin { bytes, .. }, Some(2), None) => TargetAddr::Builtin {
                bytes,
                ports: 2,
                port: 1,
            },
            _ => {
                for k in [
                    "trsvcid2",
                    "iopolicy",
                    "chaos_unplug_every",
                    "chaos_freeze_every",
                ] {
                    if self.get(k).is_some() {
                        return Err(format!(
                            "{k} is about a second path: give traddr2= (or builtin_ports=2)"
                        ));
                    }
                }
                return Ok(None);
            }
        };
        if let DeviceChoice::Kernel(d) = &first.key.device {
            return Err(format!(
                "device={d} is one device: a second path runs on a soft-HCA of its own (device=soft)"
            ));
        }
        let trsvcid = self
            .get("trsvcid2")
            .map(|v| parse_int::<u16>("trsvcid2", v))
            .transpose()?
            .unwrap_or(first.key.trsvcid);
        let iopolicy = self
            .get("iopolicy")
            .map(|v| v.parse::<IoPolicy>())
            .transpose()?
            .unwrap_or_default();
        let unplug = self.chaos("chaos_unplug_every", "chaos_unplug_for", FaultKind::Unplug)?;
        let freeze = self.chaos("chaos_freeze_every", "chaos_freeze_for", FaultKind::Freeze)?;
        let chaos = match (unplug, freeze) {
            (Some(_), Some(_)) => {
                return Err("give chaos_unplug_every or chaos_freeze_every, not both".into())
            }
            (Some(_), None) | (None, None) => unplug,
            (None, Some(_)) if matches!(target, TargetAddr::Remote(_)) => {
                return Err(
                    "chaos_freeze_every freezes a port of the built-in target: use \
                            builtin_target= with builtin_ports=2"
                        .into(),
                );
            }
            (None, Some(_)) => freeze,
        };
        let mut ctrl = first.clone();
        ctrl.key.target = target;
        ctrl.key.trsvcid = trsvcid;
        ctrl.chaos = chaos;
        Ok(Some(SecondPath { ctrl, iopolicy }))
    }

    /// A fault schedule: every `every_key`, the device away for `for_key` (default 0).
    fn chaos(
        &self,
        every_key: &str,
        for_key: &str,
        kind: FaultKind,
    ) -> Result<Option<Chaos>, String> {
        let Some(v) = self.get(every_key) else {
            return Ok(None);
        };
        let every = parse_secs(every_key, v)?;
        if every.is_zero() {
            return Err(format!("{every_key} must be more than 0"));
        }
        let down_for = self
            .get(for_key)
            .map(|v| parse_secs(for_key, v))
            .transpose()?
            .unwrap_or(Duration::ZERO);
        Ok(Some(Chaos {
            kind,
            every,
            down_for,
        }))
    }

    pub fn ctrl_options(&self) -> Result<CtrlOptions, String> {
        let target = match (self.get("builtin_target"), self.get("traddr")) {
            (Some(_), Some(_)) => {
                return Err("give either builtin_target or traddr, not both".into());
            }
            (Some(size), None) => TargetAddr::Builtin {
                bytes: parse_size("builtin_target", size)?,
                ports: self
                    .get("builtin_ports")
                    .map_or(Ok(1), |v| parse_int::<u8>("builtin_ports", v))?,
                port: 0,
            },
            (None, Some(a)) => TargetAddr::Remote(
                parse_traddr(a).map_err(|e| format!("traddr: {e} (port {DEFAULT_ROCE_PORT})"))?,
            ),
            (None, None) => {
                return Err(
                    "no target: set traddr=<IP[:PORT]> (and subnqn=), or builtin_target=<size> \
                     for the in-process RAM target"
                        .into(),
                );
            }
        };
        let subnqn = match (self.get("subnqn"), target) {
            (Some(n), _) => n.to_string(),
            (None, TargetAddr::Builtin { .. }) => DEMO_NQN.to_string(),
            (None, TargetAddr::Remote(_)) => return Err("subnqn= is required with traddr".into()),
        };
        Nqn::new(&subnqn).map_err(|e| format!("subnqn: {e}"))?;
        let hostnqn = self.get("hostnqn").map(str::to_string);
        if let Some(h) = &hostnqn {
            Nqn::new(h).map_err(|e| format!("hostnqn: {e}"))?;
        }
        let trsvcid = self
            .get("trsvcid")
            .map(|v| parse_int::<u16>("trsvcid", v))
            .transpose()?
            .unwrap_or(4420);
        let nr_io_queues = self
            .get("nr_io_queues")
            .map(|v| parse_int::<usize>("nr_io_queues", v))
            .transpose()?
            .unwrap_or(1);
        if !(1..=128).contains(&nr_io_queues) {
            return Err(format!("nr_io_queues={nr_io_queues}: use 1..128"));
        }
        let queue_size = self
            .get("queue_size")
            .map(|v| parse_int::<usize>("queue_size", v))
            .transpose()?
            .unwrap_or(128);
        if !(16..=1024).contains(&queue_size) {
            return Err(format!("queue_size={queue_size}: use 16..1024"));
        }
        let keep_alive_tmo = self
            .get("keep_alive_tmo")
            .map(|v| parse_secs("keep_alive_tmo", v))
            .transpose()?
            .unwrap_or(Duration::from_secs(5));
        let recovery = Recovery {
            ctrl_loss_tmo: parse_tmo(self.get("ctrl_loss_tmo"), "ctrl_loss_tmo", Some(600))?,
            reconnect_delay: self
                .get("reconnect_delay")
                .map(|v| parse_secs("reconnect_delay", v))
                .transpose()?
                .unwrap_or(Duration::from_secs(10)),
            fast_io_fail_tmo: parse_tmo(self.get("fast_io_fail_tmo"), "fast_io_fail_tmo", None)?,
            identity: self
                .get("identity")
                .map(|v| v.parse().map_err(|e| format!("identity: {e}")))
                .transpose()?
                .unwrap_or_default(),
            replug_window: self
                .get("replug_window")
                .map(|v| parse_secs("replug_window", v))
                .transpose()?
                .unwrap_or(DEFAULT_REPLUG_WINDOW),
            safe_retry: self
                .get("safe_retry")
                .map(|v| v.parse().map_err(|e| format!("safe_retry: {e}")))
                .transpose()?
                .unwrap_or_default(),
        };
        let device: DeviceChoice = self
            .get("device")
            .map(|v| v.parse().map_err(|e| format!("device: {e}")))
            .transpose()?
            .unwrap_or_default();
        if let DeviceChoice::Kernel(d) = &device {
            if let TargetAddr::Builtin { .. } = target {
                return Err(format!(
                    "device={d} needs traddr=: the built-in target runs on the soft-HCA"
                ));
            }
            if self.get("chaos_reset_every").is_some() {
                return Err(format!(
                    "chaos_reset_every resets our own soft-HCA; with device={d} fault the device \
                     from outside (rdma link delete/add)"
                ));
            }
        }
        let chaos = self.chaos("chaos_reset_every", "chaos_down_for", FaultKind::Reset)?;
        Ok(CtrlOptions {
            key: CtrlKey {
                target,
                trsvcid,
                subnqn,
                hostnqn,
                device,
            },
            nr_io_queues,
            queue_size,
            keep_alive_tmo,
            recovery,
            chaos,
        })
    }

    /// How long the soft-HCAs this job starts (its host device, a built-in target) keep
    /// polling after packets move before they sleep; 0 turns polling off.
    pub fn busy_poll(&self) -> Result<Duration, String> {
        let d = self
            .get("busy_poll")
            .map(|v| parse_secs("busy_poll", v))
            .transpose()?
            .unwrap_or(nvmf_rdma::driver::TOOL_BUSY_POLL);
        if d > Duration::from_secs(1) {
            return Err(format!("busy_poll={d:?}: at most 1s"));
        }
        Ok(d)
    }

    /// Whether busy polling stops for a while when the polling thread is preempted
    /// (`nvmf_rdma::driver::set_busy_poll_gate`): 0 (default) or 1.
    pub fn busy_poll_gate(&self) -> Result<bool, String> {
        match self.get("busy_poll_gate") {
            None | Some("0") => Ok(false),
            Some("1") => Ok(true),
            Some(v) => Err(format!("busy_poll_gate={v}: 1 or 0")),
        }
    }

    /// Whether fio's I/O buffers are registered memory of the host queue (reads and writes
    /// then make no host copy): 1 (default) or 0 (plain memory, copied, as before).
    pub fn registered_buffers(&self) -> Result<bool, String> {
        match self.get("registered_buffers") {
            None | Some("1") => Ok(true),
            Some("0") => Ok(false),
            Some(v) => Err(format!("registered_buffers={v}: 1 or 0")),
        }
    }

    /// Threads of the engine's own runtime, 0 = fio's threads drive it (engine-wide; the
    /// first job's value wins).
    pub fn runtime_threads(&self) -> Result<usize, String> {
        let n = self
            .get("runtime_threads")
            .map(|v| parse_int::<usize>("runtime_threads", v))
            .transpose()?
            .unwrap_or(0);
        if n > 64 {
            return Err(format!("runtime_threads={n}: use 0..64"));
        }
        Ok(n)
    }
}

fn parse_int<T: std::str::FromStr>(key: &str, v: &str) -> Result<T, String> {
    v.parse::<T>()
        .map_err(|_| format!("{key}={v} is not a valid number"))
}

/// `2`, `2s`, `500ms`, `1m`: seconds unless a unit says otherwise.
pub fn parse_secs(key: &str, v: &str) -> Result<Duration, String> {
    let v = v.trim();
    let split = v
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(v.len());
    let (num, unit) = v.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("{key}={v}: expected a duration like 2, 2s or 500ms"))?;
    let scale = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "s" => 1.0,
        "ms" => 1e-3,
        "us" => 1e-6,
        "m" => 60.0,
        u => {
            return Err(format!(
                "{key}={v}: unknown unit '{u}' (use s, ms, us or m)"
            ))
        }
    };
    Duration::try_from_secs_f64(n * scale).map_err(|_| format!("{key}={v} is out of range"))
}

/// nvme-cli style timeouts: seconds, or -1 for forever/off.
fn parse_tmo(v: Option<&str>, key: &str, default: Option<u64>) -> Result<Option<Duration>, String> {
    match v {
        None => Ok(default.map(Duration::from_secs)),
        Some("-1") | Some("off") => Ok(None),
        Some(v) => parse_secs(key, v).map(Some),
    }
}

/// `1G`, `512M`, `65536`, `64k`: binary units, as fio's.
pub fn parse_size(key: &str, v: &str) -> Result<u64, String> {
    let v = v.trim();
    let split = v.find(|c: char| !c.is_ascii_digit()).unwrap_or(v.len());
    let (num, unit) = v.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{key}={v}: expected a size like 1G, 512M or 64k"))?;
    let mult: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        u => return Err(format!("{key}={v}: unknown size unit '{u}'")),
    };
    n.checked_mul(mult)
        .filter(|&b| b >= 1 << 20)
        .ok_or_else(|| format!("{key}={v}: use at least 1M"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(pairs: &[(&str, &str)]) -> OptionText {
        let mut t = OptionText::default();
        for (k, v) in pairs {
            t.set(k, v).unwrap();
        }
        t
    }

    #[test]
    fn spdk_style_filename_overrides_options() {
        let o = opts(&[("traddr", "10.0.0.1"), ("subnqn", DEMO_NQN), ("ns", "3")]);
        let f = o
            .with_filename("trtype=RDMA adrfam=IPv4 traddr=127.0.0.1 trsvcid=4421 ns=2")
            .unwrap()
            .file_target()
            .unwrap();
        assert_eq!(f.nsid, 2);
        assert_eq!(
            f.ctrl.key.target,
            TargetAddr::Remote("127.0.0.1:4791".parse().unwrap())
        );
        assert_eq!(f.ctrl.key.trsvcid, 4421);
        assert_eq!(
            f.ctrl.recovery.ctrl_loss_tmo,
            Some(Duration::from_secs(600))
        );
        assert_eq!(f.ctrl.recovery.fast_io_fail_tmo, None);
    }

    #[test]
    fn builtin_target_defaults() {
        let f = opts(&[("builtin_target", "256M")])
            .with_filename("ns=1")
            .unwrap()
            .file_target()
            .unwrap();
        assert_eq!(
            f.ctrl.key.target,
            TargetAddr::Builtin {
                bytes: 256 << 20,
                ports: 1,
                port: 0
            }
        );
        assert_eq!(f.second, None);
        assert_eq!(f.ctrl.key.subnqn, DEMO_NQN);
        assert_eq!((f.ctrl.nr_io_queues, f.ctrl.queue_size), (1, 128));
    }

    #[test]
    fn a_second_path_on_the_builtin_target_and_on_a_remote_one() {
        let f = opts(&[
            ("builtin_target", "64M"),
            ("builtin_ports", "2"),
            ("iopolicy", "round-robin"),
            ("chaos_reset_every", "2s"),
            ("chaos_unplug_every", "3s"),
            ("chaos_unplug_for", "500ms"),
        ])
        .with_filename("ns=1")
        .unwrap()
        .file_target()
        .unwrap();
        let port = |port| TargetAddr::Builtin {
            bytes: 64 << 20,
            ports: 2,
            port,
        };
        let p = f.second.expect("a second path");
        assert_eq!((f.ctrl.key.target, p.ctrl.key.target), (port(0), port(1)));
        assert_eq!(p.iopolicy, IoPolicy::RoundRobin);
        assert_eq!(f.ctrl.chaos.map(|c| c.kind), Some(FaultKind::Reset));
        assert_eq!(
            p.ctrl.chaos,
            Some(Chaos {
                kind: FaultKind::Unplug,
                every: Duration::from_secs(3),
                down_for: Duration::from_millis(500)
            })
        );

        let f = opts(&[
            ("traddr", "10.0.0.1"),
            ("subnqn", DEMO_NQN),
            ("traddr2", "10.0.0.2:4792"),
            ("trsvcid2", "4421"),
        ])
        .file_target()
        .unwrap();
        let p = f.second.expect("a second path");
        assert_eq!(
            p.ctrl.key.target,
            TargetAddr::Remote("10.0.0.2:4792".parse().unwrap())
        );
        assert_eq!((f.ctrl.key.trsvcid, p.ctrl.key.trsvcid), (4420, 4421));
        assert_eq!(p.iopolicy, IoPolicy::Failover);
        assert_eq!(p.ctrl.key.subnqn, f.ctrl.key.subnqn);
    }

    #[test]
    fn safe_retry_defaults_to_ccr_and_takes_the_three_modes() {
        use nvmf_rdma::reconnect::hold::SafeRetry;
        let mode = |v: Option<&str>| {
            let mut pairs = vec![("builtin_target", "16M")];
            pairs.extend(v.map(|v| ("safe_retry", v)));
            opts(&pairs)
                .with_filename("ns=1")
                .and_then(|o| o.file_target())
                .map(|f| f.ctrl.recovery.safe_retry)
        };
        assert_eq!(mode(None), Ok(SafeRetry::Ccr));
        assert_eq!(mode(Some("cqt")), Ok(SafeRetry::Cqt));
        assert_eq!(mode(Some("off")), Ok(SafeRetry::Off));
        assert!(mode(Some("later")).unwrap_err().contains("safe_retry"));
    }

    #[test]
    fn bad_input_is_a_message() {
        let base = opts(&[("builtin_target", "1G")]);
        for (name, want) in [
            ("ns", "not key=value"),
            ("ns=0", "namespace IDs"),
            ("ns=x", "not a valid number"),
            ("trtype=TCP", "not supported"),
            ("color=red", "unknown key"),
            ("queue_size=8", "16..1024"),
            ("nr_io_queues=0", "1..128"),
            ("builtin_target=1Q", "unknown size unit"),
            ("traddr=1.2.3.4", "not both"),
            ("ctrl_loss_tmo=soon", "duration"),
            ("chaos_reset_every=0", "more than 0"),
            ("builtin_ports=3", "use 1 or 2"),
            ("builtin_ports=2 iopolicy=random", "unknown iopolicy"),
            ("iopolicy=round-robin", "second path"),
            ("chaos_unplug_every=1s", "second path"),
            ("traddr2=10.0.0.2", "traddr2 needs traddr"),
            (
                "builtin_ports=2 chaos_unplug_every=1s chaos_freeze_every=1s",
                "not both",
            ),
        ] {
            let e = base
                .with_filename(name)
                .and_then(|t| t.file_target())
                .unwrap_err();
            assert!(e.contains(want), "{name}: {e}");
        }
        let long = format!("subnqn=nqn.{}", "x".repeat(300));
        let e = base
            .with_filename(&long)
            .unwrap()
            .ctrl_options()
            .unwrap_err();
        assert!(e.contains("subnqn") && e.contains("223"), "{e}");
        let e = OptionText::default().ctrl_options().unwrap_err();
        assert!(e.contains("no target"), "{e}");
        let e = opts(&[("traddr", "127.0.0.1")]).ctrl_options().unwrap_err();
        assert!(e.contains("subnqn"), "{e}");
    }

    #[test]
    fn durations_and_chaos() {
        assert_eq!(parse_secs("k", "2").unwrap(), Duration::from_secs(2));
        assert_eq!(
            parse_secs("k", "500ms").unwrap(),
            Duration::from_millis(500)
        );
        assert_eq!(
            parse_secs("k", "1.5s").unwrap(),
            Duration::from_millis(1500)
        );
        let c = opts(&[
            ("builtin_target", "1G"),
            ("chaos_reset_every", "2s"),
            ("chaos_down_for", "100ms"),
            ("ctrl_loss_tmo", "-1"),
        ])
        .ctrl_options()
        .unwrap();
        assert_eq!(
            c.chaos,
            Some(Chaos {
                kind: FaultKind::Reset,
                every: Duration::from_secs(2),
                down_for: Duration::from_millis(100)
            })
        );
        assert_eq!(c.recovery.ctrl_loss_tmo, None);
    }
}

//! Pieces of the command line that are worth testing on their own: address parsing, the
//! local address towards a peer, and the control socket of a running `connect`.

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::path::PathBuf;
use std::time::Duration;

use crate::cli::wire_json::JsonObj;
use crate::reconnect::{CtrlState, Policy};
use crate::transport::CtrlStatus;

/// The UDP port a soft-HCA (like any RoCEv2 device) listens on unless told otherwise.
pub const DEFAULT_ROCE_PORT: u16 = crate::hca::device::ROCE_V2_PORT;
pub use crate::hca::device::roce_peer;

/// A soft-HCA device `name` on `addr`, the `n`th of this process. The MAC is locally
/// administered and random per process: it (and the GUID made from it) goes out in every
/// CM REQ and REP, so it must tell a peer nothing (no PID), yet differ between processes on
/// one IP, as the CM tells connections apart by it. Towards a RoCEv2 peer (rxe, a NIC) the
/// device speaks to UDP port 4791 and checks ICRCs against the real IP header
/// ([`icrc_check_for`]; see docs/wire.md, "ICRC").
pub fn soft_device_config(name: &str, addr: SocketAddr, n: u8) -> crate::hca::DeviceConfig {
    use crate::hca::device::DeviceIdentity;
    let r: [u8; 3] = rand::random();
    let mac = [0x52, 0x54, r[0], r[1], r[2], n];
    let roce = roce_peer(addr.ip());
    crate::hca::DeviceConfig {
        identity: DeviceIdentity::from_mac(name, mac, crate::verbs::PciAddr::new(0, 0x30, n, 0)),
        addr,
        icrc: icrc_check_for(addr.ip(), std::env::var(ICRC_ENV).ok().as_deref()),
        peer_port: roce.then_some(DEFAULT_ROCE_PORT),
        // Only the simulator seeds a device; this one draws from the OS CSPRNG.
        seed: 0,
    }
}

/// The environment variable that chooses how a device facing RoCEv2 peers checks ICRCs:
/// `auto` (the default: against the real IP header read off a raw socket, unchecked with a
/// warning without CAP_NET_RAW), `raw` (the raw socket or no device), `skip` (never).
pub const ICRC_ENV: &str = "NVMF_RDMA_ICRC";

/// How a device bound to `ip` checks received ICRCs, given [`ICRC_ENV`]'s value. Soft-HCA
/// peers (loopback) send IP identification 0, so their ICRCs are always verified; RoCEv2
/// peers number their datagrams, so theirs need the real header. An unknown value is
/// taken as `auto`.
pub fn icrc_check_for(ip: IpAddr, env: Option<&str>) -> crate::hca::IcrcCheck {
    use crate::hca::IcrcCheck;
    if !roce_peer(ip) {
        return IcrcCheck::Verify;
    }
    match env {
        Some("skip") => IcrcCheck::Skip,
        Some("raw") => IcrcCheck::RealHeader { required: true },
        _ => IcrcCheck::RealHeader { required: false },
    }
}

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

/// Parse a duration: `500ms`, `2s`, `1.5s`, `2` (seconds), `100us`, `1m`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num
        .parse()
        .map_err(|_| format!("'{s}' is not a duration (try 500ms, 2s, 1m)"))?;
    let mult = match unit.trim() {
        "" | "s" => 1.0,
        "ms" => 1e-3,
        "us" => 1e-6,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        u => {
            return Err(format!(
                "unknown unit '{u}' in '{s}': use us, ms, s, m or h"
            ))
        }
    };
    let secs = v * mult;
    if !secs.is_finite() || secs > 1e7 {
        return Err(format!("duration '{s}' out of range"));
    }
    Ok(Duration::from_secs_f64(secs))
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

/// Where the host's soft-HCA binds to reach `target`: `host_traddr` when given (nvme-cli's
/// `--host-traddr`), else the local address that routes there, on port 4791 towards a
/// RoCEv2 peer (it sends every response there) and any free port on loopback.
pub fn host_bind_addr(
    target: SocketAddr,
    host_traddr: Option<SocketAddr>,
) -> std::io::Result<SocketAddr> {
    if let Some(a) = host_traddr {
        return Ok(a);
    }
    let ip = local_ip_for(target)?;
    let port = if roce_peer(target.ip()) {
        DEFAULT_ROCE_PORT
    } else {
        0
    };
    Ok(SocketAddr::new(ip, port))
}

/// `--mlock`: lock every page the process has and will map (`mlockall(MCL_CURRENT |
/// MCL_FUTURE)`), so the recovery path never waits for a page fault. Returns the
/// RLIMIT_MEMLOCK that still applies (`None`: unlimited, or ignored under CAP_IPC_LOCK);
/// with MCL_FUTURE, allocations past it fail.
pub fn lock_all_memory() -> Result<Option<u64>, String> {
    let limit = memlock_limit();
    // SAFETY: mlockall takes flags only and touches no memory of ours.
    let r = unsafe { libc::mlockall(libc::MCL_CURRENT | libc::MCL_FUTURE) };
    if r != 0 {
        let e = std::io::Error::last_os_error();
        return Err(mlock_error(&e, limit));
    }
    Ok(limit.filter(|_| !has_cap_ipc_lock()))
}

/// The soft RLIMIT_MEMLOCK in bytes; `None` when unlimited or unknown.
fn memlock_limit() -> Option<u64> {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct we pass and nothing else.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut l) } == 0;
    (ok && l.rlim_cur != libc::RLIM_INFINITY).then_some(l.rlim_cur)
}

/// CAP_IPC_LOCK (bit 14) in the effective set: RLIMIT_MEMLOCK does not apply.
fn has_cap_ipc_lock() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .is_some_and(|caps| caps & (1 << 14) != 0)
}

/// Why `mlockall` failed, and what to do about it.
pub fn mlock_error(e: &std::io::Error, limit: Option<u64>) -> String {
    let lim = match limit {
        Some(b) => format!("{b} bytes"),
        None => "unlimited".into(),
    };
    let fix = "raise it (ulimit -l unlimited, or LimitMEMLOCK=infinity under systemd) \
               or grant CAP_IPC_LOCK";
    match e.raw_os_error() {
        Some(libc::ENOMEM) => format!(
            "--mlock: mlockall failed ({e}): the process maps more than RLIMIT_MEMLOCK \
             ({lim}) allows; {fix}"
        ),
        Some(libc::EPERM) => format!(
            "--mlock: mlockall not permitted ({e}): RLIMIT_MEMLOCK is {lim} and the process \
             lacks CAP_IPC_LOCK; {fix}"
        ),
        _ => format!("--mlock: mlockall failed: {e} (RLIMIT_MEMLOCK {lim})"),
    }
}

/// An error and its causes on one line, outermost first, each cause once: a cause whose text
/// the line already holds (a message that quotes its source) is not written again.
pub fn error_line(e: &(dyn std::error::Error + 'static)) -> String {
    let mut line = String::new();
    let mut cur = Some(e);
    while let Some(err) = cur {
        let text = err.to_string();
        if !text.is_empty() && !line.contains(&text) {
            if !line.is_empty() {
                line.push_str(": ");
            }
            line.push_str(&text);
        }
        cur = err.source();
    }
    line
}

/// A message of several lines as one line (its lines joined by "; ", blank ones left out):
/// protocols that carry one answer per line carry errors this way.
pub fn one_line(s: &str) -> String {
    s.split('\n')
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ")
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
    /// live, resetting, connecting, deleting, dead (Linux's names).
    pub state: String,
    pub io_queues: usize,
    pub namespaces: Vec<(u32, u32, u64)>,
    pub model: String,
    pub serial: String,
    pub health: Health,
    /// Safe retry's mode and holds.
    pub safe_retry: crate::transport::SafeRetryStatus,
}

/// The recovery side of a controller, as `list` shows it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Health {
    /// Cause of the last failure (`device-fatal`, `keep-alive-lost`, ...).
    pub cause: Option<String>,
    /// Reconnect attempts in the current (or last) episode.
    pub attempt: u32,
    /// The attempt budget; `None`: unbounded (ctrl_loss_tmo -1).
    pub max_attempts: Option<u32>,
    /// Time left before ctrl_loss_tmo deletes the controller; only while recovering, and
    /// `None` then too when ctrl_loss_tmo is -1.
    pub loss_in: Option<Duration>,
    pub recoveries: u64,
    /// Failure to LIVE, of the last completed recovery.
    pub last_recovery: Option<Duration>,
    pub device_present: bool,
    /// A card that is not ours (other GUID / PCI address) showed up in the slot.
    pub foreign_device: bool,
    /// fast_io_fail_tmo passed: I/O fails at once while the controller keeps trying.
    pub failfast: bool,
    /// Why pending I/O was failed (fast_io_fail_tmo, ctrl_loss_tmo, ...).
    pub fail_reason: Option<String>,
    /// While waiting between attempts: when the next one goes (the pacing gap after failed
    /// attempts with reconnect_delay 0, or reconnect_delay).
    pub next_attempt_in: Option<Duration>,
}

/// Is `state` one of the recovering states (resetting, connecting)?
pub fn recovering(state: &str) -> bool {
    state == CtrlState::Resetting.name() || state == CtrlState::Connecting.name()
}

fn ms(d: Duration) -> String {
    format!("{:.3}", d.as_secs_f64() * 1e3)
}

pub fn human_duration(d: Duration) -> String {
    if d >= Duration::from_secs(10) {
        format!("{} s", d.as_secs())
    } else if d >= Duration::from_secs(1) {
        format!("{:.1} s", d.as_secs_f64())
    } else if d >= Duration::from_millis(1) {
        format!("{:.1} ms", d.as_secs_f64() * 1e3)
    } else {
        format!("{} us", d.as_micros())
    }
}

impl Health {
    /// The state name and the health of a controller, from its status.
    pub fn from_status(st: &CtrlStatus) -> (String, Health) {
        let m = &st.machine;
        let state = m.state.name().to_string();
        let h = Health {
            cause: m.cause.map(|c| c.name().to_string()),
            attempt: m.attempt,
            max_attempts: m.max_attempts,
            loss_in: if recovering(&state) { m.loss_in } else { None },
            recoveries: m.recoveries,
            last_recovery: st.last_recovery,
            device_present: m.device_present,
            foreign_device: m.foreign_device,
            failfast: m.failfast,
            fail_reason: m.fail_reason.map(|r| r.name().to_string()),
            next_attempt_in: if recovering(&state) {
                m.next_attempt_in
            } else {
                None
            },
        };
        (state, h)
    }

    /// "attempt N of M" (M is "inf" without a budget).
    pub fn attempts(&self) -> String {
        match self.max_attempts {
            Some(m) => format!("attempt {} of {m}", self.attempt),
            None => format!("attempt {} of inf", self.attempt),
        }
    }

    /// One line for `list`: what the controller is doing about failures, and how it went.
    pub fn describe(&self, state: &str) -> String {
        let mut parts = Vec::new();
        if recovering(state) {
            let mut p = format!(
                "cause {}, {}",
                self.cause.as_deref().unwrap_or("-"),
                self.attempts()
            );
            if let Some(d) = self.next_attempt_in {
                p += &format!(", next attempt in {}", human_duration(d));
            }
            match self.loss_in {
                Some(d) => p += &format!(", ctrl_loss_tmo in {}", human_duration(d)),
                None => p += ", ctrl_loss_tmo off",
            }
            if self.failfast {
                p += ", failing I/O fast";
            }
            parts.push(p);
        } else if let Some(r) = &self.fail_reason {
            parts.push(format!(
                "failed: {r} (cause {}, {})",
                self.cause.as_deref().unwrap_or("-"),
                self.attempts()
            ));
        } else if let Some(c) = &self.cause {
            parts.push(format!("last failure {c}"));
        }
        let mut r = format!("recoveries {}", self.recoveries);
        if let Some(d) = self.last_recovery {
            r += &format!(" (the last took {})", human_duration(d));
        }
        parts.push(r);
        let mut d = String::from(if self.device_present {
            "device present"
        } else {
            "device absent"
        });
        if self.foreign_device {
            d += ", foreign device seen";
        }
        parts.push(d);
        parts.join("; ")
    }

    fn write_json(&self, o: &mut JsonObj) {
        let opt_str = |v: &Option<String>| v.as_deref().map_or("null".to_string(), quote_str);
        let opt_num = |v: Option<u64>| v.map_or("null".to_string(), |n| n.to_string());
        let opt_ms = |v: Option<Duration>| v.map_or("null".to_string(), ms);
        o.raw("cause", &opt_str(&self.cause))
            .num("attempt", self.attempt as u64)
            .raw("max_attempts", &opt_num(self.max_attempts.map(u64::from)))
            .raw("ctrl_loss_in_ms", &opt_ms(self.loss_in))
            .num("recoveries", self.recoveries)
            .raw("last_recovery_ms", &opt_ms(self.last_recovery))
            .raw("device_present", bool_str(self.device_present))
            .raw("foreign_device", bool_str(self.foreign_device))
            .raw("failfast", bool_str(self.failfast))
            .raw("fail_reason", &opt_str(&self.fail_reason))
            .raw("next_attempt_in_ms", &opt_ms(self.next_attempt_in));
    }

    /// Read the fields back from a controller's JSON (missing ones keep their defaults, as
    /// from an older `connect`).
    pub fn from_json(j: &str) -> Health {
        let s = |k| {
            json_field(j, k)
                .filter(|v| *v != "null")
                .map(str::to_string)
        };
        let n = |k| json_field(j, k).and_then(|v| v.trim().parse::<u64>().ok());
        let d = |k| {
            json_field(j, k)
                .and_then(|v| v.trim().parse::<f64>().ok())
                .filter(|v| v.is_finite() && *v >= 0.0)
                .map(|v| Duration::from_secs_f64(v / 1e3))
        };
        let b = |k| json_field(j, k).is_some_and(|v| v.trim() == "true");
        Health {
            cause: s("cause"),
            attempt: n("attempt").unwrap_or(0) as u32,
            max_attempts: n("max_attempts").map(|m| m.min(u32::MAX as u64) as u32),
            loss_in: d("ctrl_loss_in_ms"),
            recoveries: n("recoveries").unwrap_or(0),
            last_recovery: d("last_recovery_ms"),
            device_present: json_field(j, "device_present").is_none_or(|v| v.trim() == "true"),
            foreign_device: b("foreign_device"),
            failfast: b("failfast"),
            fail_reason: s("fail_reason"),
            next_attempt_in: d("next_attempt_in_ms"),
        }
    }
}

fn bool_str(b: bool) -> &'static str {
    if b {
        "true"
    } else {
        "false"
    }
}

fn quote_str(s: &str) -> String {
    crate::cli::wire_json::quote(s)
}

/// The value of `key` in a flat JSON object: a string's contents, or a number, `true`,
/// `false`, `null` as written.
pub fn json_field<'a>(j: &'a str, key: &str) -> Option<&'a str> {
    let k = format!("\"{key}\":");
    let i = j.find(&k)? + k.len();
    let rest = &j[i..];
    if let Some(r) = rest.strip_prefix('"') {
        r.find('"').map(|e| &r[..e])
    } else {
        let e = rest.find([',', '}']).unwrap_or(rest.len());
        Some(&rest[..e])
    }
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
        self.health.write_json(&mut o);
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
        o.str("safe_retry", self.safe_retry.mode.name());
        let holds: Vec<String> = self
            .safe_retry
            .holds
            .iter()
            .map(|h| {
                let mut j = JsonObj::new();
                j.num("cntlid", u64::from(h.instance.cntlid))
                    .num("ciu", u64::from(h.instance.ciu))
                    .num("held", h.held as u64)
                    .str("released_by", h.by.name())
                    .raw("time_left_ms", &ms(h.time_left));
                j.finish()
            })
            .collect();
        o.raw("holds", &format!("[{}]", holds.join(",")));
        o.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reconnect::{Cause, FailReason, Status};

    #[derive(Debug, thiserror::Error)]
    #[error("fuse mount at /mnt/x: {0}")]
    struct Quoting(#[source] std::io::Error);

    #[test]
    fn an_error_line_names_each_cause_once() {
        let io = || std::io::Error::from_raw_os_error(libc::EACCES);
        let e = anyhow::Error::new(Quoting(io())).context("connect nvmf0");
        assert_eq!(
            error_line(e.as_ref()),
            "connect nvmf0: fuse mount at /mnt/x: Permission denied (os error 13)"
        );
        let e = anyhow::Error::new(io()).context("open /dev/fuse");
        assert_eq!(
            error_line(e.as_ref()),
            "open /dev/fuse: Permission denied (os error 13)"
        );
    }

    fn status(state: CtrlState) -> CtrlStatus {
        CtrlStatus {
            machine: Status {
                state,
                cause: Some(Cause::DeviceFatal),
                attempt: 3,
                failed_attempts: 2,
                max_attempts: Some(60),
                next_attempt_in: Some(Duration::from_millis(40)),
                loss_in: Some(Duration::from_secs(571)),
                device_present: false,
                foreign_device: true,
                failfast: false,
                recoveries: 2,
                episodes: 3,
                fail_reason: None,
            },
            cntlid: 1,
            at: crate::verbs::Instant(0),
            last_recovery: Some(Duration::from_micros(48_250)),
            last_trace: None,
        }
    }

    fn info(state: &str, health: Health) -> CtrlInfo {
        CtrlInfo {
            name: "nvmf0".into(),
            subnqn: "nqn.a:b".into(),
            hostnqn: "nqn.h".into(),
            traddr: "127.0.0.1:4791".into(),
            trsvcid: 4420,
            cntlid: 1,
            state: state.into(),
            io_queues: 2,
            namespaces: vec![(1, 512, 1024)],
            model: "m".into(),
            serial: "s".into(),
            health,
            safe_retry: crate::transport::SafeRetryStatus {
                mode: crate::transport::SafeRetry::Cqt,
                holds: vec![crate::transport::HoldStatus {
                    instance: crate::transport::CtrlInstance {
                        cntlid: 9,
                        ciu: 4,
                        cirn: 77,
                    },
                    held: 2,
                    by: crate::transport::ReleasedBy::Time,
                    time_left: Duration::from_millis(1500),
                }],
            },
        }
    }

    #[test]
    fn safe_retry_holds_reach_the_protocols_controller_object() {
        let j = info("live", Health::default()).to_json();
        let c: crate::daemon::proto::ControllerInfo = serde_json::from_str(&j).unwrap();
        assert_eq!(c.safe_retry, "cqt");
        assert_eq!(
            c.holds,
            vec![crate::daemon::proto::HoldInfo {
                cntlid: 9,
                ciu: 4,
                held: 2,
                released_by: "time".into(),
                time_left_ms: 1500.0,
            }]
        );
    }

    #[test]
    fn health_of_a_recovering_controller_round_trips_and_reads_well() {
        let (state, h) = Health::from_status(&status(CtrlState::Connecting));
        assert_eq!(state, "connecting");
        let j = info(&state, h.clone()).to_json();
        assert!(
            j.contains(r#""max_attempts":60,"ctrl_loss_in_ms":571000.000,"#),
            "{j}"
        );
        assert!(
            j.contains(r#""device_present":false,"foreign_device":true"#),
            "{j}"
        );
        assert_eq!(json_field(&j, "state"), Some("connecting"));
        assert_eq!(Health::from_json(&j), h);
        assert_eq!(
            h.describe(&state),
            "cause device-fatal, attempt 3 of 60, next attempt in 40.0 ms, \
             ctrl_loss_tmo in 571 s; recoveries 2 (the last took 48.2 ms); device absent, \
             foreign device seen"
        );
        assert!(j.contains(r#""next_attempt_in_ms":40.000"#), "{j}");
    }

    #[test]
    fn health_when_live_dead_or_unbounded() {
        let mut st = status(CtrlState::Live);
        st.machine.device_present = true;
        st.machine.foreign_device = false;
        let (state, h) = Health::from_status(&st);
        assert_eq!(h.loss_in, None, "no countdown while live");
        assert_eq!(
            h.describe(&state),
            "last failure device-fatal; recoveries 2 (the last took 48.2 ms); device present"
        );
        let mut st = status(CtrlState::Connecting);
        st.machine.max_attempts = None;
        st.machine.loss_in = None;
        st.machine.next_attempt_in = None;
        let (state, h) = Health::from_status(&st);
        assert!(h
            .describe(&state)
            .starts_with("cause device-fatal, attempt 3 of inf, ctrl_loss_tmo off;"));
        let j = info(&state, h.clone()).to_json();
        assert!(
            j.contains(r#""max_attempts":null,"ctrl_loss_in_ms":null"#),
            "{j}"
        );
        assert_eq!(Health::from_json(&j), h);
        let mut st = status(CtrlState::Dead);
        st.machine.fail_reason = Some(FailReason::CtrlLoss);
        let (state, h) = Health::from_status(&st);
        assert_eq!(
            h.describe(&state).split(';').next().unwrap(),
            "failed: ctrl_loss_tmo expired (cause device-fatal, attempt 3 of 60)"
        );
        assert_eq!(Health::from_json(&info(&state, h.clone()).to_json()), h);
    }

    #[test]
    fn fields_from_json() {
        let j = r#"{"name":"nvmf0","cntlid":3,"subnqn":"nqn.x","max_attempts":7}"#;
        assert_eq!(json_field(j, "name"), Some("nvmf0"));
        assert_eq!(json_field(j, "cntlid"), Some("3"));
        assert_eq!(json_field(j, "attempts"), None);
        assert_eq!(json_field(j, "nope"), None);
        // An older `connect` without health fields: defaults.
        assert_eq!(
            Health::from_json(j),
            Health {
                device_present: true,
                max_attempts: Some(7),
                ..Health::default()
            }
        );
    }

    #[test]
    fn mlock_errors_say_what_to_do() {
        let e = std::io::Error::from_raw_os_error(libc::ENOMEM);
        let m = mlock_error(&e, Some(8 << 20));
        assert!(m.contains("RLIMIT_MEMLOCK (8388608 bytes)"), "{m}");
        assert!(
            m.contains("ulimit -l unlimited") && m.contains("CAP_IPC_LOCK"),
            "{m}"
        );
        let e = std::io::Error::from_raw_os_error(libc::EPERM);
        assert!(mlock_error(&e, Some(0)).contains("not permitted"));
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("2"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("100us"), Ok(Duration::from_micros(100)));
        assert_eq!(parse_duration("1m"), Ok(Duration::from_secs(60)));
        assert!(parse_duration("2 weeks").is_err());
        assert!(parse_duration("-1s").is_err());
        assert!(parse_duration("ms").is_err());
        assert!(parse_duration("1e300h").is_err());
    }

    #[test]
    fn seconds_and_timeouts() {
        assert_eq!(parse_tmo("-1"), Ok(Tmo(None)));
        assert_eq!(parse_tmo("5"), Ok(Tmo(Some(Duration::from_secs(5)))));
        assert!(parse_tmo("-3").is_err());
        assert_eq!(Tmo(None).to_string(), "-1");
        assert_eq!(parse_secs("0"), Ok(0));
        assert!(parse_secs("-1").unwrap_err().contains(">= 0"));
        assert!(parse_pos_secs("0").is_err());
        assert_eq!(parse_pos_secs("30"), Ok(30));
    }
}

//! The daemon's control protocol, version 1: JSON lines over a unix socket
//! (`docs/control-protocol.md`). One request object per line, one answer object per line, in
//! order; a bad line gets an error answer and the connection goes on. Requests and answers
//! are typed here; serde reads and writes them, and an unknown field is refused.

use serde::{de::DeserializeOwned, Deserialize, Serialize};
use serde_json::{Map, Value};

pub use crate::daemon::answers::*;

/// The protocol version this build speaks; requests carry it in `version`.
pub const PROTOCOL_VERSION: u64 = 1;
/// Longest request line in bytes (newline included); a longer one is answered with
/// `line-too-long` and skipped up to its newline.
pub const MAX_LINE: usize = 16 << 10;
/// Most bytes one `read` answer carries (the CLI asks piece by piece for more).
pub const MAX_READ: usize = 1 << 20;
/// Most bytes one `write` request carries in `data` (its base64 must fit in [`MAX_LINE`]).
pub const MAX_WRITE_DATA: usize = 8 << 10;
/// Most bytes one `write` with `pattern` fills (the daemon makes that buffer).
pub const MAX_WRITE_PATTERN: usize = 1 << 20;
/// Most bytes one `read-to-fd` or `write-from-fd` moves (the namespace bounds it too).
pub const MAX_FD_IO: u64 = 1 << 40;
/// Most bytes one `verify` covers, and its largest `chunk` (the buffer the daemon makes).
pub const MAX_VERIFY: u64 = 1 << 30;
pub const MAX_VERIFY_CHUNK: usize = 1 << 20;

/// The socket's file name in the run directory.
pub const SOCKET_NAME: &str = "daemon.sock";

/// What `connect` (and each configured controller) asks for: nvme-cli's fabrics arguments
/// with their names, our policy knobs, and the exports. Absent fields take `connect`'s
/// defaults.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConnectParams {
    /// "rdma" (the only one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transport: Option<String>,
    /// IP (RoCEv2 port 4791) or IP:PORT.
    pub traddr: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trsvcid: Option<u16>,
    /// Subsystem NQN.
    pub nqn: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostnqn: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostid: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_traddr: Option<String>,
    /// The host's RDMA device: "soft" (default) or a kernel device (rxe0, guid:..., pci:...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nr_io_queues: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_size: Option<usize>,
    /// Seconds; 0 = off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep_alive_tmo: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reconnect_delay: Option<u64>,
    /// Seconds; -1 = forever.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ctrl_loss_tmo: Option<i64>,
    /// Seconds; -1 = off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fast_io_fail_tmo: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replug_window: Option<u64>,
    /// guid, pci, both, any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub io_timeout: Option<u64>,
    /// ccr, cqt or off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub safe_retry: Option<String>,
    /// Milliseconds of CQT assumed for a target that reports none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cqt_default: Option<u64>,
    /// Namespace the exports serve (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nsid: Option<u32>,
    /// NBD export: `unix:PATH` or `IP:PORT`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbd: Option<String>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub nbd_allow_remote: bool,
    /// FUSE export: the mount point (the file is MOUNTPOINT/ns<NSID>).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fuse: Option<String>,
    /// nvme-cli's `-D`: connect even if a controller to the same subsystem, address and host
    /// NQN exists.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub duplicate_connect: bool,
    /// failover, round-robin or queue-depth: the subsystem's I/O policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iopolicy: Option<String>,
}

impl ConnectParams {
    /// The same request as `connect`'s flags (how the daemon parses and checks it, so the
    /// defaults and error messages are the CLI's).
    pub fn to_args(&self) -> Vec<String> {
        let mut v: Vec<String> = Vec::new();
        let mut add = |k: &str, val: Option<String>| {
            if let Some(val) = val {
                v.push(k.into());
                v.push(val);
            }
        };
        add("-t", self.transport.clone());
        add("-a", Some(self.traddr.clone()));
        add("-s", self.trsvcid.map(|x| x.to_string()));
        add("-n", Some(self.nqn.clone()));
        add("-q", self.hostnqn.clone());
        add("-I", self.hostid.clone());
        add("-w", self.host_traddr.clone());
        add("--device", self.device.clone());
        add("-i", self.nr_io_queues.map(|x| x.to_string()));
        add("-Q", self.queue_size.map(|x| x.to_string()));
        add("-k", self.keep_alive_tmo.map(|x| x.to_string()));
        add("-c", self.reconnect_delay.map(|x| x.to_string()));
        add("-l", self.ctrl_loss_tmo.map(|x| x.to_string()));
        add("-F", self.fast_io_fail_tmo.map(|x| x.to_string()));
        add("--replug-window", self.replug_window.map(|x| x.to_string()));
        add("--identity", self.identity.clone());
        add("--io-timeout", self.io_timeout.map(|x| x.to_string()));
        add("--safe-retry", self.safe_retry.clone());
        add("--cqt-default", self.cqt_default.map(|x| x.to_string()));
        add("--nsid", self.nsid.map(|x| x.to_string()));
        add("--nbd", self.nbd.clone());
        add("--fuse", self.fuse.clone());
        if self.nbd_allow_remote {
            v.push("--nbd-allow-remote".into());
        }
        if self.duplicate_connect {
            v.push("-D".into());
        }
        if let Some(p) = &self.iopolicy {
            v.push("--iopolicy".into());
            v.push(p.clone());
        }
        v
    }
}

/// Why a request failed, as a stable word a script can branch on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ErrorCode {
    /// Not JSON, not an object, a missing or mistyped field, an unknown op.
    BadRequest,
    UnsupportedVersion,
    LineTooLong,
    /// No complete line within the client timeout.
    Timeout,
    /// Nothing matches the device or NQN given.
    NotFound,
    /// A controller to the same subsystem, address and host exists (use duplicate_connect).
    Duplicate,
    /// An export is in use (a loop device, an open file, NBD clients); use force.
    InUse,
    /// Connecting or starting an export failed.
    Failed,
    /// The daemon is stopping.
    Stopping,
    /// Too many clients at once.
    Busy,
    /// A code this build does not know (a newer daemon's).
    #[serde(other)]
    Other,
}

/// A failed request: a one-line message, what to do about it, and the code.
#[derive(Debug, Clone, PartialEq)]
pub struct ProtoError {
    pub code: ErrorCode,
    pub message: String,
    pub hint: Option<String>,
}

impl ProtoError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> ProtoError {
        ProtoError {
            code,
            message: one_line(&message.into()),
            hint: None,
        }
    }

    pub fn hint(mut self, hint: impl Into<String>) -> ProtoError {
        self.hint = Some(one_line(&hint.into()));
        self
    }
}

impl std::fmt::Display for ProtoError {
    /// The message with its hint, as the CLI prints a refusal.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.hint {
            Some(h) => write!(f, "{} ({h})", self.message),
            None => f.write_str(&self.message),
        }
    }
}

impl std::error::Error for ProtoError {}

/// Newlines would break the framing; an answer is one line whatever a cause said.
pub use crate::cli::support::one_line;

fn one() -> u32 {
    1
}

/// One request, without the `version` and `id` every request line carries.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Request {
    /// The daemon's pid, versions and controller count. (Variants without fields are
    /// written `{}` so that serde refuses unknown fields on them too.)
    Status {},
    List {},
    Connect {
        params: Box<ConnectParams>,
    },
    /// Discover at the address given (or every configured line when `None`) and connect
    /// what is not connected yet.
    ConnectAll {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        params: Option<Box<ConnectParams>>,
    },
    Disconnect {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        device: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        nqn: Option<String>,
        #[serde(default)]
        force: bool,
    },
    DisconnectAll {
        #[serde(default)]
        force: bool,
    },
    /// Stop the daemon (as a stop signal does).
    Stop {
        #[serde(default)]
        force: bool,
    },
    /// At most [`MAX_READ`] bytes; answered with `data` (base64).
    Read {
        device: String,
        #[serde(default = "one")]
        nsid: u32,
        #[serde(default)]
        lba: u64,
        size: u64,
    },
    /// `data` (base64, at most [`MAX_WRITE_DATA`] decoded), or `size` bytes of `pattern`.
    Write {
        device: String,
        #[serde(default = "one")]
        nsid: u32,
        #[serde(default)]
        lba: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        data: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        size: Option<u64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pattern: Option<u64>,
    },
    /// `size` bytes from the namespace into the descriptor sent with the request line
    /// (SCM_RIGHTS; a file or a pipe). Answered with `copied`.
    ReadToFd {
        device: String,
        #[serde(default = "one")]
        nsid: u32,
        #[serde(default)]
        lba: u64,
        size: u64,
        /// Send progress lines before the answer.
        #[serde(default)]
        progress: bool,
    },
    /// `size` bytes from the descriptor sent with the request line into the namespace.
    WriteFromFd {
        device: String,
        #[serde(default = "one")]
        nsid: u32,
        #[serde(default)]
        lba: u64,
        size: u64,
        #[serde(default)]
        progress: bool,
    },
    /// Write a seeded random pattern in `chunk` pieces, read each back, compare.
    Verify {
        device: String,
        #[serde(default = "one")]
        nsid: u32,
        #[serde(default)]
        lba: u64,
        size: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        chunk: Option<u64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        seed: Option<u64>,
    },
}

/// Block I/O a request asks for, checked against the protocol's bounds (`nsid`, `lba` in
/// blocks; sizes in bytes).
#[derive(Debug, Clone, PartialEq)]
pub enum IoRequest {
    Read {
        nsid: u32,
        lba: u64,
        size: usize,
    },
    Write {
        nsid: u32,
        lba: u64,
        data: Vec<u8>,
    },
    Verify {
        nsid: u32,
        lba: u64,
        size: u64,
        chunk: usize,
        seed: u64,
    },
    /// Between the namespace and a descriptor the client sent.
    Fd {
        dir: FdDir,
        nsid: u32,
        lba: u64,
        size: u64,
        progress: bool,
    },
}

/// Which way a descriptor's data goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FdDir {
    /// Namespace to descriptor.
    Read,
    /// Descriptor to namespace.
    Write,
}

fn bad(m: impl Into<String>) -> ProtoError {
    ProtoError::new(ErrorCode::BadRequest, m)
}

impl Request {
    /// The controller and the checked I/O of a `read`, `write` or `verify`; `None` for the
    /// other requests.
    pub fn io(&self) -> Result<Option<(String, IoRequest)>, ProtoError> {
        let io = match self {
            Request::Read {
                device,
                nsid,
                lba,
                size,
            } => (
                device,
                IoRequest::Read {
                    nsid: *nsid,
                    lba: *lba,
                    size: bounded(*size, MAX_READ, "read size")?,
                },
            ),
            Request::Write {
                device,
                nsid,
                lba,
                data,
                size,
                pattern,
            } => {
                let data = write_data(data.as_deref(), *size, *pattern)?;
                (
                    device,
                    IoRequest::Write {
                        nsid: *nsid,
                        lba: *lba,
                        data,
                    },
                )
            }
            Request::Verify {
                device,
                nsid,
                lba,
                size,
                chunk,
                seed,
            } => (
                device,
                IoRequest::Verify {
                    nsid: *nsid,
                    lba: *lba,
                    size: bounded(*size, MAX_VERIFY as usize, "verify size")? as u64,
                    chunk: bounded(chunk.unwrap_or(128 << 10), MAX_VERIFY_CHUNK, "verify chunk")?,
                    seed: seed.unwrap_or(1),
                },
            ),
            Request::ReadToFd {
                device,
                nsid,
                lba,
                size,
                progress,
            }
            | Request::WriteFromFd {
                device,
                nsid,
                lba,
                size,
                progress,
            } => {
                if !(1..=MAX_FD_IO).contains(size) {
                    return Err(bad(format!("size {size} is not 1..={MAX_FD_IO} bytes")));
                }
                let dir = match self {
                    Request::ReadToFd { .. } => FdDir::Read,
                    _ => FdDir::Write,
                };
                (
                    device,
                    IoRequest::Fd {
                        dir,
                        nsid: *nsid,
                        lba: *lba,
                        size: *size,
                        progress: *progress,
                    },
                )
            }
            _ => return Ok(None),
        };
        Ok(Some((io.0.clone(), io.1)))
    }

    /// The checks serde cannot make: a `connect` needs its params, a `disconnect` something
    /// to match, I/O its bounds.
    pub fn check(&self) -> Result<(), ProtoError> {
        if let Request::Disconnect {
            device: None,
            nqn: None,
            ..
        } = self
        {
            return Err(bad("disconnect needs \"device\" or \"nqn\""));
        }
        self.io().map(|_| ())
    }
}

/// What a `write` writes: its `data` decoded, or `size` bytes of `pattern`.
fn write_data(
    data: Option<&str>,
    size: Option<u64>,
    pattern: Option<u64>,
) -> Result<Vec<u8>, ProtoError> {
    match (data, size) {
        (Some(_), Some(n)) if n != 0 => Err(bad(
            "write takes \"data\" or \"size\" (with \"pattern\"), not both",
        )),
        (Some(d), _) => {
            use base64::Engine;
            let d = base64::engine::general_purpose::STANDARD
                .decode(d)
                .map_err(|e| bad(format!("\"data\" is not base64: {e}")))?;
            bounded(d.len() as u64, MAX_WRITE_DATA, "write data")?;
            Ok(d)
        }
        (None, size) => {
            let n = bounded(size.unwrap_or(0), MAX_WRITE_PATTERN, "write size")?;
            let p = u8::try_from(pattern.unwrap_or(0))
                .map_err(|_| bad("\"pattern\" is a byte (0-255)"))?;
            Ok(vec![p; n])
        }
    }
}

/// `n` if it is 1..=`max`, else the `bad-request` that says the bound.
fn bounded(n: u64, max: usize, what: &str) -> Result<usize, ProtoError> {
    match usize::try_from(n) {
        Ok(v) if (1..=max).contains(&v) => Ok(v),
        _ => Err(bad(format!("{what} {n} is not 1..={max} bytes"))
            .hint("split larger I/O into several requests (the CLI does)")),
    }
}

/// A request line: `(id, request)`, or the error to answer (with the id when it could be
/// read).
pub fn parse_request(line: &str) -> (Option<Value>, Result<Request, ProtoError>) {
    #[derive(Deserialize)]
    struct Envelope {
        #[serde(default)]
        id: Option<Value>,
        #[serde(default)]
        version: Option<Value>,
        #[serde(flatten)]
        rest: Map<String, Value>,
    }
    let env: Envelope = match serde_json::from_str(line) {
        Ok(e) => e,
        Err(e) if e.is_syntax() || e.is_eof() => {
            return (
                None,
                Err(bad(format!("not JSON: {e}"))
                    .hint("send one JSON object per line, e.g. {\"version\":1,\"op\":\"list\"}")),
            )
        }
        Err(_) => return (None, Err(bad("a request is a JSON object"))),
    };
    let r = match env.version {
        Some(Value::Number(n)) if n.as_u64() == Some(PROTOCOL_VERSION) => {
            serde_json::from_value::<Request>(Value::Object(env.rest))
                .map_err(|e| {
                    bad(e.to_string()).hint(
                        "ops: status, list, connect, connect-all, disconnect, disconnect-all, \
                         read, write, verify, read-to-fd, write-from-fd, stop \
                         (docs/control-protocol.md)",
                    )
                })
                .and_then(|r| r.check().map(|_| r))
        }
        Some(v) => Err(ProtoError::new(
            ErrorCode::UnsupportedVersion,
            format!("protocol version {v} is not supported"),
        )
        .hint(format!("this daemon speaks version {PROTOCOL_VERSION}"))),
        None => {
            Err(bad("no \"version\" field").hint(format!("add \"version\":{PROTOCOL_VERSION}")))
        }
    };
    (env.id, r)
}

/// The request line for `req` (with the version; no newline).
pub fn request_line(req: &Request) -> String {
    let mut v = serde_json::to_value(req).unwrap_or(Value::Null);
    if let Value::Object(m) = &mut v {
        m.insert("version".into(), PROTOCOL_VERSION.into());
    }
    v.to_string()
}

/// The answer line for a success: `{"version":1,"ok":true,...body}` (with `id` echoed).
pub fn ok_line(id: &Option<Value>, body: &impl Serialize) -> String {
    let mut m = Map::new();
    m.insert("version".into(), PROTOCOL_VERSION.into());
    if let Some(id) = id {
        m.insert("id".into(), id.clone());
    }
    m.insert("ok".into(), true.into());
    if let Ok(Value::Object(b)) = serde_json::to_value(body) {
        m.extend(b);
    }
    Value::Object(m).to_string()
}

/// The answer line for a failure.
pub fn err_line(id: &Option<Value>, e: &ProtoError) -> String {
    let a = Failure {
        version: PROTOCOL_VERSION,
        id: id.clone(),
        ok: false,
        code: e.code,
        error: e.message.clone(),
        hint: e.hint.clone(),
    };
    serde_json::to_string(&a).unwrap_or_default()
}

/// A failure answer as it goes on the wire.
#[derive(Debug, Serialize, Deserialize)]
struct Failure {
    version: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    id: Option<Value>,
    ok: bool,
    code: ErrorCode,
    error: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    hint: Option<String>,
}

/// Read an answer line: the body of a success as `T`, or the daemon's error.
pub fn parse_answer<T: DeserializeOwned>(line: &str) -> Result<T, AnswerError> {
    let v: Value = serde_json::from_str(line).map_err(|e| AnswerError::Garbled(e.to_string()))?;
    if v.get("ok") == Some(&Value::Bool(true)) {
        return serde_json::from_value(v).map_err(|e| AnswerError::Garbled(e.to_string()));
    }
    let f: Failure = serde_json::from_value(v).map_err(|e| AnswerError::Garbled(e.to_string()))?;
    Err(AnswerError::Refused(ProtoError {
        code: f.code,
        message: f.error,
        hint: f.hint,
    }))
}

/// An answer that is not the success asked for.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AnswerError {
    #[error("{0}")]
    Refused(ProtoError),
    #[error("the daemon's answer is not what this build understands: {0}")]
    Garbled(String),
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn requests_parse_and_bad_ones_say_why() {
        let (id, r) = parse_request(r#"{"version":1,"op":"list","id":7}"#);
        assert_eq!((id, r), (Some(json!(7)), Ok(Request::List {})));
        let (_, r) = parse_request(
            r#"{"version":1,"op":"connect","params":{"traddr":"127.0.0.1","nqn":"nqn.a:b","nr_io_queues":4,"fuse":"/mnt/x"}}"#,
        );
        let Ok(Request::Connect { params: p }) = r else {
            panic!("{r:?}")
        };
        assert_eq!(
            (p.nr_io_queues, p.fuse.as_deref()),
            (Some(4), Some("/mnt/x"))
        );
        let a = p.to_args();
        assert!(a.windows(2).any(|w| w == ["-i", "4"]), "{a:?}");
        for (line, code, word) in [
            ("nonsense", ErrorCode::BadRequest, "not JSON"),
            ("[1]", ErrorCode::BadRequest, "object"),
            (r#"{"op":"list"}"#, ErrorCode::BadRequest, "version"),
            (
                r#"{"version":2,"op":"list"}"#,
                ErrorCode::UnsupportedVersion,
                "2",
            ),
            (r#"{"version":1,"op":"fly"}"#, ErrorCode::BadRequest, "fly"),
            (
                r#"{"version":1,"op":"list","x":1}"#,
                ErrorCode::BadRequest,
                "x",
            ),
            (
                r#"{"version":1,"op":"disconnect"}"#,
                ErrorCode::BadRequest,
                "device",
            ),
            (
                r#"{"version":1,"op":"connect","params":{"traddr":"1.2.3.4","nqn":"n","queues":1}}"#,
                ErrorCode::BadRequest,
                "queues",
            ),
            (
                r#"{"version":1,"op":"read","lba":0,"size":4096}"#,
                ErrorCode::BadRequest,
                "device",
            ),
            (
                r#"{"version":1,"op":"read","device":"nvmf0","size":4294967296}"#,
                ErrorCode::BadRequest,
                "1..=1048576",
            ),
            (
                r#"{"version":1,"op":"read","device":"nvmf0","size":-1}"#,
                ErrorCode::BadRequest,
                "-1",
            ),
            (
                r#"{"version":1,"op":"write","device":"nvmf0","data":"%%%"}"#,
                ErrorCode::BadRequest,
                "base64",
            ),
            (
                r#"{"version":1,"op":"write","device":"nvmf0","size":99999999}"#,
                ErrorCode::BadRequest,
                "write size",
            ),
            (
                r#"{"version":1,"op":"write","device":"nvmf0","size":512,"pattern":256}"#,
                ErrorCode::BadRequest,
                "byte",
            ),
            (
                r#"{"version":1,"op":"verify","device":"nvmf0","size":4096,"chunk":0}"#,
                ErrorCode::BadRequest,
                "verify chunk",
            ),
        ] {
            let e = parse_request(line).1.expect_err(line);
            assert_eq!(e.code, code, "{line}");
            assert!(e.message.contains(word), "{line}: {}", e.message);
            let out = err_line(&None, &e);
            assert!(!out.contains('\n'));
            let v: Value = serde_json::from_str(&out).unwrap();
            assert_eq!(v["ok"], json!(false));
            assert_eq!(v["code"], serde_json::to_value(code).unwrap());
        }
    }

    #[test]
    fn a_request_goes_out_as_the_line_the_daemon_reads() {
        let req = Request::Disconnect {
            device: Some("nvmf0".into()),
            nqn: None,
            force: true,
        };
        let line = request_line(&req);
        assert_eq!(
            serde_json::from_str::<Value>(&line).unwrap(),
            json!({"version":1,"op":"disconnect","device":"nvmf0","force":true})
        );
        assert_eq!(parse_request(&line), (None, Ok(req)));
        let e = ProtoError::new(ErrorCode::InUse, "nvmf0 is in use").hint("losetup -d");
        assert_eq!(
            parse_answer::<DisconnectReply>(&err_line(&None, &e)),
            Err(AnswerError::Refused(e))
        );
        let ok = ok_line(
            &None,
            &DisconnectReply {
                disconnected: vec!["nvmf0".into()],
            },
        );
        assert_eq!(
            parse_answer::<DisconnectReply>(&ok).unwrap().disconnected,
            ["nvmf0"]
        );
    }
}

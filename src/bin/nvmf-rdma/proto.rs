//! The daemon's control protocol, version 1: JSON lines over a unix socket
//! (`docs/control-protocol.md`). One request object per line, one answer object per line, in
//! order; a bad line gets an error answer and the connection goes on.

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

/// The protocol version this build speaks; requests carry it in `version`.
pub(crate) const PROTOCOL_VERSION: u64 = 1;
/// Longest request line in bytes (newline included); a longer one is answered with
/// `line-too-long` and skipped up to its newline.
pub(crate) const MAX_LINE: usize = 16 << 10;
/// Most bytes one `read` answer carries (the CLI asks piece by piece for more).
pub(crate) const MAX_READ: usize = 1 << 20;
/// Most bytes one `write` request carries in `data` (its base64 must fit in [`MAX_LINE`]).
pub(crate) const MAX_WRITE_DATA: usize = 8 << 10;
/// Most bytes one `write` with `pattern` fills (the daemon makes that buffer).
pub(crate) const MAX_WRITE_PATTERN: usize = 1 << 20;
/// Most bytes one `verify` covers, and its largest `chunk` (the buffer the daemon makes).
pub(crate) const MAX_VERIFY: u64 = 1 << 30;
pub(crate) const MAX_VERIFY_CHUNK: usize = 1 << 20;

/// The socket's file name in the run directory.
pub(crate) const SOCKET_NAME: &str = "daemon.sock";

/// What `connect` (and each configured controller) asks for: nvme-cli's fabrics arguments
/// with their names, our policy knobs, and the exports. Absent fields take `connect`'s
/// defaults.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ConnectParams {
    /// "rdma" (the only one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) transport: Option<String>,
    /// IP (RoCEv2 port 4791) or IP:PORT.
    pub(crate) traddr: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) trsvcid: Option<u16>,
    /// Subsystem NQN.
    pub(crate) nqn: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) hostnqn: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) hostid: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) host_traddr: Option<String>,
    /// The host's RDMA device: "soft" (default) or a kernel device (rxe0, guid:..., pci:...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) device: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) nr_io_queues: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) queue_size: Option<usize>,
    /// Seconds; 0 = off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) keep_alive_tmo: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) reconnect_delay: Option<u64>,
    /// Seconds; -1 = forever.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) ctrl_loss_tmo: Option<i64>,
    /// Seconds; -1 = off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) fast_io_fail_tmo: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) replug_window: Option<u64>,
    /// guid, pci, both, any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) identity: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) io_timeout: Option<u64>,
    /// Namespace the exports serve (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) nsid: Option<u32>,
    /// NBD export: `unix:PATH` or `IP:PORT`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) nbd: Option<String>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(crate) nbd_allow_remote: bool,
    /// FUSE export: the mount point (the file is MOUNTPOINT/ns<NSID>).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) fuse: Option<String>,
    /// nvme-cli's `-D`: connect even if a controller to the same subsystem, address and host
    /// NQN exists.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(crate) duplicate_connect: bool,
}

impl ConnectParams {
    /// The same request as `connect` arguments (how the daemon parses and checks it, so the
    /// defaults and error messages are the CLI's).
    pub(crate) fn to_args(&self) -> Vec<String> {
        let mut v: Vec<String> = vec!["nvmf-rdma".into(), "connect".into()];
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
        add("--nsid", self.nsid.map(|x| x.to_string()));
        add("--nbd", self.nbd.clone());
        add("--fuse", self.fuse.clone());
        if self.nbd_allow_remote {
            v.push("--nbd-allow-remote".into());
        }
        if self.duplicate_connect {
            v.push("-D".into());
        }
        v
    }
}

/// Why a request failed, as a stable word a script can branch on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ErrorCode {
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
}

impl ErrorCode {
    pub(crate) fn name(self) -> &'static str {
        match self {
            ErrorCode::BadRequest => "bad-request",
            ErrorCode::UnsupportedVersion => "unsupported-version",
            ErrorCode::LineTooLong => "line-too-long",
            ErrorCode::Timeout => "timeout",
            ErrorCode::NotFound => "not-found",
            ErrorCode::Duplicate => "duplicate",
            ErrorCode::InUse => "in-use",
            ErrorCode::Failed => "failed",
            ErrorCode::Stopping => "stopping",
            ErrorCode::Busy => "busy",
        }
    }
}

/// A failed request: a one-line message, what to do about it, and the code.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ProtoError {
    pub(crate) code: ErrorCode,
    pub(crate) message: String,
    pub(crate) hint: Option<String>,
}

impl ProtoError {
    pub(crate) fn new(code: ErrorCode, message: impl Into<String>) -> ProtoError {
        ProtoError {
            code,
            message: one_line(&message.into()),
            hint: None,
        }
    }

    pub(crate) fn hint(mut self, hint: impl Into<String>) -> ProtoError {
        self.hint = Some(one_line(&hint.into()));
        self
    }
}

/// Newlines would break the framing; an answer is one line whatever a cause said.
pub(crate) fn one_line(s: &str) -> String {
    s.split('\n')
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}

/// The answer line for a success: `{"version":1,"ok":true,...body}` (with `id` echoed).
pub(crate) fn ok_line(id: &Option<Value>, body: Map<String, Value>) -> String {
    let mut m = Map::new();
    m.insert("version".into(), json!(PROTOCOL_VERSION));
    if let Some(id) = id {
        m.insert("id".into(), id.clone());
    }
    m.insert("ok".into(), json!(true));
    m.extend(body);
    Value::Object(m).to_string()
}

/// The answer line for a failure.
pub(crate) fn err_line(id: &Option<Value>, e: &ProtoError) -> String {
    let mut m = Map::new();
    m.insert("version".into(), json!(PROTOCOL_VERSION));
    if let Some(id) = id {
        m.insert("id".into(), id.clone());
    }
    m.insert("ok".into(), json!(false));
    m.insert("code".into(), json!(e.code.name()));
    m.insert("error".into(), json!(e.message));
    if let Some(h) = &e.hint {
        m.insert("hint".into(), json!(h));
    }
    Value::Object(m).to_string()
}

/// One parsed request.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Request {
    /// The daemon's pid, versions and controller count.
    Status,
    List,
    Connect(Box<ConnectParams>),
    /// Discover at the address given (or every configured line when `None`) and connect
    /// what is not connected yet.
    ConnectAll(Option<Box<ConnectParams>>),
    Disconnect {
        device: Option<String>,
        nqn: Option<String>,
        force: bool,
    },
    DisconnectAll {
        force: bool,
    },
    /// Stop the daemon (as a stop signal does).
    Stop {
        force: bool,
    },
    /// Block I/O on a controller the daemon holds.
    Io {
        device: String,
        io: IoRequest,
    },
}

/// What an I/O request does (`nsid`, `lba` in blocks; sizes in bytes, whole blocks).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum IoRequest {
    /// At most [`MAX_READ`] bytes; answered with `data` (base64).
    Read { nsid: u32, lba: u64, size: usize },
    /// `data` decoded (at most [`MAX_WRITE_DATA`]), or `size` bytes of `pattern`.
    Write { nsid: u32, lba: u64, data: Vec<u8> },
    /// Write a seeded random pattern in `chunk` pieces, read each back, compare.
    Verify {
        nsid: u32,
        lba: u64,
        size: u64,
        chunk: usize,
        seed: u64,
    },
}

/// Parse a request line: `(id, request)`, or the error to answer (with the id when it could
/// be read).
pub(crate) fn parse_request(line: &str) -> (Option<Value>, Result<Request, ProtoError>) {
    let bad = |m: String| ProtoError::new(ErrorCode::BadRequest, m);
    let v: Value = match serde_json::from_str(line) {
        Ok(v) => v,
        Err(e) => {
            return (
                None,
                Err(bad(format!("not JSON: {e}"))
                    .hint("send one JSON object per line, e.g. {\"version\":1,\"op\":\"list\"}")),
            )
        }
    };
    let Value::Object(mut m) = v else {
        return (None, Err(bad("a request is a JSON object".into())));
    };
    let id = m.remove("id");
    let r = (|| {
        match m.remove("version") {
            Some(Value::Number(n)) if n.as_u64() == Some(PROTOCOL_VERSION) => {}
            Some(v) => {
                return Err(ProtoError::new(
                    ErrorCode::UnsupportedVersion,
                    format!("protocol version {v} is not supported"),
                )
                .hint(format!("this daemon speaks version {PROTOCOL_VERSION}")))
            }
            None => {
                return Err(bad("no \"version\" field".into())
                    .hint(format!("add \"version\":{PROTOCOL_VERSION}")))
            }
        }
        let op = match m.remove("op") {
            Some(Value::String(s)) => s,
            _ => return Err(bad("no \"op\" string".into())),
        };
        let take_bool = |m: &mut Map<String, Value>, k: &str| match m.remove(k) {
            None => Ok(false),
            Some(Value::Bool(b)) => Ok(b),
            Some(_) => Err(bad(format!("\"{k}\" must be true or false"))),
        };
        let take_str = |m: &mut Map<String, Value>, k: &str| match m.remove(k) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(_) => Err(bad(format!("\"{k}\" must be a string"))),
        };
        let take_u64 = |m: &mut Map<String, Value>, k: &str, default: Option<u64>| match m.remove(k)
        {
            None | Some(Value::Null) => {
                default.ok_or_else(|| bad(format!("{op} needs \"{k}\" (a number)")))
            }
            Some(Value::Number(n)) if n.as_u64().is_some() => Ok(n.as_u64().unwrap_or(0)),
            Some(_) => Err(bad(format!("\"{k}\" must be a whole number >= 0"))),
        };
        let params =
            |m: &mut Map<String, Value>| -> Result<Option<Box<ConnectParams>>, ProtoError> {
                match m.remove("params") {
                    None | Some(Value::Null) => Ok(None),
                    Some(p) => serde_json::from_value(p)
                        .map(|p| Some(Box::new(p)))
                        .map_err(|e| bad(format!("params: {e}"))),
                }
            };
        let req = match op.as_str() {
            "status" => Request::Status,
            "list" => Request::List,
            "connect" => match params(&mut m)? {
                Some(p) => Request::Connect(p),
                None => return Err(bad("connect needs \"params\"".into())),
            },
            "connect-all" => Request::ConnectAll(params(&mut m)?),
            "disconnect" => {
                let device = take_str(&mut m, "device")?;
                let nqn = take_str(&mut m, "nqn")?;
                if device.is_none() && nqn.is_none() {
                    return Err(bad("disconnect needs \"device\" or \"nqn\"".into()));
                }
                Request::Disconnect {
                    device,
                    nqn,
                    force: take_bool(&mut m, "force")?,
                }
            }
            "disconnect-all" => Request::DisconnectAll {
                force: take_bool(&mut m, "force")?,
            },
            "stop" => Request::Stop {
                force: take_bool(&mut m, "force")?,
            },
            "read" | "write" | "verify" => {
                let Some(device) = take_str(&mut m, "device")? else {
                    return Err(bad(format!("{op} needs \"device\" (e.g. \"nvmf0\")")));
                };
                let nsid = u32::try_from(take_u64(&mut m, "nsid", Some(1))?)
                    .map_err(|_| bad("\"nsid\" is a 32-bit number".into()))?;
                let lba = take_u64(&mut m, "lba", Some(0))?;
                let io = match op.as_str() {
                    "read" => IoRequest::Read {
                        nsid,
                        lba,
                        size: bounded(take_u64(&mut m, "size", None)?, MAX_READ, "read size")?,
                    },
                    "write" => {
                        let data = take_str(&mut m, "data")?;
                        let size = take_u64(&mut m, "size", Some(0))?;
                        let pattern = take_u64(&mut m, "pattern", Some(0))?;
                        let data =
                            match data {
                                Some(_) if size != 0 => return Err(bad(
                                    "write takes \"data\" or \"size\" (with \"pattern\"), not both"
                                        .into(),
                                )),
                                Some(d) => {
                                    use base64::Engine;
                                    let d = base64::engine::general_purpose::STANDARD
                                        .decode(d)
                                        .map_err(|e| bad(format!("\"data\" is not base64: {e}")))?;
                                    bounded(d.len() as u64, MAX_WRITE_DATA, "write data")?;
                                    d
                                }
                                None => {
                                    let n = bounded(size, MAX_WRITE_PATTERN, "write size")?;
                                    let p = u8::try_from(pattern)
                                        .map_err(|_| bad("\"pattern\" is a byte (0-255)".into()))?;
                                    vec![p; n]
                                }
                            };
                        IoRequest::Write { nsid, lba, data }
                    }
                    _ => IoRequest::Verify {
                        nsid,
                        lba,
                        size: bounded(
                            take_u64(&mut m, "size", None)?,
                            MAX_VERIFY as usize,
                            "verify size",
                        )? as u64,
                        chunk: bounded(
                            take_u64(&mut m, "chunk", Some(128 << 10))?,
                            MAX_VERIFY_CHUNK,
                            "verify chunk",
                        )?,
                        seed: take_u64(&mut m, "seed", Some(1))?,
                    },
                };
                Request::Io { device, io }
            }
            other => {
                return Err(bad(format!("unknown op {other:?}")).hint(
                    "ops: status, list, connect, connect-all, disconnect, disconnect-all, \
                     read, write, verify, stop",
                ))
            }
        };
        if let Some(k) = m.keys().next() {
            return Err(bad(format!("unknown field {k:?} for op {op:?}")));
        }
        Ok(req)
    })();
    (id, r)
}

/// `n` if it is 1..=`max`, else the `bad-request` that says the bound.
fn bounded(n: u64, max: usize, what: &str) -> Result<usize, ProtoError> {
    match usize::try_from(n) {
        Ok(v) if (1..=max).contains(&v) => Ok(v),
        _ => Err(ProtoError::new(
            ErrorCode::BadRequest,
            format!("{what} {n} is not 1..={max} bytes"),
        )
        .hint("split larger I/O into several requests (the CLI does)")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_parse_and_bad_ones_say_why() {
        let (id, r) = parse_request(r#"{"version":1,"op":"list","id":7}"#);
        assert_eq!((id, r), (Some(json!(7)), Ok(Request::List)));
        let (_, r) = parse_request(
            r#"{"version":1,"op":"connect","params":{"traddr":"127.0.0.1","nqn":"nqn.a:b","nr_io_queues":4,"fuse":"/mnt/x"}}"#,
        );
        let Ok(Request::Connect(p)) = r else {
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
                "\"x\"",
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
                "whole number",
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
            assert_eq!(v["code"], json!(code.name()));
        }
    }
}

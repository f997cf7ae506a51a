//! `target --control SOCKET`: change a running built-in target without code. One JSON object
//! per line each way on a unix socket (0600, clients of the target's own user or root):
//!
//! `{"op":"add-namespace","nqn":NQN,"nsid":N,"ram":BYTES}` or with `"file":PATH` (and
//! `"file_size":BYTES` to create or grow it), `"block_size"` 512 (default) or 4096. The
//! answer is `{"ok":true,"nsid":N,"blocks":B}` or `{"ok":false,"error":...,"hint":...}`.
//! Connected hosts get a Namespace Attribute Changed event (the daemon rescans and exports
//! it). `nvmf-rdma target-ns add` is the CLI client.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use nvmf_rdma::nvmet::{Namespace, Target};
use nvmf_rdma::verbs::DeviceContext;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

use crate::control::same_user;

/// Longest request line, and how long a client may take to send it.
const LINE_MAX: u64 = 4096;
const CLIENT_TIMEOUT: Duration = Duration::from_secs(10);

/// One request: a namespace to add.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct AddNamespace {
    pub(crate) nqn: String,
    pub(crate) nsid: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) ram: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) file: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) file_size: Option<u64>,
    #[serde(default = "default_block_size")]
    pub(crate) block_size: u32,
}

fn default_block_size() -> u32 {
    512
}

/// log2 of a block size the target serves.
pub(crate) fn lbads(block_size: u32) -> Result<u8> {
    match block_size {
        512 => Ok(9),
        4096 => Ok(12),
        n => bail!("--block-size must be 512 or 4096, not {n}"),
    }
}

/// The namespace `target` and `add-namespace` describe: RAM of `ram` bytes (256 MiB when
/// neither is given) or the file `file` (created or grown to `file_size`).
pub(crate) fn namespace_of(
    nsid: u32,
    ram: Option<u64>,
    file: Option<&Path>,
    file_size: Option<u64>,
    block_size: u32,
) -> Result<Namespace> {
    let lbads = lbads(block_size)?;
    if nsid == 0 || nsid == u32::MAX {
        bail!("namespace ID {nsid} is reserved: use 1..{}", u32::MAX - 1);
    }
    let ns = match (file, ram) {
        (Some(_), Some(_)) => bail!("give --ram or --file, not both"),
        (Some(p), None) => Namespace::file(nsid, p, file_size, lbads)
            .with_context(|| format!("open {}", p.display()))?,
        (None, r) => {
            let bytes = r.unwrap_or(256 << 20);
            // A size past the machine's memory would abort the target when allocated.
            let phys = physical_memory();
            if bytes > phys {
                bail!(
                    "a RAM namespace of {bytes} bytes is more than this machine's memory ({phys} bytes); use --file"
                );
            }
            Namespace::ram(nsid, bytes, lbads)
        }
    };
    if ns.blocks == 0 {
        bail!("the namespace would have no blocks");
    }
    Ok(ns)
}

fn physical_memory() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let (pages, size) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    (pages.max(0) as u64).saturating_mul(size.max(0) as u64)
}

/// Serve the control socket at `path` until the task is dropped (it removes the socket).
pub(crate) fn serve<D: DeviceContext>(
    path: &Path,
    t: Target<D>,
) -> Result<tokio::task::JoinHandle<()>> {
    let (l, rm) = nvmf_rdma::export::bind_listener(path)
        .with_context(|| format!("bind {}", path.display()))?;
    let t = Arc::new(t);
    Ok(tokio::spawn(async move {
        let _rm = rm;
        let mut clients = tokio::task::JoinSet::new();
        loop {
            tokio::select! {
                conn = l.accept() => {
                    let Ok((s, _)) = conn else {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    };
                    // A handful at once is plenty for a control socket.
                    if !same_user(&s) || clients.len() >= 16 {
                        continue;
                    }
                    clients.spawn(serve_client(s, t.clone()));
                }
                Some(_) = clients.join_next(), if !clients.is_empty() => {}
            }
        }
    }))
}

async fn serve_client<D: DeviceContext>(s: tokio::net::UnixStream, t: Arc<Target<D>>) {
    let (r, mut w) = s.into_split();
    let mut r = BufReader::new(r.take(LINE_MAX));
    loop {
        r.get_mut().set_limit(LINE_MAX);
        let mut line = String::new();
        let answer = match tokio::time::timeout(CLIENT_TIMEOUT, r.read_line(&mut line)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return,
            Err(_) => {
                json!({"ok": false, "error": format!("no request line within {} s", CLIENT_TIMEOUT.as_secs())})
            }
            Ok(Ok(_)) if !line.ends_with('\n') => {
                let _ = w
                    .write_all(format!("{}\n", json!({"ok": false, "error": format!("request line longer than {LINE_MAX} bytes")})).as_bytes())
                    .await;
                return;
            }
            Ok(Ok(_)) => handle(&t, line.trim()),
        };
        if w.write_all(format!("{answer}\n").as_bytes()).await.is_err() {
            return;
        }
        if answer["error"]
            .as_str()
            .is_some_and(|e| e.starts_with("no request line"))
        {
            return;
        }
    }
}

fn handle<D: DeviceContext>(t: &Target<D>, line: &str) -> Value {
    let fail = |e: String, hint: &str| json!({"ok": false, "error": crate::proto::one_line(&e), "hint": hint});
    let mut v: Value = match serde_json::from_str(line) {
        Ok(v) => v,
        Err(e) => return fail(format!("not JSON: {e}"), "send one JSON object per line"),
    };
    let op = v.get("op").and_then(Value::as_str).map(String::from);
    if op.as_deref() != Some("add-namespace") {
        return fail(format!("unknown op {op:?}"), "ops: add-namespace");
    }
    if let Value::Object(m) = &mut v {
        m.remove("op");
    }
    let a: AddNamespace = match serde_json::from_value(v) {
        Ok(a) => a,
        Err(e) => {
            return fail(
                format!("add-namespace: {e}"),
                "fields: nqn, nsid, ram or file (file_size), block_size",
            )
        }
    };
    let ns = match namespace_of(a.nsid, a.ram, a.file.as_deref(), a.file_size, a.block_size) {
        Ok(ns) => ns,
        Err(e) => return fail(format!("{e:#}"), "check the size, file and block size"),
    };
    let blocks = ns.blocks;
    match t.add_namespace(&a.nqn, ns) {
        Ok(()) => {
            println!("namespace {} added to {} ({blocks} blocks)", a.nsid, a.nqn);
            json!({"ok": true, "nsid": a.nsid, "blocks": blocks})
        }
        Err(e) => fail(
            e,
            "the subsystem is the target's -n; a namespace ID is used once",
        ),
    }
}

/// `nvmf-rdma target-ns add`: send one request, print the answer.
pub(crate) async fn run_add(control: &Path, a: AddNamespace) -> Result<()> {
    let s = tokio::net::UnixStream::connect(control)
        .await
        .with_context(|| {
            format!(
                "no target answers at {} (start it with `nvmf-rdma target --control {}`)",
                control.display(),
                control.display()
            )
        })?;
    let (r, mut w) = s.into_split();
    let mut req = serde_json::to_value(&a)?;
    req["op"] = json!("add-namespace");
    w.write_all(format!("{req}\n").as_bytes()).await?;
    let mut line = String::new();
    BufReader::new(r.take(64 << 10))
        .read_line(&mut line)
        .await
        .context("read the target's answer")?;
    let v: Value = serde_json::from_str(line.trim()).context("the target's answer is not JSON")?;
    if v["ok"] != json!(true) {
        bail!(
            "{} ({})",
            v["error"].as_str().unwrap_or("refused"),
            v["hint"].as_str().unwrap_or("")
        );
    }
    println!(
        "namespace {} added to {} ({} blocks)",
        a.nsid, a.nqn, v["blocks"]
    );
    Ok(())
}

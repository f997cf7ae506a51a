//! The control socket of a running built-in target (`target --control SOCKET`): change it
//! without code. One JSON object
//! per line each way on a unix socket (0600, clients of the target's own user or root):
//!
//! `{"op":"add-namespace","nqn":NQN,"nsid":N,"ram":BYTES}` or with `"file":PATH` (and
//! `"file_size":BYTES` to create or grow it), `"block_size"` 512 (default) or 4096, and
//! `"ana_group":G` (1..=128, default 1). The
//! answer is `{"ok":true,"nsid":N,"blocks":B}` or `{"ok":false,"error":...,"hint":...}`.
//! A RAM namespace must fit in the memory available now (MemAvailable, or less under a
//! cgroup memory.max or RLIMIT_AS) and, with the target's other RAM namespaces, in the
//! machine, each less 256 MiB kept back; a subsystem has at most 1024 namespaces (all a
//! host can list). Its pages are taken before the answer, off the threads that serve the
//! hosts' queues; adds run one at a time.
//! Connected hosts get a Namespace Attribute Changed event (the daemon rescans and exports
//! it). [`add_namespace`] is the client (`nvmf-rdma target-ns add`).
//!
//! `{"op":"ana-state","port":P,"group":G,"state":S}` sets ANA group G's state through port
//! P (S: optimized, non-optimized, inaccessible, persistent-loss or change; G 1..=128);
//! the answer is `{"ok":true}`. The port's controllers get an ANA change event, as nvmet's
//! do when `ports/P/ana_groups/G/ana_state` is written. [`set_ana_state`] is the client
//! (`nvmf-rdma target-ana set`).
//!
//! `{"op":"status"}` answers `{"ok":true,"ports":[{"id":1,"addr":"IP:PORT","groups":
//! [{"group":1,"state":"optimized"}]}]}`: each port, its address, and each ANA group's
//! state through it. [`status`] is the client (`nvmf-rdma target-ana status`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

use crate::cli::support::one_line;
use crate::export::{bind_listener, same_user};
use crate::nvme::ana::AnaState;
use crate::nvmet::{Namespace, Target, MAX_NAMESPACES};
use crate::verbs::DeviceContext;

/// Longest request line, and how long a client may take to send it.
const LINE_MAX: u64 = 4096;
const CLIENT_TIMEOUT: Duration = Duration::from_secs(10);

/// A request: one JSON object on a line, its `op` naming the variant.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub enum Request {
    AddNamespace(AddNamespace),
    AnaState(SetAnaState),
    Status,
}

/// An ANA group's state to set through a port.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SetAnaState {
    pub port: u16,
    pub group: u32,
    /// optimized, non-optimized, inaccessible, persistent-loss or change (Linux's names).
    pub state: String,
}

/// One port in a status answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PortStatus {
    pub id: u16,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub addr: Option<String>,
    pub groups: Vec<GroupStatus>,
}

/// One ANA group's state through a port.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupStatus {
    pub group: u32,
    pub state: String,
}

/// A namespace to add.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AddNamespace {
    pub nqn: String,
    pub nsid: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ram: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file_size: Option<u64>,
    #[serde(default = "default_block_size")]
    pub block_size: u32,
    /// Its ANA group (1..=128); group 1 when not given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ana_group: Option<u32>,
}

fn default_block_size() -> u32 {
    512
}

/// The answer to a request. Keys in their order on the wire.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Answer {
    /// Blocks of the namespace added.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blocks: Option<u64>,
    /// Why the request was refused, on one line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// What to do about it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hint: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nsid: Option<u32>,
    pub ok: bool,
    /// The ports (a status answer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ports: Option<Vec<PortStatus>>,
}

impl Answer {
    fn added(nsid: u32, blocks: u64) -> Answer {
        Answer {
            blocks: Some(blocks),
            error: None,
            hint: None,
            nsid: Some(nsid),
            ok: true,
            ports: None,
        }
    }

    fn done() -> Answer {
        Answer {
            blocks: None,
            error: None,
            hint: None,
            nsid: None,
            ok: true,
            ports: None,
        }
    }

    fn refused(error: &str, hint: Option<&str>) -> Answer {
        Answer {
            blocks: None,
            error: Some(one_line(error)),
            hint: hint.map(str::to_string),
            nsid: None,
            ok: false,
            ports: None,
        }
    }

    fn line(&self) -> String {
        // A struct of strings and numbers always serializes.
        serde_json::to_string(self).unwrap_or_default() + "\n"
    }
}

/// log2 of a block size the target serves.
pub fn lbads(block_size: u32) -> Result<u8> {
    match block_size {
        512 => Ok(9),
        4096 => Ok(12),
        n => bail!("--block-size must be 512 or 4096, not {n}"),
    }
}

/// The namespace `target` and `add-namespace` describe: RAM of `ram` bytes (256 MiB when
/// neither is given) or the file `file` (created or grown to `file_size`). `ram_held` is
/// what the target's RAM namespaces hold already. Blocks while a RAM namespace's pages are
/// taken: a running target calls it off the threads that serve its queues.
pub fn namespace_of(
    nsid: u32,
    ram: Option<u64>,
    file: Option<&Path>,
    file_size: Option<u64>,
    block_size: u32,
    ram_held: u64,
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
            ram_fits(bytes, ram_held, available_memory(), physical_memory())?;
            Namespace::try_ram(nsid, bytes, lbads)?
        }
    };
    if ns.blocks == 0 {
        bail!("the namespace would have no blocks");
    }
    Ok(ns)
}

/// Memory RAM namespaces leave to the target's own queues and to the rest of the system.
const RAM_KEPT_BACK: u64 = 256 << 20;

/// May a RAM namespace of `bytes` join RAM namespaces holding `held`? Each takes its pages
/// at once, so it must fit in what the system can give now (`available`); and all of them
/// together in the machine (`physical`), for a kernel that hands pages out only as they are
/// first used. Both less [`RAM_KEPT_BACK`].
fn ram_fits(bytes: u64, held: u64, available: u64, physical: u64) -> Result<()> {
    let mib = |b: u64| b >> 20;
    let room = available.saturating_sub(RAM_KEPT_BACK);
    if bytes > room {
        bail!(
            "a RAM namespace of {} MiB is more than the {} MiB of memory available now (less {} MiB kept back); ask for less or use --file",
            mib(bytes),
            mib(room),
            mib(RAM_KEPT_BACK)
        );
    }
    let total = held.saturating_add(bytes);
    let most = physical.saturating_sub(RAM_KEPT_BACK);
    if total > most {
        bail!(
            "RAM namespaces would hold {} MiB, more than this machine's {} MiB (less {} MiB kept back); ask for less or use --file",
            mib(total),
            mib(most),
            mib(RAM_KEPT_BACK)
        );
    }
    Ok(())
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

/// What this process can take now: the kernel's MemAvailable, or less where the process's
/// cgroup (memory.max, systemd's MemoryMax) or its address-space limit (RLIMIT_AS) leaves
/// less. Unknown parts do not limit.
fn available_memory() -> u64 {
    let kib = |text: &str, key: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|k| k.saturating_mul(1024))
    };
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let mut avail = kib(&read("/proc/meminfo"), "MemAvailable:").unwrap_or(u64::MAX);
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct we pass.
    if unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut lim) } == 0
        && lim.rlim_cur != libc::RLIM_INFINITY
    {
        let used = kib(&read("/proc/self/status"), "VmSize:").unwrap_or(0);
        avail = avail.min(lim.rlim_cur.saturating_sub(used));
    }
    // cgroup v2: "0::/path"; each level up to the root may limit.
    if let Some(path) = read("/proc/self/cgroup")
        .lines()
        .find_map(|l| l.strip_prefix("0::").map(str::to_string))
    {
        let mut dir = PathBuf::from("/sys/fs/cgroup").join(path.trim_start_matches('/'));
        loop {
            let num = |f: &str| {
                read(&dir.join(f).to_string_lossy())
                    .trim()
                    .parse::<u64>()
                    .ok()
            };
            if let (Some(max), Some(cur)) = (num("memory.max"), num("memory.current")) {
                avail = avail.min(max.saturating_sub(cur));
            }
            if !dir.pop() || !dir.starts_with("/sys/fs/cgroup") {
                break;
            }
        }
    }
    avail
}

/// Bytes held by the RAM namespaces of `t`.
fn ram_held<D: DeviceContext>(t: &Target<D>) -> u64 {
    t.config()
        .subsystems
        .iter()
        .flat_map(|s| &s.namespaces)
        .filter(|n| n.is_ram())
        .map(|n| n.bytes())
        .sum()
}

/// What a server tells its owner of each namespace it added: the request and the
/// namespace's blocks.
pub type OnAdded = Arc<dyn Fn(&AddNamespace, u64) + Send + Sync>;

/// Serve the control socket at `path` until the task is dropped (it removes the socket);
/// `added` hears of each namespace added.
pub fn serve<D: DeviceContext>(
    path: &Path,
    t: Target<D>,
    added: OnAdded,
) -> Result<tokio::task::JoinHandle<()>> {
    let (l, rm) = bind_listener(path).with_context(|| format!("bind {}", path.display()))?;
    let t = Arc::new(t);
    // One add at a time: a namespace's memory is checked against what the others hold,
    // which counts it only once it is in the target.
    let adding = Arc::new(tokio::sync::Mutex::new(()));
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
                    clients.spawn(serve_client(s, t.clone(), adding.clone(), added.clone()));
                }
                Some(_) = clients.join_next(), if !clients.is_empty() => {}
            }
        }
    }))
}

async fn serve_client<D: DeviceContext>(
    s: tokio::net::UnixStream,
    t: Arc<Target<D>>,
    adding: Arc<tokio::sync::Mutex<()>>,
    added: OnAdded,
) {
    let (r, mut w) = s.into_split();
    let mut r = BufReader::new(r.take(LINE_MAX));
    loop {
        r.get_mut().set_limit(LINE_MAX);
        let mut line = String::new();
        let answer = match tokio::time::timeout(CLIENT_TIMEOUT, r.read_line(&mut line)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return,
            Err(_) => {
                let e = format!("no request line within {} s", CLIENT_TIMEOUT.as_secs());
                // The client had its time: the answer, then the connection goes.
                let _ = w
                    .write_all(Answer::refused(&e, None).line().as_bytes())
                    .await;
                return;
            }
            Ok(Ok(_)) if !line.ends_with('\n') => {
                let e = format!("request line longer than {LINE_MAX} bytes");
                let _ = w
                    .write_all(Answer::refused(&e, None).line().as_bytes())
                    .await;
                return;
            }
            Ok(Ok(_)) => handle(&t, &adding, line.trim(), &added).await,
        };
        if w.write_all(answer.line().as_bytes()).await.is_err() {
            return;
        }
    }
}

async fn handle<D: DeviceContext>(
    t: &Arc<Target<D>>,
    adding: &tokio::sync::Mutex<()>,
    line: &str,
    added: &OnAdded,
) -> Answer {
    let fail = |e: String, hint: &str| Answer::refused(&e, Some(hint));
    match serde_json::from_str::<Request>(line) {
        Ok(Request::AddNamespace(a)) => add(t, adding, a, added).await,
        Ok(Request::AnaState(s)) => {
            let set = s
                .state
                .parse::<AnaState>()
                .and_then(|st| t.set_ana_state(s.port, s.group, st));
            match set {
                Ok(()) => Answer::done(),
                Err(e) => fail(e, "see the ports and groups with op status"),
            }
        }
        Ok(Request::Status) => Answer {
            ports: Some(port_status(t)),
            ..Answer::done()
        },
        Err(e) => fail(
            format!("bad request: {e}"),
            "one JSON object per line: op add-namespace (nqn, nsid, ram or file, file_size, \
             block_size), ana-state (port, group, state) or status",
        ),
    }
}

/// Each port of `t` with the state of each ANA group through it.
fn port_status<D: DeviceContext>(t: &Target<D>) -> Vec<PortStatus> {
    let states = t.ana_states();
    t.ports()
        .into_iter()
        .map(|p| PortStatus {
            id: p.id,
            addr: p.addr.map(|a| a.to_string()),
            groups: states
                .iter()
                .filter(|(port, _, _)| *port == p.id)
                .map(|(_, group, st)| GroupStatus {
                    group: *group,
                    state: st.name().to_string(),
                })
                .collect(),
        })
        .collect()
}

async fn add<D: DeviceContext>(
    t: &Arc<Target<D>>,
    adding: &tokio::sync::Mutex<()>,
    a: AddNamespace,
    added: &OnAdded,
) -> Answer {
    let fail = |e: String, hint: &str| Answer::refused(&e, Some(hint));
    let _one = adding.lock().await;
    // What the target would refuse anyway, before any memory is taken for it.
    let group = a.ana_group.unwrap_or(super::ana::DEFAULT_GROUP);
    if let Err(e) = super::ana::check_group(group) {
        return fail(e, "leave ana_group out for group 1");
    }
    let cfg = t.config();
    if let Some(s) = cfg.subsystems.iter().find(|s| s.nqn.as_str() == a.nqn) {
        if s.namespaces.iter().any(|n| n.nsid == a.nsid) {
            return fail(
                format!("namespace {} exists in {}", a.nsid, a.nqn),
                "a namespace ID is used once",
            );
        }
        if s.namespaces.len() >= MAX_NAMESPACES {
            return fail(
                format!(
                    "{} has {MAX_NAMESPACES} namespaces, all a host can list",
                    a.nqn
                ),
                "serve more namespaces from another subsystem (another target -n)",
            );
        }
    }
    // Taking a RAM namespace's pages takes seconds per GiB: not on the threads that serve
    // the hosts' queues.
    let held = ram_held(t);
    let b = a.clone();
    let made = tokio::task::spawn_blocking(move || {
        namespace_of(
            b.nsid,
            b.ram,
            b.file.as_deref(),
            b.file_size,
            b.block_size,
            held,
        )
    })
    .await;
    let ns = match made {
        Ok(Ok(ns)) => match ns.in_ana_group(group) {
            Ok(ns) => ns,
            Err(e) => return fail(e, "leave ana_group out for group 1"),
        },
        Ok(Err(e)) => return fail(format!("{e:#}"), "check the size, file and block size"),
        Err(e) => return fail(format!("adding the namespace failed: {e}"), "try again"),
    };
    let blocks = ns.blocks;
    match t.add_namespace(&a.nqn, ns) {
        Ok(()) => {
            added(&a, blocks);
            Answer::added(a.nsid, blocks)
        }
        Err(e) => fail(
            e,
            "the subsystem is the target's -n; a namespace ID is used once",
        ),
    }
}

/// Ask the target whose control socket is `control` to add the namespace `a`; its blocks.
pub async fn add_namespace(control: &Path, a: &AddNamespace) -> Result<u64> {
    match ask(control, &Request::AddNamespace(a.clone())).await? {
        Answer {
            blocks: Some(blocks),
            ..
        } => Ok(blocks),
        _ => bail!("the target's answer has no blocks"),
    }
}

/// Ask the target whose control socket is `control` to set an ANA group's state.
pub async fn set_ana_state(control: &Path, s: &SetAnaState) -> Result<()> {
    ask(control, &Request::AnaState(s.clone())).await.map(drop)
}

/// The ports of the target whose control socket is `control`, with their ANA groups.
pub async fn status(control: &Path) -> Result<Vec<PortStatus>> {
    Ok(ask(control, &Request::Status)
        .await?
        .ports
        .unwrap_or_default())
}

/// Send `req` to the target whose control socket is `control`: its answer if it is ok.
async fn ask(control: &Path, req: &Request) -> Result<Answer> {
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
    let req = serde_json::to_string(req)?;
    w.write_all(format!("{req}\n").as_bytes()).await?;
    let mut line = String::new();
    BufReader::new(r.take(64 << 10))
        .read_line(&mut line)
        .await
        .context("read the target's answer")?;
    let v: Answer = serde_json::from_str(line.trim()).context("the target's answer is not JSON")?;
    match v {
        Answer { ok: true, .. } => Ok(v),
        v => bail!(
            "{} ({})",
            v.error.as_deref().unwrap_or("refused"),
            v.hint.as_deref().unwrap_or("")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A RAM namespace fits what is available now and, with the others, the machine; each
    /// less what is kept back.
    #[test]
    fn a_ram_namespace_fits_available_memory_and_the_machine_with_the_others() {
        const G: u64 = 1 << 30;
        let k = RAM_KEPT_BACK;
        assert!(ram_fits(4 * G - k, 0, 4 * G, 64 * G).is_ok());
        let e = ram_fits(4 * G - k + 1, 0, 4 * G, 64 * G)
            .unwrap_err()
            .to_string();
        assert!(e.contains("available now") && e.contains("--file"), "{e}");
        assert!(ram_fits(G, 62 * G, 8 * G, 64 * G).is_ok());
        let e = ram_fits(2 * G, 62 * G, 8 * G, 64 * G)
            .unwrap_err()
            .to_string();
        assert!(e.contains("this machine's") && e.contains("--file"), "{e}");
        assert!(ram_fits(u64::MAX, u64::MAX, u64::MAX, u64::MAX).is_err());
    }

    /// Requests are typed: the op names the variant, an unknown op or field is refused, and
    /// the answer keeps its keys in wire order.
    #[test]
    fn requests_and_answers_on_the_wire() {
        let a: Request = serde_json::from_str(
            r#"{"op":"add-namespace","nqn":"nqn.a:b","nsid":2,"ram":1048576}"#,
        )
        .unwrap();
        let Request::AddNamespace(a) = a else {
            panic!("{a:?}")
        };
        assert_eq!((a.nsid, a.ram, a.block_size), (2, Some(1 << 20), 512));
        assert_eq!(a.ana_group, None);
        let g: Request = serde_json::from_str(
            r#"{"op":"add-namespace","nqn":"nqn.a:b","nsid":2,"ana_group":3}"#,
        )
        .unwrap();
        assert!(matches!(
            g,
            Request::AddNamespace(AddNamespace {
                ana_group: Some(3),
                ..
            })
        ));
        let s: Request =
            serde_json::from_str(r#"{"op":"ana-state","port":2,"group":1,"state":"inaccessible"}"#)
                .unwrap();
        let Request::AnaState(s) = s else {
            panic!("{s:?}")
        };
        assert_eq!((s.port, s.group, s.state.as_str()), (2, 1, "inaccessible"));
        assert!(matches!(
            serde_json::from_str(r#"{"op":"status"}"#).unwrap(),
            Request::Status
        ));
        for bad in [
            r#"{"op":"remove-namespace","nqn":"n","nsid":2}"#,
            r#"{"op":"add-namespace","nqn":"n","nsid":2,"colour":"red"}"#,
            r#"{"nqn":"n","nsid":2}"#,
            r#"{"op":"add-namespace","nqn":"n"}"#,
            r#"{"op":"ana-state","port":1,"group":1}"#,
            r#"{"op":"ana-state","port":1,"group":1,"state":"x","colour":"red"}"#,
            "not json",
        ] {
            assert!(serde_json::from_str::<Request>(bad).is_err(), "{bad}");
        }
        let sent = serde_json::to_string(&Request::AddNamespace(a)).unwrap();
        assert!(sent.starts_with(r#"{"op":"add-namespace","#), "{sent}");
        assert_eq!(
            Answer::added(2, 2048).line(),
            "{\"blocks\":2048,\"nsid\":2,\"ok\":true}\n"
        );
        let status = Answer {
            ports: Some(vec![PortStatus {
                id: 1,
                addr: Some("127.0.0.1:4791".into()),
                groups: vec![GroupStatus {
                    group: 1,
                    state: "optimized".into(),
                }],
            }]),
            ..Answer::done()
        };
        assert_eq!(
            status.line(),
            "{\"ok\":true,\"ports\":[{\"id\":1,\"addr\":\"127.0.0.1:4791\",\"groups\":[{\"group\":1,\"state\":\"optimized\"}]}]}\n"
        );
        assert_eq!(
            Answer::refused("no\nroom", Some("ask for less")).line(),
            "{\"error\":\"no; room\",\"hint\":\"ask for less\",\"ok\":false}\n"
        );
    }

    /// Whatever the limits, what is available is a number a RAM namespace can be held to,
    /// and no more than the machine has.
    #[test]
    fn available_memory_is_at_most_the_machines() {
        let a = available_memory();
        assert!(a > 0 && a <= physical_memory(), "{a}");
    }
}

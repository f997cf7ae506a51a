//! `connect-all` and the config file: each line connected (a discovery line expands to what
//! its discovery controller lists), failed configured lines retried, and SIGHUP's reload.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use anyhow::Result;

use crate::cli::args::{parse_connect, ExportArgs, Subsys};
use crate::cli::host::{connect_hint, discover_on, options};
use crate::daemon::config::{read_config, ConfigLine};
use crate::daemon::exports::{report_state_changes, start_exports};
use crate::daemon::proto::{
    ConnectAllReply, ConnectParams, ConnectReply, ErrorCode, LineResult, LineStatus, ProtoError,
};
use crate::daemon::registry::{failed, line_key, lock, Entry, Key, KeyedTasks, State};
use crate::daemon::say;
use crate::daemon::watch::{
    reap_when_dead, retry_delay, retry_until_ok, watch_discovery, watch_namespaces,
};
use crate::multipath::{JoinError, Subsystem};
use crate::nvme::fabrics::DISCOVERY_NQN;

/// `connect-all`: each configured line (or the one given) connected; discovery lines expand
/// to every subsystem their discovery controller lists. Already connected ones are skipped.
pub(super) async fn op_connect_all(
    st: &Arc<State>,
    given: Option<ConnectParams>,
) -> Result<ConnectAllReply, ProtoError> {
    let configured = given.is_none();
    let lines: Vec<ConfigLine> = match given {
        Some(p) => vec![ConfigLine {
            line: 0,
            discovery: p.nqn == DISCOVERY_NQN,
            params: p,
        }],
        None => {
            let lines = read_config(&st.cfg.config_dir).map_err(|e| {
                ProtoError::new(ErrorCode::BadRequest, e).hint("fix the config file")
            })?;
            *st.configured.lock().unwrap_or_else(|e| e.into_inner()) = lines.clone();
            lines
        }
    };
    connect_lines(st, lines, configured).await
}

/// Connect `lines`; a failed one that came from the config file (`configured`) is tried
/// again until it connects.
async fn connect_lines(
    st: &Arc<State>,
    lines: Vec<ConfigLine>,
    configured: bool,
) -> Result<ConnectAllReply, ProtoError> {
    let mut results = Vec::new();
    for l in lines {
        if l.discovery {
            watch(st, &l.params);
        }
        let first = results.len();
        let targets = if l.discovery {
            match discover_params(&l.params).await {
                Ok(v) => v,
                Err(e) => {
                    results.push(LineResult {
                        line: l.line,
                        traddr: l.params.traddr.clone(),
                        trsvcid: None,
                        nqn: l.params.nqn.clone(),
                        status: LineStatus::Failed,
                        device: None,
                        error: Some(format!("discovery: {e:#}")),
                    });
                    if configured {
                        retry(st, &l);
                    }
                    continue;
                }
            }
        } else {
            vec![l.params.clone()]
        };
        for p in targets {
            let mut r = LineResult {
                line: l.line,
                traddr: p.traddr.clone(),
                trsvcid: p.trsvcid,
                nqn: p.nqn.clone(),
                status: LineStatus::Connected,
                device: None,
                error: None,
            };
            match op_connect(st.clone(), p).await {
                Ok(v) => r.device = Some(v.device),
                Err(e) if e.code == ErrorCode::Duplicate => r.status = LineStatus::AlreadyConnected,
                Err(e) => {
                    r.status = LineStatus::Failed;
                    r.error = Some(e.message);
                }
            }
            results.push(r);
        }
        if configured
            && results[first..]
                .iter()
                .any(|r| r.status == LineStatus::Failed)
        {
            retry(st, &l);
        }
    }
    Ok(ConnectAllReply { results })
}

/// SIGHUP: the config file read again. New lines are connected; lines that are gone are
/// reported with the controllers they made, which stay until they are disconnected.
pub(super) async fn reload(st: &Arc<State>) {
    let report = &st.cfg.report;
    let old = st
        .configured
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let lines = match read_config(&st.cfg.config_dir) {
        Ok(l) => l,
        Err(e) => {
            say!(
                report,
                "reload: {e}; nothing changed (fix the config file and send SIGHUP again)"
            );
            return;
        }
    };
    *st.configured.lock().unwrap_or_else(|e| e.into_inner()) = lines.clone();
    for gone in old
        .iter()
        .filter(|o| !lines.iter().any(|l| l.params == o.params))
    {
        let k = line_key(&gone.params);
        let names: Vec<String> = lock(&st.inner)
            .ctrls
            .values()
            // A discovery line made the controllers at its address; a subsystem line, the
            // controllers to that subsystem there.
            .filter(|e| e.key.1 == k.1 && (gone.discovery || (e.key.0 == k.0 && e.key.2 == k.2)))
            .map(|e| e.name.clone())
            .collect();
        let what = if names.is_empty() {
            "no controller of it is connected".to_string()
        } else {
            format!(
                "would remove {}; kept (`nvmf-rdma disconnect -d NAME` removes one)",
                names.join(", ")
            )
        };
        say!(
            report,
            "reload: {} at {} is no longer configured; {what}",
            gone.params.nqn,
            gone.params.traddr
        );
        if gone.discovery {
            stop_task(&st.watchers, &k).await;
        }
        stop_task(&st.retries, &k).await;
    }
    let new: Vec<ConfigLine> = lines
        .into_iter()
        .filter(|l| !old.iter().any(|o| o.params == l.params))
        .collect();
    if new.is_empty() {
        say!(report, "reload: no new line in the config file");
        return;
    }
    match connect_lines(st, new, true).await {
        Ok(v) => {
            for r in v.results {
                say!(report, "reload: {r}");
            }
        }
        Err(e) => say!(report, "reload: {}", e.message),
    }
}

/// Abort the task of `key` in `tasks`, if there is one.
async fn stop_task(tasks: &KeyedTasks, key: &Key) {
    let t = tasks.lock().unwrap_or_else(|e| e.into_inner()).remove(key);
    if let Some(t) = t {
        t.abort();
        let _ = t.await;
    }
}

/// The subsystems the discovery controller of `p` lists, as connect requests with `p`'s
/// options. An entry at the discovery controller's own IP keeps its soft-HCA port.
async fn discover_params(p: &ConnectParams) -> Result<Vec<ConnectParams>> {
    let (sub, _, _) = parse_connect(&p.to_args()).map_err(anyhow::Error::msg)?;
    let o = options(&sub)?;
    let entries = discover_on(&sub.fabric, o, "no discovery log").await?;
    let mut out = Vec::new();
    for e in entries {
        let nqn = e.subnqn.text().trim().to_string();
        if nqn == DISCOVERY_NQN || nqn.is_empty() {
            continue;
        }
        let mut q = p.clone();
        q.nqn = nqn;
        if let Ok(s) = e.trsvcid.text().trim().parse::<u16>() {
            q.trsvcid = Some(s);
        }
        if let Ok(ip) = e.traddr.text().trim().parse::<std::net::IpAddr>() {
            if ip != sub.fabric.traddr.ip() {
                q.traddr = ip.to_string();
            }
        }
        out.push(q);
    }
    Ok(out)
}

/// Keep a discovery controller for `p` (a discovery line) watched, once.
fn watch(st: &Arc<State>, p: &ConnectParams) {
    let task = watch_discovery(st.clone(), p.clone(), st.rescan.clone());
    st.spawn_once(&st.watchers, line_key(p), task);
}

/// Try the configured line `l` again until it connects, unless that already goes on.
fn retry(st: &Arc<State>, l: &ConfigLine) {
    let (s, line) = (st.clone(), l.clone());
    let task = async move { retry_until_ok(|n| retry_line(&s, &line, n)).await };
    st.spawn_once(&st.retries, line_key(&l.params), task);
}

/// Try configured line `l` again (try `n`): done when everything it names is connected (or
/// the daemon stops). Each failure is one log line saying when the next try is.
async fn retry_line(st: &Arc<State>, l: &ConfigLine, n: u32) -> bool {
    if st.stopping.load(Ordering::SeqCst) {
        return true;
    }
    let report = &st.cfg.report;
    let r = op_connect_all(st, Some(l.params.clone())).await;
    let errors: Vec<String> = match &r {
        Ok(v) => v
            .results
            .iter()
            .filter(|r| r.status == LineStatus::Failed)
            .map(|r| format!("{}: {}", r.nqn, r.error.as_deref().unwrap_or("")))
            .collect(),
        Err(e) => vec![e.message.clone()],
    };
    let next = retry_delay(n + 1).as_secs();
    if let Ok(v) = &r {
        for r in v
            .results
            .iter()
            .filter(|r| r.status == LineStatus::Connected)
        {
            say!(report, "connect-all: line {}: {r}", l.line);
        }
    }
    for e in &errors {
        say!(
            report,
            "connect-all: line {}: {e}; trying again in {next} s",
            l.line
        );
    }
    errors.is_empty()
}

/// Connect as `p` asks; runs in its own task so a client that goes away changes nothing.
pub(super) async fn op_connect(
    st: Arc<State>,
    p: ConnectParams,
) -> Result<ConnectReply, ProtoError> {
    if st.stopping.load(Ordering::SeqCst) {
        return Err(ProtoError::new(
            ErrorCode::Stopping,
            "the daemon is stopping",
        ));
    }
    let (sub, x, mode) =
        parse_connect(&p.to_args()).map_err(|e| ProtoError::new(ErrorCode::BadRequest, e))?;
    let o = options(&sub).map_err(|e| ProtoError::new(ErrorCode::BadRequest, format!("{e:#}")))?;
    let key: Key = (
        sub.nqn.clone(),
        sub.fabric.traddr.to_string(),
        sub.fabric.trsvcid,
        o.hostnqn.clone(),
    );
    let n = st
        .reserve(&key, State::export_paths(&p), mode.duplicate_connect)
        .await?;
    let name = format!("nvmf{n}");
    let st2 = st.clone();
    let name2 = name.clone();
    let job = tokio::spawn(async move {
        let r = connect_entry(&st2, name2, key, sub, x, o).await;
        let late = {
            let mut inner = lock(&st2.inner);
            inner.reserved.remove(&n);
            match r {
                // A stop that went through while we connected has disconnected everything
                // else: this one goes too, or its exports would outlive the daemon.
                Ok(e) if st2.stopping.load(Ordering::SeqCst) => e,
                Ok(e) => {
                    let v = e.info();
                    inner.ctrls.insert(n, e);
                    return Ok(v);
                }
                Err(e) => return Err(e),
            }
        };
        late.stop().await;
        Err(ProtoError::new(
            ErrorCode::Stopping,
            "the daemon stopped while connecting",
        ))
    });
    let r = job
        .await
        .unwrap_or_else(|e| Err(failed(format!("connect task ended: {e}"))))?;
    say!(st.cfg.report, "{name}: connected ({})", p.nqn);
    Ok(ConnectReply {
        device: name,
        controller: r,
    })
}

async fn connect_entry(
    st: &Arc<State>,
    name: String,
    key: Key,
    sub: Subsys,
    x: ExportArgs,
    o: crate::transport::ConnectOptions,
) -> Result<Entry, ProtoError> {
    let what = format!("connect to {} at {}", sub.nqn, sub.fabric.traddr);
    let (c, device) = st
        .connect_on_device(&sub, o)
        .await
        .map_err(|e| failed(format!("{what}: {e:#}")).hint(connect_hint(&format!("{e:#}"))))?;
    let c = Arc::new(c);
    let mut mp = st.subsystem(&sub.nqn, &c.opts.hostnqn, sub.iopolicy);
    let (address, device_name) = (sub.fabric.traddr.to_string(), sub.fabric.device.to_string());
    let mut joined = mp
        .add_path(c.clone(), address.clone(), device_name.clone())
        .await;
    if let Some(JoinError::OtherNamespace { nsid }) =
        joined.as_ref().err().and_then(|e| e.downcast_ref())
    {
        // Not the same disk behind the same NSID: a controller of its own, not a path.
        say!(
            st.cfg.report,
            "{name}: namespace {nsid} is not the namespace the other paths of {} show (another NGUID, EUI-64 or UUID); kept as a controller of its own, not a path",
            sub.nqn
        );
        mp = Subsystem::new(&sub.nqn, sub.iopolicy.unwrap_or_default());
        joined = mp.add_path(c.clone(), address, device_name).await;
    }
    let path = match joined {
        Ok(p) => p.id,
        Err(e) => {
            if let Ok(c) = Arc::try_unwrap(c) {
                c.disconnect().await;
            }
            if let Some(d) = device {
                d.release().await;
            }
            return Err(failed(format!("{what}: {e:#}")));
        }
    };
    let exports = match start_exports(&mp, &sub, &x).await {
        Ok(x) => x,
        Err(e) => {
            mp.remove_path(path);
            if let Ok(c) = Arc::try_unwrap(c) {
                c.disconnect().await;
            }
            if let Some(d) = device {
                d.release().await;
            }
            return Err(failed(format!("{name}: exports: {e:#}")));
        }
    };
    for l in exports.describe() {
        say!(st.cfg.report, "{name}: {l}");
    }
    let tasks = vec![
        tokio::spawn(report_state_changes(
            name.clone(),
            c.watch_status(),
            st.cfg.report.clone(),
        )),
        tokio::spawn(reap_when_dead(st.clone(), name.clone(), c.watch_status())),
        tokio::spawn(watch_namespaces(
            name.clone(),
            c.clone(),
            (mp.clone(), path),
            exports.set.clone(),
            st.cfg.report.clone(),
        )),
    ];
    Ok(Entry {
        name,
        key,
        sub,
        ctrl: c,
        mp,
        path,
        exports,
        tasks,
        io_gate: Arc::new(tokio::sync::RwLock::new(())),
        device,
    })
}

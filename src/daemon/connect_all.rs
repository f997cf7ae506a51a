//! `connect-all` and the config file: each line connected (a discovery line expands to what
//! its discovery controller lists), failed configured lines retried, and SIGHUP's reload.

use std::sync::Arc;

use anyhow::Result;

use crate::cli::args::parse_connect;
use crate::cli::host::{discover_on, options};
use crate::daemon::config::{read_config, ConfigLine};
use crate::daemon::proto::{
    ConnectAllReply, ConnectParams, ErrorCode, LineResult, LineStatus, ProtoError,
};
use crate::daemon::registry::{line_key, lock, op_connect, Key, KeyedTasks, State};
use crate::daemon::say;
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
            st.watch(&l.params);
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
                        st.retry(&l);
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
            st.retry(&l);
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

//! The controllers of one run directory, wherever they are held: by its daemon (asked over
//! its socket) or by `connect --foreground` processes (one control socket each). What `list`,
//! `list-subsys`, `disconnect` and `daemon --stop` do, for any front end.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use serde::de::DeserializeOwned;

use crate::cli::support::json_field;
use crate::daemon::client::{socket_in, Client};
use crate::daemon::control::{disconnect_foreground, foreground_controllers};
use crate::daemon::proto::{
    ControllerInfo, DisconnectReply, ErrorCode, ListReply, ProtoError, Request, StopReply,
};

/// How long a front end waits for the daemon's names before taking it for absent.
const NAMES_WAIT: Duration = Duration::from_secs(2);
/// How long `daemon --stop` waits for a daemon that accepted the stop to remove its socket.
const STOP_WAIT: Duration = Duration::from_secs(30);

/// `req` on a connection of its own to the daemon of `run_dir`; `Ok(None)`: none answers.
pub async fn try_call<T: DeserializeOwned>(run_dir: &Path, req: &Request) -> Result<Option<T>> {
    match Client::try_open(&socket_in(run_dir)).await? {
        Some(mut c) => c.call(req).await.map(Some),
        None => Ok(None),
    }
}

/// Names the daemon of `run_dir` holds (a `connect --foreground` avoids them); none when no
/// daemon answers in time.
pub async fn daemon_names(run_dir: &Path) -> Vec<String> {
    let list = try_call::<ListReply>(run_dir, &Request::List {});
    match tokio::time::timeout(NAMES_WAIT, list).await {
        Ok(Ok(Some(v))) => v.controllers.into_iter().map(|c| c.name).collect(),
        _ => Vec::new(),
    }
}

/// Every controller: the daemon's, then the `connect --foreground` ones (marked
/// `foreground`); and whether a daemon answered.
pub async fn all_controllers(run_dir: &Path) -> Result<(bool, Vec<ControllerInfo>)> {
    let mut out = Vec::new();
    let daemon = try_call::<ListReply>(run_dir, &Request::List {}).await?;
    let have_daemon = daemon.is_some();
    if let Some(v) = daemon {
        out.extend(v.controllers);
    }
    for (_, j) in foreground_controllers().await {
        if let Ok(mut c) = serde_json::from_str::<ControllerInfo>(&j) {
            c.foreground = true;
            out.push(c);
        }
    }
    Ok((have_daemon, out))
}

/// Controllers grouped by subsystem NQN, subsystems in the order they first appear.
pub fn by_subsystem(ctrls: &[ControllerInfo]) -> Vec<(&str, Vec<&ControllerInfo>)> {
    let mut subs: Vec<(&str, Vec<&ControllerInfo>)> = Vec::new();
    for c in ctrls {
        match subs.iter_mut().find(|(n, _)| *n == c.subnqn) {
            Some((_, v)) => v.push(c),
            None => subs.push((&c.subnqn, vec![c])),
        }
    }
    subs
}

/// Disconnect the controllers of subsystem `nqn`, or the one named `device`, the daemon's
/// and the foreground ones; how many. One whose export is in use refuses (unless `force`)
/// and its error is returned.
pub async fn disconnect(
    run_dir: &Path,
    nqn: Option<&str>,
    device: Option<&str>,
    force: bool,
) -> Result<usize> {
    let mut n = 0;
    let req = Request::Disconnect {
        device: device.map(str::to_string),
        nqn: nqn.map(str::to_string),
        force,
    };
    match try_call::<DisconnectReply>(run_dir, &req).await {
        Ok(Some(v)) => n += v.disconnected.len(),
        Ok(None) => {}
        // Nothing of the daemon's matched: the foreground ones may.
        Err(e)
            if e.downcast_ref::<ProtoError>()
                .is_some_and(|r| r.code == ErrorCode::NotFound) => {}
        Err(e) => return Err(e),
    }
    let pick = |j: &str| {
        nqn.is_some_and(|q| json_field(j, "subnqn") == Some(q))
            || device.is_some_and(|d| json_field(j, "name") == Some(d))
    };
    Ok(n + disconnect_foreground(pick, force).await?)
}

/// Disconnect every controller of the run directory; how many.
pub async fn disconnect_all(run_dir: &Path, force: bool) -> Result<usize> {
    let req = Request::DisconnectAll { force };
    let n = try_call::<DisconnectReply>(run_dir, &req)
        .await?
        .map_or(0, |v| v.disconnected.len());
    Ok(n + disconnect_foreground(|_| true, force).await?)
}

/// Ask the daemon of `run_dir` to stop and wait until its socket is gone.
pub async fn stop_daemon(run_dir: &Path, force: bool) -> Result<()> {
    let sock = socket_in(run_dir);
    let _: StopReply = Client::open(run_dir)
        .await?
        .call(&Request::Stop { force })
        .await?;
    let deadline = Instant::now() + STOP_WAIT;
    while sock.exists() {
        if Instant::now() > deadline {
            bail!(
                "the daemon accepted the stop but its socket is still there after {} s",
                STOP_WAIT.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subsystems_group_their_paths_in_first_seen_order() {
        let c = |name: &str, nqn: &str| ControllerInfo {
            name: name.into(),
            subnqn: nqn.into(),
            ..ControllerInfo::default()
        };
        let all = [
            c("nvmf0", "nqn.b"),
            c("nvmf1", "nqn.a"),
            c("nvmf2", "nqn.b"),
        ];
        let subs = by_subsystem(&all);
        let names: Vec<(&str, Vec<&str>)> = subs
            .iter()
            .map(|(n, cs)| (*n, cs.iter().map(|c| c.name.as_str()).collect()))
            .collect();
        assert_eq!(
            names,
            [("nqn.b", vec!["nvmf0", "nvmf2"]), ("nqn.a", vec!["nvmf1"])]
        );
    }
}

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

/// `req` to the daemon of `run_dir`, started by `start` when none answers. Another front end
/// may start one at the same moment: when `start` fails but a daemon answers after all, that
/// one serves.
pub async fn call_starting<T: DeserializeOwned>(
    run_dir: &Path,
    req: &Request,
    start: impl std::future::Future<Output = Result<()>>,
) -> Result<T> {
    if let Some(v) = try_call(run_dir, req).await? {
        return Ok(v);
    }
    if let Err(e) = start.await {
        let status = try_call::<serde_json::Value>(run_dir, &Request::Status {}).await;
        if !matches!(status, Ok(Some(_))) {
            return Err(e);
        }
    }
    Client::open(run_dir).await?.call(req).await
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
    use crate::daemon::pid_lock::PidLock;
    use crate::daemon::proto::StatusReply;
    use crate::daemon::{Daemon, DaemonConfig, Reporter, Signal, CLIENT_TIMEOUT};
    use std::sync::Arc;

    struct Quiet;

    impl Reporter for Quiet {
        fn say(&self, _: &str) {}
    }

    /// Two front ends start a daemon at the same moment: the one whose start fails is served
    /// by the other's daemon; with none, its own failure is the error.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_front_end_that_loses_the_start_race_is_served_by_the_winner() {
        let dir = std::env::temp_dir().join(format!("nvmf-race-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let status = Request::Status {};
        let failed = async { anyhow::bail!("cannot start the daemon") };
        let e = call_starting::<StatusReply>(&dir, &status, failed).await;
        assert!(e.unwrap_err().to_string().contains("cannot start"));
        let d = Arc::new(Daemon::new(DaemonConfig {
            run_dir: dir.clone(),
            config_dir: dir.join("etc"),
            client_timeout: CLIENT_TIMEOUT,
            report: Arc::new(Quiet),
        }));
        let (stop, mut signals) = tokio::sync::mpsc::channel(1);
        let winner = {
            let (d, dir) = (d.clone(), dir.clone());
            async move {
                tokio::spawn(async move { d.serve_run_dir(&mut signals, false).await });
                let deadline = Instant::now() + Duration::from_secs(10);
                while !socket_in(&dir).exists() && Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                // Ours finds the lock taken.
                Err(PidLock::take(&dir)
                    .err()
                    .expect("the winner holds the lock"))
            }
        };
        let v = call_starting::<StatusReply>(&dir, &status, winner).await;
        assert!(v.is_ok(), "{v:?}");
        stop.send(Signal::Stop("SIGTERM")).await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while socket_in(&dir).exists() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(!socket_in(&dir).exists() && PidLock::holder(&dir).is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// An embedding application that stops forwarding signals (the sender dropped) can still
    /// stop its daemon with a stop request.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stop_request_is_served_after_the_signal_channel_closes() {
        let dir = std::env::temp_dir().join(format!("nvmf-nosig-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let d = Arc::new(Daemon::new(DaemonConfig {
            run_dir: dir.clone(),
            config_dir: dir.join("etc"),
            client_timeout: CLIENT_TIMEOUT,
            report: Arc::new(Quiet),
        }));
        let (signal_tx, mut signals) = tokio::sync::mpsc::channel(1);
        drop(signal_tx);
        let served = tokio::spawn(async move { d.serve_run_dir(&mut signals, false).await });
        let deadline = Instant::now() + Duration::from_secs(10);
        while !socket_in(&dir).exists() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let stopped = tokio::time::timeout(Duration::from_secs(10), stop_daemon(&dir, false)).await;
        assert!(
            matches!(stopped, Ok(Ok(()))),
            "stop request not served: {stopped:?}"
        );
        let end = tokio::time::timeout(Duration::from_secs(10), served).await;
        assert!(matches!(end, Ok(Ok(Ok(())))), "daemon did not end: {end:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }

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

//! What the daemon keeps watching: each controller's namespaces (Asynchronous Event
//! Notices and rescans, with the exports following), discovery controllers whose log may
//! change, controllers that gave up (reaped once their exports are free), and configured
//! lines that failed (tried again until they connect).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crate::cli::args::parse_connect;
use crate::cli::host::options;
use crate::daemon::proto::ConnectParams;
use crate::daemon::registry::{lock, State};
use crate::daemon::stop::PENDING_POLL;
use crate::daemon::usage::holders;
use crate::daemon::{say, Report};
use crate::export::{BlockDev, DevSet};
use crate::multipath::Subsystem;
use crate::reconnect::CtrlState;
use crate::transport::Controller;

/// A configured line that failed is tried again after this, doubling each time up to
/// [`RETRY_MAX`], until it connects.
const RETRY_FIRST: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(60);

/// The wait before try `n` (from 0) of a configured line that failed.
pub(super) fn retry_delay(n: u32) -> Duration {
    RETRY_FIRST.saturating_mul(1u32 << n.min(16)).min(RETRY_MAX)
}

/// Call `attempt(n)` after [`retry_delay`]`(n)`, for n = 0, 1, ..., until it says done.
pub(super) async fn retry_until_ok<F, Fut>(mut attempt: F)
where
    F: FnMut(u32) -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let mut n = 0u32;
    loop {
        tokio::time::sleep(retry_delay(n)).await;
        if attempt(n).await {
            return;
        }
        n = n.saturating_add(1);
    }
}

/// A controller's namespaces, followed: a Namespace Attribute Changed notice rescans them,
/// and the controller rescans them itself after each reconnect; after every rescan that
/// changed them, `list` shows the new ones and sizes and the exports follow
/// ([`follow_namespaces`]). An ANA change notice makes the subsystem `mp` read the path's
/// ANA state again. Ends when the controller is deleted.
pub(super) async fn watch_namespaces(
    name: String,
    c: Arc<Controller>,
    (mp, path): (Arc<Subsystem>, u64),
    set: Option<DevSet>,
    report: Report,
) {
    let mut changed = c.watch_namespaces();
    // Kept across turns: an Async Event Request stays outstanding until it completes.
    let events = next_namespace_event(&name, &c, (&mp, path), &report);
    tokio::pin!(events);
    loop {
        tokio::select! {
            go_on = &mut events => {
                if !go_on {
                    return;
                }
                events.set(next_namespace_event(&name, &c, (&mp, path), &report));
            }
            r = changed.changed() => {
                if r.is_err() {
                    return;
                }
                let ids: Vec<String> = c
                    .namespaces()
                    .iter()
                    .map(|n| format!("{} ({} blocks)", n.nsid, n.blocks))
                    .collect();
                say!(report, "{name}: namespaces changed: {}", ids.join(", "));
                if let Some(set) = &set {
                    for l in follow_namespaces(&c, &mp, set) {
                        say!(report, "{name}: {l}");
                    }
                }
            }
        }
    }
}

/// Wait for the controller's next Asynchronous Event and rescan on a Namespace Attribute
/// Changed notice, and the path's ANA state is read again on an ANA change notice. False
/// once the controller is deleted.
async fn next_namespace_event(
    name: &str,
    c: &Arc<Controller>,
    (mp, path): (&Subsystem, u64),
    report: &Report,
) -> bool {
    match c.next_async_event().await {
        Ok(ev) if ev.namespaces_changed() => {
            if let Err(e) = c.rescan_namespaces().await {
                say!(report, "{name}: namespaces changed, rescan failed: {e}");
            }
        }
        Ok(ev) if crate::nvme::ana::aen_reports_ana_change(ev.to_result()) => {
            if let Some(p) = mp.paths().into_iter().find(|p| p.id == path) {
                mp.handle_async_event(&p, ev).await;
                say!(report, "{name}: ANA state changed; read again");
            }
        }
        Ok(ev) => say!(
            report,
            "{name}: async event type {} info {:#x} (log page {:#x})",
            ev.kind,
            ev.info,
            ev.log_page
        ),
        // Failed with the I/O of a recovery (fast_io_fail_tmo): ask again once the
        // controller is live; a deleted one ends the watch.
        Err(_) => {
            let mut st = c.watch_status();
            match st
                .wait_for(|s| matches!(s.state(), CtrlState::Live | CtrlState::Dead))
                .await
            {
                Ok(s) if s.state() == CtrlState::Live => {}
                _ => return false,
            }
            // A request that failed at once on a live controller is not retried in a
            // loop.
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
    true
}

/// Bring the exports' namespaces in line with the controller's after a rescan: an added
/// namespace becomes `ns<NSID>` (a FUSE file, an NBD export name), a resized one is served
/// at its new size (FUSE at once; NBD to clients that connect from now on: the protocol has
/// no way to tell a connected client). A removed namespace, or one replaced by a different
/// namespace (its identity changed), keeps its name and fails every request: its users
/// (an open FUSE file, a loop device, a connected NBD client) must not be handed another
/// disk's blocks; the new one is served after the controller is connected again. Returns
/// what changed, a line each.
fn follow_namespaces(c: &Arc<Controller>, mp: &Arc<Subsystem>, set: &DevSet) -> Vec<String> {
    let mut said = Vec::new();
    let now = c.namespaces();
    for (file, old) in set.named() {
        let ns = old.namespace();
        match now.iter().find(|n| n.nsid == ns.nsid) {
            None => said.push(format!(
                "exports: namespace {} was removed; {file} fails every request",
                ns.nsid
            )),
            Some(n) if !n.same_as(&ns) => said.push(format!(
                "exports: namespace {} is a different namespace now (its identity changed); \
                 {file} fails every request; disconnect and connect again to serve the new one",
                ns.nsid
            )),
            Some(_) => {}
        }
    }
    for n in now {
        let file = format!("ns{}", n.nsid);
        let have = set.index_of(file.as_bytes()).and_then(|i| set.get(i));
        if have
            .as_ref()
            .is_some_and(|old| !old.namespace().same_as(&n) || old.size() == n.bytes())
        {
            continue;
        }
        let dev = match mp.namespace(n.nsid) {
            Ok(d) => Arc::new(BlockDev::on(Arc::new(d))),
            Err(e) => {
                said.push(format!("exports: {file}: {e}"));
                continue;
            }
        };
        let size = dev.size();
        match have {
            None => said.push(match set.add(&file, dev) {
                Ok(()) => format!("exports: namespace {} is {file}", n.nsid),
                Err(e) => format!("exports: {file}: {e}"),
            }),
            Some(old) => {
                set.replace(&file, dev);
                said.push(format!(
                    "exports: namespace {} resized from {} to {size} bytes ({file}; NBD clients connected before keep the old size until they reconnect)",
                    n.nsid,
                    old.size()
                ));
            }
        }
    }
    said
}

/// One discovery controller `connect-all` keeps connected per discovery line, so that a
/// Discovery Log Page Changed event brings its new subsystems in (sent to `rescan`).
pub(super) async fn watch_discovery(
    st: Arc<State>,
    p: ConnectParams,
    rescan: tokio::sync::mpsc::Sender<ConnectParams>,
) {
    let what = format!("discovery controller at {}", p.traddr);
    let report = &st.cfg.report;
    loop {
        let c = async {
            let (sub, _, _) = parse_connect(&p.to_args()).map_err(anyhow::Error::msg)?;
            let mut o = options(&sub)?;
            // Held for good, so kept alive (a discovery controller without keep-alive is
            // expired by the target after two minutes).
            if o.keep_alive_tmo.is_zero() {
                o.keep_alive_tmo = Duration::from_secs(5);
            }
            st.connect_on_device(&sub, o).await
        }
        .await;
        let (c, device) = match c {
            Ok(c) => c,
            Err(e) => {
                say!(report, "{what}: {e:#}; trying again in 10 s");
                tokio::time::sleep(Duration::from_secs(10)).await;
                continue;
            }
        };
        say!(report, "{what}: watching its log for changes");
        loop {
            match c.next_async_event().await {
                Ok(ev) if ev.discovery_changed() => {
                    say!(report, "{what}: discovery log changed; connect-all");
                    let _ = rescan.try_send(p.clone());
                }
                Ok(_) => {}
                Err(_) => break,
            }
        }
        c.disconnect().await;
        if let Some(d) = device {
            d.release().await;
        }
        if st.stopping.load(Ordering::SeqCst) {
            return;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// A controller that gave up (ctrl_loss_tmo) leaves the daemon as Linux deletes it. While an
/// export is in use it stays, listed as dead (its users get I/O errors), and goes once the
/// export is released.
pub(super) async fn reap_when_dead(
    st: Arc<State>,
    name: String,
    mut rx: tokio::sync::watch::Receiver<crate::transport::CtrlStatus>,
) {
    if rx.wait_for(|s| s.state() == CtrlState::Dead).await.is_err() {
        return;
    }
    let n: Option<u32> = name.strip_prefix("nvmf").and_then(|n| n.parse().ok());
    let Some(n) = n else { return };
    let report = &st.cfg.report;
    let mut said = false;
    let mut e = loop {
        let probe = match lock(&st.inner).ctrls.get(&n) {
            Some(e) => e.exports.probe(),
            None => return,
        };
        // The counters first; the scan of holders runs once they read zero.
        if !probe.busy_now() && holders(&probe).await.is_empty() {
            // A `disconnect` meanwhile aborts this task with the entry; nothing else
            // takes it out.
            match lock(&st.inner).ctrls.remove(&n) {
                Some(e) => break e,
                None => return,
            }
        }
        if !said {
            say!(report, "{name}: dead; kept while an export is in use (its users get I/O errors), until it is released or `disconnect --force`");
            said = true;
        }
        tokio::time::sleep(PENDING_POLL).await;
    };
    say!(report, "{name}: dead; removed");
    // This task is one of the entry's: do not abort ourselves.
    e.tasks.clear();
    e.stop().await;
}

#[cfg(test)]
mod retry_tests {
    use super::*;

    /// A line that keeps failing is tried after 1, 2, 4, ... s, then every 60 s.
    #[tokio::test(start_paused = true)]
    async fn a_failing_line_is_retried_at_1_s_doubling_to_60_s() {
        let start = tokio::time::Instant::now();
        let mut at = Vec::new();
        retry_until_ok(|n| {
            at.push((tokio::time::Instant::now() - start).as_secs());
            std::future::ready(n == 9)
        })
        .await;
        assert_eq!(at, [1, 3, 7, 15, 31, 63, 123, 183, 243, 303]);
    }
}

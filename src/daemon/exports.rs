//! The exports a controller runs beside it (NBD, FUSE), and what its holder reports of its
//! state changes.

use std::sync::Arc;

use anyhow::Result;

use crate::cli::args::{ExportArgs, Subsys};
use crate::cli::support::{human_duration, Health};
use crate::daemon::{say, Report};
use crate::export;
use crate::multipath::Subsystem;
use crate::reconnect::CtrlState;
use crate::transport::{Controller, CtrlStatus};

/// Print the controller's state changes as `connect` holds it: failures, attempts, LIVE
/// again, given up.
pub async fn report_state_changes(
    name: String,
    mut rx: tokio::sync::watch::Receiver<CtrlStatus>,
    out: Report,
) {
    let mut last = (rx.borrow().machine.state, rx.borrow().machine.attempt);
    while rx.changed().await.is_ok() {
        let st = *rx.borrow_and_update();
        let m = st.machine;
        let (was, _) = last;
        if (m.state, m.attempt) == last {
            continue;
        }
        last = (m.state, m.attempt);
        let (state, h) = Health::from_status(&st);
        match m.state {
            CtrlState::Live if was != CtrlState::Live => say!(
                out,
                "{name}: live again (recovery {}{})",
                m.recoveries,
                st.last_recovery.map_or(String::new(), |d| format!(
                    ", {} after the failure",
                    human_duration(d)
                ))
            ),
            CtrlState::Resetting | CtrlState::Connecting => {
                if matches!(was, CtrlState::Live | CtrlState::New) {
                    say!(
                        out,
                        "{name}: {}; recovering",
                        m.cause.map_or("failed", |c| c.name())
                    );
                }
                if m.attempt > 0 {
                    say!(out, "{name}: reconnecting, {}", h.attempts());
                }
            }
            CtrlState::Deleting | CtrlState::Dead if was != m.state => {
                say!(out, "{name}: {state}: {}", h.describe(&state));
            }
            _ => {}
        }
    }
}

/// The exports `connect` runs next to the controller (stopped before it disconnects).
pub struct Exports {
    pub nbd: Option<tokio::task::JoinHandle<()>>,
    /// Where the NBD export listens, and its counters (clients connected now).
    pub nbd_at: Option<(export::ExportAddr, Arc<export::NbdStats>)>,
    pub fuse: Option<export::FuseMount>,
    /// The namespace the exports serve first.
    pub nsid: u32,
    /// The namespaces both exports serve (`ns<NSID>`: a FUSE file, an NBD export name);
    /// namespaces the controller reports later join it.
    pub set: Option<export::DevSet>,
}

impl Exports {
    /// No export runs.
    pub fn is_empty(&self) -> bool {
        self.nbd.is_none() && self.fuse.is_none() && self.set.is_none()
    }

    /// What `connect` prints about the exports once they are ready.
    pub fn describe(&self) -> Vec<String> {
        let mut v = Vec::new();
        if let Some((a, _)) = &self.nbd_at {
            v.push(format!(
                "nbd: serving namespace {} at {a} ({})",
                self.nsid,
                a.uri()
            ));
        }
        if let Some(m) = &self.fuse {
            v.push(format!(
                "fuse: namespace {} is {}",
                self.nsid,
                m.file().display()
            ));
        }
        v
    }

    /// Take the exports down and delete the controller, whoever still holds it (a lazily
    /// detached FUSE mount keeps its files until its last user lets go). The exports are
    /// fenced first: every request from then on fails with EIO at once, and nothing is
    /// acknowledged after this returns. With `force`, a FUSE mount still in use is detached
    /// lazily (MNT_DETACH): it leaves the mount table now instead of lingering dead.
    pub async fn release(self, c: &Controller, force: bool) {
        let set = self.set.clone();
        if let Some(s) = &set {
            s.close();
        }
        self.stop_with(force).await;
        c.delete().await;
        if let Some(s) = set {
            s.fence().await;
        }
    }

    /// Stop the NBD server and unmount the FUSE file system (detached lazily when busy and
    /// `detach_busy`).
    async fn stop_with(self, detach_busy: bool) {
        if let Some(t) = self.nbd {
            t.abort();
            let _ = t.await;
        }
        if let Some(m) = self.fuse {
            let _ = tokio::task::spawn_blocking(move || {
                let mp = m.mountpoint().to_path_buf();
                if let Err(e) = m.unmount() {
                    eprintln!("{e}");
                    if detach_busy {
                        detach(&mp);
                    }
                }
            })
            .await;
        }
    }
}

/// `umount -l MOUNTPOINT`.
fn detach(mp: &std::path::Path) {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(mp.as_os_str().as_bytes()) else {
        return;
    };
    // SAFETY: a valid NUL-terminated path; umount2 touches no memory of ours.
    if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } == 0 {
        eprintln!(
            "{}: detached (lazy unmount); it goes when its last user lets go",
            mp.display()
        );
    } else {
        eprintln!(
            "{}: lazy unmount failed: {}",
            mp.display(),
            std::io::Error::last_os_error()
        );
    }
}

/// Start the exports `x` asks for, on namespace `s.nsid` over every path of `mp`.
impl Exports {
    /// No export, for namespace `nsid`.
    pub fn none(nsid: u32) -> Exports {
        Exports {
            nbd: None,
            nbd_at: None,
            fuse: None,
            nsid,
            set: None,
        }
    }
}

pub async fn start_exports(mp: &Arc<Subsystem>, s: &Subsys, x: &ExportArgs) -> Result<Exports> {
    let mut out = Exports::none(s.nsid);
    if x.nbd.is_none() && x.fuse.is_none() {
        return Ok(out);
    }
    let dev = Arc::new(export::BlockDev::on(Arc::new(mp.namespace(s.nsid)?)));
    let set = export::DevSet::one(&format!("ns{}", s.nsid), dev)?;
    out.set = Some(set.clone());
    if let Some(addr) = &x.nbd {
        let l =
            export::NbdListener::bind_with(addr, export::NbdLimits::default(), x.nbd_allow_remote)
                .await?;
        out.nbd_at = Some((l.addr().clone(), l.stats()));
        let set = set.clone();
        out.nbd = Some(tokio::spawn(async move {
            if let Err(e) = l.serve_set(set).await {
                eprintln!("nbd: {e}");
            }
        }));
    }
    if let Some(mp) = &x.fuse {
        let m = export::mount_fuse_set(set, tokio::runtime::Handle::current(), mp)?;
        out.fuse = Some(m);
    }
    Ok(out)
}

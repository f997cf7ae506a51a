//! A namespace over every path of its subsystem: the block API the exports use, each command
//! sent on the path the policy chooses, moved to another path when its path fails under it
//! (as [`super::failover`] rules), and held, bounded, while no path is usable.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::Poll;

use tokio::sync::watch;
use tokio::time::Instant;

use crate::reconnect::CtrlState;
use crate::transport::{Controller, CtrlStatus, HostError, Losses, NsInfo};

use super::failover::{after_error, AfterError, CmdKind};
use super::path::Path;
use super::selector::{Choice, Selector};
use super::subsystem::{refresh, Subsystem};

/// Times one command may move to another path before its last error is the caller's: a
/// target whose ports all answer with path statuses must not keep a command going round.
const MAX_MOVES: u32 = 16;

/// A namespace of a [`Subsystem`], with the I/O API of a controller's namespace.
pub struct MpNamespace {
    sub: Arc<Subsystem>,
    ns: NsInfo,
    /// The selector, and the id of the path it used last (paths come and go, so its index
    /// is found again before each choice).
    sel: Mutex<(Selector, Option<u64>)>,
}

/// May a write that failed on `path` with a transport-class error go to another path? Once
/// the associations it may have been in flight on (`upto`, taken as it failed) can no
/// longer execute it: its safe-retry hold says so (a Cross-Controller Reset through a live
/// controller of the subsystem, another path's first, or k x KATO + CQT since their last
/// contact; at once with `--safe-retry off`). While no path is live it waits for one to send
/// the CCR through, or for the time rule, which bounds the wait. Other errors are not
/// retried elsewhere, so nothing is waited for.
async fn old_commands_dead(
    paths: &[Arc<Path>],
    path: &Path,
    kind: CmdKind,
    err: &HostError,
    upto: Losses,
) -> bool {
    let path_error = matches!(
        err,
        HostError::Transport(_)
            | HostError::Path(_)
            | HostError::Gone(_)
            | HostError::Step(_)
            | HostError::Timeout(_)
    );
    if kind != CmdKind::Write || !path_error {
        return true;
    }
    loop {
        let via = paths
            .iter()
            .filter(|p| p.ctrl.state() == CtrlState::Live)
            .min_by_key(|p| p.id == path.id);
        if let Some(via) = via {
            // Should `via` fail with the CCR out, the CCR goes through the next LIVE path
            // (this one, back again, included) rather than wait for the time rule.
            let mut via_rx = via.ctrl.watch_status();
            tokio::select! {
                _ = path.ctrl.quiesced_via(&via.ctrl, upto) => return true,
                _ = via_rx.wait_for(|s| s.state() != CtrlState::Live) => continue,
            }
        }
        // `wait_for` looks at the current state first: a path that came LIVE since is seen.
        let mut rxs: Vec<_> = paths.iter().map(|p| p.ctrl.watch_status()).collect();
        let mut futs = boxed(rxs.iter_mut().map(|rx| async move {
            let _ = rx.wait_for(|s| s.state() == CtrlState::Live).await;
        }));
        futs.push(Box::pin(path.ctrl.quiesced_upto(upto)));
        let quiet = futs.len() - 1;
        if first_of(futs).await == quiet {
            return true;
        }
    }
}

/// One of several things waited for at once (see [`first_of`]).
type Waiting<'a> = Pin<Box<dyn Future<Output = ()> + Send + 'a>>;

fn boxed<'a, F>(futs: impl Iterator<Item = F>) -> Vec<Waiting<'a>>
where
    F: Future<Output = ()> + Send + 'a,
{
    futs.map(|f| Box::pin(f) as Waiting<'a>).collect()
}

/// The index of the first of several futures to be ready; the others are dropped with it.
async fn first_of(futs: Vec<Waiting<'_>>) -> usize {
    let mut futs = futs;
    std::future::poll_fn(|cx| {
        for (i, f) in futs.iter_mut().enumerate() {
            if f.as_mut().poll(cx).is_ready() {
                return Poll::Ready(i);
            }
        }
        Poll::Pending
    })
    .await
}

/// Wait for the next change of a watched value; forever once its sender is gone.
async fn next_change<T>(rx: &mut watch::Receiver<T>) {
    if rx.changed().await.is_err() {
        std::future::pending::<()>().await;
    }
}

impl MpNamespace {
    pub(super) fn new(sub: Arc<Subsystem>, ns: NsInfo) -> MpNamespace {
        let policy = sub.policy();
        MpNamespace {
            sub,
            ns,
            sel: Mutex::new((Selector::new(policy), None)),
        }
    }

    /// The namespace of a single controller, as a subsystem of one path.
    pub fn single(ctrl: Arc<Controller>, nsid: u32) -> Result<MpNamespace, HostError> {
        let ns = ctrl.namespace(nsid)?;
        Ok(MpNamespace::new(Subsystem::single(ctrl), ns))
    }

    pub fn subsystem(&self) -> &Arc<Subsystem> {
        &self.sub
    }

    /// The namespace as it was opened.
    pub fn info(&self) -> NsInfo {
        self.ns
    }

    pub fn nsid(&self) -> u32 {
        self.ns.nsid
    }

    /// The largest transfer every path takes in one command.
    pub fn max_transfer(&self) -> usize {
        self.sub
            .paths()
            .iter()
            .map(|p| p.ctrl.max_transfer())
            .min()
            .unwrap_or(0)
    }

    /// The namespace as it is now through a path that still has it; the error of the first
    /// path when none does (it was removed, or another namespace is behind its NSID).
    pub fn same_namespace(&self) -> Result<NsInfo, HostError> {
        let mut first = None;
        for p in self.sub.paths() {
            match p.ctrl.same_namespace(&self.ns) {
                Ok(n) => return Ok(n),
                Err(e) => {
                    first.get_or_insert(e);
                }
            }
        }
        Err(first.unwrap_or_else(|| HostError::Gone(format!("{} has no path", self.sub.nqn))))
    }

    /// The path for a command that already failed on the paths in `tried`: another one
    /// if one is usable, else the choice among all of them.
    fn choose(&self, paths: &[Arc<Path>], tried: &[u64], now: Instant) -> Choice {
        let mut views: Vec<_> = paths.iter().map(|p| p.view(&self.ns, now)).collect();
        let mut sel = self.sel.lock().unwrap_or_else(|e| e.into_inner());
        let (s, last_id) = &mut *sel;
        s.set_policy(self.sub.policy());
        let last = last_id.and_then(|id| paths.iter().position(|p| p.id == id));
        if !tried.is_empty() {
            let all = views.clone();
            for (v, p) in views.iter_mut().zip(paths) {
                if tried.contains(&p.id) {
                    v.live = false;
                }
            }
            s.resume_from(last);
            match s.choose(&views) {
                Choice::Path(i) => {
                    *last_id = Some(paths[i].id);
                    return Choice::Path(i);
                }
                _ => views = all,
            }
        }
        s.resume_from(last);
        let c = s.choose(&views);
        *last_id = s.last().map(|i| paths[i].id);
        c
    }

    /// The error for a command no path can carry: why the paths gave up.
    fn no_path(&self, paths: &[Arc<Path>]) -> HostError {
        for p in paths {
            if let Err(e) = p.ctrl.same_namespace(&self.ns) {
                return e;
            }
        }
        let reason = paths
            .iter()
            .find_map(|p| p.ctrl.status().machine.fail_reason);
        match reason {
            Some(r) => HostError::Path(r),
            None => HostError::Gone(format!(
                "no path to {} can carry I/O to namespace {}",
                self.sub.nqn, self.ns.nsid
            )),
        }
    }

    /// Wait until something about the paths changed (a status, an ANA state, a path came
    /// or went), or a group in change reaches its ANATT.
    async fn wait_for_change(&self, mut sub_rx: watch::Receiver<u64>, paths: &[Arc<Path>]) {
        let mut rxs: Vec<watch::Receiver<CtrlStatus>> = paths
            .iter()
            .map(|p| {
                let mut rx = p.ctrl.watch_status();
                rx.borrow_and_update();
                rx
            })
            .collect();
        let deadline = paths
            .iter()
            .filter_map(|p| p.change_deadline(self.ns.nsid))
            .min();
        let mut futs = boxed(rxs.iter_mut().map(next_change));
        futs.push(Box::pin(next_change(&mut sub_rx)));
        if let Some(d) = deadline {
            futs.push(Box::pin(tokio::time::sleep_until(d)));
        }
        first_of(futs).await;
    }

    /// Run `op` on a path chosen for it, moving it as the failover rule says, holding it
    /// while no path is usable.
    async fn run(&self, mut op: Op<'_>) -> Result<(), HostError> {
        let kind = op.kind();
        let mut held = None;
        let mut moves = 0;
        // Paths that failed this command: another one is preferred for it.
        let mut tried = Vec::new();
        loop {
            let sub_rx = self.sub.subscribe();
            let paths = self.sub.paths();
            match self.choose(&paths, &tried, Instant::now()) {
                Choice::Path(i) => {
                    held = None;
                    let path = &paths[i];
                    let out = {
                        let _in_flight = path.begin();
                        self.on_path(path, paths.len(), &mut op).await
                    };
                    let e = match out {
                        Outcome::Done(r) => match r {
                            Ok(()) => return Ok(()),
                            Err(e) => e,
                        },
                        Outcome::PathLeft => {
                            path.failed_over();
                            continue;
                        }
                    };
                    // Taken at once: the associations the command may have been in flight on.
                    let upto = path.ctrl.losses();
                    let dead = old_commands_dead(&paths, path, kind, &e, upto).await;
                    match after_error(kind, &e, dead) {
                        AfterError::Elsewhere { reread_ana } if moves < MAX_MOVES => {
                            moves += 1;
                            path.failed_over();
                            if !tried.contains(&path.id) {
                                tried.push(path.id);
                            }
                            if reread_ana {
                                refresh(&self.sub, path).await;
                            }
                        }
                        _ => return Err(e),
                    }
                }
                Choice::Hold => {
                    if held.is_none() {
                        held = Some(self.sub.hold()?);
                    }
                    self.wait_for_change(sub_rx, &paths).await;
                }
                Choice::Fail => return Err(self.no_path(&paths)),
            }
        }
    }

    /// `op` on `path`. A read, when the subsystem has other paths, is given up as soon as
    /// its path stops being LIVE (Linux `nvme_failover_req` for reads): it goes to another
    /// path at once instead of waiting for this one to reconnect. Anything else waits for
    /// its controller, whose recovery keeps it.
    async fn on_path(&self, path: &Path, n_paths: usize, op: &mut Op<'_>) -> Outcome {
        let nsid = self.ns.nsid;
        if op.kind() == CmdKind::Write || n_paths < 2 {
            return Outcome::Done(op.exec(&path.ctrl, nsid).await);
        }
        let mut rx = path.ctrl.watch_status();
        let left = async move {
            let _ = rx.wait_for(|s| s.state() != CtrlState::Live).await;
        };
        tokio::select! {
            r = op.exec(&path.ctrl, nsid) => Outcome::Done(r),
            _ = left => Outcome::PathLeft,
        }
    }

    /// Read `out.len()` bytes starting at block `lba` into `out`.
    pub async fn read_into(&self, lba: u64, out: &mut [u8]) -> Result<(), HostError> {
        self.run(Op::Read { lba, out }).await
    }

    /// Read `bytes` starting at block `lba`.
    pub async fn read(&self, lba: u64, bytes: usize) -> Result<Vec<u8>, HostError> {
        let mut out = vec![0u8; bytes];
        self.read_into(lba, &mut out).await?;
        Ok(out)
    }

    /// Write `data` starting at block `lba`.
    pub async fn write(&self, lba: u64, data: &[u8]) -> Result<(), HostError> {
        self.run(Op::Write { lba, data }).await
    }

    pub async fn write_zeroes(&self, lba: u64, blocks: u32) -> Result<(), HostError> {
        self.run(Op::Zeroes { lba, blocks }).await
    }

    /// Dataset Management, deallocate (TRIM).
    pub async fn deallocate(&self, ranges: &[(u64, u32)]) -> Result<(), HostError> {
        self.run(Op::Deallocate { ranges }).await
    }

    pub async fn flush(&self) -> Result<(), HostError> {
        self.run(Op::Flush).await
    }
}

/// How the command on a path ended: done, or its path stopped being LIVE first.
enum Outcome {
    Done(Result<(), HostError>),
    PathLeft,
}

/// A command of the block API, as sent on one path.
enum Op<'a> {
    Read { lba: u64, out: &'a mut [u8] },
    Write { lba: u64, data: &'a [u8] },
    Zeroes { lba: u64, blocks: u32 },
    Deallocate { ranges: &'a [(u64, u32)] },
    Flush,
}

impl Op<'_> {
    fn kind(&self) -> CmdKind {
        match self {
            Op::Read { .. } => CmdKind::Read,
            _ => CmdKind::Write,
        }
    }

    async fn exec(&mut self, c: &Controller, nsid: u32) -> Result<(), HostError> {
        match self {
            Op::Read { lba, out } => c.read_into(nsid, *lba, out).await,
            Op::Write { lba, data } => c.write(nsid, *lba, data).await,
            Op::Zeroes { lba, blocks } => c.write_zeroes(nsid, *lba, *blocks).await,
            Op::Deallocate { ranges } => c.deallocate(nsid, ranges).await,
            Op::Flush => c.flush(nsid).await,
        }
    }
}

// The subsystem hands out its namespaces here, so subsystem.rs need not know this file.
impl Subsystem {
    /// Namespace `nsid` over every path that has it, as it is through the first of them.
    pub fn namespace(self: &Arc<Self>, nsid: u32) -> Result<MpNamespace, HostError> {
        let ns = self
            .paths()
            .iter()
            .find_map(|p| p.ctrl.namespace(nsid).ok())
            .ok_or_else(|| HostError::Invalid(format!("no namespace {nsid} on any path")))?;
        Ok(MpNamespace::new(self.clone(), ns))
    }
}

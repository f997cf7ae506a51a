//! The namespaces an export serves, by name (`ns1`, `ns2`, ...): shared by a controller's
//! FUSE mount (a file each) and its NBD listener (an export name each), and grown or updated
//! while they run when the controller reports namespaces added or resized. A forced
//! disconnect fences the set ([`DevSet::close`], [`DevSet::fence`]): every request after it
//! fails at once, whoever still holds the set (a lazily detached FUSE mount keeps it until
//! its last user lets go).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use super::{BlockDev, ExportError};

/// Name and device, in the order they were added (FUSE numbers its inodes by it; the first
/// is NBD's default export).
type List = Vec<(String, Arc<BlockDev>)>;

/// Most devices one set serves (namespaces added while exported).
pub const MAX_DEVS: usize = 1024;

#[derive(Clone)]
pub struct DevSet(Arc<Shared>);

struct Shared {
    list: std::sync::RwLock<List>,
    /// Set once the exports are fenced: no request may start.
    closed: AtomicBool,
    /// Requests between [`DevSet::enter`] and the end of their answer.
    busy: AtomicUsize,
    /// Woken when the last of `busy` ends after `closed` was set.
    idle: tokio::sync::Notify,
}

/// A request of an export under way: the set is not fenced until it is dropped (after the
/// answer went out, so no answer follows a fence).
pub struct Entered(Arc<Shared>);

impl Drop for Entered {
    fn drop(&mut self) {
        if self.0.busy.fetch_sub(1, Ordering::SeqCst) == 1 && self.0.closed.load(Ordering::SeqCst) {
            self.0.idle.notify_waiters();
        }
    }
}

impl DevSet {
    /// A set of one device; `name` must be a plain file name.
    pub fn one(name: &str, dev: Arc<BlockDev>) -> Result<DevSet, ExportError> {
        check_name(name)?;
        Ok(DevSet(Arc::new(Shared {
            list: std::sync::RwLock::new(vec![(name.to_string(), dev)]),
            closed: AtomicBool::new(false),
            busy: AtomicUsize::new(0),
            idle: tokio::sync::Notify::new(),
        })))
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, List> {
        self.0.list.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, List> {
        self.0.list.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Start a request; held until its answer is sent. Fails (EIO) once the set is fenced.
    pub fn enter(&self) -> Result<Entered, ExportError> {
        // Counted before the look at `closed`: a fence either sees this request or this
        // request sees the fence (both SeqCst).
        self.0.busy.fetch_add(1, Ordering::SeqCst);
        let e = Entered(self.0.clone());
        if self.0.closed.load(Ordering::SeqCst) {
            return Err(ExportError::io(
                "export",
                std::io::Error::new(
                    std::io::ErrorKind::NotConnected,
                    "the controller was disconnected (forced)",
                ),
            ));
        }
        Ok(e)
    }

    /// Refuse every request from now on (they fail with EIO at once); requests under way
    /// go on until [`fence`](Self::fence) has waited for them.
    pub fn close(&self) {
        self.0.closed.store(true, Ordering::SeqCst);
    }

    /// Has the set been closed?
    pub fn is_closed(&self) -> bool {
        self.0.closed.load(Ordering::SeqCst)
    }

    /// [`close`](Self::close), then wait until every request under way has been answered.
    /// Whatever was not answered by then fails: nothing is acknowledged after this returns.
    pub async fn fence(&self) {
        self.close();
        loop {
            let n = self.0.idle.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            if self.0.busy.load(Ordering::SeqCst) == 0 {
                return;
            }
            n.await;
        }
    }

    pub fn get(&self, i: usize) -> Option<Arc<BlockDev>> {
        self.read().get(i).map(|(_, d)| d.clone())
    }

    pub fn index_of(&self, name: &[u8]) -> Option<usize> {
        self.read().iter().position(|(n, _)| n.as_bytes() == name)
    }

    pub fn all(&self) -> Vec<Arc<BlockDev>> {
        self.read().iter().map(|(_, d)| d.clone()).collect()
    }

    /// Every name with its device, as they are now.
    pub fn named(&self) -> List {
        self.read().clone()
    }

    /// The names, in order.
    pub fn names(&self) -> Vec<String> {
        self.read().iter().map(|(n, _)| n.clone()).collect()
    }

    /// Serve `dev` as `name` too (a namespace that appeared). A name already there, a bad
    /// name or more than [`MAX_DEVS`] is refused.
    pub fn add(&self, name: &str, dev: Arc<BlockDev>) -> Result<(), ExportError> {
        check_name(name)?;
        let mut v = self.write();
        if v.len() >= MAX_DEVS || v.iter().any(|(n, _)| n == name) {
            return Err(ExportError::io(
                "export",
                std::io::Error::new(
                    std::io::ErrorKind::AlreadyExists,
                    format!("{name} exists, or the export has {MAX_DEVS} namespaces"),
                ),
            ));
        }
        v.push((name.to_string(), dev));
        Ok(())
    }

    /// Serve `dev` as `name` from now on (a namespace that changed size): new opens and new
    /// NBD clients see the new size. Returns the old size; `None` if there is no `name`.
    pub fn replace(&self, name: &str, dev: Arc<BlockDev>) -> Option<u64> {
        let mut v = self.write();
        let slot = v.iter_mut().find(|(n, _)| n == name)?;
        let old = slot.1.size();
        slot.1 = dev;
        Some(old)
    }
}

pub(crate) fn check_name(name: &str) -> Result<(), ExportError> {
    if name.is_empty() || name.contains('/') || name == "." || name == ".." {
        return Err(ExportError::io(
            "export name",
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("bad name {name:?}"),
            ),
        ));
    }
    Ok(())
}

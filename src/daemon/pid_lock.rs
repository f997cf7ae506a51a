//! The lock that makes one daemon per run directory: `daemon.pid`, held with flock for the
//! daemon's life and naming its pid.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// The file of the lock in a run directory.
const PID_FILE: &str = "daemon.pid";

/// The run directory's lock, held; the file goes when it drops.
pub struct PidLock {
    path: PathBuf,
    _file: std::fs::File,
}

impl PidLock {
    /// Take the lock of `dir` and write our pid into it; refused, naming the holder's pid,
    /// while another daemon holds it.
    pub fn take(dir: &Path) -> Result<PidLock> {
        use std::io::Write;
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::OpenOptionsExt;
        let path = dir.join(PID_FILE);
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            // A link in our directory is not ours to truncate.
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .with_context(|| format!("open {}", path.display()))?;
        // SAFETY: flock on a descriptor we own.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let pid = std::fs::read_to_string(&path).unwrap_or_default();
            bail!(
                "a daemon already runs in {} (pid {}); set NVMF_RDMA_RUN_DIR for another",
                dir.display(),
                pid.trim()
            );
        }
        f.set_len(0)?;
        writeln!(f, "{}", std::process::id())?;
        Ok(PidLock { path, _file: f })
    }

    /// The pid of the daemon that holds the lock in `dir`, if one does.
    pub fn holder(dir: &Path) -> Option<String> {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::OpenOptionsExt;
        let path = dir.join(PID_FILE);
        let f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .ok()?;
        // SAFETY: flock on a descriptor we own; a shared lock taken here goes with `f`.
        let free = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) } == 0;
        if free {
            return None;
        }
        Some(std::fs::read_to_string(&path).ok()?.trim().to_string())
    }
}

impl Drop for PidLock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_holder_per_run_directory_and_the_file_goes_with_it() {
        let dir = std::env::temp_dir().join(format!("nvmf-pidlock-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(PidLock::holder(&dir), None);
        let held = PidLock::take(&dir).unwrap();
        assert_eq!(PidLock::holder(&dir), Some(std::process::id().to_string()));
        let e = PidLock::take(&dir)
            .err()
            .expect("a second lock")
            .to_string();
        assert!(
            e.contains("already runs") && e.contains("NVMF_RDMA_RUN_DIR"),
            "{e}"
        );
        drop(held);
        assert!(!dir.join(PID_FILE).exists());
        assert_eq!(PidLock::holder(&dir), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

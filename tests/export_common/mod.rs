//! Shared pieces of the export tests: the built-in target plus a connected host on a
//! multi-thread runtime, guards that undo mounts and loop devices even when a test fails, and
//! resets of the host soft-HCA through a fault injector.
#![allow(dead_code)]

pub mod model;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nvmf_rdma::export::BlockDev;
use nvmf_rdma::harness::nvmf_perf::{connect_host_with_faults, LocalTarget, DEMO_NQN};
use nvmf_rdma::transport::{ConnectOptions, Controller};
use nvmf_rdma::verbs::DeviceFaults;

/// Built-in RAM target and a host controller connected to it. Fields drop in order: the
/// device and controller, then the host runtime, then the target.
pub struct Stack {
    pub dev: Arc<BlockDev>,
    pub ctrl: Arc<Controller>,
    /// Resets of the host's device under `ctrl`.
    pub faults: DeviceFaults,
    pub rt: tokio::runtime::Runtime,
    pub target: LocalTarget,
}

impl Stack {
    /// `bytes` of RAM namespace with 2^`lbads`-byte blocks, `queues` I/O queues.
    pub fn start(bytes: u64, lbads: u8, queues: usize) -> Stack {
        let target = LocalTarget::start(bytes, lbads).expect("start target");
        // Multi-thread: FUSE threads and test threads block on it while its workers drive I/O.
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let (ctrl, faults) = rt
            .block_on(connect_host_with_faults(host_options(target.addr, queues)))
            .expect("connect host");
        let ctrl = Arc::new(ctrl);
        let dev = Arc::new(BlockDev::new(ctrl.clone(), 1).expect("namespace 1"));
        Stack {
            dev,
            ctrl,
            faults,
            rt,
            target,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Soft-HCA resets during writes.
//
// The issue asks for device resets in the middle of file-system writes, invisible to the file
// system except as latency. The controller runs on a managed device behind a fault injector
// (`connect_host_with_faults`), so a reset goes through the one recovery path: in-flight writes are held and resubmitted.
// NVMF_EXPORT_RESETS=N changes how many resets fire during the writes.

/// The host's options: a reset is recovered at once (reconnect_delay 0) rather than after
/// Linux's 10 s default, so the resets below cost milliseconds of latency.
pub fn host_options(addr: std::net::SocketAddr, queues: usize) -> ConnectOptions {
    let mut o = ConnectOptions::new(addr, DEMO_NQN);
    o.nr_io_queues = queues;
    o.queue_size = 128;
    o.policy.reconnect_delay = std::time::Duration::ZERO;
    o
}

/// Resets fired during the writes when NVMF_EXPORT_RESETS is not set.
pub const DEFAULT_RESETS: usize = 3;

pub fn resets_during_writes() -> usize {
    std::env::var("NVMF_EXPORT_RESETS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_RESETS)
}

/// Reset the host's soft-HCA under a live controller (a fatal error; the device comes back
/// at once) and wait until the reset has happened, from a thread outside the runtime.
pub fn reset_host_device(faults: &DeviceFaults, rt: &tokio::runtime::Handle) {
    rt.block_on(faults.reset(std::time::Duration::ZERO))
        .expect("reset the host device");
}

// ---------------------------------------------------------------------------------------------

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Is `prog` on PATH?
pub fn have(prog: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(prog).is_file()))
}

pub fn skip(test: &str, reason: &str) {
    println!("SKIPPED {test}: {reason}");
    eprintln!("SKIPPED {test}: {reason}");
}

/// Run a command, panic with its output unless it succeeds; return stdout.
pub fn run(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Poll `cond` until true or `limit` passes.
pub fn wait_for(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::yield_now();
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A scratch directory, removed (contents too) on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let p = std::env::temp_dir().join(format!("nvmf-{tag}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&p).expect("create temp dir");
        TempDir(p)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Is `path` a mount point right now (per /proc/self/mountinfo)?
pub fn is_mounted(path: &Path) -> bool {
    let Ok(canon) = path.canonicalize() else {
        return false;
    };
    let want = canon.to_string_lossy().into_owned();
    std::fs::read_to_string("/proc/self/mountinfo")
        .map(|s| {
            s.lines()
                .any(|l| l.split(' ').nth(4) == Some(want.as_str()))
        })
        .unwrap_or(false)
}

/// A file system mounted with mount(8); unmounted on drop (lazily if it is still busy).
pub struct MountGuard(pub PathBuf);

impl MountGuard {
    pub fn mount(dev: &str, at: &Path) -> MountGuard {
        run(Command::new("mount").arg(dev).arg(at));
        MountGuard(at.to_path_buf())
    }
    /// Unmount, and fail the test if that cannot be done. A process outside the test (a
    /// file indexer, a scan of /tmp) can hold the mount for a moment: on "target is busy"
    /// (exit 32) the holders are printed and the unmount is tried again, a few times.
    pub fn unmount(self) {
        for _ in 0..10 {
            let out = Command::new("umount")
                .arg(&self.0)
                .output()
                .unwrap_or_else(|e| panic!("spawn umount: {e}"));
            if out.status.success() {
                std::mem::forget(self);
                return;
            }
            let busy = out.status.code() == Some(32);
            let holders = Command::new("fuser")
                .arg("-vm")
                .arg(&self.0)
                .output()
                .map(|o| String::from_utf8_lossy(&o.stderr).into_owned())
                .unwrap_or_default();
            eprintln!(
                "umount {}: {}holders:\n{holders}",
                self.0.display(),
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(busy, "umount {} failed: {}", self.0.display(), out.status);
            std::thread::sleep(std::time::Duration::from_millis(300));
        }
        panic!("{} stayed busy", self.0.display());
    }
}

impl Drop for MountGuard {
    fn drop(&mut self) {
        if is_mounted(&self.0) {
            let ok = Command::new("umount")
                .arg(&self.0)
                .status()
                .is_ok_and(|s| s.success());
            if !ok {
                let _ = Command::new("umount").arg("-l").arg(&self.0).status();
            }
        }
    }
}

/// A loop device over a file; detached on drop.
pub struct LoopGuard(pub String);

impl LoopGuard {
    pub fn attach(file: &Path, direct_io: bool) -> LoopGuard {
        let mut c = Command::new("losetup");
        if direct_io {
            c.arg("--direct-io=on");
        }
        let dev = run(c.arg("--find").arg("--show").arg(file))
            .trim()
            .to_string();
        assert!(dev.starts_with("/dev/loop"), "losetup printed {dev:?}");
        LoopGuard(dev)
    }
    pub fn detach(self) {
        run(Command::new("losetup").arg("-d").arg(&self.0));
        std::mem::forget(self);
    }
}

impl Drop for LoopGuard {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.0).status();
    }
}

/// Deterministic pseudo-random bytes.
pub fn random_bytes(seed: u64, len: usize) -> Vec<u8> {
    use rand::{RngCore, SeedableRng};
    let mut v = vec![0u8; len];
    rand::rngs::SmallRng::seed_from_u64(seed).fill_bytes(&mut v);
    v
}

//! Who holds an export: loop devices backed by a FUSE file (and where they are mounted),
//! processes with the file open, NBD clients. An export in use is never pulled out from
//! under its user without `--force`.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

use crate::export::{ExportAddr, NbdStats};

use crate::daemon::exports::Exports;

/// One holder of an export and the command that lets it go.
#[derive(Debug, Clone, PartialEq)]
pub struct Holder {
    pub what: String,
    pub release: String,
}

/// Loop devices whose backing file is `file` (from `/sys/block/loop*/loop/backing_file`).
pub fn loop_devices_on(sys_block: &Path, file: &Path) -> Vec<String> {
    let want = file.to_string_lossy();
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(sys_block) else {
        return out;
    };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("loop") {
            continue;
        }
        let Ok(b) = std::fs::read_to_string(e.path().join("loop/backing_file")) else {
            continue;
        };
        let b = b.trim_end_matches('\n');
        if b == want || b.strip_suffix(" (deleted)") == Some(&want) {
            out.push(format!("/dev/{name}"));
        }
    }
    out.sort();
    out
}

/// Where `dev` is mounted, from a mountinfo file (`/proc/self/mountinfo`).
pub fn mounts_of(mountinfo: &str, dev: &str) -> Vec<String> {
    mountinfo
        .lines()
        .filter_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            let source = right.split(' ').nth(1)?;
            let mp = left.split(' ').nth(4)?;
            (source == dev).then(|| unescape(mp))
        })
        .collect()
}

/// mountinfo escapes space, tab, newline and backslash as octal.
fn unescape(s: &str) -> String {
    let mut out = String::new();
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() + 1 && i + 4 <= b.len() {
            if let Ok(v) = u8::from_str_radix(&s[i + 1..i + 4], 8) {
                out.push(v as char);
                i += 4;
                continue;
            }
        }
        out.push(b[i] as char);
        i += 1;
    }
    out
}

/// Processes with `file` open (their name and pid), from `/proc/*/fd`.
fn processes_with(file: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in rd.flatten() {
        let pid = e.file_name().to_string_lossy().into_owned();
        if !pid.bytes().all(|c| c.is_ascii_digit()) {
            continue;
        }
        let Ok(fds) = std::fs::read_dir(e.path().join("fd")) else {
            continue;
        };
        if fds
            .flatten()
            .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|t| t == file))
        {
            let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
            out.push(format!("{} (pid {pid})", comm.trim()));
        }
    }
    out
}

/// How long a release may take to reach the FUSE file after its last user closed it (the
/// kernel sends it asynchronously, e.g. just after `losetup -d` returned).
const RELEASE_GRACE: Duration = Duration::from_secs(2);

/// What it takes to tell whether a controller's exports are in use, cloned out of the
/// daemon's table so the look (which may wait) holds no lock.
#[derive(Clone)]
pub struct Probe {
    /// Every file of the FUSE mount, and its count of open handles (all files together).
    pub fuse: Option<(Vec<PathBuf>, Arc<AtomicUsize>)>,
    pub nbd: Option<(ExportAddr, Arc<NbdStats>)>,
}

impl Exports {
    pub fn probe(&self) -> Probe {
        Probe {
            fuse: self.fuse.as_ref().map(|m| {
                let files = m.files().names();
                let paths = files.iter().map(|n| m.mountpoint().join(n)).collect();
                (paths, m.open_counter())
            }),
            nbd: self.nbd_at.clone(),
        }
    }
}

impl Probe {
    /// In use at this instant (no waiting, no scan).
    pub fn busy_now(&self) -> bool {
        self.fuse
            .as_ref()
            .is_some_and(|(_, n)| n.load(Ordering::SeqCst) > 0)
            || self
                .nbd
                .as_ref()
                .is_some_and(|(_, s)| s.connections.load(Ordering::SeqCst) > 0)
    }
}

/// Who holds the exports of `p` now. With open handles but no loop device, waits up to
/// [`RELEASE_GRACE`] for releases still on their way before calling the file held.
pub async fn holders(p: &Probe) -> Vec<Holder> {
    let mut out = Vec::new();
    if let Some((addr, stats)) = &p.nbd {
        let n = stats.connections.load(Ordering::SeqCst);
        if n > 0 {
            let pids = stats
                .client_pids
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            out.push(Holder {
                what: nbd_holders(
                    n,
                    &pids,
                    &addr.uri(),
                    Path::new("/proc"),
                    Path::new("/sys/block"),
                ),
                release: "disconnect them (nbd-client -d /dev/nbdN, or end nbdinfo, nbdcopy, \
                          qemu-nbd)"
                    .into(),
            });
        }
    }
    if let Some((files, opens)) = &p.fuse {
        out.extend(fuse_holders(files, opens).await);
    }
    out
}

/// "N NBD client(s) on URI", naming the processes behind `pids` (from `proc`): the command
/// and pid, and the kernel NBD device a `nbd-client` set up (`sys_block/nbd*/pid`).
pub fn nbd_holders(n: usize, pids: &[i32], uri: &str, proc: &Path, sys_block: &Path) -> String {
    let mut who: Vec<String> = pids
        .iter()
        .map(|pid| {
            let comm = std::fs::read_to_string(proc.join(pid.to_string()).join("comm"))
                .map(|c| c.trim().to_string());
            let dev = nbd_device_of(sys_block, *pid);
            match (comm, dev) {
                (Ok(c), Some(d)) => format!("{c} (pid {pid}, {d})"),
                (Ok(c), None) => format!("{c} (pid {pid})"),
                (Err(_), Some(d)) => format!("{d} (set up by pid {pid}, exited)"),
                (Err(_), None) => format!("pid {pid} (exited)"),
            }
        })
        .collect();
    who.sort();
    let mut s = format!("{n} NBD client(s) on {uri}");
    if !who.is_empty() {
        s += &format!(": {}", who.join(", "));
    }
    s
}

/// The kernel NBD device (`/dev/nbdN`) whose `pid` file names `pid`.
fn nbd_device_of(sys_block: &Path, pid: i32) -> Option<String> {
    let rd = std::fs::read_dir(sys_block).ok()?;
    rd.flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("nbd"))
        .find(|n| {
            std::fs::read_to_string(sys_block.join(n).join("pid"))
                .is_ok_and(|p| p.trim() == pid.to_string())
        })
        .map(|n| format!("/dev/{n}"))
}

/// How long a loop device that `losetup -d` already let go may take to detach: the kernel
/// clears it at its last close (autoclear), and udev's probe after `umount` can hold it open
/// for seconds.
const DETACH_GRACE: Duration = Duration::from_secs(5);

/// `dev` (`/dev/loopN`) is detaching: autoclear is set (`losetup -d` on a device still open)
/// and nothing mounts it. (`mount -o loop` sets autoclear too, but mounts it.)
pub fn detaching(sys_block: &Path, dev: &str, mountinfo: &str) -> bool {
    let name = dev.trim_start_matches("/dev/");
    std::fs::read_to_string(sys_block.join(name).join("loop/autoclear"))
        .is_ok_and(|s| s.trim() == "1")
        && mounts_of(mountinfo, dev).is_empty()
}

/// Holders of a FUSE export's files.
async fn fuse_holders(files: &[PathBuf], opens: &AtomicUsize) -> Vec<Holder> {
    let sys_block = Path::new("/sys/block");
    let deadline = Instant::now() + DETACH_GRACE;
    let (loops, info) = loop {
        let loops: Vec<(PathBuf, String)> = files
            .iter()
            .flat_map(|f| {
                loop_devices_on(sys_block, f)
                    .into_iter()
                    .map(move |d| (f.clone(), d))
            })
            .collect();
        let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        // Only devices on their way out: give the kernel a moment rather than refuse.
        let all_detaching = loops.iter().all(|(_, d)| detaching(sys_block, d, &info));
        if loops.is_empty() || !all_detaching || Instant::now() >= deadline {
            break (loops, info);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    if !loops.is_empty() {
        return loops
            .into_iter()
            .map(|(file, dev)| {
                let mounts = mounts_of(&info, &dev);
                let (what, release) = if detaching(sys_block, &dev, &info) {
                    (
                        format!(
                            "{} backs {dev}, which is detaching (the kernel lets it go at its \
                             last close)",
                            file.display()
                        ),
                        format!("close what still has {dev} open, or retry in a moment"),
                    )
                } else if mounts.is_empty() {
                    (
                        format!("{} backs {dev}", file.display()),
                        format!("losetup -d {dev}"),
                    )
                } else {
                    (
                        format!(
                            "{} backs {dev}, mounted on {}",
                            file.display(),
                            mounts.join(", ")
                        ),
                        format!("umount {} && losetup -d {dev}", mounts.join(" ")),
                    )
                };
                Holder { what, release }
            })
            .collect();
    }
    // Releases the kernel has not delivered yet (the last user already closed).
    let deadline = Instant::now() + RELEASE_GRACE;
    while opens.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let n = opens.load(Ordering::SeqCst);
    if n == 0 {
        return Vec::new();
    }
    let procs: Vec<String> = files.iter().flat_map(|f| processes_with(f)).collect();
    let names: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
    let what = if procs.is_empty() {
        format!("{} is open ({n} handle(s))", names.join(", "))
    } else {
        format!("{} is open by {}", names.join(", "), procs.join(", "))
    };
    vec![Holder {
        what,
        release: "close it (fuser -v shows who has it open)".into(),
    }]
}

/// One line: what holds `name`'s exports and how to let them go.
pub fn in_use_message(name: &str, h: &[Holder]) -> (String, String) {
    let what: Vec<&str> = h.iter().map(|h| h.what.as_str()).collect();
    let release: Vec<&str> = h.iter().map(|h| h.release.as_str()).collect();
    (
        format!("{name} is in use: {}", what.join("; ")),
        format!("release it with: {}", release.join("; ")),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loop_devices_and_their_mounts_are_found() {
        let d = std::env::temp_dir().join(format!("nvmf-usage-{}", std::process::id()));
        for (dev, backing) in [
            ("loop0", Some("/mnt/x/ns1\n")),
            ("loop1", Some("/other\n")),
            ("loop2", None),
            ("loop7", Some("/mnt/x/ns1 (deleted)\n")),
            ("sda", Some("/mnt/x/ns1\n")),
        ] {
            std::fs::create_dir_all(d.join(dev).join("loop")).unwrap();
            if let Some(b) = backing {
                std::fs::write(d.join(dev).join("loop/backing_file"), b).unwrap();
            }
        }
        assert_eq!(
            loop_devices_on(&d, Path::new("/mnt/x/ns1")),
            ["/dev/loop0", "/dev/loop7"]
        );
        assert!(loop_devices_on(&d, Path::new("/mnt/y/ns1")).is_empty());
        // losetup -d on a device still open sets autoclear; a mount -o loop device has it too.
        std::fs::write(d.join("loop0/loop/autoclear"), "1\n").unwrap();
        std::fs::write(d.join("loop7/loop/autoclear"), "0\n").unwrap();
        let mounted = "36 35 7:0 / /mnt/m rw - ext4 /dev/loop0 rw\n";
        assert!(detaching(&d, "/dev/loop0", ""));
        assert!(!detaching(&d, "/dev/loop0", mounted));
        assert!(!detaching(&d, "/dev/loop7", ""));
        assert!(!detaching(&d, "/dev/loop1", ""));
        std::fs::remove_dir_all(&d).unwrap();
        let info = "36 35 98:0 / /mnt/my\\040data rw,noatime master:1 - ext4 /dev/loop0 rw\n\
                    37 35 98:0 / /srv rw - ext4 /dev/loop1 rw\n";
        assert_eq!(mounts_of(info, "/dev/loop0"), ["/mnt/my data"]);
        assert!(mounts_of(info, "/dev/loop9").is_empty());
        let (m, h) = in_use_message(
            "nvmf0",
            &[Holder {
                what: "/mnt/x/ns1 backs /dev/loop0, mounted on /mnt/d".into(),
                release: "umount /mnt/d && losetup -d /dev/loop0".into(),
            }],
        );
        assert!(
            m.contains("nvmf0 is in use") && m.contains("/dev/loop0"),
            "{m}"
        );
        assert!(h.contains("losetup -d /dev/loop0"), "{h}");
    }

    #[test]
    fn nbd_clients_are_named_by_command_pid_and_device() {
        let d = std::env::temp_dir().join(format!("nvmf-nbd-holders-{}", std::process::id()));
        let (proc, sys) = (d.join("proc"), d.join("sys"));
        for (pid, comm) in [(41, "nbdinfo"), (42, "qemu-nbd")] {
            std::fs::create_dir_all(proc.join(pid.to_string())).unwrap();
            std::fs::write(proc.join(pid.to_string()).join("comm"), format!("{comm}\n")).unwrap();
        }
        std::fs::create_dir_all(sys.join("nbd3")).unwrap();
        std::fs::write(sys.join("nbd3/pid"), "43\n").unwrap();
        std::fs::create_dir_all(sys.join("nbd4")).unwrap();
        std::fs::write(sys.join("nbd4/pid"), "42\n").unwrap();
        let s = nbd_holders(4, &[42, 41, 43, 44], "nbd+unix:///?socket=/s", &proc, &sys);
        assert_eq!(
            s,
            "4 NBD client(s) on nbd+unix:///?socket=/s: /dev/nbd3 (set up by pid 43, exited), \
             nbdinfo (pid 41), pid 44 (exited), qemu-nbd (pid 42, /dev/nbd4)"
        );
        // Clients whose process is not known (over TCP): counted only.
        assert_eq!(
            nbd_holders(2, &[], "nbd://h", &proc, &sys),
            "2 NBD client(s) on nbd://h"
        );
        std::fs::remove_dir_all(&d).unwrap();
    }
}

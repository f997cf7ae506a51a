//! The namespace as a file system on a real kernel: FUSE file (ours, or `nbdfuse` over our NBD
//! export) → `losetup --direct-io=on` → mkfs.ext4 → mount → write files → (soft-HCA resets,
//! see `export_common`) → umount, drop caches, remount → read back by checksum → `fsck -n`.
//! Needs root, /dev/fuse and loop devices; prints SKIPPED and passes without them (CI is root).

use std::io::Write;
use std::path::Path;
use std::process::{Child, Command};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::export_common::*;
use nvmf_rdma::export::{mount_fuse, NbdListener};

const NS_BYTES: u64 = 256 << 20;

fn preconditions(test: &str, tools: &[&str]) -> bool {
    if !is_root() {
        skip(test, "needs root (loop devices, mount)");
        return false;
    }
    for dev in ["/dev/fuse", "/dev/loop-control"] {
        if !Path::new(dev).exists() {
            skip(test, &format!("{dev} is absent"));
            return false;
        }
    }
    for t in ["losetup", "mkfs.ext4", "mount", "umount", "fsck.ext4"]
        .iter()
        .chain(tools)
    {
        if !have(t) {
            skip(test, &format!("{t} is not installed"));
            return false;
        }
    }
    true
}

struct Written {
    name: String,
    crc: u32,
    data: Vec<u8>,
}

/// mkfs, mount, write, reset, remount, verify, fsck on the block device over `file`.
fn ext4_roundtrip(stack: &Stack, file: &Path, tmp: &Path) {
    let lo = LoopGuard::attach(file, true);
    run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&lo.0));
    let mnt = tmp.join("fs");
    std::fs::create_dir_all(&mnt).unwrap();
    let m = MountGuard::mount(&lo.0, &mnt);

    // The resetter fires while a file's data is being written back (between the writes and
    // the end of its fsync).
    let resets = resets_during_writes();
    let (tx, rx) = mpsc::channel::<()>();
    let faults = stack.faults.clone();
    let rt = stack.rt.handle().clone();
    let resetter = std::thread::spawn(move || {
        let mut n = 0;
        while rx.recv().is_ok() {
            reset_host_device(&faults, &rt);
            n += 1;
        }
        n
    });
    const FILES: usize = 24;
    let reset_at: Vec<usize> = (1..=resets).map(|k| k * FILES / (resets + 1)).collect();
    let mut written = Vec::new();
    for i in 0..FILES {
        // Sizes from 1 MiB to ~4 MiB, most not a multiple of the block size.
        let len = (1 << 20) + i * 131_071;
        let data = random_bytes(0xF11E + i as u64, len);
        let name = format!("file-{i:02}.bin");
        let mut f = std::fs::File::create(mnt.join(&name)).unwrap();
        f.write_all(&data).unwrap();
        if reset_at.contains(&i) {
            tx.send(()).unwrap();
        }
        f.sync_all().unwrap();
        written.push(Written {
            name,
            crc: crc32fast::hash(&data),
            data,
        });
    }
    drop(tx);
    assert_eq!(resetter.join().unwrap(), resets);
    if resets > 0 {
        // Every fsync above succeeded, so the controller came back each time.
        let st = stack.ctrl.status();
        assert!(st.machine.recoveries >= 1, "{st:?}");
        eprintln!(
            "{resets} resets during the writes, {} recoveries",
            st.machine.recoveries
        );
    }
    run(&mut Command::new("sync"));
    m.unmount();

    std::fs::write("/proc/sys/vm/drop_caches", "3\n").unwrap();
    let m = MountGuard::mount(&lo.0, &mnt);
    for w in &written {
        let back = std::fs::read(mnt.join(&w.name)).unwrap();
        assert_eq!(
            crc32fast::hash(&back),
            w.crc,
            "{} checksum after remount",
            w.name
        );
        assert!(back == w.data, "{} contents after remount", w.name);
    }
    m.unmount();
    let out = run(Command::new("fsck.ext4").args(["-n", "-f"]).arg(&lo.0));
    println!("fsck: {}", out.trim());
    lo.detach();
}

#[test]
fn fuse_file_loop_ext4() {
    if !preconditions("fuse_file_loop_ext4", &[]) {
        return;
    }
    let stack = Stack::start(NS_BYTES, 9, 2);
    let tmp = TempDir::new("fuse");
    let mp = tmp.path().join("mnt");
    std::fs::create_dir_all(&mp).unwrap();
    let fuse = mount_fuse(stack.dev.clone(), stack.rt.handle().clone(), &mp, "ns1").unwrap();
    wait_for("the FUSE file", Duration::from_secs(10), || {
        fuse.file().exists()
    });
    assert_eq!(std::fs::metadata(fuse.file()).unwrap().len(), NS_BYTES);
    ext4_roundtrip(&stack, fuse.file(), tmp.path());
    fuse.unmount().unwrap();
}

/// nbdfuse (libnbd) as the kernel-facing side, our NBD server behind it.
struct NbdFuse {
    child: Child,
    mp: std::path::PathBuf,
}

impl Drop for NbdFuse {
    fn drop(&mut self) {
        if is_mounted(&self.mp) {
            let _ = Command::new("fusermount3").arg("-u").arg(&self.mp).status();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn nbdfuse_loop_ext4() {
    if !preconditions("nbdfuse_loop_ext4", &["nbdfuse", "fusermount3"]) {
        return;
    }
    let stack = Stack::start(NS_BYTES, 12, 2);
    let tmp = TempDir::new("nbdfuse");
    let sock = tmp.path().join("nbd.sock");
    let l = stack
        .rt
        .block_on(NbdListener::bind(
            &format!("unix:{}", sock.display()).parse().unwrap(),
        ))
        .unwrap();
    let uri = l.addr().uri();
    let server = stack.rt.spawn(l.serve(stack.dev.clone(), "ns1".into()));
    let mp = tmp.path().join("mnt");
    std::fs::create_dir_all(&mp).unwrap();
    let child = Command::new("nbdfuse").arg(&mp).arg(&uri).spawn().unwrap();
    let nf = NbdFuse {
        child,
        mp: mp.clone(),
    };
    let file = mp.join("nbd");
    let t0 = Instant::now();
    wait_for("the nbdfuse file", Duration::from_secs(20), || {
        std::fs::metadata(&file).is_ok_and(|m| m.len() == NS_BYTES)
    });
    println!("nbdfuse ready after {:?}", t0.elapsed());
    ext4_roundtrip(&stack, &file, tmp.path());
    drop(nf);
    server.abort();
}

/// Sequential MB/s through FUSE + loop (docs/performance.md). 1 GiB each way with dd, O_DIRECT.
/// `cargo test --release --test suite -- --ignored --nocapture fuse_loop_seq_bench`
#[test]
#[ignore = "benchmark"]
fn fuse_loop_seq_bench() {
    if !preconditions("fuse_loop_seq_bench", &["dd"]) {
        return;
    }
    let gib: u64 = std::env::var("BENCH_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1024);
    let stack = Stack::start(gib << 20, 9, 2);
    let tmp = TempDir::new("fusebench");
    let mp = tmp.path().join("mnt");
    std::fs::create_dir_all(&mp).unwrap();
    let fuse = mount_fuse(stack.dev.clone(), stack.rt.handle().clone(), &mp, "ns1").unwrap();
    let lo = LoopGuard::attach(fuse.file(), true);
    let count = format!("count={gib}");
    let t = Instant::now();
    run(Command::new("dd")
        .args([
            "if=/dev/zero",
            "bs=1M",
            "oflag=direct",
            "status=none",
            &count,
        ])
        .arg(format!("of={}", lo.0)));
    let w = gib as f64 * 1.048576 / t.elapsed().as_secs_f64();
    let t = Instant::now();
    run(Command::new("dd")
        .args([
            "of=/dev/null",
            "bs=1M",
            "iflag=direct",
            "status=none",
            &count,
        ])
        .arg(format!("if={}", lo.0)));
    let r = gib as f64 * 1.048576 / t.elapsed().as_secs_f64();
    println!("fuse+loop dd bs=1M direct {gib} MiB: write {w:.0} MB/s, read {r:.0} MB/s");
    lo.detach();
    fuse.unmount().unwrap();
}

//! The namespace as one regular file in a FUSE mount, for kernels without an NBD driver:
//! `losetup --direct-io=on /dev/loopN MOUNTPOINT/ns1` makes it a block device. Namespaces
//! that appear later can be added as more files of the same mount ([`FuseFiles::add`]).
//!
//! Files are opened `direct_io` (no page cache between the loop device and the controller,
//! and O_DIRECT opens work), reads and writes of any alignment go to [`BlockDev`], `fsync` and
//! `flush` send an NVMe Flush, and `fallocate` (what the loop driver turns discards and
//! zero-outs into) becomes Write Zeroes. Handlers run on fuser's threads and wait on the
//! controller through a tokio runtime handle.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use fuser::{
    Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, INodeNo, KernelConfig,
    LockOwner, MountOption, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty,
    ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, Request, SessionACL, TimeOrNow, WriteFlags,
};
use tokio::runtime::Handle;

use super::devset::check_name;
use super::{BlockDev, DevSet, ExportError};

const FILE_INO: INodeNo = INodeNo(2);
/// How long the kernel may keep attributes: a namespace resized on the target changes its
/// file's size ([`DevSet::replace`]), seen within this time.
const TTL: Duration = Duration::from_secs(1);
/// Largest read or write the kernel sends per request.
const MAX_IO: u32 = 1 << 20;
/// fuser worker threads, each waiting on one request at a time.
const THREADS: usize = 8;
/// How a mount of ours shows in /proc/self/mountinfo: its source, and its type (`fuse`, or
/// `fuse.` and the subtype when the mount helper passes it on).
const FS_NAME: &str = "nvmf-rdma";
const SUBTYPE: &str = "nvmf";

struct NsFile {
    /// The files, each a namespace: inode 2 + index. Namespaces the controller reports
    /// later are added while mounted ([`FuseFiles::add`]).
    files: FuseFiles,
    /// Open handles on the file (a loop device holds one): what makes the export in use.
    opens: Arc<AtomicUsize>,
    rt: Handle,
    uid: u32,
    gid: u32,
    born: SystemTime,
}

impl NsFile {
    fn attr(&self, ino: INodeNo) -> Option<FileAttr> {
        let first = self.files.get(0)?;
        let (kind, perm, nlink, size, bs) = if ino == INodeNo::ROOT {
            (FileType::Directory, 0o755, 2, 0, first.block_size())
        } else {
            let dev = self.dev_of(ino)?;
            (
                FileType::RegularFile,
                0o600,
                1,
                dev.size(),
                dev.block_size(),
            )
        };
        Some(FileAttr {
            ino,
            size,
            blocks: size.div_ceil(512),
            atime: self.born,
            mtime: self.born,
            ctime: self.born,
            crtime: self.born,
            kind,
            perm,
            nlink,
            uid: self.uid,
            gid: self.gid,
            rdev: 0,
            flags: 0,
            blksize: bs.max(4096),
        })
    }

    /// The namespace behind file inode `ino`.
    fn dev_of(&self, ino: INodeNo) -> Option<Arc<BlockDev>> {
        let i = ino.0.checked_sub(FILE_INO.0)?;
        self.files.get(usize::try_from(i).ok()?)
    }

    /// A data request starts: refused (EIO) once a forced disconnect fenced the export. The
    /// guard lives until the handler has answered.
    fn enter(&self) -> Option<super::devset::Entered> {
        self.files.enter().ok()
    }

    fn wait<T>(
        &self,
        f: impl std::future::Future<Output = Result<T, ExportError>>,
    ) -> Result<T, Errno> {
        self.rt.block_on(f).map_err(|e| {
            tracing::warn!("fuse request failed: {e}");
            Errno::from_i32(e.errno())
        })
    }
}

impl Filesystem for NsFile {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let _ = config.set_max_write(MAX_IO);
        let _ = config.set_max_readahead(MAX_IO);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let ino = (parent == INodeNo::ROOT)
            .then(|| self.files.index_of(name.as_encoded_bytes()))
            .flatten()
            .map(|i| INodeNo(FILE_INO.0 + i as u64));
        match ino.and_then(|ino| self.attr(ino)) {
            Some(a) => reply.entry(&TTL, &a, fuser::Generation(0)),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.attr(ino) {
            Some(a) => reply.attr(&TTL, &a),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let Some(a) = self.attr(ino) else {
            return reply.error(Errno::ENOENT);
        };
        // The size is the namespace's (open with O_TRUNC or `dd` without conv=notrunc fails
        // here rather than pretending); ownership and mode are fixed; times are accepted.
        if size.is_some_and(|s| s != a.size) {
            return reply.error(Errno::EPERM);
        }
        if mode.is_some_and(|m| m & 0o7777 != a.perm as u32)
            || uid.is_some_and(|u| u != a.uid)
            || gid.is_some_and(|g| g != a.gid)
        {
            return reply.error(Errno::EPERM);
        }
        reply.attr(&TTL, &a)
    }

    fn open(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        if self.dev_of(ino).is_none() {
            return reply.error(Errno::EISDIR);
        }
        self.opens.fetch_add(1, Ordering::SeqCst);
        reply.opened(
            FileHandle(0),
            FopenFlags::FOPEN_DIRECT_IO | FopenFlags::FOPEN_PARALLEL_DIRECT_WRITES,
        )
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        if self.dev_of(ino).is_some() {
            // Saturating: a release the kernel sends for an open we never counted is no harm.
            let _ = self
                .opens
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        }
        reply.ok()
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let Some(_io) = self.enter() else {
            return reply.error(Errno::EIO);
        };
        let Some(dev) = self.dev_of(ino) else {
            return reply.error(Errno::EISDIR);
        };
        let end = dev.size();
        let n = end.saturating_sub(offset).min(size as u64) as usize;
        match self.wait(dev.read_at(offset.min(end), n)) {
            Ok(d) => reply.data(&d),
            Err(e) => reply.error(e),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let Some(_io) = self.enter() else {
            return reply.error(Errno::EIO);
        };
        let Some(dev) = self.dev_of(ino) else {
            return reply.error(Errno::EISDIR);
        };
        let room = dev.size().saturating_sub(offset);
        if room == 0 && !data.is_empty() {
            return reply.error(Errno::from_i32(libc::ENOSPC));
        }
        let data = &data[..(data.len() as u64).min(room) as usize];
        // O_SYNC / O_DSYNC writers get FUA semantics.
        let sync = flags.0 & (libc::O_SYNC | libc::O_DSYNC) != 0;
        match self.wait(dev.write_at(offset, data, sync)) {
            Ok(()) => reply.written(data.len() as u32),
            Err(e) => reply.error(e),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        let Some(_io) = self.enter() else {
            return reply.error(Errno::EIO);
        };
        let Some(dev) = self.dev_of(ino) else {
            return reply.ok();
        };
        match self.wait(dev.flush()) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        let Some(_io) = self.enter() else {
            return reply.error(Errno::EIO);
        };
        let Some(dev) = self.dev_of(ino) else {
            return reply.ok();
        };
        match self.wait(dev.flush()) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let Some(_io) = self.enter() else {
            return reply.error(Errno::EIO);
        };
        let Some(dev) = self.dev_of(ino) else {
            return reply.error(Errno::EISDIR);
        };
        let end = offset.checked_add(length);
        let inside = end.is_some_and(|e| e <= dev.size());
        let zero = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_ZERO_RANGE;
        let known = zero | libc::FALLOC_FL_KEEP_SIZE;
        if mode & !known != 0 {
            return reply.error(Errno::from_i32(libc::EOPNOTSUPP));
        }
        if !inside {
            // Growing the file is impossible; inside it every block is already allocated.
            return reply.error(Errno::from_i32(libc::ENOSPC));
        }
        if mode & zero == 0 {
            return reply.ok();
        }
        // A punched hole must read back as zeroes, which Deallocate does not promise on every
        // controller: both modes are Write Zeroes.
        match self.wait(dev.write_zeroes_at(offset, length, false)) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        if ino != INodeNo::ROOT {
            return reply.error(Errno::ENOTDIR);
        }
        let mut entries = vec![
            (INodeNo::ROOT, FileType::Directory, ".".to_string()),
            (INodeNo::ROOT, FileType::Directory, "..".to_string()),
        ];
        for (i, name) in self.files.names().into_iter().enumerate() {
            entries.push((INodeNo(FILE_INO.0 + i as u64), FileType::RegularFile, name));
        }
        for (i, (ino, kind, name)) in entries.iter().enumerate().skip(offset as usize) {
            if reply.add(*ino, (i + 1) as u64, *kind, name) {
                break;
            }
        }
        reply.ok()
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let files = self.files.all();
        let bs = files.first().map_or(512, |d| d.block_size() as u64);
        let blocks = files.iter().map(|d| d.size()).sum::<u64>() / bs;
        reply.statfs(blocks, 0, 0, 2, 0, bs as u32, 255, bs as u32);
    }
}

/// The files of a mount: the namespaces it serves.
pub type FuseFiles = DevSet;

/// A mounted FUSE file system; unmounted on drop.
pub struct FuseMount {
    session: Option<fuser::BackgroundSession>,
    opens: Arc<AtomicUsize>,
    files: FuseFiles,
    mountpoint: PathBuf,
    file: PathBuf,
}

impl FuseMount {
    /// The file that holds the namespace.
    pub fn file(&self) -> &Path {
        &self.file
    }

    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// The mount's files (the first is [`file`](Self::file)); more can be added.
    pub fn files(&self) -> FuseFiles {
        self.files.clone()
    }

    /// Open handles on the file now (each open by a process or a loop device, until its
    /// release reaches us).
    pub fn open_files(&self) -> usize {
        self.opens.load(Ordering::SeqCst)
    }

    /// The live count behind [`open_files`](Self::open_files), for watching it without
    /// holding the mount.
    pub fn open_counter(&self) -> Arc<AtomicUsize> {
        self.opens.clone()
    }

    /// Unmount and wait for the FUSE thread. Fails (and stays mounted) while the file is in
    /// use, for example by a loop device.
    pub fn unmount(mut self) -> Result<(), ExportError> {
        match self.session.take() {
            Some(s) => s
                .umount_and_join()
                .map_err(|e| ExportError::io(format!("unmount {}", self.mountpoint.display()), e)),
            None => Ok(()),
        }
    }
}

impl Drop for FuseMount {
    fn drop(&mut self) {
        if let Some(s) = self.session.take() {
            if let Err(e) = s.umount_and_join() {
                tracing::warn!("unmount {}: {e}", self.mountpoint.display());
            }
        }
    }
}

/// Mount `dev` at `mountpoint` as a single file named `name`. `rt` is the runtime the
/// controller lives on; it must keep running (a multi-thread runtime, or a thread blocked in
/// `Runtime::block_on`) while the mount is used.
pub fn mount_fuse(
    dev: Arc<BlockDev>,
    rt: Handle,
    mountpoint: &Path,
    name: &str,
) -> Result<FuseMount, ExportError> {
    mount_fuse_set(DevSet::one(name, dev)?, rt, mountpoint)
}

/// Mount every device of `files` as a file of its name (and those added later); the first
/// is [`FuseMount::file`].
pub fn mount_fuse_set(
    files: DevSet,
    rt: Handle,
    mountpoint: &Path,
) -> Result<FuseMount, ExportError> {
    let name = files.names().into_iter().next().unwrap_or_default();
    check_name(&name)?;
    let opens = Arc::new(AtomicUsize::new(0));
    let fs = NsFile {
        files: files.clone(),
        opens: opens.clone(),
        rt,
        // SAFETY: geteuid/getegid cannot fail and touch no memory.
        uid: unsafe { libc::geteuid() },
        gid: unsafe { libc::getegid() },
        born: SystemTime::now(),
    };
    let mut cfg = Config::default();
    cfg.mount_options = vec![
        MountOption::FSName(FS_NAME.into()),
        MountOption::Subtype(SUBTYPE.into()),
        MountOption::NoSuid,
        MountOption::NoDev,
        MountOption::NoExec,
    ];
    cfg.acl = SessionACL::Owner;
    cfg.n_threads = Some(THREADS);
    cfg.clone_fd = true;
    detach_stale(mountpoint)?;
    let session = fuser::spawn_mount(fs, mountpoint, &cfg)
        .map_err(|e| ExportError::io(format!("fuse mount at {}", mountpoint.display()), e))?;
    Ok(FuseMount {
        session: Some(session),
        opens,
        files,
        mountpoint: mountpoint.to_path_buf(),
        file: mountpoint.join(&name),
    })
}

/// A mount of ours left at `mountpoint` by a process that died (its FUSE connection is gone,
/// so the mount point answers ENOTCONN) is detached, so that a restarted daemon can mount
/// there again. Anything else there is left for the mount to report.
fn detach_stale(mountpoint: &Path) -> Result<(), ExportError> {
    match std::fs::metadata(mountpoint) {
        Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => {}
        _ => return Ok(()),
    }
    // The mount table has the resolved path; the mount point itself cannot be resolved.
    let resolved = match (mountpoint.parent(), mountpoint.file_name()) {
        (Some(dir), Some(name)) => std::fs::canonicalize(if dir.as_os_str().is_empty() {
            Path::new(".")
        } else {
            dir
        })
        .map(|d| d.join(name)),
        _ => std::path::absolute(mountpoint),
    }
    .map_err(|e| ExportError::io(format!("resolve {}", mountpoint.display()), e))?;
    let table = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| ExportError::io("read /proc/self/mountinfo", e))?;
    if !ours_mounted_at(&table, &resolved) {
        return Ok(());
    }
    let what = format!(
        "detach the stale mount at {} (fusermount3 -u -z does it by hand)",
        mountpoint.display()
    );
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(resolved.as_os_str().as_bytes()).map_err(|_| {
        ExportError::io(
            what.clone(),
            std::io::Error::from(std::io::ErrorKind::InvalidInput),
        )
    })?;
    // SAFETY: a valid NUL-terminated path; umount2 touches no memory of ours.
    if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } != 0 {
        return Err(ExportError::io(what, std::io::Error::last_os_error()));
    }
    tracing::info!("{}: detached a stale mount of ours", mountpoint.display());
    Ok(())
}

/// Is the top mount at `mp` in `mountinfo` (proc(5) format) a FUSE mount of ours?
fn ours_mounted_at(mountinfo: &str, mp: &Path) -> bool {
    let top = mountinfo
        .lines()
        .rev()
        .filter_map(|l| {
            let (head, tail) = l.split_once(" - ")?;
            let point = unescape(head.split(' ').nth(4)?);
            let mut t = tail.split(' ');
            Some((point, t.next()?, t.next()?))
        })
        .find(|(point, ..)| Path::new(point) == mp);
    top.is_some_and(|(_, fs_type, source)| {
        source == FS_NAME && (fs_type == "fuse" || fs_type.strip_prefix("fuse.") == Some(SUBTYPE))
    })
}

/// A mountinfo field with its octal escapes (`\040` for a space) undone.
fn unescape(field: &str) -> String {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let oct = b
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match (b[i], oct) {
            (b'\\', Some(d)) => {
                out.push(d.iter().fold(0u8, |v, c| v.wrapping_mul(8) + (c - b'0')));
                i += 4;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod mount_table_tests {
    use super::*;

    const TABLE: &str = "\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
40 22 0:40 / /mnt/a\\040b rw,nosuid,nodev,noexec shared:2 - fuse.nvmf nvmf-rdma rw,user_id=0
41 22 0:41 / /mnt/other rw shared:3 - fuse.sshfs host:/ rw
42 22 0:42 / /mnt/over rw shared:4 - fuse.nvmf nvmf-rdma rw
43 42 0:43 / /mnt/over rw shared:5 - tmpfs tmpfs rw
44 22 0:44 / /mnt/plain rw,relatime - fuse nvmf-rdma rw,user_id=0,group_id=0
";

    #[test]
    fn only_the_top_mount_of_ours_counts() {
        assert!(ours_mounted_at(TABLE, Path::new("/mnt/a b")));
        assert!(!ours_mounted_at(TABLE, Path::new("/mnt/other")));
        assert!(
            !ours_mounted_at(TABLE, Path::new("/mnt/over")),
            "covered by tmpfs"
        );
        assert!(!ours_mounted_at(TABLE, Path::new("/mnt")));
        assert!(ours_mounted_at(TABLE, Path::new("/mnt/plain")));
    }
}

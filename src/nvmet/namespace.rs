//! Namespace backends for the built-in target: RAM or a file, and each namespace's own
//! identity (NGUID and UUID), which hosts tell namespaces apart by.
//!
//! A RAM namespace gets a new random identity each time it is made: its data does not
//! outlive it either. A file namespace keeps its identity in a small text file beside it,
//! `<file>.nvmf-id`, written when the file is first served: a restarted target reports the
//! same identity, so hosts keep using it across the restart. Copying the file elsewhere
//! without its `.nvmf-id` makes a different namespace; removing the `.nvmf-id` gives the
//! file a new identity (hosts then treat it as another disk).

use std::any::Any;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::hca::HostMem;
use crate::nvme::{NsIdentity, Status};
use crate::verbs::HostBuffer;

/// Back a RAM namespace with memory taken now, as SPDK's malloc bdev does: left to the
/// kernel, the first write to each 4 KiB page would take a page fault, which on a virtual
/// machine costs more than the rest of the write (random 4 KiB writes ran at half speed
/// until the namespace was full). Transparent huge pages are asked for first, so taking
/// 1 GiB is 512 faults (about a second here). Best effort: where the kernel lacks
/// MADV_POPULATE_WRITE (before 5.14) or THP, pages come on first write as before.
///
/// Pages are taken a few MiB per call: populating holds the process's memory-map lock, and
/// one call over a whole namespace kept another thread's mmap or munmap (a large buffer
/// allocated or freed while serving a host) waiting until it was done.
fn take_ram(mem: &[u8]) {
    const HUGE: usize = 2 << 20;
    const PAGE: usize = 4096;
    const STEP: usize = 2 * HUGE;
    /// MADV_POPULATE_WRITE, Linux 5.14 (not in every libc crate version).
    const POPULATE_WRITE: libc::c_int = 23;
    let (base, len) = (mem.as_ptr() as usize, mem.len());
    for (align, advice, step) in [
        (HUGE, libc::MADV_HUGEPAGE, len),
        (PAGE, POPULATE_WRITE, STEP),
    ] {
        let start = base.next_multiple_of(align);
        let end = (base + len) & !(align - 1);
        let mut at = start;
        while at < end {
            let n = (end - at).min(step.max(align));
            // SAFETY: advice on whole pages inside an allocation we own. Neither changes
            // its contents: populating write-faults pages in without writing to them.
            unsafe {
                libc::madvise(at as *mut libc::c_void, n, advice);
            }
            at += n;
        }
    }
}

/// A RAM namespace's memory: a device's [`HostBuffer`] behind an object-safe face, so a
/// [`Namespace`] need not be generic over the device. An engine whose device registers this
/// very memory type (found with [`RamStore::as_any`]) sends the namespace's data to hosts
/// with RDMA straight from it; any other engine copies through its staging. Each access is
/// atomic against the others and against the device's own copies (the buffer's lock), so
/// a read never sees part of a block written.
pub trait RamStore: Send + Sync + 'static {
    fn as_any(&self) -> &dyn Any;
    fn read(&self, offset: usize, out: &mut [u8]);
    fn write(&self, offset: usize, data: &[u8]);
    fn zero(&self, offset: usize, len: usize);
}

impl<M: HostBuffer> RamStore for M {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn read(&self, offset: usize, out: &mut [u8]) {
        HostBuffer::read(self, offset, out)
    }

    fn write(&self, offset: usize, data: &[u8]) {
        HostBuffer::write(self, offset, data)
    }

    fn zero(&self, offset: usize, len: usize) {
        self.with_range(offset, len, |g| g.fill(0))
    }
}

/// The most namespaces a subsystem has: all a host sees in one Identify Active Namespace
/// ID list (1024 IDs), which is as far as our host and Linux look.
pub const MAX_NAMESPACES: usize = 1024;

/// A RAM namespace's memory could not be had (the process's or the system's limit).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("no memory for a RAM namespace of {0} bytes: ask for less, or use a file namespace")]
pub struct NoMemory(pub u64);

/// Where a namespace keeps its blocks.
pub enum Backend {
    Ram(Box<dyn RamStore>),
    File { file: File, direct: bool },
}

pub struct Namespace {
    pub nsid: u32,
    /// What hosts tell this namespace apart by (Identify Namespace NGUID, the UUID
    /// descriptor): random at creation, kept beside a file namespace's file.
    pub ident: NsIdentity,
    /// log2 of the block size (9 = 512 B, 12 = 4 KiB).
    pub lbads: u8,
    pub blocks: u64,
    /// The ANA group it belongs to (Identify Namespace ANAGRPID), fixed while it is
    /// attached: its access state through a port is that group's there.
    pub anagrpid: u32,
    backend: Backend,
}

impl std::fmt::Debug for Namespace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Namespace({} x {} B)", self.blocks, self.block_size())
    }
}

impl Namespace {
    /// A RAM namespace of `bytes` (rounded down to whole blocks), in the soft-HCA's memory.
    /// Panics when the memory cannot be had: for tests and benches, which pick their own
    /// sizes. A size an operator or a peer asks for goes through [`Namespace::try_ram`].
    pub fn ram(nsid: u32, bytes: u64, lbads: u8) -> Namespace {
        Namespace::try_ram(nsid, bytes, lbads).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`Namespace::ram`], or an error when the memory cannot be had.
    pub fn try_ram(nsid: u32, bytes: u64, lbads: u8) -> Result<Namespace, NoMemory> {
        Namespace::try_ram_in::<HostMem>(nsid, bytes, lbads)
    }

    /// A RAM namespace in device memory of type `M`: a target on a device whose
    /// [`crate::verbs::DeviceContext::Mem`] is `M` reads it out to hosts without a copy.
    /// The pages are taken before it returns (seconds per GiB on a busy machine): call it
    /// where blocking is fine, not on a thread that serves queues.
    pub fn try_ram_in<M: HostBuffer>(
        nsid: u32,
        bytes: u64,
        lbads: u8,
    ) -> Result<Namespace, NoMemory> {
        let blocks = bytes >> lbads;
        let len = usize::try_from(blocks << lbads).map_err(|_| NoMemory(bytes))?;
        // Mapped lazily, then taken at once with huge pages (`take_ram`).
        let mem = M::try_alloc_lazy(len).ok_or(NoMemory(bytes))?;
        mem.with_range(0, len, |g| take_ram(g));
        mem.stream_writes();
        Ok(Namespace {
            nsid,
            ident: random_identity(),
            lbads,
            blocks,
            anagrpid: super::ana::DEFAULT_GROUP,
            backend: Backend::Ram(Box::new(mem)),
        })
    }

    /// A file namespace. The file is created and sized if `size` is given; O_DIRECT is used
    /// when the file system accepts it (otherwise the page cache, and flush does fsync). Its
    /// identity is read from `<path>.nvmf-id`, which is made when there is none.
    pub fn file(
        nsid: u32,
        path: &Path,
        size: Option<u64>,
        lbads: u8,
    ) -> std::io::Result<Namespace> {
        use std::os::unix::fs::OpenOptionsExt;
        let open = |direct: bool| {
            let mut o = std::fs::OpenOptions::new();
            o.read(true).write(true).create(size.is_some());
            if direct {
                o.custom_flags(libc::O_DIRECT);
            }
            o.open(path)
        };
        // O_DIRECT needs aligned buffers; our staging buffers are not guaranteed to be, so
        // direct I/O stays off until the target allocates aligned staging memory.
        let (file, direct) = (open(false)?, false);
        if let Some(s) = size {
            if file.metadata()?.len() < s {
                file.set_len(s)?;
            }
        }
        let len = file.metadata()?.len();
        let ident = file_identity(path)?;
        Ok(Namespace {
            nsid,
            ident,
            lbads,
            blocks: len >> lbads,
            anagrpid: super::ana::DEFAULT_GROUP,
            backend: Backend::File { file, direct },
        })
    }

    /// This namespace in ANA group `anagrpid` (1..=[`super::ana::MAX_GROUPS`]) instead of
    /// the default group.
    pub fn in_ana_group(mut self, anagrpid: u32) -> Result<Namespace, String> {
        super::ana::check_group(anagrpid)?;
        self.anagrpid = anagrpid;
        Ok(self)
    }

    pub fn block_size(&self) -> u32 {
        1 << self.lbads
    }

    pub fn bytes(&self) -> u64 {
        self.blocks << self.lbads
    }

    /// The byte range of `nlb` blocks at `slba`, or LBA Out of Range.
    pub fn range(&self, slba: u64, nlb: u64) -> Result<(u64, usize), Status> {
        let end = slba
            .checked_add(nlb)
            .ok_or(Status::LBA_OUT_OF_RANGE.with_dnr())?;
        if end > self.blocks {
            return Err(Status::LBA_OUT_OF_RANGE.with_dnr());
        }
        Ok((slba << self.lbads, (nlb << self.lbads) as usize))
    }

    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), Status> {
        match &self.backend {
            Backend::Ram(m) => {
                m.read(offset as usize, out);
                Ok(())
            }
            Backend::File { file, .. } => file
                .read_exact_at(out, offset)
                .map_err(|_| Status::INTERNAL_ERROR),
        }
    }

    pub fn write(&self, offset: u64, data: &[u8]) -> Result<(), Status> {
        match &self.backend {
            Backend::Ram(m) => {
                m.write(offset as usize, data);
                Ok(())
            }
            Backend::File { file, .. } => file
                .write_all_at(data, offset)
                .map_err(|_| Status::INTERNAL_ERROR),
        }
    }

    /// Is this namespace in RAM (its reads and writes cost a copy at most)?
    pub fn is_ram(&self) -> bool {
        matches!(self.backend, Backend::Ram(_))
    }

    /// The memory of a RAM namespace.
    pub fn ram_store(&self) -> Option<&dyn RamStore> {
        match &self.backend {
            Backend::Ram(m) => Some(&**m),
            Backend::File { .. } => None,
        }
    }

    /// The most one [`Namespace::zero_step`] does: bounds how long a worker is busy with one
    /// host's zeroing before another's work gets a turn.
    pub const ZERO_STEP: usize = 1 << 20;

    /// Zero (deallocate) the start of `len` bytes at `offset`: at most
    /// [`Namespace::ZERO_STEP`] of them, returning how many (at least one unless `len` is 0).
    /// A file gets a hole punched where its file system can (reads then return zeros, as
    /// Linux nvmet's file backend does), else zeros written.
    pub fn zero_step(&self, offset: u64, len: usize) -> Result<usize, Status> {
        let n = len.min(Self::ZERO_STEP);
        match &self.backend {
            Backend::Ram(m) => {
                m.zero(offset as usize, n);
                Ok(n)
            }
            Backend::File { file, .. } => {
                use std::os::fd::AsRawFd;
                // SAFETY: fallocate on a descriptor we own; it touches no memory of ours.
                let punched = unsafe {
                    libc::fallocate(
                        file.as_raw_fd(),
                        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                        offset as libc::off_t,
                        n as libc::off_t,
                    )
                } == 0;
                if !punched {
                    static ZEROS: [u8; 64 << 10] = [0; 64 << 10];
                    let mut done = 0;
                    while done < n {
                        let k = (n - done).min(ZEROS.len());
                        self.write(offset + done as u64, &ZEROS[..k])?;
                        done += k;
                    }
                }
                Ok(n)
            }
        }
    }

    pub fn flush(&self) -> Result<(), Status> {
        match &self.backend {
            Backend::Ram(_) => Ok(()),
            Backend::File { file, direct } => {
                if *direct {
                    Ok(())
                } else {
                    file.sync_data().map_err(|_| Status::INTERNAL_ERROR)
                }
            }
        }
    }
}

/// A new identity from the OS CSPRNG: an NGUID, and a UUID with the RFC 4122 version 4
/// layout (what a host's `nvme id-ns` and multipath see).
pub fn random_identity() -> NsIdentity {
    use rand::TryRngCore;
    let mut b = [0u8; 32];
    if rand::rngs::OsRng.try_fill_bytes(&mut b).is_err() {
        // The OS refused entropy: a generator it keyed earlier.
        rand::RngCore::fill_bytes(&mut rand::rng(), &mut b);
    }
    let mut id = NsIdentity::default();
    id.nguid.copy_from_slice(&b[..16]);
    id.uuid.copy_from_slice(&b[16..]);
    id.uuid[6] = (id.uuid[6] & 0x0F) | 0x40;
    id.uuid[8] = (id.uuid[8] & 0x3F) | 0x80;
    id
}

/// Where the identity of the file namespace at `path` is kept.
pub fn identity_path(path: &Path) -> std::path::PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".nvmf-id");
    p.into()
}

/// The identity kept beside `path`; a new one is made and written there when there is none.
/// A file that is there but is not an identity is an error, and is left as it is.
fn file_identity(path: &Path) -> std::io::Result<NsIdentity> {
    use std::io::Write;
    let at = identity_path(path);
    let bad = |why: String| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "{}: {why}; it should hold the namespace's identity (lines `nguid <32 hex \
                 digits>` and `uuid <UUID>`): restore it, or remove it to give {} a new \
                 identity",
                at.display(),
                path.display()
            ),
        )
    };
    match read_small(&at) {
        Ok(text) => return parse_identity(&text).map_err(bad),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(bad(e.to_string())),
    }
    let id = random_identity();
    let mut f = match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&at)
    {
        Ok(f) => f,
        // Made meanwhile by another target serving the same file: its identity is ours.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let text = read_small(&at)?;
            return parse_identity(&text).map_err(bad);
        }
        Err(e) => {
            return Err(std::io::Error::new(
                e.kind(),
                format!(
                    "cannot make {} to keep the namespace's identity ({e}): make its \
                     directory writable, or serve the file from a directory that is",
                    at.display()
                ),
            ))
        }
    };
    f.write_all(format_identity(&id).as_bytes())?;
    f.sync_all()?;
    Ok(id)
}

/// An identity file's text: its first 4 KiB at most (it is about 100 bytes; anything much
/// longer is not one, and is refused by its content rather than read whole).
fn read_small(at: &Path) -> std::io::Result<String> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(at)?
        .take(4096)
        .read_to_string(&mut text)?;
    Ok(text)
}

/// The text of an identity file.
fn format_identity(id: &NsIdentity) -> String {
    let hex: String = id.nguid.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "# nvmf-rdma namespace identity: keep with the file it names\nnguid {hex}\nuuid {}\n",
        id.uuid_text()
    )
}

/// An identity file's text: `nguid` and `uuid` lines, `#` comments, blank lines.
fn parse_identity(text: &str) -> Result<NsIdentity, String> {
    fn hex(s: &str, out: &mut [u8]) -> bool {
        let s: Vec<u8> = s.bytes().filter(|&b| b != b'-').collect();
        s.len() == out.len() * 2
            && s.chunks(2).zip(out.iter_mut()).all(|(c, o)| {
                std::str::from_utf8(c)
                    .ok()
                    .and_then(|c| u8::from_str_radix(c, 16).ok())
                    .map(|v| *o = v)
                    .is_some()
            })
    }
    let mut id = NsIdentity::default();
    let (mut nguid, mut uuid) = (false, false);
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        match line.split_once(char::is_whitespace) {
            Some(("nguid", v)) if !nguid && hex(v.trim(), &mut id.nguid) => nguid = true,
            Some(("uuid", v)) if !uuid && hex(v.trim(), &mut id.uuid) => uuid = true,
            _ => return Err(format!("line {line:?} is not understood")),
        }
    }
    if !(nguid && uuid) || id.is_empty() {
        return Err("an nguid or uuid line is missing".into());
    }
    Ok(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_identities_differ_and_have_the_uuid_layout() {
        let (a, b) = (random_identity(), random_identity());
        assert_ne!(a.nguid, b.nguid);
        assert_ne!(a.uuid, b.uuid);
        assert_eq!(a.uuid[6] >> 4, 4);
        assert_eq!(a.uuid[8] >> 6, 2);
    }

    #[test]
    fn identity_text_round_trips_and_bad_text_is_refused() {
        let id = random_identity();
        assert_eq!(parse_identity(&format_identity(&id)), Ok(id));
        for bad in [
            "",
            "nguid 00\nuuid 00",
            "nguid 0123456789abcdef0123456789abcdef\n",
            "nguid 0123456789abcdef0123456789abcdeg\nuuid 01234567-89ab-4def-8123-456789abcdef",
            "hello",
        ] {
            assert!(parse_identity(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_file_namespace_keeps_its_identity_beside_the_file() {
        let dir = std::env::temp_dir().join(format!("nvmf-id-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let disk = dir.join("disk.img");
        let a = Namespace::file(1, &disk, Some(1 << 20), 9).unwrap();
        let b = Namespace::file(1, &disk, None, 9).unwrap();
        assert_eq!(a.ident, b.ident, "the same file is the same namespace");
        assert!(!a.ident.is_empty());
        let other = Namespace::file(1, &dir.join("other.img"), Some(1 << 20), 9).unwrap();
        assert_ne!(a.ident, other.ident);
        // Something else where the identity belongs is left alone and named.
        std::fs::write(identity_path(&disk), "precious\n").unwrap();
        let e = Namespace::file(1, &disk, None, 9).unwrap_err().to_string();
        assert!(
            e.contains("disk.img.nvmf-id") && e.contains("remove it"),
            "{e}"
        );
        assert_eq!(
            std::fs::read_to_string(identity_path(&disk)).unwrap(),
            "precious\n"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// More than any address space holds (1 PiB): an error, not an abort.
    #[test]
    fn a_ram_namespace_that_cannot_be_had_is_an_error() {
        assert_eq!(
            Namespace::try_ram(1, 1 << 50, 9).map(|n| n.blocks),
            Err(NoMemory(1 << 50))
        );
        let ns = Namespace::try_ram(1, 64 << 10, 12).unwrap();
        assert_eq!((ns.blocks, ns.bytes()), (16, 64 << 10));
    }
}

//! Protection domains and memory regions: the table the responder consults for every remote
//! access and the requester for every local gather/scatter.
//!
//! Keys are random 32-bit values (an rkey must not be guessable by a peer) and unique within
//! the device. Every access is checked for key, protection domain, bounds and access flags
//! before a byte moves.

use crate::verbs::{Access, MrInfo, PdId};
use rustc_hash::FxHashMap;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use rand::Rng;

pub use super::copy::STREAM_MIN;
use super::copy::{copy_bytes, copy_streaming, extend_bytes};
use crate::verbs::MemKey;

/// Host memory that an HCA may read and write, the soft-HCA's stand-in for pinned pages.
///
/// It is shared between the application and the device. As with real DMA, the consumer owns
/// the bytes of a buffer only while no work request that names them is outstanding; the lock
/// only makes each copy atomic, it does not order them. Every access names its byte range
/// and only that range is ever borrowed, never the whole buffer: a caller that fills other
/// bytes of a registered buffer through [`HostMem::addr`] at the same moment (a registered
/// I/O buffer handed to C code) does not alias what the device touches.
#[derive(Clone)]
pub struct HostMem {
    inner: Arc<MemInner>,
}

struct MemInner {
    /// Makes each device-side copy atomic against the others.
    lock: Mutex<()>,
    /// The bytes, from a `Box<[u8]>` given up at creation and taken back on drop; only
    /// ranges of it are ever borrowed, under `lock`.
    ptr: NonNull<u8>,
    len: usize,
    /// Writes of [`STREAM_MIN`] bytes or more bypass the cache ([`HostMem::stream_writes`]).
    stream: AtomicBool,
}

// SAFETY: plain owned memory; every access goes through `lock` and names its range.
unsafe impl Send for MemInner {}
// SAFETY: as above.
unsafe impl Sync for MemInner {}

impl Drop for MemInner {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` came from `Box::into_raw` of a boxed slice in `from_boxed`,
        // and nothing borrows the bytes any more (this is the last owner).
        unsafe {
            drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.ptr.as_ptr(),
                self.len,
            )))
        }
    }
}

impl HostMem {
    pub fn new(len: usize) -> HostMem {
        let mut bytes = vec![0u8; len].into_boxed_slice();
        // Fault every page in now, as registration pins pages on a real HCA, so the data
        // path never takes a first-touch page fault.
        for page in bytes.chunks_mut(4096) {
            // SAFETY: a volatile store of zero into memory we own; it only forces the page in.
            unsafe { std::ptr::write_volatile(page.as_mut_ptr(), 0) };
        }
        HostMem::from_boxed(bytes)
    }

    /// [`new`](Self::new) that reports an allocation failure instead of aborting: for
    /// memory a peer asks for (queue rings), where running out is a refusal, not a crash.
    /// Every byte is written, so the pages are in as with `new`.
    pub fn try_new(len: usize) -> Result<HostMem, std::collections::TryReserveError> {
        Ok(HostMem::from_vec(try_zeroed(len)?))
    }

    /// Zeroed memory whose pages come in as they are first used, or `None` when it cannot
    /// be had. For a target's staging, where connecting (and every reconnect) must be quick
    /// and a queue rarely uses all of its slots' room: a 128-entry queue of 1 MiB slots costs
    /// a mapping, not 128 MiB of page faults before the host hears back.
    pub fn try_new_lazy(len: usize) -> Option<HostMem> {
        if len == 0 {
            return Some(HostMem::from_vec(Vec::new()));
        }
        let layout = std::alloc::Layout::array::<u8>(len).ok()?;
        // SAFETY: the layout has a non-zero size. alloc_zeroed gives null or `len` zeroed
        // bytes; large blocks come from fresh mappings whose pages are zero until touched.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        if p.is_null() {
            return None;
        }
        // SAFETY: `p` holds `len` initialised (zero) bytes from the global allocator with
        // the layout of a `Vec<u8>` of capacity `len`.
        let v = unsafe { Vec::from_raw_parts(p, len, len) };
        Some(HostMem::from_vec(v))
    }

    pub fn from_vec(v: Vec<u8>) -> HostMem {
        HostMem::from_boxed(v.into_boxed_slice())
    }

    fn from_boxed(bytes: Box<[u8]>) -> HostMem {
        let len = bytes.len();
        // The address of the allocation never changes, so it serves as the I/O virtual
        // address of the buffer, as a process virtual address does for real verbs.
        let raw = Box::into_raw(bytes) as *mut u8;
        HostMem {
            inner: Arc::new(MemInner {
                lock: Mutex::new(()),
                // SAFETY: a boxed slice's pointer is never null (dangling but non-null
                // when empty).
                ptr: unsafe { NonNull::new_unchecked(raw) },
                len,
                stream: AtomicBool::new(false),
            }),
        }
    }

    /// The address of byte 0, as used in SGEs and RETHs.
    pub fn addr(&self) -> u64 {
        self.inner.ptr.as_ptr() as u64
    }

    pub fn len(&self) -> usize {
        self.inner.len
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Run `f` over bytes `offset..offset + len` and nothing else, atomically with respect
    /// to the device's other copies. A poisoned lock is used as is: a panic in another
    /// holder cannot leave bytes half-copied in a way that matters more than a torn DMA.
    /// Panics if the range leaves the buffer.
    pub fn with_range<R>(&self, offset: usize, len: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
        let end = offset.checked_add(len).expect("range overflows");
        assert!(
            end <= self.inner.len,
            "range {offset}+{len} leaves a {}-byte buffer",
            self.inner.len
        );
        let _g = self.inner.lock.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: in bounds; the lock makes this the only borrow the device side holds, and
        // by the DMA contract nobody else touches bytes a posted request names.
        f(unsafe { std::slice::from_raw_parts_mut(self.inner.ptr.as_ptr().add(offset), len) })
    }

    pub fn read(&self, offset: usize, out: &mut [u8]) {
        self.with_range(offset, out.len(), |b| copy_bytes(out, b))
    }

    pub fn write(&self, offset: usize, data: &[u8]) {
        if data.len() >= STREAM_MIN && self.inner.stream.load(Ordering::Relaxed) {
            return self.with_range(offset, data.len(), |b| copy_streaming(b, data));
        }
        self.with_range(offset, data.len(), |b| copy_bytes(b, data))
    }

    /// From now on, [`write`](Self::write)s of [`STREAM_MIN`] bytes or more store past the
    /// CPU's caches (non-temporal stores). For memory far larger than any cache that is
    /// written far more than it is read back soon: a RAM namespace. There every write missed
    /// the cache anyway, and an ordinary store first reads the line it fills (twice the
    /// memory traffic), then evicts something the data path uses. Own loop, 6 alternated
    /// rounds: 4 KiB random writes 1.09x at QD32 and 1.10x at QD1, 128 KiB writes 1.10x
    /// (docs/performance.md, "128 KiB transfers").
    pub fn stream_writes(&self) {
        self.inner.stream.store(true, Ordering::Relaxed);
    }

    /// Append bytes `offset..offset + len` to `out`.
    pub fn append_to(&self, offset: usize, len: usize, out: &mut Vec<u8>) {
        self.with_range(offset, len, |b| extend_bytes(out, b))
    }

    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.len());
        self.append_to(0, self.len(), &mut v);
        v
    }

    pub fn same(&self, other: &HostMem) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

/// `len` zero bytes, or the allocation error (never an abort).
pub fn try_zeroed(len: usize) -> Result<Vec<u8>, std::collections::TryReserveError> {
    let mut v = Vec::new();
    v.try_reserve_exact(len)?;
    v.resize(len, 0);
    Ok(v)
}

impl std::fmt::Debug for HostMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostMem({:#x}+{})", self.addr(), self.len())
    }
}

pub(crate) struct Mr {
    pub pd: PdId,
    pub mem: HostMem,
    /// Offset of the region's first byte within `mem`.
    pub offset: usize,
    pub info: MrInfo,
    /// The length and access it was registered with: the most a new key may cover
    /// ([`MrTable::rekey`]); `info` says what the current key covers.
    pub registered: (u64, Access),
    /// Cleared by a SEND with Invalidate naming the rkey.
    pub valid: bool,
}

/// Why an access to a region was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AccessError {
    /// No such key, or the region was invalidated.
    BadKey,
    /// The region belongs to another protection domain.
    WrongPd,
    /// The range leaves the region.
    OutOfBounds,
    /// The region does not grant the operation.
    NotPermitted,
}

/// A resolved access: which memory and where in it.
pub(crate) struct Resolved<'a> {
    pub mem: &'a HostMem,
    pub offset: usize,
}

#[derive(Default)]
pub(crate) struct MrTable {
    by_key: FxHashMap<u32, Mr>,
}

impl MrTable {
    pub fn insert(
        &mut self,
        rng: &mut impl Rng,
        pd: PdId,
        mem: HostMem,
        offset: usize,
        len: usize,
        access: Access,
    ) -> MrInfo {
        let key = loop {
            let k: u32 = rng.random();
            if k != 0 && !self.by_key.contains_key(&k) {
                break k;
            }
        };
        let remote =
            access.intersects(Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC);
        let info = MrInfo {
            lkey: MemKey(key),
            rkey: if remote { MemKey(key) } else { MemKey(0) },
            addr: mem.addr() + offset as u64,
            len: len as u64,
            access,
        };
        self.by_key.insert(
            key,
            Mr {
                pd,
                mem,
                offset,
                info,
                registered: (info.len, access),
                valid: true,
            },
        );
        info
    }

    pub fn remove(&mut self, key: MemKey) -> bool {
        self.by_key.remove(&key.0).is_some()
    }

    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    pub fn clear(&mut self) {
        self.by_key.clear();
    }

    pub fn any_in_pd(&self, pd: PdId) -> bool {
        self.by_key.values().any(|m| m.pd == pd)
    }

    /// Check an access of `len` bytes at `addr` under `key` from a QP in `pd`.
    /// Zero-length accesses need no valid key (IBA 9.4.1.1, 9.4.4).
    pub fn resolve(
        &self,
        pd: PdId,
        key: MemKey,
        addr: u64,
        len: u64,
        need: Access,
        remote: bool,
    ) -> Result<Option<Resolved<'_>>, AccessError> {
        if len == 0 {
            return Ok(None);
        }
        let mr = self.by_key.get(&key.0).ok_or(AccessError::BadKey)?;
        if !mr.valid || (remote && mr.info.rkey != key) {
            return Err(AccessError::BadKey);
        }
        if mr.pd != pd {
            return Err(AccessError::WrongPd);
        }
        let end = addr.checked_add(len).ok_or(AccessError::OutOfBounds)?;
        if addr < mr.info.addr || end > mr.info.addr + mr.info.len {
            return Err(AccessError::OutOfBounds);
        }
        if !mr.info.access.contains(need) {
            return Err(AccessError::NotPermitted);
        }
        Ok(Some(Resolved {
            mem: &mr.mem,
            offset: mr.offset + (addr - mr.info.addr) as usize,
        }))
    }

    /// Fast registration (the effect of IB_WR_REG_MR with a new key): the region under `key`
    /// answers from now on to a fresh key only, lkey and rkey alike, and is valid again,
    /// over its first `len` bytes with `access` (both at most what it was registered
    /// with). The old key is refused at once. Returns the region's new description, or
    /// `None` when `key` names no region or `len` or `access` exceed its registration.
    pub fn rekey(
        &mut self,
        rng: &mut impl Rng,
        key: MemKey,
        len: u64,
        access: Access,
    ) -> Option<MrInfo> {
        let mr = self.by_key.get(&key.0)?;
        let (most, allowed) = mr.registered;
        if len > most || !allowed.contains(access) {
            return None;
        }
        let mut mr = self.by_key.remove(&key.0)?;
        let new = loop {
            let k: u32 = rng.random();
            if k != 0 && k != key.0 && !self.by_key.contains_key(&k) {
                break k;
            }
        };
        mr.info.lkey = MemKey(new);
        if mr.info.rkey.0 != 0 {
            mr.info.rkey = MemKey(new);
        }
        mr.info.len = len;
        mr.info.access = access;
        mr.valid = true;
        let info = mr.info;
        self.by_key.insert(new, mr);
        Some(info)
    }

    /// Local invalidate (IB_WR_LOCAL_INV): the region refuses every access under `key` until
    /// it is given a new one. Invalidating an invalid region is no error.
    pub fn invalidate_local(&mut self, key: MemKey) -> Result<(), AccessError> {
        let mr = self.by_key.get_mut(&key.0).ok_or(AccessError::BadKey)?;
        mr.valid = false;
        Ok(())
    }

    /// SEND with Invalidate: only remotely accessible regions of the QP's PD may be invalidated.
    pub fn invalidate(&mut self, pd: PdId, rkey: MemKey) -> Result<(), AccessError> {
        let mr = self.by_key.get_mut(&rkey.0).ok_or(AccessError::BadKey)?;
        if mr.info.rkey != rkey || !mr.valid {
            return Err(AccessError::BadKey);
        }
        if mr.pd != pd {
            return Err(AccessError::WrongPd);
        }
        mr.valid = false;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    /// A buffer marked for streaming writes holds what was written, long or short, at any
    /// offset, and other bytes stay as they were.
    #[test]
    fn a_streaming_buffer_reads_back_what_was_written() {
        let mem = HostMem::new(64 << 10);
        mem.stream_writes();
        let long: Vec<u8> = (0..STREAM_MIN * 4 + 3).map(|i| (i * 7) as u8).collect();
        mem.write(5, &long);
        mem.write(40_000, &long[..STREAM_MIN - 1]);
        let mut back = vec![0u8; long.len()];
        mem.read(5, &mut back);
        assert_eq!(back, long);
        mem.read(40_000, &mut back[..STREAM_MIN - 1]);
        assert_eq!(&back[..STREAM_MIN - 1], &long[..STREAM_MIN - 1]);
        let mut edge = [1u8; 5];
        mem.read(0, &mut edge);
        assert_eq!(edge, [0; 5]);
    }

    #[test]
    fn a_rekeyed_region_answers_to_its_new_key_only_and_local_invalidate_shuts_it() {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
        let mut t = MrTable::default();
        let mem = HostMem::new(4096);
        let rw = Access::REMOTE_WRITE | Access::LOCAL_WRITE;
        let old = t.insert(&mut rng, PdId(1), mem.clone(), 0, 4096, rw);
        let new = t.rekey(&mut rng, old.lkey, 4096, rw).unwrap();
        assert_ne!(new.rkey, old.rkey);
        assert_eq!(new.lkey, new.rkey);
        assert_eq!((new.addr, new.len), (old.addr, old.len));
        let at = |t: &MrTable, k: MemKey| {
            t.resolve(PdId(1), k, old.addr, 8, Access::REMOTE_WRITE, true)
                .map(|r| r.is_some())
        };
        assert_eq!(at(&t, old.rkey), Err(AccessError::BadKey));
        assert_eq!(at(&t, new.rkey), Ok(true));
        t.invalidate_local(new.lkey).unwrap();
        assert_eq!(at(&t, new.rkey), Err(AccessError::BadKey));
        // A second invalidation is harmless; a rekey makes the region usable again.
        t.invalidate_local(new.lkey).unwrap();
        let again = t.rekey(&mut rng, new.lkey, 4096, rw).unwrap();
        assert_eq!(at(&t, again.rkey), Ok(true));
        assert_eq!(t.len(), 1);
        assert!(
            t.rekey(&mut rng, new.lkey, 4096, rw).is_none(),
            "the old key names nothing"
        );
        assert!(t.remove(again.lkey));
    }

    /// A new key covers what it was asked to and no more; the registration bounds it.
    #[test]
    fn a_rekeyed_region_covers_the_length_and_access_of_its_use() {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(3);
        let mut t = MrTable::default();
        let mem = HostMem::new(64 << 10);
        let rw = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE;
        let reg = t.insert(&mut rng, PdId(1), mem, 0, 64 << 10, rw);
        let at = |t: &MrTable, k: MemKey, len: u64, need: Access| {
            t.resolve(PdId(1), k, reg.addr, len, need, true)
                .map(|r| r.is_some())
        };
        let read = t
            .rekey(&mut rng, reg.lkey, 1024, Access::REMOTE_READ)
            .unwrap();
        assert_eq!((read.len, read.access), (1024, Access::REMOTE_READ));
        assert_eq!(at(&t, read.rkey, 1024, Access::REMOTE_READ), Ok(true));
        assert_eq!(
            at(&t, read.rkey, 1025, Access::REMOTE_READ),
            Err(AccessError::OutOfBounds)
        );
        assert_eq!(
            at(&t, read.rkey, 8, Access::REMOTE_WRITE),
            Err(AccessError::NotPermitted)
        );
        let write = Access::REMOTE_WRITE | Access::LOCAL_WRITE;
        let w = t.rekey(&mut rng, read.lkey, 64 << 10, write).unwrap();
        assert_eq!(at(&t, w.rkey, 64 << 10, Access::REMOTE_WRITE), Ok(true));
        assert_eq!(
            at(&t, w.rkey, 8, Access::REMOTE_READ),
            Err(AccessError::NotPermitted)
        );
        assert!(
            t.rekey(&mut rng, w.lkey, (64 << 10) + 1, write).is_none(),
            "longer than registered"
        );
        assert!(
            t.rekey(&mut rng, w.lkey, 8, Access::REMOTE_ATOMIC)
                .is_none(),
            "an access it was not registered with"
        );
        assert_eq!(
            at(&t, w.rkey, 8, Access::REMOTE_WRITE),
            Ok(true),
            "refusals keep the key"
        );
    }

    #[test]
    fn checks_key_pd_bounds_and_access() {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(1);
        let mut t = MrTable::default();
        let mem = HostMem::new(4096);
        let info = t.insert(
            &mut rng,
            PdId(1),
            mem.clone(),
            1024,
            2048,
            Access::REMOTE_WRITE | Access::LOCAL_WRITE,
        );
        assert_eq!(info.addr, mem.addr() + 1024);
        assert_eq!(info.lkey, info.rkey);
        let a = info.addr;
        let ok = t
            .resolve(PdId(1), info.rkey, a + 10, 100, Access::REMOTE_WRITE, true)
            .unwrap()
            .unwrap();
        assert_eq!(ok.offset, 1034);
        assert_eq!(
            t.resolve(
                PdId(1),
                MemKey(info.rkey.0 ^ 1),
                a,
                1,
                Access::REMOTE_WRITE,
                true
            )
            .err(),
            Some(AccessError::BadKey)
        );
        assert_eq!(
            t.resolve(PdId(2), info.rkey, a, 1, Access::REMOTE_WRITE, true)
                .err(),
            Some(AccessError::WrongPd)
        );
        assert_eq!(
            t.resolve(PdId(1), info.rkey, a + 2000, 49, Access::REMOTE_WRITE, true)
                .err(),
            Some(AccessError::OutOfBounds)
        );
        assert_eq!(
            t.resolve(PdId(1), info.rkey, a - 1, 2, Access::REMOTE_WRITE, true)
                .err(),
            Some(AccessError::OutOfBounds)
        );
        assert_eq!(
            t.resolve(PdId(1), info.rkey, u64::MAX, 2, Access::REMOTE_WRITE, true)
                .err(),
            Some(AccessError::OutOfBounds)
        );
        assert_eq!(
            t.resolve(PdId(1), info.rkey, a, 1, Access::REMOTE_READ, true)
                .err(),
            Some(AccessError::NotPermitted)
        );
        assert!(t
            .resolve(PdId(1), MemKey(0), 0, 0, Access::REMOTE_READ, true)
            .unwrap()
            .is_none());
        t.invalidate(PdId(1), info.rkey).unwrap();
        assert_eq!(
            t.resolve(PdId(1), info.rkey, a, 1, Access::REMOTE_WRITE, true)
                .err(),
            Some(AccessError::BadKey)
        );
    }

    #[test]
    fn local_only_region_has_no_rkey() {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(2);
        let mut t = MrTable::default();
        let info = t.insert(
            &mut rng,
            PdId(1),
            HostMem::new(64),
            0,
            64,
            Access::LOCAL_WRITE,
        );
        assert_eq!(info.rkey, MemKey(0));
        assert!(t
            .resolve(PdId(1), info.lkey, info.addr, 8, Access::LOCAL_WRITE, false)
            .is_ok());
        assert_eq!(
            t.resolve(PdId(1), info.lkey, info.addr, 8, Access::empty(), true)
                .err(),
            Some(AccessError::BadKey)
        );
    }
}

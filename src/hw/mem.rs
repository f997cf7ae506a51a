//! Host memory for a kernel RDMA device: page-aligned, zeroed buffers the host allocates
//! once and registers again on every new context.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;
use std::sync::{Mutex, MutexGuard};

use crate::verbs::HostBuffer;

/// Page-aligned, zeroed host memory that a kernel RDMA device may DMA into once registered.
/// The host keeps it across contexts and registers it again on each.
pub struct HwMem {
    ptr: NonNull<u8>,
    layout: Layout,
    /// Makes host-side access atomic (the device's DMA is not ordered by it, as with any
    /// registered memory: the bytes of a posted request belong to the device until it
    /// completes).
    lock: Mutex<()>,
}

// SAFETY: plain owned memory; host access goes through `lock`.
unsafe impl Send for HwMem {}
// SAFETY: as above.
unsafe impl Sync for HwMem {}

impl Drop for HwMem {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

impl HwMem {
    pub(super) fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// The first byte, for registering the buffer by hand.
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    fn guard(&self) -> MutexGuard<'_, ()> {
        self.lock.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl HwMem {
    /// `len` zeroed, page-aligned bytes (pages come in as registration pins them), or why
    /// not: the layout, if it cannot be had.
    fn try_new(len: usize) -> Result<HwMem, Option<Layout>> {
        let layout = Layout::from_size_align(len.max(1), 4096).map_err(|_| None)?;
        // SAFETY: non-zero size.
        let p = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(p).ok_or(Some(layout))?;
        Ok(HwMem {
            ptr,
            layout,
            lock: Mutex::new(()),
        })
    }
}

impl HostBuffer for HwMem {
    fn alloc(len: usize) -> HwMem {
        match HwMem::try_new(len) {
            Ok(m) => m,
            Err(Some(layout)) => std::alloc::handle_alloc_error(layout),
            Err(None) => panic!("buffer size overflows"),
        }
    }

    fn try_alloc(len: usize) -> Option<HwMem> {
        HwMem::try_new(len).ok()
    }

    /// Registration pins every page of a kernel device's MR, so nothing is lazier than this.
    fn try_alloc_lazy(len: usize) -> Option<HwMem> {
        HwMem::try_new(len).ok()
    }

    fn len(&self) -> usize {
        self.layout.size()
    }

    fn read(&self, offset: usize, out: &mut [u8]) {
        assert!(offset + out.len() <= self.len(), "read past the buffer");
        let _g = self.guard();
        // SAFETY: in bounds; `out` is not part of this buffer.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset),
                out.as_mut_ptr(),
                out.len(),
            )
        }
    }

    fn write(&self, offset: usize, data: &[u8]) {
        assert!(offset + data.len() <= self.len(), "write past the buffer");
        let _g = self.guard();
        // SAFETY: in bounds; `data` is not part of this buffer.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.as_ptr().add(offset), data.len())
        }
    }

    fn with_range<R>(&self, offset: usize, len: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
        let end = offset.checked_add(len).expect("range overflows");
        assert!(end <= self.len(), "range past the buffer");
        let _g = self.guard();
        // SAFETY: in bounds; the guard makes this the only host-side borrow of these bytes,
        // and only these bytes are borrowed.
        f(unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(offset), len) })
    }

    fn as_mut_ptr(&self) -> *mut u8 {
        HwMem::as_mut_ptr(self)
    }
}

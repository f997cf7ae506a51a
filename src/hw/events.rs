//! The async events of an opened device (`ibv_get_async_event` on the context's `async_fd`),
//! as a tokio stream. sideway 0.4.3 does not wrap async events, so this is our own FFI over
//! `rdma-mummy-sys`, on the raw context of the sideway [`HwDevice`](super::device::HwDevice):
//! the same context that owns our QPs and CQs, so QP_FATAL / CQ_ERR for them arrive here too,
//! next to the device-wide DEVICE_FATAL / PORT_ERR / PORT_ACTIVE / GID_CHANGE.

use std::mem::MaybeUninit;
use std::sync::Arc;

use rdma_mummy_sys::{ibv_ack_async_event, ibv_async_event, ibv_context, ibv_get_async_event};
use sideway::ibverbs::device_context::DeviceContext;
use tokio::io::unix::AsyncFd;

use super::device::HwDevice;
use super::map::{self, HwEvent};
use super::{set_nonblocking, watch, BorrowedRawFd, HwError};

/// A stream of a device's async events.
pub struct AsyncEvents {
    afd: AsyncFd<BorrowedRawFd>,
    raw: *mut ibv_context,
    _ctx: Arc<DeviceContext>,
}

// SAFETY: ibv_get_async_event / ibv_ack_async_event are thread-safe; the context is kept
// alive by `_ctx`.
unsafe impl Send for AsyncEvents {}
// SAFETY: as above; `next` and `try_next` only read through the thread-safe calls.
unsafe impl Sync for AsyncEvents {}

impl AsyncEvents {
    /// Watch `dev`'s context. Needs a tokio runtime with I/O enabled.
    pub fn new(dev: &HwDevice) -> Result<AsyncEvents, HwError> {
        let raw = dev.raw_context();
        // SAFETY: `raw` is a live context (owned by dev.context()).
        let fd = unsafe { (*raw).async_fd };
        set_nonblocking(fd)?;
        Ok(AsyncEvents {
            // SAFETY: the fd belongs to the context `_ctx` keeps open; `afd` is dropped first.
            afd: unsafe { watch(fd)? },
            raw,
            _ctx: dev.context().clone(),
        })
    }

    /// The next event; waits for one.
    pub async fn next(&self) -> Result<HwEvent, HwError> {
        loop {
            let mut guard = self.afd.readable().await?;
            match self.try_next()? {
                Some(ev) => return Ok(ev),
                None => guard.clear_ready(),
            }
        }
    }

    /// An event if one is pending, without waiting.
    pub fn try_next(&self) -> Result<Option<HwEvent>, HwError> {
        let mut ev = MaybeUninit::<ibv_async_event>::zeroed();
        // SAFETY: non-blocking fd; on success the event is filled in and must be acked.
        let ret = unsafe { ibv_get_async_event(self.raw, ev.as_mut_ptr()) };
        if ret != 0 {
            let e = std::io::Error::last_os_error();
            return match e.kind() {
                std::io::ErrorKind::WouldBlock => Ok(None),
                _ => Err(HwError::Verbs {
                    call: "ibv_get_async_event",
                    source: e,
                }),
            };
        }
        let p = ev.as_mut_ptr();
        // Read the type as the integer the kernel wrote (bindgen made it a Rust enum, which an
        // unknown value from a newer kernel must not be materialised as).
        // SAFETY: the field was written by libibverbs; reading it as u32 is always valid.
        let kind = unsafe { std::ptr::addr_of!((*p).event_type).cast::<u32>().read() };
        // SAFETY: the union member matching `kind` is the one libibverbs set.
        let (qpn, cq) = unsafe {
            let el = std::ptr::addr_of!((*p).element).cast::<*mut u8>().read();
            if map::event_has_qp(kind) && !el.is_null() {
                ((*el.cast::<rdma_mummy_sys::ibv_qp>()).qp_num, 0)
            } else if map::event_has_cq(kind) && !el.is_null() {
                (0, (*el.cast::<rdma_mummy_sys::ibv_cq>()).handle)
            } else {
                (0, 0)
            }
        };
        // SAFETY: every event got must be acked, or destroying its QP/CQ blocks forever.
        unsafe { ibv_ack_async_event(p) };
        Ok(Some(map::async_event(kind, qpn, cq)))
    }
}

//! The functions the C shim calls, and `get_ioengine`, which fio looks up. Every one takes
//! plain values; errors come back as text the shim prints with fio's `log_err`.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

use crate::engine;
use crate::options::{OptionText, RawOptions};
use crate::thread::{File, FileIo, Op, Thread};

#[cfg(fio_shim)]
extern "C" {
    fn nvmf_shim_ops() -> *mut c_void;
    fn nvmf_shim_job_name(td: *mut c_void) -> *const c_char;
}

/// What fio calls to find the engine (`dlsym(handle, "get_ioengine")`).
///
/// # Safety
/// `ops` must be valid for a pointer write (fio passes the address of its local).
#[no_mangle]
pub unsafe extern "C" fn get_ioengine(ops: *mut *mut c_void) {
    #[cfg(fio_shim)]
    if !ops.is_null() {
        *ops = nvmf_shim_ops();
    }
    #[cfg(not(fio_shim))]
    {
        let _ = ops;
        eprintln!(
            "nvmf-rdma: this libnvmf_rdma_fio.so was built without fio's headers (FIO_SRC unset) \
             and has no engine; build it with fio-plugin/setup.sh"
        );
    }
}

/// Copy `msg` into the shim's buffer, truncated and NUL-terminated.
unsafe fn put_err(err: *mut c_char, len: usize, msg: &str) {
    if err.is_null() || len == 0 {
        return;
    }
    let n = msg.len().min(len - 1);
    std::ptr::copy_nonoverlapping(msg.as_ptr(), err as *mut u8, n);
    *err.add(n) = 0;
}

/// Run `f`, turning an error or a panic into a message for fio.
unsafe fn guarded<T>(
    err: *mut c_char,
    len: usize,
    f: impl FnOnce() -> Result<T, String>,
) -> Option<T> {
    let msg = match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => return Some(v),
        Ok(Err(m)) => m,
        Err(p) => {
            let what = p
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| p.downcast_ref::<&str>().copied())
                .unwrap_or("unknown");
            format!("internal error (panic: {what})")
        }
    };
    put_err(err, len, &msg);
    None
}

unsafe fn c_str<'a>(p: *const c_char) -> Result<&'a str, String> {
    if p.is_null() {
        return Err("missing filename".into());
    }
    CStr::from_ptr(p)
        .to_str()
        .map_err(|_| "filename is not UTF-8".to_string())
}

#[cfg(fio_shim)]
unsafe fn job_name(td: *mut c_void) -> String {
    let p = nvmf_shim_job_name(td);
    if p.is_null() {
        return "job".into();
    }
    CStr::from_ptr(p).to_string_lossy().into_owned()
}

#[cfg(not(fio_shim))]
unsafe fn job_name(_td: *mut c_void) -> String {
    "job".into()
}

/// fio's `setup` (main thread, before the job starts): register the job with the engine.
///
/// # Safety
/// Called by the shim with fio's `thread_data` and option strings.
#[no_mangle]
pub unsafe extern "C" fn nvmf_rs_setup(
    td: *mut c_void,
    o: *const RawOptions,
    err: *mut c_char,
    errlen: usize,
) -> c_int {
    let r = guarded(err, errlen, || {
        let t = OptionText::from_raw(o)?;
        // Before this job's controllers and targets start (they start on first use).
        nvmf_rdma::driver::set_default_busy_poll(t.busy_poll()?);
        nvmf_rdma::driver::set_busy_poll_gate(t.busy_poll_gate()?);
        engine::register(td as usize, t.runtime_threads()?).map(|_| ())
    });
    if r.is_some() {
        0
    } else {
        1
    }
}

/// The size of the namespace a filename names (connecting on first use).
///
/// # Safety
/// Called by the shim with valid pointers.
#[no_mangle]
pub unsafe extern "C" fn nvmf_rs_file_size(
    o: *const RawOptions,
    name: *const c_char,
    size: *mut u64,
    err: *mut c_char,
    errlen: usize,
) -> c_int {
    let r = guarded(err, errlen, || {
        let t = OptionText::from_raw(o)?;
        let f = t.with_filename(c_str(name)?)?.file_target()?;
        let threads = t.runtime_threads()?;
        let ns = match &f.second {
            None => engine::controller(&f.ctrl, threads)?.ctrl.namespace(f.nsid),
            Some(p) => engine::multipath(&f.ctrl, p, threads)?
                .sub
                .namespace(f.nsid)
                .map(|n| n.info()),
        };
        Ok(ns.map_err(|e| e.to_string())?.bytes())
    });
    match r {
        Some(b) => {
            *size = b;
            0
        }
        None => 1,
    }
}

/// fio's `init` (in the job's thread or process): the job's context.
///
/// # Safety
/// Called by the shim with fio's `thread_data` and option strings.
#[no_mangle]
pub unsafe extern "C" fn nvmf_rs_thread_init(
    td: *mut c_void,
    o: *const RawOptions,
    err: *mut c_char,
    errlen: usize,
) -> *mut c_void {
    let r = guarded(err, errlen, || {
        let t = OptionText::from_raw(o)?;
        let driver = engine::register(td as usize, t.runtime_threads()?)?;
        Ok(Box::new(Thread::new(&job_name(td), driver, 64)))
    });
    r.map_or(std::ptr::null_mut(), |b| Box::into_raw(b) as *mut c_void)
}

/// fio's `open_file`: the namespace's handle on its (shared) controller.
///
/// # Safety
/// `thread` comes from `nvmf_rs_thread_init`; the other pointers from fio.
#[no_mangle]
pub unsafe extern "C" fn nvmf_rs_open_file(
    thread: *mut c_void,
    o: *const RawOptions,
    name: *const c_char,
    err: *mut c_char,
    errlen: usize,
) -> *mut c_void {
    let r = guarded(err, errlen, || {
        let th = (thread as *const Thread)
            .as_ref()
            .ok_or("engine not initialised")?;
        let t = OptionText::from_raw(o)?;
        let f = t.with_filename(c_str(name)?)?.file_target()?;
        let threads = t.runtime_threads()?;
        let (io, ns) = match &f.second {
            None => {
                let c = engine::controller(&f.ctrl, threads)?;
                let ns = c.ctrl.namespace(f.nsid).map_err(|e| e.to_string())?;
                c.start_chaos(&th.rt);
                (FileIo::Ctrl(c), ns)
            }
            Some(p) => {
                let m = engine::multipath(&f.ctrl, p, threads)?;
                let ns = m.sub.namespace(f.nsid).map_err(|e| e.to_string())?;
                m.start_chaos(&th.rt);
                let info = ns.info();
                (FileIo::Multipath(std::sync::Arc::new(ns)), info)
            }
        };
        Ok(Box::new(File {
            io,
            nsid: f.nsid,
            block_size: ns.block_size as u64,
        }))
    });
    r.map_or(std::ptr::null_mut(), |b| Box::into_raw(b) as *mut c_void)
}

/// fio's `close_file`.
///
/// # Safety
/// `file` comes from `nvmf_rs_open_file` and is not used again.
#[no_mangle]
pub unsafe extern "C" fn nvmf_rs_close_file(file: *mut c_void) {
    if !file.is_null() {
        drop(Box::from_raw(file as *mut File));
    }
}

/// fio's `queue`: 0 = queued, otherwise the errno to complete the `io_u` with now.
///
/// # Safety
/// `thread` and `file` come from this engine; `buf` is the io_u's buffer of `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn nvmf_rs_queue(
    thread: *mut c_void,
    file: *mut c_void,
    io_u: *mut c_void,
    op: c_int,
    offset: u64,
    buf: *mut c_void,
    len: u64,
) -> c_int {
    let (Some(th), Some(f), Some(op)) = (
        (thread as *mut Thread).as_mut(),
        (file as *const File).as_ref(),
        Op::from_raw(op),
    ) else {
        return libc::EINVAL;
    };
    match th.queue(f, io_u as usize, op, offset, buf as *mut u8, len) {
        Ok(()) => 0,
        Err(e) => e,
    }
}

/// fio's `commit`.
///
/// # Safety
/// `thread` comes from `nvmf_rs_thread_init`.
#[no_mangle]
pub unsafe extern "C" fn nvmf_rs_commit(thread: *mut c_void) {
    if let Some(th) = (thread as *mut Thread).as_mut() {
        th.commit();
    }
}

/// fio's `getevents`; `timeout_ns < 0` waits without limit.
///
/// # Safety
/// `thread` comes from `nvmf_rs_thread_init`.
#[no_mangle]
pub unsafe extern "C" fn nvmf_rs_getevents(
    thread: *mut c_void,
    min: c_uint,
    max: c_uint,
    timeout_ns: i64,
) -> c_int {
    let Some(th) = (thread as *mut Thread).as_mut() else {
        return -libc::EINVAL;
    };
    let timeout = u64::try_from(timeout_ns).ok().map(Duration::from_nanos);
    th.getevents(min as usize, max as usize, timeout) as c_int
}

/// fio's `event`: the i-th `io_u` of the last getevents, and its errno.
///
/// # Safety
/// `thread` comes from `nvmf_rs_thread_init`; `error` is writable.
#[no_mangle]
pub unsafe extern "C" fn nvmf_rs_event(
    thread: *mut c_void,
    i: c_int,
    error: *mut c_int,
) -> *mut c_void {
    let d = (thread as *const Thread)
        .as_ref()
        .and_then(|th| th.event(usize::try_from(i).ok()?));
    match d {
        Some(d) => {
            *error = d.error;
            d.io_u as *mut c_void
        }
        None => std::ptr::null_mut(),
    }
}

/// fio's `iomem_alloc` (in the job, after `init`): `size` bytes for fio's I/O buffers of at
/// most `chunk` bytes each, as registered memory of a queue of the first file's controller,
/// so that its reads and writes make no host copy. 0 with `*buf` set; 1 when the job cannot
/// use registered memory (`registered_buffers=0`, a block size over the transfer limit): the
/// shim allocates plain memory; -1 on an error, in `err`.
///
/// # Safety
/// `thread` comes from `nvmf_rs_thread_init`; `buf` is writable; the rest from fio.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn nvmf_rs_iomem_alloc(
    thread: *mut c_void,
    o: *const RawOptions,
    name: *const c_char,
    size: usize,
    chunk: usize,
    buf: *mut *mut c_void,
    err: *mut c_char,
    errlen: usize,
) -> c_int {
    let Some(th) = (thread as *mut Thread).as_mut() else {
        put_err(err, errlen, "engine not initialised");
        return -1;
    };
    let r = guarded(err, errlen, || {
        let t = OptionText::from_raw(o)?;
        if !t.registered_buffers()? || name.is_null() {
            return Ok(None);
        }
        let f = t.with_filename(c_str(name)?)?.file_target()?;
        if f.second.is_some() {
            // Registered memory belongs to one controller's queue; a multipath I/O may go
            // on either path.
            return Ok(None);
        }
        let c = engine::controller(&f.ctrl, t.runtime_threads()?)?;
        let chunks = size.div_ceil(chunk.max(1));
        if chunk == 0
            || chunk > c.ctrl.max_transfer()
            || chunks > nvmf_rdma::transport::queue::MAX_REGION_CHUNKS
        {
            return Ok(None);
        }
        let b = c
            .ctrl
            .io_buffer(chunk, chunks)
            .map_err(|e| format!("registering fio's I/O buffers: {e}"))?;
        Ok(Some((c.ctrl.clone(), b)))
    });
    match r {
        Some(Some((c, b))) => {
            *buf = b.as_mut_ptr() as *mut c_void;
            th.iobuf = Some((c, std::sync::Arc::new(b)));
            0
        }
        Some(None) => 1,
        None => -1,
    }
}

/// fio's `iomem_free`: 1 if the buffers were the engine's (now released), 0 if the shim's.
///
/// # Safety
/// `thread` comes from `nvmf_rs_thread_init` (or is null).
#[no_mangle]
pub unsafe extern "C" fn nvmf_rs_iomem_free(thread: *mut c_void) -> c_int {
    match (thread as *mut Thread).as_mut() {
        Some(th) => th.iobuf.take().is_some() as c_int,
        None => 0,
    }
}

/// fio's `cleanup`: wait for what is still out, report errors, leave the engine.
///
/// # Safety
/// `thread` comes from `nvmf_rs_thread_init` (or is null) and is not used again.
#[no_mangle]
pub unsafe extern "C" fn nvmf_rs_thread_cleanup(td: *mut c_void, thread: *mut c_void) {
    if !thread.is_null() {
        let mut th = Box::from_raw(thread as *mut Thread);
        th.drain();
        eprintln!(
            "nvmf-rdma: {}: longest I/O stall {:.1} ms",
            th.job,
            th.longest_stall().as_secs_f64() * 1e3
        );
        let n = th.errors.count();
        if n > 0 {
            eprintln!("nvmf-rdma: {}: {n} I/O errors", th.job);
        }
    }
    engine::release(td as usize);
}

//! fio external ioengine over the nvmf-rdma NVMe-oF host.
//!
//! fio loads `libnvmf_rdma_fio.so` (`ioengine=external:/path/libnvmf_rdma_fio.so`) and calls
//! `get_ioengine`, exported here: a Rust cdylib only exports Rust's own symbols, so the engine
//! table itself lives in the C shim (`src/shim.c`, built against fio's headers), which is the
//! only code that touches fio's structures. The shim calls the `nvmf_rs_*` functions in
//! [`ffi`] with plain values.
//!
//! - [`options`]: engine options and SPDK-style filenames, checked with clear messages.
//! - [`engine`]: process-wide state: shared controllers, multipath subsystems, built-in
//!   targets.
//! - [`chaos`]: device faults on schedule, never two paths down at once.
//! - [`runtime`]: who drives the async work (fio's own threads, or threads of ours).
//! - [`thread`]: per-job queue / commit / getevents over the job's own I/O futures.

pub mod chaos;
pub mod engine;
pub mod ffi;
pub mod options;
pub mod runtime;
pub mod thread;

/// Whether this build has the fio shim (built with `FIO_SRC` set).
pub const HAS_FIO_SHIM: bool = cfg!(fio_shim);

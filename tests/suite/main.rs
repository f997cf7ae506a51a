//! Integration tests that share one test binary. Each file here was a test crate of its own,
//! and each compiled the same host, target and device code again (12-30 s apiece in release,
//! together about half of CI's test build); as modules of one crate that code is compiled
//! once. Run one file's tests with `cargo test --release --test suite <file>::`.
//!
//! Outside, each its own binary: tests that set something for the whole process
//! (recovery_alloc's and hw_backend's global allocators, host_metrics' metrics recorder,
//! cli_connect's rlimit), the long seed sweep (reconnect_sweep), and the cheap ones.

#[path = "../common/counters.rs"]
mod counters;
#[path = "../export_common/mod.rs"]
mod export_common;
#[path = "../common/fake_target.rs"]
mod fake_target;
#[path = "../common/raw_queue.rs"]
mod raw_queue;
mod rig;

mod adversarial;
mod daemon_registry;
mod export_fuse;
mod export_model;
mod export_nbd;
mod ghost_write;
mod late_writes;
mod multipath;
mod multiport;
mod ns_rescan;
mod nvme_props;
mod nvmf_bad_input;
mod nvmf_e2e;
mod nvmf_queues;
mod reconnect;
mod recovery_edges;
mod sim_integrity;
mod sim_recovery;
mod zero_copy;

//! Harnesses around the host and the target, not part of either: the chaos workload (verified
//! I/O under injected faults), the two benchmarks (raw soft-HCA loopback, NVMe-oF end to
//! end), the allocation audit behind the zero-allocation proof of the recovery path, and the
//! ghost-write model that shows why in-flight writes of a dead connection are held.

pub mod alloc_audit;
pub mod bench;
pub mod chaos;
pub mod ghost_write;
pub mod hca_peer;
pub mod hca_perf;
pub mod nvmf_perf;

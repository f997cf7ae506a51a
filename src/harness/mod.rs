//! Harnesses around the host and the target, not part of either: the chaos workload (verified
//! I/O under injected faults), the two benchmarks (raw soft-HCA loopback, NVMe-oF end to
//! end), and the allocation audit behind the zero-allocation proof of the recovery path.

pub mod alloc_audit;
pub mod chaos;
pub mod hca_perf;
pub mod nvmf_perf;

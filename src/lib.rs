//! nvmf-rdma: a user-space NVMe-over-RDMA initiator that owns its (soft) HCA.
//!
//! Layers, bottom up: [`hca`] (sans-I/O soft-HCA speaking RoCEv2), [`driver`] (tokio: sockets,
//! timers, metrics), [`verbs`] (the backend seam the host is written against), [`transport`]
//! and [`reconnect`] (the NVMe-oF host and its recovery). Beside them: [`nvmet`] (the built-in
//! NVMe-oF target), [`export`] (NBD and FUSE), [`cli`] (what the front ends share) and
//! [`harness`] (chaos, benchmarks, the allocation audit).

pub mod cli;
pub mod cm;
pub mod daemon;
pub mod driver;
pub mod export;
pub mod harness;
pub mod hca;
#[cfg(feature = "hw")]
pub mod hw;
pub mod multipath;
pub mod nvme;
pub mod nvmet;
pub mod published;
pub mod reconnect;
pub mod timer;
pub mod transport;
pub mod verbs;

//! nvmf-rdma: a user-space NVMe-over-RDMA initiator that owns its (soft) HCA.
//!
//! Layers, bottom up: [`hca`] (sans-I/O soft-HCA speaking RoCEv2), [`driver`] (tokio: sockets,
//! timers, metrics).

pub mod cm;
pub mod driver;
pub mod hca;
pub mod nvme;
pub mod perf;
pub mod target;
pub mod transport;

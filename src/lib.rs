//! nvmf-rdma: a user-space NVMe-over-RDMA initiator that owns its (soft) HCA.
//!
//! Layers, bottom up: [`hca`] (sans-I/O soft-HCA speaking RoCEv2), [`driver`] (tokio: sockets,
//! timers, metrics), [`verbs`] (the backend seam the host is written against), [`transport`]
//! and [`reconnect`] (the NVMe-oF host and its recovery).

pub mod alloc_audit;
pub mod chaos;
pub mod cli_support;
pub mod cm;
pub mod driver;
pub mod export;
pub mod hca;
#[cfg(feature = "hw")]
pub mod hw;
pub mod metrics_http;
pub mod nvme;
pub mod nvmf_perf;
pub mod perf;
pub mod reconnect;
pub mod target;
pub mod transport;
pub mod verbs;
pub mod wire_json;

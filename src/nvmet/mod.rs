//! The built-in NVMe-oF target, on any device behind the backend seam (the soft-HCA, or a
//! kernel RDMA device with `--features hw`): RAM- or file-backed namespaces, one or more
//! subsystems, the discovery subsystem, and host allow-lists.
//!
//! One engine per target device owns every queue on it. A queue is an RC QP with three
//! registered rings: receive capsules (64-byte SQE + in-capsule data), responses (16-byte
//! CQEs), and one data staging area per command slot for RDMA READ (host → target data) and
//! RDMA WRITE (target → host data). Every command follows the same path: capsule in → fetch
//! data if any → execute → push data if any → SEND the response.

mod backend;
pub mod engine;
pub mod listen;
pub mod namespace;

use std::net::SocketAddr;
use std::sync::Arc;

pub use engine::{ConnParams, ConnReject, Target, TargetStats};
pub use listen::serve_cm;
pub use namespace::{Namespace, NoMemory, MAX_NAMESPACES};

use crate::nvme::Nqn;

/// One NVM subsystem: an NQN, its namespaces and who may connect.
#[derive(Debug, Clone)]
pub struct Subsystem {
    pub nqn: Nqn,
    pub namespaces: Vec<Arc<Namespace>>,
    /// Host NQNs allowed to connect; `None` allows any host.
    pub allowed_hosts: Option<Vec<String>>,
    pub serial: String,
    pub model: String,
}

impl Subsystem {
    pub fn new(nqn: Nqn, namespaces: Vec<Arc<Namespace>>) -> Subsystem {
        Subsystem {
            nqn,
            namespaces,
            allowed_hosts: None,
            serial: "NVMFRDMA0001".to_string(),
            model: "nvmf-rdma soft target".to_string(),
        }
    }

    pub fn allows(&self, hostnqn: &str) -> bool {
        self.allowed_hosts
            .as_ref()
            .is_none_or(|h| h.iter().any(|x| x == hostnqn))
    }
}

/// Target-wide settings.
#[derive(Debug, Clone)]
pub struct TargetConfig {
    pub subsystems: Vec<Subsystem>,
    /// The NVMe-oF service port (trsvcid) the CM listens on.
    pub port: u16,
    /// Largest queue a host may ask for (CAP.MQES + 1).
    pub max_queue_size: u16,
    /// In-capsule data on I/O queues (IOCCSZ = (64 + this) / 16).
    pub inline_data: u32,
    /// Largest data transfer of one command (MDTS), in bytes.
    pub max_transfer: u32,
    /// Most I/O queues per controller.
    pub max_io_queues: u16,
    /// The address hosts reach us at, reported in the discovery log.
    pub advertise: Option<SocketAddr>,
    /// Most queues (admin and I/O, connected or not) on the target. A CM REQ beyond it is
    /// refused with an NVMe-oF CM reject "no resources".
    pub max_queues: usize,
    /// Most queues one peer IP address may hold before their Fabrics Connect succeeds
    /// (what a peer that is no host of ours can make us keep); REQs beyond get the same
    /// reject. Connected queues count only against `max_queues`: a host that resets fast
    /// leaves connected queues behind until its keep-alive expires here.
    pub max_unconnected_per_ip: usize,
    /// Controller IDs are handed out from `cntlid_min..=cntlid_max` (nvmet's `cntlid_min`
    /// and `cntlid_max`), never one that is in use. Clamped to 1..=0xFFEF.
    pub cntlid_min: u16,
    pub cntlid_max: u16,
}

impl Default for TargetConfig {
    fn default() -> Self {
        TargetConfig {
            subsystems: Vec::new(),
            port: 4420,
            max_queue_size: 1024,
            inline_data: 8192,
            max_transfer: 1 << 20,
            max_io_queues: 64,
            advertise: None,
            max_queues: 1024,
            max_unconnected_per_ip: 256,
            cntlid_min: 1,
            cntlid_max: 0xFFEF,
        }
    }
}

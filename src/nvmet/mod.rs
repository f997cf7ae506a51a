//! The built-in NVMe-oF target, on any device behind the backend seam (the soft-HCA, or a
//! kernel RDMA device with `--features hw`): RAM- or file-backed namespaces, one or more
//! subsystems, the discovery subsystem, host allow-lists, and several ports (devices) with
//! ANA groups whose state is per port.
//!
//! One engine owns every queue on every port of the target (a queue is named by its port
//! and QPN), so controllers, namespaces and Cross-Controller Reset span the ports. A queue is an RC QP with three
//! registered rings: receive capsules (64-byte SQE + in-capsule data), responses (16-byte
//! CQEs), and one data staging area per command slot for RDMA READ (host → target data) and
//! RDMA WRITE (target → host data). Every command follows the same path: capsule in → fetch
//! data if any → execute → push data if any → SEND the response.
//!
//! The files, by concern: [`engine`] (the running target and its task), `queues` (queue
//! admission and lifetime), `pipeline` (a command's way through a queue), `rdma` (rings
//! and work requests); and, with no device and no clock, `command` (the controller
//! registry and the `Slot` a handler sees of its queue), `port` (ports and the queue
//! names), [`ana`] (ANA group states per port), `exec` (fetch,
//! run, push decisions), `fabrics`, `admin` and `io` (the commands, as tables of
//! handlers). A new admin command or log page is a row in a table of `admin`.

mod admin;
pub mod ana;
mod backend;
mod budget;
mod command;
pub mod control;
pub mod engine;
mod exec;
mod fabrics;
mod io;
mod late;
pub mod listen;
pub mod namespace;
mod pipeline;
mod port;
mod queues;
mod quiesce;
mod rdma;
mod stats;
#[cfg(test)]
mod tests;

use std::net::SocketAddr;
use std::sync::Arc;

pub use engine::{ConnParams, ConnReject, Target};
pub use listen::{serve_cm, serve_cm_on};
pub use namespace::{Namespace, NoMemory, MAX_NAMESPACES};
pub use port::PortInfo;
pub use stats::TargetStats;

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

/// Command Quiesce Time reported when none is configured, ms (see `TargetConfig::cqt_ms`).
pub const DEFAULT_CQT_MS: u16 = 1000;

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
    /// The address hosts reach the first port at, reported in the discovery log (the
    /// others' come with [`Target::add_port`]).
    pub advertise: Option<SocketAddr>,
    /// Most queues (admin and I/O) on the target once their connection is established (the
    /// CM RTU arrived). A CM REQ beyond it is refused with an NVMe-oF CM reject "no
    /// resources". Queues and their completion-queue entries are also shared out: see
    /// `address_share`, `network_share`, `host_share` and `reserved_share`.
    pub max_queues: usize,
    /// Most queues one peer IP address may hold established but before their Fabrics
    /// Connect succeeds (what a peer that is no host of ours can make us keep); REQs beyond
    /// get the same reject.
    pub max_unconnected_per_ip: usize,
    /// Most queues whose CM REP is out but whose RTU has not come back, in all: a REQ
    /// with a forged source address costs one of these, never a share of `max_queues`.
    /// When the table is full the oldest waiting queue goes (a real host's RTU comes back
    /// within a round trip), and one that never gets its RTU goes at the CM's REP timeout.
    pub max_pre_rtu: usize,
    /// Most of those waiting queues per source address; REQs beyond are refused "no
    /// resources".
    pub max_pre_rtu_per_ip: usize,
    /// Percentages of the queue budget (`max_queues`, and the completion-queue entries the
    /// queues' slots can fill) that one source address, one /24 (IPv4) or /64 (IPv6)
    /// network, and one host NQN may hold. A queue past one of them is refused: a CM REQ
    /// with "no resources", a Fabrics Connect with Connect Controller Busy.
    pub address_share: u8,
    pub network_share: u8,
    pub host_share: u8,
    /// Percentage of the queue budget only hosts named in the allow-list of the subsystem
    /// they connect to may use: discovery and open subsystems get the rest.
    pub reserved_share: u8,
    /// Largest keep-alive timeout a host may ask for, ms (Connect, Set Features). A
    /// subsystem controller that asks for none (0) gets this one, a discovery controller
    /// 120 s at most: a controller whose host left must not be kept for ever.
    pub max_kato_ms: u32,
    /// Controller IDs are handed out from `cntlid_min..=cntlid_max` (nvmet's `cntlid_min`
    /// and `cntlid_max`), never one that is in use. Clamped to 1..=0xFFEF.
    pub cntlid_min: u16,
    pub cntlid_max: u16,
    /// Command Quiesce Time reported in Identify Controller, ms (TP4129): a dead
    /// controller's commands are over (run or dropped) within it. The default leaves a file
    /// namespace's slowest step (one chunk of a worker's job, a few ms on a busy disk) two
    /// orders of magnitude of room and adds 1 s to a host's KATO-based wait.
    pub cqt_ms: u16,
    /// Fault mode (tests, chaos): writes the backend still holds when their controller
    /// dies run this long after the death instead of being dropped, as a slow backend's
    /// would; a CCR or CQT still stops them. `None`: they are dropped with the controller.
    pub late_writes_ms: Option<u32>,
    /// Offer Cross-Controller Reset (CCRL 4). Without it CCRL is 0 and the command is an
    /// Invalid Opcode, as on a target that predates TP8028 (Linux nvmet): a host then
    /// falls back to the time rule.
    pub offer_ccr: bool,
    /// ANA Transition Time reported in Identify Controller, seconds: how long a host waits
    /// for a group in the change state before it gives up on the path.
    pub anatt_s: u8,
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
            max_pre_rtu: 256,
            max_pre_rtu_per_ip: 16,
            address_share: 50,
            network_share: 50,
            host_share: 50,
            reserved_share: 25,
            max_kato_ms: 120_000,
            cntlid_min: 1,
            cntlid_max: 0xFFEF,
            cqt_ms: DEFAULT_CQT_MS,
            late_writes_ms: None,
            offer_ccr: true,
            anatt_s: ana::DEFAULT_ANATT_S,
        }
    }
}

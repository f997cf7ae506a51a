//! What `connect` is asked for: the options (nvme-cli's names where there is one) and the
//! choices made from them by the path to the target.

use std::net::SocketAddr;
use std::time::Duration;

use crate::nvme::Nqn;
use crate::reconnect::hold::HoldPolicy;
use crate::reconnect::Policy;
use crate::verbs::{roce_peer, Mtu};

/// Everything `connect` needs, with nvme-cli's names where there is one.
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    /// The target device's address (`-a`, with the soft-HCA's UDP port).
    pub traddr: SocketAddr,
    /// NVMe-oF service port (`-s`, default 4420).
    pub trsvcid: u16,
    /// Subsystem NQN (`-n`).
    pub subnqn: String,
    /// Host NQN (`-q`).
    pub hostnqn: String,
    /// Host ID (`-I`), a UUID.
    pub hostid: [u8; 16],
    /// I/O queues (`-i`, default: one per core).
    pub nr_io_queues: usize,
    /// Entries per I/O queue (`-Q`, default 128, 16..=1024). One is reserved for the
    /// controller's own commands, as in Linux.
    pub queue_size: usize,
    /// Keep-alive timeout (`-k`, default 5 s; zero turns keep-alive off).
    pub keep_alive_tmo: Duration,
    /// Largest transfer per command we set up buffers for.
    pub max_io: usize,
    pub mtu: Mtu,
    /// Bound on one CM connect and on each bring-up command.
    pub connect_timeout: Duration,
    /// Reconnect policy (`-l`, `-c`, `--fast_io_fail_tmo`, replug window, identity).
    /// Its `keep_alive_tmo` is taken from the field above.
    pub policy: Policy,
    /// A command with no response after this long starts recovery (Linux `io_timeout`).
    pub io_timeout: Duration,
    /// How often a command failing with a retryable status (DNR clear) is sent again.
    pub max_retries: u8,
    /// A write that fits the target's in-capsule data size goes inside its command capsule
    /// while at most this many commands are in flight on its queue, and as a keyed SGL
    /// (the target reads the data) when the queue is deeper. In the capsule saves a round
    /// trip, which is what a shallow queue waits on. On a soft-HCA it also makes each write
    /// a full packet plus a short one, and since only a run of equal-size packets leaves in
    /// one GSO send, deep queues of such writes cost a kernel send per write; as keyed SGLs
    /// the commands, data and responses of many writes go out in a few sends each
    /// (4 KiB randwrite at QD32 through fio: about 170 K -> 290 K IOPS).
    /// `None` (the default) chooses by the path, when the queues are made: unlimited
    /// (Linux's rule: always in the capsule when it fits) towards RoCEv2 devices and towards
    /// a peer the host's device reaches in memory (a target in this process, on the
    /// soft-HCA's loopback path, where there are no GSO runs to keep and the round trip is
    /// what costs: 4 KiB randwrite QD32 through fio 205-213 K -> 268-305 K IOPS), and
    /// [`SOFT_INLINE_DEPTH`] towards other soft-HCAs.
    pub inline_depth: Option<usize>,
    /// Safe retry (`--safe-retry`, `--cqt-default`): when a command that changes state and
    /// was in flight on a dead connection may be sent again ([`crate::transport::saferetry`]).
    pub safe_retry: HoldPolicy,
}

/// In-flight commands up to which a soft-HCA host puts fitting writes in the capsule
/// towards a soft-HCA reached over UDP ([`ConnectOptions::inline_depth`]). fio 4 KiB
/// randwrite through the plugin: in the capsule wins at QD2 and QD4, keyed SGLs from QD8.
pub const SOFT_INLINE_DEPTH: usize = 4;

/// [`ConnectOptions::inline_depth`]'s choice by the path, for a host whose device reaches
/// the target over a network (`in_memory` false) or in memory.
pub(super) fn inline_depth_for(traddr: SocketAddr, in_memory: bool) -> usize {
    if roce_peer(traddr.ip()) || in_memory {
        usize::MAX
    } else {
        SOFT_INLINE_DEPTH
    }
}

impl ConnectOptions {
    pub fn new(traddr: SocketAddr, subnqn: &str) -> ConnectOptions {
        let hostid = default_hostid();
        ConnectOptions {
            traddr,
            trsvcid: 4420,
            subnqn: subnqn.to_string(),
            hostnqn: Nqn::from_uuid(&hostid).as_str().to_string(),
            hostid,
            nr_io_queues: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            queue_size: 128,
            keep_alive_tmo: Duration::from_secs(5),
            max_io: 128 << 10,
            // rxe on 1500-byte Ethernet uses 1024; soft-HCAs on loopback take 4096.
            mtu: if roce_peer(traddr.ip()) {
                Mtu::Mtu1024
            } else {
                Mtu::Mtu4096
            },
            connect_timeout: Duration::from_secs(5),
            policy: Policy::default(),
            io_timeout: crate::reconnect::policy::DEFAULT_IO_TIMEOUT,
            max_retries: crate::reconnect::policy::DEFAULT_MAX_RETRIES,
            inline_depth: None,
            safe_retry: HoldPolicy::default(),
        }
    }
}

/// A stable host ID for this machine: from /etc/machine-id when there is one.
pub fn default_hostid() -> [u8; 16] {
    let mut id = [0u8; 16];
    if let Ok(s) = std::fs::read_to_string("/etc/machine-id") {
        let hex: Vec<u8> = s.trim().bytes().collect();
        for (i, chunk) in hex.chunks(2).take(16).enumerate() {
            if let Ok(b) = u8::from_str_radix(std::str::from_utf8(chunk).unwrap_or("0"), 16) {
                id[i] = b;
            }
        }
    }
    if id == [0u8; 16] {
        id = *b"nvmf-rdma-host-1";
    }
    id[6] = (id[6] & 0x0F) | 0x40; // UUID version 4 layout
    id[8] = (id[8] & 0x3F) | 0x80;
    id
}

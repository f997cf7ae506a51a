//! What the target counts: its traffic, and what a peer made it refuse or drop.

use crate::published::Published;

/// The target's counters as metrics, labelled with its service port: what a peer made it
/// refuse or drop (refused queues, malformed capsules, exhausted controller IDs, keep-alive
/// expiries) beside its traffic.
pub(super) const COUNTERS: &[Published<TargetStats>] = &[
    ("nvmet_commands_total", None, |s| s.commands),
    ("nvmet_command_errors_total", None, |s| s.errors),
    ("nvmet_malformed_capsules_total", None, |s| {
        s.malformed_capsules
    }),
    ("nvmet_refused_queues_total", None, |s| s.refused_queues),
    ("nvmet_cntlid_exhausted_total", None, |s| s.cntlid_exhausted),
    ("nvmet_kato_expired_total", None, |s| s.kato_expired),
    ("nvmet_queues_connected_total", None, |s| s.queues_connected),
    ("nvmet_queues_dropped_total", None, |s| s.queues_dropped),
    ("nvmet_offloaded_commands_total", None, |s| s.offloaded),
    ("nvmet_read_bytes_total", None, |s| s.bytes_read),
    ("nvmet_written_bytes_total", None, |s| s.bytes_written),
    ("nvmet_io_copies_total", None, |s| s.io_copies),
];

/// Counters a person (or a test) can read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TargetStats {
    pub commands: u64,
    pub errors: u64,
    pub malformed_capsules: u64,
    /// Capsules that waited for a command slot (see `TQueue::held`).
    pub held_capsules: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub queues_connected: u64,
    pub queues_dropped: u64,
    /// Commands ignored while frozen.
    pub ignored_frozen: u64,
    /// Controllers torn down because their host went silent for KATO.
    pub kato_expired: u64,
    /// CM REQs refused for a queue cap or because memory ran out.
    pub refused_queues: u64,
    /// Fabrics Connects refused because no controller ID was free.
    pub cntlid_exhausted: u64,
    /// Commands whose namespace work ran on a worker thread, off the engine.
    pub offloaded: u64,
    /// Payload copies the target made for I/O commands (in-capsule data into a RAM
    /// namespace or into staging, staging to and from the namespace or a worker's buffer)
    /// and their bytes; what the kernel copies for a file namespace is not counted, nor
    /// RDMA straight from or into a RAM namespace (no copy).
    pub io_copies: u64,
    pub io_copied_bytes: u64,
}

/// One line for a person: what the target did (the `stopping` line of `nvmf-rdma target`).
impl std::fmt::Display for TargetStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} commands ({} failed, {} malformed), {} bytes read, {} written, \
             {} queues connected, {} dropped ({} for keep-alive), {} refused",
            self.commands,
            self.errors,
            self.malformed_capsules,
            self.bytes_read,
            self.bytes_written,
            self.queues_connected,
            self.queues_dropped,
            self.kato_expired,
            self.refused_queues,
        )
    }
}

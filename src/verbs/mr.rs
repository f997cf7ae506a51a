//! Protection domains and memory regions as a consumer sees them: handles, keys and access
//! rights (ibv_access_flags).

use bitflags::bitflags;

use super::MemKey;

bitflags! {
    /// Access rights of a memory region (ibv_access_flags).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct Access: u32 {
        const LOCAL_WRITE = 1 << 0;
        const REMOTE_WRITE = 1 << 1;
        const REMOTE_READ = 1 << 2;
        const REMOTE_ATOMIC = 1 << 3;
    }
}

/// A protection domain handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PdId(pub u32);

/// What the consumer learns about a registered region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MrInfo {
    pub lkey: MemKey,
    /// Zero when the region allows no remote access, as with rxe.
    pub rkey: MemKey,
    pub addr: u64,
    pub len: u64,
    pub access: Access,
}

//! Asymmetric Namespace Access on the target, sans I/O: the state of each ANA group through
//! each port (Linux nvmet `ports/*/ana_groups/*/ana_state`), the change count hosts compare,
//! and what a state means for I/O. The wire layouts are [`crate::nvme::ana`]'s.
//!
//! As in nvmet: every namespace is in group [`DEFAULT_GROUP`] unless it was put in another
//! ([`super::Namespace::in_ana_group`]), and a group is optimized through a port until it is
//! set otherwise. A namespace's group never changes while it is attached (ANACAP bit 6).

use std::collections::{BTreeMap, BTreeSet};

use crate::nvme::ana::{status, AnaState};
use crate::nvme::Status;

/// The group a namespace is in unless put in another (nvmet `NVMET_DEFAULT_ANA_GRPID`).
pub const DEFAULT_GROUP: u32 = 1;
/// Group IDs are 1..=this (Identify Controller ANAGRPMAX and NANAGRPID; nvmet
/// `NVMET_MAX_ANAGRPS`).
pub const MAX_GROUPS: u32 = 128;
/// ANA Transition Time reported when none is configured, seconds (nvmet's).
pub const DEFAULT_ANATT_S: u8 = 10;

/// Is `grpid` a group ID the target can have? The error says which ones are.
pub fn check_group(grpid: u32) -> Result<(), String> {
    if (1..=MAX_GROUPS).contains(&grpid) {
        Ok(())
    } else {
        Err(format!(
            "ANA group {grpid} does not exist: use 1..={MAX_GROUPS}"
        ))
    }
}

/// The states set through the control socket (or configuration), by (port, group); a pair
/// not in it is optimized. Bounded by ports x [`MAX_GROUPS`].
#[derive(Debug, Default)]
pub(super) struct AnaTable {
    set: BTreeMap<(u16, u32), AnaState>,
    /// Bumped by every change of a state (the log page's CHGCNT, and each group's).
    pub chgcnt: u64,
}

impl AnaTable {
    /// The state of group `grpid` through port `port`.
    pub fn state(&self, port: u16, grpid: u32) -> AnaState {
        self.set
            .get(&(port, grpid))
            .copied()
            .unwrap_or(AnaState::Optimized)
    }

    /// Set group `grpid`'s state through port `port`; true if that changed it (and the
    /// change count). The port is checked by the caller, the group here.
    pub fn set(&mut self, port: u16, grpid: u32, state: AnaState) -> Result<bool, String> {
        check_group(grpid)?;
        if self.state(port, grpid) == state {
            return Ok(false);
        }
        self.set.insert((port, grpid), state);
        self.chgcnt += 1;
        Ok(true)
    }

    /// May an I/O command reach a namespace of group `grpid` through port `port`? If not,
    /// the path status it is answered with (no DNR: the host may retry on another path).
    pub fn check_io(&self, port: u16, grpid: u32) -> Result<(), Status> {
        match self.state(port, grpid) {
            AnaState::Optimized | AnaState::NonOptimized => Ok(()),
            AnaState::Inaccessible => Err(status::ANA_INACCESSIBLE),
            AnaState::PersistentLoss => Err(status::ANA_PERSISTENT_LOSS),
            AnaState::Change => Err(status::ANA_TRANSITION),
        }
    }

    /// The groups there are, in order: the default one, every group a namespace is in
    /// (`in_use`), and every group a state was set for.
    pub fn groups(&self, in_use: impl IntoIterator<Item = u32>) -> BTreeSet<u32> {
        let mut g: BTreeSet<u32> = in_use.into_iter().collect();
        g.insert(DEFAULT_GROUP);
        g.extend(self.set.keys().map(|(_, grp)| *grp));
        g
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_group_is_optimized_until_set_and_each_change_counts_once() {
        let mut t = AnaTable::default();
        assert_eq!(t.state(1, 1), AnaState::Optimized);
        assert_eq!(t.set(2, 1, AnaState::Inaccessible), Ok(true));
        assert_eq!(t.set(2, 1, AnaState::Inaccessible), Ok(false));
        assert_eq!(t.chgcnt, 1);
        assert_eq!(t.state(1, 1), AnaState::Optimized, "another port");
        assert_eq!(t.check_io(2, 1), Err(status::ANA_INACCESSIBLE));
        assert!(t.set(1, 0, AnaState::Change).is_err());
        assert!(t.set(1, MAX_GROUPS + 1, AnaState::Change).is_err());
        assert_eq!(t.chgcnt, 1);
        assert_eq!(t.groups([]).into_iter().collect::<Vec<_>>(), vec![1]);
        assert_eq!(t.groups([3, 3]).into_iter().collect::<Vec<_>>(), vec![1, 3]);
    }
}

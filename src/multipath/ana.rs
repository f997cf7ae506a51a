//! The host's view of ANA through one controller: whether it reports ANA (CMIC bit 3), its
//! ANATT, each namespace's group (Identify Namespace ANAGRPID) and each group's state (the
//! ANA log page). Read at connect, again on the ANA change notice, after each reconnect and
//! when a command comes back with an ANA status (Linux: `nvme_mpath_init_identify`,
//! `nvme_read_ana_log`, `nvme_ana_work`).
//!
//! What a peer sends is bounded: the log is read groups-only into [`LOG_BYTES`], so at most
//! `(LOG_BYTES - 16) / 32` groups are kept; the namespace list is the controller's own
//! (already bounded by its Identify).

use std::time::Duration;

use crate::nvme::admin;
use crate::nvme::ana::{self, id_ctrl, id_ns, AnaLog, AnaState};
use crate::transport::{Controller, HostError};

/// Bytes of the ANA log read (groups only).
pub const LOG_BYTES: usize = 4096;

/// What Identify Controller says about ANA.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CtrlAna {
    /// The controller reports ANA states (CMIC bit 3).
    pub reports: bool,
    /// ANA Transition Time: the longest a group stays in change.
    pub anatt: Duration,
}

/// Identify Controller offset of OAES (le32).
const OAES: usize = 92;

impl CtrlAna {
    /// From Identify Controller data (the 4096 bytes, or fewer: missing fields read as 0).
    pub fn from_identify(id: &[u8]) -> CtrlAna {
        let byte = |at: usize| id.get(at).copied().unwrap_or(0);
        CtrlAna {
            reports: byte(id_ctrl::CMIC) & id_ctrl::CMIC_ANA != 0,
            anatt: Duration::from_secs(u64::from(byte(id_ctrl::ANATT))),
        }
    }

    /// Does the controller send ANA change notices (OAES bit 11)?
    pub fn notices(id: &[u8]) -> bool {
        let oaes = id
            .get(OAES..OAES + 4)
            .map_or(0, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
        oaes & id_ctrl::OAES_ANA_CHANGE != 0
    }
}

/// A namespace's ANA group from Identify Namespace data; 0 when absent.
pub fn ns_group(id: &[u8]) -> u32 {
    id.get(id_ns::ANAGRPID..id_ns::ANAGRPID + 4)
        .map_or(0, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// Each group's state, from ANA log page bytes.
pub fn group_states(log: &[u8]) -> Result<Vec<(u32, AnaState)>, HostError> {
    let log = AnaLog::new_checked(log).map_err(|e| HostError::Protocol(e.to_string()))?;
    Ok(log.groups().map(|g| (g.grpid, g.state)).collect())
}

/// One admin command on `c`, bounded by its connect timeout.
async fn admin_cmd(
    c: &Controller,
    sqe: crate::nvme::Sqe,
    len: usize,
) -> Result<Vec<u8>, HostError> {
    match tokio::time::timeout(
        c.opts.connect_timeout,
        c.admin_queue().submit(sqe, None, len),
    )
    .await
    {
        Ok(r) => Ok(r?.data),
        Err(_) => Err(HostError::Timeout(format!(
            "an ANA read got no answer within the connect timeout ({} ms)",
            c.opts.connect_timeout.as_millis()
        ))),
    }
}

/// Read what Identify Controller says about ANA.
pub async fn read_ctrl_ana(c: &Controller) -> Result<CtrlAna, HostError> {
    let id = admin_cmd(c, admin::identify_controller(0), 4096).await?;
    Ok(CtrlAna::from_identify(&id))
}

/// Read the ANA group of namespace `nsid`.
pub async fn read_ns_group(c: &Controller, nsid: u32) -> Result<u32, HostError> {
    let id = admin_cmd(c, admin::identify_namespace(0, nsid), 4096).await?;
    Ok(ns_group(&id))
}

/// Read the ANA log (groups only) and each group's state.
pub async fn read_group_states(c: &Controller) -> Result<Vec<(u32, AnaState)>, HostError> {
    let sqe = ana::get_ana_log(0, LOG_BYTES, true)?;
    let log = admin_cmd(c, sqe, LOG_BYTES).await?;
    group_states(&log)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nvme::ana::{emit_log, GroupDesc};

    #[test]
    fn identify_fields_and_the_log_give_each_group_its_state() {
        let mut id = vec![0u8; 4096];
        assert_eq!(CtrlAna::from_identify(&id), CtrlAna::default());
        id[id_ctrl::CMIC] = id_ctrl::CMIC_ANA | id_ctrl::CMIC_MULTI_PORT;
        id[id_ctrl::ANATT] = 10;
        id[OAES + 1] = (id_ctrl::OAES_ANA_CHANGE >> 8) as u8;
        let a = CtrlAna::from_identify(&id);
        assert!(a.reports && CtrlAna::notices(&id));
        assert_eq!(a.anatt, Duration::from_secs(10));
        // A short answer reads as "no ANA", not a panic.
        assert_eq!(CtrlAna::from_identify(&id[..10]), CtrlAna::default());

        let mut ns = vec![0u8; 4096];
        ns[id_ns::ANAGRPID..id_ns::ANAGRPID + 4].copy_from_slice(&7u32.to_le_bytes());
        assert_eq!(ns_group(&ns), 7);
        assert_eq!(ns_group(&ns[..50]), 0);

        let groups = [
            GroupDesc {
                grpid: 7,
                chgcnt: 1,
                state: AnaState::Inaccessible,
                nsids: &[],
            },
            GroupDesc {
                grpid: 8,
                chgcnt: 1,
                state: AnaState::Optimized,
                nsids: &[],
            },
        ];
        let mut page = [0u8; 128];
        let n = emit_log(3, &groups, true, &mut page).unwrap();
        assert_eq!(
            group_states(&page[..n]).unwrap(),
            vec![(7, AnaState::Inaccessible), (8, AnaState::Optimized)]
        );
        assert!(matches!(
            group_states(&page[..n - 1]),
            Err(HostError::Protocol(_))
        ));
    }
}

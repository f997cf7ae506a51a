//! One command's way through the target, sans I/O: what data it needs before it runs
//! ([`fetch`]), running it ([`run`], by the queue it came on: Fabrics, admin or I/O), and
//! where its data for the host goes ([`push`]). The transport moves the bytes in between.

use crate::nvme::admin::opcode;
use crate::nvme::{SglDescriptor, Sqe, Status};

use super::command::{Core, Done, Slot, SQE_LEN};
use super::{admin, fabrics, io};

/// How a command's data reaches its staging before it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Fetch {
    /// It came in the capsule and is there already.
    InCapsule,
    /// RDMA READ `len` bytes from the host's `addr` under `key`.
    Keyed { addr: u64, key: u32, len: usize },
}

/// What command `sqe` needs before it can run: `None` runs it now, `Some` fetches its data
/// first; an error is its answer, with nothing moved.
pub(super) fn fetch(core: &Core, slot: &dyn Slot, sqe: &Sqe) -> Result<Option<Fetch>, Status> {
    // Nothing but Connect on a queue without a controller, and no data moved for it
    // (NVMe-oF: Command Sequence Error).
    if slot.cntlid().is_none() && sqe.opcode != opcode::FABRICS {
        return Err(Status::COMMAND_SEQUENCE_ERROR.with_dnr());
    }
    let want = if sqe.opcode == opcode::FABRICS {
        fabrics::data_in_len(sqe)
    } else if slot.qid() == 0 {
        None
    } else {
        io::data_in_len(core, slot, sqe)?
    };
    let Some(want) = want else {
        return Ok(None);
    };
    let sgl = SglDescriptor::parse(&sqe.dptr)
        .map_err(|_| Status::SGL_DESCRIPTOR_TYPE_INVALID.with_dnr())?;
    if (sgl.data_len() as usize) < want || want > slot.staging_len() {
        return Err(Status::SGL_DATA_LENGTH_INVALID.with_dnr());
    }
    match sgl {
        SglDescriptor::InCapsule { offset, .. } => {
            // `offset` comes off the wire: only 0 is valid, so test it before adding.
            let end = SQE_LEN as u64 + want as u64;
            if offset != 0 || end > slot.capsule_len() as u64 {
                return Err(Status::SGL_OFFSET_INVALID.with_dnr());
            }
            Ok(Some(Fetch::InCapsule))
        }
        SglDescriptor::Keyed { addr, key, .. } => Ok(Some(Fetch::Keyed {
            addr,
            key,
            len: want,
        })),
    }
}

/// Run command `sqe`, whose data (if any) is in its staging.
pub(super) fn run(core: &mut Core, slot: &mut dyn Slot, sqe: &Sqe) -> Result<Done, Status> {
    if sqe.opcode == opcode::FABRICS {
        fabrics::exec(core, slot, sqe)
    } else if slot.cntlid().is_none() {
        Err(Status::COMMAND_SEQUENCE_ERROR.with_dnr())
    } else if slot.qid() == 0 {
        admin::exec(core, slot, sqe)
    } else {
        io::exec(core, slot, sqe)
    }
}

/// Where `data_out` bytes for the host go: the address and key of `sqe`'s keyed SGL, or
/// the status that refuses it (a buffer shorter than the data is refused rather than
/// written in part).
pub(super) fn push(sqe: &Sqe, data_out: usize) -> Result<(u64, u32), Status> {
    match SglDescriptor::parse(&sqe.dptr) {
        Ok(SglDescriptor::Keyed { len, .. }) if (len as usize) < data_out => {
            Err(Status::SGL_DATA_LENGTH_INVALID.with_dnr())
        }
        Ok(SglDescriptor::Keyed { addr, key, .. }) => Ok((addr, key)),
        _ => Err(Status::SGL_DESCRIPTOR_TYPE_INVALID.with_dnr()),
    }
}

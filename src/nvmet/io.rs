//! NVM I/O commands, as a table: opcode -> handler over the namespace the command names.
//! A RAM namespace's reads and writes are a copy of at most the queue's staging and run
//! here; the work a host can make long (a file namespace, zeroing) goes to a worker.

use std::collections::VecDeque;
use std::sync::Arc;

use crate::nvme::admin::opcode;
use crate::nvme::{DsmRange, Sqe, Status};

use super::backend::Op;
use super::command::{lookup, Core, Done, Slot};
use super::Namespace;

type Handler = fn(&mut Core, &mut dyn Slot, &Sqe, Arc<Namespace>) -> Result<Done, Status>;

/// The I/O commands the target implements.
const IO: &[(u8, Handler)] = &[
    (opcode::io::READ, read),
    (opcode::io::WRITE, write),
    (opcode::io::FLUSH, flush),
    (opcode::io::WRITE_ZEROES, write_zeroes),
    (opcode::io::DATASET_MANAGEMENT, dataset_management),
];

/// The starting LBA of a read or write (CDW10-11).
pub(super) fn lba(sqe: &Sqe) -> u64 {
    sqe.cdw10 as u64 | ((sqe.cdw11 as u64) << 32)
}

/// The number of blocks of a read or write (CDW12 bits 15:0, 0's based).
pub(super) fn nlb(sqe: &Sqe) -> u64 {
    (sqe.cdw12 & 0xFFFF) as u64 + 1
}

/// How many bytes of host data I/O command `sqe` brings, if any.
pub(super) fn data_in_len(
    core: &Core,
    slot: &dyn Slot,
    sqe: &Sqe,
) -> Result<Option<usize>, Status> {
    match sqe.opcode {
        opcode::io::WRITE => {
            let ns = core.io_ns(slot.cntlid(), sqe)?;
            Ok(Some((nlb(sqe) as usize) << ns.lbads))
        }
        opcode::io::DATASET_MANAGEMENT => Ok(Some(((sqe.cdw10 & 0xFF) as usize + 1) * 16)),
        _ => Ok(None),
    }
}

/// Run I/O command `sqe`; its namespace is checked before its opcode.
pub(super) fn exec(core: &mut Core, slot: &mut dyn Slot, sqe: &Sqe) -> Result<Done, Status> {
    let ns = core.io_ns(slot.cntlid(), sqe)?.clone();
    let run = lookup(IO, sqe.opcode).ok_or(Status::INVALID_OPCODE.with_dnr())?;
    run(core, slot, sqe, ns)
}

/// The byte range of a read or write, no longer than one command's staging.
fn range(slot: &dyn Slot, sqe: &Sqe, ns: &Namespace) -> Result<(u64, usize), Status> {
    let (off, len) = ns.range(lba(sqe), nlb(sqe))?;
    if len > slot.staging_len() {
        return Err(Status::INVALID_FIELD.with_dnr());
    }
    Ok((off, len))
}

fn copied(core: &mut Core, len: usize) {
    core.stats.io_copies += 1;
    core.stats.io_copied_bytes += len as u64;
}

fn read(
    core: &mut Core,
    slot: &mut dyn Slot,
    sqe: &Sqe,
    ns: Arc<Namespace>,
) -> Result<Done, Status> {
    let (off, len) = range(slot, sqe, &ns)?;
    if !ns.is_ram() {
        return Ok(Done::Offload(ns, Op::Read { off, len }));
    }
    // Where the device registers the namespace's memory, the RDMA WRITE reads it: no
    // copy, and nothing held meanwhile.
    if !slot.send_from(&ns, off) {
        slot.data_out(len, &mut |g| ns.read(off, g))?;
        copied(core, len);
    }
    Ok(Done::Respond {
        result: 0,
        data_out: len,
    })
}

fn write(
    core: &mut Core,
    slot: &mut dyn Slot,
    sqe: &Sqe,
    ns: Arc<Namespace>,
) -> Result<Done, Status> {
    let (off, len) = range(slot, sqe, &ns)?;
    let inline = slot.inline();
    if inline.is_some_and(|n| len > n) {
        // The capsule was checked against the SGL, and the SGL against the namespace
        // range, before the command ran: this does not happen.
        return Err(Status::SGL_DATA_LENGTH_INVALID.with_dnr());
    }
    if !ns.is_ram() {
        // A worker reads it from staging, after the receive buffer is posted again.
        if inline.is_some() {
            slot.stage_inline(len);
            copied(core, len);
        }
        return Ok(Done::Offload(ns, Op::Write { off, len }));
    }
    if !slot.landed() {
        slot.data_in(len, &mut |g| ns.write(off, g))?;
        copied(core, len);
    }
    core.stats.bytes_written += len as u64;
    Ok(Done::OK)
}

fn flush(_: &mut Core, _: &mut dyn Slot, _: &Sqe, ns: Arc<Namespace>) -> Result<Done, Status> {
    if !ns.is_ram() {
        return Ok(Done::Offload(ns, Op::Flush));
    }
    ns.flush()?;
    Ok(Done::OK)
}

fn write_zeroes(
    _: &mut Core,
    _: &mut dyn Slot,
    sqe: &Sqe,
    ns: Arc<Namespace>,
) -> Result<Done, Status> {
    let (off, len) = ns.range(lba(sqe), nlb(sqe))?;
    let ranges = VecDeque::from([(off, len)]);
    Ok(Done::Offload(ns, Op::Zero { ranges }))
}

fn dataset_management(
    _: &mut Core,
    slot: &mut dyn Slot,
    sqe: &Sqe,
    ns: Arc<Namespace>,
) -> Result<Done, Status> {
    let nr = (sqe.cdw10 & 0xFF) as usize + 1;
    let deallocate = sqe.cdw11 & (1 << 2) != 0;
    let mut ranges = Vec::new();
    slot.data_in(nr * 16, &mut |g| {
        ranges.extend(DsmRange::parse_all(g));
        Ok(())
    })?;
    if ranges.len() != nr {
        return Err(Status::INVALID_FIELD.with_dnr());
    }
    if !deallocate {
        return Ok(Done::OK);
    }
    // Every range is checked before any is zeroed.
    let mut zero = VecDeque::new();
    for r in &ranges {
        let (off, len) = ns.range(r.slba, r.nlb as u64)?;
        if len > 0 {
            zero.push_back((off, len));
        }
    }
    Ok(Done::Offload(ns, Op::Zero { ranges: zero }))
}

//! I/O commands: data in and out of a RAM namespace, and every bounds error (LBA range,
//! transfer length, SGL and data length mismatches, unknown opcode, bad NSID).

use std::collections::VecDeque;

use crate::nvme::admin as cmd;
use crate::nvme::{DsmRange, SglDescriptor, Sqe, Status};

use super::*;

fn in_capsule(sqe: Sqe, offset: u64, len: u32) -> Sqe {
    sqe.with_sgl(&SglDescriptor::InCapsule { offset, len })
        .expect("sgl")
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 + 3) as u8).collect()
}

fn io() -> (Core, Fake) {
    let (mut core, admin) = enabled();
    let q = io_queue(&mut core, &admin, 1);
    (core, q)
}

#[test]
fn a_keyed_write_reads_back() {
    let (mut core, mut q) = io();
    let data = pattern(4 << 9);
    let w = keyed(cmd::write(1, 1, 10, 4, false).expect("sqe"), 4 << 9);
    assert_eq!(submit(&mut core, &mut q, w, &data).result(), 0);
    q.staging.fill(0);
    let r = keyed(cmd::read(2, 1, 10, 4).expect("sqe"), 4 << 9);
    assert_eq!(submit(&mut core, &mut q, r, &[]).data(), &data[..]);
    assert_eq!(core.stats.bytes_written, 4 << 9);
}

#[test]
fn an_in_capsule_write_reads_back() {
    let (mut core, mut q) = io();
    let data = pattern(1 << 9);
    q.capsule_len = 64 + data.len();
    let w = in_capsule(cmd::write(1, 1, 0, 1, false).expect("sqe"), 0, 512);
    submit(&mut core, &mut q, w, &data).result();
    let r = keyed(cmd::read(2, 1, 0, 1).expect("sqe"), 512);
    assert_eq!(submit(&mut core, &mut q, r, &[]).data(), &data[..]);
}

#[test]
fn reads_and_writes_past_the_namespace_are_lba_out_of_range() {
    let (mut core, mut q) = io();
    let cases = [
        cmd::read(1, 1, BLOCKS - 1, 2).expect("sqe"),
        cmd::read(2, 1, BLOCKS, 1).expect("sqe"),
        cmd::write_zeroes(4, 1, BLOCKS - 1, 2, false).expect("sqe"),
        // slba + nlb overflows.
        cmd::read(5, 1, u64::MAX, 1).expect("sqe"),
    ];
    for sqe in cases {
        let st = submit(&mut core, &mut q, keyed(sqe, 1024), &[]).status();
        assert_eq!(st, Status::LBA_OUT_OF_RANGE.with_dnr(), "{sqe:?}");
    }
    // A write's range is checked before its data moves: its data length is right.
    let w = keyed(cmd::write(3, 1, BLOCKS - 1, 2, false).expect("sqe"), 1024);
    let st = submit(&mut core, &mut q, w, &[0; 1024]).status();
    assert_eq!(st, Status::LBA_OUT_OF_RANGE.with_dnr());
}

#[test]
fn a_transfer_past_the_staging_is_refused() {
    let (mut core, mut q) = io();
    let blocks = (MAX_TRANSFER >> 9) as u32 + 1;
    let len = (blocks as u64) << 9;
    let r = keyed(cmd::read(1, 1, 0, blocks).expect("sqe"), len);
    assert_eq!(
        submit(&mut core, &mut q, r, &[]).status(),
        Status::INVALID_FIELD.with_dnr()
    );
    let w = keyed(cmd::write(2, 1, 0, blocks, false).expect("sqe"), len);
    let st = submit(&mut core, &mut q, w, &vec![0; len as usize]).status();
    assert_eq!(st, Status::SGL_DATA_LENGTH_INVALID.with_dnr());
}

#[test]
fn an_sgl_shorter_than_the_data_is_refused() {
    let (mut core, mut q) = io();
    let w = keyed(cmd::write(1, 1, 0, 2, false).expect("sqe"), 512);
    let st = submit(&mut core, &mut q, w, &[0; 1024]).status();
    assert_eq!(st, Status::SGL_DATA_LENGTH_INVALID.with_dnr());
    let r = keyed(cmd::read(2, 1, 0, 2).expect("sqe"), 512);
    let st = submit(&mut core, &mut q, r, &[]).status();
    assert_eq!(st, Status::SGL_DATA_LENGTH_INVALID.with_dnr());
}

#[test]
fn in_capsule_data_must_start_at_zero_and_fit_the_capsule() {
    let (mut core, mut q) = io();
    q.capsule_len = 64 + 512;
    let w = in_capsule(cmd::write(1, 1, 0, 1, false).expect("sqe"), 16, 512);
    let st = submit(&mut core, &mut q, w, &[0; 512]).status();
    assert_eq!(st, Status::SGL_OFFSET_INVALID.with_dnr());
    // Two blocks claimed, one block in the capsule.
    let w = in_capsule(cmd::write(2, 1, 0, 2, false).expect("sqe"), 0, 1024);
    let st = submit(&mut core, &mut q, w, &[0; 512]).status();
    assert_eq!(st, Status::SGL_OFFSET_INVALID.with_dnr());
}

#[test]
fn an_unknown_sgl_type_is_refused() {
    let (mut core, mut q) = io();
    let mut w = cmd::write(1, 1, 0, 1, false).expect("sqe");
    w.dptr[15] = 0x30; // Last Segment descriptor
    let st = submit(&mut core, &mut q, w, &[0; 512]).status();
    assert_eq!(st, Status::SGL_DESCRIPTOR_TYPE_INVALID.with_dnr());
    // Data for the host needs a keyed SGL.
    let r = in_capsule(cmd::read(2, 1, 0, 1).expect("sqe"), 0, 512);
    let st = submit(&mut core, &mut q, r, &[]).status();
    assert_eq!(st, Status::SGL_DESCRIPTOR_TYPE_INVALID.with_dnr());
}

#[test]
fn an_unknown_opcode_and_a_bad_nsid_are_refused_namespace_first() {
    let (mut core, mut q) = io();
    let mut compare = Sqe::new(0x05, 1);
    compare.nsid = 1;
    let st = submit(&mut core, &mut q, compare, &[]).status();
    assert_eq!(st, Status::INVALID_OPCODE.with_dnr());
    let cases = [
        cmd::read(2, 3, 0, 1).expect("sqe"),
        cmd::write(3, 0, 0, 1, false).expect("sqe"),
        cmd::flush(4, 0xFFFF_FFFF),
        Sqe::new(0x05, 5),
    ];
    for sqe in cases {
        let st = submit(&mut core, &mut q, keyed(sqe, 512), &[0; 512]).status();
        assert_eq!(
            st,
            Status::INVALID_NAMESPACE_OR_FORMAT.with_dnr(),
            "{sqe:?}"
        );
    }
}

#[test]
fn flush_of_a_ram_namespace_succeeds_here() {
    let (mut core, mut q) = io();
    assert_eq!(submit(&mut core, &mut q, cmd::flush(1, 1), &[]).result(), 0);
}

#[test]
fn write_zeroes_goes_to_a_worker_with_its_byte_range() {
    let (mut core, mut q) = io();
    let sqe = cmd::write_zeroes(1, 1, 4, 8, false).expect("sqe");
    match submit(&mut core, &mut q, sqe, &[]) {
        Outcome::Offloaded(Op::Zero { ranges }) => {
            assert_eq!(ranges, VecDeque::from([(4 << 9, 8 << 9)]))
        }
        other => panic!("{other:?}"),
    }
}

fn dsm_data(ranges: &[DsmRange]) -> Vec<u8> {
    let mut b = vec![0u8; ranges.len() * 16];
    DsmRange::emit_all(ranges, &mut b).expect("ranges");
    b
}

fn range(slba: u64, nlb: u32) -> DsmRange {
    DsmRange {
        cattr: 0,
        nlb,
        slba,
    }
}

#[test]
fn deallocate_checks_every_range_before_any_is_zeroed() {
    let (mut core, mut q) = io();
    let good = [range(0, 2), range(8, 0), range(16, 1)];
    let sqe = keyed(cmd::dsm_deallocate(1, 1, 3).expect("sqe"), 48);
    match submit(&mut core, &mut q, sqe, &dsm_data(&good)) {
        Outcome::Offloaded(Op::Zero { ranges }) => {
            assert_eq!(ranges, VecDeque::from([(0, 1024), (16 << 9, 512)]))
        }
        other => panic!("{other:?}"),
    }
    let bad = [range(0, 2), range(BLOCKS, 1)];
    let sqe = keyed(cmd::dsm_deallocate(2, 1, 2).expect("sqe"), 32);
    let st = submit(&mut core, &mut q, sqe, &dsm_data(&bad)).status();
    assert_eq!(st, Status::LBA_OUT_OF_RANGE.with_dnr());
}

#[test]
fn dataset_management_without_deallocate_is_a_hint() {
    let (mut core, mut q) = io();
    let mut sqe = cmd::dsm_deallocate(1, 1, 1).expect("sqe");
    sqe.cdw11 = 0;
    let out = submit(&mut core, &mut q, keyed(sqe, 16), &dsm_data(&[range(0, 1)]));
    assert_eq!(out.result(), 0);
}

#[test]
fn dataset_management_ranges_must_be_all_there() {
    let (mut core, mut q) = io();
    let sqe = keyed(cmd::dsm_deallocate(1, 1, 2).expect("sqe"), 16);
    let st = submit(&mut core, &mut q, sqe, &dsm_data(&[range(0, 1)])).status();
    assert_eq!(st, Status::SGL_DATA_LENGTH_INVALID.with_dnr());
}

#[test]
fn io_commands_need_an_io_queue_of_a_controller() {
    let (mut core, _) = enabled();
    let mut q = Fake::new(500, 1, MAX_TRANSFER);
    let r = keyed(cmd::read(1, 1, 0, 1).expect("sqe"), 512);
    let st = submit(&mut core, &mut q, r, &[]).status();
    assert_eq!(st, Status::COMMAND_SEQUENCE_ERROR.with_dnr());
}

//! Admin commands: Identify of each CNS, Get / Set Features of each feature, Get Log Page of
//! each log page, Keep Alive, Async Event Request, and commands the target does not
//! implement.

use crate::nvme::admin::{self as cmd, cns, feature, lid, opcode};
use crate::nvme::fabrics::DISCOVERY_NQN;
use crate::nvme::{
    DiscoveryLogEntry, DiscoveryLogHeader, IdentifyController, IdentifyNamespace, Sqe, Status,
};

use super::super::command::AEN_NS_CHANGED;
use super::*;

/// Run admin command `sqe` with a keyed SGL of `len` bytes.
fn admin_data(core: &mut Core, admin: &mut Fake, sqe: Sqe, len: u64) -> Outcome {
    submit(core, admin, keyed(sqe, len), &[])
}

#[test]
fn identify_controller_describes_the_subsystem() {
    let (mut core, mut admin) = enabled();
    let out = admin_data(&mut core, &mut admin, cmd::identify_controller(1), 4096);
    let id = IdentifyController::parse(out.data()).expect("identify");
    assert_eq!(id.cntlid, admin.cntlid.expect("id"));
    assert_eq!(id.subnqn.text(), SUBNQN);
    assert_eq!(id.sn.text().trim_end(), "NVMFRDMA0001");
    // 16 KiB in 4 KiB pages: 2^2.
    assert_eq!(id.mdts, 2);
    // NN covers every namespace the subsystem may come to hold, as in Linux nvmet.
    assert_eq!(
        (id.nn, id.maxcmd),
        (super::super::MAX_NAMESPACES as u32, 128)
    );
    assert_eq!(id.ioccsz, (64 + 8192) / 16);
}

#[test]
fn identify_namespace_and_its_descriptors() {
    let (mut core, mut admin) = enabled();
    let out = admin_data(&mut core, &mut admin, cmd::identify_namespace(1, 1), 4096);
    let id = IdentifyNamespace::parse(out.data()).expect("identify");
    let ns = core.cfg.subsystems[0].namespaces[0].clone();
    assert_eq!((id.nsze, id.nguid), (BLOCKS, ns.ident.nguid));
    let sqe = cmd::identify(2, cns::NS_ID_DESCRIPTORS, 1, 0);
    let out = admin_data(&mut core, &mut admin, sqe, 4096);
    let mut want = [0u8; 4096];
    crate::nvme::identify::emit_ns_id_descriptors(&ns.ident, &mut want);
    assert_eq!(out.data(), &want[..]);
}

#[test]
fn identify_of_a_namespace_that_is_not_there() {
    let (mut core, mut admin) = enabled();
    for c in [cns::NAMESPACE, cns::NS_ID_DESCRIPTORS] {
        let sqe = cmd::identify(1, c, 9, 0);
        let st = admin_data(&mut core, &mut admin, sqe, 4096).status();
        assert_eq!(
            st,
            Status::INVALID_NAMESPACE_OR_FORMAT.with_dnr(),
            "cns {c}"
        );
    }
}

#[test]
fn identify_active_namespace_list_starts_after_the_nsid_given() {
    let (mut core, mut admin) = enabled();
    let ids = |out: &Outcome| -> Vec<u32> {
        out.data()
            .chunks(4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4")))
            .take_while(|&n| n != 0)
            .collect()
    };
    let all = admin_data(
        &mut core,
        &mut admin,
        cmd::identify_active_namespaces(1, 0),
        4096,
    );
    assert_eq!(ids(&all), vec![1, 2]);
    let after = admin_data(
        &mut core,
        &mut admin,
        cmd::identify_active_namespaces(2, 1),
        4096,
    );
    assert_eq!(ids(&after), vec![2]);
}

#[test]
fn identify_refuses_an_unknown_cns_and_a_short_buffer() {
    let (mut core, mut admin) = enabled();
    let st = admin_data(&mut core, &mut admin, cmd::identify(1, 0x10, 0, 0), 4096).status();
    assert_eq!(st, Status::INVALID_FIELD.with_dnr());
    let st = admin_data(&mut core, &mut admin, cmd::identify_controller(2), 1024).status();
    assert_eq!(st, Status::SGL_DATA_LENGTH_INVALID.with_dnr());
}

#[test]
fn number_of_queues_is_granted_up_to_the_most_and_read_back() {
    let (mut core, mut admin) = enabled();
    let got = |core: &mut Core, admin: &mut Fake| {
        let out = submit(
            core,
            admin,
            cmd::get_features(5, feature::NUMBER_OF_QUEUES),
            &[],
        );
        cmd::num_queues_allocated(out.result() as u32)
    };
    assert_eq!(got(&mut core, &mut admin), (1, 1));
    let sqe = cmd::set_num_queues(1, 2, 3).expect("sqe");
    let out = submit(&mut core, &mut admin, sqe, &[]);
    assert_eq!(cmd::num_queues_allocated(out.result() as u32), (2, 2));
    // Asked for more than the target gives (4).
    let sqe = cmd::set_num_queues(2, 64, 64).expect("sqe");
    let out = submit(&mut core, &mut admin, sqe, &[]);
    assert_eq!(cmd::num_queues_allocated(out.result() as u32), (4, 4));
    assert_eq!(got(&mut core, &mut admin), (4, 4));
    // 65536 queues do not fit the field.
    let sqe = cmd::set_features(3, feature::NUMBER_OF_QUEUES, 0xFFFF);
    let st = submit(&mut core, &mut admin, sqe, &[]).status();
    assert_eq!(st, Status::INVALID_FIELD.with_dnr());
}

#[test]
fn keep_alive_timer_is_set_within_the_most_and_read_back() {
    let (mut core, mut admin) = enabled();
    let sqe = cmd::set_features(1, feature::KEEP_ALIVE_TIMER, 5_000);
    submit(&mut core, &mut admin, sqe, &[]).result();
    let sqe = cmd::get_features(2, feature::KEEP_ALIVE_TIMER);
    assert_eq!(submit(&mut core, &mut admin, sqe, &[]).result(), 5_000);
    let sqe = cmd::set_features(3, feature::KEEP_ALIVE_TIMER, 60_001);
    let st = submit(&mut core, &mut admin, sqe, &[]).status();
    assert_eq!(st, Status::KEEP_ALIVE_INVALID.with_dnr());
    let id = admin.cntlid.expect("id");
    assert_eq!(core.ctrls[&id].kato_ms, 5_000);
}

#[test]
fn accepted_features_read_back_and_others_are_refused() {
    let (mut core, mut admin) = enabled();
    let vwc = feature::VOLATILE_WRITE_CACHE;
    submit(&mut core, &mut admin, cmd::set_features(1, vwc, 1), &[]).result();
    let out = submit(&mut core, &mut admin, cmd::get_features(2, vwc), &[]);
    assert_eq!(out.result(), 0);
    // Async Event Configuration: what was set, of the events the controller reports.
    let aec = feature::ASYNC_EVENT_CONFIG;
    let out = submit(&mut core, &mut admin, cmd::get_features(2, aec), &[]);
    assert_eq!(out.result(), (1 << 8) | (1 << 11), "enabled from the start");
    submit(&mut core, &mut admin, cmd::set_features(1, aec, 1), &[]).result();
    let out = submit(&mut core, &mut admin, cmd::get_features(2, aec), &[]);
    assert_eq!(out.result(), 1);
    let st = submit(
        &mut core,
        &mut admin,
        cmd::set_features(1, aec, 1 << 9),
        &[],
    )
    .status();
    assert_eq!(st, Status::INVALID_FIELD.with_dnr());
    // Arbitration: not implemented.
    for sqe in [cmd::set_features(3, 0x01, 0), cmd::get_features(4, 0x01)] {
        let st = submit(&mut core, &mut admin, sqe, &[]).status();
        assert_eq!(st, Status::INVALID_FIELD.with_dnr());
    }
}

#[test]
fn keep_alive_succeeds() {
    let (mut core, mut admin) = enabled();
    let out = submit(&mut core, &mut admin, cmd::keep_alive(1), &[]);
    assert_eq!(out.result(), 0);
}

#[test]
fn async_event_requests_park_up_to_the_limit() {
    let (mut core, mut admin) = enabled();
    for cid in 0..4 {
        let out = submit(&mut core, &mut admin, cmd::async_event_request(cid), &[]);
        assert!(matches!(out, Outcome::Parked), "{out:?}");
    }
    let st = submit(&mut core, &mut admin, cmd::async_event_request(4), &[]).status();
    assert_eq!(st, Status::ASYNC_EVENT_LIMIT_EXCEEDED.with_dnr());
}

#[test]
fn an_event_kept_while_no_request_waited_answers_the_next_one() {
    let (mut core, mut admin) = enabled();
    let id = admin.cntlid.expect("id");
    assert_eq!(core.namespace_added(0, 3), vec![id]);
    core.ctrls
        .get_mut(&id)
        .expect("ctrl")
        .keep_event(AEN_NS_CHANGED);
    core.ctrls
        .get_mut(&id)
        .expect("ctrl")
        .keep_event(AEN_NS_CHANGED);
    let out = submit(&mut core, &mut admin, cmd::async_event_request(1), &[]);
    assert_eq!(out.result(), AEN_NS_CHANGED as u64);
    // Kept once: the next request waits.
    let out = submit(&mut core, &mut admin, cmd::async_event_request(2), &[]);
    assert!(matches!(out, Outcome::Parked));
}

fn log_page(core: &mut Core, admin: &mut Fake, lid: u8, offset: u64, len: u64) -> Outcome {
    let sqe = cmd::get_log_page(1, 0xFFFF_FFFF, lid, offset, len).expect("sqe");
    admin_data(core, admin, sqe, len)
}

#[test]
fn error_smart_and_firmware_log_pages_are_zeroes() {
    let (mut core, mut admin) = enabled();
    for l in [lid::ERROR_INFO, lid::SMART, 0x03] {
        let out = log_page(&mut core, &mut admin, l, 0, 512);
        assert_eq!(out.data(), &[0u8; 512][..], "lid {l:#x}");
    }
}

#[test]
fn changed_namespace_list_names_added_namespaces_and_clears_on_read() {
    let (mut core, mut admin) = enabled();
    core.namespace_added(0, 7);
    core.namespace_added(0, 9);
    let out = log_page(&mut core, &mut admin, lid::CHANGED_NS_LIST, 0, 16);
    assert_eq!(
        out.data(),
        &[7, 0, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0][..]
    );
    let out = log_page(&mut core, &mut admin, lid::CHANGED_NS_LIST, 0, 16);
    assert_eq!(out.data(), &[0u8; 16][..]);
}

#[test]
fn a_controller_that_turned_namespace_notices_off_gets_none_but_keeps_the_list() {
    let (mut core, mut admin) = enabled();
    let id = admin.cntlid.expect("id");
    assert_eq!(core.namespace_added(0, 7), vec![id]);
    let aec = cmd::set_features(1, feature::ASYNC_EVENT_CONFIG, 1 << 11);
    assert!(submit(&mut core, &mut admin, aec, &[])
        .status()
        .is_success());
    assert_eq!(core.namespace_added(0, 9), Vec::<u16>::new());
    let out = log_page(&mut core, &mut admin, lid::CHANGED_NS_LIST, 0, 8);
    assert_eq!(out.data(), &[7, 0, 0, 0, 9, 0, 0, 0][..]);
}

#[test]
fn changed_namespace_list_overflows_to_all_ones() {
    let (mut core, mut admin) = enabled();
    for nsid in 1..=1025 {
        core.namespace_added(0, nsid);
    }
    let out = log_page(&mut core, &mut admin, lid::CHANGED_NS_LIST, 0, 8);
    assert_eq!(out.data(), &[0xFF, 0xFF, 0xFF, 0xFF, 0, 0, 0, 0][..]);
}

#[test]
fn discovery_log_lists_the_subsystems_the_host_may_see() {
    let mut cfg = config();
    let mut hidden = cfg.subsystems[0].clone();
    hidden.nqn = Nqn::new("nqn.2024-01.io.nvmf-rdma:hidden").expect("nqn");
    hidden.allowed_hosts = Some(vec!["nqn.2024-01.io.nvmf-rdma:other".into()]);
    cfg.subsystems.push(hidden);
    let mut core = Core::new(cfg);
    let mut admin = Fake::new(1, 0, ADMIN_STAGING);
    connect_admin(&mut core, &mut admin, DISCOVERY_NQN).result();
    let out = log_page(&mut core, &mut admin, lid::DISCOVERY, 0, 2048);
    let hdr = DiscoveryLogHeader::parse(&out.data()[..1024]).expect("header");
    assert_eq!(hdr.numrec, 1);
    let entry = DiscoveryLogEntry::parse(&out.data()[1024..]).expect("entry");
    assert_eq!(entry.subnqn.text(), SUBNQN);
    assert_eq!(entry.trsvcid.text(), "4420");
    // From an offset: the entry alone; past the page: zeroes.
    let out = log_page(&mut core, &mut admin, lid::DISCOVERY, 1024, 1024);
    assert_eq!(DiscoveryLogEntry::parse(out.data()).expect("entry"), entry);
    let out = log_page(&mut core, &mut admin, lid::DISCOVERY, 4096, 64);
    assert_eq!(out.data(), &[0u8; 64][..]);
}

#[test]
fn get_log_page_refuses_an_unknown_page_and_more_than_staging() {
    let (mut core, mut admin) = enabled();
    let st = log_page(&mut core, &mut admin, 0x05, 0, 64).status();
    assert_eq!(st, Status::INVALID_LOG_PAGE.with_dnr());
    let st = log_page(&mut core, &mut admin, lid::SMART, 0, 16384).status();
    assert_eq!(st, Status::SGL_DATA_LENGTH_INVALID.with_dnr());
}

#[test]
fn unimplemented_admin_commands_are_invalid_opcodes() {
    let (mut core, mut admin) = enabled();
    // Abort, Delete I/O SQ, Namespace Management, Format NVM.
    for op in [opcode::admin::ABORT, 0x00, 0x0D, 0x80] {
        let st = submit(&mut core, &mut admin, Sqe::new(op, 1), &[]).status();
        assert_eq!(st, Status::INVALID_OPCODE.with_dnr(), "opcode {op:#x}");
    }
}

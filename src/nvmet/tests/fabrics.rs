//! Fabrics Connect (good and bad), Property Get / Set of each register, and Fabrics
//! commands the target does not implement.

use crate::nvme::fabrics::{reg, ConnectResult, DISCOVERY_NQN};
use crate::nvme::{Cap, Csts, FabricsCmd, Sqe, Status};

use super::*;

#[test]
fn admin_connect_makes_a_controller_and_answers_its_id() {
    let mut core = Core::new(config());
    let mut q = Fake::new(1, 0, ADMIN_STAGING);
    let out = connect_admin(&mut core, &mut q, SUBNQN);
    let ConnectResult::Ok { cntlid, authreq } = ConnectResult::from_result(out.result(), true)
    else {
        panic!("not a success result")
    };
    assert_eq!((authreq, Some(cntlid)), (0, q.cntlid));
    let ctrl = &core.ctrls[&cntlid];
    assert_eq!(ctrl.hostnqn, HOSTNQN);
    assert_eq!(ctrl.hostid, HOSTID);
    assert_eq!(ctrl.queues, vec![(q.at(), 0)]);
    // Asked for none: the most it may have.
    assert_eq!(ctrl.kato_ms, 60_000);
}

#[test]
fn connect_ids_are_not_reused_at_once_and_run_out() {
    let mut cfg = config();
    cfg.cntlid_min = 5;
    cfg.cntlid_max = 6;
    let mut core = Core::new(cfg);
    let mut ids = Vec::new();
    for n in 0..2 {
        let mut q = Fake::new(n, 0, ADMIN_STAGING);
        connect_admin(&mut core, &mut q, SUBNQN).result();
        ids.push(q.cntlid.expect("id"));
    }
    assert_eq!(ids, vec![5, 6]);
    let mut q = Fake::new(9, 0, ADMIN_STAGING);
    let st = connect_admin(&mut core, &mut q, SUBNQN).status();
    assert_eq!(st, Status::CONNECT_CONTROLLER_BUSY);
    assert_eq!(core.stats.cntlid_exhausted, 1);
    assert!(q.cntlid.is_none());
}

#[test]
fn connect_refuses_bad_parameters_and_leaves_no_controller() {
    let bad_recfmt = {
        let mut s = connect_sqe(0, 31, 0);
        s.cdw10 |= 1;
        s
    };
    let cases: [(Sqe, [u8; 1024], Status); 7] = [
        (
            bad_recfmt,
            connect_data(SUBNQN, CNTLID_DYNAMIC),
            Status::CONNECT_INCOMPATIBLE_FORMAT.with_dnr(),
        ),
        // The queue was set up as an admin queue of 32 entries.
        (
            connect_sqe(1, 31, 0),
            connect_data(SUBNQN, CNTLID_DYNAMIC),
            Status::CONNECT_INVALID_PARAMETERS.with_dnr(),
        ),
        (
            connect_sqe(0, 15, 0),
            connect_data(SUBNQN, CNTLID_DYNAMIC),
            Status::CONNECT_INVALID_PARAMETERS.with_dnr(),
        ),
        (
            connect_sqe(0, 31, 0),
            connect_data("nqn.2024-01.io.nvmf-rdma:nobody", CNTLID_DYNAMIC),
            Status::CONNECT_INVALID_PARAMETERS.with_dnr(),
        ),
        // An admin queue asks for a dynamic controller.
        (
            connect_sqe(0, 31, 0),
            connect_data(SUBNQN, 3),
            Status::CONNECT_INVALID_PARAMETERS.with_dnr(),
        ),
        // Past max_kato_ms.
        (
            connect_sqe(0, 31, 60_001),
            connect_data(SUBNQN, CNTLID_DYNAMIC),
            Status::CONNECT_INVALID_PARAMETERS.with_dnr(),
        ),
        // Connect data that does not parse (no NQNs).
        (
            connect_sqe(0, 31, 0),
            [0u8; 1024],
            Status::CONNECT_INVALID_PARAMETERS.with_dnr(),
        ),
    ];
    for (sqe, data, want) in cases {
        let mut core = Core::new(config());
        let mut q = Fake::new(1, 0, ADMIN_STAGING);
        assert_eq!(submit(&mut core, &mut q, sqe, &data).status(), want);
        assert!(core.ctrls.is_empty() && q.cntlid.is_none());
    }
}

#[test]
fn connect_refuses_a_host_the_subsystem_does_not_allow() {
    let mut cfg = config();
    cfg.subsystems[0].allowed_hosts = Some(vec!["nqn.2024-01.io.nvmf-rdma:other".into()]);
    let mut core = Core::new(cfg);
    let mut q = Fake::new(1, 0, ADMIN_STAGING);
    let st = connect_admin(&mut core, &mut q, SUBNQN).status();
    assert_eq!(st, Status::CONNECT_INVALID_HOST.with_dnr());
}

#[test]
fn connect_needs_its_data_whole() {
    let mut core = Core::new(config());
    let mut q = Fake::new(1, 0, ADMIN_STAGING);
    let sqe = keyed(connect_sqe(0, 31, 0), 512);
    let st = submit(
        &mut core,
        &mut q,
        sqe,
        &connect_data(SUBNQN, CNTLID_DYNAMIC),
    )
    .status();
    assert_eq!(st, Status::SGL_DATA_LENGTH_INVALID.with_dnr());
}

#[test]
fn a_second_connect_on_a_queue_is_a_sequence_error() {
    let (mut core, mut admin) = enabled();
    let st = connect_admin(&mut core, &mut admin, SUBNQN).status();
    assert_eq!(st, Status::COMMAND_SEQUENCE_ERROR.with_dnr());
}

#[test]
fn io_connect_joins_the_controller() {
    let (mut core, admin) = enabled();
    let q = io_queue(&mut core, &admin, 1);
    let cntlid = admin.cntlid.expect("id");
    assert_eq!(q.cntlid, Some(cntlid));
    assert_eq!(
        core.ctrls[&cntlid].queues,
        vec![(admin.at(), 0), (q.at(), 1)]
    );
}

#[test]
fn io_connect_refuses_what_does_not_match_its_controller() {
    let (mut core, admin) = enabled();
    let cntlid = admin.cntlid.expect("id");
    let other_host = {
        let mut d = connect_data(SUBNQN, cntlid);
        d[0] ^= 1; // hostid
        d
    };
    let cases = [
        (
            1,
            connect_data(SUBNQN, cntlid + 1),
            Status::CONNECT_INVALID_PARAMETERS,
        ),
        (1, other_host, Status::CONNECT_INVALID_PARAMETERS),
        // Set Features gave it one I/O queue (none asked: still one).
        (
            2,
            connect_data(SUBNQN, cntlid),
            Status::CONNECT_INVALID_PARAMETERS,
        ),
    ];
    for (qid, data, want) in cases {
        let mut q = Fake::new(300, qid, MAX_TRANSFER);
        let st = submit(&mut core, &mut q, connect_sqe(qid, 31, 0), &data).status();
        assert_eq!(st, want.with_dnr(), "qid {qid}");
    }
    // A qid the controller has already.
    io_queue(&mut core, &admin, 1);
    let mut q = Fake::new(301, 1, MAX_TRANSFER);
    let st = submit(
        &mut core,
        &mut q,
        connect_sqe(1, 31, 0),
        &connect_data(SUBNQN, cntlid),
    );
    assert_eq!(st.status(), Status::COMMAND_SEQUENCE_ERROR.with_dnr());
}

#[test]
fn io_connect_waits_for_the_controller_to_be_enabled() {
    let mut core = Core::new(config());
    let mut admin = Fake::new(1, 0, ADMIN_STAGING);
    connect_admin(&mut core, &mut admin, SUBNQN).result();
    let mut q = Fake::new(2, 1, MAX_TRANSFER);
    let data = connect_data(SUBNQN, admin.cntlid.expect("id"));
    let st = submit(&mut core, &mut q, connect_sqe(1, 31, 0), &data).status();
    assert_eq!(st, Status::COMMAND_SEQUENCE_ERROR.with_dnr());
}

#[test]
fn a_discovery_controller_has_no_io_queues_and_a_bounded_kato() {
    let mut core = Core::new(config());
    let mut admin = Fake::new(1, 0, ADMIN_STAGING);
    connect_admin(&mut core, &mut admin, DISCOVERY_NQN).result();
    let cntlid = admin.cntlid.expect("id");
    assert!(core.ctrls[&cntlid].is_discovery());
    let en = FabricsCmd::set(reg::CC, 1).to_sqe(2);
    submit(&mut core, &mut admin, en, &[]).result();
    let mut q = Fake::new(2, 1, MAX_TRANSFER);
    let data = connect_data(DISCOVERY_NQN, cntlid);
    let st = submit(&mut core, &mut q, connect_sqe(1, 31, 0), &data).status();
    assert_eq!(st, Status::INVALID_QUEUE_ID.with_dnr());

    let mut cfg = config();
    cfg.max_kato_ms = 600_000;
    let mut core = Core::new(cfg);
    let mut admin = Fake::new(1, 0, ADMIN_STAGING);
    connect_admin(&mut core, &mut admin, DISCOVERY_NQN).result();
    assert_eq!(core.ctrls[&admin.cntlid.expect("id")].kato_ms, 120_000);
}

#[test]
fn property_get_reads_each_register() {
    let (mut core, mut admin) = enabled();
    let mut get = |offset| {
        let sqe = FabricsCmd::get(offset).to_sqe(9);
        submit(&mut core, &mut admin, sqe, &[]).result()
    };
    let cap = Cap(get(reg::CAP));
    assert_eq!((cap.mqes(), cap.cqr(), cap.css()), (127, true, 1));
    assert_eq!(get(reg::VS), 0x0001_0300);
    assert_eq!(get(reg::CC), 1);
    assert!(Csts(get(reg::CSTS) as u32).rdy());
}

#[test]
fn property_get_refuses_a_wrong_size_an_unknown_register_and_an_io_queue() {
    let (mut core, mut admin) = enabled();
    let cases = [
        (
            FabricsCmd::PropertyGet {
                size8: false,
                offset: reg::CAP,
            },
            Status::INVALID_FIELD,
        ),
        (
            FabricsCmd::PropertyGet {
                size8: true,
                offset: reg::CC,
            },
            Status::INVALID_FIELD,
        ),
        (FabricsCmd::get(0x30), Status::INVALID_FIELD),
    ];
    for (cmd, want) in cases {
        let st = submit(&mut core, &mut admin, cmd.to_sqe(3), &[]).status();
        assert_eq!(st, want.with_dnr(), "{cmd:?}");
    }
    let mut q = io_queue(&mut core, &admin, 1);
    let st = submit(&mut core, &mut q, FabricsCmd::get(reg::CC).to_sqe(4), &[]).status();
    assert_eq!(st, Status::INVALID_FIELD.with_dnr());
}

#[test]
fn property_set_of_cc_enables_and_shuts_down() {
    let mut core = Core::new(config());
    let mut admin = Fake::new(1, 0, ADMIN_STAGING);
    connect_admin(&mut core, &mut admin, SUBNQN).result();
    let id = admin.cntlid.expect("id");
    assert!(!core.ctrls[&id].csts.rdy());
    let cc = crate::nvme::Cc::enable_default();
    submit(
        &mut core,
        &mut admin,
        FabricsCmd::set(reg::CC, cc.0 as u64).to_sqe(2),
        &[],
    )
    .result();
    assert_eq!((core.ctrls[&id].cc, core.ctrls[&id].csts.rdy()), (cc, true));
    // SHN = 01b: normal shutdown; shutdown complete is reported.
    let shn = cc.0 as u64 | (1 << 14);
    submit(
        &mut core,
        &mut admin,
        FabricsCmd::set(reg::CC, shn).to_sqe(3),
        &[],
    )
    .result();
    assert_eq!(core.ctrls[&id].csts.shst(), 2);
}

#[test]
fn property_set_of_anything_but_cc_is_refused() {
    let (mut core, mut admin) = enabled();
    let cases = [
        FabricsCmd::set(reg::CAP, 0),
        FabricsCmd::set(reg::CSTS, 0),
        FabricsCmd::PropertySet {
            size8: true,
            offset: reg::CC,
            value: 1,
        },
    ];
    for cmd in cases {
        let st = submit(&mut core, &mut admin, cmd.to_sqe(3), &[]).status();
        assert_eq!(st, Status::INVALID_FIELD.with_dnr(), "{cmd:?}");
    }
}

#[test]
fn before_connect_only_connect_runs() {
    let mut core = Core::new(config());
    let mut q = Fake::new(1, 0, ADMIN_STAGING);
    let cases = [
        FabricsCmd::get(reg::CAP).to_sqe(1),
        FabricsCmd::set(reg::CC, 1).to_sqe(2),
        crate::nvme::admin::identify_controller(3),
        crate::nvme::admin::keep_alive(4),
    ];
    for sqe in cases {
        let st = submit(&mut core, &mut q, sqe, &[]).status();
        assert_eq!(
            st,
            Status::COMMAND_SEQUENCE_ERROR.with_dnr(),
            "opcode {:#x}",
            sqe.opcode
        );
    }
}

#[test]
fn unimplemented_fabrics_commands_are_refused() {
    let (mut core, mut admin) = enabled();
    // Disconnect (0x08), Authentication Send (0x05) and Receive (0x06).
    for fctype in [0x05, 0x06, 0x08] {
        let mut sqe = Sqe::new(crate::nvme::admin::opcode::FABRICS, 7);
        sqe.nsid = fctype;
        let st = submit(&mut core, &mut admin, sqe, &[]).status();
        assert_eq!(st, Status::INVALID_FIELD.with_dnr(), "fctype {fctype:#x}");
    }
}

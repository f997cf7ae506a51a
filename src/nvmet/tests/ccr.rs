//! Safe retry on the target: the Identify fields that name a controller instance and its
//! quiesce time, Cross-Controller Reset (each field checked, the limit, a reset in
//! progress), and the CCR log page.

use crate::nvme::admin::{self as cmd, lid};
use crate::nvme::ccr::{
    self, cross_ctrl_reset, CcrLog, CcrLogEntry, CcrState, CtrlInstance, CCRF_CTRL_RESET,
    CCRF_VALIDATED,
};
use crate::nvme::{IdentifyController, Sqe, Status};
use crate::verbs::Instant;

use super::super::quiesce::{Death, CCR_LIMIT, CCR_LOG_MAX};
use super::*;

/// Identify Controller of the admin queue's controller.
fn identify(core: &mut Core, admin: &mut Fake) -> IdentifyController {
    let out = submit(core, admin, keyed(cmd::identify_controller(1), 4096), &[]);
    IdentifyController::parse(out.data()).expect("identify")
}

/// Another controller of the same host and subsystem, enabled, on admin queue `qpn`.
fn another(core: &mut Core, qpn: u32) -> Fake {
    let mut admin = Fake::new(qpn, 0, ADMIN_STAGING);
    assert!(connect_admin(core, &mut admin, SUBNQN)
        .status()
        .is_success());
    let en = FabricsCmd::set(crate::nvme::fabrics::reg::CC, 1).to_sqe(2);
    assert!(submit(core, &mut admin, en, &[]).status().is_success());
    admin
}

fn ccr(core: &mut Core, source: &mut Fake, impacted: CtrlInstance) -> Outcome {
    submit(core, source, cross_ctrl_reset(9, impacted), &[])
}

/// The CCR log page of `admin`'s controller, with Remove Completed if `rmc`.
fn log(core: &mut Core, admin: &mut Fake, rmc: bool) -> Vec<CcrLogEntry> {
    let sqe = ccr::get_ccr_log(3, CCR_LOG_MAX, rmc).expect("sqe");
    let len = (ccr::LOG_HEADER_LEN + CCR_LOG_MAX * CcrLogEntry::LEN) as u64;
    let out = submit(core, admin, keyed(sqe, len), &[]);
    let page = CcrLog::new_checked(out.data().to_vec()).expect("log");
    page.entries().map(|e| e.expect("entry")).collect()
}

fn death(inst: CtrlInstance, held: usize, running: usize) -> Death<'static> {
    Death {
        inst,
        subsys: 0,
        hostnqn: HOSTNQN,
        kato_ms: 5000,
        held,
        running,
    }
}

/// `n` dead instances of this host's subsystem with a command that cannot be stopped.
fn dead_running(core: &mut Core, n: u16) -> Vec<CtrlInstance> {
    (0..n)
        .map(|i| {
            let inst = CtrlInstance {
                cntlid: 500 + i,
                ciu: 1,
                cirn: 77,
            };
            core.quiesce.died(death(inst, 0, 1), Instant(0));
            inst
        })
        .collect()
}

#[test]
fn identify_reports_cqt_ccrl_and_a_new_instance_each_time_an_id_is_reused() {
    let mut cfg = config();
    cfg.cqt_ms = 2500;
    cfg.cntlid_min = 3;
    cfg.cntlid_max = 3;
    let mut core = Core::new(cfg);
    let mut seen = Vec::new();
    for round in 0..3 {
        let mut admin = another(&mut core, 100 + round);
        let id = identify(&mut core, &mut admin);
        assert_eq!((id.cntlid, id.cqt, id.ccrl), (3, 2500, CCR_LIMIT));
        assert!(id.offers_ccr());
        assert_ne!(id.ciu, 0, "CIU 0 means not reported");
        seen.push(id.instance());
        // The host goes; the ID is free again (nothing of it still runs).
        core.ctrls.remove(&3);
    }
    for (i, a) in seen.iter().enumerate() {
        for b in &seen[i + 1..] {
            assert_ne!(a.ciu, b.ciu, "CIU must change with each instance");
            assert_ne!(a.cirn, b.cirn, "CIRN must be drawn per instance");
        }
    }
}

#[test]
fn discovery_controller_offers_no_ccr() {
    let mut core = Core::new(config());
    let mut admin = Fake::new(100, 0, ADMIN_STAGING);
    let nqn = crate::nvme::fabrics::DISCOVERY_NQN;
    assert!(connect_admin(&mut core, &mut admin, nqn)
        .status()
        .is_success());
    assert_eq!(identify(&mut core, &mut admin).ccrl, 0);
    let st = ccr(&mut core, &mut admin, CtrlInstance::default()).status();
    assert_eq!(st, Status::INVALID_OPCODE.with_dnr());
}

/// `target --no-ccr`: CCRL 0 and the command refused as a target without TP8028 does, so a
/// host falls back to the time rule; the impacted controller is left alone.
#[test]
fn a_target_that_does_not_offer_ccr_reports_ccrl_0_and_refuses_it() {
    let mut core = Core::new(TargetConfig {
        offer_ccr: false,
        ..config()
    });
    let mut a = another(&mut core, 100);
    let mut b = another(&mut core, 101);
    assert_eq!(identify(&mut core, &mut b).ccrl, 0);
    let impacted = identify(&mut core, &mut a).instance();
    let st = ccr(&mut core, &mut b, impacted).status();
    assert_eq!(st, Status::INVALID_OPCODE.with_dnr());
    assert!(core.tear_down.is_empty());
}

#[test]
fn ccr_of_a_live_controller_fences_it_and_succeeds_at_once() {
    let (mut core, mut a) = enabled();
    let mut b = another(&mut core, 101);
    let impacted = identify(&mut core, &mut a).instance();
    let source = b.cntlid.expect("id");
    let out = ccr(&mut core, &mut b, impacted);
    let r = ccr::CcrResult::from_dw0(out.result() as u32);
    assert!(r.immediate && r.validated && r.ctrl_reset, "{r:?}");
    // The transport tears the impacted controller down before it answers.
    assert_eq!(core.tear_down, vec![impacted.cntlid]);
    assert_eq!(core.stats.ccr_resets, 1);
    let want = CcrLogEntry {
        icid: impacted.cntlid,
        ciu: impacted.ciu,
        acid: source,
        state: CcrState::Success,
        flags: CCRF_VALIDATED | CCRF_CTRL_RESET,
    };
    assert_eq!(log(&mut core, &mut b, false), vec![want]);
    // Remove Completed: returned once more, then gone.
    assert_eq!(log(&mut core, &mut b, true), vec![want]);
    assert!(log(&mut core, &mut b, false).is_empty());
}

#[test]
fn ccr_with_a_wrong_field_is_refused_and_changes_nothing() {
    let (mut core, mut a) = enabled();
    let mut b = another(&mut core, 101);
    let good = identify(&mut core, &mut a).instance();
    let source = identify(&mut core, &mut b).instance();
    let wrong = [
        CtrlInstance {
            ciu: good.ciu.wrapping_add(1).max(1),
            ..good
        },
        CtrlInstance {
            cirn: good.cirn ^ 1,
            ..good
        },
        CtrlInstance {
            cntlid: 0x7777,
            ..good
        },
        // The source itself.
        source,
    ];
    for bad in wrong {
        let st = ccr(&mut core, &mut b, bad).status();
        assert_eq!(st, Status::INVALID_FIELD.with_dnr(), "{bad:?}");
    }
    let mut reserved: Sqe = cross_ctrl_reset(9, good);
    reserved.cdw10 |= 1 << 24;
    let st = submit(&mut core, &mut b, reserved, &[]).status();
    assert_eq!(st, Status::INVALID_FIELD.with_dnr());
    // Only from the admin queue (an I/O queue knows no such command).
    let mut io = io_queue(&mut core, &b, 1);
    assert!(!ccr(&mut core, &mut io, good).status().is_success());
    assert!(core.tear_down.is_empty());
    assert_eq!(core.stats.ccr_resets, 0);
    assert!(log(&mut core, &mut b, false).is_empty());
}

#[test]
fn ccr_of_another_hosts_controller_is_refused() {
    let (mut core, mut a) = enabled();
    let good = identify(&mut core, &mut a).instance();
    let mut b = another(&mut core, 101);
    let id = b.cntlid.expect("id");
    core.ctrls.get_mut(&id).expect("ctrl").hostnqn = "nqn.2024-01.io.other:host".into();
    let st = ccr(&mut core, &mut b, good).status();
    assert_eq!(st, Status::INVALID_FIELD.with_dnr());
}

#[test]
fn ccr_in_progress_until_the_last_command_ends_and_limited_to_ccrl() {
    let (mut core, mut b) = enabled();
    let dead = dead_running(&mut core, u16::from(CCR_LIMIT) + 1);
    for inst in &dead[..usize::from(CCR_LIMIT)] {
        let out = ccr(&mut core, &mut b, *inst);
        // Accepted, not over: a command of it still runs.
        assert_eq!(out.result(), 0);
    }
    let st = ccr(&mut core, &mut b, dead[0]).status();
    assert_eq!(st, ccr::status::IN_PROGRESS);
    let st = ccr(&mut core, &mut b, dead[usize::from(CCR_LIMIT)]).status();
    assert_eq!(st, ccr::status::LIMIT_EXCEEDED);
    let entries = log(&mut core, &mut b, true);
    assert_eq!(entries.len(), usize::from(CCR_LIMIT));
    assert!(entries.iter().all(|e| e.state == CcrState::InProgress));
    // In progress entries stay through Remove Completed.
    assert_eq!(log(&mut core, &mut b, false).len(), usize::from(CCR_LIMIT));
    // The command ends: that reset is over, and another may start.
    let ended = core.quiesce.running_ended(&dead[0]);
    assert_eq!(ended.len(), 1);
    assert!(ccr(&mut core, &mut b, dead[usize::from(CCR_LIMIT)])
        .status()
        .is_success());
}

#[test]
fn ccr_log_full_until_read_with_remove_completed() {
    let (mut core, mut b) = enabled();
    for i in 0..CCR_LOG_MAX as u16 {
        let inst = CtrlInstance {
            cntlid: 600 + i,
            ciu: 2,
            cirn: 5,
        };
        core.quiesce.died(death(inst, 0, 0), Instant(0));
        assert!(ccr(&mut core, &mut b, inst).status().is_success());
    }
    let next = CtrlInstance {
        cntlid: 700,
        ciu: 2,
        cirn: 5,
    };
    core.quiesce.died(death(next, 0, 0), Instant(0));
    assert_eq!(ccr(&mut core, &mut b, next).status(), ccr::status::LOG_FULL);
    assert_eq!(log(&mut core, &mut b, true).len(), CCR_LOG_MAX);
    assert!(ccr(&mut core, &mut b, next).status().is_success());
}

#[test]
fn ccr_log_page_is_known() {
    let (mut core, mut b) = enabled();
    let sqe = cmd::get_log_page(1, 0, lid::CROSS_CTRL_RESET, 0, 8).expect("sqe");
    let out = submit(&mut core, &mut b, keyed(sqe, 8), &[]);
    assert_eq!(out.data(), &[0u8; 8][..]);
}

//! ANA and several ports: the Identify fields a multipath host reads, the ANA log page with
//! and without namespace lists, the path status an I/O command gets in each state, the
//! change notice owed to each controller of the port, and one entry per port in the
//! discovery log.

use crate::nvme::admin::{self as cmd, feature, lid};
use crate::nvme::ana::{self, status, AnaLog, AnaState, CtrlAna, NsAna};
use crate::nvme::fabrics::DISCOVERY_NQN;
use crate::nvme::{DiscoveryLogEntry, DiscoveryLogHeader, Status};

use super::super::ana::{DEFAULT_ANATT_S, MAX_GROUPS};
use super::super::MAX_NAMESPACES;
use super::*;

/// Namespace 2 of [`config`] in ANA group 2, a second port, and a controller on each.
fn two_ports() -> (Core, Fake, Fake) {
    let mut cfg = config();
    let ns = &mut cfg.subsystems[0].namespaces;
    ns[1] = Arc::new(
        Namespace::ram(2, 64 << 9, 9)
            .in_ana_group(2)
            .expect("group"),
    );
    let mut core = Core::new(cfg);
    assert_eq!(core.add_port(None), Some(2));
    let a = on_port(&mut core, 1, 100);
    let b = on_port(&mut core, 2, 300);
    (core, a, b)
}

/// An enabled controller whose admin queue `qpn` came through port `port`.
fn on_port(core: &mut Core, port: u16, qpn: u32) -> Fake {
    let mut admin = Fake::new(qpn, 0, ADMIN_STAGING);
    admin.port = port;
    connect_admin(core, &mut admin, SUBNQN).result();
    let en = FabricsCmd::set(crate::nvme::fabrics::reg::CC, 1).to_sqe(2);
    assert!(submit(core, &mut admin, en, &[]).status().is_success());
    admin
}

/// The multipath fields of Identify Controller of `admin`'s controller.
fn ctrl_ana(core: &mut Core, admin: &mut Fake) -> CtrlAna {
    let sqe = keyed(cmd::identify_controller(1), 4096);
    CtrlAna::parse(submit(core, admin, sqe, &[]).data()).expect("identify")
}

/// The ANA log page as `admin`'s controller reads it.
fn ana_log(core: &mut Core, admin: &mut Fake, groups_only: bool) -> Vec<u8> {
    let sqe = ana::get_ana_log(5, 4096, groups_only).expect("sqe");
    submit(core, admin, keyed(sqe, 4096), &[]).data().to_vec()
}

/// (group, state, namespaces) of each descriptor of a log page.
fn groups(page: &[u8]) -> Vec<(u32, AnaState, Vec<u32>)> {
    let log = AnaLog::new_checked(page).expect("log");
    log.groups()
        .map(|g| (g.grpid, g.state, g.nsids().collect()))
        .collect()
}

/// Linux `nvme_mpath_init_identify` refuses (EINVAL, the connect fails) a controller that
/// reports ANA with MNAN 0 or above NN, and then reads the whole ANA log, sized from
/// NANAGRPID and MNAN, in one Get Log Page on the admin queue.
#[test]
fn a_linux_host_accepts_the_ana_fields_and_reads_the_whole_log_in_one_command() {
    let mut core = Core::new(config());
    let mut admin = on_port(&mut core, 1, 100);
    let sqe = keyed(cmd::identify_controller(1), 4096);
    let page = submit(&mut core, &mut admin, sqe, &[]).data().to_vec();
    let (id, ana_id) = (
        crate::nvme::IdentifyController::parse(&page).expect("identify"),
        CtrlAna::parse(&page).expect("identify"),
    );
    assert_ne!(ana_id.cmic & ana::id_ctrl::CMIC_ANA, 0);
    assert!(
        (1..=id.nn).contains(&ana_id.mnan),
        "MNAN {} NN {}",
        ana_id.mnan,
        id.nn
    );
    let len = ana::max_log_len(ana_id.nanagrpid, ana_id.mnan);
    let max_transfer = id.max_transfer_bytes(4096).expect("MDTS");
    assert!(len as u64 <= max_transfer, "ANA log {len} above MDTS");
    let sqe = ana::get_ana_log(5, len, false).expect("sqe");
    let out = submit(&mut core, &mut admin, keyed(sqe, len as u64), &[]);
    assert!(out.status().is_success(), "{:?}", out.status());
    assert_eq!(groups(&out.data()[..len])[0].0, 1);
}

#[test]
fn identify_reports_multipath_ana_and_each_namespaces_group() {
    let mut cfg = config();
    cfg.anatt_s = 3;
    cfg.subsystems[0].namespaces[1] = Arc::new(
        Namespace::ram(2, 64 << 9, 9)
            .in_ana_group(7)
            .expect("group"),
    );
    let mut core = Core::new(cfg);
    let mut admin = on_port(&mut core, 1, 100);
    let id = ctrl_ana(&mut core, &mut admin);
    assert_eq!(
        id,
        CtrlAna {
            cmic: ana::id_ctrl::CMIC_MULTI_PORT
                | ana::id_ctrl::CMIC_MULTI_CTRL
                | ana::id_ctrl::CMIC_ANA,
            oaes: ana::id_ctrl::OAES_NS_ATTR | ana::id_ctrl::OAES_ANA_CHANGE,
            anatt: 3,
            anacap: 0x1F | ana::id_ctrl::ANACAP_GRPID_STATIC,
            anagrpmax: MAX_GROUPS,
            nanagrpid: MAX_GROUPS,
            mnan: MAX_NAMESPACES as u32,
        }
    );
    for (nsid, group) in [(1, 1), (2, 7)] {
        let sqe = keyed(cmd::identify_namespace(2, nsid), 4096);
        let out = submit(&mut core, &mut admin, sqe, &[]);
        let id = NsAna::parse(out.data()).expect("identify");
        assert_eq!((id.nmic, id.anagrpid), (ana::id_ns::NMIC_SHARED, group));
    }
    assert_eq!(TargetConfig::default().anatt_s, DEFAULT_ANATT_S);
    assert!(Namespace::ram(3, 512, 9).in_ana_group(0).is_err());
    assert!(Namespace::ram(3, 512, 9)
        .in_ana_group(MAX_GROUPS + 1)
        .is_err());
}

#[test]
fn a_discovery_controller_reports_no_ana_and_has_no_ana_log() {
    let mut core = Core::new(config());
    let mut admin = Fake::new(1, 0, ADMIN_STAGING);
    connect_admin(&mut core, &mut admin, DISCOVERY_NQN).result();
    let id = ctrl_ana(&mut core, &mut admin);
    assert_eq!((id.cmic, id.anagrpmax, id.oaes), (0, 0, 1 << 31));
    let sqe = ana::get_ana_log(5, 4096, false).expect("sqe");
    let st = submit(&mut core, &mut admin, keyed(sqe, 4096), &[]).status();
    assert_eq!(st, Status::INVALID_LOG_PAGE.with_dnr());
}

#[test]
fn the_ana_log_shows_each_groups_state_through_the_readers_port() {
    let (mut core, mut a, mut b) = two_ports();
    let page = ana_log(&mut core, &mut a, false);
    assert_eq!(AnaLog::new_checked(&page).expect("log").chgcnt, 0);
    assert_eq!(
        groups(&page),
        vec![
            (1, AnaState::Optimized, vec![1]),
            (2, AnaState::Optimized, vec![2])
        ]
    );
    assert_eq!(
        core.set_ana_state(2, 2, AnaState::Inaccessible),
        Ok(vec![b.cntlid.expect("id")])
    );
    // Port 1 is as it was; the change count moved for everyone.
    let page = ana_log(&mut core, &mut a, false);
    assert_eq!(AnaLog::new_checked(&page).expect("log").chgcnt, 1);
    assert_eq!(groups(&page)[1], (2, AnaState::Optimized, vec![2]));
    let page = ana_log(&mut core, &mut b, false);
    let log = AnaLog::new_checked(&page).expect("log");
    assert_eq!(
        (log.chgcnt, log.state_of(2)),
        (1, Some(AnaState::Inaccessible))
    );
    assert!(log.groups().all(|g| g.chgcnt == 1));
    // Return Groups Only: the same groups and states, no namespace lists.
    let page = ana_log(&mut core, &mut b, true);
    assert_eq!(
        groups(&page),
        vec![
            (1, AnaState::Optimized, vec![]),
            (2, AnaState::Inaccessible, vec![])
        ]
    );
    assert_eq!(
        &page[ana::log_len(&[], false) + 2 * ana::DESC_HEADER_LEN..],
        &[0u8; 4096 - 80][..],
        "nothing past the descriptors"
    );
}

#[test]
fn io_through_a_port_answers_its_groups_path_status() {
    let (mut core, a, b) = two_ports();
    let mut qa = io_queue(&mut core, &a, 1);
    let mut qb = Fake::new(301, 1, MAX_TRANSFER);
    qb.port = 2;
    let cntlid = b.cntlid.expect("id");
    let mut badmin = Fake::new(b.qpn.get(), 0, ADMIN_STAGING);
    badmin.port = 2;
    badmin.cntlid = Some(cntlid);
    let nq = cmd::set_num_queues(3, 1, 1).expect("sqe");
    assert!(submit(&mut core, &mut badmin, nq, &[])
        .status()
        .is_success());
    let sqe = connect_sqe(1, qb.size as u16 - 1, 0);
    let st = submit(&mut core, &mut qb, sqe, &connect_data(SUBNQN, cntlid)).status();
    assert!(st.is_success(), "{st:?}");
    let cases = [
        (AnaState::NonOptimized, Status::SUCCESS),
        (AnaState::Inaccessible, status::ANA_INACCESSIBLE),
        (AnaState::PersistentLoss, status::ANA_PERSISTENT_LOSS),
        (AnaState::Change, status::ANA_TRANSITION),
        (AnaState::Optimized, Status::SUCCESS),
    ];
    for (state, want) in cases {
        core.set_ana_state(2, 2, state).expect("set");
        let r = keyed(cmd::read(1, 2, 0, 1).expect("sqe"), 512);
        assert_eq!(
            submit(&mut core, &mut qb, r, &[]).status(),
            want,
            "{state:?}"
        );
        assert!(!want.dnr, "a path status lets the host retry elsewhere");
        // A write is refused before its data is fetched.
        let w = keyed(cmd::write(2, 2, 0, 1, false).expect("sqe"), 512);
        assert_eq!(
            exec::fetch(&core, &qb, &w).err(),
            (!want.is_success()).then_some(want)
        );
        // The same namespace through port 1, and group 1 through port 2, serve.
        let r = keyed(cmd::read(3, 2, 0, 1).expect("sqe"), 512);
        assert!(submit(&mut core, &mut qa, r, &[]).status().is_success());
        let r = keyed(cmd::read(4, 1, 0, 1).expect("sqe"), 512);
        assert!(submit(&mut core, &mut qb, r, &[]).status().is_success());
    }
}

#[test]
fn an_io_queue_joins_its_controller_only_through_the_controllers_port() {
    let (mut core, a, _) = two_ports();
    let cntlid = a.cntlid.expect("id");
    let mut admin = Fake::new(a.qpn.get(), 0, ADMIN_STAGING);
    admin.cntlid = Some(cntlid);
    let nq = cmd::set_num_queues(3, 1, 1).expect("sqe");
    assert!(submit(&mut core, &mut admin, nq, &[]).status().is_success());
    let mut q = Fake::new(400, 1, MAX_TRANSFER);
    q.port = 2;
    let sqe = connect_sqe(1, q.size as u16 - 1, 0);
    let st = submit(&mut core, &mut q, sqe, &connect_data(SUBNQN, cntlid)).status();
    assert_eq!(st, Status::CONNECT_INVALID_PARAMETERS.with_dnr());
}

#[test]
fn a_change_is_owed_once_to_each_controller_of_the_port_until_it_reads_the_log() {
    let (mut core, mut a, mut b) = two_ports();
    let b2 = on_port(&mut core, 2, 500);
    let (id_b, id_b2) = (b.cntlid.expect("id"), b2.cntlid.expect("id"));
    let mut both = vec![id_b, id_b2];
    both.sort_unstable();
    assert_eq!(core.set_ana_state(2, 1, AnaState::NonOptimized), Ok(both));
    // The same state again is no change; another change before the log is read is
    // not raised again.
    assert_eq!(core.set_ana_state(2, 1, AnaState::NonOptimized), Ok(vec![]));
    assert_eq!(core.set_ana_state(2, 1, AnaState::Change), Ok(vec![]));
    // Read with Retain Asynchronous Event: still masked.
    let mut sqe = ana::get_ana_log(5, 4096, false).expect("sqe");
    sqe.cdw10 |= 1 << 15;
    submit(&mut core, &mut b, keyed(sqe, 4096), &[]).data();
    assert_eq!(core.set_ana_state(2, 1, AnaState::Optimized), Ok(vec![]));
    ana_log(&mut core, &mut b, true);
    assert_eq!(
        core.set_ana_state(2, 1, AnaState::Inaccessible),
        Ok(vec![id_b])
    );
    // A controller that turned the notice off is owed none.
    ana_log(&mut core, &mut b, false);
    let off = cmd::set_features(6, feature::ASYNC_EVENT_CONFIG, 1 << 8);
    assert!(submit(&mut core, &mut b, off, &[]).status().is_success());
    assert_eq!(core.set_ana_state(2, 1, AnaState::Optimized), Ok(vec![]));
    // Port 1's controller was never owed one; an unknown port or group is refused.
    ana_log(&mut core, &mut a, false);
    let e = core.set_ana_state(3, 1, AnaState::Optimized).unwrap_err();
    assert!(e.contains("no port 3") && e.contains("1, 2"), "{e}");
    let e = core.set_ana_state(1, 0, AnaState::Optimized).unwrap_err();
    assert!(e.contains("1..=128"), "{e}");
}

#[test]
fn the_discovery_log_lists_each_subsystem_on_each_port() {
    let mut core = Core::new(config());
    core.add_port(Some("192.0.2.7:4791".parse().expect("addr")));
    let mut admin = Fake::new(1, 0, ADMIN_STAGING);
    connect_admin(&mut core, &mut admin, DISCOVERY_NQN).result();
    let sqe = cmd::get_log_page(3, 0, lid::DISCOVERY, 0, 3072).expect("sqe");
    let out = submit(&mut core, &mut admin, keyed(sqe, 3072), &[]);
    let hdr = DiscoveryLogHeader::parse(&out.data()[..1024]).expect("header");
    assert_eq!(hdr.numrec, 2);
    let entries: Vec<DiscoveryLogEntry> = (1..3)
        .map(|i| DiscoveryLogEntry::parse(&out.data()[1024 * i..]).expect("entry"))
        .collect();
    let seen: Vec<(u16, String)> = entries
        .iter()
        .map(|e| (e.portid, e.traddr.text().to_string()))
        .collect();
    assert_eq!(
        seen,
        vec![(1, "127.0.0.1".to_string()), (2, "192.0.2.7".to_string())]
    );
    assert!(entries.iter().all(|e| e.subnqn.text() == SUBNQN));
}

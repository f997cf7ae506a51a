//! Fabrics commands: Connect (a queue joins a new or an existing controller) and Property
//! Get / Set of the controller registers.

use crate::nvme::fabrics::{self, ConnectResult, CNTLID_DYNAMIC};
use crate::nvme::{Cc, ConnectData, Csts, FabricsCmd, Sqe, Status, Vs};

use super::command::{kato, Admit, Core, Ctrl, Done, Join, Slot, DISCOVERY, DISCOVERY_OAES, OAES};
use super::port::QRef;

/// Length of the Connect data.
pub(super) const CONNECT_DATA: usize = 1024;

pub(super) fn exec(core: &mut Core, slot: &mut dyn Slot, sqe: &Sqe) -> Result<Done, Status> {
    let cmd = FabricsCmd::from_sqe(sqe).map_err(|_| Status::INVALID_FIELD.with_dnr())?;
    match cmd {
        FabricsCmd::Connect {
            recfmt,
            qid,
            sqsize,
            kato_ms,
            ..
        } => connect(core, slot, recfmt, qid, sqsize, kato_ms),
        FabricsCmd::PropertyGet { size8, offset } => property_get(core, slot, size8, offset),
        FabricsCmd::PropertySet {
            size8,
            offset,
            value,
        } => property_set(core, slot, size8, offset, value),
    }
}

/// Whether a command brings data, and how much: only Connect does.
pub(super) fn data_in_len(sqe: &Sqe) -> Option<usize> {
    matches!(FabricsCmd::from_sqe(sqe), Ok(FabricsCmd::Connect { .. })).then_some(CONNECT_DATA)
}

fn property_get(core: &Core, slot: &dyn Slot, size8: bool, offset: u32) -> Result<Done, Status> {
    let ctrl = core.ctrl_of(slot, true)?;
    let v = match (offset, size8) {
        (fabrics::reg::CAP, true) => core.cap().0,
        (fabrics::reg::VS, false) => Vs::new(1, 3, 0).0 as u64,
        (fabrics::reg::CC, false) => ctrl.cc.0 as u64,
        (fabrics::reg::CSTS, false) => ctrl.csts.0 as u64,
        _ => return Err(Status::INVALID_FIELD.with_dnr()),
    };
    Ok(Done::result(v))
}

fn property_set(
    core: &mut Core,
    slot: &dyn Slot,
    size8: bool,
    offset: u32,
    value: u64,
) -> Result<Done, Status> {
    if offset != fabrics::reg::CC || size8 {
        return Err(Status::INVALID_FIELD.with_dnr());
    }
    let ctrl = slot
        .cntlid()
        .and_then(|c| core.ctrls.get_mut(&c))
        .ok_or(Status::COMMAND_SEQUENCE_ERROR.with_dnr())?;
    let cc = Cc(value as u32);
    let mut csts = Csts(0);
    if cc.en() {
        csts = csts.with_rdy(true);
    }
    if cc.shn() != 0 {
        csts = csts.with_shst(2);
    }
    ctrl.cc = cc;
    ctrl.csts = csts;
    Ok(Done::OK)
}

/// Every check of a Connect, before anything changes: a Connect that fails leaves no
/// controller behind and the queue as small as it was.
fn connect(
    core: &mut Core,
    slot: &mut dyn Slot,
    recfmt: u16,
    qid: u16,
    sqsize: u16,
    kato_ms: u32,
) -> Result<Done, Status> {
    if recfmt != fabrics::RECFMT_0 {
        return Err(Status::CONNECT_INCOMPATIBLE_FORMAT.with_dnr());
    }
    if slot.cntlid().is_some() {
        return Err(Status::COMMAND_SEQUENCE_ERROR.with_dnr());
    }
    if qid != slot.qid() || sqsize as usize + 1 != slot.size() {
        return Err(Status::CONNECT_INVALID_PARAMETERS.with_dnr());
    }
    let mut data = [0u8; CONNECT_DATA];
    slot.data_in(CONNECT_DATA, &mut |g| {
        data.copy_from_slice(g);
        Ok(())
    })?;
    let cd =
        ConnectData::parse(&data).map_err(|_| Status::CONNECT_INVALID_PARAMETERS.with_dnr())?;
    let subsys = core
        .cfg
        .subsystems
        .iter()
        .position(|s| s.nqn == cd.subnqn)
        .or_else(|| cd.subnqn.is_discovery().then_some(DISCOVERY))
        .ok_or(Status::CONNECT_INVALID_PARAMETERS.with_dnr())?;
    if subsys != DISCOVERY && !core.cfg.subsystems[subsys].allows(cd.hostnqn.as_str()) {
        return Err(Status::CONNECT_INVALID_HOST.with_dnr());
    }
    let listed = subsys != DISCOVERY && core.cfg.subsystems[subsys].allowed_hosts.is_some();
    let join = if qid == 0 {
        new_controller(core, &cd, subsys, kato_ms, slot.port())?
    } else {
        join_controller(core, &cd, subsys, qid, slot.port())?
    };
    Ok(Done::Connect(Admit {
        host: cd.hostnqn.as_str().to_string(),
        listed,
        qid,
        join,
    }))
}

/// An admin queue's Connect: a controller ID and the controller it will be.
fn new_controller(
    core: &mut Core,
    cd: &ConnectData,
    subsys: usize,
    kato_ms: u32,
    port: u16,
) -> Result<Join, Status> {
    if cd.cntlid != CNTLID_DYNAMIC {
        return Err(Status::CONNECT_INVALID_PARAMETERS.with_dnr());
    }
    let kato_ms = kato(kato_ms, subsys == DISCOVERY, core.cfg.max_kato_ms)
        .ok_or(Status::CONNECT_INVALID_PARAMETERS.with_dnr())?;
    let Some(id) = core.alloc_cntlid() else {
        core.stats.cntlid_exhausted += 1;
        return Err(Status::CONNECT_CONTROLLER_BUSY);
    };
    let (ciu, cirn) = core.new_instance(id);
    let ctrl = Ctrl {
        subsys,
        port,
        hostnqn: cd.hostnqn.as_str().to_string(),
        hostid: cd.hostid,
        cc: Cc(0),
        csts: Csts(0),
        kato_ms,
        io_queues: 0,
        queues: Vec::new(),
        aers: 0,
        events: Vec::new(),
        changed_ns: Vec::new(),
        last_seen: None,
        ciu,
        cirn,
        ccr_log: Vec::new(),
        aen_enabled: if subsys == DISCOVERY {
            DISCOVERY_OAES
        } else {
            OAES
        },
        ana_masked: false,
    };
    Ok(Join::New(id, Box::new(ctrl)))
}

/// An I/O queue's Connect: the controller it names must be this host's, reached through
/// the same port, enabled, and without a queue of that ID.
fn join_controller(
    core: &Core,
    cd: &ConnectData,
    subsys: usize,
    qid: u16,
    port: u16,
) -> Result<Join, Status> {
    let ctrl = core
        .ctrls
        .get(&cd.cntlid)
        .ok_or(Status::CONNECT_INVALID_PARAMETERS.with_dnr())?;
    if ctrl.hostnqn != cd.hostnqn.as_str()
        || ctrl.hostid != cd.hostid
        || ctrl.subsys != subsys
        || ctrl.port != port
    {
        return Err(Status::CONNECT_INVALID_PARAMETERS.with_dnr());
    }
    // A discovery controller has no I/O queues (nvmet: the discovery subsystem's max_qid
    // is 0).
    if ctrl.is_discovery() {
        return Err(Status::INVALID_QUEUE_ID.with_dnr());
    }
    if !ctrl.csts.rdy() {
        return Err(Status::COMMAND_SEQUENCE_ERROR.with_dnr());
    }
    if qid > ctrl.io_queues.max(1) {
        return Err(Status::CONNECT_INVALID_PARAMETERS.with_dnr());
    }
    // nvmet_install_queue: a qid the controller has is not installed twice.
    if ctrl.queues.iter().any(|(_, q)| *q == qid) {
        return Err(Status::COMMAND_SEQUENCE_ERROR.with_dnr());
    }
    Ok(Join::Existing(cd.cntlid))
}

impl Core {
    /// The queue `qpn` got its full rings for `a`: it joins its controller (a new one for
    /// an admin queue). Returns the controller ID and the Connect's result.
    pub(super) fn install(&mut self, qpn: QRef, peer: std::net::IpAddr, a: Admit) -> (u16, u64) {
        let cntlid = match a.join {
            Join::New(id, mut ctrl) => {
                tracing::info!(
                    cntlid = id,
                    host = %a.host,
                    subsystem = %self.subsystem(&ctrl).map_or(fabrics::DISCOVERY_NQN, |s| s.nqn.as_str()),
                    peer = %peer,
                    kato_ms = ctrl.kato_ms,
                    "host connected"
                );
                ctrl.queues.push((qpn, a.qid));
                self.ctrls.insert(id, *ctrl);
                id
            }
            Join::Existing(id) => {
                if let Some(ctrl) = self.ctrls.get_mut(&id) {
                    ctrl.queues.push((qpn, a.qid));
                }
                id
            }
        };
        let r = ConnectResult::Ok { cntlid, authreq: 0 };
        (cntlid, r.to_result())
    }
}

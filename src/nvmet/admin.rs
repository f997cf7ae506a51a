//! Admin commands, as tables: opcode -> handler, Identify CNS -> page, log page ID -> page.
//! A command the tables do not name is refused (Invalid Opcode, Invalid Field, Invalid Log
//! Page).

use crate::nvme::admin::{cns, feature, lid, opcode};
use crate::nvme::fabrics;
use crate::nvme::{
    DiscoveryLogEntry, DiscoveryLogHeader, FixedStr, IdentifyController, IdentifyNamespace, Sqe,
    Status, Vs,
};

use crate::nvme::ccr::{self, CcrLogEntry, CcrResult, CcrState};

use super::ana::MAX_GROUPS;
use super::command::{
    kato, lookup, Core, Ctrl, Done, Slot, AER_LIMIT, DISCOVERY_OAES, OAES, SQE_LEN,
};
use super::quiesce::{Refusal, CCR_LIMIT, CCR_LOG_MAX};
use super::{Namespace, Subsystem, MAX_NAMESPACES};
use crate::nvme::ana::{self, CtrlAna, GroupDesc, NsAna};

type Handler = fn(&mut Core, &mut dyn Slot, &Sqe) -> Result<Done, Status>;

/// The admin commands the target implements.
const ADMIN: &[(u8, Handler)] = &[
    (opcode::admin::GET_LOG_PAGE, get_log_page),
    (opcode::admin::IDENTIFY, identify),
    (opcode::admin::SET_FEATURES, set_features),
    (opcode::admin::GET_FEATURES, get_features),
    (opcode::admin::ASYNC_EVENT_REQUEST, async_event_request),
    (opcode::admin::KEEP_ALIVE, keep_alive),
    (opcode::admin::CROSS_CTRL_RESET, cross_ctrl_reset),
];

/// Asynchronous Event Configuration bits 4:0: SMART / health critical warnings.
const SMART_WARNINGS: u32 = 0x1F;

/// Length of an Identify data structure.
const IDENTIFY_LEN: usize = 4096;

type IdentifyFn = fn(&Core, &Ctrl, u16, &Sqe, &mut [u8; IDENTIFY_LEN]) -> Result<(), Status>;

/// The Identify data structures the target returns, by CNS.
const IDENTIFY: &[(u8, IdentifyFn)] = &[
    (cns::NAMESPACE, identify_namespace),
    (cns::CONTROLLER, identify_controller),
    (cns::ACTIVE_NAMESPACE_LIST, active_namespaces),
    (cns::NS_ID_DESCRIPTORS, ns_id_descriptors),
];

type LogFn = fn(&mut Core, &dyn Slot, &Sqe) -> Result<Vec<u8>, Status>;

/// The log pages the target returns, by log page ID.
const LOG_PAGES: &[(u8, LogFn)] = &[
    // Error information, SMART / health, firmware slot: all zeroes here.
    (lid::ERROR_INFO, zeroes),
    (lid::SMART, zeroes),
    (0x03, zeroes),
    (lid::CHANGED_NS_LIST, changed_namespaces),
    (lid::CROSS_CTRL_RESET, ccr_log),
    (ana::LID_ANA, ana_log),
    (lid::DISCOVERY, discovery_log),
];

/// Run admin command `sqe` of a controller's admin queue.
pub(super) fn exec(core: &mut Core, slot: &mut dyn Slot, sqe: &Sqe) -> Result<Done, Status> {
    let run = lookup(ADMIN, sqe.opcode).ok_or(Status::INVALID_OPCODE.with_dnr())?;
    run(core, slot, sqe)
}

fn identify(core: &mut Core, slot: &mut dyn Slot, sqe: &Sqe) -> Result<Done, Status> {
    let cntlid = slot.cntlid().unwrap_or(0);
    let ctrl = core.ctrl_of(slot, true)?;
    let emit =
        lookup(IDENTIFY, (sqe.cdw10 & 0xFF) as u8).ok_or(Status::INVALID_FIELD.with_dnr())?;
    let mut page = [0u8; IDENTIFY_LEN];
    emit(core, ctrl, cntlid, sqe, &mut page)?;
    slot.data_out(IDENTIFY_LEN, &mut |g| {
        g.copy_from_slice(&page);
        Ok(())
    })?;
    Ok(Done::Respond {
        result: 0,
        data_out: IDENTIFY_LEN,
    })
}

/// The namespace `sqe` names, of `ctrl`'s subsystem.
fn namespace<'a>(core: &'a Core, ctrl: &Ctrl, sqe: &Sqe) -> Result<&'a Namespace, Status> {
    core.subsystem(ctrl)
        .and_then(|s| s.namespaces.iter().find(|n| n.nsid == sqe.nsid))
        .map(|n| &**n)
        .ok_or(Status::INVALID_NAMESPACE_OR_FORMAT.with_dnr())
}

fn identify_namespace(
    core: &Core,
    ctrl: &Ctrl,
    _: u16,
    sqe: &Sqe,
    page: &mut [u8; IDENTIFY_LEN],
) -> Result<(), Status> {
    let ns = namespace(core, ctrl, sqe)?;
    let mut id = IdentifyNamespace::simple(ns.blocks, ns.lbads);
    id.nguid = ns.ident.nguid;
    id.eui64 = ns.ident.eui64;
    id.emit(page);
    // Every port reaches every namespace: each is shared, in one ANA group.
    NsAna {
        nmic: ana::id_ns::NMIC_SHARED,
        anagrpid: ns.anagrpid,
    }
    .emit(page);
    Ok(())
}

fn ns_id_descriptors(
    core: &Core,
    ctrl: &Ctrl,
    _: u16,
    sqe: &Sqe,
    page: &mut [u8; IDENTIFY_LEN],
) -> Result<(), Status> {
    let ns = namespace(core, ctrl, sqe)?;
    crate::nvme::identify::emit_ns_id_descriptors(&ns.ident, page);
    Ok(())
}

fn active_namespaces(
    core: &Core,
    ctrl: &Ctrl,
    _: u16,
    sqe: &Sqe,
    page: &mut [u8; IDENTIFY_LEN],
) -> Result<(), Status> {
    let ids: Vec<u32> = core
        .subsystem(ctrl)
        .map(|s| {
            s.namespaces
                .iter()
                .map(|n| n.nsid)
                .filter(|&n| n > sqe.nsid)
                .collect()
        })
        .unwrap_or_default();
    crate::nvme::identify::emit_active_namespace_ids(&ids, page);
    Ok(())
}

fn identify_controller(
    core: &Core,
    ctrl: &Ctrl,
    cntlid: u16,
    _: &Sqe,
    page: &mut [u8; IDENTIFY_LEN],
) -> Result<(), Status> {
    let cfg = &core.cfg;
    let s = core.subsystem(ctrl);
    let nqn = s.map(|s| s.nqn.as_str()).unwrap_or(fabrics::DISCOVERY_NQN);
    let id = IdentifyController {
        vid: 0x1de5,
        ssvid: 0x1de5,
        sn: spaced(s.map(|s| s.serial.as_str()).unwrap_or("DISCOVERY")),
        mn: spaced(s.map(|s| s.model.as_str()).unwrap_or("nvmf-rdma discovery")),
        fr: spaced(env!("CARGO_PKG_VERSION")),
        // MDTS in units of the minimum page size (4 KiB), as a power of two.
        mdts: (cfg.max_transfer / 4096).max(1).ilog2() as u8,
        cntlid,
        ver: Vs::new(1, 3, 0).0,
        kas: 1, // 100 ms granularity
        sqes: 0x66,
        cqes: 0x44,
        maxcmd: cfg.max_queue_size,
        // As Linux nvmet: NN covers every namespace the subsystem may come to hold, so that a
        // namespace added later needs no new Identify, and MNAN (below) may not exceed it.
        nn: s
            .map(|s| s.namespaces.iter().map(|n| n.nsid).max().unwrap_or(0))
            .unwrap_or(0)
            .max(MAX_NAMESPACES as u32),
        oncs: (1 << 2) | (1 << 3), // DSM, Write Zeroes
        vwc: 0,
        // SGLs supported, keyed SGL data block, offset addressing for in-capsule data.
        sgls: 1 | (1 << 2) | (1 << 20),
        subnqn: FixedStr::new(nqn).unwrap_or_else(|_| FixedStr::zeroed()),
        ioccsz: ((SQE_LEN as u32) + cfg.inline_data) / 16,
        iorcsz: 1,
        icdoff: 0,
        msdbd: 1,
        ciu: ctrl.ciu,
        cirn: ctrl.cirn,
        cqt: cfg.cqt_ms,
        // A discovery controller has no I/O to reset.
        ccrl: if ctrl.is_discovery() || !cfg.offer_ccr {
            0
        } else {
            CCR_LIMIT
        },
        ..IdentifyController::default()
    };
    id.emit(page);
    let multipath = if ctrl.is_discovery() {
        CtrlAna {
            oaes: DISCOVERY_OAES,
            ..CtrlAna::default()
        }
    } else {
        CtrlAna {
            cmic: ana::id_ctrl::CMIC_MULTI_PORT
                | ana::id_ctrl::CMIC_MULTI_CTRL
                | ana::id_ctrl::CMIC_ANA,
            oaes: OAES,
            anatt: cfg.anatt_s,
            anacap: ana::id_ctrl::ANACAP_ALL_STATES | ana::id_ctrl::ANACAP_GRPID_STATIC,
            anagrpmax: MAX_GROUPS,
            nanagrpid: MAX_GROUPS,
            mnan: MAX_NAMESPACES as u32,
        }
    };
    multipath.emit(page);
    Ok(())
}

/// An ASCII identify field, space padded; text that does not fit is cut.
fn spaced<const N: usize>(v: &str) -> FixedStr<N> {
    let cut = &v[..v.len().min(N)];
    FixedStr::new_spaced(cut).unwrap_or_else(|_| FixedStr::zeroed())
}

fn set_features(core: &mut Core, slot: &mut dyn Slot, sqe: &Sqe) -> Result<Done, Status> {
    let fid = (sqe.cdw10 & 0xFF) as u8;
    let max = core.cfg.max_io_queues as u32;
    let max_kato_ms = core.cfg.max_kato_ms;
    let ctrl = core.ctrl_mut(slot)?;
    match fid {
        feature::NUMBER_OF_QUEUES => {
            let nsqr = (sqe.cdw11 & 0xFFFF) + 1;
            let ncqr = (sqe.cdw11 >> 16) + 1;
            if nsqr == 0x10000 || ncqr == 0x10000 {
                return Err(Status::INVALID_FIELD.with_dnr());
            }
            let n = nsqr.min(ncqr).min(max);
            ctrl.io_queues = n as u16;
            Ok(Done::result(((n - 1) | ((n - 1) << 16)) as u64))
        }
        feature::KEEP_ALIVE_TIMER => {
            ctrl.kato_ms = kato(sqe.cdw11, ctrl.is_discovery(), max_kato_ms)
                .ok_or(Status::KEEP_ALIVE_INVALID.with_dnr())?;
            Ok(Done::OK)
        }
        feature::ASYNC_EVENT_CONFIG => {
            // nvmet_set_feat_async_event: the SMART critical warnings (bits 4:0) and the
            // notices the controller reports, nothing else.
            let offered = if ctrl.is_discovery() {
                DISCOVERY_OAES
            } else {
                SMART_WARNINGS | OAES
            };
            if sqe.cdw11 & !offered != 0 {
                return Err(Status::INVALID_FIELD.with_dnr());
            }
            ctrl.aen_enabled = sqe.cdw11;
            Ok(Done::result(sqe.cdw11 as u64))
        }
        feature::VOLATILE_WRITE_CACHE => Ok(Done::OK),
        _ => Err(Status::INVALID_FIELD.with_dnr()),
    }
}

fn get_features(core: &mut Core, slot: &mut dyn Slot, sqe: &Sqe) -> Result<Done, Status> {
    let ctrl = core.ctrl_of(slot, true)?;
    let v = match (sqe.cdw10 & 0xFF) as u8 {
        feature::NUMBER_OF_QUEUES => {
            let n = ctrl.io_queues.max(1) as u32 - 1;
            n | (n << 16)
        }
        feature::KEEP_ALIVE_TIMER => ctrl.kato_ms,
        feature::ASYNC_EVENT_CONFIG => ctrl.aen_enabled,
        feature::VOLATILE_WRITE_CACHE => 0,
        _ => return Err(Status::INVALID_FIELD.with_dnr()),
    };
    Ok(Done::result(v as u64))
}

/// Any command counts as traffic for keep-alive (the transport notes it): nothing to do.
fn keep_alive(_: &mut Core, _: &mut dyn Slot, _: &Sqe) -> Result<Done, Status> {
    Ok(Done::OK)
}

fn async_event_request(core: &mut Core, slot: &mut dyn Slot, _: &Sqe) -> Result<Done, Status> {
    let ctrl = core.ctrl_mut(slot)?;
    if !ctrl.events.is_empty() {
        // An event came while no request was outstanding: report it now.
        let ev = ctrl.events.remove(0);
        return Ok(Done::result(ev as u64));
    }
    if ctrl.aers >= AER_LIMIT {
        return Err(Status::ASYNC_EVENT_LIMIT_EXCEEDED.with_dnr());
    }
    ctrl.aers += 1;
    Ok(Done::Park)
}

fn get_log_page(core: &mut Core, slot: &mut dyn Slot, sqe: &Sqe) -> Result<Done, Status> {
    let numd = (((sqe.cdw10 >> 16) & 0xFFFF) | ((sqe.cdw11 & 0xFFFF) << 16)) as usize + 1;
    let offset = sqe.cdw12 as u64 | ((sqe.cdw13 as u64) << 32);
    let len = numd * 4;
    let emit =
        lookup(LOG_PAGES, (sqe.cdw10 & 0xFF) as u8).ok_or(Status::INVALID_LOG_PAGE.with_dnr())?;
    if len > slot.staging_len() {
        return Err(Status::SGL_DATA_LENGTH_INVALID.with_dnr());
    }
    // Pages that clear on read are read only once the command can return them.
    let page = emit(core, slot, sqe)?;
    let off = (offset as usize).min(page.len());
    let n = (page.len() - off).min(len);
    slot.data_out(len, &mut |g| {
        g[..n].copy_from_slice(&page[off..off + n]);
        g[n..].fill(0);
        Ok(())
    })?;
    Ok(Done::Respond {
        result: 0,
        data_out: len,
    })
}

fn zeroes(_: &mut Core, _: &dyn Slot, _: &Sqe) -> Result<Vec<u8>, Status> {
    Ok(vec![0u8; 4096])
}

/// The Changed Namespace List: reading it clears it (and re-arms the event).
fn changed_namespaces(core: &mut Core, slot: &dyn Slot, _: &Sqe) -> Result<Vec<u8>, Status> {
    let ctrl = core.ctrl_mut(slot)?;
    let mut page = vec![0u8; 4096];
    let list = std::mem::take(&mut ctrl.changed_ns);
    for (i, id) in list.iter().enumerate() {
        page[i * 4..i * 4 + 4].copy_from_slice(&id.to_le_bytes());
    }
    Ok(page)
}

/// The discovery log as the controller's host sees it: only subsystems that allow it
/// (nvmet `nvmet_host_allowed`), so the log does not tell anyone what exists beyond that;
/// one entry per subsystem and port.
fn discovery_log(core: &mut Core, slot: &dyn Slot, _: &Sqe) -> Result<Vec<u8>, Status> {
    let hostnqn = core.ctrl_of(slot, true)?.hostnqn.as_str();
    let cfg = &core.cfg;
    let visible: Vec<&Subsystem> = cfg
        .subsystems
        .iter()
        .filter(|s| s.allows(hostnqn))
        .collect();
    let recs = visible.len() * core.ports.len();
    let mut page = vec![0u8; 1024 * (recs + 1)];
    let hdr = DiscoveryLogHeader {
        genctr: 1,
        numrec: recs as u64,
        recfmt: 0,
    };
    let mut h = [0u8; 1024];
    hdr.emit(&mut h);
    page[..1024].copy_from_slice(&h);
    let trsvcid = cfg.port.to_string();
    let entries = core
        .ports
        .iter()
        .flat_map(|p| visible.iter().map(move |s| (p, s)));
    for (i, (p, s)) in entries.enumerate() {
        let addr = p
            .addr
            .map(|a| a.ip().to_string())
            .unwrap_or_else(|| "127.0.0.1".into());
        let ipv6 = p.addr.is_some_and(|a| a.is_ipv6());
        if let Ok(e) = DiscoveryLogEntry::rdma(&s.nqn, &addr, &trsvcid, ipv6, p.id) {
            page[1024 * (i + 1)..1024 * (i + 2)].copy_from_slice(&e.to_bytes());
        }
    }
    Ok(page)
}

/// Cross-Controller Reset (TP8028): reset another controller of the source's host and
/// subsystem, named by CNTLID, CIU and CIRN. The impacted controller is fenced before this
/// answers: a live one is torn down by the transport with everything it holds, a dead one's
/// held commands are dropped. IRS says nothing of it can still run; otherwise the reset
/// is in progress until the last command that could not be stopped ends, and the source
/// hears of it through its CCR log and an asynchronous event.
fn cross_ctrl_reset(core: &mut Core, slot: &mut dyn Slot, sqe: &Sqe) -> Result<Done, Status> {
    let inst = ccr::parse_cross_ctrl_reset(sqe).map_err(|_| Status::INVALID_FIELD.with_dnr())?;
    let source = slot
        .cntlid()
        .ok_or(Status::COMMAND_SEQUENCE_ERROR.with_dnr())?;
    let src = core.ctrl_of(slot, true)?;
    if src.is_discovery() || !core.cfg.offer_ccr {
        return Err(Status::INVALID_OPCODE.with_dnr());
    }
    let (subsys, logged) = (src.subsys, src.ccr_log.len());
    let host = src.hostnqn.as_str();
    let live = core.ctrls.get(&inst.cntlid).is_some_and(|c| {
        c.instance(inst.cntlid) == inst && c.subsys == subsys && c.hostnqn == host
    });
    let known = live || core.quiesce.find(&inst, subsys, host).is_some();
    core.quiesce
        .admit(source, &inst, known, logged)
        .map_err(|r| match r {
            Refusal::Unknown => Status::INVALID_FIELD.with_dnr(),
            Refusal::InProgress => ccr::status::IN_PROGRESS,
            Refusal::LogFull => ccr::status::LOG_FULL,
            Refusal::LimitExceeded => ccr::status::LIMIT_EXCEEDED,
        })?;
    let entry = core.quiesce.fence(source, inst);
    if live {
        core.tear_down.push(inst.cntlid);
    }
    core.stats.ccr_resets += 1;
    tracing::info!(
        source,
        impacted = inst.cntlid,
        ciu = inst.ciu,
        live,
        "cross-controller reset"
    );
    core.ctrl_mut(slot)?.ccr_log.push(entry);
    let done = entry.state == CcrState::Success;
    let r = CcrResult {
        immediate: done,
        validated: done,
        ctrl_reset: done,
    };
    Ok(Done::result(u64::from(r.to_dw0())))
}

/// The CCR log page of the source controller; with Remove Completed (LSP bit 0) the resets
/// that ended leave it once returned.
fn ccr_log(core: &mut Core, slot: &dyn Slot, sqe: &Sqe) -> Result<Vec<u8>, Status> {
    let lsp = ((sqe.cdw10 >> 8) & 0x7F) as u8;
    let ctrl = core.ctrl_mut(slot)?;
    let mut page = vec![0u8; ccr::LOG_HEADER_LEN + CCR_LOG_MAX * CcrLogEntry::LEN];
    ccr::emit_log(&ctrl.ccr_log, &mut page).map_err(|_| Status::INTERNAL_ERROR)?;
    if lsp & ccr::LSP_REMOVE_COMPLETED != 0 {
        ctrl.ccr_log.retain(|e| e.state == CcrState::InProgress);
    }
    Ok(page)
}

/// The ANA log page as the controller's port sees it: every group, its state there and
/// (unless Return Groups Only, LSP bit 0) the subsystem's namespaces in it. Read without
/// Retain Asynchronous Event (CDW10 bit 15), it lets the next ANA change notice through.
fn ana_log(core: &mut Core, slot: &dyn Slot, sqe: &Sqe) -> Result<Vec<u8>, Status> {
    let lsp = ((sqe.cdw10 >> 8) & 0x7F) as u8;
    let groups_only = lsp & ana::LSP_GROUPS_ONLY != 0;
    let retain = sqe.cdw10 & (1 << 15) != 0;
    let ctrl = core.ctrl_of(slot, true)?;
    let sub = core
        .subsystem(ctrl)
        .ok_or(Status::INVALID_LOG_PAGE.with_dnr())?;
    let groups = core.ana_groups();
    let nsids: Vec<Vec<u32>> = groups
        .iter()
        .map(|g| {
            sub.namespaces
                .iter()
                .filter(|n| n.anagrpid == *g)
                .map(|n| n.nsid)
                .collect()
        })
        .collect();
    let descs: Vec<GroupDesc> = groups
        .iter()
        .zip(&nsids)
        .map(|(g, ids)| GroupDesc {
            grpid: *g,
            chgcnt: core.ana.chgcnt,
            state: core.ana.state(ctrl.port, *g),
            nsids: ids,
        })
        .collect();
    let mut page = vec![0u8; ana::log_len(&descs, groups_only)];
    ana::emit_log(core.ana.chgcnt, &descs, groups_only, &mut page)
        .map_err(|_| Status::INTERNAL_ERROR)?;
    if !retain {
        core.ctrl_mut(slot)?.ana_masked = false;
    }
    Ok(page)
}

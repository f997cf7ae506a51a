//! The target's command core, sans I/O: the controller registry and the context a command
//! handler runs over. No device and no clock: the transport ([`super::rdma`]) hands a
//! handler its queue as a [`Slot`], a test hands it plain memory.

use std::sync::Arc;

use rustc_hash::FxHashMap;

use crate::nvme::{Cap, Cc, Csts, Sqe, Status};

use super::ana::AnaTable;
use super::backend::Op;
use super::port::{PortInfo, QRef};
use super::quiesce::Quiesce;
use super::stats::TargetStats;
use super::{Namespace, Subsystem, TargetConfig};
use crate::nvme::ana::{self, AnaState};
use crate::nvme::ccr::{CcrLogEntry, CtrlInstance};

pub(super) const SQE_LEN: usize = 64;
pub(super) const CQE_LEN: usize = 16;
/// Outstanding Async Event Requests we hold per controller (AERL + 1).
pub(super) const AER_LIMIT: usize = 4;
/// Entries of the Changed Namespace List log page (1024 dwords).
pub(super) const CHANGED_NS_MAX: usize = 1024;
/// Async event completion Dword 0: Notice (2), namespace attribute changed (0x00), log page
/// 0x04 (changed namespace list).
pub(super) const AEN_NS_CHANGED: u32 = 0x2 | (0x04 << 16);
/// Notice, discovery log page changed (0xF0), log page 0x70.
pub(super) const AEN_DISCOVERY_CHANGED: u32 = 0x2 | (0xF0 << 8) | (0x70 << 16);
/// The optional asynchronous events a subsystem controller reports (Identify Controller
/// OAES), and the ones a new controller has enabled (nvmet `NVMET_AEN_CFG_OPTIONAL`).
pub(super) const OAES: u32 = ana::id_ctrl::OAES_NS_ATTR | ana::id_ctrl::OAES_ANA_CHANGE;
/// The one a discovery controller reports: Discovery Log Page Change.
pub(super) const DISCOVERY_OAES: u32 = 1 << 31;
/// Keep-alive of a discovery controller whose host asked for none (nvmet
/// `NVMET_DISC_KATO_MS`), and the most one may ask for: one left open must not live for
/// ever.
const DISCOVERY_KATO_MS: u32 = 120_000;
/// `Ctrl::subsys` of a discovery controller (it belongs to no configured subsystem).
pub(super) const DISCOVERY: usize = usize::MAX;

/// One controller: the host that made it, its registers and its queues.
pub(super) struct Ctrl {
    pub subsys: usize,
    /// The port its admin queue came through; its I/O queues come through the same one.
    pub port: u16,
    pub hostnqn: String,
    pub hostid: [u8; 16],
    pub cc: Cc,
    pub csts: Csts,
    pub kato_ms: u32,
    pub io_queues: u16,
    /// Its queues by QPN, with their queue ID (the admin queue first).
    pub queues: Vec<(QRef, u16)>,
    pub aers: usize,
    /// Asynchronous events not yet reported (no AER was outstanding), as completion Dword
    /// 0 values; at most one of each kind, so bounded by the kinds there are.
    pub events: Vec<u32>,
    /// Namespaces changed since the host last read the Changed Namespace List log page
    /// (at most [`CHANGED_NS_MAX`]; past it the list says "more than that": 0xFFFFFFFF).
    pub changed_ns: Vec<u32>,
    /// Last command seen from any of its queues (keep-alive is traffic based); `None`
    /// until the first expiry check.
    pub last_seen: Option<crate::verbs::Instant>,
    /// Controller Instance Uniquifier and Random Number: with the CNTLID they name this
    /// instance in a Cross-Controller Reset.
    pub ciu: u8,
    pub cirn: u64,
    /// The CCR log page of this controller as a source: the resets it ran (at most
    /// [`super::quiesce::CCR_LOG_MAX`]).
    pub ccr_log: Vec<CcrLogEntry>,
    /// Asynchronous Event Configuration (Set Features 0Bh): the notices the host wants.
    pub aen_enabled: u32,
    /// An ANA change notice was raised and the host has not read the ANA log page since
    /// (without Retain Asynchronous Event): no other is raised until it does (nvmet's
    /// `aen_masked`).
    pub ana_masked: bool,
}

impl Ctrl {
    pub fn is_discovery(&self) -> bool {
        self.subsys == DISCOVERY
    }

    /// This controller, with ID `cntlid`, as a CCR names it.
    pub fn instance(&self, cntlid: u16) -> CtrlInstance {
        CtrlInstance {
            cntlid,
            ciu: self.ciu,
            cirn: self.cirn,
        }
    }

    /// Keep event `ev` for the next Async Event Request (once).
    pub fn keep_event(&mut self, ev: u32) {
        if !self.events.contains(&ev) {
            self.events.push(ev);
        }
    }
}

/// A Fabrics Connect that passed every check: the transport gives the queue its full rings
/// ([`Admit::host`] and [`Admit::listed`] say whose budget pays), then
/// [`Core::install`] makes it the controller's.
pub(super) struct Admit {
    pub host: String,
    /// The host is named in its subsystem's allow-list.
    pub listed: bool,
    pub qid: u16,
    pub join: Join,
}

pub(super) enum Join {
    /// An admin queue: a new controller with this ID.
    New(u16, Box<Ctrl>),
    /// An I/O queue of an existing controller.
    Existing(u16),
}

/// What the transport does with a command a handler ran.
pub(super) enum Done {
    /// Send `data_out` bytes of the command's staging (if any), then the response.
    Respond { result: u64, data_out: usize },
    /// Hold it (an Async Event Request) until there is an event or the queue goes.
    Park,
    /// Run `Op` on a worker; the response follows when it finishes.
    Offload(Arc<Namespace>, Op),
    /// Grow the queue for a Connect, then [`Core::install`] it.
    Connect(Admit),
}

impl Done {
    pub const OK: Done = Done::Respond {
        result: 0,
        data_out: 0,
    };

    pub fn result(result: u64) -> Done {
        Done::Respond {
            result,
            data_out: 0,
        }
    }
}

/// A closure over a command's data bytes.
pub(super) type Bytes<'a> = &'a mut dyn FnMut(&mut [u8]) -> Result<(), Status>;

/// What a command handler sees of the queue its command came on: who the queue is, and the
/// command's data, wherever the transport keeps it.
pub(super) trait Slot {
    /// The port the queue came through.
    fn port(&self) -> u16;
    fn qid(&self) -> u16;
    fn cntlid(&self) -> Option<u16>;
    /// The queue size the host asked for.
    fn size(&self) -> usize;
    /// The most data bytes one command of this queue moves.
    fn staging_len(&self) -> usize;
    /// How long the command's capsule was, in-capsule data included.
    fn capsule_len(&self) -> usize;
    /// Run `f` over the first `len` bytes of the data the host sent with the command.
    fn data_in(&mut self, len: usize, f: Bytes) -> Result<(), Status>;
    /// Fill the first `len` bytes of the command's data for the host with `f`.
    fn data_out(&mut self, len: usize, f: Bytes) -> Result<(), Status>;
    /// A write's data was fetched straight into its namespace: nothing to copy.
    fn landed(&self) -> bool;
    /// Bytes of a write's in-capsule data still in the receive buffer, if it is there.
    fn inline(&self) -> Option<usize>;
    /// Move `len` bytes of in-capsule data to where a worker reads them.
    fn stage_inline(&mut self, len: usize);
    /// Send the data of a read straight from RAM namespace `ns` at byte `off`, without a
    /// copy; `false` when this queue cannot.
    fn send_from(&mut self, ns: &Arc<Namespace>, off: u64) -> bool;
}

/// The entry of a handler table (opcode, CNS, log page ID...) for `key`.
pub(super) fn lookup<K: PartialEq, F: Copy>(table: &[(K, F)], key: K) -> Option<F> {
    table.iter().find(|(k, _)| *k == key).map(|(_, f)| *f)
}

/// The keep-alive timeout a controller gets for the one its host `asked` for (ms), or
/// `None` past the most it may have: `max_kato_ms`, and for a discovery controller at most
/// [`DISCOVERY_KATO_MS`]. None asked for (0) gets that most: nvmet gives a discovery
/// controller one for the same reason, a controller whose host left must not live for
/// ever.
pub(super) fn kato(asked: u32, discovery: bool, max_kato_ms: u32) -> Option<u32> {
    let most = if discovery {
        max_kato_ms.min(DISCOVERY_KATO_MS)
    } else {
        max_kato_ms
    };
    match asked {
        0 => Some(most),
        k if k <= most => Some(k),
        _ => None,
    }
}

/// Configuration, controllers and counters: everything a command handler changes.
pub(super) struct Core {
    pub cfg: Arc<TargetConfig>,
    /// The ports, in the order they were added (port `i` has ID `i + 1`).
    pub ports: Vec<PortInfo>,
    /// The state of each ANA group through each port.
    pub ana: AnaTable,
    pub ctrls: FxHashMap<u16, Ctrl>,
    pub next_cntlid: u16,
    pub stats: TargetStats,
    /// Dead controllers' commands and the CCRs in progress.
    pub quiesce: Quiesce,
    /// The CIU last given with each controller ID (bounded by the ID range).
    pub ciu: FxHashMap<u16, u8>,
    /// Live controllers to tear down now (a CCR fenced them, or a lost connection is
    /// played): the transport does it before the command that asked is answered.
    pub tear_down: Vec<u16>,
}

impl Core {
    pub fn new(cfg: TargetConfig) -> Core {
        let cfg_cqt = cfg.cqt_ms;
        let first = PortInfo {
            id: 1,
            addr: cfg.advertise,
        };
        Core {
            ports: vec![first],
            ana: AnaTable::default(),
            cfg: Arc::new(cfg),
            ctrls: FxHashMap::default(),
            next_cntlid: 1,
            stats: TargetStats::default(),
            quiesce: Quiesce::new(cfg_cqt),
            ciu: FxHashMap::default(),
            tear_down: Vec::new(),
        }
    }

    /// CIU and CIRN of a new instance of controller `id`: the CIU moves on from the last
    /// one given with this ID (starting anywhere, never 0), the CIRN comes from the OS
    /// CSPRNG.
    pub fn new_instance(&mut self, id: u16) -> (u8, u64) {
        let mut b = [0u8; 9];
        fill_random(&mut b);
        let ciu = match self.ciu.get(&id) {
            Some(&last) => last.wrapping_add(1).max(1),
            None => b[8].max(1),
        };
        self.ciu.insert(id, ciu);
        let mut cirn = [0u8; 8];
        cirn.copy_from_slice(&b[..8]);
        (ciu, u64::from_le_bytes(cirn))
    }

    pub fn cap(&self) -> Cap {
        Cap(0)
            .with_mqes(self.cfg.max_queue_size - 1)
            .with_cqr(true)
            .with_to(10)
            .with_css(1)
    }

    pub fn subsystem(&self, ctrl: &Ctrl) -> Option<&Subsystem> {
        self.cfg.subsystems.get(ctrl.subsys)
    }

    /// The controller of the queue `slot`; with `admin_only`, only if it is the admin queue.
    pub fn ctrl_of(&self, slot: &dyn Slot, admin_only: bool) -> Result<&Ctrl, Status> {
        if admin_only && slot.qid() != 0 {
            return Err(Status::INVALID_FIELD.with_dnr());
        }
        slot.cntlid()
            .and_then(|c| self.ctrls.get(&c))
            .ok_or(Status::COMMAND_SEQUENCE_ERROR.with_dnr())
    }

    pub fn ctrl_mut(&mut self, slot: &dyn Slot) -> Result<&mut Ctrl, Status> {
        slot.cntlid()
            .and_then(|c| self.ctrls.get_mut(&c))
            .ok_or(Status::COMMAND_SEQUENCE_ERROR)
    }

    /// The namespace I/O command `sqe` names, for a queue of controller `cntlid`.
    pub fn io_ns(&self, cntlid: Option<u16>, sqe: &Sqe) -> Result<&Arc<Namespace>, Status> {
        let ctrl = cntlid
            .and_then(|c| self.ctrls.get(&c))
            .ok_or(Status::COMMAND_SEQUENCE_ERROR.with_dnr())?;
        let subsys = self
            .subsystem(ctrl)
            .ok_or(Status::INVALID_OPCODE.with_dnr())?;
        let ns = subsys
            .namespaces
            .iter()
            .find(|n| n.nsid == sqe.nsid)
            .ok_or(Status::INVALID_NAMESPACE_OR_FORMAT.with_dnr())?;
        // nvmet_check_ana_state: a path whose group cannot serve I/O says so before the
        // command is looked at further.
        self.ana.check_io(ctrl.port, ns.anagrpid)?;
        Ok(ns)
    }

    /// A new port reached at `addr`: its ID. `None` past the most ports there may be
    /// (port IDs are 16 bits).
    pub fn add_port(&mut self, addr: Option<std::net::SocketAddr>) -> Option<u16> {
        let id = u16::try_from(self.ports.len() + 1).ok()?;
        self.ports.push(PortInfo { id, addr });
        Some(id)
    }

    /// Every ANA group there is: see [`AnaTable::groups`].
    pub fn ana_groups(&self) -> std::collections::BTreeSet<u32> {
        let in_use = self
            .cfg
            .subsystems
            .iter()
            .flat_map(|s| s.namespaces.iter().map(|n| n.anagrpid));
        self.ana.groups(in_use)
    }

    /// Set ANA group `grpid`'s state through port `port`. The subsystem controllers of
    /// that port that want ANA change notices (and have read the log page since the last
    /// one) come back: each is owed [`ana::ana_change_aen_dw0`]. None when the state was
    /// that already.
    pub fn set_ana_state(
        &mut self,
        port: u16,
        grpid: u32,
        state: AnaState,
    ) -> Result<Vec<u16>, String> {
        if !self.ports.iter().any(|p| p.id == port) {
            let ids: Vec<String> = self.ports.iter().map(|p| p.id.to_string()).collect();
            return Err(format!(
                "no port {port}: the target's ports are {}",
                ids.join(", ")
            ));
        }
        if !self.ana.set(port, grpid, state)? {
            return Ok(Vec::new());
        }
        tracing::info!(
            port,
            group = grpid,
            state = state.name(),
            "ANA state changed"
        );
        let mut owed = Vec::new();
        for (id, c) in self.ctrls.iter_mut() {
            if c.port == port
                && !c.is_discovery()
                && c.aen_enabled & ana::id_ctrl::OAES_ANA_CHANGE != 0
                && !c.ana_masked
            {
                c.ana_masked = true;
                owed.push(*id);
            }
        }
        owed.sort_unstable();
        Ok(owed)
    }

    /// A controller ID in `cntlid_min..=cntlid_max` that no live controller has (nor a dead
    /// one whose commands may still run), searched
    /// round-robin from the last one given (so a freed ID is not handed out again at once);
    /// `None` when every ID is taken. Controllers never outnumber queues, so the search is
    /// at most `max_queues` + 1 steps.
    pub fn alloc_cntlid(&mut self) -> Option<u16> {
        let lo = self.cfg.cntlid_min.max(1);
        let hi = self.cfg.cntlid_max.min(0xFFEF);
        if lo > hi {
            return None;
        }
        let span = (hi - lo) as u32 + 1;
        let from = (self.next_cntlid.clamp(lo, hi) - lo) as u32;
        let id = (0..span)
            .map(|i| lo + ((from + i) % span) as u16)
            .find(|id| !self.ctrls.contains_key(id) && !self.quiesce.holds(*id))?;
        self.quiesce.reused(id);
        self.next_cntlid = if id >= hi { lo } else { id + 1 };
        Some(id)
    }

    /// Namespace `nsid` was added to subsystem `subsys`: it goes on the Changed Namespace
    /// List of each of its controllers; the IDs of those that want Namespace Attribute
    /// notices (Asynchronous Event Configuration) come back, each owed an event.
    pub fn namespace_added(&mut self, subsys: usize, nsid: u32) -> Vec<u16> {
        let mut ids = Vec::new();
        for (id, c) in self.ctrls.iter_mut().filter(|(_, c)| c.subsys == subsys) {
            if c.changed_ns.len() < CHANGED_NS_MAX {
                c.changed_ns.push(nsid);
            } else {
                c.changed_ns = vec![0xFFFF_FFFF];
            }
            if c.aen_enabled & ana::id_ctrl::OAES_NS_ATTR != 0 {
                ids.push(*id);
            }
        }
        ids
    }

    /// The discovery controllers (each is owed an event when a subsystem is added).
    pub fn discovery_ctrls(&self) -> Vec<u16> {
        self.ctrls
            .iter()
            .filter(|(_, c)| c.is_discovery())
            .map(|(id, _)| *id)
            .collect()
    }
}

/// Fill `b` from the OS CSPRNG (a generator it keyed earlier if it refuses).
fn fill_random(b: &mut [u8]) {
    use rand::TryRngCore;
    if rand::rngs::OsRng.try_fill_bytes(b).is_err() {
        rand::RngCore::fill_bytes(&mut rand::rng(), b);
    }
}

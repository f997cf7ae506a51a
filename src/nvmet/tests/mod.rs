//! The command core driven without a network: an SQE goes in as the transport would hand it
//! over (its data fetched into staging first), and the CQE and the bytes the host's buffer
//! would receive come out.

mod admin;
mod ana;
mod ccr;
mod fabrics;
mod io;

use std::sync::Arc;

use crate::nvme::fabrics::CNTLID_DYNAMIC;
use crate::nvme::{ConnectData, Cqe, FabricsCmd, Nqn, SglDescriptor, Sqe, Status};
use crate::verbs::Qpn;

use super::backend::Op;
use super::command::{Bytes, Core, Done, Slot};
use super::exec::{self, Fetch};
use super::port::QRef;
use super::{Namespace, Subsystem, TargetConfig};

const SUBNQN: &str = "nqn.2024-01.io.nvmf-rdma:test";
const HOSTNQN: &str = "nqn.2024-01.io.nvmf-rdma:host";
const HOSTID: [u8; 16] = [7; 16];
/// Blocks of namespace 1 (512-byte blocks).
const BLOCKS: u64 = 256;
const MAX_TRANSFER: usize = 16 << 10;
use super::queues::ADMIN_STAGING;

/// A queue as a handler sees it, over plain memory: the command's staging.
struct Fake {
    port: u16,
    qpn: Qpn,
    qid: u16,
    cntlid: Option<u16>,
    size: usize,
    staging: Vec<u8>,
    capsule_len: usize,
    landed: bool,
    inline: Option<usize>,
}

impl Fake {
    fn new(qpn: u32, qid: u16, staging: usize) -> Fake {
        Fake {
            port: 1,
            qpn: Qpn::new(qpn),
            qid,
            cntlid: None,
            size: 32,
            staging: vec![0; staging],
            capsule_len: 64,
            landed: false,
            inline: None,
        }
    }
}

impl Fake {
    /// The queue as the registry names it.
    fn at(&self) -> QRef {
        QRef {
            port: self.port,
            qpn: self.qpn,
        }
    }
}

impl Slot for Fake {
    fn port(&self) -> u16 {
        self.port
    }

    fn qid(&self) -> u16 {
        self.qid
    }

    fn cntlid(&self) -> Option<u16> {
        self.cntlid
    }

    fn size(&self) -> usize {
        self.size
    }

    fn staging_len(&self) -> usize {
        self.staging.len()
    }

    fn capsule_len(&self) -> usize {
        self.capsule_len
    }

    fn data_in(&mut self, len: usize, f: Bytes) -> Result<(), Status> {
        f(&mut self.staging[..len])
    }

    fn data_out(&mut self, len: usize, f: Bytes) -> Result<(), Status> {
        f(&mut self.staging[..len])
    }

    fn landed(&self) -> bool {
        self.landed
    }

    fn inline(&self) -> Option<usize> {
        self.inline
    }

    fn stage_inline(&mut self, _: usize) {}

    fn send_from(&mut self, _: &Arc<Namespace>, _: u64) -> bool {
        false
    }
}

/// What became of a command.
#[derive(Debug)]
enum Outcome {
    /// Its completion, and the bytes written to the host's buffer.
    Answer(Cqe, Vec<u8>),
    /// Held (an Async Event Request).
    Parked,
    /// Handed to a worker.
    Offloaded(Op),
}

impl Outcome {
    fn status(&self) -> Status {
        match self {
            Outcome::Answer(cqe, _) => cqe.nvme_status(),
            other => panic!("no answer: {other:?}"),
        }
    }

    fn result(&self) -> u64 {
        match self {
            Outcome::Answer(cqe, _) if cqe.nvme_status().is_success() => cqe.result,
            other => panic!("no success: {other:?}"),
        }
    }

    fn data(&self) -> &[u8] {
        match self {
            Outcome::Answer(cqe, d) if cqe.nvme_status().is_success() => d,
            other => panic!("no success: {other:?}"),
        }
    }
}

/// Run `sqe` on queue `q` as the transport does, `host` being what the host's data buffer
/// (or the capsule's in-capsule data) holds.
fn submit(core: &mut Core, q: &mut Fake, sqe: Sqe, host: &[u8]) -> Outcome {
    let answer = |st: Status, result: u64, data: Vec<u8>| {
        Outcome::Answer(Cqe::new(sqe.cid, st, result), data)
    };
    match exec::fetch(core, q, &sqe) {
        Err(st) => return answer(st, 0, Vec::new()),
        Ok(Some(Fetch::Keyed { len, .. })) => q.staging[..len].copy_from_slice(&host[..len]),
        Ok(Some(Fetch::InCapsule)) => q.staging[..host.len()].copy_from_slice(host),
        Ok(None) => {}
    }
    match exec::run(core, q, &sqe) {
        Err(st) => answer(st, 0, Vec::new()),
        Ok(Done::Respond { result, data_out }) if data_out > 0 => {
            match exec::push(&sqe, data_out) {
                Ok(_) => answer(Status::SUCCESS, result, q.staging[..data_out].to_vec()),
                Err(st) => answer(st, 0, Vec::new()),
            }
        }
        Ok(Done::Respond { result, .. }) => answer(Status::SUCCESS, result, Vec::new()),
        Ok(Done::Park) => Outcome::Parked,
        Ok(Done::Offload(_, op)) => Outcome::Offloaded(op),
        Ok(Done::Connect(a)) => {
            let (cntlid, result) = core.install(q.at(), [127, 0, 0, 1].into(), a);
            q.cntlid = Some(cntlid);
            answer(Status::SUCCESS, result, Vec::new())
        }
    }
}

/// A keyed SGL of `len` bytes.
fn keyed(sqe: Sqe, len: u64) -> Sqe {
    let sgl = SglDescriptor::keyed(0x10_0000, len, 0x1234, false).expect("sgl");
    sqe.with_sgl(&sgl).expect("sgl")
}

fn config() -> TargetConfig {
    let ns = vec![
        Arc::new(Namespace::ram(1, BLOCKS << 9, 9)),
        Arc::new(Namespace::ram(2, 64 << 9, 9)),
    ];
    TargetConfig {
        subsystems: vec![Subsystem::new(Nqn::new(SUBNQN).expect("nqn"), ns)],
        max_queue_size: 128,
        max_transfer: MAX_TRANSFER as u32,
        max_io_queues: 4,
        max_kato_ms: 60_000,
        ..TargetConfig::default()
    }
}

fn connect_data(subnqn: &str, cntlid: u16) -> [u8; 1024] {
    ConnectData {
        hostid: HOSTID,
        cntlid,
        subnqn: Nqn::new(subnqn).expect("nqn"),
        hostnqn: Nqn::new(HOSTNQN).expect("nqn"),
    }
    .to_bytes()
}

fn connect_sqe(qid: u16, sqsize: u16, kato_ms: u32) -> Sqe {
    let cmd = FabricsCmd::Connect {
        recfmt: 0,
        qid,
        sqsize,
        cattr: 0,
        kato_ms,
    };
    keyed(cmd.to_sqe(1), 1024)
}

/// Connect `q` (an admin queue) to `subnqn`.
fn connect_admin(core: &mut Core, q: &mut Fake, subnqn: &str) -> Outcome {
    let sqe = connect_sqe(0, q.size as u16 - 1, 0);
    submit(core, q, sqe, &connect_data(subnqn, CNTLID_DYNAMIC))
}

/// A core with a controller of `SUBNQN`, enabled, and its admin queue.
fn enabled() -> (Core, Fake) {
    let mut core = Core::new(config());
    let mut admin = Fake::new(100, 0, ADMIN_STAGING);
    assert!(connect_admin(&mut core, &mut admin, SUBNQN)
        .status()
        .is_success());
    let en = FabricsCmd::set(crate::nvme::fabrics::reg::CC, 1).to_sqe(2);
    assert!(submit(&mut core, &mut admin, en, &[]).status().is_success());
    (core, admin)
}

/// An I/O queue `qid` of the admin queue's controller, after Set Features asked for
/// `qid` queues.
fn io_queue(core: &mut Core, admin: &Fake, qid: u16) -> Fake {
    let cntlid = admin.cntlid.expect("connected");
    let mut a = Fake::new(admin.qpn.get(), 0, ADMIN_STAGING);
    a.cntlid = Some(cntlid);
    let nq = crate::nvme::admin::set_num_queues(3, qid as u32, qid as u32).expect("sqe");
    assert!(submit(core, &mut a, nq, &[]).status().is_success());
    let mut q = Fake::new(200 + qid as u32, qid, MAX_TRANSFER);
    let sqe = connect_sqe(qid, q.size as u16 - 1, 0);
    let st = submit(core, &mut q, sqe, &connect_data(SUBNQN, cntlid)).status();
    assert!(st.is_success(), "{st:?}");
    q
}

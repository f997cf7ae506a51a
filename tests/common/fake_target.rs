//! A target that lies, for host robustness tests.
//!
//! It accepts RDMA CM connections and answers Fabrics Connect, Property Get/Set, Identify,
//! Set Features (Number of Queues) and Keep Alive correctly, so a real [`Controller`] comes
//! up against it. Its one namespace lives in RAM. Each I/O command is then answered as a
//! test's [`Script`] says: honestly, or with one of the [`Lie`]s a broken or hostile target
//! could tell. It keeps no secrets from the test: [`FakeTarget::stats`] counts what it did.
//!
//! Each queue is one task that handles its commands one at a time (waiting for each RDMA
//! READ, WRITE and SEND to complete), so the order on the wire is exactly the script's.
//! A transport error ends the queue, as it would on a real target.
//!
//! [`Controller`]: nvmf_rdma::transport::Controller

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::sync::mpsc;

use nvmf_rdma::cm::{AcceptParams, ConnId, NvmeCmAccept};
use nvmf_rdma::driver::CmService;
use nvmf_rdma::driver::SoftHca;
use nvmf_rdma::hca::rc::{create_qp_init, qp_to_rts, RcOptions};
use nvmf_rdma::hca::HostMem;
use nvmf_rdma::nvme::admin::{cns, feature, opcode};
use nvmf_rdma::nvme::fabrics::{self, ConnectResult};
use nvmf_rdma::nvme::{
    Cap, Cc, ConnectData, Cqe, Csts, FabricsCmd, FixedStr, IdentifyController, IdentifyNamespace,
    Nqn, SglDescriptor, Sqe, Status, Vs,
};
use nvmf_rdma::verbs::PeerInfo;
use nvmf_rdma::verbs::{
    Access, CqId, MemKey, MrInfo, Mtu, PdId, Psn, QpCaps, Qpn, RecvWr, SendOp, SendWr, Sgl,
    WcOpcode, WcStatus, WorkCompletion,
};

const SQE_LEN: usize = 64;
const CQE_LEN: usize = 16;
/// Capsules we can receive: an SQE plus room for in-capsule data we never advertise.
const CAPSULE: usize = SQE_LEN + 4096;
/// Send buffers for responses (each waits for its completion before the next).
const RSP_SLOTS: usize = 64;

/// What the fake does with one I/O command instead of (or besides) answering it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lie {
    /// Answer as a real target would.
    Honest,
    /// First complete a command ID that is not in flight (`Some(cid)`), or the ID of the
    /// command this queue completed last (`None`: the same slot, an older generation,
    /// very likely); then answer honestly.
    UnknownCid(Option<u16>),
    /// Answer honestly, then send the same completion again.
    Duplicate,
    /// First send an 8-byte response (no command ID can be read from it), then answer.
    ShortResponse,
    /// First send `n` completions of random bytes, then answer.
    Garbage(u8),
    /// Report success for a read without writing its data.
    SuccessWithoutData,
    /// Write the read data just past the end of the buffer the command named (same rkey).
    WritePastBuffer,
    /// Write the read data with an rkey the host never handed out.
    WriteBogusRkey,
    /// Answer honestly, then, when the queue's next command arrives and before handling it,
    /// RDMA WRITE garbage to this command's buffer under the key this command named: a
    /// late write, after the host completed the command.
    LateWrite,
    /// For a write: first RDMA READ [`OVERSIZED_READ`] bytes from the buffer the command
    /// named, whatever the command's length; then answer honestly.
    ReadPastTransfer,
    /// For a write: first RDMA WRITE garbage into the buffer the command named (data the
    /// host gave to be read, not written); then answer honestly.
    WriteIntoWriteData,
    /// Never answer.
    Silence,
    /// Answer with this status without executing the command (a path status, say).
    Status(Status),
}

/// How much [`Lie::ReadPastTransfer`] reads.
pub const OVERSIZED_READ: usize = 64 << 10;

/// Chooses the lie for each I/O command (admin commands are always answered honestly).
pub type Script = Arc<dyn Fn(&Sqe) -> Lie + Send + Sync>;

/// Settings of a fake target.
#[derive(Clone)]
pub struct FakeConfig {
    pub subnqn: Nqn,
    /// Namespace 1: 512-byte blocks, this many bytes, filled with [`FakeConfig::pattern`].
    pub ns_bytes: usize,
    /// Largest transfer (MDTS), a power of two of at least 4 KiB.
    pub max_transfer: u32,
    /// Hold this many I/O commands before answering any, then answer the batch in reverse
    /// order of arrival (1 = answer each at once).
    pub batch: usize,
    /// The NVMe-oF service port to listen on.
    pub port: u16,
    pub seed: u64,
}

impl FakeConfig {
    pub fn new(subnqn: Nqn) -> FakeConfig {
        FakeConfig {
            subnqn,
            ns_bytes: 4 << 20,
            max_transfer: 128 << 10,
            batch: 1,
            port: 4420,
            seed: 1,
        }
    }

    /// The initial content of the namespace at byte `offset`: every 512-byte block is
    /// recognisable by its LBA.
    pub fn pattern(offset: usize) -> u8 {
        let lba = offset / 512;
        (lba as u8) ^ ((lba >> 8) as u8).rotate_left(3) ^ (offset % 512) as u8
    }
}

/// What the fake did, for assertions.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FakeStats {
    pub queues: u64,
    pub io_commands: u64,
    pub lies: u64,
    /// Queues ended by a transport error (the host refused an access, say).
    pub transport_errors: u64,
}

struct Shared {
    cfg: FakeConfig,
    script: Script,
    store: Mutex<Vec<u8>>,
    stats: Mutex<FakeStats>,
    /// CC per controller ID; controller IDs are handed out from 1.
    ctrls: Mutex<Vec<Cc>>,
}

/// A running fake target. Dropping it leaves its tasks running until the device dies.
#[derive(Clone)]
pub struct FakeTarget {
    sh: Arc<Shared>,
}

impl FakeTarget {
    /// Listen for connections on `cm` (which must run on `hca`).
    pub fn start(
        hca: SoftHca,
        cm: CmService,
        cfg: FakeConfig,
        script: Script,
    ) -> Result<FakeTarget, nvmf_rdma::verbs::VerbsError> {
        let store = (0..cfg.ns_bytes).map(FakeConfig::pattern).collect();
        let sh = Arc::new(Shared {
            script,
            store: Mutex::new(store),
            stats: Mutex::new(FakeStats::default()),
            ctrls: Mutex::new(Vec::new()),
            cfg,
        });
        let pd = hca.with(|d, _| d.alloc_pd())?;
        let mut requests = cm.listen(sh.cfg.port);
        let t = FakeTarget { sh: sh.clone() };
        tokio::spawn(async move {
            let mut psn = 0x1234u32;
            while let Some(req) = requests.recv().await {
                let Ok(nvme) = req.nvme else {
                    cm.reject(req.id, &[]);
                    continue;
                };
                psn = psn.wrapping_mul(69069).wrapping_add(1) & 0xFF_FFFF;
                let peer = req.peer;
                let size = nvme.hsqsize as usize + 1;
                let seed = sh.cfg.seed ^ psn as u64;
                let q = FakeQueue::create(&hca, pd, peer, req.local_psn, size, nvme.qid, seed);
                let Ok(q) = q else {
                    cm.reject(req.id, &[]);
                    continue;
                };
                let ap = AcceptParams::new(q.qpn);
                let private = NvmeCmAccept {
                    crqsize: size as u16,
                }
                .emit();
                if cm.accept(req.id, ap, &private).is_err() {
                    q.destroy(&hca);
                    continue;
                }
                let (gone_tx, gone_rx) = mpsc::unbounded_channel::<ConnId>();
                cm.watch(req.id, gone_tx);
                sh.stats.lock().unwrap_or_else(|e| e.into_inner()).queues += 1;
                tokio::spawn(q.run(hca.clone(), sh.clone(), gone_rx));
            }
        });
        Ok(t)
    }

    pub fn stats(&self) -> FakeStats {
        self.sh
            .stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// A command answered but not yet delivered (batching).
struct Answer {
    sqe: Sqe,
    cqe: Cqe,
    /// Data for the host (reads, Identify).
    data: Vec<u8>,
    lie: Lie,
}

struct FakeQueue {
    qid: u16,
    size: usize,
    qpn: Qpn,
    cq: CqId,
    recv: (HostMem, MrInfo),
    rsp: (HostMem, MrInfo),
    data: (HostMem, MrInfo),
    next_rsp: usize,
    cntlid: Option<u16>,
    last_cid: Option<u16>,
    held: Vec<Answer>,
    backlog: VecDeque<WorkCompletion>,
    rng: SmallRng,
    next_wr: u64,
    /// (address, length, key) of a command answered with [`Lie::LateWrite`].
    late: Option<(u64, u32, u32)>,
}

const WR_RECV: u64 = 1 << 32;

impl FakeQueue {
    fn create(
        hca: &SoftHca,
        pd: PdId,
        peer: PeerInfo,
        psn: Psn,
        size: usize,
        qid: u16,
        seed: u64,
    ) -> Result<FakeQueue, nvmf_rdma::verbs::VerbsError> {
        hca.with(|d, _| {
            let cq = d.create_cq(size * 4 + 64)?;
            let caps = QpCaps {
                max_send_wr: (size * 4 + 64) as u32,
                max_recv_wr: size as u32,
            };
            let qpn = create_qp_init(d, pd, cq, caps, Access::empty())?;
            let o = RcOptions {
                mtu: Mtu::Mtu4096,
                timeout: 14,
                retry_cnt: 7,
                rnr_retry: 7,
                max_unacked: 256,
                ..RcOptions::default()
            };
            qp_to_rts(d, qpn, peer, psn, &o)?;
            let recv = HostMem::new(size * CAPSULE);
            let recv_mr = d.reg_mr(pd, &recv, 0, recv.len(), Access::LOCAL_WRITE)?;
            let rsp = HostMem::new(RSP_SLOTS * CQE_LEN);
            let rsp_mr = d.reg_mr(pd, &rsp, 0, rsp.len(), Access::empty())?;
            let data = HostMem::new(1 << 20);
            let data_mr = d.reg_mr(pd, &data, 0, data.len(), Access::LOCAL_WRITE)?;
            for i in 0..size {
                let sgl = Sgl::one(
                    recv_mr.addr + (i * CAPSULE) as u64,
                    CAPSULE as u32,
                    recv_mr.lkey,
                );
                d.post_recv(
                    qpn,
                    RecvWr {
                        wr_id: WR_RECV | i as u64,
                        sgl,
                    },
                )?;
            }
            Ok(FakeQueue {
                qid,
                size,
                qpn,
                cq,
                recv: (recv, recv_mr),
                rsp: (rsp, rsp_mr),
                data: (data, data_mr),
                next_rsp: 0,
                cntlid: None,
                last_cid: None,
                held: Vec::new(),
                backlog: VecDeque::new(),
                rng: SmallRng::seed_from_u64(seed),
                late: None,
                next_wr: 0,
            })
        })
    }

    fn destroy(&self, hca: &SoftHca) {
        hca.with(|d, _| {
            let _ = d.destroy_qp(self.qpn);
            let _ = d.destroy_cq(self.cq);
            for mr in [self.recv.1, self.rsp.1, self.data.1] {
                let _ = d.dereg_mr(mr.lkey);
            }
        });
    }

    async fn run(
        mut self,
        hca: SoftHca,
        sh: Arc<Shared>,
        mut gone: mpsc::UnboundedReceiver<ConnId>,
    ) {
        loop {
            let wc = match self.backlog.pop_front() {
                Some(wc) => wc,
                None => {
                    let mut wcs = Vec::new();
                    tokio::select! {
                        n = hca.wait_cq(self.cq, 64, &mut wcs) => if n == 0 { break },
                        _ = gone.recv() => break,
                    }
                    self.backlog.extend(wcs);
                    continue;
                }
            };
            if wc.status != WcStatus::Success {
                break;
            }
            if wc.wr_id & WR_RECV == 0 || wc.opcode != WcOpcode::Recv {
                continue; // a late send completion
            }
            let r = (wc.wr_id & 0xFFFF_FFFF) as usize;
            let mut capsule = vec![0u8; (wc.byte_len as usize).min(CAPSULE)];
            self.recv.0.read(r * CAPSULE, &mut capsule);
            self.repost(&hca, r);
            let Ok(sqe) = Sqe::parse(&capsule) else {
                continue;
            };
            if self.command(&hca, &sh, sqe).await.is_err() {
                sh.stats
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .transport_errors += 1;
                break;
            }
        }
        self.destroy(&hca);
    }

    fn repost(&self, hca: &SoftHca, r: usize) {
        let sgl = Sgl::one(
            self.recv.1.addr + (r * CAPSULE) as u64,
            CAPSULE as u32,
            self.recv.1.lkey,
        );
        let qpn = self.qpn;
        let _ = hca.with(|d, _| {
            d.post_recv(
                qpn,
                RecvWr {
                    wr_id: WR_RECV | r as u64,
                    sgl,
                },
            )
        });
    }

    /// Post one send-queue work request and wait for its completion; completions of other
    /// work (new capsules) wait in the backlog.
    async fn post(&mut self, hca: &SoftHca, op: SendOp, sgl: Sgl) -> Result<(), ()> {
        self.next_wr += 1;
        let wr_id = self.next_wr;
        let wr = SendWr::signaled(wr_id, op, sgl);
        let qpn = self.qpn;
        hca.with(|d, now| d.post_send(now, qpn, wr))
            .map_err(|_| ())?;
        loop {
            let mut wcs = Vec::new();
            if hca.wait_cq(self.cq, 64, &mut wcs).await == 0 {
                return Err(());
            }
            let mut done = None;
            for wc in wcs {
                if wc.wr_id == wr_id {
                    done = Some(wc.status);
                } else if wc.status != WcStatus::Success && wc.wr_id & WR_RECV == 0 {
                    return Err(());
                } else {
                    self.backlog.push_back(wc);
                }
            }
            match done {
                Some(WcStatus::Success) => return Ok(()),
                Some(_) => return Err(()),
                None => {}
            }
        }
    }

    async fn send_bytes(&mut self, hca: &SoftHca, bytes: &[u8]) -> Result<(), ()> {
        let at = (self.next_rsp % RSP_SLOTS) * CQE_LEN;
        self.next_rsp += 1;
        self.rsp.0.write(at, bytes);
        let sgl = Sgl::one(
            self.rsp.1.addr + at as u64,
            bytes.len() as u32,
            self.rsp.1.lkey,
        );
        self.post(hca, SendOp::Send, sgl).await
    }

    async fn rdma_write(
        &mut self,
        hca: &SoftHca,
        data: &[u8],
        addr: u64,
        rkey: u32,
    ) -> Result<(), ()> {
        self.data.0.write(0, data);
        let sgl = Sgl::one(self.data.1.addr, data.len() as u32, self.data.1.lkey);
        let op = SendOp::Write {
            remote_addr: addr,
            rkey: MemKey(rkey),
        };
        self.post(hca, op, sgl).await
    }

    async fn rdma_read(
        &mut self,
        hca: &SoftHca,
        sgl: SglDescriptor,
        len: usize,
    ) -> Option<Vec<u8>> {
        let SglDescriptor::Keyed {
            addr, key, len: l, ..
        } = sgl
        else {
            return None;
        };
        if (l as usize) < len || len > self.data.0.len() {
            return None;
        }
        let local = Sgl::one(self.data.1.addr, len as u32, self.data.1.lkey);
        let op = SendOp::Read {
            remote_addr: addr,
            rkey: MemKey(key),
        };
        self.post(hca, op, local).await.ok()?;
        let mut v = vec![0u8; len];
        self.data.0.read(0, &mut v);
        Some(v)
    }

    /// Handle one command: fetch its data, work out the honest answer, deliver (or hold) it.
    async fn command(&mut self, hca: &SoftHca, sh: &Shared, sqe: Sqe) -> Result<(), ()> {
        if let Some((addr, len, key)) = self.late.take() {
            let mut junk = vec![0u8; len as usize];
            self.rng.fill(&mut junk[..]);
            self.rdma_write(hca, &junk, addr, key).await?;
        }
        let sgl = SglDescriptor::parse(&sqe.dptr).unwrap_or(SglDescriptor::NULL);
        let io = self.qid != 0 && sqe.opcode != opcode::FABRICS;
        let mut lie = Lie::Honest;
        let (status, result, data) = if sqe.opcode == opcode::FABRICS {
            self.fabrics(hca, sh, &sqe, sgl).await?
        } else if self.qid == 0 {
            self.admin(sh, &sqe)
        } else {
            lie = (sh.script)(&sqe);
            match lie {
                Lie::Status(s) => (s, 0, Vec::new()),
                _ => self.io(hca, sh, &sqe, sgl, lie).await?,
            }
        };
        let answer = Answer {
            sqe,
            cqe: Cqe::new(sqe.cid, status, result),
            data,
            lie,
        };
        if io {
            let mut st = sh.stats.lock().unwrap_or_else(|e| e.into_inner());
            st.io_commands += 1;
            if lie != Lie::Honest {
                st.lies += 1;
            }
        }
        if !io || sh.cfg.batch <= 1 {
            return self.deliver(hca, answer).await;
        }
        self.held.push(answer);
        if self.held.len() >= sh.cfg.batch {
            while let Some(a) = self.held.pop() {
                self.deliver(hca, a).await?;
            }
        }
        Ok(())
    }

    async fn deliver(&mut self, hca: &SoftHca, a: Answer) -> Result<(), ()> {
        let cqe = a.cqe.to_bytes();
        match a.lie {
            Lie::Silence => return Ok(()),
            Lie::UnknownCid(cid) => {
                let cid = cid.or(self.last_cid).unwrap_or(a.sqe.cid ^ 0x8000);
                let bogus = Cqe::new(cid, Status::SUCCESS, 0).to_bytes();
                self.send_bytes(hca, &bogus).await?;
            }
            Lie::ShortResponse => self.send_bytes(hca, &cqe[..8]).await?,
            Lie::Garbage(n) => {
                for _ in 0..n {
                    let mut g = [0u8; CQE_LEN];
                    self.rng.fill(&mut g[..]);
                    self.send_bytes(hca, &g).await?;
                }
            }
            _ => {}
        }
        if !a.data.is_empty() && a.cqe.nvme_status().is_success() {
            if let SglDescriptor::Keyed { addr, len, key, .. } =
                SglDescriptor::parse(&a.sqe.dptr).unwrap_or(SglDescriptor::NULL)
            {
                let n = a.data.len().min(len as usize);
                match a.lie {
                    Lie::SuccessWithoutData => {}
                    Lie::WritePastBuffer => {
                        self.rdma_write(hca, &a.data[..n], addr + len as u64, key)
                            .await?
                    }
                    Lie::WriteBogusRkey => {
                        self.rdma_write(hca, &a.data[..n], addr, key ^ 0x5A5A_5A5A)
                            .await?
                    }
                    _ => self.rdma_write(hca, &a.data[..n], addr, key).await?,
                }
            }
        }
        self.send_bytes(hca, &cqe).await?;
        if a.lie == Lie::LateWrite {
            if let Ok(SglDescriptor::Keyed { addr, len, key, .. }) =
                SglDescriptor::parse(&a.sqe.dptr)
            {
                self.late = Some((addr, len, key));
            }
        }
        if a.lie == Lie::Duplicate {
            self.send_bytes(hca, &cqe).await?;
        }
        self.last_cid = Some(a.sqe.cid);
        Ok(())
    }

    async fn fabrics(
        &mut self,
        hca: &SoftHca,
        sh: &Shared,
        sqe: &Sqe,
        sgl: SglDescriptor,
    ) -> Result<(Status, u64, Vec<u8>), ()> {
        let bad = Status::INVALID_FIELD.with_dnr();
        let Ok(cmd) = FabricsCmd::from_sqe(sqe) else {
            return Ok((bad, 0, Vec::new()));
        };
        match cmd {
            FabricsCmd::Connect { qid, sqsize, .. } => {
                let Some(raw) = self.rdma_read(hca, sgl, ConnectData::LEN).await else {
                    return Ok((Status::SGL_DATA_LENGTH_INVALID.with_dnr(), 0, Vec::new()));
                };
                let Ok(cd) = ConnectData::parse(&raw) else {
                    return Ok((Status::CONNECT_INVALID_PARAMETERS.with_dnr(), 0, Vec::new()));
                };
                if qid != self.qid || sqsize as usize + 1 != self.size || cd.subnqn != sh.cfg.subnqn
                {
                    return Ok((Status::CONNECT_INVALID_PARAMETERS.with_dnr(), 0, Vec::new()));
                }
                let mut c = sh.ctrls.lock().unwrap_or_else(|e| e.into_inner());
                let cntlid = if qid == 0 {
                    c.push(Cc(0));
                    c.len() as u16
                } else {
                    cd.cntlid
                };
                self.cntlid = Some(cntlid);
                let r = ConnectResult::Ok { cntlid, authreq: 0 }.to_result();
                Ok((Status::SUCCESS, r, Vec::new()))
            }
            FabricsCmd::PropertyGet { offset, .. } => {
                let cc = self.cc(sh);
                let v = match offset {
                    fabrics::reg::CAP => {
                        Cap(0)
                            .with_mqes(1023)
                            .with_cqr(true)
                            .with_to(10)
                            .with_css(1)
                            .0
                    }
                    fabrics::reg::VS => Vs::new(1, 3, 0).0 as u64,
                    fabrics::reg::CC => cc.0 as u64,
                    fabrics::reg::CSTS => Csts(0).with_rdy(cc.en()).0 as u64,
                    _ => return Ok((bad, 0, Vec::new())),
                };
                Ok((Status::SUCCESS, v, Vec::new()))
            }
            FabricsCmd::PropertySet { offset, value, .. } => {
                if offset != fabrics::reg::CC {
                    return Ok((bad, 0, Vec::new()));
                }
                let mut c = sh.ctrls.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(slot) = self
                    .cntlid
                    .and_then(|id| c.get_mut((id as usize).wrapping_sub(1)))
                {
                    *slot = Cc(value as u32);
                }
                Ok((Status::SUCCESS, 0, Vec::new()))
            }
        }
    }

    fn cc(&self, sh: &Shared) -> Cc {
        let c = sh.ctrls.lock().unwrap_or_else(|e| e.into_inner());
        self.cntlid
            .and_then(|id| c.get((id as usize).wrapping_sub(1)).copied())
            .unwrap_or(Cc(0))
    }

    fn admin(&mut self, sh: &Shared, sqe: &Sqe) -> (Status, u64, Vec<u8>) {
        let ok = |r: u64, d: Vec<u8>| (Status::SUCCESS, r, d);
        match sqe.opcode {
            opcode::admin::IDENTIFY => {
                let mut page = [0u8; 4096];
                match (sqe.cdw10 & 0xFF) as u8 {
                    cns::CONTROLLER => IdentifyController {
                        vid: 0x1de5,
                        ssvid: 0x1de5,
                        sn: FixedStr::new_spaced("FAKE").unwrap_or_else(|_| FixedStr::zeroed()),
                        mn: FixedStr::new_spaced("lying target")
                            .unwrap_or_else(|_| FixedStr::zeroed()),
                        mdts: (sh.cfg.max_transfer / 4096).max(1).ilog2() as u8,
                        cntlid: self.cntlid.unwrap_or(0),
                        ver: Vs::new(1, 3, 0).0,
                        sqes: 0x66,
                        cqes: 0x44,
                        maxcmd: 1024,
                        nn: 1,
                        sgls: 1 | (1 << 2),
                        subnqn: FixedStr::new(sh.cfg.subnqn.as_str())
                            .unwrap_or_else(|_| FixedStr::zeroed()),
                        // No in-capsule data: every transfer goes through a keyed SGL.
                        ioccsz: 4,
                        iorcsz: 1,
                        msdbd: 1,
                        ..IdentifyController::default()
                    }
                    .emit(&mut page),
                    cns::NAMESPACE if sqe.nsid == 1 => {
                        IdentifyNamespace::simple((sh.cfg.ns_bytes / 512) as u64, 9).emit(&mut page)
                    }
                    cns::ACTIVE_NAMESPACE_LIST => {
                        let ids: &[u32] = if sqe.nsid < 1 { &[1] } else { &[] };
                        nvmf_rdma::nvme::identify::emit_active_namespace_ids(ids, &mut page);
                    }
                    _ => return (Status::INVALID_FIELD.with_dnr(), 0, Vec::new()),
                }
                ok(0, page.to_vec())
            }
            opcode::admin::SET_FEATURES
                if (sqe.cdw10 & 0xFF) as u8 == feature::NUMBER_OF_QUEUES =>
            {
                let n = ((sqe.cdw11 & 0xFFFF) + 1)
                    .min((sqe.cdw11 >> 16) + 1)
                    .min(16)
                    - 1;
                ok((n | n << 16) as u64, Vec::new())
            }
            opcode::admin::KEEP_ALIVE => ok(0, Vec::new()),
            _ => (Status::INVALID_OPCODE.with_dnr(), 0, Vec::new()),
        }
    }

    async fn io(
        &mut self,
        hca: &SoftHca,
        sh: &Shared,
        sqe: &Sqe,
        sgl: SglDescriptor,
        lie: Lie,
    ) -> Result<(Status, u64, Vec<u8>), ()> {
        if let (opcode::io::WRITE, SglDescriptor::Keyed { addr, key, .. }) = (sqe.opcode, sgl) {
            match lie {
                Lie::ReadPastTransfer => {
                    let local = Sgl::one(self.data.1.addr, OVERSIZED_READ as u32, self.data.1.lkey);
                    let op = SendOp::Read {
                        remote_addr: addr,
                        rkey: MemKey(key),
                    };
                    self.post(hca, op, local).await?;
                }
                Lie::WriteIntoWriteData => {
                    let mut junk = vec![0u8; 512];
                    self.rng.fill(&mut junk[..]);
                    self.rdma_write(hca, &junk, addr, key).await?;
                }
                _ => {}
            }
        }
        let slba = sqe.cdw10 as u64 | (sqe.cdw11 as u64) << 32;
        let len = ((sqe.cdw12 & 0xFFFF) as usize + 1) * 512;
        let range = (slba as usize)
            .checked_mul(512)
            .filter(|&off| sqe.nsid == 1 && off.saturating_add(len) <= sh.cfg.ns_bytes)
            .map(|off| off..off + len);
        let none = Vec::new();
        match sqe.opcode {
            opcode::io::READ | opcode::io::WRITE => {
                let Some(range) = range else {
                    return Ok((Status::LBA_OUT_OF_RANGE.with_dnr(), 0, none));
                };
                if sqe.opcode == opcode::io::READ {
                    let data = sh.store.lock().unwrap_or_else(|e| e.into_inner())[range].to_vec();
                    return Ok((Status::SUCCESS, 0, data));
                }
                let Some(data) = self.rdma_read(hca, sgl, len).await else {
                    return Ok((Status::SGL_DATA_LENGTH_INVALID.with_dnr(), 0, none));
                };
                sh.store.lock().unwrap_or_else(|e| e.into_inner())[range].copy_from_slice(&data);
                Ok((Status::SUCCESS, 0, none))
            }
            opcode::io::FLUSH => Ok((Status::SUCCESS, 0, none)),
            _ => Ok((Status::INVALID_OPCODE.with_dnr(), 0, none)),
        }
    }
}

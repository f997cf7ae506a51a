//! The host controller: admin queue bring-up (Fabrics Connect, Property Get/Set, enable,
//! Identify, Set Features Number of Queues), I/O queues, keep-alive, and a block API.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::cm::{ConnId, ConnectParams, NvmeCmRequest};
use crate::driver::SoftHca;
use crate::hca::rc::PeerInfo;
use crate::hca::{Mtu, PdId, Psn};
use crate::nvme::admin;
use crate::nvme::fabrics::{self, ConnectResult, CNTLID_DYNAMIC};
use crate::nvme::{
    Cap, Cc, ConnectData, Csts, DiscoveryLogEntry, DiscoveryLogHeader, DsmRange, FabricsCmd,
    IdentifyController, IdentifyNamespace, Nqn,
};

use super::fabric::CmService;
use super::queue::{Queue, QueueHandle, QueueRes, QueueSpec};
use super::HostError;

/// Everything `connect` needs, with nvme-cli's names where there is one.
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    /// The target device's address (`-a`, with the soft-HCA's UDP port).
    pub traddr: SocketAddr,
    /// NVMe-oF service port (`-s`, default 4420).
    pub trsvcid: u16,
    /// Subsystem NQN (`-n`).
    pub subnqn: String,
    /// Host NQN (`-q`).
    pub hostnqn: String,
    /// Host ID (`-I`), a UUID.
    pub hostid: [u8; 16],
    /// I/O queues (`-i`, default: one per core).
    pub nr_io_queues: usize,
    /// Entries per I/O queue (`-Q`, default 128, 16..=1024).
    pub queue_size: usize,
    /// Keep-alive timeout (`-k`, default 5 s; zero turns keep-alive off).
    pub keep_alive_tmo: Duration,
    /// Largest transfer per command we set up buffers for.
    pub max_io: usize,
    pub mtu: Mtu,
    pub connect_timeout: Duration,
}

impl ConnectOptions {
    pub fn new(traddr: SocketAddr, subnqn: &str) -> ConnectOptions {
        let hostid = default_hostid();
        ConnectOptions {
            traddr,
            trsvcid: 4420,
            subnqn: subnqn.to_string(),
            hostnqn: Nqn::from_uuid(&hostid).as_str().to_string(),
            hostid,
            nr_io_queues: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            queue_size: 128,
            keep_alive_tmo: Duration::from_secs(5),
            max_io: 128 << 10,
            mtu: Mtu::Mtu4096,
            connect_timeout: Duration::from_secs(5),
        }
    }
}

/// A stable host ID for this machine: from /etc/machine-id when there is one.
pub fn default_hostid() -> [u8; 16] {
    let mut id = [0u8; 16];
    if let Ok(s) = std::fs::read_to_string("/etc/machine-id") {
        let hex: Vec<u8> = s.trim().bytes().collect();
        for (i, chunk) in hex.chunks(2).take(16).enumerate() {
            if let Ok(b) = u8::from_str_radix(std::str::from_utf8(chunk).unwrap_or("0"), 16) {
                id[i] = b;
            }
        }
    }
    if id == [0u8; 16] {
        id = *b"nvmf-rdma-host-1";
    }
    id[6] = (id[6] & 0x0F) | 0x40; // UUID version 4 layout
    id[8] = (id[8] & 0x3F) | 0x80;
    id
}

/// A namespace as the host sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NsInfo {
    pub nsid: u32,
    pub block_size: u32,
    pub blocks: u64,
}

impl NsInfo {
    pub fn bytes(&self) -> u64 {
        self.blocks * self.block_size as u64
    }
}

struct QueueConn {
    handle: QueueHandle,
    task: tokio::task::JoinHandle<super::QueueStats>,
    conn: ConnId,
}

impl QueueConn {
    /// Disconnect, fail what is still out, and wait until the queue's task has released its
    /// verbs resources (so the PD can go after it).
    async fn close(self, cm: &CmService) {
        cm.disconnect(self.conn);
        self.handle.stop();
        drop(self.handle);
        let _ = self.task.await;
    }
}

/// A connected NVMe-oF controller.
pub struct Controller {
    hca: SoftHca,
    cm: CmService,
    pd: PdId,
    pub cntlid: u16,
    pub opts: ConnectOptions,
    pub ident: IdentifyController,
    admin: Option<QueueConn>,
    io: Vec<QueueConn>,
    namespaces: Vec<NsInfo>,
    next: AtomicUsize,
    ka_failed: Arc<AtomicBool>,
    ka_task: Option<tokio::task::JoinHandle<()>>,
    max_io: usize,
}

async fn connect_queue(
    hca: &SoftHca,
    cm: &CmService,
    pd: PdId,
    o: &ConnectOptions,
    spec: QueueSpec,
    cntlid: u16,
    kato_ms: u32,
) -> Result<(QueueConn, u16), HostError> {
    let mut res = QueueRes::create(hca, pd, spec, Psn::new(0))?;
    let mut params = ConnectParams::new(res.qpn, o.trsvcid);
    params.path_mtu = o.mtu;
    let private = NvmeCmRequest {
        qid: spec.qid,
        hrqsize: spec.size as u16,
        hsqsize: spec.size as u16 - 1,
        cntlid,
    }
    .emit();
    let est = match cm
        .connect(o.traddr, params, &private, o.connect_timeout)
        .await
    {
        Ok(e) => e,
        Err(e) => {
            res.destroy(hca);
            return Err(e);
        }
    };
    tracing::debug!(qid = spec.qid, "CM established");
    res.psn = est.local_psn;
    let peer = PeerInfo {
        addr: est.peer,
        qpn: est.remote_qpn,
        psn: est.remote_psn,
    };
    if let Err(e) = res.connected(hca, peer) {
        cm.abort(est.id);
        res.destroy(hca);
        return Err(e);
    }
    let (handle, task) = Queue::spawn(res, hca.clone());
    let qc = QueueConn {
        handle,
        task,
        conn: est.id,
    };
    let data = ConnectData {
        hostid: o.hostid,
        cntlid,
        subnqn: Nqn::new(&o.subnqn)?,
        hostnqn: Nqn::new(&o.hostnqn)?,
    }
    .to_bytes();
    let cmd = FabricsCmd::Connect {
        recfmt: fabrics::RECFMT_0,
        qid: spec.qid,
        sqsize: spec.size as u16 - 1,
        cattr: 0,
        kato_ms,
    }
    .to_sqe(0);
    match qc.handle.submit(cmd, Some(data.to_vec()), 0).await {
        Ok(r) => match ConnectResult::from_result(r.cqe.result, true) {
            ConnectResult::Ok { cntlid, .. } => Ok((qc, cntlid)),
            ConnectResult::InvalidParameter { ipo, iattr } => {
                cm.abort(qc.conn);
                Err(HostError::Connect(format!(
                    "Connect refused parameter at offset {ipo} (attr {iattr})"
                )))
            }
        },
        Err(e) => {
            qc.close(cm).await;
            Err(e)
        }
    }
}

impl Controller {
    /// Connect admin and I/O queues to `o.subnqn` and identify it.
    pub async fn connect(
        hca: SoftHca,
        cm: CmService,
        o: ConnectOptions,
    ) -> Result<Controller, HostError> {
        if !(16..=1024).contains(&o.queue_size) {
            return Err(HostError::Invalid(format!(
                "queue size {} not in 16..=1024",
                o.queue_size
            )));
        }
        if o.nr_io_queues == 0 {
            return Err(HostError::Invalid(
                "at least one I/O queue is needed".into(),
            ));
        }
        // Refuse bad NQNs before a connection exists that an early return would leak.
        Nqn::new(&o.subnqn)?;
        Nqn::new(&o.hostnqn)?;
        let pd = hca.with(|d, _| d.alloc_pd())?;
        let admin_spec = QueueSpec {
            qid: 0,
            size: 32,
            inline: 0,
            max_io: 64 << 10,
            mtu: o.mtu,
        };
        let kato_ms = o.keep_alive_tmo.as_millis().min(u32::MAX as u128) as u32;
        let (admin, cntlid) =
            match connect_queue(&hca, &cm, pd, &o, admin_spec, CNTLID_DYNAMIC, kato_ms).await {
                Ok(a) => a,
                Err(e) => {
                    hca.with(|d, _| {
                        let _ = d.dealloc_pd(pd);
                    });
                    return Err(e);
                }
            };
        let mut c = Controller {
            hca,
            cm,
            pd,
            cntlid,
            ident: IdentifyController::default(),
            admin: Some(admin),
            io: Vec::new(),
            namespaces: Vec::new(),
            next: AtomicUsize::new(0),
            ka_failed: Arc::new(AtomicBool::new(false)),
            ka_task: None,
            max_io: o.max_io,
            opts: o,
        };
        if let Err(e) = c.bring_up().await {
            c.shutdown().await;
            return Err(e);
        }
        Ok(c)
    }

    async fn bring_up(&mut self) -> Result<(), HostError> {
        let a = self.admin()?.clone();
        let cap = Cap(a
            .submit(FabricsCmd::get(fabrics::reg::CAP).to_sqe(0), None, 0)
            .await?
            .cqe
            .result);
        a.submit(
            FabricsCmd::set(fabrics::reg::CC, Cc::enable_default().0 as u64).to_sqe(0),
            None,
            0,
        )
        .await?;
        let deadline =
            tokio::time::Instant::now() + Duration::from_millis(cap.timeout_ms().max(500) as u64);
        loop {
            let csts = Csts(
                a.submit(FabricsCmd::get(fabrics::reg::CSTS).to_sqe(0), None, 0)
                    .await?
                    .cqe
                    .result as u32,
            );
            if csts.cfs() {
                return Err(HostError::Connect(
                    "controller fatal status while enabling".into(),
                ));
            }
            if csts.rdy() {
                break;
            }
            if tokio::time::Instant::now() > deadline {
                return Err(HostError::Timeout(
                    "controller did not become ready (CSTS.RDY)".into(),
                ));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tracing::debug!("controller ready");
        let r = a.submit(admin::identify_controller(0), None, 4096).await?;
        self.ident =
            IdentifyController::parse(&r.data).map_err(|e| HostError::Protocol(e.to_string()))?;
        if let Some(m) = self.ident.max_transfer_bytes(cap.min_page_size()) {
            self.max_io = self.max_io.min(m as usize);
        }
        let inline = (self.ident.in_capsule_data_bytes() as usize).min(16 << 10);
        if Nqn::new(&self.opts.subnqn)?.is_discovery() {
            return Ok(());
        }
        let want = self.opts.nr_io_queues as u32;
        let r = a
            .submit(admin::set_num_queues(0, want, want)?, None, 0)
            .await?;
        let (sq, cq) = admin::num_queues_allocated(r.cqe.dw0());
        let n = want.min(sq).min(cq).max(1);
        let max_q = (cap.max_queue_entries() as usize).min(self.opts.queue_size);
        for qid in 1..=n as u16 {
            let spec = QueueSpec {
                qid,
                size: max_q,
                inline,
                max_io: self.max_io,
                mtu: self.opts.mtu,
            };
            let (qc, _) = connect_queue(
                &self.hca,
                &self.cm,
                self.pd,
                &self.opts,
                spec,
                self.cntlid,
                0,
            )
            .await?;
            self.io.push(qc);
        }
        // Namespaces.
        let r = a
            .submit(admin::identify_active_namespaces(0, 0), None, 4096)
            .await?;
        let ids: Vec<u32> = crate::nvme::identify::active_namespace_ids(&r.data).collect();
        for nsid in ids {
            let r = a
                .submit(admin::identify_namespace(0, nsid), None, 4096)
                .await?;
            let ns = IdentifyNamespace::parse(&r.data)
                .map_err(|e| HostError::Protocol(e.to_string()))?;
            let bs = ns.block_size().ok_or_else(|| {
                HostError::Protocol(format!("namespace {nsid} has no valid LBA format"))
            })?;
            self.namespaces.push(NsInfo {
                nsid,
                block_size: bs,
                blocks: ns.nsze,
            });
        }
        self.start_keep_alive();
        Ok(())
    }

    fn start_keep_alive(&mut self) {
        let kato = self.opts.keep_alive_tmo;
        if kato.is_zero() {
            return;
        }
        let Some(a) = self.admin.as_ref().map(|q| q.handle.clone()) else {
            return;
        };
        let failed = self.ka_failed.clone();
        self.ka_task = Some(tokio::spawn(async move {
            let mut tick = tokio::time::interval(kato / 2);
            tick.tick().await;
            loop {
                tick.tick().await;
                let r = tokio::time::timeout(kato, a.submit(admin::keep_alive(0), None, 0)).await;
                if !matches!(r, Ok(Ok(_))) {
                    tracing::warn!("keep-alive failed; controller needs recovery");
                    failed.store(true, Ordering::SeqCst);
                    return;
                }
            }
        }));
    }

    fn admin(&self) -> Result<&QueueHandle, HostError> {
        self.admin
            .as_ref()
            .map(|q| &q.handle)
            .ok_or_else(|| HostError::Gone("controller disconnected".into()))
    }

    /// True once a keep-alive went unanswered.
    pub fn keep_alive_failed(&self) -> bool {
        self.ka_failed.load(Ordering::SeqCst)
    }

    /// The soft-HCA this controller runs on.
    pub fn hca(&self) -> &SoftHca {
        &self.hca
    }

    pub fn namespaces(&self) -> &[NsInfo] {
        &self.namespaces
    }

    pub fn namespace(&self, nsid: u32) -> Result<NsInfo, HostError> {
        self.namespaces
            .iter()
            .find(|n| n.nsid == nsid)
            .copied()
            .ok_or_else(|| HostError::Invalid(format!("no namespace {nsid}")))
    }

    pub fn io_queue_count(&self) -> usize {
        self.io.len()
    }

    pub fn max_transfer(&self) -> usize {
        self.max_io
    }

    fn pick(&self) -> &QueueHandle {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.io.len();
        &self.io[i].handle
    }

    /// The I/O queue a caller pinned itself to (`queue % count`), for per-core submission.
    pub fn queue(&self, queue: usize) -> &QueueHandle {
        &self.io[queue % self.io.len()].handle
    }

    fn check(&self, nsid: u32, lba: u64, bytes: usize) -> Result<(NsInfo, u64), HostError> {
        let ns = self.namespace(nsid)?;
        let bs = ns.block_size as usize;
        if bytes == 0 || bytes % bs != 0 {
            return Err(HostError::Invalid(format!(
                "length {bytes} is not a positive multiple of the {bs}-byte block size"
            )));
        }
        let blocks = (bytes / bs) as u64;
        if lba.checked_add(blocks).is_none_or(|end| end > ns.blocks) {
            return Err(HostError::Invalid(format!(
                "blocks {lba}..{} are beyond the namespace end ({} blocks)",
                lba.saturating_add(blocks),
                ns.blocks
            )));
        }
        Ok((ns, blocks))
    }

    /// Read `bytes` starting at block `lba`.
    pub async fn read(&self, nsid: u32, lba: u64, bytes: usize) -> Result<Vec<u8>, HostError> {
        let (ns, _) = self.check(nsid, lba, bytes)?;
        let bs = ns.block_size as usize;
        let chunk = (self.max_io / bs).max(1) * bs;
        let mut out = Vec::with_capacity(bytes);
        let mut done = 0;
        while done < bytes {
            let n = chunk.min(bytes - done);
            let slba = lba + (done / bs) as u64;
            let sqe = admin::read(0, nsid, slba, (n / bs) as u32)?;
            let r = self.pick().submit(sqe, None, n).await?;
            out.extend_from_slice(&r.data);
            done += n;
        }
        Ok(out)
    }

    /// Write `data` starting at block `lba`.
    pub async fn write(&self, nsid: u32, lba: u64, data: &[u8]) -> Result<(), HostError> {
        let (ns, _) = self.check(nsid, lba, data.len())?;
        let bs = ns.block_size as usize;
        let chunk = (self.max_io / bs).max(1) * bs;
        for (i, part) in data.chunks(chunk).enumerate() {
            let slba = lba + (i * chunk / bs) as u64;
            let sqe = admin::write(0, nsid, slba, (part.len() / bs) as u32, false)?;
            self.pick().submit(sqe, Some(part.to_vec()), 0).await?;
        }
        Ok(())
    }

    pub async fn flush(&self, nsid: u32) -> Result<(), HostError> {
        self.namespace(nsid)?;
        self.pick()
            .submit(admin::flush(0, nsid), None, 0)
            .await
            .map(|_| ())
    }

    pub async fn write_zeroes(&self, nsid: u32, lba: u64, blocks: u32) -> Result<(), HostError> {
        let ns = self.namespace(nsid)?;
        self.check(nsid, lba, blocks as usize * ns.block_size as usize)?;
        self.pick()
            .submit(admin::write_zeroes(0, nsid, lba, blocks, false)?, None, 0)
            .await
            .map(|_| ())
    }

    /// Dataset Management, deallocate (TRIM).
    pub async fn deallocate(&self, nsid: u32, ranges: &[(u64, u32)]) -> Result<(), HostError> {
        let ns = self.namespace(nsid)?;
        let mut rs = Vec::with_capacity(ranges.len());
        for &(slba, nlb) in ranges {
            self.check(nsid, slba, nlb as usize * ns.block_size as usize)?;
            rs.push(DsmRange {
                cattr: 0,
                nlb,
                slba,
            });
        }
        let mut buf = vec![0u8; rs.len() * 16];
        DsmRange::emit_all(&rs, &mut buf)?;
        let sqe = admin::dsm_deallocate(0, nsid, rs.len())?;
        self.pick().submit(sqe, Some(buf), 0).await.map(|_| ())
    }

    /// Orderly disconnect: shut the controller down (CC.SHN), tear the queues down, release
    /// every resource.
    pub async fn disconnect(mut self) {
        if let Ok(a) = self.admin() {
            let shn = Cc::enable_default().with_shn(1).0 as u64;
            let cmd = FabricsCmd::set(fabrics::reg::CC, shn).to_sqe(0);
            let _ = tokio::time::timeout(Duration::from_secs(1), a.submit(cmd, None, 0)).await;
        }
        self.shutdown().await;
    }

    async fn shutdown(&mut self) {
        tracing::debug!("controller shutdown");
        if let Some(t) = self.ka_task.take() {
            t.abort();
        }
        let io = std::mem::take(&mut self.io);
        for q in io {
            q.close(&self.cm).await;
        }
        if let Some(q) = self.admin.take() {
            q.close(&self.cm).await;
        }
        let pd = self.pd;
        self.hca.with(|d, _| {
            let _ = d.dealloc_pd(pd);
        });
        tracing::debug!("controller shut down");
    }
}

/// Ask a discovery controller which subsystems it offers.
pub async fn discover(
    hca: SoftHca,
    cm: CmService,
    mut o: ConnectOptions,
) -> Result<Vec<DiscoveryLogEntry>, HostError> {
    o.subnqn = fabrics::DISCOVERY_NQN.to_string();
    o.keep_alive_tmo = Duration::ZERO;
    let c = Controller::connect(hca, cm, o).await?;
    let a = c.admin()?.clone();
    let entries = async {
        let head = a
            .submit(admin::get_discovery_log(0, 0, 1024)?, None, 1024)
            .await?;
        let hdr = DiscoveryLogHeader::parse(&head.data)
            .map_err(|e| HostError::Protocol(e.to_string()))?;
        let len = DiscoveryLogHeader::log_len(hdr.numrec.min(63)).unwrap_or(1024);
        let page = a
            .submit(admin::get_discovery_log(0, 0, len)?, None, len as usize)
            .await?;
        let hdr = DiscoveryLogHeader::parse(&page.data)
            .map_err(|e| HostError::Protocol(e.to_string()))?;
        Ok::<_, HostError>(hdr.entries(&page.data).collect())
    }
    .await;
    c.disconnect().await;
    entries
}

//! An NVMe-oF controller session over the hardware backend: admin queue (Fabrics Connect,
//! Property Get/Set to enable the controller, Identify) and one I/O queue (Connect with the
//! CNTLID, Read/Write with keyed SGLs). Keep-alive is sent from [`HwController::tick`].

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use super::cm::CmId;
use super::device::{HwDevice, Selector};
use super::events::AsyncEvents;
use super::queue::{HwQueue, QueueConfig};
use super::HwError;
use crate::hca::Guid;
use crate::nvme::admin;
use crate::nvme::cqe::Cqe;
use crate::nvme::fabrics::{
    reg, Cap, Cc, ConnectData, ConnectResult, Csts, FabricsCmd, Nqn, CNTLID_DYNAMIC, RECFMT_0,
};
use crate::nvme::identify::{active_namespace_ids, IdentifyController, IdentifyNamespace};

/// Linux `NVME_AQ_DEPTH`.
pub const ADMIN_DEPTH: u16 = 32;

/// How to reach and use a target.
#[derive(Debug, Clone)]
pub struct HostConfig {
    pub addr: SocketAddr,
    pub subnqn: String,
    pub hostnqn: String,
    pub hostid: [u8; 16],
    pub device: Selector,
    /// I/O queue depth (command slots).
    pub io_depth: u16,
    /// Largest transfer of one I/O command, bytes.
    pub max_io: u32,
    /// Keep-alive timeout sent in the admin Connect (0 = off).
    pub kato_ms: u32,
    /// Namespace to use; 0 = the first active one.
    pub nsid: u32,
    pub timeout: Duration,
}

impl HostConfig {
    /// Defaults for `addr` / `subnqn`: a random host ID and the UUID-based host NQN from it.
    pub fn new(addr: SocketAddr, subnqn: &str) -> HostConfig {
        let hostid: [u8; 16] = rand::random();
        HostConfig {
            addr,
            subnqn: subnqn.to_string(),
            hostnqn: Nqn::from_uuid(&hostid).as_str().to_string(),
            hostid,
            device: Selector::Any,
            io_depth: 32,
            max_io: 128 * 1024,
            kato_ms: 0,
            nsid: 0,
            timeout: Duration::from_secs(10),
        }
    }
}

/// A connected controller with one I/O queue and one namespace in use.
pub struct HwController {
    pub io: HwQueue,
    admin: HwQueue,
    pub events: AsyncEvents,
    pub dev: HwDevice,
    pub cntlid: u16,
    pub cap: Cap,
    pub ctrl: IdentifyController,
    pub ns: IdentifyNamespace,
    pub nsid: u32,
    pub block_size: u32,
    pub blocks: u64,
    kato: Option<Duration>,
    last_ka: Instant,
    ka_cid: Option<u16>,
    timeout: Duration,
}

fn check(what: &'static str, cqe: &Cqe) -> Result<(), HwError> {
    let status = cqe.nvme_status();
    if status.is_success() {
        Ok(())
    } else {
        Err(HwError::Nvme { what, status })
    }
}

async fn resolve(addr: SocketAddr, timeout: Duration) -> Result<(CmId, Guid), HwError> {
    let cm = CmId::new()?;
    cm.resolve(addr, timeout).await?;
    let guid = cm
        .device_guid()
        .ok_or_else(|| HwError::NoSuchDevice(format!("rdma_cm bound {addr} to no device")))?;
    Ok((cm, guid))
}

impl HwController {
    /// Connect the admin queue, enable the controller, identify it and the namespace, and
    /// connect one I/O queue.
    pub async fn connect(cfg: &HostConfig) -> Result<HwController, HwError> {
        let subnqn = Nqn::new(&cfg.subnqn)?;
        let hostnqn = Nqn::new(&cfg.hostnqn)?;
        let (cm, guid) = resolve(cfg.addr, cfg.timeout).await?;
        let dev = match &cfg.device {
            Selector::Any => HwDevice::open(&Selector::Guid(guid))?,
            sel => {
                let d = HwDevice::open(sel)?;
                if d.info().guid != guid {
                    return Err(HwError::WrongDevice {
                        want: d.info().to_string(),
                        got: format!("guid {guid}"),
                    });
                }
                d
            }
        };
        let events = AsyncEvents::new(&dev)?;
        let mut admin = HwQueue::connect(
            &dev,
            cm,
            QueueConfig {
                qid: 0,
                depth: ADMIN_DEPTH,
                max_io: 4096,
                timeout: cfg.timeout,
            },
        )
        .await?;
        let t = cfg.timeout;
        let data = ConnectData {
            hostid: cfg.hostid,
            cntlid: CNTLID_DYNAMIC,
            subnqn,
            hostnqn,
        };
        let cntlid = fabrics_connect(&mut admin, 0, ADMIN_DEPTH - 1, cfg.kato_ms, &data, t).await?;

        let cap = Cap(prop_get(&mut admin, reg::CAP, t).await?);
        prop_set(&mut admin, reg::CC, u64::from(Cc::enable_default().0), t).await?;
        let ready_by = Instant::now() + Duration::from_millis(u64::from(cap.timeout_ms().max(500)));
        loop {
            let csts = Csts(prop_get(&mut admin, reg::CSTS, t).await? as u32);
            if csts.cfs() {
                return Err(HwError::ControllerFatal);
            }
            if csts.rdy() {
                break;
            }
            if Instant::now() > ready_by {
                return Err(HwError::Timeout("CSTS.RDY after CC.EN"));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }

        let cqe = admin.exec(admin::identify_controller(0), 4096, t).await?;
        check("Identify Controller", &cqe)?;
        let ctrl = IdentifyController::parse(admin.data(cqe.cid, 4096))?;
        let nsid = if cfg.nsid != 0 {
            cfg.nsid
        } else {
            let cqe = admin
                .exec(admin::identify_active_namespaces(0, 0), 4096, t)
                .await?;
            check("Identify Active Namespaces", &cqe)?;
            active_namespace_ids(admin.data(cqe.cid, 4096))
                .next()
                .ok_or_else(|| HwError::Invalid("the subsystem has no active namespace".into()))?
        };
        let cqe = admin
            .exec(admin::identify_namespace(0, nsid), 4096, t)
            .await?;
        check("Identify Namespace", &cqe)?;
        let ns = IdentifyNamespace::parse(admin.data(cqe.cid, 4096))?;
        let block_size = ns
            .block_size()
            .ok_or_else(|| HwError::Invalid(format!("namespace {nsid}: unusable LBA format")))?;
        let blocks = ns.nsze;
        if blocks == 0 {
            return Err(HwError::Invalid(format!(
                "namespace {nsid} is empty or inactive"
            )));
        }
        // Largest transfer: ours, capped by MDTS.
        let mut max_io = cfg.max_io;
        if let Some(m) = ctrl.max_transfer_bytes(cap.min_page_size()) {
            max_io = max_io.min(u32::try_from(m).unwrap_or(u32::MAX));
        }
        let io_depth = cfg.io_depth.clamp(2, cap.mqes().saturating_add(1).max(2));

        let (cm_io, guid_io) = resolve(cfg.addr, cfg.timeout).await?;
        if guid_io != guid {
            return Err(HwError::WrongDevice {
                want: format!("guid {guid}"),
                got: format!("guid {guid_io}"),
            });
        }
        let mut io = HwQueue::connect(
            &dev,
            cm_io,
            QueueConfig {
                qid: 1,
                depth: io_depth,
                max_io,
                timeout: cfg.timeout,
            },
        )
        .await?;
        let data = ConnectData { cntlid, ..data };
        let io_cntlid = fabrics_connect(&mut io, 1, io_depth - 1, 0, &data, t).await?;
        if io_cntlid != cntlid {
            return Err(HwError::Invalid(format!(
                "I/O queue joined controller {io_cntlid}, admin is {cntlid}"
            )));
        }
        Ok(HwController {
            io,
            admin,
            events,
            dev,
            cntlid,
            cap,
            ctrl,
            ns,
            nsid,
            block_size,
            blocks,
            kato: (cfg.kato_ms > 0).then(|| Duration::from_millis(u64::from(cfg.kato_ms))),
            last_ka: Instant::now(),
            ka_cid: None,
            timeout: cfg.timeout,
        })
    }

    /// Housekeeping between I/Os, never blocking: send a Keep Alive every KATO/2, reap its
    /// completion, and surface a pending device async event as an error when it is fatal
    /// (DEVICE_FATAL); others (PORT_ERR, GID_CHANGE, ...) are logged, the QP decides.
    pub fn tick(&mut self) -> Result<(), HwError> {
        if let Some(ev) = self.events.try_next()? {
            use super::map::HwEvent;
            use crate::hca::AsyncEvent;
            tracing::warn!(?ev, device = %self.dev.info(), "async event");
            if matches!(
                ev,
                HwEvent::Known(AsyncEvent::DeviceFatal | AsyncEvent::DeviceRemoved)
            ) {
                return Err(HwError::DeviceEvent(ev));
            }
        }
        self.admin.poll()?;
        while let Some(d) = self.admin.take() {
            if Some(d.cid) == self.ka_cid {
                self.ka_cid = None;
                check("Keep Alive", &d.cqe)?;
            }
        }
        if let Some(k) = self.kato {
            if self.ka_cid.is_none() && self.last_ka.elapsed() >= k / 2 {
                let cid = self
                    .admin
                    .free_slot()
                    .ok_or_else(|| HwError::Invalid("admin queue full".into()))?;
                self.admin.submit(admin::keep_alive(0), cid, 0)?;
                self.ka_cid = Some(cid);
                self.last_ka = Instant::now();
            }
        }
        Ok(())
    }

    /// Blocks per I/O of `bytes` bytes, checked against the namespace and the queue.
    pub fn blocks_for(&self, bytes: u32) -> Result<u32, HwError> {
        if bytes == 0 || bytes % self.block_size != 0 || bytes > self.io.max_io() {
            return Err(HwError::Invalid(format!(
                "I/O size {bytes} (block size {}, max {})",
                self.block_size,
                self.io.max_io()
            )));
        }
        Ok(bytes / self.block_size)
    }

    /// Submit a read of `bytes` at `slba` in I/O slot `cid`.
    pub fn submit_read(&mut self, cid: u16, slba: u64, bytes: u32) -> Result<(), HwError> {
        let n = self.blocks_for(bytes)?;
        self.check_range(slba, n)?;
        let sqe = admin::read(cid, self.nsid, slba, n)?;
        self.io.submit(sqe, cid, bytes)
    }

    /// Submit a write of the first `bytes` of slot `cid`'s buffer to `slba`.
    pub fn submit_write(&mut self, cid: u16, slba: u64, bytes: u32) -> Result<(), HwError> {
        let n = self.blocks_for(bytes)?;
        self.check_range(slba, n)?;
        let sqe = admin::write(cid, self.nsid, slba, n, false)?;
        self.io.submit(sqe, cid, bytes)
    }

    fn check_range(&self, slba: u64, n: u32) -> Result<(), HwError> {
        match slba.checked_add(u64::from(n)) {
            Some(end) if end <= self.blocks => Ok(()),
            _ => Err(HwError::Invalid(format!(
                "LBA {slba}+{n} beyond namespace end {}",
                self.blocks
            ))),
        }
    }

    /// Orderly shutdown: CC.SHN = normal, wait for CSTS.SHST complete, disconnect both queues.
    pub async fn shutdown(mut self) -> Result<(), HwError> {
        let t = self.timeout;
        while self.admin.busy() > 0 {
            self.admin.wait().await?;
            while self.admin.take().is_some() {}
        }
        let cc = Cc::enable_default().with_shn(1);
        prop_set(&mut self.admin, reg::CC, u64::from(cc.0), t).await?;
        let by = Instant::now() + Duration::from_secs(5);
        while Csts(prop_get(&mut self.admin, reg::CSTS, t).await? as u32).shst() != 2 {
            if Instant::now() > by {
                return Err(HwError::Timeout("CSTS.SHST after CC.SHN"));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let _ = self.io.disconnect();
        let _ = self.admin.disconnect();
        Ok(())
    }
}

async fn fabrics_connect(
    q: &mut HwQueue,
    qid: u16,
    sqsize: u16,
    kato_ms: u32,
    data: &ConnectData,
    t: Duration,
) -> Result<u16, HwError> {
    let cid = q
        .free_slot()
        .ok_or_else(|| HwError::Invalid("queue full".into()))?;
    q.data_mut(cid, ConnectData::LEN)
        .copy_from_slice(&data.to_bytes());
    let sqe = FabricsCmd::Connect {
        recfmt: RECFMT_0,
        qid,
        sqsize,
        cattr: 0,
        kato_ms,
    }
    .to_sqe(cid);
    let cqe = q.exec(sqe, ConnectData::LEN as u32, t).await?;
    match ConnectResult::from_result(cqe.result, cqe.nvme_status().is_success()) {
        ConnectResult::Ok { cntlid, .. } => Ok(cntlid),
        ConnectResult::InvalidParameter { .. } => Err(HwError::Nvme {
            what: "Fabrics Connect",
            status: cqe.nvme_status(),
        }),
    }
}

async fn prop_get(q: &mut HwQueue, offset: u32, t: Duration) -> Result<u64, HwError> {
    let cqe = q.exec(FabricsCmd::get(offset).to_sqe(0), 0, t).await?;
    check("Property Get", &cqe)?;
    Ok(cqe.result)
}

async fn prop_set(q: &mut HwQueue, offset: u32, value: u64, t: Duration) -> Result<(), HwError> {
    let cqe = q
        .exec(FabricsCmd::set(offset, value).to_sqe(0), 0, t)
        .await?;
    check("Property Set", &cqe)
}

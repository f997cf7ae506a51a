//! Bring-up: the first connect of a controller, and each reconnect attempt of recovery on
//! the same buffers (device opened, a new PD, admin queue connected and the controller
//! enabled, Set Features Number of Queues, I/O queues connected).

use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, watch};

use crate::cm::{ConnectParams, NvmeCmRequest};
use crate::nvme::admin;
use crate::nvme::fabrics::{self, ConnectResult, CNTLID_DYNAMIC};
use crate::nvme::{Cap, Cc, ConnectData, Csts, FabricsCmd, IdentifyController, Nqn, Sqe};
use crate::reconnect::{Event, Machine};
use crate::verbs::{
    CmPort, DeviceContext, DeviceSource, Instant, Lifecycle, Opened, PdId, PeerInfo,
};

use super::controller::Controller;
use super::fixed::Fixed;
use super::inbox::Inbox;
use super::namespaces::{identify_namespaces, rescan_after_reconnects, NsTable};
use super::options::{inline_depth_for, ConnectOptions};
use super::queue::{self, Clock, QueueCore, QueueSpec};
use super::recovery::{CtrlMetrics, DevCtx, EventQueue, Supervisor};
use super::saferetry::{ccr_task, Assoc, SafeExec, SafeShared};
use super::state::{bounded_admin, CtrlShared, CtrlStatus, DevShared, RecoveryTrace};
use super::HostError;

impl<S: DeviceSource> Supervisor<S> {
    /// Open the device for an attempt: a new CM service on a new context.
    pub(super) fn open_device(&mut self) -> Result<(), HostError> {
        if self
            .dev
            .as_ref()
            .is_some_and(|d| d.dev.lifecycle() == Lifecycle::Live)
        {
            return Ok(());
        }
        self.dev = None;
        let Some(Opened { dev, identity, .. }) = self.devs.source.open(&self.devs.name) else {
            return Err(HostError::Step("device is not present"));
        };
        if !self.sm.policy().identity.accepts(&self.ours, &identity) {
            return Err(HostError::Transport(
                "a different device took our place".into(),
            ));
        }
        let cm = self.devs.source.cm(&dev);
        *self.devs.current.lock().unwrap_or_else(|e| e.into_inner()) = dev.clone();
        self.dev = Some(DevCtx { dev, cm, pd: None });
        Ok(())
    }

    /// A new PD on the current context.
    fn alloc_pd(&mut self) -> Result<PdId, HostError> {
        let d = self.dev.as_mut().ok_or(HostError::Step("no device"))?;
        if let Some(pd) = d.pd {
            return Ok(pd);
        }
        let pd = d.dev.alloc_pd()?;
        d.pd = Some(pd);
        Ok(pd)
    }

    /// Connect queue `qi` (0 = admin): verbs over the same buffers, CM, Fabrics Connect on
    /// the reserved slot.
    pub(super) async fn connect_queue(&mut self, qi: usize) -> Result<(), HostError> {
        let pd = self.alloc_pd()?;
        let (dev, cm) = match &self.dev {
            Some(d) => (d.dev.clone(), d.cm.clone()),
            None => return Err(HostError::Step("no device")),
        };
        let ctl = self.queue(qi);
        let qpn = ctl.lock().attach(&dev, pd)?;
        ctl.poke();
        let spec = ctl.lock().spec;
        let mut params = ConnectParams::new(qpn, self.opts.trsvcid);
        params.path_mtu = self.opts.mtu;
        let cntlid = if qi == 0 { CNTLID_DYNAMIC } else { self.cntlid };
        let private = NvmeCmRequest {
            qid: spec.qid,
            hrqsize: spec.size as u16,
            hsqsize: spec.size as u16 - 1,
            cntlid,
        }
        .emit();
        let est = cm
            .connect(
                self.opts.traddr,
                params,
                &private,
                self.opts.connect_timeout,
            )
            .await?;
        self.conns[qi] = Some(est.id);
        self.shared.inbox.connected(qi, est.id);
        if qi == 0 {
            self.trace.admin_cm = Some(self.now());
        }
        cm.watch(est.id, self.disc_tx.clone());
        let peer = PeerInfo {
            addr: est.peer,
            qpn: est.remote_qpn,
            psn: est.remote_psn,
        };
        ctl.lock().connected(peer, est.local_psn)?;
        ctl.poke();
        self.connect_data[16..18].copy_from_slice(&cntlid.to_le_bytes());
        let kato_ms = if qi == 0 {
            self.opts.keep_alive_tmo.as_millis().min(u32::MAX as u128) as u32
        } else {
            0
        };
        let sqe = FabricsCmd::Connect {
            recfmt: fabrics::RECFMT_0,
            qid: spec.qid,
            sqsize: spec.size as u16 - 1,
            cattr: 0,
            kato_ms,
        }
        .to_sqe(0);
        let cqe = ctl
            .control(sqe, &self.connect_data, 0, self.opts.connect_timeout)
            .await?;
        match ConnectResult::from_result(cqe.result, true) {
            ConnectResult::Ok { cntlid, .. } => {
                if qi == 0 {
                    self.cntlid = cntlid;
                }
                Ok(())
            }
            ConnectResult::InvalidParameter { ipo, iattr } => Err(HostError::Connect(format!(
                "Connect refused parameter at offset {ipo} (attr {iattr})"
            ))),
        }
    }

    async fn admin_cmd(&self, sqe: Sqe) -> Result<u64, HostError> {
        let cqe = self
            .admin
            .control(sqe, &[], 0, self.opts.connect_timeout)
            .await?;
        Ok(cqe.result)
    }

    /// Connect the admin queue and enable the controller (CC.EN, wait for CSTS.RDY).
    pub(super) async fn connect_admin(&mut self) -> Result<Cap, HostError> {
        self.connect_queue(0).await?;
        let cap = Cap(self
            .admin_cmd(FabricsCmd::get(fabrics::reg::CAP).to_sqe(0))
            .await?);
        self.admin_cmd(FabricsCmd::set(fabrics::reg::CC, Cc::enable_default().0 as u64).to_sqe(0))
            .await?;
        let deadline =
            tokio::time::Instant::now() + Duration::from_millis(cap.timeout_ms().max(500) as u64);
        let mut pause = Duration::from_millis(1);
        loop {
            let csts = Csts(
                self.admin_cmd(FabricsCmd::get(fabrics::reg::CSTS).to_sqe(0))
                    .await? as u32,
            );
            if csts.cfs() {
                return Err(HostError::Step("controller fatal status while enabling"));
            }
            if csts.rdy() {
                return Ok(cap);
            }
            if tokio::time::Instant::now() > deadline {
                return Err(HostError::Step(
                    "controller did not become ready (CSTS.RDY)",
                ));
            }
            // CAP.TO is the bound; poll quickly first, then back off.
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(50));
        }
    }

    /// Set Features Number of Queues; how many I/O queues the controller grants.
    pub(super) async fn negotiate_queues(&self, want: u32) -> Result<u32, HostError> {
        let dw0 = self
            .admin_cmd(admin::set_num_queues(0, want, want)?)
            .await? as u32;
        let (sq, cq) = admin::num_queues_allocated(dw0);
        Ok(want.min(sq).min(cq))
    }

    /// Identify the controller of the new association on the reserved slot, into memory
    /// sized at connect: safe retry names it in a CCR should this association die too.
    async fn identify_association(&mut self) -> Result<(), HostError> {
        self.admin
            .control(
                admin::identify_controller(0),
                &[],
                IdentifyController::LEN,
                self.opts.connect_timeout,
            )
            .await?;
        self.admin.lock().control_data(&mut self.ident_buf[..]);
        let id = IdentifyController::parse(&self.ident_buf[..])
            .map_err(|_| HostError::Step("Identify Controller data too short"))?;
        self.safe.next = Some(Assoc::of(&id));
        Ok(())
    }

    /// A reconnect attempt: admin, then the I/O queues, on the same buffers.
    pub(super) async fn reconnect(&mut self) -> Result<(), HostError> {
        self.trace.attempt_start = Some(self.now());
        self.open_device()?;
        self.trace.device_open = Some(self.now());
        self.connect_admin().await?;
        self.trace.admin_ready = Some(self.now());
        self.identify_association().await?;
        if self.nr_io > 0 {
            let n = self.negotiate_queues(self.nr_io as u32).await?;
            if (n as usize) < self.nr_io {
                return Err(HostError::Step(
                    "the controller now grants fewer I/O queues",
                ));
            }
            for qi in 1..=self.nr_io {
                self.connect_queue(qi).await?;
            }
        }
        Ok(())
    }
}

impl Controller {
    /// Connect admin and I/O queues to `o.subnqn` through one device context and identify
    /// the controller. Recovery works for CM disconnects and keep-alive loss; if the device
    /// itself dies the controller waits for ctrl_loss_tmo (use [`Controller::connect_managed`]
    /// to survive resets and re-plugs).
    pub async fn connect<D: DeviceContext>(
        dev: D,
        cm: D::Cm,
        o: ConnectOptions,
    ) -> Result<Controller, HostError> {
        // The context is ours even if it is already dead: bring-up then fails on it.
        let first = Some(dev.clone());
        Self::connect_with(Fixed::new(dev, cm), String::new(), first, o).await
    }

    /// Connect through device `name` of `source`, and come back through it after resets and
    /// re-plugs.
    pub async fn connect_managed<S: DeviceSource>(
        source: S,
        name: &str,
        o: ConnectOptions,
    ) -> Result<Controller, HostError> {
        let first = source.open(name).map(|d| d.dev);
        Self::connect_with(source, name.to_string(), first, o).await
    }

    /// The controller and its supervisor before bring-up: options checked, the admin queue's
    /// memory allocated, nothing connected. Also the CM's disconnect channel for the
    /// supervisor, and whether this is a discovery controller.
    #[allow(clippy::type_complexity)]
    fn assemble<S: DeviceSource>(
        source: S,
        name: String,
        first: Option<S::Device>,
        o: ConnectOptions,
    ) -> Result<
        (
            Controller,
            Supervisor<S>,
            mpsc::UnboundedReceiver<crate::cm::ConnId>,
            bool,
        ),
        HostError,
    > {
        // Refuse bad options before a connection exists that an early return would leak.
        let (subnqn, hostnqn) = check_options(&o)?;
        let discovery = subnqn.is_discovery();
        let clock = Clock(tokio::time::Instant::now());
        let inbox = Arc::new(Inbox::new(o.nr_io_queues + 1));
        let (admin_h, admin_ctl) = admin_queue::<S::Device>(&o, &inbox, clock)?;
        let Some(first) = first else {
            return Err(HostError::Connect(
                "no such device, or it is not live".into(),
            ));
        };
        let ours = first.identity();
        let mut policy = o.policy;
        policy.keep_alive_tmo = if discovery {
            Duration::ZERO
        } else {
            o.keep_alive_tmo
        };
        let safe = Arc::new(SafeShared::new(o.safe_retry));
        let shared = Arc::new(CtrlShared {
            inbox,
            safe: safe.clone(),
            status: watch::channel(CtrlStatus {
                machine: Machine::new(policy, ours).status(Instant(0)),
                cntlid: 0,
                at: Instant(0),
                last_recovery: None,
                last_trace: None,
            })
            .0,
            clock,
        });
        let devs = Arc::new(DevShared {
            source,
            name,
            current: Mutex::new(first),
        });
        let (disc_tx, disc_rx) = mpsc::unbounded_channel();
        let connect_data = ConnectData {
            hostid: o.hostid,
            cntlid: CNTLID_DYNAMIC,
            subnqn,
            hostnqn,
        }
        .to_bytes();
        let sup = Supervisor {
            sm: Machine::new(policy, ours),
            clock,
            devs: devs.clone(),
            dev: None,
            ours,
            admin: admin_ctl,
            io: Vec::new(),
            conns: vec![None; o.nr_io_queues + 1],
            connect_data,
            shared: shared.clone(),
            disc_tx,
            cntlid: 0,
            nr_io: 0,
            trace: RecoveryTrace::default(),
            last_recovery: None,
            last_trace: None,
            metrics: CtrlMetrics::new(&o.subnqn),
            safe: SafeExec::new(safe, 0, &o.subnqn),
            ident_buf: Box::new([0; 4096]),
            opts: o.clone(),
        };
        let c = Controller {
            cntlid: 0,
            opts: o,
            ident: IdentifyController::default(),
            admin: admin_h,
            io: Vec::new(),
            namespaces: Arc::new(NsTable::new()),
            rescans: None,
            ccr: None,
            next: AtomicUsize::new(0),
            max_io: 0,
            shared,
            backing: devs,
            sup: None,
        };
        Ok((c, sup, disc_rx, discovery))
    }

    /// Connect through `name` of `source`, starting on context `first`.
    async fn connect_with<S: DeviceSource>(
        source: S,
        name: String,
        first: Option<S::Device>,
        o: ConnectOptions,
    ) -> Result<Controller, HostError> {
        let (mut c, mut sup, disc_rx, discovery) = Self::assemble(source, name, first, o)?;
        let clock = sup.clock;
        // Bring-up runs under the rules of recovery: each step has a deadline, and a failure
        // of the connection under it (device reset, transport error, I/O timeout) ends it
        // at once. Nobody is recovering this controller yet, so that is a failed connect,
        // as in Linux, with the cause; never a command held for a recovery that never comes.
        let watch = sup.shared.clone();
        // Biased (a simulated run must replay), the failure first: a connection that failed
        // while its bring-up finished is a failed connect.
        let r = tokio::select! {
            biased;
            cause = watch.inbox.failed() => Err(HostError::Connect(format!(
                "the connection failed while it was being set up ({}); nothing is connected, \
                 try again",
                cause.name()
            ))),
            r = c.bring_up(&mut sup, discovery) => r,
        };
        let now = clock.now();
        if let Err(e) = r {
            let acts = sup.sm.handle(now, Event::ConnectFailed);
            let mut q = EventQueue::default();
            for a in acts.iter() {
                sup.execute(a, &mut q).await;
            }
            return Err(e);
        }
        sup.sm.handle(now, Event::Connected);
        c.cntlid = sup.cntlid;
        // The hold table has room for every command the queues can hold.
        let slots = sup.all_queues().map(|q| q.lock().spec.size).sum();
        sup.safe = SafeExec::new(sup.shared.safe.clone(), slots, &c.opts.subnqn);
        sup.shared.safe.set_current(Some(Assoc::of(&c.ident)));
        sup.publish();
        if !discovery {
            // Beside the recovery path, after it, as the rescan: its commands allocate.
            c.ccr = Some(tokio::spawn(crate::harness::alloc_audit::after_recovery(
                ccr_task(
                    c.admin.clone(),
                    clock,
                    sup.shared.safe.clone(),
                    sup.shared.inbox.clone(),
                ),
            )));
            c.rescans = Some(tokio::spawn(crate::harness::alloc_audit::after_recovery(
                rescan_after_reconnects(
                    c.admin.clone(),
                    c.opts.connect_timeout,
                    c.namespaces.clone(),
                    c.watch_status(),
                    c.opts.subnqn.clone(),
                ),
            )));
        }
        c.sup = Some(tokio::spawn(sup.run(disc_rx)));
        Ok(c)
    }

    async fn bring_up<S: DeviceSource>(
        &mut self,
        sup: &mut Supervisor<S>,
        discovery: bool,
    ) -> Result<(), HostError> {
        sup.open_device()?;
        let cap = sup.connect_admin().await?;
        sup.admin.lock().resume(sup.now());
        let r = self
            .bring_up_cmd(admin::identify_controller(0), 4096)
            .await?;
        self.ident =
            IdentifyController::parse(&r.data).map_err(|e| HostError::Protocol(e.to_string()))?;
        self.max_io = self.opts.max_io;
        if let Some(m) = self.ident.max_transfer_bytes(cap.min_page_size()) {
            self.max_io = self.max_io.min(m as usize);
        }
        if discovery {
            return Ok(());
        }
        let inline = (self.ident.in_capsule_data_bytes() as usize).min(16 << 10);
        let n = sup
            .negotiate_queues(self.opts.nr_io_queues as u32)
            .await?
            .max(1);
        let size = (cap.max_queue_entries() as usize).min(self.opts.queue_size);
        let inline_depth = self.opts.inline_depth.unwrap_or_else(|| {
            let in_memory = sup
                .dev
                .as_ref()
                .is_some_and(|d| d.dev.reaches_in_memory(self.opts.traddr));
            inline_depth_for(self.opts.traddr, in_memory)
        });
        for qid in 1..=n as u16 {
            let spec = QueueSpec {
                qid,
                size,
                inline,
                inline_depth,
                max_io: self.max_io,
                mtu: self.opts.mtu,
            };
            let core = QueueCore::new(
                spec,
                sup.shared.inbox.clone(),
                self.opts.io_timeout,
                self.opts.max_retries,
            )?;
            let (h, ctl, _task) = queue::spawn(core, sup.clock);
            sup.io.push(ctl);
            self.io.push(h);
            sup.nr_io = sup.io.len();
            sup.connect_queue(qid as usize).await?;
            sup.io[qid as usize - 1].lock().resume(sup.now());
        }
        let ns = identify_namespaces(&self.admin, self.opts.connect_timeout).await?;
        *self
            .namespaces
            .list
            .write()
            .unwrap_or_else(|e| e.into_inner()) = ns;
        Ok(())
    }

    /// An admin command of bring-up, bounded by `connect_timeout`.
    async fn bring_up_cmd(&self, sqe: Sqe, data_in: usize) -> Result<queue::Response, HostError> {
        bounded_admin(&self.admin, self.opts.connect_timeout, sqe, data_in).await
    }
}

/// Options a controller cannot be made with; the subsystem and host NQNs.
fn check_options(o: &ConnectOptions) -> Result<(Nqn, Nqn), HostError> {
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
    Ok((Nqn::new(&o.subnqn)?, Nqn::new(&o.hostnqn)?))
}

/// The admin queue's memory and task; nothing is connected.
fn admin_queue<D: DeviceContext>(
    o: &ConnectOptions,
    inbox: &Arc<Inbox>,
    clock: Clock,
) -> Result<(queue::QueueHandle, queue::QueueCtl<D>), HostError> {
    let spec = QueueSpec {
        qid: 0,
        size: 32,
        inline: 0,
        inline_depth: 0,
        max_io: 64 << 10,
        mtu: o.mtu,
    };
    let core: QueueCore<D> = QueueCore::new(spec, inbox.clone(), o.io_timeout, o.max_retries)?;
    let (handle, ctl, _task) = queue::spawn(core, clock);
    Ok((handle, ctl))
}

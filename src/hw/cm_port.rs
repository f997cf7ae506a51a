//! rdma_cm as a context's connection manager behind the backend seam
//! ([`crate::verbs::CmPort`], [`crate::verbs::CmListen`]), over our FFI in [`super::cm`].
//! Every connection of a context dies with it.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::sync::mpsc;

use super::cm::{ev, CmId, ConnRequest, ListenEvent};
use super::context::{Conn, Ctx, Pending, REMOVED};
use super::map::mtu_of;
use super::HwError;
use crate::cm::private::{NvmeCmAccept, NvmeCmReject, NvmeCmRequest, NvmeRejectStatus};
use crate::cm::{AcceptParams, ConnId, ConnectParams, Established};
use crate::harness::alloc_audit;
use crate::verbs::{
    CmError, CmListen, CmPort, Guid, Incoming, PeerInfo, Psn, Qpn, INCOMING_BACKLOG,
};

/// The next [`ConnId`] of any context of this process.
static NEXT_CONN: AtomicU32 = AtomicU32::new(1);

/// The rdma_cm side of one context. Cheap to clone.
#[derive(Clone)]
pub struct HwCm {
    pub(super) ctx: Arc<Ctx>,
}

/// Read one connection's events until it ends or is forgotten: DISCONNECTED (or, on the
/// passive side, a request that never became a connection) breaks it and forgets it,
/// DEVICE_REMOVAL kills the context (which destroys every id on the device, as the kernel
/// waits for).
async fn watch_conn(conn: Arc<Conn>, ctx: Weak<Ctx>) {
    loop {
        let e = tokio::select! {
            e = conn.id.event(Duration::from_secs(24 * 3600), "connection event") => e,
            _ = conn.closed.notified() => return,
        };
        let Some(c) = ctx.upgrade() else { return };
        let broken = match e {
            Ok(e) if e.kind == ev::DEVICE_REMOVAL => {
                c.kill(REMOVED);
                return;
            }
            Ok(e)
                if matches!(
                    e.kind,
                    ev::DISCONNECTED | ev::CONNECT_ERROR | ev::UNREACHABLE | ev::REJECTED
                ) =>
            {
                tracing::debug!(device = %c.info.name, "rdma_cm event {}", e.name());
                true
            }
            Ok(e) => {
                tracing::debug!(device = %c.info.name, "rdma_cm event {}", e.name());
                if e.kind == ev::ESTABLISHED {
                    let tx = conn
                        .on_established
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .take();
                    if let Some(tx) = tx {
                        let _ = tx.send(conn.conn_id);
                    }
                }
                false
            }
            Err(HwError::CmTimeout(_)) => false,
            Err(_) => true,
        };
        if broken {
            conn.report();
            // Its owner learns it from the report; the id goes once nobody holds it.
            c.conns
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&conn.conn_id.0);
            return;
        }
    }
}

/// A resolution failure that a neighbour or route still being learned explains.
fn resolve_transient(e: &HwError) -> bool {
    match e {
        HwError::Verbs { source, .. } => matches!(
            source.raw_os_error(),
            Some(libc::ENXIO | libc::ENODATA | libc::EHOSTUNREACH | libc::ETIMEDOUT)
        ),
        HwError::CmUnexpected { got, .. } => matches!(*got, "ADDR_ERROR" | "ROUTE_ERROR"),
        _ => false,
    }
}

fn refused(e: HwError) -> CmError {
    match e {
        HwError::Rejected {
            nvme: Some(s),
            status,
        } => CmError::Refused(format!(
            "the target refused the connection: {} (rdma_cm reject reason {status})",
            s.message()
        )),
        HwError::Rejected { status, .. } => CmError::Refused(format!(
            "the target refused the connection (rdma_cm reject reason {status}; 8 means no \
             listener on that port)"
        )),
        e => CmError::Refused(e.to_string()),
    }
}

impl HwCm {
    /// An id bound to this context's device, port 1, with a route to `peer`.
    async fn resolve(&self, peer: SocketAddr, timeout: Duration) -> Result<CmId, CmError> {
        let ctx = &self.ctx;
        // Address and route resolution can fail while the neighbour entry is still being
        // learned (first contact: ENXIO / ENODATA from rdma_resolve_route, or an
        // ADDR_ERROR / ROUTE_ERROR event); such a failure is retried with a fresh id until
        // the attempt's deadline, as the kernel host's own retries would.
        let deadline = tokio::time::Instant::now() + timeout;
        let id = loop {
            let id = alloc_audit::platform(CmId::new).map_err(refused)?;
            match id.resolve(peer, timeout).await {
                Ok(()) => break id,
                Err(e) if resolve_transient(&e) && tokio::time::Instant::now() < deadline => {
                    tracing::debug!("rdma_cm resolve of {peer}: {e}; again");
                    drop(id);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => return Err(refused(e)),
            }
        };
        match id.device_guid() {
            Some(g) if g == ctx.identity.guid => {}
            Some(g) => {
                return Err(CmError::Refused(format!(
                    "{peer} is reached through RDMA device guid {g}, not {} ({}); pick that \
                     device with --device",
                    ctx.info.name, ctx.identity.guid
                )))
            }
            None => return Err(CmError::Refused("rdma_cm bound no device".into())),
        }
        if id.port() != 1 {
            return Err(CmError::Refused(format!(
                "{peer} is reached through port {} of {}; only port 1 is supported",
                id.port(),
                ctx.info.name
            )));
        }
        Ok(id)
    }

    async fn connect_inner(
        &self,
        peer: SocketAddr,
        params: ConnectParams,
        private: &[u8],
        timeout: Duration,
    ) -> Result<Established, CmError> {
        let ctx = &self.ctx;
        // rdma_cm addresses the listener by IP and service port (NVMe-oF: 4420); `peer` is
        // the target's RoCEv2 address as the soft-HCA names it (UDP port 4791).
        let peer = SocketAddr::new(peer.ip(), params.service_port);
        let id = self.resolve(peer, timeout).await?;
        let ev = id
            .request(
                params.local_qpn.get(),
                private,
                params.responder_resources,
                params.initiator_depth,
                timeout,
            )
            .await
            .map_err(refused)?;
        let attrs = alloc_audit::platform(|| -> Result<_, HwError> {
            Ok((id.qp_attr(1)?, id.qp_attr(2)?, id.qp_attr(3)?))
        })
        .map_err(refused)?;
        let (init, rtr, rts) = attrs;
        let r = (
            rtr.0.dest_qp_num,
            rtr.0.rq_psn,
            rtr.0.max_dest_rd_atomic,
            rtr.0.path_mtu,
        );
        let t = (
            rts.0.sq_psn,
            rts.0.max_rd_atomic,
            rts.0.retry_cnt,
            rts.0.rnr_retry,
            rts.0.timeout,
        );
        let path = [init, rtr, rts];
        // Numbered across contexts: a late disconnect report of a dead context's connection
        // must not name a connection of its successor.
        let n = NEXT_CONN.fetch_add(1, Ordering::Relaxed);
        let conn = Arc::new(Conn::new(id, n, None));
        let registered = alloc_audit::platform(|| {
            let mut res = ctx.res();
            let Some(r) = res.as_mut() else {
                return Err(CmError::DeviceGone(
                    "the RDMA device went away while connecting",
                ));
            };
            let Some(q) = r.qps.get_mut(&params.local_qpn.get()) else {
                return Err(CmError::Refused("no such QP".into()));
            };
            q.pending = Some(Pending {
                path,
                establish: Some(conn.clone()),
            });
            self.spawn_watch(&conn);
            Ok(())
        });
        registered?;
        Ok(Established {
            id: ConnId(n),
            remote_id: ConnId(0),
            peer,
            remote_ca_guid: Guid::default(),
            remote_qpn: Qpn::new(r.0),
            remote_psn: Psn::new(r.1),
            local_psn: Psn::new(t.0),
            responder_resources: r.2,
            initiator_depth: t.1,
            retry_count: t.2,
            rnr_retry_count: t.3,
            path_mtu: mtu_of(r.3),
            target_ack_delay: 0,
            ack_timeout: t.4,
            accept: NvmeCmAccept::parse(&ev.private).ok(),
            private_data: ev.private,
        })
    }

    /// Forget connection `id`: its watcher lets go of it, and its id is destroyed once the
    /// caller drops what this returns.
    fn take(&self, id: ConnId) -> Option<Arc<Conn>> {
        let c = self
            .ctx
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id.0)?;
        c.closed.notify_one();
        Some(c)
    }

    fn conn(&self, id: ConnId) -> Option<Arc<Conn>> {
        self.ctx
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id.0)
            .cloned()
    }

    /// Watch `conn`'s events for as long as the context lives.
    fn spawn_watch(&self, conn: &Arc<Conn>) {
        self.ctx
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(conn.conn_id.0, conn.clone());
        let t = tokio::spawn(watch_conn(conn.clone(), Arc::downgrade(&self.ctx)));
        self.ctx
            .tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(t.abort_handle());
    }
}

impl CmPort for HwCm {
    async fn connect(
        &self,
        peer: SocketAddr,
        params: ConnectParams,
        private: &[u8],
        timeout: Duration,
    ) -> Result<Established, CmError> {
        if self.ctx.gone() {
            return Err(CmError::DeviceGone("the RDMA device is gone"));
        }
        // rdma_cm is the platform's connection manager, as the soft-HCA's CM is
        // (`CmService::connect`): what it allocates is not the host's.
        alloc_audit::Platform::new(async {
            let died = self.ctx.died.notified();
            tokio::pin!(died);
            died.as_mut().enable();
            tokio::select! {
                r = self.connect_inner(peer, params, private, timeout) => r,
                _ = &mut died => {
                    Err(CmError::DeviceGone("the RDMA device went away while connecting"))
                }
            }
        })
        .await
    }

    fn abort(&self, id: ConnId) {
        alloc_audit::platform(|| drop(self.take(id)))
    }

    fn disconnect(&self, id: ConnId) {
        alloc_audit::platform(|| {
            if let Some(c) = self.take(id) {
                let _ = c.id.disconnect();
            }
        })
    }

    fn watch(&self, id: ConnId, tx: mpsc::UnboundedSender<ConnId>) {
        alloc_audit::platform(|| {
            let conns = self.ctx.conns.lock().unwrap_or_else(|e| e.into_inner());
            match conns.get(&id.0) {
                Some(c) if !c.broken.load(Ordering::Acquire) => {
                    *c.watcher.lock().unwrap_or_else(|e| e.into_inner()) = Some(tx);
                }
                _ => {
                    let _ = tx.send(id);
                }
            }
        })
    }
}

/// Connection requests a listener may have waiting (`rdma_listen` backlog).
const LISTEN_BACKLOG: i32 = 128;

/// Serve a listening id until the context dies: each CONNECT_REQUEST becomes a connection
/// of the context, reported on `tx`; DEVICE_REMOVAL kills the context.
async fn serve_listen(cm: HwCm, id: CmId, tx: mpsc::Sender<Incoming>) {
    loop {
        let e = id.listen_event().await;
        if cm.ctx.gone() {
            return;
        }
        match e {
            Ok(ListenEvent::Request(r)) => {
                if let Some(inc) = alloc_audit::platform(|| cm.on_request(r)) {
                    match tx.try_send(inc) {
                        Ok(()) => {}
                        // The target is behind: refuse rather than queue without end.
                        Err(mpsc::error::TrySendError::Full(inc)) => {
                            tracing::debug!(device = %cm.ctx.info.name, "connection request refused: listener backlog full");
                            let rej = NvmeCmReject::new(NvmeRejectStatus::NoResources).emit();
                            CmListen::reject(&cm, inc.id, &rej);
                        }
                        Err(mpsc::error::TrySendError::Closed(_)) => return,
                    }
                }
            }
            Ok(ListenEvent::Other(e)) if e.kind == ev::DEVICE_REMOVAL => {
                cm.ctx.kill(REMOVED);
                return;
            }
            Ok(ListenEvent::Other(e)) => {
                tracing::debug!(device = %cm.ctx.info.name, "rdma_cm listener event {}", e.name())
            }
            // A request whose id could not be moved to a channel of its own was refused.
            Err(HwError::Verbs { call, source }) if call != "rdma_get_cm_event" => {
                tracing::warn!(device = %cm.ctx.info.name, "connection request refused: {call}: {source}")
            }
            Err(e) => {
                tracing::error!(device = %cm.ctx.info.name, "rdma_cm listener failed: {e}");
                return;
            }
        }
    }
}

impl HwCm {
    /// A connection request: on this context's device and port 1, with a path rdma_cm can
    /// give our QP, or refused here.
    fn on_request(&self, r: ConnRequest) -> Option<Incoming> {
        let name = &self.ctx.info.name;
        let refuse = |why: String| {
            tracing::warn!(device = %name, "connection request refused: {why}");
            let _ = r.id.reject(&[]);
        };
        if r.id.device_guid() != Some(self.ctx.identity.guid) || r.id.port() != 1 {
            refuse(format!(
                "it came in on device guid {:?} port {}, not port 1 of {name}",
                r.id.device_guid(),
                r.id.port()
            ));
            return None;
        }
        let path = match (r.id.qp_attr(1), r.id.qp_attr(2), r.id.qp_attr(3)) {
            (Ok(i), Ok(rtr), Ok(rts)) => [i, rtr, rts],
            (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => {
                refuse(format!("no QP path from rdma_cm: {e}"));
                return None;
            }
        };
        let [_, rtr, rts] = &path;
        let peer =
            r.id.peer_addr()
                .unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0)));
        let (qpn, psn) = (Qpn::new(rtr.0.dest_qp_num), Psn::new(rtr.0.rq_psn));
        let (local_psn, path_mtu) = (Psn::new(rts.0.sq_psn), mtu_of(rtr.0.path_mtu));
        let nvme = NvmeCmRequest::parse(&r.private);
        let n = NEXT_CONN.fetch_add(1, Ordering::Relaxed);
        let conn = Arc::new(Conn::new(r.id, n, Some(path)));
        self.spawn_watch(&conn);
        Some(Incoming {
            id: ConnId(n),
            peer: PeerInfo {
                addr: peer,
                qpn,
                psn,
            },
            local_psn,
            path_mtu,
            nvme,
        })
    }
}

impl CmListen for HwCm {
    fn listen(&self, at: SocketAddr) -> Result<mpsc::Receiver<Incoming>, CmError> {
        if self.ctx.gone() {
            return Err(CmError::DeviceGone("the RDMA device is gone"));
        }
        let name = &self.ctx.info.name;
        let id = alloc_audit::platform(|| -> Result<CmId, HwError> {
            let id = CmId::new()?;
            id.listen(at, LISTEN_BACKLOG)?;
            Ok(id)
        })
        .map_err(|e| CmError::Refused(format!("cannot listen on {at}: {e}")))?;
        match id.device_guid() {
            Some(g) if g != self.ctx.identity.guid => {
                return Err(CmError::Refused(format!(
                    "{} is an address of RDMA device guid {g}, not of {name}: listen on an \
                     address of {name}'s network interface",
                    at.ip()
                )))
            }
            // A wildcard address: requests through other devices are refused one by one.
            _ => {}
        }
        let (tx, rx) = mpsc::channel(INCOMING_BACKLOG);
        let t = tokio::spawn(serve_listen(self.clone(), id, tx));
        self.ctx
            .tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(t.abort_handle());
        Ok(rx)
    }

    fn attach(&self, id: ConnId, qpn: Qpn) -> Result<(), CmError> {
        alloc_audit::platform(|| {
            let conn = self
                .conn(id)
                .ok_or_else(|| CmError::Refused("the connection request is gone".into()))?;
            let path = conn
                .request
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take()
                .ok_or_else(|| CmError::Refused("the request is attached already".into()))?;
            let mut res = self.ctx.res();
            let r = res
                .as_mut()
                .ok_or(CmError::DeviceGone("the RDMA device is gone"))?;
            let q = r
                .qps
                .get_mut(&qpn.get())
                .ok_or_else(|| CmError::Refused("no such QP".into()))?;
            q.pending = Some(Pending {
                path,
                establish: None,
            });
            Ok(())
        })
    }

    fn accept(&self, id: ConnId, params: AcceptParams, private: &[u8]) -> Result<(), CmError> {
        alloc_audit::platform(|| {
            let conn = self
                .conn(id)
                .ok_or_else(|| CmError::Refused("the connection request is gone".into()))?;
            conn.id
                .accept(params.local_qpn.get(), private, params.rnr_retry_count)
                .map_err(|e| CmError::Refused(e.to_string()))
        })
    }

    fn reject(&self, id: ConnId, private: &[u8]) {
        alloc_audit::platform(|| {
            if let Some(c) = self.take(id) {
                if let Err(e) = c.id.reject(private) {
                    tracing::debug!("rdma_reject: {e}");
                }
            }
        })
    }

    fn watch_established(&self, id: ConnId, tx: mpsc::UnboundedSender<ConnId>) {
        alloc_audit::platform(|| {
            if let Some(c) = self.conn(id) {
                *c.on_established.lock().unwrap_or_else(|e| e.into_inner()) = Some(tx);
            }
        })
    }
}

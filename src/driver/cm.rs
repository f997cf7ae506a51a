//! RDMA CM for a soft-HCA: a pump task that moves MADs between the device's QP1 and the
//! sans-I/O [`CmEndpoint`], runs its timers, and hands its events to whoever waits for them:
//! the host's `connect` calls, the target's listener, and disconnect watchers.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::SeedableRng;
use tokio::sync::{mpsc, oneshot, Notify};

use crate::cm::{
    service_id, AcceptParams, CmConfig, CmEndpoint, CmEvent, ConnId, ConnectParams, ConnectRequest,
    Established, NvmeCmReject, NvmeRejectStatus, RejectReason,
};
use crate::verbs::{CmError, Incoming, Lifecycle, PeerInfo, INCOMING_BACKLOG};

use super::SoftHca;

struct Shared {
    hca: SoftHca,
    cm: Mutex<CmEndpoint>,
    waiters: Mutex<BTreeMap<ConnId, oneshot::Sender<CmEvent>>>,
    listener: Mutex<Option<mpsc::Sender<Incoming>>>,
    /// Connections whose teardown someone wants to hear about.
    watchers: Mutex<BTreeMap<ConnId, mpsc::UnboundedSender<ConnId>>>,
    /// Accepted requests whose RTU someone wants to hear about.
    rtu: Mutex<BTreeMap<ConnId, mpsc::UnboundedSender<ConnId>>>,
    kick: Notify,
}

/// CM on one device. Clone freely.
#[derive(Clone)]
pub struct CmService {
    sh: Arc<Shared>,
}

impl CmService {
    /// The CM of `hca`'s device context: the one already running on it, or a new one. A
    /// device's QP1 must have one CM (as the kernel has one `ib_cm` per device): two on the
    /// same context take each other's MADs, and a REP read by the wrong one leaves the
    /// other's connect waiting for an answer that never comes. Controllers that come and go
    /// on a device (after a delete, or side by side) share it.
    ///
    /// The CM stands in for the kernel's rdma_cm: it is platform code for
    /// [`crate::harness::alloc_audit`], as are all its methods. Comm IDs, transaction IDs and starting
    /// PSNs come from a CSPRNG keyed by the OS ([`CmEndpoint::from_os_rng`]): a CM on a real
    /// socket is never seeded, since whoever can guess them can speak for a connection.
    pub fn for_device(hca: &SoftHca) -> CmService {
        crate::harness::alloc_audit::platform(|| {
            static RUNNING: Mutex<Vec<std::sync::Weak<Shared>>> = Mutex::new(Vec::new());
            let mut running = RUNNING.lock().unwrap_or_else(|e| e.into_inner());
            running.retain(|w| w.strong_count() > 0);
            let found = running
                .iter()
                .filter_map(std::sync::Weak::upgrade)
                .find(|sh| sh.hca.same(hca) && sh.hca.lifecycle() == Lifecycle::Live);
            match found {
                Some(sh) => CmService { sh },
                None => {
                    let cm = Self::start_inner(hca.clone());
                    running.push(Arc::downgrade(&cm.sh));
                    cm
                }
            }
        })
    }

    fn start_inner(hca: SoftHca) -> CmService {
        let id = hca.with(|d, _| d.identity().clone());
        let cfg = CmConfig::new(hca.addr().ip(), id.guid);
        let cm = match hca.replay_seed() {
            // A simulated network: the run must replay from its seed.
            Some(seed) => CmEndpoint::new(cfg, rand::rngs::StdRng::seed_from_u64(seed)),
            None => CmEndpoint::from_os_rng(cfg),
        };
        let sh = Arc::new(Shared {
            hca,
            cm: Mutex::new(cm),
            waiters: Mutex::new(BTreeMap::new()),
            listener: Mutex::new(None),
            watchers: Mutex::new(BTreeMap::new()),
            rtu: Mutex::new(BTreeMap::new()),
            kick: Notify::new(),
        });
        crate::harness::alloc_audit::spawn(pump(sh.clone()));
        CmService { sh }
    }

    fn cm(&self) -> std::sync::MutexGuard<'_, CmEndpoint> {
        self.sh.cm.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Active side: REQ → REP → RTU. `peer` is the target device's UDP address.
    pub async fn connect(
        &self,
        peer: SocketAddr,
        params: ConnectParams,
        private: &[u8],
        timeout: Duration,
    ) -> Result<Established, CmError> {
        crate::harness::alloc_audit::Platform::new(
            self.connect_inner(peer, params, private, timeout),
        )
        .await
    }

    async fn connect_inner(
        &self,
        peer: SocketAddr,
        params: ConnectParams,
        private: &[u8],
        timeout: Duration,
    ) -> Result<Established, CmError> {
        let (tx, rx) = oneshot::channel();
        let id = {
            let now = self.sh.hca.now();
            let mut cm = self.cm();
            let id = cm
                .connect(now, peer, &params, private)
                .map_err(|e| CmError::Refused(e.to_string()))?;
            self.sh
                .waiters
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(id, tx);
            id
        };
        // A device that died before the pump saw this request never answers: fail now rather
        // than at the timeout (the pump drops the waiters of a dead device as it stops).
        if self.sh.hca.lifecycle() != Lifecycle::Live {
            self.abort(id);
            return Err(CmError::DeviceGone("the device died while connecting"));
        }
        self.sh.kick.notify_one();
        let ev = match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(ev)) => ev,
            Ok(Err(_)) => return Err(CmError::DeviceGone("the device died while connecting")),
            Err(_) => {
                self.abort(id);
                return Err(CmError::Refused(format!(
                    "no answer from {peer} within {timeout:?}"
                )));
            }
        };
        match ev {
            CmEvent::Established(e) => Ok(e),
            CmEvent::Rejected(r) => Err(CmError::Refused(match r.nvme_status {
                Some(s) => format!("rejected by {peer}: {}", s.message()),
                None if r.reason == RejectReason::INVALID_SERVICE_ID => format!(
                    "rejected by {peer}: nothing listens there on port {} (check -s: NVMe-oF \
                     targets listen on 4420 unless started with another port)",
                    params.service_port
                ),
                None => format!("rejected by {peer}: {}", r.reason.describe()),
            })),
            CmEvent::Unreachable { .. } => Err(CmError::Refused(format!(
                "{peer} is unreachable (no CM answer)"
            ))),
            other => Err(CmError::Refused(format!("unexpected CM event {other:?}"))),
        }
    }

    /// Be told (once) when connection `id` is torn down by the peer or the transport.
    pub fn watch(&self, id: ConnId, tx: mpsc::UnboundedSender<ConnId>) {
        crate::harness::alloc_audit::platform(|| {
            self.sh
                .watchers
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(id, tx);
        })
    }

    /// Passive side: be told (once) when accepted request `id` gets its RTU.
    pub fn watch_established(&self, id: ConnId, tx: mpsc::UnboundedSender<ConnId>) {
        crate::harness::alloc_audit::platform(|| {
            self.sh
                .rtu
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(id, tx);
        })
    }

    /// Passive side: connection requests for `port` arrive on the returned channel (at
    /// most [`INCOMING_BACKLOG`] waiting; more are refused "no resources").
    pub fn listen(&self, port: u16) -> mpsc::Receiver<Incoming> {
        let (tx, rx) = mpsc::channel(INCOMING_BACKLOG);
        self.cm().listen(service_id(port));
        *self.sh.listener.lock().unwrap_or_else(|e| e.into_inner()) = Some(tx);
        rx
    }

    pub fn accept(&self, id: ConnId, params: AcceptParams, private: &[u8]) -> Result<(), CmError> {
        let now = self.sh.hca.now();
        self.cm()
            .accept(now, id, &params, private)
            .map_err(|e| CmError::Refused(e.to_string()))?;
        self.sh.kick.notify_one();
        Ok(())
    }

    pub fn reject(&self, id: ConnId, private: &[u8]) {
        let _ = self
            .cm()
            .reject(id, RejectReason::CONSUMER_DEFINED, private);
        self.sh.kick.notify_one();
    }

    /// Orderly teardown (DREQ).
    pub fn disconnect(&self, id: ConnId) {
        crate::harness::alloc_audit::platform(|| {
            let now = self.sh.hca.now();
            let _ = self.cm().disconnect(now, id, &[]);
            self.sh
                .watchers
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&id);
            self.sh.kick.notify_one();
        })
    }

    /// Wait until every DREQ sent is answered (or its retries ran out), at most `limit`:
    /// the orderly goodbye reaches the peer before the device goes, so the peer lets the
    /// connection's resources go at once instead of at its keep-alive timeout.
    pub async fn settle_disconnects(&self, limit: Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        while self.cm().disconnecting() > 0 && tokio::time::Instant::now() < deadline {
            self.sh.kick.notify_one();
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// Forget a connection whatever its state (the recovery path).
    pub fn abort(&self, id: ConnId) {
        crate::harness::alloc_audit::platform(|| {
            let _ = self.cm().abort(id);
            self.sh
                .waiters
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&id);
            self.sh
                .watchers
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&id);
            self.sh
                .rtu
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&id);
            self.sh.kick.notify_one();
        })
    }
}

async fn pump(sh: Arc<Shared>) {
    let wake = sh.hca.event_handle();
    loop {
        let notified = wake.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let now = sh.hca.now();
        let mut events = Vec::new();
        let deadline;
        {
            let mut cm = sh.cm.lock().unwrap_or_else(|e| e.into_inner());
            let alive = sh.hca.with_quiet(|d, _| {
                while let Some((from, mad)) = d.poll_gsi() {
                    tracing::trace!(%from, attr = u16::from_be_bytes([mad[16], mad[17]]), "MAD in");
                    cm.handle_mad(now, from, &mad);
                }
                d.is_live()
            });
            if !alive {
                // Nobody will answer through a dead device: wake every connect waiting here.
                sh.waiters.lock().unwrap_or_else(|e| e.into_inner()).clear();
                return;
            }
            if cm.poll_timeout().is_some_and(|t| t <= now) {
                cm.handle_timeout(now);
            }
            let sent = sh.hca.with_quiet(|d, _| {
                let mut sent = false;
                while let Some((to, mad)) = cm.poll_transmit() {
                    tracing::trace!(%to, attr = u16::from_be_bytes([mad[16], mad[17]]), "MAD out");
                    if d.post_gsi(to, &mad).is_err() {
                        break; // the CM retransmits
                    }
                    sent = true;
                }
                sent
            });
            if sent {
                sh.hca.kick();
            }
            while let Some(ev) = cm.poll_event() {
                events.push(ev);
            }
            deadline = cm.poll_timeout();
        }
        for ev in events {
            dispatch(&sh, ev);
        }
        let sleep = deadline.map(|t| Duration::from_nanos(t.0.saturating_sub(sh.hca.now().0)));
        tokio::select! {
            biased;
            _ = &mut notified => {}
            _ = sh.kick.notified() => {}
            _ = async {
                match sleep {
                    Some(d) => tokio::time::sleep(d).await,
                    None => std::future::pending().await,
                }
            } => {}
        }
    }
}

fn dispatch(sh: &Shared, ev: CmEvent) {
    match ev {
        CmEvent::ConnectRequest(req) => {
            let id = req.id;
            let refused = match sh
                .listener
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_ref()
            {
                Some(tx) => tx.try_send(incoming(req)).is_err(),
                None => false,
            };
            if refused {
                // The listener is behind (or gone): refuse rather than queue without end.
                tracing::debug!(?id, "connection request refused: listener backlog full");
                let rej = NvmeCmReject::new(NvmeRejectStatus::NoResources).emit();
                let mut cm = sh.cm.lock().unwrap_or_else(|e| e.into_inner());
                let _ = cm.reject(id, RejectReason::CONSUMER_DEFINED, &rej);
                drop(cm);
                sh.kick.notify_one();
            }
        }
        CmEvent::Disconnected { id } => {
            if let Some(tx) = sh
                .watchers
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&id)
            {
                let _ = tx.send(id);
            }
        }
        CmEvent::TimewaitExit { .. } => {}
        ev => {
            let id = ev.id();
            if let Some(tx) = sh
                .waiters
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&id)
            {
                let _ = tx.send(ev);
                return;
            }
            // Passive side: the RTU arrived, or the request ended without one (our REP
            // went unanswered, or the peer rejected it): the listener's watchers hear.
            let rtu = sh.rtu.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
            let to = match ev {
                CmEvent::Established(_) => rtu,
                CmEvent::Unreachable { .. } | CmEvent::Rejected(_) => sh
                    .watchers
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&id),
                _ => None,
            };
            if let Some(tx) = to {
                let _ = tx.send(id);
            }
        }
    }
}

/// What the target needs of a REQ.
fn incoming(req: ConnectRequest) -> Incoming {
    Incoming {
        id: req.id,
        peer: PeerInfo {
            addr: req.peer,
            qpn: req.remote_qpn,
            psn: req.remote_psn,
        },
        local_psn: req.local_psn,
        path_mtu: req.path_mtu,
        nvme: req.nvme,
    }
}

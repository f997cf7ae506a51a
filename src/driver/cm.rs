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

use super::handoff::HandOff;
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
    // Connection requests wait in the listener's backlog for the target (see `handoff`).
    let mut backlog = HandOff::default();
    loop {
        let notified = wake.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let now = sh.hca.now();
        let mut events = Vec::new();
        let deadline;
        let more;
        {
            let mut cm = sh.cm.lock().unwrap_or_else(|e| e.into_inner());
            // A MAD makes at most one request for the listener: take no more than its
            // backlog has room for, so none is refused while the target is merely behind.
            let room = sh.listener_room();
            let (alive, left) = sh.hca.with_quiet(|d, _| {
                let take = match backlog.wait(room == 0 && d.gsi_pending()) {
                    true => 0,
                    false => room.max(1),
                };
                for _ in 0..take {
                    let Some((from, mad)) = d.poll_gsi() else {
                        break;
                    };
                    tracing::trace!(%from, attr = u16::from_be_bytes([mad[16], mad[17]]), "MAD in");
                    cm.handle_mad(now, from, &mad);
                }
                (d.is_live(), d.gsi_pending())
            });
            more = left;
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
        if more {
            // MADs left for after the listener took what was dispatched.
            tokio::task::yield_now().await;
            continue;
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

impl Shared {
    /// Requests the listener's backlog has room for; unbounded with no listener (requests
    /// for nobody are refused by the CM itself).
    fn listener_room(&self) -> usize {
        self.listener
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map_or(usize::MAX, |tx| tx.capacity())
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

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, SocketAddr};
    use std::time::Duration;

    use rand::SeedableRng;

    use super::CmService;
    use crate::cm::{CmConfig, CmEndpoint, ConnectParams, NvmeCmRequest};
    use crate::driver::{Fabric, SimNet, SoftHca};
    use crate::hca::device::emit_gsi;
    use crate::hca::sim::Faults;
    use crate::hca::wire::IcrcContext;
    use crate::hca::{DeviceConfig, DeviceIdentity, IcrcCheck};
    use crate::verbs::{Guid, Instant, PciAddr, Psn, Qpn, INCOMING_BACKLOG};

    /// A burst of CM REQs four times the device's MAD queue (256) and eight times the
    /// listener's backlog arrives at once, with busy polling off: every one reaches the
    /// listener, none is dropped or refused on the way, because each queue's reader runs
    /// when the queue fills (`handoff`).
    #[tokio::test(start_paused = true)]
    async fn a_burst_of_reqs_larger_than_every_queue_reaches_the_listener_whole() {
        const N: u32 = 1024;
        let net = SimNet::new(5, Faults::NONE);
        let at = |i: u8| SocketAddr::from((Ipv4Addr::new(10, 9, 0, i), 4791));
        let cfg = DeviceConfig {
            identity: DeviceIdentity::from_mac("tgt", [2, 0, 0, 9, 0, 1], PciAddr::new(0, 9, 1, 0)),
            addr: at(1),
            icrc: IcrcCheck::Verify,
            peer_port: None,
            seed: 1,
        };
        let hca = SoftHca::start_on(cfg, &Fabric::Sim(net.clone()))
            .await
            .unwrap();
        let cm = CmService::for_device(&hca);
        let mut requests = cm.listen(4420);
        assert!(N as usize > 4 * INCOMING_BACKLOG);

        // A peer that never answers: REQs only, all put on the wire in one go.
        let mut port = net.bind(at(2)).unwrap();
        let mut peer = CmEndpoint::new(
            CmConfig::new(at(2).ip(), Guid(0x200)),
            rand::rngs::StdRng::seed_from_u64(2),
        );
        let private = NvmeCmRequest {
            qid: 1,
            hrqsize: 32,
            hsqsize: 31,
            cntlid: 0,
        }
        .emit();
        for i in 0..N {
            let params = ConnectParams::new(Qpn::new(0x100 + i), 4420);
            peer.connect(Instant(0), at(1), &params, &private).unwrap();
        }
        let mut psn = 0;
        while let Some((dst, mad)) = peer.poll_transmit() {
            let buf = port.tx_buf();
            let start = buf.len();
            emit_gsi(Psn::new(psn), &mad, &IcrcContext::new(at(2), dst), buf);
            psn += 1;
            port.push(dst, start);
        }
        port.flush();

        let mut got = 0;
        while let Ok(Some(req)) =
            tokio::time::timeout(Duration::from_secs(1), requests.recv()).await
        {
            got += 1;
            cm.reject(req.id, &[]);
        }
        let overflows = hca.with_quiet(|d, _| d.stats().gsi_overflows);
        assert_eq!(
            (got, overflows),
            (N, 0),
            "(requests listened, MADs dropped)"
        );
    }
}

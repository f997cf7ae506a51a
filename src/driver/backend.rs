//! The soft-HCA behind the backend seam: [`SoftHca`] is a device context, [`DeviceManager`]
//! a device source, [`CmService`] (our IB CM on QP1) the connection manager.
//!
//! Every call runs as platform code for [`crate::harness::alloc_audit`]: the soft-HCA stands in for
//! the kernel and the NIC, whose memory is not the host's to preallocate. Calls that queue
//! nothing to send (PD, MR and CQ objects, polling) leave the driver task asleep; the others
//! wake it, as a doorbell would.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, Notify};

use crate::cm::{AcceptParams, ConnId, ConnectParams, Established};
use crate::harness::alloc_audit;
use crate::hca::rc::{create_qp_init, qp_to_rts, RcOptions};
use crate::hca::HostMem;
use crate::verbs::{
    Access, CmError, CmListen, CmPort, CqId, DeviceContext, DeviceSource, HostBuffer, Identity,
    Incoming, Lifecycle, MrInfo, Opened, PdId, PeerInfo, Psn, QpCaps, Qpn, RcAttr, RecvWr,
    ResetHook, SendWr, VerbsError, WorkCompletion,
};

use super::{CmService, DeviceManager, SoftHca};

impl HostBuffer for HostMem {
    fn alloc(len: usize) -> HostMem {
        HostMem::new(len)
    }

    fn try_alloc(len: usize) -> Option<HostMem> {
        HostMem::try_new(len).ok()
    }

    fn try_alloc_lazy(len: usize) -> Option<HostMem> {
        HostMem::try_new_lazy(len)
    }

    fn stream_writes(&self) {
        HostMem::stream_writes(self)
    }

    fn len(&self) -> usize {
        HostMem::len(self)
    }

    fn read(&self, offset: usize, out: &mut [u8]) {
        HostMem::read(self, offset, out)
    }

    fn write(&self, offset: usize, data: &[u8]) {
        HostMem::write(self, offset, data)
    }

    fn with_range<R>(&self, offset: usize, len: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
        HostMem::with_range(self, offset, len, f)
    }

    fn as_mut_ptr(&self) -> *mut u8 {
        self.addr() as *mut u8
    }
}

impl DeviceContext for SoftHca {
    type Mem = HostMem;
    type Cm = CmService;

    fn identity(&self) -> Identity {
        self.with_quiet(|d, _| {
            let id = d.identity();
            Identity {
                guid: id.guid,
                pci: id.pci,
            }
        })
    }

    fn lifecycle(&self) -> Lifecycle {
        SoftHca::lifecycle(self)
    }

    fn same(&self, other: &SoftHca) -> bool {
        SoftHca::same(self, other)
    }

    fn reaches_in_memory(&self, peer: std::net::SocketAddr) -> bool {
        super::local::reaches(self.addr(), peer)
    }

    fn alloc_pd(&self) -> Result<PdId, VerbsError> {
        self.with_quiet(|d, _| d.alloc_pd())
    }

    fn dealloc_pd(&self, pd: PdId) {
        self.with_quiet(|d, _| {
            let _ = d.dealloc_pd(pd);
        })
    }

    fn reg_mr(
        &self,
        pd: PdId,
        mem: &HostMem,
        offset: usize,
        len: usize,
        access: Access,
    ) -> Result<MrInfo, VerbsError> {
        self.with_quiet(|d, _| d.reg_mr(pd, mem, offset, len, access))
    }

    fn dereg_mr(&self, mr: &MrInfo) {
        self.with_quiet(|d, _| {
            let _ = d.dereg_mr(mr.lkey);
        })
    }

    fn per_use_keys(&self) -> bool {
        true
    }

    fn send_with_invalidate(&self) -> bool {
        true
    }

    fn rekey_mr(&self, mr: &mut MrInfo, len: usize, access: Access) -> Result<(), VerbsError> {
        *mr = self.with_quiet(|d, _| d.rekey_mr(mr.lkey, len as u64, access))?;
        Ok(())
    }

    fn invalidate_mr(&self, mr: &MrInfo) {
        self.with_quiet(|d, _| {
            let _ = d.invalidate_mr(mr.lkey);
        })
    }

    fn create_cq(&self, depth: usize) -> Result<CqId, VerbsError> {
        self.with_quiet(|d, _| d.create_cq(depth))
    }

    fn destroy_cq(&self, cq: CqId) {
        self.with_quiet(|d, _| {
            let _ = d.destroy_cq(cq);
        })
    }

    fn create_rc_qp(
        &self,
        pd: PdId,
        cq: CqId,
        caps: QpCaps,
        access: Access,
    ) -> Result<Qpn, VerbsError> {
        self.with(|d, _| create_qp_init(d, pd, cq, caps, access))
    }

    fn rc_to_rts(
        &self,
        qpn: Qpn,
        peer: PeerInfo,
        local_psn: Psn,
        attr: &RcAttr,
    ) -> Result<(), VerbsError> {
        let o = RcOptions {
            mtu: attr.mtu,
            timeout: attr.timeout,
            retry_cnt: attr.retry_cnt,
            rnr_retry: attr.rnr_retry,
            max_unacked: attr.max_unacked,
            ..RcOptions::default()
        };
        self.with(|d, _| qp_to_rts(d, qpn, peer, local_psn, &o))
    }

    fn destroy_qp(&self, qpn: Qpn) {
        self.with(|d, _| {
            let _ = d.destroy_qp(qpn);
        })
    }

    fn post(
        &self,
        qpn: Qpn,
        recvs: &mut Vec<RecvWr>,
        sends: &mut Vec<SendWr>,
    ) -> Result<(), VerbsError> {
        self.with(|d, now| {
            let mut first = Ok(());
            for r in recvs.drain(..) {
                if let Err(e) = d.post_recv(qpn, r) {
                    first = first.and(Err(e));
                }
            }
            for wr in sends.drain(..) {
                if let Err(e) = d.post_send(now, qpn, wr) {
                    first = first.and(Err(e));
                }
            }
            first
        })
    }

    fn poll_cq(&self, cq: CqId, max: usize, out: &mut Vec<WorkCompletion>) -> usize {
        self.with_quiet(|d, _| d.poll_cq(cq, max, out))
    }

    fn wait_cq<'a>(
        &'a self,
        cq: CqId,
        max: usize,
        out: &'a mut Vec<WorkCompletion>,
    ) -> impl Future<Output = usize> + Send + 'a {
        SoftHca::wait_cq(self, cq, max, out)
    }
}

impl DeviceSource for DeviceManager {
    type Device = SoftHca;

    fn open(&self, name: &str) -> Option<Opened<SoftHca>> {
        alloc_audit::platform(|| {
            DeviceManager::open(self, name).map(|(dev, info)| Opened {
                dev,
                identity: Identity {
                    guid: info.guid,
                    pci: info.pci,
                },
                generation: info.generation,
            })
        })
    }

    fn present(&self, name: &str) -> bool {
        alloc_audit::platform(|| self.refresh().iter().any(|i| i.name == name))
    }

    fn cm(&self, dev: &SoftHca) -> CmService {
        CmService::for_device(dev)
    }

    fn changed(&self) -> Arc<Notify> {
        DeviceManager::changed(self)
    }
}

impl ResetHook for DeviceManager {
    async fn inflict_reset(&self, name: &str, down_for: Duration) -> Result<(), String> {
        self.reset(name, down_for)
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    async fn inflict_unplug(&self, name: &str, down_for: Duration) -> Result<(), String> {
        let card = self
            .refresh()
            .into_iter()
            .find(|i| i.name == name)
            .ok_or_else(|| format!("no device {name} is plugged"))?
            .identity();
        self.unplug(name).await.map_err(|e| e.to_string())?;
        tokio::time::sleep(down_for).await;
        self.replug(card)
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    }
}

impl CmPort for CmService {
    fn connect<'a>(
        &'a self,
        peer: SocketAddr,
        params: ConnectParams,
        private: &'a [u8],
        timeout: Duration,
    ) -> impl Future<Output = Result<Established, CmError>> + Send + 'a {
        CmService::connect(self, peer, params, private, timeout)
    }

    fn abort(&self, id: ConnId) {
        CmService::abort(self, id)
    }

    fn disconnect(&self, id: ConnId) {
        CmService::disconnect(self, id)
    }

    fn watch(&self, id: ConnId, tx: mpsc::UnboundedSender<ConnId>) {
        CmService::watch(self, id, tx)
    }
}

impl CmListen for CmService {
    /// Our IB CM answers on the device's own address whatever `at.ip()` says: a soft-HCA
    /// context has one address.
    fn listen(&self, at: SocketAddr) -> Result<mpsc::Receiver<Incoming>, CmError> {
        Ok(CmService::listen(self, at.port()))
    }

    /// Nothing to tie: the soft-HCA's QP takes its path from [`DeviceContext::rc_to_rts`].
    fn attach(&self, _id: ConnId, _qpn: Qpn) -> Result<(), CmError> {
        Ok(())
    }

    fn accept(&self, id: ConnId, params: AcceptParams, private: &[u8]) -> Result<(), CmError> {
        CmService::accept(self, id, params, private)
    }

    fn reject(&self, id: ConnId, private: &[u8]) {
        CmService::reject(self, id, private)
    }

    fn watch_established(&self, id: ConnId, tx: mpsc::UnboundedSender<ConnId>) {
        CmService::watch_established(self, id, tx)
    }
}

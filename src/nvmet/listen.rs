//! The target's side of the connection manager: answer connection requests on the NVMe-oF
//! service port with a queue (accept + NVMe accept private data) or an NVMe reject, and drop
//! queues whose connection goes away.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use tokio::sync::mpsc;

use crate::cm::{AcceptParams, ConnId, NvmeCmAccept, NvmeCmReject, NvmeRejectStatus};
use crate::verbs::{CmError, CmListen, CmPort, DeviceContext, Qpn};

use super::{ConnParams, Target};

/// Serve the connection manager of `target`'s first port until its device dies: see
/// [`serve_cm_on`].
pub fn serve_cm<D>(target: Target<D>, cm: D::Cm) -> Result<(), CmError>
where
    D: DeviceContext,
    D::Cm: CmListen,
{
    serve_cm_on(target, 1, cm)
}

/// Serve the connection manager of port `port` of `target` (`cm` on that port's device)
/// until the device dies: listen on the port's address (any address of the device if
/// none) at the configured service port. Fails if the listen does (an address that is not
/// the device's, a port in use).
pub fn serve_cm_on<D>(target: Target<D>, port: u16, cm: D::Cm) -> Result<(), CmError>
where
    D: DeviceContext,
    D::Cm: CmListen,
{
    let cfg = target.config();
    let ip = target
        .ports()
        .iter()
        .find(|p| p.id == port)
        .and_then(|p| p.addr)
        .map(|a| a.ip())
        .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
    let mut requests = cm.listen(SocketAddr::new(ip, cfg.port))?;
    tokio::spawn(async move {
        let (gone_tx, mut gone_rx) = mpsc::unbounded_channel::<ConnId>();
        let (drop_tx, mut drop_rx) = mpsc::unbounded_channel::<Qpn>();
        let (rtu_tx, mut rtu_rx) = mpsc::unbounded_channel::<ConnId>();
        target.on_drop(port, drop_tx);
        let mut by_conn: BTreeMap<ConnId, Qpn> = BTreeMap::new();
        loop {
            // Biased so that a simulated run replays (tokio's unbiased choice is random).
            tokio::select! {
                biased;
                // First: a queue's RTU counts it against its address's share before that
                // address's next REQ (the CM reports them in the order they came) is
                // weighed.
                id = rtu_rx.recv() => {
                    if let Some(qpn) = id.and_then(|id| by_conn.get(&id)) {
                        target.established(port, *qpn);
                    }
                }
                req = requests.recv() => {
                    let Some(req) = req else { return };
                    let nvme = match req.nvme {
                        Ok(n) => n,
                        Err(e) => {
                            cm.reject(req.id, &NvmeCmReject::new(e.nvme_status()).emit());
                            continue;
                        }
                    };
                    let p = ConnParams {
                        peer: req.peer,
                        qid: nvme.qid,
                        hrqsize: nvme.hrqsize,
                        hsqsize: nvme.hsqsize,
                        path_mtu: req.path_mtu,
                        local_psn: req.local_psn,
                    };
                    match target.accept(port, p, |qpn| cm.attach(req.id, qpn).is_ok()) {
                        Ok((qpn, crqsize)) => {
                            let ap = AcceptParams::new(qpn);
                            let private = NvmeCmAccept { crqsize }.emit();
                            cm.watch_established(req.id, rtu_tx.clone());
                            if cm.accept(req.id, ap, &private).is_ok() {
                                cm.watch(req.id, gone_tx.clone());
                                by_conn.insert(req.id, qpn);
                            } else {
                                cm.abort(req.id);
                                target.drop_queue(port, qpn);
                            }
                        }
                        Err(r) => {
                            let st = NvmeRejectStatus::from_u16(r.status());
                            cm.reject(req.id, &NvmeCmReject::new(st).emit());
                        }
                    }
                }
                id = gone_rx.recv() => {
                    if let Some(id) = id {
                        if let Some(qpn) = by_conn.remove(&id) {
                            target.drop_queue(port, qpn);
                        }
                    }
                }
                // The engine dropped a queue by itself (its host went silent past KATO, or
                // the transport failed): its peer is gone, so forget the connection rather
                // than keep it established forever.
                qpn = drop_rx.recv() => {
                    if let Some(qpn) = qpn {
                        let ids: Vec<ConnId> = by_conn
                            .iter()
                            .filter(|(_, q)| **q == qpn)
                            .map(|(id, _)| *id)
                            .collect();
                        for id in ids {
                            by_conn.remove(&id);
                            cm.abort(id);
                        }
                    }
                }
            }
        }
    });
    Ok(())
}

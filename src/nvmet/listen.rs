//! The target's side of RDMA CM: answer connection requests on the NVMe-oF service port
//! with a queue (REP + NVMe accept) or an NVMe reject, and drop queues whose connection
//! goes away.

use std::collections::BTreeMap;

use tokio::sync::mpsc;

use crate::cm::{AcceptParams, ConnId, NvmeCmAccept, NvmeCmReject, NvmeRejectStatus};
use crate::driver::CmService;
use crate::hca::rc::PeerInfo;
use crate::hca::Qpn;

use super::{ConnParams, ConnReject, Target};

/// Serve CM for `target` until the device dies.
pub fn serve_cm(target: Target, cm: CmService) {
    let port = target.config().port;
    let mut requests = cm.listen(port);
    tokio::spawn(async move {
        let (gone_tx, mut gone_rx) = mpsc::unbounded_channel::<ConnId>();
        let (drop_tx, mut drop_rx) = mpsc::unbounded_channel::<Qpn>();
        target.on_drop(drop_tx);
        let mut by_conn: BTreeMap<ConnId, Qpn> = BTreeMap::new();
        loop {
            // Biased so that a simulated run replays (tokio's unbiased choice is random).
            tokio::select! {
                biased;
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
                        peer: PeerInfo { addr: req.peer, qpn: req.remote_qpn, psn: req.remote_psn },
                        qid: nvme.qid,
                        hrqsize: nvme.hrqsize,
                        hsqsize: nvme.hsqsize,
                        path_mtu: req.path_mtu,
                        local_psn: req.local_psn,
                    };
                    match target.accept(p) {
                        Ok((qpn, crqsize)) => {
                            let ap = AcceptParams::new(qpn);
                            let private = NvmeCmAccept { crqsize }.emit();
                            if cm.accept(req.id, ap, &private).is_ok() {
                                cm.watch(req.id, gone_tx.clone());
                                by_conn.insert(req.id, qpn);
                            } else {
                                target.drop_queue(qpn);
                            }
                        }
                        Err(r) => {
                            let st = match r {
                                ConnReject::InvalidQid => NvmeRejectStatus::from_u16(3),
                                ConnReject::InvalidHsqsize => NvmeRejectStatus::from_u16(4),
                                ConnReject::InvalidHrqsize => NvmeRejectStatus::from_u16(5),
                                ConnReject::NoResources => NvmeRejectStatus::from_u16(6),
                            };
                            cm.reject(req.id, &NvmeCmReject::new(st).emit());
                        }
                    }
                }
                id = gone_rx.recv() => {
                    if let Some(id) = id {
                        if let Some(qpn) = by_conn.remove(&id) {
                            target.drop_queue(qpn);
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
}

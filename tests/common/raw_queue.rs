//! One RC queue to a target driven by hand, for the tests that send what no host of ours
//! would (`#[path = "common/raw_queue.rs"] mod raw_queue;`).
#![allow(dead_code)]

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::time::Duration;

use nvmf_rdma::cm::{ConnId, ConnectParams, NvmeCmRequest};
use nvmf_rdma::driver::{CmService, SoftHca};
use nvmf_rdma::hca::rc::{create_qp_init, qp_to_rts, RcOptions};
use nvmf_rdma::hca::HostMem;
use nvmf_rdma::nvme::fabrics;
use nvmf_rdma::nvme::{ConnectData, Cqe, FabricsCmd, Nqn, SglDescriptor};
use nvmf_rdma::verbs::PeerInfo;
use nvmf_rdma::verbs::{
    Access, CqId, MrInfo, Mtu, PdId, QpCaps, Qpn, RecvWr, SendOp, SendWr, Sgl, WcOpcode, WcStatus,
    WorkCompletion,
};

pub const TX_SLOT: usize = 64 + 8192;
pub const TX_SLOTS: usize = 16;
const RX_SLOT: usize = 64;
pub const DATA_LEN: usize = 256 << 10;

/// One RC queue driven by hand: whatever bytes we like go out as capsules.
pub struct Raw {
    pub hca: SoftHca,
    pub cm: CmService,
    pub conn: ConnId,
    pub pd: PdId,
    pub cq: CqId,
    pub qpn: Qpn,
    pub size: usize,
    pub tx: (HostMem, MrInfo),
    pub rx: (HostMem, MrInfo),
    pub data: (HostMem, MrInfo),
    pub next_tx: usize,
    pub next_wr: u64,
    pub backlog: VecDeque<WorkCompletion>,
}

const RECV: u64 = 1 << 40;

impl Raw {
    pub async fn open(
        hca: &SoftHca,
        cm: &CmService,
        target: SocketAddr,
        qid: u16,
        size: usize,
    ) -> Raw {
        Raw::try_open(hca, cm, target, qid, size)
            .await
            .expect("raw queue CM connect")
    }

    /// As [`Raw::open`], with the target's refusal of the REQ as an error.
    pub async fn try_open(
        hca: &SoftHca,
        cm: &CmService,
        target: SocketAddr,
        qid: u16,
        size: usize,
    ) -> Result<Raw, String> {
        let (pd, cq, qpn, tx, rx, data) = hca.with(|d, _| {
            let pd = d.alloc_pd().unwrap();
            let cq = d.create_cq(1024).unwrap();
            let caps = QpCaps {
                max_send_wr: 64,
                max_recv_wr: size as u32 * 2,
            };
            let all = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE;
            let qpn = create_qp_init(d, pd, cq, caps, all).unwrap();
            let tx = HostMem::new(TX_SLOTS * TX_SLOT);
            let tx_mr = d.reg_mr(pd, &tx, 0, tx.len(), Access::empty()).unwrap();
            let rx = HostMem::new(size * 2 * RX_SLOT);
            let rx_mr = d.reg_mr(pd, &rx, 0, rx.len(), Access::LOCAL_WRITE).unwrap();
            let data = HostMem::new(DATA_LEN);
            let data_mr = d.reg_mr(pd, &data, 0, data.len(), all).unwrap();
            (pd, cq, qpn, (tx, tx_mr), (rx, rx_mr), (data, data_mr))
        });
        let mut params = ConnectParams::new(qpn, 4420);
        params.path_mtu = Mtu::Mtu4096;
        let private = NvmeCmRequest {
            qid,
            hrqsize: size as u16,
            hsqsize: size as u16 - 1,
            cntlid: 0,
        }
        .emit();
        let est = tokio::time::timeout(
            Duration::from_secs(20),
            cm.connect(target, params, &private, Duration::from_secs(8)),
        )
        .await
        .expect("raw CM connect: no answer within 20 s")
        .map_err(|e| e.to_string())?;
        let peer = PeerInfo {
            addr: est.peer,
            qpn: est.remote_qpn,
            psn: est.remote_psn,
        };
        let o = RcOptions {
            mtu: Mtu::Mtu4096,
            timeout: 14,
            ..RcOptions::default()
        };
        hca.with(|d, _| qp_to_rts(d, qpn, peer, est.local_psn, &o))
            .unwrap();
        let raw = Raw {
            hca: hca.clone(),
            cm: cm.clone(),
            conn: est.id,
            pd,
            cq,
            qpn,
            size,
            tx,
            rx,
            data,
            next_tx: 0,
            next_wr: 0,
            backlog: VecDeque::new(),
        };
        for r in 0..size * 2 {
            raw.post_recv(r);
        }
        Ok(raw)
    }

    pub fn post_recv(&self, r: usize) {
        let sgl = Sgl::one(
            self.rx.1.addr + (r * RX_SLOT) as u64,
            RX_SLOT as u32,
            self.rx.1.lkey,
        );
        let qpn = self.qpn;
        let _ = self.hca.with(|d, _| {
            d.post_recv(
                qpn,
                RecvWr {
                    wr_id: RECV | r as u64,
                    sgl,
                },
            )
        });
    }

    /// SEND `bytes` as one capsule.
    pub fn send(&mut self, bytes: &[u8]) {
        assert!(bytes.len() <= TX_SLOT);
        let at = (self.next_tx % TX_SLOTS) * TX_SLOT;
        self.next_tx += 1;
        self.next_wr += 1;
        self.tx.0.write(at, bytes);
        let wr = SendWr::signaled(
            self.next_wr,
            SendOp::Send,
            Sgl::one(
                self.tx.1.addr + at as u64,
                bytes.len() as u32,
                self.tx.1.lkey,
            ),
        );
        let qpn = self.qpn;
        self.hca
            .with(|d, now| d.post_send(now, qpn, wr))
            .expect("post capsule");
    }

    /// The next response capsule; `Err` if the queue failed (with the WC status) or
    /// nothing came within `ms`.
    pub async fn response(&mut self, ms: u64) -> Result<Cqe, String> {
        let deadline = tokio::time::Instant::now() + Duration::from_millis(ms);
        loop {
            if let Some(wc) = self.backlog.pop_front() {
                if wc.status != WcStatus::Success {
                    return Err(format!("transport: {}", wc.status.as_str()));
                }
                if wc.wr_id & RECV == 0 || wc.opcode != WcOpcode::Recv {
                    continue;
                }
                let r = (wc.wr_id & 0xFFFF) as usize;
                let mut b = vec![0u8; wc.byte_len as usize];
                self.rx.0.read(r * RX_SLOT, &mut b);
                self.post_recv(r);
                assert_eq!(b.len(), 16, "the target sent a {}-byte response", b.len());
                return Ok(Cqe::parse(&b).unwrap());
            }
            let mut wcs = Vec::new();
            match tokio::time::timeout_at(deadline, self.hca.wait_cq(self.cq, 64, &mut wcs)).await {
                Ok(0) => return Err("device gone".into()),
                Ok(_) => self.backlog.extend(wcs),
                Err(_) => return Err("timeout".into()),
            }
        }
    }

    /// Send a capsule and wait for its response, which must carry `cid`.
    pub async fn cmd(&mut self, bytes: &[u8], cid: u16) -> Cqe {
        self.send(bytes);
        let c = self
            .response(3000)
            .await
            .unwrap_or_else(|e| panic!("command {cid:#x}: {e}"));
        assert_eq!(c.cid, cid, "response names the command");
        c
    }

    /// A Fabrics Connect capsule to `subnqn` as `hostnqn`; the Connect data sits at offset
    /// 0 of our data buffer.
    pub fn connect_capsule(
        &self,
        cid: u16,
        qid: u16,
        cntlid: u16,
        hostid: [u8; 16],
        (subnqn, hostnqn): (&str, &str),
    ) -> [u8; 64] {
        let cd = ConnectData {
            hostid,
            cntlid,
            subnqn: Nqn::new(subnqn).unwrap(),
            hostnqn: Nqn::new(hostnqn).unwrap(),
        };
        self.data.0.write(0, &cd.to_bytes());
        let mut sqe = FabricsCmd::Connect {
            recfmt: fabrics::RECFMT_0,
            qid,
            sqsize: self.size as u16 - 1,
            cattr: 0,
            kato_ms: 0,
        }
        .to_sqe(cid);
        sqe.set_sgl(&self.keyed(0, 1024)).unwrap();
        sqe.to_bytes()
    }

    /// Fabrics Connect for `qid` (command ID 0x10 + qid) to `subnqn` as `hostnqn`, and
    /// its response.
    pub async fn connect(&mut self, qid: u16, cntlid: u16, nqns: (&str, &str)) -> Cqe {
        let cid = 0x10 + qid;
        let cap = self.connect_capsule(cid, qid, cntlid, *b"raw-queue-host\0\0", nqns);
        self.cmd(&cap, cid).await
    }

    /// A keyed SGL for `len` bytes at `offset` of our data buffer.
    pub fn keyed(&self, offset: usize, len: u32) -> SglDescriptor {
        SglDescriptor::keyed(
            self.data.1.addr + offset as u64,
            len as u64,
            self.data.1.rkey.0,
            false,
        )
        .unwrap()
    }

    pub fn close(self) {
        self.cm.disconnect(self.conn);
        let (qpn, cq, pd) = (self.qpn, self.cq, self.pd);
        let keys = [self.tx.1.lkey, self.rx.1.lkey, self.data.1.lkey];
        self.hca.with(|d, _| {
            let _ = d.destroy_qp(qpn);
            let _ = d.destroy_cq(cq);
            for k in keys {
                let _ = d.dereg_mr(k);
            }
            let _ = d.dealloc_pd(pd);
        });
    }
}

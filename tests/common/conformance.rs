//! The verbs conformance checks, the same for every backend and written against the backend
//! seam only (`nvmf_rdma::verbs`): two RC QPs connected through the backend's own connection
//! manager (one side listens and accepts, the other connects), then SEND/RECV, RDMA WRITE,
//! WRITE with immediate, RDMA READ (bytes and completion fields), and a WRITE with a bad rkey
//! failing with a remote access error.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::Duration;

use nvmf_rdma::cm::{AcceptParams, ConnectParams, NvmeCmAccept, NvmeCmRequest};
use nvmf_rdma::verbs::{
    Access, CmListen, CmPort, CqId, DeviceContext, DeviceSource, HostBuffer, MemKey, MrInfo, Mtu,
    PdId, PeerInfo, QpCaps, Qpn, RcAttr, RecvWr, SendOp, SendWr, Sgl, WcOpcode, WcStatus,
    WorkCompletion,
};

/// Bytes each end registers.
const LEN: usize = 128 * 1024;
/// How long a connect or a completion may take (virtual time in the simulator).
const WAIT: Duration = Duration::from_secs(30);

/// One connected end: a QP on a CQ and PD of its own, and a registered buffer.
pub struct End<D: DeviceContext> {
    dev: D,
    pd: PdId,
    cq: CqId,
    qpn: Qpn,
    mem: D::Mem,
    mr: MrInfo,
}

fn attr(mtu: Mtu) -> RcAttr {
    RcAttr {
        mtu,
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        max_unacked: 256,
    }
}

impl<D: DeviceContext> End<D> {
    /// PD, CQ, buffer and region, and an RC QP in INIT that peers may read and write.
    fn new(dev: D) -> Result<End<D>, String> {
        let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
        let pd = dev.alloc_pd().map_err(|e| format!("alloc_pd: {e}"))?;
        let cq = dev.create_cq(64).map_err(|e| format!("create_cq: {e}"))?;
        let mem = D::Mem::alloc(LEN);
        let mr = dev
            .reg_mr(pd, &mem, 0, LEN, all)
            .map_err(|e| format!("reg_mr: {e}"))?;
        let caps = QpCaps {
            max_send_wr: 32,
            max_recv_wr: 32,
        };
        let qpn = dev
            .create_rc_qp(pd, cq, caps, all)
            .map_err(|e| format!("create_rc_qp: {e}"))?;
        Ok(End {
            dev,
            pd,
            cq,
            qpn,
            mem,
            mr,
        })
    }

    fn sgl(&self, off: usize, len: usize) -> Sgl {
        Sgl::one(self.mr.addr + off as u64, len as u32, self.mr.lkey)
    }

    fn remote(&self, off: usize) -> u64 {
        self.mr.addr + off as u64
    }

    fn send(&self, wr: SendWr, what: &str) -> Result<(), String> {
        self.dev
            .post(self.qpn, &mut Vec::new(), &mut vec![wr])
            .map_err(|e| format!("{what}: post send: {e}"))
    }

    fn recv(&self, wr_id: u64, sgl: Sgl) -> Result<(), String> {
        self.dev
            .post(self.qpn, &mut vec![RecvWr { wr_id, sgl }], &mut Vec::new())
            .map_err(|e| format!("post receive {wr_id:#x}: {e}"))
    }

    fn read(&self, off: usize, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        self.mem.read(off, &mut v);
        v
    }

    async fn wait_wc(&self, what: &str) -> Result<WorkCompletion, String> {
        let mut out = Vec::new();
        match tokio::time::timeout(WAIT, self.dev.wait_cq(self.cq, 1, &mut out)).await {
            Ok(0) => Err(format!("{what}: the device died")),
            Ok(_) => Ok(out.remove(0)),
            Err(_) => Err(format!("{what}: no completion within {WAIT:?}")),
        }
    }

    /// Release everything, QP first.
    pub fn close(self) {
        self.dev.destroy_qp(self.qpn);
        self.dev.destroy_cq(self.cq);
        self.dev.dereg_mr(&self.mr);
        self.dev.dealloc_pd(self.pd);
    }
}

/// Connect an end on device `a` to one on device `b` of `src` (they may be the same device)
/// through the backend's connection manager: `b` listens for `service` at `b_addr`'s IP,
/// `a` connects to `b_addr` (as a host's `traddr` names a target).
pub async fn connect<S>(
    src: &S,
    a: &str,
    b: &str,
    b_addr: SocketAddr,
    service: u16,
) -> Result<(End<S::Device>, End<S::Device>), String>
where
    S: DeviceSource,
    <S::Device as DeviceContext>::Cm: CmListen,
{
    let da = src.open(a).ok_or_else(|| format!("no device {a}"))?.dev;
    let db = src.open(b).ok_or_else(|| format!("no device {b}"))?.dev;
    let (cma, cmb) = (src.cm(&da), src.cm(&db));
    let mut requests = cmb
        .listen(SocketAddr::new(b_addr.ip(), service))
        .map_err(|e| format!("listen: {e}"))?;
    let ea = End::new(da)?;
    let private = NvmeCmRequest {
        qid: 1,
        hrqsize: 32,
        hsqsize: 31,
        cntlid: 0xFFFF,
    }
    .emit();
    let params = ConnectParams::new(ea.qpn, service);
    let active = cma.connect(b_addr, params, &private, WAIT);
    let passive = async {
        let req = tokio::time::timeout(WAIT, requests.recv())
            .await
            .map_err(|_| "no connection request arrived".to_string())?
            .ok_or("the listener ended")?;
        let eb = End::new(db)?;
        cmb.attach(req.id, eb.qpn)
            .map_err(|e| format!("attach: {e}"))?;
        eb.dev
            .rc_to_rts(eb.qpn, req.peer, req.local_psn, &attr(req.path_mtu))
            .map_err(|e| format!("passive rc_to_rts: {e}"))?;
        let accept = NvmeCmAccept { crqsize: 32 }.emit();
        cmb.accept(req.id, AcceptParams::new(eb.qpn), &accept)
            .map_err(|e| format!("accept: {e}"))?;
        Ok::<_, String>(eb)
    };
    let (est, eb) = tokio::join!(active, passive);
    let est = est.map_err(|e| format!("connect: {e}"))?;
    let eb = eb?;
    let peer = PeerInfo {
        addr: est.peer,
        qpn: est.remote_qpn,
        psn: est.remote_psn,
    };
    ea.dev
        .rc_to_rts(ea.qpn, peer, est.local_psn, &attr(est.path_mtu))
        .map_err(|e| format!("active rc_to_rts: {e}"))?;
    Ok((ea, eb))
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn expect(wc: &WorkCompletion, wr_id: u64, status: WcStatus, op: WcOpcode) -> Result<(), String> {
    if wc.wr_id != wr_id || wc.status != status || (status == WcStatus::Success && wc.opcode != op)
    {
        return Err(format!(
            "got wr_id {:#x} {:?} {:?}, want {wr_id:#x} {status:?} {op:?}",
            wc.wr_id, wc.status, wc.opcode
        ));
    }
    Ok(())
}

/// The checks, from `a` to `b`. The bad rkey moves `a`'s QP to ERR, so it runs last.
pub async fn check<D: DeviceContext>(a: &End<D>, b: &End<D>) -> Result<(), String> {
    let wr = |wr_id, op, sgl| SendWr::signaled(wr_id, op, sgl);
    let done = |e: String, what: &str| format!("{what}: {e}");

    // SEND -> RECV
    let msg = pattern(1000, 1);
    a.mem.write(0, &msg);
    b.recv(0x11, b.sgl(0, 4096))?;
    a.send(wr(0x12, SendOp::Send, a.sgl(0, msg.len())), "SEND")?;
    let wc = a.wait_wc("SEND").await?;
    expect(&wc, 0x12, WcStatus::Success, WcOpcode::Send).map_err(|e| done(e, "SEND"))?;
    let wc = b.wait_wc("RECV").await?;
    expect(&wc, 0x11, WcStatus::Success, WcOpcode::Recv).map_err(|e| done(e, "RECV"))?;
    if wc.byte_len != msg.len() as u32 || wc.qpn != b.qpn {
        return Err(format!(
            "RECV: byte_len {} qpn {}, want {} {}",
            wc.byte_len,
            wc.qpn,
            msg.len(),
            b.qpn
        ));
    }
    if b.read(0, msg.len()) != msg {
        return Err("RECV: payload differs".into());
    }

    // RDMA WRITE
    let data = pattern(8192, 2);
    a.mem.write(8192, &data);
    let op = SendOp::Write {
        remote_addr: b.remote(16384),
        rkey: b.mr.rkey,
    };
    a.send(wr(0x21, op, a.sgl(8192, data.len())), "WRITE")?;
    let wc = a.wait_wc("WRITE").await?;
    expect(&wc, 0x21, WcStatus::Success, WcOpcode::RdmaWrite).map_err(|e| done(e, "WRITE"))?;
    if b.read(16384, data.len()) != data {
        return Err("WRITE: remote bytes differ".into());
    }

    // RDMA WRITE with immediate: data placed, immediate delivered with a receive
    let small = pattern(100, 3);
    a.mem.write(4096, &small);
    b.recv(0x31, Sgl::empty())?;
    let op = SendOp::WriteWithImm {
        remote_addr: b.remote(32768),
        rkey: b.mr.rkey,
        imm: 0xdead_beef,
    };
    a.send(wr(0x32, op, a.sgl(4096, small.len())), "WRITE_IMM")?;
    let wc = a.wait_wc("WRITE_IMM").await?;
    expect(&wc, 0x32, WcStatus::Success, WcOpcode::RdmaWrite).map_err(|e| done(e, "WRITE_IMM"))?;
    let wc = b.wait_wc("WRITE_IMM receive").await?;
    expect(&wc, 0x31, WcStatus::Success, WcOpcode::RecvRdmaWithImm)
        .map_err(|e| done(e, "WRITE_IMM receive"))?;
    if wc.imm != Some(0xdead_beef) {
        return Err(format!("WRITE_IMM: imm {:?}", wc.imm));
    }
    if b.read(32768, small.len()) != small {
        return Err("WRITE_IMM: remote bytes differ".into());
    }

    // RDMA READ of what the WRITE put there
    let op = SendOp::Read {
        remote_addr: b.remote(16384),
        rkey: b.mr.rkey,
    };
    a.send(wr(0x41, op, a.sgl(65536, 4096)), "READ")?;
    let wc = a.wait_wc("READ").await?;
    expect(&wc, 0x41, WcStatus::Success, WcOpcode::RdmaRead).map_err(|e| done(e, "READ"))?;
    if a.read(65536, 4096) != data[..4096] {
        return Err("READ: local bytes differ".into());
    }

    // a bad rkey: remote access error on the requester
    let op = SendOp::Write {
        remote_addr: b.remote(0),
        rkey: MemKey(b.mr.rkey.0 ^ 0x00ff_0000),
    };
    a.send(wr(0x51, op, a.sgl(0, 64)), "bad WRITE")?;
    let wc = a.wait_wc("bad WRITE").await?;
    expect(&wc, 0x51, WcStatus::RemAccessErr, WcOpcode::RdmaWrite)
        .map_err(|e| done(e, "bad rkey"))?;
    Ok(())
}

/// Connect, check, release: the whole suite on devices `a` and `b` of `src`.
pub async fn conformance<S>(
    src: &S,
    a: &str,
    b: &str,
    b_addr: SocketAddr,
    service: u16,
) -> Result<(), String>
where
    S: DeviceSource,
    <S::Device as DeviceContext>::Cm: CmListen,
{
    let (ea, eb) = connect(src, a, b, b_addr, service).await?;
    let r = check(&ea, &eb).await;
    ea.close();
    eb.close();
    r
}

//! rdma_cm with private data, active and passive side: our own FFI over `rdma-mummy-sys`.
//!
//! sideway 0.4.3 wraps rdma_cm, but its `ConnectionParameter` has no private-data setter, its
//! `Identifier` does not expose the raw `rdma_cm_id`, and its `Event` does not expose the
//! private data of a response or reject. NVMe-oF needs all three (NVMe-oF 1.1, 7.3.x: the
//! request carries qid/hrqsize/hsqsize, the accept crqsize, the reject an NVMe status), so
//! connection management is done here directly; the QP stays a sideway object, moved through
//! INIT/RTR/RTS with the attributes `rdma_init_qp_attr` computes (the QP is not attached to
//! the id, so librdmacm reports CONNECT_RESPONSE and we call `rdma_establish` ourselves).
//!
//! Passive side (the built-in target): a listening id ([`CmId::listen`]) reports each
//! CONNECT_REQUEST with a new id, which is moved to an event channel of its own
//! (`rdma_migrate_id`) so that it is read like an active connection; the target brings its
//! own QP up with the same `rdma_init_qp_attr` attributes and answers with
//! [`CmId::accept`] (`conn_param.qp_num` = that QP) or [`CmId::reject`].

use std::mem::MaybeUninit;
use std::net::SocketAddr;
use std::ptr::null_mut;
use std::time::Duration;

use rdma_mummy_sys::{
    ibv_get_device_guid, ibv_qp_attr, rdma_accept, rdma_ack_cm_event, rdma_bind_addr,
    rdma_cm_event, rdma_cm_id, rdma_conn_param, rdma_connect, rdma_create_event_channel,
    rdma_create_id, rdma_destroy_event_channel, rdma_destroy_id, rdma_disconnect, rdma_establish,
    rdma_event_channel, rdma_get_cm_event, rdma_init_qp_attr, rdma_listen, rdma_migrate_id,
    rdma_port_space, rdma_reject, rdma_resolve_addr, rdma_resolve_route,
};
use tokio::io::unix::AsyncFd;

use super::map;
use super::{set_nonblocking, watch, BorrowedRawFd, HwError};
use crate::cm::private::NvmeCmReject;
use crate::verbs::Guid;

/// rdma_cm event types we act on (`enum rdma_cm_event_type`).
pub mod ev {
    pub const ADDR_RESOLVED: u32 = 0;
    pub const ROUTE_RESOLVED: u32 = 2;
    pub const CONNECT_REQUEST: u32 = 4;
    pub const CONNECT_RESPONSE: u32 = 5;
    pub const CONNECT_ERROR: u32 = 6;
    pub const UNREACHABLE: u32 = 7;
    pub const REJECTED: u32 = 8;
    pub const ESTABLISHED: u32 = 9;
    pub const DISCONNECTED: u32 = 10;
    pub const DEVICE_REMOVAL: u32 = 11;
}

/// `RDMA_MAX_RESP_RES` / `RDMA_MAX_INIT_DEPTH`: "what the request asked for, capped by the
/// device" in an accept's `rdma_conn_param`.
const RDMA_MAX_DEPTH: u8 = 0xFF;

/// A connection request taken off a listening id.
pub struct ConnRequest {
    /// The request's own id, on an event channel of its own.
    pub id: CmId,
    /// The request's private data (after the rdma_cm IP header).
    pub private: Vec<u8>,
}

/// What a listening id reports.
pub enum ListenEvent {
    Request(ConnRequest),
    Other(CmEvent),
}

/// One rdma_cm event, copied out before it is acked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CmEvent {
    pub kind: u32,
    pub status: i32,
    pub private: Vec<u8>,
}

impl CmEvent {
    pub fn name(&self) -> &'static str {
        map::cm_event_name(self.kind)
    }
}

/// What a connect attempt ended with, decided from the event alone (testable).
pub fn connect_outcome(e: &CmEvent) -> Result<Vec<u8>, HwError> {
    match e.kind {
        ev::CONNECT_RESPONSE | ev::ESTABLISHED => Ok(e.private.clone()),
        ev::REJECTED => Err(HwError::Rejected {
            status: e.status,
            nvme: NvmeCmReject::parse(&e.private).ok().map(|r| r.status),
        }),
        _ => Err(HwError::CmUnexpected {
            expected: "CONNECT_RESPONSE",
            got: e.name(),
            status: e.status,
        }),
    }
}

/// An rdma_cm id with its own event channel.
pub struct CmId {
    /// Always `Some` until drop, which deregisters it before the channel's fd closes.
    afd: Option<AsyncFd<BorrowedRawFd>>,
    id: *mut rdma_cm_id,
    chan: *mut rdma_event_channel,
}

// SAFETY: librdmacm calls are thread-safe; `CmId` is used by one task at a time (&mut / &).
unsafe impl Send for CmId {}
unsafe impl Sync for CmId {}

impl Drop for CmId {
    fn drop(&mut self) {
        drop(self.afd.take());
        // SAFETY: every event was acked when read, so destroy_id does not block.
        unsafe {
            rdma_destroy_id(self.id);
            rdma_destroy_event_channel(self.chan);
        }
    }
}

/// The address in `ss`, if it is an IPv4 or IPv6 one.
fn socket_addr(ss: &libc::sockaddr_storage) -> Option<SocketAddr> {
    match i32::from(ss.ss_family) {
        libc::AF_INET => {
            // SAFETY: the family says sockaddr_in, which fits in sockaddr_storage.
            let sin: libc::sockaddr_in =
                unsafe { std::ptr::read((ss as *const libc::sockaddr_storage).cast()) };
            let ip = std::net::Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
            Some(SocketAddr::new(ip.into(), u16::from_be(sin.sin_port)))
        }
        libc::AF_INET6 => {
            // SAFETY: as above, sockaddr_in6.
            let sin6: libc::sockaddr_in6 =
                unsafe { std::ptr::read((ss as *const libc::sockaddr_storage).cast()) };
            let ip = std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr);
            Some(SocketAddr::new(ip.into(), u16::from_be(sin6.sin6_port)))
        }
        _ => None,
    }
}

/// The connection parameters of a connect or an accept: QP `qp_num` (not attached to the
/// id), `private` data, flow control on, retries as Linux hosts and targets set them.
fn conn_param(
    qp_num: u32,
    private: &[u8],
    responder_resources: u8,
    initiator_depth: u8,
    rnr_retry_count: u8,
) -> Result<rdma_conn_param, HwError> {
    let len = u8::try_from(private.len())
        .map_err(|_| HwError::Invalid(format!("{} bytes of private data", private.len())))?;
    Ok(rdma_conn_param {
        private_data: private.as_ptr().cast(),
        private_data_len: len,
        responder_resources,
        initiator_depth,
        flow_control: 1,
        retry_count: 7,
        rnr_retry_count,
        srq: 0,
        qp_num,
    })
}

fn sockaddr(addr: SocketAddr) -> libc::sockaddr_storage {
    // SAFETY: all-zero is a valid sockaddr_storage.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than sockaddr_in and suitably aligned.
            unsafe { std::ptr::write(std::ptr::addr_of_mut!(ss).cast(), sin) };
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: as above.
            unsafe { std::ptr::write(std::ptr::addr_of_mut!(ss).cast(), sin6) };
        }
    }
    ss
}

impl CmId {
    /// A fresh id in the TCP port space (what NVMe-oF uses) on its own non-blocking channel.
    pub fn new() -> Result<CmId, HwError> {
        // SAFETY: plain librdmacm constructors; NULL / -1 mean failure with errno set.
        unsafe {
            let chan = rdma_create_event_channel();
            if chan.is_null() {
                return Err(HwError::verbs("rdma_create_event_channel"));
            }
            let fd = (*chan).fd;
            if let Err(e) = set_nonblocking(fd) {
                rdma_destroy_event_channel(chan);
                return Err(e.into());
            }
            let mut id = null_mut();
            if rdma_create_id(chan, &mut id, null_mut(), rdma_port_space::RDMA_PS_TCP) != 0 {
                let e = HwError::verbs("rdma_create_id");
                rdma_destroy_event_channel(chan);
                return Err(e);
            }
            let afd = match watch(fd) {
                Ok(a) => a,
                Err(e) => {
                    rdma_destroy_id(id);
                    rdma_destroy_event_channel(chan);
                    return Err(e.into());
                }
            };
            Ok(CmId {
                afd: Some(afd),
                id,
                chan,
            })
        }
    }

    /// Take `raw`, a connection request's id, off its listener's channel onto one of its
    /// own. On failure the request is rejected and its id destroyed.
    ///
    /// # Safety
    /// `raw` is the id of a CONNECT_REQUEST event already acked, not used elsewhere.
    unsafe fn adopt(raw: *mut rdma_cm_id) -> Result<CmId, HwError> {
        let refuse = |e: HwError| {
            // SAFETY: per the contract, `raw` is ours to answer and destroy.
            unsafe {
                rdma_reject(raw, std::ptr::null(), 0);
                rdma_destroy_id(raw);
            }
            e
        };
        // SAFETY: plain librdmacm constructor; NULL means failure with errno set.
        let chan = unsafe { rdma_create_event_channel() };
        if chan.is_null() {
            return Err(refuse(HwError::verbs("rdma_create_event_channel")));
        }
        // SAFETY: `chan` is live.
        let fd = unsafe { (*chan).fd };
        let moved = set_nonblocking(fd)
            .map_err(HwError::from)
            // SAFETY: both live; the migrate waits for the request's event, acked already.
            .and_then(|()| match unsafe { rdma_migrate_id(raw, chan) } {
                0 => Ok(()),
                _ => Err(HwError::verbs("rdma_migrate_id")),
            })
            // SAFETY: the channel (and its fd) lives as long as the `CmId` made of it, which
            // drops the watch first.
            .and_then(|()| unsafe { watch(fd) }.map_err(HwError::from));
        match moved {
            Ok(afd) => Ok(CmId {
                afd: Some(afd),
                id: raw,
                chan,
            }),
            Err(e) => {
                let e = refuse(e);
                // SAFETY: no id is left on the channel (destroyed above).
                unsafe { rdma_destroy_event_channel(chan) };
                Err(e)
            }
        }
    }

    /// The next event, if one is pending, with what `also` reads of it before it is acked.
    fn take_event<T>(
        &self,
        also: impl FnOnce(&rdma_cm_event) -> T,
    ) -> Result<Option<(CmEvent, T)>, HwError> {
        let mut e: *mut rdma_cm_event = null_mut();
        // SAFETY: non-blocking channel; on success `e` is ours until acked.
        let ret = unsafe { rdma_get_cm_event(self.chan, &mut e) };
        if ret != 0 {
            let err = std::io::Error::last_os_error();
            return match err.kind() {
                std::io::ErrorKind::WouldBlock => Ok(None),
                _ => Err(HwError::Verbs {
                    call: "rdma_get_cm_event",
                    source: err,
                }),
            };
        }
        // SAFETY: `e` is a valid event; the conn param is the active union member for
        // connection events, and for others private_data is NULL / len 0.
        let out = unsafe {
            let kind = std::ptr::addr_of!((*e).event).cast::<u32>().read();
            let conn = &(*e).param.conn;
            let private = if conn.private_data.is_null() || conn.private_data_len == 0 {
                Vec::new()
            } else {
                std::slice::from_raw_parts(
                    conn.private_data.cast::<u8>(),
                    usize::from(conn.private_data_len),
                )
                .to_vec()
            };
            let ev = CmEvent {
                kind,
                status: (*e).status,
                private,
            };
            let extra = also(&*e);
            rdma_ack_cm_event(e);
            (ev, extra)
        };
        Ok(Some(out))
    }

    /// The next event, if one is pending.
    pub fn try_event(&self) -> Result<Option<CmEvent>, HwError> {
        Ok(self.take_event(|_| ())?.map(|(e, ())| e))
    }

    /// Wait for the next event of a listening id: a connection request (on an id of its
    /// own), or anything else.
    pub async fn listen_event(&self) -> Result<ListenEvent, HwError> {
        loop {
            let afd = self.afd.as_ref().ok_or(HwError::CmTimeout("closed id"))?;
            let mut g = afd.readable().await?;
            let got = self.take_event(|e| {
                // SAFETY: plain field reads of a live event.
                let kind = unsafe { std::ptr::addr_of!(e.event).cast::<u32>().read() };
                (kind == ev::CONNECT_REQUEST).then_some(e.id)
            })?;
            match got {
                None => g.clear_ready(),
                Some((e, Some(raw))) if !raw.is_null() => {
                    // SAFETY: the request's id, its event acked by `take_event`.
                    let id = unsafe { CmId::adopt(raw) }?;
                    return Ok(ListenEvent::Request(ConnRequest {
                        id,
                        private: e.private,
                    }));
                }
                Some((e, _)) => return Ok(ListenEvent::Other(e)),
            }
        }
    }

    /// Bind to `at` (an address of an RDMA device's netdev, or a wildcard) and listen.
    pub fn listen(&self, at: SocketAddr, backlog: i32) -> Result<(), HwError> {
        let mut ss = sockaddr(at);
        // SAFETY: `ss` outlives the call; librdmacm copies the address.
        if unsafe { rdma_bind_addr(self.id, (&raw mut ss).cast()) } != 0 {
            return Err(HwError::verbs("rdma_bind_addr"));
        }
        // SAFETY: bound id.
        if unsafe { rdma_listen(self.id, backlog) } != 0 {
            return Err(HwError::verbs("rdma_listen"));
        }
        Ok(())
    }

    /// The peer's address of a connection (its IP and rdma_cm source port).
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        // SAFETY: plain field read; librdmacm fills the route of a request's id.
        let ss = unsafe { &(*self.id).route.addr.dst_addr_union.dst_storage };
        socket_addr(ss)
    }

    /// Accept a connection request with QP `qp_num` (not attached to the id, in RTS by now)
    /// and `private` data. The read depths are the request's, capped by the device (what
    /// the QP was brought up with).
    pub fn accept(&self, qp_num: u32, private: &[u8], rnr_retry_count: u8) -> Result<(), HwError> {
        let mut p = conn_param(
            qp_num,
            private,
            RDMA_MAX_DEPTH,
            RDMA_MAX_DEPTH,
            rnr_retry_count,
        )?;
        // SAFETY: `p` and `private` outlive the call; librdmacm copies the private data.
        if unsafe { rdma_accept(self.id, &mut p) } != 0 {
            return Err(HwError::verbs("rdma_accept"));
        }
        Ok(())
    }

    /// Refuse a connection request with `private` data (a consumer-defined REJ).
    pub fn reject(&self, private: &[u8]) -> Result<(), HwError> {
        let len = u8::try_from(private.len())
            .map_err(|_| HwError::Invalid(format!("{} bytes of private data", private.len())))?;
        // SAFETY: librdmacm copies the private data.
        if unsafe { rdma_reject(self.id, private.as_ptr().cast(), len) } != 0 {
            return Err(HwError::verbs("rdma_reject"));
        }
        Ok(())
    }

    /// Wait for the next event.
    pub async fn event(&self, timeout: Duration, what: &'static str) -> Result<CmEvent, HwError> {
        let wait = async {
            loop {
                let afd = self.afd.as_ref().ok_or(HwError::CmTimeout("closed id"))?;
                let mut g = afd.readable().await?;
                match self.try_event()? {
                    Some(e) => return Ok::<_, HwError>(e),
                    None => g.clear_ready(),
                }
            }
        };
        tokio::time::timeout(timeout, wait)
            .await
            .map_err(|_| HwError::CmTimeout(what))?
    }

    async fn expect(
        &self,
        kind: u32,
        timeout: Duration,
        what: &'static str,
    ) -> Result<(), HwError> {
        let e = self.event(timeout, what).await?;
        if e.kind == kind {
            Ok(())
        } else {
            Err(HwError::CmUnexpected {
                expected: what,
                got: e.name(),
                status: e.status,
            })
        }
    }

    /// Resolve `dst` to a device/port and a route.
    pub async fn resolve(&self, dst: SocketAddr, timeout: Duration) -> Result<(), HwError> {
        let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
        let mut ss = sockaddr(dst);
        // SAFETY: `ss` outlives the call; librdmacm copies the address.
        let ret = unsafe { rdma_resolve_addr(self.id, null_mut(), (&raw mut ss).cast(), ms) };
        if ret != 0 {
            return Err(HwError::verbs("rdma_resolve_addr"));
        }
        self.expect(ev::ADDR_RESOLVED, timeout * 2, "ADDR_RESOLVED")
            .await?;
        // SAFETY: id is bound after ADDR_RESOLVED.
        if unsafe { rdma_resolve_route(self.id, ms) } != 0 {
            return Err(HwError::verbs("rdma_resolve_route"));
        }
        self.expect(ev::ROUTE_RESOLVED, timeout * 2, "ROUTE_RESOLVED")
            .await
    }

    /// The node GUID of the device the id is bound to (after [`CmId::resolve`]).
    pub fn device_guid(&self) -> Option<Guid> {
        // SAFETY: `verbs` is set by librdmacm once bound, else NULL.
        unsafe {
            let verbs = (*self.id).verbs;
            if verbs.is_null() || (*verbs).device.is_null() {
                return None;
            }
            Some(map::guid_from_be64(ibv_get_device_guid((*verbs).device)))
        }
    }

    /// The device port the id is bound to.
    pub fn port(&self) -> u8 {
        // SAFETY: plain field read.
        unsafe { (*self.id).port_num }
    }

    /// The attributes rdma_cm computes for moving a QP to `state` (`ibv_qp_state`: 1 INIT,
    /// 2 RTR, 3 RTS) on this id's path, with their mask.
    pub fn qp_attr(&self, state: u32) -> Result<(ibv_qp_attr, i32), HwError> {
        let mut attr = MaybeUninit::<ibv_qp_attr>::zeroed();
        let mut mask = 0;
        // SAFETY: attr is zeroed and large enough; qp_state selects what is computed.
        unsafe {
            (*attr.as_mut_ptr()).qp_state = state;
            if rdma_init_qp_attr(self.id, attr.as_mut_ptr(), &mut mask) != 0 {
                return Err(HwError::verbs("rdma_init_qp_attr"));
            }
            Ok((attr.assume_init(), mask))
        }
    }

    /// Send the REQ for QP `qp_num` (not attached to the id) carrying `private`, and wait for
    /// the answer: the event (CONNECT_RESPONSE with the REP's private data), or the reject as
    /// [`HwError::Rejected`].
    pub async fn request(
        &self,
        qp_num: u32,
        private: &[u8],
        responder_resources: u8,
        initiator_depth: u8,
        timeout: Duration,
    ) -> Result<CmEvent, HwError> {
        let ret = {
            let mut p = conn_param(qp_num, private, responder_resources, initiator_depth, 7)?;
            // SAFETY: `p` and `private` outlive the call; librdmacm copies the private data.
            unsafe { rdma_connect(self.id, &mut p) }
        };
        if ret != 0 {
            return Err(HwError::verbs("rdma_connect"));
        }
        let e = self.event(timeout, "CONNECT_RESPONSE").await?;
        connect_outcome(&e)?;
        Ok(e)
    }

    /// Send the RTU once our QP is in RTS (a QP not attached to the id).
    pub fn establish(&self) -> Result<(), HwError> {
        // SAFETY: connected id.
        if unsafe { rdma_establish(self.id) } != 0 {
            return Err(HwError::verbs("rdma_establish"));
        }
        Ok(())
    }

    /// Send a DREQ (idempotent from the caller's point of view: errors are returned, not fatal).
    pub fn disconnect(&self) -> Result<(), HwError> {
        // SAFETY: plain call on a live id.
        if unsafe { rdma_disconnect(self.id) } != 0 {
            return Err(HwError::verbs("rdma_disconnect"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cm::private::{NvmeCmAccept, NvmeRejectStatus};

    #[test]
    fn outcome_of_accept_reject_and_other_events() {
        let acc = NvmeCmAccept { crqsize: 128 }.emit().to_vec();
        let e = CmEvent {
            kind: ev::CONNECT_RESPONSE,
            status: 0,
            private: acc.clone(),
        };
        assert_eq!(connect_outcome(&e).unwrap(), acc);
        // nvmet-rdma rejects with a consumer REJ (reason 28) carrying nvme_rdma_cm_rej.
        let rej = NvmeCmReject::new(NvmeRejectStatus::InvalidQid)
            .emit()
            .to_vec();
        let e = CmEvent {
            kind: ev::REJECTED,
            status: 28,
            private: rej,
        };
        match connect_outcome(&e) {
            Err(HwError::Rejected { status, nvme }) => {
                assert_eq!(status, 28);
                assert_eq!(nvme, Some(NvmeRejectStatus::InvalidQid));
            }
            other => panic!("{other:?}"),
        }
        // A reject with no / short private data (e.g. invalid service ID: nothing listens).
        let e = CmEvent {
            kind: ev::REJECTED,
            status: 8,
            private: vec![0],
        };
        assert!(matches!(
            connect_outcome(&e),
            Err(HwError::Rejected {
                status: 8,
                nvme: None
            })
        ));
        let e = CmEvent {
            kind: 7,
            status: -110,
            private: vec![],
        };
        assert!(matches!(
            connect_outcome(&e),
            Err(HwError::CmUnexpected {
                got: "UNREACHABLE",
                ..
            })
        ));
    }

    #[test]
    fn peer_addresses_decode_what_sockaddr_encodes() {
        for a in ["192.168.100.1:40123", "[fe80::5054:ff:fe12:3456]:4420"] {
            let a: SocketAddr = a.parse().unwrap();
            assert_eq!(socket_addr(&sockaddr(a)), Some(a));
        }
        // SAFETY: all-zero is a valid sockaddr_storage (family AF_UNSPEC).
        let none: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        assert_eq!(socket_addr(&none), None);
    }

    #[test]
    fn sockaddr_encodes_v4_and_v6() {
        let ss = sockaddr("10.0.2.15:4420".parse().unwrap());
        // SAFETY: we just wrote a sockaddr_in there.
        let sin: libc::sockaddr_in = unsafe { std::ptr::read((&raw const ss).cast()) };
        assert_eq!(i32::from(sin.sin_family), libc::AF_INET);
        assert_eq!(u16::from_be(sin.sin_port), 4420);
        assert_eq!(sin.sin_addr.s_addr.to_ne_bytes(), [10, 0, 2, 15]);
        let ss = sockaddr("[fe80::1]:4420".parse().unwrap());
        // SAFETY: as above, sockaddr_in6.
        let sin6: libc::sockaddr_in6 = unsafe { std::ptr::read((&raw const ss).cast()) };
        assert_eq!(i32::from(sin6.sin6_family), libc::AF_INET6);
        assert_eq!(u16::from_be(sin6.sin6_port), 4420);
        assert_eq!(sin6.sin6_addr.s6_addr[0], 0xfe);
    }
}

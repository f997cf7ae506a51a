//! UDP socket set-up and batched I/O for RoCEv2 datagrams.
//!
//! Sending: packets are queued in a [`TxBatch`] and leave in runs that share a destination
//! and a size, each run as one `sendmsg` with `UDP_SEGMENT` (GSO), so the kernel walks its
//! stack once per run instead of once per packet. Receiving: `recvmmsg` with `UDP_GRO`, so a
//! run can arrive whole and is split here at the segment size the kernel reports.
//! Both fall back to one datagram per syscall where the kernel says no.
//!
//! GSO numbers the IPv4 identification of the segments 0, 1, 2…, and the ICRC covers that
//! field; a peer that verifies ICRCs against real IP headers (rxe, NICs) needs GSO off.

use std::io;
use std::mem::MaybeUninit;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;

use socket2::{Domain, Protocol, Socket, Type};

const SOL_UDP: libc::c_int = 17;
const UDP_SEGMENT: libc::c_int = 103;
const UDP_GRO: libc::c_int = 104;

/// Receive slots per wakeup.
pub const RX_SLOTS: usize = 32;
/// A slot holds a whole GRO run (up to 64 KiB).
const RX_SLOT: usize = 65_536;
/// Most bytes in one GSO send (an IPv4 UDP datagram's limit, with room for headers).
const GSO_MAX_BYTES: usize = 65_000;
const GSO_MAX_SEGS: usize = 64;
/// Runs handed to one `sendmmsg`.
const MMSG_RUNS: usize = 64;

fn setsockopt_int(
    fd: i32,
    level: libc::c_int,
    name: libc::c_int,
    val: libc::c_int,
) -> io::Result<()> {
    // SAFETY: setsockopt on an fd we own with a c_int option value.
    let r = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            &val as *const _ as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Bind a non-blocking UDP socket for a soft-HCA: big buffers, DF set so Linux sends with IP
/// identification 0 from an unconnected socket (the ICRC covers it), and GRO if asked.
/// Returns the socket and whether GRO is on.
pub fn bind_roce_socket(
    addr: SocketAddr,
    offload: bool,
) -> io::Result<(tokio::net::UdpSocket, bool)> {
    bind_udp(addr, offload, false)
}

/// Receive buffer a device socket asks for: a burst (a peer's window of 128 KiB writes, a
/// flood of connection requests) waits there while the device's thread is not polling.
const RECV_BUFFER: usize = 16 << 20;

/// Ask for a `bytes` receive buffer. The kernel caps SO_RCVBUF at `net.core.rmem_max`
/// (about 208 KiB by default, a few hundred datagrams); where the process may
/// (CAP_NET_ADMIN), SO_RCVBUFFORCE goes past the cap, as the kernel's own RDMA users and
/// packet capture tools do. Otherwise the capped size stays.
fn grow_recv_buffer(s: &Socket, bytes: usize) {
    let _ = s.set_recv_buffer_size(bytes);
    if s.recv_buffer_size().is_ok_and(|n| n < bytes) {
        let _ = setsockopt_int(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUFFORCE,
            bytes as libc::c_int,
        );
    }
}

/// As [`bind_roce_socket`]; `send_only`: a filter that accepts nothing is attached before
/// the bind, so the socket keeps the port (no ICMP port unreachable goes back) while its
/// datagrams are read off a [`RawRx`] instead and each is handled once. The kernel counts
/// the filtered datagrams as UDP receive errors (`InErrors` in /proc/net/snmp).
pub(crate) fn bind_udp(
    addr: SocketAddr,
    offload: bool,
    send_only: bool,
) -> io::Result<(tokio::net::UdpSocket, bool)> {
    let domain = if addr.is_ipv4() {
        Domain::IPV4
    } else {
        Domain::IPV6
    };
    let s = Socket::new(domain, Type::DGRAM, Some(Protocol::UDP))?;
    grow_recv_buffer(&s, RECV_BUFFER);
    let _ = s.set_send_buffer_size(16 << 20);
    if addr.is_ipv4() {
        setsockopt_int(
            s.as_raw_fd(),
            libc::IPPROTO_IP,
            libc::IP_MTU_DISCOVER,
            libc::IP_PMTUDISC_DO,
        )?;
    }
    if send_only {
        s.attach_filter(&[bpf(BPF_RET | BPF_K, 0, 0, 0)])?;
    }
    let gro = offload && setsockopt_int(s.as_raw_fd(), SOL_UDP, UDP_GRO, 1).is_ok();
    s.set_nonblocking(true)?;
    s.bind(&addr.into())?;
    Ok((tokio::net::UdpSocket::from_std(s.into())?, gro))
}

// Classic BPF (linux/filter.h).
const BPF_LD: u16 = 0x00;
const BPF_LDX: u16 = 0x01;
const BPF_JMP: u16 = 0x05;
const BPF_RET: u16 = 0x06;
const BPF_B: u16 = 0x10;
const BPF_H: u16 = 0x08;
const BPF_ABS: u16 = 0x20;
const BPF_IND: u16 = 0x40;
const BPF_MSH: u16 = 0xa0;
const BPF_JEQ: u16 = 0x10;
const BPF_JSET: u16 = 0x40;
const BPF_K: u16 = 0x00;

fn bpf(code: u16, jt: u8, jf: u8, k: u32) -> libc::sock_filter {
    libc::sock_filter { code, jt, jf, k }
}

/// The filter of a [`RawRx`] for UDP port `port`, run on each IPv4 datagram from its header
/// on: keep UDP, not a fragment, to `port`; everything else stays in the kernel.
fn raw_filter(port: u16) -> [libc::sock_filter; 9] {
    const DROP: u8 = 8; // index of the last instruction
    [
        bpf(BPF_LD | BPF_B | BPF_ABS, 0, 0, 9), // protocol
        bpf(BPF_JMP | BPF_JEQ | BPF_K, 0, DROP - 2, 17),
        bpf(BPF_LD | BPF_H | BPF_ABS, 0, 0, 6), // flags and fragment offset
        bpf(BPF_JMP | BPF_JSET | BPF_K, DROP - 4, 0, 0x3FFF), // MF or an offset
        bpf(BPF_LDX | BPF_B | BPF_MSH, 0, 0, 0), // X = IP header length
        bpf(BPF_LD | BPF_H | BPF_IND, 0, 0, 2), // UDP destination port
        bpf(BPF_JMP | BPF_JEQ | BPF_K, 0, DROP - 7, u32::from(port)),
        bpf(BPF_RET | BPF_K, 0, 0, u32::MAX), // the whole datagram
        bpf(BPF_RET | BPF_K, 0, 0, 0),
    ]
}

/// A raw IPv4 socket that receives the datagrams of one UDP socket with their IP headers
/// (`socket(AF_INET, SOCK_RAW, IPPROTO_UDP)` gets a copy of every UDP datagram the host
/// receives; a classic BPF filter keeps those to our port, and binding to our address those
/// to our address). Needs CAP_NET_RAW. The UDP socket must be bound with `send_only`, and
/// without GRO: a coalesced run would show one IP header for many packets.
pub(crate) struct RawRx {
    fd: tokio::io::unix::AsyncFd<Socket>,
}

impl RawRx {
    /// Open one for the UDP socket bound to `local` (an IPv4 address; the unspecified
    /// address takes the port on every local address). EPERM without CAP_NET_RAW.
    pub(crate) fn open(local: std::net::SocketAddrV4) -> io::Result<RawRx> {
        let s = Socket::new(Domain::IPV4, Type::RAW, Some(Protocol::UDP))?;
        let f = raw_filter(local.port());
        s.attach_filter(&f)?;
        grow_recv_buffer(&s, RECV_BUFFER);
        if !local.ip().is_unspecified() {
            s.bind(&SocketAddr::new((*local.ip()).into(), 0).into())?;
        }
        s.set_nonblocking(true)?;
        // SAFETY: `s` is an open socket the AsyncFd takes ownership of; socket2's as_raw_fd
        // returns its one descriptor until it is dropped with the AsyncFd.
        let fd = unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(s, tokio::io::Interest::READABLE)
        }
        .map_err(io::Error::from)?;
        Ok(RawRx { fd })
    }

    /// Resolves once a receive may find datagrams.
    pub(crate) async fn readable(&self) -> io::Result<()> {
        // The guard is dropped without clearing: the next `recv` clears readiness when it
        // finds the socket empty.
        self.fd.readable().await.map(drop)
    }

    /// Does tokio hold the socket readable now? Registers nothing; the readiness stays set.
    pub(crate) fn ready(&self) -> bool {
        self.fd
            .try_io(tokio::io::Interest::READABLE, |_| Ok(()))
            .is_ok()
    }
}

/// Outgoing packets of one driver turn.
pub struct TxBatch {
    pub buf: Vec<u8>,
    pkts: Vec<(SocketAddr, usize, usize)>,
    gso: bool,
}

impl TxBatch {
    pub fn new(gso: bool) -> TxBatch {
        TxBatch {
            buf: Vec::with_capacity(256 << 10),
            pkts: Vec::with_capacity(256),
            gso,
        }
    }

    /// Record that the bytes from `start` to the end of `buf` are one packet for `dst`.
    pub fn push(&mut self, dst: SocketAddr, start: usize) {
        self.pkts.push((dst, start, self.buf.len() - start));
    }

    pub fn len(&self) -> usize {
        self.pkts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pkts.is_empty()
    }

    /// Up to `runs.len()` runs from packet `first`, written to `runs` as (first packet, one
    /// past the last, segment size, bytes); returns how many.
    #[inline]
    fn cut_runs(&self, first: usize, runs: &mut [(usize, usize, usize, usize)]) -> usize {
        let mut nruns = 0;
        let mut i = first;
        while i < self.pkts.len() && nruns < runs.len() {
            let (dst, start, seg) = self.pkts[i];
            let mut j = i + 1;
            let mut total = seg;
            if self.gso {
                // A run is one slice of `buf`: packets back to back (a packet taken by the
                // loopback path leaves a gap).
                while j < self.pkts.len() && j - i < GSO_MAX_SEGS {
                    let (d, s, l) = self.pkts[j];
                    if d != dst || s != start + total || l > seg || total + l > GSO_MAX_BYTES {
                        break;
                    }
                    total += l;
                    j += 1;
                    if l < seg {
                        break; // only the last segment may be short
                    }
                }
            }
            runs[nruns] = (i, j, seg, total);
            nruns += 1;
            i = j;
        }
        nruns
    }

    /// Send everything queued: consecutive packets to one destination with one size (the
    /// last may be shorter) make a run, sent as one GSO datagram; the runs go to the kernel
    /// in one `sendmmsg`. A full socket buffer drops the rest, as a congested link would;
    /// the RC retransmit machinery recovers.
    pub fn flush(&mut self, sock: &tokio::net::UdpSocket) {
        let fd = sock.as_raw_fd();
        let mut first = 0;
        'runs: while first < self.pkts.len() {
            let mut runs = [(0usize, 0usize, 0usize, 0usize); MMSG_RUNS];
            let nruns = self.cut_runs(first, &mut runs);
            let mut names: [libc::sockaddr_storage; MMSG_RUNS] = unsafe { std::mem::zeroed() };
            let mut iovs: [libc::iovec; MMSG_RUNS] = unsafe { std::mem::zeroed() };
            let mut controls = [[0u64; 4]; MMSG_RUNS];
            let mut hdrs: [libc::mmsghdr; MMSG_RUNS] = unsafe { std::mem::zeroed() };
            for (k, &(i, j, seg, total)) in runs[..nruns].iter().enumerate() {
                let (dst, start, _) = self.pkts[i];
                let (name, namelen) = sockaddr_from_std(dst);
                names[k] = name;
                iovs[k] = libc::iovec {
                    iov_base: self.buf[start..start + total].as_ptr() as *mut libc::c_void,
                    iov_len: total,
                };
                let h = &mut hdrs[k].msg_hdr;
                h.msg_name = &mut names[k] as *mut _ as *mut libc::c_void;
                h.msg_namelen = namelen;
                h.msg_iov = &mut iovs[k];
                h.msg_iovlen = 1;
                if j - i > 1 {
                    // SAFETY: the control buffer is 32 bytes, enough for one u16 cmsg.
                    unsafe {
                        h.msg_control = controls[k].as_mut_ptr() as *mut libc::c_void;
                        h.msg_controllen =
                            libc::CMSG_SPACE(std::mem::size_of::<u16>() as u32) as usize;
                        let c = libc::CMSG_FIRSTHDR(h);
                        (*c).cmsg_level = SOL_UDP;
                        (*c).cmsg_type = UDP_SEGMENT;
                        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<u16>() as u32) as usize;
                        std::ptr::write_unaligned(libc::CMSG_DATA(c) as *mut u16, seg as u16);
                    }
                }
            }
            // Sends go straight to the kernel: tokio's readiness cache starts "not writable"
            // on a new socket, so its try_send_to would drop the very first datagram.
            let mut k = 0;
            while k < nruns {
                // SAFETY: every header points at live buffers sized as declared.
                let n = unsafe {
                    libc::sendmmsg(
                        fd,
                        hdrs[k..].as_mut_ptr(),
                        (nruns - k) as u32,
                        libc::MSG_DONTWAIT,
                    )
                };
                if n > 0 {
                    k += n as usize;
                    continue;
                }
                let e = io::Error::last_os_error();
                let (i, j, _, _) = runs[k];
                match e.raw_os_error() {
                    _ if e.kind() == io::ErrorKind::WouldBlock => break 'runs,
                    Some(libc::EIO) | Some(libc::EINVAL) | Some(libc::EOPNOTSUPP) if j - i > 1 => {
                        tracing::info!(error = %e, "UDP GSO refused; sending one datagram per packet");
                        self.gso = false;
                        first = i; // resend from this run, packet by packet
                        continue 'runs;
                    }
                    _ => {
                        tracing::debug!(error = %e, dst = %self.pkts[i].0, "send failed");
                        k += 1;
                    }
                }
            }
            first = runs[nruns - 1].1;
        }
        self.pkts.clear();
        self.buf.clear();
    }
}

fn sockaddr_from_std(a: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    let s: socket2::SockAddr = a.into();
    // SAFETY: SockAddr holds a valid sockaddr of `len` bytes inside a sockaddr_storage.
    unsafe {
        let mut st: libc::sockaddr_storage = std::mem::zeroed();
        std::ptr::copy_nonoverlapping(
            s.as_ptr() as *const u8,
            &mut st as *mut _ as *mut u8,
            s.len() as usize,
        );
        (st, s.len())
    }
}

/// Receive buffers for a batch of datagrams (recvmmsg, with GRO runs split into packets).
pub struct RxBatch {
    bufs: Vec<u8>,
    /// (source, start, len) of each packet of the last `recv`.
    pkts: Vec<(SocketAddr, usize, usize)>,
}

impl Default for RxBatch {
    fn default() -> Self {
        Self::new()
    }
}

impl RxBatch {
    pub fn new() -> RxBatch {
        RxBatch {
            bufs: vec![0u8; RX_SLOT * RX_SLOTS],
            pkts: Vec::with_capacity(RX_SLOTS * 16),
        }
    }

    pub fn len(&self) -> usize {
        self.pkts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pkts.is_empty()
    }

    /// Packet `i` of the last `recv`.
    pub fn get(&self, i: usize) -> (SocketAddr, &[u8]) {
        let (a, s, l) = self.pkts[i];
        (a, &self.bufs[s..s + l])
    }

    /// Drain what is queued without blocking; returns the number of packets.
    pub fn recv(&mut self, sock: &tokio::net::UdpSocket) -> io::Result<usize> {
        self.pkts.clear();
        let fd = sock.as_raw_fd();
        let r = sock.try_io(tokio::io::Interest::READABLE, || self.recvmmsg(fd));
        self.received(r)
    }

    /// As [`RxBatch::recv`], from a raw socket: each packet is an IPv4 datagram, header
    /// included, and its source port is 0.
    pub(crate) fn recv_raw(&mut self, raw: &RawRx) -> io::Result<usize> {
        self.pkts.clear();
        let r = raw.fd.try_io(tokio::io::Interest::READABLE, |s| {
            self.recvmmsg(s.as_raw_fd())
        });
        self.received(r)
    }

    fn received(&self, r: io::Result<()>) -> io::Result<usize> {
        match r {
            Ok(()) => Ok(self.pkts.len()),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(0),
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => Ok(0),
            Err(e) => Err(e),
        }
    }

    fn recvmmsg(&mut self, fd: i32) -> io::Result<()> {
        let mut names: [MaybeUninit<libc::sockaddr_storage>; RX_SLOTS] =
            [MaybeUninit::zeroed(); RX_SLOTS];
        let mut iovs: [libc::iovec; RX_SLOTS] = unsafe { std::mem::zeroed() };
        let mut hdrs: [libc::mmsghdr; RX_SLOTS] = unsafe { std::mem::zeroed() };
        let mut controls = [[0u64; 8]; RX_SLOTS];
        for i in 0..RX_SLOTS {
            iovs[i] = libc::iovec {
                iov_base: self.bufs[i * RX_SLOT..].as_mut_ptr() as *mut libc::c_void,
                iov_len: RX_SLOT,
            };
            let h = &mut hdrs[i].msg_hdr;
            h.msg_name = names[i].as_mut_ptr() as *mut libc::c_void;
            h.msg_namelen = std::mem::size_of::<libc::sockaddr_storage>() as u32;
            h.msg_iov = &mut iovs[i];
            h.msg_iovlen = 1;
            h.msg_control = controls[i].as_mut_ptr() as *mut libc::c_void;
            h.msg_controllen = std::mem::size_of::<[u64; 8]>();
        }
        // SAFETY: every header points at live buffers sized as declared.
        let n = unsafe {
            libc::recvmmsg(
                fd,
                hdrs.as_mut_ptr(),
                RX_SLOTS as u32,
                libc::MSG_DONTWAIT,
                std::ptr::null_mut(),
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        for (i, h) in hdrs.iter().enumerate().take(n as usize) {
            let len = h.msg_len as usize;
            // SAFETY: the kernel filled msg_namelen bytes of a sockaddr_storage.
            let Some(src) = (unsafe { sockaddr_to_std(names[i].as_ptr()) }) else {
                continue;
            };
            if h.msg_hdr.msg_flags & libc::MSG_TRUNC != 0 {
                // Too long for any RoCEv2 packet: hand the parser an empty one to count.
                self.pkts.push((src, i * RX_SLOT, 0));
                continue;
            }
            let seg = gro_segment_size(&h.msg_hdr).unwrap_or(len).max(1);
            let mut off = 0;
            while off < len {
                let l = seg.min(len - off);
                self.pkts.push((src, i * RX_SLOT + off, l));
                off += l;
            }
        }
        Ok(())
    }
}

fn gro_segment_size(h: &libc::msghdr) -> Option<usize> {
    // SAFETY: walking the control buffer the kernel filled, with the libc macros.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(h);
        while !c.is_null() {
            if (*c).cmsg_level == SOL_UDP && (*c).cmsg_type == UDP_GRO {
                let v = std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const libc::c_int);
                return usize::try_from(v).ok();
            }
            c = libc::CMSG_NXTHDR(h, c);
        }
    }
    None
}

unsafe fn sockaddr_to_std(sa: *const libc::sockaddr_storage) -> Option<SocketAddr> {
    match (*sa).ss_family as i32 {
        libc::AF_INET => {
            let a = &*(sa as *const libc::sockaddr_in);
            let ip = std::net::Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr));
            Some(SocketAddr::new(ip.into(), u16::from_be(a.sin_port)))
        }
        libc::AF_INET6 => {
            let a = &*(sa as *const libc::sockaddr_in6);
            let ip = std::net::Ipv6Addr::from(a.sin6_addr.s6_addr);
            Some(SocketAddr::new(ip.into(), u16::from_be(a.sin6_port)))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A packet the loopback path took out of the middle of a turn leaves a gap in the
    /// transmit buffer: the GSO run either side of it must not carry the gap's bytes.
    #[tokio::test]
    async fn a_gso_run_stops_at_a_gap_in_the_buffer() {
        let rx = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        rx.set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        let (tx, gso) = bind_udp("127.0.0.1:0".parse().unwrap(), true, false).unwrap();
        let mut batch = TxBatch::new(gso);
        let dst = rx.local_addr().unwrap();
        for (byte, send) in [(b'a', true), (b'g', false), (b'b', true), (b'c', true)] {
            let start = batch.buf.len();
            batch.buf.extend_from_slice(&[byte; 100]);
            if send {
                batch.push(dst, start);
            }
        }
        batch.flush(&tx);
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        for _ in 0..3 {
            let n = rx.recv(&mut buf).unwrap();
            got.push(buf[..n].to_vec());
        }
        assert_eq!(got, [vec![b'a'; 100], vec![b'b'; 100], vec![b'c'; 100]]);
    }
}

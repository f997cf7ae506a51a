//! The UDP ceiling under the soft-HCA, measured on this machine: how many packets per second
//! (and per CPU-second) loopback UDP moves with the send strategies the driver can use.
//!
//! `cargo run --release --example udp_pps [seconds per row, default 1]`
//!
//! One sender thread and one receiver thread over 127.0.0.1. The sender sends as fast as it
//! can, (a) one `sendto` per packet, (b) `sendmmsg` of 32 packets, (c) `sendmmsg` of GSO runs
//! (`UDP_SEGMENT`, 64 segments or 65,000 bytes a run); the receiver takes `recvmmsg` of 32
//! slots of 64 KiB with `UDP_GRO` on, splitting runs at the segment size the kernel reports
//! (what `src/driver/socket.rs` does). Payloads: 100 bytes (an ACK or a capsule) and 4,124
//! bytes (4 KiB of data + BTH, RETH, ICRC). Per row: packets/s sent and received, and the
//! CPU time (getrusage of each thread) per packet on each side, so "packets per core-second"
//! is 1e9 / ns-per-packet. On loopback the sender's system time includes the receive path
//! up to the socket queue (the softirq runs in the sending thread), the receiver's only the
//! copy out. Packets the receive queue had no room for are lost and not counted received.
use std::io;
use std::net::UdpSocket;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const SOL_UDP: libc::c_int = 17;
const UDP_SEGMENT: libc::c_int = 103;
const UDP_GRO: libc::c_int = 104;
const BATCH: usize = 32;
const RX_SLOT: usize = 65_536;
const GSO_SEGS: usize = 64;
const GSO_BYTES: usize = 65_000;

#[derive(Clone, Copy, PartialEq, Debug)]
enum Mode {
    SendTo,
    SendMmsg,
    Gso,
}

/// CPU seconds (user + system) of the calling thread.
fn thread_cpu() -> f64 {
    // SAFETY: getrusage fills the struct.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut u) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    t(u.ru_utime) + t(u.ru_stime)
}

struct Side {
    packets: u64,
    syscalls: u64,
    cpu: f64,
}

fn sender(sock: UdpSocket, mode: Mode, size: usize, stop: Arc<AtomicBool>) -> Side {
    let fd = sock.as_raw_fd();
    let per_run = match mode {
        Mode::Gso => GSO_SEGS.min(GSO_BYTES / size),
        _ => 1,
    };
    let msgs = match mode {
        Mode::SendTo => 1,
        _ => BATCH,
    };
    let buf = vec![0x5au8; size * per_run];
    let mut iovs: Vec<libc::iovec> = (0..msgs)
        .map(|_| libc::iovec {
            iov_base: buf.as_ptr() as *mut libc::c_void,
            iov_len: size * per_run,
        })
        .collect();
    let mut controls = vec![[0u64; 4]; msgs];
    // SAFETY: plain C structs, zeroed then filled below.
    let mut hdrs: Vec<libc::mmsghdr> = (0..msgs).map(|_| unsafe { std::mem::zeroed() }).collect();
    for k in 0..msgs {
        let h = &mut hdrs[k].msg_hdr;
        h.msg_iov = &mut iovs[k];
        h.msg_iovlen = 1;
        if per_run > 1 {
            // SAFETY: a 32-byte control buffer holds one u16 cmsg.
            unsafe {
                h.msg_control = controls[k].as_mut_ptr() as *mut libc::c_void;
                h.msg_controllen = libc::CMSG_SPACE(2) as usize;
                let c = libc::CMSG_FIRSTHDR(h);
                (*c).cmsg_level = SOL_UDP;
                (*c).cmsg_type = UDP_SEGMENT;
                (*c).cmsg_len = libc::CMSG_LEN(2) as usize;
                std::ptr::write_unaligned(libc::CMSG_DATA(c) as *mut u16, size as u16);
            }
        }
    }
    let cpu0 = thread_cpu();
    let (mut packets, mut syscalls) = (0u64, 0u64);
    while !stop.load(Ordering::Relaxed) {
        // SAFETY: the headers point at live buffers of the declared sizes; the socket is
        // connected, so no names are needed.
        let n = unsafe {
            match mode {
                Mode::SendTo => libc::send(fd, buf.as_ptr() as *const libc::c_void, size, 0) as i32,
                _ => libc::sendmmsg(fd, hdrs.as_mut_ptr(), msgs as u32, 0),
            }
        };
        syscalls += 1;
        if n > 0 {
            packets += match mode {
                Mode::SendTo => 1,
                _ => n as u64 * per_run as u64,
            };
        } else if n < 0 {
            let e = io::Error::last_os_error();
            // ECONNREFUSED: the receiver is gone at the end; ENOBUFS: a full queue.
            if e.raw_os_error() != Some(libc::ENOBUFS)
                && e.raw_os_error() != Some(libc::ECONNREFUSED)
            {
                panic!("send: {e}");
            }
        }
    }
    Side {
        packets,
        syscalls,
        cpu: thread_cpu() - cpu0,
    }
}

fn receiver(sock: UdpSocket, stop: Arc<AtomicBool>) -> Side {
    let fd = sock.as_raw_fd();
    let mut bufs = vec![0u8; RX_SLOT * BATCH];
    let mut iovs: Vec<libc::iovec> = (0..BATCH)
        .map(|i| libc::iovec {
            iov_base: bufs[i * RX_SLOT..].as_mut_ptr() as *mut libc::c_void,
            iov_len: RX_SLOT,
        })
        .collect();
    let mut controls = vec![[0u64; 8]; BATCH];
    // SAFETY: plain C structs, zeroed then filled.
    let mut hdrs: Vec<libc::mmsghdr> = (0..BATCH).map(|_| unsafe { std::mem::zeroed() }).collect();
    let cpu0 = thread_cpu();
    let (mut packets, mut syscalls) = (0u64, 0u64);
    while !stop.load(Ordering::Relaxed) {
        for k in 0..BATCH {
            let h = &mut hdrs[k].msg_hdr;
            h.msg_iov = &mut iovs[k];
            h.msg_iovlen = 1;
            h.msg_control = controls[k].as_mut_ptr() as *mut libc::c_void;
            h.msg_controllen = 64;
        }
        // SAFETY: as above; the socket has a receive timeout, so this returns to check `stop`.
        let n = unsafe {
            libc::recvmmsg(
                fd,
                hdrs.as_mut_ptr(),
                BATCH as u32,
                libc::MSG_WAITFORONE,
                std::ptr::null_mut(),
            )
        };
        syscalls += 1;
        if n <= 0 {
            continue;
        }
        for h in &hdrs[..n as usize] {
            let len = h.msg_len as usize;
            let seg = gro_segment(&h.msg_hdr).unwrap_or(len).max(1);
            packets += len.div_ceil(seg) as u64;
        }
    }
    let _ = &mut bufs;
    Side {
        packets,
        syscalls,
        cpu: thread_cpu() - cpu0,
    }
}

fn gro_segment(h: &libc::msghdr) -> Option<usize> {
    // SAFETY: walking the control buffer the kernel filled.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(h);
        while !c.is_null() {
            if (*c).cmsg_level == SOL_UDP && (*c).cmsg_type == UDP_GRO {
                return usize::try_from(std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const i32))
                    .ok();
            }
            c = libc::CMSG_NXTHDR(h, c);
        }
    }
    None
}

fn row(mode: Mode, size: usize, secs: f64) -> io::Result<()> {
    // The driver's own socket set-up (16 MiB buffers, DF, UDP_GRO), made blocking here.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()?;
    let bind = || -> io::Result<UdpSocket> {
        let (s, gro) = rt.block_on(async {
            nvmf_rdma::driver::bind_roce_socket("127.0.0.1:0".parse().unwrap(), true)
        })?;
        assert!(gro, "UDP_GRO refused by this kernel");
        let s = rt.block_on(async { s.into_std() })?;
        s.set_nonblocking(false)?;
        Ok(s)
    };
    let (rx, tx) = (bind()?, bind()?);
    rx.set_read_timeout(Some(Duration::from_millis(50)))?;
    tx.connect(rx.local_addr()?)?;
    let stop = Arc::new(AtomicBool::new(false));
    let (s1, s2) = (stop.clone(), stop.clone());
    let r = std::thread::spawn(move || receiver(rx, s1));
    let t0 = Instant::now();
    let t = std::thread::spawn(move || sender(tx, mode, size, s2));
    std::thread::sleep(Duration::from_secs_f64(secs));
    stop.store(true, Ordering::Relaxed);
    let (t, r) = (t.join().expect("sender"), r.join().expect("receiver"));
    let el = t0.elapsed().as_secs_f64();
    println!(
        "{:<9} {:>6} {:>10.3} {:>10.3} {:>7.1}% {:>11.0} {:>11.0} {:>9.3} {:>9.3}",
        format!("{mode:?}"),
        size,
        t.packets as f64 / el / 1e6,
        r.packets as f64 / el / 1e6,
        100.0 * (1.0 - r.packets as f64 / t.packets.max(1) as f64),
        t.cpu / t.packets.max(1) as f64 * 1e9,
        r.cpu / r.packets.max(1) as f64 * 1e9,
        t.syscalls as f64 / t.packets.max(1) as f64,
        r.syscalls as f64 / r.packets.max(1) as f64,
    );
    Ok(())
}

fn main() -> io::Result<()> {
    let secs: f64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(1.0);
    println!(
        "{:<9} {:>6} {:>10} {:>10} {:>8} {:>11} {:>11} {:>9} {:>9}",
        "send",
        "bytes",
        "sent Mpps",
        "recv Mpps",
        "lost",
        "tx ns/pkt",
        "rx ns/pkt",
        "tx sc/pkt",
        "rx sc/pkt"
    );
    for size in [100, 4124] {
        for mode in [Mode::SendTo, Mode::SendMmsg, Mode::Gso] {
            row(mode, size, secs)?;
        }
    }
    Ok(())
}

//! File descriptors over the control socket (SCM_RIGHTS), so bulk data goes between the
//! daemon and a file of the client's without crossing the socket: the client sends the
//! descriptor with the request line of `read-to-fd` / `write-from-fd`, and the daemon does
//! the I/O on it. libc directly: two calls, no crate needed for them.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// Descriptors one message may carry, and how many the daemon keeps for requests still to
/// come on a connection; past that they are closed.
pub const MAX_FDS: usize = 4;

/// A message header over one buffer (`iov`) and a control buffer of `space` bytes; both must
/// outlive its use.
fn header(iov: &mut libc::iovec, cbuf: &mut [u64], space: usize) -> libc::msghdr {
    // SAFETY: an all-zero msghdr is valid; the caller keeps the buffers alive.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = space as _;
    msg
}

/// Send `bytes` on the stream socket `sock`, with `fd` riding on the first byte. Returns how
/// many bytes went (the rest goes as plain data).
pub fn send_with_fd(sock: RawFd, bytes: &[u8], fd: RawFd) -> std::io::Result<usize> {
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    let msg = header(&mut iov, &mut cbuf, space);
    // SAFETY: the control buffer holds one cmsghdr with room for one descriptor
    // (CMSG_SPACE above), so the first header and its data are inside it.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(c) as *mut RawFd, fd);
    }
    // SAFETY: msg points at live buffers; MSG_NOSIGNAL: a closed peer is an error, not a
    // signal.
    let n = unsafe { libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Receive into `buf` from the stream socket `sock`; descriptors that came with the bytes go
/// to `fds` (at most [`MAX_FDS`] kept; more are closed). `Ok(0)` at the end of the stream.
pub fn recv_with_fds(
    sock: RawFd,
    buf: &mut [u8],
    fds: &mut VecDeque<OwnedFd>,
) -> std::io::Result<usize> {
    // SAFETY: CMSG_SPACE only computes a size.
    let space =
        unsafe { libc::CMSG_SPACE((MAX_FDS * std::mem::size_of::<RawFd>()) as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr() as *mut libc::c_void,
        iov_len: buf.len(),
    };
    let mut msg = header(&mut iov, &mut cbuf, space);
    // SAFETY: msg points at live buffers of the sizes it says; CLOEXEC so a descriptor
    // never leaks into a child.
    let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel filled msg_control with msg_controllen bytes of cmsghdrs; the
    // CMSG_* walk stays inside them, and each SCM_RIGHTS descriptor is ours from now on.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c) as *const RawFd;
                let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize)
                    / std::mem::size_of::<RawFd>();
                for i in 0..count {
                    let fd = OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i)));
                    if fds.len() < MAX_FDS {
                        fds.push_back(fd);
                    }
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Ok(n as usize)
}

/// Wait up to `timeout` until `fd` is ready for `events` (POLLIN / POLLOUT): a peer that
/// stops reading or writing a pipe fails the request instead of holding the daemon.
pub fn wait_ready(fd: &OwnedFd, events: i16, timeout: std::time::Duration) -> std::io::Result<()> {
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events,
        revents: 0,
    };
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    loop {
        // SAFETY: one pollfd that lives across the call.
        let r = unsafe { libc::poll(&mut p, 1, ms) };
        match r {
            0 => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("the other end moved no data for {} s", timeout.as_secs()),
                ))
            }
            r if r > 0 => return Ok(()),
            _ => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;

    #[test]
    fn a_descriptor_rides_with_the_bytes_and_extra_ones_are_closed() {
        let (a, b) = UnixStream::pair().unwrap();
        let (mut x, mut y) = UnixStream::pair().unwrap();
        assert_eq!(
            send_with_fd(a.as_raw_fd(), b"line\n", x.as_raw_fd()).unwrap(),
            5
        );
        let mut fds = VecDeque::new();
        let mut buf = [0u8; 64];
        let n = recv_with_fds(b.as_raw_fd(), &mut buf, &mut fds).unwrap();
        assert_eq!(&buf[..n], b"line\n");
        assert_eq!(fds.len(), 1);
        // The descriptor received is the same socket as the one sent.
        let mut w = std::fs::File::from(fds.pop_front().unwrap());
        w.write_all(b"hi").unwrap();
        drop(w);
        x.write_all(b"!").unwrap();
        drop(x);
        let mut got = [0u8; 3];
        y.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"hi!");
        // More than MAX_FDS over several messages: the rest are closed, not kept.
        let f = std::fs::File::open("/dev/null").unwrap();
        for _ in 0..MAX_FDS + 2 {
            send_with_fd(a.as_raw_fd(), b"x", f.as_raw_fd()).unwrap();
            recv_with_fds(b.as_raw_fd(), &mut buf, &mut fds).unwrap();
        }
        assert_eq!(fds.len(), MAX_FDS);
    }
}

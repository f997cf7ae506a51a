//! The NBD export: our own protocol client for the edges (pipelining, several connections,
//! unaligned and oversize requests, malformed input, structured replies), real Debian clients
//! for interop (`qemu-img`, `nbdcopy`, `nbdinfo`, `nbdsh`; skipped with a printed reason when
//! not installed), and proptests that the sans-I/O parser never panics.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::Command as Cmd;

use crate::export_common::*;
use bytes::{Buf, BufMut, BytesMut};
use nvmf_rdma::export::nbd::{self, *};
use nvmf_rdma::export::nbd_handshake::{ExportInfo, Negotiation, Outcome};
use nvmf_rdma::export::{ExportAddr, MemoryBudget, NbdLimits, NbdListener, NbdStats};
use proptest::prelude::*;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

const NS_BYTES: u64 = 64 << 20;

/// Our export served on a unix socket in a scratch directory.
pub(crate) struct Served {
    /// Keeps the target, host and runtime alive.
    pub(crate) stack: Stack,
    addr: ExportAddr,
    pub(crate) sock: std::path::PathBuf,
    _server: tokio::task::JoinHandle<()>,
    _tmp: TempDir,
    pub(crate) stats: Arc<NbdStats>,
    memory: Arc<MemoryBudget>,
}

pub(crate) fn serve(lbads: u8) -> Served {
    serve_limited(lbads, NbdLimits::default())
}

fn serve_limited(lbads: u8, limits: NbdLimits) -> Served {
    serve_on(lbads, None, limits, None)
}

/// Served on `tcp` (else a unix socket), charged to `memory` (else the process budget).
fn serve_on(
    lbads: u8,
    tcp: Option<&str>,
    limits: NbdLimits,
    memory: Option<Arc<MemoryBudget>>,
) -> Served {
    let stack = Stack::start(NS_BYTES, lbads, 2);
    let tmp = TempDir::new("nbd");
    let sock = tmp.path().join("nbd.sock");
    let addr: ExportAddr = match tcp {
        Some(a) => a.parse().unwrap(),
        None => format!("unix:{}", sock.display()).parse().unwrap(),
    };
    let mut l = stack
        .rt
        .block_on(NbdListener::bind_with(&addr, limits, false))
        .unwrap();
    if let Some(m) = memory {
        l = l.with_memory(m);
    }
    let (stats, memory, addr) = (l.stats(), l.memory(), l.addr().clone());
    let dev = stack.dev.clone();
    let server = stack.rt.spawn(async move {
        l.serve(dev, "ns1".into()).await.unwrap();
    });
    Served {
        stack,
        addr,
        sock,
        _server: server,
        _tmp: tmp,
        stats,
        memory,
    }
}

/// A minimal blocking NBD client built on the same codec.
pub(crate) struct Client<S = UnixStream> {
    s: S,
    size: u64,
    flags: u16,
    structured: bool,
    next: u64,
}

fn read_exact(s: &mut impl Read, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    s.read_exact(&mut v).unwrap();
    v
}

fn opt_reply(s: &mut impl Read) -> (u32, u32, Vec<u8>) {
    let mut h = &read_exact(s, 20)[..];
    assert_eq!(h.get_u64(), OPT_REPLY_MAGIC);
    let (o, t, n) = (h.get_u32(), h.get_u32(), h.get_u32());
    (o, t, read_exact(s, n as usize))
}

/// Read the server's greeting and answer it.
fn greet_on(s: &mut (impl Read + Write)) {
    let g = read_exact(s, 18);
    assert_eq!(&g[..16], b"NBDMAGICIHAVEOPT");
    s.write_all(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes())
        .unwrap();
}

impl Client {
    fn greet(sock: &Path) -> UnixStream {
        let mut s = UnixStream::connect(sock).unwrap();
        greet_on(&mut s);
        s
    }

    pub(crate) fn connect(sock: &Path, structured: bool) -> Client {
        Client::handshake(Client::greet(sock), structured)
    }
}

impl<S: Read + Write> Client<S> {
    /// Options on a greeted stream, up to the transmission phase.
    fn handshake(mut s: S, structured: bool) -> Client<S> {
        let mut out = Vec::new();
        if structured {
            emit_option(opt::STRUCTURED_REPLY, &[], &mut out);
            s.write_all(&out).unwrap();
            assert_eq!(opt_reply(&mut s).1, rep::ACK);
            out.clear();
        }
        let mut d = Vec::new();
        d.put_u32(0);
        d.put_u16(1);
        d.put_u16(info::BLOCK_SIZE);
        emit_option(opt::GO, &d, &mut out);
        s.write_all(&out).unwrap();
        let (mut size, mut flags) = (0, 0);
        loop {
            let (o, t, data) = opt_reply(&mut s);
            assert_eq!(o, opt::GO);
            match t {
                rep::ACK => break,
                rep::INFO => {
                    let mut d = &data[..];
                    if d.get_u16() == info::EXPORT {
                        size = d.get_u64();
                        flags = d.get_u16();
                    }
                }
                t => panic!("GO reply {t:#x}"),
            }
        }
        Client {
            s,
            size,
            flags,
            structured,
            next: 1,
        }
    }

    pub(crate) fn send(
        &mut self,
        command: Command,
        flags: u16,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) -> u64 {
        let cookie = self.next;
        self.next += 1;
        let mut b = Vec::with_capacity(REQUEST_LEN + payload.len());
        Request {
            flags,
            command,
            cookie,
            offset,
            length,
        }
        .emit(&mut b);
        b.extend_from_slice(payload);
        self.s.write_all(&b).unwrap();
        cookie
    }

    /// One simple reply: (cookie, error, data) where `data_len(cookie)` says how much READ
    /// data follows a successful reply.
    pub(crate) fn reply(&mut self, data_len: impl Fn(u64) -> usize) -> (u64, u32, Vec<u8>) {
        let h = read_exact(&mut self.s, 4);
        let magic = u32::from_be_bytes(h[..4].try_into().unwrap());
        if magic == SIMPLE_REPLY_MAGIC {
            let mut r = h;
            r.extend(read_exact(&mut self.s, 12));
            let r = SimpleReply::parse(&r).unwrap();
            let n = if r.error == 0 { data_len(r.cookie) } else { 0 };
            (r.cookie, r.error, read_exact(&mut self.s, n))
        } else {
            assert_eq!(magic, STRUCTURED_REPLY_MAGIC);
            let mut b = &read_exact(&mut self.s, 16)[..];
            let (flags, kind, cookie, len) = (b.get_u16(), b.get_u16(), b.get_u64(), b.get_u32());
            assert_eq!(flags & nbd::chunk::FLAG_DONE, nbd::chunk::FLAG_DONE);
            let mut p = read_exact(&mut self.s, len as usize);
            match kind {
                nbd::chunk::OFFSET_DATA => (cookie, 0, p.split_off(8)),
                nbd::chunk::NONE => (cookie, 0, Vec::new()),
                nbd::chunk::ERROR => (cookie, (&p[..4]).get_u32(), Vec::new()),
                k => panic!("chunk type {k}"),
            }
        }
    }

    pub(crate) fn call(
        &mut self,
        command: Command,
        flags: u16,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) -> (u32, Vec<u8>) {
        let c = self.send(command, flags, offset, length, payload);
        let n = if command == Command::Read {
            length as usize
        } else {
            0
        };
        let (rc, e, d) = self.reply(|_| n);
        assert_eq!(rc, c);
        (e, d)
    }

    pub(crate) fn read(&mut self, offset: u64, len: u32) -> Vec<u8> {
        let (e, d) = self.call(Command::Read, 0, offset, len, &[]);
        assert_eq!(e, 0, "read {offset}+{len}");
        d
    }

    pub(crate) fn write(&mut self, offset: u64, data: &[u8], flags: u16) {
        let (e, _) = self.call(Command::Write, flags, offset, data.len() as u32, data);
        assert_eq!(e, 0, "write {offset}+{}", data.len());
    }

    /// Expect the server to close the connection.
    fn expect_closed(mut self) {
        let mut b = [0u8; 64];
        loop {
            match self.s.read(&mut b) {
                Ok(0) | Err(_) => return,
                Ok(_) => continue,
            }
        }
    }
}

#[test]
fn pipelined_unaligned_io_on_several_connections() {
    for lbads in [9u8, 12] {
        let sv = serve(lbads);
        let conns = 3u64;
        let region = NS_BYTES / conns;
        let workers: Vec<_> = (0..conns)
            .map(|k| {
                let sock = sv.sock.clone();
                std::thread::spawn(move || {
                    let mut c = Client::connect(&sock, k == 1);
                    assert_eq!(c.size, NS_BYTES);
                    for f in [
                        tflag::SEND_FLUSH,
                        tflag::SEND_FUA,
                        tflag::SEND_TRIM,
                        tflag::SEND_WRITE_ZEROES,
                        tflag::CAN_MULTI_CONN,
                    ] {
                        assert_ne!(c.flags & f, 0, "flag {f:#x}");
                    }
                    // Pipelined: every write is sent before any reply is read.
                    let base = k * region;
                    let mut at = base + 1 + k * 7;
                    let mut expect = HashMap::new();
                    let mut pieces = Vec::new();
                    for i in 0..24u64 {
                        let len = match i % 4 {
                            0 => 4096,
                            1 => 511 + i as usize,
                            2 => (1 << 20) + 3,
                            _ => (5 << 20) - 1000,
                        };
                        let data = random_bytes(k * 1000 + i, len);
                        let cookie = c.send(
                            Command::Write,
                            if i == 5 { cflag::FUA } else { 0 },
                            at,
                            len as u32,
                            &data,
                        );
                        expect.insert(cookie, ());
                        pieces.push((at, data));
                        at += len as u64 + 13;
                        if at + (5 << 20) > base + region {
                            break;
                        }
                    }
                    for _ in 0..expect.len() {
                        let (cookie, e, _) = c.reply(|_| 0);
                        assert_eq!(e, 0);
                        assert!(expect.remove(&cookie).is_some(), "unknown cookie {cookie}");
                    }
                    assert_eq!(c.call(Command::Flush, 0, 0, 0, &[]).0, 0);
                    // Pipelined reads, replies matched by cookie.
                    let mut want = HashMap::new();
                    for (off, data) in &pieces {
                        let cookie = c.send(Command::Read, 0, *off, data.len() as u32, &[]);
                        want.insert(cookie, data.clone());
                    }
                    let lens: HashMap<u64, usize> =
                        want.iter().map(|(k, v)| (*k, v.len())).collect();
                    for _ in 0..want.len() {
                        let (cookie, e, d) = c.reply(|ck| lens[&ck]);
                        assert_eq!(e, 0);
                        assert!(want.remove(&cookie).unwrap() == d, "read-back mismatch");
                    }
                    // WRITE_ZEROES with ragged edges leaves its neighbours alone.
                    let (off, data) = &pieces[2];
                    let (zo, zl) = (off + 100, data.len() as u32 - 300);
                    assert_eq!(c.call(Command::WriteZeroes, cflag::FUA, zo, zl, &[]).0, 0);
                    let back = c.read(*off, data.len() as u32);
                    assert_eq!(&back[..100], &data[..100]);
                    assert!(back[100..100 + zl as usize].iter().all(|&b| b == 0));
                    assert_eq!(&back[100 + zl as usize..], &data[100 + zl as usize..]);
                    // TRIM is a hint; it must succeed and leave what lies outside alone.
                    let (off, data) = &pieces[3];
                    assert_eq!(c.call(Command::Trim, 0, off + 8192, 1 << 20, &[]).0, 0);
                    assert_eq!(c.read(*off, 4096), data[..4096]);
                    // DISC has no reply: the server finishes and closes.
                    c.send(Command::Disc, 0, 0, 0, &[]);
                    c.expect_closed();
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
    }
}

#[test]
fn malformed_input_gets_errors_or_a_close_never_a_panic() {
    let sv = serve(9);
    let sock = &sv.sock;

    // Handshake violations close the connection.
    let mut s = UnixStream::connect(sock).unwrap();
    read_exact(&mut s, 18);
    s.write_all(&0x8000_0000u32.to_be_bytes()).unwrap();
    Client {
        s,
        size: 0,
        flags: 0,
        structured: false,
        next: 0,
    }
    .expect_closed();

    let mut s = Client::greet(sock);
    s.write_all(&[0x55; 16]).unwrap();
    Client {
        s,
        size: 0,
        flags: 0,
        structured: false,
        next: 0,
    }
    .expect_closed();

    let mut s = Client::greet(sock);
    let mut b = Vec::new();
    b.put_u64(IHAVEOPT);
    b.put_u32(opt::GO);
    b.put_u32(u32::MAX);
    s.write_all(&b).unwrap();
    Client {
        s,
        size: 0,
        flags: 0,
        structured: false,
        next: 0,
    }
    .expect_closed();

    // Bad options get error replies and the negotiation goes on.
    let mut s = Client::greet(sock);
    for (o, d, want) in [
        (99u32, &b"junk"[..], rep::ERR_UNSUP),
        (opt::GO, &[0, 0][..], rep::ERR_INVALID),
        (opt::GO, &[0, 0, 0, 9, b'x', 0, 0][..], rep::ERR_INVALID),
        (opt::INFO, &[0, 0, 0, 1, b'x', 0, 0][..], rep::ERR_UNKNOWN),
        (opt::LIST, &[1][..], rep::ERR_INVALID),
        (opt::STARTTLS, &[][..], rep::ERR_POLICY),
        (opt::SET_META_CONTEXT, &[0; 8][..], rep::ERR_UNSUP),
    ] {
        let mut b = Vec::new();
        emit_option(o, d, &mut b);
        s.write_all(&b).unwrap();
        assert_eq!(opt_reply(&mut s).1, want, "option {o}");
    }
    let mut b = Vec::new();
    emit_option(opt::LIST, &[], &mut b);
    s.write_all(&b).unwrap();
    let (_, t, d) = opt_reply(&mut s);
    assert_eq!((t, &d[4..]), (rep::SERVER, &b"ns1"[..]));
    assert_eq!(opt_reply(&mut s).1, rep::ACK);
    let mut b = Vec::new();
    emit_option(opt::ABORT, &[], &mut b);
    s.write_all(&b).unwrap();
    assert_eq!(opt_reply(&mut s).1, rep::ACK);
    Client {
        s,
        size: 0,
        flags: 0,
        structured: false,
        next: 0,
    }
    .expect_closed();

    // Transmission: bad requests get errors, the connection stays usable.
    let mut c = Client::connect(sock, false);
    let size = c.size;
    assert_eq!(
        c.call(Command::Read, 0, size - 10, 11, &[]).0,
        errno::EINVAL
    );
    assert_eq!(c.call(Command::Read, 0, u64::MAX, 1, &[]).0, errno::EINVAL);
    assert_eq!(
        c.call(Command::Write, 0, size - 1, 2, &[1, 2]).0,
        errno::ENOSPC
    );
    assert_eq!(
        c.call(Command::WriteZeroes, 0, size, 1, &[]).0,
        errno::ENOSPC
    );
    assert_eq!(c.call(Command::Other(200), 0, 0, 0, &[]).0, errno::EINVAL);
    assert_eq!(
        c.call(Command::BlockStatus, 0, 0, 512, &[]).0,
        errno::EINVAL
    );
    assert_eq!(c.call(Command::Flush, 0, 1, 0, &[]).0, errno::EINVAL);
    assert_eq!(c.call(Command::Read, 0x100, 0, 512, &[]).0, errno::EINVAL);
    assert_eq!(
        c.call(Command::Read, 0, 0, 64 << 20, &[]).0,
        errno::EOVERFLOW
    );
    // An oversize WRITE: its payload is drained and refused, the stream stays in step.
    let big = vec![0xEE; (32 << 20) + 1];
    assert_eq!(
        c.call(Command::Write, 0, 0, big.len() as u32, &big).0,
        errno::EOVERFLOW
    );
    assert_eq!(c.call(Command::Read, 0, 0, 0, &[]).0, 0);
    c.write(1000, b"still in step", 0);
    assert_eq!(c.read(1000, 13), b"still in step");
    // A broken request magic cannot be framed: close.
    c.s.write_all(&[0xAB; REQUEST_LEN]).unwrap();
    c.expect_closed();

    // Garbage from the first byte.
    let mut s = UnixStream::connect(sock).unwrap();
    s.write_all(&random_bytes(7, 4096)).unwrap();
    Client {
        s,
        size: 0,
        flags: 0,
        structured: false,
        next: 0,
    }
    .expect_closed();

    // The server is still serving.
    let mut c = Client::connect(sock, true);
    assert_eq!(c.read(1000, 13), b"still in step");
}

#[test]
fn structured_replies_for_reads() {
    let sv = serve(12);
    let mut c = Client::connect(&sv.sock, true);
    assert!(c.structured);
    c.write(4095, &[9; 3], 0);
    assert_eq!(c.read(4094, 5), [0, 9, 9, 9, 0]);
    // A failed structured READ is an ERROR chunk, not a simple reply.
    assert_eq!(c.call(Command::Read, 0, NS_BYTES, 1, &[]).0, errno::EINVAL);
    assert_eq!(c.call(Command::Read, cflag::DF, 0, 8, &[]).0, 0);
}

// ---------------------------------------------------------------------------------------------
// Real clients.

fn tools(test: &str, list: &[&str]) -> bool {
    for t in list {
        if !have(t) {
            skip(
                test,
                &format!("{t} is not installed (apt-get install qemu-utils libnbd-bin)"),
            );
            return false;
        }
    }
    true
}

#[test]
fn qemu_img_nbdcopy_nbdinfo_interop() {
    if !tools(
        "qemu_img_nbdcopy_nbdinfo_interop",
        &["qemu-img", "nbdcopy", "nbdinfo"],
    ) {
        return;
    }
    let sv = serve(9);
    let uri = sv.addr.uri();
    let tmp = TempDir::new("nbd-interop");
    let img = tmp.path().join("random.img");
    let back = tmp.path().join("back.img");
    let data = random_bytes(0x9E40, NS_BYTES as usize);
    std::fs::write(&img, &data).unwrap();

    let info = run(Cmd::new("nbdinfo").arg("--json").arg(&uri));
    for want in [
        format!("\"export-size\": {NS_BYTES}"),
        "\"can_multi_conn\": true".into(),
        "\"can_trim\": true".into(),
        "\"can_zero\": true".into(),
        "\"can_flush\": true".into(),
    ] {
        assert!(info.contains(&want), "nbdinfo lacks {want}: {info}");
    }

    // qemu-img writes, qemu-img and nbdcopy read back.
    run(Cmd::new("qemu-img")
        .args(["convert", "-n", "-f", "raw", "-O", "raw"])
        .arg(&img)
        .arg(&uri));
    run(Cmd::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(&img)
        .arg(&uri));
    run(Cmd::new("nbdcopy").arg(&uri).arg(&back));
    assert!(
        std::fs::read(&back).unwrap() == data,
        "nbdcopy read-back differs"
    );

    // nbdcopy writes over four connections (CAN_MULTI_CONN), qemu-img verifies.
    let data2 = random_bytes(0x9E41, NS_BYTES as usize);
    std::fs::write(&img, &data2).unwrap();
    run(Cmd::new("nbdcopy")
        .args(["--connections=4", "--requests=16", "--flush"])
        .arg(&img)
        .arg(&uri));
    run(Cmd::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(&img)
        .arg(&uri));
}

#[test]
fn nbdsh_trim_zero_flush() {
    if !tools("nbdsh_trim_zero_flush", &["nbdsh"]) {
        return;
    }
    // nbdsh runs `python3` from PATH; prefer the system one that has the nbd module.
    let path = format!(
        "/usr/bin:/bin:{}",
        std::env::var("PATH").unwrap_or_default()
    );
    let ok = Cmd::new("nbdsh")
        .env("PATH", &path)
        .args(["-c", "pass"])
        .status();
    if !ok.is_ok_and(|s| s.success()) {
        skip(
            "nbdsh_trim_zero_flush",
            "nbdsh does not start (python3-libnbd missing?)",
        );
        return;
    }
    let sv = serve(12);
    let script = r#"
bs = 4096
h.pwrite(b"\xab" * (3 * bs), 0)
h.flush()
h.zero(5, bs - 7, nbd.CMD_FLAG_FUA)
assert h.pread(bs + 5, 0) == b"\xab" * (bs - 7) + bytes(5) + b"\xab" * 7, "zero"
h.trim(bs, bs)
h.flush()
assert h.pread(bs, 0) == b"\xab" * (bs - 7) + bytes(5) + b"\xab" * 2, "trim left neighbour"
assert h.pread(bs, 2 * bs) == b"\xab" * bs, "trim right neighbour"
h.pwrite(b"x" * 5, 10, nbd.CMD_FLAG_FUA)
assert h.pread(7, 9) == b"\xabxxxxx\xab", "fua write"
assert h.can_multi_conn() and h.can_trim() and h.can_zero() and h.can_fua()
print("nbdsh ok")
"#;
    let out = run(Cmd::new("nbdsh")
        .env("PATH", &path)
        .args(["-u", &sv.addr.uri(), "-c", script]));
    assert!(out.contains("nbdsh ok"), "{out}");
}

// ---------------------------------------------------------------------------------------------
// The parser never panics, whatever arrives and however it is split.

fn export() -> ExportInfo {
    ExportInfo {
        name: "ns1".into(),
        description: String::new(),
        size: 1 << 30,
        flags: tflag::SEND_FLUSH,
        min_block: 1,
        preferred_block: 4096,
        max_block: 1 << 20,
    }
}

proptest! {
    #[test]
    fn negotiation_and_decoder_never_panic(
        prefix in prop::collection::vec(any::<u8>(), 0..64),
        body in prop::collection::vec(any::<u8>(), 0..512),
        cut in 0usize..600,
        flags in 0u32..4,
    ) {
        // A plausible start (client flags, then an option) followed by noise, fed in two parts.
        let mut all = flags.to_be_bytes().to_vec();
        all.extend_from_slice(&prefix);
        all.extend_from_slice(&body);
        let cut = cut.min(all.len());
        let mut n = Negotiation::new(export());
        let mut buf = BytesMut::new();
        let mut done = None;
        for part in [&all[..cut], &all[cut..]] {
            buf.extend_from_slice(part);
            match n.handle_input(&mut buf) {
                Ok(Some(o)) => { done = Some(o); break; }
                Ok(None) => {}
                Err(_) => break,
            }
        }
        let _ = n.poll_transmit();
        if let Some(Outcome::Transmission { structured }) = done {
            let mut dec = RequestDecoder::new(1 << 20);
            while let Ok(Some(d)) = dec.decode(&mut buf) {
                if let Decoded::Request(r, _) = d {
                    let _ = nbd::validate(&r, 1 << 30, 1 << 20, structured);
                }
            }
        }
    }

    #[test]
    fn request_round_trip(flags in any::<u16>(), kind in any::<u16>(), cookie in any::<u64>(), offset in any::<u64>(), length in 0u32..4096) {
        let r = Request { flags, command: Command::from_u16(kind), cookie, offset, length };
        let mut b = BytesMut::new();
        r.emit(&mut b);
        prop_assert_eq!(b.len(), REQUEST_LEN);
        prop_assert_eq!(Request::parse(&b).unwrap(), r);
        b.extend_from_slice(&vec![7u8; r.payload_len() as usize]);
        let mut dec = RequestDecoder::new(1 << 20);
        match dec.decode(&mut b).unwrap() {
            Some(Decoded::Request(got, p)) => {
                prop_assert_eq!(got, r);
                prop_assert_eq!(p.len(), r.payload_len() as usize);
            }
            other => prop_assert!(false, "{:?}", other),
        }
        prop_assert!(b.is_empty());
    }
}

/// Resident memory of this process, bytes.
fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    // SAFETY: sysconf has no preconditions.
    pages * unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64
}

/// Security review #11: a client sends 100 READs of 16 MiB and never reads a reply. Before,
/// the server read and executed them all (the initiator grew by 2.6 GB). Now the connection
/// holds at most its byte budget (64 MiB) and stops reading the client until there is room:
/// the controller reads no more than the budget and one request beyond it.
#[test]
fn a_client_that_never_reads_its_replies_costs_a_bounded_amount() {
    let srv = serve(9);
    let mut c = Client::connect(&srv.sock, false);
    let ctrl = srv.stack.ctrl.clone();
    let read_bytes = || -> u64 {
        let done: u64 = ctrl.queue_stats().iter().map(|s| s.completed).sum();
        done * ctrl.max_transfer() as u64
    };
    let (before, read_before) = (rss(), read_bytes());
    for i in 0..100u64 {
        c.send(Command::Read, 0, (i % 3) << 24, 16 << 20, &[]);
    }
    // The budget fills (four 16 MiB reads), then the server waits for the client.
    let t0 = Instant::now();
    while srv.stats.peak_bytes_held.load(Ordering::Relaxed) < 64 << 20 {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the budget never filled"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // Watch for two seconds that nothing more is taken on.
    let mut grew = 0;
    for _ in 0..40 {
        grew = grew.max(rss().saturating_sub(before));
        let read = read_bytes() - read_before;
        assert!(
            read <= 80 << 20,
            "read {} MiB for a client that reads nothing",
            read >> 20
        );
        assert!(srv.stats.bytes_held.load(Ordering::Relaxed) <= 64 << 20);
        std::thread::sleep(Duration::from_millis(50));
    }
    println!(
        "100 unread 16 MiB READs: {} MiB read from the namespace, process +{} MiB \
         (other tests of this binary run beside it)",
        (read_bytes() - read_before) >> 20,
        grew >> 20
    );
    // The client reads after all: every reply comes, in full.
    let mut got = 0;
    while got < 100 {
        let (_, e, d) = c.reply(|_| 16 << 20);
        assert_eq!((e, d.len()), (0, 16 << 20));
        got += 1;
    }
}

/// `s` (with a read timeout set) is closed by the server without a greeting.
fn closed_before_greeting(mut s: impl Read, what: &str) {
    let mut b = [0u8; 18];
    assert!(
        matches!(s.read(&mut b), Ok(0) | Err(_)),
        "{what} is closed, not greeted"
    );
}

/// Security review #12: clients beyond the cap are closed at accept and counted; those being
/// served are unaffected, and a place that frees up is taken by the next client.
#[test]
fn connections_beyond_the_cap_are_closed_and_the_listener_goes_on() {
    let srv = serve_limited(
        9,
        NbdLimits {
            max_connections: 3,
            ..NbdLimits::default()
        },
    );
    let mut held: Vec<Client> = (0..3).map(|_| Client::connect(&srv.sock, false)).collect();
    let extra = UnixStream::connect(&srv.sock).unwrap();
    extra
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    closed_before_greeting(extra, "a fourth client");
    assert_eq!(srv.stats.refused.load(Ordering::Relaxed), 1);
    for c in held.iter_mut() {
        c.write(0, &[7u8; 4096], 0);
    }
    held.pop().unwrap().send(Command::Disc, 0, 0, 0, &[]);
    let t0 = Instant::now();
    while srv.stats.connections.load(Ordering::Relaxed) > 2 {
        assert!(t0.elapsed() < Duration::from_secs(10));
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut again = Client::connect(&srv.sock, false);
    assert_eq!(again.read(0, 4096), vec![7u8; 4096]);
}

/// A client that connects and never finishes the handshake is closed after the handshake
/// timeout instead of holding a connection for ever.
#[test]
fn a_client_that_never_finishes_the_handshake_is_closed() {
    let srv = serve_limited(
        9,
        NbdLimits {
            handshake_timeout: Duration::from_millis(300),
            ..NbdLimits::default()
        },
    );
    let mut s = Client::greet(&srv.sock);
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let t0 = Instant::now();
    let mut b = [0u8; 64];
    assert!(matches!(s.read(&mut b), Ok(0) | Err(_)));
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert_eq!(srv.stats.handshake_timeouts.load(Ordering::Relaxed), 1);
}

/// Security review #14: the unix socket is 0600 whatever the umask; TCP beyond loopback
/// needs the user's explicit consent.
#[test]
fn sockets_are_private_and_remote_tcp_needs_consent() {
    use std::os::unix::fs::PermissionsExt;
    let srv = serve(9);
    let mode = std::fs::metadata(&srv.sock).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "{mode:o}");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let any: ExportAddr = "0.0.0.0:0".parse().unwrap();
    let e = rt
        .block_on(NbdListener::bind(&any))
        .err()
        .expect("refused without consent");
    assert!(e.to_string().contains("--nbd-allow-remote"), "{e}");
    assert!(rt
        .block_on(NbdListener::bind_with(&any, NbdLimits::default(), true))
        .is_ok());
    let lo: ExportAddr = "127.0.0.1:0".parse().unwrap();
    assert!(rt.block_on(NbdListener::bind(&lo)).is_ok());
}

/// Thirty clients each send unread 16 MiB READs to two exports that share one memory
/// budget: the bytes all connections hold stay within it (no copy of a reply is made beyond
/// the one charged), nothing aborts, and the memory is given back once the clients leave.
#[test]
fn thirty_clients_that_never_read_their_replies_stay_within_the_process_budget() {
    const BOUND: usize = 256 << 20;
    const READ: u32 = 16 << 20;
    let memory = MemoryBudget::new(BOUND);
    let a = serve_on(9, None, NbdLimits::default(), Some(memory.clone()));
    let b = serve_on(12, None, NbdLimits::default(), Some(memory.clone()));
    assert!(Arc::ptr_eq(&a.memory, &b.memory));
    let before = rss();
    let mut clients: Vec<Client> = (0..30)
        .map(|k| Client::connect(if k % 2 == 0 { &a.sock } else { &b.sock }, false))
        .collect();
    for (k, c) in clients.iter_mut().enumerate() {
        for i in 0..3u64 {
            c.send(Command::Read, 0, ((k as u64 + i) % 3) << 24, READ, &[]);
        }
    }
    let t0 = Instant::now();
    while memory.peak() < BOUND - READ as usize {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the budget never filled: {} MiB held",
            memory.in_use() >> 20
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut grew = 0;
    for _ in 0..20 {
        grew = grew.max(rss().saturating_sub(before));
        let held =
            a.stats.bytes_held.load(Ordering::Relaxed) + b.stats.bytes_held.load(Ordering::Relaxed);
        assert!(
            memory.in_use() <= BOUND,
            "{} MiB held",
            memory.in_use() >> 20
        );
        assert!(held <= BOUND, "connections hold {} MiB", held >> 20);
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(memory.peak() <= BOUND, "peak {} MiB", memory.peak() >> 20);
    // Whatever else this test binary runs beside it, the held bytes and the reads' own
    // buffers stay far below one copy per client.
    assert!(
        grew < 2 * BOUND as u64,
        "process grew by {} MiB under a {} MiB budget",
        grew >> 20,
        BOUND >> 20
    );
    let peak_rss = rss();
    drop(clients);
    let t0 = Instant::now();
    while memory.in_use() > 0
        || a.stats.connections.load(Ordering::Relaxed) > 0
        || b.stats.connections.load(Ordering::Relaxed) > 0
    {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "the clients left but {} MiB stay held",
            memory.in_use() >> 20
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let after = rss();
    println!(
        "30 clients x 3 unread 16 MiB READs, {} MiB budget: peak held {} MiB, process +{} MiB \
         while held, RSS {} MiB at the peak, {} MiB after they left (started at {} MiB)",
        BOUND >> 20,
        memory.peak() >> 20,
        grew >> 20,
        peak_rss >> 20,
        after >> 20,
        before >> 20
    );
    assert!(
        after < before + BOUND as u64,
        "RSS {} MiB after the clients left, {} MiB before",
        after >> 20,
        before >> 20
    );
    // Both exports serve new clients as before.
    assert_eq!(Client::connect(&a.sock, false).read(0, 512).len(), 512);
}

/// A blocking TCP connection from `source` (any port) to `to`.
fn tcp_from(source: &str, to: &ExportAddr) -> std::net::TcpStream {
    let ExportAddr::Tcp(to) = to else {
        panic!("{to} is not TCP")
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let s = rt.block_on(async {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.bind(format!("{source}:0").parse().unwrap()).unwrap();
        sock.connect(*to).await.unwrap()
    });
    let s = s.into_std().unwrap();
    s.set_nonblocking(false).unwrap();
    s
}

fn tcp_client(source: &str, to: &ExportAddr) -> Client<std::net::TcpStream> {
    let mut s = tcp_from(source, to);
    greet_on(&mut s);
    Client::handshake(s, false)
}

/// One peer holding its cap of idle, handshaken connections does not keep a second peer out
/// (and its next connection is closed at accept).
#[test]
fn a_peer_at_its_connection_cap_does_not_keep_another_peer_out() {
    let srv = serve_on(
        9,
        Some("127.0.0.1:0"),
        NbdLimits {
            max_connections: 8,
            max_per_peer: 3,
            ..NbdLimits::default()
        },
        None,
    );
    let held: Vec<_> = (0..3).map(|_| tcp_client("127.0.0.1", &srv.addr)).collect();
    let extra = tcp_from("127.0.0.1", &srv.addr);
    extra
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    closed_before_greeting(extra, "a fourth connection of the same peer");
    assert_eq!(srv.stats.refused_per_peer.load(Ordering::Relaxed), 1);
    let mut other = tcp_client("127.0.0.2", &srv.addr);
    other.write(4096, &[9u8; 4096], 0);
    assert_eq!(other.read(4096, 4096), vec![9u8; 4096]);
    assert_eq!(srv.stats.connections.load(Ordering::Relaxed), 4);
    drop(held);
}

/// A handshaken client that sends nothing is closed after the idle timeout; one that keeps
/// sending, with pauses shorter than it, stays served for several timeouts.
#[test]
fn idle_connections_are_closed_after_the_idle_timeout_and_busy_ones_stay() {
    let idle = Duration::from_millis(400);
    // Two places, both taken: the listener is under pressure.
    let srv = serve_limited(
        9,
        NbdLimits {
            idle_timeout: idle,
            max_connections: 2,
            ..NbdLimits::default()
        },
    );
    let quiet = Client::connect(&srv.sock, false);
    quiet
        .s
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut busy = Client::connect(&srv.sock, false);
    let t0 = Instant::now();
    let watcher = std::thread::spawn(move || {
        quiet.expect_closed();
        t0.elapsed()
    });
    while t0.elapsed() < idle * 4 {
        busy.write(0, &[3u8; 512], 0);
        std::thread::sleep(idle / 4);
    }
    let closed_after = watcher.join().unwrap();
    assert!(
        closed_after >= idle && closed_after < Duration::from_secs(15),
        "the idle client was closed after {closed_after:?}"
    );
    assert_eq!(busy.read(0, 512), vec![3u8; 512]);
    assert_eq!(srv.stats.idle_closed.load(Ordering::Relaxed), 1);
}

/// An idle client with places to spare (a kernel `nbd-client` mount nobody writes to) is not
/// closed: the idle timeout gives places back only when others need them.
#[test]
fn an_idle_client_stays_while_the_listener_has_room() {
    let idle = Duration::from_millis(200);
    let srv = serve_limited(
        9,
        NbdLimits {
            idle_timeout: idle,
            ..NbdLimits::default()
        },
    );
    let mut quiet = Client::connect(&srv.sock, false);
    // Ten idle timeouts with nothing said: the idle check runs each time and keeps it.
    std::thread::sleep(idle * 10);
    quiet.write(0, &[5u8; 512], 0);
    assert_eq!(quiet.read(0, 512), vec![5u8; 512]);
    assert_eq!(srv.stats.idle_closed.load(Ordering::Relaxed), 0);
}

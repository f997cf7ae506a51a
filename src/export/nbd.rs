//! The NBD protocol, server side, sans-I/O: the fixed-newstyle handshake as a state machine
//! ([`Negotiation`]) and the transmission-phase request decoder and reply encoders. Bytes in,
//! bytes out; no sockets, no clock. The tokio server is `nbd_server.rs`.
//!
//! Spec: NetworkBlockDevice `doc/proto.md` (section names are quoted where they apply).
//! Everything on the wire is big-endian.

use bytes::{Buf, BufMut, Bytes, BytesMut};

/// "NBDMAGIC", first 8 bytes of every handshake.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// "IHAVEOPT": the newstyle server magic and the prefix of each client option.
pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
/// Option reply magic ("Fixed newstyle negotiation").
pub const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

/// Request header: magic, flags, type, cookie, offset, length.
pub const REQUEST_LEN: usize = 28;
/// Option header: IHAVEOPT, option, length.
pub const OPTION_HEADER_LEN: usize = 16;
pub const SIMPLE_REPLY_LEN: usize = 16;
pub const STRUCTURED_HEADER_LEN: usize = 20;
/// Option data longer than this is refused (strings are at most 4096 bytes by the spec; an
/// INFO/GO request adds a few info codes).
pub const MAX_OPTION_DATA: u32 = 16 << 10;

/// Handshake flags (server, 16 bits).
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flags (32 bits).
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

/// Transmission flags (16 bits).
pub mod tflag {
    pub const HAS_FLAGS: u16 = 1 << 0;
    pub const READ_ONLY: u16 = 1 << 1;
    pub const SEND_FLUSH: u16 = 1 << 2;
    pub const SEND_FUA: u16 = 1 << 3;
    pub const ROTATIONAL: u16 = 1 << 4;
    pub const SEND_TRIM: u16 = 1 << 5;
    pub const SEND_WRITE_ZEROES: u16 = 1 << 6;
    pub const SEND_DF: u16 = 1 << 7;
    pub const CAN_MULTI_CONN: u16 = 1 << 8;
}

/// Option codes.
pub mod opt {
    pub const EXPORT_NAME: u32 = 1;
    pub const ABORT: u32 = 2;
    pub const LIST: u32 = 3;
    pub const STARTTLS: u32 = 5;
    pub const INFO: u32 = 6;
    pub const GO: u32 = 7;
    pub const STRUCTURED_REPLY: u32 = 8;
    pub const LIST_META_CONTEXT: u32 = 9;
    pub const SET_META_CONTEXT: u32 = 10;
}

/// Option reply types.
pub mod rep {
    pub const ACK: u32 = 1;
    pub const SERVER: u32 = 2;
    pub const INFO: u32 = 3;
    pub const FLAG_ERROR: u32 = 1 << 31;
    pub const ERR_UNSUP: u32 = FLAG_ERROR | 1;
    pub const ERR_POLICY: u32 = FLAG_ERROR | 2;
    pub const ERR_INVALID: u32 = FLAG_ERROR | 3;
    pub const ERR_UNKNOWN: u32 = FLAG_ERROR | 6;
}

/// NBD_INFO_* codes carried by NBD_REP_INFO.
pub mod info {
    pub const EXPORT: u16 = 0;
    pub const NAME: u16 = 1;
    pub const DESCRIPTION: u16 = 2;
    pub const BLOCK_SIZE: u16 = 3;
}

/// Command flags (16 bits).
pub mod cflag {
    pub const FUA: u16 = 1 << 0;
    pub const NO_HOLE: u16 = 1 << 1;
    pub const DF: u16 = 1 << 2;
    pub const REQ_ONE: u16 = 1 << 3;
    pub const FAST_ZERO: u16 = 1 << 4;
}

/// Errors as the protocol numbers them ("Error values"): not the host's errno values, though
/// they coincide on Linux.
pub mod errno {
    pub const EPERM: u32 = 1;
    pub const EIO: u32 = 5;
    pub const ENOMEM: u32 = 12;
    pub const EINVAL: u32 = 22;
    pub const ENOSPC: u32 = 28;
    pub const EOVERFLOW: u32 = 75;
    pub const ENOTSUP: u32 = 95;
    pub const ESHUTDOWN: u32 = 108;

    /// Map a host errno to the protocol's set; anything unlisted is EIO.
    pub fn from_host(e: i32) -> u32 {
        match e {
            libc::EPERM => EPERM,
            libc::ENOMEM => ENOMEM,
            libc::EINVAL => EINVAL,
            libc::ENOSPC => ENOSPC,
            libc::EOVERFLOW => EOVERFLOW,
            libc::ENOTSUP => ENOTSUP,
            libc::ESHUTDOWN => ESHUTDOWN,
            _ => EIO,
        }
    }
}

/// Structured reply chunk types.
pub mod chunk {
    pub const NONE: u16 = 0;
    pub const OFFSET_DATA: u16 = 1;
    pub const ERROR: u16 = (1 << 15) | 1;
    pub const FLAG_DONE: u16 = 1 << 0;
}

/// Violations that end the connection (everything else gets an error reply).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NbdError {
    #[error("client sent unknown client flags {0:#x}")]
    BadClientFlags(u32),
    #[error("option magic {0:#018x} is not IHAVEOPT")]
    BadOptionMagic(u64),
    #[error("option {option} carries {len} bytes of data, more than the {max} accepted")]
    OptionTooLong { option: u32, len: u32, max: u32 },
    #[error("export {0:?} does not exist (NBD_OPT_EXPORT_NAME cannot be refused politely)")]
    UnknownExport(String),
    #[error("option {0} is not supported and the client did not negotiate fixed newstyle")]
    UnsupportedOption(u32),
    #[error("request magic {0:#010x} is not NBD_REQUEST_MAGIC")]
    BadRequestMagic(u32),
    #[error("a handshake message was shorter than its fixed size")]
    Short,
}

/// Commands of the transmission phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Read,
    Write,
    Disc,
    Flush,
    Trim,
    Cache,
    WriteZeroes,
    BlockStatus,
    Other(u16),
}

impl Command {
    pub fn from_u16(v: u16) -> Command {
        match v {
            0 => Command::Read,
            1 => Command::Write,
            2 => Command::Disc,
            3 => Command::Flush,
            4 => Command::Trim,
            5 => Command::Cache,
            6 => Command::WriteZeroes,
            7 => Command::BlockStatus,
            v => Command::Other(v),
        }
    }

    pub fn to_u16(self) -> u16 {
        match self {
            Command::Read => 0,
            Command::Write => 1,
            Command::Disc => 2,
            Command::Flush => 3,
            Command::Trim => 4,
            Command::Cache => 5,
            Command::WriteZeroes => 6,
            Command::BlockStatus => 7,
            Command::Other(v) => v,
        }
    }
}

/// A request header ("Request message").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub flags: u16,
    pub command: Command,
    pub cookie: u64,
    pub offset: u64,
    pub length: u32,
}

impl Request {
    /// Parse a 28-byte header. Fails only on a wrong magic (or a short buffer).
    pub fn parse(b: &[u8]) -> Result<Request, NbdError> {
        let mut b = b.get(..REQUEST_LEN).ok_or(NbdError::Short)?;
        let magic = b.get_u32();
        if magic != REQUEST_MAGIC {
            return Err(NbdError::BadRequestMagic(magic));
        }
        Ok(Request {
            flags: b.get_u16(),
            command: Command::from_u16(b.get_u16()),
            cookie: b.get_u64(),
            offset: b.get_u64(),
            length: b.get_u32(),
        })
    }

    pub fn emit(&self, out: &mut impl BufMut) {
        out.put_u32(REQUEST_MAGIC);
        out.put_u16(self.flags);
        out.put_u16(self.command.to_u16());
        out.put_u64(self.cookie);
        out.put_u64(self.offset);
        out.put_u32(self.length);
    }

    /// Bytes of payload that follow the header.
    pub fn payload_len(&self) -> u32 {
        if self.command == Command::Write {
            self.length
        } else {
            0
        }
    }
}

/// "Simple reply message": magic, error, cookie; READ data follows when error is 0.
pub fn simple_reply(cookie: u64, error: u32, out: &mut impl BufMut) {
    out.put_u32(SIMPLE_REPLY_MAGIC);
    out.put_u32(error);
    out.put_u64(cookie);
}

/// A parsed simple reply header (for clients and tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimpleReply {
    pub error: u32,
    pub cookie: u64,
}

impl SimpleReply {
    pub fn parse(b: &[u8]) -> Option<SimpleReply> {
        let mut b = b.get(..SIMPLE_REPLY_LEN)?;
        if b.get_u32() != SIMPLE_REPLY_MAGIC {
            return None;
        }
        Some(SimpleReply {
            error: b.get_u32(),
            cookie: b.get_u64(),
        })
    }
}

/// "Structured reply chunk message" header; `len` bytes of payload follow.
pub fn structured_header(cookie: u64, flags: u16, kind: u16, len: u32, out: &mut impl BufMut) {
    out.put_u32(STRUCTURED_REPLY_MAGIC);
    out.put_u16(flags);
    out.put_u16(kind);
    out.put_u64(cookie);
    out.put_u32(len);
}

/// The whole reply to a READ that succeeded, header first then `data`: a simple reply, or one
/// final OFFSET_DATA chunk when structured replies were negotiated.
pub fn read_reply_header(structured: bool, cookie: u64, offset: u64, data_len: usize) -> Vec<u8> {
    let mut h = Vec::with_capacity(STRUCTURED_HEADER_LEN + 8);
    if structured {
        structured_header(
            cookie,
            chunk::FLAG_DONE,
            chunk::OFFSET_DATA,
            8 + data_len as u32,
            &mut h,
        );
        h.put_u64(offset);
    } else {
        simple_reply(cookie, 0, &mut h);
    }
    h
}

/// The reply to anything else (or to a failed READ): a simple reply, or for a structured READ
/// a final NONE / ERROR chunk (a structured session must not answer READ simply).
pub fn status_reply(structured_read: bool, cookie: u64, error: u32) -> Vec<u8> {
    let mut h = Vec::with_capacity(STRUCTURED_HEADER_LEN + 6);
    if !structured_read {
        simple_reply(cookie, error, &mut h);
    } else if error == 0 {
        structured_header(cookie, chunk::FLAG_DONE, chunk::NONE, 0, &mut h);
    } else {
        structured_header(cookie, chunk::FLAG_DONE, chunk::ERROR, 6, &mut h);
        h.put_u32(error);
        h.put_u16(0);
    }
    h
}

/// What the server tells clients about an export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportInfo {
    pub name: String,
    pub description: String,
    pub size: u64,
    /// Transmission flags (HAS_FLAGS is added on the wire).
    pub flags: u16,
    pub min_block: u32,
    pub preferred_block: u32,
    pub max_block: u32,
}

/// How the handshake ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Enter transmission; `structured` if NBD_OPT_STRUCTURED_REPLY was acknowledged.
    Transmission { structured: bool },
    /// The client aborted (soft disconnect): send what is queued, then close.
    Close,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    ClientFlags,
    Options,
    Done(Outcome),
}

/// The server side of the fixed-newstyle handshake. Feed it client bytes with
/// [`Negotiation::handle_input`]; send what [`Negotiation::poll_transmit`] returns. It consumes
/// only handshake bytes, so anything after GO / EXPORT_NAME stays in the buffer for the
/// transmission phase.
#[derive(Debug)]
pub struct Negotiation {
    /// The exports offered; the first is the default (the empty name).
    exports: Vec<ExportInfo>,
    /// Which one the client chose (valid once the handshake is done).
    chosen: usize,
    state: State,
    fixed: bool,
    no_zeroes: bool,
    structured: bool,
    out: Vec<u8>,
}

impl Negotiation {
    pub fn new(export: ExportInfo) -> Negotiation {
        Negotiation::with_exports(vec![export])
    }

    /// A server offering several exports by name (NBD_OPT_LIST lists them).
    pub fn with_exports(exports: Vec<ExportInfo>) -> Negotiation {
        let mut out = Vec::with_capacity(18);
        out.put_u64(NBDMAGIC);
        out.put_u64(IHAVEOPT);
        out.put_u16(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
        Negotiation {
            exports,
            chosen: 0,
            state: State::ClientFlags,
            fixed: false,
            no_zeroes: false,
            structured: false,
            out,
        }
    }

    /// Bytes to send to the client, if any.
    pub fn poll_transmit(&mut self) -> Option<Vec<u8>> {
        if self.out.is_empty() {
            None
        } else {
            Some(std::mem::take(&mut self.out))
        }
    }

    /// The index of the export the client chose, once the handshake is over.
    pub fn chosen(&self) -> usize {
        self.chosen
    }

    /// The export `name` asks for; the empty name is the conventional default export.
    fn find(&self, name: &[u8]) -> Option<usize> {
        if name.is_empty() {
            return (!self.exports.is_empty()).then_some(0);
        }
        self.exports.iter().position(|e| e.name.as_bytes() == name)
    }

    /// The outcome once the handshake is over.
    pub fn outcome(&self) -> Option<Outcome> {
        match self.state {
            State::Done(o) => Some(o),
            _ => None,
        }
    }

    /// Consume every complete handshake message in `buf`. `Ok(None)`: need more bytes.
    /// `Err`: a violation that ends the connection (queued output may still be sent).
    pub fn handle_input(&mut self, buf: &mut BytesMut) -> Result<Option<Outcome>, NbdError> {
        loop {
            match self.state {
                State::Done(o) => return Ok(Some(o)),
                State::ClientFlags => {
                    if buf.len() < 4 {
                        return Ok(None);
                    }
                    let flags = buf.get_u32();
                    if flags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
                        return Err(NbdError::BadClientFlags(flags));
                    }
                    self.fixed = flags & FLAG_C_FIXED_NEWSTYLE != 0;
                    self.no_zeroes = flags & FLAG_C_NO_ZEROES != 0;
                    self.state = State::Options;
                }
                State::Options => {
                    if buf.len() < OPTION_HEADER_LEN {
                        return Ok(None);
                    }
                    let mut h = &buf[..OPTION_HEADER_LEN];
                    let magic = h.get_u64();
                    let option = h.get_u32();
                    let len = h.get_u32();
                    if magic != IHAVEOPT {
                        return Err(NbdError::BadOptionMagic(magic));
                    }
                    if len > MAX_OPTION_DATA {
                        return Err(NbdError::OptionTooLong {
                            option,
                            len,
                            max: MAX_OPTION_DATA,
                        });
                    }
                    if buf.len() < OPTION_HEADER_LEN + len as usize {
                        return Ok(None);
                    }
                    buf.advance(OPTION_HEADER_LEN);
                    let data = buf.split_to(len as usize).freeze();
                    self.on_option(option, data)?;
                }
            }
        }
    }

    fn flags(&self, i: usize) -> u16 {
        tflag::HAS_FLAGS | self.exports[i].flags
    }

    fn reply(&mut self, option: u32, kind: u32, data: &[u8]) {
        self.out.put_u64(OPT_REPLY_MAGIC);
        self.out.put_u32(option);
        self.out.put_u32(kind);
        self.out.put_u32(data.len() as u32);
        self.out.put_slice(data);
    }

    fn error(&mut self, option: u32, kind: u32, msg: &str) {
        self.reply(option, kind, msg.as_bytes());
    }

    fn on_option(&mut self, option: u32, data: Bytes) -> Result<(), NbdError> {
        match option {
            opt::EXPORT_NAME => {
                let Some(i) = self.find(&data) else {
                    return Err(NbdError::UnknownExport(
                        String::from_utf8_lossy(&data).into_owned(),
                    ));
                };
                self.chosen = i;
                self.out.put_u64(self.exports[i].size);
                self.out.put_u16(self.flags(i));
                if !self.no_zeroes {
                    self.out.put_bytes(0, 124);
                }
                self.state = State::Done(Outcome::Transmission {
                    structured: self.structured,
                });
            }
            _ if !self.fixed => return Err(NbdError::UnsupportedOption(option)),
            opt::ABORT => {
                self.reply(option, rep::ACK, &[]);
                self.state = State::Done(Outcome::Close);
            }
            opt::LIST => {
                if !data.is_empty() {
                    self.error(option, rep::ERR_INVALID, "NBD_OPT_LIST takes no data");
                    return Ok(());
                }
                for i in 0..self.exports.len() {
                    let name = self.exports[i].name.clone();
                    let mut d = Vec::with_capacity(4 + name.len());
                    d.put_u32(name.len() as u32);
                    d.put_slice(name.as_bytes());
                    self.reply(option, rep::SERVER, &d);
                }
                self.reply(option, rep::ACK, &[]);
            }
            opt::INFO | opt::GO => self.on_info_go(option, &data),
            opt::STRUCTURED_REPLY => {
                if !data.is_empty() {
                    self.error(option, rep::ERR_INVALID, "option takes no data");
                } else {
                    self.structured = true;
                    self.reply(option, rep::ACK, &[]);
                }
            }
            opt::STARTTLS => self.error(option, rep::ERR_POLICY, "TLS is not offered"),
            _ => self.error(option, rep::ERR_UNSUP, "option not supported"),
        }
        Ok(())
    }

    /// NBD_OPT_INFO / NBD_OPT_GO: u32 name length, name, u16 count, count × u16 info codes.
    fn on_info_go(&mut self, option: u32, mut d: &[u8]) {
        let parsed = (|| {
            if d.len() < 4 {
                return None;
            }
            let n = d.get_u32() as usize;
            let name = d.get(..n)?.to_vec();
            d.advance(n);
            if d.len() < 2 {
                return None;
            }
            let count = d.get_u16() as usize;
            if d.len() != count * 2 {
                return None;
            }
            let codes: Vec<u16> = (0..count).map(|_| d.get_u16()).collect();
            Some((name, codes))
        })();
        let Some((name, codes)) = parsed else {
            self.error(option, rep::ERR_INVALID, "malformed INFO/GO request");
            return;
        };
        let Some(i) = self.find(&name) else {
            self.error(option, rep::ERR_UNKNOWN, "no such export");
            return;
        };
        let export = self.exports[i].clone();
        for code in codes {
            match code {
                info::NAME => {
                    let mut b = Vec::new();
                    b.put_u16(info::NAME);
                    b.put_slice(export.name.as_bytes());
                    self.reply(option, rep::INFO, &b);
                }
                info::DESCRIPTION => {
                    let mut b = Vec::new();
                    b.put_u16(info::DESCRIPTION);
                    b.put_slice(export.description.as_bytes());
                    self.reply(option, rep::INFO, &b);
                }
                // EXPORT is always sent below; BLOCK_SIZE too; unknown codes are ignored.
                _ => {}
            }
        }
        let mut b = Vec::with_capacity(12);
        b.put_u16(info::BLOCK_SIZE);
        b.put_u32(export.min_block);
        b.put_u32(export.preferred_block);
        b.put_u32(export.max_block);
        self.reply(option, rep::INFO, &b);
        let mut b = Vec::with_capacity(12);
        b.put_u16(info::EXPORT);
        b.put_u64(export.size);
        b.put_u16(self.flags(i));
        self.reply(option, rep::INFO, &b);
        self.reply(option, rep::ACK, &[]);
        if option == opt::GO {
            self.chosen = i;
            self.state = State::Done(Outcome::Transmission {
                structured: self.structured,
            });
        }
    }
}

/// Emit a client option (for clients and tests).
pub fn emit_option(option: u32, data: &[u8], out: &mut impl BufMut) {
    out.put_u64(IHAVEOPT);
    out.put_u32(option);
    out.put_u32(data.len() as u32);
    out.put_slice(data);
}

/// A decoded transmission-phase message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decoded {
    /// A request, with its payload for WRITE.
    Request(Request, Bytes),
    /// A WRITE larger than the server takes: its payload is being discarded; answer `error`.
    Refused(Request, u32),
}

/// Splits the transmission-phase byte stream into requests.
#[derive(Debug)]
pub struct RequestDecoder {
    max_payload: u32,
    /// Payload bytes of a refused WRITE still to drop.
    discard: u64,
}

impl RequestDecoder {
    pub fn new(max_payload: u32) -> RequestDecoder {
        RequestDecoder {
            max_payload,
            discard: 0,
        }
    }

    /// The next complete message in `buf`, `Ok(None)` if more bytes are needed. `Err` only on
    /// a broken request magic: the stream can no longer be framed, so the connection ends.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Decoded>, NbdError> {
        if self.discard > 0 {
            let n = (buf.len() as u64).min(self.discard) as usize;
            buf.advance(n);
            self.discard -= n as u64;
            if self.discard > 0 {
                return Ok(None);
            }
        }
        if buf.len() < REQUEST_LEN {
            return Ok(None);
        }
        let req = Request::parse(&buf[..REQUEST_LEN])?;
        let payload = req.payload_len();
        if payload > self.max_payload {
            buf.advance(REQUEST_LEN);
            self.discard = payload as u64;
            return Ok(Some(Decoded::Refused(req, errno::EOVERFLOW)));
        }
        if buf.len() < REQUEST_LEN + payload as usize {
            // Make room for the whole payload at once.
            buf.reserve(REQUEST_LEN + payload as usize - buf.len());
            return Ok(None);
        }
        buf.advance(REQUEST_LEN);
        let data = buf.split_to(payload as usize).freeze();
        Ok(Some(Decoded::Request(req, data)))
    }

    /// True while a refused payload is being dropped.
    pub fn discarding(&self) -> bool {
        self.discard > 0
    }
}

/// Why a request is refused before it reaches the device, or `None` if it is acceptable.
/// `size` is the export size; `structured` whether structured replies were negotiated.
pub fn validate(req: &Request, size: u64, max_payload: u32, structured: bool) -> Option<u32> {
    let allowed = match req.command {
        Command::Read => {
            if structured {
                cflag::DF
            } else {
                0
            }
        }
        Command::Write | Command::Trim => cflag::FUA,
        Command::WriteZeroes => cflag::FUA | cflag::NO_HOLE,
        Command::Flush | Command::Disc => 0,
        _ => return Some(errno::EINVAL),
    };
    if req.flags & !allowed != 0 {
        return Some(errno::EINVAL);
    }
    match req.command {
        Command::Flush => (req.offset != 0 || req.length != 0).then_some(errno::EINVAL),
        Command::Disc => None,
        _ => {
            if matches!(req.command, Command::Read) && req.length > max_payload {
                return Some(errno::EOVERFLOW);
            }
            match req.offset.checked_add(req.length as u64) {
                Some(end) if end <= size => None,
                _ if req.command == Command::Read => Some(errno::EINVAL),
                _ => Some(errno::ENOSPC),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn export() -> ExportInfo {
        ExportInfo {
            name: "ns1".into(),
            description: "test".into(),
            size: 1 << 20,
            flags: tflag::SEND_FLUSH,
            min_block: 1,
            preferred_block: 4096,
            max_block: 32 << 20,
        }
    }

    fn take_replies(out: &[u8]) -> Vec<(u32, u32, Vec<u8>)> {
        let mut b = out;
        let mut v = Vec::new();
        while b.len() >= 20 {
            assert_eq!(b.get_u64(), OPT_REPLY_MAGIC);
            let o = b.get_u32();
            let t = b.get_u32();
            let n = b.get_u32() as usize;
            v.push((o, t, b[..n].to_vec()));
            b.advance(n);
        }
        assert!(b.is_empty());
        v
    }

    #[test]
    fn greeting_then_go() {
        let mut n = Negotiation::new(export());
        let g = n.poll_transmit().unwrap();
        assert_eq!(&g[..8], b"NBDMAGIC");
        assert_eq!(&g[8..16], b"IHAVEOPT");
        assert_eq!(g.len(), 18);
        let mut buf = BytesMut::new();
        buf.put_u32(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
        let mut d = Vec::new();
        d.put_u32(0);
        d.put_u16(1);
        d.put_u16(info::BLOCK_SIZE);
        emit_option(opt::GO, &d, &mut buf);
        // A request already pipelined behind GO stays in the buffer.
        buf.put_slice(&[0xAA; 3]);
        assert_eq!(
            n.handle_input(&mut buf).unwrap(),
            Some(Outcome::Transmission { structured: false })
        );
        assert_eq!(&buf[..], &[0xAA; 3]);
        let r = take_replies(&n.poll_transmit().unwrap());
        assert_eq!(r.len(), 3);
        assert_eq!(r[0].1, rep::INFO);
        assert_eq!(&r[0].2[..2], &info::BLOCK_SIZE.to_be_bytes());
        assert_eq!(r[1].1, rep::INFO);
        let mut e = &r[1].2[..];
        assert_eq!(e.get_u16(), info::EXPORT);
        assert_eq!(e.get_u64(), 1 << 20);
        assert_eq!(e.get_u16(), tflag::HAS_FLAGS | tflag::SEND_FLUSH);
        assert_eq!(r[2].1, rep::ACK);
    }

    #[test]
    fn export_name_with_and_without_zeroes() {
        for (cflags, len) in [(FLAG_C_FIXED_NEWSTYLE, 134), (FLAG_C_NO_ZEROES, 10)] {
            let mut n = Negotiation::new(export());
            n.poll_transmit();
            let mut buf = BytesMut::new();
            buf.put_u32(cflags);
            emit_option(opt::EXPORT_NAME, b"ns1", &mut buf);
            assert!(matches!(
                n.handle_input(&mut buf),
                Ok(Some(Outcome::Transmission { .. }))
            ));
            assert_eq!(n.poll_transmit().unwrap().len(), len);
        }
    }

    /// Several exports: LIST names each, GO picks one by name (with its size), the empty
    /// name is the first, an unknown name is refused.
    #[test]
    fn several_exports_listed_and_chosen_by_name() {
        let two = ExportInfo {
            name: "ns2".into(),
            size: 8 << 20,
            ..export()
        };
        let go = |name: &[u8]| {
            let mut n = Negotiation::with_exports(vec![export(), two.clone()]);
            n.poll_transmit();
            let mut buf = BytesMut::new();
            buf.put_u32(FLAG_C_FIXED_NEWSTYLE);
            emit_option(opt::LIST, &[], &mut buf);
            let mut d = Vec::new();
            d.put_u32(name.len() as u32);
            d.put_slice(name);
            d.put_u16(0);
            emit_option(opt::GO, &d, &mut buf);
            emit_option(opt::ABORT, &[], &mut buf);
            let out = n.handle_input(&mut buf).unwrap();
            (n, out)
        };
        let (mut n, out) = go(b"ns2");
        assert_eq!(out, Some(Outcome::Transmission { structured: false }));
        assert_eq!(n.chosen(), 1);
        let r = take_replies(&n.poll_transmit().unwrap());
        let names: Vec<&[u8]> = r
            .iter()
            .filter(|r| r.1 == rep::SERVER)
            .map(|r| &r.2[4..])
            .collect();
        assert_eq!(names, [&b"ns1"[..], b"ns2"]);
        let mut e = &r
            .iter()
            .find(|r| r.1 == rep::INFO && r.2[..2] == info::EXPORT.to_be_bytes())
            .unwrap()
            .2[2..];
        assert_eq!(e.get_u64(), 8 << 20);
        let (n, _) = go(b"");
        assert_eq!(n.chosen(), 0);
        let (mut n, out) = go(b"ns3");
        assert_eq!(out, Some(Outcome::Close));
        let r = take_replies(&n.poll_transmit().unwrap());
        assert!(r.iter().any(|r| r.1 == rep::ERR_UNKNOWN));
    }

    #[test]
    fn unknown_export_and_options() {
        let mut n = Negotiation::new(export());
        n.poll_transmit();
        let mut buf = BytesMut::new();
        buf.put_u32(FLAG_C_FIXED_NEWSTYLE);
        let mut d = Vec::new();
        d.put_u32(4);
        d.put_slice(b"nope");
        d.put_u16(0);
        emit_option(opt::INFO, &d, &mut buf);
        emit_option(99, b"x", &mut buf);
        emit_option(opt::INFO, &[1, 2], &mut buf);
        emit_option(opt::LIST, &[], &mut buf);
        emit_option(opt::ABORT, &[], &mut buf);
        assert_eq!(n.handle_input(&mut buf).unwrap(), Some(Outcome::Close));
        let r = take_replies(&n.poll_transmit().unwrap());
        let kinds: Vec<u32> = r.iter().map(|r| r.1).collect();
        assert_eq!(
            kinds,
            [
                rep::ERR_UNKNOWN,
                rep::ERR_UNSUP,
                rep::ERR_INVALID,
                rep::SERVER,
                rep::ACK,
                rep::ACK
            ]
        );
        assert_eq!(&r[3].2[4..], b"ns1");
    }

    #[test]
    fn violations_close() {
        let mut n = Negotiation::new(export());
        let mut buf = BytesMut::from(&[0, 0, 0, 4][..]);
        assert_eq!(n.handle_input(&mut buf), Err(NbdError::BadClientFlags(4)));
        let mut n = Negotiation::new(export());
        let mut buf = BytesMut::new();
        buf.put_u32(FLAG_C_FIXED_NEWSTYLE);
        buf.put_u64(1);
        buf.put_u64(0);
        assert!(matches!(
            n.handle_input(&mut buf),
            Err(NbdError::BadOptionMagic(1))
        ));
        let mut n = Negotiation::new(export());
        let mut buf = BytesMut::new();
        buf.put_u32(FLAG_C_FIXED_NEWSTYLE);
        buf.put_u64(IHAVEOPT);
        buf.put_u32(opt::GO);
        buf.put_u32(u32::MAX);
        assert!(matches!(
            n.handle_input(&mut buf),
            Err(NbdError::OptionTooLong { .. })
        ));
    }

    #[test]
    fn decoder_frames_writes_and_refuses_oversize() {
        let mut dec = RequestDecoder::new(8);
        let mut buf = BytesMut::new();
        let w = Request {
            flags: cflag::FUA,
            command: Command::Write,
            cookie: 7,
            offset: 512,
            length: 4,
        };
        w.emit(&mut buf);
        assert_eq!(dec.decode(&mut buf).unwrap(), None);
        buf.put_slice(b"abcd");
        assert_eq!(
            dec.decode(&mut buf).unwrap(),
            Some(Decoded::Request(w, Bytes::from_static(b"abcd")))
        );
        let big = Request { length: 100, ..w };
        big.emit(&mut buf);
        buf.put_bytes(1, 60);
        assert_eq!(
            dec.decode(&mut buf).unwrap(),
            Some(Decoded::Refused(big, errno::EOVERFLOW))
        );
        assert_eq!(dec.decode(&mut buf).unwrap(), None);
        assert!(dec.discarding());
        buf.put_bytes(1, 40);
        let f = Request {
            flags: 0,
            command: Command::Flush,
            cookie: 9,
            offset: 0,
            length: 0,
        };
        f.emit(&mut buf);
        assert_eq!(
            dec.decode(&mut buf).unwrap(),
            Some(Decoded::Request(f, Bytes::new()))
        );
        buf.put_u32(0xdead_beef);
        buf.put_bytes(0, 24);
        assert!(dec.decode(&mut buf).is_err());
    }

    #[test]
    fn validation() {
        let r = |command, flags, offset, length| Request {
            flags,
            command,
            cookie: 1,
            offset,
            length,
        };
        assert_eq!(
            validate(&r(Command::Read, 0, 0, 4096), 4096, 1 << 20, false),
            None
        );
        assert_eq!(
            validate(&r(Command::Read, 0, 1, 4096), 4096, 1 << 20, false),
            Some(errno::EINVAL)
        );
        assert_eq!(
            validate(&r(Command::Write, 0, u64::MAX, 2), 4096, 1 << 20, false),
            Some(errno::ENOSPC)
        );
        assert_eq!(
            validate(&r(Command::Read, cflag::DF, 0, 1), 4096, 1 << 20, false),
            Some(errno::EINVAL)
        );
        assert_eq!(
            validate(&r(Command::Read, cflag::DF, 0, 1), 4096, 1 << 20, true),
            None
        );
        assert_eq!(
            validate(&r(Command::Flush, 0, 1, 0), 4096, 1 << 20, false),
            Some(errno::EINVAL)
        );
        assert_eq!(
            validate(&r(Command::Other(77), 0, 0, 0), 4096, 1 << 20, false),
            Some(errno::EINVAL)
        );
        assert_eq!(
            validate(&r(Command::Read, 0, 0, 2 << 20), 4 << 20, 1 << 20, false),
            Some(errno::EOVERFLOW)
        );
    }
}

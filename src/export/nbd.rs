//! The NBD protocol, server side, sans-I/O: its constants, the transmission-phase request
//! decoder and reply encoders (the fixed-newstyle handshake is `nbd_handshake.rs`). Bytes in,
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

//! The NBD fixed-newstyle handshake, server side, sans-I/O: a state machine
//! ([`Negotiation`]) fed the client's bytes, answering with the options' replies until GO or
//! EXPORT_NAME picks an export (or the client aborts).
//!
//! Spec: NetworkBlockDevice `doc/proto.md`, "Handshake" and "Option types".

use bytes::{Buf, BufMut, Bytes, BytesMut};

use super::nbd::*;

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
}

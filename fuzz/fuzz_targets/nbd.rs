//! Feed arbitrary bytes, in arbitrary pieces, to the NBD server's sans-I/O side: the
//! fixed-newstyle handshake and then the transmission-phase request decoder. Neither may panic;
//! every request that decodes must re-emit to the same header bytes.

#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use nvmf_rdma::export::nbd::{tflag, validate, Decoded, Request, RequestDecoder};
use nvmf_rdma::export::nbd_handshake::{ExportInfo, Negotiation, Outcome};

fuzz_target!(|data: &[u8]| {
    let Some((&step, rest)) = data.split_first() else {
        return;
    };
    let step = step as usize + 1;
    let mut n = Negotiation::new(ExportInfo {
        name: "ns1".into(),
        description: "fuzz".into(),
        size: 1 << 30,
        flags: tflag::SEND_FLUSH | tflag::SEND_TRIM,
        min_block: 1,
        preferred_block: 4096,
        max_block: 1 << 16,
    });
    let mut buf = BytesMut::new();
    let mut chunks = rest.chunks(step);
    let mut outcome = None;
    for c in chunks.by_ref() {
        buf.extend_from_slice(c);
        match n.handle_input(&mut buf) {
            Ok(Some(o)) => {
                outcome = Some(o);
                break;
            }
            Ok(None) => {}
            Err(_) => return,
        }
        let _ = n.poll_transmit();
    }
    let Some(Outcome::Transmission { structured }) = outcome else {
        return;
    };
    let mut dec = RequestDecoder::new(1 << 16);
    loop {
        match dec.decode(&mut buf) {
            Ok(Some(Decoded::Request(r, payload))) => {
                assert_eq!(payload.len(), r.payload_len() as usize);
                let mut b = Vec::new();
                r.emit(&mut b);
                assert_eq!(Request::parse(&b).unwrap(), r);
                let _ = validate(&r, 1 << 30, 1 << 16, structured);
            }
            Ok(Some(Decoded::Refused(..))) => {}
            Ok(None) => match chunks.next() {
                Some(c) => buf.extend_from_slice(c),
                None => return,
            },
            Err(_) => return,
        }
    }
});

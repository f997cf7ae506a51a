//! systemd's readiness protocol (sd_notify): `READY=1`, `STOPPING=1`, `STATUS=...` as one
//! datagram to the unix socket named by `$NOTIFY_SOCKET` (a path, or `@name` in the abstract
//! namespace). Without the variable nothing is sent. `daemon --background` uses the same
//! protocol between the parent and the daemon it starts.

use std::os::unix::net::UnixDatagram;
use std::path::Path;

/// Send `msg` to `$NOTIFY_SOCKET`, if set. Errors are returned, not fatal to the caller.
pub(crate) fn notify(msg: &str) -> std::io::Result<()> {
    match std::env::var_os("NOTIFY_SOCKET") {
        Some(p) => send_to(Path::new(&p), msg),
        None => Ok(()),
    }
}

/// One datagram to the notify socket at `path`.
pub(crate) fn send_to(path: &Path, msg: &str) -> std::io::Result<()> {
    let s = UnixDatagram::unbound()?;
    let bytes = path.as_os_str().as_encoded_bytes();
    if let Some(name) = bytes.strip_prefix(b"@") {
        use std::os::linux::net::SocketAddrExt;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
        s.send_to_addr(msg.as_bytes(), &addr)?;
    } else {
        s.send_to(msg.as_bytes(), path)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notify_reaches_a_path_socket() {
        let p = std::env::temp_dir().join(format!("nvmf-notify-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&p);
        let r = UnixDatagram::bind(&p).unwrap();
        send_to(&p, "READY=1\nSTATUS=serving").unwrap();
        let mut buf = [0u8; 64];
        let n = r.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1\nSTATUS=serving");
        std::fs::remove_file(&p).unwrap();
    }
}

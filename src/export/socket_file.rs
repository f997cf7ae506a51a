//! Unix socket files at paths a user names (`--nbd unix:PATH`, control sockets). What is
//! already at the path is left alone unless it is a stale socket of ours (a socket file of
//! our user that nobody listens on), and at the end only the socket we bound is removed, so
//! a mistyped path never costs the user a file.

use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

/// The socket file a listener of ours was bound to: removed on drop while it is still the
/// one we made (same device and inode).
#[derive(Debug)]
pub struct SocketFile {
    path: PathBuf,
    dev: u64,
    ino: u64,
}

impl SocketFile {
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        if let Ok(m) = std::fs::symlink_metadata(&self.path) {
            if (m.dev(), m.ino()) == (self.dev, self.ino) {
                let _ = std::fs::remove_file(&self.path);
            }
        }
    }
}

/// Bind a listening unix socket at `path`, mode 0600 whatever the umask. A stale socket of
/// ours there is replaced; a socket someone answers on, someone else's socket and anything
/// that is not a socket are errors that leave it as it was.
pub fn bind_socket(path: &Path) -> io::Result<(UnixListener, SocketFile)> {
    clear_stale(path)?;
    let l = UnixListener::bind(path)?;
    let m = std::fs::symlink_metadata(path)?;
    let file = SocketFile {
        path: path.to_path_buf(),
        dev: m.dev(),
        ino: m.ino(),
    };
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok((l, file))
}

/// [`bind_socket`] for tokio (called within a runtime).
pub fn bind_listener(path: &Path) -> io::Result<(tokio::net::UnixListener, SocketFile)> {
    let (l, f) = bind_socket(path)?;
    l.set_nonblocking(true)?;
    Ok((tokio::net::UnixListener::from_std(l)?, f))
}

/// Is the peer of `s` our own user, or root? Control sockets serve only those (their file
/// mode says the same; this also holds when the file was reached through a descriptor).
pub fn same_user(s: &tokio::net::UnixStream) -> bool {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    s.peer_cred().is_ok_and(|c| c.uid() == euid || c.uid() == 0)
}

/// Remove what is at `path` if it is a stale socket of ours; an error for anything else.
fn clear_stale(path: &Path) -> io::Result<()> {
    let m = match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
        Ok(m) => m,
    };
    let refuse = |kind, what: String| Err(io::Error::new(kind, what));
    if !m.file_type().is_socket() {
        return refuse(
            io::ErrorKind::AlreadyExists,
            "the path exists and is not a socket; it is left alone: pick another path".into(),
        );
    }
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    if m.uid() != euid {
        return refuse(
            io::ErrorKind::PermissionDenied,
            format!(
                "a socket of uid {} is there; it is left alone: pick another path",
                m.uid()
            ),
        );
    }
    match UnixStream::connect(path) {
        Ok(_) => refuse(
            io::ErrorKind::AddrInUse,
            "another server answers on this socket".into(),
        ),
        Err(e) if e.raw_os_error() == Some(libc::ECONNREFUSED) => {
            match std::fs::remove_file(path) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
                _ => Ok(()),
            }
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("nvmf-sockfile-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_regular_file_at_the_path_is_refused_and_kept() {
        let d = dir("file");
        let p = d.join("precious.txt");
        std::fs::write(&p, b"keep me").unwrap();
        let e = bind_socket(&p).unwrap_err();
        assert!(e.to_string().contains("not a socket"), "{e}");
        assert_eq!(std::fs::read(&p).unwrap(), b"keep me");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_stale_socket_is_replaced_a_live_one_is_not() {
        let d = dir("stale");
        let p = d.join("s.sock");
        drop(UnixListener::bind(&p).unwrap());
        let (live, f) = bind_socket(&p).expect("a stale socket of ours is replaced");
        let e = bind_socket(&p).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AddrInUse, "{e}");
        assert!(p.exists(), "the live socket stays");
        drop(live);
        drop(f);
        assert!(!p.exists(), "ours goes at the end");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn only_the_socket_we_bound_is_removed() {
        let d = dir("swap");
        let p = d.join("s.sock");
        let (_l, f) = bind_socket(&p).unwrap();
        // Someone put their own file in its place meanwhile.
        std::fs::remove_file(&p).unwrap();
        std::fs::write(&p, b"theirs").unwrap();
        drop(f);
        assert_eq!(std::fs::read(&p).unwrap(), b"theirs");
        std::fs::remove_dir_all(&d).unwrap();
    }
}

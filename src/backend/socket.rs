//! Binding a Unix listening socket at a path safely: a socket a live process still
//! answers on is refused, a stale one replaced, anything else at the path left alone;
//! the new socket is never reachable with looser permissions than configured.

use std::fs::{self, DirBuilder, OpenOptions, Permissions};
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{
    chown, lchown, DirBuilderExt, FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt,
};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use crate::sys::sock::listen_unix;

use thiserror::Error;
use tracing::warn;

/// Mode bits and group a socket gets (the group resolved to a gid).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Access {
    pub mode: u32,
    /// `None`: the group gsonet runs as.
    pub gid: Option<u32>,
}

/// Mode of the directories gsonet creates on the way to a socket: the socket's group
/// may enter them, nobody else.
pub const DIR_MODE: u32 = 0o750;

#[derive(Debug, Error)]
pub enum BindError {
    #[error("in use by a running process (another gsonet?)")]
    InUse,
    #[error(
        "a {0} is there, not a socket; gsonet replaces only a stale socket: remove it \
         yourself or choose another path"
    )]
    NotASocket(&'static str),
    #[error("{0}")]
    Io(#[from] io::Error),
}

/// What a non-socket at a socket path is, for the error message.
fn kind(t: fs::FileType) -> &'static str {
    if t.is_symlink() {
        "symbolic link"
    } else if t.is_dir() {
        "directory"
    } else if t.is_file() {
        "regular file"
    } else if t.is_fifo() {
        "fifo"
    } else if t.is_block_device() || t.is_char_device() {
        "device node"
    } else {
        "file"
    }
}

/// Whether a socket (or nothing) is at `path`, never following a symlink there.
/// Ok(true): a socket; Ok(false): nothing.
fn socket_at(path: &Path) -> Result<bool, BindError> {
    match fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => Ok(true),
        Ok(m) => Err(BindError::NotASocket(kind(m.file_type()))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// A 64-bit value nobody outside this process can predict (std's hasher keys come
/// from the OS random source).
fn random_u64() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish()
}

/// A fresh directory only gsonet's user can enter, with a name nobody can guess or
/// take first; removed, with what is in it, when dropped.
pub struct PrivateDir {
    path: PathBuf,
}

impl PrivateDir {
    /// Creates `<parent>/<prefix><16 random hex digits>` with mode 0700.
    pub fn create(parent: &Path, prefix: &str) -> io::Result<PrivateDir> {
        let mut last = None;
        for _ in 0..8 {
            let path = parent.join(format!("{prefix}{:016x}", random_u64()));
            // mkdir never follows a symlink at its last component and fails if the
            // name exists, so what we get is ours.
            match DirBuilder::new().mode(0o700).create(&path) {
                Ok(()) => return Ok(PrivateDir { path }),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| io::Error::other("no private directory")))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.path);
    }
}

/// Makes sure `dir` exists. Directories created here get `DIR_MODE` and `gid`; an
/// existing one is left as it is (never loosened), with a warning if any local user
/// could replace what is in it.
fn ensure_dir(dir: &Path, gid: Option<u32>) -> io::Result<()> {
    let mut missing = Vec::new();
    let mut d = dir;
    loop {
        match fs::metadata(d) {
            Ok(m) if m.is_dir() => {
                if missing.is_empty() && m.mode() & 0o002 != 0 && m.mode() & 0o1000 == 0 {
                    warn!(
                        dir = %d.display(),
                        "directory is world-writable without the sticky bit: any local user can \
                         replace the socket in it; use a directory only gsonet's user can write"
                    );
                }
                break;
            }
            Ok(_) => {
                return Err(io::Error::new(
                    io::ErrorKind::NotADirectory,
                    format!("{} is not a directory", d.display()),
                ))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                missing.push(d);
                match d.parent() {
                    Some(p) if !p.as_os_str().is_empty() => d = p,
                    _ => break,
                }
            }
            Err(e) => return Err(e),
        }
    }
    for d in missing.into_iter().rev() {
        match DirBuilder::new().mode(0o700).create(d) {
            Ok(()) => {
                if let Some(g) = gid {
                    lchown(d, None, Some(g))?;
                }
                // The exact mode, whatever the umask: the group must be able to enter.
                fs::set_permissions(d, Permissions::from_mode(DIR_MODE))?;
            }
            // Created by someone else meanwhile: not ours to change.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Gives the socket at `path` its exact mode and group. The path is opened without
/// following a symlink and checked to be a socket; chmod and chown then act on that
/// inode (through /proc/self/fd), never on whatever the path names by then.
fn set_access(path: &Path, access: Access) -> io::Result<()> {
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_NOFOLLOW)
        .open(path)?;
    let m = f.metadata()?;
    if !m.file_type().is_socket() {
        return Err(io::Error::other("replaced by something else while binding"));
    }
    let fd = PathBuf::from(format!("/proc/self/fd/{}", f.as_raw_fd()));
    if m.mode() & 0o7777 != access.mode {
        fs::set_permissions(&fd, Permissions::from_mode(access.mode))?;
    }
    if let Some(g) = access.gid.filter(|g| *g != m.gid()) {
        chown(&fd, None, Some(g))?;
    }
    Ok(())
}

/// Binds `path` with mode and group `access`, creating its directory. Fails with
/// `InUse` when a running process serves the socket there, and with `NotASocket` when
/// something else (a file, a symlink, a directory) is at the path: only a stale socket
/// is removed.
///
/// The socket file is created with at most `access.mode` (less the umask), then given
/// the exact mode and the group: it is never open to more users than configured.
pub fn bind_exclusive(path: &Path, access: Access) -> Result<UnixListener, BindError> {
    if socket_at(path)? {
        if UnixStream::connect(path).is_ok() {
            return Err(BindError::InUse);
        }
        fs::remove_file(path)?;
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    ensure_dir(dir, access.gid)?;
    let listener = listen_unix(path, access.mode & 0o777)?;
    if let Err(e) = set_access(path, access) {
        if socket_at(path).unwrap_or(false) {
            let _ = fs::remove_file(path);
        }
        return Err(e.into());
    }
    Ok(listener)
}

#[cfg(test)]
mod tests {
    use super::*;

    const OPEN: Access = Access {
        mode: 0o660,
        gid: None,
    };

    fn tmpdir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("gsonet-bind-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn live_sockets_are_kept_and_stale_ones_replaced() {
        let dir = tmpdir("live");
        let path = dir.join("sub/x.sock");
        let live = bind_exclusive(&path, OPEN).unwrap();
        assert!(matches!(
            bind_exclusive(&path, OPEN).unwrap_err(),
            BindError::InUse
        ));
        drop(live);
        // The file is left behind by the closed listener: stale, replaced.
        assert!(path.exists());
        let l = bind_exclusive(&path, OPEN).unwrap();
        let _c = UnixStream::connect(&path).unwrap();
        l.accept().unwrap();
        // Bound where it is: `ss -xl` and lsof show the configured path.
        assert_eq!(l.local_addr().unwrap().as_pathname(), Some(path.as_path()));
        let names: Vec<_> = fs::read_dir(dir.join("sub"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("x.sock")]);
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn other_files_at_the_path_are_never_removed() {
        let dir = tmpdir("other");
        fs::create_dir_all(&dir).unwrap();
        let file = dir.join("file.sock");
        fs::write(&file, b"precious").unwrap();
        let link = dir.join("link.sock");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        let dangling = dir.join("dangling.sock");
        std::os::unix::fs::symlink(dir.join("nowhere"), &dangling).unwrap();
        let sub = dir.join("dir.sock");
        fs::create_dir(&sub).unwrap();
        for (p, what) in [
            (&file, "regular file"),
            (&link, "symbolic link"),
            (&dangling, "symbolic link"),
            (&sub, "directory"),
        ] {
            match bind_exclusive(p, OPEN) {
                Err(BindError::NotASocket(k)) => assert_eq!(k, what, "{}", p.display()),
                other => panic!("{}: {other:?}", p.display()),
            }
        }
        assert_eq!(fs::read(&file).unwrap(), b"precious");
        assert_eq!(fs::read_link(&link).unwrap(), file);
        assert!(fs::symlink_metadata(&dangling).is_ok());
        assert!(sub.is_dir());
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn mode_group_and_created_directories() {
        let dir = tmpdir("mode");
        let path = dir.join("a/b/x.sock");
        let _l = bind_exclusive(
            &path,
            Access {
                mode: 0o640,
                gid: Some(4242),
            },
        )
        .unwrap();
        let m = fs::symlink_metadata(&path).unwrap();
        assert!(m.file_type().is_socket());
        assert_eq!((m.mode() & 0o7777, m.gid()), (0o640, 4242));
        for d in [dir.clone(), dir.join("a"), dir.join("a/b")] {
            let m = fs::metadata(&d).unwrap();
            assert_eq!(
                (m.mode() & 0o7777, m.gid()),
                (DIR_MODE, 4242),
                "{}",
                d.display()
            );
        }
        // An existing directory keeps its mode, even a tighter one.
        let tight = dir.join("tight");
        fs::create_dir(&tight).unwrap();
        fs::set_permissions(&tight, Permissions::from_mode(0o700)).unwrap();
        let _t = bind_exclusive(&tight.join("y.sock"), OPEN).unwrap();
        let m = fs::metadata(&tight).unwrap();
        assert_eq!(m.mode() & 0o7777, 0o700);
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn private_dirs_are_0700_and_go_away() {
        let parent = tmpdir("private");
        fs::create_dir_all(&parent).unwrap();
        let a = PrivateDir::create(&parent, "p-").unwrap();
        let b = PrivateDir::create(&parent, "p-").unwrap();
        assert_ne!(a.path(), b.path());
        let m = fs::symlink_metadata(a.path()).unwrap();
        assert!(m.is_dir());
        assert_eq!(m.mode() & 0o777, 0o700);
        fs::write(a.path().join("f"), b"x").unwrap();
        let p = a.path().to_path_buf();
        drop(a);
        assert!(!p.exists());
        drop(b);
        let _ = fs::remove_dir_all(&parent);
    }
}

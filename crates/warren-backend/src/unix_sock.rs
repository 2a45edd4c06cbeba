//! Unix sockets at paths of any length. `sun_path` holds 107 bytes and a
//! NUL, so the sockets of a sandbox under a deep data directory could be
//! neither bound nor reached by their names (every create failed). A longer
//! path is reached through a descriptor of its directory instead,
//! `/proc/self/fd/N/<name>`, which the kernel resolves like any path (the
//! descriptor stays open for the call). QEMU, which names its sockets
//! itself, is started in their directory and given the bare names (see
//! `microvm::qemu`).

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{Mode, OFlags};

/// The longest path `sun_path` takes (without its NUL).
pub const SUN_PATH_MAX: usize = 107;

/// A path a socket call can take for `path`, and what keeps it valid.
struct Reachable {
    path: PathBuf,
    _dir: Option<OwnedFd>,
}

fn reachable(path: &Path) -> io::Result<Reachable> {
    if path.as_os_str().len() <= SUN_PATH_MAX {
        return Ok(Reachable { path: path.to_path_buf(), _dir: None });
    }
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{} names no socket", path.display())));
    };
    let dir = rustix::fs::open(parent, OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())?;
    let short = Path::new(&format!("/proc/self/fd/{}", dir.as_raw_fd())).join(name);
    if short.as_os_str().len() > SUN_PATH_MAX {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("socket name {name:?} is too long")));
    }
    Ok(Reachable { path: short, _dir: Some(dir) })
}

pub fn bind_std(path: &Path) -> io::Result<std::os::unix::net::UnixListener> {
    std::os::unix::net::UnixListener::bind(reachable(path)?.path)
}

/// Needs a Tokio runtime, as `tokio::net::UnixListener::bind` does.
pub fn bind(path: &Path) -> io::Result<tokio::net::UnixListener> {
    tokio::net::UnixListener::bind(reachable(path)?.path)
}

pub fn connect_std(path: &Path) -> io::Result<std::os::unix::net::UnixStream> {
    std::os::unix::net::UnixStream::connect(reachable(path)?.path)
}

pub async fn connect(path: &Path) -> io::Result<tokio::net::UnixStream> {
    let reachable = reachable(path)?;
    tokio::net::UnixStream::connect(&reachable.path).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn sockets_deep_below_any_name_limit_are_bound_and_reached() {
        let tmp = tempfile::tempdir().unwrap();
        let deep = tmp.path().join("d".repeat(100)).join("e".repeat(60));
        std::fs::create_dir_all(&deep).unwrap();
        let sock = deep.join("ctl.sock");
        assert!(sock.as_os_str().len() > SUN_PATH_MAX);
        assert!(std::os::unix::net::UnixListener::bind(&sock).is_err(), "the kernel's limit holds");

        let listener = bind(&sock).unwrap();
        assert!(sock.exists(), "bound at its own path");
        let (client, served) = tokio::join!(connect(&sock), listener.accept());
        client.unwrap();
        served.unwrap();
        let std_listener = bind_std(&deep.join("std.sock")).unwrap();
        connect_std(&deep.join("std.sock")).unwrap();
        std_listener.accept().unwrap();

        let short = tmp.path().join("s.sock");
        let _l = bind_std(&short).unwrap();
        connect_std(&short).unwrap();
        assert!(connect_std(&deep.join("missing.sock")).is_err());
    }
}

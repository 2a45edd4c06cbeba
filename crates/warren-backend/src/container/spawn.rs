//! Starting `warren-init` for a new sandbox and walking it through the setup
//! sequence of [`warren_init::proto::setup`].

use std::fs;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream as StdUnixStream};
use std::path::Path;
use std::process::Stdio;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;
use tokio::process::{Child, Command};
use warren_init::proto::setup::{HostSays, InitSays};
use warren_init::proto::{LISTEN_FD, SETUP_FD};

use super::state::{Layout, IDS_PER_SANDBOX};
use crate::{BackendError, Result};

/// Fds at or above this are free in the child while it moves the inherited
/// ones into place.
const SCRATCH_FD: i32 = 10;

/// Binds the control listener at `layout.ctl_sock()`, owner-only.
pub(crate) fn bind_control(layout: &Layout) -> Result<OwnedFd> {
    let path = layout.ctl_sock();
    let listener = UnixListener::bind(&path).map_err(|e| BackendError::io(format!("bind {}", path.display()), e))?;
    fs::set_permissions(&path, fs::Permissions::from_mode(0o600))
        .map_err(|e| BackendError::io(format!("chmod {}", path.display()), e))?;
    Ok(OwnedFd::from(listener))
}

/// Spawns init with the setup socket at fd 3 and `listener` at fd 4, no
/// environment and no stdio. No parent-death signal: sandboxes outlive a
/// restart of the server.
pub(crate) fn spawn_init(init_binary: &Path, listener: OwnedFd) -> Result<(Child, SetupChannel)> {
    let (host_end, init_end) = StdUnixStream::pair().map_err(|e| BackendError::io("socketpair", e))?;
    let (setup_fd, listen_fd) = (init_end.as_raw_fd(), listener.as_raw_fd());
    let mut command = Command::new(init_binary);
    command.arg0("warren-init").env_clear().stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
    // SAFETY: the closure runs between fork and exec and only calls fcntl(2)
    // and dup2(2), which are async-signal-safe; it allocates nothing. The fds
    // it reads stay open in the parent until spawn returns.
    unsafe {
        command.pre_exec(move || place_fds(setup_fd, listen_fd));
    }
    let child = command.spawn().map_err(|e| BackendError::io(format!("spawn {}", init_binary.display()), e))?;
    // The child has its copies; ours must close so EOF means init is gone.
    drop((init_end, listener));
    host_end.set_nonblocking(true).map_err(|e| BackendError::io("setup socket", e))?;
    let stream = UnixStream::from_std(host_end).map_err(|e| BackendError::io("setup socket", e))?;
    Ok((child, SetupChannel::new(stream)))
}

/// Moves the two inherited fds to their fixed numbers. Both are first copied
/// above [`SCRATCH_FD`] (close-on-exec) so that neither `dup2` can overwrite
/// the other's source; `dup2` then leaves the final numbers inheritable.
fn place_fds(setup_fd: i32, listen_fd: i32) -> std::io::Result<()> {
    let setup_copy = scratch_copy(setup_fd)?;
    let listen_copy = scratch_copy(listen_fd)?;
    move_to(setup_copy, SETUP_FD)?;
    move_to(listen_copy, LISTEN_FD)
}

fn scratch_copy(fd: i32) -> std::io::Result<i32> {
    // SAFETY: fcntl(F_DUPFD_CLOEXEC) on an open fd of this process; no memory
    // is touched and the call is async-signal-safe.
    let copy = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, SCRATCH_FD) };
    if copy < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(copy)
}

fn move_to(fd: i32, target: i32) -> std::io::Result<()> {
    // SAFETY: dup2 on an open fd of this process; async-signal-safe. `target`
    // is one of the protocol's fixed numbers, replaced on purpose.
    if unsafe { libc::dup2(fd, target) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Maps `0..65536` inside the user namespace of `pid` to `uid_base..`.
pub(crate) fn write_id_maps(pid: i32, uid_base: u32) -> Result<()> {
    let line = format!("0 {uid_base} {IDS_PER_SANDBOX}\n");
    for file in ["uid_map", "gid_map"] {
        let path = format!("/proc/{pid}/{file}");
        fs::write(&path, &line).map_err(|e| BackendError::io(format!("write {path}"), e))?;
    }
    Ok(())
}

/// The host end of the setup socket: JSON lines both ways.
pub(crate) struct SetupChannel {
    lines: Lines<BufReader<OwnedReadHalf>>,
    writer: OwnedWriteHalf,
}

impl SetupChannel {
    fn new(stream: UnixStream) -> SetupChannel {
        let (read, writer) = stream.into_split();
        SetupChannel { lines: BufReader::new(read).lines(), writer }
    }

    /// The next message; a `Failed` becomes [`BackendError::Setup`] with
    /// init's message.
    pub(crate) async fn next(&mut self) -> Result<InitSays> {
        match self.receive().await? {
            InitSays::Failed { message } => Err(BackendError::Setup(message)),
            said => Ok(said),
        }
    }

    async fn receive(&mut self) -> Result<InitSays> {
        let line = self
            .lines
            .next_line()
            .await
            .map_err(|e| BackendError::io("read setup socket", e))?
            .ok_or_else(|| BackendError::Setup("init exited during setup".into()))?;
        serde_json::from_str(&line).map_err(|e| BackendError::Protocol(format!("setup message {line:?}: {e}")))
    }

    pub(crate) async fn send(&mut self, message: &HostSays) -> Result<()> {
        let mut line = serde_json::to_vec(message).map_err(|e| BackendError::Protocol(e.to_string()))?;
        line.push(b'\n');
        self.writer.write_all(&line).await.map_err(|e| BackendError::io("write setup socket", e))
    }
}

pub(crate) fn unexpected(expected: &str, said: InitSays) -> BackendError {
    BackendError::Protocol(format!("expected {expected} during setup, init said {said:?}"))
}

//! Starting `warren-init` for a new sandbox (forked by the node's init
//! zygote) and walking it through the setup sequence of
//! [`warren_init::proto::setup`].

use std::fs;
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream as StdUnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use rustix::process::{WaitId, WaitIdOptions};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Interest, Lines};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;
use warren_guard::cgroup::SpawnTarget;
use warren_init::proto::setup::{HostSays, InitSays};
use warren_init::proto::zygote;

use super::state::{Layout, IDS_PER_SANDBOX};
use crate::{BackendError, Result};

/// Binds the control listener at `layout.ctl_sock()`, owner-only.
pub(crate) fn bind_control(layout: &Layout) -> Result<OwnedFd> {
    let path = layout.ctl_sock();
    let listener =
        crate::unix_sock::bind_std(&path).map_err(|e| BackendError::io(format!("bind {}", path.display()), e))?;
    fs::set_permissions(&path, fs::Permissions::from_mode(0o600))
        .map_err(|e| BackendError::io(format!("chmod {}", path.display()), e))?;
    Ok(OwnedFd::from(listener))
}

/// The first init process until it is reaped. Named by a pidfd, so neither
/// a kill nor a wait can reach a recycled pid.
pub(crate) struct FirstInit {
    pid: i32,
    /// `None` once reaped.
    pidfd: Option<OwnedFd>,
}

impl FirstInit {
    pub(crate) fn pid(&self) -> i32 {
        self.pid
    }

    /// SIGKILL, unless it was reaped already.
    pub(crate) fn kill(&self) {
        if let Some(pidfd) = &self.pidfd {
            // ESRCH (it exited) is fine: the wait collects it.
            let _ = rustix::process::pidfd_send_signal(pidfd, rustix::process::Signal::KILL);
        }
    }

    /// Waits until it has exited and left its cgroups: reaps it if it is
    /// this process's child (a first init the zygote forked becomes one
    /// when the zygote dies first), else waits for the kernel to reap it
    /// for the zygote.
    pub(crate) async fn wait(&mut self) -> io::Result<()> {
        let Some(pidfd) = self.pidfd.as_ref() else { return Ok(()) };
        // A pidfd becomes readable when its process exits.
        // SAFETY: the borrow keeps `pidfd` open, and naming the same file,
        // for as long as `exited` lives.
        let exited = unsafe { AsyncFd::register_with_interest(pidfd.as_fd(), Interest::READABLE) }?;
        loop {
            match rustix::process::waitid(WaitId::PidFd(pidfd.as_fd()), WaitIdOptions::EXITED | WaitIdOptions::NOHANG) {
                Ok(Some(_)) => break,
                Ok(None) => exited.readable().await?.clear_ready(),
                Err(rustix::io::Errno::CHILD) => {
                    // The pidfd turns readable at the exit, a moment before
                    // the kernel releases the process and its place in the
                    // cgroups; readiness is left set, as it stays so.
                    let _exited = exited.readable().await?;
                    if released(pidfd)? {
                        break;
                    }
                    tokio::time::sleep(RELEASE_POLL).await;
                }
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
        drop(exited);
        self.pidfd = None;
        Ok(())
    }
}

/// How often [`FirstInit::wait`] looks whether the kernel has released a
/// process that exited: it takes microseconds.
const RELEASE_POLL: Duration = Duration::from_micros(100);

/// True once the process of `pidfd` is gone, not even a zombie: signal 0
/// reaches a process until it is released.
fn released(pidfd: &OwnedFd) -> io::Result<bool> {
    // SAFETY: pidfd_send_signal with signal 0 and no siginfo only checks
    // that the process can be signalled; `pidfd` is open.
    let rc = unsafe {
        libc::syscall(libc::SYS_pidfd_send_signal, pidfd.as_raw_fd(), 0, std::ptr::null::<libc::siginfo_t>(), 0)
    };
    match rc {
        0 => Ok(false),
        _ => match io::Error::last_os_error() {
            e if e.raw_os_error() == Some(libc::ESRCH) => Ok(true),
            e => Err(e),
        },
    }
}

impl Drop for FirstInit {
    /// An abandoned create: kill it and reap it off the caller's thread.
    fn drop(&mut self) {
        if let Some(pidfd) = self.pidfd.take() {
            let _ = rustix::process::pidfd_send_signal(&pidfd, rustix::process::Signal::KILL);
            std::thread::spawn(move || reap(&pidfd, WaitIdOptions::empty()));
        }
    }
}

/// True once the process of `pidfd` has been reaped (or is not ours to reap).
fn reap(pidfd: &OwnedFd, options: WaitIdOptions) -> io::Result<bool> {
    loop {
        match rustix::process::waitid(WaitId::PidFd(pidfd.as_fd()), WaitIdOptions::EXITED | options) {
            Ok(Some(_)) | Err(rustix::io::Errno::CHILD) => return Ok(true),
            Ok(None) => return Ok(false),
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
}

/// How many first inits one zygote forks before the node replaces it:
/// every child starts with its zygote's address-space layout and stack
/// canary, so this bounds how many sandboxes share them. Starting a
/// zygote costs about what one exec'd first init did.
const SPAWNS_PER_ZYGOTE: u32 = 128;

/// How long the node waits for the zygote's answer before it ends it: a
/// fork of a small process takes well under a millisecond.
const ZYGOTE_ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

/// The node's init zygote (see `warren_init::proto::zygote`): started on
/// first use, replaced after [`SPAWNS_PER_ZYGOTE`] spawns or when found
/// gone. One spawn at a time: the zygote is single-threaded.
pub(crate) struct InitZygote {
    init_binary: PathBuf,
    running: Mutex<Option<Zygote>>,
}

impl InitZygote {
    pub(crate) fn new(init_binary: PathBuf) -> InitZygote {
        InitZygote { init_binary, running: Mutex::new(None) }
    }

    #[cfg(test)]
    fn pid(&self) -> Option<u32> {
        self.running.lock().ok()?.as_ref().map(|z| z.child.id())
    }

    /// Starts a sandbox's first init with the setup socket at fd 3 and
    /// `listener` at fd 4, `/dev/null` as stdio, no environment, already
    /// inside the sandbox's cgroups (`cgroups`): it is born in the cgroup2
    /// directory and moves itself into the v1 ones before it runs, so no
    /// `cgroup.procs` write (and its RCU grace period) is ever needed. Its
    /// parent is the zygote, which the kernel lets reap it; the PID 1 it
    /// forks reparents to this process (the child subreaper). No
    /// parent-death signal: sandboxes outlive a restart of the server.
    pub(crate) fn spawn_init(
        &self,
        listener: OwnedFd,
        cgroups: &SpawnTarget,
        open_files: u32,
    ) -> Result<(FirstInit, SetupChannel)> {
        let request = zygote::Request {
            v1_tasks: cgroups.v1_tasks.len() as u32,
            open_files: open_files_limit(open_files)?.map(|l| (l.rlim_cur, l.rlim_max)),
        };
        let mut running = self.running.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut retried = false;
        loop {
            let (host_end, init_end) = StdUnixStream::pair().map_err(|e| BackendError::io("socketpair", e))?;
            let mut fds = vec![init_end.as_fd(), listener.as_fd(), cgroups.unified_dir.as_fd()];
            fds.extend(cgroups.v1_tasks.iter().map(AsFd::as_fd));
            let mut zygote = match running.take().filter(Zygote::serves) {
                Some(zygote) => zygote,
                None => Zygote::start(&self.init_binary)?,
            };
            let spawned = zygote.spawn(&request, &fds);
            drop(fds);
            let lost = match spawned {
                Err(ZygoteError::Lost(lost)) => lost,
                answered => {
                    // One that answered, a refusal included, is trusted
                    // with the next request, up to its spawns.
                    if zygote.spawns < SPAWNS_PER_ZYGOTE {
                        *running = Some(zygote);
                    }
                    let first =
                        answered.map_err(|e| BackendError::io("fork a first init in the zygote", e.into_io()))?;
                    // The child has its copies; ours must close so EOF
                    // means init is gone.
                    drop((init_end, listener));
                    host_end.set_nonblocking(true).map_err(|e| BackendError::io("setup socket", e))?;
                    let stream = UnixStream::from_std(host_end).map_err(|e| BackendError::io("setup socket", e))?;
                    return Ok((first, SetupChannel::new(stream)));
                }
            };
            // A zygote that did not answer is ended (dropping it kills and
            // reaps it). Whether it forked before it died decides whether
            // the request may be sent again: a child would hold the setup
            // socket's other end, and so would a request it never read,
            // until its socket went with it.
            drop(zygote);
            drop(init_end);
            if retried || !peer_closed(&host_end) {
                return Err(BackendError::io("fork a first init in the zygote", lost));
            }
            tracing::warn!("the init zygote died before it took a request ({lost}); starting another");
            retried = true;
        }
    }
}

/// True when every copy of `socket`'s other end is closed: nobody, no
/// child and no unread message, holds it.
fn peer_closed(socket: &StdUnixStream) -> bool {
    use rustix::event::{poll, PollFd, PollFlags};
    let mut fds = [PollFd::new(socket, PollFlags::IN)];
    let zero = rustix::time::Timespec { tv_sec: 0, tv_nsec: 0 };
    matches!(poll(&mut fds, Some(&zero)), Ok(1) if fds[0].revents().contains(PollFlags::HUP))
}

/// A running zygote, ended (killed and reaped) when dropped.
struct Zygote {
    child: Child,
    /// This end of its `SOCK_SEQPACKET` socket (close-on-exec).
    socket: OwnedFd,
    spawns: u32,
}

enum ZygoteError {
    /// No answer: the zygote is gone, stuck or spoke nonsense.
    Lost(io::Error),
    /// It answered that it could not fork (e.g. `EAGAIN`).
    Refused(io::Error),
}

impl ZygoteError {
    fn into_io(self) -> io::Error {
        match self {
            ZygoteError::Lost(e) | ZygoteError::Refused(e) => e,
        }
    }
}

impl Zygote {
    fn start(init_binary: &Path) -> Result<Zygote> {
        let (ours, theirs) = rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::SEQPACKET,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .map_err(|e| BackendError::io("socketpair for the init zygote", e.into()))?;
        rustix::net::sockopt::set_socket_timeout(
            &ours,
            rustix::net::sockopt::Timeout::Recv,
            Some(ZYGOTE_ANSWER_TIMEOUT),
        )
        .map_err(|e| BackendError::io("SO_RCVTIMEO on the zygote socket", e.into()))?;
        let theirs_raw = theirs.as_raw_fd();
        let mut command = Command::new(init_binary);
        // argv[0] without the host path: every sandbox's PID 1 is a copy of
        // this process, and its command line is readable inside.
        command
            .arg0("warren-init")
            .arg(zygote::ARG)
            .env_clear()
            .current_dir("/")
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        // SAFETY: the closure runs in the child between fork and exec and
        // only makes async-signal-safe calls (dup2, fcntl) on a descriptor
        // the parent keeps open until `spawn` returns.
        unsafe {
            command.pre_exec(move || {
                let placed = if theirs_raw == zygote::SOCKET_FD {
                    // Already in place: only close-on-exec must go.
                    libc::fcntl(theirs_raw, libc::F_SETFD, 0)
                } else {
                    libc::dup2(theirs_raw, zygote::SOCKET_FD)
                };
                if placed < 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command
            .spawn()
            .map_err(|e| BackendError::io(format!("start the init zygote {}", init_binary.display()), e))?;
        Ok(Zygote { child, socket: ours, spawns: 0 })
    }

    /// False once it has exited (it ends on its own only on an error).
    fn serves(zygote: &Zygote) -> bool {
        // A peek, not a reap (dropping it reaps it): its pid stays ours.
        let pid = rustix::process::Pid::from_raw(zygote.child.id() as i32);
        let options = WaitIdOptions::EXITED | WaitIdOptions::NOHANG | WaitIdOptions::NOWAIT;
        matches!(pid.map(|pid| rustix::process::waitid(WaitId::Pid(pid), options)), Some(Ok(None)))
    }

    fn spawn(
        &mut self,
        request: &zygote::Request,
        fds: &[BorrowedFd<'_>],
    ) -> std::result::Result<FirstInit, ZygoteError> {
        use rustix::net::RecvAncillaryBuffer;
        self.spawns += 1;
        if fds.len() > zygote::MAX_REQUEST_FDS {
            return Err(ZygoteError::Refused(io::Error::other(format!(
                "{} descriptors do not fit a request",
                fds.len()
            ))));
        }
        warren_init::proto::send_with_fds(self.socket.as_fd(), &request.encode(), fds).map_err(ZygoteError::Lost)?;
        let mut answer = [0u8; zygote::REPLY_BYTES + 1];
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let (got, mut pidfds) = warren_init::proto::recv_with_fds(self.socket.as_fd(), &mut answer, &mut control)
            .map_err(ZygoteError::Lost)?;
        match (zygote::Reply::decode(&answer[..got.bytes]), pidfds.pop()) {
            (Some(zygote::Reply::Spawned { pid }), Some(pidfd)) if pidfds.is_empty() => {
                Ok(FirstInit { pid, pidfd: Some(pidfd) })
            }
            (Some(zygote::Reply::Failed { errno }), None) => {
                Err(ZygoteError::Refused(io::Error::from_raw_os_error(errno)))
            }
            _ if got.bytes == 0 => Err(ZygoteError::Lost(io::Error::other("the zygote exited"))),
            (reply, _) => {
                Err(ZygoteError::Lost(io::Error::other(format!("unexpected answer from the zygote: {reply:?}"))))
            }
        }
    }
}

impl Drop for Zygote {
    /// It holds no request between two spawns, so a kill loses nothing;
    /// the sandboxes it started are not its children any more, or are
    /// first inits that reparent here.
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The limit for `open_files` (0: the server's own), no higher than the
/// server's hard limit: lowering needs no privilege, raising would need
/// CAP_SYS_RESOURCE, which a server in a container may lack.
fn open_files_limit(open_files: u32) -> Result<Option<libc::rlimit>> {
    if open_files == 0 {
        return Ok(None);
    }
    let mut current = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one `struct rlimit` to a valid pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut current) } != 0 {
        return Err(BackendError::io("getrlimit(RLIMIT_NOFILE)", io::Error::last_os_error()));
    }
    let n = libc::rlim_t::from(open_files).min(current.rlim_max);
    Ok(Some(libc::rlimit { rlim_cur: n, rlim_max: n }))
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
            InitSays::PhaseRejected { message } => Err(BackendError::PhaseRejected(message)),
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

    /// Sends `fd` on one byte of its own (`SCM_RIGHTS`), after whatever
    /// was written before.
    pub(crate) async fn send_fd(&mut self, fd: BorrowedFd<'_>) -> Result<()> {
        let stream: &UnixStream = self.writer.as_ref();
        loop {
            stream.writable().await.map_err(|e| BackendError::io("write setup socket", e))?;
            let sent =
                stream.try_io(Interest::WRITABLE, || warren_init::proto::send_with_fds(stream.as_fd(), &[0], &[fd]));
            match sent {
                Ok(_) => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(BackendError::io("send the root filesystem on the setup socket", e)),
            }
        }
    }
}

pub(crate) fn unexpected(expected: &str, said: InitSays) -> BackendError {
    BackendError::Protocol(format!("expected {expected} during setup, init said {said:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use warren_guard::cgroup::{Limits, SandboxCgroup, UNIFIED, V1_CONTROLLERS};

    /// `target/<profile>/warren-init`, beside the `deps/` directory of this test binary.
    fn init_binary() -> std::path::PathBuf {
        let exe = std::env::current_exe().unwrap();
        let init = exe.parent().and_then(Path::parent).unwrap().join("warren-init");
        assert!(init.is_file(), "{} is missing: run `cargo build -p warren-init` first", init.display());
        init
    }

    fn signal(pid: u32, signal: rustix::process::Signal) {
        rustix::process::kill_process(rustix::process::Pid::from_raw(pid as i32).unwrap(), signal).unwrap();
    }

    /// A sandbox cgroup `sb` in a fresh instance, removed (with whatever
    /// still runs in it) when the guard goes.
    fn test_cgroup(instance: &str) -> (SandboxCgroup, Cleanup) {
        let instance = format!("{instance}-{}", std::process::id());
        let cgroup = SandboxCgroup::new(&instance, "sb").unwrap();
        let cleanup = Cleanup(cgroup.clone(), instance);
        cgroup.create(&Limits { memory_bytes: 64 << 20, cpus: 1.0, pids: 16 }).unwrap();
        (cgroup, cleanup)
    }

    struct Cleanup(SandboxCgroup, String);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            let _ = self.0.kill_all(std::time::Duration::from_secs(5));
            let _ = self.0.remove();
            let _ = SandboxCgroup::remove_instance(&self.1);
        }
    }

    #[tokio::test]
    async fn init_is_born_inside_every_cgroup_hierarchy_with_only_its_descriptors_and_a_kill_ends_it() {
        let (cgroup, _cleanup) = test_cgroup("wt-spawn");
        let dir = tempfile::tempdir().unwrap();
        let layout = Layout::new(dir.path(), "sb");
        fs::create_dir(layout.dir()).unwrap();

        let listener = bind_control(&layout).unwrap();
        let target = cgroup.spawn_target().unwrap();
        let zygote = InitZygote::new(init_binary());
        let (mut first, mut setup) = zygote.spawn_init(listener, &target, 77).unwrap();
        assert!(matches!(setup.next().await.unwrap(), InitSays::UsernsReady));
        let limits = fs::read_to_string(format!("/proc/{}/limits", first.pid())).unwrap();
        let nofile = limits.lines().find(|l| l.starts_with("Max open files")).unwrap();
        assert_eq!(nofile.split_whitespace().collect::<Vec<_>>()[3..5], ["77", "77"], "{nofile}");
        for hierarchy in V1_CONTROLLERS.into_iter().chain([UNIFIED]) {
            assert_eq!(cgroup.pids(hierarchy).unwrap(), vec![first.pid()], "{hierarchy}");
        }
        // Only what the protocol names is open in it: stdio, the setup
        // socket and the listener, and the handle on its own binary it
        // opened itself (none of the zygote's or the host's).
        for entry in fs::read_dir(format!("/proc/{}/fd", first.pid())).unwrap() {
            let entry = entry.unwrap();
            let fd: i32 = entry.file_name().to_str().unwrap().parse().unwrap();
            let target = fs::read_link(entry.path()).unwrap();
            match fd {
                0..=2 => assert_eq!(target, Path::new("/dev/null")),
                3 | 4 => assert!(target.to_string_lossy().starts_with("socket:"), "{fd}: {target:?}"),
                _ => assert_eq!(target, init_binary(), "fd {fd}"),
            }
        }
        let cmdline = fs::read(format!("/proc/{}/cmdline", first.pid())).unwrap();
        assert_eq!(cmdline, b"warren-init\0--zygote\0", "no host path in what the sandbox can read");
        let status = fs::read_to_string(format!("/proc/{}/status", first.pid())).unwrap();
        let ignored = status.lines().find(|l| l.starts_with("SigIgn:")).unwrap();
        let sigchld_bit = 1u64 << (libc::SIGCHLD - 1);
        let ignored = u64::from_str_radix(ignored.split_whitespace().nth(1).unwrap(), 16).unwrap();
        assert_eq!(ignored & sigchld_bit, 0, "the zygote's ignored SIGCHLD must not reach init");
        first.kill();
        first.wait().await.unwrap();
        assert!(cgroup.pids("memory").unwrap().is_empty());
        drop(zygote);
        // A binary that cannot be started is reported when the zygote starts.
        let other = Layout::new(dir.path(), "other");
        fs::create_dir(other.dir()).unwrap();
        let listener = bind_control(&other).unwrap();
        let missing = InitZygote::new("/nonexistent/warren-init".into());
        let error = missing.spawn_init(listener, &target, 0).err().unwrap();
        assert!(error.to_string().contains("start the init zygote /nonexistent/warren-init"), "{error}");
    }

    #[tokio::test]
    async fn a_first_init_starts_in_the_template_namespace_with_none_of_the_hosts_other_mounts() {
        let (cgroup, _cleanup) = test_cgroup("wt-template");
        let dir = tempfile::tempdir().unwrap();
        // A mount of the host's made before the zygote starts, like a
        // running sandbox's: the template must not have it.
        let host_mount = dir.path().join("host-mount");
        fs::create_dir(&host_mount).unwrap();
        rustix::mount::mount("tmpfs", &host_mount, "tmpfs", rustix::mount::MountFlags::empty(), c"size=4k").unwrap();
        let _unmount = crate::container::run_dir::tests::Unmount(host_mount.clone());
        let layout = Layout::new(dir.path(), "sb");
        fs::create_dir(layout.dir()).unwrap();
        let target = cgroup.spawn_target().unwrap();
        let zygote = InitZygote::new(init_binary());
        let (mut first, mut setup) = zygote.spawn_init(bind_control(&layout).unwrap(), &target, 0).unwrap();
        assert!(matches!(setup.next().await.unwrap(), InitSays::UsernsReady));

        let mountinfo = fs::read_to_string(format!("/proc/{}/mountinfo", first.pid())).unwrap();
        let mounts: Vec<(&str, &str)> = mountinfo
            .lines()
            .map(|line| {
                let fields: Vec<&str> = line.split(' ').collect();
                let fs_type = line.split(" - ").nth(1).and_then(|rest| rest.split(' ').next()).unwrap();
                (fields[4], fs_type)
            })
            .collect();
        let root: Vec<_> = mountinfo.lines().filter(|line| line.split(' ').nth(4) == Some("/")).collect();
        assert_eq!(root.len(), 1, "{mountinfo}");
        assert!(root[0].contains(" ro,") && root[0].contains(" - tmpfs "), "a read-only tmpfs as /: {}", root[0]);
        // The host's kernel filesystems alone, none of their submounts.
        // (A host's /dev is devtmpfs or, in a container, a tmpfs.)
        let mut points: Vec<(&str, &str)> =
            mounts.iter().map(|&(point, fs_type)| (point, if point == "/dev" { "-" } else { fs_type })).collect();
        points.sort();
        assert_eq!(points, [("/", "tmpfs"), ("/dev", "-"), ("/proc", "proc"), ("/sys", "sysfs")], "{mountinfo}");
        assert!(!mountinfo.contains(host_mount.to_str().unwrap()));
        // The sandbox's mount point, empty.
        let sandbox_root = format!("/proc/{}/root/sandbox", first.pid());
        assert_eq!(fs::read_dir(&sandbox_root).unwrap().count(), 0);
        first.kill();
        first.wait().await.unwrap();
    }

    #[tokio::test]
    async fn a_fork_the_zygote_refuses_fails_only_that_spawn_and_the_same_zygote_serves_the_next() {
        let (cgroup, _cleanup) = test_cgroup("wt-refuse");
        let dir = tempfile::tempdir().unwrap();
        let zygote = InitZygote::new(init_binary());
        // Not a cgroup2 directory: clone3's CLONE_INTO_CGROUP refuses it
        // (EBADF), so the zygote answers that it could not fork.
        let not_a_cgroup =
            SpawnTarget { v1_tasks: Vec::new(), unified_dir: OwnedFd::from(fs::File::open(dir.path()).unwrap()) };
        let refused = Layout::new(dir.path(), "refused");
        fs::create_dir(refused.dir()).unwrap();
        let error = zygote.spawn_init(bind_control(&refused).unwrap(), &not_a_cgroup, 0).err().unwrap();
        assert!(error.to_string().contains("fork a first init in the zygote"), "{error}");
        let answered = zygote.pid().expect("a zygote that answered is kept");

        let served = Layout::new(dir.path(), "served");
        fs::create_dir(served.dir()).unwrap();
        let target = cgroup.spawn_target().unwrap();
        let (mut first, mut setup) = zygote.spawn_init(bind_control(&served).unwrap(), &target, 0).unwrap();
        assert!(matches!(setup.next().await.unwrap(), InitSays::UsernsReady));
        assert_eq!(zygote.pid(), Some(answered), "the zygote that refused was not trusted with the next spawn");
        first.kill();
        first.wait().await.unwrap();
        assert!(cgroup.pids("memory").unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_dead_zygote_is_replaced_and_a_request_it_never_read_is_sent_again() {
        let (cgroup, _cleanup) = test_cgroup("wt-zygote");
        let dir = tempfile::tempdir().unwrap();
        let target = cgroup.spawn_target().unwrap();
        let zygote = InitZygote::new(init_binary());
        let first = Layout::new(dir.path(), "first");
        fs::create_dir(first.dir()).unwrap();
        let (mut first, mut setup) = zygote.spawn_init(bind_control(&first).unwrap(), &target, 0).unwrap();
        assert!(matches!(setup.next().await.unwrap(), InitSays::UsernsReady));
        first.kill();
        first.wait().await.unwrap();
        // A zygote that died between two spawns is replaced.
        let dead = zygote.pid().unwrap();
        signal(dead, rustix::process::Signal::KILL);
        // Dead means a zombie: until then it may still take the request.
        let stat = format!("/proc/{dead}/stat");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !fs::read_to_string(&stat).unwrap().rsplit(')').next().unwrap().trim_start().starts_with('Z') {
            assert!(std::time::Instant::now() < deadline, "the killed zygote never died");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let again = Layout::new(dir.path(), "again");
        fs::create_dir(again.dir()).unwrap();
        let (mut second, mut setup) = zygote.spawn_init(bind_control(&again).unwrap(), &target, 0).unwrap();
        assert!(matches!(setup.next().await.unwrap(), InitSays::UsernsReady));
        assert_ne!(zygote.pid(), Some(dead));
        second.kill();
        second.wait().await.unwrap();
        // One that dies with a request unread (stopped, then killed while
        // the node waits for its answer) is replaced and the request sent
        // again: nothing had been forked for it. Whether the kill lands
        // before or after the send, the spawn must succeed.
        let stopped = zygote.pid().unwrap();
        signal(stopped, rustix::process::Signal::STOP);
        let killer = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(200));
            signal(stopped, rustix::process::Signal::KILL);
        });
        let unread = Layout::new(dir.path(), "unread");
        fs::create_dir(unread.dir()).unwrap();
        let (mut third, mut setup) = zygote.spawn_init(bind_control(&unread).unwrap(), &target, 0).unwrap();
        killer.join().unwrap();
        assert!(matches!(setup.next().await.unwrap(), InitSays::UsernsReady));
        assert_ne!(zygote.pid(), Some(stopped));
        third.kill();
        third.wait().await.unwrap();
        assert!(cgroup.pids("memory").unwrap().is_empty());
    }
}

//! Starting `warren-init` for a new sandbox and walking it through the setup
//! sequence of [`warren_init::proto::setup`].

use std::ffi::{c_char, CString};
use std::fs;
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream as StdUnixStream};
use std::path::Path;

use rustix::process::{WaitId, WaitIdOptions};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Interest, Lines};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;
use warren_guard::cgroup::SpawnTarget;
use warren_init::proto::setup::{HostSays, InitSays};
use warren_init::proto::{LISTEN_FD, SETUP_FD};

use super::state::{Layout, IDS_PER_SANDBOX};
use crate::{BackendError, Result};

/// Fds at or above this are free in the child while it moves the inherited
/// ones into place.
const SCRATCH_FD: i32 = 10;

/// `clone3` flags (linux/sched.h); the libc crate lacks some of them.
const CLONE_VM: u64 = 0x100;
const CLONE_PIDFD: u64 = 0x1000;
const CLONE_VFORK: u64 = 0x4000;
const CLONE_CLEAR_SIGHAND: u64 = 0x1_0000_0000;
const CLONE_INTO_CGROUP: u64 = 0x2_0000_0000;

/// `struct clone_args` of `clone3(2)` (version 2, with `cgroup`).
#[repr(C)]
#[derive(Default)]
struct CloneArgs {
    flags: u64,
    pidfd: u64,
    child_tid: u64,
    parent_tid: u64,
    exit_signal: u64,
    stack: u64,
    stack_size: u64,
    tls: u64,
    set_tid: u64,
    set_tid_size: u64,
    cgroup: u64,
}

/// The steps the child reports a failure of, before it could exec.
#[derive(Debug, Clone, Copy)]
#[repr(u32)]
enum ChildStep {
    JoinCgroup = 1,
    PlaceFds = 2,
    Exec = 3,
    LimitOpenFiles = 4,
}

impl ChildStep {
    fn describe(code: u32) -> &'static str {
        match code {
            1 => "join the sandbox's v1 cgroups",
            2 => "move the inherited descriptors into place",
            3 => "exec",
            4 => "set RLIMIT_NOFILE",
            _ => "an unknown step",
        }
    }
}

/// Binds the control listener at `layout.ctl_sock()`, owner-only.
pub(crate) fn bind_control(layout: &Layout) -> Result<OwnedFd> {
    let path = layout.ctl_sock();
    let listener = UnixListener::bind(&path).map_err(|e| BackendError::io(format!("bind {}", path.display()), e))?;
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

    /// Waits for it to exit and reaps it.
    pub(crate) async fn wait(&mut self) -> io::Result<()> {
        let Some(pidfd) = self.pidfd.as_ref() else { return Ok(()) };
        // A pidfd becomes readable when its process exits.
        // SAFETY: the borrow keeps `pidfd` open, and naming the same file,
        // for as long as `exited` lives.
        let exited = unsafe { AsyncFd::register_with_interest(pidfd.as_fd(), Interest::READABLE) }?;
        loop {
            if reap(pidfd, WaitIdOptions::NOHANG)? {
                break;
            }
            exited.readable().await?.clear_ready();
        }
        drop(exited);
        self.pidfd = None;
        Ok(())
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

/// Spawns init with the setup socket at fd 3 and `listener` at fd 4, no
/// environment, `/dev/null` as stdio, already inside the sandbox's cgroups
/// (`cgroups`): it is born in the cgroup2 directory and moves itself into
/// the v1 ones before it execs, so no `cgroup.procs` write (and its RCU
/// grace period) is ever needed. No parent-death signal: sandboxes outlive a
/// restart of the server.
pub(crate) fn spawn_init(
    init_binary: &Path,
    listener: OwnedFd,
    cgroups: &SpawnTarget,
    open_files: u32,
) -> Result<(FirstInit, SetupChannel)> {
    let (host_end, init_end) = StdUnixStream::pair().map_err(|e| BackendError::io("socketpair", e))?;
    let program = CString::new(init_binary.as_os_str().as_bytes())
        .map_err(|_| BackendError::Setup(format!("init binary path {} holds a NUL", init_binary.display())))?;
    let null = rustix::fs::open("/dev/null", rustix::fs::OFlags::RDWR | rustix::fs::OFlags::CLOEXEC, 0.into())
        .map_err(|e| BackendError::io("open /dev/null", e.into()))?;
    let fds = ChildFds {
        null: null.as_raw_fd(),
        setup: init_end.as_raw_fd(),
        listen: listener.as_raw_fd(),
        v1_tasks: cgroups.v1_tasks.iter().map(AsRawFd::as_raw_fd).collect(),
        unified_dir: cgroups.unified_dir.as_raw_fd(),
        open_files: open_files_limit(open_files)?,
    };
    let first =
        clone_init(&program, &fds).map_err(|e| BackendError::io(format!("spawn {}", init_binary.display()), e))?;
    // The child has its copies; ours must close so EOF means init is gone.
    drop((init_end, listener, null));
    host_end.set_nonblocking(true).map_err(|e| BackendError::io("setup socket", e))?;
    let stream = UnixStream::from_std(host_end).map_err(|e| BackendError::io("setup socket", e))?;
    Ok((first, SetupChannel::new(stream)))
}

/// The descriptors the child works with, as plain numbers: between clone
/// and exec it may not allocate or drop anything.
struct ChildFds {
    null: RawFd,
    setup: RawFd,
    listen: RawFd,
    v1_tasks: Vec<RawFd>,
    unified_dir: RawFd,
    /// `RLIMIT_NOFILE` for init and everything it starts; `None` keeps the
    /// server's own.
    open_files: Option<libc::rlimit>,
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

/// The stack the child runs on between `clone3` and `execve`: it shares
/// this process's memory (`CLONE_VM`), so it cannot use the caller's. The
/// caller is suspended until the child has exec'd or exited
/// (`CLONE_VFORK`), so one per spawn is enough and it is free again when
/// `clone3` returns.
const CHILD_STACK_BYTES: usize = 64 * 1024;

/// `clone3` into the cgroup2 directory, with a pidfd; the child runs
/// [`child_main`]. Returns once the child has exec'd (or failed to: its
/// report arrives on a close-on-exec pipe, as with `std::process`).
///
/// `CLONE_VM | CLONE_VFORK`, as `posix_spawn` does, not a fork: a fork of
/// the server copies the page tables of its whole heap and every thread's
/// stack, which the exec throws away at once, and leaves the server to
/// take a copy-on-write fault for each of those pages it writes next.
fn clone_init(program: &CString, fds: &ChildFds) -> io::Result<FirstInit> {
    let argv: [*const c_char; 2] = [c"warren-init".as_ptr(), std::ptr::null()];
    let envp: [*const c_char; 1] = [std::ptr::null()];
    let (report_rx, report_tx) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
    let mut stack: Vec<MaybeUninit<u8>> = Vec::with_capacity(CHILD_STACK_BYTES);
    // The stack grows down from its top, which must be 16-byte aligned.
    let base = stack.as_mut_ptr() as u64;
    let top = (base + CHILD_STACK_BYTES as u64) & !15;
    let mut pidfd: RawFd = -1;
    let mut args = CloneArgs {
        flags: CLONE_VM | CLONE_VFORK | CLONE_PIDFD | CLONE_CLEAR_SIGHAND | CLONE_INTO_CGROUP,
        pidfd: &mut pidfd as *mut RawFd as u64,
        exit_signal: libc::SIGCHLD as u64,
        stack: base,
        stack_size: top - base,
        cgroup: fds.unified_dir as u64,
        ..CloneArgs::default()
    };
    let child = ChildArgs { program, argv: &argv, envp: &envp, fds, report: report_tx.as_raw_fd() };
    // SAFETY: the child shares this address space, runs on `stack` (which
    // outlives the call) and this thread is suspended until it has exec'd
    // or exited. It only runs `child_entry`, which reads `child` (alive
    // until the call returns) and makes async-signal-safe system calls on
    // it; its signal handlers are reset (CLONE_CLEAR_SIGHAND), so none of
    // ours runs on the shared memory. `args` and `pidfd` outlive the call.
    let rc = unsafe { clone3_with_entry(&mut args, child_entry, &child) };
    drop(stack);
    if rc < 0 {
        return Err(io::Error::from_raw_os_error(-rc as i32));
    }
    // SAFETY: with CLONE_PIDFD the kernel stored a new descriptor (close-on-
    // exec) that nothing else owns.
    let first = FirstInit { pid: rc as i32, pidfd: Some(unsafe { OwnedFd::from_raw_fd(pidfd) }) };
    drop(report_tx);
    let mut report = [0u8; 8];
    match read_report(&report_rx, &mut report)? {
        0 => Ok(first),
        8 => {
            let step = u32::from_ne_bytes([report[0], report[1], report[2], report[3]]);
            let errno = i32::from_ne_bytes([report[4], report[5], report[6], report[7]]);
            let error = io::Error::from_raw_os_error(errno);
            // Dropping `first` reaps the child, which has _exit'ed.
            Err(io::Error::new(error.kind(), format!("{}: {error}", ChildStep::describe(step))))
        }
        n => Err(io::Error::other(format!("short report ({n} bytes) from the child"))),
    }
}

/// Reads until EOF or `buf` is full; the child writes its report in one go.
fn read_report(pipe: &OwnedFd, buf: &mut [u8]) -> io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match rustix::io::read(pipe, &mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(got)
}

/// What the child reads from the caller's memory.
struct ChildArgs<'a> {
    program: &'a CString,
    argv: &'a [*const c_char; 2],
    envp: &'a [*const c_char; 1],
    fds: &'a ChildFds,
    /// Where it reports a failed step (close-on-exec).
    report: RawFd,
}

/// The child's first frame, on its own stack.
extern "C" fn child_entry(args: *const ChildArgs<'_>) -> ! {
    // SAFETY: `clone_init` passes a pointer to its live `ChildArgs` and
    // stays suspended (CLONE_VFORK) until this child has exec'd or exited;
    // this is the child, as child_main requires.
    unsafe {
        let args = &*args;
        child_main(args.program, args.argv, args.envp, args.fds, args.report)
    }
}

/// `clone3(args)` whose child calls `entry(child)` on the stack `args`
/// names and never returns; the parent gets the child's pid or `-errno`.
/// `libc::syscall` cannot start such a child: it would return into the
/// caller's frames on a stack that is not theirs.
///
/// # Safety
/// `args` must name a stack the child may use, and `entry` must never
/// return; everything `child` points to must stay valid until the child
/// has exec'd or exited.
#[cfg(target_arch = "x86_64")]
unsafe fn clone3_with_entry(
    args: &mut CloneArgs,
    entry: extern "C" fn(*const ChildArgs<'_>) -> !,
    child: *const ChildArgs<'_>,
) -> i64 {
    let rc: i64;
    // SAFETY: the caller's contract. r12 and r13 survive the system call
    // in both processes; the child starts with rsp at the top of its stack
    // (16-byte aligned, so the `call` leaves the ABI's alignment), clears
    // the frame pointer so nothing unwinds into the parent's frames, and
    // never comes back from `entry`.
    unsafe {
        std::arch::asm!(
            "syscall",
            "test rax, rax",
            "jnz 2f",
            "xor ebp, ebp",
            "mov rdi, r12",
            "call r13",
            "ud2",
            "2:",
            inlateout("rax") libc::SYS_clone3 => rc,
            in("rdi") args as *mut CloneArgs,
            in("rsi") std::mem::size_of::<CloneArgs>(),
            in("r12") child,
            in("r13") entry,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    rc
}

/// Elsewhere, without the assembly: a fork-like child on a copy of this
/// stack (slower, the same otherwise).
///
/// # Safety
/// As for the x86_64 version.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn clone3_with_entry(
    args: &mut CloneArgs,
    entry: extern "C" fn(*const ChildArgs<'_>) -> !,
    child: *const ChildArgs<'_>,
) -> i64 {
    args.flags &= !(CLONE_VM | CLONE_VFORK);
    args.stack = 0;
    args.stack_size = 0;
    // SAFETY: without CLONE_VM the child gets a copy of this address space
    // and continues on (a copy of) this stack, like fork(2), straight into
    // `entry`, which never returns.
    let rc = unsafe { libc::syscall(libc::SYS_clone3, args as *mut CloneArgs, std::mem::size_of::<CloneArgs>()) };
    if rc == 0 {
        entry(child)
    }
    if rc < 0 {
        return -i64::from(io::Error::last_os_error().raw_os_error().unwrap_or(libc::EINVAL));
    }
    rc
}

/// The child between `clone3` and `execve`: joins the v1 cgroups, puts the
/// descriptors in place, clears the signal mask and execs init. On failure
/// it writes `(step, errno)` to `report` and exits 127.
///
/// # Safety
/// Only in the child of [`clone_init`]: it shares the memory of a
/// multi-threaded process, in which another thread may hold any lock, so
/// only raw system calls on the prepared data are allowed - no allocation,
/// no drop.
unsafe fn child_main(
    program: &CString,
    argv: &[*const c_char; 2],
    envp: &[*const c_char; 1],
    fds: &ChildFds,
    report: RawFd,
) -> ! {
    let fail = |step: ChildStep| -> ! {
        let errno = io::Error::last_os_error().raw_os_error().unwrap_or(0);
        let mut message = [0u8; 8];
        message[..4].copy_from_slice(&(step as u32).to_ne_bytes());
        message[4..].copy_from_slice(&errno.to_ne_bytes());
        // SAFETY: write(2) and _exit(2) are async-signal-safe; `message`
        // lives on this stack.
        unsafe {
            libc::write(report, message.as_ptr().cast(), message.len());
            libc::_exit(127)
        }
    };
    for &tasks in &fds.v1_tasks {
        // SAFETY: write(2) of a static byte to an inherited descriptor.
        // "0" names the calling thread, the child's only one.
        if unsafe { libc::write(tasks, c"0".as_ptr().cast(), 1) } != 1 {
            fail(ChildStep::JoinCgroup);
        }
    }
    if place_fds(fds).is_err() {
        fail(ChildStep::PlaceFds);
    }
    if let Some(limit) = &fds.open_files {
        // SAFETY: setrlimit(2) reads one prepared `struct rlimit`; it is a
        // plain system call, async-signal-safe.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, limit) } != 0 {
            fail(ChildStep::LimitOpenFiles);
        }
    }
    let empty: u64 = 0;
    // SAFETY: rt_sigprocmask with a valid 8-byte set and no old-set pointer;
    // the mask survives exec and init must start with nothing blocked.
    unsafe {
        libc::syscall(libc::SYS_rt_sigprocmask, libc::SIG_SETMASK, &empty as *const u64, std::ptr::null_mut::<u64>(), 8)
    };
    // SAFETY: `program`, `argv` and `envp` are NUL-terminated and live in
    // the parent's frame, which this child's copy of the stack still holds.
    unsafe { libc::execve(program.as_ptr(), argv.as_ptr(), envp.as_ptr()) };
    fail(ChildStep::Exec)
}

/// Puts `/dev/null` at 0, 1 and 2, the setup socket at [`SETUP_FD`] and the
/// listener at [`LISTEN_FD`]. Each is first copied above [`SCRATCH_FD`]
/// (close-on-exec) so that no `dup2` can overwrite another's source (a
/// server started with closed stdio has its sockets at 0-2); `dup2` then
/// leaves the final numbers inheritable.
fn place_fds(fds: &ChildFds) -> io::Result<()> {
    let null = scratch_copy(fds.null)?;
    let setup = scratch_copy(fds.setup)?;
    let listen = scratch_copy(fds.listen)?;
    for stdio in 0..3 {
        move_to(null, stdio)?;
    }
    move_to(setup, SETUP_FD)?;
    move_to(listen, LISTEN_FD)
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

    struct Cleanup(SandboxCgroup, String);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            let _ = self.0.kill_all(std::time::Duration::from_secs(5));
            let _ = self.0.remove();
            let _ = SandboxCgroup::remove_instance(&self.1);
        }
    }

    #[tokio::test]
    async fn init_is_born_inside_every_cgroup_hierarchy_and_a_drop_reaps_it() {
        let instance = format!("wt-spawn-{}", std::process::id());
        let cgroup = SandboxCgroup::new(&instance, "sb").unwrap();
        let _cleanup = Cleanup(cgroup.clone(), instance.clone());
        cgroup.create(&Limits { memory_bytes: 64 << 20, cpus: 1.0, pids: 16 }).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let layout = Layout::new(dir.path(), "sb");
        fs::create_dir(layout.dir()).unwrap();

        let listener = bind_control(&layout).unwrap();
        let target = cgroup.spawn_target().unwrap();
        let (mut first, mut setup) = spawn_init(&init_binary(), listener, &target, 77).unwrap();
        assert!(matches!(setup.next().await.unwrap(), InitSays::UsernsReady));
        let limits = fs::read_to_string(format!("/proc/{}/limits", first.pid())).unwrap();
        let nofile = limits.lines().find(|l| l.starts_with("Max open files")).unwrap();
        assert_eq!(nofile.split_whitespace().collect::<Vec<_>>()[3..5], ["77", "77"], "{nofile}");
        for hierarchy in V1_CONTROLLERS.into_iter().chain([UNIFIED]) {
            assert_eq!(cgroup.pids(hierarchy).unwrap(), vec![first.pid()], "{hierarchy}");
        }
        first.kill();
        first.wait().await.unwrap();
        assert!(cgroup.pids("memory").unwrap().is_empty());
        // A binary that cannot be exec'd is reported with the step that failed.
        let other = Layout::new(dir.path(), "other");
        fs::create_dir(other.dir()).unwrap();
        let listener = bind_control(&other).unwrap();
        let missing = spawn_init(Path::new("/nonexistent/warren-init"), listener, &target, 0).err().unwrap();
        assert!(missing.to_string().contains("exec: No such file"), "{missing}");
    }
}

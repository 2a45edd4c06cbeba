//! The test harness shared by the integration tests: it plays the host.
//! It hands init the setup socket and the listener, maps its user
//! namespace, and drives it over the control protocol. Run as root.
//!
//! The rootfs is a busybox-static tree in a temp dir, chowned to the
//! sandbox's base uid (without idmapped mounts, files owned by host root
//! would show up as `nobody` inside). No cgroups here: that is the driver's.

// Each test binary uses its own part of the harness.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Once;
use std::time::{Duration, Instant};

use warren_init::proto::setup::{BuildSpec, HostSays, InitSays};
use warren_init::proto::{self, ExecSpec, Exited, FrameKind, Request, Response, SecurityEvent};

/// A generous bound so that a broken init fails a test instead of hanging it.
pub const IO_TIMEOUT: Duration = Duration::from_secs(60);

static NEXT_SANDBOX: AtomicU32 = AtomicU32::new(0);

/// A running sandbox: its PID 1 (our child through the subreaper flag) and
/// its temp dir. Dropping it kills PID 1 (which ends the pid namespace),
/// reaps it and removes the dir; all its mounts die with its namespace.
pub struct Sandbox {
    pub pid1: i32,
    pub socket: PathBuf,
    pub base: u32,
    _dir: tempfile::TempDir,
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        // SAFETY: plain syscalls on a pid this test owns.
        unsafe {
            libc::kill(self.pid1, libc::SIGKILL);
            libc::waitpid(self.pid1, std::ptr::null_mut(), 0);
        }
    }
}

pub fn become_subreaper() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: prctl with integer arguments only.
        let rc = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1 as libc::c_ulong, 0, 0, 0) };
        assert_eq!(rc, 0, "PR_SET_CHILD_SUBREAPER");
    });
}

pub fn unique_base() -> u32 {
    let n = NEXT_SANDBOX.fetch_add(1, Ordering::SeqCst);
    100_000_000 + ((std::process::id() % 4096) * 8 + n % 8) * 65536
}

/// A busybox-static root: `bin/busybox`, one relative symlink per applet,
/// the usual empty directories; everything owned by `base`.
pub fn make_rootfs(root: &Path, base: u32, add: impl FnOnce(&Path)) {
    let bin = root.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::copy("/bin/busybox", bin.join("busybox")).unwrap();
    let list = Command::new("/bin/busybox").arg("--list").output().unwrap();
    for applet in String::from_utf8(list.stdout).unwrap().lines() {
        if applet != "busybox" {
            std::os::unix::fs::symlink("busybox", bin.join(applet)).unwrap();
        }
    }
    for dir in ["proc", "sys", "dev", "tmp", "etc", "root"] {
        std::fs::create_dir(root.join(dir)).unwrap();
    }
    std::fs::set_permissions(root.join("tmp"), std::os::unix::fs::PermissionsExt::from_mode(0o1777)).unwrap();
    add(root);
    chown_tree(root, base);
}

pub fn chown_tree(path: &Path, id: u32) {
    std::os::unix::fs::lchown(path, Some(id), Some(id)).unwrap();
    if std::fs::symlink_metadata(path).unwrap().is_dir() {
        for entry in std::fs::read_dir(path).unwrap() {
            chown_tree(&entry.unwrap().path(), id);
        }
    }
}

/// Starts init the way the host driver does, up to `Ready`.
pub fn start_sandbox() -> Sandbox {
    start_sandbox_adding(|_| {})
}

/// Like [`start_sandbox`], with `add` putting extra files into the rootfs
/// (before it is chowned to the sandbox's base uid).
pub fn start_sandbox_adding(add: impl FnOnce(&Path)) -> Sandbox {
    start_with(add, |_| BuildSpec { hostname: "sbx".into(), loopback: true, phase: Default::default() })
        .unwrap_or_else(|failure| panic!("setup failed: {failure}"))
}

/// Runs the setup sequence; `Err` carries init's `Failed` message.
pub fn start_with(add: impl FnOnce(&Path), spec: impl FnOnce(&Path) -> BuildSpec) -> Result<Sandbox, String> {
    become_subreaper();
    let dir = tempfile::tempdir().unwrap();
    // Init runs as the base uid: it must be able to walk to the rootfs.
    std::fs::set_permissions(dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o711)).unwrap();
    let base = unique_base();
    let root = dir.path().join("rootfs");
    std::fs::create_dir(&root).unwrap();
    make_rootfs(&root, base, add);
    let socket = dir.path().join("ctl.sock");
    let listener = UnixListener::bind(&socket).unwrap();
    let (host_end, init_end) = UnixStream::pair().unwrap();
    host_end.set_read_timeout(Some(IO_TIMEOUT)).unwrap();

    let mut first = spawn_init(&init_end, &listener);
    drop(init_end);
    drop(listener);
    let mut reader = BufReader::new(host_end.try_clone().unwrap());
    let mut host = host_end;

    assert_eq!(read_says(&mut reader), InitSays::UsernsReady);
    for map in ["uid_map", "gid_map"] {
        std::fs::write(format!("/proc/{}/{map}", first.id()), format!("0 {base} 65536\n")).unwrap();
    }
    let build = serde_json::to_string(&HostSays::Build(spec(&root))).unwrap();
    host.write_all(format!("{build}\n").as_bytes()).unwrap();
    send_root(&host, &root);
    let pid1 = match read_says(&mut reader) {
        InitSays::Pid1 { pid } => pid,
        InitSays::Failed { message } => {
            first.wait().unwrap();
            return Err(message);
        }
        other => panic!("expected Pid1, got {other:?}"),
    };
    assert!(first.wait().unwrap().success(), "the forking init exits 0");
    let sandbox = Sandbox { pid1, socket, base, _dir: dir };
    match read_says(&mut reader) {
        InitSays::Ready => Ok(sandbox),
        InitSays::Failed { message } => Err(message),
        other => panic!("expected Ready, got {other:?}"),
    }
}

/// The root filesystem as the driver sends it after the build order: a
/// detached mount (here a bind of the directory) on one byte of its own.
pub fn send_root(host: &UnixStream, root: &Path) {
    use rustix::mount::{open_tree, OpenTreeFlags};
    let tree = open_tree(rustix::fs::CWD, root, OpenTreeFlags::OPEN_TREE_CLONE | OpenTreeFlags::OPEN_TREE_CLOEXEC)
        .expect("open_tree of the rootfs");
    proto::send_with_fds(host.as_fd(), &[0], &[tree.as_fd()]).expect("send the rootfs");
}

pub fn spawn_init(setup: &UnixStream, listener: &UnixListener) -> Child {
    // Above 4, so the dup2s in the child cannot clobber each other.
    let setup_fd: OwnedFd = rustix::io::fcntl_dupfd_cloexec(setup, 10).unwrap();
    let listen_fd: OwnedFd = rustix::io::fcntl_dupfd_cloexec(listener, 10).unwrap();
    let (s, l) = (setup_fd.as_raw_fd(), listen_fd.as_raw_fd());
    let mut command = Command::new(env!("CARGO_BIN_EXE_warren-init"));
    command.arg0("warren-init").env_clear().stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
    // SAFETY: only dup2, which is async-signal-safe, runs between fork and exec.
    unsafe {
        command.pre_exec(move || {
            if libc::dup2(s, proto::SETUP_FD) == -1 || libc::dup2(l, proto::LISTEN_FD) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    command.spawn().unwrap()
}

pub fn read_says(reader: &mut impl BufRead) -> InitSays {
    let mut line = String::new();
    let n = reader.read_line(&mut line).unwrap();
    assert!(n > 0, "init closed the setup socket");
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("bad setup line {line:?}: {e}"))
}

/// What one exec produced.
#[derive(Debug)]
pub struct Outcome {
    pub pid: i32,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub exited: Exited,
}

impl Outcome {
    pub fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
}

impl Sandbox {
    pub fn connect(&self) -> UnixStream {
        let conn = UnixStream::connect(&self.socket).unwrap();
        conn.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
        conn
    }

    pub fn request(&self, conn: &mut UnixStream, spec: ExecSpec) {
        proto::write_json(conn, FrameKind::Request, &Request::Exec(spec)).unwrap();
    }

    /// Runs `spec`, feeding `stdin` then EOF, and collects everything.
    pub fn exec(&self, spec: ExecSpec, stdin: &[u8]) -> Result<Outcome, (String, bool)> {
        let mut conn = self.connect();
        self.request(&mut conn, spec);
        let pid = match read_response(&mut conn) {
            Response::Started { pid } => pid,
            Response::Error { message, not_found, .. } => return Err((message, not_found)),
            other => panic!("expected Started, got {other:?}"),
        };
        // The process may be done (and the connection closed) before it
        // wanted any input: a failed write is not a failure then.
        if !stdin.is_empty() {
            let _ = proto::write_frame(&mut conn, FrameKind::Stdin, stdin);
        }
        let _ = proto::write_frame(&mut conn, FrameKind::StdinEof, &[]);
        Ok(collect(&mut conn, pid))
    }

    pub fn run(&self, argv: &[&str]) -> Outcome {
        self.exec(spec(argv), b"").unwrap_or_else(|e| panic!("{argv:?} did not start: {e:?}"))
    }

    /// The security events recorded after `after_seq`: (events, dropped, next_seq).
    pub fn events(&self, after_seq: u64) -> (Vec<SecurityEvent>, u64, u64) {
        let mut conn = self.connect();
        proto::write_json(&mut conn, FrameKind::Request, &Request::Events { after_seq }).unwrap();
        match read_response(&mut conn) {
            Response::Events { events, dropped, next_seq } => (events, dropped, next_seq),
            other => panic!("expected Events, got {other:?}"),
        }
    }

    /// Pids (as seen inside) of every process of the sandbox, zombies
    /// included, but not init's phase leader: the entries of its own /proc,
    /// reached through PID 1's root.
    pub fn sandbox_pids(&self) -> Vec<i32> {
        let proc = format!("/proc/{}/root/proc", self.pid1);
        let mut pids: Vec<i32> = std::fs::read_dir(&proc)
            .unwrap()
            .filter_map(|e| e.unwrap().file_name().to_str().and_then(|s| s.parse().ok()))
            .filter(|pid| !is_leader(&format!("{proc}/{pid}")))
            .collect();
        pids.sort_unstable();
        pids
    }

    /// Host pids of every live (non-zombie) process in the sandbox's pid
    /// namespace, PID 1 included, but not init's phase leader (init's own
    /// helper, always there).
    pub fn live_processes(&self) -> Vec<i32> {
        let ns = std::fs::read_link(format!("/proc/{}/ns/pid", self.pid1)).unwrap();
        let mut pids = Vec::new();
        for entry in std::fs::read_dir("/proc").unwrap() {
            let Some(pid) = entry.unwrap().file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                continue;
            };
            let same_ns = std::fs::read_link(format!("/proc/{pid}/ns/pid")).is_ok_and(|l| l == ns);
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let zombie = stat.rsplit(')').next().is_some_and(|rest| rest.trim_start().starts_with('Z'));
            if same_ns && !zombie && !is_leader(&format!("/proc/{pid}")) {
                pids.push(pid);
            }
        }
        pids
    }

    /// Fails naming every other process left (its `stat` line and command
    /// line: a rare leftover says what it was).
    pub fn assert_only_pid1_is_left(&self) {
        let left = self.live_processes();
        let others: Vec<String> = left
            .iter()
            .filter(|&&pid| pid != self.pid1)
            .map(|pid| {
                let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
                let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                format!("{} [{}]", stat.trim(), String::from_utf8_lossy(&cmdline).replace('\0', " "))
            })
            .collect();
        assert_eq!(left, vec![self.pid1], "only PID 1 is left; the others: {others:#?}");
    }
}

/// Whether the process at `/proc/<pid>` (`dir`) is a phase leader (a fork
/// of PID 1 named `phase-leader`).
fn is_leader(dir: &str) -> bool {
    std::fs::read(format!("{dir}/comm")).is_ok_and(|c| c == b"phase-leader\n")
}

pub fn spec(argv: &[&str]) -> ExecSpec {
    ExecSpec {
        argv: argv.iter().map(|s| s.to_string()).collect(),
        env: BTreeMap::from([("PATH".to_string(), "/bin".to_string())]),
        cwd: "/".into(),
        capture_session_state: false,
    }
}

pub fn read_response(conn: &mut UnixStream) -> Response {
    match proto::read_frame(conn).unwrap() {
        Some((FrameKind::Response, payload)) => serde_json::from_slice(&payload).unwrap(),
        other => panic!("expected a response frame, got {other:?}"),
    }
}

/// Reads output frames until `Exited`.
pub fn collect(conn: &mut UnixStream, pid: i32) -> Outcome {
    let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
    loop {
        match proto::read_frame(conn).unwrap() {
            Some((FrameKind::Stdout, data)) => stdout.extend(data),
            Some((FrameKind::Stderr, data)) => stderr.extend(data),
            Some((FrameKind::Response, payload)) => match serde_json::from_slice(&payload).unwrap() {
                Response::Exited(exited) => return Outcome { pid, stdout, stderr, exited },
                other => panic!("unexpected response {other:?}"),
            },
            other => panic!("unexpected frame {other:?}"),
        }
    }
}

/// Reads stdout frames until `needle` has been seen.
pub fn wait_for_output(conn: &mut UnixStream, needle: &str) {
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains(needle) {
        match proto::read_frame(conn).unwrap() {
            Some((FrameKind::Stdout, data)) | Some((FrameKind::Stderr, data)) => seen.extend(data),
            other => panic!("unexpected frame while waiting for {needle:?}: {other:?}"),
        }
    }
}

pub fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + IO_TIMEOUT;
    while !done() {
        assert!(Instant::now() < deadline, "gave up waiting until {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

//! End-to-end tests of the real `warren-init` binary. The test plays the
//! host: it hands init the setup socket and the listener, maps its user
//! namespace, and drives it over the control protocol. Run as root.
//!
//! The rootfs is a busybox-static tree in a temp dir, chowned to the
//! sandbox's base uid (without idmapped mounts, files owned by host root
//! would show up as `nobody` inside). No cgroups here: that is the driver's.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Once;
use std::time::{Duration, Instant};

use warren_init::proto::setup::{BuildSpec, HostSays, InitSays};
use warren_init::proto::{self, ExecSpec, Exited, FrameKind, Request, Response, SessionState};

/// A generous bound so that a broken init fails a test instead of hanging it.
const IO_TIMEOUT: Duration = Duration::from_secs(60);

static NEXT_SANDBOX: AtomicU32 = AtomicU32::new(0);

/// A running sandbox: its PID 1 (our child through the subreaper flag) and
/// its temp dir. Dropping it kills PID 1 (which ends the pid namespace),
/// reaps it and removes the dir; all its mounts die with its namespace.
struct Sandbox {
    pid1: i32,
    socket: PathBuf,
    base: u32,
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

fn become_subreaper() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: prctl with integer arguments only.
        let rc = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1 as libc::c_ulong, 0, 0, 0) };
        assert_eq!(rc, 0, "PR_SET_CHILD_SUBREAPER");
    });
}

fn unique_base() -> u32 {
    let n = NEXT_SANDBOX.fetch_add(1, Ordering::SeqCst);
    100_000_000 + ((std::process::id() % 4096) * 8 + n % 8) * 65536
}

/// A busybox-static root: `bin/busybox`, one relative symlink per applet,
/// the usual empty directories; everything owned by `base`.
fn make_rootfs(root: &Path, base: u32) {
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
    chown_tree(root, base);
}

fn chown_tree(path: &Path, id: u32) {
    std::os::unix::fs::lchown(path, Some(id), Some(id)).unwrap();
    if std::fs::symlink_metadata(path).unwrap().is_dir() {
        for entry in std::fs::read_dir(path).unwrap() {
            chown_tree(&entry.unwrap().path(), id);
        }
    }
}

/// Starts init the way the host driver does, up to `Ready`.
fn start_sandbox() -> Sandbox {
    start_with(|root| BuildSpec { rootfs: root.display().to_string(), hostname: "sbx".into(), loopback: true })
        .unwrap_or_else(|failure| panic!("setup failed: {failure}"))
}

/// Runs the setup sequence; `Err` carries init's `Failed` message.
fn start_with(spec: impl FnOnce(&Path) -> BuildSpec) -> Result<Sandbox, String> {
    become_subreaper();
    let dir = tempfile::tempdir().unwrap();
    // Init runs as the base uid: it must be able to walk to the rootfs.
    std::fs::set_permissions(dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o711)).unwrap();
    let base = unique_base();
    let root = dir.path().join("rootfs");
    std::fs::create_dir(&root).unwrap();
    make_rootfs(&root, base);
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

fn spawn_init(setup: &UnixStream, listener: &UnixListener) -> Child {
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

fn read_says(reader: &mut impl BufRead) -> InitSays {
    let mut line = String::new();
    let n = reader.read_line(&mut line).unwrap();
    assert!(n > 0, "init closed the setup socket");
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("bad setup line {line:?}: {e}"))
}

/// What one exec produced.
#[derive(Debug)]
struct Outcome {
    pid: i32,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    exited: Exited,
}

impl Outcome {
    fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
}

impl Sandbox {
    fn connect(&self) -> UnixStream {
        let conn = UnixStream::connect(&self.socket).unwrap();
        conn.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
        conn
    }

    fn request(&self, conn: &mut UnixStream, spec: ExecSpec) {
        proto::write_json(conn, FrameKind::Request, &Request::Exec(spec)).unwrap();
    }

    /// Runs `spec`, feeding `stdin` then EOF, and collects everything.
    fn exec(&self, spec: ExecSpec, stdin: &[u8]) -> Result<Outcome, (String, bool)> {
        let mut conn = self.connect();
        self.request(&mut conn, spec);
        let pid = match read_response(&mut conn) {
            Response::Started { pid } => pid,
            Response::Error { message, not_found } => return Err((message, not_found)),
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

    fn run(&self, argv: &[&str]) -> Outcome {
        self.exec(spec(argv), b"").unwrap_or_else(|e| panic!("{argv:?} did not start: {e:?}"))
    }

    /// Pids (as seen inside) of every process of the sandbox, zombies
    /// included: the entries of its own /proc, reached through PID 1's root.
    fn sandbox_pids(&self) -> Vec<i32> {
        let mut pids: Vec<i32> = std::fs::read_dir(format!("/proc/{}/root/proc", self.pid1))
            .unwrap()
            .filter_map(|e| e.unwrap().file_name().to_str().and_then(|s| s.parse().ok()))
            .collect();
        pids.sort_unstable();
        pids
    }

    /// Host pids of every live (non-zombie) process in the sandbox's pid
    /// namespace, PID 1 included.
    fn live_processes(&self) -> Vec<i32> {
        let ns = std::fs::read_link(format!("/proc/{}/ns/pid", self.pid1)).unwrap();
        let mut pids = Vec::new();
        for entry in std::fs::read_dir("/proc").unwrap() {
            let Some(pid) = entry.unwrap().file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                continue;
            };
            let same_ns = std::fs::read_link(format!("/proc/{pid}/ns/pid")).is_ok_and(|l| l == ns);
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let zombie = stat.rsplit(')').next().is_some_and(|rest| rest.trim_start().starts_with('Z'));
            if same_ns && !zombie {
                pids.push(pid);
            }
        }
        pids
    }
}

fn spec(argv: &[&str]) -> ExecSpec {
    ExecSpec {
        argv: argv.iter().map(|s| s.to_string()).collect(),
        env: BTreeMap::from([("PATH".to_string(), "/bin".to_string())]),
        cwd: "/".into(),
        capture_session_state: false,
    }
}

fn read_response(conn: &mut UnixStream) -> Response {
    match proto::read_frame(conn).unwrap() {
        Some((FrameKind::Response, payload)) => serde_json::from_slice(&payload).unwrap(),
        other => panic!("expected a response frame, got {other:?}"),
    }
}

/// Reads output frames until `Exited`.
fn collect(conn: &mut UnixStream, pid: i32) -> Outcome {
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
fn wait_for_output(conn: &mut UnixStream, needle: &str) {
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains(needle) {
        match proto::read_frame(conn).unwrap() {
            Some((FrameKind::Stdout, data)) | Some((FrameKind::Stderr, data)) => seen.extend(data),
            other => panic!("unexpected frame while waiting for {needle:?}: {other:?}"),
        }
    }
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + IO_TIMEOUT;
    while !done() {
        assert!(Instant::now() < deadline, "gave up waiting until {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn ping_answers_pong_with_the_init_version() {
    let sb = start_sandbox();
    let mut conn = sb.connect();
    proto::write_json(&mut conn, FrameKind::Request, &Request::Ping).unwrap();
    assert_eq!(read_response(&mut conn), Response::Pong { init_version: env!("CARGO_PKG_VERSION").into() });
}

#[test]
fn exec_gets_exactly_its_env_and_cwd() {
    let sb = start_sandbox();
    let mut s = spec(&["env"]);
    s.env.insert("FOO".into(), "one two".into());
    s.cwd = "/tmp".into();
    let out = sb.exec(s, b"").unwrap();
    let mut lines: Vec<&str> = std::str::from_utf8(&out.stdout).unwrap().lines().collect();
    lines.sort_unstable();
    assert_eq!(lines, vec!["FOO=one two", "PATH=/bin"]);
    assert_eq!(out.exited.exit_code, Some(0));

    let mut s = spec(&["pwd"]);
    s.cwd = "/tmp".into();
    assert_eq!(sb.exec(s, b"").unwrap().stdout(), "/tmp\n");
}

#[test]
fn stdout_and_stderr_stay_separate_and_the_exit_code_is_reported() {
    let sb = start_sandbox();
    let out = sb.run(&["sh", "-c", "echo out; echo err >&2; exit 3"]);
    assert_eq!(out.stdout(), "out\n");
    assert_eq!(String::from_utf8_lossy(&out.stderr), "err\n");
    assert_eq!((out.exited.exit_code, out.exited.signal, out.exited.killed), (Some(3), None, false));
    assert!(out.exited.max_rss_bytes > 0, "rusage is reported");
    assert!(out.pid > 1, "the pid is the one inside the sandbox");
}

#[test]
fn death_by_signal_is_reported_as_the_signal() {
    let sb = start_sandbox();
    let out = sb.run(&["sh", "-c", "kill -TERM $$"]);
    assert_eq!((out.exited.exit_code, out.exited.signal), (None, Some(libc::SIGTERM)));
}

#[test]
fn stdin_frames_reach_the_process_and_eof_closes_it() {
    let sb = start_sandbox();
    let out = sb.exec(spec(&["cat"]), b"hello\nworld\n").unwrap();
    assert_eq!(out.stdout(), "hello\nworld\n");
    assert_eq!(out.exited.exit_code, Some(0));
}

#[test]
fn large_output_arrives_complete() {
    let sb = start_sandbox();
    let out = sb.run(&["head", "-c", "3000000", "/dev/urandom"]);
    assert_eq!(out.stdout.len(), 3_000_000);
    assert_eq!(out.exited.exit_code, Some(0));
}

#[test]
fn missing_program_and_bad_cwd_are_errors_before_start() {
    let sb = start_sandbox();
    let (message, not_found) = sb.exec(spec(&["no-such-tool"]), b"").unwrap_err();
    assert!(not_found, "{message}");
    assert!(message.contains("no-such-tool"), "{message}");
    let (_, not_found) = sb.exec(spec(&["/etc"]), b"").unwrap_err();
    assert!(!not_found, "a directory is not executable, but it exists");
    let mut s = spec(&["true"]);
    s.cwd = "/nonexistent".into();
    let (message, not_found) = sb.exec(s, b"").unwrap_err();
    assert!(!not_found && message.contains("/nonexistent"), "{message}");
}

#[test]
fn kill_frame_kills_the_whole_tree_and_reports_killed() {
    let sb = start_sandbox();
    let mut conn = sb.connect();
    sb.request(&mut conn, spec(&["sh", "-c", "sleep 1000 & sleep 1000 & echo ready; sleep 1000"]));
    let Response::Started { pid } = read_response(&mut conn) else { panic!("not started") };
    wait_for_output(&mut conn, "ready");
    assert!(sb.live_processes().len() >= 4, "init, sh and three sleeps: {:?}", sb.live_processes());
    proto::write_frame(&mut conn, FrameKind::Kill, &[]).unwrap();
    let out = collect(&mut conn, pid);
    assert!(out.exited.killed);
    assert_eq!(out.exited.signal, Some(libc::SIGKILL));
    assert_eq!(sb.live_processes(), vec![sb.pid1], "only PID 1 is left");
}

#[test]
fn kill_reaches_setsid_daemons_that_hold_the_output() {
    let sb = start_sandbox();
    let mut conn = sb.connect();
    // The daemon leaves the session and, once its parents exit, the parent
    // chain too: only the stdout it still holds ties it to the exec.
    sb.request(&mut conn, spec(&["sh", "-c", "(setsid sleep 1000 &); echo ready"]));
    let Response::Started { pid } = read_response(&mut conn) else { panic!("not started") };
    wait_for_output(&mut conn, "ready");
    proto::write_frame(&mut conn, FrameKind::Kill, &[]).unwrap();
    let out = collect(&mut conn, pid);
    assert!(out.exited.killed);
    assert_eq!(sb.live_processes(), vec![sb.pid1], "only PID 1 is left");
}

#[test]
fn kill_stops_a_process_that_keeps_forking() {
    let sb = start_sandbox();
    let mut conn = sb.connect();
    // Bounded on purpose (no pids cgroup here): a fork loop, not a bomb.
    sb.request(&mut conn, spec(&["sh", "-c", "echo ready; while :; do (sleep 1000 &); done"]));
    let Response::Started { pid } = read_response(&mut conn) else { panic!("not started") };
    wait_for_output(&mut conn, "ready");
    wait_until("the loop has forked", || sb.live_processes().len() > 20);
    proto::write_frame(&mut conn, FrameKind::Kill, &[]).unwrap();
    let out = collect(&mut conn, pid);
    assert!(out.exited.killed);
    assert_eq!(sb.live_processes(), vec![sb.pid1], "only PID 1 is left");
}

#[test]
fn closing_the_connection_kills_the_tree() {
    let sb = start_sandbox();
    let mut conn = sb.connect();
    sb.request(&mut conn, spec(&["sh", "-c", "sleep 1000 & (sleep 1000 &); echo ready; sleep 1000"]));
    let Response::Started { .. } = read_response(&mut conn) else { panic!("not started") };
    wait_for_output(&mut conn, "ready");
    assert!(sb.live_processes().len() >= 4, "{:?}", sb.live_processes());
    drop(conn);
    wait_until("only PID 1 is left", || sb.live_processes() == vec![sb.pid1]);
}

#[test]
fn orphans_are_reaped_by_pid1() {
    let sb = start_sandbox();
    let out = sb.run(&["sh", "-c", "(sleep 0.2 >/dev/null 2>&1 &); exit 0"]);
    assert_eq!(out.exited.exit_code, Some(0));
    // Zombies included: nothing but PID 1 may stay in the namespace.
    wait_until("the orphan is reaped", || sb.sandbox_pids() == vec![1]);
}

#[test]
fn session_state_comes_back_without_touching_output_or_status() {
    let sb = start_sandbox();
    let mut s = spec(&["/bin/sh", "-c", "echo hi; cd /tmp; export FOO=bar; false"]);
    s.capture_session_state = true;
    let out = sb.exec(s, b"").unwrap();
    assert_eq!(out.stdout(), "hi\n");
    assert!(out.stderr.is_empty(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.exited.exit_code, Some(1), "CMD's status is the exec's");
    let SessionState { cwd, env } = out.exited.session_state.expect("session state");
    assert_eq!(cwd, "/tmp");
    assert_eq!(env.get("FOO").map(String::as_str), Some("bar"));
    assert_eq!(env.get("PATH").map(String::as_str), Some("/bin"));
    assert!(!env.contains_key("__warren_rc"));

    let mut s = spec(&["/bin/sh", "-c", "ls /proc/self/fd; exit 4"]);
    s.capture_session_state = true;
    let out = sb.exec(s, b"").unwrap();
    assert_eq!(out.exited.exit_code, Some(4));
    assert_eq!(out.exited.session_state, None, "exit skips the report");
    assert_eq!(out.stdout(), "0\n1\n2\n3\n", "CMD sees neither the state pipe nor init's binary");
}

#[test]
fn a_peer_inside_the_sandbox_pid_namespace_is_refused() {
    let sb = start_sandbox();
    // Sends a Ping and prints what came back: "closed" or the reply's size.
    let client = r#"
import socket, struct, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
body = b'{"op":"ping"}'
try:
    s.sendall(struct.pack(">BI", 1, len(body)) + body)
    data = s.recv(4096)
except (BrokenPipeError, ConnectionResetError):
    data = b""
print("closed" if not data else "answered %d" % len(data))
"#;
    let from = |inside: bool| {
        let mut cmd = Command::new("nsenter");
        if inside {
            cmd.args(["--target", &sb.pid1.to_string(), "--pid", "--"]);
        } else {
            cmd.arg("--");
        }
        let out = cmd.args(["/usr/bin/python3", "-c", client, sb.socket.to_str().unwrap()]).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    assert!(from(false).starts_with("answered"), "the host is served");
    assert_eq!(from(true), "closed\n", "a process of the sandbox is not");
}

#[test]
fn kernel_files_are_masked_and_read_only() {
    use warren_guard::profile::{MASKED_DIRS, MASKED_FILES, READ_ONLY_PATHS};
    let sb = start_sandbox();
    let on_host = |path: &&&str| Path::new(**path).exists();
    // This kernel has no /proc/kcore or /proc/sysrq-trigger; the masks of
    // what it has are checked, and there must be some.
    let files: Vec<&str> = MASKED_FILES.iter().filter(on_host).copied().collect();
    assert!(files.contains(&"/proc/keys") && files.contains(&"/proc/timer_list"), "{files:?}");
    let mut argv = vec!["stat", "-c", "%n %F %t:%T"];
    argv.extend(&files);
    let expected: String = files.iter().map(|f| format!("{f} character special file 1:3\n")).collect();
    assert_eq!(sb.run(&argv).stdout(), expected, "masked files are /dev/null");

    // (mount point, fstype, options) of every mount inside.
    let mounts: Vec<(String, String, String)> = sb
        .run(&["cat", "/proc/self/mountinfo"])
        .stdout()
        .lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let left: Vec<&str> = left.split(' ').collect();
            let fstype = right.split(' ').next()?;
            Some((left.get(4)?.to_string(), fstype.to_string(), left.get(5)?.to_string()))
        })
        .collect();
    let mounted = |path: &str| mounts.iter().rev().find(|(p, _, _)| p == path).cloned();
    for path in &files {
        assert!(mounted(path).is_some(), "{path} is not masked: {mounts:?}");
    }
    for path in MASKED_DIRS.iter().filter(on_host) {
        let (_, fstype, options) = mounted(path).unwrap_or_else(|| panic!("{path} is not masked"));
        assert_eq!(fstype, "tmpfs", "{path}");
        assert!(options.starts_with("ro"), "{path}: {options}");
    }
    for path in READ_ONLY_PATHS.iter().filter(on_host) {
        let (_, _, options) = mounted(path).unwrap_or_else(|| panic!("{path} is not read-only"));
        assert!(options.starts_with("ro"), "{path}: {options}");
    }
    let out = sb.run(&["sh", "-c", "echo evil > /proc/sys/kernel/hostname"]);
    assert_ne!(out.exited.exit_code, Some(0));
    assert!(String::from_utf8_lossy(&out.stderr).contains("Read-only"), "{}", String::from_utf8_lossy(&out.stderr));
    let out = sb.run(&["sh", "-c", "ls -A /sys/firmware"]);
    assert_eq!(out.stdout(), "", "masked directories are empty");
}

#[test]
fn capabilities_are_reduced_to_the_profile_and_privileges_cannot_grow() {
    let sb = start_sandbox();
    let out = sb.run(&["grep", "-E", "^(Cap|NoNewPrivs)", "/proc/self/status"]);
    let fields: BTreeMap<String, String> = out
        .stdout()
        .lines()
        .filter_map(|l| l.split_once(':').map(|(k, v)| (k.to_string(), v.trim().to_string())))
        .collect();
    let expected = format!("{:016x}", warren_guard::profile::sandbox_capability_mask());
    assert_eq!(fields["CapBnd"], expected);
    assert_eq!(fields["CapEff"], expected);
    assert_eq!(fields["CapPrm"], expected);
    assert_eq!(fields["CapInh"], "0000000000000000");
    assert_eq!(fields["CapAmb"], "0000000000000000");
    assert_eq!(fields["NoNewPrivs"], "1");
    assert_eq!(sb.run(&["id", "-u"]).stdout(), "0\n");
}

#[test]
fn exec_starts_clean_with_only_stdio_and_default_signals() {
    let sb = start_sandbox();
    // 3 is `ls`'s own handle on the directory it lists.
    assert_eq!(sb.run(&["ls", "/proc/self/fd"]).stdout(), "0\n1\n2\n3\n");
    let out = sb.run(&["grep", "-E", "^Sig(Blk|Ign)", "/proc/self/status"]);
    assert_eq!(out.stdout(), "SigBlk:\t0000000000000000\nSigIgn:\t0000000000000000\n");
    // Its own session, and a subreaper for its orphans.
    let out = sb.run(&["sh", "-c", "cut -d' ' -f6 /proc/$$/stat; echo $$"]);
    let lines: Vec<&str> = out.stdout.split(|b| *b == b'\n').map(|l| std::str::from_utf8(l).unwrap()).collect();
    assert_eq!(lines[0], lines[1], "the session id is the main pid");
}

#[test]
fn hostname_loopback_and_devices_are_set_up() {
    let sb = start_sandbox();
    assert_eq!(sb.run(&["hostname"]).stdout(), "sbx\n");
    assert!(sb.run(&["ip", "-o", "link", "show", "lo"]).stdout().contains("UP"));
    let out = sb.run(&["sh", "-c", "head -c 4 /dev/zero | wc -c; echo x > /dev/null && echo null-ok; ls /dev/pts"]);
    assert_eq!(out.stdout(), "4\nnull-ok\nptmx\n");
    // Files made inside belong to the sandbox's base uid on the host.
    sb.run(&["touch", "/tmp/made-inside"]);
    let root = PathBuf::from(format!("/proc/{}/root", sb.pid1));
    let meta = std::fs::metadata(root.join("tmp/made-inside")).unwrap();
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&meta), sb.base);
}

#[test]
fn the_binary_has_no_program_interpreter() {
    // Without PT_INTERP the kernel loads no dynamic linker, so the binary
    // cannot depend on any shared library: it runs in an empty image.
    let elf = std::fs::read(env!("CARGO_BIN_EXE_warren-init")).unwrap();
    assert_eq!(&elf[..4], b"\x7fELF");
    let u16_at = |o: usize| u16::from_le_bytes([elf[o], elf[o + 1]]) as usize;
    let phoff = u64::from_le_bytes(elf[0x20..0x28].try_into().unwrap()) as usize;
    let (phentsize, phnum) = (u16_at(0x36), u16_at(0x38));
    const PT_INTERP: u32 = 3;
    for i in 0..phnum {
        let at = phoff + i * phentsize;
        let p_type = u32::from_le_bytes(elf[at..at + 4].try_into().unwrap());
        assert_ne!(p_type, PT_INTERP, "warren-init must be statically linked");
    }
}

#[test]
fn setup_failure_is_reported_with_the_step() {
    let failure =
        start_with(|_| BuildSpec { rootfs: "/nonexistent/rootfs".into(), hostname: "x".into(), loopback: false })
            .err()
            .expect("a missing rootfs cannot be built");
    assert!(failure.contains("step 4"), "{failure}");
    assert!(failure.contains("No such file"), "{failure}");
}

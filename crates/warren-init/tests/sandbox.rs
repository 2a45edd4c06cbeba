//! End-to-end tests of the real `warren-init` binary: exec, output,
//! kills, sessions, and the sandbox's masks and credentials. The harness
//! (in `common`) plays the host. Run as root.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use warren_init::proto::setup::BuildSpec;
use warren_init::proto::{self, FrameKind, Request, Response, SessionState};

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
    sb.assert_only_pid1_is_left();
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
    sb.assert_only_pid1_is_left();
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
    sb.assert_only_pid1_is_left();
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

/// Threads of the process `pid` (host pid).
fn threads(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().count()
}

/// Host pids of `pid`'s children named `phase-leader`.
fn leaders_of(pid: i32) -> Vec<i32> {
    let mut children = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let list = std::fs::read_to_string(task.unwrap().path().join("children")).unwrap_or_default();
        children.extend(list.split_whitespace().filter_map(|p| p.parse::<i32>().ok()));
    }
    children
        .into_iter()
        .filter(|c| std::fs::read(format!("/proc/{c}/comm")).is_ok_and(|comm| comm == b"phase-leader\n"))
        .collect()
}

/// What an idle sandbox costs the host is mostly per task: PID 1 reaps
/// from its own loop, so it is two threads (that loop and the seccomp
/// supervisor) and one leader, before and after execs, while still
/// reaping every exec's process and every orphan.
#[test]
fn an_idle_sandbox_is_pid1_with_two_threads_and_one_leader() {
    let sb = start_sandbox();
    assert_eq!(threads(sb.pid1), 2, "PID 1's threads when idle");
    let leaders = leaders_of(sb.pid1);
    assert_eq!(leaders.len(), 1, "one phase leader: {leaders:?}");
    assert_eq!(threads(leaders[0]), 1, "the leader's threads");
    for code in 0..3 {
        assert_eq!(sb.run(&["/bin/sh", "-c", &format!("exit {code}")]).exited.exit_code, Some(code));
    }
    // Orphans too: the reaper is no thread, yet nothing stays a zombie.
    let out = sb.run(&["sh", "-c", "(sleep 0.2 >/dev/null 2>&1 &); exit 0"]);
    assert_eq!(out.exited.exit_code, Some(0));
    wait_until("the orphan is reaped", || sb.sandbox_pids() == vec![1]);
    // The connection threads have ended: back to the idle shape.
    wait_until("PID 1 is back to two threads", || threads(sb.pid1) == 2);
    assert_eq!(leaders_of(sb.pid1), leaders, "the same leader still serves");
}

/// The host keeps one connection per sandbox between execs: the next exec
/// on it runs as on a new one, after what the host sent the last exec once
/// it had ended (stdin, its end, a kill) has been passed over; the thread
/// serving it ends with the connection.
#[test]
fn execs_follow_each_other_on_one_connection() {
    let sb = start_sandbox();
    let mut conn = sb.connect();
    sb.request(&mut conn, spec(&["sh", "-c", "echo one; exit 3"]));
    let Response::Started { pid } = read_response(&mut conn) else { panic!("not started") };
    let first = collect(&mut conn, pid);
    assert_eq!((first.stdout(), first.exited.exit_code), ("one\n".to_string(), Some(3)));
    // Late frames for the exec that is over, then the next request.
    proto::write_frame(&mut conn, FrameKind::Stdin, b"late").unwrap();
    proto::write_frame(&mut conn, FrameKind::StdinEof, &[]).unwrap();
    proto::write_frame(&mut conn, FrameKind::Kill, &[]).unwrap();
    sb.request(&mut conn, spec(&["cat"]));
    let Response::Started { pid } = read_response(&mut conn) else { panic!("not started") };
    proto::write_frame(&mut conn, FrameKind::Stdin, b"two\n").unwrap();
    proto::write_frame(&mut conn, FrameKind::StdinEof, &[]).unwrap();
    let second = collect(&mut conn, pid);
    assert_eq!((second.stdout(), second.exited.exit_code, second.exited.killed), ("two\n".to_string(), Some(0), false));
    // A start error leaves the connection in order too.
    sb.request(&mut conn, spec(&["no-such-tool"]));
    assert!(matches!(read_response(&mut conn), Response::Error { not_found: true, .. }));
    sb.request(&mut conn, spec(&["true"]));
    let Response::Started { pid } = read_response(&mut conn) else { panic!("not started") };
    assert_eq!(collect(&mut conn, pid).exited.exit_code, Some(0));
    assert_eq!(threads(sb.pid1), 3, "PID 1's loop, the seccomp supervisor and this connection's thread");
    drop(conn);
    wait_until("the connection's thread has ended", || threads(sb.pid1) == 2);
}

/// A request that is not an exec is answered and ends the connection, as
/// does anything but a request after an exec's leftovers.
#[test]
fn a_connection_after_an_exec_takes_only_execs_in_order() {
    let sb = start_sandbox();
    let mut conn = sb.connect();
    sb.request(&mut conn, spec(&["true"]));
    let Response::Started { pid } = read_response(&mut conn) else { panic!("not started") };
    collect(&mut conn, pid);
    proto::write_json(&mut conn, FrameKind::Request, &Request::Ping).unwrap();
    assert!(matches!(read_response(&mut conn), Response::Pong { .. }));
    assert_eq!(proto::read_frame(&mut conn).unwrap(), None, "closed after the answer");

    let mut conn = sb.connect();
    sb.request(&mut conn, spec(&["true"]));
    let Response::Started { pid } = read_response(&mut conn) else { panic!("not started") };
    collect(&mut conn, pid);
    // An init-to-host kind from the host: the protocol is broken.
    proto::write_frame(&mut conn, FrameKind::Stdout, b"x").unwrap();
    // Init may have closed already: the write may fail.
    let _ = proto::write_json(&mut conn, FrameKind::Request, &Request::Exec(spec(&["true"])));
    assert_eq!(proto::read_frame(&mut conn).ok().flatten(), None, "closed without running it");
    sb.assert_only_pid1_is_left();
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
    // An image whose /proc is a symlink would redirect the kernel's proc.
    let failure = start_with(
        |root| {
            std::fs::remove_dir(root.join("proc")).unwrap();
            std::os::unix::fs::symlink("tmp", root.join("proc")).unwrap();
        },
        |_| BuildSpec { hostname: "x".into(), loopback: false, phase: Default::default() },
    )
    .err()
    .expect("a rootfs whose /proc is a symlink cannot be built");
    assert!(failure.contains("step 4"), "{failure}");
    assert!(failure.contains("/proc is not a directory"), "{failure}");
}

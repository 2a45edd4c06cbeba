//! Adversarial: run the attack inside a real sandbox, then check the host.
//! Kernel memory and page maps stay hidden, root inside holds no
//! CAP_SYS_ADMIN and cannot mount, no platform fd leaks into a command,
//! a replaced `/bin/sh` does not hijack the platform, and root inside is not
//! root on the host.

use std::collections::BTreeSet;

use reqwest::StatusCode;
use serde_json::json;
use warren_api::{ExecRequest, ExecStatus};
use warren_tests::*;

const CAP_SYS_ADMIN: u32 = 21;

#[tokio::test]
async fn kernel_memory_files_are_unreadable() {
    let server = TestServer::start().await;
    let sb = server.create_small().await;
    for file in ["/proc/kcore", "/proc/kpagecgroup", "/proc/kpageflags", "/proc/kpagecount"] {
        let got = server.sh_ok(&sb.id, &format!("head -c 64 {file} 2>/dev/null | wc -c")).await;
        assert_eq!(got.trim(), "0", "{file} gave bytes inside the sandbox");
    }
    let r = server.sh(&sb.id, "echo h > /proc/sysrq-trigger").await;
    assert_ne!(r.exit_code, Some(0), "/proc/sysrq-trigger is writable: {r:?}");
    server.finish().await;
}

#[tokio::test]
async fn root_inside_has_no_cap_sys_admin_and_cannot_mount() {
    let server = TestServer::start().await;
    let sb = server.create_small().await;
    let status = server.sh_ok(&sb.id, "grep -E '^Cap(Eff|Prm|Bnd):' /proc/self/status").await;
    for line in status.lines() {
        let hex = line.split_whitespace().nth(1).expect("a capability mask");
        let mask = u64::from_str_radix(hex, 16).expect("hex capability mask");
        assert_eq!(mask & (1 << CAP_SYS_ADMIN), 0, "CAP_SYS_ADMIN present: {line}");
    }
    let r = server.sh(&sb.id, "mount -t tmpfs none /mnt").await;
    assert_ne!(r.exit_code, Some(0), "mount succeeded inside: {r:?}");
    let mounts = server.sh_ok(&sb.id, "cat /proc/self/mountinfo").await;
    assert!(!mounts.lines().any(|l| l.split(' ').nth(4) == Some("/mnt")), "/mnt got mounted:\n{mounts}");
    let r = server.sh(&sb.id, "mknod /tmp/disk b 8 0").await;
    assert_ne!(r.exit_code, Some(0), "mknod of a block device succeeded: {r:?}");
    server.finish().await;
}

fn fd_set(listing: &str) -> BTreeSet<u32> {
    listing.split_whitespace().map(|fd| fd.parse().unwrap_or_else(|_| panic!("not an fd: {fd}"))).collect()
}

#[tokio::test]
async fn commands_inherit_only_stdio() {
    let server = TestServer::start().await;
    let sb = server.create_small().await;
    // `ls` holds the directory it lists open as fd 3.
    let want = BTreeSet::from([0, 1, 2, 3]);
    let r = server.exec_wait(&sb.id, &ExecRequest::argv(["ls", "/proc/self/fd"])).await;
    assert_eq!(fd_set(stdout(&r)), want, "argv exec");
    let with_stdin = ExecRequest { stdin: Some("x".into()), ..ExecRequest::argv(["ls", "/proc/self/fd"]) };
    assert_eq!(fd_set(stdout(&server.exec_wait(&sb.id, &with_stdin).await)), want, "argv exec with stdin");
    assert_eq!(fd_set(&server.sh_ok(&sb.id, "ls /proc/self/fd").await), want, "shell exec");
    server.finish().await;
}

#[tokio::test]
async fn session_commands_inherit_only_stdio() {
    let server = TestServer::start().await;
    let sb = server.create_small().await;
    let s = server.create_session(&sb.id, json!({})).await;
    let r = server.session_exec(&sb.id, &s.id, "ls /proc/self/fd").await;
    assert_eq!(fd_set(stdout(&r)), BTreeSet::from([0, 1, 2, 3]), "session exec");
    server.finish().await;
}

#[tokio::test]
async fn replaced_bin_sh_does_not_hijack_the_platform() {
    let server = TestServer::start().await;
    let sb = server.create_small().await;
    // The impostor records every run, then behaves like a shell.
    server
        .put_file_ok(
            &sb.id,
            "/tmp/impostor",
            "#!/bin/busybox sh\necho ran >> /tmp/hijacked\nexec /bin/busybox sh \"$@\"\n",
        )
        .await;
    server.sh_ok(&sb.id, "chmod 755 /tmp/impostor && rm /bin/sh && cp /tmp/impostor /bin/sh").await;

    let r = server.exec_wait(&sb.id, &ExecRequest::argv(["/bin/busybox", "echo", "platform-ok"])).await;
    assert_eq!(stdout(&r), "platform-ok\n");
    let r = server.exec_wait(&sb.id, &ExecRequest::argv(["echo", "via-path"])).await;
    assert_eq!(stdout(&r), "via-path\n");
    server.put_file_ok(&sb.id, "/work/after.txt", "files still work").await;
    let (status, body) = server.get_file(&sb.id, "/work/after.txt").await;
    assert_eq!((status, body.as_ref()), (StatusCode::OK, b"files still work".as_ref()));
    let (status, _) = server.stat(&sb.id, "/work/after.txt").await;
    assert_eq!(status, StatusCode::OK);
    let r = server.exec_wait(&sb.id, &ExecRequest::argv(["/bin/busybox", "cat", "/tmp/hijacked"])).await;
    assert_ne!(r.exit_code, Some(0), "the platform ran the impostor /bin/sh: {}", stdout(&r));

    // A command the user asked to run through /bin/sh does run the impostor:
    // proof that the check above could have failed.
    let r = server.sh(&sb.id, "echo user-shell").await;
    assert_eq!((r.status, stdout(&r)), (ExecStatus::Ok, "user-shell\n"));
    let r = server.exec_wait(&sb.id, &ExecRequest::argv(["/bin/busybox", "cat", "/tmp/hijacked"])).await;
    assert_eq!(stdout(&r), "ran\n");
    server.finish().await;
}

#[tokio::test]
async fn root_inside_is_not_root_on_the_host() {
    let server = TestServer::start().await;
    let sb = server.create_small().await;
    assert_eq!(server.sh_ok(&sb.id, "id -u").await, "0\n", "the command is root inside");
    let mut stream = server.exec_open(&sb.id, &ExecRequest::argv(["sleep", "12345"])).await;
    let exec_id = stream.exec_id().await;
    let pid = find_instance_process(&server.instance, "sleep 12345", std::time::Duration::from_secs(30)).await;
    let pid1 = sandbox_pid1(&server.instance, &sb.id).expect("the sandbox has a PID 1");
    for (what, pid) in [("the command", pid), ("PID 1", pid1)] {
        for key in ["Uid", "Gid"] {
            let ids = leaks::proc_status_field(pid, key).unwrap_or_else(|| panic!("{key} of {what}"));
            assert!(
                ids.split_whitespace().all(|id| id != "0"),
                "{what} (host pid {pid}) runs with host {key} 0: {ids}"
            );
        }
    }
    server.kill_exec(&sb.id, &exec_id).await;
    assert_eq!(end_result(&stream.collect().await).status, ExecStatus::Killed);
    server.finish().await;
}

#[tokio::test]
async fn host_processes_are_invisible_inside() {
    let server = TestServer::start().await;
    let sb = server.create_small().await;
    let me = std::process::id();
    let r = server.sh(&sb.id, &format!("cat /proc/{me}/cmdline")).await;
    assert!(!stdout(&r).contains("escape"), "the sandbox sees the test process: {}", stdout(&r));
    let ps = server.sh_ok(&sb.id, "ls /proc | grep -c '^[0-9]'").await;
    let count: u32 = ps.trim().parse().unwrap();
    assert!(count < 10, "the sandbox's /proc lists {count} processes: it sees the host's");
    let hostname = server.sh_ok(&sb.id, "hostname").await;
    assert_eq!(hostname.trim(), sb.id, "the sandbox has its own UTS namespace");
    server.finish().await;
}

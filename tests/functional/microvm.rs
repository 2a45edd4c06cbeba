//! The microVM backend (`backend: "microvm"`): QEMU `-M microvm` with the
//! Debian cloud kernel and `warren-init` as the guest's PID 1. The exec
//! cases of `exec.rs` run against one VM per test (a TCG boot takes
//! seconds, so the cases share it), plus what only a VM has: the
//! accelerator in the sandbox's info, and a delete that leaves no QEMU
//! process, disk, socket or cgroup behind. Pause and resume (QMP `stop` /
//! `cont`) are checked inside the guest: a counter read through exec does
//! not move across a pause, and moves again after it. The file cases of `files.rs`
//! run against one VM too: there the guest's init resolves the paths.
//!
//! Needs `qemu-system-x86` and `linux-image-cloud-amd64`
//! (`scripts/setup-host.sh` installs both); without them every test here
//! fails and says so instead of passing.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::json;
use warren_api::{
    EndReason, ErrorCode, ExecFrame, ExecRequest, ExecStatus, FileKind, FileList, FileStat, SandboxInfo, SandboxState,
    StreamName,
};
use warren_tests::guest::{
    count_moves_past, delete_leaves_nothing, guest_count, pause_or_resume, require_qemu_and_kernel, COUNTER,
    PAUSE_WINDOW,
};
use warren_tests::*;

/// Enough for the cloud kernel, the initramfs and busybox.
const GUEST_MEMORY_MIB: u64 = 256;

async fn create_vm(server: &TestServer, extra: serde_json::Value) -> SandboxInfo {
    let mut body = small(json!({"backend": "microvm", "memory_mib": GUEST_MEMORY_MIB}));
    if let (Some(base), serde_json::Value::Object(extra)) = (body.as_object_mut(), extra) {
        base.extend(extra);
    }
    let (status, answer) = server.try_create(&body).await;
    assert_eq!(status.as_u16(), 201, "microvm create failed: {answer}\nlog:\n{}", server.log_tail(30));
    serde_json::from_value(answer).expect("a sandbox info")
}

fn with<F: FnOnce(&mut ExecRequest)>(mut req: ExecRequest, f: F) -> ExecRequest {
    f(&mut req);
    req
}

#[tokio::test]
async fn exec_cases_run_in_a_microvm_as_in_a_container() {
    require_qemu_and_kernel("microvm");
    let server = TestServer::start().await;
    let sb = create_vm(&server, json!({"env": {"FROM_SANDBOX": "s"}})).await;
    assert_eq!(sb.backend, warren_api::Backend::Microvm);
    let accel = sb.accelerator.expect("a microVM reports its accelerator");
    eprintln!("microvm accelerator on this host: {accel:?}");
    assert_eq!(server.get(&sb.id).await.accelerator, Some(accel), "the accelerator stays in the info");

    let r = server.exec_wait(&sb.id, &ExecRequest::argv(["uname", "-r"])).await;
    assert!(stdout(&r).contains("cloud-amd64"), "runs on the guest's kernel, not the host's: {}", stdout(&r));

    // Resources: vCPUs, guest memory, the writable disk's size (`small` asks
    // for 1 CPU and 64 MiB of disk).
    let r = server.sh(&sb.id, "grep -c ^processor /proc/cpuinfo; awk '/MemTotal/ {print $2}' /proc/meminfo; df -k / | awk 'NR==2 {print $2}'").await;
    let numbers: Vec<u64> = stdout(&r).split_whitespace().map(|n| n.parse().expect("a number")).collect();
    let [vcpus, mem_kib, disk_kib] = numbers[..] else { panic!("unexpected output {:?}", stdout(&r)) };
    assert_eq!(vcpus, 1);
    assert!(mem_kib > (GUEST_MEMORY_MIB - 64) * 1024 && mem_kib <= GUEST_MEMORY_MIB * 1024, "MemTotal {mem_kib} KiB");
    assert!(disk_kib > 48 * 1024 && disk_kib <= 64 * 1024, "the writable disk has {disk_kib} KiB");

    // argv and shell forms, the sandbox's environment.
    let r = server.exec_wait(&sb.id, &ExecRequest::argv(["printf", "%s|", "a b", "$HOME", "c"])).await;
    assert_eq!(stdout(&r), "a b|$HOME|c|");
    let r = server.sh(&sb.id, "echo $((6 * 7)) $FROM_SANDBOX $(hostname)").await;
    assert_eq!(stdout(&r), format!("42 s {}\n", sb.id));

    // Exit codes and signals.
    for (cmd, code) in [("exit 0", 0), ("exit 3", 3), ("exit 255", 255)] {
        let r = server.sh(&sb.id, cmd).await;
        assert_eq!((r.status, r.exit_code, r.signal), (ExecStatus::Ok, Some(code), None), "`{cmd}`");
    }
    let r = server.sh(&sb.id, "kill -9 $$").await;
    assert_eq!((r.status, r.exit_code, r.signal), (ExecStatus::Ok, None, Some(9)), "{r:?}");

    // cwd, stdin, separate streams.
    let r = server.exec_wait(&sb.id, &with(ExecRequest::argv(["pwd"]), |r| r.cwd = Some("/tmp".into()))).await;
    assert_eq!(stdout(&r), "/tmp\n");
    let r = server.exec_wait(&sb.id, &with(ExecRequest::argv(["cat"]), |r| r.stdin = Some("line1\nü\n".into()))).await;
    assert_eq!(stdout(&r), "line1\nü\n");
    let r = server.sh(&sb.id, "echo out; echo err >&2; echo out2").await;
    assert_eq!((stdout(&r), stderr(&r)), ("out\nout2\n", "err\n"));

    // Streaming: ordered, contiguous frames.
    let cmd = "i=0; while [ $i -lt 300 ]; do i=$((i+1)); echo out-$i; echo err-$i >&2; done";
    let frames = server.exec_stream(&sb.id, &ExecRequest::shell(cmd)).await;
    assert!(matches!(frames[0], ExecFrame::Started { .. }), "{:?}", frames[0]);
    let want_out: String = (1..=300).map(|i| format!("out-{i}\n")).collect();
    let want_err: String = (1..=300).map(|i| format!("err-{i}\n")).collect();
    assert_eq!(String::from_utf8(frame_bytes(&frames, StreamName::Stdout)).unwrap(), want_out);
    assert_eq!(String::from_utf8(frame_bytes(&frames, StreamName::Stderr)).unwrap(), want_err);

    // A deadline kills the whole tree and keeps the partial output.
    let req =
        with(ExecRequest::argv(["sh", "-c", "sleep 1000 & echo started; sleep 1000"]), |r| r.timeout_secs = Some(2.0));
    let r = server.exec_wait(&sb.id, &req).await;
    assert_eq!((r.status, stdout(&r)), (ExecStatus::TimedOut, "started\n"), "{r:?}");
    assert_no_sleep_left(&server, &sb.id).await;

    // Output caps keep a head and a tail and count everything.
    let total: u64 = 5_000_000;
    let req = with(ExecRequest::shell(format!("yes | head -c {total}")), |r| r.output_cap_bytes = Some(65_536));
    let r = server.exec_wait(&sb.id, &req).await;
    let out = &r.output.as_ref().expect("output").stdout;
    assert_eq!((r.exit_code, out.total_bytes), (Some(0), total), "{r:?}");
    assert_eq!(b64(&out.data_b64).len() as u64 + out.dropped_bytes, total);

    // Kill of a running exec.
    let mut stream = server.exec_open(&sb.id, &ExecRequest::shell("echo first; sleep 1000")).await;
    let exec_id = stream.exec_id().await;
    assert!(matches!(stream.next().await, Some(ExecFrame::Output { offset: 0, .. })));
    let (status, body) = server.kill_exec(&sb.id, &exec_id).await;
    assert_eq!(status.as_u16(), 202, "{body}");
    assert_eq!(end_result(&stream.collect().await).status, ExecStatus::Killed);
    assert_no_sleep_left(&server, &sb.id).await;

    // The guest's OOM killer makes the exec `oom`, as a container's cgroup
    // does (`tail` keeps everything after the last newline; /dev/zero has none).
    let r = server.sh(&sb.id, "head -c 400m /dev/zero | tail").await;
    assert_eq!(r.status, ExecStatus::Oom, "{r:?}");
    assert_eq!(server.sh(&sb.id, "echo alive").await.exit_code, Some(0), "the VM outlives its command's OOM kill");

    // A missing program names the field, as in a container.
    let (status, body) = server.try_exec_wait(&sb.id, &json!({"argv": ["/no/such/program"]})).await;
    assert_api_error(status, &body, ErrorCode::InvalidRequest, Some("argv"));

    delete_leaves_nothing(warren_api::Backend::Microvm, &server, &sb.id).await;
    server.finish().await;
}

#[tokio::test]
async fn sessions_and_events_work_in_a_microvm() {
    require_qemu_and_kernel("microvm");
    let server = TestServer::start().await;
    let sb = create_vm(&server, json!({})).await;
    let session = server.create_session(&sb.id, json!({"cwd": "/"})).await;
    let r = server.session_exec(&sb.id, &session.id, "cd /tmp && export GREETING=hi").await;
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    let r = server.session_exec(&sb.id, &session.id, "echo $PWD $GREETING").await;
    assert_eq!(stdout(&r), "/tmp hi\n", "cwd and exports persist across a session's commands");

    // The guest's seccomp refusals reach the node as security events.
    let r = server.sh(&sb.id, "mkdir -p /mnt && mount -t tmpfs none /mnt; unshare -n true; echo done").await;
    assert_eq!(stdout(&r), "done\n", "{r:?}");
    let (status, list) =
        server.call(reqwest::Method::GET, &format!("/v1/sandboxes/{}/events?after_seq=0", sb.id), None).await;
    assert_eq!(status.as_u16(), 200, "{list}");
    let syscalls: Vec<&str> =
        list["events"].as_array().expect("events").iter().filter_map(|e| e["syscall"].as_str()).collect();
    for wanted in ["mount", "unshare"] {
        assert!(syscalls.contains(&wanted), "no `{wanted}` event in {syscalls:?}");
    }

    delete_leaves_nothing(warren_api::Backend::Microvm, &server, &sb.id).await;
    server.finish().await;
}

const MIB: usize = 1 << 20;

/// The file cases of `files.rs` on one VM: a streamed multi-MiB round trip
/// (and the trajectory's record of it), stat/list/mkdir/remove with their
/// typed errors, modes and ownership, `..` and symlinks that stay inside
/// the guest's root (for reads, writes, mkdir and remove), and a full
/// writable disk that refuses an upload with `no_space` and keeps no
/// staged remains; a file request resumes a paused VM.
#[tokio::test]
async fn file_api_works_in_a_microvm_as_in_a_container() {
    require_qemu_and_kernel("microvm");
    let server = TestServer::start().await;
    let sb = create_vm(&server, json!({})).await;
    let id = sb.id.as_str();

    // Round trip, streamed both ways, bigger than a mux chunk and an upload frame.
    let data = pattern(6 * MIB + 123);
    let (status, body) = server.put_file(id, "/work/blob.bin", chunked_body(&data), None).await;
    assert_eq!(status, StatusCode::OK, "{body}\nlog:\n{}", server.log_tail(30));
    let stat: FileStat = from_json(body);
    assert_eq!((stat.path.as_str(), stat.kind, stat.size_bytes), ("/work/blob.bin", FileKind::File, data.len() as u64));
    let (status, got) = server.get_file(id, "/work/blob.bin").await;
    assert_eq!(status, StatusCode::OK);
    assert!(got.as_ref() == data.as_slice(), "downloaded {} bytes differ from the {} uploaded", got.len(), data.len());
    let inside = server.sh_ok(id, "wc -c < /work/blob.bin; od -An -tx1 -N4 /work/blob.bin").await;
    let want = format!("{}\n{}", data.len(), data[..4].iter().map(|b| format!(" {b:02x}")).collect::<String>());
    assert_eq!(inside.trim_end(), want, "the guest sees the same bytes");
    let (status, log) = server.call(reqwest::Method::GET, &format!("/v1/sandboxes/{id}/trajectory"), None).await;
    assert_eq!(status, StatusCode::OK, "{log}");
    let write =
        log["steps"].as_array().expect("steps").iter().find(|s| s["kind"] == "file_write").expect("a write step");
    assert_eq!(write["request"]["size_bytes"], json!(data.len()), "{write}");
    assert!(write["request"]["sha256"].as_str().is_some_and(|h| h.starts_with("sha256:")), "{write}");

    // stat, list, mkdir, remove and their errors.
    let (status, body) = server.mkdir(id, json!({"path": "/work/a/b", "parents": true})).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(from_json::<FileStat>(body).kind, FileKind::Dir);
    let (status, body) = server.mkdir(id, json!({"path": "/work/a/b"})).await;
    assert_api_error(status, &body, ErrorCode::FileConflict, Some("path"));
    let (status, body) = server.mkdir(id, json!({"path": "/work/missing/child"})).await;
    assert_api_error(status, &body, ErrorCode::FileNotFound, Some("path"));
    server.put_file_ok(id, "/work/a/b/x.txt", "hello").await;
    server.put_file_ok(id, "/work/a/b/y.txt", "longer text").await;
    let (status, body) = server.list_dir(id, "/work/a/b").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let mut entries: Vec<(String, u64)> =
        from_json::<FileList>(body).entries.iter().map(|e| (e.path.clone(), e.size_bytes)).collect();
    entries.sort();
    assert_eq!(entries, vec![("/work/a/b/x.txt".to_string(), 5), ("/work/a/b/y.txt".to_string(), 11)]);
    let (status, body) = server.stat(id, "/work/nope").await;
    assert_api_error(status, &body, ErrorCode::FileNotFound, Some("path"));
    let (status, _) = server.get_file(id, "/work/a").await;
    assert_eq!(status, StatusCode::CONFLICT, "downloading a directory is a conflict");
    let (status, body) = server.list_dir(id, "/work/a/b/x.txt").await;
    assert_api_error(status, &body, ErrorCode::FileConflict, Some("path"));
    let (status, body) = server.remove_file(id, "/work/a/b/x.txt", false).await;
    assert_eq!(status, StatusCode::NO_CONTENT, "{body}");
    let (status, body) = server.remove_file(id, "/work/a", false).await;
    assert_api_error(status, &body, ErrorCode::FileConflict, Some("path"));
    let (status, body) = server.remove_file(id, "/work/a", true).await;
    assert_eq!(status, StatusCode::NO_CONTENT, "{body}");
    assert_eq!(server.sh_ok(id, "ls -A /work").await, "blob.bin\n", "the tree is gone inside too");

    // Modes, and files belong to the guest's root.
    let (status, body) = server.put_file(id, "/work/run.sh", "#!/bin/sh\necho ran-$1\n", Some("755")).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(from_json::<FileStat>(body).mode & 0o7777, 0o755);
    let r = server.exec_wait(id, &ExecRequest::argv(["/work/run.sh", "ok"])).await;
    assert_eq!(stdout(&r), "ran-ok\n", "an uploaded 0755 script runs");
    let (status, body) = server.mkdir(id, json!({"path": "/work/private", "mode": "700"})).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let listing = server.sh_ok(id, "stat -c '%a %u %g %n' /work/run.sh /work/private").await;
    assert_eq!(listing, "755 0 0 /work/run.sh\n700 0 0 /work/private\n");
    let (status, body) = server.put_file(id, "relative.txt", "x", None).await;
    assert_api_error(status, &body, ErrorCode::InvalidRequest, Some("path"));

    // `..` and symlinks resolve inside the guest's root, never above it.
    server
        .sh_ok(id, "ln -s / /evil && ln -s ../../../../ /up && mkdir -p /deep/er && ln -s /etc /deep/er/etc && echo inside > /tmp/t")
        .await;
    for path in [
        "/evil/etc/hostname",
        "/up/up/etc/hostname",
        "/../../../../etc/hostname",
        "/deep/er/../../../etc/hostname",
        "/deep/er/etc/hostname",
    ] {
        let (status, body) = server.get_file(id, path).await;
        assert_eq!(status, StatusCode::OK, "{path}");
        assert_eq!(body.as_ref(), rootfs::SANDBOX_HOSTNAME_FILE.as_bytes(), "{path} is the guest's /etc/hostname");
    }
    let (status, body) = server.put_file(id, "/up/../tmp/via-up.txt", "landed", None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(server.sh_ok(id, "cat /tmp/via-up.txt").await, "landed");
    let (status, body) = server.mkdir(id, json!({"path": "/evil/tmp/made"})).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(from_json::<FileStat>(body).path, "/evil/tmp/made");
    assert_eq!(server.sh_ok(id, "test -d /tmp/made && echo yes").await, "yes\n");
    // Removing a symlink removes the link, not what it points at.
    let (status, body) = server.remove_file(id, "/deep/er/etc", false).await;
    assert_eq!(status, StatusCode::NO_CONTENT, "{body}");
    assert_eq!(server.sh_ok(id, "test -f /etc/hostname && test ! -e /deep/er/etc && echo ok").await, "ok\n");
    let (status, body) = server.stat(id, "/evil").await;
    assert_eq!((status, from_json::<FileStat>(body).kind), (StatusCode::OK, FileKind::Symlink), "stat does not follow");

    // A full writable disk: the upload fails with `no_space`, the old file
    // stays, and no staged remains are left behind.
    server.put_file_ok(id, "/work/keep.txt", "old").await;
    server.sh_ok(id, "rm -f /work/blob.bin; head -c 1000m /dev/zero > /fill 2>/dev/null; sync; true").await;
    let (status, body) = server.put_file(id, "/work/keep.txt", chunked_body(&pattern(4 * MIB)), None).await;
    assert_api_error(status, &body, ErrorCode::NoSpace, None);
    assert_eq!(server.sh_ok(id, "cat /work/keep.txt; ls -A /work").await, "oldkeep.txt\nprivate\nrun.sh\n");
    server.sh_ok(id, "rm /fill").await;
    let (status, body) = server.put_file(id, "/work/keep.txt", chunked_body(&pattern(4 * MIB)), None).await;
    assert_eq!(status, StatusCode::OK, "with space again the upload works: {body}");

    // A file request on a paused VM resumes it, as an exec does.
    pause_or_resume(&server, id, "pause", SandboxState::Paused).await;
    let (status, got) = server.get_file(id, "/work/keep.txt").await;
    assert_eq!((status, got.len()), (StatusCode::OK, 4 * MIB));
    assert_eq!(server.get(id).await.state, SandboxState::Running);

    delete_leaves_nothing(warren_api::Backend::Microvm, &server, id).await;
    server.finish().await;
}

/// One VM for every case (TCG boots are slow): a paused VM's counter does
/// not move (what it counted across a pause window, read just before the
/// pause and just after the resume, is less than what it counts in as
/// long a running window), the liveness probe leaves it paused, it counts
/// again after the resume, an exec resumes it, and a delete while paused
/// leaves no QEMU, disk, socket or cgroup.
#[tokio::test]
async fn paused_microvm_makes_no_progress_and_the_next_exec_resumes_it() {
    require_qemu_and_kernel("microvm");
    let server = TestServer::start().await;
    let sb = create_vm(&server, json!({})).await;
    let _counter = server.exec_open(&sb.id, &ExecRequest::shell(COUNTER)).await;
    let started = count_moves_past(&server, &sb.id, 0).await;

    let before_run = count_moves_past(&server, &sb.id, started).await;
    tokio::time::sleep(PAUSE_WINDOW).await;
    let ran = guest_count(&server, &sb.id).await - before_run;

    let before_pause = guest_count(&server, &sb.id).await;
    pause_or_resume(&server, &sb.id, "pause", SandboxState::Paused).await;
    tokio::time::sleep(PAUSE_WINDOW).await;
    let info = server.get(&sb.id).await;
    assert_eq!(info.state, SandboxState::Paused, "neither GET nor the probe ends the pause: {info:?}");
    pause_or_resume(&server, &sb.id, "pause", SandboxState::Paused).await;
    pause_or_resume(&server, &sb.id, "resume", SandboxState::Running).await;
    let after_resume = guest_count(&server, &sb.id).await;
    let across_pause = after_resume - before_pause;
    eprintln!("counted {ran} in a running window, {across_pause} across a paused one");
    assert!(across_pause < ran, "the counter advanced while paused: {across_pause} across the pause, {ran} running");
    count_moves_past(&server, &sb.id, after_resume).await;

    // An exec on a paused VM resumes it, and the counter moves on.
    pause_or_resume(&server, &sb.id, "pause", SandboxState::Paused).await;
    assert_eq!(server.sh_ok(&sb.id, "echo awake").await, "awake\n");
    assert_eq!(server.get(&sb.id).await.state, SandboxState::Running);
    let awake = guest_count(&server, &sb.id).await;
    count_moves_past(&server, &sb.id, awake).await;

    pause_or_resume(&server, &sb.id, "pause", SandboxState::Paused).await;
    delete_leaves_nothing(warren_api::Backend::Microvm, &server, &sb.id).await;
    server.finish().await;
}

/// microVMs are not re-adopted: a paused one ends `node_restarted` on a
/// restart like a running one, and its QEMU does not outlive the sweep.
#[tokio::test]
async fn paused_microvm_ends_node_restarted_on_a_restart_and_leaves_no_qemu() {
    require_qemu_and_kernel("microvm");
    let mut server = TestServer::start().await;
    let sb = create_vm(&server, json!({})).await;
    pause_or_resume(&server, &sb.id, "pause", SandboxState::Paused).await;
    let vm_instance = leaks::vm_instance(&server.instance);
    assert!(!leaks::instance_processes(&vm_instance).is_empty(), "QEMU runs paused");

    server.restart().await;

    let info = server.get(&sb.id).await;
    assert_eq!((info.state, info.end_reason), (SandboxState::Ended, Some(EndReason::NodeRestarted)), "{info:?}");
    assert_eq!(leaks::instance_processes(&vm_instance), vec![], "the paused VM's QEMU survives the restart");
    assert!(leaks::vm_run_entries(&server.data_dir()).is_empty(), "the paused VM's run directory survives");
    server.finish().await;
}

/// Bounded: no `sleep` left in the guest.
async fn assert_no_sleep_left(server: &TestServer, id: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let ps = server.exec_wait(id, &ExecRequest::argv(["ps", "-o", "pid,args"])).await;
        let left: Vec<&str> = stdout(&ps).lines().filter(|l| l.contains("sleep")).collect();
        if left.is_empty() {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "sleeps survive in the guest: {left:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

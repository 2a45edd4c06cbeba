//! The full-VM backend (`backend: "vm"`): QEMU `q35` with the Debian
//! cloud kernel, the image's systemd as PID 1 and `warren-init` as one of
//! its services. A TCG boot of systemd takes tens of seconds, so one VM
//! carries every case: what only a full OS gives (`systemctl` starts a
//! shipped unit and a transient one, and says they are active), the exec
//! cases of `microvm.rs` (argv, shell, exit codes, streaming, deadline
//! kill, kill, `oom`), a session, the guest's seccomp events, the file API round
//! trip and its escapes, pause/resume (a paused guest's counter does not
//! move; the next exec resumes it), and a delete that leaves no QEMU,
//! cgroup or file behind. An image without systemd is refused before any
//! boot.
//!
//! The image: Debian bookworm minbase plus `systemd-sysv` and `procps`,
//! built once by `scripts/make-default-image.sh` (with
//! `WARREN_IMAGE_PACKAGES`) into [`SYSTEMD_ROOTFS`] and cached there
//! (about 50 s and 155 MB; the default image stays without systemd).
//!
//! Needs `qemu-system-x86` and `linux-image-cloud-amd64`
//! (`scripts/setup-host.sh` installs both) and `debootstrap` with the
//! host's Debian mirror; without them every test here fails and says so.

use std::path::Path;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::json;
use warren_api::{
    ErrorCode, ExecFrame, ExecRequest, ExecStatus, FileKind, FileList, FileStat, SandboxInfo, SandboxState, StreamName,
};
use warren_tests::guest::{
    count_moves_past, delete_leaves_nothing, guest_count, pause_or_resume, require_qemu_and_kernel, COUNTER,
    PAUSE_WINDOW,
};
use warren_tests::*;

const SYSTEMD_ROOTFS: &str = "/var/cache/warren/vm-systemd-rootfs";
const SYSTEMD_PACKAGES: &str = "systemd-sysv,procps";
const IMAGE_NAME: &str = "systemd";
/// The cloud kernel, systemd and journald with room to spare.
const GUEST_MEMORY_MIB: u64 = 512;
const MIB: usize = 1 << 20;

/// Builds the systemd image once (the script caches it and takes a lock).
fn systemd_rootfs() -> &'static Path {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/make-default-image.sh");
    let out = std::process::Command::new("sh")
        .arg(&script)
        .arg(SYSTEMD_ROOTFS)
        .env("WARREN_IMAGE_PACKAGES", SYSTEMD_PACKAGES)
        .output()
        .expect("run make-default-image.sh");
    assert!(
        out.status.success(),
        "building the systemd image failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Path::new(SYSTEMD_ROOTFS)
}

async fn import_systemd_image(server: &TestServer) {
    let rootfs = systemd_rootfs();
    let (status, body) =
        server.call(reqwest::Method::POST, "/v1/images", Some(&json!({"name": IMAGE_NAME, "dir": rootfs}))).await;
    assert_eq!(status, StatusCode::CREATED, "importing the systemd image: {body}");
}

async fn create_vm(server: &TestServer) -> SandboxInfo {
    let body = small(json!({"backend": "vm", "image": IMAGE_NAME, "memory_mib": GUEST_MEMORY_MIB, "disk_mib": 128,
        "env": {"FROM_SANDBOX": "s"}}));
    let started = Instant::now();
    let (status, answer) = server.try_create(&body).await;
    assert_eq!(status.as_u16(), 201, "vm create failed: {answer}\nlog:\n{}", server.log_tail(30));
    eprintln!("full VM: create (TCG boot to the agent's first answer) took {:?}", started.elapsed());
    serde_json::from_value(answer).expect("a sandbox info")
}

fn with<F: FnOnce(&mut ExecRequest)>(mut req: ExecRequest, f: F) -> ExecRequest {
    f(&mut req);
    req
}

/// No boot: the busybox test image has no systemd, so the driver refuses it
/// with the typed `unsupported` error naming what is missing.
#[tokio::test]
async fn vm_refuses_an_image_without_systemd() {
    require_qemu_and_kernel("vm");
    let server = TestServer::start().await;
    let (status, body) = server.try_create(&small(json!({"backend": "vm", "memory_mib": 256}))).await;
    assert_api_error(status, &body, ErrorCode::Unsupported, None);
    assert!(body["message"].as_str().is_some_and(|m| m.contains("systemd")), "{body}");
    server.finish().await;
}

/// One boot for everything (see the module doc).
#[tokio::test]
async fn a_full_vm_runs_systemd_and_behaves_like_every_sandbox() {
    require_qemu_and_kernel("vm");
    let server = TestServer::start().await;
    import_systemd_image(&server).await;
    let sb = create_vm(&server).await;
    let id = sb.id.as_str();
    assert_eq!(sb.backend, warren_api::Backend::Vm);
    let accel = sb.accelerator.expect("a full VM reports its accelerator");
    eprintln!("vm accelerator on this host: {accel:?}");
    assert_eq!(server.get(id).await.accelerator, Some(accel), "the accelerator stays in the info");

    whole_os_cases(&server, id).await;
    exec_cases(&server, id).await;
    session_and_event_cases(&server, id).await;
    file_cases(&server, id).await;
    pause_cases(&server, id).await;
    delete_leaves_nothing(warren_api::Backend::Vm, &server, id).await;
    server.finish().await;
}

/// What only a full OS gives: systemd is PID 1 and starts units on request.
async fn whole_os_cases(server: &TestServer, id: &str) {
    assert_eq!(server.sh_ok(id, "cat /proc/1/comm").await, "systemd\n", "systemd is the guest's PID 1");
    // The agent starts after `basic.target`; the rest of the boot finishes
    // with nothing failed.
    let r = server.sh(id, "systemctl is-system-running --wait; systemctl --failed --no-legend").await;
    assert_eq!(stdout(&r), "running\n", "{r:?}");
    // The sandbox's hostname, and a machine id of this VM's own (not the image's).
    let names = server.sh_ok(id, "cat /proc/sys/kernel/hostname /etc/machine-id").await;
    let image_id = std::fs::read_to_string(Path::new(SYSTEMD_ROOTFS).join("etc/machine-id")).unwrap_or_default();
    let lines: Vec<&str> = names.lines().collect();
    assert_eq!(lines.first(), Some(&id), "{names}");
    let machine_id = lines.get(1).copied().unwrap_or_default();
    assert!(
        machine_id.len() == 32 && machine_id != image_id.trim(),
        "machine id {machine_id:?} (image's {image_id:?})"
    );
    let r = server.exec_wait(id, &ExecRequest::argv(["uname", "-r"])).await;
    assert!(stdout(&r).contains("cloud-amd64"), "runs on the guest's kernel: {}", stdout(&r));

    // Resources: vCPUs, guest memory, the writable disk's size.
    let r = server
        .sh(id, "grep -c ^processor /proc/cpuinfo; awk '/MemTotal/ {print $2}' /proc/meminfo; df -k / | awk 'NR==2 {print $2}'")
        .await;
    let numbers: Vec<u64> = stdout(&r).split_whitespace().map(|n| n.parse().expect("a number")).collect();
    let [vcpus, mem_kib, disk_kib] = numbers[..] else { panic!("unexpected output {:?}", stdout(&r)) };
    assert_eq!(vcpus, 1);
    assert!(mem_kib > (GUEST_MEMORY_MIB - 96) * 1024 && mem_kib <= GUEST_MEMORY_MIB * 1024, "MemTotal {mem_kib} KiB");
    assert!(disk_kib > 96 * 1024 && disk_kib <= 128 * 1024, "the writable disk has {disk_kib} KiB");

    // A shipped unit, uploaded through the file API, started by systemctl.
    let unit = "[Unit]\nDescription=warren test\n[Service]\nExecStart=/bin/sleep 100000\n";
    server.put_file_ok(id, "/etc/systemd/system/warren-hello.service", unit).await;
    server.sh_ok(id, "systemctl daemon-reload && systemctl start warren-hello.service").await;
    assert_eq!(server.sh_ok(id, "systemctl is-active warren-hello.service").await, "active\n");
    let main_pid = server.sh_ok(id, "systemctl show -p MainPID --value warren-hello.service").await;
    let comm = server.sh_ok(id, &format!("cat /proc/{}/comm", main_pid.trim())).await;
    assert_eq!(comm, "sleep\n", "the unit's process runs");
    server.sh_ok(id, "systemctl stop warren-hello.service").await;
    let r = server.sh(id, "systemctl is-active warren-hello.service").await;
    assert_eq!((stdout(&r), r.exit_code), ("inactive\n", Some(3)), "{r:?}");

    // A transient unit.
    server.sh_ok(id, "systemd-run --unit=warren-transient /bin/sleep 100000").await;
    assert_eq!(server.sh_ok(id, "systemctl is-active warren-transient.service").await, "active\n");
    server.sh_ok(id, "systemctl stop warren-transient.service").await;
}

async fn exec_cases(server: &TestServer, id: &str) {
    // argv and shell forms, the sandbox's environment and hostname.
    let r = server.exec_wait(id, &ExecRequest::argv(["printf", "%s|", "a b", "$HOME", "c"])).await;
    assert_eq!(stdout(&r), "a b|$HOME|c|");
    let r = server.sh(id, "echo $((6 * 7)) $FROM_SANDBOX $(hostname)").await;
    assert_eq!(stdout(&r), format!("42 s {id}\n"));

    // Exit codes and signals.
    for (cmd, code) in [("exit 0", 0), ("exit 3", 3), ("exit 255", 255)] {
        let r = server.sh(id, cmd).await;
        assert_eq!((r.status, r.exit_code, r.signal), (ExecStatus::Ok, Some(code), None), "`{cmd}`");
    }
    let r = server.sh(id, "kill -9 $$").await;
    assert_eq!((r.status, r.exit_code, r.signal), (ExecStatus::Ok, None, Some(9)), "{r:?}");

    // cwd, stdin, separate streams.
    let r = server.exec_wait(id, &with(ExecRequest::argv(["pwd"]), |r| r.cwd = Some("/tmp".into()))).await;
    assert_eq!(stdout(&r), "/tmp\n");
    let r = server.exec_wait(id, &with(ExecRequest::argv(["cat"]), |r| r.stdin = Some("line1\nü\n".into()))).await;
    assert_eq!(stdout(&r), "line1\nü\n");
    let r = server.sh(id, "echo out; echo err >&2; echo out2").await;
    assert_eq!((stdout(&r), stderr(&r)), ("out\nout2\n", "err\n"));

    // Streaming: ordered, contiguous frames.
    let cmd = "i=0; while [ $i -lt 200 ]; do i=$((i+1)); echo out-$i; echo err-$i >&2; done";
    let frames = server.exec_stream(id, &ExecRequest::shell(cmd)).await;
    assert!(matches!(frames[0], ExecFrame::Started { .. }), "{:?}", frames[0]);
    let want_out: String = (1..=200).map(|i| format!("out-{i}\n")).collect();
    let want_err: String = (1..=200).map(|i| format!("err-{i}\n")).collect();
    assert_eq!(String::from_utf8(frame_bytes(&frames, StreamName::Stdout)).unwrap(), want_out);
    assert_eq!(String::from_utf8(frame_bytes(&frames, StreamName::Stderr)).unwrap(), want_err);

    // A deadline kills the whole tree and keeps the partial output.
    let req =
        with(ExecRequest::argv(["sh", "-c", "sleep 1000 & echo started; sleep 1000"]), |r| r.timeout_secs = Some(2.0));
    let r = server.exec_wait(id, &req).await;
    assert_eq!((r.status, stdout(&r)), (ExecStatus::TimedOut, "started\n"), "{r:?}");
    assert_no_sleep_left(server, id).await;

    // Kill of a running exec.
    let mut stream = server.exec_open(id, &ExecRequest::shell("echo first; sleep 1000")).await;
    let exec_id = stream.exec_id().await;
    assert!(matches!(stream.next().await, Some(ExecFrame::Output { offset: 0, .. })));
    let (status, body) = server.kill_exec(id, &exec_id).await;
    assert_eq!(status.as_u16(), 202, "{body}");
    assert_eq!(end_result(&stream.collect().await).status, ExecStatus::Killed);
    assert_no_sleep_left(server, id).await;

    // The guest's OOM killer makes the exec `oom`, and neither the agent nor
    // the VM goes with it (systemd would stop the agent's whole unit by default).
    let r = server.sh(id, "head -c 900m /dev/zero | tail").await;
    assert_eq!(r.status, ExecStatus::Oom, "{r:?}");
    assert_eq!(server.sh_ok(id, "echo alive").await, "alive\n", "the VM outlives its command's OOM kill");

    // A missing program names the field, as in a container.
    let (status, body) = server.try_exec_wait(id, &json!({"argv": ["/no/such/program"]})).await;
    assert_api_error(status, &body, ErrorCode::InvalidRequest, Some("argv"));
}

async fn session_and_event_cases(server: &TestServer, id: &str) {
    let session = server.create_session(id, json!({"cwd": "/"})).await;
    let r = server.session_exec(id, &session.id, "cd /tmp && export GREETING=hi").await;
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    let r = server.session_exec(id, &session.id, "echo $PWD $GREETING").await;
    assert_eq!(stdout(&r), "/tmp hi\n", "cwd and exports persist across a session's commands");

    // The agent's seccomp profile covers what it runs: refusals become events.
    let r = server.sh(id, "mkdir -p /mnt/x && mount -t tmpfs none /mnt/x; unshare -n true; echo done").await;
    assert_eq!(stdout(&r), "done\n", "{r:?}");
    let (status, list) =
        server.call(reqwest::Method::GET, &format!("/v1/sandboxes/{id}/events?after_seq=0"), None).await;
    assert_eq!(status.as_u16(), 200, "{list}");
    let syscalls: Vec<&str> =
        list["events"].as_array().expect("events").iter().filter_map(|e| e["syscall"].as_str()).collect();
    for wanted in ["mount", "unshare"] {
        assert!(syscalls.contains(&wanted), "no `{wanted}` event in {syscalls:?}");
    }
}

async fn file_cases(server: &TestServer, id: &str) {
    // The Debian image has no /work: made through the API.
    let (status, body) = server.mkdir(id, json!({"path": "/work"})).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    // Round trip, streamed both ways, bigger than a mux chunk.
    let data = pattern(3 * MIB + 123);
    let (status, body) = server.put_file(id, "/work/blob.bin", chunked_body(&data), None).await;
    assert_eq!(status, StatusCode::OK, "{body}\nlog:\n{}", server.log_tail(30));
    let stat: FileStat = from_json(body);
    assert_eq!((stat.path.as_str(), stat.kind, stat.size_bytes), ("/work/blob.bin", FileKind::File, data.len() as u64));
    let (status, got) = server.get_file(id, "/work/blob.bin").await;
    assert_eq!(status, StatusCode::OK);
    assert!(got.as_ref() == data.as_slice(), "downloaded {} bytes differ from the {} uploaded", got.len(), data.len());
    assert_eq!(server.sh_ok(id, "wc -c < /work/blob.bin").await.trim(), data.len().to_string());

    // stat, list, mkdir, remove and their errors.
    let (status, body) = server.mkdir(id, json!({"path": "/work/a/b", "parents": true})).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let (status, body) = server.mkdir(id, json!({"path": "/work/a/b"})).await;
    assert_api_error(status, &body, ErrorCode::FileConflict, Some("path"));
    server.put_file_ok(id, "/work/a/b/x.txt", "hello").await;
    let (status, body) = server.list_dir(id, "/work/a/b").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let entries: Vec<(String, u64)> =
        from_json::<FileList>(body).entries.iter().map(|e| (e.path.clone(), e.size_bytes)).collect();
    assert_eq!(entries, vec![("/work/a/b/x.txt".to_string(), 5)]);
    let (status, body) = server.stat(id, "/work/nope").await;
    assert_api_error(status, &body, ErrorCode::FileNotFound, Some("path"));
    let (status, body) = server.remove_file(id, "/work/a", true).await;
    assert_eq!(status, StatusCode::NO_CONTENT, "{body}");
    assert_eq!(server.sh_ok(id, "ls -A /work").await, "blob.bin\n", "the tree is gone inside too");

    // `..` and symlinks resolve inside the guest's root.
    server.sh_ok(id, "ln -s / /evil && ln -s ../../../../ /up && echo inside > /tmp/t").await;
    for path in ["/evil/tmp/t", "/up/up/tmp/t", "/../../../../tmp/t"] {
        let (status, body) = server.get_file(id, path).await;
        assert_eq!((status, body.as_ref()), (StatusCode::OK, b"inside\n".as_slice()), "{path}");
    }
}

/// A paused guest's counter moves less across a pause window than in as
/// long a running one; the probe leaves it paused; an exec resumes it.
async fn pause_cases(server: &TestServer, id: &str) {
    let counter = server.exec_open(id, &ExecRequest::shell(COUNTER)).await;
    let started = count_moves_past(server, id, 0).await;
    let before_run = count_moves_past(server, id, started).await;
    tokio::time::sleep(PAUSE_WINDOW).await;
    let ran = guest_count(server, id).await - before_run;

    let before_pause = guest_count(server, id).await;
    pause_or_resume(server, id, "pause", SandboxState::Paused).await;
    tokio::time::sleep(PAUSE_WINDOW).await;
    assert_eq!(server.get(id).await.state, SandboxState::Paused, "neither GET nor the probe ends the pause");
    pause_or_resume(server, id, "resume", SandboxState::Running).await;
    let across_pause = guest_count(server, id).await - before_pause;
    eprintln!("counted {ran} in a running window, {across_pause} across a paused one");
    assert!(across_pause < ran, "the counter advanced while paused: {across_pause} across the pause, {ran} running");

    pause_or_resume(server, id, "pause", SandboxState::Paused).await;
    assert_eq!(server.sh_ok(id, "echo awake").await, "awake\n", "an exec resumes a paused VM");
    assert_eq!(server.get(id).await.state, SandboxState::Running);
    let awake = guest_count(server, id).await;
    count_moves_past(server, id, awake).await;
    drop(counter);
}

/// Bounded: no `sleep` left in the agent's process tree (the guest's own
/// units are systemd's and not part of any exec).
async fn assert_no_sleep_left(server: &TestServer, id: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let ps = server.exec_wait(id, &ExecRequest::argv(["ps", "-eo", "pid,args"])).await;
        let left: Vec<&str> =
            stdout(&ps).lines().filter(|l| l.contains("sleep 1000") && !l.contains("100000")).collect();
        if left.is_empty() {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "sleeps survive in the guest: {left:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

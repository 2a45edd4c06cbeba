//! The microVM backend (`backend: "microvm"`): QEMU `-M microvm` with the
//! Debian cloud kernel and `warren-init` as the guest's PID 1. The exec
//! cases of `exec.rs` run against one VM per test (a TCG boot takes
//! seconds, so the cases share it), plus what only a VM has: the
//! accelerator in the sandbox's info, and a delete that leaves no QEMU
//! process, disk, socket or cgroup behind.
//!
//! Needs `qemu-system-x86` and `linux-image-cloud-amd64`
//! (`scripts/setup-host.sh` installs both); without them every test here
//! fails and says so instead of passing.

use std::path::Path;
use std::time::Duration;

use serde_json::json;
use warren_api::{ErrorCode, ExecFrame, ExecRequest, ExecStatus, SandboxInfo, StreamName};
use warren_tests::*;

/// Enough for the cloud kernel, the initramfs and busybox.
const GUEST_MEMORY_MIB: u64 = 256;

fn require_qemu_and_kernel() {
    let qemu = Path::new("/usr/bin/qemu-system-x86_64").is_file();
    let kernel = std::fs::read_dir("/boot").is_ok_and(|d| {
        d.flatten()
            .any(|e| e.file_name().to_str().is_some_and(|n| n.starts_with("vmlinuz-") && n.ends_with("-cloud-amd64")))
    });
    assert!(
        qemu && kernel,
        "the microvm tests need qemu-system-x86 (found: {qemu}) and a Debian cloud kernel in /boot (found: {kernel}); \
         run scripts/setup-host.sh"
    );
}

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
    require_qemu_and_kernel();
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

    delete_leaves_nothing(&server, &sb.id).await;
    server.finish().await;
}

#[tokio::test]
async fn sessions_and_events_work_and_files_answer_unsupported_in_a_microvm() {
    require_qemu_and_kernel();
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

    let (status, body) = server.put_file(&sb.id, "/tmp/x", "x", None).await;
    assert_api_error(status, &body, ErrorCode::Unsupported, None);

    delete_leaves_nothing(&server, &sb.id).await;
    server.finish().await;
}

/// Deletes the sandbox and checks the host: no QEMU process in the VM
/// driver's cgroups, no sandbox cgroup, no run directory (disk, sockets).
async fn delete_leaves_nothing(server: &TestServer, id: &str) {
    let vm_instance = leaks::vm_instance(&server.instance);
    let run_dir = server.data_dir().join("vm").join(id);
    assert!(run_dir.join("rw.img").is_file(), "a live microVM has its writable disk");
    assert!(!leaks::instance_processes(&vm_instance).is_empty(), "QEMU runs in the VM driver's cgroup");
    let ended = server.delete(id).await;
    assert_eq!(ended.end_reason, Some(warren_api::EndReason::Deleted));
    assert!(!run_dir.exists(), "{} survives the delete", run_dir.display());
    assert_eq!(leaks::instance_processes(&vm_instance), vec![], "QEMU survives the delete");
    let cgroups: Vec<_> =
        leaks::sandbox_cgroup_dirs(&server.instance).into_iter().filter(|d| d.ends_with(id)).collect();
    assert_eq!(cgroups, Vec::<std::path::PathBuf>::new(), "the sandbox's cgroups survive the delete");
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

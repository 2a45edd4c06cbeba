//! The microVM backend (`backend: "microvm"`): QEMU `-M microvm` with the
//! Debian cloud kernel and `warren-init` as the guest's PID 1. What every
//! backend does (exec, limits, sessions, events, pause, end reasons) is the
//! parity suite's (`parity.rs`); here is what only a VM has - the
//! accelerator, the guest's kernel and resources, a delete that leaves no
//! QEMU process, disk, socket or cgroup, re-adoption after a restart -
//! the file API in depth (the guest's init resolves the paths), snapshot
//! boot, pools of booted VMs and pauses to disk.
//!
//! Needs `qemu-system-x86` and `linux-image-cloud-amd64`
//! (`scripts/setup-host.sh` installs both); without them every test here
//! fails and says so instead of passing.

use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde_json::json;
use warren_api::{ErrorCode, ExecRequest, FileKind, FileList, FileStat, SandboxInfo, SandboxState, VmBoot};
use warren_tests::guest::{self, delete_leaves_nothing, pause_or_resume, require_qemu_and_kernel};
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

#[tokio::test]
async fn a_microvm_reports_its_accelerator_and_runs_its_own_kernel_and_resources() {
    require_qemu_and_kernel("microvm");
    let server = TestServer::start().await;
    let sb = create_vm(&server, json!({})).await;
    assert_eq!(sb.backend, warren_api::Backend::Microvm);
    let accel = sb.accelerator.expect("a microVM reports its accelerator");
    eprintln!("microvm accelerator on this host: {accel:?}");
    assert_eq!(server.get(&sb.id).await.accelerator, Some(accel), "the accelerator stays in the info");
    assert_eq!(sb.boot, Some(VmBoot::Cold), "without --vm-snapshots every microVM boots");
    guest_facts(&server, &sb).await;
    delete_leaves_nothing(warren_api::Backend::Microvm, &server, &sb.id).await;
    server.finish().await;
}

/// A microVM whose DELETE's client hangs up midway is torn down all the
/// same: it ends `deleted` with no QEMU, disk, socket or cgroup left (its
/// teardown awaits QEMU's exit, and a dropped call used to stop there).
/// Rounds repeat until a close lands while the delete runs (the node
/// counts the call as abandoned); one that lands before the call starts
/// leaves the VM running, and it is deleted the ordinary way.
#[tokio::test]
async fn a_microvm_whose_delete_is_abandoned_is_torn_down_all_the_same() {
    require_qemu_and_kernel("microvm");
    let server = TestServer::start().await;
    let mut round = 0;
    while server.abandoned_calls("delete").await == 0.0 {
        round += 1;
        assert!(round <= 5, "in 5 rounds no close landed while the delete ran");
        let sb = create_vm(&server, json!({})).await;
        guest::assert_vm_lives(warren_api::Backend::Microvm, &server, &sb.id);
        server.abandon(Method::DELETE, &format!("/v1/sandboxes/{}", sb.id), None).await;
        let info = server.poll_ended(&sb.id, Duration::from_secs(10)).await;
        if info.state != SandboxState::Ended {
            assert_eq!(
                server.abandoned_calls("delete").await,
                0.0,
                "round {round}: the abandoned delete left {info:?}"
            );
            delete_leaves_nothing(warren_api::Backend::Microvm, &server, &sb.id).await;
            continue;
        }
        assert_eq!(info.end_reason, Some(warren_api::EndReason::Deleted), "round {round}: {info:?}");
        guest::wait_vm_gone(warren_api::Backend::Microvm, &server, &sb.id, Duration::from_secs(10)).await;
    }
    server.finish().await;
}

/// The guest's own kernel, and the sandbox's resources as the guest sees
/// them: vCPUs, memory, the writable disk's size (`small` asks for 1 CPU
/// and 64 MiB of disk).
async fn guest_facts(server: &TestServer, sb: &SandboxInfo) {
    let r = server.exec_wait(&sb.id, &ExecRequest::argv(["uname", "-r"])).await;
    assert!(stdout(&r).contains("cloud-amd64"), "runs on the guest's kernel, not the host's: {}", stdout(&r));
    let r = server.sh(&sb.id, "grep -c ^processor /proc/cpuinfo; awk '/MemTotal/ {print $2}' /proc/meminfo; df -k / | awk 'NR==2 {print $2}'").await;
    let numbers: Vec<u64> = stdout(&r).split_whitespace().map(|n| n.parse().expect("a number")).collect();
    let [vcpus, mem_kib, disk_kib] = numbers[..] else { panic!("unexpected output {:?}", stdout(&r)) };
    assert_eq!(vcpus, 1);
    assert!(mem_kib > (GUEST_MEMORY_MIB - 64) * 1024 && mem_kib <= GUEST_MEMORY_MIB * 1024, "MemTotal {mem_kib} KiB");
    assert!(disk_kib > 48 * 1024 && disk_kib <= 64 * 1024, "the writable disk has {disk_kib} KiB");
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
    file_cases(&server, &sb.id).await;
    delete_leaves_nothing(warren_api::Backend::Microvm, &server, &sb.id).await;
    server.finish().await;
}

/// The file cases of `files.rs` against the VM `id`.
async fn file_cases(server: &TestServer, id: &str) {
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
    // In megabyte writes: busybox's `head -c` copies a byte at a time,
    // which under TCG took two minutes for this disk.
    server.sh_ok(id, "rm -f /work/blob.bin; dd if=/dev/zero of=/fill bs=1M 2>/dev/null; sync; true").await;
    let (status, body) = server.put_file(id, "/work/keep.txt", chunked_body(&pattern(4 * MIB)), None).await;
    assert_api_error(status, &body, ErrorCode::NoSpace, None);
    assert_eq!(server.sh_ok(id, "cat /work/keep.txt; ls -A /work").await, "oldkeep.txt\nprivate\nrun.sh\n");
    server.sh_ok(id, "rm /fill").await;
    let (status, body) = server.put_file(id, "/work/keep.txt", chunked_body(&pattern(4 * MIB)), None).await;
    assert_eq!(status, StatusCode::OK, "with space again the upload works: {body}");

    // A file request on a paused VM resumes it, as an exec does.
    pause_or_resume(server, id, "pause", SandboxState::Paused).await;
    let (status, got) = server.get_file(id, "/work/keep.txt").await;
    assert_eq!((status, got.len()), (StatusCode::OK, 4 * MIB));
    assert_eq!(server.get(id).await.state, SandboxState::Running);
}

/// A restarted node adopts its microVMs: after a SIGKILL of the server the
/// guest runs on in the same QEMU and the next server serves it - the
/// file API, a session's state and a detached process survive. An exec
/// that flooded the port when the node died is recorded killed and its
/// process is gone; the new node reads past what the guest still wrote
/// for the old one (frames cut mid-way included) before it serves. One
/// whose QEMU died while no server ran ends `node_restarted`.
#[tokio::test]
async fn a_running_microvm_is_readopted_after_a_crash() {
    require_qemu_and_kernel("microvm");
    let mut server = TestServer::start().await;
    let sb = create_vm(&server, json!({})).await;
    let id = sb.id.as_str();
    let vm_instance = leaks::vm_instance(&server.instance);
    server.put_file_ok(id, "/work/keep.txt", "survives").await;
    let session = server.create_session(id, json!({})).await;
    server.session_exec(id, &session.id, "cd /tmp && export KEPT=yes").await;
    let sleeper = server.sh_ok(id, "setsid sleep 100000 </dev/null >/dev/null 2>&1 & echo $!").await;
    let alive = format!("kill -0 {} && echo alive", sleeper.trim());
    let qemu = leaks::instance_processes(&vm_instance);
    assert_eq!(qemu.len(), 1, "one QEMU: {qemu:?}");
    let flood = ExecRequest::argv(["sh", "-c", "while :; do echo flooding-the-port-with-output; done"]);
    let mut stream = server.exec_open(id, &flood).await;
    let exec_id = stream.exec_id().await;
    assert!(stream.next().await.is_some(), "the flood streams");

    server.restart().await;
    drop(stream);

    let info = server.get(id).await;
    assert_eq!(info.state, SandboxState::Running, "{info:?}\nlog:\n{}", server.log_tail(30));
    assert_eq!(leaks::instance_processes(&vm_instance), qemu, "the same QEMU carries on");
    assert_eq!(server.get_exec(id, &exec_id).await.status, warren_api::ExecStatus::Killed);
    let ps = server.sh_ok(id, "ps -o args").await;
    assert!(!ps.contains("flooding"), "the exec reported killed still runs:\n{ps}");
    assert_eq!(server.sh_ok(id, &alive).await, "alive\n", "the detached process outlives the node");
    let (status, body) = server.get_file(id, "/work/keep.txt").await;
    assert_eq!((status, body.as_ref()), (StatusCode::OK, b"survives".as_ref()));
    let r = server.session_exec(id, &session.id, "echo \"$PWD $KEPT\"").await;
    assert_eq!(stdout(&r), "/tmp yes\n", "the session's state survived the restart");
    pause_or_resume(&server, id, "pause", SandboxState::Paused).await;
    pause_or_resume(&server, id, "resume", SandboxState::Running).await;
    assert_eq!(server.sh_ok(id, "cat /work/keep.txt").await, "survives");

    // A second restart finds the stream ids moved on again.
    server.restart().await;
    assert_eq!(server.sh_ok(id, &alive).await, "alive\n");
    assert_eq!(leaks::instance_processes(&vm_instance), qemu);

    // A VM whose QEMU died while no server ran ends `node_restarted`, and
    // nothing of it is left (`finish` checks the run directory and cgroups).
    server.crash().await;
    let (pid, _) = qemu[0];
    // SAFETY: kill(2) of the QEMU this test's server started, by pid.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0, "kill QEMU {pid}");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !leaks::instance_processes(&vm_instance).is_empty() {
        assert!(std::time::Instant::now() < deadline, "QEMU {pid} outlives SIGKILL");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    server.launch().await;
    let info = server.get(id).await;
    assert_eq!((info.state, info.end_reason), (SandboxState::Ended, Some(warren_api::EndReason::NodeRestarted)));
    server.finish().await;
}

/// Sizes beyond the host: guest memory QEMU could not allocate is a 400
/// naming `memory_mib` (not a failed boot), and more CPUs than the host has
/// make as many vCPUs as it has (64 TCG vCPUs on a small host would not
/// boot within the create deadline).
#[tokio::test]
async fn vm_sizes_beyond_the_host_are_refused_or_fitted() {
    require_qemu_and_kernel("microvm");
    let server = TestServer::start().await;
    let huge = small(json!({"backend": "microvm", "memory_mib": 1_048_576}));
    let (status, body) = server.try_create(&huge).await;
    assert_api_error(status, &body, ErrorCode::InvalidRequest, Some("memory_mib"));
    let host_cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let sb = create_vm(&server, json!({"cpus": 64.0})).await;
    let seen = server.sh_ok(&sb.id, "grep -c ^processor /proc/cpuinfo").await;
    assert_eq!(seen.trim(), host_cpus.min(64).to_string(), "vCPUs");
    server.finish().await;
}

/// Root in a guest is held to a container's privileges: the control
/// port has no node in its `/dev` and it cannot make one (no
/// `CAP_MKNOD`), rebooting or powering off is refused by the seccomp
/// profile (an event), init cannot be signalled, `/proc/sysrq-trigger` is
/// masked. A guest kernel that crashes anyway (here: an NMI from the host,
/// as an operator takes a hung guest down) ends the sandbox with a typed
/// reason whose message quotes the guest's console, and leaves nothing.
#[tokio::test]
async fn root_in_a_guest_cannot_take_the_control_port_and_a_crashed_guest_ends_typed() {
    require_qemu_and_kernel("microvm");
    let server = TestServer::start().await;
    let sb = create_vm(&server, json!({})).await;
    let r = server
        .sh(
            &sb.id,
            "ls /dev/vport* 2>/dev/null; dev=$(cat /sys/class/virtio-ports/*/dev | head -n 1); echo port $dev; \
             mknod /tmp/port c ${dev%:*} ${dev#*:} && head -c 1 /tmp/port && echo OPENED; echo done",
        )
        .await;
    assert!(stdout(&r).starts_with("port ") && stdout(&r).ends_with("done\n"), "{r:?}");
    assert!(!stdout(&r).contains("/dev/vport") && !stdout(&r).contains("OPENED"), "{r:?}");
    assert!(stderr(&r).contains("Operation not permitted"), "{r:?}");
    let r = server.sh(&sb.id, "reboot -f; poweroff -f; kill -9 1; echo c > /proc/sysrq-trigger; echo alive").await;
    assert_eq!(stdout(&r), "alive\n", "{r:?}");
    assert!(stderr(&r).contains("sysrq-trigger: Permission denied"), "{r:?}");
    let (status, list) = server.call(Method::GET, &format!("/v1/sandboxes/{}/events?after_seq=0", sb.id), None).await;
    assert_eq!(status, StatusCode::OK, "{list}");
    let refused: Vec<&str> =
        list["events"].as_array().expect("events").iter().filter_map(|e| e["syscall"].as_str()).collect();
    assert!(refused.contains(&"reboot"), "a reboot event: {list}");
    assert_eq!(server.get(&sb.id).await.state, SandboxState::Running);

    guest::qmp(&server, &sb.id, "inject-nmi");
    let ended = server.wait_ended(&sb.id, Duration::from_secs(60)).await;
    assert_eq!(ended.end_reason, Some(warren_api::EndReason::InitDied), "{ended:?}");
    // The end message carries the guest kernel's last words.
    let message = ended.end_message.clone().unwrap_or_default();
    assert!(message.contains("Kernel panic") && message.contains("NMI"), "{message}");
    assert_eq!(leaks::instance_processes(&leaks::vm_instance(&server.instance)), vec![]);
    server.finish().await;
}

/// Each microVM's QEMU runs as a host uid of its own (not `nobody`), from
/// the ids just below the containers' ranges, so a QEMU its guest took over
/// can signal no other sandbox's; a deleted VM's uid is handed out again.
#[tokio::test]
async fn each_microvm_runs_its_qemu_as_a_host_uid_of_its_own() {
    require_qemu_and_kernel("microvm");
    let server = TestServer::start().await;
    let vm_instance = leaks::vm_instance(&server.instance);
    let uid_of = |pid: i32| {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("QEMU's status");
        let ids = |key: &str| -> Vec<u32> {
            let line = status.lines().find(|l| l.starts_with(key)).expect("a Uid and a Gid line");
            line.split_whitespace().skip(1).map(|n| n.parse().expect("an id")).collect()
        };
        let (uids, gids) = (ids("Uid:"), ids("Gid:"));
        assert!(uids.iter().chain(&gids).all(|&id| id == uids[0]), "real, effective, saved and fs ids agree: {status}");
        uids[0]
    };
    let qemu_uids = || -> Vec<u32> {
        let mut uids: Vec<u32> = leaks::instance_processes(&vm_instance).iter().map(|(pid, _)| uid_of(*pid)).collect();
        uids.sort_unstable();
        uids
    };
    let first = create_vm(&server, json!({})).await;
    let second = create_vm(&server, json!({})).await;
    let range = (1u32 << 30) - 65_536..(1 << 30) - 32_768;
    let both = qemu_uids();
    assert_eq!(both.len(), 2, "{both:?}");
    assert_ne!(both[0], both[1], "two QEMUs, two uids");
    assert!(both.iter().all(|uid| range.contains(uid)), "{both:?} in {range:?} (nobody is 65534)");
    server.delete(&first.id).await;
    assert_eq!(qemu_uids().len(), 1, "one QEMU left");
    let third = create_vm(&server, json!({})).await;
    assert_eq!(qemu_uids(), both, "the freed uid is the lowest free one again");
    server.delete(&second.id).await;
    delete_leaves_nothing(warren_api::Backend::Microvm, &server, &third.id).await;
    server.finish().await;
}

/// A data directory deeper than a unix socket's path may be (107 bytes):
/// a container and a microVM are made under it, run, pause and resume
/// (QMP), and are reached again by a restarted server (control port,
/// console, QMP); nothing is left.
#[tokio::test]
async fn sandboxes_work_under_a_data_directory_deeper_than_a_socket_path() {
    require_qemu_and_kernel("microvm");
    let deep: std::path::PathBuf = (0..5).map(|i| format!("a-rather-long-directory-name-{i}")).collect();
    let mut server =
        TestServer::start_launched(Launch { data_dir: Some(deep.join("data")), ..Launch::default() }).await;
    assert!(server.data_dir().as_os_str().len() > 150, "{}", server.data_dir().display());
    let container = server.create(small(json!({}))).await;
    let vm = create_vm(&server, json!({})).await;
    for id in [&container.id, &vm.id] {
        assert_eq!(server.sh_ok(id, "echo hi").await, "hi\n");
        pause_or_resume(&server, id, "pause", SandboxState::Paused).await;
        pause_or_resume(&server, id, "resume", SandboxState::Running).await;
    }
    server.restart().await;
    for id in [&container.id, &vm.id] {
        assert_eq!(server.get(id).await.state, SandboxState::Running, "log:\n{}", server.log_tail(30));
        assert_eq!(server.sh_ok(id, "echo again").await, "again\n");
    }
    delete_leaves_nothing(warren_api::Backend::Microvm, &server, &vm.id).await;
    server.finish().await;
}

/// Paused VMs are adopted paused: one stopped in memory keeps its QEMU
/// (stopped) and resumes on the next exec; one paused to disk has no QEMU
/// and is loaded back from its file by the next exec. What lived only in
/// guest memory (a tmpfs file, a detached process) survives both.
#[tokio::test]
async fn paused_microvms_are_readopted_paused_in_memory_and_on_disk() {
    require_qemu_and_kernel("microvm");
    let mut server = TestServer::start().await;
    let (in_memory, on_disk) = tokio::join!(create_vm(&server, json!({})), create_vm(&server, json!({})));
    let vm_instance = leaks::vm_instance(&server.instance);
    let mut checks = Vec::new();
    for id in [&in_memory.id, &on_disk.id] {
        let marker = server.sh_ok(id, "head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n' | tee /dev/shm/m").await;
        let sleeper = server.sh_ok(id, "setsid sleep 100000 </dev/null >/dev/null 2>&1 & echo $!").await;
        checks.push((
            format!("cat /dev/shm/m; echo; kill -0 {} && echo alive", sleeper.trim()),
            format!("{marker}\nalive\n"),
        ));
    }
    pause_or_resume(&server, &in_memory.id, "pause", SandboxState::Paused).await;
    let path = format!("/v1/sandboxes/{}/pause?to_disk=true", on_disk.id);
    let (status, body) = server.call(reqwest::Method::POST, &path, None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let stopped = leaks::instance_processes(&vm_instance);
    assert_eq!(stopped.len(), 1, "only the VM paused in memory has a QEMU: {stopped:?}");

    server.restart().await;

    for sb in [&in_memory, &on_disk] {
        let info = server.get(&sb.id).await;
        assert_eq!(info.state, SandboxState::Paused, "{info:?}\nlog:\n{}", server.log_tail(30));
    }
    assert_eq!(leaks::instance_processes(&vm_instance), stopped, "the stopped QEMU carries on, and no other");
    for (sb, (check, want)) in [&in_memory, &on_disk].into_iter().zip(&checks) {
        assert_eq!(&server.sh_ok(&sb.id, check).await, want, "the exec resumes {} as it was", sb.id);
        assert_eq!(server.get(&sb.id).await.state, SandboxState::Running);
    }
    server.finish().await;
}

fn ready_snapshots(server: &TestServer) -> Vec<std::path::PathBuf> {
    guest::ready_snapshots(server, warren_api::Backend::Microvm)
}

async fn wait_for_snapshots(server: &TestServer, n: usize) -> Vec<std::path::PathBuf> {
    guest::wait_for_snapshots(server, warren_api::Backend::Microvm, n).await
}

/// 32 bytes of the guest's /dev/urandom, hex.
async fn urandom(server: &TestServer, id: &str) -> String {
    server.sh_ok(id, "head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'").await
}

/// Snapshot boot: the first create of a shape boots cold and the node
/// snapshots a template guest meanwhile; later creates are restored
/// clones that each get their own hostname and random state, and pass the
/// exec and file cases. Deleting them leaves nothing; stopping the server
/// removes the snapshot.
#[tokio::test]
async fn snapshot_restored_microvms_are_clones_with_their_own_identity() {
    require_qemu_and_kernel("microvm");
    let server = TestServer::start_with(&["--vm-snapshots", "on"]).await;
    let env = json!({"env": {"FROM_SANDBOX": "s"}});
    let first = create_vm(&server, env.clone()).await;
    assert_eq!(first.boot, Some(VmBoot::Cold), "nothing to restore yet");
    wait_for_snapshots(&server, 1).await;

    let before = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("a clock").as_secs();
    let a = create_vm(&server, env.clone()).await;
    let b = create_vm(&server, env.clone()).await;
    assert_eq!((a.boot, b.boot), (Some(VmBoot::Snapshot), Some(VmBoot::Snapshot)), "{a:?}\n{b:?}");
    assert_eq!(server.get(&a.id).await.boot, Some(VmBoot::Snapshot), "the boot stays in the info");
    for sb in [&a, &b] {
        assert_eq!(server.sh_ok(&sb.id, "hostname").await, format!("{}\n", sb.id), "a clone takes its own name");
        // The snapshot's clock stood still before these creates began.
        let guest_now: u64 = server.sh_ok(&sb.id, "date +%s").await.trim().parse().expect("seconds");
        assert!(guest_now >= before, "the clone's clock {guest_now} is the snapshot's, before {before}");
    }
    let (ra, rb) = (urandom(&server, &a.id).await, urandom(&server, &b.id).await);
    assert_eq!(ra.len(), 64, "{ra}");
    assert_ne!(ra, rb, "two clones of one snapshot read the same /dev/urandom bytes");
    assert_ne!(urandom(&server, &a.id).await, ra);

    let subject = parity::Subject {
        server: &server,
        backend: warren_api::Backend::Microvm,
        create: small(json!({"backend": "microvm", "memory_mib": GUEST_MEMORY_MIB})),
    };
    guest_facts(&server, &a).await;
    parity::exec_cases(&subject, &a.id).await;
    file_cases(&server, &b.id).await;
    let session = server.create_session(&a.id, json!({"cwd": "/"})).await;
    server.session_exec(&a.id, &session.id, "export KEPT=yes").await;
    assert_eq!(stdout(&server.session_exec(&a.id, &session.id, "echo $KEPT").await), "yes\n");

    for sb in [&first, &a] {
        server.delete(&sb.id).await;
        assert!(!server.data_dir().join("vm").join(&sb.id).exists(), "{} keeps its run directory", sb.id);
    }
    delete_leaves_nothing(warren_api::Backend::Microvm, &server, &b.id).await;
    assert_eq!(ready_snapshots(&server).len(), 1, "the snapshot outlives its clones");
    let snapshots = server.data_dir().join("vm").join(".snapshots");
    server.finish().await;
    assert!(!snapshots.exists(), "a stopped server leaves its VM snapshots behind");
}

/// `GET /v1/capacity`'s committed memory; `GET /v1/stats`' CPUs and
/// memory in use and its count of made sandboxes.
async fn books(server: &TestServer) -> (u64, f64, u64, u64) {
    let (status, capacity) = server.call(reqwest::Method::GET, "/v1/capacity", None).await;
    assert_eq!(status, StatusCode::OK, "{capacity}");
    let (status, stats) = server.call(reqwest::Method::GET, "/v1/stats", None).await;
    assert_eq!(status, StatusCode::OK, "{stats}");
    let stats: warren_api::NodeStats = serde_json::from_value(stats).expect("node stats");
    let committed = capacity["memory_mib_committed"].as_u64().expect("memory_mib_committed");
    // Creates under way are counted there but hold nothing in use yet.
    let live = stats.sandboxes.iter().filter(|c| c.state != SandboxState::Creating).map(|c| c.count).sum();
    (committed, stats.capacity.cpus_used, stats.capacity.memory_used_bytes, live)
}

/// Whether the driver builds a snapshot now (its directory is made once
/// the template's room is reserved).
fn snapshot_building(server: &TestServer) -> bool {
    leaks::dir_entries(&server.data_dir().join("vm").join(".snapshots"))
        .iter()
        .any(|d| d.extension().is_some_and(|e| e == "building"))
}

/// The template guest a snapshot is made from holds host memory and a
/// vCPU while it boots and is saved: the node's books count it beside the
/// first create (capacity, stats) and a create that fits beside that
/// create but not beside the template too is refused; once the template
/// is saved and its QEMU and cgroup are gone the room is back and the next
/// create is a restore. The books are read while the first create (whose
/// boot starts the template's) runs; a reading counts when the build was
/// under way before it and the snapshot still not saved after it.
#[tokio::test]
async fn a_snapshot_template_is_counted_in_the_books_while_it_is_built() {
    require_qemu_and_kernel("microvm");
    let g = GUEST_MEMORY_MIB;
    // The first create and one more fit; beside the template they do not.
    let server = TestServer::start_with(&["--vm-snapshots", "on", "--max-memory-mib", &(2 * g).to_string()]).await;
    let body = small(json!({"backend": "microvm", "memory_mib": g}));
    let watch = async {
        for _ in 0..60_000 {
            if !ready_snapshots(&server).is_empty() {
                panic!("the snapshot was saved before the books could be read while it was built");
            }
            if !snapshot_building(&server) {
                let log = server.log_tail(40);
                assert!(!log.contains("no room on the node for a snapshot template"), "{log}");
                tokio::time::sleep(Duration::from_millis(5)).await;
                continue;
            }
            let during = books(&server).await;
            let (status, answer) = server.try_create(&body).await;
            if !ready_snapshots(&server).is_empty() {
                if status == StatusCode::CREATED {
                    server.delete(answer["id"].as_str().expect("an id")).await;
                }
                continue; // saved meanwhile: this reading proves nothing
            }
            let (_, _, _, live) = during;
            assert_eq!(during.0, 2 * g, "the first create and the template are committed: {during:?}");
            assert_eq!(during.1, live as f64 + 1.0, "the template's vCPU is in use: {during:?}");
            assert_eq!(during.2, ((live + 1) * g) << 20, "the template's memory is in use: {during:?}");
            assert_api_error(status, &answer, ErrorCode::CapacityExceeded, None);
            return;
        }
        panic!("no snapshot build began; log:\n{}", server.log_tail(40));
    };
    let (first, ()) = tokio::join!(create_vm(&server, json!({})), watch);
    assert_eq!(first.boot, Some(VmBoot::Cold), "nothing to restore yet");

    wait_for_snapshots(&server, 1).await;
    let mut after = books(&server).await;
    for _ in 0..400 {
        if after.0 == g {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        after = books(&server).await;
    }
    assert_eq!(after, (g, 1.0, g << 20, 1), "the template's reservation outlives it");
    let restored = create_vm(&server, json!({})).await;
    assert_eq!(restored.boot, Some(VmBoot::Snapshot), "{restored:?}");
    server.finish().await;
}

/// A snapshot belongs to its image's layers: replacing the image deletes
/// it, and the next create boots the new image cold (it sees the new
/// content).
#[tokio::test]
async fn a_replaced_image_invalidates_its_vm_snapshot() {
    require_qemu_and_kernel("microvm");
    let server = TestServer::start_with(&["--vm-snapshots", "on"]).await;
    let (status, body) = import_marked(&server, "one").await;
    assert_eq!(status.as_u16(), 201, "{body}");
    let first = create_vm(&server, json!({"image": "snapped"})).await;
    let old = wait_for_snapshots(&server, 1).await;
    let restored = create_vm(&server, json!({"image": "snapped"})).await;
    assert_eq!(restored.boot, Some(VmBoot::Snapshot));
    assert_eq!(server.sh_ok(&restored.id, "cat /version").await, "one");
    server.delete(&first.id).await;
    server.delete(&restored.id).await;

    let (status, body) = import_marked(&server, "two").await;
    assert_eq!(status.as_u16(), 201, "replacing the image: {body}");
    assert!(!old[0].exists(), "the replaced image's snapshot {} survives the import", old[0].display());
    let fresh = create_vm(&server, json!({"image": "snapped"})).await;
    assert_eq!(fresh.boot, Some(VmBoot::Cold), "a snapshot of the replaced image was restored");
    assert_eq!(server.sh_ok(&fresh.id, "cat /version").await, "two");
    server.finish().await;
}

/// Imports a copy of the test image with `/version` holding `version` as
/// `snapped` (replacing the image of that name).
async fn import_marked(server: &TestServer, version: &str) -> (StatusCode, serde_json::Value) {
    let dir = server.path().join(format!("rootfs-{version}"));
    let out = std::process::Command::new("cp")
        .arg("-a")
        .arg(server.path().join("rootfs"))
        .arg(&dir)
        .output()
        .expect("run cp");
    assert!(out.status.success(), "{out:?}");
    std::fs::write(dir.join("version"), version).expect("write the marker");
    server.call(reqwest::Method::POST, "/v1/images", Some(&json!({"name": "snapped", "dir": dir}))).await
}

/// `--pool backend=microvm,...` keeps a booted VM: a create of that shape
/// claims it (`from_pool`, its init answers at once), the pool refills
/// with another, a different shape still boots, and stopping the server
/// destroys the idle member (the harness's leak check).
#[tokio::test]
async fn a_microvm_pool_hands_out_booted_vms() {
    require_qemu_and_kernel("microvm");
    let pool =
        format!("backend=microvm,image=busybox,cpus=1,memory_mib={GUEST_MEMORY_MIB},disk_mib=64,pids=256,size=1");
    let server = TestServer::start_with(&["--pool", &pool]).await;
    server.wait_pool_idle(1).await;
    let claimed = create_vm(&server, json!({"env": {"FROM_SANDBOX": "s"}})).await;
    assert!(claimed.from_pool, "a matching create claims the booted VM: {claimed:?}");
    assert_eq!(claimed.backend, warren_api::Backend::Microvm);
    assert_eq!(server.sh_ok(&claimed.id, "echo $FROM_SANDBOX; uname -r | grep -c cloud").await, "s\n1\n");
    server.wait_pool_idle(1).await;

    let other = create_vm(&server, json!({"memory_mib": GUEST_MEMORY_MIB + 64})).await;
    assert!(!other.from_pool, "another shape boots its own VM");
    let container = server.create(small(json!({}))).await;
    assert!(!container.from_pool, "a container create does not take a VM");
    server.finish().await;
}

/// `pause?to_disk=true`: the guest's memory goes to a file in its run
/// directory and its QEMU exits (no process left in the driver's cgroup);
/// the next exec loads it back, and what lived only in the guest's memory
/// is still there: a tmpfs file and a detached process with its pid. A
/// second round trip works too, an explicit resume as well, and a VM
/// paused to disk deletes cleanly.
#[tokio::test]
async fn a_microvm_paused_to_disk_keeps_its_memory_and_frees_the_host() {
    require_qemu_and_kernel("microvm");
    let server = TestServer::start().await;
    let sb = create_vm(&server, json!({})).await;
    let id = sb.id.as_str();
    let vm_instance = leaks::vm_instance(&server.instance);
    let mem = server.data_dir().join("vm").join(id).join("paused.mem");
    let marker = server.sh_ok(id, "head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n' | tee /dev/shm/marker").await;
    let sleeper = server.sh_ok(id, "setsid sleep 100000 </dev/null >/dev/null 2>&1 & echo $!").await;
    let check = format!("cat /dev/shm/marker; echo; kill -0 {} && echo alive", sleeper.trim());
    let want = format!("{marker}\nalive\n");
    assert_eq!(server.sh_ok(id, &check).await, want, "the sleeper outlives its exec");

    for round in 0..2 {
        guest::disk_pause_round(&server, id, round, (&mem, &vm_instance), (&check, &want)).await;
    }

    // Paused in memory, then to disk: it moves; a delete of it leaves nothing.
    pause_or_resume(&server, id, "pause", SandboxState::Paused).await;
    let (status, info) =
        server.call(reqwest::Method::POST, &format!("/v1/sandboxes/{id}/pause?to_disk=true"), None).await;
    assert_eq!(status, StatusCode::OK, "{info}");
    assert_eq!(leaks::instance_processes(&vm_instance), vec![], "QEMU runs while paused to disk");
    let (status, body) =
        server.call(reqwest::Method::POST, &format!("/v1/sandboxes/{id}/pause?to_disk=maybe"), None).await;
    assert_api_error(status, &body, ErrorCode::InvalidRequest, Some("to_disk"));
    server.delete(id).await;
    assert!(!server.data_dir().join("vm").join(id).exists(), "the paused VM's directory survives its delete");
    server.finish().await;
}

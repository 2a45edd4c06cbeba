//! The full-VM backend (`backend: "vm"`): QEMU `q35` with the Debian
//! cloud kernel, the image's systemd as PID 1 and `warren-init` as one of
//! its services. What every backend does (exec, limits, sessions, files,
//! events, pause, end reasons) is the parity suite's (`parity.rs`); here is
//! what only a full OS gives: `systemctl` starts a shipped unit and a
//! transient one and says they are active, the guest has its own machine
//! id and the sandbox's resources, and a delete leaves no QEMU, cgroup or
//! file behind; a restarted server adopts it. An image without systemd is
//! refused before any boot. A
//! full VM paused to disk comes back with its memory, units and clock, and
//! one restored from a snapshot runs systemd with its own name and clock.
//!
//! The image: `warren_tests::guest::systemd_rootfs` (Debian bookworm
//! minbase plus `systemd-sysv` and `procps`, built once and cached).
//!
//! Needs `qemu-system-x86` and `linux-image-cloud-amd64`
//! (`scripts/setup-host.sh` installs both) and `debootstrap` with the
//! host's Debian mirror; without them every test here fails and says so.

use std::path::Path;
use std::time::Instant;

use serde_json::json;
use warren_api::{Backend, ErrorCode, ExecRequest, SandboxInfo, SandboxState, VmBoot};
use warren_tests::guest::{
    self, delete_leaves_nothing, import_systemd_image, pause_or_resume, ready_snapshots, require_qemu_and_kernel,
    wait_for_snapshots, SYSTEMD_IMAGE, SYSTEMD_ROOTFS,
};
use warren_tests::*;

/// The cloud kernel, systemd and journald with room to spare.
const GUEST_MEMORY_MIB: u64 = 512;

/// `open_files` of [`create_vm`]'s VMs: not a default, so a guest that
/// ignored it shows.
const OPEN_FILES: u32 = 2000;

async fn create_vm(server: &TestServer) -> SandboxInfo {
    let body = small(json!({"backend": "vm", "image": SYSTEMD_IMAGE, "memory_mib": GUEST_MEMORY_MIB, "disk_mib": 128,
        "open_files": OPEN_FILES, "env": {"FROM_SANDBOX": "s"}}));
    let started = Instant::now();
    let (status, answer) = server.try_create(&body).await;
    assert_eq!(status.as_u16(), 201, "vm create failed: {answer}\nlog:\n{}", server.log_tail(30));
    eprintln!("full VM: create (TCG boot to the agent's first answer) took {:?}", started.elapsed());
    serde_json::from_value(answer).expect("a sandbox info")
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

/// One boot for everything (see the module doc), and a restart: a
/// SIGKILLed server's full VM is adopted by the next server, its QEMU and
/// a unit started before carrying on.
#[tokio::test]
async fn a_full_vm_runs_systemd_units() {
    require_qemu_and_kernel("vm");
    let mut server = TestServer::start().await;
    import_systemd_image(&server).await;
    let sb = create_vm(&server).await;
    let id = sb.id.as_str();
    assert_eq!(sb.backend, warren_api::Backend::Vm);
    let accel = sb.accelerator.expect("a full VM reports its accelerator");
    eprintln!("vm accelerator on this host: {accel:?}");
    assert_eq!(server.get(id).await.accelerator, Some(accel), "the accelerator stays in the info");

    whole_os_cases(&server, id).await;

    server.sh_ok(id, "systemd-run --unit=warren-lasting /bin/sleep 100000").await;
    let vm_instance = leaks::full_vm_instance(&server.instance);
    let qemu = leaks::instance_processes(&vm_instance);
    assert_eq!(qemu.len(), 1, "one QEMU: {qemu:?}");
    server.restart().await;
    let info = server.get(id).await;
    assert_eq!(info.state, SandboxState::Running, "{info:?}\nlog:\n{}", server.log_tail(30));
    assert_eq!(leaks::instance_processes(&vm_instance), qemu, "the same QEMU carries on");
    assert_eq!(server.sh_ok(id, "systemctl is-active warren-lasting.service").await, "active\n");

    delete_leaves_nothing(warren_api::Backend::Vm, &server, id).await;
    server.finish().await;
}

/// What only a full OS gives: systemd is PID 1 and starts units on request.
async fn whole_os_cases(server: &TestServer, id: &str) {
    assert_eq!(server.sh_ok(id, "cat /proc/1/comm").await, "systemd\n", "systemd is the guest's PID 1");
    // `open_files` is the agent unit's `LimitNOFILE`, so every command's.
    assert_eq!(server.sh_ok(id, "ulimit -n; ulimit -Hn").await, format!("{OPEN_FILES}\n{OPEN_FILES}\n"));
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

/// `pause?to_disk=true` on a full VM: the guest's memory goes to a file in
/// its run directory and QEMU exits; the next exec loads it back with
/// everything that lived only in memory (a tmpfs file, a detached process,
/// a running systemd unit), systemd still `running` and the guest's clock
/// set to the host's again (it stood still on disk). A VM paused to disk
/// deletes cleanly.
#[tokio::test]
async fn a_full_vm_paused_to_disk_keeps_its_memory_and_frees_the_host() {
    require_qemu_and_kernel("vm");
    let server = TestServer::start().await;
    import_systemd_image(&server).await;
    let sb = create_vm(&server).await;
    let id = sb.id.as_str();
    let vm_instance = leaks::full_vm_instance(&server.instance);
    let mem = server.data_dir().join("fullvm").join(id).join("paused.mem");
    let marker = server.sh_ok(id, "head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n' | tee /dev/shm/marker").await;
    let sleeper = server.sh_ok(id, "setsid sleep 100000 </dev/null >/dev/null 2>&1 & echo $!").await;
    server.sh_ok(id, "systemd-run --unit=warren-kept /bin/sleep 100000").await;
    let check = format!(
        "cat /dev/shm/marker; echo; kill -0 {} && echo alive; systemctl is-active warren-kept.service",
        sleeper.trim()
    );
    let want = format!("{marker}\nalive\nactive\n");
    assert_eq!(server.sh_ok(id, &check).await, want, "the sleeper outlives its exec");

    for round in 0..2 {
        let before = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("a clock").as_secs();
        guest::disk_pause_round(&server, id, round, (&mem, &vm_instance), (&check, &want)).await;
        let guest_now: u64 = server.sh_ok(id, "date +%s").await.trim().parse().expect("seconds");
        assert!(guest_now >= before, "round {round}: the guest's clock {guest_now} stood still (host {before})");
        let r = server.sh(id, "systemctl is-system-running --wait; systemctl --failed --no-legend").await;
        assert_eq!(stdout(&r), "running\n", "round {round}: {r:?}");
    }

    pause_or_resume(&server, id, "pause", SandboxState::Paused).await;
    let (status, info) =
        server.call(reqwest::Method::POST, &format!("/v1/sandboxes/{id}/pause?to_disk=true"), None).await;
    assert_eq!(status.as_u16(), 200, "{info}");
    assert_eq!(leaks::instance_processes(&vm_instance), vec![], "QEMU runs while paused to disk");
    server.delete(id).await;
    assert!(!server.data_dir().join("fullvm").join(id).exists(), "the paused VM's directory survives its delete");
    server.finish().await;
}

/// Snapshot boot on a full VM (`--vm-snapshots on`): the first create
/// boots cold while the node saves a template guest; the next is restored
/// from it with its own hostname, the host's time, systemd `running` and
/// units that start; a delete leaves nothing. Clones of one snapshot share
/// its machine id (the driver cannot give systemd a new one at run time).
#[tokio::test]
async fn a_snapshot_restored_full_vm_runs_systemd_with_its_own_name_and_clock() {
    require_qemu_and_kernel("vm");
    let server = TestServer::start_with(&["--vm-snapshots", "on"]).await;
    import_systemd_image(&server).await;
    let first = create_vm(&server).await;
    assert_eq!(first.boot, Some(VmBoot::Cold), "nothing to restore yet");
    wait_for_snapshots(&server, Backend::Vm, 1).await;

    let before = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("a clock").as_secs();
    let clone = create_vm(&server).await;
    let id = clone.id.as_str();
    assert_eq!(clone.boot, Some(VmBoot::Snapshot), "{clone:?}");
    assert_eq!(server.sh_ok(id, "hostname").await, format!("{id}\n"), "the clone takes its own name");
    let guest_now: u64 = server.sh_ok(id, "date +%s").await.trim().parse().expect("seconds");
    assert!(guest_now >= before, "the clone's clock {guest_now} is the snapshot's, before {before}");
    assert_eq!(server.sh_ok(id, "cat /proc/1/comm").await, "systemd\n");
    let r = server.sh(id, "systemctl is-system-running --wait; systemctl --failed --no-legend").await;
    assert_eq!(stdout(&r), "running\n", "{r:?}");
    server.sh_ok(id, "systemd-run --unit=warren-transient /bin/sleep 100000").await;
    assert_eq!(server.sh_ok(id, "systemctl is-active warren-transient.service").await, "active\n");
    let r = server.exec_wait(id, &ExecRequest::argv(["sh", "-c", "echo $FROM_SANDBOX"])).await;
    assert_eq!(stdout(&r), "s\n", "the create's env reaches the clone's execs");

    server.delete(&first.id).await;
    delete_leaves_nothing(Backend::Vm, &server, id).await;
    assert_eq!(ready_snapshots(&server, Backend::Vm).len(), 1, "the snapshot outlives its clones");
    let snapshots = server.data_dir().join("fullvm").join(".snapshots");
    server.finish().await;
    assert!(!snapshots.exists(), "a stopped server leaves its VM snapshots behind");
}

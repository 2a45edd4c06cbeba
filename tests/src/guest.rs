//! What the VM suites (`microvm`, `vm`, `parity`) share: the host check
//! they need, pause and resume, the check that a deleted VM left nothing,
//! the drivers' snapshots, and the full-VM suites' systemd image.

use std::path::Path;

use warren_api::{Backend, EndReason, SandboxInfo, SandboxState};

use crate::{leaks, TestServer};

/// Fails loudly (never skips) when this host cannot run the VM backends.
pub fn require_qemu_and_kernel(suite: &str) {
    let qemu = Path::new("/usr/bin/qemu-system-x86_64").is_file();
    let kernel = std::fs::read_dir("/boot").is_ok_and(|d| {
        d.flatten()
            .any(|e| e.file_name().to_str().is_some_and(|n| n.starts_with("vmlinuz-") && n.ends_with("-cloud-amd64")))
    });
    assert!(
        qemu && kernel,
        "the {suite} tests need qemu-system-x86 (found: {qemu}) and a Debian cloud kernel in /boot (found: {kernel}); \
         run scripts/setup-host.sh"
    );
}

/// One round of a pause to disk: `POST .../pause?to_disk=true` leaves the
/// memory file `mem` and no QEMU of `vm_instance` running; then round 0
/// resumes it through its next exec, later rounds with `POST .../resume`,
/// and `check` (run in the guest) must answer `want` again, with the
/// memory file gone.
pub async fn disk_pause_round(
    server: &TestServer,
    id: &str,
    round: usize,
    (mem, vm_instance): (&Path, &str),
    (check, want): (&str, &str),
) {
    let (status, info) =
        server.call(reqwest::Method::POST, &format!("/v1/sandboxes/{id}/pause?to_disk=true"), None).await;
    assert_eq!(status.as_u16(), 200, "{info}\nlog:\n{}", server.log_tail(30));
    assert_eq!(info["state"], "paused", "{info}");
    assert!(mem.is_file(), "round {round}: no memory file {}", mem.display());
    assert_eq!(leaks::instance_processes(vm_instance), vec![], "QEMU runs while paused to disk");
    assert_eq!(server.get(id).await.state, SandboxState::Paused, "the probe leaves it paused");
    if round == 0 {
        assert_eq!(server.sh_ok(id, check).await, want, "the next exec resumes it from disk");
    } else {
        pause_or_resume(server, id, "resume", SandboxState::Running).await;
        assert_eq!(server.sh_ok(id, check).await, want);
    }
    assert_eq!(server.get(id).await.state, SandboxState::Running);
    assert!(!mem.exists(), "the memory file outlives the resume");
}

/// `POST .../pause` or `.../resume`, asserting the state it answers.
pub async fn pause_or_resume(server: &TestServer, id: &str, verb: &str, want: SandboxState) {
    let (status, body) = server.call(reqwest::Method::POST, &format!("/v1/sandboxes/{id}/{verb}"), None).await;
    assert_eq!(status.as_u16(), 200, "{verb} {id}: {body}\nlog:\n{}", server.log_tail(30));
    let info: SandboxInfo = serde_json::from_value(body).expect("a sandbox info");
    assert_eq!(info.state, want, "after {verb}: {info:?}");
}

/// Deletes a VM sandbox of `backend` and checks the host: no QEMU process
/// in its driver's cgroups, no sandbox cgroup, no run directory (disk,
/// sockets).
pub async fn delete_leaves_nothing(backend: Backend, server: &TestServer, id: &str) {
    assert_vm_lives(backend, server, id);
    let ended = server.delete(id).await;
    assert_eq!(ended.end_reason, Some(EndReason::Deleted));
    assert_vm_gone(backend, server, id);
}

/// The VM's QEMU process and run directory (`vm/<id>` or `fullvm/<id>`
/// in the data directory) and the driver's cgroup instance.
fn vm_paths(backend: Backend, server: &TestServer, id: &str) -> (String, std::path::PathBuf) {
    match backend {
        Backend::Vm => (leaks::full_vm_instance(&server.instance), server.data_dir().join("fullvm").join(id)),
        _ => (leaks::vm_instance(&server.instance), server.data_dir().join("vm").join(id)),
    }
}

/// VM `id` (the only one of its driver) has its writable disk and QEMU.
pub fn assert_vm_lives(backend: Backend, server: &TestServer, id: &str) {
    let (vm_instance, run_dir) = vm_paths(backend, server, id);
    assert!(run_dir.join("rw.img").is_file(), "a live VM has its writable disk");
    assert!(!leaks::instance_processes(&vm_instance).is_empty(), "QEMU runs in its driver's cgroup");
}

/// [`assert_vm_gone`] once the VM's run directory and QEMU are gone, or
/// `within` has passed (an end's record can be committed before its
/// teardown is done: they run side by side).
pub async fn wait_vm_gone(backend: Backend, server: &TestServer, id: &str, within: std::time::Duration) {
    let (vm_instance, run_dir) = vm_paths(backend, server, id);
    let deadline = std::time::Instant::now() + within;
    while (run_dir.exists() || !leaks::instance_processes(&vm_instance).is_empty())
        && std::time::Instant::now() < deadline
    {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_vm_gone(backend, server, id);
}

/// Nothing of ended VM `id` is left: no run directory (disk, sockets), no
/// QEMU process, no cgroup.
pub fn assert_vm_gone(backend: Backend, server: &TestServer, id: &str) {
    let (vm_instance, run_dir) = vm_paths(backend, server, id);
    assert!(!run_dir.exists(), "{} survives the delete", run_dir.display());
    assert_eq!(leaks::instance_processes(&vm_instance), vec![], "QEMU survives the delete");
    let cgroups: Vec<_> =
        leaks::sandbox_cgroup_dirs(&server.instance).into_iter().filter(|d| d.ends_with(id)).collect();
    assert_eq!(cgroups, Vec::<std::path::PathBuf>::new(), "the sandbox's cgroups survive the delete");
}

/// Where the full-VM suites' systemd image is built and cached.
pub const SYSTEMD_ROOTFS: &str = "/var/cache/warren/vm-systemd-rootfs";
const SYSTEMD_PACKAGES: &str = "systemd-sysv,procps";
/// The name the systemd image is imported under.
pub const SYSTEMD_IMAGE: &str = "systemd";

/// Builds the systemd image once: Debian bookworm minbase plus
/// `systemd-sysv` and `procps`, by `scripts/make-default-image.sh` (with
/// `WARREN_IMAGE_PACKAGES`), which caches it and takes a lock (about 50 s
/// and 155 MB the first time; the default image stays without systemd).
pub fn systemd_rootfs() -> &'static Path {
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

/// Imports [`systemd_rootfs`] as [`SYSTEMD_IMAGE`].
pub async fn import_systemd_image(server: &TestServer) {
    let rootfs = systemd_rootfs();
    let (status, body) = server
        .call(reqwest::Method::POST, "/v1/images", Some(&serde_json::json!({"name": SYSTEMD_IMAGE, "dir": rootfs})))
        .await;
    assert_eq!(status.as_u16(), 201, "importing the systemd image: {body}");
}

/// The run directory of `backend`'s driver in the server's data directory.
pub fn vm_data_dir(server: &TestServer, backend: Backend) -> std::path::PathBuf {
    match backend {
        Backend::Vm => server.data_dir().join("fullvm"),
        _ => server.data_dir().join("vm"),
    }
}

/// The complete snapshots of booted guests `backend`'s driver holds.
pub fn ready_snapshots(server: &TestServer, backend: Backend) -> Vec<std::path::PathBuf> {
    leaks::dir_entries(&vm_data_dir(server, backend).join(".snapshots"))
        .into_iter()
        .filter(|d| d.join("meta.json").is_file())
        .collect()
}

/// Waits (bounded by a count, not a clock: a template boot under TCG on a
/// loaded machine takes what it takes) until `n` snapshots are complete.
pub async fn wait_for_snapshots(server: &TestServer, backend: Backend, n: usize) -> Vec<std::path::PathBuf> {
    for _ in 0..2400 {
        let ready = ready_snapshots(server, backend);
        if ready.len() >= n {
            return ready;
        }
        let log = server.log_tail(40);
        assert!(!log.contains("cannot build a VM snapshot"), "the snapshot build failed; log:\n{log}");
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
    panic!("no VM snapshot was built; log:\n{}", server.log_tail(40));
}

/// Sends one QMP command (`{"execute": command}`) to a microVM's QEMU, as
/// an operator would, and returns its answer's `return`.
pub fn qmp(server: &TestServer, id: &str, command: &str) -> serde_json::Value {
    use std::io::{BufRead, BufReader, Write};
    let sock = server.data_dir().join("vm").join(id).join("qmp.sock");
    let stream = std::os::unix::net::UnixStream::connect(&sock).expect("connect to the VM's qmp.sock");
    stream.set_read_timeout(Some(std::time::Duration::from_secs(30))).expect("set a read timeout");
    let mut reader = BufReader::new(stream.try_clone().expect("clone the QMP stream"));
    let mut writer = stream;
    let mut answer = |execute: &str| -> serde_json::Value {
        writeln!(writer, "{}", serde_json::json!({ "execute": execute })).expect("send a QMP command");
        loop {
            let mut line = String::new();
            assert!(reader.read_line(&mut line).expect("read QMP") > 0, "QEMU closed QMP before answering {execute}");
            let value: serde_json::Value = serde_json::from_str(&line).expect("QMP speaks JSON lines");
            // The greeting and asynchronous events come before the answer.
            if let Some(ret) = value.get("return") {
                return ret.clone();
            }
            assert!(value.get("error").is_none(), "QMP {execute}: {value}");
        }
    };
    answer("qmp_capabilities");
    answer(command)
}

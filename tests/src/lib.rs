//! The shared harness of Warren's integration and adversarial suites.
//!
//! Owns: starting a real `warren serve` per test (its own temp dir, data dir,
//! cgroup instance and busybox image), typed HTTP helpers, host-side probes
//! of sandbox processes, and the leak check every test ends with.
//! Invariant: whatever a test leaves behind - the server, its sandboxes'
//! processes, mounts and cgroups - the [`TestServer`]'s `Drop` removes, also
//! when the test panicked; [`TestServer::finish`] asserts the server removed
//! it all by itself.
//! Never: touches a process, mount or cgroup that is not its own server's.

pub mod api;
pub mod cluster;
pub mod guest;
pub mod iam;
pub mod leaks;
pub mod parity;
pub mod prometheus;
pub mod rootfs;
pub mod server;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

pub use api::{
    api_error_mismatch, assert_api_error, b64, chunked_body, end_result, frame_bytes, from_json, pattern, small,
    stderr, stdout, FrameReader,
};
pub use server::{warren_binary, Launch, TestServer, IMAGE};
use tokio::time::{sleep, Instant};
pub use warren_api as wire;

/// Host pids of the live processes of one sandbox (its pids cgroup).
pub fn sandbox_pids(instance: &str, sandbox_id: &str) -> Vec<i32> {
    let procs = Path::new(leaks::CGROUP_ROOT).join("pids").join(instance).join(sandbox_id).join("cgroup.procs");
    let text = fs::read_to_string(procs).unwrap_or_default();
    text.lines().filter_map(|l| l.trim().parse().ok()).filter(|pid| !leaks::is_zombie(*pid)).collect()
}

/// The host pid of the sandbox's PID 1: the process of its cgroup that is
/// pid 1 in its own pid namespace.
pub fn sandbox_pid1(instance: &str, sandbox_id: &str) -> Option<i32> {
    sandbox_pids(instance, sandbox_id)
        .into_iter()
        .find(|pid| leaks::proc_status_field(*pid, "NSpid").is_some_and(|ns| ns.split_whitespace().last() == Some("1")))
}

/// Waits (bounded) for a process of the instance whose command line
/// contains `needle`, and returns its host pid.
pub async fn find_instance_process(instance: &str, needle: &str, within: Duration) -> i32 {
    let deadline = Instant::now() + within;
    loop {
        if let Some((pid, _)) = leaks::instance_processes(instance).into_iter().find(|(_, cmd)| cmd.contains(needle)) {
            return pid;
        }
        assert!(Instant::now() < deadline, "no process `{needle}` of {instance} within {within:?}");
        sleep(Duration::from_millis(20)).await;
    }
}

/// A string no file on the host or in an image contains by chance.
pub fn unique_marker(what: &str) -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    format!("warren-{what}-{}-{nanos}", std::process::id())
}

/// Builds the static C helper `source` (a path under the `tests` crate)
/// into `out_dir` and returns the binary's path. Helpers are static so they
/// run inside a busybox image. Callers pass `env!("CARGO_TARGET_TMPDIR")`:
/// the build lands in the target directory, never in `/tmp`, and one fixed
/// name per helper keeps repeated runs from piling up copies; building to a
/// per-process name and renaming keeps concurrent test binaries apart.
pub fn static_c_helper(source: &str, out_dir: &str) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(source);
    let stem = src.file_stem().and_then(|s| s.to_str()).unwrap_or("helper");
    let out = Path::new(out_dir).join(format!("warren-helper-{stem}"));
    let building = Path::new(out_dir).join(format!(".warren-helper-{stem}.{}", std::process::id()));
    fs::create_dir_all(out_dir).expect("the helper directory");
    let status = Command::new("gcc")
        .args(["-static", "-O1", "-Wall", "-Werror", "-o"])
        .arg(&building)
        .arg(&src)
        .status()
        .expect("run gcc (scripts/setup-host.sh installs it)");
    assert!(status.success(), "gcc -static failed for {}", src.display());
    fs::rename(&building, &out).expect("move the built helper into place");
    out
}

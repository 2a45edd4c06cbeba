//! Test bench for the container driver: a busybox layer, a driver with its
//! own run directory, cgroup instance and uid ranges, and checks that a test
//! left nothing behind. Needs root and a built `warren-init`.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use bytes::Bytes;
use warren_api::{NetworkMode, Resources};
use warren_backend::container::{ContainerConfig, ContainerDriver};
use warren_backend::{Driver, ExecControl, ExecEvent, ExecSpec, ExitInfo, SandboxHandle, SandboxSpec};
use warren_guard::cgroup::{SandboxCgroup, UNIFIED, V1_CONTROLLERS};

static NEXT: AtomicU32 = AtomicU32::new(0);

/// `target/debug/warren-init`, next to the `deps/` directory this test
/// binary runs from.
pub fn init_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let debug_dir = exe.parent().and_then(Path::parent).expect("test binary lives in target/<profile>/deps");
    let init = debug_dir.join("warren-init");
    assert!(init.is_file(), "{} is missing: run `cargo build -p warren-init` first", init.display());
    init
}

/// A read-only layer with a static busybox and its applets as relative
/// symlinks (`busybox --install -s` would point them at the host path).
pub fn busybox_layer(dir: &Path) {
    let bin = dir.join("bin");
    fs::create_dir_all(&bin).unwrap();
    fs::copy("/bin/busybox", bin.join("busybox")).unwrap();
    let list = Command::new("/bin/busybox").arg("--list").output().unwrap();
    assert!(list.status.success());
    for applet in String::from_utf8(list.stdout).unwrap().lines() {
        if applet != "busybox" {
            symlink("busybox", bin.join(applet)).unwrap();
        }
    }
    for empty in ["proc", "sys", "dev", "tmp", "etc", "root"] {
        fs::create_dir_all(dir.join(empty)).unwrap();
    }
    fs::set_permissions(dir.join("tmp"), fs::Permissions::from_mode(0o1777)).unwrap();
}

/// One test's driver and everything it may create. Dropping it (also on a
/// panic) sweeps whatever is left; [`Bench::finish`] sweeps and asserts the
/// host is clean.
pub struct Bench {
    pub driver: ContainerDriver,
    pub instance: String,
    pub run_dir: PathBuf,
    pub layer: PathBuf,
    _tmp: tempfile::TempDir,
}

impl Bench {
    pub fn new() -> Bench {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let tmp = tempfile::tempdir().unwrap();
        // init resolves the rootfs path as an unprivileged user.
        fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o711)).unwrap();
        let layer = tmp.path().join("layer");
        busybox_layer(&layer);
        let run_dir = tmp.path().join("run");
        let instance = format!("wt-{}-{n}", std::process::id());
        let config = ContainerConfig {
            run_dir: run_dir.clone(),
            init_binary: init_binary(),
            cgroup_instance: instance.clone(),
            // Separate ranges per test, so parallel tests never share ids.
            uid_base_start: ContainerConfig::DEFAULT_UID_BASE_START + n * 64 * 65_536,
        };
        let driver = ContainerDriver::new(config).unwrap();
        let run_dir = fs::canonicalize(&run_dir).unwrap();
        Bench { driver, instance, run_dir, layer, _tmp: tmp }
    }

    pub fn spec(&self, id: &str) -> SandboxSpec {
        SandboxSpec {
            id: id.to_string(),
            layers: vec![self.layer.clone()],
            resources: Resources {
                cpus: 1.0,
                memory_mib: 128,
                disk_mib: 64,
                pids: 64,
                inodes: 16384,
                open_files: 1024,
            },
            network: NetworkMode::None,
            hostname: "sandbox".to_string(),
            phase: Default::default(),
        }
    }

    pub fn cgroup(&self, id: &str) -> SandboxCgroup {
        SandboxCgroup::new(&self.instance, id).unwrap()
    }

    /// Sweeps, then asserts: no mount under the run dir (the sweep takes
    /// the run dir's own tmpfs too), no cgroup under the instance in any
    /// hierarchy, no sandbox directory.
    pub async fn finish(self) {
        self.driver.sweep(&[]).await.unwrap();
        assert_clean(&self.run_dir, &self.instance);
        assert_eq!(mounts_under(&self.run_dir), Vec::<String>::new(), "the run dir's tmpfs outlived the sweep");
    }
}

impl Drop for Bench {
    fn drop(&mut self) {
        // The runtime of the test may be gone or busy: sweep on a thread
        // with a runtime of its own.
        let driver = &self.driver;
        std::thread::scope(|scope| {
            scope.spawn(|| {
                let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                let _ = runtime.block_on(driver.sweep(&[]));
            });
        });
        let _ = SandboxCgroup::remove_instance(&self.instance);
    }
}

pub fn mounts_under(dir: &Path) -> Vec<String> {
    let prefix = dir.to_str().unwrap();
    fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .filter(|point| point.starts_with(prefix))
        .map(str::to_string)
        .collect()
}

/// Nothing of any sandbox is left: no mount below the run dir (its own
/// tmpfs stays while the driver lives), no cgroup, no sandbox directory.
pub fn assert_clean(run_dir: &Path, instance: &str) {
    let own = run_dir.to_str().unwrap();
    let left: Vec<String> = mounts_under(run_dir).into_iter().filter(|point| point != own).collect();
    assert_eq!(left, Vec::<String>::new(), "mounts left under {}", run_dir.display());
    for hierarchy in V1_CONTROLLERS.into_iter().chain([UNIFIED]) {
        let dir = Path::new("/sys/fs/cgroup").join(hierarchy).join(instance);
        let left: Vec<_> = match fs::read_dir(&dir) {
            Ok(entries) => entries.flatten().filter(|e| e.file_type().unwrap().is_dir()).map(|e| e.path()).collect(),
            Err(_) => Vec::new(),
        };
        assert!(left.is_empty(), "cgroups left: {left:?}");
        if let Ok(procs) = fs::read_to_string(dir.join("cgroup.procs")) {
            assert_eq!(procs, "", "processes left directly in {}", dir.display());
        }
    }
    let entries: Vec<_> = fs::read_dir(run_dir).unwrap().flatten().map(|e| e.path()).collect();
    assert!(entries.is_empty(), "left in the run dir: {entries:?}");
}

pub fn exec_spec(argv: &[&str]) -> ExecSpec {
    ExecSpec {
        argv: argv.iter().map(|s| s.to_string()).collect(),
        env: BTreeMap::from([("PATH".to_string(), "/bin".to_string())]),
        cwd: "/".to_string(),
        capture_session_state: false,
    }
}

pub fn sh(script: &str) -> ExecSpec {
    exec_spec(&["/bin/sh", "-c", script])
}

/// Everything an exec produced.
#[derive(Debug)]
pub struct Finished {
    pub stdout: String,
    pub stderr: String,
    pub exit: ExitInfo,
}

/// Runs `spec` to the end, feeding `stdin` (then EOF) when given.
pub async fn run(driver: &ContainerDriver, handle: &SandboxHandle, spec: ExecSpec, stdin: Option<&str>) -> Finished {
    let mut process = driver.exec(handle, spec).await.unwrap();
    if let Some(input) = stdin {
        process.control.send(ExecControl::Stdin(Bytes::from(input.to_string()))).await.unwrap();
        process.control.send(ExecControl::StdinEof).await.unwrap();
    }
    let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
    let first = process.events.recv().await;
    assert!(matches!(first, Some(ExecEvent::Started { .. })), "{first:?}");
    let exit = loop {
        match tokio::time::timeout(Duration::from_secs(60), process.events.recv()).await.expect("exec hangs") {
            Some(ExecEvent::Stdout(b)) => stdout.extend_from_slice(&b),
            Some(ExecEvent::Stderr(b)) => stderr.extend_from_slice(&b),
            Some(ExecEvent::Exited(exit)) => break exit,
            other => panic!("unexpected event {other:?}"),
        }
    };
    Finished {
        stdout: String::from_utf8_lossy(&stdout).into_owned(),
        stderr: String::from_utf8_lossy(&stderr).into_owned(),
        exit,
    }
}

/// PID 1's host pid, from the handle.
pub fn pid1(handle: &SandboxHandle) -> i32 {
    handle.state["pid1"]["pid"].as_i64().unwrap() as i32
}

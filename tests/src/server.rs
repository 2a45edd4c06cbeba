//! One real `warren serve` per test: its own temp dir, data dir, cgroup
//! instance and busybox image; start, crash, restart, stop, and the final
//! leak check.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use reqwest::{Method, StatusCode};
use rustix::mount::{unmount, UnmountFlags};
use rustix::process::{kill_process, Pid, Signal};
use serde_json::{json, Value};
use tempfile::TempDir;
use tokio::time::{sleep, Instant};

use crate::leaks::{self, Leaks};
use crate::rootfs;

/// The image every test sandbox runs.
pub const IMAGE: &str = "busybox";
/// Bound on anything a healthy server does quickly (start, answer, stop).
pub const SERVER_WAIT: Duration = Duration::from_secs(60);

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// A running test server. Drop kills it and removes whatever it left, also
/// when the test panicked; [`TestServer::finish`] additionally asserts that
/// the server cleaned up after itself.
pub struct TestServer {
    pub url: String,
    pub http: reqwest::Client,
    /// `wt-<pid>-<n>`: names this server's cgroups.
    pub instance: String,
    /// The per-test temp dir holding `rootfs/`, `data/` and `server.log`.
    pub dir: Option<TempDir>,
    child: Option<Child>,
    /// How the last server process ended, once reaped.
    exited: Option<std::process::ExitStatus>,
    /// Extra `warren serve` arguments, kept across restarts.
    extra_args: Vec<String>,
    /// With `--auth on`: the root project's admin key the server wrote to
    /// `admin.key`; `http` sends it on every request.
    pub admin_key: Option<String>,
    /// Command words before `warren` (e.g. `nsenter --net=...`), the
    /// listen address and the headers every request carries, kept across
    /// restarts.
    prefix: Vec<String>,
    listen: String,
    headers: Vec<(String, String)>,
    /// [`Launch::default_landlock_audit`].
    default_landlock_audit: bool,
    /// [`Launch::data_dir`], below the temp dir.
    data_dir_name: PathBuf,
}

/// How a [`TestServer`] is launched beyond the defaults (loopback, the
/// host's network namespace, no credentials).
#[derive(Debug, Clone, Default)]
pub struct Launch {
    pub extra_args: Vec<String>,
    /// Words run before the `warren` binary, e.g. `["nsenter", "--net=/run/netns/x", "--"]`.
    pub prefix: Vec<String>,
    /// `--listen` (default `127.0.0.1:0`).
    pub listen: Option<String>,
    /// Headers every request of the test client carries (a cluster token).
    pub headers: Vec<(String, String)>,
    /// Do not import the busybox image (a server that holds no images,
    /// like a cluster's API server).
    pub no_image: bool,
    /// Start without `--landlock-audit off`, i.e. with the server's default,
    /// which makes it the host's audit daemon. Every other test server is
    /// `off` (unless its own args say otherwise): many run at once, some are
    /// SIGKILLed, and the adversarial suite checks the kernel log for audit
    /// records; `tests/security/landlock_audit.rs` covers the default.
    pub default_landlock_audit: bool,
    /// The data directory, relative to the test's temp dir (default `data`).
    pub data_dir: Option<PathBuf>,
}

/// A client sending `headers` (name, value) on every request.
fn http_client(headers: &[(String, String)]) -> reqwest::Client {
    let mut map = reqwest::header::HeaderMap::new();
    for (name, value) in headers {
        let name = reqwest::header::HeaderName::from_bytes(name.as_bytes()).expect("a header name");
        map.insert(name, reqwest::header::HeaderValue::from_str(value).expect("a header-safe value"));
    }
    reqwest::Client::builder().no_proxy().default_headers(map).build().expect("build an HTTP client")
}

/// The `warren` binary the tests run (`WARREN_BIN`, else beside the test executable).
pub fn warren_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("WARREN_BIN") {
        return PathBuf::from(path);
    }
    // Test executables live in target/<profile>/deps; the binaries one level up.
    let exe = std::env::current_exe().expect("the test executable has a path");
    let deps = exe.parent().expect("the test executable has a directory");
    for dir in [deps, deps.parent().unwrap_or(deps)] {
        let warren = dir.join("warren");
        if warren.is_file() && dir.join("warren-init").is_file() {
            return warren;
        }
    }
    panic!(
        "cannot find the `warren` and `warren-init` binaries beside {}: run `cargo build --workspace` first \
         (or set WARREN_BIN)",
        exe.display()
    );
}

impl TestServer {
    /// Builds the rootfs, starts the server, imports the image.
    pub async fn start() -> TestServer {
        Self::start_with(&[]).await
    }

    /// Like [`TestServer::start`], with `--auth on`: `http` (and so every
    /// helper) acts with the admin key of the root project.
    pub async fn start_with_auth(extra_args: &[&str]) -> TestServer {
        let mut args = vec!["--auth", "on"];
        args.extend_from_slice(extra_args);
        Self::start_with(&args).await
    }

    /// Like [`TestServer::start`], with extra `warren serve` arguments.
    pub async fn start_with(extra_args: &[&str]) -> TestServer {
        Self::start_launched(Launch {
            extra_args: extra_args.iter().map(|a| a.to_string()).collect(),
            ..Launch::default()
        })
        .await
    }

    /// Like [`TestServer::start`], launched as `launch` says.
    pub async fn start_launched(launch: Launch) -> TestServer {
        static SWEEP: std::sync::Once = std::sync::Once::new();
        SWEEP.call_once(|| {
            leaks::sweep_dead_test_instances();
            leaks::sweep_dead_test_dirs(&std::env::temp_dir());
        });
        let dir = tempfile::Builder::new().prefix("warren-test-").tempdir().expect("make a temp dir");
        fs::write(dir.path().join(leaks::OWNER_FILE), std::process::id().to_string()).expect("write the owner file");
        // Like /var/lib: the sandbox's ids must be able to traverse to its root.
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).expect("chmod the temp dir");
        rootfs::build_busybox_rootfs(&dir.path().join("rootfs")).expect("build the busybox rootfs");
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let http = http_client(&launch.headers);
        let mut server = TestServer {
            url: String::new(),
            http,
            instance: format!("wt-{}-{n}", std::process::id()),
            dir: Some(dir),
            child: None,
            exited: None,
            extra_args: launch.extra_args,
            admin_key: None,
            prefix: launch.prefix,
            listen: launch.listen.unwrap_or_else(|| "127.0.0.1:0".into()),
            headers: launch.headers,
            default_landlock_audit: launch.default_landlock_audit,
            data_dir_name: launch.data_dir.unwrap_or_else(|| PathBuf::from("data")),
        };
        server.launch().await;
        if launch.no_image {
            return server;
        }
        let rootfs = server.path().join("rootfs");
        let (status, body) =
            server.call(Method::POST, "/v1/images", Some(&json!({"name": IMAGE, "dir": rootfs}))).await;
        assert_eq!(status, StatusCode::CREATED, "importing the busybox image: {body}");
        server
    }

    /// The per-test temp dir.
    pub fn path(&self) -> &Path {
        self.dir.as_ref().expect("the temp dir lives until drop").path()
    }

    pub fn data_dir(&self) -> PathBuf {
        self.path().join(&self.data_dir_name)
    }

    pub fn log_path(&self) -> PathBuf {
        self.path().join("server.log")
    }

    /// The last `lines` lines of the server's log (all its runs).
    pub fn log_tail(&self, lines: usize) -> String {
        let mut text = String::new();
        let Some(dir) = &self.dir else { return "(the log went with the removed temp dir)".into() };
        if let Ok(mut f) = File::open(dir.path().join("server.log")) {
            let len = f.metadata().map(|m| m.len()).unwrap_or(0);
            let _ = f.seek(SeekFrom::Start(len.saturating_sub(64 * 1024)));
            let _ = f.read_to_string(&mut text);
        }
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// The server's pid while it runs.
    pub fn server_pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Starts a server on this test's data dir and instance and waits for
    /// its `server.url`.
    pub async fn launch(&mut self) {
        assert!(self.child.is_none(), "a server is already running");
        let data_dir = self.data_dir();
        fs::create_dir_all(&data_dir).expect("make the data dir");
        let url_file = data_dir.join("server.url");
        let _ = fs::remove_file(&url_file);
        let log = OpenOptions::new().create(true).append(true).open(self.log_path()).expect("open the server log");
        let mut command = match self.prefix.split_first() {
            Some((program, words)) => {
                let mut c = Command::new(program);
                c.args(words).arg(warren_binary());
                c
            }
            None => Command::new(warren_binary()),
        };
        let child = command
            .arg("serve")
            .arg("--data-dir")
            .arg(&data_dir)
            .args(["--listen", &self.listen, "--instance", &self.instance])
            .args(&self.extra_args)
            .args(self.landlock_audit_args())
            .env("WARREN_LOG", std::env::var("WARREN_LOG").unwrap_or_else(|_| "info".into()))
            .env("NO_COLOR", "1")
            // A VM boot the node gives up on logs its guest's console; with
            // the boot steps on it, that log says where the guest stood.
            .env("WARREN_VM_BOOTTRACE", std::env::var("WARREN_VM_BOOTTRACE").unwrap_or_else(|_| "1".into()))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("dup the log fd"))
            .stderr(log)
            .spawn()
            .expect("spawn `warren serve`");
        self.child = Some(child);
        self.url = self.wait_for_url(&url_file).await;
        if let Ok(key) = fs::read_to_string(data_dir.join("admin.key")) {
            let key = key.trim().to_string();
            let mut headers = self.headers.clone();
            headers.push((reqwest::header::AUTHORIZATION.to_string(), format!("Bearer {key}")));
            self.http = http_client(&headers);
            self.admin_key = Some(key);
        }
    }

    /// Whether the next [`TestServer::launch`] keeps the server's default
    /// `--landlock-audit` ([`Launch::default_landlock_audit`]) or adds `off`.
    pub fn set_default_landlock_audit(&mut self, default: bool) {
        self.default_landlock_audit = default;
    }

    /// `--landlock-audit off` unless the test asked for the default or set
    /// the flag itself.
    fn landlock_audit_args(&self) -> &'static [&'static str] {
        let set = self.extra_args.iter().any(|a| a == "--landlock-audit" || a.starts_with("--landlock-audit="));
        if set || self.default_landlock_audit {
            &[]
        } else {
            &["--landlock-audit", "off"]
        }
    }

    async fn wait_for_url(&mut self, url_file: &Path) -> String {
        let deadline = Instant::now() + SERVER_WAIT;
        loop {
            if let Ok(text) = fs::read_to_string(url_file) {
                if text.ends_with('\n') {
                    return text.trim().to_string();
                }
            }
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                self.child = None;
                panic!("`warren serve` exited with {status} before listening; log:\n{}", self.log_tail(40));
            }
            assert!(Instant::now() < deadline, "no server.url after {SERVER_WAIT:?}; log:\n{}", self.log_tail(40));
            sleep(Duration::from_millis(20)).await;
        }
    }

    fn signal(&self, signal: Signal) {
        if let Some(pid) = self.child.as_ref().and_then(|c| Pid::from_raw(c.id() as i32)) {
            let _ = kill_process(pid, signal);
        }
    }

    /// Waits (bounded) for the server process to exit; true when it did.
    async fn reap(&mut self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while let Some(child) = self.child.as_mut() {
            match child.try_wait() {
                Ok(None) => {}
                Ok(Some(status)) => {
                    self.exited = Some(status);
                    self.child = None;
                    return true;
                }
                Err(_) => {
                    self.exited = None;
                    self.child = None;
                    return true;
                }
            }
            if Instant::now() > deadline {
                return false;
            }
            sleep(Duration::from_millis(10)).await;
        }
        true
    }

    /// SIGKILLs the server: no chance to clean up, as in a crash.
    pub async fn crash(&mut self) {
        self.signal(Signal::KILL);
        assert!(self.reap(SERVER_WAIT).await, "the server survived SIGKILL");
    }

    /// SIGKILL, then a new server on the same data dir and instance.
    pub async fn restart(&mut self) {
        self.crash().await;
        self.launch().await;
    }

    /// As [`TestServer::restart`], the new server with `extra_args` instead
    /// of the ones it had (kept across later restarts).
    pub async fn restart_with(&mut self, extra_args: &[&str]) {
        self.crash().await;
        self.extra_args = extra_args.iter().map(|a| a.to_string()).collect();
        self.launch().await;
    }

    /// SIGTERM, a bounded wait, then SIGKILL. A clean stop exits 0: a
    /// server killed by the signal's default action skipped its shutdown
    /// (the host's audit settings, the end of every sandbox).
    pub async fn stop(&mut self) {
        self.signal(Signal::TERM);
        if !self.reap(Duration::from_secs(30)).await {
            self.crash().await;
            panic!("the server ignored SIGTERM for 30 s; log:\n{}", self.log_tail(40));
        }
        if let Some(status) = self.exited {
            assert!(
                status.success(),
                "the server did not stop cleanly on SIGTERM ({status}); log:\n{}",
                self.log_tail(40)
            );
        }
    }

    /// Deletes every sandbox still running, stops the server, and asserts
    /// it left no mount, cgroup, process or run directory behind.
    pub async fn finish(mut self) {
        if self.child.is_some() {
            self.delete_all().await;
            self.stop().await;
        }
        let leaks = Leaks::scan(&self.data_dir(), &self.instance);
        assert!(leaks.is_empty(), "the server left behind:\n{leaks}\nlog:\n{}", self.log_tail(40));
        let holders = leaks::layer_cache_holders(self.path());
        assert!(holders.is_empty(), "a cleanly stopped server left layer-cache holders {holders:?}");
        leaks::remove_instance_dirs(&self.instance);
        let left = leaks::instance_cgroup_dirs(&self.instance);
        assert!(left.is_empty(), "cannot remove the instance's cgroup directories {left:?}");
        // A mount the test made outside the data dir (a loop device, an XFS
        // scratch) would keep the temp dir and leak it on every run.
        let mounted = leaks::mounts_under(self.path());
        assert!(mounted.is_empty(), "mounts remain under the test's temp dir at finish: {mounted:?}");
        let dir = self.dir.take().expect("the temp dir lives until finish");
        let path = dir.path().to_path_buf();
        if let Err(e) = dir.close() {
            panic!("the test's temp dir {} cannot be removed: {e}", path.display());
        }
    }

    async fn delete_all(&self) {
        for sandbox in self.list(None).await {
            if sandbox.state != warren_api::SandboxState::Ended {
                let (status, body) = self.call(Method::DELETE, &format!("/v1/sandboxes/{}", sandbox.id), None).await;
                assert_eq!(status, StatusCode::OK, "deleting {} at finish: {body}", sandbox.id);
            }
        }
    }

    /// Like [`TestServer::call`] but to an arbitrary URL path with query.
    pub async fn call(&self, method: Method, path: &str, body: Option<&Value>) -> (StatusCode, Value) {
        let mut rb = self.http.request(method, format!("{}{path}", self.url));
        if let Some(b) = body {
            rb = rb.json(b);
        }
        crate::api::json_response(crate::api::send(rb).await).await
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        let panicking = std::thread::panicking();
        if panicking {
            eprintln!("---- server log tail ({}) ----\n{}\n----", self.instance, self.log_tail(60));
        }
        self.signal(Signal::KILL);
        if let Some(mut child) = self.child.take() {
            let _ = child.wait();
        }
        // `finish` has already checked and removed everything.
        let Some(dir) = self.dir.take() else { return };
        // Our own server's holders (they hold its log open): kill them before
        // their layer mounts are forced away below.
        for pid in leaks::layer_cache_holders(dir.path()) {
            if let Some(pid) = Pid::from_raw(pid) {
                let _ = kill_process(pid, Signal::KILL);
            }
        }
        leaks::force_cleanup(&dir.path().join(&self.data_dir_name), &self.instance);
        // Mounts a test made beside the data dir (a loop device, an XFS scratch).
        for point in leaks::mounts_under(dir.path()) {
            let _ = unmount(&point, UnmountFlags::DETACH | UnmountFlags::NOFOLLOW);
        }
        let left = leaks::mounts_under(dir.path());
        if left.is_empty() {
            let path = dir.path().to_path_buf();
            if let Err(e) = dir.close() {
                eprintln!("warning: the test's temp dir {} was not removed: {e}", path.display());
            }
        } else {
            // Removing a tree with mounts below it would write through them.
            eprintln!("warning: mounts remain under {}: {left:?}; keeping the dir", dir.path().display());
            let _ = dir.keep();
        }
    }
}

//! Warren's side: starts `warren serve` itself, imports the shared rootfs as
//! an image, and measures through the HTTP API as a user would.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use reqwest::Method;
use serde::de::DeserializeOwned;
use warren_api::{CreateSandboxRequest, ExecRequest, ExecResult, ExecStatus, Health, SandboxInfo, SandboxList};

use crate::cleanup;
use crate::cmd;
use crate::contest::{self, Contestant};
use crate::error::{BenchError, Result};
use crate::harness::{self, IdleHolder, IdleUsage};
use crate::host;
use crate::results::{Contender, IdleMemory, Measured, Outcome, Part, Plan, Sustained};
use crate::stats::{self, Latencies};

pub const IMAGE: &str = "bench";
/// Small limits, as the brief asks, so density is not bounded by them.
const MEMORY_MIB: u64 = 64;
const DISK_MIB: u64 = 16;
/// Long enough that no sandbox is reaped for idleness during a run.
const IDLE_TIMEOUT_SECS: u64 = 3600;
const SERVER_START_LIMIT: Duration = Duration::from_secs(60);
const SERVER_STOP_LIMIT: Duration = Duration::from_secs(120);
const HTTP_LIMIT: Duration = Duration::from_secs(90);
const POOL_FILL_LIMIT: Duration = Duration::from_secs(180);

/// The one sandbox shape every Warren measure uses (and the pool holds).
pub fn sandbox_request() -> CreateSandboxRequest {
    CreateSandboxRequest {
        image: IMAGE.into(),
        memory_mib: MEMORY_MIB,
        disk_mib: DISK_MIB,
        idle_timeout_secs: IDLE_TIMEOUT_SECS,
        ..CreateSandboxRequest::default()
    }
}

/// The `--pool` value whose members match [`sandbox_request`].
pub fn pool_spec(size: usize) -> String {
    format!("image={IMAGE},memory_mib={MEMORY_MIB},disk_mib={DISK_MIB},size={size}")
}

// ---- the server ------------------------------------------------------------------

/// A `warren serve` child; stopped (SIGTERM, then SIGKILL) when dropped.
pub struct Server {
    child: Child,
    pub url: String,
    pub log: PathBuf,
    pub command: String,
}

impl Server {
    pub fn start(binary: &Path, data_dir: &Path, instance: &str, pools: &[String], log: &Path) -> Result<Server> {
        fs::create_dir_all(data_dir).map_err(|e| BenchError::io("mkdir", data_dir, e))?;
        let url_file = data_dir.join("server.url");
        let _ = fs::remove_file(&url_file);
        let log_file = fs::File::create(log).map_err(|e| BenchError::io("create", log, e))?;
        let log_err = log_file.try_clone().map_err(|e| BenchError::io("dup", log, e))?;
        let mut c = Command::new(binary);
        c.arg("serve").arg("--data-dir").arg(data_dir).args([
            "--listen",
            "127.0.0.1:0",
            "--instance",
            instance,
            "--destroy-on-exit",
        ]);
        for p in pools {
            c.arg("--pool").arg(p);
        }
        c.stdin(Stdio::null()).stdout(log_file).stderr(log_err);
        let command = cmd::describe(&c);
        let child = c.spawn().map_err(|e| BenchError::Spawn { program: command.clone(), source: e })?;
        let mut server = Server { child, url: String::new(), log: log.to_path_buf(), command };
        server.url = server.wait_for_url(&url_file)?;
        Ok(server)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    fn wait_for_url(&mut self, url_file: &Path) -> Result<String> {
        let deadline = Instant::now() + SERVER_START_LIMIT;
        loop {
            if let Ok(text) = fs::read_to_string(url_file) {
                if !text.trim().is_empty() {
                    return Ok(text.trim().to_string());
                }
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(BenchError::ServerDied { status: status.to_string(), log_tail: self.log_tail() });
            }
            if Instant::now() > deadline {
                return Err(BenchError::Timeout { what: format!("{}", url_file.display()), limit: SERVER_START_LIMIT });
            }
            harness::check_interrupt()?;
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn log_tail(&self) -> String {
        let text = fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }

    /// SIGTERM (the server then ends every sandbox), bounded wait, then SIGKILL.
    pub fn stop(&mut self) -> Result<()> {
        if self.child.try_wait().ok().flatten().is_some() {
            return Ok(());
        }
        if let Some(pid) = rustix::process::Pid::from_raw(self.child.id() as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        match cmd::wait_bounded(&mut self.child, SERVER_STOP_LIMIT) {
            Ok(_) => Ok(()),
            Err(e) => {
                let _ = self.child.kill();
                let _ = self.child.wait();
                Err(e)
            }
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            eprintln!("warren-bench: stopping the warren server: {e}");
        }
    }
}

// ---- the client -----------------------------------------------------------------

/// A blocking API client with its own single-threaded runtime and
/// connection, so each benchmark thread drives its own requests without
/// handing them to another thread.
pub struct Client {
    rt: tokio::runtime::Runtime,
    http: reqwest::Client,
    base: String,
}

impl Client {
    pub fn new(base: &str) -> Result<Client> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| BenchError::io("start", "tokio runtime", e))?;
        let http = reqwest::Client::builder()
            .timeout(HTTP_LIMIT)
            .build()
            .map_err(|e| BenchError::Http { op: "client".into(), source: e })?;
        Ok(Client { rt, http, base: base.trim_end_matches('/').to_string() })
    }

    fn call<T: DeserializeOwned>(&self, op: &str, rb: reqwest::RequestBuilder) -> Result<T> {
        self.rt.block_on(async {
            let http = |e| BenchError::Http { op: op.to_string(), source: e };
            let resp = rb.send().await.map_err(http)?;
            let status = resp.status();
            if !status.is_success() {
                let body = resp.text().await.unwrap_or_default();
                return Err(BenchError::Api { op: op.to_string(), status: status.as_u16(), body });
            }
            resp.json::<T>().await.map_err(http)
        })
    }

    fn req(&self, method: Method, path: &str) -> reqwest::RequestBuilder {
        self.http.request(method, format!("{}{path}", self.base))
    }

    pub fn health(&self) -> Result<Health> {
        self.call("health", self.req(Method::GET, "/v1/health"))
    }

    /// `GET /v1/stats` `landlock_events`: whether the server (with its
    /// default `--landlock-audit`) made itself the host's audit daemon for
    /// the run, which puts audit's cost on the host.
    pub fn landlock_events(&self) -> Result<warren_api::LandlockEvents> {
        let stats: warren_api::NodeStats = self.call("stats", self.req(Method::GET, "/v1/stats"))?;
        Ok(stats.landlock_events)
    }

    pub fn import_dir(&self, name: &str, dir: &Path) -> Result<()> {
        let body = serde_json::json!({"name": name, "dir": dir});
        self.call::<serde_json::Value>("import image", self.req(Method::POST, "/v1/images").json(&body)).map(|_| ())
    }

    pub fn create(&self, req: &CreateSandboxRequest) -> Result<SandboxInfo> {
        self.call("create", self.req(Method::POST, "/v1/sandboxes").json(req))
    }

    /// `?wait=true` exec of `/bin/true`; anything but a clean exit 0 is an error.
    pub fn exec_true(&self, id: &str) -> Result<ExecResult> {
        self.exec_ok(id, "/bin/true")
    }

    /// `?wait=true` exec of `program` (no arguments); anything but a clean
    /// exit 0 is an error.
    pub fn exec_ok(&self, id: &str, program: &str) -> Result<ExecResult> {
        let rb = self
            .req(Method::POST, &format!("/v1/sandboxes/{id}/exec"))
            .query(&[("wait", "true")])
            .json(&ExecRequest::argv([program]));
        let r: ExecResult = self.call("exec", rb)?;
        if r.status != ExecStatus::Ok || r.exit_code != Some(0) {
            return Err(BenchError::Unexpected {
                op: format!("exec {program}"),
                detail: format!("status {:?}, exit code {:?}", r.status, r.exit_code),
            });
        }
        Ok(r)
    }

    /// `GET /v1/sandboxes/{id}`: an API round trip that starts nothing.
    pub fn get(&self, id: &str) -> Result<SandboxInfo> {
        self.call("get", self.req(Method::GET, &format!("/v1/sandboxes/{id}")))
    }

    pub fn delete(&self, id: &str) -> Result<SandboxInfo> {
        self.call("delete", self.req(Method::DELETE, &format!("/v1/sandboxes/{id}")))
    }

    /// `POST /v1/sandboxes/{id}/pause` or `.../resume` (`verb`).
    pub fn pause_or_resume(&self, id: &str, verb: &str) -> Result<SandboxInfo> {
        self.call(verb, self.req(Method::POST, &format!("/v1/sandboxes/{id}/{verb}")))
    }

    /// Starts a shell `command` in the sandbox and returns once it started,
    /// leaving it running (the server drives an exec whatever the client does).
    pub fn start_exec(&self, id: &str, command: &str) -> Result<()> {
        let req = ExecRequest { timeout_secs: Some(3600.0), ..ExecRequest::shell(command) };
        let rb = self.req(Method::POST, &format!("/v1/sandboxes/{id}/exec")).json(&req);
        self.rt.block_on(async {
            let resp = rb.send().await.map_err(|e| BenchError::Http { op: "exec".into(), source: e })?;
            match resp.status().is_success() {
                true => Ok(()),
                false => {
                    Err(BenchError::Api { op: "exec".into(), status: resp.status().as_u16(), body: String::new() })
                }
            }
        })
    }

    pub fn running(&self) -> Result<Vec<SandboxInfo>> {
        let rb = self.req(Method::GET, "/v1/sandboxes").query(&[("state", "running")]);
        self.call::<SandboxList>("list", rb).map(|l| l.sandboxes)
    }
}

// ---- the measures -----------------------------------------------------------------

/// Per-step times of the recorded cycles of one measure.
#[derive(Default)]
struct Steps {
    create: Latencies,
    exec: Latencies,
    delete: Latencies,
}

impl Steps {
    fn into_parts(self, measure: &str, first: &str, measured: bool) -> Vec<Part> {
        let steps =
            vec![(first, self.create), ("exec `true`", self.exec), ("delete (after the timed cycle)", self.delete)];
        contest::step_parts(measure, steps, measured)
    }
}

/// One cold cycle: create, exec `true`, delete, each step timed.
fn cold_cycle(client: &Client, steps: &mut Steps) -> Result<Duration> {
    let t0 = Instant::now();
    let sb = client.create(&sandbox_request())?;
    let t1 = Instant::now();
    let exec = client.exec_true(&sb.id);
    let t2 = Instant::now();
    // Delete even when the exec failed, so a failed sample leaves nothing behind.
    let deleted = client.delete(&sb.id);
    let t3 = Instant::now();
    exec?;
    deleted?;
    steps.create.push(t1 - t0);
    steps.exec.push(t2 - t1);
    steps.delete.push(t3 - t2);
    Ok(t3 - t0)
}

fn create_delete(client: &Client) -> Result<Duration> {
    let t = Instant::now();
    let sb = client.create(&sandbox_request())?;
    client.delete(&sb.id)?;
    Ok(t.elapsed())
}

struct WarrenIdle<'a> {
    url: &'a str,
    instance: &'a str,
    server_pid: u32,
    server_rss_before: u64,
}

impl IdleHolder for WarrenIdle<'_> {
    type Worker = Client;
    /// The sandbox id. Sandboxes a failed run leaves are ended by the
    /// server's `--destroy-on-exit` when its guard stops it.
    type Handle = String;

    fn worker(&self) -> Result<Client> {
        Client::new(self.url)
    }

    fn start(&self, client: &mut Client, _: usize) -> Result<String> {
        client.create(&sandbox_request()).map(|sb| sb.id)
    }

    fn ready(&self, handles: &[String]) -> Result<()> {
        let running = Client::new(self.url)?.running()?;
        let live = handles.iter().filter(|id| running.iter().any(|sb| &sb.id == *id)).count();
        if live != handles.len() {
            return Err(BenchError::Unexpected {
                op: "idle sandboxes".into(),
                detail: format!("{live} of {} created are running", handles.len()),
            });
        }
        Ok(())
    }

    fn usage(&self, handles: &[String]) -> IdleUsage {
        let instance_dir = Path::new(host::MEMORY_CGROUP_ROOT).join(self.instance);
        let mut extra = Vec::new();
        if let Ok(running) = Client::new(self.url).and_then(|c| c.running()) {
            let api_sum: u64 = running.iter().filter_map(|sb| sb.usage.as_ref()).map(|u| u.memory_bytes).sum();
            extra.push(("API `usage.memory_bytes` summed".into(), stats::bytes(api_sum as f64)));
        }
        if let Ok(rss) = host::process_rss_bytes(self.server_pid) {
            let grown = rss as f64 - self.server_rss_before as f64;
            extra.push(("server RSS growth per sandbox".into(), stats::bytes(grown / handles.len().max(1) as f64)));
        }
        let tasks = count_tasks(&Path::new("/sys/fs/cgroup/pids").join(self.instance));
        if tasks > 0 {
            extra.push(("host tasks per sandbox".into(), format!("{:.1}", tasks as f64 / handles.len().max(1) as f64)));
        }
        IdleUsage {
            cgroup_bytes: host::cgroup_memory_usage(&instance_dir),
            source: format!("memory.usage_in_bytes of {} (the instance parent)", instance_dir.display()),
            extra,
        }
    }

    fn stop(&self, client: &mut Client, id: String) -> Result<()> {
        client.delete(&id).map(|_| ())
    }
}

/// Tasks (threads) in a v1 cgroup tree.
fn count_tasks(dir: &Path) -> usize {
    let own = fs::read_to_string(dir.join("tasks")).map_or(0, |t| t.lines().count());
    let children: usize = fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| count_tasks(&e.path()))
        .sum();
    own + children
}

/// Sandboxes of the instance that exist on the host (pool members included).
fn instance_sandboxes(instance: &str) -> usize {
    let dir = Path::new(host::MEMORY_CGROUP_ROOT).join(instance);
    fs::read_dir(dir).into_iter().flatten().flatten().filter(|e| e.file_type().is_ok_and(|t| t.is_dir())).count()
}

fn wait_for_pool(instance: &str, size: usize) -> Result<()> {
    let deadline = Instant::now() + POOL_FILL_LIMIT;
    while instance_sandboxes(instance) < size {
        if Instant::now() > deadline {
            return Err(BenchError::Timeout { what: format!("a warm pool of {size}"), limit: POOL_FILL_LIMIT });
        }
        harness::check_interrupt()?;
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// Claim + exec timed, then delete (timed apart) and wait `gap` so the
/// pool replaces the member just taken before the next sample.
fn warm_cycle(client: &Client, gap: Duration, steps: &mut Steps) -> Result<Duration> {
    let t0 = Instant::now();
    let sb = client.create(&sandbox_request())?;
    let t1 = Instant::now();
    let exec = client.exec_true(&sb.id);
    let t2 = Instant::now();
    let deleted = client.delete(&sb.id);
    let t3 = Instant::now();
    std::thread::sleep(gap);
    exec?;
    deleted?;
    if !sb.from_pool {
        return Err(BenchError::Unexpected {
            op: "claim".into(),
            detail: "pool was empty: a cold create answered".into(),
        });
    }
    steps.create.push(t1 - t0);
    steps.exec.push(t2 - t1);
    steps.delete.push(t3 - t2);
    Ok(t2 - t0)
}

pub struct WarrenSetup<'a> {
    pub binary: &'a Path,
    pub workdir: &'a Path,
    pub rootfs: &'a Path,
}

/// Where Warren's server CPU per operation is added up.
#[derive(Default)]
struct ServerCpu {
    totals: Vec<(&'static str, Duration, usize)>,
}

impl ServerCpu {
    fn add(&mut self, op: &'static str, cpu: Duration, ops: usize) {
        match self.totals.iter_mut().find(|(o, _, _)| *o == op) {
            Some((_, total, n)) => {
                *total += cpu;
                *n += ops;
            }
            None => self.totals.push((op, cpu, ops)),
        }
    }

    fn per_op(&self) -> Vec<(String, Duration)> {
        self.totals.iter().filter(|(_, _, n)| *n > 0).map(|(op, cpu, n)| (op.to_string(), *cpu / *n as u32)).collect()
    }
}

/// Warren as a contestant, measured over its HTTP API. A first server runs
/// the cold, exec, sustained and idle measures; a second one, started with
/// a warm pool of the same sandbox shape, the warm claims.
pub struct WarrenContestant {
    // Drop order: the client, the server (stopping it ends its sandboxes),
    // then the sweep of whatever it left.
    client: Client,
    server: Option<Server>,
    leftovers: Leftovers,
    binary: PathBuf,
    workdir: PathBuf,
    rootfs: PathBuf,
    warmup: usize,
    cold_calls: usize,
    cold_steps: Steps,
    exec_target: Option<String>,
    server_cpu: ServerCpu,
    c: Contender,
}

impl WarrenContestant {
    pub fn start(setup: &WarrenSetup<'_>, plan: &Plan) -> Result<Self> {
        let mut c = Self::contender(setup.binary);
        let instance = cleanup::warren_instance(std::process::id());
        let data_dir = setup.workdir.join("warren-data");
        let leftovers = Leftovers { instance: instance.clone(), data_dir: data_dir.clone() };
        let server = Server::start(setup.binary, &data_dir, &instance, &[], &setup.workdir.join("server.log"))?;
        c.commands.push(("server".into(), server.command.clone()));
        let client = Client::new(&server.url)?;
        client.health()?;
        let landlock = client.landlock_events()?;
        let audit = if landlock.available { "on" } else { "off" };
        c.commands
            .push(("landlock events (default `--landlock-audit`)".into(), format!("{audit}: {}", landlock.detail)));
        client.import_dir(IMAGE, setup.rootfs)?;
        Ok(WarrenContestant {
            client,
            server: Some(server),
            leftovers,
            binary: setup.binary.to_path_buf(),
            workdir: setup.workdir.to_path_buf(),
            rootfs: setup.rootfs.to_path_buf(),
            warmup: plan.warmup,
            cold_calls: 0,
            cold_steps: Steps::default(),
            exec_target: None,
            server_cpu: ServerCpu::default(),
            c,
        })
    }

    fn contender(binary: &Path) -> Contender {
        let mut c = Contender::new("Warren", host::tool_version(&binary.to_string_lossy(), &["--version"]));
        let request = serde_json::to_string(&sandbox_request()).unwrap_or_default();
        c.commands.push(("sandbox shape".into(), format!("POST /v1/sandboxes {request}")));
        c.commands.push(("exec".into(), "POST /v1/sandboxes/{id}/exec?wait=true {\"argv\":[\"/bin/true\"]}".into()));
        c.commands.push((
            "sustained".into(),
            "each client: POST /v1/sandboxes, then DELETE /v1/sandboxes/{id} (no exec)".into(),
        ));
        c
    }

    /// The contender with the setup error, when the server cannot be started.
    pub fn failed(binary: &Path, e: &BenchError) -> Contender {
        let mut c = Self::contender(binary);
        c.cold = Outcome::Failed(format!("setup: {e}"));
        c
    }

    pub fn into_contender(mut self) -> Contender {
        self.c.server_cpu = self.server_cpu.per_op();
        self.c
    }

    fn server(&self) -> Result<&Server> {
        self.server
            .as_ref()
            .ok_or_else(|| BenchError::Unexpected { op: "warren".into(), detail: "server stopped".into() })
    }

    /// The server's CPU time so far (its own and its reaped children's).
    fn server_cpu_now(&self) -> Option<Duration> {
        self.server.as_ref().and_then(|s| host::process_cpu(s.pid()).ok())
    }

    fn count_server_cpu(&mut self, op: &'static str, before: Option<Duration>, ops: usize) {
        if let (Some(before), Some(after)) = (before, self.server_cpu_now()) {
            self.server_cpu.add(op, after.saturating_sub(before), ops);
        }
    }

    /// Stops the first server, then measures warm claims against a pooled one.
    fn warm(&mut self, plan: &Plan) -> Result<()> {
        drop(self.server.take());
        self.leftovers.note(&mut self.c, "after the first server stopped");
        let gap = refill_gap(&self.c);
        let pools = [pool_spec(plan.pool_size)];
        let log = self.workdir.join("server-pooled.log");
        let server = Server::start(&self.binary, &self.leftovers.data_dir, &self.leftovers.instance, &pools, &log)?;
        self.c.commands.push(("pooled server".into(), server.command.clone()));
        wait_for_pool(&self.leftovers.instance, plan.pool_size)?;
        // The last member counted may still be booting.
        std::thread::sleep(Duration::from_secs(1));
        let client = Client::new(&server.url)?;
        for _ in 0..plan.warmup {
            harness::check_interrupt()?;
            warm_cycle(&client, gap, &mut Steps::default())?;
        }
        let mut steps = Steps::default();
        let warm = harness::sequential(0, plan.samples, || warm_cycle(&client, gap, &mut steps));
        drop(server);
        self.leftovers.note(&mut self.c, "after the pooled server stopped");
        self.c.warm = contest::outcome(warm)?;
        let measured = self.c.warm.done().is_some();
        self.c.parts.extend(steps.into_parts("warm", "claim", measured));
        self.c.notes.push(format!(
            "warm pool: size {}, one claim every >= {} (3x cold create p50, at least 50 ms) so the member taken is \
             replaced before the next claim; a claim answered by a cold create counts as a failure (pool empty)",
            plan.pool_size,
            stats::ms(gap),
        ));
        Ok(())
    }
}

impl Contestant for WarrenContestant {
    fn contender(&mut self) -> &mut Contender {
        &mut self.c
    }

    fn cold_routes(&self) -> Vec<String> {
        vec!["create + exec + delete".into()]
    }

    fn cold(&mut self, _: usize) -> Result<Duration> {
        // The harness's warm-up cycles come first; their steps are not kept.
        let warming_up = self.cold_calls < self.warmup;
        self.cold_calls += 1;
        let before = self.server_cpu_now();
        let took = if warming_up {
            cold_cycle(&self.client, &mut Steps::default())
        } else {
            cold_cycle(&self.client, &mut self.cold_steps)
        };
        self.count_server_cpu("cold cycle", before, 1);
        took
    }

    fn cold_done(&mut self) {
        let steps = std::mem::take(&mut self.cold_steps);
        let measured = self.c.cold.done().is_some();
        self.c.parts.extend(steps.into_parts("cold", "create", measured));
    }

    fn exec_start(&mut self) -> Result<bool> {
        self.server()?;
        self.exec_target = Some(self.client.create(&sandbox_request())?.id);
        Ok(true)
    }

    fn exec(&mut self) -> Result<Duration> {
        let id = self
            .exec_target
            .clone()
            .ok_or_else(|| BenchError::Unexpected { op: "exec".into(), detail: "no target sandbox".into() })?;
        let before = self.server_cpu_now();
        let t = Instant::now();
        let done = self.client.exec_true(&id);
        let took = t.elapsed();
        self.count_server_cpu("exec", before, 1);
        done.map(|_| took)
    }

    fn exec_stop(&mut self) -> Result<()> {
        match self.exec_target.take() {
            Some(id) => self.client.delete(&id).map(|_| ()),
            None => Ok(()),
        }
    }

    fn sustain(&mut self, clients: usize, window: Duration) -> Result<Measured<Sustained>> {
        let url = self.server()?.url.clone();
        let before = self.server_cpu_now();
        let m = harness::sustained(clients, window, || Client::new(&url), |c| create_delete(c));
        let cycles = m.as_ref().map_or(0, |m| m.value.cycles.len());
        self.count_server_cpu("create+delete", before, cycles);
        m
    }

    fn idle(&mut self, plan: &Plan) -> Result<Measured<IdleMemory>> {
        let server = self.server()?;
        let holder = WarrenIdle {
            url: &server.url,
            instance: &self.leftovers.instance,
            server_pid: server.pid(),
            server_rss_before: host::process_rss_bytes(server.pid()).unwrap_or(0),
        };
        let client = &self.client;
        harness::idle(plan, &holder, || cold_cycle(client, &mut Steps::default()))
    }

    fn extra(&mut self, plan: &Plan) -> Result<()> {
        crate::progress("Warren: pause and resume");
        let before = self.server_cpu_now();
        let parts = crate::pause::measure(&self.client, plan)?;
        self.count_server_cpu("pause+resume", before, plan.samples + plan.warmup);
        self.c.parts.extend(parts);
        crate::progress("Warren: pause and resume of a microVM");
        let parts = crate::pause::measure_microvm(&self.client, plan)?;
        self.c.parts.extend(parts);
        self.c.commands.push(("pause".into(), crate::pause::DESCRIPTION.into()));
        crate::progress("Warren: where an exec's time goes");
        let parts = crate::exec_split::measure(&self.client, &self.rootfs, plan)?;
        self.c.parts.extend(parts);
        self.c.commands.push(("exec split".into(), crate::exec_split::DESCRIPTION.into()));
        crate::progress("Warren: warm pool claim+exec");
        match self.warm(plan) {
            Err(BenchError::Interrupted) => Err(BenchError::Interrupted),
            Err(e) => {
                self.c.warm = Outcome::Failed(e.to_string());
                Ok(())
            }
            Ok(()) => Ok(()),
        }
    }
}

/// One claim every 3x the cold create time leaves the pool time to replace
/// the member taken; the filler starts at once when woken by the claim.
fn refill_gap(c: &Contender) -> Duration {
    let create_p50 = c.part("cold step: create").and_then(Latencies::p50);
    create_p50.map_or(Duration::from_millis(300), |d| (d * 3).max(Duration::from_millis(50)))
}

/// What a stopped server may leave on the host: its instance's cgroups and
/// mounts below its data dir. Noted in the report, then removed; removed on
/// drop too, so an error or interrupt between the notes leaves nothing.
struct Leftovers {
    instance: String,
    data_dir: PathBuf,
}

impl Leftovers {
    fn note(&self, c: &mut Contender, when: &str) {
        let cgroups = cleanup::instance_cgroups(&self.instance);
        let mounts =
            cleanup::mounts_below(&fs::read_to_string("/proc/self/mountinfo").unwrap_or_default(), &self.data_dir);
        if !cgroups.is_empty() || !mounts.is_empty() {
            c.notes.push(format!(
                "LEAK {when}: {} sandbox cgroup dirs and {} mounts left behind (removed by the benchmark)",
                cgroups.len(),
                mounts.len()
            ));
        }
        for e in self.remove() {
            c.notes.push(format!("cleanup: {e}"));
        }
    }

    fn remove(&self) -> Vec<BenchError> {
        cleanup::unmount_below(&self.data_dir);
        cleanup::remove_named_cgroups(&self.instance)
    }
}

impl Drop for Leftovers {
    fn drop(&mut self) {
        for e in self.remove() {
            eprintln!("warren-bench: cleanup: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pool_spec_matches_the_request_shape() {
        let r = sandbox_request();
        let spec = pool_spec(8);
        assert!(spec.contains(&format!("image={}", r.image)));
        assert!(spec.contains(&format!("memory_mib={}", r.memory_mib)));
        assert!(spec.contains(&format!("disk_mib={}", r.disk_mib)));
        assert!(spec.ends_with("size=8"));
        assert!(r.validate().is_ok());
    }

    #[test]
    fn the_refill_gap_follows_the_cold_create_time() {
        let mut c = Contender::new("Warren", "test");
        assert_eq!(refill_gap(&c), Duration::from_millis(300));
        let mut lat = Latencies::default();
        lat.push(Duration::from_millis(40));
        let cpu = host::CpuUse::default();
        c.parts.push(Part {
            name: "cold step: create".into(),
            latencies: Outcome::Done(Measured { value: lat, cpu }),
            own_cpu: false,
        });
        assert_eq!(refill_gap(&c), Duration::from_millis(120));
    }
}

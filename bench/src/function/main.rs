//! `warren-bench-function`: a `python3 -c` class call through Warren's
//! function backend, side by side with the container path (create + exec +
//! destroy) and a plain `bwrap` per call, on the default image; plus what
//! python's own start-up costs. Writes a dated Markdown report.
//!
//! Owns: its own `warren serve` (a temp data dir, a function pool of the
//! default image) and the children it starts; all are gone when it ends.
//! Latencies are sequential calls from one client; throughput is
//! `--clients` concurrent clients for `--secs` seconds. Percentiles are
//! nearest-rank.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::Parser;
use serde_json::{json, Value};

// The main bench's host readings (/proc/stat busy ticks, a process's CPU).
#[allow(dead_code)]
#[path = "../error.rs"]
mod error;
#[allow(dead_code)]
#[path = "../host.rs"]
mod host;

const CODE: &str = "print(6*7)";

#[derive(Debug, Parser)]
#[command(name = "warren-bench-function", about = "Function calls beside the container path and bwrap")]
struct Args {
    /// The default image's root filesystem (scripts/make-default-image.sh).
    #[arg(long, default_value = "/var/cache/warren/default-rootfs")]
    rootfs: PathBuf,
    /// `warren` binary (its `warren-init` beside it).
    #[arg(long, default_value = "target/release/warren")]
    warren: PathBuf,
    /// Sequential samples per latency measure.
    #[arg(long, default_value_t = 200)]
    samples: usize,
    /// Concurrent clients of a throughput measure.
    #[arg(long, default_value_t = 4)]
    clients: usize,
    /// Length of a throughput window, seconds.
    #[arg(long, default_value_t = 20)]
    secs: u64,
    /// The function pool's bounds.
    #[arg(long, default_value = "min=4,max=8,queue=256")]
    pool: String,
    /// Report path (default bench/results/<date>-function.md).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Function calls only, without the container, bwrap and python
    /// start-up peers (for A/B pairs of two builds run back to back).
    #[arg(long)]
    function_only: bool,
}

type Res<T> = Result<T, String>;

struct Latencies(Vec<Duration>);

impl Latencies {
    fn pct(&self, p: f64) -> Duration {
        let mut v = self.0.clone();
        v.sort();
        if v.is_empty() {
            return Duration::ZERO;
        }
        let rank = ((p / 100.0) * v.len() as f64).ceil().max(1.0) as usize;
        v[rank.min(v.len()) - 1]
    }
}

fn ms(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64() * 1000.0)
}

struct Server {
    child: Child,
    url: String,
    /// Its `--instance`: the name of its sandboxes' parent cgroups.
    instance: String,
    _dir: tempfile::TempDir,
}

impl Server {
    fn start(warren: &Path, pool: &str) -> Res<Server> {
        let dir = tempfile::Builder::new().prefix("warren-bench-fn-").tempdir().map_err(|e| e.to_string())?;
        let data = dir.path().join("data");
        let log = std::fs::File::create(dir.path().join("server.log")).map_err(|e| e.to_string())?;
        let instance = format!("wbf-{}", std::process::id());
        let pool_arg = format!("image=default,memory_mib=256,disk_mib=64,pids=128,{pool}");
        let mut c = Command::new(warren);
        c.arg("serve").arg("--data-dir").arg(&data).args(["--listen", "127.0.0.1:0", "--instance", &instance]);
        c.args(["--destroy-on-exit", "--function-pool", &pool_arg]);
        let command = format!("{} serve --function-pool {pool_arg}", warren.display());
        let err = log.try_clone().map_err(|e| e.to_string())?;
        let child = c.stdin(Stdio::null()).stdout(log).stderr(err).spawn().map_err(|e| format!("{command}: {e}"))?;
        let url_file = data.join("server.url");
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(t) = std::fs::read_to_string(&url_file) {
                if !t.trim().is_empty() {
                    return Ok(Server { child, url: t.trim().to_string(), instance, _dir: dir });
                }
            }
            if Instant::now() > deadline {
                return Err("the server did not start within 60 s".into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(pid) = rustix::process::Pid::from_raw(self.child.id() as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        let _ = self.child.wait();
    }
}

async fn post(http: &reqwest::Client, url: &str, body: &Value) -> Res<Value> {
    let resp = http.post(url).json(body).send().await.map_err(|e| e.to_string())?;
    let status = resp.status();
    let v: Value = resp.json().await.map_err(|e| e.to_string())?;
    if !status.is_success() {
        return Err(format!("{status}: {v}"));
    }
    Ok(v)
}

/// One call through `POST /v1/functions/run`; checks the answer.
async fn function_call(http: &reqwest::Client, base: &str, body: &Value) -> Res<Value> {
    let v = post(http, &format!("{base}/v1/functions/run"), body).await?;
    if v["exec"]["exit_code"] != 0 {
        return Err(format!("bad run: {v}"));
    }
    Ok(v)
}

/// create + exec + delete of a container sandbox, as one call.
async fn container_call(http: &reqwest::Client, base: &str) -> Res<()> {
    let req = json!({"image": "default", "memory_mib": 256, "disk_mib": 64, "pids": 128});
    let sb = post(http, &format!("{base}/v1/sandboxes"), &req).await?;
    let id = sb["id"].as_str().ok_or("no id")?.to_string();
    let exec = json!({"argv": ["python3", "-c", CODE]});
    let r = post(http, &format!("{base}/v1/sandboxes/{id}/exec?wait=true"), &exec).await;
    let _ = http.delete(format!("{base}/v1/sandboxes/{id}")).send().await;
    match r?["exit_code"].as_i64() {
        Some(0) => Ok(()),
        other => Err(format!("exit {other:?}")),
    }
}

fn bwrap_command(rootfs: &Path) -> Command {
    let mut c = Command::new("bwrap");
    c.args(["--unshare-all", "--die-with-parent", "--ro-bind"]).arg(rootfs).arg("/");
    c.args(["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "python3", "-c", CODE]);
    c.stdout(Stdio::null()).stderr(Stdio::null()).stdin(Stdio::null());
    c
}

fn chroot_python(rootfs: &Path, code: &str) -> Command {
    let mut c = Command::new("chroot");
    c.arg(rootfs).args(["/usr/bin/python3", "-c", code]);
    c.stdout(Stdio::null()).stderr(Stdio::null()).stdin(Stdio::null());
    c
}

fn run_ok(mut c: Command) -> Res<()> {
    let s = c.status().map_err(|e| e.to_string())?;
    match s.success() {
        true => Ok(()),
        false => Err(format!("{s}")),
    }
}

async fn sequential<F, Fut>(n: usize, mut once: F) -> Res<Latencies>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Res<()>>,
{
    for _ in 0..5 {
        once().await?;
    }
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        once().await?;
        out.push(t.elapsed());
    }
    Ok(Latencies(out))
}

/// The CPU the host, the server process and the server's sandboxes have
/// used so far.
struct CpuReading {
    host: host::CpuSnapshot,
    server: Duration,
    sandboxes: Duration,
}

/// CPU of the function throughput window divided by its calls.
struct CpuPerCall {
    host: Duration,
    server: Duration,
    sandboxes: Duration,
}

impl CpuReading {
    fn now(server: &Server) -> Res<CpuReading> {
        Ok(CpuReading {
            host: host::CpuSnapshot::now().map_err(|e| e.to_string())?,
            server: host::process_cpu(server.child.id()).map_err(|e| e.to_string())?,
            sandboxes: sandboxes_cpu(&server.instance),
        })
    }

    fn per_call(&self, server: &Server, calls: usize) -> Res<CpuPerCall> {
        let later = CpuReading::now(server)?;
        let n = u32::try_from(calls.max(1)).unwrap_or(u32::MAX);
        Ok(CpuPerCall {
            host: self.host.since().map_err(|e| e.to_string())?.busy / n,
            server: later.server.saturating_sub(self.server) / n,
            sandboxes: later.sandboxes.saturating_sub(self.sandboxes) / n,
        })
    }
}

/// CPU of every sandbox of the server (python, and init relaying its
/// output), from the instance's v1 `cpuacct` cgroup, which counts its
/// removed children too; zero where there is none.
fn sandboxes_cpu(instance: &str) -> Duration {
    std::fs::read_to_string(format!("/sys/fs/cgroup/cpuacct/{instance}/cpuacct.usage"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .map(Duration::from_nanos)
        .unwrap_or_default()
}

/// Calls per second of `clients` concurrent loops over `secs`, and how
/// many succeeded and failed.
async fn throughput<F, Fut>(clients: usize, secs: u64, once: F) -> Res<(f64, usize, usize)>
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Res<()>> + Send,
{
    let once = Arc::new(once);
    let end = Instant::now() + Duration::from_secs(secs);
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let once = Arc::clone(&once);
        tasks.push(tokio::spawn(async move {
            let (mut ok, mut failed) = (0usize, 0usize);
            while Instant::now() < end {
                match once().await {
                    Ok(()) => ok += 1,
                    Err(_) => failed += 1,
                }
            }
            (ok, failed)
        }));
    }
    let (mut ok, mut failed) = (0, 0);
    for t in tasks {
        let (o, f) = t.await.map_err(|e| e.to_string())?;
        ok += o;
        failed += f;
    }
    Ok((ok as f64 / start.elapsed().as_secs_f64(), ok, failed))
}

fn version(program: &str, arg: &str) -> String {
    Command::new(program)
        .arg(arg)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).lines().next().unwrap_or_default().trim().to_string())
        .unwrap_or_else(|e| format!("unavailable: {e}"))
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    if let Err(e) = run(args).await {
        eprintln!("warren-bench-function: {e}");
        std::process::exit(1);
    }
}

async fn run(args: Args) -> Res<()> {
    if !args.rootfs.join(".warren-complete").exists() {
        return Err(format!("no default image at {} (scripts/make-default-image.sh)", args.rootfs.display()));
    }
    let server = Server::start(&args.warren, &args.pool)?;
    let base = server.url.clone();
    let http = reqwest::Client::builder().no_proxy().build().map_err(|e| e.to_string())?;
    post(&http, &format!("{base}/v1/images"), &json!({"name": "default", "dir": args.rootfs})).await?;
    let py = json!({"image": "default", "language": "python", "code": CODE});
    let tru = json!({"image": "default", "argv": ["/bin/true"]});
    let mut report = String::new();
    let mut table: Vec<Row> = Vec::new();
    let n = args.samples;

    eprintln!("function calls (python)...");
    let load_before = loadavg();
    let mut timings: Vec<Value> = Vec::new();
    let mut forked = 0;
    let lat_fn = {
        let mut out = Vec::new();
        for i in 0..n + 5 {
            let t = Instant::now();
            let v = function_call(&http, &base, &py).await?;
            if i >= 5 {
                out.push(t.elapsed());
                timings.push(v["timings"].clone());
                forked += usize::from(v["forked"] == json!(true));
            }
            // Sequential latency with the pool at its steady state: the
            // refill of the last call's worker is not what is measured.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Latencies(out)
    };
    let mean = |k: &str| timings.iter().map(|t| t[k].as_f64().unwrap_or(0.0)).sum::<f64>() / timings.len() as f64;
    let split = format!(
        "queue {:.2} ms, setup (claim + files) {:.2} ms, run {:.2} ms, server total {:.2} ms",
        mean("queue_secs") * 1e3,
        mean("setup_secs") * 1e3,
        mean("run_secs") * 1e3,
        mean("total_secs") * 1e3
    );
    eprintln!("function calls (/bin/true)...");
    let lat_true = {
        let mut out = Vec::new();
        for i in 0..n + 5 {
            let t = Instant::now();
            function_call(&http, &base, &tru).await?;
            if i >= 5 {
                out.push(t.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Latencies(out)
    };
    eprintln!("function throughput...");
    let cpu_before = CpuReading::now(&server)?;
    let (fn_rate, fn_ok, fn_failed) = {
        let (http, base, py) = (http.clone(), base.clone(), py.clone());
        throughput(args.clients, args.secs, move || {
            let (http, base, py) = (http.clone(), base.clone(), py.clone());
            async move { function_call(&http, &base, &py).await.map(|_| ()) }
        })
        .await?
    };
    let cpu = cpu_before.per_call(&server, fn_ok)?;
    table.push(("warren function call (`python3` code)", lat_fn, Some((fn_rate, fn_failed))));
    table.push(("warren function call (`/bin/true`, no python)", lat_true, None));

    if !args.function_only {
        peers(&args, &http, &base, &mut table).await?;
    }
    drop(server);

    let now = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let date = Command::new("date")
        .args(["-u", "+%F"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let _ = writeln!(report, "# Function-call benchmark, {date}\n");
    let _ = writeln!(report, "- unix time: {now}");
    let _ = writeln!(
        report,
        "- machine: {} cores, kernel {}",
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        version("uname", "-r")
    );
    let _ = writeln!(
        report,
        "- warren: {} ({})",
        version(&args.warren.display().to_string(), "--version"),
        args.warren.display()
    );
    let _ = writeln!(report, "- bwrap: {}", version("bwrap", "--version"));
    let _ = writeln!(
        report,
        "- python in the image: {}",
        Command::new("chroot")
            .arg(&args.rootfs)
            .args(["python3", "--version"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default()
    );
    let _ = writeln!(report, "- server: `{}`", server_command(&args));
    let _ = writeln!(
        report,
        "- command: `target/release/warren-bench-function --samples {} --clients {} --secs {} --pool {}{}`",
        args.samples,
        args.clients,
        args.secs,
        args.pool,
        if args.function_only { " --function-only" } else { "" }
    );
    let _ = writeln!(report, "- call: `POST /v1/functions/run {py}` (the container path execs `python3 -c '{CODE}'` in a fresh sandbox of the same shape: 256 MiB, 64 MiB disk, 128 pids)\n");
    let _ = writeln!(report, "Latency: {n} sequential calls from one client after 5 warm-up calls (100 for the container path), 20 ms apart for the function calls so the pool is refilled as in steady use; throughput: {} concurrent clients for {} s.\n", args.clients, args.secs);
    let _ = writeln!(report, "| path | p50 ms | p99 ms | calls/s | failed |");
    let _ = writeln!(report, "|---|---|---|---|---|");
    for (name, lat, rate) in &table {
        let (r, f) = match rate {
            Some((r, f)) => (format!("{r:.1}"), f.to_string()),
            None => ("-".into(), "-".into()),
        };
        let _ = writeln!(report, "| {name} | {} | {} | {r} | {f} |", ms(lat.pct(50.0)), ms(lat.pct(99.0)));
    }
    let _ = writeln!(report, "\nServer-side split of a python function call (means): {split}; {forked} of the {n} sequential python calls were served by the fork server (`forked`).\n");
    let rest = cpu.host.saturating_sub(cpu.server + cpu.sandboxes);
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let _ = writeln!(
        report,
        "CPU per python call over the function throughput window ({fn_ok} calls): host {} ms = server process {} ms + sandboxes (python, init) {} ms + the rest (this bench's clients, kernel threads, anything else running) {} ms; {cores} cores / host CPU per call = {:.0} calls/s on otherwise idle cores.\n",
        ms(cpu.host),
        ms(cpu.server),
        ms(cpu.sandboxes),
        ms(rest),
        cores as f64 / cpu.host.as_secs_f64().max(1e-9)
    );
    let _ = writeln!(
        report,
        "Load average (1, 5, 15 min) before the function calls: {load_before}; at the end: {}.\n",
        loadavg()
    );
    let _ = writeln!(
        report,
        "Targets: p50 <= 5 ms end to end: **{}** ({} ms); >= 500 calls/s: **{}** ({fn_rate:.1}/s).",
        if table[0].1.pct(50.0) <= Duration::from_millis(5) { "met" } else { "not met" },
        ms(table[0].1.pct(50.0)),
        if fn_rate >= 500.0 { "met" } else { "not met" }
    );
    let out = args.out.unwrap_or_else(|| PathBuf::from(format!("bench/results/{date}-function.md")));
    std::fs::write(&out, &report).map_err(|e| format!("{}: {e}", out.display()))?;
    println!("{report}");
    eprintln!("written to {}", out.display());
    Ok(())
}

/// One row of the report's table: the path, its sequential latencies, and
/// its throughput (calls/s, failed calls) where it was measured.
type Row = (&'static str, Latencies, Option<(f64, usize)>);

/// The peers of a function call, each on the same machine in the same run:
/// the container path, a plain `bwrap` per call, python's own start-up.
async fn peers(args: &Args, http: &reqwest::Client, base: &str, table: &mut Vec<Row>) -> Res<()> {
    eprintln!("container path...");
    let lat_ct = sequential(args.samples / 2, || container_call(http, base)).await?;
    let (ct_rate, _, ct_failed) = {
        let (http, base) = (http.clone(), base.to_string());
        throughput(args.clients, args.secs, move || {
            let (http, base) = (http.clone(), base.to_string());
            async move { container_call(&http, &base).await }
        })
        .await?
    };
    table.push(("warren container create + exec `python3 -c` + destroy", lat_ct, Some((ct_rate, ct_failed))));

    eprintln!("bwrap per call...");
    let rootfs = args.rootfs.clone();
    let lat_bw = sequential(args.samples, || {
        let c = bwrap_command(&rootfs);
        async move { tokio::task::spawn_blocking(move || run_ok(c)).await.map_err(|e| e.to_string())? }
    })
    .await?;
    let (bw_rate, _, bw_failed) = {
        let rootfs = rootfs.clone();
        throughput(args.clients, args.secs, move || {
            let c = bwrap_command(&rootfs);
            async move { tokio::task::spawn_blocking(move || run_ok(c)).await.map_err(|e| e.to_string())? }
        })
        .await?
    };
    table.push(("plain `bwrap --unshare-all ... python3 -c` per call", lat_bw, Some((bw_rate, bw_failed))));

    eprintln!("python start-up...");
    let lat_py = sequential(args.samples, || {
        let c = chroot_python(&rootfs, CODE);
        async move { tokio::task::spawn_blocking(move || run_ok(c)).await.map_err(|e| e.to_string())? }
    })
    .await?;
    let (py_rate, _, py_failed) = {
        let rootfs = rootfs.clone();
        throughput(args.clients, args.secs, move || {
            let c = chroot_python(&rootfs, CODE);
            async move { tokio::task::spawn_blocking(move || run_ok(c)).await.map_err(|e| e.to_string())? }
        })
        .await?
    };
    table.push((
        "`chroot ROOTFS python3 -c` (python start-up alone, no isolation)",
        lat_py,
        Some((py_rate, py_failed)),
    ));
    Ok(())
}

/// The first three fields of `/proc/loadavg`: the machine is shared.
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(", "))
        .unwrap_or_default()
}

fn server_command(args: &Args) -> String {
    format!(
        "{} serve --destroy-on-exit --function-pool image=default,memory_mib=256,disk_mib=64,pids=128,{}",
        args.warren.display(),
        args.pool
    )
}

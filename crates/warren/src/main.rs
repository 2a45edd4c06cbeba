//! `warren`: the one CLI binary. It parses arguments and calls the crates;
//! the logic lives in them.

mod client;
mod cluster_cmd;
mod iam_cmd;
mod image_cmd;
mod serve;
mod trajectory_cmd;

use std::collections::BTreeMap;
use std::io::{BufRead, Write};
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use client::Client;
use futures_util::StreamExt;
use image_cmd::ImageCmd;
use warren_api::*;

#[derive(Parser)]
#[command(name = "warren", version, about = "Sandboxes for training and evaluating AI agents")]
struct Cli {
    /// Print machine-readable JSON instead of text.
    #[arg(long, global = true)]
    json: bool,
    /// Server URL.
    #[arg(long, global = true, env = "WARREN_URL", default_value = DEFAULT_URL)]
    url: String,
    #[command(subcommand)]
    cmd: Cmd,
}

// Parsed once at startup: boxing `ServeArgs` would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Cmd {
    /// Run the embedded server (API + node + state store).
    Serve(serve::ServeArgs),
    /// Create a sandbox, run one command streaming its output, delete it, and
    /// exit with the command's exit code. Starts an embedded server when none answers.
    Run {
        #[command(flatten)]
        spec: SpecArgs,
        /// Kill the command after this many seconds.
        #[arg(long)]
        timeout: Option<f64>,
        /// Data dir of the embedded server started when none is running.
        #[arg(long, default_value = "/var/lib/warren")]
        data_dir: PathBuf,
        /// The command; without one, the image's OCI Entrypoint + Cmd.
        #[arg(last = true)]
        command: Vec<String>,
    },
    /// Create, inspect, drive and delete sandboxes.
    #[command(subcommand)]
    Sandbox(SandboxCmd),
    /// Read, write and list files inside a sandbox.
    #[command(subcommand)]
    Files(FilesCmd),
    /// Import, pull, push, compose and inspect images.
    #[command(subcommand)]
    Image(ImageCmd),
    /// Show a sandbox's trajectory log, or replay it in a fresh sandbox.
    #[command(subcommand)]
    Trajectory(trajectory_cmd::TrajectoryCmd),
    /// A cluster's nodes and running sandboxes (ask an API server).
    #[command(subcommand)]
    Cluster(cluster_cmd::ClusterCmd),
    /// Projects: nested, each with its quotas (needs IAM; see docs/iam.md).
    #[command(subcommand)]
    Project(iam_cmd::ProjectCmd),
    /// API keys: `create` prints the secret once; `rm` revokes.
    #[command(subcommand)]
    Key(iam_cmd::KeyCmd),
}

#[derive(Args, Clone)]
struct SpecArgs {
    #[arg(long, default_value = DEFAULT_IMAGE)]
    image: String,
    /// CPU share, in cores (fractions allowed).
    #[arg(long)]
    cpus: Option<f64>,
    /// Memory limit; past it the OOM killer ends the command, not the sandbox.
    #[arg(long)]
    memory_mib: Option<u64>,
    /// Size of the writable layer.
    #[arg(long)]
    disk_mib: Option<u64>,
    /// Most processes and threads at once (a fork bomb stops here).
    #[arg(long)]
    pids: Option<u32>,
    /// Most files and directories in the writable layer (default 256 per MiB of disk).
    #[arg(long)]
    inodes: Option<u64>,
    /// Most open descriptors per process (RLIMIT_NOFILE).
    #[arg(long)]
    open_files: Option<u32>,
    /// `none`, `loopback` or `allowlist` (egress limited to the --allow
    /// rules and presets).
    #[arg(long)]
    network: Option<String>,
    #[command(flatten)]
    egress: EgressArgs,
    #[arg(long)]
    idle_timeout: Option<u64>,
    #[arg(long)]
    lifetime: Option<u64>,
    /// K=V, repeatable.
    #[arg(long = "env", value_parser = parse_kv)]
    env: Vec<(String, String)>,
    /// K=V, repeatable.
    #[arg(long = "label", value_parser = parse_kv)]
    labels: Vec<(String, String)>,
    #[arg(long)]
    idempotency_key: Option<String>,
    /// Named phases as JSON, e.g. `{"rollout": {"protected_paths": {"/answers": "none"}}}`.
    #[arg(long)]
    phases: Option<String>,
    /// The phase the sandbox starts in (required with --phases).
    #[arg(long)]
    phase: Option<String>,
}

/// An egress policy from the command line.
#[derive(Args, Clone, Default)]
struct EgressArgs {
    /// Allow TCP to HOST[:PORT]: a domain (`pypi.org`, `*.example.org`), an
    /// address or a prefix (`10.0.0.0/8:443`, `[fd00::1]:53`). Repeatable.
    #[arg(long = "allow")]
    allow: Vec<String>,
    /// Like --allow, for UDP.
    #[arg(long = "allow-udp")]
    allow_udp: Vec<String>,
    /// A server preset such as `pypi`, `npm`, `debian`. Repeatable.
    #[arg(long = "preset")]
    presets: Vec<String>,
    /// A whole policy as JSON (`{"presets": [...], "rules": [...]}`); the
    /// other flags add to it.
    #[arg(long = "policy")]
    policy_file: Option<PathBuf>,
}

impl EgressArgs {
    fn is_empty(&self) -> bool {
        self.allow.is_empty() && self.allow_udp.is_empty() && self.presets.is_empty() && self.policy_file.is_none()
    }

    fn policy(&self) -> Result<Option<NetworkPolicy>> {
        if self.is_empty() {
            return Ok(None);
        }
        let mut policy = match &self.policy_file {
            Some(path) => {
                let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
                serde_json::from_str(&text).with_context(|| format!("{} is not a network policy", path.display()))?
            }
            None => NetworkPolicy::default(),
        };
        policy.presets.extend(self.presets.iter().cloned());
        for (specs, protocol) in [(&self.allow, Protocol::Tcp), (&self.allow_udp, Protocol::Udp)] {
            for spec in specs {
                policy.rules.push(allow_rule(spec, protocol)?);
            }
        }
        Ok(Some(policy))
    }
}

/// `HOST[:PORT]`, HOST a domain, an address or a prefix; IPv6 in brackets.
fn allow_rule(spec: &str, protocol: Protocol) -> Result<NetworkRule> {
    let (host, port) = match spec.strip_prefix('[') {
        Some(rest) => match rest.split_once(']') {
            Some((host, tail)) => (host, tail.strip_prefix(':')),
            None => bail!("--allow {spec}: missing `]`"),
        },
        None => match spec.rsplit_once(':') {
            Some((host, port)) if !host.contains(':') => (host, Some(port)),
            _ => (spec, None),
        },
    };
    let ports = match port {
        Some(p) => vec![p.parse::<u16>().with_context(|| format!("--allow {spec}: bad port {p:?}"))?],
        None => Vec::new(),
    };
    let is_address = host.parse::<std::net::IpAddr>().is_ok() || warren_api::parse_cidr(host).is_some();
    Ok(NetworkRule {
        domain: (!is_address).then(|| host.to_string()),
        cidr: is_address.then(|| host.to_string()),
        ports,
        protocol,
    })
}

fn parse_kv(s: &str) -> Result<(String, String), String> {
    s.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())).ok_or_else(|| format!("`{s}` is not K=V"))
}

impl SpecArgs {
    fn request(&self) -> Result<CreateSandboxRequest> {
        let d = CreateSandboxRequest::default();
        Ok(CreateSandboxRequest {
            image: self.image.clone(),
            cpus: self.cpus.unwrap_or(d.cpus),
            memory_mib: self.memory_mib.unwrap_or(d.memory_mib),
            disk_mib: self.disk_mib.unwrap_or(d.disk_mib),
            pids: self.pids.unwrap_or(d.pids),
            inodes: self.inodes,
            open_files: self.open_files,
            network: match self.network.as_deref() {
                None | Some("none") => NetworkMode::None,
                Some("loopback") => NetworkMode::Loopback,
                Some("allowlist") => NetworkMode::Allowlist,
                Some(other) => bail!("--network must be none, loopback or allowlist, not {other}"),
            },
            network_policy: self.egress.policy()?,
            idle_timeout_secs: self.idle_timeout.unwrap_or(d.idle_timeout_secs),
            lifetime_secs: self.lifetime.unwrap_or(d.lifetime_secs),
            env: self.env.iter().cloned().collect::<BTreeMap<_, _>>(),
            labels: self.labels.iter().cloned().collect::<BTreeMap<_, _>>(),
            idempotency_key: self.idempotency_key.clone(),
            phases: match &self.phases {
                Some(json) => serde_json::from_str(json).context("--phases must be a JSON object of phases")?,
                None => BTreeMap::new(),
            },
            phase: self.phase.clone(),
            ..d
        })
    }
}

// Parsed once per process; boxing the create arguments would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum SandboxCmd {
    /// Create a sandbox and print its id.
    Create {
        #[command(flatten)]
        spec: SpecArgs,
    },
    /// List sandboxes, running and recently ended.
    Ls {
        /// Only sandboxes with this label (K=V).
        #[arg(long)]
        label: Option<String>,
    },
    /// Show one sandbox: state, resources, usage, end reason.
    Get { id: String },
    /// Run a command (argv) in a sandbox, streaming its output.
    Exec {
        id: String,
        #[arg(long)]
        timeout: Option<f64>,
        #[arg(long)]
        cwd: Option<String>,
        #[arg(long = "env", value_parser = parse_kv)]
        env: Vec<(String, String)>,
        #[arg(required = true, last = true)]
        command: Vec<String>,
    },
    /// A line-by-line shell session: cwd and exports persist between lines.
    Shell { id: String },
    /// Delete sandboxes (they end with reason `deleted`).
    Rm { ids: Vec<String> },
    /// Freeze sandboxes: their processes stop where they are until resumed
    /// (the next exec, session command or file call resumes one too).
    Pause { ids: Vec<String> },
    /// Let paused sandboxes run again.
    Resume { ids: Vec<String> },
    /// Snapshot the sandbox's writable layer into a new image (`pack_diff`).
    Pack {
        id: String,
        image: String,
        /// Absolute path to remove from the new image, whichever layer holds it (repeatable).
        #[arg(long)]
        scrub: Vec<String>,
    },
    /// Replace the egress policy of an `allowlist` sandbox, live.
    Network {
        id: String,
        #[command(flatten)]
        egress: EgressArgs,
    },
    /// Switch the sandbox to phase NAME; processes of earlier phases are
    /// killed unless --keep-running.
    Phase {
        id: String,
        name: String,
        /// Let running processes live on, with the rights of their phase.
        #[arg(long)]
        keep_running: bool,
    },
}

#[derive(Subcommand)]
enum FilesCmd {
    /// Upload a local file (or `-` for stdin) to PATH in the sandbox.
    Put {
        id: String,
        local: String,
        path: String,
        #[arg(long)]
        mode: Option<String>,
    },
    /// Download PATH from the sandbox to a local file (or `-` for stdout).
    Get { id: String, path: String, local: String },
    /// List the directory PATH in the sandbox.
    Ls { id: String, path: String },
}

fn print<T: serde::Serialize>(json: bool, value: &T, text: impl FnOnce(&T) -> String) {
    if json {
        println!("{}", serde_json::to_string_pretty(value).unwrap_or_default());
    } else {
        println!("{}", text(value));
    }
}

fn sandbox_line(s: &SandboxInfo) -> String {
    let state = match (s.state, s.end_reason) {
        (SandboxState::Ended, Some(r)) => format!(
            "ended ({})",
            serde_json::to_value(r).ok().and_then(|v| v.as_str().map(String::from)).unwrap_or_default()
        ),
        (st, _) => serde_json::to_value(st).ok().and_then(|v| v.as_str().map(String::from)).unwrap_or_default(),
    };
    format!("{}  {:<16} {:<10} {}", s.id, state, s.backend.as_str(), s.image)
}

async fn body_from(local: &str) -> Result<reqwest::Body> {
    if local == "-" {
        return Ok(reqwest::Body::wrap_stream(tokio_util::io::ReaderStream::new(tokio::io::stdin())));
    }
    let f = tokio::fs::File::open(local).await.with_context(|| format!("cannot open {local}"))?;
    Ok(reqwest::Body::wrap_stream(tokio_util::io::ReaderStream::new(f)))
}

async fn stream_exec(client: &Client, path: &str, req: &ExecRequest, json: bool) -> Result<ExecResult> {
    let result = client
        .exec_streaming(path, req, |stream, data| {
            if json {
                return;
            }
            let _ = match stream {
                StreamName::Stdout => std::io::stdout().write_all(data),
                StreamName::Stderr => std::io::stderr().write_all(data),
            };
        })
        .await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&result)?);
    }
    Ok(result)
}

fn exit_code_of(r: &ExecResult) -> i32 {
    match (r.exit_code, r.signal) {
        (Some(c), _) => c,
        (None, Some(s)) => 128 + s,
        _ => 125,
    }
}

async fn cmd_run(
    cli: &Cli,
    spec: &SpecArgs,
    timeout: Option<f64>,
    data_dir: &std::path::Path,
    command: &[String],
) -> Result<i32> {
    let mut client = Client::new(&cli.url);
    let mut embedded = None;
    if client.health().await.is_err() {
        let running = serve::start(&serve::ServeArgs::with_data_dir(data_dir.to_path_buf())).await?;
        client = Client::anonymous(&running.url);
        embedded = Some(running);
    }
    let request = spec.request()?;
    let argv = match command {
        [] => image_default_command(&client, &request.image).await?,
        given => given.to_vec(),
    };
    let sandbox = client.create(&request).await?;
    let req = ExecRequest { argv: Some(argv), timeout_secs: timeout, ..Default::default() };
    let result = stream_exec(&client, &format!("/v1/sandboxes/{}/exec", sandbox.id), &req, cli.json).await;
    let deleted = client.delete(&sandbox.id).await;
    if let Some(running) = embedded {
        let _ = running.stop.send(());
        running.node.shutdown(Some(EndReason::Shutdown)).await;
    }
    let result = result?;
    deleted?;
    if result.status == ExecStatus::TimedOut {
        eprintln!("warren: command timed out after {:.1}s", result.wall_time_secs);
        return Ok(124);
    }
    Ok(exit_code_of(&result))
}

/// What `warren run` runs when given no command: the image's OCI
/// Entrypoint + Cmd, as inspect reports them.
async fn image_default_command(client: &Client, image: &str) -> Result<Vec<String>> {
    let detail = client.inspect_image(image).await?;
    let argv = detail.config.map(|c| c.default_command()).unwrap_or_default();
    if argv.is_empty() {
        bail!("image {image} has no Entrypoint or Cmd: give the command after --");
    }
    Ok(argv)
}

async fn cmd_shell(client: &Client, id: &str) -> Result<()> {
    let session = client.create_session(id).await?;
    let path = format!("/v1/sandboxes/{id}/sessions/{}/exec", session.id);
    let stdin = std::io::stdin();
    eprint!("{id}$ ");
    for line in stdin.lock().lines() {
        let line = line?;
        if !line.trim().is_empty() {
            let r = stream_exec(client, &path, &ExecRequest::shell(line), false).await?;
            if r.exit_code != Some(0) {
                eprintln!("[exit {}]", exit_code_of(&r));
            }
        }
        eprint!("{id}$ ");
    }
    eprintln!();
    Ok(())
}

async fn real_main(cli: Cli) -> Result<i32> {
    let client = Client::new(&cli.url);
    let json = cli.json;
    match &cli.cmd {
        Cmd::Serve(args) => serve::run(args.clone()).await.map(|_| 0),
        Cmd::Run { spec, timeout, data_dir, command } => cmd_run(&cli, spec, *timeout, data_dir, command).await,
        Cmd::Sandbox(c) => {
            match c {
                SandboxCmd::Create { spec } => print(json, &client.create(&spec.request()?).await?, |s| s.id.clone()),
                SandboxCmd::Ls { label } => print(json, &client.list(label.as_deref()).await?, |l| {
                    l.sandboxes.iter().map(sandbox_line).collect::<Vec<_>>().join("\n")
                }),
                SandboxCmd::Get { id } => {
                    print(json, &client.get(id).await?, |s| serde_json::to_string_pretty(s).unwrap_or_default())
                }
                SandboxCmd::Exec { id, timeout, cwd, env, command } => {
                    let req = ExecRequest {
                        argv: Some(command.clone()),
                        cwd: cwd.clone(),
                        env: env.iter().cloned().collect(),
                        timeout_secs: *timeout,
                        ..Default::default()
                    };
                    let r = stream_exec(&client, &format!("/v1/sandboxes/{id}/exec"), &req, json).await?;
                    return Ok(exit_code_of(&r));
                }
                SandboxCmd::Shell { id } => cmd_shell(&client, id).await?,
                SandboxCmd::Pack { id, image, scrub } => {
                    let req = PackRequest { image: image.clone(), scrub: scrub.clone() };
                    print(json, &client.pack(id, &req).await?, |i| {
                        format!("packed into {} ({} layers)", i.name, i.layers.len())
                    })
                }
                SandboxCmd::Network { id, egress } => {
                    let policy = egress.policy()?.unwrap_or_default();
                    print(json, &client.set_network(id, &policy).await?, |s| {
                        let p = s.network_policy.clone().unwrap_or_default();
                        format!("{}: {} presets, {} rules", s.id, p.presets.len(), p.rules.len())
                    })
                }
                SandboxCmd::Phase { id, name, keep_running } => {
                    let req = SetPhaseRequest { name: name.clone(), kill_running: !keep_running };
                    print(json, &client.set_phase(id, &req).await?, |s| {
                        format!("{} is in phase {}", s.id, s.phase.as_deref().unwrap_or("-"))
                    })
                }
                SandboxCmd::Rm { ids } => {
                    for id in ids {
                        print(json, &client.delete(id).await?, sandbox_line);
                    }
                }
                SandboxCmd::Pause { ids } | SandboxCmd::Resume { ids } => {
                    let verb = if matches!(c, SandboxCmd::Pause { .. }) { "pause" } else { "resume" };
                    for id in ids {
                        print(json, &client.pause_or_resume(id, verb).await?, sandbox_line);
                    }
                }
            }
            Ok(0)
        }
        Cmd::Files(c) => {
            match c {
                FilesCmd::Put { id, local, path, mode } => {
                    print(json, &client.put_file(id, path, mode.as_deref(), body_from(local).await?).await?, |s| {
                        format!("{} {} bytes", s.path, s.size_bytes)
                    })
                }
                FilesCmd::Get { id, path, local } => {
                    let mut body = client.get_file(id, path).await?.bytes_stream();
                    let mut out: Box<dyn Write> = if local == "-" {
                        Box::new(std::io::stdout())
                    } else {
                        Box::new(std::fs::File::create(local).with_context(|| format!("cannot create {local}"))?)
                    };
                    while let Some(chunk) = body.next().await {
                        out.write_all(&chunk?)?;
                    }
                }
                FilesCmd::Ls { id, path } => print(json, &client.list_files(id, path).await?, |l| {
                    l.entries
                        .iter()
                        .map(|e| format!("{:o} {:>10} {}", e.mode, e.size_bytes, e.path))
                        .collect::<Vec<_>>()
                        .join("\n")
                }),
            }
            Ok(0)
        }
        Cmd::Image(c) => image_cmd::run(&client, json, c).await.map(|_| 0),
        Cmd::Cluster(c) => cluster_cmd::run(&client, json, c).await,
        Cmd::Trajectory(c) => trajectory_cmd::run(&client, json, c).await,
        Cmd::Project(c) => iam_cmd::run_project(&client, json, c).await.map(|_| 0),
        Cmd::Key(c) => iam_cmd::run_key(&client, json, c).await.map(|_| 0),
    }
}

fn main() {
    // The layer cache's holder: a tiny process keeping the fanotify group
    // open so unfilled layer ranges fail closed while no server runs.
    if std::env::args_os().nth(1).is_some_and(|a| a == warren_image::cache::HOLDER_ARG) {
        warren_image::cache::holder_main();
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("WARREN_LOG").unwrap_or_else(|_| "warn,warren=info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("warren: cannot start the runtime: {e}");
            std::process::exit(1);
        }
    };
    let code = runtime.block_on(real_main(cli)).unwrap_or_else(|e| {
        eprintln!("warren: {e:#}");
        1
    });
    std::process::exit(code);
}

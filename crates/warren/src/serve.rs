//! `warren serve`: the embedded single-process server - API, one node agent,
//! the redb state store and the local image store in one data directory.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use warren_backend::container::{ContainerConfig, ContainerDriver};
use warren_node::{Node, NodeConfig, PoolSpec};
use warren_store::RedbStore;

#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Where state, images and per-sandbox runtime files live.
    #[arg(long, env = "WARREN_DATA_DIR", default_value = "/var/lib/warren")]
    pub data_dir: PathBuf,
    /// Address to listen on; port 0 picks a free port (printed and written to
    /// `<data-dir>/server.url`).
    #[arg(long, default_value = "127.0.0.1:7070")]
    pub listen: SocketAddr,
    /// Names this server's cgroups, so several servers on one host never collide.
    #[arg(long, default_value = "warren")]
    pub instance: String,
    /// The in-sandbox agent binary (default: `warren-init` beside this binary).
    #[arg(long)]
    pub init_binary: Option<PathBuf>,
    /// Warm pool, e.g. `image=default,memory_mib=512,size=4` (repeatable).
    #[arg(long = "pool")]
    pub pools: Vec<PoolSpec>,
    #[arg(long, default_value_t = 4096)]
    pub max_sandboxes: usize,
    /// End every sandbox when the server stops (instead of leaving them to be
    /// re-adopted by the next start).
    #[arg(long)]
    pub destroy_on_exit: bool,
    /// Size bound of the node's cache of layered-image layers.
    #[arg(long, default_value_t = warren_node::DEFAULT_CACHE_BYTES)]
    pub layer_cache_bytes: u64,
    /// How long an ended sandbox's record, exec results and idempotency key
    /// are kept (and answered) before they are deleted.
    #[arg(long, default_value_t = warren_node::DEFAULT_ENDED_RETENTION_SECS)]
    pub ended_retention_secs: u64,
    /// IPv4 pool for `allowlist` sandboxes, split into one /30 each
    /// (default: a /20 of 10.128.0.0/9 picked by the instance name).
    #[arg(long)]
    pub sandbox_net: Option<String>,
    /// Static names for the platform resolver, `/etc/hosts` format; names
    /// not in it are resolved on the host.
    #[arg(long)]
    pub dns_hosts: Option<PathBuf>,
    /// Network presets, JSON `{"name": [rule, ...]}`, replacing the built-in
    /// `pypi`, `npm` and `debian` of the same name.
    #[arg(long)]
    pub network_presets: Option<PathBuf>,
}

impl ServeArgs {
    pub fn with_data_dir(data_dir: PathBuf) -> Self {
        ServeArgs {
            data_dir,
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            instance: "warren-run".into(),
            init_binary: None,
            pools: Vec::new(),
            max_sandboxes: 4096,
            destroy_on_exit: true,
            layer_cache_bytes: warren_node::DEFAULT_CACHE_BYTES,
            ended_retention_secs: warren_node::DEFAULT_ENDED_RETENTION_SECS,
            sandbox_net: None,
            dns_hosts: None,
            network_presets: None,
        }
    }
}

fn default_init_binary() -> Result<PathBuf> {
    let exe = std::env::current_exe().context("cannot find this binary's path")?;
    let dir = exe.parent().context("binary has no directory")?;
    // Integration tests run from target/<profile>/deps; the binaries are one level up.
    for candidate in [dir.join("warren-init"), dir.join("../warren-init")] {
        if candidate.is_file() {
            return Ok(candidate);
        }
    }
    anyhow::bail!("cannot find warren-init beside {}; pass --init-binary", exe.display())
}

/// A running server: its URL, its node, and how to stop it.
pub struct Running {
    pub url: String,
    pub node: Node,
    pub stop: tokio::sync::oneshot::Sender<()>,
    pub task: tokio::task::JoinHandle<std::io::Result<()>>,
}

pub async fn start(args: &ServeArgs) -> Result<Running> {
    std::fs::create_dir_all(&args.data_dir)
        .with_context(|| format!("cannot create data dir {}", args.data_dir.display()))?;
    // A sandbox's init resolves its root filesystem under the data dir after it
    // has become an unprivileged host uid: it needs search (not read) permission.
    std::fs::set_permissions(&args.data_dir, std::os::unix::fs::PermissionsExt::from_mode(0o711))
        .with_context(|| format!("cannot set the mode of {}", args.data_dir.display()))?;
    let init_binary = match &args.init_binary {
        Some(p) => p.clone(),
        None => default_init_binary()?,
    };
    let store = Arc::new(RedbStore::open(args.data_dir.join("state.redb")).context("cannot open the state store")?);
    let driver = Arc::new(
        ContainerDriver::new(ContainerConfig {
            run_dir: args.data_dir.join("run"),
            init_binary: init_binary.clone(),
            cgroup_instance: args.instance.clone(),
            uid_base_start: ContainerConfig::DEFAULT_UID_BASE_START,
        })
        .context("cannot start the container driver")?,
    );
    let node = Node::start(
        NodeConfig {
            data_dir: args.data_dir.clone(),
            instance: args.instance.clone(),
            init_binary,
            max_sandboxes: args.max_sandboxes,
            pools: args.pools.clone(),
            layer_cache: Some((
                warren_node::HolderCommand::current_exe()
                    .context("cannot find this binary for the layer cache's holder")?,
                args.layer_cache_bytes,
            )),
            ended_retention: std::time::Duration::from_secs(args.ended_retention_secs),
            network: warren_node::NetworkOptions {
                pool: args.sandbox_net.clone(),
                dns_hosts: args.dns_hosts.clone(),
                presets: args.network_presets.clone(),
            },
        },
        store,
        driver,
    )
    .await
    .context("cannot start the node")?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let url = format!("http://{}", listener.local_addr()?);
    write_url_file(&args.data_dir, &url)?;
    let (stop, stopped) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(warren_control::serve(listener, node.clone(), async move {
        let _ = stopped.await;
    }));
    Ok(Running { url, node, stop, task })
}

fn write_url_file(data_dir: &Path, url: &str) -> Result<()> {
    let tmp = data_dir.join("server.url.tmp");
    std::fs::write(&tmp, format!("{url}\n"))?;
    std::fs::rename(&tmp, data_dir.join("server.url"))?;
    Ok(())
}

/// `warren serve`: runs until SIGINT or SIGTERM.
pub async fn run(args: ServeArgs) -> Result<()> {
    let running = start(&args).await?;
    println!("warren listening on {}", running.url);
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tracing::info!("shutting down");
    let _ = running.stop.send(());
    running.node.shutdown(args.destroy_on_exit.then_some(warren_api::EndReason::Shutdown)).await;
    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), running.task).await;
    let _ = std::fs::remove_file(args.data_dir.join("server.url"));
    Ok(())
}

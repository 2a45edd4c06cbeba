//! `warren serve`: the embedded single-process server - API, one node agent,
//! the redb state store and the local image store in one data directory.

use std::future::IntoFuture;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use warren_backend::container::{ContainerConfig, ContainerDriver};
use warren_backend::microvm::{MicroVmConfig, MicroVmDriver};
use warren_node::{FunctionPoolSpec, Node, NodeConfig, PoolSpec};
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
    /// Warm pool of one-use function-call workers, e.g.
    /// `image=default,min=2,max=8,queue=64,memory_mib=256` (repeatable).
    #[arg(long = "function-pool")]
    pub function_pools: Vec<FunctionPoolSpec>,
    #[arg(long, default_value_t = 4096)]
    pub max_sandboxes: usize,
    /// First host uid of the container sandboxes' uid ranges (65536 ids
    /// each, one per live sandbox, up to `u32::MAX`); the 65536 ids below it
    /// are the VMs' QEMU uids (one per VM). Servers sharing a host should
    /// get disjoint ranges, so no two sandboxes share host ids.
    #[arg(long, default_value_t = ContainerConfig::DEFAULT_UID_BASE_START)]
    pub uid_base_start: u32,
    /// Memory (MiB) the running sandboxes may ask for in all (paused ones do
    /// not count); creates past it wait in the admission queue.
    #[arg(long)]
    pub max_memory_mib: Option<u64>,
    /// Creates that may wait for room at once; one more is refused with
    /// 429 `queue_full`.
    #[arg(long, default_value_t = warren_api::DEFAULT_ADMISSION_QUEUE_LIMIT)]
    pub admission_queue_limit: usize,
    /// End every sandbox when the server stops (instead of leaving them to be
    /// re-adopted by the next start).
    #[arg(long)]
    pub destroy_on_exit: bool,
    /// Size bound of the node's cache of layered-image layers.
    #[arg(long, default_value_t = warren_node::DEFAULT_CACHE_BYTES)]
    pub layer_cache_bytes: u64,
    /// Docker-style `config.json` whose `auths` entry for a registry's host
    /// is used by pulls and pushes that bring no `auth` of their own.
    #[arg(long)]
    pub registry_auth_file: Option<PathBuf>,
    /// Keep layered images' chunks in an S3-compatible bucket,
    /// `http(s)://host:port/bucket`, instead of `<data-dir>/blobs`. Keys
    /// from `WARREN_S3_ACCESS_KEY_ID` / `WARREN_S3_SECRET_ACCESS_KEY`
    /// (region `WARREN_S3_REGION`, default us-east-1).
    #[arg(long)]
    pub blob_store_s3: Option<String>,
    /// Chunk size of layers imported from now on (a power of two, 4096 to
    /// 64 MiB; default 1 MiB).
    #[arg(long)]
    pub chunk_size_bytes: Option<u64>,
    /// Piece size of layers imported from now on: the unit a node fetches
    /// and verifies inside a chunk with a ranged GET (a power of two from
    /// 4096 up to the chunk size; default 16 KiB; 0 = whole chunks only).
    #[arg(long)]
    pub piece_size_bytes: Option<u64>,
    /// Readahead window of lazily filled layer mounts, in KiB (default 16;
    /// 0 keeps the kernel's 128). Bytes readahead covers are fetched.
    #[arg(long)]
    pub layer_readahead_kb: Option<u32>,
    /// Readahead window a layer mount gets once a sandbox that read from the
    /// layer has ended on this node, in KiB (default 128; 0 keeps the first
    /// window).
    #[arg(long)]
    pub layer_warm_readahead_kb: Option<u32>,
    /// Once a sandbox that read from a layer has ended on this node, fetch
    /// the rest of the layer in the background; a complete layer is read
    /// with no fill daemon in the path. Costs the layer's remaining bytes
    /// from the store, once per node. On by default;
    /// `--layer-complete-after-use=false` keeps layers lazy for good.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub layer_complete_after_use: Option<bool>,
    /// How far ahead of a sequential reader of a lazily filled layer the
    /// node fetches, in KiB (0 = no prefetch).
    #[arg(long, default_value_t = warren_image::cache::DEFAULT_PREFETCH_KB)]
    pub layer_prefetch_kb: u32,
    /// Prefetch requests (ranged GETs) in flight per layer, at most (0 = no
    /// prefetch).
    #[arg(long, default_value_t = warren_image::cache::DEFAULT_PREFETCH_REQUESTS)]
    pub layer_prefetch_requests: usize,
    /// A miss in a file of a layer with at most this much data (KiB) fetches
    /// the whole file in the same request (0 = off).
    #[arg(long, default_value_t = warren_image::cache::DEFAULT_WHOLE_FILE_KB)]
    pub layer_whole_file_kb: u32,
    /// Ranged GETs in flight while a layer new to this node replays its
    /// stored access trace (0 = access traces off: none is replayed,
    /// recorded or stored).
    #[arg(long, default_value_t = warren_image::cache::DEFAULT_TRACE_REQUESTS)]
    pub layer_trace_requests: usize,
    /// Fill events of lazily filled layers served at once.
    #[arg(long, default_value_t = warren_image::cache::DEFAULT_FILL_THREADS)]
    pub layer_fill_threads: usize,
    /// How long an ended sandbox's record, exec results and idempotency key
    /// are kept (and answered) before they are deleted.
    #[arg(long, default_value_t = warren_node::DEFAULT_ENDED_RETENTION_SECS)]
    pub ended_retention_secs: u64,
    /// How long a sandbox's trajectory log (`GET .../trajectory`) is kept
    /// after the sandbox ended.
    #[arg(long, default_value_t = warren_node::trajectory::DEFAULT_TRAJECTORY_RETENTION_SECS)]
    pub trajectory_retention_secs: u64,
    /// Finished execs' captured output a sandbox may have kept on this node
    /// (its exec results and trajectory), in MiB: past it the oldest
    /// outputs are dropped (`output_expired`), their results kept. The
    /// newest exec's output is always kept.
    #[arg(long, default_value_t = warren_node::DEFAULT_EXEC_OUTPUT_RETENTION_MIB)]
    pub exec_output_retention_mib: u64,
    /// Uploads a sandbox's trajectory keeps for replay, in MiB (each
    /// distinct content once; an upload above 64 MiB never is): past it
    /// an upload is logged by its digest only and a replay skips it.
    #[arg(long, default_value_t = warren_node::DEFAULT_UPLOAD_RETENTION_MIB)]
    pub upload_retention_mib: u64,
    /// While less than this percentage of the data directory's filesystem
    /// is available, ended sandboxes (record, exec results, trajectory and
    /// its files) are forgotten before their retention is up, the longest
    /// ended first, until it is above again (0 = never).
    #[arg(long, default_value_t = warren_node::DEFAULT_DISK_RESERVE_PERCENT,
        value_parser = clap::value_parser!(u8).range(0..=100))]
    pub disk_reserve_percent: u8,
    /// How long (ms) a create may take before it is abandoned, what it made
    /// removed, and the caller answered 504 `timed_out`.
    #[arg(long, default_value_t = warren_node::DEFAULT_CREATE_TIMEOUT.as_millis() as u64)]
    pub create_timeout_ms: u64,
    /// IPv4 pool for `allowlist` sandboxes, split into one /30 each
    /// (default: a /20 of 10.128.0.0/9 picked by the instance name).
    #[arg(long)]
    pub sandbox_net: Option<String>,
    /// IPv6 pool for `allowlist` sandboxes (a /32 to a /120, ULA advised),
    /// split into one /126 each and masqueraded (NAT66) like the IPv4 pool
    /// (default: a ULA /64, fdXX:XXXX:XXXX::/64, picked by the instance
    /// name). Needs Linux 6.17+ (per-interface IPv6 force_forwarding);
    /// without it sandboxes get IPv4 egress only.
    #[arg(long)]
    pub sandbox_net6: Option<String>,
    /// Static names for the platform resolver, `/etc/hosts` format; names
    /// not in it are resolved on the host.
    #[arg(long)]
    pub dns_hosts: Option<PathBuf>,
    /// Network presets, JSON `{"name": [rule, ...]}`, replacing the built-in
    /// `pypi`, `npm` and `debian` of the same name.
    #[arg(long)]
    pub network_presets: Option<PathBuf>,
    /// API keys the E2B-compatible API accepts in `X-API-KEY` (repeatable,
    /// or comma-separated in the environment variable). None: keys are not
    /// checked, like the v1 API (see docs/e2b.md).
    #[arg(long = "e2b-api-key", env = "WARREN_E2B_API_KEYS", value_delimiter = ',', hide_env_values = true)]
    pub e2b_api_keys: Vec<String>,
    /// The Warren image an E2B sandbox gets for E2B's default template
    /// (`base`) or none.
    #[arg(long, env = "WARREN_E2B_DEFAULT_TEMPLATE", default_value = warren_api::DEFAULT_IMAGE)]
    pub e2b_default_template: String,
    /// `on`: every v1 request needs an API key (`Authorization: Bearer`);
    /// the first start writes a root-project key to `<data-dir>/admin.key`
    /// (`--role api`: the first API server of the cluster, once).
    /// `off`: requests without a key act as the root project - local use
    /// only (see docs/iam.md).
    #[arg(long, value_enum, env = "WARREN_AUTH", default_value_t = crate::iam_cmd::AuthMode::Off)]
    pub auth: crate::iam_cmd::AuthMode,
    /// `embedded`: API, node agent and state store in this one process.
    /// `node`: a cluster's node agent (registers in etcd; answers only API
    /// servers). `api`: a cluster's stateless API server. See docs/cluster.md.
    #[arg(long, value_enum, default_value_t = Role::Embedded)]
    pub role: Role,
    /// etcd client URLs of the cluster (comma-separated or repeated).
    #[arg(long = "etcd", env = "WARREN_ETCD", value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// Every cluster key lives under this etcd prefix.
    #[arg(long, default_value = "/warren")]
    pub etcd_prefix: String,
    /// This node's name in the cluster (`--role node`): 1-16 of [a-z0-9].
    #[arg(long)]
    pub node_name: Option<String>,
    /// The URL API servers reach this node at (`--role node`; default:
    /// `http://<listen address>`).
    #[arg(long)]
    pub advertise: Option<String>,
    /// File with the cluster token API servers present to nodes (cluster
    /// roles; mode 0600).
    #[arg(long)]
    pub cluster_token_file: Option<PathBuf>,
    /// How long a node that stopped renewing its registration counts as
    /// alive (`--role node`); after it, its sandboxes end `node_lost`.
    #[arg(long, default_value_t = 5)]
    pub node_ttl_secs: u64,
    /// A VM backend (`microvm`, `vm`) this server does not offer even where
    /// the host could run it: its creates answer `unsupported_backend`
    /// (repeatable).
    #[arg(long = "disable-backend", value_parser = ["microvm", "vm"])]
    pub disabled_backends: Vec<String>,
    /// Snapshot boot for `microvm` and `vm`: per image and VM shape the node keeps a
    /// snapshot of a booted, idle guest and restores it on create (the
    /// first create of a shape boots and builds it). See docs/architecture.md.
    #[arg(long, default_value = "off", value_parser = ["off", "on"])]
    pub vm_snapshots: String,
    /// Landlock denials as `landlock` security events, read from the
    /// kernel's audit records. `auto` and `on`: if no audit daemon runs,
    /// this server registers as the audit daemon, adds a `never,task` audit
    /// rule (so no process pays audit's per-syscall cost) and enables audit
    /// host-wide until it stops (restoring all three then, or at the next
    /// start after a crash); with one running, it reads that daemon's
    /// records. Where audit cannot be enabled, `auto` warns and runs without
    /// these events (`GET /v1/stats` `landlock_events` says why) and `on`
    /// refuses to start. `off`: never (see docs/security.md).
    #[arg(long, default_value = "auto", value_parser = ["off", "on", "auto"])]
    pub landlock_audit: String,
}

/// What `warren serve` runs as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Role {
    Embedded,
    Node,
    Api,
}

impl ServeArgs {
    pub fn with_data_dir(data_dir: PathBuf) -> Self {
        ServeArgs {
            data_dir,
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            instance: "warren-run".into(),
            init_binary: None,
            pools: Vec::new(),
            function_pools: Vec::new(),
            max_sandboxes: 4096,
            uid_base_start: ContainerConfig::DEFAULT_UID_BASE_START,
            max_memory_mib: None,
            admission_queue_limit: warren_api::DEFAULT_ADMISSION_QUEUE_LIMIT,
            destroy_on_exit: true,
            layer_cache_bytes: warren_node::DEFAULT_CACHE_BYTES,
            registry_auth_file: None,
            blob_store_s3: None,
            chunk_size_bytes: None,
            piece_size_bytes: None,
            layer_readahead_kb: None,
            layer_warm_readahead_kb: None,
            layer_complete_after_use: None,
            layer_prefetch_kb: warren_image::cache::DEFAULT_PREFETCH_KB,
            layer_prefetch_requests: warren_image::cache::DEFAULT_PREFETCH_REQUESTS,
            layer_whole_file_kb: warren_image::cache::DEFAULT_WHOLE_FILE_KB,
            layer_trace_requests: warren_image::cache::DEFAULT_TRACE_REQUESTS,
            layer_fill_threads: warren_image::cache::DEFAULT_FILL_THREADS,
            ended_retention_secs: warren_node::DEFAULT_ENDED_RETENTION_SECS,
            trajectory_retention_secs: warren_node::trajectory::DEFAULT_TRAJECTORY_RETENTION_SECS,
            exec_output_retention_mib: warren_node::DEFAULT_EXEC_OUTPUT_RETENTION_MIB,
            upload_retention_mib: warren_node::DEFAULT_UPLOAD_RETENTION_MIB,
            disk_reserve_percent: warren_node::DEFAULT_DISK_RESERVE_PERCENT,
            create_timeout_ms: warren_node::DEFAULT_CREATE_TIMEOUT.as_millis() as u64,
            sandbox_net: None,
            sandbox_net6: None,
            dns_hosts: None,
            network_presets: None,
            e2b_api_keys: Vec::new(),
            e2b_default_template: warren_api::DEFAULT_IMAGE.to_string(),
            auth: crate::iam_cmd::AuthMode::Off,
            role: Role::Embedded,
            etcd: Vec::new(),
            etcd_prefix: "/warren".into(),
            node_name: None,
            advertise: None,
            cluster_token_file: None,
            node_ttl_secs: 5,
            disabled_backends: Vec::new(),
            vm_snapshots: "off".into(),
            landlock_audit: "auto".into(),
        }
    }
}

/// `http(s)://host:port/bucket` plus the keys from the environment.
fn s3_config(url: &str) -> Result<warren_node::S3Config> {
    let (scheme, rest) = url.split_once("://").context("--blob-store-s3 must be http(s)://host:port/bucket")?;
    let (host, bucket) = rest.split_once('/').context("--blob-store-s3 must name the bucket after the host")?;
    let bucket = bucket.trim_end_matches('/');
    if bucket.is_empty() || bucket.contains('/') || !matches!(scheme, "http" | "https") {
        anyhow::bail!("--blob-store-s3 must be http(s)://host:port/bucket");
    }
    let key = |name: &str| std::env::var(name).with_context(|| format!("--blob-store-s3 needs {name} set"));
    Ok(warren_node::S3Config {
        endpoint: format!("{scheme}://{host}"),
        bucket: bucket.to_string(),
        region: std::env::var("WARREN_S3_REGION").unwrap_or_else(|_| "us-east-1".into()),
        access_key_id: key("WARREN_S3_ACCESS_KEY_ID")?,
        secret_access_key: key("WARREN_S3_SECRET_ACCESS_KEY")?,
        allow_http: scheme == "http",
    })
}

/// Where layered images' chunks live and how the node's layer cache fetches them.
fn blob_store_config(args: &ServeArgs) -> Result<warren_node::BlobStoreConfig> {
    Ok(warren_node::BlobStoreConfig {
        s3: args.blob_store_s3.as_deref().map(s3_config).transpose()?,
        chunk_size_bytes: args.chunk_size_bytes,
        piece_size_bytes: args.piece_size_bytes,
        layer_readahead_kb: args.layer_readahead_kb,
        layer_warm_readahead_kb: args.layer_warm_readahead_kb,
        layer_complete_after_use: args.layer_complete_after_use,
        layer_prefetch: warren_image::cache::PrefetchConfig {
            max_ahead_bytes: u64::from(args.layer_prefetch_kb) * 1024,
            max_requests: args.layer_prefetch_requests,
            whole_file_bytes: u64::from(args.layer_whole_file_kb) * 1024,
            trace_requests: args.layer_trace_requests,
        },
        layer_fill_threads: Some(args.layer_fill_threads),
    })
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
    /// The node's registration with the cluster (`--role node`).
    pub registration: Option<warren_cluster::node_agent::Registration>,
    pub stop: tokio::sync::oneshot::Sender<()>,
    pub task: tokio::task::JoinHandle<std::io::Result<()>>,
}

/// Refuses a data dir below a directory that others may not search (such
/// as a `mktemp -d` directory, mode 0700): a sandbox's init resolves its
/// root filesystem there after it has become an unprivileged host uid, so
/// every create would fail on it. Said once at start instead.
fn check_sandboxes_reach(data_dir: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let full = std::fs::canonicalize(data_dir).with_context(|| format!("cannot resolve {}", data_dir.display()))?;
    for dir in full.ancestors().skip(1) {
        let mode =
            std::fs::metadata(dir).with_context(|| format!("cannot stat {}", dir.display()))?.permissions().mode();
        if mode & 0o001 == 0 {
            anyhow::bail!(
                "sandboxes cannot reach the data dir {}: {} has mode {:o}, and a sandbox's init (an unprivileged \
                 host uid) needs search permission on every directory above the data dir; `chmod o+x {}` or use \
                 another --data-dir",
                full.display(),
                dir.display(),
                mode & 0o7777,
                dir.display()
            );
        }
    }
    Ok(())
}

pub async fn start(args: &ServeArgs) -> Result<Running> {
    // Absolute from here on: a VM's QEMU runs in its sandbox's directory
    // (see `warren_backend::unix_sock`), and every path it is given must
    // mean the same there.
    let data_dir = std::path::absolute(&args.data_dir)
        .with_context(|| format!("cannot resolve data dir {}", args.data_dir.display()))?;
    let args = &ServeArgs { data_dir, ..args.clone() };
    let cluster = match args.role {
        Role::Node => Some(NodeRole::from_args(args).await?),
        Role::Embedded => None,
        Role::Api => anyhow::bail!("an API server runs no node: use `warren serve --role api` (serve::run)"),
    };
    std::fs::create_dir_all(&args.data_dir)
        .with_context(|| format!("cannot create data dir {}", args.data_dir.display()))?;
    check_sandboxes_reach(&args.data_dir)?;
    // A sandbox's init resolves its root filesystem under the data dir after it
    // has become an unprivileged host uid: it needs search (not read) permission.
    std::fs::set_permissions(&args.data_dir, std::os::unix::fs::PermissionsExt::from_mode(0o711))
        .with_context(|| format!("cannot set the mode of {}", args.data_dir.display()))?;
    protect_the_node(&[args.instance.clone(), vm_instance(args), full_vm_instance(args)])?;
    let init_binary = match &args.init_binary {
        Some(p) => p.clone(),
        None => default_init_binary()?,
    };
    let store = Arc::new(RedbStore::open(args.data_dir.join("state.redb")).context("cannot open the state store")?);
    // IAM is the API's: a cluster node answers only API servers, which enforce it.
    let auth = match cluster {
        None => Some(crate::iam_cmd::serve_auth(args.auth, &args.data_dir, store.clone(), &args.listen.to_string())?),
        Some(_) => None,
    };
    let driver = Arc::new(
        ContainerDriver::new(ContainerConfig {
            run_dir: args.data_dir.join("run"),
            init_binary: init_binary.clone(),
            cgroup_instance: args.instance.clone(),
            uid_base_start: args.uid_base_start,
        })
        .context("cannot start the container driver")?,
    );
    let vm_drivers = vm_drivers(args, &init_binary);
    let node = Node::start_with(
        NodeConfig {
            data_dir: args.data_dir.clone(),
            instance: args.instance.clone(),
            init_binary,
            max_sandboxes: args.max_sandboxes,
            max_memory_mib: args.max_memory_mib,
            admission_queue_limit: args.admission_queue_limit,
            pools: args.pools.clone(),
            function_pools: args.function_pools.clone(),
            layer_cache: Some((
                warren_node::HolderCommand::current_exe()
                    .context("cannot find this binary for the layer cache's holder")?,
                args.layer_cache_bytes,
            )),
            registry_auth_file: args.registry_auth_file.clone(),
            blob_store: blob_store_config(args)?,
            ended_retention: std::time::Duration::from_secs(args.ended_retention_secs),
            trajectory_retention: std::time::Duration::from_secs(args.trajectory_retention_secs),
            exec_output_retention_bytes: args.exec_output_retention_mib.saturating_mul(1 << 20),
            upload_retention_bytes: args.upload_retention_mib.saturating_mul(1 << 20),
            disk_reserve_percent: args.disk_reserve_percent,
            create_timeout: std::time::Duration::from_millis(args.create_timeout_ms),
            network: warren_node::NetworkOptions {
                pool: args.sandbox_net.clone(),
                pool6: args.sandbox_net6.clone(),
                dns_hosts: args.dns_hosts.clone(),
                presets: args.network_presets.clone(),
            },
            sandbox_id_prefix: cluster.as_ref().map_or_else(
                || warren_node::SANDBOX_ID_PREFIX.to_string(),
                |c| warren_cluster::records::sandbox_id_prefix(&c.name),
            ),
            landlock_audit: args.landlock_audit.parse().map_err(|e: String| anyhow::anyhow!("--landlock-audit {e}"))?,
        },
        store,
        driver,
        vm_drivers,
    )
    .await
    .context("cannot start the node")?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let url = format!("http://{}", listener.local_addr()?);
    write_url_file(&args.data_dir, &url)?;
    let (stop, stopped) = tokio::sync::oneshot::channel();
    let e2b = warren_control::E2bConfig {
        api_keys: args.e2b_api_keys.iter().filter(|k| !k.is_empty()).cloned().collect(),
        default_template: args.e2b_default_template.clone(),
    };
    let mut router = warren_control::router_with_e2b_and_auth(node.clone(), e2b, auth);
    if let Some(c) = &cluster {
        router =
            router.layer(axum::middleware::from_fn_with_state(c.token.clone(), warren_cluster::token::require_token));
    }
    let serving = axum::serve(listener, router).with_graceful_shutdown(async move {
        let _ = stopped.await;
    });
    let task = tokio::spawn(serving.into_future());
    let registration = match cluster {
        Some(c) => {
            let config = warren_cluster::node_agent::NodeAgentConfig {
                name: c.name,
                url: args.advertise.clone().unwrap_or_else(|| url.clone()),
                data_dir: args.data_dir.clone(),
                ttl: std::time::Duration::from_secs(args.node_ttl_secs),
                heartbeat: warren_cluster::node_agent::DEFAULT_HEARTBEAT,
            };
            Some(
                warren_cluster::node_agent::register(node.clone(), c.store, config)
                    .await
                    .context("cannot register this node with the cluster")?,
            )
        }
        None => None,
    };
    Ok(Running { url, node, registration, stop, task })
}

/// A cluster node's settings, checked before anything starts.
struct NodeRole {
    name: String,
    token: warren_cluster::token::ClusterToken,
    store: Arc<warren_store_etcd::EtcdStore>,
}

impl NodeRole {
    async fn from_args(args: &ServeArgs) -> Result<NodeRole> {
        let name = args.node_name.clone().context("--role node needs --node-name")?;
        warren_cluster::records::check_node_name(&name)?;
        Ok(NodeRole { name, token: cluster_token(args)?, store: etcd_store(args).await? })
    }
}

fn cluster_token(args: &ServeArgs) -> Result<warren_cluster::token::ClusterToken> {
    let path = args.cluster_token_file.as_ref().context("cluster roles need --cluster-token-file")?;
    Ok(warren_cluster::token::ClusterToken::read(path)?)
}

/// Connects to etcd and checks that a quorum answers.
async fn etcd_store(args: &ServeArgs) -> Result<Arc<warren_store_etcd::EtcdStore>> {
    anyhow::ensure!(!args.etcd.is_empty(), "cluster roles need --etcd URL[,URL...]");
    let config = warren_store_etcd::EtcdConfig::new(args.etcd.clone()).with_prefix(args.etcd_prefix.clone());
    let store = tokio::task::spawn_blocking(move || {
        let store = warren_store_etcd::EtcdStore::connect(config)?;
        store.check()?;
        Ok::<_, warren_store_etcd::EtcdError>(store)
    })
    .await?
    .context("cannot reach etcd")?;
    Ok(Arc::new(store))
}

/// `warren serve --role api`: a stateless API server until SIGINT or SIGTERM.
async fn run_api(args: ServeArgs) -> Result<()> {
    let signals = StopSignals::take_over()?;
    let token = cluster_token(&args)?;
    let store = etcd_store(&args).await?;
    std::fs::create_dir_all(&args.data_dir)
        .with_context(|| format!("cannot create data dir {}", args.data_dir.display()))?;
    let auth = crate::iam_cmd::cluster_auth(args.auth, &args.data_dir, store.clone(), &args.listen.to_string()).await?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = warren_cluster::api::start(listener, store, token, auth, async move {
        let _ = stopped.await;
    })
    .await
    .context("cannot start the API server")?;
    let url = format!("http://{}", server.addr);
    write_url_file(&args.data_dir, &url)?;
    println!("warren API server listening on {url}");
    signals.wait().await;
    let _ = stop.send(());
    server.abort_watcher();
    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), server.task).await;
    let _ = std::fs::remove_file(args.data_dir.join("server.url"));
    Ok(())
}

/// SIGINT and SIGTERM, taken over before the server starts: a signal that
/// arrives once `server.url` exists must end the server through its clean
/// shutdown (which also puts the host's audit settings back), never by the
/// default action (seen in CI: a SIGTERM right after start-up left the
/// server registered as the host's audit daemon).
struct StopSignals {
    term: tokio::signal::unix::Signal,
    interrupt: tokio::signal::unix::Signal,
}

impl StopSignals {
    fn take_over() -> Result<StopSignals> {
        use tokio::signal::unix::{signal, SignalKind};
        let term = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
        let interrupt = signal(SignalKind::interrupt()).context("cannot handle SIGINT")?;
        Ok(StopSignals { term, interrupt })
    }

    async fn wait(mut self) {
        tokio::select! {
            _ = self.interrupt.recv() => {}
            _ = self.term.recv() => {}
        }
    }
}

/// The microVM and full-VM drivers when this host has QEMU and a cloud
/// kernel; without them `microvm` and `vm` creates answer
/// `unsupported_backend` (logged once here).
fn vm_drivers(
    args: &ServeArgs,
    init_binary: &Path,
) -> std::collections::HashMap<warren_api::Backend, Arc<dyn warren_backend::Driver>> {
    let mut drivers = std::collections::HashMap::new();
    let disabled = |name: &str| args.disabled_backends.iter().any(|b| b == name);
    if disabled("microvm") && disabled("vm") {
        return drivers;
    }
    // Each QEMU runs as a host uid of its own, from just below the
    // containers' ranges: the microVMs' half, then the full VMs'.
    let qemu_uids = |half: u32| args.uid_base_start.checked_sub((2 - half) * warren_backend::microvm::QEMU_UIDS);
    let config = MicroVmConfig::discover(args.data_dir.join("vm"), init_binary.to_path_buf(), vm_instance(args))
        .map(|c| MicroVmConfig { snapshots: args.vm_snapshots == "on", qemu_uid_start: qemu_uids(0), ..c });
    match config.and_then(MicroVmDriver::new) {
        Ok(driver) if !disabled("microvm") => {
            drivers.insert(warren_api::Backend::Microvm, Arc::new(driver) as Arc<dyn warren_backend::Driver>);
        }
        Ok(_) => tracing::info!("the microvm backend is disabled (--disable-backend)"),
        Err(e) => tracing::warn!("the microvm backend is unavailable: {e}"),
    }
    let config =
        MicroVmConfig::discover_full(args.data_dir.join("fullvm"), init_binary.to_path_buf(), full_vm_instance(args))
            .map(|c| MicroVmConfig { snapshots: args.vm_snapshots == "on", qemu_uid_start: qemu_uids(1), ..c });
    match config.and_then(MicroVmDriver::new) {
        Ok(driver) if !disabled("vm") => {
            drivers.insert(warren_api::Backend::Vm, Arc::new(driver) as Arc<dyn warren_backend::Driver>);
        }
        Ok(_) => tracing::info!("the vm backend is disabled (--disable-backend)"),
        Err(e) => tracing::warn!("the vm backend is unavailable: {e}"),
    }
    drivers
}

/// The cgroup instance of the full-VM driver's QEMU processes (each driver
/// sweeps everything under its own instance).
fn full_vm_instance(args: &ServeArgs) -> String {
    format!("{}-fullvm", args.instance)
}

/// The cgroup instance of the microVM driver's QEMU processes.
fn vm_instance(args: &ServeArgs) -> String {
    format!("{}-vm", args.instance)
}

/// Keeps part of the host's memory and pid space out of reach of every
/// sandbox (each cgroup instance's parents are capped at the host minus a
/// reserve) and makes this process the OOM killer's last choice, so that
/// sandboxes cannot starve the node agent (see `warren_guard::reserve`).
fn protect_the_node(instances: &[String]) -> Result<()> {
    use warren_guard::reserve;
    let host = reserve::HostTotals::read().context("cannot read the host's memory and pid totals")?;
    let keep = reserve::NodeReserve::default_for(&host);
    for instance in instances {
        let limits = reserve::cap_instance(instance, &host, &keep)
            .with_context(|| format!("cannot cap the sandboxes of cgroup instance {instance}"))?;
        tracing::info!(instance, memory_bytes = limits.memory_bytes, pids = limits.pids, "sandboxes capped together");
    }
    if !reserve::protect_agent_from_oom_killer().context("cannot lower the node agent's OOM score")? {
        tracing::warn!("no CAP_SYS_RESOURCE: the node agent keeps its OOM score, like the sandboxes' PID 1s");
    }
    Ok(())
}

fn write_url_file(data_dir: &Path, url: &str) -> Result<()> {
    let tmp = data_dir.join("server.url.tmp");
    std::fs::write(&tmp, format!("{url}\n"))?;
    std::fs::rename(&tmp, data_dir.join("server.url"))?;
    Ok(())
}

/// `warren serve`: runs until SIGINT or SIGTERM.
pub async fn run(args: ServeArgs) -> Result<()> {
    if args.role == Role::Api {
        return run_api(args).await;
    }
    let signals = StopSignals::take_over()?;
    let running = start(&args).await?;
    println!("warren listening on {}", running.url);
    signals.wait().await;
    tracing::info!("shutting down");
    let _ = running.stop.send(());
    running.node.shutdown(args.destroy_on_exit.then_some(warren_api::EndReason::Shutdown)).await;
    if let Some(registration) = running.registration {
        // With every sandbox ended, nothing is left to give up: withdraw
        // at once. Otherwise the registration lives out its TTL, and a
        // restart within it re-adopts everything.
        registration.stop(args.destroy_on_exit).await;
    }
    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), running.task).await;
    let _ = std::fs::remove_file(args.data_dir.join("server.url"));
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;
    use warren_image::cache::PrefetchConfig;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    fn blob_store(flags: &[&str]) -> warren_node::BlobStoreConfig {
        let cli = Cli::try_parse_from(std::iter::once("serve").chain(flags.iter().copied())).unwrap();
        blob_store_config(&cli.serve).unwrap()
    }

    #[test]
    fn layer_cache_flags_default_to_the_cache_defaults() {
        let config = blob_store(&[]);
        assert_eq!(config.layer_prefetch, PrefetchConfig::default());
        assert_eq!(config.layer_fill_threads, Some(warren_image::cache::DEFAULT_FILL_THREADS));
        let defaults = blob_store_config(&ServeArgs::with_data_dir(PathBuf::from("/nonexistent"))).unwrap();
        assert_eq!(defaults.layer_prefetch, PrefetchConfig::default());
    }

    #[test]
    fn layer_cache_flags_reach_the_cache_config() {
        let config = blob_store(&[
            "--layer-prefetch-kb",
            "128",
            "--layer-prefetch-requests",
            "2",
            "--layer-whole-file-kb",
            "0",
            "--layer-trace-requests",
            "0",
            "--layer-fill-threads",
            "7",
            "--layer-readahead-kb",
            "32",
            "--layer-warm-readahead-kb",
            "256",
            "--layer-complete-after-use=false",
        ]);
        assert_eq!(
            config.layer_prefetch,
            PrefetchConfig { max_ahead_bytes: 128 * 1024, max_requests: 2, whole_file_bytes: 0, trace_requests: 0 }
        );
        assert_eq!(config.layer_fill_threads, Some(7));
        assert_eq!(config.layer_readahead_kb, Some(32));
        assert_eq!(config.layer_warm_readahead_kb, Some(256));
        assert_eq!(config.layer_complete_after_use, Some(false));
        // Bare, the flag says yes; absent, the node's default holds.
        assert_eq!(blob_store(&["--layer-complete-after-use"]).layer_complete_after_use, Some(true));
        assert_eq!(blob_store(&[]).layer_complete_after_use, None);
    }
}

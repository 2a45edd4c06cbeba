//! Owns sandbox network plumbing - veth pairs, addresses, routes, NAT -
//! the platform DNS resolver, and the eBPF egress programs and their policy
//! maps. Never runs in the sandbox (and is not linked into `warren-init`).
//!
//! A sandbox in `allowlist` mode gets a veth pair (`eth0` inside, a /30 of
//! the node's IPv4 pool and a /126 of its IPv6 pool), default routes of
//! both families through the host end, masquerade (NAT44 and NAT66) for
//! the pools, and the node's egress programs attached to its cgroup2
//! directory. IPv6 needs per-interface `force_forwarding` (Linux 6.17+);
//! without it sandboxes are IPv4 only (see `forwarding.rs`). Its policy
//! lives in one LPM map keyed by (cgroup id, prefix) for both families,
//! so changing it is a map update that the next `connect()`/`sendmsg()`
//! sees, and the `cgroup_skb/egress` backstop drops packets of sockets
//! connected before a rule went away.
//!
//! Invariants: a sandbox's egress is refused unless its policy allows it
//! (loopback and the platform resolver always are); every veth, map entry,
//! program attachment, nft table and pinned map is removed on detach or
//! shutdown, and found by [`Network::recover`] after a crash; the node
//! never changes a host-wide forwarding switch for IPv6, and lets go of
//! the per-interface ones it holds when it releases the network.

mod bpf;
pub mod dns;
mod forwarding;
mod netlink;
mod nft;
pub mod policy;
mod resolver;

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use serde::{Deserialize, Serialize};
use warren_api::{NetworkRule, Protocol};

pub use bpf::{Denial, Hook};
use policy::{AddrRule, Prefix};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("eBPF: {0}")]
    Bpf(String),
    #[error("nftables: {0}")]
    Nft(String),
    #[error("invalid network configuration: {0}")]
    Config(String),
    /// The policy cannot be expressed (e.g. too many ports for one
    /// destination); `field` names the offending rule.
    #[error("{message}")]
    Policy { field: String, message: String },
    #[error("the address pool {0} is exhausted")]
    PoolExhausted(String),
    #[error("sandbox {0} has no network of this node")]
    UnknownSandbox(String),
}

impl Error {
    fn io(context: impl Into<String>, source: std::io::Error) -> Error {
        Error::Io { context: context.into(), source }
    }

    fn bpf(context: impl std::fmt::Display, e: libbpf_rs::Error) -> Error {
        Error::Bpf(format!("{context}: {e}"))
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The node-wide network settings.
#[derive(Debug, Clone)]
pub struct NetConfig {
    /// Names the veths, the nft table and the pinned maps, so two servers
    /// on one host never touch each other's.
    pub instance: String,
    /// The IPv4 pool the sandboxes' /30s come from; `None` picks a /20 in
    /// 10.128.0.0/9 from a hash of the instance name.
    pub pool: Option<(Ipv4Addr, u8)>,
    /// The IPv6 pool the sandboxes' /126s come from; `None` picks a ULA
    /// /64 (`fdXX:XXXX:XXXX::/64`) from a hash of the instance name.
    pub pool6: Option<(Ipv6Addr, u8)>,
    /// Where each sandbox's network state is kept for re-adoption.
    pub state_dir: PathBuf,
    /// Names the resolver answers without asking the host (`/etc/hosts` format).
    pub dns_hosts: BTreeMap<String, Vec<IpAddr>>,
}

/// Parses `10.200.0.0/16` into a pool (a /8 to a /28).
pub fn parse_pool(text: &str) -> Result<(Ipv4Addr, u8)> {
    match warren_api::parse_cidr(text) {
        Some((IpAddr::V4(addr), len)) if (8..=28).contains(&len) => {
            let mask = u32::MAX << (32 - len);
            Ok((Ipv4Addr::from(u32::from(addr) & mask), len))
        }
        _ => Err(Error::Config(format!("sandbox network {text:?}: want an IPv4 prefix between /8 and /28"))),
    }
}

/// Parses `fd12:3456:789a::/64` into an IPv6 pool (a /32 to a /120).
pub fn parse_pool6(text: &str) -> Result<(Ipv6Addr, u8)> {
    match warren_api::parse_cidr(text) {
        Some((IpAddr::V6(addr), len)) if (32..=120).contains(&len) => {
            let mask = u128::MAX << (128 - len);
            Ok((Ipv6Addr::from(u128::from(addr) & mask), len))
        }
        _ => Err(Error::Config(format!("sandbox IPv6 network {text:?}: want an IPv6 prefix between /32 and /120"))),
    }
}

/// What the network observed a sandbox try.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetEvent {
    pub kind: NetEventKind,
    /// The process as seen inside the sandbox; 0 when unknown.
    pub pid: i32,
    pub comm: String,
    /// `connect`, `sendmsg`, `socket`; empty for dropped packets and DNS.
    pub syscall: String,
    pub detail: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NetEventKind {
    Blocked,
    DnsRefused,
}

/// Receives (sandbox id, event).
pub type EventSink = Arc<dyn Fn(&str, NetEvent) + Send + Sync>;

/// How a sandbox reaches the world: its addresses and gateways (the IPv4
/// gateway is also its resolver; the IPv6 pair is `None` on a host without
/// IPv6 forwarding per interface).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Endpoint {
    pub address: Ipv4Addr,
    pub gateway: Ipv4Addr,
    #[serde(default)]
    pub address6: Option<Ipv6Addr>,
    #[serde(default)]
    pub gateway6: Option<Ipv6Addr>,
}

/// What is kept on disk about one sandbox's network.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct SandboxState {
    id: String,
    slot: u32,
    host_if: String,
    cgroup_dir: PathBuf,
    cgroup_id: u64,
    endpoint: Endpoint,
    rules: Vec<NetworkRule>,
    /// Resolver answers pinned into the policy, for the domain rules.
    pinned: Vec<AddrRule>,
}

struct Sandbox {
    state: SandboxState,
    resolver: Option<resolver::Handle>,
}

struct Started {
    programs: bpf::Programs,
    stop_reader: Arc<AtomicBool>,
    reader: Option<std::thread::JoinHandle<()>>,
}

pub(crate) struct Inner {
    cfg: NetConfig,
    pool: (Ipv4Addr, u8),
    /// `None` when the kernel cannot forward IPv6 per interface.
    pool6: Option<(Ipv6Addr, u8)>,
    veth_prefix: String,
    table: String,
    sink: EventSink,
    started: Mutex<Option<Started>>,
    sandboxes: Mutex<HashMap<String, Sandbox>>,
    by_cgroup: Arc<Mutex<HashMap<u64, String>>>,
}

/// The node's sandbox networking. Cheap to clone.
#[derive(Clone)]
pub struct Network {
    inner: Arc<Inner>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// FNV-1a, for names derived from the instance.
fn hash(text: &str) -> u32 {
    text.bytes().fold(0x811c9dc5u32, |h, b| (h ^ u32::from(b)).wrapping_mul(0x01000193))
}

impl Network {
    /// Prepares the network of this node; nothing is made on the host until
    /// the first sandbox attaches (or [`Network::recover`] finds leftovers).
    pub fn new(cfg: NetConfig, sink: EventSink) -> Result<Network> {
        let pool = match cfg.pool {
            Some(pool) => pool,
            None => {
                let block = hash(&cfg.instance) % 2048;
                (Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 128, 0, 0)) + (block << 12)), 20)
            }
        };
        let pool6 = cfg.pool6.unwrap_or_else(|| default_pool6(&cfg.instance));
        // Every IPv4 slot needs its IPv6 /126.
        if 126 - u32::from(pool6.1) < 30 - u32::from(pool.1) {
            return Err(Error::Config(format!(
                "the IPv6 pool {}/{} has fewer /126s than the IPv4 pool {}/{} has /30s",
                pool6.0, pool6.1, pool.0, pool.1
            )));
        }
        let pool6 = if forwarding::supported() {
            Some(pool6)
        } else {
            tracing::warn!("this kernel has no IPv6 force_forwarding (Linux 6.17+): sandboxes get IPv4 egress only");
            None
        };
        std::fs::create_dir_all(&cfg.state_dir)
            .map_err(|e| Error::io(format!("mkdir {}", cfg.state_dir.display()), e))?;
        let veth_prefix = format!("wr{:06x}", hash(&cfg.instance) & 0xff_ffff);
        let table = nft::table_name(&cfg.instance);
        Ok(Network {
            inner: Arc::new(Inner {
                cfg,
                pool,
                pool6,
                veth_prefix,
                table,
                sink,
                started: Mutex::new(None),
                sandboxes: Mutex::new(HashMap::new()),
                by_cgroup: Arc::new(Mutex::new(HashMap::new())),
            }),
        })
    }

    pub fn pool(&self) -> String {
        format!("{}/{}", self.inner.pool.0, self.inner.pool.1)
    }

    /// The IPv6 pool, `None` when sandboxes get IPv4 only.
    pub fn pool6(&self) -> Option<String> {
        self.inner.pool6.map(|(addr, len)| format!("{addr}/{len}"))
    }

    /// Loads the programs (once), installs the nft table and turns on IPv4
    /// forwarding (and IPv6 forwarding on the uplinks, see `forwarding.rs`).
    fn ensure_started(&self, cgroup_dir: &Path) -> Result<()> {
        let mut started = lock(&self.inner.started);
        if started.is_some() {
            return Ok(());
        }
        let level = cgroup_level(cgroup_dir)?;
        let programs = bpf::Programs::load(&self.inner.cfg.instance, level)?;
        nft::install(
            &self.inner.table,
            &self.pool(),
            self.pool6().as_deref(),
            &format!("{}*", self.inner.veth_prefix),
        )?;
        std::fs::write("/proc/sys/net/ipv4/ip_forward", "1").map_err(|e| Error::io("turn on IPv4 forwarding", e))?;
        self.hold_uplinks()?;
        let stop_reader = Arc::new(AtomicBool::new(false));
        let weak = Arc::downgrade(&self.inner);
        let reader = bpf::read_denials(programs.denials()?, Arc::clone(&stop_reader), move |d| deliver(&weak, d))?;
        *started = Some(Started { programs, stop_reader, reader: Some(reader) });
        Ok(())
    }

    /// Turns on IPv6 forwarding on the host interfaces replies come back
    /// on, and lets only those replies through there (nft set `forced6`).
    fn hold_uplinks(&self) -> Result<()> {
        if self.inner.pool6.is_none() {
            return Ok(());
        }
        let held = forwarding::hold_uplinks(&self.inner.cfg.instance, &format!("{}h", self.inner.veth_prefix))?;
        nft::add_forced(&self.inner.table, &held)
    }

    fn with_programs<T>(&self, f: impl FnOnce(&bpf::Programs) -> Result<T>) -> Result<T> {
        match lock(&self.inner.started).as_ref() {
            Some(s) => f(&s.programs),
            None => Err(Error::Bpf("the egress programs are not loaded".into())),
        }
    }

    /// Gives sandbox `id` (whose network namespace is `netns` and cgroup2
    /// directory `cgroup_dir`) its veth pair, address, route, resolver and
    /// egress programs, with `rules` as its policy. On error nothing is left.
    pub async fn attach(
        &self,
        id: &str,
        netns: OwnedFd,
        cgroup_dir: &Path,
        rules: Vec<NetworkRule>,
    ) -> Result<Endpoint> {
        let (this, id_owned, dir) = (self.clone(), id.to_string(), cgroup_dir.to_path_buf());
        let state = blocking(move || this.plumb(&id_owned, netns, &dir)).await?;
        let endpoint = state.endpoint;
        lock(&self.inner.by_cgroup).insert(state.cgroup_id, id.to_string());
        let configured = match self.set_rules(id, rules) {
            Ok(()) => self.start_resolver(id).await,
            Err(e) => Err(e),
        };
        if let Err(e) = configured {
            let _ = self.detach(id).await;
            return Err(e);
        }
        Ok(endpoint)
    }

    /// The host-side work of [`Network::attach`], blocking.
    fn plumb(&self, id: &str, netns: OwnedFd, cgroup_dir: &Path) -> Result<SandboxState> {
        self.ensure_started(cgroup_dir)?;
        // Interfaces made since the last sandbox (a new uplink) too.
        self.hold_uplinks()?;
        let cgroup = open_dir(cgroup_dir)?;
        let cgroup_id =
            std::fs::metadata(cgroup_dir).map_err(|e| Error::io(format!("stat {}", cgroup_dir.display()), e))?.ino();
        let state = self.reserve(id, cgroup_dir, cgroup_id)?;
        let endpoint = state.endpoint;
        let made = (|| {
            // Base entries and programs first: the sandbox never has a
            // moment with a route out and no policy.
            let base = policy::compile(&base_rules(&endpoint)).unwrap_or_default();
            self.with_programs(|p| p.set_entries(cgroup_id, &base))?;
            if let Some((dev, ino)) = pid_namespace(cgroup_dir) {
                self.with_programs(|p| p.set_pidns(cgroup_id, dev, ino))?;
            }
            self.with_programs(|p| p.attach(cgroup.as_fd()))?;
            make_veth(&state.host_if, netns, endpoint)
        })();
        if let Err(e) = made {
            lock(&self.inner.sandboxes).remove(id);
            self.unplumb(&state);
            return Err(e);
        }
        Ok(state)
    }

    /// Removes what [`Network::plumb`] made; best effort, logs failures.
    fn unplumb(&self, state: &SandboxState) {
        if let Err(e) = netlink::Netlink::open().and_then(|mut nl| nl.delete_link(&state.host_if)) {
            tracing::warn!(sandbox = %state.id, "cannot delete veth {}: {e}", state.host_if);
        }
        let _ = self.with_programs(|p| {
            p.clear(state.cgroup_id);
            Ok(())
        });
        if let Ok(cgroup) = open_dir(&state.cgroup_dir) {
            if let Err(e) = bpf::Programs::detach_all(cgroup.as_fd()) {
                tracing::warn!(sandbox = %state.id, "cannot detach the egress programs: {e}");
            }
        }
        let _ = std::fs::remove_file(self.state_path(&state.id));
    }

    /// Picks a free slot, registers the sandbox with it and records it on
    /// disk (so a crash before the veth exists still leaves a trace).
    fn reserve(&self, id: &str, cgroup_dir: &Path, cgroup_id: u64) -> Result<SandboxState> {
        let mut sandboxes = lock(&self.inner.sandboxes);
        let taken: std::collections::BTreeSet<u32> = sandboxes.values().map(|s| s.state.slot).collect();
        let slots = 1u32 << (32 - u32::from(self.inner.pool.1) - 2);
        let slot = (0..slots).find(|s| !taken.contains(s)).ok_or_else(|| Error::PoolExhausted(self.pool()))?;
        let state = SandboxState {
            id: id.to_string(),
            slot,
            host_if: format!("{}h{slot:x}", self.inner.veth_prefix),
            cgroup_dir: cgroup_dir.to_path_buf(),
            cgroup_id,
            endpoint: self.endpoint(slot),
            rules: Vec::new(),
            pinned: Vec::new(),
        };
        self.save(&state)?;
        sandboxes.insert(id.to_string(), Sandbox { state: state.clone(), resolver: None });
        Ok(state)
    }

    fn endpoint(&self, slot: u32) -> Endpoint {
        let base = u32::from(self.inner.pool.0) + slot * 4;
        // Slot-aligned /126s: the checked pool sizes leave room for each.
        let base6 = self.inner.pool6.map(|(addr, _)| u128::from(addr) + u128::from(slot) * 4);
        Endpoint {
            gateway: Ipv4Addr::from(base + 1),
            address: Ipv4Addr::from(base + 2),
            gateway6: base6.map(|b| Ipv6Addr::from(b + 1)),
            address6: base6.map(|b| Ipv6Addr::from(b + 2)),
        }
    }

    /// Replaces sandbox `id`'s rules. Domain rules take effect through the
    /// resolver; answers pinned for domains no longer allowed are dropped.
    pub fn set_rules(&self, id: &str, rules: Vec<NetworkRule>) -> Result<()> {
        let mut sandboxes = lock(&self.inner.sandboxes);
        let sandbox = sandboxes.get_mut(id).ok_or_else(|| Error::UnknownSandbox(id.to_string()))?;
        let mut state = sandbox.state.clone();
        let domains: Vec<&NetworkRule> = rules.iter().filter(|r| r.domain.is_some()).collect();
        state.pinned.retain(|p| domains.iter().any(|r| same_ports(r, p)));
        state.rules = rules;
        self.install(&state)?;
        self.save(&state)?;
        sandbox.state = state;
        Ok(())
    }

    /// Writes `state`'s whole policy to the map.
    fn install(&self, state: &SandboxState) -> Result<()> {
        let mut addr_rules = base_rules(&state.endpoint);
        addr_rules.extend(cidr_rules(&state.rules)?);
        addr_rules.extend(state.pinned.iter().cloned());
        let entries = policy::compile(&addr_rules)
            .map_err(|e| Error::Policy { field: "rules".into(), message: e.to_string() })?;
        self.with_programs(|p| p.set_entries(state.cgroup_id, &entries))
    }

    /// The resolver's decision for `name` asked by sandbox `id`: the
    /// addresses (pinned into the policy before this returns), or `None`
    /// when no domain rule allows the name.
    pub(crate) async fn resolve(&self, id: &str, name: &str) -> Result<Option<Vec<IpAddr>>> {
        let rules: Vec<NetworkRule> = {
            let sandboxes = lock(&self.inner.sandboxes);
            let sandbox = sandboxes.get(id).ok_or_else(|| Error::UnknownSandbox(id.to_string()))?;
            sandbox
                .state
                .rules
                .iter()
                .filter(|r| r.domain.as_deref().is_some_and(|d| dns::matches(d, name)))
                .cloned()
                .collect()
        };
        if rules.is_empty() {
            return Ok(None);
        }
        let addrs = match self.inner.cfg.dns_hosts.get(name) {
            Some(addrs) => addrs.clone(),
            None => match tokio::net::lookup_host((name, 0)).await {
                Ok(found) => {
                    let mut addrs: Vec<IpAddr> = Vec::new();
                    for a in found.map(|a| a.ip()) {
                        if !addrs.contains(&a) {
                            addrs.push(a);
                        }
                    }
                    addrs
                }
                Err(_) => Vec::new(),
            },
        };
        let mut sandboxes = lock(&self.inner.sandboxes);
        let sandbox = sandboxes.get_mut(id).ok_or_else(|| Error::UnknownSandbox(id.to_string()))?;
        let mut state = sandbox.state.clone();
        for rule in &rules {
            for addr in &addrs {
                let pin = AddrRule { prefix: Prefix::host(*addr), ports: rule.ports.clone(), protocol: rule.protocol };
                if !state.pinned.contains(&pin) {
                    state.pinned.push(pin);
                }
            }
        }
        if state.pinned != sandbox.state.pinned {
            self.install(&state)?;
            self.save(&state)?;
            sandbox.state = state;
        }
        Ok(Some(addrs))
    }

    async fn start_resolver(&self, id: &str) -> Result<()> {
        let endpoint = {
            let sandboxes = lock(&self.inner.sandboxes);
            sandboxes.get(id).ok_or_else(|| Error::UnknownSandbox(id.to_string()))?.state.endpoint
        };
        let handle = resolver::serve(self.clone(), id.to_string(), endpoint).await?;
        if let Some(s) = lock(&self.inner.sandboxes).get_mut(id) {
            s.resolver = Some(handle);
        }
        Ok(())
    }

    pub(crate) fn report(&self, id: &str, event: NetEvent) {
        (self.inner.sink)(id, event);
    }

    /// Removes sandbox `id`'s network: veth, resolver, policy entries and
    /// program attachments. Idempotent.
    pub async fn detach(&self, id: &str) -> Result<()> {
        let removed = lock(&self.inner.sandboxes).remove(id);
        let state = match removed {
            Some(sandbox) => {
                drop(sandbox.resolver);
                Some(sandbox.state)
            }
            None => self.saved().into_iter().find(|s| s.id == id),
        };
        let Some(state) = state else { return Ok(()) };
        lock(&self.inner.by_cgroup).remove(&state.cgroup_id);
        let this = self.clone();
        blocking(move || {
            this.unplumb(&state);
            Ok(())
        })
        .await
    }

    /// At node start: takes over the networks of the re-adopted sandboxes
    /// in `keep` and removes every other trace a previous run left (veths,
    /// map entries, attachments, the nft table and pins when none is kept).
    pub async fn recover(&self, keep: &[String]) -> Result<()> {
        let saved = self.saved();
        let mut kept = Vec::new();
        for state in saved {
            if keep.contains(&state.id) {
                kept.push(state);
            } else {
                let this = self.clone();
                let _ = blocking(move || {
                    if this.ensure_started(&state.cgroup_dir).is_err() {
                        tracing::debug!(sandbox = %state.id, "sweeping its network without the programs");
                    }
                    this.unplumb(&state);
                    Ok(())
                })
                .await;
            }
        }
        let mut first_error = None;
        for state in kept {
            let id = state.id.clone();
            if let Err(e) = self.take_over(state).await {
                tracing::warn!(sandbox = %id, "cannot take over the sandbox's network: {e}");
                first_error.get_or_insert(e);
            }
        }
        let this = self.clone();
        blocking(move || this.sweep_host()).await?;
        first_error.map_or(Ok(()), Err)
    }

    /// Registers a re-adopted sandbox's network and restarts its resolver.
    async fn take_over(&self, state: SandboxState) -> Result<()> {
        let this = self.clone();
        let dir = state.cgroup_dir.clone();
        blocking(move || this.ensure_started(&dir)).await?;
        let id = state.id.clone();
        lock(&self.inner.by_cgroup).insert(state.cgroup_id, id.clone());
        self.install(&state)?;
        lock(&self.inner.sandboxes).insert(id.clone(), Sandbox { state, resolver: None });
        self.start_resolver(&id).await
    }

    /// Deletes this instance's veths and map entries that no sandbox owns;
    /// with no sandbox at all, also the nft table and the pinned maps.
    fn sweep_host(&self) -> Result<()> {
        let owned: Vec<String> = lock(&self.inner.sandboxes).values().map(|s| s.state.host_if.clone()).collect();
        let mut nl = netlink::Netlink::open().map_err(|e| Error::io("open netlink", e))?;
        for name in nl.link_names().map_err(|e| Error::io("list links", e))? {
            if name.starts_with(&format!("{}h", self.inner.veth_prefix)) && !owned.contains(&name) {
                nl.delete_link(&name).map_err(|e| Error::io(format!("delete {name}"), e))?;
            }
        }
        let cgroups: Vec<u64> = lock(&self.inner.by_cgroup).keys().copied().collect();
        let _ = self.with_programs(|p| {
            for stale in p.cgroups().into_iter().filter(|c| !cgroups.contains(c)) {
                p.clear(stale);
            }
            Ok(())
        });
        if lock(&self.inner.sandboxes).is_empty() {
            self.release()?;
        }
        Ok(())
    }

    /// Removes the node-wide objects (nft table, pinned maps, state dir)
    /// when no sandbox is left; a no-op otherwise.
    fn release(&self) -> Result<()> {
        if !lock(&self.inner.sandboxes).is_empty() {
            return Ok(());
        }
        let started = lock(&self.inner.started).take();
        if let Some(mut s) = started {
            s.stop_reader.store(true, std::sync::atomic::Ordering::Relaxed);
            if let Some(reader) = s.reader.take() {
                let _ = reader.join();
            }
            s.programs.unpin()?;
        } else {
            let dir = bpf::Programs::pin_dir(&self.inner.cfg.instance);
            if dir.exists() {
                std::fs::remove_dir_all(&dir).map_err(|e| Error::io(format!("remove {}", dir.display()), e))?;
            }
        }
        nft::remove(&self.inner.table)?;
        forwarding::release_uplinks(&self.inner.cfg.instance)
    }

    /// Stops the network: the denial reader ends and, when no sandbox is
    /// left, every node-wide object is removed. Sandboxes still running
    /// keep their veths, policies and attachments for the next start.
    pub async fn shutdown(&self) -> Result<()> {
        let resolvers: Vec<resolver::Handle> =
            lock(&self.inner.sandboxes).values_mut().filter_map(|s| s.resolver.take()).collect();
        drop(resolvers);
        let this = self.clone();
        blocking(move || {
            if lock(&this.inner.sandboxes).is_empty() {
                this.release()
            } else {
                let started = lock(&this.inner.started).take();
                if let Some(mut s) = started {
                    s.stop_reader.store(true, std::sync::atomic::Ordering::Relaxed);
                    if let Some(reader) = s.reader.take() {
                        let _ = reader.join();
                    }
                }
                Ok(())
            }
        })
        .await
    }

    fn state_path(&self, id: &str) -> PathBuf {
        self.inner.cfg.state_dir.join(format!("{id}.json"))
    }

    fn save(&self, state: &SandboxState) -> Result<()> {
        let path = self.state_path(&state.id);
        let tmp = path.with_extension("json.tmp");
        let bytes = serde_json::to_vec(state).map_err(|e| Error::io("encode network state", e.into()))?;
        std::fs::write(&tmp, bytes).map_err(|e| Error::io(format!("write {}", tmp.display()), e))?;
        std::fs::rename(&tmp, &path).map_err(|e| Error::io(format!("rename {}", path.display()), e))
    }

    fn saved(&self) -> Vec<SandboxState> {
        let Ok(entries) = std::fs::read_dir(&self.inner.cfg.state_dir) else { return Vec::new() };
        entries
            .filter_map(|e| e.ok())
            .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
            .filter_map(|e| std::fs::read(e.path()).ok())
            .filter_map(|bytes| serde_json::from_slice(&bytes).ok())
            .collect()
    }
}

/// The address rules among `rules`.
fn cidr_rules(rules: &[NetworkRule]) -> Result<Vec<AddrRule>> {
    let mut out = Vec::new();
    for (i, rule) in rules.iter().enumerate() {
        if let Some((ip, len)) = rule.cidr.as_deref().and_then(warren_api::parse_cidr) {
            out.push(AddrRule { prefix: Prefix::new(ip, len), ports: rule.ports.clone(), protocol: rule.protocol });
        } else if rule.cidr.is_some() {
            return Err(Error::Policy { field: format!("rules[{i}].cidr"), message: "not an IP prefix".into() });
        }
    }
    Ok(out)
}

/// Checks that `rules` fit the policy map (e.g. not too many ports for one
/// destination), before anything is made for them.
pub fn check_rules(rules: &[NetworkRule]) -> Result<()> {
    policy::compile(&cidr_rules(rules)?)
        .map(|_| ())
        .map_err(|e| Error::Policy { field: "rules".into(), message: e.to_string() })
}

/// What every sandbox may reach: its resolver on the IPv4 gateway (port
/// 53) and its own addresses. The resolver does not listen on IPv6.
fn base_rules(endpoint: &Endpoint) -> Vec<AddrRule> {
    let mut rules = vec![
        AddrRule { prefix: Prefix::host(IpAddr::V4(endpoint.gateway)), ports: vec![53], protocol: Protocol::Any },
        AddrRule { prefix: Prefix::host(IpAddr::V4(endpoint.address)), ports: Vec::new(), protocol: Protocol::Any },
    ];
    if let Some(address6) = endpoint.address6 {
        rules.push(AddrRule { prefix: Prefix::host(IpAddr::V6(address6)), ports: Vec::new(), protocol: Protocol::Any });
    }
    rules
}

/// The default IPv6 pool: a ULA /64 whose 40-bit global id comes from the
/// instance name (RFC 4193 wants it random; a hash keeps it stable across
/// restarts and distinct between instances).
fn default_pool6(instance: &str) -> (Ipv6Addr, u8) {
    let a = hash(instance).to_be_bytes();
    let b = hash(&format!("{instance}/ipv6")).to_be_bytes();
    let mut octets = [0u8; 16];
    octets[0] = 0xfd;
    octets[1..5].copy_from_slice(&a);
    octets[5] = b[0];
    (Ipv6Addr::from(octets), 64)
}

fn same_ports(rule: &NetworkRule, pin: &AddrRule) -> bool {
    rule.ports == pin.ports && rule.protocol == pin.protocol
}

/// Makes the veth pair and configures both ends.
fn make_veth(host_if: &str, netns: OwnedFd, endpoint: Endpoint) -> Result<()> {
    let mut nl = netlink::Netlink::open().map_err(|e| Error::io("open netlink", e))?;
    nl.delete_link(host_if).map_err(|e| Error::io(format!("delete stale {host_if}"), e))?;
    nl.add_veth(host_if, "eth0", netns.as_fd()).map_err(|e| Error::io(format!("make veth {host_if}"), e))?;
    nl.add_address(host_if, IpAddr::V4(endpoint.gateway), 30)
        .map_err(|e| Error::io(format!("address {host_if}"), e))?;
    match endpoint.gateway6 {
        Some(gateway6) => {
            forwarding::configure_veth_end(host_if, true)
                .map_err(|e| Error::io(format!("IPv6 settings of {host_if}"), e))?;
            nl.add_address(host_if, IpAddr::V6(gateway6), 126)
                .map_err(|e| Error::io(format!("IPv6 address {host_if}"), e))?;
        }
        None => no_ipv6(host_if),
    }
    nl.set_up(host_if).map_err(|e| Error::io(format!("set {host_if} up"), e))?;
    netlink::in_netns(netns, move || {
        let mut nl = netlink::Netlink::open()?;
        // /proc/sys/net is the opening thread's network namespace's.
        match endpoint.address6 {
            Some(_) => forwarding::configure_veth_end("eth0", false)?,
            None => no_ipv6("eth0"),
        }
        nl.add_address("eth0", IpAddr::V4(endpoint.address), 30)?;
        if let Some(address6) = endpoint.address6 {
            nl.add_address("eth0", IpAddr::V6(address6), 126)?;
        }
        nl.set_up("eth0")?;
        nl.set_up("lo")?;
        nl.add_default_route("eth0", IpAddr::V4(endpoint.gateway))?;
        match endpoint.gateway6 {
            Some(gateway6) => nl.add_default_route("eth0", IpAddr::V6(gateway6)),
            None => Ok(()),
        }
    })
    .map_err(|e| Error::io("configure eth0 in the sandbox", e))
}

/// On a host that cannot forward IPv6 per interface: no IPv6 at all, not
/// even link-local between the sandbox and the host. Best effort (a kernel
/// without IPv6 has nothing to disable).
fn no_ipv6(interface: &str) {
    let _ = std::fs::write(format!("/proc/sys/net/ipv6/conf/{interface}/disable_ipv6"), "1");
}

/// Hands a denial to the sink under its sandbox's id.
fn deliver(inner: &Weak<Inner>, d: Denial) {
    let Some(inner) = inner.upgrade() else { return };
    let Some(id) = lock(&inner.by_cgroup).get(&d.cgroup_id).cloned() else { return };
    let proto = match d.protocol {
        6 => "tcp".to_string(),
        17 => "udp".to_string(),
        n => format!("protocol {n}"),
    };
    let dest = match d.addr {
        IpAddr::V4(a) => format!("{a}:{}", d.port),
        IpAddr::V6(a) => format!("[{a}]:{}", d.port),
    };
    let (syscall, detail) = match d.hook {
        Hook::Connect => ("connect", format!("{proto} {dest}")),
        Hook::Sendmsg => ("sendmsg", format!("{proto} {dest}")),
        Hook::SockCreate => {
            ("socket", format!("socket(family {}, type {}, protocol {}) refused", d.family, d.sock_type, d.protocol))
        }
        Hook::Egress => ("", format!("{proto} {dest} (packet dropped)")),
    };
    let pid = match (d.ns_pid, d.host_pid) {
        (0, 0) => 0,
        (0, host) => pid_in_sandbox(host),
        (ns, _) => ns as i32,
    };
    let event = NetEvent { kind: NetEventKind::Blocked, pid, comm: d.comm, syscall: syscall.into(), detail };
    (inner.sink)(&id, event);
}

/// A host pid's number in its own (innermost) pid namespace.
fn pid_in_sandbox(host_pid: u32) -> i32 {
    let status = std::fs::read_to_string(format!("/proc/{host_pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|p| p.parse().ok())
        .unwrap_or(0)
}

/// The pid namespace (nsfs device, inode) of the processes in the cgroup
/// `dir` (all of a sandbox's share its PID 1's).
fn pid_namespace(dir: &Path) -> Option<(u64, u64)> {
    let procs = std::fs::read_to_string(dir.join("cgroup.procs")).ok()?;
    procs.lines().find_map(|pid| {
        let meta = std::fs::metadata(format!("/proc/{}/ns/pid", pid.trim())).ok()?;
        Some((meta.dev(), meta.ino()))
    })
}

/// The depth of `dir` below the root of its cgroup2 mount.
fn cgroup_level(dir: &Path) -> Result<u32> {
    let mountinfo =
        std::fs::read_to_string("/proc/self/mountinfo").map_err(|e| Error::io("read /proc/self/mountinfo", e))?;
    let root = mountinfo
        .lines()
        .filter(|l| l.split(" - ").nth(1).is_some_and(|fs| fs.starts_with("cgroup2 ")))
        .filter_map(|l| l.split_whitespace().nth(4))
        .map(PathBuf::from)
        .find(|mount| dir.starts_with(mount))
        .ok_or_else(|| Error::Config(format!("{} is not on a cgroup2 mount", dir.display())))?;
    let below = dir
        .strip_prefix(&root)
        .map_err(|_| Error::Config(format!("{} is not below {}", dir.display(), root.display())))?;
    Ok(below.components().count() as u32)
}

fn open_dir(path: &Path) -> Result<OwnedFd> {
    rustix::fs::open(
        path,
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .map_err(|e| Error::io(format!("open {}", path.display()), e.into()))
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f).await.map_err(|e| Error::io("network task", std::io::Error::other(e.to_string())))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pools_are_checked_and_masked() {
        assert_eq!(parse_pool("10.200.3.4/16").unwrap(), (Ipv4Addr::new(10, 200, 0, 0), 16));
        assert!(parse_pool("10.0.0.0/30").is_err());
        assert!(parse_pool("fd00::/64").is_err());
        assert!(parse_pool("nonsense").is_err());
    }

    #[test]
    fn ipv6_pools_are_checked_and_masked() {
        assert_eq!(parse_pool6("fd12:3456:789a:1::5/64").unwrap(), ("fd12:3456:789a:1::".parse().unwrap(), 64));
        assert!(parse_pool6("fd00::/124").is_err(), "too small for one /126 per slot");
        assert!(parse_pool6("10.0.0.0/16").is_err());
        let (addr, len) = default_pool6("some-instance");
        assert_eq!((addr.octets()[0], len), (0xfd, 64), "a ULA /64");
        assert_ne!(default_pool6("other-instance"), (addr, len));
    }
}

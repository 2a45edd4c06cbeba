//! Egress of sandboxes in `allowlist` network mode: the node's side of
//! `warren-net`. It expands presets into rules, plugs a sandbox's network
//! in after the driver made it (and its resolver into `/etc/resolv.conf`),
//! applies policy changes live (`PUT /v1/sandboxes/{id}/network`, phase
//! switches), turns the network's observations into security events, and
//! unplugs on end. The network's own state survives restarts next to the
//! store (`<data>/net`), so re-adopted sandboxes keep their policy.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock, Weak};

use warren_api::{ApiError, NetworkMode, NetworkPolicy, NetworkRule, Protocol, SandboxInfo, SecurityEventKind};
use warren_backend::{Driver, SandboxHandle};
use warren_net::{NetConfig, NetEvent, NetEventKind, Network};

use crate::events::Observed;
use crate::{joined, Inner, Node, NodeError, Result};

/// `warren serve` flags for the sandbox network.
#[derive(Debug, Clone, Default)]
pub struct NetworkOptions {
    /// The IPv4 pool of the sandboxes' /30s (`--sandbox-net`); default: a
    /// /20 of 10.128.0.0/9 picked by the instance name.
    pub pool: Option<String>,
    /// The IPv6 pool of the sandboxes' /126s (`--sandbox-net6`); default:
    /// a ULA /64 picked by the instance name.
    pub pool6: Option<String>,
    /// Names the platform resolver answers from, `/etc/hosts` format.
    pub dns_hosts: Option<PathBuf>,
    /// Named rule sets, JSON `{"name": [rule, ...]}`; they replace the
    /// built-in presets of the same name.
    pub presets: Option<PathBuf>,
}

/// The node's network and its presets.
pub(crate) struct NodeNet {
    net: Network,
    presets: BTreeMap<String, Vec<NetworkRule>>,
    /// The node, for events; set once the node exists.
    node: Arc<OnceLock<Weak<Inner>>>,
}

fn rule(domain: &str, ports: &[u16]) -> NetworkRule {
    NetworkRule { domain: Some(domain.to_string()), cidr: None, ports: ports.to_vec(), protocol: Protocol::Tcp }
}

/// `pypi`, `npm` and `debian`, as the package tools reach them.
pub fn builtin_presets() -> BTreeMap<String, Vec<NetworkRule>> {
    BTreeMap::from([
        ("pypi".to_string(), vec![rule("pypi.org", &[443]), rule("files.pythonhosted.org", &[443])]),
        ("npm".to_string(), vec![rule("registry.npmjs.org", &[443])]),
        (
            "debian".to_string(),
            vec![
                rule("deb.debian.org", &[80, 443]),
                rule("security.debian.org", &[80, 443]),
                rule("*.debian.org", &[80, 443]),
            ],
        ),
    ])
}

fn config_err(what: String) -> NodeError {
    NodeError::Internal(what)
}

impl NodeNet {
    pub(crate) fn open(instance: &str, data_dir: &std::path::Path, opts: &NetworkOptions) -> Result<NodeNet> {
        let pool = match &opts.pool {
            Some(text) => Some(warren_net::parse_pool(text).map_err(|e| config_err(e.to_string()))?),
            None => None,
        };
        let pool6 = match &opts.pool6 {
            Some(text) => Some(warren_net::parse_pool6(text).map_err(|e| config_err(e.to_string()))?),
            None => None,
        };
        let dns_hosts = match &opts.dns_hosts {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| config_err(format!("cannot read --dns-hosts {}: {e}", path.display())))?;
                warren_net::dns::parse_hosts(&text)
                    .map_err(|e| config_err(format!("--dns-hosts {}: {e}", path.display())))?
            }
            None => BTreeMap::new(),
        };
        let mut presets = builtin_presets();
        if let Some(path) = &opts.presets {
            let text = std::fs::read_to_string(path)
                .map_err(|e| config_err(format!("cannot read --network-presets {}: {e}", path.display())))?;
            let custom: BTreeMap<String, Vec<NetworkRule>> = serde_json::from_str(&text)
                .map_err(|e| config_err(format!("--network-presets {}: {e}", path.display())))?;
            for (name, rules) in custom {
                let check = NetworkPolicy { presets: vec![name.clone()], rules: rules.clone() };
                check
                    .validate(&format!("presets.{name}"))
                    .map_err(|e| config_err(format!("--network-presets {}: {}", path.display(), e.message)))?;
                presets.insert(name, rules);
            }
        }
        let node: Arc<OnceLock<Weak<Inner>>> = Arc::new(OnceLock::new());
        let sink_node = Arc::clone(&node);
        let sink: warren_net::EventSink = Arc::new(move |id: &str, event: NetEvent| {
            let Some(inner) = sink_node.get().and_then(Weak::upgrade) else { return };
            let node = Node { inner };
            let in_vm = node.live_as_is(id).is_ok_and(|live| {
                matches!(live.handle.backend, warren_api::Backend::Microvm | warren_api::Backend::Vm)
            });
            node.record_event(id, observed(event, in_vm));
        });
        let net = Network::new(
            NetConfig { instance: instance.to_string(), pool, pool6, state_dir: data_dir.join("net"), dns_hosts },
            sink,
        )
        .map_err(|e| config_err(e.to_string()))?;
        Ok(NodeNet { net, presets, node })
    }

    pub(crate) fn set_node(&self, inner: &Arc<Inner>) {
        let _ = self.node.set(Arc::downgrade(inner));
    }

    /// The rules `policy` stands for: its presets' rules, then its own.
    fn expand(&self, policy: &NetworkPolicy) -> Result<Vec<NetworkRule>> {
        let mut rules = Vec::new();
        for (i, name) in policy.presets.iter().enumerate() {
            let preset = self.presets.get(name).ok_or_else(|| {
                let known: Vec<&str> = self.presets.keys().map(String::as_str).collect();
                NodeError::Invalid(ApiError::invalid(
                    format!("network_policy.presets[{i}]"),
                    format!("no preset `{name}`; this server has {}", known.join(", ")),
                ))
            })?;
            rules.extend(preset.iter().cloned());
        }
        rules.extend(policy.rules.iter().cloned());
        Ok(rules)
    }
}

/// A network observation as a security event. In a VM the socket is
/// QEMU's, made for whichever guest process asked: the event names no
/// process rather than QEMU's host pid.
fn observed(event: NetEvent, in_vm: bool) -> Observed {
    let kind = match event.kind {
        NetEventKind::Blocked => SecurityEventKind::NetworkBlocked,
        NetEventKind::DnsRefused => SecurityEventKind::DnsRefused,
    };
    let (pid, comm) = if in_vm { (0, String::new()) } else { (event.pid, event.comm) };
    let mut o = Observed::new(kind, event.detail).process(pid, comm);
    o.syscall = event.syscall;
    o
}

fn net_err(e: warren_net::Error) -> NodeError {
    match e {
        warren_net::Error::Policy { field, message } => {
            NodeError::Invalid(ApiError::invalid(format!("network_policy.{field}"), message))
        }
        other => NodeError::Internal(format!("sandbox network: {other}")),
    }
}

impl Node {
    fn node_net(&self) -> &NodeNet {
        &self.inner.net
    }

    /// The policy a sandbox starts with: its initial phase's, else its own.
    pub(crate) fn initial_policy(req: &warren_api::CreateSandboxRequest) -> NetworkPolicy {
        req.phase
            .as_deref()
            .and_then(|p| req.phases.get(p))
            .and_then(|p| p.network.clone())
            .or_else(|| req.network_policy.clone())
            .unwrap_or_default()
    }

    /// Checks a create's policy before anything is made (unknown presets,
    /// too many ports for one destination).
    pub(crate) fn check_policy(&self, policy: &NetworkPolicy) -> Result<()> {
        let rules = self.node_net().expand(policy)?;
        warren_net::check_rules(&rules).map_err(net_err)
    }

    /// Gives a just-made `allowlist` sandbox its network and policy.
    pub(crate) async fn plug_network(
        &self,
        id: &str,
        driver: &Arc<dyn Driver>,
        handle: &SandboxHandle,
        policy: &NetworkPolicy,
    ) -> Result<()> {
        let rules = self.node_net().expand(policy)?;
        let target = driver.network_target(handle)?;
        let endpoint =
            self.node_net().net.attach(id, target.netns, &target.cgroup2_dir, rules).await.map_err(net_err)?;
        let resolv = format!("nameserver {}\n", endpoint.gateway);
        // A VM's resolver address is the same: QEMU's user-mode network
        // forwards the guest's queries from QEMU's (the sandbox's) namespace.
        let root = warren_backend::remote_files::FileAccess::of(driver.as_ref(), handle);
        let written = tokio::task::spawn_blocking(move || -> Result<()> {
            let mut writer = root?.create_write("/etc/resolv.conf", 0o644)?;
            writer.append(resolv.as_bytes())?;
            writer.commit()?;
            Ok(())
        })
        .await
        .map_err(|e| NodeError::Internal(e.to_string()))
        .and_then(|r| r);
        if let Err(e) = written {
            let _ = self.node_net().net.detach(id).await;
            return Err(e);
        }
        Ok(())
    }

    /// Removes a sandbox's network (a no-op for other modes).
    pub(crate) async fn unplug_network(&self, id: &str, mode: NetworkMode) {
        if mode != NetworkMode::Allowlist {
            return;
        }
        if let Err(e) = self.node_net().net.detach(id).await {
            tracing::warn!(sandbox = %id, "cannot remove the sandbox's network: {e}");
        }
    }

    /// Takes the networks of re-adopted sandboxes over and sweeps the rest.
    /// A failure is logged, not fatal: the node still serves, and what was
    /// not swept is found again at the next start.
    pub(crate) async fn recover_network(&self, keep: &[String]) {
        if let Err(e) = self.node_net().net.recover(keep).await {
            tracing::warn!("recovering the sandbox network: {e}");
        }
    }

    pub(crate) async fn shutdown_network(&self) {
        if let Err(e) = self.node_net().net.shutdown().await {
            tracing::warn!("cannot stop the sandbox network: {e}");
        }
    }

    /// `PUT /v1/sandboxes/{id}/network`: replaces sandbox `id`'s egress
    /// policy (its `network_policy`, shown in its info) and enforces it at
    /// once: the next `connect()` or `sendmsg()` of any of its sockets sees
    /// it, and packets of connections to destinations no longer allowed are
    /// dropped. Until the next phase switch it also overrides the current
    /// phase's `network`.
    pub async fn apply_network_policy(&self, id: &str, policy: &NetworkPolicy) -> Result<SandboxInfo> {
        policy.validate("network_policy").map_err(NodeError::Invalid)?;
        let live = self.live(id)?;
        live.touch();
        if live.record().info.network != NetworkMode::Allowlist {
            return Err(NodeError::Invalid(ApiError::invalid(
                "network",
                "the sandbox is not in `allowlist` network mode; its egress cannot be changed",
            )));
        }
        self.enforce(id, policy)?;
        let rec = {
            let mut rec = live.record();
            rec.info.network_policy = Some(policy.clone());
            rec.clone()
        };
        joined(self.commit(rec.clone()).await)?;
        let mut info = rec.info;
        info.usage = live.driver.usage(&live.handle).ok();
        Ok(info)
    }

    /// For phase switches: enforces `policy` (the phase's `network`, or the
    /// sandbox's `network_policy` for a phase without one) live, like
    /// [`Node::apply_network_policy`], without replacing the sandbox's own
    /// `network_policy`. A no-op for sandboxes not in `allowlist` mode.
    pub async fn enforce_network_policy(&self, id: &str, policy: &NetworkPolicy) -> Result<()> {
        policy.validate("network_policy").map_err(NodeError::Invalid)?;
        let live = self.live(id)?;
        if live.record().info.network != NetworkMode::Allowlist {
            return Ok(());
        }
        self.enforce(id, policy)
    }

    fn enforce(&self, id: &str, policy: &NetworkPolicy) -> Result<()> {
        let rules = self.node_net().expand(policy)?;
        self.node_net().net.set_rules(id, rules).map_err(net_err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(presets: Option<&str>) -> (tempfile::TempDir, NodeNet) {
        let dir = tempfile::tempdir().unwrap();
        let mut opts = NetworkOptions::default();
        if let Some(json) = presets {
            let path = dir.path().join("presets.json");
            std::fs::write(&path, json).unwrap();
            opts.presets = Some(path);
        }
        let net = NodeNet::open("unit", dir.path(), &opts).unwrap();
        (dir, net)
    }

    #[test]
    fn builtin_presets_are_valid_policies() {
        for (name, rules) in builtin_presets() {
            let policy = NetworkPolicy { presets: vec![name.clone()], rules };
            assert!(policy.validate("p").is_ok(), "{name}");
        }
    }

    #[test]
    fn presets_expand_before_own_rules_and_unknown_ones_name_their_index() {
        let (_dir, net) = net(Some(r#"{"mirror": [{"cidr": "10.9.0.0/16", "ports": [80]}]}"#));
        let policy: NetworkPolicy = serde_json::from_str(
            r#"{"presets": ["mirror", "npm"], "rules": [{"domain": "example.org", "ports": [443]}]}"#,
        )
        .unwrap();
        let rules = net.expand(&policy).unwrap();
        let names: Vec<String> = rules.iter().map(|r| r.cidr.clone().or(r.domain.clone()).unwrap()).collect();
        assert_eq!(names, vec!["10.9.0.0/16", "registry.npmjs.org", "example.org"]);
        let bad = NetworkPolicy { presets: vec!["pypi".into(), "nope".into()], rules: Vec::new() };
        match net.expand(&bad) {
            Err(NodeError::Invalid(e)) => assert_eq!(e.field.as_deref(), Some("network_policy.presets[1]")),
            other => panic!("{:?}", other.map(|_| ())),
        }
    }

    #[test]
    fn a_bad_presets_file_is_refused_at_start() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("presets.json");
        std::fs::write(&path, r#"{"x": [{"cidr": "300.0.0.1"}]}"#).unwrap();
        let opts = NetworkOptions { presets: Some(path), ..Default::default() };
        assert!(NodeNet::open("unit", dir.path(), &opts).is_err());
    }
}

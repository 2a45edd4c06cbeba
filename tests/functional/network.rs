//! Egress of `allowlist` sandboxes: a veth pair, NAT, and eBPF cgroup
//! programs that allow only the policy's destinations - changed live, with
//! every refusal a security event, over IPv4 and IPv6. Peers are servers
//! this test runs in network namespaces it makes (named after the test
//! process), never any outside address.

use std::net::{Ipv4Addr, Ipv6Addr};
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::{sleep, Instant};
use warren_api::{ErrorCode, SandboxInfo, SecurityEvent, SecurityEventKind, SecurityEventList};
use warren_tests::*;

const PROBE: &str = "/tmp/netprobe";
const WAIT: Duration = Duration::from_secs(30);
static PEERS: AtomicU32 = AtomicU32::new(0);

fn run(cmd: &[&str]) {
    let out = Command::new(cmd[0]).args(&cmd[1..]).output().expect("run a host command");
    assert!(out.status.success(), "{cmd:?}: {}", String::from_utf8_lossy(&out.stderr));
}

fn output(cmd: &[&str]) -> String {
    let out = Command::new(cmd[0]).args(&cmd[1..]).output().expect("run a host command");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A /24 per test for the sandboxes' pool and one for its peers, picked
/// by pid and a counter so concurrent tests (and runs) do not collide.
fn block() -> u8 {
    let n = PEERS.fetch_add(1, Ordering::SeqCst);
    ((std::process::id() * 7 + n * 13) % 200) as u8 + 20
}

/// A network namespace with a veth to the host and TCP echo servers, on
/// an IPv4 /30 and an IPv6 /64 (ULA) of the test's block.
struct Peer {
    ns: String,
    host_if: String,
    addr: Ipv4Addr,
    addr6: Ipv6Addr,
    servers: Vec<tokio::task::JoinHandle<()>>,
}

impl Peer {
    fn new(block: u8) -> Peer {
        let tag = format!("{}{}", std::process::id() % 100_000, block);
        let peer = Peer {
            ns: format!("wtnet-{tag}"),
            host_if: format!("wtp{tag}"),
            addr: Ipv4Addr::new(10, 251, block, 2),
            addr6: Ipv6Addr::new(0xfdee, 0x77, u16::from(block), 0, 0, 0, 0, 2),
            servers: Vec::new(),
        };
        let peer_if = format!("wtq{tag}");
        run(&["ip", "netns", "add", &peer.ns]);
        run(&["ip", "link", "add", &peer.host_if, "type", "veth", "peer", "name", &peer_if, "netns", &peer.ns]);
        run(&["ip", "addr", "add", &format!("10.251.{block}.1/30"), "dev", &peer.host_if]);
        run(&["ip", "addr", "add", &format!("{}/64", peer.host_addr6()), "dev", &peer.host_if, "nodad"]);
        run(&["ip", "link", "set", &peer.host_if, "up"]);
        run(&["ip", "-n", &peer.ns, "addr", "add", &format!("10.251.{block}.2/30"), "dev", &peer_if]);
        run(&["ip", "-n", &peer.ns, "addr", "add", &format!("{}/64", peer.addr6), "dev", &peer_if, "nodad"]);
        run(&["ip", "-n", &peer.ns, "link", "set", &peer_if, "up"]);
        run(&["ip", "-n", &peer.ns, "link", "set", "lo", "up"]);
        peer
    }

    /// The host's end of the peer's veth.
    fn host_addr(&self) -> Ipv4Addr {
        let [a, b, c, _] = self.addr.octets();
        Ipv4Addr::new(a, b, c, 1)
    }

    /// The host's IPv6 address on the peer's veth.
    fn host_addr6(&self) -> Ipv6Addr {
        let s = self.addr6.segments();
        Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 1)
    }

    /// An echo server on `port` in the namespace (IPv4 and IPv6).
    fn serve_echo(&mut self, port: u16) {
        let ns = PathBuf::from("/run/netns").join(&self.ns);
        let listener = std::thread::spawn(move || {
            let f = std::fs::File::open(&ns).expect("open the peer netns");
            rustix::thread::move_into_link_name_space(f.as_fd(), Some(rustix::thread::LinkNameSpaceType::Network))
                .expect("setns into the peer netns");
            // `::` takes IPv4 too (the namespace's bindv6only is 0).
            let l = std::net::TcpListener::bind(("::", port)).expect("bind the echo server");
            l.set_nonblocking(true).expect("nonblocking listener");
            l
        })
        .join()
        .expect("the setns thread");
        let listener = tokio::net::TcpListener::from_std(listener).expect("tokio listener");
        self.servers.push(tokio::spawn(async move {
            loop {
                let Ok((mut conn, _)) = listener.accept().await else { continue };
                tokio::spawn(async move {
                    let mut buf = [0u8; 64];
                    while let Ok(n) = conn.read(&mut buf).await {
                        if n == 0 || conn.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        }));
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        for s in &self.servers {
            s.abort();
        }
        let _ = Command::new("ip").args(["link", "del", &self.host_if]).output();
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).output();
    }
}

/// FNV-1a, as warren-net names its host objects.
fn fnv(text: &str) -> u32 {
    text.bytes().fold(0x811c9dc5u32, |h, b| (h ^ u32::from(b)).wrapping_mul(0x01000193))
}

/// The host objects of a server's sandbox network; removes them on drop
/// (after a failed test) and checks they are gone.
struct NetObjects {
    table: String,
    pins: PathBuf,
    veth_prefix: String,
    instance: String,
}

impl NetObjects {
    fn of(server: &TestServer) -> NetObjects {
        let clean: String =
            server.instance.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' { c } else { '_' }).collect();
        NetObjects {
            table: format!("warren_net_{clean}"),
            pins: PathBuf::from(format!("/sys/fs/bpf/warren-net-{}", server.instance)),
            veth_prefix: format!("wr{:06x}h", fnv(&server.instance) & 0xff_ffff),
            instance: server.instance.clone(),
        }
    }

    fn veths(&self) -> Vec<String> {
        output(&["ip", "-o", "link", "show"])
            .lines()
            .filter_map(|l| l.split(": ").nth(1))
            .map(|n| n.split('@').next().unwrap_or(n).to_string())
            .filter(|n| n.starts_with(&self.veth_prefix))
            .collect()
    }

    fn table_exists(&self) -> bool {
        Command::new("nft").args(["list", "table", "inet", &self.table]).output().is_ok_and(|o| o.status.success())
    }

    fn assert_gone(&self) {
        assert_eq!(self.veths(), Vec::<String>::new(), "veths left");
        assert!(!self.table_exists(), "nft table {} left", self.table);
        assert!(!self.pins.exists(), "bpffs pins {} left", self.pins.display());
        assert_eq!(held_uplinks(&self.instance), Vec::<String>::new(), "IPv6 uplinks still held");
    }
}

impl Drop for NetObjects {
    fn drop(&mut self) {
        for v in self.veths() {
            let _ = Command::new("ip").args(["link", "del", &v]).output();
        }
        let _ = Command::new("nft").args(["delete", "table", "inet", &self.table]).output();
        let _ = std::fs::remove_dir_all(&self.pins);
        // Let go of the uplinks as the server would have (a failed test's
        // server is killed): the last holder turns forwarding back off.
        for interface in held_uplinks(&self.instance) {
            let dir = PathBuf::from(FORCE_FORWARDING).join(&interface);
            let _ = std::fs::remove_file(dir.join(holder_name(&self.instance)));
            if std::fs::read_dir(&dir).map(|d| d.count()).unwrap_or(0) == 0 {
                let _ = std::fs::write(format!("/proc/sys/net/ipv6/conf/{interface}/force_forwarding"), "0");
                let _ = std::fs::remove_dir(&dir);
            }
        }
    }
}

fn probe_binary() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT.get_or_init(|| static_c_helper("functional/network/probe.c", env!("CARGO_TARGET_TMPDIR"))).clone()
}

async fn start(pool_block: u8, extra: &[&str]) -> (TestServer, NetObjects) {
    let pool = format!("10.250.{pool_block}.0/24");
    let mut args = vec!["--sandbox-net", pool.as_str()];
    args.extend_from_slice(extra);
    let server = TestServer::start_with(&args).await;
    let objects = NetObjects::of(&server);
    (server, objects)
}

async fn allowlist(server: &TestServer, policy: Value) -> SandboxInfo {
    let sb = server.create(small(json!({"network": "allowlist", "network_policy": policy}))).await;
    let bytes = std::fs::read(probe_binary()).expect("read the probe");
    let (status, body) = server.put_file(&sb.id, PROBE, bytes, Some("755")).await;
    assert_eq!(status, StatusCode::OK, "upload the probe: {body}");
    sb
}

async fn probe(server: &TestServer, id: &str, args: &str) -> String {
    let r = server.sh(id, &format!("{PROBE} {args}")).await;
    assert_eq!(r.exit_code, Some(0), "probe {args}: {r:?}");
    stdout(&r).to_string()
}

async fn put_network(server: &TestServer, id: &str, policy: Value) -> (StatusCode, Value) {
    server.call(Method::PUT, &format!("/v1/sandboxes/{id}/network"), Some(&policy)).await
}

async fn events(server: &TestServer, id: &str) -> Vec<SecurityEvent> {
    let (status, body) = server.call(Method::GET, &format!("/v1/sandboxes/{id}/events"), None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    serde_json::from_value::<SecurityEventList>(body).expect("an event list").events
}

/// Waits (bounded) for an event of `kind` whose detail contains `needle`.
async fn wait_event(server: &TestServer, id: &str, kind: SecurityEventKind, needle: &str) -> SecurityEvent {
    let deadline = Instant::now() + WAIT;
    loop {
        let all = events(server, id).await;
        if let Some(e) = all.iter().find(|e| e.kind == kind && e.detail.contains(needle)) {
            return e.clone();
        }
        assert!(Instant::now() < deadline, "no {kind:?} event about {needle}: {all:?}");
        sleep(Duration::from_millis(50)).await;
    }
}

/// A peer with echo servers on ports 80 and 81, and a `--dns-hosts` file
/// (in the returned temporary directory) holding `hosts(&peer)`.
fn echo_peer_named(hosts: impl FnOnce(&Peer) -> String) -> (u8, Peer, tempfile::TempDir, PathBuf) {
    let b = block();
    let mut peer = Peer::new(b);
    peer.serve_echo(80);
    peer.serve_echo(81);
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("hosts");
    std::fs::write(&path, hosts(&peer)).expect("hosts file");
    (b, peer, dir, path)
}

fn cidr_rule(addr: Ipv4Addr, ports: &[u16], protocol: &str) -> Value {
    json!({"cidr": addr.to_string(), "ports": ports, "protocol": protocol})
}

#[tokio::test]
async fn allowed_tcp_connects_and_anything_else_is_refused_and_reported() {
    let b = block();
    let mut peer = Peer::new(b);
    peer.serve_echo(80);
    peer.serve_echo(81);
    let (server, objects) = start(b, &[]).await;
    let sb = allowlist(&server, json!({"rules": [cidr_rule(peer.addr, &[80], "tcp")]})).await;
    assert_eq!(server.get(&sb.id).await.network_policy.map(|p| p.rules.len()), Some(1), "info shows the policy");
    let link = server.sh_ok(&sb.id, "ip -o addr show eth0").await;
    assert!(link.contains("10.250."), "eth0 has an address of the pool: {link}");
    assert!(link.contains("inet6 fd"), "eth0 has an address of the IPv6 pool: {link}");
    assert!(!link.contains("fe80"), "no link-local IPv6: {link}");

    assert_eq!(probe(&server, &sb.id, &format!("tcp {} 80", peer.addr)).await, "tcp OK\necho OK\n");
    assert_eq!(probe(&server, &sb.id, &format!("tcp {} 81", peer.addr)).await, "tcp EPERM\n");
    let event = wait_event(&server, &sb.id, SecurityEventKind::NetworkBlocked, &format!("{}:81", peer.addr)).await;
    assert_eq!((event.syscall.as_str(), event.comm.as_str()), ("connect", "netprobe"), "{event:?}");
    assert!(event.detail.starts_with("tcp "), "{event:?}");
    assert!(event.pid > 0, "the pid inside the sandbox: {event:?}");
    // Loopback inside the sandbox is always allowed.
    // (The listener hands the connection to `cat`: a plain `nc -l` quits at
    // EOF on its own stdin, which can come before the client's bytes.)
    let lo = "nc -l -p 7000 -e sh -c 'cat > /tmp/got' & listener=$!; i=0; until echo lo | nc 127.0.0.1 7000; do i=$((i+1)); \
              [ $i -gt 300 ] && exit 1; sleep 0.1; done; wait $listener; cat /tmp/got";
    assert_eq!(server.sh_ok(&sb.id, lo).await, "lo\n");
    assert_eq!(objects.veths().len(), 1, "one veth for the sandbox");
    assert!(objects.table_exists() && objects.pins.exists());

    // A rule wide enough to cover an address of the host itself still does
    // not reach the host's own services.
    let host_side = std::net::TcpListener::bind((peer.host_addr(), 0)).expect("a host listener");
    let port = host_side.local_addr().expect("its address").port();
    let wide = json!({"rules": [{"cidr": format!("{}/30", peer.addr), "ports": [80, port]}]});
    let (status, body) = put_network(&server, &sb.id, wide).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(probe(&server, &sb.id, &format!("tcp {} 80", peer.addr)).await, "tcp OK\necho OK\n");
    let to_host = probe(&server, &sb.id, &format!("tcp {} {port}", peer.host_addr())).await;
    assert!(!to_host.contains("tcp OK"), "the host is not reachable: {to_host}");

    server.delete(&sb.id).await;
    assert_eq!(objects.veths(), Vec::<String>::new(), "destroy removes the veth");
    server.finish().await;
    objects.assert_gone();
}

#[tokio::test]
async fn udp_ipv6_and_foreign_dns_are_blocked_around_a_tcp_rule() {
    let b = block();
    let mut peer = Peer::new(b);
    peer.serve_echo(53);
    let (server, objects) = start(b, &[]).await;
    let sb = allowlist(&server, json!({"rules": [cidr_rule(peer.addr, &[53], "tcp")]})).await;
    assert_eq!(probe(&server, &sb.id, &format!("tcp {} 53", peer.addr)).await, "tcp OK\necho OK\n");
    // A resolver of the agent's choosing, on the very host the TCP rule names.
    assert_eq!(probe(&server, &sb.id, &format!("udp {} 53", peer.addr)).await, "udp EPERM\n");
    wait_event(&server, &sb.id, SecurityEventKind::NetworkBlocked, &format!("udp {}:53", peer.addr)).await;
    // busybox nslookup against that resolver gets nowhere either.
    let r = server.sh(&sb.id, &format!("nslookup example.test {}", peer.addr)).await;
    assert_ne!(r.exit_code, Some(0), "{r:?}");
    assert_eq!(probe(&server, &sb.id, "tcp6 2001:db8::1 80").await, "tcp6 EPERM\n");
    assert_eq!(
        probe(&server, &sb.id, &format!("tcp6 ::ffff:{} 53", peer.addr)).await,
        "tcp6 OK\necho OK\n",
        "a v4-mapped address is the same destination"
    );
    // IPv6 routes now: the peer's own IPv6 address, same port, is refused
    // by the policy, not by a missing route.
    assert_eq!(probe(&server, &sb.id, &format!("tcp6 {} 53", peer.addr6)).await, "tcp6 EPERM\n");
    assert_eq!(probe(&server, &sb.id, "udp6 2001:db8::1 53").await, "udp6 EPERM\n");
    wait_event(&server, &sb.id, SecurityEventKind::NetworkBlocked, "[2001:db8::1]:80").await;
    server.finish().await;
    objects.assert_gone();
}

#[tokio::test]
async fn raw_packet_and_odd_sockets_are_refused() {
    let b = block();
    let (server, objects) = start(b, &[]).await;
    let sb = allowlist(&server, json!({})).await;
    let out = probe(&server, &sb.id, "sockets").await;
    for line in out.lines() {
        assert!(!line.ends_with(" OK"), "{line} in:\n{out}");
    }
    assert!(out.contains("raw EPERM") && out.contains("packet EPERM"), "{out}");
    server.finish().await;
    objects.assert_gone();
}

#[tokio::test]
async fn live_policy_changes_apply_to_the_next_connect_and_cut_established_connections() {
    let b = block();
    let mut peer = Peer::new(b);
    peer.serve_echo(80);
    let (server, objects) = start(b, &[]).await;
    let sb = allowlist(&server, json!({})).await;
    let target = format!("{} 80", peer.addr);
    assert_eq!(probe(&server, &sb.id, &format!("tcp {target}")).await, "tcp EPERM\n");

    // Through the CLI, as a user would.
    let cli = Command::new(warren_binary())
        .args(["--json", "sandbox", "network", &sb.id, "--allow", &format!("{}:80", peer.addr)])
        .env("WARREN_URL", &server.url)
        .output()
        .expect("run the warren CLI");
    assert!(cli.status.success(), "{}", String::from_utf8_lossy(&cli.stderr));
    let body: Value = serde_json::from_slice(&cli.stdout).expect("the CLI prints the sandbox as JSON");
    assert_eq!(body["network_policy"]["rules"][0]["cidr"], json!(peer.addr.to_string()));
    assert_eq!(body["network_policy"]["rules"][0]["ports"], json!([80]));
    assert_eq!(probe(&server, &sb.id, &format!("tcp {target}")).await, "tcp OK\necho OK\n");

    // An established connection: proven to work, then its rule goes away.
    let req = warren_api::ExecRequest { command: Some(format!("{PROBE} hold {target} /tmp/go")), ..Default::default() };
    let mut reader = server.exec_open(&sb.id, &req).await;
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("first ") {
        let frame = reader.next().await.expect("the hold probe reports its first round trip");
        seen.extend(frame_bytes(&[frame], warren_api::StreamName::Stdout));
    }
    assert!(String::from_utf8_lossy(&seen).contains("first OK"), "{}", String::from_utf8_lossy(&seen));
    let (status, body) = put_network(&server, &sb.id, json!({})).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    server.sh_ok(&sb.id, "touch /tmp/go").await;
    let rest = reader.collect().await;
    seen.extend(frame_bytes(&rest, warren_api::StreamName::Stdout));
    let text = String::from_utf8_lossy(&seen).to_string();
    assert!(text.contains("second ") && !text.contains("second OK"), "the backstop drops its packets:\n{text}");
    wait_event(&server, &sb.id, SecurityEventKind::NetworkBlocked, "(packet dropped)").await;
    assert_eq!(probe(&server, &sb.id, &format!("tcp {target}")).await, "tcp EPERM\n");

    // Bad policies name their field; other modes cannot be changed.
    let (status, body) = put_network(&server, &sb.id, json!({"presets": ["nope"]})).await;
    assert_api_error(status, &body, ErrorCode::InvalidRequest, Some("network_policy.presets[0]"));
    let (status, body) = put_network(&server, &sb.id, json!({"rules": [{"cidr": "10.0.0.0/33"}]})).await;
    assert_api_error(status, &body, ErrorCode::InvalidRequest, Some("network_policy.rules[0].cidr"));
    let plain = server.create(small(json!({"network": "loopback"}))).await;
    let (status, body) = put_network(&server, &plain.id, json!({})).await;
    assert_api_error(status, &body, ErrorCode::InvalidRequest, Some("network"));
    server.finish().await;
    objects.assert_gone();
}

#[tokio::test]
async fn domain_rules_resolve_through_the_platform_resolver_and_pin_the_answer() {
    let b = block();
    let mut peer = Peer::new(b);
    peer.serve_echo(80);
    let dir = tempfile::tempdir().expect("temp dir");
    let hosts = dir.path().join("hosts");
    std::fs::write(&hosts, format!("{} mirror.test\n{} other.test\n", peer.addr, peer.addr)).expect("hosts file");
    let (server, objects) = start(b, &["--dns-hosts", hosts.to_str().expect("utf-8 path")]).await;
    let sb = allowlist(&server, json!({"rules": [{"domain": "mirror.test", "ports": [80]}]})).await;
    let target = format!("tcp {} 80", peer.addr);
    assert_eq!(probe(&server, &sb.id, &target).await, "tcp EPERM\n", "not before the name was resolved");
    let resolv = server.sh_ok(&sb.id, "cat /etc/resolv.conf").await;
    assert!(resolv.starts_with("nameserver 10.250."), "{resolv}");

    let found = server.sh_ok(&sb.id, "nslookup mirror.test").await;
    assert!(found.contains(&peer.addr.to_string()), "{found}");
    assert_eq!(probe(&server, &sb.id, &target).await, "tcp OK\necho OK\n", "the answer is pinned");

    let r = server.sh(&sb.id, "nslookup other.test").await;
    assert!(!stdout(&r).contains(&peer.addr.to_string()), "a name no rule allows is refused: {r:?}");
    wait_event(&server, &sb.id, SecurityEventKind::DnsRefused, "other.test").await;

    // Dropping the domain rule drops its pinned answers too.
    let (status, body) = put_network(&server, &sb.id, json!({})).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(probe(&server, &sb.id, &target).await, "tcp EPERM\n");
    server.finish().await;
    objects.assert_gone();
}

#[tokio::test]
async fn presets_expand_from_the_config_file_and_unknown_ones_are_rejected() {
    let b = block();
    let mut peer = Peer::new(b);
    peer.serve_echo(80);
    let dir = tempfile::tempdir().expect("temp dir");
    let presets = dir.path().join("presets.json");
    std::fs::write(&presets, json!({"mirror": [cidr_rule(peer.addr, &[80], "tcp")]}).to_string()).expect("presets");
    let (server, objects) = start(b, &["--network-presets", presets.to_str().expect("utf-8 path")]).await;
    let (status, body) = server
        .try_create(&small(json!({"network": "allowlist", "network_policy": {"presets": ["pypi", "nope"]}})))
        .await;
    assert_api_error(status, &body, ErrorCode::InvalidRequest, Some("network_policy.presets[1]"));
    let ports: Vec<u16> = (1..=33).collect();
    let too_many = json!({"network": "allowlist", "network_policy": {"rules": [cidr_rule(peer.addr, &ports, "tcp")]}});
    let (status, body) = server.try_create(&small(too_many)).await;
    assert_api_error(status, &body, ErrorCode::InvalidRequest, Some("network_policy.rules"));
    assert_eq!(server.list(None).await.len(), 0, "nothing was made for refused policies");
    let sb = allowlist(&server, json!({"presets": ["mirror", "pypi"]})).await;
    assert_eq!(probe(&server, &sb.id, &format!("tcp {} 80", peer.addr)).await, "tcp OK\necho OK\n");
    server.finish().await;
    objects.assert_gone();
}

#[tokio::test]
async fn a_crashed_server_leaves_enforcement_in_place_and_the_restart_sweeps() {
    let b = block();
    let mut peer = Peer::new(b);
    peer.serve_echo(80);
    peer.serve_echo(81);
    let (mut server, objects) = start(b, &[]).await;
    let kept = allowlist(
        &server,
        json!({"rules": [cidr_rule(peer.addr, &[80], "tcp"), cidr6_rule(peer.addr6, &[80], "tcp")]}),
    )
    .await;
    let gone = allowlist(&server, json!({})).await;
    server.crash().await;
    // While no node runs, the programs still hold.
    let pid1 = sandbox_pids(&server.instance, &kept.id);
    assert!(!pid1.is_empty());
    assert_eq!(objects.veths().len(), 2);
    // The second sandbox dies with the node: the restart must sweep its network.
    for pid in sandbox_pids(&server.instance, &gone.id) {
        let _ = rustix::process::kill_process(
            rustix::process::Pid::from_raw(pid).expect("a pid"),
            rustix::process::Signal::KILL,
        );
    }
    // A veth of this server that no sandbox owns, as a crash mid-create leaves.
    let stray = format!("{}ffff", objects.veth_prefix);
    let stray_peer = format!("wts{}", std::process::id() % 100_000);
    run(&["ip", "link", "add", &stray, "type", "veth", "peer", "name", &stray_peer]);
    server.launch().await;
    assert!(!objects.veths().contains(&stray), "the restart swept {stray}");
    assert_eq!(server.get(&kept.id).await.state, warren_api::SandboxState::Running);
    assert_eq!(server.get(&gone.id).await.state, warren_api::SandboxState::Ended);
    assert_eq!(objects.veths().len(), 1, "the dead sandbox's veth was swept: {:?}", objects.veths());
    assert_eq!(probe(&server, &kept.id, &format!("tcp {} 80", peer.addr)).await, "tcp OK\necho OK\n");
    assert_eq!(probe(&server, &kept.id, &format!("tcp {} 81", peer.addr)).await, "tcp EPERM\n");
    assert_eq!(probe(&server, &kept.id, &format!("tcp6 {} 80", peer.addr6)).await, "tcp6 OK\necho OK\n");
    assert_eq!(probe(&server, &kept.id, &format!("tcp6 {} 81", peer.addr6)).await, "tcp6 EPERM\n");
    wait_event(&server, &kept.id, SecurityEventKind::NetworkBlocked, &format!("{}:81", peer.addr)).await;
    let (status, body) = put_network(&server, &kept.id, json!({})).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(probe(&server, &kept.id, &format!("tcp {} 80", peer.addr)).await, "tcp EPERM\n");
    server.finish().await;
    objects.assert_gone();
}

/// The registry of host interfaces whose IPv6 `force_forwarding` servers
/// turned on (crates/warren-net/src/forwarding.rs), and the holder file
/// name of `instance` in it.
const FORCE_FORWARDING: &str = "/run/warren-net/ipv6-force-forwarding";

fn force_forwarding(interface: &str) -> String {
    std::fs::read_to_string(format!("/proc/sys/net/ipv6/conf/{interface}/force_forwarding"))
        .unwrap_or_default()
        .trim()
        .to_string()
}

fn holder_name(instance: &str) -> String {
    instance.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).collect()
}

/// The interfaces the registry says `instance` holds.
fn held_uplinks(instance: &str) -> Vec<String> {
    let holder = holder_name(instance);
    let Ok(entries) = std::fs::read_dir(FORCE_FORWARDING) else { return Vec::new() };
    entries
        .filter_map(|e| e.ok())
        .filter(|e| e.path().join(&holder).exists())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

/// IPv6 egress is tested wherever it runs: it fails (does not skip) where
/// the host kernel cannot give it.
fn require_ipv6_egress() {
    assert!(
        std::path::Path::new("/proc/sys/net/ipv6/conf/all/force_forwarding").exists(),
        "IPv6 egress needs per-interface force_forwarding (Linux 6.17+)"
    );
}

fn cidr6_rule(addr: Ipv6Addr, ports: &[u16], protocol: &str) -> Value {
    json!({"cidr": format!("{addr}/128"), "ports": ports, "protocol": protocol})
}

#[tokio::test]
async fn ipv6_egress_is_routed_and_held_to_the_same_policy() {
    require_ipv6_egress();
    let (b, peer, _dir, hosts) = echo_peer_named(|peer| format!("{} mirror6.test\n", peer.addr6));
    // A holder a killed server left on the peer's veth: no such process,
    // so the first server touching the registry lets it go.
    let ghost = PathBuf::from(FORCE_FORWARDING).join(&peer.host_if);
    std::fs::create_dir_all(&ghost).expect("plant a registry entry");
    std::fs::write(ghost.join("wt-ghost"), "4000000000 1").expect("plant a dead holder");
    let (server, objects) = start(b, &["--dns-hosts", hosts.to_str().expect("utf-8 path")]).await;
    let sb = allowlist(&server, json!({"rules": [cidr6_rule(peer.addr6, &[80], "tcp")]})).await;
    assert!(!ghost.join("wt-ghost").exists(), "the dead server's holder was let go");
    let link = server.sh_ok(&sb.id, "ip -o addr show eth0").await;
    assert!(link.contains("inet6 fd") && link.contains("/126"), "a /126 of the IPv6 pool: {link}");
    assert!(!link.contains("fe80"), "no link-local address: {link}");
    let route = server.sh_ok(&sb.id, "ip -6 route show default").await;
    assert!(route.contains("default via fd"), "an IPv6 default route: {route}");

    // The forwarding this takes: the sandbox's veth and the way back in,
    // per interface; the host-wide switch is left alone.
    let global = std::fs::read_to_string("/proc/sys/net/ipv6/conf/all/forwarding").expect("all.forwarding");
    let veths = objects.veths();
    assert_eq!(veths.len(), 1);
    assert_eq!(force_forwarding(&veths[0]), "1", "the sandbox's host veth forwards");
    if global.trim() == "0" {
        assert!(held_uplinks(&server.instance).contains(&peer.host_if), "the peer's veth is held");
        assert_eq!(force_forwarding(&peer.host_if), "1");
    }

    assert_eq!(probe(&server, &sb.id, &format!("tcp6 {} 80", peer.addr6)).await, "tcp6 OK\necho OK\n");
    assert_eq!(probe(&server, &sb.id, &format!("tcp6 {} 81", peer.addr6)).await, "tcp6 EPERM\n");
    let event =
        wait_event(&server, &sb.id, SecurityEventKind::NetworkBlocked, &format!("tcp [{}]:81", peer.addr6)).await;
    assert_eq!((event.syscall.as_str(), event.comm.as_str()), ("connect", "netprobe"), "{event:?}");
    // UDP to the very host and port the TCP rule names.
    assert_eq!(probe(&server, &sb.id, &format!("udp6 {} 80", peer.addr6)).await, "udp6 EPERM\n");
    wait_event(&server, &sb.id, SecurityEventKind::NetworkBlocked, &format!("udp [{}]:80", peer.addr6)).await;
    // The IPv4 side of the same peer has no rule.
    assert_eq!(probe(&server, &sb.id, &format!("tcp {} 80", peer.addr)).await, "tcp EPERM\n");

    // A rule wide enough to cover the host's own IPv6 address on the
    // peer's link does not reach the host's services.
    let host_side = std::net::TcpListener::bind((peer.host_addr6(), 0)).expect("a host listener");
    let port = host_side.local_addr().expect("its address").port();
    let wide = json!({"rules": [{"cidr": format!("{}/64", peer.host_addr6()), "ports": [80, port]}]});
    let (status, body) = put_network(&server, &sb.id, wide).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(probe(&server, &sb.id, &format!("tcp6 {} 80", peer.addr6)).await, "tcp6 OK\necho OK\n");
    let to_host = probe(&server, &sb.id, &format!("tcp6 {} {port}", peer.host_addr6())).await;
    assert!(!to_host.contains("tcp6 OK"), "the host is not reachable over IPv6: {to_host}");

    // Live: without the rule the next connect is refused, with it back it works.
    let (status, body) = put_network(&server, &sb.id, json!({})).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(probe(&server, &sb.id, &format!("tcp6 {} 80", peer.addr6)).await, "tcp6 EPERM\n");
    let rule = json!({"rules": [cidr6_rule(peer.addr6, &[80], "tcp")]});
    let (status, body) = put_network(&server, &sb.id, rule).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(probe(&server, &sb.id, &format!("tcp6 {} 80", peer.addr6)).await, "tcp6 OK\necho OK\n");

    // A domain rule whose answer is AAAA: pinned like an A answer.
    let (status, body) =
        put_network(&server, &sb.id, json!({"rules": [{"domain": "mirror6.test", "ports": [80]}]})).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let target = format!("tcp6 {} 80", peer.addr6);
    assert_eq!(probe(&server, &sb.id, &target).await, "tcp6 EPERM\n", "not before the name was resolved");
    let found = server.sh_ok(&sb.id, "nslookup -type=AAAA mirror6.test").await;
    assert!(found.contains(&peer.addr6.to_string()), "{found}");
    assert_eq!(probe(&server, &sb.id, &target).await, "tcp6 OK\necho OK\n", "the AAAA answer is pinned");

    server.delete(&sb.id).await;
    assert_eq!(objects.veths(), Vec::<String>::new(), "destroy removes the veth");
    server.finish().await;
    objects.assert_gone();
    let still_held = std::path::Path::new(FORCE_FORWARDING).join(&peer.host_if).exists();
    if !still_held {
        assert_eq!(force_forwarding(&peer.host_if), "0", "the peer veth's force_forwarding is back off");
    }
}

/// A warm pool of `allowlist` members (`--pool ...,network=allowlist`):
/// a member holds an empty network namespace until a create claims it, and
/// the claim plugs it with that create's own policy, so two claims with
/// different policies each reach what theirs allows and nothing else.
#[tokio::test]
async fn pooled_allowlist_sandboxes_get_their_own_policy_at_the_claim() {
    pooled_allowlist_case(warren_api::Backend::Container).await;
}

/// The same with a pool of booted `allowlist` microVMs.
#[tokio::test]
async fn pooled_allowlist_microvms_get_their_own_policy_at_the_claim() {
    guest::require_qemu_and_kernel("network");
    pooled_allowlist_case(warren_api::Backend::Microvm).await;
}

async fn pooled_allowlist_case(backend: warren_api::Backend) {
    let b = block();
    let mut peer = Peer::new(b);
    peer.serve_echo(80);
    peer.serve_echo(81);
    let backend_name = backend.as_str();
    let pool = format!(
        "backend={backend_name},image=busybox,cpus=1,memory_mib=128,disk_mib=64,pids=256,network=allowlist,size=2"
    );
    let (server, objects) = start(b, &["--pool", &pool]).await;
    server.wait_pool_idle(2).await;
    let to_80 = pooled_allowlist(&server, backend, json!({"rules": [cidr_rule(peer.addr, &[80], "tcp")]})).await;
    let to_81 = pooled_allowlist(&server, backend, json!({"rules": [cidr_rule(peer.addr, &[81], "tcp")]})).await;
    assert_eq!(objects.veths().len(), 2, "a veth per claimed sandbox, none for the members waiting");
    // A VM's refused connect reaches the guest as a reset, a container's as EPERM.
    for (sb, allowed, refused) in [(&to_80, 80, 81), (&to_81, 81, 80)] {
        let resolv = server.sh_ok(&sb.id, "cat /etc/resolv.conf").await;
        assert!(resolv.starts_with("nameserver 10.250."), "{resolv}");
        assert_eq!(probe(&server, &sb.id, &format!("tcp {} {allowed}", peer.addr)).await, "tcp OK\necho OK\n");
        let blocked = probe(&server, &sb.id, &format!("tcp {} {refused}", peer.addr)).await;
        assert!(!blocked.contains("tcp OK"), "port {refused} has no rule: {blocked}");
        wait_event(&server, &sb.id, SecurityEventKind::NetworkBlocked, &format!("{}:{refused}", peer.addr)).await;
    }
    server.delete(&to_80.id).await;
    server.delete(&to_81.id).await;
    assert_eq!(objects.veths(), Vec::<String>::new(), "destroy removes the veths");
    server.finish().await;
    objects.assert_gone();
}

/// An `allowlist` sandbox of `backend` under `policy` claimed from the
/// pool (creates until one is: the pool fills in the background), with the
/// probe in it.
async fn pooled_allowlist(server: &TestServer, backend: warren_api::Backend, policy: Value) -> SandboxInfo {
    for _ in 0..600 {
        let request = small(json!({"backend": backend, "network": "allowlist", "network_policy": policy}));
        let sb = create_ok(server, &request).await;
        if sb.from_pool {
            let bytes = std::fs::read(probe_binary()).expect("read the probe");
            let (status, body) = server.put_file(&sb.id, PROBE, bytes, Some("755")).await;
            assert_eq!(status, StatusCode::OK, "upload the probe: {body}");
            return sb;
        }
        server.delete(&sb.id).await;
        sleep(Duration::from_millis(200)).await;
    }
    panic!("no pooled sandbox; log:\n{}", server.log_tail(30));
}

/// A VM in `allowlist` mode: QEMU runs in the sandbox's network namespace
/// and cgroup, so the guest's connections (QEMU's user-mode network makes
/// them QEMU's own sockets) meet the same veth, NAT, egress programs,
/// platform resolver and live policy changes as a container's, also after
/// a pause to disk and after a restart of the server, which adopts it.
#[tokio::test]
async fn a_microvm_reaches_only_what_its_policy_allows() {
    vm_egress_case(warren_api::Backend::Microvm).await;
}

/// The same for a full VM (systemd's image; `getent` resolves through
/// glibc, which reads the same `/etc/resolv.conf`).
#[tokio::test]
async fn a_full_vm_reaches_only_what_its_policy_allows() {
    vm_egress_case(warren_api::Backend::Vm).await;
}

/// Snapshot boot of `allowlist` microVMs: the first create boots cold
/// while a template guest with a network device is snapshotted; the next
/// is a restored clone whose QEMU runs in its own sandbox's namespace and
/// reaches only what its policy allows. A sandbox without a network is
/// never restored from that snapshot (its clone would have a device whose
/// QEMU sits in no namespace of the sandbox's).
#[tokio::test]
async fn a_snapshot_restored_microvm_reaches_only_what_its_policy_allows() {
    vm_snapshot_egress_case(warren_api::Backend::Microvm).await;
}

/// The same for a full VM (its initramfs configures the network before
/// systemd starts; the no-network check is the microVM's).
#[tokio::test]
async fn a_snapshot_restored_full_vm_reaches_only_what_its_policy_allows() {
    vm_snapshot_egress_case(warren_api::Backend::Vm).await;
}

async fn vm_snapshot_egress_case(backend: warren_api::Backend) {
    guest::require_qemu_and_kernel("network");
    let (b, peer, _dir, hosts) = echo_peer_named(|peer| format!("{} mirror.test\n", peer.addr));
    let hosts = hosts.to_str().expect("utf-8 path");
    let (server, objects) = start(b, &["--dns-hosts", hosts, "--vm-snapshots", "on"]).await;
    let policy = vm_policy(&peer);
    let (request, lookup, _) = vm_request(&server, backend, policy).await;
    let first = create_ok(&server, &request).await;
    assert_eq!(first.boot, Some(warren_api::VmBoot::Cold), "nothing to restore yet");
    guest::wait_for_snapshots(&server, backend, 1).await;

    let clone = create_ok(&server, &request).await;
    assert_eq!(clone.boot, Some(warren_api::VmBoot::Snapshot), "{clone:?}");
    assert_eq!(objects.veths().len(), 2, "a veth per VM");
    vm_policy_holds(&server, &clone.id, &peer, lookup).await;
    server.delete(&first.id).await;

    if backend == warren_api::Backend::Microvm {
        let plain = create_ok(&server, &small(json!({"backend": backend}))).await;
        assert_eq!(plain.boot, Some(warren_api::VmBoot::Cold), "a guest with no network from a snapshot with one");
        let links = server.sh_ok(&plain.id, "cat /proc/net/dev").await;
        assert!(!links.contains("eth0"), "a sandbox without a network has a network device: {links}");
        server.delete(&plain.id).await;
        // Its shape's template runs in the driver's cgroup until snapshotted.
        assert_eq!(guest::wait_for_snapshots(&server, backend, 2).await.len(), 2);
    }

    guest::delete_leaves_nothing(backend, &server, &clone.id).await;
    assert_eq!(objects.veths(), Vec::<String>::new(), "destroy removes the veths");
    server.finish().await;
    objects.assert_gone();
}

/// A create request for an `allowlist` VM of `backend` under `policy`,
/// how its image resolves `mirror.test`, and its driver's run directory.
async fn vm_request(
    server: &TestServer,
    backend: warren_api::Backend,
    policy: Value,
) -> (Value, &'static str, &'static str) {
    let mut request = small(json!({"backend": backend, "network": "allowlist", "network_policy": policy}));
    match backend {
        warren_api::Backend::Vm => {
            guest::import_systemd_image(server).await;
            request["image"] = json!(guest::SYSTEMD_IMAGE);
            request["memory_mib"] = json!(512);
            request["disk_mib"] = json!(128);
            (request, "getent hosts mirror.test", "fullvm")
        }
        _ => (request, "nslookup mirror.test", "vm"),
    }
}

async fn create_ok(server: &TestServer, request: &Value) -> SandboxInfo {
    let (status, body) = server.try_create(request).await;
    assert_eq!(status, StatusCode::CREATED, "{body}\nlog:\n{}", server.log_tail(30));
    serde_json::from_value(body).expect("a sandbox info")
}

/// What the VM cases allow: `peer`'s TCP port 80 in IPv4 and IPv6, and
/// `mirror.test` (resolved to `peer`) on port 81.
fn vm_policy(peer: &Peer) -> Value {
    json!({"rules": [
        cidr_rule(peer.addr, &[80], "tcp"),
        cidr6_rule(peer.addr6, &[80], "tcp"),
        {"domain": "mirror.test", "ports": [81]},
    ]})
}

/// The checks of an `allowlist` VM under [`vm_policy`], `lookup` being how
/// the image resolves a name.
async fn vm_policy_holds(server: &TestServer, id: &str, peer: &Peer, lookup: &str) {
    let (peer6, peer) = (peer.addr6, peer.addr);
    let bytes = std::fs::read(probe_binary()).expect("read the probe");
    let (status, body) = server.put_file(id, PROBE, bytes, Some("755")).await;
    assert_eq!(status, StatusCode::OK, "upload the probe: {body}");
    assert_eq!(probe(server, id, &format!("tcp {peer} 80")).await, "tcp OK\necho OK\n");
    // QEMU's connect is refused: the guest sees its connection reset.
    let refused = probe(server, id, &format!("tcp {peer} 81")).await;
    assert!(!refused.contains("tcp OK"), "port 81 before its name was resolved: {refused}");
    let event = wait_event(server, id, SecurityEventKind::NetworkBlocked, &format!("{peer}:81")).await;
    assert_eq!((event.syscall.as_str(), event.pid, event.comm.as_str()), ("connect", 0, ""), "no host pid: {event:?}");

    let resolv = server.sh_ok(id, "cat /etc/resolv.conf").await;
    assert!(resolv.starts_with("nameserver 10.250."), "{resolv}");
    let found = server.sh_ok(id, lookup).await;
    assert!(found.contains(&peer.to_string()), "{found}");
    assert_eq!(probe(server, id, &format!("tcp {peer} 81")).await, "tcp OK\necho OK\n", "pinned");

    // IPv6: QEMU's own IPv6 sockets, held to the same rules.
    require_ipv6_egress();
    assert_eq!(probe(server, id, &format!("tcp6 {peer6} 80")).await, "tcp6 OK\necho OK\n");
    let refused = probe(server, id, &format!("tcp6 {peer6} 81")).await;
    assert!(!refused.contains("tcp6 OK"), "IPv6 port 81 has no rule: {refused}");
    wait_event(server, id, SecurityEventKind::NetworkBlocked, &format!("tcp [{peer6}]:81")).await;
}

async fn vm_egress_case(backend: warren_api::Backend) {
    guest::require_qemu_and_kernel("network");
    let (b, peer, _dir, hosts) = echo_peer_named(|peer| format!("{} mirror.test\n", peer.addr));
    let (mut server, objects) = start(b, &["--dns-hosts", hosts.to_str().expect("utf-8 path")]).await;
    let policy = vm_policy(&peer);
    let (request, lookup, run_dir) = vm_request(&server, backend, policy).await;
    let sb = create_ok(&server, &request).await;
    assert_eq!(objects.veths().len(), 1, "one veth for the VM");
    vm_policy_holds(&server, &sb.id, &peer, lookup).await;

    // Paused to disk and resumed, QEMU starts again in the same namespace.
    let mem = server.data_dir().join(run_dir).join(&sb.id).join("paused.mem");
    let vm_instance = match backend {
        warren_api::Backend::Vm => leaks::full_vm_instance(&server.instance),
        _ => leaks::vm_instance(&server.instance),
    };
    let check = format!("{PROBE} tcp {} 80", peer.addr);
    guest::disk_pause_round(&server, &sb.id, 0, (&mem, &vm_instance), (&check, "tcp OK\necho OK\n")).await;

    // A restarted server adopts the VM with its network: the same veth and
    // policy, and the namespace, pinned in the run directory. Adopted
    // paused to disk (no QEMU held it), running after the restart, and
    // paused to disk again, QEMU starts in it each time.
    let path = format!("/v1/sandboxes/{}/pause?to_disk=true", sb.id);
    let (status, body) = server.call(reqwest::Method::POST, &path, None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    server.restart().await;
    assert_eq!(server.get(&sb.id).await.state, warren_api::SandboxState::Paused, "log:\n{}", server.log_tail(30));
    assert_eq!(objects.veths().len(), 1, "the adopted VM keeps its veth");
    assert_eq!(probe(&server, &sb.id, &format!("tcp {} 80", peer.addr)).await, "tcp OK\necho OK\n");
    server.restart().await;
    assert_eq!(server.get(&sb.id).await.state, warren_api::SandboxState::Running, "log:\n{}", server.log_tail(30));
    assert_eq!(probe(&server, &sb.id, &format!("tcp {} 80", peer.addr)).await, "tcp OK\necho OK\n");
    let refused = probe(&server, &sb.id, &format!("tcp {} 82", peer.addr)).await;
    assert!(!refused.contains("tcp OK"), "port 82 has no rule after the restart: {refused}");
    guest::disk_pause_round(&server, &sb.id, 1, (&mem, &vm_instance), (&check, "tcp OK\necho OK\n")).await;

    // A live change applies to the guest's next connection.
    let (status, body) = put_network(&server, &sb.id, json!({})).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let cut = probe(&server, &sb.id, &format!("tcp {} 80", peer.addr)).await;
    assert!(!cut.contains("tcp OK"), "nothing allowed any more: {cut}");

    guest::delete_leaves_nothing(backend, &server, &sb.id).await;
    assert_eq!(objects.veths(), Vec::<String>::new(), "destroy removes the veth");
    server.finish().await;
    objects.assert_gone();
}

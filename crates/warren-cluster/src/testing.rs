//! A cluster on one machine, for tests and benchmarks: a bridge on the host
//! and one network namespace per node, each with its own address, so that
//! node agents, API servers and etcd talk over real interfaces. Names carry
//! the process id and the lab's number in the process (tests of one binary
//! run at once); dropping the [`Lab`] deletes the namespaces (and with
//! them the veth pairs) and the bridge. No traffic leaves these test hosts.

use std::net::{IpAddr, Ipv4Addr};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

/// Labs made by this process so far.
static LABS: AtomicU32 = AtomicU32::new(0);

/// The network: a bridge on the host side, one namespace per node.
pub struct Lab {
    bridge: String,
    pub namespaces: Vec<String>,
    subnet: u8,
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(out.status.success(), "ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
}

impl Lab {
    /// Makes the bridge and `nodes` namespaces; panics if `ip` fails (a
    /// test or benchmark cannot go on without them).
    pub fn new(nodes: usize) -> Lab {
        let pid = std::process::id();
        let seq = LABS.fetch_add(1, Ordering::SeqCst);
        let tag = format!("{}l{seq}", pid % 100_000);
        let lab = Lab {
            bridge: format!("wcb{tag}"),
            namespaces: (0..nodes).map(|i| format!("wcl-{pid}-{seq}-{i}")).collect(),
            subnet: ((pid + seq) % 250) as u8,
        };
        ip(&["link", "add", &lab.bridge, "type", "bridge"]);
        ip(&["addr", "add", &format!("{}/24", lab.host_ip()), "dev", &lab.bridge]);
        ip(&["link", "set", &lab.bridge, "up"]);
        for (i, ns) in lab.namespaces.iter().enumerate() {
            let (host_end, node_end) = (format!("wcv{tag}n{i}"), format!("wcp{tag}n{i}"));
            ip(&["netns", "add", ns]);
            ip(&["link", "add", &host_end, "type", "veth", "peer", "name", &node_end]);
            ip(&["link", "set", &node_end, "netns", ns]);
            ip(&["link", "set", &host_end, "master", &lab.bridge, "up"]);
            ip(&["-n", ns, "addr", "add", &format!("{}/24", lab.node_ip(i)), "dev", &node_end]);
            ip(&["-n", ns, "link", "set", &node_end, "up"]);
            ip(&["-n", ns, "link", "set", "lo", "up"]);
        }
        lab
    }

    /// The host's address on the bridge (etcd and API servers listen here
    /// or on loopback).
    pub fn host_ip(&self) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(10, 77, self.subnet, 1))
    }

    pub fn node_ip(&self, i: usize) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(10, 77, self.subnet, 11 + i as u8))
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        // Deleting a namespace deletes its veth end, and with it the pair.
        for ns in &self.namespaces {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
        let _ = Command::new("ip").args(["link", "del", &self.bridge]).status();
    }
}

impl Lab {
    /// The command words that run a program in node `i`'s namespace (its
    /// network only: mounts stay the host's, so leak checks see them).
    pub fn enter(&self, i: usize) -> Vec<String> {
        vec!["nsenter".into(), format!("--net=/run/netns/{}", self.namespaces[i]), "--".into()]
    }
}

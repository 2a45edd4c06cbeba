//! Turning address rules into the entries of the LPM policy map.
//!
//! The map answers with the longest matching prefix only, so each entry
//! carries the union of the ports of every rule whose prefix covers it: the
//! longest match then decides exactly as "any rule allows it" would.

use std::collections::BTreeSet;
use std::net::IpAddr;

use serde::{Deserialize, Serialize};
use warren_api::Protocol;

/// Ports per protocol one map entry can hold; keep in step with the C side.
pub const MAX_PORTS: usize = 32;
const KEY_BYTES: usize = 4 + 8 + 16;

/// A destination prefix as the map stores it: IPv6, or IPv4-mapped IPv6
/// (`::ffff:a.b.c.d`) with the length counted over all 128 bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Prefix {
    addr: [u8; 16],
    len: u8,
}

impl Prefix {
    /// `len` counts the bits of `ip`'s own family (at most 32 or 128).
    pub fn new(ip: IpAddr, len: u8) -> Prefix {
        let (addr, len) = match ip {
            IpAddr::V4(v4) => (v4.to_ipv6_mapped().octets(), 96 + len.min(32)),
            IpAddr::V6(v6) => (v6.octets(), len.min(128)),
        };
        Prefix { addr: mask(addr, len), len }
    }

    pub fn host(ip: IpAddr) -> Prefix {
        Prefix::new(ip, if ip.is_ipv4() { 32 } else { 128 })
    }

    fn covers(&self, other: &Prefix) -> bool {
        self.len <= other.len && mask(other.addr, self.len) == self.addr
    }

    pub fn describe(&self) -> String {
        let v6 = std::net::Ipv6Addr::from(self.addr);
        match v6.to_ipv4_mapped() {
            Some(v4) if self.len >= 96 => format!("{v4}/{}", self.len - 96),
            _ => format!("{v6}/{}", self.len),
        }
    }
}

fn mask(mut addr: [u8; 16], len: u8) -> [u8; 16] {
    for (i, byte) in addr.iter_mut().enumerate() {
        let bits = (len as usize).saturating_sub(i * 8).min(8);
        *byte &= if bits == 0 { 0 } else { 0xffu8 << (8 - bits) };
    }
    addr
}

/// One rule in address form (a CIDR rule, or a domain rule's pinned answer).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AddrRule {
    pub prefix: Prefix,
    /// Empty: every port.
    pub ports: Vec<u16>,
    pub protocol: Protocol,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Ports {
    any: bool,
    list: BTreeSet<u16>,
}

impl Ports {
    fn add(&mut self, ports: &[u16]) {
        if ports.is_empty() {
            self.any = true;
        }
        self.list.extend(ports);
    }

    fn write(&self, out: &mut Vec<u8>) {
        let mut slots = [0u16; MAX_PORTS];
        for (slot, port) in slots.iter_mut().zip(&self.list) {
            *slot = *port;
        }
        for slot in slots {
            out.extend_from_slice(&slot.to_ne_bytes());
        }
    }

    fn count(&self) -> u8 {
        if self.any {
            0
        } else {
            self.list.len() as u8
        }
    }
}

/// One entry of the policy map.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    prefix: Prefix,
    tcp: Ports,
    udp: Ports,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("destination {0} would need more than {MAX_PORTS} distinct ports for one protocol")]
pub struct TooManyPorts(pub String);

/// Builds the map entries that allow exactly what `rules` allow.
pub fn compile(rules: &[AddrRule]) -> Result<Vec<Entry>, TooManyPorts> {
    let prefixes: BTreeSet<Prefix> = rules.iter().map(|r| r.prefix).collect();
    let mut entries = Vec::with_capacity(prefixes.len());
    for prefix in prefixes {
        let mut entry = Entry { prefix, tcp: Ports::default(), udp: Ports::default() };
        for rule in rules.iter().filter(|r| r.prefix.covers(&prefix)) {
            if matches!(rule.protocol, Protocol::Tcp | Protocol::Any) {
                entry.tcp.add(&rule.ports);
            }
            if matches!(rule.protocol, Protocol::Udp | Protocol::Any) {
                entry.udp.add(&rule.ports);
            }
        }
        for ports in [&entry.tcp, &entry.udp] {
            if !ports.any && ports.list.len() > MAX_PORTS {
                return Err(TooManyPorts(prefix.describe()));
            }
        }
        entries.push(entry);
    }
    Ok(entries)
}

impl Entry {
    pub fn key(&self, cgroup_id: u64) -> Vec<u8> {
        let mut key = Vec::with_capacity(KEY_BYTES);
        key.extend_from_slice(&(64 + u32::from(self.prefix.len)).to_ne_bytes());
        key.extend_from_slice(&cgroup_id.to_ne_bytes());
        key.extend_from_slice(&self.prefix.addr);
        key
    }

    pub fn value(&self) -> Vec<u8> {
        let mut value = vec![u8::from(self.tcp.any), u8::from(self.udp.any), self.tcp.count(), self.udp.count()];
        self.tcp.write(&mut value);
        self.udp.write(&mut value);
        value
    }

    pub fn cgroup_of_key(key: &[u8]) -> Option<u64> {
        (key.len() == KEY_BYTES).then(|| u64::from_ne_bytes(key[4..12].try_into().unwrap_or_default()))
    }

    pub fn describe(&self) -> String {
        self.prefix.describe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(cidr: &str, len: u8, ports: &[u16], protocol: Protocol) -> AddrRule {
        AddrRule { prefix: Prefix::new(cidr.parse().unwrap(), len), ports: ports.to_vec(), protocol }
    }

    #[test]
    fn a_longer_prefix_inherits_the_ports_of_the_prefixes_covering_it() {
        let entries = compile(&[
            rule("10.0.0.0", 8, &[80], Protocol::Tcp),
            rule("10.1.2.3", 32, &[443], Protocol::Tcp),
            rule("10.1.2.3", 32, &[53], Protocol::Udp),
        ])
        .unwrap();
        assert_eq!(entries.len(), 2);
        let host = entries.iter().find(|e| e.prefix.len == 128).unwrap();
        assert_eq!(host.tcp.list, BTreeSet::from([80, 443]));
        assert_eq!(host.udp.list, BTreeSet::from([53]));
        let net = entries.iter().find(|e| e.prefix.len == 104).unwrap();
        assert_eq!(net.tcp.list, BTreeSet::from([80]));
        assert!(net.udp.list.is_empty() && !net.udp.any);
    }

    #[test]
    fn prefixes_are_masked_and_mapped() {
        let p = Prefix::new("192.168.7.9".parse().unwrap(), 16);
        assert_eq!(p.describe(), "192.168.0.0/16");
        assert!(p.covers(&Prefix::host("192.168.200.1".parse().unwrap())));
        assert!(!p.covers(&Prefix::host("192.169.0.1".parse().unwrap())));
        assert_eq!(Prefix::new("fd00::1".parse().unwrap(), 8).describe(), "fd00::/8");
    }

    #[test]
    fn keys_and_values_have_the_c_layout() {
        let entries = compile(&[rule("10.0.0.1", 32, &[], Protocol::Any)]).unwrap();
        let key = entries[0].key(5);
        assert_eq!(key.len(), 28);
        assert_eq!(u32::from_ne_bytes(key[..4].try_into().unwrap()), 64 + 128);
        assert_eq!(Entry::cgroup_of_key(&key), Some(5));
        let value = entries[0].value();
        assert_eq!(value.len(), 4 + 4 * MAX_PORTS);
        assert_eq!(&value[..4], &[1, 1, 0, 0]);
    }

    #[test]
    fn too_many_ports_is_an_error() {
        let ports: Vec<u16> = (1..=33).collect();
        assert!(compile(&[rule("10.0.0.1", 32, &ports, Protocol::Tcp)]).is_err());
    }
}

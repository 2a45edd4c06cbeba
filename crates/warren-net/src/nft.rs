//! The node's nftables table (family `inet`, so one table holds both
//! address families): masquerade for the sandbox address pools, no
//! forwarding between sandboxes, and nothing from a sandbox to the host
//! itself but DNS to its (IPv4) resolver and IPv6 neighbour discovery
//! (whatever CIDR rules a policy has). One table per server instance, made when the
//! network starts and deleted when it stops (or swept at start).
//!
//! The set `forced6` holds the host interfaces on which this instance
//! turned on IPv6 `force_forwarding` (see `forwarding.rs`): through them
//! only replies of masqueraded sandbox flows are forwarded, so the host
//! does not start routing anything else it receives there.

use std::io::Write;
use std::process::{Command, Stdio};

use crate::{Error, Result};

/// `warren_net_<instance>`, with characters nft does not take replaced.
pub fn table_name(instance: &str) -> String {
    let clean: String = instance.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' { c } else { '_' }).collect();
    format!("warren_net_{clean}")
}

/// (Re)creates the table: masquerade traffic from `pool` (and `pool6`)
/// leaving through anything but a sandbox veth, drop traffic between two
/// sandbox veths, and drop traffic from a sandbox veth to the host but
/// port 53 over IPv4 and neighbour discovery.
pub fn install(table: &str, pool: &str, pool6: Option<&str>, veth_glob: &str) -> Result<()> {
    let masquerade6 = match pool6 {
        Some(pool6) => format!("\t\tip6 saddr {pool6} oifname != \"{veth_glob}\" masquerade\n"),
        None => String::new(),
    };
    let script = format!(
        "table inet {table}\n\
         delete table inet {table}\n\
         table inet {table} {{\n\
         \tset forced6 {{\n\
         \t\ttype ifname;\n\
         \t}}\n\
         \tchain postrouting {{\n\
         \t\ttype nat hook postrouting priority srcnat; policy accept;\n\
         \t\tip saddr {pool} oifname != \"{veth_glob}\" masquerade\n\
         {masquerade6}\
         \t}}\n\
         \tchain input {{\n\
         \t\ttype filter hook input priority filter; policy accept;\n\
         \t\tiifname \"{veth_glob}\" meta nfproto ipv4 udp dport 53 accept\n\
         \t\tiifname \"{veth_glob}\" meta nfproto ipv4 tcp dport 53 accept\n\
         \t\tiifname \"{veth_glob}\" icmpv6 type {{ nd-neighbor-solicit, nd-neighbor-advert }} ip6 hoplimit 255 accept\n\
         \t\tiifname \"{veth_glob}\" drop\n\
         \t}}\n\
         \tchain forward {{\n\
         \t\ttype filter hook forward priority filter; policy accept;\n\
         \t\tiifname \"{veth_glob}\" oifname \"{veth_glob}\" drop\n\
         \t\tmeta nfproto ipv6 iifname @forced6 ct direction reply ct status snat accept\n\
         \t\tmeta nfproto ipv6 iifname @forced6 drop\n\
         \t}}\n\
         }}\n"
    );
    run(&["-f", "-"], Some(&script))
}

/// Adds host interfaces to the table's `forced6` set (already present
/// ones are fine).
pub fn add_forced(table: &str, interfaces: &[String]) -> Result<()> {
    if interfaces.is_empty() {
        return Ok(());
    }
    let names: Vec<String> = interfaces.iter().map(|i| format!("\"{i}\"")).collect();
    let script = format!("add element inet {table} forced6 {{ {} }}\n", names.join(", "));
    run(&["-f", "-"], Some(&script))
}

/// Deletes the table (and the `ip` one earlier versions made); a table
/// that is not there is not an error.
pub fn remove(table: &str) -> Result<()> {
    for family in ["inet", "ip"] {
        if exists_in(family, table)? {
            run(&["delete", "table", family, table], None)?;
        }
    }
    Ok(())
}

/// Whether `family`'s table exists; without the `nft` tool there can be
/// none of ours.
fn exists_in(family: &str, table: &str) -> Result<bool> {
    let out =
        Command::new("nft").args(["list", "table", family, table]).stdout(Stdio::null()).stderr(Stdio::null()).status();
    match out {
        Ok(status) => Ok(status.success()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(Error::io("run nft", e)),
    }
}

fn run(args: &[&str], stdin: Option<&str>) -> Result<()> {
    let mut child = Command::new("nft")
        .args(args)
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| Error::io("run nft (install nftables)", e))?;
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(text.as_bytes()).map_err(|e| Error::io("write to nft", e))?;
    }
    let out = child.wait_with_output().map_err(|e| Error::io("wait for nft", e))?;
    if !out.status.success() {
        return Err(Error::Nft(format!("nft {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim())));
    }
    Ok(())
}

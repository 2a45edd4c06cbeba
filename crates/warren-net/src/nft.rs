//! The node's nftables table: masquerade for the sandbox address pool, no
//! forwarding between sandboxes, and nothing from a sandbox to the host
//! itself but its resolver (whatever CIDR rules a policy has). One table per server instance, made
//! when the network starts and deleted when it stops (or swept at start).

use std::io::Write;
use std::process::{Command, Stdio};

use crate::{Error, Result};

/// `warren_net_<instance>`, with characters nft does not take replaced.
pub fn table_name(instance: &str) -> String {
    let clean: String = instance.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' { c } else { '_' }).collect();
    format!("warren_net_{clean}")
}

/// (Re)creates the table: masquerade traffic from `pool` leaving through
/// anything but a sandbox veth, drop traffic between two sandbox veths,
/// and drop traffic from a sandbox veth to the host but UDP port 53.
pub fn install(table: &str, pool: &str, veth_glob: &str) -> Result<()> {
    let script = format!(
        "table ip {table}\n\
         delete table ip {table}\n\
         table ip {table} {{\n\
         \tchain postrouting {{\n\
         \t\ttype nat hook postrouting priority srcnat; policy accept;\n\
         \t\tip saddr {pool} oifname != \"{veth_glob}\" masquerade\n\
         \t}}\n\
         \tchain input {{\n\
         \t\ttype filter hook input priority filter; policy accept;\n\
         \t\tiifname \"{veth_glob}\" udp dport 53 accept\n\
         \t\tiifname \"{veth_glob}\" tcp dport 53 accept\n\
         \t\tiifname \"{veth_glob}\" drop\n\
         \t}}\n\
         \tchain forward {{\n\
         \t\ttype filter hook forward priority filter; policy accept;\n\
         \t\tiifname \"{veth_glob}\" oifname \"{veth_glob}\" drop\n\
         \t}}\n\
         }}\n"
    );
    run(&["-f", "-"], Some(&script))
}

/// Deletes the table; a table that is not there is not an error.
pub fn remove(table: &str) -> Result<()> {
    if !exists(table)? {
        return Ok(());
    }
    run(&["delete", "table", "ip", table], None)
}

/// Whether the table exists; without the `nft` tool there can be none of ours.
pub fn exists(table: &str) -> Result<bool> {
    let out =
        Command::new("nft").args(["list", "table", "ip", table]).stdout(Stdio::null()).stderr(Stdio::null()).status();
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

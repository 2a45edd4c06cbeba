//! IPv6 forwarding for the sandboxes without the host-wide switch.
//!
//! IPv6 forwards a packet only when `net.ipv6.conf.all.forwarding` is on or
//! the interface it *arrived on* has `force_forwarding` (Linux 6.17+).
//! Turning on `all.forwarding` would make every interface a router (the
//! host then ignores router advertisements), so the node never does:
//! each sandbox's host veth gets `force_forwarding` (gone with the veth),
//! and so does every other host interface replies can come back on - the
//! "uplinks" - unless `all.forwarding` already forwards everything.
//!
//! Several servers can share a host, so the uplinks' setting is held in
//! a registry under [`REGISTRY`] (tmpfs, like the setting itself): a
//! directory per interface this code turned on, a file per server
//! instance holding it, changed under one `flock`. The last holder to
//! let go turns the interface back off. A holder file names its server
//! process (pid and start time); a holder whose process is gone (a server
//! killed and never restarted) is let go by the next server that touches
//! the registry. An interface that was on before any server touched it is
//! never changed.

use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// Where the uplinks' holders are kept.
pub const REGISTRY: &str = "/run/warren-net/ipv6-force-forwarding";
const CONF: &str = "/proc/sys/net/ipv6/conf";

/// Whether this kernel can give the sandboxes IPv6: IPv6 is on and has
/// per-interface `force_forwarding`.
pub fn supported() -> bool {
    Path::new(CONF).join("all/force_forwarding").exists() && read(&Path::new(CONF).join("all/disable_ipv6")) == "0"
}

/// Whether the host forwards IPv6 on every interface anyway.
fn globally_on() -> bool {
    read(&Path::new(CONF).join("all/forwarding")) == "1"
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default().trim().to_string()
}

fn write(interface: &str, value: &str) -> std::io::Result<()> {
    std::fs::write(Path::new(CONF).join(interface).join("force_forwarding"), value)
}

/// Whether `name` is some server's sandbox veth (`wr<6 hex>h<slot>`): its
/// owner sets it up, possibly right now, so no other server holds it.
fn sandbox_veth(name: &str) -> bool {
    let b = name.as_bytes();
    b.len() > 9 && name.starts_with("wr") && b[2..8].iter().all(u8::is_ascii_hexdigit) && b[8] == b'h'
}

/// A holder's file name: the instance with path separators replaced.
fn holder(instance: &str) -> String {
    instance.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).collect()
}

/// The registry, locked for as long as the value lives.
struct Locked {
    _lock: std::os::fd::OwnedFd,
    dir: PathBuf,
}

fn lock() -> Result<Locked> {
    let dir = PathBuf::from(REGISTRY);
    std::fs::create_dir_all(&dir).map_err(|e| Error::io(format!("mkdir {}", dir.display()), e))?;
    let path = dir.join(".lock");
    let fd = rustix::fs::open(
        &path,
        rustix::fs::OFlags::RDWR | rustix::fs::OFlags::CREATE | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::from_raw_mode(0o600),
    )
    .map_err(|e| Error::io(format!("open {}", path.display()), e.into()))?;
    rustix::fs::flock(&fd, rustix::fs::FlockOperation::LockExclusive)
        .map_err(|e| Error::io(format!("lock {}", path.display()), e.into()))?;
    Ok(Locked { _lock: fd, dir })
}

/// Turns `force_forwarding` on for every host interface but loopback and
/// sandbox veths, records `instance` as holding it, and returns the
/// interfaces it holds. Interfaces made later are picked up by the next
/// call (the node calls this at every attach). An interface that cannot be
/// held (it is being deleted, say) is skipped with a warning: IPv6 replies
/// through it are then not forwarded, nothing else changes.
pub fn hold_uplinks(instance: &str, own_prefix: &str) -> Result<Vec<String>> {
    if globally_on() {
        return Ok(Vec::new());
    }
    let reg = lock()?;
    sweep(&reg.dir, None)?;
    let entries = std::fs::read_dir(CONF).map_err(|e| Error::io(format!("list {CONF}"), e))?;
    let mut held = Vec::new();
    for entry in entries.filter_map(|e| e.ok()) {
        let name = entry.file_name().to_string_lossy().into_owned();
        if ["all", "default", "lo"].contains(&name.as_str()) || name.starts_with(own_prefix) || sandbox_veth(&name) {
            continue;
        }
        match hold(&reg.dir, instance, &name) {
            Ok(true) => held.push(name),
            Ok(false) => {}
            Err(e) => {
                let dir = reg.dir.join(&name);
                let _ = std::fs::remove_file(dir.join(holder(instance)));
                let _ = std::fs::remove_dir(&dir); // only when no other holder is left
                if Path::new(CONF).join(&name).exists() {
                    tracing::warn!("cannot turn on IPv6 force_forwarding on {name}: {e}");
                }
            }
        }
    }
    Ok(held)
}

/// Holds one interface; `false` when it is not ours to change (it was on
/// before any server touched it).
fn hold(registry: &Path, instance: &str, name: &str) -> std::io::Result<bool> {
    let dir = registry.join(name);
    if !dir.exists() {
        if read(&Path::new(CONF).join(name).join("force_forwarding")) != "0" {
            return Ok(false);
        }
        std::fs::create_dir(&dir)?;
    }
    std::fs::write(dir.join(holder(instance)), this_process())?;
    write(name, "1")?;
    Ok(true)
}

/// Lets go of every interface `instance` holds; the last holder turns
/// the interface's `force_forwarding` back off. Registry entries of
/// interfaces that no longer exist are dropped.
pub fn release_uplinks(instance: &str) -> Result<()> {
    if !Path::new(REGISTRY).exists() {
        return Ok(());
    }
    let reg = lock()?;
    sweep(&reg.dir, Some(instance))
}

/// Removes `instance`'s holders and those of processes that are gone;
/// turns off every interface left without a holder and drops the entries
/// of interfaces that no longer exist.
fn sweep(registry: &Path, instance: Option<&str>) -> Result<()> {
    let entries = std::fs::read_dir(registry).map_err(|e| Error::io(format!("list {}", registry.display()), e))?;
    for entry in entries.filter_map(|e| e.ok()).filter(|e| e.path().is_dir()) {
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(instance) = instance {
            let _ = std::fs::remove_file(entry.path().join(holder(instance)));
        }
        let mut holders = 0;
        for file in std::fs::read_dir(entry.path()).into_iter().flatten().filter_map(|f| f.ok()) {
            if alive(&std::fs::read_to_string(file.path()).unwrap_or_default()) {
                holders += 1;
            } else {
                let _ = std::fs::remove_file(file.path());
            }
        }
        let exists = Path::new(CONF).join(&name).exists();
        if holders > 0 && exists {
            continue;
        }
        // A write that fails because the interface is going away is fine.
        if let Err(e) = write(&name, "0") {
            if Path::new(CONF).join(&name).exists() {
                tracing::warn!("cannot turn IPv6 force_forwarding on {name} back off: {e}");
                continue;
            }
        }
        std::fs::remove_dir_all(entry.path())
            .map_err(|e| Error::io(format!("remove {}", entry.path().display()), e))?;
    }
    Ok(())
}

/// `<pid> <start time>` of this process, what a holder file holds.
fn this_process() -> String {
    let pid = std::process::id();
    format!("{pid} {}", start_time(pid).unwrap_or_default())
}

/// A process's start time (clock ticks after boot, field 22 of
/// `/proc/<pid>/stat`), which tells a reused pid apart.
fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses.
    stat.rsplit_once(')')?.1.split_whitespace().nth(19)?.parse().ok()
}

/// Whether the process a holder file names still runs.
fn alive(holder: &str) -> bool {
    let mut words = holder.split_whitespace();
    let (Some(pid), Some(start)) = (words.next(), words.next()) else { return false };
    match (pid.parse::<u32>(), start.parse::<u64>()) {
        (Ok(pid), Ok(start)) => start_time(pid) == Some(start),
        _ => false,
    }
}

/// Sets the IPv6 switches of a veth end before it comes up: no router
/// advertisements, no autoconfiguration, no link-local address (nothing
/// but the pool's addresses exists on the link), and for the host end
/// `force_forwarding`. Reads `/proc/sys/net` of the calling thread's
/// network namespace.
pub fn configure_veth_end(interface: &str, host_end: bool) -> std::io::Result<()> {
    let dir = Path::new(CONF).join(interface);
    let mut settings = vec![
        ("disable_ipv6", "0"),
        ("accept_ra", "0"),
        ("autoconf", "0"),
        ("accept_dad", "0"),
        ("accept_redirects", "0"),
        // IN6_ADDR_GEN_MODE_NONE: no fe80:: address when the link comes up.
        ("addr_gen_mode", "1"),
    ];
    if host_end {
        settings.push(("force_forwarding", "1"));
    }
    for (key, value) in settings {
        std::fs::write(dir.join(key), value)
            .map_err(|e| std::io::Error::new(e.kind(), format!("{}/{key}: {e}", dir.display())))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn other_servers_sandbox_veths_are_recognised() {
        assert!(sandbox_veth("wr0a1b2ch1f"));
        assert!(!sandbox_veth("wr0a1b2c"));
        assert!(!sandbox_veth("wrongname0"));
        assert!(!sandbox_veth("eth0"));
        assert_eq!(holder("wt-12/3"), "wt-12_3");
    }

    #[test]
    fn holders_of_gone_processes_are_not_alive() {
        assert!(alive(&this_process()));
        let start = start_time(std::process::id()).unwrap();
        assert!(!alive(&format!("{} {}", std::process::id(), start + 1)), "a reused pid");
        assert!(!alive(""));
        assert!(!alive("nonsense"));
    }
}

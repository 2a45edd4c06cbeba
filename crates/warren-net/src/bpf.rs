//! The node's one set of egress programs (`bpf/egress.bpf.c`), their
//! maps, and attaching them to sandbox cgroups.
//!
//! The maps are pinned under `/sys/fs/bpf/warren-net-<instance>/` and the
//! programs are attached with `BPF_PROG_ATTACH` (not links): both outlive
//! the node process, so a sandbox that survives a crash of the node stays
//! enforced, and the restarted node finds its policy entries and denials
//! where it left them. Removing a sandbox's cgroup drops its attachments.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::path::{Path, PathBuf};

use libbpf_rs::libbpf_sys;
use libbpf_rs::{MapCore, MapFlags, MapHandle, Object, ObjectBuilder};

use crate::policy::Entry;
use crate::{Error, Result};

pub(crate) const OBJECT: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/egress.bpf.o"));

const BPFFS: &str = "/sys/fs/bpf";
const POLICY_MAP: &str = "warren_policy";
const SETTINGS_MAP: &str = "warren_settings";
const DENIALS_MAP: &str = "warren_denials";
const PIDNS_MAP: &str = "warren_pidns";

/// The programs in the object and where each is attached.
const PROGRAMS: [(&str, libbpf_sys::bpf_attach_type); 6] = [
    ("warren_connect4", libbpf_sys::BPF_CGROUP_INET4_CONNECT),
    ("warren_connect6", libbpf_sys::BPF_CGROUP_INET6_CONNECT),
    ("warren_sendmsg4", libbpf_sys::BPF_CGROUP_UDP4_SENDMSG),
    ("warren_sendmsg6", libbpf_sys::BPF_CGROUP_UDP6_SENDMSG),
    ("warren_sock_create", libbpf_sys::BPF_CGROUP_INET_SOCK_CREATE),
    ("warren_egress", libbpf_sys::BPF_CGROUP_INET_EGRESS),
];

/// Which hook refused (the `hook` field of a denial).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hook {
    Connect,
    Sendmsg,
    SockCreate,
    /// The `cgroup_skb/egress` backstop dropped a packet.
    Egress,
}

/// One refusal reported by the programs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Denial {
    pub cgroup_id: u64,
    /// Host pid (tgid) of the process; 0 for dropped packets.
    pub host_pid: u32,
    /// Its pid inside the sandbox; 0 when unknown.
    pub ns_pid: u32,
    pub comm: String,
    pub hook: Hook,
    /// `AF_INET` or `AF_INET6`.
    pub family: u8,
    pub protocol: u8,
    pub sock_type: u8,
    pub addr: std::net::IpAddr,
    pub port: u16,
}

impl Denial {
    const SIZE: usize = 56;

    fn parse(data: &[u8]) -> Option<Denial> {
        if data.len() < Self::SIZE {
            return None;
        }
        let u64_at = |i: usize| u64::from_ne_bytes(data[i..i + 8].try_into().unwrap_or_default());
        let u32_at = |i: usize| u32::from_ne_bytes(data[i..i + 4].try_into().unwrap_or_default());
        let hook = match data[16] {
            1 => Hook::Connect,
            2 => Hook::Sendmsg,
            3 => Hook::SockCreate,
            _ => Hook::Egress,
        };
        let mut addr = [0u8; 16];
        addr.copy_from_slice(&data[20..36]);
        let addr = std::net::Ipv6Addr::from(addr);
        let addr = match addr.to_ipv4_mapped() {
            Some(v4) => std::net::IpAddr::V4(v4),
            None => std::net::IpAddr::V6(addr),
        };
        let comm = &data[36..52];
        let comm = String::from_utf8_lossy(&comm[..comm.iter().position(|&b| b == 0).unwrap_or(comm.len())]).into();
        Some(Denial {
            cgroup_id: u64_at(0),
            host_pid: u32_at(8),
            ns_pid: u32_at(52),
            port: u16::from_ne_bytes([data[12], data[13]]),
            family: data[14],
            protocol: data[15],
            hook,
            sock_type: data[17],
            addr,
            comm,
        })
    }
}

/// The loaded programs and handles on their maps.
pub struct Programs {
    pin_dir: PathBuf,
    /// Keeps the programs loaded while the node runs.
    object: Object,
    policy: MapHandle,
    pidns: MapHandle,
}

impl Programs {
    /// Loads the programs, reusing the maps a previous run of this instance
    /// pinned (or pinning new ones), and records the cgroup2 level of the
    /// sandboxes' directories.
    pub fn load(instance: &str, sandbox_cgroup_level: u32) -> Result<Programs> {
        ensure_bpffs()?;
        let pin_dir = Path::new(BPFFS).join(format!("warren-net-{instance}"));
        std::fs::create_dir_all(&pin_dir).map_err(|e| Error::io(format!("mkdir {}", pin_dir.display()), e))?;
        let mut open =
            ObjectBuilder::default().open_memory(OBJECT).map_err(|e| Error::bpf("open the egress object", e))?;
        for mut map in open.maps_mut() {
            let name = map.name().to_string_lossy().into_owned();
            map.set_pin_path(pin_dir.join(&name)).map_err(|e| Error::bpf(format!("pin path of {name}"), e))?;
        }
        let object = open.load().map_err(|e| Error::bpf("load the egress programs", e))?;
        let handle = |name: &str| -> Result<MapHandle> {
            let map = object
                .maps()
                .find(|m| m.name() == name)
                .ok_or_else(|| Error::Bpf(format!("the egress object has no map {name}")))?;
            MapHandle::try_from(&map).map_err(|e| Error::bpf(format!("handle on {name}"), e))
        };
        let policy = handle(POLICY_MAP)?;
        let pidns = handle(PIDNS_MAP)?;
        let settings = handle(SETTINGS_MAP)?;
        settings
            .update(&0u32.to_ne_bytes(), &sandbox_cgroup_level.to_ne_bytes(), MapFlags::ANY)
            .map_err(|e| Error::bpf("write the settings map", e))?;
        Ok(Programs { pin_dir, object, policy, pidns })
    }

    /// The ring buffer the programs report denials to.
    pub fn denials(&self) -> Result<MapHandle> {
        let map = self
            .object
            .maps()
            .find(|m| m.name() == DENIALS_MAP)
            .ok_or_else(|| Error::Bpf(format!("the egress object has no map {DENIALS_MAP}")))?;
        MapHandle::try_from(&map).map_err(|e| Error::bpf("handle on the denials ring", e))
    }

    /// Attaches every program to the cgroup2 directory `cgroup`. Attaching a
    /// program that is attached already is a no-op for the kernel.
    pub fn attach(&self, cgroup: BorrowedFd<'_>) -> Result<()> {
        for (name, attach_type) in PROGRAMS {
            let prog = self
                .object
                .progs()
                .find(|p| p.name() == name)
                .ok_or_else(|| Error::Bpf(format!("the egress object has no program {name}")))?;
            // SAFETY: both fds are open for the duration of the call; the
            // call reads nothing else.
            let rc = unsafe {
                libbpf_sys::bpf_prog_attach(
                    prog.as_fd().as_raw_fd(),
                    cgroup.as_raw_fd(),
                    attach_type,
                    libbpf_sys::BPF_F_ALLOW_MULTI,
                )
            };
            if rc < 0 {
                return Err(Error::io(format!("attach {name}"), std::io::Error::from_raw_os_error(-rc)));
            }
        }
        Ok(())
    }

    /// Detaches every program of any egress attach type from `cgroup`,
    /// including ones a previous run of the node attached.
    pub fn detach_all(cgroup: BorrowedFd<'_>) -> Result<()> {
        for (name, attach_type) in PROGRAMS {
            let mut ids = [0u32; 64];
            let mut count = ids.len() as u32;
            let mut flags = 0u32;
            // SAFETY: `ids` has room for `count` entries; the kernel writes
            // at most that many and updates `count`.
            let rc = unsafe {
                libbpf_sys::bpf_prog_query(cgroup.as_raw_fd(), attach_type, 0, &mut flags, ids.as_mut_ptr(), &mut count)
            };
            if rc < 0 {
                return Err(Error::io(format!("query {name}"), std::io::Error::from_raw_os_error(-rc)));
            }
            for &id in &ids[..(count as usize).min(ids.len())] {
                // SAFETY: plain syscall wrapper; a returned fd is owned here.
                let fd = unsafe { libbpf_sys::bpf_prog_get_fd_by_id(id) };
                if fd < 0 {
                    continue;
                }
                // SAFETY: `fd` was just returned to us and nothing else owns it.
                let prog = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
                // SAFETY: both fds are open for the duration of the call.
                let rc = unsafe { libbpf_sys::bpf_prog_detach2(prog.as_raw_fd(), cgroup.as_raw_fd(), attach_type) };
                if rc < 0 && -rc != libc::ENOENT {
                    return Err(Error::io(format!("detach {name}"), std::io::Error::from_raw_os_error(-rc)));
                }
            }
        }
        Ok(())
    }

    /// Replaces the entries of cgroup `cgroup_id` with `entries`: new ones
    /// are written before stale ones are deleted, so a destination allowed
    /// before and after never sees a gap.
    pub fn set_entries(&self, cgroup_id: u64, entries: &[Entry]) -> Result<()> {
        let mut wanted = std::collections::HashSet::new();
        for entry in entries {
            let key = entry.key(cgroup_id);
            self.policy
                .update(&key, &entry.value(), MapFlags::ANY)
                .map_err(|e| Error::bpf(format!("update the policy of {}", entry.describe()), e))?;
            wanted.insert(key);
        }
        for key in self.keys_of(cgroup_id) {
            if !wanted.contains(&key) {
                let _ = self.policy.delete(&key);
            }
        }
        Ok(())
    }

    /// Records the pid namespace (nsfs `st_dev`, `st_ino`) of the sandbox
    /// in cgroup `cgroup_id`, for the pids in its denials.
    pub fn set_pidns(&self, cgroup_id: u64, dev: u64, ino: u64) -> Result<()> {
        let mut value = dev.to_ne_bytes().to_vec();
        value.extend_from_slice(&ino.to_ne_bytes());
        self.pidns
            .update(&cgroup_id.to_ne_bytes(), &value, MapFlags::ANY)
            .map_err(|e| Error::bpf("update the pid namespace map", e))
    }

    /// Deletes every entry of cgroup `cgroup_id`.
    pub fn clear(&self, cgroup_id: u64) {
        let _ = self.pidns.delete(&cgroup_id.to_ne_bytes());
        for key in self.keys_of(cgroup_id) {
            let _ = self.policy.delete(&key);
        }
    }

    /// Cgroup ids that have entries.
    pub fn cgroups(&self) -> std::collections::BTreeSet<u64> {
        let mut ids: std::collections::BTreeSet<u64> =
            self.policy.keys().filter_map(|k| Entry::cgroup_of_key(&k)).collect();
        ids.extend(self.pidns.keys().filter_map(|k| k.try_into().ok().map(u64::from_ne_bytes)));
        ids
    }

    fn keys_of(&self, cgroup_id: u64) -> Vec<Vec<u8>> {
        self.policy.keys().filter(|k| Entry::cgroup_of_key(k) == Some(cgroup_id)).collect()
    }

    /// Unpins the maps (when the node stops with no sandbox left).
    pub fn unpin(self) -> Result<()> {
        let dir = self.pin_dir.clone();
        drop(self);
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io(format!("remove {}", dir.display()), e)),
        }
    }

    pub fn pin_dir(instance: &str) -> PathBuf {
        Path::new(BPFFS).join(format!("warren-net-{instance}"))
    }
}

/// Polls the denials ring on a thread of its own until `stop` is set,
/// handing each denial to `sink`.
pub fn read_denials(
    ring: MapHandle,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    sink: impl Fn(Denial) + Send + 'static,
) -> Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("warren-net-denials".into())
        .spawn(move || {
            let mut builder = libbpf_rs::RingBufferBuilder::new();
            let added = builder.add(&ring, |data: &[u8]| {
                if let Some(d) = Denial::parse(data) {
                    sink(d);
                }
                0
            });
            if let Err(e) = added {
                tracing::error!("cannot read the egress denials ring: {e}");
                return;
            }
            let ring = match builder.build() {
                Ok(r) => r,
                Err(e) => {
                    tracing::error!("cannot read the egress denials ring: {e}");
                    return;
                }
            };
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if let Err(e) = ring.poll(std::time::Duration::from_millis(100)) {
                    if e.kind() != libbpf_rs::ErrorKind::Interrupted {
                        tracing::warn!("polling the egress denials ring: {e}");
                    }
                }
            }
        })
        .map_err(|e| Error::io("start the denials reader", e))
}

/// Mounts the BPF filesystem at `/sys/fs/bpf` when nothing is mounted there.
fn ensure_bpffs() -> Result<()> {
    let path = Path::new(BPFFS);
    let stat = rustix::fs::statfs(path).map_err(|e| Error::io(format!("statfs {BPFFS}"), e.into()))?;
    const BPF_FS_MAGIC: i64 = 0xcafe4a11;
    if stat.f_type as i64 == BPF_FS_MAGIC {
        return Ok(());
    }
    rustix::mount::mount("bpf", path, "bpf", rustix::mount::MountFlags::empty(), None)
        .map_err(|e| Error::io(format!("mount bpffs on {BPFFS}"), e.into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn denials_parse_as_the_c_struct_lays_them_out() {
        let mut d = [0u8; Denial::SIZE];
        d[0..8].copy_from_slice(&77u64.to_ne_bytes());
        d[8..12].copy_from_slice(&1234u32.to_ne_bytes());
        d[12..14].copy_from_slice(&53u16.to_ne_bytes());
        d[14] = 2;
        d[15] = 17;
        d[16] = 2;
        d[20 + 10] = 0xff;
        d[20 + 11] = 0xff;
        d[32..36].copy_from_slice(&[10, 1, 2, 3]);
        d[36..38].copy_from_slice(b"nc");
        d[52..56].copy_from_slice(&7u32.to_ne_bytes());
        let parsed = Denial::parse(&d).unwrap();
        assert_eq!(parsed.cgroup_id, 77);
        assert_eq!(parsed.host_pid, 1234);
        assert_eq!(parsed.port, 53);
        assert_eq!(parsed.hook, Hook::Sendmsg);
        assert_eq!(parsed.addr, "10.1.2.3".parse::<std::net::IpAddr>().unwrap());
        assert_eq!(parsed.comm, "nc");
        assert_eq!(parsed.ns_pid, 7);
    }

    /// Needs root and a cgroup2 mount at /sys/fs/cgroup/unified (as the
    /// tests' hosts have): the programs pass this kernel's verifier, attach
    /// to a cgroup and detach again, and the pins go away.
    #[test]
    fn programs_load_attach_and_detach() {
        let instance = format!("unit-{}", std::process::id());
        let cgroup = Path::new("/sys/fs/cgroup/unified").join(format!("warren-net-{instance}"));
        std::fs::create_dir(&cgroup).unwrap();
        let programs = Programs::load(&instance, 1).unwrap();
        let fd = std::fs::File::open(&cgroup).unwrap();
        programs.attach(fd.as_fd()).unwrap();
        let entries = crate::policy::compile(&[crate::policy::AddrRule {
            prefix: crate::policy::Prefix::host("10.9.9.9".parse().unwrap()),
            ports: vec![80],
            protocol: warren_api::Protocol::Tcp,
        }])
        .unwrap();
        programs.set_entries(42, &entries).unwrap();
        assert!(programs.cgroups().contains(&42));
        programs.clear(42);
        assert!(!programs.cgroups().contains(&42));
        Programs::detach_all(fd.as_fd()).unwrap();
        drop(fd);
        std::fs::remove_dir(&cgroup).unwrap();
        programs.unpin().unwrap();
        assert!(!Programs::pin_dir(&instance).exists());
    }
}

//! The microVM driver: a sandbox is a QEMU `-M microvm` guest running
//! Debian's cloud kernel with `warren-init` as its PID 1, the image's
//! layers as read-only virtio-blk disks stacked with overlayfs on a
//! writable disk inside the guest.
//!
//! The same driver, built with [`Machine::Q35`] ([`MicroVmConfig::discover_full`]),
//! is the full-VM backend (`backend: "vm"`): a `q35` machine with the
//! same disks and port on PCI, the same kernel and initramfs; the guest's
//! init stacks the root as for a microVM, installs itself as a systemd
//! service in it and hands PID 1 to the image's systemd (see
//! `warren-init`'s `vm::systemd`). Everything on the host side (mux,
//! files, pause, teardown) is shared; the images must ship systemd.
//!
//! The host side (this module) owns the QEMU process, its cgroup, the
//! sandbox's run directory (`<run_dir>/<id>/`: the writable disk, QEMU's
//! port socket and the mux listener) and the mux task. Execs, pings and
//! security events travel over the mux as over a container's control
//! socket ([`crate::container::channel`]): the same code, the same frames.
//!
//! Resources: `cpus` -> vCPUs (rounded up) and the QEMU cgroup's CPU quota,
//! `memory_mib` -> guest memory (QEMU's own cgroup allows the guest plus
//! [`QEMU_OVERHEAD_MIB`]), `disk_mib` / `inodes` -> the writable ext4 disk.
//!
//! Invariants: a failed create and `destroy` leave no QEMU process,
//! cgroup, disk or socket behind; QEMU never gets a host path beyond the
//! kernel, the initramfs and its disks.
//! Pause and resume are QMP `stop` / `cont` on `qmp.sock` in the run
//! directory ([`qmp`]); a paused VM probes alive while its QEMU lives,
//! without a ping, and so does one being saved to disk or restored (a VM
//! is never out of both the driver's maps while it lives). A QMP socket
//! nobody serves answers [`BackendError::Gone`]. A pause to disk ([`Driver::pause_to_disk`], both
//! machines) migrates the stopped guest into `paused.mem` through a
//! descriptor passed over QMP (QEMU 7.2 has no `file:` migration, `savevm`
//! needs qcow2 disks) and ends QEMU; `resume` starts QEMU on the file
//! (`-incoming fd:3`), tells the guest the time over the port (its clock
//! stood still on disk) and starts a new mux. Snapshot boot ([`snapshot`],
//! `MicroVmConfig::snapshots`, both machines) restores a snapshot of a
//! booted guest of the same image and shape instead of booting; the
//! template guest it is made from is reserved in the node's books
//! ([`Driver::attach_books`]). Every VM gets its writable disk as inherited
//! descriptors (see [`qemu::VmSpec::writable_by_fd`]) so that migrations
//! work from QEMU's chroot.
//! `pack_diff` asks the guest's init for its writable layer as an archive
//! (see [`Driver::snapshot`] here).
//! Phases work as in a container (a switch kills what earlier phases left
//! running); protected paths need a guest kernel with Landlock ABI 6 (else
//! they are refused as unsupported) and are refused on a full VM (its
//! systemd runs units outside every phase's rules).
//! An `allowlist` sandbox's QEMU runs in a network namespace of its own
//! ([`qemu::VmSpec::netns`], pinned on [`NETNS_PIN`]) that the node plugs
//! like a container's;
//! its snapshot is a different one from a guest's without a network device.
//! A VM outlives the node process: its QEMU is in a process group of its
//! own and nothing kills it at the node's exit; `vm.json` in its run
//! directory ([`VmRecord`]) is what a restarted node adopts it by
//! ([`Driver::adopt`]: the recorded QEMU, a new mux after a resync of the
//! control port, see [`mux::resync_blocking`]).

mod disks;
mod initramfs;
mod kernel;
mod mux;
mod qemu;
mod qmp;
mod snapshot;

use std::collections::HashMap;
use std::fs;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tokio::sync::OnceCell;
use warren_api::{Backend, Usage, VmBoot};
use warren_guard::cgroup::{Limits, SandboxCgroup, UNIFIED};
use warren_guard::reserve::HostTotals;

pub use self::qemu::{Accel, AccelChoice, Machine};
use self::qemu::{QemuProcess, VmSpec};
use crate::container::channel;
use crate::container::state::{Layout, ProcessId, SlotBook};
use crate::{
    check_id, BackendError, Driver, EventBatch, ExecProcess, ExecSpec, Liveness, PhaseRules, Result, SandboxHandle,
    SandboxSpec, SweepReport,
};

/// A TCG boot of this kernel to init takes about two seconds here; a loaded
/// two-core machine booting several at once needs far more.
const BOOT_DEADLINE: Duration = Duration::from_secs(120);
/// A full VM boots firmware and systemd before its init service answers.
const FULL_BOOT_DEADLINE: Duration = Duration::from_secs(240);
/// Where an image's systemd lives (usr-merged or not): a full VM's image
/// without it cannot boot.
const SYSTEMD_PATHS: [&str; 2] = ["usr/lib/systemd/systemd", "lib/systemd/systemd"];
const PING_TIMEOUT: Duration = Duration::from_secs(2);
/// How long one ping waits while the guest boots. Its frames wait in
/// QEMU's socket until init serves the port, and the guest answers them
/// then however long ago they were sent: a ping given up and sent again
/// only leaves the guest a stale stream to serve (three threads and an
/// answer nobody reads) on its one vCPU just as the boot ends. Another
/// goes only if this one is lost.
const BOOT_PING_PATIENCE: Duration = Duration::from_secs(5);
/// Memory QEMU itself needs beside the guest's (TCG's translation cache,
/// device emulation, its own heap).
pub const QEMU_OVERHEAD_MIB: u64 = 256;
/// Below this the cloud kernel does not boot.
pub const MIN_MEMORY_MIB: u64 = 128;
/// QEMU's threads beside one per vCPU (I/O workers, RCU, the main loop);
/// nothing in the guest counts here.
const QEMU_PIDS: u32 = 64;

#[derive(Debug, Clone)]
pub struct MicroVmConfig {
    /// Holds one directory per sandbox plus the driver's caches.
    pub run_dir: PathBuf,
    pub init_binary: PathBuf,
    pub qemu: PathBuf,
    pub kernel: PathBuf,
    /// `/lib/modules/<release>` of `kernel`.
    pub modules_dir: PathBuf,
    /// Parent cgroup of the QEMU processes; must differ from the container
    /// driver's (each driver sweeps everything under its own).
    pub cgroup_instance: String,
    pub accel: AccelChoice,
    pub machine: Machine,
    /// Snapshot boot (`--vm-snapshots on`): creates
    /// restore a snapshot of a booted guest of the same image and shape
    /// (see [`snapshot`]).
    pub snapshots: bool,
    /// Each sandbox's QEMU runs as a host uid (and gid) of its own,
    /// `qemu_uid_start + n` for the lowest `n` below [`QEMU_UIDS`] no other
    /// VM of this driver holds, so that a QEMU taken over by its guest can
    /// signal no other sandbox's QEMU; `None`: every QEMU runs as `nobody`.
    /// The probe and snapshot templates run as `nobody` (no agent's code
    /// has run in them).
    pub qemu_uid_start: Option<u32>,
}

/// Host uids a driver hands its QEMUs (see [`MicroVmConfig::qemu_uid_start`]).
pub const QEMU_UIDS: u32 = 32_768;

impl MicroVmConfig {
    /// Finds QEMU and a Debian cloud kernel with its modules on this host
    /// (`qemu-system-x86` and `linux-image-cloud-amd64`); `Err` names what
    /// is missing. `WARREN_MICROVM_ACCEL=kvm|tcg` skips the KVM probe.
    pub fn discover(run_dir: PathBuf, init_binary: PathBuf, cgroup_instance: String) -> Result<MicroVmConfig> {
        let qemu = PathBuf::from("/usr/bin/qemu-system-x86_64");
        if !qemu.is_file() {
            return Err(BackendError::Setup(format!("{} not found (apt install qemu-system-x86)", qemu.display())));
        }
        let kernel = newest_cloud_kernel()?;
        let release = kernel
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix("vmlinuz-"))
            .ok_or_else(|| BackendError::Setup(format!("unexpected kernel name {}", kernel.display())))?;
        let modules_dir = PathBuf::from("/lib/modules").join(release);
        if !modules_dir.is_dir() {
            return Err(BackendError::Setup(format!("{} not found", modules_dir.display())));
        }
        let accel = match std::env::var("WARREN_MICROVM_ACCEL").as_deref() {
            Ok("kvm") => AccelChoice::Force(Accel::Kvm),
            Ok("tcg") => AccelChoice::Force(Accel::Tcg),
            _ => AccelChoice::Auto,
        };
        Ok(MicroVmConfig {
            run_dir,
            init_binary,
            qemu,
            kernel,
            modules_dir,
            cgroup_instance,
            accel,
            machine: Machine::Micro,
            snapshots: false,
            qemu_uid_start: None,
        })
    }

    /// As [`MicroVmConfig::discover`], for the full-VM backend (`q35`, systemd
    /// images). The cloud kernel has the PCI virtio drivers q35 needs.
    pub fn discover_full(run_dir: PathBuf, init_binary: PathBuf, cgroup_instance: String) -> Result<MicroVmConfig> {
        let config = MicroVmConfig::discover(run_dir, init_binary, cgroup_instance)?;
        Ok(MicroVmConfig { machine: Machine::Q35, ..config })
    }

    fn backend(&self) -> Backend {
        match self.machine {
            Machine::Micro => Backend::Microvm,
            Machine::Q35 => Backend::Vm,
        }
    }

    /// `Err(why)` when this driver's guests cannot hold a phase's
    /// protected paths.
    fn protected_paths(&self) -> std::result::Result<(), &'static str> {
        match self.machine {
            Machine::Q35 => Err(GUEST_SYSTEMD),
            Machine::Micro if release_version(&self.kernel.to_string_lossy()) < LANDLOCK_ABI6_RELEASE => {
                Err(GUEST_LANDLOCK)
            }
            Machine::Micro => Ok(()),
        }
    }
}

fn newest_cloud_kernel() -> Result<PathBuf> {
    let entries = fs::read_dir("/boot").map_err(|e| BackendError::io("read /boot", e))?;
    let mut kernels: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("vmlinuz-") && n.ends_with("-cloud-amd64"))
        })
        .collect();
    kernels.sort_by_key(|k| release_version(&k.to_string_lossy()));
    kernels.pop().ok_or_else(|| {
        BackendError::Setup("no /boot/vmlinuz-*-cloud-amd64 (apt install linux-image-cloud-amd64)".into())
    })
}

/// `(6, 12, 95)` of `vmlinuz-6.12.95+deb12-cloud-amd64` (or of its release);
/// what is not a number counts as 0.
fn release_version(name: &str) -> (u32, u32, u32) {
    let release = name.rsplit('/').next().unwrap_or(name);
    let release = release.strip_prefix("vmlinuz-").unwrap_or(release);
    let mut parts = release.split(|c: char| !c.is_ascii_digit()).map(|p| p.parse().unwrap_or(0));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0), parts.next().unwrap_or(0))
}

/// A new, empty network namespace, held by the descriptor alone (no
/// mount to leak: it ends with the last descriptor, QEMU's or the
/// driver's). Made on a thread of its own, which alone enters it.
fn new_netns() -> Result<OwnedFd> {
    std::thread::spawn(|| -> std::io::Result<OwnedFd> {
        // SAFETY: a new network namespace changes only which network
        // this short-lived thread's later sockets and opens of
        // `/proc/thread-self/ns/net` see; no memory or descriptor is shared
        // differently afterwards (the hazard `unshare_unsafe` names is
        // CLONE_FILES/CLONE_VM-like flags).
        unsafe { rustix::thread::unshare_unsafe(rustix::thread::UnshareFlags::NEWNET) }?;
        let ns = rustix::fs::open(
            "/proc/thread-self/ns/net",
            rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )?;
        Ok(ns)
    })
    .join()
    .map_err(|_| BackendError::Setup("the network namespace thread panicked".into()))?
    .map_err(|e| BackendError::io("make a network namespace", e))
}

/// Bind-mounts `ns` on [`NETNS_PIN`] in `dir` (as `ip netns` pins one).
fn pin_netns(dir: &Path, ns: &OwnedFd) -> Result<()> {
    use std::os::fd::AsRawFd;
    let target = dir.join(NETNS_PIN);
    fs::File::create(&target).map_err(|e| BackendError::io(format!("create {}", target.display()), e))?;
    rustix::mount::mount_bind(format!("/proc/self/fd/{}", ns.as_raw_fd()), &target)
        .map_err(|e| BackendError::io(format!("pin the network namespace on {}", target.display()), e.into()))
}

fn open_pinned_netns(dir: &Path) -> Result<OwnedFd> {
    let pin = dir.join(NETNS_PIN);
    let ns = fs::File::open(&pin).map_err(|e| BackendError::io(format!("open {}", pin.display()), e))?;
    // A file left where the mount was is no namespace.
    match rustix::fs::fstatfs(&ns) {
        Ok(fs) if fs.f_type == NSFS_MAGIC => Ok(ns.into()),
        _ => Err(BackendError::Setup(format!("{} holds no network namespace", pin.display()))),
    }
}

/// `statfs(2)`'s type of a namespace file.
const NSFS_MAGIC: i64 = 0x6e73_6673;

/// Undoes [`pin_netns`] (nothing to do where there is none).
fn unpin_netns(dir: &Path) -> Result<()> {
    let target = dir.join(NETNS_PIN);
    match rustix::mount::unmount(&target, rustix::mount::UnmountFlags::DETACH) {
        Ok(()) | Err(rustix::io::Errno::NOENT | rustix::io::Errno::INVAL) => Ok(()),
        Err(e) => Err(BackendError::io(format!("unmount {}", target.display()), e.into())),
    }
}

/// What the node persists about a microVM.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct HandleState {
    dir: PathBuf,
    accel: Accel,
    #[serde(default)]
    boot: Option<VmBoot>,
}

/// A running VM's host-side parts, owned by the driver.
struct Running {
    qemu: QemuProcess,
    _mux: mux::Mux,
    /// Set before QMP `stop` and cleared after `cont`: while set, the
    /// probe does not ping the guest (a stopped guest cannot answer).
    paused: bool,
    /// A paused VM adopted from an earlier node process has no mux yet:
    /// the guest must run to answer the resync, so the resume starts it.
    mux_at_resume: bool,
    /// How QEMU was started: a restore from disk starts it the same way.
    launch: Launch,
    /// The guest console's tail: a guest that died says why there.
    console: qemu::ConsoleTail,
}

/// What a restarted node needs to adopt a VM (`vm.json` in its directory),
/// rewritten whenever its QEMU or the mux's first stream changes.
#[derive(Serialize, Deserialize)]
struct VmRecord {
    /// `None` while the VM is paused to disk.
    qemu: Option<ProcessId>,
    /// QEMU runs in a network namespace of its own (an `allowlist`
    /// sandbox): the adopting node opens it from [`NETNS_PIN`].
    net: bool,
    launch: Launch,
}

/// What QEMU's command line was made of beyond the driver's config.
#[derive(Clone, Serialize, Deserialize)]
struct Launch {
    layer_files: Vec<PathBuf>,
    vcpus: u32,
    memory_mib: u64,
    pids: u32,
    #[serde(default)]
    open_files: u32,
    /// On the kernel command line (a snapshot's clones keep the template's).
    hostname: String,
    /// The sandbox's hostname: told the guest again with the time after a
    /// restore from disk.
    name: String,
    accel: Accel,
    /// The mux's first stream id: past every id the guest has seen.
    first_stream: u32,
    /// The network namespace QEMU runs in (an `allowlist` sandbox): held
    /// here so that it, and the node's veth in it, outlive a QEMU that a
    /// pause to disk ends.
    #[serde(skip)]
    netns: Option<Arc<OwnedFd>>,
    /// The host uid QEMU runs as (`None`: `nobody`).
    #[serde(default)]
    qemu_uid: Option<u32>,
}

/// A VM paused to disk: no QEMU runs; `paused.mem` in its directory holds
/// the guest until the resume.
struct OnDisk {
    launch: Launch,
}

/// Where a probe finds a VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Seen {
    /// Paused to disk, or being saved there or restored from there.
    OnDisk,
    Running {
        exited: bool,
        paused: bool,
    },
    Absent,
}

/// The guest's state while it is paused to disk.
const PAUSED_MEM: &str = "paused.mem";
/// [`PAUSED_MEM`] while it is written: only a complete one is renamed.
const PAUSED_MEM_PART: &str = "paused.mem.part";
/// See [`VmRecord`].
const VM_RECORD: &str = "vm.json";
/// An `allowlist` VM's network namespace, bind-mounted in its run
/// directory: what holds it while no QEMU runs (paused to disk) and no
/// node process does either (between a node's exit and the next start).
const NETNS_PIN: &str = "netns";
/// How long a guest whose node went away has to answer the new node's
/// resync (see [`mux::resync_blocking`]).
const RESYNC_WAIT: Duration = Duration::from_secs(10);
/// Why a microVM refuses protected paths on a guest kernel older than
/// 6.12 (Debian 12's own 6.1 enforces Landlock ABI 2, and a phase needs 6:
/// ABI 3 is what stops `truncate(2)` of a read-only file, without which an
/// agent could empty the tests it may only read).
const GUEST_LANDLOCK: &str = "phases with protected paths (the guest kernel's Landlock is older than ABI 6)";
/// Why a full VM refuses them on any kernel: its systemd is outside every
/// phase's domain and starts whatever a unit names for whoever asks on its
/// socket (`systemd-run cat /protected`).
const GUEST_SYSTEMD: &str = "phases with protected paths (the guest's systemd runs units outside the phase's rules)";
/// How long the node waits for a guest's limit counters.
const LIMITS_TIMEOUT: Duration = Duration::from_secs(2);
/// The first kernel release whose Landlock has ABI 6.
const LANDLOCK_ABI6_RELEASE: (u32, u32, u32) = (6, 12, 0);
/// A `pack_diff` archive holds the writable disk's files plus a header (and
/// perhaps a PAX record) per file: at most twice the disk and this much
/// more, or it is not the guest's init that sends it.
const PACK_SLACK_BYTES: u64 = 16 << 20;

/// A reader that fails once it has given `left` bytes and there are more.
struct Capped<R> {
    inner: R,
    left: u64,
}

impl<R: std::io::Read> std::io::Read for Capped<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.left = self.left.checked_sub(n as u64).ok_or_else(|| {
            std::io::Error::other("the archive is larger than the sandbox's writable disk could hold")
        })?;
        Ok(n)
    }
}
/// Writing a paused guest's memory out; reading it back on resume.
const DISK_PAUSE_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a guest gets to see the node disconnect before it is saved.
const DISK_PAUSE_QUIESCE: Duration = Duration::from_millis(200);

pub struct MicroVmDriver {
    config: MicroVmConfig,
    /// The initramfs, built on first use.
    initramfs: OnceCell<PathBuf>,
    kernel_image: std::sync::OnceLock<PathBuf>,
    accel: OnceCell<Accel>,
    /// One build of a directory layer at a time (they are cached).
    layer_build: tokio::sync::Mutex<()>,
    running: Mutex<HashMap<String, Running>>,
    /// VMs paused to disk, and those being saved there or restored from
    /// there. A VM moves between this map and `running` under both locks
    /// (`running`'s first), so it is always in one of them until removed:
    /// a probe that saw it in neither would have it ended.
    on_disk: Mutex<HashMap<String, OnDisk>>,
    /// Held through a pause to disk and a resume: one move of a VM's
    /// guest at a time (the node serialises them too).
    moves: Mutex<()>,
    snapshots: snapshot::Snapshots,
    /// Each VM's last limit counters from its guest (see
    /// [`Driver::limit_counters`] here).
    limit_reads: Mutex<HashMap<String, LimitRead>>,
    /// Which of [`QEMU_UIDS`] each VM's QEMU runs as (its `slot` file).
    qemu_uids: SlotBook,
    /// The most guest memory QEMU can be given on this host (its
    /// `MemTotal` less [`QEMU_OVERHEAD_MIB`]), read once.
    max_guest_mib: u64,
}

/// One answer of a guest's init to the limit counters, and QEMU's CPU
/// time when it had come.
struct LimitRead {
    counters: crate::LimitCounters,
    cpu_time_ns: u64,
    at: std::time::Instant,
}

impl LimitRead {
    /// Whether a guest whose QEMU has used `cpu_time_ns` in all by `now`
    /// was quiet since this read (see [`QUIET_GUEST_NS_PER_SEC`]).
    fn quiet_until(&self, cpu_time_ns: u64, now: std::time::Instant) -> bool {
        let elapsed = now.saturating_duration_since(self.at);
        if elapsed >= QUIET_GUEST_MAX_SKIP {
            return false;
        }
        let budget = QUIET_GUEST_SLACK_NS.saturating_add(
            u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX).saturating_mul(QUIET_GUEST_NS_PER_SEC / 1000),
        );
        cpu_time_ns.saturating_sub(self.cpu_time_ns) <= budget
    }
}

/// Guest CPU (QEMU's cgroup, ns) a VM may use per second since its last
/// limit read and still count as quiet: an idle TCG guest's timer ticks
/// take about 3 ms a second here, a guest answering the read itself about
/// 11 ms (its last part lands after the answer).
const QUIET_GUEST_NS_PER_SEC: u64 = 5_000_000;
const QUIET_GUEST_SLACK_NS: u64 = 20_000_000;
/// A quiet guest's counters are read again after this all the same.
const QUIET_GUEST_MAX_SKIP: Duration = Duration::from_secs(30);

impl MicroVmDriver {
    pub fn new(mut config: MicroVmConfig) -> Result<MicroVmDriver> {
        SandboxCgroup::new(&config.cgroup_instance, "probe").map_err(cgroup_err)?;
        for dir in [config.run_dir.clone(), config.run_dir.join(".layers"), config.run_dir.join(".jail")] {
            fs::create_dir_all(&dir).map_err(|e| BackendError::io(format!("mkdir {}", dir.display()), e))?;
        }
        config.run_dir = fs::canonicalize(&config.run_dir)
            .map_err(|e| BackendError::io(format!("resolve {}", config.run_dir.display()), e))?;
        let snapshots = snapshot::Snapshots::new(&config.run_dir, &config.init_binary)?;
        let qemu_uids = SlotBook::numbers(config.run_dir.clone(), QEMU_UIDS);
        let host_mib = HostTotals::read().map_err(cgroup_err)?.memory_bytes >> 20;
        Ok(MicroVmDriver {
            qemu_uids,
            max_guest_mib: host_mib.saturating_sub(QEMU_OVERHEAD_MIB),
            snapshots,
            on_disk: Mutex::new(HashMap::new()),
            moves: Mutex::new(()),
            config,
            initramfs: OnceCell::new(),
            kernel_image: std::sync::OnceLock::new(),
            accel: OnceCell::new(),
            layer_build: tokio::sync::Mutex::new(()),
            running: Mutex::new(HashMap::new()),
            limit_reads: Mutex::new(HashMap::new()),
        })
    }

    fn dir(&self, id: &str) -> PathBuf {
        self.config.run_dir.join(id)
    }

    fn ctl_sock(&self, id: &str) -> PathBuf {
        self.dir(id).join("ctl.sock")
    }

    fn qmp_sock(&self, id: &str) -> PathBuf {
        self.dir(id).join("qmp.sock")
    }

    /// Sets the running VM's paused flag; returns what it was.
    fn set_paused(&self, id: &str, paused: bool) -> Result<bool> {
        let mut running = self.running();
        let vm = running.get_mut(id).ok_or(BackendError::Gone)?;
        Ok(std::mem::replace(&mut vm.paused, paused))
    }

    fn cgroup(&self, id: &str) -> Result<SandboxCgroup> {
        SandboxCgroup::new(&self.config.cgroup_instance, id).map_err(cgroup_err)
    }

    fn state(&self, handle: &SandboxHandle) -> Result<HandleState> {
        check_id(&handle.id)?;
        let state: HandleState = serde_json::from_value(handle.state.clone())
            .map_err(|e| BackendError::Protocol(format!("bad microvm handle: {e}")))?;
        if state.dir != self.dir(&handle.id) {
            return Err(BackendError::Protocol(format!("handle of {} is not from this driver", handle.id)));
        }
        Ok(state)
    }

    fn running(&self) -> std::sync::MutexGuard<'_, HashMap<String, Running>> {
        self.running.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn on_disk(&self) -> std::sync::MutexGuard<'_, HashMap<String, OnDisk>> {
        self.on_disk.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Where the VM is, both maps read at one moment (a move between
    /// them holds both locks).
    fn seen(&self, id: &str) -> Seen {
        let mut running = self.running();
        if self.on_disk().contains_key(id) {
            return Seen::OnDisk;
        }
        match running.get_mut(id) {
            Some(vm) => Seen::Running { exited: vm.qemu.exited(), paused: vm.paused },
            None => Seen::Absent,
        }
    }

    /// The VM spec to start `launch` again in `dir`.
    fn respawn(&self, id: &str, launch: &Launch, mem: &fs::File) -> Result<(QemuProcess, qemu::ConsoleTail)> {
        let initramfs = self.initramfs.get().ok_or_else(|| BackendError::Setup("no initramfs yet".into()))?;
        let dir = self.dir(id);
        let (serial_sock, qmp_sock, writable) = (dir.join("port.sock"), self.qmp_sock(id), dir.join("rw.img"));
        for stale in [&serial_sock, &qmp_sock] {
            let _ = fs::remove_file(stale);
        }
        qemu::spawn(&VmSpec {
            qemu: &self.config.qemu,
            kernel: self.kernel(),
            initramfs,
            accel: launch.accel,
            machine: self.config.machine,
            vcpus: launch.vcpus,
            memory_mib: launch.memory_mib,
            pids: launch.pids,
            open_files: launch.open_files,
            layers: &launch.layer_files,
            writable: &writable,
            serial_sock: &serial_sock,
            qmp_sock: &qmp_sock,
            hostname: &launch.hostname,
            jail: &self.config.run_dir.join(".jail"),
            incoming: Some(mem),
            netns: launch.netns.as_deref().map(|fd| fd.as_fd()),
            writable_by_fd: true,
            qemu_uid: launch.qemu_uid,
        })
    }

    /// Starts the guest saved in `paused.mem` again, stopped, with a new
    /// mux; then lets it run.
    fn restore_from_disk(&self, id: &str, mut launch: Launch) -> Result<Running> {
        let mem_path = self.dir(id).join(PAUSED_MEM);
        let mem = fs::File::open(&mem_path).map_err(|e| BackendError::io(format!("open {}", mem_path.display()), e))?;
        let (mut child, console) = self.respawn(id, &launch, &mem)?;
        drop(mem);
        let started = (|| {
            self.cgroup(id)?.add_pid(child.pid().pid).map_err(cgroup_err)?;
            qmp::wait_incoming(&self.qmp_sock(id), DISK_PAUSE_TIMEOUT)?;
            let mut port = mux::connect_blocking(&self.dir(id).join("port.sock"), Duration::from_secs(10))?;
            qmp::cont(&self.qmp_sock(id))?;
            // What the guest wrote for the node it had before the pause
            // comes first on the port.
            mux::resync_blocking(&mut port, RESYNC_WAIT)?;
            // The guest's clock stood still on disk. Told before the mux
            // takes the port, so no exec sees the old time; a guest that
            // runs again is not failed over its clock.
            if let Err(e) = snapshot::identify_on_port(&mut port, &mut launch.first_stream, &launch.name) {
                tracing::warn!(sandbox = %id, "a guest restored from disk keeps its stale clock: {e}");
            }
            mux::serve_blocking(port, &self.ctl_sock(id), launch.first_stream)
        })();
        match started {
            Ok(mux) => {
                let _ = fs::remove_file(&mem_path);
                child.keep_running_on_drop();
                if let Err(e) = self.save_record(id, Some(child.pid()), &launch) {
                    tracing::warn!(sandbox = %id, "a restarted node will not adopt this VM: {e}");
                }
                Ok(Running { qemu: child, _mux: mux, paused: false, mux_at_resume: false, launch, console })
            }
            Err(e) => {
                child.start_kill();
                Err(match console.text().trim() {
                    "" => e,
                    tail => BackendError::Setup(format!("{e}; console: {tail}")),
                })
            }
        }
    }

    /// The initramfs, built once; the kernel image QEMU boots
    /// ([`MicroVmDriver::kernel`]) is made with it, so every path that
    /// boots a guest asks for this first.
    async fn initramfs(&self) -> Result<&Path> {
        let path = self
            .initramfs
            .get_or_try_init(|| async {
                let dest = self.config.run_dir.join(".initramfs.cpio");
                let (init, modules, out) =
                    (self.config.init_binary.clone(), self.config.modules_dir.clone(), dest.clone());
                let (bzimage, vmlinux) = (self.config.kernel.clone(), self.config.run_dir.join(".vmlinux"));
                let list = match self.config.machine {
                    Machine::Micro => initramfs::MODULES,
                    Machine::Q35 => initramfs::Q35_MODULES,
                };
                let kernel = tokio::task::spawn_blocking(move || {
                    initramfs::build(&init, &modules, list, &out)?;
                    Ok::<_, BackendError>(match kernel::extract(&bzimage, &vmlinux) {
                        Ok(()) => vmlinux,
                        Err(e) => {
                            tracing::warn!("booting the compressed kernel as it is: {e}");
                            bzimage
                        }
                    })
                })
                .await
                .map_err(|e| BackendError::io("initramfs task", std::io::Error::other(e)))??;
                let _ = self.kernel_image.set(kernel);
                Ok::<_, BackendError>(dest)
            })
            .await?;
        Ok(path)
    }

    /// The kernel image QEMU boots: the unpacked `vmlinux` once
    /// [`MicroVmDriver::initramfs`] has made it (see [`kernel`]).
    fn kernel(&self) -> &Path {
        self.kernel_image.get().map_or(self.config.kernel.as_path(), PathBuf::as_path)
    }

    /// The accelerator every VM of this driver uses: KVM if it boots this
    /// guest, TCG otherwise (probed once).
    pub async fn accel(&self) -> Result<Accel> {
        let initramfs = self.initramfs().await?.to_path_buf();
        let accel = self
            .accel
            .get_or_init(|| async {
                match self.config.accel {
                    AccelChoice::Force(a) => a,
                    AccelChoice::Auto => {
                        let jail = self.config.run_dir.join(".jail");
                        let config = &self.config;
                        qemu::probe_kvm(&config.qemu, config.machine, self.kernel(), &initramfs, &jail).await
                    }
                }
            })
            .await;
        Ok(*accel)
    }

    async fn layer_files(&self, layers: &[PathBuf]) -> Result<Vec<PathBuf>> {
        let _one_at_a_time = self.layer_build.lock().await;
        let layers = layers.to_vec();
        let cache = self.config.run_dir.join(".layers");
        tokio::task::spawn_blocking(move || layers.iter().map(|l| disks::layer_file(l, &cache)).collect())
            .await
            .map_err(|e| BackendError::io("layer task", std::io::Error::other(e)))?
    }

    /// Everything after the directory and cgroup exist.
    async fn boot(
        &self,
        spec: &SandboxSpec,
        dir: &Path,
        cgroup: &SandboxCgroup,
        netns: Option<Arc<OwnedFd>>,
        qemu_uid: Option<u32>,
    ) -> Result<(Running, Accel)> {
        let entered = std::time::Instant::now();
        let layers = self.layer_files(&spec.layers).await?;
        let initramfs = self.initramfs().await?.to_path_buf();
        let accel = self.accel().await?;
        let writable = dir.join("rw.img");
        disks::make_writable(&writable, spec.resources.disk_mib, spec.resources.inodes).await?;
        let launch = Launch {
            layer_files: layers.clone(),
            vcpus: vcpus(spec),
            memory_mib: spec.resources.memory_mib,
            pids: spec.resources.pids,
            open_files: spec.resources.open_files,
            hostname: spec.hostname.clone(),
            name: spec.hostname.clone(),
            accel,
            first_stream: 1,
            netns,
            qemu_uid,
        };
        let serial_sock = dir.join("port.sock");
        let qmp_sock = self.qmp_sock(&spec.id);
        let vm = VmSpec {
            qemu: &self.config.qemu,
            kernel: self.kernel(),
            initramfs: &initramfs,
            accel,
            machine: self.config.machine,
            vcpus: vcpus(spec),
            memory_mib: spec.resources.memory_mib,
            pids: spec.resources.pids,
            open_files: spec.resources.open_files,
            layers: &layers,
            writable: &writable,
            serial_sock: &serial_sock,
            qmp_sock: &qmp_sock,
            hostname: &spec.hostname,
            jail: &self.config.run_dir.join(".jail"),
            incoming: None,
            netns: launch.netns.as_deref().map(|fd| fd.as_fd()),
            // A pause to disk migrates this QEMU (see `VmSpec`).
            writable_by_fd: true,
            qemu_uid,
        };
        let spawned_ms = entered.elapsed().as_millis();
        let (mut child, console) = qemu::spawn(&vm)?;
        // Before its vCPUs run the guest: a moment of QEMU's start-up
        // outside the cgroup is the price of not forking through it.
        cgroup.add_pid(child.pid().pid).map_err(cgroup_err)?;
        let abandoned = AbandonedBootReport {
            id: &spec.id,
            console: &console,
            qmp_sock: &qmp_sock,
            vmlinuz: &self.config.kernel,
            entered,
            spawned_ms,
            settled: false,
        };
        let ready = self.wait_ready(&mut child, &serial_sock, &self.ctl_sock(&spec.id)).await;
        abandoned.settle();
        if qemu::boot_trace() {
            let ready_ms = entered.elapsed().as_millis();
            tracing::info!(sandbox = %spec.id, spawned_ms, ready_ms, console = %console.text(), "boot trace");
        }
        match ready {
            Ok(mux) => {
                Ok((Running { qemu: child, _mux: mux, paused: false, mux_at_resume: false, launch, console }, accel))
            }
            Err(e) => {
                child.start_kill();
                let _ = child.wait().await;
                let tail = console.text();
                let tail = tail.trim();
                Err(match e {
                    _ if tail.is_empty() => e,
                    BackendError::Setup(why) => BackendError::Setup(format!("{why}; console: {tail}")),
                    e => BackendError::Setup(format!("{e}; console: {tail}")),
                })
            }
        }
    }

    async fn wait_ready(&self, child: &mut QemuProcess, serial_sock: &Path, ctl_sock: &Path) -> Result<mux::Mux> {
        wait_ready(child, serial_sock, ctl_sock, boot_deadline(self.config.machine)).await
    }

    /// What a snapshot of this sandbox's image and shape is made from.
    async fn template(&self, spec: &SandboxSpec) -> Result<snapshot::Template> {
        Ok(snapshot::Template {
            qemu: self.config.qemu.clone(),
            initramfs: self.initramfs().await?.to_path_buf(),
            kernel: self.kernel().to_path_buf(),
            accel: self.accel().await?,
            machine: self.config.machine,
            jail: self.config.run_dir.join(".jail"),
            cgroup_instance: self.config.cgroup_instance.clone(),
            image_layers: spec.layers.clone(),
            layer_files: self.layer_files(&spec.layers).await?,
            shape: snapshot::Shape {
                vcpus: vcpus(spec),
                memory_mib: spec.resources.memory_mib,
                disk_mib: spec.resources.disk_mib,
                inodes: spec.resources.inodes,
                pids: spec.resources.pids,
                open_files: spec.resources.open_files,
                net: spec.network == warren_api::NetworkMode::Allowlist,
            },
        })
    }

    /// Restores this shape's snapshot when there is one (starting its
    /// build when there is none), else boots.
    async fn restore_or_boot(
        &self,
        spec: &SandboxSpec,
        dir: &Path,
        cgroup: &SandboxCgroup,
        netns: Option<Arc<OwnedFd>>,
        qemu_uid: Option<u32>,
    ) -> Result<(Running, Accel, VmBoot)> {
        if self.config.snapshots {
            let template = self.template(spec).await;
            let keyed = template.and_then(|t| self.snapshots.key(&t).map(|key| (t, key)));
            match keyed {
                Ok((template, key)) => {
                    self.snapshots.prune();
                    match self.snapshots.ready(&key) {
                        Some(snap) => {
                            let restored = snapshot::restore(
                                &snap,
                                &template,
                                dir,
                                cgroup,
                                &spec.hostname,
                                netns.clone(),
                                qemu_uid,
                            );
                            match restored.await {
                                Ok(running) => return Ok((running, template.accel, VmBoot::Snapshot)),
                                Err(e) => {
                                    tracing::warn!(sandbox = %spec.id, "snapshot restore failed, booting instead: {e}");
                                    self.snapshots.discard(&key);
                                }
                            }
                        }
                        None => self.snapshots.build_in_background(key, template),
                    }
                }
                Err(e) => tracing::warn!(sandbox = %spec.id, "no snapshot boot: {e}"),
            }
        }
        let (running, accel) = self.boot(spec, dir, cgroup, netns, qemu_uid).await?;
        Ok((running, accel, VmBoot::Cold))
    }

    /// Kills QEMU (and anything else in its cgroup) and removes the cgroup
    /// and the directory.
    async fn remove(&self, id: &str) -> Result<()> {
        self.on_disk().remove(id);
        self.limit_reads.lock().unwrap_or_else(PoisonError::into_inner).remove(id);
        let running = self.running().remove(id);
        if let Some(mut running) = running {
            running.qemu.start_kill();
            let _ = running.qemu.wait().await;
        }
        let cgroup = self.cgroup(id)?;
        let dir = self.dir(id);
        let uid_slot = SlotBook::recorded(&Layout::new(&self.config.run_dir, id));
        tokio::task::spawn_blocking(move || {
            cgroup.kill_all(Duration::from_secs(5)).map_err(cgroup_err)?;
            cgroup.remove().map_err(cgroup_err)?;
            unpin_netns(&dir)?;
            match fs::remove_dir_all(&dir) {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(BackendError::io(format!("remove {}", dir.display()), e)),
            }
        })
        .await
        .map_err(|e| BackendError::io("teardown task", std::io::Error::other(e)))??;
        // Free once nothing of the VM that ran as its uid is left.
        if let Some(slot) = uid_slot {
            self.qemu_uids.release(slot);
        }
        Ok(())
    }

    /// The host uid a new VM's QEMU runs as, claimed in its directory
    /// (see [`MicroVmConfig::qemu_uid_start`]).
    fn claim_qemu_uid(&self, id: &str) -> Result<Option<u32>> {
        let Some(start) = self.config.qemu_uid_start else { return Ok(None) };
        let slot = self.qemu_uids.claim_slot(&Layout::new(&self.config.run_dir, id))?;
        Ok(Some(start + slot))
    }

    /// Writes the VM's [`VmRecord`] (whole or not at all).
    fn save_record(&self, id: &str, qemu: Option<ProcessId>, launch: &Launch) -> Result<()> {
        let record = VmRecord { qemu, net: launch.netns.is_some(), launch: launch.clone() };
        let bytes = serde_json::to_vec(&record).map_err(|e| BackendError::Protocol(e.to_string()))?;
        let (tmp, path) = (self.dir(id).join(format!("{VM_RECORD}.tmp")), self.dir(id).join(VM_RECORD));
        fs::write(&tmp, bytes).map_err(|e| BackendError::io(format!("write {}", tmp.display()), e))?;
        fs::rename(&tmp, &path).map_err(|e| BackendError::io(format!("rename {}", tmp.display()), e))
    }

    /// Takes over a VM an earlier node process left running (or paused to
    /// disk): its QEMU, checked to be the recorded process and in the
    /// sandbox's cgroup, is watched through a pidfd; a new mux serves the
    /// control port after a resync (see [`mux::resync_blocking`]) on
    /// stream ids past every id the guest has seen. `paused` is the
    /// node's view, which the guest is brought to: a pause or resume the
    /// earlier node did not finish is finished here one way or the other.
    async fn take_over(&self, handle: &SandboxHandle, paused: bool) -> Result<()> {
        let _ = self.state(handle)?;
        let id = handle.id.as_str();
        // A resume from disk starts QEMU with the kernel and initramfs.
        self.initramfs().await?;
        let dir = self.dir(id);
        let path = dir.join(VM_RECORD);
        let bytes = fs::read(&path).map_err(|e| BackendError::io(format!("read {}", path.display()), e))?;
        let record: VmRecord =
            serde_json::from_slice(&bytes).map_err(|e| BackendError::Protocol(format!("{}: {e}", path.display())))?;
        let mut launch = record.launch;
        launch.first_stream = launch.first_stream.saturating_add(1 << 24);
        let cgroup = self.cgroup(id)?;
        if record.net {
            launch.netns = Some(Arc::new(open_pinned_netns(&dir)?));
        }
        if dir.join(PAUSED_MEM).exists() {
            if !paused {
                return Err(BackendError::Setup("paused to disk while the node saw it running".into()));
            }
            // A QEMU the earlier node had not ended yet after the save.
            tokio::task::spawn_blocking(move || cgroup.kill_all(Duration::from_secs(5)).map_err(cgroup_err))
                .await
                .map_err(|e| BackendError::io("adoption task", std::io::Error::other(e)))??;
            self.save_record(id, None, &launch)?;
            self.on_disk().insert(id.to_string(), OnDisk { launch });
            return Ok(());
        }
        let _ = fs::remove_file(dir.join(PAUSED_MEM_PART));
        let pid = record.qemu.ok_or_else(|| BackendError::Setup("no QEMU recorded".into()))?;
        if !cgroup.pids("memory").map_err(cgroup_err)?.contains(&pid.pid) {
            return Err(BackendError::Setup(format!("QEMU (pid {}) is not in the sandbox's cgroup", pid.pid)));
        }
        let qemu = QemuProcess::adopt(pid).ok_or_else(|| BackendError::Setup("its QEMU is gone".into()))?;
        let (qmp_sock, port_sock) = (self.qmp_sock(id), dir.join("port.sock"));
        let port = tokio::task::spawn_blocking(move || {
            let status = qmp::query_status(&qmp_sock)?;
            match (status.status.as_str(), paused) {
                ("running", true) => qmp::stop(&qmp_sock)?,
                ("paused", false) => qmp::cont(&qmp_sock)?,
                ("running", false) | ("paused", true) => {}
                (other, _) => return Err(BackendError::Setup(format!("its QEMU is in state `{other}`"))),
            }
            if paused {
                return Ok(None);
            }
            let mut port = mux::connect_blocking(&port_sock, Duration::from_secs(10))?;
            mux::resync_blocking(&mut port, RESYNC_WAIT)?;
            Ok(Some(port))
        })
        .await
        .map_err(|e| BackendError::io("adoption task", std::io::Error::other(e)))??;
        let mux = match port {
            Some(port) => mux::serve_blocking(port, &self.ctl_sock(id), launch.first_stream)?,
            None => mux::Mux::detached(),
        };
        self.save_record(id, Some(pid), &launch)?;
        // The old node's reader went with it; QEMU serves the next one.
        let console = qemu::ConsoleTail::default();
        console.attach(&qemu::console_sock(&self.dir(id).join("port.sock")));
        let vm = Running { qemu, _mux: mux, paused, mux_at_resume: paused, launch, console };
        self.running().insert(id.to_string(), vm);
        Ok(())
    }

    /// Ids with a run directory or a cgroup.
    fn known_ids(&self) -> Result<Vec<String>> {
        let mut ids = SandboxCgroup::list(&self.config.cgroup_instance).map_err(cgroup_err)?;
        let entries = fs::read_dir(&self.config.run_dir)
            .map_err(|e| BackendError::io(format!("read {}", self.config.run_dir.display()), e))?;
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !name.starts_with('.') && entry.file_type().is_ok_and(|t| t.is_dir()) {
                ids.push(name);
            }
        }
        ids.sort();
        ids.dedup();
        Ok(ids)
    }
}

#[async_trait]
impl Driver for MicroVmDriver {
    fn backend(&self) -> Backend {
        self.config.backend()
    }

    async fn create(&self, spec: &SandboxSpec) -> Result<SandboxHandle> {
        check_id(&spec.id)?;
        let backend = self.backend().as_str();
        if !spec.phase.protected_paths.is_empty() {
            self.config.protected_paths().map_err(|why| BackendError::Unsupported(backend, why))?;
        }
        if spec.resources.memory_mib < MIN_MEMORY_MIB {
            return Err(BackendError::Unsupported(backend, "memory below 128 MiB"));
        }
        // QEMU allocates the guest's memory: more than the host has fails
        // its start (and a cgroup limit above it means nothing).
        let most = self.max_guest_mib;
        if spec.resources.memory_mib > most {
            let message = format!("a {backend} guest's memory must fit this host: at most {most} MiB here");
            return Err(BackendError::Invalid { field: "memory_mib", message });
        }
        if self.config.machine == Machine::Q35 && !has_systemd(&spec.layers) {
            return Err(BackendError::Unsupported(backend, "images without systemd (/lib/systemd/systemd)"));
        }
        let dir = self.dir(&spec.id);
        match fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                return Err(BackendError::Setup(format!("sandbox {} exists already", dir.display())))
            }
            Err(e) => return Err(BackendError::io(format!("mkdir {}", dir.display()), e)),
        }
        let cgroup = self.cgroup(&spec.id)?;
        let limits = Limits {
            memory_bytes: spec.resources.memory_mib.saturating_add(QEMU_OVERHEAD_MIB).saturating_mul(1 << 20),
            cpus: spec.resources.cpus,
            pids: QEMU_PIDS + vcpus(spec),
        };
        let netns = match spec.network {
            warren_api::NetworkMode::Allowlist => new_netns().map(|ns| Some(Arc::new(ns))),
            _ => Ok(None),
        };
        let booted = match (cgroup.create(&limits).map_err(cgroup_err), netns, self.claim_qemu_uid(&spec.id)) {
            (Ok(()), Ok(netns), Ok(uid)) => self.restore_or_boot(spec, &dir, &cgroup, netns, uid).await,
            (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => Err(e),
        };
        let handle = match booted {
            Ok((mut running, accel, boot)) => {
                running.qemu.keep_running_on_drop();
                let pinned = match &running.launch.netns {
                    Some(ns) => pin_netns(&dir, ns),
                    None => Ok(()),
                };
                let recorded =
                    pinned.and_then(|()| self.save_record(&spec.id, Some(running.qemu.pid()), &running.launch));
                self.running().insert(spec.id.clone(), running);
                if let Err(e) = recorded {
                    let _ = self.remove(&spec.id).await;
                    return Err(e);
                }
                let state = HandleState { dir, accel, boot: Some(boot) };
                serde_json::to_value(&state)
                    .map_err(|e| BackendError::Protocol(e.to_string()))
                    .map(|state| SandboxHandle { id: spec.id.clone(), backend: self.backend(), state })
            }
            Err(e) => Err(e),
        };
        // The guest's init starts in an unnamed phase (a snapshot's guest
        // was booted for any sandbox): the first one is set as a switch,
        // before anything runs.
        let phased = match handle {
            Ok(handle) if spec.phase != PhaseRules::default() => {
                channel::set_phase(&self.ctl_sock(&spec.id), spec.phase.clone(), false).await.map(|_| handle)
            }
            other => other,
        };
        if phased.is_err() {
            let _ = self.remove(&spec.id).await;
        }
        phased
    }

    async fn set_phase(&self, handle: &SandboxHandle, phase: PhaseRules, kill_running: bool) -> Result<u32> {
        let _ = self.state(handle)?;
        if !phase.protected_paths.is_empty() {
            self.config.protected_paths().map_err(|why| BackendError::Unsupported(self.backend().as_str(), why))?;
        }
        if !self.running().contains_key(&handle.id) {
            return Err(BackendError::Gone);
        }
        channel::set_phase(&self.ctl_sock(&handle.id), phase, kill_running).await
    }

    async fn exec(&self, handle: &SandboxHandle, spec: ExecSpec) -> Result<ExecProcess> {
        let _ = self.state(handle)?;
        if !self.running().contains_key(&handle.id) {
            return Err(BackendError::Gone);
        }
        channel::start_exec(&self.ctl_sock(&handle.id), spec, self.cgroup(&handle.id)?).await
    }

    async fn destroy(&self, handle: &SandboxHandle) -> Result<()> {
        check_id(&handle.id)?;
        self.remove(&handle.id).await
    }

    async fn adopt(&self, handle: &SandboxHandle, paused: bool) -> Liveness {
        if self.seen(&handle.id) == Seen::Absent {
            if let Err(e) = self.take_over(handle, paused).await {
                tracing::warn!(sandbox = %handle.id, "cannot adopt the VM: {e}");
                return Liveness::Dead { oom: false };
            }
        }
        self.probe(handle).await
    }

    /// A live QEMU is all this looks at: no round trip into the guest,
    /// which under TCG costs the guest's vCPU a wake-up and the ping's
    /// work in emulated code.
    async fn probe_idle(&self, handle: &SandboxHandle) -> Liveness {
        match self.seen(&handle.id) {
            Seen::OnDisk | Seen::Running { exited: false, .. } if self.state(handle).is_ok() => Liveness::Alive,
            _ => self.probe(handle).await,
        }
    }

    async fn probe(&self, handle: &SandboxHandle) -> Liveness {
        if self.state(handle).is_err() {
            return Liveness::Dead { oom: false };
        }
        match self.seen(&handle.id) {
            Seen::OnDisk => return Liveness::Alive,
            // A stopped guest cannot answer a ping; a live QEMU is all there is to see.
            Seen::Running { exited: false, paused: true } => return Liveness::Alive,
            Seen::Running { exited: false, paused: false } => {
                if channel::ping(&self.ctl_sock(&handle.id), PING_TIMEOUT).await {
                    return Liveness::Alive;
                }
                // A pause that came while the ping waited stopped the guest
                // mid-answer; one to disk also ended the mux the ping used.
                match self.seen(&handle.id) {
                    Seen::OnDisk | Seen::Running { exited: false, paused: true } => return Liveness::Alive,
                    // QEMU runs on: the guest is slow (TCG under load) or its init hangs.
                    Seen::Running { exited: false, paused: false } => return Liveness::Unresponsive,
                    Seen::Running { exited: true, .. } | Seen::Absent => {}
                }
            }
            Seen::Running { exited: true, .. } | Seen::Absent => {}
        }
        let oom = self.cgroup(&handle.id).and_then(|cg| cg.oom_kills().map_err(cgroup_err)).is_ok_and(|n| n > 0);
        Liveness::Dead { oom }
    }

    fn death_detail(&self, handle: &SandboxHandle) -> Option<String> {
        let running = self.running();
        last_words(&running.get(&handle.id)?.console.text())
    }

    /// QMP `stop`: the vCPUs stop where they are, the guest's clocks with
    /// them; memory stays allocated (no snapshot to disk yet).
    fn pause(&self, handle: &SandboxHandle) -> Result<()> {
        let _ = self.state(handle)?;
        if self.on_disk().contains_key(&handle.id) {
            return Ok(());
        }
        if self.set_paused(&handle.id, true)? {
            return Ok(());
        }
        let sock = self.qmp_sock(&handle.id);
        let stopped = qmp::stop(&sock).and_then(|()| match qmp::query_status(&sock)? {
            status if status.running => {
                Err(BackendError::Protocol(format!("QEMU still runs the guest after `stop` ({})", status.status)))
            }
            _ => Ok(()),
        });
        if stopped.is_err() {
            // Back to a known state: a guest left stopped but unmarked
            // would fail its next probe and be ended.
            let _ = qmp::cont(&sock);
            let _ = self.set_paused(&handle.id, false);
        }
        stopped
    }

    /// The guest's memory and devices to `paused.mem` (a QEMU migration
    /// stream), then QEMU exits: the memory is the host's again. The mux
    /// goes first, so the guest ends its streams as for a node that went
    /// away: running execs end (their processes are killed), while every
    /// other process and all memory state (tmpfs, caches) stay as they are.
    fn pause_to_disk(&self, handle: &SandboxHandle) -> Result<()> {
        let _ = self.state(handle)?;
        let _moving = self.moves.lock().unwrap_or_else(PoisonError::into_inner);
        if self.on_disk().contains_key(&handle.id) {
            return Ok(());
        }
        let id = handle.id.as_str();
        let sock = self.qmp_sock(id);
        let mut vm = {
            let mut running = self.running();
            let vm = running.remove(id).ok_or(BackendError::Gone)?;
            // Probes see it alive (and unpingable) from here on.
            self.on_disk().insert(id.to_string(), OnDisk { launch: vm.launch.clone() });
            vm
        };
        let (mem_path, part_path) = (self.dir(id).join(PAUSED_MEM), self.dir(id).join(PAUSED_MEM_PART));
        let saved = (|| {
            if vm.paused {
                qmp::cont(&sock)?;
            }
            drop(std::mem::replace(&mut vm._mux, mux::Mux::detached()));
            std::thread::sleep(DISK_PAUSE_QUIESCE);
            qmp::stop(&sock)?;
            let file = fs::File::create(&part_path)
                .map_err(|e| BackendError::io(format!("create {}", part_path.display()), e))?;
            qmp::migrate_to_file(&sock, &file, DISK_PAUSE_TIMEOUT)?;
            file.sync_all().map_err(|e| BackendError::io(format!("sync {}", part_path.display()), e))?;
            // Only a whole stream has the name a restarted node looks for.
            fs::rename(&part_path, &mem_path)
                .map_err(|e| BackendError::io(format!("rename {}", part_path.display()), e))
        })();
        match saved {
            Ok(()) => {
                vm.qemu.start_kill();
                // The cgroup's kill reaps nothing; QEMU must be gone before
                // the resume opens the disk again.
                for _ in 0..500 {
                    if vm.qemu.exited() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                Ok(())
            }
            Err(e) => {
                // Back to a running VM with a new mux, as if never paused.
                let _ = fs::remove_file(&part_path);
                let _ = fs::remove_file(&mem_path);
                let back = qmp::cont(&sock).and_then(|()| {
                    mux::start_blocking(
                        &self.dir(id).join("port.sock"),
                        &self.ctl_sock(id),
                        Duration::from_secs(10),
                        vm.launch.first_stream.saturating_add(1 << 24),
                    )
                });
                let mut running = self.running();
                // Not there if the sandbox was removed meanwhile: then the
                // VM (its QEMU) goes with `vm`.
                let ours = self.on_disk().remove(id).is_some();
                if let (true, Ok(mux)) = (ours, back) {
                    vm._mux = mux;
                    vm.launch.first_stream = vm.launch.first_stream.saturating_add(1 << 24);
                    vm.paused = false;
                    if let Err(e) = self.save_record(id, Some(vm.qemu.pid()), &vm.launch) {
                        tracing::warn!(sandbox = %id, "a restarted node will not adopt this VM: {e}");
                    }
                    running.insert(id.to_string(), vm);
                }
                Err(e)
            }
        }
    }

    /// QMP `cont`; the mux's streams carry on where they were. A VM paused
    /// to disk is started again from `paused.mem` first (blocking: QEMU
    /// loads the guest's memory, a fraction of a second for a small guest).
    fn resume(&self, handle: &SandboxHandle) -> Result<()> {
        let _ = self.state(handle)?;
        let _moving = self.moves.lock().unwrap_or_else(PoisonError::into_inner);
        // It stays in `on_disk` while it is restored (probes see it alive);
        // a failed restore leaves it there, and a later resume may succeed.
        let saved = self.on_disk().get_mut(&handle.id).map(|saved| {
            saved.launch.first_stream = saved.launch.first_stream.saturating_add(1 << 24);
            saved.launch.clone()
        });
        if let Some(launch) = saved {
            let mut vm = self.restore_from_disk(&handle.id, launch)?;
            let mut running = self.running();
            if self.on_disk().remove(&handle.id).is_none() {
                // Removed while it was restored: the new QEMU goes too.
                drop(running);
                vm.qemu.start_kill();
                return Err(BackendError::Gone);
            }
            running.insert(handle.id.clone(), vm);
            return Ok(());
        }
        let (paused, mux_at_resume, first_stream) = self
            .running()
            .get(&handle.id)
            .map(|vm| (vm.paused, vm.mux_at_resume, vm.launch.first_stream))
            .ok_or(BackendError::Gone)?;
        if !paused {
            return Ok(());
        }
        qmp::cont(&self.qmp_sock(&handle.id))?;
        if mux_at_resume {
            let mux = mux::start_blocking(
                &self.dir(&handle.id).join("port.sock"),
                &self.ctl_sock(&handle.id),
                RESYNC_WAIT,
                first_stream,
            )?;
            let mut running = self.running();
            let vm = running.get_mut(&handle.id).ok_or(BackendError::Gone)?;
            vm._mux = mux;
            vm.mux_at_resume = false;
        }
        self.set_paused(&handle.id, false)?;
        Ok(())
    }

    fn accelerator(&self, handle: &SandboxHandle) -> Option<Accel> {
        self.state(handle).ok().map(|s| s.accel)
    }

    /// Snapshots of replaced or removed images go at once (a create would
    /// neither restore them nor keep them).
    fn images_changed(&self) {
        self.snapshots.prune();
    }

    /// Snapshot template guests are counted there while they live.
    fn attach_books(&self, books: std::sync::Arc<dyn crate::HostBooks>) {
        self.snapshots.attach_books(books);
    }

    fn boot(&self, handle: &SandboxHandle) -> Option<VmBoot> {
        self.state(handle).ok().and_then(|s| s.boot)
    }

    /// `pack_diff`: the guest's init archives its overlay's upper directory
    /// while the sandbox's processes are stopped, and the node unpacks the
    /// archive - which comes from inside the sandbox - with the checks of
    /// [`warren_image::oci::unpack_sandbox_diff`] and a cap on its size.
    /// The guest's ids are the image's: nothing to shift back.
    fn snapshot(&self, handle: &SandboxHandle, dest: &Path) -> Result<()> {
        let files = self.remote_files(handle)?;
        let rw = self.dir(&handle.id).join("rw.img");
        let disk_bytes = fs::metadata(&rw).map_err(|e| BackendError::io(format!("stat {}", rw.display()), e))?.len();
        let (archive, _stopped) =
            files.open_pack().map_err(|e| BackendError::Protocol(format!("archiving the writable layer: {e}")))?;
        let cap = disk_bytes.saturating_mul(2).saturating_add(PACK_SLACK_BYTES);
        warren_image::oci::unpack_sandbox_diff(Capped { inner: archive, left: cap }, dest)
            .map_err(|e| BackendError::Setup(format!("unpacking the writable layer: {e}")))
    }

    /// Init serves the guest's files over the mux (the guest's root is a
    /// filesystem on a disk only the guest kernel reads).
    fn remote_files(&self, handle: &SandboxHandle) -> Result<crate::remote_files::RemoteFiles> {
        self.state(handle)?;
        Ok(crate::remote_files::RemoteFiles::new(self.ctl_sock(&handle.id)))
    }

    /// The guest's init counts them (the host sees only QEMU); blocking,
    /// bounded by [`LIMITS_TIMEOUT`]. A paused guest is not asked, nor is a
    /// quiet one: asking wakes a TCG guest and costs it more CPU than its
    /// whole idle second (about 11 ms against 3 here, the node asking every
    /// second), while a guest that used next to no CPU since its last answer
    /// cannot have run into a limit meanwhile (no allocation, fork or write
    /// happens without CPU; the file API's writes are the guest's too). Its
    /// last answer stands, for at most [`QUIET_GUEST_MAX_SKIP`].
    fn limit_counters(&self, handle: &SandboxHandle) -> Result<crate::LimitCounters> {
        let _ = self.state(handle)?;
        if self.seen(&handle.id) != (Seen::Running { exited: false, paused: false }) {
            return Err(BackendError::Busy("the VM is paused or gone".into()));
        }
        let cgroup = self.cgroup(&handle.id)?;
        let cpu_time_ns = || cgroup.cpu_time_ns().map_err(cgroup_err);
        let before = cpu_time_ns()?;
        let reads = || self.limit_reads.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(last) = reads().get(&handle.id) {
            if last.quiet_until(before, std::time::Instant::now()) {
                return Ok(last.counters);
            }
        }
        let counters = channel::limit_counters_blocking(&self.ctl_sock(&handle.id), LIMITS_TIMEOUT)?;
        let read = LimitRead { counters, cpu_time_ns: cpu_time_ns()?, at: std::time::Instant::now() };
        reads().insert(handle.id.clone(), read);
        Ok(counters)
    }

    /// QEMU's network namespace (see [`VmSpec::netns`]) and cgroup.
    fn network_target(&self, handle: &SandboxHandle) -> Result<crate::NetworkTarget> {
        let _ = self.state(handle)?;
        let netns = {
            let running = self.running();
            let on_disk = self.on_disk();
            let launch = running.get(&handle.id).map(|vm| &vm.launch).or(on_disk.get(&handle.id).map(|vm| &vm.launch));
            match launch.map(|l| l.netns.as_ref()) {
                None => return Err(BackendError::Gone),
                Some(None) => return Err(BackendError::Unsupported(self.backend().as_str(), "egress networking")),
                Some(Some(ns)) => ns.try_clone().map_err(|e| BackendError::io("duplicate the netns", e))?,
            }
        };
        Ok(crate::NetworkTarget { netns, cgroup2_dir: self.cgroup(&handle.id)?.path(UNIFIED) })
    }

    async fn events(&self, handle: &SandboxHandle, after_seq: u64) -> Result<EventBatch> {
        let _ = self.state(handle)?;
        channel::events(&self.ctl_sock(&handle.id), after_seq).await
    }

    fn usage(&self, handle: &SandboxHandle) -> Result<Usage> {
        let _ = self.state(handle)?;
        let rw = self.dir(&handle.id).join("rw.img");
        if self.on_disk().contains_key(&handle.id) {
            // No QEMU: no memory, CPU or threads; the disk stays.
            let disk_bytes =
                disks::allocated_bytes(&rw).map_err(|e| BackendError::io(format!("stat {}", rw.display()), e))?;
            return Ok(Usage { memory_bytes: 0, memory_peak_bytes: 0, cpu_time_secs: 0.0, pids: 0, disk_bytes });
        }
        if !self.running().contains_key(&handle.id) {
            return Err(BackendError::Gone);
        }
        let counters = self.cgroup(&handle.id)?.usage().map_err(cgroup_err)?;
        Ok(Usage {
            memory_bytes: counters.memory_bytes,
            memory_peak_bytes: counters.memory_peak_bytes,
            cpu_time_secs: counters.cpu_time_ns as f64 / 1e9,
            // QEMU's threads; the guest's processes are not visible here.
            pids: counters.pids,
            disk_bytes: disks::allocated_bytes(&rw)
                .map_err(|e| BackendError::io(format!("stat {}", rw.display()), e))?,
        })
    }

    async fn sweep(&self, keep: &[String]) -> Result<SweepReport> {
        let mut report = SweepReport::default();
        for id in self.known_ids()? {
            if keep.contains(&id) && (self.running().contains_key(&id) || self.on_disk().contains_key(&id)) {
                continue;
            }
            self.remove(&id).await?;
            report.sandboxes_removed.push(id);
        }
        Ok(report)
    }

    async fn release(&self) -> Result<()> {
        self.snapshots.clear(&self.config.cgroup_instance).await?;
        if !self.running().is_empty() || !self.on_disk().is_empty() {
            return Ok(());
        }
        SandboxCgroup::remove_instance(&self.config.cgroup_instance).map_err(cgroup_err)
    }
}

/// Says what a guest's console showed when its boot is dropped unfinished
/// (the node's create deadline cancels the create): that boot ends in no
/// error of the driver's own, and the console is the only witness of
/// where a slow or hung guest stood.
struct AbandonedBootReport<'a> {
    id: &'a str,
    console: &'a qemu::ConsoleTail,
    /// Where the guest's vCPU is, read through QMP when the boot is given up.
    qmp_sock: &'a Path,
    /// The `vmlinuz` whose `System.map` names that place.
    vmlinuz: &'a Path,
    entered: std::time::Instant,
    /// When QEMU started, after `entered` (disks and the initramfs first).
    spawned_ms: u128,
    settled: bool,
}

impl AbandonedBootReport<'_> {
    fn settle(mut self) {
        self.settled = true;
    }
}

impl Drop for AbandonedBootReport<'_> {
    fn drop(&mut self) {
        if !self.settled {
            let waited_ms = self.entered.elapsed().as_millis();
            let console = self.console.text();
            let spawned_ms = self.spawned_ms;
            // A few samples in a row: one place again and again is a guest
            // stuck there, different places one that runs (or spins wider).
            let vcpu = match qmp::instruction_pointers(self.qmp_sock, 3) {
                Ok(rips) => rips
                    .iter()
                    .map(|&rip| match kernel::symbol(self.vmlinuz, rip) {
                        Some(symbol) => format!("{rip:#x} {symbol}"),
                        None => format!("{rip:#x}"),
                    })
                    .collect::<Vec<_>>()
                    .join(", "),
                Err(e) => format!("unknown ({e})"),
            };
            tracing::warn!(sandbox = %self.id, spawned_ms, waited_ms, vcpu = %vcpu, console = %console.trim(), "a VM boot was abandoned before its init answered");
        }
    }
}

/// What a guest that died said on its console, for its end message: the
/// last line naming a cause (a kernel panic, oops or BUG, an out-of-memory
/// kill, warren-init's own last message), then its last line, each cut to
/// [`LAST_WORDS`] bytes.
fn last_words(console: &str) -> Option<String> {
    const CAUSES: [&str; 5] = ["Kernel panic", "BUG:", "Oops", "Out of memory", "warren-init:"];
    let lines: Vec<&str> = console.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    let cut = |line: &str| match line.char_indices().nth(LAST_WORDS) {
        Some((at, _)) => format!("{}...", &line[..at]),
        None => line.to_string(),
    };
    let last = lines.last()?;
    let cause = lines.iter().rev().find(|l| CAUSES.iter().any(|c| l.contains(c)));
    Some(match cause {
        Some(cause) if cause != last => {
            format!("the guest's console said: {}; its last line: {}", cut(cause), cut(last))
        }
        _ => format!("the guest's console ended with: {}", cut(last)),
    })
}

/// See [`last_words`].
const LAST_WORDS: usize = 200;

fn boot_deadline(machine: Machine) -> Duration {
    match machine {
        Machine::Micro => BOOT_DEADLINE,
        Machine::Q35 => FULL_BOOT_DEADLINE,
    }
}

/// vCPUs for the sandbox's CPU share: one per CPU (rounded up), at most
/// the host's CPUs. More would only slow the guest (a TCG guest with 64
/// vCPUs on two cores did not boot within the create deadline); the CPU
/// quota of QEMU's cgroup stays what `cpus` says.
fn vcpus(spec: &SandboxSpec) -> u32 {
    static HOST_CPUS: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    let host = *HOST_CPUS
        .get_or_init(|| std::thread::available_parallelism().map_or(1, |n| u32::try_from(n.get()).unwrap_or(u32::MAX)));
    (spec.resources.cpus.ceil() as u32).clamp(1, host.max(1))
}

/// Starts the mux and pings until init answers, QEMU dies or `limit` passes.
async fn wait_ready(child: &mut QemuProcess, serial_sock: &Path, ctl_sock: &Path, limit: Duration) -> Result<mux::Mux> {
    let deadline = tokio::time::Instant::now() + limit;
    // A QEMU that refuses its command line exits before it makes the port's
    // socket: that ends the wait at once, with QEMU's words in the console.
    let mux = tokio::select! {
        status = child.wait() => {
            return Err(BackendError::Setup(format!("QEMU exited during boot ({})", status?)));
        }
        mux = mux::start(serial_sock, ctl_sock, Duration::from_secs(10)) => mux?,
    };
    loop {
        let patience = deadline.saturating_duration_since(tokio::time::Instant::now()).min(BOOT_PING_PATIENCE);
        let started = tokio::time::Instant::now();
        tokio::select! {
            // Cancel-safe: a ping that ends first leaves the wait to the next round.
            status = child.wait() => {
                return Err(BackendError::Setup(format!("QEMU exited during boot ({})", status?)));
            }
            answered = channel::ping(ctl_sock, patience) => {
                if answered {
                    return Ok(mux);
                }
            }
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(BackendError::Setup(format!("the VM's init did not answer within {limit:?}")));
        }
        // A ping refused at once (the mux lost QEMU's socket) is not retried in a spin.
        tokio::time::sleep_until(started + Duration::from_millis(20)).await;
    }
}

/// Whether any of the image's layers holds systemd (whiteouts aside: an
/// image that deletes its own systemd fails at boot instead, with the
/// guest's console in the error).
fn has_systemd(layers: &[PathBuf]) -> bool {
    layers.iter().any(|layer| SYSTEMD_PATHS.iter().any(|p| fs::symlink_metadata(layer.join(p)).is_ok()))
}

fn cgroup_err(e: warren_guard::cgroup::CgroupError) -> BackendError {
    BackendError::io("cgroup", std::io::Error::other(e))
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader, Read, Write};
    use std::os::unix::net::UnixListener;
    use std::sync::{mpsc, Arc};

    use super::*;

    #[test]
    fn kernels_sort_by_version_not_by_spelling() {
        assert_eq!(release_version("/boot/vmlinuz-6.12.95+deb12-cloud-amd64"), (6, 12, 95));
        assert_eq!(release_version("6.1.0-57-cloud-amd64"), (6, 1, 0));
        assert!(release_version("vmlinuz-6.9.1-cloud-amd64") < release_version("vmlinuz-6.12.0-cloud-amd64"));
    }

    /// A guest that used little more than an idle guest's CPU since its
    /// last limit read is quiet; one that worked, or whose read is older
    /// than the cap, is asked again.
    #[test]
    fn a_dead_guests_last_words_name_the_cause_and_the_last_line() {
        assert_eq!(last_words(" \n\n"), None);
        let panic = "[ 1.0] booting\n[ 3.2] Kernel panic - not syncing: sysrq triggered crash\n[ 3.3] RIP: 0033\n\n";
        assert_eq!(
            last_words(panic).as_deref(),
            Some(
                "the guest's console said: [ 3.2] Kernel panic - not syncing: sysrq triggered crash; \
                 its last line: [ 3.3] RIP: 0033"
            )
        );
        assert_eq!(last_words("a\nb\n").as_deref(), Some("the guest's console ended with: b"));
        let long = format!("warren-init: {}", "x".repeat(2 * LAST_WORDS));
        let said = last_words(&long).unwrap_or_default();
        assert!(said.ends_with("...") && said.len() < LAST_WORDS + 64, "{said}");
    }

    #[test]
    fn a_quiet_guest_keeps_its_last_limit_read_for_a_while() {
        let at = std::time::Instant::now();
        let last = LimitRead { counters: crate::LimitCounters::default(), cpu_time_ns: 1_000_000_000, at };
        let second = at + Duration::from_secs(1);
        assert!(last.quiet_until(1_000_000_000 + 3_000_000, second), "an idle second");
        assert!(last.quiet_until(1_000_000_000 + 24_000_000, second), "idle plus the read's tail");
        assert!(!last.quiet_until(1_000_000_000 + 60_000_000, second), "60 ms of work in a second");
        let later = at + Duration::from_secs(20);
        assert!(last.quiet_until(1_000_000_000 + 100_000_000, later), "5 ms a second for 20 s is idle");
        assert!(!last.quiet_until(1_000_000_000, at + QUIET_GUEST_MAX_SKIP), "never past the cap");
    }

    #[test]
    fn a_pack_archive_past_its_cap_is_cut_off_with_an_error() {
        let mut within = Capped { inner: &[7u8; 100][..], left: 100 };
        let mut all = Vec::new();
        within.read_to_end(&mut all).unwrap();
        assert_eq!(all.len(), 100, "exactly the cap is fine");
        let mut past = Capped { inner: &[7u8; 101][..], left: 100 };
        let err = past.read_to_end(&mut Vec::new()).unwrap_err();
        assert!(err.to_string().contains("writable disk"), "{err}");
    }

    fn driver(run_dir: &Path) -> MicroVmDriver {
        MicroVmDriver::new(MicroVmConfig {
            run_dir: run_dir.to_path_buf(),
            init_binary: run_dir.join("warren-init"),
            qemu: PathBuf::from("/nonexistent/qemu"),
            kernel: PathBuf::from("/nonexistent/vmlinuz"),
            modules_dir: PathBuf::from("/nonexistent/modules"),
            cgroup_instance: "warren-microvm-unit".into(),
            accel: AccelChoice::Force(Accel::Tcg),
            machine: Machine::Micro,
            snapshots: false,
            qemu_uid_start: None,
        })
        .unwrap()
    }

    /// A running VM whose QEMU is a `sleep` (killed with the driver) and
    /// which has no mux: QMP and the control socket are the test's to serve.
    fn fake_vm(driver: &MicroVmDriver, id: &str) -> SandboxHandle {
        fs::create_dir(driver.dir(id)).unwrap();
        let qemu = QemuProcess::spawned(tokio::process::Command::new("sleep").arg("1000").spawn().unwrap()).unwrap();
        let launch = Launch {
            layer_files: Vec::new(),
            vcpus: 1,
            memory_mib: 128,
            pids: 256,
            open_files: 4096,
            hostname: id.into(),
            name: id.into(),
            accel: Accel::Tcg,
            first_stream: 1,
            netns: None,
            qemu_uid: None,
        };
        driver.running().insert(
            id.into(),
            Running {
                qemu,
                _mux: mux::Mux::detached(),
                paused: false,
                mux_at_resume: false,
                launch,
                console: qemu::ConsoleTail::default(),
            },
        );
        let state = HandleState { dir: driver.dir(id), accel: Accel::Tcg, boot: None };
        SandboxHandle { id: id.into(), backend: Backend::Microvm, state: serde_json::to_value(state).unwrap() }
    }

    #[tokio::test]
    async fn a_pause_that_cannot_reach_qemu_answers_gone() {
        let run_dir = tempfile::tempdir().unwrap();
        let driver = driver(run_dir.path());
        let vm = fake_vm(&driver, "noqmp");
        assert!(matches!(driver.pause(&vm), Err(BackendError::Gone)));
        assert_eq!(driver.seen("noqmp"), Seen::Running { exited: false, paused: false }, "left as it was");
        assert!(matches!(driver.pause_to_disk(&vm), Err(BackendError::Gone)));
        assert!(!driver.dir("noqmp").join(PAUSED_MEM).exists());
    }

    /// QEMU 10 refused 7.2's `-chroot` and exited at once; the boot went on
    /// waiting for a control port nobody would make. The exit ends it.
    #[tokio::test]
    async fn a_qemu_that_exits_before_its_port_exists_ends_the_boot_wait() {
        let run_dir = tempfile::tempdir().unwrap();
        let mut qemu =
            QemuProcess::spawned(tokio::process::Command::new("sh").args(["-c", "exit 3"]).spawn().unwrap()).unwrap();
        let (serial, ctl) = (run_dir.path().join("port.sock"), run_dir.path().join("ctl.sock"));
        let err = wait_ready(&mut qemu, &serial, &ctl, Duration::from_secs(600)).await.err().unwrap();
        assert!(err.to_string().contains("QEMU exited during boot"), "{err}");
    }

    /// Between pings the reaper asks `probe_idle`: a live QEMU is enough
    /// (nothing listens on the control socket here, so a ping would find
    /// the guest silent), and a QEMU that exited is a full probe's death.
    #[tokio::test]
    async fn probe_idle_looks_at_qemu_and_not_into_the_guest() {
        let run_dir = tempfile::tempdir().unwrap();
        let driver = driver(run_dir.path());
        let vm = fake_vm(&driver, "quiet");
        assert_eq!(driver.probe_idle(&vm).await, Liveness::Alive);
        assert_eq!(driver.probe(&vm).await, Liveness::Unresponsive, "the ping finds nobody");
        let mut running = driver.running().remove("quiet").unwrap();
        running.qemu.start_kill();
        running.qemu.wait().await.unwrap();
        driver.running().insert("quiet".into(), running);
        assert_eq!(driver.probe_idle(&vm).await, Liveness::Dead { oom: false });
    }

    /// The CI flake: a probe's ping was in flight when a pause to disk took
    /// the VM out of `running` and dropped its mux; the ping failed, the
    /// probe found the VM in neither map and the node ended the sandbox,
    /// removing its directory (QMP socket included) under the pause.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_probe_whose_ping_a_pause_to_disk_cuts_sees_the_vm_alive() {
        let run_dir = tempfile::tempdir().unwrap();
        let driver = Arc::new(driver(run_dir.path()));
        let vm = fake_vm(&driver, "moving");
        let (pinged, ping_in_flight) = mpsc::channel();
        let (cut_tx, cut) = mpsc::channel::<()>();
        // init's end of the control socket: takes the probe's ping and
        // answers nothing until the pause has begun, then drops it (as the
        // pause's dropped mux does).
        let ctl = UnixListener::bind(driver.ctl_sock("moving")).unwrap();
        let init = std::thread::spawn(move || {
            let (mut conn, _) = ctl.accept().unwrap();
            let mut byte = [0u8; 1];
            conn.read_exact(&mut byte).unwrap();
            pinged.send(()).unwrap();
            // Ends when the sender goes.
            let _ = cut.recv();
        });
        // QEMU's QMP: `stop` (the pause's first command after the mux is
        // gone) ends the ping, then waits for the probe's verdict.
        let (verdict_tx, verdict) = mpsc::channel::<Liveness>();
        let qmp = UnixListener::bind(driver.qmp_sock("moving")).unwrap();
        let qemu = std::thread::spawn(move || {
            let mut cut_tx = Some(cut_tx);
            let mut seen = Vec::new();
            while seen.last().map(String::as_str) != Some("query-migrate") {
                let (conn, _) = qmp.accept().unwrap();
                let mut out = conn.try_clone().unwrap();
                out.write_all(b"{\"QMP\": {}}\n").unwrap();
                for line in BufReader::new(conn).lines() {
                    let request: serde_json::Value = serde_json::from_str(&line.unwrap()).unwrap();
                    let command = request["execute"].as_str().unwrap().to_string();
                    if command == "stop" {
                        drop(cut_tx.take());
                        seen.push(format!("probe: {:?}", verdict.recv().unwrap()));
                    }
                    let answer = match command.as_str() {
                        "query-migrate" => r#"{"return": {"status": "completed"}}"#,
                        _ => r#"{"return": {}}"#,
                    };
                    out.write_all(format!("{answer}\n").as_bytes()).unwrap();
                    seen.push(command);
                    if seen.last().map(String::as_str) == Some("query-migrate") {
                        break;
                    }
                }
            }
            seen
        });
        let probe = tokio::spawn({
            let (driver, vm) = (Arc::clone(&driver), vm.clone());
            async move { driver.probe(&vm).await }
        });
        tokio::task::spawn_blocking(move || ping_in_flight.recv().unwrap()).await.unwrap();
        let pause = tokio::task::spawn_blocking({
            let (driver, vm) = (Arc::clone(&driver), vm.clone());
            move || driver.pause_to_disk(&vm)
        });
        let liveness = probe.await.unwrap();
        verdict_tx.send(liveness).unwrap();
        pause.await.unwrap().unwrap();
        init.join().unwrap();
        let seen = qemu.join().unwrap();
        assert!(seen.contains(&"probe: Alive".to_string()), "{seen:?}");
        assert_eq!(liveness, Liveness::Alive);
        assert_eq!(driver.seen("moving"), Seen::OnDisk);
        assert_eq!(driver.probe(&vm).await, Liveness::Alive, "paused to disk");
    }
}

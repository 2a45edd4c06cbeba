//! PID 1 of a microVM: the kernel runs this binary as `/init` from the
//! initramfs the node built (this binary plus the kernel modules it needs).
//!
//! Boot: mount the kernel filesystems, load the modules (virtio, block,
//! console, EROFS, overlayfs), find the disks by their serials (`wl<i>`
//! for image layer `i`, bottom first, `wrw` for the writable disk), stack
//! them with overlayfs, switch into the overlay with a container's `/dev`
//! and `/proc` masks, install the seccomp profile, start the phase leader
//! (which holds the sandbox to a container's capabilities) and serve the
//! node over the virtio-serial port (see [`warren_init::mux`]).
//!
//! The node passes what init needs on the kernel command line:
//! `warren.layers=<n>`, `warren.hostname=<name>`, `warren.pids=<n>` (the
//! sandbox's pids limit: a guest cgroup for a microVM, the agent unit's
//! `TasksMax` for a full VM), `warren.nofile=<n>` (the sandbox's
//! `open_files`: init's `RLIMIT_NOFILE`, so every process's),
//! `warren.net` (the VM has a network device:
//! load `virtio_net` and configure `eth0` for QEMU's user-mode network,
//! IPv4 and IPv6),
//! `warren.probe` (power
//! off as soon as init runs: the node's check that an accelerator can boot
//! this guest at all), and `warren.systemd` (a full VM: after stacking the
//! root, hand PID 1 to the image's systemd and serve the node from a
//! systemd service instead; see [`systemd`]).
//!
//! A guest restored from a snapshot of a booted one is told its own
//! hostname, fresh entropy and the time by the node (`Identify`, see
//! [`identity`]).
//!
//! On any failure init prints why on the console and powers the VM off; the
//! node sees QEMU exit and reports the console's tail.

mod identity;
mod limits;
mod port;
mod systemd;
mod tamper;

pub use identity::identify;
pub(crate) use limits::counters as limit_counters;
pub use systemd::{service_main, SERVICE_ARG};
pub(crate) use tamper::TamperWatch;

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags};
use rustix::fs::inotify::{CreateFlags, WatchFlags};
use rustix::fs::{Mode, OFlags};
use rustix::mount::{MountFlags, MountPropagationFlags};

use crate::error::{InitError, StepContext};
use crate::events::EventLog;
use crate::leader::{StartError, LANDLOCK_OPTIONAL};
use crate::phase::Phases;
use crate::reaper::Registry;
use crate::{seccomp, serve, sys};
use warren_init::proto::PhaseRules;

/// Where the initramfs keeps the modules and their load order.
const MODULES_DIR: &str = "/modules";
/// How long the devices may take to appear after their drivers loaded.
const DEVICE_WAIT: Duration = Duration::from_secs(20);
/// How often to look for them without a new device node to wake on (a
/// sysfs attribute such as the port's name can lag its node).
const DEVICE_POLL: Duration = Duration::from_millis(20);
/// [`DEVICE_POLL`] as `poll` takes it.
const DEVICE_POLL_TS: rustix::time::Timespec = rustix::time::Timespec { tv_sec: 0, tv_nsec: 20_000_000 };
const NEW_ROOT: &str = "/newroot";
/// Serial of the writable disk; layer `i`'s is `wl<i>`.
const RW_SERIAL: &str = "wrw";

/// What the kernel command line says.
struct BootArgs {
    layers: usize,
    hostname: String,
    probe: bool,
    systemd: bool,
    /// `warren.boottrace`: print each boot step's time on the console (how
    /// the boot's split in `bench/results/` was measured).
    trace: bool,
    /// `warren.pids=N`: the sandbox's pids limit (see [`limit_pids`]).
    pids: Option<u32>,
    /// `warren.nofile=N`: the sandbox's `open_files`, `RLIMIT_NOFILE` of
    /// init and so of every process (as in a container).
    open_files: Option<u64>,
    /// `warren.net`: the VM has a network device (an `allowlist` sandbox;
    /// see [`configure_network`]).
    net: bool,
}

/// Set once this process is a microVM's PID 1: only then is
/// `/proc/vmstat` this sandbox's own.
static IN_VM: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The guest kernel's count of OOM kills; `None` outside a microVM (a
/// container's `/proc/vmstat` is the host's: there the node reads the
/// sandbox's cgroup instead).
pub fn oom_kills() -> Option<u64> {
    if !IN_VM.load(std::sync::atomic::Ordering::Relaxed) {
        return None;
    }
    let vmstat = std::fs::read_to_string("/proc/vmstat").ok()?;
    warren_guard::cgroup::counter(&vmstat, "oom_kill")
}

/// The VM's PID 1. Never returns.
pub fn run() -> ! {
    IN_VM.store(true, std::sync::atomic::Ordering::Relaxed);
    match boot() {
        Ok(Booted::Probe) => power_off(),
        Ok(Booted::Systemd) => {
            let e = systemd::exec_systemd();
            eprintln!("warren-init: {e}");
            power_off()
        }
        Ok(Booted::Serving { shared, port }) => port::serve(port, shared),
        Err(e) => {
            eprintln!("warren-init: {e}");
            power_off()
        }
    }
}

enum Booted {
    Probe,
    /// The root is `/`, ready for the image's systemd.
    Systemd,
    Serving {
        shared: Arc<serve::Shared>,
        port: OwnedFd,
    },
}

fn boot() -> Result<Booted, InitError> {
    mount_kernel_fs("")?;
    let args = boot_args()?;
    if args.probe {
        return Ok(Booted::Probe);
    }
    let trace = |step: &str| {
        if args.trace {
            let now = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
            eprintln!("warren-init: [{:>5}.{:06}] {step}", now.tv_sec, now.tv_nsec / 1000);
        }
    };
    trace("init runs");
    load_modules("order", &trace)?;
    if args.net {
        // Before the device exists: it takes these as its own settings.
        static_ipv6_only()?;
        load_modules("net-order", &trace)?;
        configure_network()?;
    }
    trace("modules loaded");
    let devices = wait_for_devices(args.layers)?;
    trace("devices found");
    stack_root(&devices, &trace)?;
    trace("root stacked");
    if args.systemd {
        systemd::install(Path::new(NEW_ROOT), args.pids, args.open_files)?;
        switch_root(GuestDev::Whole)?;
        return Ok(Booted::Systemd);
    }
    // Taken while the initramfs is still `/`: leaders and session commands
    // exec this very binary through the descriptor.
    let self_exe =
        rustix::fs::open("/init", OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty()).step(|| "open /init".into())?;
    let self_exe = settle_fds(self_exe)?;
    // After `settle_fds`, which takes fds 3 to 5, and while `/rw` is in reach.
    crate::pack::keep_upper_at(c"/rw/upper");
    if let Some(max) = args.pids {
        limit_pids(max)?;
    }
    if let Some(n) = args.open_files {
        // Soft and hard alike: without `CAP_SYS_RESOURCE` (see `leader`)
        // no process of the sandbox can raise it again.
        let limit = rustix::process::Rlimit { current: Some(n), maximum: Some(n) };
        rustix::process::setrlimit(rustix::process::Resource::Nofile, limit)
            .step(|| format!("set RLIMIT_NOFILE to {n}"))?;
    }
    // While the kernel's whole /dev is in reach: the new root's has only
    // a container's devices.
    let port = open_port(&devices.port)?;
    switch_root(GuestDev::ContainerSet)?;
    trace("switch_root");
    close_kernel_doors()?;
    crate::rootfs::protect_kernel_files(Path::new("/"))?;
    crate::leader::SEAL_CAPABILITIES.store(true, std::sync::atomic::Ordering::Relaxed);
    // The sandbox's processes are root like init: only this keeps them
    // out of init's `/proc/1/fd` and memory (as `seal` does in a container).
    rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable)
        .step(|| "prctl(PR_SET_DUMPABLE, 0)".into())?;
    // And they see in `/proc` only the processes ptrace's rules would let
    // them read: each other, not init or the phase leaders (which hold
    // capabilities they lack). In a container init is as far out of
    // reach, in a user namespace above theirs.
    rustix::mount::mount_remount(
        "/proc",
        MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC,
        c"hidepid=ptraceable",
    )
    .step(|| "remount /proc with hidepid=ptraceable".into())?;
    rustix::system::sethostname(args.hostname.as_bytes()).step(|| "sethostname".into())?;
    sys::bring_loopback_up().step(|| "bring up lo".into())?;
    // Before the filter: the one thread that may rename the guest and set
    // its clock once it is a clone of a snapshot.
    identity::start().step(|| "start the identity thread".into())?;
    trace("root switched");
    let shared = start_serving(self_exe, &trace)?;
    trace("serving");
    Ok(Booted::Serving { shared, port })
}

fn open_port(port: &Path) -> Result<OwnedFd, InitError> {
    rustix::fs::open(port, OFlags::RDWR | OFlags::CLOEXEC | OFlags::NOCTTY, Mode::empty())
        .step(|| format!("open {}", port.display()))
}

/// The tamper watch and the seccomp profile on this (single-threaded)
/// process, then the reaper and the first phase's leader: what serving the
/// node needs, as PID 1 of a microVM or as a full VM's service.
fn start_serving(self_exe: OwnedFd, trace: &dyn Fn(&str)) -> Result<Arc<serve::Shared>, InitError> {
    let events = Arc::new(EventLog::new(crate::events::CAPACITY));
    // Before the filter, which refuses fanotify to the whole sandbox.
    let tamper = tamper::TamperWatch::start(Arc::clone(&events));
    seccomp::start(&events)?;
    trace("seccomp");
    LANDLOCK_OPTIONAL.store(true, std::sync::atomic::Ordering::Relaxed);
    let registry = Registry::start().step(|| "start the reaper".into())?;
    trace("reaper");
    let phases = Phases::start(registry, self_exe, PhaseRules::default()).map_err(|e| match e {
        StartError::Rejected(message) => InitError::PhaseRejected(message),
        StartError::Io(e) => InitError::Sys { step: "start the phase leader".into(), source: e },
    })?;
    Ok(serve::Shared::new(Arc::new(phases), events, tamper))
}

fn mount_kernel_fs(root: &str) -> Result<(), InitError> {
    for (fstype, target, flags) in [
        ("devtmpfs", "/dev", MountFlags::NOSUID),
        ("proc", "/proc", MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC),
        ("sysfs", "/sys", MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC),
    ] {
        let target = format!("{root}{target}");
        mkdir_all(Path::new(&target))?;
        rustix::mount::mount(fstype, target.as_str(), fstype, flags, None)
            .step(|| format!("mount {fstype} on {target}"))?;
    }
    Ok(())
}

fn boot_args() -> Result<BootArgs, InitError> {
    let cmdline = std::fs::read_to_string("/proc/cmdline").step(|| "read /proc/cmdline".into())?;
    let mut args = BootArgs {
        layers: 0,
        hostname: "sandbox".into(),
        probe: false,
        systemd: false,
        trace: false,
        pids: None,
        open_files: None,
        net: false,
    };
    for word in cmdline.split_ascii_whitespace() {
        if let Some(n) = word.strip_prefix("warren.layers=") {
            args.layers = n.parse().map_err(|_| InitError::Refused(format!("bad {word}")))?;
        } else if let Some(name) = word.strip_prefix("warren.hostname=") {
            args.hostname = name.to_string();
        } else if word == "warren.probe" {
            args.probe = true;
        } else if word == "warren.systemd" {
            args.systemd = true;
        } else if word == "warren.net" {
            args.net = true;
        } else if word == "warren.boottrace" {
            args.trace = true;
        } else if let Some(n) = word.strip_prefix("warren.pids=") {
            args.pids = Some(n.parse().map_err(|_| InitError::Refused(format!("bad {word}")))?);
        } else if let Some(n) = word.strip_prefix("warren.nofile=") {
            args.open_files = Some(n.parse().map_err(|_| InitError::Refused(format!("bad {word}")))?);
        }
    }
    if args.layers == 0 && !args.probe {
        return Err(InitError::Refused("no warren.layers on the kernel command line".into()));
    }
    Ok(args)
}

/// Loads the modules in the order the node wrote to `/modules/<list>`.
fn load_modules(list: &str, trace: &dyn Fn(&str)) -> Result<(), InitError> {
    let order = std::fs::read_to_string(format!("{MODULES_DIR}/{list}")).step(|| format!("read {list}"))?;
    for name in order.lines().filter(|l| !l.is_empty()) {
        let path = format!("{MODULES_DIR}/{name}.ko");
        let file = rustix::fs::open(path.as_str(), OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())
            .step(|| format!("open {path}"))?;
        match rustix::system::finit_module(&file, c"", 0) {
            Ok(()) | Err(rustix::io::Errno::EXIST) => {}
            Err(e) => return Err(e).step(|| format!("load module {name}")),
        }
        trace(name);
    }
    Ok(())
}

/// The guest's side of QEMU's user-mode network (slirp's defaults): the
/// guest's address, its network's prefix length, and the gateway through
/// which QEMU's own sockets reach what the sandbox's policy allows.
const GUEST_ADDR: std::net::Ipv4Addr = std::net::Ipv4Addr::new(10, 0, 2, 15);
const GUEST_PREFIX: u8 = 24;
const GUEST_GATEWAY: std::net::Ipv4Addr = std::net::Ipv4Addr::new(10, 0, 2, 2);
/// The same in IPv6 (`fec0::/64`, see the driver's `GUEST_NET6`).
const GUEST_ADDR6: std::net::Ipv6Addr = std::net::Ipv6Addr::new(0xfec0, 0, 0, 0, 0, 0, 0, 0x15);
const GUEST_PREFIX6: u8 = 64;
const GUEST_GATEWAY6: std::net::Ipv6Addr = std::net::Ipv6Addr::new(0xfec0, 0, 0, 0, 0, 0, 0, 2);
/// The IPv6 settings every new network device starts with: no duplicate
/// address detection (the address would stay unusable for a second, and
/// slirp is the only other host on the link) and no address or route from
/// router advertisements (slirp sends them; the guest's address and route
/// are the fixed ones above).
const IPV6_DEVICE_DEFAULTS: &[(&str, &str)] = &[("accept_dad", "0"), ("accept_ra", "0"), ("autoconf", "0")];

fn static_ipv6_only() -> Result<(), InitError> {
    for (key, value) in IPV6_DEVICE_DEFAULTS {
        let path = format!("/proc/sys/net/ipv6/conf/default/{key}");
        std::fs::write(&path, value).step(|| format!("write {path}"))?;
    }
    Ok(())
}

/// Gives `eth0` (the only network device) the guest's address and a
/// default route. Its driver binds the device as the module loads; a
/// device still on its way gets [`DEVICE_WAIT`].
fn configure_network() -> Result<(), InitError> {
    let started = Instant::now();
    loop {
        match sys::configure_ipv4("eth0", GUEST_ADDR, GUEST_PREFIX, GUEST_GATEWAY) {
            Ok(()) => {
                return sys::configure_ipv6("eth0", GUEST_ADDR6, GUEST_PREFIX6, GUEST_GATEWAY6)
                    .step(|| "configure eth0 (IPv6)".into())
            }
            Err(e) if e.raw_os_error() == Some(libc::ENODEV) && started.elapsed() < DEVICE_WAIT => {
                std::thread::sleep(DEVICE_POLL)
            }
            Err(e) => return Err(e).step(|| "configure eth0".into()),
        }
    }
}

/// The block devices and the control port, by what the node named them.
struct Devices {
    layers: Vec<PathBuf>,
    rw: PathBuf,
    port: PathBuf,
}

fn wait_for_devices(layers: usize) -> Result<Devices, InitError> {
    let started = Instant::now();
    // devtmpfs makes each node as its device appears: look again as soon as
    // one does, not at the next tick (a missing watch leaves the tick).
    let watch = rustix::fs::inotify::init(CreateFlags::CLOEXEC | CreateFlags::NONBLOCK)
        .and_then(|fd| rustix::fs::inotify::add_watch(&fd, "/dev", WatchFlags::CREATE).map(|_| fd))
        .ok();
    loop {
        if let Some(found) = find_devices(layers) {
            return Ok(found);
        }
        if started.elapsed() > DEVICE_WAIT {
            return Err(InitError::Refused(format!(
                "the disks ({layers} layers + writable) and the control port did not appear within {DEVICE_WAIT:?}"
            )));
        }
        match &watch {
            Some(fd) => {
                let _ = rustix::event::poll(&mut [PollFd::new(fd, PollFlags::IN)], Some(&DEVICE_POLL_TS));
                let mut events = [0u8; 1024];
                while matches!(rustix::io::read(fd, &mut events), Ok(n) if n > 0) {}
            }
            None => std::thread::sleep(DEVICE_POLL),
        }
    }
}

fn find_devices(layers: usize) -> Option<Devices> {
    let mut by_serial = std::collections::HashMap::new();
    for entry in std::fs::read_dir("/sys/block").ok()?.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Ok(serial) = std::fs::read_to_string(entry.path().join("serial")) {
            by_serial.insert(serial.trim().to_string(), PathBuf::from(format!("/dev/{name}")));
        }
    }
    let layers = (0..layers).map(|i| by_serial.get(&format!("wl{i}")).cloned()).collect::<Option<Vec<_>>>()?;
    let rw = by_serial.get(RW_SERIAL)?.clone();
    let port = find_port()?;
    let all_there = layers.iter().chain([&rw]).all(|d| d.exists());
    all_there.then_some(Devices { layers, rw, port })
}

/// The node's virtio-serial port, once its device node exists.
fn find_port() -> Option<PathBuf> {
    let mut port = None;
    for entry in std::fs::read_dir("/sys/class/virtio-ports").ok()?.flatten() {
        let name = std::fs::read_to_string(entry.path().join("name")).unwrap_or_default();
        if name.trim() == warren_init::mux::PORT_NAME {
            port = Some(PathBuf::from(format!("/dev/{}", entry.file_name().to_string_lossy())));
        }
    }
    port.filter(|p| p.exists())
}

/// Layers read-only (EROFS), the writable disk (ext4, made by the node),
/// and the overlay of them at [`NEW_ROOT`].
fn stack_root(devices: &Devices, trace: &dyn Fn(&str)) -> Result<(), InitError> {
    let mut lower = Vec::with_capacity(devices.layers.len());
    for (i, disk) in devices.layers.iter().enumerate() {
        let target = format!("/layers/{i}");
        mkdir_all(Path::new(&target))?;
        rustix::mount::mount(disk, target.as_str(), "erofs", MountFlags::RDONLY, None)
            .step(|| format!("mount layer {i} ({}) as erofs", disk.display()))?;
        lower.push(target);
    }
    trace("layers mounted");
    mkdir_all(Path::new("/rw"))?;
    // The node's mkfs leaves the inode tables unwritten on a sparse file:
    // they read as zeros already, and zeroing them again (ext4lazyinit)
    // would take the guest's one vCPU and the disk while the sandbox boots
    // and runs its first commands.
    rustix::mount::mount(&devices.rw, "/rw", "ext4", MountFlags::NOATIME, Some(c"noinit_itable"))
        .step(|| format!("mount the writable disk {}", devices.rw.display()))?;
    trace("writable disk mounted");
    for dir in ["/rw/upper", "/rw/work", NEW_ROOT] {
        mkdir_all(Path::new(dir))?;
    }
    // overlayfs lists the top layer first.
    lower.reverse();
    let options = std::ffi::CString::new(format!("lowerdir={},upperdir=/rw/upper,workdir=/rw/work", lower.join(":")))
        .map_err(|_| InitError::Refused("a layer path holds a NUL byte".into()))?;
    rustix::mount::mount("overlay", NEW_ROOT, "overlay", MountFlags::empty(), Some(options.as_c_str()))
        .step(|| "mount the overlay root".into())
}

/// Holds this process (PID 1) and everything it will ever start - threads
/// included, as a container's pids cgroup does - to `max` tasks: a cgroup2
/// hierarchy mounted in the initramfs's tree, which the sandbox never sees
/// after [`switch_root`] (and, under the seccomp profile, cannot mount
/// itself), with one child that PID 1 moves into. The kernel's threads stay
/// in the root.
fn limit_pids(max: u32) -> Result<(), InitError> {
    mkdir_all(Path::new(CGROUP_DIR))?;
    rustix::mount::mount(
        "cgroup2",
        CGROUP_DIR,
        "cgroup2",
        MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC,
        None,
    )
    .step(|| format!("mount cgroup2 on {CGROUP_DIR}"))?;
    let write = |file: &str, value: String| {
        std::fs::write(format!("{CGROUP_DIR}/{file}"), value).step(|| format!("write {CGROUP_DIR}/{file}"))
    };
    write("cgroup.subtree_control", "+pids".into())?;
    mkdir_all(Path::new(&format!("{CGROUP_DIR}/sandbox")))?;
    write("sandbox/pids.max", max.to_string())?;
    write("sandbox/cgroup.procs", std::process::id().to_string())?;
    limits::keep_pids_cgroup(&format!("{CGROUP_DIR}/sandbox"));
    Ok(())
}

/// Where a microVM's init mounts the guest's cgroup2 hierarchy.
const CGROUP_DIR: &str = "/cg";

/// Keeps fds 3 and 4 taken for good (session commands overwrite them in
/// the child, as in a container) and puts this binary at 5.
fn settle_fds(self_exe: OwnedFd) -> Result<OwnedFd, InitError> {
    use std::os::fd::{AsRawFd, IntoRawFd};
    // First, so that filling 3 and 4 cannot land on it.
    let self_exe = sys::move_fd(self_exe, crate::pid1::SELF_EXE_FD).step(|| "move /init's descriptor".into())?;
    for fd in [3, 4] {
        let null = rustix::fs::open("/dev/null", OFlags::RDWR | OFlags::CLOEXEC, Mode::empty())
            .step(|| "open /dev/null".into())?;
        let held =
            if null.as_raw_fd() == fd { null } else { sys::move_fd(null, fd).step(|| format!("hold fd {fd}"))? };
        let _kept_forever = held.into_raw_fd();
    }
    Ok(self_exe)
}

/// What the new root's `/dev` is.
#[derive(Clone, Copy, PartialEq)]
enum GuestDev {
    /// The kernel's `devtmpfs`, every device of the guest: what the image's
    /// systemd (a full VM) expects to manage.
    Whole,
    /// A container's `/dev` (`rootfs::mount_dev`): `null`, `zero`, `full`,
    /// `random`, `urandom`, `tty`, `pts`, `shm`. The guest's other devices
    /// stay behind in the initramfs, out of reach: no `mem`, `kmsg`,
    /// `userfaultfd` (a door around the profile's refusal of the system
    /// call), `snapshot`, the disks' raw bytes or the control port.
    ContainerSet,
}

/// Moves the kernel filesystems into the overlay and makes it `/` (the
/// initramfs cannot be `pivot_root`ed away: move and chroot, as
/// `switch_root` does).
fn switch_root(dev: GuestDev) -> Result<(), InitError> {
    let moved: &[&str] = match dev {
        GuestDev::Whole => &["/dev", "/proc", "/sys"],
        GuestDev::ContainerSet => &["/proc", "/sys"],
    };
    for dir in moved {
        let target = format!("{NEW_ROOT}{dir}");
        mkdir_all(Path::new(&target))?;
        rustix::mount::mount_move(*dir, target.as_str()).step(|| format!("move {dir} into the new root"))?;
    }
    if dev == GuestDev::ContainerSet {
        // Binds the devices from the initramfs's `/dev`, still `/dev` here.
        crate::rootfs::mount_dev(Path::new(NEW_ROOT))?;
    }
    rustix::process::chdir(NEW_ROOT).step(|| "chdir to the new root".into())?;
    rustix::mount::mount_move(".", "/").step(|| "move the new root onto /".into())?;
    rustix::process::chroot(".").step(|| "chroot into the new root".into())?;
    rustix::process::chdir("/").step(|| "chdir /".into())?;
    rustix::mount::mount_change("/", MountPropagationFlags::PRIVATE | MountPropagationFlags::REC)
        .step(|| "make mounts private".into())
}

/// Takes from the guest's root what would let a process that holds
/// root's file access - but not its capabilities, as every process of the
/// sandbox (see `leader`) - get around Landlock or the profile: the
/// kernel's module loader (it runs `/sbin/modprobe` of the image as full
/// root, outside every domain, when a socket of an unknown family is asked
/// for) and writes to `/sys` (`/proc/sys`, where `core_pattern` names a
/// program the kernel runs the same way, is read-only by the profile's
/// `READ_ONLY_PATHS`, made after this). The disks' nodes (their raw bytes
/// hold every protected file) were left behind with the kernel's `/dev`.
/// The seccomp profile keeps the sandbox from mounting anything back.
fn close_kernel_doors() -> Result<(), InitError> {
    std::fs::write("/proc/sys/kernel/modprobe", "\n").step(|| "clear kernel.modprobe".into())?;
    std::fs::write("/proc/sys/kernel/modules_disabled", "1").step(|| "set kernel.modules_disabled".into())?;
    crate::rootfs::remount_read_only(Path::new("/sys"))
}

fn mkdir_all(path: &Path) -> Result<(), InitError> {
    std::fs::create_dir_all(path).step(|| format!("mkdir {}", path.display()))
}

fn power_off() -> ! {
    // SAFETY: `sync` takes no arguments and cannot fail.
    unsafe { libc::sync() };
    let _ = rustix::system::reboot(rustix::system::RebootCommand::PowerOff);
    // Only reached if the kernel refused: PID 1 exiting panics the kernel,
    // and `panic=-1` with `-no-reboot` ends QEMU just the same.
    sys::exit_now(1)
}

//! QEMU's command line for one microVM or full VM, the accelerator probe,
//! and the console's bounded tail.
//!
//! The machine is `-M microvm` with virtio-mmio devices only, or for a full
//! VM `-M q35` with the same devices on PCI ([`Machine`]): one
//! virtio-serial port for the node (`warren.ctl`), one virtio-blk disk per
//! layer (read-only, serial `wl<i>`) and the writable disk (serial `wrw`).
//! QEMU opens the kernel, the initramfs and the disks, then confines itself:
//! `-chroot` into an empty directory and `-runas` a host uid of its own
//! sandbox (`nobody` for the probe and snapshot templates; so it holds no
//! host path and no capability, and can signal no other sandbox's QEMU),
//! under its own seccomp filter (`-sandbox on`, denying obsolete calls,
//! spawning and resource control). Its filter
//! must allow the `setuid` of `-runas` itself (QEMU installs the filter
//! first); after it no capability is left to regain root with. There is no
//! network device and no shared host directory.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::process::{Child, Command};

use crate::container::state::ProcessId;
use crate::{BackendError, Result};

/// Bytes of console output kept (what a failed boot printed last).
const CONSOLE_TAIL_BYTES: usize = 16 << 10;
/// QEMU serves its console's socket before the guest runs; a QEMU that
/// has not within this never will.
const CONSOLE_CONNECT_WAIT: Duration = Duration::from_secs(10);
/// How long a guest may take to power itself off under KVM in the probe;
/// under a KVM that cannot run it the guest never gets there.
const PROBE_TIMEOUT: Duration = Duration::from_secs(6);
/// TCG's translation cache: QEMU's default (1 GiB) would dwarf a small
/// guest's memory.
const TCG_TB_MIB: u32 = 64;

/// How the guest's CPU runs (the API's type: it is reported as is).
pub use warren_api::Accelerator as Accel;

/// Which machine QEMU emulates; everything else (disks, port, kernel,
/// confinement) is the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Machine {
    /// `-M microvm`: virtio-mmio devices, `warren-init` stays PID 1.
    Micro,
    /// `-M q35`: PCI virtio devices, firmware, ACPI; the guest's init
    /// hands PID 1 to the image's systemd and comes back as its service
    /// (`warren.systemd` on the kernel command line).
    Q35,
}

impl Machine {
    fn qemu_machine(self) -> &'static str {
        match self {
            Machine::Micro => "microvm,pit=off,pic=off,rtc=on,isa-serial=on",
            // The legacy PIT and PIC stay for the firmware (SeaBIOS); the
            // guest kernel is told the TSC's rate, so it does not calibrate
            // on them.
            Machine::Q35 => "q35,sata=off,smbus=off,usb=off,vmport=off,i8042=off",
        }
    }

    fn device(self, kind: &str) -> String {
        match self {
            Machine::Micro => format!("{kind}-device"),
            Machine::Q35 => format!("{kind}-pci"),
        }
    }
}

/// What the operator asked for (`WARREN_MICROVM_ACCEL`): probe, or force one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AccelChoice {
    Auto,
    Force(Accel),
}

/// Everything one QEMU process is started with.
pub struct VmSpec<'a> {
    pub qemu: &'a Path,
    pub kernel: &'a Path,
    pub initramfs: &'a Path,
    pub accel: Accel,
    pub machine: Machine,
    pub vcpus: u32,
    pub memory_mib: u64,
    /// The guest's init holds every process it starts to this many
    /// (`warren.pids=` on the kernel command line).
    pub pids: u32,
    /// `RLIMIT_NOFILE` of the guest's init and so of every process it
    /// starts (`warren.nofile=`; 0: the guest kernel's default).
    pub open_files: u32,
    pub layers: &'a [PathBuf],
    pub writable: &'a Path,
    pub serial_sock: &'a Path,
    /// Where QEMU serves QMP (pause and resume).
    pub qmp_sock: &'a Path,
    pub hostname: &'a str,
    /// An empty directory QEMU chroots into once it has opened its files.
    pub jail: &'a Path,
    /// A migration stream to load instead of booting (`-incoming fd:3`):
    /// the guest's memory and devices from a snapshot. Everything else
    /// must match what the snapshot's QEMU was started with.
    pub incoming: Option<&'a std::fs::File>,
    /// The network namespace QEMU runs in when the sandbox has an
    /// `allowlist` network: QEMU's user-mode network (slirp) turns the
    /// guest's connections into QEMU's own sockets there, which the node's
    /// veth, NAT and egress programs (on the sandbox's cgroup, QEMU's)
    /// handle as they do a container's. `None`: no network device.
    pub netns: Option<BorrowedFd<'a>>,
    /// Hand QEMU the writable disk as descriptors (`-add-fd`, one
    /// read-write and one read-only, `file=/dev/fdset/1`) instead of a
    /// path. A migration's source drops its write access at the end and
    /// its destination takes it at the start, and QEMU reopens the file to
    /// do so: by path that fails in its chroot, from the fd set it works.
    pub writable_by_fd: bool,
    /// The host uid (and gid) QEMU drops to; `None`: `nobody`.
    pub qemu_uid: Option<u32>,
}

/// The guest's side of QEMU's user-mode network: slirp's defaults, which
/// the guest's init assumes (address `.15`, gateway `.2`; in IPv6 `::15`
/// and `::2`). slirp's IPv6 default is the old site-local prefix, which no
/// destination a policy could name lives in.
pub const GUEST_NET: &str = "10.0.2.0/24";
pub const GUEST_NET6: &str = "fec0::/64";

/// The descriptor QEMU reads an incoming migration stream from.
const INCOMING_FD: i32 = 3;
/// The writable disk's read-write and read-only descriptors in fd set 1.
const WRITABLE_RW_FD: i32 = 4;
const WRITABLE_RO_FD: i32 = 5;
/// Descriptors to hand over are moved at least this high first, so that
/// putting one at its target never overwrites another still to be moved.
const HANDOVER_MIN_FD: i32 = 16;

/// Kernel arguments every boot shares. An NMI from the host (QMP
/// `inject-nmi`) panics the guest, the operator's way to take a hung guest
/// down with its backtrace on the console (and the sandbox's end message):
/// `microvm` has no port 0x61, whose 0xff the guest reads as a PCI system
/// error (`panic_on_unrecovered_nmi`), and `unknown_nmi_panic` is for a
/// machine that has one. Under TCG the guest's TSC is the
/// host's, and calibrating it against emulated timers either fails (no
/// PIT) or, with the legacy PIT and PIC on, livelocks on timer interrupts
/// when the host is busy: the guest is told the host's TSC rate instead,
/// and the machine has no legacy PIT or PIC (the RTC stays: it sets the
/// guest's clock).
fn base_append() -> String {
    let khz = host_tsc_khz();
    // loops_per_jiffy at HZ=250; only udelay before the TSC takes over uses it.
    // Traced boots keep the kernel's messages: a boot that hangs shows
    // where in the console the node reports.
    let trace = if boot_trace() { " warren.boottrace" } else { " quiet" };
    format!("console=ttyS0{trace} panic=-1 unknown_nmi_panic sysctl.kernel.panic_on_unrecovered_nmi=1 tsc=reliable no_timer_check tsc_early_khz={khz} lpj={} {GUEST_KERNEL_TRIM}", khz * 4)
}

/// What a Debian cloud kernel does at boot that no Warren guest uses,
/// skipped: under TCG it was a third of the kernel's boot (2.1 of 2.3 s
/// to a trivial init's power-off without it, 1.5 s with it; see
/// `bench/results/`). The crypto API's self-tests of every algorithm
/// (`cryptomgr.notests`: ~550 ms; the guest's kernel crypto is ext4's
/// `crc32c`), and initcalls whose work only matters to what a guest never
/// does: the system keyring's certificates (its modules are unsigned, see
/// `initramfs`), the jitter entropy source (only the crypto API's
/// DRBG draws on it; the kernel's CRNG does not), the BPF kfunc and struct-ops
/// sets that parse the kernel's BTF (the sandbox's seccomp profile refuses
/// `bpf`), encrypted and OPAL keys, TPMs; one serial port of four, and no
/// audit daemon to feed.
const GUEST_KERNEL_TRIM: &str = "cryptomgr.notests 8250.nr_uarts=1 audit=0 initcall_blacklist=load_system_certificate_list,jent_mod_init,bpf_tcp_ca_kfunc_init,bpf_dummy_struct_ops_init,bpf_sockmap_iter_init,crypto_kdf108_init,init_encrypted,sed_opal_init,tpm_init";

/// `WARREN_VM_BOOTTRACE=1`: guests print their boot steps' times, their
/// kernel is not `quiet`, and the console's tail stamps each chunk with the
/// host's milliseconds since QEMU started (what the boot split in
/// `bench/results/` comes from; the test servers set it).
pub fn boot_trace() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("WARREN_VM_BOOTTRACE").is_some_and(|v| v == "1"))
}

/// The host's TSC rate, measured once against the monotonic clock.
fn host_tsc_khz() -> u64 {
    static KHZ: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *KHZ.get_or_init(|| {
        let read = || {
            // SAFETY: RDTSC reads a counter; every x86-64 CPU has it and it
            // touches no memory.
            unsafe { std::arch::x86_64::_rdtsc() }
        };
        let (t0, c0) = (std::time::Instant::now(), read());
        std::thread::sleep(Duration::from_millis(50));
        let (elapsed, cycles) = (t0.elapsed(), read().wrapping_sub(c0));
        let khz = cycles as u128 * 1_000_000 / elapsed.as_nanos().max(1);
        u64::try_from(khz).unwrap_or(2_000_000).clamp(100_000, 10_000_000)
    })
}

/// The CPU a TCG guest sees: everything QEMU emulates but `cmpxchg16b`.
/// Debian's 6.12 kernel takes slab objects with `cmpxchg16b` on a per-CPU
/// (`%gs`-relative) address, and QEMU 7.2's translation of that sometimes
/// corrupts the guest (a double fault in `kmem_cache_alloc` in 6 of 16
/// boots here, none in 16 without it); without the instruction the kernel
/// uses its other path.
const TCG_CPU: &str = "max,cx16=off";

/// What every QEMU of the driver is started with.
struct MachineArgs<'a> {
    machine: Machine,
    accel: Accel,
    memory_mib: u64,
    vcpus: u32,
    jail: &'a Path,
    qemu_uid: Option<u32>,
}

/// The user QEMU drops to: `uid:gid` (QEMU 7.1 and later), or `nobody`.
fn runas(qemu_uid: Option<u32>) -> String {
    qemu_uid.map_or_else(|| "nobody".to_string(), |uid| format!("{uid}:{uid}"))
}

/// How a QEMU is told to chroot and drop its user once it has opened its
/// files: `-chroot DIR -runas USER` until QEMU 9.0 (both gone in 10.0),
/// `-run-with chroot=DIR,user=USER` from 9.1 (when `-run-with` took
/// `user=`). Debian 12 ships 7.2, its backports 10.0.
fn jail_args(cmd: &mut Command, jail: &Path, qemu_uid: Option<u32>) {
    if qemu_version(cmd.as_std().get_program()) >= (9, 1) {
        let mut run_with = std::ffi::OsString::from("chroot=");
        // `-run-with` is a comma-separated option list: a comma in the path doubles.
        run_with.push(jail.as_os_str().to_string_lossy().replace(',', ",,"));
        run_with.push(format!(",user={}", runas(qemu_uid)));
        cmd.arg("-run-with").arg(run_with);
    } else {
        cmd.arg("-chroot").arg(jail).args(["-runas", &runas(qemu_uid)]);
    }
}

/// `(major, minor)` of the QEMU at `program`, read once per program from
/// `-version` ("QEMU emulator version 10.0.2 (...)"); `(0, 0)` when it
/// cannot be read (the older flags, which then fail with QEMU's own error).
fn qemu_version(program: &std::ffi::OsStr) -> (u32, u32) {
    static SEEN: std::sync::Mutex<Vec<(std::ffi::OsString, (u32, u32))>> = std::sync::Mutex::new(Vec::new());
    let mut seen = SEEN.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some((_, v)) = seen.iter().find(|(p, _)| p == program) {
        return *v;
    }
    let output = std::process::Command::new(program).arg("-version").stdin(Stdio::null()).output();
    let version = output.map_or((0, 0), |o| parse_qemu_version(&String::from_utf8_lossy(&o.stdout)));
    seen.push((program.to_os_string(), version));
    version
}

fn parse_qemu_version(banner: &str) -> (u32, u32) {
    let Some(rest) = banner.split("version ").nth(1) else { return (0, 0) };
    let mut numbers = rest.split(|c: char| !c.is_ascii_digit()).map(|n| n.parse().unwrap_or(0));
    (numbers.next().unwrap_or(0), numbers.next().unwrap_or(0))
}

fn machine_args(cmd: &mut Command, spec: MachineArgs<'_>) {
    let MachineArgs { machine, accel: qemu_accel, memory_mib, vcpus, jail, qemu_uid } = spec;
    let accel = match qemu_accel {
        Accel::Kvm => "kvm".to_string(),
        Accel::Tcg => format!("tcg,tb-size={TCG_TB_MIB}"),
    };
    cmd.args(["-M", machine.qemu_machine(), "-accel", &accel])
        .args(["-cpu", if qemu_accel == Accel::Kvm { "host" } else { TCG_CPU }])
        .args(["-m", &memory_mib.to_string(), "-smp", &vcpus.to_string()])
        .args(["-nodefaults", "-no-user-config", "-display", "none", "-no-reboot"])
        .args(["-sandbox", "on,obsolete=deny,elevateprivileges=allow,spawn=deny,resourcecontrol=deny"]);
    jail_args(cmd, jail, qemu_uid);
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        // A sandbox's QEMU outlives the node process (a restarted node
        // adopts it); `QemuProcess` kills it when dropped before that.
        .kill_on_drop(false)
        // Not in the node's process group: a terminal's Ctrl-C meant for
        // the node must not end the guests.
        .process_group(0);
}

/// The guest's serial console: a socket beside the control port, which
/// QEMU serves and drops output on while nobody reads it, so a guest's
/// console never waits for the node (nor fails when a node went away).
pub fn console_sock(serial_sock: &Path) -> PathBuf {
    serial_sock.with_file_name("console.sock")
}

/// Starts QEMU for `spec`, and the tail of its console and error output.
/// The process is killed when dropped until
/// [`QemuProcess::keep_running_on_drop`].
pub fn spawn(spec: &VmSpec<'_>) -> Result<(QemuProcess, ConsoleTail)> {
    let mut cmd = Command::new(spec.qemu);
    let args = MachineArgs {
        machine: spec.machine,
        accel: spec.accel,
        memory_mib: spec.memory_mib,
        vcpus: spec.vcpus,
        jail: spec.jail,
        qemu_uid: spec.qemu_uid,
    };
    machine_args(&mut cmd, args);
    let console = console_sock(spec.serial_sock);
    let _ = std::fs::remove_file(&console);
    // QEMU binds its sockets by name before it chroots: started in their
    // directory, it is given their bare names, which fit `sun_path` however
    // deep the data directory is (see `unix_sock`).
    let sock_dir = spec.serial_sock.parent().unwrap_or(Path::new("/"));
    cmd.current_dir(sock_dir);
    let sock_name = |sock: &Path| match sock.strip_prefix(sock_dir) {
        Ok(name) => drive_path(name),
        Err(_) => drive_path(sock),
    };
    cmd.arg("-chardev")
        .arg(format!("socket,id=con,path={},server=on,wait=off", sock_name(&console)?))
        .args(["-serial", "chardev:con"]);
    let mut append = format!(
        "{} warren.layers={} warren.hostname={} warren.pids={}",
        base_append(),
        spec.layers.len(),
        spec.hostname,
        spec.pids
    );
    if spec.open_files > 0 {
        append.push_str(&format!(" warren.nofile={}", spec.open_files));
    }
    if spec.machine == Machine::Q35 {
        // systemd names the machine from its first step, not only once the
        // agent runs. No getty on the console: nobody logs in there (it is
        // the node's boot log), and without udev in the image its device
        // never appears, holding the boot in `starting` for 90 s.
        append.push_str(&format!(" warren.systemd systemd.hostname={} systemd.getty_auto=0", spec.hostname));
    }
    if spec.netns.is_some() {
        // The guest's init configures `eth0` as slirp's network expects it
        // (see `GUEST_NET`); udev must not rename it in a full VM.
        append.push_str(" warren.net net.ifnames=0");
        cmd.args(["-netdev", &format!("user,id=net0,ipv4=on,net={GUEST_NET},ipv6=on,ipv6-net={GUEST_NET6}")])
            .args(["-device", &format!("{},netdev=net0", spec.machine.device("virtio-net"))]);
    }
    cmd.arg("-kernel").arg(spec.kernel).arg("-initrd").arg(spec.initramfs).args(["-append", &append]);
    cmd.arg("-qmp").arg(format!("unix:{},server=on,wait=off", sock_name(spec.qmp_sock)?));
    cmd.args(["-device", &format!("{},max_ports=2", spec.machine.device("virtio-serial"))])
        .arg("-chardev")
        .arg(format!("socket,id=ctl,path={},server=on,wait=off", sock_name(spec.serial_sock)?))
        .args(["-device", &format!("virtserialport,chardev=ctl,name={}", warren_init::mux::PORT_NAME)]);
    for (i, layer) in spec.layers.iter().enumerate() {
        cmd.arg("-drive")
            .arg(format!("id=l{i},file={},format=raw,if=none,readonly=on", drive_path(layer)?))
            .args(["-device", &format!("{},drive=l{i},serial=wl{i}", spec.machine.device("virtio-blk"))]);
    }
    let mut handover: Vec<(OwnedFd, i32)> = Vec::new();
    let writable = if spec.writable_by_fd {
        for (read_write, target) in [(true, WRITABLE_RW_FD), (false, WRITABLE_RO_FD)] {
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(read_write)
                .open(spec.writable)
                .map_err(|e| BackendError::io(format!("open {}", spec.writable.display()), e))?;
            handover.push((high_fd(file.into())?, target));
            cmd.args(["-add-fd", &format!("fd={target},set=1")]);
        }
        "/dev/fdset/1".to_string()
    } else {
        drive_path(spec.writable)?
    };
    // No image locking on the writable disk: it is this VM's alone, and
    // QEMU 10 locks the two descriptors of its fd set against each other
    // when a VM restored from a migration stream takes write access at
    // `cont` ("Failed to get shared \"write\" lock"); 7.2 did not.
    cmd.arg("-drive")
        .arg(format!("id=rw,file={writable},format=raw,if=none,cache=unsafe,file.locking=off"))
        .args(["-device", &format!("{},drive=rw,serial=wrw", spec.machine.device("virtio-blk"))]);
    if let Some(stream) = spec.incoming {
        let dup = stream.try_clone().map_err(|e| BackendError::io("duplicate the snapshot's descriptor", e))?;
        handover.push((high_fd(dup.into())?, INCOMING_FD));
        cmd.args(["-incoming", &format!("fd:{INCOMING_FD}")]);
    }
    let netns = match spec.netns {
        Some(ns) => Some(high_fd(ns.try_clone_to_owned().map_err(|e| BackendError::io("duplicate the netns", e))?)?),
        None => None,
    };
    if !handover.is_empty() || netns.is_some() {
        let pairs: Vec<(i32, i32)> = handover.iter().map(|(fd, target)| (fd.as_raw_fd(), *target)).collect();
        let netns_fd = netns.as_ref().map(|fd| fd.as_raw_fd());
        // SAFETY: between fork and exec only dup2 and setns, both
        // async-signal-safe system calls, on descriptors the parent keeps
        // open until `spawn` returns; the sources are all above every target.
        unsafe {
            cmd.pre_exec(move || {
                for &(fd, target) in &pairs {
                    if libc::dup2(fd, target) == -1 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                if let Some(ns) = netns_fd {
                    if libc::setns(ns, libc::CLONE_NEWNET) == -1 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
    }
    // The handover descriptors are closed once the child has its copies.
    let mut child = cmd.spawn().map_err(|e| BackendError::io(format!("start {}", spec.qemu.display()), e))?;
    let tail = ConsoleTail::default();
    tail.follow_stderr(&mut child);
    let qemu = QemuProcess::spawned(child)?;
    tail.attach(&console);
    Ok((qemu, tail))
}

/// One VM's QEMU: a child of this node process, or one a previous node
/// process started that this one adopted ([`QemuProcess::adopt`]: not its
/// child, so watched through a pidfd and reaped by whoever inherited it).
pub struct QemuProcess {
    process: Process,
    pid: ProcessId,
    kill_on_drop: bool,
}

enum Process {
    Child(Child),
    Adopted(OwnedFd),
}

/// How long a teardown waits for an adopted QEMU to die of SIGKILL (the
/// cgroup's kill follows anyway).
const ADOPTED_EXIT_WAIT: Duration = Duration::from_secs(10);

impl QemuProcess {
    pub(super) fn spawned(mut child: Child) -> Result<QemuProcess> {
        let pid = child.id().and_then(|pid| ProcessId::of(pid as i32).ok());
        match pid {
            Some(pid) => Ok(QemuProcess { process: Process::Child(child), pid, kill_on_drop: true }),
            None => {
                let _ = child.start_kill();
                Err(BackendError::Setup("QEMU exited at once".into()))
            }
        }
    }

    /// Takes over the QEMU that `pid` names if it still runs (same start
    /// time); `None` if it is gone. The pidfd is opened before the start
    /// time is checked again, so it names that process and no successor.
    pub fn adopt(pid: ProcessId) -> Option<QemuProcess> {
        let raw = rustix::process::Pid::from_raw(pid.pid)?;
        let fd = rustix::process::pidfd_open(raw, rustix::process::PidfdFlags::empty()).ok()?;
        pid.is_running().then_some(QemuProcess { process: Process::Adopted(fd), pid, kill_on_drop: false })
    }

    pub fn pid(&self) -> ProcessId {
        self.pid
    }

    /// The VM is the driver's now: it outlives this handle and the node
    /// process (a restarted node adopts it).
    pub fn keep_running_on_drop(&mut self) {
        self.kill_on_drop = false;
    }

    pub fn exited(&mut self) -> bool {
        match &mut self.process {
            Process::Child(child) => !matches!(child.try_wait(), Ok(None)),
            Process::Adopted(fd) => pidfd_readable(fd),
        }
    }

    /// SIGKILL, without waiting.
    pub fn start_kill(&mut self) {
        match &mut self.process {
            Process::Child(child) => {
                let _ = child.start_kill();
            }
            Process::Adopted(fd) => {
                let _ = rustix::process::pidfd_send_signal(&*fd, rustix::process::Signal::KILL);
            }
        }
    }

    /// Until QEMU has exited; what its exit status was, where known.
    pub async fn wait(&mut self) -> Result<String> {
        match &mut self.process {
            Process::Child(child) => {
                child.wait().await.map(|s| s.to_string()).map_err(|e| BackendError::io("wait for QEMU", e))
            }
            Process::Adopted(fd) => {
                let deadline = tokio::time::Instant::now() + ADOPTED_EXIT_WAIT;
                while !pidfd_readable(fd) && tokio::time::Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Ok("exited (adopted: status unknown)".into())
            }
        }
    }
}

impl Drop for QemuProcess {
    fn drop(&mut self) {
        if self.kill_on_drop {
            self.start_kill();
        }
    }
}

/// A pidfd polls readable once its process has exited.
fn pidfd_readable(fd: &OwnedFd) -> bool {
    let mut fds = [rustix::event::PollFd::new(fd, rustix::event::PollFlags::IN)];
    let zero = rustix::event::Timespec { tv_sec: 0, tv_nsec: 0 };
    matches!(rustix::event::poll(&mut fds, Some(&zero)), Ok(n) if n > 0)
}

/// `fd` moved to a close-on-exec descriptor at or above [`HANDOVER_MIN_FD`].
fn high_fd(fd: OwnedFd) -> Result<OwnedFd> {
    rustix::io::fcntl_dupfd_cloexec(&fd, HANDOVER_MIN_FD)
        .map_err(|e| BackendError::io("move a descriptor for QEMU", e.into()))
}

/// QEMU's option syntax splits on commas (`,,` escapes one).
fn drive_path(path: &Path) -> Result<String> {
    let s = path.to_str().ok_or_else(|| BackendError::Setup(format!("{} is not UTF-8", path.display())))?;
    Ok(s.replace(',', ",,"))
}

/// Whether KVM boots this guest: the guest's init powers off at once when
/// told `warren.probe`. This host's KVM is paravirtual (PVM) and spins
/// forever on an ordinary guest kernel, so only a clean exit in time counts.
pub async fn probe_kvm(qemu: &Path, machine: Machine, kernel: &Path, initramfs: &Path, jail: &Path) -> Accel {
    if std::fs::OpenOptions::new().read(true).write(true).open("/dev/kvm").is_err() {
        return Accel::Tcg;
    }
    let mut cmd = Command::new(qemu);
    machine_args(&mut cmd, MachineArgs { machine, accel: Accel::Kvm, memory_mib: 128, vcpus: 1, jail, qemu_uid: None });
    // A probe given up (its caller dropped) must not spin on: under a KVM
    // that cannot run the guest it never ends by itself.
    cmd.stdout(Stdio::null()).stderr(Stdio::null()).kill_on_drop(true);
    cmd.arg("-kernel").arg(kernel).arg("-initrd").arg(initramfs);
    cmd.args(["-append", &format!("{} warren.probe", base_append())]);
    let Ok(mut child) = cmd.spawn() else { return Accel::Tcg };
    match tokio::time::timeout(PROBE_TIMEOUT, child.wait()).await {
        Ok(Ok(status)) if status.success() => Accel::Kvm,
        _ => {
            let _ = child.start_kill();
            let _ = child.wait().await;
            Accel::Tcg
        }
    }
}

/// The last [`CONSOLE_TAIL_BYTES`] of what QEMU and the guest printed.
#[derive(Clone, Default)]
pub struct ConsoleTail(Arc<Mutex<VecDeque<u8>>>);

impl ConsoleTail {
    /// Keeps reading QEMU's own messages until `child` closes its stderr.
    fn follow_stderr(&self, child: &mut Child) {
        if let Some(err) = child.stderr.take() {
            let tail = self.clone();
            let started = std::time::Instant::now();
            tokio::spawn(async move { tail.read_all(boxed(err), started).await });
        }
    }

    /// Reads the guest's console at `console_sock` (see [`console_sock`])
    /// until QEMU closes it, connecting as soon as QEMU serves it (within
    /// [`CONSOLE_CONNECT_WAIT`]).
    pub fn attach(&self, console_sock: &Path) {
        let (tail, path) = (self.clone(), console_sock.to_path_buf());
        let started = std::time::Instant::now();
        tokio::spawn(async move {
            while started.elapsed() < CONSOLE_CONNECT_WAIT {
                if let Ok(stream) = crate::unix_sock::connect(&path).await {
                    return tail.read_all(boxed(stream), started).await;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        });
    }

    async fn read_all(&self, mut out: Box<dyn AsyncRead + Send + Unpin>, started: std::time::Instant) {
        let mut buf = [0u8; 4096];
        let mut line_start = true;
        while let Ok(n) = out.read(&mut buf).await {
            if n == 0 {
                return;
            }
            let mut tail = self.0.lock().unwrap_or_else(PoisonError::into_inner);
            if boot_trace() {
                for &b in &buf[..n] {
                    if line_start {
                        tail.extend(format!("<host +{} ms> ", started.elapsed().as_millis()).bytes());
                    }
                    tail.push_back(b);
                    line_start = b == b'\n';
                }
            } else {
                tail.extend(&buf[..n]);
            }
            let excess = tail.len().saturating_sub(CONSOLE_TAIL_BYTES);
            tail.drain(..excess);
        }
    }

    pub fn text(&self) -> String {
        let tail = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        String::from_utf8_lossy(&tail.iter().copied().collect::<Vec<u8>>()).into_owned()
    }
}

fn boxed<R: AsyncRead + Send + Unpin + 'static>(r: R) -> Box<dyn AsyncRead + Send + Unpin> {
    Box::new(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qemu_versions_are_read_from_the_banner() {
        assert_eq!(parse_qemu_version("QEMU emulator version 7.2.22 (Debian 1:7.2+dfsg-7+deb12u18+b3)\n"), (7, 2));
        assert_eq!(parse_qemu_version("QEMU emulator version 10.0.2 (Debian 1:10.0.2+ds-2)\nCopyright"), (10, 0));
        assert_eq!(parse_qemu_version("not qemu"), (0, 0));
        assert!(parse_qemu_version("QEMU emulator version 9.1.0") >= (9, 1));
    }

    #[test]
    fn the_jail_flags_follow_the_installed_qemu() {
        let qemu = Path::new("/usr/bin/qemu-system-x86_64");
        if !qemu.is_file() {
            eprintln!("NOTE: no {} here: only the banner parsing is checked", qemu.display());
            return;
        }
        let mut cmd = Command::new(qemu);
        jail_args(&mut cmd, Path::new("/run/a,b"), Some(1000));
        let args: Vec<String> = cmd.as_std().get_args().map(|a| a.to_string_lossy().into_owned()).collect();
        if qemu_version(qemu.as_os_str()) >= (9, 1) {
            assert_eq!(args, ["-run-with", "chroot=/run/a,,b,user=1000:1000"]);
        } else {
            assert_eq!(args, ["-chroot", "/run/a,b", "-runas", "1000:1000"]);
        }
    }
}

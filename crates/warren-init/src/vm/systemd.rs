//! A full VM (`backend: "vm"`): systemd is the guest's PID 1 and this
//! binary serves the node as one of its services.
//!
//! Two halves, one per process:
//! - In the initramfs, PID 1 (this binary, booted with `warren.systemd`)
//!   stacks the root exactly as for a microVM, then [`install`]s itself in
//!   it: the binary is bind-mounted from the initramfs (no copy on the
//!   sandbox's writable disk) at [`SERVICE_BINARY`], and a unit
//!   `warren-init.service`, wanted by `multi-user.target`, starts it with
//!   [`SERVICE_ARG`]. Then it moves into the root and execs the image's
//!   `/sbin/init`.
//! - As that service ([`service_main`]), it makes itself the child
//!   subreaper (orphans of the commands it runs come back to it, not to
//!   systemd: the reaper and the tree kill see them as under a microVM's
//!   PID 1), sets the sandbox's hostname, opens the same virtio-serial
//!   port and serves the node over it exactly as a microVM's PID 1 does
//!   (`Identify` included: the node renames a snapshot's clone and sets
//!   the clock of a guest restored from disk).
//!   The seccomp profile covers this service and what it runs, not systemd
//!   or the units systemd starts: those are the guest OS's own.
//!
//! Why a service and not PID 1 ahead of systemd: a task for a full VM
//! needs what systemd gives (units, `systemctl`, logind, timers), and
//! systemd insists on being PID 1.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::time::{Duration, Instant};

use rustix::fs::{Mode, OFlags};
use rustix::mount::MountFlags;

use super::{boot_args, find_port, mkdir_all, open_port, port, settle_fds, start_serving, IN_VM};
use crate::error::{InitError, StepContext};
use crate::{serve, sys};

/// `warren-init <SERVICE_ARG>`: the mode systemd starts.
pub const SERVICE_ARG: &str = "--vm-service";
/// Where the guest sees this binary (a bind mount of the initramfs's `/init`).
const SERVICE_BINARY: &str = "usr/lib/warren/warren-init";
const UNIT_DIR: &str = "etc/systemd/system";
const UNIT_NAME: &str = "warren-init.service";
/// Restart=no: a restarted agent would have lost every exec the node still
/// waits for; the node sees the agent gone and ends the sandbox instead.
/// No OOMScoreAdjust: the commands inherit it, and the guest's OOM killer
/// must be able to pick them (an exec ends `oom`, as in a microVM).
/// OOMPolicy=continue: systemd's default stops the whole unit (the agent
/// and every exec) when the kernel kills any one of its processes.
/// `@TASKS_MAX@`: the sandbox's pids limit, `@LIMIT_NOFILE@` its
/// `open_files`, filled in by [`install`].
const UNIT: &str = "\
[Unit]
Description=Warren's guest agent (serves the node over virtio-serial)

[Service]
Type=simple
ExecStart=/usr/lib/warren/warren-init --vm-service
Restart=no
OOMPolicy=continue
TasksMax=@TASKS_MAX@
LimitNOFILE=@LIMIT_NOFILE@
StandardOutput=journal+console
StandardError=journal+console

[Install]
WantedBy=multi-user.target
";
/// How long the service waits for the port's device node (the initramfs
/// saw it already: this is a margin, not a boot wait).
const PORT_WAIT: Duration = Duration::from_secs(10);

/// Installs the service into the stacked root at `root`; `pids` becomes its
/// `TasksMax` (systemd's pids limit on the unit's cgroup: the agent, its
/// threads and every command it starts, as a container's pids cgroup),
/// `open_files` its `LimitNOFILE` (the agent's `RLIMIT_NOFILE`, so every
/// command's; without one, systemd's default of 1024 soft, 512 Ki hard).
pub fn install(root: &Path, pids: Option<u32>, open_files: Option<u64>) -> Result<(), InitError> {
    let binary = root.join(SERVICE_BINARY);
    if let Some(dir) = binary.parent() {
        mkdir_all(dir)?;
    }
    std::fs::write(&binary, b"").step(|| format!("create {}", binary.display()))?;
    rustix::mount::mount_bind("/init", &binary).step(|| format!("bind /init onto {}", binary.display()))?;
    // Read-only, so that nothing in the guest rewrites the agent in place.
    rustix::mount::mount_remount(&binary, MountFlags::BIND | MountFlags::RDONLY, "")
        .step(|| format!("make {} read-only", binary.display()))?;
    write_machine_id(root)?;
    let units = root.join(UNIT_DIR);
    let wants = units.join("multi-user.target.wants");
    mkdir_all(&wants)?;
    let unit = units.join(UNIT_NAME);
    let tasks_max = pids.map_or("infinity".to_string(), |n| n.to_string());
    let limit_nofile = open_files.map_or("1024:524288".to_string(), |n| n.to_string());
    let text = UNIT.replace("@TASKS_MAX@", &tasks_max).replace("@LIMIT_NOFILE@", &limit_nofile);
    std::fs::write(&unit, text).step(|| format!("write {}", unit.display()))?;
    let link = wants.join(UNIT_NAME);
    match std::fs::remove_file(&link) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).step(|| format!("remove {}", link.display())),
    }
    std::os::unix::fs::symlink(format!("../{UNIT_NAME}"), &link).step(|| format!("link {}", link.display()))
}

/// A fresh `/etc/machine-id` per sandbox: images carry the one of the
/// machine that built them, and an empty one would make systemd run its
/// first-boot work on every boot. `GRND_INSECURE`: an id, not a key, and
/// a guest this early may not have a seeded generator yet.
fn write_machine_id(root: &Path) -> Result<(), InitError> {
    let mut bytes = [0u8; 16];
    let mut filled = 0;
    while filled < bytes.len() {
        filled += rustix::rand::getrandom(&mut bytes[filled..], rustix::rand::GetRandomFlags::INSECURE)
            .step(|| "getrandom".into())?;
    }
    let id: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    let path = root.join("etc/machine-id");
    std::fs::write(&path, format!("{id}\n")).step(|| format!("write {}", path.display()))
}

/// Replaces this process (PID 1, now in the image's root) with the image's
/// init; returns only if that fails.
pub fn exec_systemd() -> InitError {
    let e = std::process::Command::new("/sbin/init").exec();
    InitError::Sys { step: "exec the image's /sbin/init (does it ship systemd?)".into(), source: e }
}

/// `warren-init --vm-service`. Never returns.
pub fn service_main() -> ! {
    IN_VM.store(true, std::sync::atomic::Ordering::Relaxed);
    match start_service() {
        Ok((port_fd, shared)) => port::serve(port_fd, shared),
        Err(e) => {
            eprintln!("warren-init: {e}");
            sys::exit_now(1)
        }
    }
}

fn start_service() -> Result<(std::os::fd::OwnedFd, std::sync::Arc<serve::Shared>), InitError> {
    rustix::process::set_child_subreaper(Some(rustix::process::getpid()))
        .step(|| "prctl(PR_SET_CHILD_SUBREAPER)".into())?;
    let args = boot_args()?;
    rustix::system::sethostname(args.hostname.as_bytes()).step(|| "sethostname".into())?;
    let started = Instant::now();
    let port_path = loop {
        if let Some(port) = find_port() {
            break port;
        }
        if started.elapsed() > PORT_WAIT {
            return Err(InitError::Refused(format!("the control port did not appear within {PORT_WAIT:?}")));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let self_exe = rustix::fs::open("/proc/self/exe", OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())
        .step(|| "open /proc/self/exe".into())?;
    let self_exe = settle_fds(self_exe)?;
    // Before the filter, which refuses mounts.
    match super::find_devices(args.layers) {
        Some(devices) => crate::pack::keep_upper_of_disk(&devices.rw),
        None => eprintln!("warren-init: the writable disk is not there: pack_diff will not work"),
    }
    super::limits::keep_own_cgroup();
    let port_fd = open_port(&port_path)?;
    // Before the filter, as in a microVM: a guest restored from a snapshot
    // or from disk is told its name and the time.
    super::identity::start().step(|| "start the identity thread".into())?;
    Ok((port_fd, start_serving(self_exe, &|_| {})?))
}

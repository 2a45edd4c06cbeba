//! The sandbox's mount namespace: kernel filesystems, a minimal `/dev`, the
//! masks of `warren_guard::profile`, then `pivot_root` into the image.
//!
//! Runs as root of the sandbox's user namespace, in a mount namespace that
//! namespace owns, copied from the zygote's template (see `template`). What this kernel (6.18) allows there, tested:
//! - `proc` and `sysfs` mount (the host's fully visible `/proc` and `/sys`
//!   in the copied namespace satisfy the kernel's "not too revealing" rule);
//!   if sysfs is refused anyway, an empty read-only tmpfs takes its place.
//! - bind mounts of the host's `/dev/null` etc. onto files of our tmpfs
//!   work and keep the device usable (the bind keeps the host mount's
//!   flags, while device nodes made in a user-namespace tmpfs would not).
//! - masks (bind `/dev/null` over proc files, a read-only tmpfs over proc
//!   and sysfs directories) and read-only rebinds of `/proc/sys` etc. work.
//!
//! Every mount-point directory the image provides is checked not to be a
//! symlink: an image cannot redirect a kernel filesystem or a mask.

use std::fs;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use rustix::fs::CWD;
use rustix::mount::{MountFlags, MountPropagationFlags, MoveMountFlags, UnmountFlags};
use warren_guard::profile::{MASKED_DIRS, MASKED_FILES, READ_ONLY_PATHS};

use crate::error::{InitError, StepContext};
use crate::template::SANDBOX_ROOT;

/// Host devices bound into the sandbox's `/dev`.
const DEVICES: &[&str] = &["null", "zero", "full", "random", "urandom", "tty"];

/// Symlinks in the sandbox's `/dev`: (name, target).
const DEV_LINKS: &[(&str, &str)] = &[
    ("fd", "/proc/self/fd"),
    ("stdin", "/proc/self/fd/0"),
    ("stdout", "/proc/self/fd/1"),
    ("stderr", "/proc/self/fd/2"),
    ("ptmx", "pts/ptmx"),
];

const KERNEL_FS_FLAGS: MountFlags = MountFlags::NOSUID.union(MountFlags::NODEV).union(MountFlags::NOEXEC);

/// Attaches `root_fs` (the sandbox's overlay, a detached mount the host
/// sent) at the template namespace's mount point, builds every mount of
/// the sandbox under it, then makes it the process's `/`.
pub fn build(root_fs: OwnedFd) -> Result<(), InitError> {
    rustix::mount::mount_change("/", MountPropagationFlags::REC | MountPropagationFlags::PRIVATE)
        .step(|| "step 4: make / recursively private".into())?;
    let root = Path::new(SANDBOX_ROOT);
    rustix::mount::move_mount(&root_fs, "", CWD, root, MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH)
        .step(|| format!("step 4: attach the root filesystem at {SANDBOX_ROOT}"))?;
    drop(root_fs);
    mount_proc(root)?;
    mount_sys(root)?;
    mount_dev(root)?;
    protect_kernel_files(root)?;
    enter(root)
}

/// `root` joined with an absolute in-sandbox path.
fn inside(root: &Path, path: &str) -> PathBuf {
    root.join(path.trim_start_matches('/'))
}

/// Makes sure `path` is a real directory (creating it if missing), never a
/// symlink or anything else an image could use to redirect a mount.
fn ensure_dir(path: &Path) -> Result<(), InitError> {
    match fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_dir() => Ok(()),
        Ok(_) => Err(InitError::Refused(format!("step 4: mount point {} is not a directory", path.display()))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            fs::DirBuilder::new().mode(0o755).create(path).step(|| format!("step 4: mkdir {}", path.display()))
        }
        Err(e) => Err(e).step(|| format!("step 4: stat {}", path.display())),
    }
}

fn mount_proc(root: &Path) -> Result<(), InitError> {
    let target = inside(root, "/proc");
    ensure_dir(&target)?;
    rustix::mount::mount("proc", &target, "proc", KERNEL_FS_FLAGS, None)
        .step(|| format!("step 4: mount proc on {}", target.display()))
}

fn mount_sys(root: &Path) -> Result<(), InitError> {
    let target = inside(root, "/sys");
    ensure_dir(&target)?;
    match rustix::mount::mount("sysfs", &target, "sysfs", KERNEL_FS_FLAGS | MountFlags::RDONLY, None) {
        Ok(()) => Ok(()),
        // Refused in this user namespace: an empty read-only tmpfs shows the
        // sandbox no host device tree at all, which only tightens.
        Err(rustix::io::Errno::PERM) => mount_empty_dir(&target),
        Err(e) => Err(e).step(|| format!("step 4: mount sysfs on {}", target.display())),
    }
}

pub(crate) fn mount_dev(root: &Path) -> Result<(), InitError> {
    let dev = inside(root, "/dev");
    ensure_dir(&dev)?;
    rustix::mount::mount("tmpfs", &dev, "tmpfs", MountFlags::NOSUID | MountFlags::NOEXEC, c"mode=0755,size=65536k")
        .step(|| format!("step 4: mount tmpfs on {}", dev.display()))?;
    for name in DEVICES {
        let target = dev.join(name);
        fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o666)
            .open(&target)
            .step(|| format!("step 4: create {}", target.display()))?;
        let source = Path::new("/dev").join(name);
        rustix::mount::mount_bind(&source, &target)
            .step(|| format!("step 4: bind {} onto {}", source.display(), target.display()))?;
    }
    for (name, to) in DEV_LINKS {
        let link = dev.join(name);
        std::os::unix::fs::symlink(to, &link).step(|| format!("step 4: symlink {}", link.display()))?;
    }
    let pts = dev.join("pts");
    ensure_dir(&pts)?;
    rustix::mount::mount(
        "devpts",
        &pts,
        "devpts",
        MountFlags::NOSUID | MountFlags::NOEXEC,
        c"newinstance,ptmxmode=0666,mode=0620,gid=5",
    )
    .step(|| format!("step 4: mount devpts on {}", pts.display()))?;
    let shm = dev.join("shm");
    ensure_dir(&shm)?;
    rustix::mount::mount("shm", &shm, "tmpfs", KERNEL_FS_FLAGS, c"mode=1777,size=65536k")
        .step(|| format!("step 4: mount tmpfs on {}", shm.display()))
}

/// Applies `warren_guard::profile`: read-only kernel interfaces first, then
/// the masks (a mask may sit inside a read-only tree, never the reverse).
/// A path this kernel does not have is skipped; any other failure fails
/// setup, because a mask that silently did not apply is an open door.
pub(crate) fn protect_kernel_files(root: &Path) -> Result<(), InitError> {
    for path in READ_ONLY_PATHS {
        let target = inside(root, path);
        if exists(&target)? {
            remount_read_only(&target)?;
        }
    }
    // The first masked file gets `/dev/null` on a `nodev` bind, which
    // cannot be opened at all (EACCES), and the others binds of that one,
    // which inherit the flag. A plain `/dev/null` would take writes: where
    // the caller is the kernel's root (a microVM's guest),
    // `echo c > /proc/sysrq-trigger` would "succeed" into nothing, and
    // nobody could tell a mask from a write that took effect.
    let null = inside(root, "/dev/null");
    let mut masked_file: Option<PathBuf> = None;
    for path in MASKED_FILES {
        let target = inside(root, path);
        if !exists(&target)? {
            continue;
        }
        match &masked_file {
            None => {
                rustix::mount::mount_bind(&null, &target).step(|| format!("step 4: mask {path}"))?;
                rustix::mount::mount_remount(&target, KERNEL_FS_FLAGS | MountFlags::BIND | MountFlags::RDONLY, c"")
                    .step(|| format!("step 4: make the mask of {path} unopenable"))?;
                masked_file = Some(target);
            }
            Some(source) => rustix::mount::mount_bind(source, &target).step(|| format!("step 4: mask {path}"))?,
        }
    }
    // One empty read-only tmpfs, bound onto every masked directory: a bind
    // costs a mount, a tmpfs of its own also a superblock to set up and to
    // shut down again (nine of them were a fifth of init's CPU per sandbox).
    // The superblock is read-only and the sandbox cannot remount, so the
    // shared one hides exactly what separate ones did.
    let mut empty: Option<PathBuf> = None;
    for path in MASKED_DIRS {
        let target = inside(root, path);
        if !exists(&target)? {
            continue;
        }
        match &empty {
            None => {
                mount_empty_dir(&target)?;
                empty = Some(target);
            }
            Some(source) => rustix::mount::mount_bind(source, &target).step(|| format!("step 4: mask {path}"))?,
        }
    }
    Ok(())
}

fn exists(path: &Path) -> Result<bool, InitError> {
    match fs::symlink_metadata(path) {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e).step(|| format!("step 4: stat {}", path.display())),
    }
}

pub(crate) fn remount_read_only(target: &Path) -> Result<(), InitError> {
    rustix::mount::mount_bind_recursive(target, target)
        .step(|| format!("step 4: bind {} onto itself", target.display()))?;
    rustix::mount::mount_remount(target, KERNEL_FS_FLAGS | MountFlags::BIND | MountFlags::RDONLY, c"")
        .step(|| format!("step 4: remount {} read-only", target.display()))
}

fn mount_empty_dir(target: &Path) -> Result<(), InitError> {
    rustix::mount::mount("tmpfs", target, "tmpfs", KERNEL_FS_FLAGS | MountFlags::RDONLY, c"mode=0555,size=4k")
        .step(|| format!("step 4: mount an empty tmpfs on {}", target.display()))
}

/// `pivot_root(".", ".")`: the old root ends up stacked under the new one
/// and is detached at once, so nothing of the host stays reachable.
fn enter(root: &Path) -> Result<(), InitError> {
    rustix::process::chdir(root).step(|| format!("step 4: chdir {}", root.display()))?;
    rustix::process::pivot_root(".", ".").step(|| "step 4: pivot_root".into())?;
    rustix::mount::unmount(".", UnmountFlags::DETACH).step(|| "step 4: detach the old root".into())?;
    rustix::process::chdir("/").step(|| "step 4: chdir /".into())
}

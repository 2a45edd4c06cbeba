//! The template mount namespace the init zygote lives in, and so every
//! first init it forks: a small read-only tmpfs as `/` holding binds of
//! the host's `/proc`, `/sys` and `/dev` (without what is mounted below
//! them) and an empty mount point for the sandbox's root
//! ([`SANDBOX_ROOT`]), and nothing else of the host: four mounts.
//!
//! Why: `unshare(CLONE_NEWNS)` copies the caller's whole mount table and
//! the detach after `pivot_root` tears the copy down again, both in time
//! linear in its size. Every live sandbox adds two mounts to the host's
//! table (its tmpfs and its overlay), so a first init forked in the host's
//! namespace made each create slower with every sandbox already running
//! (measured: 3.9 ms with none, 14.2 ms with 1,000; `unshare -m true`
//! alone 1.6 and 8.0 ms). From the template the copy is four mounts
//! however many sandboxes run. The zygote pays one copy of the host's
//! table when it starts, once per its spawns.
//!
//! What a first init still needs of the host is here: `/proc` (its own
//! executable, and the fully visible procfs the kernel requires before a
//! user namespace may mount one), `/sys` (the same for sysfs) and `/dev`
//! (the device files bound into the sandbox's `/dev`). Their submounts
//! (`/sys/fs/cgroup/*`, `/dev/pts`, `binfmt_misc`, ...) serve no first
//! init: the sandbox mounts its own `devpts`, and a kernel filesystem with
//! nothing mounted on it is trivially "fully visible". The sandbox's overlay
//! is mounted by the node after the zygote's namespace was made, so it
//! cannot be found by path: the node sends a detached clone of it on the
//! setup socket and the first init attaches it at [`SANDBOX_ROOT`] in its
//! own namespace (`rootfs::build`).

use std::io;
use std::os::fd::OwnedFd;

use rustix::fs::{Mode, CWD};
use rustix::mount::{MountFlags, MountPropagationFlags, MoveMountFlags, OpenTreeFlags, UnmountFlags};
use rustix::thread::UnshareFlags;

/// Where a first init attaches its sandbox's root filesystem.
pub const SANDBOX_ROOT: &str = "/sandbox";

/// The host's kernel filesystems a first init needs, each bound into the
/// template alone (none of its submounts).
const HOST_TREES: &[&str] = &["proc", "sys", "dev"];

/// Moves the calling process (single-threaded, host root) into a new
/// mount namespace laid out as the module's doc says.
pub fn enter() -> io::Result<()> {
    // SAFETY: the zygote calls this before it starts any thread or forks,
    // and only the mount namespace is unshared (not the descriptor table).
    unsafe { rustix::thread::unshare_unsafe(UnshareFlags::NEWNS) }.map_err(|e| step("unshare(CLONE_NEWNS)", e))?;
    rustix::mount::mount_change("/", MountPropagationFlags::REC | MountPropagationFlags::PRIVATE)
        .map_err(|e| step("make / recursively private", e))?;
    // Cloned before the new root hides their paths.
    let trees = HOST_TREES
        .iter()
        .map(|name| {
            let path = format!("/{name}");
            rustix::mount::open_tree(
                CWD,
                path.as_str(),
                OpenTreeFlags::OPEN_TREE_CLONE | OpenTreeFlags::OPEN_TREE_CLOEXEC,
            )
            .map_err(|e| step(&format!("clone {path}"), e))
        })
        .collect::<io::Result<Vec<OwnedFd>>>()?;
    // The new root goes on /proc, a directory every host has; the pivot
    // below makes it `/`.
    let new_root = "/proc";
    rustix::mount::mount(
        "tmpfs",
        new_root,
        "tmpfs",
        MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC,
        c"mode=0755,size=16k,nr_inodes=16",
    )
    .map_err(|e| step("mount the template's tmpfs", e))?;
    for (name, tree) in HOST_TREES.iter().zip(&trees) {
        let target = format!("{new_root}/{name}");
        rustix::fs::mkdir(target.as_str(), Mode::from_raw_mode(0o755))
            .map_err(|e| step(&format!("mkdir {target}"), e))?;
        rustix::mount::move_mount(tree, "", CWD, target.as_str(), MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH)
            .map_err(|e| step(&format!("attach /{name} at {target}"), e))?;
    }
    let sandbox_root = format!("{new_root}{SANDBOX_ROOT}");
    rustix::fs::mkdir(sandbox_root.as_str(), Mode::from_raw_mode(0o755))
        .map_err(|e| step(&format!("mkdir {sandbox_root}"), e))?;
    rustix::process::chdir(new_root).map_err(|e| step("chdir to the template's root", e))?;
    rustix::process::pivot_root(".", ".").map_err(|e| step("pivot_root into the template", e))?;
    rustix::mount::unmount(".", UnmountFlags::DETACH).map_err(|e| step("detach the host's mounts", e))?;
    rustix::process::chdir("/").map_err(|e| step("chdir /", e))?;
    // Nothing is ever written to the template: a first init only mounts on
    // its mount point, in its own copy.
    rustix::mount::mount_remount(
        "/",
        MountFlags::BIND | MountFlags::RDONLY | MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC,
        c"",
    )
    .map_err(|e| step("make the template read-only", e))
}

fn step(what: &str, e: rustix::io::Errno) -> io::Error {
    let e = io::Error::from(e);
    io::Error::new(e.kind(), format!("template mount namespace: {what}: {e}"))
}

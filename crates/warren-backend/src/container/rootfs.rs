//! The sandbox's files as the host builds them: the sandbox's own tmpfs at
//! its run directory (its size is the disk limit: it holds the writable
//! layer, and the control files and mount points beside it), one idmapped
//! read-only clone per image layer, and an overlay of them at `rootfs/`.
//! Also the reverse: detaching all of it at once, and unmounting whatever
//! an older or interrupted sandbox left under its directory.
//!
//! Only two mounts per sandbox enter the host's mount table (the tmpfs and
//! the overlay): the layer clones stay detached, named to overlayfs by
//! their descriptors. The sandbox's own mount namespace is not a copy of
//! that table but of the init zygote's small template; its first init
//! gets a detached clone of the overlay ([`clone_for_init`]).

use std::fs;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

use rustix::fs::{Gid, Mode, OFlags, Uid, CWD};
use rustix::mount::{
    fsconfig_create, fsconfig_set_string, fsmount, fsopen, mount, move_mount, open_tree, unmount, FsMountFlags,
    FsOpenFlags, MountAttrFlags, MountFlags, MoveMountFlags, OpenTreeFlags, UnmountFlags,
};

use super::state::Layout;
use crate::{BackendError, Result};

/// `struct mount_attr` of `mount_setattr(2)`; the libc crate lacks it.
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// What the writable layer and the overlay need to know.
pub(crate) struct RootfsSpec<'a> {
    /// Read-only layer directories, bottom first.
    pub(crate) layers: &'a [PathBuf],
    /// Host uid and gid that root inside maps to.
    pub(crate) uid_base: u32,
    /// A process in the sandbox's user namespace; the layers are idmapped
    /// through it.
    pub(crate) userns_pid: i32,
}

/// The sandbox's tmpfs at `layout.dir()`, `disk_mib` large with at most
/// `inodes` inodes (0: the tmpfs default). Nothing on it is reachable from
/// the sandbox but the overlay's upper layer, so the sandbox can fill it,
/// not outgrow it. Control files and mount points cost nothing to make and
/// remove there, and detaching it takes every mount of the sandbox along
/// (see [`detach`]).
/// Inodes of the run directory itself on the sandbox's tmpfs (control
/// socket, state file, mount points, overlay work dir), added to the cap.
const RUN_DIR_INODES: u64 = 32;

pub(crate) fn mount_sandbox_dir(layout: &Layout, disk_mib: u64, inodes: u64) -> Result<()> {
    let dir = layout.dir();
    // The few control files and mount points of the run directory share the
    // cap; they exist before the sandbox runs, so it cannot starve them.
    let nr_inodes = match inodes {
        0 => String::new(),
        n => format!(",nr_inodes={}", n.saturating_add(RUN_DIR_INODES)),
    };
    let options = std::ffi::CString::new(format!("size={disk_mib}m,mode=0711{nr_inodes}"))
        .map_err(|e| io_err("tmpfs options for", dir, io::Error::other(e)))?;
    mount("tmpfs", dir, "tmpfs", MountFlags::NOSUID | MountFlags::NODEV, Some(options.as_c_str()))
        .map_err(|e| io_err("mount tmpfs on", dir, e))
}

/// The parts of the root filesystem that need no user namespace: the
/// writable layer's directories, owned by the sandbox's root, and the
/// overlay's mount point. Done while init is starting.
pub(crate) fn prepare(layout: &Layout, spec: &RootfsSpec<'_>) -> Result<()> {
    for layer in spec.layers {
        if !layer.is_dir() {
            return Err(BackendError::Setup(format!("layer {} is not a directory", layer.display())));
        }
    }
    make_dir(&layout.rw())?;
    for dir in [layout.upper(), layout.work()] {
        make_dir(&dir)?;
        rustix::fs::chown(&dir, Some(Uid::from_raw(spec.uid_base)), Some(Gid::from_raw(spec.uid_base)))
            .map_err(|e| io_err("chown", &dir, e))?;
    }
    make_dir(&layout.rootfs())
}

/// Mounts the overlay at `layout.rootfs()` on what [`prepare`] made, once
/// `spec.userns_pid` has its user namespace mapped. On error, what was
/// mounted stays for the caller's teardown to remove.
pub(crate) fn build(layout: &Layout, spec: &RootfsSpec<'_>) -> Result<()> {
    let userns = open_userns(spec.userns_pid)?;
    let lowers = spec.layers.iter().map(|layer| idmapped_clone(layer, &userns)).collect::<Result<Vec<_>>>()?;
    mount_overlay(layout, &lowers)
}

/// A 0755 directory whatever the umask.
fn make_dir(path: &Path) -> Result<()> {
    fs::DirBuilder::new().mode(0o755).create(path).map_err(|e| io_err("mkdir", path, e))?;
    fs::set_permissions(path, fs::Permissions::from_mode(0o755)).map_err(|e| io_err("chmod", path, e))
}

fn io_err(op: &str, path: &Path, e: impl Into<io::Error>) -> BackendError {
    BackendError::io(format!("{op} {}", path.display()), e.into())
}

fn open_userns(pid: i32) -> Result<OwnedFd> {
    let path = PathBuf::from(format!("/proc/{pid}/ns/user"));
    rustix::fs::open(&path, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty()).map_err(|e| io_err("open", &path, e))
}

/// A detached, read-only clone of `layer` in which ids are shifted through
/// `userns`: uid 0 in the layer shows as the sandbox's base uid.
fn idmapped_clone(layer: &Path, userns: &OwnedFd) -> Result<OwnedFd> {
    let tree = open_tree(
        CWD,
        layer,
        OpenTreeFlags::OPEN_TREE_CLONE | OpenTreeFlags::OPEN_TREE_CLOEXEC | OpenTreeFlags::AT_RECURSIVE,
    )
    .map_err(|e| io_err("open_tree", layer, e))?;
    let attr = MountAttr {
        attr_set: (MountAttrFlags::MOUNT_ATTR_IDMAP
            | MountAttrFlags::MOUNT_ATTR_RDONLY
            | MountAttrFlags::MOUNT_ATTR_NODEV
            | MountAttrFlags::MOUNT_ATTR_NOSUID)
            .bits() as u64,
        attr_clr: 0,
        propagation: 0,
        userns_fd: userns.as_raw_fd() as u64,
    };
    // SAFETY: `tree` is a live mount fd, the path is a NUL-terminated empty
    // string, and `attr` is a properly sized `struct mount_attr` that the
    // kernel only reads during the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH | libc::AT_RECURSIVE,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if rc != 0 {
        return Err(io_err("idmap (mount_setattr)", layer, io::Error::last_os_error()));
    }
    Ok(tree)
}

/// Overlayfs at `rootfs` over the detached lowers (bottom first), each
/// named by its descriptor: overlayfs takes its own private clone of every
/// layer at creation, so none of them has to be attached anywhere. Each
/// lower goes in as its own `lowerdir+` so no path needs escaping and the
/// option page cannot overflow. Devices are off: a device node in an image
/// must not open a host device.
fn mount_overlay(layout: &Layout, lowers: &[OwnedFd]) -> Result<()> {
    let target = layout.rootfs();
    let fs = fsopen("overlay", FsOpenFlags::FSOPEN_CLOEXEC).map_err(|e| io_err("fsopen overlay for", &target, e))?;
    // Overlay's first lower is the top one; the spec lists layers bottom first.
    for lower in lowers.iter().rev() {
        let path = PathBuf::from(format!("/proc/self/fd/{}", lower.as_raw_fd()));
        fsconfig_set_string(fs.as_fd(), "lowerdir+", &path).map_err(|e| io_err("overlay lowerdir+", &path, e))?;
    }
    // Upper and work go in by descriptor too: overlayfs shows each option
    // as it was given in the sandbox's /proc/self/mountinfo, and a host
    // path there would disclose the data directory's layout.
    for (option, dir) in [("upperdir", layout.upper()), ("workdir", layout.work())] {
        let held = rustix::fs::open(&dir, OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())
            .map_err(|e| io_err("open", &dir, e))?;
        let path = PathBuf::from(format!("/proc/self/fd/{}", held.as_raw_fd()));
        fsconfig_set_string(fs.as_fd(), option, &path).map_err(|e| io_err(option, &dir, e))?;
    }
    fsconfig_create(fs.as_fd()).map_err(|e| io_err("create overlay for", &target, e))?;
    let mnt = fsmount(fs.as_fd(), FsMountFlags::FSMOUNT_CLOEXEC, MountAttrFlags::MOUNT_ATTR_NODEV)
        .map_err(|e| io_err("fsmount overlay for", &target, e))?;
    move_mount(mnt.as_fd(), "", CWD, &target, MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH)
        .map_err(|e| io_err("move_mount to", &target, e))
}

/// A detached clone of the overlay at `layout.rootfs()`, for the sandbox's
/// first init to attach in its own mount namespace: that namespace is a
/// copy of the init zygote's template, made before this overlay existed
/// (see `warren-init`'s `template`).
pub(crate) fn clone_for_init(layout: &Layout) -> Result<OwnedFd> {
    let root = layout.rootfs();
    open_tree(CWD, &root, OpenTreeFlags::OPEN_TREE_CLONE | OpenTreeFlags::OPEN_TREE_CLOEXEC)
        .map_err(|e| io_err("open_tree", &root, e))
}

/// Mount points at or below `dir`, deepest (most recently stacked) first.
pub(crate) fn mounts_under(dir: &Path) -> Result<Vec<PathBuf>> {
    let text = fs::read_to_string("/proc/self/mountinfo").map_err(|e| BackendError::io("read mountinfo", e))?;
    let mut found: Vec<PathBuf> = text
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(|field| PathBuf::from(unescape_mountinfo(field)))
        .filter(|point| point.starts_with(dir))
        .collect();
    // mountinfo lists in mount order; reversing puts stacked mounts and
    // children before what they sit on, and sorting by depth keeps that.
    found.reverse();
    found.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    Ok(found)
}

/// mountinfo writes space, tab, newline and backslash as `\ooo`.
fn unescape_mountinfo(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).filter(|d| d.iter().all(|b| (b'0'..=b'7').contains(b)));
        match (bytes[i], octal) {
            (b'\\', Some(d)) => {
                out.push((d[0] - b'0') * 64 + (d[1] - b'0') * 8 + (d[2] - b'0'));
                i += 4;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Detaches the mount at `dir`, and with it every mount below it. True when
/// `dir` was a mount point; false when it was not (a sandbox made before
/// the sandbox dir had its own tmpfs, or one whose create stopped before
/// it), and only [`unmount_all_under`] can tell what is mounted below.
pub(crate) fn detach(dir: &Path) -> Result<bool> {
    match unmount(dir, UnmountFlags::NOFOLLOW | UnmountFlags::DETACH) {
        Ok(()) => Ok(true),
        Err(rustix::io::Errno::INVAL | rustix::io::Errno::NOENT) => Ok(false),
        Err(e) => Err(io_err("detach", dir, e)),
    }
}

/// Unmounts everything at or below `dir`, deepest first. A mount still
/// busy (an open file handle of the node, say) is detached instead.
pub(crate) fn unmount_all_under(dir: &Path) -> Result<()> {
    // Each pass unmounts what mountinfo listed; the bound only guards
    // against mounts that keep reappearing.
    for _ in 0..100 {
        let mounts = mounts_under(dir)?;
        if mounts.is_empty() {
            return Ok(());
        }
        for point in &mounts {
            match unmount(point, UnmountFlags::NOFOLLOW) {
                Ok(()) => {}
                Err(rustix::io::Errno::BUSY) => {
                    unmount(point, UnmountFlags::NOFOLLOW | UnmountFlags::DETACH)
                        .map_err(|e| io_err("detach", point, e))?;
                }
                // Gone between reading mountinfo and the call (or with a
                // parent detached before it).
                Err(rustix::io::Errno::INVAL | rustix::io::Errno::NOENT) => {}
                Err(e) => return Err(io_err("unmount", point, e)),
            }
        }
    }
    Err(BackendError::Setup(format!("mounts under {} keep reappearing", dir.display())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;
    use std::process::{Child, Command, Stdio};

    /// A process in a fresh user namespace mapping 0..65536 to `base..`.
    struct Userns(Child);
    impl Userns {
        fn new(base: u32) -> Userns {
            let child = Command::new("unshare").args(["-U", "sleep", "1000"]).stdin(Stdio::null()).spawn().unwrap();
            let pid = child.id();
            let mine = fs::read_link("/proc/self/ns/user").unwrap();
            while fs::read_link(format!("/proc/{pid}/ns/user")).map_or(true, |ns| ns == mine) {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            crate::container::spawn::write_id_maps(pid as i32, base).unwrap();
            Userns(child)
        }
    }
    impl Drop for Userns {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = unmount_all_under(&self.0);
        }
    }

    /// A run dir with one sandbox directory, and layers made by `layers`.
    fn sandbox_dir(tmp: &Path) -> Layout {
        let run = tmp.join("run");
        fs::create_dir(&run).unwrap();
        let layout = Layout::new(&run, "sb");
        fs::create_dir(layout.dir()).unwrap();
        layout
    }

    #[test]
    fn overlay_of_idmapped_layers_shifts_ownership_within_the_disk_limit() {
        let tmp = tempfile::tempdir().unwrap();
        let bottom = tmp.path().join("bottom");
        let top = tmp.path().join("top");
        fs::create_dir_all(bottom.join("etc")).unwrap();
        fs::create_dir_all(&top).unwrap();
        fs::write(bottom.join("etc/name"), "bottom").unwrap();
        fs::write(bottom.join("shadowed"), "bottom").unwrap();
        fs::write(top.join("shadowed"), "top").unwrap();
        rustix::fs::chown(bottom.join("etc/name").as_path(), Some(Uid::from_raw(1000)), Some(Gid::from_raw(1000)))
            .unwrap();
        let layout = sandbox_dir(tmp.path());
        let _unmount = Unmount(layout.dir().to_path_buf());

        let base = 1 << 30;
        let userns = Userns::new(base);
        let spec =
            RootfsSpec { layers: &[bottom.clone(), top.clone()], uid_base: base, userns_pid: userns.0.id() as i32 };
        mount_sandbox_dir(&layout, 4, 64).unwrap();
        prepare(&layout, &spec).unwrap();
        build(&layout, &spec).unwrap();

        let root = layout.rootfs();
        assert_eq!(fs::read_to_string(root.join("shadowed")).unwrap(), "top");
        // The inode cap: the sandbox's 64 plus the run directory's own.
        let inodes = rustix::fs::statvfs(layout.dir()).unwrap().f_files;
        assert_eq!(inodes, 64 + RUN_DIR_INODES);
        assert_eq!(fs::metadata(root.join("etc")).unwrap().uid(), base);
        assert_eq!(fs::metadata(root.join("etc/name")).unwrap().uid(), base + 1000);
        assert_eq!(fs::metadata(&root).unwrap().uid(), base);
        // The layers themselves are untouched, and read-only through the clones.
        assert_eq!(fs::metadata(bottom.join("etc")).unwrap().uid(), 0);
        fs::write(root.join("etc/name"), "changed").unwrap();
        assert_eq!(fs::read_to_string(bottom.join("etc/name")).unwrap(), "bottom");
        // Writes land in the upper layer, bounded by the sandbox's tmpfs.
        fs::write(root.join("new"), "x").unwrap();
        assert!(layout.upper().join("new").exists());
        assert!(!top.join("new").exists());
        let big = vec![0u8; 5 << 20];
        assert_eq!(fs::write(root.join("big"), &big).unwrap_err().raw_os_error(), Some(libc::ENOSPC));

        // Only the tmpfs and the overlay are in the host's mount table.
        assert_eq!(mounts_under(layout.dir()).unwrap().len(), 2);
        unmount_all_under(layout.dir()).unwrap();
        assert!(mounts_under(layout.dir()).unwrap().is_empty());
    }

    #[test]
    fn detaching_the_sandbox_dir_takes_every_mount_of_the_sandbox_along() {
        let tmp = tempfile::tempdir().unwrap();
        let layer = tmp.path().join("layer");
        fs::create_dir_all(layer.join("etc")).unwrap();
        let layout = sandbox_dir(tmp.path());
        let _unmount = Unmount(layout.dir().to_path_buf());

        let base = 1 << 30;
        let userns = Userns::new(base);
        let spec = RootfsSpec { layers: &[layer], uid_base: base, userns_pid: userns.0.id() as i32 };
        mount_sandbox_dir(&layout, 4, 0).unwrap();
        prepare(&layout, &spec).unwrap();
        build(&layout, &spec).unwrap();
        fs::write(layout.slot_file(), "0").unwrap();
        assert_eq!(mounts_under(layout.dir()).unwrap().len(), 2);

        assert!(detach(layout.dir()).unwrap());
        assert!(mounts_under(layout.dir()).unwrap().is_empty());
        // Everything lived on the tmpfs: the host directory is empty.
        fs::remove_dir(layout.dir()).unwrap();
        assert!(!detach(layout.dir()).unwrap());
    }

    #[test]
    fn mountinfo_escapes_are_decoded() {
        assert_eq!(unescape_mountinfo(r"/tmp/a\040b\134c"), "/tmp/a b\\c");
        assert_eq!(unescape_mountinfo(r"/x\09"), r"/x\09");
    }
}

//! The sandbox's root filesystem as the host builds it: a size-limited tmpfs
//! for the writable layer, one idmapped read-only clone per image layer, and
//! an overlay of them. Also the reverse: unmounting everything under a
//! sandbox's run directory.

use std::ffi::CString;
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
    pub(crate) disk_mib: u64,
    /// Host uid and gid that root inside maps to.
    pub(crate) uid_base: u32,
    /// A process in the sandbox's user namespace; the layers are idmapped
    /// through it.
    pub(crate) userns_pid: i32,
}

/// Builds `layout.rootfs()`. On error, what was mounted stays for the
/// caller's teardown to remove (it unmounts everything under the run dir).
pub(crate) fn build(layout: &Layout, spec: &RootfsSpec<'_>) -> Result<()> {
    for layer in spec.layers {
        if !layer.is_dir() {
            return Err(BackendError::Setup(format!("layer {} is not a directory", layer.display())));
        }
    }
    mount_writable(layout, spec.disk_mib, spec.uid_base)?;
    let userns = open_userns(spec.userns_pid)?;
    make_dir(&layout.lowers())?;
    for (index, layer) in spec.layers.iter().enumerate() {
        let target = layout.lower(index);
        make_dir(&target)?;
        mount_idmapped(layer, &target, &userns)?;
    }
    make_dir(&layout.rootfs())?;
    mount_overlay(layout, spec.layers.len())
}

/// A 0755 directory whatever the umask.
fn make_dir(path: &Path) -> Result<()> {
    fs::DirBuilder::new().mode(0o755).create(path).map_err(|e| io_err("mkdir", path, e))?;
    fs::set_permissions(path, fs::Permissions::from_mode(0o755)).map_err(|e| io_err("chmod", path, e))
}

fn io_err(op: &str, path: &Path, e: impl Into<io::Error>) -> BackendError {
    BackendError::io(format!("{op} {}", path.display()), e.into())
}

/// A tmpfs whose size is the disk limit, with `upper/` and `work/` owned by
/// the sandbox's root.
fn mount_writable(layout: &Layout, disk_mib: u64, uid_base: u32) -> Result<()> {
    let rw = layout.rw();
    make_dir(&rw)?;
    let options = CString::new(format!("size={disk_mib}m,mode=0755,uid={uid_base},gid={uid_base}"))
        .map_err(|e| io_err("tmpfs options for", &rw, io::Error::other(e)))?;
    mount("tmpfs", &rw, "tmpfs", MountFlags::NOSUID | MountFlags::NODEV, Some(options.as_c_str()))
        .map_err(|e| io_err("mount tmpfs on", &rw, e))?;
    for dir in [layout.upper(), layout.work()] {
        make_dir(&dir)?;
        rustix::fs::chown(&dir, Some(Uid::from_raw(uid_base)), Some(Gid::from_raw(uid_base)))
            .map_err(|e| io_err("chown", &dir, e))?;
    }
    Ok(())
}

fn open_userns(pid: i32) -> Result<OwnedFd> {
    let path = PathBuf::from(format!("/proc/{pid}/ns/user"));
    rustix::fs::open(&path, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty()).map_err(|e| io_err("open", &path, e))
}

/// Mounts a read-only clone of `layer` at `target` in which ids are shifted
/// through `userns`: uid 0 in the layer shows as the sandbox's base uid.
fn mount_idmapped(layer: &Path, target: &Path, userns: &OwnedFd) -> Result<()> {
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
    move_mount(tree.as_fd(), "", CWD, target, MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH)
        .map_err(|e| io_err("move_mount to", target, e))
}

/// Overlayfs at `rootfs` over the idmapped lowers. Each lower goes in as its
/// own `lowerdir+` so no path needs escaping and the option page cannot
/// overflow. Devices are off: a device node in an image must not open a host
/// device.
fn mount_overlay(layout: &Layout, layers: usize) -> Result<()> {
    let target = layout.rootfs();
    let fs = fsopen("overlay", FsOpenFlags::FSOPEN_CLOEXEC).map_err(|e| io_err("fsopen overlay for", &target, e))?;
    // Overlay's first lower is the top one; the spec lists layers bottom first.
    for index in (0..layers).rev() {
        let lower = layout.lower(index);
        fsconfig_set_string(fs.as_fd(), "lowerdir+", &lower).map_err(|e| io_err("overlay lowerdir+", &lower, e))?;
    }
    let (upper, work) = (layout.upper(), layout.work());
    fsconfig_set_string(fs.as_fd(), "upperdir", &upper).map_err(|e| io_err("overlay upperdir", &upper, e))?;
    fsconfig_set_string(fs.as_fd(), "workdir", &work).map_err(|e| io_err("overlay workdir", &work, e))?;
    fsconfig_create(fs.as_fd()).map_err(|e| io_err("create overlay for", &target, e))?;
    let mnt = fsmount(fs.as_fd(), FsMountFlags::FSMOUNT_CLOEXEC, MountAttrFlags::MOUNT_ATTR_NODEV)
        .map_err(|e| io_err("fsmount overlay for", &target, e))?;
    move_mount(mnt.as_fd(), "", CWD, &target, MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH)
        .map_err(|e| io_err("move_mount to", &target, e))
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

/// Unmounts everything at or below `dir`, deepest first. A mount still
/// busy (an open file handle of the node, say) is detached instead.
pub(crate) fn unmount_all_under(dir: &Path) -> Result<()> {
    // Each pass removes at least one mount; the bound only guards against a
    // mount that keeps reappearing.
    for _ in 0..1000 {
        let mounts = mounts_under(dir)?;
        let Some(point) = mounts.first() else { return Ok(()) };
        match unmount(point, UnmountFlags::NOFOLLOW) {
            Ok(()) => {}
            Err(rustix::io::Errno::BUSY) => {
                unmount(point, UnmountFlags::NOFOLLOW | UnmountFlags::DETACH)
                    .map_err(|e| io_err("detach", point, e))?;
            }
            // Gone between reading mountinfo and the call.
            Err(rustix::io::Errno::INVAL | rustix::io::Errno::NOENT) => {}
            Err(e) => return Err(io_err("unmount", point, e)),
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

    #[test]
    fn overlay_of_idmapped_layers_shifts_ownership_and_unmounts_cleanly() {
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
        let run = tmp.path().join("run");
        fs::create_dir(&run).unwrap();
        let layout = Layout::new(&run, "sb");
        fs::create_dir(layout.dir()).unwrap();
        let _unmount = Unmount(layout.dir().to_path_buf());

        let base = 1 << 30;
        let userns = Userns::new(base);
        let spec = RootfsSpec {
            layers: &[bottom.clone(), top.clone()],
            disk_mib: 4,
            uid_base: base,
            userns_pid: userns.0.id() as i32,
        };
        build(&layout, &spec).unwrap();

        let root = layout.rootfs();
        assert_eq!(fs::read_to_string(root.join("shadowed")).unwrap(), "top");
        assert_eq!(fs::metadata(root.join("etc")).unwrap().uid(), base);
        assert_eq!(fs::metadata(root.join("etc/name")).unwrap().uid(), base + 1000);
        assert_eq!(fs::metadata(&root).unwrap().uid(), base);
        // The layers themselves are untouched and read-only through the clones.
        assert_eq!(fs::metadata(bottom.join("etc")).unwrap().uid(), 0);
        assert!(fs::write(layout.lower(0).join("x"), "").is_err());
        // Writes land in the tmpfs upper layer, bounded by its size.
        fs::write(root.join("new"), "x").unwrap();
        assert!(layout.upper().join("new").exists());
        assert!(!top.join("new").exists());
        let big = vec![0u8; 5 << 20];
        assert_eq!(fs::write(root.join("big"), &big).unwrap_err().raw_os_error(), Some(libc::ENOSPC));

        assert_eq!(mounts_under(layout.dir()).unwrap().len(), 4);
        unmount_all_under(layout.dir()).unwrap();
        assert!(mounts_under(layout.dir()).unwrap().is_empty());
    }

    #[test]
    fn mountinfo_escapes_are_decoded() {
        assert_eq!(unescape_mountinfo(r"/tmp/a\040b\134c"), "/tmp/a b\\c");
        assert_eq!(unescape_mountinfo(r"/x\09"), r"/x\09");
    }
}

//! Host-side setups that put a real host object inside a sandbox: a real
//! XFS filesystem for the `XFS_IOC_SWAPEXT` incident (an image made with
//! `mkfs.xfs`, loop-mounted on the host), or the sandbox's own control
//! socket, attached in the sandbox's mount namespace with host-side tools
//! only (`open_tree` on the host, `setns` + `move_mount` in a short-lived
//! child). Dropping an [`Xfs`] unmounts the host mount; the sandbox's copy
//! goes with its namespace.

use std::ffi::CString;
use std::fs;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// What the protected file holds; the sandbox must never read it.
pub const PROTECTED_TEXT: &str = "the-answer-is-42\n";

pub struct Xfs {
    pub mnt: PathBuf,
    image: PathBuf,
    mounted: bool,
}

impl Xfs {
    /// A 300 MiB sparse image (XFS's minimum), formatted and loop-mounted
    /// at `dir/mnt`, with `protected/answer.txt` (0600, host root) and a
    /// world-writable `agent/` for the sandbox's own files.
    pub fn make(dir: &Path) -> Xfs {
        fs::create_dir_all(dir.join("mnt")).expect("mkdir for the XFS mount");
        let image = dir.join("xfs.img");
        let file = fs::File::create(&image).expect("create the XFS image");
        file.set_len(300 << 20).expect("size the XFS image");
        drop(file);
        run(Command::new("mkfs.xfs").arg("-q").arg(&image));
        let mnt = dir.join("mnt");
        run(Command::new("mount").args(["-t", "xfs", "-o", "loop"]).arg(&image).arg(&mnt));
        let xfs = Xfs { mnt, image, mounted: true };
        fs::create_dir(xfs.mnt.join("protected")).expect("mkdir protected");
        fs::write(xfs.mnt.join("protected/answer.txt"), PROTECTED_TEXT).expect("write the protected file");
        fs::set_permissions(xfs.mnt.join("protected/answer.txt"), fs::Permissions::from_mode(0o600)).expect("chmod");
        fs::create_dir(xfs.mnt.join("agent")).expect("mkdir agent");
        fs::set_permissions(xfs.mnt.join("agent"), fs::Permissions::from_mode(0o1777)).expect("chmod");
        fs::set_permissions(xfs.mnt.join("protected"), fs::Permissions::from_mode(0o755)).expect("chmod");
        xfs
    }

    /// Clones the mount and attaches the clone at `target` (which must
    /// exist) inside the mount namespace of host pid `pid`.
    pub fn bind_into(&self, pid: i32, target: &str) -> io::Result<()> {
        attach_into(&self.mnt, pid, target)
    }

    /// The filesystem still takes writes and the protected file is intact.
    pub fn healthy(&self) -> Result<(), String> {
        let probe = self.mnt.join("agent/host-write-check");
        fs::write(&probe, "ok").map_err(|e| format!("the XFS filesystem refuses writes after the case: {e}"))?;
        let _ = fs::remove_file(&probe);
        let text = fs::read_to_string(self.mnt.join("protected/answer.txt")).map_err(|e| e.to_string())?;
        match text == PROTECTED_TEXT {
            true => Ok(()),
            false => Err(format!("the protected file changed: {text:?}")),
        }
    }
}

impl Drop for Xfs {
    fn drop(&mut self) {
        if self.mounted {
            let _ = Command::new("umount").arg(&self.mnt).status();
        }
        let _ = fs::remove_file(&self.image);
    }
}

/// Bind-mounts the host's `source` (a directory or a single file, such as
/// a socket) at `target`, which must exist and be of the same kind, inside
/// the mount namespace of host pid `pid`: `open_tree` on the host, then
/// `setns` + `move_mount` in a short-lived single-threaded child.
pub fn attach_into(source: &Path, pid: i32, target: &str) -> io::Result<()> {
    let tree: OwnedFd = rustix::mount::open_tree(
        rustix::fs::CWD,
        source,
        rustix::mount::OpenTreeFlags::OPEN_TREE_CLONE
            | rustix::mount::OpenTreeFlags::OPEN_TREE_CLOEXEC
            | rustix::mount::OpenTreeFlags::AT_RECURSIVE,
    )?;
    let ns: OwnedFd = fs::File::open(format!("/proc/{pid}/ns/mnt"))?.into();
    let target = CString::new(target).map_err(io::Error::other)?;
    let (tree_fd, ns_fd) = (tree.as_raw_fd(), ns.as_raw_fd());
    let mut cmd = Command::new("/bin/true");
    // SAFETY: between fork and exec the child makes only raw system calls
    // (setns, move_mount) on descriptors and a C string prepared before the
    // fork; nothing is allocated or freed. setns into a mount namespace
    // needs a single-threaded process, which the child is.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(ns_fd, libc::CLONE_NEWNS) != 0 {
                return Err(io::Error::last_os_error());
            }
            let rc = libc::syscall(
                libc::SYS_move_mount,
                tree_fd,
                c"".as_ptr(),
                libc::AT_FDCWD,
                target.as_ptr(),
                MOVE_MOUNT_F_EMPTY_PATH,
            );
            if rc != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let status = cmd.status()?;
    match status.success() {
        true => Ok(()),
        false => Err(io::Error::other(format!("the mount child exited {status}"))),
    }
}

const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x4;

fn run(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("run {cmd:?}: {e} (scripts/setup-host.sh installs xfsprogs)"));
    assert!(out.status.success(), "{cmd:?}: {}", String::from_utf8_lossy(&out.stderr));
}

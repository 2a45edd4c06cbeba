//! `pack_diff`'s scrub list, applied to the image a packed layer makes, not
//! only to the layer: a path the sandbox never wrote (a task's answers in
//! the workspace layer, say) lives in a layer below, and removing it from
//! the new layer alone would leave it in the new image.
//!
//! Each path is resolved in the new image as a sandbox would see it - the
//! new layer over the image's layers, mounted read-only as one overlay -
//! with symlinks kept inside its root; whatever is there is then hidden by
//! an overlay whiteout at that place in the new layer (parent directories
//! the layer lacks are made with the owner, mode and times the image shows
//! there, so the merged directory looks as before). The overlay is a
//! detached mount (`fsopen`/`fsmount`): it is attached nowhere and goes
//! with its descriptor, so nothing is left mounted even if the node dies
//! midway.

use std::ffi::{OsStr, OsString};
use std::fs;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{chown, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, Mode, OFlags, Timespec, Timestamps};
use rustix::mount::{FsMountFlags, FsOpenFlags, MountAttrFlags};

use crate::error::{IoContext, Result};
use crate::ImageError;

/// Symlinks followed while resolving one path (the kernel's own limit).
const MAX_SYMLINKS: usize = 40;

/// A directory on the way to a hidden path, as the image shows it.
#[derive(Debug, Clone)]
struct Ancestor {
    name: OsString,
    stat: rustix::fs::Stat,
}

/// A path to hide: where it resolved in the image, and the directories above it.
#[derive(Debug)]
struct Found {
    ancestors: Vec<Ancestor>,
    name: OsString,
}

/// Hides every path of `paths` (absolute, as the sandbox names them) in the
/// image made of `layer` (the new top layer, in overlay form) over `lowers`
/// (the image's layer directories, bottom first). Returns the places that
/// got a whiteout, as paths inside the image; a path that is not in the
/// image is fine and not among them.
pub fn hide_in_image(layer: &Path, lowers: &[PathBuf], paths: &[String]) -> Result<Vec<String>> {
    if paths.is_empty() {
        return Ok(Vec::new());
    }
    let found = {
        let view = mount_view(layer, lowers)?;
        let mut found = Vec::new();
        for path in paths {
            if let Some(f) = resolve(&view, path).context(|| format!("resolving {path} in the packed image"))? {
                found.push(f);
            }
        }
        found
        // The view goes here, before the layer under it changes.
    };
    let mut hidden = Vec::new();
    for f in found {
        hidden.extend(whiteout(layer, &f)?);
    }
    Ok(hidden)
}

/// `layer` over `lowers`, read-only, mounted nowhere: a root directory fd.
fn mount_view(layer: &Path, lowers: &[PathBuf]) -> Result<OwnedFd> {
    let mount = || -> io::Result<OwnedFd> {
        let fs = rustix::mount::fsopen("overlay", FsOpenFlags::FSOPEN_CLOEXEC)?;
        // `lowerdir+` takes one path per call (no `:` or `,` escaping), top first.
        rustix::mount::fsconfig_set_string(fs.as_fd(), "lowerdir+", layer)?;
        for lower in lowers.iter().rev() {
            rustix::mount::fsconfig_set_string(fs.as_fd(), "lowerdir+", lower.as_path())?;
        }
        rustix::mount::fsconfig_create(fs.as_fd())?;
        let attrs =
            MountAttrFlags::MOUNT_ATTR_RDONLY | MountAttrFlags::MOUNT_ATTR_NODEV | MountAttrFlags::MOUNT_ATTR_NOSUID;
        let mnt = rustix::mount::fsmount(fs.as_fd(), FsMountFlags::FSMOUNT_CLOEXEC, attrs)?;
        Ok(rustix::fs::openat(mnt, ".", OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())?)
    };
    mount().context(|| format!("mounting {} over the image's layers to scrub it", layer.display()))
}

/// Where `path` is in the tree at `root`, resolving `..` and symlinks of
/// its directories inside that root (as `RESOLVE_IN_ROOT` does); its last
/// component is not followed (a symlink is hidden itself). `None`: not there.
fn resolve(root: &OwnedFd, path: &str) -> io::Result<Option<Found>> {
    let mut todo: Vec<OsString> = components(path.as_bytes());
    todo.reverse();
    let mut at: Vec<(Ancestor, OwnedFd)> = Vec::new();
    let mut links = 0;
    while let Some(name) = todo.pop() {
        if name == ".." {
            at.pop();
            if todo.is_empty() {
                // The path ends in `..`: it names the directory reached.
                return Ok(at.pop().map(|(target, _)| Found {
                    ancestors: at.into_iter().map(|(a, _)| a).collect(),
                    name: target.name,
                }));
            }
            continue;
        }
        let dir = at.last().map_or(root, |(_, fd)| fd);
        let stat = match rustix::fs::statat(dir, name.as_os_str(), AtFlags::SYMLINK_NOFOLLOW) {
            Ok(stat) => stat,
            Err(rustix::io::Errno::NOENT | rustix::io::Errno::NOTDIR) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let kind = rustix::fs::FileType::from_raw_mode(stat.st_mode);
        if todo.is_empty() {
            let ancestors = at.into_iter().map(|(a, _)| a).collect();
            return Ok(Some(Found { ancestors, name }));
        }
        match kind {
            rustix::fs::FileType::Directory => {
                let fd = rustix::fs::openat(
                    dir,
                    name.as_os_str(),
                    OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                    Mode::empty(),
                )?;
                at.push((Ancestor { name, stat }, fd));
            }
            rustix::fs::FileType::Symlink => {
                links += 1;
                if links > MAX_SYMLINKS {
                    return Err(io::Error::from_raw_os_error(libc::ELOOP));
                }
                let target = rustix::fs::readlinkat(dir, name.as_os_str(), Vec::new())?;
                let target = target.as_bytes();
                if target.starts_with(b"/") {
                    at.clear();
                }
                todo.extend(components(target).into_iter().rev());
            }
            // A file where a directory was named: nothing below it.
            _ => return Ok(None),
        }
    }
    // The root itself (`/`, or `..` past it): the API refuses `/`.
    Ok(None)
}

fn components(path: &[u8]) -> Vec<OsString> {
    path.split(|&b| b == b'/')
        .filter(|c| !c.is_empty() && *c != b".")
        .map(|c| OsStr::from_bytes(c).to_os_string())
        .collect()
}

/// Puts a whiteout for `found` into `layer`, making the directories above
/// it that the layer lacks; what the layer had there goes. `None`: a
/// directory above it got a whiteout of its own (an earlier path).
fn whiteout(layer: &Path, found: &Found) -> Result<Option<String>> {
    let mut dir = layer.to_path_buf();
    for ancestor in &found.ancestors {
        dir.push(&ancestor.name);
        match fs::symlink_metadata(&dir) {
            Ok(meta) if meta.is_dir() => {}
            Ok(meta) if meta.file_type().is_char_device() && meta.rdev() == 0 => return Ok(None),
            Ok(_) => {
                // The image shows a directory here, which a non-directory
                // in the top layer would have hidden: not the layer we read.
                return Err(ImageError::Corrupt {
                    name: layer.display().to_string(),
                    reason: format!("{} changed while it was scrubbed", dir.display()),
                });
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => make_dir_like(&dir, &ancestor.stat)?,
            Err(e) => return Err(e).context(|| format!("stat {}", dir.display())),
        }
    }
    let target = dir.join(&found.name);
    match fs::symlink_metadata(&target) {
        Ok(meta) if meta.is_dir() => fs::remove_dir_all(&target),
        Ok(_) => fs::remove_file(&target),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
    .context(|| format!("removing {}", target.display()))?;
    // overlayfs's whiteout: a character device numbered 0:0.
    rustix::fs::mknodat(
        rustix::fs::CWD,
        &target,
        rustix::fs::FileType::CharacterDevice,
        Mode::empty(),
        rustix::fs::makedev(0, 0),
    )
    .map_err(io::Error::from)
    .context(|| format!("making a whiteout at {}", target.display()))?;
    let inside = target.strip_prefix(layer).unwrap_or(&target);
    Ok(Some(format!("/{}", inside.display())))
}

/// A directory at `path` with the owner, mode and times of `like`.
fn make_dir_like(path: &Path, like: &rustix::fs::Stat) -> Result<()> {
    let what = || format!("making {}", path.display());
    fs::create_dir(path).context(what)?;
    chown(path, Some(like.st_uid), Some(like.st_gid)).context(what)?;
    // After the chown, which clears set-id bits.
    fs::set_permissions(path, fs::Permissions::from_mode(like.st_mode & 0o7777)).context(what)?;
    let times = Timestamps {
        last_access: Timespec { tv_sec: like.st_atime, tv_nsec: like.st_atime_nsec as _ },
        last_modification: Timespec { tv_sec: like.st_mtime, tv_nsec: like.st_mtime_nsec as _ },
    };
    rustix::fs::utimensat(rustix::fs::CWD, path, &times, AtFlags::SYMLINK_NOFOLLOW)
        .map_err(io::Error::from)
        .context(what)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    fn is_whiteout(path: &Path) -> bool {
        fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_char_device() && m.rdev() == 0)
    }

    /// Needs root (an overlay mount); the suite runs as root.
    #[test]
    fn paths_in_lower_layers_get_whiteouts_and_new_ones_are_only_removed() {
        let tmp = tempfile::tempdir().unwrap();
        let (base, work, layer) = (tmp.path().join("base"), tmp.path().join("work"), tmp.path().join("new"));
        fs::create_dir_all(base.join("repo/tests")).unwrap();
        fs::write(base.join("repo/tests/answers.txt"), "42").unwrap();
        fs::write(base.join("repo/keep.txt"), "keep").unwrap();
        fs::set_permissions(base.join("repo"), fs::Permissions::from_mode(0o750)).unwrap();
        chown(base.join("repo"), Some(1000), Some(1000)).unwrap();
        fs::create_dir_all(work.join("srv/old")).unwrap();
        fs::write(work.join("srv/solution.py"), "print(42)").unwrap();
        // Merged /usr: /lib is a symlink in the layer above the one holding its target.
        fs::create_dir_all(base.join("usr/lib")).unwrap();
        fs::write(base.join("usr/lib/leak.so"), "x").unwrap();
        symlink("usr/lib", work.join("lib")).unwrap();
        fs::create_dir_all(layer.join("tmp")).unwrap();
        fs::write(layer.join("tmp/build.log"), "log").unwrap();
        let lowers = [base.clone(), work.clone()];
        let scrub = [
            "/repo/tests/answers.txt",
            "/srv/old/..",
            "/srv/../srv/solution.py",
            "/lib/leak.so",
            "/tmp/build.log",
            "/not/there",
            "/repo/keep.txt/..",
        ]
        .map(String::from);
        let mut hidden = hide_in_image(&layer, &lowers, &scrub).unwrap();
        hidden.sort();
        // `keep.txt/..` names nothing (a file is no directory); `/srv/old/..`
        // is `/srv`, whose whiteout hides `solution.py` in it already.
        assert_eq!(hidden, ["/repo/tests/answers.txt", "/srv", "/tmp/build.log", "/usr/lib/leak.so"]);
        assert!(is_whiteout(&layer.join("repo/tests/answers.txt")));
        assert!(is_whiteout(&layer.join("usr/lib/leak.so")), "resolved through the lower layer's symlink");
        assert!(is_whiteout(&layer.join("tmp/build.log")), "the layer's own file replaced");
        assert!(!layer.join("not").exists(), "nothing made for a path the image lacks");
        let repo = fs::metadata(layer.join("repo")).unwrap();
        assert_eq!((repo.mode() & 0o7777, repo.uid(), repo.gid()), (0o750, 1000, 1000), "made like the image's");
        assert_eq!(repo.mtime(), fs::metadata(base.join("repo")).unwrap().mtime());
        // The lower layers are untouched: only the new layer hides.
        assert_eq!(fs::read_to_string(base.join("repo/tests/answers.txt")).unwrap(), "42");
        // And the image, mounted again, no longer has them.
        let view = mount_view(&layer, &lowers).unwrap();
        for path in &scrub {
            assert!(resolve(&view, path).unwrap().is_none(), "{path} is gone from the image");
        }
        assert!(resolve(&view, "/repo/tests").unwrap().is_some(), "its directory stays");
        assert!(resolve(&view, "/repo/keep.txt").unwrap().is_some(), "a path through a file hides nothing");
    }

    #[test]
    fn symlink_loops_and_escapes_stay_inside() {
        let tmp = tempfile::tempdir().unwrap();
        let (base, layer) = (tmp.path().join("base"), tmp.path().join("new"));
        fs::create_dir_all(base.join("d")).unwrap();
        fs::create_dir_all(&layer).unwrap();
        symlink("/loop", base.join("loop")).unwrap();
        symlink("../../../../etc", base.join("d/up")).unwrap();
        let view = mount_view(&layer, std::slice::from_ref(&base)).unwrap();
        let looped = resolve(&view, "/loop/x").unwrap_err();
        assert_eq!(looped.raw_os_error(), Some(libc::ELOOP));
        // `..` past the root stays at the root: the host's /etc/passwd is not in the image.
        assert!(resolve(&view, "/d/up/passwd").unwrap().is_none());
    }
}

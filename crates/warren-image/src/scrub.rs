//! `pack_diff`'s scrub list, applied to the image a packed layer makes, not
//! only to the layer: a path the sandbox never wrote (a task's answers in
//! the workspace layer, say) lives in a layer below, and removing it from
//! the new layer alone would leave it in the new image.
//!
//! Each path is resolved in the new image as a sandbox would see it - the
//! new layer over the image's layers, mounted read-only as one overlay -
//! with symlinks kept inside its root. What the new layer has at that
//! place goes; if the layers below have something there too (and no opaque
//! directory of the new layer hides it already), an overlay whiteout takes
//! its place, and parent directories the layer lacks are made with the
//! owner, mode and times the image shows there, so the merged directory
//! looks as before. A whiteout is only made over something: in a
//! directory no lower layer has, overlayfs lists it (as a `c?????????`
//! entry) instead of hiding it. The overlays are detached mounts
//! (`fsopen`/`fsmount`): attached nowhere, gone with their descriptors, so
//! nothing is left mounted even if the node dies midway.

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
    /// The layers below the new one have an entry at this place.
    below: bool,
}

/// Hides every path of `paths` (absolute, as the sandbox names them) in the
/// image made of `layer` (the new top layer, in overlay form) over `lowers`
/// (the image's layer directories, bottom first). Returns the places it
/// hid, as paths inside the image (see `hide`); a path that is not in
/// the image is fine and not among them.
pub fn hide_in_image(layer: &Path, lowers: &[PathBuf], paths: &[String]) -> Result<Vec<String>> {
    if paths.is_empty() {
        return Ok(Vec::new());
    }
    let found = {
        let mut top_first = vec![layer.to_path_buf()];
        top_first.extend(lowers.iter().rev().cloned());
        let image = view(&top_first)?;
        let below = if lowers.is_empty() { None } else { Some(view(&top_first[1..])?) };
        let mut found = Vec::new();
        for path in paths {
            if let Some(mut f) = resolve(&image, path).context(|| format!("resolving {path} in the packed image"))? {
                if let Some(below) = &below {
                    f.below = exists(below, &f).context(|| format!("looking up {path} below the packed layer"))?;
                }
                found.push(f);
            }
        }
        found
        // The views go here, before the layer under them changes.
    };
    let mut hidden = Vec::new();
    for f in found {
        hidden.extend(hide(layer, &f)?);
    }
    Ok(hidden)
}

/// The tree `layers` (top first, at least one) make, read-only: a root
/// directory fd of an overlay mounted nowhere, or of the one layer itself
/// (an overlay without an upper layer needs two).
fn view(layers: &[PathBuf]) -> Result<OwnedFd> {
    let what = || format!("opening the tree of the layers {layers:?} to scrub it");
    match layers {
        [one] => rustix::fs::open(one, OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())
            .map_err(io::Error::from)
            .context(what),
        _ => mount_view(layers).context(what),
    }
}

fn mount_view(layers: &[PathBuf]) -> io::Result<OwnedFd> {
    {
        let fs = rustix::mount::fsopen("overlay", FsOpenFlags::FSOPEN_CLOEXEC)?;
        // `lowerdir+` takes one path per call (no `:` or `,` escaping), top first.
        for layer in layers {
            rustix::mount::fsconfig_set_string(fs.as_fd(), "lowerdir+", layer.as_path())?;
        }
        rustix::mount::fsconfig_create(fs.as_fd())?;
        let attrs =
            MountAttrFlags::MOUNT_ATTR_RDONLY | MountAttrFlags::MOUNT_ATTR_NODEV | MountAttrFlags::MOUNT_ATTR_NOSUID;
        let mnt = rustix::mount::fsmount(fs.as_fd(), FsMountFlags::FSMOUNT_CLOEXEC, attrs)?;
        Ok(rustix::fs::openat(mnt, ".", OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())?)
    }
}

/// Whether the tree at `root` has an entry where `found` is (its
/// directories are not followed: they were resolved in the image).
fn exists(root: &OwnedFd, found: &Found) -> io::Result<bool> {
    let mut dir: Option<OwnedFd> = None;
    for ancestor in &found.ancestors {
        let at = dir.as_ref().unwrap_or(root);
        match rustix::fs::openat(
            at,
            ancestor.name.as_os_str(),
            OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        ) {
            Ok(fd) => dir = Some(fd),
            // Missing, or not a directory (a symlink among them).
            Err(rustix::io::Errno::NOENT | rustix::io::Errno::NOTDIR | rustix::io::Errno::LOOP) => return Ok(false),
            Err(e) => return Err(e.into()),
        }
    }
    match rustix::fs::statat(dir.as_ref().unwrap_or(root), found.name.as_os_str(), AtFlags::SYMLINK_NOFOLLOW) {
        Ok(_) => Ok(true),
        Err(rustix::io::Errno::NOENT) => Ok(false),
        Err(e) => Err(e.into()),
    }
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
                    below: false,
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
            return Ok(Some(Found { ancestors, name, below: false }));
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

/// Takes `found` out of the image at `layer`: what the layer has there
/// goes, and if the layers below have something there that no opaque
/// directory of the layer hides, a whiteout takes its place (with the
/// directories above it the layer lacks). `None`: a directory above it is
/// a whiteout already (an earlier path of the list).
fn hide(layer: &Path, found: &Found) -> Result<Option<String>> {
    let mut dir = layer.to_path_buf();
    let mut below = found.below;
    for ancestor in &found.ancestors {
        dir.push(&ancestor.name);
        match fs::symlink_metadata(&dir) {
            Ok(meta) if meta.is_dir() => below &= !is_opaque(&dir)?,
            Ok(meta) if meta.file_type().is_char_device() && meta.rdev() == 0 => return Ok(None),
            Ok(_) => {
                // The image shows a directory here, which a non-directory
                // in the top layer would have hidden: not the layer we read.
                return Err(ImageError::Corrupt {
                    name: layer.display().to_string(),
                    reason: format!("{} changed while it was scrubbed", dir.display()),
                });
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound && below => make_dir_like(&dir, &ancestor.stat)?,
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
    if below {
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
    }
    let inside = target.strip_prefix(layer).unwrap_or(&target);
    Ok(Some(format!("/{}", inside.display())))
}

/// overlayfs's mark of a directory that hides the layers below it.
fn is_opaque(dir: &Path) -> Result<bool> {
    let mut value = [0u8; 1];
    match rustix::fs::lgetxattr(dir, "trusted.overlay.opaque", &mut value) {
        Ok(n) => Ok(n == 1 && value[0] == b'y'),
        Err(rustix::io::Errno::NODATA | rustix::io::Errno::RANGE) => Ok(false),
        Err(e) => Err(io::Error::from(e)).context(|| format!("reading the xattrs of {}", dir.display())),
    }
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

    /// The image `layer` over `lowers` (bottom first) makes.
    fn image(layer: &Path, lowers: &[PathBuf]) -> OwnedFd {
        let mut top_first = vec![layer.to_path_buf()];
        top_first.extend(lowers.iter().rev().cloned());
        view(&top_first).unwrap()
    }

    fn is_whiteout(path: &Path) -> bool {
        fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_char_device() && m.rdev() == 0)
    }

    /// Needs root (an overlay mount); the suite runs as root.
    #[test]
    fn paths_in_lower_layers_get_whiteouts_and_the_layers_own_are_only_removed() {
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
        // An opaque directory of the new layer already hides the one below.
        fs::create_dir_all(base.join("opq")).unwrap();
        fs::write(base.join("opq/x"), "old").unwrap();
        fs::create_dir_all(layer.join("opq")).unwrap();
        fs::write(layer.join("opq/x"), "new").unwrap();
        rustix::fs::setxattr(layer.join("opq"), "trusted.overlay.opaque", b"y", rustix::fs::XattrFlags::empty())
            .unwrap();
        let lowers = [base.clone(), work.clone()];
        let scrub = [
            "/repo/tests/answers.txt",
            "/srv/old/..",
            "/srv/../srv/solution.py",
            "/lib/leak.so",
            "/tmp/build.log",
            "/opq/x",
            "/not/there",
            "/repo/keep.txt/..",
        ]
        .map(String::from);
        let mut hidden = hide_in_image(&layer, &lowers, &scrub).unwrap();
        hidden.sort();
        // `keep.txt/..` names nothing (a file is no directory); `/srv/old/..`
        // is `/srv`, whose whiteout hides `solution.py` in it already.
        assert_eq!(hidden, ["/opq/x", "/repo/tests/answers.txt", "/srv", "/tmp/build.log", "/usr/lib/leak.so"]);
        assert!(is_whiteout(&layer.join("repo/tests/answers.txt")));
        assert!(is_whiteout(&layer.join("srv")));
        assert!(is_whiteout(&layer.join("usr/lib/leak.so")), "resolved through the lower layer's symlink");
        // Nothing below them: a whiteout there would be listed, not hidden.
        for own in ["tmp/build.log", "opq/x"] {
            assert!(fs::symlink_metadata(layer.join(own)).is_err(), "{own}: removed, no whiteout");
        }
        assert!(!layer.join("not").exists(), "nothing made for a path the image lacks");
        let repo = fs::metadata(layer.join("repo")).unwrap();
        assert_eq!((repo.mode() & 0o7777, repo.uid(), repo.gid()), (0o750, 1000, 1000), "made like the image's");
        assert_eq!(repo.mtime(), fs::metadata(base.join("repo")).unwrap().mtime());
        // The lower layers are untouched: only the new layer hides.
        assert_eq!(fs::read_to_string(base.join("repo/tests/answers.txt")).unwrap(), "42");
        // And the image, mounted again, no longer has them.
        let view = image(&layer, &lowers);
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
        let view = image(&layer, std::slice::from_ref(&base));
        let looped = resolve(&view, "/loop/x").unwrap_err();
        assert_eq!(looped.raw_os_error(), Some(libc::ELOOP));
        // `..` past the root stays at the root: the host's /etc/passwd is not in the image.
        assert!(resolve(&view, "/d/up/passwd").unwrap().is_none());
    }
}

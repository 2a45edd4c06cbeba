use std::collections::HashSet;
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use rustix::fs::FlockOperation;

use crate::error::{ImageError, IoContext, Result};
use crate::fsutil::{fsync_dir, now_ms, random_hex_id, remove_tree, sync_filesystem, write_atomically, DirGuard};
use crate::manifest::{is_layer_id, Manifest};
use crate::name::validate_name;
use crate::tar;

/// Held shared by every open store; taken exclusive only to sweep, so a
/// sweep never deletes another process's import in progress.
const OPEN_LOCK: &str = ".open.lock";
/// Taken exclusive around every manifest change, by every thread and process.
const MANIFEST_LOCK: &str = ".manifest.lock";

/// One read-only directory of an image's stack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layer {
    id: String,
    path: PathBuf,
}

impl Layer {
    pub fn id(&self) -> &str {
        &self.id
    }

    /// An absolute path; treat the tree under it as read-only.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// A named stack of layers, bottom first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Image {
    name: String,
    layers: Vec<Layer>,
    created_at_ms: u64,
}

impl Image {
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn layers(&self) -> &[Layer] {
        &self.layers
    }

    pub fn created_at_ms(&self) -> u64 {
        self.created_at_ms
    }
}

/// Images under one root directory (`<data>/images`):
/// `layers/<id>/` (trees), `manifests/<name>.json`, `tmp/` (work in
/// progress, swept on open). Several stores, in one process or several, may
/// share a root.
///
/// Removing or replacing an image deletes its layer directories at once; the
/// caller must not remove an image that running sandboxes still use.
pub struct ImageStore {
    root: PathBuf,
    open_lock: File,
}

impl ImageStore {
    /// Opens (creating if needed) the store at `root`. If no other store has
    /// it open, also removes what a crash left behind: everything in `tmp/`
    /// and layers no manifest names. The sweep may also be skipped while a
    /// child forked by this process has not yet exec'd (it briefly shares the
    /// lock); skipping only delays the cleanup to a later open.
    pub fn open(root: impl AsRef<Path>) -> Result<Self> {
        let root = root.as_ref();
        for dir in [root.to_path_buf(), root.join("layers"), root.join("manifests"), root.join("tmp")] {
            std::fs::create_dir_all(&dir).context(|| format!("creating {}", dir.display()))?;
        }
        // Absolute, so layer paths stay valid after the caller changes directory.
        let root = root.canonicalize().context(|| format!("resolving {}", root.display()))?;
        let open_lock = open_lock_file(&root.join(OPEN_LOCK))?;
        let store = Self { root, open_lock };
        if try_flock(&store.open_lock, FlockOperation::NonBlockingLockExclusive)? {
            store.sweep()?;
        }
        flock(&store.open_lock, FlockOperation::LockShared)?;
        Ok(store)
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Imports the tree under `src` as a one-layer image `name`, replacing
    /// any image of that name.
    pub fn import_dir(&self, name: &str, src: &Path) -> Result<Image> {
        self.import_layers(name, &[src])
    }

    /// Imports the directories `layer_srcs` (bottom first) as one layer each.
    pub fn import_layers(&self, name: &str, layer_srcs: &[&Path]) -> Result<Image> {
        validate_name(name)?;
        for src in layer_srcs {
            if !src.is_dir() {
                return Err(ImageError::NotADirectory(src.to_path_buf()));
            }
        }
        let mut layers = Vec::with_capacity(layer_srcs.len());
        for src in layer_srcs {
            layers.push(self.build_layer(|dst| tar::copy_dir(src, dst))?);
        }
        self.publish(name, layers)
    }

    /// Imports a tar stream (plain, gzip, zstd or xz) as a one-layer image
    /// `name`, replacing any image of that name.
    pub fn import_tar(&self, name: &str, tar: impl Read) -> Result<Image> {
        validate_name(name)?;
        let layer = self.build_layer(|dst| tar::extract(tar, dst))?;
        self.publish(name, vec![layer])
    }

    /// Makes image `name` from the layers of image `base` plus one new top
    /// layer that `fill` writes into an empty directory. The base's layers
    /// are shared, not copied.
    pub fn extend(&self, name: &str, base: &str, fill: impl FnOnce(&Path) -> Result<()>) -> Result<Image> {
        validate_name(name)?;
        let base_ids = Manifest::load(&self.manifest_path(base), base)?.layers;
        let (top_id, top) = self.build_layer(fill)?;
        let mut ids = base_ids;
        ids.push(top_id);
        self.publish_ids(name, ids, vec![top])
    }

    pub fn get(&self, name: &str) -> Result<Image> {
        validate_name(name)?;
        let manifest = Manifest::load(&self.manifest_path(name), name)?;
        self.image_from(manifest)
    }

    /// All images, sorted by name.
    pub fn list(&self) -> Result<Vec<Image>> {
        let mut images = Vec::new();
        for name in self.manifest_names()? {
            match self.get(&name) {
                Ok(image) => images.push(image),
                // Removed between the directory read and now.
                Err(ImageError::NotFound(_)) => {}
                Err(e) => return Err(e),
            }
        }
        images.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(images)
    }

    /// Removes image `name` and the layers no other image uses.
    pub fn remove(&self, name: &str) -> Result<()> {
        validate_name(name)?;
        let _lock = self.lock_manifests()?;
        let path = self.manifest_path(name);
        // A corrupt manifest is still removable; its layers become orphans
        // for the next sweep instead of being trusted now.
        let layers = match Manifest::load(&path, name) {
            Ok(manifest) => manifest.layers,
            Err(ImageError::Corrupt { .. }) => Vec::new(),
            Err(e) => return Err(e),
        };
        std::fs::remove_file(&path).context(|| format!("removing {}", path.display()))?;
        fsync_dir(&self.root.join("manifests"))?;
        self.remove_unreferenced(&layers)
    }

    /// Fills a fresh directory under `tmp/` with `fill` and moves it into
    /// `layers/` once complete. The guard removes it if anything later fails.
    fn build_layer(&self, fill: impl FnOnce(&Path) -> Result<()>) -> Result<(String, DirGuard)> {
        let id = random_hex_id()?;
        let mut guard = DirGuard::new(self.root.join("tmp").join(&id));
        std::fs::create_dir(guard.path()).context(|| format!("creating {}", guard.path().display()))?;
        // An archive without a "./" entry leaves the root as created; make
        // that independent of this process's umask.
        std::fs::set_permissions(guard.path(), std::fs::Permissions::from_mode(0o755))
            .context(|| format!("setting the mode of {}", guard.path().display()))?;
        fill(guard.path())?;
        // The rename below publishes the tree; its contents must be on disk
        // before the name is.
        sync_filesystem(guard.path())?;
        let dst = self.layer_path(&id);
        std::fs::rename(guard.path(), &dst).context(|| format!("moving layer into {}", dst.display()))?;
        guard.moved_to(dst);
        fsync_dir(&self.root.join("layers"))?;
        Ok((id, guard))
    }

    /// Points `name` at `layers` (replacing the old manifest atomically),
    /// then removes the layers the old manifest used and nothing else does.
    fn publish(&self, name: &str, layers: Vec<(String, DirGuard)>) -> Result<Image> {
        let ids: Vec<String> = layers.iter().map(|(id, _)| id.clone()).collect();
        self.publish_ids(name, ids, layers.into_iter().map(|(_, guard)| guard).collect())
    }

    /// Points `name` at the layer `ids`, of which the `fresh` ones were just built.
    fn publish_ids(&self, name: &str, ids: Vec<String>, fresh: Vec<DirGuard>) -> Result<Image> {
        let manifest = Manifest::new(name, ids, now_ms());
        let _lock = self.lock_manifests()?;
        let path = self.manifest_path(name);
        let old = match Manifest::load(&path, name) {
            Ok(old) => Some(old),
            Err(ImageError::NotFound(_)) => None,
            // A corrupt old manifest is being replaced; its layers are left
            // for the orphan sweep rather than trusted.
            Err(ImageError::Corrupt { .. }) => None,
            Err(e) => return Err(e),
        };
        let scratch = self.root.join("tmp").join(format!("{}.manifest", random_hex_id()?));
        write_atomically(&scratch, &path, &manifest.to_bytes()?)?;
        for guard in fresh {
            guard.keep();
        }
        if let Some(old) = old {
            self.remove_unreferenced(&old.layers)?;
        }
        self.image_from(manifest)
    }

    /// Removes each of `candidates` unless some manifest still names it.
    /// Caller holds the manifest lock. If any manifest is unreadable, what it
    /// names is unknown, so nothing is removed: a leak beats deleting a layer
    /// an image needs.
    fn remove_unreferenced(&self, candidates: &[String]) -> Result<()> {
        let Some(in_use) = self.referenced_layers()? else { return Ok(()) };
        for id in candidates.iter().filter(|id| !in_use.contains(*id)) {
            self.retire_layer(id)?;
        }
        Ok(())
    }

    /// Moves the layer out of `layers/` in one rename, then deletes it, so a
    /// crash mid-delete leaves only `tmp/` debris, never a partial layer.
    fn retire_layer(&self, id: &str) -> Result<()> {
        let from = self.layer_path(id);
        let to = self.root.join("tmp").join(format!("{id}.removed"));
        match std::fs::rename(&from, &to) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            other => other.context(|| format!("retiring layer {}", from.display()))?,
        }
        remove_tree(&to)
    }

    /// The layer ids all manifests name, or `None` if some manifest is corrupt.
    fn referenced_layers(&self) -> Result<Option<HashSet<String>>> {
        let mut ids = HashSet::new();
        for name in self.manifest_names()? {
            match Manifest::load(&self.manifest_path(&name), &name) {
                Ok(m) => ids.extend(m.layers),
                Err(ImageError::NotFound(_)) => {}
                Err(ImageError::Corrupt { .. }) => return Ok(None),
                Err(e) => return Err(e),
            }
        }
        Ok(Some(ids))
    }

    /// Names of the valid manifest files; anything else in the directory is
    /// not ours and is ignored.
    fn manifest_names(&self) -> Result<Vec<String>> {
        let dir = self.root.join("manifests");
        let mut names = Vec::new();
        for entry in std::fs::read_dir(&dir).context(|| format!("reading {}", dir.display()))? {
            let entry = entry.context(|| format!("reading {}", dir.display()))?;
            let file_name = entry.file_name();
            let Some(name) = file_name.to_str().and_then(|f| f.strip_suffix(".json")) else { continue };
            if validate_name(name).is_ok() {
                names.push(name.to_owned());
            }
        }
        Ok(names)
    }

    /// Removes everything in `tmp/` and every layer no manifest names. Only
    /// called while this store holds the open lock exclusively.
    fn sweep(&self) -> Result<()> {
        let tmp = self.root.join("tmp");
        for entry in std::fs::read_dir(&tmp).context(|| format!("reading {}", tmp.display()))? {
            let entry = entry.context(|| format!("reading {}", tmp.display()))?;
            let path = entry.path();
            if entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                remove_tree(&path)?;
            } else {
                std::fs::remove_file(&path).context(|| format!("removing {}", path.display()))?;
            }
        }
        let _lock = self.lock_manifests()?;
        let layers = self.root.join("layers");
        let mut orphans = Vec::new();
        for entry in std::fs::read_dir(&layers).context(|| format!("reading {}", layers.display()))? {
            let entry = entry.context(|| format!("reading {}", layers.display()))?;
            if let Some(id) = entry.file_name().to_str().filter(|id| is_layer_id(id)) {
                orphans.push(id.to_owned());
            }
        }
        self.remove_unreferenced(&orphans)
    }

    fn image_from(&self, manifest: Manifest) -> Result<Image> {
        let mut layers = Vec::with_capacity(manifest.layers.len());
        for id in manifest.layers {
            let path = self.layer_path(&id);
            if !path.is_dir() {
                return Err(ImageError::Corrupt { name: manifest.name, reason: format!("layer {id} is missing") });
            }
            layers.push(Layer { id, path });
        }
        Ok(Image { name: manifest.name, layers, created_at_ms: manifest.created_at_ms })
    }

    fn lock_manifests(&self) -> Result<File> {
        let file = open_lock_file(&self.root.join(MANIFEST_LOCK))?;
        flock(&file, FlockOperation::LockExclusive)?;
        Ok(file)
    }

    fn manifest_path(&self, name: &str) -> PathBuf {
        self.root.join("manifests").join(format!("{name}.json"))
    }

    fn layer_path(&self, id: &str) -> PathBuf {
        self.root.join("layers").join(id)
    }
}

fn open_lock_file(path: &Path) -> Result<File> {
    File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .context(|| format!("opening {}", path.display()))
}

/// A blocking flock; released when the file is closed.
fn flock(file: &File, op: FlockOperation) -> Result<()> {
    rustix::fs::flock(file, op).map_err(std::io::Error::from).context(|| format!("locking ({op:?})"))
}

/// A non-blocking flock: `false` if someone else holds a conflicting lock.
fn try_flock(file: &File, op: FlockOperation) -> Result<bool> {
    match rustix::fs::flock(file, op) {
        Ok(()) => Ok(true),
        Err(rustix::io::Errno::WOULDBLOCK) => Ok(false),
        Err(e) => Err(std::io::Error::from(e)).context(|| format!("locking ({op:?})")),
    }
}

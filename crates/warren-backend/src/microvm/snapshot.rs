//! Snapshot boot (`--vm-snapshots on`, microVMs and full VMs): per image
//! and VM shape the driver keeps the state of a booted, idle guest, and a
//! create restores it instead of booting.
//!
//! A snapshot is a directory `<run_dir>/.snapshots/<key>/` holding `mem`
//! (QEMU's migration stream of the stopped guest: memory and device state,
//! written through a descriptor passed over QMP, see
//! [`super::qmp::migrate_to_file`]), `rw.img` (the writable disk at that
//! moment) and `meta.json` (the image layers it was made from, with their
//! identity). The key hashes everything the guest's state depends on: the
//! layer files and their sources' identity, vCPUs, memory, the disk's size
//! and inodes, the kernel, the init binary and the accelerator.
//!
//! A restore copies `rw.img` (reflinked where the file system can, sparse
//! otherwise) into the sandbox's directory, starts QEMU with the
//! snapshot's exact command line plus `-incoming fd:3` on `mem`, connects
//! the mux (numbering its streams past anything the template's mux used),
//! lets the guest run and sends init `Identify`: the sandbox's hostname,
//! 64 bytes from the host's CRNG mixed into the guest's pool followed by a
//! forced reseed (`RNDADDENTROPY` + `RNDRESEEDCRNG`; clones of one snapshot
//! share their random state until then), and the host's time (the guest's
//! clock stood still in the snapshot). A restore that fails at any step
//! leaves nothing behind and the create boots cold instead.
//!
//! The first create of a shape boots cold and builds the snapshot in the
//! background (a second, template guest that is snapshotted and killed);
//! later creates restore it. The template's memory and vCPUs are reserved
//! in the node's books ([`crate::HostBooks`]) from before its boot until
//! its QEMU and cgroup are gone; a build the node has no room for is not
//! started (a later create of the shape tries again). A full VM's clones
//! keep the template's machine id (systemd reads it once, at boot). Snapshots are never persisted: the driver
//! removes every one when it starts and when the node shuts down. One whose
//! image layers are gone or changed (the image was replaced or removed) is
//! removed when the node's images change and by the next create
//! ([`Snapshots::prune`]); none is restored without checking first.

use std::collections::HashMap;
use std::fs;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::task::JoinHandle;
use warren_guard::cgroup::{Limits, SandboxCgroup};
use warren_init::proto::{FrameKind, Request, Response};

use super::qemu::{self, Accel, Machine, QemuProcess, VmSpec};
use super::{cgroup_err, disks, mux, qmp, Running, QEMU_OVERHEAD_MIB, QEMU_PIDS};
use crate::container::channel;
use crate::{BackendError, HostBooks, Result};

/// The hostname on the snapshotted guest's kernel command line. A restore
/// must start QEMU with the same command line, so every clone's kernel
/// keeps this one in `/proc/cmdline`; its hostname is the sandbox's.
const TEMPLATE_HOSTNAME: &str = "warren-snapshot";
/// A restored guest's mux numbers its streams from here, far past what the
/// template's mux used before the snapshot.
const RESTORED_FIRST_STREAM: u32 = 1 << 24;
/// Writing a few hundred MiB of guest memory to a local file.
const MIGRATE_TIMEOUT: Duration = Duration::from_secs(120);
/// Loading it back, and the identity round trip afterwards: generous, for
/// a loaded two-core machine.
const RESTORE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the template's init gets to see the node disconnect (and drop
/// its streams) before the guest is stopped.
const QUIESCE: Duration = Duration::from_millis(200);
const ENTROPY_BYTES: usize = 64;

/// What a guest's state depends on beyond the image: the VM's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub(super) struct Shape {
    pub vcpus: u32,
    pub memory_mib: u64,
    pub disk_mib: u64,
    pub inodes: u64,
    /// Set at boot in the guest (see `VmSpec::pids`).
    #[serde(default)]
    pub pids: u32,
    /// Set at boot in the guest (see `VmSpec::open_files`).
    #[serde(default)]
    pub open_files: u32,
    /// The guest has a network device (an `allowlist` sandbox): its init
    /// configured `eth0` at boot, and QEMU's user-mode network runs in a
    /// network namespace of the sandbox's own. A guest without one is a
    /// different snapshot: a clone must never get a device its sandbox
    /// did not ask for.
    #[serde(default)]
    pub net: bool,
}

/// An image layer a snapshot was made from, as it was then.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Source {
    path: PathBuf,
    dev: u64,
    ino: u64,
    ctime: i64,
    ctime_nsec: i64,
}

impl Source {
    fn of(path: &Path) -> Option<Source> {
        let meta = fs::metadata(path).ok()?;
        Some(Source {
            path: path.to_path_buf(),
            dev: meta.dev(),
            ino: meta.ino(),
            ctime: meta.ctime(),
            ctime_nsec: meta.ctime_nsec(),
        })
    }

    fn unchanged(&self) -> bool {
        Source::of(&self.path).as_ref() == Some(self)
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct Meta {
    /// The image's layer directories, then the layer files QEMU attaches.
    sources: Vec<Source>,
    shape: Shape,
}

/// Everything a template boot needs, owned (it runs as its own task).
#[derive(Clone)]
pub(super) struct Template {
    pub qemu: PathBuf,
    pub kernel: PathBuf,
    pub initramfs: PathBuf,
    pub accel: Accel,
    pub machine: Machine,
    pub jail: PathBuf,
    pub cgroup_instance: String,
    /// The image's layer directories (what the node passed).
    pub image_layers: Vec<PathBuf>,
    /// The EROFS files QEMU attaches for them.
    pub layer_files: Vec<PathBuf>,
    pub shape: Shape,
}

impl Template {
    /// QEMU's command line for the template or a clone: the same but for
    /// the migration stream to load, the writable disk and the network
    /// namespace, which a guest with a network device needs (QEMU's
    /// user-mode network in the host's namespace would reach everything).
    fn spec<'a>(
        &'a self,
        dir: &'a Snap,
        incoming: Option<&'a fs::File>,
        writable: &'a Path,
        netns: Option<BorrowedFd<'a>>,
        qemu_uid: Option<u32>,
    ) -> Result<VmSpec<'a>> {
        if self.shape.net != netns.is_some() {
            return Err(BackendError::Setup(format!(
                "a VM snapshot's network device ({}) and its network namespace ({}) disagree",
                self.shape.net,
                netns.is_some()
            )));
        }
        Ok(VmSpec {
            qemu: &self.qemu,
            kernel: &self.kernel,
            initramfs: &self.initramfs,
            accel: self.accel,
            machine: self.machine,
            vcpus: self.shape.vcpus,
            memory_mib: self.shape.memory_mib,
            pids: self.shape.pids,
            open_files: self.shape.open_files,
            layers: &self.layer_files,
            writable,
            serial_sock: &dir.serial_sock,
            qmp_sock: &dir.qmp_sock,
            hostname: TEMPLATE_HOSTNAME,
            jail: &self.jail,
            incoming,
            netns,
            writable_by_fd: true,
            qemu_uid,
        })
    }

    fn sources(&self) -> Option<Vec<Source>> {
        self.image_layers.iter().chain(&self.layer_files).map(|p| Source::of(p)).collect()
    }
}

/// The sockets of one QEMU process.
pub(super) struct Snap {
    pub serial_sock: PathBuf,
    pub qmp_sock: PathBuf,
    pub ctl_sock: PathBuf,
}

impl Snap {
    pub fn in_dir(dir: &Path) -> Snap {
        Snap { serial_sock: dir.join("port.sock"), qmp_sock: dir.join("qmp.sock"), ctl_sock: dir.join("ctl.sock") }
    }
}

/// The driver's snapshots and the builds in flight.
pub(super) struct Snapshots {
    dir: PathBuf,
    /// The init binary's identity goes into every key: a rebuilt init
    /// must not be served a guest running the old one.
    init_binary: PathBuf,
    building: Arc<Mutex<HashMap<String, JoinHandle<()>>>>,
    /// The node's books: a template guest's memory and vCPUs are reserved
    /// there while it lives (none attached: not counted, as in unit tests).
    books: OnceLock<Arc<dyn HostBooks>>,
}

impl Snapshots {
    /// Removes whatever an earlier run left (snapshots are not persisted).
    pub fn new(run_dir: &Path, init_binary: &Path) -> Result<Snapshots> {
        let dir = run_dir.join(".snapshots");
        remove_dir(&dir)?;
        fs::create_dir_all(&dir).map_err(|e| BackendError::io(format!("mkdir {}", dir.display()), e))?;
        Ok(Snapshots { dir, init_binary: init_binary.to_path_buf(), building: Arc::default(), books: OnceLock::new() })
    }

    pub fn attach_books(&self, books: Arc<dyn HostBooks>) {
        let _ = self.books.set(books);
    }

    pub fn key(&self, template: &Template) -> Result<String> {
        let mut hash = Sha256::new();
        let sources = template
            .sources()
            .ok_or_else(|| BackendError::Setup("an image layer vanished while the VM was made".into()))?;
        hash.update(serde_json::to_vec(&sources).map_err(|e| BackendError::Protocol(e.to_string()))?);
        hash.update(serde_json::to_vec(&template.shape).map_err(|e| BackendError::Protocol(e.to_string()))?);
        for file in [&template.kernel, &template.initramfs, &self.init_binary] {
            let meta = fs::metadata(file).map_err(|e| BackendError::io(format!("stat {}", file.display()), e))?;
            hash.update(file.as_os_str().as_encoded_bytes());
            hash.update(meta.len().to_be_bytes());
            hash.update(meta.mtime().to_be_bytes());
            hash.update(meta.mtime_nsec().to_be_bytes());
        }
        hash.update([template.accel as u8, template.machine as u8]);
        Ok(hash.finalize().iter().take(16).map(|b| format!("{b:02x}")).collect())
    }

    /// The snapshot's directory if it is complete and still matches its image.
    pub fn ready(&self, key: &str) -> Option<PathBuf> {
        let dir = self.dir.join(key);
        let meta = read_meta(&dir)?;
        meta.sources.iter().all(Source::unchanged).then_some(dir)
    }

    /// Removes every finished snapshot whose image layers are gone or
    /// changed. Blocking (a few `stat`s per snapshot).
    pub fn prune(&self) {
        let Ok(entries) = fs::read_dir(&self.dir) else { return };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.contains('.') {
                continue; // a build in flight
            }
            let changed = match read_meta(&path) {
                None => Some(format!(
                    "its metadata is unreadable: {:?}",
                    fs::read(path.join("meta.json")).map(|b| String::from_utf8_lossy(&b).into_owned())
                )),
                Some(meta) => meta.sources.iter().find(|s| !s.unchanged()).map(|s| {
                    format!("{} is gone or changed ({:?} now {:?})", s.path.display(), s, Source::of(&s.path))
                }),
            };
            if let Some(why) = changed {
                tracing::info!(snapshot = %name, "removing a VM snapshot: {why}");
                let _ = remove_dir(&path);
            }
        }
    }

    /// Forgets a snapshot that failed to restore.
    pub fn discard(&self, key: &str) {
        let _ = remove_dir(&self.dir.join(key));
    }

    /// Starts building the snapshot for `key` unless it is being built or
    /// the node has no room for the template guest now (a later create of
    /// the shape tries again).
    pub fn build_in_background(&self, key: String, template: Template) {
        let mut building = self.building.lock().unwrap_or_else(PoisonError::into_inner);
        building.retain(|_, task| !task.is_finished());
        if building.contains_key(&key) {
            return;
        }
        // Held by the task until the template's QEMU and cgroup are gone.
        let reservation = match self.books.get() {
            Some(books) => match books.reserve(template.shape.memory_mib, template.shape.vcpus as f64) {
                Some(reservation) => Some(reservation),
                None => {
                    tracing::info!(snapshot = %key, "no room on the node for a snapshot template now");
                    return;
                }
            },
            None => None,
        };
        let dir = self.dir.clone();
        let done = Arc::clone(&self.building);
        let task_key = key.clone();
        let task = tokio::spawn(async move {
            match build(&dir, &task_key, &template).await {
                Ok(()) => tracing::info!(snapshot = %task_key, "VM snapshot ready"),
                Err(e) => tracing::warn!(snapshot = %task_key, "cannot build a VM snapshot: {e}"),
            }
            drop(reservation);
            let _ = done;
        });
        building.insert(key, task);
    }

    /// Stops the builds in flight and removes every snapshot.
    pub async fn clear(&self, cgroup_instance: &str) -> Result<()> {
        let tasks: Vec<(String, JoinHandle<()>)> =
            self.building.lock().unwrap_or_else(PoisonError::into_inner).drain().collect();
        for (key, task) in tasks {
            task.abort();
            let _ = task.await;
            // An aborted build leaves its QEMU (killed on drop) and cgroup.
            let cgroup = SandboxCgroup::new(cgroup_instance, &cgroup_name(&key)).map_err(cgroup_err)?;
            tokio::task::spawn_blocking(move || {
                cgroup.kill_all(Duration::from_secs(5)).map_err(cgroup_err)?;
                cgroup.remove().map_err(cgroup_err)
            })
            .await
            .map_err(|e| BackendError::io("snapshot cleanup task", std::io::Error::other(e)))??;
        }
        remove_dir(&self.dir)
    }
}

fn cgroup_name(key: &str) -> String {
    format!("snap-{}", &key[..key.len().min(16)])
}

fn read_meta(dir: &Path) -> Option<Meta> {
    serde_json::from_slice(&fs::read(dir.join("meta.json")).ok()?).ok()
}

fn remove_dir(dir: &Path) -> Result<()> {
    match fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(BackendError::io(format!("remove {}", dir.display()), e)),
    }
}

/// Boots a template guest in `<dir>/<key>.building`, snapshots it and
/// renames the directory to `<dir>/<key>` once complete.
async fn build(dir: &Path, key: &str, template: &Template) -> Result<()> {
    let work = dir.join(format!("{key}.building"));
    remove_dir(&work)?;
    fs::create_dir(&work).map_err(|e| BackendError::io(format!("mkdir {}", work.display()), e))?;
    let cgroup = SandboxCgroup::new(&template.cgroup_instance, &cgroup_name(key)).map_err(cgroup_err)?;
    let built = match cgroup.create(&limits(&template.shape)).map_err(cgroup_err) {
        Ok(()) => snapshot_template(&work, template, &cgroup).await,
        Err(e) => Err(e),
    };
    let cleaned = tokio::task::spawn_blocking(move || {
        cgroup.kill_all(Duration::from_secs(5)).map_err(cgroup_err)?;
        cgroup.remove().map_err(cgroup_err)
    })
    .await
    .map_err(|e| BackendError::io("snapshot cleanup task", std::io::Error::other(e)))?;
    let finished = built.and_then(|meta| cleaned.map(|()| meta)).and_then(|meta: Meta| {
        let sockets = Snap::in_dir(&work);
        for sock in
            [&sockets.serial_sock, &sockets.qmp_sock, &sockets.ctl_sock, &qemu::console_sock(&sockets.serial_sock)]
        {
            let _ = fs::remove_file(sock);
        }
        let meta = serde_json::to_vec(&meta).map_err(|e| BackendError::Protocol(e.to_string()))?;
        fs::write(work.join("meta.json"), meta).map_err(|e| BackendError::io("write meta.json", e))?;
        let dest = dir.join(key);
        remove_dir(&dest)?;
        fs::rename(&work, &dest).map_err(|e| BackendError::io(format!("rename {}", work.display()), e))
    });
    if finished.is_err() {
        let _ = remove_dir(&work);
    }
    finished
}

pub(super) fn limits(shape: &Shape) -> Limits {
    Limits {
        memory_bytes: shape.memory_mib.saturating_add(QEMU_OVERHEAD_MIB).saturating_mul(1 << 20),
        cpus: shape.vcpus as f64,
        pids: QEMU_PIDS,
    }
}

async fn snapshot_template(work: &Path, template: &Template, cgroup: &SandboxCgroup) -> Result<Meta> {
    // Taken before the boot: a layer replaced meanwhile makes the snapshot
    // stale at once instead of wrongly current.
    let sources = template.sources().ok_or_else(|| BackendError::Setup("an image layer vanished".into()))?;
    let writable = work.join("rw.img");
    disks::make_writable(&writable, template.shape.disk_mib, template.shape.inodes).await?;
    let sockets = Snap::in_dir(work);
    // The template's network is an empty namespace: nothing in the guest
    // connects before the snapshot, and a clone's QEMU gets its sandbox's.
    let netns = if template.shape.net { Some(super::new_netns()?) } else { None };
    let (mut child, console) =
        qemu::spawn(&template.spec(&sockets, None, &writable, netns.as_ref().map(AsFd::as_fd), None)?)?;
    drop(netns);
    let outcome = async {
        cgroup.add_pid(child.pid().pid).map_err(cgroup_err)?;
        let deadline = super::boot_deadline(template.machine);
        let mux = super::wait_ready(&mut child, &sockets.serial_sock, &sockets.ctl_sock, deadline).await?;
        // The node goes away, as it does across a restore: init drops
        // every stream and waits for the next node.
        drop(mux);
        tokio::time::sleep(QUIESCE).await;
        let qmp_sock = sockets.qmp_sock.clone();
        let mem = work.join("mem");
        tokio::task::spawn_blocking(move || {
            qmp::stop(&qmp_sock)?;
            let file = fs::File::create(&mem).map_err(|e| BackendError::io(format!("create {}", mem.display()), e))?;
            qmp::migrate_to_file(&qmp_sock, &file, MIGRATE_TIMEOUT)?;
            file.sync_all().map_err(|e| BackendError::io(format!("sync {}", mem.display()), e))
        })
        .await
        .map_err(|e| BackendError::io("migration task", std::io::Error::other(e)))?
    }
    .await;
    // QEMU wrote its last disk blocks before the migration completed.
    child.start_kill();
    let _ = child.wait().await;
    match outcome {
        Ok(()) => Ok(Meta { sources, shape: template.shape }),
        Err(e) => {
            let tail = console.text();
            Err(BackendError::Setup(format!("{e}; console: {}", tail.trim())))
        }
    }
}

/// Restores `snapshot` as the sandbox in `dir` (which exists, as does its
/// cgroup), named `hostname`, its QEMU in `netns` if the guest has a
/// network device. On error nothing of the restore is left in `dir` and
/// no QEMU runs.
pub(super) async fn restore(
    snapshot: &Path,
    template: &Template,
    dir: &Path,
    cgroup: &SandboxCgroup,
    hostname: &str,
    netns: Option<Arc<OwnedFd>>,
    qemu_uid: Option<u32>,
) -> Result<Running> {
    let sockets = Snap::in_dir(dir);
    let writable = dir.join("rw.img");
    let mut spawned: Option<QemuProcess> = None;
    let mut console: Option<qemu::ConsoleTail> = None;
    let started = std::time::Instant::now();
    let mut phases = [Duration::ZERO; 3];
    let outcome = async {
        copy_sparse(&snapshot.join("rw.img"), &writable).await?;
        phases[0] = started.elapsed();
        let mem_path = snapshot.join("mem");
        let mem = fs::File::open(&mem_path).map_err(|e| BackendError::io(format!("open {}", mem_path.display()), e))?;
        let spec = template.spec(&sockets, Some(&mem), &writable, netns.as_deref().map(AsFd::as_fd), qemu_uid)?;
        let (child, tail) = qemu::spawn(&spec)?;
        console = Some(tail);
        let child = spawned.insert(child);
        drop(mem);
        cgroup.add_pid(child.pid().pid).map_err(cgroup_err)?;
        let qmp_sock = sockets.qmp_sock.clone();
        tokio::task::spawn_blocking(move || qmp::wait_incoming(&qmp_sock, RESTORE_TIMEOUT))
            .await
            .map_err(|e| BackendError::io("restore task", std::io::Error::other(e)))??;
        phases[1] = started.elapsed();
        let mux =
            mux::start_from(&sockets.serial_sock, &sockets.ctl_sock, Duration::from_secs(10), RESTORED_FIRST_STREAM)
                .await?;
        let qmp_sock = sockets.qmp_sock.clone();
        tokio::task::spawn_blocking(move || qmp::cont(&qmp_sock))
            .await
            .map_err(|e| BackendError::io("restore task", std::io::Error::other(e)))??;
        tokio::time::timeout(RESTORE_TIMEOUT, identify(&sockets.ctl_sock, hostname)).await.map_err(|_| {
            BackendError::Setup(format!("the restored guest did not answer within {RESTORE_TIMEOUT:?}"))
        })??;
        phases[2] = started.elapsed();
        Ok(mux)
    }
    .await;
    match outcome {
        Ok(mux) => match spawned {
            Some(qemu) => {
                // Where a restore's time goes (bench/vm-boot.sh reports the total).
                tracing::debug!(
                    disk_ms = phases[0].as_millis() as u64,
                    loaded_ms = phases[1].as_millis() as u64,
                    identified_ms = phases[2].as_millis() as u64,
                    "restored a microVM from its snapshot"
                );
                let launch = super::Launch {
                    layer_files: template.layer_files.clone(),
                    vcpus: template.shape.vcpus,
                    memory_mib: template.shape.memory_mib,
                    pids: template.shape.pids,
                    open_files: template.shape.open_files,
                    hostname: TEMPLATE_HOSTNAME.to_string(),
                    name: hostname.to_string(),
                    accel: template.accel,
                    first_stream: RESTORED_FIRST_STREAM,
                    netns,
                    qemu_uid,
                };
                let console = console.unwrap_or_default();
                Ok(Running { qemu, _mux: mux, paused: false, mux_at_resume: false, launch, console })
            }
            None => Err(BackendError::Setup("no QEMU after a restore".into())),
        },
        Err(e) => {
            if let Some(mut child) = spawned {
                child.start_kill();
                let _ = child.wait().await;
            }
            for path in [
                &writable,
                &sockets.serial_sock,
                &sockets.qmp_sock,
                &sockets.ctl_sock,
                &qemu::console_sock(&sockets.serial_sock),
            ] {
                let _ = fs::remove_file(path);
            }
            Err(e)
        }
    }
}

/// `cp --reflink=auto --sparse=always`: a reflink where the file system
/// shares extents, else only the written blocks are copied.
async fn copy_sparse(from: &Path, to: &Path) -> Result<()> {
    let out = tokio::process::Command::new("cp")
        .args(["--reflink=auto", "--sparse=always", "--"])
        .arg(from)
        .arg(to)
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .map_err(|e| BackendError::io("run cp", e))?;
    if !out.status.success() {
        return Err(BackendError::Setup(format!(
            "cannot copy {}: {}",
            from.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// Sends init the sandbox's identity, retrying while the guest's side of
/// the port has not seen the new node yet.
async fn identify(ctl_sock: &Path, hostname: &str) -> Result<()> {
    let payload = identify_request(hostname)?;
    loop {
        let attempt = async {
            let mut stream = crate::unix_sock::connect(ctl_sock).await.ok()?;
            channel::write_frame(&mut stream, FrameKind::Request, &payload).await.ok()?;
            channel::read_frame(&mut stream).await.ok()?
        };
        match tokio::time::timeout(Duration::from_secs(2), attempt).await {
            Ok(Some((FrameKind::Response, answer))) => return identified(&answer),
            _ => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
}

/// As [`identify`], straight over the port of a guest restored from disk
/// before its mux starts (blocking: see [`mux::request_blocking`]).
pub(super) fn identify_on_port(
    port: &mut std::os::unix::net::UnixStream,
    next_stream: &mut u32,
    hostname: &str,
) -> Result<()> {
    let mut frame = Vec::new();
    warren_init::proto::write_frame(&mut frame, FrameKind::Request, &identify_request(hostname)?)
        .map_err(|e| BackendError::io("frame the identity", e))?;
    match mux::request_blocking(port, next_stream, &frame, Duration::from_secs(2), RESTORE_TIMEOUT)? {
        (FrameKind::Response, answer) => identified(&answer),
        (kind, _) => Err(BackendError::Protocol(format!("expected a response to Identify, got a {kind:?} frame"))),
    }
}

/// `Identify` with the sandbox's name, fresh entropy and the host's time.
fn identify_request(hostname: &str) -> Result<Vec<u8>> {
    let mut entropy = vec![0u8; ENTROPY_BYTES];
    let mut filled = 0;
    while filled < entropy.len() {
        filled += rustix::rand::getrandom(&mut entropy[filled..], rustix::rand::GetRandomFlags::empty())
            .map_err(|e| BackendError::io("getrandom", e.into()))?;
    }
    let unix_time_ns = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    let request = Request::Identify { hostname: hostname.to_string(), entropy, unix_time_ns };
    serde_json::to_vec(&request).map_err(|e| BackendError::Protocol(e.to_string()))
}

fn identified(answer: &[u8]) -> Result<()> {
    match serde_json::from_slice::<Response>(answer) {
        Ok(Response::Identified) => Ok(()),
        Ok(Response::Error { message, .. }) => {
            Err(BackendError::Setup(format!("the restored guest refused its identity: {message}")))
        }
        other => Err(BackendError::Protocol(format!("expected Identified, got {other:?}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meta_round_trips_and_notices_a_replaced_source() {
        let dir = tempfile::tempdir().unwrap();
        let layer = dir.path().join("layer");
        fs::create_dir(&layer).unwrap();
        let shape =
            Shape { vcpus: 1, memory_mib: 256, disk_mib: 64, inodes: 1000, pids: 256, open_files: 4096, net: true };
        let meta = Meta { sources: vec![Source::of(&layer).unwrap()], shape };
        fs::write(dir.path().join("meta.json"), serde_json::to_vec(&meta).unwrap()).unwrap();
        let read = read_meta(dir.path()).expect("readable");
        assert_eq!((read.sources.clone(), read.shape), (meta.sources.clone(), shape));
        assert!(read.sources[0].unchanged());
        fs::remove_dir(&layer).unwrap();
        fs::create_dir(&layer).unwrap();
        fs::write(layer.join("f"), b"x").unwrap();
        assert!(!read.sources[0].unchanged(), "a replaced directory is a change");
    }
}

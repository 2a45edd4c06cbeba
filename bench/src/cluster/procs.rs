//! The `warren serve` processes of a run: nodes (in the lab's network
//! namespaces), API servers and the embedded server. A [`Proc`] owns its
//! child: dropping it stops the server (SIGTERM, so `--destroy-on-exit`
//! ends its sandboxes; SIGKILL after a bounded wait) and removes its cgroup
//! instance directories; mounts left under the run's directory keep it
//! from being removed (removing a tree would write through them).

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rustix::process::{kill_process, Pid, Signal};

use crate::Res;

/// Bound on a healthy server's start and stop.
const SERVER_WAIT: Duration = Duration::from_secs(60);
const CGROUP_ROOT: &str = "/sys/fs/cgroup";

pub struct Proc {
    pub name: String,
    pub url: String,
    /// Its cgroup instance (none for an API server, which runs no sandbox).
    instance: Option<String>,
    log: PathBuf,
    child: Option<Child>,
}

/// How to start one server.
pub struct Spec<'a> {
    pub name: String,
    /// Words before the binary (`nsenter --net=... --`), or none.
    pub prefix: Vec<String>,
    pub warren: &'a Path,
    pub data_dir: PathBuf,
    pub listen: String,
    pub instance: Option<String>,
    pub args: Vec<String>,
}

impl Spec<'_> {
    /// The command line, for the report.
    pub fn command(&self) -> String {
        let mut words: Vec<String> = self.prefix.clone();
        words.push(self.warren.display().to_string());
        words.extend(self.words());
        words.join(" ")
    }

    fn words(&self) -> Vec<String> {
        let mut w = vec!["serve".to_string(), "--data-dir".into(), self.data_dir.display().to_string()];
        w.extend(["--listen".into(), self.listen.clone()]);
        if let Some(i) = &self.instance {
            w.extend(["--instance".into(), i.clone()]);
        }
        w.extend(self.args.iter().cloned());
        w
    }
}

impl Proc {
    /// Starts the server and waits for its `server.url`.
    pub fn start(spec: &Spec<'_>) -> Res<Proc> {
        fs::create_dir_all(&spec.data_dir).map_err(|e| format!("{}: {e}", spec.data_dir.display()))?;
        let log = spec.data_dir.with_extension("log");
        let out = File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
        let err = out.try_clone().map_err(|e| e.to_string())?;
        let mut c = match spec.prefix.split_first() {
            Some((program, words)) => {
                let mut c = Command::new(program);
                c.args(words).arg(spec.warren);
                c
            }
            None => Command::new(spec.warren),
        };
        c.args(spec.words()).env("WARREN_LOG", "warn").env("NO_COLOR", "1");
        let child =
            c.stdin(Stdio::null()).stdout(out).stderr(err).spawn().map_err(|e| format!("{}: {e}", spec.command()))?;
        let mut p = Proc {
            name: spec.name.clone(),
            url: String::new(),
            instance: spec.instance.clone(),
            log,
            child: Some(child),
        };
        let url_file = spec.data_dir.join("server.url");
        let deadline = Instant::now() + SERVER_WAIT;
        loop {
            if let Ok(t) = fs::read_to_string(&url_file) {
                // Written whole by a rename, with a final newline.
                if t.ends_with('\n') {
                    p.url = t.trim().to_string();
                    return Ok(p);
                }
            }
            if let Some(status) = p.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                p.child = None;
                return Err(format!("{} exited with {status} before listening; log:\n{}", p.name, p.log_tail()));
            }
            if Instant::now() > deadline {
                return Err(format!("{}: no server.url within {SERVER_WAIT:?}; log:\n{}", p.name, p.log_tail()));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn log_tail(&self) -> String {
        let text = fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    fn signal(&self, signal: Signal) {
        if let Some(pid) = self.child.as_ref().and_then(|c| Pid::from_raw(c.id() as i32)) {
            let _ = kill_process(pid, signal);
        }
    }

    /// Waits (bounded) for the child to exit; true when it did.
    fn reap(&mut self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while let Some(child) = self.child.as_mut() {
            if !matches!(child.try_wait(), Ok(None)) {
                self.child = None;
                return true;
            }
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        true
    }

    /// SIGTERM, a bounded wait, then SIGKILL; then its cgroup instance
    /// directories. Returns what it found left behind.
    pub fn stop(&mut self) -> Vec<String> {
        let mut left = Vec::new();
        if self.child.is_some() {
            self.signal(Signal::TERM);
            if !self.reap(Duration::from_secs(30)) {
                left.push(format!("{} ignored SIGTERM for 30 s (killed)", self.name));
                self.signal(Signal::KILL);
                self.reap(SERVER_WAIT);
            }
        }
        if let Some(instance) = self.instance.take() {
            left.extend(remove_instance_cgroups(&instance));
        }
        left
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        for what in self.stop() {
            eprintln!("warren-bench-cluster: LEAK {what}");
        }
    }
}

/// Removes the (empty, once the server stopped cleanly) cgroup directories
/// of `instance` in every hierarchy; names what could not be removed.
fn remove_instance_cgroups(instance: &str) -> Vec<String> {
    let mut left = Vec::new();
    let Ok(hierarchies) = fs::read_dir(CGROUP_ROOT) else { return left };
    let names = [instance.to_string(), format!("{instance}-vm"), format!("{instance}-fullvm")];
    for h in hierarchies.flatten() {
        for name in &names {
            let dir = h.path().join(name);
            if dir.is_dir() && fs::remove_dir(&dir).is_err() {
                left.push(format!("cgroup {} (not empty)", dir.display()));
            }
        }
    }
    left
}

/// Mount points at or below `dir` (this mount namespace is the nodes': they
/// enter only a network namespace).
pub fn mounts_under(dir: &Path) -> Vec<String> {
    let info = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let dir = dir.display().to_string();
    info.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|m| *m == dir || m.starts_with(&format!("{dir}/")))
        .map(str::to_string)
        .collect()
}

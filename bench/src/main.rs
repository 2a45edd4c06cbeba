//! `warren-bench`: Warren side by side with bubblewrap, runc and crun on one
//! busybox rootfs, in one run, written as a dated Markdown report.
//!
//! Owns: the measures (cold cycle, warm claim, exec round trip, sustained
//! creations, idle memory), the peers' invocations and the report.
//! Invariant: every contender is timed by the same loops (`harness`) on the
//! same rootfs, and everything a run makes - the server, sandboxes,
//! containers, cgroups, mounts, temp dirs - is removed when it ends, also on
//! error or interrupt; a killed run's leftovers are swept by the next run.
//! Never: touches a process, container or cgroup whose name does not carry
//! a benchmark run's pid.

mod cleanup;
mod cmd;
mod contest;
mod error;
mod exec_split;
mod harness;
mod host;
mod oci;
mod pause;
mod peers;
mod report;
mod results;
mod rootfs;
mod stats;
mod warren;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::Parser;

use contest::Contestant;
use error::{BenchError, Result};
use peers::Runtime;
use results::{Contender, Outcome, Plan};

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// True once SIGINT or SIGTERM arrived; every loop checks it between samples.
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::Relaxed)
}

/// A line on stderr, so a long run shows where it is.
pub fn progress(what: &str) {
    let _ = writeln!(std::io::stderr().lock(), "warren-bench: {what}");
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Which {
    Warren,
    Bwrap,
    Runc,
    Crun,
    /// The same `true` started with no sandbox: the host's floor.
    Floor,
}

#[derive(Debug, Parser)]
#[command(name = "warren-bench", about = "Warren side by side with bwrap, runc and crun")]
struct Args {
    /// Markdown report to write (default: bench/results/<YYYY-MM-DD>.md).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Smoke run: small sample counts and short windows.
    #[arg(long)]
    quick: bool,
    /// Contenders to run (repeatable); default all.
    #[arg(long = "only", value_enum)]
    only: Vec<Which>,
    /// Cold and warm cycles per contender.
    #[arg(long)]
    samples: Option<usize>,
    /// Unrecorded cycles before each measure.
    #[arg(long)]
    warmup: Option<usize>,
    /// Exec round trips per contender.
    #[arg(long)]
    exec_samples: Option<usize>,
    /// Seconds of the sustained-creation measure.
    #[arg(long)]
    sustain_secs: Option<u64>,
    /// Concurrent clients for the sustained and idle measures.
    #[arg(long)]
    clients: Option<usize>,
    /// Idle sandboxes held for the memory measure.
    #[arg(long)]
    idle: Option<usize>,
    #[arg(long)]
    pool_size: Option<usize>,
    /// The `warren` binary (default: target/release/warren of this workspace).
    #[arg(long)]
    warren_bin: Option<PathBuf>,
    /// The rootfs script (default: scripts/make-test-image.sh of this workspace).
    #[arg(long)]
    image_script: Option<PathBuf>,
    /// Only remove what killed runs left behind, then exit.
    #[arg(long)]
    sweep: bool,
}

impl Args {
    fn plan(&self) -> Plan {
        let (samples, warmup, exec, sustain, idle, pool, held) =
            if self.quick { (20, 2, 50, 5, 50, 4, 10) } else { (200, 5, 1000, 60, 1000, 16, 50) };
        Plan {
            samples: self.samples.unwrap_or(samples),
            warmup: self.warmup.unwrap_or(warmup),
            exec_samples: self.exec_samples.unwrap_or(exec),
            sustain: Duration::from_secs(self.sustain_secs.unwrap_or(sustain)),
            clients: self.clients.unwrap_or(4).max(1),
            idle: self.idle.unwrap_or(idle),
            idle_cpu_window: Duration::from_secs(if self.quick { 2 } else { 5 }),
            settle: Duration::from_secs(2),
            pool_size: self.pool_size.unwrap_or(pool).max(1),
            held_cold_samples: held,
        }
    }

    fn runs(&self, which: Which) -> bool {
        self.only.is_empty() || self.only.contains(&which)
    }
}

fn workspace_path(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..").join(rel)
}

/// SIGINT / SIGTERM set the flag (runs wind down and clean up); a second one exits at once.
fn watch_signals() {
    std::thread::spawn(|| {
        let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() else { return };
        rt.block_on(async {
            use tokio::signal::unix::{signal, SignalKind};
            let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
                return;
            };
            loop {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                }
                if INTERRUPTED.swap(true, Ordering::Relaxed) {
                    std::process::exit(130);
                }
                progress("interrupted: cleaning up (signal again to exit at once)");
            }
        });
    });
}

/// (year, month, day, hour, minute, second) in UTC of a Unix time.
fn civil_utc(unix_secs: u64) -> (i64, u32, u32, u32, u32, u32) {
    let days = (unix_secs / 86_400) as i64;
    let rem = unix_secs % 86_400;
    // Howard Hinnant's days-to-civil.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day, (rem / 3600) as u32, (rem % 3600 / 60) as u32, (rem % 60) as u32)
}

fn now_utc() -> (String, String) {
    let secs = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (y, mo, d, h, mi, s) = civil_utc(secs);
    (format!("{y:04}-{mo:02}-{d:02}"), format!("{y:04}-{mo:02}-{d:02} {h:02}:{mi:02}:{s:02}"))
}

fn warren_missing(binary: &std::path::Path) -> Contender {
    let mut c = Contender::new("Warren", "not built");
    c.cold = Outcome::Failed(format!(
        "{} not found; build it with `cargo build --release -p warren -p warren-init`",
        binary.display()
    ));
    c
}

/// Sets up every contender asked for, runs the measures, and returns the
/// results in table order. A contender whose setup fails is reported as such.
fn contend(args: &Args, plan: &Plan, workdir: &Path, rootfs: &Path) -> Result<Vec<Contender>> {
    let binary = args.warren_bin.clone().unwrap_or_else(|| workspace_path("target/release/warren"));
    let mut failed: Vec<(usize, Contender)> = Vec::new();
    let mut warren = None;
    if args.runs(Which::Warren) {
        progress("starting the warren server");
        let setup = warren::WarrenSetup { binary: &binary, workdir, rootfs };
        match binary.is_file().then(|| warren::WarrenContestant::start(&setup, plan)) {
            None => failed.push((0, warren_missing(&binary))),
            Some(Ok(w)) => warren = Some(w),
            Some(Err(BenchError::Interrupted)) => return Err(BenchError::Interrupted),
            Some(Err(e)) => failed.push((0, warren::WarrenContestant::failed(&binary, &e))),
        }
    }
    let mut bwrap = args.runs(Which::Bwrap).then(|| peers::BwrapContestant::new(rootfs));
    let mut oci = Vec::new();
    for (slot, which, runtime) in [(2, Which::Runc, Runtime::Runc), (3, Which::Crun, Runtime::Crun)] {
        if args.runs(which) {
            match peers::OciContestant::new(runtime, workdir, rootfs) {
                Ok(o) => oci.push((slot, o)),
                Err(e) => failed.push((slot, peers::OciContestant::failed(runtime, &e))),
            }
        }
    }

    let mut floor = args.runs(Which::Floor).then(|| peers::FloorContestant::new(rootfs));

    let mut all: Vec<&mut dyn contest::Contestant> = Vec::new();
    if let Some(w) = warren.as_mut() {
        all.push(w);
    }
    if let Some(b) = bwrap.as_mut() {
        all.push(b);
    }
    for (_, o) in oci.iter_mut() {
        all.push(o);
    }
    if let Some(f) = floor.as_mut() {
        all.push(f);
    }
    contest::run_all(plan, &mut all)?;

    let mut ordered: Vec<(usize, Contender)> = failed;
    ordered.extend(warren.map(|w| (0, w.into_contender())));
    ordered.extend(bwrap.map(|mut b| (1, std::mem::replace(b.contender(), Contender::new("", "")))));
    ordered
        .extend(oci.into_iter().map(|(slot, mut o)| (slot, std::mem::replace(o.contender(), Contender::new("", "")))));
    ordered.extend(floor.map(|mut f| (4, std::mem::replace(f.contender(), Contender::new("", "")))));
    ordered.sort_by_key(|(slot, _)| *slot);
    Ok(ordered.into_iter().map(|(_, c)| c).collect())
}

fn run(args: &Args) -> Result<PathBuf> {
    let started = Instant::now();
    let (date, started_utc) = now_utc();
    let plan = args.plan();
    let out = args.out.clone().unwrap_or_else(|| PathBuf::from(format!("bench/results/{date}.md")));
    let machine = host::machine();
    let load_start = host::loadavg();

    let workdir = cleanup::Workdir::create()?;
    let script = args.image_script.clone().unwrap_or_else(rootfs::default_script);
    progress("building the rootfs");
    let rootfs = rootfs::build(&script, &workdir.path().join("rootfs"))?;

    let contenders = contend(args, &plan, workdir.path(), &rootfs.dir)?;

    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let text = report::render(&report::Run {
        date,
        started_utc,
        took: started.elapsed(),
        command,
        machine: &machine,
        load_start,
        load_end: host::loadavg(),
        rootfs: &rootfs,
        plan: &plan,
        contenders: &contenders,
    });
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| BenchError::io("mkdir", dir, e))?;
    }
    std::fs::write(&out, text).map_err(|e| BenchError::io("write", &out, e))?;
    Ok(out)
}

fn sweep() {
    let crun_ns = peers::PrivateMountNs::without_cgroup2().ok();
    let done = cleanup::sweep_stale(|name| {
        let runtime = if name == "crun" { Runtime::Crun } else { Runtime::Runc };
        let ns = if runtime == Runtime::Crun { crun_ns.as_ref() } else { None };
        peers::runtime_command(runtime, ns)
    });
    for line in done {
        progress(&format!("swept: {line}"));
    }
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    watch_signals();
    sweep();
    if args.sweep {
        return std::process::ExitCode::SUCCESS;
    }
    match run(&args) {
        Ok(out) => {
            progress(&format!("wrote {}", out.display()));
            std::process::ExitCode::SUCCESS
        }
        Err(BenchError::Interrupted) => {
            progress("interrupted; everything made was removed");
            std::process::ExitCode::from(130)
        }
        Err(e) => {
            progress(&format!("error: {e}"));
            std::process::ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_dates_match_known_days() {
        assert_eq!(civil_utc(0), (1970, 1, 1, 0, 0, 0));
        assert_eq!(civil_utc(951_782_400), (2000, 2, 29, 0, 0, 0));
        assert_eq!(civil_utc(1_798_761_599), (2026, 12, 31, 23, 59, 59));
    }

    #[test]
    fn quick_scales_down_and_flags_override() {
        let quick = Args::parse_from(["warren-bench", "--quick", "--idle", "7"]).plan();
        let full = Args::parse_from(["warren-bench"]).plan();
        assert!(quick.samples < full.samples && quick.sustain < full.sustain);
        assert_eq!(quick.idle, 7);
        assert_eq!((full.samples, full.exec_samples, full.idle), (200, 1000, 1000));
        let some = Args::parse_from(["warren-bench", "--only", "bwrap", "--only", "runc"]);
        assert!(some.runs(Which::Runc) && !some.runs(Which::Warren));
    }
}

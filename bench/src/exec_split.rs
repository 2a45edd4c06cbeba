//! Where an exec round trip's time goes (Warren only). In one live sandbox,
//! interleaved round by round: the API's round trip that starts nothing
//! (`GET` of the sandbox), the exec of busybox's `true` and of `exit0` (the
//! same without a C library's start-up, see [`crate::rootfs::exit0_elf`]),
//! and both programs started by the bench with no sandbox at all. What is
//! left of an exec once the API's round trip and the process's own start
//! are taken away is what the sandbox's exec path costs.
//!
//! Then the same three with the host left idle before each sample, as an
//! agent that thinks between its commands leaves it: the figures a trainer
//! sees, which a back-to-back loop hides.

use std::path::Path;
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use crate::cmd;
use crate::contest;
use crate::error::Result;
use crate::harness;
use crate::results::{Part, Plan};
use crate::rootfs::EXIT0;
use crate::stats::Latencies;
use crate::warren::{sandbox_request, Client};

pub const DESCRIPTION: &str = "one sandbox; interleaved round by round: GET /v1/sandboxes/{id}, exec \
     /bin/true (busybox), exec /bin/exit0 (no C library), and both started by the bench with no \
     sandbox; then GET, exec /bin/true and /bin/true with no sandbox after 100 ms idle each";

/// Idle time before each paced sample: longer than any of the exec path's
/// threads spins before it sleeps, short of an agent's thinking time.
const PACE: Duration = Duration::from_millis(100);

pub const GET: &str = "API round trip with no exec (GET the sandbox)";
pub const EXEC_TRUE: &str = "exec `true`";
pub const EXEC_EXIT0: &str = "exec `exit0` (no C library)";
pub const BARE_TRUE: &str = "`true` with no sandbox";
pub const BARE_EXIT0: &str = "`exit0` with no sandbox";
pub const PACED_GET: &str = "after 100 ms idle: GET the sandbox";
pub const PACED_EXEC: &str = "after 100 ms idle: exec `true`";
pub const PACED_BARE: &str = "after 100 ms idle: `true` with no sandbox";

fn timed(step: impl FnOnce() -> Result<()>) -> Result<Duration> {
    let t = Instant::now();
    step()?;
    Ok(t.elapsed())
}

/// Runs both rounds on a fresh sandbox of the shared shape; the rootfs is
/// the one the server imported, for the no-sandbox runs.
pub fn measure(client: &Client, rootfs: &Path, plan: &Plan) -> Result<Vec<Part>> {
    let id = client.create(&sandbox_request())?.id;
    let (true_bin, exit0_bin) = (rootfs.join("bin/true"), rootfs.join(EXIT0));
    let sample_hot = |lane: usize| match lane {
        0 => timed(|| client.get(&id).map(drop)),
        1 => timed(|| client.exec_ok(&id, "/bin/true").map(drop)),
        2 => timed(|| client.exec_ok(&id, &format!("/{EXIT0}")).map(drop)),
        3 => cmd::run_timed(&mut Command::new(&true_bin)),
        _ => cmd::run_timed(&mut Command::new(&exit0_bin)),
    };
    let sample_paced = |lane: usize| {
        thread::sleep(PACE);
        match lane {
            0 => timed(|| client.get(&id).map(drop)),
            1 => timed(|| client.exec_ok(&id, "/bin/true").map(drop)),
            _ => cmd::run_timed(&mut Command::new(&true_bin)),
        }
    };
    let measured = (|| {
        let hot = harness::interleaved(plan.warmup, plan.exec_samples, 5, sample_hot)?;
        let paced = harness::interleaved(plan.warmup, paced_samples(plan), 3, sample_paced)?;
        Ok::<_, crate::error::BenchError>((hot, paced))
    })();
    let deleted = client.delete(&id);
    let (hot, paced) = measured?;
    deleted?;
    let names = [GET, EXEC_TRUE, EXEC_EXIT0, BARE_TRUE, BARE_EXIT0, PACED_GET, PACED_EXEC, PACED_BARE];
    let mut parts = Vec::with_capacity(names.len());
    for (name, lane) in names.into_iter().zip(hot.into_iter().chain(paced)) {
        // A paced sample's host CPU would count the idle time's other work.
        let own_cpu = ![PACED_GET, PACED_EXEC, PACED_BARE].contains(&name);
        parts.push(Part { name: part_name(name), latencies: contest::outcome(lane)?, own_cpu });
    }
    Ok(parts)
}

/// The report's name of one of this measure's parts.
pub fn part_name(name: &str) -> String {
    format!("exec split: {name}")
}

/// A paced sample costs its idle time, so fewer of them: a quarter of the
/// cycles' count, at least 10.
fn paced_samples(plan: &Plan) -> usize {
    (plan.samples / 4).max(10)
}

/// What an exec of `true` costs over the API's round trip and the
/// process's own start (`None` until all three are measured).
pub fn exec_path(exec: Option<&Latencies>, get: Option<&Latencies>, bare: Option<&Latencies>) -> Option<Duration> {
    let (exec, get, bare) = (exec?.p50()?, get?.p50()?, bare?.p50()?);
    Some(exec.saturating_sub(get).saturating_sub(bare))
}

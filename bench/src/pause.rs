//! Pause and resume (Warren only): how long `POST .../pause` takes to
//! freeze a sandbox whose process spins on a CPU, how long
//! `POST .../resume` takes to thaw it, and how much an exec on a paused
//! sandbox (which resumes it first) costs over the plain exec round trip.

use std::time::{Duration, Instant};

use warren_api::SandboxState;

use crate::contest;
use crate::error::{BenchError, Result};
use crate::harness;
use crate::results::{Part, Plan};
use crate::stats::Latencies;
use crate::warren::{sandbox_request, Client};

pub const DESCRIPTION: &str = "one sandbox running 'while :; do :; done' (one CPU busy); each sample: \
     POST /v1/sandboxes/{id}/pause, then POST /v1/sandboxes/{id}/resume; then pause + exec 'true' \
     (the exec resumes it)";

/// The loop every sample freezes: one task always running, so the freeze
/// has to stop a process mid-run, not one asleep.
const BUSY: &str = "while :; do :; done";

fn timed<T>(step: impl FnOnce() -> Result<T>) -> Result<(Duration, T)> {
    let t = Instant::now();
    let out = step()?;
    Ok((t.elapsed(), out))
}

fn expect_state(op: &str, got: SandboxState, want: SandboxState) -> Result<()> {
    match got == want {
        true => Ok(()),
        false => Err(BenchError::Unexpected { op: op.into(), detail: format!("state {got:?}, expected {want:?}") }),
    }
}

/// Runs the pause measures on a fresh sandbox of the shared shape and
/// returns them as parts of the `pause` measure.
pub fn measure(client: &Client, plan: &Plan) -> Result<Vec<Part>> {
    let id = client.create(&sandbox_request())?.id;
    let measured = (|| {
        client.start_exec(&id, BUSY)?;
        let (mut pause, mut resume, mut exec_paused) =
            (Latencies::default(), Latencies::default(), Latencies::default());
        for i in 0..plan.warmup + plan.samples {
            harness::check_interrupt()?;
            let (p, info) = timed(|| client.pause_or_resume(&id, "pause"))?;
            expect_state("pause", info.state, SandboxState::Paused)?;
            let (r, info) = timed(|| client.pause_or_resume(&id, "resume"))?;
            expect_state("resume", info.state, SandboxState::Running)?;
            client.pause_or_resume(&id, "pause")?;
            let (e, _) = timed(|| client.exec_true(&id))?;
            if i >= plan.warmup {
                pause.push(p);
                resume.push(r);
                exec_paused.push(e);
            }
        }
        Ok::<_, BenchError>(vec![
            ("POST pause (freeze a busy sandbox)", pause),
            ("POST resume", resume),
            ("exec `true` on a paused sandbox (resumes it)", exec_paused),
        ])
    })();
    let deleted = client.delete(&id);
    let steps = measured?;
    deleted?;
    Ok(contest::step_parts("pause", steps, true))
}

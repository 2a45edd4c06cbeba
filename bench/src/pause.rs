//! Pause and resume (Warren only): how long `POST .../pause` takes to
//! stop a sandbox whose process spins on a CPU, how long
//! `POST .../resume` takes to let it run again, and how much an exec on a
//! paused sandbox (which resumes it first) costs over the plain exec round
//! trip; for a container (the cgroup freezer) and a microVM (QMP `stop` /
//! `cont`).

use std::time::{Duration, Instant};

use warren_api::{Backend, CreateSandboxRequest, SandboxState};

use crate::contest;
use crate::error::{BenchError, Result};
use crate::harness;
use crate::results::{Outcome, Part, Plan};
use crate::stats::Latencies;
use crate::warren::{sandbox_request, Client};

pub const DESCRIPTION: &str = "one sandbox running 'while :; do :; done' (one CPU busy); each sample: \
     POST /v1/sandboxes/{id}/pause, then POST /v1/sandboxes/{id}/resume; then pause + exec 'true' \
     (the exec resumes it); once on a container sandbox, once on a microvm one (memory_mib 256, \
     as the microvm tests use)";

/// Guest memory of the measured microVM (what the microVM tests give theirs).
const MICROVM_MEMORY_MIB: u64 = 256;

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

/// Runs the pause measures on a fresh container sandbox of the shared
/// shape and returns them as parts of the `pause` measure.
pub fn measure(client: &Client, plan: &Plan) -> Result<Vec<Part>> {
    let steps = ["POST pause (freeze a busy sandbox)", "POST resume", "exec `true` on a paused sandbox (resumes it)"];
    measure_on(client, plan, &sandbox_request(), steps)
}

/// The same on a microVM (a busy TCG guest), as more parts of the `pause`
/// measure. Kept apart from [`measure`] so the server CPU counted for a
/// pause cycle is not the VM's boot and spinning guest. A host without the
/// microVM backend gets failed microVM rows, not a failed run.
pub fn measure_microvm(client: &Client, plan: &Plan) -> Result<Vec<Part>> {
    let steps = [
        "microvm: POST pause (QMP stop of a busy guest)",
        "microvm: POST resume (QMP cont)",
        "microvm: exec `true` on a paused VM (resumes it)",
    ];
    let request =
        CreateSandboxRequest { backend: Backend::Microvm, memory_mib: MICROVM_MEMORY_MIB, ..sandbox_request() };
    match measure_on(client, plan, &request, steps) {
        Err(BenchError::Interrupted) => Err(BenchError::Interrupted),
        Err(e) => Ok(steps
            .iter()
            .map(|step| Part {
                name: format!("pause step: {step}"),
                latencies: Outcome::Failed(e.to_string()),
                own_cpu: false,
            })
            .collect()),
        parts => parts,
    }
}

/// Pause, resume and exec-on-paused samples on one sandbox made from
/// `request`, named by `steps` in that order.
fn measure_on(client: &Client, plan: &Plan, request: &CreateSandboxRequest, steps: [&str; 3]) -> Result<Vec<Part>> {
    let id = client.create(request)?.id;
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
        Ok::<_, BenchError>(vec![(steps[0], pause), (steps[1], resume), (steps[2], exec_paused)])
    })();
    let deleted = client.delete(&id);
    let steps = measured?;
    deleted?;
    Ok(contest::step_parts("pause", steps, true))
}

//! The order of a run. The host is shared, and its load moves within
//! minutes, so measures whose figures are compared as ratios are taken
//! side by side rather than one tool after another: latency samples are
//! interleaved round by round, and the sustained window is cut into slices
//! that the contenders take in turn. Idle memory, which holds the host
//! still for a while, is measured one contender at a time.

use std::time::Duration;

use crate::error::{BenchError, Result};
use crate::harness;
use crate::results::{Contender, IdleMemory, Measured, Outcome, Part, Plan, Sustained};
use crate::stats::Latencies;

/// One tool under test, able to take one sample of each measure at a time.
pub trait Contestant {
    fn contender(&mut self) -> &mut Contender;

    /// Routes to a cold create+exec+destroy; the first fills `cold`, the
    /// others become parts named `cold, <route>`.
    fn cold_routes(&self) -> Vec<String>;
    fn cold(&mut self, route: usize) -> Result<Duration>;
    /// Called once the cold samples are in (to add per-step parts).
    fn cold_done(&mut self) {}

    /// Prepares the sandbox execs run in; false when the tool cannot exec
    /// into a running sandbox.
    fn exec_start(&mut self) -> Result<bool> {
        Ok(false)
    }
    fn exec(&mut self) -> Result<Duration> {
        Err(BenchError::Unexpected { op: "exec".into(), detail: "not supported".into() })
    }
    fn exec_stop(&mut self) -> Result<()> {
        Ok(())
    }

    fn sustain(&mut self, clients: usize, window: Duration) -> Result<Measured<Sustained>>;
    /// Whether idle sandboxes mean anything for this contender.
    fn has_idle(&self) -> bool {
        true
    }
    fn idle(&mut self, plan: &Plan) -> Result<Measured<IdleMemory>>;
    /// Measures only this tool has (Warren's warm pool).
    fn extra(&mut self, _plan: &Plan) -> Result<()> {
        Ok(())
    }
}

/// Only an interrupt ends the run; any other error becomes the measure's outcome.
pub fn outcome<T>(r: Result<Measured<T>>) -> Result<Outcome<T>> {
    match r {
        Ok(m) => Ok(Outcome::Done(m)),
        Err(BenchError::Interrupted) => Err(BenchError::Interrupted),
        Err(e) => Ok(Outcome::Failed(e.to_string())),
    }
}

pub fn run_all(plan: &Plan, all: &mut [&mut dyn Contestant]) -> Result<()> {
    crate::progress("cold create+exec+destroy, interleaved");
    cold(plan, all)?;
    crate::progress("exec round trip, interleaved");
    exec(plan, all)?;
    crate::progress("sustained creations, in slices taken in turn");
    sustained(plan, all)?;
    for c in all.iter_mut().filter(|c| c.has_idle()) {
        crate::progress(&format!("{}: idle sandboxes", c.contender().name));
        let idle = outcome(c.idle(plan))?;
        c.contender().idle = idle;
    }
    for c in all.iter_mut() {
        c.extra(plan)?;
    }
    Ok(())
}

fn cold(plan: &Plan, all: &mut [&mut dyn Contestant]) -> Result<()> {
    let lanes: Vec<(usize, usize, String)> = all
        .iter()
        .enumerate()
        .flat_map(|(ci, c)| c.cold_routes().into_iter().enumerate().map(move |(route, name)| (ci, route, name)))
        .collect();
    let results = harness::interleaved(plan.warmup, plan.samples, lanes.len(), |lane| {
        let (ci, route, _) = &lanes[lane];
        all[*ci].cold(*route)
    })?;
    for ((ci, route, name), result) in lanes.into_iter().zip(results) {
        let latencies = outcome(result)?;
        let c = all[ci].contender();
        if route == 0 {
            c.cold = latencies;
        } else {
            c.parts.push(Part { name: format!("cold, {name}"), latencies, own_cpu: true });
        }
    }
    for c in all.iter_mut() {
        c.cold_done();
    }
    Ok(())
}

fn exec(plan: &Plan, all: &mut [&mut dyn Contestant]) -> Result<()> {
    let mut lanes = Vec::new();
    for (ci, c) in all.iter_mut().enumerate() {
        match c.exec_start() {
            Ok(true) => lanes.push(ci),
            Ok(false) => {}
            Err(BenchError::Interrupted) => return Err(BenchError::Interrupted),
            Err(e) => c.contender().exec = Outcome::Failed(format!("setup: {e}")),
        }
    }
    let results = harness::interleaved(plan.warmup, plan.exec_samples, lanes.len(), |lane| all[lanes[lane]].exec());
    // The targets go whatever happened above.
    for &ci in &lanes {
        if let Err(e) = all[ci].exec_stop() {
            let c = all[ci].contender();
            c.notes.push(format!("exec target cleanup: {e}"));
        }
    }
    for (ci, result) in lanes.into_iter().zip(results?) {
        all[ci].contender().exec = outcome(result)?;
    }
    Ok(())
}

/// Slices of about 10 s (at most 6), taken by each contender in turn and
/// rotated, so each one's total window spans the same stretch of the run.
fn sustained(plan: &Plan, all: &mut [&mut dyn Contestant]) -> Result<()> {
    let slices = (plan.sustain.as_secs() / 10).clamp(1, 6) as u32;
    let window = plan.sustain / slices;
    let mut merged: Vec<Option<Result<Measured<Sustained>>>> = all.iter().map(|_| None).collect();
    for slice in 0..slices as usize {
        for k in 0..all.len() {
            let ci = (slice + k) % all.len();
            if matches!(merged[ci], Some(Err(_))) {
                continue;
            }
            let got = all[ci].sustain(plan.clients, window);
            merged[ci] = Some(match (merged[ci].take(), got) {
                (_, Err(BenchError::Interrupted)) => return Err(BenchError::Interrupted),
                (_, Err(e)) => Err(e),
                (None, Ok(m)) => Ok(m),
                (Some(Ok(mut acc)), Ok(m)) => {
                    acc.value.merge(m.value);
                    acc.cpu.add(&m.cpu);
                    Ok(acc)
                }
                (Some(Err(e)), Ok(_)) => Err(e),
            });
        }
    }
    for (c, m) in all.iter_mut().zip(merged) {
        if let Some(m) = m {
            c.contender().sustained = outcome(m)?;
        }
    }
    Ok(())
}

/// An outcome for a lane that produced only the part of a cycle it was given.
pub fn step_parts(measure: &str, steps: Vec<(&str, Latencies)>, measured: bool) -> Vec<Part> {
    steps
        .into_iter()
        .filter(|(_, lat)| !lat.is_empty() || !measured)
        .map(|(step, lat)| Part {
            name: format!("{measure} step: {step}"),
            latencies: if measured {
                Outcome::Done(Measured { value: lat, cpu: crate::host::CpuUse::default() })
            } else {
                Outcome::skipped(format!("{measure} cycle failed"))
            },
            own_cpu: false,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::CpuUse;

    /// A fake tool whose cold route 1 always fails and which has no exec.
    struct Fake {
        c: Contender,
        colds: usize,
    }

    impl Contestant for Fake {
        fn contender(&mut self) -> &mut Contender {
            &mut self.c
        }
        fn cold_routes(&self) -> Vec<String> {
            vec!["main".into(), "broken".into()]
        }
        fn cold(&mut self, route: usize) -> Result<Duration> {
            self.colds += 1;
            if route == 1 {
                return Err(BenchError::parse("route", "broken"));
            }
            Ok(Duration::from_millis(3))
        }
        fn sustain(&mut self, clients: usize, window: Duration) -> Result<Measured<Sustained>> {
            let mut cycles = Latencies::default();
            cycles.push(Duration::from_millis(1));
            Ok(Measured { value: Sustained { clients, elapsed: window, cycles }, cpu: CpuUse::default() })
        }
        fn idle(&mut self, _: &Plan) -> Result<Measured<IdleMemory>> {
            Err(BenchError::parse("idle", "not here"))
        }
    }

    #[test]
    fn every_measure_lands_in_its_slot_and_failures_stay_local() {
        let plan = Plan {
            samples: 4,
            warmup: 1,
            exec_samples: 2,
            sustain: Duration::from_secs(30),
            clients: 2,
            idle: 1,
            idle_cpu_window: Duration::ZERO,
            settle: Duration::ZERO,
            pool_size: 1,
            held_cold_samples: 0,
        };
        let mut a = Fake { c: Contender::new("a", "1"), colds: 0 };
        let mut b = Fake { c: Contender::new("b", "1"), colds: 0 };
        run_all(&plan, &mut [&mut a, &mut b]).unwrap();
        for f in [&a, &b] {
            assert_eq!(f.c.cold.done().unwrap().value.len(), 4);
            assert!(matches!(f.c.parts[0].latencies, Outcome::Failed(_)) && f.c.parts[0].name == "cold, broken");
            assert!(matches!(f.c.exec, Outcome::Skipped(_)));
            let s = &f.c.sustained.done().unwrap().value;
            assert_eq!((s.cycles.len(), s.elapsed), (3, Duration::from_secs(30)), "three 10 s slices merged");
            assert!(matches!(f.c.idle, Outcome::Failed(_)));
            assert_eq!(f.colds, 1 + 4 + 1, "warm-up and samples of route 0, one failed warm-up of route 1");
        }
    }
}

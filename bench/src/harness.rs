//! The measuring loops every contender goes through, so Warren and its peers
//! are timed by the same code: sequential samples, several clients for a
//! fixed time, and many idle sandboxes held while memory is read.
//!
//! Each client thread gets its own state from a factory (a Warren client
//! with its own connection; nothing for a CLI peer), so no two clients share
//! a lock while timing.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::error::{BenchError, Result};
use crate::host::{self, CpuSnapshot, CpuUse};
use crate::results::{IdleMemory, Measured, Plan, Sustained};
use crate::stats::{Failures, Latencies};

/// A run of failures this long with no success means the contender is
/// broken here; stop instead of waiting out every sample's timeout.
const GIVE_UP_AFTER_FAILURES: u64 = 10;

pub fn check_interrupt() -> Result<()> {
    if crate::interrupted() {
        Err(BenchError::Interrupted)
    } else {
        Ok(())
    }
}

fn hopeless(l: &Latencies) -> bool {
    l.is_empty() && l.failures.count >= GIVE_UP_AFTER_FAILURES
}

fn give_up(l: &Latencies) -> BenchError {
    let first = l.failures.examples.keys().next().cloned().unwrap_or_default();
    BenchError::Unexpected {
        op: "every attempt".into(),
        detail: format!("{} failures, e.g. {first}", l.failures.count),
    }
}

/// `warmup` unrecorded calls, then `n` recorded ones, one after another.
/// `once` returns the time of the part that is being measured.
pub fn sequential(warmup: usize, n: usize, mut once: impl FnMut() -> Result<Duration>) -> Result<Measured<Latencies>> {
    for _ in 0..warmup {
        check_interrupt()?;
        once()?;
    }
    let cpu = CpuSnapshot::now()?;
    let mut lat = Latencies::default();
    for _ in 0..n {
        check_interrupt()?;
        match once() {
            Ok(d) => lat.push(d),
            Err(BenchError::Interrupted) => return Err(BenchError::Interrupted),
            Err(e) => lat.fail(e.to_string()),
        }
        if hopeless(&lat) {
            return Err(give_up(&lat));
        }
    }
    Ok(Measured { value: lat, cpu: cpu.since()? })
}

/// Samples several lanes (one per contender and route) in rounds, so every
/// lane sees the same background load: round `r` visits the lanes starting
/// at lane `r % lanes`. Each lane first gets `warmup` unrecorded samples; a
/// lane whose warm-up fails, or that keeps failing, drops out with its error
/// while the others go on. Host CPU is read around every sample and summed
/// per lane.
pub fn interleaved(
    warmup: usize,
    n: usize,
    lanes: usize,
    mut sample: impl FnMut(usize) -> Result<Duration>,
) -> Result<Vec<Result<Measured<Latencies>>>> {
    let load_at_start = host::loadavg1();
    let mut out: Vec<Result<(Latencies, CpuUse)>> =
        (0..lanes).map(|_| Ok((Latencies::default(), CpuUse { load_at_start, ..CpuUse::default() }))).collect();
    for (lane, slot) in out.iter_mut().enumerate() {
        for _ in 0..warmup {
            check_interrupt()?;
            if let Err(e) = sample(lane) {
                *slot = Err(e);
                break;
            }
        }
    }
    for round in 0..n {
        for k in 0..lanes {
            check_interrupt()?;
            let lane = (round + k) % lanes;
            let Ok((lat, cpu)) = &mut out[lane] else { continue };
            let before = CpuSnapshot::now()?;
            let result = sample(lane);
            cpu.add(&before.since()?);
            match result {
                Ok(d) => lat.push(d),
                Err(BenchError::Interrupted) => return Err(BenchError::Interrupted),
                Err(e) => lat.fail(e.to_string()),
            }
            if hopeless(lat) {
                out[lane] = Err(give_up(lat));
            }
        }
    }
    Ok(out.into_iter().map(|r| r.map(|(value, cpu)| Measured { value, cpu })).collect())
}

/// `clients` threads repeat `once` until `duration` has passed; the rate is
/// completed cycles over the time until the last one finished.
pub fn sustained<W: Send>(
    clients: usize,
    duration: Duration,
    worker: impl Fn() -> Result<W> + Sync,
    once: impl Fn(&mut W) -> Result<Duration> + Sync,
) -> Result<Measured<Sustained>> {
    let workers: Vec<W> = (0..clients.max(1)).map(|_| worker()).collect::<Result<_>>()?;
    let cpu = CpuSnapshot::now()?;
    let started = Instant::now();
    let per_client: Vec<Latencies> = std::thread::scope(|s| {
        let handles: Vec<_> = workers
            .into_iter()
            .map(|mut w| {
                let once = &once;
                s.spawn(move || {
                    let mut lat = Latencies::default();
                    while started.elapsed() < duration && !crate::interrupted() && !hopeless(&lat) {
                        match once(&mut w) {
                            Ok(d) => lat.push(d),
                            Err(e) => lat.fail(e.to_string()),
                        }
                    }
                    lat
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_default()).collect()
    });
    let elapsed = started.elapsed();
    check_interrupt()?;
    let mut cycles = Latencies::default();
    for l in per_client {
        cycles.merge(l);
    }
    if hopeless(&cycles) {
        return Err(give_up(&cycles));
    }
    Ok(Measured { value: Sustained { clients: clients.max(1), elapsed, cycles }, cpu: cpu.since()? })
}

/// What the idle-memory measure reads besides MemAvailable.
#[derive(Debug, Clone, Default)]
pub struct IdleUsage {
    /// Sum of the sandboxes' memory cgroup usage, when it can be read.
    pub cgroup_bytes: Option<u64>,
    /// How that sum was read.
    pub source: String,
    /// Other figures (label, value).
    pub extra: Vec<(String, String)>,
}

/// How one contender holds idle sandboxes. A handle must release its
/// sandbox when dropped, so an error anywhere still cleans up.
pub trait IdleHolder: Sync {
    /// Per-client state (a connection, or nothing).
    type Worker: Send;
    type Handle: Send;
    fn worker(&self) -> Result<Self::Worker>;
    fn start(&self, worker: &mut Self::Worker, index: usize) -> Result<Self::Handle>;
    /// Waits until every started sandbox is idle (its process is running).
    fn ready(&self, handles: &[Self::Handle]) -> Result<()>;
    fn usage(&self, handles: &[Self::Handle]) -> IdleUsage;
    fn stop(&self, worker: &mut Self::Worker, handle: Self::Handle) -> Result<()>;
    /// True when a sandbox dies with the thread that started it (a parent-death
    /// signal is tied to the thread, not the process): then all are started
    /// one by one from the calling thread, which outlives them.
    fn tied_to_starting_thread(&self) -> bool {
        false
    }
}

/// Starts `plan.idle` sandboxes with `plan.clients` threads, lets them
/// settle, reads host memory and idle CPU, takes `plan.held_cold_samples`
/// cycles of `cold` (the contender's cold create+exec+destroy) while they
/// are all still there, then stops them all.
pub fn idle<T: IdleHolder>(
    plan: &Plan,
    holder: &T,
    cold: impl FnMut() -> Result<Duration>,
) -> Result<Measured<IdleMemory>> {
    let mut workers: Vec<T::Worker> = (0..plan.clients.max(1)).map(|_| holder.worker()).collect::<Result<_>>()?;
    let before = host::settled_mem_snapshot()?;
    let cpu = CpuSnapshot::now()?;

    let started_at = Instant::now();
    let (handles, start_failures) = start_all(holder, &mut workers, plan.idle);
    let start_wall = started_at.elapsed();
    let mut m = IdleMemory {
        requested: plan.idle,
        started: handles.len(),
        start_failures,
        start_wall,
        before,
        ..Default::default()
    };

    // Whatever happens here, the handles are stopped below (or by their Drop).
    let measured = measure_idle(plan, holder, &handles, &mut m, cold);

    let stopped_at = Instant::now();
    m.stop_failures = stop_all(holder, &mut workers, handles);
    m.stop_wall = stopped_at.elapsed();
    measured?;
    if m.started == 0 {
        return Err(BenchError::Unexpected { op: "idle start".into(), detail: m.start_failures.summary() });
    }
    std::thread::sleep(plan.settle);
    m.after = host::settled_mem_snapshot()?;
    Ok(Measured { value: m, cpu: cpu.since()? })
}

fn start_all<T: IdleHolder>(holder: &T, workers: &mut [T::Worker], n: usize) -> (Vec<T::Handle>, Failures) {
    if holder.tied_to_starting_thread() {
        return start_here(holder, workers, n);
    }
    let next = AtomicUsize::new(0);
    let handles = Mutex::new(Vec::with_capacity(n));
    let failures = Mutex::new(Failures::default());
    let hopeless = || {
        let failed = failures.lock().map_or(0, |f| f.count);
        failed >= GIVE_UP_AFTER_FAILURES && handles.lock().map_or(true, |h| h.is_empty())
    };
    std::thread::scope(|s| {
        for w in workers.iter_mut() {
            let (next, handles, failures, hopeless) = (&next, &handles, &failures, &hopeless);
            s.spawn(move || loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n || crate::interrupted() || hopeless() {
                    return;
                }
                match holder.start(w, i) {
                    Ok(h) => handles.lock().unwrap_or_else(|p| p.into_inner()).push(h),
                    Err(e) => failures.lock().unwrap_or_else(|p| p.into_inner()).record(e.to_string()),
                }
            });
        }
    });
    (handles.into_inner().unwrap_or_else(|p| p.into_inner()), failures.into_inner().unwrap_or_else(|p| p.into_inner()))
}

fn start_here<T: IdleHolder>(holder: &T, workers: &mut [T::Worker], n: usize) -> (Vec<T::Handle>, Failures) {
    let mut handles = Vec::with_capacity(n);
    let mut failures = Failures::default();
    let Some(w) = workers.first_mut() else { return (handles, failures) };
    for i in 0..n {
        if crate::interrupted() || (handles.is_empty() && failures.count >= GIVE_UP_AFTER_FAILURES) {
            break;
        }
        match holder.start(w, i) {
            Ok(h) => handles.push(h),
            Err(e) => failures.record(e.to_string()),
        }
    }
    (handles, failures)
}

fn measure_idle<T: IdleHolder>(
    plan: &Plan,
    holder: &T,
    handles: &[T::Handle],
    m: &mut IdleMemory,
    cold: impl FnMut() -> Result<Duration>,
) -> Result<()> {
    check_interrupt()?;
    if handles.is_empty() {
        return Ok(());
    }
    holder.ready(handles)?;
    std::thread::sleep(plan.settle);
    check_interrupt()?;
    m.during = host::settled_mem_snapshot()?;
    let usage = holder.usage(handles);
    m.cgroup_bytes = usage.cgroup_bytes;
    m.cgroup_source = usage.source;
    m.extra = usage.extra;
    let quiet = CpuSnapshot::now()?;
    std::thread::sleep(plan.idle_cpu_window);
    m.idle_cpu = Some(quiet.since()?);
    if plan.held_cold_samples > 0 {
        // A failure spoils only this figure, not the memory measure.
        match sequential(plan.warmup, plan.held_cold_samples, cold) {
            Ok(cycles) => m.cold_while_held = Some(cycles.value),
            Err(BenchError::Interrupted) => return Err(BenchError::Interrupted),
            Err(e) => m.extra.push(("cold cycles while held".into(), format!("failed: {e}"))),
        }
    }
    Ok(())
}

fn stop_all<T: IdleHolder>(holder: &T, workers: &mut [T::Worker], handles: Vec<T::Handle>) -> Failures {
    let queue = Mutex::new(handles);
    let failures = Mutex::new(Failures::default());
    std::thread::scope(|s| {
        for w in workers.iter_mut() {
            let (queue, failures) = (&queue, &failures);
            s.spawn(move || loop {
                let Some(h) = queue.lock().unwrap_or_else(|p| p.into_inner()).pop() else { return };
                if let Err(e) = holder.stop(w, h) {
                    failures.lock().unwrap_or_else(|p| p.into_inner()).record(e.to_string());
                }
            });
        }
    });
    failures.into_inner().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;
    use std::sync::Arc;

    fn plan() -> Plan {
        Plan {
            samples: 3,
            warmup: 1,
            exec_samples: 3,
            sustain: Duration::from_millis(50),
            clients: 3,
            idle: 20,
            idle_cpu_window: Duration::from_millis(10),
            settle: Duration::from_millis(1),
            pool_size: 1,
            held_cold_samples: 0,
        }
    }

    #[test]
    fn sequential_records_failures_and_gives_up_on_a_broken_tool() {
        let mut i = 0;
        let m = sequential(1, 4, || {
            i += 1;
            // The warm-up call (i == 1) succeeds; then 2 of the 4 samples fail.
            if i % 2 == 1 {
                Ok(Duration::from_millis(i))
            } else {
                Err(BenchError::parse("x", "even"))
            }
        });
        let lat = m.unwrap().value;
        assert_eq!((lat.len(), lat.failures.count), (2, 2));
        assert!(sequential(0, 100, || Err(BenchError::parse("x", "always"))).is_err());
    }

    #[test]
    fn interleaved_lanes_rotate_and_a_broken_lane_drops_out_alone() {
        let mut order = Vec::new();
        let got = interleaved(1, 3, 3, |lane| {
            order.push(lane);
            if lane == 2 {
                Err(BenchError::parse("lane", "broken"))
            } else {
                Ok(Duration::from_millis(lane as u64 + 1))
            }
        })
        .unwrap();
        // Warm-up visits each lane once; lane 2 fails it and is never sampled again.
        assert_eq!(order, vec![0, 1, 2, 0, 1, 1, 0, 0, 1]);
        assert_eq!(got[0].as_ref().unwrap().value.len(), 3);
        assert_eq!(got[1].as_ref().unwrap().value.p50(), Some(Duration::from_millis(2)));
        assert!(got[2].is_err());
    }

    #[test]
    fn sustained_clients_each_run_their_own_state() {
        let made = AtomicU64::new(0);
        let m = sustained(
            3,
            Duration::from_millis(30),
            || Ok(made.fetch_add(1, Ordering::Relaxed)),
            |_w| {
                std::thread::sleep(Duration::from_millis(1));
                Ok(Duration::from_millis(1))
            },
        )
        .unwrap();
        assert_eq!(made.load(Ordering::Relaxed), 3);
        assert!(m.value.cycles.len() >= 3 && m.value.per_second() > 0.0);
    }

    struct Token(Arc<AtomicU64>);
    impl Drop for Token {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::Relaxed);
        }
    }

    struct Counter {
        live: Arc<AtomicU64>,
        fail_ready: bool,
    }

    impl IdleHolder for Counter {
        type Worker = ();
        type Handle = Token;
        fn worker(&self) -> Result<()> {
            Ok(())
        }
        fn start(&self, _: &mut (), i: usize) -> Result<Token> {
            if i == 7 {
                return Err(BenchError::parse("start", "seven"));
            }
            self.live.fetch_add(1, Ordering::Relaxed);
            Ok(Token(Arc::clone(&self.live)))
        }
        fn ready(&self, _: &[Token]) -> Result<()> {
            if self.fail_ready {
                Err(BenchError::parse("ready", "no"))
            } else {
                Ok(())
            }
        }
        fn usage(&self, h: &[Token]) -> IdleUsage {
            IdleUsage { cgroup_bytes: Some(h.len() as u64 * 10), source: "test".into(), extra: vec![] }
        }
        fn stop(&self, _: &mut (), t: Token) -> Result<()> {
            drop(t);
            Ok(())
        }
    }

    #[test]
    fn idle_stops_everything_it_started_even_when_ready_fails() {
        for fail_ready in [false, true] {
            let counter = Counter { live: Arc::new(AtomicU64::new(0)), fail_ready };
            // Each cold cycle sees every started sandbox still there.
            let live = Arc::clone(&counter.live);
            let held = std::cell::RefCell::new(Vec::new());
            let plan = Plan { held_cold_samples: 3, ..plan() };
            let got = idle(&plan, &counter, || {
                held.borrow_mut().push(live.load(Ordering::Relaxed));
                Ok(Duration::from_millis(1))
            });
            assert_eq!(counter.live.load(Ordering::Relaxed), 0, "all stopped (fail_ready={fail_ready})");
            if fail_ready {
                assert!(got.is_err());
            } else {
                let m = got.unwrap().value;
                assert_eq!((m.requested, m.started, m.start_failures.count), (20, 19, 1));
                assert_eq!(m.cgroup_bytes, Some(190));
                assert_eq!(held.into_inner(), vec![19; plan.warmup + 3]);
                assert_eq!(m.cold_while_held.map(|cold| cold.len()), Some(3));
            }
        }
    }
}

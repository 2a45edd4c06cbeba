//! The results file: machine, versions, command, the side-by-side table,
//! the ratios, the targets (met or not), and per contender the details that
//! say what limits each figure.

use std::fmt::Write as _;
use std::time::Duration;

use crate::host::{CpuUse, Machine};
use crate::results::{Contender, IdleMemory, Measured, Outcome, Plan, Sustained};
use crate::rootfs::Rootfs;
use crate::stats::{self, Latencies};

pub struct Run<'a> {
    pub date: String,
    pub started_utc: String,
    pub took: Duration,
    pub command: String,
    pub machine: &'a Machine,
    pub load_start: String,
    pub load_end: String,
    pub rootfs: &'a Rootfs,
    pub plan: &'a Plan,
    pub contenders: &'a [Contender],
}

const TARGET_WARM_P50: Duration = Duration::from_millis(2);
const TARGET_EXEC_P50: Duration = Duration::from_millis(1);
const TARGET_RATE: f64 = 300.0;
const TARGET_IDLE_BYTES: f64 = 1024.0 * 1024.0;
/// The name of the contender that starts the same `true` with no sandbox.
pub const FLOOR: &str = "no sandbox";

pub fn render(run: &Run<'_>) -> String {
    let mut out = String::new();
    header(&mut out, run);
    targets(&mut out, run);
    side_by_side(&mut out, run);
    ratios(&mut out, run);
    for c in run.contenders {
        details(&mut out, c, run.machine.nproc);
    }
    out
}

fn header(out: &mut String, run: &Run<'_>) {
    let m = run.machine;
    let p = run.plan;
    let _ = writeln!(out, "# Warren side-by-side benchmark, {}\n", run.date);
    let _ = writeln!(
        out,
        "- Machine: {}, {} CPUs (nproc), kernel {}, {} RAM",
        m.cpu_model,
        m.nproc,
        m.kernel,
        stats::bytes(m.mem_total_bytes as f64)
    );
    let _ = writeln!(
        out,
        "- Load average (1/5/15 min) at start: {}; at end: {}. Other work on the host shares the CPUs and \
         shows in every figure.",
        run.load_start, run.load_end
    );
    let _ = writeln!(out, "- Started {} UTC, took {:.0} s", run.started_utc, run.took.as_secs_f64());
    let _ = writeln!(out, "- Command: `{}`", run.command);
    let _ = writeln!(
        out,
        "- Rootfs (same for all): {} static, {} entries, {} bytes, built by scripts/make-test-image.sh at {}",
        run.rootfs.busybox_version,
        run.rootfs.files,
        run.rootfs.bytes,
        run.rootfs.dir.display()
    );
    let _ = writeln!(
        out,
        "- Plan: {} cold/warm samples after {} unrecorded warm-up cycles; {} exec samples; {} s sustained with {} \
         clients; {} idle sandboxes, and {} cold cycles while they are held; warm pool of {}. Cold and exec samples are interleaved round by round \
         across the contenders (one sample at a time, rotating who goes first), and the sustained window is cut \
         into slices the contenders take in turn, so all of them see the same background load; idle memory and \
         the warm pool are measured one contender at a time. Percentiles are nearest-rank (every figure is a \
         measured sample).",
        p.samples,
        p.warmup,
        p.exec_samples,
        p.sustain.as_secs(),
        p.clients,
        p.idle,
        p.held_cold_samples,
        p.pool_size
    );
    let _ = writeln!(out, "\n| tool | version |\n|---|---|");
    for c in run.contenders {
        let _ = writeln!(out, "| {} | {} |", c.name, c.version);
    }
    out.push('\n');
}

fn warren<'a>(run: &'a Run<'_>) -> Option<&'a Contender> {
    run.contenders.iter().find(|c| c.name == "Warren")
}

/// The contender that starts the same `true` with no sandbox.
fn floor<'a>(run: &'a Run<'_>) -> Option<&'a Contender> {
    peer(run, FLOOR)
}

fn peer<'a>(run: &'a Run<'_>, name: &str) -> Option<&'a Contender> {
    run.contenders.iter().find(|c| c.name == name)
}

fn lat(o: &Outcome<Latencies>) -> Option<&Latencies> {
    o.done().map(|m| &m.value).filter(|l| !l.is_empty())
}

fn verdict(met: Option<bool>) -> &'static str {
    match met {
        Some(true) => "**met**",
        Some(false) => "**not met**",
        None => "not measured",
    }
}

fn p50_of(l: Option<&Latencies>) -> String {
    stats::opt_ms(l.and_then(Latencies::p50))
}

/// The exec split's p50s, as a sentence for the exec target's row (empty
/// when the split was not measured).
fn exec_split_summary(c: &Contender) -> String {
    use crate::exec_split::{self as split, part_name};
    let part = |name: &str| c.part(&part_name(name));
    let (get, exec, bare) = (part(split::GET), part(split::EXEC_TRUE), part(split::BARE_TRUE));
    let Some(path) = split::exec_path(exec, get, bare) else { return String::new() };
    let paced = split::exec_path(part(split::PACED_EXEC), part(split::PACED_GET), part(split::PACED_BARE));
    format!(
        ". Split (one sandbox, interleaved): API round trip with no exec {}, exec `true` {}, `true` with no sandbox \
         {}, so the exec path itself {}; without a C library's start-up: exec `exit0` {}, with no sandbox {}; \
         after 100 ms idle: exec `true` {}, GET {}, `true` with no sandbox {} (exec path {})",
        p50_of(get),
        p50_of(exec),
        p50_of(bare),
        stats::ms(path),
        p50_of(part(split::EXEC_EXIT0)),
        p50_of(part(split::BARE_EXIT0)),
        p50_of(part(split::PACED_EXEC)),
        p50_of(part(split::PACED_GET)),
        p50_of(part(split::PACED_BARE)),
        stats::opt_ms(paced)
    )
}

fn targets(out: &mut String, run: &Run<'_>) {
    let _ =
        writeln!(out, "## Targets\n\n| target | measured | verdict | what the figure is made of |\n|---|---|---|---|");
    let w = warren(run);
    let cold_w = w.and_then(|c| lat(&c.cold)).and_then(Latencies::p50);
    let cold_b = peer(run, "bwrap").and_then(|c| lat(&c.cold)).and_then(Latencies::p50);
    let _ = writeln!(
        out,
        "| cold create+exec+destroy p50 <= bwrap's | Warren {} vs bwrap {} | {} | {} |",
        stats::opt_ms(cold_w),
        stats::opt_ms(cold_b),
        verdict(cold_w.zip(cold_b).map(|(w, b)| w <= b)),
        w.map_or(String::new(), |c| format!(
            "p50 of the steps: create {}, exec {}, delete {}; server CPU per cycle {}",
            p50_of(c.part("cold step: create")),
            p50_of(c.part("cold step: exec `true`")),
            p50_of(c.part("cold step: delete (after the timed cycle)")),
            stats::opt_ms(c.server_cpu_per("cold cycle"))
        ))
    );
    let warm = w.and_then(|c| lat(&c.warm)).and_then(Latencies::p50);
    let _ = writeln!(
        out,
        "| warm claim+exec p50 <= 2 ms | {} | {} | {} |",
        stats::opt_ms(warm),
        verdict(warm.map(|d| d <= TARGET_WARM_P50)),
        w.map_or(String::new(), |c| format!(
            "p50 of the steps: claim {}, exec {}",
            p50_of(c.part("warm step: claim")),
            p50_of(c.part("warm step: exec `true`"))
        ))
    );
    let exec = w.and_then(|c| c.exec.done());
    let exec_p50 = exec.and_then(|m| m.value.p50());
    let _ = writeln!(
        out,
        "| exec round trip p50 <= 1 ms | {} | {} | {} |",
        stats::opt_ms(exec_p50),
        verdict(exec_p50.map(|d| d <= TARGET_EXEC_P50)),
        match (w, exec) {
            (Some(c), Some(m)) => format!(
                "server CPU per exec {}; host CPU per exec {}; load {:.1} at start; the same `true` with no sandbox \
                 (the floor): {}{}",
                stats::opt_ms(c.server_cpu_per("exec")),
                stats::opt_ms(m.cpu.per_op(m.value.len())),
                m.cpu.load_at_start,
                stats::opt_ms(floor(run).and_then(|f| lat(&f.exec)?.p50())),
                exec_split_summary(c)
            ),
            _ => String::new(),
        }
    );
    let sustained = w.and_then(|c| c.sustained.done());
    let rate = sustained.map(|m| m.value.per_second());
    let _ = writeln!(
        out,
        "| >= 300 creations/s sustained | {} | {} | {} |",
        rate.map_or("-".into(), |r| format!("{r:.1}/s")),
        verdict(rate.map(|r| r >= TARGET_RATE)),
        match (w, sustained) {
            (Some(c), Some(m)) => format!(
                "{} clients; CPUs {:.0}% busy; server CPU per create+delete {}; cycle p50 {}",
                m.value.clients,
                m.cpu.percent_of_host(run.machine.nproc),
                stats::opt_ms(c.server_cpu_per("create+delete")),
                stats::opt_ms(m.value.cycles.p50())
            ),
            _ => String::new(),
        }
    );
    let idle = w.and_then(|c| c.idle.done()).map(|m| &m.value);
    let drop = idle.and_then(IdleMemory::per_sandbox_drop);
    let cg = idle.and_then(IdleMemory::per_sandbox_cgroup);
    let kernel = idle.and_then(IdleMemory::per_sandbox_kernel_pinned);
    let bytes = |v: Option<f64>| v.map_or("-".into(), stats::bytes);
    let _ = writeln!(
        out,
        "| <= 1 MiB host memory per idle sandbox (MemAvailable drop) | {} | {} | memory cgroups {} per sandbox; \
         kernel pinned memory grew {} per sandbox; against the after-teardown level: {} |",
        bytes(drop),
        verdict(drop.map(|b| b <= TARGET_IDLE_BYTES)),
        bytes(cg),
        bytes(kernel),
        bytes(idle.and_then(IdleMemory::per_sandbox_drop_vs_after))
    );
    out.push('\n');
}

/// One row's value for a contender.
type Cell = fn(&Contender) -> Option<String>;

fn side_by_side(out: &mut String, run: &Run<'_>) {
    let names: Vec<&str> = run.contenders.iter().map(|c| c.name.as_str()).collect();
    let _ = writeln!(out, "## Side by side\n\n| measure | {} |", names.join(" | "));
    let _ = writeln!(out, "|---|{}", "---|".repeat(names.len()));
    let rows: [(&str, Cell); 12] = [
        ("cold create+exec+destroy p50", |c| lat(&c.cold)?.p50().map(stats::ms)),
        ("cold create+exec+destroy p99", |c| lat(&c.cold)?.p99().map(stats::ms)),
        ("warm claim+exec p50", |c| lat(&c.warm)?.p50().map(stats::ms)),
        ("warm claim+exec p99", |c| lat(&c.warm)?.p99().map(stats::ms)),
        ("exec round trip p50", |c| lat(&c.exec)?.p50().map(stats::ms)),
        ("exec round trip p99", |c| lat(&c.exec)?.p99().map(stats::ms)),
        ("sustained creations/s", |c| c.sustained.done().map(|m| format!("{:.1}", m.value.per_second()))),
        ("sustained errors", |c| c.sustained.done().map(|m| m.value.cycles.failures.count.to_string())),
        ("host memory per idle sandbox (MemAvailable)", |c| c.idle.done()?.value.per_sandbox_drop().map(stats::bytes)),
        ("memory cgroup per idle sandbox", |c| c.idle.done()?.value.per_sandbox_cgroup().map(stats::bytes)),
        ("cold create+exec+destroy p50 while the idle sandboxes are held", |c| held_cold_p50(c).map(stats::ms)),
        ("- over cold p50 with none held", |c| {
            let (held, none) = (secs(held_cold_p50(c))?, secs(lat(&c.cold)?.p50())?);
            (none > 0.0).then(|| format!("{:.2}x", held / none))
        }),
    ];
    for (label, cell) in rows {
        let cells: Vec<String> = run.contenders.iter().map(|c| cell(c).unwrap_or_else(|| "-".into())).collect();
        let _ = writeln!(out, "| {label} | {} |", cells.join(" | "));
    }
    let _ = writeln!(out, "\n`-`: not applicable or failed; see the details below.\n");
}

/// The cold cycle's p50 taken while the contender's idle sandboxes were held.
fn held_cold_p50(c: &Contender) -> Option<Duration> {
    c.idle.done()?.value.cold_while_held.as_ref()?.p50()
}

fn secs(d: Option<Duration>) -> Option<f64> {
    d.map(|d| d.as_secs_f64())
}

/// Warren's figure over a peer's, for one measure.
type Figure = fn(&Contender) -> Option<f64>;

fn ratios(out: &mut String, run: &Run<'_>) {
    let Some(w) = warren(run) else { return };
    let peers: Vec<&Contender> = run.contenders.iter().filter(|c| c.name != "Warren").collect();
    if peers.is_empty() {
        return;
    }
    let names: Vec<&str> = peers.iter().map(|c| c.name.as_str()).collect();
    let _ = writeln!(
        out,
        "## Ratios (Warren / peer)\n\nFor times and memory below 1 favours Warren; for the rate above 1 does.\n"
    );
    let _ = writeln!(
        out,
        "| measure | {} |",
        names.iter().map(|n| format!("Warren / {n}")).collect::<Vec<_>>().join(" | ")
    );
    let _ = writeln!(out, "|---|{}", "---|".repeat(names.len()));
    let rows: [(&str, Figure); 7] = [
        ("cold p50", |c| secs(lat(&c.cold)?.p50())),
        ("cold p99", |c| secs(lat(&c.cold)?.p99())),
        ("exec round trip p50", |c| secs(lat(&c.exec)?.p50())),
        ("exec round trip p99", |c| secs(lat(&c.exec)?.p99())),
        ("sustained creations/s", |c| c.sustained.done().map(|m| m.value.per_second())),
        ("host memory per idle sandbox (MemAvailable)", |c| c.idle.done()?.value.per_sandbox_drop()),
        ("cold p50 while the idle sandboxes are held", |c| secs(held_cold_p50(c))),
    ];
    for (label, figure) in rows {
        let cells: Vec<String> = peers
            .iter()
            .map(|p| match (figure(w), figure(p)) {
                (Some(a), Some(b)) if b > 0.0 => format!("{:.2}", a / b),
                _ => "-".into(),
            })
            .collect();
        let _ = writeln!(out, "| {label} | {} |", cells.join(" | "));
    }
    out.push('\n');
}

const DETAIL_HEADER: &str =
    "| measure | n | p50 | p99 | mean | max | failures | host CPU per op | CPUs busy | load at start | what limits it |";

fn details(out: &mut String, c: &Contender, nproc: usize) {
    let _ = writeln!(out, "## {} in detail\n", c.name);
    for (what, command) in &c.commands {
        let _ = writeln!(out, "- {what}: `{command}`");
    }
    let _ = writeln!(out, "\n{DETAIL_HEADER}");
    let _ = writeln!(out, "|{}", "---|".repeat(DETAIL_HEADER.matches('|').count() - 1));
    for (measure, name, outcome) in [
        ("cold", "cold create+exec+destroy", &c.cold),
        ("warm", "warm claim+exec", &c.warm),
        ("exec", "exec round trip", &c.exec),
    ] {
        latency_row(out, name, outcome, nproc, true);
        for part in c.parts.iter().filter(|p| p.name.starts_with(measure)) {
            latency_row(out, &format!("- {}", part.name), &part.latencies, nproc, part.own_cpu);
        }
    }
    // Measures of one contender only, shown by their steps (pause and resume).
    for part in c.parts.iter().filter(|p| p.name.starts_with("pause")) {
        latency_row(out, &format!("- {}", part.name), &part.latencies, nproc, part.own_cpu);
    }
    sustained_row(out, &c.sustained, nproc);
    out.push('\n');
    idle_section(out, &c.idle, nproc);
    for (op, cpu) in &c.server_cpu {
        let _ = writeln!(out, "- server process CPU (its own and its reaped children's) per {op}: {}", stats::ms(*cpu));
    }
    for note in &c.notes {
        let _ = writeln!(out, "- {note}");
    }
    out.push('\n');
}

fn not_done<T>(o: &Outcome<T>) -> Option<String> {
    match o {
        Outcome::Done(_) => None,
        Outcome::Failed(e) => Some(format!("failed: {}", e.replace('\n', " ").replace('|', "/"))),
        Outcome::Skipped(why) => Some(format!("n/a: {why}")),
    }
}

/// One latency measure; `own_cpu` is false for a step, which has no CPU figure of its own.
fn latency_row(out: &mut String, name: &str, o: &Outcome<Latencies>, nproc: usize, own_cpu: bool) {
    if let Some(why) = not_done(o) {
        let _ = writeln!(out, "| {name} | | | | | | | | | | {why} |");
        return;
    }
    let Some(Measured { value: l, cpu }) = o.done() else { return };
    let per_op = cpu.per_op(l.len() + l.failures.count as usize);
    let (per_op, busy, load, limit) = if own_cpu {
        (
            stats::opt_ms(per_op),
            format!("{:.0}%", cpu.percent_of_host(nproc)),
            format!("{:.1}", cpu.load_at_start),
            latency_limit(l, cpu, nproc),
        )
    } else {
        ("-".into(), "-".into(), "-".into(), String::new())
    };
    let _ = writeln!(
        out,
        "| {name} | {} | {} | {} | {} | {} | {} | {per_op} | {busy} | {load} | {limit} |",
        l.len(),
        stats::opt_ms(l.p50()),
        stats::opt_ms(l.p99()),
        stats::opt_ms(l.mean()),
        stats::opt_ms(l.max()),
        l.failures.summary(),
    );
}

/// A sequential sample keeps at most one CPU busy with its own work; if the
/// host was busier than one CPU's worth, something else ran too.
fn latency_limit(l: &Latencies, cpu: &CpuUse, nproc: usize) -> String {
    let (Some(mean), Some(per_op)) = (l.mean(), cpu.per_op(l.len())) else { return String::new() };
    let on_cpu = per_op.as_secs_f64() / mean.as_secs_f64().max(1e-9);
    if on_cpu > 1.0 {
        format!(
            "host CPU per op exceeds the op's time ({:.0}%): other work on the host shared the {nproc} CPUs",
            on_cpu * 100.0
        )
    } else if on_cpu >= 0.8 {
        format!("CPU: {:.0}% of each op's time some CPU was busy", on_cpu * 100.0)
    } else {
        format!(
            "waiting: only {:.0}% of each op's time had a CPU busy; the rest is sleeps, wake-ups and kernel grace periods",
            on_cpu * 100.0
        )
    }
}

fn sustained_row(out: &mut String, o: &Outcome<Sustained>, nproc: usize) {
    let name = "sustained cycles";
    if let Some(why) = not_done(o) {
        let _ = writeln!(out, "| {name} | | | | | | | | | | {why} |");
        return;
    }
    let Some(Measured { value: s, cpu }) = o.done() else { return };
    let busy = cpu.percent_of_host(nproc);
    let limit = if busy >= 90.0 {
        format!("CPU: {busy:.0}% of {nproc} CPUs busy at {:.1}/s with {} clients", s.per_second(), s.clients)
    } else {
        format!(
            "not CPU ({busy:.0}% busy) at {:.1}/s with {} clients: serialisation or waiting",
            s.per_second(),
            s.clients
        )
    };
    let l = &s.cycles;
    let _ = writeln!(
        out,
        "| {name} ({:.1}/s over {:.0} s) | {} | {} | {} | {} | {} | {} | {} | {busy:.0}% | {:.1} | {limit} |",
        s.per_second(),
        s.elapsed.as_secs_f64(),
        l.len(),
        stats::opt_ms(l.p50()),
        stats::opt_ms(l.p99()),
        stats::opt_ms(l.mean()),
        stats::opt_ms(l.max()),
        l.failures.summary(),
        stats::opt_ms(cpu.per_op(l.len())),
        cpu.load_at_start,
    );
}

fn idle_section(out: &mut String, o: &Outcome<IdleMemory>, nproc: usize) {
    if let Some(why) = not_done(o) {
        let _ = writeln!(out, "- idle sandboxes: {why}");
        return;
    }
    let Some(Measured { value: m, .. }) = o.done() else { return };
    let _ = writeln!(
        out,
        "- idle sandboxes: {} of {} started in {:.1} s (failures: {}), stopped in {:.1} s (failures: {})",
        m.started,
        m.requested,
        m.start_wall.as_secs_f64(),
        m.start_failures.summary(),
        m.stop_wall.as_secs_f64(),
        m.stop_failures.summary()
    );
    let per = |v: Option<f64>| v.map_or("-".into(), stats::bytes);
    let _ = writeln!(
        out,
        "- MemAvailable: {} per sandbox against the level before they started; {} against the level after \
         teardown ({} of the drop had not come back then: drift from other processes, or memory not returned)",
        per(m.per_sandbox_drop()),
        per(m.per_sandbox_drop_vs_after()),
        stats::bytes(m.not_returned_bytes() as f64)
    );
    let _ = writeln!(
        out,
        "- kernel memory pinned (SUnreclaim + KernelStack + PageTables + Percpu) grew {} per sandbox",
        per(m.per_sandbox_kernel_pinned())
    );
    let _ = writeln!(
        out,
        "- memory cgroups: {} in all, {} per sandbox ({})",
        m.cgroup_bytes.map_or("-".into(), |b| stats::bytes(b as f64)),
        m.per_sandbox_cgroup().map_or("-".into(), stats::bytes),
        m.cgroup_source
    );
    if let (Some(drop), Some(cg)) = (m.per_sandbox_drop(), m.per_sandbox_cgroup()) {
        let _ = writeln!(
            out,
            "- what limits it: {} per sandbox is outside the sandboxes' memory cgroups (kernel objects of the \
             namespaces, mounts and page tables charged elsewhere, plus the manager's own memory)",
            stats::bytes(drop - cg)
        );
    }
    for (label, value) in &m.extra {
        let _ = writeln!(out, "- {label}: {value}");
    }
    if let Some(cold) = &m.cold_while_held {
        let _ = writeln!(
            out,
            "- cold create+exec+destroy while all {} were held: p50 {}, p99 {} ({} cycles, failures: {})",
            m.started,
            cold.p50().map_or("-".into(), stats::ms),
            cold.p99().map_or("-".into(), stats::ms),
            cold.len(),
            cold.failures.summary()
        );
    }
    if let Some(cpu) = m.idle_cpu {
        let _ = writeln!(
            out,
            "- host CPU while all were idle: {:.1}% of {nproc} CPUs over {:.0} s (load {:.1} when it began; \
             other work on the host counts too)",
            cpu.percent_of_host(nproc),
            cpu.wall.as_secs_f64(),
            cpu.load_at_start
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::Machine;
    use std::path::PathBuf;

    fn measured<T>(value: T) -> Outcome<T> {
        Outcome::Done(Measured {
            value,
            cpu: CpuUse { busy: Duration::from_millis(100), wall: Duration::from_secs(1), load_at_start: 1.5 },
        })
    }

    fn lat_ms(v: &[u64]) -> Latencies {
        let mut l = Latencies::default();
        for x in v {
            l.push(Duration::from_millis(*x));
        }
        l
    }

    fn sample_run(warren_cold: u64) -> String {
        let machine =
            Machine { cpu_model: "Test CPU".into(), nproc: 2, kernel: "6.18".into(), mem_total_bytes: 1 << 34 };
        let rootfs =
            Rootfs { dir: PathBuf::from("/tmp/r"), busybox_version: "BusyBox v1".into(), files: 400, bytes: 2_000_000 };
        let plan = Plan {
            samples: 3,
            warmup: 1,
            exec_samples: 3,
            sustain: Duration::from_secs(1),
            clients: 2,
            idle: 10,
            idle_cpu_window: Duration::from_secs(1),
            settle: Duration::from_secs(1),
            pool_size: 4,
            held_cold_samples: 0,
        };
        let mut w = Contender::new("Warren", "warren 0.1.0");
        w.cold = measured(lat_ms(&[warren_cold, warren_cold, warren_cold]));
        w.warm = measured(lat_ms(&[1, 1, 3]));
        w.exec = Outcome::Failed("boom | bang".into());
        w.sustained = measured(Sustained { clients: 2, elapsed: Duration::from_secs(1), cycles: lat_ms(&[1; 400]) });
        w.idle = measured(IdleMemory {
            requested: 10,
            started: 10,
            before: crate::host::MemSnapshot { available: 10 * 512 * 1024, kernel_pinned: 0 },
            cgroup_bytes: Some(10 * 256 * 1024),
            cold_while_held: Some(lat_ms(&[8, 8, 8])),
            ..Default::default()
        });
        let mut b = Contender::new("bwrap", "bubblewrap 0.8.0");
        b.cold = measured(lat_ms(&[5, 5, 5]));
        let contenders = [w, b];
        render(&Run {
            date: "2026-12-02".into(),
            started_utc: "2026-12-02 10:00:00".into(),
            took: Duration::from_secs(60),
            command: "warren-bench --out x.md".into(),
            machine: &machine,
            load_start: "0.1 0.1 0.1".into(),
            load_end: "0.2 0.2 0.2".into(),
            rootfs: &rootfs,
            plan: &plan,
            contenders: &contenders,
        })
    }

    #[test]
    fn targets_say_met_and_not_met_from_the_figures() {
        let text = sample_run(4);
        assert!(
            text.contains("| cold create+exec+destroy p50 <= bwrap's | Warren 4.00 ms vs bwrap 5.00 ms | **met** |"),
            "{text}"
        );
        assert!(text.contains("| warm claim+exec p50 <= 2 ms | 1.00 ms | **met** |"));
        assert!(text.contains("| exec round trip p50 <= 1 ms | - | not measured |"));
        assert!(
            text.contains("| >= 300 creations/s sustained | 400.0/s | **met** | 2 clients; CPUs 5% busy"),
            "{text}"
        );
        assert!(text.contains("(MemAvailable drop) | 512 KiB | **met** | memory cgroups 256 KiB per sandbox"));
        let slower = sample_run(6);
        assert!(slower.contains("Warren 6.00 ms vs bwrap 5.00 ms | **not met** |"));
    }

    #[test]
    fn tables_carry_ratios_versions_and_failures_without_breaking_rows() {
        let text = sample_run(4);
        assert!(text.contains("| cold p50 | 0.80 |"), "{text}");
        assert!(text.contains("| cold create+exec+destroy p50 while the idle sandboxes are held | 8.00 ms | - |"));
        assert!(text.contains("| - over cold p50 with none held | 2.00x | - |"), "{text}");
        assert!(text.contains("- cold create+exec+destroy while all 10 were held: p50 8.00 ms, p99 8.00 ms (3 cycles"));
        assert!(text.contains("| bwrap | bubblewrap 0.8.0 |"));
        assert!(text.contains("failed: boom / bang"));
        assert!(text.contains("Test CPU, 2 CPUs"));
        for line in text.lines().filter(|l| l.starts_with("| cold create+exec+destroy p50 |")) {
            assert_eq!(line.matches('|').count(), 4, "{line}");
        }
        // Every row of every table has as many cells as its header.
        let mut columns = 0;
        for line in text.lines() {
            if !line.starts_with('|') {
                columns = 0;
                continue;
            }
            let cells = line.matches('|').count();
            if columns == 0 {
                columns = cells;
            }
            assert_eq!(cells, columns, "row does not match its header: {line}");
        }
    }

    #[test]
    fn the_exec_split_names_what_the_exec_path_adds_to_the_floors() {
        use crate::exec_split::{self as split, part_name};
        use crate::results::Part;
        let mut w = Contender::new("Warren", "warren 0.1.0");
        assert_eq!(exec_split_summary(&w), "", "no split measured: nothing said");
        let figures = [
            (split::GET, 1),
            (split::EXEC_TRUE, 5),
            (split::BARE_TRUE, 3),
            (split::EXEC_EXIT0, 2),
            (split::BARE_EXIT0, 1),
            (split::PACED_GET, 2),
            (split::PACED_EXEC, 9),
            (split::PACED_BARE, 4),
        ];
        for (name, ms) in figures {
            w.parts.push(Part { name: part_name(name), latencies: measured(lat_ms(&[ms, ms, ms])), own_cpu: true });
        }
        let text = exec_split_summary(&w);
        assert!(text.contains("API round trip with no exec 1.00 ms, exec `true` 5.00 ms"), "{text}");
        assert!(text.contains("so the exec path itself 1.00 ms;"), "{text}");
        assert!(text.contains("exec `exit0` 2.00 ms, with no sandbox 1.00 ms"), "{text}");
        assert!(text.ends_with("(exec path 3.00 ms)"), "{text}");
    }
}

//! `warren trajectory ...`: show a sandbox's trajectory log, or replay it
//! in a fresh sandbox (the server runs the replay; see the node's
//! `trajectory` module).

use anyhow::Result;
use clap::Subcommand;
use warren_api::*;

use crate::client::Client;
use crate::print;

#[derive(Subcommand)]
pub enum TrajectoryCmd {
    /// What the sandbox was made from and every mutating call, in step
    /// order (also after the sandbox ended, for the server's retention).
    Show { id: String },
    /// Re-run the trajectory in a fresh sandbox from the same image and
    /// report step by step whether each result matches. Exits 0 when every
    /// step matched, 1 otherwise.
    Replay {
        id: String,
        /// Keep the fresh sandbox (its id is in the report).
        #[arg(long)]
        keep: bool,
    },
}

/// Runs the command; returns the process's exit code.
pub async fn run(client: &Client, json: bool, cmd: &TrajectoryCmd) -> Result<i32> {
    match cmd {
        TrajectoryCmd::Show { id } => {
            print(json, &client.trajectory(id).await?, show);
            Ok(0)
        }
        TrajectoryCmd::Replay { id, keep } => {
            let report = client.replay(id, &ReplayRequest { keep: *keep }).await?;
            print(json, &report, replay_lines);
            Ok(if report.matched { 0 } else { 1 })
        }
    }
}

fn wire_name<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_value(v).ok().and_then(|v| v.as_str().map(String::from)).unwrap_or_default()
}

fn show(t: &Trajectory) -> String {
    let o = &t.origin;
    let mut lines = vec![format!(
        "{}: image {}, {} cpus, {} MiB, {} env vars{}",
        t.sandbox_id,
        o.image,
        o.resources.cpus,
        o.resources.memory_mib,
        o.env.len(),
        if t.ended_at_ms.is_some() { ", ended" } else { "" }
    )];
    for s in &t.steps {
        let what = match (s.kind, s.request.get("command").or(s.request.get("argv")).or(s.request.get("path"))) {
            (_, Some(v)) => v.to_string(),
            (_, None) => s.request.to_string(),
        };
        let result = match &s.result {
            Some(r) if r.exec_id.is_some() => format!(
                "{} exit {}",
                r.status.map(|st| wire_name(&st)).unwrap_or_default(),
                r.exit_code.map_or("-".to_string(), |c| c.to_string())
            ),
            Some(_) => "done".to_string(),
            None => wire_name(&s.state),
        };
        lines.push(format!("{:>5}  {:<14} {:<24} {}", s.step, wire_name(&s.kind), result, what));
    }
    lines.join("\n")
}

fn replay_lines(r: &ReplayReport) -> String {
    let mut lines: Vec<String> = r
        .steps
        .iter()
        .map(|s| {
            let why = match (&s.message, s.differences.is_empty()) {
                (Some(m), _) => format!(" ({m})"),
                (None, false) => format!(" ({})", s.differences.join(", ")),
                (None, true) => String::new(),
            };
            format!("{:>5}  {:<14} {}{why}", s.step, wire_name(&s.kind), wire_name(&s.outcome))
        })
        .collect();
    let verdict = if r.matched { "every step matched" } else { "some steps did not match" };
    lines.push(format!("replayed {} in {}: {verdict}", r.source_id, r.sandbox_id));
    lines.join("\n")
}

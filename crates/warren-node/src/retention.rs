//! How much finished execs' captured output a sandbox keeps on the node:
//! the newest outputs up to [`crate::NodeConfig::exec_output_retention_bytes`],
//! the oldest dropped beyond it (their results stay, marked
//! `output_expired`). Each exec's capture is capped, but not how many execs
//! a sandbox runs: without this bound an agent printing a megabyte per
//! command fills the node's data disk (the exec record in the state store
//! and the trajectory's data file both hold the output), whatever its
//! sandbox's `disk_mib`.
//!
//! The ledger lives with the running sandbox; after a restart it is
//! rebuilt from the store at the sandbox's first finished exec. An exec
//! that ends after its sandbox did is stored as before (one more output).

use std::collections::VecDeque;

use warren_api::{ExecOutput, ExecResult, ExecStatus};
use warren_store::{StateStoreExt, Table, Write};

use crate::{Node, Result};

/// One kept output, oldest first in [`OutputLedger::kept`].
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct KeptOutput {
    pub exec_id: String,
    /// Outputs are dropped in the order their execs started.
    pub started_at_ms: u64,
    /// Its trajectory step, if it has one.
    pub step: Option<u64>,
    /// The trajectory's data file holding the output (`sha256:<hex>`), if any.
    pub data_file: Option<String>,
    pub bytes: u64,
}

/// A sandbox's kept outputs and their sum.
#[derive(Debug, Default)]
pub(crate) struct OutputLedger {
    loaded: bool,
    total: u64,
    kept: VecDeque<KeptOutput>,
}

impl OutputLedger {
    /// Adds `output` and returns what must be dropped, oldest first, for
    /// the total to fit `budget`. The newest exec's output is never dropped,
    /// so a client can still fetch the exec it just ran, however large.
    /// Execs end (and are added) in any order; they are dropped in the
    /// order they started, so that which outputs stay does not depend on
    /// which exec's record happened to be written first.
    fn keep(&mut self, output: KeptOutput, budget: u64) -> Vec<KeptOutput> {
        self.total += output.bytes;
        let at = self.kept.partition_point(|k| start_order(k) <= start_order(&output));
        self.kept.insert(at, output);
        let mut dropped = Vec::new();
        while self.total > budget && self.kept.len() > 1 {
            if let Some(oldest) = self.kept.pop_front() {
                self.total -= oldest.bytes;
                dropped.push(oldest);
            }
        }
        dropped
    }

    fn holds_data_file(&self, name: &str) -> bool {
        self.kept.iter().any(|k| k.data_file.as_deref() == Some(name))
    }
}

/// The order outputs are dropped in: by when their execs started.
fn start_order(k: &KeptOutput) -> (u64, &str) {
    (k.started_at_ms, &k.exec_id)
}

/// The bytes of output a result keeps (what the process wrote less what the
/// capture cap dropped, both streams).
pub(crate) fn kept_bytes(output: &ExecOutput) -> u64 {
    [&output.stdout, &output.stderr].iter().map(|s| s.total_bytes.saturating_sub(s.dropped_bytes)).sum()
}

impl Node {
    /// Commits an ended exec's `writes` (its final record, its step), then
    /// drops the oldest outputs the sandbox keeps past the budget (a second
    /// commit, only when there are some; it may be this exec's own, if a
    /// later-started exec ended first). `output` describes the exec's own.
    pub(crate) fn commit_exec_end(&self, sandbox: &str, writes: &[Write], output: KeptOutput) -> Result<()> {
        let live = self.live_map().get(sandbox).cloned();
        let Some(live) = live.filter(|_| output.bytes > 0) else {
            return Ok(self.store().apply(writes)?);
        };
        // Held across both commits: two execs ending at once must not each
        // drop an output the other's commit writes back.
        let mut ledger = live.outputs.lock().unwrap_or_else(|p| p.into_inner());
        if !ledger.loaded {
            match self.load_ledger(sandbox, &output.exec_id) {
                Ok(loaded) => *ledger = loaded,
                Err(e) => {
                    // The exec's own record comes first; the budget waits
                    // for the next exec's end.
                    tracing::warn!(sandbox, "cannot read the outputs the sandbox keeps: {e}");
                    return Ok(self.store().apply(writes)?);
                }
            }
        }
        self.store().apply(writes)?;
        let dropped = ledger.keep(output, self.inner.cfg.exec_output_retention_bytes);
        if dropped.is_empty() {
            return Ok(());
        }
        let mut expiring = Vec::new();
        let mut files = Vec::new();
        for old in &dropped {
            expiring.extend(self.expire_output(sandbox, old)?);
            if let Some(name) = old.data_file.as_deref().filter(|n| !ledger.holds_data_file(n)) {
                files.push(name.to_string());
            }
        }
        self.store().apply(&expiring)?;
        for name in files {
            self.remove_trajectory_data_file(sandbox, &name);
        }
        Ok(())
    }

    /// The writes that drop one kept output: from the exec's record and
    /// from its step.
    fn expire_output(&self, sandbox: &str, old: &KeptOutput) -> Result<Vec<Write>> {
        let mut writes = Vec::new();
        let key = format!("{sandbox}/{}", old.exec_id);
        if let Some(mut r) = self.store().get_json::<ExecResult>(Table::Execs, &key)? {
            r.output = None;
            r.output_expired = true;
            writes.push(Write::json(Table::Execs, key, &r)?);
        }
        if let Some(step) = old.step {
            writes.extend(self.expire_step_output(sandbox, step)?);
        }
        Ok(writes)
    }

    /// What a sandbox keeps now, from the store: its exec records with
    /// output, in the order they started, with their steps and data files.
    /// `skip` (the exec being added) is left out.
    fn load_ledger(&self, sandbox: &str, skip: &str) -> Result<OutputLedger> {
        let steps = self.exec_steps(sandbox)?;
        let mut found: Vec<KeptOutput> = Vec::new();
        for (_, r) in self.store().list_json::<ExecResult>(Table::Execs, &format!("{sandbox}/"))? {
            // A running exec's record comes back through here when it ends.
            if r.exec_id == skip || r.status == ExecStatus::Running {
                continue;
            }
            let bytes = r.output.as_ref().map_or(0, kept_bytes);
            if bytes == 0 {
                continue;
            }
            let (step, data_file) = match steps.get(&r.exec_id) {
                Some(s) => (Some(s.step), s.data_file.clone()),
                None => (None, None),
            };
            let started_at_ms = r.started_at_ms;
            found.push(KeptOutput { exec_id: r.exec_id.clone(), started_at_ms, step, data_file, bytes });
        }
        found.sort_by(|a, b| start_order(a).cmp(&start_order(b)));
        let kept: VecDeque<KeptOutput> = found.into();
        Ok(OutputLedger { loaded: true, total: kept.iter().map(|k| k.bytes).sum(), kept })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Execs are named by when they started: "a" before "b".
    fn out(id: &str, bytes: u64, file: Option<&str>) -> KeptOutput {
        let started_at_ms = u64::from(id.as_bytes()[0]);
        KeptOutput { exec_id: id.into(), started_at_ms, step: None, data_file: file.map(Into::into), bytes }
    }

    #[test]
    fn outputs_go_in_the_order_their_execs_started_whatever_order_they_ended() {
        let mut ledger = OutputLedger::default();
        let mut dropped: Vec<String> = Vec::new();
        // a started first and ended last: its own output goes at once.
        for id in ["b", "c", "d", "a"] {
            dropped.extend(ledger.keep(out(id, 40, None), 100).into_iter().map(|k| k.exec_id));
        }
        assert_eq!(dropped, ["b", "a"]);
        let kept: Vec<&str> = ledger.kept.iter().map(|k| k.exec_id.as_str()).collect();
        assert_eq!(kept, ["c", "d"]);
    }

    #[test]
    fn the_oldest_outputs_go_first_and_the_newest_always_stays() {
        let mut ledger = OutputLedger::default();
        assert!(ledger.keep(out("a", 40, None), 100).is_empty());
        assert!(ledger.keep(out("b", 40, None), 100).is_empty());
        let dropped: Vec<String> = ledger.keep(out("c", 40, None), 100).into_iter().map(|k| k.exec_id).collect();
        assert_eq!(dropped, ["a"]);
        assert_eq!(ledger.total, 80);
        // One output larger than the budget drops every older one and stays.
        let dropped: Vec<String> = ledger.keep(out("d", 500, None), 100).into_iter().map(|k| k.exec_id).collect();
        assert_eq!(dropped, ["b", "c"]);
        assert_eq!((ledger.total, ledger.kept.len()), (500, 1));
        // The next one, however small, drops it.
        let dropped: Vec<String> = ledger.keep(out("e", 1, None), 100).into_iter().map(|k| k.exec_id).collect();
        assert_eq!(dropped, ["d"]);
        assert_eq!(ledger.total, 1);
    }

    #[test]
    fn a_data_file_another_kept_output_shares_is_still_held() {
        let mut ledger = OutputLedger::default();
        ledger.keep(out("a", 10, Some("sha256:x")), 100);
        ledger.keep(out("b", 10, Some("sha256:x")), 100);
        let dropped = ledger.keep(out("c", 90, None), 100);
        assert_eq!(dropped.len(), 1);
        assert!(ledger.holds_data_file("sha256:x"), "b still refers to it");
        ledger.keep(out("d", 90, None), 100);
        assert!(!ledger.holds_data_file("sha256:x"));
    }

    #[test]
    fn kept_bytes_counts_both_streams_less_what_the_cap_dropped() {
        let mut output = ExecOutput { stdout: Default::default(), stderr: Default::default() };
        output.stdout.total_bytes = 3 << 20;
        output.stdout.dropped_bytes = 2 << 20;
        output.stderr.total_bytes = 10;
        assert_eq!(kept_bytes(&output), (1 << 20) + 10);
    }
}

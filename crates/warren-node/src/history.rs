//! A sandbox's execs, oldest first and without their output: the record
//! of what ran in it, kept as long as the sandbox's record is.

use warren_api::ExecResult;
use warren_store::Table;

use crate::{Node, Result};

impl Node {
    /// Every exec of sandbox `id` (running ones included), by start time.
    pub fn list_execs(&self, id: &str) -> Result<Vec<ExecResult>> {
        // Answers NotFound for a sandbox that never existed or was forgotten.
        self.get(id)?;
        let mut execs: Vec<ExecResult> = Vec::new();
        for (_, bytes) in self.store().list(Table::Execs, &format!("{id}/"))? {
            if let Ok(r) = serde_json::from_slice::<ExecResult>(&bytes) {
                execs.push(r);
            }
        }
        if let Some(live) = self.live_map().get(id).cloned() {
            let running: Vec<_> = live.execs.lock().unwrap_or_else(|p| p.into_inner()).values().cloned().collect();
            for entry in running {
                let now = entry.result(false);
                match execs.iter_mut().find(|e| e.exec_id == now.exec_id) {
                    Some(stored) => *stored = now,
                    None => execs.push(now),
                }
            }
        }
        for e in &mut execs {
            e.output = None;
        }
        execs.sort_by(|a, b| a.started_at_ms.cmp(&b.started_at_ms).then_with(|| a.exec_id.cmp(&b.exec_id)));
        Ok(execs)
    }
}

//! Steering what already runs: writing to an exec's open stdin, closing it,
//! and moving a sandbox's lifetime (E2B's `set_timeout`).

use bytes::Bytes;
use warren_api::{ApiError, SandboxInfo, MAX_TIMEOUT_SECS};

use crate::{joined, now_ms, Node, NodeError, Result, StdinError};

impl Node {
    fn running_exec(&self, id: &str, exec_id: &str) -> Result<std::sync::Arc<crate::ExecEntry>> {
        match self.exec_entry(id, exec_id) {
            Some(e) => Ok(e),
            // Ended execs leave memory: known but finished means stdin is gone.
            None => match self.stored_exec(id, exec_id) {
                Ok(_) => Err(stdin_closed()),
                Err(e) => {
                    self.live(id)?;
                    Err(e)
                }
            },
        }
    }

    /// An exec's status, without copying its output.
    pub fn exec_status(&self, id: &str, exec_id: &str) -> Result<warren_api::ExecStatus> {
        match self.exec_entry(id, exec_id) {
            Some(e) => Ok(e.result(false).status),
            None => Ok(self.stored_exec(id, exec_id)?.status),
        }
    }

    /// Writes `data` to the stdin of an exec started with `stdin_open`.
    pub async fn send_stdin(&self, id: &str, exec_id: &str, data: Bytes) -> Result<()> {
        let entry = self.running_exec(id, exec_id)?;
        entry.send_stdin(data).await.map_err(|StdinError::Closed| stdin_closed())
    }

    /// Closes the stdin of an exec started with `stdin_open`.
    pub async fn close_stdin(&self, id: &str, exec_id: &str) -> Result<()> {
        let entry = self.running_exec(id, exec_id)?;
        entry.close_stdin().await.map_err(|StdinError::Closed| stdin_closed())
    }

    /// Makes a live sandbox end `remaining_secs` from now (its lifetime is
    /// counted from its creation, so it becomes age + `remaining_secs`).
    pub async fn set_remaining_lifetime(&self, id: &str, remaining_secs: u64) -> Result<SandboxInfo> {
        if remaining_secs == 0 || remaining_secs > MAX_TIMEOUT_SECS {
            return Err(NodeError::Invalid(ApiError::invalid(
                "lifetime_secs",
                format!("must be between 1 and {MAX_TIMEOUT_SECS}"),
            )));
        }
        // A paused sandbox stays paused: only its end moves.
        let live = self.live_as_is(id)?;
        let rec = {
            let mut rec = live.record();
            let age_secs = now_ms().saturating_sub(rec.info.created_at_ms).div_ceil(1000);
            rec.info.lifetime_secs = age_secs + remaining_secs;
            rec.clone()
        };
        joined(self.commit(rec.clone()).await)?;
        Ok(rec.info)
    }
}

fn stdin_closed() -> NodeError {
    NodeError::Invalid(ApiError::invalid("stdin", "the exec's stdin is closed (or it was started without one)"))
}

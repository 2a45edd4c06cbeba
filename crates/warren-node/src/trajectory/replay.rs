//! Replay: a logged trajectory re-run step by step in a fresh sandbox made
//! from the same origin, with a verdict per step.

use std::collections::HashMap;

use bytes::Bytes;
use warren_api::{
    CreateSandboxRequest, CreateSessionRequest, ExecRequest, NetworkPolicy, ReplayOutcome, ReplayReport, ReplayRequest,
    ReplayStep, SetPhaseRequest, StepKind, StepResult, StepState, TrajectoryOrigin, TrajectoryStep,
};

use super::{exec_step_result, from_json, ExecAnswer};
use crate::{Node, NodeError, Result};

impl Node {
    /// Re-runs sandbox `id`'s trajectory, step by step, in a fresh sandbox
    /// made from the same origin, and says for each step whether the result
    /// matches. The fresh sandbox logs its own trajectory.
    pub async fn replay_trajectory(&self, id: &str, req: ReplayRequest) -> Result<ReplayReport> {
        let trajectory = self.trajectory(id)?;
        let (info, _) = self.create(create_request(&trajectory.origin)?).await?;
        let fresh = info.id.clone();
        let mut sessions = HashMap::new();
        let mut steps = Vec::new();
        for logged in &trajectory.steps {
            let replayed = self.replay_step(id, &fresh, logged, &mut sessions).await;
            steps.push(replayed);
        }
        if !req.keep {
            self.delete(&fresh).await?;
        }
        let matched = steps.iter().all(|s| s.outcome == ReplayOutcome::Match);
        Ok(ReplayReport { source_id: id.to_string(), sandbox_id: fresh, steps, matched })
    }

    async fn replay_step(
        &self,
        source: &str,
        fresh: &str,
        logged: &TrajectoryStep,
        sessions: &mut HashMap<String, String>,
    ) -> ReplayStep {
        let mut out = ReplayStep {
            step: logged.step,
            kind: logged.kind,
            outcome: ReplayOutcome::Match,
            differences: Vec::new(),
            message: None,
            result: None,
        };
        if logged.state != StepState::Done {
            out.outcome = ReplayOutcome::Skipped;
            out.message = Some("the step had not finished when it was logged".into());
            return out;
        }
        match self.replay_call(source, fresh, logged, sessions).await {
            Ok(None) => {
                out.outcome = ReplayOutcome::Skipped;
                out.message = Some(
                    "the upload's bytes were not kept (larger than 64 MiB, or past the sandbox's upload budget)".into(),
                );
            }
            Ok(Some(result)) => {
                out.differences = differences(logged.result.as_ref(), &result);
                if !out.differences.is_empty() {
                    out.outcome = ReplayOutcome::Mismatch;
                }
                out.result = Some(result);
            }
            Err(e) => {
                out.outcome = ReplayOutcome::Failed;
                out.message = Some(e.to_string());
            }
        }
        out
    }

    /// Runs one logged call again in `fresh`; `None` when it cannot be.
    async fn replay_call(
        &self,
        source: &str,
        fresh: &str,
        logged: &TrajectoryStep,
        sessions: &mut HashMap<String, String>,
    ) -> Result<Option<StepResult>> {
        let request = logged.request.clone();
        let answered = |v: serde_json::Value| StepResult { response: Some(v), ..Default::default() };
        Ok(Some(match logged.kind {
            StepKind::Exec | StepKind::SessionExec => {
                let mut request = request;
                let session = match request.as_object_mut().and_then(|o| o.remove("session_id")) {
                    Some(serde_json::Value::String(old)) => Some(
                        sessions
                            .get(&old)
                            .cloned()
                            .ok_or_else(|| NodeError::SessionNotFound(format!("{old} (not created in the replay)")))?,
                    ),
                    _ => None,
                };
                let req: ExecRequest = from_json(request, "exec request")?;
                let answer = self.exec_stepped(fresh, req, session.as_deref(), None).await?.value;
                let result = match answer {
                    ExecAnswer::Logged(r) => *r,
                    ExecAnswer::Live(entry) => {
                        entry.ended().await;
                        entry.result(true)
                    }
                };
                exec_step_result(&result)
            }
            StepKind::SessionCreate => {
                let req: CreateSessionRequest = from_json(request, "session request")?;
                let made = self.create_session_stepped(fresh, req, None).await?.value;
                let old = logged.result.as_ref().and_then(|r| r.response.as_ref()).and_then(|v| v.get("id"));
                if let Some(serde_json::Value::String(old)) = old {
                    sessions.insert(old.clone(), made.id.clone());
                }
                answered(serde_json::json!({ "created": true }))
            }
            StepKind::FileWrite => {
                let path: String = from_json(request["path"].clone(), "upload path")?;
                let mode: u32 = from_json(request["mode"].clone(), "upload mode")?;
                let sha: String = from_json(request["sha256"].clone(), "upload digest")?;
                let digest = sha.trim_start_matches("sha256:");
                let kept = self.trajectory_dir(source).join(digest);
                let Ok(bytes) = std::fs::read(&kept) else { return Ok(None) };
                let body = futures_util::stream::iter([Ok::<_, std::convert::Infallible>(Bytes::from(bytes))]);
                let stat = self.write_file_stepped(fresh, path, mode, body, None).await?.value;
                answered(serde_json::json!({ "size_bytes": stat.size_bytes }))
            }
            StepKind::FileRemove => {
                let path: String = from_json(request["path"].clone(), "remove path")?;
                let recursive = request["recursive"].as_bool().unwrap_or(false);
                self.remove_file_stepped(fresh, path, recursive, None).await?;
                answered(serde_json::Value::Null)
            }
            StepKind::Mkdir => {
                let path: String = from_json(request["path"].clone(), "mkdir path")?;
                let mode = request["mode"].as_u64().and_then(|m| u32::try_from(m).ok()).unwrap_or(0o755);
                let parents = request["parents"].as_bool().unwrap_or(false);
                self.mkdir_stepped(fresh, path, mode, parents, None).await?;
                answered(serde_json::Value::Null)
            }
            StepKind::Phase => {
                let req: SetPhaseRequest = from_json(request, "phase request")?;
                let info = self.set_phase_stepped(fresh, req, None).await?.value;
                answered(serde_json::json!({ "phase": info.phase }))
            }
            StepKind::Network => {
                let policy: NetworkPolicy = from_json(request, "network policy")?;
                self.set_network_stepped(fresh, policy, None).await?;
                answered(serde_json::Value::Null)
            }
        }))
    }
}

/// What differs between a logged step's result and its replay: for execs
/// status, exit code, signal and the output digests; for other calls only
/// that they succeeded (a failure is `failed`, not a difference).
fn differences(logged: Option<&StepResult>, replayed: &StepResult) -> Vec<String> {
    let Some(logged) = logged else { return Vec::new() };
    if logged.exec_id.is_none() {
        return Vec::new();
    }
    let mut out = Vec::new();
    if logged.status != replayed.status {
        out.push("status".to_string());
    }
    if logged.exit_code != replayed.exit_code {
        out.push("exit_code".to_string());
    }
    if logged.signal != replayed.signal {
        out.push("signal".to_string());
    }
    if logged.stdout_sha256 != replayed.stdout_sha256 {
        out.push("stdout_sha256".to_string());
    }
    if logged.stderr_sha256 != replayed.stderr_sha256 {
        out.push("stderr_sha256".to_string());
    }
    out
}

/// A create request for a sandbox like the one `origin` describes.
fn create_request(origin: &TrajectoryOrigin) -> Result<CreateSandboxRequest> {
    let r = &origin.resources;
    let request = serde_json::json!({
        "backend": origin.backend,
        "image": origin.image,
        "cpus": r.cpus,
        "memory_mib": r.memory_mib,
        "disk_mib": r.disk_mib,
        "pids": r.pids,
        // 0: a record older than the field, made with the default.
        "inodes": (r.inodes > 0).then_some(r.inodes),
        "open_files": (r.open_files > 0).then_some(r.open_files),
        "env": origin.env,
        "labels": origin.labels,
        "network": origin.network,
        "network_policy": origin.network_policy,
        "phases": origin.phases,
        "phase": origin.phase,
        "project": origin.project,
    });
    from_json(request, "origin")
}

#[cfg(test)]
mod tests {
    use warren_api::ExecStatus;

    use super::*;

    #[test]
    fn exec_differences_name_the_fields() {
        let logged = StepResult {
            exec_id: Some("ex-1".into()),
            status: Some(ExecStatus::Ok),
            exit_code: Some(0),
            stdout_sha256: Some("sha256:aa".into()),
            ..Default::default()
        };
        let mut replayed = logged.clone();
        assert!(differences(Some(&logged), &replayed).is_empty());
        replayed.exit_code = Some(1);
        replayed.stdout_sha256 = Some("sha256:bb".into());
        assert_eq!(differences(Some(&logged), &replayed), ["exit_code", "stdout_sha256"]);
    }
}

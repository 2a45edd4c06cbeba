//! Phase switches: `PUT /v1/sandboxes/{id}/phase`.
//!
//! The node checks the name against the phases the sandbox was created
//! with, has the driver make it current (inside the sandbox, init starts
//! the new phase's Landlock leader and, with `kill_running`, kills every
//! process of earlier phases), records the new phase in the sandbox's
//! record (so a restarted node re-adopts the sandbox in it), adds a
//! `phase_changed` event to its timeline, has the tamper watch mark the
//! phase's protected paths (see `tamper`), and then enforces the phase's
//! egress policy (see `network`).

use std::collections::BTreeMap;

use warren_api::{AccessLevel, ApiError, PhaseSpec, SandboxInfo, SecurityEventKind, SetPhaseRequest};
use warren_backend::{BackendError, PathAccess, PhaseRules};

use crate::events::Observed;
use crate::{joined, Node, NodeError, Result};

/// What init needs of phase `name` (nothing protected without a phase).
pub(crate) fn rules(phases: &BTreeMap<String, PhaseSpec>, name: Option<&str>) -> PhaseRules {
    let Some((name, spec)) = name.and_then(|n| phases.get_key_value(n)) else { return PhaseRules::default() };
    PhaseRules {
        name: name.clone(),
        protected_paths: spec.protected_paths.iter().map(|(path, level)| (path.clone(), access(*level))).collect(),
    }
}

/// A phase whose rules cannot be enforced is the request's fault (its
/// protected paths against this image); anything else is the backend's.
pub(crate) fn backend_error(e: BackendError, phase: &str) -> NodeError {
    match e {
        BackendError::PhaseRejected(message) => {
            NodeError::Invalid(ApiError::invalid(format!("phases.{phase}.protected_paths"), message))
        }
        other => NodeError::Backend(other),
    }
}

fn access(level: AccessLevel) -> PathAccess {
    match level {
        AccessLevel::None => PathAccess::None,
        AccessLevel::Read => PathAccess::Read,
        AccessLevel::ReadWrite => PathAccess::ReadWrite,
    }
}

impl Node {
    /// Makes phase `req.name` current in sandbox `id`.
    pub async fn set_phase(&self, id: &str, req: SetPhaseRequest) -> Result<SandboxInfo> {
        let live = self.live(id)?;
        live.touch();
        // One switch at a time per sandbox, so the record and the event
        // timeline follow the order in which init made the phases current.
        let _switching = live.phase_switch.lock().await;
        let (rules, previous) = {
            let rec = live.record();
            if !rec.info.phases.contains_key(&req.name) {
                let known: Vec<&str> = rec.info.phases.keys().map(String::as_str).collect();
                let message = match known.is_empty() {
                    true => "this sandbox was created without phases".to_string(),
                    false => format!("no phase `{}`; the sandbox has {}", req.name, known.join(", ")),
                };
                return Err(NodeError::Invalid(ApiError::invalid("name", message)));
            }
            (rules(&rec.info.phases, Some(&req.name)), rec.info.phase.clone())
        };
        let killed = live
            .driver
            .set_phase(&live.handle, rules, req.kill_running)
            .await
            .map_err(|e| backend_error(e, &req.name))?;
        let (rec, policy) = {
            let mut rec = live.record();
            rec.info.phase = Some(req.name.clone());
            let phase_network = rec.info.phases.get(&req.name).and_then(|p| p.network.clone());
            (rec.clone(), phase_network.or_else(|| rec.info.network_policy.clone()).unwrap_or_default())
        };
        joined(self.commit(rec.clone()).await)?;
        // Processes of earlier phases keep their looser Landlock domains:
        // the tamper watch holds them to this phase's protected paths.
        self.watch_protected_paths(id).await;
        let detail = format!(
            "{} -> {}; {}",
            previous.as_deref().unwrap_or("(none)"),
            req.name,
            match req.kill_running {
                true => format!("killed {killed} processes of earlier phases"),
                false => "processes of earlier phases keep running with their rights".to_string(),
            }
        );
        self.record_event(id, Observed::new(SecurityEventKind::PhaseChanged, detail));
        // The phase's egress policy (or the sandbox's own, for a phase
        // without one), after the earlier phases' processes are gone: they
        // never see a looser policy. A no-op outside `allowlist` mode.
        self.enforce_network_policy(id, &policy).await?;
        let mut info = rec.info;
        info.usage = live.driver.usage(&live.handle).ok();
        Ok(info)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_carry_the_named_phase_and_nothing_without_one() {
        let phases: BTreeMap<String, PhaseSpec> =
            serde_json::from_str(r#"{"rollout": {"protected_paths": {"/answers": "none", "/work": "read_write"}}}"#)
                .unwrap();
        let r = rules(&phases, Some("rollout"));
        assert_eq!(r.name, "rollout");
        assert_eq!(r.protected_paths["/answers"], PathAccess::None);
        assert_eq!(r.protected_paths["/work"], PathAccess::ReadWrite);
        assert_eq!(rules(&phases, None), PhaseRules::default());
        assert_eq!(rules(&phases, Some("other")), PhaseRules::default());
    }
}

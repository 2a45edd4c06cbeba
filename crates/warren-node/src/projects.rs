//! Each sandbox's project, as IAM in front of the node needs it: the node
//! records the project a create names and reports it; it never judges who
//! may act on what (that is `warren-iam`'s, called by the API layer).

use serde::Deserialize;
use warren_api::{TrajectoryOrigin, ROOT_PROJECT};
use warren_store::{StateStoreExt, Table};

use crate::records::SandboxRecord;
use crate::{Node, NodeError, Result};

/// A live sandbox as quotas count it.
#[derive(Debug, Clone, PartialEq)]
pub struct LiveProject {
    pub project: String,
    pub cpus: f64,
    pub memory_mib: u64,
}

impl Node {
    /// The project and size of every live sandbox, paused ones included
    /// (a paused sandbox keeps its quota, as it keeps its node slot).
    pub fn live_projects(&self) -> Vec<LiveProject> {
        let lives: Vec<_> = self.live_map().values().cloned().collect();
        lives
            .iter()
            .map(|live| {
                let rec = live.record();
                LiveProject {
                    project: rec.info.project.clone(),
                    cpus: rec.info.resources.cpus,
                    memory_mib: rec.info.resources.memory_mib,
                }
            })
            .collect()
    }

    /// The project of sandbox `id`, live or ended: from its record while
    /// that is kept, then from its trajectory's origin (kept longer, and
    /// still readable and replayable); without reading its usage, unlike
    /// [`Node::get`].
    pub fn project_of(&self, id: &str) -> Result<String> {
        if let Some(live) = self.live_map().get(id).cloned() {
            return Ok(live.record().info.project.clone());
        }
        if let Some(rec) = self.store().get_json::<SandboxRecord>(Table::Sandboxes, id)? {
            return Ok(rec.info.project);
        }
        match self.store().get_json::<TrajectoryRow>(Table::Trajectories, id)? {
            Some(row) => Ok(row.origin.project.unwrap_or_else(|| ROOT_PROJECT.to_string())),
            None => Err(NodeError::NotFound(id.to_string())),
        }
    }
}

impl Node {
    /// Whether a create with idempotency key `key` was made (or is being
    /// made): a retry of it makes nothing new, so it needs no quota.
    pub fn idempotency_claimed(&self, key: &str) -> Result<bool> {
        Ok(self.store().get(Table::Idempotency, key)?.is_some())
    }
}

/// The part of a [`Table::Trajectories`] row this module reads.
#[derive(Deserialize)]
struct TrajectoryRow {
    origin: TrajectoryOrigin,
}

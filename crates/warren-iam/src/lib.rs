//! Identity and quotas: who a request is, what it may touch, and how much it
//! may hold.
//!
//! Owns: projects (nested; the root project exists from the start), API
//! keys (a random secret shown once, stored only as its SHA-256), the
//! authorisation rule (a key acts on its own project and every project
//! below it), quota delegation, and the quota gate every create passes
//! (concurrent sandboxes, cpus, memory, creations per second). Everything
//! durable goes through [`warren_store::StateStore`], so the same code runs
//! on redb (embedded) and etcd (cluster).
//!
//! Invariants: a project's quota never exceeds what its parent has left to
//! give (the sum of a parent's children's quotas stays within its own), and
//! a sandbox counts against its project and every project above it, so no
//! project's subtree ever holds more than its quota; a secret is never
//! stored or logged.
//!
//! Never: knows HTTP, nodes or sandboxes beyond their project and size (the
//! caller reports what runs through [`UsageSource`]), or reveals whether a
//! project or key it hides from the caller exists.

mod delegation;
mod error;
mod gate;
pub mod quota;
mod secret;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use warren_api::{
    ApiKeyCreated, ApiKeyInfo, CreateKeyRequest, CreateProjectRequest, ProjectInfo, Quota, QuotaKind, ROOT_PROJECT,
};
use warren_store::{StateStore, StateStoreExt, Table};

pub use error::IamError;
pub use gate::{Admitted, UsageSource};
pub use quota::{Demand, QuotaRefusal, SandboxUsage};

/// Default bound of the line of creates waiting for quota.
pub const DEFAULT_QUEUE_LIMIT: usize = warren_api::DEFAULT_ADMISSION_QUEUE_LIMIT;

/// A project as stored in [`Table::Projects`]. Its parent and path never
/// change, so any copy of them stays true.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProjectRecord {
    pub id: String,
    pub name: String,
    pub parent: Option<String>,
    /// Root first, this project last.
    pub path: Vec<String>,
    pub quota: Quota,
    pub created_at_ms: u64,
}

/// An API key as stored in [`Table::ApiKeys`].
#[derive(Debug, Clone, Serialize, Deserialize)]
struct KeyRecord {
    id: String,
    project: String,
    name: Option<String>,
    secret_sha256: String,
    created_at_ms: u64,
}

impl KeyRecord {
    fn info(&self) -> ApiKeyInfo {
        ApiKeyInfo {
            id: self.id.clone(),
            project: self.project.clone(),
            name: self.name.clone(),
            created_at_ms: self.created_at_ms,
        }
    }
}

/// Who a request acts as: a key's project, or the root project when auth is
/// off and no key was sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub project: String,
    /// `None` when no key was sent (auth off).
    pub key_id: Option<String>,
}

impl Caller {
    pub fn root() -> Caller {
        Caller { project: ROOT_PROJECT.to_string(), key_id: None }
    }

    /// Whether the caller may act on the project with `path`: its own
    /// project or one below it.
    pub fn may_act_on(&self, path: &[String]) -> bool {
        path.contains(&self.project)
    }
}

/// The IAM service; cheap to clone.
#[derive(Clone)]
pub struct Iam {
    inner: Arc<Inner>,
}

struct Inner {
    store: Arc<dyn StateStore>,
    /// Every project seen so far; parents and paths never change, so the
    /// cache is only ever missing entries (read through on a miss).
    projects: RwLock<HashMap<String, ProjectRecord>>,
    /// Serialises project creation here: sibling names and the children's
    /// quota sum are checked, then written.
    creating: Mutex<()>,
    gate: gate::Gate,
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

impl Iam {
    /// Opens IAM on `store`, making the root project on first use.
    pub fn open(store: Arc<dyn StateStore>) -> Result<Iam, IamError> {
        Iam::open_with(store, DEFAULT_QUEUE_LIMIT)
    }

    /// [`Iam::open`] with at most `queue_limit` creates waiting for quota.
    pub fn open_with(store: Arc<dyn StateStore>, queue_limit: usize) -> Result<Iam, IamError> {
        let root = ProjectRecord {
            id: ROOT_PROJECT.to_string(),
            name: ROOT_PROJECT.to_string(),
            parent: None,
            path: vec![ROOT_PROJECT.to_string()],
            quota: Quota::default(),
            created_at_ms: now_ms(),
        };
        store.put_json_if_absent(Table::Projects, ROOT_PROJECT, &root)?;
        let iam = Iam {
            inner: Arc::new(Inner {
                store,
                projects: RwLock::new(HashMap::new()),
                creating: Mutex::new(()),
                gate: gate::Gate::new(queue_limit),
            }),
        };
        iam.refresh()?;
        Ok(iam)
    }

    fn store(&self) -> &dyn StateStore {
        self.inner.store.as_ref()
    }

    /// Reads every project from the store (another API server may have made
    /// some) and returns them.
    fn refresh(&self) -> Result<Vec<ProjectRecord>, IamError> {
        let all: Vec<ProjectRecord> =
            self.store().list_json::<ProjectRecord>(Table::Projects, "")?.into_iter().map(|(_, p)| p).collect();
        let mut cache = self.inner.projects.write().unwrap_or_else(|p| p.into_inner());
        for p in &all {
            cache.insert(p.id.clone(), p.clone());
        }
        Ok(all)
    }

    /// The project `id`, whoever asks.
    pub fn project(&self, id: &str) -> Result<ProjectRecord, IamError> {
        if let Some(p) = self.inner.projects.read().unwrap_or_else(|p| p.into_inner()).get(id) {
            return Ok(p.clone());
        }
        let p: ProjectRecord = self.store().get_json(Table::Projects, id)?.ok_or_else(|| IamError::no_project(id))?;
        self.inner.projects.write().unwrap_or_else(|p| p.into_inner()).insert(id.to_string(), p.clone());
        Ok(p)
    }

    /// The path (root first) of project `id`; a project IAM does not know
    /// (a record from before it, or a typo) hangs under the root, so only
    /// root keys see its sandboxes.
    pub fn path_of(&self, id: &str) -> Vec<String> {
        match self.project(id) {
            Ok(p) => p.path,
            Err(_) if id == ROOT_PROJECT => vec![ROOT_PROJECT.to_string()],
            Err(_) => vec![ROOT_PROJECT.to_string(), id.to_string()],
        }
    }

    /// The project `id` if `caller` may act on it; otherwise not found, as
    /// if it did not exist.
    pub fn visible_project(&self, caller: &Caller, id: &str) -> Result<ProjectRecord, IamError> {
        match self.project(id) {
            Ok(p) if caller.may_act_on(&p.path) => Ok(p),
            Ok(_) | Err(IamError::NotFound { .. }) => Err(IamError::no_project(id)),
            Err(e) => Err(e),
        }
    }

    /// Whether `caller` may act on a sandbox of project `project`.
    pub fn may_act_on_project(&self, caller: &Caller, project: &str) -> bool {
        caller.may_act_on(&self.path_of(project))
    }

    /// Whether any project on `id`'s path has a concurrency quota
    /// (sandboxes, cpus or memory): only then can another API server's
    /// create take room this one's needs.
    pub fn has_concurrency_quota(&self, id: &str) -> Result<bool, IamError> {
        Ok(self
            .quota_path(id)?
            .iter()
            .any(|(_, q)| q.sandboxes.is_some() || q.cpus.is_some() || q.memory_mib.is_some()))
    }

    /// The quota of every project on `id`'s path, root first.
    fn quota_path(&self, id: &str) -> Result<gate::QuotaPath, IamError> {
        let project = self.project(id)?;
        project.path.iter().map(|p| Ok((p.clone(), self.project(p)?.quota))).collect()
    }

    // ---- projects ---------------------------------------------------------

    /// Makes a child project of `req.parent` (default: the caller's own
    /// project), with quota out of what the parent has left to give.
    pub fn create_project(&self, caller: &Caller, req: &CreateProjectRequest) -> Result<ProjectRecord, IamError> {
        validate_name(&req.name)?;
        let parent_id = req.parent.clone().unwrap_or_else(|| caller.project.clone());
        let parent = self.visible_project(caller, &parent_id).map_err(|e| match e {
            IamError::NotFound { .. } => IamError::invalid("parent", format!("no project {parent_id}")),
            other => other,
        })?;
        let _one_at_a_time = self.inner.creating.lock().unwrap_or_else(|p| p.into_inner());
        let id = format!("prj-{}", secret::random_hex(8)?);
        let claim = delegation::Claim {
            child: id.clone(),
            name: req.name.clone(),
            quota: req.quota.clone(),
            at_ms: now_ms(),
            void: false,
        };
        // Other servers may be making children of the same parent: the
        // claim orders us among them (see `delegation`).
        let slot = delegation::take_slot(self.store(), &parent.id, &claim)?;
        let refused = |e: IamError| match delegation::void(self.store(), &parent.id, slot, &claim) {
            Ok(()) => e,
            Err(void_failed) => void_failed,
        };
        let all = self.refresh().map_err(refused)?;
        let children: Vec<&ProjectRecord> = all.iter().filter(|p| p.parent.as_deref() == Some(&parent.id)).collect();
        let before = delegation::before(self.store(), &parent.id, slot, &children, now_ms()).map_err(refused)?;
        if before.iter().any(|(name, _)| *name == req.name) {
            return Err(refused(IamError::invalid(
                "name",
                format!("project {} already has a child named {}", parent.id, req.name),
            )));
        }
        let mut delegated = Quota::default();
        for (_, q) in &before {
            quota::add_quota(&mut delegated, q);
        }
        quota::check_delegation(&parent.quota, &delegated, &req.quota)
            .map_err(|(kind, message)| refused(IamError::invalid(format!("quota.{}", kind.as_str()), message)))?;
        let mut path = parent.path.clone();
        path.push(id.clone());
        let record = ProjectRecord {
            id: id.clone(),
            name: req.name.clone(),
            parent: Some(parent.id.clone()),
            path,
            quota: req.quota.clone(),
            created_at_ms: now_ms(),
        };
        if self.store().put_json_if_absent(Table::Projects, &id, &record)?.is_some() {
            return Err(refused(IamError::Internal(format!("project id {id} was taken; retry"))));
        }
        self.inner.projects.write().unwrap_or_else(|p| p.into_inner()).insert(id, record.clone());
        tracing::info!(project = %record.id, parent = %parent.id, name = %record.name, "project created");
        Ok(record)
    }

    /// The caller's project and every project below it, by path.
    pub fn list_projects(&self, caller: &Caller) -> Result<Vec<ProjectRecord>, IamError> {
        let mut mine: Vec<ProjectRecord> = self.refresh()?.into_iter().filter(|p| caller.may_act_on(&p.path)).collect();
        mine.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(mine)
    }

    /// `record` as the API shows it: with the quota given to its children
    /// and what its subtree holds among `live`.
    pub fn project_info(&self, record: &ProjectRecord, live: &[SandboxUsage]) -> ProjectInfo {
        let mut delegated = Quota::default();
        for child in self
            .inner
            .projects
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .filter(|p| p.parent.as_deref() == Some(&record.id))
        {
            quota::add_quota(&mut delegated, &child.quota);
        }
        let mut usage = warren_api::QuotaUse::default();
        for s in live {
            if self.path_of(&s.project).contains(&record.id) {
                quota::add_use(&mut usage, 1, s.cpus, s.memory_mib);
            }
        }
        ProjectInfo {
            id: record.id.clone(),
            name: record.name.clone(),
            parent: record.parent.clone(),
            path: record.path.clone(),
            quota: record.quota.clone(),
            delegated,
            usage,
            created_at_ms: record.created_at_ms,
        }
    }

    // ---- keys -------------------------------------------------------------

    /// Makes a key of project `project` (which the caller may act on); the
    /// answer carries the secret, which is not kept.
    pub fn create_key(
        &self,
        caller: &Caller,
        project: &str,
        req: &CreateKeyRequest,
    ) -> Result<ApiKeyCreated, IamError> {
        if let Some(name) = &req.name {
            if name.len() > 128 {
                return Err(IamError::invalid("name", "at most 128 characters"));
            }
        }
        let project = self.visible_project(caller, project)?;
        let (id, secret) = secret::new_key()?;
        let record = KeyRecord {
            id: id.clone(),
            project: project.id.clone(),
            name: req.name.clone(),
            secret_sha256: secret::hash(&secret),
            created_at_ms: now_ms(),
        };
        if self.store().put_json_if_absent(Table::ApiKeys, &id, &record)?.is_some() {
            return Err(IamError::Internal(format!("key id {id} was taken; retry")));
        }
        tracing::info!(key = %id, project = %project.id, "API key created");
        Ok(ApiKeyCreated { key: record.info(), secret })
    }

    /// Revokes key `id` if it belongs to a project the caller may act on
    /// (a key may revoke itself); requests with it answer 401 from now on.
    pub fn revoke_key(&self, caller: &Caller, id: &str) -> Result<ApiKeyInfo, IamError> {
        let not_found = || IamError::NotFound { what: "key", id: id.to_string() };
        let record: KeyRecord = self.store().get_json(Table::ApiKeys, id)?.ok_or_else(not_found)?;
        if !self.may_act_on_project(caller, &record.project) {
            return Err(not_found());
        }
        self.store().delete(Table::ApiKeys, id)?;
        tracing::info!(key = %id, project = %record.project, "API key revoked");
        Ok(record.info())
    }

    /// Who `secret` is: one store read, so a revocation holds at once on
    /// every API server.
    pub fn authenticate(&self, secret: &str) -> Result<Caller, IamError> {
        let refused = || IamError::Unauthorized("unknown or revoked API key".into());
        let id = secret::key_id_of(secret).ok_or_else(refused)?;
        let record: KeyRecord = self.store().get_json(Table::ApiKeys, &id)?.ok_or_else(refused)?;
        if !secret::same(&record.secret_sha256, &secret::hash(secret)) {
            return Err(refused());
        }
        Ok(Caller { project: record.project, key_id: Some(record.id) })
    }

    /// How many creates wait for quota now.
    pub fn quota_waiting(&self) -> usize {
        self.inner.gate.waiting()
    }

    /// Wakes creates waiting for quota: call when room may have appeared
    /// (a sandbox was deleted) so they need not wait for their next look.
    pub fn room_changed(&self) {
        self.inner.gate.bump();
    }
}

/// A refusal's quota dimension as the error `field`.
pub fn quota_field(kind: QuotaKind) -> String {
    format!("quota.{}", kind.as_str())
}

fn validate_name(name: &str) -> Result<(), IamError> {
    let ok = (1..=64).contains(&name.len())
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    match ok {
        true => Ok(()),
        false => Err(IamError::invalid("name", "1-64 characters of A-Z, a-z, 0-9, `.`, `_` and `-`")),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use warren_store::RedbStore;

    pub(crate) fn iam_in() -> (tempfile::TempDir, Iam) {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(RedbStore::open(dir.path().join("state.redb")).unwrap());
        let iam = Iam::open(store).unwrap();
        (dir, iam)
    }

    pub(crate) fn project(iam: &Iam, caller: &Caller, name: &str, quota: Quota) -> ProjectRecord {
        iam.create_project(caller, &CreateProjectRequest { name: name.into(), parent: None, quota }).unwrap()
    }

    fn as_key(iam: &Iam, project: &str) -> Caller {
        let made = iam.create_key(&Caller::root(), project, &CreateKeyRequest::default()).unwrap();
        iam.authenticate(&made.secret).unwrap()
    }

    #[test]
    fn the_root_project_exists_and_survives_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.redb");
        let a_id = {
            let iam = Iam::open(Arc::new(RedbStore::open(&path).unwrap())).unwrap();
            let root = iam.project(ROOT_PROJECT).unwrap();
            assert_eq!((root.parent, root.path), (None, vec![ROOT_PROJECT.to_string()]));
            project(&iam, &Caller::root(), "a", Quota::default()).id
        };
        let iam = Iam::open(Arc::new(RedbStore::open(&path).unwrap())).unwrap();
        let a = iam.project(&a_id).unwrap();
        assert_eq!(a.path, vec![ROOT_PROJECT.to_string(), a_id.clone()]);
        assert_eq!(iam.list_projects(&Caller::root()).unwrap().len(), 2);
    }

    #[test]
    fn a_key_acts_on_its_project_and_below_and_nothing_else() {
        let (_dir, iam) = iam_in();
        let a = project(&iam, &Caller::root(), "a", Quota::default());
        let b = project(&iam, &Caller::root(), "b", Quota::default());
        let a_key = as_key(&iam, &a.id);
        let a1 = project(&iam, &a_key, "a1", Quota::default());
        assert_eq!(a1.parent.as_deref(), Some(a.id.as_str()));
        assert!(iam.may_act_on_project(&a_key, &a.id));
        assert!(iam.may_act_on_project(&a_key, &a1.id));
        assert!(!iam.may_act_on_project(&a_key, &b.id));
        assert!(!iam.may_act_on_project(&a_key, ROOT_PROJECT));
        // A sandbox of a project nobody knows is the root's alone.
        assert!(!iam.may_act_on_project(&a_key, "prj-gone"));
        assert!(iam.may_act_on_project(&Caller::root(), "prj-gone"));
        // Another project is invisible, not forbidden.
        assert!(matches!(iam.visible_project(&a_key, &b.id), Err(IamError::NotFound { .. })));
        let a1_key = as_key(&iam, &a1.id);
        assert!(matches!(iam.visible_project(&a1_key, &a.id), Err(IamError::NotFound { .. })));
        let err = iam
            .create_project(
                &a_key,
                &CreateProjectRequest { name: "x".into(), parent: Some(b.id.clone()), ..Default::default() },
            )
            .unwrap_err();
        assert!(matches!(err, IamError::Invalid { ref field, .. } if field == "parent"), "{err:?}");
        let listed: Vec<String> = iam.list_projects(&a_key).unwrap().into_iter().map(|p| p.id).collect();
        assert_eq!(listed, vec![a.id.clone(), a1.id.clone()]);
    }

    #[test]
    fn delegation_is_bounded_by_what_the_parent_has_left() {
        let (_dir, iam) = iam_in();
        let quota = |sandboxes, cpus| Quota { sandboxes: Some(sandboxes), cpus: Some(cpus), ..Quota::default() };
        let team = project(&iam, &Caller::root(), "team", quota(10, 8.0));
        let key = as_key(&iam, &team.id);
        project(&iam, &key, "one", quota(6, 4.0));
        let over = iam
            .create_project(&key, &CreateProjectRequest { name: "two".into(), parent: None, quota: quota(5, 1.0) })
            .unwrap_err();
        assert!(matches!(over, IamError::Invalid { ref field, .. } if field == "quota.sandboxes"), "{over:?}");
        let beyond_own = iam
            .create_project(&key, &CreateProjectRequest { name: "two".into(), parent: None, quota: quota(1, 9.0) })
            .unwrap_err();
        assert!(matches!(beyond_own, IamError::Invalid { ref field, .. } if field == "quota.cpus"), "{beyond_own:?}");
        let two = project(&iam, &key, "two", quota(4, 4.0));
        let info = iam.project_info(&team, &[SandboxUsage { project: two.id.clone(), cpus: 1.5, memory_mib: 64 }]);
        assert_eq!(info.delegated, quota(10, 8.0));
        assert_eq!((info.usage.sandboxes, info.usage.cpus, info.usage.memory_mib), (1, 1.5, 64));
        let dup =
            iam.create_project(&key, &CreateProjectRequest { name: "two".into(), parent: None, quota: quota(0, 0.0) });
        assert!(matches!(dup, Err(IamError::Invalid { ref field, .. }) if field == "name"));
        let bad = iam.create_project(&key, &CreateProjectRequest { name: "a/b".into(), ..Default::default() });
        assert!(matches!(bad, Err(IamError::Invalid { ref field, .. }) if field == "name"));
    }

    #[test]
    fn keys_are_stored_hashed_and_revocation_is_immediate() {
        let (dir, iam) = iam_in();
        let a = project(&iam, &Caller::root(), "a", Quota::default());
        let b = project(&iam, &Caller::root(), "b", Quota::default());
        let made = iam.create_key(&Caller::root(), &a.id, &CreateKeyRequest { name: Some("ci".into()) }).unwrap();
        let caller = iam.authenticate(&made.secret).unwrap();
        assert_eq!(caller, Caller { project: a.id.clone(), key_id: Some(made.key.id.clone()) });
        // Only the hash is stored.
        let raw = iam.store().get(Table::ApiKeys, &made.key.id).unwrap().unwrap();
        assert!(!String::from_utf8_lossy(&raw).contains(&made.secret));
        // A forged secret with the right id is refused.
        let forged =
            format!("{}{}", &made.secret[..made.secret.len() - 1], if made.secret.ends_with('0') { '1' } else { '0' });
        assert!(matches!(iam.authenticate(&forged), Err(IamError::Unauthorized(_))));
        assert!(matches!(iam.authenticate("nonsense"), Err(IamError::Unauthorized(_))));
        // A key of another project cannot see (so not revoke) it.
        let b_key = as_key(&iam, &b.id);
        assert!(matches!(iam.revoke_key(&b_key, &made.key.id), Err(IamError::NotFound { .. })));
        assert!(matches!(iam.create_key(&b_key, &a.id, &CreateKeyRequest::default()), Err(IamError::NotFound { .. })));
        iam.revoke_key(&caller, &made.key.id).unwrap();
        assert!(matches!(iam.authenticate(&made.secret), Err(IamError::Unauthorized(_))));
        drop(dir);
    }

    /// Another server's maker, between its claim and its child's record.
    fn claim_elsewhere(iam: &Iam, parent: &str, name: &str, quota: Quota) -> (u64, delegation::Claim) {
        let claim = delegation::Claim {
            child: format!("prj-elsewhere-{name}"),
            name: name.into(),
            quota,
            at_ms: now_ms(),
            void: false,
        };
        (delegation::take_slot(iam.store(), parent, &claim).unwrap(), claim)
    }

    #[test]
    fn a_child_being_made_elsewhere_counts_against_the_parent() {
        let (dir, iam) = iam_in();
        let root = Caller::root();
        let parent = project(&iam, &root, "p", Quota { sandboxes: Some(4), ..Quota::default() });
        let owner = Caller { project: parent.id.clone(), key_id: None };
        let (slot, claim) = claim_elsewhere(&iam, &parent.id, "x", Quota { sandboxes: Some(3), ..Quota::default() });
        let req = CreateProjectRequest {
            name: "y".into(),
            parent: None,
            quota: Quota { sandboxes: Some(2), ..Quota::default() },
        };
        let refused = iam.create_project(&owner, &req).err().unwrap();
        assert!(matches!(refused, IamError::Invalid { ref field, .. } if field == "quota.sandboxes"), "{refused:?}");
        // The same name as a child being made elsewhere is taken too.
        let same = CreateProjectRequest { name: "x".into(), parent: None, quota: Quota::default() };
        let refused = iam.create_project(&owner, &same).err().unwrap();
        assert!(matches!(refused, IamError::Invalid { ref field, .. } if field == "name"), "{refused:?}");
        // Refused makers void their own claims; once the other maker gave up
        // too, the room is there.
        let voided =
            iam.store().list_json::<delegation::Claim>(Table::Meta, &format!("delegations/{}/", parent.id)).unwrap();
        assert_eq!(voided.iter().filter(|(_, c)| c.void).count(), 2, "{voided:?}");
        delegation::void(iam.store(), &parent.id, slot, &claim).unwrap();
        let made = iam.create_project(&owner, &req).unwrap();
        assert_eq!(made.quota.sandboxes, Some(2));
        drop(dir);
    }

    #[test]
    fn a_child_that_claimed_later_does_not_count_before_an_earlier_claim() {
        let (dir, iam) = iam_in();
        let parent = project(&iam, &Caller::root(), "p", Quota { sandboxes: Some(4), ..Quota::default() });
        let owner = Caller { project: parent.id.clone(), key_id: None };
        let (early, _) = claim_elsewhere(&iam, &parent.id, "early", Quota { sandboxes: Some(3), ..Quota::default() });
        // A later maker checked itself against `early` (3 of 4): 1 fits.
        let later = iam
            .create_project(
                &owner,
                &CreateProjectRequest {
                    name: "later".into(),
                    parent: None,
                    quota: Quota { sandboxes: Some(1), ..Quota::default() },
                },
            )
            .unwrap();
        let all = iam.refresh().unwrap();
        let children: Vec<&ProjectRecord> = all.iter().filter(|p| p.parent.as_deref() == Some(&parent.id)).collect();
        let before_early = delegation::before(iam.store(), &parent.id, early, &children, now_ms()).unwrap();
        assert!(before_early.is_empty(), "the later child is not early's business: {before_early:?}");
        let before_next = delegation::before(iam.store(), &parent.id, early + 2, &children, now_ms()).unwrap();
        let names: Vec<&str> = before_next.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["later", "early"], "committed children, then pending claims");
        assert_eq!(later.parent.as_deref(), Some(parent.id.as_str()));
        // A claim whose maker died stops counting after its TTL.
        let stale =
            delegation::before(iam.store(), &parent.id, early + 2, &children, now_ms() + delegation::CLAIM_TTL_MS)
                .unwrap();
        assert_eq!(stale.len(), 1);
        drop(dir);
    }
}

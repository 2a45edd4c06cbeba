//! Delegation claims: what keeps a parent from giving away more quota than
//! it has when several servers make its children at once (the API servers
//! of a cluster share one store; one server alone serialises with a lock).
//!
//! Before a child project is written, its maker claims the next slot of
//! the parent's claim sequence (`meta/delegations/<parent>/<n>`, taken with
//! put-if-absent, so every slot has one owner and the slots order the
//! makers). It then checks the child's quota against the parent's minus
//! what the committed children and the earlier claims hold - every earlier
//! claim is visible by then, since it was written before this one took a
//! later slot - and against their names. A refused maker voids its claim
//! (overwrites it; slots are never freed, so the order never changes). A
//! claim whose child was never written (its maker died) stops counting
//! after [`CLAIM_TTL_MS`].

use serde::{Deserialize, Serialize};
use warren_api::Quota;
use warren_store::{StateStore, StateStoreExt, Table};

use crate::error::IamError;
use crate::ProjectRecord;

/// How long a claim whose child never appeared still counts.
pub const CLAIM_TTL_MS: u64 = 60_000;
/// Slots a maker tries before giving up (others keep taking them first).
const CLAIM_ATTEMPTS: usize = 64;

/// One maker's claim on a parent's quota.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Claim {
    pub child: String,
    pub name: String,
    pub quota: Quota,
    pub at_ms: u64,
    #[serde(default)]
    pub void: bool,
}

fn prefix(parent: &str) -> String {
    format!("delegations/{parent}/")
}

fn slot_key(parent: &str, slot: u64) -> String {
    format!("{}{slot:020}", prefix(parent))
}

/// Takes the next free slot of `parent`'s sequence for `claim`.
pub(crate) fn take_slot(store: &dyn StateStore, parent: &str, claim: &Claim) -> Result<u64, IamError> {
    let last = store.last(Table::Meta, &prefix(parent))?;
    let first = match last {
        Some((key, _)) => key.rsplit('/').next().and_then(|n| n.parse::<u64>().ok()).map_or(0, |n| n + 1),
        None => 0,
    };
    for slot in first..first + CLAIM_ATTEMPTS as u64 {
        if store.put_json_if_absent(Table::Meta, &slot_key(parent, slot), claim)?.is_none() {
            return Ok(slot);
        }
    }
    Err(IamError::Internal(format!("no free delegation slot of {parent} after {CLAIM_ATTEMPTS} tries; retry")))
}

/// What counts against the parent before the maker holding `slot`, as
/// `(name, quota)`: the committed children that claimed an earlier slot
/// (or none: made before claims existed), and the earlier claims whose
/// child is not committed yet, unless void or expired. Children that
/// claimed a later slot checked themselves against this one's claim.
pub(crate) fn before(
    store: &dyn StateStore,
    parent: &str,
    slot: u64,
    children: &[&ProjectRecord],
    now_ms: u64,
) -> Result<Vec<(String, Quota)>, IamError> {
    let claims: Vec<(u64, Claim)> = store
        .list_json::<Claim>(Table::Meta, &prefix(parent))?
        .into_iter()
        .filter_map(|(key, claim)| key.rsplit('/').next().and_then(|n| n.parse().ok()).map(|n| (n, claim)))
        .collect();
    let slot_of = |child: &str| claims.iter().find(|(_, c)| c.child == child).map(|(n, _)| *n);
    let mut out: Vec<(String, Quota)> = children
        .iter()
        .filter(|c| slot_of(&c.id).is_none_or(|n| n < slot))
        .map(|c| (c.name.clone(), c.quota.clone()))
        .collect();
    for (n, claim) in &claims {
        let committed = children.iter().any(|c| c.id == claim.child);
        let live = !claim.void && now_ms.saturating_sub(claim.at_ms) < CLAIM_TTL_MS;
        if *n < slot && live && !committed {
            out.push((claim.name.clone(), claim.quota.clone()));
        }
    }
    Ok(out)
}

/// Voids the claim in `slot` (its child was refused).
pub(crate) fn void(store: &dyn StateStore, parent: &str, slot: u64, claim: &Claim) -> Result<(), IamError> {
    let voided = Claim { void: true, ..claim.clone() };
    store.put_json(Table::Meta, &slot_key(parent, slot), &voided)?;
    Ok(())
}

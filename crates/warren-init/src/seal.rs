//! The last step before serving: reduce PID 1's (and so every later
//! process's) privileges to `warren_guard::profile::SANDBOX_CAPABILITIES`.
//!
//! Order matters: capability changes need `CAP_SETPCAP` (dropped last from
//! the effective set by `capset`), and any credential change resets the
//! dumpable flag, so `PR_SET_DUMPABLE` comes at the very end.

use rustix::process::DumpableBehavior;
use rustix::thread::{CapabilitySet, CapabilitySets};
use warren_guard::profile::sandbox_capability_mask;

use crate::error::{InitError, StepContext};
use crate::sys;

/// Capability numbers to try dropping; the kernel answers EINVAL past its
/// last one, which ends the loop early.
const MAX_CAPABILITY_NUMBER: u32 = 63;

pub fn apply() -> Result<(), InitError> {
    apply_keeping(sandbox_capability_mask())
}

/// As [`apply`], keeping the capabilities of `mask` (bit `n` for number `n`).
pub fn apply_keeping(mask: u64) -> Result<(), InitError> {
    drop_bounding_set(mask)?;
    rustix::thread::clear_ambient_capability_set().step(|| "step 4: clear the ambient capabilities".into())?;
    let kept = CapabilitySet::from_bits_retain(mask);
    rustix::thread::set_capabilities(
        None,
        CapabilitySets { effective: kept, permitted: kept, inheritable: CapabilitySet::empty() },
    )
    .step(|| "step 4: capset".into())?;
    rustix::thread::set_no_new_privs(true).step(|| "step 4: prctl(PR_SET_NO_NEW_PRIVS, 1)".into())?;
    rustix::process::set_dumpable_behavior(DumpableBehavior::NotDumpable)
        .step(|| "step 4: prctl(PR_SET_DUMPABLE, 0)".into())
}

fn drop_bounding_set(mask: u64) -> Result<(), InitError> {
    for number in 0..=MAX_CAPABILITY_NUMBER {
        if mask & (1u64 << number) != 0 {
            continue;
        }
        let known =
            sys::drop_bounding_capability(number).step(|| format!("step 4: prctl(PR_CAPBSET_DROP, {number})"))?;
        if !known {
            break;
        }
    }
    Ok(())
}

//! The file API (stat, list, read, write, mkdir, remove, rename) of a sandbox, served
//! from the host on a directory fd of the sandbox's root filesystem.
//!
//! The code lives in `warren_init::files` because a microVM's init runs the
//! very same resolution inside its guest; the container backend uses it
//! here, on the host. See that module for the invariants.

pub use warren_init::files::*;

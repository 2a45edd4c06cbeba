//! Owns the images sandboxes start from: named, ordered stacks of read-only
//! layer directories on the node's disk, and the importers that fill them
//! (directories, tar streams, OCI layouts, `docker save`, OCI registries).
//!
//! Invariants: a manifest names only complete layers (a layer is built under
//! `tmp/` and renamed into `layers/` before any manifest refers to it), and a
//! manifest on disk is always whole (written to a temporary file, synced and
//! renamed). A crash leaves at most unreferenced leftovers, which the next
//! sole opener of the store removes.
//!
//! Never runs anything from an image: copying is done by the host's GNU tar.
//! Layers are handed out as read-only directories so the lazy EROFS format can
//! replace this one behind the same interface.

pub mod blob;
pub mod cache;
pub mod docker_config;
pub mod erofs;
mod error;
mod fsutil;
pub mod layer;
mod manifest;
pub mod metablob;
mod name;
pub mod oci;
pub mod registry;
pub mod scrub;
mod store;
mod tar;

pub use error::{ImageError, Result};
pub use name::validate_name;
pub use store::{Image, ImageStore, Layer};

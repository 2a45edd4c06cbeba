//! Wire types of Warren's HTTP API v1: requests, responses, stream frames,
//! states, end reasons and the error body.
//!
//! Owns: the JSON shape every client sees. The server, the CLI, the tests and
//! the OpenAPI document all derive from these types, so they cannot drift.
//! Invariant: states and reasons are enums, units are in field names.
//! Never: performs I/O or depends on any other Warren crate.

pub mod batch;
pub mod cluster;
pub mod error;
pub mod events;
pub mod exec;
pub mod files;
pub mod function;
pub mod iam;
pub mod images;
pub mod network;
pub mod phase;
pub mod sandbox;
pub mod session;
pub mod stats;
pub mod trajectory;

pub use batch::*;
pub use cluster::*;
pub use error::{ApiError, ErrorCode};
pub use events::*;
pub use exec::*;
pub use files::*;
pub use function::*;
pub use iam::*;
pub use images::*;
pub use network::*;
pub use phase::*;
pub use sandbox::*;
pub use session::*;
pub use stats::*;
pub use trajectory::*;

/// Default address of the embedded server; clients read `WARREN_URL` first.
pub const DEFAULT_URL: &str = "http://127.0.0.1:7070";
/// Environment variable through which every client finds the server.
pub const URL_ENV: &str = "WARREN_URL";

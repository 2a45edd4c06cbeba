//! The one error type of init's setup and service.

use std::io;

#[derive(Debug, thiserror::Error)]
pub enum InitError {
    /// A system call failed; `step` names what init was doing.
    #[error("{step}: {source}")]
    Sys {
        step: String,
        #[source]
        source: io::Error,
    },
    /// Init refused to continue because something is not as it must be
    /// (e.g. a mount point in the image is a symlink).
    #[error("{0}")]
    Refused(String),
    /// The seccomp profile does not compile (a bug in its data).
    #[error("step 4: seccomp profile: {0}")]
    Profile(#[from] warren_guard::seccomp::SeccompError),
    /// The initial phase's rules cannot be enforced in this image.
    #[error("{0}")]
    PhaseRejected(String),
    /// The host broke the setup protocol.
    #[error("setup protocol: {0}")]
    Protocol(String),
}

/// Attaches the step that failed to a system-call error.
pub trait StepContext<T> {
    fn step(self, what: impl FnOnce() -> String) -> Result<T, InitError>;
}

impl<T, E: Into<io::Error>> StepContext<T> for Result<T, E> {
    fn step(self, what: impl FnOnce() -> String) -> Result<T, InitError> {
        self.map_err(|e| InitError::Sys { step: what(), source: e.into() })
    }
}

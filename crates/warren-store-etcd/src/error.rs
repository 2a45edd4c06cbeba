use tonic::Code;
use warren_store::StoreError;

/// Why an etcd store operation failed. [`StateStore`](warren_store::StateStore)
/// calls see these as [`StoreError`]s; the etcd-only calls (compare-and-swap,
/// watch) return them as they are.
#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    /// The configuration cannot work (no endpoints, a malformed URL, a prefix
    /// that is not a path).
    #[error("etcd store configuration: {0}")]
    Config(String),
    /// No member answered within the timeouts, or the cluster has no leader.
    /// A write that fails so may still have been applied.
    #[error("etcd unavailable at {endpoints}: {reason}")]
    Unavailable { endpoints: String, reason: String },
    /// A watch asked for history that etcd has compacted away; the watcher
    /// must list again and watch from the list's revision.
    #[error("etcd history before revision {compacted} is compacted; cannot watch from revision {requested}")]
    Compacted { requested: i64, compacted: i64 },
    /// A read-modify-write lost its compare-and-swap this many times in a
    /// row: the key is contended beyond what retrying can fix.
    #[error("etcd key {key} kept changing under {attempts} compare-and-swap attempts")]
    Contended { key: String, attempts: u32 },
    /// A key under this store's prefix that is not UTF-8: something other
    /// than this store wrote it.
    #[error("etcd key under the store's prefix is not UTF-8: {0:?}")]
    ForeignKey(Vec<u8>),
    /// The store's own runtime could not start or has shut down.
    #[error("etcd store runtime: {0}")]
    Runtime(String),
    /// Anything else etcd reported; the text is for humans.
    #[error("etcd: {0}")]
    Backend(String),
}

impl EtcdError {
    /// Sorts a client error into what a caller can act on: transport
    /// failures and the gRPC codes etcd uses for "no leader" and timeouts are
    /// `Unavailable`, the rest is `Backend`.
    pub(crate) fn from_client(e: etcd_client::Error, endpoints: &str) -> Self {
        use etcd_client::Error as E;
        let unavailable = |reason: String| EtcdError::Unavailable { endpoints: endpoints.to_owned(), reason };
        match e {
            E::TransportError(t) => unavailable(t.to_string()),
            E::IoError(io) => unavailable(io.to_string()),
            E::GRpcStatus(status) if status_unavailable(&status) => unavailable(status_text(&status)),
            E::GRpcStatus(status) => EtcdError::Backend(status_text(&status)),
            E::InvalidUri(u) => EtcdError::Config(format!("invalid endpoint URL: {u}")),
            E::InvalidArgs(a) => EtcdError::Config(a),
            other => EtcdError::Backend(other.to_string()),
        }
    }
}

/// True when the request never left this process: no connection to the
/// member it was routed to could be made. Such a request is safe to send
/// again whatever it does, since nothing of it was applied.
pub(crate) fn never_sent(e: &etcd_client::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = match e {
        etcd_client::Error::GRpcStatus(status) => Some(status),
        etcd_client::Error::TransportError(t) => Some(t),
        _ => None,
    };
    while let Some(err) = source {
        if err.is::<tonic::ConnectError>() {
            return true;
        }
        source = err.source();
    }
    false
}

/// Unavailable for any reason: a read may be sent again after it.
pub(crate) fn unavailable(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => true,
        etcd_client::Error::GRpcStatus(status) => status_unavailable(status),
        _ => false,
    }
}

/// etcd answers "no leader" and its own request timeout with Unavailable,
/// tonic's client-side timeout is Cancelled, and a connection that broke
/// under a request (a member killed) is Unknown with the transport error
/// as its source.
fn status_unavailable(status: &tonic::Status) -> bool {
    use std::error::Error as _;
    match status.code() {
        Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled => true,
        Code::Unknown => {
            let mut source = status.source();
            while let Some(err) = source {
                if err.is::<tonic::transport::Error>() || err.is::<std::io::Error>() {
                    return true;
                }
                source = err.source();
            }
            false
        }
        _ => false,
    }
}

/// A status's message, with the transport error under it when there is one
/// (tonic puts "connection refused" there, not in the message).
fn status_text(status: &tonic::Status) -> String {
    use std::error::Error as _;
    let mut text = format!("{:?}: {}", status.code(), status.message());
    let mut source = status.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

impl From<EtcdError> for StoreError {
    fn from(e: EtcdError) -> Self {
        match e {
            EtcdError::Unavailable { endpoints, reason } => StoreError::Unavailable { endpoints, reason },
            other => StoreError::Backend(other.to_string()),
        }
    }
}

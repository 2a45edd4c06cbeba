use warren_store_etcd::EtcdError;

/// What can stop a cluster role from starting or working.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("invalid cluster configuration: {0}")]
    Config(String),
    #[error("etcd: {0}")]
    Etcd(#[from] EtcdError),
    #[error("store: {0}")]
    Store(#[from] warren_store::StoreError),
    #[error("cluster token file {path}: {message}")]
    Token { path: String, message: String },
    #[error("a blocking etcd call was cancelled")]
    Cancelled,
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("IAM: {0}")]
    Iam(#[from] warren_iam::IamError),
    #[error("a shared record is corrupt: {0}")]
    Corrupt(String),
}

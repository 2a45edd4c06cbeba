use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{EventType, WatchClient, WatchOptions, WatchRequestSender, WatchResponseStream};
use tokio::runtime::Handle;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::error::EtcdError;

/// A change to one key, in etcd's revision order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchEvent {
    Put { key: String, value: Vec<u8>, mod_revision: i64 },
    Delete { key: String, mod_revision: i64 },
}

impl WatchEvent {
    pub fn key(&self) -> &str {
        match self {
            WatchEvent::Put { key, .. } | WatchEvent::Delete { key, .. } => key,
        }
    }

    /// The store revision of the change.
    pub fn revision(&self) -> i64 {
        match self {
            WatchEvent::Put { mod_revision, .. } | WatchEvent::Delete { mod_revision, .. } => *mod_revision,
        }
    }
}

/// A live watch on a key range, from [`EtcdStore::watch`](crate::EtcdStore::watch).
/// Dropping it cancels the watch in etcd.
///
/// Events arrive in revision order, each once. An `Err` is the last item:
/// [`EtcdError::Compacted`] (list again and watch from the new revision) or
/// [`EtcdError::Unavailable`] (no member could resume the stream).
#[derive(Debug)]
pub struct Watch {
    events: mpsc::Receiver<Result<WatchEvent, EtcdError>>,
    member: Arc<AtomicU64>,
    task: JoinHandle<()>,
}

impl Watch {
    /// The next event; `None` once the watch has ended (after its error).
    pub async fn next(&mut self) -> Option<Result<WatchEvent, EtcdError>> {
        self.events.recv().await
    }

    /// [`Watch::next`] for a thread outside any async runtime (it panics
    /// inside one, like every tokio blocking receive).
    pub fn blocking_next(&mut self) -> Option<Result<WatchEvent, EtcdError>> {
        self.events.blocking_recv()
    }

    /// The id of the etcd member streaming this watch now (it changes when
    /// the watch resumes elsewhere): for logs, and for tests that kill it.
    pub fn member_id(&self) -> u64 {
        self.member.load(Ordering::Relaxed)
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What to watch and how to name the keys back.
pub(crate) struct Spec {
    pub(crate) client: WatchClient,
    pub(crate) start: Vec<u8>,
    pub(crate) end: Vec<u8>,
    /// The table's key prefix, removed from every event's key.
    pub(crate) strip: Vec<u8>,
    pub(crate) endpoints: String,
}

/// Events buffered between etcd and a slow consumer; past this the stream
/// waits (etcd buffers on its side, then reports the watcher as lagging).
const BUFFER: usize = 256;
/// Resume attempts after the stream broke, 0.1 s to 0.5 s apart (~5 s in
/// all): long enough for the survivors to elect a leader, short enough that
/// a lost cluster is reported soon.
const RESUME_ATTEMPTS: u32 = 12;

pub(crate) async fn start(spec: Spec, from_revision: Option<i64>, runtime: Handle) -> Result<Watch, EtcdError> {
    let mut attempt = 0;
    let (stream, next_revision) = loop {
        match open(&spec, from_revision).await {
            // Routed to a member that is gone: nothing was registered.
            Err(OpenError::NeverSent(_)) if attempt < RESUME_ATTEMPTS => {
                attempt += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => break other.map_err(EtcdError::from)?,
        }
    };
    let (tx, rx) = mpsc::channel(BUFFER);
    let member = Arc::new(AtomicU64::new(stream.member_id));
    let task = runtime.spawn(forward(spec, stream, next_revision, tx, Arc::clone(&member)));
    Ok(Watch { events: rx, member, task })
}

/// One gRPC watch stream. The request side is kept open for the stream's
/// life: a half-closed stream is one etcd may end.
struct Stream {
    member_id: u64,
    _requests: WatchRequestSender,
    responses: WatchResponseStream,
}

/// Opens the watch and waits for etcd to confirm it. Returns the stream and
/// the revision its first event will have at least.
async fn open(spec: &Spec, from_revision: Option<i64>) -> Result<(Stream, i64), OpenError> {
    let mut options = WatchOptions::new().with_range(spec.end.clone());
    if let Some(rev) = from_revision {
        options = options.with_start_revision(rev);
    }
    let mut client = spec.client.clone();
    let (requests, mut responses) = client
        .watch(spec.start.clone(), Some(options))
        .await
        .map_err(|e| match crate::error::never_sent(&e) {
            true => OpenError::NeverSent(EtcdError::from_client(e, &spec.endpoints)),
            false => OpenError::Other(EtcdError::from_client(e, &spec.endpoints)),
        })?
        .split();
    let first = responses.message().await.map_err(|e| OpenError::Other(EtcdError::from_client(e, &spec.endpoints)))?;
    match first {
        Some(resp) if resp.created() && !resp.canceled() => {
            let now = resp.header().map_or(0, |h| h.revision());
            let member_id = resp.header().map_or(0, |h| h.member_id());
            Ok((Stream { member_id, _requests: requests, responses }, from_revision.unwrap_or(now + 1)))
        }
        Some(resp) => Err(OpenError::Other(cancelled(&resp, from_revision.unwrap_or(0)))),
        None => Err(OpenError::Other(EtcdError::Unavailable {
            endpoints: spec.endpoints.clone(),
            reason: "the watch stream closed before etcd confirmed it".into(),
        })),
    }
}

enum OpenError {
    /// No connection could be made: etcd never saw the request.
    NeverSent(EtcdError),
    Other(EtcdError),
}

impl From<OpenError> for EtcdError {
    fn from(e: OpenError) -> Self {
        match e {
            OpenError::NeverSent(e) | OpenError::Other(e) => e,
        }
    }
}

fn cancelled(resp: &etcd_client::WatchResponse, requested: i64) -> EtcdError {
    if resp.compact_revision() > 0 {
        EtcdError::Compacted { requested, compacted: resp.compact_revision() }
    } else {
        EtcdError::Backend(format!("etcd cancelled the watch: {}", resp.cancel_reason()))
    }
}

async fn forward(
    spec: Spec,
    mut stream: Stream,
    mut next_revision: i64,
    tx: mpsc::Sender<Result<WatchEvent, EtcdError>>,
    member: Arc<AtomicU64>,
) {
    loop {
        let message = tokio::select! {
            _ = tx.closed() => return,
            message = stream.responses.message() => message,
        };
        match message {
            Ok(Some(resp)) if resp.canceled() => {
                let _ = tx.send(Err(cancelled(&resp, next_revision))).await;
                return;
            }
            Ok(Some(resp)) => {
                for event in resp.events() {
                    let Some(kv) = event.kv() else { continue };
                    next_revision = next_revision.max(kv.mod_revision() + 1);
                    let decoded = decode(&spec.strip, kv, event.event_type());
                    if tx.send(decoded).await.is_err() {
                        return;
                    }
                }
            }
            // The member went away (or closed the stream): pick the watch
            // up elsewhere from where it stopped, so nothing is missed.
            Ok(None) | Err(_) => match resume(&spec, next_revision).await {
                Ok(resumed) => {
                    member.store(resumed.member_id, Ordering::Relaxed);
                    stream = resumed;
                }
                Err(e) => {
                    let _ = tx.send(Err(e)).await;
                    return;
                }
            },
        }
    }
}

async fn resume(spec: &Spec, next_revision: i64) -> Result<Stream, EtcdError> {
    let mut last = None;
    for attempt in 0..RESUME_ATTEMPTS {
        match open(spec, Some(next_revision)).await.map_err(EtcdError::from) {
            Ok((stream, _)) => return Ok(stream),
            Err(e @ EtcdError::Compacted { .. }) => return Err(e),
            Err(e) => {
                tracing::debug!(error = %e, attempt, "etcd watch resume failed");
                last = Some(e);
            }
        }
        tokio::time::sleep(Duration::from_millis(100) * (attempt + 1).min(5)).await;
    }
    Err(last.unwrap_or_else(|| EtcdError::Unavailable {
        endpoints: spec.endpoints.clone(),
        reason: "the watch could not be resumed".into(),
    }))
}

fn decode(strip: &[u8], kv: &etcd_client::KeyValue, kind: EventType) -> Result<WatchEvent, EtcdError> {
    let key = kv
        .key()
        .strip_prefix(strip)
        .and_then(|rest| std::str::from_utf8(rest).ok())
        .ok_or_else(|| EtcdError::ForeignKey(kv.key().to_vec()))?
        .to_owned();
    let mod_revision = kv.mod_revision();
    Ok(match kind {
        EventType::Put => WatchEvent::Put { key, value: kv.value().to_vec(), mod_revision },
        EventType::Delete => WatchEvent::Delete { key, mod_revision },
    })
}

//! Batch creation and the admission queue: a failed item fails alone, a
//! retried batch makes nothing new, a full node queues creates (reporting
//! the position) and admits them in order as room appears, and a full queue
//! answers 429 with its limit.

use std::time::Duration;

use futures_util::StreamExt;
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};
use tokio::time::{sleep, timeout, Instant};
use warren_api::{BatchFrame, ErrorCode, QueueFullError, SandboxInfo, SandboxState};
use warren_tests::*;

const WAIT: Duration = Duration::from_secs(60);

/// An open batch answer, read frame by frame.
struct BatchStream {
    body: std::pin::Pin<Box<dyn futures_util::Stream<Item = reqwest::Result<bytes::Bytes>> + Send>>,
    buf: Vec<u8>,
}

impl BatchStream {
    async fn open(server: &TestServer, body: &Value) -> BatchStream {
        let resp = api::send(server.http.post(format!("{}/v1/sandboxes/batch", server.url)).json(body)).await;
        assert_eq!(resp.status(), StatusCode::OK, "batch {body}");
        BatchStream { body: Box::pin(resp.bytes_stream()), buf: Vec::new() }
    }

    async fn next(&mut self) -> Option<BatchFrame> {
        loop {
            if let Some(nl) = self.buf.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=nl).collect();
                return Some(serde_json::from_slice(&line).expect("a BatchFrame line"));
            }
            match timeout(WAIT, self.body.next()).await.expect("a batch frame in time") {
                Some(chunk) => self.buf.extend_from_slice(&chunk.expect("read the batch stream")),
                None => return None,
            }
        }
    }

    async fn collect(mut self) -> Vec<BatchFrame> {
        let mut frames = Vec::new();
        while let Some(f) = self.next().await {
            frames.push(f);
        }
        frames
    }
}

/// Item frames by index: the sandbox (and whether this call made it) or the error.
fn items(frames: &[BatchFrame]) -> Vec<(u32, Option<SandboxInfo>, bool, Option<warren_api::ApiError>)> {
    let mut out: Vec<_> = frames
        .iter()
        .filter_map(|f| match f {
            BatchFrame::Item { index, sandbox, made, error } => {
                Some((*index, sandbox.as_deref().cloned(), *made, error.clone()))
            }
            _ => None,
        })
        .collect();
    out.sort_by_key(|i| i.0);
    out
}

fn done(frames: &[BatchFrame]) -> (u32, u32, u32) {
    match frames.last() {
        Some(BatchFrame::Done { made, existing, failed }) => (*made, *existing, *failed),
        other => panic!("the batch did not end with `done`: {other:?}"),
    }
}

#[tokio::test]
async fn a_failed_item_does_not_fail_the_batch() {
    let server = TestServer::start().await;
    // Item 1's key is taken by a different request: that item, and only it, fails.
    server.create(small(json!({"idempotency_key": "pf-1", "memory_mib": 64}))).await;
    let frames = BatchStream::open(&server, &json!({"count": 3, "batch_key": "pf", "template": small(json!({}))}))
        .await
        .collect()
        .await;
    let items = items(&frames);
    assert_eq!(items.len(), 3, "{frames:?}");
    for (index, sandbox, made, error) in &items {
        if *index == 1 {
            let error = error.as_ref().expect("item 1 failed");
            assert_eq!((error.code, error.field.as_deref()), (ErrorCode::IdempotencyConflict, Some("idempotency_key")));
            assert!(sandbox.is_none());
        } else {
            let sb = sandbox.as_ref().unwrap_or_else(|| panic!("item {index} failed: {error:?}"));
            assert!(*made && sb.state == SandboxState::Running, "{sb:?}");
            assert_eq!(server.sh_ok(&sb.id, "echo up").await, "up\n");
        }
    }
    assert_eq!(done(&frames), (2, 0, 1));
    // A bad template is refused as a whole, naming the field.
    let (status, body) =
        server.call(Method::POST, "/v1/sandboxes/batch", Some(&json!({"count": 2, "template": {"cpus": 0}}))).await;
    assert_api_error(status, &body, ErrorCode::InvalidRequest, Some("template.cpus"));
    server.finish().await;
}

#[tokio::test]
async fn a_retried_batch_answers_with_the_same_sandboxes() {
    let server = TestServer::start().await;
    let req = json!({"count": 3, "batch_key": "retry", "template": small(json!({"labels": {"b": "retry"}}))});
    let first = BatchStream::open(&server, &req).await.collect().await;
    assert_eq!(done(&first), (3, 0, 0), "{first:?}");
    let second = BatchStream::open(&server, &req).await.collect().await;
    assert_eq!(done(&second), (0, 3, 0), "{second:?}");
    let ids = |frames: &[BatchFrame]| -> Vec<String> {
        items(frames).into_iter().map(|i| i.1.expect("a sandbox").id).collect()
    };
    assert_eq!(ids(&first), ids(&second), "the retry answered with other sandboxes");
    assert_eq!(server.list(Some("b=retry")).await.len(), 3, "the retry made more sandboxes");
    server.finish().await;
}

async fn books(server: &TestServer) -> Value {
    let (status, body) = server.call(Method::GET, "/v1/capacity", None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    body
}

/// Waits (bounded) until `n` creates wait in the admission queue.
async fn queue_holds(server: &TestServer, n: u64) {
    let deadline = Instant::now() + WAIT;
    while books(server).await["queue_waiting"] != json!(n) {
        assert!(Instant::now() < deadline, "the queue never held {n}: {}", books(server).await);
        sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_full_node_queues_creates_and_admits_them_as_room_appears() {
    let server = TestServer::start_with(&["--max-sandboxes", "2"]).await;
    let holders = [server.create_small().await, server.create_small().await];

    let mut batch =
        BatchStream::open(&server, &json!({"count": 3, "batch_key": "q", "template": small(json!({}))})).await;
    match batch.next().await {
        Some(BatchFrame::Queued { position: 1, items_waiting: 3 }) => {}
        other => panic!("expected the batch queued at position 1 with 3 items waiting, got {other:?}"),
    }
    // While creates wait, one that does not wait is refused instead of overtaking them...
    let (status, body) = server.try_create(&small(json!({}))).await;
    assert_api_error(status, &body, ErrorCode::CapacityExceeded, None);
    // ...and one that waits queues behind the batch's waiting items.
    let waiting = {
        let (http, url, body) = (server.http.clone(), server.url.clone(), small(json!({"labels": {"who": "single"}})));
        tokio::spawn(async move {
            api::json_response(api::send(http.post(format!("{url}/v1/sandboxes?queue=true")).json(&body)).await).await
        })
    };
    queue_holds(&server, 4).await;

    // Room appears one sandbox at a time: each admitted item is deleted again
    // so the next can go, and the reported position only ever falls.
    server.delete(&holders[0].id).await;
    server.delete(&holders[1].id).await;
    let mut made = Vec::new();
    let mut positions = Vec::new();
    while let Some(frame) = batch.next().await {
        match frame {
            BatchFrame::Queued { position, .. } => positions.push(position),
            BatchFrame::Item { index, sandbox, error, .. } => {
                let sb = sandbox.unwrap_or_else(|| panic!("item {index} failed: {error:?}"));
                made.push(index);
                server.delete(&sb.id).await;
            }
            BatchFrame::Done { made, existing, failed } => assert_eq!((made, existing, failed), (3, 0, 0)),
        }
    }
    made.sort();
    assert_eq!(made, vec![0, 1, 2]);
    assert!(positions.iter().all(|p| *p == 1), "the batch was first in line throughout: {positions:?}");

    let (status, body) = timeout(WAIT, waiting).await.expect("the queued create finished").expect("join");
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(books(&server).await["queue_waiting"], json!(0));
    server.finish().await;
}

#[tokio::test]
async fn a_full_queue_answers_429_with_its_limit() {
    let server = TestServer::start_with(&["--max-sandboxes", "1", "--admission-queue-limit", "1"]).await;
    let holder = server.create_small().await;
    let first = {
        let (http, url, body) = (server.http.clone(), server.url.clone(), small(json!({})));
        tokio::spawn(async move {
            api::json_response(api::send(http.post(format!("{url}/v1/sandboxes?queue=true")).json(&body)).await).await
        })
    };
    queue_holds(&server, 1).await;

    let (status, body) = server.call(Method::POST, "/v1/sandboxes?queue=true", Some(&small(json!({})))).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
    let refused: QueueFullError = serde_json::from_value(body.clone()).expect("a QueueFullError body");
    assert_eq!((refused.code, refused.queue_limit, refused.field.as_deref()), (ErrorCode::QueueFull, 1, Some("queue")));
    let (status, body) = server
        .call(Method::POST, "/v1/sandboxes/batch", Some(&json!({"count": 2, "template": small(json!({}))})))
        .await;
    assert_eq!(
        (status, &body["code"], &body["queue_limit"]),
        (StatusCode::TOO_MANY_REQUESTS, &json!("queue_full"), &json!(1))
    );

    server.delete(&holder.id).await;
    let (status, body) = timeout(WAIT, first).await.expect("the queued create finished").expect("join");
    assert_eq!(status, StatusCode::CREATED, "{body}");
    server.finish().await;
}

/// A node out of uid ranges (here: room for one) refuses a create with 503
/// `capacity_exceeded` naming them - not 500 `internal` - leaves nothing of
/// the refused sandbox behind, and creates again once the range is free.
#[tokio::test]
async fn a_node_out_of_uid_ranges_answers_503_capacity_exceeded() {
    let room_for_one = (u32::MAX - 65_536 - 1).to_string();
    let server = TestServer::start_with(&["--uid-base-start", &room_for_one]).await;
    let holder = server.create_small().await;
    let (status, body) = server.try_create(&small(json!({}))).await;
    assert_api_error(status, &body, ErrorCode::CapacityExceeded, None);
    assert!(body["message"].as_str().is_some_and(|m| m.contains("uid ranges")), "{body}");
    server.delete(&holder.id).await;
    let again = server.create_small().await;
    server.delete(&again.id).await;
    server.finish().await;
}

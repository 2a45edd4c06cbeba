//! A small typed client of the HTTP API, for the CLI.

use anyhow::{bail, Context, Result};
use base64::Engine as _;
use futures_util::StreamExt;
use reqwest::{Method, RequestBuilder, Response};
use serde::de::DeserializeOwned;
use serde::Serialize;
use warren_api::*;

pub struct Client {
    base: String,
    http: reqwest::Client,
    /// Sent as `Authorization: Bearer` on every request.
    api_key: Option<String>,
}

impl Client {
    /// A client that sends the key in `WARREN_API_KEY`, if set.
    pub fn new(base: &str) -> Self {
        let api_key = std::env::var(API_KEY_ENV).ok().filter(|k| !k.is_empty());
        Client { base: base.trim_end_matches('/').to_string(), http: reqwest::Client::new(), api_key }
    }

    /// A client that sends no key (for a server this process started).
    pub fn anonymous(base: &str) -> Self {
        Client { api_key: None, ..Client::new(base) }
    }

    fn req(&self, method: Method, path: &str) -> RequestBuilder {
        let rb = self.http.request(method, format!("{}{}", self.base, path));
        match &self.api_key {
            Some(key) => rb.bearer_auth(key),
            None => rb,
        }
    }

    async fn check(resp: Response) -> Result<Response> {
        if resp.status().is_success() {
            return Ok(resp);
        }
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        match serde_json::from_str::<ApiError>(&text) {
            Ok(e) => match e.field {
                Some(f) => bail!("{} ({:?}, field `{f}`): {}", status, e.code, e.message),
                None => bail!("{} ({:?}): {}", status, e.code, e.message),
            },
            Err(_) => bail!("{status}: {text}"),
        }
    }

    async fn json<T: DeserializeOwned>(&self, rb: RequestBuilder) -> Result<T> {
        let resp = rb.send().await.with_context(|| format!("cannot reach the Warren server at {}", self.base))?;
        Ok(Self::check(resp).await?.json().await?)
    }

    pub async fn health(&self) -> Result<Health> {
        self.json(self.req(Method::GET, "/v1/health")).await
    }

    pub async fn create(&self, req: &CreateSandboxRequest) -> Result<SandboxInfo> {
        self.json(self.req(Method::POST, "/v1/sandboxes").json(req)).await
    }

    pub async fn get(&self, id: &str) -> Result<SandboxInfo> {
        self.json(self.req(Method::GET, &format!("/v1/sandboxes/{id}"))).await
    }

    pub async fn list(&self, label: Option<&str>) -> Result<SandboxList> {
        let mut rb = self.req(Method::GET, "/v1/sandboxes");
        if let Some(l) = label {
            rb = rb.query(&[("label", l)]);
        }
        self.json(rb).await
    }

    pub async fn delete(&self, id: &str) -> Result<SandboxInfo> {
        self.json(self.req(Method::DELETE, &format!("/v1/sandboxes/{id}"))).await
    }

    /// `pause` or `resume`.
    pub async fn pause_or_resume(&self, id: &str, verb: &str) -> Result<SandboxInfo> {
        self.json(self.req(Method::POST, &format!("/v1/sandboxes/{id}/{verb}"))).await
    }

    pub async fn pack(&self, id: &str, req: &PackRequest) -> Result<ImageInfo> {
        self.json(self.req(Method::POST, &format!("/v1/sandboxes/{id}/pack")).json(req)).await
    }

    pub async fn set_network(&self, id: &str, policy: &warren_api::NetworkPolicy) -> Result<SandboxInfo> {
        self.json(self.req(Method::PUT, &format!("/v1/sandboxes/{id}/network")).json(policy)).await
    }

    pub async fn set_phase(&self, id: &str, req: &SetPhaseRequest) -> Result<SandboxInfo> {
        self.json(self.req(Method::PUT, &format!("/v1/sandboxes/{id}/phase")).json(req)).await
    }

    /// Runs an exec, handing each output chunk to `on_output` as it arrives.
    pub async fn exec_streaming(
        &self,
        path: &str,
        req: &ExecRequest,
        mut on_output: impl FnMut(StreamName, &[u8]),
    ) -> Result<ExecResult> {
        let resp = self.req(Method::POST, path).json(req).send().await.context("cannot reach the Warren server")?;
        let mut body = Self::check(resp).await?.bytes_stream();
        let mut buf: Vec<u8> = Vec::new();
        while let Some(chunk) = body.next().await {
            buf.extend_from_slice(&chunk?);
            while let Some(nl) = buf.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = buf.drain(..=nl).collect();
                match serde_json::from_slice::<ExecFrame>(&line)? {
                    ExecFrame::Output { stream, data_b64, .. } => {
                        on_output(stream, &base64::engine::general_purpose::STANDARD.decode(data_b64)?)
                    }
                    ExecFrame::Gap { stream, dropped_bytes, .. } => {
                        on_output(stream, format!("\n[... {dropped_bytes} bytes dropped ...]\n").as_bytes())
                    }
                    ExecFrame::End { result } => return Ok(*result),
                    ExecFrame::Started { .. } => {}
                }
            }
        }
        bail!("the server closed the exec stream before its end frame")
    }

    pub async fn create_session(&self, id: &str) -> Result<SessionInfo> {
        self.json(
            self.req(Method::POST, &format!("/v1/sandboxes/{id}/sessions")).json(&CreateSessionRequest::default()),
        )
        .await
    }

    pub async fn put_file(&self, id: &str, path: &str, mode: Option<&str>, body: reqwest::Body) -> Result<FileStat> {
        let mut q = vec![("path", path)];
        if let Some(m) = mode {
            q.push(("mode", m));
        }
        self.json(self.req(Method::PUT, &format!("/v1/sandboxes/{id}/files")).query(&q).body(body)).await
    }

    pub async fn get_file(&self, id: &str, path: &str) -> Result<Response> {
        let resp = self.req(Method::GET, &format!("/v1/sandboxes/{id}/files")).query(&[("path", path)]).send().await?;
        Self::check(resp).await
    }

    pub async fn list_files(&self, id: &str, path: &str) -> Result<FileList> {
        self.json(self.req(Method::GET, &format!("/v1/sandboxes/{id}/files/list")).query(&[("path", path)])).await
    }

    pub async fn cluster_status(&self) -> Result<ClusterStatus> {
        self.json(self.req(Method::GET, "/v1/cluster")).await
    }

    pub async fn image_stats(&self) -> Result<ImageStats> {
        self.json(self.req(Method::GET, "/v1/images/stats")).await
    }

    pub async fn sandbox_image_stats(&self, id: &str) -> Result<SandboxImageStats> {
        self.json(self.req(Method::GET, &format!("/v1/sandboxes/{id}/image-stats"))).await
    }

    pub async fn images(&self) -> Result<ImageList> {
        self.json(self.req(Method::GET, "/v1/images")).await
    }

    pub async fn import_dir(
        &self,
        name: &str,
        dir: &str,
        format: &str,
        role: Option<ImageLayerRole>,
    ) -> Result<ImageInfo> {
        #[derive(Serialize)]
        struct Req<'a> {
            name: &'a str,
            dir: &'a str,
            format: &'a str,
            #[serde(skip_serializing_if = "Option::is_none")]
            role: Option<ImageLayerRole>,
        }
        self.json(self.req(Method::POST, "/v1/images").json(&Req { name, dir, format, role })).await
    }

    pub async fn pull_image(&self, req: &PullImageRequest) -> Result<ImageInfo> {
        self.json(self.req(Method::POST, "/v1/images/pull").json(req)).await
    }

    pub async fn push_image(&self, name: &str, req: &PushImageRequest) -> Result<PushImageResult> {
        self.json(self.req(Method::POST, &format!("/v1/images/{name}/push")).json(req)).await
    }

    pub async fn inspect_image(&self, name: &str) -> Result<ImageDetail> {
        self.json(self.req(Method::GET, &format!("/v1/images/{name}"))).await
    }

    pub async fn remove_image(&self, name: &str) -> Result<()> {
        let resp = self.req(Method::DELETE, &format!("/v1/images/{name}")).send().await?;
        Self::check(resp).await.map(|_| ())
    }

    pub async fn compose_image(&self, req: &ComposeImageRequest) -> Result<ImageInfo> {
        self.json(self.req(Method::POST, "/v1/images/compose").json(req)).await
    }

    pub async fn gc_images(&self) -> Result<ImageGcReport> {
        self.json(self.req(Method::POST, "/v1/images/gc")).await
    }

    pub async fn import_tar(&self, name: &str, body: reqwest::Body) -> Result<ImageInfo> {
        self.json(self.req(Method::PUT, &format!("/v1/images/{name}/tar")).body(body)).await
    }

    pub async fn trajectory(&self, id: &str) -> Result<Trajectory> {
        self.json(self.req(Method::GET, &format!("/v1/sandboxes/{id}/trajectory"))).await
    }

    pub async fn create_project(&self, req: &CreateProjectRequest) -> Result<ProjectInfo> {
        self.json(self.req(Method::POST, "/v1/projects").json(req)).await
    }

    pub async fn projects(&self) -> Result<ProjectList> {
        self.json(self.req(Method::GET, "/v1/projects")).await
    }

    pub async fn project(&self, id: &str) -> Result<ProjectInfo> {
        self.json(self.req(Method::GET, &format!("/v1/projects/{id}"))).await
    }

    pub async fn create_key(&self, project: &str, req: &CreateKeyRequest) -> Result<ApiKeyCreated> {
        self.json(self.req(Method::POST, &format!("/v1/projects/{project}/keys")).json(req)).await
    }

    pub async fn delete_key(&self, id: &str) -> Result<ApiKeyInfo> {
        self.json(self.req(Method::DELETE, &format!("/v1/keys/{id}"))).await
    }

    /// Waits for the whole replay: one exec after the other, on the server.
    pub async fn replay(&self, id: &str, req: &ReplayRequest) -> Result<ReplayReport> {
        self.json(self.req(Method::POST, &format!("/v1/sandboxes/{id}/trajectory/replay")).json(req)).await
    }
}

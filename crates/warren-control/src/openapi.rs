//! The OpenAPI document, generated from the handlers and the wire types. The
//! checked-in copy (`docs/openapi.json`) is compared with it by a test.

use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityRequirement, SecurityScheme};
use utoipa::{Modify, OpenApi};

use crate::{batch, files, functions, handlers, images, metrics, projects, trajectory};

#[derive(OpenApi)]
#[openapi(
    info(title = "Warren API", version = "1", description = "Sandboxes for training and evaluating AI agents."),
    paths(
        handlers::health,
        metrics::stats,
        handlers::list_images,
        handlers::image_stats,
        handlers::import_image_dir,
        handlers::import_image_tar,
        images::pull_image,
        images::push_image,
        images::inspect_image,
        images::remove_image,
        images::compose_image,
        images::gc_images,
        images::sandbox_image_stats,
        batch::create_sandbox,
        batch::create_batch,
        batch::pause_sandbox,
        batch::resume_sandbox,
        batch::capacity,
        handlers::list_sandboxes,
        handlers::pack_sandbox,
        handlers::set_phase,
        handlers::set_network,
        handlers::list_events,
        handlers::get_sandbox,
        handlers::delete_sandbox,
        handlers::start_exec,
        metrics::list_execs,
        handlers::get_exec,
        handlers::resume_exec,
        handlers::kill_exec,
        handlers::create_session,
        handlers::list_sessions,
        handlers::delete_session,
        handlers::session_exec,
        functions::run_function,
        functions::list_function_pools,
        files::download,
        files::upload,
        files::remove,
        files::stat,
        files::list,
        files::mkdir,
        trajectory::get_trajectory,
        trajectory::replay_trajectory,
        projects::create_project,
        projects::list_projects,
        projects::get_project,
        projects::create_key,
        projects::delete_key,
    ),
    components(schemas(
        warren_api::ExecFrame,
        warren_api::ErrorCode,
        warren_api::BatchFrame,
        warren_api::QuotaExceededError
    )),
    modifiers(&BearerKey)
)]
pub struct ApiDoc;

/// `Authorization: Bearer <API key>`: required with `warren serve --auth on`,
/// optional otherwise (docs/iam.md).
struct BearerKey;

impl Modify for BearerKey {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme("api_key", SecurityScheme::Http(Http::new(HttpAuthScheme::Bearer)));
        // The empty requirement makes the key optional: a server may run with auth off.
        openapi.security =
            Some(vec![SecurityRequirement::new("api_key", Vec::<String>::new()), SecurityRequirement::default()]);
    }
}

/// The document as pretty JSON, byte-stable for a given build.
pub fn document() -> String {
    ApiDoc::openapi().to_pretty_json().unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
}

#[cfg(test)]
mod tests {
    /// The checked-in document must match the code; `WARREN_BLESS=1` rewrites it.
    #[test]
    fn checked_in_openapi_document_is_current() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/openapi.json");
        let current = super::document() + "\n";
        if std::env::var_os("WARREN_BLESS").is_some() {
            std::fs::write(&path, &current).unwrap();
        }
        let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            on_disk == current,
            "docs/openapi.json is stale: run `WARREN_BLESS=1 cargo test -p warren-control openapi`"
        );
    }
}

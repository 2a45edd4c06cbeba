//! The OpenAPI document, generated from the handlers and the wire types. The
//! checked-in copy (`docs/openapi.json`) is compared with it by a test.

use utoipa::OpenApi;

use crate::{files, handlers, images};

#[derive(OpenApi)]
#[openapi(
    info(title = "Warren API", version = "1", description = "Sandboxes for training and evaluating AI agents."),
    paths(
        handlers::health,
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
        handlers::create_sandbox,
        handlers::list_sandboxes,
        handlers::pack_sandbox,
        handlers::set_phase,
        handlers::set_network,
        handlers::list_events,
        handlers::get_sandbox,
        handlers::delete_sandbox,
        handlers::start_exec,
        handlers::get_exec,
        handlers::resume_exec,
        handlers::kill_exec,
        handlers::create_session,
        handlers::list_sessions,
        handlers::delete_session,
        handlers::session_exec,
        files::download,
        files::upload,
        files::remove,
        files::stat,
        files::list,
        files::mkdir,
    ),
    components(schemas(warren_api::ExecFrame, warren_api::ErrorCode))
)]
pub struct ApiDoc;

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

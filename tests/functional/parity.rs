//! The parity suite (`warren_tests::parity`) once per backend: the same
//! cases, the same expected results, one parameter changed. A VM test needs
//! `qemu-system-x86` and the Debian cloud kernel (and, for `vm`, the
//! systemd image built with `debootstrap`): without them it fails and says
//! so instead of passing.

use serde_json::json;
use warren_api::Backend;
use warren_tests::guest::{delete_leaves_nothing, import_systemd_image, require_qemu_and_kernel, SYSTEMD_IMAGE};
use warren_tests::parity::{run_all, Subject};
use warren_tests::*;

async fn parity(server: &TestServer, backend: Backend, create: serde_json::Value) {
    let subject = Subject { server, backend, create };
    let sb = subject.create().await;
    run_all(&subject, &sb.id).await;
    match backend {
        // A VM's delete also leaves no QEMU, disk or socket behind.
        Backend::Microvm | Backend::Vm => delete_leaves_nothing(backend, server, &sb.id).await,
        _ => {
            let ended = server.delete(&sb.id).await;
            assert_eq!(ended.end_reason, Some(warren_api::EndReason::Deleted), "{ended:?}");
        }
    }
}

#[tokio::test]
async fn a_container_passes_the_parity_suite() {
    let server = TestServer::start().await;
    parity(&server, Backend::Container, small(json!({"backend": "container"}))).await;
    server.finish().await;
}

#[tokio::test]
async fn a_function_sandbox_passes_the_parity_suite() {
    let server = TestServer::start().await;
    parity(&server, Backend::Function, small(json!({"backend": "function"}))).await;
    server.finish().await;
}

#[tokio::test]
async fn a_microvm_passes_the_parity_suite() {
    require_qemu_and_kernel("microvm");
    let server = TestServer::start().await;
    parity(&server, Backend::Microvm, small(json!({"backend": "microvm", "memory_mib": 256}))).await;
    server.finish().await;
}

#[tokio::test]
async fn a_full_vm_passes_the_parity_suite() {
    require_qemu_and_kernel("vm");
    let server = TestServer::start().await;
    import_systemd_image(&server).await;
    let create = small(json!({"backend": "vm", "image": SYSTEMD_IMAGE, "memory_mib": 512, "disk_mib": 128}));
    parity(&server, Backend::Vm, create).await;
    server.finish().await;
}

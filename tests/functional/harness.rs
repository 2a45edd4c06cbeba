//! The harness itself: its leak check must be able to fail, and its drop
//! guard must clean up after a test that did fail.

use warren_tests::leaks::Leaks;
use warren_tests::*;

#[tokio::test]
#[should_panic(expected = "the server left behind")]
async fn leak_check_catches_a_sandbox_the_server_left() {
    let mut server = TestServer::start().await;
    server.create_small().await;
    // A crashed server cleans nothing up: finish must notice.
    server.crash().await;
    server.finish().await;
}

#[tokio::test]
async fn drop_guard_removes_what_a_failed_test_left() {
    let (data_dir, instance) = {
        let mut server = TestServer::start().await;
        let sb = server.create_small().await;
        server.crash().await;
        let leaks = Leaks::scan(&server.data_dir(), &server.instance);
        assert!(!leaks.mounts.is_empty() && !leaks.processes.is_empty(), "the sandbox {} is still there", sb.id);
        (server.data_dir(), server.instance.clone())
    };
    let leaks = Leaks::scan(&data_dir, &instance);
    assert!(leaks.is_empty(), "the drop guard left:\n{leaks}");
    assert!(leaks::instance_cgroup_dirs(&instance).is_empty());
    assert!(!data_dir.exists(), "the temp dir is removed");
}

//! IAM on etcd, as a cluster's API servers run it: two `Iam`s on one etcd
//! (two API servers) see each other's projects and keys, a revocation on
//! one holds at once on the other, and delegation counts the children the
//! other one made. Needs Debian's `etcd-server` (fails, never skips,
//! without it).

use std::sync::Arc;

use warren_api::{CreateKeyRequest, CreateProjectRequest, Quota, ROOT_PROJECT};
use warren_iam::{Caller, Iam, IamError};
use warren_store_etcd::testing::EtcdCluster;
use warren_store_etcd::{EtcdConfig, EtcdStore};

fn iam_on(cluster: &EtcdCluster, prefix: &str) -> Iam {
    let config = EtcdConfig::new(cluster.endpoints()).with_prefix(prefix);
    let store = EtcdStore::connect(config).expect("connect to etcd");
    Iam::open(Arc::new(store)).expect("open IAM on etcd")
}

#[test]
fn two_api_servers_on_one_etcd_share_projects_keys_and_revocations() {
    let cluster = EtcdCluster::start(1);
    let (one, two) = (iam_on(&cluster, "/iam-test"), iam_on(&cluster, "/iam-test"));
    let quota = |sandboxes| Quota { sandboxes: Some(sandboxes), ..Quota::default() };
    let team = one
        .create_project(&Caller::root(), &CreateProjectRequest { name: "team".into(), parent: None, quota: quota(4) })
        .expect("a project");
    let made = one.create_key(&Caller::root(), &team.id, &CreateKeyRequest::default()).expect("a key");

    // The other server knows the key and the project.
    let caller = two.authenticate(&made.secret).expect("the key on the other server");
    assert_eq!(caller.project, team.id);
    assert_eq!(two.project(&team.id).expect("the project").path, vec![ROOT_PROJECT.to_string(), team.id.clone()]);

    // Delegation on one server counts the children the other made.
    let child = |name: &str, n| CreateProjectRequest { name: name.into(), parent: None, quota: quota(n) };
    one.create_project(&caller, &child("a", 3)).expect("a child");
    let over = two.create_project(&caller, &child("b", 2)).expect_err("past the parent's quota");
    assert!(matches!(over, IamError::Invalid { ref field, .. } if field == "quota.sandboxes"), "{over:?}");
    two.create_project(&caller, &child("b", 1)).expect("what is left");
    assert_eq!(one.list_projects(&caller).expect("the list").len(), 3);

    // A revocation on one server holds on the other from the next request.
    two.revoke_key(&caller, &made.key.id).expect("revoke");
    assert!(matches!(one.authenticate(&made.secret), Err(IamError::Unauthorized(_))));
}

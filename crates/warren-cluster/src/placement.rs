//! Placement: which node gets a new sandbox.
//!
//! Filter the live nodes by backend and room; sample `k` of them at random
//! (power of k choices: near-best balance without every API server herding
//! onto the one least-loaded node), add one node that already holds the
//! image if the sample has none, and take the least loaded - unless a node
//! holding the image is close to it (at most [`LOCALITY_SLACK_SANDBOXES`]
//! more sandboxes and [`LOCALITY_SLACK`] more load), which is then
//! preferred (no layer fetch, no cold cache). Load counts what the node
//! reported at its last heartbeat plus what this API server has sent it
//! since (in flight or placed after that heartbeat), so a burst of creates
//! between two heartbeats still spreads. The node has the final word: a
//! refusal (no room, no such image) excludes it and placement runs again.

use std::collections::BTreeSet;
use std::fmt::Write as _;

use warren_api::{Backend, NodeStatus};

/// Nodes sampled per decision.
pub const SAMPLE: usize = 2;
/// A node holding the image wins if its load is at most this much above
/// the least loaded candidate's (loads are fractions of the node's room).
pub const LOCALITY_SLACK: f64 = 0.10;
/// ... and at most this many sandboxes more: on a big node 10% is hundreds.
pub const LOCALITY_SLACK_SANDBOXES: u64 = 2;

/// What a create asks for.
#[derive(Debug, Clone)]
pub struct Ask {
    pub backend: Backend,
    pub image: String,
    pub memory_mib: u64,
    pub disk_mib: u64,
}

/// A live node with what this API server has sent it since its last
/// heartbeat.
#[derive(Debug, Clone)]
pub struct Candidate<'a> {
    pub node: &'a NodeStatus,
    pub pending_sandboxes: u64,
    pub pending_memory_mib: u64,
}

impl Candidate<'_> {
    fn sandboxes(&self) -> u64 {
        self.node.books.sandboxes_live + self.node.books.queue_waiting + self.pending_sandboxes
    }

    fn memory_mib(&self) -> u64 {
        self.node.books.memory_mib_committed + self.pending_memory_mib
    }

    fn memory_room_mib(&self) -> u64 {
        self.node.books.memory_mib_max.unwrap_or(self.node.memory_total_mib)
    }

    /// The fuller of its two dimensions, from 0 (empty) to 1 (full).
    fn load(&self) -> f64 {
        let by_count = self.sandboxes() as f64 / self.node.books.sandboxes_max.max(1) as f64;
        let by_memory = self.memory_mib() as f64 / self.memory_room_mib().max(1) as f64;
        by_count.max(by_memory)
    }

    /// Why it cannot take `ask`, if it cannot.
    fn unfit(&self, ask: &Ask) -> Option<String> {
        if !self.node.backends.contains(&ask.backend) {
            return Some(format!("no {} backend", ask.backend.as_str()));
        }
        if self.sandboxes() >= self.node.books.sandboxes_max {
            return Some(format!("full ({} sandboxes)", self.sandboxes()));
        }
        if self.memory_mib() + ask.memory_mib > self.memory_room_mib() {
            return Some(format!("{} of {} MiB committed", self.memory_mib(), self.memory_room_mib()));
        }
        if ask.disk_mib > self.node.disk_free_mib {
            return Some(format!("{} MiB of disk free", self.node.disk_free_mib));
        }
        None
    }

    fn holds(&self, image: &str) -> bool {
        self.node.images.iter().any(|i| i == image)
    }

    fn describe(&self) -> String {
        format!(
            "{} ({} sandboxes, {} MiB, load {:.2})",
            self.node.name,
            self.sandboxes(),
            self.memory_mib(),
            self.load()
        )
    }
}

/// The decision: the node, and why, in words for the sandbox's info.
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    pub node: String,
    pub reason: String,
}

/// Chooses a node for `ask` among `candidates` minus `excluded`;
/// `random(n)` picks in `0..n`. `Err` says why none fits.
pub fn choose(
    candidates: &[Candidate<'_>],
    ask: &Ask,
    excluded: &BTreeSet<String>,
    random: &mut dyn FnMut(usize) -> usize,
) -> Result<Choice, String> {
    let mut unfit = Vec::new();
    let mut fit: Vec<&Candidate<'_>> = Vec::new();
    for c in candidates {
        if excluded.contains(&c.node.name) {
            continue;
        }
        match c.unfit(ask) {
            Some(why) => unfit.push(format!("{}: {why}", c.node.name)),
            None => fit.push(c),
        }
    }
    if fit.is_empty() {
        return Err(match unfit.is_empty() {
            true => "no live node".to_string(),
            false => format!("no node fits: {}", unfit.join("; ")),
        });
    }
    // Sample without replacement.
    let mut pool = fit.clone();
    let mut sample = Vec::new();
    while sample.len() < SAMPLE && !pool.is_empty() {
        sample.push(pool.swap_remove(random(pool.len())));
    }
    if !sample.iter().any(|c| c.holds(&ask.image)) {
        let holders: Vec<&Candidate<'_>> = pool.iter().copied().filter(|c| c.holds(&ask.image)).collect();
        if !holders.is_empty() {
            sample.push(holders[random(holders.len())]);
        }
    }
    let by_load = |a: &&&Candidate<'_>, b: &&&Candidate<'_>| a.load().total_cmp(&b.load());
    let least = *sample.iter().min_by(by_load).expect("the sample is not empty");
    let holder = sample.iter().filter(|c| c.holds(&ask.image)).min_by(by_load).copied();
    let mut reason = format!(
        "sampled {} of {} fitting nodes: {}",
        sample.len(),
        fit.len(),
        sample.iter().map(|c| c.describe()).collect::<Vec<_>>().join(", ")
    );
    let chosen = match holder {
        Some(h)
            if h.load() <= least.load() + LOCALITY_SLACK
                && h.sandboxes() <= least.sandboxes() + LOCALITY_SLACK_SANDBOXES =>
        {
            let _ = write!(reason, "; chose {}: holds image `{}`", h.node.name, ask.image);
            if h.node.name != least.node.name {
                let _ = write!(reason, " (close enough to the least loaded)");
            }
            h
        }
        _ => {
            let _ = write!(reason, "; chose {}: least loaded", least.node.name);
            least
        }
    };
    Ok(Choice { node: chosen.node.name.clone(), reason })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use warren_api::NodeBooks;

    use super::*;

    fn node(name: &str, live: u64, images: &[&str]) -> NodeStatus {
        NodeStatus {
            name: name.into(),
            url: format!("http://{name}"),
            backends: vec![Backend::Container],
            cpus: 2.0,
            memory_total_mib: 4096,
            disk_free_mib: 10_000,
            books: NodeBooks {
                sandboxes_max: 10,
                sandboxes_live: live,
                sandboxes_paused: 0,
                memory_mib_max: None,
                memory_mib_committed: live * 256,
                memory_mib_reclaimable: 0,
                queue_waiting: 0,
                queue_limit: 64,
            },
            images: images.iter().map(|s| s.to_string()).collect(),
            running_by_backend: BTreeMap::new(),
            running_by_label: BTreeMap::new(),
            usage_by_project: BTreeMap::new(),
            heartbeat_at_ms: 0,
            started_at_ms: 0,
        }
    }

    fn ask(image: &str) -> Ask {
        Ask { backend: Backend::Container, image: image.into(), memory_mib: 256, disk_mib: 512 }
    }

    fn candidates(nodes: &[NodeStatus]) -> Vec<Candidate<'_>> {
        nodes.iter().map(|n| Candidate { node: n, pending_sandboxes: 0, pending_memory_mib: 0 }).collect()
    }

    #[test]
    fn the_least_loaded_of_the_sample_wins() {
        let nodes = [node("a", 5, &[]), node("b", 1, &[]), node("c", 3, &[])];
        // Sample a, then b (indices into the pool, which swap_remove
        // reorders: [a, b, c] -> [c, b]).
        let mut picks = [0usize, 1].into_iter();
        let choice = choose(&candidates(&nodes), &ask("x"), &BTreeSet::new(), &mut |_| picks.next().unwrap()).unwrap();
        assert_eq!(choice.node, "b", "{}", choice.reason);
        assert!(choice.reason.contains("least loaded"), "{}", choice.reason);
    }

    #[test]
    fn pending_placements_count_as_load() {
        let nodes = [node("a", 0, &[]), node("b", 0, &[])];
        let mut cands = candidates(&nodes);
        cands[0].pending_sandboxes = 3;
        cands[0].pending_memory_mib = 768;
        let choice = choose(&cands, &ask("x"), &BTreeSet::new(), &mut |_| 0).unwrap();
        assert_eq!(choice.node, "b");
    }

    #[test]
    fn a_node_holding_the_image_joins_the_sample_and_wins_when_not_much_busier() {
        let nodes = [node("a", 0, &[]), node("b", 0, &[]), node("c", 1, &["x"])];
        // Sample a, b; c joins as the holder: 1/10 load is within the slack.
        let choice = choose(&candidates(&nodes), &ask("x"), &BTreeSet::new(), &mut |_| 0).unwrap();
        assert_eq!(choice.node, "c", "{}", choice.reason);
        assert!(choice.reason.contains("holds image `x`"), "{}", choice.reason);
        // Much busier (3 sandboxes more, though far from full), it loses
        // to balance.
        let nodes = [node("a", 0, &[]), node("b", 0, &[]), node("c", 3, &["x"])];
        let choice = choose(&candidates(&nodes), &ask("x"), &BTreeSet::new(), &mut |_| 0).unwrap();
        assert_ne!(choice.node, "c", "{}", choice.reason);
    }

    #[test]
    fn unfit_and_excluded_nodes_are_never_chosen() {
        let mut vm_only = node("vm", 0, &["x"]);
        vm_only.backends = vec![Backend::Microvm];
        let full = node("full", 10, &["x"]);
        let refused = node("refused", 0, &["x"]);
        let nodes = [vm_only, full, refused, node("ok", 8, &[])];
        let excluded = BTreeSet::from(["refused".to_string()]);
        for seed in 0..8 {
            let mut n = seed;
            let choice = choose(&candidates(&nodes), &ask("x"), &excluded, &mut |len| {
                n += 1;
                n % len
            })
            .unwrap();
            assert_eq!(choice.node, "ok");
        }
        let err = choose(&candidates(&nodes[..2]), &ask("x"), &BTreeSet::new(), &mut |_| 0).unwrap_err();
        assert!(err.contains("vm: no container backend") && err.contains("full: full"), "{err}");
        assert_eq!(choose(&[], &ask("x"), &BTreeSet::new(), &mut |_| 0).unwrap_err(), "no live node");
    }

    #[test]
    fn memory_room_is_respected() {
        let mut tight = node("tight", 0, &[]);
        tight.books.memory_mib_max = Some(512);
        tight.books.memory_mib_committed = 384;
        let err = choose(&candidates(&[tight]), &ask("x"), &BTreeSet::new(), &mut |_| 0).unwrap_err();
        assert!(err.contains("384 of 512 MiB"), "{err}");
        let mut small_disk = node("disk", 0, &[]);
        small_disk.disk_free_mib = 100;
        let err = choose(&candidates(&[small_disk]), &ask("x"), &BTreeSet::new(), &mut |_| 0).unwrap_err();
        assert!(err.contains("100 MiB of disk free"), "{err}");
    }
}

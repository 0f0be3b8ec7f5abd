//! Unit tests of the placer.

use super::*;
use crate::model::{Gpu, Node};

/// A placer over one node with 8 CPUs, 64 GiB and `gpus` H100s.
fn one_node(gpus: usize) -> Placer {
    let node = Node::new(
        0,
        "n1",
        CpuMilli(8000),
        MemMib(65_536),
        vec![Gpu::plain("H100", MemMib(81_920)); gpus],
    );
    Placer::new(
        Cluster::new(vec![node]).unwrap(),
        Policy::gpuflow(),
        WorkloadMix::default(),
        1,
    )
}

#[test]
fn fits_after_release_answers_for_the_released_state_and_changes_nothing() {
    let mut placer = one_node(4);
    let whole = |count| TaskRequest {
        cpu: CpuMilli(1000),
        mem: MemMib(1024),
        gpu: GpuRequest::Whole { count },
        models: Vec::new(),
    };
    let three = placer.place_job(&Job::single(1, whole(3))).unwrap();
    let before = placer.cluster().usage(NodeId(0)).clone();
    let cons = Constraints::default();
    let freed: Vec<&Allocation> = three.iter().collect();
    assert!(!placer.fits_after_release(NodeId(0), &[], &whole(2), &cons));
    assert!(placer.fits_after_release(NodeId(0), &freed, &whole(2), &cons));
    assert!(placer.fits_after_release(NodeId(0), &freed, &whole(4), &cons));
    // CPU still bounds it: the node has 8 CPUs.
    let big = TaskRequest {
        cpu: CpuMilli(9000),
        ..whole(1)
    };
    assert!(!placer.fits_after_release(NodeId(0), &freed, &big, &cons));
    assert_eq!(placer.cluster().usage(NodeId(0)), &before);
    assert!(placer.try_place_job(&Job::single(2, whole(2))).is_none());
}

#[test]
fn fits_after_release_counts_a_shared_gpu_given_back_as_a_whole_one() {
    let mut placer = one_node(2);
    let req = |gpu| TaskRequest {
        cpu: CpuMilli(1000),
        mem: MemMib(1024),
        gpu,
        models: Vec::new(),
    };
    let half = req(GpuRequest::Fraction {
        milli: crate::ids::GpuMilli(500),
        mem: MemMib(0),
    });
    let one = placer
        .place_job(&Job::single(1, req(GpuRequest::Whole { count: 1 })))
        .unwrap();
    let shared = placer.place_job(&Job::single(2, half)).unwrap();
    // Half a GPU is free: too little for a whole one, until the shared
    // task stops and gives its GPU back whole.
    assert_eq!(placer.cluster().free_milli_total(NodeId(0)), 500);
    let cons = Constraints::default();
    let whole = req(GpuRequest::Whole { count: 1 });
    assert!(!placer.fits_after_release(NodeId(0), &[], &whole, &cons));
    let freed: Vec<&Allocation> = shared.iter().collect();
    assert!(placer.fits_after_release(NodeId(0), &freed, &whole, &cons));
    let two = req(GpuRequest::Whole { count: 2 });
    assert!(!placer.fits_after_release(NodeId(0), &freed, &two, &cons));
    let both: Vec<&Allocation> = one.iter().chain(&shared).collect();
    assert!(placer.fits_after_release(NodeId(0), &both, &two, &cons));
}

/// A placer over `n` equal nodes of 8 H100s, ties broken at random.
fn equal_nodes(n: u32, seed: u64) -> Placer {
    let nodes = (0..n)
        .map(|i| {
            Node::new(
                i,
                &format!("n{i}"),
                CpuMilli(64_000),
                MemMib(512 * 1024),
                vec![Gpu::plain("H100", MemMib(81_920)); 8],
            )
        })
        .collect();
    let mut policy = Policy::gpuflow();
    policy.tie_break = TieBreak::Random;
    Placer::new(
        Cluster::new(nodes).unwrap(),
        policy,
        WorkloadMix::default(),
        seed,
    )
}

#[test]
fn a_one_task_job_that_asks_to_be_spread_is_placed_as_any_other() {
    // One task has nothing to spread from: it goes where the same job
    // without the constraint goes, by the same draws.
    let task = |count| TaskRequest {
        cpu: CpuMilli(1000),
        mem: MemMib(1024),
        gpu: GpuRequest::Whole { count },
        models: Vec::new(),
    };
    let (mut plain, mut spread) = (equal_nodes(64, 5), equal_nodes(64, 5));
    for i in 0..200u64 {
        let job = Job::single(i, task([1, 2, 4, 8][i as usize % 4]));
        let mut asks = job.clone();
        asks.constraints.spread = true;
        assert_eq!(
            plain.place_job(&job).ok(),
            spread.place_job(&asks).ok(),
            "job {i}"
        );
    }
    // One that fits nowhere is told why, the same either way.
    let mut big = Job::single(999, task(9));
    let plain_why = plain.place_job(&big).unwrap_err();
    big.constraints.spread = true;
    let spread_why = spread.place_job(&big).unwrap_err();
    assert!(!plain_why.rejections.is_empty());
    assert_eq!(plain_why, spread_why);
    // A service of several replicas still spreads them: one a node.
    let mut service = Job::single(1000, task(1));
    service.groups[0].replicas = 4;
    service.constraints.spread = true;
    let mut fresh = equal_nodes(8, 5);
    let placed = fresh.place_job(&service).unwrap();
    let mut nodes: Vec<NodeId> = placed.iter().map(|a| a.node).collect();
    nodes.sort_unstable();
    nodes.dedup();
    assert_eq!(
        nodes.len(),
        4,
        "replicas of a spread service share a node: {placed:?}"
    );
}

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

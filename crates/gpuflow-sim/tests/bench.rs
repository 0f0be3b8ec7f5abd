//! The cycle benchmark runs the cycle the server runs.

use gpuflow_core::{MixWeighting, WorkloadMix};
use gpuflow_sim::bench::{CycleBench, CycleWorld};

/// The server sets the placement's mix from the pending work before each
/// cycle; a benchmark that placed with an empty mix measured a cheaper
/// cycle than the server runs.
#[test]
fn the_cycle_benchmark_places_with_the_pending_works_mix() {
    let mut world = CycleWorld::build(&CycleBench {
        nodes: 40,
        teams: 2,
        projects_per_team: 2,
        pending: 300,
        ..CycleBench::default()
    })
    .unwrap();
    for _ in 0..2 {
        let expected = WorkloadMix::from_groups(
            world.pending.iter().flat_map(|w| &w.job.groups),
            MixWeighting::Tasks,
            1.0,
        );
        assert_ne!(expected, WorkloadMix::default());
        world.cycle();
        assert_eq!(world.placer.mix(), &expected);
    }
}

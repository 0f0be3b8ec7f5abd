//! Placement scenarios: fixture in, rendered placement out (see `support`).

mod support;

use expect_test::expect;

#[test]
fn exclusive_gpus_carry_nothing_else_and_fractions_share() {
    let out = support::run(
        "
        node n1 gpus=2*A100
        job 1 gpu=whole:1 cpu=1
        job 2 gpu=frac:500 cpu=1
        job 3 gpu=frac:500 cpu=1
        job 4 gpu=frac:300 cpu=1     # no GPU has 300 left: one is exclusive, one is full
        ",
    );
    expect![[r#"
        job 1: main/0→n1[0]
        job 2: main/0→n1[1]
        job 3: main/0→n1[1]
        job 4: pending: main: needs 300 milli-GPU, 1 CPU: 1 node has too few free GPUs in the requested sharing mode
        usage:
          n1     cpu  3/64 gpus X f1000
    "#]]
    .assert_eq(&out);
}

#[test]
fn fractional_tasks_respect_gpu_memory() {
    let out = support::run(
        "
        node n1 gpus=1*A10 gpumem=24
        job 1 gpu=frac:200:16 cpu=1
        job 2 gpu=frac:200:16 cpu=1   # compute fits, memory does not
        job 3 gpu=frac:200:8 cpu=1
        ",
    );
    expect![[r#"
        job 1: main/0→n1[0]
        job 2: pending: main: needs 200 milli-GPU with 16384 MiB of GPU memory, 1 CPU: 1 node has too few free GPUs in the requested sharing mode
        job 3: main/0→n1[0]
        usage:
          n1     cpu  2/64 gpus f400
    "#]]
    .assert_eq(&out);
}

#[test]
fn sharing_modes_never_mix_on_one_gpu() {
    let out = support::run(
        "
        node n1 gpus=2*L4 slices=2
        job 1 gpu=slice cpu=1
        job 2 gpu=frac:100 cpu=1      # must not join the time-sliced GPU
        job 3 gpu=slice cpu=1         # joins the time-sliced GPU
        job 4 gpu=slice cpu=1         # slice limit 2 reached, the other GPU is fractional
        job 5 gpu=whole:1 cpu=1       # no idle GPU left
        ",
    );
    expect![[r#"
        job 1: main/0→n1[0]
        job 2: main/0→n1[1]
        job 3: main/0→n1[0]
        job 4: pending: main: needs a time slice of a GPU, 1 CPU: 1 node has too few free GPUs in the requested sharing mode
        job 5: pending: main: needs 1 whole GPU, 1 CPU: 1 node has too few free GPUs in the requested sharing mode
        usage:
          n1     cpu  3/64 gpus t2 f100
    "#]]
    .assert_eq(&out);
}

#[test]
fn mig_instances_are_whole_units_and_mig_gpus_take_no_other_work() {
    let out = support::run(
        "
        node n1 gpus=1*A100 mig=1g.10gb*2
        node n2 gpus=1*A100
        job 1 gpu=mig:1g.10gb cpu=1
        job 2 gpu=mig:1g.10gb cpu=1
        job 3 gpu=mig:1g.10gb cpu=1   # both instances taken
        job 4 gpu=mig:3g.40gb cpu=1   # no such profile anywhere
        job 5 gpu=whole:1 cpu=1       # only n2's GPU, n1 is in MIG mode
        release 1
        job 6 gpu=mig:1g.10gb cpu=1   # the released instance
        ",
    );
    expect![[r#"
        job 1: main/0→n1[0.mig0]
        job 2: main/0→n1[0.mig1]
        job 3: pending: main: needs a MIG 1g.10gb instance, 1 CPU: 2 nodes have too few free GPUs in the requested sharing mode
        job 4: pending: main: needs a MIG 3g.40gb instance, 1 CPU: 2 nodes have too few free GPUs in the requested sharing mode
        job 5: main/0→n2[0]
        release 1
        job 6: main/0→n1[0.mig0]
        usage:
          n1     cpu  2/64 gpus m2
          n2     cpu  1/64 gpus X
    "#]]
    .assert_eq(&out);
}

#[test]
fn explanation_counts_every_rule_that_rejected_nodes() {
    let out = support::run(
        "
        node n1 gpus=8*H100 state=cordoned
        node n2 gpus=8*H100 state=cordoned
        node n3 gpus=8*H100 cpu=8
        node n4 gpus=4*H100
        node n5 gpus=8*A10
        node n6 gpus=8*H100 unhealthy=0
        node n7 gpus=8*H100 taints=dedicated
        job 1 gpu=whole:8 cpu=16 models=H100
        ",
    );
    expect![[r#"
        job 1: pending: main: needs 8 whole GPUs (H100) on one node, 16 CPU: 2 nodes are cordoned, 1 node has taints the job does not tolerate, 1 node has no GPU of an accepted model, 1 node has too few healthy GPUs, 1 node has too little free CPU, 1 node has too few free GPUs in the requested sharing mode
        usage:
          n1     cpu  0/64 gpus . . . . . . . .
          n2     cpu  0/64 gpus . . . . . . . .
          n3     cpu  0/8  gpus . . . . . . . .
          n4     cpu  0/64 gpus . . . .
          n5     cpu  0/64 gpus . . . . . . . .
          n6     cpu  0/64 gpus .! . . . . . . .
          n7     cpu  0/64 gpus . . . . . . . .
    "#]]
    .assert_eq(&out);
}

#[test]
fn a_gang_is_placed_whole_or_not_at_all() {
    let out = support::run(
        "
        node n1 gpus=8*H100
        node n2 gpus=8*H100
        job 1 group=launcher cpu=1 gpu=none group=worker*2 gpu=whole:8 cpu=8
        job 2 group=worker*2 gpu=whole:4 cpu=8   # no GPU left: neither worker is placed
        release 1
        job 3 group=worker*3 gpu=whole:8 cpu=8   # 3 × 8 GPUs never fit 16: nothing is taken
        job 4 group=worker*2 gpu=whole:4 cpu=8
        ",
    );
    expect![[r#"
        job 1: worker/0→n1[0,1,2,3,4,5,6,7] worker/1→n2[0,1,2,3,4,5,6,7] launcher/0→n1
        job 2: pending: worker: needs 4 whole GPUs on one node, 8 CPU: 2 nodes have too few free GPUs in the requested sharing mode
        release 1
        job 3: pending: worker: needs 8 whole GPUs on one node, 8 CPU: 2 nodes have too few free GPUs in the requested sharing mode
        job 4: worker/0→n1[0,1,2,3] worker/1→n1[4,5,6,7]
        usage:
          n1     cpu 16/64 gpus X X X X X X X X
          n2     cpu  0/64 gpus . . . . . . . .
    "#]]
    .assert_eq(&out);
}

#[test]
fn required_topology_keeps_a_gang_in_one_rack_or_explains() {
    let out = support::run(
        "
        node a1 gpus=8*H100 rack=ra
        node a2 gpus=8*H100 rack=ra
        node b1 gpus=8*H100 rack=rb
        node b2 gpus=8*H100 rack=rb
        job 1 gpu=whole:4 cpu=1                            # takes half of one node
        job 2 group=worker*2 gpu=whole:8 cpu=1 topology=rack!   # needs a whole rack: the one job 1 left alone
        job 3 group=worker*2 gpu=whole:4 cpu=1 topology=rack!   # rack ra still has 4 + 8 free
        job 4 group=worker*2 gpu=whole:4 cpu=1 topology=rack!   # 4 free GPUs left in all: pending
        ",
    );
    expect![[r#"
        job 1: main/0→a1[0,1,2,3]
        job 2: worker/0→b1[0,1,2,3,4,5,6,7] worker/1→b2[0,1,2,3,4,5,6,7]
        job 3: worker/0→a1[4,5,6,7] worker/1→a2[0,1,2,3]
        job 4: pending: worker: needs 4 whole GPUs on one node, 1 CPU: 4 nodes have too few free GPUs in the requested sharing mode
        usage:
          a1     cpu  2/64 gpus X X X X X X X X
          a2     cpu  1/64 gpus X X X X . . . .
          b1     cpu  1/64 gpus X X X X X X X X
          b2     cpu  1/64 gpus X X X X X X X X
    "#]]
    .assert_eq(&out);
}

#[test]
fn preferred_topology_falls_back_and_required_topology_says_why() {
    let out = support::run(
        "
        node a1 gpus=4*H100 rack=ra labels=zone:a
        node b1 gpus=4*H100 rack=rb labels=zone:b
        job 1 gpu=whole:2 cpu=1 select=zone:a
        job 2 gpu=whole:2 cpu=1 select=zone:b
        job 3 group=worker*2 gpu=whole:2 cpu=1 topology=rack!   # 4 GPUs free, 2 per rack
        job 4 group=worker*2 gpu=whole:2 cpu=1 topology=rack    # preferred: spans both racks
        ",
    );
    expect![[r#"
        job 1: main/0→a1[0,1]
        job 2: main/0→b1[0,1]
        job 3: pending: worker: needs 2 whole GPUs on one node, 1 CPU; the job's 2 tasks fit the cluster but no single rack has room for all of them
        job 4: worker/0→a1[2,3] worker/1→b1[2,3]
        usage:
          a1     cpu  2/64 gpus X X X X
          b1     cpu  2/64 gpus X X X X
    "#]]
    .assert_eq(&out);
}

#[test]
fn nvlink_topology_keeps_gpus_in_one_island() {
    let out = support::run(
        "
        node n1 gpus=8*H100 nvlink=2
        job 1 gpu=whole:2 cpu=1                   # the tightest island that fits
        job 2 gpu=whole:4 cpu=1 topology=nvlink!  # the other island is whole
        job 3 gpu=whole:2 cpu=1 topology=nvlink!  # what is left of the first island
        job 4 gpu=whole:1 cpu=1 topology=nvlink!  # nothing left
        ",
    );
    expect![[r#"
        job 1: main/0→n1[0,1]
        job 2: main/0→n1[4,5,6,7]
        job 3: main/0→n1[2,3]
        job 4: pending: main: needs 1 whole GPU, 1 CPU: 1 node has too few free GPUs in the requested sharing mode
        usage:
          n1     cpu  3/64 gpus X X X X X X X X
    "#]]
    .assert_eq(&out);
}

#[test]
fn spread_services_put_replicas_on_different_nodes_and_racks() {
    let out = support::run(
        "
        policy best-fit
        node a1 gpus=8*L4 rack=ra
        node a2 gpus=8*L4 rack=ra
        node b1 gpus=8*L4 rack=rb
        node b2 gpus=8*L4 rack=rb
        job 1 group=replica*3 gpu=whole:1 cpu=1 spread
        job 2 group=worker*3 gpu=whole:1 cpu=1          # a gang without spread packs
        ",
    );
    expect![[r#"
        job 1: replica/0→a1[0] replica/1→b1[0] replica/2→a2[0]
        job 2: worker/0→a1[1] worker/1→a1[2] worker/2→a1[3]
        usage:
          a1     cpu  4/64 gpus X X X X . . . .
          a2     cpu  1/64 gpus X . . . . . . .
          b1     cpu  1/64 gpus X . . . . . . .
          b2     cpu  0/64 gpus . . . . . . . .
    "#]]
    .assert_eq(&out);
}

#[test]
fn pools_selectors_and_taints_restrict_nodes() {
    let out = support::run(
        "
        node t1 gpus=8*H100 pool=training labels=zone:a
        node t2 gpus=8*H100 pool=training labels=zone:b
        node i1 gpus=8*L4 pool=inference taints=dedicated
        job 1 gpu=whole:1 cpu=1 pool=training select=zone:b
        job 2 gpu=whole:1 cpu=1 pool=inference                     # does not tolerate the taint
        job 3 gpu=whole:1 cpu=1 pool=inference tolerate=dedicated
        job 4 gpu=whole:1 cpu=1 select=zone:c
        ",
    );
    expect![[r#"
        job 1: main/0→t2[0]
        job 2: pending: main: needs 1 whole GPU, 1 CPU: 2 nodes are in another pool, 1 node has taints the job does not tolerate
        job 3: main/0→i1[0]
        job 4: pending: main: needs 1 whole GPU, 1 CPU: 3 nodes lack the selected labels
        usage:
          t1     cpu  0/64 gpus . . . . . . . .
          t2     cpu  1/64 gpus X . . . . . . .
          i1     cpu  1/64 gpus X . . . . . . .
    "#]]
    .assert_eq(&out);
}

#[test]
fn unhealthy_gpus_and_cordoned_nodes_take_no_new_work() {
    let out = support::run(
        "
        node n1 gpus=2*A100
        node n2 gpus=2*A100
        state n2 cordoned
        health n1 0 bad
        job 1 gpu=whole:1 cpu=1      # only n1's GPU 1 is usable
        job 2 gpu=whole:1 cpu=1      # nothing usable left
        health n1 0 good
        job 3 gpu=whole:1 cpu=1
        state n2 ready
        job 4 gpu=whole:2 cpu=1
        ",
    );
    expect![[r#"
        n2 is cordoned
        gpu 0 of n1 is bad
        job 1: main/0→n1[1]
        job 2: pending: main: needs 1 whole GPU, 1 CPU: 1 node is cordoned, 1 node has too few free GPUs in the requested sharing mode
        gpu 0 of n1 is good
        job 3: main/0→n1[0]
        n2 is ready
        job 4: main/0→n2[0,1]
        usage:
          n1     cpu  2/64 gpus X X
          n2     cpu  1/64 gpus X X
    "#]]
    .assert_eq(&out);
}

#[test]
fn best_fit_fills_the_tightest_gpu_and_node() {
    let out = support::run(
        "
        policy best-fit
        node big gpus=8*T4 cpu=96
        node small gpus=2*T4 cpu=32
        job 1 gpu=frac:600 cpu=2       # the smaller node leaves less over
        job 2 gpu=frac:300 cpu=2       # the GPU with 400 left, not an idle one
        job 3 gpu=whole:2 cpu=2        # small has only one idle GPU: big
        ",
    );
    expect![[r#"
        job 1: main/0→small[0]
        job 2: main/0→small[0]
        job 3: main/0→big[0,1]
        usage:
          big    cpu  2/96 gpus X X . . . . . .
          small  cpu  4/32 gpus f900 .
    "#]]
    .assert_eq(&out);
}

#[test]
fn block_topology_spans_racks_of_one_block() {
    let out = support::run(
        "
        node a1 gpus=8*H100 rack=ra block=b1
        node b1 gpus=8*H100 rack=rb block=b1
        node c1 gpus=8*H100 rack=rc block=b2
        job 1 gpu=whole:8 cpu=1 select=zone:none topology=block   # selects nothing: pending, says labels
        job 2 group=worker*3 gpu=whole:8 cpu=1 topology=block!    # 3 nodes but no block has 3
        job 3 group=worker*2 gpu=whole:8 cpu=1 topology=block!    # block b1: two racks
        ",
    );
    expect![[r#"
        job 1: pending: main: needs 8 whole GPUs on one node, 1 CPU: 3 nodes lack the selected labels
        job 2: pending: worker: needs 8 whole GPUs on one node, 1 CPU; the job's 3 tasks fit the cluster but no single block has room for all of them
        job 3: worker/0→a1[0,1,2,3,4,5,6,7] worker/1→b1[0,1,2,3,4,5,6,7]
        usage:
          a1     cpu  1/64 gpus X X X X X X X X
          b1     cpu  1/64 gpus X X X X X X X X
          c1     cpu  0/64 gpus . . . . . . . .
    "#]]
    .assert_eq(&out);
}

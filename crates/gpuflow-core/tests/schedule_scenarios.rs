//! Scheduling-cycle scenarios: fixture in, rendered plans out (see `support::sched`).

mod support;

use expect_test::expect;
use support::sched::run;

#[test]
fn quota_admits_within_guarantee_and_borrows_idle_guarantee() {
    let out = run("
        node n1 gpus=8*H100
        node n2 gpus=8*H100
        queue org H100=16
        queue team-a parent=org H100=8
        queue team-b parent=org H100=8,borrow=4
        job 1 queue=team-b gpu=whole:8 cpu=1
        job 2 queue=team-b gpu=whole:4 cpu=1     # borrows 4 of team-a's idle 8
        job 3 queue=team-b gpu=whole:4 cpu=1     # would pass the borrowing limit
        cycle 10
    ");
    expect![[r#"
        cycle t=10
          start job 1 on H100: n1[0,1,2,3,4,5,6,7]
          start job 2 on H100: n2[0,1,2,3]
          pending job 3 (#1 in queue, eta unknown): queue team-b would use 16 H100 GPUs, above its guarantee plus borrowing limit of 12
    "#]]
    .assert_eq(&out);
}

#[test]
fn lending_limit_keeps_part_of_an_idle_guarantee_for_its_owner() {
    let out = run("
        node n1 gpus=8*H100
        queue org H100=8
        queue team-a parent=org H100=4,lend=1     # keeps 3 for itself
        queue team-b parent=org H100=4
        job 1 queue=team-b gpu=whole:5 cpu=1      # 4 own + 1 lent
        job 2 queue=team-b gpu=whole:1 cpu=1      # team-a lends no more
        job 3 queue=team-a gpu=whole:3 cpu=1      # its reserved part is there
        cycle 10
    ");
    expect![[r#"
        cycle t=10
          start job 3 on H100: n1[0,1,2]
          start job 1 on H100: n1[3,4,5,6,7]
          pending job 2 (#1 in queue, eta unknown): needs 1 H100 GPUs of quota; org has 0 left to lend; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode
    "#]]
    .assert_eq(&out);
}

#[test]
fn caps_user_limits_held_and_draining_queues_block_with_reasons() {
    let out = run("
        node n1 gpus=8*H100
        queue org H100=8
        queue capped parent=org H100=2,cap=2
        queue limited parent=org H100=4 users=gpus:2,running:1
        queue held parent=org H100=1 state=held
        queue draining parent=org H100=1 state=draining
        job 1 queue=capped gpu=whole:3 cpu=1
        job 2 queue=limited user=ann gpu=whole:1 cpu=1
        job 3 queue=limited user=ann gpu=whole:1 cpu=1        # ann may run one job
        job 4 queue=limited user=bob gpu=whole:3 cpu=1        # bob may hold 2 GPUs
        job 5 queue=held gpu=whole:1 cpu=1
        job 6 queue=draining gpu=whole:1 cpu=1
        cycle 10
    ");
    expect![[r#"
        cycle t=10
          start job 2 on H100: n1[0]
          pending job 1 (#1 in queue, eta unknown): queue capped would use 3 H100 GPUs, above its cap of 2
          pending job 3 (#1 in queue, eta unknown): user ann runs 1 jobs of a 1 job limit in this queue
          pending job 4 (#2 in queue, eta unknown): user bob holds 0 GPUs of a 2 GPU limit in this queue
          pending job 5 (#1 in queue, eta unknown): queue held is held: it accepts work but starts none
          pending job 6 (#1 in queue, eta unknown): queue draining is draining
    "#]]
    .assert_eq(&out);
}

#[test]
fn budgets_taper_weight_then_stop_borrowing_or_admitting() {
    let out = run("
        node n1 gpus=8*H100
        queue org H100=8
        queue spent parent=org H100=2 budget=100,used=120
        queue frozen parent=org H100=2 budget=100,used=100,stop-admitting
        queue other parent=org H100=4
        job 1 queue=spent gpu=whole:2 cpu=1      # within its guarantee: starts
        job 2 queue=spent gpu=whole:1 cpu=1      # would borrow: budget says no
        job 3 queue=frozen gpu=whole:1 cpu=1     # starts nothing
        cycle 10
    ");
    expect![[r#"
        cycle t=10
          start job 1 on H100: n1[0,1]
          pending job 2 (#1 in queue, eta unknown): queue spent's GPU-hour budget is used up: it may not borrow
          pending job 3 (#1 in queue, eta unknown): queue frozen's GPU-hour budget is used up: it starts no new work
    "#]]
    .assert_eq(&out);
}

#[test]
fn a_queue_below_its_guarantee_reclaims_borrowed_capacity_without_pushing_the_borrower_below_its_own()
 {
    let out = run("
        node n1 gpus=8*H100
        queue org H100=8
        queue team-a parent=org H100=4
        queue team-b parent=org H100=4
        run 10 queue=team-b class=batch gpu=whole:4 cpu=1 started=0      # within team-b's guarantee
        run 11 queue=team-b class=batch gpu=whole:2 cpu=1 started=0 checkpoint=900
        run 12 queue=team-b class=batch gpu=whole:2 cpu=1 started=0 checkpoint=500
        job 1 queue=team-a class=training gpu=whole:2 cpu=1
        cycle 1000
        cycle 1001
    ");
    expect![[r#"
        cycle t=1000
          preempt job 11 for job 1 (Reclaim): signal now, kill at t=1030, loses 0.06 GPU-h
          nominate n1 for job 1 from t=1030
          pending job 1 (#1 in queue, eta t=1030): waiting for 1 preempted job(s) to stop
        cycle t=1001
          start job 1 on H100: n1[4,5]
          pending job 11 (#1 in queue, eta unknown): needs 2 H100 GPUs of quota; org has 0 left to lend; on H100: main: needs 2 whole GPUs (H100) on one node, 1 CPU: 1 node has too few free GPUs in the requested sharing mode
    "#]]
    .assert_eq(&out);
}

#[test]
fn within_a_queue_only_strictly_lower_priority_is_preempted_and_inference_never() {
    let out = run("
        node n1 gpus=4*H100
        queue org H100=4
        queue team parent=org H100=4
        run 10 queue=team class=inference gpu=whole:1 cpu=1
        run 11 queue=team class=training prio=5 gpu=whole:1 cpu=1
        run 12 queue=team class=batch gpu=whole:1 cpu=1
        run 13 queue=team class=training prio=0 gpu=whole:1 cpu=1
        job 1 queue=team class=training prio=5 gpu=whole:2 cpu=1     # may take 12 (batch) and 13 (lower prio)
        job 2 queue=team class=batch gpu=whole:1 cpu=1               # preempts nobody: nothing is lower
        cycle 1000
        cycle 1001
    ");
    expect![[r#"
        cycle t=1000
          preempt job 12 for job 1 (Priority): signal now, kill at t=1030, loses 0.28 GPU-h
          preempt job 13 for job 1 (Priority): signal now, kill at t=1030, loses 0.28 GPU-h
          nominate n1 for job 1 from t=1030
          pending job 1 (#1 in queue, eta t=1030): waiting for 2 preempted job(s) to stop
          pending job 2 (#2 in queue, eta unknown): needs 1 H100 GPUs of quota; org has 0 left to lend; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode
        cycle t=1001
          start job 1 on H100: n1[2,3]
          pending job 2 (#1 in queue, eta unknown): needs 1 H100 GPUs of quota; org has 0 left to lend; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode
          pending job 12 (#2 in queue, eta unknown): needs 1 H100 GPUs of quota; org has 0 left to lend; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode
          pending job 13 (#3 in queue, eta unknown): needs 1 H100 GPUs of quota; org has 0 left to lend; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode
    "#]]
    .assert_eq(&out);
}

#[test]
fn preemption_respects_min_runtime_and_the_disruption_budget() {
    // b borrows both GPUs; a reclaims them (a queue's own priority
    // preemptions are not budgeted, its reclaims by others are).
    let out = run("
        config min_runtime=600 budget=1 max_unsaved=none underserved_pass=0
        node n1 gpus=2*H100
        queue a H100=2
        queue b H100=0
        run 10 queue=b class=batch gpu=whole:1 cpu=1 started=900        # too young at t=1000
        run 11 queue=b class=batch gpu=whole:1 cpu=1 started=0          # 0.28 GPU-h lost at t=1000
        job 1 queue=a class=training gpu=whole:1 cpu=1
        job 2 queue=a class=training gpu=whole:1 cpu=1
        cycle 1000
        cycle 5000      # 10 would lose 1.14 GPU-h, more than the budget
    ");
    expect![[r#"
        cycle t=1000
          preempt job 11 for job 1 (Reclaim): signal now, kill at t=1030, loses 0.28 GPU-h
          hold n1 for job 2 from t=1500
          nominate n1 for job 1 from t=1030
          pending job 1 (#1 in queue, eta t=1030): waiting for 1 preempted job(s) to stop
          pending job 2 (#2 in queue, eta t=1500): within queue a's guarantee of 2 H100 GPUs (it would hold 1), but other queues hold that capacity on loan: it is taken back as borrowed jobs pass their minimum runtime, and leases their term; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode
        cycle t=5000
          start job 1 on H100: n1[1]
          hold n1 for job 2 from t=5000
          pending job 2 (#1 in queue, eta t=5000): within queue a's guarantee of 2 H100 GPUs (it would hold 2), but other queues hold that capacity on loan: it is taken back as borrowed jobs pass their minimum runtime, and leases their term; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode; preempting would pass queue b's disruption budget: 0.00 of 1.00 GPU-hours already lost in the window
          pending job 11 (#1 in queue, eta unknown): needs 1 H100 GPUs of quota; the cluster has 0 left to lend; the free GPUs that would hold it are kept from new borrowing for job 2, within its queue's guarantee, which takes back the borrowed GPUs beside them from t=5000s; this job would borrow and not end before
    "#]]
    .assert_eq(&out);
}

#[test]
fn inference_must_fit_its_guarantee() {
    let out = run("
        config lease=none
        node n1 gpus=8*H100
        queue org H100=8
        queue svc parent=org H100=2
        queue other parent=org H100=6
        job 1 queue=svc class=inference gpu=whole:2 cpu=1
        job 2 queue=svc class=inference gpu=whole:1 cpu=1    # would borrow: not for inference
        cycle 10
    ");
    expect![[r#"
        cycle t=10
          start job 1 on H100: n1[0,1]
          pending job 2 (#1 in queue, eta unknown): inference jobs must fit the guaranteed H100 quota: jobs that may not borrow would hold 3 of 2 GPUs
    "#]]
    .assert_eq(&out);
}

#[test]
fn backfill_lets_short_jobs_run_before_a_reservation_but_never_delays_it() {
    let out = run("
        config preemption=off quotas=off
        node n1 gpus=8*H100
        node n2 gpus=8*H100
        queue org H100=16
        queue team parent=org H100=16
        run 10 queue=team class=training gpu=whole:4 cpu=1 started=0 runtime=2000
        run 11 queue=team class=training gpu=whole:4 cpu=1 started=0 runtime=5000
        run 12 queue=team class=training gpu=whole:4 cpu=1 started=0 runtime=8000
        job 1 queue=team class=training prio=9 gpu=whole:8 cpu=1 runtime=3600   # needs a whole node: reserved
        job 2 queue=team class=batch gpu=whole:4 cpu=1 runtime=500              # ends before: backfills
        job 3 queue=team class=batch gpu=whole:4 cpu=1 runtime=9000             # would delay job 1
        job 4 queue=team class=batch gpu=whole:4 cpu=1                          # no max runtime: may not use it
        cycle 1000
    ");
    expect![[r#"
        cycle t=1000
          start job 2 on H100: n2[4,5,6,7]
          reserve n1 for job 1 from t=5000
          reserve n2 for job 3 from t=8000
          pending job 1 (#1 in queue, eta t=5000): on H100: main: needs 8 whole GPUs (H100) on one node, 1 CPU: 2 nodes have too few free GPUs in the requested sharing mode
          pending job 3 (#2 in queue, eta t=8000): capacity is reserved for job 1 from t=5000s and this job would not end before
          pending job 4 (#3 in queue, eta t=8000): capacity is reserved for job 1 from t=5000s and this job would not end before
    "#]]
    .assert_eq(&out);
}

/// Several reservations a cycle (Slurm's `bf_max_job_test`): each blocked
/// gang, in order, holds the nodes where it could start earliest, on nodes
/// the ones before it did not take; a job that would still run when the
/// first starts keeps off all of them.
#[test]
fn several_gangs_hold_reservations_in_order_and_backfill_respects_them_all() {
    let out = run("
        config preemption=off quotas=off reservations=2
        node n1 gpus=8*H100
        node n2 gpus=8*H100
        node n3 gpus=8*H100
        queue org H100=24
        queue team parent=org H100=24
        run 10 queue=team class=training gpu=whole:4 cpu=1 started=0 runtime=2000
        run 11 queue=team class=training gpu=whole:4 cpu=1 started=0 runtime=5000
        run 12 queue=team class=training gpu=whole:4 cpu=1 started=0 runtime=8000
        run 13 queue=team class=training gpu=whole:8 cpu=1 started=0 runtime=12000
        job 1 queue=team class=training prio=9 gpu=whole:8 cpu=1 runtime=3600   # first gang: n1 at t=5000
        job 2 queue=team class=training prio=8 gpu=whole:8 cpu=1 runtime=3600   # second gang: another node
        job 3 queue=team class=batch gpu=whole:4 cpu=1 runtime=500              # ends before both: backfills
        job 4 queue=team class=batch gpu=whole:4 cpu=1 runtime=9000             # would delay them
        cycle 1000
    ");
    expect![[r#"
        cycle t=1000
          start job 3 on H100: n2[4,5,6,7]
          reserve n1 for job 1 from t=5000
          reserve n2 for job 2 from t=8000
          pending job 1 (#1 in queue, eta t=5000): on H100: main: needs 8 whole GPUs (H100) on one node, 1 CPU: 3 nodes have too few free GPUs in the requested sharing mode
          pending job 2 (#2 in queue, eta t=8000): on H100: main: needs 8 whole GPUs (H100) on one node, 1 CPU: 3 nodes have too few free GPUs in the requested sharing mode
          pending job 4 (#3 in queue, eta t=8600): capacity is reserved for job 1 from t=5000s and this job would not end before
    "#]]
    .assert_eq(&out);
}

/// `backfill_per_node`: backfill plans each reserved node on its own, as
/// Slurm's does: a job that would still run when the first reservation
/// starts may use the nodes of a later one that it ends before. Off (the
/// default), it keeps off every reserved node.
#[test]
fn backfill_may_use_a_later_reservations_node_that_it_ends_before() {
    let fixture = |per_node: &str| {
        run(&format!(
            "
        config preemption=off quotas=off reservations=2 backfill_per_node={per_node}
        node n1 gpus=8*H100 pool=a
        node n2 gpus=8*H100 pool=b
        queue org H100=16
        queue team parent=org H100=16
        run 10 queue=team class=training gpu=whole:4 cpu=1 started=0 runtime=5000 pool=a
        run 11 queue=team class=training gpu=whole:4 cpu=1 started=0 runtime=8000 pool=b
        job 1 queue=team class=training prio=9 gpu=whole:8 cpu=1 runtime=3600   # n1 from t=5000
        job 2 queue=team class=training prio=8 gpu=whole:8 cpu=1 runtime=3600   # n2 from t=8000
        job 3 queue=team class=batch gpu=whole:4 cpu=1 runtime=5000             # ends at 6000: n2 only
        job 4 queue=team class=batch gpu=whole:4 cpu=1 runtime=9000             # ends after both
        cycle 1000
    "
        ))
    };
    expect![[r#"
        cycle t=1000
          reserve n1 for job 1 from t=5000
          reserve n2 for job 2 from t=8000
          pending job 1 (#1 in queue, eta t=5000): on H100: main: needs 8 whole GPUs (H100) on one node, 1 CPU: 2 nodes have too few free GPUs in the requested sharing mode
          pending job 2 (#2 in queue, eta t=8000): on H100: main: needs 8 whole GPUs (H100) on one node, 1 CPU: 2 nodes have too few free GPUs in the requested sharing mode
          pending job 3 (#3 in queue, eta t=8600): capacity is reserved for job 1 from t=5000s and this job would not end before
          pending job 4 (#4 in queue, eta t=8600): capacity is reserved for job 1 from t=5000s and this job would not end before
    "#]]
    .assert_eq(&fixture("off"));
    expect![[r#"
        cycle t=1000
          start job 3 on H100: n2[4,5,6,7]
          reserve n1 for job 1 from t=5000
          reserve n2 for job 2 from t=8000
          pending job 1 (#1 in queue, eta t=5000): on H100: main: needs 8 whole GPUs (H100) on one node, 1 CPU: 2 nodes have too few free GPUs in the requested sharing mode
          pending job 2 (#2 in queue, eta t=8000): on H100: main: needs 8 whole GPUs (H100) on one node, 1 CPU: 2 nodes have too few free GPUs in the requested sharing mode
          pending job 4 (#3 in queue, eta t=8600): capacity is reserved for job 1 from t=5000s and this job would not end before
    "#]]
    .assert_eq(&fixture("on"));
}

#[test]
fn fifo_blocks_at_the_head_and_fair_share_serves_the_lighter_team_first() {
    let fifo = run("
        config ordering=fifo backfill=off preemption=off quotas=off
        node n1 gpus=4*H100
        queue a H100=2
        queue b H100=2
        run 10 queue=a gpu=whole:2 cpu=1
        job 1 queue=a submit=1 gpu=whole:4 cpu=1
        job 2 queue=b submit=2 gpu=whole:1 cpu=1
        cycle 10
    ");
    expect![[r#"
        cycle t=10
          pending job 1 (#1 in queue, eta unknown): on H100: main: needs 4 whole GPUs (H100) on one node, 1 CPU: 1 node has too few free GPUs in the requested sharing mode
          pending job 2 (#1 in queue, eta t=10): not reached this cycle: 1 job(s) ahead were tried first
    "#]]
    .assert_eq(&fifo);
    let fair = run("
        node n1 gpus=4*H100
        queue a H100=2,borrow=2
        queue b H100=2,borrow=2
        run 10 queue=a class=batch gpu=whole:2 cpu=1
        job 1 queue=a submit=1 class=batch gpu=whole:1 cpu=1
        job 2 queue=b submit=2 class=batch gpu=whole:1 cpu=1
        job 3 queue=b submit=3 class=batch gpu=whole:1 cpu=1
        cycle 10
    ");
    expect![[r#"
        cycle t=10
          start job 2 on H100: n1[2]
          start job 3 on H100: n1[3]
          pending job 1 (#1 in queue, eta unknown): needs 1 H100 GPUs of quota; the cluster has 0 left to lend; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode
    "#]]
    .assert_eq(&fair);
}

#[test]
fn aging_lets_old_work_overtake_higher_priority_newcomers() {
    let aged = run("
        config aging=600 preemption=off
        node n1 gpus=1*H100
        queue q H100=1
        job 1 queue=q class=batch prio=0 submit=0 gpu=whole:1 cpu=1
        job 2 queue=q class=batch prio=2 submit=5400 gpu=whole:1 cpu=1
        cycle 6000                                   # job 1: 0 + 10 steps; job 2: 2 + 1
    ");
    expect![[r#"
        cycle t=6000
          start job 1 on H100: n1[0]
          pending job 2 (#1 in queue, eta unknown): needs 1 H100 GPUs of quota; the cluster has 0 left to lend; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode
    "#]]
    .assert_eq(&aged);
    let unaged = run("
        config aging=0 preemption=off
        node n1 gpus=1*H100
        queue q H100=1
        job 1 queue=q class=batch prio=0 submit=0 gpu=whole:1 cpu=1
        job 2 queue=q class=batch prio=2 submit=5400 gpu=whole:1 cpu=1
        cycle 6000
    ");
    expect![[r#"
        cycle t=6000
          start job 2 on H100: n1[0]
          pending job 1 (#1 in queue, eta unknown): needs 1 H100 GPUs of quota; the cluster has 0 left to lend; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode
    "#]]
    .assert_eq(&unaged);
}

#[test]
fn decayed_history_favours_the_queue_that_used_less_lately() {
    let out = run("
        config preemption=off history=0.5
        node n1 gpus=4*H100
        queue a H100=2,borrow=2
        queue b H100=2,borrow=2
        run 10 queue=a class=batch gpu=whole:4 cpu=1 started=0
        cycle 0
        cycle 3600                                   # team a ran 4 GPUs for an hour
        finish 10
        job 1 queue=a submit=3600 class=batch gpu=whole:4 cpu=1
        job 2 queue=b submit=3601 class=batch gpu=whole:4 cpu=1
        cycle 3660
    ");
    expect![[r#"
        cycle t=0
        cycle t=3600
        finish job 10
        cycle t=3660
          start job 2 on H100: n1[0,1,2,3]
          pending job 1 (#1 in queue, eta unknown): needs 4 H100 GPUs of quota; the cluster has 0 left to lend; on H100: main: needs 4 whole GPUs (H100) on one node, 1 CPU: 1 node has too few free GPUs in the requested sharing mode
    "#]]
    .assert_eq(&out);
}

#[test]
fn fair_share_applies_at_every_level_of_the_tree() {
    let out = run("
        config preemption=off
        node n1 gpus=8*H100
        queue org H100=8
        queue dept-x parent=org H100=4,borrow=4
        queue dept-y parent=org H100=4,borrow=4
        queue x1 parent=dept-x H100=2,borrow=6
        queue x2 parent=dept-x H100=2,borrow=6
        queue y1 parent=dept-y H100=4,borrow=4
        run 10 queue=x1 class=batch gpu=whole:4 cpu=1
        job 1 queue=x2 submit=1 class=batch gpu=whole:1 cpu=1    # x2 is idle, but dept-x is not
        job 2 queue=y1 submit=2 class=batch gpu=whole:1 cpu=1
        job 3 queue=y1 submit=3 class=batch gpu=whole:1 cpu=1
        job 4 queue=y1 submit=4 class=batch gpu=whole:1 cpu=1
        cycle 10
    ");
    expect![[r#"
        cycle t=10
          start job 2 on H100: n1[4]
          start job 3 on H100: n1[5]
          start job 4 on H100: n1[6]
          start job 1 on H100: n1[7]
    "#]]
    .assert_eq(&out);
}

#[test]
fn two_reclaimers_in_one_cycle_never_take_a_borrower_below_its_guarantee_together() {
    let out = run("
        node n1 gpus=6*H100
        queue org H100=6
        queue a parent=org H100=2
        queue b parent=org H100=2
        queue c parent=org H100=2
        run 10 queue=b class=batch gpu=whole:2 cpu=1       # b borrows 2
        run 11 queue=b class=batch gpu=whole:2 cpu=1
        run 12 queue=a class=training gpu=whole:1 cpu=1
        run 13 queue=c class=training gpu=whole:1 cpu=1
        job 1 queue=a class=training gpu=whole:1 cpu=1     # within a's guarantee: reclaims one of b's jobs
        job 2 queue=c class=training gpu=whole:1 cpu=1     # so would c, but b must keep its 2
        cycle 1000
    ");
    expect![[r#"
        cycle t=1000
          preempt job 10 for job 1 (Reclaim): signal now, kill at t=1030, loses 0.56 GPU-h
          hold n1 for job 2 from t=1000
          nominate n1 for job 1 from t=1030
          pending job 1 (#1 in queue, eta t=1030): waiting for 1 preempted job(s) to stop
          pending job 2 (#1 in queue, eta t=1000): within queue c's guarantee of 2 H100 GPUs (it would hold 2), but other queues hold that capacity on loan: it is taken back as borrowed jobs pass their minimum runtime, and leases their term; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode
    "#]]
    .assert_eq(&out);
}

#[test]
fn a_spent_budget_tapers_the_queue_weight_in_fair_share() {
    let out = run("
        config preemption=off
        node n1 gpus=3*H100
        queue a H100=1,borrow=2 budget=100,used=90     # 90 % used: weight × 0.4
        queue b H100=1,borrow=2
        run 10 queue=a class=batch gpu=whole:1 cpu=1
        run 11 queue=b class=batch gpu=whole:1 cpu=1
        job 1 queue=a submit=1 class=batch gpu=whole:1 cpu=1
        job 2 queue=b submit=2 class=batch gpu=whole:1 cpu=1
        cycle 10                                       # one GPU free: b goes first
    ");
    expect![[r#"
        cycle t=10
          start job 2 on H100: n1[1]
          pending job 1 (#1 in queue, eta unknown): needs 1 H100 GPUs of quota; the cluster has 0 left to lend; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode
    "#]]
    .assert_eq(&out);
}

#[test]
fn the_disruption_budget_caps_work_lost_per_window() {
    let out = run("
        config min_runtime=0 budget=0.5 window=600 underserved_pass=0
        node n1 gpus=2*H100
        queue a H100=2
        queue b H100=0
        run 10 queue=b class=batch gpu=whole:1 cpu=1 started=0
        run 11 queue=b class=batch gpu=whole:1 cpu=1 started=0
        job 1 queue=a class=training gpu=whole:1 cpu=1
        job 2 queue=a class=training gpu=whole:1 cpu=1
        cycle 1000      # 10 reclaimed: 0.28 of b's 0.5 GPU-h budget
        cycle 1001      # 11 would lose 0.28 more within the window: over budget
        cycle 1700      # the first loss left the window; 11 loses 0.47 alone
    ");
    expect![[r#"
        cycle t=1000
          preempt job 10 for job 1 (Reclaim): signal now, kill at t=1030, loses 0.28 GPU-h
          hold n1 for job 2 from t=1000
          nominate n1 for job 1 from t=1030
          pending job 1 (#1 in queue, eta t=1030): waiting for 1 preempted job(s) to stop
          pending job 2 (#2 in queue, eta t=1000): within queue a's guarantee of 2 H100 GPUs (it would hold 1), but other queues hold that capacity on loan: it is taken back as borrowed jobs pass their minimum runtime, and leases their term; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode
        cycle t=1001
          start job 1 on H100: n1[0]
          hold n1 for job 2 from t=1001
          pending job 2 (#1 in queue, eta t=1001): within queue a's guarantee of 2 H100 GPUs (it would hold 2), but other queues hold that capacity on loan: it is taken back as borrowed jobs pass their minimum runtime, and leases their term; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode; preempting would pass queue b's disruption budget: 0.28 of 0.50 GPU-hours already lost in the window
          pending job 10 (#1 in queue, eta unknown): needs 1 H100 GPUs of quota; the cluster has 0 left to lend; the free GPUs that would hold it are kept from new borrowing for job 2, within its queue's guarantee, which takes back the borrowed GPUs beside them from t=1001s; this job would borrow and not end before
        cycle t=1700
          preempt job 11 for job 2 (Reclaim): signal now, kill at t=1730, loses 0.47 GPU-h
          nominate n1 for job 2 from t=1730
          pending job 2 (#1 in queue, eta t=1730): waiting for 1 preempted job(s) to stop
          pending job 10 (#1 in queue, eta unknown): needs 1 H100 GPUs of quota; the cluster has 0 left to lend; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode
    "#]]
    .assert_eq(&out);
}

#[test]
fn the_disruption_budget_caps_jobs_stopped_per_window() {
    // Young borrowers lose little work, so a budget of GPU-hours alone
    // would let a queue lose any number of them at once; the count stops
    // that, and the rest wait for the window to move on.
    let out = run("
        config min_runtime=0 budget=none max_jobs=2 window=600 underserved_pass=0 holds=off
        node n1 gpus=4*H100
        queue a H100=1
        queue c H100=1
        queue d H100=1
        queue b H100=0
        run 10 queue=b class=batch gpu=whole:1 cpu=1 started=990
        run 11 queue=b class=batch gpu=whole:1 cpu=1 started=990
        run 12 queue=b class=batch gpu=whole:1 cpu=1 started=990
        run 13 queue=b class=batch gpu=whole:1 cpu=1 started=990
        job 1 queue=a class=training gpu=whole:1 cpu=1
        job 2 queue=c class=training gpu=whole:1 cpu=1
        job 3 queue=d class=training gpu=whole:1 cpu=1
        cycle 1000      # two of b's jobs reclaimed: its count for the window
        cycle 1100      # job 3 waits for the window
        cycle 1700      # the first two left the window
    ");
    expect![[r#"
        cycle t=1000
          preempt job 10 for job 1 (Reclaim): signal now, kill at t=1030, loses 0.00 GPU-h
          preempt job 11 for job 2 (Reclaim): signal now, kill at t=1030, loses 0.00 GPU-h
          nominate n1 for job 1 from t=1030
          nominate n1 for job 2 from t=1030
          pending job 1 (#1 in queue, eta t=1030): waiting for 1 preempted job(s) to stop
          pending job 2 (#1 in queue, eta t=1030): waiting for 1 preempted job(s) to stop
          pending job 3 (#1 in queue, eta unknown): within queue d's guarantee of 1 H100 GPUs (it would hold 1), but other queues hold that capacity on loan: it is taken back as borrowed jobs pass their minimum runtime, and leases their term; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode; preempting would pass queue b's disruption budget: 2 of at most 2 of its jobs already preempted in the window
        cycle t=1100
          start job 1 on H100: n1[0]
          start job 2 on H100: n1[1]
          pending job 3 (#1 in queue, eta unknown): within queue d's guarantee of 1 H100 GPUs (it would hold 1), but other queues hold that capacity on loan: it is taken back as borrowed jobs pass their minimum runtime, and leases their term; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode; preempting would pass queue b's disruption budget: 2 of at most 2 of its jobs already preempted in the window
          pending job 10 (#1 in queue, eta unknown): needs 1 H100 GPUs of quota; the cluster has 0 left to lend; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode
          pending job 11 (#2 in queue, eta unknown): needs 1 H100 GPUs of quota; the cluster has 0 left to lend; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode
        cycle t=1700
          preempt job 12 for job 3 (Reclaim): signal now, kill at t=1730, loses 0.20 GPU-h
          nominate n1 for job 3 from t=1730
          pending job 3 (#1 in queue, eta t=1730): waiting for 1 preempted job(s) to stop
          pending job 10 (#1 in queue, eta unknown): needs 1 H100 GPUs of quota; the cluster has 0 left to lend; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode
          pending job 11 (#2 in queue, eta unknown): needs 1 H100 GPUs of quota; the cluster has 0 left to lend; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode
    "#]]
    .assert_eq(&out);
}

#[test]
fn a_queues_own_priority_preemptions_are_not_budgeted() {
    // The budget paces what other queues take back; a queue's training job
    // still preempts its own batch job, whatever that loses.
    let out = run("
        config min_runtime=0 budget=0.1 max_unsaved=none
        node n1 gpus=1*H100
        queue q H100=1
        run 10 queue=q class=batch gpu=whole:1 cpu=1 started=0
        job 1 queue=q class=training gpu=whole:1 cpu=1
        cycle 1000
    ");
    expect![[r#"
        cycle t=1000
          preempt job 10 for job 1 (Priority): signal now, kill at t=1030, loses 0.28 GPU-h
          nominate n1 for job 1 from t=1030
          pending job 1 (#1 in queue, eta t=1030): waiting for 1 preempted job(s) to stop
    "#]]
    .assert_eq(&out);
}

/// Queues a and b guaranteed a GPU each, c borrowing both for two batch
/// jobs started at 0, a budget of 0.1 GPU-h with `config`, the `usage`
/// lines, and one job each of a (`class`) and b (training) at t=1000.
fn borrowed_pair(config: &str, usage: &str, class: &str) -> String {
    format!(
        "
        config min_runtime=0 budget=0.1 max_unsaved=none patience=0 {config}
        node n1 gpus=2*H100
        queue a H100=1
        queue b H100=1
        queue c H100=0
        {usage}
        run 10 queue=c class=batch gpu=whole:1 cpu=1 started=0
        run 11 queue=c class=batch gpu=whole:1 cpu=1 started=0
        job 1 queue=a class={class} gpu=whole:1 cpu=1
        job 2 queue=b class=training gpu=whole:1 cpu=1
        cycle 1000
        "
    )
}

#[test]
fn protected_classes_reclaim_past_the_disruption_budget() {
    // Queue c borrows both GPUs; its budget (0.1 GPU-h) is smaller than
    // either job's loss. A notebook of a, within a's guarantee, reclaims
    // anyway; a training job of b, within b's guarantee too, is held to the
    // budget and waits. With the rule off, both are held.
    let script = |rule: &str| {
        borrowed_pair(
            &format!("protected_pass={rule} underserved_pass=0"),
            "",
            "notebook",
        )
    };
    expect![[r#"
        cycle t=1000
          preempt job 10 for job 1 (Reclaim): signal now, kill at t=1030, loses 0.28 GPU-h
          nominate n1 for job 1 from t=1030
          pending job 1 (#1 in queue, eta t=1030): waiting for 1 preempted job(s) to stop
          pending job 2 (#1 in queue, eta unknown): within queue b's guarantee of 1 H100 GPUs (it would hold 1), but other queues hold that capacity on loan: it is taken back as borrowed jobs pass their minimum runtime, and leases their term; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode; preempting would pass queue c's disruption budget: 0.28 of 0.10 GPU-hours already lost in the window
    "#]]
    .assert_eq(&run(&script("on")));
    expect![[r#"
        cycle t=1000
          pending job 1 (#1 in queue, eta unknown): within queue a's guarantee of 1 H100 GPUs (it would hold 1), but other queues hold that capacity on loan: it is taken back as borrowed jobs pass their minimum runtime, and leases their term; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode; preempting would pass queue c's disruption budget: 0.00 of 0.10 GPU-hours already lost in the window
          pending job 2 (#1 in queue, eta unknown): within queue b's guarantee of 1 H100 GPUs (it would hold 1), but other queues hold that capacity on loan: it is taken back as borrowed jobs pass their minimum runtime, and leases their term; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode; preempting would pass queue c's disruption budget: 0.00 of 0.10 GPU-hours already lost in the window
    "#]]
    .assert_eq(&run(&script("off")));
}

#[test]
fn a_job_that_passes_budgets_waits_its_patience_first() {
    // Queue c borrows both GPUs; its budget (0.1 GPU-h) is smaller than
    // either job's loss. The notebook of a (a protected class) and the
    // training job of b (below its share) would pass it, but bind
    // themselves to it until they have waited the patience (an hour from
    // their submission at t=0): at t=1000 both wait, say until when, and
    // are told they start when the patience ends and their victims' grace
    // runs out; at t=3600 both reclaim.
    let out = run(&borrowed_pair(
        "patience=3600 underserved_pass=1.0",
        "usage a 10\nusage b 1\nusage c 10",
        "notebook",
    )
    .replace("cycle 1000", "cycle 1000\ncycle 3599\ncycle 3600"));
    expect![[r#"
        cycle t=1000
          pending job 1 (#1 in queue, eta t=3630): within queue a's guarantee of 1 H100 GPUs (it would hold 1), but other queues hold that capacity on loan: it is taken back as borrowed jobs pass their minimum runtime, and leases their term; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode; preempting would pass queue c's disruption budget: 0.00 of 0.10 GPU-hours already lost in the window; it preempts past disruption budgets once it has waited 60 min, from t=3600s
          pending job 2 (#1 in queue, eta t=3630): within queue b's guarantee of 1 H100 GPUs (it would hold 1), but other queues hold that capacity on loan: it is taken back as borrowed jobs pass their minimum runtime, and leases their term; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode; preempting would pass queue c's disruption budget: 0.00 of 0.10 GPU-hours already lost in the window; it preempts past disruption budgets once it has waited 60 min, from t=3600s
        cycle t=3599
          pending job 1 (#1 in queue, eta t=3630): within queue a's guarantee of 1 H100 GPUs (it would hold 1), but other queues hold that capacity on loan: it is taken back as borrowed jobs pass their minimum runtime, and leases their term; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode; preempting would pass queue c's disruption budget: 0.00 of 0.10 GPU-hours already lost in the window; it preempts past disruption budgets once it has waited 60 min, from t=3600s
          pending job 2 (#1 in queue, eta t=3630): within queue b's guarantee of 1 H100 GPUs (it would hold 1), but other queues hold that capacity on loan: it is taken back as borrowed jobs pass their minimum runtime, and leases their term; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode; preempting would pass queue c's disruption budget: 0.00 of 0.10 GPU-hours already lost in the window; it preempts past disruption budgets once it has waited 60 min, from t=3600s
        cycle t=3600
          preempt job 10 for job 2 (Reclaim): signal now, kill at t=3630, loses 1.00 GPU-h
          preempt job 11 for job 1 (Reclaim): signal now, kill at t=3630, loses 1.00 GPU-h
          nominate n1 for job 2 from t=3630
          nominate n1 for job 1 from t=3630
          pending job 1 (#1 in queue, eta t=3630): waiting for 1 preempted job(s) to stop
          pending job 2 (#1 in queue, eta t=3630): waiting for 1 preempted job(s) to stop
    "#]]
    .assert_eq(&out);
}

#[test]
fn a_patient_jobs_estimate_is_the_end_of_its_patience_not_of_the_borrowers() {
    // As above, but c's borrowed jobs declare 20,000 s and a grace of 120 s:
    // GPUs would free at t=20000, but the notebook reclaims at t=3600
    // (once it has waited the patience), so it starts when c's jobs have
    // had their grace, at t=3720; before, its estimate said t=20000. b's
    // training job, paced by its large history, takes back its guarantee
    // as c's jobs end, at t=20000; before, "unknown" (it was counted as
    // held back by its own queue's quota, whose jobs free nothing).
    let out = run(&borrowed_pair(
        "patience=3600 underserved_pass=1.0",
        "usage a 10\nusage b 100\nusage c 10",
        "notebook",
    )
    .replace("started=0", "started=0 runtime=20000 grace=120")
    .replace("cycle 1000", "cycle 1000\ncycle 3600"));
    expect![[r#"
        cycle t=1000
          pending job 1 (#1 in queue, eta t=3720): within queue a's guarantee of 1 H100 GPUs (it would hold 1), but other queues hold that capacity on loan: it is taken back as borrowed jobs pass their minimum runtime, and leases their term; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode; preempting would pass queue c's disruption budget: 0.00 of 0.10 GPU-hours already lost in the window; it preempts past disruption budgets once it has waited 60 min, from t=3600s
          pending job 2 (#1 in queue, eta t=20000): within queue b's guarantee of 1 H100 GPUs (it would hold 1), but other queues hold that capacity on loan: it is taken back as borrowed jobs pass their minimum runtime, and leases their term; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode; reclaiming would take GPUs from queue c, which has had 0.26 of its share of recent GPU-hours against 2.49 for queue b: a reclaim never deepens that imbalance, so this job waits for GPUs to free
        cycle t=3600
          preempt job 10 for job 1 (Reclaim): signal now, kill at t=3720, loses 1.00 GPU-h
          nominate n1 for job 1 from t=3720
          pending job 1 (#1 in queue, eta t=3720): waiting for 1 preempted job(s) to stop
          pending job 2 (#1 in queue, eta t=20000): within queue b's guarantee of 1 H100 GPUs (it would hold 1), but other queues hold that capacity on loan: it is taken back as borrowed jobs pass their minimum runtime, and leases their term; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode; reclaiming would take GPUs from queue c, which has had 0.30 of its share of recent GPU-hours against 2.46 for queue b: a reclaim never deepens that imbalance, so this job waits for GPUs to free
    "#]]
    .assert_eq(&out);
}

#[test]
fn a_queue_below_its_share_of_the_history_reclaims_past_the_disruption_budget() {
    // Queue c borrows both GPUs; its budget (0.1 GPU-h) is smaller than
    // either job's loss. a has used a tenth of what b and c each have:
    // below its weighted share, its training job reclaims anyway; b, above
    // its share, is held to the budget. With the rule off, both are held.
    let script = |threshold: &str| {
        borrowed_pair(
            &format!("underserved_pass={threshold}"),
            "usage a 1\nusage b 10\nusage c 10",
            "training",
        )
    };
    expect![[r#"
        cycle t=1000
          preempt job 10 for job 1 (Reclaim): signal now, kill at t=1030, loses 0.28 GPU-h
          nominate n1 for job 1 from t=1030
          pending job 1 (#1 in queue, eta t=1030): waiting for 1 preempted job(s) to stop
          pending job 2 (#1 in queue, eta unknown): within queue b's guarantee of 1 H100 GPUs (it would hold 1), but other queues hold that capacity on loan: it is taken back as borrowed jobs pass their minimum runtime, and leases their term; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode; preempting would pass queue c's disruption budget: 0.28 of 0.10 GPU-hours already lost in the window
    "#]]
    .assert_eq(&run(&script("1.0")));
    expect![[r#"
        cycle t=1000
          pending job 1 (#1 in queue, eta unknown): within queue a's guarantee of 1 H100 GPUs (it would hold 1), but other queues hold that capacity on loan: it is taken back as borrowed jobs pass their minimum runtime, and leases their term; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode; preempting would pass queue c's disruption budget: 0.00 of 0.10 GPU-hours already lost in the window
          pending job 2 (#1 in queue, eta unknown): within queue b's guarantee of 1 H100 GPUs (it would hold 1), but other queues hold that capacity on loan: it is taken back as borrowed jobs pass their minimum runtime, and leases their term; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode; preempting would pass queue c's disruption budget: 0.00 of 0.10 GPU-hours already lost in the window
    "#]]
    .assert_eq(&run(&script("0")));
}

#[test]
fn a_job_whose_queues_reclaim_the_rules_refused_holds_no_nodes() {
    // Queue a has had ten times c's GPU-hours; c borrows 3 of the 4 GPUs.
    // a's two training jobs are within its guarantee and paced: the first
    // searches for victims and reclaim fairness refuses (c has had less).
    // The second does not search (one search a queue a cycle). It used to
    // hold n1 for a reclaim that would not come, "from now" every cycle,
    // so c's next job was kept off the GPU that is free. It holds nothing
    // now, and c's job starts on it.
    let script = |config: &str, c_usage: u32, class: &str| {
        format!(
            "
            config min_runtime=0 max_unsaved=none {config}
            node n1 gpus=4*H100
            queue a H100=3
            queue c H100=1
            usage a 10
            usage c {c_usage}
            run 10 queue=c class=batch gpu=whole:1 cpu=1 started=0
            run 11 queue=c class=batch gpu=whole:1 cpu=1 started=0
            run 12 queue=c class=batch gpu=whole:1 cpu=1 started=0
            job 1 queue=a class={class} gpu=whole:2 cpu=1
            job 2 queue=a class={class} gpu=whole:2 cpu=1
            cycle 1000
            job 20 queue=c class=batch gpu=whole:1 cpu=1 submit=1030
            cycle 1060
            "
        )
    };
    let out = run(&script("budget=none", 1, "training"));
    expect![[r#"
        cycle t=1000
          pending job 1 (#1 in queue, eta unknown): within queue a's guarantee of 3 H100 GPUs (it would hold 2), but other queues hold that capacity on loan: it is taken back as borrowed jobs pass their minimum runtime, and leases their term; on H100: main: needs 2 whole GPUs (H100) on one node, 1 CPU: 1 node has too few free GPUs in the requested sharing mode; reclaiming would take GPUs from queue c, which has had 0.31 of its share of recent GPU-hours against 1.69 for queue a: a reclaim never deepens that imbalance, so this job waits for GPUs to free
          pending job 2 (#2 in queue, eta unknown): within queue a's guarantee of 3 H100 GPUs (it would hold 2), but other queues hold that capacity on loan: it is taken back as borrowed jobs pass their minimum runtime, and leases their term; on H100: main: needs 2 whole GPUs (H100) on one node, 1 CPU: 1 node has too few free GPUs in the requested sharing mode; reclaiming would take GPUs from queue c, which has had 0.31 of its share of recent GPU-hours against 1.69 for queue a: a reclaim never deepens that imbalance, so this job waits for GPUs to free
        cycle t=1060
          start job 20 on H100: n1[3]
          pending job 1 (#1 in queue, eta unknown): within queue a's guarantee of 3 H100 GPUs (it would hold 2), but other queues hold that capacity on loan: it is taken back as borrowed jobs pass their minimum runtime, and leases their term; on H100: main: needs 2 whole GPUs (H100) on one node, 1 CPU: 1 node has too few free GPUs in the requested sharing mode; reclaiming would take GPUs from queue c, which has had 0.32 of its share of recent GPU-hours against 1.68 for queue a: a reclaim never deepens that imbalance, so this job waits for GPUs to free
          pending job 2 (#2 in queue, eta unknown): within queue a's guarantee of 3 H100 GPUs (it would hold 2), but other queues hold that capacity on loan: it is taken back as borrowed jobs pass their minimum runtime, and leases their term; on H100: main: needs 2 whole GPUs (H100) on one node, 1 CPU: 1 node has too few free GPUs in the requested sharing mode; reclaiming would take GPUs from queue c, which has had 0.32 of its share of recent GPU-hours against 1.68 for queue a: a reclaim never deepens that imbalance, so this job waits for GPUs to free
    "#]]
    .assert_eq(&out);
    // The same with a disruption budget that refuses (c has had as much as
    // a, so fairness allows): the second job holds nothing either.
    let out = run(&script("budget=0.1", 10, "training"));
    expect![[r#"
        cycle t=1000
          pending job 1 (#1 in queue, eta unknown): within queue a's guarantee of 3 H100 GPUs (it would hold 2), but other queues hold that capacity on loan: it is taken back as borrowed jobs pass their minimum runtime, and leases their term; on H100: main: needs 2 whole GPUs (H100) on one node, 1 CPU: 1 node has too few free GPUs in the requested sharing mode; preempting would pass queue c's disruption budget: 0.00 of 0.10 GPU-hours already lost in the window
          pending job 2 (#2 in queue, eta unknown): within queue a's guarantee of 3 H100 GPUs (it would hold 2), but other queues hold that capacity on loan: it is taken back as borrowed jobs pass their minimum runtime, and leases their term; on H100: main: needs 2 whole GPUs (H100) on one node, 1 CPU: 1 node has too few free GPUs in the requested sharing mode; preempting would pass queue c's disruption budget: 0.00 of 0.10 GPU-hours already lost in the window
        cycle t=1060
          start job 20 on H100: n1[3]
          pending job 1 (#1 in queue, eta unknown): within queue a's guarantee of 3 H100 GPUs (it would hold 2), but other queues hold that capacity on loan: it is taken back as borrowed jobs pass their minimum runtime, and leases their term; on H100: main: needs 2 whole GPUs (H100) on one node, 1 CPU: 1 node has too few free GPUs in the requested sharing mode; preempting would pass queue c's disruption budget: 0.00 of 0.10 GPU-hours already lost in the window
          pending job 2 (#2 in queue, eta unknown): within queue a's guarantee of 3 H100 GPUs (it would hold 2), but other queues hold that capacity on loan: it is taken back as borrowed jobs pass their minimum runtime, and leases their term; on H100: main: needs 2 whole GPUs (H100) on one node, 1 CPU: 1 node has too few free GPUs in the requested sharing mode; preempting would pass queue c's disruption budget: 0.00 of 0.10 GPU-hours already lost in the window
    "#]]
    .assert_eq(&out);
    // Notebooks are not paced: budgets bind their reclaims only until they
    // have waited their patience, when the reclaim comes. The second
    // notebook keeps its hold, and c's new job keeps off n1. It gives the
    // first one's reasons, and its estimate is the end of its patience
    // plus the victims' grace, as the first one's (it said "t=1000", the
    // start of its hold, before).
    let out = run(&script("budget=0.1 patience=3600", 10, "notebook"));
    expect![[r#"
        cycle t=1000
          hold n1 for job 2 from t=1000
          pending job 1 (#1 in queue, eta t=3630): within queue a's guarantee of 3 H100 GPUs (it would hold 2), but other queues hold that capacity on loan: it is taken back as borrowed jobs pass their minimum runtime, and leases their term; on H100: main: needs 2 whole GPUs (H100) on one node, 1 CPU: 1 node has too few free GPUs in the requested sharing mode; preempting would pass queue c's disruption budget: 0.00 of 0.10 GPU-hours already lost in the window; it preempts past disruption budgets once it has waited 60 min, from t=3600s
          pending job 2 (#2 in queue, eta t=3630): within queue a's guarantee of 3 H100 GPUs (it would hold 2), but other queues hold that capacity on loan: it is taken back as borrowed jobs pass their minimum runtime, and leases their term; on H100: main: needs 2 whole GPUs (H100) on one node, 1 CPU: 1 node has too few free GPUs in the requested sharing mode; preempting would pass queue c's disruption budget: 0.00 of 0.10 GPU-hours already lost in the window; it preempts past disruption budgets once it has waited 60 min, from t=3600s
        cycle t=1060
          hold n1 for job 2 from t=1060
          pending job 1 (#1 in queue, eta t=3630): within queue a's guarantee of 3 H100 GPUs (it would hold 2), but other queues hold that capacity on loan: it is taken back as borrowed jobs pass their minimum runtime, and leases their term; on H100: main: needs 2 whole GPUs (H100) on one node, 1 CPU: 1 node has too few free GPUs in the requested sharing mode; preempting would pass queue c's disruption budget: 0.00 of 0.10 GPU-hours already lost in the window; it preempts past disruption budgets once it has waited 60 min, from t=3600s
          pending job 2 (#2 in queue, eta t=3630): within queue a's guarantee of 3 H100 GPUs (it would hold 2), but other queues hold that capacity on loan: it is taken back as borrowed jobs pass their minimum runtime, and leases their term; on H100: main: needs 2 whole GPUs (H100) on one node, 1 CPU: 1 node has too few free GPUs in the requested sharing mode; preempting would pass queue c's disruption budget: 0.00 of 0.10 GPU-hours already lost in the window; it preempts past disruption budgets once it has waited 60 min, from t=3600s
          pending job 20 (#1 in queue, eta unknown): the free GPUs that would hold it are kept from new borrowing for job 2, within its queue's guarantee, which takes back the borrowed GPUs beside them from t=1060s; this job would borrow and not end before
    "#]]
    .assert_eq(&out);
}

#[test]
fn a_paced_reclaim_takes_only_from_queues_that_had_as_much() {
    // Queues a and b have had ten times c's GPU-hours; c borrows both GPUs.
    // a's training job is paced (a has had its share) and may not reclaim
    // from c, which has had less: it waits, and says why. b's notebook (a
    // protected class) reclaims anyway. When c has had as much as a, or
    // with the rule off, a reclaims too. No disruption budget: the rule
    // holds without one.
    let script = |rule: &str, c_usage: u32| {
        format!(
            "
            config min_runtime=0 budget=none max_unsaved=none restore_fairness={rule}
            node n1 gpus=2*H100
            queue a H100=1
            queue b H100=1
            queue c H100=0
            usage a 10
            usage b 10
            usage c {c_usage}
            run 10 queue=c class=batch gpu=whole:1 cpu=1 started=0
            run 11 queue=c class=batch gpu=whole:1 cpu=1 started=0
            job 1 queue=a class=training gpu=whole:1 cpu=1
            job 2 queue=b class=notebook gpu=whole:1 cpu=1
            cycle 1000
            "
        )
    };
    expect![[r#"
        cycle t=1000
          preempt job 10 for job 2 (Reclaim): signal now, kill at t=1030, loses 0.28 GPU-h
          nominate n1 for job 2 from t=1030
          pending job 1 (#1 in queue, eta unknown): within queue a's guarantee of 1 H100 GPUs (it would hold 1), but other queues hold that capacity on loan: it is taken back as borrowed jobs pass their minimum runtime, and leases their term; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode; reclaiming would take GPUs from queue c, which has had 0.22 of its share of recent GPU-hours against 1.39 for queue a: a reclaim never deepens that imbalance, so this job waits for GPUs to free
          pending job 2 (#1 in queue, eta t=1030): waiting for 1 preempted job(s) to stop
    "#]].assert_eq(&run(&script("on", 1)));
    // c has had as much as a, or the rule is off: both reclaim.
    let both = expect![[r#"
        cycle t=1000
          preempt job 10 for job 1 (Reclaim): signal now, kill at t=1030, loses 0.28 GPU-h
          preempt job 11 for job 2 (Reclaim): signal now, kill at t=1030, loses 0.28 GPU-h
          nominate n1 for job 1 from t=1030
          nominate n1 for job 2 from t=1030
          pending job 1 (#1 in queue, eta t=1030): waiting for 1 preempted job(s) to stop
          pending job 2 (#1 in queue, eta t=1030): waiting for 1 preempted job(s) to stop
    "#]];
    both.assert_eq(&run(&script("on", 10)));
    both.assert_eq(&run(&script("off", 1)));
}

#[test]
fn a_paced_reclaim_compares_shares_where_fair_share_divides_the_queues() {
    // Leaf a1 (under orgA) and leaf b1 (under orgB) are each all of their
    // org's usage, so each has had exactly its share within its org; orgA
    // has had ten times orgB's. a1's training job may not reclaim from b1:
    // the orgs, children of the top, are compared. With the orgs' usage
    // the other way round, it reclaims.
    let script = |a: u32, b: u32| {
        format!(
            "
            config min_runtime=0 budget=none max_unsaved=none
            node n1 gpus=2*H100
            queue orgA H100=2
            queue a1 parent=orgA H100=2
            queue orgB H100=0
            queue b1 parent=orgB H100=0
            usage orgA {a}
            usage a1 {a}
            usage orgB {b}
            usage b1 {b}
            run 10 queue=b1 class=batch gpu=whole:1 cpu=1 started=0
            run 11 queue=b1 class=batch gpu=whole:1 cpu=1 started=0
            job 1 queue=a1 class=training gpu=whole:1 cpu=1
            cycle 1000
            "
        )
    };
    expect![[r#"
        cycle t=1000
          pending job 1 (#1 in queue, eta unknown): within queue a1's guarantee of 2 H100 GPUs (it would hold 1), but other queues hold that capacity on loan: it is taken back as borrowed jobs pass their minimum runtime, and leases their term; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode; reclaiming would take GPUs from queue orgB, which has had 0.27 of its share of recent GPU-hours against 1.73 for queue orgA: a reclaim never deepens that imbalance, so this job waits for GPUs to free
    "#]].assert_eq(&run(&script(10, 1)));
    expect![[r#"
        cycle t=1000
          preempt job 10 for job 1 (Reclaim): signal now, kill at t=1030, loses 0.28 GPU-h
          nominate n1 for job 1 from t=1030
          pending job 1 (#1 in queue, eta t=1030): waiting for 1 preempted job(s) to stop
    "#]]
    .assert_eq(&run(&script(1, 10)));
}

#[test]
fn a_victim_search_checks_the_fit_after_its_last_candidate() {
    // Candidates in cost order: 10 and 11 (fresh checkpoints, on n2, where
    // nothing fits even without them), then 12 (old checkpoint, on n1, which
    // has 3 GPUs free). Only the third makes room for 4 GPUs; the search must
    // try the fit after it, although 3 GPUs released is less than the demand.
    let out = run("
        node n1 gpus=8*H100 labels=side:a
        node n2 gpus=8*H100 labels=side:b
        queue org H100=16
        queue team parent=org H100=16
        run 20 queue=team class=inference gpu=whole:4 cpu=1 select=side:a
        run 12 queue=team class=batch started=0 checkpoint=0 gpu=whole:1 cpu=1 select=side:a
        run 21 queue=team class=inference gpu=whole:6 cpu=1 select=side:b
        run 10 queue=team class=batch started=0 checkpoint=990 gpu=whole:1 cpu=1 select=side:b
        run 11 queue=team class=batch started=0 checkpoint=990 gpu=whole:1 cpu=1 select=side:b
        job 1 queue=team class=training prio=5 gpu=whole:4 cpu=1
        cycle 1000
        cycle 1001
    ");
    expect![[r#"
        cycle t=1000
          preempt job 12 for job 1 (Priority): signal now, kill at t=1030, loses 0.28 GPU-h
          nominate n1 for job 1 from t=1030
          pending job 1 (#1 in queue, eta t=1030): waiting for 1 preempted job(s) to stop
        cycle t=1001
          start job 1 on H100: n1[4,5,6,7]
          pending job 12 (#1 in queue, eta unknown): needs 1 H100 GPUs of quota; org has 0 left to lend; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node lacks the selected labels, 1 node has too few free GPUs in the requested sharing mode
    "#]]
    .assert_eq(&out);
}

#[test]
fn the_backlog_is_ordered_by_class_then_aged_priority_then_submission() {
    // A held queue starts nothing, so positions show the order. Aging adds
    // one to the priority per full hour waited: job 4 (+1) ties job 3 and is
    // older; jobs 6 and 7 tie on everything but their ids. Every class is a
    // tier of its own here (by default training and batch share one: see
    // `preemptible_classes_may_share_one_tier_of_the_order`).
    let out = run("
        config aging=3600 one_tier=off
        node n1 gpus=8*H100
        queue org H100=8 state=held
        job 1 queue=org class=batch prio=5 submit=0 gpu=whole:1 cpu=1
        job 2 queue=org class=training prio=0 submit=7000 gpu=whole:1 cpu=1
        job 3 queue=org class=training prio=1 submit=7100 gpu=whole:1 cpu=1
        job 4 queue=org class=training prio=0 submit=100 gpu=whole:1 cpu=1
        job 5 queue=org class=inference prio=0 submit=7150 gpu=whole:1 cpu=1
        job 6 queue=org class=training prio=0 submit=6900 gpu=whole:1 cpu=1
        job 7 queue=org class=training prio=0 submit=6900 gpu=whole:1 cpu=1
        cycle 7200
    ");
    expect![[r#"
        cycle t=7200
          pending job 1 (#7 in queue, eta unknown): queue org is held: it accepts work but starts none
          pending job 2 (#6 in queue, eta unknown): queue org is held: it accepts work but starts none
          pending job 3 (#3 in queue, eta unknown): queue org is held: it accepts work but starts none
          pending job 4 (#2 in queue, eta unknown): queue org is held: it accepts work but starts none
          pending job 5 (#1 in queue, eta unknown): queue org is held: it accepts work but starts none
          pending job 6 (#4 in queue, eta unknown): queue org is held: it accepts work but starts none
          pending job 7 (#5 in queue, eta unknown): queue org is held: it accepts work but starts none
    "#]].assert_eq(&out);
}

#[test]
fn a_quota_blocked_job_is_also_told_when_it_would_not_fit() {
    let out = run("
        node n1 gpus=8*H100
        node n2 gpus=8*H100
        queue org H100=16
        queue capped parent=org H100=4,cap=4
        job 1 queue=capped gpu=whole:4 cpu=1
        job 2 queue=capped gpu=whole:2 cpu=1     # fits a node, not the cap
        job 3 queue=capped gpu=whole:16 cpu=1    # no node has 16 GPUs either
        cycle 10
    ");
    expect![[r#"
        cycle t=10
          start job 1 on H100: n1[0,1,2,3]
          pending job 2 (#1 in queue, eta unknown): queue capped would use 6 H100 GPUs, above its cap of 4
          pending job 3 (#2 in queue, eta unknown): queue capped would use 20 H100 GPUs, above its cap of 4; on H100: main: needs 16 whole GPUs (H100) on one node, 1 CPU: 2 nodes have too few free GPUs in the requested sharing mode
    "#]]
    .assert_eq(&out);
}

#[test]
fn a_ready_preemptor_that_cannot_start_is_explained_once() {
    let out = run("
        config patience=0
        node n1 gpus=8*H100
        node n2 gpus=1*H100
        queue org H100=9
        queue team-a parent=org H100=5 users=running:1
        queue team-b parent=org H100=4
        run 10 queue=team-b class=batch gpu=whole:4 cpu=1 started=0
        run 12 queue=team-b class=batch gpu=whole:4 cpu=1 started=0   # team-b uses 8: 4 borrowed
        job 1 queue=team-a user=ann class=training gpu=whole:4 cpu=1
        cycle 1000
        run 11 queue=team-a user=ann class=notebook gpu=whole:1 cpu=1 started=1000  # ann is at her limit
        cycle 1001
    ");
    expect![[r#"
        cycle t=1000
          preempt job 10 for job 1 (Reclaim): signal now, kill at t=1030, loses 1.11 GPU-h
          nominate n1 for job 1 from t=1030
          pending job 1 (#1 in queue, eta t=1030): waiting for 1 preempted job(s) to stop
        cycle t=1001
          start job 10 on H100: n1[0,1,2,3]
          pending job 1 (#1 in queue, eta unknown): user ann runs 1 jobs of a 1 job limit in this queue
    "#]]
    .assert_eq(&out);
}

#[test]
fn a_held_or_user_limited_job_is_also_told_about_quota_and_fit() {
    let out = run("
        node n1 gpus=4*H100
        queue org H100=4
        queue limited parent=org H100=2,cap=2 users=running:1
        queue held parent=org H100=2,cap=2 state=held
        run 10 queue=limited user=ann gpu=whole:2 cpu=1 started=0
        job 1 queue=limited user=ann gpu=whole:3 cpu=1    # limit, cap and fit
        job 2 queue=limited user=bob gpu=whole:1 cpu=1    # only the cap
        job 3 queue=held gpu=whole:8 cpu=1                # held, cap and fit
        job 4 queue=held gpu=whole:1 cpu=1                # only held
        cycle 10
    ");
    expect![[r#"
        cycle t=10
          pending job 1 (#1 in queue, eta unknown): user ann runs 1 jobs of a 1 job limit in this queue; queue limited would use 5 H100 GPUs, above its cap of 2; on H100: main: needs 3 whole GPUs (H100) on one node, 1 CPU: 1 node has too few free GPUs in the requested sharing mode
          pending job 2 (#2 in queue, eta unknown): queue limited would use 3 H100 GPUs, above its cap of 2
          pending job 3 (#1 in queue, eta unknown): queue held is held: it accepts work but starts none; queue held would use 8 H100 GPUs, above its cap of 2; on H100: main: needs 8 whole GPUs (H100) on one node, 1 CPU: 1 node has too few free GPUs in the requested sharing mode
          pending job 4 (#2 in queue, eta unknown): queue held is held: it accepts work but starts none
    "#]]
    .assert_eq(&out);
}

#[test]
fn a_victim_search_checks_the_fit_after_its_last_victim_when_later_candidates_are_skipped() {
    // team-b borrows 3 GPUs in six 1-GPU jobs: only three may be reclaimed
    // (it keeps its guarantee of 3). With one GPU free, those three make
    // room for job 1's 4 GPUs; the candidates after them are skipped, and
    // the search must still try the fit after the third.
    let out = run("
        node n1 gpus=8*H100
        queue org H100=8
        queue team-a parent=org H100=5
        queue team-b parent=org H100=3
        run 20 queue=team-a class=training gpu=whole:1 cpu=1 started=0
        run 10 queue=team-b class=batch gpu=whole:1 cpu=1 started=0 checkpoint=100
        run 11 queue=team-b class=batch gpu=whole:1 cpu=1 started=0 checkpoint=200
        run 12 queue=team-b class=batch gpu=whole:1 cpu=1 started=0 checkpoint=300
        run 13 queue=team-b class=batch gpu=whole:1 cpu=1 started=0 checkpoint=900
        run 14 queue=team-b class=batch gpu=whole:1 cpu=1 started=0 checkpoint=900
        run 15 queue=team-b class=batch gpu=whole:1 cpu=1 started=0 checkpoint=900
        job 1 queue=team-a class=training gpu=whole:4 cpu=1
        cycle 1000
    ");
    expect![[r#"
        cycle t=1000
          preempt job 13 for job 1 (Reclaim): signal now, kill at t=1030, loses 0.03 GPU-h
          preempt job 14 for job 1 (Reclaim): signal now, kill at t=1030, loses 0.03 GPU-h
          preempt job 15 for job 1 (Reclaim): signal now, kill at t=1030, loses 0.03 GPU-h
          nominate n1 for job 1 from t=1030
          pending job 1 (#1 in queue, eta t=1030): waiting for 3 preempted job(s) to stop
    "#]]
    .assert_eq(&out);
}

#[test]
fn a_reclaim_that_could_only_help_past_the_borrowers_guarantee_is_not_tried() {
    // team-b may give back 3 of its 6 GPUs: the three cheapest, on n1,
    // where job 20 keeps a GPU, so 4 never come free on one node. Stopping
    // all six would free n2, but that would take team-b below its
    // guarantee: no preemption. (Debug builds also run the search the
    // cheap test skips and check that it finds nothing.)
    let out = run("
        node n1 gpus=4*H100 labels=side:a
        node n2 gpus=4*H100 labels=side:b
        queue org H100=8
        queue team-a parent=org H100=5
        queue team-b parent=org H100=3
        run 20 queue=team-a class=training gpu=whole:1 cpu=1 started=0 select=side:a
        run 10 queue=team-b class=batch gpu=whole:1 cpu=1 started=0 checkpoint=900 select=side:a
        run 11 queue=team-b class=batch gpu=whole:1 cpu=1 started=0 checkpoint=900 select=side:a
        run 12 queue=team-b class=batch gpu=whole:1 cpu=1 started=0 checkpoint=900 select=side:a
        run 13 queue=team-b class=batch gpu=whole:1 cpu=1 started=0 checkpoint=100 select=side:b
        run 14 queue=team-b class=batch gpu=whole:1 cpu=1 started=0 checkpoint=100 select=side:b
        run 15 queue=team-b class=batch gpu=whole:1 cpu=1 started=0 checkpoint=100 select=side:b
        job 1 queue=team-a class=training gpu=whole:4 cpu=1
        cycle 1000
    ");
    expect![[r#"
        cycle t=1000
          hold n2 for job 1 from t=1000
          pending job 1 (#1 in queue, eta t=1000): within queue team-a's guarantee of 5 H100 GPUs (it would hold 5), but other queues hold that capacity on loan: it is taken back as borrowed jobs pass their minimum runtime, and leases their term; on H100: main: needs 4 whole GPUs (H100) on one node, 1 CPU: 2 nodes have too few free GPUs in the requested sharing mode
    "#]]
    .assert_eq(&out);
}

#[test]
fn a_job_the_cycle_did_not_reach_is_diagnosed_on_demand() {
    // One failed try per queue: jobs 2 and 3 are not reached. Asked why,
    // each gets every reason its turn would find, and asking changes nothing
    // (the fixture checks the next plan is the same).
    let out = run("
        node n1 gpus=4*H100
        node n2 gpus=2*A100
        queue org H100=4 A100=2
        queue team parent=org H100=2,cap=2 A100=2 users=gpus:3
        config tries=1
        run 10 queue=team user=ann gpu=whole:2 cpu=1 models=H100 started=0
        job 1 queue=team user=bob gpu=whole:4 cpu=1    # tried: cap, quota and fit
        job 2 queue=team user=ann gpu=whole:2 cpu=1    # user limit; H100 cap
        job 3 queue=team user=bob gpu=whole:1 cpu=1    # H100 cap; would start on A100
        job 4 queue=team user=bob gpu=whole:3 cpu=1 models=H100    # cap and fit
        cycle 1000
        why 2 1000
        why 3 1000
        why 4 1000
    ");
    expect![[r#"
        cycle t=1000
          pending job 1 (#1 in queue, eta unknown): user bob holds 0 GPUs of a 3 GPU limit in this queue; needs 4 A100 GPUs of quota; org has 2 left to lend; on A100: main: needs 4 whole GPUs (A100) on one node, 1 CPU: 1 node has no GPU of an accepted model, 1 node has too few free GPUs in the requested sharing mode; queue team would use 6 H100 GPUs, above its cap of 2; on H100: main: needs 4 whole GPUs (H100) on one node, 1 CPU: 1 node has no GPU of an accepted model, 1 node has too few free GPUs in the requested sharing mode
          pending job 2 (#2 in queue, eta t=1000): not reached this cycle: 1 job(s) ahead were tried first
          pending job 3 (#3 in queue, eta t=1000): not reached this cycle: 1 job(s) ahead were tried first
          pending job 4 (#4 in queue, eta unknown): not reached this cycle: 1 job(s) ahead were tried first
        why job 2 at t=1000: user ann holds 2 GPUs of a 3 GPU limit in this queue
        why job 3 at t=1000: it would start
        why job 4 at t=1000: queue team would use 5 H100 GPUs, above its cap of 2; on H100: main: needs 3 whole GPUs (H100) on one node, 1 CPU: 1 node has no GPU of an accepted model, 1 node has too few free GPUs in the requested sharing mode
    "#]]
    .assert_eq(&out);
}

#[test]
fn a_gang_is_preempted_whole_and_requeued_whole() {
    // Job 10 is a 2-task gang across both nodes; job 1 needs one node's
    // GPUs. The gang is the only candidate: it stops whole (one order, both
    // tasks' GPUs freed) and waits again as one job.
    let out = run("
        node n1 gpus=4*H100
        node n2 gpus=4*H100
        queue org H100=8
        queue team parent=org H100=8
        run 10 queue=team class=batch started=0 group=worker*2 gpu=whole:4 cpu=1
        job 1 queue=team class=training gpu=whole:4 cpu=1
        cycle 1000
        cycle 1001
    ");
    expect![[r#"
        cycle t=1000
          preempt job 10 for job 1 (Priority): signal now, kill at t=1030, loses 2.22 GPU-h
          nominate n1 for job 1 from t=1030
          pending job 1 (#1 in queue, eta t=1030): waiting for 1 preempted job(s) to stop
        cycle t=1001
          start job 1 on H100: n1[0,1,2,3]
          pending job 10 (#1 in queue, eta unknown): needs 8 H100 GPUs of quota; org has 4 left to lend; on H100: worker: needs 4 whole GPUs (H100) on one node, 1 CPU: 2 nodes have too few free GPUs in the requested sharing mode
    "#]]
    .assert_eq(&out);
}

#[test]
fn victims_lose_the_least_work_then_hold_the_fewest_gpus() {
    // Since their last checkpoints, job 10 lost 2 GPUs × 500 s and job 11
    // 1 GPU × 1000 s: the same work. Job 12 lost more. The one with fewer
    // GPUs goes.
    let out = run("
        node n1 gpus=4*H100
        queue org H100=4
        queue team parent=org H100=4
        run 10 queue=team class=batch gpu=whole:2 cpu=1 started=0 checkpoint=500
        run 11 queue=team class=batch gpu=whole:1 cpu=1 started=0 checkpoint=0
        run 12 queue=team class=batch gpu=whole:1 cpu=1 started=0
        job 1 queue=team class=training gpu=whole:1 cpu=1
        cycle 1000
    ");
    expect![[r#"
        cycle t=1000
          preempt job 11 for job 1 (Priority): signal now, kill at t=1030, loses 0.28 GPU-h
          nominate n1 for job 1 from t=1030
          pending job 1 (#1 in queue, eta t=1030): waiting for 1 preempted job(s) to stop
    "#]]
    .assert_eq(&out);
}

/// No head-of-line blocking across classes: the queue's notebooks are held by
/// their class's quota (notebooks may not borrow), and after their one try
/// (`tries=1`) only the other notebooks wait; the batch job behind them starts.
#[test]
fn a_class_held_by_its_quota_does_not_hold_the_queues_other_classes() {
    let out = run("
        config tries=1 lease=none
        node n1 gpus=4*H100
        queue org H100=4
        queue team parent=org H100=2,borrow=2
        run 10 queue=team class=notebook gpu=whole:2 cpu=1 started=0
        job 1 queue=team class=notebook submit=1 gpu=whole:1 cpu=1   # would borrow: held
        job 2 queue=team class=notebook submit=2 gpu=whole:1 cpu=1   # same class: waits
        job 3 queue=team class=batch submit=3 gpu=whole:1 cpu=1      # another class: starts
        cycle 100
    ");
    expect![[r#"
        cycle t=100
          start job 3 on H100: n1[2]
          pending job 1 (#1 in queue, eta unknown): notebook jobs must fit the guaranteed H100 quota: jobs that may not borrow would hold 3 of 2 GPUs
          pending job 2 (#2 in queue, eta t=100): not reached this cycle: 1 job(s) ahead were tried first
    "#]]
    .assert_eq(&out);
}

/// Slurm's multifactor priority (the faithful Slurm baseline): fair share
/// outweighs age, so team-b, which used nothing, goes before team-a's older
/// job; age and size only order jobs of equal fair share (job 3, older than
/// job 4 and as big, goes first; job 5, bigger, before both).
#[test]
fn multifactor_priority_puts_fair_share_before_age_and_size_as_slurm_does() {
    let out = run("
        config ordering=multifactor preemption=off quotas=off backfill=off
        node n1 gpus=8*H100
        queue org H100=8
        queue team-a parent=org H100=4
        queue team-b parent=org H100=4
        usage team-a 100
        run 10 queue=team-a class=batch gpu=whole:7 cpu=1 started=0
        job 1 queue=team-a class=batch submit=0 gpu=whole:1 cpu=1      # oldest, but team-a used more
        job 2 queue=team-b class=batch submit=3000 gpu=whole:1 cpu=1   # starts
        job 3 queue=team-a class=batch submit=100 gpu=whole:1 cpu=1
        job 4 queue=team-a class=batch submit=200 gpu=whole:1 cpu=1
        job 5 queue=team-a class=batch submit=300 gpu=whole:2 cpu=1
        cycle 3600
    ");
    expect![[r#"
        cycle t=3600
          start job 2 on H100: n1[7]
          pending job 1 (#2 in queue, eta unknown): on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode
          pending job 3 (#3 in queue, eta unknown): on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode
          pending job 4 (#4 in queue, eta unknown): on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode
          pending job 5 (#1 in queue, eta unknown): on H100: main: needs 2 whole GPUs (H100) on one node, 1 CPU: 1 node has too few free GPUs in the requested sharing mode
    "#]]
    .assert_eq(&out);
}

/// Protect unsaved work: no victim loses more than `max_unsaved` seconds of
/// work. Job 10 has run 2 h without a checkpoint and keeps its GPU (without
/// the limit it is the victim), and job 1 is told so; once job 10 has
/// checkpointed, it may be chosen.
#[test]
fn a_victim_with_more_than_an_hour_of_unsaved_work_is_not_preempted() {
    let fixture = |limit: &str, checkpoint: &str| {
        run(&format!(
            "
            config max_unsaved={limit}
            node n1 gpus=1*H100
            queue org H100=1
            queue team parent=org H100=1
            run 10 queue=team class=batch gpu=whole:1 cpu=1 started=0 {checkpoint}
            job 1 queue=team class=training gpu=whole:1 cpu=1
            cycle 7200
            "
        ))
    };
    expect![[r#"
        cycle t=7200
          pending job 1 (#1 in queue, eta unknown): needs 1 H100 GPUs of quota; org has 0 left to lend; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode; 1 running job(s) that could make room hold more than 1 h of work since their last checkpoint and are not preempted until they checkpoint or end
    "#]]
    .assert_eq(&fixture("3600", ""));
    expect![[r#"
        cycle t=7200
          preempt job 10 for job 1 (Priority): signal now, kill at t=7230, loses 2.00 GPU-h
          nominate n1 for job 1 from t=7230
          pending job 1 (#1 in queue, eta t=7230): waiting for 1 preempted job(s) to stop
    "#]]
    .assert_eq(&fixture("none", ""));
    expect![[r#"
        cycle t=7200
          preempt job 10 for job 1 (Priority): signal now, kill at t=7230, loses 0.06 GPU-h
          nominate n1 for job 1 from t=7230
          pending job 1 (#1 in queue, eta t=7230): waiting for 1 preempted job(s) to stop
    "#]]
    .assert_eq(&fixture("3600", "checkpoint=7000"));
}

/// A cycle's failed tries are shared among the queues with pending work:
/// one queue alone tries deeper than `tries_per_queue` (here 2), and reaches
/// the job that fits behind four that do not.
#[test]
fn a_queue_alone_tries_deeper_into_its_backlog_within_the_cycles_tries() {
    let fixture = |per_cycle: u32| {
        run(&format!(
            "
            config tries=2 tries_per_cycle={per_cycle} preemption=off backfill=off
            node n1 gpus=4*H100
            queue org H100=4
            queue team parent=org H100=4
            run 10 queue=team class=batch gpu=whole:2 cpu=1 started=0
            job 1 queue=team class=batch submit=1 gpu=whole:4 cpu=1
            job 2 queue=team class=batch submit=2 gpu=whole:4 cpu=1
            job 3 queue=team class=batch submit=3 gpu=whole:4 cpu=1
            job 4 queue=team class=batch submit=4 gpu=whole:4 cpu=1
            job 5 queue=team class=batch submit=5 gpu=whole:2 cpu=1   # fits
            cycle 100
            "
        ))
    };
    expect![[r#"
        cycle t=100
          pending job 1 (#1 in queue, eta unknown): needs 4 H100 GPUs of quota; org has 2 left to lend; on H100: main: needs 4 whole GPUs (H100) on one node, 1 CPU: 1 node has too few free GPUs in the requested sharing mode
          pending job 2 (#2 in queue, eta unknown): needs 4 H100 GPUs of quota; org has 2 left to lend; on H100: main: needs 4 whole GPUs (H100) on one node, 1 CPU: 1 node has too few free GPUs in the requested sharing mode
          pending job 3 (#3 in queue, eta unknown): not reached this cycle: 2 job(s) ahead were tried first
          pending job 4 (#4 in queue, eta unknown): not reached this cycle: 2 job(s) ahead were tried first
          pending job 5 (#5 in queue, eta t=100): not reached this cycle: 2 job(s) ahead were tried first
    "#]]
    .assert_eq(&fixture(0));
    expect![[r#"
        cycle t=100
          start job 5 on H100: n1[2,3]
          pending job 1 (#1 in queue, eta unknown): needs 4 H100 GPUs of quota; org has 2 left to lend; on H100: main: needs 4 whole GPUs (H100) on one node, 1 CPU: 1 node has too few free GPUs in the requested sharing mode
          pending job 2 (#2 in queue, eta unknown): needs 4 H100 GPUs of quota; org has 2 left to lend; on H100: main: needs 4 whole GPUs (H100) on one node, 1 CPU: 1 node has too few free GPUs in the requested sharing mode
          pending job 3 (#3 in queue, eta unknown): needs 4 H100 GPUs of quota; org has 2 left to lend; on H100: main: needs 4 whole GPUs (H100) on one node, 1 CPU: 1 node has too few free GPUs in the requested sharing mode
          pending job 4 (#4 in queue, eta unknown): needs 4 H100 GPUs of quota; org has 2 left to lend; on H100: main: needs 4 whole GPUs (H100) on one node, 1 CPU: 1 node has too few free GPUs in the requested sharing mode
    "#]]
    .assert_eq(&fixture(10));
}

/// A job no node can take as the cluster stands (its node selector matches
/// no node) gets no expected start, however much capacity is free; one
/// that waits only for capacity to free does.
#[test]
fn a_job_no_node_can_take_has_no_expected_start() {
    let out = run("
        node n1 gpus=8*H100 labels=zone:a
        node n2 gpus=8*H100 labels=zone:a
        queue org H100=16
        run 1 queue=org gpu=whole:8 cpu=1 runtime=100 started=0
        run 2 queue=org gpu=whole:4 cpu=1 runtime=300 started=0
        job 3 queue=org gpu=whole:1 cpu=1 select=zone:b
        job 4 queue=org gpu=whole:8 cpu=1
        cycle 10
    ");
    expect![[r#"
        cycle t=10
          pending job 3 (#1 in queue, eta unknown): on H100: main: needs 1 whole GPU (H100), 1 CPU: 2 nodes lack the selected labels
          pending job 4 (#2 in queue, eta t=100): needs 8 H100 GPUs of quota; the cluster has 4 left to lend; on H100: main: needs 8 whole GPUs (H100) on one node, 1 CPU: 2 nodes have too few free GPUs in the requested sharing mode
    "#]]
    .assert_eq(&out);
}

/// `preemptible_one_tier`: training and batch take turns by age (the
/// default); off, training goes first.
#[test]
fn preemptible_classes_may_share_one_tier_of_the_order() {
    let fixture = |tier: &str| {
        run(&format!(
            "
        node n1 gpus=8*H100
        queue org H100=8
        config one_tier={tier}
        job 1 queue=org class=batch submit=0 gpu=whole:8 cpu=1
        job 2 queue=org class=training submit=5 gpu=whole:8 cpu=1
        cycle 10
    "
        ))
    };
    expect![[r#"
        cycle t=10
          start job 2 on H100: n1[0,1,2,3,4,5,6,7]
          pending job 1 (#1 in queue, eta unknown): needs 8 H100 GPUs of quota; the cluster has 0 left to lend; on H100: main: needs 8 whole GPUs (H100) on one node, 1 CPU: 1 node has too few free GPUs in the requested sharing mode
    "#]].assert_eq(&fixture("off"));
    expect![[r#"
        cycle t=10
          start job 1 on H100: n1[0,1,2,3,4,5,6,7]
          pending job 2 (#1 in queue, eta unknown): needs 8 H100 GPUs of quota; the cluster has 0 left to lend; on H100: main: needs 8 whole GPUs (H100) on one node, 1 CPU: 1 node has too few free GPUs in the requested sharing mode
    "#]].assert_eq(&fixture("on"));
}

/// `victims_by_lost_work`: the victim that loses least goes first, whatever
/// its class (the default); off, the lowest class goes first.
#[test]
fn victims_may_be_chosen_by_the_work_they_lose_before_their_class() {
    let fixture = |victims: &str| {
        run(&format!(
            "
        node n1 gpus=8*H100
        queue org H100=8
        config victims={victims}
        run 1 queue=org class=batch started=0 gpu=whole:4 cpu=1
        run 2 queue=org class=training started=0 checkpoint=95 gpu=whole:4 cpu=1
        job 3 queue=org class=inference gpu=whole:4 cpu=1
        cycle 100
    "
        ))
    };
    expect![[r#"
        cycle t=100
          preempt job 1 for job 3 (Priority): signal now, kill at t=130, loses 0.11 GPU-h
          nominate n1 for job 3 from t=130
          pending job 3 (#1 in queue, eta t=130): waiting for 1 preempted job(s) to stop
    "#]]
    .assert_eq(&fixture("class"));
    expect![[r#"
        cycle t=100
          preempt job 2 for job 3 (Priority): signal now, kill at t=130, loses 0.01 GPU-h
          nominate n1 for job 3 from t=130
          pending job 3 (#1 in queue, eta t=130): waiting for 1 preempted job(s) to stop
    "#]]
    .assert_eq(&fixture("lost-work"));
}

/// A job blocked by where GPUs are free, not by how many, is not told it
/// starts now: it starts when a node frees enough. Here 9 GPUs are free in
/// all, 3 on each node; job 3 needs 4 on one node, which n2 has when job 2
/// ends at t=100 (job 5 declares no end), with room for both of job 4's
/// tasks of 4 GPUs.
#[test]
fn a_job_that_fits_nowhere_yet_expects_to_start_when_a_node_frees_enough() {
    let out = run("
        node n1 gpus=8*H100
        node n2 gpus=8*H100
        node n3 gpus=8*H100
        queue org H100=24
        config backfill=off
        run 1 queue=org gpu=whole:5 cpu=1 runtime=300 started=0
        run 2 queue=org gpu=whole:5 cpu=1 runtime=100 started=0
        run 5 queue=org gpu=whole:5 cpu=1 started=0
        job 3 queue=org gpu=whole:4 cpu=1
        job 4 queue=org group=worker*2 gpu=whole:4 cpu=1
        cycle 10
    ");
    expect![[r#"
        cycle t=10
          pending job 3 (#1 in queue, eta t=100): on H100: main: needs 4 whole GPUs (H100) on one node, 1 CPU: 3 nodes have too few free GPUs in the requested sharing mode
          pending job 4 (#2 in queue, eta t=100): on H100: worker: needs 4 whole GPUs (H100) on one node, 1 CPU: 3 nodes have too few free GPUs in the requested sharing mode
    "#]]
    .assert_eq(&out);
}

/// A job that no node has room for yet takes GPUs in the estimates behind
/// it only from when a node has room for it, not from when enough are
/// free across nodes: job 3 needs 4 GPUs on one node, 4 are free in all
/// at t=2000 but on two nodes, and n1 has 4 at t=5000. Job 4 (2 GPUs for
/// two hours) starts at t=1000, when n1 frees 2. The estimate said
/// t=5000: job 3 had taken the GPUs that free at t=2000.
#[test]
fn a_job_waiting_for_a_node_takes_no_gpus_from_those_behind_it_before_then() {
    // The cluster from t=1000 on; before, job 1 also holds 2 GPUs of n1.
    let rest = "
        node n1 gpus=8*H100 labels=zone:a
        node n2 gpus=8*H100 labels=zone:b
        queue org H100=16
        config quotas=off backfill=off preemption=off
        run 2 queue=org gpu=whole:2 cpu=1 runtime=5000 started=0 select=zone:a
        run 5 queue=org gpu=whole:4 cpu=1 started=0 select=zone:a
        run 6 queue=org gpu=whole:2 cpu=1 runtime=2000 started=0 select=zone:b
        run 7 queue=org gpu=whole:6 cpu=1 started=0 select=zone:b
        job 3 queue=org gpu=whole:4 cpu=1 runtime=3600 prio=9
        job 4 queue=org gpu=whole:2 cpu=1 runtime=7200
    ";
    let out = run(&format!(
        "{rest}
        run 1 queue=org gpu=whole:2 cpu=1 runtime=1000 started=0 select=zone:a
        cycle 10"
    ));
    expect![[r#"
        cycle t=10
          pending job 3 (#1 in queue, eta t=5000): on H100: main: needs 4 whole GPUs (H100) on one node, 1 CPU: 2 nodes have too few free GPUs in the requested sharing mode
          pending job 4 (#2 in queue, eta t=1000): on H100: main: needs 2 whole GPUs (H100) on one node, 1 CPU: 2 nodes have too few free GPUs in the requested sharing mode
    "#]]
    .assert_eq(&out);
    // At t=1000, once job 1 has ended, job 4 starts, as estimated.
    let later = run(&format!("{rest}\n        cycle 1000"));
    expect![[r#"
        cycle t=1000
          start job 4 on H100: n1[2,3]
          pending job 3 (#1 in queue, eta t=8200): on H100: main: needs 4 whole GPUs (H100) on one node, 1 CPU: 2 nodes have too few free GPUs in the requested sharing mode
    "#]]
    .assert_eq(&later);
}

/// GPUs that free on a node that takes no new work, or that have failed,
/// make no room: job 3 waits for n2, whose job ends at t=300, not for
/// cordoned n1 (t=100) or for n3, whose job ends at t=50 on GPUs that have
/// failed since.
#[test]
fn room_that_frees_on_a_cordoned_node_or_a_failed_gpu_does_not_count_for_an_estimate() {
    let out = run("
        node n1 gpus=8*H100 labels=zone:a
        node n2 gpus=8*H100 labels=zone:b
        node n3 gpus=8*H100 labels=zone:c
        queue org H100=24
        config backfill=off
        run 1 queue=org gpu=whole:5 cpu=1 runtime=100 started=0 select=zone:a
        run 2 queue=org gpu=whole:5 cpu=1 runtime=300 started=0 select=zone:b
        run 5 queue=org gpu=whole:5 cpu=1 runtime=50 started=0 select=zone:c
        state n1 cordoned
        health n3 0 bad
        health n3 1 bad
        health n3 2 bad
        health n3 3 bad
        health n3 4 bad
        job 3 queue=org gpu=whole:4 cpu=1
        cycle 10
    ");
    expect![[r#"
        cycle t=10
          pending job 3 (#1 in queue, eta t=300): on H100: main: needs 4 whole GPUs (H100) on one node, 1 CPU: 1 node is cordoned, 1 node has too few healthy GPUs, 1 node has too few free GPUs in the requested sharing mode
    "#]]
    .assert_eq(&out);
}

/// Room on a node the job may not use makes no room for it: job 3 selects
/// zone b, so it waits for n2's job to end at t=300, though n1 (zone a)
/// has all its GPUs idle. The estimate said "now" (t=10), every cycle.
#[test]
fn idle_gpus_on_a_node_the_job_may_not_use_do_not_count_for_its_estimate() {
    let out = run("
        node n1 gpus=8*H100 labels=zone:a
        node n2 gpus=8*H100 labels=zone:b
        queue org H100=16
        config backfill=off
        run 2 queue=org gpu=whole:5 cpu=1 runtime=300 started=0 select=zone:b
        job 3 queue=org gpu=whole:4 cpu=1 select=zone:b
        job 4 queue=org gpu=whole:4 cpu=1 select=zone:a
        cycle 10
    ");
    expect![[r#"
        cycle t=10
          start job 4 on H100: n1[0,1,2,3]
          pending job 3 (#1 in queue, eta t=300): on H100: main: needs 4 whole GPUs (H100) on one node, 1 CPU: 1 node lacks the selected labels, 1 node has too few free GPUs in the requested sharing mode
    "#]]
    .assert_eq(&out);
}

/// A job that GPUs would hold but CPUs do not: its estimate is when the
/// CPUs free (the running job's end), not "now".
#[test]
fn a_job_short_of_cpus_is_not_told_it_starts_now() {
    let out = run("
        node n1 gpus=8*H100 cpu=8
        queue org H100=8
        config backfill=off
        run 2 queue=org gpu=whole:1 cpu=6 runtime=300 started=0
        job 3 queue=org gpu=whole:1 cpu=4
        cycle 10
    ");
    expect![[r#"
        cycle t=10
          pending job 3 (#1 in queue, eta t=300): on H100: main: needs 1 whole GPU (H100), 4 CPU: 1 node has too little free CPU
    "#]]
    .assert_eq(&out);
}

/// Consolidation: a job no node can take, though the free GPUs would hold
/// it, starts once a running job that fits elsewhere moves; the cheapest
/// to move goes (least work lost). Nothing moves when consolidation is off,
/// when the movers hold more unsaved work than the limit, when they are of
/// a class that is not preemptible (a notebook), when neither fits on the
/// other node (job 11 takes 60 of a node's 64 CPUs), or with preemption off.
#[test]
fn consolidation_moves_a_job_that_fits_elsewhere_so_a_whole_node_job_starts() {
    let fixture = |config: &str, class: &str, cpu: u32| {
        run(&format!(
            "
            config {config}
            node n1 gpus=4*H100
            node n2 gpus=4*H100
            queue org H100=8
            queue team-a parent=org H100=4
            queue team-b parent=org H100=4
            run 10 queue=team-b class={class} gpu=whole:2 cpu=10 started=0 runtime=36000
            state n1 cordoned
            run 11 queue=team-b class={class} gpu=whole:2 cpu={cpu} started=600 runtime=36000
            state n1 ready
            job 1 queue=team-a class=training gpu=whole:4 cpu=1 runtime=3600
            cycle 1000
            cycle 1010
            "
        ))
    };
    expect![[r#"
        cycle t=1000
          preempt job 11 for job 1 (Consolidation): signal now, kill at t=1030, loses 0.22 GPU-h
          nominate n2 for job 1 from t=1030
          pending job 1 (#1 in queue, eta t=1030): waiting for 1 preempted job(s) to stop
        cycle t=1010
          start job 1 on H100: n2[0,1,2,3]
          start job 11 on H100: n1[2,3]
    "#]]
    .assert_eq(&fixture("consolidate=1800", "batch", 1));
    let unmoved = fixture("consolidate=none", "batch", 1);
    expect![[r#"
        cycle t=1000
          reserve n1 for job 1 from t=36000
          pending job 1 (#1 in queue, eta t=36000): on H100: main: needs 4 whole GPUs (H100) on one node, 1 CPU: 2 nodes have too few free GPUs in the requested sharing mode
        cycle t=1010
          reserve n1 for job 1 from t=36000
          pending job 1 (#1 in queue, eta t=36000): on H100: main: needs 4 whole GPUs (H100) on one node, 1 CPU: 2 nodes have too few free GPUs in the requested sharing mode
    "#]].assert_eq(&unmoved);
    for (config, class, cpu) in [
        ("consolidate=300", "batch", 1),
        ("consolidate=1800", "notebook", 1),
        ("consolidate=1800", "batch", 60),
        ("consolidate=1800 preemption=off", "batch", 1),
    ] {
        assert_eq!(
            fixture(config, class, cpu),
            unmoved,
            "{config} {class} cpu={cpu}"
        );
    }
}

/// Team-b's job 2 reclaims two of the GPUs team-a's job 10 borrows on n1;
/// job 12 of team-a (guaranteed `guaranteed` GPUs) then ends, and job 10,
/// waiting, could start on n1 if team-b's job 11 moved.
fn reclaimed_then_freed(guaranteed: u32) -> String {
    run(&format!(
        "
        config consolidate=1800 min_runtime=0
        node n1 gpus=4*H100
        node n2 gpus=4*H100
        queue org H100=8
        queue team-a parent=org H100={guaranteed}
        queue team-b parent=org H100=4
        run 12 queue=team-a class=batch gpu=whole:2 cpu=1 started=0 runtime=36000
        run 11 queue=team-b class=batch gpu=whole:2 cpu=1 started=500 runtime=36000
        run 10 queue=team-a class=batch gpu=whole:4 cpu=1 started=900 runtime=36000
        job 2 queue=team-b class=batch gpu=whole:2 cpu=1 runtime=36000
        cycle 1000
        cycle 1010
        finish 12
        cycle 1020
        "
    ))
}

/// Consolidation does not move a job that reclaimed GPUs from the job it
/// would make room for (reclaims ignore rank, so the two could take turns):
/// team-b's job 2 reclaims n1 from team-a's borrowing job 10; when job 10
/// could start by moving a two-GPU job, it moves team-b's job 11, though
/// job 2, which started last, would lose less. (Job 10 would then run
/// within two GPUs of team-a's guarantee, where no reclaim takes it: the
/// jobs of team-b, within its guarantee, may move for it; see the next
/// test.)
#[test]
fn consolidation_does_not_move_a_job_that_reclaimed_from_it() {
    let out = reclaimed_then_freed(2);
    expect![[r#"
        cycle t=1000
          preempt job 10 for job 2 (Reclaim): signal now, kill at t=1030, loses 0.11 GPU-h
          nominate n2 for job 2 from t=1030
          pending job 2 (#1 in queue, eta t=1030): waiting for 1 preempted job(s) to stop
        cycle t=1010
          start job 2 on H100: n2[0,1]
          pending job 10 (#1 in queue, eta unknown): needs 4 H100 GPUs of quota; org has 2 left to lend; on H100: main: needs 4 whole GPUs (H100) on one node, 1 CPU: 2 nodes have too few free GPUs in the requested sharing mode
        finish job 12
        cycle t=1020
          preempt job 11 for job 10 (Consolidation): signal now, kill at t=1050, loses 0.29 GPU-h
          nominate n1 for job 10 from t=1050
          pending job 10 (#1 in queue, eta t=1050): waiting for 1 preempted job(s) to stop
    "#]].assert_eq(&out);
}

/// Consolidation does not move a job of a queue within its guarantee to
/// make room for a job that a reclaim could then take: the moved job would
/// be entitled to reclaim it at once, and the two would take turns (a
/// property test found such a cycle). As above, but team-a has no
/// guarantee: job 10, once job 12 ends, would borrow all four GPUs, and
/// team-b's job 11 holds two of team-b's four. Nothing moves; job 10 waits.
#[test]
fn consolidation_does_not_move_a_lenders_job_for_a_borrower() {
    let out = reclaimed_then_freed(0);
    expect![[r#"
        cycle t=1000
          preempt job 10 for job 2 (Reclaim): signal now, kill at t=1030, loses 0.11 GPU-h
          nominate n2 for job 2 from t=1030
          pending job 2 (#1 in queue, eta t=1030): waiting for 1 preempted job(s) to stop
        cycle t=1010
          start job 2 on H100: n2[0,1]
          pending job 10 (#1 in queue, eta unknown): needs 4 H100 GPUs of quota; org has 2 left to lend; on H100: main: needs 4 whole GPUs (H100) on one node, 1 CPU: 2 nodes have too few free GPUs in the requested sharing mode
        finish job 12
        cycle t=1020
          reserve n1 for job 10 from t=36500
          pending job 10 (#1 in queue, eta t=36500): on H100: main: needs 4 whole GPUs (H100) on one node, 1 CPU: 2 nodes have too few free GPUs in the requested sharing mode
    "#]].assert_eq(&out);
}

/// Consolidations are paced: one a cycle, none within
/// `consolidation_interval` (60 s) of the last, however often cycles run.
/// Four nodes each run a two-GPU job and two four-GPU jobs wait: the first
/// moves a job at t=1000, the second only at t=1060.
#[test]
fn consolidations_are_paced_by_their_interval() {
    let out = run("
        node n1 gpus=4*H100
        node n2 gpus=4*H100
        node n3 gpus=4*H100
        node n4 gpus=4*H100
        queue org H100=16
        queue team parent=org H100=16
        state n2 cordoned
        state n3 cordoned
        state n4 cordoned
        run 10 queue=team class=training gpu=whole:2 cpu=1 started=0 runtime=36000
        state n1 cordoned
        state n2 ready
        run 11 queue=team class=training gpu=whole:2 cpu=1 started=100 runtime=36000
        state n2 cordoned
        state n3 ready
        run 12 queue=team class=training gpu=whole:2 cpu=1 started=200 runtime=36000
        state n3 cordoned
        state n4 ready
        run 13 queue=team class=training gpu=whole:2 cpu=1 started=300 runtime=36000
        state n1 ready
        state n2 ready
        state n3 ready
        job 1 queue=team class=training gpu=whole:4 cpu=1 runtime=3600
        job 2 queue=team class=training gpu=whole:4 cpu=1 runtime=3600
        cycle 1000
        cycle 1010
        cycle 1020
        cycle 1060
    ");
    expect![[r#"
        cycle t=1000
          preempt job 13 for job 1 (Consolidation): signal now, kill at t=1030, loses 0.39 GPU-h
          reserve n1 for job 2 from t=36000
          nominate n4 for job 1 from t=1030
          pending job 1 (#1 in queue, eta t=1030): waiting for 1 preempted job(s) to stop
          pending job 2 (#2 in queue, eta t=36000): on H100: main: needs 4 whole GPUs (H100) on one node, 1 CPU: 4 nodes have too few free GPUs in the requested sharing mode
        cycle t=1010
          start job 1 on H100: n4[0,1,2,3]
          start job 13 on H100: n2[2,3]
          reserve n1 for job 2 from t=36000
          pending job 2 (#1 in queue, eta t=36000): on H100: main: needs 4 whole GPUs (H100) on one node, 1 CPU: 4 nodes have too few free GPUs in the requested sharing mode
        cycle t=1020
          reserve n4 for job 2 from t=4610
          pending job 2 (#1 in queue, eta t=4610): on H100: main: needs 4 whole GPUs (H100) on one node, 1 CPU: 4 nodes have too few free GPUs in the requested sharing mode
        cycle t=1060
          preempt job 12 for job 2 (Consolidation): signal now, kill at t=1090, loses 0.48 GPU-h
          nominate n3 for job 2 from t=1090
          pending job 2 (#1 in queue, eta t=1090): waiting for 1 preempted job(s) to stop
    "#]].assert_eq(&out);
}

#[test]
fn a_cycle_starts_no_victim_search_past_its_preemption_cap() {
    // Two queues, each with a training job that may preempt its own
    // queue's batch job. Without a cap both preempt in the first cycle;
    // with a cap of one, the second waits for the next cycle.
    let fixture = |cap: &str| {
        run(&format!(
            "
            node n1 gpus=2*H100
            queue org H100=2
            queue a parent=org H100=1
            queue b parent=org H100=1
            config min_runtime=0 max_preemptions={cap}
            run 10 queue=a class=batch started=0 gpu=whole:1 cpu=1
            run 11 queue=b class=batch started=0 gpu=whole:1 cpu=1
            job 1 queue=a class=training gpu=whole:1 cpu=1
            job 2 queue=b class=training gpu=whole:1 cpu=1
            cycle 1000
            cycle 1001
            "
        ))
    };
    expect![[r#"
        cycle t=1000
          preempt job 10 for job 1 (Priority): signal now, kill at t=1030, loses 0.28 GPU-h
          preempt job 11 for job 2 (Priority): signal now, kill at t=1030, loses 0.28 GPU-h
          nominate n1 for job 1 from t=1030
          nominate n1 for job 2 from t=1030
          pending job 1 (#1 in queue, eta t=1030): waiting for 1 preempted job(s) to stop
          pending job 2 (#1 in queue, eta t=1030): waiting for 1 preempted job(s) to stop
        cycle t=1001
          start job 1 on H100: n1[0]
          start job 2 on H100: n1[1]
          pending job 10 (#1 in queue, eta unknown): needs 1 H100 GPUs of quota; org has 0 left to lend; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode
          pending job 11 (#1 in queue, eta unknown): needs 1 H100 GPUs of quota; org has 0 left to lend; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode
    "#]]
    .assert_eq(&fixture("256"));
    expect![[r#"
        cycle t=1000
          preempt job 10 for job 1 (Priority): signal now, kill at t=1030, loses 0.28 GPU-h
          nominate n1 for job 1 from t=1030
          pending job 1 (#1 in queue, eta t=1030): waiting for 1 preempted job(s) to stop
          pending job 2 (#1 in queue, eta unknown): needs 1 H100 GPUs of quota; org has 0 left to lend; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode
        cycle t=1001
          start job 1 on H100: n1[0]
          preempt job 11 for job 2 (Priority): signal now, kill at t=1031, loses 0.28 GPU-h
          nominate n1 for job 2 from t=1031
          pending job 2 (#1 in queue, eta t=1031): waiting for 1 preempted job(s) to stop
          pending job 10 (#1 in queue, eta unknown): needs 1 H100 GPUs of quota; org has 0 left to lend; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode
    "#]]
    .assert_eq(&fixture("1"));
}

/// Leases: a notebook beyond its team's guarantee runs on the guarantee
/// another team leaves idle (job 1), as long as the flavor's leases stay
/// within what the idle guarantees leave beyond the work pending: once
/// team-b has work pending for its guarantee, job 2 is told how much is
/// lent and how little is left. Job 3 declares nothing and gets the same
/// terms: its lease may be taken back after the horizon.
#[test]
fn a_notebook_beyond_its_guarantee_runs_on_a_lease_of_idle_guarantee() {
    let out = run("
        node n1 gpus=8*H100
        queue org H100=8
        queue team-a parent=org H100=2
        queue team-b parent=org H100=6
        run 10 queue=team-a class=notebook gpu=whole:2 cpu=1 started=0
        job 1 queue=team-a class=notebook submit=1 gpu=whole:2 cpu=1 runtime=3600
        cycle 100
        job 2 queue=team-a class=notebook submit=101 gpu=whole:2 cpu=1 runtime=3600
        job 3 queue=team-b class=batch submit=102 gpu=whole:4 cpu=1 prio=0
        run 11 queue=team-b class=batch gpu=whole:1 cpu=1 started=150
        cycle 200
    ");
    expect![[r#"
        cycle t=100
          start job 1 on H100: n1[2,3]
        cycle t=200
          reserve n1 for job 3 from t=3700
          pending job 2 (#1 in queue, eta t=3700): notebook jobs beyond the guaranteed H100 quota (they would hold 6 of 2 GPUs) run only on idle capacity lent to them: 2 GPUs are lent already and this job needs 2 more, but the capacity no queue claims for its guarantee (what it holds and has pending) leaves 1 GPUs to lend; capacity is reserved for job 3 from t=3700s and this job would not end before
          pending job 3 (#1 in queue, eta t=3700): within queue team-b's guarantee of 6 H100 GPUs (it would hold 5), but other queues hold that capacity on loan: it is taken back as borrowed jobs pass their minimum runtime, and leases their term; on H100: main: needs 4 whole GPUs (H100) on one node, 1 CPU: 1 node has too few free GPUs in the requested sharing mode
    "#]]
    .assert_eq(&out);
}

/// A lease past the horizon is taken back by a queue within its guarantee,
/// but after every other candidate: job 1 (one GPU) takes the borrowing
/// batch job; job 2 (two more) then takes the notebook whose lease has run
/// four hours, not the younger one.
#[test]
fn an_expired_lease_is_taken_back_after_every_other_candidate() {
    let out = run("
        config underserved_pass=1.0 budget=none
        node n1 gpus=4*H100
        queue org H100=4
        queue team-a parent=org H100=1
        queue team-b parent=org H100=3
        run 10 queue=team-a class=notebook gpu=whole:1 cpu=1 started=0
        run 11 queue=team-a class=notebook gpu=whole:1 cpu=1 started=0
        run 12 queue=team-a class=notebook gpu=whole:1 cpu=1 started=10000
        run 13 queue=team-a class=batch gpu=whole:1 cpu=1 started=10000
        job 1 queue=team-b class=training submit=15000 gpu=whole:1 cpu=1
        cycle 15000
        job 2 queue=team-b class=training submit=15010 gpu=whole:1 cpu=1
        cycle 15010
        job 3 queue=team-b class=training submit=15020 gpu=whole:1 cpu=1
        cycle 15020
    ");
    expect![[r#"
        cycle t=15000
          preempt job 13 for job 1 (Reclaim): signal now, kill at t=15030, loses 1.39 GPU-h
          nominate n1 for job 1 from t=15030
          pending job 1 (#1 in queue, eta t=15030): waiting for 1 preempted job(s) to stop
        cycle t=15010
          start job 1 on H100: n1[3]
          preempt job 10 for job 2 (Reclaim): signal now, kill at t=15040, loses 4.17 GPU-h
          nominate n1 for job 2 from t=15040
          pending job 2 (#1 in queue, eta t=15040): waiting for 1 preempted job(s) to stop
          pending job 13 (#1 in queue, eta unknown): needs 1 H100 GPUs of quota; org has 0 left to lend; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode
        cycle t=15020
          start job 2 on H100: n1[0]
          preempt job 11 for job 3 (Reclaim): signal now, kill at t=15050, loses 4.17 GPU-h
          nominate n1 for job 3 from t=15050
          pending job 3 (#1 in queue, eta t=15050): waiting for 1 preempted job(s) to stop
          pending job 10 (#1 in queue, eta unknown): notebook jobs beyond the guaranteed H100 quota (they would hold 3 of 1 GPUs) run only on idle capacity lent to them: 1 GPUs are lent already and this job needs 1 more, but the capacity no queue claims for its guarantee (what it holds and has pending) leaves 0 GPUs to lend; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode
          pending job 13 (#2 in queue, eta unknown): needs 1 H100 GPUs of quota; org has 0 left to lend; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode
    "#]]
    .assert_eq(&out);
}

/// Unsaved work does not protect capacity held beyond a guarantee: the
/// borrower's job has run two hours without a checkpoint, more than
/// `max_unsaved`, and the lender's job within its guarantee takes it back
/// all the same (its own queue's lower priority work would be kept).
#[test]
fn unsaved_work_does_not_keep_borrowed_capacity_from_its_lender() {
    let out = run("
        config max_unsaved=3600 budget=none
        node n1 gpus=2*H100
        queue org H100=2
        queue team-a parent=org H100=1
        queue team-b parent=org H100=1
        run 10 queue=team-b class=batch gpu=whole:1 cpu=1 started=0
        run 11 queue=team-b class=batch gpu=whole:1 cpu=1 started=0
        job 1 queue=team-a class=training submit=7000 gpu=whole:1 cpu=1
        cycle 7200
    ");
    expect![[r#"
        cycle t=7200
          preempt job 10 for job 1 (Reclaim): signal now, kill at t=7230, loses 2.00 GPU-h
          nominate n1 for job 1 from t=7230
          pending job 1 (#1 in queue, eta t=7230): waiting for 1 preempted job(s) to stop
    "#]]
    .assert_eq(&out);
}

/// The lender first: team-a's job within its guarantee needs three GPUs on
/// the node team-b borrows; the borrowers are younger than their minimum
/// runtime. The node is held from new borrowing until they may be taken
/// back (t=1200), and held again every cycle until the job starts:
/// team-b's next borrower (job 2) is kept off the GPU that stands free. A
/// borrower that ends before the hold starts (job 3) may still use it.
#[test]
fn a_reclaim_hold_keeps_new_borrowing_off_the_node_a_lender_takes_back() {
    let fixture = |holds: &str| {
        run(&format!(
            "
            config budget=none min_runtime=300 holds={holds}
            node n1 gpus=4*H100
            queue org H100=4
            queue team-a parent=org H100=3
            queue team-b parent=org H100=1
            run 10 queue=team-b class=batch gpu=whole:1 cpu=1 started=0
            run 11 queue=team-b class=batch gpu=whole:1 cpu=1 started=900
            run 12 queue=team-b class=batch gpu=whole:1 cpu=1 started=900
            job 1 queue=team-a class=training submit=950 gpu=whole:3 cpu=1
            job 2 queue=team-b class=batch submit=960 gpu=whole:1 cpu=1
            job 3 queue=team-b class=batch submit=970 gpu=whole:1 cpu=1 runtime=120
            cycle 1000
            cycle 1200
            cycle 1210
            "
        ))
    };
    expect![[r#"
        cycle t=1000
          start job 3 on H100: n1[3]
          hold n1 for job 1 from t=1200
          pending job 1 (#1 in queue, eta t=1200): within queue team-a's guarantee of 3 H100 GPUs (it would hold 3), but other queues hold that capacity on loan: it is taken back as borrowed jobs pass their minimum runtime, and leases their term; on H100: main: needs 3 whole GPUs (H100) on one node, 1 CPU: 1 node has too few free GPUs in the requested sharing mode
          pending job 2 (#1 in queue, eta t=1120): the free GPUs that would hold it are kept from new borrowing for job 1, within its queue's guarantee, which takes back the borrowed GPUs beside them from t=1200s; this job would borrow and not end before
        cycle t=1200
          preempt job 11 for job 1 (Reclaim): signal now, kill at t=1230, loses 0.08 GPU-h
          preempt job 12 for job 1 (Reclaim): signal now, kill at t=1230, loses 0.08 GPU-h
          preempt job 10 for job 1 (Reclaim): signal now, kill at t=1230, loses 0.33 GPU-h
          hold n1 for job 1 from t=1200
          nominate n1 for job 1 from t=1230
          pending job 1 (#1 in queue, eta t=1230): waiting for 3 preempted job(s) to stop
          pending job 2 (#1 in queue, eta t=1200): needs 1 H100 GPUs of quota; org has 0 left to lend; the free GPUs that would hold it are kept from new borrowing for job 1, within its queue's guarantee, which takes back the borrowed GPUs beside them from t=1200s; this job would borrow and not end before
        cycle t=1210
          start job 1 on H100: n1[0,1,2]
          pending job 2 (#4 in queue, eta unknown): needs 1 H100 GPUs of quota; org has 0 left to lend; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode
          pending job 10 (#1 in queue, eta t=1210): needs 1 H100 GPUs of quota; org has 0 left to lend; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode
          pending job 11 (#2 in queue, eta unknown): needs 1 H100 GPUs of quota; org has 0 left to lend; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode
          pending job 12 (#3 in queue, eta unknown): needs 1 H100 GPUs of quota; org has 0 left to lend; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode
    "#]].assert_eq(&fixture("on"));
    // Without holds, job 2 (which would not end before) takes the free GPU
    // at once. Here the lender still starts at t=1210 on the other three
    // GPUs; with borrowers on every GPU that keep ending and starting (the
    // server test `lending.rs`), it waits as long as they come.
    expect![[r#"
        cycle t=1000
          start job 2 on H100: n1[3]
          pending job 1 (#1 in queue, eta unknown): within queue team-a's guarantee of 3 H100 GPUs (it would hold 3), but other queues hold that capacity on loan: it is taken back as borrowed jobs pass their minimum runtime, and leases their term; on H100: main: needs 3 whole GPUs (H100) on one node, 1 CPU: 1 node has too few free GPUs in the requested sharing mode
          pending job 3 (#1 in queue, eta unknown): needs 1 H100 GPUs of quota; org has 0 left to lend; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode
        cycle t=1200
          preempt job 11 for job 1 (Reclaim): signal now, kill at t=1230, loses 0.08 GPU-h
          preempt job 12 for job 1 (Reclaim): signal now, kill at t=1230, loses 0.08 GPU-h
          preempt job 10 for job 1 (Reclaim): signal now, kill at t=1230, loses 0.33 GPU-h
          nominate n1 for job 1 from t=1230
          pending job 1 (#1 in queue, eta t=1230): waiting for 3 preempted job(s) to stop
          pending job 3 (#1 in queue, eta unknown): needs 1 H100 GPUs of quota; org has 0 left to lend; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode
        cycle t=1210
          start job 1 on H100: n1[0,1,2]
          pending job 3 (#4 in queue, eta unknown): needs 1 H100 GPUs of quota; org has 0 left to lend; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode
          pending job 10 (#1 in queue, eta unknown): needs 1 H100 GPUs of quota; org has 0 left to lend; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode
          pending job 11 (#2 in queue, eta unknown): needs 1 H100 GPUs of quota; org has 0 left to lend; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode
          pending job 12 (#3 in queue, eta unknown): needs 1 H100 GPUs of quota; org has 0 left to lend; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode
    "#]].assert_eq(&fixture("off"));
}

#[test]
fn start_estimates_expect_jobs_to_run_as_long_as_their_users_recent_ones() {
    // Running jobs declare 24 h but their users' jobs of late ran about an
    // hour (`expected`, given by the edge): the jobs waiting behind them
    // are told when those are expected to end, not the latest they may.
    // A job past its expected runtime is expected to run as long again as
    // it has (job 11, 1,000 s in, expected 600 s); none past its declared
    // maximum (job 12). The three waiting jobs take the three ends in
    // turn. Without expectations, the declared ends.
    let fixture = |expected: [&str; 3]| {
        run(&format!(
            "
        node n1 gpus=2*H100
        node n2 gpus=1*H100
        queue team H100=3
        run 10 queue=team gpu=whole:1 cpu=1 started=0 runtime=86400 {}
        run 11 queue=team gpu=whole:1 cpu=1 started=0 runtime=86400 {}
        run 12 queue=team gpu=whole:1 cpu=1 started=0 runtime=1500 {}
        job 1 queue=team gpu=whole:1 cpu=1 runtime=86400
        job 2 queue=team gpu=whole:1 cpu=1 runtime=86400
        job 3 queue=team gpu=whole:1 cpu=1 runtime=86400
        cycle 1000
    ",
            expected[0], expected[1], expected[2]
        ))
    };
    expect![[r#"
        cycle t=1000
          pending job 1 (#1 in queue, eta t=1500): needs 1 H100 GPUs of quota; the cluster has 0 left to lend; on H100: main: needs 1 whole GPU (H100), 1 CPU: 2 nodes have too few free GPUs in the requested sharing mode
          pending job 2 (#2 in queue, eta t=2000): needs 1 H100 GPUs of quota; the cluster has 0 left to lend; on H100: main: needs 1 whole GPU (H100), 1 CPU: 2 nodes have too few free GPUs in the requested sharing mode
          pending job 3 (#3 in queue, eta t=3600): needs 1 H100 GPUs of quota; the cluster has 0 left to lend; on H100: main: needs 1 whole GPU (H100), 1 CPU: 2 nodes have too few free GPUs in the requested sharing mode
    "#]]
    .assert_eq(&fixture(["expected=3600", "expected=600", "expected=7200"]));
    expect![[r#"
        cycle t=1000
          pending job 1 (#1 in queue, eta t=1500): needs 1 H100 GPUs of quota; the cluster has 0 left to lend; on H100: main: needs 1 whole GPU (H100), 1 CPU: 2 nodes have too few free GPUs in the requested sharing mode
          pending job 2 (#2 in queue, eta t=86400): needs 1 H100 GPUs of quota; the cluster has 0 left to lend; on H100: main: needs 1 whole GPU (H100), 1 CPU: 2 nodes have too few free GPUs in the requested sharing mode
          pending job 3 (#3 in queue, eta t=86400): needs 1 H100 GPUs of quota; the cluster has 0 left to lend; on H100: main: needs 1 whole GPU (H100), 1 CPU: 2 nodes have too few free GPUs in the requested sharing mode
    "#]].assert_eq(&fixture(["", "", ""]));
}

#[test]
fn a_held_queues_job_takes_no_capacity_from_the_estimates_behind_it() {
    // Quotas off (as in the Slurm baselines): job 5, first in order but in
    // a held queue, starts nothing, so job 6 of another queue is estimated
    // at the first GPU to come free (t=500), not after job 5 took it.
    let out = run("
        node n1 gpus=2*H100
        queue org H100=2
        queue held parent=org H100=1 state=held
        queue open parent=org H100=1
        config quotas=off backfill=off
        run 10 queue=open gpu=whole:1 cpu=1 started=0 runtime=500
        run 11 queue=open gpu=whole:1 cpu=1 started=0 runtime=900
        job 5 queue=held gpu=whole:1 cpu=1 prio=9 runtime=100 submit=0
        job 6 queue=open gpu=whole:1 cpu=1 runtime=100 submit=5
        cycle 10
    ");
    expect![[r#"
        cycle t=10
          pending job 5 (#1 in queue, eta unknown): queue held is held: it accepts work but starts none; on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode
          pending job 6 (#1 in queue, eta t=500): on H100: main: needs 1 whole GPU (H100), 1 CPU: 1 node has too few free GPUs in the requested sharing mode
    "#]].assert_eq(&out);
}

/// Start estimates backfill: a short job behind a big one starts in the
/// gap before the big one's start, as the cycle would start it, instead
/// of after the big one (a strict order of starts said t=10800). Job 5,
/// as long as the gap and more, waits for the big one to end.
#[test]
fn a_short_jobs_estimate_backfills_the_gap_before_a_big_one() {
    let out = run("
        node n1 gpus=8*H100
        queue org H100=8
        config backfill=off
        run 1 queue=org gpu=whole:4 cpu=1 runtime=3600 started=0
        run 2 queue=org gpu=whole:4 cpu=1 runtime=600 started=0
        job 3 queue=org gpu=whole:8 cpu=1 runtime=7200
        job 4 queue=org gpu=whole:4 cpu=1 runtime=300
        job 5 queue=org gpu=whole:4 cpu=1 runtime=7200
        cycle 10
    ");
    expect![[r#"
        cycle t=10
          pending job 3 (#1 in queue, eta t=3600): needs 8 H100 GPUs of quota; the cluster has 0 left to lend; on H100: main: needs 8 whole GPUs (H100) on one node, 1 CPU: 1 node has too few free GPUs in the requested sharing mode
          pending job 4 (#2 in queue, eta t=600): needs 4 H100 GPUs of quota; the cluster has 0 left to lend; on H100: main: needs 4 whole GPUs (H100) on one node, 1 CPU: 1 node has too few free GPUs in the requested sharing mode
          pending job 5 (#3 in queue, eta t=10800): needs 4 H100 GPUs of quota; the cluster has 0 left to lend; on H100: main: needs 4 whole GPUs (H100) on one node, 1 CPU: 1 node has too few free GPUs in the requested sharing mode
    "#]]
    .assert_eq(&out);
}

/// A guarantee larger than the cluster, filled by the queue's own jobs,
/// is not lent: job 3 is told the cluster has nothing left, not that
/// other queues hold its capacity on loan (no other queue borrows).
#[test]
fn a_guarantee_the_queue_fills_itself_is_not_called_lent() {
    let out = run("
        node n1 gpus=8*H100
        queue org H100=16
        config backfill=off
        run 1 queue=org gpu=whole:8 cpu=1 runtime=3600 started=0
        job 3 queue=org gpu=whole:4 cpu=1 runtime=600
        cycle 10
    ");
    expect![[r#"
        cycle t=10
          pending job 3 (#1 in queue, eta t=3600): needs 4 H100 GPUs of quota; the cluster has 0 left to lend; on H100: main: needs 4 whole GPUs (H100) on one node, 1 CPU: 1 node has too few free GPUs in the requested sharing mode
    "#]]
    .assert_eq(&out);
}

/// A job kept off the nodes held for a lender's reclaim waits for its own
/// queue's work to end, as a job over its quota does, not for GPUs to be
/// free somewhere. Queue a reclaims all four GPUs of n1 for job 1; two
/// are free now, but held. Queue b's job 3 would borrow: it cannot have
/// them while they are held, nor once job 1 holds the node. Its estimate
/// said t=1000 (the held GPUs counted as free); its queue's running jobs
/// are expected to end at t=2000 and t=2050 (they are preempted sooner,
/// and job 1 then holds n1 to about t=5000, so it is still early, but no
/// longer "now").
#[test]
fn a_job_kept_off_nodes_held_for_a_reclaim_waits_for_its_own_queue() {
    let out = run("
        config min_runtime=600 budget=none max_unsaved=none underserved_pass=0
        node n1 gpus=4*H100
        queue a H100=4
        queue b H100=0
        run 10 queue=b class=batch gpu=whole:1 cpu=1 started=900 runtime=7200 expected=1100
        run 11 queue=b class=batch gpu=whole:1 cpu=1 started=950 runtime=7200 expected=1100
        job 1 queue=a class=training gpu=whole:4 cpu=1 runtime=3600
        job 3 queue=b class=batch gpu=whole:1 cpu=1 runtime=600 expected=600
        cycle 1000
    ");
    expect![[r#"
        cycle t=1000
          hold n1 for job 1 from t=1550
          pending job 1 (#1 in queue, eta t=1550): within queue a's guarantee of 4 H100 GPUs (it would hold 4), but other queues hold that capacity on loan: it is taken back as borrowed jobs pass their minimum runtime, and leases their term; on H100: main: needs 4 whole GPUs (H100) on one node, 1 CPU: 1 node has too few free GPUs in the requested sharing mode
          pending job 3 (#1 in queue, eta t=2000): the free GPUs that would hold it are kept from new borrowing for job 1, within its queue's guarantee, which takes back the borrowed GPUs beside them from t=1550s; this job would borrow and not end before
    "#]]
    .assert_eq(&out);
}

//! Invariants of placement over random clusters and random sequences of
//! placements, releases, cordons and GPU failures.

use std::collections::BTreeMap;

use gpuflow_core::*;
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    Place(Job),
    Release(usize),
    Cordon(usize, bool),
    Health(usize, usize, bool),
}

fn gpu_request() -> impl Strategy<Value = GpuRequest> {
    prop_oneof![
        Just(GpuRequest::None),
        (1u8..=4).prop_map(|count| GpuRequest::Whole { count }),
        ((1u32..=10), (0u64..=3)).prop_map(|(m, g)| GpuRequest::Fraction {
            milli: GpuMilli(m * 100),
            mem: MemMib(g * 8192)
        }),
        prop_oneof![Just("1g"), Just("2g")].prop_map(|p| GpuRequest::Mig {
            profile: p.to_string()
        }),
        (0u64..=2).prop_map(|g| GpuRequest::TimeSlice {
            mem: MemMib(g * 8192)
        }),
    ]
}

fn job(id: u64) -> impl Strategy<Value = Job> {
    let group = (
        1u32..=3,
        gpu_request(),
        0u64..=8,
        prop::option::weighted(0.2, prop_oneof![Just("A"), Just("B")]),
    );
    let topology = prop::option::weighted(
        0.4,
        (
            prop_oneof![
                Just(TopologyLevel::Node),
                Just(TopologyLevel::Rack),
                Just(TopologyLevel::NvLink)
            ],
            any::<bool>(),
        )
            .prop_map(|(level, required)| Topology { level, required }),
    );
    (
        prop::collection::vec(group, 1..=2),
        topology,
        prop::bool::weighted(0.2),
    )
        .prop_map(move |(groups, topology, spread)| Job {
            id: JobId(id),
            groups: groups
                .into_iter()
                .enumerate()
                .map(|(i, (replicas, gpu, cpu, model))| TaskGroup {
                    name: format!("g{i}"),
                    replicas,
                    request: TaskRequest {
                        cpu: CpuMilli(cpu * 1000),
                        mem: MemMib(cpu * 4096),
                        gpu,
                        models: model.map(|m| vec![m.to_string()]).unwrap_or_default(),
                    },
                })
                .collect(),
            constraints: Constraints {
                topology,
                spread,
                ..Default::default()
            },
        })
}

fn node(id: u32) -> impl Strategy<Value = Node> {
    (
        1usize..=8,
        prop_oneof![Just("A"), Just("B")],
        4u64..=64,
        0u32..3,
        any::<bool>(),
        1u16..=3,
        prop::bool::weighted(0.25),
    )
        .prop_map(move |(gpus, model, cpu, mig_kind, nvlink, slices, mig)| {
            let name = format!("n{id}");
            let mut n = Node::new(
                id,
                &name,
                CpuMilli(cpu * 1000),
                MemMib(cpu * 8192),
                Vec::new(),
            );
            n.rack = Some(format!("r{}", id % 2));
            n.gpus = (0..gpus)
                .map(|i| {
                    let mut g = Gpu::plain(model, MemMib(24_576));
                    g.numa = (i % 2) as u8;
                    g.time_slices = slices;
                    if nvlink {
                        g.nvlink = Some(format!("{name}/nvl{}", i / 4));
                    }
                    if mig && i % 2 == 0 {
                        let p = if mig_kind == 0 { "1g" } else { "2g" };
                        g.mig = (0..3)
                            .map(|_| MigInstance {
                                profile: p.to_string(),
                                mem: MemMib(8192),
                            })
                            .collect();
                    }
                    g
                })
                .collect();
            n
        })
}

fn scenario() -> impl Strategy<Value = (Vec<Node>, Vec<Op>, u64, usize)> {
    (1usize..=6).prop_flat_map(|n| {
        let nodes = (0..n as u32).map(node).collect::<Vec<_>>();
        let ops = prop::collection::vec(
            prop_oneof![
                6 => (0u64..1_000_000).prop_flat_map(job).prop_map(Op::Place),
                2 => any::<prop::sample::Index>().prop_map(|i| Op::Release(i.index(1 << 20))),
                1 => (0..n, any::<bool>()).prop_map(|(i, c)| Op::Cordon(i, c)),
                1 => (0..n, 0usize..8, any::<bool>()).prop_map(|(i, g, h)| Op::Health(i, g, h)),
            ],
            1..40,
        );
        (nodes, ops, any::<u64>(), 0usize..Policy::NAMES.len())
    })
}

/// Replays the ops, checking invariants after each; returns what each op
/// produced. With `trials`, each placement is preceded by trials that leave
/// usage as it was: the job placed and given back, and a live job given back
/// and taken again (as a victim search does).
fn replay(
    nodes: &[Node],
    ops: &[Op],
    seed: u64,
    policy: usize,
    trials: bool,
) -> Result<Vec<String>, TestCaseError> {
    replay_with(nodes, ops, seed, policy, trials, None)
}

/// [`replay`]; with `remix`, before each placement the placer plans for
/// that other mix, tries the job under it (in a trial), and is given its
/// own mix back, as a simulator's placer is given a new mix every cycle.
fn replay_with(
    nodes: &[Node],
    ops: &[Op],
    seed: u64,
    policy: usize,
    trials: bool,
    remix: Option<&WorkloadMix>,
) -> Result<Vec<String>, TestCaseError> {
    let policy = Policy::named(Policy::NAMES[policy]).unwrap();
    let tasks: Vec<TaskRequest> = ops
        .iter()
        .filter_map(|o| if let Op::Place(j) = o { Some(j) } else { None })
        .flat_map(|j| j.groups.iter().map(|g| g.request.clone()))
        .collect();
    let mix = WorkloadMix::from_tasks(&tasks, MixWeighting::Tasks, 1.0);
    let mut placer = Placer::new(
        Cluster::new(nodes.to_vec()).unwrap(),
        policy,
        mix.clone(),
        seed,
    );
    let mut live: Vec<(Job, Vec<Allocation>)> = Vec::new();
    let mut log = Vec::new();
    for (n, op) in ops.iter().enumerate() {
        match op {
            Op::Place(job) => {
                if let Some(other) = remix {
                    placer.set_mix(other.clone());
                    let t = placer.begin_trial();
                    if let Ok(q) = placer.place_job(job) {
                        placer.release(&q);
                    }
                    placer.end_trial(t);
                    placer.set_mix(mix.clone());
                }
                if trials {
                    let t = placer.begin_trial();
                    if let Some((_, p)) = live.get(n % live.len().max(1)) {
                        placer.release(p);
                        // Asked with a live job given back, as a victim
                        // search asks: the existence test answers as a
                        // trial placement does.
                        let fits = placer.fits_job(job);
                        let q = placer.try_place_job(job);
                        prop_assert_eq!(fits, q.is_some(), "fits_job and try_place_job disagree");
                        if let Some(q) = q {
                            placer.release(&q);
                        }
                        placer.restore(p);
                    }
                    if let Ok(q) = placer.place_job(job) {
                        placer.release(&q);
                    }
                    placer.end_trial(t);
                }
                let before: Vec<NodeUsage> = nodes
                    .iter()
                    .map(|n| placer.cluster().usage(n.id).clone())
                    .collect();
                // A trial placement (no explanation) decides exactly as a real one.
                let trial = placer.clone().try_place_job(job);
                let real = placer.clone().place_job(job).ok();
                prop_assert_eq!(&trial, &real, "try_place_job and place_job disagree");
                // Whether it fits, without choosing where: what it
                // remembers from earlier ops (a class that fitted, the
                // moment none did) stays true as nodes fill, empty,
                // cordon and fail.
                prop_assert_eq!(
                    placer.fits_job(job),
                    trial.is_some(),
                    "fits_job and try_place_job disagree"
                );
                prop_assert_eq!(
                    &placer.trial_place(job),
                    &trial,
                    "trial_place and try_place_job disagree"
                );
                match placer.place_job(job) {
                    Ok(p) => {
                        // Gangs whole: one allocation per task, each task once.
                        prop_assert_eq!(p.len() as u64, job.task_count());
                        let mut ids: Vec<TaskId> = p.iter().map(|a| a.task).collect();
                        ids.sort();
                        ids.dedup();
                        prop_assert_eq!(ids.len(), p.len());
                        for a in &p {
                            let n = placer.cluster().node(a.node);
                            let req = &job.groups[a.task.group as usize].request;
                            prop_assert_eq!(
                                n.state,
                                NodeState::Ready,
                                "new work on a node that is not ready"
                            );
                            for g in a.gpu_indices() {
                                let gpu = &n.gpus[g as usize];
                                prop_assert_eq!(
                                    gpu.health,
                                    GpuHealth::Healthy,
                                    "new work on an unhealthy GPU"
                                );
                                prop_assert!(
                                    req.models.is_empty() || req.models.contains(&gpu.model)
                                );
                            }
                        }
                        if let Some(t) = job.constraints.topology.filter(|t| t.required) {
                            let key = |a: &Allocation| -> Vec<Option<String>> {
                                let n = placer.cluster().node(a.node);
                                match t.level {
                                    TopologyLevel::Node => vec![Some(n.name.clone())],
                                    TopologyLevel::Rack => vec![n.rack.clone()],
                                    TopologyLevel::Block => vec![n.block.clone()],
                                    TopologyLevel::NvLink => a
                                        .gpu_indices()
                                        .iter()
                                        .map(|&g| n.gpus[g as usize].nvlink.clone())
                                        .collect(),
                                }
                            };
                            let mut keys: Vec<Option<String>> = p.iter().flat_map(key).collect();
                            keys.sort();
                            keys.dedup();
                            prop_assert!(
                                keys.len() <= 1,
                                "required {:?} spans {:?}",
                                t.level,
                                keys
                            );
                            prop_assert!(keys.iter().all(|k| k.is_some()));
                        }
                        log.push(format!(
                            "{:?}",
                            p.iter().map(|a| (a.node, a.pick)).collect::<Vec<_>>()
                        ));
                        live.push((job.clone(), p));
                    }
                    Err(u) => {
                        // None placed: usage unchanged.
                        let after: Vec<NodeUsage> = nodes
                            .iter()
                            .map(|n| placer.cluster().usage(n.id).clone())
                            .collect();
                        prop_assert_eq!(before, after, "a failed gang left allocations behind");
                        log.push(u.to_string());
                    }
                }
            }
            Op::Release(i) => {
                if !live.is_empty() {
                    let (_, p) = live.remove(i % live.len());
                    placer.release(&p);
                    log.push("release".to_string());
                }
            }
            Op::Cordon(i, c) => placer.set_node_state(
                NodeId(*i as u32),
                if *c {
                    NodeState::Cordoned
                } else {
                    NodeState::Ready
                },
            ),
            Op::Health(i, g, h) => placer.set_gpu_health(
                NodeId(*i as u32),
                *g,
                if *h {
                    GpuHealth::Healthy
                } else {
                    GpuHealth::Unhealthy
                },
            ),
        }
        check_no_overcommit(placer.cluster(), &live)?;
    }
    Ok(log)
}

/// Recounts every GPU, CPU and memory from the live allocations.
fn check_no_overcommit(c: &Cluster, live: &[(Job, Vec<Allocation>)]) -> Result<(), TestCaseError> {
    #[derive(Default)]
    struct G {
        exclusive: u32,
        milli: u32,
        mem: u64,
        slices: u16,
        mig: Vec<u8>,
    }
    let mut gpus: BTreeMap<(NodeId, u8), G> = BTreeMap::new();
    let mut cpu: BTreeMap<NodeId, (u64, u64)> = BTreeMap::new();
    for a in live.iter().flat_map(|(_, p)| p) {
        let e = cpu.entry(a.node).or_default();
        e.0 += a.cpu.0;
        e.1 += a.mem.0;
        match (&a.gpu, a.pick) {
            (GpuRequest::Whole { .. }, GpuPick::Whole(_)) => {
                for g in a.gpu_indices() {
                    gpus.entry((a.node, g)).or_default().exclusive += 1;
                }
            }
            (GpuRequest::Fraction { milli, mem }, GpuPick::Shared(g)) => {
                let e = gpus.entry((a.node, g)).or_default();
                e.milli += milli.0;
                e.mem += mem.0;
            }
            (GpuRequest::TimeSlice { mem }, GpuPick::Shared(g)) => {
                let e = gpus.entry((a.node, g)).or_default();
                e.slices += 1;
                e.mem += mem.0;
            }
            (GpuRequest::Mig { profile }, GpuPick::Mig { gpu, instance }) => {
                let m = &c.node(a.node).gpus[gpu as usize].mig;
                prop_assert!(
                    m.get(instance as usize)
                        .is_some_and(|i| i.profile == *profile),
                    "wrong MIG profile"
                );
                gpus.entry((a.node, gpu)).or_default().mig.push(instance);
            }
            (GpuRequest::None, GpuPick::None) => {}
            (r, p) => prop_assert!(false, "request {r:?} got pick {p:?}"),
        }
    }
    for (node, (cpu_used, mem_used)) in &cpu {
        let n = c.node(*node);
        prop_assert!(
            *cpu_used <= n.cpu.0 && *mem_used <= n.mem.0,
            "CPU or memory over-committed on {}",
            n.name
        );
        prop_assert_eq!(c.usage(*node).cpu, *cpu_used);
    }
    for ((node, g), u) in &gpus {
        let gpu = &c.node(*node).gpus[*g as usize];
        let modes = (u.exclusive > 0) as u8
            + (u.milli > 0 || (u.mem > 0 && u.slices == 0)) as u8
            + (u.slices > 0) as u8
            + (!u.mig.is_empty()) as u8;
        prop_assert!(modes <= 1, "sharing modes mixed on one GPU");
        prop_assert!(u.exclusive <= 1, "an exclusive GPU given twice");
        prop_assert!(u.milli <= 1000, "GPU compute over-committed: {}", u.milli);
        prop_assert!(u.mem <= gpu.mem.0, "GPU memory over-committed");
        prop_assert!(u.slices <= gpu.time_slices, "too many time slices");
        let mut m = u.mig.clone();
        m.sort();
        m.dedup();
        prop_assert_eq!(m.len(), u.mig.len(), "a MIG instance given twice");
        prop_assert!(
            gpu.mig.is_empty() || (u.exclusive == 0 && u.milli == 0 && u.slices == 0),
            "non-MIG work on a MIG GPU"
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn placement_keeps_every_invariant_and_is_deterministic((nodes, ops, seed, policy) in scenario()) {
        let first = replay(&nodes, &ops, seed, policy, false)?;
        let second = replay(&nodes, &ops, seed, policy, false)?;
        prop_assert_eq!(first, second, "equal inputs gave different placements");
    }

    /// Trial placements (and releases taken back) inside a trial change no
    /// later decision: what only explains or tests cannot steer the plan.
    #[test]
    fn trials_leave_no_trace_on_later_placements((nodes, ops, seed, policy) in scenario()) {
        let plain = replay(&nodes, &ops, seed, policy, false)?;
        let with_trials = replay(&nodes, &ops, seed, policy, true)?;
        prop_assert_eq!(plain, with_trials, "a trial changed a later placement");
    }

    /// What the placer keeps when its mix changes (rejections, which never
    /// read the mix) changes no decision: evaluations made under another
    /// mix do not steer placements under its own.
    #[test]
    fn a_new_mix_keeps_nothing_that_steers_placements((nodes, ops, seed, policy) in scenario()) {
        // Whole 8-GPU tasks only: fragmentation scores far from the jobs' own mix.
        let other = WorkloadMix::from_tasks(
            &[TaskRequest {
                cpu: CpuMilli(1000),
                mem: MemMib(1024),
                gpu: GpuRequest::Whole { count: 8 },
                models: Vec::new(),
            }],
            MixWeighting::Tasks,
            1.0,
        );
        let plain = replay(&nodes, &ops, seed, policy, false)?;
        let remixed = replay_with(&nodes, &ops, seed, policy, false, Some(&other))?;
        prop_assert_eq!(plain, remixed, "a mix planned for before changed a placement");
    }
}

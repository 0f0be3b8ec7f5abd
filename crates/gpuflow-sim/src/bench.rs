//! The placement benchmark: a synthetic cluster of racks of mixed GPU nodes and a
//! seeded stream of tasks of mixed shapes, with departures that hold the
//! cluster near a target allocation so that decisions are made on a busy,
//! fragmented cluster rather than an empty one.

use gpuflow_core::{
    Allocation, Cluster, Constraints, CpuMilli, Gpu, GpuMilli, GpuRequest, Job, JobId, MemMib,
    MixWeighting, Node, Placer, Policy, SplitMix64, TaskGroup, TaskRequest, Topology,
    TopologyLevel, WorkloadMix,
};

use crate::error::SimError;

/// The synthetic cluster and workload.
#[derive(Clone, Debug)]
pub struct BenchConfig {
    pub nodes: u32,
    pub gpus_per_node: u32,
    pub rack_size: u32,
    pub tasks: u32,
    /// Share of GPU capacity above which running jobs are released at random.
    pub target_allocation: f64,
    /// Share of jobs that are 4-task gangs asking for one rack (preferred).
    pub gang_share: f64,
    pub seed: u64,
}

impl Default for BenchConfig {
    fn default() -> BenchConfig {
        BenchConfig {
            nodes: 10_000,
            gpus_per_node: 8,
            rack_size: 32,
            tasks: 100_000,
            target_allocation: 0.85,
            gang_share: 0.0,
            seed: 1,
        }
    }
}

const MODELS: &[(&str, u64, u32)] = &[
    ("H100", 81_920, 40),
    ("A100", 81_920, 30),
    ("L4", 24_576, 20),
    ("A10", 24_576, 10),
];

/// Builds the synthetic cluster: models by share, racks of `rack_size`, blocks of 8 racks,
/// two NVLink islands per node on H100 and A100.
pub fn cluster(cfg: &BenchConfig) -> Vec<Node> {
    let mut rng = SplitMix64::new(cfg.seed ^ 0xC1C1);
    (0..cfg.nodes)
        .map(|i| {
            let mut pick = rng.below(100) as u32;
            let &(model, mem, _) = MODELS
                .iter()
                .find(|(_, _, share)| {
                    if pick < *share {
                        true
                    } else {
                        pick -= share;
                        false
                    }
                })
                .unwrap_or(&MODELS[0]);
            let name = format!("node-{i:05}");
            let gpus = (0..cfg.gpus_per_node)
                .map(|g| {
                    let mut gpu = Gpu::plain(model, MemMib(mem));
                    gpu.numa = (g * 2 / cfg.gpus_per_node.max(1)) as u8;
                    if model == "H100" || model == "A100" {
                        gpu.nvlink = Some(format!("{name}/nvl{}", g / 4));
                    }
                    gpu
                })
                .collect();
            let cpu = if i % 3 == 0 { 96_000 } else { 128_000 };
            let mut node = Node::new(i, &name, CpuMilli(cpu), MemMib(1_048_576), gpus);
            let rack = i / cfg.rack_size;
            node.rack = Some(format!("rack-{rack:04}"));
            node.block = Some(format!("block-{:03}", rack / 8));
            node
        })
        .collect()
}

/// One task shape of the synthetic stream.
fn task(rng: &mut SplitMix64) -> TaskRequest {
    let r = rng.below(100);
    let (gpu, cpu) = match r {
        0..=4 => (GpuRequest::None, 4_000),
        5..=19 => (
            GpuRequest::Fraction {
                milli: GpuMilli(250),
                mem: MemMib(10_240),
            },
            2_000,
        ),
        20..=34 => (
            GpuRequest::Fraction {
                milli: GpuMilli(500),
                mem: MemMib(20_480),
            },
            4_000,
        ),
        35..=64 => (GpuRequest::Whole { count: 1 }, 8_000),
        65..=79 => (GpuRequest::Whole { count: 2 }, 16_000),
        80..=89 => (GpuRequest::Whole { count: 4 }, 32_000),
        _ => (GpuRequest::Whole { count: 8 }, 64_000),
    };
    let models = match rng.below(10) {
        0 => vec!["H100".to_string()],
        1 => vec!["A100".to_string(), "H100".to_string()],
        2 => vec!["L4".to_string()],
        _ => Vec::new(),
    };
    TaskRequest {
        cpu: CpuMilli(cpu),
        mem: MemMib(cpu / 1000 * 8192),
        gpu,
        models,
    }
}

/// The seeded job stream: mostly single tasks, some 4-task gangs.
pub fn jobs(cfg: &BenchConfig) -> Vec<Job> {
    let mut rng = SplitMix64::new(cfg.seed);
    let mut jobs = Vec::new();
    let mut tasks = 0u32;
    while tasks < cfg.tasks {
        let id = jobs.len() as u64;
        let request = task(&mut rng);
        let gang = (rng.below(10_000) as f64) < cfg.gang_share * 10_000.0;
        let job = if gang {
            Job {
                id: JobId(id),
                groups: vec![TaskGroup {
                    name: "worker".to_string(),
                    replicas: 4,
                    request,
                }],
                constraints: Constraints {
                    topology: Some(Topology {
                        level: TopologyLevel::Rack,
                        required: false,
                    }),
                    ..Constraints::default()
                },
            }
        } else {
            Job::single(id, request)
        };
        tasks += job.task_count() as u32;
        jobs.push(job);
    }
    jobs
}

/// What a benchmark run did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BenchOutcome {
    pub jobs: u64,
    pub tasks: u64,
    pub placed_jobs: u64,
    pub released_jobs: u64,
    /// Mean GPU allocation over the run's decisions, as a share of capacity.
    pub mean_allocation: f64,
}

/// Places every job in order; after each, releases random running jobs while
/// allocation is above the target. The caller times it.
///
/// # Errors
/// When the synthetic cluster is invalid (it is not, unless the config is absurd).
pub fn run(
    nodes: Vec<Node>,
    jobs: &[Job],
    policy: Policy,
    cfg: &BenchConfig,
) -> Result<BenchOutcome, SimError> {
    let capacity: u64 = nodes.iter().map(|n| n.gpus.len() as u64 * 1000).sum();
    let cluster = Cluster::new(nodes).map_err(|e| SimError::Invalid(e.to_string()))?;
    let mix = WorkloadMix::from_groups(
        jobs.iter().flat_map(|j| &j.groups),
        MixWeighting::Tasks,
        1.0,
    );
    let mut placer = Placer::new(cluster, policy, mix, cfg.seed);
    let mut rng = SplitMix64::new(cfg.seed ^ 0xDEAD);
    let mut running: Vec<(Vec<Allocation>, u64)> = Vec::new();
    let mut out = BenchOutcome::default();
    let (mut allocated, mut alloc_sum) = (0u64, 0f64);
    let limit = (capacity as f64 * cfg.target_allocation) as u64;
    for job in jobs {
        out.jobs += 1;
        out.tasks += job.task_count();
        if let Ok(p) = placer.place_job(job) {
            let milli: u64 = p.iter().map(|a| a.gpu.milli()).sum();
            allocated += milli;
            out.placed_jobs += 1;
            running.push((p, milli));
        }
        while allocated > limit && !running.is_empty() {
            let i = rng.below(running.len() as u64) as usize;
            let (p, milli) = running.swap_remove(i);
            placer.release(&p);
            allocated -= milli;
            out.released_jobs += 1;
        }
        alloc_sum += allocated as f64 / capacity as f64;
    }
    out.mean_allocation = alloc_sum / out.jobs.max(1) as f64;
    Ok(out)
}

/// Peak resident memory of this process in MiB (Linux), if it can be read.
pub fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

/// The scheduling-cycle benchmark: a busy synthetic cluster, a queue tree
/// (organisation → teams → projects) and a large backlog.
#[derive(Clone, Debug)]
pub struct CycleBench {
    pub nodes: u32,
    pub teams: u32,
    pub projects_per_team: u32,
    pub pending: u32,
    /// Share of GPU capacity already running when the cycles start.
    pub running_share: f64,
    /// Priority classes (indices into the default classes) jobs are drawn from.
    pub classes: Vec<usize>,
    pub seed: u64,
}

impl Default for CycleBench {
    fn default() -> CycleBench {
        CycleBench {
            nodes: 10_000,
            teams: 40,
            projects_per_team: 24,
            pending: 100_000,
            running_share: 0.85,
            classes: vec![0, 1, 2, 3],
            seed: 1,
        }
    }
}

/// What a cycle did and how long it took (measured by the caller's clock).
#[derive(Clone, Debug, Default)]
pub struct CycleFigures {
    pub queues: usize,
    pub running: usize,
    pub pending: usize,
    pub admitted: usize,
    pub preempted: usize,
}

/// The state the cycles run on.
pub struct CycleWorld {
    pub placer: Placer,
    pub queues: gpuflow_core::queue::Queues,
    pub running: Vec<gpuflow_core::schedule::Running>,
    pub pending: Vec<gpuflow_core::schedule::Workload>,
    pub history: gpuflow_core::schedule::History,
    pub config: gpuflow_core::schedule::Config,
    pub now: u64,
    rng: SplitMix64,
    next_id: u64,
    classes: Vec<usize>,
}

impl CycleWorld {
    /// Builds the cluster, fills it to `running_share` with running jobs and queues the backlog.
    ///
    /// # Errors
    /// When the synthetic cluster is invalid.
    pub fn build(b: &CycleBench) -> Result<CycleWorld, SimError> {
        use gpuflow_core::queue::{FlavorQuota, Queue, QueueId, Queues};
        let cfg = BenchConfig {
            nodes: b.nodes,
            seed: b.seed,
            ..BenchConfig::default()
        };
        let nodes = cluster(&cfg);
        let mut capacity: std::collections::BTreeMap<String, u64> = Default::default();
        for g in nodes.iter().flat_map(|n| &n.gpus) {
            *capacity.entry(g.model.clone()).or_default() += 1000;
        }
        let leaves = (b.teams * b.projects_per_team).max(1) as u64;
        let mut list = vec![Queue::new("org", None)];
        for (f, c) in &capacity {
            list[0]
                .quotas
                .insert(f.clone(), FlavorQuota::guaranteed(*c));
        }
        for t in 0..b.teams {
            let mut team = Queue::new(&format!("team-{t:03}"), Some(QueueId(0)));
            for (f, c) in &capacity {
                team.quotas.insert(
                    f.clone(),
                    FlavorQuota::guaranteed(c / b.teams.max(1) as u64),
                );
            }
            list.push(team);
        }
        for t in 0..b.teams {
            for p in 0..b.projects_per_team {
                let mut q = Queue::new(&format!("team-{t:03}/proj-{p:02}"), Some(QueueId(1 + t)));
                for (f, c) in &capacity {
                    q.quotas
                        .insert(f.clone(), FlavorQuota::guaranteed(c / leaves));
                }
                list.push(q);
            }
        }
        let queues =
            Queues::new(list, capacity.clone()).map_err(|e| SimError::Invalid(e.to_string()))?;
        let total: u64 = capacity.values().sum();
        let placer = Placer::new(
            Cluster::new(nodes).map_err(|e| SimError::Invalid(e.to_string()))?,
            Policy::gpuflow(),
            WorkloadMix::default(),
            b.seed,
        );
        let mut w = CycleWorld {
            placer,
            queues,
            running: Vec::new(),
            pending: Vec::new(),
            history: Default::default(),
            config: Default::default(),
            now: 100_000,
            rng: SplitMix64::new(b.seed ^ 0xC7C1E),
            next_id: 0,
            classes: if b.classes.is_empty() {
                vec![0, 1, 2, 3]
            } else {
                b.classes.clone()
            },
        };
        let first_leaf = 1 + b.teams;
        // Fill the cluster with running jobs, each charged to a leaf within its guarantee.
        let mut used = 0u64;
        let mut misses = 0;
        while (used as f64) < b.running_share * total as f64 && misses < 1000 {
            let work = w.work(first_leaf, leaves as u32);
            match w.placer.place_job(&work.job) {
                Ok(p) => {
                    let model = p.iter().find_map(|a| {
                        a.gpu_indices().first().map(|&g| {
                            w.placer.cluster().node(a.node).gpus[g as usize]
                                .model
                                .clone()
                        })
                    });
                    let flavor = model.unwrap_or_default();
                    let mut work = work;
                    if !flavor.is_empty() {
                        // Charge it to a queue with room in its guarantee, so the
                        // start state is one a quota-respecting scheduler could reach.
                        let need = work.gpu_milli();
                        let fits = |w: &CycleWorld, q: gpuflow_core::queue::QueueId| {
                            w.queues.usage(q, &flavor) + need
                                <= w.queues.get(q).quota(&flavor).guaranteed
                        };
                        let mut tries = 0;
                        while !fits(&w, work.queue) && tries < 64 {
                            work.queue = gpuflow_core::queue::QueueId(
                                first_leaf + w.rng.below(leaves) as u32,
                            );
                            tries += 1;
                        }
                        if !fits(&w, work.queue) {
                            w.placer.release(&p);
                            misses += 1;
                            continue;
                        }
                        w.queues
                            .charge(work.queue, &flavor, work.gpu_milli() as i64);
                    }
                    used += work.gpu_milli();
                    let started = w.now - w.rng.below(50_000);
                    w.running.push(gpuflow_core::schedule::Running {
                        work,
                        flavor,
                        allocations: p,
                        started,
                        last_checkpoint: None,
                        stopping_at: None,
                    });
                }
                Err(_) => misses += 1,
            }
        }
        for _ in 0..b.pending {
            let work = w.work(first_leaf, leaves as u32);
            w.pending.push(work);
        }
        Ok(w)
    }

    fn work(&mut self, first_leaf: u32, leaves: u32) -> gpuflow_core::schedule::Workload {
        let mut req = task(&mut self.rng);
        req.models.clear();
        let id = self.next_id;
        self.next_id += 1;
        let class = self.classes
            [self.rng.below(self.classes.len().max(1) as u64) as usize % self.classes.len().max(1)];
        gpuflow_core::schedule::Workload {
            job: Job::single(id, req),
            queue: gpuflow_core::queue::QueueId(first_leaf + self.rng.below(leaves as u64) as u32),
            user: format!("user-{}", self.rng.below(100)),
            class,
            priority: 0,
            submitted: self.now - self.rng.below(10_000),
            max_runtime: Some(3600 + self.rng.below(36_000)),
            grace: 30,
            expected_runtime: None,
        }
    }

    /// Gives the queues decayed usage as on a cluster that has run for a
    /// while: each leaf between 0.2 and 1.8 times a day of its guarantee
    /// (drawn from the seed), each inner queue the sum of its children's.
    /// Victim searches are then paced (disruption budgets, reclaim fairness)
    /// for the queues at or above their share; without it every queue is
    /// below its share, and no search is.
    pub fn seed_history(&mut self) {
        use gpuflow_core::queue::QueueId;
        let n = self.queues.list().len();
        let mut usage = vec![0.0f64; n];
        for q in 0..n {
            let id = QueueId(q as u32);
            if !self.queues.is_leaf(id) {
                continue;
            }
            let guaranteed: u64 = self
                .queues
                .get(id)
                .quotas
                .values()
                .map(|f| f.guaranteed)
                .sum();
            let draw = (self.rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
            let used = guaranteed as f64 / 1000.0 * 24.0 * (0.2 + 1.6 * draw);
            for a in self.queues.path(id) {
                usage[a.0 as usize] += used;
            }
        }
        self.history.usage = usage
            .into_iter()
            .enumerate()
            .map(|(q, u)| (QueueId(q as u32), u))
            .collect();
        self.history.decayed_at = self.now;
    }

    /// One cycle: applies the plan (admitted jobs run; victims stop at once).
    pub fn cycle(&mut self) -> CycleFigures {
        self.cycle_observed(|_, _| {})
    }

    /// [`CycleWorld::cycle`], calling `done` as each of the core's phases
    /// ends ([`gpuflow_core::schedule::schedule_observed`]).
    pub fn cycle_observed(
        &mut self,
        done: impl FnMut(gpuflow_core::schedule::Phase, &gpuflow_core::schedule::Tally),
    ) -> CycleFigures {
        // The placement's mix is the pending work's, as the server and the
        // simulator set it each cycle.
        self.placer
            .set_mix(gpuflow_core::schedule::pending_mix(&self.pending));
        let plan = gpuflow_core::schedule::schedule_observed(
            gpuflow_core::schedule::Snapshot {
                now: self.now,
                placer: &mut self.placer,
                queues: &mut self.queues,
                running: &self.running,
                pending: &self.pending,
                cfg: &self.config,
            },
            &mut self.history,
            done,
        );
        let figures = CycleFigures {
            queues: self.queues.list().len(),
            running: self.running.len(),
            pending: self.pending.len(),
            admitted: plan.admitted.len(),
            preempted: plan.preempted.len(),
        };
        let admitted: std::collections::BTreeMap<JobId, (String, Vec<Allocation>)> = plan
            .admitted
            .into_iter()
            .map(|(id, f, p)| (id, (f, p)))
            .collect();
        // Admitted jobs leave the backlog (which keeps its order) and run.
        if !admitted.is_empty() {
            let started: Vec<gpuflow_core::schedule::Workload> = self
                .pending
                .extract_if(.., |w| admitted.contains_key(&w.job.id))
                .collect();
            for w in started {
                let (f, p) = &admitted[&w.job.id];
                self.running.push(gpuflow_core::schedule::Running {
                    work: w,
                    flavor: f.clone(),
                    allocations: p.clone(),
                    started: self.now,
                    last_checkpoint: None,
                    stopping_at: None,
                });
            }
        }
        let victims: std::collections::BTreeSet<JobId> =
            plan.preempted.iter().map(|p| p.victim).collect();
        let mut i = 0;
        while i < self.running.len() {
            if victims.contains(&self.running[i].work.job.id) {
                let r = self.running.swap_remove(i);
                self.release(&r);
                self.pending.push(r.work);
            } else {
                i += 1;
            }
        }
        figures
    }

    fn release(&mut self, r: &gpuflow_core::schedule::Running) {
        self.placer.release(&r.allocations);
        if !r.flavor.is_empty() {
            self.queues
                .charge(r.work.queue, &r.flavor, -(r.work.gpu_milli() as i64));
        }
    }

    /// A small change: `n` running jobs end and `n` new jobs arrive; time moves on a minute.
    pub fn churn(&mut self, n: usize, first_leaf: u32, leaves: u32) {
        for _ in 0..n.min(self.running.len()) {
            let k = self.rng.below(self.running.len() as u64) as usize;
            let r = self.running.swap_remove(k);
            self.release(&r);
        }
        for _ in 0..n {
            let w = self.work(first_leaf, leaves);
            self.pending.push(w);
        }
        self.now += 60;
    }
}

//! `gpuflow job`: submit, list, show, explain, act on jobs, their logs and sessions.

use super::*;

#[derive(Subcommand)]
pub(crate) enum JobCmd {
    /// A job's GPU use: each attempt's GPU-hours and utilisation, each
    /// task's utilisation and GPU memory, and what stands out (like jobstats).
    Stats { id: u64 },
    /// Submit a job from a YAML or JSON file (`-` for stdin), or a shell
    /// command with --wrap.
    Submit {
        /// The job spec, YAML or JSON (`-`: stdin).
        #[arg(
            short = 'f',
            long,
            required_unless_present = "wrap",
            conflicts_with = "wrap"
        )]
        file: Option<PathBuf>,
        /// A shell command to run as a one-task job (like sbatch --wrap),
        /// with --queue, --name, --kind, --gpus, --cpu and --memory-mib.
        #[arg(long)]
        wrap: Option<String>,
        /// With --wrap: the queue.
        #[arg(long, default_value = "default", requires = "wrap")]
        queue: String,
        /// With --wrap: the job's name.
        #[arg(long, default_value = "wrap", requires = "wrap")]
        name: String,
        /// With --wrap: inference, notebook, training or batch.
        #[arg(long, default_value = "batch", requires = "wrap")]
        kind: String,
        /// With --wrap: whole GPUs.
        #[arg(long, default_value_t = 0, requires = "wrap")]
        gpus: u32,
        /// With --wrap: CPU cores.
        #[arg(long, default_value_t = 1.0, requires = "wrap")]
        cpu: f64,
        /// With --wrap: memory in MiB.
        #[arg(long, default_value_t = 1024, requires = "wrap")]
        memory_mib: u64,
        /// With --wrap: the OCI image to run it in
        /// (127.0.0.1:5000/team/pytorch:2.4); with -f, every task's image.
        #[arg(long)]
        image: Option<String>,
        /// Store nothing: say whether it would start now, where, or why it
        /// would wait and when it would start (like sbatch --test-only).
        #[arg(long)]
        test_only: bool,
        /// Submit an array, one job per index (like sbatch --array):
        /// 0-999, 1,3,8-15, with %N to run at most N at once (0-999%50).
        #[arg(long)]
        array: Option<String>,
        /// Start only after other jobs of the team (like sbatch
        /// --dependency): afterok:12:13, afterany:14, after, afternotok,
        /// aftercorr:ARRAY, singleton; terms joined by ',' all hold.
        #[arg(long, short = 'd')]
        dependency: Option<String>,
        /// Run in this reservation (`gpuflow reservation ls`).
        #[arg(long)]
        reservation: Option<String>,
    },
    /// List jobs: the active ones (pending to stopping), newest first;
    /// `--all` adds the finished ones.
    Ls {
        /// Only these states, comma separated (running,pending).
        #[arg(long, value_delimiter = ',', value_parser = job_state)]
        state: Vec<String>,
        /// Finished jobs too (with no --state).
        #[arg(long, conflicts_with = "state")]
        all: bool,
        /// Only this queue's.
        #[arg(long)]
        queue: Option<String>,
        /// Only this team's (admins see every team).
        #[arg(long)]
        team: Option<String>,
        /// Only this user's.
        #[arg(long)]
        user: Option<String>,
        /// Only this array's elements (its id: the first element's), each
        /// on its own row.
        #[arg(long)]
        array: Option<u64>,
        /// Each pending array element on its own row (they are one row,
        /// `10_[30-199]`, as squeue shows them).
        #[arg(long)]
        expand: bool,
        /// Only jobs not finished before this time: a local time
        /// (2026-12-05 14:00, 2026-12-05), RFC 3339, or how long ago (2h,
        /// 1d); as sacct -S. Finished jobs are included.
        #[arg(long, value_parser = time_arg)]
        since: Option<i64>,
        /// Only jobs submitted before this time (the forms of --since); as
        /// sacct -E.
        #[arg(long, value_parser = time_arg)]
        until: Option<i64>,
        /// At most this many (1 to 1000).
        #[arg(long)]
        limit: Option<usize>,
        #[command(flatten)]
        watch: Watch,
    },
    /// One job with its tasks (where they run, their GPUs and exit codes).
    Get {
        id: u64,
        #[command(flatten)]
        watch: Watch,
    },
    /// Why a job waits (or what it is doing): a job id, or a Kubernetes
    /// pod gpuflow schedules as NAMESPACE/POD (read through the kubeconfig).
    Why { id: String },
    /// Runs a command beside a running task, as the task runs (its user,
    /// directory, environment, cgroup and namespaces), as `kubectl exec` or
    /// `srun --jobid N --pty` do: input passes through and the exit status
    /// is the command's. Audited. E.g. `gpuflow job exec 12 -t -- bash`.
    Exec {
        id: u64,
        /// The task, GROUP/INDEX (default: the job's first running task).
        #[arg(long)]
        task: Option<String>,
        /// Give the command a terminal (the default when stdin is one).
        #[arg(short = 't', long)]
        tty: bool,
        /// Never give the command a terminal.
        #[arg(short = 'T', long, conflicts_with = "tty")]
        no_tty: bool,
        /// The command and its arguments, after `--`.
        #[arg(required = true, last = true)]
        command: Vec<String>,
    },
    /// Follows a running task's output as it writes it, stdout and stderr
    /// apart, as `sattach` or `kubectl attach` do (a task reads no input, so
    /// none is passed); Ctrl-C detaches.
    Attach {
        id: u64,
        /// The task, GROUP/INDEX (default: the job's first running task).
        #[arg(long)]
        task: Option<String>,
    },
    /// Each task's output: the server keeps the whole output of each task
    /// of the last five attempts, up to the job's log limit (16 MiB by
    /// default), then the last 16 KiB of each stream.
    Logs {
        id: u64,
        /// Only the last N lines of each task.
        #[arg(long)]
        tail: Option<usize>,
        /// This attempt's output (default: the latest).
        #[arg(long)]
        attempt: Option<u32>,
        /// Keep printing what the tasks write, until the job ends.
        #[arg(short = 'f', long)]
        follow: bool,
        /// stdout, stderr or both (each task's stderr shown apart).
        #[arg(long, value_parser = ["stdout", "stderr", "both"], default_value = "both")]
        stream: String,
    },
    /// Cancel jobs: by id, or every active job matching the filters (a
    /// running job is signalled and stopped).
    Cancel {
        ids: Vec<u64>,
        /// Jobs of this name.
        #[arg(long)]
        name: Option<String>,
        /// Jobs of this user.
        #[arg(long)]
        user: Option<String>,
        /// Jobs in these states, comma separated (e.g. pending).
        #[arg(long, value_delimiter = ',', value_parser = job_state)]
        state: Vec<String>,
        /// Every unfinished element of this array, in one change.
        #[arg(long, conflicts_with_all = ["ids", "name", "user", "state"])]
        array: Option<u64>,
    },
    /// Stop a job and release its GPUs until it is resumed.
    Suspend { id: u64 },
    /// Queue a suspended job again.
    Resume { id: u64 },
    /// Keep a pending job from starting (admin).
    Hold { id: u64 },
    /// Let a held job start again (admin).
    Release { id: u64 },
}

/// Submits a job, sent again with the same idempotency `key` while no
/// server answers or the first try is still being stored (`in_progress`):
/// after `first`, then twice as long each time, four times in all; then
/// the error stands. The job is stored once however often it is sent.
pub(super) fn submit_once(
    c: &Client,
    ct: &str,
    body: &[u8],
    key: &str,
    first: std::time::Duration,
) -> anyhow::Result<Value> {
    use backon::{BlockingRetryable, ExponentialBuilder};
    let backoff = ExponentialBuilder::new()
        .with_min_delay(first)
        .with_factor(2.0)
        .with_max_times(4);
    (|| c.call_with("POST", "/v1/jobs", Some((ct, body.to_vec())), Some(key)))
        .retry(backoff)
        .when(|e| {
            unreachable(e)
                || e.downcast_ref::<Refusal>()
                    .is_some_and(|r| r.code == "in_progress")
        })
        .notify(|e, wait| eprintln!("{e:#}; retrying in {} ms", wait.as_millis()))
        .call()
}

/// GPUs a job asks for in all (whole GPUs, shares; a MIG instance or time
/// slice counts one).
/// The GPUs a job holds (or held last) as its quota counts them, a MIG
/// instance or time slice at its share; for a job that has not run, what
/// its spec asks for (a MIG profile or a time slice by name, as their
/// share depends on the node).
pub(super) fn gpus_of(j: &api::Job) -> String {
    let held = j.ledger.last().map(|h| h.gpus);
    let mut n = 0.0;
    let mut shared = Vec::new();
    for t in &j.spec.tasks {
        let Some(g) = &t.resources.gpu else {
            continue;
        };
        let replicas = f64::from(t.replicas);
        let times = if t.replicas == 1 {
            String::new()
        } else {
            format!("{replicas}x")
        };
        match g.mode {
            api::GpuMode::Whole => n += f64::from(g.count.unwrap_or(1)) * replicas,
            api::GpuMode::Fraction => n += g.fraction.unwrap_or(0.0) * replicas,
            api::GpuMode::Mig => {
                shared.push(format!("{times}{}", g.profile.as_deref().unwrap_or("-")));
            }
            api::GpuMode::TimeSlice => shared.push(format!("{times}slice")),
        }
    }
    if let Some(h) = held {
        n = h;
    } else if !shared.is_empty() {
        if n > 0.0 {
            shared.insert(0, gpu_number(n));
        }
        return shared.join("+");
    }
    gpu_number(n)
}

/// How long a job has run: from its start to its end, or to now.
pub(super) fn elapsed(j: &api::Job) -> String {
    let Some(start) = j.started_at else {
        return "-".into();
    };
    let end = j.finished_at.map_or_else(unix_now, |f| f as i64);
    age_of(end - start as i64)
}

/// `job ls`'s table. Pending elements of one array are one row, as
/// Slurm's squeue shows them (`10_[30-199]`), unless `expand`.
pub(super) fn job_rows(jobs: &[api::Job], wide: bool, expand: bool, headed: bool) -> String {
    // Rows in the answer's order: a job, or an array's pending elements.
    let mut groups: Vec<Vec<&api::Job>> = Vec::new();
    let mut at: std::collections::BTreeMap<u64, usize> = Default::default();
    for j in jobs {
        let array = j
            .array
            .as_ref()
            .map(|a| a.id)
            .filter(|_| !expand && j.state == api::JobState::Pending);
        match array.and_then(|a| at.get(&a)) {
            Some(&g) => groups[g].push(j),
            None => {
                if let Some(a) = array {
                    at.insert(a, groups.len());
                }
                groups.push(vec![j]);
            }
        }
    }
    let rows = groups
        .into_iter()
        .filter_map(|g| {
            // The group's first element (lowest index) speaks for it.
            let j = *g.iter().min_by_key(|j| j.id)?;
            let nodes: Vec<String> = j
                .tasks
                .iter()
                .map(|t| t.node.clone())
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect();
            let (id, name) = match (g.len(), &j.array) {
                (1, Some(a)) => (j.id.to_string(), format!("{}[{}]", j.name, a.index)),
                (1, None) => (j.id.to_string(), j.name.clone()),
                (_, _) => {
                    let indices: Vec<u64> = g
                        .iter()
                        .filter_map(|e| e.array.as_ref().map(|a| u64::from(a.index)))
                        .collect();
                    let list = index_ranges(indices);
                    let array = j.array.as_ref().map_or(j.id, |a| a.id);
                    (format!("{array}_[{list}]"), format!("{}[{list}]", j.name))
                }
            };
            let mut row = vec![
                id,
                name,
                j.user.clone(),
                j.team.clone(),
                j.queue.clone(),
                j.spec.kind.as_str().to_string(),
                gpus_of(j),
                j.state.as_str().to_string(),
                age_of(unix_now() - j.submitted_at as i64),
                elapsed(j),
                start_of(j),
            ];
            if wide {
                row.push(if nodes.is_empty() {
                    "-".into()
                } else {
                    nodes.join(",")
                });
                row.push(local(&Value::from(j.submitted_at)));
            }
            row.push(j.reason.clone());
            Some(row)
        })
        .collect();
    let mut head = vec![
        "id", "name", "user", "team", "queue", "kind", "gpus", "state", "age", "time", "start",
    ];
    if wide {
        head.extend(["nodes", "submitted"]);
    }
    head.push("reason");
    table(headed, &head, rows)
}

/// Array indices as Slurm writes them: `0-3,7,9-12`.
pub(super) fn index_ranges(mut v: Vec<u64>) -> String {
    v.sort_unstable();
    v.dedup();
    let mut out: Vec<String> = Vec::new();
    let mut k = 0;
    while k < v.len() {
        let mut e = k;
        while e + 1 < v.len() && v[e + 1] == v[e] + 1 {
            e += 1;
        }
        out.push(if e == k {
            v[k].to_string()
        } else {
            format!("{}-{}", v[k], v[e])
        });
        k = e + 1;
    }
    out.join(",")
}

/// When a job started (local time, the date only when not today), or for
/// a pending job when it is expected to ("in 12m"; "-" when unknown).
pub(super) fn start_of(j: &api::Job) -> String {
    use chrono::TimeZone;
    if let Some(t) = j.started_at {
        let t = t as i64;
        let Some(t) = chrono::Local.timestamp_opt(t, 0).single() else {
            return "-".into();
        };
        let fmt = if t.date_naive() == chrono::Local::now().date_naive() {
            "%H:%M"
        } else {
            "%m-%d %H:%M"
        };
        return t.format(fmt).to_string();
    }
    match j.eta.map(|e| e as i64) {
        Some(e) if e <= unix_now() => "now".into(),
        Some(e) => format!("in {}", age_of(e - unix_now())),
        None => "-".into(),
    }
}

/// An estimated start in words: "unknown" without one (the reasons said
/// before it tell why it waits; the server gives no cause for the lack of
/// an estimate, so none is guessed here), "now" when it is due.
pub(super) fn eta_text(eta: Option<u64>) -> String {
    let Some(e) = eta else {
        return "unknown".into();
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    match e.saturating_sub(now) {
        0 => "now (at the next cycle)".into(),
        secs => format!("in {}", human(secs)),
    }
}

pub(crate) fn job(conn: &Conn, cmd: JobCmd) -> anyhow::Result<()> {
    // A pod on Kubernetes: asked of its cluster, no token needed.
    if let JobCmd::Why { id } = &cmd
        && let Some((ns, pod)) = id.split_once('/')
    {
        println!("{}", crate::k8s::why(ns, pod, "gpuflow")?);
        return Ok(());
    }
    let c = Client::new(conn)?;
    match cmd {
        JobCmd::Submit {
            file,
            wrap,
            queue,
            name,
            kind,
            gpus,
            cpu,
            memory_mib,
            test_only,
            array,
            dependency,
            reservation,
            image,
        } => {
            let (mut body, mut ct, file) = match (file, wrap) {
                (Some(file), _) => {
                    let ct = if file.extension().is_some_and(|e| e == "json") {
                        "application/json"
                    } else {
                        "application/yaml"
                    };
                    (read_file(&file)?, ct, file)
                }
                (None, Some(cmd)) => {
                    let mut resources = serde_json::json!({"cpu": cpu, "memory_mib": memory_mib});
                    if gpus > 0 {
                        resources["gpu"] = serde_json::json!({ "count": gpus });
                    }
                    let spec = serde_json::json!({
                        "name": name, "queue": queue, "kind": kind,
                        "tasks": [{"name": "main", "command": ["sh", "-c", cmd], "resources": resources}],
                    });
                    (
                        serde_json::to_vec(&spec)?,
                        "application/json",
                        PathBuf::from("--wrap"),
                    )
                }
                (None, None) => return Err(Usage("give -f FILE or --wrap COMMAND".into()).into()),
            };
            if array.is_some() || dependency.is_some() || reservation.is_some() || image.is_some() {
                // The file's spec with its `array` and `dependency` set, sent as JSON.
                let mut spec: Value = serde_norway::from_slice(&body)
                    .map_err(|e| Usage(format!("{} is not YAML or JSON: {e}", file.display())))?;
                if let Some(i) = &image
                    && let Some(tasks) = spec["tasks"].as_array_mut()
                {
                    for t in tasks {
                        t["image"] = Value::String(i.clone());
                    }
                }
                if let Some(a) = array {
                    spec["array"] = Value::String(a);
                }
                if let Some(d) = dependency {
                    spec["dependency"] = Value::String(d);
                }
                if let Some(r) = reservation {
                    spec["reservation"] = Value::String(r);
                }
                body = serde_json::to_vec(&spec)?;
                ct = "application/json";
            }
            if test_only {
                let path = "/v1/jobs?test_only=true";
                let v = c.call("POST", path, Some((ct, body)))?;
                return print_as(conn.output, path, v, |t: &api::TestOnly| {
                    if t.would_start {
                        return format!("would start now on {}\n", t.nodes.join(", "));
                    }
                    let mut out = String::from("would wait:\n");
                    for r in &t.reasons {
                        out += &format!("  {r}\n");
                    }
                    out += &format!("  estimated start: {}\n", eta_text(t.eta));
                    out
                });
            }
            // Retried on connection failures with one idempotency key: the job
            // is stored once however often it is sent.
            let key = idempotency_key();
            let v = submit_once(&c, ct, &body, &key, std::time::Duration::from_millis(500))?;
            print_as(conn.output, "/v1/jobs", v, |v: &api::Submitted| {
                match &v.array {
                    Some(a) => {
                        let (id, n) = (a.id, u64::from(a.index));
                        format!(
                            "array {id} submitted: {n} jobs, {id}-{} ({})\n",
                            id + n.saturating_sub(1),
                            v.state.as_str()
                        )
                    }
                    None => format!("job {} submitted ({})\n", v.id, v.state.as_str()),
                }
            })?;
        }
        JobCmd::Ls {
            state,
            all,
            queue,
            team,
            user,
            array,
            expand,
            since,
            until,
            limit,
            watch,
        } => {
            if let (Some(a), Some(b)) = (since, until)
                && a >= b
            {
                return Err(Usage("--since must be before --until".into()).into());
            }
            let mut q = form_urlencoded::Serializer::new(String::new());
            // A time window asks for history: finished jobs too.
            if !state.is_empty() {
                q.append_pair("state", &state.join(","));
            } else if !all && since.is_none() && until.is_none() {
                q.append_pair("state", ACTIVE);
            }
            for (k, t) in [("since", since), ("until", until)] {
                if let Some(t) = t {
                    q.append_pair(k, &t.max(0).to_string());
                }
            }
            for (k, v) in [("queue", queue), ("team", team), ("user", user)] {
                if let Some(v) = v {
                    q.append_pair(k, &v);
                }
            }
            if let Some(a) = array {
                q.append_pair("array", &a.to_string());
            }
            if let Some(l) = limit {
                q.append_pair("limit", &l.to_string());
            }
            let path = format!("/v1/jobs?{}", q.finish());
            let wide = conn.output == Format::Wide;
            watch.run(|| {
                let v = c.call("GET", &path, None)?;
                print_as(conn.output, &path, v, |jobs: &Vec<api::Job>| {
                    job_rows(jobs, wide, expand || array.is_some(), !conn.no_headers)
                })
            })?;
        }
        JobCmd::Get { id, watch } => {
            watch.run(|| {
                let path = format!("/v1/jobs/{id}");
                let v = c.call("GET", &path, None)?;
                print_as(conn.output, &path, v, |j| job_text(j, c.base()))?;
                Ok(())
            })?;
        }
        JobCmd::Exec {
            id,
            task,
            tty,
            no_tty,
            command,
        } => {
            let code = crate::session::exec(&c, id, task, tty, no_tty, &command)?;
            std::process::exit(code);
        }
        JobCmd::Attach { id, task } => {
            crate::session::attach(&c, id, task)?;
        }
        JobCmd::Stats { id } => {
            let path = format!("/v1/jobs/{id}");
            let v = c.call("GET", &path, None)?;
            print_as(conn.output, &path, v, job_stats)?;
        }
        JobCmd::Why { id } => {
            let id: u64 = id.parse().map_err(|_| {
                Usage(format!(
                    "{id:?} is neither a job id (a number) nor a Kubernetes pod (NAMESPACE/POD)"
                ))
            })?;
            let path = format!("/v1/jobs/{id}/why");
            let v = c.call("GET", &path, None)?;
            print_as(conn.output, &path, v, |w: &api::Why| {
                let mut out = format!("job {} is {}: {}\n", w.id, w.state.as_str(), w.summary);
                for r in w.reasons.iter().skip(1) {
                    out += &format!("  also: {r}\n");
                }
                if let Some(p) = w.position {
                    out += &format!("  position in its queue: {p}\n");
                }
                if w.state == api::JobState::Pending {
                    out += &format!("  estimated start: {}\n", eta_text(w.eta));
                }
                out
            })?;
        }
        JobCmd::Logs {
            id,
            tail,
            attempt,
            follow,
            stream,
        } => return logs(&c, conn.output, id, (tail, attempt, follow), &stream),
        JobCmd::Cancel { array: Some(a), .. } => {
            let path = format!("/v1/arrays/{a}/cancel");
            let v = c.call("POST", &path, None)?;
            print_as(conn.output, &path, v, |v: &api::ArrayCancelled| {
                format!(
                    "array {}: {} cancelled, {} stopping\n",
                    v.id, v.cancelled, v.stopping
                )
            })?;
        }
        JobCmd::Cancel {
            ids,
            name,
            user,
            state,
            array: None,
        } => return cancel(&c, conn.output, ids, name, user, state),
        JobCmd::Suspend { id } => return job_action(&c, conn.output, "suspend", id),
        JobCmd::Resume { id } => return job_action(&c, conn.output, "resume", id),
        JobCmd::Hold { id } => return job_action(&c, conn.output, "hold", id),
        JobCmd::Release { id } => return job_action(&c, conn.output, "release", id),
    }
    Ok(())
}

/// A job's output: each task's, of one attempt, the last lines or all the
/// server keeps; following, what is new every second until the job ends.
pub(super) fn logs(
    c: &Client,
    output: Format,
    id: u64,
    (tail, attempt, follow): (Option<usize>, Option<u32>, bool),
    stream: &str,
) -> anyhow::Result<()> {
    // Each task's stdout, then (labelled) its stderr, as asked.
    let texts = |v: &api::JobLogs| -> anyhow::Result<Vec<(String, String)>> {
        let mut out = Vec::new();
        let none = std::collections::BTreeMap::new();
        for (latest, all, label) in [
            (&v.tasks, &v.attempts, ""),
            (&v.stderr, &v.stderr_attempts, " (stderr)"),
        ] {
            if (stream == "stdout" && !label.is_empty()) || (stream == "stderr" && label.is_empty())
            {
                continue;
            }
            let m = match attempt {
                None => latest,
                Some(a) => {
                    if !v.attempts.contains_key(&a) {
                        let kept: Vec<String> = v.attempts.keys().map(u32::to_string).collect();
                        return Err(Usage(format!(
                            "--attempt {a}: no output kept for it; kept: {}",
                            if kept.is_empty() {
                                "none".into()
                            } else {
                                kept.join(", ")
                            }
                        ))
                        .into());
                    }
                    all.get(&a).unwrap_or(&none)
                }
            };
            out.extend(
                m.iter()
                    .map(|(k, t)| (format!("{k}{label}"), t.clone()))
                    .filter(|(_, t)| label.is_empty() || !t.is_empty()),
            );
        }
        Ok(out)
    };
    let path = format!("/v1/jobs/{id}/logs");
    let v = c.call("GET", &path, None)?;
    if !follow {
        let tasks = texts(&gpuflow_client::read(&path, v.clone())?)?;
        print(output, &v, |_| {
            let mut out = String::new();
            for (task, text) in &tasks {
                let text = match tail {
                    Some(n) => {
                        let lines: Vec<&str> = text.lines().collect();
                        lines[lines.len().saturating_sub(n)..].join("\n") + "\n"
                    }
                    None => text.clone(),
                };
                out += &format!("==> {task} <==\n{text}");
                if !out.ends_with('\n') {
                    out.push('\n');
                }
            }
            out
        });
        return Ok(());
    }
    // Following: what each task wrote since the last look (the window asked
    // for is the end of the output: the new part is what follows the part
    // seen before).
    use std::io::Write;
    let mut seen: std::collections::BTreeMap<String, String> = Default::default();
    loop {
        let path = format!("/v1/jobs/{id}/logs?tail_bytes=65536");
        let v: api::JobLogs = gpuflow_client::read(&path, c.call("GET", &path, None)?)?;
        for (task, text) in texts(&v)? {
            let before = seen.get(&task).cloned().unwrap_or_default();
            let new = match text.find(before.as_str()).filter(|_| !before.is_empty()) {
                Some(at) => &text[at + before.len()..],
                None if before.is_empty() => match tail {
                    Some(n) => {
                        let lines: Vec<&str> = text.lines().collect();
                        let start = lines.len().saturating_sub(n);
                        let skip: usize = lines[..start].iter().map(|l| l.len() + 1).sum();
                        &text[skip.min(text.len())..]
                    }
                    None => text.as_str(),
                },
                // The window moved past what was seen: print it whole.
                None => text.as_str(),
            };
            if !new.is_empty() {
                print!("{new}");
                let _ = std::io::stdout().flush();
            }
            // Keep the last part seen, to find the new part next time.
            let keep = text.len().saturating_sub(4096);
            let keep = (keep..=text.len())
                .find(|i| text.is_char_boundary(*i))
                .unwrap_or(text.len());
            seen.insert(task, text[keep..].to_string());
        }
        let path = format!("/v1/jobs/{id}");
        let job: api::Job = gpuflow_client::read(&path, c.call("GET", &path, None)?)?;
        if job.state.finished() {
            return Ok(());
        }
        std::thread::sleep(std::time::Duration::from_secs(1));
    }
}

/// One job as text: what it is, its state, and its tasks.
/// A job in words; `base`: the server's address, for its proxied ports.
pub(super) fn job_text(j: &api::Job, base: &str) -> String {
    let at = |t: u64| local(&Value::from(t));
    let mut out = format!(
        "job {} {} ({}) in queue {} of team {}, by {}\nstate: {} — {}\nsubmitted {} ({} ago), ran {}\nattempts: {}, preemptions: {}\n",
        j.id,
        j.name,
        j.spec.kind.as_str(),
        j.queue,
        j.team,
        j.user,
        j.state.as_str(),
        j.reason,
        at(j.submitted_at),
        age_of(unix_now() - j.submitted_at as i64),
        elapsed(j),
        j.attempts,
        j.preemptions
    );
    let rows = j
        .tasks
        .iter()
        .map(|t| {
            let gpus = t.gpus.iter().map(u32::to_string).collect::<Vec<_>>();
            vec![
                format!("{}/{}", t.group, t.index),
                t.node.clone(),
                match (t.mig_instance, gpus.first()) {
                    (Some(m), Some(g)) => format!("{g} MIG {m}"),
                    _ if gpus.is_empty() => "-".into(),
                    _ => gpus.join(","),
                },
                t.state.clone(),
                t.exit_code.map_or_else(|| "-".into(), |c| c.to_string()),
            ]
        })
        .collect();
    out += &columns(&["task", "node", "gpus", "state", "exit"], rows);
    for t in &j.tasks {
        for p in &t.ports {
            out += &format!(
                "{}/{} serves {} (port {}) at {}{}\n",
                t.group,
                t.index,
                p.name,
                p.port,
                base.trim_end_matches('/'),
                p.url
            );
        }
    }
    out
}

/// Cancels the jobs named by id, or every active job matching the filters.
pub(super) fn cancel(
    c: &Client,
    output: Format,
    ids: Vec<u64>,
    name: Option<String>,
    user: Option<String>,
    state: Vec<String>,
) -> anyhow::Result<()> {
    let filtered = name.is_some() || user.is_some() || !state.is_empty();
    if ids.is_empty() && !filtered {
        return Err(Usage(
            "name the jobs to cancel: one or more ids, or --name, --user, --state or --array"
                .into(),
        )
        .into());
    }
    let mut targets = ids;
    if filtered {
        let mut q = form_urlencoded::Serializer::new(String::new());
        q.append_pair(
            "state",
            &if state.is_empty() {
                ACTIVE.to_string()
            } else {
                state.join(",")
            },
        );
        if let Some(u) = &user {
            q.append_pair("user", u);
        }
        let path = format!("/v1/jobs?{}", q.finish());
        let jobs: Vec<api::Job> = gpuflow_client::read(&path, c.call("GET", &path, None)?)?;
        targets.extend(
            jobs.iter()
                .filter(|j| name.as_ref().is_none_or(|n| j.name == *n))
                .map(|j| j.id),
        );
        if targets.is_empty() {
            eprintln!("no active job matches");
            return Ok(());
        }
    }
    // One job: its error as it is. Several: each is tried, each failure
    // said once (the server's message names the job), then how many.
    if let [id] = targets[..] {
        return job_action(c, output, "cancel", id);
    }
    let mut failed = Vec::new();
    for id in targets {
        if let Err(e) = job_action(c, output, "cancel", id) {
            eprintln!("error: {e:#}");
            failed.push(id);
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(anyhow!(
            "{} job(s) could not be cancelled: {failed:?}",
            failed.len()
        ))
    }
}

pub(super) fn job_action(c: &Client, output: Format, action: &str, id: u64) -> anyhow::Result<()> {
    let path = format!("/v1/jobs/{id}/{action}");
    let v = c.call("POST", &path, None)?;
    print_as(output, &path, v, |j: &api::Job| {
        format!("job {}: {} — {}\n", j.id, j.state.as_str(), j.reason)
    })
}

/// `job stats`: a job's ledger and its tasks' sampled GPU use, with flags.
pub(super) fn job_stats(j: &api::Job) -> String {
    let held: f64 = j.ledger.iter().map(|h| h.gpu_hours).sum();
    let sampled: Vec<(f64, f64)> = j
        .ledger
        .iter()
        .filter_map(|h| Some((h.gpu_hours, h.util_pct?)))
        .collect();
    let used: f64 = sampled.iter().map(|(g, u)| g * u / 100.0).sum();
    let sampled_hours: f64 = sampled.iter().map(|(g, _)| g).sum();
    let mut out = format!(
        "job {} ({}, team {}, {}): {} attempt(s), {held:.2} GPU-hours held",
        j.id,
        j.name,
        j.team,
        j.state.as_str(),
        j.attempts
    );
    if sampled_hours > 0.0 {
        out += &format!(
            ", {used:.2} used ({:.0}% efficient)",
            used / sampled_hours * 100.0
        );
    }
    out += "\n\n";
    out += &columns(
        &["attempt", "gpus", "model", "gpu-hours", "util"],
        j.ledger
            .iter()
            .map(|h| {
                vec![
                    h.attempt.to_string(),
                    Value::from(h.gpus).to_string(),
                    h.model.clone(),
                    format!("{:.2}", h.gpu_hours),
                    h.util_pct.map_or("-".into(), |u| format!("{u:.1}%")),
                ]
            })
            .collect(),
    );
    if !j.tasks.is_empty() {
        out += "\n";
        out += &columns(
            &[
                "task",
                "node",
                "gpus",
                "util now",
                "util mean",
                "gpu mem",
                "peak",
                "samples",
            ],
            j.tasks
                .iter()
                .map(|t| {
                    let u = t.usage.as_ref();
                    let dash = |f: &dyn Fn(&api::TaskUsage) -> String| u.map_or("-".into(), f);
                    vec![
                        format!("{}/{}", t.group, t.index),
                        t.node.clone(),
                        serde_json::to_string(&t.gpus).unwrap_or_default(),
                        dash(&|u| format!("{}%", u.gpu_util_pct)),
                        dash(&|u| format!("{:.1}%", u.gpu_util_avg_pct)),
                        dash(&|u| format!("{} MiB", u.gpu_memory_mib)),
                        dash(&|u| format!("{} MiB", u.gpu_memory_peak_mib)),
                        dash(&|u| u.samples.to_string()),
                    ]
                })
                .collect(),
        );
    }
    // What a reviewer of GPU use would flag.
    let mut flags = Vec::new();
    if sampled_hours > 0.0 && used / sampled_hours < 0.1 {
        flags.push(format!(
            "its GPUs sat mostly idle: {:.0}% mean utilisation",
            used / sampled_hours * 100.0
        ));
    }
    for t in &j.tasks {
        if t.usage
            .as_ref()
            .is_some_and(|u| u.samples > 0 && u.gpu_memory_peak_mib == 0)
        {
            flags.push(format!(
                "task {}/{} never held GPU memory: does it use its GPU?",
                t.group, t.index
            ));
        }
    }
    if sampled_hours == 0.0 && held > 0.0 {
        flags.push("no GPU samples (emulated GPUs, or the agent could not read them)".into());
    }
    for fl in flags {
        out += &format!("\nnote: {fl}");
    }
    out + "\n"
}

//! `gpuflow k8s`: the scheduler on Kubernetes and its manifests.

use std::time::Duration;

use clap::Subcommand;
use gpuflow_k8s::manifests::{self, Install};
use gpuflow_k8s::scheduler::{Scheduler, Settings};

// Parsed once at start: the size of `Run` does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
pub(crate) enum K8sCmd {
    /// Schedule the pods that set `schedulerName: gpuflow` in the cluster of
    /// the kubeconfig (or the pod's service account). Replicas elect a
    /// leader through a Lease; the others wait.
    Run {
        /// The `schedulerName` gpuflow's pods set.
        #[arg(long, default_value = "gpuflow")]
        scheduler_name: String,
        /// The namespace of the lease.
        #[arg(long, default_value = "gpuflow-system")]
        namespace: String,
        #[arg(long, default_value = "gpuflow-scheduler")]
        lease_name: String,
        /// This replica's name in the lease (the pod's name in a Deployment).
        #[arg(long, env = "GPUFLOW_IDENTITY")]
        identity: Option<String>,
        /// The longest time between cycles (e.g. `1s`, `500ms`).
        #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
        interval: Duration,
        /// Node labels holding a node's rack and block.
        #[arg(long, default_value = "gpuflow.io/rack")]
        rack_label: String,
        #[arg(long, default_value = "gpuflow.io/block")]
        block_label: String,
        /// The node label naming a node's NVLink domain (GB200 NVL72 racks
        /// share one across nodes).
        #[arg(long, default_value = "nvidia.com/gpu.clique")]
        nvlink_label: String,
        /// Consolidation: a pod group that no node takes, though the free
        /// GPUs would hold it, may have smaller pods that started at most
        /// this many seconds ago moved out of its way (deleted, as victims
        /// are, when they fit on another node at once). 0, the default: never,
        /// since a deleted pod comes back only if a controller makes it
        /// again; turn it on where pods belong to Jobs or JobSets.
        #[arg(long, default_value_t = 0)]
        consolidate_max_unsaved: u64,
        /// Where to serve /healthz, /readyz and /metrics.
        #[arg(long, default_value = "0.0.0.0:8080")]
        listen: std::net::SocketAddr,
        /// A gpuflow control plane (its URL) to report the cluster's
        /// workloads to, for its accounting, reports and dashboard; its
        /// token is an admin's (--token or GPUFLOW_TOKEN).
        #[arg(long, env = "GPUFLOW_CONTROL_PLANE")]
        control_plane: Option<String>,
        /// The control plane's API token.
        #[arg(long, env = "GPUFLOW_TOKEN", hide_env_values = true)]
        token: Option<String>,
        /// PEM certificate to trust for an https control plane.
        #[arg(long, env = "GPUFLOW_CA_CERT")]
        ca_cert: Option<std::path::PathBuf>,
        /// This cluster's name in the control plane.
        #[arg(long, default_value = "kubernetes", requires = "control_plane")]
        cluster: String,
        /// How often the leader reports (e.g. `15s`).
        #[arg(long, default_value = "15s", value_parser = humantime::parse_duration, requires = "control_plane")]
        report_every: Duration,
    },
    /// Why a pod waits, as gpuflow explained it (`NAMESPACE/POD`).
    Why {
        pod: String,
        #[arg(long, default_value = "gpuflow")]
        scheduler_name: String,
    },
    /// Print the manifests that install gpuflow: the GpuQueue CRD, then a
    /// namespace, service account, RBAC and the Deployment.
    Manifests {
        /// Only the CRD.
        #[arg(long)]
        crd: bool,
        #[arg(long, default_value = "gpuflow-system")]
        namespace: String,
        /// The image holding the `gpuflow` binary (deploy/kubernetes/Dockerfile builds one).
        #[arg(long, default_value = "gpuflow:dev")]
        image: String,
        #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(i32).range(1..))]
        replicas: i32,
    },
}

/// Why a pod waits, read from its cluster through the kubeconfig.
pub(crate) fn why(ns: &str, pod: &str, scheduler_name: &str) -> anyhow::Result<String> {
    let rt = tokio::runtime::Runtime::new()?;
    Ok(rt.block_on(async {
        let client = gpuflow_k8s::connect().await?;
        gpuflow_k8s::why(client, ns, pod, scheduler_name).await
    })?)
}

pub(crate) fn run(cmd: K8sCmd) -> anyhow::Result<()> {
    match cmd {
        K8sCmd::Manifests {
            crd,
            namespace,
            image,
            replicas,
        } => {
            print!("{}", manifests::crd_yaml());
            if !crd {
                print!(
                    "{}",
                    manifests::install_yaml(&Install {
                        namespace,
                        image,
                        replicas,
                    })
                );
            }
            Ok(())
        }
        K8sCmd::Why {
            pod,
            scheduler_name,
        } => {
            let (ns, name) = pod.split_once('/').ok_or_else(|| {
                anyhow::anyhow!("write the pod as NAMESPACE/NAME, e.g. team-a/train-0")
            })?;
            println!("{}", why(ns, name, &scheduler_name)?);
            Ok(())
        }
        K8sCmd::Run {
            scheduler_name,
            namespace,
            lease_name,
            identity,
            interval,
            rack_label,
            block_label,
            nvlink_label,
            consolidate_max_unsaved,
            listen,
            control_plane,
            token,
            ca_cert,
            cluster,
            report_every,
        } => {
            if !gpuflow_api::valid_name(&cluster) {
                return Err(crate::client::Usage(format!(
                    "--cluster {cluster:?}: lowercase letters, digits and dashes, starting with a letter"
                ))
                .into());
            }
            let reporter = match control_plane {
                None => None,
                Some(server) => {
                    let conn = crate::client::Conn {
                        server: Some(server),
                        token,
                        context: None,
                        output: crate::client::Format::Json,
                        no_headers: false,
                        ca_cert,
                    };
                    Some(crate::client::Client::new(&conn)?)
                }
            };
            crate::platform::init_logging();
            let rt = tokio::runtime::Runtime::new()?;
            rt.block_on(async move {
                let client = gpuflow_k8s::connect().await?;
                let mut settings = Settings {
                    scheduler_name,
                    namespace,
                    lease_name,
                    interval,
                    report_workloads: reporter.is_some(),
                    ..Settings::default()
                };
                if let Some(i) = identity {
                    settings.identity = i;
                }
                settings.topology.rack = rack_label;
                settings.topology.block = block_label;
                settings.topology.nvlink = nvlink_label;
                settings.config.consolidate_max_unsaved =
                    (consolidate_max_unsaved > 0).then_some(consolidate_max_unsaved);
                tracing::info!(identity = %settings.identity, "gpuflow on Kubernetes: waiting for the lease");
                let stop = async {
                    let _ = tokio::signal::ctrl_c().await;
                };
                let scheduler = Scheduler::new(client, settings);
                let listener = tokio::net::TcpListener::bind(listen)
                    .await
                    .map_err(|e| anyhow::anyhow!("--listen {listen}: {e}"))?;
                let app = gpuflow_k8s::health::router(scheduler.health());
                tokio::spawn(async move {
                    let _ = axum::serve(listener, app).await;
                });
                if let Some(client) = reporter {
                    let (workloads, health) = (scheduler.workloads(), scheduler.health());
                    std::thread::spawn(move || {
                        report_loop(&client, &cluster, report_every, &workloads, &health);
                    });
                }
                scheduler.run(stop).await?;
                anyhow::Ok(())
            })
        }
    }
}

/// Reports the last cycle's workloads to the control plane every `every`,
/// while this replica leads (a follower's last report is stale).
fn report_loop(
    client: &crate::client::Client,
    cluster: &str,
    every: Duration,
    workloads: &std::sync::Mutex<Option<gpuflow_api::WorkloadReport>>,
    health: &gpuflow_k8s::health::Health,
) {
    let mut last_refused = std::collections::BTreeMap::new();
    loop {
        std::thread::sleep(every);
        if !health.leading.load(std::sync::atomic::Ordering::Relaxed) {
            continue;
        }
        let Some(report) = workloads.lock().ok().and_then(|w| w.clone()) else {
            continue;
        };
        let body = match serde_json::to_vec(&report) {
            Ok(b) => b,
            Err(e) => {
                tracing::error!(error = %e, "the workload report does not serialise");
                continue;
            }
        };
        let path = format!("/v1/clusters/{cluster}/workloads");
        match client.call("PUT", &path, Some(("application/json", body))) {
            Ok(v) => {
                let result: Option<gpuflow_api::WorkloadReportResult> =
                    serde_json::from_value(v).ok();
                let refused = result.map(|r| r.refused).unwrap_or_default();
                // Said once, not every report.
                if refused != last_refused {
                    for (key, why) in &refused {
                        tracing::warn!(workload = %key, %why, "the control plane refused a workload");
                    }
                    last_refused = refused;
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not report the workloads to the control plane; retrying")
            }
        }
    }
}

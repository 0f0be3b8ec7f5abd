//! `gpuflow k8s`: the scheduler on Kubernetes and its manifests.

use std::time::Duration;

use clap::Subcommand;
use gpuflow_k8s::manifests::{self, Install};
use gpuflow_k8s::scheduler::{Scheduler, Settings};

#[derive(Subcommand)]
pub enum K8sCmd {
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
        /// Where to serve /healthz, /readyz and /metrics.
        #[arg(long, default_value = "0.0.0.0:8080")]
        listen: std::net::SocketAddr,
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

pub fn run(cmd: K8sCmd) -> anyhow::Result<()> {
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
            let rt = tokio::runtime::Runtime::new()?;
            let out = rt.block_on(async {
                let client = gpuflow_k8s::connect().await?;
                gpuflow_k8s::why(client, ns, name, &scheduler_name).await
            })?;
            println!("{out}");
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
            listen,
        } => {
            crate::platform::init_logging();
            let rt = tokio::runtime::Runtime::new()?;
            rt.block_on(async move {
                let client = gpuflow_k8s::connect().await?;
                let mut settings = Settings {
                    scheduler_name,
                    namespace,
                    lease_name,
                    interval,
                    ..Settings::default()
                };
                if let Some(i) = identity {
                    settings.identity = i;
                }
                settings.topology.rack = rack_label;
                settings.topology.block = block_label;
                settings.topology.nvlink = nvlink_label;
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
                scheduler.run(stop).await?;
                anyhow::Ok(())
            })
        }
    }
}

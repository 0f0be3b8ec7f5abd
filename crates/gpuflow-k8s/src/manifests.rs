//! What a cluster installs: the `GpuQueue` CRD generated from the Rust
//! types, a namespace, a service account with least-privilege RBAC, and a
//! Deployment of two replicas (one leads through the Lease). The Helm chart
//! in `deploy/helm/gpuflow` holds the same objects with its values in
//! place; tests check both.

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{
    Capabilities, Container, ContainerPort, EnvVar, EnvVarSource, HTTPGetAction, Namespace,
    ObjectFieldSelector, PodSecurityContext, PodSpec, PodTemplateSpec, Probe, ResourceRequirements,
    SecurityContext, ServiceAccount,
};
use k8s_openapi::api::rbac::v1::{
    ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding, RoleRef, Subject,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use kube::CustomResourceExt;
use serde::Serialize;

use crate::crd::GpuQueue;

/// Where gpuflow runs and as what.
pub struct Install {
    pub namespace: String,
    pub image: String,
    pub replicas: i32,
}

impl Default for Install {
    fn default() -> Self {
        Install {
            namespace: "gpuflow-system".into(),
            image: "gpuflow:dev".into(),
            replicas: 2,
        }
    }
}

const NAME: &str = "gpuflow-scheduler";

fn meta(name: &str, namespace: Option<&str>) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.into()),
        namespace: namespace.map(Into::into),
        labels: Some([("app.kubernetes.io/name".to_string(), "gpuflow".to_string())].into()),
        ..ObjectMeta::default()
    }
}

fn rule(groups: &[&str], resources: &[&str], verbs: &[&str]) -> PolicyRule {
    let v = |s: &[&str]| s.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    PolicyRule {
        api_groups: Some(v(groups)),
        resources: Some(v(resources)),
        verbs: v(verbs),
        ..PolicyRule::default()
    }
}

/// The cluster-wide permissions: read what it schedules on (nodes, pods,
/// disruption budgets, Jobs for their parallelism, queues), bind and
/// explain pods, delete victims, report on queues' status; nothing else
/// (no secrets, no writes to nodes or to queues' specs).
pub fn cluster_role() -> ClusterRole {
    ClusterRole {
        metadata: meta(NAME, None),
        rules: Some(vec![
            rule(&[""], &["nodes"], &["get", "list", "watch"]),
            rule(
                &[""],
                &["pods"],
                &["get", "list", "watch", "patch", "delete"],
            ),
            rule(&[""], &["pods/binding"], &["create"]),
            rule(&[""], &["pods/status"], &["patch"]),
            rule(&[""], &["events"], &["create"]),
            rule(
                &["policy"],
                &["poddisruptionbudgets"],
                &["get", "list", "watch"],
            ),
            rule(&["batch"], &["jobs"], &["get", "list", "watch"]),
            rule(&["gpuflow.io"], &["gpuqueues"], &["get", "list", "watch"]),
            rule(&["gpuflow.io"], &["gpuqueues/status"], &["patch"]),
        ]),
        ..ClusterRole::default()
    }
}

/// The one write to nodes, for HAMi's protocol: a node whose GPUs HAMi
/// shares is locked (annotation `hami.io/mutex.lock`) while its device
/// plugin allocates a pod's devices. In a role of its own, so that a
/// cluster without HAMi can leave it out; pods bound to HAMi's nodes then
/// wait with the API's `403`.
pub fn hami_role() -> ClusterRole {
    ClusterRole {
        metadata: meta(HAMI_ROLE, None),
        rules: Some(vec![rule(&[""], &["nodes"], &["patch"])]),
        ..ClusterRole::default()
    }
}

const HAMI_ROLE: &str = "gpuflow-scheduler-hami";

/// The lease, in its own namespace only.
pub fn lease_role(namespace: &str) -> Role {
    Role {
        metadata: meta(NAME, Some(namespace)),
        rules: Some(vec![rule(
            &["coordination.k8s.io"],
            &["leases"],
            &["get", "create", "update"],
        )]),
    }
}

fn subject(namespace: &str) -> Vec<Subject> {
    vec![Subject {
        kind: "ServiceAccount".into(),
        name: NAME.into(),
        namespace: Some(namespace.into()),
        ..Subject::default()
    }]
}

pub fn deployment(i: &Install) -> Deployment {
    let labels: std::collections::BTreeMap<String, String> =
        [("app.kubernetes.io/name".to_string(), "gpuflow".to_string())].into();
    Deployment {
        metadata: meta(NAME, Some(&i.namespace)),
        spec: Some(DeploymentSpec {
            replicas: Some(i.replicas),
            selector: LabelSelector {
                match_labels: Some(labels.clone()),
                ..LabelSelector::default()
            },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels),
                    ..ObjectMeta::default()
                }),
                spec: Some(PodSpec {
                    service_account_name: Some(NAME.into()),
                    security_context: Some(PodSecurityContext {
                        run_as_non_root: Some(true),
                        run_as_user: Some(65532),
                        seccomp_profile: Some(k8s_openapi::api::core::v1::SeccompProfile {
                            type_: "RuntimeDefault".into(),
                            ..Default::default()
                        }),
                        ..PodSecurityContext::default()
                    }),
                    containers: vec![Container {
                        name: "scheduler".into(),
                        image: Some(i.image.clone()),
                        command: Some(vec!["gpuflow".into()]),
                        security_context: Some(SecurityContext {
                            allow_privilege_escalation: Some(false),
                            read_only_root_filesystem: Some(true),
                            capabilities: Some(Capabilities {
                                drop: Some(vec!["ALL".into()]),
                                ..Capabilities::default()
                            }),
                            ..SecurityContext::default()
                        }),
                        resources: Some(ResourceRequirements {
                            requests: Some(
                                [
                                    ("cpu".to_string(), Quantity("500m".into())),
                                    ("memory".to_string(), Quantity("512Mi".into())),
                                ]
                                .into(),
                            ),
                            limits: Some([("memory".to_string(), Quantity("2Gi".into()))].into()),
                            ..ResourceRequirements::default()
                        }),
                        ports: Some(vec![ContainerPort {
                            name: Some("http".into()),
                            container_port: 8080,
                            ..ContainerPort::default()
                        }]),
                        readiness_probe: Some(probe("/readyz")),
                        liveness_probe: Some(probe("/healthz")),
                        args: Some(vec![
                            "k8s".into(),
                            "run".into(),
                            "--namespace".into(),
                            i.namespace.clone(),
                        ]),
                        env: Some(vec![EnvVar {
                            name: "GPUFLOW_IDENTITY".into(),
                            value_from: Some(EnvVarSource {
                                field_ref: Some(ObjectFieldSelector {
                                    field_path: "metadata.name".into(),
                                    ..ObjectFieldSelector::default()
                                }),
                                ..EnvVarSource::default()
                            }),
                            ..EnvVar::default()
                        }]),
                        ..Container::default()
                    }],
                    ..PodSpec::default()
                }),
            },
            ..DeploymentSpec::default()
        }),
        ..Deployment::default()
    }
}

/// An HTTP probe of the scheduler's own endpoint.
fn probe(path: &str) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.into()),
            port: k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String("http".into()),
            ..HTTPGetAction::default()
        }),
        period_seconds: Some(10),
        ..Probe::default()
    }
}

fn doc(out: &mut String, v: &impl Serialize) {
    out.push_str("---\n");
    out.push_str(&serde_norway::to_string(v).expect("manifests serialise"));
}

/// The `GpuQueue` CRD as YAML.
pub fn crd_yaml() -> String {
    let mut out = String::new();
    doc(&mut out, &GpuQueue::crd());
    out
}

/// Everything but the CRD, as YAML documents: the namespace, then
/// [`release_yaml`].
pub fn install_yaml(i: &Install) -> String {
    let mut out = String::new();
    doc(
        &mut out,
        &Namespace {
            metadata: meta(&i.namespace, None),
            ..Namespace::default()
        },
    );
    out.push_str(&release_yaml(i));
    out
}

/// The objects of a release in an existing namespace (what the Helm chart
/// renders): service account, RBAC, Deployment.
pub fn release_yaml(i: &Install) -> String {
    let mut out = String::new();
    doc(
        &mut out,
        &ServiceAccount {
            metadata: meta(NAME, Some(&i.namespace)),
            ..ServiceAccount::default()
        },
    );
    doc(&mut out, &cluster_role());
    doc(
        &mut out,
        &ClusterRoleBinding {
            metadata: meta(NAME, None),
            role_ref: RoleRef {
                api_group: "rbac.authorization.k8s.io".into(),
                kind: "ClusterRole".into(),
                name: NAME.into(),
            },
            subjects: Some(subject(&i.namespace)),
        },
    );
    doc(&mut out, &hami_role());
    doc(
        &mut out,
        &ClusterRoleBinding {
            metadata: meta(HAMI_ROLE, None),
            role_ref: RoleRef {
                api_group: "rbac.authorization.k8s.io".into(),
                kind: "ClusterRole".into(),
                name: HAMI_ROLE.into(),
            },
            subjects: Some(subject(&i.namespace)),
        },
    );
    doc(&mut out, &lease_role(&i.namespace));
    doc(
        &mut out,
        &RoleBinding {
            metadata: meta(NAME, Some(&i.namespace)),
            role_ref: RoleRef {
                api_group: "rbac.authorization.k8s.io".into(),
                kind: "Role".into(),
                name: NAME.into(),
            },
            subjects: Some(subject(&i.namespace)),
        },
    );
    doc(&mut out, &deployment(i));
    out
}

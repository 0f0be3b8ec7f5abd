//! The manifests gpuflow installs with: generated from the Rust types,
//! parsed back as their Kubernetes types, the CRD schema checked against
//! the example queues and a malformed one, the committed files and the Helm
//! chart kept equal to what the code generates.

use std::path::PathBuf;

use gpuflow_k8s::crd::GpuQueue;
use gpuflow_k8s::manifests::{self, Install};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use serde_json::Value;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn docs(yaml: &str) -> Vec<Value> {
    yaml.split("\n---")
        .map(|d| d.trim_start_matches("---"))
        .filter(|d| {
            d.lines()
                .any(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
        })
        .map(|d| serde_norway::from_str(d).unwrap_or_else(|e| panic!("{e}: {d}")))
        .collect()
}

/// Parses `v` as `T` and checks that nothing is lost on the way back.
fn round_trip<T: serde::de::DeserializeOwned + serde::Serialize>(v: &Value) -> T {
    let t: T = serde_json::from_value(v.clone()).unwrap_or_else(|e| panic!("{e}: {v}"));
    assert_eq!(
        &serde_json::to_value(&t).unwrap(),
        v,
        "a field was lost in the round trip"
    );
    t
}

fn crd_schema() -> Value {
    let crd: CustomResourceDefinition = round_trip(&docs(&manifests::crd_yaml())[0]);
    let schema = crd.spec.versions[0]
        .schema
        .as_ref()
        .unwrap()
        .open_api_v3_schema
        .as_ref()
        .unwrap();
    serde_json::to_value(schema).unwrap()
}

#[test]
fn the_crd_parses_as_a_custom_resource_definition_and_is_structural() {
    let crd: CustomResourceDefinition = round_trip(&docs(&manifests::crd_yaml())[0]);
    assert_eq!(crd.metadata.name.as_deref(), Some("gpuqueues.gpuflow.io"));
    assert_eq!(crd.spec.scope, "Cluster");
    // A structural schema: every object property typed, no
    // `additionalProperties: false` beside `properties`.
    fn walk(v: &Value, path: &str) {
        if let Some(o) = v.as_object()
            && o.contains_key("properties")
        {
            assert!(
                o.get("additionalProperties").is_none(),
                "{path}: properties and additionalProperties"
            );
            assert_eq!(
                o.get("type").and_then(Value::as_str),
                Some("object"),
                "{path}"
            );
            for (k, p) in o["properties"].as_object().unwrap() {
                assert!(p.get("type").is_some(), "{path}.{k} has no type");
                walk(p, &format!("{path}.{k}"));
            }
        }
    }
    walk(&crd_schema(), "");
}

#[test]
fn the_crd_schema_accepts_the_example_queues_and_rejects_malformed_ones() {
    let schema = crd_schema();
    let v = jsonschema::validator_for(&schema).expect("the schema compiles");
    let examples =
        std::fs::read_to_string(repo().join("deploy/kubernetes/examples/queues.yaml")).unwrap();
    let queues = docs(&examples);
    assert_eq!(queues.len(), 3);
    for q in &queues {
        let errors: Vec<String> = v.iter_errors(q).map(|e| e.to_string()).collect();
        assert!(errors.is_empty(), "{q}: {errors:?}");
        // And gpuflow reads them as it will from the API.
        let _: GpuQueue = serde_json::from_value(q.clone()).unwrap();
    }
    let bad = |patch: &str| {
        let mut q = queues[1].clone();
        let p: Value = serde_json::from_str(patch).unwrap();
        for (k, val) in p.as_object().unwrap() {
            q["spec"][k] = val.clone();
        }
        q
    };
    for (malformed, why) in [
        (r#"{"weight": -1}"#, "a negative weight"),
        (
            r#"{"quotas": {"*": {"guaranteed": "four"}}}"#,
            "a quota that is not a number",
        ),
        (
            r#"{"quotas": {"*": {"borrowLimit": 4}}}"#,
            "a quota without its guarantee",
        ),
        (
            r#"{"namespaces": "team-a"}"#,
            "namespaces that are not a list",
        ),
        (r#"{"state": "Paused"}"#, "an unknown state"),
        (
            r#"{"budget": {"gpuHours": 10, "period": "Year"}}"#,
            "an unknown budget period",
        ),
        (
            r#"{"budget": {"gpuHours": 10}}"#,
            "a budget without its period",
        ),
        (
            r#"{"budget": {"gpuHours": 10, "period": "Day", "taperFrom": 1.5}}"#,
            "a taper beyond the budget",
        ),
    ] {
        assert!(!v.is_valid(&bad(malformed)), "the schema accepted {why}");
    }
    // A queue without its spec is refused too.
    assert!(!v.is_valid(&serde_json::json!({"apiVersion": "gpuflow.io/v1alpha1", "kind": "GpuQueue", "metadata": {"name": "x"}})));
}

fn check_install(yaml: &str, namespace: &str, image: &str, replicas: i32) {
    let mut kinds = Vec::new();
    for d in docs(yaml) {
        let kind = d["kind"].as_str().unwrap().to_string();
        match kind.as_str() {
            "Namespace" => drop(round_trip::<Namespace>(&d)),
            "ServiceAccount" => drop(round_trip::<ServiceAccount>(&d)),
            "ClusterRole" => {
                let r: ClusterRole = round_trip(&d);
                let hami = r.metadata.name.as_deref() == Some("gpuflow-scheduler-hami");
                for rule in r.rules.unwrap() {
                    let res = rule.resources.unwrap_or_default();
                    assert!(
                        !res.iter()
                            .any(|x| x == "*" || x == "secrets" || x == "configmaps"),
                        "{res:?}"
                    );
                    assert!(!rule.verbs.iter().any(|v| v == "*"), "{:?}", rule.verbs);
                    // Writes only where gpuflow writes.
                    for v in &rule.verbs {
                        let write = !matches!(v.as_str(), "get" | "list" | "watch");
                        let allowed = [
                            "pods",
                            "pods/binding",
                            "pods/status",
                            "events",
                            "gpuqueues/status",
                        ];
                        // Nodes: only HAMi's lock, in a role of its own.
                        let hami_lock = hami && v == "patch" && res == ["nodes"];
                        assert!(
                            !write
                                || hami_lock
                                || res.iter().all(|r| allowed.contains(&r.as_str())),
                            "{v} on {res:?}"
                        );
                    }
                }
            }
            "ClusterRoleBinding" => drop(round_trip::<ClusterRoleBinding>(&d)),
            "Role" => {
                let r: Role = round_trip(&d);
                assert_eq!(
                    r.metadata.namespace.as_deref(),
                    Some(namespace),
                    "the lease role is namespaced"
                );
            }
            "RoleBinding" => drop(round_trip::<RoleBinding>(&d)),
            "Deployment" => {
                let dep: Deployment = round_trip(&d);
                let spec = dep.spec.unwrap();
                assert_eq!(spec.replicas, Some(replicas));
                let pod = spec.template.spec.unwrap();
                let c = &pod.containers[0];
                assert_eq!(c.image.as_deref(), Some(image));
                assert_eq!(pod.security_context.unwrap().run_as_non_root, Some(true));
                let sc = c.security_context.clone().unwrap();
                assert_eq!(sc.allow_privilege_escalation, Some(false));
                assert!(
                    c.args
                        .as_ref()
                        .unwrap()
                        .windows(2)
                        .any(|w| w[0] == "--namespace" && w[1] == namespace)
                );
            }
            k => panic!("unexpected kind {k}"),
        }
        kinds.push(kind);
    }
    for k in [
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "Deployment",
    ] {
        assert!(kinds.iter().any(|x| x == k), "no {k} in {kinds:?}");
    }
}

#[test]
fn the_install_manifests_parse_as_their_types_with_least_privilege() {
    let i = Install::default();
    check_install(
        &manifests::install_yaml(&i),
        &i.namespace,
        &i.image,
        i.replicas,
    );
}

#[test]
fn the_committed_manifests_are_what_the_code_generates() {
    let read = |p: &str| std::fs::read_to_string(repo().join(p)).unwrap();
    assert_eq!(
        read("deploy/kubernetes/crd.yaml"),
        manifests::crd_yaml(),
        "regenerate: deploy/regenerate.sh"
    );
    assert_eq!(
        read("deploy/helm/gpuflow/crds/gpuqueues.yaml"),
        manifests::crd_yaml()
    );
    assert_eq!(
        read("deploy/kubernetes/gpuflow.yaml"),
        manifests::install_yaml(&Install::default()),
        "regenerate: deploy/regenerate.sh"
    );
}

/// Renders the chart's templates as `helm template` would with these
/// values (the chart uses only `.Values.image`, `.Values.replicas` and
/// `.Release.Namespace`; any other template expression fails the test).
fn render_chart(namespace: &str, image: &str, replicas: i32) -> String {
    let t =
        std::fs::read_to_string(repo().join("deploy/helm/gpuflow/templates/gpuflow.yaml")).unwrap();
    let out = t
        .replace("{{ .Release.Namespace }}", namespace)
        .replace("{{ .Values.image }}", image)
        .replace("{{ .Values.replicas }}", &replicas.to_string());
    assert!(
        !out.contains("{{"),
        "the chart uses a template expression this test does not render"
    );
    out
}

#[test]
fn the_helm_chart_renders_the_same_objects_with_its_values() {
    let values: Value = serde_norway::from_str(
        &std::fs::read_to_string(repo().join("deploy/helm/gpuflow/values.yaml")).unwrap(),
    )
    .unwrap();
    let image = values["image"].as_str().unwrap();
    let replicas = values["replicas"].as_i64().unwrap() as i32;
    for (ns, image, replicas) in [
        ("gpuflow-system", image, replicas),
        ("sched", "registry.example.com/gpuflow:1.2", 3),
    ] {
        let rendered = render_chart(ns, image, replicas);
        check_install(&rendered, ns, image, replicas);
        let want = manifests::release_yaml(&Install {
            namespace: ns.into(),
            image: image.into(),
            replicas,
        });
        assert_eq!(
            docs(&rendered),
            docs(&want),
            "the chart and `gpuflow k8s manifests` differ"
        );
    }
    let chart: Value = serde_norway::from_str(
        &std::fs::read_to_string(repo().join("deploy/helm/gpuflow/Chart.yaml")).unwrap(),
    )
    .unwrap();
    assert_eq!(chart["apiVersion"], "v2");
    assert_eq!(chart["name"], "gpuflow");
}

#!/usr/bin/env bash
# Writes the Kubernetes manifests and the Helm chart's templates from the
# Rust types (`gpuflow k8s manifests`). crates/gpuflow-k8s/tests/manifests.rs
# fails when the committed files differ from what this writes.
set -euo pipefail
cd "$(dirname "$0")/.."
gpuflow=(cargo run -q --release --bin gpuflow --)
"${gpuflow[@]}" k8s manifests --crd > deploy/kubernetes/crd.yaml
cp deploy/kubernetes/crd.yaml deploy/helm/gpuflow/crds/gpuqueues.yaml
crd_bytes=$(wc -c < deploy/kubernetes/crd.yaml)
"${gpuflow[@]}" k8s manifests | tail -c +$((crd_bytes + 1)) > deploy/kubernetes/gpuflow.yaml
# The chart: the same objects but the namespace (Helm creates it), with the
# values in place of placeholders.
"${gpuflow[@]}" k8s manifests --namespace NAMESPACE_X --image IMAGE_X --replicas 7 \
  | tail -c +$((crd_bytes + 1)) | python3 -c '
import sys
docs = sys.stdin.read().split("---\n")[1:]
docs = [d for d in docs if not d.startswith("apiVersion: v1\nkind: Namespace")]
out = "---\n" + "---\n".join(docs)
out = out.replace("NAMESPACE_X", "{{ .Release.Namespace }}").replace("IMAGE_X", "{{ .Values.image }}")
out = out.replace("replicas: 7", "replicas: {{ .Values.replicas }}")
print("# Rendered by Helm with values.yaml; the same objects as `gpuflow k8s manifests`")
print("# (deploy/regenerate.sh writes it; crates/gpuflow-k8s/tests/manifests.rs checks it).")
sys.stdout.write(out)
' > deploy/helm/gpuflow/templates/gpuflow.yaml

#!/usr/bin/env bash
# Installs gpuflow in a kind cluster (or, with KIND=0, in the cluster of the
# current kubeconfig), then runs the example gang, a MIG pod, a pod on a
# time slice of a GPU and a share of a GPU with memory and compute limits
# (HAMi).
#
# Needs: docker, kind, kubectl. kind nodes have no GPUs, so the script
# gives two of them fake GPU capacity (as the NVIDIA device plugin would
# advertise it) through the API; the example pods are bound by gpuflow but
# their containers cannot use a GPU there. The third worker gets the
# registration HAMi's device plugin would write; with no plugin to allocate,
# the share is bound and its node stays locked. On a real GPU cluster
# (NVIDIA device plugin with the mixed MIG strategy or time-slicing with
# renameByDefault, GPU feature discovery, and HAMi's device plugin on the
# nodes that share) run it with KIND=0 and the pods run.
set -euo pipefail
cd "$(dirname "$0")/../.."
KIND=${KIND:-1}
IMAGE=${IMAGE:-gpuflow:dev}

if [ "$KIND" = 1 ]; then
  kind get clusters | grep -qx gpuflow || kind create cluster --name gpuflow --config - <<'YAML'
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
nodes: [{role: control-plane}, {role: worker}, {role: worker}, {role: worker}]
YAML
  docker build -t "$IMAGE" -f deploy/kubernetes/Dockerfile .
  kind load docker-image "$IMAGE" --name gpuflow
  # Fake GPUs on the workers: capacity as a device plugin reports it, and
  # GPU feature discovery's labels.
  kubectl proxy --port=8011 & proxy=$!
  trap 'kill $proxy' EXIT
  sleep 2
  # The first worker: four whole GPUs and seven MIG instances; the second:
  # two GPUs time-sliced four ways.
  workers=($(kubectl get nodes -o name | grep worker | cut -d/ -f2))
  curl -s -H 'Content-Type: application/json-patch+json' -X PATCH \
    "http://127.0.0.1:8011/api/v1/nodes/${workers[0]}/status" \
    -d '[{"op":"add","path":"/status/capacity/nvidia.com~1gpu","value":"4"},
         {"op":"add","path":"/status/capacity/nvidia.com~1mig-1g.10gb","value":"7"}]' >/dev/null
  curl -s -H 'Content-Type: application/json-patch+json' -X PATCH \
    "http://127.0.0.1:8011/api/v1/nodes/${workers[1]}/status" \
    -d '[{"op":"add","path":"/status/capacity/nvidia.com~1gpu.shared","value":"8"}]' >/dev/null
  kubectl label node "${workers[1]}" --overwrite nvidia.com/gpu.replicas=4
  # The third: two GPUs HAMi splits ten ways each.
  curl -s -H 'Content-Type: application/json-patch+json' -X PATCH \
    "http://127.0.0.1:8011/api/v1/nodes/${workers[2]}/status" \
    -d '[{"op":"add","path":"/status/capacity/nvidia.com~1gpu","value":"20"}]' >/dev/null
  kubectl annotate node "${workers[2]}" --overwrite \
    hami.io/node-nvidia-register='GPU-kind-0,10,81559,100,NVIDIA-H100-80GB-HBM3,0,true,0,hami-core:GPU-kind-1,10,81559,100,NVIDIA-H100-80GB-HBM3,0,true,1,hami-core:' 
  for n in "${workers[@]}"; do
    kubectl label node "$n" --overwrite nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3 nvidia.com/gpu.memory=81559
  done
fi

kubectl apply -f deploy/kubernetes/crd.yaml
kubectl wait --for condition=established crd/gpuqueues.gpuflow.io
cargo run -q --release --bin gpuflow -- k8s manifests --image "$IMAGE" | kubectl apply -f -
kubectl -n gpuflow-system rollout status deploy/gpuflow-scheduler --timeout=120s
kubectl create namespace team-a --dry-run=client -o yaml | kubectl apply -f -
kubectl create namespace team-b --dry-run=client -o yaml | kubectl apply -f -
kubectl apply -f deploy/kubernetes/examples/queues.yaml
kubectl apply -f deploy/kubernetes/examples/gang.yaml -f deploy/kubernetes/examples/mig.yaml \
  -f deploy/kubernetes/examples/time-slice.yaml -f deploy/kubernetes/examples/share.yaml
sleep 5
kubectl -n team-a get pods -o wide
kubectl -n gpuflow-system get lease gpuflow-scheduler -o jsonpath='{.spec.holderIdentity}{"\n"}'

#!/usr/bin/env bash
# The agent on a real NVIDIA GPU machine, end to end (issue #14): runs
# `gpuflow up` on the machine's GPUs through NVML and checks what only real
# GPUs can show. It reads GPUs and never changes their settings (no MIG mode,
# no clocks, no persistence mode). Run it as root so tasks get cgroups.
#
#   scripts/gpu-check.sh                 # builds target/release/gpuflow first
#   GPUFLOW_BIN=path/to/gpuflow scripts/gpu-check.sh
#
# Checks, each printed PASS, FAIL or SKIP (with the reason); exits 1 when one
# failed:
#   1. the inventory the agent found through NVML matches nvidia-smi's list;
#   2. a 1-GPU task sees exactly its GPU (CUDA_VISIBLE_DEVICES is its UUID,
#      and CUDA, through PyTorch when it is installed, counts one device);
#   3. a PyTorch program that keeps its GPU busy moves the utilisation samples
#      (the node's and the task's);
#   4. a task sharing a GPU with a 1 GiB GPU-memory claim that allocates 4 GiB
#      is stopped by the watchdog with a gpu-memory event;
#   5. a task opens only its own GPU's /dev/nvidiaN (others, and every one
#      for a task without a GPU, are refused by the device controller);
#   6. where a GPU is already in MIG mode with two or more instances (the
#      script never sets it): a task on one instance opens its own two
#      /dev/nvidia-caps capabilities and is refused every other one.
set -uo pipefail
cd "$(dirname "$0")/.."
bin=${GPUFLOW_BIN:-}
if [ -z "$bin" ]; then
  cargo build --release --quiet --bin gpuflow || exit 2
  bin=target/release/gpuflow
fi
command -v nvidia-smi >/dev/null || { echo "nvidia-smi not found: this script needs an NVIDIA GPU machine" >&2; exit 2; }
dir=$(mktemp -d)
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
trap 'kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; rm -rf "$dir"' EXIT
"$bin" up --listen "127.0.0.1:$port" --data-dir "$dir/data" --heartbeat 1 --cycle-ms 200 \
  --min-runtime 0 --sample-s 1 >"$dir/up.out" 2>"$dir/up.log" &
export GPUFLOW_SERVER="http://127.0.0.1:$port"
for _ in $(seq 300); do [ -s "$dir/data/admin.token" ] && break; sleep 0.2; done
export GPUFLOW_TOKEN=$(cat "$dir/data/admin.token")
failed=0
pass() { echo "PASS $*"; }
fail() { echo "FAIL $*"; failed=1; }
skip() { echo "SKIP $*"; }
json() { python3 -c "import json,sys; d=json.load(sys.stdin); print(eval(sys.argv[1]))" "$1"; }
nodes() { "$bin" node ls --output json; }
for _ in $(seq 100); do [ "$(nodes | json 'len(d)')" = 1 ] && break; sleep 0.2; done

# 1. Inventory.
want=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | sort | tr '\n' ' ')
got=$(nodes | json '" ".join(sorted(g["uuid"] for g in d[0]["inventory"]["gpus"]))')
emulated=$(nodes | json 'd[0]["inventory"]["emulated"]')
if [ "$emulated" = False ] && [ "$(echo $want)" = "$(echo $got)" ]; then
  pass "inventory: $(nodes | json 'len(d[0]["inventory"]["gpus"])') GPUs through NVML, as nvidia-smi lists them"
else
  fail "inventory: nvidia-smi lists [$want], the agent found [$got] (emulated: $emulated)"
fi
nodes | json 'd[0]["inventory"]["limits"]' | sed 's/^/     limits: /'

submit() { # name gpu-spec (empty: no GPU) script
  if [ -n "$2" ]; then gpu=", gpu: $2"; else gpu=""; fi
  cat >"$dir/$1.yaml" <<YAML
name: $1
queue: default
kind: batch
tasks:
  - name: main
    command: [sh, -c, '$3']
    resources: {cpu: 2, memory_mib: 8192$gpu}
YAML
  "$bin" job submit -f "$dir/$1.yaml" --output json | json 'd["id"]'
}
wait_state() { # id state...
  for _ in $(seq 300); do
    s=$("$bin" job get "$1" --output json | json 'd["state"]')
    for w in "${@:2}"; do [ "$s" = "$w" ] && { echo "$s"; return 0; }; done
    sleep 0.5
  done
  echo "$s"; return 1
}
logs() { "$bin" job logs "$1" --output json | json '"".join(d["tasks"].values())'; }
has_torch=$(python3 -c 'import torch; print(torch.cuda.is_available())' 2>/dev/null || echo no)

# 2. A task sees exactly its GPU.
id=$(submit see '{count: 1}' 'echo visible=$CUDA_VISIBLE_DEVICES; python3 -c "import torch; print(\"devices\", torch.cuda.device_count())" 2>/dev/null || echo devices none')
wait_state "$id" succeeded failed >/dev/null
out=$(logs "$id")
visible=$(echo "$out" | sed -n 's/^visible=//p')
if echo "$visible" | grep -qE '^(GPU|MIG)-[0-9a-f-]+$'; then
  pass "a 1-GPU task sees one GPU by UUID: $visible"
else
  fail "a 1-GPU task saw CUDA_VISIBLE_DEVICES=$visible"
fi
case "$out" in
  *"devices 1"*) pass "CUDA (PyTorch) counts one device in the task" ;;
  *"devices none"*) skip "PyTorch is not installed: CUDA's device count not checked" ;;
  *) fail "CUDA (PyTorch) in the task: $(echo "$out" | grep devices)" ;;
esac

# 3. Utilisation samples move when the GPU works.
if [ "$has_torch" = True ]; then
  id=$(submit busy '{count: 1}' 'python3 -c "import torch,time; a=torch.randn(8192,8192,device=\"cuda\"); t=time.time()
while time.time()-t<25: a=a@a; a=a/a.norm()
torch.cuda.synchronize()"')
  wait_state "$id" running >/dev/null
  sleep 12
  node_util=$(nodes | json 'max([g["util_pct"] for g in d[0].get("gpus_now", [])] or [0])')
  task_util=$("$bin" job get "$id" --output json | json '(d["tasks"][0].get("usage") or {}).get("gpu_util_pct", 0)')
  if [ "$node_util" -gt 10 ] && [ "$task_util" -gt 10 ]; then
    pass "utilisation samples move: node GPU at ${node_util}%, the task at ${task_util}%"
  else
    fail "utilisation while a matmul loop runs: node ${node_util}%, task ${task_util}%"
  fi
  wait_state "$id" succeeded failed >/dev/null
else
  skip "PyTorch with CUDA is not installed: the utilisation and watchdog checks need a CUDA program"
fi

# 4. The GPU-memory watchdog.
if [ "$has_torch" = True ]; then
  id=$(submit hog '{mode: fraction, fraction: 0.25, memory_mib: 1024}' 'python3 -c "import torch,time; x=torch.empty(4<<30, dtype=torch.uint8, device=\"cuda\"); x.fill_(1); time.sleep(60)"')
  state=$(wait_state "$id" failed succeeded)
  reason=$("$bin" job get "$id" --output json | json 'd["reason"]')
  if [ "$state" = failed ] && echo "$reason" | grep -q "GPU-memory limit"; then
    pass "the watchdog stopped a task past its GPU-memory claim: $reason"
  else
    fail "a task allocating 4 GiB against a 1 GiB claim ended $state: $reason"
  fi
fi
# A task's script that tries to open each device node of a glob.
opener() { echo 'for d in '"$1"'; do if true 2>e <"$d"; then echo "$d opened"; else echo "$d $(cat e)"; fi; done'; }
# 5. A task opens only its own GPU's device node.
probe=$(opener '/dev/nvidia[0-9]*')
id=$(submit devs '{count: 1}' "$probe")
wait_state "$id" succeeded failed >/dev/null
out=$(logs "$id")
opened=$(echo "$out" | grep -c ' opened$' || true)
denied=$(echo "$out" | grep -c 'Operation not permitted' || true)
total=$(ls /dev/nvidia[0-9]* 2>/dev/null | wc -l)
if [ "$opened" = 1 ] && [ "$denied" = $((total - 1)) ]; then
  pass "a 1-GPU task opens its own device node and is refused the other $denied"
else
  fail "a 1-GPU task opened $opened of $total GPU device nodes: $(echo "$out" | tr '\n' ';')"
fi
id=$(submit nodevs '' "$probe")
wait_state "$id" succeeded failed >/dev/null
out=$(logs "$id")
if [ "$(echo "$out" | grep -c 'Operation not permitted' || true)" = "$total" ]; then
  pass "a task without a GPU is refused all $total GPU device nodes"
else
  fail "a task without a GPU: $(echo "$out" | tr '\n' ';')"
fi
# 6. A MIG task opens only its own instance's capabilities.
profile=$(nvidia-smi -L | sed -n 's/.*MIG \([0-9]*g\.[0-9]*gb\).*/\1/p' | head -1)
caps=$(ls /dev/nvidia-caps/nvidia-cap* 2>/dev/null | wc -l)
if [ -z "$profile" ] || [ "$caps" -lt 4 ]; then
  skip "no GPU in MIG mode with capability devices here (the script never sets MIG mode)"
else
  probe=$(opener '/dev/nvidia-caps/nvidia-cap*')
  id=$(submit migcaps "{mode: mig, profile: $profile}" "$probe")
  wait_state "$id" succeeded failed >/dev/null
  out=$(logs "$id")
  opened=$(echo "$out" | grep -c ' opened$' || true)
  # config and monitor are root's alone (0400): refused before the cgroup asks.
  denied=$(echo "$out" | grep -c 'Operation not permitted\|Permission denied' || true)
  if [ "$opened" = 2 ] && [ "$denied" = $((caps - 2)) ]; then
    pass "a $profile task opens its instance's 2 capabilities and is refused the other $denied"
  else
    fail "a $profile task opened $opened of $caps MIG capabilities: $(echo "$out" | tr '\n' ';')"
  fi
fi
exit $failed

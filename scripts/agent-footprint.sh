#!/usr/bin/env bash
# The node agent's own cost (issue #14): resident memory and CPU of a
# `gpuflow agent` process at idle and with 8 running tasks, sampling its
# GPUs and tasks every second. The GPUs are the fake NVML library's (8 of
# them, each task's process listed on its GPU, so every sample traces
# processes to tasks), built from crates/gpuflow-agent/fake-nvml with cc.
#
#   scripts/agent-footprint.sh [SECONDS]     # each phase measured this long (30)
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-30}
bin=${GPUFLOW_BIN:-}
if [ -z "$bin" ]; then
  cargo build --release --quiet --bin gpuflow
  bin=target/release/gpuflow
fi
dir=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; rm -rf "$dir"' EXIT
cc -shared -fPIC -O1 -o "$dir/libnvidia-ml.so.1" crates/gpuflow-agent/fake-nvml/fake_nvml.c
: >"$dir/state"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
GPUFLOW_JOIN_TOKEN=bench "$bin" server --listen "127.0.0.1:$port" --data-dir "$dir/data" \
  --heartbeat 2 --cycle-ms 200 >/dev/null 2>"$dir/server.log" &
for _ in $(seq 100); do [ -s "$dir/data/admin.token" ] && break; sleep 0.1; done
FAKE_NVML_GPUS=8 FAKE_NVML_STATE="$dir/state" GPUFLOW_JOIN_TOKEN=bench "$bin" agent \
  --server "http://127.0.0.1:$port" --node bench --work-dir "$dir/work" \
  --nvml-lib "$dir/libnvidia-ml.so.1" --sample-s 1 >/dev/null 2>"$dir/agent.log" &
agent=$!
export GPUFLOW_SERVER="http://127.0.0.1:$port" GPUFLOW_TOKEN=$(cat "$dir/data/admin.token")
tick=$(getconf CLK_TCK)
measure() { # label
  local a b
  read -r a < <(awk '{print $14+$15}' /proc/$agent/stat)
  sleep "$secs"
  read -r b < <(awk '{print $14+$15}' /proc/$agent/stat)
  local rss=$(awk '/VmRSS/ {print $2}' /proc/$agent/status)
  python3 -c "print(f'$1: resident {int($rss)/1024:.1f} MiB, CPU {($b-$a)/$tick/$secs*100:.2f}% of one core over $secs s')"
}
sleep 5
measure "idle (8 GPUs, sampled every 1 s)"
for i in $(seq 8); do
  printf 'name: t%s\nqueue: default\ntasks:\n  - name: main\n    command: [sh, -c, "echo pid $$; exec sleep 100000"]\n    resources: {cpu: 0.1, memory_mib: 64, gpu: {count: 1}}\n' "$i" >"$dir/j.yaml"
  "$bin" job submit -f "$dir/j.yaml" >/dev/null
done
for _ in $(seq 100); do
  [ "$("$bin" job ls --state running --output json | python3 -c 'import json,sys; print(len(json.load(sys.stdin)))')" = 8 ] && break
  sleep 0.5
done
# Each task's process on its GPU, as NVML would list it.
"$bin" job ls --output json | python3 -c '
import json, subprocess, sys
for j in json.load(sys.stdin):
    logs = json.loads(subprocess.check_output([sys.argv[1], "job", "logs", str(j["id"]), "--output", "json"]))
    pid = "".join(logs["tasks"].values()).split()[1]
    g = j["tasks"][0]["gpus"][0]
    print(f"gpu {g} util 60 memutil 30 used_mib 20000 power_mw 300000 temp 65")
    print(f"proc {g} {pid} 20000 60")
' "$bin" >"$dir/state"
sleep 3
measure "8 running tasks (each on its GPU, sampled every 1 s)"
"$bin" job ls --output json | python3 -c '
import json, sys
jobs = json.load(sys.stdin)
traced = sum(1 for j in jobs if (j["tasks"][0].get("usage") or {}).get("gpu_memory_mib") == 20000)
print(f"tasks whose GPU process the agent traced: {traced} of {len(jobs)}")'

#!/usr/bin/env bash
# Fuzzes the HTTP API from its own OpenAPI document with schemathesis
# (pip install schemathesis): a throwaway `gpuflow server` with one emulated
# agent, every operation called with generated inputs as the admin. Fails on
# any 5xx and on any reply the document does not describe.
#
#   scripts/fuzz-api.sh [MAX_EXAMPLES]      # default 30 per operation
set -euo pipefail
cd "$(dirname "$0")/.."
command -v schemathesis >/dev/null || { echo "schemathesis is not installed: pip install schemathesis" >&2; exit 2; }
# GPUFLOW_BIN: a gpuflow binary already built (the test suite passes its own).
bin=${GPUFLOW_BIN:-}
if [ -z "$bin" ]; then
  cargo build --quiet --bin gpuflow
  bin=target/debug/gpuflow
fi
dir=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; rm -rf "$dir"' EXIT
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
GPUFLOW_JOIN_TOKEN=fuzz-join "$bin" server --listen "127.0.0.1:$port" --data-dir "$dir/data" >"$dir/server.log" 2>&1 &
for _ in $(seq 100); do [ -s "$dir/data/admin.token" ] && curl -sf "http://127.0.0.1:$port/v1/openapi.json" >/dev/null && break; sleep 0.1; done
GPUFLOW_JOIN_TOKEN=fuzz-join "$bin" agent --server "http://127.0.0.1:$port" --node n1 --emulate 2 --work-dir "$dir/work" >"$dir/agent.log" 2>&1 &
token=$(cat "$dir/data/admin.token")
api="http://127.0.0.1:$port/v1"
# The operations that revoke tokens or disable users run apart, as a spare
# admin: run with the main token, they could revoke it, and every later
# case would test only 401s.
destroy='^/v1/(tokens/\{id\}|users/\{name\}/(disable|enable))$'
curl -sf -X POST "$api/users" -H "Authorization: Bearer $token" -H 'Content-Type: application/json' \
  -d '{"name": "fuzz-spare", "role": "admin"}' >/dev/null
spare=$(curl -sf -X POST "$api/tokens" -H "Authorization: Bearer $token" -H 'Content-Type: application/json' \
  -d '{"user": "fuzz-spare"}' | python3 -c 'import json, sys; print(json.load(sys.stdin)["token"])')
common=(--checks not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance
  --max-examples "${1:-30}" --phases examples,coverage,fuzzing)
schemathesis run "$api/openapi.json" -H "Authorization: Bearer $token" "${common[@]}" \
  --exclude-path-regex "$destroy"
# The main token still works: nothing above could take it.
curl -sf "$api/whoami" -H "Authorization: Bearer $token" >/dev/null || { echo "the fuzzer's token stopped working" >&2; exit 1; }
schemathesis run "$api/openapi.json" -H "Authorization: Bearer $spare" "${common[@]}" \
  --include-path-regex "$destroy"

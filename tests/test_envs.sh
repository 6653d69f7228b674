#!/usr/bin/env bash
# Both separate test environments at once (tests/vllm_cpu_env.sh and tests/speculators_env.sh): their installs are
# mostly downloads and unpacking, so side by side they take about the longer one's time (here 241 s against 352 s
# one after the other). Fails when either fails; each one's output is kept in its log until it succeeds.
set -uo pipefail
cd "$(dirname "$0")/.."
logs="$(mktemp -d)"
bash tests/vllm_cpu_env.sh >"$logs/vllm.log" 2>&1 &
vllm=$!
bash tests/speculators_env.sh >"$logs/speculators.log" 2>&1 &
speculators=$!
status=0
for name in vllm speculators; do
    pid="${!name}"
    if wait "$pid"; then
        tail -n 1 "$logs/$name.log"
    else
        echo "test_envs.sh: the $name environment failed (tests/${name/vllm/vllm_cpu}_env.sh); its output:" >&2
        cat "$logs/$name.log" >&2
        status=1
    fi
done
rm -rf "$logs"
exit "$status"

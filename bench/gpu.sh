#!/bin/bash
# On a GPU machine whose Python packages (vLLM 0.26, Ray for the two-replica runs, the runner's
# dependencies) are unpacked in /tmp/site and whose model is in /tmp/smollm2 (Hugging Face format).
# Each call of the lending tool lays the working tree anew, so the benchmark runs from a copy, in
# the background, across calls:
#   bash bench/gpu.sh start [bench.py options]   |   bash bench/gpu.sh wait SECONDS
#   bash bench/gpu.sh streams DEADLINE_S "CASES_A" "CASES_B"   (two GPUs: one bench.py per GPU, each
#       pinned to half the host's cores, so that neighbours do not share CPUs; then `wait`)
# BENCH=bench/speculation.py runs that benchmark instead of bench/bench.py.
# IMPORTTIME=1 first writes `python -X importtime -c "import vllm"` to /tmp/importtime.txt (where the
# ~18 s of vLLM's import on the H200 host goes; `wait` copies it to $OUT).
# The 8B shape was last measured at b6250f9 (3 rounds of sorted, runner and cap512 after a warm-up
# of the three, every runner run calibrating: ~1,280 s of device time in all; staging ~30 s, install
# ~90 s, the warm-up ~480 s, a round ~230 s; bench/results/2026-12-05-nvidia-h200-8b-cap512.json):
#   WARMUP="invoices/tight/8b=sorted,runner,cap512" BENCH_COMMIT=<commit> bash bench/gpu.sh start --multi "" \
#     --repeats 3 --deadline-s 620 --cases "invoices/tight/8b=sorted,runner,cap512"
# With a stored calibration (81b1f0d: runner_first, then 3 rounds of sorted and runner; 1,079 s):
#   WARMUP="invoices/tight/8b=sorted,runner" BENCH_COMMIT=<commit> bash bench/gpu.sh start --multi "" \
#     --repeats 3 --deadline-s 800 --cases "invoices/tight/8b=runner_first@1;invoices/tight/8b=sorted,runner"
# With plain arrival too (fd5ce10: bench/results/2026-12-03-nvidia-h200-8b-feedback.json) a round of
# four took ~6.5 min: 3 such rounds do not fit in 30 device minutes; plan 2. A start refused by the
# device (none free) still cost ~90 s of budget. The 135M was last measured at 585f8fb (3 rounds of
# plain, sorted and runner after a warm-up of plain and runner, then 2 more rounds of the three with
# --repeats 1 and a --workdir of their own: bench/results/2026-12-04-nvidia-h200-135m-5rounds.json;
# staging and install ~210 s of device time, the warm-up ~270 s, a round of the three ~3.5 min; no
# runner_first, so every runner run calibrated), then `profile` (py-spy, ~60 s). The 135M and two
# replicas were last measured together at 7222ca4 on nvidia-h200-x2 (the parts with EXTRA="ray[data]":
# 8 of 54 MiB, staged in ~70 s; install ~95 s; the warm-up ~215 s; a round ~345 s: two single-GPU runs
# at a time, then ray1 with the machine to itself, then ray2; ~1,410 s of device time in all;
# bench/results/2026-12-04-nvidia-h200x2-135m-ray.json):
#   WARMUP="invoices/tight/135m=plain,runner;invoices/roomy/135m=ray1" BENCH_COMMIT=<commit> bash bench/gpu.sh \
#     start --repeats 3 --deadline-s 1100 --cases "invoices/tight/135m=plain,sorted,runner,nobytecode" \
#     --multi "invoices/roomy/135m=ray1,ray2"
# The engine core in a replica's actor (ip) was measured on one H200 at d1e54b6 (two pairs of ray1 and
# ray1ip): it started ~3 s sooner but generated at 0.7x; it stays off. The 135M with a stored
# calibration was measured in the same lease (~1,450 s of device time with the second ray pair):
#   WARMUP="invoices/tight/135m=plain,runner;invoices/roomy/135m=ray1" BENCH_COMMIT=<commit> bash bench/gpu.sh \
#     start --repeats 3 --multi-repeats 1 --deadline-s 1000 --multi "invoices/roomy/135m=ray1,ray1ip" \
#     --cases "invoices/tight/135m=runner_first@1;invoices/tight/135m=plain,sorted,runner"
# Next, if a change to admission or the engine start is to be measured: the 135M plan again
#   WARMUP="invoices/tight/135m=plain,runner" BENCH_COMMIT=<commit> bash bench/gpu.sh start --multi "" \
#     --repeats 3 --deadline-s 900 --cases "invoices/tight/135m=sorted,runner,<variant>"
# Check a new configuration's outputs too (rows_valid, and errors in its results.sqlite), not only its speed.
# The incidents workload was last measured at 0956b60 (runner_first, then 3 rounds of plain, sorted and
# runner after a warm-up of plain and runner: bench/results/2026-12-04-nvidia-h200-incidents-3rounds.json),
# one machine for the whole plan: staging and install ~155 s of device time, the warm-up ~270 s (plain's
# first compile 148 s), runner_first 71 s, a round of the three ~4 min (runs 68-92 s); ~1,130 s in all:
#   WARMUP="incidents/tight/135m=plain,runner" bash bench/gpu.sh start --multi "" --repeats 3 \
#     --deadline-s 900 --cases "incidents/tight/135m=runner_first@1;incidents/tight/135m=plain,sorted,runner"
# The lease of 1e36786 lost its first machine at the poll after a `wait 280` that came back with the
# warm-up's files (~600 s of device time); `wait 270` polls, back to back, kept both machines since.
# The 8B shape's plan with plain arrival (~6.5 min a round; its 8B run takes ~135 s):
#   WARMUP="invoices/tight/8b=plain,runner" bash bench/gpu.sh start --multi "" --repeats 2 \
#     --deadline-s 700 --cases "invoices/tight/8b=plain,sorted,runner"
# A machine left idle for 30 s is gone with everything on it (62855f5 lost its round 3 that way, and
# 04253d4 its whole first machine, ~750 s of device time, while a watcher script was being written
# between two polls: write any command before the poll that precedes it):
# chain the polls with nothing between them, and copy what a later look needs (a run's
# results.sqlite) to $OUT inside a polling call.
# .gpu/setup.sh is git-ignored: carry it (with the part) in every staging and install call. A call
# carries at most 64 MiB with the working tree (~3 MB): the parts must be 54 MiB each (p0-p6);
# make-wheelhouse.sh writes 62 MiB ones, so split them again:
#   cd .gpu && cat p0 p1 p2 p3 p4 p5 > /tmp/all.tar && rm p? && split -b 54M -d -a 1 /tmp/all.tar p
# The device keeps a machine only 30 s after a call: poll with back-to-back `wait 290` calls.
# Staging takes ~1 min of device time, `install` ~1.5 min; a fresh machine's first vLLM start takes
# ~3 min even eager, so a one-off check needs ~6 min of device time, not 3.
# On nvidia-h200-x2 (two replicas, 8,192 documents; Ray needs EXTRA="ray[data]" in the wheelhouse).
# Last measured at 253e960 (bench/results/2026-12-04-nvidia-h200x2-135m-ray-fork.json; ~1,320 s of
# device time: staging ~70 s, install with the model's conversion ~115 s, the warm-up and 3 rounds of
# the three ~1,130 s, a round ~290 s):
#   WARMUP="invoices/roomy/135m=ray1" BENCH_COMMIT=<commit> bash bench/gpu.sh start --cases "" --repeats 3 \
#     --multi-repeats 3 --deadline-s 1000 --multi "invoices/roomy/135m=ray1,ray2,ray2sp"
# What a step costs (bench/step_cost.py; 2026-12-05 on an H100, ~290 s with the engine's first start of 211 s):
#   cd /tmp/proj && PYTHONPATH=/tmp/site:/tmp/proj VLLM_CACHE_ROOT=/tmp/vllm-cache HF_HUB_OFFLINE=1 timeout 440 \
#     python3 bench/step_cost.py --model /tmp/smollm2 --shape 8b --batches 16,64,128,192 --tokens 96 --repeats 2 --out $OUT/sc.json
# The pace seeded with the stored calibration's lengths (kv_lengths_from_calibration) against `noseed`,
# the runner without it, both reusing runner_first's calibration, was measured at 6386fd0 on an H100
# with the shorter plan below (~860 s of device time held: staging ~30 s, install ~80 s, the sorted
# warm-up and runner_first ~290 s, a round ~180 s; bench/results/2026-12-05-nvidia-h100-8b-calibration-seeds.json):
#   WARMUP="invoices/tight/8b=sorted,runner" BENCH_COMMIT=<commit> bash bench/gpu.sh start --multi "" \
#     --repeats 3 --deadline-s 700 --cases "invoices/tight/8b=runner_first@1;invoices/tight/8b=sorted,runner,noseed"
# With less device time left, runner_first is the runner's warm-up (its compile counts in its own wall,
# which no target reads for the 8B shape) and --deadline-s lets round 3 start (~1,000 s in all):
#   WARMUP="invoices/tight/8b=sorted" BENCH_COMMIT=<commit> bash bench/gpu.sh start --multi "" \
#     --repeats 3 --deadline-s 900 --cases "invoices/tight/8b=runner_first@1;invoices/tight/8b=sorted,runner,noseed"
# Without noseed (785a79a, an H200: bench/results/2026-12-06-nvidia-h200-8b-stored.json; staging ~25 s,
# install with the model's conversion ~117 s, the plan ~755 s; then gpu_smoke.sh ~215 s in the same lease):
#   WARMUP="invoices/tight/8b=sorted" BENCH_COMMIT=<commit> bash bench/gpu.sh start --multi "" \
#     --repeats 3 --deadline-s 800 --cases "invoices/tight/8b=runner_first@1;invoices/tight/8b=sorted,runner"
# 84f3ee5's output lengths from the last run (since taken out) were measured on an H100 (no H200 came):
# a runner warm-up, runner_first, 3 rounds of runner and noseed: ~1,150 s of device time with staging
# (~30 s) and install (~100 s); bench/results/2026-12-05-nvidia-h100-8b-seeded-lengths.json.
# A process left running in the background must be started with setsid (as `start` does): without it,
# it ended with the call that started it, and ~560 s of device time went by polling an empty log.
set -u
BENCH="${BENCH:-bench/bench.py}"
export PYTHONPATH=/tmp/site VLLM_CACHE_ROOT=/tmp/vllm-cache RUNNER_CACHE=/tmp/runner-cache PYTHONUNBUFFERED=1 \
       HF_HUB_OFFLINE=1 RAY_AUTH_MODE=disabled
machine() {  # what the results files name the machine by
  echo "$(nvidia-smi -L | wc -l)x $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(nproc) cores, vllm 0.26.0"
}
case "$1" in
start)
  # The warm-up must log as the measured runs do: vLLM 0.26 (torch < 2.12) turns inductor's asserts
  # on at VLLM_LOGGING_LEVEL=DEBUG, another compile-cache key, so a DEBUG warm-up warms nothing (the
  # lease of e916717 tried it: each configuration's first measured run compiled, ~22 s).
  # WARMUP="invoices/tight/135m=plain;invoices/tight/8b=plain" first runs those cases once on 16
  # rows (each model's first torch.compile and kernel JIT, ~1-3 min), so that every measured round
  # is warm; its results go to /tmp/warmup.json. --deadline-s counts from the measured rounds' start.
  # A Ray configuration in WARMUP runs on 16 rows too (Ray's own first start, its bytecode written).
  shift
  rm -rf /tmp/proj && cp -r . /tmp/proj && cd /tmp/proj
  export BENCH WARMUP="${WARMUP:-}" BENCH_COMMIT="${BENCH_COMMIT:-unknown}" IMPORTTIME="${IMPORTTIME:-}"
  export MACHINE="$(machine)"
  # A misspelt case or configuration stops here, before the warm-up spends GPU time (bench.py only).
  if [ "$BENCH" = bench/bench.py ]; then
    { [ -z "$WARMUP" ] || python3 "$BENCH" --model /tmp/smollm2 --multi "" --cases "$WARMUP" --dry-run; } &&
      python3 "$BENCH" --model /tmp/smollm2 "$@" --dry-run || exit 1
  fi
  setsid nohup bash -c '
    if [ -n "$IMPORTTIME" ]; then
      python3 -X importtime -c "import vllm; from vllm import LLM, SamplingParams" 2> /tmp/importtime.txt
    fi
    if [ -n "$WARMUP" ]; then
      python3 "$BENCH" --model /tmp/smollm2 --machine "$MACHINE" --multi "" --repeats 1 --docs 16 --multi-docs 16 \
        --cases "$WARMUP" --out /tmp/warmup.json --workdir /tmp/rbw > /tmp/warmup.log 2>&1
      # The compile caches stay warm; the grammar choice goes, so that the first measured run makes
      # it, as the first run of a job on a machine does.
      rm -rf "$RUNNER_CACHE/grammar"
    fi
    exec python3 "$BENCH" --model /tmp/smollm2 --machine "$MACHINE" --out /tmp/e2e.json --workdir /tmp/rb "$@"
  ' bench "$@" > /tmp/bench.log 2>&1 < /dev/null &
  sleep 30; grep -vE "WARNING|INFO|^\s*$" /tmp/warmup.log /tmp/bench.log 2>/dev/null | tail -5 ;;
streams)
  rm -rf /tmp/proj && cp -r . /tmp/proj && cd /tmp/proj
  half=$(( $(nproc) / 2 ))
  for i in 0 1; do
    cases=$([ $i = 0 ] && echo "$3" || echo "$4")
    cores=$([ $i = 0 ] && echo "0-$(( half - 1 ))" || echo "$half-$(( 2 * half - 1 ))")
    BENCH_COMMIT="${BENCH_COMMIT:-unknown}" setsid nohup taskset -c "$cores" python3 "$BENCH" --model /tmp/smollm2 \
      --machine "$(machine)" --cases "$cases" --multi "" --gpus $i --deadline-s "$2" --out /tmp/e2e-$i.json \
      --workdir /tmp/rb$i > /tmp/bench-$i.log 2>&1 < /dev/null &
  done
  sleep 20; tail -n 2 /tmp/bench-0.log /tmp/bench-1.log ;;
profile)
  # py-spy (a wheel carried beside the parts: python3 -m zipfile -e .gpu/py_spy-*.whl /tmp/site) over
  # one more runner run: the last measured runner run's job again over all its rows (--restart, its
  # calibration stored), the engine core's process included; poll with BENCH="-m runner.cli" ... wait.
  src=$(ls -d /tmp/rb/runs/*-runner-r* | sort | tail -1)
  rm -rf /tmp/prof && cp -r "$src" /tmp/prof && rm -f /tmp/prof/*.lock && cd /tmp/proj
  spy=$(ls /tmp/site/py_spy-*.data/scripts/py-spy) && chmod +x "$spy" || exit 1
  export PYTHONPATH=/tmp/site:/tmp/proj
  setsid nohup "$spy" record --subprocesses --nonblocking --idle --threads --rate 100 --format raw \
    --output /tmp/prof-runner.txt -- python3 -m runner.cli run --restart /tmp/prof/job.yaml \
    > /tmp/prof.log 2>&1 < /dev/null &
  sleep 20; tail -n 3 /tmp/prof.log ;;
wait)
  end=$(( $(date +%s) + $2 ))
  while [ "$(date +%s)" -lt "$end" ] && pgrep -f "python3 $BENCH" >/dev/null; do sleep 5; done
  pgrep -f "python3 $BENCH" >/dev/null && echo "still running" || echo "finished"
  # Every run's engine core is shut down and waited for: nothing may still hold the GPU.
  echo "GPU processes now: $(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ' ')"
  grep -hE "doc/s|ERROR|Error|failed|runs planned|Traceback" /tmp/bench.log /tmp/bench-*.log 2>/dev/null | tail -40
  cp /tmp/e2e*.json /tmp/prof*.txt /tmp/prof.log /tmp/bench*.log /tmp/warmup.json /tmp/warmup.log /tmp/importtime.txt "$OUT"/ 2>/dev/null
  # every run's own logs (vLLM's engine log among them), for what the results' excerpts leave out
  (cd /tmp && tar czf "$OUT/run-logs.tgz" --exclude='*.sqlite' --exclude='*.sqlite-*' --exclude='*.jsonl' --exclude='*.parquet' rb*/runs 2>/dev/null) ;;
esac

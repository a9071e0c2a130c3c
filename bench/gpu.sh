#!/bin/bash
# On the lent H200 (see ../shared/gpu/README.md): after `setup.sh install`, run the benchmark in
# the background (it outlives one device call) and wait for it.
#   bash bench/gpu.sh start   |   bash bench/gpu.sh wait SECONDS   |   bash bench/gpu.sh collect
set -u
export PYTHONPATH=/tmp/site:$PWD VLLM_CACHE_ROOT=/tmp/vllm-cache RUNNER_CACHE=/tmp/runner-cache PYTHONUNBUFFERED=1
case "$1" in
start)
  # Wheels were unpacked with zipfile, which drops the exec bit Ray's own binaries need.
  find /tmp/site/ray -path '*core/src*' -type f -exec chmod +x {} + 2>/dev/null
  setsid nohup python3 bench/bench.py --model /tmp/smollm2 --machine "nvidia-h200 (1x H200 141GB, 16 cores), vllm 0.26.0" \
    --docs 1024 --prompts 64 --prompt-words 650 --regimes tight,roomy --tight-configs "${TIGHT_CONFIGS:-plain,runner,spec_off,peaks_only}" \
    --configs "${CONFIGS:-plain,runner,raw_ordered,spec_off,ray,no_warm,spec_k2,spec_k4}" \
    --out /tmp/bench.json --workdir /tmp/rb > /tmp/bench.log 2>&1 < /dev/null &
  sleep 5; cat /tmp/bench.log ;;
wait)
  end=$(( $(date +%s) + $2 ))
  while [ "$(date +%s)" -lt "$end" ] && ! grep -q '"roomy_speedup"' /tmp/bench.done 2>/dev/null; do
    if ! pgrep -f bench/bench.py >/dev/null; then cp /tmp/bench.json /tmp/bench.done 2>/dev/null; echo finished; break; fi
    sleep 5
  done
  grep -E "docs/s|ERROR" /tmp/bench.log; tail -3 /tmp/bench.log
  cp /tmp/bench.json /tmp/bench.log /tmp/rb/profile-*.txt "$OUT"/ 2>/dev/null ;;
collect)
  cp /tmp/bench.json /tmp/bench.log "$OUT"/ 2>/dev/null; ls -la "$OUT" ;;
esac

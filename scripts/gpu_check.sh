#!/usr/bin/env bash
# The CUDA path on a real GPU, in one command (issue 30): made for a bare machine lent for a few
# minutes -- one H100 / H200 with torch + CUDA + Triton installed, nothing downloadable there.
#
#   bash scripts/gpu_check.sh --fetch-wheels   # HERE, with network: wheels into gpu-wheels/ (ignored)
#   bash scripts/gpu_check.sh                  # ON THE DEVICE, from the repo root; ~8 minutes at most
#   bash scripts/gpu_check.sh --dry-run        # on a CPU: every stage's plumbing on tiny shapes
#
# With the project's device tool: run(command="bash scripts/gpu_check.sh", carry=["gpu-wheels"],
# timeout_s=540) -- $OUT is set there, and gpu-wheels/ (ignored by git) must be named to travel.
#
# Everything printed also goes to $OUT/gpu_check.log, and the figures and verdicts to
# $OUT/gpu_check.json ($OUT defaults to ./gpu-check-out). Stages, each under its own time limit
# (seconds), each recorded with its exit status whatever the others do:
#   env      (15)  nvidia-smi, torch / CUDA / Triton versions
#   wheels   (45)  installs what the device lacks from gpu-wheels/ (pip --no-index --no-deps)
#   gpu      (130) python -m pytest -m gpu tests/gpu           (CUDA tests: attention, dequant, engine)
#   triton   (50)  python -m pytest tests/unit/ops/test_triton_*.py   (compiled on the device)
#   bench    (150) scripts/gpu_bench.py: random Llama-3-8B-shaped model, bf16 and int4: decode tok/s
#                  at batch 1/8/32/64 eager and with CUDA graphs, prefill tok/s at 4k, HBM roofline
#   soak     (85) ft serve --device cuda on a tiny Gemma 3 (SWA radix cache) under benchmarks/soak.py:
#                  60 s of agent traffic, --debug-kv, pools balanced at idle
#
# The wheels (gpu-wheels/, made by --fetch-wheels; $PY_VERSIONS, default "3.11 3.12", picks
# the CPython ABIs of the compiled ones; the total must stay under the 64 MiB that travels with the
# working tree). Runtime: gguf safetensors tokenizers jinja2 markupsafe tqdm psutil fastapi
# starlette anyio sniffio idna typing_extensions typing_inspection annotated_types pydantic
# pydantic_core uvicorn h11 click httptools pyzmq msgpack prometheus_client llguidance xxhash
# pyyaml requests urllib3 certifi charset_normalizer. Tests: pytest pluggy iniconfig packaging
# hypothesis sortedcontainers attrs httpx httpcore transformers huggingface_hub hf_xet regex
# filelock fsspec typer shellingham rich markdown_it_py mdurl pygments kernels. Not carried
# (expected on a CUDA machine with torch): torch, triton, numpy, the nvidia-* libraries.
set -u -o pipefail

MODE="${1:-run}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELS="$ROOT/gpu-wheels"
PY="${PYTHON:-python}"

# distribution name -> import name (one pair a line); the order installs dependencies first
PACKAGES="
typing_extensions typing_extensions
typing_inspection typing_inspection
annotated_types annotated_types
idna idna
sniffio sniffio
anyio anyio
h11 h11
click click
certifi certifi
urllib3 urllib3
charset_normalizer charset_normalizer
requests requests
pyyaml yaml
tqdm tqdm
markupsafe markupsafe
jinja2 jinja2
psutil psutil
packaging packaging
filelock filelock
fsspec fsspec
gguf gguf
safetensors safetensors
tokenizers tokenizers
pydantic_core pydantic_core
pydantic pydantic
starlette starlette
fastapi fastapi
uvicorn uvicorn
httptools httptools
pyzmq zmq
msgpack msgpack
prometheus_client prometheus_client
llguidance llguidance
xxhash xxhash
pluggy pluggy
iniconfig iniconfig
pytest pytest
attrs attrs
sortedcontainers sortedcontainers
hypothesis hypothesis
httpcore httpcore
httpx httpx
regex regex
hf_xet hf_xet
shellingham shellingham
mdurl mdurl
markdown_it_py markdown_it
pygments pygments
rich rich
typer typer
huggingface_hub huggingface_hub
kernels kernels
transformers transformers
"

fetch_wheels() {
  mkdir -p "$WHEELS"
  local names
  names=$(echo "$PACKAGES" | awk 'NF {print $1}')
  for v in ${PY_VERSIONS:-3.11 3.12}; do
    # shellcheck disable=SC2086
    pip download --quiet --no-deps --only-binary=:all: --dest "$WHEELS" \
      --python-version "$v" --implementation cp \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
      --platform manylinux_2_34_x86_64 $names || { echo "pip download failed for Python $v"; return 1; }
  done
  local mib
  mib=$(du -sm "$WHEELS" | cut -f1)
  echo "gpu-wheels/: $(ls "$WHEELS" | wc -l) wheels, ${mib} MiB (limit 64 MiB with everything carried)"
  [ "$mib" -lt 60 ] || { echo "too large: set PY_VERSIONS to the device's Python only"; return 1; }
}

if [ "$MODE" = "--fetch-wheels" ]; then
  fetch_wheels
  exit $?
fi
if [ "$MODE" != "run" ] && [ "$MODE" != "--dry-run" ]; then
  echo "usage: bash scripts/gpu_check.sh [--fetch-wheels | --dry-run]"
  exit 2
fi

DRY=0
[ "$MODE" = "--dry-run" ] && DRY=1
OUT="${OUT:-$ROOT/gpu-check-out}"
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: > "$LOG"
exec > >(tee -a "$LOG") 2>&1
cd "$ROOT" || exit 2
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
STAGES="$OUT/stages.tsv"
: > "$STAGES"
START=$(date +%s)
echo "gpu_check: mode $MODE, commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), out $OUT, $(date -u +%FT%TZ)"

stage() {  # stage NAME LIMIT_S COMMAND...: run it under a time limit, record status and seconds
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s): $*"
  local t0 rc
  t0=$(date +%s)
  if declare -F "$1" > /dev/null; then  # a function of this script: run in a child bash that has it
    timeout --kill-after=10 "$limit" bash -c "$*"
  else
    timeout --kill-after=10 "$limit" "$@"
  fi
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" >> "$STAGES"
  echo "=== $name: exit $rc after $(( $(date +%s) - t0 ))s"
}

env_report() {
  command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$PY" - <<'EOF'
import json, os, sys
import torch
info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
try:
    import triton
    info["triton"] = triton.__version__
except ImportError:
    info["triton"] = None
print(json.dumps(info))
json.dump(info, open(os.path.join(os.environ["OUT"], "env.json"), "w"))
EOF
}

install_wheels() {
  [ -d "$WHEELS" ] || { echo "no gpu-wheels/: nothing to install (run --fetch-wheels where there is network)"; return 0; }
  local missing=0
  while read -r dist mod; do
    [ -n "$dist" ] || continue
    "$PY" -c "import $mod" 2> /dev/null && continue
    if pip install --quiet --no-index --no-deps --find-links "$WHEELS" "$dist"; then
      echo "installed $dist"
    else
      echo "MISSING $dist (no wheel for this Python here)"
      missing=1
    fi
  done <<< "$PACKAGES"
  return $missing
}

soak() {  # a tiny Gemma 3 (sliding-window layers: the SWA radix cache) served on the device
  local model="$OUT/tiny-gemma3" device=cuda duration=60
  [ "$DRY" = 1 ] && device=cpu && duration=10
  "$PY" -c "import sys; sys.path.insert(0, 'tests'); from pathlib import Path; \
from tiny_models import write_tiny_model; write_tiny_model('gemma3', Path('$model'), max_position_embeddings=16384)" || return 1
  "$PY" benchmarks/soak.py --model "$model" --duration "$duration" --interval 5 --conversations 4 \
    --max-tokens 32 --system-sentences 4 --ready-timeout 60 --out "$OUT/soak" \
    --serve-arg=--device="$device" --serve-arg=--debug-kv
}

export OUT DRY PY WHEELS PACKAGES
export -f env_report install_wheels soak
stage env 15 env_report
if [ $DRY = 1 ]; then
  echo "dry run: the wheels are not installed; tests/gpu skip without CUDA"
  printf 'wheels\tskipped\t0\n' >> "$STAGES"
  stage gpu 150 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/gpu -x --junitxml "$OUT/gpu-tests.xml"
  stage triton 120 "$PY" -m pytest -q -p no:cacheprovider tests/unit/ops/test_triton_attention.py \
    tests/unit/ops/test_triton_qlinear.py --junitxml "$OUT/triton-tests.xml"
  stage bench 120 "$PY" scripts/gpu_bench.py --dry-run --out "$OUT/bench.json"
else
  stage wheels 45 install_wheels
  stage gpu 130 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/gpu --junitxml "$OUT/gpu-tests.xml"
  stage triton 50 "$PY" -m pytest -q -p no:cacheprovider tests/unit/ops/test_triton_attention.py \
    tests/unit/ops/test_triton_qlinear.py --junitxml "$OUT/triton-tests.xml"
  stage bench 150 "$PY" scripts/gpu_bench.py --out "$OUT/bench.json"
fi

stage soak 85 soak

"$PY" - <<'EOF'
import json, os
out = os.environ["OUT"]
def load(name):
    try:
        return json.load(open(os.path.join(out, name)))
    except (OSError, ValueError):
        return None
stages = {}
for line in open(os.path.join(out, "stages.tsv")):
    name, rc, secs = line.rstrip("\n").split("\t")
    stages[name] = {"exit": rc, "seconds": int(secs)}
def junit(name):
    import xml.etree.ElementTree as ET
    try:
        root = ET.parse(os.path.join(out, name)).getroot()
    except (OSError, ET.ParseError):
        return None
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
result = {"env": load("env.json"), "stages": stages, "gpu_tests": junit("gpu-tests.xml"),
          "triton_tests": junit("triton-tests.xml"), "bench": load("bench.json"),
          "soak": load(os.path.join("soak", "soak.json"))}
json.dump(result, open(os.path.join(out, "gpu_check.json"), "w"), indent=2)
print(json.dumps({k: result[k] for k in ("stages", "gpu_tests", "triton_tests")}, indent=2))
EOF
echo "gpu_check: done in $(( $(date +%s) - START ))s; $OUT/gpu_check.json and $OUT/gpu_check.log"

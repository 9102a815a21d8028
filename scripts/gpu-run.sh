#!/usr/bin/env bash
# One device-machine call: install carried wheels, then run the GPU tests or the benchmarks.
# Usage (on the GPU machine, from the repo root):
#   scripts/gpu-run.sh [tests [PYTEST ARGS] | bench SPEC...]
# Wheels for what the machine lacks come from `make gpu-wheels` (carry .whl).
# BENCH_MODES=eager,cold,kiln,megacache,copied,kiln-blob,kiln-serial picks bench modes;
# BENCH_REPEAT=3 runs each served mode three times (medians with their range).
# Writes logs and JSON to $OUT (or ./out/gpu) and prints a short table last.
set -uo pipefail
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src || exit 1
else
  export PYTHONPATH=$PWD/src
fi
export PYTHONUNBUFFERED=1
# WITH_BYTECODE=1: measure as on an image that has its Python bytecode (pip's default), which
# the H200 image lacks: compile every library module into a pycache prefix first (~15 s).
if [ "${WITH_BYTECODE:-0}" = 1 ]; then
  export PYTHONPYCACHEPREFIX=/tmp/pyc
  libs=$(python3 -c 'import sysconfig; p = sysconfig.get_paths()
print(*sorted({p[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}))')
  # shellcheck disable=SC2086  # $libs is a list of folders
  python3 -m compileall -q -j 16 $libs /tmp/site "$PWD/src" examples >/dev/null 2>&1
  echo "bytecode compiled into $PYTHONPYCACHEPREFIX: $(du -sh /tmp/pyc | cut -f1)"
fi
python3 - <<'PY'
import torch, triton
print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name(0), "gpus", torch.cuda.device_count())
PY
what=${1:-tests}; shift || true
if [ "$what" = tests ]; then
  python3 -m pytest -q -m gpu -p no:cacheprovider -s tests/test_gpu.py "$@" 2>&1 | tee "$OUT/gpu-tests.log" | grep -vE "^\s*$" | tail -40
  exit "${PIPESTATUS[0]}"
fi
# Start another spec only while at least MIN_LEFT_S of BUDGET_S remain (device calls are capped).
BUDGET_S=${BUDGET_S:-560}; MIN_LEFT_S=${MIN_LEFT_S:-200}
for spec in "$@"; do
  name=$(basename "$spec" .yaml)
  if [ $((BUDGET_S - SECONDS)) -lt "$MIN_LEFT_S" ]; then echo "skip $name: ${SECONDS}s used"; continue; fi
  COLUMNS=160 python3 -m kiln bench "$spec" -q --modes "${BENCH_MODES:-eager,cold,kiln,megacache,copied}" \
    --repeat "${BENCH_REPEAT:-1}" --save "$OUT/bench-$name.json" > "$OUT/bench-$name.txt" \
    2> "$OUT/bench-$name.err" || { echo "bench $name failed"; tail -20 "$OUT/bench-$name.err"; }
done
# The short table: time to ready (median and range) and start-up per mode, per spec.
python3 - "$OUT" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("bench-*.json")):
    r = json.loads(f.read_text())
    eager = r["modes"].get("eager", {}).get("time_to_ready_s")
    for m, v in r["modes"].items():
        runs = v["ready_runs_s"] or [v["time_to_ready_s"]]
        vs = f"{v['time_to_ready_s'] / eager:.2f}x" if eager else "-"
        print(f"{r['name']:24} {m:12} ready {v['time_to_ready_s']:7.2f}s ({min(runs):.2f}-{max(runs):.2f})"
              f" {vs:>6} start-up {v['startup_s']:6.2f}s compiles {v['compiles']}"
              f" first-req/steady {v['worst_first_request_ratio'] or 0:.2f}")
PY

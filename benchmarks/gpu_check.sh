#!/usr/bin/env bash
# One device check for issue 14, at most 8 minutes: install what the GPU machine lacks from the
# wheels carried beside this script (no package registry), run `fedhisto bench` for both encoders
# (HIBOU-B at the study's per-client batch of 8 pairs: micro-batch 4 x 2 accumulation steps, for
# 5 members = one round's clients, and 25 members = 5 clients x 5 seeds), then one study-shape
# round (HIBOU-B shape, five clients) with both engines. Figures go to $OUT as JSON.
#
#   bash benchmarks/gpu_check.sh            # on the GPU machine (device tool: carry benchmarks/wheels)
#   bash benchmarks/gpu_check.sh --dry-run  # on a CPU: no install, tiny sizes, same steps and files
#
# Wheels (Python 3.12, x86-64; the device image has torch, transformers, peft, opencv, numpy, yaml
# but not pydantic): bash benchmarks/fetch_wheels.sh
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
OUT=${OUT:-/tmp/fedhisto_gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
dry=0
[[ "${1:-}" == "--dry-run" ]] && dry=1
start=$(date +%s)

if [[ $dry == 0 ]] && ! $PY -c "import pydantic" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fedhisto_site \
    "$here"/wheels/*.whl || { echo "gpu_check: wheel install failed" >&2; exit 3; }
  export PYTHONPATH=/tmp/fedhisto_site
fi
export PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

$PY - >"$OUT/env.json" <<'PYEOF'
import json, platform, torch, transformers, peft
print(json.dumps({"python": platform.python_version(), "torch": torch.__version__,
                  "transformers": transformers.__version__, "peft": peft.__version__,
                  "cuda": torch.cuda.is_available(),
                  "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"}, indent=2))
PYEOF
cat "$OUT/env.json"

# step NAME SECONDS COMMAND...: a step that overruns is stopped and recorded, the others still run
status=0
step() {
  local name=$1 secs=$2; shift 2
  echo "== $name (at most ${secs}s)"
  timeout "$secs" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  [[ $rc == 0 ]] || { echo "gpu_check: $name ended with $rc" | tee -a "$OUT/$name.log"; status=1; }
}

if [[ $dry == 1 ]]; then
  step bench_tiny 120 $PY -m fedhisto.cli bench --encoder tiny --members 5 --json "$OUT/bench_tiny.json"
  step bench_hibou 300 $PY -m fedhisto.cli bench --encoder hibou-b --members 2 --micro-batch 1 \
    --accumulation-steps 1 --iters 1 --warmup 1 --inference-batch 2 --json "$OUT/bench_hibou.json"
  step round 300 $PY "$here/gpu_round.py" --images-per-client 1 --methods past_v2 --engines sequential batched \
    --json "$OUT/round.json"
else
  step bench_tiny 60 $PY -m fedhisto.cli bench --encoder tiny --members 25 --iters 8 --json "$OUT/bench_tiny.json"
  step bench_hibou 100 $PY -m fedhisto.cli bench --encoder hibou-b --members 5 --iters 8 \
    --inference-batch 512 --json "$OUT/bench_hibou.json"
  step bench_hibou25 100 $PY -m fedhisto.cli bench --encoder hibou-b --members 25 --iters 8 \
    --inference-batch 512 --json "$OUT/bench_hibou25.json"
  step round 150 $PY "$here/gpu_round.py" --images-per-client 64 --methods past_v2 --engines sequential batched \
    --json "$OUT/round.json"
fi
echo "gpu_check: $(( $(date +%s) - start )) s in all, status $status"
exit $status

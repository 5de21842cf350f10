#!/usr/bin/env bash
# The one GPU check: the GPU path proven on the first GPU lent, in at most 9 minutes of steps on one H100/H200
# (the device tool allows 10 per command). It installs what the GPU machine lacks from wheels carried beside
# this script (it reaches no package registry), then, in order of importance, each step under its own limit:
#   device         train.device auto/cuda pick the GPU; a job declaring a GPU with every GPU hidden stops
#                  naming the cause (benchmarks/gpu_path.py device);
#   resume         a HIBOU-B-shaped run (batched engine, 3 rounds) killed with SIGKILL after round 1's
#                  checkpoint and resumed in a fresh process, against the uninterrupted run (gpu_path.py resume);
#   bench_hibou    `fedhisto bench --config config/paper.yaml`: the pipeline's own training configuration
#                  (one job's 5 members, micro-batch 4 x 2, host views and its view workers), and 25 members
#                  (seeds stacked, not what the pipeline runs): sequential and batched pairs/s, inference
#                  images/s, peak memory, host views (one thread, view workers) and device view rates;
#   round          one study-shape round (HIBOU-B, five clients of 64 images, past_v2: client update,
#                  delta-SVD aggregation, prototypes, validation) per engine, host and device views;
#   views          the host/device split: the share of a round the engine waits for host views, without and
#                  with the view workers (benchmarks/host_view_share.py via gpu_path.py views);
#   bench_compile  HIBOU-B at 25 members with the batched step under torch.compile (train.compile);
#   bench_uni      the pipeline's configuration with UNI (timm ViT-L/16; where timm is absent, phikon-v2:
#                  transformers' ViT-L/16 of the same width, depth, patch and token count, and the log says so);
#   report         the Markdown block for docs/changelog.md with the full-grid estimate (39 study runs, at most
#                  50 rounds, one GPU, as the pipeline runs them; target under 2 hours): performance_block.md.
# Files under $OUT (8, as the device tool returns at most 8): env.json, path.json (device, resume, views),
# bench_hibou.json, round.json, bench_compile.json, bench_uni.json, performance_block.md, check.log.
#
#   bash benchmarks/fetch_wheels.sh            # here, once: pydantic and its three needs (cp312 wheels)
#   device tool: run(command="bash benchmarks/gpu_check.sh", carry=["benchmarks/wheels"], timeout_s=600)
#   bash benchmarks/gpu_check.sh --dry-run     # on a CPU: the same steps and files at toy sizes
#
# A step that fails or overruns is recorded in check.log and the next one still runs; the exit status
# is 1 if any step failed. GPU_CHECK_BUDGET (seconds) caps the steps before the report together:
# default 520 on the GPU (the report then has 50 s: 570 s at most, inside the tool's 600), 3600 in a
# dry run, whose limits only catch a hang (a CPU shared with other jobs can be many times slower).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
OUT=${OUT:-/tmp/fedhisto_gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
dry=0
[[ "${1:-}" == "--dry-run" ]] && dry=1
start=$(date +%s)
budget=${GPU_CHECK_BUDGET:-$(( dry ? 3600 : 520 ))}
log="$OUT/check.log"
: >"$log"
rm -f "$OUT/path.json"

if ! $PY -c "import pydantic" 2>/dev/null; then
  ls "$here"/wheels/*.whl >/dev/null 2>&1 || { echo "gpu_check: pydantic is missing and benchmarks/wheels is empty: run benchmarks/fetch_wheels.sh here and carry benchmarks/wheels" | tee -a "$log" >&2; exit 3; }
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fedhisto_site \
    "$here"/wheels/*.whl 2>&1 | tee -a "$log" || { echo "gpu_check: wheel install failed" | tee -a "$log" >&2; exit 3; }
  export PYTHONPATH=/tmp/fedhisto_site
fi
export PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

# every module the steps import, before any time is spent (a missing one is named here, not minutes later)
uni=$($PY - "$OUT/env.json" "$dry" 2>>"$log" <<'PYEOF'
import datetime, importlib, json, os, platform, sys
import fedhisto.bench.throughput, fedhisto.bench.gpu_summary, fedhisto.train.loop, fedhisto.train.participants  # noqa: F401
import peft, torch, transformers
try:
    import timm
    timm.create_model  # noqa: B018  (timm imports torchvision: a mismatched one fails here)
    timm_version, uni = timm.__version__, "uni"
except Exception as exc:  # noqa: BLE001  (any import failure means: no timm here)
    print(f"gpu_check: timm not usable ({exc!r}): UNI-size runs as phikon-v2 (transformers ViT-L/16)", file=sys.stderr)
    timm_version, uni = None, "phikon-v2"
env = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), "dry_run": sys.argv[2] == "1",
       "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
       "peft": peft.__version__, "timm": timm_version, "uni_encoder": uni, "cuda": torch.cuda.is_available(),
       "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU", "cpus": os.cpu_count(),
       "cpus_usable": len(os.sched_getaffinity(0))}
with open(sys.argv[1], "w") as fh:
    json.dump(env, fh, indent=2)
print(uni)
PYEOF
) || { echo "gpu_check: a module the check needs does not import (see $log)" | tee -a "$log" >&2; tail -5 "$log" >&2; exit 3; }
{ cat "$OUT/env.json"; echo; } | tee -a "$log"
if [[ $dry == 0 && $($PY -c "import torch; print(torch.cuda.is_available())") != True ]]; then
  echo "gpu_check: no CUDA device visible (use --dry-run on a CPU)" | tee -a "$log" >&2; exit 3
fi

# step NAME SECONDS COMMAND...: at most SECONDS, and never past the budget; a failure is recorded
status=0
step() {
  local name=$1 secs=$2; shift 2
  local left=$(( budget - ($(date +%s) - start) ))
  (( secs > left )) && secs=$left
  if (( secs < 20 )); then
    echo "gpu_check: $name skipped (${left}s of the ${budget}s budget left)" | tee -a "$log"; status=1; return
  fi
  echo "== $name (at most ${secs}s, at $(( $(date +%s) - start ))s)" | tee -a "$log"
  timeout "$secs" "$@" 2>&1 | grep -v -E "Warning|warnings.warn" | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  [[ $rc == 0 ]] || { echo "gpu_check: $name ended with $rc" | tee -a "$log"; status=1; }
}

bench=("$PY" -m fedhisto.cli bench --config "$repo/config/paper.yaml")
path=("$PY" "$here/gpu_path.py")
if [[ $dry == 1 ]]; then
  toy=(--depth 1 --micro-batch 1 --accumulation-steps 1 --iters 1 --warmup 1 --inference-batch 2 --view-samples 2)
  step device 300 "${path[@]}" device --json "$OUT/path.json"
  step resume 900 "${path[@]}" resume --depth 1 --images 2 --rounds 2 --json "$OUT/path.json"
  step bench_hibou 900 "${bench[@]}" --members 1 2 "${toy[@]}" --json "$OUT/bench_hibou.json"
  step round 900 "$PY" "$here/gpu_round.py" --encoder hibou-b --depth 1 --images-per-client 1 --methods past_v2 \
    --engines sequential batched --view-pipelines host device --json "$OUT/round.json"
  step views 900 "${path[@]}" views --encoder tiny --images 2 --json "$OUT/path.json"
  step bench_compile 900 "${bench[@]}" --encoder tiny --members 2 "${toy[@]}" --compile --json "$OUT/bench_compile.json"
  step bench_uni 900 "${bench[@]}" --encoder "$uni" --members 1 "${toy[@]}" --json "$OUT/bench_uni.json"
else
  step device 30 "${path[@]}" device --json "$OUT/path.json"
  step resume 100 "${path[@]}" resume --images 8 --rounds 3 --json "$OUT/path.json"
  step bench_hibou 120 "${bench[@]}" --members 5 25 --iters 8 --inference-batch 512 --json "$OUT/bench_hibou.json"
  step round 90 "$PY" "$here/gpu_round.py" --encoder hibou-b --images-per-client 64 --methods past_v2 \
    --engines sequential batched --view-pipelines host device --json "$OUT/round.json"
  step views 60 "${path[@]}" views --images 32 --json "$OUT/path.json"
  step bench_compile 90 "${bench[@]}" --members 25 --iters 8 --inference-batch 512 --compile \
    --json "$OUT/bench_compile.json"
  step bench_uni 60 "${bench[@]}" --encoder "$uni" --members 5 --iters 8 --inference-batch 256 --json "$OUT/bench_uni.json"
fi
budget=$(( budget + 50 ))  # the report always gets its 50 s
step report 50 "$PY" "$here/gpu_report.py" "$OUT"
echo "gpu_check: $(( $(date +%s) - start )) s in all, status $status" | tee -a "$log"
exit $status

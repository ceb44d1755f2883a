#!/usr/bin/env bash
# The GPU check: what a developer who is lent a GPU runs first. At most 8 minutes in all: each stage has its own
# time limit, output is unbuffered and every stage's log is kept, so a run cut short still reports what it reached.
#
#   bash tools/gpu-check.sh [OUT]      OUT: the folder for the logs and the JSON (default: gpu-check)
#
# Stages, the proof first: `rnn-darts check --bench` (every execution path of the plan against its reference on every
# case: CUDA graphs, TF32, bf16, fused, fused + graphs, compiled, compiled + graphs; then each path's search step timed
# as the learner runs it at the paper's shapes; OUT/check.json, written after each path); the GPU tier of the tests
# (pytest --gpu, without test_check.py, which is what the first stage ran); one epoch of the quick search with the
# defaults (compiled, graphed; epoch times in OUT/quick/run.json); last, in the time left, `rnn-darts bench` at the
# paper's shapes (search bs 256, bptt 35, nhid 300, 10,000 words; derived DARTS_V2 nhid 850, bs 64) as captured CUDA
# graphs, each row also profiled (OUT/profile-graphed.txt: kernels per step, the 15 kernels with the most GPU time, how
# much of the step the GPU is busy, peak memory). The tier's and the quick search's limits are what they took on an
# H200 (2026-11-27: 132 s and 61 s), with room; the check has not run on a GPU yet, and its limit is a guess (Inductor
# compiles the tiny step, then the paper's). Where fastai is not installed and the checkout holds wheels in .whl/ (see
# the README's development section), they are installed into /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-check}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
py=${PYTHON:-python3}
if ! $py -c 'import fastai' 2>/dev/null && compgen -G '.whl/*.whl' >/dev/null; then
  $py -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
start=$SECONDS
stage() {   # stage NAME LIMIT_S COMMAND...: run COMMAND under its limit, its output to the screen and to OUT/NAME.log
  local name=$1 limit=$2; shift 2
  echo "== $name (at most $limit s; $((SECONDS - start)) s so far)"
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - t0)) s$([ "$rc" = 124 ] && echo ', stopped at its time limit')"
}
stage versions 20 $py -c "
import torch, platform
print('python', platform.python_version(), '| torch', torch.__version__, '| CUDA', torch.version.cuda)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print('GPU', p.name, f'{p.total_memory / 2**30:.0f} GiB', p.multi_processor_count, 'SMs', '| devices', torch.cuda.device_count())
else: print('no CUDA device visible')
import fastai; print('fastai', fastai.__version__)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | sed 's/^/nvidia-smi: /'
stage check 170 $py -m rnn_darts.cli check --device cuda --bench --json-path "$out/check.json"
# four workers, so the tier fits its limit: each runs tiny models; without a GPU the tier only skips, so no
# workers are started (each would import torch and collect every module)
workers=4; grep -q 'no CUDA device visible' "$out/versions.log" && workers=0
stage gpu-tier 150 $py -m pytest -q --gpu -n $workers -rs --durations=10 -p no:cacheprovider --ignore tests/test_check.py tests
stage quick-search 75 $py -m rnn_darts.cli search --preset quick --epochs 1 --device cuda --out "$out/quick" --overwrite
$py -c "import json, sys; r = json.load(open(sys.argv[1])); print('quick search epoch times (s):', r.get('epoch_times'))" \
  "$out/quick/run.json" 2>/dev/null || echo "quick search: no run.json"
left=$((470 - (SECONDS - start)))   # the bench takes what is left of the 8 minutes
if [ "$left" -ge 30 ]; then
  stage bench-graphed "$left" $py -m rnn_darts.cli bench --device cuda --graphs --iters 3 --modes second,first --methods none \
    --json-path "$out/bench-graphed.json" --profile "$out/profile-graphed.txt"
else echo "== bench-graphed: skipped, $left s left of the 8 minutes"; fi
echo "== GPU check done in $((SECONDS - start)) s; logs in $out"

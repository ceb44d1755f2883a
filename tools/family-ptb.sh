#!/usr/bin/env bash
# The DARTS family on Penn Treebank at the search preset (issue #43): one search per method, each resumed where it
# stopped, so the script can be run again after an interruption. Train on PTB's valid split, validate and test on
# the halves of its test split (the train split is not shared here).
#   bash tools/family-ptb.sh PENN_DIR OUT_DIR [EPOCHS] [METHODS]
# It ends with `rnn-darts report OUT_DIR`: OUT_DIR/report.md, the searches side by side.
set -euo pipefail
penn=${1:?usage: bash tools/family-ptb.sh PENN_DIR OUT_DIR [EPOCHS] [METHODS]}
out=${2:?usage: bash tools/family-ptb.sh PENN_DIR OUT_DIR [EPOCHS] [METHODS]}
epochs=${3:-5}
methods=${4:-gdas,snas,drnas,beta-darts,sdarts-rs,milenas,darts,random,sdarts-adv,darts-pt}
for f in valid.txt test.txt; do [ -f "$penn/$f" ] || { echo "family-ptb: $penn/$f not found" >&2; exit 2; }; done
corpus=$out/corpus
mkdir -p "$corpus"
n=$(wc -l < "$penn/test.txt")
cp "$penn/valid.txt" "$corpus/train.txt"
head -n $((n / 2)) "$penn/test.txt" > "$corpus/valid.txt"
tail -n +$((n / 2 + 1)) "$penn/test.txt" > "$corpus/test.txt"
failed=()
for m in ${methods//,/ }; do
  run=$out/$m
  if [ -f "$run/run.json" ] && grep -q '"finished": true' "$run/run.json"; then echo "== $m: done"; continue; fi
  # a folder that exists is resumed: from its newest checkpoint, or from scratch when it was killed before its first one
  resume=(); [ -d "$run" ] && resume=(--resume)
  echo "== $m ${resume[*]}"
  # one method's failure (say, its folder locked by a second copy of this script) does not stop the others
  rnn-darts search --preset search --data "$corpus" --unk '<unk>' --method "$m" --epochs "$epochs" \
    --threads "${THREADS:-1}" --out "$run" "${resume[@]}" || failed+=("$m")
done
[ ${#failed[@]} -eq 0 ] || { echo "family-ptb: not finished: ${failed[*]}" >&2; exit 1; }
rnn-darts report "$out"

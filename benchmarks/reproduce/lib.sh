# Shared by benchmarks/reproduce/*.sh (sourced, not run). Each claim script calls `setup "$@"` and
# then `run CLAIM VARIANT SCRIPT FLAGS...` once per compared variant.
#
# Environment:
#   DATA_DIR  CIFAR-10: torchvision's download folder (holding cifar-10-batches-py/, read with --dataset cifar10:
#             the README's ./data) or an image folder (train/<class>/*, test/<class>/*; --dataset folder);
#             required unless DRY_RUN=1 (without DATA_DIR, its commands show an image folder)
#   SEEDS     seeds to run, default "0 1 2" (each seed also seeds the partition: --data-seed = --seed)
#   VARIANTS  run only these variants (space-separated names), default all
#   RUNS_DIR  where runs go (relative to the repository root), default runs/reproduce:
#             RUNS_DIR/<claim>-<scale>/<variant>/seed<k>
#   DRY_RUN=1 print the commands (one per line, shell-quoted, DATA_DIR left as "$DATA_DIR"), run nothing
#   PYTHON    interpreter, default python
#   JOBS      runs at a time, default 1; with JOBS>1 runs go to the background (one GPU holds several
#             small runs) and each one's output goes to <run folder>/log.txt instead of the terminal
# A run whose summary.json exists is skipped; one with a checkpoint.pt but no summary.json is
# resumed (--resume), so an interrupted script can simply be started again.
set -euo pipefail

setup() {
  SCALE=${1:-small}
  case "$SCALE" in
    small|proxy|paper) ;;
    *) echo "usage: DATA_DIR=./data [SEEDS=\"0 1 2\"] bash $0 [small|proxy|paper]" >&2; exit 2 ;;
  esac
  SEEDS=${SEEDS:-"0 1 2"}
  VARIANTS=${VARIANTS:-}
  RUNS_DIR=${RUNS_DIR:-runs/reproduce}
  PYTHON=${PYTHON:-python}
  DRY_RUN=${DRY_RUN:-0}
  JOBS=${JOBS:-1}
  FAILED=0
  FAILURES=$(mktemp)  # background runs report failures here
  trap 'rm -f "$FAILURES"' EXIT  # also when setup refuses its input or the script is interrupted
  if [ -n "${DATA_DIR:-}" ] && [ -d "$DATA_DIR" ]; then
    DATA_DIR=$(cd "$DATA_DIR" && pwd)  # absolute: we change directory next
  fi
  cd "$(dirname "${BASH_SOURCE[0]}")/../.."  # the repository root: the method scripts live there
  DATASET=folder
  if [ -d "${DATA_DIR:-}/cifar-10-batches-py" ]; then
    DATASET=cifar10  # torchvision's download (the README's first run made it); a dry run shows it too
  fi
  if [ "$DRY_RUN" != 1 ]; then
    if [ "$DATASET" = folder ] && { [ -z "${DATA_DIR:-}" ] || [ ! -d "$DATA_DIR/train" ] || [ ! -d "$DATA_DIR/test" ]; }; then
      echo "DATA_DIR must hold CIFAR-10: torchvision's download (DATA_DIR/cifar-10-batches-py, as the README's" \
        "first run leaves it in ./data) or an image folder with train/ and test/ (got '${DATA_DIR:-}')" >&2
      exit 2
    fi
    if [ "$SCALE" != paper ]; then
      export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # the small and proxy configs were sized for one CPU thread per run
    fi
  fi
}

# _run_one OUT SHOWN SCRIPT CMD...: resume OUT if it has a checkpoint, else start CMD; failures go to $FAILURES.
_run_one() {
  local out=$1 shown=$2 script=$3
  shift 3
  if [ -f "$out/checkpoint.pt" ]; then
    echo "== $out: resuming"
    "$PYTHON" "$script" --resume "$out" --data-dir "$DATA_DIR" || { echo "!! $out: exited with status $?" | tee -a "$FAILURES" >&2; }
  else
    echo "== $out"
    echo "   $shown"
    mkdir -p "$out"
    echo "$shown" > "$out/command.txt"
    "$@" || { echo "!! $out: exited with status $? (see $out; summary.json says if it diverged)" | tee -a "$FAILURES" >&2; }
  fi
}

# run CLAIM VARIANT SCRIPT FLAGS...: one run per seed into $RUNS_DIR/CLAIM-$SCALE/VARIANT/seed<k>.
run() {
  local claim=$1 variant=$2 script=$3
  shift 3
  if [ -n "$VARIANTS" ] && [[ " $VARIANTS " != *" $variant "* ]]; then
    return 0
  fi
  local seed out shown
  for seed in $SEEDS; do
    out="$RUNS_DIR/$claim-$SCALE/$variant/seed$seed"
    local cmd=("$PYTHON" "$script" --dataset "$DATASET" --data-dir "${DATA_DIR:-\$DATA_DIR}" "$@" --seed "$seed" --out "$out")
    # the command as written in the claim script, with DATA_DIR symbolic (collect.py shows it)
    shown="python $script --dataset $DATASET --data-dir \"\$DATA_DIR\" $(printf '%q ' "$@")--seed $seed --out $out"
    if [ "$DRY_RUN" = 1 ]; then
      echo "$shown"
      continue
    fi
    if [ -f "$out/summary.json" ]; then
      echo "== $out: done (summary.json exists), skipped"
      continue
    fi
    if [ "$JOBS" -gt 1 ]; then
      while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n || true; done
      echo "== $out (background, output in $out/log.txt)"
      mkdir -p "$out"
      _run_one "$out" "$shown" "$script" "${cmd[@]}" > "$out/log.txt" 2>&1 &
    else
      _run_one "$out" "$shown" "$script" "${cmd[@]}"
    fi
  done
}

# finish: call last; non-zero exit status if any run failed (the others still ran).
finish() {
  wait  # background runs (JOBS>1)
  if [ -s "$FAILURES" ]; then
    FAILED=1
    [ "$JOBS" -gt 1 ] && cat "$FAILURES" >&2
  fi
  if [ "$DRY_RUN" != 1 ]; then
    echo "runs are in $RUNS_DIR; tables: python benchmarks/collect.py $RUNS_DIR"
  fi
  return "$FAILED"
}

#!/usr/bin/env bash
# Everything one call on a lent GPU machine runs (about 9 minutes; benchmarks/gpu_call.md).
#
#   bash benchmarks/gpu.sh                         # MODE=full: the call (stages env data threads levers)
#   MODE=dry bash benchmarks/gpu.sh                # print every command, run none
#   MODE=tiny DEVICE=cpu bash benchmarks/gpu.sh    # CI: every default stage at toy size on the CPU
#   bash benchmarks/gpu.sh env data smoke times fedbabu   # only these stages (then the collect step)
#
# Stages, in this order; each is independent: a failing or timed-out stage is reported and the next one
# still runs. The exit status is 0 only if every stage passed. Stage timings are printed and kept.
# Without stage names: env data threads levers (the speed call); smoke, times, fedbabu and pair run by name.
#   env      card, driver, torch, CUDA and cuDNN versions, CPUs (OUT/env.txt)
#   data     unpack DATA_ARCHIVE into DATA_DIR if DATA_DIR/train is missing, decode it once into its
#            cache (DATA_DIR/.cleanfl-cache.pt) so the parallel runs below only read the cache
#   smoke    each of the six scripts, 2 rounds on DEVICE, tiny settings on synthetic data: fp32, --amp, and
#            --stop-after 1 then --resume (OUT/smoke.md; is the resumed run's final accuracy the
#            uninterrupted one's? on CUDA it need not be bit for bit)
#   times    s/round of each claim's paper configuration and projected minutes of the full run
#            (benchmarks/gpu_times.py, with benchmarks/round_time.py for fedavg.py; OUT/times.md)
#   fedbabu  FedBABU Table 13 at paper scale: benchmarks/reproduce/fedbabu.sh paper (variants fedavg,
#            fedbabu; SEEDS), JOBS runs at a time on the one GPU; resumable (lib.sh)
#   threads  the CPU threads table on this machine's cores, the GPU left alone: benchmarks/threads.py, idle (2
#            cycles, in 5/8 of the stage's cap) then beside a busy process on each core (1 cycle), the default
#            against --threads 2, 4 and 8 for fedavg-mlp, then fedfn-small (THREADS_FLAGS; threads/tables.md)
#   levers   s/round of the five paper configurations under today's loop and each lever alone and combined
#            (torchrun K on the one GPU, --amp, anfr's --channels-last --tf32, benchmarks/together.py), the
#            FLOPs and floors: benchmarks/levers.py measure, by priority within the stage's cap (OUT/speed.md)
#   pair     FedFN's Table 1 pair at s=2 (FedFN, FedAvg; seed 0) at once with measure's fastest fp32 lever,
#            --stop-after sized to end inside the stage's cap: benchmarks/levers.py pair (OUT/speed.md)
# Then, always: collect (OUT/fedbabu.md from benchmarks/collect.py, OUT/summary.md, OUT/runs.tar.gz).
# OUT ends with at most 8 files: log.txt env.txt smoke.md times.md fedbabu.md speed.md summary.md runs.tar.gz
# (the threads tables in summary.md; they and their JSONs in runs.tar.gz, threads/).
#
# Environment (defaults in brackets):
#   MODE          full | dry | tiny [full]
#   DEVICE        [cuda; tiny: cpu]
#   DATA_DIR      unpacked CIFAR-10 image folder [data/cifar10, git-ignored; tiny: a toy folder in WORK]
#   DATA_ARCHIVE  unpacked into DATA_DIR when DATA_DIR/train is missing [data/cifar10-jpg.tar.gz]
#   WORK          every run folder goes under it; must not hold runs yet [runs/gpu/<date-time>]
#   OUT           the files that come back [$OUT if set (the device machine sets it), else WORK/out]
#   SEEDS, JOBS   fedbabu stage: seeds ["0 1 2"; tiny "0"], runs at a time [6: all six at once, so both
#                 variants advance together and a cut-off call leaves checkpoints of all; tiny 2]
#   FEDBABU_RUNS  RUNS_DIR of the fedbabu stage [WORK/fedbabu]; an earlier call's folder (carried)
#                 continues it: finished runs are skipped, checkpointed ones resumed
#   SMOKE_JOBS    smoke chains (one per script) at a time [6; tiny 2]
#   SMOKE_BATCH   1: the smoke runs share SMOKE_JOBS python processes (tests/run_batch.py's trick, no
#                 torch import per run) [tiny 1, else 0: a fresh process per run, as on the GPU]
#   TIMES_FLAGS   extra flags of benchmarks/gpu_times.py, e.g. "--variants all --fedavg-precisions fp32 amp"
#   LEVERS_FLAGS  extra flags of benchmarks/levers.py measure, e.g. "--claims fedfn anfr"
#   THREADS_FLAGS flags of both benchmarks/threads.py runs ["--workloads fedavg-mlp fedfn-small --thread-counts
#                 2 4 8 --no-torchrun --rounds 2 --run-timeout 90", and every CPU among the counts where a core has
#                 two hardware threads; tiny: fedfn-small, --thread-counts 1, R=1, idle only]
#   DEADLINE      seconds for all stages; each stage's cap is cut to what is left [full 540; tiny 900]
#   CAP_ENV CAP_DATA CAP_SMOKE CAP_TIMES CAP_FEDBABU CAP_THREADS CAP_LEVERS CAP_PAIR   per-stage caps in seconds
#                 [60 90 90 200 (tiny: smoke and times 300); fedbabu: the rest of DEADLINE; threads 240; levers
#                 250; pair: the rest].
#                 A stage over its cap is stopped (timeout, whole process group); levers and pair read their
#                 cap (STAGE_CAP) and end inside it.
#   PYTHON        [python3, else python]
set -euo pipefail

MODE=${MODE:-full}
case "$MODE" in full|dry|tiny) ;; *) echo "MODE must be full, dry or tiny (got '$MODE')" >&2; exit 2 ;; esac
SELF=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")
ROOT=$(cd "$(dirname "$SELF")/.." && pwd)
cd "$ROOT"
abs() { case "$1" in /*) echo "$1" ;; *) echo "$ROOT/$1" ;; esac; }

if [ -z "${PYTHON:-}" ]; then
  if command -v python3 > /dev/null; then PYTHON=python3; else PYTHON=python; fi
fi
if [ "$MODE" = tiny ]; then
  DEVICE=${DEVICE:-cpu}
else
  DEVICE=${DEVICE:-cuda}
fi
WORK=$(abs "${WORK:-runs/gpu/$(date +%Y%m%d-%H%M%S)}")
OUT=$(abs "${OUT:-$WORK/out}")
if [ "$MODE" = tiny ]; then
  DATA_DIR=$WORK/tiny-data  # written by the data stage: toy images, so CI needs no CIFAR-10
else
  DATA_DIR=$(abs "${DATA_DIR:-data/cifar10}")
fi
DATA_ARCHIVE=$(abs "${DATA_ARCHIVE:-data/cifar10-jpg.tar.gz}")
FEDBABU_RUNS=$(abs "${FEDBABU_RUNS:-$WORK/fedbabu}")
if [ "$MODE" = tiny ]; then
  SEEDS=${SEEDS:-0}; JOBS=${JOBS:-2}; SMOKE_JOBS=${SMOKE_JOBS:-2}; SMOKE_BATCH=${SMOKE_BATCH:-1}; DEADLINE=${DEADLINE:-900}
  CAP_SMOKE=${CAP_SMOKE:-300}; CAP_TIMES=${CAP_TIMES:-300}  # a busy CI machine: the caps only catch a hang
else
  SEEDS=${SEEDS:-"0 1 2"}; JOBS=${JOBS:-6}; SMOKE_JOBS=${SMOKE_JOBS:-6}; SMOKE_BATCH=${SMOKE_BATCH:-0}; DEADLINE=${DEADLINE:-540}
fi
TIMES_FLAGS=${TIMES_FLAGS:-}; LEVERS_FLAGS=${LEVERS_FLAGS:-}
if [ "$MODE" = tiny ]; then
  THREADS_FLAGS=${THREADS_FLAGS:-"--workloads fedfn-small --thread-counts 1 --no-torchrun --rounds 1"}
else  # with hardware threads (two a core) the default is a thread a core: then every CPU is timed too
  SMT_CPUS=$(lscpu 2>/dev/null | awk -F: -v n="$(nproc)" '/^Thread\(s\) per core/ && $2 > 1 {print n}')
  THREADS_FLAGS=${THREADS_FLAGS:-"--workloads fedavg-mlp fedfn-small --thread-counts 2 4 8 $SMT_CPUS --no-torchrun --rounds 2 --run-timeout 90"}
fi
CAP_ENV=${CAP_ENV:-60}; CAP_DATA=${CAP_DATA:-90}; CAP_SMOKE=${CAP_SMOKE:-90}; CAP_TIMES=${CAP_TIMES:-200}; CAP_FEDBABU=${CAP_FEDBABU:-0}
CAP_THREADS=${CAP_THREADS:-240}; CAP_LEVERS=${CAP_LEVERS:-250}; CAP_PAIR=${CAP_PAIR:-0}
export MODE DEVICE WORK OUT DATA_DIR DATA_ARCHIVE FEDBABU_RUNS SEEDS JOBS SMOKE_JOBS SMOKE_BATCH TIMES_FLAGS LEVERS_FLAGS
export THREADS_FLAGS PYTHON
export PYTHONUNBUFFERED=1
STAGES_ALL="env data smoke times fedbabu threads levers pair"
STAGES_DEFAULT="env data threads levers"  # the speed call; smoke, times, fedbabu and pair by name
SCRIPTS=(fedavg fedbabu fedfn fedln fednnnn anfr)

# show CMD...: the command, shell-quoted, on one line (what MODE=dry prints for every command).
show() {
  local a out=()
  for a in "$@"; do
    if [[ "$a" =~ ^[A-Za-z0-9_./=:,+@%-]+$ ]]; then out+=("$a"); else out+=("${a@Q}"); fi
  done
  echo "${out[*]}"
}

# run_or_show TEE_ARGS... -- CMD...: MODE=dry prints CMD and runs it with --dry; else runs it into tee TEE_ARGS
run_or_show() {
  local tee_args=()
  while [ "$1" != -- ]; do tee_args+=("$1"); shift; done
  shift
  if [ "$MODE" = dry ]; then
    show "$@"
    "$@" --dry
    return 0
  fi
  "$@" | tee "${tee_args[@]}"
}

# ------------------------------------------------------------------------------------------------
# env
# ------------------------------------------------------------------------------------------------
# the threads stage's default way: a script without --threads or OMP_NUM_THREADS (one process of the cores' threads)
CORES='import sys; sys.argv[1:] = ["--dataset", "synthetic", "--device", "cpu"]; import fedavg; a = fedavg.parse_args()
print(f"1 process x {a.threads} threads")'
CPUS='import sys; sys.path.insert(0, "benchmarks"); import threads; print(threads.cores())'  # its affinity

stage_env() {
  if [ "$MODE" = dry ]; then
    show nvidia-smi
    show "$PYTHON" -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())"
    return 0
  fi
  {
    echo "date: $(date -u +%FT%TZ); host: $(uname -srm); CPUs: $(nproc --all); memory: $(free -g 2>/dev/null | awk '/Mem:/ {print $2 " GiB"}')"
    echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo '?') $(git status --porcelain 2>/dev/null | wc -l | tr -d ' ') changed files"
    # the CPUs the threads stage runs on: hardware threads a core (two: 16 CPUs are 8 cores), this process's share
    lscpu 2>/dev/null | grep -E '^(Model name|Thread\(s\) per core|Core\(s\) per socket|Socket\(s\)):' || true
    echo "CPUs this process may run on: $("$PYTHON" -c "$CPUS")"
    echo "CPU limit (cgroup v2 cpu.max, quota period): $(cat /sys/fs/cgroup/cpu.max 2>/dev/null || echo none)"
    echo "the scripts' CPU default: $(env -u OMP_NUM_THREADS "$PYTHON" -c "$CORES")"
    if command -v nvidia-smi > /dev/null; then
      nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv || true
      nvidia-smi || true
    else
      echo "nvidia-smi: not found"
    fi
    "$PYTHON" - "$DEVICE" <<'PY'
import platform, sys
import torch
device = sys.argv[1]
print(f"python {platform.python_version()} ({sys.executable})")
print(f"torch {torch.__version__} (this machine's own install, not pinned by requirements.txt), "
      f"built for CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}")
print(f"cuda available: {torch.cuda.is_available()}, devices: {torch.cuda.device_count()}")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"  cuda:{i} {p.name}, capability {p.major}.{p.minor}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs")
if device.startswith("cuda") and not torch.cuda.is_available():
    sys.exit(f"DEVICE={device} but torch sees no CUDA device")
PY
  } 2>&1 | tee "$OUT/env.txt"
}

# ------------------------------------------------------------------------------------------------
# data
# ------------------------------------------------------------------------------------------------
WARM_CACHE='import argparse, sys, time; sys.path.insert(0, "."); import common; t = time.time(); d = common.image_folder(argparse.Namespace(data_dir=sys.argv[1])); x_tr, y_tr, y_te = d["x_train"], d["y_train"], d["y_test"]; print(f"{sys.argv[1]}: {len(y_tr)} train and {len(y_te)} test images, {tuple(x_tr.shape[1:])}, {int(y_tr.max()) + 1} classes, read in {time.time() - t:.1f} s")'
TOY_FOLDER='import argparse, os, sys; sys.path.insert(0, "."); import common; from PIL import Image
root = sys.argv[1]
d = common.synthetic_dataset(argparse.Namespace(data_seed=0), n_train=1000, n_test=200)  # 100 + 20 images per class
x_tr, y_tr, x_te, y_te = d["x_train"], d["y_train"], d["x_test"], d["y_test"]
for split, x, y in (("train", x_tr, y_tr), ("test", x_te, y_te)):
    for i, (img, c) in enumerate(zip(x, y)):
        os.makedirs(os.path.join(root, split, f"class{int(c)}"), exist_ok=True)
        Image.fromarray(img.permute(1, 2, 0).numpy()).save(os.path.join(root, split, f"class{int(c)}", f"{i:04d}.png"))
print(f"toy image folder {root}: {len(y_tr)} train, {len(y_te)} test images")'

stage_data() {
  if [ "$MODE" = tiny ]; then  # the toy folder, and its cache from the same process (one torch import)
    "$PYTHON" -c "$TOY_FOLDER"$'\n'"$WARM_CACHE" "$DATA_DIR"
    return 0
  elif [ ! -d "$DATA_DIR/train" ] || [ ! -d "$DATA_DIR/test" ]; then
    if [ "$MODE" = dry ] || [ -f "$DATA_ARCHIVE" ]; then
      echo "# $DATA_DIR has no train/ and test/: unpacking $DATA_ARCHIVE"
      if [ "$MODE" = dry ]; then
        show mkdir -p "$DATA_DIR"; show tar -xzf "$DATA_ARCHIVE" -C "$DATA_DIR"
      else
        mkdir -p "$DATA_DIR"
        tar -xzf "$DATA_ARCHIVE" -C "$DATA_DIR"
      fi
    else
      echo "DATA_DIR=$DATA_DIR has no train/ and test/, and there is no DATA_ARCHIVE ($DATA_ARCHIVE) to unpack" >&2
      return 1
    fi
  fi
  if [ "$MODE" = dry ]; then
    show "$PYTHON" -c "$WARM_CACHE" "$DATA_DIR"
  else
    "$PYTHON" -c "$WARM_CACHE" "$DATA_DIR"
  fi
}

# ------------------------------------------------------------------------------------------------
# smoke: per script one chain fp32, amp, stop-after 1, resume
# ------------------------------------------------------------------------------------------------
declare -A SMOKE_FLAGS=(  # tiny settings each script's tests use (tests/helpers.py TINY, tests/test_<script>.py)
  [fedavg]="--model cnn --num-clients 4 --frac 0.5 --shards 2 --local-steps 3 --batch-size 16"
  [fedbabu]="--model convnet4-tiny --num-clients 4 --frac 0.5 --shards 2 --local-steps 4 --batch-size 32 --ft-epochs 2 --ft-eval-epochs 0 1"
  [fedfn]="--model cnn --num-clients 4 --frac 0.5 --shards 2 --local-steps 3 --batch-size 16"
  [fedln]="--model normcnn --width 8 --norm ln --batch-size 16 --local-steps 3"
  [fednnnn]="--model cnn6-narrow --num-clients 4 --frac 0.5 --shards 2 --local-steps 3 --batch-size 16"
  [anfr]="--depth 18 --width 8 --image-size 16 --num-clients 3 --alpha 1.0 --local-steps 5 --batch-size 16"
)

# smoke_spec S: label<TAB>command lines of script S's chain
smoke_spec() {
  local s=$1 dir=$WORK/smoke
  # shellcheck disable=SC2206  # the flags are plain words
  local base=("$PYTHON" "$s.py" --dataset synthetic --device "$DEVICE" --rounds 2 --eval-every 2 --seed 0 ${SMOKE_FLAGS[$s]})
  printf '%s\t%s\n' "$s/fp32" "$(show "${base[@]}" --out "$dir/$s-fp32")"
  printf '%s\t%s\n' "$s/amp" "$(show "${base[@]}" --amp --out "$dir/$s-amp")"
  printf '%s\t%s\n' "$s/stop-after" "$(show "${base[@]}" --stop-after 1 --out "$dir/$s-resumed")"
  printf '%s\t%s\n' "$s/resume" "$(show "$PYTHON" "$s.py" --resume "$dir/$s-resumed")"
}

# SMOKE_BATCH=1: run the lines of a spec in this one process, on after a failure; "label rc" lines go to
# DIR/<script>.status (label = script/step).
BATCH_PY='import os, runpy, shlex, sys, traceback
sys.path.insert(0, os.getcwd())
spec, d = sys.argv[1], sys.argv[2]
for line in open(spec).read().splitlines():
    label, cmd = line.split("\t", 1)
    argv = shlex.split(cmd)[1:]
    print(f"=== {label}: {cmd}", file=sys.stderr, flush=True)
    sys.argv = argv
    try:
        runpy.run_path(argv[0], run_name="__main__")
        rc = 0
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    with open(os.path.join(d, label.split("/")[0] + ".status"), "a") as f:
        f.write(f"{label} {rc}\n")'

# smoke_chain NAME S...: the chains of scripts S (fp32, amp, stop-after, resume each), one after another;
# output in WORK/smoke/NAME.log, "label rc" lines in WORK/smoke/<S>.status.
smoke_chain() {
  local name=$1 dir=$WORK/smoke label cmd rc s
  shift
  for s in "$@"; do smoke_spec "$s"; : > "$dir/$s.status"; done > "$dir/$name.spec"
  if [ "$SMOKE_BATCH" = 1 ]; then  # one python process for all of them
    "$PYTHON" -c "$BATCH_PY" "$dir/$name.spec" "$dir" > "$dir/$name.log" 2>&1 || true
  else  # a fresh process per run, as the GPU runs are made
    while IFS=$'\t' read -r label cmd; do
      echo "=== $label: $cmd" >> "$dir/$name.log"
      rc=0
      eval "$cmd" >> "$dir/$name.log" 2>&1 || rc=$?
      echo "$label $rc" >> "$dir/${label%%/*}.status"
    done < "$dir/$name.spec"
  fi
}

SMOKE_TABLE='import json, os, sys
d, scripts = sys.argv[1], sys.argv[2:]
steps = ["fp32", "amp", "stop-after", "resume"]
def acc(run):
    try:
        return json.load(open(os.path.join(d, run, "summary.json")))["test_acc"]
    except (OSError, KeyError, ValueError):
        return None
print("| script | " + " | ".join(steps) + " | final test acc: uninterrupted / resumed |")
print("|---" * (len(steps) + 2) + "|")
bad = 0
for s in scripts:
    status = {}
    if os.path.exists(os.path.join(d, f"{s}.status")):
        for line in open(os.path.join(d, f"{s}.status")):
            label, rc = line.split()
            status[label.split("/", 1)[1]] = int(rc)
    cells = ["ok" if status.get(k) == 0 else ("not run" if k not in status else f"**FAILED** (exit {status[k]})") for k in steps]
    bad += sum(c != "ok" for c in cells)
    a, b = acc(f"{s}-fp32"), acc(f"{s}-resumed")
    same = "-" if a is None or b is None else (f"{a:.4f} / {b:.4f} " + ("(same)" if a == b else "(differ)"))
    print(f"| {s}.py | " + " | ".join(cells) + f" | {same} |")
sys.exit(1 if bad else 0)'

stage_smoke() {
  local s i k groups=()
  if [ "$MODE" = dry ]; then
    for s in "${SCRIPTS[@]}"; do smoke_spec "$s" | cut -f2-; done
    return 0
  fi
  mkdir -p "$WORK/smoke"
  if [ "$SMOKE_BATCH" = 1 ]; then  # SMOKE_JOBS processes, the scripts dealt round-robin (fewer torch imports)
    for i in "${!SCRIPTS[@]}"; do k=$((i % SMOKE_JOBS)); groups[k]="${groups[k]:-} ${SCRIPTS[i]}"; done
  else  # one chain per script
    groups=("${SCRIPTS[@]}")
  fi
  for i in "${!groups[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "$SMOKE_JOBS" ]; do wait -n || true; done
    # shellcheck disable=SC2086  # a group is a list of script names
    set -- ${groups[i]}
    local name=$1
    [ "$#" -gt 1 ] && name=batch$i
    echo "smoke: $* (log: $WORK/smoke/$name.log)"
    smoke_chain "$name" "$@" &
  done
  wait
  for i in "${!groups[@]}"; do
    # shellcheck disable=SC2086
    set -- ${groups[i]}
    local name=$1 bad=0
    [ "$#" -gt 1 ] && name=batch$i
    for s in "$@"; do
      if grep -qv ' 0$' "$WORK/smoke/$s.status" 2>/dev/null || [ "$(wc -l < "$WORK/smoke/$s.status")" -lt 4 ]; then bad=1; fi
    done
    if [ "$bad" = 1 ]; then
      echo "---- smoke: a run of $* failed; the end of $WORK/smoke/$name.log:"
      tail -n 40 "$WORK/smoke/$name.log" || true
    fi
  done
  "$PYTHON" -c "$SMOKE_TABLE" "$WORK/smoke" "${SCRIPTS[@]}" | tee "$OUT/smoke.md"
}

# ------------------------------------------------------------------------------------------------
# times
# ------------------------------------------------------------------------------------------------
stage_times() {
  local cmd=("$PYTHON" benchmarks/gpu_times.py --data-dir "$DATA_DIR" --device "$DEVICE" --out "$WORK/times")
  [ "$MODE" = tiny ] && cmd+=(--tiny)
  # shellcheck disable=SC2206
  cmd+=($TIMES_FLAGS)
  run_or_show "$OUT/times.md" -- "${cmd[@]}"
}

# ------------------------------------------------------------------------------------------------
# fedbabu: Table 13 at paper scale
# ------------------------------------------------------------------------------------------------
stage_fedbabu() {
  local py=$PYTHON
  if [ "$MODE" = tiny ]; then
    # Toy size through the real reproduce script: a python that appends toy flags (argparse: last wins), with
    # --local-steps in place of the paper's --local-epochs (the two are exclusive); a --resume keeps its config.
    py=$WORK/tiny-python
    mkdir -p "$WORK"
    {
      echo '#!/usr/bin/env bash'
      echo "case \" \$* \" in *' --resume '*) exec $(printf %q "$PYTHON") \"\$@\" ;; esac"
      echo 'a=(); while [ $# -gt 0 ]; do if [ "$1" = --local-epochs ]; then shift 2; else a+=("$1"); shift; fi; done'
      echo "exec $(printf %q "$PYTHON") \"\${a[@]}\" --model convnet4-tiny --rounds 2 --local-steps 2 --ft-epochs 1 \\"
      echo "  --ft-eval-epochs 0 1 2"
    } > "$py"
    chmod +x "$py"
  fi
  if [ "$MODE" = dry ]; then
    echo "DATA_DIR=$(printf %q "$DATA_DIR") SEEDS=\"$SEEDS\" RUNS_DIR=$(printf %q "$FEDBABU_RUNS") JOBS=$JOBS PYTHON=$PYTHON bash benchmarks/reproduce/fedbabu.sh paper"
    DRY_RUN=1 SEEDS="$SEEDS" RUNS_DIR="$FEDBABU_RUNS" bash benchmarks/reproduce/fedbabu.sh paper
    return 0
  fi
  local rc=0
  DATA_DIR="$DATA_DIR" SEEDS="$SEEDS" RUNS_DIR="$FEDBABU_RUNS" JOBS="$JOBS" PYTHON="$py" \
    bash benchmarks/reproduce/fedbabu.sh paper || rc=$?
  if [ "$rc" != 0 ]; then
    for log in "$FEDBABU_RUNS"/fedbabu-paper/*/seed*/log.txt; do
      [ -f "$log" ] && grep -q Traceback "$log" && { echo "---- $log:"; tail -n 30 "$log"; }
    done
  fi
  return "$rc"
}

# ------------------------------------------------------------------------------------------------
# threads: docs/speed.md's CPU threads table on this machine's cores (benchmarks/threads.py)
# ------------------------------------------------------------------------------------------------
THREADS_TABLE='import argparse, json, os, sys; sys.path.insert(0, "benchmarks"); import threads
for name in ("threads-idle", "threads"):
    path = os.path.join(sys.argv[1], f"{name}.json")
    if not os.path.exists(path):
        print(f"{name}.json: not written (not run, or stopped before its first run ended)\n")
        continue
    saved = json.load(open(path))
    a, n, cores = saved["args"], len(saved["runs"]), saved.get("cores", saved["cpu_count"])
    conditions, rounds = " ".join(a["conditions"]), a["rounds"]
    print(f"{name}.json: {n} runs on {cores} cores, {conditions}, R={rounds}")
    print(threads.table(saved["runs"], argparse.Namespace(**a)) + "\n")'

stage_threads() {
  local rc=0 idle loaded cycles=2
  [ "$MODE" = tiny ] && cycles=1
  # shellcheck disable=SC2206  # the flags are plain words
  idle=("$PYTHON" benchmarks/threads.py --data-dir "$DATA_DIR" $THREADS_FLAGS --conditions idle --cycles "$cycles"
    --out "$WORK/threads/threads-idle.json")
  # shellcheck disable=SC2206
  loaded=("$PYTHON" benchmarks/threads.py --data-dir "$DATA_DIR" $THREADS_FLAGS --conditions loaded --cycles 1
    --out "$WORK/threads/threads.json")
  if [ "$MODE" = dry ]; then
    show "${idle[@]}"; "${idle[@]}" --dry
    show "${loaded[@]}"; "${loaded[@]}" --dry
    return 0
  fi
  mkdir -p "$WORK/threads"
  timeout -k 5 $(( ${STAGE_CAP:-240} * 5 / 8 )) "${idle[@]}" || rc=$?  # idle first; its JSON holds every run ended
  [ "$rc" = 124 ] && echo "threads: the idle runs stopped at 5/8 of the stage's cap" && rc=0
  [ "$MODE" = tiny ] || "${loaded[@]}" || rc=$?  # the stage's cap ends it; its JSON likewise
  "$PYTHON" -c "$THREADS_TABLE" "$WORK/threads" | tee "$WORK/threads/tables.md"
  return "$rc"
}

# ------------------------------------------------------------------------------------------------
# levers and pair: the speed call (benchmarks/levers.py)
# ------------------------------------------------------------------------------------------------
# levers_cmd measure|pair: the command line of a levers.py stage (its seconds: the stage's cap less 10)
levers_cmd() {
  local seconds=$(( ${STAGE_CAP:-250} - 10 ))
  LCMD=("$PYTHON" benchmarks/levers.py "$1" --data-dir "$DATA_DIR" --device "$DEVICE" --out "$WORK/$2")
  [ "$MODE" = tiny ] && LCMD+=(--tiny)
  if [ "$1" = measure ]; then
    LCMD+=(--budget "$seconds")
    # shellcheck disable=SC2206
    LCMD+=($LEVERS_FLAGS)
  else
    LCMD+=(--seconds "$seconds" --levers "$WORK/levers/levers.json")
  fi
}

stage_levers() {
  levers_cmd measure levers
  run_or_show "$OUT/speed.md" -- "${LCMD[@]}"
}

stage_pair() {
  if [ "$MODE" = dry ]; then  # about what the stages before it leave
    STAGE_CAP=$((DEADLINE - 5 - 30 - CAP_LEVERS))
    case " $STAGES " in *" threads "*) STAGE_CAP=$((STAGE_CAP - CAP_THREADS)) ;; esac
  fi
  levers_cmd pair pair
  run_or_show -a "$OUT/speed.md" -- "${LCMD[@]}"
}

# ------------------------------------------------------------------------------------------------
# collect (always, after the stages)
# ------------------------------------------------------------------------------------------------
collect() {
  local rc=0 parts=()
  if [ -d "$WORK/smoke" ]; then  # again: a smoke stage stopped at its cap has not written its table
    "$PYTHON" -c "$SMOKE_TABLE" "$WORK/smoke" "${SCRIPTS[@]}" > "$OUT/smoke.md" 2>&1 || true
  fi
  if [ -d "$FEDBABU_RUNS/fedbabu-paper" ]; then
    "$PYTHON" benchmarks/collect.py "$FEDBABU_RUNS" --claim fedbabu > "$OUT/fedbabu.md" 2>&1 || rc=1
  else
    echo "no fedbabu runs (stage not run)" > "$OUT/fedbabu.md"
  fi
  # smoke and times run folders without their checkpoints (up to 8 MB each, of no further use); the
  # fedbabu runs with theirs (0.5 MB each), so that a cut-off stage can be resumed by a later call
  # speed.md again from levers.json and the pair's folders: a stage stopped at its cap has not printed its table
  if [ -d "$WORK/threads" ]; then  # again: a threads stage stopped at its cap has not written its tables
    "$PYTHON" -c "$THREADS_TABLE" "$WORK/threads" > "$WORK/threads/tables.md" 2>&1 || rc=1
  fi
  if [ -d "$WORK/levers" ] || [ -d "$WORK/pair" ]; then
    : > "$OUT/speed.md"
    if [ -d "$WORK/levers" ]; then levers_cmd measure levers; "${LCMD[@]}" --report >> "$OUT/speed.md" 2>&1 || rc=1; fi
    if [ -d "$WORK/pair" ]; then levers_cmd pair pair; "${LCMD[@]}" --report >> "$OUT/speed.md" 2>&1 || rc=1; fi
  fi
  # smoke, times, levers and pair run folders without their checkpoints (up to 8 MB each for smoke and times,
  # 37 MB for the pair's VGG11: over what comes back); the fedbabu runs with theirs (0.5 MB each), so that a
  # cut-off stage can be resumed by a later call
  for p in smoke times threads levers pair; do [ -d "$WORK/$p" ] && parts+=(-C "$WORK" "$p"); done
  [ -d "$FEDBABU_RUNS" ] && parts+=(-C "$(dirname "$FEDBABU_RUNS")" "$(basename "$FEDBABU_RUNS")")
  if [ "${#parts[@]}" -gt 0 ]; then
    tar -czf "$OUT/runs.tar.gz" --exclude='smoke/*/checkpoint.pt' --exclude='times/*/checkpoint.pt' \
      --exclude='levers/*/*.pt' --exclude='pair/*/*.pt' --exclude='.gate*' "${parts[@]}" || rc=1
  fi
  {
    echo "# benchmarks/gpu.sh, MODE=$MODE, DEVICE=$DEVICE, $(date -u +%FT%TZ)"
    echo
    echo "| stage | result | seconds |"
    echo "|---|---|---|"
    cat "$WORK/.stages"
    for f in env.txt smoke.md times.md fedbabu.md threads/tables.md speed.md; do
      echo
      echo "## $f"
      echo
      if [ "$f" = env.txt ]; then echo '```'; fi
      if [ "$f" = threads/tables.md ]; then cat "$WORK/$f" 2>/dev/null || echo "(threads: not run)"; continue; fi
      cat "$OUT/$f" 2>/dev/null || echo "(missing)"
      if [ "$f" = env.txt ]; then echo '```'; fi
    done
  } > "$OUT/summary.md"
  return "$rc"
}

# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------
if [ "${1:-}" = --stage ]; then  # one stage, in its own process (run below under timeout)
  "stage_$2"
  exit $?
fi

STAGES=${*:-$STAGES_DEFAULT}
for s in $STAGES; do
  case " $STAGES_ALL " in *" $s "*) ;; *) echo "unknown stage '$s' (stages: $STAGES_ALL)" >&2; exit 2 ;; esac
done

if [ "$MODE" = dry ]; then
  echo "# MODE=dry: the commands of each stage, none run; WORK=$WORK OUT=$OUT DEVICE=$DEVICE"
  for s in $STAGES; do
    echo "# ---- stage $s"
    "stage_$s"
  done
  exit 0
fi

if [ -e "$WORK/smoke" ] || [ -e "$WORK/times" ] || [ -e "$WORK/.stages" ]; then
  echo "WORK=$WORK already holds runs of an earlier call; choose a new WORK (every --out must be fresh)" >&2
  exit 2
fi
mkdir -p "$WORK" "$OUT"
exec 3>&1 4>&2
exec > >(tee -a "$OUT/log.txt") 2>&1
TEE_PID=$!
: > "$WORK/.stages"
echo "benchmarks/gpu.sh MODE=$MODE DEVICE=$DEVICE DATA_DIR=$DATA_DIR WORK=$WORK OUT=$OUT"
echo "stages: $STAGES; deadline ${DEADLINE}s; python $PYTHON; SEEDS=\"$SEEDS\" JOBS=$JOBS SMOKE_JOBS=$SMOKE_JOBS SMOKE_BATCH=$SMOKE_BATCH"
START=$SECONDS
FAILED=0
for s in $STAGES; do
  case $s in
    env) cap=$CAP_ENV ;; data) cap=$CAP_DATA ;; smoke) cap=$CAP_SMOKE ;; times) cap=$CAP_TIMES ;; fedbabu) cap=$CAP_FEDBABU ;;
    threads) cap=$CAP_THREADS ;; levers) cap=$CAP_LEVERS ;; pair) cap=$CAP_PAIR ;;
  esac
  left=$((DEADLINE - (SECONDS - START)))
  if [ "$cap" -le 0 ] || [ "$cap" -gt "$left" ]; then cap=$left; fi
  if [ "$cap" -lt 10 ]; then
    echo "##### stage $s: SKIPPED, ${left}s left of DEADLINE=${DEADLINE}s"
    echo "| $s | **skipped** (deadline) | 0 |" >> "$WORK/.stages"
    FAILED=1
    continue
  fi
  echo
  echo "##### stage $s (at most ${cap}s) $(date -u +%T)"
  t0=$SECONDS
  rc=0
  STAGE_CAP=$cap timeout -k 10 "$cap" bash "$SELF" --stage "$s" || rc=$?
  dt=$((SECONDS - t0))
  if [ "$rc" = 0 ]; then
    result=ok
  elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    result="**TIMEOUT** after ${cap}s"
    FAILED=1
  else
    result="**FAILED** (exit $rc)"
    FAILED=1
  fi
  echo "##### stage $s: $result in ${dt}s"
  echo "| $s | $result | $dt |" >> "$WORK/.stages"
done
echo
echo "##### collect"
collect || { echo "| collect | **FAILED** | - |" >> "$WORK/.stages"; FAILED=1; }
echo
echo "##### stages (seconds)"
cat "$WORK/.stages"
echo "total $((SECONDS - START))s; files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
echo "exit status $FAILED"
exec 1>&3 2>&4 3>&- 4>&-
wait "$TEE_PID" 2>/dev/null || true
exit "$FAILED"

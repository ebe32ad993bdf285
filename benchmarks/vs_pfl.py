"""Time CleanFL's fedavg.py against pfl-research (Apple's pfl 0.6.0, PyTorch, SimulatedBackend) on pfl's own CIFAR-10.

The work, on the CPU, is pfl's CIFAR-10 benchmark (pfl-research benchmarks/image_classification, configs/
baseline.yaml, IID): CIFAR-10 from an image folder, IID clients of 50 images each (N=1,000), 50 a round with
uniform weights, E=1 local epoch of B=10 (5 SGD steps a client), SGD lr 0.1 without momentum or weight decay, no
augmentation, per-channel normalization, and pfl's simple_cnn on both sides (CleanFL's --model pfl-cnn: the same
layers, 1,626,442 parameters; the run fails if the two counts differ). Both sides test the global model on the
10,000 test images every E = --eval-every rounds, pfl's config's 10 (pfl's CentralEvaluationCallback at its
frequency E; CleanFL --eval-every E), so that any E rounds in a row hold one evaluation. Seven configurations, run
in interleaved cycles (each cycle runs each configuration once, every other cycle in reverse order):

  pfl-1        benchmarks/pfl_app/simulate.py in one process with pfl's defaults (torch's threads: the cores)
  pfl-1-spin   the same with GOMP_SPINCOUNT=1000 (the spin count CleanFL's scripts set before torch loads)
  pfl-1t       the same at one thread (OMP_NUM_THREADS=1)
  pfl-2        torchrun --standalone --nproc_per_node 2 simulate.py (pfl's way for PyTorch), OMP_NUM_THREADS=1:
               each process trains its share of the cohort and tests its share of the test set
  cleanfl-1    python fedavg.py ...: one process at the scripts' CPU default (no --threads: the usable cores)
  cleanfl-1t   the same with --threads 1
  cleanfl-2    torchrun --standalone --nproc_per_node 2 fedavg.py ..., OMP_NUM_THREADS=1

A run's time per round is the median, over the windows of E rounds after the first E (the warm-up), of a window's
time over E: E rounds of training and one evaluation, each side by its own clock (CleanFL: metrics.jsonl's
elapsed_s at its evaluations; pfl: simulate.py's stamp at the end of each round); its fastest window is kept too,
with the final test accuracy and the wall time. The table's ratio is pfl / CleanFL of the median s/round at equal
processes and threads (pfl-1 and pfl-1-spin against cleanfl-1, pfl-1t against cleanfl-1t, pfl-2 against
cleanfl-2). Before the cycles, both sides' decoded copies of the images are made (or found): no run decodes a JPEG.

Where the work is not quite the same (both differences are the frameworks' own): pfl samples a round's users with
replacement, CleanFL without; pfl's users train on their images in a fixed order, CleanFL's shuffle them. pfl's
config ties a second evaluation to the central one's frequency (each user's model on its own images before and
after local training); CleanFL does none, so simulate.py runs it only in round 1, which pfl always does (warm-up).

pfl lives in its own venv (--venv), made here once by `pip install pfl==0.6.0 torch==2.14.1 torchvision==0.29.1`
(as vs_flower.py makes Flower's); it is not a CleanFL dependency, nor in benchmarks/requirements.txt.

    python benchmarks/vs_pfl.py --data-dir /path/to/cifar10                  # 3 cycles of 20 rounds, all seven
    python benchmarks/vs_pfl.py --data-dir /path/to/cifar10 --load 2         # with a busy process per core beside
    python benchmarks/vs_pfl.py --data-dir /path/to/cifar10 --configs pfl-2 cleanfl-2
    python benchmarks/vs_pfl.py --setup-only                                 # only make pfl's venv
    python benchmarks/vs_pfl.py --data-dir D --rounds 2 --eval-every 1 --cycles 1 --frac 0.002   # a smoke run
    python benchmarks/vs_pfl.py --data-dir D --dry                           # print each run's command only

It prints a markdown table and writes every number to --out (default runs/vs_pfl/results.json; an existing one
is refused); each run's log and run folder (or pfl's JSON) lie beside it, in <configuration>-cycle<k>/.
"""

import argparse
import contextlib
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vs_flower import start_load, stop_load  # noqa: E402  (the busy processes of the loaded case)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIMULATE = os.path.join(ROOT, "benchmarks", "pfl_app", "simulate.py")
PFL_PACKAGES = ["pfl==0.6.0", "torch==2.14.1", "torchvision==0.29.1"]
CONFIGS = ["pfl-1", "pfl-1-spin", "pfl-1t", "pfl-2", "cleanfl-1", "cleanfl-1t", "cleanfl-2"]
# The same numbers of processes and threads.
TWIN = {"pfl-1": "cleanfl-1", "pfl-1-spin": "cleanfl-1", "pfl-1t": "cleanfl-1t", "pfl-2": "cleanfl-2"}
PROCESSES = 2  # of pfl-2 and cleanfl-2
# pfl's benchmark: images per client (50,000 / N), clients a round (frac N), local epochs, batch, lr
WORK = {"num_clients": 1000, "frac": 0.05, "local_epochs": 1, "batch_size": 10, "lr": 0.1}


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse's own adds the usage block above it)
        self.exit(2, f"{self.prog}: error: {message}; see --help\n")


def refuse(flag, message):
    print(f"vs_pfl.py: error: {flag}: {message}", file=sys.stderr)
    sys.exit(2)


def parse_args(argv=None):
    p = Parser(
        prog="vs_pfl.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--data-dir", help="CIFAR-10 image folder (train/<class>/*, test/<class>/*)")
    p.add_argument("--rounds", type=int, default=20, help="R: rounds per run (the first E are warm-up)")
    p.add_argument("--eval-every", type=int, default=10, help="E: a test-set evaluation every E rounds (pfl's config)")
    p.add_argument("--cycles", type=int, default=3, help="interleaved repetitions of the configurations")
    p.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS, help="a subset, run in this order")
    p.add_argument("--load", type=int, default=0, help="busy processes (while True: pass) running beside")
    p.add_argument("--venv", default=os.path.expanduser("~/.cache/cleanfl/pfl-venv"), help="pfl's venv")
    p.add_argument("--out", default=os.path.join("runs", "vs_pfl", "results.json"), help="JSON of all numbers")
    p.add_argument("--setup-only", action="store_true", help="make pfl's venv, run nothing")
    p.add_argument("--dry", action="store_true", help="print each run's command, run nothing")
    # the work; smaller values only for smoke runs
    p.add_argument("--num-clients", type=int, default=WORK["num_clients"], help="N (the images split in N parts)")
    p.add_argument("--frac", type=float, default=WORK["frac"], help="fraction of clients a round (0.05: 50 of 1,000)")
    args = p.parse_args(argv)
    # both sides run with cwd = the repository root, so relative paths are made absolute here
    args.out, args.venv = os.path.abspath(args.out), os.path.abspath(os.path.expanduser(args.venv))
    if args.setup_only:
        return args
    if not args.data_dir:
        refuse("--data-dir", "required (unless --setup-only)")
    args.data_dir = os.path.abspath(args.data_dir)
    for split in ("train", "test"):
        if not os.path.isdir(os.path.join(args.data_dir, split)):
            refuse(
                "--data-dir", f"{args.data_dir}/{split}/ is missing; an image folder is DIR/{{train,test}}/<class>/*"
            )
    if args.eval_every < 1:
        refuse("--eval-every", f"must be at least 1, got {args.eval_every}")
    if args.rounds < 2 * args.eval_every or args.rounds % args.eval_every:
        refuse("--rounds", f"must be a multiple of --eval-every {args.eval_every}, at least two, got {args.rounds}")
    if args.cycles < 1:
        refuse("--cycles", f"must be at least 1, got {args.cycles}")
    if args.load < 0:
        refuse("--load", f"must be 0 or more, got {args.load}")
    if args.num_clients < 1:
        refuse("--num-clients", f"must be at least 1, got {args.num_clients}")
    if not 0 < args.frac <= 1:
        refuse("--frac", f"must be in (0, 1], got {args.frac}")
    if len(set(args.configs)) != len(args.configs):
        refuse("--configs", "names a configuration twice")
    if os.path.exists(args.out) and not args.dry:
        refuse("--out", f"{args.out} exists; name another file (or remove it)")
    return args


def cohort(args):
    """Clients a round, as CleanFL's sample_clients counts them: max(floor(frac N), 1)."""
    return max(int(args.frac * args.num_clients + 1e-9), 1)


# ---------------------------------------------------------------------------------------------
# pfl's venv
# ---------------------------------------------------------------------------------------------
def venv_python(venv):
    return os.path.join(venv, "bin", "python")


def pfl_python(venv):
    """The venv's python, after making the venv and installing pfl into it if it lacks pfl 0.6.0."""
    python = venv_python(venv)
    check = [python, "-c", "import pfl, torch, torchvision, PIL; assert pfl.__version__ == '0.6.0'"]
    if os.path.exists(python) and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    print(f"making pfl's venv in {venv} ({' '.join(PFL_PACKAGES)})", flush=True)
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    subprocess.run([python, "-m", "pip", "install", *PFL_PACKAGES], check=True)
    subprocess.run(check, check=True)
    return python


def prepare_data(args, python):
    """Both sides' decoded copies of the images (each side's own cache), so that no timed run decodes a JPEG."""
    if python:
        subprocess.run([python, SIMULATE, "--data-dir", args.data_dir, "--prepare-only"], cwd=ROOT, check=True)
    if any(c.startswith("cleanfl") for c in args.configs):
        code = "import types; from common import DATASETS; DATASETS['folder'](types.SimpleNamespace(data_dir=%r))"
        subprocess.run([sys.executable, "-c", code % args.data_dir], cwd=ROOT, check=True)


# ---------------------------------------------------------------------------------------------
# Each run's command, and running it
# ---------------------------------------------------------------------------------------------
def command(args, config, run_dir, python):
    """(cmd, env) of one run: env is what the configuration sets on top of the environment, which is stripped
    of OMP_NUM_THREADS and GOMP_SPINCOUNT (each configuration sets its own)."""
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", PROCESSES]
    if config.startswith("pfl"):
        flags = [
            *("--data-dir", args.data_dir, "--rounds", args.rounds, "--num-clients", args.num_clients),
            *("--cohort-size", cohort(args), "--local-epochs", WORK["local_epochs"]),
            *("--batch-size", WORK["batch_size"], "--lr", WORK["lr"], "--out", os.path.join(run_dir, "pfl.json")),
            *("--central-eval-every", args.eval_every),
        ]
        # pfl takes a GPU where there is one; CleanFL is told --device cpu
        env = {"PFL_PYTORCH_DEVICE": "cpu"}
        launcher = [python, *torchrun] if config == "pfl-2" else [python]
        if config == "pfl-1-spin":
            env["GOMP_SPINCOUNT"] = "1000"
        if config in ("pfl-1t", "pfl-2"):
            env["OMP_NUM_THREADS"] = "1"
        cmd = [*launcher, SIMULATE, *flags]
    else:
        flags = [
            *("--dataset", "folder", "--data-dir", args.data_dir, "--model", "pfl-cnn", "--iid"),
            *("--num-clients", args.num_clients, "--frac", args.frac, "--local-epochs", WORK["local_epochs"]),
            *("--batch-size", WORK["batch_size"], "--lr", WORK["lr"], "--momentum", 0, "--weight-decay", 0),
            *("--augment", "none", "--weighting", "uniform", "--device", "cpu", "--rounds", args.rounds),
            *("--eval-every", args.eval_every, "--out", os.path.join(run_dir, "run"), "--overwrite"),
            # One checkpoint, at the end (pfl writes none).
            *("--checkpoint-every", args.rounds),
        ]
        env = {}
        launcher = [sys.executable, *torchrun] if config == "cleanfl-2" else [sys.executable]
        if config == "cleanfl-1t":
            flags += ["--threads", 1]
        if config == "cleanfl-2":
            env["OMP_NUM_THREADS"] = "1"
        cmd = [*launcher, os.path.join(ROOT, "fedavg.py"), *flags]
    return [str(a) for a in cmd], env


def timed(cmd, env, log_path):
    """Run cmd (output to log_path) in its own process group; its wall time in seconds. A failed run stops the
    benchmark; so does Ctrl-C, which ends the run's whole group (torchrun's workers too)."""
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "GOMP_SPINCOUNT")}
    with open(log_path, "w") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env={**base, **env}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            returncode = proc.wait()
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
            raise
        wall = time.perf_counter() - start
    if returncode != 0:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        sys.exit(f"failed ({returncode}): {shlex.join(cmd)}\n{tail}")
    return wall


def intervals(stamps, every):
    """Seconds a round over each window of E rounds after the first E (the warm-up): stamps[r] is the clock at the end
    of round r (those of rounds E, 2E, ... at least), and every window holds one test-set evaluation."""
    ends = [stamps[r] for r in range(every, max(stamps) + 1, every)]
    return [(b - a) / every for a, b in zip(ends, ends[1:])]


def run_one(args, config, run_dir, python):
    cmd, env = command(args, config, run_dir, python)
    log_path = os.path.join(run_dir, "log.txt")
    wall = timed(cmd, env, log_path)
    if config.startswith("pfl"):
        with open(os.path.join(run_dir, "pfl.json")) as f:
            rec = json.load(f)
        # round_end[i]: the end of central iteration i, which is round i + 1.
        stamps = {i + 1: t - rec["start"] for i, t in enumerate(rec["round_end"])}
        res = {"params": rec["params"], "test_acc": rec["final_test_acc"], "pfl": rec}
    else:
        with open(os.path.join(run_dir, "run", "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        with open(log_path) as f:
            found = re.search(r"model pfl-cnn, ([\d,]+) parameters", f.read())
        stamps = {row["round"]: row["elapsed_s"] for row in rows}
        res = {"params": int(found.group(1).replace(",", "")) if found else None, "test_acc": rows[-1]["test_acc"]}
        res["test_acc_by_round"] = [row["test_acc"] for row in rows]
    if max(stamps) != args.rounds:
        sys.exit(f"{config}: the last round stamped in {run_dir} is {max(stamps)}, not --rounds {args.rounds}")
    gaps = intervals(stamps, args.eval_every)
    return {
        "cmd": cmd,
        "env": env,
        "wall_s": wall,
        "round_end_s": stamps,
        "round_s": statistics.median(gaps),
        "round_min_s": min(gaps),
        **res,
    }


# ---------------------------------------------------------------------------------------------
# Load, table, the cycles
# ---------------------------------------------------------------------------------------------
def table(runs, configs, rounds):
    """Markdown: per configuration the s/round of each cycle (the median of its windows), the fastest window of
    all its cycles, the median over cycles, the mean final test accuracy, and pfl / CleanFL of the medians at equal
    processes (TWIN)."""
    by = {c: [r for r in runs if r["config"] == c] for c in configs}
    median = {c: statistics.median(r["round_s"] for r in by[c]) for c in configs if by[c]}
    cycles = max(len(v) for v in by.values())
    head = ["configuration", *(f"cycle {i + 1}" for i in range(cycles)), "min (fastest round)", "median"]
    lines = ["| " + " | ".join([*head, f"test acc (R={rounds})", "pfl / CleanFL"]) + " |"]
    lines.append("|" + "---|" * (len(head) + 2))
    for c in configs:
        if not by[c]:
            continue
        twin = TWIN.get(c)
        ratio = f"{median[c] / median[twin]:.2f}x ({twin})" if twin in median else ""
        cells = [f"{r['round_s']:.2f}" for r in by[c]] + [""] * (cycles - len(by[c]))
        fastest = min(r["round_min_s"] for r in by[c])
        acc = statistics.mean(r["test_acc"] for r in by[c])
        row = [c, *cells, f"{fastest:.2f}", f"{median[c]:.2f}", f"{acc:.4f}", ratio]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def schedule(configs, cycles):
    """(cycle, config) in run order: the configurations in order, every other cycle reversed."""
    return [(k, c) for k in range(1, cycles + 1) for c in (configs if k % 2 else configs[::-1])]


def save(path, obj):
    """Write JSON atomically: another name, then renamed over path."""
    with open(f"{path}.tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(f"{path}.tmp", path)


def measure(args, python):
    """The interleaved cycles; every run's numbers, also written to args.out after each run."""
    out_dir = os.path.dirname(args.out)
    runs, params = [], {}
    for cycle, config in schedule(args.configs, args.cycles):
        run_dir = os.path.join(out_dir, f"{config}-cycle{cycle}")
        os.makedirs(run_dir, exist_ok=True)
        loadavg = os.getloadavg()[0]  # the machine's load just before: background work shows here
        res = run_one(args, config, run_dir, python)
        res.update(config=config, cycle=cycle, loadavg_before=loadavg)
        runs.append(res)
        print(
            f"cycle {cycle} {config}: {res['round_s']:.2f} s/round (fastest {res['round_min_s']:.2f}), wall "
            f"{res['wall_s']:.1f} s, test acc {res['test_acc']:.4f}, {res['params']:,} parameters "
            f"(load average before: {loadavg:.2f})",
            flush=True,
        )
        params[config.split("-")[0]] = res["params"]
        save(args.out, {"args": vars(args), "cpu_count": os.cpu_count(), "cohort": cohort(args), "runs": runs})
        if len(set(params.values())) > 1:
            sys.exit(f"the two sides' models differ: {params} parameters (pfl's simple_cnn has 1,626,442)")
    return runs


if __name__ == "__main__":
    args = parse_args()
    if args.setup_only:
        pfl_python(args.venv)
        sys.exit(0)
    if args.dry:
        for cycle, config in schedule(args.configs, args.cycles):
            run_dir = os.path.join(os.path.dirname(args.out), f"{config}-cycle{cycle}")
            cmd, env = command(args, config, run_dir, venv_python(args.venv))
            print(f"cycle {cycle} {config}: " + " ".join([*(f"{k}={v}" for k, v in env.items()), shlex.join(cmd)]))
        sys.exit(0)
    python = pfl_python(args.venv) if any(c.startswith("pfl") for c in args.configs) else None
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    prepare_data(args, python)
    load = start_load(args.load)
    try:
        runs = measure(args, python)
    finally:
        stop_load(load)
    print(
        f"\nN={args.num_clients}, {cohort(args)} clients a round, R={args.rounds}, --load {args.load}, "
        f"{os.cpu_count()} cores. s/round: median of the windows of E={args.eval_every} rounds after the first, each "
        "with one test-set evaluation; min: the fastest "
        "such round of any cycle; pfl / CleanFL: of the medians, at equal processes"
    )
    print(table(runs, args.configs, args.rounds))
    print(f"\nraw numbers: {args.out}")

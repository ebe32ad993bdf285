"""Time CleanFL's fedavg.py against Flower (flwr 1.42, Message API, simulation on Ray) on the same work.

The work, on the CPU: CIFAR-10 from an image folder, McMahan's CNN (2,156,490 parameters), IID over N=100
clients, 10 a round, E=1 local epoch, B=50, SGD lr 0.01 momentum 0.5, no weight decay, no augmentation,
per-channel normalization. Both sides test the global model on the 10,000 test images after every round
(CleanFL --eval-every 1, its default; Flower's central evaluate_fn, as in its quickstart), because CleanFL
stamps its clock (metrics.jsonl elapsed_s) only at an evaluation; Flower's ServerApp stamps the same point.
Four configurations, run in interleaved cycles (each cycle runs each configuration once, in this order):

  flower-default   benchmarks/flower_app/simulate.py: run_simulation, 100 SuperNodes, Flower's backend defaults
                   (each actor reserves 2 CPUs: cores/2 actors, and Ray sets OMP_NUM_THREADS=2 in each)
  cleanfl-default  python fedavg.py ...: one process at the scripts' default threads (no --threads, no
                   OMP_NUM_THREADS: the cores not running other threads as it starts)
  flower-equal     the same with --actor-cpus 1 --ray-cpus C and OMP_NUM_THREADS=1: C actors of 1 thread
  cleanfl-equal    torchrun --nproc_per_node C fedavg.py ... with OMP_NUM_THREADS=1: C ranks of 1 thread

C = --cores (default: all). A run's time per round is the median, over rounds 2..R, of the time between
consecutive evaluations (round 1 is warm-up: Flower's actors start and load their data then); its fixed cost
is its wall time minus R such rounds (start-up, data loading, Ray, warm-up, shut-down). Flower's clients read
the images as the quickstart does, a file decoded per access (ImageFolder); --flower-data memory decodes
them once per process instead, as CleanFL holds its data, to separate the framework's cost from the data
path's. Flower lives in its own venv (--venv), made here once by `pip install flwr[simulation]==1.42.0
torch==2.14.1 torchvision==0.29.1`; it is not a CleanFL dependency.

    python benchmarks/vs_flower.py --data-dir /path/to/cifar10                 # 3 cycles of 4 rounds, all four
    python benchmarks/vs_flower.py --data-dir /path/to/cifar10 --load 1        # with one busy process beside
    python benchmarks/vs_flower.py --data-dir /path/to/cifar10 --configs flower-default cleanfl-default
    python benchmarks/vs_flower.py --setup-only                                # only make Flower's venv
    python benchmarks/vs_flower.py --data-dir D --rounds 2 --cycles 1 --frac 0.02   # a smoke run (2 clients)

It prints a markdown table and writes every number to --out (default runs/vs_flower/results.json); each run's
log and run folder (or Flower's JSON) lie beside it, in <configuration>-cycle<k>/.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIMULATE = os.path.join(ROOT, "benchmarks", "flower_app", "simulate.py")
FLOWER_PACKAGES = ["flwr[simulation]==1.42.0", "torch==2.14.1", "torchvision==0.29.1"]
CONFIGS = ["flower-default", "cleanfl-default", "flower-equal", "cleanfl-equal"]


def parse_args():
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--data-dir", help="CIFAR-10 image folder (train/<class>/*, test/<class>/*)")
    p.add_argument("--rounds", type=int, default=4, help="R: rounds per run (the first is warm-up)")
    p.add_argument("--cycles", type=int, default=3, help="interleaved repetitions of the configurations")
    p.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS, help="a subset, run in this order")
    p.add_argument("--cores", type=int, default=os.cpu_count(), help="C: workers of the equal-core configurations")
    p.add_argument("--load", type=int, default=0, help="busy processes (while True: pass) running beside")
    p.add_argument("--venv", default=os.path.expanduser("~/.cache/cleanfl/flower-venv"), help="Flower's venv")
    p.add_argument("--out", default=os.path.join("runs", "vs_flower", "results.json"), help="JSON of all numbers")
    p.add_argument("--setup-only", action="store_true", help="make Flower's venv, run nothing")
    # the work; smaller values only for smoke runs
    p.add_argument("--num-clients", type=int, default=100, help="N")
    p.add_argument("--frac", type=float, default=0.1, help="fraction of clients per round")
    p.add_argument(
        "--flower-data",
        choices=["files", "memory"],
        default="files",
        help="Flower's Dataset: files (ImageFolder, a JPEG decoded per access, the quickstart's path) or memory "
        "(decoded once per process, as CleanFL holds its data: the framework's cost without the data path's)",
    )
    args = p.parse_args()
    if not args.setup_only and not args.data_dir:
        p.error("--data-dir is required (unless --setup-only)")
    # both sides run with cwd = the repository root, so relative paths are made absolute here
    args.data_dir = args.data_dir and os.path.abspath(args.data_dir)
    args.out, args.venv = os.path.abspath(args.out), os.path.abspath(os.path.expanduser(args.venv))
    if args.rounds < 2:
        p.error("--rounds must be at least 2: round 1 is warm-up, not timed")
    return args


# ---------------------------------------------------------------------------------------------
# Flower's venv
# ---------------------------------------------------------------------------------------------
def flower_python(venv):
    """The venv's python, after making the venv and installing Flower into it if it lacks flwr 1.42.0."""
    python = os.path.join(venv, "bin", "python")
    check = [python, "-c", "import flwr, ray, torchvision; assert flwr.__version__ == '1.42.0'"]
    if os.path.exists(python) and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    print(f"making Flower's venv in {venv} ({' '.join(FLOWER_PACKAGES)})", flush=True)
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    subprocess.run([python, "-m", "pip", "install", *FLOWER_PACKAGES], check=True)
    subprocess.run(check, check=True)
    return python


# ---------------------------------------------------------------------------------------------
# One run of each side
# ---------------------------------------------------------------------------------------------
def timed(cmd, env, log_path):
    """Run cmd (output to log_path); its wall time in seconds. A failed run stops the benchmark."""
    with open(log_path, "w") as log:
        start = time.perf_counter()
        base = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # each configuration sets its own
        proc = subprocess.run(cmd, cwd=ROOT, env={**base, **env}, stdout=log, stderr=subprocess.STDOUT)
        wall = time.perf_counter() - start
    if proc.returncode != 0:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{tail}")
    return wall


def run_cleanfl(args, config, run_dir):
    """fedavg.py alone (default) or under torchrun with C one-thread ranks (equal)."""
    flags = [
        *("--dataset", "folder", "--data-dir", args.data_dir, "--model", "cnn", "--iid"),
        *("--num-clients", args.num_clients, "--frac", args.frac, "--local-epochs", 1, "--batch-size", 50),
        *("--lr", 0.01, "--momentum", 0.5, "--weight-decay", 0, "--augment", "none", "--device", "cpu"),
        *("--rounds", args.rounds, "--eval-every", 1, "--out", os.path.join(run_dir, "run"), "--overwrite"),
        # one checkpoint, at the end: with --eval-every 1 the default would write one every round (Flower writes none)
        *("--checkpoint-every", args.rounds),
    ]
    if config == "cleanfl-default":
        launcher, env = [sys.executable], {}
    else:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", args.cores]
        env = {"OMP_NUM_THREADS": "1"}
    cmd = [str(a) for a in [*launcher, os.path.join(ROOT, "fedavg.py"), *flags]]
    wall = timed(cmd, env, os.path.join(run_dir, "log.txt"))
    with open(os.path.join(run_dir, "run", "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    stamps = [row["elapsed_s"] for row in rows]  # after each round's evaluation
    return {"cmd": cmd, "env": env, "wall_s": wall, "round_end_s": stamps, "test_acc": rows[-1]["test_acc"]}


def run_flower(args, config, run_dir, python):
    """simulate.py with Flower's defaults, or with one actor of one thread per core (equal)."""
    out = os.path.join(run_dir, "flower.json")
    flags = [
        *("--data-dir", args.data_dir, "--rounds", args.rounds, "--num-clients", args.num_clients),
        *("--frac", args.frac, "--out", out),
        *(["--in-memory"] if args.flower_data == "memory" else []),
    ]
    # telemetry is a daemon thread either way (no effect on time); off, so that the benchmark posts nothing
    env = {"FLWR_TELEMETRY_ENABLED": "0"}
    if config == "flower-equal":
        flags += ["--actor-cpus", 1, "--ray-cpus", args.cores]
        env["OMP_NUM_THREADS"] = "1"  # Ray keeps a set OMP_NUM_THREADS; the ServerApp's evaluation gets 1 too
    cmd = [str(a) for a in [python, SIMULATE, *flags]]
    wall = timed(cmd, env, os.path.join(run_dir, "log.txt"))
    with open(out) as f:
        rec = json.load(f)
    stamps = [t - rec["start"] for t in rec["round_end"]]
    return {"cmd": cmd, "env": env, "wall_s": wall, "round_end_s": stamps, **rec}


def per_round(stamps):
    """Median time between consecutive evaluations over rounds 2..R."""
    return statistics.median(b - a for a, b in zip(stamps, stamps[1:]))


def compute_floor(threads, steps=100, batch=50, test=10_000):
    """Seconds of one round's arithmetic alone, in this process at `threads` torch threads: `steps` SGD steps of the
    CNN on random batches (10 clients x 10 steps: E=1 of 500 images at B=50) and a forward pass over `test` images
    in batches of 2,000 (the evaluation); no data path, no framework: what a round's time cannot go below."""
    import torch
    from types import SimpleNamespace

    sys.path.insert(0, ROOT)
    from common import build_model

    torch.set_num_threads(threads)
    model = build_model("cnn", SimpleNamespace(in_channels=3, num_classes=10, image_size=32))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    start = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    with torch.no_grad():
        for _ in range(test // 2000):
            model(torch.randn(2000, 3, 32, 32))
    return time.perf_counter() - start


# ---------------------------------------------------------------------------------------------
# Load, table
# ---------------------------------------------------------------------------------------------
def start_load(n):
    """n busy processes beside the measurement (the loaded case); stopped by stop_load."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stop_load(procs):
    for proc in procs:
        proc.terminate()
        proc.wait()


def table(runs, configs, rounds):
    """Markdown: per configuration the s/round of each cycle, their median, the fixed cost and wall time
    (medians over cycles), the mean final accuracy, and Flower / CleanFL of the median s/round."""
    by = {c: [r for r in runs if r["config"] == c] for c in configs}
    median = {c: statistics.median(r["round_s"] for r in by[c]) for c in configs if by[c]}
    cycles = max(len(v) for v in by.values())
    head = ["configuration", *(f"cycle {i + 1}" for i in range(cycles)), "median s/round", "fixed s", "wall s"]
    lines = ["| " + " | ".join([*head, f"test acc (R={rounds})", "Flower / ours"]) + " |"]
    lines.append("|" + "---|" * (len(head) + 2))
    for c in configs:
        if not by[c]:
            continue
        twin = c.replace("flower", "cleanfl")
        ratio = f"{median[c] / median[twin]:.2f}x" if c.startswith("flower") and twin in median else ""
        cells = [f"{r['round_s']:.2f}" for r in by[c]] + [""] * (cycles - len(by[c]))
        fixed = statistics.median(r["wall_s"] - rounds * r["round_s"] for r in by[c])
        wall = statistics.median(r["wall_s"] for r in by[c])
        acc = statistics.mean(r["test_acc"] for r in by[c])
        row = [c, *cells, f"{median[c]:.2f}", f"{fixed:.1f}", f"{wall:.1f}", f"{acc:.4f}", ratio]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def measure(args, python):
    """The interleaved cycles; every run's numbers, also written to args.out after each run."""
    out_dir = os.path.dirname(os.path.abspath(args.out))
    runs = []
    for cycle in range(1, args.cycles + 1):
        for config in args.configs:
            run_dir = os.path.join(out_dir, f"{config}-cycle{cycle}")
            os.makedirs(run_dir, exist_ok=True)
            loadavg = os.getloadavg()[0]  # the machine's load just before: background work shows here
            if config.startswith("flower"):
                res = run_flower(args, config, run_dir, python)
            else:
                res = run_cleanfl(args, config, run_dir)
            res.update(config=config, cycle=cycle, loadavg_before=loadavg, round_s=per_round(res["round_end_s"]))
            runs.append(res)
            print(
                f"cycle {cycle} {config}: {res['round_s']:.2f} s/round, wall {res['wall_s']:.1f} s, "
                f"test acc {res['test_acc']:.4f} (load average before: {loadavg:.2f})",
                flush=True,
            )
            with open(args.out, "w") as f:  # after every run: an interrupted benchmark keeps what it measured
                json.dump({"args": vars(args), "cpu_count": os.cpu_count(), "runs": runs}, f, indent=1)
    return runs


if __name__ == "__main__":
    args = parse_args()
    needs_flower = args.setup_only or any(c.startswith("flower") for c in args.configs)
    python = flower_python(args.venv) if needs_flower else None
    if args.setup_only:
        sys.exit(0)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    load = start_load(args.load)
    try:
        runs = measure(args, python)
    finally:
        stop_load(load)
    print(
        f"\nN={args.num_clients}, frac {args.frac}, R={args.rounds}, C={args.cores}, --load {args.load}, "
        f"--flower-data {args.flower_data}. s/round: median of rounds 2..R, each with one test-set evaluation; "
        "fixed s: wall - R x s/round"
    )
    print(table(runs, args.configs, args.rounds))
    floor = {threads: compute_floor(threads) for threads in (args.cores, 1)}
    with open(args.out) as f:
        saved = json.load(f)
    with open(args.out, "w") as f:
        json.dump({**saved, "floor_s": floor}, f, indent=1)
    print(
        f"compute floor of a round (its SGD steps and evaluation alone): {floor[args.cores]:.2f} s at {args.cores} "
        f"threads; {floor[1]:.2f} s at 1 thread, {floor[1] / args.cores:.2f} s split over {args.cores} processes"
    )
    print(f"\nraw numbers: {args.out}")

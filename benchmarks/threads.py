"""Time per round on the CPU at each thread setting, on an idle machine and beside a busy process.

Five workloads, each run these ways:
  fedavg-mlp     fedavg.py, the README's first run: McMahan's 2NN, Dirichlet 0.5 over N=10, all a round, 20 local steps
  fedavg-cnn     fedavg.py, McMahan's CNN, IID over N=100, 10 a round, E=1, B=50, SGD 0.01 momentum 0.5 (the Flower
                 comparison's work, benchmarks/vs_flower.py)
  fedbabu-small  fedbabu.py at benchmarks/reproduce/fedbabu.sh small (convnet4-tiny, s=10, tau=10)
  fedfn-small    fedfn.py at benchmarks/reproduce/fedfn.sh small (convnet4-tiny, s=2, E=5, lr 0.03)
  fednnnn-small  fednnnn.py at benchmarks/reproduce/fednnnn.sh small, FedNNNN (cnn6-narrow, s=2, E=2)
ways:
  default        python SCRIPT ...               no --threads, no OMP_NUM_THREADS: the scripts' own choice, on the
                 CPU one process of a thread a core (torch's count of physical cores, at most a container's CPU limit)
  default ENV    the same with the environment variable(s) of --envs set, e.g. GOMP_SPINCOUNT=300000 (libgomp's
                 own default, the scripts' before they set one) or OMP_WAIT_POLICY=PASSIVE
  N threads      python SCRIPT ... --threads N, for each N of --thread-counts (default: the powers of two below the
                 cores, and the cores: 1 and 2 on two cores; 1 2 4 8 16 on sixteen); the best: the bounds' yardstick
  torchrun 2x1   torchrun --nproc_per_node 2 SCRIPT ...   (torchrun sets OMP_NUM_THREADS=1 a rank; --no-torchrun: not)
and two conditions: idle, and loaded (--load busy processes, `while True: pass`, started first; default: one a core).
The default takes torch's count of the machine's cores (a function of the machine alone: one command, one set of
numbers). Each run evaluates after rounds R and 2R; its time per round is the difference of the two rows' elapsed_s
over R (start-up, data loading and the first rounds' warm-up left out; one test-set evaluation in). The table gives,
over --cycles interleaved cycles (every other one in reverse order: no way always runs first), the median of the
loaded rows (there the interference is what is measured) and by default the minimum of the idle rows (timeit's rule:
interference only adds time, so the fastest of identical runs is the machine's speed), and the threads the default
picked (config.json; "P x T threads": P processes of T threads, from summary.json).

    python benchmarks/threads.py --data-dir /path/to/cifar10                      # idle and loaded, 2 cycles
    python benchmarks/threads.py --data-dir D --conditions idle --workloads fedavg-cnn --cycles 1 --rounds 1
    python benchmarks/threads.py --data-dir D --thread-counts 2 4 8 --no-torchrun --dry     # print the runs' commands

Stop other work on the machine first (the idle rows assume it). Every number goes to --out as it is measured.
"""

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOADS = {
    "fedavg-mlp": "fedavg.py --model mlp --alpha 0.5 --num-clients 10 --frac 1 --local-steps 20",
    "fedavg-cnn": "fedavg.py --model cnn --iid --num-clients 100 --frac 0.1 --local-epochs 1 --batch-size 50 "
    "--lr 0.01 --momentum 0.5 --weight-decay 0 --augment none",
    "fedbabu-small": "fedbabu.py --model convnet4-tiny --num-clients 100 --shards 10 --frac 0.1 --local-epochs 10 "
    "--ft-epochs 0 --ft-eval-epochs",
    "fedfn-small": "fedfn.py --model convnet4-tiny --num-clients 100 --frac 0.1 --local-epochs 5 --shards 2 --lr 0.03",
    "fednnnn-small": "fednnnn.py --model cnn6-narrow --num-clients 100 --shards 2 --frac 0.1 --local-epochs 2 "
    "--batch-size 50 --lr 0.05 --momentum 0 --weight-decay 5e-4 --augment none --beta 0.6 --gamma 0.7",
}


CONDITIONS = ["idle", "loaded", "sweep"]


def cores():  # the CPUs this process may run on (under a container's CPU limit the scripts' default takes fewer)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def parse_args():
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--data-dir", required=True, help="CIFAR-10 image folder (train/<class>/*, test/<class>/*)")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS), help="a subset")
    p.add_argument("--conditions", nargs="+", default=CONDITIONS, choices=CONDITIONS, help="a subset")
    p.add_argument(
        "--load", type=int, default=cores(), help="busy processes (loaded), runs at once (sweep) [the cores]"
    )
    p.add_argument(
        "--envs",
        nargs="*",
        default=[],
        metavar="NAME=VALUE[,NAME=VALUE]",
        help="more ways: the default with these environment variables set",
    )
    p.add_argument("--thread-counts", type=int, nargs="+", help="N of the --threads N ways [the cores' powers of two]")
    p.add_argument("--no-torchrun", action="store_true", help="leave out the torchrun 2x1 way")
    p.add_argument("--rounds", type=int, default=3, help="R: rounds timed, after R warm-up rounds")
    p.add_argument("--cycles", type=int, default=2, help="interleaved repetitions of the ways")
    p.add_argument("--idle-statistic", default="min", choices=["min", "median"], help="over cycles, idle rows")
    p.add_argument("--run-timeout", type=float, default=900, help="seconds a run may take (then: timed out)")
    p.add_argument("--out", default=os.path.join("runs", "threads", "results.json"), help="JSON of every run")
    p.add_argument("--dry", action="store_true", help="print each run's command, run none")
    args = p.parse_args()
    if args.rounds < 1 or args.cycles < 1 or args.load < 1:
        p.error("--rounds, --cycles and --load must be at least 1")
    n = cores()
    args.thread_counts = args.thread_counts or [*[2**i for i in range(n.bit_length()) if 2**i < n], n]
    if min(args.thread_counts) < 1:
        p.error("--thread-counts must be at least 1")
    if not all("=" in pair for env in args.envs for pair in env.split(",")):
        p.error("--envs: each is NAME=VALUE, or several joined by commas")
    args.data_dir = os.path.abspath(args.data_dir)
    if not args.dry and not all(os.path.isdir(os.path.join(args.data_dir, split)) for split in ("train", "test")):
        p.error(f"--data-dir: {args.data_dir} is not an image folder with train/ and test/")
    return args


def command(args, workload, way, out):
    """The command line and environment of one run."""
    script, *flags = WORKLOADS[workload].split()
    flags += ["--dataset", "folder", "--data-dir", args.data_dir, "--device", "cpu", "--out", out]
    flags += [
        "--rounds",
        str(2 * args.rounds),
        "--eval-every",
        str(getattr(args, "eval_every", args.rounds)),  # R; a control can ask for every round
        "--checkpoint-every",
        str(2 * args.rounds),
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    if way.startswith("default "):
        env.update(pair.split("=", 1) for pair in way.split()[1].split(","))
    launcher = [sys.executable]
    if way.endswith("thread") or way.endswith("threads"):
        flags += ["--threads", way.split()[0]]
    elif way.startswith("torchrun"):
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    return [*launcher, os.path.join(ROOT, script), *flags], env


def start(args, workload, way, out):
    """One run started in the background, its output in out/log.txt."""
    cmd, env = command(args, workload, way, out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    log = open(f"{out}.log", "w")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)


def finish(args, proc, out):
    """Waits for a started run; (seconds a round, the threads a process used, final test accuracy)."""
    try:
        code = proc.wait(timeout=args.run_timeout)
    except subprocess.TimeoutExpired:
        # Oversubscribed threads can be tens of times slower: a row, not a stall.
        proc.kill()
        proc.wait()
        return None, None, None
    if code != 0:
        with open(f"{out}.log") as f:
            sys.exit(f"failed ({code}): {' '.join(proc.args)}\n{f.read()[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    with open(os.path.join(out, "config.json")) as f:
        threads = json.load(f).get("threads")
    after_warmup = next(row for row in rows if row["round"] == args.rounds)
    return (rows[-1]["elapsed_s"] - after_warmup["elapsed_s"]) / args.rounds, threads, rows[-1]["test_acc"]


def run_once(args, workload, way, out):
    """One run alone; (seconds a round, the threads a process used, final test accuracy)."""
    return finish(args, start(args, workload, way, out), out)


def run_sweep(args, workload, way, out):
    """args.load copies of one run started at once (a sweep); the median of their seconds a round, and each."""
    outs = [f"{out}-copy{i}" for i in range(args.load)]
    procs = [start(args, workload, way, o) for o in outs]
    done = [finish(args, p, o) for p, o in zip(procs, outs)]
    each = [sec for sec, _, _ in done]
    median = None if None in each else statistics.median(each)
    return median, done[0][1], done[0][2], each


def ways_of(args, cycle=1):  # every other cycle in reverse: over two cycles each way runs at the same mean place
    counts = [f"{n} thread{'s' * (n > 1)}" for n in getattr(args, "thread_counts", [1, 2])]
    torchrun = [] if getattr(args, "no_torchrun", False) else ["torchrun 2x1"]
    ways = ["default", *[f"default {env}" for env in args.envs], *counts, *torchrun]
    return ways if cycle % 2 else ways[::-1]


def table(runs, args):
    workloads, conditions = args.workloads, args.conditions
    ways = list(dict.fromkeys(r["way"] for r in runs))  # in the order measured
    picks = ["default"]
    head = "".join(f" | {way} picked" for way in picks) + " | default / best thread count | default / torchrun |"
    lines = ["| workload | condition | " + " | ".join(ways) + head, "|---|---|" + "---|" * (len(ways) + len(picks) + 2)]
    for w in workloads:
        for c in conditions:
            sel = {
                way: [r for r in runs if r["workload"] == w and r["condition"] == c and r["way"] == way] for way in ways
            }
            if not all(sel.values()):
                continue
            inf = float("inf")  # a timed-out run
            stat = min if c == "idle" and getattr(args, "idle_statistic", "median") == "min" else statistics.median
            secs = {way: stat(r["s_per_round"] or inf for r in rs) for way, rs in sel.items()}
            procs = sorted({r.get("processes") or 1 for r in sel["default"]})  # (a JSON measured before: none)
            times = f"{procs} x " * (procs != [1])
            picked = "".join(
                f" | {times}{sorted({r['threads'] for r in sel[way] if r['threads']})} threads" for way in picks
            )
            cells = [f"{secs[w_]:.2f}" if secs[w_] < inf else f"timed out ({args.run_timeout:.0f} s)" for w_ in ways]
            counts = [secs[way] for way in ways if way.endswith(("thread", "threads"))]  # over --thread-counts
            best = f"{secs['default'] / min(counts):.2f}" if counts else "-"  # "-": a way not measured
            torchrun = f"{secs['default'] / secs['torchrun 2x1']:.2f}" if "torchrun 2x1" in secs else "-"
            ratios = f"{best} | {torchrun}"
            lines.append(f"| {w} | {c} | " + " | ".join(cells) + f"{picked} | {ratios} |")
    return "\n".join(lines)


BOUNDS = {"idle": 1.1, "loaded": 1.5, "sweep": 1.3}


def bounds(runs, args):
    """The default against its yardstick: idle, the fastest one-process way; loaded and sweep, one thread."""
    ways = list(dict.fromkeys(r["way"] for r in runs))
    lines = ["| workload | condition | " + " | ".join(ways) + " | default / yardstick | bound |"]
    lines.append("|---|---|" + "---|" * (len(ways) + 2))
    for w in args.workloads:
        for c in args.conditions:
            sel = {
                way: [
                    r["s_per_round"] or math.inf
                    for r in runs
                    if (r["workload"], r["condition"], r["way"]) == (w, c, way)
                ]
                for way in ways
            }
            if not all(sel.values()):
                continue
            stat = min if c == "idle" else statistics.median
            secs = {way: stat(s) for way, s in sel.items()}
            if c == "idle":
                yardstick = min(s for way, s in secs.items() if not way.startswith("torchrun"))
            else:
                yardstick = secs["1 thread"]
            ratio = secs["default"] / yardstick
            cells = " | ".join(f"{s:.2f}" for s in secs.values())
            verdict = "met" if ratio <= BOUNDS[c] else "missed"
            lines.append(f"| {w} | {c} | {cells} | {ratio:.2f} | {BOUNDS[c]}x: {verdict} |")
    return "\n".join(lines)


if __name__ == "__main__":
    args = parse_args()
    if args.dry:
        print(f"# {args.cycles} cycles of {args.conditions}, each these runs (every other cycle in reverse)")
        for workload in args.workloads:
            for way in ways_of(args):
                cmd, env = command(args, workload, way, os.path.join("TMP", f"{workload}-{way.replace(' ', '-')}"))
                changed = [f"{k}={v}" for k, v in env.items() if os.environ.get(k) != v]
                print(shlex.join([*changed, os.path.basename(cmd[0]), *cmd[1:]]))
        sys.exit(0)
    if os.path.exists(args.out):  # never over an earlier measurement
        print(f"threads.py: error: --out: {args.out} exists; name a new file", file=sys.stderr)
        sys.exit(2)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for condition in args.conditions:
            busy = []
            if condition == "loaded":
                busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
            try:
                for cycle in range(1, args.cycles + 1):
                    for workload in args.workloads:
                        for way in ways_of(args, cycle):
                            load = os.getloadavg()[0]
                            out = os.path.join(tmp, f"{condition}-{cycle}-{workload}-{ways_of(args).index(way)}")
                            if condition == "sweep":
                                sec, threads, acc, each = run_sweep(args, workload, way, out)
                            else:
                                (sec, threads, acc), each = run_once(args, workload, way, out), None
                            row = dict(condition=condition, cycle=cycle, workload=workload, way=way, s_per_round=sec)
                            # A run timed out: no summary.json.
                            summary = os.path.join(out if each is None else f"{out}-copy0", "summary.json")
                            processes = json.load(open(summary)).get("processes") if os.path.exists(summary) else None
                            row.update(threads=threads, processes=processes, test_acc=acc, loadavg_before=load)
                            if each is not None:
                                row["each"] = each
                            runs.append(row)
                            said = f"{sec:.2f} s/round, threads {threads}, acc {acc:.4f}" if sec else "timed out"
                            print(f"{condition} {cycle} {workload} {way}: {said}, load before {load:.2f}", flush=True)
                            saved = {"args": vars(args), "cpu_count": os.cpu_count(), "cores": cores(), "runs": runs}
                            with open(args.out + ".part", "w") as f:  # then renamed: a stop mid-write leaves the last
                                json.dump(saved, f, indent=1)
                            os.replace(args.out + ".part", args.out)
            finally:
                for proc in busy:
                    proc.terminate()
                    proc.wait()
    print(
        f"\n{cores()} cores; s/round: over {args.cycles} cycles ({args.idle_statistic} idle, median loaded) of "
        f"rounds {args.rounds + 1}-{2 * args.rounds} (one test-set evaluation in each R)"
    )
    print(table(runs, args))
    print()
    print(bounds(runs, args))

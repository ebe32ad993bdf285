"""Estimate the CPU time of a reproduction config by timing one round of each of its commands.

For every command a claim script prints with DRY_RUN=1 (first seed only), run it once with
`--rounds 2 --eval-every 2` on one thread (OMP_NUM_THREADS=1) and measure process CPU time in
phases: before the round loop (imports, data from the cache, partition, models), round 1 (with its
one-time warm-up), round 2 (the steady state, timed alone), the one test evaluation (after round 2),
and after the loop (FedBABU's personalization, summary). Then scale:

    estimate = before + round1 + (R - 1) * round2 + E * evaluation + after,   E = evaluations in R rounds

with R and --eval-every read from the command by the method script's own parser. CPU time, not
wall time: on a shared machine wall time depends on the load; on an idle core the two agree.

    DATA_DIR=/path/to/cifar10 python benchmarks/estimate_cpu.py fedfn [small]   # one claim script
    DATA_DIR=/path/to/cifar10 python benchmarks/estimate_cpu.py all small       # all five
Runs go to a temporary folder and are deleted. Standard library only (the runs need torch).
"""

import importlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLAIM_SCRIPTS = ["fedfn", "fedbabu", "fedln", "fednnnn", "anfr"]

# Runs inside the child: wrap common.load_data / evaluate / personalize and the rounds that common.Run.rounds
# yields with CPU-time counters, run the method script as __main__, write the counters as JSON.
CHILD = r"""
import json, os, runpy, sys, time
import common
clock = time.process_time
T = {"load_data": 0.0, "eval": 0.0, "eval_calls": 0, "personalize": 0.0,
     "loop_start": None, "loop_end": None, "iters": []}
depth = {"personalize": 0}
def timed(fn, key):
    def wrapper(*a, **k):
        if key == "eval" and depth["personalize"]:
            return fn(*a, **k)
        if key == "personalize":
            depth["personalize"] += 1
        t = clock()
        try:
            return fn(*a, **k)
        finally:
            T[key] += clock() - t
            if key == "eval":
                T["eval_calls"] += 1
            if key == "personalize":
                depth["personalize"] -= 1
    return wrapper
common.load_data = timed(common.load_data, "load_data")
common.evaluate = timed(common.evaluate, "eval")  # eval_metrics calls it by its global name
common.personalize = timed(common.personalize, "personalize")
rounds = common.Run.rounds
def timed_rounds(self, state):  # the script's `for rnd in run.rounds(state)`: the start of each round, the end
    T["loop_start"] = clock()
    for rnd in rounds(self, state):  # its bar, and each round's checkpoint, are inside
        T["iters"].append(clock())
        yield rnd
    T["loop_end"] = clock()
common.Run.rounds = timed_rounds
out, script = sys.argv[1], sys.argv[2]
sys.argv = sys.argv[2:]
wall = time.perf_counter()
try:
    runpy.run_path(script, run_name="__main__")
finally:
    T["total"] = clock()
    T["wall_run"] = time.perf_counter() - wall
    with open(out, "w") as f:
        json.dump(T, f)
"""


def dry_run(claim, scale):
    env = {**os.environ, "DRY_RUN": "1", "SEEDS": "0"}
    res = subprocess.run(
        ["bash", os.path.join(ROOT, "benchmarks", "reproduce", f"{claim}.sh"), scale],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return [shlex.split(line) for line in res.stdout.splitlines() if line.startswith("python ")]


def parse(argv):
    """The method script's parse_args() on argv (its own defaults and checks)."""
    script = argv[1]
    sys.path.insert(0, ROOT)
    module = importlib.import_module(os.path.splitext(script)[0])
    saved = sys.argv
    sys.argv = [script, *argv[2:]]
    try:
        return module.parse_args()
    finally:
        sys.argv = saved


def variant_of(argv):
    out = argv[argv.index("--out") + 1]
    parts = out.split(os.sep)
    return parts[-3], parts[-2]  # claim-scale, variant


def time_one(argv, data_dir):
    argv = [a if a != "$DATA_DIR" else data_dir for a in argv]
    args = parse(argv)
    rounds, every = args.rounds, args.eval_every
    with tempfile.TemporaryDirectory() as tmp:
        stats = os.path.join(tmp, "stats.json")
        cmd = [
            sys.executable,
            "-c",
            CHILD,
            stats,
            *argv[1:],
            "--rounds",
            "2",
            "--eval-every",
            "2",
            "--out",
            os.path.join(tmp, "run"),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        t = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wall = time.perf_counter() - t
        with open(stats) as f:
            T = json.load(f)
    before = T["loop_start"]
    in_loop_eval = T["eval"]  # --rounds 2 --eval-every 2: the one evaluation is at the end of round 2
    round1 = T["iters"][1] - T["iters"][0]
    round2 = T["loop_end"] - T["iters"][1] - in_loop_eval
    after = T["total"] - T["loop_end"]
    evals = rounds // every + (1 if rounds % every else 0)
    estimate = before + round1 + (rounds - 1) * round2 + evals * in_loop_eval + after
    return {
        "rounds": rounds,
        "evals": evals,
        "before": before,
        "round1": round1,
        "round": round2,
        "eval": in_loop_eval,
        "after": after,
        "estimate": estimate,
        "wall_run": wall,
    }


def main():
    claims = sys.argv[1:2] or ["all"]
    scale = sys.argv[2] if len(sys.argv) > 2 else "small"
    claims = CLAIM_SCRIPTS if claims == ["all"] else claims
    data_dir = os.environ.get("DATA_DIR")
    if not data_dir:
        sys.exit("set DATA_DIR to the unpacked CIFAR-10 image folder")
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    print(f"one thread per run; {os.cpu_count()} CPUs, load average {load:.1f} at start; seconds of CPU time\n")
    print(
        "| claim | variant | R | evals | before loop | round 1 | round 2 | 1 eval | after loop | estimate (min) "
        "| wall of the 2-round run (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for claim in claims:
        for argv in dry_run(claim, scale):
            c, v = variant_of(argv)
            r = time_one(argv, data_dir)
            print(
                f"| {c} | {v} | {r['rounds']} | {r['evals']} | {r['before']:.1f} | {r['round1']:.2f} "
                f"| {r['round']:.2f} | "
                f"{r['eval']:.2f} | {r['after']:.1f} | {r['estimate'] / 60:.1f} | {r['wall_run']:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()

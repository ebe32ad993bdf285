"""Speed-up of `torchrun --nproc_per_node K` over one process, for one method script.

Runs the same command (default: fedavg.py, 100 clients of the McMahan CNN, 10 per round, one local
epoch each) three ways and reports the time per round:
  alone, all threads   python SCRIPT ...             OMP_NUM_THREADS = --threads (the fair baseline)
  alone, 1 thread      python SCRIPT ...             OMP_NUM_THREADS = 1
  torchrun K           torchrun --nproc_per_node K   OMP_NUM_THREADS = 1 per rank
Each run evaluates after round R and after round 2R; the time per round is the difference of the two
rows' elapsed_s divided by R (so data loading, process start-up and the first round's warm-up are
left out; one evaluation of the test set, which every rank does, is in). It also checks that the runs
end with the same test accuracy (they are the same run).

    python benchmarks/torchrun_speed.py --data-dir /path/to/cifar10 --device cpu --nproc 2 --threads 2
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--script", default="fedavg", help="method script (fedavg, fedbabu, fedfn, fedln, fednnnn, anfr)")
    p.add_argument("--data-dir", required=True, help="CIFAR-10 image folder (train/<class>/*, test/<class>/*)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (torchrun gives rank r the GPU cuda:r)")
    p.add_argument("--nproc", type=int, default=2, help="K: processes under torchrun")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of the one-process baseline")
    p.add_argument("--rounds", type=int, default=3, help="R: rounds timed (after R warm-up rounds)")
    p.add_argument(
        "--flags",
        nargs=argparse.REMAINDER,
        default=["--model", "cnn", "--num-clients", "100", "--frac", "0.1", "--local-epochs", "1", "--shards", "2"],
        help="the script's flags (default: fedavg's CNN setting)",
    )
    return p.parse_args()


def timed_run(cmd, threads, out):
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run(cmd + ["--out", out], cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows


if __name__ == "__main__":
    args = parse_args()
    run = [
        f"{args.script}.py",
        "--dataset",
        "folder",
        "--data-dir",
        args.data_dir,
        "--device",
        args.device,
        *args.flags,
        "--rounds",
        str(2 * args.rounds),
        "--eval-every",
        str(args.rounds),
    ]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc)]
    ways = [
        (f"alone, {args.threads} threads", [sys.executable, *run], args.threads),
        ("alone, 1 thread", [sys.executable, *run], 1),
        (f"torchrun, {args.nproc} processes x 1 thread", [*torchrun, *run], 1),
    ]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, cmd, threads) in enumerate(ways):
            rows = timed_run(cmd, threads, os.path.join(tmp, str(i)))
            per_round = (rows[-1]["elapsed_s"] - rows[0]["elapsed_s"]) / args.rounds
            results.append((name, per_round, rows[-1]["test_acc"]))
    base = results[0][1]
    print(
        f"{args.script}.py {' '.join(args.flags)} "
        f"(device {args.device}; {2 * args.rounds} rounds, the last {args.rounds} timed)"
    )
    print("| way | s / round | speed-up vs the first row | final test acc |")
    print("|---|---|---|---|")
    for name, per_round, acc in results:
        print(f"| {name} | {per_round:.2f} | {base / per_round:.2f}x | {acc:.4f} |")
    if len({acc for _, _, acc in results[1:]}) != 1:
        print("note: the one-thread and torchrun runs should end with the same accuracy; they did not")

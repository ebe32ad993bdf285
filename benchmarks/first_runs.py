"""The README's first run and each docs page's one-minute run, as a user runs them, idle and beside busy processes.

    python benchmarks/first_runs.py --data-dir /path/to/cifar10 --out benchmarks/results-cpu/first-runs.json

Each command is taken from the text itself: the README's first `python fedavg.py` line of its quick start, and the
`python <script>.py ...` line after `--help` in each page's Usage block. Its `--dataset cifar10 --data-dir ./data`
becomes `--dataset folder --data-dir DIR` (a CIFAR-10 image folder: the machine may have no internet), and `--out`
a folder of its own. Each runs at the scripts' default (no --threads, no OMP_NUM_THREADS) once idle, then once
beside --load busy processes (`while True: pass`; default one a core), in alternating order; the wall time is from
the command's start to its end (start-up, data loading and every evaluation in). The JSON holds each run's wall
time, final test accuracy (and fedbabu.py's accuracies before and after fine-tuning), threads and processes.
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["fedbabu", "fedfn", "fedln", "fednnnn", "anfr"]
# The README's first run, and the same under torchrun (its quick start's last line).
README = ["readme", "readme-torchrun"]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", required=True, help="CIFAR-10 image folder (train/<class>/*, test/<class>/*)")
    p.add_argument("--load", type=int, default=os.cpu_count(), help="busy processes of the loaded runs")
    p.add_argument("--pages", nargs="+", default=[*README, *PAGES], help="a subset: the README's and the pages'")
    p.add_argument("--out", required=True, help="JSON of every run (a new file)")
    args = p.parse_args()
    if not all(os.path.isdir(os.path.join(args.data_dir, split)) for split in ("train", "test")):
        p.error(f"--data-dir: {args.data_dir} is not an image folder with train/ and test/")
    if args.load < 1:
        p.error("--load: must be at least 1")
    unknown = [page for page in args.pages if page not in (*README, *PAGES)]
    if unknown:
        p.error(f"--pages: unknown {unknown}")
    if os.path.exists(args.out):
        p.error(f"--out: {args.out} exists; name a new file")
    return args


def documented_command(page):
    """The command a page gives for its first run, as written."""
    if page in README:
        text = open(os.path.join(ROOT, "README.md")).read()
        quick = text.split("## Quick start", 1)[1]
        start = "torchrun " if page == "readme-torchrun" else "python fedavg.py"
        return next(line for line in quick.splitlines() if line.startswith(start))
    text = open(os.path.join(ROOT, "docs", f"{page}.md")).read()
    usage = text.split("## Usage", 1)[1].split("```", 2)[1]
    return next(line for line in usage.splitlines() if line.startswith("python ") and "--help" not in line)


def as_run(command, data_dir, out):
    """The documented command on the image folder, into out."""
    words = shlex.split(command.split("#")[0])
    script = next(i for i, word in enumerate(words) if word.endswith(".py"))
    flags = words[script + 1 :]
    for flag in ("--dataset", "--data-dir", "--out"):
        if flag in flags:
            at = flags.index(flag)
            del flags[at : at + 2]
    if words[0] == "torchrun":
        launcher = [sys.executable, "-m", "torch.distributed.run", *words[1:script]]
    else:
        launcher = [sys.executable]
    return [*launcher, words[script], *flags, "--dataset", "folder", "--data-dir", data_dir, "--out", out]


def run(cmd, out):
    """Runs cmd at the scripts' default threads; (seconds from start to end, its summary.json, config.json)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "GOMP_SPINCOUNT")}
    began = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - began
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {shlex.join(cmd)}\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    return seconds, summary, config


def main():
    args = parse_args()
    runs = []
    # Each command once before the timings: the folder's cache is made, the files are in the page cache.
    with tempfile.TemporaryDirectory() as tmp:
        order = [(page, condition) for page in args.pages for condition in ("idle", "loaded")]
        for i, (page, condition) in enumerate(order):
            # Alternating: idle first for every other page.
            if (i // 2) % 2:
                condition = "loaded" if condition == "idle" else "idle"
            busy = []
            if condition == "loaded":
                busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
            try:
                out = os.path.join(tmp, f"{page}-{condition}")
                command = documented_command(page)
                seconds, summary, config = run(as_run(command, args.data_dir, out), out)
            finally:
                for proc in busy:
                    proc.terminate()
                    proc.wait()
            row = {"page": page, "condition": condition, "command": command, "wall_s": round(seconds, 1)}
            row.update(test_acc=summary["test_acc"], processes=summary["processes"], threads=config["threads"])
            row["device"] = summary["device"]
            for key in ("init_acc_mean", "pers_acc_mean"):
                if key in summary:
                    row[key] = summary[key]
            runs.append(row)
            print(f"{page} {condition}: {row['wall_s']} s, test acc {row['test_acc']:.4f}", flush=True)
            measured = f"{time.strftime('%Y-%m-%d')}, {row['device']}"
            with open(args.out + ".part", "w") as f:
                json.dump({"measured": measured, "data_dir": args.data_dir, "runs": runs}, f, indent=1)
            os.replace(args.out + ".part", args.out)


if __name__ == "__main__":
    main()

"""FL overhead of every method script: its round loop versus a centralized run of the same SGD steps.

Each script runs twice, as a subprocess, with the same device, data, model, batch size, optimizer,
augmentation and method flags:
  FL           N clients (IID), m = C*N of them per round, K local steps each, 2R rounds
  centralized  one client holding all the data, 2 rounds of R*m*K local steps each
Both evaluate after their first and last round only (--eval-every R, resp. 1) and never checkpoint in
between. metrics.jsonl stamps each evaluation with elapsed_s, so the time between the two rows is R
federated rounds, resp. one centralized pass over the same R*m*K steps, plus one test-set evaluation
each (the first half of each run is the warm-up: allocator, cudnn autotuning, caches). The ratio
FL / centralized is what federation adds: loading the global state into the one client model, a
fresh optimizer per client, the weighted sums and the method's own server step (FedNNNN's
normalization and momentum, FedBABU's frozen head, ...). The one evaluation on each side pulls the
ratio slightly towards 1 (on the synthetic data's 1,000 test images it is a small part of the time).

    python benchmarks/overhead.py --dataset folder --data-dir /path/to/cifar10 --device cpu
    python benchmarks/overhead.py --dataset folder --data-dir /path/to/cifar10 --device cuda --scripts fedavg fedfn
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# Per script: the model flags (small models, so the CPU numbers take minutes; the model and any
# method flag can be changed with --model-flags) and flags that switch off work after the loop.
SCRIPTS = {
    "fedavg": ["--model", "cnn"],
    "fedbabu": ["--model", "convnet4-tiny", "--no-client-test"],  # no per-client fine-tuning after the loop
    "fedfn": ["--model", "cnn"],
    "fedln": ["--model", "normcnn", "--width", "16", "--norm", "ln"],
    "fednnnn": ["--model", "convnet4-tiny"],
    "anfr": ["--depth", "18", "--width", "8", "--arch", "anfr"],
}


def device_name(device):
    """The device as a run's summary.json names it (common.Run.device): the GPU's name, or the CPU with its cores
    and this process's torch threads (the runs, started with this environment, use as many)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    cpu = platform.processor() or platform.machine()
    return f"cpu ({cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scripts", nargs="+", default=list(SCRIPTS), choices=list(SCRIPTS), help="method scripts to time")
    p.add_argument("--dataset", default="synthetic", help="as in the scripts (folder needs --data-dir)")
    p.add_argument("--data-dir", default="./data", help="as in the scripts")
    p.add_argument("--num-clients", type=int, default=100, help="N")
    p.add_argument("--frac", type=float, default=0.1, help="C: fraction of clients per round (m = C*N)")
    p.add_argument("--local-steps", type=int, default=10, help="K: local SGD steps per client and round")
    p.add_argument("--batch-size", type=int, default=50, help="B")
    p.add_argument("--rounds", type=int, default=2, help="R: timed FL rounds (after R warm-up rounds)")
    p.add_argument("--repeats", type=int, default=3, help="FL and centralized timings, alternated, this many times")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    p.add_argument("--amp", action="store_true", help="bfloat16 autocast in both runs")
    p.add_argument(
        "--model-flags", default=None, help='replace the per-script model flags of SCRIPTS, e.g. "--model vgg11"'
    )
    args = p.parse_args()
    if args.rounds < 1 or args.repeats < 1 or args.local_steps < 1:
        p.error("--rounds, --repeats and --local-steps must be at least 1")
    return args


def between_evaluations(script, flags, out, shortest=False):
    """Run `script` with `flags`; seconds between its first and last evaluation rows of metrics.jsonl, or
    with `shortest` the shortest gap between two consecutive ones (a pause of the machine lengthens one gap)."""
    cmd = [
        str(a)
        for a in [sys.executable, os.path.join(ROOT, f"{script}.py"), *flags, "--checkpoint-every", 10**9, "--out", out]
    ]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"{script}.py failed ({res.returncode}):\n{' '.join(cmd)}\n{res.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return seconds_between_evaluations([json.loads(line) for line in f], shortest)


def seconds_between_evaluations(rows, shortest=False):
    """elapsed_s of the last evaluation row minus the first one, or the shortest gap between two consecutive ones
    (rows without test_acc, such as fednnnn.py's per-round norm rows, are not evaluations)."""
    times = [r["elapsed_s"] for r in rows if "test_acc" in r]
    return min(b - a for a, b in zip(times, times[1:])) if shortest else times[-1] - times[0]


def run_flags(script, args):
    """(FL flags, centralized flags, SGD steps per timing) of `script`: the same work on both sides."""
    steps = args.rounds * max(int(args.frac * args.num_clients), 1) * args.local_steps  # R * m * K
    base = [
        "--dataset",
        args.dataset,
        "--data-dir",
        args.data_dir,
        "--device",
        args.device,
        "--iid",
        "--batch-size",
        args.batch_size,
        "--seed",
        0,
        *(["--amp"] if args.amp else []),
        *(args.model_flags.split() if args.model_flags else SCRIPTS[script]),
    ]
    fl_flags = [
        *base,
        "--num-clients",
        args.num_clients,
        "--frac",
        args.frac,
        "--local-steps",
        args.local_steps,
        "--rounds",
        2 * args.rounds,
        "--eval-every",
        args.rounds,
    ]
    central_flags = [*base, "--num-clients", 1, "--frac", 1, "--local-steps", steps, "--rounds", 2, "--eval-every", 1]
    return fl_flags, central_flags, steps


def time_script(script, args, tmp):
    """FL seconds, centralized seconds (args.repeats alternated pairs) and SGD steps per timing."""
    fl_flags, central_flags, steps = run_flags(script, args)
    fl, central = [], []
    for i in range(args.repeats):
        fl.append(between_evaluations(script, fl_flags, os.path.join(tmp, f"{script}-fl-{i}")))
        central.append(between_evaluations(script, central_flags, os.path.join(tmp, f"{script}-central-{i}")))
    return fl, central, steps


if __name__ == "__main__":
    args = parse_args()
    m = max(int(args.frac * args.num_clients), 1)
    print(
        f"device {device_name(args.device)}, torch {torch.__version__}, {args.dataset}, B={args.batch_size}, "
        f"{args.rounds} rounds x {m} clients x {args.local_steps} steps per timing, {args.repeats} repeats"
    )
    print("| script | model flags | SGD steps per timing | FL (s) | centralized (s) | FL / centralized, median (all) |")
    print("| --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for script in args.scripts:
            fl, central, steps = time_script(script, args, tmp)
            ratios = [a / b for a, b in zip(fl, central)]
            flags = args.model_flags or " ".join(SCRIPTS[script])
            print(
                f"| {script}.py | `{flags}` | {steps} | {np.median(fl):.2f} | {np.median(central):.2f} | "
                f"**{np.median(ratios):.2f}** ({', '.join(f'{r:.2f}' for r in ratios)}) |",
                flush=True,
            )

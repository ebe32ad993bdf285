"""Where a round's time goes in one process: forward, backward and the optimizer's step against all the rest.

    python benchmarks/profile_round.py --data-dir /path/to/cifar10 -- --threads 1
    python benchmarks/profile_round.py --data-dir D --rounds 3 --out profile.json -- --threads 2

It runs fedavg.py in this process on pfl-research's CIFAR-10 benchmark workload (IID clients of 50 images, 50
clients a round, one local epoch of batch 10, SGD lr 0.1 without momentum, uniform weights, no augmentation; the
model pfl-cnn) and times, with a wall clock around each call, the pieces of every round after the first: the
SGD work (the model's forward pass in training, backward, the optimizer's step), the per-client overhead that the
loop adds around it (rebuilding the optimizer, load_state_dict, state_dict, the weighted sums and the average,
reseeding, drawing the batches, indexing and normalizing them) and the test-set evaluation. "Other" is the round's
time less all of these: the loop's own Python. Flags after `--` go to fedavg.py (e.g. --threads 1).
"""

import argparse
import collections
import json
import os
import runpy
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOAD = [
    "--model",
    "pfl-cnn",
    "--iid",
    "--num-clients",
    "1000",
    "--frac",
    "0.05",
    "--local-epochs",
    "1",
    "--batch-size",
    "10",
    "--lr",
    "0.1",
    "--momentum",
    "0",
    "--weight-decay",
    "0",
    "--augment",
    "none",
    "--weighting",
    "uniform",
]
# The SGD work, then the overhead around it, then the evaluation.
WORK = ("forward", "backward", "optimizer step")
OVERHEAD = (
    "load_state_dict",
    "state_dict",
    "optimizer built",
    "accumulate",
    "load_average",
    "seeding",
    "batches drawn",
    "prepare_batch",
    "batch indexing",
)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", required=True, help="CIFAR-10 image folder (train/<class>/*, test/<class>/*)")
    p.add_argument("--rounds", type=int, default=3, help="rounds timed, after one round of warm-up")
    p.add_argument("--out", help="JSON of the seconds of each piece (a new file)")
    p.add_argument("script_flags", nargs="*", help="after --: more flags for fedavg.py")
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds: must be at least 1")
    if not all(os.path.isdir(os.path.join(args.data_dir, split)) for split in ("train", "test")):
        p.error(f"--data-dir: {args.data_dir} is not an image folder with train/ and test/")
    if args.out and os.path.exists(args.out):
        p.error(f"--out: {args.out} exists; name a new file")
    return args


class Clock:
    """Seconds spent in each named piece, counted only in timed rounds and outside evaluation (but 'evaluation')."""

    def __init__(self):
        self.seconds = collections.defaultdict(float)
        self.depth = collections.defaultdict(int)
        self.on = False
        self.in_eval = False

    def wrap(self, name, fn):
        """fn, timed as `name` (not again inside itself)."""

        def timed(*a, **k):
            if not self.on or (self.in_eval and name != "evaluation") or self.depth[name]:
                return fn(*a, **k)
            self.depth[name] += 1
            began = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds[name] += time.perf_counter() - began
                self.depth[name] -= 1

        return timed

    def wrap_generator(self, name, fn):
        """A generator function whose steps (not its consumer's work) are timed as `name`."""

        def timed(*a, **k):
            items = fn(*a, **k)
            while True:
                began = time.perf_counter()
                try:
                    item = next(items)
                except StopIteration:
                    return
                finally:
                    if self.on and not self.in_eval:
                        self.seconds[name] += time.perf_counter() - began
                yield item

        return timed


def instrument(clock):
    """Wraps the pieces in torch and common.py before fedavg.py imports them."""
    import torch

    import common

    def evaluation(fn):
        def timed(*a, **k):
            clock.in_eval = True
            try:
                return clock.wrap("evaluation", fn)(*a, **k)
            finally:
                clock.in_eval = False

        return timed

    common.Classifier.forward = clock.wrap("forward", common.Classifier.forward)
    torch.Tensor.backward = clock.wrap("backward", torch.Tensor.backward)
    torch.optim.SGD.step = clock.wrap("optimizer step", torch.optim.SGD.step)
    torch.optim.SGD.__init__ = clock.wrap("optimizer built", torch.optim.SGD.__init__)
    torch.nn.Module.load_state_dict = clock.wrap("load_state_dict", torch.nn.Module.load_state_dict)
    torch.nn.Module.state_dict = clock.wrap("state_dict", torch.nn.Module.state_dict)
    common.accumulate = clock.wrap("accumulate", common.accumulate)
    common.load_average = clock.wrap("load_average", common.load_average)
    common.client_seed = clock.wrap("seeding", common.client_seed)
    torch.manual_seed = clock.wrap("seeding", torch.manual_seed)
    common.client_batches = clock.wrap_generator("batches drawn", common.client_batches)
    common.prepare_batch = clock.wrap("prepare_batch", common.prepare_batch)
    torch.Tensor.__getitem__ = clock.wrap("batch indexing", torch.Tensor.__getitem__)
    common.eval_metrics = evaluation(common.eval_metrics)
    return common


def table(saved):
    """The markdown of a profile: seconds a round of each piece and its share of the round, then the share of the
    round, and of its training, outside forward, backward and the step."""
    times, seconds = saved["rounds"], saved["seconds"]
    rounds, total = len(times), sum(times)
    named = sum(seconds.values())
    rows = [(name, seconds.get(name, 0.0)) for name in (*WORK, *OVERHEAD, "evaluation")]
    rows.append(("other (the loop's own Python)", total - named))
    lines = [f"{rounds} rounds, {total / rounds:.3f} s a round", "", "| piece | s/round | share |", "|---|---|---|"]
    for name, value in rows:
        lines.append(f"| {name} | {value / rounds:.4f} | {value / total:.1%} |")
    work = sum(seconds.get(name, 0.0) for name in WORK)
    training = total - seconds.get("evaluation", 0.0)
    overhead = training - work
    lines.append("")
    lines.append(
        f"Outside forward, backward and the step: {overhead / total:.1%} of the round, {overhead / training:.1%} "
        "of its training (the round less its evaluation)."
    )
    return "\n".join(lines)


def main():
    args = parse_args()
    sys.path.insert(0, ROOT)
    clock = Clock()
    common = instrument(clock)
    round_times = []
    real_bar = common.Run.bar

    def timed_bar(run, rounds):
        # Each round's wall time; the first is warm-up.
        for rnd in real_bar(run, rounds):
            clock.on = rnd > 0
            began = time.perf_counter()
            yield rnd
            if rnd > 0:
                round_times.append(time.perf_counter() - began)

    common.Run.bar = timed_bar
    with tempfile.TemporaryDirectory() as tmp:
        flags = [*WORKLOAD, "--dataset", "folder", "--data-dir", args.data_dir, "--device", "cpu"]
        flags += ["--rounds", str(args.rounds + 1), "--out", os.path.join(tmp, "run"), *args.script_flags]
        sys.argv = [os.path.join(ROOT, "fedavg.py"), *flags]
        try:
            runpy.run_path(sys.argv[0], run_name="__main__")
        except SystemExit as e:
            if e.code:
                raise
    saved = {"args": vars(args), "rounds": round_times, "seconds": dict(clock.seconds)}
    print(table(saved))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(saved, f, indent=1)


if __name__ == "__main__":
    main()

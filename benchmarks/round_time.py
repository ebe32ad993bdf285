"""Seconds per FedAvg round and per full test-set evaluation, for several models, with and without --amp.

The GPU speed target setting: CIFAR-10, N=100 clients, f=0.1, E=5, B=50 (fedavg.py's defaults
otherwise). fedavg.py runs the models of common.py; a model that fedfn.py registers (vgg11, vgg11-narrow) runs as
fedfn.py --no-fn, FedAvg on FedFN's code path, with fedavg.py's partition, lr, weight decay and augmentation
written out (script_for). For each model and precision the script runs twice:
  run A: 3R rounds, evaluated every R rounds  -> each gap between rows is R rounds + 1 evaluation
  run B: 4 rounds, evaluated every round      -> each gap is 1 round + 1 evaluation
so a round takes (A - B) / (R - 1) and an evaluation B - round, with A and B each the shortest of its gaps (a
busy moment of the machine lengthens one gap, not all; rounds before the first row are the warm-up).
Targets on an H100: VGG11 1.5 s, ResNet-18 3 s, CNN 0.5 s per round.

    python benchmarks/round_time.py --dataset folder --data-dir /path/to/cifar10 --device cuda
    python benchmarks/round_time.py --models cnn --device cpu --local-epochs 1     # a CPU smoke run
"""

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import between_evaluations, device_name  # noqa: E402  (puts the repository root on sys.path)

# Pairs of runs before a noisy estimate is refused.
ATTEMPTS = 3


def script_for(model):
    """(script, flags) that run FedAvg with `model` in fedavg.py's setting, or None for a model of neither
    fedavg.py (common.py's models) nor fedfn.py (its own, e.g. vgg11: run as fedfn.py --no-fn)."""
    import common
    import fedavg
    import fedfn  # noqa: F401  (registers its models into common.MODELS)

    builder = common.MODELS.get(model)
    code = getattr(builder, "func", builder).__code__ if builder else None  # a functools.partial: its func's
    where = os.path.splitext(os.path.basename(code.co_filename))[0] if code else None  # the file, whatever the module
    if where == "common":
        return "fedavg", []
    if where != "fedfn":
        return None
    paper = fedavg.PAPER  # fedavg.py's partition, lr, weight decay and augmentation, where fedfn.py's differ
    return "fedfn", ["--no-fn", "--shards", paper["shards"], "--lr", paper["lr"],
                     "--weight-decay", paper["weight_decay"], "--augment", paper["augment"]]  # fmt: skip


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--models", nargs="+", default=["vgg11", "resnet18", "cnn"], help="--model values (fedfn.py's: see script_for)"
    )
    p.add_argument(
        "--precisions",
        nargs="+",
        default=["fp32", "amp"],
        choices=["fp32", "amp"],
        help="amp = --amp (bfloat16 autocast)",
    )
    p.add_argument("--dataset", default="folder", help="as in fedavg.py")
    p.add_argument("--data-dir", default="./data", help="as in fedavg.py")
    p.add_argument("--num-clients", type=int, default=100, help="N")
    p.add_argument("--frac", type=float, default=0.1, help="f: fraction of clients per round")
    p.add_argument("--local-epochs", type=int, default=5, help="E")
    p.add_argument("--batch-size", type=int, default=50, help="B")
    p.add_argument("--rounds", type=int, default=3, help="R: rounds between the rows of run A (at least 2)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    args = p.parse_args()
    if args.rounds < 2:
        p.error("--rounds must be at least 2 (the round time is the difference of R rounds and 1 round)")
    unknown = [m for m in args.models if script_for(m) is None]
    if unknown:
        p.error(f"--models: {', '.join(unknown)}: neither fedavg.py's models nor fedfn.py's")
    return args


if __name__ == "__main__":
    args = parse_args()
    print(
        f"device {device_name(args.device)}, torch {torch.__version__}, {args.dataset}, "
        f"N={args.num_clients}, f={args.frac}, "
        f"E={args.local_epochs}, B={args.batch_size}"
    )
    scripts = {m: script_for(m) for m in args.models}
    for m, (script, extra) in scripts.items():
        if script != "fedavg":
            print(f"{m}: {script}.py {' '.join(map(str, extra))} (FedAvg on {script}.py's code path)")
    print("| model | precision | s / round | s / evaluation |")
    print("| --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            for precision in args.precisions:
                script, extra = scripts[model]
                base = [
                    *extra,
                    "--dataset",
                    args.dataset,
                    "--data-dir",
                    args.data_dir,
                    "--device",
                    args.device,
                    "--model",
                    model,
                    "--num-clients",
                    args.num_clients,
                    "--frac",
                    args.frac,
                    "--local-epochs",
                    args.local_epochs,
                    "--batch-size",
                    args.batch_size,
                    "--seed",
                    0,
                    *(["--amp"] if precision == "amp" else []),
                ]
                # On a busy machine the noise of one pair of runs can exceed R - 1 rounds: the pair is run again,
                # up to ATTEMPTS times.
                for attempt in range(ATTEMPTS):
                    a = between_evaluations(
                        script,
                        [*base, "--rounds", 3 * args.rounds, "--eval-every", args.rounds],
                        os.path.join(tmp, f"{model}-{precision}-a{attempt}"),
                        shortest=True,
                    )
                    b = between_evaluations(
                        script,
                        [*base, "--rounds", 4, "--eval-every", 1],
                        os.path.join(tmp, f"{model}-{precision}-b{attempt}"),
                        shortest=True,
                    )
                    per_round = (a - b) / (args.rounds - 1)
                    if per_round > 0:
                        break
                if per_round <= 0:
                    sys.exit(
                        f"{model} {precision}: R rounds and an evaluation took {a:.3f} s, 1 round and one {b:.3f} s "
                        f"(noise above R - 1 rounds, {ATTEMPTS} times): raise --rounds or --local-epochs"
                    )
                print(f"| {model} | {precision} | {per_round:.3f} | {b - per_round:.3f} |", flush=True)

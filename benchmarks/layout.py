"""Channel-first against channel-last images on the CPU, for each model family: a training step and an evaluation.

    python benchmarks/layout.py                                   # every family, 1 and 2 threads
    python benchmarks/layout.py --models cnn pfl-cnn --threads 1 --out layout.json

For each model of --models (common.py's builders: the MLP, the small CNNs, VGG11, the ResNets) and each thread
count, it times on random 32x32 images (the layouts' speed does not depend on the pixels) two things in each
layout: a training step (forward, cross-entropy, backward and an SGD step on a batch of --batch-size images) and
the evaluation of --eval-images images in batches of 2,000, as common.evaluate does. "first" is PyTorch's default
layout, channels first in memory (NCHW); "last" keeps the images channels last in memory (NHWC, torch's
channels_last), the model's weights as they are. The two layouts alternate, --repeats times each, and the fastest
of each is kept (interference only adds time). The table gives both and last / first: below 1, channel-last is
faster. The predictions of the two layouts are compared too (the largest difference of a logit), to show the work
is the same.
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402

FAMILIES = {
    "mlp": {},
    "cnn": {},
    "pfl-cnn": {},
    "convnet4": {},
    "vgg11": {},
    "mobilenet": {},
    "resnet18": {},
    "resnet18-gn": {"norm": "gn"},
    "resnet18-nf": {"norm": "nf"},
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(FAMILIES), help="model families (see FAMILIES)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch threads")
    p.add_argument("--batch-size", type=int, default=50, help="images of a training step")
    p.add_argument("--steps", type=int, default=10, help="training steps timed together")
    p.add_argument("--eval-images", type=int, default=2000, help="images evaluated")
    p.add_argument("--repeats", type=int, default=3, help="timings of each layout, alternating")
    p.add_argument("--out", help="JSON of every timing (a new file)")
    args = p.parse_args()
    unknown = [m for m in args.models if m not in FAMILIES]
    if unknown:
        p.error(f"--models: unknown {unknown}; choose from {sorted(FAMILIES)}")
    if min(args.threads) < 1 or min(args.batch_size, args.steps, args.eval_images, args.repeats) < 1:
        p.error("--threads, --batch-size, --steps, --eval-images and --repeats must be at least 1")
    if args.out and os.path.exists(args.out):
        p.error(f"--out: {args.out} exists; name a new file")
    return args


def build(name):
    """A fresh model of the family, as the scripts build it, on 10 classes of 3x32x32 images, without the hook that
    lays a convolutional body's images out channels last on the CPU: here the layout is the input's."""
    torch.manual_seed(0)
    if name == "vgg11":
        import fedfn  # noqa: F401  registers VGG11

        model = common.MODELS["vgg11"](3, 10, 32)
    else:
        builder = common.MODELS[name.split("-")[0] if name.startswith("resnet18-") else name]
        model = builder(3, 10, 32, **FAMILIES.get(name, {}))
    if model.layout_hook is not None:
        model.layout_hook.remove()
    return model


def in_layout(x, layout):
    if layout == "last":
        return x.contiguous(memory_format=torch.channels_last)
    return x.contiguous()


def time_training(model, x, y, steps):
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model.train()
    began = time.perf_counter()
    for _ in range(steps):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return (time.perf_counter() - began) / steps


@torch.no_grad()
def time_evaluation(model, x):
    model.eval()
    began = time.perf_counter()
    outputs = [model(batch) for batch in x.split(2000)]
    return time.perf_counter() - began, torch.cat(outputs)


def main():
    args = parse_args()
    g = torch.Generator().manual_seed(0)
    x_train = torch.randn(args.batch_size, 3, 32, 32, generator=g)
    y_train = torch.randint(0, 10, (args.batch_size,), generator=g)
    x_eval = torch.randn(args.eval_images, 3, 32, 32, generator=g)
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name in args.models:
            best = {}
            logits = {}
            for _ in range(args.repeats):
                for layout in ("first", "last"):
                    model = build(name)
                    step = time_training(model, in_layout(x_train, layout), y_train, args.steps)
                    evaluation, logits[layout] = time_evaluation(build(name), in_layout(x_eval, layout))
                    old = best.get(layout, (float("inf"), float("inf")))
                    best[layout] = (min(old[0], step), min(old[1], evaluation))
            gap = float((logits["first"] - logits["last"]).abs().max())
            row = {"model": name, "threads": threads, "first": best["first"], "last": best["last"], "gap": gap}
            rows.append(row)
            step_ratio = best["last"][0] / best["first"][0]
            eval_ratio = best["last"][1] / best["first"][1]
            print(f"{name}, {threads} thread(s): step {step_ratio:.2f}, evaluation {eval_ratio:.2f}", flush=True)
    print()
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


def table(rows):
    lines = [
        "| model | threads | step, first (ms) | step, last (ms) | last / first | evaluation, first (s) | "
        "evaluation, last (s) | last / first | largest logit gap |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        (step_first, eval_first), (step_last, eval_last) = r["first"], r["last"]
        cells = [
            r["model"],
            str(r["threads"]),
            f"{step_first * 1000:.1f}",
            f"{step_last * 1000:.1f}",
            f"{step_last / step_first:.2f}",
            f"{eval_first:.2f}",
            f"{eval_last:.2f}",
            f"{eval_last / eval_first:.2f}",
            f"{r['gap']:.1e}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

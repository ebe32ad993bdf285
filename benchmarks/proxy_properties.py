"""Proxy properties: does a small CPU proxy keep, at initialization, the property its paper's method depends on?

No training: forward passes at initialization only, for several seeds (mean [min, max] over them), on real
CIFAR-10 training images normalized as the scripts do (common.prepare_batch, no augmentation). Prints one
markdown table "model | property | value".

1. FedFN (fedfn.py: logits theta_cls f / ||f||_2). The mean L2 norm of the penultimate feature f = model.body(x)
   and the mean L2 norm of the head's rows (model.head.weight), which bound the logits with and without FN:
   vgg11 (the paper's model, d = 512), vgg11-narrow (ours: a quarter of the channels, sized for a CPU) and
   convnet4-tiny (the small-scale proxy of benchmarks/reproduce/fedfn.sh).
2. FedBABU (fedbabu.py: the random head is frozen). The head rows' coherence, mean and max |cos| over the pairs
   of rows: convnet4 (the paper's, d = 256), convnet4-narrow (ours, d = 128) and convnet4-tiny (d = 32). Random
   rows in R^d have E|cos| ~ sqrt(2 / (pi d)): the smaller d, the less orthogonal the frozen head.
3. ANFR (anfr.py: NF-ResNets). The mean of the last gains: the gain g (Eq. 5, common.ScaledStdConv2d) of the last
   conv of each residual branch (conv2 of a basic block, conv3 of a bottleneck), which --last-gain-init starts
   (0, timm's NF-ResNets: each branch starts switched off). Pooled over all channels of all blocks; for trained
   runs also the mean of |g| (the gains take both signs, so their plain mean stays near 0 however open).
Plus, for sizing a budget, the time of one SGD step (momentum 0.9, batch 50, 1 thread, the median of a few
steps after one warm-up) per image, for each FedFN and FedBABU model.

    OMP_NUM_THREADS=1 python benchmarks/proxy_properties.py --data-dir /path/to/cifar10     # about 15 s

The last gains of a run, from its checkpoint.pt (written at each evaluation) or model.pt (--save-model):

    import sys, torch; sys.path.insert(0, "benchmarks")
    from proxy_properties import last_gain_mean
    ckpt = torch.load("runs/anfr__.../checkpoint.pt", map_location="cpu", weights_only=False)
    print(ckpt["round"], last_gain_mean(ckpt["model"]))   # a whole checkpoint dict works too

or, for whole run folders (their checkpoint.pt, else model.pt), one markdown row each:

    python benchmarks/proxy_properties.py --runs benchmarks/results/anfr-proxy/*/seed*

That is: the mean over torch.cat of the values of the keys body.stages.<i>.conv<k>.gain with the largest k of
each block i (ANFR's blocks have no other conv<k>.gain; stem, shortcut and CBAM gains are not in it).
"""

import argparse
import math
import os
import re
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import anfr  # noqa: E402  (the repository root is on sys.path now)
import fedfn  # noqa: E402, F401  (registers vgg11 and vgg11-narrow into common.MODELS)
from common import build_model, load_data, prepare_batch  # noqa: E402

FEDFN_MODELS = ["vgg11", "vgg11-narrow", "convnet4-tiny"]  # the first is the paper's: ratios are to it
FEDBABU_MODELS = ["convnet4", "convnet4-narrow", "convnet4-tiny"]
# (label, anfr.py flags): the paper's ResNet-50 and the small proxy of benchmarks/reproduce/anfr.sh
ANFR_MODELS = [
    ("anfr.py --arch anfr", dict(depth=50, width=64)),
    ("anfr.py --arch anfr --depth 18 --width 8", dict(depth=18, width=8)),
    ("anfr.py --arch anfr --depth 18 --width 8 --last-gain-init 1", dict(depth=18, width=8, last_gain_init=1.0)),
]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", help="the CIFAR-10 image folder (train/<class>/*, test/<class>/*)")
    p.add_argument(
        "--runs", nargs="+", metavar="DIR", help="only the mean (and mean |.|) last gain of these anfr.py runs"
    )
    p.add_argument("--images", type=int, default=256, help="the first N training images (in load_data's order)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="model-init seeds")
    p.add_argument("--steps", type=int, default=5, help="timed SGD steps per model (after one warm-up step)")
    p.add_argument("--batch-size", type=int, default=50, help="batch of the timed SGD steps")
    args = p.parse_args()
    if not args.runs and not args.data_dir:
        p.error("--data-dir is required (unless --runs)")
    return args


# ---------------------------------------------------------------------------------------- the measurements
@torch.no_grad()
def feature_norm(model, x):
    """Mean over the images of ||model.body(x)||_2 (eval mode; x normalized)."""
    model.eval()
    return model.body(x).norm(dim=1).mean().item()


def head_row_norm(model):
    """Mean over the classes c of ||theta_cls,c||_2, the rows of model.head.weight."""
    return model.head.weight.detach().norm(dim=1).mean().item()


def row_coherence(w):
    """(mean, max) of |cos(w_i, w_j)| over the pairs i < j of rows of w [C, d]."""
    u = F.normalize(w.detach().double(), dim=1)
    i, j = torch.triu_indices(len(u), len(u), offset=1)
    cos = (u @ u.T)[i, j].abs()
    return cos.mean().item(), cos.max().item()


LAST_GAIN = re.compile(r"^(.*stages\.\d+)\.conv(\d+)\.gain$")


def last_gains(state_dict):
    """{block: gain tensor} of the last conv (the largest conv<k>) of each NF block of a state dict."""
    if isinstance(state_dict.get("model"), dict):  # a checkpoint.pt's dict
        state_dict = state_dict["model"]
    found = {}
    for key, value in state_dict.items():
        m = LAST_GAIN.match(key)
        if m and (m.group(1) not in found or int(m.group(2)) > found[m.group(1)][0]):
            found[m.group(1)] = (int(m.group(2)), value)
    if not found:
        raise ValueError("no NF block gains (keys ...stages.<i>.conv<k>.gain) in this state dict")
    return {block: value for block, (_, value) in found.items()}


def last_gain_mean(state_dict, absolute=False):
    """Mean of the last gains, over all channels of all NF blocks (see last_gains); a float. absolute=True: the
    mean of |g|, the scale of the residual branches' output (a channel's sign is a symmetry: the gains of a
    trained net have both signs, so their plain mean can stay near 0 while the branches are open)."""
    g = torch.cat([g.detach().float().flatten() for g in last_gains(state_dict).values()])
    return (g.abs() if absolute else g).mean().item()


def step_ms_per_image(model, x, y, steps=5, batch_size=50):
    """Milliseconds per image of one SGD step (momentum 0.9) at batch_size: the median of `steps` timed steps
    after one warm-up step, over the first batch_size images of x, on the current torch thread count."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    xb, yb, times = x[:batch_size], y[:batch_size], []
    for _ in range(steps + 1):
        start = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[1:]) / len(xb)


# ---------------------------------------------------------------------------------------- the table
def spread(values, digits=3):
    """'mean [min, max]' of a list of floats (the value alone for one)."""
    f = f"{{:.{digits}f}}"
    if len(values) == 1:
        return f.format(values[0])
    return f"{f.format(statistics.mean(values))} [{f.format(min(values))}, {f.format(max(values))}]"


def build(name, data, seed):
    torch.manual_seed(seed)
    return build_model(name, data)


def n_params(model):
    return f"{sum(p.numel() for p in model.parameters()):,}"


def fedfn_rows(data, x, y, seeds, steps=5, batch_size=50, models=FEDFN_MODELS):
    rows, ref, timed = [], None, {}
    for name in models:
        feats, heads = [], []
        for seed in seeds:
            model = build(name, data, seed)
            feats.append(feature_norm(model, x))
            heads.append(head_row_norm(model))

        def ratio(v, i):
            return f" ({statistics.mean(v) / ref[i]:.2f}x {models[0]})" if ref else ""

        rows += [
            (
                name,
                f"FedFN: mean L2 norm of the feature body(x) (d = {model.head.in_features})",
                spread(feats) + ratio(feats, 0),
            ),
            (name, "FedFN: mean L2 norm of the head's rows", spread(heads) + ratio(heads, 1)),
        ]
        ref = ref or (statistics.mean(feats), statistics.mean(heads))
        timed[name] = (model, n_params(model))
    return rows + time_rows(timed, x, y, steps, batch_size)


def fedbabu_rows(data, x, y, seeds, steps=5, batch_size=50, models=FEDBABU_MODELS, timed_already=()):
    rows, timed = [], {}
    for name in models:
        means, maxes = [], []
        for seed in seeds:
            model = build(name, data, seed)
            mean, top = row_coherence(model.head.weight)
            means.append(mean)
            maxes.append(top)
        d = model.head.in_features
        random = math.sqrt(2 / (math.pi * d))  # E|cos| of two random directions in R^d, for large d
        rows += [
            (name, f"FedBABU: head rows' mean \\|cos\\| (d = {d}; sqrt(2/(pi d)) = {random:.3f})", spread(means)),
            (name, "FedBABU: head rows' max \\|cos\\| over pairs", spread(maxes)),
        ]
        if name not in timed_already:
            timed[name] = (model, n_params(model))
    return rows + time_rows(timed, x, y, steps, batch_size)


def time_rows(timed, x, y, steps, batch_size):
    rows = []
    for name, (model, params) in timed.items():
        ms = step_ms_per_image(model, x, y, steps, batch_size)
        rows.append((name, f"SGD step, batch {batch_size}, {torch.get_num_threads()} thread(s): ms/image", f"{ms:.2f}"))
        rows.append((name, "parameters", params))
    return rows


def anfr_rows(data, seeds, models=ANFR_MODELS):
    rows = []
    for label, flags in models:
        opts = dict(arch="anfr", depth=50, width=64, stem="cifar", attention="se", last_gain_init=0.0)
        values = []
        for seed in seeds:
            torch.manual_seed(seed)
            values.append(last_gain_mean(anfr.build(argparse.Namespace(**{**opts, **flags}), data).state_dict()))
        rows.append((label, "ANFR: mean last gain of the NF blocks (at init)", spread(values)))
    return rows


def run_gain_rows(run_dirs):
    """(run folder, round, mean last gain, mean |last gain|) per run folder with an NF model, from checkpoint.pt,
    else model.pt; the folders skipped (no such file, or no NF gains) are named on stderr."""
    rows = []
    for d in run_dirs:
        found = [n for n in ("checkpoint.pt", "model.pt") if os.path.isfile(os.path.join(d, n))]
        if not found:
            print(f"skipped {d}: neither checkpoint.pt nor model.pt", file=sys.stderr)
            continue
        state = torch.load(os.path.join(d, found[0]), map_location="cpu", weights_only=False)
        rnd = state.get("round", "final") if found[0] == "checkpoint.pt" else "final"
        try:
            rows.append((d, rnd, f"{last_gain_mean(state):.4f}", f"{last_gain_mean(state, absolute=True):.4f}"))
        except ValueError:  # a BN / GN model
            print(f"skipped {d}: no NF block gains in its {found[0]}", file=sys.stderr)
    return rows


def table(rows):
    lines = ["| model | property | value |", "|---|---|---|"]
    return "\n".join(lines + [f"| `{m}` | {p} | {v} |" for m, p, v in rows])


if __name__ == "__main__":
    args = parse_args()
    torch.set_num_threads(1)
    if args.runs:
        print("| run | round | mean last gain | mean \\|last gain\\| |\n|---|---|---|---|")
        print("\n".join(f"| {d} | {r} | {g} | {a} |" for d, r, g, a in run_gain_rows(args.runs)))
        sys.exit(0)
    data = load_data(argparse.Namespace(dataset="folder", data_dir=args.data_dir, device="cpu", data_seed=0))
    x, y = prepare_batch(data.x_train[: args.images], data), data.y_train[: args.images]
    print(f"{len(x)} CIFAR-10 training images, seeds {args.seeds}, torch {torch.__version__}\n")
    rows = fedfn_rows(data, x, y, args.seeds, args.steps, args.batch_size)
    rows += fedbabu_rows(data, x, y, args.seeds, args.steps, args.batch_size, timed_already=FEDFN_MODELS)
    rows += anfr_rows(data, args.seeds[:1])  # the gains start at --last-gain-init whatever the seed
    print(table(rows))

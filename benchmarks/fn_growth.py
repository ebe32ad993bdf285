"""FedFN's feature norm inside one round, step by step, and what the server's average does to it.

From a fedfn.py run folder's checkpoint.pt (the global model w_t after round t, with the sampler's state), train
the clients of round t + 1 as fedfn.local_train does (same lr, seeds, batches), and record before and after
every local step, on a fixed probe batch of the client's own training images (its first --probe samples, no
augmentation): the mean ||f||_2 of the penultimate feature, and the norm of the last body layer
(fedfn.invariant_layer). With FN the loss cannot see that layer's scale, so its gradient is orthogonal to it and
a plain SGD step can only lengthen it (||w - lr g||^2 = ||w||^2 + lr^2 ||g||^2; momentum and weight decay
change this). Then the clients' models are averaged as the server does (weights n_k / n) and the same is
measured on the average.

    OMP_NUM_THREADS=1 python benchmarks/fn_growth.py --run RUN_DIR [--data-dir DIR] [--clients K] [--json OUT]

Prints one markdown row per client (samples n_k, the share of its largest class, local steps K, ||f|| on its probe
at the first and the last step, their change per step per unit of lr, the layer's norm and the change of its square,
the client's weight and its share of the server's update of the layer) and a row for the average.
`python benchmarks/plot.py fn-growth OUT.json` draws the per-step traces.
"""

import argparse
import json
import os
import sys

import numpy as np
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fedfn  # noqa: E402  (the repository root is on sys.path now)
from common import (  # noqa: E402
    accumulate,
    build_model,
    client_seed,
    client_weights,
    load_average,
    load_data,
    lr_at,
    make_partition,
    prepare_batch,
    sample_clients,
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="a fedfn.py run folder with config.json and checkpoint.pt")
    p.add_argument("--data-dir", default=None, help="the run's data in another place (default: its config's)")
    p.add_argument("--clients", type=int, default=None, help="train only the first K clients of the round")
    p.add_argument("--probe", type=int, default=50, help="probe images per client (default 50)")
    p.add_argument("--json", default=None, help="also write every client's per-step trace to this file")
    a = p.parse_args(argv)
    for name in ("config.json", "checkpoint.pt"):
        if not os.path.isfile(os.path.join(a.run, name)):
            p.error(f"--run: {a.run} has no {name} (a fedfn.py run folder with a checkpoint is needed)")
    for flag, value in (("--clients", a.clients), ("--probe", a.probe)):
        if value is not None and value < 1:
            p.error(f"{flag}: must be >= 1, got {value}")
    return a


@torch.no_grad()
def probe_norms(model, probe, args):
    """(mean ||f||_2 on the probe, ||invariant layer||), the model left in the mode it was in."""
    mode = model.training
    model.eval()  # batch norm, if any, must not update its statistics here
    f = fedfn.fn_forward(model, probe, args.fn, args.fn_scale)[1]
    model.train(mode)
    return float(f.float().norm(dim=1).mean()), float(fedfn.param_norm(fedfn.invariant_layer(model)))


def trace_round(args, data, partition, ckpt, limit=None, probe_size=50):
    """The round after the checkpoint's: per client its probe norms before and after every step; the average's.
    Returns (result, the averaged model, or None when only some clients trained)."""
    model = build_model(args.model, data)
    model.load_state_dict(ckpt["model"])
    sampler = np.random.default_rng(args.seed)  # the client sampler after the checkpoint's round, as Run.start
    sampler.bit_generator.state = ckpt["sampler"]  # (torch's generator is seeded for each client below)
    rnd = ckpt["round"]  # rounds done: the round traced is the next one
    clients = sample_clients(sampler, args.num_clients, args.frac)
    weights = client_weights([len(partition.train[k]) for k in clients], args.weighting)
    lr = lr_at(rnd, args)
    total = {k: torch.zeros_like(v, dtype=torch.float) for k, v in model.state_dict().items()}
    out = {"round": rnd + 1, "lr": lr, "clients": []}
    client = build_model(args.model, data)

    def flat(net):
        return torch.cat([p.detach().flatten() for p in fedfn.invariant_layer(net).parameters(recurse=False)])

    start, deltas = flat(model), []
    for k, w in list(zip(clients, weights))[:limit]:
        client.load_state_dict(model.state_dict())
        probe = prepare_batch(data.x_train[partition.train[k][:probe_size]], data)
        trace = [probe_norms(client, probe, args)]
        hook = register_optimizer_step_post_hook(lambda *_: trace.append(probe_norms(client, probe, args)))
        try:
            torch.manual_seed(client_seed(args.seed, rnd, k))  # as common.each_client
            _, steps, _ = fedfn.local_train(client, partition.train[k], data, args, lr, list(model.parameters()))
        finally:
            hook.remove()
        accumulate(total, client.state_dict(), w)
        deltas.append(w * (flat(client) - start))  # the client's weighted update of the layer
        labels = data.y_train[partition.train[k]]
        top_share = float(torch.bincount(labels).max()) / len(labels)  # how much of its data is one class
        out["clients"].append(
            {"client": k, "samples": len(labels), "top_share": top_share, "weight": w, "steps": steps, "trace": trace}
        )
    if limit is not None and limit < len(clients):  # the average is the server's only when every client trained
        return out, None
    # the server's update of the layer, sum_k p_k (W_k - W_t), and client k's share of it, p_k <dW_k, dW> / ||dW||^2
    # (they sum to 1): in float64, as float32 dot products over a layer of millions of entries miss that by 1e-5
    deltas = [d.double() for d in deltas]
    update = torch.stack(deltas).sum(0)
    for c, d in zip(out["clients"], deltas):
        c["update_share"] = float(d @ update / (update @ update).clamp_min(1e-30))
    load_average(model, total)
    out["average"] = [
        probe_norms(model, prepare_batch(data.x_train[partition.train[c["client"]][:probe_size]], data), args)
        for c in out["clients"]
    ]
    return out, model


def table(result):
    lr = result["lr"]
    lines = [
        f"round {result['round']}, lr {lr:g}",
        "",
        "| client | n_k | largest class | steps K | mean ‖f‖, first -> last step | change / (K lr) | ‖layer‖ "
        "| ‖layer‖² change | weight p_k | share of the layer's update |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in result["clients"]:
        (f0, w0), (f1, w1) = c["trace"][0], c["trace"][-1]
        share = f"{c['update_share']:.3f}" if "update_share" in c else ""  # only when every client trained
        lines.append(
            f"| {c['client']} | {c['samples']} | {100 * c['top_share']:.0f}% | {c['steps']} | {f0:.3f} -> {f1:.3f} | "
            f"{(f1 - f0) / (c['steps'] * lr):+.3f} | {w0:.4f} | {w1**2 - w0**2:+.3e} | {c['weight']:.3f} | {share} |"
        )
    if "average" in result:
        start = result["clients"][0]["trace"][0][1]  # w_t's, the same for every client
        f_mean = np.mean([c["trace"][-1][0] for c in result["clients"]])
        w2_mean = np.mean([c["trace"][-1][1] ** 2 for c in result["clients"]])
        f_avg, w_avg = np.mean([a[0] for a in result["average"]]), result["average"][0][1]
        lines.append(
            f"| the clients' mean / the average | | | | {f_mean:.3f} / {f_avg:.3f} | | | "
            f"{w2_mean - start**2:+.3e} / {w_avg**2 - start**2:+.3e} | 1 | 1 |"
        )
    return "\n".join(lines)


def main(argv=None):
    a = parse_args(argv)
    with open(os.path.join(a.run, "config.json")) as f:
        args = argparse.Namespace(**json.load(f))
    args.device = "cpu"
    args.data_dir = a.data_dir or args.data_dir
    ckpt = torch.load(os.path.join(a.run, "checkpoint.pt"), map_location="cpu", weights_only=False)
    data = load_data(args)
    result, _ = trace_round(args, data, make_partition(args, data), ckpt, a.clients, a.probe)
    print(table(result))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())

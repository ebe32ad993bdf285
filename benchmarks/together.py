"""The "together" speed lever, a prototype: a round's clients trained together, exactly as one at a time.

fedavg.py, fedfn.py and fedbabu.py train a round's clients one after the other (`common.each_client` reseeds
torch's global RNG per client, then `local_train` draws the client's batches and augmentations and takes its SGD
steps). Here the same round is trained in one stream of stacked steps:

1. draws: each client's index batches (`common.client_batches`) and augmented inputs (`common.prepare_batch`) are
   drawn in local_train's order, under `common.each_client` (so with the RNG reseeded per client as there, and
   reseeded after the clients as there). Nothing else in a client's steps draws random numbers (no dropout in
   these models), so drawing them first changes no number;
2. clients whose batch sizes match step for step (equal client sizes: all of them) form a group; each parameter of
   a group becomes one [G, ...] tensor (`torch.func.stack_module_state`);
3. per step: the G clients' losses by `torch.func.vmap` over `torch.func.functional_call` (the script's own
   forward: `fedfn.fn_forward` for FedFN), FedProx's term per client, summed; one backward, so slice g of each
   gradient is client g's own; SCAFFOLD's correction added slice by slice; then one `torch.optim.SGD` step on the
   stacked tensors (momentum and weight decay act elementwise: each slice gets exactly its client's update);
4. the server sums the clients' states in the round's client order, as the scripts do.

    python benchmarks/together.py --model cnn --clients 4 --steps 20    # CPU time: together vs one at a time

tests/test_together.py checks rounds against the scripts' own functions (float64 to 1e-12); benchmarks/levers.py
times it on the GPU (benchmarks/gpu_call.md).
"""

import argparse
import copy
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common  # noqa: E402
from common import accumulate, autocast, client_batches, each_client, load_average, prepare_batch  # noqa: E402


def draw_client(indices, data, args):
    """Client's (x, y) batches for one round, drawn as its local_train draws them (index batches, then each
    batch's augmentation, in order) from the RNG as it stands."""
    out = []
    for batch in client_batches(indices, args.batch_size, args.local_epochs, args.local_steps):
        out.append((prepare_batch(data.x_train[batch], data, args.augment), data.y_train[batch]))
    return out


def draw_round(clients, weights, partition, data, args, rnd):
    """{k: [(x, y), ...]} for the round's clients, each drawn under `common.each_client`'s seeding."""
    return {k: out for k, _, out in each_client(clients, weights, lambda k: draw_client(partition.train[k], data, args),
                                                args.seed, rnd)}  # fmt: skip


def groups_by_steps(draws):
    """Lists of clients whose batches have the same sizes step for step (so they can be stacked), in the order of
    their first client; clients keep the round's order inside a group."""
    groups = {}
    for k, batches in draws.items():
        groups.setdefault(tuple(len(y) for _, y in batches), []).append(k)
    return list(groups.values())


class _Call(nn.Module):  # functional_call runs forward(): this one runs `forward_fn(model, x)` (e.g. fn_forward)
    def __init__(self, model, forward_fn):
        super().__init__()
        self.model, self.forward_fn = model, forward_fn

    def forward(self, x):
        return self.forward_fn(self.model, x)


def train_together(model, draws, args, lr, forward_fn, trainable=None, global_params=None, corrections=None):
    """Train the clients of `draws` ({k: batches}) from `model`'s state, stacked per group. forward_fn(model, x)
    -> (logits, feature); trainable(name): whether a parameter is in the optimizer (FedBABU: the body only);
    global_params: w_t for FedProx (model's parameter order); corrections {k: {name: c - c_i}} for SCAFFOLD.
    Returns {k: (state_dict, mean training loss tensor, steps)}."""
    trainable = trainable or (lambda name: True)
    base = _Call(copy.deepcopy(model).to("meta"), forward_fn)  # its tensors are replaced in every call
    base.train()
    names = [n for n, _ in model.named_parameters()]
    anchor = global_params if global_params is not None else [p.detach() for p in model.parameters()]

    def client_loss(params, buffers, x, y):  # one client's loss, as local_train computes it
        with autocast(args.device, args.amp):
            logits, f = torch.func.functional_call(base, (params, buffers), (x,))
            loss = F.cross_entropy(logits.float(), y)
        if getattr(args, "fr_mu", 0) > 0:  # FedFN's FedFR: L_CE + mu ||f||_2 (batch mean)
            loss = loss + args.fr_mu * f.float().norm(dim=1).mean()
        if args.prox_mu > 0:  # FedProx: + mu/2 ||w - w_t||^2, summed in the model's parameter order
            loss = loss + common.prox_term([params[f"model.{n}"] for n in names], anchor, args.prox_mu)
        return loss

    losses_of = torch.func.vmap(client_loss)
    out = {}
    for group in groups_by_steps(draws):
        params, buffers = torch.func.stack_module_state([model] * len(group))
        params = {f"model.{n}": p.detach().requires_grad_(trainable(n)) for n, p in params.items()}
        buffers = {f"model.{n}": b for n, b in buffers.items()}
        opt = torch.optim.SGD([p for p in params.values() if p.requires_grad], lr=lr, momentum=args.momentum,
                              weight_decay=args.weight_decay)  # fmt: skip
        corr = None
        if corrections is not None:  # [G, ...] per trainable parameter
            corr = {f"model.{n}": torch.stack([corrections[k][n] for k in group]) for n in names}
        steps = len(draws[group[0]])
        loss_sum = torch.zeros(len(group), device=args.device)
        seen = 0
        for s in range(steps):
            x = torch.stack([draws[k][s][0] for k in group])
            y = torch.stack([draws[k][s][1] for k in group])
            losses = losses_of(params, buffers, x, y)  # [G]: each client's loss on its own batch
            opt.zero_grad(set_to_none=True)
            losses.sum().backward()
            if corr is not None:  # SCAFFOLD: every client's gradient + (c - c_i)
                for n, p in params.items():
                    if p.grad is not None:
                        p.grad.add_(corr[n])
            opt.step()
            loss_sum += losses.detach() * y.shape[1]
            seen += y.shape[1]
        for g, k in enumerate(group):
            stacked = {**params, **buffers}
            state = {n: stacked[f"model.{n}"][g].detach() for n in model.state_dict()}  # state_dict order and keys
            out[k] = (state, loss_sum[g] / max(seen, 1), steps)
    return out


def fedavg_round(model, clients, weights, partition, data, args, lr, rnd, forward_fn=None):
    """One round of fedavg.py's loop the together way: w_{t+1} = sum_k w_k y_k loaded into `model`; returns the
    round's training loss sum_k w_k loss_k (a tensor), as the script sums it."""
    forward_fn = forward_fn or (lambda m, x: (m(x), None))
    draws = draw_round(clients, weights, partition, data, args, rnd)
    trained = train_together(model, draws, args, lr, forward_fn)
    total = {k: torch.zeros_like(v, dtype=torch.float) for k, v in model.state_dict().items()}
    train_loss = torch.zeros((), device=args.device)
    for k, w in zip(clients, weights):  # the round's order, as each_client yields
        state, loss, _ = trained[k]
        train_loss += w * loss
        accumulate(total, state, w)
    load_average(model, total)
    return train_loss


def fedbabu_round(model, clients, weights, partition, data, args, lr, rnd):
    """One round of fedbabu.py's loop the together way (the head frozen unless --train-head; its aggregate)."""
    import fedbabu

    draws = draw_round(clients, weights, partition, data, args, rnd)

    def trainable(name):
        return args.train_head or not name.startswith("head.")

    trained = train_together(model, draws, args, lr, lambda m, x: (m(x), None), trainable)
    total = {k: torch.zeros_like(v, dtype=torch.float) for k, v in model.state_dict().items()}
    train_loss = torch.zeros((), device=args.device)
    for k, w in zip(clients, weights):
        state, loss, _ = trained[k]
        train_loss += w * loss
        accumulate(total, state, w)
    fedbabu.aggregate(model, total, args.train_head)
    return train_loss


def fedfn_round(model, clients, weights, partition, data, args, lr, rnd, scaffold=None):
    """One round of fedfn.py's loop the together way: FN (or --no-fn), FedProx, FedFR, and SCAFFOLD when
    `scaffold` = {"c": c_global, "c_local": {k: c_i}} is given (updated in place, as fedfn.py updates its c and
    c_i). Returns the round's training loss. --agg fedexp and --analyze are not covered."""
    import fedfn

    if args.agg not in ("fedavg", "scaffold") or args.analyze:
        raise NotImplementedError("together: fedfn.py's --agg fedexp and --analyze are not covered")
    if (args.agg == "scaffold") != (scaffold is not None):
        raise ValueError("together: --agg scaffold needs the `scaffold` state, and only it")
    names = [n for n, _ in model.named_parameters()]
    x_old = [w.detach().clone() for w in model.parameters()]  # w_t

    def zeros():
        return {n: torch.zeros_like(w) for n, w in model.named_parameters()}

    corrections = None
    if scaffold is not None:

        def c_of(k):
            return scaffold["c_local"].get(k) or zeros()

        corrections = {k: common.scaffold_correction(scaffold["c"], c_of(k)) for k in clients}
    draws = draw_round(clients, weights, partition, data, args, rnd)

    def forward_fn(m, x):
        return fedfn.fn_forward(m, x, args.fn, args.fn_scale)

    trained = train_together(model, draws, args, lr, forward_fn, global_params=x_old, corrections=corrections)
    total = {k: torch.zeros_like(v, dtype=torch.float) for k, v in model.state_dict().items()}
    train_loss = torch.zeros((), device=args.device)
    delta_c_sum = zeros() if scaffold is not None else None
    for k, w in zip(clients, weights):
        state, loss, steps = trained[k]
        train_loss += w * loss
        if scaffold is not None:  # c_i+ (option II) and the server's sum of c_i+ - c_i, as fedfn.py
            c_i, step_sum = c_of(k), common.local_step_sum(steps, lr, args.momentum)
            y = {n: state[n] for n in names}
            scaffold["c_local"][k] = common.scaffold_control(c_i, scaffold["c"], dict(zip(names, x_old)), y, step_sum)
            delta_c_sum = {n: delta_c_sum[n] + (scaffold["c_local"][k][n] - c_i[n]) for n in names}
        accumulate(total, state, w)
    load_average(model, total)
    if scaffold is not None:
        scaffold["c"] = common.scaffold_server(scaffold["c"], delta_c_sum, args.num_clients)
    return train_loss


ROUNDS = {"fedavg": fedavg_round, "fedbabu": fedbabu_round, "fedfn": fedfn_round}


def one_at_a_time_round(script, model, clients, weights, partition, data, args, lr, rnd):
    """The script's own loop for the same round, from its functions (what the levers are timed against; the
    tests build their reference the same way). Returns the round's training loss."""
    module = __import__(script)
    client = copy.deepcopy(model)
    if script == "fedbabu":
        client.head.requires_grad_(args.train_head)
    total = {k: torch.zeros_like(v, dtype=torch.float) for k, v in model.state_dict().items()}
    train_loss = torch.zeros((), device=args.device)
    x_old = [w.detach().clone() for w in model.parameters()]

    def train_client(k):
        client.load_state_dict(model.state_dict())
        out = module.local_train(client, partition.train[k], data, args, lr, x_old)
        return {"loss": out[0] if isinstance(out, tuple) else out, "state": client.state_dict()}

    for k, w, out in each_client(clients, weights, train_client, args.seed, rnd):
        train_loss += w * out["loss"]
        accumulate(total, out["state"], w)
    if script == "fedbabu":
        module.aggregate(model, total, args.train_head)
    else:
        load_average(model, total)
    return train_loss


def script_setup(script, flags):
    """(args, data, partition, model) as `script` builds them from its own parser and `flags`."""
    module = __import__(script)
    saved, sys.argv = sys.argv, [f"{script}.py", *map(str, flags)]
    try:
        args = module.parse_args()
    finally:
        sys.argv = saved
    data = common.load_data(args)
    partition = common.make_partition(args, data)
    torch.manual_seed(args.seed)
    return args, data, partition, common.build_model(args.model, data).to(args.device)


def time_round(way, script, model, clients, weights, partition, data, args, rnd=0):
    """Seconds of one round (`way` together or one-at-a-time) from a copy of model, synchronized on a GPU."""
    model = copy.deepcopy(model)
    lr = common.lr_at(rnd, args)
    sync = torch.cuda.synchronize if "cuda" in str(args.device) else (lambda: None)
    sync()
    t = time.perf_counter()
    if way == "together":
        loss = ROUNDS[script](model, clients, weights, partition, data, args, lr, rnd)
    else:
        loss = one_at_a_time_round(script, model, clients, weights, partition, data, args, lr, rnd)
    float(loss)
    sync()
    return time.perf_counter() - t


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="CPU (or GPU) time of one round: together vs one at a time")
    p.add_argument("--script", default="fedavg", choices=sorted(ROUNDS))
    p.add_argument("--model", default="cnn")
    p.add_argument("--clients", type=int, default=4, help="clients a round")
    p.add_argument("--steps", type=int, default=20, help="local steps of each client")
    p.add_argument("--batch-size", type=int, default=50)
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds of each way (after one warm-up each)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: as the scripts: OMP_NUM_THREADS)")
    return p.parse_args(argv)


def main():
    a = parse_args()
    flags = ["--dataset", "synthetic", "--device", a.device, "--model", a.model, "--num-clients", a.clients * 2,
             "--frac", 0.5, "--shards", 2, "--local-steps", a.steps, "--batch-size", a.batch_size]  # fmt: skip
    if a.threads:
        torch.set_num_threads(a.threads)
    args, data, partition, model = script_setup(a.script, flags)
    clients = list(range(0, 2 * a.clients, 2))
    weights = common.client_weights([len(partition.train[k]) for k in clients], args.weighting)
    print(
        f"{a.script}.py --model {a.model}: {a.clients} clients x {a.steps} steps of B={a.batch_size}, {args.device}, "
        f"{torch.get_num_threads()} torch threads; median of {a.repeats} rounds after a warm-up"
    )
    times = {}
    for way in ("one-at-a-time", "together"):
        time_round(way, a.script, model, clients, weights, partition, data, args)
        times[way] = sorted(time_round(way, a.script, model, clients, weights, partition, data, args)
                            for _ in range(a.repeats))[a.repeats // 2]  # fmt: skip
    print("| way | s / round | ratio to one-at-a-time |\n| --- | --- | --- |")
    for way, t in times.items():
        print(f"| {way} | {t:.3f} | {t / times['one-at-a-time']:.2f} |")


if __name__ == "__main__":
    main()

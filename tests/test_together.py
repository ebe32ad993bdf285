"""benchmarks/together.py (the "together" lever): a round's clients trained together (stacked parameters, vmap, one
backward, one SGD step) against the scripts' own one-at-a-time loop, built here from the scripts' functions
(`local_train`, `common.each_client`, `accumulate`, `load_average`; fedfn.py's SCAFFOLD lines). Float64: every
client's trained parameters and the new global model equal to 1e-12 (max abs difference); float32: within 1e-5.
The losses go through the scripts' `logits.float()`, so the round's loss is compared at float32's precision."""

import copy
import os
import runpy
import sys

import numpy as np
import pytest
import torch

import common
import fedavg
import fedbabu
import fedfn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import together  # noqa: E402

EXACT = 1e-12  # float64
FLOAT32 = 1e-5  # float32: the stacked convolutions and matmuls sum in another order (measured: about 2e-8 here)
TINY = ["--dataset", "synthetic", "--device", "cpu", "--num-clients", "6", "--frac", "0.5", "--batch-size", "8"]


def setup(module, argv, monkeypatch, dtype=torch.float64):
    """module's args (its own parser), data, partition and a global model in dtype, as the script builds them."""
    monkeypatch.setattr(sys, "argv", [f"{module.__name__}.py", *TINY, *argv])
    args = module.parse_args()
    data = common.load_data(args)
    if dtype == torch.float64:  # prepare_batch's (x - mean) / std then comes out in float64
        data.mean, data.std = data.mean.double(), data.std.double()
    partition = common.make_partition(args, data)
    torch.manual_seed(args.seed)
    model = common.build_model(args.model, data).to(dtype)
    clients = common.sample_clients(np.random.default_rng(args.seed), args.num_clients, args.frac)
    weights = common.client_weights([len(partition.train[k]) for k in clients], args.weighting)
    return args, data, partition, model, clients, weights


def reference_round(module, model, clients, weights, partition, data, args, lr, rnd, scaffold=None):
    """One round of module's loop, one client at a time (the scripts' main loops, from their own functions).
    Returns (train loss, {k: client k's trained state}); `model` holds w_{t+1} after it."""
    client = copy.deepcopy(model)
    if module is fedbabu:
        client.head.requires_grad_(args.train_head)
    total = {k: torch.zeros_like(v, dtype=torch.float) for k, v in model.state_dict().items()}
    train_loss, states = torch.zeros(()), {}
    names = [n for n, _ in model.named_parameters()]
    x_old = [w.detach().clone() for w in model.parameters()]

    def zeros():
        return {n: torch.zeros_like(w) for n, w in model.named_parameters()}

    def c_of(k):
        return scaffold["c_local"].get(k) or zeros()

    delta_c_sum = zeros()

    def train_client(k):
        client.load_state_dict(model.state_dict())
        if module is fedfn:
            correction = common.scaffold_correction(scaffold["c"], c_of(k)) if scaffold else None
            loss, steps, _ = fedfn.local_train(client, partition.train[k], data, args, lr, x_old, correction)
        else:
            loss, steps = module.local_train(client, partition.train[k], data, args, lr, x_old), None
        return {"loss": loss, "state": client.state_dict(), "steps": steps}

    for k, w, out in common.each_client(clients, weights, train_client, args.seed, rnd):
        train_loss += w * out["loss"]
        states[k] = {n: v.clone() for n, v in out["state"].items()}
        if scaffold:  # fedfn.py's lines
            c_i, step_sum = c_of(k), common.local_step_sum(out["steps"], lr, args.momentum)
            y = {n: out["state"][n] for n in names}
            scaffold["c_local"][k] = common.scaffold_control(c_i, scaffold["c"], dict(zip(names, x_old)), y, step_sum)
            delta_c_sum = {n: delta_c_sum[n] + (scaffold["c_local"][k][n] - c_i[n]) for n in names}
        common.accumulate(total, out["state"], w)
    if module is fedbabu:
        fedbabu.aggregate(model, total, args.train_head)
    else:
        common.load_average(model, total)
    if scaffold:
        scaffold["c"] = common.scaffold_server(scaffold["c"], delta_c_sum, args.num_clients)
    return train_loss, states


def max_diff(a, b):
    """Max abs difference over every entry of two state dicts (same keys)."""
    assert a.keys() == b.keys()
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a.values(), b.values()))


def together_round(module, model, clients, weights, partition, data, args, lr, rnd, scaffold=None, spy=None):
    """together's round of module; spy(k, state) sees every client's trained state."""
    if spy is not None:
        trained_by = together.train_together

        def train(*a, **kw):
            out = trained_by(*a, **kw)
            for k, (state, _, _) in out.items():
                spy(k, state)
            return out

        together.train_together = train
    try:
        if module is fedfn:
            return together.fedfn_round(model, clients, weights, partition, data, args, lr, rnd, scaffold)
        if module is fedbabu:
            return together.fedbabu_round(model, clients, weights, partition, data, args, lr, rnd)
        return together.fedavg_round(model, clients, weights, partition, data, args, lr, rnd)
    finally:
        if spy is not None:
            together.train_together = trained_by


def compare(module, argv, monkeypatch, rounds=1, dtype=torch.float64, scaffold=False):
    """(max client-state difference, max global-state difference, loss pairs, groups seen) after `rounds` rounds
    of module's loop both ways, from the same model, clients and seeds."""
    args, data, partition, model, _, _ = setup(module, argv, monkeypatch, dtype)
    ref, tog = model, copy.deepcopy(model)

    def zeros():
        return {n: torch.zeros_like(w) for n, w in model.named_parameters()}

    s_ref, s_tog = ({"c": zeros(), "c_local": {}}, {"c": zeros(), "c_local": {}}) if scaffold else (None, None)
    sampler, client_diff, losses = np.random.default_rng(args.seed), 0.0, []
    for rnd in range(rounds):
        clients = common.sample_clients(sampler, args.num_clients, args.frac)
        weights = common.client_weights([len(partition.train[k]) for k in clients], args.weighting)
        lr = common.lr_at(rnd, args)
        loss_ref, states = reference_round(module, ref, clients, weights, partition, data, args, lr, rnd, s_ref)
        seen = {}
        loss_tog = together_round(
            module, tog, clients, weights, partition, data, args, lr, rnd, s_tog, spy=lambda k, s: seen.update({k: s})
        )
        client_diff = max(client_diff, *(max_diff(states[k], seen[k]) for k in clients))
        losses.append((float(loss_ref), float(loss_tog)))
    if scaffold:
        client_diff = max(client_diff, max_diff(s_ref["c"], s_tog["c"]))
    return client_diff, max_diff(ref.state_dict(), tog.state_dict()), losses


def check(client_diff, global_diff, losses, tol=EXACT):
    assert client_diff <= tol, f"a client's trained parameters differ by {client_diff:.3g}"
    assert global_diff <= tol, f"the new global model differs by {global_diff:.3g}"
    for a, b in losses:  # float32 cross-entropy in both (the scripts' logits.float())
        assert a == pytest.approx(b, rel=1e-6), losses


def test_fedavg_momentum_weight_decay_float64(monkeypatch):  # convolutions, crop-flip augmentation
    flags = ["--model", "cnn", "--shards", "2", "--local-steps", "2", "--momentum", "0.9", "--weight-decay", "5e-4"]
    check(*compare(fedavg, flags + ["--augment", "crop-flip"], monkeypatch))


def test_two_rounds_float64(monkeypatch):  # round 2: other clients, other seeds, from the averaged model
    check(*compare(fedavg, ["--model", "mlp", "--shards", "2", "--local-steps", "3"], monkeypatch, rounds=2))


def test_fedprox_float64(monkeypatch):
    flags = ["--model", "mlp", "--shards", "2", "--local-steps", "3", "--prox-mu", "0.5", "--lr", "0.05"]
    check(*compare(fedavg, flags, monkeypatch))


def test_fedfn_vgg_float64(monkeypatch):  # FN's unit feature into the head, VGG11's layout (narrow), flip
    flags = ["--model", "vgg11-narrow", "--shards", "2", "--local-steps", "2", "--num-clients", "4", "--lr", "0.03"]
    check(*compare(fedfn, flags, monkeypatch))


def test_fedfn_prox_and_scaffold_float64(monkeypatch):  # two rounds, so the second uses nonzero c and c_i
    flags = ["--model", "mlp", "--shards", "2", "--local-steps", "2", "--agg", "scaffold", "--prox-mu", "0.1"]
    check(*compare(fedfn, flags, monkeypatch, rounds=2, scaffold=True))


def test_fedfn_no_fn_and_fedfr_float64(monkeypatch):
    check(*compare(fedfn, ["--model", "mlp", "--iid", "--local-steps", "2", "--no-fn", "--fr-mu", "0.01"], monkeypatch))


def test_unequal_client_sizes_float64(monkeypatch):
    """Power-law client sizes and whole epochs: the clients take different numbers of steps and short last
    batches, so they train in several stacked groups."""
    flags = ["--model", "mlp", "--iid", "--quantity", "powerlaw", "--local-epochs", "1", "--num-clients", "8"]
    args, data, partition, model, clients, weights = setup(fedavg, flags, monkeypatch)
    draws = together.draw_round(clients, weights, partition, data, args, 0)
    assert len(together.groups_by_steps(draws)) == len(clients) > 2  # every client its own step sequence here
    check(*compare(fedavg, flags, monkeypatch))


def test_fedbabu_frozen_head_float64(monkeypatch):
    check(*compare(fedbabu, ["--model", "convnet4-tiny", "--shards", "2", "--local-steps", "3"], monkeypatch))


def test_float32_within_tolerance(monkeypatch):
    flags = ["--model", "cnn", "--shards", "2", "--local-steps", "2", "--augment", "crop-flip"]
    client_diff, global_diff, losses = compare(fedavg, flags, monkeypatch, dtype=torch.float32)
    check(client_diff, global_diff, losses, tol=FLOAT32)


def test_swapped_batches_are_caught(monkeypatch):
    """The comparison can fail: with two clients' drawn batches swapped, their trained parameters differ."""
    drawn = together.draw_round

    def swapped(*a, **kw):
        draws = drawn(*a, **kw)
        first, second = list(draws)[:2]
        draws[first], draws[second] = draws[second], draws[first]
        return draws

    monkeypatch.setattr(together, "draw_round", swapped)
    client_diff, global_diff, _ = compare(
        fedavg, ["--model", "mlp", "--shards", "2", "--local-steps", "3"], monkeypatch
    )
    assert client_diff > 1e-4 and client_diff > 1e6 * EXACT


def test_matches_the_script_run_itself(tmp_path, monkeypatch):
    """Two rounds together (float32) land where fedavg.py's own run of two rounds lands (its model.pt)."""
    flags = ["--model", "mlp", "--shards", "2", "--local-steps", "3", "--augment", "crop-flip", "--rounds", "2"]
    out = tmp_path / "run"
    argv = ["fedavg.py", *TINY, *flags, "--eval-every", "2", "--save-model", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(os.path.join(ROOT, "fedavg.py"), run_name="__main__")
    script_state = torch.load(out / "model.pt")
    args, data, partition, model, _, _ = setup(fedavg, flags, monkeypatch, torch.float32)
    sampler = np.random.default_rng(args.seed)
    for rnd in range(2):
        clients = common.sample_clients(sampler, args.num_clients, args.frac)
        weights = common.client_weights([len(partition.train[k]) for k in clients], args.weighting)
        together.fedavg_round(model, clients, weights, partition, data, args, common.lr_at(rnd, args), rnd)
    assert max_diff(script_state, model.state_dict()) <= FLOAT32

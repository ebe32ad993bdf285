"""fedln.py: normalization layers, FN scale, bias-free Table 7 CNN, SCAFFOLD/FedYogi math, FedAvg
equivalence, resume equality for every --agg, and learning under one class per client."""
import argparse
import json
import math
import os
import sys

import pytest
import torch
import torch.nn as nn

import common
import fedln
from common import Data, FeatureNorm, build_model
from helpers import assert_same_model, metrics, run_batches, summary


def fake_data(size=32, channels=3, n=64):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (n, channels, size, size), dtype=torch.uint8, generator=g)
    y = torch.arange(n) % 10
    return Data(x, y, x, y, 10, torch.full((1, channels, 1, 1), 0.5), torch.full((1, channels, 1, 1), 0.25))


def images(data, n=8):
    return common.prepare_batch(data.x_train[:n], data)


def model_args(**kw):
    base = dict(model="normcnn", norm="ln", ln_affine=True, norm_before_act=False, width=8)
    return argparse.Namespace(**{**base, **kw})


def per_sample_stats(t):
    flat = t.flatten(1)
    return flat.mean(1), flat.var(1, unbiased=False)


def capture(module):
    out = {}
    module.register_forward_hook(lambda m, i, o: out.__setitem__("y", o.detach()))
    return out


# --- normalization layers ------------------------------------------------------------------------
def test_ln_after_relu_zero_mean_unit_variance_per_sample():
    data = fake_data()
    torch.manual_seed(0)
    model = fedln.build(model_args(norm="ln", width=16), data)
    body = model.body
    assert isinstance(body[1], nn.ReLU) and isinstance(body[2], nn.GroupNorm) and body[2].num_groups == 1
    conv_ln, dense_ln = capture(body[2]), capture(body[-1])
    assert isinstance(body[-2], nn.ReLU) and isinstance(body[-1], nn.GroupNorm)
    model.train()
    model(images(data))
    for out, shape in ((conv_ln["y"], (8, 16, 28, 28)), (dense_ln["y"], (8, 384))):
        assert out.shape == shape
        mean, var = per_sample_stats(out)
        assert torch.allclose(mean, torch.zeros(8), atol=1e-5)  # over (C, H, W) per sample
        assert torch.allclose(var, torch.ones(8), atol=1e-3)  # 1 - eps / sigma^2
        assert (out < 0).any()  # normalized after the ReLU: the shift makes some entries negative


def test_norm_before_act_and_static_ln():
    data = fake_data()
    model = fedln.build(model_args(norm="ln", norm_before_act=True, ln_affine=False), data)
    body = model.body
    assert isinstance(body[0], nn.Conv2d) and isinstance(body[1], nn.GroupNorm) and isinstance(body[2], nn.ReLU)
    assert all(not m.affine for m in body.modules() if isinstance(m, nn.GroupNorm))
    out = capture(body[2])
    model(images(data))
    assert (out["y"] >= 0).all()  # the block now ends with the ReLU


def test_gn_has_two_groups_and_bn_is_batch_norm():
    data = fake_data()
    gn = fedln.build(model_args(norm="gn"), data)
    assert [m.num_groups for m in gn.modules() if isinstance(m, nn.GroupNorm)] == [2, 2, 2]
    bn = fedln.build(model_args(norm="bn"), data)
    kinds = [type(m) for m in bn.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert kinds == [nn.BatchNorm2d, nn.BatchNorm2d, nn.BatchNorm1d]


def test_resnet_norm_after_activation_normalizes_stem_and_blocks():
    data = fake_data()
    torch.manual_seed(0)
    model = fedln.build(model_args(model="resnet18", norm="ln"), data)
    stem, block = model.body.stem, model.body.stages[2]  # stages[2]: a downsampling block
    assert isinstance(stem[1], nn.ReLU) and isinstance(stem[2], nn.GroupNorm)
    assert isinstance(block.shortcut[1], nn.Identity)  # the sum is normalized, not the shortcut (Eq. 10)
    outs = [capture(stem), capture(block)]
    model(images(data))
    for out in outs:
        mean, var = per_sample_stats(out["y"])
        assert torch.allclose(mean, torch.zeros(8), atol=1e-5)
        assert torch.allclose(var, torch.ones(8), atol=1e-3)
    default = build_model("resnet18", data, norm="ln", width=8)  # the shared default is unchanged
    assert isinstance(default.body.stem[1], nn.GroupNorm) and isinstance(default.body.stem[2], nn.ReLU)
    assert isinstance(default.body.stages[2].shortcut[1], nn.GroupNorm)


# --- feature normalization -----------------------------------------------------------------------
@pytest.mark.parametrize("model,dim", [("normcnn", 384), ("resnet18", 64)])
def test_fn_features_have_norm_sqrt_d(model, dim):
    data = fake_data()
    torch.manual_seed(0)
    net = fedln.build(model_args(model=model, norm="fn"), data)
    z = net.body(images(data))
    assert z.shape == (8, dim)
    assert torch.allclose(z.norm(dim=1), torch.full((8,), math.sqrt(dim)), rtol=1e-5)
    assert not any(isinstance(m, (nn.GroupNorm, nn.BatchNorm2d)) for m in net.modules())  # nothing inside


def test_feature_norm_formula_and_eps():
    z = torch.tensor([[3.0, 4.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1e-7, 0.0, 0.0, 0.0]])
    out = FeatureNorm(eps=1e-5)(z)
    assert torch.allclose(out[0], torch.tensor([0.6, 0.8, 0.0, 0.0]) * 2)  # sqrt(4) z / ||z||
    assert torch.equal(out[1], torch.zeros(4))  # max(eps, 0): no NaN
    assert torch.allclose(out[2], torch.tensor([2e-7 / 1e-5, 0.0, 0.0, 0.0]))  # below eps: divided by eps


def test_norm_none_is_the_plain_table7_cnn():
    data = fake_data()
    torch.manual_seed(0)
    a = build_model("normcnn", data)  # what fedavg.py --model normcnn builds
    torch.manual_seed(0)
    b = fedln.build(model_args(norm="none", width=64), data)
    assert a.state_dict().keys() == b.state_dict().keys()
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())
    x = images(data)
    assert torch.equal(a(x), b(x))


def test_normcnn_own_fn_slot_matches_fedln_build():
    data = fake_data()
    torch.manual_seed(0)
    a = build_model("normcnn", data, norm="fn", width=8)
    torch.manual_seed(0)
    b = fedln.build(model_args(norm="fn"), data)
    x = images(data)
    assert torch.allclose(a(x), b(x))


# --- Table 7 CNN ---------------------------------------------------------------------------------
@pytest.mark.parametrize("norm", ["none", "ln", "fn", "gn", "bn"])
def test_table7_cnn_has_no_bias(norm):
    data = fake_data()
    static = fedln.build(model_args(norm=norm, ln_affine=False, width=64), data)
    assert not [n for n, _ in static.named_parameters() if "bias" in n]
    learnable = fedln.build(model_args(norm=norm, width=64), data)
    layers = [m for m in learnable.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    assert len(layers) == 4 and all(m.bias is None for m in layers)
    assert [tuple(m.weight.shape) for m in layers] == [(64, 3, 5, 5), (64, 64, 5, 5), (384, 1600), (10, 384)]


def test_table7_cnn_is_scale_equivariant():
    """No bias + ReLU + max-pool: vanilla logits scale with the input, FN logits do not move (Prop. 1)."""
    data = fake_data()
    x = images(data).double()
    vanilla = fedln.build(model_args(norm="none"), data).double().eval()
    assert torch.allclose(vanilla(2.5 * x), 2.5 * vanilla(x), rtol=1e-9, atol=1e-12)
    fn = fedln.build(model_args(norm="fn"), data).double().eval()
    assert torch.allclose(fn(2.5 * x), fn(x), rtol=1e-9, atol=1e-12)


def test_one_channel_and_other_sizes():
    for size, channels in ((28, 1), (32, 3)):
        data = fake_data(size, channels)
        for norm in ("ln", "bn", "fn"):
            assert fedln.build(model_args(norm=norm), data)(images(data)).shape == (8, 10)


# --- aggregation math ----------------------------------------------------------------------------
def test_yogi_update_matches_formula():
    lr, b1, b2, tau = 0.01, 0.9, 0.99, 1e-3
    x0, d1, d2 = [1.0, -2.0, 0.5], [0.5, -0.1, 0.0], [0.01, 0.3, -0.2]
    x, m, v = ({"w": torch.tensor(x0, dtype=torch.float64)}, {"w": torch.zeros(3, dtype=torch.float64)},
               {"w": torch.full((3,), 1e-6, dtype=torch.float64)})
    ex, em, ev = list(x0), [0.0] * 3, [1e-6] * 3
    for d in (d1, d2):
        x, m, v = fedln.yogi_update(x, {"w": torch.tensor(d, dtype=torch.float64)}, m, v, lr, b1, b2, tau)
        for i in range(3):
            em[i] = b1 * em[i] + (1 - b1) * d[i]
            sign = (ev[i] > d[i] ** 2) - (ev[i] < d[i] ** 2)
            ev[i] = ev[i] - (1 - b2) * d[i] ** 2 * sign
            ex[i] = ex[i] + lr * em[i] / (math.sqrt(ev[i]) + tau)
        assert torch.allclose(m["w"], torch.tensor(em, dtype=torch.float64), rtol=1e-12, atol=0)
        assert torch.allclose(v["w"], torch.tensor(ev, dtype=torch.float64), rtol=1e-12, atol=0)
        assert torch.allclose(x["w"], torch.tensor(ex, dtype=torch.float64), rtol=1e-12, atol=0)
    # round 1, coordinate 0 by hand: v grows to 1e-6 + 0.01 * 0.25, step 0.01 * 0.05 / (sqrt(v) + 1e-3)
    v1 = 1e-6 + 0.0025
    assert abs((1.0 + 0.01 * 0.05 / (math.sqrt(v1) + 1e-3)) - fedln.yogi_update(
        {"w": torch.tensor([1.0], dtype=torch.float64)}, {"w": torch.tensor([0.5], dtype=torch.float64)},
        {"w": torch.zeros(1, dtype=torch.float64)}, {"w": torch.full((1,), 1e-6, dtype=torch.float64)},
        lr, b1, b2, tau)[0]["w"].item()) < 1e-12
    # v shrinks when v > D^2 (the Yogi sign), where Adam's v would grow
    _, _, v_big = fedln.yogi_update({"w": torch.zeros(1)}, {"w": torch.tensor([0.1])}, {"w": torch.zeros(1)},
                                    {"w": torch.tensor([1.0])}, lr, b1, b2, tau)
    assert torch.allclose(v_big["w"], torch.tensor([1.0 - 0.01 * 0.01]))


def test_scaffold_option_ii_matches_formula():
    c_k, c = {"w": torch.tensor([0.1, -0.2])}, {"w": torch.tensor([0.3, 0.0])}
    x, y = {"w": torch.tensor([1.0, 1.0])}, {"w": torch.tensor([0.8, 1.1])}
    new = fedln.scaffold_control(c_k, c, x, y, steps=4, lr=0.05)
    expected = torch.tensor([0.1 - 0.3 + 0.2 / 0.2, -0.2 - 0.0 - 0.1 / 0.2])
    assert torch.allclose(new["w"], expected)


# --- end to end: each stage is ONE python process that runs the scripts one after another ------------
BASE = ["--dataset", "synthetic", "--device", "cpu", "--batch-size", "8", "--seed", "3"]
AGGS = [("fedavg", "bn"), ("fedprox", "ln"), ("scaffold", "fn"), ("fedyogi", "bn")]
EQUAL = [*BASE, "--model", "mlp", "--num-clients", "4", "--frac", "0.5", "--classes-per-client", "2", "--local-steps",
         "2", "--rounds", "2", "--eval-every", "1", "--lr", "0.05", "--momentum", "0.9", "--weight-decay", "5e-4",
         "--save-model"]
LEARN = [*BASE, "--width", "8", "--batch-size", "16", "--local-steps", "3", "--rounds", "8", "--eval-every", "8",
         "--lr", "0.02", "--track-singular-values"]  # defaults: 10 clients, all per round, 1 class each


def resume_flags(agg, norm):
    return [*BASE, "--width", "4", "--num-clients", "4", "--frac", "0.5", "--local-steps", "2", "--rounds", "3",
            "--eval-every", "1", "--lr", "0.05", "--agg", agg, "--norm", norm, "--save-model"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Stage 1 (two processes): fedavg.py vs fedln.py --norm none (mlp: the loop is compared, the model is
    in test_norm_none_is_the_plain_table7_cnn), the one-class runs, and for each --agg an uninterrupted run
    and one stopped after round 1. Stage 2 (a fresh process): resume the stopped runs."""
    d = tmp_path_factory.mktemp("fedln")
    run_batches([["fedavg.py", *EQUAL, "--out", d / "avg"], ["fedln.py", *EQUAL, "--norm", "none", "--agg", "fedavg", "--out", d / "plain"],
            *[["fedln.py", *LEARN, "--norm", n, "--out", d / n] for n in ("ln", "fn", "none")]],
           [c for agg, norm in AGGS for c in (["fedln.py", *resume_flags(agg, norm), "--out", d / f"{agg}_full"],
                                              ["fedln.py", *resume_flags(agg, norm), "--out", d / f"{agg}_cut",
                                               "--stop-after", "1"])])
    cut = {agg: torch.load(d / f"{agg}_cut" / "checkpoint.pt", weights_only=False) for agg, _ in AGGS}
    run_batches([["fedln.py", "--resume", d / f"{agg}_cut"] for agg, _ in AGGS])
    return d, cut


def test_norm_none_fedavg_reproduces_fedavg_py(runs):
    d, _ = runs
    assert len(metrics(d / "avg")) == 2
    assert metrics(d / "avg") == metrics(d / "plain")
    assert_same_model(d / "avg", d / "plain")


@pytest.mark.parametrize("agg", [a for a, _ in AGGS])
def test_resume_equals_uninterrupted(runs, agg):
    d, cut = runs
    server = cut[agg]["server"]
    assert cut[agg]["round"] == 1  # the run really stopped after round 1
    if agg == "scaffold":  # the method state travels in the checkpoint
        assert len(server["c_k"]) == 4 and any(v.abs().sum() > 0 for v in server["c"].values())
    if agg == "fedyogi":
        assert any(v.abs().sum() > 0 for v in server["m"].values())
        assert all((v > 0).all() for v in server["v"].values())
    full, cut = d / f"{agg}_full", d / f"{agg}_cut"
    assert len(metrics(full)) == 3
    assert metrics(full) == metrics(cut)
    assert_same_model(full, cut)


def test_one_class_per_client_beats_chance_with_ln_and_fn(runs):
    """Measured: ln 0.77, fn 0.51, vanilla (--norm none) 0.17 after these 8 rounds (chance 0.1)."""
    d, _ = runs
    with open(d / "ln" / "partition.json") as f:
        assert all(sum(c > 0 for c in counts) == 1 for counts in json.load(f)["train"])
    vanilla = summary(d / "none")["test_acc"]
    for norm in ("ln", "fn"):
        s = summary(d / norm)
        assert s["test_acc"] > 0.3 and s["test_acc"] > vanilla + 0.1, (norm, s["test_acc"], vanilla)
        sv = s["feature_sv"]
        assert len(sv) == 20 and all(a >= b >= 0 for a, b in zip(sv, sv[1:]))
        assert len(s["feature_sv_unit"]) == 20


@pytest.mark.parametrize("flags,flag", [(["--model", "cnn", "--norm", "ln"], "--norm"),
                                        (["--model", "resnet18", "--no-ln-affine"], "--no-ln-affine"),
                                        (["--local-steps", "0"], "--local-steps")])
def test_bad_flags_exit_2_naming_the_flag(monkeypatch, capsys, flags, flag):
    monkeypatch.setattr(sys, "argv", ["fedln.py", *BASE, *flags, "--out", "unused"])
    with pytest.raises(SystemExit) as exit_info:
        fedln.parse_args()
    assert exit_info.value.code == 2 and flag in capsys.readouterr().err


def test_defaults_are_the_papers(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["fedln.py", "--device", "cpu", "--out", "unused"])
    a = fedln.parse_args()
    assert (a.norm, a.agg, a.model, a.num_clients, a.frac, a.classes_per_client, a.local_steps) == \
        ("ln", "fedavg", "normcnn", 10, 1.0, 1, 10)
    assert (a.lr, a.momentum, a.weight_decay, a.batch_size, a.augment, a.rounds, a.eval_every) == \
        (0.01, 0.0, 0.0, 32, "crop-flip", 10000, 100)
    assert (a.server_lr, a.yogi_beta1, a.yogi_beta2, a.yogi_tau, a.yogi_v0, a.prox_mu, a.ln_affine) == \
        (0.01, 0.9, 0.99, 1e-3, 1e-6, 0.01, True)

"""fedfn.py: unit-norm features, SCAFFOLD / FedEXP math, the four factors, --no-fn == fedavg.py,
interrupted-and-resumed == uninterrupted for every --agg, and learning above chance."""

import argparse
import math
import os
import sys

import pytest
import torch
import torch.nn as nn

import fedfn
import common
from common import Classifier, Data, synthetic_dataset
from helpers import assert_same_model, metrics, run_batches, summary

AGGS = ["fedavg", "scaffold", "fedexp"]


# ---------------------------------------------------------------------------------------------
# In-process: feature normalization
# ---------------------------------------------------------------------------------------------
def tiny_data(n=24, size=8):
    d = synthetic_dataset(argparse.Namespace(data_seed=0), n_train=n, n_test=n, size=size)
    x, y, xt, yt = d["x_train"], d["y_train"], d["x_test"], d["y_test"]
    xf = x.float() / 255
    return Data(x, y, xt, yt, 10, xf.mean((0, 2, 3), keepdim=True), xf.std((0, 2, 3), keepdim=True))


def tiny_model(seed=0, size=8):
    torch.manual_seed(seed)
    body = nn.Sequential(nn.Flatten(), nn.Linear(3 * size * size, 16), nn.ReLU())
    return Classifier(body, 16, 10)


def tiny_args(**kw):
    base = dict(
        lr=0.1,
        momentum=0.0,
        weight_decay=0.0,
        prox_mu=0.0,
        fr_mu=0.0,
        fn=True,
        fn_scale=1.0,
        device="cpu",
        amp=False,
        batch_size=8,
        local_epochs=None,
        local_steps=1,
        augment="none",
        analyze=None,
    )
    return argparse.Namespace(**{**base, **kw})


def test_features_reaching_the_head_have_unit_norm():
    data, model = tiny_data(), tiny_model()
    seen = []
    model.head.register_forward_pre_hook(lambda m, inp: seen.append(inp[0].detach()))
    x = torch.randn(5, 3, 8, 8) * 3
    logits, f = fedfn.fn_forward(model, x, fn=True)
    assert torch.allclose(seen[-1].norm(dim=1), torch.ones(5), atol=1e-5)
    assert f.norm(dim=1).max() > 1.5, "the raw feature is not normalized itself"
    assert torch.allclose(logits, model.head(f / f.norm(dim=1, keepdim=True)), atol=1e-6)
    seen.clear()
    fedfn.local_train(model, torch.arange(24), data, tiny_args(local_steps=3), 0.1, None)  # training path
    assert len(seen) == 3 and all(torch.allclose(s.norm(dim=1), torch.ones(len(s)), atol=1e-5) for s in seen)
    logits_nofn, f2 = fedfn.fn_forward(model, x, fn=False)  # --no-fn: exactly model(x)
    assert torch.equal(logits_nofn, model(x)) and not torch.allclose(seen[-1].norm(dim=1), torch.ones(5))


def test_fn_makes_the_last_body_layer_scale_invariant():
    """With FN the loss depends on f / ||f|| only, and f = relu(W h + b) scales with (W, b): the gradient of
    the loss is orthogonal to (W, b), so one plain SGD step lengthens it by exactly lr^2 ||g||^2. Without FN
    neither holds."""
    data = tiny_data()
    x, y = common.prepare_batch(data.x_train[:8], data), data.y_train[:8]
    for fn in (True, False):
        model = tiny_model()
        layer = fedfn.invariant_layer(model)
        assert layer is model.body[1]  # the Linear before the ReLU
        torch.nn.functional.cross_entropy(fedfn.fn_forward(model, x, fn)[0], y).backward()
        w = torch.cat([layer.weight.detach().flatten(), layer.bias.detach()])
        g = torch.cat([layer.weight.grad.flatten(), layer.bias.grad])
        lr, before = 0.7, float(fedfn.param_norm(layer) ** 2)
        with torch.no_grad():
            for p in layer.parameters():
                p -= lr * p.grad
        grown, expected = float(fedfn.param_norm(layer) ** 2) - before, lr**2 * float(g @ g)
        if fn:
            assert abs(float(w @ g)) < 1e-6 * float(w.norm() * g.norm())
            assert grown == pytest.approx(expected, rel=1e-3)
        else:
            assert abs(float(w @ g)) > 1e-4 * float(w.norm() * g.norm())

        def loss():
            return float(torch.nn.functional.cross_entropy(fedfn.fn_forward(model, x, fn)[0], y).detach())

        before = loss()
        with torch.no_grad():
            for p in layer.parameters():
                p *= 3.0
        assert (loss() == pytest.approx(before, rel=1e-5)) == fn  # scale-invariant with FN only


def test_local_train_reports_the_feature_norm_of_its_first_and_last_batch():
    data = tiny_data()
    model = tiny_model()
    batches = [torch.arange(0, 8), torch.arange(8, 16)]  # with --local-steps 2 and no shuffling: these two
    common_batches = common.client_batches
    try:
        fedfn.client_batches = lambda *a, **k: iter(batches)
        expect_first = model.body(common.prepare_batch(data.x_train[:8], data)).norm(dim=1).mean().detach()
        snapshot = {k: v.clone() for k, v in model.state_dict().items()}
        _, steps, (first, last) = fedfn.local_train(
            model, torch.arange(16), data, tiny_args(analyze="every"), 0.5, None
        )
        after_one = tiny_model()
        after_one.load_state_dict(snapshot)
        fedfn.client_batches = lambda *a, **k: iter(batches[:1])
        fedfn.local_train(after_one, torch.arange(8), data, tiny_args(), 0.5, None)
        expect_last = after_one.body(common.prepare_batch(data.x_train[8:16], data)).norm(dim=1).mean().detach()
    finally:
        fedfn.client_batches = common_batches
    assert steps == 2
    assert float(first) == pytest.approx(float(expect_first), rel=1e-6)
    assert float(last) == pytest.approx(float(expect_last), rel=1e-6) and float(last) != float(first)
    assert fedfn.local_train(model, torch.arange(8), data, tiny_args(), 0.5, None)[2] == (None, None)  # off


def test_client_traces_by_hand():
    traces = torch.tensor([[1.0, 2.0, 10.0], [3.0, 6.0, 14.0]])  # per client: ||f|| first, last, ||layer||
    got = fedfn.client_traces(traces, torch.tensor(11.0))
    assert got == {
        "client_feature_norm_start": 2.0,
        "client_feature_norm_end": 4.0,
        "client_feature_norm_end_std": 2.0,  # population std of (2, 6)
        "client_invariant_norm": 12.0,
        "invariant_norm": 11.0,
    }


def test_fn_logits_by_hand_axis_and_scale():
    """z = W (s f/||f||_2) + b on a hand-made model: each row (sample) is normalized, not each column."""
    model = Classifier(nn.Identity(), 2, 2)
    with torch.no_grad():
        model.head.weight.copy_(torch.tensor([[1.0, 0.0], [1.0, 2.0]]))
        model.head.bias.copy_(torch.tensor([0.5, -1.0]))
    # 3 samples of d = 2 (not square, so the batch size cannot stand in for d): norms 5, 2, 1,
    # unit rows [0.6, 0.8], [0, 1], [-1, 0]
    f = torch.tensor([[3.0, 4.0], [0.0, 2.0], [-1.0, 0.0]])
    r2 = 2**0.5
    expect = {
        1.0: [[1.1, 1.2], [0.5, 1.0], [-0.5, -2.0]],  # s = 1 (the paper)
        5.0: [[3.5, 10.0], [0.5, 9.0], [-4.5, -6.0]],
        "sqrt-d": [[0.5 + 0.6 * r2, -1 + 2.2 * r2], [0.5, -1 + 2 * r2], [0.5 - r2, -1 - r2]],  # s = sqrt(2)
    }
    for scale, z in expect.items():
        logits, feat = fedfn.fn_forward(model, f, fn=True, scale=scale)
        assert torch.allclose(logits, torch.tensor(z), atol=1e-6), scale
        assert torch.equal(feat, f)
    assert torch.allclose(fedfn.fn_forward(model, f)[0], torch.tensor(expect[1.0]))  # the defaults: FN, s = 1
    # a feature of norm 1e-7 is still made a unit vector (the norm is clamped at 1e-12, as F.normalize does)
    assert torch.allclose(fedfn.fn_forward(model, torch.tensor([[1e-7, 0.0]]))[0], torch.tensor([[1.5, 0.0]]))
    assert torch.allclose(
        fedfn.fn_forward(model, f, fn=False)[0], torch.tensor([[3.5, 10.0], [0.5, 3.0], [-0.5, -2.0]])
    )
    assert fedfn.fn_scale("sqrt-d") == "sqrt-d" and fedfn.fn_scale("2.5") == 2.5
    for bad in ("0", "-1", "big"):
        with pytest.raises(argparse.ArgumentTypeError):
            fedfn.fn_scale(bad)


def test_fr_mu_adds_mu_times_feature_norm_gradient():
    data = tiny_data()
    grads = []
    for mu in (0.0, 0.5):
        model = tiny_model()
        torch.manual_seed(1)
        fedfn.local_train(model, torch.arange(8), data, tiny_args(fn=False, fr_mu=mu, batch_size=8), 1.0, None)
        grads.append([p.detach().clone() for p in model.parameters()])
    model = tiny_model()  # one step at lr 1 differs by -mu * d mean_x ||f(x)||_2 / d theta (Eq. 1)
    model.body(fedfn.prepare_batch(data.x_train[:8], data)).norm(dim=1).mean().backward()
    for a, b, p in zip(grads[0], grads[1], model.parameters()):
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        assert torch.allclose(b - a, -0.5 * g, atol=1e-5)


def test_vgg11_layout():
    """FedNTD's vgg11 (no batch norm): torchvision's VGG11 conv stack, fc 512 -> 512 -> 512, head."""
    import torchvision
    from common import MODELS

    model = MODELS["vgg11"](3, 10, 32)
    convs = [m for m in model.body.modules() if isinstance(m, nn.Conv2d)]
    assert [c.out_channels for c in convs] == [64, 128, 256, 256, 512, 512, 512, 512]
    assert not any(isinstance(m, (nn.BatchNorm2d, nn.Dropout)) for m in model.modules())
    reference = torchvision.models.vgg11().features  # an independent count of cfg "A"'s convolutions
    assert sum(p.numel() for c in convs for p in c.parameters()) == sum(p.numel() for p in reference.parameters())
    assert sum(p.numel() for p in model.parameters()) == 9_750_922  # 9,220,480 conv + 2 x fc 512 + head 5,130
    assert model.head.in_features == 512 and model.head.out_features == 10 and model.head.bias is not None
    small = MODELS["vgg11"](1, 62, 28).eval()  # EMNIST-size input: the last pool is skipped at 1x1
    assert small(torch.randn(2, 1, 28, 28)).shape == (2, 62)


# ---------------------------------------------------------------------------------------------
# In-process: SCAFFOLD and FedEXP math on hand-made tensors
# ---------------------------------------------------------------------------------------------
def test_scaffold_correction_is_added_to_the_gradient():
    data, steps = tiny_data(), []
    for corr in (False, True):
        model = tiny_model()
        # a different c - c_i per parameter, so a correction that lands on another parameter shows
        correction = {n: torch.full_like(p, 0.3 * (i + 1)) for i, (n, p) in enumerate(model.named_parameters())}
        correction = correction if corr else None
        torch.manual_seed(1)
        steps.append(
            (
                fedfn.local_train(model, torch.arange(8), data, tiny_args(), 0.5, None, correction)[1],
                [p.detach().clone() for p in model.parameters()],
            )
        )
    assert steps[0][0] == steps[1][0] == 1
    for i, (a, b) in enumerate(zip(steps[0][1], steps[1][1])):  # y <- y - lr (g - c_i + c)
        assert torch.allclose(b - a, torch.full_like(a, -0.5 * 0.3 * (i + 1)), atol=1e-6)


def test_scaffold_loop_divides_by_the_momentum_step_sum(monkeypatch, tmp_path):
    """fedfn.py's loop hands local_step_sum the client's K and --momentum (option II divides by K' lr, not K lr);
    the step sum's own formula is tested in test_common."""
    import runpy

    seen = []
    real = common.local_step_sum
    monkeypatch.setattr(common, "local_step_sum", lambda *a: seen.append(a) or real(*a))
    flags = ["--dataset", "synthetic", "--device", "cpu", "--model", "mlp", "--num-clients", "2", "--frac", "1"]
    flags += ["--local-steps", "3", "--rounds", "1", "--agg", "scaffold", "--momentum", "0.5", "--lr", "0.05"]
    monkeypatch.setattr(sys, "argv", ["fedfn.py", *flags, "--out", str(tmp_path / "run")])
    runpy.run_path(os.path.join(os.path.dirname(fedfn.__file__), "fedfn.py"), run_name="__main__")
    assert seen == [(3, 0.05, 0.5), (3, 0.05, 0.5)]  # (K, lr, rho) for each of the two clients


def test_fedexp_step_by_hand():
    """Jhunjhunwala et al. 2023, Alg. 1 on two tensors, three clients with p_i = 1/3, eps = 1/6.
    From w_t = ([0, 0, 0], [1]):
    y_1 = ([2, 0, 0], [1]), y_2 = ([0, 2, 0], [1]), y_3 = ([0, 0, 2], [4]): ||Delta_i||^2 = 4, 4, 13, mean 7;
    the average is ([2/3] * 3, [2]), so ||Delta_bar||^2 = 3 (2/3)^2 + 1 = 7/3 and eta_g = 7 / (2 (7/3 + 1/6)) = 1.4;
    w_{t+1} = w_t + 1.4 (average - w_t) = ([14/15] * 3, [2.4]); the evaluated midpoint ([7/15] * 3, [1.7])."""
    x_old = [torch.zeros(3), torch.tensor([1.0])]
    ys = [
        [torch.tensor([2.0, 0, 0]), torch.tensor([1.0])],
        [torch.tensor([0, 2.0, 0]), torch.tensor([1.0])],
        [torch.tensor([0, 0, 2.0]), torch.tensor([4.0])],
    ]
    sq = [fedfn.sq_dist(x_old, y) for y in ys]
    assert [float(v) for v in sq] == [4.0, 4.0, 13.0]
    avg = [sum(y[j] for y in ys) / 3 for j in range(2)]
    eta = fedfn.fedexp_step(avg, x_old, sum(sq) / 3, eps=1 / 6)
    assert eta == pytest.approx(1.4)
    assert torch.allclose(avg[0], torch.full((3,), 14 / 15)) and torch.allclose(avg[1], torch.tensor([2.4]))
    fedfn.midpoint_(avg, x_old)
    assert torch.allclose(avg[0], torch.full((3,), 7 / 15)) and torch.allclose(avg[1], torch.tensor([1.7]))
    same = [torch.tensor([1.0, 2.0, 2.0]), torch.tensor([3.0])]  # all clients agree: eta_g = 1, FedAvg's step
    assert fedfn.fedexp_step(same, x_old, fedfn.sq_dist(same, x_old), eps=1e-3) == 1.0
    assert torch.equal(same[0], torch.tensor([1.0, 2.0, 2.0])) and torch.equal(same[1], torch.tensor([3.0]))


def test_prox_term_by_hand_and_in_local_train():
    w = [torch.tensor([1.0, 2.0], requires_grad=True), torch.tensor([[3.0]], requires_grad=True)]
    value = common.prox_term(w, [torch.tensor([0.0, 4.0]), torch.tensor([[1.0]])], mu=0.5)  # 0.25 (1 + 4 + 4)
    assert value.item() == pytest.approx(2.25)
    data, after = tiny_data(), []
    for mu in (0.0, 0.4):  # one plain SGD step: prox - plain = -lr mu (w - w_t)
        model = tiny_model()
        init = [p.detach().clone() for p in model.parameters()]
        anchor = [p + 0.1 * torch.randn_like(p) for p in init]
        torch.manual_seed(1)
        fedfn.local_train(model, torch.arange(8), data, tiny_args(prox_mu=mu), 0.5, anchor)
        after.append([p.detach().clone() for p in model.parameters()])
    for a, b, w0, wt in zip(after[0], after[1], init, anchor):
        assert torch.allclose(b - a, -0.5 * 0.4 * (w0 - wt), atol=1e-6)


def test_fedexp_server_step_matches_formula_and_is_at_least_one():
    deltas = [torch.tensor([1.0, 0.0]), torch.tensor([-1.0, 0.5])]
    p = [0.5, 0.5]
    sq = sum(w * d.pow(2).sum() for w, d in zip(p, deltas))  # 0.5 * 1 + 0.5 * 1.25 = 1.125
    bar = sum(w * d for w, d in zip(p, deltas))  # [0, 0.25]
    eta = fedfn.fedexp_server_lr(sq, bar.pow(2).sum(), eps=1e-3)
    assert eta == pytest.approx(1.125 / (2 * (0.0625 + 1e-3)))  # sum ||D_i||^2 / (2M(||D_bar||^2 + eps))
    assert eta > 8
    same = torch.tensor([0.3, -0.4])  # identical updates: ratio 1/2 -> clipped to 1 (FedAvg step)
    assert fedfn.fedexp_server_lr(same.pow(2).sum(), same.pow(2).sum(), eps=1e-3) == 1.0
    assert fedfn.fedexp_server_lr(0.0, 0.0, eps=1e-3) == 1.0


# ---------------------------------------------------------------------------------------------
# In-process: the four factors on a hand-built model
# ---------------------------------------------------------------------------------------------
def test_four_factors_on_hand_built_model():
    # features are the pixels of 2-channel 1x1 images; mean 0, std 1/255 make the normalized input = the pixel
    x = torch.tensor([[3, 0], [1, 1], [0, 2], [0, 4]], dtype=torch.uint8).view(4, 2, 1, 1)
    y = torch.tensor([0, 0, 1, 1])
    data = Data(x, y, x, y, 2, torch.zeros(1, 2, 1, 1), torch.full((1, 2, 1, 1), 1 / 255))
    model = Classifier(nn.Flatten(), 2, 2)
    with torch.no_grad():
        model.head.weight.copy_(torch.tensor([[1.0, 0.0], [1.0, 1.0]]))
    s2 = math.sqrt(2)
    # class 0 with FN: prototype = mean([1,0], [1,1]/s2) ; class 1: [0, 1]
    p0 = torch.tensor([1 + 1 / s2, 1 / s2]) / 2
    p0 = p0 / p0.norm()
    p1 = torch.tensor([0.0, 1.0])
    want = {
        "weight_sim": 1 / s2,  # cos([1,0],[1,1])
        "inter_class_sim": float(p0 @ p1),
        "intra_class_sim": (float((p0[0] + (p0[0] + p0[1]) / s2) / 2) + 1.0) / 2,
        "proto_weight_align": (float(p0[0]) + 1 / s2) / 2,
        "feature_norm": (3 + s2 + 2 + 4) / 4,
        "head_row_norm": (1 + s2) / 2,  # rows [1, 0] and [1, 1]
    }
    got = fedfn.analyze(model, data, argparse.Namespace(fn=True, fn_scale=1.0))
    for k, v in want.items():
        assert got[k] == pytest.approx(v, abs=1e-5), k
    # without FN the prototypes average raw features: class 0 -> [2, 0.5]
    got = fedfn.analyze(model, data, argparse.Namespace(fn=False, fn_scale=1.0))
    q0 = torch.tensor([2.0, 0.5]) / math.hypot(2.0, 0.5)
    assert got["inter_class_sim"] == pytest.approx(float(q0[1]), abs=1e-5)
    assert got["proto_weight_align"] == pytest.approx((float(q0[0]) + 1 / s2) / 2, abs=1e-5)


def test_bad_method_flags_exit_2(monkeypatch, capsys):
    for flags in (
        ["--ft-epochs", "2"],
        ["--fr-mu", "-1"],
        ["--fedexp-eps", "0"],
        ["--agg", "fedprox"],
        ["--fn-scale", "0"],
    ):
        monkeypatch.setattr(sys, "argv", ["fedfn.py", "--dataset", "synthetic", "--device", "cpu", *flags])
        with pytest.raises(SystemExit) as e:
            fedfn.parse_args()
        assert e.value.code == 2, flags
    monkeypatch.setattr(sys, "argv", ["fedfn.py", "--dataset", "synthetic", "--device", "cpu", "--out", "x"])
    args = fedfn.parse_args()  # the paper's defaults
    assert (
        args.model,
        args.num_clients,
        args.frac,
        args.shards,
        args.local_epochs,
        args.batch_size,
        args.rounds,
        args.lr,
        args.momentum,
        args.weight_decay,
        args.lr_decay_at,
        args.lr_decay,
        args.augment,
        args.fn,
        args.agg,
        args.fn_scale,
    ) == ("vgg11", 100, 0.1, 10, 15, 50, 320, 0.03, 0.9, 0.0, [0.5, 0.75], 0.1, "flip", True, "fedavg", 1.0)


# ---------------------------------------------------------------------------------------------
# End to end: each process costs ~5 s of CPU before it trains (importing torch, and torch._dynamo at the
# first optimizer), so the runs share processes (helpers.run_batches) and every run proves several things.
# ---------------------------------------------------------------------------------------------
# The 2NN MLP, 4 clients, all per round, 2 local steps: ~0.8 accuracy after 3 rounds, so FedFN-FT has
# something to gain (FN bounds the logits by ||theta_cls,c||, so it wants a large lr early; the paper
# tunes it up too). A copy stopped after round 2 (--stop-after 2) is resumed in a fresh process, which
# does round 3 (at the decayed lr) from the round-2 checkpoint; evaluating every round makes a resume that
# restarted from scratch log duplicate rows.
E2E = [
    "--dataset",
    "synthetic",
    "--device",
    "cpu",
    "--model",
    "mlp",
    "--num-clients",
    "4",
    "--frac",
    "1",
    "--shards",
    "5",
    "--local-steps",
    "2",
    "--batch-size",
    "32",
    "--rounds",
    "3",
    "--lr",
    "0.5",
    "--lr-decay-at",
    "0.75",
    "--checkpoint-every",
    "2",
    "--analyze",
    "--save-model",
]
# --no-fn vs fedavg.py: every shared code path on (momentum, weight decay, FedProx, crop-flip, lr decay,
# per-client test sets); fedfn.py's own defaults differ, so all of them are passed.
NOFN = [
    "--dataset",
    "synthetic",
    "--device",
    "cpu",
    "--model",
    "mlp",
    "--num-clients",
    "4",
    "--frac",
    "0.5",
    "--shards",
    "2",
    "--local-steps",
    "3",
    "--batch-size",
    "16",
    "--rounds",
    "3",
    "--eval-every",
    "2",
    "--lr",
    "0.05",
    "--momentum",
    "0.9",
    "--weight-decay",
    "5e-4",
    "--prox-mu",
    "0.01",
    "--augment",
    "crop-flip",
    "--lr-decay-at",
    "0.5",
    "--client-test",
    "--save-model",
]
FACTORS = ("weight_sim", "inter_class_sim", "intra_class_sim", "proto_weight_align", "feature_norm")
EXTRA = {"fedavg": ["--client-test", "--ft-epochs", 1, "--lr-decay-at", 0.3, 0.6], "scaffold": [], "fedexp": []}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """fedavg.py and fedfn.py --no-fn (each in its own process), and an uninterrupted FN run per --agg: two
    processes of helpers.run_batches (most of a tiny run's CPU is importing torch)."""
    d = tmp_path_factory.mktemp("fedfn")
    # FedFN-FT rides on the FN + fedavg run, FedAvg-FT on the --no-fn run (summary.json only)
    # (the decay at rounds 1 and 2 keeps accuracy low enough for FedFN-FT to have room to help)
    full = [["fedfn.py", *E2E, "--agg", agg, *EXTRA[agg], "--out", d / f"{agg}_full"] for agg in AGGS]
    run_batches(
        [["fedavg.py", *NOFN, "--out", d / "fedavg_py"], *full[:2]],
        [["fedfn.py", *NOFN, "--no-fn", "--ft-epochs", 1, "--out", d / "nofn"], *full[2:]],
    )
    return d


@pytest.fixture(scope="module")
def resumed(runs):
    """Each --agg run again, stopped after round 2, then resumed in a fresh process: runs / <agg>."""
    run_batches([["fedfn.py", *E2E, "--agg", agg, *EXTRA[agg], "--stop-after", 2, "--out", runs / agg] for agg in AGGS])
    for agg in AGGS:
        assert torch.load(runs / agg / "checkpoint.pt", weights_only=False)["round"] == 2
    run_batches([["fedfn.py", "--resume", runs / agg] for agg in AGGS])
    return runs


def test_no_fn_reproduces_fedavg_exactly(runs):
    a, b = metrics(runs / "fedavg_py"), metrics(runs / "nofn")
    assert [r["round"] for r in a] == [2, 3] and "client_test_acc_mean" in a[0]
    assert a == b
    assert_same_model(runs / "fedavg_py", runs / "nofn")
    s = summary(runs / "nofn")  # the per-client fine-tuning of --ft-epochs (common.personalize)
    assert s["ft_acc_mean_before"] == pytest.approx(a[-1]["client_test_acc_mean"])
    assert s["ft_acc_mean"] > s["ft_acc_mean_before"] + 0.2 and s["ft_lr"] == pytest.approx(0.005)


def UNTIMED(x):
    return {k: v for k, v in x.items() if k not in ("elapsed_s", "wall_time_s")}


@pytest.mark.slow  # a second run of each --agg, stopped and resumed in a fresh process
@pytest.mark.parametrize("agg", AGGS)
def test_resumed_equals_uninterrupted(resumed, agg):
    full, cut = resumed / f"{agg}_full", resumed / agg
    assert metrics(cut) == metrics(full)
    assert_same_model(full, cut)
    assert UNTIMED(summary(full)) == UNTIMED(summary(cut))


@pytest.mark.parametrize("agg", AGGS)
def test_every_agg_learns(runs, agg):
    full = runs / f"{agg}_full"
    rows = metrics(full)
    assert [r["round"] for r in rows] == [1, 2, 3]
    ckpt = torch.load(os.path.join(full, "checkpoint.pt"), weights_only=False)
    assert ckpt["round"] == 3  # --checkpoint-every 2 of 3 rounds: the final round is checkpointed too
    if agg == "scaffold":  # control variates travel with the checkpoint
        assert len(ckpt["scaffold_c_local"]) == 4 and any(c.abs().max() > 0 for c in ckpt["scaffold_c"].values())
    s = summary(full)
    assert s["test_acc"] > 0.25, f"{agg}: {s['test_acc']} is not clearly above chance (0.1)"
    assert all(math.isfinite(s[k]) for k in FACTORS)
    if agg == "fedexp":
        assert all(r["server_lr"] >= 1.0 for r in rows) and any(r["server_lr"] > 1.1 for r in rows)
    if agg == "fedavg":  # FedFN-FT: evaluates with FN (the same accuracy as the last evaluation) and helps
        assert s["ft_acc_mean_before"] == pytest.approx(rows[-1]["client_test_acc_mean"]) and s["test_acc"] < 0.95
        assert s["ft_acc_mean"] > s["ft_acc_mean_before"] + 0.1 and s["ft_lr"] == pytest.approx(0.05)

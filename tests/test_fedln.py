"""fedln.py: normalization layers, FN scale, Props. 1-2 (Table 3's variants), bias-free Table 7 CNN,
FedProx / SCAFFOLD / FedYogi math against hand computations and closed forms, Figure 3's singular values,
FedAvg equivalence, resume equality for every --agg, learning under one class per client; and common.py's
refusals after the data is loaded (exit 2, one line)."""

import argparse
import json
import math
import os
import sys
import urllib.error

import numpy as np
import pytest
import torch
import torch.nn as nn

import common
import fedln
from common import Data, build_model
from fedln import ScaleNorm
from helpers import assert_same_model, metrics, prepare, run_batches, run_script, summary


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
    assert all(m.affine and m.weight is not None for m in body if isinstance(m, nn.GroupNorm))  # --ln-affine reaches it
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
    out = ScaleNorm(eps=1e-5)(z)
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


# --- Table 3: last-layer normalization (Props. 1 and 2) --------------------------------------------
def test_scale_norm_by_hand_on_non_square_inputs():
    """n(z) = s z / ||z|| per sample: B = 4 features of d = 4 (norms 5, 2, 2, 0.03), and 2 conv maps of (C, H, W) =
    (2, 1, 3), each normalized over its 6 entries; s = sqrt(d) by default, or a number."""
    z = torch.tensor([[3.0, 4.0, 0.0, 0.0], [0.0, 0.0, 0.0, 2.0], [1.0, 1.0, 1.0, 1.0], [0.0, -0.03, 0.0, 0.0]])
    unit = torch.tensor([[0.6, 0.8, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [0.0, -1.0, 0.0, 0.0]])
    assert torch.allclose(ScaleNorm(scale=1.0)(z), unit)
    assert torch.allclose(ScaleNorm()(z), 2 * unit)  # sqrt(4) of d, whatever the batch size
    assert torch.allclose(ScaleNorm(scale=0.5)(z), 0.5 * unit)
    maps = torch.stack([torch.arange(1.0, 7.0), torch.full((6,), -2.0)]).view(2, 2, 1, 3)  # norms sqrt(91), sqrt(24)
    want = torch.stack([torch.arange(1.0, 7.0) / math.sqrt(91), torch.full((6,), -2.0 / math.sqrt(24))])
    assert torch.allclose(ScaleNorm()(maps), math.sqrt(6) * want.view(2, 2, 1, 3))
    tiny = torch.tensor([[1e-7, 0.0, 0.0, 0.0]])  # ||z|| below eps: divided by eps, no blow-up
    assert torch.allclose(ScaleNorm(scale=1.0, eps=1e-5)(tiny), torch.tensor([[1e-2, 0.0, 0.0, 0.0]]))


def test_scale_norm_and_mean_shift_by_hand():
    x = torch.tensor([1.0, 2.0, 2.0, 4.0]).view(1, 2, 1, 2)  # one sample, d = C*H*W = 4, ||x|| = 5
    assert torch.allclose(ScaleNorm()(x), x * 2 / 5)  # sqrt(4) x / ||x||, over all of (C, H, W)
    assert torch.allclose(fedln.MeanShift()(x), torch.tensor([-1.25, -0.25, -0.25, 1.75]).view(1, 2, 1, 2))  # mean 2.25
    three = torch.tensor([[3.0, 4.0], [0.0, 1.0], [-2.0, 0.0]])  # per sample, not over the batch (3 x 2)
    assert torch.allclose(ScaleNorm()(three), torch.tensor([[0.6, 0.8], [0.0, 1.0], [-1.0, 0.0]]) * math.sqrt(2))
    assert torch.allclose(fedln.MeanShift()(three), torch.tensor([[-0.5, 0.5], [-0.5, 0.5], [-1.0, 1.0]]))


def test_table3_variants_fill_the_ln_slots():
    data = fake_data()
    each = fedln.build(model_args(norm="fn-each"), data).body
    last = fedln.build(model_args(norm="ln-last", ln_affine=False), data).body
    slots = [i for i, m in enumerate(fedln.build(model_args(norm="ln"), data).body) if isinstance(m, nn.GroupNorm)]
    assert len(slots) == 3 and all(isinstance(each[i], ScaleNorm) for i in slots)
    fn = fedln.build(model_args(norm="fn"), data)  # fn: the plain CNN and one n on its last feature, none inside
    assert sum(isinstance(m, ScaleNorm) for m in fn.modules()) == 1 and isinstance(fn.body[-1], ScaleNorm)
    assert [type(last[i]) for i in slots] == [fedln.MeanShift, fedln.MeanShift, nn.GroupNorm]
    assert last[slots[-1]].num_groups == 1 and not last[slots[-1]].affine
    tiny = torch.full((2, 16), 1e-4)  # ||x|| = 4e-4, above n's eps = 1e-5: scaled to sqrt(16) x / ||x|| = 1 per entry
    assert all(torch.allclose(each[i](tiny), torch.ones(2, 16)) for i in slots)
    # n^L in every slot: the bias-free CNN's logits ignore the input's scale
    torch.manual_seed(0)
    model, x = fedln.build(model_args(norm="fn-each"), data), images(data, n=4)
    with torch.no_grad():
        for c in (1e-3, 1e3):
            assert torch.allclose(model(c * x), model(x), rtol=1e-4, atol=1e-5), c


def same_weights(a, b):
    """Copy a's conv / linear weights into b (the two differ only in their normalization modules)."""
    wa = [m.weight for m in a.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    wb = [m.weight for m in b.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    with torch.no_grad():
        for p, q in zip(wa, wb):
            q.copy_(p)


def test_prop1_scaling_every_layer_equals_scaling_the_last():
    """Prop. 1: n after every activation (Table 3 n^L) computes the same g(x) as n on the last feature only (Eq. 7)."""
    data = fake_data()
    torch.manual_seed(1)
    each = fedln.build(model_args(norm="fn-each"), data).double()
    last = fedln.build(model_args(norm="fn"), data).double()
    same_weights(each, last)
    x = images(data).double()
    assert torch.allclose(each.body(x), last.body(x), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("before", [False, True])
def test_prop2_mv_every_layer_equals_shift_then_mv_last(before):
    """Prop. 2 / Eq. 8: static LN after every activation (n^L_MV) = mean shift s, then n_MV only at the last
    (n_MV s^{L-1})."""
    data = fake_data()
    torch.manual_seed(2)
    full = fedln.build(model_args(norm="ln", ln_affine=False, norm_before_act=before), data).double()
    last = fedln.build(model_args(norm="ln-last", ln_affine=False, norm_before_act=before), data).double()
    same_weights(full, last)
    for m in [*full.modules(), *last.modules()]:
        if isinstance(m, nn.GroupNorm):
            m.eps = 0.0  # Prop. 2 is exact without LN's eps
    x = images(data).double()
    assert torch.allclose(full.body(x), last.body(x), rtol=1e-9, atol=1e-9)
    plain = fedln.build(model_args(norm="none", norm_before_act=before), data).double()
    same_weights(full, plain)
    # the shifts matter
    assert not torch.allclose(full.body(x), nn.GroupNorm(1, 384, affine=False).double()(plain.body(x)), atol=1e-3)


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
def test_fedyogi_step_matches_the_yogi_formula():
    lr, b1, b2, tau = 0.01, 0.9, 0.99, 1e-3
    x0, d1, d2 = [1.0, -2.0, 0.5], [0.5, -0.1, 0.0], [0.01, 0.3, -0.2]
    x, m, v = (
        {"w": torch.tensor(x0, dtype=torch.float64)},
        {"w": torch.zeros(3, dtype=torch.float64)},
        {"w": torch.full((3,), 1e-6, dtype=torch.float64)},
    )
    ex, em, ev = list(x0), [0.0] * 3, [1e-6] * 3
    for d in (d1, d2):
        avg = {"w": x["w"] + torch.tensor(d, dtype=torch.float64)}  # the clients' mean: D = avg - x = d
        x, m, v = fedln.fedyogi_step(x, avg, m, v, lr, b1, b2, tau)
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
    assert (
        abs(
            (1.0 + 0.01 * 0.05 / (math.sqrt(v1) + 1e-3))
            - fedln.fedyogi_step(
                {"w": torch.tensor([1.0], dtype=torch.float64)},
                {"w": torch.tensor([1.5], dtype=torch.float64)},
                {"w": torch.zeros(1, dtype=torch.float64)},
                {"w": torch.full((1,), 1e-6, dtype=torch.float64)},
                lr,
                b1,
                b2,
                tau,
            )[0]["w"].item()
        )
        < 1e-12
    )
    # v shrinks when v > D^2 (the Yogi sign), where Adam's v would grow
    _, _, v_big = fedln.fedyogi_step(
        {"w": torch.zeros(1)},
        {"w": torch.tensor([0.1])},
        {"w": torch.zeros(1)},
        {"w": torch.tensor([1.0])},
        lr,
        b1,
        b2,
        tau,
    )
    assert torch.allclose(v_big["w"], torch.tensor([1.0 - 0.01 * 0.01]))
    # v = D^2: sign 0 leaves v as it is
    x_eq, m_eq, v_eq = fedln.fedyogi_step(
        {"w": torch.zeros(1)},
        {"w": torch.tensor([0.5])},
        {"w": torch.zeros(1)},
        {"w": torch.tensor([0.25])},
        lr,
        b1,
        b2,
        tau,
    )
    assert v_eq["w"].item() == 0.25 and x_eq["w"].item() == pytest.approx(lr * 0.05 / (0.5 + tau), rel=1e-6)


def test_fedyogi_step_moves_towards_the_clients():
    """One FedYogi round from m_0 = 0, v_0 = 1e-6 by hand: D = avg - x = (0.5, -0.1); m_1 = 0.1 D;
    v_1 = 1e-6 + 0.01 D^2 (v_0 < D^2); x_1 = x + 0.01 m_1 / (sqrt(v_1) + 1e-3): towards the clients' average."""

    def f64(*v):
        return torch.tensor(v, dtype=torch.float64)

    x, m, v = fedln.fedyogi_step(
        {"w": f64(1.0, -2.0)},
        {"w": f64(1.5, -2.1), "buffer": f64(9.0)},
        {"w": f64(0.0, 0.0)},
        {"w": f64(1e-6, 1e-6)},
        0.01,
        0.9,
        0.99,
        1e-3,
    )
    assert set(x) == {"w"}  # the pseudo-gradient is over the given parameters only
    assert torch.allclose(m["w"], f64(0.05, -0.01), rtol=1e-12)
    assert torch.allclose(v["w"], f64(1e-6 + 0.0025, 1e-6 + 0.0001), rtol=1e-12)
    step = f64(0.01 * 0.05 / (math.sqrt(1e-6 + 0.0025) + 1e-3), 0.01 * -0.01 / (math.sqrt(1e-6 + 0.0001) + 1e-3))
    assert torch.allclose(x["w"], f64(1.0, -2.0) + step, rtol=1e-12)  # = (1.009615, -2.009016)


def test_prox_term_value_and_gradient_by_hand():
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    v = torch.tensor([[0.5]], requires_grad=True)
    anchor = [torch.tensor([0.0, 4.0]), torch.tensor([[1.5]])]
    term = common.prox_term([w, v], anchor, mu=0.1)
    assert term.item() == pytest.approx(0.05 * (1 + 4 + 1))  # mu/2 (||(1, -2)||^2 + ||-1||^2)
    term.backward()
    # mu (w - w_t)
    assert torch.allclose(w.grad, torch.tensor([0.1, -0.2])) and torch.allclose(v.grad, torch.tensor([[-0.1]]))


def tiny_client(agg, mu=0.1):
    """4 one-pixel-row images (2 features = pixel / 255), 3 classes, a bias-free linear model W [3, 2]."""
    x = torch.tensor([[10, 200], [50, 30], [255, 0], [120, 90]], dtype=torch.uint8).view(4, 1, 1, 2)
    y = torch.tensor([0, 1, 2, 1])
    data = Data(x, y, x, y, 3, torch.zeros(1, 1, 1, 1), torch.ones(1, 1, 1, 1))
    model = common.Classifier(nn.Flatten(), 2, 3, head_bias=False)
    with torch.no_grad():
        model.head.weight.copy_(torch.tensor([[0.5, -1.0], [0.2, 0.3], [-0.7, 0.9]]))
    args = argparse.Namespace(
        momentum=0.0,
        weight_decay=0.0,
        batch_size=4,
        local_steps=1,
        augment="none",
        device="cpu",
        amp=False,
        agg=agg,
        prox_mu=mu,
    )
    return model, data, args


def ce_gradient_by_hand(W, x, y):
    """Mean cross-entropy of softmax(x W^T) and its gradient (p - onehot)^T x / B, in numpy."""
    logits = x @ W.T
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    onehot = np.eye(W.shape[0])[y]
    return -np.log(p[np.arange(len(y)), y]).mean(), (p - onehot).T @ x / len(y)


@pytest.mark.parametrize("agg", ["fedavg", "fedprox", "scaffold"])
def test_local_train_one_sgd_step_by_hand(agg):
    """local_train's step: W <- W - lr (grad CE + mu (W - W_t)) for FedProx, W - lr (grad CE + c - c_k) for SCAFFOLD."""
    model, data, args = tiny_client(agg)
    W = model.head.weight.detach().double().numpy().copy()
    # w_t != the client's start, so the prox gradient is not 0
    anchor = torch.tensor([[0.4, -0.8], [0.0, 0.5], [-0.5, 1.0]])
    correction = {"head.weight": torch.tensor([[0.3, -0.2], [0.1, 0.0], [-0.4, 0.25]])}
    loss = fedln.local_train(
        model, torch.arange(4), data, args, 0.5, [anchor], correction if agg == "scaffold" else None
    )
    ce, grad = ce_gradient_by_hand(W, data.x_train.view(4, 2).double().numpy() / 255, data.y_train.numpy())
    if agg == "fedprox":
        grad = grad + 0.1 * (W - anchor.double().numpy())
        ce = ce + 0.05 * ((W - anchor.double().numpy()) ** 2).sum()
    if agg == "scaffold":
        grad = grad + correction["head.weight"].double().numpy()
    assert loss.item() == pytest.approx(ce, rel=1e-5)
    assert np.allclose(model.head.weight.detach().double().numpy(), W - 0.5 * grad, rtol=1e-5, atol=1e-6)


# --- Figure 3: singular values of the feature matrix --------------------------------------------------
def test_singular_values_of_a_rank_two_feature_matrix():
    """[g(x_1)..g(x_20)] = 3 u1 v1^T + u2 v2^T (orthonormal u, v): singular values exactly (3, 1, 0, 0, 0, 0);
    the unit-row version against numpy's SVD of rows normalized independently."""
    g = torch.Generator().manual_seed(0)
    u = torch.linalg.qr(torch.randn(20, 2, generator=g, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(6, 2, generator=g, dtype=torch.float64))[0]
    z = 3 * u[:, :1] @ v[:, :1].T + u[:, 1:] @ v[:, 1:].T
    model = common.Classifier(nn.Identity(), 6, 4)  # body = identity: the features are z itself
    raw, unit = fedln.singular_values(model, z)
    assert len(raw) == 6 and np.allclose(raw[:2], [3, 1], rtol=1e-6) and max(raw[2:]) < 1e-5  # rank 2
    rows = z.numpy() / np.linalg.norm(z.numpy(), axis=1, keepdims=True)
    assert np.allclose(unit, np.linalg.svd(rows, compute_uv=False), rtol=1e-5, atol=1e-6)


def test_singular_values_of_a_model_match_numpy():
    data = fake_data()
    torch.manual_seed(0)
    model = fedln.build(model_args(norm="none"), data).eval()
    x = images(data, 20)
    with torch.no_grad():
        z = model.body(x).double().numpy()  # the penultimate features g(x), not the logits
    raw, unit = fedln.singular_values(model, x)
    assert np.allclose(raw, np.linalg.svd(z, compute_uv=False), rtol=1e-4, atol=1e-5)
    assert np.allclose(
        unit, np.linalg.svd(z / np.linalg.norm(z, axis=1, keepdims=True), compute_uv=False), rtol=1e-4, atol=1e-5
    )


def test_figure3_images_are_from_different_classes():
    labels = torch.arange(300) % 10
    labels = labels[torch.randperm(300, generator=torch.Generator().manual_seed(0))]
    pick = fedln.figure3_images(labels, 20, seed=3)
    assert len(set(pick.tolist())) == 20 and torch.bincount(labels[pick], minlength=10).tolist() == [2] * 10
    assert torch.equal(pick, fedln.figure3_images(labels, 20, seed=3))  # fixed for a seed
    assert not torch.equal(pick, fedln.figure3_images(labels, 20, seed=4))
    uneven = torch.tensor([0, 0, 1, 0, 2, 2])  # classes of 3, 1 and 2 images: the rounds skip the used-up classes
    pick = fedln.figure3_images(uneven, 6, seed=0)
    assert sorted(pick.tolist()) == list(range(6)) and uneven[pick].tolist()[:3] == [0, 1, 2]
    assert uneven[pick].tolist()[3:] == [0, 2, 0]


def logged_svs_match_the_saved_model(run_dir, norm, overfit=False):
    """Rebuild the run's final model from model.pt, take Figure 3's 20 test images, and compare the logged
    singular values with numpy's SVD of the model's features (and ||w_c|| with the head's rows)."""
    data = common.load_data(argparse.Namespace(dataset="synthetic", data_dir=".", device="cpu", data_seed=3))
    model = fedln.build(model_args(norm=norm), data)
    model.load_state_dict(torch.load(run_dir / "model.pt"))
    x = common.prepare_batch(data.x_test[fedln.figure3_images(data.y_test, 20, seed=3)], data)
    with torch.no_grad():
        z = model.eval().body(x).double().numpy()
    s = summary(run_dir)
    assert np.allclose(s["feature_sv"], np.linalg.svd(z, compute_uv=False), rtol=1e-4, atol=1e-4)
    if overfit:
        assert np.allclose(s["class_norms"], model.head.weight.detach().norm(dim=1).numpy(), rtol=1e-5)
    return s


# --- end to end: each stage is ONE python process that runs the scripts one after another ------------
BASE = ["--dataset", "synthetic", "--device", "cpu", "--batch-size", "8", "--seed", "3"]
AGGS = [("fedavg", "bn"), ("fedprox", "ln"), ("scaffold", "fn"), ("fedyogi", "bn")]
EQUAL = [
    *BASE,
    "--model",
    "mlp",
    "--num-clients",
    "4",
    "--frac",
    "0.5",
    "--classes-per-client",
    "2",
    "--local-steps",
    "2",
    "--rounds",
    "2",
    "--eval-every",
    "1",
    "--lr",
    "0.05",
    "--momentum",
    "0.9",
    "--weight-decay",
    "5e-4",
    "--save-model",
]
LEARN = [
    *BASE,
    "--width",
    "8",
    "--batch-size",
    "16",
    "--local-steps",
    "3",
    "--rounds",
    "8",
    "--eval-every",
    "8",
    "--lr",
    "0.02",
    "--track-singular-values",
    "--save-model",
]  # defaults: 10 clients, all per round, 1 class each
OVERFIT = [
    *BASE,
    "--width",
    "8",
    "--batch-size",
    "16",
    "--local-steps",
    "10",
    "--rounds",
    "3",
    "--eval-every",
    "3",
    "--lr",
    "0.05",
    "--norm",
    "none",
    "--overfit-client",
    "0",
    "--save-model",
]  # Figure 3 left: client 0 alone


def resume_flags(agg, norm):
    return [
        *BASE,
        "--width",
        "4",
        "--num-clients",
        "4",
        "--frac",
        "0.5",
        "--local-steps",
        "2",
        "--rounds",
        "3",
        "--eval-every",
        "1",
        "--lr",
        "0.05",
        "--agg",
        agg,
        "--norm",
        norm,
        "--save-model",
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two processes (helpers.run_batches): fedavg.py vs fedln.py --norm none (mlp: the loop is compared, the
    model is in test_norm_none_is_the_plain_table7_cnn), each in its own, and the one-class runs."""
    d = tmp_path_factory.mktemp("fedln")
    run_batches(
        [
            ["fedavg.py", *EQUAL, "--out", d / "avg"],
            *[["fedln.py", *LEARN, "--norm", n, "--out", d / n] for n in ("ln", "none")],
        ],
        [
            ["fedln.py", *EQUAL, "--norm", "none", "--agg", "fedavg", "--out", d / "plain"],
            ["fedln.py", *LEARN, "--norm", "fn", "--out", d / "fn"],
            ["fedln.py", *OVERFIT, "--out", d / "overfit"],
        ],
    )
    return d


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """For each --agg an uninterrupted run and one stopped after round 1 (two processes), then the stopped
    runs resumed in a fresh process."""
    d = tmp_path_factory.mktemp("fedln_resume")
    run_batches(
        [["fedln.py", *resume_flags(agg, norm), "--out", d / f"{agg}_full"] for agg, norm in AGGS],
        [["fedln.py", *resume_flags(agg, norm), "--out", d / f"{agg}_cut", "--stop-after", "1"] for agg, norm in AGGS],
    )
    cut = {agg: torch.load(d / f"{agg}_cut" / "checkpoint.pt", weights_only=False) for agg, _ in AGGS}
    run_batches([["fedln.py", "--resume", d / f"{agg}_cut"] for agg, _ in AGGS])
    return d, cut


def test_norm_none_fedavg_reproduces_fedavg_py(runs):
    assert len(metrics(runs / "avg")) == 2
    assert metrics(runs / "avg") == metrics(runs / "plain")
    assert_same_model(runs / "avg", runs / "plain")


@pytest.mark.slow  # two runs of each --agg and a resume
@pytest.mark.parametrize("agg", [a for a, _ in AGGS])
def test_resume_equals_uninterrupted(resumed, agg):
    d, cut = resumed
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
    d = runs
    with open(d / "ln" / "partition.json") as f:
        assert all(sum(c > 0 for c in counts) == 1 for counts in json.load(f)["train"])
    vanilla = summary(d / "none")["test_acc"]
    for norm in ("ln", "fn"):
        s = logged_svs_match_the_saved_model(d / norm, norm)  # --track-singular-values: the global model's features
        assert s["test_acc"] > 0.3 and s["test_acc"] > vanilla + 0.1, (norm, s["test_acc"], vanilla)
        assert len(s["feature_sv"]) == len(s["feature_sv_unit"]) == 20 and "class_norms" not in s


def test_overfit_client_trains_one_client_alone_and_collapses(runs):
    """--overfit-client 0 (Figure 3 left): the model fits client 0's one class, so it predicts that class for
    every test image (accuracy = its share, 0.1), its class embedding has the largest norm (Figure 3 left),
    and the 20 test images' features collapse onto one direction (sigma_1 >> sigma_2; measured ~30x)."""
    d = runs
    with open(d / "overfit" / "partition.json") as f:
        own = [c for c, n in enumerate(json.load(f)["train"][0]) if n > 0]
    s = logged_svs_match_the_saved_model(d / "overfit", "none", overfit=True)
    assert len(own) == 1 and s["test_acc"] == pytest.approx(0.1) and s["train_loss"] < 0.05
    assert int(np.argmax(s["class_norms"])) == own[0]
    assert s["feature_sv"][0] > 10 * s["feature_sv"][1]
    assert len(s["client_feature_norms"]) == 20 and min(s["client_feature_norms"]) > 0


@pytest.mark.parametrize(
    "flags,flag",
    [
        (["--model", "cnn", "--norm", "ln"], "--norm"),
        (["--model", "resnet18", "--norm", "ln-last"], "--norm"),
        (["--model", "resnet18", "--no-ln-affine"], "--no-ln-affine"),
        (["--local-steps", "0"], "--local-steps"),
        # not silently ignored
        (["--agg", "scaffold", "--prox-mu", "0.1"], "--prox-mu"),
        (["--prox-mu", "0.01"], "--prox-mu"),  # --agg fedavg
        (["--agg", "fedprox", "--prox-mu", "0"], "--prox-mu"),
        (["--agg", "fedprox", "--prox-mu", "-1"], "--prox-mu"),
        (["--overfit-client", "10"], "--overfit-client"),
        (["--overfit-client", "0", "--agg", "fedyogi"], "--overfit-client"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(monkeypatch, capsys, flags, flag):
    monkeypatch.setattr(sys, "argv", ["fedln.py", *BASE, *flags, "--out", "unused"])
    with pytest.raises(SystemExit) as exit_info:
        fedln.parse_args()
    assert exit_info.value.code == 2 and flag in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "flags,mu",
    [
        ([], 0.0),
        (["--agg", "fedprox"], 0.01),
        (["--agg", "fedprox", "--prox-mu", "0.1"], 0.1),
        (["--agg", "scaffold", "--prox-mu", "0"], 0.0),
    ],
)
def test_prox_mu_belongs_to_agg_fedprox(monkeypatch, flags, mu):
    monkeypatch.setattr(sys, "argv", ["fedln.py", *BASE, *flags, "--out", "unused"])
    assert fedln.parse_args().prox_mu == mu


def test_resume_of_a_run_saved_with_an_unused_prox_mu(monkeypatch, tmp_path):
    """Runs saved before the rule kept the old default prox_mu 0.01 with every --agg: they still resume."""
    monkeypatch.setattr(sys, "argv", ["fedln.py", "--dataset", "synthetic", "--device", "cpu", "--agg", "scaffold"])
    config = {k: v for k, v in vars(fedln.parse_args()).items() if k not in ("resume", "stop_after", "overwrite")}
    (tmp_path / "config.json").write_text(json.dumps({**config, "prox_mu": 0.01}))  # as such runs saved it
    (tmp_path / "checkpoint.pt").write_bytes(b"")
    monkeypatch.setattr(sys, "argv", ["fedln.py", "--resume", str(tmp_path)])
    args = fedln.parse_args()
    assert (args.agg, args.prox_mu) == ("scaffold", 0.0)


def test_defaults_are_the_papers(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["fedln.py", "--device", "cpu", "--out", "unused"])
    a = fedln.parse_args()
    assert (a.norm, a.agg, a.model, a.num_clients, a.frac, a.classes_per_client, a.local_steps) == (
        "ln",
        "fedavg",
        "normcnn",
        10,
        1.0,
        1,
        10,
    )
    assert (a.lr, a.momentum, a.weight_decay, a.batch_size, a.augment, a.rounds, a.eval_every) == (
        0.01,
        0.0,
        0.0,
        32,
        "crop-flip",
        10000,
        100,
    )
    assert (a.server_lr, a.yogi_beta1, a.yogi_beta2, a.yogi_tau, a.yogi_v0, a.prox_mu, a.ln_affine) == (
        0.01,
        0.9,
        0.99,
        1e-3,
        1e-6,
        0.0,
        True,
    )  # FedProx's mu 0.01: test_prox_mu_belongs_to_agg_fedprox


# --- common.py: refusals found only after the data is loaded exit 2 with one line naming the flag ----------
SYNTH = ["--dataset", "synthetic", "--device", "cpu"]


@pytest.mark.parametrize(
    "flags,flag",
    [
        (["--num-clients", "100000", "--iid"], "--num-clients"),  # clients left without data
        (["--num-clients", "2000", "--shards", "2"], "--shards"),  # N*S = 4000 shards of 3000 samples
        (["--num-clients", "300", "--alpha", "0.001"], "--alpha"),
    ],
)
def test_partition_refusals_exit_2_with_one_line(monkeypatch, capsys, tmp_path, flags, flag):
    """parse_args lets these through (only the data can tell); make_partition finds them (BadInput), and the run
    says them in one line, exit 2, leaving no run folder."""
    monkeypatch.setattr(common, "_HELD", {})
    monkeypatch.setattr(sys, "argv", ["fedln.py", *SYNTH, *flags, "--out", str(tmp_path / "run")])
    args = fedln.parse_args()
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        with common.Run(args):
            data = common.load_data(args)
            common.make_partition(args, data)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and err[0].split(": error: ")[1].startswith(flag), err
    # The message also travels in the exception.
    assert flag in str(exit_info.value)
    assert not (tmp_path / "run").exists()


def test_no_data_refusal_is_exit_status_2_in_a_real_process(tmp_path):
    """The issue's case (was status 1 from sys.exit(message)): the process itself exits 2, nothing written."""
    proc = run_script(
        "fedln.py",
        "--dataset",
        "synthetic",
        "--device",
        "cpu",
        "--num-clients",
        "100000",
        "--iid",
        "--out",
        tmp_path / "run",
        check=False,
    )
    assert proc.returncode == 2 and "--num-clients" in proc.stderr.strip().splitlines()[-1], proc.stderr[-500:]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "layout,images,words",
    [
        ({"train": [], "test": []}, True, "train/ lacks the class folder(s)"),
        ({"train": ["a", "b"], "test": ["a"]}, True, "lacks the class folder(s) b"),
        ({"train": ["a", "b"], "test": ["a", "b"]}, False, "hold no images"),
    ],
)
def test_folder_refusals_exit_2_naming_data_dir(tmp_path, monkeypatch, capsys, layout, images, words):
    """The folder is read after parse_args (load_data): still exit 2, one line naming --data-dir, no run folder."""
    from PIL import Image

    data_dir = tmp_path / "data"
    for split, classes in layout.items():
        (data_dir / split).mkdir(parents=True)
        for c in classes:
            (data_dir / split / c).mkdir()
            if images:
                Image.new("RGB", (2, 2)).save(data_dir / split / c / "0.png")
    argv = ["--dataset", "folder", "--data-dir", data_dir, "--device", "cpu", "--out", tmp_path / "run"]
    code, last = prepare("fedln", argv, monkeypatch, capsys)
    assert code == 2 and "--data-dir" in last and words in last, last
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("existed", [False, True])
@pytest.mark.parametrize(
    "error", [urllib.error.URLError("[Errno -2] Name or service not known"), ConnectionResetError("reset")]
)
def test_failed_download_exits_2_with_what_to_do(monkeypatch, capsys, tmp_path, error, existed):
    """Offline --dataset cifar10 (torchvision's CIFAR10 raising as urllib does without internet): bad input, which
    the run says in one line (exit 2); a --data-dir the failed download made is removed again, one that was there
    before is kept."""
    import torchvision.datasets

    root = tmp_path / "data"
    if existed:
        root.mkdir()
        (root / "kept.txt").write_text("x")

    def offline(folder, *_, **__):
        os.makedirs(folder, exist_ok=True)  # as torchvision does before it downloads
        raise error

    monkeypatch.setattr(torchvision.datasets, "CIFAR10", offline)
    with pytest.raises(common.BadInput) as raised:
        common.torchvision_dataset(argparse.Namespace(dataset="cifar10", data_dir=str(root)))
    said = str(raised.value)
    assert "--dataset folder --data-dir" in said and "cifar10" in said and type(error).__name__ in said
    assert capsys.readouterr().err == ""
    assert root.exists() == existed and (not existed or (root / "kept.txt").exists())

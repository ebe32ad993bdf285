"""anfr.py: weight standardization, NF signal propagation, Table 6 parameter counts, the six timm
ResNet-50s (logits through --init-from's name map; needs timm), aggregation math, DP-SGD clipping and
accountant (against Opacus), CSI by hand, and end-to-end runs (every --arch and --agg learns; resume is
bitwise; FedPer/FedBN keep each client's parts; DP epsilon is logged).

The end-to-end runs are launched once for the module, in two processes at a time."""

import json
import math
import os
import runpy
import shutil
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import anfr
import common
from helpers import ROOT, assert_same_model, metrics, run_batches, summary

TINY = [
    "--dataset",
    "synthetic",
    "--device",
    "cpu",
    "--depth",
    "18",
    "--width",
    "8",
    "--image-size",
    "16",
    "--num-clients",
    "3",
    "--alpha",
    "1.0",
    "--rounds",
    "3",
    "--local-steps",
    "5",
    "--batch-size",
    "16",
    "--lr",
    "0.03",
    "--warmup-steps",  # 15 steps in all: the recipe's 100-step warm-up would leave them no lr
    "0",
]
CHANCE = 0.1


# ---------------------------------------------------------------------------------------------- models
def test_scaled_weight_standardization_eq5():
    torch.manual_seed(0)
    conv = common.ScaledStdConv2d(5, 7, 3, padding=1, gamma=common.RELU_GAMMA)
    with torch.no_grad():
        conv.weight.mul_(3).add_(torch.randn(7, 1, 1, 1))  # arbitrary per-channel mean and scale
        conv.gain.copy_(torch.rand(7, 1, 1, 1) + 0.5)
        conv.bias.copy_(torch.randn(7))
    w = conv.standardized_weight().flatten(1)
    assert torch.allclose(w.mean(1), torch.zeros(7), atol=1e-6)  # per output channel: mean 0 ...
    assert torch.allclose(w.std(1, unbiased=False), torch.ones(7), atol=1e-4)  # ... and std 1 before the gain
    x = torch.randn(2, 5, 6, 6)
    W = conv.weight
    mu, var = W.mean((1, 2, 3), keepdim=True), W.var((1, 2, 3), unbiased=False, keepdim=True)
    w_hat = conv.gain * common.RELU_GAMMA / math.sqrt(5 * 3 * 3) * (W - mu) / torch.sqrt(var + 1e-5)  # Eq. 5 by hand
    assert torch.allclose(conv(x), F.conv2d(x, w_hat, conv.bias, padding=1), atol=1e-5)
    # gamma = 1/std(relu(z)): timm's (DeepMind's) measured constant, within 1e-3 of the closed form
    assert (
        common.RELU_GAMMA == 1.7139588594436646 and abs(common.RELU_GAMMA - math.sqrt(2 / (1 - 1 / math.pi))) < 1.2e-3
    )


@pytest.mark.parametrize("depth", [18, 26, 50])
def test_nf_signal_propagation_at_init(depth):
    """Brock et al. 2021a, block by block: on an input of variance Var (the expected one, beta = Var^-1/2),
    the shortcut keeps variance (a transition's conv of relu(x) beta gives 1: Eq. 5's gamma), the branch
    (attention x2 included) has variance 1 when every gain is 1, so Var(out) = Var or 1, plus alpha^2.
    Inputs are constant on 2x2 patches, as the average pool of a transition's shortcut assumes of images.
    Measured: branch 0.86-1.07, the rest within 5% (zero padding shrinks a branch a little)."""
    torch.manual_seed(0)
    model = common.resnet(3, 10, 32, depth=depth, width=16, norm="nf", attention="se", last_gain_init=1.0)
    fresh = common.resnet(3, 10, 32, depth=depth, width=16, norm="nf", attention="se")  # timm's zero last gains
    var, betas = 1.0, []
    for b in model.body.stages:  # the expected variance: Var += alpha^2, reset to 1 by a transition's shortcut
        betas.append(var**-0.5)
        var = (1.0 if b.transition else var) + 0.2**2
    assert [b.beta for b in model.body.stages] == pytest.approx(betas, abs=1e-12)
    assert model.body.stages[0].transition == (depth != 18)  # a basic block keeps 16 channels at stride 1
    with torch.no_grad():
        for b, b0 in zip(model.body.stages, fresh.body.stages):
            var_in = b.beta**-2
            x = F.interpolate(torch.randn(4, b.conv1.in_channels, 16, 16), scale_factor=2) * var_in**0.5
            skip = b.shortcut(F.relu(x) * b.beta) if b.transition else x
            out = b(x)
            branch = (out - skip) / 0.2
            assert skip.var().item() == pytest.approx(1.0 if b.transition else var_in, rel=0.07)
            assert 0.8 < branch.var().item() < 1.2
            assert out.var().item() == pytest.approx((1.0 if b.transition else var_in) + 0.04, rel=0.07)
            b0.load_state_dict({k: v for k, v in b.state_dict().items() if not k.endswith("gain")}, strict=False)
            assert torch.equal(b0(x), (b0.shortcut(F.relu(x) * b0.beta) if b0.transition else x))  # zero gain: shut


TABLE6 = [
    ("bn", None, 25.56),
    ("gn", None, 25.56),
    ("bn", "se", 28.09),
    ("nf", None, 25.56),
    ("nf", "se", 28.09),
    ("nf", "eca", 25.56),
    ("nf", "cbam", 28.07),
]


@pytest.mark.parametrize("norm,attention,millions", TABLE6)
def test_parameter_counts_table6(norm, attention, millions):
    with torch.device("meta"):
        model = common.resnet(3, 1000, 224, depth=50, norm=norm, attention=attention, stem="imagenet")
    n = sum(p.numel() for p in model.parameters())
    assert round(n / 1e6, 2) == millions, n
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules()) or norm == "bn"


# timm models (the paper's) -> anfr.py flags: --arch, --attention; all with --depth 50 --stem imagenet
TIMM = {
    "resnet50": ("bn", "se"),
    "resnet50_gn": ("gn", "se"),
    "seresnet50": ("se", "se"),
    "nf_resnet50": ("nf", "se"),
    "nf_seresnet50": ("anfr", "se"),
    "nf_ecaresnet50": ("anfr", "eca"),
}
NARROW = {"channels": (32, 64, 128, 256), "stem_chs": 8}  # timm NF-ResNet-50 kwargs for our --width 8


def ours_for(name, width=64, last_gain_init=0.0):
    arch, attention = TIMM[name]
    args = SimpleNamespace(
        arch=arch, attention=attention, depth=50, width=width, stem="imagenet", last_gain_init=last_gain_init
    )
    return anfr.build(args, SimpleNamespace(in_channels=3, num_classes=1000, image_size=40))


@pytest.mark.parametrize("name,width", [(n, 64) for n in TIMM] + [("nf_seresnet50", 8)])
def test_timm_logits_through_the_init_from_name_map(name, width):
    """timm's randomly initialized weights, with every gain, norm affine, running statistic and bias made
    random and nonzero (so the x2 attention gain and every branch count), loaded by anfr.load_pretrained:
    the same logits. 40x40 inputs give odd maps (5x5, 3x3) for the NF shortcut's ceil-mode average pool.
    Width 8: SE hidden width 32/16 = 2 rounded up to 8, as timm."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    ref = timm.create_model(name, **(NARROW if width == 8 else {})).eval()
    with torch.no_grad():
        for k, v in ref.state_dict().items():
            if v.is_floating_point() and (
                k.endswith(("gain", "running_var")) or (v.dim() == 1 and k.endswith("weight"))
            ):
                v.uniform_(0.5, 1.5)
            elif v.is_floating_point() and k.endswith(("bias", "running_mean")):
                v.uniform_(-0.2, 0.2)
    model = ours_for(name, width).eval()
    assert anfr.load_pretrained(model, ref.state_dict(), common.RESNET_LAYOUT[50][1]) == (len(model.state_dict()),) * 2
    x = torch.randn(2, 3, 40, 40)
    with torch.no_grad():
        want, got = ref(x), model(x)
    assert want.abs().max() > 0.1 and (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("name", ["nf_resnet50", "nf_seresnet50", "nf_ecaresnet50"])
def test_fresh_nf_gains_start_as_timm(name):
    """Every gain g of a fresh NF model equals timm's, by name: 1, and 0 on the last conv of each block."""
    timm = pytest.importorskip("timm")
    ref = timm.create_model(name, **NARROW).state_dict()
    ours = ours_for(name, width=8).state_dict()
    gains = {anfr.timm_name(k, common.RESNET_LAYOUT[50][1]): v for k, v in ref.items() if k.endswith(".gain")}
    assert gains.keys() == {k for k in ours if k.endswith(".gain")}
    assert all(torch.equal(ours[k], v) for k, v in gains.items())
    assert sum(not v.any() for v in gains.values()) == 16 and all(
        not ours[f"body.stages.{i}.conv3.gain"].any() for i in range(16)
    )


def test_attention_widths_as_timm():
    timm = pytest.importorskip("timm")
    from timm.layers.cbam import CbamModule

    # SE: C/16 to the nearest multiple of 8, >= 8; CBAM: nearest, >= 1
    for c in (4, 8, 20, 32, 40, 64, 72, 136, 256, 2048):
        assert common.SqueezeExcite(c).fc1.out_channels == timm.layers.SEModule(c).fc1.out_channels, c
        assert anfr.CBAM(c).fc1.out_channels == CbamModule(c).channel.fc1.out_channels, c
        assert anfr.EfficientChannelAttention(c).conv.kernel_size == timm.layers.EcaModule(c).conv.kernel_size, c


def test_timm_names_map_onto_ours():
    layout = common.RESNET_LAYOUT[50][1]
    cases = {
        "conv1.weight": "body.stem.0.weight",
        "bn1.running_var": "body.stem.1.running_var",
        "fc.bias": "head.bias",
        "layer1.0.downsample.1.weight": "body.stages.0.shortcut.1.weight",
        "layer2.3.bn3.bias": "body.stages.6.n3.bias",
        "layer4.2.se.fc2.weight": "body.stages.15.attn.fc2.weight",
        "stem.conv.gain": "body.stem.0.gain",
        "stages.3.0.downsample.conv.gain": "body.stages.13.shortcut.conv.gain",
        "stages.2.5.conv3.bias": "body.stages.12.conv3.bias",
        "stages.0.1.attn_last.conv.weight": "body.stages.1.attn.conv.weight",
        "head.fc.weight": "head.weight",
    }
    assert {k: anfr.timm_name(k, layout) for k in cases} == cases
    ours = ours_for("nf_seresnet50", width=8).state_dict()
    assert all(anfr.timm_name(k, layout) == k for k in ours)  # our own names pass unchanged


@pytest.mark.parametrize("arch", list(anfr.ARCHS))
@pytest.mark.parametrize("attention", ["se", "eca", "cbam"])
def test_every_arch_runs_on_1_and_3_channels(arch, attention):
    for channels, size in ((1, 12), (3, 16)):
        model = common.resnet(
            channels,
            7,
            size,
            depth=18,
            width=4,
            norm=anfr.ARCHS[arch][0],
            attention=attention if anfr.ARCHS[arch][1] else None,
        )
        assert model(torch.randn(2, channels, size, size)).shape == (2, 7)
        assert isinstance(model.head, torch.nn.Linear) and model.body(torch.randn(2, channels, size, size)).shape == (
            2,
            8 * 4,
        )


def test_personal_keys():
    se = common.resnet(3, 10, 32, depth=18, width=4, norm="bn", attention="se")
    nf = common.resnet(3, 10, 32, depth=18, width=4, norm="nf", attention="se")
    assert anfr.personal_keys(se, "fedper") == {"head.weight", "head.bias"}
    bn = anfr.personal_keys(se, "fedbn")
    assert (
        "body.stem.1.running_var" in bn and "body.stages.0.n1.weight" in bn and "body.stages.0.conv1.weight" not in bn
    )
    assert len(bn) == 5 * sum(isinstance(m, torch.nn.BatchNorm2d) for m in se.modules())
    assert anfr.personal_keys(nf, "fedbn") == set() and anfr.personal_keys(se, "none") == set()


def test_personal_keys_of_bn_stats_local_are_the_running_statistics_only():
    se = common.resnet(3, 10, 32, depth=18, width=4, norm="bn", attention="se")
    nf = common.resnet(3, 10, 32, depth=18, width=4, norm="nf", attention="se")
    keys = anfr.personal_keys(se, "none", "local")
    n_bn = sum(isinstance(m, torch.nn.BatchNorm2d) for m in se.modules())
    assert len(keys) == 3 * n_bn and all(
        k.endswith(("running_mean", "running_var", "num_batches_tracked")) for k in keys
    )
    assert keys < anfr.personal_keys(se, "fedbn") and anfr.personal_keys(nf, "none", "local") == set()


# timm's fresh models (the paper's, and ResNet-18 for the BasicBlock path) -> (our norm, attention, depth)
FRESH = {
    "resnet18": ("bn", None, 18),
    "resnet50": ("bn", None, 50),
    "resnet50_gn": ("gn", None, 50),
    "seresnet50": ("bn", "se", 50),
    "nf_resnet50": ("nf", None, 50),
    "nf_seresnet50": ("nf", "se", 50),
}


def init_differences(name, init):
    """Entries where our fresh model starts otherwise than timm's: which are all zero, a weight's std off by more
    than 10% (convs, the head, attention convs), a gain or norm weight (vectors of ones and zeros) not equal."""
    timm = pytest.importorskip("timm")
    norm, attention, depth = FRESH[name]
    torch.manual_seed(0)
    ref = timm.create_model(name).state_dict()
    ref = {anfr.timm_name(k, common.RESNET_LAYOUT[depth][1]): v for k, v in ref.items()}
    ours = common.resnet(3, 1000, 224, depth=depth, norm=norm, attention=attention, stem="imagenet", init=init)
    ours = ours.state_dict()
    assert ours.keys() == ref.keys()
    bad = []
    for k, v in ours.items():
        want = ref[k]
        if not v.is_floating_point() or k.endswith(("running_mean", "running_var")):
            continue
        if bool((v == 0).all()) != bool((want == 0).all()):
            bad.append(f"{k}: zero {bool((v == 0).all())}, timm {bool((want == 0).all())}")
        elif k.endswith("gain") or (v.dim() == 1 and k.endswith("weight")):
            if not torch.equal(v, want):
                bad.append(f"{k}: values")
        elif v.dim() > 1 and not (v == 0).all() and abs(float(v.std() / want.std()) - 1) > 0.1:
            bad.append(f"{k}: std {float(v.std()):.4g}, timm {float(want.std()):.4g}")
    return bad


@pytest.mark.parametrize("name", list(FRESH))
def test_fresh_models_start_as_timms(name):
    """Layer by layer: the entries that start at zero (the last norm weight or NF gain of every residual branch,
    timm's NF biases) and each weight's init std within 10% (convs fan-out in activation-normed nets, fan-in in
    NF ones; SE convs; the head: PyTorch's in ResNets, N(0, 0.01^2) in NF-ResNets), against timm's fresh models."""
    assert init_differences(name, "timm") == []


def test_pytorch_default_init_differs_from_timms_where_the_issue_found_it():
    """The check above can fail: --init torch leaves every branch open and the convs about 2.45x narrower."""
    bad = init_differences("resnet50", "torch")
    assert any("n3.weight: zero False, timm True" in b for b in bad)
    assert any("conv1.weight: std" in b for b in bad)
    assert any("head.weight: std" in b for b in init_differences("nf_resnet50", "torch"))


def test_last_gains_are_the_last_nf_gain_or_norm_weight_of_each_block():
    nf = common.resnet(3, 10, 32, depth=50, width=4, norm="nf")
    bn = common.resnet(3, 10, 32, depth=18, width=4, norm="bn")
    assert [g is b.conv3.gain for g, b in zip(anfr.last_gains(nf), nf.body.stages)] == [True] * 16
    assert [g is b.n2.weight for g, b in zip(anfr.last_gains(bn), bn.body.stages)] == [True] * 8
    assert all(not g.any() for g in anfr.last_gains(nf) + anfr.last_gains(bn))  # timm: every branch starts shut


def test_gain_statistics_by_hand():
    grads = torch.tensor([[1.0, -1.0], [2.0, 1.0], [3.0, -1.0]])  # 3 steps, 2 gains
    keep, coherence = anfr.gain_statistics(grads).tolist()
    assert keep == pytest.approx(2 / 4)  # gain 0 keeps its sign twice, gain 1 never
    assert coherence == pytest.approx((6 / 6 + 1 / 3) / 2)


def test_gain_steps_by_hand():
    deltas, weights = torch.tensor([[1.0, -2.0], [-1.0, 2.0], [3.0, 0.0]]), torch.tensor([0.25, 0.25, 0.5])
    client, server = anfr.gain_steps(deltas, weights)
    assert client == pytest.approx(0.25 * 1.5 + 0.25 * 1.5 + 0.5 * 1.5)  # each client's mean |delta|, weighted
    assert server == pytest.approx((1.5 + 0.0) / 2)  # the average moves gain 0 by 1.5, gain 1 not at all


def test_cosine_with_warmup_by_hand():
    def lr(step):
        return anfr.cosine_lr(2.0, step, 110, warmup=10)

    assert [lr(0), lr(5), lr(10)] == [0.0, 1.0, 2.0]  # linear from 0, as Pieri et al.'s LambdaLR
    assert lr(60) == pytest.approx(1.0) and lr(110) == pytest.approx(0.0) and lr(35) == pytest.approx(2 * 0.8535534)
    assert anfr.cosine_lr(2.0, 5, 110) == anfr.cosine_lr(2.0, 5, 110, warmup=0) != lr(5)


def test_adaptive_clipping_equals_timms():
    """Brock et al. 2021b, unit-wise, against timm's adaptive_clip_grad (an independent implementation), on
    gradients whose units range over four orders of magnitude: some are clipped, some are not."""
    agc = pytest.importorskip("timm.utils.agc")
    torch.manual_seed(0)
    params = [p for m in (torch.nn.Conv2d(4, 6, 3), torch.nn.Linear(5, 3)) for p in m.parameters()]
    grads = [torch.randn_like(p) * torch.logspace(-3, 1, p.shape[0]).view(-1, *[1] * (p.dim() - 1)) for p in params]
    results = []
    for clip in (lambda: anfr.adaptive_clip_(params, 0.05), lambda: agc.adaptive_clip_grad(params, 0.05, eps=1e-3)):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        clip()
        results.append([p.grad.clone() for p in params])
    ours, ref = results
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-12) for a, b in zip(ours, ref))
    units = [(a == g).flatten(1).all(1) if g.dim() > 1 else (a == g).all()[None] for a, g in zip(ours, grads)]
    kept = torch.cat(units)
    assert kept.any() and not kept.all()


# ---------------------------------------------------------------------------------------------- aggregation math
def test_fedadam_step_by_hand():
    x, d = {"w": torch.tensor([1.0, -2.0])}, {"w": torch.tensor([0.5, -1.0])}
    m, v = {"w": torch.tensor([0.1, 0.0])}, {"w": torch.tensor([0.04, 0.0])}
    new = anfr.fedadam_step(x, d, m, v, lr=0.1, betas=(0.9, 0.99), tau=1e-3)
    m_ref = torch.tensor([0.9 * 0.1 + 0.1 * 0.5, -0.1])
    v_ref = torch.tensor([0.99 * 0.04 + 0.01 * 0.25, 0.01])
    assert torch.allclose(m["w"], m_ref) and torch.allclose(v["w"], v_ref)
    assert torch.allclose(new["w"], x["w"] + 0.1 * m_ref / (v_ref.sqrt() + 1e-3))


def test_cosine_schedule_and_steps():
    assert anfr.cosine_lr(1.0, 0, 10) == 1.0 and anfr.cosine_lr(1.0, 5, 10) == pytest.approx(0.5)
    assert anfr.cosine_lr(1.0, 10, 10) == pytest.approx(0.0) and anfr.cosine_lr(1.0, 12, 10) == pytest.approx(0.0)
    args = type("A", (), {"local_steps": None, "local_epochs": 2, "batch_size": 32, "dp_noise_multiplier": None})
    assert anfr.steps_per_round(65, args) == 2 * 2  # the lone 65th sample is skipped (client_batches)
    assert anfr.steps_per_round(66, args) == 2 * 3
    assert len(list(common.client_batches(torch.arange(66), 32, epochs=2))) == 6


def test_class_selectivity_more_classes_than_channels_and_small_means():
    """4 classes x 2 channels (not square, so the class axis is the one reduced), means far below 1 (the
    1e-12 guard only keeps an all-zero channel finite)."""
    acts = torch.tensor([[0.04, 0.0], [0.0, 0.0], [0.02, 0.0], [0.02, 0.0]], dtype=torch.float64)
    csi = anfr.class_selectivity(acts)  # channel 0: max 0.04, the others' mean 0.04 / 3 -> (1 - 1/3) / (1 + 1/3)
    assert torch.allclose(csi, torch.tensor([0.5, 0.0], dtype=torch.float64), rtol=1e-12, atol=0)


def test_cosine_one_step_run_and_dp_steps_per_round():
    assert anfr.cosine_lr(1.0, 1, 1) == pytest.approx(0.0, abs=1e-15)  # a one-step run also ends at 0
    assert anfr.cosine_lr(2.0, 0, 0) == 2.0
    dp = SimpleNamespace(local_steps=None, local_epochs=2, batch_size=32, dp_noise_multiplier=1.0)
    assert anfr.steps_per_round(100, dp) == 2 * 3  # Poisson batches: 1/q = 100 / 32 = 3.125 -> 3 per epoch
    assert anfr.steps_per_round(10, dp) == 2 * 1  # 10 / 32 rounds to 0: at least one batch per epoch
    plain = SimpleNamespace(local_steps=None, local_epochs=2, batch_size=32, dp_noise_multiplier=None)
    assert anfr.steps_per_round(1, plain) == 2  # a one-sample client keeps its lone batch
    assert len(list(common.client_batches(torch.arange(1), 32, epochs=2))) == 2
    assert (
        anfr.steps_per_round(
            1000, SimpleNamespace(local_steps=7, local_epochs=2, batch_size=32, dp_noise_multiplier=1.0)
        )
        == 7
    )


def test_class_selectivity_index():
    acts = torch.tensor([[4.0, 1.0, 0.0], [0.0, 1.0, 0.0], [2.0, 1.0, 3.0]])  # [classes, channels]
    csi = anfr.class_selectivity(acts)  # (max - mean of the others) / (max + mean of the others)
    assert torch.allclose(csi, torch.tensor([(4 - 1) / (4 + 1), 0.0, 1.0]))


def test_analyze_by_hand():
    """anfr.analyze on 12 images in batches of 5: CSI of each feature channel from class means computed
    here, and the last SE module's class-mean weights, recomputed from its input."""
    torch.manual_seed(0)
    model = common.resnet(3, 3, 8, depth=18, width=4, norm="nf", attention="se", last_gain_init=1.0)
    y = torch.tensor([0, 1, 2, 0, 1, 2, 2, 2, 0, 1, 2, 0])  # classes of 4, 3 and 5 images
    data = SimpleNamespace(
        x_test=torch.randint(0, 256, (12, 3, 8, 8), dtype=torch.uint8),
        y_test=y,
        num_classes=3,
        mean=torch.full((1, 3, 1, 1), 0.5),
        std=torch.full((1, 3, 1, 1), 0.25),
    )
    got = anfr.analyze(model, data, None, batch_size=5)
    x = (data.x_test.float() / 255 - 0.5) / 0.25
    se, seen = model.body.stages[-1].attn, []
    hook = se.register_forward_hook(lambda m, inp, out: seen.append(inp[0]))
    with torch.no_grad():
        feats = model.body(x)  # [12, 32]
        hook.remove()
        z = seen[0].mean((2, 3))
        w = torch.sigmoid(
            F.linear(F.relu(F.linear(z, se.fc1.weight.flatten(1), se.fc1.bias)), se.fc2.weight.flatten(1), se.fc2.bias)
        )
    csi = []
    for c in range(feats.shape[1]):
        mu = [feats[y == k, c].mean().item() for k in range(3)]
        top = max(mu)
        rest = (sum(mu) - top) / 2
        csi.append((top - rest) / (top + rest))
    csi = torch.tensor(csi)
    assert got["csi_mean"] == pytest.approx(csi.mean().item(), rel=1e-5)
    assert got["csi_median"] == pytest.approx(csi.median().item(), rel=1e-5)
    assert got["csi_frac_above_0.75"] == pytest.approx((csi > 0.75).float().mean().item())
    assert got["csi_hist"] == [float(((csi >= i / 10) & ((csi < (i + 1) / 10) | (i == 9))).sum()) for i in range(10)]
    wk = torch.stack([w[y == k].mean(0) for k in range(3)])  # [classes, channels]
    assert got["attn_weight_mean"] == pytest.approx(wk.mean().item(), rel=1e-5)
    assert got["attn_std_over_channels"] == pytest.approx(wk.std(1).mean().item(), rel=1e-5)
    assert got["attn_std_over_classes"] == pytest.approx(wk.std(0).mean().item(), rel=1e-5)
    assert (got["attn_weight_min"], got["attn_weight_max"]) == pytest.approx(
        (wk.min().item(), wk.max().item()), rel=1e-5
    )


# ---------------------------------------------------------------------------------------------- differential privacy
def test_per_sample_clipping_bounds_each_norm():
    grads = {"a": torch.tensor([[3.0, 0.0], [0.1, 0.0], [0.0, 0.0]]), "b": torch.tensor([[4.0], [0.0], [2.0]])}
    out = anfr.clip_per_sample(grads, max_norm=1.0)
    norms = torch.sqrt(out["a"].pow(2).sum(1) + out["b"].pow(2).sum(1))
    assert torch.allclose(norms, torch.tensor([1.0, 0.1, 1.0]), atol=1e-5)  # 5 -> 1, 0.1 kept, 2 -> 1
    assert torch.allclose(out["a"][0] / out["b"][0], torch.tensor([0.75, 0.0]))  # direction kept


def test_per_sample_clipping_factor_as_opacus_at_tiny_norms():
    """Opacus's factor min(1, C / (||g_i|| + 1e-6)), visible at norms near 1e-6: norms 5e-6 and 5e-7, C = 1e-6
    -> factors 1e-6 / 6e-6 = 1/6 and 1e-6 / 1.5e-6 = 2/3 (the second sample is scaled although ||g|| < C)."""
    grads = {
        "a": torch.tensor([[3e-6, 0.0], [3e-7, 0.0]], dtype=torch.float64),
        "b": torch.tensor([[4e-6], [4e-7]], dtype=torch.float64),
    }
    out = anfr.clip_per_sample(grads, max_norm=1e-6)
    factor = torch.tensor([1 / 6, 2 / 3], dtype=torch.float64)
    for n in grads:
        assert torch.allclose(out[n], grads[n] * factor[:, None], rtol=1e-12, atol=0), n
    optimizers = pytest.importorskip("opacus.optimizers")
    params = {n: torch.nn.Parameter(torch.zeros(g.shape[1:], dtype=torch.float64)) for n, g in grads.items()}
    for n, p in params.items():
        p.grad_sample = grads[n]
    opt = optimizers.DPOptimizer(
        torch.optim.SGD(list(params.values()), lr=1.0), noise_multiplier=0.0, max_grad_norm=1e-6, expected_batch_size=2
    )
    opt.clip_and_accumulate()  # Opacus's own clipping, summed over the batch
    for n, p in params.items():
        assert torch.allclose(out[n].sum(0), p.summed_grad, rtol=1e-12, atol=0), n


def _linear_ce_grad(model, x, y):
    """d CE(W x + b, y) / d(W, b) = ((p - e_y) x^T, p - e_y), by hand."""
    r = torch.softmax(model(x[None]).detach()[0], 0) - F.one_hot(y, model.out_features).to(x.dtype)
    return {"weight": r[:, None] * x[None, :], "bias": r}


def test_dp_gradients_one_sample_and_empty_batch_by_hand():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    x, y = torch.tensor([[1.0, -2.0, 0.5]], dtype=torch.float64), torch.tensor([1])
    g = _linear_ce_grad(model, x[0], y[0])
    norm = torch.sqrt(sum(v.pow(2).sum() for v in g.values())).item()
    loss = anfr.dp_gradients(model, x, y, sigma=0.0, max_norm=100.0, expected_batch=4)  # a batch of one, unclipped
    assert loss.item() == pytest.approx(F.cross_entropy(model(x), y).item(), rel=1e-12)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, g[n] / 4, rtol=1e-10, atol=0), n
    # clipped to C = 0.1, plus the noise sigma C z / B, z from torch's generator in parameter order
    torch.manual_seed(7)
    anfr.dp_gradients(model, x, y, sigma=0.5, max_norm=0.1, expected_batch=4)
    torch.manual_seed(7)
    z = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, (g[n] * 0.1 / (norm + 1e-6) + 0.5 * 0.1 * z[n]) / 4, rtol=1e-10, atol=1e-15), n
    torch.manual_seed(3)  # an empty Poisson batch: noise only, loss 0
    loss = anfr.dp_gradients(model, x[:0], y[:0], sigma=0.5, max_norm=2.0, expected_batch=4)
    torch.manual_seed(3)
    z = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    assert loss.item() == 0.0
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, 0.5 * 2.0 * z[n] / 4, rtol=1e-12, atol=0), n


def test_dp_gradients_match_per_sample_loop():
    torch.manual_seed(0)
    model = common.resnet(3, 4, 8, depth=18, width=4, norm="nf", attention="eca")
    x, y = torch.randn(5, 3, 8, 8), torch.tensor([0, 1, 2, 3, 0])
    ref = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for i in range(5):  # one sample at a time, clipped to 0.5 by hand
        model.zero_grad()
        F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters()))
        for n, p in model.named_parameters():
            ref[n] += p.grad * min(1.0, 0.5 / (norm.item() + 1e-6))
    anfr.dp_gradients(model, x, y, sigma=0.0, max_norm=0.5, expected_batch=4)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, ref[n] / 4, atol=1e-6), n
    torch.manual_seed(1)
    anfr.dp_gradients(model, x, y, sigma=1.0, max_norm=0.5, expected_batch=4)  # noise N(0, (sigma C)^2) / B
    noise = torch.cat([(p.grad - ref[n] / 4).flatten() for n, p in model.named_parameters()]) * 4
    assert 0.45 < noise.std().item() < 0.55


def test_rdp_log_erfc_and_log_sub():
    for x in (0.1, 1.0, 5.0, 20.0, 26.0):
        assert anfr._log_erfc(x) == pytest.approx(math.log(math.erfc(x)), rel=1e-12)
    # erfc underflows past x ~ 27.2; the asymptotic series
    # erfc x = e^{-x^2} / (x sqrt(pi)) sum_n (-1)^n (2n-1)!! / (2x^2)^n,
    # 8 terms (error < 1e-15 here), checked against math.erfc at x = 26 where both exist
    for x in (26.0, 28.0, 40.0, 1e3):
        series = sum((-1) ** n * math.prod(range(1, 2 * n, 2)) / (2 * x * x) ** n for n in range(8))
        ref = -x * x - math.log(x * math.sqrt(math.pi)) + math.log(series)
        assert abs(anfr._log_erfc(x) - ref) < 1e-8, x  # the code keeps 3 terms: error 15 / (8 x^6) < 4e-9
    assert anfr._log_sub(math.log(5.0), math.log(3.0)) == pytest.approx(math.log(2.0), rel=1e-12)
    assert anfr._log_sub(1.5, 1.5) == -math.inf  # log(e^a - e^a) = log 0


def test_rdp_edge_cases():
    assert anfr.rdp_subsampled_gaussian(0.0, 1.1, 2.5) == 0.0  # nobody sampled: no privacy loss
    assert anfr.rdp_subsampled_gaussian(0.05, 0.0, 2.5) == math.inf  # no noise
    q = 0.05  # sigma = 1, alpha = 2 by hand: A_2 = 1 + q^2 (e^{1/sigma^2} - 1)
    assert anfr.rdp_subsampled_gaussian(q, 1.0, 2) == pytest.approx(math.log(1 + q * q * (math.e - 1)), rel=1e-12)
    assert anfr.rdp_subsampled_gaussian(1.0, 2.0, 3) == pytest.approx(3 / 8, rel=1e-15)  # alpha / (2 sigma^2)


def test_rdp_accountant():
    # RDP of the subsampled Gaussian: values (rounded) of TF Privacy's rdp_accountant test (q=0.01, sigma=2.5, 50 steps)
    rdp = [50 * anfr.rdp_subsampled_gaussian(0.01, 2.5, a) for a in (1.5, 2.5, 5, 50, 100)]
    assert rdp == pytest.approx([0.00065, 0.001085, 0.00218075, 0.023846, 167.416307], rel=1e-3)
    # by hand, alpha = 2: A_2 = (1-q)^2 + 2q(1-q) + q^2 e^{1/sigma^2}
    q, s = 0.05, 1.1
    assert anfr.rdp_subsampled_gaussian(q, s, 2) == pytest.approx(
        math.log(1 + q * q * (math.exp(1 / s**2) - 1)), rel=1e-12
    )
    assert anfr.rdp_subsampled_gaussian(q, s, 3.0000001) == pytest.approx(
        anfr.rdp_subsampled_gaussian(q, s, 3), rel=1e-5
    )
    # by hand, no subsampling: R(a) = T a / (2 sigma^2), eps = min_a R - (log d + log a)/(a-1) + log((a-1)/a)
    T, d = 10, 1e-5
    hand = min(
        T * a / (2 * s * s) - (math.log(d) + math.log(a)) / (a - 1) + math.log((a - 1) / a) for a in anfr.DP_ORDERS
    )
    assert anfr.dp_epsilon(1.0, s, T, d) == pytest.approx(hand, rel=1e-9)
    e = [anfr.dp_epsilon(0.05, s, t, d) for t in (10, 100, 1000)]
    assert 0 < e[0] < e[1] < e[2]  # grows with steps
    assert anfr.dp_epsilon(0.05, 2.0, 100, d) < e[1] < anfr.dp_epsilon(0.05, 0.8, 100, d)  # shrinks with noise
    assert anfr.dp_epsilon(0.05, s, 0, d) == 0.0


@pytest.mark.parametrize(
    "q,sigma,steps,delta",
    [
        (0.01, 1.1, 1000, 1e-5),
        (0.05, 0.8, 50, 1e-4),
        (0.2, 2.0, 300, 1e-6),
        (0.5, 0.7, 10, 1e-5),
        (0.004, 4.0, 10000, 1e-5),
        (0.1, 5.0, 5, 1e-3),
    ],
)
def test_dp_epsilon_matches_opacus(q, sigma, steps, delta):
    """Opacus's RDP accountant (its own orders, which are ours); the best orders here are 9.6, 3.4, 3.4, 2.1,
    40 and 46, so both the fractional and the integer formulas count."""
    accountants = pytest.importorskip("opacus.accountants")
    acc = accountants.RDPAccountant()
    acc.history.append((sigma, q, steps))
    assert anfr.DP_ORDERS == acc.DEFAULT_ALPHAS
    assert anfr.dp_epsilon(q, sigma, steps, delta) == pytest.approx(acc.get_epsilon(delta), rel=1e-9)


# ---------------------------------------------------------------------------------------------- end to end
def _tamper(run_dir, client):
    """Shift client `client`'s kept (FedPer/FedBN) floating entries in the checkpoint by 0.5."""
    path = os.path.join(run_dir, "checkpoint.pt")
    ckpt = torch.load(path, weights_only=False)
    ckpt["local"][client] = {k: v + 0.5 if v.is_floating_point() else v for k, v in ckpt["local"][client].items()}
    torch.save(ckpt, path)


def _run_here(*argv):
    """Run a script in this process (torch is imported already), restoring what a run changes."""
    handler, old_argv = signal.getsignal(signal.SIGINT), sys.argv
    try:
        sys.argv = list(map(str, argv))
        runpy.run_path(os.path.join(ROOT, argv[0]), run_name="__main__")
    except SystemExit as e:  # as helpers.run_batches: a non-zero exit fails, and does not end pytest
        if e.code not in (None, 0):
            raise AssertionError(f"{argv} exited {e.code}") from None
    finally:
        sys.argv = old_argv
        signal.signal(signal.SIGINT, handler)


def anfr_cmd(tmp, out, *flags):
    return ["anfr.py", *TINY, *flags, "--out", str(tmp / out)]


# FedAvg with FedPer and DP-SGD (resume, local heads, accountant), SCAFFOLD (_a is also a learning run), FedBN
GROUPS = {
    "scaffold": ["--agg", "scaffold", "--attention", "cbam", "--rounds", "2"],
    "fedper": ["--pfl", "fedper", "--attention", "eca", "--rounds", "2", "--dp-noise-multiplier", "0.8"],
    "fedbn": ["--arch", "se", "--pfl", "fedbn", "--rounds", "2", "--local-steps", "10", "--eval-every", "2"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted runs, in two processes at a time: this one (every --arch) and one of
    helpers.run_batches (every --agg, FedPer with DP-SGD; most of a tiny run's CPU is importing torch)."""
    tmp = tmp_path_factory.mktemp("anfr")
    arch = [
        anfr_cmd(
            tmp,
            f"arch_{a}",
            "--arch",
            a,
            "--eval-every",
            "3",
            *(["--analyze", "--save-model"] if a == "se" else []),
            *(["--lr", "0.01"] if a == "gn" else []),  # GN wants a smaller lr
            # 15 steps are too few for these two (0.16-0.26 at some seeds)
            *(["--local-steps", "10"] if a in ("bn", "gn") else []),
        )
        for a in ("bn", "gn", "se", "nf", "anfr")
    ]
    others = [
        anfr_cmd(tmp, "agg_fedprox", "--agg", "fedprox", "--eval-every", "3"),
        anfr_cmd(tmp, "agg_fedadam", "--agg", "fedadam", "--server-lr", "0.1", "--eval-every", "3"),
        *[anfr_cmd(tmp, f"{g}_a", *GROUPS[g], "--save-model") for g in ("scaffold", "fedper")],
        anfr_cmd(tmp, "channels_last", "--arch", "anfr", "--eval-every", "3", "--channels-last", "--tf32"),
    ]
    with ThreadPoolExecutor(1) as pool:  # one process for the others, while this one (torch imported) does the rest
        pending = pool.submit(run_batches, others)
        for c in arch:
            _run_here(*c)
        pending.result()
    return tmp


@pytest.fixture(scope="module")
def pairs(runs):
    """X_b: --stop-after 1, then --resume (fedbn_b: not resumed); X_t: a copy of X_b after round 1 with client 0's
    FedPer/FedBN parts shifted by 0.5, then --resume; and fedbn_a, uninterrupted. Returns the round-1 checkpoints."""
    tmp = runs

    def resume(g):
        return ["anfr.py", "--resume", str(tmp / g)]

    stopped = [anfr_cmd(tmp, f"{g}_b", *f, "--save-model", "--stop-after", "1") for g, f in GROUPS.items()]
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(run_batches, stopped + [resume("scaffold_b")])
        _run_here(*anfr_cmd(tmp, "fedbn_a", *GROUPS["fedbn"], "--save-model"))
        pending.result()
    # after round 1
    ckpt1 = {g: torch.load(tmp / f"{g}_b" / "checkpoint.pt", weights_only=False) for g in ("fedper", "fedbn")}
    for g in ("fedper", "fedbn"):
        shutil.copytree(tmp / f"{g}_b", tmp / f"{g}_t")
        _tamper(tmp / f"{g}_t", 0)
    for g in ("fedper_b", "fedper_t", "fedbn_t"):  # one short round each: cheaper here than a new torch import
        _run_here(*resume(g))
    for run in sorted(os.listdir(tmp)):  # shown with pytest -s
        print(run, [round(r["test_acc"], 3) for r in metrics(tmp / run)])
    return ckpt1


@pytest.mark.parametrize(
    "run", ["arch_bn", "arch_gn", "arch_se", "arch_nf", "arch_anfr", "agg_fedprox", "scaffold_a", "agg_fedadam"]
)
def test_every_arch_and_agg_learns(runs, run):
    acc = summary(runs / run)["test_acc"]  # --arch runs use FedAvg; --agg runs use ANFR
    assert acc > 2 * CHANCE, acc


def test_analyze_reports_the_final_model(runs):
    tmp = runs  # the numbers themselves: test_analyze_by_hand
    a = summary(tmp / "arch_se")["analysis"]
    args = SimpleNamespace(**json.load(open(tmp / "arch_se" / "config.json")))
    data = common.load_data(args)
    model = anfr.build(args, data)
    model.load_state_dict(torch.load(tmp / "arch_se" / "model.pt"))
    again = anfr.analyze(model, data, args.image_size)
    assert a.keys() == again.keys() and sum(a["csi_hist"]) == 8 * 8
    for key in a:  # (pytest.approx takes no nested values such as the histogram)
        assert a[key] == pytest.approx(again[key], rel=1e-5), key
    final_gains = float(torch.cat([g.detach().abs().flatten() for g in anfr.last_gains(model)]).mean())
    rows = metrics(tmp / "arch_se")
    assert rows[-1]["last_gain_abs_mean"] == pytest.approx(final_gains, rel=1e-6) and final_gains > 0  # opened
    assert all(0 <= r["last_gain_grad_sign_keep"] <= 1 and 0 < r["last_gain_grad_coherence"] <= 1 for r in rows)
    assert all(0 < r["last_gain_server_step"] <= r["last_gain_client_step"] for r in rows)  # the triangle inequality


@pytest.mark.slow  # the stopped and resumed runs
@pytest.mark.parametrize("name", ["fedper", "scaffold"])  # FedAvg (+ FedPer + DP-SGD), SCAFFOLD
def test_resume_equals_uninterrupted(runs, pairs, name):
    tmp = runs
    a, b = f"{name}_a", f"{name}_b"
    assert metrics(tmp / a) == metrics(tmp / b)  # includes the DP accountant's epsilons for fedper
    assert_same_model(tmp / a, tmp / b)
    ca = torch.load(tmp / a / "checkpoint.pt", weights_only=False)
    cb = torch.load(tmp / b / "checkpoint.pt", weights_only=False)
    rounds = json.load(open(tmp / a / "config.json"))["rounds"]
    assert ca["client_steps"] == cb["client_steps"] == [rounds * 5] * 3  # each client's scheduler position
    assert ca["local"] == [None] * 3 or all(
        torch.equal(x[k], y[k]) for x, y in zip(ca["local"], cb["local"]) for k in x
    )
    assert (ca["c"] is None) == (name == "fedper")
    if ca["c"] is not None:  # SCAFFOLD server and client controls
        assert all(torch.equal(ca["c"][n], cb["c"][n]) and ca["c"][n].abs().sum() > 0 for n in ca["c"])
        assert all(torch.equal(x[n], y[n]) for x, y in zip(ca["c_i"], cb["c_i"]) for n in x)
    for sa, sb in zip(ca["opts"], cb["opts"]):  # each client's AdamW state
        assert sa["state"] and all(
            torch.equal(sa["state"][i]["exp_avg_sq"], sb["state"][i]["exp_avg_sq"]) for i in sa["state"]
        )


@pytest.mark.slow  # the stopped, tampered and resumed runs
@pytest.mark.parametrize("name,kind", [("fedper", "head"), ("fedbn", "bn")])
def test_pfl_keeps_local_parts_per_client(runs, pairs, name, kind):
    tmp, ckpt1 = runs, pairs[name]  # after round 1
    a = torch.load(tmp / f"{name}_a" / "checkpoint.pt", weights_only=False)  # after round 2 (the last)
    # same, client 0's parts shifted after round 1
    t = torch.load(tmp / f"{name}_t" / "checkpoint.pt", weights_only=False)
    keys = sorted(a["local"][0])
    assert keys and all(k.startswith("head.") for k in keys) == (kind == "head")
    assert any("running_mean" in k for k in keys) == (kind == "bn")
    for k in keys:  # never averaged: the global model's entries are still the initial ones
        assert torch.equal(a["model"][k], ckpt1["model"][k]), k
    assert not torch.equal(a["local"][0][keys[0]], a["local"][1][keys[0]])  # each client has its own
    # client 0 continued from its shifted parts, the other clients from their own, bitwise unchanged
    assert any(not torch.equal(a["local"][0][k], t["local"][0][k]) for k in keys)
    for c in range(1, len(a["local"])):
        assert all(torch.equal(a["local"][c][k], t["local"][c][k]) for k in keys), c
    last = metrics(tmp / f"{name}_a")[-1]
    assert last["test_acc"] == pytest.approx(np.mean(last["client_test_acc"]))  # personalized accuracy
    assert name == "fedper" or last["test_acc"] > 2 * CHANCE  # (fedper runs under DP noise here)


def test_dp_epsilon_per_client(runs):
    tmp = runs  # the FedPer run uses DP-SGD with sigma 0.8, C 1, B 16, 5 steps per round
    rows = metrics(tmp / "fedper_a")
    sizes = [sum(c) for c in json.load(open(tmp / "fedper_a" / "partition.json"))["train"]]
    for r, row in enumerate(rows, 1):
        expect = [anfr.dp_epsilon(16 / n, 0.8, 5 * r, 0.1 / n) for n in sizes]  # delta = 0.1 / |D_i|
        assert row["dp_epsilon"] == pytest.approx(expect, rel=1e-9)
        assert row["dp_epsilon_max"] == max(row["dp_epsilon"])
    assert rows[1]["dp_epsilon_max"] > rows[0]["dp_epsilon_max"] > 0
    assert torch.load(tmp / "fedper_a" / "checkpoint.pt", weights_only=False)["dp_steps"] == [10] * 3


def test_bad_flags_name_the_flag(tmp_path, monkeypatch, capsys):  # parse_args in this process: no torch import
    for flags, words in (
        (["--arch", "anfr", "--pfl", "fedbn"], ("--pfl fedbn", "no batch norm")),
        (["--arch", "se", "--dp-noise-multiplier", "1.0"], ("--dp-noise-multiplier", "batch norm")),
        (["--arch", "gn", "--last-gain-init", "1"], ("--last-gain-init", "--arch nf or anfr")),
    ):
        monkeypatch.setattr("sys.argv", ["anfr.py", *TINY, *flags, "--out", str(tmp_path / "x")])
        with pytest.raises(SystemExit) as e:
            anfr.parse_args()
        err = capsys.readouterr().err
        assert e.value.code == 2 and all(w in err for w in words), err


def test_last_gain_init_reaches_every_last_gain(tmp_path, monkeypatch):
    data = SimpleNamespace(in_channels=3, num_classes=10, image_size=16)
    for flags, start in (([], 0.0), (["--last-gain-init", "1"], 1.0), (["--last-gain-init", "0.3"], 0.3)):
        monkeypatch.setattr("sys.argv", ["anfr.py", *TINY, "--arch", "anfr", *flags, "--out", str(tmp_path / "x")])
        model = anfr.build(anfr.parse_args(), data)
        last = {id(b.conv2) for b in model.body.stages}  # depth 18: the last conv of a basic block is conv2
        convs = [m for m in model.modules() if isinstance(m, common.ScaledStdConv2d)]
        assert len(convs) == 1 + 8 * 2 + 3 and len(last) == 8  # stem, blocks, shortcuts
        assert all(torch.all(m.gain == (start if id(m) in last else 1.0)) for m in convs)


def test_init_from_loads_matching_entries(tmp_path):
    src = common.resnet(3, 1000, 32, depth=18, width=4, norm="nf", attention="se")
    torch.save(src.state_dict(), tmp_path / "w.pt")
    dst = common.resnet(3, 10, 32, depth=18, width=4, norm="nf", attention="se")
    loaded, total = anfr.load_pretrained(dst, str(tmp_path / "w.pt"), [2, 2, 2, 2])
    assert total - loaded == 2  # the 1000-class head (weight, bias) is skipped, everything else copied
    assert all(torch.equal(v, src.body.state_dict()[k]) for k, v in dst.body.state_dict().items())


def test_init_from_refuses_a_file_that_leaves_entries_unloaded(tmp_path, monkeypatch, capsys):
    bn = common.resnet(3, 10, 16, depth=18, width=8, norm="bn", attention="se").state_dict()
    nf = common.resnet(3, 10, 16, depth=18, width=8, norm="nf").state_dict()
    missing = [k for k in nf if not k.startswith("head.") and not (k in bn and bn[k].shape == nf[k].shape)]
    torch.save(bn, tmp_path / "bn.pt")
    monkeypatch.setattr(
        "sys.argv",
        ["anfr.py", *TINY, "--arch", "nf", "--init-from", str(tmp_path / "bn.pt"), "--out", str(tmp_path / "run")],
    )
    with pytest.raises(SystemExit) as e:
        runpy.run_path(os.path.join(ROOT, "anfr.py"), run_name="__main__")
    err = capsys.readouterr().err.strip().splitlines()
    # The folder Run made and left empty is removed as the run ends.
    assert e.value.code == 2 and len(err) == 1 and not (tmp_path / "run").exists()
    assert (
        f"--init-from {tmp_path / 'bn.pt'}: {len(missing)} entries of ours" in err[0]
        and ", ".join(missing[:3]) + ", ..." in err[0]
    )
    model = common.resnet(3, 10, 16, depth=18, width=8, norm="bn")  # no SE: the file's SE entries would be dropped
    with pytest.raises(ValueError, match="32 entries of it fitting none of ours: body.stages.0.attn.fc1.weight"):
        anfr.load_pretrained(model, bn, [2, 2, 2, 2])


def test_bn_stats_local_keeps_each_clients_statistics_and_scores_each_clients_model(tmp_path):
    """--bn-stats local (Pieri et al.): the parameters are averaged, every client keeps its running statistics
    (the global model's stay as they started), and test_acc / val_acc are the means over the clients' models
    (the averaged parameters with the client's statistics), recomputed here from the saved state."""
    out = tmp_path / "bn_local"
    flags = ["--arch", "bn", "--bn-stats", "local", "--val-frac", "0.2", "--rounds", "2", "--save-model"]
    _run_here("anfr.py", *TINY, *flags, "--out", out)
    ckpt = torch.load(out / "checkpoint.pt", weights_only=False)
    args = SimpleNamespace(**json.load(open(out / "config.json")))
    data = common.load_data(args)
    model = anfr.build(args, data)
    model.load_state_dict(torch.load(out / "model.pt"))
    keys = anfr.personal_keys(model, "none", "local")
    assert all(set(local) == keys for local in ckpt["local"])
    mean = "body.stem.1.running_mean"
    assert not torch.equal(ckpt["local"][0][mean], ckpt["local"][1][mean])
    assert not model.state_dict()[mean].any() and bool((model.state_dict()[mean.replace("mean", "var")] == 1).all())
    partition = common.make_partition(args, data)
    scores = []
    for local in ckpt["local"]:
        model.load_state_dict(local, strict=False)
        model.eval()

        def net(x):
            return model(anfr.resize(x, args.image_size))

        held = torch.cat(partition.val)
        test = common.evaluate(net, data.x_test, data.y_test, data)[0]
        scores.append((test, common.evaluate(net, data.x_train[held], data.y_train[held], data)[0]))
    row = metrics(out)[-1]
    assert row["test_acc"] == pytest.approx(np.mean([s[0] for s in scores]), abs=1e-12)
    assert row["val_acc"] == pytest.approx(np.mean([s[1] for s in scores]), abs=1e-12)
    assert len({s[0] for s in scores}) > 1  # the clients' models differ
    assert summary(out)["test_acc_at_best_val"] in {r["test_acc"] for r in metrics(out)}


def test_optimizer_flag_and_weight_decay_defaults(monkeypatch):
    def parse(*flags):
        return anfr_args(monkeypatch, *flags)

    sgd, adamw = parse("--optimizer", "sgd"), parse()
    assert (
        sgd.weight_decay,
        adamw.weight_decay,
        parse("--optimizer", "sgd", "--weight-decay", "0.1").weight_decay,
    ) == (
        0.0,  # Pieri et al.'s SGD
        0.05,  # their AdamW
        0.1,
    )
    params = [torch.nn.Parameter(torch.zeros(3))]
    opt = anfr.make_optimizer(params, sgd)
    assert isinstance(opt, torch.optim.SGD) and opt.defaults["momentum"] == 0.9 and opt.defaults["weight_decay"] == 0
    assert isinstance(anfr.make_optimizer(params, adamw), torch.optim.AdamW)


def anfr_args(monkeypatch, *flags):
    monkeypatch.setattr(
        sys, "argv", ["anfr.py", "--dataset", "synthetic", "--device", "cpu", "--out", "unused", *flags]
    )
    return anfr.parse_args()


def test_client_state_reset_keeps_nothing_per_client_and_schedules_by_round(tmp_path):
    """--client-state reset (cross-device): the first round equals keep's bit for bit (both start fresh); the
    second does not (keep carries AdamW's moments); the checkpoint holds no optimizer state; the lr follows the
    round's place in the run, also for a client that trains for the first time."""
    flags = ["--rounds", "2", "--eval-every", "1", "--frac", "0.5", "--warmup-steps", "0", "--save-model"]
    runs = {name: tmp_path / name for name in ("keep", "reset")}
    for name, out in runs.items():
        _run_here("anfr.py", *TINY, *flags, "--client-state", name, "--out", out)
    keep, reset = metrics(runs["keep"]), metrics(runs["reset"])
    assert keep[0] == reset[0]  # (helpers.metrics drops elapsed_s)
    assert keep[1]["train_loss"] != reset[1]["train_loss"]
    assert torch.load(runs["reset"] / "checkpoint.pt", weights_only=False)["opts"] is None
    steps = 5  # TINY's --local-steps
    assert reset[1]["lr"] == pytest.approx(anfr.cosine_lr(0.03, 2 * steps, 2 * steps))  # after round 2 of 2: 0
    assert reset[0]["lr"] == pytest.approx(anfr.cosine_lr(0.03, steps, 2 * steps))


def test_channels_last_and_tf32_compute_the_same_run(runs):
    """The speed levers --channels-last (NHWC weights and batches) and --tf32 (CUDA matmuls; nothing on the CPU)
    change the memory layout, not the math: on the CPU the run matches arch_anfr's to float rounding."""
    plain, nhwc = metrics(runs / "arch_anfr"), metrics(runs / "channels_last")
    assert [r["round"] for r in plain] == [r["round"] for r in nhwc]
    for a, b in zip(plain, nhwc):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-4)
        assert abs(b["test_acc"] - a["test_acc"]) <= 0.01
    assert json.load(open(runs / "channels_last" / "config.json"))["channels_last"] is True
    x = torch.arange(2 * 3 * 4 * 4, dtype=torch.float).view(2, 3, 4, 4)
    nhwc_x = anfr.resize(x, None, channels_last=True)
    assert nhwc_x.is_contiguous(memory_format=torch.channels_last) and torch.equal(nhwc_x, x)
    assert anfr.resize(x, 8).shape == (2, 3, 8, 8) and anfr.resize(x, 4) is x

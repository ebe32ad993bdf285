"""benchmarks/proxy_properties.py's measurements by hand, and the CPU-sized models it measures (vgg11-narrow,
convnet4-narrow): synthetic data only, a few seconds on one thread."""

import argparse
import math
import os
import sys

import pytest
import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import proxy_properties as pp  # noqa: E402
from common import MODELS, Classifier, Data  # noqa: E402


def fake_data(n=8, channels=3, size=32, classes=10):
    torch.manual_seed(0)
    x = torch.randint(0, 256, (n, channels, size, size), dtype=torch.uint8)
    mean, std = torch.full((1, channels, 1, 1), 0.5), torch.full((1, channels, 1, 1), 0.25)
    return Data(x, torch.arange(n) % classes, x, torch.arange(n) % classes, classes, mean, std)


# ------------------------------------------------------------------ the measurements
def test_row_coherence_by_hand():
    # rows (1, 0), (0, 1), (1, 1): |cos| of the pairs 0, 1/sqrt(2), 1/sqrt(2)
    mean, top = pp.row_coherence(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]))
    assert mean == pytest.approx(2 / math.sqrt(2) / 3) and top == pytest.approx(1 / math.sqrt(2))
    # the sign does not count, nor the length of a row
    assert pp.row_coherence(torch.tensor([[2.0, 0.0], [-3.0, 0.0]])) == pytest.approx((1.0, 1.0))


def test_feature_norm_and_head_row_norm_on_a_hand_made_model():
    model = Classifier(nn.Identity(), 2, 3)  # the feature is the input itself
    with torch.no_grad():
        model.head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 4.0]]))
    x = torch.tensor([[3.0, 4.0], [0.0, 1.0]])
    assert pp.feature_norm(model, x) == pytest.approx((5 + 1) / 2)
    assert pp.head_row_norm(model) == pytest.approx((1 + 2 + 5) / 3)
    scaled = Classifier(nn.Linear(2, 2, bias=False), 2, 3)
    with torch.no_grad():
        scaled.body.weight.copy_(2 * torch.eye(2))
    assert pp.feature_norm(scaled, x) == pytest.approx(6.0)


def gain(*values):
    return torch.tensor(values).view(-1, 1, 1, 1)


def test_last_gain_mean_on_a_hand_made_state_dict():
    sd = {
        "body.stem.0.gain": gain(9.0),  # not a block's: left out
        "body.stages.0.conv1.gain": gain(9.0, 9.0),  # not the last conv of its block
        "body.stages.0.conv2.gain": gain(0.0, 3.0),
        "body.stages.0.attn.spatial.0.gain": gain(9.0),  # CBAM's: left out
        "body.stages.1.conv1.gain": gain(9.0),
        "body.stages.1.conv2.gain": gain(1.0, 1.0, 1.0, 1.0),
        "body.stages.1.shortcut.conv.gain": gain(9.0),  # a shortcut's: left out
        "body.stages.1.conv1.weight": torch.ones(4, 1, 3, 3),
    }
    assert pp.last_gain_mean(sd) == pytest.approx((0 + 3 + 1 + 1 + 1 + 1) / 6)  # pooled over channels
    signed = {"body.stages.0.conv2.gain": gain(-2.0, 1.0, 0.5)}
    assert pp.last_gain_mean(signed) == pytest.approx(-0.5 / 3)
    assert pp.last_gain_mean(signed, absolute=True) == pytest.approx(3.5 / 3)  # |g|: the branch's scale
    assert pp.last_gain_mean({"model": sd, "round": 3}) == pytest.approx(7 / 6)  # a checkpoint.pt's dict
    bottleneck = {f"body.stages.0.conv{k}.gain": gain(float(k)) for k in (1, 2, 3)}
    assert pp.last_gain_mean(bottleneck) == 3.0
    with pytest.raises(ValueError):
        pp.last_gain_mean({"body.stages.0.conv1.weight": torch.ones(1)})


def test_run_gain_rows_read_checkpoint_then_model_and_skip_bn(tmp_path, capsys):
    nf = {"body.stages.0.conv2.gain": gain(1.0, -2.0)}
    runs = {name: tmp_path / name for name in ("ckpt", "both", "final", "bn", "empty")}
    for d in runs.values():
        d.mkdir()
    torch.save({"round": 7, "model": nf}, runs["ckpt"] / "checkpoint.pt")
    torch.save({"round": 9, "model": {"body.stages.0.conv2.gain": gain(4.0)}}, runs["both"] / "checkpoint.pt")
    torch.save(nf, runs["both"] / "model.pt")  # checkpoint.pt wins
    torch.save({"body.stages.0.conv2.gain": gain(0.5)}, runs["final"] / "model.pt")
    torch.save({"round": 3, "model": {"body.stages.0.bn1.weight": torch.ones(2)}}, runs["bn"] / "checkpoint.pt")
    rows = pp.run_gain_rows([str(d) for d in runs.values()])
    assert rows == [
        (str(runs["ckpt"]), 7, "-0.5000", "1.5000"),
        (str(runs["both"]), 9, "4.0000", "4.0000"),
        (str(runs["final"]), "final", "0.5000", "0.5000"),
    ]
    skipped = capsys.readouterr().err.splitlines()
    assert skipped == [
        f"skipped {runs['bn']}: no NF block gains in its checkpoint.pt",
        f"skipped {runs['empty']}: neither checkpoint.pt nor model.pt",
    ]


@pytest.mark.parametrize("depth,last", [(18, "conv2"), (26, "conv3")])
def test_last_gains_of_anfr_models_start_at_last_gain_init(depth, last):
    data = fake_data()
    for init in (0.0, 1.0):
        flags = dict(arch="anfr", depth=depth, width=8, stem="cifar", attention="se", last_gain_init=init)
        sd = pp.anfr.build(argparse.Namespace(**flags), data).state_dict()
        gains = pp.last_gains(sd)
        assert len(gains) == 8 and all(g is sd[f"{block}.{last}.gain"] for block, g in gains.items())
        assert pp.last_gain_mean(sd) == init


def test_step_time_and_the_rows_on_synthetic_data():
    data = fake_data()
    x, y = pp.prepare_batch(data.x_train, data), data.y_train
    assert pp.step_ms_per_image(MODELS["convnet4-tiny"](3, 10, 32), x, y, steps=1, batch_size=4) > 0
    rows = pp.fedfn_rows(data, x, y, [0, 1], steps=1, batch_size=4, models=["convnet4-tiny", "vgg11-narrow"])
    rows += pp.fedbabu_rows(data, x, y, [0], steps=1, batch_size=4, models=["convnet4-narrow"])
    text = pp.table(rows)
    assert text.startswith("| model | property | value |\n|---|---|---|\n")
    assert all(line.count("|") - line.count("\\|") == 4 for line in text.splitlines())  # three cells a row
    assert "(d = 128; sqrt(2/(pi d)) = 0.071)" in text and "| `vgg11-narrow` | parameters | 1,107,562 |" in text
    assert pp.spread([1.0, 2.0, 6.0]) == "3.000 [1.000, 6.000]" and pp.spread([0.5]) == "0.500"


# ------------------------------------------------------------------ the models
def test_vgg11_narrow_is_vgg11_at_a_quarter_width_with_four_pools():
    torch.manual_seed(0)
    model = MODELS["vgg11-narrow"](3, 10, 32)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert [m.out_channels for m in convs] == [16, 32, 64, 64, 128, 128, 128, 128]
    assert sum(isinstance(m, nn.MaxPool2d) for m in model.modules()) == 4
    assert not any(isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)) for m in model.modules())
    linears = [(m.in_features, m.out_features) for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears == [(512, 512), (512, 512), (512, 10)]  # fc 1 reads 128 x 2 x 2, as VGG11's reads 512 x 1 x 1
    # by hand: convs 3*16*9+16 = 448, 16*32*9+32 = 4,640, 32*64*9+64 = 18,496, 64*64*9+64 = 36,928,
    # 64*128*9+128 = 73,856, 3 x (128*128*9+128) = 3 x 147,584; fc 2 x (512*512+512); head 512*10+10
    assert (
        sum(p.numel() for p in model.parameters())
        == 448 + 4_640 + 18_496 + 36_928 + 73_856 + 3 * 147_584 + (2 * 262_656) + 5_130
    )
    assert model.body(torch.randn(2, 3, 32, 32)).shape == (2, 512) and model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    # vgg11's init: conv weights N(0, 2/(9*C_out)), zero biases
    assert all(not m.bias.detach().any() for m in convs)
    assert float(convs[-1].weight.detach().std()) == pytest.approx(math.sqrt(2 / (9 * 128)), rel=0.02)


def test_vgg11_keeps_its_size():
    # convs 1,792 + 73,856 + 295,168 + 590,080 + 1,180,160 + 3 x 2,359,808; fc 2 x 262,656; head 5,130
    model = MODELS["vgg11"](3, 10, 32)
    assert sum(p.numel() for p in model.parameters()) == 9_750_922


def test_convnet4_narrow_is_convnet4_at_32_channels():
    model = MODELS["convnet4-narrow"](3, 10, 32)
    assert [m.out_channels for m in model.modules() if isinstance(m, nn.Conv2d)] == [32] * 4
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert len(bns) == 4 and not any(m.track_running_stats for m in bns)  # as convnet4: nothing but weights
    assert model.head.in_features == 32 * 2 * 2 == 128 and model.head.out_features == 10
    # by hand: conv 3*32*9+32 = 896, 3 x (32*32*9+32) = 3 x 9,248, BN 4 x 64, head 128*10+10 = 1,290
    assert sum(p.numel() for p in model.parameters()) == 896 + 3 * 9_248 + 4 * 64 + 1_290 == 30_186
    assert model.body(torch.randn(2, 3, 32, 32)).shape == (2, 128)

"""FedNNNN (fednnnn.py): Algorithm 3's server math on hand-made updates, the paper's models, and
end-to-end runs (FedAvg reproduced bit for bit, evaluation vs broadcast model, resume with d_t)."""
import argparse
import shutil

import pytest
import torch
import torch.nn as nn

import common
import fednnnn
from helpers import assert_same_model, metrics, run_script, summary

SHAPES = {"conv.w": (4, 3, 2, 2), "conv.b": (4,), "fc.w": (5, 6), "bn.w": (7,)}
KINDS = {"conv.w": "conv", "conv.b": "conv", "fc.w": "fc", "bn.w": "other"}


def hand_round(seed, m=3, w=None, dtype=torch.float64):
    """w_t, m client updates Delta_k, weights n_k/n, the FedAvg average and the per-client squared norms."""
    g = torch.Generator().manual_seed(seed)
    if w is None:
        w = {n: torch.randn(s, generator=g, dtype=dtype) for n, s in SHAPES.items()}
    deltas = [{n: torch.randn(s, generator=g, dtype=dtype) for n, s in SHAPES.items()} for _ in range(m)]
    sizes = torch.randint(10, 100, (m,), generator=g)
    weights = common.client_weights(sizes.tolist(), "samples")
    return w, deltas, weights, *aggregate(w, deltas, weights)


def aggregate(w, deltas, weights):
    states = [{n: w[n] + dk[n] for n in w} for dk in deltas]
    w_avg = {n: sum(a * s[n] for a, s in zip(weights, states)) for n in w}  # Eq. 1
    client_sq = torch.stack([fednnnn.sq_norms(s, w, list(w)) for s in states])
    return w_avg, client_sq


def flat(d, names=None):
    return torch.cat([d[n].reshape(-1) for n in (names or list(d))])


def by_hand(w, deltas, weights, names=None):
    """N = ||sum_k a_k Delta_k|| and E = sum_k a_k ||Delta_k|| on flattened vectors (Eqs. 4-5)."""
    avg = sum(a * flat(dk, names) for a, dk in zip(weights, deltas))
    return avg, avg.norm().item(), sum(a * flat(dk, names).norm().item() for a, dk in zip(weights, deltas))


def test_norms_match_eqs_4_5_and_n_le_e_per_group():
    w, deltas, weights, w_avg, client_sq = hand_round(0)
    w_next = {n: w[n] + 3 * (w_avg[n] - w[n]) for n in w}  # a server step 3x the average update
    stats = fednnnn.norm_stats(w, w_next, w_avg, client_sq, weights, KINDS)
    _, N, E = by_hand(w, deltas, weights)
    assert stats["N"] == pytest.approx(N, rel=1e-9) and stats["E"] == pytest.approx(E, rel=1e-9)
    assert stats["step_norm"] == pytest.approx(3 * N, rel=1e-9)  # ||w_{t+1} - w_t|| (Eq. 24)
    assert stats["N"] < stats["E"]  # Proposition 1, strict for divergent updates
    for kind in ("conv", "fc", "other"):
        names = [n for n in KINDS if KINDS[n] == kind]
        _, N_g, E_g = by_hand(w, deltas, weights, names)
        assert stats[f"N_{kind}"] == pytest.approx(N_g, rel=1e-9)
        assert stats[f"E_{kind}"] == pytest.approx(E_g, rel=1e-9)
        assert stats[f"step_norm_{kind}"] == pytest.approx(3 * N_g, rel=1e-9)
        assert stats[f"N_{kind}"] < stats[f"E_{kind}"]
    w1, d1, a1, avg1, sq1 = hand_round(1, m=1)  # one client: N = E
    s1 = fednnnn.norm_stats(w1, avg1, avg1, sq1, a1, KINDS)
    assert s1["N"] == pytest.approx(s1["E"], rel=1e-12)


@pytest.mark.parametrize("scope", ["global", "layer"])
def test_gamma0_step_has_norm_beta_E_along_the_average(scope):
    w, deltas, weights, w_avg, client_sq = hand_round(2)
    d0 = {n: torch.zeros_like(v) for n, v in w.items()}
    w_next, d_next = fednnnn.fednnnn_step(w, w_avg, d0, client_sq, weights, beta=0.6, gamma=0.0, scope=scope)
    groups = [list(w)] if scope == "global" else [[n] for n in w]
    for names in groups:
        avg, N, E = by_hand(w, deltas, weights, names)
        step = flat(w_next, names) - flat(w, names)
        assert step.norm().item() == pytest.approx(0.6 * E, rel=1e-9)  # Eq. 9
        assert torch.allclose(step, 0.6 * E / N * avg, rtol=1e-9, atol=1e-12)  # direction of the average
        assert torch.allclose(flat(d_next, names), step, rtol=1e-9, atol=1e-12)  # d_1 = w_1 - w_0


@pytest.mark.parametrize("normalize", [True, False])
def test_momentum_recursion_eq_12_over_rounds(normalize):
    beta, gamma = 0.6, 0.7
    w, _, _, _, _ = hand_round(3)
    d = {n: torch.zeros_like(v) for n, v in w.items()}
    w_ref, d_ref = flat(w), torch.zeros_like(flat(w))
    for t in range(5):
        _, deltas, weights, w_avg, client_sq = hand_round(10 + t, m=4, w=w)
        avg, N, E = by_hand(w, deltas, weights)
        d_ref = gamma * d_ref + beta * (E / N if normalize else 1.0) * avg  # Eq. 12 (Eq. 10 unnormalized)
        w_ref = w_ref + d_ref  # Eq. 13
        w, d = fednnnn.fednnnn_step(w, w_avg, d, client_sq, weights, beta, gamma, normalize=normalize)
        assert torch.allclose(flat(d), d_ref, rtol=1e-9, atol=1e-10), t
        assert torch.allclose(flat(w), w_ref, rtol=1e-9, atol=1e-10), t
    assert d_ref.norm() > 0.5 * avg.norm()  # the momentum really contributes


def test_zero_or_tiny_n_is_not_normalized():
    w, deltas, _, _, _ = hand_round(4, m=1)
    cancel = [deltas[0], {n: -v for n, v in deltas[0].items()}]  # opposite updates: N = 0, E > 0
    _, client_sq = aggregate(w, cancel, [0.5, 0.5])
    w_avg = {n: v.clone() for n, v in w.items()}  # their average is exactly w_t
    d0 = {n: torch.zeros_like(v) for n, v in w.items()}
    w_next, d_next = fednnnn.fednnnn_step(w, w_avg, d0, client_sq, [0.5, 0.5], beta=0.6, gamma=0.0)
    assert client_sq.sum() > 0
    assert all(torch.equal(w_next[n], w[n]) for n in w)  # w unchanged, nothing blows up
    assert all(torch.equal(d_next[n], torch.zeros_like(w[n])) for n in w)
    d1 = {n: torch.ones_like(v) for n, v in w.items()}  # with momentum only gamma d_t moves w
    w_next, _ = fednnnn.fednnnn_step(w, w_avg, d1, client_sq, [0.5, 0.5], beta=0.6, gamma=0.7)
    assert torch.allclose(flat(w_next) - flat(w), torch.full_like(flat(w), 0.7))
    tiny = [deltas[0], {n: -v * (1 - 1e-9) for n, v in deltas[0].items()}]  # N ~ 1e-9 E: near zero
    w_avg, client_sq = aggregate(w, tiny, [0.5, 0.5])
    w_next, _ = fednnnn.fednnnn_step(w, w_avg, d0, client_sq, [0.5, 0.5], beta=0.6, gamma=0.0, eps=1e-6)
    step, avg = flat(w_next) - flat(w), flat(w_avg) - flat(w)
    assert torch.allclose(step, 0.6 * avg, rtol=1e-6, atol=1e-15)  # factor 1, not E/N ~ 1e9


def test_fedavg_setting_is_the_plain_average_bitwise():
    w, deltas, weights, w_avg, client_sq = hand_round(5, dtype=torch.float32)
    d = {n: torch.randn_like(v) for n, v in w.items()}  # any d_t: gamma = 0 forgets it
    w_next, d_next = fednnnn.fednnnn_step(w, w_avg, d, client_sq, weights, 1.0, 0.0, normalize=False)
    for n in w:
        assert torch.equal(w_next[n], w_avg[n]), n
        assert torch.equal(d_next[n], w_avg[n] - w[n]), n


def test_param_kinds_by_module_type_and_only_trainable():
    model = common.MODELS["cnn6"](3, 10, 32)
    kinds = fednnnn.param_kinds(model)
    assert list(kinds) == [n for n, _ in model.named_parameters()]  # buffers are not normalized
    assert not any("running" in n or "num_batches" in n for n in kinds)
    assert sum(k == "conv" for k in kinds.values()) == 12 and sum(k == "fc" for k in kinds.values()) == 6
    assert sum(k == "other" for k in kinds.values()) == 12  # the 6 batch norms' weight and bias
    assert kinds["head.weight"] == kinds["head.bias"] == "fc"
    lenet_kinds = fednnnn.param_kinds(common.MODELS["lenet"](1, 10, 28))
    assert list(lenet_kinds.values()) == ["conv"] * 4 + ["fc"] * 4


@pytest.mark.parametrize("name,dim", [("lenet", 500), ("cnn6", 192)])
@pytest.mark.parametrize("channels,size", [(1, 28), (3, 32)])
def test_paper_models(name, dim, channels, size):
    model = common.MODELS[name](channels, 10, size)
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert all(int(b.num_batches_tracked) == 0 for b in bns)  # built without a probe pass
    assert isinstance(model.head, nn.Linear) and model.head.in_features == dim
    x = torch.randn(3, channels, size, size)
    assert model.body(x).shape == (3, dim) and model(x).shape == (3, 10)
    layers = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    assert all(m.bias is not None for m in layers)  # "all with bias terms"
    types = "".join({nn.Conv2d: "C", nn.BatchNorm2d: "B", nn.ReLU: "R", nn.MaxPool2d: "P", nn.Flatten: "F",
                     nn.Linear: "L"}[type(m)] for m in model.body)
    if (channels, size) == {"lenet": (1, 28), "cnn6": (3, 32)}[name]:  # the paper's input: exact size
        assert sum(p.numel() for p in model.parameters()) == {"lenet": 431080, "cnn6": 1146088}[name]
    if name == "lenet":  # Table 3: conv5-20, ReLU, pool, conv5-50, ReLU, pool, fc 500, ReLU, fc 10
        assert types == "CRPCRPFLR" and all(m.kernel_size == (5, 5) for m in layers[:2])
        assert [m.out_channels for m in layers[:2]] == [20, 50] and layers[2].out_features == 500
    else:  # Table 4: [conv3 + BN + ReLU] x2 and pool per stage, fc 382, ReLU, fc 192, ReLU, fc 10
        assert types == "CBRCBRP" * 3 + "FLRLR" and all(m.kernel_size == (3, 3) for m in layers[:6])
        assert [m.out_channels for m in layers[:6]] == [32, 32, 64, 64, 128, 128]
        assert [m.out_features for m in layers[6:]] == [382, 192, 10]
        assert len(bns) == 6 and all(b.num_features == c for b, c in zip(bns, [32, 32, 64, 64, 128, 128]))


BASE = ["--dataset", "synthetic", "--device", "cpu", "--model", "lenet", "--num-clients", "4", "--batch-size", "16",
        "--lr", "0.05", "--momentum", "0", "--weight-decay", "5e-4"]


def test_beta1_gamma0_no_normalize_reproduces_fedavg(tmp_path):
    flags = BASE + ["--frac", "0.5", "--local-steps", "3", "--rounds", "2", "--eval-every", "2", "--augment", "crop-flip",
                    "--quantity", "powerlaw", "--seed", "3", "--save-model"]
    run_script("fedavg.py", *flags, "--out", tmp_path / "fedavg")
    run_script("fednnnn.py", *flags, "--beta", "1", "--gamma", "0", "--no-normalize", "--out", tmp_path / "nnnn")
    a, b = metrics(tmp_path / "fedavg"), metrics(tmp_path / "nnnn")
    assert [r["round"] for r in a] == [2] and [r["round"] for r in b] == [1, 2]  # + a norms-only row
    assert {k: b[1][k] for k in a[0]} == a[0]  # shared keys identical (test_acc, test_loss, train_loss, lr)
    assert all(r["step_norm"] == r["N"] < r["E"] for r in b)  # FedAvg's server step is the plain average
    assert_same_model(tmp_path / "fedavg", tmp_path / "nnnn")


def test_fednnnn_resume_evaluation_model_and_learning(tmp_path):
    flags = BASE + ["--frac", "1", "--local-steps", "3", "--rounds", "3", "--eval-every", "3", "--save-model"]
    full, part = tmp_path / "full", tmp_path / "part"
    run_script("fednnnn.py", *flags, "--out", full)
    run_script("fednnnn.py", *flags, "--out", part, "--stop-after", "2")  # stops after a round without evaluation
    shutil.copy(part / "checkpoint.pt", tmp_path / "round2.pt")
    run_script("fednnnn.py", "--resume", part)
    rows = metrics(full)
    assert rows == metrics(part)  # interrupted and resumed equals uninterrupted, bitwise
    assert_same_model(full, part)
    c_full, c_part = (torch.load(d / "checkpoint.pt", weights_only=False) for d in (full, part))
    assert all(torch.equal(c_full["momentum"][n], c_part["momentum"][n]) for n in c_full["momentum"])
    assert [r["round"] for r in rows] == [1, 2, 3]  # norms every round, test metrics at the evaluation
    assert ["test_acc" in r for r in rows] == [False, False, True]
    assert all(r["N"] < r["E"] and r["N_conv"] <= r["E_conv"] and r["N_fc"] <= r["E_fc"] for r in rows)
    assert rows[0]["step_norm"] == pytest.approx(0.6 * rows[0]["E"], rel=1e-4)  # d_0 = 0: norm beta*E
    s = summary(full)
    assert s["test_acc"] > 0.3  # 10 classes: chance is 0.1 (FedAvg with these flags stays near 0.1)
    # Round 3 from the saved states: evaluation model (model.pt) = w_2 + average update with norm N_3;
    # broadcast model (checkpoint) = w_2 + d_3, d_3 = gamma d_2 + beta E_3/N_3 (average update).
    c2, evaluated = torch.load(tmp_path / "round2.pt", weights_only=False), torch.load(full / "model.pt")
    names = list(c2["momentum"])
    avg = flat(evaluated, names) - flat(c2["model"], names)
    N, E = rows[2]["N"], rows[2]["E"]
    assert avg.norm().item() == pytest.approx(N, rel=1e-4)
    d3 = flat(c_full["momentum"], names)
    assert flat(c2["momentum"], names).norm() > 0.1 * d3.norm()  # resumed with a non-zero d_t
    assert torch.allclose(d3, 0.7 * flat(c2["momentum"], names) + 0.6 * E / N * avg, rtol=1e-4, atol=1e-6)
    assert torch.allclose(flat(c_full["model"], names), flat(c2["model"], names) + d3, rtol=1e-5, atol=1e-6)
    # The reported test metrics are the evaluation model's, not the broadcast model's (Sec. 4.1).
    data = common.load_data(argparse.Namespace(dataset="synthetic", data_dir=".", device="cpu", data_seed=0))
    net = common.MODELS["lenet"](data.in_channels, data.num_classes, data.image_size).eval()
    losses = []
    for state in (evaluated, c_full["model"]):
        net.load_state_dict(state)
        losses.append(common.evaluate(net, data.x_test, data.y_test, data)[1])
    assert losses[0] == pytest.approx(s["test_loss"], rel=1e-5)
    assert abs(losses[1] - s["test_loss"]) > 0.02 * s["test_loss"]  # the two models differ (here by ~7%)


@pytest.mark.parametrize("flag,value", [("--gamma", "1"), ("--beta", "0")])
def test_bad_server_flags_are_refused(monkeypatch, capsys, flag, value):
    monkeypatch.setattr("sys.argv", ["fednnnn.py", *BASE, flag, value])
    with pytest.raises(SystemExit) as exit_info:
        fednnnn.parse_args()
    assert exit_info.value.code == 2 and flag in capsys.readouterr().err

"""FedNNNN (fednnnn.py): Algorithm 3's server math on hand-made updates, the paper's models, and
end-to-end runs (FedAvg reproduced bit for bit, evaluation vs broadcast model, resume with d_t)."""

import argparse
import os
import runpy
import shutil
import signal
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn

import common
import fednnnn
from common import Data
from helpers import ROOT, assert_same_model, metrics, run_batches, run_script, summary

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


def test_zero_or_tiny_n_threshold_is_eps_times_e():
    """One client, weight 1, Delta = (1, 0): N = 1; its squared norm passed as 4 makes E = 2. The factor is
    E/N = 2 only when N > eps E (the docstring's N <= eps E gives 1), so eps = 0.5 sits exactly on the edge."""
    w, w_avg = {"a": torch.zeros(2, dtype=torch.float64)}, {"a": torch.tensor([1.0, 0.0], dtype=torch.float64)}
    d0, client_sq = {"a": torch.zeros(2, dtype=torch.float64)}, torch.tensor([[4.0]], dtype=torch.float64)
    for eps, factor in ((0.5, 1.0), (0.49, 2.0), (0.8, 1.0), (1e-6, 2.0)):
        w_next, _ = fednnnn.fednnnn_step(w, w_avg, d0, client_sq, [1.0], beta=0.5, gamma=0.0, eps=eps)
        assert torch.equal(w_next["a"], torch.tensor([0.5 * factor, 0.0], dtype=torch.float64)), eps


def test_fedavg_setting_is_the_plain_average_bitwise():
    w, deltas, weights, w_avg, client_sq = hand_round(5, dtype=torch.float32)
    d = {n: torch.randn_like(v) for n, v in w.items()}  # any d_t: gamma = 0 forgets it
    w_next, d_next = fednnnn.fednnnn_step(w, w_avg, d, client_sq, weights, 1.0, 0.0, normalize=False)
    for n in w:
        assert torch.equal(w_next[n], w_avg[n]), n
        assert torch.equal(d_next[n], w_avg[n] - w[n]), n


def test_prox_term_value_and_gradient_by_hand():
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    v = torch.tensor([[0.5]], requires_grad=True)
    term = common.prox_term([w, v], [torch.tensor([0.0, 4.0]), torch.tensor([[1.5]])], mu=0.1)
    assert term.item() == pytest.approx(0.05 * (1 + 4 + 1))  # mu/2 (||(1, -2)||^2 + ||-1||^2), Eq. 7
    term.backward()
    # mu (w - w_t)
    assert torch.allclose(w.grad, torch.tensor([0.1, -0.2])) and torch.allclose(v.grad, torch.tensor([[-0.1]]))


def test_local_train_one_fedprox_sgd_step_by_hand():
    """W <- W - lr (grad CE + mu (W - W_t)) on a bias-free linear model, the CE gradient (p - onehot)^T x / B
    in numpy."""
    x = torch.tensor([[10, 200], [50, 30], [255, 0], [120, 90]], dtype=torch.uint8).view(4, 1, 1, 2)
    y = torch.tensor([0, 1, 2, 1])
    data = Data(x, y, x, y, 3, torch.zeros(1, 1, 1, 1), torch.ones(1, 1, 1, 1))
    model = common.Classifier(nn.Flatten(), 2, 3, head_bias=False)
    W = np.array([[0.5, -1.0], [0.2, 0.3], [-0.7, 0.9]])
    anchor = np.array([[0.4, -0.8], [0.0, 0.5], [-0.5, 1.0]])  # w_t != the client's start: a non-zero prox gradient
    with torch.no_grad():
        model.head.weight.copy_(torch.tensor(W))
    args = argparse.Namespace(
        momentum=0.0,
        weight_decay=0.0,
        batch_size=4,
        local_epochs=1,
        local_steps=1,
        augment="none",
        device="cpu",
        amp=False,
        prox_mu=0.1,
    )
    loss = fednnnn.local_train(model, torch.arange(4), data, args, 0.5, [torch.tensor(anchor, dtype=torch.float32)])
    f = x.view(4, 2).double().numpy() / 255
    logits = f @ W.T
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    grad = (p - np.eye(3)[y.numpy()]).T @ f / 4 + 0.1 * (W - anchor)
    expected_loss = -np.log(p[np.arange(4), y.numpy()]).mean() + 0.05 * ((W - anchor) ** 2).sum()
    assert loss.item() == pytest.approx(expected_loss, rel=1e-5)
    assert np.allclose(model.head.weight.detach().double().numpy(), W - 0.5 * grad, rtol=1e-5, atol=1e-6)


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


def test_param_kinds_of_parameters_on_the_root_module():
    assert fednnnn.param_kinds(nn.Linear(2, 3)) == {"weight": "fc", "bias": "fc"}
    assert fednnnn.param_kinds(nn.Conv2d(1, 2, 3)) == {"weight": "conv", "bias": "conv"}
    seq = nn.Sequential(nn.Conv1d(1, 2, 3), nn.BatchNorm1d(2), nn.Linear(2, 1, bias=False))
    assert fednnnn.param_kinds(seq) == {
        "0.weight": "conv",
        "0.bias": "conv",
        "1.weight": "other",
        "1.bias": "other",
        "2.weight": "fc",
    }


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
    types = "".join(
        {nn.Conv2d: "C", nn.BatchNorm2d: "B", nn.ReLU: "R", nn.MaxPool2d: "P", nn.Flatten: "F", nn.Linear: "L"}[type(m)]
        for m in model.body
    )
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


BASE = [
    "--dataset",
    "synthetic",
    "--device",
    "cpu",
    "--model",
    "lenet",
    "--num-clients",
    "4",
    "--batch-size",
    "16",
    "--lr",
    "0.05",
    "--momentum",
    "0",
    "--weight-decay",
    "5e-4",
]


# fedavg.py offers common.py's models only (lenet and cnn6 are registered by fednnnn.py): the FedAvg comparison runs
# McMahan's CNN, like lenet convolutions then fully connected layers, without batch norm.
AS_FEDAVG = [*BASE[: BASE.index("--model") + 1], "cnn", *BASE[BASE.index("--model") + 2 :]] + [
    "--frac",
    "0.5",
    "--local-steps",
    "3",
    "--rounds",
    "2",
    "--eval-every",
    "2",
    "--augment",
    "crop-flip",
    "--quantity",
    "powerlaw",
    "--seed",
    "3",
    "--save-model",
]
RESUMED = BASE + ["--frac", "1", "--local-steps", "3", "--rounds", "3", "--eval-every", "3", "--save-model"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """fedavg.py and fednnnn.py as FedAvg, each in its own process, and (beside the second) a fednnnn.py run stopped
    after round 2, a round without evaluation: its checkpoint is kept as round2.pt and it is resumed in this process."""
    d = tmp_path_factory.mktemp("fednnnn_e2e")
    run_batches(
        [["fedavg.py", *AS_FEDAVG, "--out", d / "fedavg"]],
        [
            ["fednnnn.py", *AS_FEDAVG, "--beta", "1", "--gamma", "0", "--no-normalize", "--out", d / "nnnn"],
            ["fednnnn.py", *RESUMED, "--out", d / "part", "--stop-after", "2"],
        ],
    )
    shutil.copy(d / "part" / "checkpoint.pt", d / "round2.pt")
    run_here(["fednnnn.py", "--resume", d / "part"])
    return d


def test_beta1_gamma0_no_normalize_reproduces_fedavg(runs):
    a, b = metrics(runs / "fedavg"), metrics(runs / "nnnn")
    assert [r["round"] for r in a] == [2] and [r["round"] for r in b] == [1, 2]  # + a norms-only row
    assert {k: b[1][k] for k in a[0]} == a[0]  # shared keys identical (test_acc, test_loss, train_loss, lr)
    assert all(r["step_norm"] == r["N"] < r["E"] for r in b)  # FedAvg's server step is the plain average
    assert all(0 < r["N_conv"] < r["E_conv"] and 0 < r["N_fc"] < r["E_fc"] for r in b)  # both kinds of layer
    assert_same_model(runs / "fedavg", runs / "nnnn")


@pytest.mark.slow  # a second, uninterrupted run
def test_fednnnn_resume_equals_uninterrupted(runs, tmp_path):
    full, part = tmp_path / "full", runs / "part"
    run_script("fednnnn.py", *RESUMED, "--out", full)
    assert metrics(full) == metrics(part)  # interrupted and resumed equals uninterrupted, bitwise
    assert_same_model(full, part)
    c_full, c_part = (torch.load(d / "checkpoint.pt", weights_only=False) for d in (full, part))
    assert all(torch.equal(c_full["momentum"][n], c_part["momentum"][n]) for n in c_full["momentum"])


def test_fednnnn_evaluation_model_and_learning(runs):
    """The run resumed from round 2 (round 3 from the saved states; uninterrupted runs end the same: above)."""
    full = runs / "part"
    rows = metrics(full)
    c_full = torch.load(full / "checkpoint.pt", weights_only=False)
    assert [r["round"] for r in rows] == [1, 2, 3]  # norms every round, test metrics at the evaluation
    assert ["test_acc" in r for r in rows] == [False, False, True]
    assert all(r["N"] < r["E"] and r["N_conv"] <= r["E_conv"] and r["N_fc"] <= r["E_fc"] for r in rows)
    s = summary(full)
    assert s["test_acc"] > 0.3  # 10 classes: chance is 0.1 (FedAvg with these flags stays near 0.1)
    # Round 3 from the saved states: evaluation model (model.pt) = w_2 + average update with norm N_3;
    # broadcast model (checkpoint) = w_2 + d_3, d_3 = gamma d_2 + beta E_3/N_3 (average update). E_3 needs the
    # clients' models, which no file keeps: the factor E/N is checked by hand in test_two_rounds_against_eqs_4_5_12_13.
    c2, evaluated = torch.load(runs / "round2.pt", weights_only=False), torch.load(full / "model.pt")
    names = list(c2["momentum"])
    avg = flat(evaluated, names) - flat(c2["model"], names)
    assert avg.norm().item() == pytest.approx(rows[2]["N"], rel=1e-4)  # the logged N (Eq. 4), from the saved models
    d3 = flat(c_full["momentum"], names)
    assert flat(c2["momentum"], names).norm() > 0.1 * d3.norm()  # resumed with a non-zero d_t
    fresh = d3 - 0.7 * flat(c2["momentum"], names)  # beta E/N (average update): along the average, at least beta N long
    assert torch.nn.functional.cosine_similarity(fresh, avg, dim=0) > 1 - 1e-4 and fresh.norm() >= 0.6 * avg.norm()
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


# --- in this process: two rounds checked against the paper's equations from the clients' own models ------
def run_here(argv):
    """Run fednnnn.py in this process (torch is imported already); returns the script's globals."""
    handler, old_argv = signal.getsignal(signal.SIGINT), sys.argv
    try:
        sys.argv = list(map(str, argv))
        return runpy.run_path(os.path.join(ROOT, argv[0]), run_name="__main__")
    finally:
        sys.argv = old_argv
        signal.signal(signal.SIGINT, handler)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """2 rounds, 3 clients, FedProx on, recording every (w_t, client model, weight) as the script hands the clients'
    models to common.accumulate (the script imports it at run time, so the patched one is the one it calls)."""
    out = tmp_path_factory.mktemp("fednnnn") / "run"
    built, rounds = [], []
    real_build, real_accumulate = common.build_model, common.accumulate

    def build(*a, **kw):
        built.append(real_build(*a, **kw))  # built[0] is the broadcast model w_t
        return built[-1]

    def accumulate(total, state, weight):
        if not rounds or rounds[-1]["total"] is not total:  # a new round starts a new total
            rounds.append(
                {
                    "total": total,
                    "w": {n: p.detach().double().clone() for n, p in built[0].named_parameters()},
                    "clients": [],
                }
            )
        rounds[-1]["clients"].append((weight, {n: v.detach().double().clone() for n, v in state.items()}))
        real_accumulate(total, state, weight)

    mp = pytest.MonkeyPatch()
    mp.setattr(common, "build_model", build)
    mp.setattr(common, "accumulate", accumulate)
    try:
        g = run_here(
            [
                "fednnnn.py",
                *BASE,
                "--num-clients",
                "3",
                "--frac",
                "1",
                "--local-steps",
                "2",
                "--rounds",
                "2",
                "--prox-mu",
                "0.01",
                "--out",
                out,
            ]
        )
    finally:
        mp.undo()
    return g, rounds, metrics(out)


def test_fedprox_anchor_is_detached(recorded):
    """The proximal term's w_t is the global model, detached: no gradient may fill the global model's .grad."""
    g, _, _ = recorded
    assert g["args"].prox_mu == 0.01 and all(p.grad is None for p in g["model"].parameters())
    assert any(p.grad is not None for p in g["client"].parameters())  # the clients did train with gradients


def test_two_rounds_against_eqs_4_5_12_13(recorded):
    """From the recorded client models alone: Delta_k = w^k - w_t (Eq. 2), N = ||sum a_k Delta_k|| (Eq. 4),
    E = sum a_k ||Delta_k|| (Eq. 5), d_t = 0.7 d_{t-1} + 0.6 E/N sum a_k Delta_k (Eq. 12),
    w_{t+1} = w_t + d_t (Eq. 13)."""
    g, rounds, rows = recorded
    names = [n for n, _ in g["model"].named_parameters()]
    sizes = np.array([len(p) for p in g["partition"].train], dtype=float)
    d = torch.zeros(sum(g["model"].state_dict()[n].numel() for n in names), dtype=torch.float64)
    assert len(rounds) == 2 and [len(r["clients"]) for r in rounds] == [3, 3]
    w_next = None  # the broadcast model the previous round computed
    for t, r in enumerate(rounds):
        a = [weight for weight, _ in r["clients"]]
        assert np.allclose(a, sizes / sizes.sum())  # n_k / n
        w = flat(r["w"], names)
        if t > 0:
            assert torch.allclose(w, w_next, rtol=1e-5, atol=1e-6)  # the broadcast w_t is the previous w_t + d_t
        deltas = [flat(state, names) - w for _, state in r["clients"]]
        avg = sum(ak * dk for ak, dk in zip(a, deltas))
        N, E = avg.norm().item(), sum(ak * dk.norm().item() for ak, dk in zip(a, deltas))
        d = 0.7 * d + 0.6 * E / N * avg
        w_next = w + d
        assert rows[t]["N"] == pytest.approx(N, rel=1e-4) and rows[t]["E"] == pytest.approx(E, rel=1e-4)
        assert rows[t]["step_norm"] == pytest.approx(d.norm().item(), rel=1e-4)
        assert 0 < N < 0.99 * E  # the clients disagree: the normalization really scales
    assert torch.allclose(flat({n: v.double() for n, v in g["momentum"].items()}, names), d, rtol=1e-5, atol=1e-7)
    assert torch.allclose(
        flat({n: p.detach().double() for n, p in g["model"].named_parameters()}, names), w_next, rtol=1e-5, atol=1e-6
    )
    evaluation = flat({n: v.double() for n, v in g["client"].state_dict().items()}, names)  # the plain FedAvg average
    assert torch.allclose(evaluation, w + avg, rtol=1e-5, atol=1e-6)

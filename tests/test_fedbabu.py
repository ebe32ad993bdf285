"""fedbabu.py: frozen head, body-only aggregation, personalization (Alg. 2), "without head" accuracy, resume."""

import argparse
import json
import os
import runpy
import signal
import sys

import pytest
import torch

import common
import torch.nn as nn

import fedbabu
from common import MODELS, Classifier, Data, FineTuning, evaluate, personalize
from helpers import ROOT, assert_same_model, metrics, run_script, set_state, start_script, summary, wait_for_checkpoint

# 4 clients, 2 sampled per round; the 8-channel 4convNet keeps the whole file fast on a CPU.
TINY = [
    "--dataset",
    "synthetic",
    "--device",
    "cpu",
    "--model",
    "convnet4-tiny",
    "--num-clients",
    "4",
    "--frac",
    "0.5",
    "--shards",
    "2",
    "--local-steps",
    "4",
    "--batch-size",
    "32",
    "--augment",
    "none",
    "--ft-epochs",
    "2",
    "--ft-eval-epochs",
    "0",
    "1",
    "--ft-lr",
    "0.001",
]  # accuracy 0.76 -> 0.97 -> 1.0
E2E = [*TINY, "--rounds", "4", "--eval-every", "2", "--lr-decay-at", "0.5", "--save-model"]


def tiny_data(n=64, seed=0, size=8):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=g)
    y = torch.arange(n) % 4
    return Data(x, y, x.clone(), y.clone(), 4, torch.full((1, 3, 1, 1), 0.5), torch.full((1, 3, 1, 1), 0.25))


def bn_model(seed=0):
    """A body with batch-norm running statistics, so 'frozen' must also cover buffers."""
    torch.manual_seed(seed)
    body = nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    return Classifier(body, 6, 4)


def states_equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def sub(model, part):
    return {k: v.clone() for k, v in getattr(model, part).state_dict().items()}


@pytest.mark.parametrize("train_head", [False, True])
def test_local_train_freezes_head_only_without_train_head(train_head):
    data = tiny_data()
    model = bn_model()
    head0, body0 = sub(model, "head"), sub(model, "body")
    # momentum, weight decay and a proximal term: none of them may move a frozen head
    args = argparse.Namespace(
        train_head=train_head,
        lr=0.1,
        momentum=0.9,
        weight_decay=0.1,
        prox_mu=0.5,
        device="cpu",
        amp=False,
        batch_size=16,
        local_epochs=None,
        local_steps=4,
        augment="flip",
    )
    anchor = [p.detach() + 0.1 for p in model.parameters()]
    fedbabu.local_train(model, torch.arange(64), data, args, 0.1, anchor)
    assert states_equal(sub(model, "head"), head0) is (not train_head)
    assert not states_equal(sub(model, "body"), body0)


def hand_model(scale):
    """Body Linear(2 -> 2) + BatchNorm1d(2) (running statistics and an int64 counter), head Linear(2 -> 3);
    every float entry is `scale` times 1, 2, ... in state order, the counter 4."""
    return set_state(Classifier(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)), 2, 3), scale, batches=4)


@pytest.mark.parametrize("train_head", [False, True])
def test_aggregate_averages_the_body_and_keeps_the_head_bitwise(train_head):
    """Alg. 1 line 9 on tiny tensors: two clients, n = 100 and 300, entries 2 * (1, 2, ...) and 6 * (1, 2, ...):
    0.25 * 2 + 0.75 * 6 = 5 times (1, 2, ...). The clients' heads differ from the global one (as they would if
    they had trained it), so a head that were averaged would show."""
    glob = hand_model(1)
    head0 = {k: v.clone() for k, v in glob.head.state_dict().items()}
    total = {k: torch.zeros_like(v, dtype=torch.float) for k, v in glob.state_dict().items()}
    for scale, w in zip((2, 6), common.client_weights([100, 300], "samples")):  # the script's loop: the FedAvg sum
        common.accumulate(total, hand_model(scale).state_dict(), w)
    fedbabu.aggregate(glob, total, train_head)
    body = glob.body.state_dict()
    assert torch.equal(body["0.weight"], torch.tensor([[5.0, 10.0], [15.0, 20.0]]))  # body.0.weight = 1..4
    assert torch.equal(body["0.bias"], torch.tensor([25.0, 30.0]))
    assert torch.equal(body["1.weight"], torch.tensor([35.0, 40.0])) and torch.equal(
        body["1.bias"], torch.tensor([45.0, 50.0])
    )
    assert torch.equal(body["1.running_mean"], torch.tensor([55.0, 60.0]))  # buffers averaged like weights
    assert torch.equal(body["1.running_var"], torch.tensor([65.0, 70.0]))
    assert body["1.num_batches_tracked"].dtype == torch.int64 and body["1.num_batches_tracked"] == 4
    head = glob.head.state_dict()  # head.weight = 15..20, head.bias = 21..23
    if train_head:  # FedAvg: the head is averaged like everything else
        assert torch.equal(head["weight"], 5 * torch.arange(15.0, 21.0).view(3, 2))
        assert torch.equal(head["bias"], 5 * torch.arange(21.0, 24.0))
    else:  # FedBABU: not aggregated, the initial head bitwise
        assert states_equal(head, head0)


def test_head_survives_an_average_of_identical_heads_bitwise():
    """Frozen heads are all equal, but their float average need not be: 0.1 h + 0.2 h + 0.7 h != h for most h."""
    torch.manual_seed(0)
    glob = bn_model()
    head0 = {k: v.clone() for k, v in glob.head.state_dict().items()}
    total = {k: torch.zeros_like(v, dtype=torch.float) for k, v in glob.state_dict().items()}
    for w in (0.1, 0.2, 0.7):
        common.accumulate(total, glob.state_dict(), w)
    assert not torch.equal(total["head.weight"], head0["weight"])  # the sum really moved some bits
    fedbabu.aggregate(glob, total)
    assert states_equal(glob.head.state_dict(), head0)


@pytest.mark.parametrize("part,moved", [("head", {"head"}), ("body", {"body"}), ("full", {"head", "body"})])
def test_personalize_updates_only_the_chosen_part(part, moved):
    data = tiny_data()
    model = bn_model()
    glob = {k: v.clone() for k, v in model.state_dict().items()}
    train, test = [torch.arange(0, 32)], [torch.arange(32, 64)]
    ft = FineTuning(epochs=2, eval_epochs=[0, 1], lr=0.05, part=part, batch_size=8, augment="none")
    res = personalize(model, glob, data, train, test, ft)
    for name in ("head", "body"):  # the model is left holding the (only) client's fine-tuned weights
        same = states_equal(
            {k: v for k, v in model.state_dict().items() if k.startswith(name + ".")},
            {k: v for k, v in glob.items() if k.startswith(name + ".")},
        )
        assert same is (name not in moved), (part, name)
    assert all(p.requires_grad for p in model.parameters())  # restored afterwards
    assert sorted(res["acc_mean"]) == [0, 1, 2] and res["clients"] == [0]
    model.load_state_dict(glob)
    model.eval()
    # epoch 0 = initial
    assert res["acc_mean"][0] == evaluate(model, data.x_test[test[0]], data.y_test[test[0]], data)[0]


def test_personalize_statistics_over_clients():
    data = tiny_data()
    model = bn_model()
    glob = {k: v.clone() for k, v in model.state_dict().items()}
    train = [torch.arange(0, 16), torch.arange(16, 32), torch.arange(32, 48)]
    test = [torch.arange(0, 8), torch.arange(0), torch.arange(40, 64)]  # client 1 has no test data: skipped
    ft = FineTuning(epochs=1, eval_epochs=[0], lr=0.05, part="full", batch_size=8, augment="none")
    res = personalize(model, glob, data, train, test, ft)
    assert res["clients"] == [0, 2] and len(res["per_client"][1]) == 2
    accs = torch.tensor(res["per_client"][1], dtype=torch.float64)
    assert res["acc_mean"][1] == pytest.approx(accs.mean().item())
    assert res["acc_std"][1] == pytest.approx(accs.std(unbiased=False).item())


def test_nohead_accuracy_by_hand():
    # 1x1x2 images, features = the normalized pixels (body = Flatten); mean 0, std 1/255 -> features = raw pixel values
    x_tr = torch.tensor([[250, 10], [240, 20], [4, 100], [100, 100]], dtype=torch.uint8).view(4, 1, 1, 2)
    y_tr = torch.tensor([0, 0, 2, 0])  # client 0: classes {0, 2}; client 1: class 0 only
    x_te = torch.tensor([[200, 30], [200, 240], [30, 190], [150, 140]], dtype=torch.uint8).view(4, 1, 1, 2)
    y_te = torch.tensor([0, 2, 1, 0])  # the class-1 image cannot be right: no client has a class-1 template
    data = Data(x_tr, y_tr, x_te, y_te, 3, torch.zeros(1, 1, 1, 1), torch.full((1, 1, 1, 1), 1 / 255))
    model = Classifier(nn.Flatten(), 2, 3)
    accs = fedbabu.nohead_accuracy(
        model, data, [torch.tensor([0, 1, 2]), torch.tensor([3])], [torch.tensor([0, 1, 2]), torch.tensor([3])]
    )
    # client 0: templates (245, 15) for 0 and (4, 100) for 2. Cosine similarity predicts 0, 2, 2 -> 2/3;
    # (200, 240) is nearer (245, 15) in Euclidean distance and by dot product, which would give 1/3.
    # Client 1: one template -> 1/1.
    assert accs == pytest.approx([2 / 3, 1.0])


def test_defaults_follow_the_paper(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["fedbabu.py", "--device", "cpu", "--local-epochs", "4"])
    args = fedbabu.parse_args()
    assert args.rounds == 80 and args.shards == 10 and args.client_test  # rounds x tau = 320
    assert (args.dataset, args.model, args.num_clients, args.frac, args.batch_size) == (
        "cifar100",
        "mobilenet",
        100,
        0.1,
        50,
    )
    assert (args.lr, args.momentum, args.weight_decay, args.lr_decay_at) == (0.1, 0.9, 0.0, [0.5, 0.75])
    assert (args.lr_decay, args.augment, args.weighting, args.prox_mu) == (0.1, "crop-flip", "samples", 0.0)
    assert (args.ft_epochs, args.ft_lr, args.ft_part, args.train_head) == (5, 1e-3, "full", False)
    assert args.ft_eval_epochs == [0, 1, 2, 5, 10]
    monkeypatch.setattr(sys, "argv", ["fedbabu.py", "--device", "cpu"])
    args = fedbabu.parse_args()
    assert args.rounds == 32 and args.local_epochs == 10 and args.client_test  # tau = 10: K = 320 / 10
    monkeypatch.setattr(sys, "argv", ["fedbabu.py", "--device", "cpu", "--local-steps", "5"])
    args = fedbabu.parse_args()  # local steps, not epochs: K stays the paper's 320 / 10
    assert args.rounds == 32 and args.local_epochs is None and args.local_steps == 5
    monkeypatch.setattr(sys, "argv", ["fedbabu.py", "--device", "cpu", "--local-epochs", "4", "--rounds", "7"])
    assert fedbabu.parse_args().rounds == 7  # a written --rounds wins


def test_no_client_test_turns_personalization_off(monkeypatch, tmp_path):
    """--no-client-test (docs/fedbabu.md's flag table; benchmarks/overhead.py's fedbabu flags): no per-client test
    sets, so no Algorithm 2 after the last round (the global model's test accuracy only)."""
    monkeypatch.setattr(sys, "argv", ["fedbabu.py", "--device", "cpu", "--no-client-test"])
    assert not fedbabu.parse_args().client_test
    run_script("fedbabu.py", *E2E, "--rounds", "1", "--no-client-test", "--out", tmp_path / "run")
    s = summary(tmp_path / "run")
    assert "test_acc" in s and not any(k.startswith(("init_", "pers_", "nohead_")) for k in s)
    assert "client_test_acc_mean" not in metrics(tmp_path / "run")[-1]


@pytest.mark.parametrize(
    "flags,name",
    [
        (["--local-epochs", "0"], "--local-epochs"),
        (["--ft-epochs", "-1"], "--ft-epochs"),
        (["--ft-eval-epochs", "0", "-2"], "--ft-eval-epochs"),
        (["--ft-lr", "-0.1"], "--ft-lr"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(flags, name, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["fedbabu.py", "--device", "cpu", *flags])
    with pytest.raises(SystemExit) as exit_info:
        fedbabu.parse_args()
    assert exit_info.value.code == 2 and name in capsys.readouterr().err


@pytest.mark.parametrize(
    "name,channels,size,classes,feature_dim,params",
    [
        # 4convNet, App. A.1: conv 3->64 (1,792) + 3 x conv 64->64 (36,928) + 4 x BN (128) + linear 256->10 (2,570)
        ("convnet4", 3, 32, 10, 256, 115_658),
        # 3convNet: conv 1->64 (640) + 2 x conv 64->64 + 3 x BN + linear 576->62 (35,774)
        ("convnet3", 1, 28, 62, 576, 110_654),
        # MobileNet of kuangliu/pytorch-cifar: 3,217,226 parameters with 10 classes
        ("mobilenet", 3, 32, 10, 1024, 3_217_226),
    ],
)
def test_paper_architectures(name, channels, size, classes, feature_dim, params):
    model = MODELS[name](channels, classes, size)
    assert model.head.in_features == feature_dim and model.head.out_features == classes
    assert sum(p.numel() for p in model.parameters()) == params
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    # nothing but weights to average
    assert bns and not any(m.track_running_stats for m in bns) and not list(model.buffers())
    assert model.body(torch.randn(2, channels, size, size)).shape == (2, feature_dim)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """One uninterrupted end-to-end run shared by the tests below (subprocesses are the slow part)."""
    out = tmp_path_factory.mktemp("fedbabu") / "full"
    run_script("fedbabu.py", *E2E, "--out", out)
    return out


def test_personalized_beats_initial_end_to_end(full_run):
    s = summary(full_run)
    keys = {
        "init_acc_mean",
        "init_acc_std",
        "pers_acc_mean",
        "pers_acc_std",
        "nohead_acc_mean",
        "pers_acc_mean_by_epoch",
        "pers_acc_std_by_epoch",
    }
    assert keys <= set(s)
    assert s["pers_acc_mean"] > s["init_acc_mean"] + 0.1, s
    # initial accuracy (Alg. 2 line 5) = the last round's evaluation of the same global model on the same sets
    assert s["init_acc_mean"] == metrics(full_run)[-1]["client_test_acc_mean"]
    by_epoch = s["pers_acc_mean_by_epoch"]  # tau_f = 2 with epochs 0 and 1 also reported (Table 6)
    assert sorted(by_epoch) == ["0", "1", "2"] and by_epoch["0"] == s["init_acc_mean"]
    assert by_epoch["2"] == s["pers_acc_mean"] != by_epoch["1"], by_epoch  # personalized = after tau_f epochs
    assert s["nohead_acc_mean"] > 0.5  # chance is 1/4 to 1/2 with 2-4 classes per client
    part = json.load(open(full_run / "partition.json"))  # --client-test is on by default
    for train, test in zip(part["train"], part["test"]):  # test classes are the client's training classes
        assert sum(test) > 0 and all(t == 0 or c > 0 for c, t in zip(train, test))
    assert sum(map(sum, part["test"])) == 1000


def test_global_head_stays_initial_unless_train_head(full_run, tmp_path):
    # Same seed -> same init: the global model is the first thing the script draws from torch's RNG.
    torch.manual_seed(0)
    init = MODELS["convnet4-tiny"](3, 10, 32).state_dict()
    final = torch.load(full_run / "model.pt")
    assert torch.equal(final["head.weight"], init["head.weight"]) and torch.equal(final["head.bias"], init["head.bias"])
    assert not torch.equal(final["body.0.0.weight"], init["body.0.0.weight"])  # while the body trained
    run_script("fedbabu.py", *E2E, "--rounds", "1", "--train-head", "--out", tmp_path / "avg")
    avg = torch.load(tmp_path / "avg" / "model.pt")
    assert not torch.equal(avg["head.weight"], init["head.weight"])  # --train-head: FedAvg moves the head
    assert not torch.equal(avg["body.0.0.weight"], init["body.0.0.weight"])
    assert "pers_acc_mean" in summary(tmp_path / "avg")  # the paper's FedAvg baseline is fine-tuned too


@pytest.mark.slow  # a second run, stopped and resumed
def test_stop_and_resume_equals_uninterrupted(full_run, tmp_path):
    proc = run_script("fedbabu.py", *E2E, "--out", tmp_path / "cut", "--stop-after", "2")
    assert "--resume" in proc.stdout and len(metrics(tmp_path / "cut")) == 1  # evaluated at round 2 only
    run_script("fedbabu.py", "--resume", tmp_path / "cut")
    assert metrics(tmp_path / "cut") == metrics(full_run)
    assert_same_model(tmp_path / "cut", full_run)

    def drop(s):
        return {k: v for k, v in s.items() if k not in ("wall_time_s", "elapsed_s")}

    assert drop(summary(tmp_path / "cut")) == drop(summary(full_run))  # the personalization results too


@pytest.mark.slow  # two runs, one stopped in its last round and resumed
def test_a_stop_in_the_last_round_comes_before_the_fine_tuning(tmp_path):
    """SIGTERM in the last round: the line to --resume, then the round ends with its checkpoint and the run stops
    (exit 143, no summary.json) before the personalization; --resume then fine-tunes and ends as the whole run."""
    flags, out = [*TINY, "--local-steps", "150", "--rounds", "2", "--save-model"], tmp_path / "cut"  # seconds a round
    whole = start_script("fedbabu.py", *flags, "--out", tmp_path / "whole")
    proc = start_script("fedbabu.py", *flags, "--out", out)
    wait_for_checkpoint(out)
    proc.send_signal(signal.SIGTERM)
    stdout, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and stdout.count(f"continue with: python fedbabu.py --resume {out}") == 1, err
    assert torch.load(out / "checkpoint.pt", weights_only=False)["round"] == 2 and not (out / "summary.json").exists()
    run_script("fedbabu.py", "--resume", out)
    whole.communicate(timeout=120)
    assert metrics(out) == metrics(tmp_path / "whole")
    assert_same_model(out, tmp_path / "whole")

    def drop(s):
        return {k: v for k, v in s.items() if k not in ("wall_time_s", "elapsed_s")}

    assert drop(summary(out)) == drop(summary(tmp_path / "whole"))  # the personalization results too


def test_fedprox_anchor_is_detached(tmp_path):
    """One FedProx(+BABU) round in this process: the proximal term's w_t is the global model detached, so no
    gradient reaches the global model (before: its .grad filled up every local step)."""
    handler, old_argv = signal.getsignal(signal.SIGINT), sys.argv
    try:
        sys.argv = [
            "fedbabu.py",
            *TINY,
            "--rounds",
            "1",
            "--local-steps",
            "2",
            "--prox-mu",
            "0.01",
            "--ft-epochs",  # no fine-tuning after the round: the client's gradients are local training's
            "0",
            "--ft-eval-epochs",
            "--out",
            str(tmp_path / "run"),
        ]
        g = runpy.run_path(os.path.join(ROOT, "fedbabu.py"), run_name="__main__")
    finally:
        sys.argv = old_argv
        signal.signal(signal.SIGINT, handler)
    assert g["args"].prox_mu == 0.01 and all(p.grad is None for p in g["model"].parameters())
    assert any(p.grad is not None for p in g["client"].body.parameters())  # the client did train

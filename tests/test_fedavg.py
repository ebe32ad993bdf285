"""fedavg.py: aggregation math, FedProx, bad input, reproducibility, resume, learning."""

import argparse
import json
import os
import signal
import sys

import pytest
import torch

import common

import fedavg
from helpers import (
    TINY,
    assert_same_model,
    metrics,
    prepare,
    run_batches,
    run_script,
    set_state,
    start_script,
    summary,
    wait_for_checkpoint,
)


def test_client_weights():
    assert common.client_weights([100, 300], "samples") == [0.25, 0.75]
    assert common.client_weights([1, 2, 5], "samples") == [0.125, 0.25, 0.625]  # n_k / n, in client order
    assert common.client_weights([100, 300, 50, 50], "uniform") == [0.25] * 4  # 1/m whatever the sizes
    assert common.client_weights([7, 7, 7], "samples") == [1 / 3] * 3  # computed in float64: exactly Python's 1/3
    assert common.client_weights([1, 2], "samples") == [1 / 3, 2 / 3]


def test_accumulate_is_the_weighted_sum():
    total = {"w": torch.zeros(2, 2), "bn.running_mean": torch.zeros(3), "bn.num_batches_tracked": torch.zeros(())}
    states = [
        {
            "w": torch.tensor([[1.0, 2.0], [3.0, 4.0]]),
            "bn.running_mean": torch.tensor([1.0, 0.0, 2.0]),
            "bn.num_batches_tracked": torch.tensor(4),
        },
        {
            "w": torch.tensor([[5.0, 6.0], [7.0, 8.0]]),
            "bn.running_mean": torch.tensor([3.0, 4.0, 2.0]),
            "bn.num_batches_tracked": torch.tensor(8),
        },
    ]
    for state, w in zip(states, [0.25, 0.75]):
        common.accumulate(total, state, w)
    assert torch.equal(total["w"], torch.tensor([[4.0, 5.0], [6.0, 7.0]]))  # 0.25 * a + 0.75 * b
    assert torch.equal(total["bn.running_mean"], torch.tensor([2.5, 3.0, 2.0]))  # statistics averaged too
    assert total["bn.num_batches_tracked"] == 7 and total["w"].dtype == torch.float32


def bn_net():
    """Linear(1 -> 2, no bias) + BatchNorm1d(2): a weight, an affine pair, running statistics, an int64 counter."""
    return torch.nn.Sequential(torch.nn.Linear(1, 2, bias=False), torch.nn.BatchNorm1d(2))


def script_aggregates():
    """FedAvg's aggregation (common.load_average, which every script calls; fedbabu's aggregate with
    --train-head), checked against the same hand values."""
    import fedbabu

    return {"common": common.load_average, "fedbabu-train-head": lambda m, t: fedbabu.aggregate(m, t, train_head=True)}


@pytest.mark.parametrize("script", ["common", "fedbabu-train-head"])
def test_aggregate_loads_the_weighted_average_with_buffers(script):
    # Three clients, n = 10, 30, 60: weights 0.1, 0.3, 0.6; client k's float entries are k * (1, 2, ...):
    # weight [[1], [2]], bn weight [3, 4], bias [5, 6], running mean [7, 8], running var [9, 10]. The
    # average is (0.1 * 1 + 0.3 * 2 + 0.6 * 3) = 2.5 times those; the counters (5 each) stay 5.
    clients = [set_state(bn_net(), k, batches=5) for k in (1, 2, 3)]
    glob = set_state(bn_net(), 0, batches=0)
    total = {k: torch.zeros_like(v, dtype=torch.float) for k, v in glob.state_dict().items()}
    for c, w in zip(clients, common.client_weights([10, 30, 60], "samples")):
        common.accumulate(total, c.state_dict(), w)
    script_aggregates()[script](glob, total)
    got = glob.state_dict()
    assert torch.allclose(got["0.weight"], torch.tensor([[2.5], [5.0]]))
    assert torch.allclose(got["1.weight"], torch.tensor([7.5, 10.0])) and torch.allclose(
        got["1.bias"], torch.tensor([12.5, 15.0])
    )
    assert torch.allclose(got["1.running_mean"], torch.tensor([17.5, 20.0]))  # buffers: the same weighted average
    assert torch.allclose(got["1.running_var"], torch.tensor([22.5, 25.0]))
    assert got["1.num_batches_tracked"].dtype == torch.int64 and got["1.num_batches_tracked"] == 5


@pytest.mark.parametrize("script", ["common", "fedbabu-train-head"])
def test_aggregate_rounds_integer_buffers(script):
    """Nine clients with 3 batches each: 9 x (1/9 x 3) is 2.9999998 in float32, which a cast truncates to 2."""
    glob = set_state(bn_net(), 0, batches=0)
    total = {k: torch.zeros_like(v, dtype=torch.float) for k, v in glob.state_dict().items()}
    for w in common.client_weights([7] * 9, "samples"):
        common.accumulate(total, set_state(bn_net(), 1, batches=3).state_dict(), w)
    assert total["1.num_batches_tracked"] < 3  # the float sum really is below 3
    script_aggregates()[script](glob, total)
    assert glob.state_dict()["1.num_batches_tracked"] == 3
    assert torch.allclose(glob.state_dict()["1.running_var"], torch.tensor([9.0, 10.0]))


def test_load_average_is_strict_unless_told():
    """anfr.py loads a sum without the clients' local entries (FedPer / FedBN) with strict=False; every
    other caller must load a complete state."""
    glob = set_state(bn_net(), 0, batches=0)
    partial = {k: v.float() + 1 for k, v in glob.state_dict().items() if k != "1.running_mean"}
    with pytest.raises(RuntimeError, match="running_mean"):
        common.load_average(glob, partial)
    common.load_average(glob, partial, strict=False)
    assert torch.equal(glob.state_dict()["1.running_mean"], torch.tensor([5.0, 6.0]) * 0)  # untouched
    assert torch.equal(glob.state_dict()["1.running_var"], torch.tensor([1.0, 1.0]))  # 0 + 1, loaded


def test_prox_term_by_hand():  # common.prox_term, which every script's FedProx calls
    w = [torch.tensor([1.0, 2.0], requires_grad=True), torch.tensor([[3.0]], requires_grad=True)]
    w_t = [torch.tensor([0.0, 4.0]), torch.tensor([[1.0]])]
    value = common.prox_term(w, w_t, mu=0.5)  # 0.5 / 2 * (1 + 4 + 4) = 2.25
    assert value.item() == pytest.approx(2.25)
    value.backward()  # gradient mu (w - w_t)
    assert torch.allclose(w[0].grad, torch.tensor([0.5, -1.0])) and torch.allclose(w[1].grad, torch.tensor([[1.0]]))


def _one_step(prox_mu, lr=0.1):
    """One local SGD step (no momentum, no decay) from a fixed init, with w_t a perturbed copy."""
    from common import Data, build_model

    data = Data(
        torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)),
        torch.arange(8) % 10,
        None,
        None,
        10,
        torch.full((1, 3, 1, 1), 0.5),
        torch.full((1, 3, 1, 1), 0.25),
    )
    torch.manual_seed(0)
    model = build_model("cnn", data)
    init = [p.detach().clone() for p in model.parameters()]
    anchor = [p + 0.01 * torch.randn_like(p) for p in init]  # the global model w_t, away from w
    args = argparse.Namespace(
        lr=lr,
        momentum=0.0,
        weight_decay=0.0,
        prox_mu=prox_mu,
        device="cpu",
        amp=False,
        batch_size=8,
        local_epochs=None,
        local_steps=1,
        augment="none",
    )
    torch.manual_seed(1)
    fedavg.local_train(model, torch.arange(8), data, args, lr, anchor)
    return init, [p.detach() for p in model.parameters()], anchor


def test_fedprox_step_adds_mu_times_distance_to_global():
    init, plain, anchor = _one_step(prox_mu=0.0)
    _, prox, _ = _one_step(prox_mu=0.5)
    # One SGD step: w' = w - lr * (grad + mu * (w - w_t)), so prox - plain = -lr * mu * (w - w_t).
    for p, q, w, w_t in zip(plain, prox, init, anchor):
        assert torch.allclose(q - p, -0.1 * 0.5 * (w - w_t), atol=1e-6)


# End-to-end runs shared by the tests below: two processes, three runs each (one torch import per process).
BASE = [*TINY, "--num-clients", "5", "--shards", "2", "--client-test", "--lr-decay-at", "0.5", "--save-model"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fedavg")
    run_batches(
        [
            ["fedavg.py", *BASE, "--out", tmp / "a"],
            ["fedavg.py", *BASE, "--prox-mu", "0.1", "--out", tmp / "mu01"],
            ["fedavg.py", *BASE, "--out", tmp / "cut", "--stop-after", "2"],
        ],
        [
            ["fedavg.py", *BASE, "--seed", "1", "--data-seed", "0", "--out", tmp / "seed1"],
            ["fedavg.py", *BASE, "--data-seed", "1", "--out", tmp / "dseed1"],
            [
                "fedavg.py",
                "--dataset",
                "synthetic",
                "--device",
                "cpu",
                "--model",
                "cnn",
                "--num-clients",
                "10",
                "--frac",
                "0.5",
                "--iid",
                "--rounds",
                "4",
                "--local-steps",
                "4",
                "--batch-size",
                "32",
                "--lr",
                "0.05",
                "--eval-every",
                "4",
                "--out",
                tmp / "learn",
            ],
        ],
        [["fedavg.py", *BASE, "--out", tmp / "again"]],  # its own process: sharing one changes nothing
    )
    return tmp


def test_fedprox_mu_changes_training(runs):  # (--prox-mu 0 is the default run itself: nothing to compare)
    assert metrics(runs / "a") != metrics(runs / "mu01"), "mu > 0 must change training"


def test_seed_reproduces_run_and_outputs(runs):
    a = metrics(runs / "a")
    assert a == metrics(runs / "again")
    assert_same_model(runs / "a", runs / "again")
    assert a != metrics(runs / "seed1")
    assert [row["round"] for row in a] == [1, 2, 3, 4]
    assert [row["lr"] for row in a] == [0.01, 0.01, 0.001, 0.001]  # --lr-decay-at 0.5
    assert {"test_acc", "test_loss", "train_loss", "client_test_acc_mean"} <= set(a[0])
    config = json.load(open(runs / "a" / "config.json"))
    assert config["shards"] == 2 and config["data_seed"] == 0 and config["model"] == "mlp"
    part = json.load(open(runs / "a" / "partition.json"))
    assert len(part["train"]) == 5 and sum(map(sum, part["train"])) == 3000
    assert all(sum(c > 0 for c in counts) <= 2 for counts in part["train"])  # 10 shards of 300 = 1 class each
    assert sum(map(sum, part["test"])) == 1000
    s = summary(runs / "a")
    assert s["test_acc"] == a[-1]["test_acc"] and s["final_round"] == 4 and "device" in s


def test_data_seed_fixes_partition_while_seed_varies(runs):
    def part(d):
        return json.load(open(runs / d / "partition.json"))["train"]

    assert part("a") == part("seed1") != part("dseed1")


def test_learns_well_above_chance(runs):
    assert summary(runs / "learn")["test_acc"] > 0.5  # chance is 0.1


@pytest.mark.slow  # two resumes, a process each
def test_stop_and_resume_equals_uninterrupted(runs):
    assert not os.path.exists(runs / "cut" / "summary.json")
    assert len(metrics(runs / "cut")) == 2
    proc = run_script("fedavg.py", "--resume", runs / "cut", "--stop-after", "1")  # round 3 of 4
    assert "--resume" in proc.stdout and len(metrics(runs / "cut")) == 3
    run_script("fedavg.py", "--resume", runs / "cut")
    assert metrics(runs / "cut") == metrics(runs / "a")
    assert_same_model(runs / "cut", runs / "a")
    assert summary(runs / "cut")["test_acc"] == summary(runs / "a")["test_acc"]


@pytest.mark.slow  # a run interrupted and resumed
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGKILL, -9)])
def test_ctrl_c_or_sigterm_writes_checkpoint_and_resume_is_the_whole_run(sig, code, tmp_path):
    """Ctrl-C, or SIGTERM (a scheduler's preemption): one line with the --resume command at once, then the round
    ends, a checkpoint, exit 128 + the signal. SIGKILL: SIGTERM, then a kill once that line is out (a container's
    stop after its grace): the line stays, and so does the last checkpoint. --resume then ends as the uninterrupted
    run, bit for bit."""
    out, flags = tmp_path / "run", [*TINY, "--iid", "--rounds", "60", "--local-steps", "1", "--save-model"]
    whole = start_script("fedavg.py", *flags, "--out", tmp_path / "whole")
    proc = start_script("fedavg.py", *flags, "--out", out)
    wait_for_checkpoint(out)
    proc.send_signal(signal.SIGTERM if sig == signal.SIGKILL else sig)
    # The start line, a plain line for each evaluation (stdout is not a terminal), an empty one, the signal's line.
    said = [proc.stdout.readline()]
    while said[-1] and "continue with" not in said[-1]:
        said.append(proc.stdout.readline())
    if sig == signal.SIGKILL:
        proc.kill()
    stdout, err = proc.communicate(timeout=120)
    assert proc.returncode == code and "Traceback" not in err, err[-2000:]
    assert said[-1].endswith(f"; continue with: python fedavg.py --resume {out}\n") and said[0].startswith("fedavg: ")
    others = [line for line in said[1:-1] + stdout.splitlines() if not line.startswith("round ")]
    assert not "".join(others).strip(), said
    ckpt = torch.load(out / "checkpoint.pt", weights_only=False)
    ahead = len(metrics(out)) - ckpt["round"]  # a kill between a round's row and its checkpoint leaves the row
    assert 1 <= ckpt["round"] < 60 and ahead in ((0, 1) if sig == signal.SIGKILL else (0,))
    run_script("fedavg.py", "--resume", out)  # (which keeps the rows up to its checkpoint's round)
    whole.communicate(timeout=120)
    assert whole.returncode == 0
    assert metrics(out) == metrics(tmp_path / "whole")
    assert_same_model(out, tmp_path / "whole")


def test_divergence_stops_with_summary(tmp_path):
    proc = run_script(
        "fedavg.py", *TINY, "--iid", "--lr", "1e12", "--momentum", "0", "--out", tmp_path / "a", check=False
    )
    assert proc.returncode != 0 and "diverged" in proc.stderr
    s = summary(tmp_path / "a")
    assert s["diverged"] is True and s["round"] == 1


# Refused by parse_args: a flag's own value, or flags that exclude each other (argparse names both).
BAD = [
    (["--dataset", "imagenet7"], ["--dataset"]),
    (["--model", "transformer9"], ["--model"]),
    (["--shards", "2", "--iid"], ["--iid", "--shards"]),
    (["--alpha", "0.5", "--classes-per-client", "2"], ["--classes-per-client", "--alpha"]),
    (["--local-epochs", "2", "--local-steps", "3"], ["--local-steps", "--local-epochs"]),
    (["--clients-per-domain", "2"], ["--clients-per-domain"]),  # needs a partition within each domain
    (["--alpha", "0"], ["--alpha"]),
    (["--alpha", "-1"], ["--alpha"]),
    (["--frac", "0"], ["--frac"]),
    (["--frac", "1.5"], ["--frac"]),
    (["--rounds", "0"], ["--rounds"]),
    (["--augment", "mixup"], ["--augment"]),
    (["--resume", "/nonexistent"], ["--resume"]),
]


@pytest.mark.parametrize("flags,names", BAD, ids=[" ".join(f) for f, _ in BAD])
def test_bad_input_exits_2_naming_the_flag(flags, names, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["fedavg.py", *flags])
    with pytest.raises(SystemExit) as exit_info:
        fedavg.parse_args()
    assert exit_info.value.code == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert all(name in message for name in names), message


@pytest.mark.parametrize(
    "flags,partition,local_epochs",
    [
        ([], {"shards": 2}, 5),  # none written: the paper's --shards 2, E = 5
        (["--iid", "--local-steps", "3"], {"iid": True}, None),  # a written one replaces it; steps, not epochs
        (["--alpha", "0.3", "--local-epochs", "1"], {"alpha": 0.3}, 1),
    ],
)
def test_the_papers_partition_and_epochs_apply_only_when_none_is_given(
    flags, partition, local_epochs, tmp_path, monkeypatch
):
    monkeypatch.setattr(sys, "argv", ["fedavg.py", "--device", "cpu", "--out", str(tmp_path / "run"), *flags])
    args = fedavg.parse_args()
    names = ("iid", "shards", "classes_per_client", "alpha", "split2", "disjoint_classes", "natural")
    assert {k: getattr(args, k) for k in names if getattr(args, k)} == partition
    assert args.local_epochs == local_epochs and not os.path.exists(tmp_path / "run")


# Refused once the data is read (load_data, make_partition), before the run folder: the synthetic set has
# 3,000 training samples of 10 classes.
BAD_FOR_THE_DATA = [
    (["--shards", "11"], "--shards"),  # more shards per client than the 10 classes present
    (["--num-clients", "1501", "--shards", "2"], "--shards"),  # N*S = 3,002 shards > 3,000 samples
    (["--classes-per-client", "11"], "--classes-per-client"),
    (["--dataset", "folder", "--data-dir", "/nonexistent"], "--data-dir"),
    (["--split2", "--num-clients", "10"], "--split2"),  # split-2 has exactly 5 clients
    (["--iid", "--num-clients", "3001"], "--num-clients"),  # a client would get no sample
    (["--split2", "--num-clients", "5", "--quantity", "powerlaw"], "--quantity"),  # split-2's sizes are fixed
]


@pytest.mark.parametrize("flags,name", BAD_FOR_THE_DATA, ids=[" ".join(f) for f, _ in BAD_FOR_THE_DATA])
def test_bad_input_for_the_data_exits_2_naming_the_flag(flags, name, tmp_path, monkeypatch, capsys):
    base = ["--dataset", "synthetic", "--device", "cpu", "--out", tmp_path / "run"]
    code, message = prepare("fedavg", [*base, *flags], monkeypatch, capsys)
    assert code == 2 and name in message, message
    assert message.startswith("fedavg.py: error: ")  # one line, as argparse's own refusals
    assert not os.path.exists(tmp_path / "run")


@pytest.mark.parametrize(
    "flags,clients",
    [
        (["--shards", "10"], 100),
        (["--num-clients", "1500", "--shards", "2"], 1500),
        (["--classes-per-client", "10"], 100),
        (["--split2", "--num-clients", "5"], 5),
        (["--iid", "--num-clients", "3000"], 3000),
    ],
)
def test_data_checks_accept_their_limits(flags, clients, monkeypatch):
    """The refusals above stop at the data's limits: S = C = the 10 classes present, N*S = N = the 3,000 samples,
    split-2's 5 clients."""
    args, data, partition = prepare("fedavg", ["--dataset", "synthetic", "--device", "cpu", *flags], monkeypatch)
    assert len(partition.train) == clients == args.num_clients
    assert sorted(torch.cat(partition.train).tolist()) == list(range(3000))  # every sample, once


@pytest.mark.parametrize(
    "flags,name",
    [
        (["--dataset", "cifar10", "--alpha", "-2"], "--alpha"),  # a flag's value: parse_args
        (["--dataset", "synthetic", "--shards", "11"], "--shards"),  # what the data tells: make_partition
    ],
)
def test_bad_input_fails_before_any_work(flags, name, tmp_path):
    proc = run_script("fedavg.py", *flags, "--data-dir", tmp_path / "dl", "--out", tmp_path / "run", check=False)
    assert proc.returncode == 2 and name in proc.stderr.splitlines()[-1]
    assert not os.path.exists(tmp_path / "dl") and not os.path.exists(tmp_path / "run")


def write_idx(path, tensor):  # the MNIST file format torchvision reads: magic (type 8 = uint8, rank), sizes, bytes
    with open(path, "wb") as f:
        f.write(bytes([0, 0, 8, tensor.ndim]) + b"".join(n.to_bytes(4, "big") for n in tensor.shape))
        f.write(tensor.numpy().tobytes())


def test_a_torchvision_folder_is_read_offline(tmp_path):
    """The README's offline route: a folder as torchvision downloads and unpacks it is read without a network (an
    attempt to download would fail on the dead proxy), the folder left as it was. The images are MNIST-format files
    made here (digit k: a bright square at row 2k), so a run that reads them right learns them."""
    raw = tmp_path / "data" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for split, n in (("train", 600), ("t10k", 200)):
        y = torch.arange(n) % 10
        x = torch.randint(0, 60, (n, 28, 28), generator=torch.Generator().manual_seed(n), dtype=torch.uint8)
        for i, k in enumerate(y.tolist()):
            x[i, 2 * k + 2 : 2 * k + 6, 8:20] = 255
        write_idx(raw / f"{split}-images-idx3-ubyte", x)
        write_idx(raw / f"{split}-labels-idx1-ubyte", y.to(torch.uint8))
    before = sorted(p.name for p in raw.iterdir())
    dead = {v: "http://127.0.0.1:9" for v in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY")}
    flags = ["--dataset", "mnist", "--data-dir", tmp_path / "data", "--device", "cpu", "--model", "mlp", "--iid"]
    flags += ["--num-clients", "4", "--frac", "1", "--rounds", "5", "--local-steps", "20", "--lr", "0.1"]
    run_script("fedavg.py", *flags, "--out", tmp_path / "run", env=dead)
    assert sorted(p.name for p in raw.iterdir()) == before
    part = json.load(open(tmp_path / "run" / "partition.json"))
    assert sum(map(sum, part["train"])) == 600 and len(part["train"][0]) == 10
    assert summary(tmp_path / "run")["test_acc"] > 0.5  # chance is 0.10


CIFAR = os.environ.get("CLEANFL_CIFAR10_DIR")


@pytest.mark.skipif(not CIFAR, reason="set CLEANFL_CIFAR10_DIR to an unpacked cifar10-jpg folder")
def test_real_cifar10_folder_end_to_end(tmp_path):
    run_script(
        "fedavg.py",
        "--dataset",
        "folder",
        "--data-dir",
        CIFAR,
        "--device",
        "cpu",
        "--model",
        "mlp",
        "--num-clients",
        "10",
        "--frac",
        "0.3",
        "--iid",
        "--rounds",
        "4",
        "--local-steps",
        "30",
        "--batch-size",
        "50",
        "--lr",
        "0.05",
        "--augment",
        "none",
        "--eval-every",
        "4",
        "--out",
        tmp_path / "a",
    )
    s = summary(tmp_path / "a")
    assert s["test_acc"] > 0.2  # chance is 0.10
    part = json.load(open(tmp_path / "a" / "partition.json"))
    assert sum(map(sum, part["train"])) == 50000 and len(part["train"][0]) == 10


@pytest.mark.slow  # the fast tier keeps the real-CIFAR-10 run end to end
@pytest.mark.skipif(not CIFAR, reason="set CLEANFL_CIFAR10_DIR to an unpacked cifar10-jpg folder")
def test_real_cifar10_accuracy_does_not_depend_on_the_test_order():
    """The score does not depend on the test set's order: a batch norm without running statistics normalizes
    each evaluation batch with its own statistics, so the folder's class-sorted test set scored batches of two
    classes (4-6 points lower)."""
    import torch.nn.functional as F
    from common import build_model, evaluate, load_data, prepare_batch

    torch.manual_seed(0)
    data = load_data(argparse.Namespace(dataset="folder", data_dir=CIFAR, device="cpu", data_seed=0))
    model = build_model("convnet4-tiny", data)  # batch norm with track_running_stats=False
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    order = torch.randperm(len(data.y_train), generator=torch.Generator().manual_seed(0))
    for i in range(0, 10000, 50):  # one pass over a random fifth of the training set: about 30% accuracy
        batch = order[i : i + 50]
        x, y = prepare_batch(data.x_train[batch], data), data.y_train[batch]
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    model.eval()
    stored, _ = evaluate(model, data.x_test, data.y_test, data)
    perm = torch.randperm(len(data.y_test), generator=torch.Generator().manual_seed(1))
    shuffled, _ = evaluate(model, data.x_test[perm], data.y_test[perm], data)
    assert stored > 0.2
    assert abs(stored - shuffled) < 0.01, (stored, shuffled)

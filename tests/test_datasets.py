"""Clients and domains from image folders (--natural, --clients-per-domain, --disjoint-classes), Tiny-ImageNet's
own layout, the per-client spread and balanced accuracy every script logs, and anfr.py's focal loss. Every
folder is built here with tiny PIL images; expected numbers are counted or computed by hand."""

import importlib
import math
import os
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import common
from helpers import metrics, run_batches

PACS = ["art_painting", "cartoon", "photo", "sketch"]
SEVEN = ["dog", "elephant", "giraffe", "guitar", "horse", "house", "person"]


def write_images(root, counts, size=8, mode="RGB"):
    """counts: {"train/c0/ant": 3, ...}; image i of a folder has the pixel value 7 i + 1 in every channel."""
    from PIL import Image

    for folder, n in counts.items():
        os.makedirs(os.path.join(root, folder), exist_ok=True)
        for i in range(n):
            Image.new(mode, (size, size), (7 * i + 1,) * 3).save(os.path.join(root, folder, f"{i}.png"))
    return str(root)


NATURAL = {"c0": {"ant": 5, "bee": 3}, "c1": {"bee": 4, "cat": 6}, "c2": {"ant": 2, "bee": 2, "cat": 2}}
NATURAL_TEST = {"c0": {"ant": 2, "bee": 1}, "c1": {"cat": 3}, "c2": {"ant": 1, "bee": 1, "cat": 1}}


def natural_folder(root, shared_test=False, size=8):
    counts = {f"train/{k}/{c}": n for k, cs in NATURAL.items() for c, n in cs.items()}
    if shared_test:
        counts.update({f"test/{c}": 4 for c in ("ant", "bee", "cat")})
    else:
        counts.update({f"test/{k}/{c}": n for k, cs in NATURAL_TEST.items() for c, n in cs.items()})
    return write_images(root, counts, size)


def domain_folder(root, per_class=4, per_class_test=2, size=8):
    counts = {
        f"{s}/{d}/{c}": n for d in PACS for c in SEVEN for s, n in (("train", per_class), ("test", per_class_test))
    }
    return write_images(root, counts, size)


def parse(script, argv, monkeypatch, capsys=None):
    """<script>.parse_args on argv (finish_args included); returns args, or (exit code, last stderr line)."""
    module = importlib.import_module(script)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", "--device", "cpu", *map(str, argv)])
    try:
        return module.parse_args()
    except SystemExit as e:
        err = capsys.readouterr().err.strip().splitlines() if capsys else [""]
        return e.code, err[-1]


def load(script, argv, monkeypatch):
    args = parse(script, argv, monkeypatch)
    data = common.load_data(args)
    return args, data, common.make_partition(args, data)


def counts(labels, parts, c):
    return [np.bincount(labels[p].numpy(), minlength=c).tolist() for p in parts]


# ---------------------------------------------------------------------------------------------------- natural
def test_natural_partition_is_the_folders_with_their_own_test_sets(tmp_path, monkeypatch):
    root = natural_folder(tmp_path / "nat")
    args, data, part = load("fedavg", ["--dataset", "folder", "--data-dir", root, "--natural"], monkeypatch)
    assert args.num_clients == 3 and args.client_test  # test/<client>/: per-client test sets without --client-test
    assert data.classes == ["ant", "bee", "cat"] and part.names == ["c0", "c1", "c2"] and part.scheme == "natural"
    assert counts(data.y_train, part.train, 3) == [[5, 3, 0], [0, 4, 6], [2, 2, 2]]
    assert counts(data.y_test, part.test, 3) == [[2, 1, 0], [0, 0, 3], [1, 1, 1]]
    assert len(data.y_train) == 24 and len(data.y_test) == 9  # the global test set: every client's test images
    # the samples of a client are its folder's images (pixel value 7 i + 1 of image i): c0/ant holds 5
    x0 = data.x_train[part.train[0]][data.y_train[part.train[0]] == 0, 0, 0, 0]
    assert sorted(x0.tolist()) == [1, 8, 15, 22, 29]


def test_natural_with_one_shared_test_folder(tmp_path, monkeypatch):
    root = natural_folder(tmp_path / "nat", shared_test=True)
    args, data, part = load("fedavg", ["--dataset", "folder", "--data-dir", root, "--natural"], monkeypatch)
    assert part.test is None and not args.client_test and data.group_test is None and len(data.y_test) == 12
    args, data, part = load(
        "fedavg", ["--dataset", "folder", "--data-dir", root, "--natural", "--client-test"], monkeypatch
    )
    # --client-test deals each class's 4 shared test images by the clients' training counts: ant 5:2 -> cut at
    # round(4 * 5/7) = 3; bee 3:4:2 -> cuts at round(4 * 3/9) = 1, round(4 * 7/9) = 3; cat 6:2 -> cut at 3
    assert counts(data.y_test, part.test, 3) == [[3, 1, 0], [0, 2, 3], [1, 1, 1]]
    assert counts(data.y_train, part.train, 3) == [[5, 3, 0], [0, 4, 6], [2, 2, 2]]


def test_folder_listing_order_does_not_change_the_data(tmp_path, monkeypatch):
    root = natural_folder(tmp_path / "nat")
    first = load("fedavg", ["--dataset", "folder", "--data-dir", root, "--natural"], monkeypatch)
    os.remove(os.path.join(root, ".cleanfl-cache.pt"))
    real = os.listdir
    monkeypatch.setattr(common.os, "listdir", lambda p: list(reversed(real(p))))  # another file system's order
    second = load("fedavg", ["--dataset", "folder", "--data-dir", root, "--natural"], monkeypatch)
    (_, d1, p1), (_, d2, p2) = first, second
    for name in ("x_train", "y_train", "x_test", "y_test", "group_train", "group_test"):
        assert torch.equal(getattr(d1, name), getattr(d2, name)), name
    assert all(torch.equal(a, b) for a, b in zip(p1.train + p1.test, p2.train + p2.test))


# ---------------------------------------------------------------------------------------------------- domains
def test_pacs_disjoint_classes_two_two_three_per_domain(tmp_path, monkeypatch):
    """FedLN Table 5: 4 domains x 3 clients, the domain's 7 classes cut into 2, 2 and 3, test dealt alike."""
    root = domain_folder(tmp_path / "pacs")
    flags = ["--dataset", "folder", "--data-dir", root, "--clients-per-domain", "3", "--disjoint-classes"]
    args, data, part = load("fedln", [*flags, "--client-test"], monkeypatch)
    assert args.num_clients == 12 and part.names == [d for d in PACS for _ in range(3)]
    train, test = counts(data.y_train, part.train, 7), counts(data.y_test, part.test, 7)
    for d in range(4):
        held = [{c for c in range(7) if train[3 * d + j][c]} for j in range(3)]
        assert [len(h) for h in held] == [2, 2, 3] and set().union(*held) == set(range(7))
        for j in range(3):  # every image of its classes in its domain: 4 per class, 2 test images per class
            k = 3 * d + j
            assert train[k] == [4 if c in held[j] else 0 for c in range(7)]
            assert test[k] == [2 if c in held[j] else 0 for c in range(7)]
            assert set(data.group_train[part.train[k].cpu()].tolist()) == {d}
            assert set(data.group_test[part.test[k].cpu()].tolist()) == {d}
    assert sum(map(len, part.train)) == 4 * 7 * 4 and sum(map(len, part.test)) == 4 * 7 * 2


def test_split_disjoint_class_counts_by_hand():
    """c classes over n clients: floor(c/n) each, the last c mod n clients one more, every sample of a class with
    its one client: 8 over 3 -> 2, 3, 3; 10 over 4 -> 2, 2, 3, 3; 6 over 3 -> 2, 2, 2."""
    for c, n, want in [(8, 3, [2, 3, 3]), (10, 4, [2, 2, 3, 3]), (6, 3, [2, 2, 2])]:
        labels = np.repeat(np.arange(c), 3)
        parts = common.split_disjoint(labels, n, np.random.default_rng(0))
        held = [sorted(set(labels[p].tolist())) for p in parts]
        assert [len(h) for h in held] == want
        assert sorted(sum(held, [])) == list(range(c)) and [len(p) for p in parts] == [3 * k for k in want]


@pytest.mark.parametrize("flag", [["--iid"], ["--alpha", "0.5"], ["--classes-per-client", "7"], ["--shards", "2"]])
def test_every_partition_flag_works_within_each_domain(flag, tmp_path, monkeypatch):
    root = domain_folder(tmp_path / "pacs", per_class=6)
    args, data, part = load(
        "fedavg", ["--dataset", "folder", "--data-dir", root, "--clients-per-domain", "2", *flag], monkeypatch
    )
    assert len(part.train) == 8 and part.test is None
    for d in range(4):
        mine = torch.cat(part.train[2 * d : 2 * d + 2]).cpu()
        assert set(data.group_train[mine].tolist()) == {d} and len(mine) == len(set(mine.tolist())) == 42
    if flag == ["--iid"] or flag[0] == "--classes-per-client":
        assert [len(p) for p in part.train] == [21] * 8  # each domain's 42 images split evenly


REFUSED = [
    (["--natural"], "flat", "--data-dir"),  # a flat folder given as clients
    ([], "nat", "--natural or --clients-per-domain"),  # a grouped folder read flat: the hint names the flags
    (["--natural", "--num-clients", "4"], "nat", "--num-clients"),
    (["--natural", "--quantity", "powerlaw"], "nat", "--quantity"),
    (["--clients-per-domain", "3"], "pacs", "--clients-per-domain"),  # no partition flag within the domains
    (["--clients-per-domain", "2", "--natural"], "pacs", "--clients-per-domain"),
    (["--clients-per-domain", "8", "--disjoint-classes"], "pacs", "--disjoint-classes"),
    (["--clients-per-domain", "2", "--classes-per-client", "8"], "pacs", "--classes-per-client"),
    (["--clients-per-domain", "2", "--split2"], "pacs", "--clients-per-domain"),
    (["--clients-per-domain", "3", "--iid", "--num-clients", "3"], "pacs", "--num-clients"),
]


def test_bad_folders_and_flags_are_refused_before_any_work(tmp_path, monkeypatch, capsys):
    from helpers import stand_in_folder

    roots = {"nat": natural_folder(tmp_path / "nat"), "pacs": domain_folder(tmp_path / "pacs", 1, 1)}
    roots["flat"] = stand_in_folder(tmp_path / "flat")
    for flags, root, named in REFUSED:
        out = tmp_path / "run"
        code, last = parse("fedavg", ["--dataset", "folder", "--data-dir", roots[root], "--out", out, *flags],
                           monkeypatch, capsys)  # fmt: skip
        assert code == 2 and named in last, (flags, last)
        assert not out.exists()
    for flags, named in [(["--natural"], "--natural"), (["--disjoint-classes", "--num-clients", "11"], "--disjoint")]:
        code, last = parse("fedavg", ["--dataset", "synthetic", *flags], monkeypatch, capsys)
        assert code == 2 and named in last, last
    # a class folder in a client's test/ that no training folder has
    write_images(tmp_path / "nat", {"test/c1/dog": 1})
    code, last = parse("fedavg", ["--dataset", "folder", "--data-dir", roots["nat"], "--natural"], monkeypatch, capsys)
    assert code == 2 and "c1/dog" in last


# ---------------------------------------------------------------------------------------------------- Tiny-ImageNet
def tiny_imagenet(root):
    """Three wnids (listed unsorted in wnids.txt), one grayscale JPEG, val labels from val_annotations.txt."""
    from PIL import Image

    wnids = ["n03", "n01", "n02"]
    for w in wnids:
        os.makedirs(root / "train" / w / "images")
        (root / "train" / w / f"{w}_boxes.txt").write_text("")
        for i in range(2):
            img = Image.new("L", (64, 64), 200) if (w, i) == ("n02", 0) else Image.new("RGB", (64, 64), (i, 9, 9))
            img.save(root / "train" / w / "images" / f"{w}_{i}.JPEG", quality=100)
    os.makedirs(root / "val" / "images")
    labels = ["n02", "n03", "n01", "n02"]
    for i in range(4):
        Image.new("RGB", (64, 64), (i, 0, 0)).save(root / "val" / "images" / f"val_{i}.JPEG")
    rows = [f"val_{i}.JPEG\t{w}\t0\t0\t63\t63\n" for i, w in enumerate(labels)]
    (root / "val" / "val_annotations.txt").write_text("".join(reversed(rows)))
    (root / "wnids.txt").write_text("\n".join(wnids))
    return str(root)


def test_tiny_imagenet_layout_is_read_with_sorted_wnids(tmp_path):
    root = tiny_imagenet(tmp_path / "tiny-imagenet-200")
    x_tr, y_tr, x_te, y_te = common.tinyimagenet_dataset(root)
    assert x_tr.shape == (6, 3, 64, 64) and x_te.shape == (4, 3, 64, 64)
    assert y_tr.tolist() == [0, 0, 1, 1, 2, 2]  # n01, n02, n03 in sorted order, not wnids.txt's
    assert y_te.tolist() == [1, 2, 0, 1]  # val_0..val_3 by their annotation, whatever the file's row order
    gray = x_tr[2]  # n02_0.JPEG, grayscale: three equal channels
    assert torch.equal(gray[0], gray[1]) and torch.equal(gray[1], gray[2]) and abs(int(gray[0, 0, 0]) - 200) <= 2
    assert common.NUM_CLASSES["tinyimagenet"] == 200 and common.TRAIN_SIZE["tinyimagenet"] == 100_000


def test_tiny_imagenet_without_its_layout_is_refused(tmp_path, monkeypatch, capsys):
    root = tiny_imagenet(tmp_path / "t")
    os.remove(os.path.join(root, "val", "val_annotations.txt"))
    code, last = parse("fedavg", ["--dataset", "tinyimagenet", "--data-dir", root, "--natural"], monkeypatch, capsys)
    assert code == 2 and "--natural" in last  # its folders are classes, not clients
    code, last = parse("fedavg", ["--dataset", "tinyimagenet", "--data-dir", root], monkeypatch, capsys)
    assert code == 2 and "--data-dir" in last and "val_annotations.txt" in last


def test_every_model_runs_at_64x64():
    data = common.Data(torch.zeros(1, 3, 64, 64, dtype=torch.uint8), None, None, None, 200, None, None)
    for name in sorted(common.MODELS):
        torch.manual_seed(0)
        model = common.build_model(name, data).eval()
        with torch.no_grad():
            assert model(torch.randn(1, 3, 64, 64)).shape == (1, 200), name


# ---------------------------------------------------------------------------------------------------- metrics
def fixed_predictions(y, pred, num_classes):
    """Data whose image i makes the forward pass predict pred[i] (the pixel value is the class)."""
    x = torch.tensor(pred, dtype=torch.uint8).view(-1, 1, 1, 1)
    data = common.Data(
        x, None, x, torch.tensor(y), num_classes, torch.zeros(1, 1, 1, 1), torch.full((1, 1, 1, 1), 1 / 255)
    )
    forward = lambda xb: F.one_hot(xb.round().long().view(-1), num_classes).float()
    return data, forward


def test_balanced_accuracy_by_hand():
    # class 0: 2 of 3 right, class 1: 1 of 1, class 2: 1 of 2; class 3 is predicted once but never a target
    y, pred = [0, 0, 0, 1, 2, 2], [0, 3, 0, 1, 0, 2]
    data, forward = fixed_predictions(y, pred, 4)
    acc, _, bacc = common.evaluate(forward, data.x_test, data.y_test, data, batch_size=4, balanced=True)
    assert acc == pytest.approx(4 / 6) and bacc == pytest.approx((2 / 3 + 1 + 1 / 2) / 3)  # 13/18
    assert len(common.evaluate(forward, data.x_test, data.y_test, data)) == 2  # without balanced: as before


def test_spread_mean_std_and_worst_tenth_by_hand():
    s = common.spread([0.5, 0.2, 0.9])
    mean = 1.6 / 3
    assert s["mean"] == pytest.approx(mean)
    assert s["std"] == pytest.approx(math.sqrt(((0.5 - mean) ** 2 + (0.2 - mean) ** 2 + (0.9 - mean) ** 2) / 3))
    assert s["worst10"] == pytest.approx(0.2)  # ceil(3/10) = 1 client
    assert common.spread([k / 10 for k in range(10, -1, -1)])["worst10"] == pytest.approx(0.05)  # 11: the 2 lowest


def test_eval_metrics_per_client_rows_by_hand():
    y, pred = [0, 0, 0, 1, 2, 2, 1, 1], [0, 3, 0, 1, 0, 2, 2, 2]
    data, forward = fixed_predictions(y, pred, 4)
    tests = [torch.tensor([0, 1, 2]), torch.tensor([3, 4, 5]), torch.tensor([], dtype=torch.long), torch.tensor([6, 7])]
    row = common.eval_metrics(forward, data, tests, balanced=True, lists=True)
    # client 0: 2/3 (bacc 2/3); client 1: 2/3 (bacc (1 + 1/2)/2); client 2: no test data; client 3: 0 (bacc 0)
    acc = row["client_test_acc"]
    assert acc[2] is None and [acc[0], acc[1], acc[3]] == pytest.approx([2 / 3, 2 / 3, 0.0])
    assert row["client_test_bacc"][3] == 0.0 and row["client_test_bacc"][1] == pytest.approx(3 / 4)
    assert row["client_test_acc_mean"] == pytest.approx(4 / 9) and row["client_test_acc_worst10"] == 0.0
    assert row["client_test_acc_std"] == pytest.approx(math.sqrt(2 * (2 / 3 - 4 / 9) ** 2 / 3 + (4 / 9) ** 2 / 3))
    assert row["client_test_bacc_mean"] == pytest.approx((2 / 3 + 3 / 4 + 0) / 3)
    assert row["test_acc"] == pytest.approx(4 / 8) and row["test_bacc"] == pytest.approx((2 / 3 + 1 / 3 + 1 / 2) / 3)
    plain = common.eval_metrics(forward, data, tests)  # without balanced, without lists
    assert set(plain) == {
        "test_acc",
        "test_loss",
        "client_test_acc_mean",
        "client_test_acc_std",
        "client_test_acc_worst10",
    }


# ---------------------------------------------------------------------------------------------------- focal loss
def test_focal_loss_and_local_class_weights_by_hand():
    import anfr

    alpha = anfr.class_weights(torch.tensor([0, 0, 0, 2]), 3)  # shares 3/4, 0, 1/4 -> 4/3, 0 (absent), 4
    assert alpha.tolist() == pytest.approx([4 / 3, 0.0, 4.0])
    # one weight per class of the dataset, also when the client lacks the last ones
    assert anfr.class_weights(torch.tensor([0, 1, 1]), 4).tolist() == pytest.approx([3.0, 1.5, 0.0, 0.0])
    logits = torch.log(torch.tensor([[1.0, 1.0, 2.0], [3.0, 1.0, 1.0]]))  # softmax: (1/4, 1/4, 1/2), (3/5, 1/5, 1/5)
    y = torch.tensor([2, 0])
    expected = (4 * (1 - 0.5) ** 2 * math.log(2) + 4 / 3 * (1 - 0.6) ** 2 * -math.log(0.6)) / 2
    assert anfr.focal_loss(logits, y, alpha, 2.0).item() == pytest.approx(expected, rel=1e-6)
    # gamma 0 with unit weights is PyTorch's cross-entropy
    z, t = torch.randn(5, 4), torch.tensor([0, 3, 1, 1, 2])
    assert anfr.focal_loss(z, t, torch.ones(4), 0.0).item() == pytest.approx(F.cross_entropy(z, t).item(), rel=1e-6)


# ---------------------------------------------------------------------------------------------------- every script
SMALL = {
    "fedavg": ["--model", "cnn"],
    "fedbabu": ["--model", "convnet4-tiny", "--ft-epochs", "1"],
    "fedfn": ["--model", "cnn"],
    "fedln": ["--model", "normcnn", "--width", "8"],
    "fednnnn": ["--model", "cnn6-narrow"],
    "anfr": ["--depth", "18", "--width", "8", "--loss", "focal"],
}


def test_every_script_logs_the_spread_and_balanced_accuracy_on_natural_clients(tmp_path):
    root = natural_folder(tmp_path / "nat", size=32)
    base = ["--dataset", "folder", "--data-dir", root, "--natural", "--balanced-acc", "--device", "cpu", "--frac", "1",
            "--rounds", "1", "--local-steps", "1", "--batch-size", "4"]  # fmt: skip
    cmds = [[f"{s}.py", *base, *flags, "--out", tmp_path / s] for s, flags in SMALL.items()]
    run_batches(cmds[:3], cmds[3:])
    keys = ["test_acc", "test_bacc"] + [
        f"client_test_{m}_{s}" for m in ("acc", "bacc") for s in ("mean", "std", "worst10")
    ]
    for s in SMALL:
        row = metrics(tmp_path / s)[-1]
        assert all(0 <= row[k] <= 1 for k in keys), (s, row)
        assert row["client_test_acc_worst10"] <= row["client_test_acc_mean"], s
    per_client = metrics(tmp_path / "anfr")[-1]["client_test_acc"]  # anfr also logs each client's
    assert len(per_client) == 3 and metrics(tmp_path / "anfr")[-1]["client_test_acc_worst10"] == min(per_client)


# ---------------------------------------------------------------------------------------------------- preparation
def test_prepare_data_lays_out_fed_isic2019_and_pacs(tmp_path, monkeypatch):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import prepare_data
    from PIL import Image

    os.makedirs(tmp_path / "isic_raw")
    rows = [("a", 0, 0, "train", (30, 20)), ("b", 1, 0, "test", (20, 26)), ("c", 1, 1, "train", (24, 24)),
            ("d", 0, 1, "test", (40, 22))]  # fmt: skip
    for name, _, _, _, wh in rows:
        Image.new("RGB", wh, (9, 9, 9)).save(tmp_path / "isic_raw" / f"{name}.jpg")
    (tmp_path / "meta.csv").write_text(
        "image,target,center,fold\n" + "".join(f"{n},{t},{c},{f}\n" for n, t, c, f, _ in rows)
    )
    out = tmp_path / "isic"
    prepare_data.main(["isic", "--csv", str(tmp_path / "meta.csv"), "--images", str(tmp_path / "isic_raw"),
                       "--out", str(out), "--size", "16"])  # fmt: skip
    assert (out / "train" / "center1" / "class1" / "c.png").exists() and (out / "test" / "center0" / "class1").exists()
    with Image.open(out / "test" / "center1" / "class0" / "d.png") as im:
        assert im.size == (16, 16)
    args, data, part = load(
        "anfr", ["--dataset", "folder", "--data-dir", out, "--natural", "--depth", "18"], monkeypatch
    )
    assert part.names == ["center0", "center1"] and counts(data.y_test, part.test, 2) == [[0, 1], [1, 0]]
    write_images(tmp_path / "PACS", {f"{d}/{c}": 5 for d in ("photo", "sketch") for c in ("dog", "horse")})
    prepare_data.main(["pacs", "--src", str(tmp_path / "PACS"), "--out", str(tmp_path / "pacs")])
    for d in ("photo", "sketch"):
        for c in ("dog", "horse"):  # round(0.2 * 5) = 1 test image of each domain's class
            assert len(os.listdir(tmp_path / "pacs" / "train" / d / c)) == 4
            assert len(os.listdir(tmp_path / "pacs" / "test" / d / c)) == 1

"""Clients and domains from image folders (--natural, --clients-per-domain, --disjoint-classes), Tiny-ImageNet's
own layout, the per-client spread and balanced accuracy every script logs, and anfr.py's focal loss. Every
folder is built here with tiny PIL images; expected numbers are counted or computed by hand."""

import importlib
import json
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
    # a class folder in one shared test/ that no training folder has (was a KeyError while decoding)
    shared = natural_folder(tmp_path / "shared", shared_test=True)
    write_images(tmp_path / "shared", {"test/zebra": 1})
    code, last = parse("fedavg", ["--dataset", "folder", "--data-dir", shared, "--natural"], monkeypatch, capsys)
    assert code == 2 and "--data-dir" in last and "zebra" in last, last


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


# Fed-ISIC2019's training labels per center and class (MEL, NV, BCC, AK, BKL, DF, VASC, SCC), counted in FLamby's
# train_test_split (fold == train); FLamby's BaselineLoss default alpha, as printed in flamby/datasets/fed_isic2019/
# loss.py: N / n_c over the pooled training labels, to 4 decimals
ISIC_TRAIN = [[2279, 3363, 2245, 606, 923, 97, 87, 330], [20, 2977, 2, 0, 96, 23, 45, 0],
              [533, 1470, 174, 20, 379, 40, 64, 11], [276, 649, 223, 86, 406, 20, 3, 144],
              [166, 349, 0, 0, 140, 0, 0, 0], [58, 276, 5, 0, 6, 4, 2, 0]]  # fmt: skip
FLAMBY_ALPHA = [5.5813, 2.0472, 7.0204, 26.1194, 9.5369, 101.0707, 92.5224, 38.3443]


def isic_labels():
    labels, parts, start = [], [], 0
    for row in ISIC_TRAIN:
        ys = [c for c, n in enumerate(row) for _ in range(n)]
        labels += ys
        parts.append(torch.arange(start, start + len(ys)))
        start += len(ys)
    return torch.tensor(labels), parts


def test_pooled_focal_weights_are_flamby_s_constants():
    import anfr

    labels, parts = isic_labels()
    assert len(labels) == 18597 and [len(p) for p in parts] == [9930, 3163, 2691, 1807, 655, 351]  # FLamby's sizes
    pooled = anfr.focal_weights(labels, parts, 8, "pooled")
    assert len(pooled) == 6 and all(torch.equal(a, pooled[0]) for a in pooled)  # one fixed set for every client
    assert pooled[0].tolist() == pytest.approx(FLAMBY_ALPHA, abs=5e-5)  # FLamby's eight constants
    local = anfr.focal_weights(labels, parts, 8, "local")
    assert local[1][2].item() == pytest.approx(3163 / 2)  # center 1 holds 2 BCC images: 1,581.5
    assert local[1][3].item() == 0 and local[4][2].item() == 0  # classes a center lacks: never a target
    assert max(a.max().item() for a in local) == pytest.approx(1581.5) and pooled[0].max().item() < 101.1
    assert local[0].tolist() == pytest.approx([9930 / n for n in ISIC_TRAIN[0]])


def flamby_baseline_loss(inputs, targets, alpha, gamma=2.0):
    """FLamby's BaselineLoss.forward (flamby/datasets/fed_isic2019/loss.py), step by step as written there."""
    targets = targets.view(-1, 1).type_as(inputs)
    logpt = F.log_softmax(inputs, dim=1).gather(1, targets.long()).view(-1)
    pt = logpt.exp()
    at = alpha.gather(0, targets.data.view(-1).long())
    logpt = logpt * at
    return (-1 * (1 - pt) ** gamma * logpt).mean()


def test_focal_loss_equals_flamby_s_baseline_loss_bit_for_bit():
    import anfr

    alpha = torch.tensor(FLAMBY_ALPHA)
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        z, y = 3 * torch.randn(64, 8, generator=g), torch.randint(0, 8, (64,), generator=g)
        for gamma in (2.0, 0.0, 0.5):
            ours, theirs = z.clone().requires_grad_(), z.clone().requires_grad_()
            a, b = anfr.focal_loss(ours, y, alpha, gamma), flamby_baseline_loss(theirs, y, alpha, gamma)
            a.backward()
            b.backward()
            assert torch.equal(a, b) and torch.equal(ours.grad, theirs.grad), (seed, gamma, (a - b).item())


def test_focal_weights_by_hand_and_the_flag(monkeypatch):
    import anfr

    labels = torch.tensor([0, 0, 0, 1, 1, 2])  # client 0: 0, 0, 0, 1; client 1: 1, 2
    parts = [torch.tensor([0, 1, 2, 3]), torch.tensor([4, 5])]
    pooled = anfr.focal_weights(labels, parts, 3, "pooled")
    assert [a.tolist() for a in pooled] == [pytest.approx([2.0, 3.0, 6.0])] * 2  # 6/3, 6/2, 6/1
    local = anfr.focal_weights(labels, parts, 3, "local")
    assert local[0].tolist() == pytest.approx([4 / 3, 4.0, 0.0]) and local[1].tolist() == pytest.approx([0.0, 2.0, 2.0])
    assert parse("anfr", ["--dataset", "synthetic"], monkeypatch).focal_weights == "local"  # the main tables' (A.1)
    pooled = ["--dataset", "synthetic", "--loss", "focal", "--focal-weights", "pooled"]
    assert parse("anfr", pooled, monkeypatch).focal_weights == "pooled"
    assert parse("anfr", ["--dataset", "synthetic", "--focal-weights", "flamby"], monkeypatch)[0] == 2


@pytest.mark.slow  # 4 runs of anfr.py (the weights by hand: above)
def test_focal_weights_flag_reaches_the_loss(tmp_path):
    """The first round's train_loss is each client's focal loss at the initial model (one local step): local and
    pooled weights give different numbers on three clients with different labels, and equal ones on one client,
    whose local weights are the pooled ones."""
    natural_folder(tmp_path / "three", size=16)
    write_images(tmp_path / "one", {"train/c0/ant": 3, "train/c0/bee": 2, "test/c0/ant": 1, "test/c0/bee": 1},
                       size=16)  # fmt: skip
    base = ["--dataset", "folder", "--natural", "--device", "cpu", "--depth", "18", "--width", "8", "--loss", "focal",
            "--rounds", "1", "--local-steps", "1", "--batch-size", "4"]  # fmt: skip
    runs = {(d, w): tmp_path / f"{d}-{w}" for d in ("three", "one") for w in ("local", "pooled")}
    cmds = [["anfr.py", *base, "--data-dir", tmp_path / d, "--focal-weights", w, "--out", out] for (d, w), out in
            runs.items()]  # fmt: skip
    run_batches(cmds[:2], cmds[2:])
    loss = {k: metrics(out)[-1]["train_loss"] for k, out in runs.items()}
    assert loss["three", "local"] != pytest.approx(loss["three", "pooled"], rel=1e-3)
    assert loss["one", "local"] == loss["one", "pooled"]


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
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
FLAMBY_HEADER = "image,MEL,NV,BCC,AK,BKL,DF,VASC,SCC,UNK,target,center,fold,fold2"  # train_test_split's columns


def prepare(argv, capsys):
    """benchmarks/prepare_data.py in-process: (exit code, stderr's last line)."""
    import prepare_data

    capsys.readouterr()
    try:
        prepare_data.main(list(map(str, argv)))
        code = 0
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


def flamby_csv(path, rows):
    """FLamby's train_test_split with its real columns: one-hot diagnoses, target, center, fold, fold2."""
    lines = [FLAMBY_HEADER]
    for image, target, center, fold in rows:
        onehot = ",".join("1.0" if k == target else "0.0" for k in range(9))
        lines.append(f"{image},{onehot},{target},{center},{fold},{fold}_{center}")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def isic_source(tmp_path):
    from PIL import Image

    os.makedirs(tmp_path / "isic_raw")
    rows = [("ISIC_0000000", 0, 0, "train", (30, 20)), ("ISIC_0000001", 1, 0, "test", (20, 26)),
            ("ISIC_0012669_downsampled", 1, 1, "train", (24, 24)),
            ("ISIC_0000003", 0, 1, "test", (40, 22))]  # fmt: skip
    for name, _, _, _, wh in rows:
        Image.new("RGB", wh, (9, 9, 9)).save(tmp_path / "isic_raw" / f"{name}.jpg")
    return flamby_csv(tmp_path / "train_test_split", [r[:4] for r in rows]), str(tmp_path / "isic_raw")


def files_under(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def test_prepare_data_lays_out_fed_isic2019_from_flamby_s_real_csv(tmp_path, monkeypatch, capsys):
    csv_path, images = isic_source(tmp_path)
    out = tmp_path / "isic"
    code, last = prepare(["isic", "--csv", csv_path, "--images", images, "--out", out, "--size", "16"], capsys)
    assert code == 0 and "4 images written" in last, last
    assert (out / "train" / "center1" / "class1" / "ISIC_0012669_downsampled.png").exists()
    with Image_open(out / "test" / "center1" / "class0" / "ISIC_0000003.png") as im:
        assert im.size == (16, 16) and im.mode == "RGB"
    # FLamby's 8 classes in classes.txt: the head has 8 outputs although this subset holds 2 classes
    assert (out / "classes.txt").read_text().split() == [f"class{y}" for y in range(8)]
    args, data, part = load(
        "anfr", ["--dataset", "folder", "--data-dir", out, "--natural", "--depth", "18"], monkeypatch
    )
    assert part.names == ["center0", "center1"] and data.num_classes == 8
    assert counts(data.y_test, part.test, 8) == [[0, 1, 0, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0, 0]]
    assert not [f for f in os.listdir(tmp_path) if ".partial-" in f]  # the temporary folder became --out


def Image_open(path):
    from PIL import Image

    return Image.open(path)


def test_prepare_data_refuses_bad_input_before_writing_anything(tmp_path, capsys):
    csv_path, images = isic_source(tmp_path)
    out = tmp_path / "isic"
    base = ["isic", "--images", images, "--out", out]
    # FLamby's data-folder metadata instead of train_test_split: the line says where the right file is
    meta = tmp_path / "ISIC_2019_Training_Metadata_FL.csv"
    meta.write_text("image,age_approx,anatom_site_general,lesion_id,sex,dataset\nISIC_0000000,55.0,anterior torso,"
                    "BCN_0000001,male,BCN_nevi\n")  # fmt: skip
    code, last = prepare([*base, "--csv", meta], capsys)
    assert code == 2 and "--csv" in last and "fold" in last and "ISIC_2019_Training_Metadata_FL.csv" in last
    assert "flamby/datasets/fed_isic2019/dataset_creation_scripts/train_test_split" in last
    # two listed images missing: the count and the first names
    os.remove(os.path.join(images, "ISIC_0000001.jpg"))
    os.remove(os.path.join(images, "ISIC_0000003.jpg"))
    code, last = prepare([*base, "--csv", csv_path], capsys)
    assert code == 2 and "--images" in last and "2 of the 4" in last and "ISIC_0000001.jpg" in last, last
    bad = flamby_csv(tmp_path / "bad", [("ISIC_0000000", 0, 0, "val")])  # fold must be train or test
    code, last = prepare([*base, "--csv", bad], capsys)
    assert code == 2 and "--csv" in last and "line 2" in last
    for args, flag in [
        (["--csv", tmp_path / "nope"], "--csv"),
        (["--csv", csv_path, "--images", tmp_path], "--images"),
    ]:
        code, last = prepare(["isic", "--images", images, "--out", out, *args], capsys)
        assert code == 2 and flag in last, last
    assert not out.exists() and not [f for f in os.listdir(tmp_path) if ".partial-" in f]


@pytest.mark.parametrize(
    "flags, named",
    [(["--test-frac", "0"], "--test-frac"), (["--test-frac", "1"], "--test-frac"),
     (["--test-frac", "1.5"], "--test-frac"), (["--test-frac", "nan"], "--test-frac"), (["--size", "0"], "--size"),
     (["--size", "-3"], "--size"), (["--size", "2.5"], "--size"), (["--seed", "-1"], "--seed")],
)  # fmt: skip
def test_prepare_data_bad_flag_values_exit_2_naming_the_flag(flags, named, tmp_path, capsys):
    write_images(tmp_path / "PACS", {"photo/dog": 2})
    code, last = prepare(["pacs", "--src", tmp_path / "PACS", "--out", tmp_path / "pacs", *flags], capsys)
    assert code == 2 and f"argument {named}" in last, last
    assert not (tmp_path / "pacs").exists()


def pacs_source(root, per_class=5):
    """PACS as distributed: sketch PNGs in L, RGBA and RGB modes, the other domains' JPEGs."""
    from PIL import Image

    for d in ("photo", "sketch"):
        for c in ("dog", "horse"):
            os.makedirs(root / d / c)
            for i in range(per_class):
                if d == "sketch":
                    mode = ("L", "RGBA", "RGB")[i % 3]
                    Image.new(mode, (12, 12), 200 if mode == "L" else (200,) * len(mode)).save(
                        root / d / c / f"{i}.png"
                    )
                else:
                    Image.new("RGB", (12, 12), (7 * i + 1, 0, 0)).save(root / d / c / f"pic_{i:03d}.jpg")
    return str(root)


def split_of(out):
    """{(domain, class): (train names, test names)} of a prepared PACS folder."""
    got = {}
    for d in sorted(os.listdir(out / "train")):
        for c in sorted(os.listdir(out / "train" / d)):
            got[d, c] = tuple(set(os.listdir(out / s / d / c)) for s in ("train", "test"))
    return got


def test_prepare_data_never_mixes_two_conversions(tmp_path, monkeypatch, capsys):
    """A second run into the same --out with another --seed is refused; with --overwrite the folder is the second
    run's alone: train and test disjoint, together the source's images (the 34-of-140 leak cannot happen)."""
    src, out = pacs_source(tmp_path / "PACS", per_class=10), tmp_path / "pacs"
    assert prepare(["pacs", "--src", src, "--out", out], capsys)[0] == 0
    first = files_under(out)
    code, last = prepare(["pacs", "--src", src, "--out", out, "--seed", "1"], capsys)
    assert code == 2 and "--out" in last and "--overwrite" in last and files_under(out) == first
    code, last = prepare(["pacs", "--src", src, "--out", out, "--seed", "1", "--test-frac", "0.5", "--overwrite"],
                         capsys)  # fmt: skip
    assert code == 0, last
    for (d, c), (train, test) in split_of(out).items():
        stems = {os.path.splitext(f)[0] for f in os.listdir(os.path.join(src, d, c))}
        assert not train & test and {os.path.splitext(f)[0] for f in train | test} == stems
        assert len(test) == 5  # round(0.5 * 10): the second run's fraction, not the first's 2
    assert files_under(out) != first
    # an empty --out is fine; an --out holding the source is refused, even with --overwrite
    os.makedirs(tmp_path / "empty")
    assert prepare(["pacs", "--src", src, "--out", tmp_path / "empty"], capsys)[0] == 0
    code, last = prepare(["pacs", "--src", src, "--out", tmp_path, "--overwrite"], capsys)
    assert code == 2 and "--out" in last and "overlap" in last and os.path.isdir(src)


def test_prepare_data_leaves_no_half_output(tmp_path, monkeypatch, capsys):
    """A failure or Ctrl-C half-way leaves --out as it was (absent, or the previous conversion whole) and no
    temporary folder."""
    import prepare_data

    src, out = pacs_source(tmp_path / "PACS"), tmp_path / "pacs"
    real, calls = prepare_data.open_rgb, []

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) == 7:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(prepare_data, "open_rgb", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare_data.main(["pacs", "--src", src, "--out", str(out)])
    assert not out.exists() and sorted(os.listdir(tmp_path)) == ["PACS"]
    monkeypatch.setattr(prepare_data, "open_rgb", real)
    assert prepare(["pacs", "--src", src, "--out", out], capsys)[0] == 0
    before = files_under(out)
    calls.clear()
    monkeypatch.setattr(prepare_data, "open_rgb", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare_data.main(["pacs", "--src", src, "--out", str(out), "--overwrite", "--seed", "3"])
    assert files_under(out) == before and sorted(os.listdir(tmp_path)) == ["PACS", "pacs"]


def test_prepare_data_skips_stray_files_and_unreadable_images(tmp_path, monkeypatch, capsys):
    src, out = pacs_source(tmp_path / "PACS"), tmp_path / "pacs"
    (tmp_path / "PACS" / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    (tmp_path / "PACS" / "sketch" / "dog" / "Thumbs.db").write_bytes(b"\xd0\xcf\x11\xe0")
    (tmp_path / "PACS" / "photo" / "readme.txt").write_text("PACS")
    (tmp_path / "PACS" / "photo" / "horse" / "pic_999.jpg").write_bytes(b"not a JPEG")  # unreadable
    code, last = prepare(["pacs", "--src", src, "--out", out, "--size", "8"], capsys)
    assert code == 0, last
    assert "20 images written" in last and "skipped 3 stray non-image files" in last and ".DS_Store" in last
    assert "skipped 1 unreadable image" in last and "pic_999" in last and len(last.splitlines()) == 1
    assert sum(len(tr) + len(te) for tr, te in split_of(out).values()) == 20
    assert not any("pic_999" in f for f in files_under(out))


def test_prepare_data_pacs_sketch_modes_are_rgb_and_fedln_reads_them(tmp_path, monkeypatch, capsys):
    src, out = pacs_source(tmp_path / "PACS"), tmp_path / "pacs"
    code, last = prepare(["pacs", "--src", src, "--out", out], capsys)
    assert code == 0, last
    for d in ("photo", "sketch"):
        for c in ("dog", "horse"):  # round(0.2 * 5) = 1 test image of each domain's class
            assert len(os.listdir(out / "train" / d / c)) == 4 and len(os.listdir(out / "test" / d / c)) == 1
    for name in files_under(out / "train" / "sketch"):
        with Image_open(out / "train" / "sketch" / name) as im:
            assert im.mode == "RGB" and im.getpixel((3, 3)) == (200, 200, 200)  # L, RGBA, RGB: the same grey
    flags = ["--dataset", "folder", "--data-dir", out, "--clients-per-domain", "1", "--iid", "--model", "resnet18"]
    args, data, part = load("fedln", flags, monkeypatch)
    assert data.x_train.shape[1:] == (3, 12, 12) and part.names == ["photo", "sketch"] and data.num_classes == 2


def test_prepare_data_shows_a_progress_bar(tmp_path, capsys):
    import prepare_data

    prepare_data.main(["pacs", "--src", pacs_source(tmp_path / "PACS"), "--out", str(tmp_path / "pacs")])
    err = capsys.readouterr().err
    assert "writing:" in err and "/20 [" in err  # tqdm's bar over the 20 images (drawn again each second)
    assert err.splitlines()[-1].endswith("(train 16, test 4)")  # then the one summary line


# ---------------------------------------------------------------------------------------------------- LEAF
def leaf_json(path, users):
    """LEAF's JSON: {"users", "num_samples", "user_data": {user: {"x": [...], "y": [...]}}}."""
    data = {"users": list(users), "num_samples": [len(d["y"]) for d in users.values()], "user_data": users}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def femnist_x(ink=(), value=0.0):
    """784 values, 1.0 (LEAF's white background) except the (row, col) pixels of ink."""
    x = [1.0] * 784
    for r, c in ink:
        x[28 * r + c] = value
    return x


# writer -> (train labels, test labels); A is 10, a is 36 (LEAF's relabel_class)
WRITERS = {"f0000_14": ([10, 36, 36, 0], [10, 36]), "f0001_41": ([61, 5, 5], [5]), "f0002_03": ([10, 10], [61, 10])}


def femnist_source(root):
    for split, k in (("train", 0), ("test", 1)):
        users = {w: {"x": [femnist_x([(3, 5)]) for _ in ys[k]], "y": ys[k]} for w, ys in WRITERS.items()}
        first = {w: users[w] for w in ("f0000_14", "f0001_41")}  # LEAF writes at most 100 writers per file
        leaf_json(root / split / f"all_data_0_niid_0_keep_0_{split}_9.json", first)
        leaf_json(root / split / f"all_data_1_niid_0_keep_0_{split}_9.json", {"f0002_03": users["f0002_03"]})
    return root


def test_prepare_data_femnist_from_leaf_json(tmp_path, monkeypatch, capsys):
    leaf, out = femnist_source(tmp_path / "leaf"), tmp_path / "femnist"
    code, last = prepare(["femnist", "--train", leaf / "train", "--test", leaf / "test", "--out", out], capsys)
    assert code == 0 and "14 images written" in last and "train 9, test 5" in last, last
    # A and a: two folders that a case-insensitive file system keeps apart
    for d, dirs, _ in os.walk(out):
        assert len({x.lower() for x in dirs}) == len(dirs), d
    assert sorted(os.listdir(out / "train" / "f0000_14")) == ["00_0", "10_A", "36_a"]
    names = (out / "classes.txt").read_text().split()
    assert len(names) == 62 and names == sorted(names)  # sorted folder names are the label order too
    assert (names[0], names[9], names[10], names[35], names[36], names[61]) == ("00_0", "09_9", "10_A", "35_Z", "36_a",
                                                                              "61_z")  # fmt: skip
    with Image_open(out / "train" / "f0000_14" / "10_A" / "f0000_14_00000.png") as im:  # LEAF's polarity, row by row
        px = np.array(im)
        assert im.mode == "L" and im.size == (28, 28) and px[3, 5] == 0 and px[5, 3] == 255 and (px == 255).sum() == 783
    # the scripts: one client per writer, its own test set, LEAF's labels, 62 classes, FedBABU's 3convNet
    args, data, part = load("fedbabu", ["--dataset", "folder", "--data-dir", out, "--natural", "--model", "convnet3"],
                            monkeypatch)  # fmt: skip
    assert part.names == sorted(WRITERS) and args.client_test and data.num_classes == 62
    assert data.x_train.shape[1:] == (1, 28, 28)
    for k, w in enumerate(sorted(WRITERS)):
        assert sorted(data.y_train[part.train[k]].tolist()) == sorted(WRITERS[w][0])
        assert sorted(data.y_test[part.test[k]].tolist()) == sorted(WRITERS[w][1])
    head = common.build_model("convnet3", data).head
    assert (head.in_features, head.out_features) == (576, 62)  # FedBABU App. A.1: Linear(576, 62)


def test_prepare_data_femnist_values_become_pixels_by_hand(tmp_path, capsys):
    x = femnist_x()
    x[0], x[1], x[28], x[783] = 0.0, 0.2, 0.5, 0.996  # round(255 x): 0, 51, 128 (127.5 to even), 254
    leaf_json(tmp_path / "train" / "a.json", {"w": {"x": [x], "y": [3]}})
    leaf_json(tmp_path / "test" / "a.json", {"w": {"x": [x], "y": [3]}})
    out = tmp_path / "out"
    assert (
        prepare(["femnist", "--train", tmp_path / "train", "--test", tmp_path / "test", "--out", out], capsys)[0] == 0
    )
    with Image_open(out / "train" / "w" / "03_3" / "w_00000.png") as im:
        px = np.array(im)
    assert (px[0, 0], px[0, 1], px[1, 0], px[27, 27], px[13, 13]) == (0, 51, 128, 254, 255)


def test_prepare_data_leaf_refusals(tmp_path, capsys):
    good = {"w": {"x": [femnist_x()], "y": [1]}}
    leaf_json(tmp_path / "test" / "a.json", good)
    cases = [
        ({"w": {"x": [femnist_x()], "y": [62]}}, "--train", "outside 0..61"),  # not FEMNIST's label
        ({"w": {"x": [femnist_x()], "y": [float("nan")]}}, "--train", "outside 0..61"),
        ({"w": {"x": [femnist_x(), femnist_x()], "y": [1]}}, "--train", "2 x but 1 y"),
        ({"w": {"x": ["000001.jpg"], "y": [1]}}, "--train", "784"),  # CelebA's JSON given to femnist
        ({"Ab": good["w"], "ab": good["w"]}, "--train", "case"),  # one folder on a case-insensitive file system
        ({"../w": good["w"]}, "--train", "folder name"),
    ]
    for users, flag, said in cases:
        leaf_json(tmp_path / "train" / "a.json", users)
        code, last = prepare(["femnist", "--train", tmp_path / "train", "--test", tmp_path / "test", "--out",
                              tmp_path / "out"], capsys)  # fmt: skip
        assert code == 2 and flag in last and said in last, (users.keys(), last)
    (tmp_path / "train" / "a.json").write_text("{not json")
    code, last = prepare(["femnist", "--train", tmp_path / "train", "--test", tmp_path / "test", "--out",
                          tmp_path / "out"], capsys)  # fmt: skip
    assert code == 2 and "--train" in last and "JSON" in last
    code, last = prepare(["femnist", "--train", tmp_path / "nothing", "--test", tmp_path / "test", "--out",
                          tmp_path / "out"], capsys)  # fmt: skip
    assert code == 2 and "--train" in last
    assert not (tmp_path / "out").exists()


def celeba_source(root):
    """LEAF's CelebA: x an image name of img_align_celeba/ (178x218 JPEGs), y 0.0 or 1.0 as LEAF writes them."""
    from PIL import Image

    os.makedirs(root / "img_align_celeba")
    users = {"2880": [(1, 1.0), (2, 0.0), (3, 1.0)], "7": [(4, 0.0), (5, 0.0)]}
    test = {"2880": [(6, 1.0)], "7": [(7, 1.0)]}
    for split, data in (("train", users), ("test", test)):
        for samples in data.values():
            for i, _ in samples:
                Image.new("RGB", (178, 218), (i, 100, 0)).save(root / "img_align_celeba" / f"{i:06d}.jpg", quality=95)
        users = {u: {"x": [f"{i:06d}.jpg" for i, _ in s], "y": [y for _, y in s]} for u, s in data.items()}
        leaf_json(root / split / f"all_data_niid_0_keep_5_{split}_9.json", users)
    return root


def test_prepare_data_celeba_from_leaf_json(tmp_path, monkeypatch, capsys):
    leaf, out = celeba_source(tmp_path / "leaf"), tmp_path / "celeba"
    flags = ["celeba", "--train", leaf / "train", "--test", leaf / "test", "--images", leaf / "img_align_celeba"]
    code, last = prepare([*flags, "--out", out, "--size", "16"], capsys)
    assert code == 0 and "7 images written" in last, last
    assert (out / "classes.txt").read_text().split() == ["0_not_smiling", "1_smiling"]
    assert sorted(os.listdir(out / "train" / "2880" / "1_smiling")) == ["000001.png", "000003.png"]  # CelebA's names
    with Image_open(out / "test" / "7" / "1_smiling" / "000007.png") as im:
        assert im.size == (16, 16) and abs(im.getpixel((8, 8))[1] - 100) <= 2
    args, data, part = load("anfr", ["--dataset", "folder", "--data-dir", out, "--natural", "--depth", "18"],
                            monkeypatch)  # fmt: skip
    assert part.names == ["2880", "7"] and data.num_classes == 2 and args.num_clients == 2
    assert counts(data.y_train, part.train, 2) == [[1, 2], [2, 0]] and counts(data.y_test, part.test, 2) == [
        [0, 1],
        [0, 1],
    ]
    os.remove(leaf / "img_align_celeba" / "000004.jpg")
    code, last = prepare([*flags, "--out", tmp_path / "again"], capsys)
    assert code == 2 and "--images" in last and "000004.jpg" in last and "1 of the 7" in last
    assert not (tmp_path / "again").exists()


def test_prepare_data_leaf_split_by_user_gives_one_shared_test_folder(tmp_path, monkeypatch, capsys):
    """LEAF's -t user puts whole users in test: the test images become one shared test/<class>/ (every class
    folder present, as the scripts need), which --natural --client-test deals by training labels."""
    leaf_json(tmp_path / "train" / "a.json", {"u1": {"x": [femnist_x()] * 3, "y": [0, 1, 1]},
                                              "u2": {"x": [femnist_x()] * 2, "y": [0, 0]}})  # fmt: skip
    leaf_json(tmp_path / "test" / "a.json", {"u3": {"x": [femnist_x()] * 2, "y": [1, 0]}})
    out = tmp_path / "out"
    code, last = prepare(["femnist", "--train", tmp_path / "train", "--test", tmp_path / "test", "--out", out], capsys)
    assert code == 0 and "shared test/<class>/" in last, last
    assert len(os.listdir(out / "test")) == 62 and len(files_under(out / "test")) == 2
    args, data, part = load("fedavg", ["--dataset", "folder", "--data-dir", out, "--natural", "--model", "mlp"],
                            monkeypatch)  # fmt: skip
    assert args.num_clients == 2 and data.group_test is None and sorted(data.y_test.tolist()) == [0, 1]


# ---------------------------------------------------------------------------------------------------- classes.txt
def test_classes_file_sets_the_label_order_and_the_number_of_classes(tmp_path, monkeypatch, capsys):
    """classes.txt (written by prepare_data.py) lists the class folders in label order: labels follow it, not the
    sorted names, and a listed class without images still counts; a folder it does not list is refused."""
    root = natural_folder(tmp_path / "nat")
    (tmp_path / "nat" / "classes.txt").write_text("cat\nant\nbee\nzebra\n")
    args, data, part = load("fedavg", ["--dataset", "folder", "--data-dir", root, "--natural"], monkeypatch)
    assert data.classes == ["cat", "ant", "bee", "zebra"] and data.num_classes == 4
    assert counts(data.y_train, part.train, 4) == [[0, 5, 3, 0], [6, 0, 4, 0], [2, 2, 2, 0]]  # NATURAL, reordered
    flat = write_images(tmp_path / "flat", {"train/x": 2, "train/y": 1, "test/x": 1, "test/y": 1})
    (tmp_path / "flat" / "classes.txt").write_text("y\nw\nx\n")  # w: no folder at all
    args, data, part = load("fedavg", ["--dataset", "folder", "--data-dir", flat, "--iid", "--num-clients", "1"],
                            monkeypatch)  # fmt: skip
    assert (
        data.num_classes == 3 and sorted(data.y_train.tolist()) == [0, 2, 2] and sorted(data.y_test.tolist()) == [0, 2]
    )
    (tmp_path / "nat" / "classes.txt").write_text("ant\nbee\n")
    code, last = parse("fedavg", ["--dataset", "folder", "--data-dir", root, "--natural"], monkeypatch, capsys)
    assert code == 2 and "--data-dir" in last and "classes.txt" in last and "cat" in last

"""Clients and domains from image folders (--natural, --clients-per-domain, --disjoint-classes), Tiny-ImageNet's
own layout, the per-client spread and balanced accuracy every script logs, and anfr.py's focal loss. Every
folder is built here with tiny PIL images; expected numbers are counted or computed by hand."""

import argparse
import math
import os
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import common
from helpers import mapped_from, metrics, prepare, run_batches

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
    """<script>'s steps before training (parse_args, load_data, make_partition); returns (args, data, partition),
    or (exit code, last stderr line) on a refusal."""
    return prepare(script, ["--device", "cpu", *argv], monkeypatch, capsys)


def load(script, argv, monkeypatch):
    args, data, partition = parse(script, argv, monkeypatch)
    return args, data, partition


def counts(labels, parts, c):
    return [np.bincount(labels[p].numpy(), minlength=c).tolist() for p in parts]


# ---------------------------------------------------------------------------------------------------- natural
def test_natural_partition_is_the_folders_with_their_own_test_sets(tmp_path, monkeypatch):
    root = natural_folder(tmp_path / "nat")
    args, data, part = load("fedavg", ["--dataset", "folder", "--data-dir", root, "--natural"], monkeypatch)
    assert len(part.train) == 3 and len(part.test) == 3  # test/<client>/: per-client test sets without --client-test
    assert args.num_clients is None and not args.client_test  # the partition decides: args stay as parsed
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
    assert len(part.train) == 12 and part.names == [d for d in PACS for _ in range(3)]
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
        parts = common.split_disjoint(labels, n, c, None, np.full(n, 1 / n), np.random.default_rng(0))
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
    (["--clients-per-domain", "2", "--split2"], "pacs", "--split2"),  # split-2 has 5 clients, in each domain too
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
    d = common.tinyimagenet_dataset(argparse.Namespace(data_dir=root))
    x_tr, y_tr, x_te, y_te = d["x_train"], d["y_train"], d["x_test"], d["y_test"]
    assert x_tr.shape == (6, 3, 64, 64) and x_te.shape == (4, 3, 64, 64)
    assert sorted(y_tr.tolist()) == [0, 0, 1, 1, 2, 2]  # n01, n02, n03 in sorted order, not wnids.txt's
    assert y_te.tolist() == [1, 2, 0, 1]  # val_0..val_3 by their annotation, whatever the file's row order
    [(gray, label)] = [(x, y) for x, y in zip(x_tr, y_tr) if int(x[1, 0, 0]) > 100]  # the others' green is 9
    assert label == 1  # n02_0.JPEG, grayscale: three equal channels
    assert torch.equal(gray[0], gray[1]) and torch.equal(gray[1], gray[2]) and abs(int(gray[0, 0, 0]) - 200) <= 2


def test_a_torchvision_cifar10_download_is_read_offline_channel_first(tmp_path, monkeypatch):
    """The README's offline route for CIFAR-10: a copy of torchvision's cifar-10-batches-py/ is read with no attempt to
    download, each image channel first as the format stores it (an image's 3072 bytes: the R, G, B planes, row by
    row), the five training batches in order. Made here, so torchvision's md5 check is told the files are whole."""
    import pickle

    import torchvision.datasets.cifar as cifar

    folder = tmp_path / "data" / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng, stored = np.random.default_rng(0), {}
    for name, n in [*((f"data_batch_{i}", 2) for i in range(1, 6)), ("test_batch", 3)]:
        stored[name] = rng.integers(0, 256, (n, 3072), dtype=np.uint8), rng.integers(0, 10, n).tolist()
        (folder / name).write_bytes(pickle.dumps({"data": stored[name][0], "labels": stored[name][1]}))
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": [f"class{k}" for k in range(10)]}))
    monkeypatch.setattr(cifar, "check_integrity", lambda path, md5=None: os.path.isfile(path))
    monkeypatch.setattr(cifar, "download_and_extract_archive", lambda *a, **k: pytest.fail("it tried to download"))
    d = common.DATASETS["cifar10"](argparse.Namespace(dataset="cifar10", data_dir=str(tmp_path / "data")))
    train = [stored[f"data_batch_{i}"] for i in range(1, 6)]
    assert d["x_train"].shape == (10, 3, 32, 32) and d["x_test"].shape == (3, 3, 32, 32)
    assert np.array_equal(d["x_train"].reshape(10, -1).numpy(), np.concatenate([x for x, _ in train]))
    assert np.array_equal(d["x_test"].reshape(3, -1).numpy(), stored["test_batch"][0])
    assert d["y_train"].tolist() == sum((y for _, y in train), []) and d["y_test"].tolist() == stored["test_batch"][1]

    # Cached: read again from the cache, memory-mapped, without torchvision; a changed file is read anew.
    cache = tmp_path / "data" / ".cleanfl-cache-cifar10.pt"
    monkeypatch.setattr(cifar.CIFAR10, "__init__", lambda *a, **k: pytest.fail("it read torchvision's files"))
    again = common.DATASETS["cifar10"](argparse.Namespace(dataset="cifar10", data_dir=str(tmp_path / "data")))
    assert all(torch.equal(again[k], d[k]) for k in d)
    assert mapped_from(again["x_train"], cache)
    stored["test_batch"][1][0] = (stored["test_batch"][1][0] + 1) % 10
    test_batch = {"data": stored["test_batch"][0], "labels": stored["test_batch"][1]}
    (folder / "test_batch").write_bytes(pickle.dumps(test_batch))
    with pytest.raises(pytest.fail.Exception, match="torchvision's files"):
        common.DATASETS["cifar10"](argparse.Namespace(dataset="cifar10", data_dir=str(tmp_path / "data")))


def test_tiny_imagenet_without_its_layout_is_refused(tmp_path, monkeypatch, capsys):
    root = tiny_imagenet(tmp_path / "t")
    os.remove(os.path.join(root, "val", "val_annotations.txt"))
    code, last = parse("fedavg", ["--dataset", "tinyimagenet", "--data-dir", root, "--natural"], monkeypatch, capsys)
    assert code == 2 and "--natural" in last  # its folders are classes, not clients
    code, last = parse("fedavg", ["--dataset", "tinyimagenet", "--data-dir", root], monkeypatch, capsys)
    assert code == 2 and "--data-dir" in last and "val_annotations.txt" in last


def test_tiny_imagenet_names_the_file_each_fault_is_in(tmp_path):
    """A class folder without images/ is train/'s fault; a class or an image the annotations name but lack, theirs."""
    args = argparse.Namespace(dataset="tinyimagenet")
    root = tiny_imagenet(tmp_path / "a")
    os.rename(os.path.join(root, "train", "n01", "images"), os.path.join(root, "train", "n01", "pictures"))
    with pytest.raises(common.BadInput, match=r"/train has class folders without images/: \['n01'\]"):
        common.tinyimagenet_dataset(argparse.Namespace(**vars(args), data_dir=root))
    root = tiny_imagenet(tmp_path / "b")
    shutil.rmtree(os.path.join(root, "train", "n03"))
    with pytest.raises(common.BadInput, match=r"val_annotations.txt has classes without a train/ folder: \['n03'\]"):
        common.tinyimagenet_dataset(argparse.Namespace(**vars(args), data_dir=root))
    root = tiny_imagenet(tmp_path / "c")
    os.remove(os.path.join(root, "val", "images", "val_1.JPEG"))
    with pytest.raises(common.BadInput, match=r"val_annotations.txt has images not in val/images/: \['val_1.JPEG'\]"):
        common.tinyimagenet_dataset(argparse.Namespace(**vars(args), data_dir=root))


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

    def forward(xb):
        return F.one_hot(xb.round().long().view(-1), num_classes).float()

    return data, forward


def test_balanced_accuracy_by_hand():
    # class 0: 2 of 3 right, class 1: 1 of 1, class 2: 1 of 2; class 3 is predicted once but never a target
    y, pred = [0, 0, 0, 1, 2, 2], [0, 3, 0, 1, 0, 2]
    data, forward = fixed_predictions(y, pred, 4)
    acc, loss, bacc = common.evaluate(forward, data.x_test, data.y_test, data, batch_size=4, balanced=True)
    assert acc == pytest.approx(4 / 6) and bacc == pytest.approx((2 / 3 + 1 + 1 / 2) / 3)  # 13/18
    # one-hot logits: -log softmax is log(e + 3) - 1 for the predicted class and log(e + 3) for another
    assert loss == pytest.approx((4 * (math.log(math.e + 3) - 1) + 2 * math.log(math.e + 3)) / 6)  # over both batches
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
    plain = common.eval_metrics(forward, data, tests, lists=False)  # without balanced, without lists
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
    assert parse("anfr", ["--dataset", "synthetic"], monkeypatch)[0].focal_weights == "local"  # the main tables' (A.1)
    pooled = ["--dataset", "synthetic", "--loss", "focal", "--focal-weights", "pooled"]
    assert parse("anfr", pooled, monkeypatch)[0].focal_weights == "pooled"
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

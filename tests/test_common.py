"""common.py: partitions, models, batches, folder datasets."""

import argparse
import json
import os

import numpy as np
import pytest
import torch

import common
from common import MODELS, Data, build_model, client_batches, make_partition, prepare_batch
from helpers import mapped_from

NUM_CLASSES = 10


def fake_data(n_train=2000, n_test=500, classes=NUM_CLASSES, seed=0):
    g = torch.Generator().manual_seed(seed)
    y_tr = torch.arange(n_train) % classes  # balanced classes
    y_te = torch.arange(n_test) % classes
    x_tr = torch.randint(0, 256, (n_train, 3, 8, 8), dtype=torch.uint8, generator=g)
    x_te = torch.randint(0, 256, (n_test, 3, 8, 8), dtype=torch.uint8, generator=g)
    return Data(
        x_tr,
        y_tr[torch.randperm(n_train, generator=g)],
        x_te,
        y_te,
        classes,
        torch.full((1, 3, 1, 1), 0.5),
        torch.full((1, 3, 1, 1), 0.25),
    )


def part_args(**kw):
    base = dict(
        iid=False,
        shards=None,
        classes_per_client=None,
        alpha=None,
        split2=False,
        quantity="equal",
        client_test=False,
        num_clients=20,
        data_seed=0,
    )
    return argparse.Namespace(**{**base, **kw})


SCHEMES = [
    dict(iid=True),
    dict(shards=2),
    dict(shards=5),
    dict(classes_per_client=1, num_clients=10),
    dict(classes_per_client=3),
    dict(alpha=0.1),
    dict(alpha=100.0),
    dict(split2=True, num_clients=5),
    dict(iid=True, quantity="powerlaw"),
    dict(shards=2, quantity="powerlaw"),
    dict(classes_per_client=2, quantity="powerlaw"),
    dict(alpha=0.5, quantity="powerlaw"),
]


def classes_of(data, part):
    return set(data.y_train[part].tolist())


@pytest.mark.parametrize("kw", SCHEMES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_partition_is_disjoint_and_complete(kw):
    data = fake_data()
    p = make_partition(part_args(**kw), data)
    allidx = torch.cat(p.train)
    assert len(p.train) == part_args(**kw).num_clients
    assert len(allidx) == len(set(allidx.tolist())), "a sample was given to two clients"
    assert sorted(allidx.tolist()) == list(range(len(data.y_train))), "some sample was lost"
    assert all(len(t) > 0 for t in p.train)


def test_partition_same_data_seed_same_split_other_seed_differs():
    data = fake_data()
    for kw in SCHEMES:
        a = make_partition(part_args(**kw, data_seed=3), data).train
        b = make_partition(part_args(**kw, data_seed=3), data).train
        c = make_partition(part_args(**kw, data_seed=4), data).train
        assert all(torch.equal(x, y) for x, y in zip(a, b)), kw
        assert not all(torch.equal(x, y) for x, y in zip(a, c)), kw


def test_iid_sizes_equal():
    p = make_partition(part_args(iid=True, num_clients=7), fake_data())
    sizes = [len(t) for t in p.train]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("s", [1, 2, 3, 5])
def test_shards_sizes_and_class_limit(s):
    data = fake_data()
    p = make_partition(part_args(shards=s), data)
    shard = len(data.y_train) / (20 * s)  # shards of |D|/(N*S) samples, floor or ceil so none is dropped
    assert all(s * int(shard) <= len(t) <= s * int(np.ceil(shard)) for t in p.train)
    # shards never straddle classes when the shard size divides the class size (200): s = 1, 2, 5
    limit = s if 200 % shard == 0 else 2 * s
    assert all(len(classes_of(data, t)) <= limit for t in p.train)
    most = max(len(classes_of(data, t)) for t in p.train)
    assert most > s if limit == 2 * s else most == s  # straddling shards give some client more than s classes
    if s == 1:  # 2000 samples / 20 shards of 100, classes of 200: one class per shard
        assert all(len(classes_of(data, t)) == 1 for t in p.train)


def test_classes_per_client_one_class_each_and_even_holders():
    data = fake_data()
    p = make_partition(part_args(classes_per_client=1, num_clients=10), data)
    held = [classes_of(data, t) for t in p.train]
    assert all(len(h) == 1 for h in held)
    assert sorted(c for h in held for c in h) == list(range(10)), "every client a different class"
    p = make_partition(part_args(classes_per_client=3, num_clients=20), data)
    held = [classes_of(data, t) for t in p.train]
    assert all(len(h) == 3 for h in held)
    holders = np.bincount([c for h in held for c in h], minlength=10)
    assert set(holders.tolist()) == {6}, "20*3/10 = 6 holders per class"
    for cls in range(10):  # a class is split evenly among its holders (200 / 6 -> 33 or 34)
        counts = [int((data.y_train[t] == cls).sum()) for t in p.train if cls in classes_of(data, t)]
        assert max(counts) - min(counts) <= 1


def test_split2_classes_and_even_split():
    data = fake_data()
    p = make_partition(part_args(split2=True, num_clients=5), data)
    for t, want in zip(p.train, [[0, 1, 2, 3], [2, 3, 4, 5], [4, 5, 6, 7], [6, 7, 8, 9], [8, 9, 0, 1]]):
        assert classes_of(data, t) == set(want)
        assert {int((data.y_train[t] == c).sum()) for c in want} == {100}  # 200 per class, 2 holders


def test_dirichlet_skew_depends_on_alpha():
    data = fake_data()

    def mean_classes(alpha):
        p = make_partition(part_args(alpha=alpha, num_clients=10), data)
        return np.mean([len(classes_of(data, t)) for t in p.train])

    assert mean_classes(0.05) < 5 < mean_classes(100.0)


def test_dirichlet_gives_up_with_clear_error():
    data = fake_data(n_train=60)
    with pytest.raises(common.BadInput, match="--alpha"):
        make_partition(part_args(alpha=0.001, num_clients=30), data)


def test_powerlaw_sizes_are_unbalanced():
    data = fake_data()
    for kw in [dict(iid=True), dict(shards=2), dict(alpha=1.0)]:
        sizes = sorted(len(t) for t in make_partition(part_args(**kw, quantity="powerlaw"), data).train)
        assert sizes[-1] > 4 * sizes[len(sizes) // 2], (kw, sizes)


def test_client_test_sets_follow_client_labels():
    data = fake_data()
    p = make_partition(part_args(shards=2, client_test=True), data)
    allidx = torch.cat(p.test)
    assert len(allidx) == len(set(allidx.tolist())), "client test sets overlap"
    for tr, te in zip(p.train, p.test):
        assert set(data.y_test[te].tolist()) <= classes_of(data, tr)
        share_tr = torch.bincount(data.y_train[tr], minlength=10) / len(tr)
        share_te = torch.bincount(data.y_test[te], minlength=10) / len(te)
        assert (share_tr - share_te).abs().max() < 0.1


def test_partition_does_not_touch_global_rng():
    torch.manual_seed(0)
    np.random.seed(0)
    before = torch.rand(1), np.random.rand()
    torch.manual_seed(0)
    np.random.seed(0)
    make_partition(part_args(alpha=0.5), fake_data())
    assert (torch.rand(1), np.random.rand()) == before


# ------------------------------------------------------------------ models
@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("channels", [1, 3])
def test_model_shapes(name, channels):
    torch.manual_seed(0)
    data = Data(
        torch.zeros(4, channels, 32, 32, dtype=torch.uint8), torch.zeros(4, dtype=torch.long), None, None, 7, None, None
    )
    model = build_model(name, data).eval()
    assert isinstance(model.head, torch.nn.Linear) and model.head.out_features == 7
    x = torch.randn(2, channels, 32, 32)
    feats = model.body(x)
    assert feats.shape == (2, model.head.in_features)
    assert model(x).shape == (2, 7)


def test_cnn_matches_mcmahan_size():
    data = Data(torch.zeros(1, 1, 28, 28, dtype=torch.uint8), None, None, None, 10, None, None)
    n = sum(p.numel() for p in build_model("cnn", data).parameters())
    assert n == 1_663_370  # McMahan et al. 2017: "a total of 1,663,370 parameters" (MNIST CNN)


def test_resnet18_cifar_parameter_count():
    data = Data(torch.zeros(1, 3, 32, 32, dtype=torch.uint8), None, None, None, 10, None, None)
    n = sum(p.numel() for p in build_model("resnet18", data).parameters())
    assert n == 11_173_962  # the standard CIFAR ResNet-18 (kuangliu/pytorch-cifar)


@pytest.mark.parametrize("depth", [18, 26])
def test_resnet_builds_one_kind_of_block(depth):
    """ResNetBody builds every block in one placement of the norm: conv-norm-ReLU, FedLN's norm after the
    activation, NF; basic blocks (2 convs, 3x3) at depth 18, bottlenecks (3 convs, 1x1-3x3-1x1) at 26; NF blocks have
    no activation norm, the others one norm a conv."""
    kinds = [
        ({"norm": "gn"}, "conv-norm-relu"),
        ({"norm": "ln", "norm_after_act": True}, "norm-after-act"),
        ({"norm": "nf", "attention": "se"}, "nf"),
        ({"norm": "none"}, "conv-norm-relu"),
    ]
    convs = 2 if depth == 18 else 3
    for options, placement in kinds:
        model = common.resnet(3, 10, 16, depth=depth, width=4, **options)
        assert {(b.placement, b.depth) for b in model.body.stages} == {(placement, convs)}, options
        kernels = [getattr(model.body.stages[0], f"conv{i}").kernel_size[0] for i in range(1, convs + 1)]
        assert kernels == ([3, 3] if depth == 18 else [1, 3, 1])
        assert hasattr(model.body.stages[0], "n1") == (placement != "nf")
        assert model(torch.randn(2, 3, 16, 16)).shape == (2, 10)
    with pytest.raises(ValueError, match="'nf' has no activation norm"):
        common.resnet(3, 10, 16, depth=depth, width=4, norm="nf", norm_after_act=True)


# ------------------------------------------------------------------ batches
def test_client_batches_epochs_cover_each_sample_once_per_epoch():
    torch.manual_seed(0)
    idx = torch.arange(100, 153)
    batches = list(client_batches(idx, 10, epochs=2))
    assert [len(b) for b in batches] == [10] * 5 + [3] + [10] * 5 + [3]
    assert sorted(torch.cat(batches[:6]).tolist()) == idx.tolist()
    assert sorted(torch.cat(batches[6:]).tolist()) == idx.tolist()


def test_client_batches_steps_and_no_lone_sample():
    idx = torch.arange(21)
    assert [len(b) for b in client_batches(idx, 10, steps=5)] == [10, 10, 10, 10, 10]  # 21 -> 10, 10 (lone 1 skipped)
    assert len(list(client_batches(torch.arange(3), 8, steps=4))) == 4


def test_load_data_normalizes_by_the_training_splits_channel_mean_and_std(monkeypatch):
    """data.mean and data.std: per channel over the training images' pixels in [0, 1] (the test split left out), the
    std unbiased (torch's), floored at one grey level where a channel is constant; checked in float64 by numpy."""
    g = torch.Generator().manual_seed(0)
    x_train = torch.randint(0, 256, (5, 3, 2, 3), dtype=torch.uint8, generator=g)
    x_train[:, 2] = 7  # a constant channel: std 0 -> 1/255
    x_test = torch.full((4, 3, 2, 3), 255, dtype=torch.uint8)  # never counted

    def reader(args):
        return {
            "x_train": x_train,
            "y_train": torch.arange(5) % 2,
            "x_test": x_test,
            "y_test": torch.zeros(4),
        }

    monkeypatch.setitem(common.DATASETS, "handmade", reader)
    data = common.load_data(argparse.Namespace(dataset="handmade", data_dir=".", device="cpu", data_seed=0))
    pixels = x_train.numpy().astype(np.float64).transpose(1, 0, 2, 3).reshape(3, -1) / 255  # [C, N * H * W]
    assert data.mean.shape == data.std.shape == (1, 3, 1, 1)
    assert np.allclose(data.mean.flatten().numpy(), pixels.mean(1), rtol=1e-6, atol=0)
    assert np.allclose(data.std.flatten().numpy(), [*pixels.std(1, ddof=1)[:2], 1 / 255], rtol=1e-6, atol=0)


def test_channel_stats_sum_chunks_exactly_as_float64_does_at_once():
    """Chunk by chunk (2 images here, 3 chunks) the stats are numpy's float64 ones over all pixels, rounded to float32;
    a chunk left out, a biased std, or stats over the wrong axis each fail it."""
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (5, 3, 4, 2), dtype=torch.uint8, generator=g)
    mean, std = common.channel_stats(x, chunk=2)
    pixels = x.numpy().astype(np.float64).transpose(1, 0, 2, 3).reshape(3, -1) / 255
    assert mean.dtype == std.dtype == torch.float32 and mean.shape == std.shape == (1, 3, 1, 1)
    assert mean.flatten().tolist() == pixels.mean(1).astype(np.float32).tolist()
    assert std.flatten().tolist() == pixels.std(1, ddof=1).astype(np.float32).tolist()


def test_prepare_batch_normalizes_and_augments():
    data = fake_data()
    x = data.x_train[:64]
    plain = prepare_batch(x, data)
    assert torch.allclose(plain, (x.float() / 255 - 0.5) / 0.25)
    torch.manual_seed(0)
    flipped = prepare_batch(x, data, "flip")
    same = [torch.equal(flipped[i], plain[i]) for i in range(64)]
    mirrored = [torch.equal(flipped[i], plain[i].flip(2)) for i in range(64)]
    assert all(s or m for s, m in zip(same, mirrored)) and 10 < sum(mirrored) < 54
    cropped = prepare_batch(x, data, "crop-flip")
    assert cropped.shape == plain.shape
    zero = (0 - 0.5) / 0.25  # zero padding appears at the borders of shifted crops
    assert (cropped == zero).any() and not (plain == zero).all()


def test_random_crop_is_a_shift_of_the_padded_image():
    torch.manual_seed(1)
    x = torch.arange(2 * 1 * 6 * 6, dtype=torch.float).reshape(2, 1, 6, 6) + 1
    out = common.random_crop(x, padding=2)
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    for b in range(2):
        assert any(torch.equal(out[b], padded[b, :, i : i + 6, j : j + 6]) for i in range(5) for j in range(5))


def test_crop_resize_equals_torchvisions_resized_crop():
    """Up- and downsampling of random boxes, against torchvision's resized_crop without antialiasing."""
    tvf = pytest.importorskip("torchvision.transforms.v2.functional")
    torch.manual_seed(0)
    x = torch.rand(40, 3, 32, 24)
    top, left, bh, bw = common.rrc_boxes(40, 32, 24, (0.05, 1.0), (3 / 4, 4 / 3), "cpu")
    assert ((top >= 0) & (left >= 0) & (top + bh <= 32) & (left + bw <= 24) & (bh > 0) & (bw > 0)).all()
    for size in (224, 32, 9):
        ours = common.crop_resize(x, top, left, bh, bw, size)
        want = torch.stack(
            [
                tvf.resized_crop(x[i], int(top[i]), int(left[i]), int(bh[i]), int(bw[i]), [size, size], antialias=False)
                for i in range(40)
            ]
        )
        assert (ours - want).abs().max() < 1e-5, size


def test_rrc_boxes_are_drawn_as_torchvisions():
    """The same distribution as torchvision's RandomResizedCrop.get_params (an independent sampler): mean area
    fraction, mean log aspect ratio and mean size of the boxes on a 32x32 image with scale (0.05, 1)."""
    transforms = pytest.importorskip("torchvision.transforms")
    torch.manual_seed(0)
    n, img = 20000, torch.zeros(3, 32, 32)
    ref = torch.tensor([transforms.RandomResizedCrop.get_params(img, [0.05, 1.0], [3 / 4, 4 / 3]) for _ in range(n)])
    top, left, bh, bw = common.rrc_boxes(n, 32, 32, (0.05, 1.0), (3 / 4, 4 / 3), "cpu")
    ours = torch.stack([top, left, bh, bw], 1)

    def area(b):
        return float((b[:, 2] * b[:, 3]).double().mean() / 1024)

    def log_ratio(b):
        return float((b[:, 3].double() / b[:, 2]).log().mean())

    assert area(ours) == pytest.approx(area(ref), abs=0.01)  # 0.47 both
    assert log_ratio(ours) == pytest.approx(log_ratio(ref), abs=0.01)
    assert torch.allclose(ours.double().mean(0), ref.double().mean(0), atol=0.2)  # top, left, height, width


def test_rrc_falls_back_to_the_central_crop_and_flips_only_with_rrc_flip():
    data = fake_data()
    x = data.x_train[:32]
    torch.manual_seed(0)
    top, left, bh, bw = common.rrc_boxes(4, 8, 20, (2.0, 3.0), (3 / 4, 4 / 3), "cpu")  # no box can hold 2x the area
    assert top.tolist() == [0] * 4 and bh.tolist() == [8] * 4 and bw.tolist() == [11] * 4 and left.tolist() == [4] * 4
    whole = common.prepare_batch(x, data, "rrc", size=16, crop_scale=(2.0, 3.0))  # a square: the whole image
    resized = torch.nn.functional.interpolate(x.float() / 255, size=16, mode="bilinear", align_corners=False)
    assert torch.allclose(whole, (resized - 0.5) / 0.25, atol=1e-5)
    torch.manual_seed(0)
    flipped = common.prepare_batch(x, data, "rrc-flip", size=16, crop_scale=(2.0, 3.0))
    mirrored = [
        torch.allclose(flipped[i], whole[i].flip(2)) and not torch.allclose(flipped[i], whole[i]) for i in range(32)
    ]
    assert 4 < sum(mirrored) < 28
    assert common.prepare_batch(x, data, "rrc", crop_scale=(0.05, 1.0)).shape == (32, 3, 8, 8)  # default: stored size


def test_val_frac_holds_out_part_of_each_clients_data():
    data = fake_data()
    plain = make_partition(part_args(shards=2), data)
    held = make_partition(part_args(shards=2, val_frac=0.15), data)
    assert plain.val is None and len(held.val) == len(held.train) == 20
    for train, val, whole in zip(held.train, held.val, plain.train):
        assert len(val) == int(0.15 * len(whole) + 0.5) and not set(val.tolist()) & set(train.tolist())
        assert sorted(val.tolist() + train.tolist()) == whole.tolist()  # the partition itself is unchanged
    tiny = make_partition(part_args(iid=True, num_clients=2000, val_frac=0.9), data)  # one sample each
    assert all(len(t) == 1 for t in tiny.train) and all(len(v) == 0 for v in tiny.val)


def test_eval_metrics_scores_the_held_out_samples():
    data = fake_data()
    p = make_partition(part_args(shards=2, val_frac=0.2), data)

    def always_3(x):
        return torch.nn.functional.one_hot(torch.full((len(x),), 3), NUM_CLASSES).float()

    row = common.eval_metrics(always_3, data, val=p.val)
    held = torch.cat(p.val)
    assert row["val_acc"] == pytest.approx(float((data.y_train[held] == 3).float().mean()))
    assert row["test_acc"] == pytest.approx(0.1) and "val_acc" not in common.eval_metrics(always_3, data)


def run_args(out, **kw):
    """What common.Run reads of a script's args."""
    base = dict(out=str(out), resume=None, rounds=4, save_model=False, device="cpu", seed=0, script="fedavg",
                eval_every=1, checkpoint_every=None, stop_after=None, dataset="synthetic", overwrite=False,
                threads=1)  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


def test_summary_reports_the_test_accuracy_at_the_first_best_validation_round(tmp_path):
    args = run_args(tmp_path / "r")
    os.makedirs(args.out)
    run = common.Run(args)
    run.start(build_model("mlp", fake_data()), make_partition(part_args(shards=2), fake_data()), fake_data(), "mlp")
    rows = [(1, 0.5, 0.6), (2, 0.7, 0.4), (3, 0.7, 0.9), (4, 0.6, 0.8)]
    for rnd in run.bar(range(4)):  # checkpoints after rounds 1-4 (each evaluates)
        run.log({"round": rnd + 1, "test_acc": rows[rnd][2], "val_acc": rows[rnd][1], "train_loss": 1.0})
        run.save(run.snapshot(rnd), "checkpoint.pt")
    got = run.finish()
    assert (got["test_acc"], got["test_acc_at_best_val"], got["best_val_round"], got["best_val_acc"]) == (
        0.8,
        0.4,
        2,
        0.7,
    )
    again = common.Run(run_args(args.out, resume=args.out))  # a resumed run finds the same best row in metrics.jsonl
    again.start(build_model("mlp", fake_data()), make_partition(part_args(shards=2), fake_data()), fake_data(), "mlp")
    assert again.checkpoint["round"] == 4 and again.finish()["best_val_round"] == 2


def test_a_resumed_runs_clock_goes_on_from_its_checkpoint(tmp_path):
    """elapsed_s and wall_time_s count the time before a stop: a resumed run's clock starts at the checkpoint's."""
    args, data = run_args(tmp_path / "r", rounds=2), fake_data()
    os.makedirs(args.out)
    run = common.Run(args)
    run.start(build_model("mlp", data), make_partition(part_args(shards=2), data), data, "mlp")
    for rnd in run.bar(range(1)):
        run.log({"round": rnd + 1, "test_acc": 0.1, "train_loss": 1.0})
        run.save({**run.snapshot(rnd), "elapsed_s": 1000.0}, "checkpoint.pt")  # as if round 1 had taken 1000 s
    assert run.elapsed < 60
    again = common.Run(run_args(args.out, resume=args.out, rounds=2))
    again.start(build_model("mlp", data), make_partition(part_args(shards=2), data), data, "mlp")
    for rnd in again.bar(range(1, 2)):
        again.log({"round": rnd + 1, "test_acc": 0.2, "train_loss": 1.0})
    again.finish()
    wall = json.loads((tmp_path / "r" / "summary.json").read_text())["wall_time_s"]
    assert 1000 < again.rows[-1]["elapsed_s"] < 1060 and 1000 < wall < 1060


def test_metrics_are_appended_and_a_resume_cuts_them_back_to_its_checkpoint(tmp_path):
    """One row appended per evaluation (the earlier rows' bytes untouched); a resume drops the rows after the
    checkpoint's round and a last line a crash cut short."""
    args = run_args(tmp_path / "r", rounds=5, checkpoint_every=2)
    os.makedirs(args.out)
    run = common.Run(args)
    data = fake_data()
    run.start(build_model("mlp", data), make_partition(part_args(shards=2), data), data, "mlp")
    path = tmp_path / "r" / "metrics.jsonl"
    sizes = []
    for rnd in run.bar(range(5)):
        if rnd < 3:
            run.log({"round": rnd + 1, "test_acc": 0.1 * rnd, "train_loss": 1.0})
            sizes.append(path.stat().st_size)
        if (rnd + 1) % 2 == 0 or rnd == 4:  # after rounds 2 and 4, and the last
            run.save(run.snapshot(rnd), "checkpoint.pt")
    assert [len(line) for line in path.read_text().splitlines()] == [sizes[0] - 1, sizes[1] - sizes[0] - 1,
                                                                    sizes[2] - sizes[1] - 1]  # fmt: skip
    first = path.read_bytes()[: sizes[0]]
    torch.save({**torch.load(tmp_path / "r" / "checkpoint.pt", weights_only=False), "round": 2},
               tmp_path / "r" / "checkpoint.pt")  # fmt: skip
    with open(path, "a") as f:
        f.write('{"round": 4, "test_a')  # a crash in the middle of a line
    again = common.Run(run_args(args.out, resume=args.out, rounds=5, checkpoint_every=2))
    again.start(build_model("mlp", data), make_partition(part_args(shards=2), data), data, "mlp")
    assert again.checkpoint["round"] == 2
    assert [row["round"] for row in map(json.loads, path.read_text().splitlines())] == [1, 2]
    assert path.read_bytes()[: sizes[0]] == first and again.rows[-1]["round"] == 2


# ------------------------------------------------------------------ folder datasets
def write_folder(root, per_class=3, classes=("cat", "ant", "bee"), size=8):
    from PIL import Image

    g = np.random.default_rng(0)
    for split in ("train", "test"):
        for c in classes:
            os.makedirs(os.path.join(root, split, c))
            for i in range(per_class):
                pixels = g.integers(0, 256, (size, size, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(os.path.join(root, split, c, f"{i}.png"))


def read_folder(root):
    """common.image_folder on a flat folder: (x_train, y_train, x_test, y_test)."""
    d = common.image_folder(argparse.Namespace(data_dir=str(root), natural=False, clients_per_domain=None))
    return d["x_train"], d["y_train"], d["x_test"], d["y_test"]


def test_folder_dataset_reads_sorted_classes_and_caches(tmp_path):
    from PIL import Image

    write_folder(tmp_path / "ds")
    x_tr, y_tr, x_te, y_te = read_folder(tmp_path / "ds")
    assert x_tr.shape == (9, 3, 8, 8) and x_tr.dtype == torch.uint8
    assert sorted(y_tr.tolist()) == [0, 0, 0, 1, 1, 1, 2, 2, 2] != y_tr.tolist()  # ant, bee, cat; mixed (unsort)
    for split, xs, ys in (("train", x_tr, y_tr), ("test", x_te, y_te)):  # each file read, with its class's label
        for label, c in enumerate(("ant", "bee", "cat")):
            for i in range(3):
                png = torch.from_numpy(np.array(Image.open(tmp_path / "ds" / split / c / f"{i}.png"))).permute(2, 0, 1)
                assert [int(y) for x, y in zip(xs, ys) if torch.equal(x, png)] == [label]
    assert os.path.isfile(tmp_path / "ds" / ".cleanfl-cache.pt")
    again = read_folder(tmp_path / "ds")
    assert all(torch.equal(a, b) for a, b in zip(again, (x_tr, y_tr, x_te, y_te)))
    # Read memory-mapped from the cache, the first time too: the processes of a machine share one copy.
    for tensors in (x_tr, again[0]):
        assert mapped_from(tensors, tmp_path / "ds" / ".cleanfl-cache.pt")


def test_folder_dataset_read_only_caches_in_home(tmp_path, monkeypatch):
    write_folder(tmp_path / "ds")
    real_save = common.atomic_save

    def save(obj, path):  # the data folder refuses writes, as a read-only mount would
        if path.startswith(str(tmp_path / "ds")):
            raise PermissionError(path)
        real_save(obj, path)

    monkeypatch.setattr(common, "atomic_save", save)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    read_folder(tmp_path / "ds")
    assert not os.path.exists(tmp_path / "ds" / ".cleanfl-cache.pt")
    assert list((tmp_path / "home" / ".cache" / "cleanfl").glob("*-cleanfl-cache.pt"))


# ------------------------------------------------------------------ torchvision datasets (no download)
class FakeTorchvision:
    """Stand-ins with the storage layout of each torchvision dataset class (checked offline)."""

    @staticmethod
    def make(kind):
        class DS:
            def __init__(self, root, train=True, split=None, download=False):
                g = np.random.default_rng(0)  # the same pixels every time: the test rebuilds them
                n = 4 if split == "test" or (split != "train" and not train) else 6  # EMNIST: split="byclass"
                if kind == "hwc":  # CIFAR-10/100: numpy [N, H, W, 3], list targets
                    self.data, self.targets = g.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8), list(range(n))
                elif kind == "nchw":  # SVHN: numpy [N, 3, H, W], numpy labels
                    self.data, self.labels = g.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8), np.arange(n)
                else:  # MNIST family: uint8 tensor [N, H, W]
                    self.data = (
                        torch.arange(n * 28 * 28, dtype=torch.int64).reshape(n, 28, 28).remainder(251).to(torch.uint8)
                    )
                    self.targets = torch.arange(n)

        return DS


@pytest.mark.parametrize(
    "name,cls,kind",
    [
        ("cifar10", "CIFAR10", "hwc"),
        ("cifar100", "CIFAR100", "hwc"),
        ("svhn", "SVHN", "nchw"),
        ("mnist", "MNIST", "hw"),
        ("fashionmnist", "FashionMNIST", "hw"),
        ("emnist", "EMNIST", "hw"),
    ],
)
def test_torchvision_datasets_become_uint8_nchw(name, cls, kind, monkeypatch, tmp_path):
    import torchvision.datasets as tvd

    fake = FakeTorchvision.make(kind)
    monkeypatch.setattr(tvd, cls, fake)
    d = common.torchvision_dataset(argparse.Namespace(dataset=name, data_dir=str(tmp_path)))
    x_tr, y_tr, x_te = d["x_train"], d["y_train"], d["x_test"]
    assert d["y_test"].tolist() == list(range(4))
    channels, size = (3, 32) if kind != "hw" else (1, 28)
    assert x_tr.shape == (6, channels, size, size) and x_te.shape == (4, channels, size, size)
    assert x_tr.dtype == torch.uint8 and y_tr.dtype == torch.long and y_tr.tolist() == list(range(6))
    raw = fake("r", train=True, split="train").data
    raw = torch.as_tensor(raw)
    if kind == "hwc":
        assert torch.equal(x_tr[2, :, 5, 7], raw[2, 5, 7, :])
    elif kind == "nchw":
        assert torch.equal(x_tr, raw)
    elif name == "emnist":  # EMNIST is stored transposed: the loader turns it upright
        assert torch.equal(x_tr[1, 0], raw[1].T)
    else:
        assert torch.equal(x_tr[1, 0], raw[1])


def test_lr_decays_at_fractions_of_the_run():
    args = argparse.Namespace(lr=0.1, lr_decay=0.1, lr_decay_at=[0.5, 0.75], rounds=320)
    lrs = [common.lr_at(r, args) for r in (0, 159, 160, 239, 240, 319)]
    assert lrs == pytest.approx([0.1, 0.1, 0.01, 0.01, 0.001, 0.001])
    args.rounds = 5  # half of 5 rounds is 2.5: the decay starts with the 4th round (index 3)
    assert [common.lr_at(r, args) for r in range(5)] == pytest.approx([0.1, 0.1, 0.1, 0.01, 0.001])
    args.rounds = 1  # a one-round run never reaches "half of the run"
    assert common.lr_at(0, args) == 0.1


def test_cpu_device_name_says_cores_processes_and_threads(tmp_path):
    os.makedirs(tmp_path / "r")
    common.Run(run_args(tmp_path / "r")).write_summary({})
    name = json.load(open(tmp_path / "r" / "summary.json"))["device"]
    assert f"{os.cpu_count()} cores, {torch.get_num_threads()} threads)" in name  # one process of them


# ------------------------------------------------------------------ storage order
def test_load_data_mixes_a_class_sorted_folder_with_one_fixed_permutation(tmp_path):
    from PIL import Image

    write_folder(tmp_path / "ds", per_class=20)  # stored class by class; read here file by file, in that order

    def stored(split):  # (images, labels) in the folder's order: class by class, file by file
        files = [
            (tmp_path / "ds" / split / c / f"{i}.png", y)
            for y, c in enumerate(("ant", "bee", "cat"))
            for i in range(20)
        ]
        images = [torch.from_numpy(np.array(Image.open(f))).permute(2, 0, 1) for f, _ in files]
        return torch.stack(images), torch.tensor([y for _, y in files])

    (x_tr, y_tr), (x_te, y_te) = stored("train"), stored("test")
    loads = [
        common.load_data(
            argparse.Namespace(
                dataset="folder",
                data_dir=str(tmp_path / "ds"),
                device="cpu",
                seed=s,
                data_seed=s,
                natural=False,
                clients_per_domain=None,
            )  # fmt: skip
        )
        for s in (0, 7)
    ]
    for d in loads:
        assert d.y_test.tolist() != sorted(d.y_test.tolist()) and d.y_train.tolist() != sorted(d.y_train.tolist())
        assert set(d.y_test[:15].tolist()) == {0, 1, 2}  # the first quarter already mixes all three classes
        for x, y, x0, y0 in ((d.x_train, d.y_train, x_tr, y_tr), (d.x_test, d.y_test, x_te, y_te)):
            # the same (image, label) pairs, only reordered
            def key(xs, ys):
                return sorted((bytes(xi.flatten().tolist()), int(yi)) for xi, yi in zip(xs, ys))

            assert key(x, y) == key(x0, y0)
    # the permutation is fixed: it depends neither on --seed nor on --data-seed
    assert torch.equal(loads[0].y_test, loads[1].y_test) and torch.equal(loads[0].x_train, loads[1].x_train)


def test_unsort_keeps_a_mixed_order_as_it_is():
    x, y = torch.arange(6).view(6, 1), torch.tensor([2, 0, 1, 2, 0, 1])
    assert common.unsort(x, y)[1] is y
    xs, ys, _ = common.unsort(x, torch.tensor([0, 0, 1, 1, 2, 2]))
    assert ys.tolist() != [0, 0, 1, 1, 2, 2] and torch.equal(torch.tensor([0, 0, 1, 1, 2, 2])[xs.view(-1)], ys)


def test_cnn6_narrow_is_cnn6_at_a_quarter_width_with_running_statistics():
    import fednnnn  # its models

    model = fednnnn.cnn6(3, 10, 32, width=8)
    assert MODELS["cnn6-narrow"](3, 10, 32).state_dict().keys() == model.state_dict().keys()
    convs = [m.out_channels for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert convs == [8, 8, 16, 16, 32, 32]
    bns = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert len(bns) == 6 and all(b.track_running_stats for b in bns)  # FedNNNN averages these into its eval model
    # by hand: convs 224 + 584 + 1,168 + 2,320 + 4,640 + 9,248, BN 2 x 112, fc 512*382+382, 382*192+192, head 1,930
    assert sum(p.numel() for p in model.parameters()) == 18_184 + 224 + 195_966 + 73_536 + 1_930
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_folder_without_images_or_with_mixed_sizes_is_bad_input(tmp_path, capsys):
    """The data section raises BadInput and prints nothing: saying it in one line is the run helpers' part."""
    from PIL import Image

    write_folder(tmp_path / "empty", per_class=0)
    with pytest.raises(common.BadInput, match="hold no images"):
        read_folder(tmp_path / "empty")
    write_folder(tmp_path / "mixed")
    Image.new("RGB", (4, 4)).save(tmp_path / "mixed" / "train" / "ant" / "odd.png")
    with pytest.raises(common.BadInput, match="differ in size"):
        read_folder(tmp_path / "mixed")
    assert capsys.readouterr().err == ""


def test_unreadable_images_are_skipped_with_one_line(tmp_path, capsys):
    """A 0-byte and a corrupt .jpg among the images: skipped and counted in one line, the rest read."""
    write_folder(tmp_path / "ds")
    (tmp_path / "ds" / "train" / "ant" / "empty.jpg").write_bytes(b"")
    (tmp_path / "ds" / "train" / "bee" / "broken.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    x_tr, y_tr, _, _ = read_folder(tmp_path / "ds")
    assert sorted(y_tr.tolist()) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "skipped 2 unreadable image(s)" in err[0]


# ------------------------------------------------------------------ partition helpers, by hand
def assert_disjoint_cover(parts, expected):
    """parts are disjoint and together hold exactly the indices `expected`."""
    allidx = np.concatenate([np.asarray(p, dtype=int) for p in parts])
    assert len(allidx) == len(set(allidx.tolist())), "a sample was given to two clients"
    assert sorted(allidx.tolist()) == sorted(np.asarray(expected).tolist()), "a sample was lost or invented"


def test_cut_sizes_by_hand():
    pieces = common._cut(np.arange(10), [1, 1, 1])  # bounds round(10/3, 20/3) = 3, 7
    assert [p.tolist() for p in pieces] == [[0, 1, 2], [3, 4, 5, 6], [7, 8, 9]]  # consecutive, in order
    assert [len(p) for p in common._cut(np.arange(8), [0.5, 0.25, 0.25])] == [4, 2, 2]
    assert [len(p) for p in common._cut(np.arange(8), [2, 6])] == [2, 6]  # shares need not sum to 1
    assert [len(p) for p in common._cut(np.arange(6), [1, 0, 2])] == [2, 0, 4]  # a zero share: an empty piece


def test_split_iid_sizes_follow_weights():
    parts = common.split_iid(np.zeros(100), 3, 1, None, np.array([0.5, 0.3, 0.2]), np.random.default_rng(0))
    assert [len(p) for p in parts] == [50, 30, 20]
    assert_disjoint_cover(parts, range(100))
    assert parts[0].tolist() != list(range(50)), "a random permutation, not the storage order"


def test_split_shards_deals_whole_equal_shards():
    """60 samples of 5 classes, n = 3 clients, s = 2: 6 shards of 10 consecutive samples of the label-sorted
    order; each client holds exactly two of them."""
    labels = np.random.default_rng(1).permutation(np.repeat(np.arange(5), 12))
    order = np.argsort(labels, kind="stable")
    parts = common.split_shards(labels, 3, 5, 2, np.full(3, 1 / 3), np.random.default_rng(0))
    assert_disjoint_cover(parts, range(60))
    rank = np.empty(60, dtype=int)
    rank[order] = np.arange(60)  # position of each sample in the sorted order
    dealt = []
    for p in parts:
        shards = sorted(set((rank[p] // 10).tolist()))
        assert len(p) == 20 and len(shards) == 2, "two whole shards of 10 each"
        assert sorted(rank[p].tolist()) == [r for j in shards for r in range(10 * j, 10 * j + 10)]
        dealt += shards
    assert sorted(dealt) == list(range(6))
    assert [sorted(set((rank[p] // 10).tolist())) for p in parts] != [[0, 1], [2, 3], [4, 5]], (
        "shards are dealt at random"
    )


def test_split_shards_powerlaw_counts_by_hand():
    """Weights 0.5, 0.3, 0.2 over 6 shards: 1 + floor(w * (6 - 3)) = 2, 1, 1 shards, the largest client takes the
    remaining 2: 4, 1, 1 shards of 10 samples."""
    labels = np.repeat(np.arange(3), 20)
    parts = common.split_shards(labels, 3, 3, 2, np.array([0.5, 0.3, 0.2]), np.random.default_rng(0))
    assert [len(p) for p in parts] == [40, 10, 10]
    assert_disjoint_cover(parts, range(60))
    parts = common.split_shards(labels, 3, 3, 2, np.array([0.2, 0.5, 0.3]), np.random.default_rng(0))
    assert [len(p) for p in parts] == [10, 40, 10]  # the remainder goes to the largest weight, wherever it is
    # 4 clients, s = 5: 20 shards of 10; 1 + floor(w * 16) = 7, 5, 4, 2 (sum 18), the largest takes 2 more
    labels = np.repeat(np.arange(5), 40)
    parts = common.split_shards(labels, 4, 5, 5, np.array([0.4, 0.3, 0.2, 0.1]), np.random.default_rng(0))
    assert [len(p) for p in parts] == [90, 50, 40, 20]
    assert_disjoint_cover(parts, range(200))
    (one,) = common.split_shards(labels, 1, 5, 3, np.array([1.0]), np.random.default_rng(0))  # a single client
    assert sorted(one.tolist()) == list(range(200))


def test_split_classes_round_robin_by_hand():
    """4 classes of 6 samples. per_client = 2, n = 4: client k holds classes start[2k % 4], start[(2k + 1) % 4],
    so clients 0 and 2 share one pair, 1 and 3 the other, and each class is halved: 3 + 3."""
    labels = np.repeat(np.arange(4), 6)
    parts = common.split_classes(labels, 4, 4, 2, np.full(4, 0.25), np.random.default_rng(0))
    assert_disjoint_cover(parts, range(24))
    held = [sorted(set(labels[p].tolist())) for p in parts]
    assert held[0] == held[2] and held[1] == held[3] and sorted(held[0] + held[1]) == [0, 1, 2, 3]
    assert all(np.bincount(labels[p], minlength=4).tolist().count(3) == 2 for p in parts)
    # per_client = 3: every class has 3 holders and is cut 2 + 2 + 2
    parts = common.split_classes(labels, 4, 4, 3, np.full(4, 0.25), np.random.default_rng(0))
    assert_disjoint_cover(parts, range(24))
    assert all(sorted(np.bincount(labels[p], minlength=4).tolist()) == [0, 2, 2, 2] for p in parts)
    # unequal weights: class shared by clients 0 and 2 with weights 0.1 and 0.3 -> 6 * 0.25 = 1.5 -> 2 and 4
    weights = np.array([0.1, 0.2, 0.3, 0.4])
    parts = common.split_classes(labels, 4, 4, 2, weights, np.random.default_rng(0))
    assert [len(p) for p in parts] == [4, 4, 8, 8]  # the other class: 0.2 : 0.4 -> 2 and 4 as well


def test_split_classes_skips_unheld_classes_and_keeps_the_rest():
    labels = np.repeat(np.arange(4), 6)
    (part,) = common.split_classes(labels, 1, 4, 2, np.array([1.0]), np.random.default_rng(0))
    assert sorted(set(labels[part].tolist())) == [0, 2]  # class 1 (unheld) comes before class 2 (held)
    assert_disjoint_cover([part], np.flatnonzero((labels == 0) | (labels == 2)))
    holders = [[1, 3], [1], []]  # split-2 style explicit holders: class 1 cut 3 + 3, class 3 all to client 0
    parts = common.split_classes(labels, 3, 4, None, np.full(3, 1 / 3), np.random.default_rng(0), holders=holders)
    assert [np.bincount(labels[p], minlength=4).tolist() for p in parts] == [[0, 3, 0, 6], [0, 3, 0, 0], [0, 0, 0, 0]]
    assert parts[2].dtype.kind == "i"  # a client without classes gets an empty index array


def test_split_dirichlet_minimum_size_and_alpha():
    labels = np.repeat(np.arange(5), 40)  # 200 samples, 5 classes
    for seed in range(3):
        parts = common.split_dirichlet(labels, 8, 5, 0.3, np.full(8, 1 / 8), np.random.default_rng(seed))
        assert_disjoint_cover(parts, range(200))
        assert min(len(p) for p in parts) >= 10  # min(min_size = 10, 200 // 8 = 25)
    # alpha -> infinity: every class is split evenly (40 / 4 = 10 each); times weights when they differ
    even = common.split_dirichlet(labels, 4, 5, 1e6, np.full(4, 0.25), np.random.default_rng(0))
    assert all(np.bincount(labels[p], minlength=5).tolist() == [10] * 5 for p in even)
    skew = common.split_dirichlet(labels, 4, 5, 1e6, np.array([0.4, 0.3, 0.2, 0.1]), np.random.default_rng(0))
    assert [len(p) for p in skew] == [80, 60, 40, 20]
    # alpha -> 0: each class goes (almost) entirely to one client
    parts = common.split_dirichlet(labels, 4, 5, 1e-3, np.full(4, 0.25), np.random.default_rng(0), min_size=0)
    counts = np.stack([np.bincount(labels[p], minlength=5) for p in parts])
    assert (counts.max(0) >= 39).all()


def test_split_dirichlet_redraws_until_every_client_has_min_size():
    """The first draw of seed 0 leaves some client below 10 samples; the default min_size=10 must redraw."""
    labels = np.repeat(np.arange(5), 40)
    first = common.split_dirichlet(labels, 8, 5, 0.3, np.full(8, 1 / 8), np.random.default_rng(0), min_size=0)
    assert min(len(p) for p in first) < 10
    parts = common.split_dirichlet(labels, 8, 5, 0.3, np.full(8, 1 / 8), np.random.default_rng(0))
    assert min(len(p) for p in parts) >= 10
    exactly = common.split_dirichlet(labels, 8, 5, 0.3, np.full(8, 1 / 8), np.random.default_rng(9))
    assert min(len(p) for p in exactly) == 10  # a client with exactly min_size samples is accepted
    # 61 samples over 8 clients: the bar is 61 // 8 = 7 (at most 7 fit in every client), not 7.6
    small = np.repeat(np.arange(5), 13)[:61]
    parts = common.split_dirichlet(small, 8, 5, 100.0, np.full(8, 1 / 8), np.random.default_rng(0))
    assert min(len(p) for p in parts) == 7
    with pytest.raises(ValueError, match=r"^after 100 draws of Dir\(0.0001\) a client had fewer than 10 samples"):
        common.split_dirichlet(labels, 8, 5, 1e-4, np.full(8, 1 / 8), np.random.default_rng(0))


def test_split_dirichlet_skips_empty_classes():
    labels = np.array([0] * 30 + [2] * 30 + [3] * 1)  # class 1 absent, class 3 has one sample
    parts = common.split_dirichlet(labels, 3, 4, 1.0, np.full(3, 1 / 3), np.random.default_rng(0), min_size=0)
    assert_disjoint_cover(parts, range(61))


def test_client_test_split_by_hand():
    """Client 0 trains on classes 1 (x3) and 2 (x1), client 1 on class 2 (x3). Test: class 0 x2 -> held by nobody,
    dropped; class 1 x4 -> all to client 0; class 2 x8 -> 1 : 3 -> 2 and 6."""
    train = np.array([1, 1, 1, 2, 2, 2, 2])
    parts = [np.array([0, 1, 2, 3]), np.array([4, 5, 6])]
    test = np.random.default_rng(3).permutation(np.array([0] * 2 + [1] * 4 + [2] * 8))
    out = common.client_test_split(test, train, parts, 3, np.random.default_rng(0))
    assert [np.bincount(test[t], minlength=3).tolist() for t in out] == [[0, 4, 2], [0, 0, 6]]
    assert_disjoint_cover(out, np.flatnonzero(test != 0))
    none = common.client_test_split(test, train, [np.array([], dtype=int), np.arange(7)], 3, np.random.default_rng(0))
    assert none[0].dtype.kind == "i" and len(test[none[0]]) == 0  # an empty index array, still usable as one
    assert np.bincount(test[none[1]], minlength=3).tolist() == [0, 4, 8]


def test_partition_json_counts_labels_by_hand(tmp_path):
    """partition.json (Run.start): the scheme and each client's label counts of its train, test and validation
    indices, by hand; class names where the data has them."""
    y = torch.tensor([2, 0, 2, 1, 2])
    data = Data(torch.zeros(5, 1, 2, 2, dtype=torch.uint8), y, None, torch.tensor([1, 1, 3, 0]), 4, None, None)
    t = torch.tensor
    part = common.Partition([t([0, 2, 4]), t([1, 3])], [t([0, 2]), t([1, 3])], "shards=2", val=[t([0]), t([1, 3])])
    args = run_args(tmp_path / "r", model="mlp")
    common.Run(args).start(build_model("mlp", data), part, data)
    info = json.loads((tmp_path / "r" / "partition.json").read_text())
    assert info == {"scheme": "shards=2", "train": [[0, 0, 3, 0], [1, 1, 0, 0]], "test": [[0, 1, 0, 1], [1, 1, 0, 0]],
                    "val": [[0, 0, 1, 0], [1, 1, 0, 0]]}  # fmt: skip


def test_sample_clients_count_order_and_range():
    rng = np.random.default_rng(0)
    assert len(common.sample_clients(rng, 100, 0.29)) == 29  # floor(29.000000000000004), not 28
    assert len(common.sample_clients(rng, 10, 0.25)) == 2  # floor(2.5)
    assert len(common.sample_clients(rng, 10, 0.05)) == 1  # at least one client
    assert common.sample_clients(rng, 4, 1.0) == [0, 1, 2, 3]
    draws = [common.sample_clients(rng, 20, 0.3) for _ in range(50)]
    assert all(d == sorted(set(d)) and len(d) == 6 and 0 <= d[0] and d[-1] < 20 for d in draws)
    assert len({tuple(d) for d in draws}) > 40 and {k for d in draws for k in d} == set(range(20))


def test_powerlaw_weights_follow_a_pareto_law():
    """w_k proportional to 1 + Lomax(1.5) = a Pareto with x_m = 1 and exponent a = 1.5, whose q-quantile is
    (1 - q)^(-1/a): median 2^(2/3) = 1.587, 90th percentile 10^(2/3) = 4.64 (relative to the smallest weight,
    which tends to x_m)."""
    w = common.powerlaw_weights(20000, np.random.default_rng(0))
    assert w.sum() == pytest.approx(1.0) and (w > 0).all()
    ratio = w / w.min()
    assert np.median(ratio) == pytest.approx(2 ** (2 / 3), abs=0.05)
    assert np.quantile(ratio, 0.9) == pytest.approx(10 ** (2 / 3), abs=0.25)


# ------------------------------------------------------------------ SCAFFOLD (Karimireddy et al. 2020, Alg. 1)
def test_local_step_sum_of_momentum():
    assert common.local_step_sum(3, 0.1) == pytest.approx(0.3)
    assert common.local_step_sum(1, 0.1, 0.9) == pytest.approx(0.1)  # one step: momentum changes nothing
    assert common.local_step_sum(2, 1.0, 0.5) == pytest.approx(2.5)  # lr g + lr (0.5 g + g)
    assert common.local_step_sum(3, 2.0, 0.5) == pytest.approx(2 * (1 + 1.5 + 1.75))
    assert common.local_step_sum(4, 0.5, 1.0) == pytest.approx(0.5 * (1 + 2 + 3 + 4))


def test_local_step_sum_matches_k_momentum_steps_on_a_constant_gradient():
    """K' eta is defined by: K steps of torch's heavy-ball SGD on a constant gradient g move w by -K' eta g."""
    g = torch.tensor([0.5, -2.0])
    for rho in (0.0, 0.5, 0.9, 1.0):  # 1.0: the limit K (K + 1) / 2
        for steps in (1, 2, 3, 7):
            w = torch.zeros(2, requires_grad=True)
            opt = torch.optim.SGD([w], lr=0.1, momentum=rho)
            for _ in range(steps):
                opt.zero_grad()
                (g * w).sum().backward()  # d/dw = g, whatever w is
                opt.step()
            assert torch.allclose(w.detach(), -common.local_step_sum(steps, 0.1, rho) * g, rtol=1e-5), (rho, steps)


def test_scaffold_round_by_hand_several_clients():
    """N = 3 clients, S = {0, 2} sampled, c != any c_k, two parameters of different shapes. Corrections c - c_k;
    option II c_k+ = c_k - c + (x - y_k) / (K eta_l) with K eta_l = 0.2; c+ = c + ((c_0+ - c_0) + (c_2+ - c_2)) / 3."""

    def t(w, b):
        return {"w": torch.tensor(w), "b": torch.tensor(b)}

    c, c_k = t([0.3, -0.1], [[0.5]]), [t([0.1, 0.2], [[0.0]]), t([-0.4, 0.5], [[1.0]]), t([0.0, -0.3], [[0.2]])]
    x, y = t([1.0, 2.0], [[0.5]]), {0: t([0.8, 2.2], [[0.3]]), 2: t([1.1, 1.6], [[0.5]])}
    corr = common.scaffold_correction(c, c_k[0])
    assert torch.allclose(corr["w"], torch.tensor([0.2, -0.3])) and torch.allclose(corr["b"], torch.tensor([[0.5]]))
    assert torch.allclose(common.scaffold_correction(c, c_k[2])["w"], torch.tensor([0.3, 0.2]))
    new = {k: common.scaffold_control(c_k[k], c, x, y[k], common.local_step_sum(4, 0.05)) for k in (0, 2)}
    assert torch.allclose(new[0]["w"], torch.tensor([0.8, -0.7]))  # (0.1 - 0.3 + 1.0, 0.2 + 0.1 - 1.0)
    assert torch.allclose(new[0]["b"], torch.tensor([[0.5]]))  # 0.0 - 0.5 + 0.2 / 0.2
    assert torch.allclose(new[2]["w"], torch.tensor([-0.8, 1.8]))  # (0.0 - 0.3 - 0.5, -0.3 + 0.1 + 2.0)
    delta_sum = {n: (new[0][n] - c_k[0][n]) + (new[2][n] - c_k[2][n]) for n in c}
    c_next = common.scaffold_server(c, delta_sum, num_clients=3)
    assert torch.allclose(c_next["w"], torch.tensor([0.3 - 0.1 / 3, -0.1 + 1.2 / 3]))  # divided by N = 3, not |S| = 2
    assert torch.allclose(c_next["b"], torch.tensor([[0.5 + (0.5 - 0.5) / 3]]))


def test_scaffold_three_clients_of_four_on_quadratics_by_hand():
    """One round on 1-d quadratics f_i(y) = (y - b_i)^2 / 2, N = 4 clients with different c_i (c = their mean,
    0.1), clients 0-2 sampled, K = 2 local steps at lr 0.5 from x = 0, every step y <- y - lr (g_i(y) + c - c_i):
      client 0: b = 1, c - c_0 = -0.1: y = 0 -> 0.55 -> 0.825
      client 1: b = 2, c - c_1 = +0.5: y = 0 -> 0.75 -> 1.125
      client 2: b = 6, c - c_2 = -0.4: y = 0 -> 3.2  -> 4.8
    c_i+ = c_i - c + (x - y_i) / (K lr) = the mean true gradient along the client's path: -0.725, -1.625, -4.4;
    c+ = c + sum_i (c_i+ - c_i) / N = 0.1 + (-0.925 - 1.225 - 4.9) / 4 = -1.6625 (= the mean of all four c_i)."""
    b, c_all = [1.0, 2.0, 6.0], [0.2, -0.4, 0.5, 0.1]

    def t(v):
        return {"y": torch.tensor([v])}

    c, x, delta_sum = t(0.1), t(0.0), t(0.0)
    for i, (want_y, want_c) in enumerate([(0.825, -0.725), (1.125, -1.625), (4.8, -4.4)]):
        corr = common.scaffold_correction(c, t(c_all[i]))["y"]
        assert corr.item() == pytest.approx([-0.1, 0.5, -0.4][i])
        y = x["y"].clone()
        for _ in range(2):
            y = y - 0.5 * ((y - b[i]) + corr)
        assert y.item() == pytest.approx(want_y)
        new = common.scaffold_control(t(c_all[i]), c, x, {"y": y}, common.local_step_sum(2, 0.5))
        assert new["y"].item() == pytest.approx(want_c)
        delta_sum = {"y": delta_sum["y"] + new["y"] - c_all[i]}
    assert common.scaffold_server(c, delta_sum, num_clients=4)["y"].item() == pytest.approx(-1.6625)


def quadratic_rounds(scaffold, rounds=100, steps=5, lr=0.1):
    """FedAvg / SCAFFOLD on f_k(y) = a_k/2 ||y - b_k||^2, 3 clients, all every round."""
    a, b = [1.0, 3.0, 0.5], torch.tensor([[1.0, 0.0], [0.0, 2.0], [-3.0, 1.0]], dtype=torch.float64)
    x, zero = torch.zeros(2, dtype=torch.float64), {"w": torch.zeros(2, dtype=torch.float64)}
    c, c_k = zero, [zero] * 3
    for _ in range(rounds):
        ys, delta_sum = [], {"w": torch.zeros(2, dtype=torch.float64)}
        for k in range(3):
            y = x.clone()
            corr = common.scaffold_correction(c, c_k[k])["w"] if scaffold else 0.0
            for _ in range(steps):
                y = y - lr * (a[k] * (y - b[k]) + corr)  # local_train: the correction added to the gradient
            ys.append(y)
            if scaffold:
                new = common.scaffold_control(c_k[k], c, {"w": x}, {"w": y}, common.local_step_sum(steps, lr))
                delta_sum["w"] += new["w"] - c_k[k]["w"]
                c_k[k] = new
        if scaffold:
            c = common.scaffold_server(c, delta_sum, 3)
        x = sum(ys) / 3
    return x, (torch.tensor(a, dtype=torch.float64)[:, None] * b).sum(0) / sum(a)  # x and x* = sum a_k b_k / sum a_k


def test_scaffold_reaches_the_optimum_of_heterogeneous_quadratics():
    """Closed form: the minimizer of sum_k f_k is x* = sum a_k b_k / sum a_k. SCAFFOLD's corrections remove the
    client drift and reach it; FedAvg with 5 local steps stops at a biased point (the test can tell them apart)."""
    x, x_star = quadratic_rounds(scaffold=True)
    assert torch.allclose(x, x_star, atol=1e-9)
    x_avg, _ = quadratic_rounds(scaffold=False)
    assert (x_avg - x_star).norm() > 0.05


# ------------------------------------------------------------------ clients' random streams
def test_each_client_gives_every_client_its_own_stream():
    """Client k's draws depend on (seed, round, k) only: not on the clients before it, not on the draws
    made before the loop; and the stream after the loop is the same whatever the clients were."""

    def draw(k):
        return {"r": torch.rand(3), "k": k}

    torch.manual_seed(123)
    first = {k: out["r"] for k, _, out in common.each_client([4, 1, 7], [0.2, 0.3, 0.5], draw, 5, 2)}
    after_first = torch.rand(2)
    torch.manual_seed(999)  # another state before the loop, another order, one client fewer
    second = {k: out["r"] for k, _, out in common.each_client([7, 4], [0.5, 0.5], draw, 5, 2)}
    after_second = torch.rand(2)
    assert torch.equal(first[7], second[7]) and torch.equal(first[4], second[4])
    assert torch.equal(after_first, after_second)
    assert not torch.equal(after_first, first[1][:2])  # the stream after the loop is no client's stream
    assert not torch.equal(first[4], first[1])  # distinct clients, distinct streams
    other_round = {k: out["r"] for k, _, out in common.each_client([4], [1.0], draw, 5, 3)}
    other_seed = {k: out["r"] for k, _, out in common.each_client([4], [1.0], draw, 6, 2)}
    assert not torch.equal(first[4], other_round[4]) and not torch.equal(first[4], other_seed[4])
    torch.manual_seed(common.client_seed(5, 2, 4))  # the documented seed
    assert torch.equal(torch.rand(3), first[4])


def test_each_client_yields_clients_weights_and_results_in_order():
    got = list(common.each_client([4, 1, 7], [0.2, 0.3, 0.5], lambda k: {"k": k * 10}, 0, 0))
    assert [(k, w, out["k"]) for k, w, out in got] == [(4, 0.2, 40), (1, 0.3, 10), (7, 0.5, 70)]


def test_result_layout_survives_mapping_its_leaves():
    """What _broadcast sends: every tensor of a client's result replaced (by its CPU copy) and put back, the layout
    (dicts, lists, tuples, plain numbers, None) kept; a _Sent pair is a leaf, not a tuple to walk into."""
    result = {
        "loss": torch.tensor(1.5),
        "steps": 3,
        "state": {"w": torch.ones(2, 2), "n": torch.tensor(4)},
        "opt": {"state": {0: {"step": torch.tensor(2.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        "pair": (torch.zeros(1), None),
    }
    seen = []
    sent = common._map_leaves(result, lambda t: seen.append(t) or common._Sent((t, "cpu")) if torch.is_tensor(t) else t)
    assert len(seen) == 5 and isinstance(sent["state"]["w"], common._Sent)
    back = common._map_leaves(sent, lambda v: v[0].clone() if isinstance(v, common._Sent) else v)
    assert back["steps"] == 3 and back["opt"]["param_groups"] == [{"lr": 0.1, "params": [0]}]
    assert back["pair"][1] is None and isinstance(back["pair"], tuple)
    assert torch.equal(back["state"]["w"], torch.ones(2, 2)) and back["state"]["n"].item() == 4
    assert back["opt"]["state"][0]["step"].item() == 2.0 and back["loss"].item() == 1.5
    assert common._json_safe({"a": [1.0, float("nan"), (float("inf"), 2)]}) == {"a": [1.0, None, (None, 2)]}


@pytest.mark.parametrize(
    "visible, local_world, rank, device, backend",
    [
        (4, 4, 2, "cuda:2", "nccl"),  # a GPU a rank: NCCL
        (1, 4, 3, "cuda:0", "gloo"),  # 4 ranks on one GPU (the torchrun speed lever): they share it, over gloo
        (2, 4, 3, "cuda:1", "gloo"),  # 4 ranks on 2 GPUs: rank i on GPU i mod 2
        (1, 1, 0, "cuda:0", "nccl"),  # one process per task (a scheduler's share of one GPU): NCCL
    ],
)
def test_torchrun_ranks_share_the_gpus_there_are_over_gloo(visible, local_world, rank, device, backend, monkeypatch):
    """A rank (Run) with fewer visible GPUs than local ranks goes on GPU rank mod visible and joins gloo, which
    (unlike NCCL) lets ranks share a device; with a GPU each it keeps NCCL."""
    joined = {}

    def join(backend, **kwargs):
        joined.update(backend=backend)
        raise InterruptedError  # joined: the rest of Run is other tests'

    env = {"WORLD_SIZE": str(max(local_world, 2)), "LOCAL_WORLD_SIZE": str(local_world), "LOCAL_RANK": str(rank)}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: joined.update(set_device=d))
    monkeypatch.setattr(common.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(common.dist, "init_process_group", join)
    monkeypatch.setattr(common.ctypes, "CDLL", lambda _: argparse.Namespace(prctl=lambda *a: None))  # (not pytest's)
    args = argparse.Namespace(device="cuda")
    with pytest.raises(InterruptedError):
        common.Run(args)
    assert (args.device, joined["set_device"], joined["backend"]) == (device, device, backend)


def test_a_convolutional_body_takes_its_images_channels_last_on_the_cpu():
    """Whether through the model or its body alone: a body with convolutions gets channels-last images on the CPU
    (the same values), a body without them the images as they come, and so does fedfn.py's VGG11, which trains
    slower channels-last; under torch.func's vmap the layout stays."""
    import fedfn  # noqa: F401  (registers vgg11)

    x = torch.randn(4, 3, 32, 32)
    for name, want in (
        ("cnn", torch.channels_last),
        ("pfl-cnn", torch.channels_last),
        ("mlp", torch.contiguous_format),
        ("vgg11-narrow", torch.contiguous_format),
    ):
        model = build_model(name, argparse.Namespace(in_channels=3, num_classes=10, image_size=32))
        seen = []

        def record(module, inputs):
            seen.append(inputs[0])

        next(model.body.children()).register_forward_pre_hook(record)
        model(x)
        model.body(x)
        assert [t.is_contiguous(memory_format=want) for t in seen] == [True, True], name
        assert all(torch.equal(t, x) for t in seen), name
    model = build_model("cnn", argparse.Namespace(in_channels=3, num_classes=10, image_size=32))
    batched = torch.func.vmap(lambda xi: model(xi[None])[0])(x)
    assert torch.allclose(batched, model(x), atol=1e-5)

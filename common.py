"""What CleanFL's scripts share, in reading order: data as tensors on the device, batches (augmentation on the
device) and evaluation, partitions, aggregation math (FedProx, SCAFFOLD), personalization, models; then one short
block of run helpers (flags, the run folder, checkpoints, Ctrl-C, torchrun), which is not federated learning.

A script keeps its own training loop: one script plus this file is all a reader copies. Datasets, partitions and
models are registered by name (@dataset, @partition, @register_model): a reader follows only the ones a run uses.

Bad input found while reading data or making partitions raises BadInput, whose message names the flag; the run
helpers turn it into one line and exit 2. Besides that, the federated-learning sections use four things of the run
block: rank_and_world (torchrun's rank and number of processes), together (the first process of a machine reads
the data, the others wait), atomic_save (the data caches are written whole or not at all) and progress (the bars).
"""

import argparse
import atexit
import contextlib
import ctypes
import datetime
import difflib
import fcntl
import functools
import glob
import hashlib
import importlib.util
import io
import itertools
import json
import math
import os
import pathlib
import platform
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

# Imported before any process group: its `group=WORLD` defaults bind now, to None.
import torch.distributed.nn.functional  # noqa: F401
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm


class BadInput(Exception):
    """Input the run cannot use, found while reading data or making partitions; the message names the flag."""


# ---- Data: every dataset becomes uint8 tensors [N, C, H, W] on the run's device ------------------------------------
@dataclass
class Data:
    x_train: torch.Tensor  # uint8 [N, C, H, W]
    y_train: torch.Tensor  # int64 [N]
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    # Per channel, in [0, 1] pixel units, from the training split: float [1, C, 1, 1].
    mean: torch.Tensor
    std: torch.Tensor
    # An image folder in groups (clients, domains): each sample's group, on the CPU. The test one is None when
    # test/ is one shared test/<class>/*.
    group_train: torch.Tensor = None
    group_test: torch.Tensor = None
    # The group names (sorted folder names) and an image folder's class names (sorted, or classes.txt's order).
    groups: list = None
    classes: list = None
    # The sizes, and hashes of the labels and pixels: --resume checks that the data is the run's.
    fingerprint: dict = None

    @property
    def in_channels(self):
        return self.x_train.shape[1]

    @property
    def image_size(self):
        return self.x_train.shape[2]


# --dataset NAME -> reader(args) -> {x_train, y_train, x_test, y_test: uint8, int64; extras}
DATASETS = {}


def dataset(*names):
    """Registers a reader under its --dataset names."""

    def register(reader):
        DATASETS.update(dict.fromkeys(names, reader))
        return reader

    return register


def load_data(args):
    """args.dataset as a Data on args.device. Under torchrun the first process of a machine reads (and caches) it
    first, then the others read it."""
    first = rank_and_world()[1] == 1 or int(os.environ["LOCAL_RANK"]) == 0
    d = together(functools.partial(DATASETS[args.dataset], args), first)
    if not first:
        d = DATASETS[args.dataset](args)
    x_tr, y_tr, x_te, y_te = d["x_train"], d["y_train"], d["x_test"], d["y_test"]
    # All the classes of classes.txt count, whether or not they have images.
    num_classes = max(int(max(y_tr.max(), y_te.max())) + 1, len(d.get("classes") or ()))
    mean, std = channel_stats(x_tr)
    fingerprint = {
        "training images": len(y_tr),
        "test images": len(y_te),
        "image shape": list(x_tr.shape[1:]),
        "classes": num_classes,
        "labels": digest(y_tr, y_te),
        "pixels": digest(x_tr, x_te),
    }
    return Data(
        x_tr.to(args.device),
        y_tr.to(args.device),
        x_te.to(args.device),
        y_te.to(args.device),
        num_classes,
        mean.to(args.device),
        std.to(args.device),
        d.get("group_train"),
        d.get("group_test"),
        d.get("groups"),
        d.get("classes"),
        fingerprint,
    )


def channel_stats(x, chunk=512):
    """Per-channel mean and std (unbiased) of uint8 images [N, C, H, W] in [0, 1] units, as float [1, C, 1, 1].
    The sums are of integers in float64, exact in any order, a chunk of images at a time: no float copy of the set.
    The std is floored at one grey level, since a constant channel's is 0."""
    total = torch.zeros(x.shape[1], dtype=torch.float64)
    squares = torch.zeros(x.shape[1], dtype=torch.float64)
    for part in x.split(chunk):
        part = part.double()
        total += part.sum((0, 2, 3))
        squares += part.square_().sum((0, 2, 3))
    n = x.numel() // x.shape[1]
    mean = total / n
    var = (squares - total * mean) / (n - 1)
    std = (var.clamp_min(0).sqrt() / 255).clamp_min(1 / 255)
    return (mean / 255).float().view(1, -1, 1, 1), std.float().view(1, -1, 1, 1)


def digest(*tensors):
    """A hash of the tensors' bytes: with the sizes, the fingerprint a resumed run is checked by."""
    h = hashlib.sha1()
    for t in tensors:
        h.update(t.contiguous().numpy())
    return h.hexdigest()[:16]


@dataset("synthetic")
def synthetic_dataset(args, n_train=3000, n_test=1000, num_classes=10, size=32):
    """Offline, seeded by --data-seed, learnable: a smooth random template per class plus pixel noise."""
    g = torch.Generator().manual_seed(args.data_seed + 12345)
    templates = torch.rand(num_classes, 3, 4, 4, generator=g)
    templates = F.interpolate(templates, size=size, mode="bilinear", align_corners=False)

    def draw(n):
        # n / num_classes images of each class, in random order.
        y = (torch.arange(n) % num_classes)[torch.randperm(n, generator=g)]
        brightness = 0.7 + 0.6 * torch.rand(n, 1, 1, 1, generator=g)
        x = templates[y] * brightness + 0.35 * torch.randn(n, 3, size, size, generator=g)
        return (x.clamp(0, 1) * 255).round().to(torch.uint8), y

    return dict(zip(("x_train", "y_train", "x_test", "y_test"), (*draw(n_train), *draw(n_test))))


# Where torchvision keeps each dataset's files in --data-dir: the cache is keyed on them.
TORCHVISION_FILES = {
    "mnist": "MNIST/raw/*",
    "fashionmnist": "FashionMNIST/raw/*",
    "emnist": "EMNIST/raw/*",
    "cifar10": "cifar-10-batches-py/*",
    "cifar100": "cifar-100-python/*",
    "svhn": "*_32x32.mat",
}


@dataset(*TORCHVISION_FILES)
def torchvision_dataset(args):
    """Downloaded once into --data-dir, read once, then cached in --data-dir/.cleanfl-cache-<name>.pt."""
    name, root = args.dataset, args.data_dir
    # Not torchvision's files: an image folder.
    if os.path.isdir(f"{root}/train") and _listing(f"{root}/train")[0]:
        raise BadInput(f"--dataset {name}: {root} holds train/<class>/ folders; read them with --dataset folder")

    def sources():
        return sorted(glob.glob(os.path.join(root, TORCHVISION_FILES[name])))

    read = functools.partial(read_torchvision, name, root)
    tensors = cached(root, f".cleanfl-cache-{name}.pt", name, sources, read)
    return dict(zip(("x_train", "y_train", "x_test", "y_test"), tensors))


def read_torchvision(name, root):
    """[x_train, y_train, x_test, y_test] of a torchvision dataset, downloaded into root if it is not there. A failed
    download is bad input; it removes the root it made."""
    import torchvision.datasets as tvd

    made = not os.path.exists(root)
    ctor = {"mnist": tvd.MNIST, "fashionmnist": tvd.FashionMNIST, "cifar10": tvd.CIFAR10, "cifar100": tvd.CIFAR100}
    out = []
    try:
        for split in ("train", "test"):
            if name == "svhn":
                ds = tvd.SVHN(root, split=split, download=True)
                x, y = torch.from_numpy(ds.data), torch.from_numpy(ds.labels)
            elif name == "emnist":
                ds = tvd.EMNIST(root, split="byclass", train=split == "train", download=True)
                # EMNIST is stored transposed.
                x, y = ds.data.transpose(1, 2).unsqueeze(1), ds.targets
            else:
                ds = ctor[name](root, train=split == "train", download=True)
                x, y = torch.as_tensor(ds.data), torch.as_tensor(ds.targets)
                if x.ndim == 3:
                    x = x.unsqueeze(1)
                else:
                    x = x.permute(0, 3, 1, 2)
            out += [x.contiguous(), y.long()]
    except (OSError, RuntimeError) as e:
        # Without internet, urllib's URLError is an OSError; MNIST's mirrors raise a RuntimeError.
        if made:
            shutil.rmtree(root, ignore_errors=True)
        why = " ".join(f"{type(e).__name__}: {e}".split())[:160]
        raise BadInput(
            f"--dataset: could not download or read {name} into --data-dir {root} ({why}); without internet, use "
            "--dataset folder --data-dir DIR with images in DIR/train/<class>/ and DIR/test/<class>/"
        )
    return out


IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".ppm", ".webp", ".tif", ".tiff")
# Optional: an image folder's class folder names in label order, one a line.
CLASSES_FILE = "classes.txt"


def _listing(path):
    """(sorted subfolders, sorted image files) of a folder."""
    names = sorted(os.listdir(path))
    dirs = [n for n in names if os.path.isdir(os.path.join(path, n))]
    return dirs, [n for n in names if n.lower().endswith(IMAGE_EXTENSIONS) and n not in dirs]


def read_text(path):
    """A text file's lines as UTF-8; anything else is bad input, naming the file."""
    try:
        return pathlib.Path(path).read_text(encoding="utf-8").splitlines()
    except (UnicodeDecodeError, OSError) as e:
        raise BadInput(f"--data-dir: cannot read {path} as UTF-8 text ({type(e).__name__})")


@dataset("folder")
def image_folder(args):
    """DIR/train/<class>/* and DIR/test/<class>/*; with --natural or --clients-per-domain in groups (clients or
    domains), DIR/train/<group>/<class>/* with test/ one folder per group or one shared test/<class>/*. A layout it
    cannot use is bad input, the folder named. A class's label is its place in the sorted class names, or in
    DIR/classes.txt (benchmarks/prepare_data.py's: a class keeps its label where a subset lacks it)."""
    root = args.data_dir
    grouped = bool(getattr(args, "natural", 0) or getattr(args, "clients_per_domain", 0))
    if grouped:
        layout = "DIR/train/<group>/<class>/*"
    else:
        layout = "DIR/train/<class>/*"
    train, test = os.path.join(root, "train"), os.path.join(root, "test")
    for split in (train, test):
        if not os.path.isdir(split):
            parent = os.path.dirname(os.path.abspath(root))
            hint = ""
            if os.path.isdir(f"{parent}/test"):
                hint = f"; {root} looks like one split: try --data-dir {parent}"
            raise BadInput(
                f"--data-dir: {split}/ is missing; an image folder is {layout} and the same under test/{hint}"
            )

    # Test class folders without images: their classes have no test images there (said in a line).
    empty_tests = []

    def classes(base, need=(), some=True):
        # {class: its image files} of base/<class>/*, each training class with an image.
        found = {c: _listing(os.path.join(base, c))[1] for c in _listing(base)[0]}
        empty = [c for c, f in found.items() if not f]
        missing = [c for c in need if c not in found]
        if empty and base.startswith(test):
            empty_tests.extend(os.path.join(base, c) for c in empty)
        elif empty:
            nested = not grouped and all(_listing(os.path.join(base, c))[0] for c in empty)
            hint = ""
            if nested:
                hint = "; train/<group>/<class>/* needs --natural or --clients-per-domain"
            raise BadInput(f"--data-dir: the class folder(s) {', '.join(empty[:3])} of {base} hold no images{hint}")
        if missing or (some and not found):
            named = ", ".join(missing[:3]) or "<class>"
            raise BadInput(f"--data-dir: {base} lacks the class folder(s) {named} ({layout})")
        return found

    groups = [""]
    if grouped:
        groups = _listing(train)[0]
        for g in groups:
            if _listing(f"{train}/{g}")[1] or not _listing(f"{train}/{g}")[0]:
                raise BadInput(
                    f"--data-dir: {train}/{g} is not a folder of class folders ({layout}; a flat train/<class>/* "
                    "needs neither --natural nor --clients-per-domain)"
                )
    if not groups:
        raise BadInput(f"--data-dir: {train} has no group folders; clients or domains from folders need {layout}")
    train_found = {g: classes(os.path.join(train, g)) for g in groups}
    seen = sorted({c for found in train_found.values() for c in found})
    names = class_order(root, seen)
    per_group = grouped and set(_listing(test)[0]) == set(groups)
    if per_group:
        test_found = {g: classes(f"{test}/{g}", some=False) for g in groups}
    else:
        test_found = {"": classes(test, seen)}
    extra = [f"{g}/{c}".lstrip("/") for g, found in test_found.items() for c in found if c not in names]
    if extra:
        raise BadInput(f"--data-dir: {test} has class folder(s) {', '.join(extra[:3])} of no class in {train}")
    if empty_tests:
        print(f"note: {len(empty_tests)} test class folder(s) hold no images, e.g. {empty_tests[0]}", file=sys.stderr)
    label = {c: i for i, c in enumerate(names)}
    files = {}
    for split, base, by_group in (("train", train, train_found), ("test", test, test_found)):
        files[split] = [
            (label[c], i, os.path.join(base, g, c, f))
            for i, (g, found) in enumerate(by_group.items())
            for c in sorted(found, key=label.get)
            for f in found[c]
        ]
    if grouped:
        layout_name = "groups"
    else:
        layout_name = "flat"
    x_tr, y_tr, x_te, y_te, g_tr, g_te = decode_cached(root, files, layout_name)
    out = {"x_train": x_tr, "y_train": y_tr, "x_test": x_te, "y_test": y_te, "classes": names}
    if not grouped:
        return out
    if not per_group:
        g_te = None
    return {**out, "group_train": g_tr, "group_test": g_te, "groups": groups}


def class_order(root, found):
    """Class names in label order: root/classes.txt's (a class folder it lacks is bad input), else the sorted ones."""
    path = os.path.join(root, CLASSES_FILE)
    if not os.path.isfile(path):
        return sorted(found)
    names = [line.strip() for line in read_text(path) if line.strip()]
    unlisted = sorted(set(found) - set(names))
    if len(set(names)) != len(names):
        what = "lists a class twice"
    else:
        what = f"lacks the class folder(s) {unlisted[:3]}"
    if unlisted or len(set(names)) != len(names):
        raise BadInput(
            f"--data-dir: {path} {what}; it lists the class folders in label order, one a line (or delete it)"
        )
    return names


@dataset("tinyimagenet")
def tinyimagenet_dataset(args):
    """Tiny-ImageNet as distributed (tiny-imagenet-200/): train/<wnid>/images/*.JPEG, 500 a class, and val/images/
    labelled by val/val_annotations.txt, 50 a class (the test split here; test/ has no labels). Labels: sorted wnids."""
    root = args.data_dir
    train, val, notes = f"{root}/train", f"{root}/val", f"{root}/val/val_annotations.txt"
    if not os.path.isdir(train) or not _listing(train)[0] or not os.path.isfile(notes):
        raise BadInput(f"--data-dir: Tiny-ImageNet needs {train}/<wnid>/images/*.JPEG, {val}/images/ and {notes}")
    wnids = _listing(train)[0]
    label = {w: i for i, w in enumerate(wnids)}
    rows = sorted(line.split("\t")[:2] for line in read_text(notes) if line.strip())
    problems = (
        (train, "class folders without images/", [w for w in wnids if not os.path.isdir(f"{train}/{w}/images")]),
        (notes, "classes without a train/ folder", sorted({w for _, w in rows} - set(label))),
        (notes, "images not in val/images/", [name for name, _ in rows if not os.path.isfile(f"{val}/images/{name}")]),
    )
    for where, what, bad in problems:
        if bad:
            raise BadInput(f"--data-dir: {where} has {what}: {bad[:3]}")
    train_files = [(label[w], 0, f"{train}/{w}/images/{f}") for w in wnids for f in _listing(f"{train}/{w}/images")[1]]
    files = {"train": train_files, "test": [(label[w], 0, f"{val}/images/{name}") for name, w in rows]}
    return dict(zip(("x_train", "y_train", "x_test", "y_test"), decode_cached(root, files, "tinyimagenet")))


def cached(root, name, layout, sources, build):
    """build()'s list of tensors, cached as root/name (or in ~/.cache/cleanfl where root is read-only) and read back
    memory-mapped, so that the processes of one machine share one copy. The cache is keyed by the layout and each
    source file's path, size and time: a change builds it anew. A cache that cannot be read (cut, corrupt, foreign,
    code in it) is removed and built anew."""
    root = os.path.abspath(root)
    key = hashlib.sha1(f"{root}/{name}".encode()).hexdigest()[:16]
    caches = [f"{root}/{name}", os.path.expanduser(f"~/.cache/cleanfl/{key}-{name.lstrip('.')}")]
    stamp = file_stamp(root, layout, sources())
    for path in caches:
        if not os.path.isfile(path):
            continue
        try:
            saved = torch.load(path, weights_only=True, mmap=True)
            if saved["stamp"] == stamp:
                return saved["tensors"]
        except Exception as e:  # noqa: BLE001
            # Whatever is wrong with it, the sources are still there.
            why = type(e).__name__
            print(f"note: {path} is no cache this code can read ({why}); building it anew", file=sys.stderr)
            with contextlib.suppress(OSError):
                os.remove(path)
    tensors = build()
    # A download has brought the source files: the stamp is theirs.
    stamp = file_stamp(root, layout, sources())
    for path in caches:
        # The first writable place.
        with contextlib.suppress(OSError):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            atomic_save({"stamp": stamp, "tensors": tensors}, path)
            return torch.load(path, weights_only=True, mmap=True)["tensors"]
    return tensors


def file_stamp(root, layout, paths):
    """A hash of the layout and each file's path (from root), size and modification time."""
    h = hashlib.sha1(f"{layout}, mixed\n".encode())
    for path in paths:
        st = os.stat(path)
        h.update(f"{os.path.relpath(path, root)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def image_size_text(shape):
    """(C, H, W) as words."""
    return f"{shape[2]}x{shape[1]} with {shape[0]} channel(s)"


def decode(root, files):
    """{"train": [(label, group, path)], "test": [...]} -> [x_train, y_train, x_test, y_test, group_train,
    group_test], each split in a mixed order (unsort). Unreadable images are skipped with one line."""
    # PIL is installed with torchvision.
    from PIL import Image

    out, skipped = [], []
    for split in ("train", "test"):
        kept = []
        for y, g, path in progress(files[split], f"decoding {split}/"):
            try:
                with Image.open(path) as img:
                    x = torch.from_numpy(np.array(img))
            except (OSError, ValueError):
                # Empty or corrupt.
                skipped.append(path)
                continue
            if x.ndim == 2:
                x = x.unsqueeze(0)
            else:
                x = x.permute(2, 0, 1)
            kept.append((x, y, g, path))  # x: [C, H, W]
        if not kept:
            raise BadInput(f"--data-dir: no readable images under {root}/{split}/")
        xs = [x for x, *_ in kept]
        # Grayscale images among colour ones become 3-channel.
        if {x.shape[0] for x in xs} == {1, 3}:
            xs = [x.expand(3, -1, -1) if x.shape[0] == 1 else x for x in xs]
        # (C, H, W): its first image.
        shapes = {}
        for x, (*_, path) in zip(xs, kept):
            shapes.setdefault(tuple(x.shape), path)
        if len(shapes) > 1:
            (a, pa), (b, pb) = list(shapes.items())[:2]
            raise BadInput(
                f"--data-dir: images differ in size: {pa} is {image_size_text(a)}, {pb} {image_size_text(b)}; write "
                f"a copy at one size with python benchmarks/prepare_data.py resize --src {root} --size N --out NEW_DIR"
            )
        labels = torch.tensor([y for _, y, *_ in kept])
        groups = torch.tensor([g for _, _, g, _ in kept])
        # Mixed, as torchvision's files are.
        out.append(unsort(torch.stack(xs), labels, groups))
    if skipped:
        print(f"skipped {len(skipped)} unreadable image(s), e.g. {skipped[0]}", file=sys.stderr)
    return [*out[0][:2], *out[1][:2], out[0][2], out[1][2]]


def decode_cached(root, files, layout):
    """decode(root, files), cached in root/.cleanfl-cache.pt, keyed on the layout, the images and classes.txt."""
    paths = [path for split in files.values() for _, _, path in split]
    # The labels' order.
    if os.path.isfile(f"{root}/{CLASSES_FILE}"):
        paths.append(f"{root}/{CLASSES_FILE}")

    def sources():
        return paths

    return cached(root, ".cleanfl-cache.pt", layout, sources, functools.partial(decode, root, files))


# The one fixed permutation of class-sorted datasets (see unsort).
STORAGE_ORDER_SEED = 20240101


def unsort(x, y, g=None):
    """(x, y, g) in one fixed random order (its own seed) if stored sorted (by group, then label), else unchanged. An
    image folder holds its images class by class: evaluation's consecutive batches would hold one or two classes each,
    which a batch norm without running statistics normalizes alone. torchvision's files are mixed already."""
    if g is None:
        key = y
    elif len(y):
        key = g * (int(y.max()) + 1) + y
    else:
        key = g + y
    if len(y) < 2 or not bool((key[1:] >= key[:-1]).all()):
        return x, y, g
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(STORAGE_ORDER_SEED))
    if g is None:
        return x[perm], y[perm], None
    return x[perm], y[perm], g[perm]


# ---- Batches on the device (normalization and augmentation, all batched) and evaluation ----------------------------
# --augment NAME -> augment(x: float [B, C, H, W] in [0, 1], size, crop_scale), on the device
AUGMENTATIONS = {}


def augmentation(name):
    """Registers an augmentation under its --augment name."""

    def register(augment):
        AUGMENTATIONS[name] = augment
        return augment

    return register


def prepare_batch(x, data, augment="none", size=None, crop_scale=(0.08, 1.0)):
    """uint8 [B, C, H, W] -> float, augmented by name (AUGMENTATIONS; rrc: to size x size, area in crop_scale) and
    normalized by the training split's mean and std. The batch is made once, in the statistics' dtype (float32;
    float64 in the tests), and normalized in place."""
    augmented = AUGMENTATIONS[augment](x.to(data.mean.dtype).div_(255), size, crop_scale)
    return augmented.sub_(data.mean).div_(data.std)


def hflip(x):
    """Each image flipped horizontally with probability 1/2."""
    return torch.where(torch.rand(x.shape[0], 1, 1, 1, device=x.device) < 0.5, x.flip(3), x)


@augmentation("none")
def no_augmentation(x, size, crop_scale):
    return x


@augmentation("flip")
def flip(x, size, crop_scale):
    return hflip(x)


@augmentation("crop-flip")
def crop_flip(x, size, crop_scale):
    """A random crop of the 4-pixel zero-padded image, then a flip."""
    return hflip(random_crop(x, padding=4))


@augmentation("rrc")
def rrc(x, size, crop_scale):
    """torchvision's RandomResizedCrop: an area fraction in crop_scale, resized to size x size."""
    boxes = rrc_boxes(len(x), *x.shape[2:], crop_scale, (3 / 4, 4 / 3), x.device)
    return crop_resize(x, *boxes, size or x.shape[-1])


@augmentation("rrc-flip")
def rrc_flip(x, size, crop_scale):
    return hflip(rrc(x, size, crop_scale))


def random_crop(x, padding):
    b, _, h, w = x.shape
    x = F.pad(x, (padding,) * 4)
    dy = torch.randint(0, 2 * padding + 1, (b, 1), device=x.device)
    dx = torch.randint(0, 2 * padding + 1, (b, 1), device=x.device)
    rows = (torch.arange(h, device=x.device) + dy)[:, None, :, None]  # [B, 1, H, 1]
    cols = (torch.arange(w, device=x.device) + dx)[:, None, None, :]  # [B, 1, 1, W]
    batch = torch.arange(b, device=x.device)[:, None, None, None]
    channels = torch.arange(x.shape[1], device=x.device)[None, :, None, None]
    return x[batch, channels, rows, cols]


def rrc_boxes(b, h, w, scale, ratio, device, tries=10):
    """torchvision's RandomResizedCrop.get_params for b images of h x w: up to `tries` draws of an area s ~ U(scale)
    h w and a ratio r = exp(U(log ratio)); the first box (round(sqrt(s r)), round(sqrt(s / r))) that fits is placed
    uniformly, else the whole image is cut centrally to the nearest allowed ratio. LongTensors top, left, bh, bw."""
    area = torch.empty(b, tries, device=device).uniform_(*scale) * (h * w)
    r = torch.empty(b, tries, device=device).uniform_(math.log(ratio[0]), math.log(ratio[1])).exp()
    bw, bh = (area * r).sqrt().round(), (area / r).sqrt().round()
    fits = (bw > 0) & (bw <= w) & (bh > 0) & (bh <= h)
    # The first box that fits.
    pick = fits.float().argmax(1, keepdim=True)
    bw, bh, found = bw.gather(1, pick)[:, 0], bh.gather(1, pick)[:, 0], fits.any(1)
    # The fallback.
    fw, fh = w, h
    if w / h < min(ratio):
        fh = round(w / min(ratio))
    elif w / h > max(ratio):
        fw = round(h * max(ratio))
    bw, bh = torch.where(found, bw, fw).long(), torch.where(found, bh, fh).long()
    top = torch.where(found, (torch.rand(b, device=device) * (h - bh + 1)).long(), (h - bh) // 2)
    left = torch.where(found, (torch.rand(b, device=device) * (w - bw + 1)).long(), (w - bw) // 2)
    return top, left, bh, bw


def as_rows(t):
    """[B, size] -> [B, 1, size, 1]."""
    return t[:, None, :, None]


def as_cols(t):
    """[B, size] -> [B, 1, 1, size]."""
    return t[:, None, None, :]


def crop_resize(x, top, left, bh, bw, size):
    """Box [top, top + bh) x [left, left + bw) of each image resized to size x size, bilinear as torch's interpolate
    (align_corners=False, no antialiasing): source = (i + 0.5) * box / size - 0.5, clamped to the box."""
    i = torch.arange(size, device=x.device, dtype=torch.float)

    def axis(start, length):
        # [B, size] each: the lower and upper source index, and the weight of the upper one.
        src = ((i + 0.5) * (length[:, None] / size) - 0.5).clamp_min(0)
        lo = src.floor().long().clamp_max(length[:, None] - 1)
        return start[:, None] + lo, start[:, None] + torch.minimum(lo + 1, length[:, None] - 1), src - lo

    y0, y1, wy = axis(top, bh)
    x0, x1, wx = axis(left, bw)
    n = torch.arange(x.shape[0], device=x.device)[:, None, None, None]
    c = torch.arange(x.shape[1], device=x.device)[None, :, None, None]
    upper = x[n, c, as_rows(y0), as_cols(x0)] * (1 - as_cols(wx)) + x[n, c, as_rows(y0), as_cols(x1)] * as_cols(wx)
    lower = x[n, c, as_rows(y1), as_cols(x0)] * (1 - as_cols(wx)) + x[n, c, as_rows(y1), as_cols(x1)] * as_cols(wx)
    return upper * (1 - as_rows(wy)) + lower * as_rows(wy)


def client_batches(indices, batch_size, epochs=None, steps=None):
    """Index batches for local training: `epochs` shuffled passes over the client's data (the last batch of a pass
    may be short), or exactly `steps` batches from reshuffled passes if steps is set."""
    n, done = len(indices), 0
    for epoch in itertools.count():
        if steps is None and epoch == epochs:
            return
        perm = indices[torch.randperm(n, device=indices.device)]
        for i in range(0, n, batch_size):
            # A lone trailing sample breaks batch norm in training mode: it is skipped.
            if n - i == 1 and n > 1:
                break
            if steps is not None and done == steps:
                return
            yield perm[i : i + batch_size]
            done += 1


def autocast(device, enabled):
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16, enabled=enabled)


@torch.no_grad()
def evaluate(forward, x, y, data, batch_size=2000, amp=False, balanced=False):
    """Accuracy and mean cross-entropy of `forward`; balanced: + mean recall over the classes present (Fed-ISIC2019's
    metric). Under torchrun batch j runs on rank j mod K, the sums added in batch order: bit for bit one process."""
    rank, world = rank_and_world()
    # A row a batch: its loss sum, hits, hits per class (counts below 2^24 are exact in float32; MPS has no float64).
    sums = torch.zeros(math.ceil(len(x) / batch_size), 2 + data.num_classes, device=y.device)
    for j in range(rank, len(sums), world):
        xb = prepare_batch(x[j * batch_size : (j + 1) * batch_size], data)
        yb = y[j * batch_size : (j + 1) * batch_size]
        with autocast(xb.device, amp):
            logits = forward(xb).float()
        right = logits.argmax(1) == yb
        sums[j, 0] = F.cross_entropy(logits, yb, reduction="sum")
        sums[j, 1] = right.sum()
        if balanced:
            sums[j, 2:] = torch.bincount(yb[right], minlength=data.num_classes)
    if world > 1:
        # A row is one rank's, zeros on the others.
        dist.all_reduce(sums)
    # The loss summed in float32, batch by batch.
    loss = torch.zeros((), device=y.device)
    for batch_loss in sums[:, 0]:
        loss = loss + batch_loss
    acc = float(sums[:, 1].sum()) / len(x)
    loss = float(loss) / len(x)
    if not balanced:
        return acc, loss
    counts, hits = torch.bincount(y, minlength=data.num_classes), sums[:, 2:].sum(0)
    # The recall of each class present.
    recall = hits[counts > 0].cpu().double() / counts[counts > 0].cpu().double()
    return acc, loss, float(recall.mean())


def spread(values):
    """Mean, std (ddof 0) and mean of the worst 10% (the ceil(n/10) lowest) of per-client scores. In client order,
    the mean equals np.mean of the list to the bit."""
    v = np.asarray(values, dtype=float)
    worst = np.sort(v)[: math.ceil(len(v) / 10)]
    return {"mean": float(v.mean()), "std": float(v.std()), "worst10": float(worst.mean())}


def eval_metrics(
    forward, data, tests=None, balanced=False, amp=False, batch_size=2000, client_forward=None, lists=True, val=None
):
    """An evaluation row: test_acc, test_loss; val_acc, val_loss on `val` (--val-frac); over per-client test sets
    `tests` client_test_acc_{mean,std,worst10} (spread; `lists`: each client's, None without test data), each on
    client_forward(k) if given; `balanced`: the same of the balanced accuracy (test_bacc, client_test_bacc_*)."""
    scores = evaluate(forward, data.x_test, data.y_test, data, batch_size, amp, balanced)
    row = {"test_acc": scores[0], "test_loss": scores[1]}
    if balanced:
        row["test_bacc"] = scores[2]
    if val is not None:
        held = torch.cat(val)
        val_scores = evaluate(forward, data.x_train[held], data.y_train[held], data, batch_size, amp)
        row["val_acc"], row["val_loss"] = val_scores
    if tests is None:
        return row
    per_client = {}
    for k, t in enumerate(tests):
        if len(t):
            fwd = forward if client_forward is None else client_forward(k)
            per_client[k] = evaluate(fwd, data.x_test[t], data.y_test[t], data, batch_size, amp, balanced)
    metrics = [("acc", 0)]
    if balanced:
        metrics.append(("bacc", 2))
    for name, i in metrics:
        for stat, value in spread([r[i] for r in per_client.values()]).items():
            row[f"client_test_{name}_{stat}"] = value
        if lists:
            row[f"client_test_{name}"] = [per_client[k][i] if k in per_client else None for k in range(len(tests))]
    return row


# ---- Partitions: every scheme gives one index array per client; @partition registers a scheme's flag ---------------
@dataclass
class Partition:
    # Per client: a LongTensor of indices into data.x_train.
    train: list
    # Per client: a LongTensor into data.x_test (with --client-test), else None.
    test: list
    scheme: str
    # Per client: its folder (--natural) or domain (--clients-per-domain), else None.
    names: list = None
    # Per client: a LongTensor into data.x_train held out of its training data (--val-frac), else None.
    val: list = None


# The partition flag (argparse dest) -> (scheme format, split(labels, n, c, value, weights, rng)).
PARTITIONS = {}


def partition(flag, scheme):
    """Registers split -> n index arrays as the partition of --flag (labels of the samples to split, n clients, c
    classes, the flag's value, client shares, the generator); a ValueError is bad input, naming the flag."""

    def register(split):
        PARTITIONS[flag] = (scheme, split)
        return split

    return register


def as_index_tensors(parts, device):
    """Each client's indices as a sorted LongTensor on the device; None stays None."""
    if parts is None:
        return None
    return [torch.as_tensor(np.sort(p), dtype=torch.long, device=device) for p in parts]


def make_partition(args, data):
    """The clients' training sets by the partition flag (over the whole set, within each domain, or the --natural
    folders), --client-test's test sets, --val-frac's held-out round(F n_k) (at most n_k - 1); its own generator
    (--data-seed), so client sampling never changes it. What the data cannot give is bad input."""
    labels, test_labels = data.y_train.cpu().numpy(), data.y_test.cpu().numpy()
    rng, c = np.random.default_rng(args.data_seed), data.num_classes
    m, natural = getattr(args, "clients_per_domain", None), getattr(args, "natural", False)
    flag = next((k for k in PARTITIONS if getattr(args, k, None)), None)
    powerlaw = args.quantity == "powerlaw"
    if powerlaw and (natural or flag == "split2"):
        given = flag or "natural"
        raise BadInput(f"--quantity: powerlaw needs --iid, --shards, --classes-per-client or --alpha, not {given}")
    groups, test_groups = data.group_train, data.group_test
    client_test = getattr(args, "client_test", False)
    if natural or m:
        # The data's number of clients.
        n = len(data.groups) * (m or 1)
        if args.num_clients not in (None, n):
            raise BadInput(
                f"--num-clients: {args.data_dir}/train has {len(data.groups)} folders, so the run has {n} clients"
            )

    def split(idx, n, where=""):
        # (parts of idx, scheme) by the partition flag, with --quantity's client shares.
        if powerlaw:
            weights = powerlaw_weights(n, rng)
        else:
            weights = np.full(n, 1.0 / n)
        scheme, fn = PARTITIONS[flag]
        try:
            parts = fn(labels[idx], n, c, getattr(args, flag), weights, rng)
        except ValueError as e:
            raise BadInput(f"--{flag.replace('_', '-')}: {e}{where}")
        scheme = scheme.format(getattr(args, flag))
        if powerlaw:
            scheme += " powerlaw"
        return [idx[p] for p in parts], scheme

    names, test = None, None
    if natural or m:
        # The folders train/<group>/: each a client (--natural), or a domain of M clients.
        parts, names = [], []
        if test_groups is not None and (natural or client_test):
            test = []
        for g, name in enumerate(data.groups):
            idx = np.flatnonzero(groups == g)
            if natural:
                sub, scheme = [idx], "natural"
            else:
                sub, scheme = split(idx, m, f" (domain {name})")
            parts += sub
            names += [name] * len(sub)
            if test is not None:
                # test/<group>/: a client's own; a domain's, dealt by its clients' label counts.
                t_idx = np.flatnonzero(test_groups == g)
                if m:
                    dealt = client_test_split(test_labels[t_idx], labels, sub, c, rng)
                else:
                    dealt = [slice(None)]
                test += [t_idx[t] for t in dealt]
        if not natural:
            scheme = f"{len(data.groups)} domains x {m} clients, {scheme}"
    else:
        parts, scheme = split(np.arange(len(labels)), args.num_clients)
    empty = [k for k, p in enumerate(parts) if len(p) == 0]
    if empty:
        flag_name = "--clients-per-domain" if m else "--num-clients"
        more = ""
        if len(empty) > 1:
            more = f" (and {len(empty) - 1} more)"
        raise BadInput(
            f"{flag_name}: client {empty[0]} of {len(parts)}{more} received no training data under {scheme} "
            f"({len(labels)} training samples); use fewer clients"
        )
    if test is None and client_test:
        test = client_test_split(test_labels, labels, parts, c, rng)
    val = None
    # Drawn last: the partition itself does not depend on --val-frac.
    if getattr(args, "val_frac", 0) > 0:
        val = [rng.permutation(p)[: min(int(args.val_frac * len(p) + 0.5), len(p) - 1)] for p in parts]
        parts = [np.setdiff1d(p, v) for p, v in zip(parts, val)]
    device = data.y_train.device
    return Partition(
        as_index_tensors(parts, device), as_index_tensors(test, device), scheme, names, as_index_tensors(val, device)
    )


def powerlaw_weights(n, rng, exponent=1.5):
    """Client shares of a power law: a few clients hold most of the data."""
    w = rng.pareto(exponent, n) + 1.0
    return w / w.sum()


def _cut(idx, shares):
    """idx in consecutive pieces of sizes proportional to shares (the sum kept)."""
    bounds = np.round(np.cumsum(shares) / np.sum(shares) * len(idx)).astype(int)
    return np.split(idx, bounds[:-1])


@partition("iid", "iid")
def split_iid(labels, n, c, _, weights, rng):
    return _cut(rng.permutation(len(labels)), weights)


@partition("shards", "shards={}")
def split_shards(labels, n, c, s, weights, rng):
    """McMahan et al.: sort by label, cut into n*s equal shards, deal s to each client (with power-law shares a number
    proportional to the share, at least 1). A client holds at most s classes when the shard size divides every
    class size (CIFAR-10 with n=100, s=2 or 10); otherwise a shard may straddle two classes, as in the original."""
    if s > len(np.unique(labels)):
        raise ValueError(f"S={s} is more than the {len(np.unique(labels))} classes")
    if n * s > len(labels):
        raise ValueError(f"N*S = {n * s} shards is more than the {len(labels)} training samples")
    order, num_shards = np.argsort(labels, kind="stable"), n * s
    shards, counts = np.array_split(order, num_shards), np.full(n, s)
    if not np.allclose(weights, weights[0]):
        counts = np.maximum(1, np.floor(weights * (num_shards - n)).astype(int) + 1)
        counts[np.argmax(weights)] += num_shards - counts.sum()
    deal, starts = rng.permutation(num_shards), np.concatenate([[0], np.cumsum(counts)])
    return [np.concatenate([shards[j] for j in deal[starts[k] : starts[k + 1]]]) for k in range(n)]


@partition("classes_per_client", "classes-per-client={}")
def split_classes(labels, n, c, per_client, weights, rng, holders=None):
    """Each client holds `per_client` distinct classes, dealt round-robin from a random start so every class has the
    same number of holders when n*per_client is a multiple of c; a class is split among its holders (evenly, or by
    power-law share). `holders` gives the class lists directly (split-2)."""
    if holders is None:
        if per_client > len(np.unique(labels)):
            raise ValueError(f"C must be in 1..{len(np.unique(labels))}, the classes present, got {per_client}")
        # Which class the round-robin begins with is random.
        start = rng.permutation(c)
        holders = [[int(start[(k * per_client + j) % c]) for j in range(per_client)] for k in range(n)]
    parts = [[] for _ in range(n)]
    for cls in range(c):
        owners = [k for k in range(n) if cls in holders[k]]
        if owners:
            pieces = _cut(rng.permutation(np.flatnonzero(labels == cls)), weights[owners])
            for k, piece in zip(owners, pieces):
                parts[k].append(piece)
    return [np.concatenate(p) if p else np.array([], dtype=int) for p in parts]


SPLIT2_CLASSES = [[0, 1, 2, 3], [2, 3, 4, 5], [4, 5, 6, 7], [6, 7, 8, 9], [8, 9, 0, 1]]


@partition("split2", "split-2")
def split2(labels, n, c, _, weights, rng):
    """CIFAR-10 split-2 (Qu et al. 2022; ANFR): 5 clients with classes {0-3}, {2-5}, {4-7}, {6-9}, {8, 9, 0, 1}."""
    if n != 5:
        raise ValueError(f"split-2 has exactly 5 clients; pass --num-clients 5 (got {n})")
    return split_classes(labels, 5, c, None, weights, rng, holders=SPLIT2_CLASSES)


@partition("disjoint_classes", "disjoint-classes")
def split_disjoint(labels, n, c, _, weights, rng):
    """FedLN's "2-2-3 classes" (Table 5, App. C.2): the classes present, in a random order, cut into n disjoint sets,
    floor(c'/n) classes each and one more for the last c' mod n clients (PACS' 7 over 3 clients: 2, 2, 3)."""
    present = rng.permutation(np.unique(labels))
    if n > len(present):
        raise ValueError(f"{n} clients cannot each hold their own of {len(present)} classes; use fewer clients")
    sizes = [len(present) // n + (k >= n - len(present) % n) for k in range(n)]
    return [np.flatnonzero(np.isin(labels, s)) for s in np.split(present, np.cumsum(sizes)[:-1])]


@partition("alpha", "dirichlet alpha={}")
def split_dirichlet(labels, n, c, alpha, weights, rng, min_size=10, max_tries=100):
    """Hsu et al. 2019: per class, client proportions ~ Dir(alpha) (times the shares), redrawn until every client
    has at least min(min_size, |D|/n) samples, at most max_tries times."""
    need = min(min_size, len(labels) // n)
    for _ in range(max_tries):
        parts = [[] for _ in range(n)]
        for cls in range(c):
            idx = rng.permutation(np.flatnonzero(labels == cls))
            if len(idx):
                for k, piece in enumerate(_cut(idx, rng.dirichlet(np.full(n, alpha)) * weights)):
                    parts[k].append(piece)
        parts = [np.concatenate(p) for p in parts]
        if min(len(p) for p in parts) >= need:
            return parts
    raise ValueError(
        f"after {max_tries} draws of Dir({alpha}) a client had fewer than {need} samples; use a larger "
        "--alpha or fewer --num-clients"
    )


def client_test_split(test_labels, train_labels, parts, c, rng):
    """Class y's test samples go to the clients holding y, in proportion to their training counts. Each client's set
    is evaluated on its own (FedBABU's Alg. 2): a batch norm without running statistics sees its classes only."""
    counts = np.stack([np.bincount(train_labels[p], minlength=c) for p in parts])  # [n, c]
    test = [[] for _ in parts]
    for cls in range(c):
        owners = np.flatnonzero(counts[:, cls])
        if len(owners):
            pieces = _cut(rng.permutation(np.flatnonzero(test_labels == cls)), counts[owners, cls])
            for k, piece in zip(owners, pieces):
                test[k].append(piece)
    return [np.concatenate(t) if t else np.array([], dtype=int) for t in test]


# ---- Rounds and aggregation: client sampling, the lr schedule, weights, weighted sums, FedProx, SCAFFOLD -----------
def sample_clients(rng, num_clients, frac):
    """The clients of one round: m = max(floor(frac N), 1) of them (McMahan et al., Alg. 1), without replacement."""
    # The epsilon keeps e.g. 0.29 * 100 at 29, not 28.
    m = max(int(frac * num_clients + 1e-9), 1)
    return sorted(rng.choice(num_clients, m, replace=False).tolist())


def client_seed(seed, rnd, k):
    """The seed of client k's stream in round rnd: never the process's or the clients' before it. k = -1: the stream
    after the round's clients."""
    return int(np.random.SeedSequence([seed, rnd, k + 1]).generate_state(1)[0])


def each_client(clients, weights, train_client, seed, rnd):
    """Yield (k, weight, result) for the round's clients in client order, result = train_client(k) with torch's
    generator seeded client_seed(seed, rnd, k) just before. Alone, a result is valid in the loop body until the next
    client trains. Under torchrun client i trains on rank i mod K, which keeps a copy of its result; once the ranks
    have trained their clients, one exchange gives every rank every result, and the loop body runs on each rank on
    all of them in client order: what one process computes, bit for bit."""
    rank, world = rank_and_world()
    if world == 1:
        for i in progress(range(len(clients)), f"round {rnd + 1}: clients"):
            torch.manual_seed(client_seed(seed, rnd, clients[i]))
            yield clients[i], weights[i], train_client(clients[i])
    else:
        mine = []
        for i in progress(range(rank, len(clients), world), f"round {rnd + 1}: clients of rank 0"):
            torch.manual_seed(client_seed(seed, rnd, clients[i]))
            mine.append(_map_leaves(train_client(clients[i]), copy_tensor))
        by_rank = exchange(mine)
        for i in range(len(clients)):
            yield clients[i], weights[i], by_rank[i % world][i // world]
    # After the clients: the same stream on every rank.
    torch.manual_seed(client_seed(seed, rnd, -1))


def lr_at(round_idx, args):
    """Step decay: lr * decay^(the number of --lr-decay-at fractions of the run passed)."""
    return args.lr * args.lr_decay ** sum(round_idx >= f * args.rounds for f in args.lr_decay_at)


def client_weights(sizes, weighting):
    """Aggregation weights of the sampled clients: n_k / n, or 1/m with --weighting uniform."""
    if weighting == "uniform":
        sizes = [1] * len(sizes)
    w = torch.as_tensor(sizes, dtype=torch.float64)
    return (w / w.sum()).tolist()


def accumulate(total, state, weight):
    """total += weight * state, entry by entry: batch-norm running means and variances are averaged with the
    parameters' weights (num_batches_tracked too; load_average rounds such integer entries)."""
    for k, v in state.items():
        total[k] += weight * v.float()


def load_average(model, total, strict=True):
    """Load the weighted sum of client states into model, each entry in its own dtype; integer buffers rounded (a
    float sum such as 9 x (1/9 x 3) can land just below the integer, and a cast would truncate it)."""
    own = model.state_dict()
    average = {k: v if own[k].is_floating_point() else v.round() for k, v in total.items()}
    model.load_state_dict(average, strict=strict)


def prox_term(params, anchor, mu):
    """FedProx's mu/2 sum_w ||w - w_t||^2 (Li et al. 2020, Eq. 2); anchor: w_t, detached (no gradient reaches it)."""
    return mu / 2 * sum((w - w0).pow(2).sum() for w, w0 in zip(params, anchor))


# SCAFFOLD (Karimireddy et al. 2020, Alg. 1 with option II), on dicts keyed by parameter name.
def scaffold_correction(c, c_i):
    """c - c_i: the drift correction of every local step, y <- y - eta_l (g(y) - c_i + c) (Alg. 1 line 10)."""
    return {n: c[n] - c_i[n] for n in c}


def local_step_sum(steps, lr, momentum=0.0):
    """K eta_l, option II's denominator, for K SGD steps at a constant lr. With heavy-ball momentum rho, K steps of
    a constant gradient move as far as K' = (K - rho (1 - rho^K) / (1 - rho)) / (1 - rho) plain ones (FedNTD's
    code, which FedFN's Table 2 runs); K (K + 1) / 2 at rho = 1."""
    if momentum == 0:
        return steps * lr
    if momentum == 1:
        return steps * (steps + 1) / 2 * lr
    return (steps - momentum * (1 - momentum**steps) / (1 - momentum)) / (1 - momentum) * lr


def scaffold_control(c_i, c, x, y, step_sum):
    """Option II (Alg. 1 line 12): c_i+ = c_i - c + (x - y_i) / (K eta_l), x the global and y_i the client's
    parameters after its K steps; step_sum = K eta_l (local_step_sum, or the sum of a schedule's lrs)."""
    return {n: c_i[n] - c[n] + (x[n] - y[n]) / step_sum for n in c_i}


def scaffold_server(c, delta_sum, num_clients):
    """c <- c + (1/N) sum_{i in S} (c_i+ - c_i) (Alg. 1 line 17; N all clients, not |S|); delta_sum: that sum."""
    return {n: c[n] + delta_sum[n] / num_clients for n in c}


# ---- Personalization: fine-tune the global model on each client (FedBABU's Algorithm 2, FedFN-FT) ------------------
@dataclass
class FineTuning:
    """`epochs` of SGD on `part` (full | body | head; the rest frozen), tested after them and after eval_epochs
    (0: before fine-tuning)."""

    epochs: int
    lr: float
    part: str
    batch_size: int
    augment: str
    eval_epochs: tuple = ()
    momentum: float = 0.9
    amp: bool = False


def call_model(model, x):
    return model(x)


def personalize(model, global_state, data, train_parts, test_parts, ft, forward=None):
    """FedBABU's Algorithm 2: each client with a test set loads global_state into `model` (reused), fine-tunes ft.part
    (the rest frozen; a frozen body in eval mode keeps its batch-norm statistics), is tested after ft.eval_epochs (0:
    before) and ft.epochs. Returns {"acc_mean"|"acc_std" (ddof 0)|"per_client": {epoch: ...}, "clients": [k]}."""
    if forward is None:
        forward = call_model
    points = sorted(set(ft.eval_epochs) | {ft.epochs})
    tuned = {"full": model, "body": model.body, "head": model.head}[ft.part]
    trainable = {id(p) for p in tuned.parameters()}
    for p in model.parameters():
        p.requires_grad_(id(p) in trainable)
    opt_params = [p for p in model.parameters() if p.requires_grad]
    clients = [k for k in range(len(train_parts)) if len(test_parts[k]) > 0]
    per_client = {e: [] for e in points}

    def tuned_forward(x):
        return forward(model, x)

    for k in progress(clients, "fine-tuning clients"):
        model.load_state_dict(global_state)
        opt = torch.optim.SGD(opt_params, lr=ft.lr, momentum=ft.momentum)
        for e in range(points[-1] + 1):
            model.train()
            if ft.part == "head":
                model.body.eval()
            # Epoch 0 is the model before fine-tuning.
            if e > 0:
                for batch in client_batches(train_parts[k], ft.batch_size, epochs=1):
                    x, y = prepare_batch(data.x_train[batch], data, ft.augment), data.y_train[batch]
                    with autocast(x.device, ft.amp):
                        loss = F.cross_entropy(forward(model, x).float(), y)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
            if e in per_client:
                model.eval()
                x, y = data.x_test[test_parts[k]], data.y_test[test_parts[k]]
                per_client[e].append(evaluate(tuned_forward, x, y, data, amp=ft.amp)[0])
    for p in model.parameters():
        p.requires_grad_(True)
    means = {e: float(np.mean(a)) for e, a in per_client.items()}
    stds = {e: float(np.std(a)) for e, a in per_client.items()}
    return {"acc_mean": means, "acc_std": stds, "per_client": per_client, "clients": clients}


# ---- Models: .body (images -> penultimate feature), .head (one nn.Linear); @register_model names them for --model
# --model NAME -> builder(in_channels, num_classes, image_size, **options) -> Classifier
MODELS = {}


def register_model(name):
    """Registers a model builder under its --model name."""

    def register(builder):
        MODELS[name] = builder
        return builder

    return register


def build_model(name, data, **options):
    return MODELS[name](data.in_channels, data.num_classes, data.image_size, **options)


def channels_last_on_cpu(body, inputs):
    """A forward pre-hook: on the CPU, convolutions run faster on images laid out channels last in memory
    (docs/speed.md#image-layout), in training and in evaluation. The values are the same; only their order in
    memory changes."""
    x = inputs[0]
    # Not inside torch.func's transforms (anfr.py's per-sample gradients): vmap cannot change a layout.
    if x.device.type != "cpu" or x.dim() != 4 or torch._C._functorch.maybe_get_level(x) != -1:
        return None
    return (x.contiguous(memory_format=torch.channels_last), *inputs[1:])


class Classifier(nn.Module):
    """body -> feature vector -> head. Methods reach the classifier as model.head. A body with convolutions takes its
    images channels last on the CPU (channels_last_on_cpu), however it is called, unless channels_last is False (a
    body measured slower that way)."""

    def __init__(self, body, feature_dim, num_classes, head_bias=True, channels_last=True):
        super().__init__()
        self.body = body
        self.head = nn.Linear(feature_dim, num_classes, bias=head_bias)
        # Its handle: layout_hook.remove() gives the body its images as they come (benchmarks/layout.py).
        self.layout_hook = None
        if channels_last and any(isinstance(m, nn.Conv2d) for m in body.modules()):
            self.layout_hook = body.register_forward_pre_hook(channels_last_on_cpu)

    def forward(self, x):
        return self.head(self.body(x))


def flat_dim(body, in_channels, image_size):
    with torch.no_grad():
        return body(torch.zeros(2, in_channels, image_size, image_size)).shape[1]


def make_norm(kind, channels, groups=32, affine=True, conv=True):
    """An activation norm for conv maps or features: bn; gn (Wu & He 2018, at most `groups` groups); ln over (C, H, W)
    or the features, GroupNorm(1, C) with a per-channel affine (FedLN's code); none, nf, fn: nothing here."""
    if kind == "bn" and conv:
        return nn.BatchNorm2d(channels, affine=affine)
    if kind == "bn":
        return nn.BatchNorm1d(channels, affine=affine)
    if kind == "gn":
        return nn.GroupNorm(min(groups, channels), channels, affine=affine)
    if kind == "ln":
        return nn.GroupNorm(1, channels, affine=affine)
    if kind in ("none", "nf", "fn"):
        return nn.Identity()
    raise ValueError(f"unknown norm '{kind}'")


@register_model("cnn")
def cnn(in_channels, num_classes, image_size, **_):
    """McMahan et al. 2017 CNN: conv5x5-32, pool, conv5x5-64, pool, fc 512, head."""
    conv = nn.Sequential(
        nn.Conv2d(in_channels, 32, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
    )
    body = nn.Sequential(conv, nn.Linear(flat_dim(conv, in_channels, image_size), 512), nn.ReLU())
    return Classifier(body, 512, num_classes)


@register_model("mlp")
def mlp(in_channels, num_classes, image_size, **_):
    """McMahan et al. 2017 '2NN': two hidden layers of 200 units with ReLU (cheap: used by fast tests)."""
    flat = in_channels * image_size**2
    body = nn.Sequential(nn.Flatten(), nn.Linear(flat, 200), nn.ReLU(), nn.Linear(200, 200), nn.ReLU())
    return Classifier(body, 200, num_classes)


@register_model("pfl-cnn")
def pfl_cnn(in_channels, num_classes, image_size, **_):
    """pfl-research's simple_cnn (its CIFAR-10 benchmark): conv3x3-32, conv3x3-64 (no padding, ReLU each), max-pool 2,
    dropout 0.25, fc 128 with ReLU, dropout 0.5, head; Glorot-uniform weights as pfl's (1,626,442 parameters)."""
    body = nn.Sequential(
        nn.Conv2d(in_channels, 32, 3),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Dropout(0.25),
        nn.Flatten(),
        nn.Linear(64 * ((image_size - 4) // 2) ** 2, 128),
        nn.ReLU(),
        nn.Dropout(0.5),
    )
    model = Classifier(body, 128, num_classes)
    # pfl draws every convolution's and linear layer's weight Glorot-uniform; the biases keep PyTorch's default.
    for layer in model.modules():
        if isinstance(layer, (nn.Conv2d, nn.Linear)):
            nn.init.xavier_uniform_(layer.weight)
    return model


@register_model("convnet4")
def convnet(in_channels, num_classes, image_size, blocks=4, width=64, **_):
    """FedBABU's 4convNet (App. A.1): `blocks` x [conv3x3 (bias), batch norm without running statistics (nothing to
    aggregate), ReLU, max-pool 2], head 256 -> C at 32x32. 3convNet: 3 blocks (EMNIST, 576 -> C at 28x28)."""
    layers = []
    for i in range(blocks):
        cin = in_channels if i == 0 else width
        conv = nn.Conv2d(cin, width, 3, padding=1)
        layers.append(nn.Sequential(conv, nn.BatchNorm2d(width, track_running_stats=False), nn.ReLU(), nn.MaxPool2d(2)))
    body = nn.Sequential(*layers, nn.Flatten())
    return Classifier(body, flat_dim(body, in_channels, image_size), num_classes)


# Not in the papers: tiny (8 channels) for tests, narrow (32) for FedBABU's CPU proxy (d = 128, a head near
# orthogonal). 3convNet: FedBABU's Table 19, on EMNIST.
@register_model("convnet4-tiny")
def convnet4_tiny(in_channels, num_classes, image_size, **_):
    return convnet(in_channels, num_classes, image_size, 4, width=8)


@register_model("convnet4-narrow")
def convnet4_narrow(in_channels, num_classes, image_size, **_):
    return convnet(in_channels, num_classes, image_size, 4, width=32)


@register_model("convnet3")
def convnet3(in_channels, num_classes, image_size, width=64, **_):
    return convnet(in_channels, num_classes, image_size, 3, width)


# Planes, or (planes, stride).
MOBILENET = [64, (128, 2), 128, (256, 2), 256, (512, 2), 512, 512, 512, 512, 512, (1024, 2), 1024]


def batch_norm_without_statistics(channels):
    return nn.BatchNorm2d(channels, track_running_stats=False)


@register_model("mobilenet")
def mobilenet(in_channels, num_classes, image_size, **_):
    """MobileNet v1 (Howard et al. 2017) as FedBABU's code (kuangliu/pytorch-cifar): conv3x3-32, depthwise-pointwise
    blocks (MOBILENET), batch norm without running statistics, average pool."""
    bn = batch_norm_without_statistics
    layers = [nn.Conv2d(in_channels, 32, 3, 1, 1, bias=False), bn(32), nn.ReLU()]
    cin = 32
    for item in MOBILENET:
        if isinstance(item, tuple):
            cout, stride = item
        else:
            cout, stride = item, 1
        layers += [
            nn.Conv2d(cin, cin, 3, stride, 1, groups=cin, bias=False),
            bn(cin),
            nn.ReLU(),
            nn.Conv2d(cin, cout, 1, bias=False),
            bn(cout),
            nn.ReLU(),
        ]
        cin = cout
    return Classifier(nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten()), cin, num_classes)


# ResNet: one implementation; batch, group or layer norm (or none: weight-standardized NF blocks) and attention options.
# gamma = 1/std(relu(z)), z ~ N(0, 1), as timm and DeepMind's NFNets measure it.
RELU_GAMMA = 1.7139588594436646
# alpha: the scale of each residual branch (Brock et al. 2021a; timm's NfCfg.alpha).
NF_ALPHA = 0.2
# The attention output x2 in NF blocks, since a sigmoid gate starts near 0.5 (timm's NfCfg.attn_gain).
NF_ATTN_GAIN = 2.0
# depth -> (bottleneck blocks, blocks a stage)
RESNET_LAYOUT = {
    18: (False, [2, 2, 2, 2]),
    26: (True, [2, 2, 2, 2]),
    34: (False, [3, 4, 6, 3]),
    50: (True, [3, 4, 6, 3]),
}


class ScaledStdConv2d(nn.Conv2d):
    """Scaled Weight Standardization (ANFR Eq. 5; Brock et al. 2021a): W_hat_c = g_c gamma / sqrt(fan_in) (W_c -
    mean(W_c)) / std(W_c) per output channel c, learnable gain g and bias; gamma fixed by the input's nonlinearity.
    eps is timm's."""

    def __init__(self, cin, cout, kernel, stride=1, padding=0, gamma=1.0, gain_init=1.0, eps=1e-5):
        super().__init__(cin, cout, kernel, stride, padding, bias=True)
        self.gain = nn.Parameter(torch.full((cout, 1, 1, 1), float(gain_init)))
        self.scale = gamma / math.sqrt(self.weight[0].numel())  # gamma / sqrt(fan_in)
        self.eps = eps
        nn.init.kaiming_normal_(self.weight, nonlinearity="linear")
        nn.init.zeros_(self.bias)

    def standardized_weight(self):
        """(W - mu_c) / sigma_c per output channel (Eq. 5 before the gain and scale)."""
        mean = self.weight.mean((1, 2, 3), keepdim=True)
        var = self.weight.var((1, 2, 3), keepdim=True, unbiased=False)
        return (self.weight - mean) / torch.sqrt(var + self.eps)

    def forward(self, x):
        return F.conv2d(x, self.gain * self.scale * self.standardized_weight(), self.bias, self.stride, self.padding)


def nf_conv(cin, cout, kernel, stride=1, gain_init=1.0):
    """An NF-ResNet convolution: Scaled Weight Standardization for a ReLU input."""
    return ScaledStdConv2d(cin, cout, kernel, stride, kernel // 2, gamma=RELU_GAMMA, gain_init=gain_init)


def round_channels(v, divisor):
    """timm's make_divisible(v, divisor, round_limit=0)."""
    return max(divisor, int(v + divisor / 2) // divisor * divisor)


class SqueezeExcite(nn.Module):
    """Hu et al. 2018: weights sigmoid(MLP(average pool)), hidden C/16 to a multiple of 8 (timm's SEModule). Attention
    modules take (channels, the network's norm)."""

    def __init__(self, channels, norm=None, reduction=16):
        super().__init__()
        hidden = round_channels(channels / reduction, 8)
        self.fc1 = nn.Conv2d(channels, hidden, 1)
        self.fc2 = nn.Conv2d(hidden, channels, 1)

    def weights(self, x):
        """The channel weights [B, C, 1, 1] (read by anfr.py --analyze)."""
        return torch.sigmoid(self.fc2(F.relu(self.fc1(x.mean((2, 3), keepdim=True)))))

    def forward(self, x):
        return x * self.weights(x)


# anfr.py adds ECA and CBAM.
ATTENTION = {"se": SqueezeExcite}


class Block(nn.Module):
    """A residual block (He et al. 2016): conv1.. (basic 3x3, 3x3; bottleneck 1x1, 3x3, 1x1 to 4x the planes; the
    stride on the first 3x3), attention after the last, plus the shortcut. Placements: "conv-norm-relu": conv, norm
    n_i, ReLU; ReLU after the sum; conv1x1 + norm shortcut where the shape changes. "norm-after-act" (FedLN, Zhang et
    al. 2024, Eq. 10): the norm after each ReLU and on the sum. "nf" (NF-ResNet, Brock et al. 2021a; ANFR): no
    activation norm; x + alpha attn_gain f(relu(x) beta), beta = 1/sqrt(expected Var(x)), Scaled WS convs, the last
    gain starting at last_gain_init (timm: 0: the block starts as its shortcut); a transition (new stride or width)
    takes pool + conv1x1 of relu(x) beta as its shortcut (timm's DownsampleAvg)."""

    def __init__(self, cin, planes, stride, bottleneck, placement, norm, attention, beta=1.0, last_gain_init=0.0):
        super().__init__()
        if bottleneck:
            kernels = (1, 3, 1)
            self.cout = planes * 4
        else:
            kernels = (3, 3)
            self.cout = planes
        self.placement = placement
        self.depth = len(kernels)
        c = cin
        for i, k in enumerate(kernels, 1):
            last = i == self.depth
            out = self.cout if last else planes
            # The stride is on the first 3x3.
            s = stride if i == kernels.index(3) + 1 else 1
            if placement == "nf":
                setattr(self, f"conv{i}", nf_conv(c, out, k, s, gain_init=last_gain_init if last else 1.0))
            else:
                setattr(self, f"conv{i}", nn.Conv2d(c, out, k, s, k // 2, bias=False))
                setattr(self, f"n{i}", make_norm(norm, out))
            c = out
        attend = attention not in (None, "none")
        if attend:
            self.attn = ATTENTION[attention](self.cout, norm)
        else:
            self.attn = nn.Identity()
        self.transition = stride != 1 or cin != self.cout
        if placement == "nf":
            self.beta = beta
            self.alpha = NF_ALPHA
            self.attn_gain = NF_ATTN_GAIN if attend else 1.0
            if self.transition:
                self.shortcut = nn.Sequential()
                if stride > 1:
                    pool = nn.AvgPool2d(2, stride, ceil_mode=True, count_include_pad=False)
                else:
                    pool = nn.Identity()
                self.shortcut.add_module("pool", pool)
                self.shortcut.add_module("conv", nf_conv(cin, self.cout, 1))
            else:
                self.shortcut = nn.Identity()
        elif self.transition:
            # FedLN's placement normalizes the sum, not the shortcut.
            if placement == "conv-norm-relu":
                shortcut_norm = make_norm(norm, self.cout)
            else:
                shortcut_norm = make_norm("none", self.cout)
            self.shortcut = nn.Sequential(nn.Conv2d(cin, self.cout, 1, stride, bias=False), shortcut_norm)
        else:
            self.shortcut = nn.Identity()

    def forward(self, x):
        convs = [getattr(self, f"conv{i}") for i in range(1, self.depth + 1)]
        if self.placement == "nf":
            h = F.relu(x) * self.beta
            out = h
            for conv in convs[:-1]:
                out = F.relu(conv(out))
            out = self.attn(convs[-1](out))
            if self.transition:
                return self.shortcut(h) + self.alpha * self.attn_gain * out
            return x + self.alpha * self.attn_gain * out
        norms = [getattr(self, f"n{i}") for i in range(1, self.depth + 1)]
        out = x
        if self.placement == "norm-after-act":
            for conv, norm in zip(convs[:-1], norms):
                out = norm(F.relu(conv(out)))
            return norms[-1](F.relu(self.attn(convs[-1](out)) + self.shortcut(x)))
        for i, (conv, norm) in enumerate(zip(convs, norms)):
            out = norm(conv(out))
            if i < self.depth - 1:
                out = F.relu(out)
            else:
                out = self.attn(out)
        return F.relu(out + self.shortcut(x))


class ResNetBody(nn.Module):
    """He et al. 2016 ResNet to the global average pool, of Blocks in one placement (norm bn, gn, ln, none; after the
    activation; or nf: the stem ends at its conv, beta follows Var(x_{l+1}) = Var(x_l) + alpha^2, reset to 1 by a
    transition, and a ReLU ends the last block). stem cifar: conv3x3; imagenet: conv7x7 stride 2 + max-pool."""

    def __init__(
        self,
        in_channels,
        depth=18,
        width=64,
        norm="bn",
        attention=None,
        stem="cifar",
        norm_after_act=False,
        last_gain_init=0.0,
    ):
        super().__init__()
        if norm == "nf" and norm_after_act:
            raise ValueError("norm 'nf' has no activation norm to put after the activation")
        bottleneck, layers = RESNET_LAYOUT[depth]
        if norm == "nf":
            placement = "nf"
        elif norm_after_act:
            placement = "norm-after-act"
        else:
            placement = "conv-norm-relu"
        if stem == "cifar":
            kernel, stride = 3, 1
        else:
            kernel, stride = 7, 2
        if placement == "nf":
            stem_layers = [nf_conv(in_channels, width, kernel, stride)]
        else:
            conv = nn.Conv2d(in_channels, width, kernel, stride, kernel // 2, bias=False)
            n = make_norm(norm, width)
            if placement == "norm-after-act":
                stem_layers = [conv, nn.ReLU(), n]
            else:
                stem_layers = [conv, n, nn.ReLU()]
        if stem == "imagenet":
            stem_layers.append(nn.MaxPool2d(3, 2, 1))
        self.stem = nn.Sequential(*stem_layers)
        stages, cin, expected_var = [], width, 1.0
        for i, blocks in enumerate(layers):
            for j in range(blocks):
                beta = expected_var**-0.5
                # Each stage after the first begins at stride 2.
                first_stride = 2 if (j == 0 and i > 0) else 1
                block = Block(
                    cin, width * 2**i, first_stride, bottleneck, placement, norm, attention, beta, last_gain_init
                )
                stages.append(block)
                if block.transition:
                    expected_var = 1.0
                expected_var += NF_ALPHA**2
                cin = block.cout
        self.stages = nn.Sequential(*stages)
        # NF: the last block ends without a ReLU.
        if placement == "nf":
            self.final_act = nn.ReLU()
        else:
            self.final_act = nn.Identity()
        self.out_dim = cin

    def forward(self, x):
        return self.final_act(self.stages(self.stem(x))).mean((2, 3))


@register_model("resnet")
def resnet(in_channels, num_classes, image_size, depth=18, init="timm", **options):
    """The one ResNet (ResNetBody, a linear head), started as timm's fresh ones (init="timm") or PyTorch's. timm's
    resnet50(_gn), seresnet50: convs kaiming-normal fan-out, each branch's last norm at weight 0; nf_(se)resnet50:
    convs kaiming-normal fan-in with bias 0, the head N(0, 0.01^2). FedLN's (norm after the activation): PyTorch's."""
    names = ("width", "norm", "attention", "stem", "norm_after_act", "last_gain_init")
    options = {k: v for k, v in options.items() if k in names}
    body = ResNetBody(in_channels, depth, **options)
    model = Classifier(body, body.out_dim, num_classes)
    norm = options.get("norm", "bn")
    if init != "timm" or options.get("norm_after_act"):
        return model
    for m in model.modules():
        if isinstance(m, nn.Conv2d) and norm == "nf":
            nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="linear")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
    if norm == "nf":
        nn.init.normal_(model.head.weight, 0.0, 0.01)
        nn.init.zeros_(model.head.bias)
    elif norm != "none":
        for block in model.body.stages:
            nn.init.zeros_(getattr(block, f"n{block.depth}").weight)
    return model


register_model("resnet18")(functools.partial(resnet, depth=18))
register_model("resnet50")(functools.partial(resnet, depth=50))


# ==== Run helpers, not federated learning: flags, the run folder, checkpoints, stops, several processes ============
RUN_FILES = ("config.json", "partition.json", "metrics.jsonl", "checkpoint.pt", "summary.json", "model.pt")
# --track's choices, and their folders in a run folder.
TRACKERS = ["tensorboard", "wandb"]
TRACKED = ("tensorboard", "wandb")
# What --resume may change (a larger --rounds extends the run).
RESUMABLE = ("rounds", "stop_after", "device", "data_dir")
# torch's default, before any is set: the physical cores, not hardware threads (Apple: the performance cores).
TORCH_THREADS = torch.get_num_threads()


def flag_type(cast, inside, span):
    """An argparse type: cast(text), finite (a number) and inside(value), else one line. An int may be any size."""

    def check(text):
        try:
            value = cast(text)
        except ValueError:
            kind = "an integer" if cast is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {kind}, got '{text}'")
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be finite, got {text}")
        if not inside(value):
            raise argparse.ArgumentTypeError(f"must be {span}, got {text or repr(text)}")
        return value

    return check


# Counts: clients, rounds, epochs, steps, periods, threads.
positive_int = flag_type(int, lambda v: v >= 1, ">= 1")
non_negative_int = flag_type(int, lambda v: v >= 0, ">= 0")
# numpy's legacy seeding takes 32 bits.
seed_int = flag_type(int, lambda v: 0 <= v < 2**32, "in [0, 4294967295]")
# Learning rates, alpha, tau.
positive_float = flag_type(float, lambda v: v > 0, "> 0")
# Weight decay, mu (0: off).
non_negative_float = flag_type(float, lambda v: v >= 0, ">= 0")
# --frac, --lr-decay.
fraction = flag_type(float, lambda v: 0 < v <= 1, "in (0, 1]")
# Momentum and moment decays, --val-frac.
decay_rate = flag_type(float, lambda v: 0 <= v < 1, "in [0, 1)")
# --lr-decay-at.
inner_fraction = flag_type(float, lambda v: 0 < v < 1, "in (0, 1)")
device_flag = flag_type(str, lambda v: re.fullmatch(r"cpu|cuda|cuda:\d+|mps", v), "cpu, cuda, cuda:N or mps")
# ~ is expanded, also in --data-dir=~/cifar10 (where no shell does it).
path_arg = flag_type(os.path.expanduser, str.strip, "a path")


class Parser(argparse.ArgumentParser):
    """--help: the header's paper and idea, every default; one-line errors; .given: the flags given (parse_args)."""

    def __init__(self, doc):
        super().__init__(
            description="\n\n".join(doc.split("\n\n")[:2]),
            usage="%(prog)s [flags]",
            allow_abbrev=False,
            formatter_class=HelpFormatter,
        )

    def parse_args(self, argv=None):
        # Every default is first a marker, so that the flags given are known. A flag that appends (given more
        # than once) starts from None instead: argparse appends to what is there.
        unset = object()
        actions = [a for a in self._actions if a.default is not argparse.SUPPRESS]
        markers = {}
        for a in actions:
            if isinstance(a, argparse._AppendAction):
                markers[a.dest] = None
            else:
                markers[a.dest] = unset
        args = super().parse_args(argv, argparse.Namespace(**markers))
        self.given = {a.dest for a in actions if getattr(args, a.dest) is not markers[a.dest]}
        # The flag given replaces its group's default (the paper's). argparse itself lets `--shards 2 --alpha 0.1`
        # pass, since 2 is the default.
        for group in self._mutually_exclusive_groups:
            named = [a.option_strings[0] for a in group._group_actions if a.dest in self.given]
            if len(named) > 1:
                self.error(f"argument {named[1]}: not allowed with argument {named[0]}")
            if not named:
                continue
            for a in group._group_actions:
                if a.dest in self.given:
                    continue
                if a.nargs == 0:
                    setattr(args, a.dest, False)
                else:
                    setattr(args, a.dest, None)
        for a in actions:
            if getattr(args, a.dest) is markers[a.dest]:
                setattr(args, a.dest, a.default)
        return args

    def error(self, message):
        """One line, e.g. `fedfn.py: error: --lr: must be > 0, got -1; see --help`, with no usage block above it."""
        if message.startswith("unrecognized arguments: "):
            first = message.split()[2].split("=")[0]
            close = difflib.get_close_matches(first, self._option_string_actions, 1)
            if close:
                message += f" (did you mean {close[0]}?)"
        refuse(f"{message.removeprefix('argument ')}; see --help")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every default, 0 too, in --help; a switch's help says what it does; the header keeps its lines."""

    def _get_help_string(self, action):
        if action.default is None or action.nargs == 0 or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def finish_args(parser, args, script):
    """After argparse: --resume's config.json, --data-seed, the device, the CPU threads; what cannot run exits 2."""
    err, folder, given = parser.error, args.resume, parser.given
    if folder:
        args = resumed_args(parser, args, script)
    elif (args.natural or args.clients_per_domain) and args.dataset != "folder":
        flag = "natural" if args.natural else "clients-per-domain"
        err(f"--{flag}: groups are folders of --dataset folder")
    elif args.clients_per_domain and (args.natural or not given & set(PARTITIONS)):
        err("--clients-per-domain: give the partition within each domain (--iid, --shards, --alpha, ...)")
    elif (args.natural or args.clients_per_domain) and "num_clients" not in given:
        # The data's number: make_partition counts the folders.
        args.num_clients = None
    if args.data_seed is None:
        args.data_seed = args.seed
    args.script = script
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    gpus = torch.cuda.device_count()
    mps = args.device == "mps" and torch.backends.mps.is_available()
    missing_gpu = args.device.startswith("cuda") and int(args.device[5:] or 0) >= gpus
    if missing_gpu or (args.device == "mps" and not mps):
        no_mps = "" if mps else ", no MPS"
        err(f"--device: {args.device} is not on this machine ({gpus} CUDA GPUs{no_mps})")
    if args.threads is None:
        args.threads = default_threads()
    for tracker in sorted(set(args.track or [])):
        if importlib.util.find_spec(tracker) is None:
            err(f"--track {tracker}: the {tracker} package is not installed; pip install {tracker}")
    return args


def resumed_args(parser, args, script):
    """The flags of the run in --resume's folder (its config.json), with the few that a resume may change."""
    err, folder, given = parser.error, args.resume, parser.given
    try:
        saved = json.loads(pathlib.Path(f"{folder}/config.json").read_text())
    except (OSError, ValueError):
        err(f"--resume: {folder} has no readable config.json, so it holds no run to resume")
    # The script that wrote config.json.
    if saved.get("script") != script:
        err(f"--resume: {folder} holds a run of {saved.get('script', '?')}.py, not of {script}.py")
    extra = given - {"resume", *RESUMABLE}
    if extra:
        err(f"--{min(extra).replace('_', '-')}: --resume takes only --rounds, --stop-after, --device, --data-dir")
    rounds = args.rounds if "rounds" in given else saved["rounds"]
    if rounds < saved["rounds"]:
        err(f"--rounds: the run in {folder} has {saved['rounds']} rounds; --resume can extend, not shorten it")
    summary = {}
    if os.path.isfile(f"{folder}/summary.json"):
        with open(f"{folder}/summary.json") as f:
            summary = json.load(f)
    if summary.get("diverged"):
        err(f"--resume: the run in {folder} diverged in round {summary['round']}; start a new one (smaller --lr?)")
    if summary.get("final_round") == rounds:
        print(f"{folder}: this run has finished its {rounds} rounds; nothing to do (a larger --rounds extends it)")
        raise SystemExit(0)
    if not os.path.isfile(f"{folder}/checkpoint.pt"):
        err(f"--resume: {folder} has config.json, no checkpoint.pt; start it again with --out {folder} --overwrite")
    for k in RESUMABLE:
        if k in given:
            saved[k] = getattr(args, k)
    return argparse.Namespace(**{**vars(args), **saved, "resume": folder, "out": folder})


def default_threads():
    """OMP_NUM_THREADS (torchrun sets 1; of "4,2", OpenMP's nested levels, the first), else the usable cores. A value
    OpenMP rejects ("0", "abc"; libgomp says so in a line) leaves the cores, as OpenMP does."""
    omp = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if omp.isdigit() and int(omp) > 0:
        return int(omp)
    return usable_cores()


def usable_cores():
    """torch's count of cores, at most the CPUs this process may run on and the tightest CPU limit (a CPU-time quota:
    docker --cpus, Kubernetes, systemd's CPUQuota=) of its cgroup and those above it, to the nearest, at least 1.
    A function of the machine alone, never of its load: one command gives one set of numbers."""
    cores = TORCH_THREADS
    if hasattr(os, "sched_getaffinity"):
        cores = min(cores, len(os.sched_getaffinity(0)))
    for quota, period in cgroup_cpu_limits():
        cores = min(cores, max(1, int(quota / period + 0.5)))
    return cores


def cgroup_cpu_limits():
    """(quota, period) of each CPU limit on this process's cgroup and those above it; a container sees its own group
    as the root. cgroup v1 lines read "4:cpu,cpuacct:/a/b", v2 lines "0::/a/b"."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    limits = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            mount, files = "cpu", ["cpu.cfs_quota_us", "cpu.cfs_period_us"]
        else:
            mount, files = "", ["cpu.max"]
        for group in [path, *pathlib.PurePosixPath(path).parents]:
            folder = pathlib.Path("/sys/fs/cgroup", mount, str(group).lstrip("/"))
            try:
                text = ""
                for name in files:
                    with open(folder / name) as f:
                        text += f.read() + " "
                quota, period = (int(v) for v in text.split())
            except (OSError, ValueError):
                # No such group or file, or no limit ("max").
                continue
            # A v1 quota of -1: no limit.
            if quota > 0:
                limits.append((quota, period))
    return limits


def refuse(message):
    """Bad input: one line (under torchrun, from the first process of a machine) and exit 2."""
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        print(f"{os.path.basename(sys.argv[0])}: error: {message}", file=sys.stderr)
    refusal = SystemExit(message)
    # Exit code 2, not the 1 of sys.exit(message); str() of it is still the message.
    refusal.code = 2
    raise refusal


def join_torchrun(args):
    """Under a torchrun of the user's own: join its process group. More ranks than GPUs share them, round-robin."""
    cuda = args.device.startswith("cuda")
    shared = False
    if cuda:
        args.device = f"cuda:{int(os.environ['LOCAL_RANK']) % torch.cuda.device_count()}"
        # NCCL needs a GPU a rank; gloo lets ranks share one.
        shared = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) > torch.cuda.device_count()
        torch.cuda.set_device(args.device)
    if sys.platform == "linux":
        # A rank ends with its launcher (`kill -9` of torchrun): no orphans train on, holding the run folder.
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    # A long timeout: ranks wait for the first process's download or decoding, and for the slowest rank's clients.
    backend = "nccl" if cuda and not shared else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(hours=6))
    # Its threads end before the interpreter's: without this, exit can abort ("terminate called...").
    atexit.register(dist.destroy_process_group)
    if dist.get_rank() != 0:
        # Rank 0 prints; errors (stderr) still show from every rank.
        sys.stdout = open(os.devnull, "w")


class Run:
    """One run: its folder, ranks, threads, seeds, client sampler, stop signals, checkpoint; rank 0 writes its files.
    As a context manager it turns bad input into one line and exit 2, and removes a run folder it made and left
    empty (a run refused before it wrote anything)."""

    def __init__(self, args):
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
            join_torchrun(args)
        self.args, self.script = args, args.script
        self.main = rank_and_world()[0] == 0
        # Taken by rank 0: a refusal there ends every rank.
        self.dir, self.made = together(functools.partial(take_folder, args), self.main, share=True)
        args.out = self.dir
        self.made = self.made and self.main
        hidden = ("resume", "stop_after", "overwrite")
        self.config = {k: v for k, v in vars(args).items() if k not in hidden}
        # What --resume may not change, in config.json's own types.
        in_json = json.loads(jsonl([self.config]))
        self.settings = {k: v for k, v in in_json.items() if k not in ("out", *RESUMABLE)}
        self.checkpoint = {}
        if args.resume:
            self.checkpoint = safe_load(f"{self.dir}/checkpoint.pt", "--resume", args.device)
        began = self.checkpoint.get("settings", self.settings)
        keys = began.keys() | self.settings.keys()
        edited = sorted(k for k in keys if began.get(k) != self.settings.get(k))
        if edited:
            refuse(f"--resume: {self.dir}/config.json was edited (in {', '.join(edited[:4])}); undo it, or start anew")
        torch.set_num_threads(args.threads)
        # The models' init (Python's and numpy's global generators serve nothing here).
        torch.manual_seed(args.seed)
        # Client sampling has its own generator.
        self.sampler = np.random.default_rng(args.seed)
        if "cuda" in args.device:
            self.device = torch.cuda.get_device_name(args.device)
        else:
            processes = ""
            if rank_and_world()[1] > 1:
                processes = f", {rank_and_world()[1]} processes"
            self.device = f"cpu ({cpu_name()}, {os.cpu_count()} cores, {args.threads} threads{processes})"
        self.clock = time.time()
        self.rows = None
        self.stop_signal = 0
        self._bar = None
        # Bars in a terminal; in a file (a cluster job's log), a plain line for each evaluation.
        self.bars = sys.stderr.isatty()
        self.tensorboard = None
        self.wandb = None
        self.wandb_id = None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        if self.made and os.path.isdir(self.dir) and not os.listdir(self.dir):
            os.rmdir(self.dir)
        if isinstance(error, BadInput):
            refuse(str(error))
        return False

    @property
    def elapsed(self):
        """Seconds of the run; a resumed run keeps its earlier ones."""
        return self.checkpoint.get("elapsed_s", 0.0) + time.time() - self.clock

    def start(self, model, partition, data, name=None):
        """config.json, partition.json, start-up line; --resume: checks the data, restores sampler, clock, rows.
        Returns the first round: 0, or the checkpoint's."""
        args, ckpt = self.args, self.checkpoint
        sizes = [len(p) for p in partition.train]
        self.fingerprint = data.fingerprint
        began = ckpt.get("data", data.fingerprint) or {}
        differ = [k for k in began if began[k] != data.fingerprint.get(k)]
        if differ:
            refuse(f"--data-dir: {args.data_dir} holds other data than {self.dir} began on (its {', '.join(differ)})")
        self.rows = []
        if ckpt and os.path.isfile(f"{self.dir}/metrics.jsonl"):
            with open(f"{self.dir}/metrics.jsonl") as f:
                lines = f.readlines()
            for line in lines:
                try:
                    row = json.loads(line)
                except ValueError:
                    # A line a crash cut short.
                    continue
                if row["round"] <= ckpt["round"]:
                    self.rows.append(row)
        if ckpt:
            # The client sampler (an older checkpoint's is in rng); torch's generator needs none (each_client).
            self.sampler.bit_generator.state = ckpt.get("sampler") or ckpt["rng"]["numpy_sampler"]
        info = {
            "scheme": partition.scheme,
            "train": label_counts(data.y_train, partition.train, data.num_classes),
            "test": label_counts(data.y_test, partition.test, data.num_classes),
            "classes": data.classes,
            "val": label_counts(data.y_train, partition.val, data.num_classes),
            "clients": partition.names,
        }
        # A new run's folder loses an earlier run's files (take_folder found the folder writable).
        if self.main and not args.resume:
            for f in RUN_FILES:
                pathlib.Path(f"{self.dir}/{f}").unlink(missing_ok=True)
            for tracked in TRACKED:
                shutil.rmtree(f"{self.dir}/{tracked}", ignore_errors=True)
        self.save(jsonl(self.rows), "metrics.jsonl")
        self.save(self.config, "config.json")
        self.save({k: v for k, v in info.items() if v is not None}, "partition.json")
        if self.main:
            self.start_tracking(ckpt.get("round", 0))
        params = sum(p.numel() for p in model.parameters())
        resumed = " (resumed)" if args.resume else ""
        print(
            f"{self.script}: {self.device} | model {name or args.model}, {params:,} parameters | {partition.scheme}: "
            f"{len(sizes)} clients, {min(sizes)}-{max(sizes)} training samples each | run folder {self.dir}{resumed}",
            flush=True,
        )
        return ckpt.get("round", 0)

    def start_tracking(self, first_round):
        """--track's writers: TensorBoard's event files in OUT/tensorboard, a W&B run in OUT/wandb whose config is
        config.json. A resumed run continues both: TensorBoard drops what it holds from the first round on (a crash
        may have logged rounds after the checkpoint), W&B resumes the run of the same id."""
        track = getattr(self.args, "track", None) or []
        if "tensorboard" in track:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(f"{self.dir}/tensorboard", purge_step=first_round + 1)
        if "wandb" in track:
            import wandb

            # The run's id goes into each checkpoint: a resume continues the same W&B run.
            self.wandb_id = self.checkpoint.get("wandb_id") or f"{self.script}-{uuid.uuid4().hex[:8]}"
            self.wandb = wandb.init(
                project=self.args.wandb_project,
                entity=self.args.wandb_entity,
                dir=self.dir,
                id=self.wandb_id,
                name=os.path.basename(os.path.normpath(self.dir)),
                config=self.config,
                resume="allow",
            )
            # A crash may have lost rows W&B had not yet written: what it lacks of the checkpoint's is logged again
            # (W&B's next step: 0 offline, where it cannot ask the server).
            for row in self.rows:
                if row["round"] >= self.wandb.step:
                    self.track_wandb(row)

    def track(self, row):
        """A metrics row to the trackers, at its round: each number as a scalar, each list as a histogram."""
        if self.tensorboard is not None:
            for name, value in row.items():
                if isinstance(value, list):
                    values = torch.tensor([v for v in value if v is not None], dtype=torch.float64)
                    self.tensorboard.add_histogram(name, values, row["round"])
                elif isinstance(value, (int, float)) and name != "round":
                    self.tensorboard.add_scalar(name, value, row["round"])
            self.tensorboard.flush()
        if self.wandb is not None:
            self.track_wandb(row)

    def track_wandb(self, row):
        import wandb

        logged = {}
        for name, value in row.items():
            if isinstance(value, list):
                logged[name] = wandb.Histogram([v for v in value if v is not None])
            elif name != "round":
                logged[name] = value
        self.wandb.log(logged, step=row["round"])

    def bar(self, rounds):
        """The loop's rounds under a bar (rank 0's, in a terminal) that shows the latest test accuracy log sets."""
        hidden = not self.main or not self.bars
        self._bar = tqdm(rounds, self.script, self.args.rounds, initial=rounds.start, disable=hidden)
        yield from self._bar
        # After the rounds (fine-tuning, ...) a stop signal ends the run at once; --resume does that part again.
        self._bar = None

    def snapshot(self, rnd):
        """What --resume needs besides the server's state (and checks)."""
        snapshot = {
            "round": rnd + 1,
            "elapsed_s": self.elapsed,
            "sampler": self.sampler.bit_generator.state,
            "settings": self.settings,
            "data": self.fingerprint,
        }
        if self.wandb_id is not None:
            snapshot["wandb_id"] = self.wandb_id
        return snapshot

    def interrupted(self):
        """Whether Ctrl-C or SIGTERM came, to any rank: all ranks stop together."""
        return agree(self.stop_signal) > 0

    def end_stopped(self, rnd):
        """Ends the run after round rnd, with one line that gives the command which continues it. Exit 0, or 130 and
        143 after Ctrl-C and SIGTERM."""
        self._bar.close()
        if self.stop_signal:
            # The signal's own line said it already, in case a kill ended the round (_on_signal).
            raise SystemExit(128 + self.stop_signal)
        print(f"stopped after round {rnd + 1}; continue with: python {sys.argv[0]} --resume {self.dir}")
        raise SystemExit(0)

    def end_diverged(self, rnd, train_loss):
        """Ends the run with exit 1; summary.json says it diverged."""
        self.write_summary({"diverged": True, "round": rnd + 1, "train_loss": train_loss})
        if self.main:
            raise SystemExit(f"diverged in round {rnd + 1}: loss {train_loss}; try a smaller --lr")
        raise SystemExit(1)

    def log(self, metrics):
        """One more row (with elapsed_s) in metrics.jsonl, which is written whole (save)."""
        row = {**metrics, "elapsed_s": round(self.elapsed, 3)}
        self.rows.append(row)
        self.save(jsonl(self.rows), "metrics.jsonl")
        if self.main:
            self.track(row)
        if "test_acc" not in metrics:
            return
        if self._bar is not None and self.bars:
            self._bar.set_postfix(acc=f"{metrics['test_acc']:.4f}", loss=f"{metrics['train_loss']:.3f}")
        elif self.main:
            print(
                f"round {metrics['round']}/{self.args.rounds}: test_acc {metrics['test_acc']:.4f}, "
                f"train_loss {metrics['train_loss']:.4f}, {row['elapsed_s']:.1f} s",
                flush=True,
            )

    def finish(self, model=None, **extra):
        """summary.json: the final round's evaluation and `extra`; model.pt with --save-model."""
        final = {}
        for row in reversed(self.rows):
            if "test_acc" in row:
                final = {k: v for k, v in row.items() if k != "round"}
                break
        # --val-frac: the papers' protocol, the test accuracy at the first best validation accuracy.
        scored = [row for row in self.rows if row.get("val_acc") is not None]
        if scored:
            top = max(scored, key=val_acc_of)
            final.update(best_val_acc=top["val_acc"], best_val_round=top["round"], test_acc_at_best_val=top["test_acc"])
        summary = {"final_round": self.args.rounds, **final, **extra}
        self.write_summary(summary)
        if model is not None and self.args.save_model:
            self.save(model.state_dict(), "model.pt")
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.summary.update(summary)
            self.wandb.finish()
        print(f"final test accuracy {summary['test_acc']:.4f} after {self.args.rounds} rounds; outputs in {self.dir}")
        return summary

    def write_summary(self, summary):
        """summary.json: `summary` and what ran it, where, how long."""
        about = {
            "wall_time_s": round(self.elapsed, 3),
            "device": self.device,
            "torch": torch.__version__,
            "script": self.script,
            "processes": rank_and_world()[1],
        }
        self.save({**summary, **about}, "summary.json")

    def save(self, obj, name):
        """A run file, written whole by rank 0; a write that fails ends the run in one line."""
        if not self.main:
            return
        try:
            atomic_save(obj, f"{self.dir}/{name}")
        except OSError as e:
            # A full disk, a read-only or removed folder.
            whole = f"the files written before are whole: once that is fixed, --resume {self.dir} continues"
            sys.exit(f"{self.script}.py: error: cannot write {self.dir}/{name}: {e.strerror or e}; {whole}")

    def _on_signal(self, signum, _):
        """In the rounds, the loop stops after the round in progress; outside them, or at a second signal, at once."""
        if self.stop_signal and rank_and_world()[1] > 1:
            # A scheduler signals torchrun's agent and its ranks, and the agent passes it on: the same stop.
            return
        at_once = self._bar is None or self.stop_signal > 0
        self.stop_signal = signum
        if self.main and at_once:
            if self.rows is None:
                kept = "nothing was written"
            else:
                kept = "the run folder keeps what was saved (--resume)"
            print(f"\ninterrupted; {kept}", file=sys.stderr, flush=True)
        elif self.main:
            # The command is said now: a kill may end the round (a container's 10 s, torchrun's 30 s).
            name = signal.Signals(signum).name
            print(
                f"\n{name}: finishing this round, then a checkpoint (again: at once); continue with: python "
                f"{sys.argv[0]} --resume {self.dir}",
                flush=True,
            )
        if at_once:
            raise SystemExit(128 + signum)


def cpu_name():
    """The CPU's model name (Linux's /proc/cpuinfo), else the machine's architecture."""
    try:
        with open("/proc/cpuinfo") as f:
            found = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.M)
    except OSError:
        found = None
    if found:
        return found.group(1).strip()
    return platform.machine()


def val_acc_of(row):
    return row["val_acc"]


def label_counts(y, parts, num_classes):
    """Each part's count of each label (partition.json); None for no parts."""
    if parts is None:
        return None
    return [torch.bincount(y[p], minlength=num_classes).tolist() for p in parts]


def atomic_save(obj, path):
    """torch.save (JSON for *.json, text for a str) to a temporary file, then renamed: the file is whole or not
    there. The temporary file is this process's own: writers never share one."""
    tmp = f"{path}.{socket.gethostname()}.{os.getpid()}.tmp"
    try:
        if isinstance(obj, str):
            data = obj.encode()
        elif path.endswith(".json"):
            data = json.dumps(_json_safe(obj), indent=2, allow_nan=False).encode()
        else:
            # In memory first, so that a full disk is an OSError, not torch's own error.
            buffer = io.BytesIO()
            torch.save(obj, buffer)
            data = buffer.getbuffer()
        # Buffered: a short write on a full disk is retried, and raises ENOSPC.
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            # On the disk before the rename: a crash leaves the old file or the new one.
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        # Interrupted (or failed) before the rename.
        pathlib.Path(tmp).unlink(missing_ok=True)


def safe_load(path, flag, device="cpu"):
    """torch.load that runs no code: tensors and plain types only, else one line (a cut zip, garbage or a pickled
    object alike)."""
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # noqa: BLE001
        if "Weights only" in str(e):
            why = "it needs more than tensors and plain types"
        else:
            why = "cut short or corrupt"
        refuse(f"{flag}: cannot load {path}: {why} ({type(e).__name__}); nothing was run or changed")


def finite_or_none(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _json_safe(obj):
    """obj with NaN and infinities as None (JSON has neither)."""
    return _map_leaves(obj, finite_or_none)


def rank_and_world():
    """(rank, number of processes) under torchrun; (0, 1) alone."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def jsonl(rows):
    """metrics.jsonl's text: a JSON object a line."""
    return "".join(json.dumps(_json_safe(row), allow_nan=False) + "\n" for row in rows)


def _wire():
    """The device collectives send from: this rank's GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device(f"cuda:{torch.cuda.current_device()}")
    return torch.device("cpu")


def progress(items, desc, total=None):
    """A bar over items (rank 0's, in a terminal), shown once they take more than 5 seconds."""
    hidden = rank_and_world()[0] > 0 or not sys.stderr.isatty()
    return tqdm(items, desc, total, False, disable=hidden, delay=5)


# The run folders this process holds: path -> the locked descriptor.
_HELD = {}


def take_folder(args):
    """--out, or runs/<script>__<dataset>__<seed>__<time>(-2, -3, ...), made and locked: a second run is refused.
    Returns (the folder, whether this call made it)."""
    flag = "--resume" if args.resume else "--out"
    made = False
    name = args.out or f"runs/{args.script}__{args.dataset}__{args.seed}__{time.strftime('%Y%m%d-%H%M%S')}"
    out = name
    if args.out:
        candidates = [name]
    else:
        candidates = itertools.chain([name], (f"{name}-{n}" for n in itertools.count(2)))
    try:
        os.makedirs(os.path.dirname(os.path.abspath(name)), exist_ok=True)
        for out in candidates:
            # mkdir is atomic: of two runs, one makes it. --out may be there already; a default name is another run's.
            try:
                os.mkdir(out)
            except FileExistsError:
                if args.out:
                    break
                continue
            made = True
            break
        # A process may run runs in turn (tests/run_batch.py).
        key = os.path.realpath(out)
        if key not in _HELD:
            fd = os.open(out, os.O_RDONLY)
            # Held until the process ends; kept only once locked.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            _HELD[key] = fd
        # A folder this process can write in.
        os.rmdir(tempfile.mkdtemp(prefix=".cleanfl-probe", dir=out))
    except BlockingIOError:
        # A folder made here but locked first by another run is that run's: kept.
        refuse(f"{flag}: another run is using {out} now; wait for it to end, or choose another --out")
    except OSError as e:
        # A file in the way, a read-only or full disk.
        verb = "write in" if made or os.path.isdir(out) else "make"
        refuse(f"{flag}: cannot {verb} {out}: {e.strerror}")
    holds_run = any(os.path.exists(f"{out}/{f}") for f in RUN_FILES)
    if flag == "--out" and not args.overwrite and holds_run:
        refuse(f"--out: {out} holds a run; continue it with --resume {out}, or another --out or --overwrite")
    return out, made


def agree(value):
    """The largest of the ranks' integers (a stop signal, an exit code); alone, the value itself."""
    if rank_and_world()[1] == 1:
        return int(value)
    value = torch.tensor([value], device=_wire())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value)


def together(fn, here, share=False):
    """fn() where `here`, the others waiting (share: rank 0's result to all). A refusal (SystemExit, BadInput) on one
    ends all: raised where it happened, once every rank knows; the others exit with its code, quietly."""
    result, code = None, 0
    try:
        if here:
            result = fn()
    except BadInput as e:
        result, code = e, 2
    except SystemExit as e:
        result = e
        code = e.code if isinstance(e.code, int) else 1
    agreed = agree(code)
    if code:
        raise result
    if agreed:
        raise SystemExit(agreed)
    if share and rank_and_world()[1] > 1:
        return _broadcast(result, src=0)
    return result


def _map_leaves(obj, fn):
    """obj with fn applied to every leaf (not a dict, list or tuple), the layout kept."""
    if isinstance(obj, dict):
        return {k: _map_leaves(v, fn) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_map_leaves(v, fn) for v in obj)
    return fn(obj)


class _Sent(tuple):
    """A tensor on its way to the other ranks: (its CPU copy, its device type)."""


def _to_wire(leaf):
    if torch.is_tensor(leaf):
        return _Sent((leaf.detach().cpu(), leaf.device.type))
    return leaf


def _from_wire(leaf):
    # "cuda" is this rank's GPU (set_device).
    if isinstance(leaf, _Sent):
        return leaf[0].to(leaf[1])
    return leaf


def _broadcast(result, src):
    """Rank src's result to every rank, pickled with its tensors' bits; src keeps its own."""
    box = [_map_leaves(result, _to_wire)]
    dist.broadcast_object_list(box, src=src, device=_wire())
    if dist.get_rank() == src:
        return result
    return _map_leaves(box[0], _from_wire)


def copy_tensor(leaf):
    """A tensor's own copy (a client's state shares the reused client model's memory); other values as they are."""
    if torch.is_tensor(leaf):
        return leaf.detach().clone()
    return leaf


class _Slot(int):
    """Where a result held a tensor: its index among the tensors sent."""


def _slots(obj, tensors):
    """obj with each tensor replaced by a _Slot, the tensors appended to `tensors` in order."""
    if torch.is_tensor(obj):
        tensors.append(obj)
        return _Slot(len(tensors) - 1)
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out[k] = _slots(v, tensors)
        return out
    if type(obj) in (list, tuple):
        out = []
        for v in obj:
            out.append(_slots(v, tensors))
        return type(obj)(out)
    return obj


def exchange(mine):
    """Every rank's list of results to every rank, in one gather of their bytes: [rank 0's list, rank 1's, ...]. A
    result is dicts, lists and tuples of tensors and plain values; its tensors come back with their bits and dtypes,
    on this rank's device."""
    world = rank_and_world()[1]
    wire = _wire()
    tensors = []
    layout = _slots(mine, tensors)
    pieces, kinds, offset = [], [], 0
    for t in tensors:
        data = t.detach().to(wire).contiguous().reshape(-1).view(torch.uint8)
        kinds.append((t.shape, t.dtype, t.device.type, offset))
        # Each tensor starts at a multiple of 8 bytes, where a view of any dtype may begin.
        padding = -len(data) % 8
        pieces += [data, torch.zeros(padding, dtype=torch.uint8, device=wire)]
        offset += len(data) + padding
    layouts = [None] * world
    dist.all_gather_object(layouts, (layout, kinds, offset))
    size = max(n for _, _, n in layouts)
    buffer = torch.zeros(size, dtype=torch.uint8, device=wire)
    if pieces:
        torch.cat(pieces, out=buffer[:offset])
    gathered = [torch.empty(size, dtype=torch.uint8, device=wire) for _ in range(world)]
    dist.all_gather(gathered, buffer)
    by_rank = []
    for (layout, kinds, _), data in zip(layouts, gathered):
        received = []
        for shape, dtype, device, start in kinds:
            nbytes = math.prod(shape) * dtype.itemsize
            # A copy of its own: a view into the buffer could not be saved beside views of other dtypes, and would
            # keep the whole buffer alive. "cuda" is this rank's GPU (set_device).
            received.append(data[start : start + nbytes].view(dtype).reshape(shape).clone().to(device))
        by_rank.append(_filled(layout, received))
    return by_rank


def _filled(obj, tensors):
    """obj with each _Slot replaced by its tensor."""
    if isinstance(obj, _Slot):
        return tensors[obj]
    if isinstance(obj, dict):
        return {k: _filled(v, tensors) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_filled(v, tensors) for v in obj)
    return obj

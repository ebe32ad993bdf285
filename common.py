"""Shared pieces of CleanFL, in reading order: data as tensors on the device, batches (augmentation on
the device) and evaluation, partitions, rounds and aggregation, per-client personalization, and the
models (the papers' models, each marked with its paper, and one ResNet family). Below one banner
follows the run machinery, which is not federated learning: flag checks, dataset files and caches,
the run folder's files (RunFolder), the loop's control (RoundLoop), the divergence stop (exit_if_diverged),
atomic saves, RNG state, several processes (torchrun).

A method script imports what it needs from here and keeps its own training loop, so one script plus
this file is everything a reader must copy. Most of a method's own equations live in its script.
"""

import argparse
import atexit
import datetime
import hashlib
import itertools
import json
import math
import os
import random
import signal
import socket
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm


# ----------------------------------------------------------------------------------------------
# Data: every dataset becomes uint8 tensors [N, C, H, W] on the run's device
# ----------------------------------------------------------------------------------------------
@dataclass
class Data:
    x_train: torch.Tensor  # uint8 [N, C, H, W]
    y_train: torch.Tensor  # int64 [N]
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    mean: torch.Tensor  # float [1, C, 1, 1], in [0, 1] pixel units, from the training split
    std: torch.Tensor
    # image folders in groups (train/<group>/<class>/*: clients or domains): each sample's group, on the CPU;
    # group_test is None when test/ is one shared test/<class>/*
    group_train: torch.Tensor = None
    group_test: torch.Tensor = None
    groups: list = None  # group names (sorted folder names)
    classes: list = None  # class names of an image folder (sorted folder names, or classes.txt's order)

    @property
    def in_channels(self):
        return self.x_train.shape[1]

    @property
    def image_size(self):
        return self.x_train.shape[2]


def load_data(args):
    """Load args.dataset into a Data on args.device (downloaded to / cached in args.data_dir)."""
    d = read_dataset(args)  # uint8 [N, C, H, W] and int64 labels (and groups), on the CPU
    # An image folder stores its images class by class. Evaluation cuts the test set into consecutive
    # batches, and a model whose batch norm keeps no running statistics normalizes each batch with its
    # own statistics, so a class-sorted test set would be scored on batches of one or two classes.
    # One fixed permutation (its own seed, not --seed or --data-seed) mixes the classes the way
    # torchvision's files are mixed; partitions select by label (and group), so they are unaffected.
    x_tr, y_tr, g_tr = unsort(d["x_train"], d["y_train"], d.get("group_train"))
    x_te, y_te, g_te = unsort(d["x_test"], d["y_test"], d.get("group_test"))
    num_classes = max(int(max(y_tr.max(), y_te.max())) + 1, len(d.get("classes") or ()))  # classes.txt: all listed
    xf = x_tr.float() / 255
    mean, std = xf.mean(dim=(0, 2, 3), keepdim=True), xf.std(dim=(0, 2, 3), keepdim=True)
    dev = args.device
    return Data(
        x_tr.to(dev),
        y_tr.to(dev),
        x_te.to(dev),
        y_te.to(dev),
        num_classes,
        mean.to(dev),
        std.to(dev),
        g_tr,
        g_te,
        d.get("groups"),
        d.get("classes"),
    )


STORAGE_ORDER_SEED = 20240101  # the one fixed permutation of class-sorted datasets (see load_data)


def unsort(x, y, g=None):
    """Return (x, y, g) in one fixed random order if the samples are stored grouped (by label, or by group
    and label within a group: non-decreasing), else unchanged: torchvision's files are already mixed."""
    key = y if g is None else g * (int(y.max()) + 1 if len(y) else 1) + y
    if len(y) < 2 or not bool((key[1:] >= key[:-1]).all()):
        return x, y, g
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(STORAGE_ORDER_SEED))
    return x[perm], y[perm], None if g is None else g[perm]


# ----------------------------------------------------------------------------------------------
# Batches on the device (normalization and augmentation, all batched) and evaluation
# ----------------------------------------------------------------------------------------------
AUGMENTATIONS = ["crop-flip", "flip", "none", "rrc", "rrc-flip"]


def prepare_batch(x, data, augment="none", size=None, crop_scale=(0.08, 1.0)):
    """uint8 [B, C, H, W] -> normalized float, with random crop (4-pixel zero padding) and/or flip, or a
    RandomResizedCrop of area fraction in crop_scale resized to size x size (default: the stored size)."""
    x = x.float().div_(255)
    if augment == "crop-flip":
        x = random_crop(x, padding=4)
    if augment in ("rrc", "rrc-flip"):
        x = random_resized_crop(x, size or x.shape[-1], crop_scale)
    if augment in ("crop-flip", "flip", "rrc-flip"):
        flip = torch.rand(x.shape[0], 1, 1, 1, device=x.device) < 0.5
        x = torch.where(flip, x.flip(3), x)
    return (x - data.mean) / data.std


def random_crop(x, padding):
    b, _, h, w = x.shape
    x = F.pad(x, (padding,) * 4)
    dy = torch.randint(0, 2 * padding + 1, (b, 1), device=x.device)
    dx = torch.randint(0, 2 * padding + 1, (b, 1), device=x.device)
    rows = (torch.arange(h, device=x.device) + dy)[:, None, :, None]  # [B, 1, H, 1]
    cols = (torch.arange(w, device=x.device) + dx)[:, None, None, :]  # [B, 1, 1, W]
    batch = torch.arange(b, device=x.device)[:, None, None, None]
    chan = torch.arange(x.shape[1], device=x.device)[None, :, None, None]
    return x[batch, chan, rows, cols]


def random_resized_crop(x, size, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    """torchvision's RandomResizedCrop, batched on the device: a box per image (rrc_boxes), resized to
    size x size (crop_resize)."""
    return crop_resize(x, *rrc_boxes(x.shape[0], *x.shape[2:], scale, ratio, x.device), size)


def rrc_boxes(b, h, w, scale, ratio, device, tries=10):
    """torchvision's RandomResizedCrop.get_params for b images of h x w: up to `tries` draws of an area
    s ~ U(scale) * h * w and an aspect ratio r = exp(U(log ratio)); the first box (bw, bh) = (round(sqrt(s r)),
    round(sqrt(s / r))) that fits is placed uniformly at random, else the whole image is cut centrally to the
    nearest allowed ratio. Returns LongTensors top, left, bh, bw [b]."""
    area = torch.empty(b, tries, device=device).uniform_(*scale) * (h * w)
    r = torch.empty(b, tries, device=device).uniform_(math.log(ratio[0]), math.log(ratio[1])).exp()
    bw, bh = (area * r).sqrt().round(), (area / r).sqrt().round()
    fits = (bw > 0) & (bw <= w) & (bh > 0) & (bh <= h)
    pick = fits.float().argmax(1, keepdim=True)  # the first box that fits
    bw, bh, found = bw.gather(1, pick)[:, 0], bh.gather(1, pick)[:, 0], fits.any(1)
    fw, fh = w, h  # the fallback
    if w / h < min(ratio):
        fh = round(w / min(ratio))
    elif w / h > max(ratio):
        fw = round(h * max(ratio))
    bw, bh = torch.where(found, bw, fw).long(), torch.where(found, bh, fh).long()
    top = torch.where(found, (torch.rand(b, device=device) * (h - bh + 1)).long(), (h - bh) // 2)
    left = torch.where(found, (torch.rand(b, device=device) * (w - bw + 1)).long(), (w - bw) // 2)
    return top, left, bh, bw


def crop_resize(x, top, left, bh, bw, size):
    """Box [top, top + bh) x [left, left + bw) of each image resized to size x size, bilinear as torch's
    interpolate (align_corners=False, no antialiasing): source = (i + 0.5) * box / size - 0.5, clamped to the box."""
    i = torch.arange(size, device=x.device, dtype=torch.float)

    def axis(start, length):  # [B, size]: lower and upper source index, weight of the upper one
        src = ((i + 0.5) * (length[:, None] / size) - 0.5).clamp_min(0)
        lo = src.floor().long().clamp_max(length[:, None] - 1)
        return start[:, None] + lo, start[:, None] + torch.minimum(lo + 1, length[:, None] - 1), src - lo

    (y0, y1, wy), (x0, x1, wx) = axis(top, bh), axis(left, bw)
    n = torch.arange(x.shape[0], device=x.device)[:, None, None, None]
    c = torch.arange(x.shape[1], device=x.device)[None, :, None, None]
    rows, cols = (lambda t: t[:, None, :, None]), (lambda t: t[:, None, None, :])
    upper = x[n, c, rows(y0), cols(x0)] * (1 - cols(wx)) + x[n, c, rows(y0), cols(x1)] * cols(wx)
    lower = x[n, c, rows(y1), cols(x0)] * (1 - cols(wx)) + x[n, c, rows(y1), cols(x1)] * cols(wx)
    return upper * (1 - rows(wy)) + lower * rows(wy)


def client_batches(indices, batch_size, epochs=None, steps=None):
    """Index batches for local training: `epochs` shuffled passes over the client's data (the last
    batch of a pass may be short), or exactly `steps` batches from reshuffled passes if steps is set."""
    n, done = len(indices), 0
    for epoch in itertools.count():
        if steps is None and epoch == epochs:
            return
        perm = indices[torch.randperm(n, device=indices.device)]
        for i in range(0, n, batch_size):
            if n - i == 1 and n > 1:  # a lone trailing sample breaks batch norm in training mode: skip it
                break
            if steps is not None and done == steps:
                return
            yield perm[i : i + batch_size]
            done += 1


def autocast(device, enabled):
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16, enabled=enabled)


@torch.no_grad()
def evaluate(forward, x, y, data, batch_size=2000, amp=False, balanced=False):
    """Accuracy and mean cross-entropy of `forward` (a callable on normalized images); balanced=True adds a
    third value, the balanced accuracy (see balanced_accuracy)."""
    correct, loss = 0, 0.0
    hits = torch.zeros(data.num_classes, device=y.device)
    for i in range(0, len(x), batch_size):
        xb, yb = prepare_batch(x[i : i + batch_size], data), y[i : i + batch_size]
        with autocast(xb.device, amp):
            logits = forward(xb).float()
        loss += F.cross_entropy(logits, yb, reduction="sum")
        right = logits.argmax(1) == yb
        correct += right.sum()
        if balanced:
            hits += torch.bincount(yb[right], minlength=data.num_classes)
    acc, loss = float(correct) / len(x), float(loss) / len(x)
    if not balanced:
        return acc, loss
    return acc, loss, balanced_accuracy(hits, torch.bincount(y, minlength=data.num_classes))


def balanced_accuracy(hits, counts):
    """Mean per-class recall over the classes present: mean_c hits_c / counts_c for counts_c > 0 (FLamby's
    and scikit-learn's balanced accuracy; Fed-ISIC2019's metric). hits, counts: per class."""
    present = counts > 0
    return float((hits[present].cpu().double() / counts[present].cpu().double()).mean())


def spread(values):
    """Mean, standard deviation (ddof 0) and the mean of the worst 10% (the ceil(n/10) lowest values, at least
    one) of per-client scores: how evenly a model serves the clients."""
    v = np.asarray(values, dtype=float)  # in client order: the mean equals np.mean of the list, to the bit
    worst = np.sort(v)[: math.ceil(len(v) / 10)]
    return {"mean": float(v.mean()), "std": float(v.std()), "worst10": float(worst.mean())}


def eval_metrics(
    forward, data, tests=None, balanced=False, amp=False, batch_size=2000, client_forward=None, lists=False, val=None
):
    """The test keys of an evaluation row: test_acc and test_loss of `forward` on the test set; with validation
    samples `val` (per client, indices into the training split: --val-frac), val_acc and val_loss on all of them; with
    per-client test sets `tests`, client_test_acc_{mean,std,worst10} over the clients that have test data
    (see spread); with balanced, the same of the balanced accuracy: test_bacc, client_test_bacc_*.
    client_forward(k): client k's callable when clients are tested on their own models (default: forward);
    lists: also each client's score, client_test_acc (None for a client without test data)."""
    scores = evaluate(forward, data.x_test, data.y_test, data, batch_size, amp, balanced)
    row = {"test_acc": scores[0], "test_loss": scores[1]}
    if val is not None:
        held = torch.cat(val)
        row["val_acc"], row["val_loss"] = evaluate(
            forward, data.x_train[held], data.y_train[held], data, batch_size, amp
        )
    if balanced:
        row["test_bacc"] = scores[2]
    if tests is not None:
        per_client = {
            k: evaluate(
                (client_forward or (lambda _: forward))(k),
                data.x_test[t],
                data.y_test[t],
                data,
                batch_size,
                amp,
                balanced,
            )
            for k, t in enumerate(tests)
            if len(t)
        }
        for name, i in [("acc", 0)] + [("bacc", 2)] * balanced:
            row.update({f"client_test_{name}_{s}": v for s, v in spread([r[i] for r in per_client.values()]).items()})
            if lists:
                row[f"client_test_{name}"] = [per_client[k][i] if k in per_client else None for k in range(len(tests))]
    return row


# ----------------------------------------------------------------------------------------------
# Partitions: every scheme returns one LongTensor of training indices per client
# ----------------------------------------------------------------------------------------------
SPLIT2_CLASSES = [[0, 1, 2, 3], [2, 3, 4, 5], [4, 5, 6, 7], [6, 7, 8, 9], [8, 9, 0, 1]]


@dataclass
class Partition:
    train: list  # per client: LongTensor of indices into data.x_train
    test: list  # per client: LongTensor into data.x_test (with --client-test), else None
    scheme: str
    names: list = None  # per client: its folder (--natural) or domain (--clients-per-domain), else None
    val: list = None  # per client: LongTensor into data.x_train held out of its training data (--val-frac), else None


def make_partition(args, data):
    """Split the training set over args.num_clients with the one partition flag the run has: the groups of an
    image folder as they are (--natural), or that flag within each group (--clients-per-domain M).

    Uses its own generator seeded by args.data_seed, so client sampling never changes it. With --val-frac F,
    round(F n_k) random samples of each client's n_k (at most n_k - 1) are held out as its validation samples.
    """
    labels = data.y_train.cpu().numpy()
    rng = np.random.default_rng(args.data_seed)
    n, c = args.num_clients, data.num_classes
    groups = data.group_train.numpy() if data.group_train is not None else None
    own_test = getattr(args, "client_test", False) and data.group_test is not None  # test/<group>/<class>/
    test_groups = data.group_test.numpy() if own_test else None
    names, test = None, None
    if getattr(args, "natural", False):  # the clients are the folders train/<client>/
        parts, scheme, names = [np.flatnonzero(groups == g) for g in range(len(data.groups))], "natural", data.groups
        if own_test:
            test = [np.flatnonzero(test_groups == g) for g in range(len(data.groups))]
    elif getattr(args, "clients_per_domain", None):  # the partition flag within each domain, M clients each
        m, parts, test, names = args.clients_per_domain, [], [] if own_test else None, []
        test_labels = data.y_test.cpu().numpy()
        for g, name in enumerate(data.groups):
            idx = np.flatnonzero(groups == g)
            sub, scheme = split_by_flag(args, labels[idx], m, c, rng)
            parts += [idx[p] for p in sub]
            names += [name] * m
            if own_test:  # the domain's test images, dealt to its clients by their label distributions
                t_idx = np.flatnonzero(test_groups == g)
                test += [t_idx[t] for t in client_test_split(test_labels[t_idx], labels[idx], sub, c, rng)]
        scheme = f"{len(data.groups)} domains x {m} clients, {scheme}"
    else:
        parts, scheme = split_by_flag(args, labels, n, c, rng)
    empty = [k for k, p in enumerate(parts) if len(p) == 0]
    if empty:  # bad input found only now that the data is known: exit 2 with one line, as parser.error
        more = f" (and {len(empty) - 1} more)" if len(empty) > 1 else ""
        flag = "--clients-per-domain" if getattr(args, "clients_per_domain", None) else "--num-clients"
        msg = (
            f"{flag}: client {empty[0]} of {len(parts)}{more} received no training data under {scheme} "
            f"({len(labels)} training samples); use fewer clients"
        )
        refuse(msg)
    if test is None and getattr(args, "client_test", False):
        test = client_test_split(data.y_test.cpu().numpy(), labels, parts, c, rng)
    val = None
    if getattr(args, "val_frac", 0) > 0:  # drawn last: the partition itself does not depend on --val-frac
        val = [rng.permutation(p)[: min(int(args.val_frac * len(p) + 0.5), len(p) - 1)] for p in parts]
        parts = [np.setdiff1d(p, v) for p, v in zip(parts, val)]
    to_dev = lambda ps: [torch.as_tensor(np.sort(p), dtype=torch.long, device=data.y_train.device) for p in ps]
    return Partition(to_dev(parts), to_dev(test) if test is not None else None, scheme, names, val and to_dev(val))


def split_by_flag(args, labels, n, c, rng):
    """(parts, scheme): labels split over n clients by the run's partition flag (and --quantity)."""
    weights = powerlaw_weights(n, rng) if args.quantity == "powerlaw" else np.full(n, 1.0 / n)
    if args.iid:
        parts, scheme = split_iid(len(labels), weights, rng), "iid"
    elif args.shards is not None:
        parts, scheme = split_shards(labels, n, args.shards, weights, rng), f"shards={args.shards}"
    elif args.classes_per_client is not None:
        parts = split_classes(labels, n, c, args.classes_per_client, weights, rng)
        scheme = f"classes-per-client={args.classes_per_client}"
    elif args.alpha is not None:
        parts, scheme = split_dirichlet(labels, n, c, args.alpha, weights, rng), f"dirichlet alpha={args.alpha}"
    elif args.split2:
        parts, scheme = split_classes(labels, 5, c, None, weights, rng, holders=SPLIT2_CLASSES), "split-2"
    elif getattr(args, "disjoint_classes", False):
        parts, scheme = split_disjoint(labels, n, rng), "disjoint-classes"
    else:
        raise ValueError("no partition flag set")
    return parts, scheme + (" powerlaw" if args.quantity == "powerlaw" else "")


def powerlaw_weights(n, rng, exponent=1.5):
    """Client shares following a power law (a few clients hold most of the data)."""
    w = rng.pareto(exponent, n) + 1.0
    return w / w.sum()


def _cut(idx, shares):
    """Split an index array into consecutive pieces with sizes proportional to shares (sum kept)."""
    shares = np.asarray(shares, dtype=float)
    bounds = np.round(np.cumsum(shares) / shares.sum() * len(idx)).astype(int)
    return np.split(idx, bounds[:-1])


def split_iid(n_samples, weights, rng):
    return _cut(rng.permutation(n_samples), weights)


def split_shards(labels, n, s, weights, rng):
    """McMahan et al.: sort by label, cut into n*s equal shards, deal s shards to each client.

    A client holds at most s classes when the shard size divides every class size (CIFAR-10 with
    n=100 and s=2 or 10); otherwise a shard may straddle two classes, as in the original recipe.

    With power-law weights a client gets a number of shards proportional to its weight (at least 1).
    """
    order = np.argsort(labels, kind="stable")
    num_shards = n * s
    shards = np.array_split(order, num_shards)
    counts = np.full(n, s)
    if not np.allclose(weights, weights[0]):
        counts = np.maximum(1, np.floor(weights * (num_shards - n)).astype(int) + 1)
        counts[np.argmax(weights)] += num_shards - counts.sum()
    deal = rng.permutation(num_shards)
    starts = np.concatenate([[0], np.cumsum(counts)])
    return [np.concatenate([shards[j] for j in deal[starts[k] : starts[k + 1]]]) for k in range(n)]


def split_classes(labels, n, c, per_client, weights, rng, holders=None):
    """Each client holds `per_client` distinct classes, dealt round-robin so every class has the
    same number of holders when n*per_client is a multiple of c; a class is split among its holders
    (evenly, or by power-law weight). `holders` gives the class lists directly (split-2)."""
    if holders is None:
        start = rng.permutation(c)  # which class the round-robin begins with is random
        holders = [[int(start[(k * per_client + j) % c]) for j in range(per_client)] for k in range(n)]
    parts = [[] for _ in range(n)]
    for cls in range(c):
        owners = [k for k in range(n) if cls in holders[k]]
        if not owners:
            continue
        idx = rng.permutation(np.flatnonzero(labels == cls))
        for k, piece in zip(owners, _cut(idx, weights[owners])):
            parts[k].append(piece)
    return [np.concatenate(p) if p else np.array([], dtype=int) for p in parts]


def split_disjoint(labels, n, rng):
    """FedLN's "2-2-3 classes" (Table 5, App. C.2): the classes present, in a random order, cut into n disjoint
    sets, the first clients floor(c'/n) classes, the last c' mod n clients one more (PACS: 7 classes over 3
    clients: 2, 2, 3); each client holds every sample of its classes."""
    present = rng.permutation(np.unique(labels))
    sizes = [len(present) // n + (k >= n - len(present) % n) for k in range(n)]
    sets = np.split(present, np.cumsum(sizes)[:-1])
    return [np.flatnonzero(np.isin(labels, s)) for s in sets]


def split_dirichlet(labels, n, c, alpha, weights, rng, min_size=10, max_tries=100):
    """Hsu et al. 2019: per class, proportions over clients ~ Dir(alpha) (times power-law weights).
    Redraws until every client has at least min(min_size, |D|/n) samples; after max_tries draws it
    refuses the flags (exit 2, one line, as parser.error)."""
    need = min(min_size, len(labels) // n)
    for _ in range(max_tries):
        parts = [[] for _ in range(n)]
        for cls in range(c):
            idx = rng.permutation(np.flatnonzero(labels == cls))
            if len(idx) == 0:
                continue
            p = rng.dirichlet(np.full(n, alpha)) * weights
            for k, piece in enumerate(_cut(idx, p)):
                parts[k].append(piece)
        parts = [np.concatenate(p) for p in parts]
        if min(len(p) for p in parts) >= need:
            return parts
    msg = (
        f"--alpha: after {max_tries} draws of Dir({alpha}) some client still had fewer than {need} samples; "
        "use a larger --alpha or fewer --num-clients"
    )
    refuse(msg)


def client_test_split(test_labels, train_labels, parts, c, rng):
    """Deal the test split so that each client's test labels follow its training label distribution:
    the test samples of class y go to the clients holding y, in proportion to their training counts.
    Each client's test set is evaluated on its own, one client at a time (FedBABU's Algorithm 2 and
    official code), so a batch norm without running statistics sees that client's classes only, as there."""
    counts = np.stack([np.bincount(train_labels[p], minlength=c) for p in parts])  # [n, c]
    test = [[] for _ in parts]
    for cls in range(c):
        owners = np.flatnonzero(counts[:, cls])
        if len(owners) == 0:
            continue
        idx = rng.permutation(np.flatnonzero(test_labels == cls))
        for k, piece in zip(owners, _cut(idx, counts[owners, cls])):
            test[k].append(piece)
    return [np.concatenate(t) if t else np.array([], dtype=int) for t in test]


def label_counts(labels, parts, num_classes):
    return [torch.bincount(labels[p], minlength=num_classes).tolist() for p in parts]


# ----------------------------------------------------------------------------------------------
# Rounds and aggregation: client sampling, the lr schedule, weights, weighted sums, FedProx, SCAFFOLD
# ----------------------------------------------------------------------------------------------
def sample_clients(rng, num_clients, frac):
    """The clients of one round: m = max(floor(frac * N), 1) of them (McMahan et al., Alg. 1), without replacement."""
    m = max(int(frac * num_clients + 1e-9), 1)  # the epsilon keeps e.g. 0.29 * 100 at 29, not 28
    return sorted(rng.choice(num_clients, m, replace=False).tolist())


def lr_at(round_idx, args):
    """Step decay: lr * decay^(number of --lr-decay-at fractions of the run already passed)."""
    passed = sum(round_idx >= f * args.rounds for f in args.lr_decay_at)  # never before round 1 of 1
    return args.lr * args.lr_decay**passed


def client_weights(sizes, weighting):
    """Aggregation weights over the sampled clients: n_k / n, or 1/m with --weighting uniform."""
    sizes = torch.as_tensor(sizes, dtype=torch.float64)
    w = torch.ones_like(sizes) if weighting == "uniform" else sizes
    return (w / w.sum()).tolist()


def accumulate(total, state, weight):
    """total += weight * state, entry by entry. Batch-norm running means and variances are averaged
    with the same weights as the parameters (num_batches_tracked too; it only matters for momentum=None;
    load_average rounds such integer entries when loading the sum, instead of truncating)."""
    for k, v in state.items():
        total[k] += weight * v.float()


def load_average(model, total, strict=True):
    """Load the weighted sum of client states (accumulate) into model, each entry cast back to its dtype.
    Integer buffers (num_batches_tracked) are rounded: a float sum such as 9 x (1/9 x 3) can land just
    below the integer, and a cast would truncate it."""
    own = model.state_dict()
    model.load_state_dict({k: v if own[k].is_floating_point() else v.round() for k, v in total.items()}, strict=strict)


def prox_term(params, anchor, mu):
    """FedProx's proximal term mu/2 sum_w ||w - w_t||^2 (Li et al. 2020, Eq. 2); its gradient mu (w - w_t)
    pulls the local model toward w_t. anchor: the global parameters w_t, detached (no gradient may reach
    the global model)."""
    return mu / 2 * sum((w - w0).pow(2).sum() for w, w0 in zip(params, anchor))


# SCAFFOLD (Karimireddy et al. 2020, Alg. 1 with option II), on dicts keyed by parameter name
def scaffold_correction(c, c_i):
    """c - c_i: the drift correction of every local step, y <- y - eta_l (g(y) - c_i + c) (Alg. 1 line 10)."""
    return {n: c[n] - c_i[n] for n in c}


def local_step_sum(steps, lr, momentum=0.0):
    """K eta_l, option II's denominator, for K SGD steps at a constant lr. With heavy-ball momentum rho, K
    steps of a constant gradient move the weights as far as K' plain ones: K' = (K - rho (1 - rho^K) / (1 - rho))
    / (1 - rho) (FedNTD's code, which FedFN's Table 2 runs), K (K + 1) / 2 at rho = 1 (torch accepts it)."""
    if momentum == 0:
        return steps * lr
    if momentum == 1:
        return steps * (steps + 1) / 2 * lr
    return (steps - momentum * (1 - momentum**steps) / (1 - momentum)) / (1 - momentum) * lr


def scaffold_control(c_i, c, x, y, step_sum):
    """Option II (Alg. 1 line 12): c_i+ = c_i - c + (x - y_i) / (K eta_l), x the global and y_i the client's
    parameters after its K steps; step_sum = K eta_l (local_step_sum, or the sum of the lrs of a schedule)."""
    return {n: c_i[n] - c[n] + (x[n] - y[n]) / step_sum for n in c_i}


def scaffold_server(c, delta_sum, num_clients):
    """c <- c + (1/N) sum_{i in S} (c_i+ - c_i) (Alg. 1 line 17; N all clients, not |S|); delta_sum: that sum."""
    return {n: c[n] + delta_sum[n] / num_clients for n in c}


# ----------------------------------------------------------------------------------------------
# Personalization: fine-tune the global model on each client (FedBABU's Algorithm 2, FedFN-FT)
# ----------------------------------------------------------------------------------------------
@dataclass
class FineTuning:
    """Per-client fine-tuning: `epochs` of SGD(lr, momentum) on `part` of the model (the rest frozen), batches of
    batch_size with augmentation `augment`; evaluated after `epochs` and after each epoch of eval_epochs (0: before
    fine-tuning); amp: bfloat16 autocast."""

    epochs: int
    lr: float
    part: str  # "full" | "body" | "head"
    batch_size: int
    augment: str
    eval_epochs: tuple = ()
    momentum: float = 0.9
    amp: bool = False


def personalize(model, global_state, data, train_parts, test_parts, ft, forward=None):
    """Per-client fine-tuning and evaluation (FedBABU, Oh et al. 2022, Algorithm 2); method-neutral.

    For each client k: load global_state into `model` (reused, no copies), fine-tune ft.part of it (the rest
    frozen: requires_grad off and not in the optimizer, and a frozen body is kept in eval mode so its batch-norm
    running statistics do not move either) on data.x_train[train_parts[k]] with the settings `ft` (FineTuning),
    and evaluate on data.x_test[test_parts[k]] after each epoch e in ft.eval_epochs (e = 0: before fine-tuning)
    and after ft.epochs; training runs max(ft.epochs, *ft.eval_epochs) epochs. `forward(model, x) -> logits`
    (default model(x)) is used for both the fine-tuning loss and evaluation. Clients with an empty test set are
    skipped. `model` is left holding the last client's weights.

    Returns {"acc_mean": {e: mean accuracy over clients}, "acc_std": {e: std over clients (ddof 0)},
             "per_client": {e: [accuracy of each client in "clients"]}, "clients": [k, ...]},
    keyed by the evaluated epochs e (ints, sorted).
    """
    forward = forward or (lambda m, x: m(x))
    points = sorted(set(ft.eval_epochs) | {ft.epochs})
    params = {"full": model, "body": model.body, "head": model.head}[ft.part].parameters()
    trainable = {id(p) for p in params}
    for p in model.parameters():
        p.requires_grad_(id(p) in trainable)
    opt_params = [p for p in model.parameters() if p.requires_grad]
    clients = [k for k in range(len(train_parts)) if len(test_parts[k]) > 0]
    per_client = {e: [] for e in points}
    for k in clients:
        model.load_state_dict(global_state)
        opt = torch.optim.SGD(opt_params, lr=ft.lr, momentum=ft.momentum)
        for e in range(points[-1] + 1):
            if e > 0:  # one epoch of fine-tuning
                model.train()
                if ft.part == "head":
                    model.body.eval()
                for batch in client_batches(train_parts[k], ft.batch_size, epochs=1):
                    x, y = prepare_batch(data.x_train[batch], data, ft.augment), data.y_train[batch]
                    with autocast(x.device, ft.amp):
                        loss = F.cross_entropy(forward(model, x).float(), y)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
            if e in per_client:
                model.eval()
                t = test_parts[k]
                per_client[e].append(
                    evaluate(lambda x: forward(model, x), data.x_test[t], data.y_test[t], data, amp=ft.amp)[0]
                )
    for p in model.parameters():
        p.requires_grad_(True)
    return {
        "acc_mean": {e: float(np.mean(a)) for e, a in per_client.items()},
        "acc_std": {e: float(np.std(a)) for e, a in per_client.items()},
        "per_client": per_client,
        "clients": clients,
    }


# ----------------------------------------------------------------------------------------------
# Models: every model has .body (images -> penultimate feature vector) and .head (one nn.Linear);
# @register_model makes --model NAME find them. The papers' models are marked with their paper.
# ----------------------------------------------------------------------------------------------
def make_norm(kind, channels, groups=32, affine=True, conv=True):
    """An activation normalization, for conv maps [B, C, H, W] (conv=True) or features [B, C]: bn = batch
    norm (the scripts average its running statistics with the weights); gn = group norm with `groups`
    groups, fewer if the layer is narrower (32: Wu & He 2018; normcnn: 2, FedLN Section 5.3); ln = layer
    norm over (C, H, W) or the features, GroupNorm(1, C) with a per-channel affine (FedLN's code);
    none | nf | fn = nothing here (nf: the weight-standardized convolutions of make_conv, NF-ResNet,
    Brock et al. 2021a; fn: ScaleNorm on the last feature). affine: learnable gamma, beta. eps 1e-5."""
    if kind == "bn":
        return (nn.BatchNorm2d if conv else nn.BatchNorm1d)(channels, affine=affine)
    if kind in ("gn", "ln"):
        return nn.GroupNorm(1 if kind == "ln" else min(groups, channels), channels, affine=affine)
    if kind in ("none", "nf", "fn"):
        return nn.Identity()
    raise ValueError(f"unknown norm '{kind}'")


MODELS = {}


def register_model(name):
    def wrap(fn):
        MODELS[name] = fn
        return fn

    return wrap


def build_model(name, data, **options):
    """MODELS[name](in_channels, num_classes, image_size, **options)."""
    return MODELS[name](data.in_channels, data.num_classes, data.image_size, **options)


class Classifier(nn.Module):
    """body -> feature vector -> head. Methods reach the classifier as model.head."""

    def __init__(self, body, feature_dim, num_classes, head_bias=True):
        super().__init__()
        self.body = body
        self.head = nn.Linear(feature_dim, num_classes, bias=head_bias)

    def forward(self, x):
        return self.head(self.body(x))


def flat_dim(body, in_channels, image_size):
    with torch.no_grad():
        return body(torch.zeros(2, in_channels, image_size, image_size)).shape[1]


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
    body = nn.Sequential(
        nn.Flatten(), nn.Linear(in_channels * image_size**2, 200), nn.ReLU(), nn.Linear(200, 200), nn.ReLU()
    )
    return Classifier(body, 200, num_classes)


# FedBABU's 4convNet, 3convNet and MobileNet
def _conv_bn_pool(cin, cout=64):
    """FedBABU Appendix A.1 block: conv3x3 (bias) -> batch norm without running statistics
    (track_running_stats=False: batch statistics in training and evaluation, nothing to aggregate) -> ReLU
    -> max-pool 2."""
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout, track_running_stats=False), nn.ReLU(), nn.MaxPool2d(2)
    )


def convnet(in_channels, num_classes, image_size, blocks, width=64):
    body = nn.Sequential(*[_conv_bn_pool(in_channels if i == 0 else width, width) for i in range(blocks)], nn.Flatten())
    return Classifier(body, flat_dim(body, in_channels, image_size), num_classes)


@register_model("convnet4")
def convnet4(in_channels, num_classes, image_size, width=64, **_):
    """FedBABU 4convNet (CIFAR-10): four conv3x3-64/BN/ReLU/pool blocks, linear 256 -> C at 32x32."""
    return convnet(in_channels, num_classes, image_size, 4, width)


@register_model("convnet4-tiny")
def convnet4_tiny(in_channels, num_classes, image_size, **_):
    """4convNet with 8 channels instead of 64: for tests and CPU smoke runs, not in the paper."""
    return convnet(in_channels, num_classes, image_size, 4, width=8)


@register_model("convnet4-narrow")
def convnet4_narrow(in_channels, num_classes, image_size, **_):
    """4convNet with 32 channels instead of 64, not in the paper: a CPU-sized FedBABU proxy whose head keeps
    dimension d = 128 at 32x32 (the paper's 256 / 2; convnet4-tiny's 32), so its frozen random head stays
    nearly orthogonal (benchmarks/proxy_properties.py); about a quarter of convnet4's multiply-adds."""
    return convnet(in_channels, num_classes, image_size, 4, width=32)


@register_model("convnet3")
def convnet3(in_channels, num_classes, image_size, width=64, **_):
    """FedBABU 3convNet (EMNIST): three conv3x3-64/BN/ReLU/pool blocks, linear 576 -> C at 28x28."""
    return convnet(in_channels, num_classes, image_size, 3, width)


MOBILENET_CFG = [64, (128, 2), 128, (256, 2), 256, (512, 2), 512, 512, 512, 512, 512, (1024, 2), 1024]


@register_model("mobilenet")
def mobilenet(in_channels, num_classes, image_size, **_):
    """MobileNet v1 (Howard et al. 2017) in the CIFAR layout of kuangliu/pytorch-cifar used by FedBABU:
    conv3x3-32 stride 1, then depthwise-3x3/pointwise-1x1 blocks per MOBILENET_CFG (planes or
    (planes, stride)), batch norm without running statistics, global average pool, linear 1024 -> C.
    (The original uses avg_pool2d(2) on the 2x2 map of a 32x32 input: the same thing at 32x32.)"""
    bn = lambda c: nn.BatchNorm2d(c, track_running_stats=False)
    layers, cin = [nn.Conv2d(in_channels, 32, 3, 1, 1, bias=False), bn(32), nn.ReLU()], 32
    for item in MOBILENET_CFG:
        cout, stride = item if isinstance(item, tuple) else (item, 1)
        layers += [
            nn.Conv2d(cin, cin, 3, stride, 1, groups=cin, bias=False),
            bn(cin),
            nn.ReLU(),
            nn.Conv2d(cin, cout, 1, bias=False),
            bn(cout),
            nn.ReLU(),
        ]
        cin = cout
    body = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
    return Classifier(body, cin, num_classes)


# FedFN's VGG11 (FedNTD's, without batch norm) and a CPU-sized one
VGG11_CFG = [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]  # Simonyan & Zisserman, config "A"
VGG11_NARROW_CFG = [16, "M", 32, "M", 64, 64, "M", 128, 128, "M", 128, 128]  # ours: a quarter width, 4 pools


def vgg(in_channels, num_classes, image_size, cfg):
    """VGG without batch norm (vgg11's docstring): conv3x3 (bias) -> ReLU per channel entry of cfg, max-pool 2 at
    "M" (skipped at 1x1), flatten, fc -> 512 -> ReLU -> 512 -> ReLU, head 512 -> C."""
    layers, cin, size = [], in_channels, image_size
    for v in cfg:
        if v == "M":
            if size >= 2:
                layers.append(nn.MaxPool2d(2))
                size //= 2
            continue
        conv = nn.Conv2d(cin, v, 3, padding=1)
        nn.init.normal_(conv.weight, 0, math.sqrt(2.0 / (9 * v)))
        nn.init.zeros_(conv.bias)
        layers += [conv, nn.ReLU()]
        cin = v
    conv = nn.Sequential(*layers, nn.Flatten())
    body = nn.Sequential(
        conv, nn.Linear(flat_dim(conv, in_channels, image_size), 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU()
    )
    return Classifier(body, 512, num_classes)


@register_model("vgg11")
def vgg11(in_channels, num_classes, image_size, **_):
    """VGG11 for CIFAR as in the FedNTD code base (train_tools/models/vgg.py, `vgg11`, the model its
    registry builds; fedfn.md B.2 ran Tables 2 and 8 on that code base, and FedBABU's has no VGG):
    conv3x3 (bias) -> ReLU per VGG11_CFG entry (no batch norm), max-pool 2 at "M", then
    fc 512*s*s -> 512 -> ReLU -> 512 -> ReLU (body output, d = 512), head linear 512 -> C with bias;
    no dropout. Conv init N(0, 2/(9*C_out)), bias 0; linear layers keep PyTorch's default init.
    A max-pool is skipped when the map is already 1x1 (28x28 inputs: 28-14-7-3-1, FedNTD drops the last one)."""
    return vgg(in_channels, num_classes, image_size, VGG11_CFG)


@register_model("vgg11-narrow")
def vgg11_narrow(in_channels, num_classes, image_size, **_):
    """VGG11 for a 2-core CPU, not in the paper: vgg11's layers (no batch norm, the same init) with a quarter
    of the channels (16, 32, 64, 64, 128, 128, 128, 128) and the fifth max-pool left out, so the flattened
    conv output keeps VGG11's 512 entries (128 x 2 x 2) and fc 512 -> 512 -> 512 and the head are VGG11's.
    Why that matches VGG11's feature and head-row norms at init (benchmarks/proxy_properties.py): the
    convs' N(0, 2/(9*C_out)) init multiplies the mean square by C_in/C_out per layer, so the conv output's
    norm does not depend on the widths, and PyTorch's default linear init (weight variance 1/(3 d_in)) scales
    a layer's squared output norm by about d_out/(3 d_in), VGG11's as long as fc 1 reads 512 entries (with
    all five pools, 128 -> 512 makes the feature about 1.35x VGG11's, measured). About a tenth of VGG11's
    time per image on a CPU (1,107,562 parameters at 3 x 32 x 32 and 10 classes)."""
    return vgg(in_channels, num_classes, image_size, VGG11_NARROW_CFG)


# FedLN's CNN (Table 7) with normalization slots, and the scaled feature normalization
def scale_norm(x, scale="sqrt-d", eps=1e-5):
    """n(x) = s x / max(eps, ||x||_2), each sample over all its entries (a [B, d] feature, or a conv map's
    (C, H, W), as layer norm's statistics). s = sqrt(d) ("sqrt-d"): FedLN's scale normalization (Zhang et al.
    2024, Section 2, Eqs. 6-7), so ||n(x)|| = sqrt(d), the norm an n_MV output has; s = 1: FedFN's unit feature
    (Kim et al. 2023, Section 4.1)."""
    flat = x.flatten(1)
    s = math.sqrt(flat.shape[1]) if scale == "sqrt-d" else scale
    return s * (x / flat.norm(dim=1).clamp_min(eps).view(-1, *[1] * (x.dim() - 1)))


class ScaleNorm(nn.Module):
    """scale_norm as a layer (FedLN's n on the last feature, or in every normalization slot)."""

    def __init__(self, scale="sqrt-d", eps=1e-5):
        super().__init__()
        self.scale, self.eps = scale, eps

    def forward(self, x):
        return scale_norm(x, self.scale, self.eps)


@register_model("normcnn")
def normcnn(in_channels, num_classes, image_size, norm="none", ln_affine=True, norm_after_act=True, width=64, **_):
    """Zhang et al. 2024, Table 7: conv5x5-64 (no padding), pool 2, conv5x5-64, pool 2, dense -> 384, head
    384 -> C; ReLU; no bias terms anywhere, head included (Assumption 1, scale equivariance). The dense
    layer is 1600 -> 384 for 32 x 32 inputs, as in Table 7 (whose "(28, 28, 3)" input row would give 1024).
    norm (none | ln | gn | bn | fn) fills the slot after each ReLU, before pooling (Appendix C.1), or before
    each ReLU with norm_after_act=False (Table 6 "before"); ln_affine: learnable gamma, beta of ln/gn/bn
    (Table 6 "learnable") or none ("static"). fn: no normalization inside, ScaleNorm on the 384-d feature.
    width: channels of both convolutions (64 in Table 7; smaller only for quick tests)."""

    def layer(op, channels):
        n = make_norm(norm, channels, groups=2, affine=ln_affine, conv=isinstance(op, nn.Conv2d))
        return [op, nn.ReLU(), n] if norm_after_act else [op, n, nn.ReLU()]

    side = ((image_size - 4) // 2 - 4) // 2  # computed, not probed: a probe pass would move BN statistics
    body = nn.Sequential(
        *layer(nn.Conv2d(in_channels, width, 5, bias=False), width),
        nn.MaxPool2d(2),
        *layer(nn.Conv2d(width, width, 5, bias=False), width),
        nn.MaxPool2d(2),
        nn.Flatten(),
        *layer(nn.Linear(width * side * side, 384, bias=False), 384),
    )
    if norm == "fn":
        body.append(ScaleNorm())
    return Classifier(body, 384, num_classes, head_bias=False)


# FedNNNN's LeNet and 6-layer CNN
@register_model("lenet")
def lenet(in_channels, num_classes, image_size, **_):
    """Nagura et al. 2020, Table 3 (MNIST): conv5x5-20, pool, conv5x5-50, pool, fc 500, head; all with
    bias, no padding (28x28 -> 50x4x4; 431,080 parameters)."""
    side = ((image_size - 4) // 2 - 4) // 2
    body = nn.Sequential(
        nn.Conv2d(in_channels, 20, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(20, 50, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(50 * side * side, 500),
        nn.ReLU(),
    )
    return Classifier(body, 500, num_classes)


@register_model("cnn6")
def cnn6(in_channels, num_classes, image_size, width=32, **_):
    """Nagura et al. 2020, Table 4 (CIFAR-10): [conv3x3 (padding 1) + BN + ReLU] x2 per stage with 32, 64,
    128 channels, max-pool after each stage, then fc 382, fc 192 and the head; all layers with bias
    (1,146,088 parameters at 32x32). 382 as printed, twice, in Table 4 (Fc1 out, Fc2 in), though likely
    a typo for the 384 of the TensorFlow CIFAR-10 tutorial's 384-192 head. `width` is the first stage's
    channels (32 in the paper; the stages have width, 2*width, 4*width). Batch norm keeps running statistics."""
    layers, cin = [], in_channels
    for cout in (width, width, "pool", 2 * width, 2 * width, "pool", 4 * width, 4 * width, "pool"):
        if cout == "pool":
            layers.append(nn.MaxPool2d(2))
            continue
        layers += [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU()]
        cin = cout
    side = image_size // 8  # computed, not probed: a probe pass would move the BN running statistics
    body = nn.Sequential(
        *layers, nn.Flatten(), nn.Linear(4 * width * side * side, 382), nn.ReLU(), nn.Linear(382, 192), nn.ReLU()
    )
    return Classifier(body, 192, num_classes)


@register_model("cnn6-narrow")
def cnn6_narrow(in_channels, num_classes, image_size, **_):
    """cnn6 with a quarter of the channels (8, 16, 32; fc 382-192 kept): a CPU-sized model that, unlike
    convnet4-tiny, keeps batch-norm running statistics (FedNNNN's evaluation model averages them)."""
    return cnn6(in_channels, num_classes, image_size, width=8)


# ----------------------------------------------------------------------------------------------
# ResNet: one implementation; normalization (batch, group, layer, or none with weight-standardized
# NF blocks, ANFR) and channel attention (SE, ECA, CBAM) are options
# ----------------------------------------------------------------------------------------------
# gamma = 1/std(relu(z)), z ~ N(0, 1), as measured by timm and DeepMind's NFNets (closed form 1.71286)
RELU_GAMMA = 1.7139588594436646
NF_ALPHA = 0.2  # alpha: scale of each residual branch (Brock et al. 2021a; timm NfCfg.alpha)
NF_ATTN_GAIN = 2.0  # attention output x2 in NF blocks, since a sigmoid gate starts near 0.5 (timm NfCfg.attn_gain)


class ScaledStdConv2d(nn.Conv2d):
    """Scaled Weight Standardization (ANFR Eq. 5; Brock et al. 2021a), per output channel c:
    W_hat_c = g_c * gamma / sqrt(fan_in) * (W_c - mean(W_c)) / std(W_c), statistics over the
    fan_in = C_in * k * k weights of channel c (Eq. 5 writes C_in for k = 1); learnable gain g and
    bias beta (A' = X * W_hat + beta), gamma fixed by the nonlinearity that feeds the conv.
    Init as timm: kaiming-normal weights (irrelevant after standardization), zero bias."""

    def __init__(self, cin, cout, kernel, stride=1, padding=0, gamma=1.0, gain_init=1.0, eps=1e-5):
        super().__init__(cin, cout, kernel, stride, padding, bias=True)
        self.gain = nn.Parameter(torch.full((cout, 1, 1, 1), float(gain_init)))
        self.scale = gamma / math.sqrt(self.weight[0].numel())  # gamma / sqrt(fan_in)
        self.eps = eps  # timm's std_conv_eps for NF-ResNets
        nn.init.kaiming_normal_(self.weight, nonlinearity="linear")
        nn.init.zeros_(self.bias)

    def standardized_weight(self):
        """(W - mu_c) / sigma_c per output channel (Eq. 5 before gain and scale)."""
        mean = self.weight.mean((1, 2, 3), keepdim=True)
        var = self.weight.var((1, 2, 3), keepdim=True, unbiased=False)
        return (self.weight - mean) / torch.sqrt(var + self.eps)

    def forward(self, x):
        return F.conv2d(x, self.gain * self.scale * self.standardized_weight(), self.bias, self.stride, self.padding)


def resnet_conv(cin, cout, kernel, stride=1):
    """A convolution of the normalized ResNets (an activation norm follows it): no bias, padding kernel // 2."""
    return nn.Conv2d(cin, cout, kernel, stride, kernel // 2, bias=False)


def nf_conv(cin, cout, kernel, stride=1, gain_init=1.0):
    """A convolution of the NF-ResNets: Scaled Weight Standardized for a ReLU input (gamma = RELU_GAMMA), with
    bias and gain g starting at gain_init (ANFR Eq. 5; ScaledStdConv2d above), padding kernel // 2."""
    return ScaledStdConv2d(cin, cout, kernel, stride, kernel // 2, gamma=RELU_GAMMA, gain_init=gain_init)


def round_channels(v, divisor):
    """timm's make_divisible(v, divisor, round_limit=0): the nearest multiple of divisor, at least divisor."""
    return max(divisor, int(v + divisor / 2) // divisor * divisor)


class SqueezeExcite(nn.Module):
    """Hu et al. 2018: channel weights = sigmoid(MLP(global average pool)), reduction r; the hidden width
    C/r rounded to a multiple of 8, at least 8 (timm SEModule, as in seresnet50 and nf_seresnet50)."""

    def __init__(self, channels, reduction=16):
        super().__init__()
        hidden = round_channels(channels / reduction, 8)
        self.fc1, self.fc2 = nn.Conv2d(channels, hidden, 1), nn.Conv2d(hidden, channels, 1)

    def weights(self, x):  # [B, C, 1, 1] channel weights (read by anfr.py --analyze)
        return torch.sigmoid(self.fc2(F.relu(self.fc1(x.mean((2, 3), keepdim=True)))))

    def forward(self, x):
        return x * self.weights(x)


class EfficientChannelAttention(nn.Module):
    """ECA (Wang et al. 2020): channel weights = sigmoid(conv1d_k over channels of the global average
    pool), no dimensionality reduction; k = |(log2 C + 1) / 2| rounded up to odd, at least 3 (timm EcaModule)."""

    def __init__(self, channels, gamma=2, b=1):
        super().__init__()
        t = int(abs(math.log2(channels) + b) / gamma)
        k = max(t if t % 2 else t + 1, 3)
        self.conv = nn.Conv1d(1, 1, k, padding=(k - 1) // 2, bias=False)

    def weights(self, x):  # [B, C, 1, 1]
        return torch.sigmoid(self.conv(x.mean((2, 3)).unsqueeze(1))).transpose(1, 2).unsqueeze(-1)

    def forward(self, x):
        return x * self.weights(x)


class CBAM(nn.Module):
    """CBAM (Woo et al. 2018; timm CbamModule): channel gate sigmoid(MLP(avg pool) + MLP(max pool)) with
    a shared bias-free MLP (reduction 16), then spatial gate sigmoid(conv7x7([mean_c, max_c])); the
    spatial conv is followed by the network's norm (bn: batch norm; nf: weight-standardized conv with bias)."""

    def __init__(self, channels, norm="bn", reduction=16):
        super().__init__()
        hidden = round_channels(channels / reduction, 1)  # timm ChannelAttn: C/r rounded, at least 1
        self.fc1, self.fc2 = nn.Conv2d(channels, hidden, 1, bias=False), nn.Conv2d(hidden, channels, 1, bias=False)
        conv = ScaledStdConv2d(2, 1, 7, 1, 3) if norm == "nf" else nn.Conv2d(2, 1, 7, 1, 3, bias=False)
        self.spatial = nn.Sequential(conv, make_norm(norm, 1))

    def weights(self, x):  # channel weights [B, C, 1, 1]
        mlp = lambda z: self.fc2(F.relu(self.fc1(z)))
        return torch.sigmoid(mlp(x.mean((2, 3), keepdim=True)) + mlp(x.amax((2, 3), keepdim=True)))

    def forward(self, x):
        x = x * self.weights(x)
        return x * torch.sigmoid(self.spatial(torch.cat([x.mean(1, keepdim=True), x.amax(1, keepdim=True)], 1)))


def make_attention(kind, channels, norm="bn"):
    """Channel attention after a block's last conv: none | se | eca | cbam (the last two in the ANFR block)."""
    if kind is None or kind == "none":
        return nn.Identity()
    if kind == "se":
        return SqueezeExcite(channels)
    if kind == "eca":
        return EfficientChannelAttention(channels)
    if kind == "cbam":
        return CBAM(channels, norm)
    raise ValueError(f"unknown attention '{kind}'")


def projection(cin, cout, stride, norm):
    """The shortcut of BasicBlock and Bottleneck: the identity, or where the block changes the shape a conv1x1 with
    the block's stride, then the norm."""
    if stride == 1 and cin == cout:
        return nn.Identity()
    return nn.Sequential(resnet_conv(cin, cout, 1, stride), make_norm(norm, cout))


class BasicBlock(nn.Module):
    """He et al. 2016, ResNet-18/34: conv3x3 -> norm -> ReLU -> conv3x3 -> norm -> attention, plus the
    shortcut, then ReLU. norm: bn | gn | ln | none (make_norm)."""

    expansion = 1
    shortcut_norm = True  # FedLNBasicBlock: the norm goes on the sum instead

    def __init__(self, cin, planes, stride, norm="bn", attention=None):
        super().__init__()
        cout = planes * self.expansion
        self.conv1, self.n1 = resnet_conv(cin, planes, 3, stride), make_norm(norm, planes)
        self.conv2, self.n2 = resnet_conv(planes, cout, 3), make_norm(norm, cout)
        self.attn = make_attention(attention, cout, norm)
        self.shortcut = projection(cin, cout, stride, norm if self.shortcut_norm else "none")

    def forward(self, x):
        out = F.relu(self.n1(self.conv1(x)))
        out = self.attn(self.n2(self.conv2(out)))
        return F.relu(out + self.shortcut(x))


class Bottleneck(nn.Module):
    """He et al. 2016, ResNet-26/50: conv1x1 -> norm -> ReLU -> conv3x3 (the block's stride) -> norm -> ReLU ->
    conv1x1 to 4x the planes -> norm -> attention, plus the shortcut, then ReLU. norm: bn | gn | ln | none."""

    expansion = 4
    shortcut_norm = True  # FedLNBottleneck: the norm goes on the sum instead

    def __init__(self, cin, planes, stride, norm="bn", attention=None):
        super().__init__()
        cout = planes * self.expansion
        self.conv1, self.n1 = resnet_conv(cin, planes, 1), make_norm(norm, planes)
        self.conv2, self.n2 = resnet_conv(planes, planes, 3, stride), make_norm(norm, planes)
        self.conv3, self.n3 = resnet_conv(planes, cout, 1), make_norm(norm, cout)
        self.attn = make_attention(attention, cout, norm)
        self.shortcut = projection(cin, cout, stride, norm if self.shortcut_norm else "none")

    def forward(self, x):
        out = F.relu(self.n1(self.conv1(x)))
        out = F.relu(self.n2(self.conv2(out)))
        out = self.attn(self.n3(self.conv3(out)))
        return F.relu(out + self.shortcut(x))


class FedLNBasicBlock(BasicBlock):
    """FedLN's ResNet-18 block (Zhang et al. 2024, Eq. 10 and Appendix C.1; the authors' code): BasicBlock's
    layers with the norm after each ReLU, and on the block's sum instead of its shortcut."""

    shortcut_norm = False

    def forward(self, x):
        out = self.n1(F.relu(self.conv1(x)))
        out = self.attn(self.conv2(out))
        return self.n2(F.relu(out + self.shortcut(x)))


class FedLNBottleneck(Bottleneck):
    """FedLN's normalization (Eq. 10) in a bottleneck: Bottleneck's layers with the norm after each ReLU, and on
    the block's sum instead of its shortcut."""

    shortcut_norm = False

    def forward(self, x):
        out = self.n1(F.relu(self.conv1(x)))
        out = self.n2(F.relu(self.conv2(out)))
        return self.n3(F.relu(self.attn(self.conv3(out)) + self.shortcut(x)))


def nf_downsample(cin, cout, stride):
    """The shortcut of an NF transition block, timm's DownsampleAvg (named as timm's: pool, conv): a 2x2 average
    pool (strided blocks only; ceil mode, padding not counted), then a conv1x1 at stride 1."""
    shortcut = nn.Sequential()
    shortcut.add_module(
        "pool", nn.AvgPool2d(2, stride, ceil_mode=True, count_include_pad=False) if stride > 1 else nn.Identity()
    )
    shortcut.add_module("conv", nf_conv(cin, cout, 1))
    return shortcut


class NFBasicBlock(nn.Module):
    """NF-ResNet basic block (Brock et al. 2021a; timm's NormFreeBlock; ANFR with attention), no activation norm.
    Pre-activation h = relu(x) * beta, beta = 1/sqrt(expected Var(x)) (ResNetBody); branch
    f(h) = attn(conv3x3(relu(conv3x3(h)))) with Scaled WS convs, the last one's gain starting at last_gain_init
    (timm: 0, so the block starts as its shortcut); x_{l+1} = shortcut + alpha * attn_gain * f(h), the shortcut x
    itself, or for a transition block (a new stride or width) the downsampling conv applied to h."""

    expansion = 1
    alpha = NF_ALPHA

    def __init__(self, cin, planes, stride, attention=None, beta=1.0, last_gain_init=0.0):
        super().__init__()
        cout = planes * self.expansion
        self.beta, self.transition = beta, stride != 1 or cin != cout
        self.attn_gain = NF_ATTN_GAIN if attention not in (None, "none") else 1.0
        self.conv1 = nf_conv(cin, planes, 3, stride)
        self.conv2 = nf_conv(planes, cout, 3, gain_init=last_gain_init)
        self.attn = make_attention(attention, cout, "nf")
        self.shortcut = nf_downsample(cin, cout, stride) if self.transition else nn.Identity()

    def forward(self, x):
        h = F.relu(x) * self.beta
        branch = self.attn(self.conv2(F.relu(self.conv1(h))))
        return (self.shortcut(h) if self.transition else x) + self.alpha * self.attn_gain * branch


class NFBottleneck(nn.Module):
    """NF-ResNet bottleneck (timm's NormFreeBlock in nf_resnet50): NFBasicBlock with the branch
    f(h) = attn(conv1x1(relu(conv3x3(relu(conv1x1(h)))))) to 4x the planes, the stride on the conv3x3."""

    expansion = 4
    alpha = NF_ALPHA

    def __init__(self, cin, planes, stride, attention=None, beta=1.0, last_gain_init=0.0):
        super().__init__()
        cout = planes * self.expansion
        self.beta, self.transition = beta, stride != 1 or cin != cout
        self.attn_gain = NF_ATTN_GAIN if attention not in (None, "none") else 1.0
        self.conv1 = nf_conv(cin, planes, 1)
        self.conv2 = nf_conv(planes, planes, 3, stride)
        self.conv3 = nf_conv(planes, cout, 1, gain_init=last_gain_init)
        self.attn = make_attention(attention, cout, "nf")
        self.shortcut = nf_downsample(cin, cout, stride) if self.transition else nn.Identity()

    def forward(self, x):
        h = F.relu(x) * self.beta
        branch = self.attn(self.conv3(F.relu(self.conv2(F.relu(self.conv1(h))))))
        return (self.shortcut(h) if self.transition else x) + self.alpha * self.attn_gain * branch


# depth -> (block kind, blocks per stage); the block of a kind for each placement of the norm
RESNET_LAYOUT = {
    18: ("basic", [2, 2, 2, 2]),
    26: ("bottleneck", [2, 2, 2, 2]),
    34: ("basic", [3, 4, 6, 3]),
    50: ("bottleneck", [3, 4, 6, 3]),
}
RESNET_BLOCKS = {
    "basic": {"conv-norm-relu": BasicBlock, "norm-after-act": FedLNBasicBlock, "nf": NFBasicBlock},
    "bottleneck": {"conv-norm-relu": Bottleneck, "norm-after-act": FedLNBottleneck, "nf": NFBottleneck},
}


class ResNetBody(nn.Module):
    """He et al. 2016 ResNet up to global average pooling, with one of three kinds of block:

    - norm bn | gn | ln | none: BasicBlock / Bottleneck, conv -> norm -> ReLU;
    - norm_after_act=True: FedLNBasicBlock / FedLNBottleneck, the norm after each ReLU (the stem's too) and on the
      block's sum, not its shortcut (FedLN, Zhang et al. 2024, Eq. 10 and Appendix C.1);
    - norm 'nf': NFBasicBlock / NFBottleneck, weight-standardized and pre-activated (NF-ResNet, Brock et al. 2021a;
      ANFR): the stem ends at its conv, each block gets beta = 1/sqrt(expected Var of its input), where
      Var(x_{l+1}) = Var(x_l) + alpha^2 and a transition block's shortcut first resets it to 1 (timm resets at
      each stage's first block, always a transition in its NF-ResNets), and a ReLU ends the last block.

    stem 'cifar': conv3x3 stride 1, no max-pool (32x32 inputs); 'imagenet': conv7x7 stride 2 + max-pool.
    """

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
        kind, layers = RESNET_LAYOUT[depth]
        placement = "nf" if norm == "nf" else "norm-after-act" if norm_after_act else "conv-norm-relu"
        block = RESNET_BLOCKS[kind][placement]
        kernel, stride = (3, 1) if stem == "cifar" else (7, 2)
        if placement == "nf":
            stem_layers = [nf_conv(in_channels, width, kernel, stride)]
        elif placement == "norm-after-act":
            stem_layers = [resnet_conv(in_channels, width, kernel, stride), nn.ReLU(), make_norm(norm, width)]
        else:
            stem_layers = [resnet_conv(in_channels, width, kernel, stride), make_norm(norm, width), nn.ReLU()]
        self.stem = nn.Sequential(*stem_layers, *([nn.MaxPool2d(3, 2, 1)] if stem == "imagenet" else []))
        stages, cin, expected_var = [], width, 1.0
        for i, blocks in enumerate(layers):
            planes = width * 2**i
            for j in range(blocks):
                stride = 2 if (j == 0 and i > 0) else 1
                if placement == "nf":
                    beta = expected_var**-0.5
                    stages.append(block(cin, planes, stride, attention, beta=beta, last_gain_init=last_gain_init))
                    expected_var = (1.0 if stages[-1].transition else expected_var) + NF_ALPHA**2
                else:
                    stages.append(block(cin, planes, stride, norm, attention))
                cin = planes * block.expansion
        self.stages = nn.Sequential(*stages)
        self.final_act = nn.ReLU() if placement == "nf" else nn.Identity()  # NF: the last block ends without ReLU
        self.out_dim = cin

    def forward(self, x):
        return self.final_act(self.stages(self.stem(x))).mean((2, 3))


def resnet(
    in_channels,
    num_classes,
    image_size,
    depth=18,
    width=64,
    norm="bn",
    attention=None,
    stem="cifar",
    norm_after_act=False,
    last_gain_init=0.0,
    init="timm",
    **_,
):
    """The one ResNet (ResNetBody, a linear head), started as timm's (init="timm", see timm_init) or with
    PyTorch's default init of each layer (init="torch")."""
    body = ResNetBody(
        in_channels, depth, width, norm, attention, stem, norm_after_act=norm_after_act, last_gain_init=last_gain_init
    )
    model = Classifier(body, body.out_dim, num_classes)
    if init == "timm" and not norm_after_act:  # FedLN's ResNet (norm after the activation) keeps PyTorch's init
        timm_init(model, norm)
    return model


def timm_init(model, norm):
    """Start a ResNet as timm's fresh ones start. Activation-normed (resnet50, resnet50_gn, seresnet50:
    ResNet.init_weights(zero_init_last=True)): every Conv2d weight (SE's and CBAM's too) kaiming-normal,
    fan-out, gain sqrt(2), their biases PyTorch's; the last norm of each residual branch with weight 0, so
    every block starts as its shortcut (norm none: no norm, the branches stay open); the head PyTorch's.
    NF (nf_resnet50, nf_seresnet50: NormFreeNet's init): every Conv2d weight kaiming-normal, fan-in, gain 1,
    bias 0; the head's weight N(0, 0.01^2), bias 0; the last conv's gain of each branch is last_gain_init
    (0 in timm). ECA's Conv1d keeps PyTorch's in both."""
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
        return
    if norm == "none":  # no norm to start at zero: the branches start open
        return
    for block in model.body.stages:
        nn.init.zeros_(block.n3.weight if hasattr(block, "n3") else block.n2.weight)


@register_model("resnet18")
def resnet18(in_channels, num_classes, image_size, **options):
    return resnet(in_channels, num_classes, image_size, depth=18, **options)


@register_model("resnet50")
def resnet50(in_channels, num_classes, image_size, **options):
    return resnet(in_channels, num_classes, image_size, depth=50, **options)


# the one ResNet with its options: depth, width, norm, attention, stem (anfr.py --arch)
register_model("resnet")(resnet)


# ==============================================================================================
# Run machinery: nothing below is federated learning. Flag checks, dataset files and caches, the
# run folder's files (RunFolder), the loop's control (RoundLoop), the divergence stop, atomic saves,
# RNG state, several processes (torchrun).
# ==============================================================================================


# --- Flag checks: exit status 2 and one line naming the flag, before any work -----------------
TORCHVISION_DATASETS = ["mnist", "fashionmnist", "emnist", "cifar10", "cifar100", "svhn"]
DATASETS = TORCHVISION_DATASETS + ["folder", "tinyimagenet", "synthetic"]
PARTITION_FLAGS = {
    "iid": "--iid",
    "shards": "--shards",
    "classes_per_client": "--classes-per-client",
    "alpha": "--alpha",
    "split2": "--split2",
    "disjoint_classes": "--disjoint-classes",
    "natural": "--natural",
}
NUM_CLASSES = {
    "mnist": 10,
    "fashionmnist": 10,
    "emnist": 62,
    "cifar10": 10,
    "cifar100": 100,
    "svhn": 10,
    "tinyimagenet": 200,
    "synthetic": 10,
}
TRAIN_SIZE = {
    "mnist": 60000,
    "fashionmnist": 60000,
    "emnist": 697932,
    "cifar10": 50000,
    "cifar100": 50000,
    "svhn": 73257,
    "tinyimagenet": 100000,
}
RUNTIME_FLAGS = ("resume", "stop_after", "overwrite")  # not part of a run's config: they belong to one invocation
# what may be given with --resume: --rounds extends; --device and --data-dir say where it runs and where the data lie
RESUME_FLAGS = ("resume", "stop_after", "rounds", "device", "data_dir")
RUN_FILES = ("config.json", "partition.json", "metrics.jsonl", "checkpoint.pt", "summary.json", "model.pt")


# Flag types: argparse calls them on the text of a flag, so a bad value ends the parse with exit status 2
# and "argument --lr: must be > 0, got -0.1", before anything is read or written.
def flag_type(cast, low=-math.inf, high=math.inf, open_low=False, open_high=False):
    """An argparse type: cast(text), finite and in [low, high] (an open end where said)."""

    def check(text):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if cast is int else 'a number'}, got '{text}'")
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if value < low or (open_low and value == low) or value > high or (open_high and value == high):
            raise argparse.ArgumentTypeError(f"must be {_range_text(low, high, open_low, open_high)}, got {text}")
        return value

    check.__name__ = cast.__name__  # argparse names the type in its own messages
    return check


def _range_text(low, high, open_low, open_high):
    if high == math.inf:
        return f"{'>' if open_low else '>='} {low:g}"
    return f"in {'(' if open_low else '['}{low:g}, {high:g}{')' if open_high else ']'}"


positive_int = flag_type(int, 1)  # counts: clients, rounds, epochs, steps, batch size, periods
non_negative_int = flag_type(int, 0)
seed_int = flag_type(int, 0, 2**32 - 1)  # numpy's legacy seeding takes at most 32 bits
positive_float = flag_type(float, 0, open_low=True)  # learning rates, alpha, tau
non_negative_float = flag_type(float, 0)  # weight decay, mu (0 = off)
fraction = flag_type(float, 0, 1, open_low=True)  # (0, 1]: --frac, --lr-decay
decay_rate = flag_type(float, 0, 1, open_high=True)  # [0, 1): momentum and moment decays, --val-frac
inner_fraction = flag_type(float, 0, 1, open_low=True, open_high=True)  # (0, 1): --lr-decay-at


def device_flag(text):
    """--device: cpu, cuda, cuda:N or mps (whether it exists is checked in finish_args)."""
    if text in ("cpu", "cuda", "mps") or (text.startswith("cuda:") and text[5:].isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"expected cpu, cuda, cuda:N or mps, got '{text}'")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help with every flag's default after its help; a help that states its own "(default ...)" (e.g.
    "(default: --seed)") keeps it alone."""

    def _get_help_string(self, action):
        return action.help if "(default" in (action.help or "") else super()._get_help_string(action)


# fmt: off
def add_run_flags(group, script):
    """The flags of the run folder and the loop's control, the same in every script: --checkpoint-every, --out,
    --overwrite, --save-model, --resume, --stop-after."""
    group.add_argument("--checkpoint-every", type=positive_int, default=None,
        help="write checkpoint.pt every this many rounds (default: at each evaluation)")
    group.add_argument("--out", default=None, help=f"run folder (default runs/{script}__<dataset>__<seed>__<time>)")
    group.add_argument("--overwrite", action="store_true",
        help="replace the run already in --out (without it, such an --out is refused)")
    group.add_argument("--save-model", action="store_true",
        help="write the final evaluated global model's state_dict to OUT/model.pt")
    group.add_argument("--resume", default=None, metavar="DIR",
        help="continue the run in DIR (its config.json is used); with a larger --rounds, extend it")
    group.add_argument("--stop-after", type=positive_int, default=None,
        help="checkpoint and stop after this many rounds of this invocation (wall-time-limited jobs)")
# fmt: on


def given_flags(parser, argv=None):
    """The dests of the flags written on the command line (not left at their defaults)."""
    unset = object()
    dests = [a.dest for a in parser._actions if a.dest != "help"] + list(parser._defaults)  # set_defaults too
    namespace = argparse.Namespace(**{dest: unset for dest in dests})
    parser.parse_args(argv, namespace=namespace)  # argparse fills in defaults only where nothing is set
    return {k for k, v in vars(namespace).items() if v is not unset}


def finish_args(parser, args, script):
    """Validate the flags every script shares and fill in derived defaults, step by step.

    Bad input ends here (exit status 2, one line naming the flag) before any data is touched. Ranges of
    single flags are checked by their argparse types (flag_type); here: names, the data folder, the
    partition (choose_partition, check_partition), the device and the run folder (choose_out).
    --resume DIR: see resume_args.
    """
    if getattr(args, "resume", None):
        return resume_args(parser, args, script)
    err = parser.error
    if args.dataset not in DATASETS:
        err(f"--dataset: unknown dataset '{args.dataset}'; choose one of {', '.join(DATASETS)}")
    if args.model not in MODELS:
        err(f"--model: unknown model '{args.model}'; choose one of {', '.join(sorted(MODELS))}")
    check_data_dir(args, err)
    choose_partition(parser, args)
    check_partition(parser, args)
    if args.data_seed is None:
        args.data_seed = args.seed
    args.device = check_device(args.device, err)
    if args.amp and args.device == "cpu":
        print(
            "note: --amp on the CPU: bfloat16 autocast runs, but is usually slower than float32 there", file=sys.stderr
        )
    args.out = choose_out(args, script, err)
    args.script = script
    return args


def choose_partition(parser, args):
    """At most one partition flag. The script's paper partition is the default of its flag (e.g. --shards 10,
    shown by --help) and holds when no partition flag is written; a flag written replaces it."""
    written = [k for k in PARTITION_FLAGS if k in given_flags(parser)]
    if len(written) > 1:
        parser.error(
            "partition: give at most one of "
            + ", ".join(PARTITION_FLAGS.values())
            + f" (got {' and '.join(PARTITION_FLAGS[k] for k in written)})"
        )
    if not written and getattr(args, "clients_per_domain", None):
        parser.error(
            "--clients-per-domain: give the partition within each domain: --iid, --shards S, "
            "--classes-per-client C, --alpha A or --disjoint-classes"
        )
    for k in PARTITION_FLAGS:
        if written and k not in written and hasattr(args, k):  # the default partition gives way
            setattr(args, k, False if isinstance(parser.get_default(k), bool) else None)


def check_partition(parser, args):
    """The partition fits the data: S and C at most the classes (of the fewest-class domain), N*S shards at most
    the samples, split-2's 5 clients, power-law sizes only where they apply, one class set per client."""
    err = parser.error
    classes = _num_classes_hint(args)
    if grouped_layout(args):
        classes = check_groups(parser, args, err)  # the fewest classes of a domain, or None
    if args.shards is not None:
        if classes is not None and args.shards > classes:
            err(f"--shards: S={args.shards} is more than the {classes} classes of {args.dataset}")
        size = TRAIN_SIZE.get(args.dataset)
        if size is not None and args.num_clients * args.shards > size:
            err(f"--shards: N*S = {args.num_clients * args.shards} shards is more than the {size} training samples")
    if args.classes_per_client is not None and classes is not None and args.classes_per_client > classes:
        err(f"--classes-per-client: C must be in 1..{classes}, got {args.classes_per_client}")
    if args.split2 and args.num_clients != 5:
        err(f"--split2: split-2 has exactly 5 clients; pass --num-clients 5 (got {args.num_clients})")
    if args.quantity == "powerlaw" and (args.split2 or getattr(args, "natural", False)):
        err(
            "--quantity: powerlaw works with --iid, --shards, --classes-per-client or --alpha, not "
            + ("--split2" if args.split2 else "--natural (its clients' sizes are the data's)")
        )
    if getattr(args, "disjoint_classes", False) and classes is not None:
        n = getattr(args, "clients_per_domain", None) or args.num_clients
        if n > classes:
            err(f"--disjoint-classes: {n} clients cannot each hold their own of {classes} classes; use fewer clients")


def choose_out(args, script, err):
    """The run folder: --out, or a new runs/<script>__<dataset>__<seed>__<time>. One that holds a run is refused
    unless --overwrite; it must be a folder this process can write in (rank 0's, under torchrun)."""
    out = args.out
    if out is None:
        out = default_out_dir(script, args)
    elif holds_run(out) and not args.overwrite:
        err(
            f"--out: {out} already holds a run; continue it with --resume {out}, "
            f"write to another --out, or replace it with --overwrite"
        )
    if int(os.environ.get("RANK", "0")) == 0:  # torchrun: rank 0's folder is the run's
        check_writable(out, err)
    return out


def resume_args(parser, args, script):
    """--resume DIR: the run's config.json replaces the command line, which may add only --stop-after,
    --device, --data-dir (the same data in another place, e.g. on another machine), and a larger --rounds
    (to extend the run; decay points of --lr-decay-at, and anfr.py's cosine, are then fractions of the new
    total). A finished run is left as it is."""
    err, folder = parser.error, args.resume
    try:
        with open(os.path.join(folder, "config.json")) as f:
            saved = json.load(f)
    except FileNotFoundError:
        err(f"--resume: {folder} has no config.json, so it holds no run to resume")
    except (OSError, ValueError) as e:
        err(f"--resume: cannot read {os.path.join(folder, 'config.json')} ({e})")
    own = ({a.dest for a in parser._actions} | set(parser._defaults)) - {"help", *RUNTIME_FLAGS}
    owner = saved.get("script") or (script if set(saved) == own else "another script")
    if owner != script:
        hint = f"; resume it with python {owner}.py --resume {folder}" if owner != "another script" else ""
        err(f"--resume: {folder} holds a run of {owner}, not of {script}.py{hint}")
    given = given_flags(parser)
    extra = sorted(given - set(RESUME_FLAGS))
    if extra:
        err(
            f"--{extra[0].replace('_', '-')}: a resumed run keeps the flags of its config.json; "
            "with --resume give only --rounds (to extend it), --stop-after, --device or --data-dir"
        )
    rounds = args.rounds if "rounds" in given else saved["rounds"]
    if rounds < saved["rounds"]:
        err(f"--rounds: the run in {folder} has {saved['rounds']} rounds; --resume can extend it, not shorten it")
    summary = _read_json(os.path.join(folder, "summary.json"))
    if summary and summary.get("diverged"):
        err(f"--resume: the run in {folder} diverged in round {summary['round']}; start a new one (a smaller --lr?)")
    if summary and summary.get("final_round", saved["rounds"]) == rounds:
        print(
            f"{folder}: this run has finished its {rounds} rounds; nothing to do "
            f"(a larger --rounds extends it: --resume {folder} --rounds N)"
        )
        raise SystemExit(0)
    if not os.path.isfile(os.path.join(folder, "checkpoint.pt")):
        err(
            f"--resume: {folder} has config.json but no checkpoint.pt (the run stopped before its first "
            f"checkpoint); start it again with --out {folder} --overwrite"
        )
    device = check_device(args.device if "device" in given else saved["device"], err)
    if "data_dir" in given:
        saved["data_dir"] = args.data_dir
        check_data_dir(argparse.Namespace(**{**saved, "data_dir": args.data_dir}), err)
    keep = {"resume": folder, "stop_after": args.stop_after, "overwrite": False, "rounds": rounds, "device": device}
    args = argparse.Namespace(**{**vars(args), **saved, **keep, "script": script})
    args.out = folder
    return args


def check_device(device, err):
    """The device to use: cuda when available if none was asked for; a missing one is refused."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            err(f"--device: '{device}' asked for but CUDA is not available; use --device cpu")
        if ":" in device and int(device[5:]) >= torch.cuda.device_count():
            err(f"--device: {device} does not exist; this machine has {torch.cuda.device_count()} GPU(s)")
    if device == "mps" and not torch.backends.mps.is_available():
        err("--device: 'mps' asked for but Apple's MPS is not available; use --device cpu")
    return device


def grouped_layout(args):
    """Whether the image folder is read in groups, train/<group>/<class>/*: clients (--natural) or domains."""
    return bool(getattr(args, "natural", False) or getattr(args, "clients_per_domain", None))


def check_data_dir(args, err):
    """The folder of --dataset folder (flat, or in groups with --natural / --clients-per-domain) or
    tinyimagenet is in its layout; folder layouts need --dataset folder."""
    if grouped_layout(args) and args.dataset != "folder":
        flag = "--natural" if getattr(args, "natural", False) else "--clients-per-domain"
        err(
            f"{flag}: clients or domains come from an image folder: --dataset folder --data-dir DIR with "
            "DIR/train/<group>/<class>/*"
        )
    if args.dataset == "folder" and grouped_layout(args):
        check_group_folder(args.data_dir, err)
    elif args.dataset == "folder":
        check_image_folder(args.data_dir, err)
    elif args.dataset == "tinyimagenet":
        check_tinyimagenet(args.data_dir, err)


def check_groups(parser, args, err):
    """--natural / --clients-per-domain M: the number of clients is the data's (N groups, or N*M; a different
    --num-clients given is refused); per-group test folders give --natural its per-client test sets. Returns
    the fewest classes of a domain (for --shards, --classes-per-client, --disjoint-classes)."""
    root = args.data_dir
    groups, _, per_group = folder_layout(root)
    natural, m = getattr(args, "natural", False), getattr(args, "clients_per_domain", None)
    if natural and m:
        err("--clients-per-domain: --natural makes each folder one client; give one of the two")
    if m and args.split2:
        err(
            "--clients-per-domain: --split2 has its own 5 clients; give --iid, --shards, --classes-per-client, "
            "--alpha or --disjoint-classes within each domain"
        )
    n = len(groups) * (m or 1)
    if "num_clients" in given_flags(parser) and args.num_clients != n:
        kind = "client" if natural else "domain"
        err(
            f"--num-clients: {root}/train has {len(groups)} {kind} folders, so the run has {n} clients; "
            f"leave --num-clients out or give {n}"
        )
    args.num_clients = n
    if natural and per_group:
        args.client_test = True  # test/<client>/<class>/*: each client's own test set
    fewest = min(groups, key=lambda g: len(_subdirs(os.path.join(root, "train", g))))
    count = len(_subdirs(os.path.join(root, "train", fewest)))
    if m and args.classes_per_client is not None and args.classes_per_client > count:
        err(f"--classes-per-client: the domain {fewest} has {count} classes, fewer than C={args.classes_per_client}")
    if m and args.shards is not None and args.shards > count:
        err(f"--shards: the domain {fewest} has {count} classes, fewer than S={args.shards}")
    if m and getattr(args, "disjoint_classes", False) and m > count:
        err(f"--disjoint-classes: the domain {fewest} has {count} classes, too few for {m} clients with their own")
    return count if m else None


def check_group_folder(root, err):
    """root/train/<group>/<class>/ with an image in each class folder, and test/ either one folder per group
    (test/<group>/<class>/*, classes among the training ones) or one shared test/<class>/* with every class."""
    train, test = (os.path.join(root, split) for split in ("train", "test"))
    layout = "DIR/train/<group>/<class>/*images*"
    for split in (train, test):
        if not os.path.isdir(split):
            err(f"--data-dir: clients or domains from folders need {split}/ ({layout})")
    groups = _subdirs(train)
    if not groups:
        err(f"--data-dir: {train} has no group folders; clients or domains from folders need {layout}")
    for g in groups:
        base = os.path.join(train, g)
        if _images(base) or not _subdirs(base):
            err(
                f"--data-dir: {base} holds {'images' if _images(base) else 'no class folders'}; clients or domains "
                f"from folders need {layout} (a folder of train/<class>/*: leave out --natural and "
                "--clients-per-domain)"
            )
        empty = [c for c in _subdirs(base) if not _images(os.path.join(base, c))]
        if empty:
            err(
                f"--data-dir: the class folder(s) {', '.join(empty[:3])} of {base} hold no images; remove them or "
                "add images"
            )
    groups, classes, per_group = folder_layout(root)
    if per_group:
        extra = sorted(
            {f"{g}/{c}" for g in groups for c in _subdirs(os.path.join(test, g))}
            - {f"{g}/{c}" for g in groups for c in classes}
        )
        if extra:
            err(f"--data-dir: {test} has class folder(s) {', '.join(extra[:3])} of no class in {train}")
    else:
        missing = [c for c in classes if not os.path.isdir(os.path.join(test, c))]
        extra = [c for c in _subdirs(test) if c not in classes]
        if extra and not missing:  # a shared test/<class>/ with a class no training folder has: no label for it
            err(f"--data-dir: {test} has class folder(s) {', '.join(extra[:3])} of no class in {train}")
        if missing:
            err(
                f"--data-dir: {test} is neither one folder per group of {train} ({', '.join(groups[:3])}"
                f"{' ...' if len(groups) > 3 else ''}) nor one per class: it lacks the class folder(s) "
                f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"
            )


def check_tinyimagenet(root, err):
    """root (tiny-imagenet-200/) holds train/<wnid>/images/ and val/images/ with val/val_annotations.txt."""
    train = os.path.join(root, "train")
    needed = [os.path.join(root, "val", "images"), os.path.join(root, "val", "val_annotations.txt")]
    if not os.path.isdir(train) or not _subdirs(train) or not all(map(os.path.exists, needed)):
        err(
            f"--data-dir: Tiny-ImageNet needs {root}/train/<wnid>/images/*.JPEG, {root}/val/images/ and "
            f"{root}/val/val_annotations.txt (the unpacked tiny-imagenet-200.zip)"
        )
    bad = [w for w in _subdirs(train) if not os.path.isdir(os.path.join(train, w, "images"))]
    if bad:
        err(f"--data-dir: {train}/{bad[0]} has no images/ folder (Tiny-ImageNet's layout: train/<wnid>/images/)")


def check_image_folder(root, err):
    """--dataset folder: root/train/<class>/ with at least one image each, and the same classes in root/test/."""
    train, test = (os.path.join(root, split) for split in ("train", "test"))
    for split in (train, test):
        if not os.path.isdir(split):
            err(f"--data-dir: a folder dataset needs {split}/<class>/*images*")
    try:
        classes = sorted(d for d in os.listdir(train) if os.path.isdir(os.path.join(train, d)))
    except OSError as e:
        err(f"--data-dir: cannot list {train} ({e.strerror})")
    if not classes:
        err(f"--data-dir: {train} has no class folders; a folder dataset needs {train}/<class>/*images*")
    missing = [c for c in classes if not os.path.isdir(os.path.join(test, c))]
    if missing:
        err(
            f"--data-dir: {test} lacks the class folder(s) "
            f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} "
            f"of {train}"
        )
    empty = [
        c for c in classes if not any(f.lower().endswith(IMAGE_EXTENSIONS) for f in os.listdir(os.path.join(train, c)))
    ]
    if empty:
        nested = all(_subdirs(os.path.join(train, c)) for c in empty)  # train/<group>/<class>/*
        hint = (
            "; folders in groups, train/<group>/<class>/*, need --natural or --clients-per-domain M" if nested else ""
        )
        err(
            f"--data-dir: the class folder(s) {', '.join(empty[:3])}{' ...' if len(empty) > 3 else ''} of {train} "
            f"hold no images; remove them or add images{hint}"
        )


def check_writable(folder, err):
    """--out must be a folder this process can create and write in; the probe leaves nothing behind."""
    path, missing = os.path.abspath(folder), []
    while not os.path.exists(path):
        missing.append(path)
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        err(f"--out: {path} is a file, so {folder} cannot be a run folder")
    probe = os.path.join(folder, f".cleanfl-probe.{os.getpid()}")
    try:
        os.makedirs(folder, exist_ok=True)
        open(probe, "w").close()
    except OSError as e:
        err(f"--out: cannot write in {folder} ({e.strerror})")
    finally:
        if os.path.exists(probe):
            os.remove(probe)
        for made in missing:  # deepest first
            if os.path.isdir(made):
                os.rmdir(made)


def default_out_dir(script, args):
    """runs/<script>__<dataset>__<seed>__<time>, with -2, -3, ... if another run started in the same second."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = os.path.join("runs", f"{script}__{args.dataset}__{args.seed}__{stamp}")
    out, n = base, 1
    while os.path.exists(out):
        n += 1
        out = f"{base}-{n}"
    return out


def holds_run(folder):
    return any(os.path.exists(os.path.join(folder, name)) for name in RUN_FILES)


def _read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _num_classes_hint(args):
    if args.dataset == "folder":
        return len(folder_layout(args.data_dir)[1] if grouped_layout(args) else folder_classes(args.data_dir))
    return NUM_CLASSES.get(args.dataset)


def refuse(message):
    """Bad input found after the flags were parsed (in the data or the partition): print one
    `prog: error: message` line and exit with status 2, as parser.error does. str() of the raised
    SystemExit is the message, so callers and tests can read it."""
    print(f"{os.path.basename(sys.argv[0])}: error: {message}", file=sys.stderr)
    refusal = SystemExit(message)
    refusal.code = 2  # not the 1 of sys.exit(message)
    raise refusal


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# --- Dataset files: torchvision downloads, image folders (decoded once, cached), synthetic data -----
def read_dataset(args):
    """{x_train, y_train, x_test, y_test (, group_train, group_test, groups, classes)} of args.dataset, as
    stored. Under torchrun one process per machine downloads or decodes (and caches) first, then the others
    read its files."""
    world = rank_and_world()[1]
    first = world == 1 or int(os.environ["LOCAL_RANK"]) == 0
    if not first:
        dist.barrier()  # wait for the first process of this machine
    extra = {}
    if args.dataset == "synthetic":
        tensors = synthetic_dataset(args.data_seed)
    elif args.dataset == "folder" and grouped_layout(args):
        *tensors, g_tr, g_te = group_folder_dataset(args.data_dir)
        groups, classes, _ = folder_layout(args.data_dir)
        extra = {"group_train": g_tr, "group_test": g_te, "groups": groups, "classes": classes}
    elif args.dataset == "folder":
        tensors, extra = folder_dataset(args.data_dir), {"classes": folder_classes(args.data_dir)}
    elif args.dataset == "tinyimagenet":
        tensors = tinyimagenet_dataset(args.data_dir)
    else:
        tensors = torchvision_dataset(args.dataset, args.data_dir)
    if first and world > 1:
        dist.barrier()
    return {**dict(zip(("x_train", "y_train", "x_test", "y_test"), tensors)), **extra}


def synthetic_dataset(seed, n_train=3000, n_test=1000, num_classes=10, size=32):
    """Offline, seeded, learnable images: a smooth random template per class plus pixel noise."""
    g = torch.Generator().manual_seed(seed + 12345)
    templates = F.interpolate(
        torch.rand(num_classes, 3, 4, 4, generator=g), size=size, mode="bilinear", align_corners=False
    )

    def draw(n):  # n/num_classes images of each class, in random order
        y = (torch.arange(n) % num_classes)[torch.randperm(n, generator=g)]
        brightness = 0.7 + 0.6 * torch.rand(n, 1, 1, 1, generator=g)
        x = templates[y] * brightness + 0.35 * torch.randn(n, 3, size, size, generator=g)
        return (x.clamp(0, 1) * 255).round().to(torch.uint8), y

    x_tr, y_tr = draw(n_train)
    x_te, y_te = draw(n_test)
    return x_tr, y_tr, x_te, y_te


def torchvision_dataset(name, root):
    """Download (once) into root and load a torchvision dataset. A failed download (no internet: urllib's
    URLError is an OSError; torchvision's MNIST mirrors end in a RuntimeError) exits 2 with one line."""
    import torchvision.datasets as tvd

    ctor = {"mnist": tvd.MNIST, "fashionmnist": tvd.FashionMNIST, "cifar10": tvd.CIFAR10, "cifar100": tvd.CIFAR100}
    out = []
    try:
        for train in (True, False):
            if name == "svhn":
                ds = tvd.SVHN(root, split="train" if train else "test", download=True)
                x, y = torch.from_numpy(ds.data), torch.from_numpy(ds.labels).long()
            elif name == "emnist":
                ds = tvd.EMNIST(root, split="byclass", train=train, download=True)
                x, y = ds.data.transpose(1, 2).unsqueeze(1), ds.targets.long()  # EMNIST is stored transposed
            else:
                ds = ctor[name](root, train=train, download=True)
                x = torch.as_tensor(ds.data)
                x = x.unsqueeze(1) if x.ndim == 3 else x.permute(0, 3, 1, 2)
                y = torch.as_tensor(ds.targets).long()
            out += [x.contiguous(), y]
    except (OSError, RuntimeError) as e:
        reason = " ".join(f"{type(e).__name__}: {e}".split())[:160]
        msg = (
            f"--dataset: could not download or read {name} into --data-dir {root} ({reason}); without internet "
            f"use --dataset folder --data-dir DIR (images in DIR/train/<class>/ and DIR/test/<class>/)"
        )
        refuse(msg)
    return out


IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".ppm", ".webp", ".tif", ".tiff")


def _subdirs(path):
    return sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)))


def _images(path):
    return sorted(f for f in os.listdir(path) if f.lower().endswith(IMAGE_EXTENSIONS))


CLASSES_FILE = "classes.txt"  # optional: an image folder's class folder names in label order, one a line


def class_order(root, found):
    """The class names in label order: those of root/classes.txt if the folder has one (benchmarks/prepare_data.py
    writes it, e.g. FEMNIST's 62, so a class keeps its label even where a subset lacks it), else the sorted names
    found. A class folder the file does not list is refused."""
    path = os.path.join(root, CLASSES_FILE)
    if not os.path.isfile(path):
        return sorted(found)
    with open(path) as f:
        names = [line.strip() for line in f if line.strip()]
    unlisted = sorted(set(found) - set(names))
    if unlisted or len(set(names)) != len(names):
        what = "lists a class twice" if len(set(names)) != len(names) else f"lacks the class folder(s) {unlisted[:3]}"
        refuse(f"--data-dir: {path} {what}; it lists the class folders in label order, one a line (or delete it)")
    return names


def folder_classes(root):
    return class_order(root, _subdirs(os.path.join(root, "train")))


def folder_dataset(root):
    """Read root/{train,test}/<class>/* once and cache the decoded uint8 tensors (see _decode_cached).
    Class index = position of the folder name in sorted order (or in classes.txt)."""
    classes = folder_classes(root)
    folder = lambda split, c: os.path.join(root, split, classes[c])
    files = {
        split: [
            (c, 0, os.path.join(folder(split, c), f))
            for c in range(len(classes))
            if os.path.isdir(folder(split, c))  # a class of classes.txt may have no folder
            for f in _images(folder(split, c))
        ]
        for split in ("train", "test")
    }
    return _decode_cached(root, files, "flat")[:4]


def folder_layout(root):
    """An image folder in groups, root/train/<group>/<class>/*: (groups, classes, test_per_group), with the
    sorted group names, the sorted union of the groups' class names (or classes.txt's), and whether test/ is
    test/<group>/<class>/* (its folders are the groups) rather than one shared test/<class>/*."""
    groups = _subdirs(os.path.join(root, "train"))
    classes = class_order(root, {c for g in groups for c in _subdirs(os.path.join(root, "train", g))})
    return groups, classes, set(_subdirs(os.path.join(root, "test"))) == set(groups)


def group_folder_dataset(root):
    """Read root/train/<group>/<class>/* and root/test/<group>/<class>/* (or one shared root/test/<class>/*)
    once, cached: [x_train, y_train, x_test, y_test, group_train, group_test]; group_test is None for a shared
    test/. Group and class index = position of the name in sorted order (classes: over all groups, or classes.txt's
    order)."""
    groups, classes, per_group = folder_layout(root)
    label = {c: i for i, c in enumerate(classes)}

    def listing(g, base):  # (label, group, path) of base/<class>/*
        return [(label[c], g, os.path.join(base, c, f)) for c in _subdirs(base) for f in _images(os.path.join(base, c))]

    train, test = os.path.join(root, "train"), os.path.join(root, "test")
    files = {"train": [item for g, name in enumerate(groups) for item in listing(g, os.path.join(train, name))]}
    if per_group:
        files["test"] = [item for g, name in enumerate(groups) for item in listing(g, os.path.join(test, name))]
    else:
        files["test"] = listing(-1, test)
    tensors = _decode_cached(root, files, "groups")
    return tensors if per_group else tensors[:5] + [None]


def tinyimagenet_dataset(root):
    """Tiny-ImageNet as distributed (tiny-imagenet-200/): train/<wnid>/images/*.JPEG (500 per class) and
    val/images/*.JPEG labelled by val/val_annotations.txt (50 per class, the test split here; test/ has no
    labels). 64x64; the few grayscale images become RGB. Class index = position of the wnid in sorted order."""
    wnids = _subdirs(os.path.join(root, "train"))
    label = {w: i for i, w in enumerate(wnids)}
    train = [
        (label[w], 0, os.path.join(root, "train", w, "images", f))
        for w in wnids
        for f in _images(os.path.join(root, "train", w, "images"))
    ]
    with open(os.path.join(root, "val", "val_annotations.txt")) as f:
        rows = sorted(line.split("\t")[:2] for line in f if line.strip())
    unknown = sorted({w for _, w in rows} - set(label))
    if unknown:
        refuse(f"--data-dir: {root}/val/val_annotations.txt names classes without a train/ folder: {unknown[:3]}")
    test = [(label[w], 0, os.path.join(root, "val", "images", name)) for name, w in rows]
    return _decode_cached(root, {"train": train, "test": test}, "tinyimagenet")[:4]


def _decode_cached(root, files, layout):
    """files: {"train": [(label, group, path)], "test": [...]} -> [x_train, y_train, x_test, y_test, group_train,
    group_test], decoded once and cached.

    The cache sits in root (root/.cleanfl-cache.pt), or in ~/.cache/cleanfl when root is read-only. It is
    keyed on the layout and the folder's contents (every image's path, size and modification time), so added,
    removed or replaced images are decoded anew.
    """
    root = os.path.abspath(root)
    key = hashlib.sha1(root.encode()).hexdigest()[:16]
    caches = [
        os.path.join(root, ".cleanfl-cache.pt"),
        os.path.join(os.path.expanduser("~"), ".cache", "cleanfl", f"folder-{key}.pt"),
    ]
    listed = [os.path.join(root, CLASSES_FILE)] if os.path.isfile(os.path.join(root, CLASSES_FILE)) else []
    stamp = _fingerprint([path for split in files.values() for _, _, path in split] + listed, root)  # + the labels
    stamp = stamp if layout == "flat" else f"{layout}:{stamp}"  # a flat folder's cache keeps its old key
    for path in caches:
        if os.path.isfile(path):
            cached = torch.load(path)
            if cached.get("stamp") == stamp:
                return cached["tensors"]
    tensors, groups = [], []
    for split in ("train", "test"):
        xs = [_decode_image(path) for _, _, path in _progress(files[split], desc=f"decoding {split}/")]
        if not xs:
            refuse(f"--data-dir: no images found under {os.path.join(root, split)}/<class>/")
        tensors += [_stack(xs, os.path.join(root, split)), torch.tensor([y for y, _, _ in files[split]])]
        groups.append(torch.tensor([g for _, g, _ in files[split]]))
    tensors += groups
    for path in caches:  # first writable place wins
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            _atomic_save({"stamp": stamp, "tensors": tensors}, path)
            break
        except OSError:
            continue
    return tensors


def _stack(xs, where):
    """One uint8 [N, C, H, W] tensor; grayscale images among colour ones become 3-channel (Tiny-ImageNet has some)."""
    if {x.shape[0] for x in xs} == {1, 3}:
        xs = [x.expand(3, -1, -1) if x.shape[0] == 1 else x for x in xs]
    shapes = {tuple(x.shape) for x in xs}
    if len(shapes) > 1:
        refuse(
            f"--data-dir: images under {where} differ in size ({sorted(shapes)[:3]}...); resize them to one size first"
        )
    return torch.stack(xs)


def _fingerprint(paths, root):
    """sha1 of every file's path (relative to root), size and modification time, in the given order."""
    h = hashlib.sha1()
    for path in paths:
        st = os.stat(path)
        h.update(f"{os.path.relpath(path, root)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _decode_image(path):
    from PIL import Image  # installed with torchvision

    with Image.open(path) as img:
        x = torch.from_numpy(np.array(img))
    return x.unsqueeze(0) if x.ndim == 2 else x.permute(2, 0, 1)  # [C, H, W], grayscale -> 1 channel


def _progress(items, desc):
    return tqdm(items, desc=desc, leave=False, mininterval=1.0, disable=len(items) < 2000)


# --- The run folder's files ----------------------------------------------------------------------
class RunFolder:
    """The run folder's files: config.json (written at once), partition.json, metrics.jsonl (log),
    checkpoint.pt, summary.json (finish) and model.pt; and the run's clock, which every row, checkpoint
    and summary carries (a resumed run counts on from its checkpoint).

    Every file is written whole (a temporary file, then a rename); NaN and infinity are written as null.
    Under torchrun only rank 0 writes (folder.main); every rank keeps the same rows.
    """

    def __init__(self, args, script):
        self.args, self.script, self.dir = args, script, args.out
        self.main = rank_and_world()[0] == 0  # torchrun: rank 0 alone writes the run folder
        self.start, self.elapsed_before = time.time(), 0.0
        self.last_eval = {}  # the latest evaluation row: the summary's metrics
        self.best_val = {}  # --val-frac: the first evaluation row with the highest val_acc
        self.metrics_path = os.path.join(self.dir, "metrics.jsonl")
        if self.main:
            os.makedirs(self.dir, exist_ok=True)
            if not args.resume:
                for name in RUN_FILES:  # --overwrite: the earlier run's files go (finish_args refused them otherwise)
                    if os.path.exists(os.path.join(self.dir, name)):
                        os.remove(os.path.join(self.dir, name))
                _atomic_save("", self.metrics_path)
            # the config (with --resume --rounds N: the extended one)
            config = {k: v for k, v in vars(args).items() if k not in RUNTIME_FLAGS}
            _atomic_save(config, os.path.join(self.dir, "config.json"))

    @property
    def elapsed(self):
        return self.elapsed_before + time.time() - self.start

    def write_partition(self, partition, data):
        if self.main:
            _atomic_save(partition_info(partition, data), os.path.join(self.dir, "partition.json"))

    def log(self, metrics):
        """Append one row to metrics.jsonl (with elapsed_s); keep the latest evaluation row (one with test_acc)
        and the first one with the highest val_acc."""
        metrics = {**metrics, "elapsed_s": round(self.elapsed, 3)}
        if self.main:
            with open(self.metrics_path) as f:
                before = f.read()
            _atomic_save(before + json.dumps(_json_safe(metrics), allow_nan=False) + "\n", self.metrics_path)
        if "test_acc" in metrics:
            self.last_eval = metrics
        if "val_acc" in metrics and metrics["val_acc"] > self.best_val.get("val_acc", -math.inf):
            self.best_val = metrics
        return metrics

    def save_checkpoint(self, round_done, state):
        """state: everything the method keeps (global model, server/client state, RNG)."""
        if self.main:
            _atomic_save(
                {"round": round_done, "elapsed_s": self.elapsed, **state}, os.path.join(self.dir, "checkpoint.pt")
            )

    def load_checkpoint(self):
        """checkpoint.pt; metrics.jsonl cut back to its round (a resumed log has no repeats), the clock and the
        evaluation rows as they were then. Under torchrun every rank reads the file (with several nodes, --out
        must be on a shared disk)."""
        ckpt = torch.load(os.path.join(self.dir, "checkpoint.pt"), map_location=self.args.device, weights_only=False)
        self.elapsed_before = ckpt["elapsed_s"]
        with open(self.metrics_path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        rows = [row for row in rows if row["round"] <= ckpt["round"]]
        self.last_eval = next((row for row in reversed(rows) if "test_acc" in row), {})
        self.best_val = max(
            (row for row in rows if row.get("val_acc") is not None), key=lambda r: r["val_acc"], default={}
        )
        if self.main:
            _atomic_save("".join(json.dumps(row) + "\n" for row in rows), self.metrics_path)
        return ckpt

    def finish(self, model=None, **extra):
        """summary.json: the final round's evaluation (never the best round's; with --val-frac also
        test_acc_at_best_val, best_val_acc, best_val_round) and `extra`; model.pt with --save-model; the closing
        line."""
        final = {k: v for k, v in self.last_eval.items() if k != "round"}
        if self.best_val:  # --val-frac: the protocol that reports the test accuracy at the best validation round
            best = self.best_val
            final.update(
                best_val_acc=best["val_acc"], best_val_round=best["round"], test_acc_at_best_val=best["test_acc"]
            )
        summary = self.write_summary({"final_round": self.args.rounds, **final, **extra})
        if self.main and model is not None and self.args.save_model:
            _atomic_save(model.state_dict(), os.path.join(self.dir, "model.pt"))
        print(f"final test accuracy {summary['test_acc']:.4f} after {self.args.rounds} rounds; outputs in {self.dir}")
        return summary

    def write_summary(self, summary):
        summary = {
            **summary,
            "wall_time_s": round(self.elapsed, 3),
            "device": device_name(self.args.device),
            "torch": torch.__version__,
            "script": self.script,
            "processes": rank_and_world()[1],
        }
        if self.main:
            _atomic_save(summary, os.path.join(self.dir, "summary.json"))
        return summary


def partition_info(partition, data):
    """partition.json: the scheme and each client's label counts (train; test, val where there are such sets),
    an image folder's class names, each client's folder or domain."""
    info = {"scheme": partition.scheme, "train": label_counts(data.y_train, partition.train, data.num_classes)}
    if partition.test is not None:
        info["test"] = label_counts(data.y_test, partition.test, data.num_classes)
    if getattr(data, "classes", None) is not None:  # an image folder's class names
        info["classes"] = data.classes
    if partition.val is not None:  # --val-frac: each client's held-out validation samples
        info["val"] = label_counts(data.y_train, partition.val, data.num_classes)
    if partition.names is not None:  # each client's folder (--natural) or domain (--clients-per-domain)
        info["clients"] = partition.names
    return info


def announce(folder, model, partition, name=None):
    """The start-up line: device, model and parameter count, partition, run folder."""
    sizes = [len(p) for p in partition.train]
    params = sum(p.numel() for p in model.parameters())
    if folder.main:
        print(
            f"{folder.script}: {device_name(folder.args.device)} "
            f"| model {name or folder.args.model}, {params:,} parameters "
            f"| {partition.scheme}: {len(sizes)} clients, {min(sizes)}-{max(sizes)} training samples each "
            f"| run folder {folder.dir}{' (resumed)' if folder.args.resume else ''}",
            flush=True,
        )


# --- The loop's control: rounds, evaluation, checkpoint, stop --------------------------------------
class RoundLoop:
    """The rounds of this invocation under a tqdm bar with the latest test accuracy: which rounds end with an
    evaluation (evaluates), a checkpoint of the method's state after each evaluation (or every --checkpoint-every
    rounds) and at the last round, and the stop asked for by --stop-after K or Ctrl-C: a checkpoint, the
    command that resumes, exit 0 (130 for Ctrl-C). A resumed run (resume) starts after its checkpoint's round.

    Ctrl-C once asks the loop to stop after the current round; twice, it stops at once with one line. Under
    torchrun Ctrl-C ends every rank at once (torchrun stops them): resume from the last checkpoint.
    """

    def __init__(self, args, folder):
        self.args, self.folder = args, folder
        self.first_round = 0
        self.stop_requested = False
        if rank_and_world()[1] == 1:
            signal.signal(signal.SIGINT, self._on_sigint)

    def resume(self):
        """Load the run folder's checkpoint (returned); rounds() then starts after its round."""
        ckpt = self.folder.load_checkpoint()
        self.first_round = ckpt["round"]
        return ckpt

    def rounds(self, state):
        """The round indices of this invocation. After each round's body: its evaluation beside the bar, a
        checkpoint of state() (the method's model, server and client state, RNG) when due, then the stop."""
        args, folder, first = self.args, self.folder, self.first_round
        bar = tqdm(
            range(first, args.rounds),
            initial=first,
            total=args.rounds,
            desc=folder.script,
            unit="round",
            disable=not folder.main,
        )
        for rnd in bar:
            yield rnd
            done, row = rnd + 1, folder.last_eval
            if row.get("round") == done:  # this round's evaluation
                bar.set_postfix(acc=f"{row['test_acc']:.4f}", loss=f"{row['train_loss']:.3f}")
            stop = done < args.rounds and (
                self.stop_requested or (args.stop_after is not None and done - first >= args.stop_after)
            )
            if stop or self.checkpoint_due(rnd):
                folder.save_checkpoint(done, state())
            if stop:
                bar.close()
                print(f"stopped after round {done}; continue with: python {folder.script}.py --resume {folder.dir}")
                raise SystemExit(130 if self.stop_requested else 0)
        bar.close()

    def evaluates(self, rnd):
        """Whether round rnd (0-based) ends with an evaluation: every --eval-every rounds and the last."""
        return (rnd + 1) % self.args.eval_every == 0 or rnd + 1 == self.args.rounds

    def checkpoint_due(self, rnd):
        """Whether round rnd ends with a checkpoint: at each evaluation, or every --checkpoint-every rounds and
        the last."""
        if self.args.checkpoint_every is None:
            return self.evaluates(rnd)
        return (rnd + 1) % self.args.checkpoint_every == 0 or rnd + 1 == self.args.rounds

    def _on_sigint(self, *_):
        print(
            "\ninterrupt: finishing this round, then writing a checkpoint (Ctrl-C again stops at once)", file=sys.stderr
        )
        self.stop_requested = True
        signal.signal(signal.SIGINT, _interrupted)


# --- The divergence stop ----------------------------------------------------------------------------
def exit_if_diverged(train_loss, rnd, folder):
    """The round's mean training loss as a float. NaN or inf ends the program: summary.json says diverged
    (with the round and the loss) and the process exits with status 1 and one line."""
    train_loss = float(train_loss)
    if not math.isfinite(train_loss):
        folder.write_summary({"diverged": True, "round": rnd + 1, "train_loss": train_loss})
        sys.exit(
            f"diverged: training loss became {train_loss} in round {rnd + 1}; "
            f"try a smaller --lr (summary in {folder.dir})"
        )
    return train_loss


def _atomic_save(obj, path):
    """torch.save obj (JSON for a *.json path, text for a str) to a temporary file, then rename it to
    path: the file is whole or absent, whenever the process stops."""
    tmp = f"{path}.{socket.gethostname()}.{os.getpid()}.tmp"  # one per process: writers never share a temporary file
    try:
        if isinstance(obj, str) or path.endswith(".json"):
            with open(tmp, "w") as f:
                f.write(obj if isinstance(obj, str) else json.dumps(_json_safe(obj), indent=2, allow_nan=False))
        else:
            torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):  # interrupted (or failed) before the rename
            os.remove(tmp)


def _json_safe(obj):
    """obj with every NaN or infinity replaced by None (JSON has neither; json.dumps would write NaN)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def _interrupted(*_):
    """Ctrl-C when a round cannot be finished first (before the loop, or a second time): one line, no traceback."""
    print(
        "\ninterrupted; the run folder keeps what was saved (resume from its last checkpoint with --resume)",
        file=sys.stderr,
    )
    raise SystemExit(130)


def device_name(device):
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    import platform

    cpu = platform.processor() or platform.machine()
    return f"cpu ({cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"


def rng_state(sampler):
    state = {"torch": torch.get_rng_state(), "numpy_sampler": sampler.bit_generator.state}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state, sampler):
    torch.set_rng_state(state["torch"].cpu())  # CPU tensors, also when the checkpoint was mapped to a GPU
    sampler.bit_generator.state = state["numpy_sampler"]
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


# --- Several processes: `torchrun --nproc_per_node K script.py ...` splits each round's clients over
# K ranks. Every rank keeps the same global model and server state; a client's result is sent to
# every rank, and every rank sums the results in client order, so the run equals the one-process
# run bit for bit (with the same threads per process). Alone, these helpers do nothing extra.
def setup_distributed(args):
    """Under torchrun (WORLD_SIZE > 1): join the process group (NCCL on GPUs, gloo on CPU), give each
    rank its own GPU (cuda:LOCAL_RANK, or cuda:0 where a process sees one GPU), take rank 0's --out,
    and silence the stdout of ranks other than 0. Alone: Ctrl-C from here on ends with one line, no traceback."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        signal.signal(signal.SIGINT, _interrupted)  # until RoundLoop's handler lets the loop finish its round
        return
    if dist.is_initialized():
        return
    cuda = args.device.startswith("cuda")
    if cuda:
        gpu, visible = int(os.environ["LOCAL_RANK"]), torch.cuda.device_count()
        gpu = 0 if visible == 1 else gpu  # e.g. a scheduler that gives each process one GPU
        if gpu >= visible:
            refuse(
                f"--device {args.device}: local rank {gpu} needs GPU cuda:{gpu}, but this machine shows {visible}; "
                f"start at most that many processes per machine (--nproc_per_node)"
            )
        args.device = f"cuda:{gpu}"
        torch.cuda.set_device(args.device)
    # a long timeout: ranks wait for rank 0's first download or decoding, and for a wave's slowest client
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(hours=6))
    atexit.register(dist.destroy_process_group)
    out = [args.out]
    dist.broadcast_object_list(out, src=0)  # the default run folder has a time stamp: rank 0's
    args.out = out[0]
    if dist.get_rank() != 0:
        sys.stdout = open(os.devnull, "w")  # rank 0 prints; errors (stderr) still show from every rank


def rank_and_world():
    """(this process's rank, number of processes); (0, 1) without torchrun."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def client_seed(seed, rnd, k):
    """Seed of client k's random stream in round rnd (batch order, augmentation, dropout, DP noise).
    It depends on (seed, round, client) only, never on which process trains the client or on the
    clients trained before it. k = -1 seeds what follows the round's clients (server, fine-tuning)."""
    return int(np.random.SeedSequence([seed, rnd, k + 1]).generate_state(1)[0])


def each_client(clients, weights, train_client, seed, rnd):
    """Train this round's clients; yield (k, weight, result) for every sampled client k, in client
    order, on every rank. result = train_client(k): a dict / list / tuple of tensors and plain numbers.

    Alone, the clients train one after another. Under torchrun with K ranks, the i-th sampled client
    trains on rank i mod K, K clients at a time, and each result is broadcast from its rank to all.
    A result is valid inside the loop body only (it may be the live client model): clone what you keep.
    Each client trains from its own seed (client_seed: torch's global generator is reseeded), so a run
    does not depend on K.
    """
    rank, world = rank_and_world()
    for first in range(0, len(clients), world):
        wave = clients[first : first + world]  # one client per rank; the last wave may leave ranks idle
        result = None
        if rank < len(wave):
            torch.manual_seed(client_seed(seed, rnd, wave[rank]))
            result = train_client(wave[rank])
        for j, k in enumerate(wave):
            yield k, weights[first + j], result if world == 1 else _broadcast(result, src=j)
    torch.manual_seed(client_seed(seed, rnd, -1))  # after the clients: the same stream on every rank


class _Slot(int):
    """Where a tensor was taken out of a client's result (its index in the flat list)."""


def _map_leaves(obj, fn):
    """obj with fn applied to every leaf (anything but a dict, list or tuple), the layout kept."""
    if isinstance(obj, dict):
        return {k: _map_leaves(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_leaves(v, fn) for v in obj)
    return fn(obj)


def _take_tensors(obj, tensors):
    """obj with each tensor moved to the list `tensors` and replaced by its _Slot."""

    def take(leaf):
        if not isinstance(leaf, torch.Tensor):
            return leaf
        tensors.append(leaf)
        return _Slot(len(tensors) - 1)

    return _map_leaves(obj, take)


def _put_tensors(obj, tensors):
    return _map_leaves(obj, lambda leaf: tensors[leaf] if isinstance(leaf, _Slot) else leaf)


def _broadcast(result, src):
    """Rank src's result to every rank: its layout (and any plain numbers) pickled, its tensors in
    one flat buffer per dtype, unconverted (bitwise). Rank src gets its own objects back."""
    sender, tensors = dist.get_rank() == src, []
    header = [None]
    if sender:
        header = [(_take_tensors(result, tensors), [(t.dtype, t.shape, t.device.type) for t in tensors])]
    dist.broadcast_object_list(header, src=src)
    layout, specs = header[0]
    wire = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    received = [None] * len(specs)
    for dtype in dict.fromkeys(spec[0] for spec in specs):
        idx = [i for i, spec in enumerate(specs) if spec[0] == dtype]
        sizes = [specs[i][1].numel() for i in idx]
        if sender:
            buf = torch.cat([tensors[i].detach().reshape(-1).to(wire) for i in idx])
        else:
            buf = torch.empty(sum(sizes), dtype=dtype, device=wire)
        dist.broadcast(buf, src=src)
        for i, part in zip(idx, buf.split(sizes)):
            # not a view of buf
            received[i] = part.view(specs[i][1]).to("cpu" if specs[i][2] == "cpu" else wire).clone()
    return result if sender else _put_tensors(layout, received)

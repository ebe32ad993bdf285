"""pfl-research's side of benchmarks/vs_pfl.py: pfl's CIFAR-10 benchmark (benchmarks/image_classification/pytorch/
train.py with configs/baseline.yaml, IID) on an image folder, in pfl's own venv (pfl 0.6.0; not a CleanFL dependency).

    PFL_VENV/bin/python benchmarks/pfl_app/simulate.py --data-dir /path/to/cifar10 --rounds 10 --out pfl.json
    PFL_VENV/bin/python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/pfl_app/simulate.py ...
    PFL_VENV/bin/python benchmarks/pfl_app/simulate.py --data-dir /path/to/cifar10 --prepare-only  # decode, cache

As pfl's benchmark: simple_cnn (benchmarks/model/pytorch/cnn.py, copied below: the benchmarks are not in pfl's
wheel), the images as float32 channel-last arrays normalized by the training split's per-channel mean and std,
IID users of a constant number of images (np.random.permutation, then consecutive slices), users sampled at
random each round, unweighted (WeightByUser) averaging of the model differences applied by central SGD at lr 1
(FedAvg), local SGD without momentum, SimulatedBackend, CentralEvaluationCallback on the whole test set in one
batch of 10,000, and the benchmark's other callbacks (stopwatch, metrics to disk, best metrics). Under torchrun
(pfl's recommended way for PyTorch) each of the processes trains its share of the cohort and evaluates its share
of the test set; pfl all-reduces both.

The run evaluates centrally every --central-eval-every rounds (the callback's frequency; pfl's config: 10), at
the central iterations 0, E, 2E, ...: any E consecutive rounds hold one evaluation, as CleanFL's --eval-every E
rounds do. pfl's config ties one more evaluation to the same
frequency (the algorithm's evaluation_frequency): each user's model on its own data before and after its local
training, two forward passes over the user's images; CleanFL does no such thing, so it runs only where pfl always
runs it, in round 1 (the warm-up), unless --user-eval-every asks for it. A callback after the central evaluation
stamps the wall clock at the end of each round; --out gets those stamps, the accuracy after each round (None for
round 1), the parameter count and the processes' threads.
The JPEGs are decoded once and cached (DIR/.pfl-cache.npz, or ~/.cache/cleanfl/pfl-folder-<key>.npz where DIR is
read-only, as CleanFL caches its copy), so a run reads no image file.
"""

import argparse
import hashlib
import json
import os
import sys
import time
import types

import numpy as np
import torch
import torch.nn as nn
from PIL import Image

import pfl
from pfl.aggregate.simulate import SimulatedBackend
from pfl.aggregate.weighting import WeightByUser
from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
from pfl.callback.aggregate_metrics_to_disk import AggregateMetricsToDisk
from pfl.callback.base import TrainingProcessCallback
from pfl.callback.central_evaluation import CentralEvaluationCallback
from pfl.callback.stopwatch import StopwatchCallback
from pfl.callback.track_best_overall_metrics import TrackBestOverallMetrics
from pfl.data.dataset import Dataset
from pfl.data.federated_dataset import FederatedDataset
from pfl.data.sampling import get_user_sampler
from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
from pfl.internal.ops import pytorch_ops
from pfl.metrics import Metrics, Weighted
from pfl.model.pytorch import PyTorchModel

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")
ACCURACY = "Central val | accuracy"  # CentralEvaluationCallback's name of the test accuracy


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", required=True, help="image folder: train/<class>/*, test/<class>/*")
    p.add_argument("--rounds", type=int, default=10, help="central iterations")
    p.add_argument("--num-clients", type=int, default=1000, help="users: the training images split in equal parts")
    p.add_argument("--cohort-size", type=int, default=50, help="users a round")
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.1, help="local SGD learning rate (no momentum)")
    p.add_argument("--eval-batch-size", type=int, default=10_000, help="central evaluation batch (pfl's config)")
    p.add_argument(
        "--central-eval-every", type=int, default=10, help="central evaluation every this many rounds (pfl's config)"
    )
    p.add_argument(
        "--user-eval-every",
        type=int,
        default=0,
        help="pfl's evaluation of each user before and after its local training, every this many rounds (pfl's "
        "evaluation_frequency; its config: 10, with the central evaluation's). 0: only in round 1 (pfl always does "
        "it there), as CleanFL evaluates no client",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="JSON file of the results (required unless --prepare-only)")
    p.add_argument("--prepare-only", action="store_true", help="decode and cache the images, run nothing")
    args = p.parse_args()
    if not args.prepare_only and not args.out:
        p.error("--out is required")
    return args


# ---------------------------------------------------------------------------------------------
# pfl-research's simple_cnn, as in its benchmarks (not part of the pfl package):
# benchmarks/model/pytorch/cnn.py (simple_cnn), layer.py (Transpose2D), metrics.py (loss and metrics)
# ---------------------------------------------------------------------------------------------
class Transpose2D(nn.Module):
    """Transpose Tensorflow style image to PyTorch compatible."""

    def forward(self, inputs):
        return inputs.permute((0, 3, 1, 2))


def cross_entropy(logits, targets, reduction):
    assert logits.ndim == 2, f"expect 2D tensor, get {logits.ndim}D"
    loss_fct = nn.CrossEntropyLoss(reduction=reduction)
    if targets.dim() > 1:
        targets = targets.squeeze()
    return loss_fct(logits, targets.long())


@torch.no_grad()
def accuracy(logits, targets):
    assert logits.ndim == 2, f"expect 2D tensor, get {logits.ndim}D"
    correct = logits.argmax(-1) == targets.squeeze().long()
    return correct.float().sum()


def image_classification_loss(self, inputs, targets, eval=False):
    self.eval() if eval else self.train()
    return cross_entropy(self(inputs), targets, "mean")


@torch.no_grad()
def image_classification_metrics(self, inputs, targets, eval=True):
    self.eval() if eval else self.train()
    logits = self(inputs)
    num_samples = len(inputs)
    correct = accuracy(logits, targets).item()
    loss = cross_entropy(logits, targets, "sum").item()
    return {"loss": Weighted(loss, num_samples), "accuracy": Weighted(correct, num_samples)}


def simple_cnn(input_shape, num_outputs):
    """A simple CNN with 2 convolutional layers and one dense hidden layer; input_shape e.g. (32, 32, 3)."""
    in_channels = input_shape[-1]
    maxpool_output_size = (input_shape[0] - 4) // 2
    flatten_size = maxpool_output_size * maxpool_output_size * 64
    model = nn.Sequential(
        Transpose2D(),
        nn.Conv2d(in_channels, 32, kernel_size=(3, 3)),
        nn.ReLU(),
        nn.Conv2d(32, 64, kernel_size=(3, 3)),
        nn.ReLU(),
        nn.MaxPool2d((2, 2)),
        nn.Dropout(0.25),
        nn.Flatten(),
        nn.Linear(flatten_size, 128),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Linear(128, num_outputs),
    )
    # Apply Glorot (Xavier) uniform initialization to match TF2 model.
    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            torch.nn.init.xavier_uniform_(m.weight)
    model.loss = types.MethodType(image_classification_loss, model)
    model.metrics = types.MethodType(image_classification_metrics, model)
    return model


# ---------------------------------------------------------------------------------------------
# The image folder, decoded once (uint8 [N, H, W, C], channel-last as pfl's CIFAR-10 pickles) and cached
# ---------------------------------------------------------------------------------------------
def folder_files(data_dir):
    """{"train": [(label, path)], "test": [...]}: a class's label is its place among train/'s sorted folder names."""
    classes = sorted(e.name for e in os.scandir(os.path.join(data_dir, "train")) if e.is_dir())
    files = {}
    for split in ("train", "test"):
        files[split] = []
        for label, name in enumerate(classes):
            folder = os.path.join(data_dir, split, name)
            images = sorted(f for f in os.listdir(folder) if f.lower().endswith(IMAGE_EXTENSIONS))
            files[split] += [(label, os.path.join(folder, f)) for f in images]
    return files


def read_folder(data_dir):
    """x_train, y_train, x_test, y_test of the folder: decoded on the first call, then read from the cache (its stamp:
    each image's path, size and modification time)."""
    root = os.path.abspath(data_dir)
    files = folder_files(root)
    stamp = hashlib.sha1()
    for split in ("train", "test"):
        for label, path in files[split]:
            st = os.stat(path)
            stamp.update(f"{split}\0{label}\0{os.path.relpath(path, root)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    key = hashlib.sha1(root.encode()).hexdigest()[:16]
    caches = [os.path.join(root, ".pfl-cache.npz"), os.path.expanduser(f"~/.cache/cleanfl/pfl-folder-{key}.npz")]
    for cache in caches:
        if os.path.isfile(cache):
            with np.load(cache) as saved:
                if str(saved["stamp"]) == stamp.hexdigest():
                    return saved["x_train"], saved["y_train"], saved["x_test"], saved["y_test"]
    arrays = {}
    for split in ("train", "test"):
        images = []
        for _, path in files[split]:
            with Image.open(path) as img:
                images.append(np.asarray(img.convert("RGB")))
        arrays[f"x_{split}"] = np.stack(images)
        arrays[f"y_{split}"] = np.array([label for label, _ in files[split]], dtype=np.int64)
    # The first writable place; written under another name and renamed, so that a reader (another worker) never
    # sees a half-written cache.
    for cache in caches:
        try:
            os.makedirs(os.path.dirname(cache), exist_ok=True)
            tmp = f"{cache}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                np.savez(f, stamp=np.array(stamp.hexdigest()), **arrays)
            os.replace(tmp, cache)
            break
        except OSError:
            continue
    return arrays["x_train"], arrays["y_train"], arrays["x_test"], arrays["y_test"]


# ---------------------------------------------------------------------------------------------
# pfl's benchmark datasets: benchmarks/dataset/cifar10/numpy.py (load_and_preprocess, make_iid_federated_dataset,
# make_central_dataset), on the decoded arrays instead of its pickles
# ---------------------------------------------------------------------------------------------
def normalize(images, channel_means=None, channel_stddevs=None):
    """Per-channel normalization; the means and stddevs of these images unless given (the training split's)."""
    images = images.astype(np.float32)
    if channel_means is None:
        channel_means = images.mean(axis=(0, 1, 2), dtype="float64")
    if channel_stddevs is None:
        channel_stddevs = images.std(axis=(0, 1, 2), dtype="float64")
    images = (images - channel_means) / channel_stddevs
    return images, channel_means, channel_stddevs


def make_iid_federated_dataset(images, labels, num_users, numpy_to_tensor):
    """num_users users of len(images) // num_users images each, IID: a random permutation cut in consecutive slices
    (pfl's loop over a constant dataset-length sampler, stopped at num_users)."""
    data_order = np.random.permutation(len(images))
    images, labels = images[data_order], labels[data_order]
    images = numpy_to_tensor(images)
    labels = numpy_to_tensor(labels)
    per_user = len(images) // num_users
    users_to_data = {}
    for user in range(num_users):
        user_slice = slice(user * per_user, (user + 1) * per_user)
        users_to_data[user] = (images[user_slice], labels[user_slice])
    user_sampler = get_user_sampler("random", range(len(users_to_data)))
    return FederatedDataset.from_slices(users_to_data, user_sampler)


class RoundClock(TrainingProcessCallback):
    """Placed after the central evaluation: stamps the wall clock at the end of each central iteration (round) and
    keeps the test accuracy. At iteration 0 the metrics hold the initial model's evaluation (on_train_begin's)."""

    def __init__(self, record):
        self.record = record

    def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
        now = time.time()
        value = aggregate_metrics.to_simple_dict().get(ACCURACY)
        if central_iteration == 0:
            self.record["initial_acc"] = value
            value = None
        self.record["round_end"].append(now)
        self.record["test_acc_by_round"].append(value)
        return False, Metrics()


@torch.no_grad()
def final_accuracy(model, images, labels, batch_size):
    """The share of the images the model classifies right (channel-last float images, as the benchmark's)."""
    model.eval()
    right = 0
    for start in range(0, len(images), batch_size):
        x = torch.as_tensor(images[start : start + batch_size], dtype=torch.float32).to(next(model.parameters()).device)
        predicted = model(x).argmax(1).cpu().numpy()
        right += int((predicted == labels[start : start + batch_size]).sum())
    return right / len(images)


def main(args):
    start = time.time()
    torch.random.manual_seed(args.seed)
    np.random.seed(args.seed)
    x_train, y_train, x_test, y_test = read_folder(args.data_dir)
    record = {"start": start, "data_read": time.time(), "round_end": [], "test_acc_by_round": []}
    train_images, channel_means, channel_stddevs = normalize(x_train)
    val_images, _, _ = normalize(x_test, channel_means, channel_stddevs)
    numpy_to_tensor = pytorch_ops.to_tensor
    training_federated_dataset = make_iid_federated_dataset(train_images, y_train, args.num_clients, numpy_to_tensor)
    val_federated_dataset = make_iid_federated_dataset(val_images, y_test, args.num_clients, numpy_to_tensor)
    central_data = Dataset(raw_data=[val_images, y_test])

    pytorch_model = simple_cnn(x_train.shape[1:], int(y_train.max()) + 1)
    pytorch_model = pytorch_model.to(pytorch_ops.get_default_device())
    params = [p for p in pytorch_model.parameters() if p.requires_grad]
    record["params"] = sum(p.numel() for p in params)
    print(f"pfl simple_cnn: {record['params']:,} parameters", flush=True)
    model = PyTorchModel(
        model=pytorch_model,
        local_optimizer_create=torch.optim.SGD,
        central_optimizer=torch.optim.SGD(params, 1.0),
    )
    backend = SimulatedBackend(
        training_data=training_federated_dataset,
        val_data=val_federated_dataset,
        postprocessors=[WeightByUser()],
    )
    algorithm_params = NNAlgorithmParams(
        central_num_iterations=args.rounds,
        evaluation_frequency=args.user_eval_every or args.rounds + 1,
        train_cohort_size=args.cohort_size,
        val_cohort_size=0,
    )
    model_train_params = NNTrainHyperParams(
        local_learning_rate=args.lr,
        local_num_epochs=args.local_epochs,
        local_batch_size=args.batch_size,
    )
    model_eval_params = NNEvalHyperParams(local_batch_size=args.eval_batch_size)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    callbacks = [
        StopwatchCallback(),
        CentralEvaluationCallback(central_data, model_eval_params=model_eval_params, frequency=args.central_eval_every),
        AggregateMetricsToDisk(os.path.join(out_dir, "pfl-metrics.csv")),
        TrackBestOverallMetrics(higher_is_better_metric_names=[ACCURACY]),
        RoundClock(record),
    ]
    FederatedAveraging().run(
        algorithm_params=algorithm_params,
        backend=backend,
        model=model,
        model_train_params=model_train_params,
        model_eval_params=model_eval_params,
        callbacks=callbacks,
    )
    # The final model's test accuracy, after the last round (pfl's own evaluations fall on rounds 1, E + 1, ...),
    # outside the timed rounds: the accuracy both sides reach after R rounds.
    record["final_test_acc"] = final_accuracy(pytorch_model, val_images, y_test, args.eval_batch_size)
    distributed = pytorch_ops.distributed
    evaluated = [acc for acc in record["test_acc_by_round"] if acc is not None]
    record.update(
        test_acc=evaluated[-1] if evaluated else None,
        workers=distributed.world_size,
        threads=torch.get_num_threads(),
        cohort_size=args.cohort_size,
        num_clients=args.num_clients,
        pfl=pfl.__version__,
        torch=torch.__version__,
    )
    if distributed.global_rank == 0:
        # Written under another name and renamed: a half-written JSON is never read as a result.
        with open(f"{args.out}.tmp", "w") as f:
            json.dump(record, f, indent=1)
        os.replace(f"{args.out}.tmp", args.out)


if __name__ == "__main__":
    args = parse_args()
    if args.prepare_only:
        read_folder(args.data_dir)
    else:
        main(args)
        # Under torchrun, pfl's processes abort at the interpreter's exit about one time in two ("terminate called
        # without an active exception", SIGABRT, from a thread left running): once every process is done and rank 0
        # has written the results, each ends at once.
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)

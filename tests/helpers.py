"""Helpers for end-to-end tests: run a script in a subprocess and read its run folder."""

import importlib
import json
import os
import subprocess
import sys
import time

import torch

import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [
    "--dataset",
    "synthetic",
    "--device",
    "cpu",
    "--model",
    "mlp",
    "--num-clients",
    "4",
    "--frac",
    "0.5",
    "--local-steps",
    "3",
    "--batch-size",
    "16",
    "--rounds",
    "4",
]


def run_script(script, *flags, check=True, env=None):
    """python <script> <flags> in the repo root with one thread; returns the CompletedProcess."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run([sys.executable, script, *map(str, flags)], cwd=ROOT, env=env, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


def prepare(script, argv, monkeypatch, capsys=None):
    """<script>'s steps before training, in this process: parse_args, load_data, make_partition (where a bad flag,
    folder or partition is refused). (args, data, partition), or (exit code, the last stderr line) on a refusal."""
    module = importlib.import_module(script)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *map(str, argv)])
    try:
        args = module.parse_args()
        try:
            data = common.load_data(args)
            return args, data, common.make_partition(args, data)
        except common.BadInput as e:
            # As the scripts' `with Run(args)` does: one line, exit 2.
            common.refuse(str(e))
    except SystemExit as e:
        err = capsys.readouterr().err.strip().splitlines() if capsys else []
        return e.code, err[-1] if err else ""


def wait_for_checkpoint(out, timeout=120):  # round 1's checkpoint.pt, written after its metrics row: a signal now
    deadline = time.time() + timeout  # falls in a later round, and a kill leaves round 1 to resume from
    while time.time() < deadline and not os.path.exists(os.path.join(out, "checkpoint.pt")):
        time.sleep(0.05)


def start_script(script, *flags):
    """python <script> <flags> started in the background (one thread, output piped): for Ctrl-C tests."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, script, *map(str, flags)]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def metrics(run_dir):
    """metrics.jsonl without timings."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for row in rows:
        row.pop("elapsed_s", None)
    return rows


def summary(run_dir):
    with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f)


def assert_same_model(dir_a, dir_b):
    a = torch.load(os.path.join(dir_a, "model.pt"))
    b = torch.load(os.path.join(dir_b, "model.pt"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def mapped_from(tensor, path):
    """Whether the tensor's memory is a mapping of the file at path (Linux's /proc/self/maps)."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            span, *_, name = line.split(maxsplit=5)
            start, end = (int(a, 16) for a in span.split("-"))
            if start <= address < end and name.strip() == os.path.realpath(path):
                return True
    return False


def set_state(net, scale, batches):
    """Hand-made state: the float entries are `scale` times 1, 2, ... in state order, integer counters `batches`."""
    values, i = {}, 1
    for k, v in net.state_dict().items():
        if v.is_floating_point():
            values[k] = scale * torch.arange(i, i + v.numel(), dtype=torch.float).view_as(v)
            i += v.numel()
        else:
            values[k] = torch.tensor(batches)
    net.load_state_dict(values)
    return net


def run_parallel(*commands, workers=2):
    """Run several (script, *flags) commands, `workers` at a time (the CI machine has 2 cores)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return [f.result() for f in [pool.submit(run_script, *c) for c in commands]]


RUN_BATCH = os.path.join(ROOT, "tests", "run_batch.py")


def run_batches(*batches):
    """Run the batches at the same time, each batch ([script, *flags] lists) one after another in ONE
    python process: most of a tiny run's CPU is importing torch, which a batch pays once. Each run
    seeds everything it uses, so sharing a process does not change its results (tested against
    separate processes in test_fedavg.py). Fails on a non-zero exit."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, RUN_BATCH, json.dumps([[str(a) for a in c] for c in batch])],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for batch in batches
    ]
    for p in procs:
        _, err = p.communicate()
        assert p.returncode == 0, err[-3000:]


CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


def stand_in_folder(root, classes=CIFAR10_CLASSES):
    """A CIFAR-10-shaped image folder with one 2x2 image per class and split: enough for finish_args,
    which looks at the class folders and requires an image in each."""
    from PIL import Image

    for split in ("train", "test"):
        for c in classes:
            os.makedirs(os.path.join(root, split, c))
            Image.new("RGB", (2, 2)).save(os.path.join(root, split, c, "0.png"))
    return str(root)


def stand_in_groups(root, groups=("art_painting", "cartoon", "photo", "sketch"), classes=CIFAR10_CLASSES[:7]):
    """An image folder in groups (PACS-shaped: 4 domains of 7 classes, test/ per group), one 2x2 image per
    class: enough for finish_args with --natural or --clients-per-domain."""
    from PIL import Image

    for split in ("train", "test"):
        for g in groups:
            for c in classes:
                os.makedirs(os.path.join(root, split, g, c))
                Image.new("RGB", (2, 2)).save(os.path.join(root, split, g, c, "0.png"))
    return str(root)


def stand_in_tinyimagenet(root):
    """Tiny-ImageNet's layout (train/<wnid>/images/, val/images/, val/val_annotations.txt), one image a class."""
    from PIL import Image

    for w in ("n01443537", "n01629819"):
        os.makedirs(os.path.join(root, "train", w, "images"))
        Image.new("RGB", (64, 64)).save(os.path.join(root, "train", w, "images", f"{w}_0.JPEG"))
    os.makedirs(os.path.join(root, "val", "images"))
    Image.new("RGB", (64, 64)).save(os.path.join(root, "val", "images", "val_0.JPEG"))
    with open(os.path.join(root, "val", "val_annotations.txt"), "w") as f:
        f.write("val_0.JPEG\tn01443537\t0\t0\t63\t63\n")
    return str(root)

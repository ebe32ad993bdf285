"""A refactor keeps results: run a fixed set of tiny runs of the six scripts, then compare two such sets bit for bit.

    python benchmarks/same_results.py run DIR [NAME ...]  # the runs below (or these) into DIR/<name>/, one thread
    python benchmarks/same_results.py compare DIR_A DIR_B

`run` covers the scripts' main flags: partitions (shards, Dirichlet with power-law sizes, classes per client,
disjoint classes, split-2, client folders, domains), aggregations (FedProx, SCAFFOLD, FedEXP, FedYogi, FedAdam),
personalization, per-client and balanced tests, validation, augmentations, analyses, and a run stopped and
resumed. `compare` checks, for every run folder of DIR_A, that DIR_B has the same metrics.jsonl rows (without
elapsed_s), summary.json (without its timings and torch's thread line), partition.json and model.pt (every
tensor bit for bit); it prints one line per run and exits 1 if any differ. Run both sets on one machine: the
same thread count gives the same float results.
"""

import json
import os
import subprocess
import sys

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYN = ["--dataset", "synthetic", "--device", "cpu", "--save-model", "--eval-every", "1"]
RUNS = {  # name: (script, flags)
    "fedavg-prox": (
        "fedavg.py",
        [
            *SYN,
            "--num-clients",
            "10",
            "--frac",
            "0.5",
            "--shards",
            "2",
            "--rounds",
            "3",
            "--local-steps",
            "4",
            "--prox-mu",
            "0.01",
            "--client-test",
            "--balanced-acc",
            "--val-frac",
            "0.1",
        ],
    ),
    "fedavg-dirichlet": (
        "fedavg.py",
        [
            *SYN,
            "--alpha",
            "0.5",
            "--quantity",
            "powerlaw",
            "--model",
            "mlp",
            "--num-clients",
            "8",
            "--rounds",
            "3",
            "--local-epochs",
            "1",
            "--lr-decay-at",
            "0.5",
            "--weighting",
            "uniform",
            "--augment",
            "flip",
            "--data-seed",
            "7",
        ],
    ),
    "fedavg-natural": (
        "fedavg.py",
        [
            "--dataset",
            "folder",
            "--data-dir",
            "{groups}",
            "--natural",
            "--model",
            "mlp",
            "--device",
            "cpu",
            "--save-model",
            "--rounds",
            "2",
            "--local-steps",
            "3",
            "--frac",
            "1",
            "--balanced-acc",
        ],
    ),
    "fedavg-domains": (
        "fedavg.py",
        [
            "--dataset",
            "folder",
            "--data-dir",
            "{domains}",
            "--clients-per-domain",
            "2",
            "--classes-per-client",
            "2",
            "--model",
            "cnn",
            "--device",
            "cpu",
            "--save-model",
            "--rounds",
            "2",
            "--local-steps",
            "2",
            "--frac",
            "0.5",
            "--client-test",
        ],
    ),
    "fedbabu": (
        "fedbabu.py",
        [
            *SYN,
            "--model",
            "convnet4-tiny",
            "--shards",
            "2",
            "--num-clients",
            "6",
            "--rounds",
            "2",
            "--local-epochs",
            "1",
            "--ft-epochs",
            "2",
            "--ft-eval-epochs",
            "0",
            "1",
            "--frac",
            "0.5",
        ],
    ),
    "fedfn-scaffold": (
        "fedfn.py",
        [
            *SYN,
            "--model",
            "cnn",
            "--alpha",
            "0.3",
            "--num-clients",
            "6",
            "--rounds",
            "2",
            "--local-steps",
            "3",
            "--agg",
            "scaffold",
            "--analyze",
            "every",
            "--frac",
            "0.5",
        ],
    ),
    "fedfn-fedexp": (
        "fedfn.py",
        [
            *SYN,
            "--model",
            "convnet4-tiny",
            "--shards",
            "2",
            "--num-clients",
            "6",
            "--rounds",
            "2",
            "--local-steps",
            "3",
            "--agg",
            "fedexp",
            "--ft-epochs",
            "1",
            "--fn-scale",
            "sqrt-d",
            "--frac",
            "0.5",
            "--client-test",
        ],
    ),
    "fedln-yogi": (
        "fedln.py",
        [
            *SYN,
            "--model",
            "normcnn",
            "--width",
            "8",
            "--norm",
            "ln",
            "--classes-per-client",
            "1",
            "--num-clients",
            "10",
            "--rounds",
            "2",
            "--local-steps",
            "3",
            "--agg",
            "fedyogi",
            "--track-singular-values",
            "--frac",
            "0.3",
        ],
    ),
    "fedln-resnet": (
        "fedln.py",
        [
            *SYN,
            "--model",
            "resnet18",
            "--width",
            "4",
            "--norm",
            "bn",
            "--disjoint-classes",
            "--num-clients",
            "3",
            "--rounds",
            "2",
            "--local-steps",
            "2",
            "--agg",
            "scaffold",
        ],
    ),
    "fednnnn": (
        "fednnnn.py",
        [
            *SYN,
            "--model",
            "cnn6-narrow",
            "--iid",
            "--num-clients",
            "5",
            "--rounds",
            "3",
            "--local-steps",
            "3",
            "--frac",
            "0.6",
        ],
    ),
    "anfr-fedadam": (
        "anfr.py",
        [
            *SYN,
            "--arch",
            "anfr",
            "--depth",
            "18",
            "--width",
            "8",
            "--rounds",
            "2",
            "--local-steps",
            "3",
            "--agg",
            "fedadam",
            "--val-frac",
            "0.1",
            "--analyze",
        ],
    ),
    "anfr-recipe": (
        "anfr.py",
        [
            *SYN,
            "--arch",
            "se",
            "--depth",
            "18",
            "--width",
            "4",
            "--rounds",
            "2",
            "--local-steps",
            "3",
            "--augment",
            "rrc",
            "--crop-scale",
            "0.05",
            "1",
            "--image-size",
            "24",
            "--normalize",
            "half",
            "--bn-stats",
            "local",
            "--loss",
            "focal",
            "--iid",
        ],
    ),
    "anfr-fedbn": (
        "anfr.py",
        [
            *SYN,
            "--arch",
            "bn",
            "--depth",
            "18",
            "--width",
            "4",
            "--rounds",
            "2",
            "--local-steps",
            "2",
            "--pfl",
            "fedbn",
            "--classes-per-client",
            "2",
        ],
    ),
    "anfr-dp": (
        "anfr.py",
        [
            *SYN,
            "--arch",
            "nf",
            "--depth",
            "18",
            "--width",
            "4",
            "--rounds",
            "2",
            "--local-steps",
            "2",
            "--dp-noise-multiplier",
            "1.0",
            "--agg",
            "scaffold",
            "--alpha",
            "1.0",
        ],
    ),
}
RESUMED = "fedavg-prox"  # also run stopped after 2 rounds and resumed: fedavg-prox-resumed


def image_folders(base):
    """Two tiny image folders of 16x16 PNGs (seeded): in client groups with per-client tests, and in domains with
    one shared test/."""
    from PIL import Image

    rng = np.random.default_rng(0)

    def write(path, label, n):
        os.makedirs(path, exist_ok=True)
        for i in range(n):
            pixels = np.clip(rng.normal(60 + 60 * label, 40, (16, 16, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(os.path.join(path, f"{i}.png"))

    groups, domains = os.path.join(base, "groups"), os.path.join(base, "domains")
    for g in ("alice", "bob", "carol"):
        for c, label in (("cat", 0), ("dog", 1), ("emu", 2)):
            write(os.path.join(groups, "train", g, c), label, 12)
            write(os.path.join(groups, "test", g, c), label, 4)
    for d in ("art", "photo"):
        for c, label in (("cat", 0), ("dog", 1), ("emu", 2)):
            write(os.path.join(domains, "train", d, c), label, 10)
    for c, label in (("cat", 0), ("dog", 1), ("emu", 2)):
        write(os.path.join(domains, "test", c), label, 6)
    return {"groups": groups, "domains": domains}


def run_all(out, only=()):
    os.makedirs(out, exist_ok=True)
    folders = image_folders(os.path.join(out, "_data"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def run(script, flags):
        flags = [f.format(**folders) for f in flags]
        proc = subprocess.run([sys.executable, script, *flags], cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{script} {' '.join(flags)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")

    for name, (script, flags) in RUNS.items():
        if only and name not in only:
            continue
        print(f"{name}: python {script} {' '.join(flags)}", flush=True)
        run(script, [*flags, "--out", os.path.join(out, name)])
    if only and f"{RESUMED}-resumed" not in only:
        return
    script, flags = RUNS[RESUMED]
    resumed = os.path.join(out, f"{RESUMED}-resumed")
    print(f"{RESUMED}-resumed: --stop-after 2, then --resume", flush=True)
    run(script, [*flags, "--out", resumed, "--stop-after", "2"])
    run(script, ["--resume", resumed])


def read(folder, name):
    path = os.path.join(folder, name)
    if not os.path.exists(path):
        return None
    if name == "model.pt":
        return torch.load(path)
    with open(path) as f:
        if name.endswith(".jsonl"):
            rows = [json.loads(line) for line in f if line.strip()]
            return [{k: v for k, v in row.items() if k != "elapsed_s"} for row in rows]
        value = json.load(f)
    if name == "summary.json":
        value = {k: v for k, v in value.items() if k not in ("wall_time_s", "elapsed_s", "device")}
    return value


def same(a, b):
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def compare(dir_a, dir_b):
    names = sorted(n for n in os.listdir(dir_a) if os.path.isfile(os.path.join(dir_a, n, "summary.json")))
    bad = 0
    for name in names:
        diffs = [
            f
            for f in ("metrics.jsonl", "summary.json", "partition.json", "model.pt")
            if not same(read(os.path.join(dir_a, name), f), read(os.path.join(dir_b, name), f))
        ]
        rows = len(read(os.path.join(dir_a, name), "metrics.jsonl"))
        print(f"{name:22} {'same' if not diffs else 'DIFFERENT: ' + ', '.join(diffs)} ({rows} rows)")
        bad += bool(diffs)
    print(f"{len(names) - bad} of {len(names)} runs bit for bit the same")
    return 1 if bad or not names else 0


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "run":
        run_all(sys.argv[2], sys.argv[3:])
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    else:
        sys.exit(__doc__)

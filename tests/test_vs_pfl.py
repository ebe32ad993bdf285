"""Tests of benchmarks/vs_pfl.py (fedavg.py against pfl-research on pfl's CIFAR-10 benchmark). The fast ones need no
pfl (CI installs none): the command line, the refusals, every run's command (--dry), the table, and that CleanFL's
`pfl-cnn` is pfl's simple_cnn layer for layer. One more runs both sides for 2 rounds on a tiny image folder; it is
skipped where pfl's venv (vs_pfl.py --setup-only) is absent."""

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from common import MODELS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
SCRIPT = os.path.join(BENCH, "vs_pfl.py")
PFL_PYTHON = os.path.expanduser("~/.cache/cleanfl/pfl-venv/bin/python")  # vs_pfl.py's default --venv

# pfl-research's simple_cnn for 32x32x3 images and 10 classes, read from its source (benchmarks/model/pytorch/cnn.py):
# Transpose2D, Conv2d(3, 32, 3), ReLU, Conv2d(32, 64, 3), ReLU, MaxPool2d(2), Dropout(0.25), Flatten,
# Linear(14 * 14 * 64, 128), ReLU, Dropout(0.5), Linear(128, 10). Its parameters in order:
SIMPLE_CNN_SHAPES = [(32, 3, 3, 3), (32,), (64, 32, 3, 3), (64,), (128, 12544), (128,), (10, 128), (10,)]
SIMPLE_CNN_LAYERS = [nn.Conv2d, nn.ReLU, nn.Conv2d, nn.ReLU, nn.MaxPool2d, nn.Dropout, nn.Flatten, nn.Linear, nn.ReLU]
SIMPLE_CNN_LAYERS += [nn.Dropout]  # then the head, Linear(128, 10)


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def vs_pfl(*flags):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, SCRIPT, *map(str, flags)]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)


@pytest.fixture
def folder(tmp_path):
    """DIR/train/<class>/ and DIR/test/<class>/, empty: enough for the flag checks and --dry."""
    for split in ("train", "test"):
        os.makedirs(tmp_path / "cifar" / split / "cat")
    return str(tmp_path / "cifar")


def test_help():
    res = vs_pfl("--help")
    assert res.returncode == 0, res.stderr
    for flag in ["--data-dir", "--rounds", "--cycles", "--configs", "--load", "--venv", "--out", "--setup-only"]:
        assert flag in res.stdout
    for flag in ["--dry", "--num-clients", "--frac"]:
        assert flag in res.stdout


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--rounds", "0"], "--rounds"),
        (["--rounds", "1"], "--rounds"),
        (["--rounds", "x"], "--rounds"),
        (["--rounds", "15"], "--rounds"),
        (["--rounds", "10"], "--rounds"),
        (["--eval-every", "0"], "--eval-every"),
        (["--cycles", "0"], "--cycles"),
        (["--load", "-1"], "--load"),
        (["--frac", "0"], "--frac"),
        (["--frac", "1.5"], "--frac"),
        (["--num-clients", "0"], "--num-clients"),
        (["--configs", "pfl-3"], "--configs"),
        (["--configs", "pfl-1", "pfl-1"], "--configs"),
    ],
)
def test_bad_flags(folder, tmp_path, flags, named):
    """Refused with one line that names the flag, exit 2, before any work (nothing written)."""
    out = tmp_path / "runs" / "results.json"
    res = vs_pfl("--data-dir", folder, "--out", out, *flags)
    assert res.returncode == 2, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and named in res.stderr, res.stderr
    assert res.stdout == "" and not (tmp_path / "runs").exists()


def test_bad_data_dir_and_out(tmp_path, folder):
    res = vs_pfl("--data-dir", tmp_path / "nowhere")
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1 and "--data-dir" in res.stderr
    os.makedirs(tmp_path / "half" / "train")
    res = vs_pfl("--data-dir", tmp_path / "half")
    assert res.returncode == 2 and "test/ is missing" in res.stderr and "--data-dir" in res.stderr
    res = vs_pfl("--rounds", 3)
    assert res.returncode == 2 and "--data-dir" in res.stderr
    out = tmp_path / "results.json"
    out.write_text("{}")
    res = vs_pfl("--data-dir", folder, "--out", out)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1 and "--out" in res.stderr
    assert out.read_text() == "{}"


def flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def test_dry_commands(folder, tmp_path):
    """--dry: every run's command in run order (every other cycle reversed), with the benchmark's work on both sides;
    each CleanFL flag is one of fedavg.py's, each pfl flag one of simulate.py's."""
    out = tmp_path / "results.json"
    flags = ["--dry", "--cycles", 2, "--rounds", 6, "--eval-every", 3, "--frac", 0.002, "--out", out]
    res = vs_pfl("--data-dir", folder, *flags)
    assert res.returncode == 0, res.stderr
    vs = load("vs_pfl.py", "vs_pfl")
    lines = res.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == [f"cycle 1 {c}" for c in vs.CONFIGS] + [
        f"cycle 2 {c}" for c in reversed(vs.CONFIGS)
    ]
    assert not out.exists()
    fedavg_help = subprocess.run(
        [sys.executable, "fedavg.py", "--help"], cwd=ROOT, capture_output=True, text=True, env=os.environ
    ).stdout
    with open(os.path.join(BENCH, "pfl_app", "simulate.py")) as f:
        simulate_flags = set(re.findall(r'add_argument\(\s*"(--[a-z-]+)"', f.read()))
    for line in lines[: len(vs.CONFIGS)]:
        config = line.split(":")[0].split()[-1]
        words = shlex.split(line.split(": ", 1)[1])
        env = dict(w.split("=", 1) for w in words if re.fullmatch(r"[A-Z_]+=.*", w))
        cmd = [w for w in words if not re.fullmatch(r"[A-Z_]+=.*", w)]
        torchrun = "torch.distributed.run" in cmd
        assert torchrun == config.endswith("-2")
        if torchrun:
            assert flag(cmd, "--nproc_per_node") == "2" and "--standalone" in cmd
        assert env.get("OMP_NUM_THREADS") == ("1" if torchrun or config == "pfl-1t" else None)
        assert flag(cmd, "--rounds") == "6" and flag(cmd, "--num-clients") == "1000"
        # A test-set evaluation every 3 rounds on both sides.
        assert flag(cmd, "--central-eval-every" if config.startswith("pfl") else "--eval-every") == "3"
        assert flag(cmd, "--local-epochs") == "1" and flag(cmd, "--batch-size") == "10" and flag(cmd, "--lr") == "0.1"
        if config.startswith("pfl"):
            assert cmd[0].endswith("bin/python") and any(w.endswith("pfl_app/simulate.py") for w in cmd)
            assert flag(cmd, "--cohort-size") == "2"  # 0.002 x 1000, as fedavg.py counts its clients a round
            assert env.get("GOMP_SPINCOUNT") == ("1000" if config == "pfl-1-spin" else None)
            assert env["PFL_PYTORCH_DEVICE"] == "cpu"
            assert {w for w in cmd if w.startswith("--") and w not in ("--standalone", "--nproc_per_node")} <= (
                simulate_flags
            )
        else:
            assert cmd[0] == sys.executable and any(w.endswith("fedavg.py") for w in cmd)
            assert flag(cmd, "--frac") == "0.002" and flag(cmd, "--model") == "pfl-cnn" and "--iid" in cmd
            assert flag(cmd, "--dataset") == "folder" and flag(cmd, "--data-dir") == folder
            assert flag(cmd, "--momentum") == "0" and flag(cmd, "--weight-decay") == "0"
            assert flag(cmd, "--augment") == "none" and flag(cmd, "--weighting") == "uniform"
            assert flag(cmd, "--eval-every") == "3" and flag(cmd, "--device") == "cpu"
            assert ("--threads" in cmd) == (config == "cleanfl-1t")
            assert "GOMP_SPINCOUNT" not in env  # fedavg.py sets its own
            for word in cmd:
                if word.startswith("--") and word not in ("--standalone", "--nproc_per_node"):
                    assert word in fedavg_help, word


def test_table():
    """Per configuration: each cycle's s/round, the fastest round of all cycles, the median over cycles, the mean
    accuracy, and pfl / CleanFL of the medians at equal processes and threads (pfl-1, pfl-1-spin: cleanfl-1; pfl-1t:
    cleanfl-1t; pfl-2: cleanfl-2)."""
    vs = load("vs_pfl.py", "vs_pfl")
    runs = [
        {"config": c, "round_s": s, "round_min_s": m, "wall_s": 60.0, "test_acc": a}
        for c, s, m, a in [
            ("pfl-1", 6.0, 5.5, 0.30),
            ("pfl-1", 8.0, 7.0, 0.30),
            ("pfl-1", 7.0, 6.5, 0.30),
            ("pfl-1t", 9.0, 8.0, 0.30),
            ("pfl-2", 4.0, 3.9, 0.20),
            ("pfl-2", 5.0, 4.5, 0.40),
            ("cleanfl-1", 2.0, 1.8, 0.25),
            ("cleanfl-1", 4.0, 1.5, 0.35),
            ("cleanfl-1t", 4.0, 3.0, 0.30),
            ("cleanfl-2", 2.5, 2.4, 0.31),
        ]
    ]
    table = vs.table(runs, vs.CONFIGS, rounds=10)
    lines = table.splitlines()
    head = "| configuration | cycle 1 | cycle 2 | cycle 3 | min (fastest round) | median | test acc (R=10) |"
    assert lines[0] == head + " pfl / CleanFL |"
    assert "| pfl-1 | 6.00 | 8.00 | 7.00 | 5.50 | 7.00 | 0.3000 | 2.33x (cleanfl-1) |" in lines
    assert "| pfl-1t | 9.00 |  |  | 8.00 | 9.00 | 0.3000 | 2.25x (cleanfl-1t) |" in lines
    assert "| pfl-2 | 4.00 | 5.00 |  | 3.90 | 4.50 | 0.3000 | 1.80x (cleanfl-2) |" in lines
    assert "| cleanfl-1 | 2.00 | 4.00 |  | 1.50 | 3.00 | 0.3000 |  |" in lines
    assert "| cleanfl-2 | 2.50 |  |  | 2.40 | 2.50 | 0.3100 |  |" in lines
    assert not any("pfl-1-spin" in line for line in lines)  # no runs: no row
    assert len(lines) == 8
    # without its twin a pfl row has no ratio
    alone = vs.table([r for r in runs if r["config"] == "pfl-2"], ["pfl-2"], rounds=10)
    assert alone.splitlines()[-1].endswith("| 0.3000 |  |")
    # Windows of E rounds after the first E: the stamps of rounds 2, 4, 6 (whatever others there are) give 2 windows.
    assert vs.intervals({1: 0.5, 2: 1.0, 3: 2.0, 4: 4.0, 5: 5.0, 6: 7.0}, 2) == [1.5, 1.5]
    assert vs.intervals({2: 1.0, 4: 4.0, 6: 7.0, 8: 10.0}, 2) == [1.5, 1.5, 1.5]
    assert vs.intervals({1: 0.5, 2: 0.6, 3: 0.9}, 1) == [0.09999999999999998, 0.30000000000000004]
    assert vs.schedule(["a", "b", "c"], 3) == [(1, "a"), (1, "b"), (1, "c"), (2, "c"), (2, "b"), (2, "a")] + [
        (3, "a"),
        (3, "b"),
        (3, "c"),
    ]


def test_pfl_cnn_is_pfl_simple_cnn():
    """CleanFL's pfl-cnn: pfl's simple_cnn layers and parameter shapes (in order, so that FedAvg averages the same
    tensors), 1,626,442 parameters, the last Linear as model.head and everything before it as model.body."""
    torch.manual_seed(0)
    model = MODELS["pfl-cnn"](3, 10, 32)
    assert [tuple(p.shape) for p in model.parameters()] == SIMPLE_CNN_SHAPES
    assert sum(p.numel() for p in model.parameters()) == 1_626_442
    assert [type(m) for m in model.body] == SIMPLE_CNN_LAYERS
    assert [m.p for m in model.body if isinstance(m, nn.Dropout)] == [0.25, 0.5]
    assert isinstance(model.head, nn.Linear) and (model.head.in_features, model.head.out_features) == (128, 10)
    assert [name for name, _ in model.named_children()] == ["body", "head"]
    model.eval()
    x = torch.randn(4, 3, 32, 32)
    assert model(x).shape == (4, 10)
    assert torch.equal(model(x), model.head(model.body(x)))
    # Glorot-uniform weights, as pfl draws them: bounded by sqrt(6 / (fan_in + fan_out))
    bound = (6 / (12544 + 128)) ** 0.5
    assert model.body[7].weight.abs().max() <= bound and model.body[7].weight.abs().max() > 0.9 * bound


def tiny_folder(root):
    """10 classes of 32x32 JPEGs: 10 training images and 2 test images a class."""
    from PIL import Image

    gen = torch.Generator().manual_seed(0)
    for split, n in (("train", 10), ("test", 2)):
        for c in range(10):
            os.makedirs(os.path.join(root, split, f"class{c}"))
            for i in range(n):
                pixels = torch.randint(0, 256, (32, 32, 3), generator=gen, dtype=torch.uint8).numpy()
                Image.fromarray(pixels).save(os.path.join(root, split, f"class{c}", f"{i}.jpg"))
    return root


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(PFL_PYTHON), reason="no pfl venv (python benchmarks/vs_pfl.py --setup-only)")
def test_smoke_both_sides(tmp_path):
    """2 rounds of 2 clients a round, one configuration a side (one thread each): both sides count 1,626,442
    parameters and stamp both rounds; the JSON holds every number."""
    data = tiny_folder(str(tmp_path / "cifar"))
    out = tmp_path / "vs" / "results.json"
    flags = ["--data-dir", data, "--rounds", 2, "--eval-every", 1, "--cycles", 1, "--num-clients", 50, "--frac", 0.04]
    flags += ["--out", out]
    res = vs_pfl(*flags, "--configs", "pfl-2", "cleanfl-1t")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    saved = json.loads(out.read_text())
    assert [r["config"] for r in saved["runs"]] == ["pfl-2", "cleanfl-1t"]
    for run in saved["runs"]:
        assert run["params"] == 1_626_442
        assert len(run["round_end_s"]) == 2 and run["round_s"] > 0 and run["wall_s"] > 0
        assert 0 <= run["test_acc"] <= 1
    pfl = saved["runs"][0]["pfl"]
    assert pfl["workers"] == 2 and pfl["threads"] == 1 and pfl["cohort_size"] == 2 and pfl["num_clients"] == 50
    assert len(pfl["test_acc_by_round"]) == 2 and pfl["test_acc_by_round"][0] is None  # pfl skips round 1's test
    with open(tmp_path / "vs" / "cleanfl-1t-cycle1" / "run" / "metrics.jsonl") as f:
        assert [json.loads(line)["round"] for line in f] == [1, 2]
    assert "| pfl-2 |" in res.stdout and "| cleanfl-1t |" in res.stdout

"""Fast tests of benchmarks/vs_flower.py (fedavg.py against Flower on the same work) without Flower (CI installs no
flwr and runs no simulation): its command line, and that the Flower app's model is CleanFL's `cnn` layer for layer."""

import importlib.util
import os
import subprocess
import sys

import torch

from common import MODELS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_help():
    res = subprocess.run(
        [sys.executable, os.path.join(BENCH, "vs_flower.py"), "--help"], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    for flag in ["--data-dir", "--rounds", "--cycles", "--venv", "--out", "--load", "--configs", "--flower-data"]:
        assert flag in res.stdout


def test_flower_net_is_cleanfl_cnn():
    """Same parameter shapes in the same order (so FedAvg averages the same tensors), 2,156,490 in all, and the
    same function: CleanFL's weights loaded in order give the same outputs."""
    task = load("flower_app/task.py", "flower_task")  # torch only: no flwr needed
    ours = MODELS["cnn"](3, 10, 32)
    theirs = task.Net()
    assert [p.shape for p in theirs.parameters()] == [p.shape for p in ours.parameters()]
    assert sum(p.numel() for p in theirs.parameters()) == 2_156_490
    theirs.load_state_dict(dict(zip(theirs.state_dict(), ours.state_dict().values())))
    x = torch.randn(4, 3, 32, 32)
    assert torch.allclose(theirs(x), ours(x), atol=1e-6)


def test_table_ratio():
    """The table pairs each Flower configuration with its CleanFL twin: median s/round of Flower / of ours."""
    vs = load("vs_flower.py", "vs_flower")
    runs = [
        {"config": c, "round_s": s, "wall_s": 20.0, "test_acc": 0.3}
        for c, s in [
            ("flower-default", 3.0),
            ("flower-default", 5.0),
            ("cleanfl-default", 2.0),
            ("cleanfl-default", 2.0),
        ]
    ]
    table = vs.table(runs, ["flower-default", "cleanfl-default"], rounds=4)
    assert "| flower-default | 3.00 | 5.00 | 4.00 | 4.0 | 20.0 | 0.3000 | 2.00x |" in table
    assert vs.per_round([10.0, 12.0, 15.0, 17.0]) == 2.0  # the median of rounds 2..R, round 1 left out

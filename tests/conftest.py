import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Runs inside the pytest process must match script runs in subprocesses (helpers.py gives them
# OMP_NUM_THREADS=1) bit for bit, and a different thread count can change float reductions. A script run in this
# process (runpy) reads OMP_NUM_THREADS too; without it, it would take the idle cores and leave torch at that count.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)


def pytest_configure(config):
    """The `slow` marker: the full suite (CI, the README's command) runs everything; `-m "not slow"` is the fast
    tier for work in progress (README, "Tests and CI"): every script end to end at least once and every
    equation's test, without torchrun, gpu.sh's tiny mode and dry run, the timing benchmarks, fn_growth's replay,
    the bars' scripts, the second real-CIFAR-10 run and the second runs that resume == uninterrupted, Ctrl-C and the
    run-folder refusals need."""
    config.addinivalue_line("markers", "slow: left out of the fast tier (pytest -m 'not slow'); CI runs it")

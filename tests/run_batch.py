"""Run several script invocations one after another in this one process (helpers.run_batches; also
started by torchrun, one such process per rank): most of a tiny run's CPU is importing torch.
Usage: python tests/run_batch.py '[["fedavg.py", "--flag", ...], ...]' (from the repository root)."""

import json
import os
import runpy
import sys

sys.path.insert(0, os.getcwd())  # the repository root: the scripts import common
for argv in json.loads(sys.argv[1]):
    print("running", *argv, file=sys.stderr, flush=True)
    sys.argv = argv
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:  # --stop-after exits 0; anything else fails the batch
        if e.code not in (None, 0):
            raise

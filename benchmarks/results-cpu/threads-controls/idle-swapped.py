"""fedbabu-small and fedfn-small idle: the threads table's order, the default and --threads 2 in each other's places.

python benchmarks/results-cpu/threads-controls/idle-swapped.py /path/to/cifar10   # from the repository root
"""

import json
import os
import sys
import tempfile
import types

if len(sys.argv) != 2 or not all(os.path.isdir(os.path.join(sys.argv[1], s)) for s in ("train", "test")):
    sys.exit(f"usage: python {sys.argv[0]} DATA_DIR (a CIFAR-10 image folder with train/ and test/)")
if os.path.exists("idle-swapped.json"):  # the JSON goes to the current folder: never over an earlier one
    sys.exit("idle-swapped.json is here already: move it away, or run from another folder")
sys.path.insert(0, "benchmarks")
import threads  # noqa: E402

args, rows = types.SimpleNamespace(data_dir=os.path.abspath(sys.argv[1]), rounds=2, run_timeout=900), []
order = ["2 threads", "1 thread", "default", "torchrun 2x1"]
with tempfile.TemporaryDirectory() as tmp:
    for cycle in (1, 2):
        for workload in ("fedbabu-small", "fedfn-small"):
            for way in order if cycle % 2 else order[::-1]:
                sec, thr, acc = threads.run_once(args, workload, way, os.path.join(tmp, f"{cycle}-{workload}-{way}"))
                rows.append(dict(cycle=cycle, workload=workload, way=way, s_per_round=sec, threads=thr, test_acc=acc))
                print(rows[-1], flush=True)
                with open("idle-swapped.json", "w") as f:
                    json.dump(rows, f, indent=1)

"""fedfn-small idle: the default, --threads 2 (12 bytes more of argv), and the default with "--shards 02" (12 bytes)
or "--shards 2" (11) repeated at the end, which change nothing in config.json; the order reversed every other cycle.

    python benchmarks/results-cpu/threads-controls/idle-argv.py /path/to/cifar10   # from the repository root
"""

import json
import os
import sys
import tempfile
import types

if len(sys.argv) != 2 or not all(os.path.isdir(os.path.join(sys.argv[1], s)) for s in ("train", "test")):
    sys.exit(f"usage: python {sys.argv[0]} DATA_DIR (a CIFAR-10 image folder with train/ and test/)")
if os.path.exists("idle-argv.json"):  # the JSON goes to the current folder: never over an earlier one
    sys.exit("idle-argv.json is here already: move it away, or run from another folder")
sys.path.insert(0, "benchmarks")
import threads  # noqa: E402

base = threads.WORKLOADS["fedfn-small"]
threads.WORKLOADS.update({"+shards 2": base + " --shards 2", "+shards 02": base + " --shards 02", "base": base})
args, rows = types.SimpleNamespace(data_dir=os.path.abspath(sys.argv[1]), rounds=2, run_timeout=900), []
ways = [("base", "default"), ("base", "2 threads"), ("+shards 02", "default"), ("+shards 2", "default")]
with tempfile.TemporaryDirectory() as tmp:
    for cycle in (1, 2, 3):
        for workload, way in ways if cycle % 2 else ways[::-1]:
            out = os.path.join(tmp, f"{cycle}-{workload}-{way}")
            sec, thr, acc = threads.run_once(args, workload, way, out)
            with open(os.path.join(out, "config.json")) as f:
                config = {k: v for k, v in json.load(f).items() if k != "out"}
            rows.append(dict(cycle=cycle, argv=f"{workload} {way}", s_per_round=sec, threads=thr, test_acc=acc))
            rows[-1]["config"] = hash(json.dumps(config, sort_keys=True))  # one value: the same settings each run
            print(rows[-1], flush=True)
            with open("idle-argv.json", "w") as f:
                json.dump(rows, f, indent=1)

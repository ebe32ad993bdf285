"""Three idle controls of the threads table (docs/evidence/threads.md), each a set of (workload, way) blocks run in
cycles, every block's order reversed every other cycle; the JSON goes to idle-CONTROL.json in the current folder.
  swapped  fedbabu-small, then fedfn-small: the table's order with the default and --threads 2 in each other's places
  argv     fedfn-small: the default, --threads 2 (12 bytes more of argv), and the default with "--shards 02" (12 bytes)
           or "--shards 2" (11) repeated at the end, which change nothing in config.json (its hash, "config", says so)
  drift    fedfn-small, --threads 1 then the default, 30 rounds each, evaluated every round: every round's seconds
           (the same work each round: 10 clients of 500 images, one test-set evaluation) and the VM's steal time

    python benchmarks/results-cpu/threads-controls/idle_controls.py swapped /path/to/cifar10   # from any folder
"""

import json
import os
import sys
import tempfile
import types

CONTROLS = ("swapped", "argv", "drift")
if len(sys.argv) != 3 or sys.argv[1] not in CONTROLS or not os.path.isdir(os.path.join(sys.argv[2], "test")):
    sys.exit(f"usage: python {sys.argv[0]} swapped|argv|drift DATA_DIR (a CIFAR-10 image folder with train/ and test/)")
control, out_json = sys.argv[1], f"idle-{sys.argv[1]}.json"
if os.path.exists(out_json):  # never over an earlier one
    sys.exit(f"{out_json} is here already: move it away, or run from another folder")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # benchmarks/
import threads  # noqa: E402

base = threads.WORKLOADS["fedfn-small"]
threads.WORKLOADS.update({"+shards 2": base + " --shards 2", "+shards 02": base + " --shards 02", "base": base})
swapped = ["2 threads", "1 thread", "default", "torchrun 2x1"]
cycles, blocks = {
    "swapped": (2, [[(w, way) for way in swapped] for w in ("fedbabu-small", "fedfn-small")]),
    "argv": (3, [[("base", "default"), ("base", "2 threads"), ("+shards 02", "default"), ("+shards 2", "default")]]),
    "drift": (2, [[("fedfn-small", "1 thread"), ("fedfn-small", "default")]]),
}[control]
args, rows = types.SimpleNamespace(data_dir=os.path.abspath(sys.argv[2]), rounds=2, run_timeout=900), []
if control == "drift":  # one run of 2R rounds, R = 15, evaluated every round (threads.run_once: every R)
    args.rounds, args.eval_every = 15, 1


def steal():  # the VM's steal time, clock ticks over all cores (/proc/stat's 8th field): the host ran something else
    with open("/proc/stat") as f:
        return int(f.readline().split()[8])


with tempfile.TemporaryDirectory() as tmp:
    for cycle in range(1, cycles + 1):
        for workload, way in [pair for block in blocks for pair in (block if cycle % 2 else block[::-1])]:
            out = os.path.join(tmp, f"{cycle}-{workload}-{way}")
            steal_before = steal() if control == "drift" else None  # Linux's /proc/stat
            sec, thr, acc = threads.run_once(args, workload, way, out)
            rows.append(dict(cycle=cycle, workload=workload, way=way, s_per_round=sec, threads=thr, test_acc=acc))
            if control == "drift":  # each round's seconds from the second (the first holds start-up)
                with open(os.path.join(out, "metrics.jsonl")) as f:
                    elapsed = [json.loads(line)["elapsed_s"] for line in f if line.strip()]
                rows[-1]["round_s"] = [round(b - a, 3) for a, b in zip(elapsed, elapsed[1:])]
                rows[-1]["steal_ticks"] = steal() - steal_before
            if control == "argv":
                with open(os.path.join(out, "config.json")) as f:
                    config = {k: v for k, v in json.load(f).items() if k != "out"}
                rows[-1]["config"] = hash(json.dumps(config, sort_keys=True))  # one value: the same settings each run
            print(rows[-1], flush=True)
            with open(out_json, "w") as f:
                json.dump(rows, f, indent=1)

"""Peak memory (PSS) of a short fedavg.py run as 1, 2, 4 and 8 processes on one machine.

    python benchmarks/memory.py synth DIR        # an image folder of Tiny-ImageNet's shape, random pixels
    python benchmarks/memory.py measure --data-dir /path/to/cifar10 --data-dir DIR --out memory.json

`synth` writes DIR/train/<class>/*.bmp and DIR/test/<class>/*.bmp: 200 classes of 500 training and 50 test images
of 64x64 RGB, as Tiny-ImageNet has (random pixels, seeded: their decoded size is what counts here).

`measure` runs, for each --data-dir and each count K of --processes, the README's first run's work on that folder
(McMahan's 2NN, IID over 10 clients, all a round, 5 local steps, 2 rounds): `python fedavg.py` for K = 1 and
`torchrun --standalone --nproc_per_node K fedavg.py` above. Every 0.2 s it sums the proportional set size (PSS:
a page shared by n processes counts 1/n in each) over the command's processes, read from /proc/<pid>/smaps_rollup,
and keeps the peak: the memory the run takes from the machine. Torchrun's own agent is one of the processes. The
folder's cache is made before the first timing, so each run reads the decoded images from it, memory-mapped.
The table gives the decoded images' size (training and test, uint8) and the peak: in total, less the images, and
less torch's own memory too (what a process holds after importing torch and stepping an optimizer once, which
imports torch._dynamo; measured first, once a process, torchrun's agent included). torch's own depends on its build:
its CUDA build maps far more than its CPU one.
Linux only (it reads /proc).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORK = "--model mlp --iid --num-clients 10 --frac 1 --local-steps 5 --rounds 2"


def refuse(message):
    print(f"memory.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("synth", help="write an image folder of Tiny-ImageNet's shape")
    s.add_argument("dir", help="the folder to write (it must not exist)")
    s.add_argument("--classes", type=int, default=200)
    s.add_argument("--train-per-class", type=int, default=500)
    s.add_argument("--test-per-class", type=int, default=50)
    s.add_argument("--size", type=int, default=64)
    m = sub.add_parser("measure", help="peak PSS of runs of 1, 2, 4, 8 processes")
    m.add_argument("--data-dir", action="append", required=True, help="an image folder; give it again for more")
    m.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4, 8], help="K: processes of a run")
    m.add_argument("--interval", type=float, default=0.2, help="seconds between samples")
    m.add_argument("--out", required=True, help="JSON of every run (a new file)")
    args = p.parse_args()
    if args.command == "synth":
        if os.path.exists(args.dir):
            refuse(f"dir: {args.dir} exists; name a new folder")
        if min(args.classes, args.train_per_class, args.test_per_class, args.size) < 1:
            refuse("--classes, --train-per-class, --test-per-class and --size must be at least 1")
        return args
    for folder in args.data_dir:
        if not all(os.path.isdir(os.path.join(folder, split)) for split in ("train", "test")):
            refuse(f"--data-dir: {folder} is not an image folder with train/ and test/")
    if min(args.processes) < 1:
        refuse("--processes: each count must be at least 1")
    if args.interval <= 0:
        refuse("--interval: must be > 0")
    if os.path.exists(args.out):
        refuse(f"--out: {args.out} exists; name a new file")
    if not os.path.isdir("/proc/self"):
        refuse("measure reads /proc: it runs on Linux only")
    return args


def synth(args):
    """Random images in a folder of Tiny-ImageNet's layout and shape, written as uncompressed BMP."""
    from PIL import Image

    rng = np.random.default_rng(0)
    counts = {"train": args.train_per_class, "test": args.test_per_class}
    for split, count in counts.items():
        print(f"writing {split}/: {args.classes} classes of {count} images", flush=True)
        for c in range(args.classes):
            folder = os.path.join(args.dir, split, f"class{c:03d}")
            os.makedirs(folder)
            for i in range(count):
                pixels = rng.integers(0, 256, (args.size, args.size, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(os.path.join(folder, f"{i}.bmp"))


def descendants(pid):
    """pid and every process below it."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            # It ended meanwhile.
            continue
    return found


def pss_bytes(pid):
    """The process's proportional set size, or 0 if it ended."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


def peak_pss(cmd, interval):
    """Runs cmd; (its peak PSS summed over its processes, the most processes seen at once, seconds)."""
    began = time.time()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log, text=True)
        peak, most = 0, 0
        while proc.poll() is None:
            pids = descendants(proc.pid)
            peak = max(peak, sum(pss_bytes(p) for p in pids))
            most = max(most, len(pids))
            time.sleep(interval)
        if proc.returncode != 0:
            log.seek(0)
            sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{log.read()[-3000:]}")
    return peak, most, time.time() - began


def command(folder, k, out):
    flags = [*WORK.split(), "--dataset", "folder", "--data-dir", folder, "--device", "cpu", "--out", out]
    script = os.path.join(ROOT, "fedavg.py")
    if k == 1:
        return [sys.executable, script, *flags]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(k)]
    return [*torchrun, script, *flags]


def decoded_bytes(folder):
    """The bytes of the folder's decoded images (uint8, training and test), read from its cache."""
    import torch

    saved = torch.load(os.path.join(folder, ".cleanfl-cache.pt"), weights_only=True, mmap=True)
    x_train, _, x_test, *_ = saved["tensors"]
    return x_train.nbytes + x_test.nbytes


# torch imported and an optimizer used once (its zero_grad imports torch._dynamo): what any process of a run holds.
TORCH_ALONE = (
    "import time, torch; p = torch.zeros(2, requires_grad=True); o = torch.optim.SGD([p], lr=0.1); "
    "o.zero_grad(); p.sum().backward(); o.step(); time.sleep(1)"
)


def table(runs, torch_alone):
    """The peak of each run, less its images, and less torch's own (torch_alone bytes a process) too."""
    lines = [
        "| data | processes | decoded images (GB) | peak PSS (GB) | peak less the images (GB) | "
        "less torch's own too (GB) |"
    ]
    lines.append("|---|---|---|---|---|---|")
    for r in runs:
        images, peak = r["images_bytes"] / 1e9, r["peak_pss_bytes"] / 1e9
        # torchrun's agent, one process more, imports torch too.
        importing = r["processes"] + (r["processes"] > 1)
        own = peak - images - importing * torch_alone / 1e9
        cells = [r["data"], str(r["processes"]), f"{images:.2f}", f"{peak:.2f}", f"{peak - images:.2f}", f"{own:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def measure(args):
    import torch

    runs = []
    torch_alone = peak_pss([sys.executable, "-c", TORCH_ALONE], args.interval)[0]
    print(f"torch {torch.__version__} and an optimizer alone: {torch_alone / 1e9:.2f} GB", flush=True)
    saved = {"args": vars(args), "torch": torch.__version__, "torch_alone_bytes": torch_alone, "runs": runs}
    with tempfile.TemporaryDirectory() as tmp:
        for folder in args.data_dir:
            name = os.path.basename(os.path.abspath(folder))
            # The cache first: every timed run reads the decoded images from it.
            peak_pss(command(folder, 1, os.path.join(tmp, f"{name}-cache")), args.interval)
            images = decoded_bytes(folder)
            for k in args.processes:
                out = os.path.join(tmp, f"{name}-{k}")
                peak, seen, seconds = peak_pss(command(folder, k, out), args.interval)
                row = {"data": name, "processes": k, "processes_seen": seen, "images_bytes": images}
                row.update(peak_pss_bytes=peak, seconds=round(seconds, 1))
                runs.append(row)
                print(f"{name}, {k} process(es): peak PSS {peak / 1e9:.2f} GB over {seen} processes", flush=True)
                with open(args.out + ".part", "w") as f:
                    json.dump(saved, f, indent=1)
                os.replace(args.out + ".part", args.out)
    print(table(runs, torch_alone))


if __name__ == "__main__":
    args = parse_args()
    if args.command == "synth":
        synth(args)
    else:
        measure(args)

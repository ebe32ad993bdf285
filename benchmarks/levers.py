"""The speed call. Seconds per round of the five paper configurations under today's loop and
under each lever, alone and combined, against the FLOP floor; then FedFN's Table 1 pair in the time left.

    python benchmarks/levers.py measure --data-dir data/cifar10 --device cuda --budget 240   # gpu.sh stage levers
    python benchmarks/levers.py pair --data-dir data/cifar10 --device cuda --seconds 250    # gpu.sh stage pair
    python benchmarks/levers.py measure --dry          # the commands, none run (also: pair --dry)
    python benchmarks/levers.py measure --tiny --data-dir TOYFOLDER --device cpu   # CI: toy models, a few levers

measure. The configurations are the first command of each claim's own variant in `benchmarks/reproduce/<claim>.sh
paper` (as benchmarks/gpu_times.py times them). Each lever is timed on a slice of a round, in a process of its own:
  rounds     W warm-up rounds, then T timed rounds (W = T = 1; FedLN's short rounds 5 and 5), no evaluation
             (--eval-every 10**6), a checkpoint after round W and after W + T (--checkpoint-every W, --stop-after
             W + T): timed = the difference of the two checkpoints' elapsed_s, over T
  slices     fedfn, fedbabu: 4 of the round's 10 clients (--frac 0.04), fednnnn: 8 of its 100 (--frac 0.08),
             each client's whole local work; projected to the paper's round by the waves of clients it takes
             (ceil(m / K) with K processes); anfr: the 5 clients, 12 local steps each (--local-steps), projected
             by steps to the paper's 282 (the per-client copies counted 23 times: a slight overestimate), under
             torchrun 6 and 18 steps, fitted a + b steps (the broadcasts of client models are per client)
  evaluation the paper's evaluations are added: eval s (forward passes of the evaluation, the model's in-process
             throughput at the script's evaluation batch) x evaluations per round (1, FedLN 1/100)
  start-up   the next process starts while one is timed, waits at a gate with torch imported and the data
             folder's cache read (`gated`), then runs the script itself (runpy)
Levers: (a) K processes on one GPU, `torchrun --standalone --nproc_per_node K script.py ...` (K = 2, 4; anfr 2 and
5); (b) anfr.py --amp, --channels-last, --tf32 alone and combined (a flag the script lacks: a row saying so); --amp
elsewhere; (c) benchmarks/together.py for fedfn.py's and fedbabu.py's loops, in this process (timed at 4 and 12
local steps, fitted a + b steps, projected to the paper's); (d) CUDA graphs / torch.compile: not prepared.
Items run by priority (every configuration's today and main lever first) until --budget seconds are spent; what
is left gets a row "skipped (budget)". FLOPs: torch.utils.flop_counter over each model's forward and backward
(training) and forward (evaluation) on the meta device, times the sample passes of the paper's run; the floor is
those FLOPs at 40% of the H200's dense bf16 rate (989 TFLOP/s) for --amp rows, at half that (TF32) for the others.

pair. FedFN's Table 1 at s=2 (fedfn.py --shards 2 and --no-fn --lr 0.01, seed 0, as reproduce/fedfn.sh paper)
concurrently on the one GPU with the fastest lever of `measure` that keeps fp32 (today or torchrun K; --amp would
change the arithmetic of the paper's runs), --checkpoint-every 1: a first part sized for half the time at twice
the measured s/round, then --resume with --stop-after sized from the two runs' own s/round side by side, so both
stop with a checkpoint and their metrics before --seconds; past it they are stopped (the last round's checkpoint
stays).
"""

import argparse
import copy
import json
import math
import os
import re
import runpy
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

H200_BF16 = 989e12  # dense bf16 FLOP/s, datasheet
UTILIZATION = 0.4
RATES = {"bf16": UTILIZATION * H200_BF16, "tf32": UTILIZATION * H200_BF16 / 2}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
# claim: its own variant, the slice of a round that is timed, timed rounds (= warm-up rounds), a label
CONFIGS = {
    "fedfn": dict(variant="fedfn", slice=("clients", 4), timed=1, label="fedfn.py VGG11 N=100 r=0.1 E=15 s=2"),
    "fedbabu": dict(variant="fedbabu", slice=("clients", 4), timed=1, label="fedbabu.py 4convNet s=10"),
    "fedln": dict(variant="ln", slice=None, timed=5, label="fedln.py Table 7 CNN, 10 one-class clients"),
    "fednnnn": dict(variant="fednnnn", slice=("clients", 8), timed=1, label="fednnnn.py cnn6, all 100 clients E=5"),
    "anfr": dict(variant="anfr", slice=("steps", 12), timed=1, label="anfr.py ResNet-50 at 224, 5 clients"),
}
STEP_POINTS = (6, 18)  # anfr under torchrun: two slices, fitted a + b steps
TOGETHER_POINTS = (4, 12)  # local steps of the in-process timings, fitted a + b steps
ANFR_FLAGS = ["--amp", "--channels-last", "--tf32"]
# (priority, claim, lever, kind, processes, flags); "best": anfr's fastest single-process flags measured before it
PLAN = [
    (1, "fedfn", "today", "script", 1, []),
    (1, "fedfn", "torchrun 4", "script", 4, []),
    (1, "fedfn", "together", "together", 1, []),
    (1, "fedfn", "today (in-process)", "inprocess", 1, []),  # together's own yardstick: the same timing
    (1, "anfr", "today", "script", 1, []),
    (1, "anfr", "amp + channels-last + tf32", "script", 1, ANFR_FLAGS),
    (1, "fednnnn", "today", "script", 1, []),
    (1, "fednnnn", "torchrun 4", "script", 4, []),
    (1, "fedln", "today", "script", 1, []),
    (1, "fedln", "torchrun 4", "script", 4, []),
    (1, "fedbabu", "today", "script", 1, []),
    (1, "fedbabu", "torchrun 4", "script", 4, []),
    (2, "fedfn", "torchrun 2", "script", 2, []),
    (2, "fedfn", "amp", "script", 1, ["--amp"]),
    (2, "fedfn", "together + amp", "together", 1, ["--amp"]),
    (2, "anfr", "amp", "script", 1, ["--amp"]),
    (2, "anfr", "amp + channels-last", "script", 1, ["--amp", "--channels-last"]),
    (2, "fednnnn", "torchrun 2", "script", 2, []),
    (2, "fedln", "torchrun 2", "script", 2, []),
    (2, "fedbabu", "torchrun 2", "script", 2, []),
    (2, "fedbabu", "together", "together", 1, []),
    (2, "fedbabu", "today (in-process)", "inprocess", 1, []),
    (2, "anfr", "torchrun 2 + best", "script", 2, "best"),
    (3, "anfr", "channels-last", "script", 1, ["--channels-last"]),
    (3, "anfr", "tf32", "script", 1, ["--tf32"]),
    (3, "fedfn", "torchrun 4 + amp", "script", 4, ["--amp"]),
    (3, "fedbabu", "amp", "script", 1, ["--amp"]),
    (3, "fedln", "amp", "script", 1, ["--amp"]),
    (3, "fednnnn", "amp", "script", 1, ["--amp"]),
    (3, "anfr", "torchrun 5 + best", "script", 5, "best"),
]
# --tiny (CI on a CPU): the mechanisms once each (a process, torchrun, together, anfr's flags), toy models
TINY_PLAN = [
    (1, "fedfn", "today", "script", 1, []),
    (1, "fedfn", "torchrun 2", "script", 2, []),
    (1, "fedfn", "together", "together", 1, []),
    (1, "fedfn", "today (in-process)", "inprocess", 1, []),
    # not --amp: on the CPU, bfloat16 autocast with the paper's recipe at toy size gave NaN in some runs
    (1, "anfr", "channels-last + tf32", "script", 1, ["--channels-last", "--tf32"]),
]
TINY_STEPS, TINY_STEP_POINTS = 2, (1, 3)  # anfr's slices in --tiny
PAIR_VARIANTS = ["fedavg", "fedfn"]  # Table 1's columns at s=2, as reproduce/fedfn.sh paper names them
ALONE_FALLBACK = 6.63  # s/round of fedfn.py's paper round alone on the H200 (benchmarks/results-h200/times.md)
ITEM_CAP = 90  # seconds: one measurement at most


# ------------------------------------------------------------------------------------------------
# commands
# ------------------------------------------------------------------------------------------------
def paper_argv(claim, variant):
    """[script.py, flags...] of claim's paper command of this variant (fedfn: s = 2), --out dropped."""
    import gpu_times

    for argv in gpu_times.paper_commands(claim):
        parts = gpu_times.flag(argv, "--out").split("/")
        if parts[-2] == variant and (claim != "fedfn" or parts[-3] == "fedfn-s2-paper"):
            i = argv.index("--out")
            return argv[1:i] + argv[i + 2 :]
    raise ValueError(f"no {variant} command in benchmarks/reproduce/{claim}.sh paper")


def set_flag(argv, name, value=None):
    """argv with `name value` replaced or appended (value None: the store_true flag `name` once)."""
    argv = list(argv)
    if value is None:
        return argv if name in argv else argv + [name]
    if name in argv:
        argv[argv.index(name) + 1] = str(value)
        return argv
    return argv + [name, str(value)]


def drop_flag(argv, name, nargs=1):
    argv = list(argv)
    if name in argv:
        i = argv.index(name)
        del argv[i : i + 1 + nargs]
    return argv


def parse(script, flags, device="cpu", synthetic=True):
    """script's own parser on flags with --device (on the CPU with synthetic data unless `synthetic` is False, so
    that no data folder or GPU is needed): its args, or the SystemExit it raised."""
    import importlib

    module = importlib.import_module(os.path.splitext(script)[0])
    if device == "cpu" and synthetic:
        flags = drop_flag(set_flag(flags, "--dataset", "synthetic"), "--data-dir")
    out = os.path.join(tempfile.gettempdir(), "levers-parse")
    flags = set_flag(set_flag(set_flag(flags, "--device", device), "--threads", 1), "--out", out)
    saved, sys.argv = sys.argv, [script, *map(str, flags)]
    stderr, sys.stderr = sys.stderr, open(os.devnull, "w")
    try:
        return module.parse_args()
    except SystemExit as e:
        return e
    finally:
        sys.stderr.close()
        sys.argv, sys.stderr = saved, stderr


HELP = {}


def missing_flags(script, flags):
    """The --flags of `flags` that script's --help does not name (a lever the script does not have yet)."""
    if script not in HELP:
        import contextlib
        import importlib
        import io

        module, text = importlib.import_module(os.path.splitext(script)[0]), io.StringIO()
        saved, sys.argv = sys.argv, [script, "--help"]
        try:
            with contextlib.redirect_stdout(text):
                module.parse_args()
        except SystemExit:
            pass
        finally:
            sys.argv = saved
        HELP[script] = set(re.findall(r"--[a-z0-9][a-z0-9-]*", text.getvalue()))
    return [f for f in flags if str(f).startswith("--") and f not in HELP[script]]


def base_flags(claim, a):
    """claim's paper flags for this machine: --data-dir, --device, and with --tiny gpu_times.TINY's toy flags."""
    import gpu_times

    argv = paper_argv(claim, CONFIGS[claim]["variant"])
    script, flags = argv[0], argv[1:]
    flags = set_flag(set_flag(flags, "--data-dir", a.data_dir), "--device", a.device)
    if a.tiny:
        if "--local-steps" in gpu_times.TINY[claim]:
            flags = drop_flag(flags, "--local-epochs")
        flags += gpu_times.TINY[claim]
    return script, flags


def slice_flags(claim, flags, paper, a, steps=None):
    """The flags of the timed slice of a round (CONFIGS' slice), and what it is: (kind, slice size)."""
    kind, size = CONFIGS[claim]["slice"] or (None, None)
    if kind == "clients":
        return set_flag(flags, "--frac", size / paper.num_clients), (kind, size)
    if kind == "steps":
        size = steps or (TINY_STEPS if a.tiny else size)
        return set_flag(drop_flag(flags, "--local-epochs"), "--local-steps", size), (kind, size)
    return flags, (None, None)


def timed_flags(claim, flags, out):
    T = CONFIGS[claim]["timed"]
    run = ["--eval-every", 10**6, "--checkpoint-every", T, "--stop-after", 2 * T, "--out", out]
    for name, value in zip(run[::2], run[1::2]):
        flags = set_flag(flags, name, value)
    return flags


def launcher(procs):
    return [sys.executable] if procs == 1 else [*TORCHRUN, str(procs)]


def shown(procs, script, flags):  # the command as a reader would type it
    head = ["python"] if procs == 1 else ["torchrun", "--standalone", "--nproc_per_node", str(procs)]
    return shlex.join([*head, script, *map(str, flags)])


# ------------------------------------------------------------------------------------------------
# gated start: a process imports torch and reads the data folder's cache, then waits for its turn
# ------------------------------------------------------------------------------------------------
def gated(gate, script, flags):
    """Run script (runpy, as `python script flags`) once the file `gate` exists; meanwhile import torch and the
    script's modules and read --data-dir's decoded cache, so the timed process starts at its data."""
    os.chdir(ROOT)
    import common  # noqa: F401  (torch with it)

    if flags.count("--dataset") and flags[flags.index("--dataset") + 1] == "folder" and "--data-dir" in flags:
        folder, reader = flags[flags.index("--data-dir") + 1], common.DATASETS["folder"]
        cached = reader(argparse.Namespace(data_dir=folder, natural=False, clients_per_domain=None))

        def grouped(args):
            return getattr(args, "natural", 0) or getattr(args, "clients_per_domain", 0)

        def same(args):
            return args.data_dir == folder and not grouped(args)

        common.DATASETS["folder"] = lambda args: cached if same(args) else reader(args)
    parent = os.getppid()
    while not os.path.exists(gate):
        if os.getppid() != parent:  # whoever started it is gone: never its turn
            sys.exit(1)
        time.sleep(0.005)
    here = os.path.join(ROOT, "benchmarks")  # the script sees the repository's modules only, as when run itself
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.argv = [script, *flags]
    runpy.run_path(os.path.join(ROOT, script), run_name="__main__")


CHILDREN = []  # process groups started here, ended at a stop signal (gpu.sh's stage timeout sends SIGTERM)


def start(procs, script, flags, gate, log):
    cmd = [*launcher(procs), os.path.abspath(__file__), "gated", gate, script, *map(str, flags)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    CHILDREN.append(proc)
    return proc


def stop(*procs, grace=5.0):
    """End processes started here: SIGTERM to each one's process group (torchrun's agent then ends its ranks,
    which run in sessions of their own), SIGKILL to what is left after `grace` seconds."""
    live = [p for p in procs if p.poll() is None]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in live:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        end = time.time() + grace
        while any(p.poll() is None for p in live) and time.time() < end:
            time.sleep(0.05)
        live = [p for p in live if p.poll() is None]
    for p in procs:
        p.wait()


def _on_signal(signum, _):
    stop(*CHILDREN)
    sys.exit(128 + signum)


def checkpoint_times(proc, out, timeout):
    """Wait for proc; hard-link its first checkpoint.pt before the stop's replaces it. (round, elapsed_s) of both,
    or raise with the reason."""
    import torch

    first, deadline = os.path.join(out, "first.pt"), time.time() + timeout
    ckpt = os.path.join(out, "checkpoint.pt")
    while proc.poll() is None:
        if not os.path.exists(first) and os.path.exists(ckpt):
            try:
                os.link(ckpt, first)  # the inode of round W's checkpoint, whatever replaces the name later
            except FileNotFoundError:
                pass
            except OSError:  # no hard links on this file system: a copy (the round is checked below)
                shutil.copyfile(ckpt, first)
        if time.time() > deadline:
            stop(proc)
            raise TimeoutError(f"stopped after {timeout:.0f} s")
        time.sleep(0.005)
    if proc.returncode != 0:
        last = (
            open(out + ".log", errors="replace").read().strip().splitlines()[-1:]
            if os.path.exists(out + ".log")
            else []
        )
        raise RuntimeError(f"exit {proc.returncode}: {last[0][-200:] if last else ''}")

    def read(p):
        return torch.load(p, map_location="cpu", weights_only=False, mmap=True)

    a, b = read(first), read(ckpt)
    if a["round"] >= b["round"]:
        raise RuntimeError(f"the checkpoint of round {a['round']} was missed")
    return (a["round"], a["elapsed_s"]), (b["round"], b["elapsed_s"])


# ------------------------------------------------------------------------------------------------
# the paper's work: sample passes, evaluation passes, FLOPs (in this process, on the meta device)
# ------------------------------------------------------------------------------------------------
def client_steps(n, args):
    """(steps, sample passes) of a client of n samples in one round, by common.client_batches itself."""
    import torch

    import common

    epochs = getattr(args, "local_epochs", None)  # fedln.py has --local-steps only
    with torch.random.fork_rng(devices=[]):
        sizes = [len(b) for b in common.client_batches(torch.arange(n), args.batch_size, epochs, args.local_steps)]
    return len(sizes), sum(sizes)


def builder(script, args, data):
    import importlib

    import common

    module = importlib.import_module(script)
    if script in ("fedln", "anfr"):
        return lambda: module.build(args, data)
    return lambda: common.build_model(args.model, data)


def image_size(script, args, data):
    return (getattr(args, "image_size", None) or data.image_size) if script == "anfr" else data.image_size


def count_flops(build, script, args, data, batch=2):
    """(training FLOPs per sample: forward + backward, evaluation FLOPs per sample: forward), matmuls and
    convolutions as torch.utils.flop_counter counts them, on the meta device."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = build()
        x = torch.zeros(batch, data.in_channels, image_size(script, args, data), image_size(script, args, data))
    if script == "fedbabu" and not args.train_head:
        model.head.requires_grad_(False)  # as fedbabu.py's clients: no gradient for the frozen head
    model.train()
    with FlopCounterMode(display=False) as train:
        model(x).float().sum().backward()
    model.eval()
    with FlopCounterMode(display=False) as forward, torch.no_grad():
        model(x)
    return train.get_total_flops() / batch, forward.get_total_flops() / batch


def eval_passes(script, args, data, partition, build):
    """Forward passes of one evaluation: the test set, the validation samples, each client's test set (anfr.py with
    --bn-stats local and batch norms: every client's model on the test and validation sets)."""
    test = len(data.y_test)
    val = sum(len(v) for v in partition.val) if partition.val else 0
    clients = sum(len(t) for t in partition.test) if partition.test else 0
    if script == "anfr" and args.bn_stats == "local":
        import anfr
        import torch

        with torch.device("meta"):
            if anfr.personal_keys(build(), args.pfl, args.bn_stats):
                return len(partition.train) * (test + val)
    return test + val + clients


def paper_work(claim, a, data):
    """What the paper's run computes: args, partition, sample passes and steps a round, evaluation passes,
    FLOPs and the floors."""
    import numpy as np

    import common

    script, flags = base_flags(claim, a)
    args = parse(script, flags, a.device, synthetic=False)
    if isinstance(args, SystemExit):
        raise RuntimeError(f"{script} refused its paper flags (exit {args.code})")
    name = os.path.splitext(script)[0]
    partition = common.make_partition(args, data)
    sizes = [len(p) for p in partition.train]
    m = common.sample_clients(np.random.default_rng(0), args.num_clients, args.frac).__len__()
    per_client = [client_steps(n, args) for n in sizes]
    steps = float(np.mean([s for s, _ in per_client]))
    passes = m * float(np.mean([p for _, p in per_client]))  # expected over the uniform choice of m clients
    build = builder(name, args, data)
    train_fps, eval_fps = count_flops(build, name, args, data)
    evals = eval_passes(name, args, data, partition, build)
    round_flops = train_fps * passes + eval_fps * evals / args.eval_every
    return dict(script=script, name=name, args=args, partition=partition, clients=m, steps=steps, passes=passes,
                eval_passes=evals, train_fps=train_fps, eval_fps=eval_fps, round_flops=round_flops,
                rounds=args.rounds, floors={k: round_flops / r for k, r in RATES.items()})  # fmt: skip


# ------------------------------------------------------------------------------------------------
# in-process timings: evaluation throughput, together.py, the one-at-a-time loop
# ------------------------------------------------------------------------------------------------
def synchronize(device):
    import torch

    if "cuda" in str(device):
        torch.cuda.synchronize()


def precision(flags, args):
    """args for a lever's flags in this process: --amp; channels-last and tf32 (as the flags would set them)."""
    args = copy.copy(args)
    args.amp = "--amp" in flags
    args.channels_last, args.tf32 = "--channels-last" in flags, "--tf32" in flags
    return args


def eval_seconds(work, data, args, a):
    """Seconds of one evaluation: the model's forward throughput at the script's evaluation batch (2000, anfr.py at
    224: 200), in eval mode, times the evaluation's passes."""
    import torch

    import common

    size = image_size(work["name"], args, data)
    batch = 2000 if size <= 64 else 200
    batch = min(batch, 256) if a.tiny else batch
    if "model" not in work:  # one build per configuration (ResNet-50's init takes a second)
        work["model"] = builder(work["name"], args, data)().to(args.device).eval()
    model = copy.deepcopy(work["model"])
    x = torch.randn(batch, data.in_channels, size, size, device=args.device)
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    if args.channels_last:
        model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    if args.tf32:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        with torch.no_grad(), common.autocast(args.device, args.amp):
            reps = 1 if a.tiny else 5
            for _ in range(2):
                model(x)
            synchronize(args.device)
            t = time.perf_counter()
            for _ in range(reps):
                model(x)
            synchronize(args.device)
        return (time.perf_counter() - t) / reps * work["eval_passes"] / batch
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def time_inprocess(way, work, data, args, a):
    """(projected training s/round, what was fitted): `way` together or one-at-a-time, one round of the paper's
    clients at TOGETHER_POINTS local steps each after a warm-up round, fitted a + b steps."""
    import numpy as np
    import torch

    import common
    import together

    script = work["name"]
    args = copy.copy(args)
    args.local_epochs = None
    torch.manual_seed(args.seed)
    model = builder(script, args, data)().to(args.device)
    clients = common.sample_clients(np.random.default_rng(args.seed), args.num_clients, args.frac)
    weights = common.client_weights([len(work["partition"].train[k]) for k in clients], args.weighting)
    times = {}
    for steps in (1, *TOGETHER_POINTS):
        args.local_steps = steps
        times[steps] = together.time_round(way, script, model, clients, weights, work["partition"], data, args)
    (s1, t1), (s2, t2) = [(s, times[s]) for s in TOGETHER_POINTS]
    b = (t2 - t1) / (s2 - s1)
    return t1 + b * (work["steps"] - s1), f"{t1:.3f} s at {s1} steps, {t2:.3f} s at {s2}"


# ------------------------------------------------------------------------------------------------
# measure
# ------------------------------------------------------------------------------------------------
def plan_items(a):
    plan = TINY_PLAN if a.tiny else PLAN
    items = [dict(zip(("priority", "claim", "lever", "kind", "procs", "flags"), p)) for p in plan]
    items = [it for it in items if it["claim"] in a.claims]
    return sorted(items, key=lambda it: it["priority"])  # stable: PLAN's order within a priority


def run_name(n, item):  # the run folder of the n-th measured lever: 03-fedfn-torchrun-4
    return f"{n:02d}-{item['claim']}-{re.sub(r'[^a-z0-9]+', '-', item['lever']).strip('-')}"


def lever_flags(item, results):
    if item["flags"] != "best":
        return item["flags"]
    single = [r for r in results if r["claim"] == item["claim"] and r["procs"] == 1 and r.get("s_round")]
    single = [r for r in single if r["kind"] == "script"]
    return min(single, key=lambda r: r["s_round"])["flags"] if single else []


def item_runs(item, flags, paper, a, out):
    """[(slice steps or None, script, flags, out)] of a script item: one slice, or anfr's two under torchrun."""
    claim = item["claim"]
    script, base = base_flags(claim, a)
    points = [None]
    if CONFIGS[claim]["slice"] and CONFIGS[claim]["slice"][0] == "steps" and item["procs"] > 1:
        points = list(TINY_STEP_POINTS if a.tiny else STEP_POINTS)
    runs = []
    for p in points:
        sliced, what = slice_flags(claim, base + list(flags), paper, a, p)
        d = out if p is None else f"{out}-{p}"
        runs.append((what, script, timed_flags(claim, sliced, d), d))
    return runs


def project(item, work, slices):
    """Training s/round of the paper's round from the slices' s/round ({(kind, size): s})."""
    K = item["procs"]
    (kind, size), t = next(iter(slices.items()))
    if kind == "clients":
        return t * math.ceil(work["clients"] / K) / math.ceil(size / K)
    if kind == "steps" and len(slices) == 2:
        (s1, t1), (s2, t2) = [(k[1], v) for k, v in slices.items()]
        b = (t2 - t1) / (s2 - s1)
        return t1 + b * (work["steps"] - s1)
    if kind == "steps":
        return t * work["steps"] / size
    return t


def measure(a):
    if a.report:
        return report(a)
    import common

    signal.signal(signal.SIGTERM, _on_signal)
    items = plan_items(a)
    papers = {}
    for claim in a.claims:  # the paper flags as each script's parser reads them (on the CPU, synthetic data)
        script, flags = base_flags(claim, a)
        papers[claim] = parse(script, flags)
    if a.dry:
        print(f"# benchmarks/levers.py measure: {len(items)} levers by priority, until --budget {a.budget:.0f} s")
        n = 0
        for item in items:
            flags = item["flags"]
            if flags == "best":  # the prediction: every one of ANFR_FLAGS that anfr.py has
                flags = [f for f in ANFR_FLAGS if not missing_flags("anfr.py", [f])]
            missing = missing_flags(f"{item['claim']}.py", flags)
            if item["kind"] != "script":
                print(f"# {item['claim']} {item['lever']}: in this process (benchmarks/together.py)")
            elif missing:
                print(f"# {item['claim']} {item['lever']}: not run, {item['claim']}.py has no {' '.join(missing)}")
            else:
                n += 1
                out = os.path.join(a.out, run_name(n, item))
                for _, script, f, _ in item_runs(item, flags, papers[item["claim"]], a, out):
                    print(shown(item["procs"], script, f))
        return 0
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()

    def say(*m):
        return print(*m, file=sys.stderr, flush=True)

    works, results, evals = {}, [], {}
    queue = items
    started, serial = {}, [0]  # index -> [(proc, gate, (slice, script, flags, out))]: started ahead, at its gate

    def prestart(i):  # queue[i]'s processes: imports and the data cache while the one before is timed
        it = queue[i]
        if i in started or it["kind"] != "script":
            return
        flags = lever_flags(it, results)
        it["resolved"], script = list(flags), f"{it['claim']}.py"
        missing = missing_flags(script, flags)
        if missing:
            it["why_not"], started[i] = f"{script} has no {' '.join(missing)}", []
            return
        refused = parse(script, base_flags(it["claim"], a)[1] + list(flags), a.device, synthetic=False)
        if isinstance(refused, SystemExit):  # e.g. a flag for CUDA alone, on the CPU
            it["why_not"], started[i] = f"{script} refuses {' '.join(map(str, flags))} on {a.device}", []
            return
        serial[0] += 1
        out = os.path.join(a.out, run_name(serial[0], it))
        started[i] = []
        for j, run in enumerate(item_runs(it, flags, papers[it["claim"]], a, out)):
            gate = os.path.join(a.out, f".gate-{serial[0]}-{j}")
            log = open(run[3] + ".log", "w")  # beside the run folder, which the script alone makes
            log.write(f"{shown(it['procs'], run[1], run[2])}\n")
            log.flush()
            started[i].append((start(it["procs"], run[1], run[2], gate, log), gate, run))

    def next_script(i):
        return next((j for j in range(i + 1, len(queue)) if queue[j]["kind"] == "script"), None)

    first = next_script(-1)
    if first is not None:
        prestart(first)  # its start-up while this process reads the data and counts the FLOPs
    script0, flags0 = base_flags(a.claims[0], a)
    data = common.load_data(parse(script0, flags0, a.device, synthetic=False))
    for claim in a.claims:
        try:
            works[claim] = paper_work(claim, a, data)
        except Exception as e:  # said here; its levers get a row saying so
            say(f"{claim}: the paper's work not counted, not timed: {type(e).__name__}: {e}")
    for i, it in enumerate(queue):
        claim, work = it["claim"], works.get(it["claim"])
        row = dict(claim=claim, lever=it["lever"], kind=it["kind"], procs=it["procs"], priority=it["priority"])
        row["flags"] = list(it["flags"]) if it["flags"] != "best" else []
        if work is None:
            for proc, _, _ in started.pop(i, []):
                stop(proc)
            results.append({**row, "status": "failed: the paper's work could not be counted (see the log)"})
            continue
        left = a.budget - (time.time() - t0)
        if left < 15:
            results.append({**row, "status": "skipped (budget)"})
            continue
        try:
            if it["kind"] == "script":
                prestart(i)
                row["flags"] = it["resolved"]
                if not started[i]:
                    results.append({**row, "status": f"not run: {it['why_not']}"})
                    continue
                slices, said = {}, []
                for j, (proc, gate, (what, script, flags, out)) in enumerate(started.pop(i)):
                    open(gate, "w").close()  # its turn
                    if j == 0 and next_script(i) is not None:
                        prestart(next_script(i))
                    (r1, e1), (r2, e2) = checkpoint_times(proc, out, min(ITEM_CAP, a.budget - (time.time() - t0)))
                    slices[what] = (e2 - e1) / (r2 - r1)
                    said.append(f"{slices[what]:.3f} s a round of {what[1] or 'all'} {what[0] or 'clients'}")
                    for name in ("first.pt", "checkpoint.pt"):  # large; their timings are read
                        os.remove(os.path.join(out, name))
                row.update(command=shown(it["procs"], script, flags), fit="; ".join(said))
                train = project(it, work, slices)
            else:
                way = "together" if it["kind"] == "together" else "one-at-a-time"
                train, row["fit"] = time_inprocess(way, work, data, precision(row["flags"], work["args"]), a)
            key = (claim, tuple(f for f in row["flags"] if f in ANFR_FLAGS))
            if key not in evals:
                evals[key] = eval_seconds(work, data, precision(row["flags"], work["args"]), a)
            ev = evals[key] / work["args"].eval_every
            row.update(train_s=train, eval_s=ev, s_round=train + ev, status="ok")
        except Exception as e:  # the row says what failed; the next lever still runs
            row["status"] = f"failed: {type(e).__name__}: {str(e)[:160]}"
        say(
            f"[{time.time() - t0:6.1f} s] {claim} {it['lever']}: "
            + (f"{row['s_round']:.3f} s/round" if row.get("s_round") else row["status"])
        )
        results.append(row)
        save(a, works, results, t0)  # after every lever: a stage stopped at its cap keeps what it measured
    for runs in started.values():
        for proc, _, _ in runs:
            stop(proc)
    save(a, works, results, t0)
    table(works, results, a)
    bad = [r for r in results if r["status"].startswith("failed")]
    return 1 if bad or len(works) < len(a.claims) else 0


def save(a, works, results, t0):
    public = {c: {k: v for k, v in w.items() if k not in ("args", "partition", "model")} for c, w in works.items()}
    with open(os.path.join(a.out, "levers.json.tmp"), "w") as f:
        json.dump({"results": results, "works": public, "seconds": time.time() - t0}, f, indent=1)
    os.replace(os.path.join(a.out, "levers.json.tmp"), os.path.join(a.out, "levers.json"))


def report(a):
    """measure's table again from its levers.json (e.g. after the stage was stopped at its cap)."""
    try:
        with open(os.path.join(a.out, "levers.json")) as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        print(f"no levers table: {os.path.join(a.out, 'levers.json')} unreadable ({type(e).__name__})")
        return 1
    done = {(r["claim"], r["lever"]) for r in saved["results"]}
    left = [it for it in plan_items(a) if (it["claim"], it["lever"]) not in done and it["claim"] in saved["works"]]
    rows = saved["results"] + [{**it, "flags": [], "status": "not reached (stage stopped)"} for it in left]
    table(saved["works"], rows, a)
    return 0


def table(works, results, a):
    print(f"device {a.device}, data {a.data_dir}{', TINY toy flags' if a.tiny else ''}; s/round = training "
          f"(timed slices, projected) + evaluation per round; floor: the FLOPs at {UTILIZATION:.0%} of "
          f"{H200_BF16 / 1e12:.0f} TFLOP/s (bf16, --amp rows) or half that (TF32, the others)\n")  # fmt: skip
    print("| configuration | lever | s / round | projected min | speed-up over today | measured / floor |")
    print("| --- | --- | --- | --- | --- | --- |")

    def label(claim):
        return CONFIGS[claim]["label"] + (" [--tiny: toy model]" if a.tiny else "")

    for claim in [c for c in CONFIGS if c in works or any(r["claim"] == c for r in results)]:
        work = works.get(claim)
        rows = [r for r in results if r["claim"] == claim]
        today = next((r["s_round"] for r in rows if r["lever"] == "today" and r.get("s_round")), None)
        for r in rows:
            if not r.get("s_round") or work is None:
                print(f"| {label(claim)} | {r['lever']} | {r['status']} | - | - | - |")
                continue
            floor = work["floors"]["bf16" if "--amp" in r["flags"] else "tf32"]
            speedup = f"{today / r['s_round']:.2f}x" if today else "-"
            minutes = work["rounds"] * r["s_round"] / 60
            print(f"| {label(claim)} | {r['lever']} | {r['s_round']:.3f} | {minutes:.1f} | {speedup} | "
                  f"{r['s_round'] / floor:.0f}x |")  # fmt: skip
    print("\n| configuration | rounds | GFLOP / sample (train, eval) | sample passes / round | eval passes / eval "
          "| total PFLOP | floor min (bf16 / TF32) |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for claim, w in works.items():
        total = w["round_flops"] * w["rounds"]
        print(
            f"| {label(claim)} | {w['rounds']} | {w['train_fps'] / 1e9:.3f}, {w['eval_fps'] / 1e9:.3f} | "
            f"{w['passes']:,.0f} | {w['eval_passes']:,} | {total / 1e15:.2f} | "
            f"{w['floors']['bf16'] * w['rounds'] / 60:.2f} / {w['floors']['tf32'] * w['rounds'] / 60:.2f} |"
        )
    sys.stdout.flush()


# ------------------------------------------------------------------------------------------------
# pair
# ------------------------------------------------------------------------------------------------
def pair_choice(path):
    """(processes, s/round alone, why) of fedfn.py's fastest fp32 lever in measure's levers.json."""
    try:
        with open(path) as f:
            rows = json.load(f)["results"]
    except (OSError, ValueError, KeyError):
        rows = []
    rows = [r for r in rows if r["claim"] == "fedfn" and r["kind"] == "script" and r.get("s_round")]
    rows = [r for r in rows if "--amp" not in r["flags"]]
    if not rows:
        return 1, ALONE_FALLBACK, f"no fp32 fedfn.py lever measured: one process, {ALONE_FALLBACK} s/round assumed"
    best = min(rows, key=lambda r: r["s_round"])
    return best["procs"], best["s_round"], f"{best['lever']} ({best['s_round']:.2f} s/round alone, measured)"


def pair_flags(variant, a, out):
    flags = paper_argv("fedfn", variant)
    script, flags = flags[0], flags[1:]
    flags = set_flag(set_flag(flags, "--data-dir", a.data_dir), "--device", a.device)
    if a.tiny:
        flags += ["--model", "convnet4-tiny", "--local-steps", "2"]
        flags = drop_flag(flags, "--local-epochs")
    return script, set_flag(set_flag(flags, "--checkpoint-every", 1), "--out", out)


def rows_of(out):
    try:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip().endswith("}")]
    except OSError:
        return []


def pair(a):
    if a.report:
        return pair_report(a)
    signal.signal(signal.SIGTERM, _on_signal)
    procs, alone, why = pair_choice(a.levers)
    if a.tiny:  # CI: one process a run (the CPU has 2 cores; measure runs torchrun already)
        procs, why = 1, f"one process (--tiny); {why}"
    startup = 8 if a.tiny else 25  # seconds before a first round: imports, data, models (torchrun: a few ranks)
    n1 = max(2, int((a.seconds / 2 - startup) / (2 * alone)))  # half the time, at twice the alone s/round
    if a.tiny:
        n1 = 2
    outs = {v: os.path.join(a.out, v) for v in PAIR_VARIANTS}
    first = {v: pair_flags(v, a, outs[v]) for v in PAIR_VARIANTS}
    if a.dry:
        print(f"# benchmarks/levers.py pair: {why}; first part --stop-after {n1}, then --resume sized at run time")
        for v in PAIR_VARIANTS:
            print(shown(procs, first[v][0], set_flag(set_flag(first[v][1], "--stop-after", n1), "--overwrite")))
        n2 = max(1, int((a.seconds - startup * 2 - alone * n1 * 2) / (2 * alone)))
        for v in PAIR_VARIANTS:
            print(shown(procs, "fedfn.py", ["--resume", outs[v], "--stop-after", n2]))
        return 0
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()

    def say(*m):
        return print(*m, file=sys.stderr, flush=True)

    say(f"pair: {why}; {procs} process(es) per run; first part {n1} rounds")

    def both(make, limit):
        """Run both variants at once (make(v) -> (script, flags)); stop them past `limit` seconds."""
        running = {}
        for v in PAIR_VARIANTS:
            script, flags = make(v)
            log = open(os.path.join(a.out, f"{v}.log"), "a")
            log.write(f"=== {shown(procs, script, flags)}\n")
            log.flush()
            gate = os.path.join(a.out, f".gate-{v}")
            open(gate, "w").close()
            running[v] = start(procs, script, flags, gate, log)
        end = time.time() + limit
        while any(p.poll() is None for p in running.values()) and time.time() < end:
            time.sleep(0.2)
        stop(*running.values())
        return {v: p.returncode for v, p in running.items()}

    def budget():
        return a.seconds - (time.time() - t0)

    def part1(v):
        return (first[v][0], set_flag(set_flag(first[v][1], "--stop-after", n1), "--overwrite"))

    codes1 = both(part1, budget() - 5)

    def stopped():
        return all(os.path.exists(os.path.join(outs[v], "checkpoint.pt")) for v in PAIR_VARIANTS)

    if not stopped() and procs > 1 and budget() > 2 * startup:  # torchrun failed: once more, one process a run
        procs, why = 1, f"one process ({procs} under torchrun failed: exit {codes1}); {why}"
        say(f"pair: {why}")
        codes1 = both(part1, budget() - 5)
    rates = []
    for v in PAIR_VARIANTS:
        rows = [r for r in rows_of(outs[v]) if "test_acc" in r]
        if len(rows) >= 2:  # round 1 carries the start-up
            rates.append((rows[-1]["elapsed_s"] - rows[0]["elapsed_s"]) / (rows[-1]["round"] - rows[0]["round"]))
    side = max(rates) if rates else 2 * alone
    n2 = min(2, int((budget() - startup - 10) / side)) if a.tiny else int((budget() - startup - 10) / side)
    say(f"pair: first part exit {codes1}, {side:.2f} s/round side by side; second part {n2} rounds")
    if n2 >= 1 and stopped():
        both(lambda v: ("fedfn.py", ["--resume", outs[v], "--stop-after", n2]), budget() - 5)
    with open(os.path.join(a.out, "pair.json"), "w") as f:
        json.dump({"why": why, "processes": procs, "side_by_side_s_round": side, "first": n1, "second": n2}, f)
    return pair_report(a)


def pair_report(a):
    """The pair's table from its run folders (and pair.json)."""
    try:
        with open(os.path.join(a.out, "pair.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        meta = {"why": "pair.json missing (stage stopped?)", "processes": "?", "side_by_side_s_round": float("nan")}
    outs = {v: os.path.join(a.out, v) for v in PAIR_VARIANTS}
    print(f"\nFedFN Table 1, s=2, seed 0, both at once on {a.device}: {meta['why']}; {meta['processes']} "
          f"process(es) each; {meta['side_by_side_s_round']:.2f} s/round side by side\n")  # fmt: skip
    print("| variant | rounds done of 320 | test acc at the last evaluation | train loss | state |")
    print("| --- | --- | --- | --- | --- |")
    for v in PAIR_VARIANTS:
        rows = [r for r in rows_of(outs[v]) if "test_acc" in r]
        last = rows[-1] if rows else {}
        state = "finished" if os.path.exists(os.path.join(outs[v], "summary.json")) else "partial (checkpoint.pt)"
        acc = f"{last['test_acc']:.4f}" if last else "-"
        loss = f"{last['train_loss']:.4f}" if last else "-"
        name = "FedFN" if v == "fedfn" else "FedAvg"
        print(f"| {name} (`{v}`) | {last.get('round', 0)} | {acc} | {loss} | {state} |")
    return 0 if all(rows_of(outs[v]) for v in PAIR_VARIANTS) else 1


# ------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("measure", "pair"):
        s = sub.add_parser(name)
        s.add_argument("--data-dir", default="data/cifar10", help="CIFAR-10 image folder (--dataset folder)")
        s.add_argument("--device", default="cuda")
        s.add_argument("--out", default="runs/levers", help="run folders (a .log beside each), levers.json")
        s.add_argument("--tiny", action="store_true", help="toy models, a few levers: CI on a CPU")
        s.add_argument("--dry", action="store_true", help="print the commands, run nothing")
        s.add_argument("--report", action="store_true", help="only the table again, from what --out holds")
        if name == "measure":
            s.add_argument("--budget", type=float, default=240, help="seconds for all measurements")
            s.add_argument("--claims", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
        else:
            s.add_argument("--seconds", type=float, default=250, help="seconds for the pair, start-ups included")
            s.add_argument("--levers", default="runs/levers/levers.json", help="measure's levers.json")
    g = sub.add_parser("gated", help="(internal) run a script once a gate file exists")
    g.add_argument("gate")
    g.add_argument("script")
    g.add_argument("flags", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    if a.command == "gated":
        return a
    for flag in ("budget", "seconds"):  # bad input: one line, before any work
        if not getattr(a, flag, 1) > 0:
            p.error(f"--{flag}: must be > 0, got {getattr(a, flag)}")
    work = not (a.dry or a.report)
    if work and not all(os.path.isdir(os.path.join(a.data_dir, split)) for split in ("train", "test")):
        p.error(f"--data-dir: {a.data_dir} is not an image folder with train/ and test/")
    if work and os.path.exists(os.path.join(a.out, f"{a.command}.json" if a.command == "pair" else "levers.json")):
        p.error(f"--out: {a.out} holds a {a.command} already (its table: --report); choose another --out")
    return a


def main(argv=None):
    a = parse_args(argv)
    if a.command == "gated":
        return gated(a.gate, a.script, a.flags)
    a.out = os.path.abspath(a.out)
    if a.command == "measure":
        return measure(a)
    return pair(a)


if __name__ == "__main__":
    sys.exit(main())

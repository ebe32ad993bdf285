"""Seconds per round of each claim's paper configuration, and the minutes a full run would take.

Run by benchmarks/gpu.sh (stage `times`). One markdown table, one row per script and configuration,
printed as each run ends, one run at a time:
  the claims  the first command of `DRY_RUN=1 SEEDS=0 bash benchmarks/reproduce/<claim>.sh paper` of
              the claim's own variant (fedfn: s=2; --variants all: every command), with its flags except
                --rounds K+T --eval-every K    K = min(the paper's --eval-every, T)
                --checkpoint-every 10**9       (no checkpoint), and --device, --data-dir, --out
              s/round = (elapsed_s of the last metrics row - elapsed_s of the row at round K) / T, so the
              first K rounds are the warm-up (allocator, cudnn autotuning). With the paper's evaluation
              every round (K = 1) each timed round carries its evaluation, as in the full run; FedLN
              evaluates every 100 rounds and is timed with K = T = 20 (one evaluation per 20 rounds:
              a slight overestimate). after loop = summary.json's wall_time_s - the last row's
              elapsed_s (FedBABU's per-client fine-tuning; about 0 for the others).
              projected minutes = (R * s/round + after loop) / 60, R the paper's --rounds; the set-up
              before the loop (imports, data from the cache, models: 10-20 s) is not counted.
  FedAvg      last: benchmarks/round_time.py (the speed target setting: N=100, f=0.1, E=5, B=50), one row
              per model and precision (fedavg.py; vgg11, which fedfn.py registers: fedfn.py --no-fn);
              projected for fedavg.py's default 200 rounds, evaluated each round

    python benchmarks/gpu_times.py --data-dir data/cifar10 --device cuda
    python benchmarks/gpu_times.py --data-dir D --device cuda --claims anfr --variants all --timed-rounds 2
    python benchmarks/gpu_times.py --tiny --data-dir TOYFOLDER --device cpu   # CI: toy models (flags below)
    python benchmarks/gpu_times.py --dry                                      # print the commands only
A failed run gets a row saying so, the next one still runs, and the exit status is 1.
"""

import argparse
import importlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLAIMS = ["fedfn", "fedbabu", "fedln", "fednnnn", "anfr"]
OWN_VARIANT = {"fedfn": "fedfn", "fedbabu": "fedbabu", "fedln": "ln", "fednnnn": "fednnnn", "anfr": "anfr"}
TIMED = {"fedln": 20}  # timed rounds per claim where a round is very short (default: --timed-rounds)
FEDAVG_ROUNDS = 200  # fedavg.py's default --rounds (evaluated every round)
# --tiny (CI, CPU): appended to the paper flags (argparse: the last value wins; --local-steps replaces the paper's
# --local-epochs, which the scripts refuse beside it), so the real code paths
# run on toy models with a few local steps.
TINY = {
    "fedfn": ["--model", "convnet4-tiny", "--local-steps", "2"],
    "fedbabu": ["--model", "convnet4-tiny", "--local-steps", "2", "--ft-epochs", "1", "--ft-eval-epochs", "0", "1"],
    "fedln": ["--width", "8", "--local-steps", "2"],
    "fednnnn": ["--model", "cnn6-narrow", "--local-steps", "1", "--frac", "0.05"],  # 5 of the 100 clients
    "anfr": ["--depth", "18", "--width", "8", "--image-size", "16", "--local-steps", "2"],
}
TINY_ROUND_TIME = [
    "--models",
    "cnn",
    "--precisions",
    "fp32",
    "--dataset",
    "synthetic",
    "--num-clients",
    "30",
    "--frac",
    "0.1",
    "--local-epochs",
    "1",
    "--rounds",
    "4",
]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--claims", nargs="+", default=CLAIMS, choices=CLAIMS, help="claim scripts of benchmarks/reproduce to time"
    )
    p.add_argument(
        "--variants",
        default="own",
        choices=["own", "all"],
        help="own: the method's own variant per claim; all: every paper variant",
    )
    p.add_argument("--data-dir", default="data/cifar10", help="unpacked CIFAR-10 image folder (--dataset folder)")
    p.add_argument("--device", default="cuda", help="cpu or cuda")
    p.add_argument(
        "--timed-rounds",
        type=int,
        default=None,
        help="T: timed rounds after the warm-up (default 1; FedLN 20; --tiny 1)",
    )
    p.add_argument(
        "--fedavg",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run benchmarks/round_time.py (fedavg.py)",
    )
    p.add_argument("--fedavg-models", nargs="+", default=["vgg11", "resnet18", "cnn"], help="round_time.py --models")
    p.add_argument(
        "--fedavg-precisions", nargs="+", default=["fp32"], choices=["fp32", "amp"], help="round_time.py --precisions"
    )
    p.add_argument("--out", default=None, help="keep the run folders here (default: a temporary folder)")
    p.add_argument("--tiny", action="store_true", help="toy models and few steps (the flags of TINY), for CI on a CPU")
    p.add_argument("--dry", action="store_true", help="print the commands, run nothing")
    args = p.parse_args()
    if args.timed_rounds is not None and args.timed_rounds < 1:
        p.error(f"--timed-rounds: must be at least 1, got {args.timed_rounds}")
    return args


def paper_commands(claim):
    """argv lists of `DRY_RUN=1 SEEDS=0 bash benchmarks/reproduce/<claim>.sh paper` ("$DATA_DIR" literal)."""
    env = {**os.environ, "DRY_RUN": "1", "SEEDS": "0", "VARIANTS": ""}
    res = subprocess.run(
        ["bash", os.path.join(ROOT, "benchmarks", "reproduce", f"{claim}.sh"), "paper"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return [shlex.split(line) for line in res.stdout.splitlines() if line.startswith("python ")]


def flag(argv, name):
    return argv[argv.index(name) + 1] if name in argv else None


def set_flag(argv, name, value):
    """argv with `name value` replaced (or appended)."""
    argv = list(argv)
    if name in argv:
        argv[argv.index(name) + 1] = str(value)
    else:
        argv += [name, str(value)]
    return argv


def paper_setting(argv):
    """(rounds, eval_every) of a paper command, by the method script's own parser (on synthetic data, so
    that no data folder or GPU is needed to read them)."""
    script = argv[1]
    flags = [a for a in argv[2:]]
    flags = set_flag(flags, "--dataset", "synthetic")
    if "--data-dir" in flags:
        i = flags.index("--data-dir")
        del flags[i : i + 2]
    flags = set_flag(
        set_flag(flags, "--device", "cpu"), "--out", os.path.join(tempfile.gettempdir(), "gpu_times-parse")
    )
    sys.path.insert(0, ROOT)
    module = importlib.import_module(os.path.splitext(script)[0])
    saved = sys.argv
    sys.argv = [script, *flags]
    try:
        args = module.parse_args()
    finally:
        sys.argv = saved
    return args.rounds, args.eval_every


def timing_command(argv, args, out):
    """The paper command as run here, and (K, T, R): warm-up/evaluation period, timed rounds, paper rounds."""
    claim = os.path.splitext(argv[1])[0]
    rounds, every = paper_setting(argv)
    T = args.timed_rounds or (1 if args.tiny else TIMED.get(claim, 1))
    K = max(1, min(every, T))
    cmd = [sys.executable, *argv[1:]]
    cmd = set_flag(cmd, "--data-dir", args.data_dir)
    cmd = set_flag(cmd, "--device", args.device)
    for name, value in [("--rounds", K + T), ("--eval-every", K), ("--checkpoint-every", 10**9), ("--out", out)]:
        cmd = set_flag(cmd, name, value)
    if args.tiny:
        if "--local-steps" in TINY[claim] and "--local-epochs" in cmd:  # the two are one exclusive choice
            i = cmd.index("--local-epochs")
            del cmd[i : i + 2]
        cmd = cmd[: cmd.index("--out")] + TINY[claim] + cmd[cmd.index("--out") :]
    return cmd, (K, T, rounds)


def configuration(argv):
    """The paper flags of a command, without data, seed and output flags."""
    out, skip = [], {"--dataset", "--data-dir", "--seed", "--out"}
    i = 2
    while i < len(argv):
        if argv[i] in skip:
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return " ".join(out)


def measure(cmd, out, K, T):
    """(s/round, after-loop s, process wall s) from the run folder, or raise with the tail of stderr."""
    t = time.perf_counter()
    res = subprocess.run([str(a) for a in cmd], cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t
    with open(out + ".log", "w") as f:  # beside the run folder, which the script alone creates
        f.write(shlex.join(str(a) for a in cmd) + "\n" + res.stdout + res.stderr)
    if res.returncode != 0:
        raise RuntimeError(
            f"exit {res.returncode}: {res.stderr.strip().splitlines()[-1] if res.stderr.strip() else ''}"
        )
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = [r for r in rows if "test_acc" in r]  # evaluation rows (fednnnn.py also logs norm rows)
    first = next(r for r in rows if r["round"] == K)
    last = rows[-1]
    assert last["round"] == K + T, last
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    per_round = (last["elapsed_s"] - first["elapsed_s"]) / T
    return per_round, summary["wall_time_s"] - last["elapsed_s"], wall


def round_time_rows(args):
    """FedAvg rows from benchmarks/round_time.py (its own table, converted)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from round_time import script_for  # which script runs FedAvg with a model (fedavg.py, or fedfn.py --no-fn)

    flags = (
        TINY_ROUND_TIME
        if args.tiny
        else [
            "--models",
            *args.fedavg_models,
            "--precisions",
            *args.fedavg_precisions,
            "--dataset",
            "folder",
            "--data-dir",
            args.data_dir,
            "--rounds",
            "2",
        ]
    )
    cmd = [sys.executable, os.path.join("benchmarks", "round_time.py"), *flags, "--device", args.device]
    if args.dry:
        print(shlex.join(cmd))
        return True
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    print(f"<!-- {shlex.join(cmd)} -->", file=sys.stderr)
    for line in res.stdout.splitlines():
        print(f"    round_time.py: {line}", file=sys.stderr)
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[1] in ("fp32", "amp"):
            model, precision, per_round, per_eval = cells[0], cells[1], float(cells[2]), float(cells[3])
            setting = "N=100 f=0.1 E=5 B=50" if not args.tiny else "toy (round_time.py on synthetic data)"
            minutes = FEDAVG_ROUNDS * (per_round + per_eval) / 60
            script, extra = script_for(model)  # FedAvg: fedavg.py, or fedfn.py --no-fn for fedfn.py's vgg11
            flags = " ".join(["--model", model, *map(str, extra[:1])])
            print(
                f"| {script}.py | `{flags}`{' `--amp`' if precision == 'amp' else ''} (FedAvg, {setting}; "
                f"round_time.py) | {per_round:.3f} | {per_eval:.3f} | 0 | {FEDAVG_ROUNDS} | {minutes:.1f} |",
                flush=True,
            )
    if res.returncode != 0:
        print(
            f"| fedavg.py | round_time.py failed (exit {res.returncode}): "
            f"{(res.stderr.strip().splitlines() or [''])[-1][:200].replace('|', '/')} | - | - | - | - | - |",
            flush=True,
        )
        print(res.stderr[-3000:], file=sys.stderr)
        return False
    return True


def main():
    args = parse_args()
    ok = True
    if not args.dry:
        print(
            f"device {args.device}, data {args.data_dir}{', TINY toy flags' if args.tiny else ''}; "
            f"s/round after a warm-up, projected = (R x s/round + after loop) / 60\n"
        )
        print("| script | configuration | s / round | s / evaluation | after loop (s) | R | projected min |")
        print("| --- | --- | --- | --- | --- | --- | --- |", flush=True)
    tmp = None
    if args.out is None and not args.dry:
        tmp = tempfile.TemporaryDirectory()
    root = args.out or (tmp.name if tmp else "OUT")
    for claim in args.claims:
        timed = 0
        for argv in paper_commands(claim):
            parts = flag(argv, "--out").split("/")
            claim_scale, variant = parts[-3], parts[-2]
            if args.variants == "own" and (variant != OWN_VARIANT[claim] or timed):
                continue  # own: the first command of the method's variant (fedfn: s=2; s=10 costs the same)
            timed += 1
            out = os.path.join(root, f"{claim_scale}-{variant}")
            cmd, (K, T, R) = timing_command(argv, args, out)
            if args.dry:
                print(shlex.join(str(a) for a in cmd))
                continue
            name = f"{argv[1]}"
            config = f"`{claim_scale}/{variant}`: `{configuration(argv)}`{' + TINY toy flags' if args.tiny else ''}"
            os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
            try:
                per_round, after, wall = measure(cmd, out, K, T)
            except Exception as e:  # report, go on with the next configuration
                ok = False
                print(f"| {name} | {config} | failed: {str(e)[:200].replace('|', '/')} | - | - | {R} | - |", flush=True)
                continue
            minutes = (R * per_round + after) / 60
            evals = "in s / round" if K == 1 else f"1 per {K} rounds, in s / round"
            print(f"| {name} | {config} | {per_round:.3f} | {evals} | {after:.1f} | {R} | {minutes:.1f} |", flush=True)
            print(
                f"    {claim_scale}/{variant}: {K} warm-up + {T} timed rounds, process wall {wall:.1f} s",
                file=sys.stderr,
            )
    if args.fedavg:  # last: the claims' paper configurations matter more if a time limit cuts this short
        ok = round_time_rows(args) and ok
    if tmp:
        tmp.cleanup()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

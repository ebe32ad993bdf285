"""benchmarks/gpu.sh, the one script a lent GPU machine runs: MODE=dry prints commands that each script's own
parser accepts; MODE=tiny runs every stage end to end on the CPU at toy size (the first call's stages, smoke,
times and fedbabu, about 1.5 min on one thread; the speed call's, threads and levers, and pair, about 40 s) and
leaves the files the GPU call brings back; a failing stage is reported and the next one still runs. Also
benchmarks/levers.py's arithmetic: FLOPs and floors of the five paper configurations against the expected ones, the
projection of a timed slice to the paper's round, the pair's choice of lever."""

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile

import pytest
import torch

import common
from test_docs import parse, places  # noqa: F401  (places: a pytest fixture, used by name)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import levers  # noqa: E402

SCRIPT = os.path.join(ROOT, "benchmarks", "gpu.sh")
METHODS = ["fedavg", "fedbabu", "fedfn", "fedln", "fednnnn", "anfr"]
FILES = {"log.txt", "env.txt", "smoke.md", "times.md", "fedbabu.md", "summary.md", "runs.tar.gz"}
FIRST_CALL = ["env", "data", "smoke", "times", "fedbabu"]  # the stages of the first call, by name


SETTINGS = {
    "MODE",
    "DEVICE",
    "DATA_DIR",
    "DATA_ARCHIVE",
    "WORK",
    "OUT",
    "SEEDS",
    "JOBS",
    "FEDBABU_RUNS",
    "SMOKE_JOBS",
    "SMOKE_BATCH",
    "TIMES_FLAGS",
    "LEVERS_FLAGS",
    "DEADLINE",
    "PYTHON",
    "CAP_ENV",
    "CAP_DATA",
    "CAP_SMOKE",
    "CAP_TIMES",
    "CAP_FEDBABU",
    "CAP_LEVERS",
    "CAP_PAIR",
    "STAGE_CAP",
}


def gpu_sh(tmp_path, *stages, timeout=600, **env):
    """bash benchmarks/gpu.sh STAGES with the script's defaults except `env` (none of this shell's settings)."""
    base = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    env = {**base, "OMP_NUM_THREADS": "1", "WORK": str(tmp_path / "work"), "OUT": str(tmp_path / "out"), **env}
    return subprocess.run(["bash", SCRIPT, *stages], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def dry_commands(stdout):
    """(line, argv) of every `python <something>.py ...` line of MODE=dry's output; a `torchrun --standalone
    --nproc_per_node K script.py ...` line as `python script.py ...` (with K in the line)."""
    out = []
    for line in stdout.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        argv = shlex.split(line)
        while argv and re.fullmatch(r"\w+=.*", argv[0]):  # VAR=value command
            argv = argv[1:]
        if argv[:3] == ["torchrun", "--standalone", "--nproc_per_node"]:
            argv = ["python", *argv[4:]]
        if argv and os.path.basename(argv[0]).startswith("python") and len(argv) > 1 and argv[1].endswith(".py"):
            out.append((line, argv))
    return out


@pytest.mark.slow  # every command of gpu.sh through its parser
def test_dry_run_prints_commands_each_parser_accepts(tmp_path, places, monkeypatch, capsys):  # noqa: F811
    res = gpu_sh(tmp_path, *FIRST_CALL, "threads", "levers", "pair", MODE="dry", timeout=120)
    assert res.returncode == 0, res.stderr
    assert not (tmp_path / "work").exists() and not (tmp_path / "out").exists()  # nothing ran, nothing written
    commands = dry_commands(res.stdout)
    assert len(commands) >= 6 * 4 + 5 + 1 + 6  # smoke, times (claims, round_time.py), Table 13
    monkeypatch.chdir(ROOT)
    for line, argv in commands:
        assert os.path.isfile(os.path.join(ROOT, argv[1])), line
        try:
            parse(argv[1], argv[2:], places, monkeypatch)
        except SystemExit as e:
            pytest.fail(f"`{line}` rejected (exit {e.code}): {capsys.readouterr().err.strip()}")
    by_script = {m: [a for _, a in commands if a[1] == f"{m}.py"] for m in METHODS}

    def smoke(a):
        return "/smoke/" in (a + ["--out", ""])[(a + ["--out"]).index("--out") + 1] or "/smoke/" in str(a)

    for m, runs in by_script.items():  # smoke: fp32, --amp, --stop-after 1 then --resume, on cuda
        runs = [a for a in runs if smoke(a)]
        assert any("--amp" in a and a[a.index("--device") + 1] == "cuda" for a in runs), m
        stopped = [a[a.index("--out") + 1] for a in runs if "--stop-after" in a]
        assert stopped and [stopped[0]] == [a[a.index("--resume") + 1] for a in runs if "--resume" in a], m
        assert len({a[a.index("--out") + 1] for a in runs if "--out" in a}) == len([a for a in runs if "--out" in a])
    assert any(a[1] == "benchmarks/round_time.py" for _, a in commands)
    for m in ["fedfn", "fedbabu", "fedln", "fednnnn", "anfr"]:  # times: each claim's paper configuration
        assert any(
            "--dataset" in a and a[a.index("--dataset") + 1] == "folder" and "--checkpoint-every" in a
            for a in by_script[m]
        ), m
    table13 = [
        a
        for a in by_script["fedbabu"]
        if "--model" in a
        and a[a.index("--model") + 1] == "convnet4"
        and "--rounds" in a
        and a[a.index("--rounds") + 1] == "32"
        and "/levers/" not in " ".join(a)
    ]
    assert sorted((("--train-head" in a), a[a.index("--seed") + 1]) for a in table13) == [
        (False, "0"),
        (False, "1"),
        (False, "2"),
        (True, "0"),
        (True, "1"),
        (True, "2"),
    ]
    assert "JOBS=6" in res.stdout and "bash benchmarks/reproduce/fedbabu.sh paper" in res.stdout
    # levers: every configuration today and under torchrun 4 (the issue's K = 2 and 4), the slices' timing flags
    lines = res.stdout.splitlines()
    for m in ["fedfn", "fedbabu", "fedln", "fednnnn", "anfr"]:
        timed = [a for a in by_script[m] if "/levers/" in " ".join(a) and "--stop-after" in a]
        assert timed and all("--eval-every" in a and a[a.index("--eval-every") + 1] == "1000000" for a in timed), m
    for k in (2, 4):
        assert any(line.startswith(f"torchrun --standalone --nproc_per_node {k} fedfn.py") for line in lines), k
    assert any("fedfn together: in this process" in line for line in lines)
    anfr_flags = [line for line in lines if "anfr" in line and ("--channels-last" in line or "has no" in line)]
    assert anfr_flags, "anfr.py's --channels-last / --tf32: a command or a line saying the flag is missing"
    # pair: FedFN and FedAvg of Table 1 at s=2, seed 0, checkpointed every round, then resumed
    pair = [a for a in by_script["fedfn"] if "/pair/" in " ".join(a)]
    firsts = [a for a in pair if "--shards" in a]
    assert sorted(("--no-fn" in a, a[a.index("--lr") + 1]) for a in firsts) == [(False, "0.03"), (True, "0.01")]
    for a in firsts:
        assert a[a.index("--shards") + 1] == "2" and a[a.index("--seed") + 1] == "0" and "--stop-after" in a
        assert a[a.index("--checkpoint-every") + 1] == "1" and a[a.index("--rounds") + 1] == "320"
    assert sorted(a[a.index("--resume") + 1] for a in pair if "--resume" in a) == sorted(
        a[a.index("--out") + 1] for a in firsts
    )
    # threads: idle then loaded, each the default and --threads 2, 4, 8 of fedavg-mlp and fedfn-small on the CPU
    tables = [a for _, a in commands if a[1] == "benchmarks/threads.py"]
    assert [a[a.index("--conditions") + 1] for a in tables] == ["idle", "loaded"]
    for m in ["fedavg", "fedfn"]:
        runs = [a for _, a in commands if a[1].endswith(f"/{m}.py") and "TMP/" in " ".join(a)]  # threads.py --dry
        assert all(a[a.index("--device") + 1] == "cpu" for a in runs), m
        got = [a[a.index("--threads") + 1] if "--threads" in a else "default" for a in runs]
        assert got == ["default", "2", "4", "8"] * 2, (m, got)


@pytest.mark.slow  # every stage of gpu.sh, each script several times
def test_tiny_mode_runs_every_stage_end_to_end(tmp_path):
    res = gpu_sh(tmp_path, *FIRST_CALL, MODE="tiny", DEVICE="cpu", timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    out = tmp_path / "out"
    assert set(os.listdir(out)) == FILES and len(FILES) <= 8  # what the GPU call brings back
    summary = (out / "summary.md").read_text()
    for stage in ["env", "data", "smoke", "times", "fedbabu"]:
        assert re.search(rf"^\| {stage} \| ok \| \d+ \|$", summary, re.M), summary
    smoke = (out / "smoke.md").read_text()
    for m in METHODS:
        row = next(line for line in smoke.splitlines() if line.startswith(f"| {m}.py |"))
        assert row.count("| ok ") == 4 and "(same)" in row, row  # on the CPU the resumed run is the same run
    times = (out / "times.md").read_text()
    for m in METHODS:
        rows = [line for line in times.splitlines() if line.startswith(f"| {m}.py |")]
        assert rows, f"no row for {m}.py in times.md:\n{times}"
        cells = [c.strip() for c in rows[0].strip("|").split("|")]
        assert float(cells[2]) > 0 and float(cells[-1]) > 0, rows[0]  # s / round, projected minutes
    fedbabu = (out / "fedbabu.md").read_text()
    assert re.search(r"^\| fedavg \| \d", fedbabu, re.M) and re.search(r"^\| fedbabu \| \d", fedbabu, re.M), fedbabu
    with tarfile.open(out / "runs.tar.gz") as tar:
        names = tar.getnames()
    for variant in ["fedavg", "fedbabu"]:
        assert f"fedbabu/fedbabu-paper/{variant}/seed0/summary.json" in names
        assert f"fedbabu/fedbabu-paper/{variant}/seed0/checkpoint.pt" in names  # so that a later call can resume
    assert "smoke/fedavg-resumed/summary.json" in names and not any(
        n.startswith("smoke/") and n.endswith(".pt") for n in names
    )
    assert "##### stage times: ok" in (out / "log.txt").read_text()


def test_the_default_call_is_env_data_threads_levers(tmp_path):
    res = gpu_sh(tmp_path, MODE="dry", timeout=120)
    assert res.returncode == 0, res.stderr
    assert re.findall(r"^# ---- stage (\w+)$", res.stdout, re.M) == ["env", "data", "threads", "levers"]


def test_a_failing_stage_is_reported_and_the_next_still_runs(tmp_path):
    res = gpu_sh(
        tmp_path,
        "data",
        "env",
        MODE="full",
        DEVICE="cpu",
        DATA_DIR=str(tmp_path / "none"),
        DATA_ARCHIVE=str(tmp_path / "none.tar.gz"),
        timeout=120,
    )
    assert res.returncode == 1
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert re.search(r"^\| data \| \*\*FAILED\*\* \(exit 1\) \| \d+ \|$", summary, re.M), summary
    assert re.search(r"^\| env \| ok \| \d+ \|$", summary, re.M), summary
    assert "no DATA_ARCHIVE" in res.stdout
    again = gpu_sh(tmp_path, "env", MODE="full", DEVICE="cpu", timeout=120)  # the same WORK: refused
    assert again.returncode == 2 and "already holds runs" in again.stderr
    bad = gpu_sh(tmp_path, "nope", MODE="full", timeout=60)
    assert bad.returncode == 2 and "unknown stage" in bad.stderr


@pytest.mark.slow  # torchrun and six script processes (about 30 s)
def test_tiny_levers_and_pair_end_to_end(tmp_path):
    """The speed call's stages (threads, levers; pair by name) at toy size: the idle threads table, the levers
    table with today, torchrun 2 and together timed, the FLOP table of all five configurations, the pair run side
    by side, stopped and resumed."""
    res = gpu_sh(tmp_path, "env", "data", "threads", "levers", "pair", MODE="tiny", DEVICE="cpu", timeout=300)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    out = tmp_path / "out"
    assert set(os.listdir(out)) == {"log.txt", "env.txt", "fedbabu.md", "speed.md", "summary.md", "runs.tar.gz"}
    summary = (out / "summary.md").read_text()
    for stage in ["env", "data", "threads", "levers", "pair"]:
        assert re.search(rf"^\| {stage} \| ok \| \d+ \|$", summary, re.M), summary
    speed = (out / "speed.md").read_text()
    for lever in ["today", "torchrun 2", "together", "today (in-process)"]:
        row = next(line for line in speed.splitlines() if line.startswith("| fedfn.py") and f"| {lever} |" in line)
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[2]) > 0 and float(cells[3]) > 0 and cells[5].endswith("x"), row
    assert re.search(r"^\| anfr\.py .*\| channels-last \+ tf32 \| (\d|not run: anfr\.py has no)", speed, re.M)
    flops = [line for line in speed.splitlines() if re.match(r"^\| \w+\.py .* \| \d+ \| [\d.]+, [\d.]+ \|", line)]
    assert len(flops) == 5, speed
    for variant in ["fedavg", "fedfn"]:
        row = next(line for line in speed.splitlines() if f"(`{variant}`)" in line)
        assert re.search(r"\| 4 \| 0\.\d+ \| [\d.]+ \| partial", row), row  # 2 rounds, then 2 more resumed
    with tarfile.open(out / "runs.tar.gz") as tar:
        names = tar.getnames()
        runs = json.load(tar.extractfile("threads/threads-idle.json"))["runs"]
    idle = {r["way"]: r["s_per_round"] for r in runs}
    [threads] = {r["threads"] for r in runs if r["way"] == "default"}  # what the default run took (config.json)
    [procs] = {r["processes"] for r in runs if r["way"] == "default"}  # and its processes (summary.json)
    env_txt = (out / "env.txt").read_text()
    # The default is one process.
    assert procs == 1
    assert f"the scripts' CPU default: 1 process x {threads} threads\n" in env_txt
    assert ("Thread(s) per core:" in env_txt) == bool(shutil.which("lscpu"))
    assert "levers/levers.json" in names and "pair/pair.json" in names and "threads/threads-idle.json" in names
    assert "threads/tables.md" in names
    assert set(idle) == {"default", "1 thread"}  # the default against --threads 1, on the CPU, no torchrun
    picked = f"[{procs}] x [{threads}] threads" if procs > 1 else f"[{threads}] threads"
    row = f"| fedfn-small | idle | {idle['default']:.2f} | {idle['1 thread']:.2f} | {picked} | "
    assert row + f"{idle['default'] / idle['1 thread']:.2f} | - |" in summary.splitlines(), summary
    assert "pair/fedfn/metrics.jsonl" in names and "pair/fedavg/config.json" in names
    assert not any(n.endswith(".pt") for n in names)  # checkpoints stay behind (37 MB each for VGG11)


# ---------------------------------------------------------------------------------------------
# benchmarks/levers.py's arithmetic, in this process
# ---------------------------------------------------------------------------------------------
def cifar_shaped():
    """A stand-in for CIFAR-10 as the scripts see it: 50,000 + 10,000 images of 3x32x32, 10 balanced classes (no
    pixels: the FLOP count runs on the meta device, the partitions read labels only)."""

    def images(n):
        return torch.zeros(1, 3, 32, 32, dtype=torch.uint8).expand(n, 3, 32, 32)

    def labels(n):
        return torch.arange(n) % 10

    half = torch.full((1, 3, 1, 1), 0.5)
    return common.Data(images(50000), labels(50000), images(10000), labels(10000), 10, half, half)


def test_flops_and_floors_match_the_issue():
    """FLOPs (torch.utils.flop_counter) times the paper runs' sample passes, at 40% of 989 TFLOP/s: the expected
    floors (58 s / 116 s, under 1 s, 7 s / 14 s, 38 s / 75 s, 5 min / 10 min), and its 46 GFLOP a VGG11 step."""
    a = argparse.Namespace(tiny=False, data_dir="data/cifar10", device="cpu")
    data = cifar_shaped()
    works = {claim: levers.paper_work(claim, a, data) for claim in levers.CONFIGS}
    fedfn = works["fedfn"]
    assert fedfn["clients"] == 10 and fedfn["steps"] == 150 and fedfn["passes"] == 75000
    assert fedfn["train_fps"] * 50 / 1e9 == pytest.approx(46, rel=0.01)  # a VGG11 SGD step at B=50
    assert works["anfr"]["steps"] == 282 and works["anfr"]["train_fps"] / 1e9 == pytest.approx(24.3, rel=0.01)
    floors = {claim: {k: v * w["rounds"] for k, v in w["floors"].items()} for claim, w in works.items()}
    issue = {"fedfn": 58, "fedln": 7, "fednnnn": 38, "anfr": 300}  # seconds at bf16; TF32: twice
    for claim, seconds in issue.items():
        assert floors[claim]["bf16"] == pytest.approx(seconds, rel=0.08), (claim, floors[claim])
        assert floors[claim]["tf32"] == pytest.approx(2 * floors[claim]["bf16"])
    assert floors["fedbabu"]["bf16"] < 1
    assert works["anfr"]["eval_passes"] == 15000  # test set and the 10% held out (NF-ResNet: no batch norm)


def test_a_slice_is_projected_by_waves_and_steps():
    work = {"clients": 10, "steps": 150}

    def item(k):
        return {"procs": k}

    assert levers.project(item(1), work, {("clients", 4): 1.0}) == pytest.approx(2.5)  # 10 clients from 4
    assert levers.project(item(4), work, {("clients", 4): 1.0}) == pytest.approx(3.0)  # 3 waves of 4 from 1
    assert levers.project(item(2), work, {("clients", 4): 1.0}) == pytest.approx(2.5)  # 5 waves from 2
    assert levers.project(item(1), work, {("steps", 12): 1.2}) == pytest.approx(15.0)  # 150 steps from 12
    # two slices: a + b steps, so the per-client part is counted once (0.5 s + 0.1 s a step here)
    assert levers.project(item(2), work, {("steps", 6): 1.1, ("steps", 18): 2.3}) == pytest.approx(15.5)
    assert levers.project(item(1), work, {(None, None): 0.3}) == 0.3


def test_the_pair_takes_the_fastest_fp32_lever(tmp_path):
    rows = [
        {"claim": "fedfn", "kind": "script", "lever": "today", "procs": 1, "flags": [], "s_round": 6.0},
        {"claim": "fedfn", "kind": "script", "lever": "torchrun 4", "procs": 4, "flags": [], "s_round": 2.0},
        {"claim": "fedfn", "kind": "script", "lever": "amp", "procs": 1, "flags": ["--amp"], "s_round": 1.0},
        {"claim": "fedfn", "kind": "together", "lever": "together", "procs": 1, "flags": [], "s_round": 0.5},
        {"claim": "fedfn", "kind": "script", "lever": "torchrun 2", "procs": 2, "flags": [], "status": "failed"},
        {"claim": "fedln", "kind": "script", "lever": "torchrun 4", "procs": 4, "flags": [], "s_round": 0.1},
    ]
    path = tmp_path / "levers.json"
    path.write_text(json.dumps({"results": rows}))
    procs, alone, why = levers.pair_choice(str(path))
    assert (procs, alone) == (4, 2.0) and "torchrun 4" in why
    assert levers.pair_choice(str(tmp_path / "none.json"))[:2] == (1, levers.ALONE_FALLBACK)


def test_a_lever_the_script_lacks_is_named():
    assert levers.missing_flags("anfr.py", ["--amp", "--no-such-lever"]) == ["--no-such-lever"]
    assert levers.missing_flags("fedfn.py", ["--amp"]) == []


def test_levers_refuses_bad_input_before_any_work(tmp_path, capsys):
    """levers.py: a budget that is not positive, a --data-dir that is no image folder and an --out that already holds
    a measurement are refused (exit 2, the flag named), nothing written."""
    from helpers import stand_in_folder

    data = stand_in_folder(tmp_path / "data")
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "levers.json").write_text("{}")
    for argv, flag in [
        (["measure", "--budget", "0", "--data-dir", data], "--budget"),
        (["pair", "--seconds", "-1", "--data-dir", data], "--seconds"),
        (["measure", "--data-dir", str(tmp_path / "none")], "--data-dir"),
        (["measure", "--data-dir", data, "--out", str(tmp_path / "done")], "--out"),
    ]:
        with pytest.raises(SystemExit) as e:
            levers.parse_args([*argv, *([] if "--out" in argv else ["--out", str(tmp_path / "new")])])
        assert e.value.code == 2 and flag in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "new").exists() and os.listdir(tmp_path / "done") == ["levers.json"]

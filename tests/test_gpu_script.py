"""benchmarks/gpu.sh (issue 24), the one script a lent GPU machine runs: MODE=dry prints commands that each
script's own parser accepts; MODE=tiny runs every stage end to end on the CPU at toy size (about 1.5 min
on one thread) and leaves the files the GPU call brings back; a failing stage is reported and the next
one still runs."""

import os
import re
import shlex
import subprocess
import tarfile

import pytest

from test_docs import parse, places  # noqa: F401  (places: a pytest fixture, used by name)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu.sh")
METHODS = ["fedavg", "fedbabu", "fedfn", "fedln", "fednnnn", "anfr"]
FILES = {"log.txt", "env.txt", "smoke.md", "times.md", "fedbabu.md", "summary.md", "runs.tar.gz"}


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
    "DEADLINE",
    "PYTHON",
    "CAP_ENV",
    "CAP_DATA",
    "CAP_SMOKE",
    "CAP_TIMES",
    "CAP_FEDBABU",
}


def gpu_sh(tmp_path, *stages, timeout=600, **env):
    """bash benchmarks/gpu.sh STAGES with the script's defaults except `env` (none of this shell's settings)."""
    base = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    env = {**base, "OMP_NUM_THREADS": "1", "WORK": str(tmp_path / "work"), "OUT": str(tmp_path / "out"), **env}
    return subprocess.run(["bash", SCRIPT, *stages], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def dry_commands(stdout):
    """(line, argv) of every `python <something>.py ...` line of MODE=dry's output."""
    out = []
    for line in stdout.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        argv = shlex.split(line)
        while argv and re.fullmatch(r"\w+=.*", argv[0]):  # VAR=value command
            argv = argv[1:]
        if argv and os.path.basename(argv[0]).startswith("python") and len(argv) > 1 and argv[1].endswith(".py"):
            out.append((line, argv))
    return out


@pytest.mark.slow  # every command of gpu.sh through its parser
def test_dry_run_prints_commands_each_parser_accepts(tmp_path, places, monkeypatch, capsys):  # noqa: F811
    res = gpu_sh(tmp_path, MODE="dry", timeout=120)
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
    for m, runs in by_script.items():  # smoke: fp32, --amp, --stop-after 1 then --resume, on cuda
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


@pytest.mark.slow  # every stage of gpu.sh, each script several times
def test_tiny_mode_runs_every_stage_end_to_end(tmp_path):
    res = gpu_sh(tmp_path, MODE="tiny", DEVICE="cpu", timeout=600)
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

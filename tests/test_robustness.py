"""Bad input is refused before any work (exit 2, the flag named on the last line), and run folders are
never lost: --out on a run, --resume of a finished, extended, foreign or diverged run, atomic files
without NaN, the image-folder cache keyed on the folder's contents, Ctrl-C twice."""

import argparse
import ast
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import common
from helpers import ROOT, TINY, assert_same_model, metrics, prepare, run_script, start_script, summary

SCRIPTS = ["fedavg", "fedbabu", "fedfn", "fedln", "fednnnn", "anfr"]
# the smallest valid command of each script (what the bad value is added to)
BASE = {
    "fedavg": [],
    "fedbabu": [],
    "fedfn": [],
    "fedln": [],
    "fednnnn": [],
    "anfr": ["--depth", "18", "--width", "8"],
}


class _Captured(Exception):
    def __init__(self, parser):
        self.parser = parser


def script_parser(name, monkeypatch):
    """The argparse parser that <name>.parse_args builds (captured at its parse_args call)."""
    module = importlib.import_module(name)

    def capture(self, *a, **k):
        raise _Captured(self)

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", capture)
        m.setattr(sys, "argv", [f"{name}.py"])
        with pytest.raises(_Captured) as info:
            module.parse_args()
    return info.value.parser


def numeric_flags(parser):
    """(flag, nargs, int?) of every option whose type turns "1" into a number: found from the parser itself."""
    found = []
    for action in parser._actions:
        if not action.option_strings or action.type is None:
            continue
        try:
            one = action.type("1")
        except (argparse.ArgumentTypeError, ValueError, TypeError):
            continue
        if isinstance(one, (int, float)):
            found.append((action.option_strings[0], action.nargs, isinstance(one, int)))
    return found


def parse(name, argv, monkeypatch, capsys):
    """Run <name>.parse_args on argv; returns (exit code or None, last stderr line)."""
    module = importlib.import_module(name)
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *map(str, argv)])
    code = None
    try:
        module.parse_args()
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


def values_of(flag, nargs, value):
    return [flag, *([value] * (2 if nargs == 2 else 1))]


UNIVERSAL_INT = ["-1", "1.5", "nan", "x"]
UNIVERSAL_FLOAT = ["-1", "-0.5", "nan", "inf", "-inf", "1e999", "x"]
# values that are invalid for some flags only (zero where the flag must be positive, 1 and above for fractions)
EXTRA = {
    "--num-clients": ["0"],
    "--frac": ["0", "1.5"],
    "--rounds": ["0"],
    "--local-epochs": ["0"],
    "--local-steps": ["0"],
    "--batch-size": ["0"],
    "--lr": ["0"],
    "--momentum": ["1", "1.5"],
    "--lr-decay-at": ["0", "1", "1.5"],
    "--lr-decay": ["0", "1.5"],
    "--eval-every": ["0"],
    "--checkpoint-every": ["0"],
    "--stop-after": ["0"],
    "--shards": ["0"],
    "--classes-per-client": ["0"],
    "--clients-per-domain": ["0"],
    "--focal-gamma": [],
    "--alpha": ["0"],
    "--seed": ["4294967296"],
    "--data-seed": ["4294967296"],
    "--ft-lr": ["0"],
    "--fedexp-eps": ["0"],
    "--fn-scale": ["0"],
    "--width": ["0"],
    "--server-lr": ["0"],
    "--yogi-beta1": ["1", "1.5"],
    "--yogi-beta2": ["1"],
    "--yogi-tau": ["0"],
    "--beta": ["0"],
    "--gamma": ["1"],
    "--image-size": ["0", "7"],
    "--server-betas": ["1"],
    "--server-tau": ["0"],
    "--dp-noise-multiplier": ["0"],
    "--dp-max-grad-norm": ["0"],
    "--prox-mu": [],
    "--depth": ["0", "19"],
    "--val-frac": ["1", "1.5"],
    "--crop-scale": ["0", "1.5"],
    "--agc": [],
    "--warmup-steps": [],
    "--threads": ["0"],
}
# edge values that must still be accepted
VALID = {
    "fedavg": [
        ["--momentum", "0"],
        ["--weight-decay", "0"],
        ["--prox-mu", "0"],
        ["--seed", "0"],
        ["--seed", "4294967295"],
        ["--frac", "1"],
        ["--lr-decay", "1"],
        ["--lr-decay-at", "0.5", "0.75"],
        ["--lr", "1e-6"],
        ["--val-frac", "0"],
        ["--val-frac", "0.5"],
    ],
    "fedbabu": [["--ft-epochs", "0"], ["--ft-eval-epochs", "0", "1"]],
    "fedfn": [["--fn-scale", "sqrt-d"], ["--fn-scale", "2.5"], ["--fr-mu", "0"]],
    "fedln": [["--yogi-beta1", "0"], ["--yogi-v0", "0"], ["--agg", "fedprox", "--prox-mu", "0.1"]],
    "fednnnn": [["--gamma", "0"], ["--norm-eps", "0"]],
    "anfr": [
        ["--clip", "0"],
        ["--last-gain-init", "1", "--arch", "nf"],
        ["--image-size", "8"],
        ["--agg", "fedprox", "--prox-mu", "0.1"],
        ["--crop-scale", "1", "1"],
        ["--agc", "0.01", "--clip", "0"],
        ["--warmup-steps", "0"],
        ["--bn-stats", "local", "--arch", "bn"],
    ],
}


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_numeric_flag_refuses_its_invalid_values(name, tmp_path, monkeypatch, capsys):
    """Generated from the script's own parser: each numeric flag with negative, non-finite, non-numeric and
    (from EXTRA) out-of-range values exits 2 with the flag on the last line, no traceback, nothing written."""
    flags = numeric_flags(script_parser(name, monkeypatch))
    assert len(flags) >= 18, flags  # every script has at least the shared numeric flags
    assert set(EXTRA) >= {f for f, _, _ in flags} - {
        "--ft-epochs",
        "--ft-eval-epochs",
        "--weight-decay",
        "--fr-mu",
        "--yogi-v0",
        "--norm-eps",
        "--overfit-client",
        "--last-gain-init",
        "--clip",
    }, "a new numeric flag: add its invalid values to EXTRA"
    base = [
        "--dataset",
        "synthetic",
        "--device",
        "cpu",
        "--data-dir",
        tmp_path / "dl",
        "--out",
        tmp_path / "run",
        *BASE[name],
    ]
    tried = 0
    for flag, nargs, is_int in flags:
        for value in (UNIVERSAL_INT if is_int else UNIVERSAL_FLOAT) + EXTRA.get(flag, []):
            code, last = parse(name, [*base, *values_of(flag, nargs, value)], monkeypatch, capsys)
            assert code == 2, f"{name}.py {flag} {value}: exit {code}"
            assert flag in last, f"{name}.py {flag} {value}: {last}"
            tried += 1
    assert os.listdir(tmp_path) == []
    assert tried > 100


@pytest.mark.parametrize("name", SCRIPTS)
def test_valid_edge_values_are_accepted(name, tmp_path, monkeypatch, capsys):
    for extra in VALID[name]:
        out = tmp_path / "_".join(extra).replace("-", "")
        code, last = parse(
            name, ["--dataset", "synthetic", "--device", "cpu", "--out", out, *BASE[name], *extra], monkeypatch, capsys
        )
        assert code is None, f"{name}.py {' '.join(extra)}: {last}"
        assert not out.exists()  # the probe of --out leaves nothing behind


# The regression table: each of these was a traceback, a hang, or silently accepted.
REFUSED = [
    ("fedavg", ["--lr", "-0.1"], "--lr"),
    ("fedavg", ["--weight-decay", "-1"], "--weight-decay"),
    ("fedavg", ["--momentum", "-0.1"], "--momentum"),
    ("fedavg", ["--device", "gpu"], "--device"),
    ("fedavg", ["--seed", "-1"], "--seed"),
    ("fedavg", ["--data-seed", "-1"], "--data-seed"),
    ("fedavg", ["--local-steps", "0"], "--local-steps"),
    ("fedavg", ["--local-epochs", "0"], "--local-epochs"),
    ("fedavg", ["--momentum", "1.5"], "--momentum"),
    ("fedavg", ["--lr-decay-at", "1.5"], "--lr-decay-at"),
    ("fedavg", ["--lr-decay", "-0.5"], "--lr-decay"),
    ("fedavg", ["--checkpoint-every", "-1"], "--checkpoint-every"),
    ("fedavg", ["--stop-after", "0"], "--stop-after"),
    ("fedavg", ["--lr", "nan"], "--lr"),
    ("fedln", ["--agg", "fedyogi", "--yogi-beta1", "1.5"], "--yogi-beta1"),
    ("fedln", ["--agg", "fedyogi", "--yogi-tau", "-1"], "--yogi-tau"),
    ("anfr", ["--clip", "-1"], "--clip"),
    ("anfr", ["--agg", "fedavg", "--prox-mu", "0.1"], "--prox-mu"),
    ("fedln", ["--prox-mu", "0.1"], "--prox-mu"),
    ("anfr", ["--crop-scale", "0.5", "0.1"], "--crop-scale"),
    ("anfr", ["--agc", "0.01"], "--agc"),
    ("anfr", ["--arch", "bn", "--bn-stats", "local", "--pfl", "fedbn"], "--bn-stats"),
    ("anfr", ["--arch", "bn", "--bn-stats", "local", "--client-test"], "--bn-stats"),
    ("anfr", ["--focal-weights", "pooled"], "--focal-weights"),
    ("anfr", ["--focal-gamma", "1"], "--focal-gamma"),
]


@pytest.mark.parametrize("name,flags,flag", REFUSED, ids=[f"{n} {' '.join(f)}" for n, f, _ in REFUSED])
def test_regressions_are_refused(name, flags, flag, tmp_path, monkeypatch, capsys):
    code, last = parse(
        name,
        ["--dataset", "synthetic", "--device", "cpu", "--out", tmp_path / "run", *BASE[name], *flags],
        monkeypatch,
        capsys,
    )
    assert code == 2 and flag in last, last
    assert os.listdir(tmp_path) == []


def test_an_out_that_cannot_be_made_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    """--out below a file, a file, or where nothing can be written: one line from Run (it takes the folder first)."""
    (tmp_path / "file").write_text("x")
    cases = [
        (tmp_path / "file" / "run", "File exists"),
        (tmp_path / "file", "Not a directory"),
        ("/proc/x", "cannot"),
    ]
    for out, why in cases:
        monkeypatch.setattr(sys, "argv", ["fedavg.py", "--dataset", "synthetic", "--device", "cpu", "--out", str(out)])
        with pytest.raises(SystemExit) as e:
            common.Run(importlib.import_module("fedavg").parse_args())
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert e.value.code == 2 and "--out" in last and why in last, last
    assert os.listdir(tmp_path) == ["file"]


@pytest.mark.slow  # processes that hang or fail
def test_hangs_and_tracebacks_end_within_seconds_in_a_process(tmp_path):
    """The inputs that hung (--local-epochs -1) or raised deep in torch, as a user runs them."""
    from concurrent.futures import ThreadPoolExecutor

    cases = [["--local-epochs", "-1"], ["--local-steps", "-1"], ["--lr", "-0.1"], ["--device", "gpu"]]

    def one(flags):
        start = time.time()
        proc = subprocess.run(
            [sys.executable, "fedavg.py", *TINY, *flags, "--out", str(tmp_path / "run")],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        return proc, time.time() - start

    with ThreadPoolExecutor(2) as pool:
        for flags, (proc, seconds) in zip(cases, pool.map(one, cases)):
            assert proc.returncode == 2 and flags[0] in proc.stderr.splitlines()[-1], proc.stderr[-500:]
            assert "Traceback" not in proc.stderr and seconds < 60
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("script", SCRIPTS)
def test_amp_on_the_cpu_is_said_in_help(script, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [f"{script}.py", "--help"])
    with pytest.raises(SystemExit):
        importlib.import_module(script).parse_args()
    assert "CPU: often slower" in " ".join(capsys.readouterr().out.split())


def parse_args_of(name, argv, monkeypatch):
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *map(str, argv)])
    return importlib.import_module(name).parse_args()


def test_empty_class_folder_is_named(tmp_path, monkeypatch, capsys):
    from PIL import Image

    for split in ("train", "test"):
        for cls in ("cat", "dog"):
            (tmp_path / split / cls).mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(tmp_path / "train" / "cat" / "a.png")
    Image.new("RGB", (8, 8)).save(tmp_path / "test" / "cat" / "a.png")
    code, last = prepare(
        "fedavg", ["--dataset", "folder", "--data-dir", tmp_path, "--out", tmp_path / "run"], monkeypatch, capsys
    )
    assert code == 2 and "--data-dir" in last and "dog" in last and "no images" in last, last
    assert not (tmp_path / "run").exists()  # refused before the run folder is made


# ---- run folders ----------------------------------------------------------------------------------------
def tiny(out, *flags):
    return ["fedavg.py", *TINY, "--iid", "--out", out, *flags]


def files_of(folder):
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder))}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 4-round run (with model.pt), and a 6-round run of the same flags."""
    tmp = tmp_path_factory.mktemp("finished")
    from helpers import run_batches

    run_batches([tiny(tmp / "four", "--save-model")], [tiny(tmp / "six", "--save-model", "--rounds", "6")])
    return tmp


@pytest.mark.slow  # a process per script
def test_out_holding_a_run_is_refused_and_kept(finished, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished / "four", run)
    before = files_of(run)
    for script in ("fedavg.py", "fedbabu.py"):  # also another script's --out
        proc = run_script(script, *TINY, "--out", run, check=False)
        assert proc.returncode == 2 and "--out" in proc.stderr.splitlines()[-1] and "--resume" in proc.stderr
    assert files_of(run) == before
    run_script(*tiny(run, "--overwrite", "--rounds", "2"))  # asked for: replaced
    assert [r["round"] for r in metrics(run)] == [1, 2] and not (run / "model.pt").exists()
    assert summary(run)["final_round"] == 2


@pytest.mark.slow  # a run in a process
def test_out_with_other_files_is_accepted(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "command.txt").write_text("python fedavg.py ...")  # benchmarks/reproduce writes this first
    run_script(*tiny(tmp_path / "run", "--rounds", "1"))
    assert (tmp_path / "run" / "command.txt").exists() and summary(tmp_path / "run")["final_round"] == 1


@pytest.mark.slow  # two resumes, a process each
def test_resume_of_a_finished_run_changes_nothing(finished, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished / "four", run)
    before = files_of(run)
    proc = run_script("fedavg.py", "--resume", run)
    assert "finished" in proc.stdout and files_of(run) == before
    proc = run_script("fedavg.py", "--resume", run, "--rounds", "4")  # the same number of rounds: nothing to do
    assert "finished" in proc.stdout and files_of(run) == before


@pytest.mark.slow  # resumes, a process each
def test_resume_with_more_rounds_extends_like_an_uninterrupted_run(finished, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished / "four", run)
    run_script("fedavg.py", "--resume", run, "--rounds", "6")
    assert metrics(run) == metrics(finished / "six")  # the lr is constant here, so nothing differs
    assert_same_model(run, finished / "six")
    assert json.load(open(run / "config.json"))["rounds"] == 6 and summary(run)["final_round"] == 6
    proc = run_script("fedavg.py", "--resume", run, "--rounds", "5", check=False)
    assert proc.returncode == 2 and "--rounds" in proc.stderr.splitlines()[-1]


@pytest.mark.slow  # two runs and a resume
def test_extension_of_a_run_checkpointed_sparsely_continues_from_its_last_round(tmp_path):
    """--checkpoint-every 3 over 4 rounds: the last round is checkpointed too, so an extension goes on from it."""
    run_script(*tiny(tmp_path / "a", "--checkpoint-every", "3"))
    assert torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=False)["round"] == 4


@pytest.mark.slow  # needs the finished runs (two processes)
def test_resume_refuses_other_flags_and_other_scripts_runs(finished, tmp_path, monkeypatch, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished / "four", run)
    code, last = parse("fedavg", ["--resume", run, "--lr", "0.5"], monkeypatch, capsys)
    assert code == 2 and "--lr" in last
    for name in ("fedbabu", "fedfn", "anfr"):
        code, last = parse(name, ["--resume", run], monkeypatch, capsys)
        assert code == 2 and "--resume" in last and "fedavg" in last, last
    config = (run / "config.json").read_text()
    (run / "config.json").write_text(json.dumps({k: v for k, v in json.loads(config).items() if k != "script"}))
    for name in ("fedavg", "fedbabu"):  # config.json without the script that wrote it: no script's run
        code, last = parse(name, ["--resume", run], monkeypatch, capsys)
        assert code == 2 and last.endswith(f"error: --resume: {run} holds a run of ?.py, not of {name}.py; see --help")
    (run / "config.json").write_text(config)
    (run / "summary.json").unlink()
    code, last = parse("fedavg", ["--resume", run], monkeypatch, capsys)
    assert code is None
    monkeypatch.setattr(sys, "argv", ["fedavg.py", "--resume", str(run), "--data-dir", str(tmp_path / "moved")])
    assert importlib.import_module("fedavg").parse_args().data_dir == str(tmp_path / "moved")  # the data moved


@pytest.mark.slow  # a diverging run
def test_resume_without_checkpoint_or_of_a_diverged_run_says_what_is_missing(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    proc = run_script(*tiny(run, "--lr", "1e12", "--momentum", "0"), check=False)
    assert proc.returncode == 1 and "diverged" in proc.stderr
    code, last = parse("fedavg", ["--resume", run], monkeypatch, capsys)
    assert code == 2 and "diverged" in last
    (run / "summary.json").unlink()
    code, last = parse("fedavg", ["--resume", run], monkeypatch, capsys)
    assert code == 2 and "no checkpoint.pt" in last and "no config.json" not in last


def test_nan_never_reaches_a_json_file(tmp_path):
    run = tmp_path / "run"
    run_script(*tiny(run, "--lr", "1e12", "--momentum", "0"), check=False)

    def strict(text):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in a JSON file"))

    s = strict((run / "summary.json").read_text())
    assert s["diverged"] is True and s["train_loss"] is None
    for line in (run / "metrics.jsonl").read_text().splitlines():
        strict(line)
    assert common._json_safe({"a": [1.0, float("nan"), {"b": float("-inf")}], "c": 2}) == {
        "a": [1.0, None, {"b": None}],
        "c": 2,
    }


def test_atomic_save_leaves_the_old_file_whole_when_interrupted(tmp_path, monkeypatch):
    path = str(tmp_path / "checkpoint.pt")
    common.atomic_save({"round": 1}, path)

    def interrupted(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        common.atomic_save({"round": 2}, path)
    monkeypatch.undo()
    assert torch.load(path) == {"round": 1} and os.listdir(tmp_path) == ["checkpoint.pt"]  # no temporary file left


def test_start_up_line_names_device_model_parameters_partition_and_folder(tmp_path):
    proc = run_script(*tiny(tmp_path / "run", "--rounds", "1"))
    line = next(line for line in proc.stdout.splitlines() if line.startswith("fedavg: "))
    model = common.build_model("mlp", argparse.Namespace(in_channels=3, num_classes=10, image_size=32))
    params = sum(p.numel() for p in model.parameters())
    assert "cpu" in line and f"model mlp, {params:,} parameters" in line and "iid: 4 clients" in line
    assert str(tmp_path / "run") in line


@pytest.mark.slow  # a run interrupted twice
def test_ctrl_c_twice_ends_with_one_line_and_no_traceback(tmp_path):
    out = tmp_path / "run"
    proc = start_script(*tiny(out, "--rounds", "200", "--local-steps", "400"))  # rounds of seconds
    deadline = time.time() + 120
    while time.time() < deadline and not (out.joinpath("metrics.jsonl").exists() and metrics(out)):
        time.sleep(0.05)
    lines = []  # stdout, read as it comes: the second Ctrl-C goes once the first is acknowledged, mid-round

    def read():
        for line in iter(proc.stdout.readline, ""):
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    proc.send_signal(signal.SIGINT)
    while time.time() < deadline and not any("SIGINT: finishing this round" in line for line in list(lines)):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    err = proc.stderr.read()
    proc.wait(timeout=120)
    reader.join(timeout=10)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert err.count("interrupted;") == 1
    rows = metrics(out)  # whole lines only
    ckpt = torch.load(out / "checkpoint.pt", weights_only=False)
    assert ckpt["round"] >= 1 and len(rows) >= ckpt["round"]


# ---- the image-folder cache ----------------------------------------------------------------------------
def make_folder(root, counts, size=8):
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    for split, per_class in counts.items():
        for cls, n in per_class.items():
            (root / split / cls).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                pixels = torch.randint(0, 256, (size, size, 3), generator=g, dtype=torch.uint8).numpy()
                Image.fromarray(pixels).save(root / split / cls / f"{i}.png")


def read_folder(root):  # common's image-folder reader: (x_train, y_train, x_test, y_test)
    d = common.image_folder(argparse.Namespace(data_dir=str(root)))
    return d["x_train"], d["y_train"], d["x_test"], d["y_test"]


def test_folder_cache_sees_added_removed_and_replaced_images(tmp_path):
    from PIL import Image

    root = tmp_path / "data"
    make_folder(root, {"train": {"cat": 3, "dog": 2}, "test": {"cat": 1, "dog": 1}})
    x, y, _, _ = read_folder(root)
    assert sorted(y.tolist()) == [0, 0, 0, 1, 1] and (root / ".cleanfl-cache.pt").exists()  # read in a mixed order
    stamps = {d: os.stat(d).st_mtime_ns for d in (root / "train", root / "train" / "cat")}

    def restore_folder_times():  # what the old cache key looked at stays the same
        for d, ns in stamps.items():
            os.utime(d, ns=(ns, ns))

    make_folder(root, {"train": {"cat": 5}})  # two more cats (0-2 rewritten with the same pixels)
    restore_folder_times()
    x, y, _, _ = read_folder(root)
    assert sorted(y.tolist()) == [0] * 5 + [1, 1]
    (root / "train" / "cat" / "4.png").unlink()
    restore_folder_times()
    assert sorted(read_folder(root)[1].tolist()) == [0] * 4 + [1, 1]
    Image.new("RGB", (8, 8), (1, 2, 3)).save(root / "train" / "cat" / "0.png")  # replaced in place
    restore_folder_times()
    x = read_folder(root)[0]
    assert sum(bool((img == torch.tensor([1, 2, 3])[:, None, None]).all()) for img in x) == 1  # the new pixels


# ---- CI's dependencies -----------------------------------------------------------------------------------
def test_every_third_party_import_of_tests_and_benchmarks_is_installed_by_requirements_dev():
    """A fresh virtual environment gets only requirements-dev.txt (and requirements.txt through it)."""
    local = {
        os.path.splitext(f)[0]
        for d in (ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "benchmarks"))
        for f in os.listdir(d)
        if f.endswith(".py")
    }
    provided_by = {"PIL": "torchvision"}  # Pillow comes with torchvision
    names = set()
    for req in ("requirements.txt", "requirements-dev.txt"):
        for line in open(os.path.join(ROOT, req)):
            line = line.split("#")[0].strip()
            if line and not line.startswith("-r"):
                names.add(line.split(">")[0].split("=")[0].split("<")[0].strip().lower())
    missing = set()
    for d in ("tests", "benchmarks"):
        for f in os.listdir(os.path.join(ROOT, d)):
            if not f.endswith(".py"):
                continue
            tree = ast.parse(open(os.path.join(ROOT, d, f)).read())
            for node in ast.walk(tree):
                mods = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else ([node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
                )
                for mod in mods:
                    top = mod.split(".")[0]
                    if top in sys.stdlib_module_names or top in local:
                        continue
                    if provided_by.get(top, top).lower() not in names:
                        missing.add(f"{d}/{f}: {top}")
    assert not missing, missing


# ---- a new user's first runs ----------------------------------------------------------------------------
NEW_USER_REFUSALS = [
    (["--local-epochs", "1", "--local-steps", "2"], ["--local-steps", "--local-epochs"]),  # one kind of local work
    (["--shards", "2", "--alpha", "0.1"], ["--alpha", "--shards"]),  # one partition
    (["--seed", "-1"], ["--seed", "must be in [0, 4294967295], got -1"]),  # the range as integers
    (["--dataset", "cifar11"], ["--dataset", "invalid choice"]),
    (["--model", "resnet19"], ["--model", "invalid choice"]),
]


@pytest.mark.parametrize("flags,named", NEW_USER_REFUSALS, ids=[" ".join(f) for f, _ in NEW_USER_REFUSALS])
def test_conflicting_or_unknown_flags_are_refused_in_one_line(flags, named, tmp_path, monkeypatch, capsys):
    code, last = parse("fedavg", ["--device", "cpu", "--out", tmp_path / "run", *flags], monkeypatch, capsys)
    assert code == 2 and all(n in last for n in named), last
    assert os.listdir(tmp_path) == []


def test_one_kind_of_local_work_is_kept(tmp_path, monkeypatch, capsys):
    """--local-steps leaves --local-epochs unset (config.json holds one of them); neither: the paper's E."""
    args = parse_args_of(
        "fedavg", ["--dataset", "synthetic", "--local-steps", "3", "--out", tmp_path / "a"], monkeypatch
    )
    assert (args.local_epochs, args.local_steps) == (None, 3)
    args = parse_args_of("fedavg", ["--dataset", "synthetic", "--out", tmp_path / "b"], monkeypatch)
    assert (args.local_epochs, args.local_steps) == (5, None)  # fedavg.py's E


def test_a_split_folder_given_as_data_dir_suggests_its_parent(tmp_path, monkeypatch, capsys):
    from PIL import Image

    for split in ("train", "test"):
        (tmp_path / "cifar10" / split / "cat").mkdir(parents=True)
        Image.new("RGB", (4, 4)).save(tmp_path / "cifar10" / split / "cat" / "0.png")
    code, last = prepare("fedavg", ["--dataset", "folder", "--data-dir", tmp_path / "cifar10" / "train", "--iid",
                                    "--out", tmp_path / "run"], monkeypatch, capsys)  # fmt: skip
    assert code == 2 and "--data-dir" in last and f"try --data-dir {tmp_path / 'cifar10'}" in last, last
    assert not (tmp_path / "run").exists()


def test_a_failed_download_removes_the_folder_it_made_and_keeps_one_that_was_there(tmp_path, monkeypatch, capsys):
    import torchvision.datasets as tvd

    def offline(root, **_):  # torchvision makes the folder, then fails to reach the internet
        os.makedirs(os.path.join(root, "cifar-10-batches-py"), exist_ok=True)
        raise OSError("URLError: <urlopen error [Errno -3] Temporary failure in name resolution>")

    monkeypatch.setattr(tvd, "CIFAR10", offline)
    code, last = prepare("fedavg", ["--data-dir", tmp_path / "data", "--out", tmp_path / "run"], monkeypatch, capsys)
    assert code == 2 and "--dataset folder" in last and not (tmp_path / "data").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    code, last = prepare("fedavg", ["--data-dir", tmp_path / "mine", "--out", tmp_path / "run"], monkeypatch, capsys)
    assert code == 2 and (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_unreadable_text_files_and_missing_annotated_images_are_one_line(tmp_path, monkeypatch, capsys):
    from helpers import stand_in_folder, stand_in_tinyimagenet

    flat = stand_in_folder(tmp_path / "flat")
    (tmp_path / "flat" / "classes.txt").write_text("cat\ndog\n", encoding="utf-16")
    code, last = prepare("fedavg", ["--dataset", "folder", "--data-dir", flat, "--iid"], monkeypatch, capsys)
    assert code == 2 and "classes.txt" in last and "UTF-8" in last, last
    tiny = stand_in_tinyimagenet(tmp_path / "tiny")
    with open(tmp_path / "tiny" / "val" / "val_annotations.txt", "a") as f:
        f.write("val_9.JPEG\tn01443537\t0\t0\t63\t63\n")  # an image that is not there
    code, last = prepare("fedavg", ["--dataset", "tinyimagenet", "--data-dir", tiny, "--iid"], monkeypatch, capsys)
    assert code == 2 and "val_9.JPEG" in last and "val_annotations.txt" in last, last


def test_empty_test_class_folders_are_said_in_one_line(tmp_path, monkeypatch, capsys):
    """A test class folder without images (LEAF's user split leaves most of them empty): one note, the run goes on."""
    from helpers import stand_in_folder

    root = stand_in_folder(tmp_path / "flat")
    os.remove(os.path.join(root, "test", "dog", "0.png"))
    args, data, _ = prepare("fedavg", ["--dataset", "folder", "--data-dir", root, "--iid", "--num-clients", "2"],
                            monkeypatch, capsys)  # fmt: skip
    assert len(data.y_test) == 9 and data.num_classes == 10
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "1 test class folder(s) hold no images" in err[0] and "dog" in err[0]


def test_the_picked_threads_are_used_kept_and_said(tmp_path, monkeypatch):
    """Run sets torch's thread count from args.threads (config.json keeps it: a resume computes as the run began) and
    the start-up line and summary.json say it."""
    before, n = torch.get_num_threads(), 3
    args = argparse.Namespace(out=str(tmp_path), seed=0, script="fedavg", device="cpu", threads=n, resume=None,
                              overwrite=False)  # fmt: skip
    try:
        run = common.Run(args)
        assert torch.get_num_threads() == n and f"cores, {n} threads)" in run.device
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_before_the_rounds_ends_at_once_and_in_them_after_the_round(sig, code, tmp_path, capsys, monkeypatch):
    """Ctrl-C or SIGTERM while the data is read: at once, saying nothing was written (after start: what was kept);
    in the rounds: the line to --resume (the script as the command named it), the loop's run.interrupted() is true
    and end_stopped exits 128 + the signal (the line not again); again: at once; after the rounds: at once."""
    monkeypatch.setattr(sys, "argv", ["../CleanFL/fedavg.py"])  # run from another folder: the line still works there
    args = argparse.Namespace(out=str(tmp_path / "r"), seed=0, script="fedavg", device="cpu", threads=1, resume=None,
                              overwrite=False, rounds=3)  # fmt: skip
    try:
        run = common.Run(args)
        assert not run.interrupted()
        with pytest.raises(SystemExit) as e:
            run._on_signal(sig, None)  # no round to finish, no folder yet
        assert e.value.code == code and "nothing was written" in capsys.readouterr().err
        run.rows, run.stop_signal = [], 0  # started
        with pytest.raises(SystemExit):
            run._on_signal(sig, None)
        assert "keeps what was saved" in capsys.readouterr().err
        run.stop_signal = 0
        for rnd in run.bar(range(3)):
            run._on_signal(sig, None)  # in the rounds: after this one; the line to continue now, before a kill can come
            said = f"{sig.name}: finishing this round, then a checkpoint (again: at once); continue with: python "
            assert capsys.readouterr().out == f"\n{said}../CleanFL/fedavg.py --resume {run.dir}\n" and run.interrupted()
            with pytest.raises(SystemExit) as e:
                run._on_signal(sig, None)  # again: at once
            assert e.value.code == code
            with pytest.raises(SystemExit) as e:
                run.end_stopped(rnd)
            assert e.value.code == code and capsys.readouterr().out == ""  # the line once
            break
        run.stop_signal = 0
        for _ in run.bar(range(2)):
            pass
        with pytest.raises(SystemExit) as e:
            run._on_signal(sig, None)  # after the rounds (a script's fine-tuning): at once, the last checkpoint kept
        assert e.value.code == code and "keeps what was saved" in capsys.readouterr().err
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@pytest.mark.slow  # four scripts in this process
def test_every_long_phase_has_its_bar(tmp_path, monkeypatch):
    """Decoding an image folder, each round's clients, FedBABU's per-client fine-tuning and ANFR's steps within a
    round go through common.progress (a bar shown once a phase passes 5 s); recorded here by its description."""
    import runpy

    from helpers import stand_in_folder

    seen = []

    def recording(items, desc, total=None):
        seen.append(desc)
        return items

    monkeypatch.setattr(common, "progress", recording)
    folder = stand_in_folder(tmp_path / "flat")
    common.image_folder(argparse.Namespace(data_dir=folder))
    tiny = ["--dataset", "synthetic", "--device", "cpu", "--rounds", "1", "--local-steps", "1", "--num-clients", "2"]
    for script, extra in [("fedbabu.py", ["--model", "convnet4-tiny", "--iid", "--ft-epochs", "1"]),
                          ("anfr.py", ["--depth", "18", "--width", "4", "--iid"])]:  # fmt: skip
        monkeypatch.setattr(sys, "argv", [script, *tiny, *extra, "--out", str(tmp_path / script)])
        runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
    assert {"decoding train/", "decoding test/", "round 1: clients", "fine-tuning clients"} <= set(seen)
    assert {"client 0: steps", "client 1: steps"} <= set(seen), seen


# ---- a resumed run is the run it began; odd images ----------------------------------------------------------
FOLDER_RUN = ["--dataset", "folder", "--device", "cpu", "--model", "mlp", "--num-clients", "3", "--iid", "--frac", "1"]
FOLDER_RUN += ["--local-steps", "2", "--batch-size", "8", "--rounds", "3"]


@pytest.mark.slow  # four runs
def test_resume_on_other_images_is_refused_and_the_same_images_moved_resume(tmp_path):
    """One image changed (same names, sizes and labels): refused in one line naming the pixels, the run folder
    unchanged; the same images copied to another place resume, to the uninterrupted run."""
    from PIL import Image

    began, other, moved, run = (tmp_path / n for n in ("began", "other", "moved", "run"))
    make_folder(began, {"train": {"cat": 12, "dog": 12}, "test": {"cat": 4, "dog": 4}})
    shutil.copytree(began, other)
    Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(other / "train" / "cat" / "3.png")
    run_script("fedavg.py", *FOLDER_RUN, "--data-dir", began, "--stop-after", "1", "--out", run)
    before = files_of(run)
    proc = run_script("fedavg.py", "--resume", run, "--data-dir", other, check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        f"fedavg.py: error: --data-dir: {other} holds other data than {run} began on (its pixels)"
    ), proc.stderr[-1000:]
    assert files_of(run) == before
    shutil.copytree(began, moved)
    run_script("fedavg.py", "--resume", run, "--data-dir", moved)
    run_script("fedavg.py", *FOLDER_RUN, "--data-dir", began, "--out", tmp_path / "whole")
    assert metrics(run) == metrics(tmp_path / "whole")


@pytest.mark.slow  # three runs
def test_an_edited_config_is_refused_naming_the_key_and_resumes_once_undone(tmp_path):
    run = tmp_path / "run"
    run_script("fedavg.py", *TINY, "--iid", "--stop-after", "1", "--out", run)
    config = (run / "config.json").read_text()
    edited = json.loads(config)
    edited["lr"] *= 5
    (run / "config.json").write_text(json.dumps(edited, indent=2))
    before = files_of(run)
    proc = run_script("fedavg.py", "--resume", run, check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        f"fedavg.py: error: --resume: {run}/config.json was edited (in lr); undo it, or start anew"
    ), proc.stderr[-1000:]
    assert files_of(run) == before
    (run / "config.json").write_text(config)  # undone: the run goes on to its uninterrupted end
    run_script("fedavg.py", "--resume", run)
    run_script("fedavg.py", *TINY, "--iid", "--out", tmp_path / "whole")
    assert metrics(run) == metrics(tmp_path / "whole")


def test_a_constant_channel_is_floored_and_trains(tmp_path):
    """Every image's red channel 128: its standard deviation is 0, floored at one grey level (1/255), so the
    normalized inputs are finite (0 in that channel) and a round of SGD keeps finite weights."""
    from PIL import Image

    g = np.random.default_rng(0)
    for split, n in (("train", 6), ("test", 2)):
        for cls in ("cat", "dog"):
            (tmp_path / "ds" / split / cls).mkdir(parents=True)
            for i in range(n):
                pixels = g.integers(0, 256, (8, 8, 3), dtype=np.uint8)
                pixels[..., 0] = 128
                Image.fromarray(pixels).save(tmp_path / "ds" / split / cls / f"{i}.png")
    data = common.load_data(argparse.Namespace(dataset="folder", data_dir=str(tmp_path / "ds"), device="cpu"))
    assert data.std.flatten()[0].item() == pytest.approx(1 / 255) and data.std.flatten()[1] > 0.2
    x = common.prepare_batch(data.x_train, data)
    assert torch.isfinite(x).all() and x[:, 0].abs().max() < 1e-6
    model = common.build_model("mlp", data)
    torch.nn.functional.cross_entropy(model(x), data.y_train).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_mixed_sizes_name_two_files_and_the_command_that_resizes(tmp_path, capsys):
    from PIL import Image

    from test_prepare_data import prepare

    make_folder(tmp_path / "ds", {"train": {"cat": 2, "dog": 2}, "test": {"cat": 1, "dog": 1}})
    Image.new("RGB", (5, 4)).save(tmp_path / "ds" / "train" / "dog" / "odd.png")
    with pytest.raises(common.BadInput) as e:
        read_folder(tmp_path / "ds")
    first, odd = tmp_path / "ds" / "train" / "cat" / "0.png", tmp_path / "ds" / "train" / "dog" / "odd.png"
    command = f"python benchmarks/prepare_data.py resize --src {tmp_path / 'ds'} --size N --out NEW_DIR"
    assert str(e.value) == (
        f"--data-dir: images differ in size: {first} is 8x8 with 3 channel(s), {odd} 5x4 with 3 channel(s); write a "
        f"copy at one size with {command}"
    )
    argv = command.replace("N ", "8 ").replace("NEW_DIR", str(tmp_path / "new")).split()[2:]
    assert prepare(argv, capsys)[0] == 0  # the command it names, as named: the copy reads
    x, y, _, _ = read_folder(tmp_path / "new")
    assert x.shape == (5, 3, 8, 8) and sorted(y.tolist()) == [0, 0, 1, 1, 1]
    assert odd.exists() and Image.open(odd).size == (5, 4)  # the originals untouched


# A user's shell: no OMP_NUM_THREADS, so the script picks its CPU default.
BARE = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}


def edited_fedavg(folder, after, new):
    """A copy of fedavg.py (with common.py beside it) with the line `new` put first in the block that the line
    starting with `after` opens, as a reader would edit it."""
    os.makedirs(folder)
    shutil.copy(os.path.join(ROOT, "common.py"), folder)
    lines = open(os.path.join(ROOT, "fedavg.py")).read().splitlines(keepends=True)
    i = next(i for i, line in enumerate(lines) if line.strip().startswith(after))
    indent = lines[i + 1][: len(lines[i + 1]) - len(lines[i + 1].lstrip())]
    edited = "".join([*lines[: i + 1], f"{indent}{new}\n", *lines[i + 1 :]])
    with open(os.path.join(folder, "fedavg.py"), "w") as f:
        f.write(edited)
    return os.path.join(folder, "fedavg.py")


def test_the_cpu_default_is_one_process_where_a_print_and_a_breakpoint_work(tmp_path):
    """`python fedavg.py` on the CPU trains in the process that was started: a print added in train_client shows every
    client of every round from that process, and a breakpoint() there stops in pdb and goes on with `c`. The run is
    one process of the cores' threads (torch's own count here)."""
    flags = [*TINY, "--num-clients", "6", "--frac", "0.9", "--rounds", "2"]
    printing = edited_fedavg(tmp_path / "print", "def train_client(k):", 'print("trained", k, os.getpid())')
    cmd = [sys.executable, printing, *map(str, flags), "--out", str(tmp_path / "p")]
    proc = subprocess.Popen(cmd, env=BARE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    said = [line.split() for line in stdout.splitlines() if line.startswith("trained ")]
    # Five clients a round, each said by the process that was started.
    assert len(said) == 10 and {pid for _, _, pid in said} == {str(proc.pid)}
    config, done = json.load(open(tmp_path / "p" / "config.json")), summary(tmp_path / "p")
    count = "import torch; print(torch.get_num_threads())"
    cores = int(subprocess.check_output([sys.executable, "-c", count], env=BARE))
    assert done["processes"] == 1 and config["threads"] == cores
    stopping = edited_fedavg(tmp_path / "pdb", "def train_client(k):", "breakpoint()")
    cmd = [sys.executable, stopping, *map(str, flags), "--out", str(tmp_path / "b")]
    proc = subprocess.run(cmd, env=BARE, input="c\n" * 10, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stdout.count("(Pdb)") == 10 and len(metrics(tmp_path / "b")) == 2

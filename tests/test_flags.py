"""Read at a glance: a bad flag is one line naming it, abbreviations are refused, --help
shows every default (0 too) and no default for a switch, ~ is expanded in path flags, the parser's defaults are the
run's (the paper's partition and E are declared on their flags; the flag given clears them), a torchvision dataset
pointed at an image folder is told to use --dataset folder, and each script's loop shows its rounds, its stop and
where its checkpoint is written, and calls with more than four arguments name them."""

import ast
import importlib
import json
import os
import subprocess
import sys

import pytest

import common
from helpers import ROOT
from test_robustness import script_parser

SCRIPTS = ["fedavg", "fedbabu", "fedfn", "fedln", "fednnnn", "anfr"]
# the paper's partition of each script, as its PAPER dict declares it
PARTITION = {"fedavg": ("shards", 2), "fedbabu": ("shards", 10), "fedfn": ("shards", 10),
             "fedln": ("classes_per_client", 1), "fednnnn": ("shards", 2), "anfr": ("split2", True)}  # fmt: skip


def parse(name, argv, monkeypatch, capsys):
    """(args or None, exit code or None, stderr lines) of <name>.parse_args on argv, in this process."""
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--dataset", "synthetic", "--device", "cpu", *map(str, argv)])
    try:
        return importlib.import_module(name).parse_args(), None, capsys.readouterr().err.strip().splitlines()
    except SystemExit as e:
        return None, e.code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_bad_flag_is_one_line_naming_it_and_abbreviations_are_refused(name, monkeypatch, capsys):
    for argv, line in [
        (["--lr", "-1"], f"{name}.py: error: --lr: must be > 0, got -1; see --help"),
        (["--round", "3"], f"{name}.py: error: unrecognized arguments: --round 3 (did you mean --rounds?); see --help"),
        (
            ["--clients", "3"],
            f"{name}.py: error: unrecognized arguments: --clients 3 (did you mean --num-clients?); see --help",
        ),  # fmt: skip
        (["--out", ""], f"{name}.py: error: --out: must be a path, got ''; see --help"),
        (["--seed", "x"], f"{name}.py: error: --seed: expected an integer, got 'x'; see --help"),
        (["--seed", "9" * 400], f"{name}.py: error: --seed: must be in [0, 4294967295], got {'9' * 400}; see --help"),
        (["--threads", "two"], f"{name}.py: error: --threads: expected an integer, got 'two'; see --help"),
    ]:
        args, code, err = parse(name, argv, monkeypatch, capsys)
        assert (code, err) == (2, [line]), (argv, err)


@pytest.mark.parametrize(
    "argv,line",
    [
        (["mlp"], "unrecognized arguments: mlp; see --help"),
        (["--rounds", "5", "10"], "unrecognized arguments: 10; see --help"),
        (["--xyzzy"], "unrecognized arguments: --xyzzy; see --help"),
        (["--xyzzy=3"], "unrecognized arguments: --xyzzy=3; see --help"),
        (["--seeed", "1"], "unrecognized arguments: --seeed 1 (did you mean --seed?); see --help"),
    ],
)
def test_a_stray_word_or_an_unknown_flag_is_one_line_with_a_suggestion_only_when_close(argv, line, monkeypatch, capsys):
    args, code, err = parse("fedavg", argv, monkeypatch, capsys)
    assert (code, err) == (2, [f"fedavg.py: error: {line}"])


@pytest.mark.parametrize("value", ["cpu", "cuda", "cuda:0", "cuda:12", "mps", "gpu", "cuda:", "cuda:x", "CPU", "cpu0"])
def test_device_is_cpu_cuda_cuda_n_or_mps(value, monkeypatch, capsys):
    """--device: the four forms pass as typed (whether the machine has the device is checked after); else one line."""
    monkeypatch.setattr(importlib.import_module("fedavg"), "finish_args", lambda parser, args, script: args)
    args, code, err = parse("fedavg", ["--device", value], monkeypatch, capsys)
    if value in ("cpu", "cuda", "cuda:0", "cuda:12", "mps"):
        assert code is None and args.device == value
    else:
        assert err == [f"fedavg.py: error: --device: must be cpu, cuda, cuda:N or mps, got {value}; see --help"]


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_shows_every_default_and_none_for_a_switch(name, monkeypatch, capsys):
    parser = script_parser(name, monkeypatch)
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--help"])
    with pytest.raises(SystemExit):
        importlib.import_module(name).parse_args()
    text = " ".join(capsys.readouterr().out.split())
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        shown = common.HelpFormatter(name)._get_help_string(action) or ""
        if action.nargs == 0:  # a switch (store_true, store_false, a partition switch): its help says what it does
            assert "(default" not in shown and action.help, action.option_strings
        elif action.default is not None:  # 0 and 0.0 too
            assert "(default" in shown, action.option_strings
    assert "(default: 0.0)" in text or "(default: 0)" in text  # a zero default is shown
    assert "(default: True)" not in text and "(default: False)" not in text


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_parsers_defaults_are_the_runs(name, monkeypatch, capsys):
    """No partition flag: the paper's, declared on its flag (so --help shows it); another flag given clears it; two
    given are refused, also when one repeats the default's value. Likewise E against --local-steps."""
    dest, value = PARTITION[name]
    parser = script_parser(name, monkeypatch)
    assert parser.get_default(dest) == value
    args, _, _ = parse(name, [], monkeypatch, capsys)
    assert getattr(args, dest) == value and sum(bool(getattr(args, k)) for k in common.PARTITIONS) == 1
    args, _, _ = parse(name, ["--iid"], monkeypatch, capsys)
    assert args.iid is True and not getattr(args, dest) and sum(bool(getattr(args, k)) for k in common.PARTITIONS) == 1
    flag = "--" + dest.replace("_", "-")
    twice = [flag] if value is True else [flag, str(value)]
    _, code, err = parse(name, [*twice, "--alpha", "0.5"], monkeypatch, capsys)
    assert code == 2 and err == [f"{name}.py: error: --alpha: not allowed with argument {flag}; see --help"], err
    if "local_epochs" in {a.dest for a in parser._actions}:
        assert parser.get_default("local_epochs") == importlib.import_module(name).PAPER["local_epochs"]
        args, _, _ = parse(name, ["--local-steps", "3"], monkeypatch, capsys)
        assert (args.local_epochs, args.local_steps) == (None, 3)
        _, code, _ = parse(name, ["--local-epochs", str(parser.get_default("local_epochs")), "--local-steps", "3"],
                           monkeypatch, capsys)  # fmt: skip
        assert code == 2


def test_path_flags_expand_the_home_folder(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    args, _, _ = parse("fedavg", ["--data-dir=~/cifar10", "--out", "~/runs/a"], monkeypatch, capsys)
    assert (args.data_dir, args.out) == (f"{tmp_path}/cifar10", f"{tmp_path}/runs/a")
    monkeypatch.setattr(sys, "argv", ["anfr.py", "--init-from", "~/w.pt"])
    parser = script_parser("anfr", monkeypatch)
    assert parser.parse_args(["--init-from", "~/w.pt"]).init_from == f"{tmp_path}/w.pt"


def test_a_torchvision_name_on_an_image_folder_is_told_to_use_folder(tmp_path, monkeypatch, capsys):
    from helpers import prepare, stand_in_folder

    root = stand_in_folder(tmp_path / "cifar10")
    code, last = prepare("fedavg", ["--dataset", "cifar10", "--data-dir", root], monkeypatch, capsys)
    said = f"fedavg.py: error: --dataset cifar10: {root} holds train/<class>/ folders; read them with --dataset folder"
    assert code == 2 and last == said
    assert sorted(os.listdir(root)) == ["test", "train"]  # nothing downloaded into it


@pytest.mark.slow  # a run in a process
def test_a_warm_up_longer_than_the_run_is_said_at_start(tmp_path):
    flags = ["--dataset", "synthetic", "--device", "cpu", "--depth", "18", "--width", "4", "--image-size", "8",
             "--num-clients", "3", "--alpha", "1.0", "--rounds", "1", "--local-steps", "2",
             "--out", tmp_path / "r"]  # fmt: skip
    proc = subprocess.run([sys.executable, "anfr.py", *map(str, flags)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    notes = [line for line in proc.stdout.splitlines() if "--warmup-steps" in line]
    assert notes == ["note: --warmup-steps 100 exceeds the 2 local steps of a client's run: its lr stays in the "
                     "warm-up throughout"], proc.stdout[-2000:]  # fmt: skip


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_loop_shows_its_rounds_its_stop_and_its_checkpoint(name):
    """In each script the rounds' loop runs over range(start, args.rounds), decides its stop in a line of its own
    (Ctrl-C or SIGTERM, asked of every rank in a statement of its own: run.interrupted; --stop-after) and ends the
    run on it apart from the checkpoint it writes
    there (what the checkpoint holds is written in the loop); no call passes more than four arguments by position
    (nn.Sequential's layers aside)."""
    tree = ast.parse(open(os.path.join(ROOT, f"{name}.py")).read())
    loop = next(n for n in ast.walk(tree) if isinstance(n, ast.For) and "run.bar" in ast.unparse(n.iter))
    assert ast.unparse(loop.iter) == "run.bar(range(start, args.rounds))" and ast.unparse(loop.target) == "rnd"
    assigned = {ast.unparse(a.targets[0]): ast.unparse(a.value) for a in loop.body if isinstance(a, ast.Assign)}
    assert assigned["interrupted"] == "run.interrupted()"
    assert assigned["stop"] == "interrupted or (rnd + 1 - start == args.stop_after and (not last))"
    ends = [n for n in loop.body if isinstance(n, ast.If) and ast.unparse(n.test) == "stop"]
    assert [ast.unparse(n.body[0]) for n in ends] == ["run.end_stopped(rnd)"]
    saves = [c for c in ast.walk(loop) if isinstance(c, ast.Call) and ast.unparse(c.func) == "run.save"]
    assert [ast.literal_eval(c.args[1]) for c in saves] == ["checkpoint.pt"]
    assert isinstance(saves[0].args[0], ast.Dict) and "run.snapshot(rnd)" in ast.unparse(saves[0].args[0])
    crowded = [
        ast.unparse(c)[:80]
        for c in ast.walk(tree)
        if isinstance(c, ast.Call) and len(c.args) > 4 and ast.unparse(c.func) != "nn.Sequential"
    ]
    assert crowded == []


@pytest.mark.slow  # a run in a process
def test_a_copy_without_its_checkpoint_lines_still_stops_after_stop_after(tmp_path):
    """A reader who copies fedavg.py and deletes the checkpoint's lines keeps --stop-after: the loop decides it."""
    lines = open(os.path.join(ROOT, "fedavg.py")).read().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("if stop or last"))
    assert "run.save(" in lines[at + 1]
    (tmp_path / "fedavg.py").write_text("".join(lines[:at] + lines[at + 2 :]))
    flags = ["--dataset", "synthetic", "--device", "cpu", "--model", "mlp", "--num-clients", "4", "--frac", "0.5",
             "--local-steps", "2", "--rounds", "5", "--stop-after", "2", "--out", tmp_path / "run"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, tmp_path / "fedavg.py", *map(str, flags)], cwd=tmp_path, env=env,
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("stopped after round 2; continue with: ")
    assert [json.loads(r)["round"] for r in open(tmp_path / "run" / "metrics.jsonl")] == [1, 2]
    assert not (tmp_path / "run" / "checkpoint.pt").exists() and not (tmp_path / "run" / "summary.json").exists()

"""--track tensorboard and --track wandb: what each tracker holds, read back with its own format, equals
metrics.jsonl; a resumed run continues both without a step twice; a missing package is one line; a run whose
output goes to a file logs a plain line per evaluation."""

import glob
import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

import common
from helpers import ROOT, TINY, metrics, run_script

FLAGS = [*TINY, "--client-test", "--balanced-acc"]
TRACK = ["--track", "tensorboard", "--track", "wandb"]


def offline(tmp_path):
    """W&B offline, its own folders in tmp_path: nothing leaves the machine or lands in the home folder."""
    return {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb-data"),
    }


def tensorboard_rows(folder):
    """({round: {name: value}}, the rounds of test_acc) of the event files, read as TensorBoard's server reads them
    (plugin_event_accumulator: the steps a restart logged again purged); a histogram as its buckets [k, 3] (left
    edge, right edge, count)."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    events = EventAccumulator(os.path.join(folder, "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    rows = {}
    for name in events.Tags()["tensors"]:
        for e in events.Tensors(name):
            value = tensor_util.make_ndarray(e.tensor_proto)
            rows.setdefault(e.step, {})[name] = float(value) if value.ndim == 0 else value
    steps = [e.step for e in events.Tensors("test_acc")]
    return rows, steps


def same_as_tensorboard(row, held):
    """Whether TensorBoard holds the metrics.jsonl row: its numbers exactly as 32-bit floats; a list as a histogram
    of as many values (None left out), whose edges bracket them."""
    for name, value in row.items():
        if isinstance(value, list):
            kept = [v for v in value if v is not None]
            buckets = held[name]
            if buckets[:, 2].sum() != len(kept) or not buckets[0, 0] <= min(kept) <= max(kept) <= buckets[-1, 1]:
                return False
        # TensorBoard keeps a scalar in 32 bits.
        elif name != "round" and held[name] != float(np.float32(value)):
            return False
    return True


def wandb_records(folder):
    """Every record of the folder's W&B offline runs, read from their .wandb files: W&B's record log (blocks of 32
    KiB holding records of a 7-byte header: checksum, length, type), each record one of W&B's protocol buffers.
    [(run id, record)] in the order written."""
    from wandb.proto import wandb_internal_pb2

    records = []
    for path in sorted(glob.glob(os.path.join(folder, "wandb", "offline-run-*", "run-*.wandb"))):
        with open(path, "rb") as f:
            data = f.read()
        # The file's own 7-byte header, then the records.
        pos, pending = 7, b""
        while pos + 7 <= len(data):
            left = 32768 - pos % 32768
            if left < 7:
                pos += left
                continue
            _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            pending += data[pos + 7 : pos + 7 + length]
            pos += 7 + length
            # FULL or LAST: a whole record.
            if kind in (1, 4):
                record = wandb_internal_pb2.Record()
                record.ParseFromString(pending)
                pending = b""
                records.append((os.path.basename(path)[4:-6], record))
    return records


def items(entries):
    """A protocol buffer's key-value items as a dict; a nested key joined by "/"."""
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in entries}


def wandb_history(folder):
    """[(run id, {key: value})] of every history row, in the order written."""
    rows = []
    for run_id, record in wandb_records(folder):
        if record.WhichOneof("record_type") == "history":
            rows.append((run_id, items(record.history.item)))
    return rows


def wandb_config(folder):
    """The runs' config, as W&B holds it."""
    config = {}
    for _, record in wandb_records(folder):
        if record.WhichOneof("record_type") == "run":
            config.update(items(record.run.config.update))
        if record.WhichOneof("record_type") == "config":
            config.update(items(record.config.update))
    return config


def test_both_trackers_hold_what_metrics_jsonl_holds(tmp_path):
    """Each metric of each evaluation, at its round, in TensorBoard's event files and in W&B's offline run; the
    per-client test accuracies as a histogram in TensorBoard and W&B; W&B's config is config.json."""
    out = tmp_path / "run"
    run_script("fedavg.py", *FLAGS, *TRACK, "--out", out, env=offline(tmp_path))
    rows = metrics(out)
    by_round, steps = tensorboard_rows(out)
    assert steps == [1, 2, 3, 4]
    for row in rows:
        assert same_as_tensorboard(row, by_round[row["round"]]), row["round"]
        # metrics() drops elapsed_s: TensorBoard holds it too.
        assert by_round[row["round"]].keys() - {"elapsed_s"} == row.keys() - {"round"}
    history = wandb_history(out)
    assert len({run_id for run_id, _ in history}) == 1
    assert [h["_step"] for _, h in history] == [1, 2, 3, 4]
    for row, (_, h) in zip(rows, history):
        for name, value in row.items():
            if isinstance(value, list):
                # A histogram: its counts add up to the clients with a test set.
                assert h[f"{name}/_type"] == "histogram"
                assert sum(h[f"{name}/values"]) == len([v for v in value if v is not None])
            elif name != "round":
                assert h[name] == value, name
    config = json.loads((out / "config.json").read_text())
    held = wandb_config(out)
    assert {k: held[k] for k in config} == config


def test_a_resumed_run_continues_both_trackers_without_a_step_twice(tmp_path):
    """Killed after round 3 was logged but before its checkpoint (round 2's is the last), then resumed: TensorBoard
    drops its round 3 and holds rounds 1-4 once each, equal to metrics.jsonl; W&B continues the same run id, with
    rounds 1-4 as metrics.jsonl holds them."""
    copy = tmp_path / "code"
    copy.mkdir()
    shutil.copy(os.path.join(ROOT, "common.py"), copy)
    lines = open(os.path.join(ROOT, "fedavg.py")).read().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("run.log("))
    indent = lines[at][: len(lines[at]) - len(lines[at].lstrip())]
    lines.insert(at + 1, f"{indent}if rnd + 1 == 3 and not args.resume:\n{indent}    os._exit(9)\n")
    (copy / "fedavg.py").write_text("".join(lines))
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", **offline(tmp_path)}
    flags = [*FLAGS, *TRACK, "--checkpoint-every", "2", "--out", str(out)]
    killed = subprocess.run([sys.executable, str(copy / "fedavg.py"), *flags], env=env, capture_output=True, text=True)
    assert killed.returncode == 9 and [r["round"] for r in metrics(out)] == [1, 2, 3]
    assert tensorboard_rows(out)[1] == [1, 2, 3]
    resumed = subprocess.run(
        [sys.executable, str(copy / "fedavg.py"), "--resume", str(out)], env=env, capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = metrics(out)
    by_round, steps = tensorboard_rows(out)
    assert [r["round"] for r in rows] == steps == [1, 2, 3, 4]
    assert all(same_as_tensorboard(r, by_round[r["round"]]) for r in rows)
    history = wandb_history(out)
    run_ids = {run_id for run_id, _ in history}
    # Offline, each process writes its own copy of the run; the resumed one logs again what its checkpoint holds
    # (the killed one may have lost it) and goes on. Every step holds the row metrics.jsonl holds, whichever wrote it.
    assert len(run_ids) == 1 and sorted({h["_step"] for _, h in history}) == [1, 2, 3, 4]
    by_round = {r["round"]: r for r in rows}
    assert all(h["test_acc"] == by_round[h["_step"]]["test_acc"] for _, h in history)


def test_a_missing_tracker_package_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec

    def without_wandb(name, *a, **k):
        return None if name == "wandb" else real(name, *a, **k)

    monkeypatch.setattr(importlib.util, "find_spec", without_wandb)
    monkeypatch.setattr(sys, "argv", ["fedavg.py", *FLAGS, *TRACK, "--out", str(tmp_path / "run")])
    import fedavg

    with pytest.raises(SystemExit) as e:
        fedavg.parse_args()
    line = "fedavg.py: error: --track wandb: the wandb package is not installed; pip install wandb; see --help"
    assert e.value.code == 2 and capsys.readouterr().err.strip().splitlines() == [line]
    assert not (tmp_path / "run").exists()


def test_a_run_logging_to_a_file_writes_a_plain_line_for_each_evaluation(tmp_path):
    """Its output in a file (a cluster job's log): no carriage return, no escape sequence, one line per
    evaluation that gives the round, the test accuracy, the training loss and the time."""
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "fedavg.py", *FLAGS, "--out", str(tmp_path / "run")]
        subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, check=True)
    text = log.read_text()
    assert "\r" not in text and "\x1b" not in text
    said = [line for line in text.splitlines() if line.startswith("round ")]
    rows = metrics(tmp_path / "run")
    assert len(said) == len(rows) == 4
    for line, row in zip(said, rows):
        assert line.startswith(f"round {row['round']}/4: test_acc {row['test_acc']:.4f}, train_loss ")
        assert line.endswith(" s")


def test_the_trackers_are_flags_of_every_script():
    for script in ("fedavg", "fedbabu", "fedfn", "fedln", "fednnnn", "anfr"):
        text = open(os.path.join(ROOT, f"{script}.py")).read()
        assert '"--track", action="append", choices=TRACKERS' in text, script
        assert '"--wandb-project"' in text and '"--wandb-entity"' in text, script
    assert common.TRACKERS == ["tensorboard", "wandb"]

"""benchmarks/memory.py: its synthetic folder of Tiny-ImageNet's layout, what it counts (PSS over a command's
processes) and its table; bad input is one line."""

import importlib.util
import os
import subprocess
import sys

import pytest
from PIL import Image

from helpers import ROOT

BENCH = os.path.join(ROOT, "benchmarks", "memory.py")


def memory():
    spec = importlib.util.spec_from_file_location("memory", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_synth_writes_a_folder_of_the_asked_shape(tmp_path):
    folder = tmp_path / "tin"
    cmd = [sys.executable, BENCH, "synth", str(folder), "--classes", "3", "--train-per-class", "2"]
    cmd += ["--test-per-class", "1", "--size", "8"]
    subprocess.run(cmd, check=True, capture_output=True)
    for split, per_class in (("train", 2), ("test", 1)):
        classes = sorted(os.listdir(folder / split))
        assert classes == ["class000", "class001", "class002"]
        for c in classes:
            files = sorted(os.listdir(folder / split / c))
            assert len(files) == per_class and all(f.endswith(".bmp") for f in files)
            with Image.open(folder / split / c / files[0]) as img:
                assert img.size == (8, 8) and img.mode == "RGB"


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc (Linux)")
def test_pss_counts_a_command_and_its_children():
    """A command that starts a child holding 200 MB: the peak over both is at least that; alone, the parent's own
    PSS is far less."""
    m = memory()
    holder = "import time; b = bytearray(200 * 2**20); time.sleep(1.5)"
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {holder!r}])"
    peak, seen, seconds = m.peak_pss([sys.executable, "-c", parent], interval=0.05)
    assert peak >= 200 * 2**20 and seen >= 2 and seconds >= 1.5
    assert m.pss_bytes(os.getpid()) > 0 and m.pss_bytes(2**22 + 1) == 0


def test_table_gives_the_peak_less_the_images():
    m = memory()
    runs = [
        {"data": "cifar10", "processes": 1, "processes_seen": 1, "images_bytes": 184e6, "peak_pss_bytes": 0.684e9},
        {"data": "cifar10", "processes": 2, "processes_seen": 3, "images_bytes": 184e6, "peak_pss_bytes": 1.5e9},
    ]
    lines = m.table(runs, torch_alone=0.3e9).splitlines()
    # Less torch's own: 0.3 GB a process, torchrun's agent one of the three.
    assert lines[2] == "| cifar10 | 1 | 0.18 | 0.68 | 0.50 | 0.20 |"
    assert lines[3] == "| cifar10 | 2 | 0.18 | 1.50 | 1.32 | 0.42 |"


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["measure", "--data-dir", "nowhere", "--out", "x.json"], "--data-dir"),
        (["measure", "--data-dir", "{folder}", "--processes", "0", "--out", "x.json"], "--processes"),
        (["measure", "--data-dir", "{folder}", "--interval", "0", "--out", "x.json"], "--interval"),
        (["measure", "--data-dir", "{folder}", "--out", "{taken}"], "--out"),
        (["synth", "{folder}"], "dir"),
        (["synth", "{new}", "--size", "0"], "--size"),
    ],
)
def test_bad_input_is_one_line(argv, flag, tmp_path):
    folder = tmp_path / "images"
    for split in ("train", "test"):
        (folder / split).mkdir(parents=True)
    taken = tmp_path / "taken.json"
    taken.write_text("{}")
    argv = [a.format(folder=folder, taken=taken, new=tmp_path / "new") for a in argv]
    res = subprocess.run([sys.executable, BENCH, *argv], cwd=tmp_path, capture_output=True, text=True)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and flag in lines[0], res.stderr
    assert taken.read_text() == "{}" and not (tmp_path / "new").exists()

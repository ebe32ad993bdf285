"""A run owns its folder: two runs started at once into one folder, or into the default name, leave one
run's files each; a write that fails (a full disk, a read-only or removed folder) ends the run in one line with the
earlier files whole, and --resume then ends as the uninterrupted run; a cut, corrupt or code-carrying checkpoint.pt,
--init-from file is refused in one line and runs nothing (a damaged cache is rebuilt); the default thread count is
the machine's, whatever its load."""

import argparse
import hashlib
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import time

import pytest
import torch

import common
from helpers import ROOT, TINY, metrics, run_script, start_script, summary

FLAGS = [*TINY, "--frac", "1", "--rounds", "3"]
# a wrapper that runs a script as `python script.py ...` does, with os.fsync failing (ENOSPC) from call N on: the disk
# fills up after N synced writes (a run syncs metrics.jsonl "", config.json, partition.json, then per round a
# metrics row and a checkpoint)
FULL_DISK = """
import errno, os, runpy, sys
calls, sync = [0], os.fsync
def fsync(fd):
    calls[0] += 1
    if calls[0] >= int(os.environ["FULL_AT_FSYNC"]):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    sync(fd)
os.fsync = fsync
sys.argv = sys.argv[1:]
sys.path.insert(0, os.getcwd())
runpy.run_path(sys.argv[0], run_name="__main__")
"""


class Planted:
    """A pickled object whose loading runs a shell command (`touch MARKER`): what a stranger's file can carry."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def plant(path, marker, wrap=lambda obj: obj):
    torch.save(wrap(Planted(marker)), path)
    torch.load(path, weights_only=False)  # loaded the unsafe way, the file does run its command: a real plant
    assert os.path.exists(marker)
    os.remove(marker)


def files_of(folder):  # every file's bytes, by name
    return {f: hashlib.sha1((folder / f).read_bytes()).hexdigest() for f in sorted(os.listdir(folder))}


def last_line(proc):
    lines = proc.stderr.strip().splitlines()
    return lines[-1] if lines else ""


def one_line_error(proc, code):
    assert proc.returncode == code, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return last_line(proc)


def start(cmd, cwd=ROOT):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# ---- a run owns its folder ------------------------------------------------------------------------------
@pytest.mark.slow  # two processes at once
def test_two_runs_started_at_once_into_one_folder_leave_one_runs_files(tmp_path):
    out = tmp_path / "run"
    procs = [start([sys.executable, "fedavg.py", *FLAGS, "--seed", s, "--out", str(out)]) for s in ("0", "1")]
    done = [(p, *p.communicate()) for p in procs]
    ok = [i for i, (p, _, _) in enumerate(done) if p.returncode == 0]
    assert len(ok) == 1, [p.returncode for p, _, _ in done]
    loser = done[1 - ok[0]]
    assert loser[0].returncode == 2 and "Traceback" not in loser[2]
    assert loser[2].strip().splitlines()[-1].startswith("fedavg.py: error: --out: ")  # in use, or (later) holds a run
    rows = metrics(out)
    config, final = json.loads((out / "config.json").read_text()), summary(out)
    assert [r["round"] for r in rows] == [1, 2, 3] and config["seed"] == ok[0]
    assert final["test_acc"] == rows[-1]["test_acc"]
    alone = tmp_path / "alone"  # the winner's numbers are its own: the same seed alone gives the same rows
    run_script("fedavg.py", *FLAGS, "--seed", ok[0], "--out", alone)
    assert metrics(alone) == rows


@pytest.mark.slow  # two processes at once
def test_two_runs_started_at_once_under_one_default_name_take_the_next_free_one(tmp_path):
    """Both stamped with one second (time.strftime fixed): one takes runs/<name>, the other runs/<name>-2, each with
    its own config and rows."""
    wrapper = "import runpy, sys, time; time.strftime = lambda *a: '20260101-000000'; sys.argv = sys.argv[1:]; " \
              "sys.path.insert(0, sys.argv.pop(0)); runpy.run_path(sys.argv[0], run_name='__main__')"  # fmt: skip
    procs = [
        start([sys.executable, "-c", wrapper, ROOT, f"{ROOT}/fedavg.py", *FLAGS, "--alpha", a], cwd=tmp_path)
        for a in ("0.3", "0.9")
    ]
    for p in procs:
        assert p.wait() == 0, p.stderr.read()[-2000:]
    base = tmp_path / "runs" / "fedavg__synthetic__0__20260101-000000"
    assert sorted(os.listdir(tmp_path / "runs")) == [base.name, base.name + "-2"]
    alphas = []
    for folder in (base, base.parent / (base.name + "-2")):
        config = json.loads((folder / "config.json").read_text())
        assert config["out"] == os.path.join("runs", folder.name) and [r["round"] for r in metrics(folder)] == [1, 2, 3]
        alphas.append(config["alpha"])
    assert sorted(alphas) == [0.3, 0.9]


def test_the_default_name_takes_the_next_free_one_and_a_held_folder_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(common.time, "strftime", lambda fmt: "20260101-000000")  # two runs in the same second
    monkeypatch.setattr(common, "_HELD", {})
    base = os.path.join("runs", "fedavg__synthetic__0__20260101-000000")
    names = []
    for _ in range(3):
        args = argparse.Namespace(out=None, script="fedavg", dataset="synthetic", seed=0, resume=None, overwrite=False)
        names.append(common.take_folder(args)[0])
    assert names == [base, base + "-2", base + "-3"] and all(os.path.isdir(n) for n in names)
    code = subprocess.run(  # another process: each folder this one holds is refused there, before any work
        [sys.executable, os.path.join(ROOT, "fedavg.py"), *FLAGS, "--out", base], capture_output=True, text=True
    )
    assert one_line_error(code, 2) == f"fedavg.py: error: --out: another run is using {base} now; wait for it to " \
                                       "end, or choose another --out"  # fmt: skip
    assert os.listdir(base) == []


@pytest.mark.slow  # a run killed, then resumed
def test_a_killed_run_leaves_no_lock_and_resumes_at_once(tmp_path):
    out = tmp_path / "run"
    proc = start_script("fedavg.py", *TINY, "--rounds", "200", "--local-steps", "50", "--out", out)
    deadline = time.time() + 120
    while time.time() < deadline and not ((out / "checkpoint.pt").exists() and metrics(out)):
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    done = run_script("fedavg.py", "--resume", out, "--stop-after", "1")  # not refused as in use
    assert "stopped after round" in done.stdout


def test_a_refused_run_leaves_no_folder(tmp_path):
    proc = run_script("fedavg.py", *FLAGS, "--dataset", "folder", "--data-dir", tmp_path / "none", "--out",
                      tmp_path / "run", check=False)  # fmt: skip
    assert "--data-dir" in one_line_error(proc, 2) and not (tmp_path / "run").exists()


# ---- a write that fails ---------------------------------------------------------------------------------
@pytest.mark.slow  # a run, its resume, and the uninterrupted run
@pytest.mark.parametrize("fsync_call, rows_kept", [(6, 1), (7, 2)])  # the second metrics row; the second checkpoint
def test_a_full_disk_is_one_line_and_resume_continues_once_it_is_fixed(fsync_call, rows_kept, tmp_path):
    out, whole = tmp_path / "run", tmp_path / "whole"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FULL_AT_FSYNC": str(fsync_call)}
    proc = subprocess.run([sys.executable, "-c", FULL_DISK, "fedavg.py", *FLAGS, "--out", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True)  # fmt: skip
    line = one_line_error(proc, 1)
    name = "metrics.jsonl" if fsync_call == 6 else "checkpoint.pt"
    assert line.startswith(f"fedavg.py: error: cannot write {out}/{name}: No space left on device;"), line
    assert f"--resume {out}" in line
    assert [r["round"] for r in metrics(out)] == list(range(1, rows_kept + 1))  # every row whole, none cut
    assert common.safe_load(str(out / "checkpoint.pt"), "--resume")["round"] == 1  # the previous one, whole
    assert not (out / "summary.json").exists() and not [f for f in os.listdir(out) if f.endswith(".tmp")]
    run_script("fedavg.py", "--resume", out)
    run_script("fedavg.py", *FLAGS, "--out", whole)
    assert metrics(out) == metrics(whole)

    def drop(s):
        return {k: v for k, v in s.items() if k not in ("wall_time_s", "elapsed_s")}

    assert drop(summary(out)) == drop(summary(whole))


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MB filesystem (tmpfs), where this machine lets the tests mount one; else the test is skipped."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a small filesystem here")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=True)


@pytest.mark.slow  # runs on a filesystem of its own
def test_a_real_full_disk_keeps_the_last_checkpoint_and_a_read_only_folder_is_refused(small_disk, tmp_path):
    """The mlp's checkpoint is 2.6 MB: the first fits the 3 MB disk, the second's temporary file does not."""
    out = small_disk / "run"
    line = one_line_error(run_script("fedavg.py", *FLAGS, "--out", out, check=False), 1)
    assert line.startswith(f"fedavg.py: error: cannot write {out}/checkpoint.pt: No space left on device;"), line
    assert common.safe_load(str(out / "checkpoint.pt"), "--resume")["round"] == 1
    assert [r["round"] for r in metrics(out)] == [1, 2] and not [f for f in os.listdir(out) if f.endswith(".tmp")]
    before = files_of(out)
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    line = one_line_error(run_script("fedavg.py", "--resume", out, check=False), 2)
    assert line == f"fedavg.py: error: --resume: cannot write in {out}: Read-only file system", line
    assert files_of(out) == before
    moved = tmp_path / "moved"  # the cause fixed (a disk with room): the run goes on from round 1 to its end
    shutil.copytree(out, moved)
    run_script("fedavg.py", "--resume", moved)
    run_script("fedavg.py", *FLAGS, "--out", tmp_path / "whole")
    assert metrics(moved) == metrics(tmp_path / "whole")


@pytest.mark.slow  # a run whose folder goes away under it
def test_a_folder_removed_mid_run_is_one_line(tmp_path):
    out = tmp_path / "run"
    proc = start_script("fedavg.py", *TINY, "--rounds", "200", "--out", out)
    deadline = time.time() + 120
    while time.time() < deadline and not (out.joinpath("metrics.jsonl").exists() and metrics(out)):
        time.sleep(0.05)
    while out.exists():  # the run may be writing a temporary file into it as it goes
        shutil.rmtree(out, ignore_errors=True)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "Traceback" not in err, err[-2000:]
    assert err.strip().splitlines()[-1].startswith(f"fedavg.py: error: cannot write {out}/"), err[-500:]
    assert "No such file or directory" in err.strip().splitlines()[-1]


# ---- a damaged or code-carrying file is refused ---------------------------------------------------------
@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A 3-round run stopped after round 2: a checkpoint to damage and resume."""
    out = tmp_path_factory.mktemp("finished") / "run"
    run_script("fedavg.py", *FLAGS, "--out", out, "--stop-after", "2")
    return out


@pytest.mark.slow  # a resume per damage
@pytest.mark.parametrize("damage", ["cut", "garbage", "planted"])
def test_a_damaged_or_planted_checkpoint_is_refused_with_every_file_unchanged(damage, finished, tmp_path):
    out, marker = tmp_path / "run", tmp_path / "ran"
    shutil.copytree(finished, out)
    ckpt = (out / "checkpoint.pt").read_bytes()
    if damage == "cut":
        (out / "checkpoint.pt").write_bytes(ckpt[: len(ckpt) // 2])
    elif damage == "garbage":
        (out / "checkpoint.pt").write_bytes(ckpt[:100] + bytes(range(256)) * 40 + ckpt[100 + 256 * 40 :])
    else:
        plant(out / "checkpoint.pt", marker, lambda obj: {"round": 2, "rng": obj})
    before = files_of(out)
    line = one_line_error(run_script("fedavg.py", "--resume", out, check=False), 2)
    why = "it needs more than tensors and plain types" if damage == "planted" else "cut short or corrupt"
    assert line.startswith(f"fedavg.py: error: --resume: cannot load {out}/checkpoint.pt: {why}"), line
    assert files_of(out) == before and not marker.exists()


def test_a_planted_init_from_file_is_refused_and_runs_nothing(tmp_path):
    import anfr

    marker, path = tmp_path / "ran", tmp_path / "weights.pt"
    plant(path, marker, lambda obj: {"body.stem.0.weight": obj})
    model = common.build_model("mlp", argparse.Namespace(in_channels=3, num_classes=10, image_size=8))
    with pytest.raises(SystemExit) as e:
        anfr.load_pretrained(model, str(path), [2, 2, 2, 2])
    assert e.value.code == 2 and "--init-from: cannot load" in str(e.value) and "more than tensors" in str(e.value)
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["planted", "cut", "garbage"])
def test_a_damaged_image_folder_cache_runs_nothing_and_is_rebuilt(damage, tmp_path, capsys):
    """A cache that carries code, is cut short or is not a torch file: one line, the images decoded anew (the same
    tensors), the cache rewritten whole; nothing of the planted one runs."""
    from test_robustness import make_folder, read_folder

    make_folder(tmp_path / "ds", {"train": {"a": 2, "b": 2}, "test": {"a": 1, "b": 1}})
    read_folder(tmp_path / "ds")  # decoded and cached
    marker, cache = tmp_path / "ran", tmp_path / "ds" / ".cleanfl-cache.pt"
    # (A copy: the cache is read memory-mapped, and the damage below is written in place.)
    stamp, decoded = torch.load(cache)["stamp"], [t.clone() for t in read_folder(tmp_path / "ds")]
    if damage == "planted":
        plant(cache, marker, lambda obj: {"stamp": stamp, "tensors": obj})
    else:
        cache.write_bytes(cache.read_bytes()[: cache.stat().st_size // 2] if damage == "cut" else b"not a cache" * 9)
    again = read_folder(tmp_path / "ds")  # set aside with one line and decoded anew: the images are still there
    assert not marker.exists() and all(torch.equal(a, b) for a, b in zip(decoded, again))
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"note: {cache} is no cache this code can read (") and line.endswith("); building it anew")
    assert torch.load(cache, weights_only=True)["stamp"] == stamp  # rebuilt


def test_a_checkpoint_holds_tensors_and_plain_types_only(finished):
    """What Run writes loads with weights_only=True: the model's tensors, numpy's sampler state as plain types."""
    ckpt = torch.load(finished / "checkpoint.pt", weights_only=True)
    assert ckpt["round"] == 2 and all(torch.is_tensor(v) for v in ckpt["model"].values())
    assert ckpt["sampler"]["bit_generator"] == "PCG64" and ckpt["data"]["training images"] > 0
    with pytest.raises(pickle.UnpicklingError):  # and the safe load is a real one: it refuses an object
        torch.save({"x": argparse.Namespace()}, finished.parent / "object.pt")
        torch.load(finished.parent / "object.pt", weights_only=True)


# ---- one command, one set of numbers --------------------------------------------------------------------
ROOT_GROUPS = "4:cpu,cpuacct:/\n0::/\n"  # a container's view of its groups (v1's cpu controller, v2): the root


def parse_threads(argv, monkeypatch, cores=None, env=None, cgroup=None, torch_threads=None, groups=ROOT_GROUPS):
    """The default threads of `fedavg.py --dataset synthetic --device cpu ARGV`; on a machine of
    `cores` CPUs (None: this one's;
    0: a system without affinity, macOS or Windows) of which torch's own default counts `torch_threads` (None: all of
    them, no hardware threads), with only `env`'s OMP_NUM_THREADS (None: as it is), whose /sys/fs/cgroup is `cgroup`
    (a folder: faked; None: one with no CPU limit) and the process's /proc/self/cgroup `groups`."""
    if env is not None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
    if cores == 0:
        monkeypatch.delattr(os, "sched_getaffinity")
        monkeypatch.setattr(os, "cpu_count", lambda: 10)  # all the CPUs, which the default must not take
    elif cores is not None:
        monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(cores)))
    if cores is not None or torch_threads is not None:
        monkeypatch.setattr(common, "TORCH_THREADS", torch_threads or cores)
    real_open, cgroup = open, cgroup or "/nonexistent"

    def fake(path, *a, **k):
        return (
            io.StringIO(groups)
            if str(path) == "/proc/self/cgroup"
            else real_open(str(path).replace("/sys/fs/cgroup", str(cgroup)), *a, **k)
        )

    monkeypatch.setattr(common, "open", fake, raising=False)  # finish_args reads the cgroup files through it
    data = [] if "--resume" in argv else ["--dataset", "synthetic"]  # a resumed run's is its config.json's
    monkeypatch.setattr(sys, "argv", ["fedavg.py", *data, "--device", "cpu", *map(str, argv)])
    import fedavg

    return fedavg.parse_args().threads


@pytest.mark.parametrize(
    "cores,env,given,want",
    [
        (2, {}, [], 2),  # the CPU's default: one process of the cores' threads
        (8, {}, [], 8),
        (1, {}, [], 1),
        (8, {}, ["--threads", "1"], 1),  # a count given
        (8, {}, ["--threads", "4"], 4),
        (8, {"LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}, [], 1),  # under torchrun: its OMP_NUM_THREADS=1
        (8, {"WORLD_SIZE": "1"}, [], 8),  # torchrun of one process
        (8, {"OMP_NUM_THREADS": "3"}, [], 3),  # the user's OMP_NUM_THREADS
        (8, {"OMP_NUM_THREADS": "3"}, ["--threads", "4"], 4),  # --threads wins
        (8, {"OMP_NUM_THREADS": "4,2"}, [], 4),  # OpenMP's nested levels: the first
        (8, {"OMP_NUM_THREADS": "abc"}, [], 8),  # a value libgomp refuses (it says so): as OpenMP, the cores
        (8, {"OMP_NUM_THREADS": "0"}, [], 8),
    ],
)
def test_threads_are_the_machines_cores(cores, env, given, want, monkeypatch):
    """A function of the machine alone, never of its load: one command, one set of numbers."""
    monkeypatch.setattr(os, "getloadavg", lambda: pytest.fail("the thread count looked at the load"))
    assert parse_threads(given, monkeypatch, cores=cores, env=env) == want


def test_a_gpu_run_keeps_one_process_of_the_cores_threads(monkeypatch):
    """Off the CPU too, this process's CPU threads are the cores."""
    monkeypatch.setattr(common.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(common.torch.cuda, "device_count", lambda: 1)
    assert parse_threads(["--device", "cuda"], monkeypatch, cores=4, env={}) == 4


@pytest.mark.parametrize("threads", [1, 2])
def test_a_resumed_run_keeps_its_threads(threads, tmp_path, monkeypatch):
    """A run resumes at the threads it began with (config.json), whatever the machine's cores: its numbers unchanged."""
    (tmp_path / "config.json").write_text(json.dumps({"script": "fedavg", "rounds": 3, "threads": threads}))
    (tmp_path / "checkpoint.pt").write_bytes(b"")
    assert parse_threads(["--resume", tmp_path], monkeypatch, cores=4, env={}) == threads


@pytest.mark.parametrize(
    "cores,torch_threads,cgroup_cpus,want",
    [
        (16, 8, None, 8),  # 8 cores of two hardware threads (SMT): a process a core, as torch counts them
        (0, 8, None, 8),  # Apple silicon, 8 performance and 2 efficiency cores (no affinity): torch's 8
        (4, 16, None, 4),  # taskset -c 0-3 where torch counts the whole machine's cores (cpuinfo): the 4
        (16, 8, "300000 100000", 3),  # a CPU limit below torch's count: the limit
    ],
)
def test_threads_are_torchs_count_of_usable_cores(cores, torch_threads, cgroup_cpus, want, tmp_path, monkeypatch):
    """Hardware threads share a core's arithmetic units, and an efficiency core left with an equal share of every
    parallel loop is the one the others wait for: torch's default counts neither, and the default keeps to it."""
    if cgroup_cpus:
        (tmp_path / "cpu.max").write_text(cgroup_cpus)
    found = parse_threads([], monkeypatch, cores=cores, env={}, cgroup=tmp_path, torch_threads=torch_threads)
    assert found == want


@pytest.mark.parametrize(
    "files,env,want",
    [
        ({"cpu.max": "200000 100000\n"}, {}, 2),  # docker --cpus 2 (cgroup v2): 2 of the 8 cores' time
        ({"cpu.max": "150000 100000\n"}, {}, 2),  # 1.5 CPUs: to the nearest, half up (2 threads were faster)
        ({"cpu.max": "140000 100000\n"}, {}, 1),
        ({"cpu.max": "250000 100000\n"}, {}, 3),
        ({"cpu.max": "20000 100000\n"}, {}, 1),  # a fifth of a CPU: still one thread
        ({"cpu.max": "max 100000\n"}, {}, 8),  # no limit
        ({"cpu.max": "1600000 100000\n"}, {}, 8),  # more than the cores: the cores
        ({"cpu/cpu.cfs_quota_us": "400000\n", "cpu/cpu.cfs_period_us": "100000\n"}, {}, 4),  # cgroup v1
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, {}, 8),  # v1, no limit
        ({"cpu.max": "200000 100000\n"}, {"OMP_NUM_THREADS": "3"}, 3),  # the user's count wins
    ],
)
def test_threads_are_at_most_a_containers_cpu_limit(files, env, want, tmp_path, monkeypatch):
    """docker --cpus or a Kubernetes limit is a CPU-time quota, not fewer cores: the affinity still shows all 8."""
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    assert parse_threads([], monkeypatch, cores=8, env=env, cgroup=tmp_path) == want


USER = "user.slice/user-1000.slice"  # a user's slice (a shared login node may limit it), above each login's scope
SERVICE = "cpu/system.slice/train.service"  # a systemd service in cgroup v1's cpu hierarchy


@pytest.mark.parametrize(
    "groups,files,want",
    [
        (
            f"0::/{USER}/session-2.scope",
            {f"{USER}/cpu.max": "400000 100000", f"{USER}/session-2.scope/cpu.max": "max 100000"},
            4,
        ),
        ("0::/a.slice/b.scope", {"a.slice/cpu.max": "300000 100000", "a.slice/b.scope/cpu.max": "600000 100000"}, 3),
        ("0::/a.slice/b.scope", {"a.slice/cpu.max": "600000 100000", "a.slice/b.scope/cpu.max": "300000 100000"}, 3),
        (
            "4:cpu,cpuacct:/system.slice/train.service",
            {f"{SERVICE}/cpu.cfs_quota_us": "200000", f"{SERVICE}/cpu.cfs_period_us": "100000"},
            2,
        ),  # a service's CPUQuota= in cgroup v1
        # docker on cgroup v1: /proc names the host's group, the container sees its own as the root
        ("4:cpu,cpuacct:/docker/0123abcd", {"cpu/cpu.cfs_quota_us": "100000", "cpu/cpu.cfs_period_us": "100000"}, 1),
        ("3:cpuset:/few", {"cpu/few/cpu.cfs_quota_us": "100000", "cpu/few/cpu.cfs_period_us": "100000"}, 8),  # no cpu
    ],
)
def test_threads_are_at_most_the_cpu_limit_of_a_group_above(groups, files, want, tmp_path, monkeypatch):
    """A CPU limit may sit on a group above the process's own: systemd-run -p CPUQuota=, a service, a user slice."""
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text + "\n")
    assert parse_threads([], monkeypatch, cores=8, env={}, cgroup=tmp_path, groups=groups + "\n") == want


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5", ""])
def test_a_bad_threads_value_is_one_line(value, monkeypatch, capsys):
    with pytest.raises(SystemExit) as e:
        parse_threads(["--threads", value], monkeypatch)
    assert e.value.code == 2 and "--threads" in capsys.readouterr().err.strip().splitlines()[-1]


def test_a_folder_made_here_but_locked_first_by_another_run_is_kept(tmp_path, monkeypatch, capsys):
    """Two runs into a new --out: this one makes the folder, the other locks it first. This one is refused and must
    not remove the folder the other now holds: only a folder this run made and left empty goes, as the run ends."""

    def locked_by_another(fd, how):
        raise BlockingIOError

    monkeypatch.setattr(common, "_HELD", {})
    monkeypatch.setattr(common.fcntl, "flock", locked_by_another)
    args = argparse.Namespace(
        out=str(tmp_path / "run"), script="fedavg", dataset="synthetic", seed=0, resume=None, overwrite=False
    )
    with pytest.raises(SystemExit) as e:
        common.Run(args)
    assert e.value.code == 2 and "another run is using" in capsys.readouterr().err
    assert (tmp_path / "run").is_dir()
    monkeypatch.undo()
    monkeypatch.setattr(common, "_HELD", {})
    # There already: not made here, so never removed.
    assert common.take_folder(args) == (str(tmp_path / "run"), False)
    args = argparse.Namespace(**{**vars(args), "out": str(tmp_path / "new"), "device": "cpu", "threads": 1})
    with pytest.raises(SystemExit) as e:
        with common.Run(args):
            raise common.BadInput("--alpha: found bad while reading")
    # Made here and left empty: removed, and the bad input said in one line.
    assert e.value.code == 2 and not (tmp_path / "new").exists() and (tmp_path / "run").is_dir()
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.endswith(": error: --alpha: found bad while reading")

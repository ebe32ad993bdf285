"""torchrun: K processes (gloo on CPU) give the one-process run bit for bit, resume with another K,
and a failing rank stops the whole run with nothing half-written."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import ROOT, RUN_BATCH, assert_same_model, metrics, run_script, summary, wait_for_checkpoint
from test_common import write_folder

pytestmark = pytest.mark.slow  # torchrun: several processes per run (the fast tier leaves it out)

SYNTH = ["--dataset", "synthetic", "--device", "cpu", "--rounds", "3", "--save-model"]
# Each script with the method state that must travel between ranks: 5 sampled clients, so K = 2 and
# K = 3 leave a rank without a client in the last wave.
CASES = {
    "fedavg": [
        *SYNTH,
        "--model",
        "mlp",
        "--num-clients",
        "6",
        "--frac",
        "0.9",
        "--local-steps",
        "3",
        "--batch-size",
        "16",
        "--prox-mu",
        "0.01",
        "--client-test",
    ],
    "fedbabu": [
        *SYNTH,
        "--model",
        "convnet4-tiny",
        "--num-clients",
        "5",
        "--frac",
        "1",
        "--local-steps",
        "3",
        "--batch-size",
        "32",
        "--ft-epochs",
        "1",
        "--ft-eval-epochs",
        "0",
        "1",
        "--ft-lr",
        "0.001",
    ],
    "fedfn": [
        *SYNTH,
        "--model",
        "convnet4-tiny",
        "--num-clients",
        "5",
        "--frac",
        "1",
        "--local-steps",
        "3",
        "--batch-size",
        "32",
        "--agg",
        "scaffold",
        "--client-test",
        "--ft-epochs",
        "1",
    ],
    "fedln": [
        *SYNTH,
        "--model",
        "cnn",
        "--num-clients",
        "5",
        "--frac",
        "1",
        "--local-steps",
        "3",
        "--batch-size",
        "32",
        "--agg",
        "scaffold",
        "--norm",
        "fn",
    ],
    "fednnnn": [
        *SYNTH,
        "--model",
        "cnn6-narrow",
        "--num-clients",
        "5",
        "--frac",
        "1",
        "--local-steps",
        "3",
        "--batch-size",
        "32",
        "--eval-every",
        "2",
    ],
    "anfr": [
        *SYNTH,
        "--arch",
        "bn",
        "--depth",
        "18",
        "--width",
        "8",
        "--image-size",
        "16",
        "--num-clients",
        "5",
        "--frac",
        "1",
        "--alpha",
        "1.0",
        "--local-steps",
        "3",
        "--batch-size",
        "16",
        "--agg",
        "scaffold",
        "--pfl",
        "fedbn",
    ],
}
EXTRA = {  # other per-client state: FedEXP's norms, FedYogi's moments, DP-SGD's noise and step counts
    # the last of a flag wins
    "fedfn-fedexp": ("fedfn", [*CASES["fedfn"], "--agg", "fedexp", "--ft-epochs", "0", "--client-test"]),
    "fedln-fedyogi": ("fedln", [*CASES["fedln"], "--agg", "fedyogi"]),
    "anfr-dp": (
        "anfr",
        [*CASES["anfr"], "--agg", "fedavg", "--arch", "nf", "--dp-noise-multiplier", "1.0", "--pfl", "fedper"],
    ),
}
VOLATILE = ("wall_time_s", "elapsed_s", "processes", "device")
RESUMED = {"fedfn-2-3": ("fedfn", 2, 3), "anfr-3-2": ("anfr", 3, 2)}  # stopped under K, resumed under K'
# K = 3 as well for these (every case runs under K = 2, which already leaves rank 1 idle in a wave of 5 clients)
THREE_RANKS = ("fedavg", "fedavg-one-client", "fedln", "anfr")
# (resumed alone after torchrun: test_failing_rank_stops_every_rank_and_leaves_whole_files)


def torchrun_cmd(k, *args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(k), *map(str, args)]


def start(cmd, own_group=False, **env):  # own_group: its own process group, as a terminal's foreground job
    return subprocess.Popen(
        [str(a) for a in cmd],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},  # one thread per rank, as torchrun sets
        start_new_session=own_group,
    )


def finish(*procs):
    outs = [p.communicate() for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, f"{p.args[-2:]} exited {p.returncode}:\n{err[-4000:]}"
    return [out for out, _ in outs]


def batch(runs):
    return json.dumps([[str(a) for a in argv] for argv in runs])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case alone (k1), under torchrun with 2 ranks (k2; THREE_RANKS with 3 too, k3), the resume pairs:
    one process per K runs its whole list (tests/run_batch.py), so torch is imported once per rank."""
    tmp = tmp_path_factory.mktemp("torchrun")
    cases = {name: EXTRA.get(name, (name, CASES.get(name))) for name in [*CASES, *EXTRA]}
    cases["fedavg-one-client"] = ("fedavg", [*CASES["fedavg"], "--frac", "0.2"])  # 1 client a round: ranks idle
    # an image folder not yet cached, one copy per K: rank 0 decodes and caches it, the others wait and read
    cases["fedavg-folder"] = ("fedavg", [*CASES["fedavg"], "--dataset", "folder", "--data-dir", "{images}", "--iid"])
    for k in ("k1", "k2"):
        write_folder(tmp / f"images-{k}", per_class=20)

    def run(name, k, *more):
        return [
            f"{cases[name][0]}.py",
            *[str(f).replace("{images}", str(tmp / f"images-{k}")) for f in cases[name][1]],
            *more,
            "--out",
            tmp / name / k,
        ]

    for name, (script, _, _) in RESUMED.items():
        cases[name] = (script, [*CASES[script], "--rounds", "4", "--eval-every", "1"])
    alone = [run(name, "k1") for name in cases]
    by_k = {2: [run(name, "k2") for name in cases if name not in RESUMED], 3: [run(name, "k3") for name in THREE_RANKS]}
    for name, (_, first, _) in RESUMED.items():
        by_k[first].append(run(name, "resumed", "--stop-after", "2"))
    outs = finish(start([sys.executable, RUN_BATCH, batch(alone)]), start(torchrun_cmd(2, RUN_BATCH, batch(by_k[2]))))
    outs += finish(start(torchrun_cmd(3, RUN_BATCH, batch(by_k[3]))))
    stopped = {name: not (tmp / name / "resumed" / "summary.json").exists() for name in RESUMED}
    finish(
        *[
            start(torchrun_cmd(then, RUN_BATCH, batch([[f"{script}.py", "--resume", tmp / name / "resumed"]])))
            for name, (script, _, then) in RESUMED.items()
        ]
    )
    return tmp, outs, stopped


def assert_same_run(one, other):
    assert metrics(other) == metrics(one)

    def strip(d):
        return {k: v for k, v in summary(d).items() if k not in VOLATILE}

    assert strip(other) == strip(one)
    assert_same_model(one, other)


@pytest.mark.parametrize("case", [*CASES, *EXTRA, "fedavg-one-client", "fedavg-folder"])
def test_torchrun_equals_one_process(case, runs):
    """Metrics, summary and final model of 2 (and for some, 3) ranks equal those of one process, bit for bit."""
    tmp, _, _ = runs
    for k in (2, 3) if case in THREE_RANKS else (2,):
        assert summary(tmp / case / f"k{k}")["processes"] == k
        assert_same_run(tmp / case / "k1", tmp / case / f"k{k}")


def test_one_cache_of_a_new_image_folder(runs):
    tmp, _, _ = runs
    assert sorted(os.listdir(tmp / "images-k2")) == [".cleanfl-cache.pt", "test", "train"]  # no *.tmp left


def test_only_rank_0_prints(runs):
    _, outs, _ = runs
    assert outs[1].count("final test accuracy") == len(CASES) + len(EXTRA) + 2  # K = 2: rank 0's lines, not rank 1's
    assert outs[2].count("final test accuracy") == len(THREE_RANKS)  # K = 3: rank 0's


@pytest.mark.parametrize("case", RESUMED)
def test_resume_with_another_number_of_processes(case, runs):
    """Stopped after 2 of 4 rounds under K ranks, resumed under K' (3 after 2; 2 after 3): the one-process
    run from start to end. Per-client state (SCAFFOLD c_i, AdamW states, FedBN entries) is on every rank
    and in rank 0's checkpoint."""
    tmp, _, stopped = runs
    assert stopped[case]
    assert_same_run(tmp / case / "k1", tmp / case / "resumed")


FAIL_RANK = """import os, runpy, sys
sys.path.insert(0, os.getcwd())  # the repository root
import torch.distributed as dist
import common
train = common.client_batches
def failing(*a, **kw):  # rank 1 fails in round 3 (its first batch of that round)
    if dist.get_rank() == 1 and failing.calls >= 4:
        raise RuntimeError("injected failure on rank 1")
    failing.calls += 1
    return train(*a, **kw)
failing.calls = 0
common.client_batches = failing
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_failing_rank_stops_every_rank_and_leaves_whole_files(tmp_path):
    wrapper = tmp_path / "fail_rank.py"
    wrapper.write_text(FAIL_RANK)
    flags = [*CASES["fedavg"], "--rounds", "5", "--eval-every", "1"]
    out = tmp_path / "run"
    whole = start([sys.executable, "fedavg.py", *flags, "--out", tmp_path / "whole"])  # meanwhile, the reference
    proc = start(torchrun_cmd(2, wrapper, "fedavg.py", *flags, "--out", out))
    _, stderr = proc.communicate(timeout=300)
    finish(whole)
    assert proc.returncode != 0
    assert "injected failure on rank 1" in stderr  # the cause, from the failing rank
    assert "rank      : 1" in stderr  # torchrun's report names it
    assert not (out / "summary.json").exists() and not (out / "model.pt").exists()
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]
    rows = metrics(out)  # every line whole; the rounds before the failure (rank 1 fails in round 3)
    assert [r["round"] for r in rows] == [1, 2]
    ckpt = torch.load(out / "checkpoint.pt", weights_only=False)
    assert ckpt["round"] == 2
    # and the run can go on from there, alone, to the uninterrupted result
    run_script("fedavg.py", "--resume", out)
    assert_same_run(tmp_path / "whole", out)


INSPECT = """import atexit, hashlib, json, os, runpy, sys
sys.path.insert(0, os.getcwd())  # the repository root
import torch, torch.distributed as dist
import common
def threads_at_exit():  # registered first, so it runs last: after the script's destroy_process_group
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    with open(os.environ["INSPECT_OUT"] + os.environ["RANK"] + "-threads.json", "w") as f:
        json.dump(names, f)
if os.path.isdir("/proc/self/task"):  # Linux: a process's threads by name
    atexit.register(threads_at_exit)
trained, real = [], common.each_client
def each_client(clients, weights, train_client, seed, rnd):  # count the clients this rank trains
    def counted(k):
        trained.append([rnd, k])
        return train_client(k)
    return real(clients, weights, counted, seed, rnd)
common.each_client = each_client
sys.argv = sys.argv[1:]
g = runpy.run_path(sys.argv[0], run_name="__main__")
digest = lambda ts: hashlib.sha256(b"".join(t.detach().cpu().numpy().tobytes() for t in ts)).hexdigest()
c_local = [t for k in sorted(g["c_local"]) for t in g["c_local"][k].values()]
with open(os.environ["INSPECT_OUT"] + f"{dist.get_rank()}.json", "w") as f:  # a file per rank: no interleaved lines
    json.dump({"rank": dist.get_rank(), "trained": trained, "sampled": g["clients"],
               "model": digest(g["model"].state_dict().values()), "c_local": digest(c_local)}, f)
"""


def test_each_rank_trains_its_share_and_all_ranks_end_equal(tmp_path, monkeypatch):
    """Rank r trains the clients at positions r, r+K, ... of the sampled list, and no other (the
    speed-up); at the end every rank holds the same global model and the same SCAFFOLD c_i, and no gloo thread."""
    wrapper = tmp_path / "count_clients.py"  # (not inspect.py: that is a stdlib module torch imports)
    wrapper.write_text(INSPECT)
    flags = [*CASES["fedfn"], "--ft-epochs", "0", "--rounds", "2", "--frac", "1"]  # every client in every round
    monkeypatch.setenv("INSPECT_OUT", str(tmp_path / "rank"))  # start() passes the environment on
    proc = start(torchrun_cmd(2, wrapper, "fedfn.py", *flags, "--out", tmp_path / "run"))
    _, err = proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    rows = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}
    assert sorted(rows) == [0, 1]
    order = rows[0]["sampled"]  # the last round's sampled clients (all 5 here, in sampled order)
    assert sorted(order) == [0, 1, 2, 3, 4]
    for r in (0, 1):
        assert [k for rnd, k in rows[r]["trained"] if rnd == 1] == order[r::2]
        assert len(rows[r]["trained"]) == 2 * len(order[r::2])  # two rounds, nothing trained twice
    assert rows[0]["model"] == rows[1]["model"] and rows[0]["c_local"] == rows[1]["c_local"]
    # and the group is gone when the script ends: no gloo thread left to abort the exit (a group kept alive, e.g. by
    # torch.distributed.nn.functional's `group=WORLD` defaults bound after init, ends some runs "terminate called")
    for r in (0, 1) if os.path.isdir("/proc/self/task") else ():  # Linux: threads by name
        names = json.loads((tmp_path / f"rank{r}-threads.json").read_text())
        assert names and not [n for n in names if "gloo" in n], names  # (the main thread's name is the binary's)


BROADCAST = """import os, sys
sys.path.insert(0, os.getcwd())  # the repository root
import torch, torch.distributed as dist
import common
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
from client_result import result_of
dist.init_process_group("gloo")
rank, out = dist.get_rank(), sys.argv[1]
mine = result_of(rank)
for src in (0, 1):  # each rank's own result goes in, as each_client passes it; an idle rank passes None
    got = common._broadcast(mine if rank != 1 or src == 1 else None, src)
    torch.save({"got": got, "is_mine": got is mine}, os.path.join(out, f"rank{rank}_from{src}.pt"))
dist.destroy_process_group()
"""
CLIENT_RESULT = """import torch
def result_of(r):  # a client's result as the scripts return it: nested dicts, tuples and lists, tensors of
    g = torch.Generator().manual_seed(r)  # several dtypes (a transposed view, bfloat16), numbers, strings, None
    return {"loss": torch.tensor(0.5 + r, dtype=torch.float64),
            "state": {"w": torch.randn(3, 4, generator=g).t(), "steps": torch.tensor(7 + r),
                      "h": torch.randn(5, generator=g).to(torch.bfloat16)},
            "pair": (r, [1.5 * r, None, torch.arange(3) * (r + 1)]), "name": f"client {r}"}
"""


def assert_same_result(got, want, where="result"):
    """Bit for bit, the layout too (a tuple stays a tuple): compared here, not with common._map_leaves."""
    assert type(got) is type(want), (where, type(got), type(want))
    if isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for k in want:
            assert_same_result(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same_result(a, b, f"{where}[{i}]")
    elif torch.is_tensor(want):
        assert got.dtype == want.dtype and got.shape == want.shape and got.device.type == "cpu", where

        def bits(t):
            return t.contiguous().reshape(-1).view(torch.uint8)

        assert torch.equal(bits(got), bits(want)), where
        assert not got.requires_grad, where
    else:
        assert got == want, where


def run_with_client_results(tmp_path, name, script):
    """script, with client_result.py beside it, under torchrun on 2 ranks, writing into tmp_path/out. Returns that
    folder and the client_result module."""
    (tmp_path / "client_result.py").write_text(CLIENT_RESULT)
    (tmp_path / name).write_text(script)
    out = tmp_path / "out"
    out.mkdir()
    finish(start(torchrun_cmd(2, tmp_path / name, out)))
    spec = importlib.util.spec_from_file_location("client_result", tmp_path / "client_result.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return out, module


def test_broadcast_sends_a_results_bits_and_layout_to_every_rank(tmp_path):
    """common._broadcast under torchrun (gloo): every rank gets rank src's result with each tensor's bits, dtype and
    shape and the layout of dicts, tuples, lists, numbers, strings and None; rank src keeps its own object; a rank
    without a client (None) receives as the others do."""
    out, module = run_with_client_results(tmp_path, "broadcast.py", BROADCAST)
    result_of = module.result_of
    assert result_of(0)["state"]["w"].stride() != (4, 1)  # the transposed view really is not contiguous
    for rank in (0, 1):
        for src in (0, 1):
            saved = torch.load(out / f"rank{rank}_from{src}.pt", weights_only=False)
            assert_same_result(saved["got"], result_of(src), f"rank {rank} from {src}")
            assert saved["is_mine"] == (rank == src)  # the sender's own result, not a copy


EXCHANGE = """import os, sys
sys.path.insert(0, os.getcwd())  # the repository root
import torch, torch.distributed as dist
import common
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
from client_result import result_of
dist.init_process_group("gloo")
rank, out = dist.get_rank(), sys.argv[1]
# Unequal shares, as a round of 3 clients over 2 ranks gives them: rank 0 two results, rank 1 one.
mine = [result_of(rank), result_of(rank + 2)] if rank == 0 else [result_of(rank)]
torch.save(common.exchange(mine), os.path.join(out, f"rank{rank}.pt"))
dist.barrier()
dist.destroy_process_group()
"""


def test_exchange_gives_every_rank_every_result_bit_for_bit(tmp_path):
    """common.exchange under torchrun (gloo): each rank gets every rank's list of results, in rank order, each tensor
    with its bits, dtype and shape (a transposed view, bfloat16, 0-dim) and the layout of dicts, tuples, lists,
    numbers, strings and None, whatever the lists' lengths."""
    out, module = run_with_client_results(tmp_path, "exchange.py", EXCHANGE)
    want = [[module.result_of(0), module.result_of(2)], [module.result_of(1)]]
    for rank in (0, 1):
        got = torch.load(out / f"rank{rank}.pt", weights_only=False)
        assert_same_result(got, want, f"rank {rank}")


EVAL_SPLIT = """import json, os, sys
sys.path.insert(0, os.getcwd())  # the repository root
import torch, torch.distributed as dist
import torch.nn.functional as F
import common
if os.environ.get("WORLD_SIZE"):
    dist.init_process_group("gloo")
torch.manual_seed(0)  # the same model and data on every rank
y = torch.randint(0, 5, (1100,))
x = torch.randint(0, 256, (1100, 1, 4, 4), dtype=torch.uint8)
data = common.Data(x, y, x, y, 5, torch.full((1, 1, 1, 1), 0.5), torch.full((1, 1, 1, 1), 0.25))
net, seen = torch.nn.Linear(16, 5), []
forward = lambda xb: seen.append(len(xb)) or net(xb.flatten(1))
acc, loss, bacc = common.evaluate(forward, x, y, data, batch_size=200, balanced=True)  # 6 batches, the last 100
with open(f"{sys.argv[1]}{common.rank_and_world()[0]}.json", "w") as f:  # a file per rank: no interleaved lines
    json.dump({"seen": seen, "scores": [acc, loss, bacc]}, f)
if dist.is_initialized():  # leave together (a rank that exits with the group open aborts)
    dist.barrier()
    dist.destroy_process_group()
"""


def test_torchrun_splits_the_evaluation_and_matches_one_process(tmp_path):
    """Under torchrun rank r evaluates the batches r, r+K, ... and no other; every rank returns the one-process
    accuracy, loss and balanced accuracy bit for bit (the batches' float32 loss sums added in batch order)."""
    script = tmp_path / "eval_split.py"
    script.write_text(EVAL_SPLIT)
    finish(start([sys.executable, script, tmp_path / "alone"]), start(torchrun_cmd(2, script, tmp_path / "rank")))
    alone, ranks = (
        json.loads((tmp_path / "alone0.json").read_text()),
        [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)],
    )
    assert alone["seen"] == [200] * 5 + [100]
    assert ranks[0]["seen"] == [200] * 3 and ranks[1]["seen"] == [200, 200, 100]
    assert ranks[0]["scores"] == ranks[1]["scores"] == alone["scores"]  # JSON floats: every bit


def rank_frames(err):  # traceback lines that come from our code: torchrun's own report is all torch's frames
    return [line for line in err.splitlines() if line.strip().startswith('File "') and ROOT in line]


def ctrl_c_after_round_1(proc, out):  # SIGINT to the job's process group once round 1 is checkpointed
    import signal

    wait_for_checkpoint(out)
    os.killpg(proc.pid, signal.SIGINT)
    return proc.communicate(timeout=120)


def test_torchrun_bad_flag_refusal_and_ctrl_c_are_one_line_each(tmp_path):
    """Under torchrun: a bad flag is printed once; a job into a run folder in use is refused in one line and its
    other rank exits quietly (no rank prints a traceback: what follows is torchrun's own report); Ctrl-C to the job
    (SIGINT to its process group, as a terminal sends it) prints the --resume line once, finishes the round, and
    --resume under torchrun ends as the uninterrupted one-process run."""
    import fcntl

    held = tmp_path / "held"  # a run folder in use: locked as a running run locks its folder
    held.mkdir()
    fcntl.flock(lock := os.open(held, os.O_RDONLY), fcntl.LOCK_EX | fcntl.LOCK_NB)
    flags, out = [*CASES["fedavg"], "--local-steps", "1", "--rounds", "40"], tmp_path / "run"
    bad, second = (
        start(torchrun_cmd(2, "fedavg.py", "--lr", "-1")),
        start(torchrun_cmd(2, "fedavg.py", *flags, "--out", held)),
    )
    whole = start([sys.executable, "fedavg.py", *flags, "--out", tmp_path / "whole"])  # meanwhile, the reference
    stdout, err = ctrl_c_after_round_1(start(torchrun_cmd(2, "fedavg.py", *flags, "--out", out), True), out)
    assert not rank_frames(err) and "Traceback" not in stdout, err[-3000:]
    said = "SIGINT: finishing this round, then a checkpoint (again: at once); continue with: python fedavg.py --resume"
    assert stdout.count(f"{said} {out}\n") == 1 and stdout.count("--resume") == 1, stdout[-1000:] + err[-3000:]
    assert 1 <= len(metrics(out)) < 40 and not (out / "summary.json").exists()
    _, err = bad.communicate(timeout=120)
    assert bad.returncode != 0 and err.count("error: --lr: must be > 0, got -1") == 1 and not rank_frames(err), err
    _, err = second.communicate(timeout=120)
    os.close(lock)
    assert second.returncode != 0 and not rank_frames(err), err[-3000:]
    assert err.count(f"fedavg.py: error: --out: another run is using {held} now") == 1, err[-3000:]
    assert "fedavg.py: error" not in err.replace(f"fedavg.py: error: --out: another run is using {held} now", "")
    finish(start(torchrun_cmd(2, "fedavg.py", "--resume", out)), whole)
    assert_same_run(tmp_path / "whole", out)


def test_torchrun_killing_its_ranks_mid_round_leaves_the_line_and_the_last_checkpoint(tmp_path):
    """torchrun SIGKILLs its ranks a grace after passing them a stop (30 s; here TORCH_ELASTIC_SHUTDOWN_TIMEOUT=1),
    which a long round outlasts: the --resume line, printed at the signal, is there once; the round is lost, the
    checkpoint of the one before stands, and --resume under torchrun ends as the uninterrupted run."""
    flags, out = [*CASES["fedavg"], "--local-steps", "300", "--rounds", "3"], tmp_path / "run"  # rounds of 3-5 s idle
    whole = start([sys.executable, "fedavg.py", *flags, "--out", tmp_path / "whole"])
    proc = start(torchrun_cmd(2, "fedavg.py", *flags, "--out", out), True, TORCH_ELASTIC_SHUTDOWN_TIMEOUT="1")
    stdout, err = ctrl_c_after_round_1(proc, out)
    assert not rank_frames(err) and stdout.count(f"continue with: python fedavg.py --resume {out}\n") == 1, err[-3000:]
    assert len(metrics(out)) == torch.load(out / "checkpoint.pt", weights_only=False)["round"] == 1  # round 2: cut
    assert sorted(os.listdir(out)) == ["checkpoint.pt", "config.json", "metrics.jsonl", "partition.json"]
    finish(start(torchrun_cmd(2, "fedavg.py", "--resume", out)), whole)
    assert_same_run(tmp_path / "whole", out)


def test_under_torchrun_only_rank_0_tracks(tmp_path):
    """--track tensorboard under torchrun: one event file, each round once, equal to metrics.jsonl."""
    from test_tracking import same_as_tensorboard, tensorboard_rows

    out = tmp_path / "run"
    finish(start(torchrun_cmd(2, "fedavg.py", *CASES["fedavg"], "--track", "tensorboard", "--out", out)))
    assert len(os.listdir(out / "tensorboard")) == 1
    by_round, steps = tensorboard_rows(out)
    rows = metrics(out)
    assert steps == [r["round"] for r in rows] == [1, 2, 3]
    assert all(same_as_tensorboard(r, by_round[r["round"]]) for r in rows)

"""Fast tests of the reproduction tooling: benchmarks/collect.py on hand-made run folders,
and benchmarks/reproduce/*.sh (bash -n, and every command's flags accepted by its script's parser,
called in-process on a tiny fake image folder). Seconds, no training."""

import argparse
import importlib
import json
import os
import shlex
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import collect  # noqa: E402
from helpers import stand_in_folder  # noqa: E402

REPRO = os.path.join(ROOT, "benchmarks", "reproduce")
CLAIM_SCRIPTS = ["fedfn", "fedbabu", "fedln", "fednnnn", "anfr"]


# ---------------------------------------------------------------------------------------------
# collect.py on hand-made run folders
# ---------------------------------------------------------------------------------------------
def make_run(
    root, claim, variant, seed, accs, summary_extra=None, config=None, command=True, finished=True, script="fedln"
):
    """root/claim/variant/seed<k> with metrics.jsonl (one row per accuracy in accs, rounds 1..n),
    summary.json (final row's test_acc) and config.json."""
    d = os.path.join(root, claim, variant, f"seed{seed}")
    os.makedirs(d)
    with open(os.path.join(d, "metrics.jsonl"), "w") as f:
        for i, a in enumerate(accs):
            f.write(json.dumps({"round": i + 1, "test_acc": a, "test_loss": 1.0, "elapsed_s": i}) + "\n")
    cfg = config or {
        "dataset": "folder",
        "data_dir": "/data/cifar10",
        "model": "normcnn",
        "rounds": len(accs),
        "seed": seed,
        "data_seed": seed,
        "out": d,
        "lr": 0.01,
        "iid": False,
        "lr_decay_at": [0.5, 0.75],
    }
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    if command:
        with open(os.path.join(d, "command.txt"), "w") as f:
            f.write(
                f'python {script}.py --dataset folder --data-dir "$DATA_DIR" --norm {variant} --seed {seed} --out {d}\n'
            )
    if finished:
        summary = {
            "final_round": len(accs),
            "test_acc": accs[-1],
            "wall_time_s": 60.0 * (seed + 1),
            "device": "cpu (x86_64, 2 threads)",
            "torch": "2.4.0",
            "script": script,
            **(summary_extra or {}),
        }
        with open(os.path.join(d, "summary.json"), "w") as f:
            json.dump(summary, f)
    return d


def rows(lines):
    """variant -> list of cells of the markdown table rows."""
    out = {}
    for line in lines:
        if line.startswith("| ") and not line.startswith("| variant"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            out[cells[0]] = cells
    return out


def test_exact_mean_std_final_round_and_grouping(tmp_path):
    root = str(tmp_path)
    # ln: best round (0.9) is never the final one; finals 0.5, 0.6, 0.7
    make_run(root, "fedln-small", "ln", 0, [0.9, 0.5])
    make_run(root, "fedln-small", "ln", 1, [0.2, 0.95, 0.6])
    make_run(root, "fedln-small", "ln", 2, [0.7])
    make_run(root, "fedln-small", "vanilla", 0, [0.1, 0.3])
    make_run(root, "fedln-small", "vanilla", 1, [0.4, 0.2])
    found = collect.gather(root)
    assert set(found) == {("fedln", "small")}
    assert set(found[("fedln", "small")]) == {"ln", "vanilla"}
    r = rows(collect.table("fedln", "small", found[("fedln", "small")]))
    finals = [0.5, 0.6, 0.7]
    mean, std = np.mean(finals), np.std(finals, ddof=1)
    assert r["ln"][1] == f"{100 * mean:.2f} ± {100 * std:.2f}" == "60.00 ± 10.00"
    assert r["ln"][2] == "78.04 (T10), 77.71 (T4)"  # the paper's number beside it
    assert r["ln"][3].startswith("3 (0, 1, 2)")
    assert r["ln"][4] == "2.0"  # mean wall time: (1 + 2 + 3) / 3 minutes
    assert r["ln"][5] == "cpu (x86_64, 2 threads)" and r["ln"][6] == "2.4.0"
    assert "--norm ln" in r["ln"][7] and "--seed" not in r["ln"][7] and '"$DATA_DIR"' in r["ln"][7]
    assert r["vanilla"][1] == "25.00 ± 7.07"  # finals 0.3 and 0.2, not the best 0.4
    # display order follows the claim (ln before vanilla), then unknown variants
    table = collect.table("fedln", "small", found[("fedln", "small")])
    assert [row.split("|")[1].strip() for row in table if row.startswith("| ") and "variant" not in row] == [
        "ln",
        "vanilla",
    ]


def test_final_accuracy_prefers_summary_then_final_metrics_row(tmp_path):
    d = make_run(str(tmp_path), "x-small", "a", 0, [0.8, 0.4])
    run = collect.load_run(d)
    assert collect.final_accuracy(run) == 0.4
    del run["summary"]["test_acc"]
    assert collect.final_accuracy(run) == 0.4  # last metrics row, which is the final round
    run["summary"]["final_round"] = 5  # the log stops before the final round: no number rather than a wrong one
    assert collect.final_accuracy(run) is None


def test_one_seed_has_no_std_unfinished_and_diverged_left_out(tmp_path):
    root = str(tmp_path)
    make_run(root, "fedln-paper", "ln", 0, [0.5, 0.75])
    make_run(root, "fedln-paper", "ln", 1, [0.5], finished=False)
    make_run(root, "fedln-paper", "ln", 2, [0.1], summary_extra={"diverged": True, "round": 1})
    lines = collect.table("fedln", "paper", collect.gather(root)[("fedln", "paper")])
    r = rows(lines)
    assert r["ln"][1] == "75.00"  # one finished, non-diverged seed: no std
    assert r["ln"][3] == "1 (0) + 1 diverged"
    text = "\n".join(lines)
    assert "unfinished" in text and "seed1" in text and "diverged at round 1" in text


def test_fedbabu_and_fednnnn_columns(tmp_path):
    root = str(tmp_path)
    for seed, pers in [(0, 0.7), (1, 0.8)]:
        make_run(
            root,
            "fedbabu-small",
            "fedbabu",
            seed,
            [0.3, 0.2],
            script="fedbabu",
            summary_extra={
                "pers_acc_mean": pers,
                "init_acc_mean": 0.1,
                "nohead_acc_mean": 0.5,
                "pers_acc_mean_by_epoch": {"0": 0.1, "1": 0.6, "2": 0.65, "5": pers, "10": 0.9},
            },
        )
    r = rows(collect.table("fedbabu", "small", collect.gather(root)[("fedbabu", "small")]))
    assert r["fedbabu"][1:3] == ["75.00 ± 7.07", "76.25 (T13)"]
    assert r["fedbabu"][3:5] == ["10.00 ± 0.00", "62.68 (T12)"]
    assert r["fedbabu"][7:10] == ["60.00 ± 0.00", "65.00 ± 0.00", "90.00 ± 0.00"]
    # at 1/4 and 1/2 of the rounds: the last evaluation at or before that round
    make_run(root, "fednnnn-small", "fednnnn", 0, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8], script="fednnnn")
    r = rows(collect.table("fednnnn", "small", collect.gather(root)[("fednnnn", "small")]))
    assert r["fednnnn"][1:5] == ["80.00", "76.7", "20.00", "40.00"]
    assert r["fednnnn"][5] == "60.00"  # the mean of the last five evaluations: 0.4 ... 0.8
    make_run(root, "fednnnn-small", "fednnnn", 1, [0.1, 0.2, 0.3, 0.4], script="fednnnn")  # fewer than five: none
    r = rows(collect.table("fednnnn", "small", collect.gather(root)[("fednnnn", "small")]))
    assert r["fednnnn"][5] == "60.00"


def test_variant_order_puts_controls_after_the_papers_variants():
    found = dict.fromkeys(["zzz", "anfr-iid", "bn", "anfr", "bn-iid", "nf"])
    assert collect.variant_order(collect.CLAIMS["anfr"], found) == ["bn", "nf", "anfr", "bn-iid", "anfr-iid", "zzz"]


def test_rebuilt_command_from_config(tmp_path):
    d = make_run(str(tmp_path), "fedln-small", "ln", 3, [0.5], command=False)
    cmd = collect.command_of(collect.load_run(d))
    assert cmd.startswith("python fedln.py ")
    assert '--data-dir "$DATA_DIR"' in cmd and "--lr-decay-at 0.5 0.75" in cmd and "--lr 0.01" in cmd
    assert "--seed" not in cmd and "--out" not in cmd and "--data-seed" not in cmd and "--iid" not in cmd


def test_collect_main_prints_all_claims(tmp_path, capsys):
    root = str(tmp_path)
    make_run(root, "fedln-small", "ln", 0, [0.5])
    make_run(root, "fedfn-s2-small", "fedfn", 0, [0.5], script="fedfn")
    make_run(root, "fedfn-s2-paper", "fedfn", 0, [0.6], script="fedfn")
    assert collect.main([root]) == 0
    out = capsys.readouterr().out
    assert out.index("fedfn.md Table 1") < out.index("fedln.md")  # claims in issue order
    assert "[small]" in out and "[paper]" in out and "77.77" in out
    assert collect.main([root, "--claim", "fedln"]) == 0
    assert "fedfn" not in capsys.readouterr().out
    assert collect.main([str(tmp_path / "empty")]) == 1


def test_trace_means_over_seeds_per_round_and_last_quarter_change(tmp_path, capsys):
    root = str(tmp_path)
    for seed, norms in [(0, [1.0, 2.0, 3.0, 4.0]), (1, [3.0, 4.0, 5.0, 8.0])]:
        d = make_run(root, "fedfn-s2-proxy", "fedfn", seed, [0.1, 0.2, 0.3, 0.4], script="fedfn")
        with open(os.path.join(d, "metrics.jsonl"), "w") as f:  # rounds 10, 20, 30, 40
            for i, n in enumerate(norms):
                f.write(json.dumps({"round": 10 * (i + 1), "test_acc": 0.1, "head_row_norm": n}) + "\n")
    make_run(root, "fedfn-s2-proxy", "fedavg", 0, [0.1], script="fedfn")  # never logged the key: no column
    lines = collect.trace(collect.gather(root)[("fedfn-s2", "proxy")], collect.CLAIMS["fedfn-s2"], "head_row_norm")
    table = [line for line in lines if line.startswith("| ")]
    assert table[0] == "| round | fedfn |"
    assert table[1:] == ["| 10 | 2 |", "| 20 | 3 |", "| 30 | 4 |", "| 40 | 6 |"]  # means over the two seeds
    # last quarter of 40 rounds: from round 30 (the last evaluation at or before 30) to 40: 4 -> 6, +50%
    assert "- fedfn: head_row_norm 4 at round 30 -> 6 at round 40 (+50.0% in the last quarter)" in lines
    assert collect.main([root, "--trace", "head_row_norm"]) == 0
    assert "| 40 | 6 |" in capsys.readouterr().out


def test_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch, capsys):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *a, **k)

    plot = importlib.import_module("plot")
    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert plot.main([str(tmp_path), "--out", str(tmp_path / "docs")]) == 1
    assert "pip install -r benchmarks/requirements.txt" in capsys.readouterr().err


def test_plot_curves_mean_over_seeds(tmp_path):
    plot = importlib.import_module("plot")
    root = str(tmp_path)
    make_run(root, "fedln-small", "ln", 0, [0.2, 0.4])
    make_run(root, "fedln-small", "ln", 1, [0.4, 0.6])
    rounds, mean, std, n = plot.curves(os.path.join(root, "fedln-small"))["ln"]
    assert list(rounds) == [1, 2] and np.allclose(mean, [30, 50]) and n == 2
    assert np.allclose(std, [np.std([20, 40], ddof=1)] * 2)
    pytest.importorskip("matplotlib")
    assert plot.main([root, "--out", str(tmp_path / "docs")]) == 0  # the old form
    assert os.path.getsize(tmp_path / "docs" / "fedln-small.png") > 0
    assert plot.main(["claims", root, "--out", str(tmp_path / "d2"), "--claim", "fedln"]) == 0
    assert os.listdir(tmp_path / "d2") == ["fedln-small.png"]


def test_plot_cli_modes_and_the_old_form():
    plot = importlib.import_module("plot")
    a = plot.parse([])  # the old form: claims mode on runs/reproduce
    assert (a.command, a.root, a.out, a.claim) == ("claims", os.path.join("runs", "reproduce"), "docs", None)
    a = plot.parse(["benchmarks/results", "--out", "d", "--claim", "fedln"])
    assert (a.command, a.root, a.out, a.claim) == ("claims", "benchmarks/results", "d", "fedln")
    assert plot.parse(["claims", "runs"]).root == "runs"  # a RUNS_DIR named like a subcommand
    a = plot.parse(["runs", "x", "y", "--mean-seeds"])
    assert (a.command, a.folders, a.mean_seeds) == ("runs", ["x", "y"], True)
    a = plot.parse(["partition", "x", "--split", "test"])
    assert (a.command, a.path, a.split) == ("partition", "x", "test")
    with pytest.raises(SystemExit) as e:
        plot.parse(["runs"])  # no run folder
    assert e.value.code == 2


def test_plot_fn_growth_draws_a_panel_per_trace_and_a_line_per_client(tmp_path):
    pytest.importorskip("matplotlib")
    plot = importlib.import_module("plot")
    trace = {"round": 3, "lr": 0.03, "clients": [
        {"client": 4, "samples": 9, "top_share": 0.9, "trace": [[1.0, 13.0], [2.0, 13.1], [4.0, 13.2]]},
        {"client": 7, "samples": 5, "trace": [[3.0, 13.0], [2.5, 13.0]]},
    ]}  # fmt: skip
    other = {"round": 3, "lr": 0.01, "clients": [{"client": 4, "samples": 9, "trace": [[5.0, 1.0], [6.0, 1.0]]}]}
    (tmp_path / "fedfn.json").write_text(json.dumps(trace))
    (tmp_path / "fedavg.json").write_text(json.dumps(other))
    panels = []  # the figure is drawn for real; its lines are read back from its axes

    def keep(a, plt):
        out = plot.plot_fn_growth(a, plt)
        for ax in plt.gcf().axes:
            panels.append((ax.get_title().split(":")[0], [line.get_ydata().tolist() for line in ax.get_lines()]))
        return out

    paths = [str(tmp_path / "fedfn.json"), str(tmp_path / "fedavg.json")]
    a = plot.parse(["fn-growth", *paths, "--out", str(tmp_path / "g.png")])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    assert keep(a, plt) == 0 and (tmp_path / "g.png").stat().st_size > 1000
    assert panels == [("fedfn", [[1.0, 2.0, 4.0], [3.0, 2.5]]), ("fedavg", [[5.0, 6.0]])]


@pytest.mark.parametrize("content", [None, "{not json", '{"round": 3}', "[1, 2]"])
def test_plot_fn_growth_refuses_a_missing_or_foreign_trace(tmp_path, content, capsys):
    pytest.importorskip("matplotlib")
    plot = importlib.import_module("plot")
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps({"round": 1, "lr": 0.1, "clients": []}))
    if content is not None:
        bad.write_text(content)
    a = plot.parse(["fn-growth", str(good), str(bad), "--out", str(tmp_path / "g.png")])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    assert plot.plot_fn_growth(a, plt) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"plot.py fn-growth: JSON {bad}: ") and err.count("\n") == 1
    assert not (tmp_path / "g.png").exists()  # nothing drawn


def write_run(d, config, script=None, accs=(), losses=()):
    os.makedirs(d)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(d, "metrics.jsonl"), "w") as f:
        for i, a in enumerate(accs):
            f.write(json.dumps({"round": i + 1, "test_acc": a, "train_loss": losses[i] if losses else 1.0}) + "\n")
    if script:
        with open(os.path.join(d, "summary.json"), "w") as f:
            json.dump({"script": script}, f)
    return d


def test_plot_runs_labels_name_script_and_differing_flags(tmp_path, capsys):
    plot = importlib.import_module("plot")
    base = {
        "dataset": "folder",
        "data_dir": "/x",
        "shards": 2,
        "alpha": None,
        "lr": 0.03,
        "seed": 0,
        "data_seed": 0,
        "lr_decay_at": [0.5, 0.75],
        "iid": False,
    }
    # fedfn with FN, fedfn --no-fn at another lr, fedavg (no "fn" flag at all) with --iid in place of --shards;
    # the script comes from summary.json, command.txt, or the default folder name <script>__...
    a = write_run(str(tmp_path / "a"), {**base, "fn": True, "out": "a"}, script="fedfn", accs=[0.1, 0.3])
    b = write_run(str(tmp_path / "b"), {**base, "fn": False, "lr": 0.01, "out": "b"}, accs=[0.2, 0.4])
    with open(os.path.join(b, "command.txt"), "w") as f:
        f.write("python fedfn.py --no-fn --lr 0.01\n")
    c = write_run(
        str(tmp_path / "fedavg__folder__0__2026"), {**base, "shards": None, "iid": True, "out": "c"}, accs=[0.5]
    )
    runs = [plot.load_run(d) for d in plot.find_runs([a, b, c])]
    assert [r["script"] for r in runs] == ["fedfn", "fedfn", "fedavg"]
    assert plot.labels(runs) == [
        "fedfn --shards 2 --lr 0.03",
        "fedfn --shards 2 --lr 0.01 --no-fn",
        "fedavg --lr 0.03 --iid",
    ]
    assert plot.shared_settings(runs) == "shared: --dataset folder"
    # two seeds of two configurations: --mean-seeds makes two lines, each the mean over its seeds
    root = tmp_path / "results"
    for lr in (0.01, 0.03):
        for seed, accs in [(0, [0.2, 0.4]), (1, [0.4, 0.8])]:
            write_run(
                str(root / f"lr{lr}" / f"seed{seed}"),
                {**base, "lr": lr, "seed": seed, "data_seed": seed},
                script="fedavg",
                accs=[x * lr * 100 for x in accs],
            )
    runs = [plot.load_run(d) for d in plot.find_runs([str(root)])]  # a folder without config.json: the runs below it
    assert len(runs) == 4
    assert plot.labels(runs) == [
        "fedavg --lr 0.01 --seed 0",
        "fedavg --lr 0.01 --seed 1",
        "fedavg --lr 0.03 --seed 0",
        "fedavg --lr 0.03 --seed 1",
    ]
    groups = plot.group_seeds(runs)
    assert [(name, len(rs)) for name, rs in groups] == [
        ("fedavg --lr 0.01 (2 seeds)", 2),
        ("fedavg --lr 0.03 (2 seeds)", 2),
    ]
    rounds, mean, std = plot.mean_band(plot.series(groups[1][1], "test_acc"))
    # percent: mean of 0.6/1.2, 1.2/2.4
    assert list(rounds) == [1, 2] and np.allclose(mean, [100 * 3 * 0.3, 100 * 3 * 0.6])
    assert np.allclose(std, [np.std([60, 120], ddof=1), np.std([120, 240], ddof=1)])
    assert plot.main(["runs", str(tmp_path / "empty")]) == 2  # not a folder: one line, exit 2
    assert "not a folder" in capsys.readouterr().err
    pytest.importorskip("matplotlib")
    assert plot.main(["runs", a, b, c, "--out", str(tmp_path / "cmp.png")]) == 0
    assert plot.main(["runs", str(root), "--mean-seeds", "--out", str(tmp_path / "seeds.png")]) == 0
    assert os.path.getsize(tmp_path / "cmp.png") > 0 and os.path.getsize(tmp_path / "seeds.png") > 0


def test_plot_runs_refuses_more_lines_than_max_runs(tmp_path, capsys):
    """A parent folder of many runs is refused in one line naming --max-runs (it drew a 1320 x 19512 px legend);
    --mean-seeds counts configurations, and --max-runs raises the limit."""
    import types

    plot = importlib.import_module("plot")
    root = tmp_path / "results"
    for k in range(7):  # 7 learning rates x 2 seeds: 14 runs, 7 configurations
        for seed in (0, 1):
            write_run(str(root / f"lr{k}" / f"seed{seed}"), {"lr": k, "seed": seed}, script="fedavg", accs=[0.5])
    png = tmp_path / "runs.png"

    class Drawing(Exception):  # plot_runs got past its checks to the figure
        pass

    def subplots(*a, **k):
        raise Drawing

    plt = types.SimpleNamespace(subplots=subplots)  # matplotlib is optional: the checks need none
    for flags, refused in [([], True), (["--max-runs", "13"], True), (["--max-runs", "14"], False),
                           (["--mean-seeds"], False), (["--mean-seeds", "--max-runs", "6"], True)]:  # fmt: skip
        a = plot.parse(["runs", str(root), "--out", str(png), *flags])
        if refused:
            assert plot.plot_runs(a, plt) == 2, flags
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and "--max-runs" in err and str(root) in err, err
            assert ("7 configurations" if "--mean-seeds" in flags else "14 runs") in err, err
            assert not png.exists()
        else:
            with pytest.raises(Drawing):
                plot.plot_runs(a, plt)
    assert plot.parse(["runs", "x"]).max_runs == 12
    for bad in ("0", "-1", "two"):
        with pytest.raises(SystemExit) as e:
            plot.parse(["runs", "x", "--max-runs", bad])
        assert e.value.code == 2 and "--max-runs" in capsys.readouterr().err
    pytest.importorskip("matplotlib")
    assert plot.main(["runs", str(root), "--max-runs", "14", "--out", str(png)]) == 0 and png.stat().st_size > 0
    assert plot.main(["runs", str(root), "--mean-seeds", "--out", str(tmp_path / "seeds.png")]) == 0


def test_plot_usage_and_help_list_every_subcommand(capsys):
    plot = importlib.import_module("plot")
    usage = plot.parser().format_usage()
    with pytest.raises(SystemExit) as e:
        plot.parse(["--help"])
    assert e.value.code == 0
    helped = capsys.readouterr().out
    for command in ("claims", "runs", "partition", "fn-growth"):
        assert command in usage and f"    {command} " in helped, (command, usage)
    assert "{claims,runs,partition,fn-growth}" in usage


def test_plot_partition_reads_what_run_writes(tmp_path, capsys):
    """partition.json as common.Run.start writes it -> the clients x classes count matrix."""
    import types
    import torch
    import common

    plot = importlib.import_module("plot")
    labels = torch.tensor([0, 0, 1, 2, 2, 2, 1, 0])
    part = common.Partition(
        train=[torch.tensor([0, 1, 2]), torch.tensor([3, 4, 5, 6, 7])], test=None, scheme="shards=2"
    )
    data = types.SimpleNamespace(y_train=labels, y_test=labels, num_classes=3, classes=None, fingerprint={})
    run_dir = tmp_path / "run"
    args = argparse.Namespace(resume=None, model="mlp", out=str(run_dir), seed=0, script="fedavg", device="cpu",
                              overwrite=False, threads=1)  # fmt: skip
    common.Run(args).start(torch.nn.Linear(2, 3), part, data)  # the run folder, config.json, partition.json
    capsys.readouterr()  # the start-up line
    counts, scheme, names, _ = plot.load_partition(str(run_dir))
    assert counts.tolist() == [[2, 1, 0], [1, 1, 3]] and scheme == "shards=2" and names == ["0", "1", "2"]
    assert plot.load_partition(str(run_dir / "partition.json"))[0].tolist() == counts.tolist()
    # class names: the image folder's sorted class folders, when config.json names one
    for c in ("cat", "ant", "bee"):
        os.makedirs(tmp_path / "img" / "train" / c)
    with open(run_dir / "config.json", "w") as f:
        json.dump({"dataset": "folder", "data_dir": str(tmp_path / "img")}, f)
    assert plot.load_partition(str(run_dir))[2] == ["ant", "bee", "cat"]
    assert plot.main(["partition", str(run_dir), "--split", "test"]) == 2  # no --client-test counts
    assert plot.main(["partition", str(tmp_path)]) == 2  # no partition.json
    assert "no partition.json" in capsys.readouterr().err
    pytest.importorskip("matplotlib")
    assert plot.main(["partition", str(run_dir), "--out", str(tmp_path / "p.png")]) == 0
    assert os.path.getsize(tmp_path / "p.png") > 0


# ---------------------------------------------------------------------------------------------
# benchmarks/reproduce/*.sh
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", CLAIM_SCRIPTS + ["lib"])
def test_reproduce_script_syntax(name):
    subprocess.run(["bash", "-n", os.path.join(REPRO, f"{name}.sh")], check=True)


def dry_run(name, scale, **env):
    res = subprocess.run(
        ["bash", os.path.join(REPRO, f"{name}.sh"), scale],
        capture_output=True,
        text=True,
        env={**os.environ, "DRY_RUN": "1", **env},
        check=True,
    )
    return [shlex.split(line) for line in res.stdout.splitlines()]


@pytest.fixture(scope="module")
def fake_folder(tmp_path_factory):
    """A CIFAR-10-shaped image folder with one image per class: finish_args only looks at the class folders."""
    return stand_in_folder(tmp_path_factory.mktemp("cifar10") / "data")


def parse_in_process(argv, monkeypatch):
    """argv = ["python", "x.py", flags...] -> x.parse_args() with sys.argv set to it."""
    module = importlib.import_module(os.path.splitext(argv[1])[0])
    monkeypatch.setattr(sys, "argv", [argv[1], *argv[2:]])
    return module.parse_args()


@pytest.mark.parametrize("scale", ["small", "paper"])
@pytest.mark.parametrize("name", CLAIM_SCRIPTS)
def test_reproduce_commands_parse(name, scale, fake_folder, monkeypatch):
    monkeypatch.chdir(ROOT)
    commands = dry_run(name, scale)
    assert commands, f"{name}.sh {scale} printed no command"
    outs = set()
    for argv in commands:
        assert argv[0] == "python" and argv[1] in {f"{m}.py" for m in CLAIM_SCRIPTS}
        assert argv[argv.index("--data-dir") + 1] == "$DATA_DIR"
        argv = [fake_folder if a == "$DATA_DIR" else a for a in argv]
        try:
            args = parse_in_process(argv, monkeypatch)
        except SystemExit as e:  # argparse error: the message is on stderr
            pytest.fail(f"{name}.sh {scale}: {' '.join(argv[1:])} rejected by the parser (exit {e.code})")
        assert args.dataset == "folder" and args.data_dir == fake_folder
        out = args.out.split("/")
        assert out[:2] == ["runs", "reproduce"] and out[2].endswith("-" + scale) and out[4] == f"seed{args.seed}"
        outs.add(args.out)
        # collect.py's command rebuilt from this config.json parses back to the same flags
        cfg = {k: v for k, v in vars(args).items() if k not in ("resume", "stop_after", "ranks")}  # as Run's
        rebuilt = shlex.split(
            collect.rebuild_command(os.path.splitext(argv[1])[0], cfg).replace('"$DATA_DIR"', shlex.quote(fake_folder))
        )
        again = parse_in_process(rebuilt, monkeypatch)
        assert vars(again) == vars(args), f"{name}.sh {scale}: collect.rebuild_command does not round-trip"
    assert len(outs) == len(commands)  # every run has its own folder
    seeds = {int(o.rsplit("seed", 1)[1]) for o in outs}
    assert seeds == {0, 1, 2}  # SEEDS defaults to "0 1 2"


# run at the first seed only, as does every proxy-scale control but EVERY_SEED_PROXY
ONE_SEED_CONTROLS = {"nf-agc", "anfr-agc", "nf-nowarmup", "anfr-nowarmup", "bn-central-total", "nf-central-total"}
EVERY_SEED_PROXY = {"fedavg-e5", "fedfn-e5", "bn-central", "gn-central", "se-central", "nf-central", "anfr-central"}
ALPHA, RRC = {"SHARDS": "", "ALPHAS": "0.1"}, {"AUGMENT": "rrc"}
FED, CENTRAL = "--split2 --num-clients 5", "--iid --num-clients 1"  # anfr.sh: Table 9's central column


@pytest.mark.parametrize(
    "name, base, control, old, new, scale, env",
    [
        ("anfr", "bn", "bn-iid", "--split2", "--iid", "small", {"RECIPE": "old"}),
        ("anfr", "anfr", "anfr-iid", "--split2", "--iid", "small", {"RECIPE": "old"}),
        ("fedfn", "fedfn", "fedfn-lr0.01", "0.03", "0.01", "small", {}),
        ("fedfn", "fedfn-lr0.01", "fedfn-sqrtd", None, "--fn-scale sqrt-d", "small", {}),  # None: `new` is added
        ("anfr", "nf", "nf-gain1", None, "--last-gain-init 1", "small", {"RECIPE": "old"}),
        ("anfr", "anfr", "anfr-gain1", None, "--last-gain-init 1", "small", {"RECIPE": "old"}),
        ("anfr", "nf", "nf-agc", None, "--clip 0 --agc 0.01", "small", {}),
        ("anfr", "anfr", "anfr-agc", None, "--clip 0 --agc 0.01", "small", {}),
        ("anfr", "nf", "nf-nowarmup", None, "--warmup-steps 0", "small", {}),
        ("anfr", "anfr", "anfr-nowarmup", None, "--warmup-steps 0", "small", {}),
        ("anfr", "bn", "bn-central", FED, CENTRAL, "small", {}),
        ("anfr", "se", "se-central", FED, CENTRAL, "small", RRC),
        ("anfr", "anfr", "anfr-central", FED, CENTRAL, "proxy", {}),
        ("anfr", "nf", "nf-central-total", f"{FED} --local-steps 50", f"{CENTRAL} --local-steps 250", "small", {}),
        ("anfr", "bn", "bn-central-total", f"{FED} --local-steps 200", f"{CENTRAL} --local-steps 1000", "proxy", RRC),
        ("fedfn", "fedfn", "fedfn-lr0.01", "0.03", "0.01", "proxy", ALPHA),
        ("fedfn", "fedfn", "fedfn-sqrtd", None, "--fn-scale sqrt-d", "proxy", ALPHA),
        ("fedfn", "fedfn", "fedfn-wd1e-5", None, "--weight-decay 1e-5", "proxy", ALPHA),
        ("fedfn", "fedavg", "fedavg-wd1e-5", None, "--weight-decay 1e-5", "proxy", ALPHA),
        ("fedfn", "fedfn", "fedfn-e5", "--local-epochs 2", "--local-epochs 5", "proxy", ALPHA),
        ("fedfn", "fedavg", "fedavg-e5", "--local-epochs 2", "--local-epochs 5", "proxy", ALPHA),
    ],
)
def test_controls_change_one_flag_only(name, base, control, old, new, scale, env, monkeypatch):
    """A control's command is its base variant's with `old` (consecutive words, exactly once) replaced by `new`, or
    with `new` added before --seed; collect.py tables and plot.py draws it as a control; the seeds it runs."""
    monkeypatch.chdir(ROOT)

    def runs(scale, **more):  # {(claim folder, variant): argv}
        cmds = dry_run(name, scale, SEEDS="0 1", **{**env, **more})
        return {tuple(argv[argv.index("--out") + 1].split("/")[2:4]): argv for argv in cmds if "seed0" in argv[-1]}

    found = runs(scale)
    claims = sorted(folder for folder, variant in found if variant == base)
    assert claims
    for folder in claims:
        expected = [a.replace(f"/{base}/", f"/{control}/") for a in found[(folder, base)]]
        if old is None:  # the flags go after the variant's own flags, before --seed
            i = expected.index("--seed")
            expected[i:i] = new.split()
        else:
            o = old.split()
            at = [i for i in range(len(expected)) if expected[i : i + len(o)] == o]
            assert len(at) == 1, (old, expected)
            expected[at[0] : at[0] + len(o)] = new.split()
        assert found[(folder, control)] == expected
        assert control in collect.CLAIMS[collect.split_claim(folder)[0]]["controls"]  # tabled and drawn as a control
    seeds = [argv[-1] for argv in dry_run(name, scale, SEEDS="0 1", **env) if f"/{control}/" in argv[-1]]
    if control in ONE_SEED_CONTROLS or (scale == "proxy" and control not in EVERY_SEED_PROXY):  # the first seed only
        assert [s.split("/")[-1] for s in seeds] == ["seed0"] * len(claims)
    else:
        assert len(seeds) == 2 * len(claims)
    assert control not in {variant for _, variant in runs("paper", ALPHAS="")}  # controls are CPU diagnostics


@pytest.mark.parametrize("scale", ["small", "proxy"])
def test_anfr_augment_names_the_claim_and_rrc_adds_only_its_crop(scale, monkeypatch):
    """anfr.sh's recipe runs: AUGMENT=cropflip (the default below paper scale) and AUGMENT=rrc are the same commands
    but for the claim folder anfr-<augment>-<scale> and rrc's --augment rrc --crop-scale 0.05 1 (before --arch); the
    AGC and warm-up controls run with cropflip at small scale only; paper scale is rrc alone; collect.py knows both."""
    monkeypatch.chdir(ROOT)
    crop = {a[-1]: a for a in dry_run("anfr", scale)}
    rrc = {a[-1].replace("anfr-rrc-", "anfr-cropflip-"): a for a in dry_run("anfr", scale, AUGMENT="rrc")}
    controls = {o for o in crop if any(f"/{c}/" in o for c in ("nf-agc", "anfr-agc", "nf-nowarmup", "anfr-nowarmup"))}
    assert len(controls) == (4 if scale == "small" else 0) and set(rrc) == set(crop) - controls
    assert all(o.startswith(f"runs/reproduce/anfr-cropflip-{scale}/") for o in crop)
    for out, argv in rrc.items():
        assert "--augment" not in crop[out]
        i = crop[out].index("--arch")
        assert argv[:-1] == crop[out][:i] + ["--augment", "rrc", "--crop-scale", "0.05", "1"] + crop[out][i:-1]
    for claim in ("anfr-cropflip", "anfr-rrc"):
        assert collect.CLAIMS[claim]["variants"] == ["bn", "gn", "se", "nf", "anfr"]
    paper = dry_run("anfr", "paper")
    assert paper and all("/anfr-rrc-paper/" in a[-1] and "--augment" in a for a in paper)
    res = subprocess.run(["bash", os.path.join(REPRO, "anfr.sh"), "paper"], capture_output=True, text=True,
                         env={**os.environ, "DRY_RUN": "1", "AUGMENT": "cropflip"})  # fmt: skip
    assert res.returncode == 2 and "AUGMENT" in res.stderr


def test_reproduce_env_seeds_and_variants(monkeypatch):
    monkeypatch.chdir(ROOT)
    cmds = dry_run("fedln", "small", SEEDS="5", VARIANTS="bn")
    assert len(cmds) == 1 and cmds[0][cmds[0].index("--seed") + 1] == "5"
    assert cmds[0][cmds[0].index("--out") + 1] == "runs/reproduce/fedln-small/bn/seed5"
    res = subprocess.run(["bash", os.path.join(REPRO, "fedln.sh"), "large"], capture_output=True, text=True)
    assert res.returncode == 2 and "usage" in res.stderr
    res = subprocess.run(
        ["bash", os.path.join(REPRO, "fedln.sh")],
        capture_output=True,
        text=True,
        env={**os.environ, "DATA_DIR": "/nonexistent"},
    )
    assert res.returncode == 2 and "DATA_DIR" in res.stderr


@pytest.mark.parametrize("jobs", [1, 3])
def test_reproduce_runs_skips_resumes_and_continues_after_a_failure(tmp_path, fake_folder, jobs):
    """The non-dry path of lib.sh with a stand-in interpreter (PYTHON=fake) that logs its arguments;
    JOBS=3 runs them in the background, three at a time, each logging to its run folder."""
    log = tmp_path / "calls.txt"
    fake = tmp_path / "fake-python"
    fake.write_text(f"""#!/usr/bin/env bash
echo "$*" >> {log}
out=""; prev=""
for a in "$@"; do [ "$prev" = --out ] || [ "$prev" = --resume ] && out=$a; prev=$a; done
case "$out" in */bn/seed1) exit 3 ;; esac
echo '{{"test_acc": 0.5}}' > "$out/summary.json"
""")
    fake.chmod(0o755)
    runs = tmp_path / "runs"
    done = runs / "fedln-small" / "ln" / "seed0"
    done.mkdir(parents=True)
    (done / "summary.json").write_text("{}")
    half = runs / "fedln-small" / "fn" / "seed0"
    half.mkdir(parents=True)
    (half / "checkpoint.pt").write_text("")
    env = {
        **os.environ,
        "PYTHON": str(fake),
        "DATA_DIR": fake_folder,
        "RUNS_DIR": str(runs),
        "SEEDS": "0 1",
        "JOBS": str(jobs),
    }
    res = subprocess.run(["bash", os.path.join(REPRO, "fedln.sh")], env=env, capture_output=True, text=True)
    assert res.returncode == 1, res.stderr  # bn/seed1 failed ...
    calls = log.read_text().splitlines()
    assert len(calls) == 7  # ... and the rest still ran: 4 variants x 2 seeds, minus the finished ln/seed0
    first = next(c for c in calls if "/ln/seed1" in c)  # in order when JOBS=1
    assert first.startswith("fedln.py --dataset folder --data-dir " + fake_folder) and "--seed 1" in first
    resumed = f"fedln.py --resume {half} --data-dir {fake_folder}"  # the data may have moved since
    assert resumed in calls
    if jobs == 1:
        assert calls[0] == first and calls[1] == resumed
    else:
        assert (
            "resuming" in (half / "log.txt").read_text()
            and "bn/seed1" in (runs / "fedln-small/bn/seed1/log.txt").read_text()
        )
    assert (runs / "fedln-small" / "bn" / "seed0" / "summary.json").exists()
    assert "--norm none" in (runs / "fedln-small" / "vanilla" / "seed1" / "command.txt").read_text()
    assert "bn/seed1" in res.stderr


def test_reproduce_reads_torchvisions_download_as_the_readme_leaves_it(tmp_path):
    """DATA_DIR holding cifar-10-batches-py/ (the README's first run's ./data): every run reads it with --dataset
    cifar10, the command shown and saved says so; an image folder keeps --dataset folder (the test above)."""
    log, fake = tmp_path / "calls.txt", tmp_path / "fake-python"
    fake.write_text(f'#!/usr/bin/env bash\necho "$*" >> {log}\n')
    fake.chmod(0o755)
    (tmp_path / "data" / "cifar-10-batches-py").mkdir(parents=True)
    env = {**os.environ, "PYTHON": str(fake), "DATA_DIR": str(tmp_path / "data"), "RUNS_DIR": str(tmp_path / "runs"),
           "SEEDS": "0", "VARIANTS": "ln"}  # fmt: skip
    res = subprocess.run(["bash", os.path.join(REPRO, "fedln.sh")], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert log.read_text().startswith(f"fedln.py --dataset cifar10 --data-dir {tmp_path / 'data'} ")
    saved = (tmp_path / "runs" / "fedln-small" / "ln" / "seed0" / "command.txt").read_text()
    assert saved.startswith('python fedln.py --dataset cifar10 --data-dir "$DATA_DIR" ')
    dry = subprocess.run(["bash", os.path.join(REPRO, "fedln.sh")], env={**env, "DRY_RUN": "1"}, capture_output=True,
                         text=True)  # fmt: skip
    assert dry.returncode == 0 and dry.stdout.splitlines() == [saved.strip()], dry.stderr  # what a run would run


# ---------------------------------------------------------------------------------------------
# overhead.py: every script, FL versus one client doing the same steps
# ---------------------------------------------------------------------------------------------
def test_overhead_times_evaluation_rows_only():
    import overhead

    rows = [
        {"round": 1, "train_loss": 1.0, "elapsed_s": 1.0},
        {"round": 2, "test_acc": 0.1, "elapsed_s": 2.5},
        {"round": 3, "train_loss": 1.0, "elapsed_s": 4.0},
        {"round": 4, "test_acc": 0.2, "elapsed_s": 6.0},
    ]
    assert overhead.seconds_between_evaluations(rows) == 3.5  # rounds 2 -> 4, not 1 -> 4
    rows += [{"round": 5, "test_acc": 0.3, "elapsed_s": 11.0}, {"round": 6, "test_acc": 0.4, "elapsed_s": 14.0}]
    assert overhead.seconds_between_evaluations(rows, shortest=True) == 3.0  # gaps 3.5, 5, 3: a busy moment in one


def test_overhead_runs_do_the_same_steps_with_the_same_flags(monkeypatch):
    import overhead

    monkeypatch.setattr(
        sys,
        "argv",
        ["overhead.py", "--num-clients", "20", "--frac", "0.25", "--local-steps", "4", "--rounds", "3", "--amp"],
    )
    args = overhead.parse_args()
    fl, central, steps = overhead.run_flags("fedbabu", args)
    assert steps == 3 * 5 * 4  # R rounds x m = C*N clients x K steps

    def tail(flags):
        return flags[flags.index("--num-clients") :]

    assert fl[: -len(tail(fl))] == central[: -len(tail(central))]  # everything but the federation flags is shared
    assert "--amp" in fl and "--no-client-test" in fl and fl[fl.index("--model") + 1] == "convnet4-tiny"
    assert tail(fl) == ["--num-clients", 20, "--frac", 0.25, "--local-steps", 4, "--rounds", 6, "--eval-every", 3]
    assert tail(central) == ["--num-clients", 1, "--frac", 1, "--local-steps", 60, "--rounds", 2, "--eval-every", 1]
    args.model_flags = "--model mlp"  # --model-flags replaces the per-script model flags
    fl, _, _ = overhead.run_flags("fedbabu", args)
    assert fl[fl.index("--model") + 1] == "mlp" and "--no-client-test" not in fl
    args.model_flags, args.amp = None, False
    for script in overhead.SCRIPTS:  # every script's parser takes both runs' flags (its model registered by it)
        for flags in overhead.run_flags(script, args)[:2]:
            parsed = parse_in_process(["python", f"{script}.py", *map(str, flags), "--device", "cpu"], monkeypatch)
            assert parsed.local_steps in (4, 60) and getattr(parsed, "local_epochs", None) is None and parsed.iid


@pytest.mark.slow  # 2 scripts x (FL, centralized) x 2 repeats, a process each
def test_overhead_times_each_script_against_the_same_steps_centralized(tmp_path):
    cmd = [
        sys.executable,
        os.path.join(ROOT, "benchmarks", "overhead.py"),
        "--scripts",
        "fedavg",
        "fednnnn",
        "--device",
        "cpu",
        "--num-clients",
        "4",
        "--frac",
        "0.5",
        "--local-steps",
        "3",
        "--rounds",
        "2",
        "--repeats",
        "2",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr
    table = [line for line in res.stdout.splitlines() if line.startswith("| fed")]
    assert [line.split("|")[1].strip() for line in table] == ["fedavg.py", "fednnnn.py"]
    for line in table:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        steps, fl, central = int(cells[2]), float(cells[3]), float(cells[4])
        assert steps == 2 * 2 * 3 and fl > 0 and central > 0  # R rounds x m clients x K steps
        ratios = [float(r) for r in cells[5].split("(")[1].rstrip(")").split(", ")]
        assert len(ratios) == 2 and all(0.2 < r < 5 for r in ratios)


@pytest.mark.parametrize("script,rounds", [("overhead.py", "0"), ("round_time.py", "1")])
def test_timing_benchmarks_refuse_too_few_rounds(script, rounds):
    bad = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", script), "--rounds", rounds], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "--rounds" in bad.stderr


@pytest.mark.slow  # fedavg.py's CNN timed twice, rounds long enough to stand out of the noise
def test_round_time_splits_rounds_from_evaluation():
    cmd = [
        sys.executable,
        os.path.join(ROOT, "benchmarks", "round_time.py"),
        "--models",
        "cnn",
        "--precisions",
        "fp32",
        "--dataset",
        "synthetic",
        "--device",
        "cpu",
        "--num-clients",
        "4",
        "--frac",
        "0.5",
        "--local-epochs",
        "2",
        "--rounds",
        "2",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr
    row = [
        c.strip()
        for c in next(line for line in res.stdout.splitlines() if line.startswith("| cnn")).strip("|").split("|")
    ]
    assert row[:2] == ["cnn", "fp32"] and float(row[2]) > 0  # a round of 2 clients x 2 epochs takes time


def test_every_hand_mutant_finds_its_snippet_once():
    """benchmarks/hand_mutants.py replaces exact snippets: a reformatted line must not silently disarm one."""
    spec = importlib.util.spec_from_file_location("hand_mutants", os.path.join(ROOT, "benchmarks", "hand_mutants.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert len(module.MUTANTS) >= 20
    for name, path, original, mutated, _ in module.MUTANTS:
        with open(os.path.join(ROOT, path)) as f:
            assert f.read().count(original) == 1, name
        assert mutated != original, name


@pytest.mark.slow  # 20 s: two runs and a replay
def test_fn_growth_replays_the_round_and_fn_only_lengthens_the_invariant_layer(tmp_path):
    """benchmarks/fn_growth.py on a run stopped after 2 of 3 rounds (FN, momentum 0, no weight decay): its average
    of the traced clients is the model fedfn.py itself ends round 3 with (bit for bit); at every local step the
    last body layer's norm does not shrink (FN makes it scale-invariant: ||w - lr g||^2 = ||w||^2 + lr^2 ||g||^2),
    the first probe norm is the global model's, and the average's norm is at most the clients' weighted mean
    (the triangle inequality); bad input exits 2 naming the flag."""
    import torch

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import fn_growth

    import common
    import fedfn

    run = tmp_path / "run"
    flags = ["--dataset", "synthetic", "--model", "cnn", "--num-clients", "6", "--frac", "0.5", "--rounds", "3"]
    flags += ["--local-epochs", "1", "--alpha", "0.5", "--momentum", "0", "--lr", "0.05", "--save-model"]
    one_thread = {**os.environ, "OMP_NUM_THREADS": "1"}  # as this process (conftest.py): the same float sums
    subprocess.run([sys.executable, "fedfn.py", *flags, "--stop-after", "2", "--out", run], cwd=ROOT, check=True,
                   env=one_thread)  # fmt: skip
    with open(run / "config.json") as f:
        args = argparse.Namespace(**{**json.load(f), "device": "cpu"})
    ckpt = torch.load(run / "checkpoint.pt", map_location="cpu", weights_only=False)
    data = common.load_data(args)
    partition = common.make_partition(args, data)
    result, averaged = fn_growth.trace_round(args, data, partition, ckpt, probe_size=20)
    subprocess.run([sys.executable, "fedfn.py", "--resume", run], cwd=ROOT, check=True, capture_output=True,
                   env=one_thread)  # fmt: skip
    final = torch.load(run / "model.pt")
    assert all(torch.equal(final[k], v) for k, v in averaged.state_dict().items())
    assert result["round"] == 3 and len(result["clients"]) == 3
    start = common.build_model("cnn", data)
    start.load_state_dict(ckpt["model"])
    for c in result["clients"]:
        layer = [w for _, w in c["trace"]]
        assert len(layer) == c["steps"] + 1 and all(b >= a * (1 - 1e-7) for a, b in zip(layer, layer[1:]))
        assert layer[-1] > layer[0]
        probe = common.prepare_batch(data.x_train[partition.train[c["client"]][:20]], data)
        assert c["trace"][0][0] == pytest.approx(float(start.body(probe).norm(dim=1).mean().detach()), rel=1e-6)
    sizes = [c["samples"] for c in result["clients"]]
    mean_norm = sum(n * c["trace"][-1][1] for n, c in zip(sizes, result["clients"])) / sum(sizes)
    assert result["average"][0][1] <= mean_norm
    assert sum(c["update_share"] for c in result["clients"]) == pytest.approx(1.0, rel=1e-5)
    assert float(fedfn.param_norm(fedfn.invariant_layer(averaged))) == pytest.approx(result["average"][0][1])
    for argv, flag in (([], "--run"), (["--run", str(run), "--clients", "0"], "--clients")):
        res = subprocess.run(
            [sys.executable, "benchmarks/fn_growth.py", *(argv or ["--run", str(tmp_path)])],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        assert res.returncode == 2 and flag in res.stderr.splitlines()[-1]


# ---------------------------------------------------------------------------------------------
# threads.py (time per round at each thread setting): how each way launches a script, and its table
# ---------------------------------------------------------------------------------------------
class FinishedProcess:
    """A started run (subprocess.Popen) that has ended with exit code 0."""

    def __init__(self, cmd):
        self.args = cmd

    def wait(self, timeout=None):
        return 0


@pytest.mark.parametrize(
    "way,launcher,threads_flag",
    [
        ("default", [], None),
        ("default GOMP_SPINCOUNT=300000,OMP_WAIT_POLICY=ACTIVE", [], None),
        ("1 thread", [], "1"),
        ("2 threads", [], "2"),
        ("torchrun 2x1", ["-m"], None),
    ],
)
def test_threads_ways_launch_as_named_and_time_between_evaluations(way, launcher, threads_flag, tmp_path, monkeypatch):
    """The default gets neither --threads nor OMP_NUM_THREADS nor GOMP_SPINCOUNT (the scripts choose), "default ENV"
    those variables; s/round is the last two evaluations' elapsed_s apart over R; the picked threads come from
    config.json."""
    threads = importlib.import_module("threads")
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.setenv("GOMP_SPINCOUNT", "5")
    seen = {}

    def fake_run(cmd, cwd, env, **kw):
        seen.update(cmd=cmd, env=env)
        out = cmd[cmd.index("--out") + 1]
        os.makedirs(out)
        rows = [{"round": 3, "test_acc": 0.2, "elapsed_s": 10.0}, {"round": 6, "test_acc": 0.3, "elapsed_s": 22.0}]
        with open(os.path.join(out, "metrics.jsonl"), "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump({"threads": 2}, f)
        return FinishedProcess(cmd)

    monkeypatch.setattr(threads.subprocess, "Popen", fake_run)
    args = argparse.Namespace(data_dir="/d", rounds=3, run_timeout=60)
    assert threads.run_once(args, "fedfn-small", way, str(tmp_path / "r")) == (4.0, 2, 0.3)
    cmd = seen["cmd"]
    assert "OMP_NUM_THREADS" not in seen["env"] and cmd[1 : 1 + len(launcher)] == launcher
    spin = {k: seen["env"].get(k) for k in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    assert spin == ({"GOMP_SPINCOUNT": "300000", "OMP_WAIT_POLICY": "ACTIVE"} if "=" in way else dict.fromkeys(spin))
    assert (cmd[cmd.index("--threads") + 1] if "--threads" in cmd else None) == threads_flag
    assert ("torch.distributed.run" in cmd) == (way == "torchrun 2x1")
    assert cmd[cmd.index("--rounds") + 1] == "6" and cmd[cmd.index("--eval-every") + 1] == "3"


def test_threads_run_once_evaluated_every_round_times_rounds_r_plus_1_to_2r(tmp_path, monkeypatch):
    """A control's eval_every=1 (every round logged): s/round is still rounds R+1..2R, from the row of round R."""
    threads = importlib.import_module("threads")
    elapsed = {1: 5.0, 2: 6.0, 3: 8.0, 4: 11.0, 5: 15.0, 6: 20.0}  # rounds 4-6 take 3, 4, 5 s

    def fake_run(cmd, cwd, env, **kw):
        assert cmd[cmd.index("--eval-every") + 1] == "1" and cmd[cmd.index("--rounds") + 1] == "6"
        out = cmd[cmd.index("--out") + 1]
        os.makedirs(out)
        with open(os.path.join(out, "metrics.jsonl"), "w") as f:
            f.writelines(json.dumps({"round": r, "test_acc": 0.1, "elapsed_s": e}) + "\n" for r, e in elapsed.items())
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump({"threads": 1}, f)
        return FinishedProcess(cmd)

    monkeypatch.setattr(threads.subprocess, "Popen", fake_run)
    args = argparse.Namespace(data_dir="/d", rounds=3, eval_every=1, run_timeout=60)
    assert threads.run_once(args, "fedfn-small", "1 thread", str(tmp_path / "r")) == (4.0, 1, 0.1)


def test_threads_table_takes_medians_says_timeouts_and_the_defaults_ratio_to_the_best():
    threads = importlib.import_module("threads")
    secs = {"default": [5.0, 7.0, 6.0], "1 thread": [8.0, 9.0, 10.0], "2 threads": [None, None, 3.0]}
    secs["torchrun 2x1"] = [4.0, 5.0, 3.0]
    runs = [
        dict(workload="fedavg-cnn", condition="idle", way=way, s_per_round=s, threads=2 if way == "default" else 1)
        for way, ss in secs.items()
        for s in ss
    ]
    args = argparse.Namespace(workloads=["fedavg-cnn"], conditions=["idle"], run_timeout=900)
    row = threads.table(runs, args).splitlines()[2]
    # medians 6, 9, timed out (two of three), 4; the default over the best thread count (9: 0.67), 1.5x torchrun
    assert row == "| fedavg-cnn | idle | 6.00 | 9.00 | timed out (900 s) | 4.00 | [2] threads | 0.67 | 1.50 |"


def test_threads_table_takes_the_idle_minimum_and_the_loaded_median_when_asked():
    """--idle-statistic min (the default; written to the JSON's args before the first run) gives idle rows the fastest
    of the cycles and loaded rows still their median; a JSON without it (measured before) keeps its medians."""
    threads = importlib.import_module("threads")
    secs = {"default": [5.0, 9.0, 6.0], "1 thread": [8.0, 7.5, 10.0], "2 threads": [4.0, 6.0, 12.0]}
    secs["torchrun 2x1"] = [2.5, 5.0, 3.0]
    runs = [
        dict(workload="fedfn-small", condition=c, way=way, s_per_round=s, threads=2 if way == "default" else 1)
        for c in ("idle", "loaded")
        for way, ss in secs.items()
        for s in ss
    ]
    args = argparse.Namespace(workloads=["fedfn-small"], conditions=["idle", "loaded"], run_timeout=900)
    idle, loaded = threads.table(runs, argparse.Namespace(**vars(args), idle_statistic="min")).splitlines()[2:]
    assert idle == "| fedfn-small | idle | 5.00 | 7.50 | 4.00 | 2.50 | [2] threads | 1.25 | 2.00 |"
    assert loaded == "| fedfn-small | loaded | 6.00 | 8.00 | 6.00 | 3.00 | [2] threads | 1.00 | 2.00 |"
    assert threads.table(runs, args).splitlines()[2] == loaded.replace("loaded", "idle")


def test_threads_ways_alternate_their_order_so_none_always_runs_first():
    threads = importlib.import_module("threads")
    args = argparse.Namespace(envs=["GOMP_SPINCOUNT=0"])
    first, second = threads.ways_of(args, 1), threads.ways_of(args, 2)
    assert first == ["default", "default GOMP_SPINCOUNT=0", "1 thread", "2 threads", "torchrun 2x1"]
    assert second == first[::-1] and threads.ways_of(args, 3) == first


def test_threads_counts_default_to_the_cores_powers_of_two_and_the_cores(monkeypatch):
    """--thread-counts: 1 2 on two cores, 1 2 4 8 on eight, 1 2 4 8 12 on twelve (the cores: the affinity, as
    common.py counts them); the ways run each count, then torchrun 2x1 unless --no-torchrun."""
    threads = importlib.import_module("threads")
    got = {}
    for cores in (1, 2, 8, 12):
        monkeypatch.setattr(threads.os, "sched_getaffinity", lambda _, n=cores: set(range(n)), raising=False)
        monkeypatch.setattr(sys, "argv", ["threads.py", "--data-dir", "/nowhere", "--dry"])
        got[cores] = threads.parse_args().thread_counts
    assert got == {1: [1], 2: [1, 2], 8: [1, 2, 4, 8], 12: [1, 2, 4, 8, 12]}
    args = argparse.Namespace(envs=[], thread_counts=[2, 4], no_torchrun=True)
    assert threads.ways_of(args, 1) == ["default", "2 threads", "4 threads"]
    assert threads.ways_of(argparse.Namespace(envs=[], thread_counts=[1]), 2) == ["torchrun 2x1", "1 thread", "default"]


def test_threads_table_takes_the_best_of_every_count_and_says_what_was_not_measured():
    threads = importlib.import_module("threads")
    secs = {"default": [5.0], "2 threads": [6.0], "4 threads": [4.0], "8 threads": [4.5]}
    runs = [dict(workload="fedfn-small", condition="idle", way=w, s_per_round=s[0], threads=8) for w, s in secs.items()]
    args = argparse.Namespace(workloads=["fedfn-small"], conditions=["idle"], run_timeout=900)
    assert threads.table(runs, args).splitlines()[2] == (
        "| fedfn-small | idle | 5.00 | 6.00 | 4.00 | 4.50 | [8] threads | 1.25 | - |"  # 5 / 4, the best: 4 threads
    )
    alone = threads.table(runs[:1], args).splitlines()[2]  # a run cut short after its default
    assert alone == "| fedfn-small | idle | 5.00 | [8] threads | - | - |"


def test_threads_dry_prints_each_runs_command_and_runs_none(tmp_path):
    out = tmp_path / "t.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "threads.py"), "--data-dir", str(tmp_path / "none")]
    cmd += ["--workloads", "fedfn-small", "--thread-counts", "2", "4", "--no-torchrun", "--out", str(out), "--dry"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and not out.exists(), res.stderr
    runs = [shlex.split(line) for line in res.stdout.splitlines() if not line.startswith("#")]
    assert [a[a.index("--threads") + 1] if "--threads" in a else None for a in runs] == [None, "2", "4"]
    assert all(a[1].endswith("fedfn.py") and a[a.index("--device") + 1] == "cpu" for a in runs)
    out.write_text("{}")  # an earlier measurement: refused, not overwritten
    for split in ("train", "test"):
        (tmp_path / "none" / split).mkdir(parents=True)
    res = subprocess.run([*cmd[:-1]], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--out" in res.stderr.strip().splitlines()[-1] and out.read_text() == "{}"


@pytest.mark.parametrize(
    "flags,flag",
    [
        (["--data-dir", "no-such-folder"], "--data-dir"),
        (["--rounds", "0"], "--rounds"),
        (["--envs", "X"], "--envs"),
        (["--thread-counts", "0"], "--thread-counts"),
    ],
)
def test_threads_refuses_bad_input_in_one_line(flags, flag, tmp_path):
    base = ["--data-dir", str(tmp_path)]
    (tmp_path / "train").mkdir()
    (tmp_path / "test").mkdir()
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "threads.py"), *base, *flags]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 2 and flag in res.stderr.strip().splitlines()[-1]


def test_threads_table_says_the_defaults_processes_from_summary_json():
    """The default on the CPU is a process a core of one thread each: its cell says "[2] x [1] threads"; a JSON
    measured before the runs said their processes keeps its "[2] threads"."""
    threads = importlib.import_module("threads")
    row = dict(workload="fedavg-mlp", condition="idle", threads=1)
    runs = [
        {**row, "way": "default", "s_per_round": 1.0, "processes": 2},
        {**row, "way": "1 thread", "s_per_round": 2.0},
    ]
    args = argparse.Namespace(workloads=["fedavg-mlp"], conditions=["idle"], run_timeout=900)
    assert (
        threads.table(runs, args).splitlines()[2]
        == "| fedavg-mlp | idle | 1.00 | 2.00 | [2] x [1] threads | 0.50 | - |"
    )
    old = [{k: v for k, v in r.items() if k != "processes"} for r in runs]
    assert "| [1] threads |" in threads.table(old, args)


def test_threads_sweep_starts_its_copies_at_once_and_takes_their_median(tmp_path, monkeypatch):
    """The sweep condition: --load copies of one run started before any is waited for, each its own folder; the
    row's s/round is their median, each copy's kept."""
    threads = importlib.import_module("threads")
    started, waited = [], []

    class Copy:
        def __init__(self, cmd):
            self.args = cmd
            started.append(cmd[cmd.index("--out") + 1])

        def wait(self, timeout=None):
            waited.append(len(started))
            out = self.args[self.args.index("--out") + 1]
            seconds = 2.0 * len(waited)
            rows = [
                {"round": 3, "test_acc": 0.2, "elapsed_s": 1.0},
                {"round": 6, "test_acc": 0.3, "elapsed_s": 1 + 3 * seconds},
            ]
            os.makedirs(out)
            with open(os.path.join(out, "metrics.jsonl"), "w") as f:
                f.write("".join(json.dumps(r) + "\n" for r in rows))
            with open(os.path.join(out, "config.json"), "w") as f:
                json.dump({"threads": 2}, f)
            return 0

    def popen(cmd, cwd, env, **kw):
        return Copy(cmd)

    monkeypatch.setattr(threads.subprocess, "Popen", popen)
    args = argparse.Namespace(data_dir="/d", rounds=3, run_timeout=60, load=3)
    sec, used, acc, each = threads.run_sweep(args, "fedfn-small", "default", str(tmp_path / "r"))
    assert waited == [3, 3, 3] and len(set(started)) == 3
    assert each == [2.0, 4.0, 6.0] and sec == 4.0 and used == 2 and acc == 0.3


def test_threads_bounds_take_the_fastest_one_process_way_idle_and_one_thread_else():
    """idle: the default over the fastest way of one process (torchrun's left out), bound 1.1; loaded: over one
    thread, bound 1.5; sweep: over one thread, bound 1.3."""
    threads = importlib.import_module("threads")
    secs = {
        "idle": {"default": [5.0, 6.0], "1 thread": [9.0, 9.5], "2 threads": [4.8, 7.0], "torchrun 2x1": [3.0, 3.0]},
        "loaded": {"default": [8.0, 12.0], "1 thread": [7.0, 7.0], "2 threads": [9.0, 9.0], "torchrun 2x1": [1.0, 1.0]},
        "sweep": {"default": [10.0, 10.0], "1 thread": [8.0, 8.0], "2 threads": [9.0, 9.0], "torchrun 2x1": [1.0, 1.0]},
    }
    runs = [
        dict(workload="fedavg-cnn", condition=c, way=way, s_per_round=s)
        for c, ways in secs.items()
        for way, ss in ways.items()
        for s in ss
    ]
    args = argparse.Namespace(workloads=["fedavg-cnn"], conditions=["idle", "loaded", "sweep"])
    idle, loaded, sweep = threads.bounds(runs, args).splitlines()[2:]
    # 5.0 over the fastest one-process way, 2 threads' 4.8; the median 10.0 over one thread's 7.0; 10.0 over 8.0.
    assert idle.endswith("| 1.04 | 1.1x: met |")
    assert loaded.endswith("| 1.43 | 1.5x: met |")
    assert sweep.endswith("| 1.25 | 1.3x: met |")
    runs.append(dict(workload="fedavg-cnn", condition="sweep", way="default", s_per_round=12.0))
    assert threads.bounds(runs, args).splitlines()[4].endswith("| 1.25 | 1.3x: met |")
    runs.append(dict(workload="fedavg-cnn", condition="sweep", way="default", s_per_round=12.0))
    assert threads.bounds(runs, args).splitlines()[4].endswith("| 1.38 | 1.3x: missed |")

"""Plots of CleanFL runs: reproduced claims, any run folders, partitions and FN traces (matplotlib, optional).

Four modes, one subcommand each:

    pip install -r benchmarks/requirements.txt    # matplotlib: only this tool needs it

    # claims: one PNG per RUNS_DIR/<claim>-<scale>/ folder of benchmarks/reproduce/*.sh, one line per
    # variant (test accuracy per evaluated round, mean over seeds, band of +- one std, ddof=1; a claim's
    # controls from collect.CLAIMS dashed; unfinished runs drawn with their rounds so far)
    python benchmarks/plot.py claims                              # runs/reproduce -> docs/<claim>-<scale>.png
    python benchmarks/plot.py claims benchmarks/results --out docs --claim fedln

    # runs: your own run folders (those with a config.json; a folder without one stands for every run
    # folder below it) in one PNG: test accuracy and train loss per round, each line labelled with its
    # script and the flags that differ between the runs; --mean-seeds averages runs that differ only in seed;
    # more than --max-runs lines (default 12) are refused: the legend of a folder of 100 runs is taller than a page
    python benchmarks/plot.py runs runs/a runs/b --out compare.png
    python benchmarks/plot.py runs benchmarks/results/fedfn-s2-small --mean-seeds --out fedfn-s2.png

    # partition: the clients x classes label counts of a run's partition.json as a heatmap
    python benchmarks/plot.py partition runs/a --out partition.png

    # fn-growth: traces of benchmarks/fn_growth.py --json, each client's mean ||f|| per local step, a panel each
    python benchmarks/plot.py fn-growth fedfn-round51.json fedavg-round51.json --out growth.png

The old form `python benchmarks/plot.py [RUNS_DIR] [--out DIR] [--claim X]` (no subcommand) is the
claims mode. A RUNS_DIR literally named claims, runs, partition or fn-growth needs the subcommand: `claims runs`.
"""

import argparse
import glob
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from collect import CLAIMS, NEGATED, read_metrics, split_claim, variant_order, DEFAULT_CLAIM  # noqa: E402

COMMANDS = ("claims", "runs", "partition", "fn-growth")
SCRIPTS = ("fedavg", "fedbabu", "fedfn", "fedln", "fednnnn", "anfr")
# config.json keys that never tell two runs apart in a label (where the run went, how it was checkpointed).
NOT_IN_LABEL = {"out", "resume", "stop_after", "checkpoint_every", "save_model", "data_dir", "device"}
SEED_KEYS = {"seed", "data_seed"}
MAX_RUNS = 12  # lines in one runs figure: beyond it the legend (a line each) outgrows the plots and colors repeat
CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


# ---------------------------------------------------------------------------------------------
# claims: RUNS_DIR/<claim>-<scale>/<variant>/seed<k>
# ---------------------------------------------------------------------------------------------
def curves(claim_dir):
    """{variant: (rounds, mean, std, n_seeds)} from claim_dir/<variant>/seed*/metrics.jsonl."""
    out = {}
    for variant_dir in sorted(glob.glob(os.path.join(claim_dir, "*"))):
        per_round = {}
        seeds = glob.glob(os.path.join(variant_dir, "seed*", "metrics.jsonl"))
        for path in seeds:
            for row in read_metrics(path):
                if "test_acc" in row:
                    per_round.setdefault(row["round"], []).append(100 * float(row["test_acc"]))
        if not per_round:
            continue
        out[os.path.basename(variant_dir)] = (*mean_band(per_round), len(seeds))
    return out


def mean_band(per_round):
    """{round: [values]} -> (rounds, mean, std over the values, ddof=1; 0 where there is one value)."""
    rounds = sorted(per_round)
    mean = np.array([np.mean(per_round[r]) for r in rounds])
    std = np.array([np.std(per_round[r], ddof=1) if len(per_round[r]) > 1 else 0.0 for r in rounds])
    return np.array(rounds), mean, std


def plot_claims(a, plt):
    claim_dirs = sorted(d for d in glob.glob(os.path.join(a.root, "*")) if os.path.isdir(d))
    if not claim_dirs:
        print(f"no runs under {a.root}/<claim>-<scale>/<variant>/seed<k>", file=sys.stderr)
        return 1
    os.makedirs(a.out, exist_ok=True)
    for claim_dir in claim_dirs:
        name = os.path.basename(claim_dir)
        claim, scale = split_claim(name)
        if a.claim and claim != a.claim:
            continue
        data = curves(claim_dir)
        if not data:
            continue
        spec = CLAIMS.get(claim, DEFAULT_CLAIM)
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for variant in variant_order(spec, data):
            rounds, mean, std, n = data[variant]
            ax.plot(
                rounds,
                mean,
                marker="." if len(rounds) < 40 else None,
                label=f"{variant} ({n} seed{'s' if n != 1 else ''})",
                linestyle="--" if variant in spec.get("controls", []) else "-",
            )
            if np.any(std > 0):
                ax.fill_between(rounds, mean - std, mean + std, alpha=0.2)
        ax.set_xlabel("communication round")
        ax.set_ylabel("test accuracy (%), mean over seeds")
        ax.set_title((spec["title"] or claim) + (f" [{scale}]" if scale else ""), fontsize=8, wrap=True)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(a.out, f"{name}.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        print(path)
    return 0


# ---------------------------------------------------------------------------------------------
# runs: any run folders, labelled by the flags that differ
# ---------------------------------------------------------------------------------------------
def is_run(path):
    return os.path.isfile(os.path.join(path, "config.json")) or os.path.isfile(os.path.join(path, "metrics.jsonl"))


def find_runs(paths):
    """Run folders: each path that is one (has config.json or metrics.jsonl), else every run folder
    below it (sorted). Raises ValueError naming a path that holds none."""
    found = []
    for path in paths:
        if not os.path.isdir(path):
            raise ValueError(f"{path}: not a folder")
        if is_run(path):
            found.append(path)
            continue
        below = sorted(d for d, _, _ in os.walk(path) if is_run(d))
        if not below:
            raise ValueError(f"{path}: no run folder (one with config.json and metrics.jsonl) in it or below it")
        found += below
    return found


def script_of(run_dir, config):
    """The script of a run: summary.json's "script", else command.txt, else the default folder name
    <script>__<dataset>__<seed>__<time>, else "run"."""
    summary = os.path.join(run_dir, "summary.json")
    if os.path.isfile(summary):
        with open(summary) as f:
            script = json.load(f).get("script")
        if script:
            return script
    command = os.path.join(run_dir, "command.txt")
    if os.path.isfile(command):
        with open(command) as f:
            for word in f.read().split():
                if word.endswith(".py"):
                    return os.path.basename(word)[:-3]
    for name in (os.path.basename(os.path.normpath(run_dir)), os.path.basename(config.get("out") or "")):
        prefix = name.split("__")[0]
        if prefix in SCRIPTS:
            return prefix
    return "run"


def load_run(run_dir):
    path = os.path.join(run_dir, "config.json")
    config = {}
    if os.path.isfile(path):
        with open(path) as f:
            config = json.load(f)
    return {
        "dir": run_dir,
        "config": config,
        "script": script_of(run_dir, config),
        "metrics": read_metrics(os.path.join(run_dir, "metrics.jsonl")),
    }


def flag_words(key, value, config, script=None):
    """How a config.json entry reads on the command line ('' when the flag is not given)."""
    if value is None or (key == "data_seed" and value == config.get("seed")):  # --data-seed defaults to --seed
        return ""
    flag = "--" + key.replace("_", "-")
    if isinstance(value, bool):  # store_true flags; flags that default to True (collect.NEGATED) read --no-<flag>
        if key in NEGATED.get(script, ()):
            return "" if value else "--no-" + key.replace("_", "-")
        return flag if value else ""
    if isinstance(value, list):
        return " ".join([flag, *map(str, value)])
    return f"{flag} {value}"


def labels(runs, ignore=(), disambiguate=True):
    """One label per run: its script, then every flag whose value differs between the runs that have it
    (a flag only some scripts have, with one value wherever it appears, is that script's setting and the
    script name already tells it apart; keys in NOT_IN_LABEL and `ignore` are left out). With
    `disambiguate`, runs that no flag tells apart get their folder name added."""
    skip = NOT_IN_LABEL | set(ignore)
    keys = [k for k in dict.fromkeys(k for r in runs for k in r["config"]) if k not in skip]  # config (flag) order
    differ = [k for k in keys if len({json.dumps(r["config"][k], default=str) for r in runs if k in r["config"]}) > 1]
    out = []
    for r in runs:
        words = [flag_words(k, r["config"][k], r["config"], r["script"]) for k in differ if k in r["config"]]
        out.append(" ".join([r["script"], *[w for w in words if w]]))
    if disambiguate and len(set(out)) < len(out):  # not told apart by their flags (e.g. the same command twice)
        out = [f"{label} ({os.path.basename(os.path.normpath(r['dir']))})" for label, r in zip(out, runs)]
    return out


def shared_settings(runs):
    """A short line of the settings all runs share (dataset, model, partition, clients, rounds)."""
    words = []
    for key in (
        "dataset",
        "model",
        "iid",
        "shards",
        "classes_per_client",
        "alpha",
        "split2",
        "num_clients",
        "frac",
        "rounds",
    ):
        values = {json.dumps(r["config"].get(key), default=str) for r in runs}
        if len(values) == 1:
            w = flag_words(key, runs[0]["config"].get(key), runs[0]["config"], runs[0]["script"])
            if w:
                words.append(w)
    return "shared: " + " ".join(words) if words else ""


def series(runs, key):
    """{round: [values of key]} over the metrics rows of these runs (percent for accuracies)."""
    per_round = {}
    scale = 100.0 if key.endswith("_acc") else 1.0
    for r in runs:
        for row in r["metrics"]:
            if row.get(key) is not None:
                per_round.setdefault(row["round"], []).append(scale * float(row[key]))
    return per_round


def group_seeds(runs):
    """[(label, [runs])]: runs whose configs are equal apart from the seed (and data seed, out folder)."""
    names = labels(runs, ignore=SEED_KEYS, disambiguate=False)
    groups = {}
    for name, r in zip(names, runs):
        groups.setdefault(name, []).append(r)
    return [(f"{name} ({len(rs)} seed{'s' if len(rs) != 1 else ''})", rs) for name, rs in groups.items()]


def too_many(n, a):
    """Refuse (exit 2, one line) a figure of n lines over --max-runs: a parent folder of 100 runs would give a
    legend 18 inches tall and a 1320 x 19512 px image. Returns 2, or 0 when n fits."""
    if n <= a.max_runs:
        return 0
    what = "configurations (--mean-seeds)" if a.mean_seeds else "runs"
    folders = ", ".join(a.folders[:3]) + (" ..." if len(a.folders) > 3 else "")
    print(
        f"plot.py runs: {n} {what} in {folders}, more lines than one figure shows (--max-runs {a.max_runs}); "
        f"give fewer folders{'' if a.mean_seeds else ', --mean-seeds'} or --max-runs {n}",
        file=sys.stderr,
    )
    return 2


def plot_runs(a, plt):
    try:
        found = find_runs(a.folders)
    except ValueError as e:
        print(f"plot.py runs: {e}", file=sys.stderr)
        return 2
    if not a.mean_seeds and too_many(len(found), a):  # a line a run: refused before every run is read
        return 2
    runs = [load_run(d) for d in found]
    groups = group_seeds(runs) if a.mean_seeds else [(name, [r]) for name, r in zip(labels(runs), runs)]
    if too_many(len(groups), a):
        return 2
    has_loss = any(series(rs, "train_loss") for _, rs in groups)
    legend_h = 0.18 * len(groups) + 0.2  # inches: the legend goes under the plots, one line per label
    height = 4.0 + legend_h
    fig, axes = plt.subplots(1, 2 if has_loss else 1, figsize=(11 if has_loss else 6.4, height), squeeze=False)
    for (name, rs), color in zip(groups, _colors(plt, len(groups))):
        for ax, key in zip(axes[0], ("test_acc", "train_loss")):
            per_round = series(rs, key)
            if not per_round:
                continue
            rounds, mean, std = mean_band(per_round)
            ax.plot(rounds, mean, color=color, marker="." if len(rounds) < 40 else None, label=name)
            if np.any(std > 0):
                ax.fill_between(rounds, mean - std, mean + std, color=color, alpha=0.2)
    axes[0][0].set_ylabel("test accuracy (%)" + (", mean over seeds" if a.mean_seeds else ""))
    if has_loss:
        axes[0][1].set_ylabel("train loss (mean over the round's clients)")
    for ax in axes[0]:
        ax.set_xlabel("communication round")
        ax.grid(alpha=0.3)
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower left", fontsize=7, frameon=False)
    fig.suptitle(a.title or shared_settings(runs), fontsize=8)
    fig.tight_layout(rect=(0, legend_h / height, 1, 1))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    fig.savefig(a.out, dpi=120)
    plt.close(fig)
    print(a.out)
    return 0


def _colors(plt, n):
    cmap = plt.get_cmap("tab10" if n <= 10 else "tab20")
    return [cmap(i % cmap.N) for i in range(n)]


# ---------------------------------------------------------------------------------------------
# partition: partition.json (written by common.Run.start) as a clients x classes heatmap
# ---------------------------------------------------------------------------------------------
def load_partition(path, split="train"):
    """(counts [clients, classes] int array, scheme, class names, client names or None) from a run folder or its
    partition.json: {"scheme": str, "train": [[count per class] per client], "test": ... (--client-test),
    "classes": [name] (image folders), "clients": [folder or domain per client] (--natural, --clients-per-domain)}."""
    run_dir = path if os.path.isdir(path) else os.path.dirname(path)
    file = os.path.join(path, "partition.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ValueError(f"{path}: no partition.json (every run writes one into its folder before training)")
    with open(file) as f:
        info = json.load(f)
    if split not in info:
        raise ValueError(f"{file}: no '{split}' counts (test counts exist only for runs with --client-test)")
    counts = np.asarray(info[split], dtype=int)
    names = info.get("classes") or class_names(run_dir, counts.shape[1])  # an image folder's: in the file
    return counts, info.get("scheme", "?"), names, info.get("clients")


def class_names(run_dir, num_classes):
    """Class names from the run's config.json: the image folder's sorted class folders, or CIFAR-10's."""
    path = os.path.join(run_dir, "config.json")
    if os.path.isfile(path):
        with open(path) as f:
            config = json.load(f)
        train = os.path.join(config.get("data_dir") or "", "train")
        if config.get("dataset") == "folder" and os.path.isdir(train):
            names = sorted(d for d in os.listdir(train) if os.path.isdir(os.path.join(train, d)))
            if len(names) == num_classes:
                return names
        if config.get("dataset") == "cifar10" and num_classes == 10:
            return CIFAR10_CLASSES
    return [str(c) for c in range(num_classes)]


def load_trace(path):
    """A trace written by benchmarks/fn_growth.py --json: {"round", "lr", "clients": [...]}; ValueError otherwise."""
    try:
        with open(path) as f:
            trace = json.load(f)
    except OSError as e:
        raise ValueError(f"JSON {path}: {e.strerror}") from e
    except ValueError as e:
        raise ValueError(f"JSON {path}: {e}") from e
    if not isinstance(trace, dict) or not {"round", "lr", "clients"} <= set(trace):
        raise ValueError(f"JSON {path}: not a trace of benchmarks/fn_growth.py --json (round, lr, clients)")
    return trace


def plot_fn_growth(a, plt):
    """One panel per trace (e.g. FedFN's and FedAvg's replay of the same round), one line per client of the traced
    round: mean ||f|| on its probe at each local step (log scale, one y axis for all panels), labelled with its
    samples and the share of its largest class (from the run's partition.json beside the trace's run)."""
    try:  # every trace read and checked before anything is drawn
        traces = [(os.path.splitext(os.path.basename(path))[0], load_trace(path)) for path in a.paths]
    except ValueError as e:
        print(f"plot.py fn-growth: {e}", file=sys.stderr)
        return 2
    fig, axes = plt.subplots(1, len(traces), figsize=(5.4 * len(traces), 4.0), sharey=True, squeeze=False)
    for ax, (name, trace) in zip(axes[0], traces):
        for c in trace["clients"]:
            label = f"client {c['client']}: n={c['samples']}"
            if "top_share" in c:
                label += f", {100 * c['top_share']:.0f}% one class"
            ax.plot([t[0] for t in c["trace"]], label=label)
        ax.set_yscale("log")
        ax.set_xlabel("local step")
        ax.set_title(f"{name}: round {trace['round']} (lr {trace['lr']:g}), ||f|| inside local training", fontsize=9)
        ax.legend(fontsize=6, ncol=2)
    axes[0][0].set_ylabel("mean ||f|| on the client's probe batch")
    fig.tight_layout()
    fig.savefig(a.out, dpi=120)
    print(f"wrote {a.out}")
    return 0


def plot_partition(a, plt):
    try:
        counts, scheme, names, clients = load_partition(a.path, a.split)
    except ValueError as e:
        print(f"plot.py partition: {e}", file=sys.stderr)
        return 2
    n, c = counts.shape
    fig, ax = plt.subplots(figsize=(min(12.0, max(4.5, 0.09 * n + 3.0)), max(2.6, 0.25 * c + 1.2)))
    masked = np.ma.masked_equal(counts.T, 0)  # empty cells stay white
    image = ax.imshow(
        masked, aspect="auto", cmap="viridis", interpolation="nearest", vmin=0, vmax=max(int(counts.max()), 1)
    )
    fig.colorbar(image, ax=ax, label="samples", pad=0.01)
    if n * c <= 200:  # few cells: write the counts in them
        for k in range(n):
            for j in range(c):
                if counts[k, j]:
                    light = counts[k, j] > 0.6 * counts.max()  # viridis is light at the top of the scale
                    ax.text(k, j, str(counts[k, j]), ha="center", va="center", fontsize=6, color="k" if light else "w")
    ax.set_yticks(range(c))
    ax.set_yticklabels(names, fontsize=7)
    ax.set_xlabel(f"client (0-{n - 1})")
    if n <= 20:
        ax.set_xticks(range(n))
        if clients:  # each client's folder or domain
            ax.set_xticklabels(clients, fontsize=6, rotation=90)
    sizes = counts.sum(1)
    ax.set_title(
        a.title
        or f"{scheme}: {n} clients x {c} classes, {counts.sum()} {a.split} samples\n"
        f"(client sizes {sizes.min()}-{sizes.max()}, classes per client "
        f"{(counts > 0).sum(1).min()}-{(counts > 0).sum(1).max()})",
        fontsize=8,
    )
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    fig.savefig(a.out, dpi=110)
    plt.close(fig)
    print(a.out)
    return 0


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------
def positive_int(text):
    n = int(text)  # ValueError: argparse's "invalid positive_int value"
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text} is not >= 1")
    return n


def parser():
    p = argparse.ArgumentParser(
        prog="benchmarks/plot.py",
        description=__doc__.split("\n\n")[0],
        epilog="Without a subcommand the arguments are the claims mode's (the old form).",
    )
    sub = p.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")  # every one in the usage line
    c = sub.add_parser("claims", help="one PNG per reproduced claim: RUNS_DIR/<claim>-<scale>/<variant>/seed<k>")
    c.add_argument(
        "root",
        nargs="?",
        default=os.path.join("runs", "reproduce"),
        metavar="RUNS_DIR",
        help="the RUNS_DIR of benchmarks/reproduce/*.sh (e.g. benchmarks/results)",
    )
    c.add_argument("--out", default="docs", help="folder for the PNGs (<claim>-<scale>.png)")
    c.add_argument("--claim", default=None, help="only this claim (e.g. fedln, fedfn-s2)")
    r = sub.add_parser("runs", help="any run folders in one PNG: test accuracy and train loss per round")
    r.add_argument(
        "folders",
        nargs="+",
        metavar="RUN",
        help="run folders (with config.json); a folder without one stands for every run folder below it",
    )
    r.add_argument("--out", default="runs.png", help="the PNG to write")
    r.add_argument(
        "--mean-seeds",
        action="store_true",
        help="one line per configuration: mean and +- std over runs that differ only in --seed",
    )
    r.add_argument("--title", default=None, help="figure title (default: the settings all runs share)")
    r.add_argument(
        "--max-runs",
        type=positive_int,
        default=MAX_RUNS,
        metavar="N",
        help="refuse more lines than N (runs, or configurations with --mean-seeds): a legend line each "
        "(default: %(default)s)",
    )
    t = sub.add_parser("partition", help="a run's partition.json as a clients x classes heatmap of label counts")
    t.add_argument("path", metavar="RUN", help="a run folder, or its partition.json")
    t.add_argument("--out", default="partition.png", help="the PNG to write")
    t.add_argument(
        "--split",
        default="train",
        choices=["train", "test"],
        help="training counts, or the per-client test sets' (--client-test)",
    )
    t.add_argument("--title", default=None, help="figure title (default: scheme, clients, classes, sizes)")
    g = sub.add_parser("fn-growth", help="benchmarks/fn_growth.py --json: each client's mean ||f|| per local step")
    g.add_argument("paths", metavar="JSON", nargs="+", help="traces benchmarks/fn_growth.py --json wrote: a panel each")
    g.add_argument("--out", default="fn-growth.png", help="the PNG to write")
    return p


def parse(argv):
    """Parse argv; without a subcommand it is the claims mode's old form [RUNS_DIR] [--out] [--claim]."""
    argv = list(argv)
    if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help")):
        argv = ["claims", *argv]
    return parser().parse_args(argv)


def main(argv=None):
    a = parse(sys.argv[1:] if argv is None else argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "benchmarks/plot.py needs matplotlib, an optional benchmark-only dependency:\n"
            "    pip install -r benchmarks/requirements.txt",
            file=sys.stderr,
        )
        return 1
    commands = {"claims": plot_claims, "runs": plot_runs, "partition": plot_partition, "fn-growth": plot_fn_growth}
    return commands[a.command](a, plt)


if __name__ == "__main__":
    sys.exit(main())

"""Collect the reproduction runs into markdown tables, one per claim.

Reads RUNS/<claim>-<scale>/<variant>/seed<k>/{summary.json, config.json, metrics.jsonl, command.txt}
as written by benchmarks/reproduce/*.sh and prints, per claim and scale, one row per variant: mean
+- std over seeds of the FINAL-round accuracy (summary.json; never the best round's), the number of
seeds, the paper's number beside it, mean wall time, device, torch version and the command.

    python benchmarks/collect.py                    # runs/reproduce
    python benchmarks/collect.py RUNS_DIR --claim fedln
    python benchmarks/collect.py RUNS_DIR --claim fedfn-s2 --scale proxy --trace head_row_norm

--trace KEY adds, per claim, a second table: KEY at each evaluated round (mean over the finished seeds that
logged it at that round) per variant, and its change over the last quarter of the run (from the last
evaluation at or before 3/4 of the final round to the final one), which says whether it still grows.

Accuracies are in percent; std is the sample standard deviation over seeds (ddof=1; "-" for one
seed). Runs without summary.json (unfinished) are left out and listed; diverged runs
(summary.json "diverged": true) are counted apart and left out of the mean. Standard library and
numpy only.
"""

import argparse
import glob
import json
import os
import re
import shlex
import sys

import numpy as np

SCALES = ("small", "proxy", "paper")

# Per claim: title, the paper's setting, variants in display order, and the reported quantities.
# Each quantity: (column label, where: ("summary", key) or ("summary_by_epoch", epoch) or
# ("at_fraction", f): the test accuracy of the last evaluation at or before f * final round, or ("last_mean", k): the
# mean test accuracy of the last k evaluations (where single evaluations swing); paper numbers per variant (strings,
# in percent, with their table), or None).
LAST5 = ("mean of the last 5 evaluations", ("last_mean", 5), None)
CLAIMS = {
    "fedfn-s2": {
        "title": "Claim 1: FedFN vs FedAvg, s=2 shards per client (fedfn.md Table 1, VGG11, CIFAR-10)",
        "variants": ["fedavg", "fedfn"],
        "controls": ["fedfn-lr0.01", "fedfn-sqrtd"],  # ours (small scale): FedFN at FedAvg's lr 0.01 instead of its
        # tuned 0.03; and at lr 0.01 with the unit feature scaled by sqrt(d) (--fn-scale sqrt-d)
        "metrics": [("final test acc", ("summary", "test_acc"), {"fedavg": "74.24", "fedfn": "77.77"})],
    },
    "fedfn-s10": {
        "title": "Claim 1: FedFN vs FedAvg, s=10 shards per client (fedfn.md Table 1, VGG11, CIFAR-10)",
        "variants": ["fedavg", "fedfn"],
        "controls": ["fedfn-lr0.01", "fedfn-sqrtd"],  # ours (small scale): FedFN at FedAvg's lr 0.01 instead of its
        # tuned 0.03; and at lr 0.01 with the unit feature scaled by sqrt(d) (--fn-scale sqrt-d)
        "metrics": [("final test acc", ("summary", "test_acc"), {"fedavg": "81.97", "fedfn": "83.80"})],
    },
    "fedfn-a0.1": {
        "title": "Claim 1: FedFN vs FedAvg, Dirichlet alpha=0.1 (fedfn.md Table 8, VGG11, CIFAR-10, one seed)",
        "variants": ["fedavg", "fedfn"],
        # ours (proxy, one seed): FedFN at FedAvg's lr; FN scaled to sqrt(d); weight decay 1e-5 (FedNTD's config);
        # (every seed) E=5 local epochs instead of the proxy's 2, toward the paper's 15
        "controls": ["fedfn-lr0.01", "fedfn-sqrtd", "fedavg-wd1e-5", "fedfn-wd1e-5", "fedavg-e5", "fedfn-e5"],
        "metrics": [("final test acc", ("summary", "test_acc"), {"fedavg": "73.16", "fedfn": "75.58"}), LAST5],
    },
    "fedfn-a0.5": {
        "title": "Claim 1: FedFN vs FedAvg, Dirichlet alpha=0.5 (fedfn.md Table 8, VGG11, CIFAR-10, one seed)",
        "variants": ["fedavg", "fedfn"],
        "metrics": [("final test acc", ("summary", "test_acc"), {"fedavg": "81.63", "fedfn": "83.06"}), LAST5],
    },
    "fedbabu": {
        "title": "Claim 2: FedBABU vs FedAvg personalization "
        "(fedbabu.md Tables 12-13, 4convNet, CIFAR-10, s=10, f=0.1, tau=10)",
        "variants": ["fedavg", "fedbabu"],
        "metrics": [
            (
                "personalized (5 ft epochs)",
                ("summary", "pers_acc_mean"),
                {"fedavg": "69.11 (T13)", "fedbabu": "76.25 (T13)"},
            ),
            (
                "initial (0 ft epochs)",
                ("summary", "init_acc_mean"),
                {"fedavg": "57.32 (T12)", "fedbabu": "62.68 (T12)"},
            ),
            ("without head", ("summary", "nohead_acc_mean"), {"fedavg": "63.19 (T12)", "fedbabu": "67.58 (T12)"}),
            ("after 1 ft epoch", ("summary_by_epoch", "1"), None),
            ("after 2 ft epochs", ("summary_by_epoch", "2"), None),
            ("after 10 ft epochs", ("summary_by_epoch", "10"), None),
            ("global test acc", ("summary", "test_acc"), None),  # the final global model on the whole test set
        ],
        "note": "Accuracies are means over clients of per-client test accuracy (Algorithm 2); +- is over seeds, "
        "the paper's +- (not shown) is over clients. Speed (Table 6) is only given for CIFAR-100/MobileNet "
        "in the paper: FedAvg 14.40 / 27.43 / 48.63 / 62.67, FedBABU 18.50 / 63.29 / 66.05 / 66.32 after "
        "0 / 1 / 2 / 5 fine-tuning epochs.",
    },
    "fedln": {
        "title": "Claim 3: normalization with one class per client (fedln.md Table 10, CNN, E=10; Table 4)",
        "variants": ["ln", "fn", "vanilla", "bn", "gn"],
        "metrics": [
            (
                "final test acc",
                ("summary", "test_acc"),
                {
                    "ln": "78.04 (T10), 77.71 (T4)",
                    "fn": "77.14 (T10), 77.14 (T4)",
                    "vanilla": "55.86 (T10), 56.82 (T4)",
                    "bn": "9.63 (T4)",
                    "gn": "77.15 (T4)",
                },
            )
        ],
    },
    "fednnnn": {
        "title": "Claim 4: FedNNNN vs FedAvg / Norm-Norm / Momentum (fednnnn.md Table 2, CIFAR-10 non-IID-B; Fig. 7)",
        "variants": ["fedavg", "fedprox", "normnorm", "momentum", "fednnnn"],
        "metrics": [
            (
                "final test acc",
                ("summary", "test_acc"),
                {"fedavg": "72.6", "fedprox": "74.2", "normnorm": "76.7", "momentum": "74.3", "fednnnn": "76.7"},
            ),
            ("test acc at 1/4 of the rounds", ("at_fraction", 0.25), None),
            ("test acc at 1/2 of the rounds", ("at_fraction", 0.5), None),
            LAST5,
        ],
        "note": "Convergence speed: the paper shows it only as curves (Fig. 7); the 1/4 and 1/2 columns and "
        "docs/fednnnn-<scale>.png are ours.",
    },
    "anfr": {
        "title": "Claim 5: ANFR vs BN/GN/SE/NF-ResNets, CIFAR-10 split-2, FedAvg (anfr.md Table 9, random init)",
        "variants": ["bn", "gn", "se", "nf", "anfr"],
        # ours (small scale), drawn dashed: IID clients; NF last gains from 1
        "controls": ["bn-iid", "anfr-iid", "nf-gain1", "anfr-gain1"],
        "metrics": [
            (
                "final test acc",
                ("summary", "test_acc"),
                {"bn": "80.89", "gn": "78.52", "se": "81.19", "nf": "81.66", "anfr": "83.20"},
            )
        ],
        "note": "Table 1 (ImageNet-pretrained, FedAvg): BN 91.71, GN 96.60, SE 94.07, NF 96.72, ANFR 97.42; "
        "not comparable to runs from random init. The -iid and -gain1 rows (small scale only) are our "
        "controls: the same runs on IID clients, and with the NF blocks' last gains starting at 1 "
        "instead of timm's 0 (--last-gain-init 1).",
    },
}
# Claim 5 under Pieri et al.'s recipe with timm's init (benchmarks/reproduce/anfr.sh RECIPE=paper), named by the
# augmentation its runs used (AUGMENT): anfr-cropflip (4-pixel pad-crop and flip at 32x32, small and proxy scale) and
# anfr-rrc (the recipe's RandomResizedCrop; at paper scale the only one). At small and proxy scale both add Table 9's
# central column: <arch>-central, one client holding all the training data for a federated client's steps, and
# {bn,nf,anfr}-central-total (first seed) for the federation's total steps; drawn as controls (not federated).
TABLE9 = CLAIMS["anfr"]["metrics"][0][2]
CENTRAL = [f"{arch}-central" for arch in CLAIMS["anfr"]["variants"]]
CENTRAL += [f"{arch}-central-total" for arch in ("bn", "nf", "anfr")]
AUGMENTS = {"cropflip": "with a 4-pixel pad-crop and flip in place of its", "rrc": "with its"}
for augment, what in AUGMENTS.items():
    CLAIMS[f"anfr-{augment}"] = {
        "title": f"Claim 5: ANFR vs BN/GN/SE/NF, split-2, FedAvg (anfr.md Table 9), Pieri et al.'s recipe {what} "
        "RandomResizedCrop (area 5-100%, no flip), timm's init",
        "variants": ["bn", "gn", "se", "nf", "anfr"],
        # ours, one seed: AGC; no warm-up
        "controls": CENTRAL + (["nf-agc", "anfr-agc", "nf-nowarmup", "anfr-nowarmup"] if augment == "cropflip" else []),
        "metrics": [
            ("test acc at best val (the paper's)", ("summary", "test_acc_at_best_val"), TABLE9),
            ("final test acc", ("summary", "test_acc"), None),
            ("mean |last gain|", ("summary", "last_gain_abs_mean"), None),
        ],
        "note": "Each client keeps its batch-norm statistics; test and validation accuracies are means over the "
        "clients' models. The -central rows are Table 9's central column (one client holding all the data; "
        "-central-total: the federation's total steps, one seed)."
        + (" The -agc and -nowarmup rows are our one-seed controls (adaptive gradient clipping in place of norm "
           "clipping; no warm-up)." if augment == "cropflip" else ""),
    }  # fmt: skip
DEFAULT_CLAIM = {"title": None, "variants": [], "metrics": [("final test acc", ("summary", "test_acc"), None)]}

# Flags that default to True in that script: False is written "--no-<flag>", True not at all.
NEGATED = {"fedfn": {"fn"}, "fedln": {"ln_affine"}, "fedbabu": {"client_test"}}
# config.json keys that are not flags of that script (set by the script itself).
NOT_FLAGS = {"anfr": {"model"}}


def split_claim(name):
    """'fedfn-s2-small' -> ('fedfn-s2', 'small'); a folder without a scale suffix -> (name, '')."""
    for scale in SCALES:
        if name.endswith("-" + scale):
            return name[: -len(scale) - 1], scale
    return name, ""


def read_json(path):
    with open(path) as f:
        return json.load(f)


def read_metrics(path):
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def load_run(run_dir):
    """One seed's folder -> dict, or None when it has no summary.json (not finished)."""
    path = os.path.join(run_dir, "summary.json")
    if not os.path.isfile(path):
        return None
    run = {"dir": run_dir, "summary": read_json(path), "metrics": read_metrics(os.path.join(run_dir, "metrics.jsonl"))}
    cfg = os.path.join(run_dir, "config.json")
    run["config"] = read_json(cfg) if os.path.isfile(cfg) else None
    cmd = os.path.join(run_dir, "command.txt")
    run["command"] = open(cmd).read().strip() if os.path.isfile(cmd) else None
    return run


def final_accuracy(run, key="test_acc"):
    """The final round's value: summary.json (written after the last round), else the metrics.jsonl
    row of the final round. Never the maximum over rounds."""
    s = run["summary"]
    if key in s and s[key] is not None:
        return float(s[key])
    rows = [r for r in run["metrics"] if key in r]
    final = s.get("final_round")
    if rows and (final is None or rows[-1]["round"] == final):
        return float(rows[-1][key])
    return None


def value(run, where):
    kind, arg = where
    if kind == "summary":
        return final_accuracy(run, arg)
    if kind == "summary_by_epoch":
        v = run["summary"].get("pers_acc_mean_by_epoch", {}).get(str(arg))
        return None if v is None else float(v)
    if kind == "at_fraction":
        final = run["summary"].get("final_round") or max((r["round"] for r in run["metrics"]), default=0)
        rows = [r for r in run["metrics"] if "test_acc" in r and r["round"] <= arg * final]
        return float(rows[-1]["test_acc"]) if rows else None
    if kind == "last_mean":
        rows = [float(r["test_acc"]) for r in run["metrics"] if "test_acc" in r][-arg:]
        return sum(rows) / len(rows) if len(rows) == arg else None
    raise ValueError(kind)


def mean_std(values):
    """(mean, sample std with ddof=1 or None for one value, n) of a list of numbers."""
    a = np.asarray(values, dtype=float)
    if a.size == 0:
        return None, None, 0
    return float(a.mean()), (float(a.std(ddof=1)) if a.size > 1 else None), int(a.size)


def fmt_pct(mean, std):
    if mean is None:
        return "-"
    return f"{100 * mean:.2f}" + (f" ± {100 * std:.2f}" if std is not None else "")


def command_of(run):
    """The command of this run: command.txt (written by the reproduce scripts), else rebuilt from
    config.json (every flag, the data folder as $DATA_DIR). Seed and --out are left out."""
    if run["command"]:
        words = shlex.split(run["command"])
        out = []
        skip = False
        for w in words:
            if skip:
                skip = False
                continue
            if w in ("--seed", "--out"):
                skip = True
                continue
            out.append(w)
        return " ".join(shlex.quote(w) if w != "$DATA_DIR" else '"$DATA_DIR"' for w in out)
    cfg, script = run["config"], run["summary"].get("script")
    if cfg is None or script is None:
        return "?"
    return rebuild_command(script, cfg, skip=("seed", "out"))


def rebuild_command(script, cfg, skip=()):
    """python <script>.py --flag value ... from a config.json dict (keys are argparse dests)."""
    words = ["python", f"{script}.py"]
    negated, not_flags = NEGATED.get(script, set()), NOT_FLAGS.get(script, set())
    for key, v in cfg.items():
        if key in skip or key in not_flags or key in ("script", "overwrite") or v is None:  # not flags of a run
            continue
        if key == "data_seed" and v == cfg.get("seed"):
            continue  # the default: --data-seed = --seed
        flag = "--" + key.replace("_", "-")
        if key == "data_dir" and cfg.get("dataset") == "folder":
            words += [flag, '"$DATA_DIR"']
        elif isinstance(v, bool):
            if key in negated:  # default True: only False is written, as --no-<flag>
                if not v:
                    words.append("--no-" + key.replace("_", "-"))
            elif v:
                words.append(flag)
        elif isinstance(v, list):
            words += [flag, *map(str, v)]
        else:
            words += [flag, shlex.quote(str(v))]
    return " ".join(words)


def seed_of(run_dir):
    m = re.search(r"seed(\d+)$", os.path.basename(os.path.normpath(run_dir)))
    return int(m.group(1)) if m else None


def gather(root):
    """{(claim, scale): {variant: {"runs": [...], "unfinished": [dirs]}}}."""
    found = {}
    for seed_dir in sorted(glob.glob(os.path.join(root, "*", "*", "seed*"))):
        if not os.path.isdir(seed_dir):
            continue
        variant_dir = os.path.dirname(seed_dir)
        claim, scale = split_claim(os.path.basename(os.path.dirname(variant_dir)))
        entry = found.setdefault((claim, scale), {}).setdefault(
            os.path.basename(variant_dir), {"runs": [], "unfinished": []}
        )
        run = load_run(seed_dir)
        if run is None:
            entry["unfinished"].append(seed_dir)
        else:
            entry["runs"].append(run)
    return found


def variant_order(spec, variants):
    """The claim's variants, then its controls, in their listed order; unknown ones sorted at the end."""
    listed = spec["variants"] + spec.get("controls", [])
    return [v for v in listed if v in variants] + sorted(v for v in variants if v not in listed)


def table(claim, scale, variants):
    """Markdown lines for one claim and scale."""
    spec = CLAIMS.get(claim, DEFAULT_CLAIM)
    title = spec["title"] or f"{claim}"
    lines = [f"### {title}" + (f" [{scale}]" if scale else ""), ""]
    header = ["variant"]
    for label, _, paper in spec["metrics"]:
        header.append(f"{label} (%)")
        if paper is not None:
            header.append("paper")
    header += ["seeds", "wall time (min, mean)", "device", "torch", "command (+ --seed K)"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    notes = []
    for variant in variant_order(spec, variants):
        entry = variants[variant]
        ok = [r for r in entry["runs"] if not r["summary"].get("diverged")]
        diverged = [r for r in entry["runs"] if r["summary"].get("diverged")]
        row = [variant]
        for label, where, paper in spec["metrics"]:
            vals = [v for v in (value(r, where) for r in ok) if v is not None]
            mean, std, _ = mean_std(vals)
            row.append(fmt_pct(mean, std))
            if paper is not None:
                row.append(paper.get(variant, "-"))
        seeds = sorted(seed_of(r["dir"]) for r in ok)
        seeds_txt = f"{len(ok)} ({', '.join(map(str, seeds))})" if ok else "0"
        if diverged:
            seeds_txt += f" + {len(diverged)} diverged"
        row.append(seeds_txt)
        walls = [r["summary"]["wall_time_s"] for r in entry["runs"] if "wall_time_s" in r["summary"]]
        row.append(f"{np.mean(walls) / 60:.1f}" if walls else "-")
        row.append(", ".join(sorted({str(r["summary"].get("device", "?")) for r in entry["runs"]})) or "-")
        row.append(", ".join(sorted({str(r["summary"].get("torch", "?")) for r in entry["runs"]})) or "-")
        cmds = sorted({command_of(r) for r in entry["runs"]})
        row.append("<br>".join(f"`{c}`" for c in cmds) if cmds else "-")
        lines.append("| " + " | ".join(row) + " |")
        for d in entry["unfinished"]:
            notes.append(f"unfinished (no summary.json, not counted): {d}")
        for r in diverged:
            notes.append(f"diverged at round {r['summary'].get('round', '?')} (not in the mean): {r['dir']}")
    lines.append("")
    if spec.get("note"):
        lines += [spec["note"], ""]
    lines += [f"- {n}" for n in notes]
    if notes:
        lines.append("")
    return lines


def trace(variants, spec, key):
    """Markdown lines: KEY per evaluated round (mean over finished seeds) per variant, then the change of the
    mean over the last quarter: from the last evaluation at or before 3/4 of the final round to the final one."""
    names = [v for v in variant_order(spec, variants) if variants[v]["runs"]]
    per = {}  # variant -> {round: [values over seeds]}
    for v in names:
        for run in variants[v]["runs"]:
            for row in run["metrics"]:
                if row.get(key) is not None:
                    per.setdefault(v, {}).setdefault(row["round"], []).append(float(row[key]))
    names = [v for v in names if v in per]
    if not names:
        return [f"(no run logged {key})", ""]
    rounds = sorted({r for v in names for r in per[v]})
    lines = [f"{key} per evaluation (mean over seeds):", "", "| round | " + " | ".join(names) + " |"]
    lines.append("|" + "---|" * (len(names) + 1))
    for r in rounds:
        cells = [f"{np.mean(per[v][r]):.4g}" if r in per[v] else "-" for v in names]
        lines.append(f"| {r} | " + " | ".join(cells) + " |")
    lines.append("")
    for v in names:
        final = max(per[v])
        earlier = [r for r in per[v] if r <= 0.75 * final]
        if not earlier:
            continue
        start = max(earlier)
        a, b = np.mean(per[v][start]), np.mean(per[v][final])
        change = f"{100 * (b - a) / abs(a):+.1f}%" if a != 0 else "-"
        lines.append(
            f"- {v}: {key} {a:.4g} at round {start} -> {b:.4g} at round {final} ({change} in the last quarter)"
        )
    lines.append("")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "root", nargs="?", default=os.path.join("runs", "reproduce"), help="the RUNS_DIR of the reproduce scripts"
    )
    p.add_argument("--claim", default=None, help="only this claim (e.g. fedln, fedfn-s2)")
    p.add_argument("--scale", default=None, choices=SCALES, help="only this scale")
    p.add_argument("--trace", default=None, metavar="KEY", help="also KEY (a metrics.jsonl key) per evaluation")
    a = p.parse_args(argv)
    found = gather(a.root)
    if not found:
        print(f"no runs under {a.root}/<claim>-<scale>/<variant>/seed<k>", file=sys.stderr)
        return 1
    order = list(CLAIMS)
    keys = sorted(found, key=lambda k: (order.index(k[0]) if k[0] in order else len(order), k[0], k[1]))
    for claim, scale in keys:
        if (a.claim and claim != a.claim) or (a.scale and scale != a.scale):
            continue
        print("\n".join(table(claim, scale, found[(claim, scale)])))
        if a.trace:
            print("\n".join(trace(found[(claim, scale)], CLAIMS.get(claim, DEFAULT_CLAIM), a.trace)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

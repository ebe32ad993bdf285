"""Accuracy-per-round curves of each reproduced comparison into docs/<claim>-<scale>.png (issue 8).

For every RUNS/<claim>-<scale>/ folder, one line per variant: the test accuracy of metrics.jsonl
per evaluated round, averaged over the seeds that evaluated that round, with a band of +- one std
over seeds (ddof=1) where there are several; a claim's controls (collect.CLAIMS) are dashed.
Unfinished runs are drawn too (their rounds so far).

    pip install -r benchmarks/requirements.txt    # matplotlib: only the benchmarks need it
    python benchmarks/plot.py                      # runs/reproduce -> docs/
    python benchmarks/plot.py RUNS_DIR --out docs --claim fedln
"""
import argparse
import glob
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from collect import CLAIMS, read_metrics, split_claim, variant_order, DEFAULT_CLAIM  # noqa: E402


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
        rounds = sorted(per_round)
        mean = np.array([np.mean(per_round[r]) for r in rounds])
        std = np.array([np.std(per_round[r], ddof=1) if len(per_round[r]) > 1 else 0.0 for r in rounds])
        out[os.path.basename(variant_dir)] = (np.array(rounds), mean, std, len(seeds))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root", nargs="?", default=os.path.join("runs", "reproduce"), help="the RUNS_DIR of the reproduce scripts")
    p.add_argument("--out", default="docs", help="folder for the PNGs")
    p.add_argument("--claim", default=None, help="only this claim (e.g. fedln, fedfn-s2)")
    a = p.parse_args(argv)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("benchmarks/plot.py needs matplotlib, an optional benchmark-only dependency:\n"
              "    pip install -r benchmarks/requirements.txt", file=sys.stderr)
        return 1
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
            ax.plot(rounds, mean, marker="." if len(rounds) < 40 else None, label=f"{variant} ({n} seed{'s' if n != 1 else ''})",
                    linestyle="--" if variant in spec.get("controls", []) else "-")
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


if __name__ == "__main__":
    sys.exit(main())

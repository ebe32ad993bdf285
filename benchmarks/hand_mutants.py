"""Hand-written mutants of the math: each replaces one exact snippet of a script, runs the in-process
tests that should catch it, and restores the file. Complements mutmut (tests/README.md), whose one-token
mutants cannot express e.g. "the control variate with its sign flipped and scaled by 7".

    OMP_NUM_THREADS=1 python benchmarks/hand_mutants.py          # all; prints KILLED / SURVIVED per mutant

Exit status 1 if any mutant survives. Restores every file, also on Ctrl-C.
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (name, file, original snippet, mutated snippet, pytest selection)
MUTANTS = [
    (
        "scaffold c_i+: sign flipped and x7",
        "common.py",
        "return {n: c_i[n] - c[n] + (x[n] - y[n]) / step_sum for n in c_i}",
        "return {n: -7 * (c_i[n] - c[n] + (x[n] - y[n]) / step_sum) for n in c_i}",
        "tests/test_common.py -k scaffold",
    ),
    (
        "scaffold correction c_i - c instead of c - c_i",
        "common.py",
        "return {n: c[n] - c_i[n] for n in c}",
        "return {n: c_i[n] - c[n] for n in c}",
        "tests/test_common.py -k scaffold",
    ),
    (
        "scaffold server divides by |S| (no N)",
        "common.py",
        "return {n: c[n] + delta_sum[n] / num_clients for n in c}",
        "return {n: c[n] + delta_sum[n] for n in c}",
        "tests/test_common.py -k scaffold",
    ),
    (
        "scaffold K instead of K' (momentum ignored)",
        "fedfn.py",
        'local_step_sum(out["steps"], lr, args.momentum)',
        'local_step_sum(out["steps"], lr)',
        "tests/test_fedfn.py -k momentum_step_sum",
    ),
    (
        "local step sum: rho^K -> rho^(K-1)",
        "common.py",
        "momentum * (1 - momentum**steps)",
        "momentum * (1 - momentum ** (steps - 1))",
        "tests/test_common.py -k step_sum",
    ),
    (
        "FedEXP: drop the factor 2",
        "fedfn.py",
        "float(sq_norm_mean) / (2 * (float(avg_update_sq_norm) + eps))",
        "float(sq_norm_mean) / (float(avg_update_sq_norm) + eps)",
        "tests/test_fedfn.py -k fedexp",
    ),
    (
        "FedEXP: step from the average, not from w_t",
        "fedfn.py",
        "p.copy_(x0 + eta_g * (p - x0))",
        "p.copy_(p + eta_g * (p - x0))",
        "tests/test_fedfn.py -k fedexp",
    ),
    ("FedEXP: midpoint not halved", "fedfn.py", "p.add_(x0).mul_(0.5)", "p.add_(x0)", "tests/test_fedfn.py -k fedexp"),
    (
        "FN: normalize each feature dimension (over the batch)",
        "fedfn.py",
        "f / f.norm(dim=1, keepdim=True)",
        "f / f.norm(dim=0, keepdim=True)",
        "tests/test_fedfn.py -k fn_logits",
    ),
    (
        "FedLN's scale norm: sqrt(d) taken from the batch size",
        "fedln.py",
        "s = math.sqrt(flat.shape[1]) if",
        "s = math.sqrt(flat.shape[0]) if",
        "tests/test_fedln.py -k scale_norm",
    ),
    (
        "FN: scale dropped",
        "fedfn.py",
        "return model.head(s * (f /",
        "return model.head((f /",
        "tests/test_fedfn.py -k fn_logits",
    ),
    (
        "FedProx: mu instead of mu/2 (fedfn's tests)",
        "common.py",
        "return mu / 2 * sum(",
        "return mu * sum(",
        "tests/test_fedfn.py -k prox",
    ),
    (
        "FedProx: mu instead of mu/2 (fedavg's tests)",
        "common.py",
        "return mu / 2 * sum(",
        "return mu * sum(",
        "tests/test_fedavg.py -k 'prox_term or fedprox_step'",
    ),
    (
        "FedProx: (w + w_t)",
        "common.py",
        "sum((w - w0).pow(2).sum()",
        "sum((w + w0).pow(2).sum()",
        "tests/test_fedavg.py -k 'prox_term or fedprox_step'",
    ),
    (
        "load_average: integer buffers truncated (the old behaviour)",
        "common.py",
        "else v.round() for k, v in total.items()",
        "else v for k, v in total.items()",
        "tests/test_fedavg.py -k aggregate",
    ),
    (
        "fedbabu aggregate: the head averaged too (FedAvg)",
        "fedbabu.py",
        "    if not train_head:  # FedBABU: the head is not aggregated",
        "    if False:  # FedBABU: the head is not aggregated",
        "tests/test_fedbabu.py -k 'aggregate or head_survives'",
    ),
    (
        "accumulate: weight ignored",
        "common.py",
        "total[k] += weight * v.float()",
        "total[k] += v.float()",
        "tests/test_fedavg.py -k 'accumulate or aggregate'",
    ),
    (
        "client weights: uniform for samples",
        "common.py",
        'if weighting == "uniform":',
        "if True:",
        "tests/test_fedavg.py -k client_weights",
    ),
    (
        "shards: one shard too many",
        "common.py",
        'num_shards = np.argsort(labels, kind="stable"), n * s',
        'num_shards = np.argsort(labels, kind="stable"), n * s + 1',
        "tests/test_common.py -k 'shards or partition'",
    ),
    (
        "dirichlet: power-law weights ignored",
        "common.py",
        "_cut(idx, rng.dirichlet(np.full(n, alpha)) * weights)",
        "_cut(idx, rng.dirichlet(np.full(n, alpha)))",
        "tests/test_common.py -k dirichlet",
    ),
    (
        "client test split: equal shares instead of training counts",
        "common.py",
        "np.flatnonzero(test_labels == cls)), counts[owners, cls])",
        "np.flatnonzero(test_labels == cls)), np.ones(len(owners)))",
        "tests/test_common.py -k client_test",
    ),
]


def run(selection):
    cmd = f"{sys.executable} -m pytest -q -x -p no:cacheprovider {selection}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, shell=True, cwd=ROOT, env=env, capture_output=True, text=True).returncode


def main():
    survived = []
    for name, path, old, new, selection in MUTANTS:
        full = os.path.join(ROOT, path)
        with open(full) as f:
            source = f.read()
        assert source.count(old) == 1, f"{name}: snippet not found exactly once in {path}"
        try:
            with open(full, "w") as f:
                f.write(source.replace(old, new))
            killed = run(selection) != 0
        finally:
            with open(full, "w") as f:
                f.write(source)
        print(("KILLED  " if killed else "SURVIVED"), f"{name}  [{path}; {selection}]", flush=True)
        if not killed:
            survived.append(name)
    print(f"{len(MUTANTS) - len(survived)}/{len(MUTANTS)} killed")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())

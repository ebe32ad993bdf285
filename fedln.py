"""FedLN / FedFN: Understanding the Role of Layer Normalization in Label-Skewed Federated Learning
(Zhang, Beitollahi, Bie, Chen; TMLR 2024), on FedAvg (McMahan et al. 2017) with the baselines FedProx (Li et al.
2020), SCAFFOLD (Karimireddy et al. 2020) and FedYogi (Reddi et al. 2021).

Idea: with one class per client a client overfits by inflating feature norms (feature collapse, Theorem 1). Layer
normalization after every activation (FedLN), or scaling the last feature to norm sqrt(d), n(z) = sqrt(d) z /
max(eps, ||z||) (FedFN, Eq. 7), bounds the norms and makes FedAvg converge far faster. --norm picks the
normalization (Table 3's variants too), --agg the algorithm.

    python fedln.py --dataset cifar10 --norm ln            # Table 10: the CNN on CIFAR-10, one class a client

Usage (the commands of Tables 1-4 and 10), logged metrics, implementation details (where the norms sit, Table 7's
CNN, FN's sqrt(d) scale, SCAFFOLD, FedYogi, Figure 3's measurements) and results: docs/fedln.md.
"""

import os

# Before torch loads OpenMP: a thread that waits for work spins about 10 microseconds, then sleeps. Longer spins
# are faster alone and far slower beside other runs (docs/speed.md#cpu-threads); the numbers are the same.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")

import argparse
import math

import torch
import torch.nn as nn  # FedLN: the CNN, nn.Sequential to append ScaleNorm
import torch.nn.functional as F

from common import AUGMENTATIONS, DATASETS, MODELS, Parser, Run, build_model, finish_args, load_data, make_partition
from common import accumulate, client_batches, client_weights, each_client, eval_metrics, load_average, lr_at
from common import autocast, prepare_batch, prox_term, sample_clients
from common import decay_rate, device_flag, fraction, inner_fraction, non_negative_float, path_arg, positive_float
from common import TRACKERS, non_negative_int, positive_int, seed_int
from common import Classifier, make_norm, register_model  # FedLN: the CNN
from common import local_step_sum, scaffold_control, scaffold_correction, scaffold_server  # FedLN: SCAFFOLD

# The paper's setting, the defaults of the flags below: Table 7's CNN on CIFAR-10 with one class per client (App.
# C.3, Tables 8-10); FedYogi's and FedProx's constants are App. C.4's.
PAPER = dict(
    dataset="cifar10",
    # n = 1: the paper's "1 class".
    classes_per_client=1,
    num_clients=10,  # K (Table 8)
    # All clients every round.
    frac=1.0,
    rounds=10000,  # T (App. C.3)
    # E: local SGD steps (batches) per round, not epochs (App. C.3).
    local_steps=10,
    batch_size=32,  # B (Table 9)
    # Table 7's bias-free CNN, and its channels.
    model="normcnn",
    width=64,  # Table 7
    lr=0.01,  # eta_l (Table 9)
    # Plain SGD.
    momentum=0.0,
    weight_decay=0.0,
    eval_every=100,
    # FedLN: layer norm after each activation.
    norm="ln",
    server_lr=0.01,  # FedYogi's eta
    yogi_v0=1e-6,  # FedYogi's v_0
    # Ours, as in fedavg.py.
    augment="crop-flip",
)
# FedLN: the models with normalization slots (--norm ln | gn | bn).
NORM_MODELS = ("normcnn", "resnet18", "resnet50")


# FedLN: the paper's CNN with normalization slots.
@register_model("normcnn")
def normcnn(in_channels, num_classes, image_size, norm="none", ln_affine=True, norm_after_act=True, width=64, **_):
    """FedLN's CNN (Table 7): conv5x5-64 (no padding), pool 2, conv5x5-64, pool 2, dense 384, head; ReLU; no bias
    anywhere (Assumption 1). norm (none | ln | gn | bn | fn) fills the slot after each ReLU (App. C.1), or before it
    with norm_after_act=False (Table 6); ln_affine: learnable or static (Table 6); fn: ScaleNorm on the 384-d feature
    only. width: both convs' channels (64; smaller for quick tests)."""

    def layer(op, channels):
        n = make_norm(norm, channels, groups=2, affine=ln_affine, conv=isinstance(op, nn.Conv2d))
        return [op, nn.ReLU(), n] if norm_after_act else [op, n, nn.ReLU()]

    # Computed, not probed: a probe pass would move BN statistics.
    side = ((image_size - 4) // 2 - 4) // 2
    body = nn.Sequential(
        *layer(nn.Conv2d(in_channels, width, 5, bias=False), width),
        nn.MaxPool2d(2),
        *layer(nn.Conv2d(width, width, 5, bias=False), width),
        nn.MaxPool2d(2),
        nn.Flatten(),
        *layer(nn.Linear(width * side * side, 384, bias=False), 384),
    )
    if norm == "fn":
        body.append(ScaleNorm())
    return Classifier(body, 384, num_classes, head_bias=False)


# FedLN: scale normalization as a layer, each sample over all its entries (Eqs. 6-7).
class ScaleNorm(nn.Module):
    """n(z) = s z / max(eps, ||z||_2), s = sqrt(d) (scale="sqrt-d"): ||n(z)|| = sqrt(d), as an n_MV output has."""

    def __init__(self, scale="sqrt-d", eps=1e-5):
        super().__init__()
        self.scale = scale
        self.eps = eps

    def forward(self, z):
        flat = z.flatten(1)
        s = math.sqrt(flat.shape[1]) if self.scale == "sqrt-d" else self.scale
        return s * (z / flat.norm(dim=1).clamp_min(self.eps).view(-1, *[1] * (z.dim() - 1)))


def parse_args():
    p = Parser(__doc__)
    g = p.add_argument_group("FedLN: normalization and aggregation")  # FedLN: the method's flags
    g.add_argument(
        "--norm",
        default=PAPER["norm"],
        choices=["none", "ln", "fn", "gn", "bn", "fn-each", "ln-last"],
        help="ln: layer norm after each activation (FedLN, Table 3 n^L_MV); fn: n(z) = sqrt(d) z / max(eps, ||z||) on"
        " the last feature (FedFN, Eq. 7); gn, bn; none: vanilla; normcnn only: fn-each (n after each activation,"
        " Table 3 n^L), ln-last (mean shift s, then layer norm last: Table 3 / 4 n_MV s^{L-1}, Prop. 2)",
    )
    g.add_argument(
        "--ln-affine",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="gamma, beta of ln/gn/bn: learnable (Table 6 'learnable') or static; normcnn only",
    )
    g.add_argument(
        "--norm-before-act",
        action="store_true",
        help="normalize before each ReLU (Table 6 'before'; resnet18: the standard conv-norm-ReLU ResNet)",
    )
    g.add_argument(
        "--agg",
        default="fedavg",
        choices=["fedavg", "fedprox", "scaffold", "fedyogi"],
        help="FedAvg; FedProx (--prox-mu); SCAFFOLD (Option II); FedYogi (server Yogi on the mean update)",
    )
    g.add_argument("--server-lr", type=positive_float, default=PAPER["server_lr"], help="eta: FedYogi's server lr")
    g.add_argument("--yogi-beta1", type=decay_rate, default=0.9, help="beta_1: FedYogi first-moment decay")
    g.add_argument("--yogi-beta2", type=decay_rate, default=0.99, help="beta_2: FedYogi second-moment decay")
    g.add_argument("--yogi-tau", type=positive_float, default=1e-3, help="tau: FedYogi adaptivity (to sqrt(v))")
    g.add_argument("--yogi-v0", type=non_negative_float, default=PAPER["yogi_v0"], help="v_0: FedYogi's initial v")
    g.add_argument(
        "--track-singular-values",
        action="store_true",
        help="log the singular values of the features of 20 fixed test images of different classes (Fig. 3)",
    )
    g.add_argument(
        "--overfit-client",
        type=non_negative_int,
        metavar="K",
        help="Fig. 3 left (App. D): train client K alone; log ||w_c|| per class, ||g(x)|| of 20 of its images and "
        "the singular values of 20 test images of different classes",
    )
    g = p.add_argument_group("data")
    g.add_argument("--dataset", default=PAPER["dataset"], choices=sorted(DATASETS), help="folder: --data-dir's images")
    g.add_argument("--data-dir", type=path_arg, default="./data", help="download folder, or DIR/{train,test}/<class>/*")
    g.add_argument("--augment", default=PAPER["augment"], choices=AUGMENTATIONS, help="of training batches, on device")
    g = p.add_argument_group("partition: one of these (default: --classes-per-client 1, the paper's)")
    # One of them: the flag given replaces the default.
    x = g.add_mutually_exclusive_group()
    x.add_argument("--iid", action="store_true", help="a uniform random split")
    x.add_argument("--shards", type=positive_int, help="S: N*S sorted shards, S each")
    x.add_argument(
        "--classes-per-client",
        type=positive_int,
        default=PAPER["classes_per_client"],
        help="n classes a client, each split among its holders",  # FedLN: the paper's symbol
    )
    x.add_argument(
        "--alpha",
        type=positive_float,
        help="beta: Dirichlet label skew Dir(beta) (Hsu et al. 2019; the paper's 0.1)",  # FedLN: the paper's symbol
    )
    x.add_argument("--split2", action="store_true", help="CIFAR-10 split-2 (Qu et al. 2022): 5 clients, 4 classes each")
    x.add_argument("--disjoint-classes", action="store_true", help="N disjoint class sets (FedLN T5: 2, 2, 3 of 7)")
    x.add_argument("--natural", action="store_true", help="the clients are the folders DIR/train/<client>/<class>/*")
    g.add_argument("--clients-per-domain", type=positive_int, help="M: DIR/train/<domain>/<class>/*, split M ways each")
    g.add_argument("--quantity", default="equal", choices=["equal", "powerlaw"], help="client sizes")
    g.add_argument("--client-test", action="store_true", help="also test each client on its own label distribution")
    g.add_argument("--balanced-acc", action="store_true", help="also log the balanced accuracy (mean class recall)")
    g.add_argument("--data-seed", type=seed_int, help="seed of the partition (default: --seed)")
    g.add_argument("--val-frac", type=decay_rate, default=0.0, help="share of each client's data held out: val_acc")
    g = p.add_argument_group("federation")
    g.add_argument("--num-clients", type=positive_int, default=PAPER["num_clients"], help="K: number of clients")
    g.add_argument("--frac", type=fraction, default=PAPER["frac"], help="fraction of clients a round, in (0, 1]")
    g.add_argument("--rounds", type=positive_int, default=PAPER["rounds"], help="T: communication rounds")
    g.add_argument(
        "--local-steps",
        type=positive_int,
        default=PAPER["local_steps"],
        help="E: local SGD steps (batches) a round",  # FedLN: steps, not epochs
    )
    g.add_argument("--batch-size", type=positive_int, default=PAPER["batch_size"], help="B: local batch size")
    g.add_argument(
        "--weighting",
        default="samples",
        choices=["samples", "uniform"],
        help="weights m_k/m (Eq. 1), or 1/|S|",  # FedLN: the paper's symbols
    )
    g = p.add_argument_group("optimization")
    g.add_argument(
        "--model",
        default=PAPER["model"],
        choices=sorted(MODELS),
        metavar="NAME",
        help="normcnn (Table 7), resnet18 (App. C.1), cnn, ...",  # FedLN: its models
    )
    g.add_argument(
        "--width",
        type=positive_int,
        default=PAPER["width"],
        help="channels of normcnn's convolutions or resnet18's first stage",  # FedLN: narrow models for CPU runs
    )
    g.add_argument("--lr", type=positive_float, default=PAPER["lr"], help="eta_l: local learning rate")  # FedLN
    g.add_argument("--momentum", type=decay_rate, default=PAPER["momentum"], help="local SGD momentum, reset a round")
    g.add_argument("--weight-decay", type=non_negative_float, default=PAPER["weight_decay"], help="local L2 decay")
    g.add_argument("--lr-decay-at", type=inner_fraction, nargs="*", default=[], help="fractions of the run, e.g. 0.5")
    g.add_argument("--lr-decay", type=fraction, default=0.1, help="lr multiplier at each --lr-decay-at")
    g.add_argument(
        "--prox-mu",
        type=non_negative_float,
        help="mu of --agg fedprox (default there: 0.01, App. C.4); refused with another --agg",  # FedLN
    )
    g = p.add_argument_group("run")
    g.add_argument("--seed", type=seed_int, default=0, help="seed of the init, client sampling and local shuffling")
    g.add_argument("--device", type=device_flag, help="cpu, cuda, cuda:N or mps (default: cuda if there is one)")
    g.add_argument("--amp", action="store_true", help="bfloat16 autocast for forward passes (CPU: often slower)")
    g.add_argument("--threads", type=positive_int, help="CPU threads (default: the cores; OMP_NUM_THREADS)")
    g.add_argument("--eval-every", type=positive_int, default=PAPER["eval_every"], help="evaluation period (and last)")
    g.add_argument("--checkpoint-every", type=positive_int, help="checkpoint period (default: at each evaluation)")
    g.add_argument("--out", type=path_arg, help="run folder (default: runs/fedln__<dataset>__<seed>__<time>)")
    g.add_argument("--overwrite", action="store_true", help="replace the run in --out (else such an --out is refused)")
    g.add_argument("--save-model", action="store_true", help="write the final global model to OUT/model.pt")
    g.add_argument("--resume", type=path_arg, metavar="DIR", help="continue the run in DIR (a larger --rounds: extend)")
    g.add_argument("--stop-after", type=positive_int, help="checkpoint and stop after this many rounds")
    g.add_argument("--track", action="append", choices=TRACKERS, help="also log to TensorBoard or W&B (both: twice)")
    g.add_argument("--wandb-project", default="cleanfl", help="W&B project (--track wandb)")
    g.add_argument("--wandb-entity", help="W&B entity, a user or team (default: W&B's own)")
    return check_args(p, finish_args(p, p.parse_args(), "fedln"))  # FedLN: + this script's flags together


def check_args(p, args):
    """FedLN: this script's flags together. Refuse what cannot run (exit 2, the flag named) and resolve --prox-mu
    (0: no proximal term)."""
    # --model cnn has no slots.
    if args.norm in ("ln", "gn", "bn") and args.model not in NORM_MODELS:
        p.error(
            f"--norm: {args.norm} needs a model with normalization slots ({', '.join(NORM_MODELS)}), not {args.model}"
        )
    # Table 3's variants of the Table 7 CNN.
    if args.norm in ("fn-each", "ln-last") and args.model != "normcnn":
        p.error(f"--norm: {args.norm} is defined for --model normcnn only, not {args.model}")
    if not args.ln_affine and args.model != "normcnn":
        p.error("--no-ln-affine: only normcnn has static normalization layers")
    # --prox-mu is never silently ignored.
    if args.prox_mu and args.agg != "fedprox" and not args.resume:
        p.error(
            f"--prox-mu: the proximal term belongs to --agg fedprox, not --agg {args.agg}; "
            "add --agg fedprox or drop --prox-mu"
        )
    if args.agg == "fedprox":
        # mu = 0.01 unless given (Appendix C.4).
        args.prox_mu = 0.01 if args.prox_mu is None else args.prox_mu
        if args.prox_mu <= 0:
            p.error(f"--prox-mu: --agg fedprox needs mu > 0, got {args.prox_mu}")
    else:
        # 0 = no proximal term (config.json says so; older runs saved an unused 0.01).
        args.prox_mu = 0.0
    # Figure 3 left: client K alone.
    if args.overfit_client is not None:
        if not 0 <= args.overfit_client < args.num_clients:
            p.error(
                f"--overfit-client: K must be in 0..{args.num_clients - 1} (--num-clients {args.num_clients}), "
                f"got {args.overfit_client}"
            )
        if args.agg != "fedavg":
            p.error(f"--overfit-client: trains one client alone, which needs --agg fedavg, not {args.agg}")
    return args


class MeanShift(nn.Module):
    """FedLN: the shift s(x) = x - mu(x) 1 of Prop. 2, mu over each sample's entries ((C, H, W) of a conv map)."""

    def forward(self, x):
        return x - x.flatten(1).mean(1).view(-1, *[1] * (x.dim() - 1))


def build(args, data):
    """FedLN: the model with --norm in its layers (ln | gn | bn) or on its last feature (fn); fn-each and
    ln-last (normcnn) refill the Table 7 CNN's three LN slots: n in each (Table 3 n^L), or s in the first
    two and the LN kept in the last (n_MV s^{L-1}, Prop. 2 / Eq. 8)."""
    base = {"fn": "none", "fn-each": "ln", "ln-last": "ln"}.get(args.norm, args.norm)
    model = build_model(
        args.model, data, norm=base, ln_affine=args.ln_affine, norm_after_act=not args.norm_before_act, width=args.width
    )
    # g(x) = n(vanilla body(x)): scale-normalizing the last feature only (Prop. 1, Eq. 7).
    if args.norm == "fn":
        model.body = nn.Sequential(model.body, ScaleNorm(eps=1e-5))
    # Table 3: the slots are the GroupNorm(1, C) layers of --norm ln.
    if args.norm in ("fn-each", "ln-last"):
        slots = [i for i, m in enumerate(model.body) if isinstance(m, nn.GroupNorm)]
        for i in slots if args.norm == "fn-each" else slots[:-1]:
            model.body[i] = ScaleNorm(eps=1e-5) if args.norm == "fn-each" else MeanShift()
    return model


def local_train(model, indices, data, args, lr, global_params, correction=None):
    """--local-steps of SGD on one client; returns the mean training loss (a tensor).  FedLN: steps, and
    correction: SCAFFOLD's c - c_k per parameter (None for the other --agg)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum, weight_decay=args.weight_decay)
    model.train()
    loss_sum = torch.zeros((), device=args.device)
    seen = 0
    for batch in client_batches(indices, args.batch_size, steps=args.local_steps):  # FedLN: E steps (Appendix C.3)
        x = prepare_batch(data.x_train[batch], data, args.augment)
        y = data.y_train[batch]
        with autocast(args.device, args.amp):
            loss = F.cross_entropy(model(x).float(), y)
        if args.agg == "fedprox":  # FedLN: --agg fedprox adds mu/2 ||w - w_t||^2
            loss = loss + prox_term(model.parameters(), global_params, args.prox_mu)  # Li et al. 2020, Eq. 2
        opt.zero_grad(set_to_none=True)
        loss.backward()
        # FedLN: SCAFFOLD y <- y - eta_l (g(y) - c_k + c) (Karimireddy et al., Alg. 1, local step).
        if correction is not None:
            for name, w in model.named_parameters():
                w.grad.add_(correction[name])
        opt.step()
        loss_sum += loss.detach() * len(batch)
        seen += len(batch)
    return loss_sum / max(seen, 1)


def fedyogi_step(x, avg, m, v, lr, beta1, beta2, tau):
    """FedLN: one FedYogi server round (Reddi et al. 2021, Alg. 2, no bias correction), per parameter name of x:
    D = avg - x, the n_k/n-weighted mean client model minus the global x (a step towards the clients), then
    m = b1 m + (1 - b1) D;  v = v - (1 - b2) D^2 sign(v - D^2);  x = x + eta m / (sqrt(v) + tau). Returns (x, m, v)."""
    delta = {n: avg[n] - x[n] for n in x}
    m = {n: beta1 * m[n] + (1 - beta1) * delta[n] for n in delta}
    v = {n: v[n] - (1 - beta2) * delta[n].pow(2) * torch.sign(v[n] - delta[n].pow(2)) for n in delta}
    x = {n: x[n] + lr * m[n] / (v[n].sqrt() + tau) for n in delta}
    return x, m, v


def figure3_images(labels, n, seed):
    """FedLN: indices of n test images of different classes (Figure 3: "20 random images from different
    classes"): the classes in turn (2 of each of 10), each class's images in an order drawn by a private generator."""
    g = torch.Generator().manual_seed(seed)
    by_class = [torch.nonzero(labels.cpu() == c).flatten() for c in labels.unique().tolist()]
    pools = [idx[torch.randperm(len(idx), generator=g)] for idx in by_class]
    picked = [int(pool[r]) for r in range(max(map(len, pools))) for pool in pools if r < len(pool)]
    return torch.tensor(picked[:n])


@torch.no_grad()
def feature_norms(model, x):
    """FedLN: ||g(x_i)|| per image and ||w_c|| per class (Figure 3 left and middle left, Theorem 1)."""
    return model.body(x).float().norm(dim=1).tolist(), model.head.weight.float().norm(dim=1).tolist()


@torch.no_grad()
def singular_values(model, x):
    """FedLN: singular values of the feature matrix [g(x_1), ..., g(x_n)] (Figure 3), raw and with each
    feature scaled to unit norm (Figure 3 right: comparable across --norm)."""
    z = model.body(x).float()
    return torch.linalg.svdvals(z).tolist(), torch.linalg.svdvals(F.normalize(z, dim=1)).tolist()


if __name__ == "__main__":
    args = parse_args()
    # The run folder (taken first), torchrun's ranks, the seeds, the client sampler, Ctrl-C and SIGTERM. Bad input
    # found in the block ends the run in one line.
    with Run(args) as run:
        # uint8 tensors on the device; a bad folder is refused as it is read.
        data = load_data(args)
        # The partition has its own generator, seeded by --data-seed.
        partition = make_partition(args, data)
        # The global model w_t, and one client model reloaded for every client.
        model = build(args, data).to(args.device)  # FedLN: build() adds --norm
        client = build(args, data).to(args.device)  # FedLN
        # config.json, partition.json and the start-up line; the first round.
        start = run.start(model, partition, data)
        sizes = [len(p) for p in partition.train]
        # FedLN: the parameters that SCAFFOLD and FedYogi update; the buffers are averaged.
        names = [n for n, _ in model.named_parameters()]

        def zeros(fill=0.0):
            """FedLN: a tensor of fill for each parameter of the model, by name."""
            return {n: torch.full_like(p, fill).detach() for n, p in model.named_parameters()}

        # FedLN: the method's state, SCAFFOLD's c and c_k or FedYogi's m and v.
        server = {}
        if args.agg == "scaffold":
            # FedLN: the control variates start at 0.
            server = {"c": zeros(), "c_k": [zeros() for _ in range(len(sizes))]}
        if args.agg == "fedyogi":
            # FedLN: m_0 = 0, v_0 = 1e-6 (Appendix C.4).
            server = {"m": zeros(), "v": zeros(args.yogi_v0)}
        # FedLN: Figure 3's 20 fixed test images of different classes, and 20 of client K's images.
        sv_x = None
        own_x = None
        if args.track_singular_values or args.overfit_client is not None:
            picked = figure3_images(data.y_test, 20, args.seed).to(data.x_test.device)
            sv_x = prepare_batch(data.x_test[picked], data)
        if args.overfit_client is not None:
            # FedLN: Figure 3 middle left, "20 images from client 1".
            own = partition.train[args.overfit_client]
            pick = torch.randperm(len(own), generator=torch.Generator().manual_seed(args.seed))[:20].to(own.device)
            own_x = prepare_batch(data.x_train[own[pick]], data)
        if args.resume:
            model.load_state_dict(run.checkpoint["model"])
            # FedLN: the control variates or moments.
            server = run.checkpoint["server"]

        # The bar shows the latest test accuracy.
        for rnd in run.bar(range(start, args.rounds)):
            lr = lr_at(rnd, args)
            clients = sample_clients(run.sampler, len(sizes), args.frac)
            # FedLN: client K alone (Figure 3 left, Appendix D); weight 1: the model is its own.
            if args.overfit_client is not None:
                clients = [args.overfit_client]
            weights = client_weights([sizes[k] for k in clients], args.weighting)
            total = {k: torch.zeros_like(v, dtype=torch.float) for k, v in model.state_dict().items()}
            train_loss = torch.zeros((), device=args.device)
            # FedLN: SCAFFOLD's c_k+ of this round's clients.
            new_c = {}

            def train_client(k):
                """What client k does this round; returns what the server sums."""
                client.load_state_dict(model.state_dict())
                # FedLN: SCAFFOLD's c - c_k.
                correction = None
                if args.agg == "scaffold":
                    correction = scaffold_correction(server["c"], server["c_k"][k])
                # w_t, for FedProx.
                anchor = [p.detach() for p in model.parameters()]
                loss = local_train(
                    client, partition.train[k], data, args, lr=lr, global_params=anchor, correction=correction
                )
                return {"loss": loss, "state": client.state_dict()}

            # Each client its own seed; under torchrun, split over the ranks and summed in client order.
            for k, w, out in each_client(clients, weights, train_client, seed=args.seed, rnd=rnd):
                train_loss += w * out["loss"]
                # Batch-norm running statistics are averaged like the weights.
                accumulate(total, out["state"], w)
                # FedLN: SCAFFOLD's Option II update of c_k (Alg. 1), K = --local-steps.
                if args.agg == "scaffold":
                    step_sum = local_step_sum(args.local_steps, lr)
                    c_k = server["c_k"][k]
                    c = server["c"]
                    new_c[k] = scaffold_control(c_k, c, model.state_dict(), out["state"], step_sum=step_sum)
            # FedLN: SCAFFOLD's c <- c + 1/N sum_{k in S} (c_k+ - c_k), then c_k <- c_k+.
            if args.agg == "scaffold":
                delta_sum = {n: sum(new_c[k][n] - server["c_k"][k][n] for k in new_c) for n in names}
                server["c"] = scaffold_server(server["c"], delta_sum, len(sizes))
                for k, c_k in new_c.items():
                    server["c_k"][k] = c_k
            # FedLN: x <- Yogi(x, D = sum_k n_k/n y_k - x); the buffers keep the average.
            if args.agg == "fedyogi":
                x = {n: p.detach().float() for n, p in model.named_parameters()}
                hyper = dict(lr=args.server_lr, beta1=args.yogi_beta1, beta2=args.yogi_beta2, tau=args.yogi_tau)
                x, server["m"], server["v"] = fedyogi_step(x, total, server["m"], server["v"], **hyper)
                total.update(x)
            load_average(model, total)  # w_{t+1} = sum_k n_k/n w_{t+1}^k (McMahan et al. 2017, Alg. 1)
            train_loss = float(train_loss)
            if not math.isfinite(train_loss):
                # summary.json says it diverged; exit 1.
                run.end_diverged(rnd, train_loss)

            last = rnd + 1 == args.rounds
            if (rnd + 1) % args.eval_every == 0 or last:
                model.eval()
                # test_acc, test_loss; per client: mean, std, worst 10%; --balanced-acc: the same of it.
                tests = eval_metrics(model, data, partition.test, args.balanced_acc, amp=args.amp, val=partition.val)
                metrics = {"round": rnd + 1, **tests, "train_loss": train_loss, "lr": lr}
                # FedLN: feature collapse (Figure 3).
                if sv_x is not None:
                    metrics["feature_sv"], metrics["feature_sv_unit"] = singular_values(model, sv_x)
                # FedLN: Figure 3 left and middle left.
                if own_x is not None:
                    metrics["client_feature_norms"], metrics["class_norms"] = feature_norms(model, own_x)
                run.log(metrics)
            # Ctrl-C or SIGTERM to any rank, or --stop-after.
            interrupted = run.interrupted()
            stop = interrupted or (rnd + 1 - start == args.stop_after and not last)
            # By default a checkpoint at each evaluation: the server's state, the round, the sampler, the clock.
            if stop or last or (rnd + 1) % (args.checkpoint_every or args.eval_every) == 0:
                # FedLN: the server's state includes the method's.
                run.save({"model": model.state_dict(), "server": server, **run.snapshot(rnd)}, "checkpoint.pt")
            if stop:
                # One line says how to --resume it; exit 0, or 130 and 143 after Ctrl-C and SIGTERM.
                run.end_stopped(rnd)
        # summary.json: the final round's metrics.
        run.finish(model)

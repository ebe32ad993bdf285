"""FedLN / FedFN: Understanding the Role of Layer Normalization in Label-Skewed Federated Learning
(Zhang, Beitollahi, Bie, Chen; TMLR 2024), on FedAvg (McMahan et al. 2017) with the baselines FedProx
(Li et al. 2020), SCAFFOLD (Karimireddy et al. 2020) and FedYogi (Reddi et al. 2021).

Idea: with one class per client a client overfits by inflating feature norms (feature collapse,
Theorem 1). Layer normalization after every activation (FedLN), or scaling the last feature to norm
sqrt(d), n(z) = sqrt(d) z / max(eps, ||z||) (FedFN, Eq. 7), bounds the norms and makes FedAvg converge
far faster. --norm picks the normalization (Table 3's variants too), --agg the algorithm.

Reproduce (CPU, synthetic data, a few minutes; add --norm none for vanilla FedAvg):
    python fedln.py --dataset synthetic --rounds 5 --eval-every 1
The paper's CNN on CIFAR-10, 1 class per client, 10,000 rounds (Table 10: FedLN 78.04, FedFN 77.14, FedAvg 55.86):
    python fedln.py --dataset cifar10 --norm ln
Measured (benchmarks/reproduce/fedln.sh small: width-16 CNN, 10 one-class clients, 300 rounds; real
CIFAR-10, seeds 0-2, 2-core CPU, about 5 min a run): LN 43.5, FN 41.9, vanilla 31.8, BN 9.4
(paper, Tables 10 and 4: 78.04, 77.14, 55.86, 9.63).

Docs: docs/fedln.md, with the commands of Tables 1-4 and 10. Its "Implementation details and
deviations" gives each choice with its reason: where the norms sit, Table 7's CNN, FN's sqrt(d) scale
against fedfn.py's unit norm, SCAFFOLD, FedYogi, FedProx and Figure 3's measurements.
"""

import argparse

import numpy as np
import torch
import torch.nn as nn  # FedLN: nn.Sequential to append ScaleNorm
import torch.nn.functional as F

# fmt: off
from common import (AUGMENTATIONS, HelpFormatter, RoundLoop, RunFolder, accumulate, add_run_flags, announce, autocast,
                    build_model, client_batches, client_weights, decay_rate, device_flag, each_client, eval_metrics,
                    exit_if_diverged, finish_args, fraction, inner_fraction, load_average, load_data, lr_at,
                    make_partition, non_negative_float, non_negative_int, positive_float, positive_int, prepare_batch,
                    prox_term, rng_state, sample_clients, seed_everything, seed_int, set_rng_state, setup_distributed,
                    local_step_sum, scaffold_control, scaffold_correction, scaffold_server,  # FedLN: SCAFFOLD
                    ScaleNorm)  # FedLN: sqrt(d)-scaled normalization n
# fmt: on

# The paper's setting: the defaults of the flags below (--help shows them). Table 7's CNN on CIFAR-10 with one
# class per client (App. C.3, Tables 8-10); FedYogi's and FedProx's constants are App. C.4's.
PAPER = dict(
    dataset="cifar10",
    classes_per_client=1,  # n=1: the paper's "1 class"
    num_clients=10,  # K (Table 8)
    frac=1.0,  # all clients every round
    rounds=10000,  # T (App. C.3)
    local_steps=10,  # E: local SGD steps (batches) per round, not epochs (App. C.3)
    batch_size=32,  # B (Table 9)
    model="normcnn",  # Table 7's bias-free CNN
    width=64,  # its channels (Table 7)
    lr=0.01,  # eta_l (Table 9)
    momentum=0.0,  # plain SGD
    weight_decay=0.0,
    eval_every=100,
    norm="ln",  # FedLN: layer norm after each activation
    server_lr=0.01,  # FedYogi's eta
    yogi_v0=1e-6,  # FedYogi's v_0
)
NORM_MODELS = ("normcnn", "resnet18", "resnet50")  # FedLN: models with normalization slots (--norm ln | gn | bn)


# fmt: off
def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    g = p.add_argument_group("data")
    g.add_argument("--dataset", default=PAPER["dataset"],
        help="mnist | fashionmnist | emnist | cifar10 | cifar100 | svhn | folder | tinyimagenet | synthetic")
    g.add_argument("--data-dir", default="./data",
        help="download folder, the image folder of --dataset folder (train/<class>/*, test/<class>/*; in groups: "
             "train/<group>/<class>/*), or tiny-imagenet-200/")
    g.add_argument("--augment", default="crop-flip", choices=AUGMENTATIONS,
        help="on-device augmentation of training batches")
    g = p.add_argument_group("partition (at most one of --iid, --shards, --classes-per-client, --alpha, --split2, "
                             "--disjoint-classes, --natural; one given replaces the default)")
    g.add_argument("--iid", action="store_true", default=PAPER.get("iid", False), help="uniform random split")
    g.add_argument("--shards", type=positive_int, default=PAPER.get("shards"),
        help="S: sort by label, N*S shards, S per client")
    g.add_argument("--classes-per-client", type=positive_int, default=PAPER.get("classes_per_client"),
        help="n: each client holds n classes, each class split evenly among its holders")  # FedLN: paper's symbol
    g.add_argument("--alpha", type=positive_float, default=PAPER.get("alpha"),
        help="beta: Dirichlet label skew Dir(beta) (Hsu et al. 2019; the paper's Dir(0.1))")  # FedLN: paper's symbol
    g.add_argument("--split2", action="store_true", default=PAPER.get("split2", False),
        help="CIFAR-10 split-2 of Qu et al. 2022 (5 clients, 4 classes each)")
    g.add_argument("--disjoint-classes", action="store_true",
        help="each client holds its own classes: N disjoint sets (7 classes, 3 clients: 2, 2, 3; FedLN Table 5)")
    g.add_argument("--natural", action="store_true",
        help="the clients are the folders of an image folder, train/<client>/<class>/* (N: their number)")
    g.add_argument("--clients-per-domain", type=positive_int, default=None,
        help="M: an image folder train/<domain>/<class>/*, each domain split over M clients by the partition flag")
    g.add_argument("--quantity", default="equal", choices=["equal", "powerlaw"],
        help="client sizes: equal, or power law (unbalanced)")
    g.add_argument("--client-test", action="store_true",
        help="also evaluate on per-client test sets with each client's label distribution")
    g.add_argument("--balanced-acc", action="store_true",
        help="also log the balanced accuracy (mean per-class recall) of the global and per-client tests")
    g.add_argument("--data-seed", type=seed_int, default=None,
        help="seed of the partition (default: --seed); client sampling uses --seed")
    g.add_argument("--val-frac", type=decay_rate, default=0.0,
        help="share of each client's training data held out for validation: val_acc, and test_acc_at_best_val "
             "in summary.json (0: none)")
    g = p.add_argument_group("federation")
    g.add_argument("--num-clients", type=positive_int, default=PAPER["num_clients"], help="K: number of clients")
    g.add_argument("--frac", type=fraction, default=PAPER["frac"],
        help="fraction of clients sampled per round, in (0, 1]")  # FedLN: the paper has no symbol
    g.add_argument("--rounds", type=positive_int, default=PAPER["rounds"], help="T: communication rounds")
    g.add_argument("--local-steps", type=positive_int, default=PAPER["local_steps"],
        help="E: local SGD steps (batches) per round")  # FedLN: steps, not epochs
    g.add_argument("--batch-size", type=positive_int, default=PAPER["batch_size"], help="B: local batch size")
    g.add_argument("--weighting", default="samples", choices=["samples", "uniform"],
        help="aggregation weights: m_k/m (Eq. 1), or 1/|S|")  # FedLN: paper's symbols
    g = p.add_argument_group("optimization")
    g.add_argument("--model", default=PAPER["model"],
        help="normcnn (Table 7) | resnet18 (Appendix C.1) | cnn | ... (see common.MODELS)")  # FedLN: its models
    g.add_argument("--width", type=positive_int, default=PAPER["width"],
        help="channels of normcnn's convolutions or resnet18's first stage")  # FedLN: narrow models for CPU runs
    g.add_argument("--lr", type=positive_float, default=PAPER["lr"],
        help="eta_l: local learning rate")  # FedLN: paper's symbol
    g.add_argument("--momentum", type=decay_rate, default=PAPER["momentum"],
        help="local SGD momentum (reset every round)")
    g.add_argument("--weight-decay", type=non_negative_float, default=PAPER["weight_decay"],
        help="local L2 weight decay")
    g.add_argument("--lr-decay-at", type=inner_fraction, nargs="*", default=[],
        help="fractions of the run at which lr is multiplied by --lr-decay, e.g. 0.5 0.75")
    g.add_argument("--lr-decay", type=fraction, default=0.1, help="lr multiplier at each --lr-decay-at")
    g.add_argument("--prox-mu", type=non_negative_float, default=None,
        help="mu: FedProx proximal term mu/2 ||w - w_t||^2 of --agg fedprox (default there: 0.01, Appendix C.4); with"
             " another --agg it is refused (exit 2), never ignored")  # FedLN: --agg fedprox's mu
    g = p.add_argument_group("FedLN: normalization and aggregation")  # FedLN: the method's flags
    g.add_argument("--norm", default=PAPER["norm"], choices=["none", "ln", "fn", "gn", "bn", "fn-each", "ln-last"],
        help="ln: layer norm after each activation (FedLN, Table 3 n^L_MV); fn: n(z) = sqrt(d) z / max(eps, ||z||) on"
             " the last feature (FedFN, Eq. 7, Table 3 n 1^{L-1}); gn: group norm; bn: batch norm; none: vanilla; "
             "normcnn only: fn-each: n after each activation (Table 3 n^L), ln-last: mean shift s after each "
             "activation, layer norm after the last (Table 3 / 4 n_MV s^{L-1}, Prop. 2)")  # FedLN
    g.add_argument("--ln-affine", action=argparse.BooleanOptionalAction, default=True,
        help="gamma, beta of ln/gn/bn: learnable (Table 6 'learnable') or static; normcnn only")  # FedLN
    g.add_argument("--norm-before-act", action="store_true",
        help="normalize before each ReLU instead of after (Table 6 'before'; for resnet18: the standard "
             "conv-norm-ReLU ResNet)")  # FedLN
    g.add_argument("--agg", default="fedavg", choices=["fedavg", "fedprox", "scaffold", "fedyogi"],
        help="FedAvg; FedProx (--prox-mu); SCAFFOLD (Option II); FedYogi (server Yogi on the mean update)")  # FedLN
    g.add_argument("--server-lr", type=positive_float, default=PAPER["server_lr"],
        help="eta: FedYogi server learning rate")  # FedLN
    g.add_argument("--yogi-beta1", type=decay_rate, default=0.9, help="beta_1: FedYogi first-moment decay")  # FedLN
    g.add_argument("--yogi-beta2", type=decay_rate, default=0.99, help="beta_2: FedYogi second-moment decay")  # FedLN
    g.add_argument("--yogi-tau", type=positive_float, default=1e-3,
        help="tau: FedYogi adaptivity (added to sqrt(v))")  # FedLN
    g.add_argument("--yogi-v0", type=non_negative_float, default=PAPER["yogi_v0"],
        help="v_0: FedYogi initial second moment")  # FedLN
    g.add_argument("--track-singular-values", action="store_true",
        help="log the singular values of the feature matrix [g(x_1)..g(x_20)] of 20 fixed test images of different "
             "classes at each evaluation (feature collapse, Figure 3 right: the global model)")  # FedLN
    g.add_argument("--overfit-client", type=non_negative_int, default=None, metavar="K",
        help="Figure 3 left panels (Appendix D): train client K alone (every round samples only K, so the logged "
             "model is its local model) and log at each evaluation ||w_c|| per class, ||g(x)|| of 20 of its training "
             "images, and the singular values of 20 test images of different classes")  # FedLN
    g = p.add_argument_group("run")
    g.add_argument("--seed", type=seed_int, default=0, help="seed of model init, client sampling and local shuffling")
    g.add_argument("--device", type=device_flag, default=None,
        help="cpu, cuda, cuda:N or mps (default: cuda if available, else cpu)")
    g.add_argument("--amp", action="store_true", help="bfloat16 autocast for forward passes")
    g.add_argument("--eval-every", type=positive_int, default=PAPER["eval_every"],
        help="evaluate every this many rounds (and at the last)")
    add_run_flags(g, "fedln")  # --checkpoint-every, --out, --overwrite, --save-model, --resume, --stop-after
    return check_args(p, finish_args(p, p.parse_args(), "fedln"))  # FedLN: + this script's flags together


def check_args(p, args):  # FedLN: this script's flags together
    """Refuse what cannot run (exit 2, the flag named) and resolve --prox-mu (0: no proximal term)."""
    if args.norm in ("ln", "gn", "bn") and args.model not in NORM_MODELS:  # FedLN: --model cnn has no slots
        p.error(f"--norm: {args.norm} needs a model with normalization slots ({', '.join(NORM_MODELS)}), "
                f"not {args.model}")  # FedLN
    if args.norm in ("fn-each", "ln-last") and args.model != "normcnn":  # FedLN: Table 3's variants of the Table 7 CNN
        p.error(f"--norm: {args.norm} is defined for --model normcnn only, not {args.model}")  # FedLN
    if not args.ln_affine and args.model != "normcnn":  # FedLN
        p.error("--no-ln-affine: only normcnn has static normalization layers")  # FedLN
    if args.prox_mu and args.agg != "fedprox" and not args.resume:  # FedLN: --prox-mu is never silently ignored
        p.error(f"--prox-mu: the proximal term belongs to --agg fedprox, not --agg {args.agg}; "
                "add --agg fedprox or drop --prox-mu")  # FedLN
    if args.agg == "fedprox":  # FedLN: mu = 0.01 unless given (Appendix C.4)
        args.prox_mu = 0.01 if args.prox_mu is None else args.prox_mu  # FedLN
        if args.prox_mu <= 0:  # FedLN
            p.error(f"--prox-mu: --agg fedprox needs mu > 0, got {args.prox_mu}")  # FedLN
    else:  # FedLN: 0 = no proximal term (config.json says so; older runs saved an unused 0.01)
        args.prox_mu = 0.0  # FedLN
    if args.overfit_client is not None:  # FedLN: Figure 3 left, client K alone
        if not 0 <= args.overfit_client < args.num_clients:
            p.error(f"--overfit-client: K must be in 0..{args.num_clients - 1} (--num-clients {args.num_clients}), "
                    f"got {args.overfit_client}")  # FedLN
        if args.agg != "fedavg":
            p.error(f"--overfit-client: trains one client alone, which needs --agg fedavg, not {args.agg}")  # FedLN
    return args
# fmt: on


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
    if args.norm == "fn":  # g(x) = n(vanilla body(x)): scale-normalizing the last feature only (Prop. 1, Eq. 7)
        model.body = nn.Sequential(model.body, ScaleNorm(eps=1e-5))
    if args.norm in ("fn-each", "ln-last"):  # Table 3: the slots are the GroupNorm(1, C) layers of --norm ln
        slots = [i for i, m in enumerate(model.body) if isinstance(m, nn.GroupNorm)]
        for i in slots if args.norm == "fn-each" else slots[:-1]:
            model.body[i] = ScaleNorm(eps=1e-5) if args.norm == "fn-each" else MeanShift()
    return model


def local_train(model, indices, data, args, lr, global_params, correction=None):
    """--local-steps of SGD on one client; returns the mean training loss (a tensor).  FedLN: steps, correction
    correction: SCAFFOLD's c - c_k per parameter (FedLN: None for the other --agg)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum, weight_decay=args.weight_decay)
    model.train()
    loss_sum = torch.zeros((), device=args.device)
    seen = 0
    for batch in client_batches(indices, args.batch_size, steps=args.local_steps):  # FedLN: E steps (Appendix C.3)
        x, y = prepare_batch(data.x_train[batch], data, args.augment), data.y_train[batch]
        with autocast(args.device, args.amp):
            loss = F.cross_entropy(model(x).float(), y)
        if args.agg == "fedprox":  # FedLN: --agg fedprox: + mu/2 ||w - w_t||^2 (Li et al. 2020, Eq. 2)
            loss = loss + prox_term(model.parameters(), global_params, args.prox_mu)  # FedLN: a tested function
        opt.zero_grad(set_to_none=True)
        loss.backward()
        # FedLN: SCAFFOLD y <- y - eta_l (g(y) - c_k + c) (Karimireddy et al., Alg. 1, local step)
        if correction is not None:
            for name, w in model.named_parameters():
                w.grad.add_(correction[name])
        opt.step()
        loss_sum += loss.detach() * len(batch)
        seen += len(batch)
    return loss_sum / max(seen, 1)


def yogi_update(x, delta, m, v, lr, beta1, beta2, tau):
    """FedLN: FedYogi server step (Reddi et al. 2021, Alg. 2, no bias correction), per parameter name:
    m = b1 m + (1 - b1) D;  v = v - (1 - b2) D^2 sign(v - D^2);  x = x + eta m / (sqrt(v) + tau).
    Returns the new (x, m, v); delta is the pseudo-gradient D = mean client model - x."""
    m = {n: beta1 * m[n] + (1 - beta1) * delta[n] for n in delta}
    v = {n: v[n] - (1 - beta2) * delta[n].pow(2) * torch.sign(v[n] - delta[n].pow(2)) for n in delta}
    x = {n: x[n] + lr * m[n] / (v[n].sqrt() + tau) for n in delta}
    return x, m, v


def fedyogi_step(x, avg, m, v, lr, beta1, beta2, tau):
    """FedLN: one FedYogi server round (Reddi et al. 2021, Alg. 2): pseudo-gradient D = avg - x, the
    n_k/n-weighted mean client model minus the global x (a step towards the clients), then yogi_update."""
    return yogi_update(x, {n: avg[n] - x[n] for n in x}, m, v, lr, beta1, beta2, tau)


def figure3_images(labels, n, seed):
    """FedLN: indices of n test images of different classes (Figure 3: "20 random images from different
    classes"): the classes in turn (2 of each of 10), each class's images in an order drawn by a private generator."""
    g = torch.Generator().manual_seed(seed)
    labels = labels.cpu()
    pools = [
        idx[torch.randperm(len(idx), generator=g)]
        for idx in (torch.nonzero(labels == c).flatten() for c in labels.unique().tolist())
    ]
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
    setup_distributed(args)  # torchrun: join the other ranks (nothing when run alone)
    seed_everything(args.seed)
    data = load_data(args)
    partition = make_partition(args, data)  # uses its own generator seeded by --data-seed
    folder = RunFolder(args, "fedln")  # config.json; then partition.json, metrics.jsonl, checkpoint.pt, summary.json
    loop = RoundLoop(args, folder)  # the rounds under a bar: which evaluate, checkpoints, --stop-after, Ctrl-C
    folder.write_partition(partition, data)
    model = build(args, data).to(args.device)  # the global model w_t; FedLN: build() adds --norm
    # one client model, reloaded for every client
    client = build(args, data).to(args.device)
    announce(folder, model, partition)  # start-up line: device, model, partition, run folder
    sampler = np.random.default_rng(args.seed)  # client sampling, independent of the partition
    sizes = [len(p) for p in partition.train]
    # FedLN: SCAFFOLD and FedYogi act on parameters; buffers are averaged
    names = [n for n, _ in model.named_parameters()]
    zeros = lambda fill=0.0: {n: torch.full_like(p, fill).detach() for n, p in model.named_parameters()}  # FedLN
    server = {}  # FedLN: method state: SCAFFOLD's c and c_k, FedYogi's m and v
    if args.agg == "scaffold":  # FedLN: control variates start at 0
        server = {"c": zeros(), "c_k": [zeros() for _ in range(args.num_clients)]}
    if args.agg == "fedyogi":  # FedLN: m_0 = 0, v_0 = 1e-6 (Appendix C.4)
        server = {"m": zeros(), "v": zeros(args.yogi_v0)}
    sv_x = own_x = None  # FedLN: Figure 3's 20 fixed test images of different classes; 20 of client K's images
    if args.track_singular_values or args.overfit_client is not None:
        sv_x = prepare_batch(data.x_test[figure3_images(data.y_test, 20, args.seed).to(data.x_test.device)], data)
    if args.overfit_client is not None:  # FedLN: Figure 3 middle left, "20 images from client 1"
        own = partition.train[args.overfit_client]
        own_x = prepare_batch(
            data.x_train[
                own[torch.randperm(len(own), generator=torch.Generator().manual_seed(args.seed))[:20].to(own.device)]
            ],
            data,
        )
    if args.resume:
        ckpt = loop.resume()  # checkpoint.pt; loop.rounds() continues after its round
        model.load_state_dict(ckpt["model"])
        server = ckpt["server"]  # FedLN: control variates / moments
        set_rng_state(ckpt["rng"], sampler)

    def state():  # what a checkpoint holds
        return {"model": model.state_dict(), "rng": rng_state(sampler), "server": server}  # FedLN: + server

    for rnd in loop.rounds(state):
        lr = lr_at(rnd, args)
        clients = sample_clients(sampler, args.num_clients, args.frac)
        # FedLN: client K alone (Figure 3 left, Appendix D); weight 1: the model is its own
        if args.overfit_client is not None:
            clients = [args.overfit_client]
        weights = client_weights([sizes[k] for k in clients], args.weighting)
        total = {k: torch.zeros_like(v, dtype=torch.float) for k, v in model.state_dict().items()}
        train_loss = torch.zeros((), device=args.device)
        new_c = {}  # FedLN: SCAFFOLD's c_k+ of this round's clients

        def train_client(k):  # what client k does this round; returns what the server sums
            client.load_state_dict(model.state_dict())
            # FedLN: c - c_k
            correction = scaffold_correction(server["c"], server["c_k"][k]) if args.agg == "scaffold" else None
            loss = local_train(
                client, partition.train[k], data, args, lr, [p.detach() for p in model.parameters()], correction
            )  # FedLN: + correction
            return {"loss": loss, "state": client.state_dict()}

        # own seed per client; torchrun: split over ranks, summed in order
        for k, w, out in each_client(clients, weights, train_client, args.seed, rnd):
            train_loss += w * out["loss"]
            accumulate(total, out["state"], w)  # batch-norm running statistics are averaged like weights
            if args.agg == "scaffold":  # FedLN: Option II update of c_k (Alg. 1), K = --local-steps
                step_sum = local_step_sum(args.local_steps, lr)
                new_c[k] = scaffold_control(server["c_k"][k], server["c"], model.state_dict(), out["state"], step_sum)
        if args.agg == "scaffold":  # FedLN: c <- c + 1/N sum_{k in S} (c_k+ - c_k), then c_k <- c_k+
            delta_sum = {n: sum(new_c[k][n] - server["c_k"][k][n] for k in new_c) for n in names}
            server["c"] = scaffold_server(server["c"], delta_sum, args.num_clients)
            for k, c_k in new_c.items():
                server["c_k"][k] = c_k
        if args.agg == "fedyogi":  # FedLN: x <- Yogi(x, D = sum_k n_k/n y_k - x); buffers keep the average
            current = model.state_dict()
            x = {n: current[n].float() for n in names}
            x, server["m"], server["v"] = fedyogi_step(
                x, total, server["m"], server["v"], args.server_lr, args.yogi_beta1, args.yogi_beta2, args.yogi_tau
            )
            total.update(x)
        load_average(model, total)  # w_{t+1} = sum_k n_k/n w_{t+1}^k (each entry cast back to its dtype)
        train_loss = exit_if_diverged(train_loss, rnd, folder)  # NaN or inf: summary.json says diverged, exit 1

        if loop.evaluates(rnd):  # every --eval-every rounds and the last
            model.eval()
            # test_acc, test_loss; per-client mean, std, worst 10%; --balanced-acc: the same of balanced accuracy
            tests = eval_metrics(model, data, partition.test, args.balanced_acc, args.amp, val=partition.val)
            metrics = {"round": rnd + 1, **tests, "train_loss": train_loss, "lr": lr}
            if sv_x is not None:  # FedLN: feature collapse (Figure 3)
                metrics["feature_sv"], metrics["feature_sv_unit"] = singular_values(model, sv_x)
            if own_x is not None:  # FedLN: Figure 3 left and middle left
                metrics["client_feature_norms"], metrics["class_norms"] = feature_norms(model, own_x)
            folder.log(metrics)
    folder.finish(model)  # summary.json: the final round's metrics

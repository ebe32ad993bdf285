"""FedNNNN: Norm-Normalized Neural Network Aggregation for Fast and Accurate Federated Learning
(Nagura, Bian, Sato; Kyoto University, arXiv 2020).

Idea: averaging client updates that point in different directions shrinks the server step (N = ||sum_k n_k/n
Delta_k|| <= E = sum_k n_k/n ||Delta_k||, Eqs. 4-6). FedNNNN rescales the averaged update to norm beta * E and adds
server momentum (Algorithm 3, Eqs. 12-13): d_{t+1} = gamma d_t + beta (E/N) sum_k n_k/n Delta_k, w_{t+1} = w_t +
d_{t+1}. The normalized model is broadcast; the plain FedAvg average is the evaluation model (Sec. 4.1). Table 2's
variants: FedAvg = --beta 1 --gamma 0 --no-normalize, Norm-Norm = --gamma 0, Momentum = --beta 1 --no-normalize.

    python fednnnn.py --dataset cifar10                   # Table 2: CIFAR-10 non-IID-B, Table 4's CNN

Usage, logged metrics, implementation details (the non-IID-B partition, the normalized entries, N near 0, the conv /
fc split of the norms) and results: docs/fednnnn.md.
"""

import os

# Before torch loads OpenMP: a thread that waits for work spins about 10 microseconds, then sleeps. Longer spins
# are faster alone and far slower beside other runs (docs/speed.md#cpu-threads); the numbers are the same.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")

import math

import torch
import torch.nn as nn  # FedNNNN: the paper's models; module types for the conv / fc split
import torch.nn.functional as F

from common import AUGMENTATIONS, DATASETS, MODELS, Parser, Run, build_model, finish_args, load_data, make_partition
from common import Classifier, register_model  # FedNNNN: the paper's models
from common import accumulate, client_batches, client_weights, each_client, eval_metrics, load_average, lr_at
from common import autocast, prepare_batch, prox_term, sample_clients
from common import decay_rate, device_flag, fraction, inner_fraction, non_negative_float, path_arg, positive_float
from common import TRACKERS, positive_int, seed_int

# The paper's setting, the defaults of the flags below: CIFAR-10 non-IID-B of Table 1 with Table 4's CNN (Table 2:
# FedNNNN 76.7); beta and gamma from Table 5.
PAPER = dict(
    dataset="cifar10",
    # Non-IID "2 classes", by McMahan's recipe (--classes-per-client 2: exactly 2 classes each).
    shards=2,
    num_clients=100,  # K
    # C = 1: all the clients every round.
    frac=1.0,
    rounds=250,  # T
    local_epochs=5,  # E
    batch_size=50,  # B
    model="cnn6",  # Table 4
    lr=0.05,  # eta
    # Plain SGD (Sec. 5.1).
    momentum=0.0,
    # The paper's lambda (none on MNIST).
    weight_decay=5e-4,
    # The inputs are only normalized.
    augment="none",
    # The normalized step's norm is beta * E.
    beta=0.6,
    # The server momentum gamma.
    gamma=0.7,
)


@register_model("lenet")  # FedNNNN: the paper's models
def lenet(in_channels, num_classes, image_size, **_):
    """Nagura et al. 2020, Table 3 (MNIST): conv5x5-20, pool, conv5x5-50, pool, fc 500, head; bias everywhere."""
    side = ((image_size - 4) // 2 - 4) // 2
    conv1 = [nn.Conv2d(in_channels, 20, 5), nn.ReLU(), nn.MaxPool2d(2)]
    conv2 = [nn.Conv2d(20, 50, 5), nn.ReLU(), nn.MaxPool2d(2)]
    fc = [nn.Flatten(), nn.Linear(50 * side * side, 500), nn.ReLU()]
    return Classifier(nn.Sequential(*conv1, *conv2, *fc), 500, num_classes)


@register_model("cnn6")  # FedNNNN
def cnn6(in_channels, num_classes, image_size, width=32, **_):
    """Nagura et al. 2020, Table 4 (CIFAR-10): [conv3x3 + BN + ReLU] x2 per stage of width, 2 width, 4 width channels,
    max-pool after each, fc 382 (as printed, twice; likely 384), fc 192, head; bias everywhere; BN keeps running
    statistics. cnn6-narrow (ours): width 8, a CPU-sized model that keeps them."""
    layers = []
    cin = in_channels
    for cout in (width, width, "pool", 2 * width, 2 * width, "pool", 4 * width, 4 * width, "pool"):
        if cout == "pool":
            layers.append(nn.MaxPool2d(2))
            continue
        layers += [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU()]
        cin = cout
    # Computed, not probed: a probe pass would move the BN running statistics.
    side = image_size // 8
    fc = [nn.Linear(4 * width * side * side, 382), nn.ReLU(), nn.Linear(382, 192), nn.ReLU()]
    return Classifier(nn.Sequential(*layers, nn.Flatten(), *fc), 192, num_classes)


# FedNNNN: for the CPU.
@register_model("cnn6-narrow")
def cnn6_narrow(in_channels, num_classes, image_size, **_):
    return cnn6(in_channels, num_classes, image_size, width=8)


def parse_args():
    p = Parser(__doc__)
    g = p.add_argument_group("FedNNNN server aggregation (Algorithm 3)")  # FedNNNN: the method's flags
    g.add_argument(
        "--beta",
        type=positive_float,
        default=PAPER["beta"],
        help="beta: the normalized step has norm beta * E (Eqs. 8-9, 12)",
    )
    g.add_argument(
        "--gamma",
        type=decay_rate,
        default=PAPER["gamma"],
        help="gamma: server momentum d_{t+1} = gamma d_t + ... (Eq. 12); 0 = Norm-Norm",
    )
    g.add_argument(
        "--no-normalize",
        action="store_true",
        help="use E/N = 1 (Momentum variant, Eq. 10; with --beta 1 --gamma 0: FedAvg)",
    )
    g.add_argument(
        "--norm-scope",
        default="global",
        choices=["global", "layer"],
        help="N, E over the whole flattened parameter vector (Eqs. 4-5), or one E/N per parameter tensor",
    )
    g.add_argument(
        "--norm-eps",
        type=non_negative_float,
        default=1e-6,
        help="N counts as (near) zero when N <= eps * E: then no normalization (Sec. 4.2)",
    )
    g = p.add_argument_group("data")
    g.add_argument("--dataset", default=PAPER["dataset"], choices=sorted(DATASETS), help="folder: --data-dir's images")
    g.add_argument("--data-dir", type=path_arg, default="./data", help="download folder, or DIR/{train,test}/<class>/*")
    g.add_argument("--augment", default=PAPER["augment"], choices=AUGMENTATIONS, help="of training batches, on device")
    g = p.add_argument_group("partition: one of these (default: --shards 2, the paper's non-IID-B)")
    # One of them: the flag given replaces the default.
    x = g.add_mutually_exclusive_group()
    x.add_argument("--iid", action="store_true", help="a uniform random split")
    x.add_argument("--shards", type=positive_int, default=PAPER["shards"], help="S: N*S sorted shards, S each")
    x.add_argument("--classes-per-client", type=positive_int, help="C classes a client, each split among its holders")
    x.add_argument("--alpha", type=positive_float, help="Dirichlet label skew Dir(alpha) (Hsu et al. 2019)")
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
    g.add_argument("--frac", type=fraction, default=PAPER["frac"], help="C: fraction of clients a round, in (0, 1]")
    g.add_argument("--rounds", type=positive_int, default=PAPER["rounds"], help="T: communication rounds")
    # One of them: the flag given replaces the default.
    x = g.add_mutually_exclusive_group()
    x.add_argument("--local-epochs", type=positive_int, default=PAPER["local_epochs"], help="E: epochs a round")
    x.add_argument("--local-steps", type=positive_int, help="local SGD steps a round, not epochs")
    g.add_argument("--batch-size", type=positive_int, default=PAPER["batch_size"], help="B: local batch size")
    # FedNNNN: the paper's unbalanced settings use --weighting uniform (the server does not know the sizes).
    g.add_argument("--weighting", default="samples", choices=["samples", "uniform"], help="weights n_k/n, or 1/m")
    g = p.add_argument_group("optimization")
    g.add_argument(  # FedNNNN: its models
        "--model",
        default=PAPER["model"],
        choices=sorted(MODELS),
        metavar="NAME",
        help="cnn6 (Table 4, CIFAR-10), lenet (Table 3, MNIST), cnn, ...",
    )
    g.add_argument("--lr", type=positive_float, default=PAPER["lr"], help="eta: local learning rate")
    g.add_argument("--momentum", type=decay_rate, default=PAPER["momentum"], help="local SGD momentum, reset a round")
    g.add_argument("--weight-decay", type=non_negative_float, default=PAPER["weight_decay"], help="local L2 decay")
    g.add_argument("--lr-decay-at", type=inner_fraction, nargs="*", default=[], help="fractions of the run, e.g. 0.5")
    g.add_argument("--lr-decay", type=fraction, default=0.1, help="lr multiplier at each --lr-decay-at")
    g.add_argument(  # FedNNNN
        "--prox-mu",
        type=non_negative_float,
        default=0.0,
        help="mu: FedProx's mu/2 ||w - w_t||^2 (0: off), with the server's aggregation",
    )
    g = p.add_argument_group("run")
    g.add_argument("--seed", type=seed_int, default=0, help="seed of the init, client sampling and local shuffling")
    g.add_argument("--device", type=device_flag, help="cpu, cuda, cuda:N or mps (default: cuda if there is one)")
    g.add_argument("--amp", action="store_true", help="bfloat16 autocast for forward passes (CPU: often slower)")
    g.add_argument("--threads", type=positive_int, help="CPU threads (default: the cores; OMP_NUM_THREADS)")
    g.add_argument("--eval-every", type=positive_int, default=1, help="evaluate every this many rounds and the last")
    g.add_argument("--checkpoint-every", type=positive_int, help="checkpoint period (default: at each evaluation)")
    g.add_argument("--out", type=path_arg, help="run folder (default: runs/fednnnn__<dataset>__<seed>__<time>)")
    g.add_argument("--overwrite", action="store_true", help="replace the run in --out (else such an --out is refused)")
    g.add_argument("--save-model", action="store_true", help="write the final global model to OUT/model.pt")
    g.add_argument("--resume", type=path_arg, metavar="DIR", help="continue the run in DIR (a larger --rounds: extend)")
    g.add_argument("--stop-after", type=positive_int, help="checkpoint and stop after this many rounds")
    g.add_argument("--track", action="append", choices=TRACKERS, help="also log to TensorBoard or W&B (both: twice)")
    g.add_argument("--wandb-project", default="cleanfl", help="W&B project (--track wandb)")
    g.add_argument("--wandb-entity", help="W&B entity, a user or team (default: W&B's own)")
    return finish_args(p, p.parse_args(), "fednnnn")


def local_train(model, indices, data, args, lr, global_params):
    """E epochs (or --local-steps) of SGD on one client; returns the mean training loss (a tensor)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum, weight_decay=args.weight_decay)
    model.train()
    loss_sum = torch.zeros((), device=args.device)
    seen = 0
    for batch in client_batches(indices, args.batch_size, args.local_epochs, args.local_steps):
        x = prepare_batch(data.x_train[batch], data, args.augment)
        y = data.y_train[batch]
        with autocast(args.device, args.amp):
            loss = F.cross_entropy(model(x).float(), y)
        if args.prox_mu > 0:
            loss = loss + prox_term(model.parameters(), global_params, args.prox_mu)  # Li et al. 2020, Eq. 2
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss_sum += loss.detach() * len(batch)
        seen += len(batch)
    return loss_sum / max(seen, 1)


def param_kinds(model):  # FedNNNN
    """{name: 'conv' | 'fc' | 'other'} for every trainable parameter, in model.parameters() order.

    These names are the entries FedNNNN normalizes (w in Eqs. 2-13); buffers (batch-norm statistics)
    are not among them. The kind is the type of the module owning the parameter (Figs. 8-9 split the
    norms into convolutional and fully connected layers); batch-norm affine weights are 'other'."""
    kinds = {}
    for prefix, module in model.named_modules():
        kind = "other"
        if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            kind = "conv"
        elif isinstance(module, nn.Linear):
            kind = "fc"
        for name, _ in module.named_parameters(recurse=False):
            kinds[f"{prefix}.{name}" if prefix else name] = kind
    return {name: kinds[name] for name, _ in model.named_parameters()}


def sq_norms(state, ref, names):  # FedNNNN
    """[T] tensor of ||state[p] - ref[p]||^2 per parameter tensor p: one client's ||Delta^k_p||^2 (Eq. 2)."""
    return torch.stack([(state[n] - ref[n]).pow(2).sum() for n in names])


def fednnnn_step(w, w_avg, d, client_sq, weights, beta, gamma, normalize=True, scope="global", eps=1e-6):  # FedNNNN
    """Server update of Algorithm 3, lines 9-12, on the trainable parameters; returns (w_{t+1}, d_{t+1}).

    w: w_t; w_avg: the FedAvg average sum_k (n_k/n) w^k_{t+1} (Eq. 1); d: d_t (dicts name -> tensor,
    same keys); client_sq: [m, T] squared norms ||Delta^k_p||^2 per client k and tensor p (in w's key
    order, see sq_norms); weights: the m aggregation weights n_k/n. scope 'global': one factor E/N over
    the whole flattened vector; 'layer': one factor per tensor. N <= eps * E: factor 1 (Sec. 4.2)."""
    names = list(w)
    delta = {n: w_avg[n] - w[n] for n in names}  # sum_k (n_k/n) Delta^k_{t+1} = w_avg - w_t (Eq. 3)
    a = torch.as_tensor(weights, dtype=client_sq.dtype, device=client_sq.device)[:, None]
    n_sq = torch.stack([delta[n].pow(2).sum() for n in names])
    if scope == "global":
        N = n_sq.sum().sqrt()  # Eq. 4
        E = (a * client_sq.sum(1, keepdim=True).sqrt()).sum()  # Eq. 5
    else:
        N = n_sq.sqrt()  # Eq. 4, per tensor
        E = (a * client_sq.sqrt()).sum(0)  # Eq. 5, per tensor
    one = torch.ones_like(N)
    # E/N; 1 when N is (near) zero.
    scale = torch.where(N > eps * E, E / N, one) if normalize else one
    scale = scale.expand(len(names))
    d_next = {n: gamma * d[n] + (beta * scale[i]) * delta[n] for i, n in enumerate(names)}  # Eq. 12
    # Eq. 13, w_{t+1} = w_t + d_{t+1}, written as w_avg + (d_{t+1} - Delta_avg): the same in exact arithmetic,
    # and exactly w_avg (fedavg.py bit for bit) when beta = 1, gamma = 0 and E/N = 1.
    w_next = {n: w_avg[n] + (d_next[n] - delta[n]) for n in names}
    return w_next, d_next


def norm_stats(w, w_next, w_avg, client_sq, weights, kinds):  # FedNNNN
    """N (Eq. 4), E (Eq. 5) and the server step ||w_{t+1} - w_t|| (Eq. 24) over all trainable parameters
    and per module kind (N_conv, E_fc, step_norm_other, ...; Figs. 8-9), as floats for metrics.jsonl."""
    names = list(kinds)
    a = torch.as_tensor(weights, dtype=client_sq.dtype, device=client_sq.device)[:, None]
    n_sq = torch.stack([(w_avg[n] - w[n]).pow(2).sum() for n in names])
    s_sq = torch.stack([(w_next[n] - w[n]).pow(2).sum() for n in names])
    out = {}
    for group in ["", "conv", "fc", "other"]:
        # On the CPU: it indexes a tensor on any device.
        mask = torch.tensor([group in ("", kinds[n]) for n in names])
        if mask.any():
            suffix = f"_{group}" if group else ""
            out["N" + suffix] = n_sq[mask].sum().sqrt()
            out["E" + suffix] = (a * client_sq[:, mask].sum(1, keepdim=True).sqrt()).sum()
            out["step_norm" + suffix] = s_sq[mask].sum().sqrt()
    return dict(zip(out, torch.stack(list(out.values())).tolist()))


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
        # FedNNNN: w_t is the broadcast (normalized) model; the client model also holds the evaluation model.
        model = build_model(args.model, data).to(args.device)
        client = build_model(args.model, data).to(args.device)
        # config.json, partition.json and the start-up line; the first round.
        start = run.start(model, partition, data)
        sizes = [len(p) for p in partition.train]
        kinds = param_kinds(model)  # FedNNNN: the normalized entries (trainable parameters) and their conv / fc kind
        names = list(kinds)  # FedNNNN
        momentum = {n: torch.zeros_like(p) for n, p in model.named_parameters()}  # FedNNNN: d_0 = 0
        if args.resume:
            model.load_state_dict(run.checkpoint["model"])
            momentum = run.checkpoint["momentum"]  # FedNNNN: d_t

        # The bar shows the latest test accuracy.
        for rnd in run.bar(range(start, args.rounds)):
            lr = lr_at(rnd, args)
            clients = sample_clients(run.sampler, len(sizes), args.frac)
            weights = client_weights([sizes[k] for k in clients], args.weighting)
            total = {k: torch.zeros_like(v, dtype=torch.float) for k, v in model.state_dict().items()}
            train_loss = torch.zeros((), device=args.device)
            global_state = model.state_dict()  # FedNNNN: w_t (views of the parameters, no copy)
            client_sq = []  # FedNNNN: ||Delta^k_p||^2 per client and parameter tensor

            def train_client(k):
                """What client k does this round; returns what the server sums."""
                client.load_state_dict(model.state_dict())
                # w_t, for FedProx.
                anchor = [p.detach() for p in model.parameters()]
                loss = local_train(client, partition.train[k], data, args, lr=lr, global_params=anchor)
                return {"loss": loss, "state": client.state_dict()}

            # Each client its own seed; under torchrun, split over the ranks and summed in client order.
            for k, w, out in each_client(clients, weights, train_client, seed=args.seed, rnd=rnd):
                train_loss += w * out["loss"]
                # Batch-norm running statistics are averaged like the weights.
                accumulate(total, out["state"], w)
                client_sq.append(sq_norms(out["state"], global_state, names))  # FedNNNN: Eq. 2
            client_sq = torch.stack(client_sq)  # FedNNNN: [m, T]
            w_t = {n: global_state[n] for n in names}  # FedNNNN
            # FedNNNN: the server step, Eqs. 4-5 and 12-13.
            w_next, momentum = fednnnn_step(
                w_t,
                total,
                momentum,
                client_sq,
                weights=weights,
                beta=args.beta,
                gamma=args.gamma,
                normalize=not args.no_normalize,
                scope=args.norm_scope,
                eps=args.norm_eps,
            )
            # FedNNNN: the norms, before w_t is overwritten.
            norms = norm_stats(w_t, w_next, total, client_sq, weights=weights, kinds=kinds)
            # FedNNNN: the broadcast model is w_{t+1}; its batch-norm running statistics are the plain average.
            load_average(model, {**total, **w_next})  # w_{t+1} = w_t + d_{t+1} (Eq. 13)
            train_loss = float(train_loss)
            if not math.isfinite(train_loss):
                # summary.json says it diverged; exit 1.
                run.end_diverged(rnd, train_loss)

            last = rnd + 1 == args.rounds
            if (rnd + 1) % args.eval_every == 0 or last:
                load_average(client, total)  # FedNNNN: the evaluation model = FedAvg average (Sec. 4.1)
                client.eval()  # FedNNNN: evaluate the evaluation model, not the broadcast one
                # test_acc, test_loss; per client: mean, std, worst 10%; --balanced-acc: the same of it.
                tests = eval_metrics(client, data, partition.test, args.balanced_acc, amp=args.amp, val=partition.val)
                run.log({"round": rnd + 1, **tests, "train_loss": train_loss, "lr": lr, **norms})  # FedNNNN: + norms
            else:  # FedNNNN
                run.log({"round": rnd + 1, "train_loss": train_loss, "lr": lr, **norms})  # FedNNNN: norms every round
            # Ctrl-C or SIGTERM to any rank, or --stop-after.
            interrupted = run.interrupted()
            stop = interrupted or (rnd + 1 - start == args.stop_after and not last)
            # By default a checkpoint at each evaluation: the server's state, the round, the sampler, the clock.
            if stop or last or (rnd + 1) % (args.checkpoint_every or args.eval_every) == 0:
                # FedNNNN: the server's state includes d_t.
                run.save({"model": model.state_dict(), "momentum": momentum, **run.snapshot(rnd)}, "checkpoint.pt")
            if stop:
                # One line says how to --resume it; exit 0, or 130 and 143 after Ctrl-C and SIGTERM.
                run.end_stopped(rnd)
        # summary.json: the final round's metrics.
        run.finish(client)  # FedNNNN: --save-model writes the evaluation model

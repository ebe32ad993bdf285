"""FedNNNN: Norm-Normalized Neural Network Aggregation for Fast and Accurate Federated Learning
(Nagura, Bian, Sato; Kyoto University, arXiv 2020).

Idea: averaging client updates that point in different directions shrinks the server step
(N = ||sum_k n_k/n Delta_k|| <= E = sum_k n_k/n ||Delta_k||, Eqs. 4-6). FedNNNN rescales the averaged
update to norm beta * E and adds server momentum (Algorithm 3, Eqs. 12-13):
    d_{t+1} = gamma d_t + beta (E/N) sum_k n_k/n Delta_k,    w_{t+1} = w_t + d_{t+1}.
The normalized model is broadcast; the plain FedAvg average is the evaluation model (Sec. 4.1).
Table 2's variants: FedAvg = --beta 1 --gamma 0 --no-normalize, Norm-Norm = --gamma 0, Momentum =
--beta 1 --no-normalize, FedNNNN = --beta B --gamma G.

Reproduce (CPU, synthetic data, about a minute):
    python fednnnn.py --dataset synthetic --model lenet --num-clients 10 --rounds 10 --local-steps 10
CIFAR-10 non-IID-B (Table 2: 76.7; the defaults), from an image folder:
    python fednnnn.py --dataset folder --data-dir /path/to/cifar10
Measured (benchmarks/reproduce/fednnnn.sh small: cnn6-narrow, s=2, 100 rounds; real CIFAR-10, seeds 0-2,
2-core CPU, about 9 min a run): FedNNNN 49.8, Norm-Norm 48.5, Momentum 43.4, FedAvg 43.1 (paper: 76.7,
76.7, 74.3, 72.6).

Docs: docs/fednnnn.md. Its "Implementation details and deviations" gives each choice with its reason:
the non-IID-B partition, which entries are normalized, N close to 0, the conv / fc split of the norms.
"""

import argparse

import numpy as np
import torch
import torch.nn as nn  # FedNNNN: module types for the conv / fc split
import torch.nn.functional as F

# fmt: off
from common import (AUGMENTATIONS, HelpFormatter, RoundLoop, RunFolder, accumulate, add_run_flags, announce, autocast,
                    build_model, client_batches, client_weights, decay_rate, device_flag, each_client, eval_metrics,
                    exit_if_diverged, finish_args, fraction, inner_fraction, load_average, load_data, lr_at,
                    make_partition, non_negative_float, positive_float, positive_int, prepare_batch, prox_term,
                    rng_state, sample_clients, seed_everything, seed_int, set_rng_state, setup_distributed)
# fmt: on

# The paper's setting: the defaults of the flags below (--help shows them). CIFAR-10 non-IID-B of Table 1 with
# Table 4's CNN (Table 2: FedNNNN 76.7); beta and gamma from Table 5.
PAPER = dict(
    dataset="cifar10",
    shards=2,  # non-IID "2 classes", by McMahan's recipe (--classes-per-client 2: exactly 2 classes each)
    num_clients=100,  # K
    frac=1.0,  # C=1: all clients every round
    rounds=250,  # T
    local_epochs=5,  # E
    batch_size=50,  # B
    model="cnn6",  # Table 4
    lr=0.05,  # eta
    momentum=0.0,  # plain SGD (Sec. 5.1)
    weight_decay=5e-4,  # lambda (none on MNIST)
    augment="none",  # inputs are only normalized
    beta=0.6,  # the normalized step's norm, beta * E
    gamma=0.7,  # server momentum
)


# fmt: off
def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    g = p.add_argument_group("data")
    g.add_argument("--dataset", default=PAPER["dataset"],
        help="mnist | fashionmnist | emnist | cifar10 | cifar100 | svhn | folder | tinyimagenet | synthetic")
    g.add_argument("--data-dir", default="./data",
        help="download folder, the image folder of --dataset folder (train/<class>/*, test/<class>/*; in groups: "
             "train/<group>/<class>/*), or tiny-imagenet-200/")
    g.add_argument("--augment", default=PAPER["augment"], choices=AUGMENTATIONS,
        help="on-device augmentation of training batches")
    g = p.add_argument_group("partition (at most one of --iid, --shards, --classes-per-client, --alpha, --split2, "
                             "--disjoint-classes, --natural; one given replaces the default)")
    g.add_argument("--iid", action="store_true", default=PAPER.get("iid", False),
        help="uniform random split (the paper's IID)")  # FedNNNN: its name in the paper
    g.add_argument("--shards", type=positive_int, default=PAPER.get("shards"),
        help="S: sort by label, N*S shards, S per client (on CIFAR-10 5-9 of the 100 clients get 2 shards of one "
             "class)")  # FedNNNN: not always 2 classes
    g.add_argument("--classes-per-client", type=positive_int, default=PAPER.get("classes_per_client"),
        help="C: each client holds C classes, each class split evenly among its holders")
    g.add_argument("--alpha", type=positive_float, default=PAPER.get("alpha"),
        help="Dirichlet label skew Dir(alpha) (Hsu et al. 2019)")
    g.add_argument("--split2", action="store_true", default=PAPER.get("split2", False),
        help="CIFAR-10 split-2 of Qu et al. 2022 (5 clients, 4 classes each)")
    g.add_argument("--disjoint-classes", action="store_true",
        help="each client holds its own classes: N disjoint sets (7 classes, 3 clients: 2, 2, 3; FedLN Table 5)")
    g.add_argument("--natural", action="store_true",
        help="the clients are the folders of an image folder, train/<client>/<class>/* (N: their number)")
    g.add_argument("--clients-per-domain", type=positive_int, default=None,
        help="M: an image folder train/<domain>/<class>/*, each domain split over M clients by the partition flag")
    g.add_argument("--quantity", default="equal", choices=["equal", "powerlaw"],
        help="client sizes: equal (B), or power law (the paper's unbalanced UB)")  # FedNNNN: the paper's names
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
        help="C: fraction of clients sampled per round, in (0, 1]")
    g.add_argument("--rounds", type=positive_int, default=PAPER["rounds"], help="T: communication rounds")
    g.add_argument("--local-epochs", type=positive_int, default=PAPER["local_epochs"], help="E: local epochs per round")
    g.add_argument("--local-steps", type=positive_int, default=None,
        help="local SGD steps per round instead of --local-epochs")
    g.add_argument("--batch-size", type=positive_int, default=PAPER["batch_size"], help="B: local batch size")
    g.add_argument("--weighting", default="samples", choices=["samples", "uniform"],
        help="aggregation weights: n_k/n, or 1/m (the paper's unbalanced setting: sizes unknown to the server)")
    g = p.add_argument_group("optimization")
    g.add_argument("--model", default=PAPER["model"],
        help="cnn6 (Table 4, CIFAR-10) | lenet (Table 3, MNIST) | cnn | ... (see common.MODELS)")  # FedNNNN: its models
    g.add_argument("--lr", type=positive_float, default=PAPER["lr"], help="eta: local learning rate")
    g.add_argument("--momentum", type=decay_rate, default=PAPER["momentum"],
        help="local SGD momentum (reset every round)")
    g.add_argument("--weight-decay", type=non_negative_float, default=PAPER["weight_decay"],
        help="local L2 weight decay")
    g.add_argument("--lr-decay-at", type=inner_fraction, nargs="*", default=[],
        help="fractions of the run at which lr is multiplied by --lr-decay, e.g. 0.5 0.75")
    g.add_argument("--lr-decay", type=fraction, default=0.1, help="lr multiplier at each --lr-decay-at")
    g.add_argument("--prox-mu", type=non_negative_float, default=0.0,
        help="mu: FedProx proximal term mu/2 ||w - w_t||^2 (0 = FedAvg); > 0 turns FedProx on, combined with the "
             "server aggregation")
    g = p.add_argument_group("FedNNNN server aggregation (Algorithm 3)")  # FedNNNN: the method's flags
    g.add_argument("--beta", type=positive_float, default=PAPER["beta"],
        help="beta: the normalized step has norm beta * E (Eqs. 8-9, 12)")  # FedNNNN
    g.add_argument("--gamma", type=decay_rate, default=PAPER["gamma"],
        help="gamma: server momentum d_{t+1} = gamma d_t + ... (Eq. 12); 0 = Norm-Norm")  # FedNNNN
    g.add_argument("--no-normalize", action="store_true",
        help="use E/N = 1 (Momentum variant, Eq. 10; with --beta 1 --gamma 0: FedAvg)")  # FedNNNN
    g.add_argument("--norm-scope", default="global", choices=["global", "layer"],
        help="N, E over the whole flattened parameter vector (Eqs. 4-5), or one E/N per parameter tensor")  # FedNNNN
    g.add_argument("--norm-eps", type=non_negative_float, default=1e-6,
        help="N counts as (near) zero when N <= eps * E: then no normalization (Sec. 4.2)")  # FedNNNN
    g = p.add_argument_group("run")
    g.add_argument("--seed", type=seed_int, default=0, help="seed of model init, client sampling and local shuffling")
    g.add_argument("--device", type=device_flag, default=None,
        help="cpu, cuda, cuda:N or mps (default: cuda if available, else cpu)")
    g.add_argument("--amp", action="store_true", help="bfloat16 autocast for forward passes")
    g.add_argument("--eval-every", type=positive_int, default=1,
        help="evaluate every this many rounds (and at the last)")
    add_run_flags(g, "fednnnn")  # --checkpoint-every, --out, --overwrite, --save-model, --resume, --stop-after
    return finish_args(p, p.parse_args(), "fednnnn")
# fmt: on


def local_train(model, indices, data, args, lr, global_params):
    """E epochs (or --local-steps) of SGD on one client; returns the mean training loss (a tensor)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum, weight_decay=args.weight_decay)
    model.train()
    loss_sum = torch.zeros((), device=args.device)
    seen = 0
    for batch in client_batches(indices, args.batch_size, args.local_epochs, args.local_steps):
        x, y = prepare_batch(data.x_train[batch], data, args.augment), data.y_train[batch]
        with autocast(args.device, args.amp):
            loss = F.cross_entropy(model(x).float(), y)
        if args.prox_mu > 0:  # FedProx: + mu/2 ||w - w_t||^2 (Li et al. 2020, Eq. 2)
            loss = loss + prox_term(model.parameters(), global_params, args.prox_mu)  # FedNNNN: a tested function
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
        kind = (
            "conv"
            if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d))
            else "fc"
            if isinstance(module, nn.Linear)
            else "other"
        )
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
        N, E = n_sq.sum().sqrt(), (a * client_sq.sum(1, keepdim=True).sqrt()).sum()  # Eqs. 4, 5
    else:
        N, E = n_sq.sqrt(), (a * client_sq.sqrt()).sum(0)  # Eqs. 4, 5 per tensor
    one = torch.ones_like(N)
    scale = torch.where(N > eps * E, E / N, one) if normalize else one  # E/N; 1 when N is (near) zero
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
        mask = torch.tensor([group in ("", kinds[n]) for n in names])  # on the CPU: it indexes any device
        if mask.any():
            suffix = f"_{group}" if group else ""
            out["N" + suffix] = n_sq[mask].sum().sqrt()
            out["E" + suffix] = (a * client_sq[:, mask].sum(1, keepdim=True).sqrt()).sum()
            out["step_norm" + suffix] = s_sq[mask].sum().sqrt()
    return dict(zip(out, torch.stack(list(out.values())).tolist()))


if __name__ == "__main__":
    args = parse_args()
    setup_distributed(args)  # torchrun: join the other ranks (nothing when run alone)
    seed_everything(args.seed)
    data = load_data(args)
    partition = make_partition(args, data)  # uses its own generator seeded by --data-seed
    folder = RunFolder(args, "fednnnn")  # config.json; then partition.json, metrics.jsonl, checkpoint.pt, summary.json
    loop = RoundLoop(args, folder)  # the rounds under a bar: which evaluate, checkpoints, --stop-after, Ctrl-C
    folder.write_partition(partition, data)
    model = build_model(args.model, data).to(args.device)  # FedNNNN: the broadcast (normalized) model w_t
    # one client model, reloaded for every client; FedNNNN: also holds the evaluation model
    client = build_model(args.model, data).to(args.device)
    announce(folder, model, partition)  # start-up line: device, model, partition, run folder
    sampler = np.random.default_rng(args.seed)  # client sampling, independent of the partition
    sizes = [len(p) for p in partition.train]
    kinds = param_kinds(model)  # FedNNNN: the normalized entries (trainable parameters) and their conv/fc kind
    names = list(kinds)  # FedNNNN
    momentum = {n: torch.zeros_like(p) for n, p in model.named_parameters()}  # FedNNNN: d_0 = 0
    if args.resume:
        ckpt = loop.resume()  # checkpoint.pt; loop.rounds() continues after its round
        model.load_state_dict(ckpt["model"])
        momentum = ckpt["momentum"]  # FedNNNN: d_t
        set_rng_state(ckpt["rng"], sampler)

    def state():  # what a checkpoint holds
        return {"model": model.state_dict(), "momentum": momentum, "rng": rng_state(sampler)}  # FedNNNN: + d_t

    for rnd in loop.rounds(state):
        lr = lr_at(rnd, args)
        clients = sample_clients(sampler, args.num_clients, args.frac)
        weights = client_weights([sizes[k] for k in clients], args.weighting)
        total = {k: torch.zeros_like(v, dtype=torch.float) for k, v in model.state_dict().items()}
        train_loss = torch.zeros((), device=args.device)
        global_state = model.state_dict()  # FedNNNN: w_t (views of the parameters, no copy)
        client_sq = []  # FedNNNN: ||Delta^k_p||^2 per client and parameter tensor

        def train_client(k):  # what client k does this round; returns what the server sums
            client.load_state_dict(model.state_dict())
            loss = local_train(client, partition.train[k], data, args, lr, [p.detach() for p in model.parameters()])
            return {"loss": loss, "state": client.state_dict()}

        # own seed per client; torchrun: split over ranks, summed in order
        for k, w, out in each_client(clients, weights, train_client, args.seed, rnd):
            train_loss += w * out["loss"]
            accumulate(total, out["state"], w)  # batch-norm running statistics are averaged like weights
            client_sq.append(sq_norms(out["state"], global_state, names))  # FedNNNN: Eq. 2
        client_sq = torch.stack(client_sq)  # FedNNNN: [m, T]
        w_t = {n: global_state[n] for n in names}  # FedNNNN
        # FedNNNN: Eqs. 4-5, 12-13
        w_next, momentum = fednnnn_step(
            w_t,
            total,
            momentum,
            client_sq,
            weights,
            args.beta,
            args.gamma,
            not args.no_normalize,
            args.norm_scope,
            args.norm_eps,
        )
        norms = norm_stats(w_t, w_next, total, client_sq, weights, kinds)  # FedNNNN: before w_t is overwritten
        load_average(model, {**total, **w_next})  # FedNNNN: broadcast w_{t+1}; BN running statistics: the plain average
        train_loss = exit_if_diverged(train_loss, rnd, folder)  # NaN or inf: summary.json says diverged, exit 1

        if loop.evaluates(rnd):  # every --eval-every rounds and the last
            load_average(client, total)  # FedNNNN: the evaluation model = FedAvg average (Sec. 4.1)
            client.eval()  # FedNNNN: evaluate the evaluation model, not the broadcast one
            # test_acc, test_loss; per-client mean, std, worst 10%; --balanced-acc: the same of balanced accuracy
            tests = eval_metrics(
                client, data, partition.test, args.balanced_acc, args.amp, val=partition.val
            )  # FedNNNN: the evaluation model
            folder.log({"round": rnd + 1, **tests, "train_loss": train_loss, "lr": lr, **norms})  # FedNNNN: + norms
        else:  # FedNNNN
            folder.log({"round": rnd + 1, "train_loss": train_loss, "lr": lr, **norms})  # FedNNNN: norms every round
    folder.finish(client)  # FedNNNN: --save-model writes the evaluation model

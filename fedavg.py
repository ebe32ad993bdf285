"""FedAvg: Communication-Efficient Learning of Deep Networks from Decentralized Data
(McMahan, Moore, Ramage, Hampson, Aguera y Arcas; AISTATS 2017), with FedProx (Li et al., MLSys 2020).

Idea: each round a fraction of the clients runs E epochs of local SGD from the global model, and the
server replaces the global model by their average weighted by sample count (Alg. 1:
w_{t+1} = sum_k n_k/n w_{t+1}^k). FedProx adds mu/2 ||w - w_t||^2 to each local loss.
Every other CleanFL script is this file plus a small diff: `diff fedavg.py fedbabu.py` shows a method.

Reproduce (CPU, synthetic data: final test accuracy 0.883 after 20 rounds, 70 s on one thread of a
2-core x86_64 VM, torch 2.14.1):
    python fedavg.py --dataset synthetic --num-clients 10 --frac 0.5 --shards 2 --local-epochs 1 --rounds 20
Real CIFAR-10 from an image folder (no internet needed); the same run on 2 processes or GPUs:
    python fedavg.py --dataset folder --data-dir /path/to/cifar10 --shards 2
    torchrun --nproc_per_node 2 fedavg.py --dataset folder --data-dir /path/to/cifar10 --shards 2

Docs: docs/fedavg.md (usage, logged metrics, results). Choices the paper leaves open, with reasons, are
in its "Implementation details and deviations": SGD momentum 0.9 and weight decay 5e-4 by default,
crop-and-flip augmentation, batch-norm running statistics averaged like weights.
"""

import argparse

import numpy as np
import torch
import torch.nn.functional as F

# fmt: off
from common import (AUGMENTATIONS, HelpFormatter, RoundLoop, RunFolder, accumulate, add_run_flags, announce, autocast,
                    build_model, client_batches, client_weights, decay_rate, device_flag, each_client, eval_metrics,
                    exit_if_diverged, finish_args, fraction, inner_fraction, load_average, load_data, lr_at,
                    make_partition, non_negative_float, positive_float, positive_int, prepare_batch, prox_term,
                    rng_state, sample_clients, seed_everything, seed_int, set_rng_state, setup_distributed)
# fmt: on

# The run's setting: the defaults of the flags below (--help shows them). McMahan et al.'s federation (Sec. 3:
# 100 clients, C=0.1, E=5, B=50) on CIFAR-10, with CleanFL's shared baseline where marked "ours" (reasons in
# docs/fedavg.md).
PAPER = dict(
    dataset="cifar10",
    shards=2,  # the paper's pathological non-IID split (of MNIST): 2 shards of label-sorted data per client
    num_clients=100,  # K
    frac=0.1,  # C
    rounds=200,  # ours
    local_epochs=5,  # E
    batch_size=50,  # B
    model="cnn",  # the paper's MNIST CNN: two 5x5 convolutions (32, 64 channels), fc 512
    lr=0.01,  # ours: the paper tunes it per setting
    momentum=0.9,  # ours: the paper's SGD has none (--momentum 0 --weight-decay 0)
    weight_decay=5e-4,  # ours
    lr_decay_at=[],  # ours: no decay
    augment="crop-flip",  # ours
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
    g.add_argument("--iid", action="store_true", default=PAPER.get("iid", False), help="uniform random split")
    g.add_argument("--shards", type=positive_int, default=PAPER.get("shards"),
        help="S: sort by label, N*S shards, S per client")
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
        help="C: fraction of clients sampled per round, in (0, 1]")
    g.add_argument("--rounds", type=positive_int, default=PAPER["rounds"], help="T: communication rounds")
    g.add_argument("--local-epochs", type=positive_int, default=PAPER["local_epochs"], help="E: local epochs per round")
    g.add_argument("--local-steps", type=positive_int, default=None,
        help="local SGD steps per round instead of --local-epochs")
    g.add_argument("--batch-size", type=positive_int, default=PAPER["batch_size"], help="B: local batch size")
    g.add_argument("--weighting", default="samples", choices=["samples", "uniform"],
        help="aggregation weights: n_k/n, or 1/m")
    g = p.add_argument_group("optimization")
    g.add_argument("--model", default=PAPER["model"], help="cnn | resnet18 | ... (see common.MODELS)")
    g.add_argument("--lr", type=positive_float, default=PAPER["lr"], help="eta: local learning rate")
    g.add_argument("--momentum", type=decay_rate, default=PAPER["momentum"],
        help="local SGD momentum (reset every round)")
    g.add_argument("--weight-decay", type=non_negative_float, default=PAPER["weight_decay"],
        help="local L2 weight decay")
    g.add_argument("--lr-decay-at", type=inner_fraction, nargs="*", default=PAPER["lr_decay_at"],
        help="fractions of the run at which lr is multiplied by --lr-decay, e.g. 0.5 0.75")
    g.add_argument("--lr-decay", type=fraction, default=0.1, help="lr multiplier at each --lr-decay-at")
    g.add_argument("--prox-mu", type=non_negative_float, default=0.0,
        help="mu: FedProx proximal term mu/2 ||w - w_t||^2 (0 = FedAvg)")
    g = p.add_argument_group("run")
    g.add_argument("--seed", type=seed_int, default=0, help="seed of model init, client sampling and local shuffling")
    g.add_argument("--device", type=device_flag, default=None,
        help="cpu, cuda, cuda:N or mps (default: cuda if available, else cpu)")
    g.add_argument("--amp", action="store_true", help="bfloat16 autocast for forward passes")
    g.add_argument("--eval-every", type=positive_int, default=1,
        help="evaluate every this many rounds (and at the last)")
    add_run_flags(g, "fedavg")  # --checkpoint-every, --out, --overwrite, --save-model, --resume, --stop-after
    return finish_args(p, p.parse_args(), "fedavg")
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
            loss = loss + prox_term(model.parameters(), global_params, args.prox_mu)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss_sum += loss.detach() * len(batch)
        seen += len(batch)
    return loss_sum / max(seen, 1)


if __name__ == "__main__":
    args = parse_args()
    setup_distributed(args)  # torchrun: join the other ranks (nothing when run alone)
    seed_everything(args.seed)
    data = load_data(args)
    partition = make_partition(args, data)  # uses its own generator seeded by --data-seed
    folder = RunFolder(args, "fedavg")  # config.json; then partition.json, metrics.jsonl, checkpoint.pt, summary.json
    loop = RoundLoop(args, folder)  # the rounds under a bar: which evaluate, checkpoints, --stop-after, Ctrl-C
    folder.write_partition(partition, data)
    model = build_model(args.model, data).to(args.device)  # the global model w_t
    client = build_model(args.model, data).to(args.device)  # one client model, reloaded for every client
    announce(folder, model, partition)  # start-up line: device, model, partition, run folder
    sampler = np.random.default_rng(args.seed)  # client sampling, independent of the partition
    sizes = [len(p) for p in partition.train]
    if args.resume:
        ckpt = loop.resume()  # checkpoint.pt; loop.rounds() continues after its round
        model.load_state_dict(ckpt["model"])
        set_rng_state(ckpt["rng"], sampler)

    def state():  # what a checkpoint holds
        return {"model": model.state_dict(), "rng": rng_state(sampler)}

    for rnd in loop.rounds(state):
        lr = lr_at(rnd, args)
        clients = sample_clients(sampler, args.num_clients, args.frac)
        weights = client_weights([sizes[k] for k in clients], args.weighting)
        total = {k: torch.zeros_like(v, dtype=torch.float) for k, v in model.state_dict().items()}
        train_loss = torch.zeros((), device=args.device)

        def train_client(k):  # what client k does this round; returns what the server sums
            client.load_state_dict(model.state_dict())
            loss = local_train(client, partition.train[k], data, args, lr, [p.detach() for p in model.parameters()])
            return {"loss": loss, "state": client.state_dict()}

        # own seed per client; torchrun: split over ranks, summed in order
        for k, w, out in each_client(clients, weights, train_client, args.seed, rnd):
            train_loss += w * out["loss"]
            accumulate(total, out["state"], w)  # batch-norm running statistics are averaged like weights
        load_average(model, total)  # w_{t+1} = sum_k n_k/n w_{t+1}^k (McMahan et al. 2017, Alg. 1)
        train_loss = exit_if_diverged(train_loss, rnd, folder)  # NaN or inf: summary.json says diverged, exit 1

        if loop.evaluates(rnd):  # every --eval-every rounds and the last
            model.eval()
            # test_acc, test_loss; per-client mean, std, worst 10%; --balanced-acc: the same of balanced accuracy
            tests = eval_metrics(model, data, partition.test, args.balanced_acc, args.amp, val=partition.val)
            folder.log({"round": rnd + 1, **tests, "train_loss": train_loss, "lr": lr})
    folder.finish(model)  # summary.json: the final round's metrics

"""FedAvg: Communication-Efficient Learning of Deep Networks from Decentralized Data
(McMahan, Moore, Ramage, Hampson, Aguera y Arcas; AISTATS 2017), with FedProx (Li et al., MLSys 2020).

Idea: each round a fraction of the clients runs E epochs of local SGD from the global model, and the server
replaces the global model by their average weighted by sample count (Alg. 1: w_{t+1} = sum_k n_k/n w_{t+1}^k).
FedProx adds mu/2 ||w - w_t||^2 to each local loss. The other scripts start from this file's flags and loop:
`diff fedavg.py fedbabu.py` shows what a method adds, its lines tagged (`# FedBABU: ...`).

    python fedavg.py --dataset cifar10 --shards 2          # McMahan's pathological non-IID split
    torchrun --nproc_per_node 2 fedavg.py --dataset cifar10 --shards 2   # the same run on 2 processes or GPUs

Usage, logged metrics, choices the paper leaves open and results: docs/fedavg.md.
"""

import os

# Before torch loads OpenMP: a thread that waits for work spins about 10 microseconds, then sleeps. Longer spins
# are faster alone and far slower beside other runs (docs/speed.md#cpu-threads); the numbers are the same.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")

import math

import torch
import torch.nn.functional as F

from common import AUGMENTATIONS, DATASETS, MODELS, Parser, Run, build_model, finish_args, load_data, make_partition
from common import accumulate, client_batches, client_weights, each_client, eval_metrics, load_average, lr_at
from common import autocast, prepare_batch, prox_term, sample_clients
from common import decay_rate, device_flag, fraction, inner_fraction, non_negative_float, path_arg, positive_float
from common import TRACKERS, positive_int, seed_int

# The run's setting, the defaults of the flags below: McMahan et al.'s federation (Sec. 3: 100 clients, C = 0.1,
# E = 5, B = 50) on CIFAR-10, with CleanFL's shared baseline where marked "ours" (reasons in docs/fedavg.md).
PAPER = dict(
    dataset="cifar10",
    # The paper's pathological non-IID split (of MNIST): 2 shards of label-sorted data per client.
    shards=2,
    num_clients=100,  # K
    frac=0.1,  # C
    rounds=200,  # ours
    local_epochs=5,  # E
    batch_size=50,  # B
    # The paper's MNIST CNN: two 5x5 convolutions (32, 64 channels), fc 512.
    model="cnn",
    # Ours: the paper tunes it per setting.
    lr=0.01,
    # Ours: the paper's SGD has none (--momentum 0 --weight-decay 0).
    momentum=0.9,
    weight_decay=5e-4,  # ours
    augment="crop-flip",  # ours
)


def parse_args():
    p = Parser(__doc__)
    g = p.add_argument_group("data")
    g.add_argument("--dataset", default=PAPER["dataset"], choices=sorted(DATASETS), help="folder: --data-dir's images")
    g.add_argument("--data-dir", type=path_arg, default="./data", help="download folder, or DIR/{train,test}/<class>/*")
    g.add_argument("--augment", default=PAPER["augment"], choices=AUGMENTATIONS, help="of training batches, on device")
    g = p.add_argument_group("partition: one of these (default: --shards 2, the paper's)")
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
    g.add_argument("--weighting", default="samples", choices=["samples", "uniform"], help="weights n_k/n, or 1/m")
    g = p.add_argument_group("optimization")
    g.add_argument("--model", default=PAPER["model"], choices=sorted(MODELS), metavar="NAME", help="cnn, resnet18, ...")
    g.add_argument("--lr", type=positive_float, default=PAPER["lr"], help="eta: local learning rate")
    g.add_argument("--momentum", type=decay_rate, default=PAPER["momentum"], help="local SGD momentum, reset a round")
    g.add_argument("--weight-decay", type=non_negative_float, default=PAPER["weight_decay"], help="local L2 decay")
    g.add_argument("--lr-decay-at", type=inner_fraction, nargs="*", default=[], help="fractions of the run, e.g. 0.5")
    g.add_argument("--lr-decay", type=fraction, default=0.1, help="lr multiplier at each --lr-decay-at")
    g.add_argument("--prox-mu", type=non_negative_float, default=0.0, help="mu: FedProx's mu/2 ||w - w_t||^2 (0: off)")
    g = p.add_argument_group("run")
    g.add_argument("--seed", type=seed_int, default=0, help="seed of the init, client sampling and local shuffling")
    g.add_argument("--device", type=device_flag, help="cpu, cuda, cuda:N or mps (default: cuda if there is one)")
    g.add_argument("--amp", action="store_true", help="bfloat16 autocast for forward passes (CPU: often slower)")
    g.add_argument("--threads", type=positive_int, help="CPU threads (default: the cores; OMP_NUM_THREADS)")
    g.add_argument("--eval-every", type=positive_int, default=1, help="evaluate every this many rounds and the last")
    g.add_argument("--checkpoint-every", type=positive_int, help="checkpoint period (default: at each evaluation)")
    g.add_argument("--out", type=path_arg, help="run folder (default: runs/fedavg__<dataset>__<seed>__<time>)")
    g.add_argument("--overwrite", action="store_true", help="replace the run in --out (else such an --out is refused)")
    g.add_argument("--save-model", action="store_true", help="write the final global model to OUT/model.pt")
    g.add_argument("--resume", type=path_arg, metavar="DIR", help="continue the run in DIR (a larger --rounds: extend)")
    g.add_argument("--stop-after", type=positive_int, help="checkpoint and stop after this many rounds")
    g.add_argument("--track", action="append", choices=TRACKERS, help="also log to TensorBoard or W&B (both: twice)")
    g.add_argument("--wandb-project", default="cleanfl", help="W&B project (--track wandb)")
    g.add_argument("--wandb-entity", help="W&B entity, a user or team (default: W&B's own)")
    return finish_args(p, p.parse_args(), "fedavg")


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
        model = build_model(args.model, data).to(args.device)
        client = build_model(args.model, data).to(args.device)
        # config.json, partition.json and the start-up line; the first round.
        start = run.start(model, partition, data)
        sizes = [len(p) for p in partition.train]
        if args.resume:
            model.load_state_dict(run.checkpoint["model"])

        # The bar shows the latest test accuracy.
        for rnd in run.bar(range(start, args.rounds)):
            lr = lr_at(rnd, args)
            clients = sample_clients(run.sampler, len(sizes), args.frac)
            weights = client_weights([sizes[k] for k in clients], args.weighting)
            total = {k: torch.zeros_like(v, dtype=torch.float) for k, v in model.state_dict().items()}
            train_loss = torch.zeros((), device=args.device)

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
                run.log({"round": rnd + 1, **tests, "train_loss": train_loss, "lr": lr})
            # Ctrl-C or SIGTERM to any rank, or --stop-after.
            interrupted = run.interrupted()
            stop = interrupted or (rnd + 1 - start == args.stop_after and not last)
            # By default a checkpoint at each evaluation: the server's state, the round, the sampler, the clock.
            if stop or last or (rnd + 1) % (args.checkpoint_every or args.eval_every) == 0:
                run.save({"model": model.state_dict(), **run.snapshot(rnd)}, "checkpoint.pt")
            if stop:
                # One line says how to --resume it; exit 0, or 130 and 143 after Ctrl-C and SIGTERM.
                run.end_stopped(rnd)
        # summary.json: the final round's metrics.
        run.finish(model)

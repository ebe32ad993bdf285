"""FedBABU: Toward Enhanced Representation for Federated Image Classification
(Oh, Kim, Yun; ICLR 2022), on top of FedAvg (McMahan et al., AISTATS 2017) and FedProx (Li et al., MLSys 2020).

Idea: the head (last linear layer) keeps its random initialization for the whole federated phase and only the body
is trained and averaged (Algorithm 1); the final global model is then fine-tuned on each client's data and tested
on that client's test set (Algorithm 2). --train-head is FedAvg on the same code path; --prox-mu gives FedProx(+BABU).

    python fedbabu.py --dataset cifar10 --model convnet4 --shards 10   # Table 13 (CIFAR-10, 4convNet, s = 10)

Usage, logged metrics, implementation details (the frozen head, Algorithm 2's settings) and results:
docs/fedbabu.md.
"""

import os

# Before torch loads OpenMP: a thread that waits for work spins about 10 microseconds, then sleeps. Longer spins
# are faster alone and far slower beside other runs (docs/speed.md#cpu-threads); the numbers are the same.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")

import argparse
import math

import numpy as np
import torch
import torch.nn.functional as F

from common import AUGMENTATIONS, DATASETS, MODELS, Parser, Run, build_model, finish_args, load_data, make_partition
from common import accumulate, client_batches, client_weights, each_client, eval_metrics, load_average, lr_at
from common import autocast, prepare_batch, prox_term, sample_clients
from common import FineTuning, client_seed, personalize  # FedBABU: Algorithm 2 fine-tuning
from common import decay_rate, device_flag, fraction, inner_fraction, non_negative_float, path_arg, positive_float
from common import TRACKERS, non_negative_int, positive_int, seed_int

# The paper's setting, the defaults of the flags below: CIFAR-100 with MobileNet, s = 10 (Sec. 3, App. A, Tables
# 3-6); CIFAR-10 with 4convNet is Table 13's (--dataset cifar10 --model convnet4).
PAPER = dict(
    dataset="cifar100",
    # The most heterogeneous CIFAR-100 setting, s = 10 (the paper also runs 50 and 100).
    shards=10,
    num_clients=100,
    frac=0.1,  # f
    # The paper fixes rounds x tau = 320: K = 320 // tau rounds.
    local_epochs=10,  # tau
    # Also of the fine-tuning.
    batch_size=50,
    model="mobilenet",
    # Of the body.
    lr=0.1,
    # Also of the fine-tuning (App. D).
    momentum=0.9,
    weight_decay=0.0,
    # The lr is multiplied by 0.1 at half and at three quarters of the rounds.
    lr_decay_at=[0.5, 0.75],
    # Also of the fine-tuning.
    augment="crop-flip",
    ft_epochs=5,  # tau_f (Algorithm 2)
    # The paper gives none: the official code's.
    ft_lr=1e-3,
)


def parse_args():
    p = Parser(__doc__)
    g = p.add_argument_group("FedBABU: the frozen head (Algorithm 1) and personalization (Algorithm 2)")
    g.add_argument(
        "--train-head",
        action="store_true",
        help="also train and average the head theta_cls: plain FedAvg (the paper's baseline)",
    )
    g.add_argument(
        "--ft-epochs",
        type=non_negative_int,
        default=PAPER["ft_epochs"],
        help="tau_f: fine-tuning epochs of the personalized accuracy",
    )
    g.add_argument("--ft-lr", type=positive_float, default=PAPER["ft_lr"], help="fine-tuning learning rate")
    g.add_argument(
        "--ft-part", default="full", choices=["full", "body", "head"], help="part updated when fine-tuning (Table 4)"
    )
    g.add_argument(
        "--ft-eval-epochs",
        type=non_negative_int,
        nargs="*",
        default=[0, 1, 2, 5, 10],
        help="fine-tuning epochs of the accuracy also reported (Table 6; 0: initial)",
    )
    g = p.add_argument_group("data")
    g.add_argument("--dataset", default=PAPER["dataset"], choices=sorted(DATASETS), help="folder: --data-dir's images")
    g.add_argument("--data-dir", type=path_arg, default="./data", help="download folder, or DIR/{train,test}/<class>/*")
    # FedBABU: also of the fine-tuning.
    g.add_argument(
        "--augment",
        default=PAPER["augment"],
        choices=AUGMENTATIONS,
        help="of training and fine-tuning batches, on the device",
    )
    g = p.add_argument_group("partition: one of these (default: --shards 10, the paper's)")
    # One of them: the flag given replaces the default.
    x = g.add_mutually_exclusive_group()
    x.add_argument("--iid", action="store_true", help="a uniform random split")
    x.add_argument("--shards", type=positive_int, default=PAPER["shards"], help="s: N*s sorted shards, s each")
    x.add_argument("--classes-per-client", type=positive_int, help="C classes a client, each split among its holders")
    x.add_argument("--alpha", type=positive_float, help="Dirichlet label skew Dir(alpha) (Hsu et al. 2019)")
    x.add_argument("--split2", action="store_true", help="CIFAR-10 split-2 (Qu et al. 2022): 5 clients, 4 classes each")
    x.add_argument("--disjoint-classes", action="store_true", help="N disjoint class sets (FedLN T5: 2, 2, 3 of 7)")
    x.add_argument("--natural", action="store_true", help="the clients are the folders DIR/train/<client>/<class>/*")
    g.add_argument("--clients-per-domain", type=positive_int, help="M: DIR/train/<domain>/<class>/*, split M ways each")
    g.add_argument("--quantity", default="equal", choices=["equal", "powerlaw"], help="client sizes")
    # FedBABU: on by default, Alg. 2 tests each client on D_i^ts.
    g.add_argument(
        "--client-test",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="D_i^ts: each client's test set has its training classes; off: no personalization",
    )
    g.add_argument("--balanced-acc", action="store_true", help="also log the balanced accuracy (mean class recall)")
    g.add_argument("--data-seed", type=seed_int, help="seed of the partition (default: --seed)")
    g.add_argument("--val-frac", type=decay_rate, default=0.0, help="share of each client's data held out: val_acc")
    g = p.add_argument_group("federation")
    g.add_argument("--num-clients", type=positive_int, default=PAPER["num_clients"], help="N: number of clients")
    g.add_argument("--frac", type=fraction, default=PAPER["frac"], help="f: fraction of clients a round, in (0, 1]")
    g.add_argument("--rounds", type=positive_int, help="K: communication rounds (default: 320 // tau)")  # FedBABU
    # One of them: the flag given replaces the default.
    x = g.add_mutually_exclusive_group()
    x.add_argument("--local-epochs", type=positive_int, default=PAPER["local_epochs"], help="tau: epochs a round")
    x.add_argument("--local-steps", type=positive_int, help="local SGD steps a round, not epochs")
    # FedBABU: also of the fine-tuning.
    g.add_argument(
        "--batch-size", type=positive_int, default=PAPER["batch_size"], help="B: local (and fine-tuning) batch size"
    )
    g.add_argument("--weighting", default="samples", choices=["samples", "uniform"], help="weights n_k/n, or 1/m")
    g = p.add_argument_group("optimization")
    # FedBABU: the paper's models.
    g.add_argument(
        "--model",
        default=PAPER["model"],
        choices=sorted(MODELS),
        metavar="NAME",
        help="mobilenet, convnet4, convnet3, resnet18, ...",
    )
    g.add_argument("--lr", type=positive_float, default=PAPER["lr"], help="local learning rate of the body")  # FedBABU
    # FedBABU: also of the fine-tuning (App. D).
    g.add_argument(
        "--momentum",
        type=decay_rate,
        default=PAPER["momentum"],
        help="local (and fine-tuning) SGD momentum, reset a round",
    )
    g.add_argument("--weight-decay", type=non_negative_float, default=PAPER["weight_decay"], help="local L2 decay")
    # FedBABU: the paper's decay.
    g.add_argument(
        "--lr-decay-at", type=inner_fraction, nargs="*", default=PAPER["lr_decay_at"], help="fractions of the run"
    )
    g.add_argument("--lr-decay", type=fraction, default=0.1, help="lr multiplier at each --lr-decay-at")
    g.add_argument("--prox-mu", type=non_negative_float, default=0.0, help="mu: FedProx's mu/2 ||w - w_t||^2 (0: off)")
    g = p.add_argument_group("run")
    g.add_argument("--seed", type=seed_int, default=0, help="seed of the init, client sampling and local shuffling")
    g.add_argument("--device", type=device_flag, help="cpu, cuda, cuda:N or mps (default: cuda if there is one)")
    g.add_argument("--amp", action="store_true", help="bfloat16 autocast for forward passes (CPU: often slower)")
    g.add_argument("--threads", type=positive_int, help="CPU threads (default: the cores; OMP_NUM_THREADS)")
    g.add_argument("--eval-every", type=positive_int, default=1, help="evaluate every this many rounds and the last")
    g.add_argument("--checkpoint-every", type=positive_int, help="checkpoint period (default: at each evaluation)")
    g.add_argument("--out", type=path_arg, help="run folder (default: runs/fedbabu__<dataset>__<seed>__<time>)")
    g.add_argument("--overwrite", action="store_true", help="replace the run in --out (else such an --out is refused)")
    g.add_argument("--save-model", action="store_true", help="write the final global model to OUT/model.pt")
    g.add_argument("--resume", type=path_arg, metavar="DIR", help="continue the run in DIR (a larger --rounds: extend)")
    g.add_argument("--stop-after", type=positive_int, help="checkpoint and stop after this many rounds")
    g.add_argument("--track", action="append", choices=TRACKERS, help="also log to TensorBoard or W&B (both: twice)")
    g.add_argument("--wandb-project", default="cleanfl", help="W&B project (--track wandb)")
    g.add_argument("--wandb-entity", help="W&B entity, a user or team (default: W&B's own)")
    args = finish_args(p, p.parse_args(), "fedbabu")
    # FedBABU: without --rounds, K = 320 // tau (Sec. 3); with --local-steps, the paper's tau.
    if args.rounds is None:
        args.rounds = max(320 // (args.local_epochs or PAPER["local_epochs"]), 1)
    return args


def aggregate(model, total, train_head=False):  # FedBABU: theta_G,ext^k = sum_i n_i/n theta_i,ext^k (Alg. 1 line 9)
    """The weighted sum of the client states (common.accumulate: parameters and buffers, so batch-norm
    running statistics are averaged like weights) becomes the global model (common.load_average), except
    the head: without --train-head it is not aggregated and keeps theta_G,cls^0, bitwise."""
    if not train_head:  # FedBABU: the head is not aggregated
        total = {**total, **model.head.state_dict(prefix="head.")}
    load_average(model, total)


def local_train(model, indices, data, args, lr, global_params):
    """E epochs (or --local-steps) of SGD on one client; returns the mean training loss (a tensor)."""
    # FedBABU: the head is not in the optimizer (Alg. 1 line 16: SGD on theta_ext given theta_cls^0).
    params = model.parameters() if args.train_head else model.body.parameters()
    opt = torch.optim.SGD(params, lr=lr, momentum=args.momentum, weight_decay=args.weight_decay)  # FedBABU: params
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


@torch.no_grad()
def body_features(model, x, data, amp=False, batch_size=2000):
    """FedBABU: penultimate features model.body(x) of uint8 images x (no augmentation), as float."""
    out = []
    for i in range(0, len(x), batch_size):
        with autocast(x.device, amp):
            out.append(model.body(prepare_batch(x[i : i + batch_size], data)).float())
    return torch.cat(out)


@torch.no_grad()
def nohead_accuracy(model, data, train_parts, test_parts, amp=False):
    """FedBABU 'without head' accuracy (Sec. 5.2.1, Table 3): per client, the template of class c is the
    mean body feature of the client's training images of class c; a test image gets the class of the
    template with the largest cosine similarity. Returns one accuracy per client with a test set."""
    model.eval()
    accs = []
    for tr, te in zip(train_parts, test_parts):
        if len(te) == 0:
            continue
        f = body_features(model, data.x_train[tr], data, amp)
        y = data.y_train[tr]
        sums = torch.zeros(data.num_classes, f.shape[1], device=f.device).index_add_(0, y, f)
        counts = torch.bincount(y, minlength=data.num_classes)
        # Only the client's own classes have a template.
        classes = torch.nonzero(counts).flatten()
        templates = sums[classes] / counts[classes, None]
        sim = F.normalize(body_features(model, data.x_test[te], data, amp), dim=1) @ F.normalize(templates, dim=1).T
        accs.append((classes[sim.argmax(1)] == data.y_test[te]).float().mean().item())
    return accs


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
        # FedBABU: the global model's head stays theta_G,cls^0 (Alg. 1 line 1).
        model = build_model(args.model, data).to(args.device)
        client = build_model(args.model, data).to(args.device)
        # config.json, partition.json and the start-up line; the first round.
        start = run.start(model, partition, data)
        client.head.requires_grad_(args.train_head)  # FedBABU: no gradient for the frozen head
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
                # FedBABU: the broadcast of {theta_G,ext^{k-1}, theta_G,cls^0} (Alg. 1 line 6).
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
            aggregate(model, total, args.train_head)  # FedBABU: the body averaged, the head kept (Alg. 1 line 9)
            train_loss = float(train_loss)
            if not math.isfinite(train_loss):
                # summary.json says it diverged; exit 1.
                run.end_diverged(rnd, train_loss)

            last = rnd + 1 == args.rounds
            if (rnd + 1) % args.eval_every == 0 or last:
                model.eval()
                # test_acc, test_loss; per client: mean, std, worst 10%; --balanced-acc: the same of it.
                # FedBABU: client_test_acc_mean is the initial accuracy of this round's global model.
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
        # FedBABU: Algorithm 2 on the final global model, for every client with a test set: fine-tune, then test.
        # Its results join summary.json; without per-client test sets there are none.
        summary = {}
        if partition.test is not None:
            # The stream that follows the last round's clients, also where --resume starts at the fine-tuning.
            torch.manual_seed(client_seed(args.seed, args.rounds - 1, -1))
            nohead = nohead_accuracy(model, data, partition.train, partition.test, amp=args.amp)  # Table 3
            # The accuracy after 0 (initial), tau_f and --ft-eval-epochs epochs.
            tuning = FineTuning(
                epochs=args.ft_epochs,
                lr=args.ft_lr,
                part=args.ft_part,
                batch_size=args.batch_size,
                augment=args.augment,
                eval_epochs=[0, *args.ft_eval_epochs],
                momentum=args.momentum,
                amp=args.amp,
            )
            ft = personalize(client, model.state_dict(), data, partition.train, test_parts=partition.test, ft=tuning)
            # Alg. 2 lines 5-6 (initial), lines 7-9 (personalized after tau_f epochs), Table 6 (the speed of it).
            summary = {
                "init_acc_mean": ft["acc_mean"][0],
                "init_acc_std": ft["acc_std"][0],
                "pers_acc_mean": ft["acc_mean"][args.ft_epochs],
                "pers_acc_std": ft["acc_std"][args.ft_epochs],
                "nohead_acc_mean": float(np.mean(nohead)),
                "nohead_acc_std": float(np.std(nohead)),
                "pers_acc_mean_by_epoch": {str(e): a for e, a in ft["acc_mean"].items()},
                "pers_acc_std_by_epoch": {str(e): a for e, a in ft["acc_std"].items()},
            }
            print(
                f"initial {summary['init_acc_mean']:.4f}, personalized ({args.ft_epochs} epochs) "
                f"{summary['pers_acc_mean']:.4f}, without head {summary['nohead_acc_mean']:.4f} (means over clients)"
            )
        # summary.json: the final round's metrics.
        run.finish(model, **summary)  # FedBABU: and the personalization's results

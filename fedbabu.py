"""FedBABU: Toward Enhanced Representation for Federated Image Classification
(Oh, Kim, Yun; ICLR 2022), on top of FedAvg (McMahan et al., AISTATS 2017) and FedProx (Li et al., MLSys 2020).

Idea: the head (last linear layer) keeps its random initialization for the whole federated phase and
only the body is trained and averaged (Algorithm 1); the final global model is then fine-tuned on each
client's data and evaluated on that client's test set (Algorithm 2). --train-head is FedAvg on the same
code path; --prox-mu gives FedProx(+BABU).

Reproduce (CPU, synthetic data, about a minute; add --train-head for the FedAvg side):
    python fedbabu.py --dataset synthetic --model convnet4-tiny --num-clients 10 --frac 0.5 --local-epochs 1 --rounds 10
The paper's settings: CIFAR-100 with MobileNet (Tables 3-6), CIFAR-10 with 4convNet (Appendix F, Table 13):
    python fedbabu.py --dataset cifar100
    python fedbabu.py --dataset cifar10 --model convnet4 --shards 10
Measured (benchmarks/reproduce/fedbabu.sh paper: Table 13's configuration, real CIFAR-10, seeds 0-1, one thread
of a 2-core x86_64 CPU, 95-100 min a run): personalized 77.7 vs FedAvg 71.7, after one fine-tuning epoch
77.0 vs 63.7, initial 66.1 vs 61.7 (Table 13: 76.25 vs 69.11; Table 12: initial 62.68 vs 57.32).

Docs: docs/fedbabu.md. Its "Implementation details and deviations" gives each choice with its reason:
the frozen head, the body-only average, Algorithm 2's fine-tuning (the official code's settings), the
per-client test sets and the "without head" accuracy.
"""

import argparse

import numpy as np
import torch
import torch.nn.functional as F

# fmt: off
from common import (AUGMENTATIONS, HelpFormatter, RoundLoop, RunFolder, accumulate, add_run_flags, announce, autocast,
                    build_model, client_batches, client_weights, decay_rate, device_flag, each_client, eval_metrics,
                    exit_if_diverged, finish_args, fraction, inner_fraction, load_average, load_data, lr_at,
                    make_partition, non_negative_float, non_negative_int, positive_float, positive_int, prepare_batch,
                    prox_term, rng_state, sample_clients, seed_everything, seed_int, set_rng_state, setup_distributed,
                    FineTuning, personalize)  # FedBABU: Algorithm 2 fine-tuning
# fmt: on

# The paper's setting: the defaults of the flags below (--help shows them). CIFAR-100 with MobileNet, s=10
# (Sec. 3, App. A, Tables 3-6); CIFAR-10 with 4convNet is Table 13's (--dataset cifar10 --model convnet4).
PAPER = dict(
    dataset="cifar100",
    shards=10,  # s=10: the most heterogeneous CIFAR-100 setting (also 50, 100)
    client_test=True,  # D_i^ts: each client's test set has its training classes
    num_clients=100,
    frac=0.1,  # f
    rounds=None,  # K = 320 // tau: the paper fixes rounds x tau = 320
    local_epochs=10,  # tau
    batch_size=50,  # also fine-tuning
    model="mobilenet",
    lr=0.1,  # of the body
    momentum=0.9,  # also fine-tuning (App. D)
    weight_decay=0.0,
    lr_decay_at=[0.5, 0.75],  # x0.1 at half and three quarters of the rounds
    augment="crop-flip",  # also fine-tuning
    ft_epochs=5,  # tau_f (Algorithm 2)
    ft_lr=1e-3,  # the paper gives none: the official code's
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
        help="on-device augmentation of training and fine-tuning batches")  # FedBABU: also fine-tuning
    g = p.add_argument_group("partition (at most one of --iid, --shards, --classes-per-client, --alpha, --split2, "
                             "--disjoint-classes, --natural; one given replaces the default)")
    g.add_argument("--iid", action="store_true", default=PAPER.get("iid", False), help="uniform random split")
    g.add_argument("--shards", type=positive_int, default=PAPER.get("shards"),
        help="s: sort by label, N*s shards, s per client")  # FedBABU: the paper's symbol
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
    g.add_argument("--client-test", action=argparse.BooleanOptionalAction, default=PAPER["client_test"],
        help="D_i^ts: per-client test sets with each client's training classes (needed for initial/personalized "
             "accuracy)")  # FedBABU: on
    g.add_argument("--balanced-acc", action="store_true",
        help="also log the balanced accuracy (mean per-class recall) of the global and per-client tests")
    g.add_argument("--data-seed", type=seed_int, default=None,
        help="seed of the partition (default: --seed); client sampling uses --seed")
    g.add_argument("--val-frac", type=decay_rate, default=0.0,
        help="share of each client's training data held out for validation: val_acc, and test_acc_at_best_val "
             "in summary.json (0: none)")
    g = p.add_argument_group("federation")
    g.add_argument("--num-clients", type=positive_int, default=PAPER["num_clients"], help="N: number of clients")
    g.add_argument("--frac", type=fraction, default=PAPER["frac"],
        help="f: fraction of clients sampled per round, in (0, 1]")
    g.add_argument("--rounds", type=positive_int, default=PAPER["rounds"],
        help="K: communication rounds (default: 320 // tau)")  # FedBABU: rounds x tau = 320
    g.add_argument("--local-epochs", type=positive_int, default=PAPER["local_epochs"],
        help="tau: local epochs per round")  # FedBABU: the paper's symbol
    g.add_argument("--local-steps", type=positive_int, default=None,
        help="local SGD steps per round instead of --local-epochs")
    g.add_argument("--batch-size", type=positive_int, default=PAPER["batch_size"],
        help="B: local (and fine-tuning) batch size")  # FedBABU: also fine-tuning
    g.add_argument("--weighting", default="samples", choices=["samples", "uniform"],
        help="aggregation weights: n_k/n, or 1/m")
    g = p.add_argument_group("optimization")
    g.add_argument("--model", default=PAPER["model"],
        help="mobilenet | convnet4 | convnet3 | resnet18 | resnet50 | ... (see common.MODELS)")  # FedBABU: its models
    g.add_argument("--lr", type=positive_float, default=PAPER["lr"],
        help="local learning rate of the body")  # FedBABU: the head is not trained
    g.add_argument("--momentum", type=decay_rate, default=PAPER["momentum"],
        help="local (and fine-tuning) SGD momentum (reset every round)")  # FedBABU: also fine-tuning (App. D)
    g.add_argument("--weight-decay", type=non_negative_float, default=PAPER["weight_decay"],
        help="local L2 weight decay")
    g.add_argument("--lr-decay-at", type=inner_fraction, nargs="*", default=PAPER["lr_decay_at"],
        help="fractions of the run at which lr is multiplied by --lr-decay, e.g. 0.5 0.75")
    g.add_argument("--lr-decay", type=fraction, default=0.1, help="lr multiplier at each --lr-decay-at")
    g.add_argument("--prox-mu", type=non_negative_float, default=0.0,
        help="mu: FedProx proximal term mu/2 ||w - w_t||^2 (0 = FedAvg/FedBABU; Table 7 uses 0.01)")
    g.add_argument("--train-head", action="store_true",
        help="also train and aggregate the head theta_cls: plain FedAvg (the paper's baseline)")  # FedBABU
    g = p.add_argument_group("personalization (Algorithm 2, run once after the last round)")  # FedBABU
    g.add_argument("--ft-epochs", type=non_negative_int, default=PAPER["ft_epochs"],
        help="tau_f: fine-tuning epochs of the personalized accuracy")  # FedBABU
    g.add_argument("--ft-lr", type=positive_float, default=PAPER["ft_lr"], help="fine-tuning learning rate")  # FedBABU
    g.add_argument("--ft-part", default="full", choices=["full", "body", "head"],
        help="part updated when fine-tuning (Table 4)")  # FedBABU
    g.add_argument("--ft-eval-epochs", type=non_negative_int, nargs="*", default=[0, 1, 2, 5, 10],
        help="fine-tuning epochs at which personalized accuracy is also reported (Table 6; 0 = initial)")  # FedBABU
    g = p.add_argument_group("run")
    g.add_argument("--seed", type=seed_int, default=0, help="seed of model init, client sampling and local shuffling")
    g.add_argument("--device", type=device_flag, default=None,
        help="cpu, cuda, cuda:N or mps (default: cuda if available, else cpu)")
    g.add_argument("--amp", action="store_true", help="bfloat16 autocast for forward passes")
    g.add_argument("--eval-every", type=positive_int, default=1,
        help="evaluate every this many rounds (and at the last)")
    add_run_flags(g, "fedbabu")  # --checkpoint-every, --out, --overwrite, --save-model, --resume, --stop-after
    args = p.parse_args()  # FedBABU
    if args.rounds is None:  # FedBABU: K = 320 / tau (Sec. 3)
        args.rounds = max(320 // args.local_epochs, 1)  # FedBABU
    return finish_args(p, args, "fedbabu")
# fmt: on


def aggregate(model, total, train_head=False):  # FedBABU: theta_G,ext^k = sum_i n_i/n theta_i,ext^k (Alg. 1 line 9)
    """The weighted sum of the client states (common.accumulate: parameters and buffers, so batch-norm
    running statistics are averaged like weights) becomes the global model (common.load_average), except
    the head: without --train-head it is not aggregated and keeps theta_G,cls^0, bitwise."""
    if not train_head:  # FedBABU: the head is not aggregated
        total = {**total, **model.head.state_dict(prefix="head.")}  # FedBABU
    load_average(model, total)


def local_train(model, indices, data, args, lr, global_params):
    """E epochs (or --local-steps) of SGD on one client; returns the mean training loss (a tensor)."""
    # FedBABU: head not in the optimizer (Alg. 1 line 16: SGD on theta_ext given theta_cls^0)
    params = model.parameters() if args.train_head else model.body.parameters()
    opt = torch.optim.SGD(params, lr=lr, momentum=args.momentum, weight_decay=args.weight_decay)  # FedBABU: params
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


@torch.no_grad()
def body_features(model, x, data, amp=False, batch_size=2000):  # FedBABU
    """FedBABU: penultimate features model.body(x) of uint8 images x (no augmentation), as float."""
    out = []
    for i in range(0, len(x), batch_size):
        with autocast(x.device, amp):
            out.append(model.body(prepare_batch(x[i : i + batch_size], data)).float())
    return torch.cat(out)


@torch.no_grad()
def nohead_accuracy(model, data, train_parts, test_parts, amp=False):  # FedBABU
    """FedBABU 'without head' accuracy (Sec. 5.2.1, Table 3): per client, the template of class c is the
    mean body feature of the client's training images of class c; a test image gets the class of the
    template with the largest cosine similarity. Returns one accuracy per client with a test set."""
    model.eval()
    accs = []
    for tr, te in zip(train_parts, test_parts):
        if len(te) == 0:
            continue
        f, y = body_features(model, data.x_train[tr], data, amp), data.y_train[tr]
        sums = torch.zeros(data.num_classes, f.shape[1], device=f.device).index_add_(0, y, f)
        counts = torch.bincount(y, minlength=data.num_classes)
        classes = torch.nonzero(counts).flatten()  # only the client's own classes have a template
        templates = sums[classes] / counts[classes, None]
        sim = F.normalize(body_features(model, data.x_test[te], data, amp), dim=1) @ F.normalize(templates, dim=1).T
        accs.append((classes[sim.argmax(1)] == data.y_test[te]).float().mean().item())
    return accs


if __name__ == "__main__":
    args = parse_args()
    setup_distributed(args)  # torchrun: join the other ranks (nothing when run alone)
    seed_everything(args.seed)
    data = load_data(args)
    partition = make_partition(args, data)  # uses its own generator seeded by --data-seed
    folder = RunFolder(args, "fedbabu")  # config.json; then partition.json, metrics.jsonl, checkpoint.pt, summary.json
    loop = RoundLoop(args, folder)  # the rounds under a bar: which evaluate, checkpoints, --stop-after, Ctrl-C
    folder.write_partition(partition, data)
    # the global model w_t; FedBABU: its head stays theta_G,cls^0 (Alg. 1 line 1)
    model = build_model(args.model, data).to(args.device)
    client = build_model(args.model, data).to(args.device)  # one client model, reloaded for every client
    announce(folder, model, partition)  # start-up line: device, model, partition, run folder
    client.head.requires_grad_(args.train_head)  # FedBABU: no gradient for the frozen head
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
            # FedBABU: broadcast {theta_G,ext^{k-1}, theta_G,cls^0} (Alg. 1 line 6)
            client.load_state_dict(model.state_dict())
            loss = local_train(client, partition.train[k], data, args, lr, [p.detach() for p in model.parameters()])
            return {"loss": loss, "state": client.state_dict()}

        # own seed per client; torchrun: split over ranks, summed in order
        for k, w, out in each_client(clients, weights, train_client, args.seed, rnd):
            train_loss += w * out["loss"]
            accumulate(total, out["state"], w)  # batch-norm running statistics are averaged like weights
        # FedBABU: theta_G,ext^k = sum_i n_i/n theta_i,ext^k (Alg. 1 line 9); the head stays
        aggregate(model, total, args.train_head)
        train_loss = exit_if_diverged(train_loss, rnd, folder)  # NaN or inf: summary.json says diverged, exit 1

        if loop.evaluates(rnd):  # every --eval-every rounds and the last
            model.eval()
            # test_acc, test_loss; per-client mean, std, worst 10%; --balanced-acc: the same of balanced accuracy.
            # FedBABU: client_test_acc_mean is the initial accuracy of this round's global model
            tests = eval_metrics(model, data, partition.test, args.balanced_acc, args.amp, val=partition.val)
            folder.log({"round": rnd + 1, **tests, "train_loss": train_loss, "lr": lr})
    # FedBABU: Algorithm 2 on the final global model, for every client: fine-tune, then test
    summary = {}  # FedBABU: its results, added to summary.json
    if partition.test is not None:  # FedBABU
        nohead = nohead_accuracy(model, data, partition.train, partition.test, args.amp)  # FedBABU: Table 3
        # FedBABU: Alg. 2, accuracy after 0 (initial), tau_f and --ft-eval-epochs epochs
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
        ft = personalize(client, model.state_dict(), data, partition.train, partition.test, tuning)
        summary = {  # FedBABU: Alg. 2 lines 5-6 (initial), 7-9 (personalized after tau_f epochs), Table 6 (speed)
            "init_acc_mean": ft["acc_mean"][0],
            "init_acc_std": ft["acc_std"][0],
            "pers_acc_mean": ft["acc_mean"][args.ft_epochs],
            "pers_acc_std": ft["acc_std"][args.ft_epochs],
            "nohead_acc_mean": float(np.mean(nohead)),
            "nohead_acc_std": float(np.std(nohead)),
            "pers_acc_mean_by_epoch": {str(e): a for e, a in ft["acc_mean"].items()},
            "pers_acc_std_by_epoch": {str(e): a for e, a in ft["acc_std"].items()},
        }
        print(  # FedBABU
            f"initial {summary['init_acc_mean']:.4f}, personalized ({args.ft_epochs} epochs) "
            f"{summary['pers_acc_mean']:.4f}, without head {summary['nohead_acc_mean']:.4f} (means over clients)"
        )
    folder.finish(model, **summary)  # FedBABU: summary.json also holds the personalization

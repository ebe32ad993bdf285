"""FedFN: Feature Normalization for Alleviating Data Heterogeneity Problem in Federated Learning
(Kim, Lee, Oh, Yun; FL@FM-NeurIPS 2023 workshop), on top of FedAvg (McMahan et al., AISTATS 2017).

Idea: under label skew, local models learn large feature norms for their own classes. FedFN feeds the classifier the
unit-norm feature, z = theta_cls f / ||f||_2 (Section 4.1), on clients and at evaluation; everything else is FedAvg.
--no-fn is FedAvg on the same code path; --agg scaffold|fedexp combines FN with SCAFFOLD / FedEXP (Table 2);
--ft-epochs gives FedFN-FT (Appendix D.3); --fr-mu is FedFR (Eq. 1); --analyze logs the four factors of Section 3.1.

    python fedfn.py --dataset cifar10 --shards 2          # Table 1: VGG11 on CIFAR-10, s = 2
    python fedfn.py --dataset cifar10 --shards 2 --no-fn --lr 0.01   # its FedAvg column

Usage, logged metrics, implementation details (VGG11, the head's bias, SCAFFOLD, FedEXP) and results: docs/fedfn.md.
"""

import os

# Before torch loads OpenMP: a thread that waits for work spins about 10 microseconds, then sleeps. Longer spins
# are faster alone and far slower beside other runs (docs/speed.md#cpu-threads); the numbers are the same.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")

import math

import torch
import torch.nn as nn  # FedFN: VGG11
import torch.nn.functional as F

from common import AUGMENTATIONS, DATASETS, MODELS, Parser, Run, build_model, finish_args, load_data, make_partition
from common import accumulate, client_batches, client_weights, each_client, eval_metrics, load_average, lr_at
from common import autocast, prepare_batch, prox_term, sample_clients
from common import Classifier, flat_dim, register_model  # FedFN: VGG11
from common import local_step_sum, scaffold_control, scaffold_correction, scaffold_server  # FedFN: SCAFFOLD
from common import FineTuning, personalize  # FedFN: FedFN-FT (Appendix D.3)
from common import decay_rate, device_flag, fraction, inner_fraction, non_negative_float, path_arg, positive_float
from common import TRACKERS, non_negative_int, positive_int, seed_int

# The paper's setting, the defaults of the flags below: Table 1's CIFAR-10 column with VGG11 (App. B.2); Table 1 also
# runs s = 2, 3, 5 (--shards S) and CIFAR-100 with MobileNet (E = 5, lr 0.5).
PAPER = dict(
    dataset="cifar10",
    shards=10,  # s
    num_clients=100,  # N
    frac=0.1,  # r
    rounds=320,  # R
    local_epochs=15,  # E
    batch_size=50,
    # VGG11 without batch norm.
    model="vgg11",
    # FN's tuned rate (ResNet18: 0.1); FedAvg's, with --no-fn, is 0.01.
    lr=0.03,
    momentum=0.9,
    # Not stated; FedBABU's code, which FedFN builds on, has none.
    weight_decay=0.0,
    # The lr is multiplied by 0.1 at half and at three quarters of the rounds (B.2).
    lr_decay_at=[0.5, 0.75],
    # Horizontal flips only (B.2).
    augment="flip",
)


@register_model("vgg11")  # FedFN: the paper's model
def vgg(in_channels, num_classes, image_size, width=1.0, pools=5, **_):
    """VGG11 as FedFN's code base (FedNTD's models/vgg.py) builds it: conv3x3 (bias; init N(0, 2/(9 C_out)), bias 0)
    and ReLU, max-pool 2 at M (not at 1x1), no batch norm; fc 512, fc 512 (d = 512), head. vgg11-narrow (ours, CPU):
    1/4 of the channels, 4 pools: fc 1 reads 512 entries, init norms stay VGG11's (benchmarks/proxy_properties.py)."""
    layers = []
    cin = in_channels
    size = image_size
    pooled = 0
    for v in [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]:
        if v == "M":
            if size >= 2 and pooled < pools:
                layers.append(nn.MaxPool2d(2))
                size = size // 2
                pooled = pooled + 1
            continue
        conv = nn.Conv2d(cin, int(v * width), 3, padding=1)
        nn.init.normal_(conv.weight, 0, math.sqrt(2.0 / (9 * conv.out_channels)))
        nn.init.zeros_(conv.bias)
        layers += [conv, nn.ReLU()]
        cin = conv.out_channels
    conv = nn.Sequential(*layers, nn.Flatten())
    fc = [nn.Linear(flat_dim(conv, in_channels, image_size), 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU()]
    # Its images as they come: VGG11 trains slower on channels-last images on the CPU (docs/speed.md#image-layout).
    return Classifier(nn.Sequential(conv, *fc), 512, num_classes, channels_last=False)


# FedFN: the CPU proxy.
@register_model("vgg11-narrow")
def vgg_narrow(in_channels, num_classes, image_size, **_):
    return vgg(in_channels, num_classes, image_size, width=0.25, pools=4)


def fn_scale(text):  # FedFN: --fn-scale
    """s > 0, or sqrt-d."""
    if text == "sqrt-d":
        return text
    return positive_float(text)


def parse_args():
    p = Parser(__doc__)
    g = p.add_argument_group("FedFN")  # FedFN: the method's flags
    g.add_argument(
        "--no-fn",
        dest="fn",
        action="store_false",
        help="logits theta_cls f, not theta_cls f/||f||_2: FedAvg on this code path",
    )
    # Our control, not the paper's method.
    g.add_argument(
        "--fn-scale",
        type=fn_scale,
        default=1.0,
        help="s in z = theta_cls (s f/||f||_2): 1 is FedFN's; a number, or sqrt-d (FedLN's FN)",
    )
    g.add_argument(
        "--fr-mu",
        type=non_negative_float,
        default=0.0,
        help="mu of Eq. (1): + mu ||f(x)||_2 on the local loss (FedFR, App. D.6: 0.005, with --no-fn)",
    )
    g.add_argument(
        "--agg",
        default="fedavg",
        choices=["fedavg", "scaffold", "fedexp"],
        help="the server algorithm FN is combined with (Table 2)",
    )
    g.add_argument(
        "--fedexp-eps",
        type=positive_float,
        default=1e-3,
        help="epsilon of FedEXP's server step size (Jhunjhunwala et al. 2023)",
    )
    g.add_argument(
        "--ft-epochs",
        type=non_negative_int,
        default=0,
        help="FedFN-FT: fine-tune the final model on each client (App. D.3: 5; needs --client-test)",
    )
    g.add_argument("--ft-lr", type=positive_float, help="FedFN-FT's lr (default: 0.1 x --lr, Table 9)")
    g.add_argument(
        "--analyze",
        nargs="?",
        const="final",
        choices=["final", "every"],
        help="the four factors (Sec. 3.1, B.3) and the feature norm, at the final or every evaluation",
    )
    g = p.add_argument_group("data")
    g.add_argument("--dataset", default=PAPER["dataset"], choices=sorted(DATASETS), help="folder: --data-dir's images")
    g.add_argument("--data-dir", type=path_arg, default="./data", help="download folder, or DIR/{train,test}/<class>/*")
    g.add_argument("--augment", default=PAPER["augment"], choices=AUGMENTATIONS, help="of training batches, on device")
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
    g.add_argument("--client-test", action="store_true", help="also test each client on its own label distribution")
    g.add_argument("--balanced-acc", action="store_true", help="also log the balanced accuracy (mean class recall)")
    g.add_argument("--data-seed", type=seed_int, help="seed of the partition (default: --seed)")
    g.add_argument("--val-frac", type=decay_rate, default=0.0, help="share of each client's data held out: val_acc")
    g = p.add_argument_group("federation")
    g.add_argument("--num-clients", type=positive_int, default=PAPER["num_clients"], help="N: number of clients")
    g.add_argument("--frac", type=fraction, default=PAPER["frac"], help="r: fraction of clients a round, in (0, 1]")
    g.add_argument("--rounds", type=positive_int, default=PAPER["rounds"], help="R: communication rounds")
    # One of them: the flag given replaces the default.
    x = g.add_mutually_exclusive_group()
    x.add_argument("--local-epochs", type=positive_int, default=PAPER["local_epochs"], help="E: epochs a round")
    x.add_argument("--local-steps", type=positive_int, help="local SGD steps a round, not epochs")
    g.add_argument("--batch-size", type=positive_int, default=PAPER["batch_size"], help="B: local batch size")
    g.add_argument("--weighting", default="samples", choices=["samples", "uniform"], help="weights n_k/n, or 1/m")
    g = p.add_argument_group("optimization")
    # FedFN: the paper's models.
    g.add_argument(
        "--model",
        default=PAPER["model"],
        choices=sorted(MODELS),
        metavar="NAME",
        help="vgg11, mobilenet, resnet18, cnn, ...",
    )
    # FedFN: FN's rate is higher.
    g.add_argument(
        "--lr", type=positive_float, default=PAPER["lr"], help="eta: local learning rate (FedAvg's, with --no-fn: 0.01)"
    )
    g.add_argument("--momentum", type=decay_rate, default=PAPER["momentum"], help="local SGD momentum, reset a round")
    g.add_argument("--weight-decay", type=non_negative_float, default=PAPER["weight_decay"], help="local L2 decay")
    # FedFN: the paper's decay.
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
    g.add_argument("--out", type=path_arg, help="run folder (default: runs/fedfn__<dataset>__<seed>__<time>)")
    g.add_argument("--overwrite", action="store_true", help="replace the run in --out (else such an --out is refused)")
    g.add_argument("--save-model", action="store_true", help="write the final global model to OUT/model.pt")
    g.add_argument("--resume", type=path_arg, metavar="DIR", help="continue the run in DIR (a larger --rounds: extend)")
    g.add_argument("--stop-after", type=positive_int, help="checkpoint and stop after this many rounds")
    g.add_argument("--track", action="append", choices=TRACKERS, help="also log to TensorBoard or W&B (both: twice)")
    g.add_argument("--wandb-project", default="cleanfl", help="W&B project (--track wandb)")
    g.add_argument("--wandb-entity", help="W&B entity, a user or team (default: W&B's own)")
    args = p.parse_args()  # FedFN: the method's flags are checked first
    if args.ft_epochs > 0 and not args.client_test and not args.resume:
        p.error("--ft-epochs: FedFN-FT needs --client-test (per-client test sets)")  # FedFN
    return finish_args(p, args, "fedfn")


def fn_forward(model, x, fn=True, scale=1.0):  # FedFN: Section 4.1, z = theta_cls f / ||f||_2
    """(logits, feature f): head(s f / ||f||_2) with FN (s = 1 in the paper), head(f) = model(x) without (FedAvg).
    Each feature vector (dim 1) is normalized on its own; the head keeps its bias (the paper's z has none)."""
    f = model.body(x)
    if not fn:
        return model.head(f), f
    # With sqrt-d, ||s f / ||f|| || = sqrt(d): FedLN's scale.
    s = math.sqrt(f.shape[1]) if scale == "sqrt-d" else scale
    # The norm is clamped at F.normalize's eps.
    return model.head(s * (f / f.norm(dim=1, keepdim=True).clamp_min(1e-12))), f


def local_train(model, indices, data, args, lr, global_params, correction=None):  # FedFN: + SCAFFOLD's correction
    """E epochs (or --local-steps) of SGD on one client; returns the mean training loss (a tensor), the steps K and
    (--analyze) the mean ||f|| of the first and of the last batch.
    `correction` (SCAFFOLD): c - c_i per parameter, added to every gradient (Karimireddy et al. 2020, Alg. 1)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum, weight_decay=args.weight_decay)
    model.train()
    loss_sum = torch.zeros((), device=args.device)
    seen = 0
    steps = 0  # FedFN: K, for SCAFFOLD
    # With --analyze, the mean ||f|| of the first and of the last batch.
    first_norm = None  # FedFN
    last_norm = None  # FedFN
    for batch in client_batches(indices, args.batch_size, args.local_epochs, args.local_steps):
        x = prepare_batch(data.x_train[batch], data, args.augment)
        y = data.y_train[batch]
        with autocast(args.device, args.amp):
            logits, f = fn_forward(model, x, args.fn, args.fn_scale)  # FedFN: the normalized feature into the head
            loss = F.cross_entropy(logits.float(), y)
        if args.analyze:  # FedFN: how ||f|| grows in local training
            last_norm = f.detach().float().norm(dim=1).mean()
            first_norm = last_norm if first_norm is None else first_norm
        if args.fr_mu > 0:  # FedFN: FedFR, Eq. (1): L_CE + mu ||f(x; theta_ext)||_2 (batch mean)
            loss = loss + args.fr_mu * f.float().norm(dim=1).mean()
        if args.prox_mu > 0:
            loss = loss + prox_term(model.parameters(), global_params, args.prox_mu)  # Li et al. 2020, Eq. 2
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if correction is not None:  # FedFN: SCAFFOLD, y_i <- y_i - eta_l (g_i(y_i) - c_i + c)
            for name, w in model.named_parameters():
                w.grad.add_(correction[name])
        opt.step()
        loss_sum += loss.detach() * len(batch)
        seen += len(batch)
        steps += 1  # FedFN
    return loss_sum / max(seen, 1), steps, (first_norm, last_norm)  # FedFN: + K, + ||f|| at the first and last step


def fedexp_server_lr(sq_norm_mean, avg_update_sq_norm, eps):  # FedFN: FedEXP's step size
    """Jhunjhunwala et al. 2023 (p_i = 1/M): eta_g = max(1, sum_i p_i ||Delta_i||^2 / (2 (||Delta_bar||^2 + eps)))."""
    return max(1.0, float(sq_norm_mean) / (2 * (float(avg_update_sq_norm) + eps)))


def sq_dist(xs, ys):  # FedFN: FedEXP
    """||x - y||^2 summed over all parameters (lists of tensors), in float32."""
    return sum((a - b).float().pow(2).sum() for a, b in zip(xs, ys))


def fedexp_step(params, x_old, sq_norm_mean, eps):  # FedFN: FedEXP's server step (Jhunjhunwala et al. 2023, Alg. 1)
    """w_{t+1} = w_t - eta_g Delta_bar, Delta_bar = w_t - sum_i p_i y_i. `params` (a list) hold the average
    sum_i p_i y_i on entry and w_{t+1} on return; x_old is w_t, sq_norm_mean sum_i p_i ||Delta_i||^2. Returns eta_g."""
    eta_g = fedexp_server_lr(sq_norm_mean, sq_dist(params, x_old), eps)
    for p, x0 in zip(params, x_old):
        p.copy_(x0 + eta_g * (p - x0))
    return eta_g


def midpoint_(params, x_old):  # FedFN: FedEXP
    """params <- (params + x_old) / 2: FedEXP reports the mean of the last two iterates."""
    for p, x0 in zip(params, x_old):
        p.add_(x0).mul_(0.5)


def four_factors(weight, feats, labels, num_classes, fn=True):  # FedFN: Section 3.1 / Appendix B.3
    """weight [C, d] (theta_cls), feats [n, d] (f(x), un-normalized), labels [n]. Mean cosine similarities:
    weight_sim of pairs of head rows; inter_class_sim of pairs of class prototypes (a class's mean of the features the
    head sees: f/||f|| with FN); intra_class_sim over classes of mean cos(f(x), prototype); proto_weight_align over
    classes of cos(theta_cls,c, prototype_c). feature_norm: mean ||f(x)||_2; head_row_norm: mean ||theta_cls,c||_2."""
    w = F.normalize(weight.float(), dim=1)
    head_in = F.normalize(feats, dim=1) if fn else feats
    classes = [c for c in range(num_classes) if bool((labels == c).any())]
    protos = F.normalize(torch.stack([head_in[labels == c].mean(0) for c in classes]), dim=1)

    def off(m):
        """The mean of a square matrix's off-diagonal entries."""
        return m[~torch.eye(len(m), dtype=torch.bool, device=m.device)].mean()

    intra = [(F.normalize(feats[labels == c], dim=1) @ protos[i]).mean() for i, c in enumerate(classes)]
    return {
        "weight_sim": float(off(w @ w.T)),
        "inter_class_sim": float(off(protos @ protos.T)),
        "intra_class_sim": float(torch.stack(intra).mean()),
        "proto_weight_align": float((w[classes] * protos).sum(1).mean()),
        "feature_norm": float(feats.norm(dim=1).mean()),
        # With FN it bounds the logits: |z_c| <= ||theta_c||.
        "head_row_norm": float(weight.float().norm(dim=1).mean()),
    }


def invariant_layer(model):  # FedFN: the parameters that FN makes scale-invariant
    """The last module of model.body with parameters of its own (VGG: the second fc layer; 4convNet: the last batch
    norm). Where only ReLU, pooling and flattening follow it (not in ResNets: a shortcut joins after it), scaling
    (weight, bias) by c > 0 scales f by c: with FN the loss is unchanged, the gradient orthogonal to them, and a plain
    SGD step can only lengthen them, ||w - lr g||^2 = ||w||^2 + lr^2 ||g||^2."""
    return [m for m in model.body.modules() if next(m.parameters(recurse=False), None) is not None][-1]


def param_norm(module):  # FedFN
    """||(weight, bias)||_2 of one module."""
    return torch.sqrt(sum(p.detach().float().pow(2).sum() for p in module.parameters(recurse=False)))


@torch.no_grad()
def analyze(model, data, args, batch_size=2000):  # FedFN
    """The four factors (four_factors) of the global model on D_test."""
    model.eval()

    def feature(x):
        return fn_forward(model, prepare_batch(x, data), args.fn, args.fn_scale)[1].float()

    feats = torch.cat([feature(data.x_test[i : i + batch_size]) for i in range(0, len(data.x_test), batch_size)])
    return four_factors(model.head.weight, feats, data.y_test, data.num_classes, fn=args.fn)


def client_traces(traces, global_layer_norm):  # FedFN: what local training and averaging do to ||f||
    """traces [m, 3]: each client's mean ||f|| on its first and last batch, its invariant layer's norm after them."""
    start, end, layer = traces.float().T
    return {
        # The global model w_t's, on the clients' data.
        "client_feature_norm_start": float(start.mean()),
        "client_feature_norm_end": float(end.mean()),
        # The spread over the round's clients.
        "client_feature_norm_end_std": float(end.std(unbiased=False)),
        "client_invariant_norm": float(layer.mean()),
        # After averaging: below the clients' mean when they disagree.
        "invariant_norm": float(global_layer_norm),
    }


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
        scaffold = args.agg == "scaffold"  # FedFN
        fedexp = args.agg == "fedexp"  # FedFN

        def zeros():  # FedFN
            """A zero tensor for each parameter, by name."""
            return {n: torch.zeros_like(w) for n, w in model.named_parameters()}

        c_global = run.checkpoint.get("scaffold_c", zeros()) if scaffold else None  # FedFN: SCAFFOLD's c, resumed too
        c_local = run.checkpoint.get("scaffold_c_local", {})  # FedFN: SCAFFOLD's c_i of each client that has trained

        def c_of(k):  # FedFN
            """Client k's c_i, 0 until it trains."""
            return c_local.get(k) or zeros()

        param_names = [n for n, _ in model.named_parameters()]  # FedFN: y_i = these entries of client i's state
        if args.resume:
            model.load_state_dict(run.checkpoint["model"])

        def state():
            """What a checkpoint holds: what the server keeps."""
            extra = {"scaffold_c": c_global, "scaffold_c_local": c_local} if scaffold else {}  # FedFN: c, c_i
            return {"model": model.state_dict(), **extra}

        eval_model = model  # FedFN: the model evaluated (FedEXP: the mean of two iterates)
        # The bar shows the latest test accuracy.
        for rnd in run.bar(range(start, args.rounds)):
            lr = lr_at(rnd, args)
            clients = sample_clients(run.sampler, len(sizes), args.frac)
            weights = client_weights([sizes[k] for k in clients], args.weighting)
            total = {k: torch.zeros_like(v, dtype=torch.float) for k, v in model.state_dict().items()}
            train_loss = torch.zeros((), device=args.device)
            x_old = [w.detach().clone() for w in model.parameters()]  # FedFN: w_t, for SCAFFOLD and FedEXP
            delta_c_sum = zeros() if scaffold else None  # FedFN: SCAFFOLD's sum_i (c_i+ - c_i)
            sq_norm_mean = torch.zeros((), device=args.device)  # FedFN: FedEXP's sum_i p_i ||Delta_i||^2
            # With --analyze, a row per client: ||f|| at the first and the last step, ||invariant layer|| after them.
            traces = []  # FedFN

            def train_client(k):
                """What client k does this round; returns what the server sums."""
                client.load_state_dict(model.state_dict())
                correction = scaffold_correction(c_global, c_of(k)) if scaffold else None  # FedFN: c - c_i
                # x_old is w_t, for FedProx.
                loss, steps, norms = local_train(
                    client, partition.train[k], data, args, lr=lr, global_params=x_old, correction=correction
                )
                out = {"loss": loss, "state": client.state_dict(), "steps": steps}  # FedFN: + steps
                if args.analyze:  # FedFN: ||f|| at the first and last local step, the invariant layer's norm after them
                    out["traces"] = torch.stack([*norms, param_norm(invariant_layer(client))])
                return out

            # Each client its own seed; under torchrun, split over the ranks and summed in client order.
            for k, w, out in each_client(clients, weights, train_client, seed=args.seed, rnd=rnd):
                train_loss += w * out["loss"]
                y = {n: out["state"][n] for n in param_names}  # FedFN: y_i
                if scaffold:  # FedFN: c_i+ (option II, K -> K' with momentum) and the server's sum of c_i+ - c_i
                    c_i = c_of(k)
                    step_sum = local_step_sum(out["steps"], lr, args.momentum)
                    c_local[k] = scaffold_control(c_i, c_global, dict(zip(param_names, x_old)), y, step_sum=step_sum)
                    delta_c_sum = {n: delta_c_sum[n] + (c_local[k][n] - c_i[n]) for n in param_names}
                if fedexp:  # FedFN: ||Delta_i||^2 = ||w_t - y_i||^2
                    sq_norm_mean += w * sq_dist(x_old, y.values())
                if args.analyze:  # FedFN
                    traces.append(out["traces"])
                # Batch-norm running statistics are averaged like the weights.
                accumulate(total, out["state"], w)
            load_average(model, total)  # w_{t+1} = sum_k n_k/n w_{t+1}^k (McMahan et al. 2017, Alg. 1)
            if scaffold:  # FedFN: x <- x + (1/|S|) sum Delta y_i (server step 1, weighted as above); c's update
                c_global = scaffold_server(c_global, delta_c_sum, len(sizes))
            if fedexp:  # FedFN: w_{t+1} = w_t - eta_g Delta_bar, Delta_bar = w_t - sum_i p_i y_i
                with torch.no_grad():
                    eta_g = fedexp_step(list(model.parameters()), x_old, sq_norm_mean, args.fedexp_eps)
                    # Evaluated: (w_t + w_{t+1}) / 2, as the FedEXP paper does.
                    client.load_state_dict(model.state_dict())
                    if rnd > 0:
                        midpoint_(list(client.parameters()), x_old)
                    eval_model = client
            train_loss = float(train_loss)
            if not math.isfinite(train_loss):
                # summary.json says it diverged; exit 1.
                run.end_diverged(rnd, train_loss)

            last = rnd + 1 == args.rounds
            if (rnd + 1) % args.eval_every == 0 or last:
                eval_model.eval()  # FedFN

                def forward(x):  # FedFN: FN at evaluation, too
                    return fn_forward(eval_model, x, args.fn, args.fn_scale)[0]

                # test_acc, test_loss; per client: mean, std, worst 10%; --balanced-acc: the same of it.
                tests = eval_metrics(forward, data, partition.test, args.balanced_acc, amp=args.amp, val=partition.val)
                metrics = {"round": rnd + 1, **tests, "train_loss": train_loss, "lr": lr}
                if fedexp:  # FedFN
                    metrics["server_lr"] = eta_g
                if args.analyze == "every" or (args.analyze and last):  # FedFN
                    metrics.update(analyze(eval_model, data, args))
                    metrics.update(client_traces(torch.stack(traces), param_norm(invariant_layer(eval_model))))
                run.log(metrics)
            # Ctrl-C or SIGTERM to any rank, or --stop-after.
            interrupted = run.interrupted()
            stop = interrupted or (rnd + 1 - start == args.stop_after and not last)
            # By default a checkpoint at each evaluation: the server's state, the round, the sampler, the clock.
            if stop or last or (rnd + 1) % (args.checkpoint_every or args.eval_every) == 0:
                run.save({**state(), **run.snapshot(rnd)}, "checkpoint.pt")
            if stop:
                # One line says how to --resume it; exit 0, or 130 and 143 after Ctrl-C and SIGTERM.
                run.end_stopped(rnd)
        model.load_state_dict(eval_model.state_dict())  # FedFN: the evaluated final model (FedEXP: averaged)
        final = {}  # FedFN: FedFN-FT's results, added to summary.json
        if args.ft_epochs > 0:  # FedFN: FedFN-FT (App. D.3): fine-tune the final model on each client, FN kept
            ft_lr = args.ft_lr if args.ft_lr is not None else 0.1 * args.lr
            ft = FineTuning(
                epochs=args.ft_epochs,
                lr=ft_lr,
                part="full",
                batch_size=args.batch_size,
                augment=args.augment,
                eval_epochs=[0],
                momentum=args.momentum,
                amp=args.amp,
            )

            def forward(m, x):
                return fn_forward(m, x, args.fn, args.fn_scale)[0]

            res = personalize(
                client, model.state_dict(), data, partition.train, test_parts=partition.test, ft=ft, forward=forward
            )
            final.update(
                ft_acc_mean=res["acc_mean"][args.ft_epochs],
                ft_acc_std=res["acc_std"][args.ft_epochs],
                ft_lr=ft_lr,
                ft_acc_mean_before=res["acc_mean"][0],
            )
        # summary.json: the final round's metrics.
        run.finish(model, **final)  # FedFN: and FedFN-FT's
        if args.ft_epochs > 0:  # FedFN
            print(f"FedFN-FT personalized accuracy {final['ft_acc_mean']:.4f} +- {final['ft_acc_std']:.4f}")

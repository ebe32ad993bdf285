"""ANFR: An Architecture Built for Federated Learning: Addressing Data Heterogeneity through Adaptive
Normalization-Free Feature Recalibration (anonymous authors, under review at ICML).

Idea: the method is the backbone, not the aggregation. ANFR = an NF-ResNet (Scaled Weight Standardization, Eq. 5: no
activation normalization, so no client batch statistics to mismatch or average) plus channel attention (SE / ECA /
CBAM). It is compared with BN-, GN-, SE- and NF-ResNets (--arch) under FedAvg, FedProx, SCAFFOLD and FedAdam (--agg,
Table 1), FedPer and FedBN (--pfl, Table 2), and DP-SGD (Sec. 4.3). The models are timm's ResNet-50s, checked logit
for logit in tests.

    python anfr.py --dataset cifar10 --arch anfr --stem imagenet --image-size 224 --augment rrc --crop-scale 0.05 1 \
        --normalize half --bn-stats local --val-frac 0.1      # Table 9: CIFAR-10 split-2 from scratch (a GPU)

Usage (with the pretrained, timm setting), logged metrics, implementation details (timm's init, Pieri et al.'s recipe,
per-client AdamW and cosine state, FedAdam, SCAFFOLD after each AdamW step, DP-SGD's sampling and accountant,
batch-norm averaging) and results: docs/anfr.md.
"""

import os

# Before torch loads OpenMP: a thread that waits for work spins about 10 microseconds, then sleeps. Longer spins
# are faster alone and far slower beside other runs (docs/speed.md#cpu-threads); the numbers are the same.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")

import functools
import math
import re

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad_and_value, vmap  # ANFR: per-sample gradients for DP-SGD

from common import AUGMENTATIONS, DATASETS, BadInput, Parser, Run, build_model, finish_args, load_data, make_partition
from common import accumulate, client_batches, client_weights, each_client, eval_metrics, load_average
from common import autocast, prepare_batch, progress, prox_term, sample_clients
from common import decay_rate, device_flag, flag_type, fraction, non_negative_float, non_negative_int, path_arg
from common import TRACKERS, positive_float, positive_int, seed_int
from common import ATTENTION, RESNET_LAYOUT, ScaledStdConv2d, make_norm, round_channels  # ANFR: the ResNet's parts
from common import safe_load  # ANFR: --init-from
from common import scaffold_control, scaffold_correction, scaffold_server  # ANFR: SCAFFOLD

# The paper's from-scratch CIFAR-10 setting, the defaults of the flags below: App. A.1 and B.3, Table 9, with Pieri et
# al. 2023's recipe, which B.3 follows, where marked. The rest of that recipe, at the paper's 224x224: --augment rrc
# --crop-scale 0.05 1 --normalize half --image-size 224 --stem imagenet (benchmarks/reproduce/anfr.sh paper).
PAPER = dict(
    dataset="cifar10",
    # Split-2 of Qu et al. 2022: 5 clients of 4 classes each (A.1).
    split2=True,
    num_clients=5,  # C
    # All clients every round.
    frac=1.0,
    rounds=100,  # T (A.1)
    local_epochs=1,  # E (A.1)
    batch_size=32,  # B (A.1)
    arch="anfr",
    # The paper's ResNet-50.
    depth=50,
    # B.3, from random init; Pieri et al.'s, from ImageNet weights, is SGD.
    optimizer="adamw",
    # AdamW's, cosine-decayed over the run (B.3).
    lr=1e-3,
    weight_decay=0.05,  # Pieri et al.
    warmup_steps=100,  # Pieri et al.
    # Gradient-norm clipping (A.1).
    clip=1.0,
    # Each client keeps its optimizer state and its place in the schedule between rounds (A.2).
    client_state="keep",
)
# Each --arch: its norm, and whether it has channel attention.
ARCHS = {"bn": ("bn", False), "gn": ("gn", False), "se": ("bn", True), "nf": ("nf", False), "anfr": ("nf", True)}
# The Renyi orders of the DP accountant (those of Opacus).
DP_ORDERS = [1 + x / 10 for x in range(1, 100)] + list(range(12, 64))


class EfficientChannelAttention(nn.Module):  # ANFR: Table 5's attention variants
    """ECA (Wang et al. 2020): channel weights sigmoid(conv1d_k over the channels of the average pool), k = |(log2 C +
    1) / 2| rounded up to odd, at least 3 (timm's EcaModule)."""

    def __init__(self, channels, norm=None, gamma=2, b=1):
        super().__init__()
        t = int(abs(math.log2(channels) + b) / gamma)
        k = max(t if t % 2 else t + 1, 3)
        self.conv = nn.Conv1d(1, 1, k, padding=(k - 1) // 2, bias=False)

    def weights(self, x):
        return torch.sigmoid(self.conv(x.mean((2, 3)).unsqueeze(1))).transpose(1, 2).unsqueeze(-1)

    def forward(self, x):
        return x * self.weights(x)


class CBAM(nn.Module):  # ANFR
    """CBAM (Woo et al. 2018; timm's CbamModule): channel gate sigmoid(MLP(avg pool) + MLP(max pool)), a shared
    bias-free MLP (C/16), then spatial gate sigmoid(conv7x7([mean_c, max_c])), that conv followed by the net's norm."""

    def __init__(self, channels, norm="bn", reduction=16):
        super().__init__()
        hidden = round_channels(channels / reduction, 1)
        self.fc1 = nn.Conv2d(channels, hidden, 1, bias=False)
        self.fc2 = nn.Conv2d(hidden, channels, 1, bias=False)
        if norm == "nf":
            conv = ScaledStdConv2d(2, 1, 7, padding=3)
        else:
            conv = nn.Conv2d(2, 1, 7, padding=3, bias=False)
        self.spatial = nn.Sequential(conv, make_norm(norm, 1))

    def mlp(self, z):
        """The shared MLP of the channel gate."""
        return self.fc2(F.relu(self.fc1(z)))

    def weights(self, x):
        return torch.sigmoid(self.mlp(x.mean((2, 3), keepdim=True)) + self.mlp(x.amax((2, 3), keepdim=True)))

    def forward(self, x):
        x = x * self.weights(x)
        return x * torch.sigmoid(self.spatial(torch.cat([x.mean(1, keepdim=True), x.amax(1, keepdim=True)], 1)))


ATTENTION.update(eca=EfficientChannelAttention, cbam=CBAM)  # ANFR: --attention, beside common's SE


def parse_args():
    p = Parser(__doc__)
    g = p.add_argument_group("model (the one ResNet of common.py)")
    g.add_argument(
        "--arch",
        default=PAPER["arch"],
        choices=list(ARCHS),
        help="ANFR: bn | gn (group norm) | se (bn + attention) | nf (NF-ResNet, Eq. 5) | anfr (nf + attention)",
    )
    g.add_argument(
        "--depth",
        type=int,
        default=PAPER["depth"],
        choices=[18, 26, 50],
        help="ANFR: ResNet depth (18: basic blocks; 26, 50: bottlenecks)",
    )
    g.add_argument("--width", type=positive_int, default=64, help="ANFR: base channels (64: the standard ResNet)")
    g.add_argument(
        "--stem",
        default="cifar",
        choices=["cifar", "imagenet"],
        help="ANFR: conv3x3 stem for 32x32 inputs, or conv7x7 + max-pool (paper, at 224)",
    )
    g.add_argument(
        "--attention",
        default="se",
        choices=["se", "eca", "cbam"],
        help="ANFR: channel attention of --arch se and anfr (Table 5); SE reduction r=16",
    )
    g.add_argument(
        "--init-from",
        type=path_arg,
        metavar="PATH",
        help="ANFR: start from this state dict, ours or timm's (the paper: timm's ImageNet weights; docs/anfr.md); "
        "every entry but the head must load",
    )
    g.add_argument(
        "--init",
        default="timm",
        choices=["timm", "torch"],
        help="ANFR: start every --arch as timm's fresh ResNet-50s (each branch's last norm weight or NF gain 0, "
        "timm's conv and head init; common.resnet), or with PyTorch's default layer init",
    )
    g.add_argument(
        "--last-gain-init",
        type=non_negative_float,
        default=0.0,
        help="ANFR: start of the gain g (Eq. 5) of each NF branch's last conv; 0: timm's, the paper's models",
    )
    g = p.add_argument_group("data")
    g.add_argument("--dataset", default=PAPER["dataset"], choices=sorted(DATASETS), help="folder: --data-dir's images")
    g.add_argument("--data-dir", type=path_arg, default="./data", help="download folder, or DIR/{train,test}/<class>/*")
    g.add_argument(
        "--augment",
        default="crop-flip",
        choices=AUGMENTATIONS,
        help="of training batches, on device; rrc: RandomResizedCrop to --image-size (the paper's recipe, no flip)",
    )
    g.add_argument(
        "--crop-scale",
        type=fraction,
        nargs=2,
        default=[0.08, 1.0],
        metavar=("LO", "HI"),
        help="ANFR: area fraction range of --augment rrc (torchvision's; the paper's recipe: 0.05 1)",
    )
    g.add_argument(
        "--image-size",
        type=flag_type(int, lambda v: v >= 8, ">= 8"),
        help="ANFR: the size the model sees (the paper: 224; default: as stored); rrc crops to it, the other "
        "augmentations and the test images are resized to it",
    )
    g.add_argument(
        "--normalize",
        default="dataset",
        choices=["dataset", "half"],
        help="ANFR: by the training split's per-channel mean and std, or (x - 0.5) / 0.5 (the paper's recipe)",
    )
    g = p.add_argument_group("partition: one of these (default: --split2, the paper's)")
    # One of them: the flag given replaces the default.
    x = g.add_mutually_exclusive_group()
    x.add_argument("--iid", action="store_true", help="a uniform random split")
    x.add_argument("--shards", type=positive_int, help="S: N*S sorted shards, S each")
    x.add_argument("--classes-per-client", type=positive_int, help="C classes a client, each split among its holders")
    x.add_argument("--alpha", type=positive_float, help="Dirichlet label skew Dir(alpha) (Hsu et al. 2019)")
    x.add_argument(
        "--split2",
        action="store_true",
        default=PAPER["split2"],
        help="CIFAR-10 split-2 (Qu et al. 2022): 5 clients, 4 classes each",
    )
    x.add_argument("--disjoint-classes", action="store_true", help="N disjoint class sets (FedLN T5: 2, 2, 3 of 7)")
    x.add_argument("--natural", action="store_true", help="the clients are the folders DIR/train/<client>/<class>/*")
    g.add_argument("--clients-per-domain", type=positive_int, help="M: DIR/train/<domain>/<class>/*, split M ways each")
    g.add_argument("--quantity", default="equal", choices=["equal", "powerlaw"], help="client sizes")
    g.add_argument(
        "--client-test",
        action="store_true",
        help="also test each client on its own label distribution (always with --pfl)",
    )
    g.add_argument("--balanced-acc", action="store_true", help="also log the balanced accuracy (mean class recall)")
    g.add_argument("--data-seed", type=seed_int, help="seed of the partition (default: --seed)")
    g.add_argument("--val-frac", type=decay_rate, default=0.0, help="share of each client's data held out: val_acc")
    g = p.add_argument_group("federation")
    # The paper's symbol for the number of clients is C.
    g.add_argument("--num-clients", type=positive_int, default=PAPER["num_clients"], help="C: number of clients")
    g.add_argument("--frac", type=fraction, default=PAPER["frac"], help="fraction of clients a round, in (0, 1]")
    g.add_argument("--rounds", type=positive_int, default=PAPER["rounds"], help="T: communication rounds")
    # One of them: the flag given replaces the default.
    x = g.add_mutually_exclusive_group()
    x.add_argument("--local-epochs", type=positive_int, default=PAPER["local_epochs"], help="E: epochs a round")
    x.add_argument("--local-steps", type=positive_int, help="local steps a round, not epochs")  # ANFR: AdamW steps
    g.add_argument("--batch-size", type=positive_int, default=PAPER["batch_size"], help="B: local batch size")
    g.add_argument("--weighting", default="samples", choices=["samples", "uniform"], help="weights n_k/n, or 1/m")
    g.add_argument(
        "--agg",
        default="fedavg",
        choices=["fedavg", "fedprox", "scaffold", "fedadam"],
        help="ANFR: aggregation method (Table 1)",
    )
    g.add_argument(
        "--pfl",
        default="none",
        choices=["none", "fedper", "fedbn"],
        help="ANFR: personalization (Table 2): FedPer keeps each head local, FedBN each batch norm",
    )
    g = p.add_argument_group("optimization")
    g.add_argument(
        "--optimizer",
        default=PAPER["optimizer"],
        choices=["adamw", "sgd"],
        help="ANFR: AdamW, or SGD with momentum 0.9 (Pieri et al.'s from ImageNet weights, lr 0.03)",
    )
    g.add_argument(
        "--lr",
        type=positive_float,
        default=PAPER["lr"],
        help="eta: local learning rate, warmed up and cosine-decayed over the run",
    )
    g.add_argument(
        "--weight-decay",
        type=non_negative_float,
        default=PAPER["weight_decay"],
        help="AdamW's decoupled weight decay, or SGD's L2 (with --optimizer sgd unless given: 0, Pieri et al.'s)",
    )
    g.add_argument(
        "--client-state",
        default=PAPER["client_state"],
        choices=["keep", "reset"],
        help="ANFR: keep: each client keeps its optimizer state and schedule between rounds (A.2); reset: a fresh "
        "optimizer a round, the schedule at the round's place (cross-device, e.g. CelebA's 9,343)",
    )
    g.add_argument(
        "--warmup-steps",
        type=non_negative_int,
        default=PAPER["warmup_steps"],
        help="ANFR: linear warm-up from 0 over a client's first steps, then the cosine",
    )
    g.add_argument(
        "--loss",
        default="ce",
        choices=["ce", "focal"],
        help="ANFR: cross-entropy, or Fed-ISIC2019's focal loss (FLamby's BaselineLoss): the batch mean of -alpha_y "
        "(1 - p_y)^gamma log p_y with the weights of --focal-weights",
    )
    g.add_argument(
        "--focal-gamma",
        type=non_negative_float,
        default=2.0,
        help="ANFR: gamma of --loss focal (FLamby's 2; 0 with weights 1 is cross-entropy)",
    )
    g.add_argument(
        "--focal-weights",
        default="local",
        choices=["local", "pooled"],
        help="ANFR: alpha of --loss focal. local: alpha_c = n_k / n_k,c of client k's own labels (App. A.1, the "
        "main tables); pooled: N / n_c of all clients' labels, FLamby's fixed weights (App. B.2). A class "
        "without training labels: 0",
    )
    g.add_argument(
        "--clip", type=non_negative_float, default=PAPER["clip"], help="ANFR: local gradient-norm clipping (0 = off)"
    )
    g.add_argument(
        "--agc",
        type=non_negative_float,
        default=0.0,
        help="ANFR: lambda of adaptive gradient clipping (Brock et al. 2021b; App. A.2's grid): each unit's gradient "
        "at most lambda max(||W||, 1e-3), the head unclipped; needs --clip 0 (0 = off)",
    )
    g.add_argument(
        "--bn-stats",
        default="average",
        choices=["average", "local"],
        help="ANFR: batch-norm running statistics averaged with the weights, or kept by each client (Pieri et al.: "
        "each client's model is tested, the scores averaged)",
    )
    g.add_argument(
        "--prox-mu",
        type=non_negative_float,
        help="mu: FedProx's mu/2 ||w - w_t||^2, with --agg fedprox only (default there: 0.01)",
    )
    g.add_argument(
        "--server-lr",
        type=positive_float,
        default=1e-3,
        help="ANFR: FedAdam server learning rate eta (Appendix A.2 range 5e-4..1e-1)",
    )
    g.add_argument(
        "--server-betas",
        type=decay_rate,
        nargs=2,
        default=[0.9, 0.99],
        help="ANFR: FedAdam beta1 beta2 (Reddi et al. 2021)",
    )
    g.add_argument(
        "--server-tau", type=positive_float, default=1e-3, help="ANFR: FedAdam adaptivity tau (Reddi et al. 2021)"
    )
    g = p.add_argument_group("differential privacy (Section 4.3)")
    g.add_argument(
        "--dp-noise-multiplier",
        type=positive_float,
        help="ANFR: sigma; DP-SGD on the clients (paper: 1.1); architectures without batch norm only",
    )
    g.add_argument(
        "--dp-max-grad-norm",
        type=positive_float,
        default=1.0,
        help="ANFR: C, per-sample gradient norm bound of DP-SGD (paper: 1.0)",
    )
    g = p.add_argument_group("run")
    g.add_argument("--seed", type=seed_int, default=0, help="seed of the init, client sampling and local shuffling")
    g.add_argument("--device", type=device_flag, help="cpu, cuda, cuda:N or mps (default: cuda if there is one)")
    g.add_argument("--amp", action="store_true", help="bfloat16 autocast of forward passes (no DP; CPU: often slower)")
    g.add_argument("--channels-last", action="store_true", help="ANFR: channels-last weights and batches (GPUs)")
    g.add_argument("--tf32", action="store_true", help="ANFR: TF32 matmuls on CUDA (cuDNN's convolutions: by default)")
    g.add_argument("--threads", type=positive_int, help="CPU threads (default: the cores; OMP_NUM_THREADS)")
    g.add_argument("--eval-every", type=positive_int, default=1, help="evaluate every this many rounds and the last")
    g.add_argument(
        "--analyze",
        action="store_true",
        help="ANFR: class selectivity and attention-weight spread of the last attention module (Sec. 3.4) in "
        "summary.json; at every evaluation the branches' last gains and how their gradients agree",
    )
    g.add_argument("--checkpoint-every", type=positive_int, help="checkpoint period (default: at each evaluation)")
    g.add_argument("--out", type=path_arg, help="run folder (default: runs/anfr__<dataset>__<seed>__<time>)")
    g.add_argument("--overwrite", action="store_true", help="replace the run in --out (else such an --out is refused)")
    g.add_argument("--save-model", action="store_true", help="write the final global model to OUT/model.pt")
    g.add_argument("--resume", type=path_arg, metavar="DIR", help="continue the run in DIR (a larger --rounds: extend)")
    g.add_argument("--stop-after", type=positive_int, help="checkpoint and stop after this many rounds")
    g.add_argument("--track", action="append", choices=TRACKERS, help="also log to TensorBoard or W&B (both: twice)")
    g.add_argument("--wandb-project", default="cleanfl", help="W&B project (--track wandb)")
    g.add_argument("--wandb-entity", help="W&B entity, a user or team (default: W&B's own)")
    p.set_defaults(model="resnet")  # ANFR: common.resnet with the options of --arch
    args = p.parse_args()
    args.client_test = args.client_test or args.pfl != "none"  # ANFR: pFL is tested on per-client test sets
    args = finish_args(p, args, "anfr")
    # A resumed run's flags were checked when it began.
    if args.resume:
        return args
    return check_args(p, args)  # ANFR


def check_args(p, args):  # ANFR: this script's flags together
    """Refuse what cannot run (exit 2, the flag named); resolve --prox-mu (0: no proximal term) and, for
    --optimizer sgd, --weight-decay."""
    dp = args.dp_noise_multiplier is not None
    has_bn = ARCHS[args.arch][0] == "bn"
    if args.pfl == "fedbn" and not has_bn:
        p.error(
            f"--pfl fedbn: --arch {args.arch} has no batch norm to keep local; use --arch bn or se, or --pfl fedper"
        )
    if dp and has_bn:
        p.error(
            f"--dp-noise-multiplier: DP-SGD needs per-sample gradients, which batch norm (--arch {args.arch}) mixes; "
            "use --arch gn, nf or anfr"
        )
    if args.agg == "fedprox" and args.prox_mu == 0:
        p.error("--prox-mu: --agg fedprox needs mu > 0, got 0")
    if args.prox_mu and args.agg != "fedprox":
        p.error(f"--prox-mu: the proximal term belongs to --agg fedprox, not --agg {args.agg}; add --agg fedprox")
    if args.init_from is not None and not os.path.isfile(args.init_from):
        p.error(f"--init-from: no file {args.init_from}")
    if args.last_gain_init != 0 and ARCHS[args.arch][0] != "nf":
        p.error(f"--last-gain-init: --arch {args.arch} has no NF gains; use --arch nf or anfr")
    if args.crop_scale[0] > args.crop_scale[1]:
        p.error(f"--crop-scale: LO {args.crop_scale[0]} is above HI {args.crop_scale[1]}")
    if args.agc > 0 and args.clip > 0:
        p.error("--agc: adaptive clipping replaces norm clipping (App. A.2 tries one or the other); add --clip 0")
    if args.bn_stats == "local" and args.pfl != "none":
        p.error(f"--bn-stats local: --pfl {args.pfl} evaluates personalized models already; use --bn-stats average")
    if args.bn_stats == "local" and args.client_test:
        p.error("--bn-stats local: each client's model is scored on the whole test set; drop --client-test")
    for name in ("focal_gamma", "focal_weights"):
        if args.loss != "focal" and getattr(args, name) != p.get_default(name):
            p.error(f"--{name.replace('_', '-')}: a setting of the focal loss; add --loss focal")
    if args.optimizer == "sgd" and "weight_decay" not in p.given:
        # Pieri et al.'s SGD has none.
        args.weight_decay = 0.0
    # 0: no proximal term. --agg fedprox without --prox-mu: 0.01.
    if args.agg != "fedprox":
        args.prox_mu = 0.0
    elif args.prox_mu is None:
        args.prox_mu = 0.01
    return args


def build(args, data):  # ANFR: --arch from the one ResNet in common.py; --channels-last: NHWC weights
    norm, attention = ARCHS[args.arch]
    # A config.json older than --init: PyTorch's init.
    init = getattr(args, "init", "torch")
    attention = args.attention if attention else None
    model = build_model(
        "resnet",
        data,
        depth=args.depth,
        width=args.width,
        norm=norm,
        stem=args.stem,
        init=init,
        attention=attention,
        last_gain_init=args.last_gain_init,
    )
    if getattr(args, "channels_last", False):
        model = model.to(memory_format=torch.channels_last)
    return model


def resize(x, size, channels_last=False):  # ANFR: --image-size, and --channels-last's batches
    if size is not None and x.shape[-1] != size:
        x = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


# The renames of timm's entry names to ours, applied in turn (timm_name).
TIMM_NAMES = [
    (r"^(conv1|stem\.conv)\.", "body.stem.0."),
    (r"^bn1\.", "body.stem.1."),
    (r"^(head\.)?fc\.", "head."),
    (r"\.bn(\d)\.", r".n\1."),
    (r"\.(se|attn_last)\.", ".attn."),
    (r"\.downsample\.", ".shortcut."),
]


def timm_name(key, layout):  # ANFR: --init-from with timm weights: timm's entry name -> ours (ours unchanged)
    """resnet50, resnet50_gn, seresnet50 (conv1, bn1, layer1-4.J.{convK, bnK, se, downsample}, fc) and
    nf_resnet50, nf_seresnet50, nf_ecaresnet50 (stem.conv, stages.0-3.J.{convK, attn_last, downsample}, head.fc).
    Our blocks are one list: block J of stage I is number sum(layout[:I]) + J."""
    m = re.match(r"(layer(\d)|stages\.(\d))\.(\d+)\.", key)
    if m:
        stage = int(m[2]) - 1 if m[2] else int(m[3])
        key = f"body.stages.{sum(layout[:stage]) + int(m[4])}.{key[m.end() :]}"
    for pattern, ours in TIMM_NAMES:
        key = re.sub(pattern, ours, key)
    return key


def load_pretrained(model, src, layout):  # ANFR: --init-from
    """Load a state dict (a path or a dict: ours, a checkpoint.pt, or timm's, renamed by timm_name). Every
    entry of ours but the head must come from it with our shape, and every entry of it must be used (the
    head is loaded if its shape matches, e.g. not a 1000-class one); else ValueError, naming the first few."""
    if isinstance(src, str):
        # It runs no code.
        src = safe_load(src, "--init-from")
    # A checkpoint.pt works too.
    src = src["model"] if isinstance(src.get("model"), dict) else src
    src = {timm_name(k, layout): v for k, v in src.items()}
    own = model.state_dict()
    match = {k: v for k, v in src.items() if k in own and own[k].shape == v.shape}
    for what, bad in (
        ("of ours not in it (or of another shape)", [k for k in own if k not in match]),
        ("of it fitting none of ours", [k for k in src if k not in match]),
    ):
        bad = [k for k in bad if not k.startswith("head.")]
        if bad:
            raise ValueError(f"{len(bad)} entries {what}: {', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}")
    model.load_state_dict(match, strict=False)
    return len(match), len(own)


def make_optimizer(params, args):  # ANFR: --optimizer
    if args.optimizer == "sgd":
        # Pieri et al.'s SGD: momentum 0.9, L2 weight decay.
        return torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=args.weight_decay)
    return torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)


def cosine_lr(lr, step, total, warmup=0):  # ANFR: cosine decay over the run, at the client's own step counter
    """lr * step / warmup for the first `warmup` steps (0 at step 0), then the cosine from lr to 0 over the
    remaining total - warmup steps (the warm-up cosine schedule of Pieri et al.'s code)."""
    if step < warmup:
        return lr * step / warmup
    return lr * 0.5 * (1 + math.cos(math.pi * min(step - warmup, total - warmup) / max(total - warmup, 1)))


def adaptive_clip_(params, clip, eps=1e-3):  # ANFR: --agc (Brock et al. 2021b, Eq. 3), in place
    """Each unit's gradient G_i (a row of the weight: all but the first axis; a bias or gain as a whole)
    scaled to norm at most clip * max(||W_i||, eps)."""
    for p in params:
        if p.grad is None:
            continue
        dims = tuple(range(1, p.dim())) if p.dim() > 1 else None
        limit = torch.linalg.vector_norm(p.detach(), dim=dims, keepdim=True).clamp_min(eps) * clip
        grad_norm = torch.linalg.vector_norm(p.grad, dim=dims, keepdim=True)
        p.grad.mul_(torch.where(grad_norm > limit, limit / grad_norm.clamp_min(1e-6), torch.ones_like(grad_norm)))


def steps_per_round(n, args):  # ANFR: the length of one client's local run (for its cosine schedule)
    if args.local_steps is not None:
        return args.local_steps
    if args.dp_noise_multiplier is not None:
        # Poisson batches: 1/q steps an epoch.
        return args.local_epochs * max(1, round(n / args.batch_size))
    return args.local_epochs * (math.ceil(n / args.batch_size) - (1 if n > 1 and n % args.batch_size == 1 else 0))


def poisson_batches(indices, q, steps):  # ANFR: DP-SGD sampling: each sample joins each batch w.p. q
    for _ in range(steps):
        yield indices[torch.rand(len(indices), device=indices.device) < q]


def personal_keys(model, pfl, bn_stats="average"):  # ANFR: the entries each client keeps, never averaged
    """FedPer (Arivazhagan et al. 2019): the head, found as model.head; FedBN (Li et al. 2021): every entry
    (weight, bias, running mean/var, count) of every batch-norm module; --bn-stats local: the running
    statistics (mean, var, count) of every batch-norm module."""
    bn = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if pfl == "fedper":
        return {"head." + k for k in model.head.state_dict()}
    if pfl == "fedbn":
        return {f"{name}.{k}" for name, m in bn for k in m.state_dict()}
    if bn_stats == "local":
        return {f"{name}.{k}" for name, m in bn for k, _ in m.named_buffers()}
    return set()


def last_gains(model):  # ANFR: --analyze, what closes each residual branch at the start
    """Per residual block, the gain g of its last conv (NF, Eq. 5) or the weight of its last norm (BN, GN):
    timm starts both at 0, so each block starts as its shortcut."""
    gains = []
    for block in model.body.stages:
        # The branch's last conv: NF's gain g.
        conv = block.conv3 if hasattr(block, "conv3") else block.conv2
        if hasattr(conv, "gain"):
            gains.append(conv.gain)
        else:
            norm = block.n3 if hasattr(block, "n3") else block.n2
            gains.append(norm.weight)
    return gains


def flat_gains(net):  # ANFR: --analyze
    """The last gains (last_gains) as one detached vector."""
    return torch.cat([g.detach().flatten() for g in last_gains(net)])


def gain_statistics(grads):  # ANFR: --analyze, [steps, gains] gradients of the last gains over one client's steps
    """share of step pairs whose gradient keeps its sign (0.5: as a coin; 1: always the same way), and the
    coherence |sum_t g_t| / sum_t |g_t| (1: one direction; about 1/sqrt(steps) for random signs), each averaged
    over the gains."""
    if len(grads) > 1:
        keep = (grads[1:].sign() == grads[:-1].sign()).float().mean()
    else:
        keep = grads.new_tensor(float("nan"))
    coherence = (grads.sum(0).abs() / grads.abs().sum(0).clamp_min(1e-30)).mean()
    return torch.stack([keep, coherence])


def clip_per_sample(grads, max_norm):  # ANFR: DP-SGD clipping (Abadi et al. 2016), factor as Opacus
    """grads: {name: [B, ...]}; each sample's gradient (over all tensors) scaled to norm <= max_norm."""
    norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in grads.values()))
    factor = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    return {n: g * factor.view(-1, *[1] * (g.dim() - 1)) for n, g in grads.items()}


def dp_gradients(model, x, y, sigma, max_norm, expected_batch, loss_fn=F.cross_entropy):  # ANFR: DP-SGD step
    """Per-sample gradients of loss_fn(logits, y) with torch.func, clipped to C, summed, plus N(0, sigma^2 C^2)
    noise, divided by the expected batch size q|D_i| (as Opacus), into p.grad. Returns the batch's mean loss."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    buffers = dict(model.named_buffers())

    def loss_one(prm, xi, yi):
        return loss_fn(functional_call(model, (prm, buffers), (xi[None],)), yi[None])

    if len(y) > 0:
        grads, losses = vmap(grad_and_value(loss_one), in_dims=(None, 0, 0))(params, x, y)
        summed = {n: g.sum(0) for n, g in clip_per_sample(grads, max_norm).items()}
    else:
        # An empty Poisson batch: noise only.
        summed = {n: torch.zeros_like(p) for n, p in params.items()}
        losses = x.new_zeros(())
    for n, p in model.named_parameters():
        p.grad = (summed[n] + sigma * max_norm * torch.randn_like(p)) / expected_batch
    return losses.mean().detach()


def _log_sub(a, b):
    """log(exp(a) - exp(b)) for a >= b."""
    return a + math.log1p(-math.exp(b - a)) if b < a else -math.inf


def _log_erfc(x):
    """log(erfc(x)); where erfc underflows to 0 (x past about 27), its asymptotic series."""
    r = math.erfc(x)
    if r > 0:
        return math.log(r)
    return -x * x - math.log(x) - 0.5 * math.log(math.pi) + math.log1p(-0.5 / x**2 + 0.75 / x**4)


def rdp_subsampled_gaussian(q, sigma, alpha):  # ANFR: Renyi DP of one DP-SGD step
    """RDP at order alpha of the Gaussian mechanism (noise sigma) on a Poisson subsample of rate q
    (Mironov, Talwar & Zhang 2019, Sec. 3.3): log(A_alpha) / (alpha - 1), A_alpha = E_{z~mu0}[(mu(z)/mu0(z))^alpha],
    mu = (1-q) mu0 + q mu1; integer alpha by the binomial sum, fractional alpha by their two-series formula."""
    if q == 0:
        return 0.0
    if sigma == 0:
        return math.inf
    if q == 1:
        return alpha / (2 * sigma**2)

    def term(c, i, j):
        return math.log(c) + i * math.log(q) + j * math.log(1 - q) + (i * i - i) / (2 * sigma**2)

    if float(alpha).is_integer():
        # A = sum_k C(a,k) (1-q)^(a-k) q^k exp((k^2 - k) / (2 sigma^2)).
        a = int(alpha)
        return float(np.logaddexp.reduce([term(math.comb(a, k), k, a - k) for k in range(a + 1)])) / (alpha - 1)
    # The two series A_0 and A_1, term by term; coef = binom(alpha, k), generalized.
    log_a = [-math.inf, -math.inf]
    k = 0
    coef = 1.0
    z0 = sigma**2 * math.log(1 / q - 1) + 0.5
    while True:
        # Term k of A_0 (i = k, j = alpha - k) and of A_1 (i = alpha - k, j = k).
        s = [
            term(abs(coef), i, j) + math.log(0.5) + _log_erfc(e / (math.sqrt(2) * sigma))
            for i, j, e in ((k, alpha - k, k - z0), (alpha - k, k, z0 - alpha + k))
        ]
        log_a = [float(np.logaddexp(a, t)) if coef > 0 else _log_sub(a, t) for a, t in zip(log_a, s)]
        coef *= (alpha - k) / (k + 1)
        k += 1
        if max(s) < -30:
            return float(np.logaddexp(*log_a)) / (alpha - 1)


def dp_epsilon(q, sigma, steps, delta, orders=DP_ORDERS):  # ANFR: the accountant's epsilon
    """epsilon at delta after `steps` compositions: min over orders of RDP -> (eps, delta)-DP with the
    conversion of Balle et al. 2020 (as Opacus): eps = R - (log delta + log a)/(a - 1) + log((a - 1)/a)."""
    if steps == 0:
        return 0.0
    a = np.asarray(orders)
    rdp = steps * np.array([rdp_subsampled_gaussian(q, sigma, o) for o in orders])
    eps = rdp - (np.log(delta) + np.log(a)) / (a - 1) + np.log((a - 1) / a)
    return float(np.nanmin(eps))


def class_weights(labels, num_classes):  # ANFR: --loss focal's weights, from training labels
    """alpha_c = n / n_c, the inverse share of class c in labels: one client's (--focal-weights local, App. A.1:
    "weighted by the local class percentages at each client") or all clients' pooled (--focal-weights pooled:
    FLamby's fixed BaselineLoss weights, App. B.2); 0 for a class absent from labels (it is never a target)."""
    counts = torch.bincount(labels, minlength=num_classes).float()
    return torch.where(counts > 0, counts.sum() / counts.clamp_min(1), torch.zeros_like(counts))


def focal_weights(labels, parts, num_classes, kind):  # ANFR: --focal-weights
    """Each client's alpha: local, from its own training labels labels[parts[k]]; pooled, FLamby's one set from
    all clients' training labels (N / n_c over the union of the parts)."""
    if kind == "pooled":
        return [class_weights(labels[torch.cat(list(parts))], num_classes)] * len(parts)
    return [class_weights(labels[p], num_classes) for p in parts]


def focal_loss(logits, y, alpha, gamma):  # ANFR: Fed-ISIC2019's loss (FLamby's; Lin et al. 2017, Eq. 5)
    """mean_i -alpha_{y_i} (1 - p_i)^gamma log p_i with p_i = softmax(logits_i)_{y_i}, a mean over the batch
    as FLamby's (not normalized by the weights); gamma = 0 with alpha = 1 is the cross-entropy."""
    log_p = F.log_softmax(logits, 1).gather(1, y[:, None]).squeeze(1)
    # FLamby's order of operations: the same bits.
    return (-((1 - log_p.exp()) ** gamma) * (log_p * alpha[y])).mean()


def gain_steps(deltas, weights):  # ANFR: --analyze, what averaging does to the clients' moves of the last gains
    """deltas [m, gains]: each client's change of the last gains in its round; weights [m]: its p_k. (the
    clients' mean move, sum_k p_k mean|delta_k|; the server's, mean|sum_k p_k delta_k|): equal when every client
    moves every gain the same way, the server's near 0 when their moves cancel."""
    return float((weights * deltas.abs().mean(1)).sum()), float((weights[:, None] * deltas).sum(0).abs().mean())


def fedadam_step(x, delta, m, v, lr, betas, tau):  # ANFR: FedAdam (Reddi et al. 2021, Algorithm 2)
    """m = b1 m + (1-b1) Delta; v = b2 v + (1-b2) Delta^2; x + lr m / (sqrt(v) + tau). m, v updated in place."""
    for n in delta:
        m[n].mul_(betas[0]).add_(delta[n], alpha=1 - betas[0])
        v[n].mul_(betas[1]).addcmul_(delta[n], delta[n], value=1 - betas[1])
    return {n: x[n] + lr * m[n] / (v[n].sqrt() + tau) for n in delta}


def class_selectivity(mean_act):  # ANFR: CSI (Morcos et al. 2018), Section 3.4
    """mean_act [classes, channels] (non-negative): (mu_max - mu_-max) / (mu_max + mu_-max) per channel."""
    mu_max = mean_act.max(0).values
    mu_rest = (mean_act.sum(0) - mu_max) / (mean_act.shape[0] - 1)
    return (mu_max - mu_rest) / (mu_max + mu_rest).clamp_min(1e-12)


@torch.no_grad()
def analyze(model, data, image_size, batch_size=500):  # ANFR: --analyze, on the test set (Section 3.4, Figs. 2-3)
    """CSI of the channels after the last attention module (the ReLU'd features that feed the head) and
    the spread of that module's channel weights over channels and classes."""
    model.eval()
    # The SE, ECA or CBAM modules, in order.
    attn = [m for m in model.body.modules() if hasattr(m, "weights")]
    # The last one's channel weights, a batch at a time.
    seen = []

    def keep_weights(module, inputs, output):
        seen.append(module.weights(inputs[0]).flatten(1))

    hook = None
    if attn:
        hook = attn[-1].register_forward_hook(keep_weights)
    k = data.num_classes
    act = 0
    wts = 0
    count = torch.zeros(k, device=data.y_test.device)
    for i in range(0, len(data.x_test), batch_size):
        x = resize(prepare_batch(data.x_test[i : i + batch_size], data), image_size)
        y = data.y_test[i : i + batch_size]
        onehot = F.one_hot(y, k).float().T  # [k, B]
        act = act + onehot @ model.body(x).float()
        if attn:
            wts = wts + onehot @ seen.pop().float()
        count += onehot.sum(1)
    if hook:
        hook.remove()
    csi = class_selectivity(act / count[:, None].clamp_min(1))
    out = {
        "csi_mean": csi.mean().item(),
        "csi_median": csi.median().item(),
        "csi_frac_above_0.75": (csi > 0.75).float().mean().item(),
        "csi_hist": torch.histc(csi, 10, 0, 1).tolist(),
    }
    if attn:
        # The class-mean attention weights.
        w = wts / count[:, None].clamp_min(1)  # [classes, channels]
        out.update(
            attn_weight_mean=w.mean().item(),
            attn_std_over_channels=w.std(1).mean().item(),
            attn_std_over_classes=w.std(0).mean().item(),
            attn_weight_min=w.min().item(),
            attn_weight_max=w.max().item(),
        )
    return out


def local_train(
    model, opt, batches, data, args, first_step, total, prox_pairs, correction, dp_batch=None, loss_fn=F.cross_entropy
):
    """Local steps of opt (AdamW, or SGD) on loss_fn(logits, y), continuing the client's optimizer and cosine
    schedule; FedProx pulls the shared parameters to w_t (`prox_pairs`: (w, w_t)); SCAFFOLD `correction` (params,
    c - c_i) is applied after each step. Returns (mean training loss, steps taken, sum of step lrs, with --analyze
    the last gains' gradient statistics else None)."""
    model.train()
    loss_sum = torch.zeros((), device=args.device)
    seen = 0
    step = first_step  # ANFR: the client's own step counter
    lr_sum = 0.0
    gain_grads = []  # ANFR: --analyze, the last gains' gradient at each step
    for batch in batches:
        lr = cosine_lr(args.lr, step, total, args.warmup_steps)  # ANFR: the client's own scheduler (Appendix A.2)
        for group in opt.param_groups:
            group["lr"] = lr
        # --augment rrc: the output size and the area range.
        crop = dict(size=args.image_size, crop_scale=args.crop_scale)
        x = prepare_batch(data.x_train[batch], data, args.augment, **crop)
        x = resize(x, args.image_size, args.channels_last)  # ANFR: --image-size
        y = data.y_train[batch]
        if args.dp_noise_multiplier is None:
            with autocast(args.device, args.amp):
                loss = loss_fn(model(x).float(), y)
            if args.agg == "fedprox":
                # The (w, w_t) pairs as two lists.
                loss = loss + prox_term(*zip(*prox_pairs), args.prox_mu)  # Li et al. 2020, Eq. 2
            opt.zero_grad(set_to_none=True)
            loss.backward()
            # Before clipping, which scales the gradients and keeps every sign.
            if args.analyze:  # ANFR
                gain_grads.append(torch.cat([g.grad.detach().flatten() for g in last_gains(model)]))
            if args.clip > 0:  # ANFR: gradient-norm clipping (Appendix A.1)
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            # Not on the head (Brock et al.).
            if args.agc > 0:  # ANFR: adaptive gradient clipping (App. A.2's grid)
                adaptive_clip_(model.body.parameters(), args.agc)
        else:  # ANFR: DP-SGD (Section 4.3)
            noise = args.dp_noise_multiplier
            clip = args.dp_max_grad_norm
            loss = dp_gradients(model, x, y, noise, max_norm=clip, expected_batch=dp_batch, loss_fn=loss_fn)
            # The proximal term touches no data, so its gradient is added after the noise.
            if args.agg == "fedprox":
                for w, w0 in prox_pairs:
                    w.grad += args.prox_mu * (w.detach() - w0)
        opt.step()
        if correction is not None:  # ANFR: SCAFFOLD y <- y - lr (c - c_i) (Karimireddy et al. 2020, Eq. 3)
            with torch.no_grad():
                for p, d in zip(*correction):
                    p.sub_(lr * d)
        loss_sum += loss.detach() * len(batch)
        seen += len(batch)
        step += 1
        lr_sum += lr
    stats = gain_statistics(torch.stack(gain_grads)) if gain_grads else None  # ANFR
    return loss_sum / max(seen, 1), step - first_step, lr_sum, stats


if __name__ == "__main__":
    args = parse_args()
    # The run folder (taken first), torchrun's ranks, the seeds, the client sampler, Ctrl-C and SIGTERM. Bad input
    # found in the block ends the run in one line.
    with Run(args) as run:
        # uint8 tensors on the device; a bad folder is refused as it is read.
        data = load_data(args)
        if args.normalize == "half":  # ANFR: the recipe's (x - 0.5) / 0.5
            data.mean = torch.full_like(data.mean, 0.5)
            data.std = torch.full_like(data.std, 0.5)
        # The partition has its own generator, seeded by --data-seed.
        partition = make_partition(args, data)
        # The global model w_t, and one client model reloaded for every client.
        model = build(args, data).to(args.device)  # ANFR: build() from --arch
        client = build(args, data).to(args.device)
        torch.backends.cuda.matmul.allow_tf32 = args.tf32 or torch.backends.cuda.matmul.allow_tf32  # ANFR: --tf32
        # Before run.start writes a file: a refused one leaves no run folder (Run removes the empty one it made).
        if args.init_from and not args.resume:  # ANFR: --init-from
            try:
                loaded = load_pretrained(model, args.init_from, RESNET_LAYOUT[args.depth][1])
                print("--init-from: loaded %d of %d entries" % loaded)
            except ValueError as e:
                raise BadInput(f"--init-from {args.init_from}: {e}")
        # config.json, partition.json and the start-up line; the first round.
        start = run.start(model, partition, data, f"resnet{args.depth} --arch {args.arch}")  # ANFR: the model's name
        sizes = [len(p) for p in partition.train]
        n_clients = len(sizes)
        # ANFR: what each client keeps between rounds: its optimizer state (--client-state keep), its place in the
        # schedule, its FedPer or FedBN entries, SCAFFOLD's c_i and its DP steps.
        opts = []
        if args.client_state == "keep":
            opts = [make_optimizer(client.parameters(), args) for _ in range(n_clients)]
        total_steps = [args.rounds * steps_per_round(n, args) for n in sizes]
        # The lr would never leave its warm-up.
        if args.warmup_steps > min(total_steps):
            print(
                f"note: --warmup-steps {args.warmup_steps} exceeds the {min(total_steps)} local steps of a client's "
                "run: its lr stays in the warm-up throughout"
            )
        client_steps = [0] * n_clients
        dp_steps = [0] * n_clients
        local_keys = personal_keys(model, args.pfl, args.bn_stats)  # ANFR: FedPer, FedBN or --bn-stats local
        loss_fns = [F.cross_entropy] * n_clients  # ANFR: --loss focal with the weights of --focal-weights
        if args.loss == "focal":
            alphas = focal_weights(data.y_train, partition.train, data.num_classes, args.focal_weights)
            loss_fns = [functools.partial(focal_loss, alpha=a, gamma=args.focal_gamma) for a in alphas]
        local = [None] * n_clients
        # The averaged entries, batch-norm running statistics too.
        shared = [k for k in model.state_dict() if k not in local_keys]
        shared_params = [n for n, _ in model.named_parameters() if n not in local_keys]

        def zeros():
            """A float zero of each shared parameter."""
            return {n: torch.zeros_like(model.get_parameter(n), dtype=torch.float) for n in shared_params}

        c = zeros() if args.agg == "scaffold" else None  # ANFR: SCAFFOLD's controls c and c_i
        c_i = [None] * n_clients if args.agg == "scaffold" else None
        m = zeros() if args.agg == "fedadam" else None  # ANFR: FedAdam's moments m and v
        v = zeros() if args.agg == "fedadam" else None
        if args.resume:
            model.load_state_dict(run.checkpoint["model"])
            # ANFR: the clients' and the server's state.
            ckpt = run.checkpoint
            for opt, state in zip(opts, ckpt["opts"] or []):
                opt.load_state_dict(state)
            client_steps = ckpt["client_steps"]
            dp_steps = ckpt["dp_steps"]
            local = ckpt["local"]
            c = ckpt["c"]
            c_i = ckpt["c_i"]
            m = ckpt["m"]
            v = ckpt["v"]

        def state():
            """What a checkpoint holds besides the global model: each client's state and the server's."""
            return {
                "opts": [o.state_dict() for o in opts] if opts else None,
                "client_steps": client_steps,
                "dp_steps": dp_steps,
                "local": local,
                "c": c,
                "c_i": c_i,
                "m": m,
                "v": v,
            }

        def load_client(k):
            """w_t, then client k's own FedPer or FedBN entries."""
            client.load_state_dict(model.state_dict())
            if local[k] is not None:
                client.load_state_dict(local[k], strict=False)

        def fwd(net):
            """net on batches resized to --image-size (and --channels-last)."""

            def forward(x):
                return net(resize(x, args.image_size, args.channels_last))

            return forward

        def personal(k):
            """Client k's personalized model, to evaluate."""
            load_client(k)
            client.eval()
            return fwd(client)

        # The bar shows the latest test accuracy.
        for rnd in run.bar(range(start, args.rounds)):
            clients = sample_clients(run.sampler, len(sizes), args.frac)
            weights = client_weights([sizes[k] for k in clients], args.weighting)
            total = {k: torch.zeros_like(v, dtype=torch.float) for k, v in model.state_dict().items() if k in shared}
            dc_sum = zeros() if c is not None else None  # ANFR: SCAFFOLD's sum of c_i+ - c_i
            train_loss = torch.zeros((), device=args.device)
            # x: the shared parameters of w_t (SCAFFOLD, FedAdam).
            x_params = {n: p.detach().clone() for n, p in model.named_parameters() if n in shared_params}
            # ANFR: --analyze, per client of the round.
            gain_stats = []
            gain_deltas = []
            gain_weights = []
            gains_before = flat_gains(model) if args.analyze else None

            def train_client(k):
                """What client k does this round; returns what the server sums and what client k keeps."""
                load_client(k)
                steps = steps_per_round(sizes[k], args)  # ANFR: its local steps a round
                if args.dp_noise_multiplier is None:
                    batches = client_batches(partition.train[k], args.batch_size, args.local_epochs, args.local_steps)
                else:  # ANFR: Poisson sampling of rate q = B / |D_i|
                    batches = poisson_batches(partition.train[k], min(1.0, args.batch_size / sizes[k]), steps)
                batches = progress(batches, f"client {k}: steps", steps)  # ANFR: a bar for long rounds
                named = dict(client.named_parameters())
                global_named = dict(model.named_parameters())
                # FedProx's (w, w_t): the shared parameters, not the local parts.
                prox_pairs = [(named[n], global_named[n].detach()) for n in shared_params]
                correction = None
                if c is not None:  # ANFR: SCAFFOLD
                    c_k = c_i[k] if c_i[k] is not None else zeros()
                    c_minus_c_k = scaffold_correction(c, c_k)
                    correction = ([named[n] for n in shared_params], [c_minus_c_k[n] for n in shared_params])
                # --client-state keep: client k's optimizer, at its own step; reset: a new one, at the round's place.
                if opts:
                    opt = opts[k]
                    first = client_steps[k]
                else:
                    opt = make_optimizer(client.parameters(), args)
                    first = rnd * steps
                dp_batch = min(args.batch_size, sizes[k])  # ANFR: DP-SGD's expected batch q |D_i|
                loss, taken, lr_sum, stats = local_train(
                    client,
                    opt,
                    batches,
                    data,
                    args=args,
                    first_step=first,
                    total=total_steps[k],
                    prox_pairs=prox_pairs,
                    correction=correction,
                    dp_batch=dp_batch,
                    loss_fn=loss_fns[k],
                )
                # ANFR: how far the last gains moved.
                moved = flat_gains(client) - gains_before if args.analyze else None
                return {
                    "loss": loss,
                    "steps": taken,
                    "lr_sum": lr_sum,
                    "gain_stats": stats,
                    "gain_delta": moved,
                    "state": client.state_dict(),
                    "opt": opt.state_dict() if opts else None,
                }

            # Each client its own seed; under torchrun, split over the ranks and summed in client order.
            for k, w, out in each_client(clients, weights, train_client, seed=args.seed, rnd=rnd):
                # On every rank: a no-op where client k trained.
                if opts:  # ANFR: client k's optimizer state
                    opts[k].load_state_dict(out["opt"])
                client_steps[k] += out["steps"]
                if args.dp_noise_multiplier is not None:
                    dp_steps[k] += out["steps"]
                train_loss += w * out["loss"]
                if out["gain_stats"] is not None:  # ANFR: --analyze
                    gain_stats.append(out["gain_stats"])
                    gain_deltas.append(out["gain_delta"])
                    gain_weights.append(w)
                client_state = out["state"]
                # Batch-norm running statistics are averaged like the weights.
                accumulate(total, {key: client_state[key] for key in shared}, w)  # ANFR: the shared entries
                if local_keys:  # ANFR: FedPer, FedBN: these entries stay with client k
                    local[k] = {key: client_state[key].clone() for key in local_keys}
                if c is not None:  # ANFR: SCAFFOLD's c_i+ (Eq. 4), and its change for the server
                    c_k = c_i[k] if c_i[k] is not None else zeros()
                    y_k = {n: client_state[n].float() for n in shared_params}
                    # K eta: the sum of the client's K cosine lrs.
                    new = scaffold_control(c_k, c, x_params, y_k, step_sum=max(out["lr_sum"], 1e-12))
                    for n in shared_params:
                        dc_sum[n] += new[n] - c_k[n]
                    c_i[k] = new
            if args.agg == "fedadam":  # ANFR: FedAdam
                # Delta = sum_k w_k y_k - x; the server's Adam moves the parameters, batch-norm statistics are averaged.
                delta = {n: total[n] - x_params[n] for n in shared_params}
                total.update(
                    fedadam_step(x_params, delta, m, v, lr=args.server_lr, betas=args.server_betas, tau=args.server_tau)
                )
            # ANFR: SCAFFOLD's eta_g is 1; strict=False leaves the local entries as they are.
            load_average(model, total, strict=False)  # w_{t+1} = sum_k n_k/n w_{t+1}^k (McMahan et al. 2017, Alg. 1)
            if c is not None:  # ANFR: SCAFFOLD c <- c + 1/N sum_{i in S} (c_i+ - c_i) (Eq. 5)
                c = scaffold_server(c, dc_sum, n_clients)
            train_loss = float(train_loss)
            if not math.isfinite(train_loss):
                # summary.json says it diverged; exit 1.
                run.end_diverged(rnd, train_loss)

            last = rnd + 1 == args.rounds
            if (rnd + 1) % args.eval_every == 0 or last:
                model.eval()
                eval_bs = 2000 if (args.image_size or data.image_size) <= 64 else 200  # ANFR: --image-size
                if args.bn_stats == "local" and local_keys:
                    # ANFR: each client's model (the averaged parameters, its own statistics) on the whole test and
                    # validation sets, then the mean over the clients (Pieri et al.).
                    rows = []
                    for k in range(n_clients):
                        row = eval_metrics(
                            personal(k),
                            data,
                            None,
                            args.balanced_acc,
                            amp=args.amp,
                            batch_size=eval_bs,
                            val=partition.val,
                        )
                        rows.append(row)
                    tests = {key: float(np.mean([row[key] for row in rows])) for key in rows[0]}
                else:
                    # test_acc, test_loss; per client: mean, std, worst 10% and each client's; --balanced-acc: the
                    # same of it.
                    tests = eval_metrics(
                        fwd(model),
                        data,
                        partition.test,
                        args.balanced_acc,
                        amp=args.amp,
                        batch_size=eval_bs,
                        client_forward=personal if local_keys else None,
                        lists=True,
                        val=partition.val,
                    )
                first = clients[0]  # ANFR: the lr its next step would take
                at = client_steps[first] if opts else (rnd + 1) * steps_per_round(sizes[first], args)
                lr_now = cosine_lr(args.lr, at, total_steps[first], args.warmup_steps)
                metrics = {"round": rnd + 1, **tests, "train_loss": train_loss, "lr": lr_now}
                if args.analyze:  # ANFR: how far the residual branches have opened, and why (gain_statistics)
                    metrics["last_gain_abs_mean"] = float(flat_gains(model).abs().mean())
                    keep, coherence = torch.stack(gain_stats).nanmean(0).tolist()
                    metrics.update(last_gain_grad_sign_keep=keep, last_gain_grad_coherence=coherence)
                    moved = gain_steps(torch.stack(gain_deltas), torch.tensor(gain_weights, device=args.device))
                    metrics.update(last_gain_client_step=moved[0], last_gain_server_step=moved[1])
                # The global model lacks the clients' local parts.
                if args.pfl != "none":  # ANFR: pFL reports the personalized models
                    for name in ("acc", "bacc") if args.balanced_acc else ("acc",):
                        metrics[f"global_test_{name}"] = metrics[f"test_{name}"]
                        metrics[f"test_{name}"] = metrics[f"client_test_{name}_mean"]
                if args.dp_noise_multiplier is not None:  # ANFR: epsilon at delta = 0.1/|D_i| for each client
                    eps = [
                        dp_epsilon(min(1.0, args.batch_size / n), args.dp_noise_multiplier, s, 0.1 / n)
                        for n, s in zip(sizes, dp_steps)
                    ]
                    metrics["dp_epsilon"] = eps
                    metrics["dp_epsilon_max"] = max(eps)
                run.log(metrics)
            # Ctrl-C or SIGTERM to any rank, or --stop-after.
            interrupted = run.interrupted()
            stop = interrupted or (rnd + 1 - start == args.stop_after and not last)
            # By default a checkpoint at each evaluation: the server's state, the round, the sampler, the clock.
            if stop or last or (rnd + 1) % (args.checkpoint_every or args.eval_every) == 0:
                run.save({"model": model.state_dict(), **state(), **run.snapshot(rnd)}, "checkpoint.pt")
            if stop:
                # One line says how to --resume it; exit 0, or 130 and 143 after Ctrl-C and SIGTERM.
                run.end_stopped(rnd)
        # ANFR: --analyze, of the global model (Sec. 3.4).
        extra = {}
        if args.analyze:
            extra["analysis"] = analyze(model, data, args.image_size)
        # summary.json: the final round's metrics.
        run.finish(model, **extra)

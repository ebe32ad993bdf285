"""FL overhead: fedavg.py's round loop versus a centralized loop doing the same SGD steps.

Both loops use the same model, batch size, optimizer, on-device data and augmentation
(fedavg.local_train for every client; one model and one optimizer for the centralized loop), so the
ratio measures only what federation adds: reloading the global state into the one client model,
a fresh optimizer per client, weighted accumulation of client states and the server update.

    python benchmarks/overhead.py --dataset synthetic --model cnn --device cpu
    python benchmarks/overhead.py --dataset folder --data-dir /path/to/cifar10 --device cuda
"""
import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fedavg  # noqa: E402
from common import (accumulate, build_model, client_batches, client_weights, load_data, make_partition,  # noqa: E402
                    prepare_batch, sample_clients)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="synthetic", help="as in fedavg.py")
    p.add_argument("--data-dir", default="./data", help="as in fedavg.py")
    p.add_argument("--model", default="cnn", help="model name from common.MODELS")
    p.add_argument("--num-clients", type=int, default=100, help="K")
    p.add_argument("--frac", type=float, default=0.1, help="C: fraction of clients per round")
    p.add_argument("--local-epochs", type=int, default=1, help="E")
    p.add_argument("--batch-size", type=int, default=50, help="B")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (after one warm-up round)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    p.add_argument("--amp", action="store_true", help="bfloat16 autocast")
    p.add_argument("--repeats", type=int, default=3, help="alternate FL and centralized timings this many times")
    a = p.parse_args()
    a.iid, a.shards, a.classes_per_client, a.alpha, a.split2 = False, 2, None, None, False
    a.quantity, a.client_test, a.data_seed, a.seed = "equal", False, 0, 0
    a.lr, a.momentum, a.weight_decay, a.prox_mu, a.local_steps, a.augment = 0.01, 0.9, 5e-4, 0.0, None, "crop-flip"
    a.weighting = "samples"
    return a


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def fl_rounds(model, client, partition, data, args, sampler, rounds):
    """fedavg.py's round loop (without evaluation); returns the number of SGD steps taken."""
    steps = 0
    for _ in range(rounds):
        clients = sample_clients(sampler, args.num_clients, args.frac)
        weights = client_weights([len(partition.train[k]) for k in clients], args.weighting)
        total = {k: torch.zeros_like(v, dtype=torch.float) for k, v in model.state_dict().items()}
        for k, w in zip(clients, weights):
            client.load_state_dict(model.state_dict())
            fedavg.local_train(client, partition.train[k], data, args, args.lr, [p.detach() for p in model.parameters()])
            accumulate(total, client.state_dict(), w)
            steps += len(list(client_batches(partition.train[k], args.batch_size, args.local_epochs)))
        model.load_state_dict(total)
    return steps


def centralized(model, data, args, steps):
    """The same number of SGD steps on one model with one optimizer, batches from all the data."""
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    model.train()
    indices = torch.arange(len(data.y_train), device=args.device)
    for batch in client_batches(indices, args.batch_size, steps=steps):
        x, y = prepare_batch(data.x_train[batch], data, args.augment), data.y_train[batch]
        with torch.autocast(torch.device(args.device).type, torch.bfloat16, enabled=args.amp):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


if __name__ == "__main__":
    args = parse_args()
    torch.manual_seed(0)
    data = load_data(args)
    partition = make_partition(args, data)
    model, client = build_model(args.model, data).to(args.device), build_model(args.model, data).to(args.device)
    sampler = np.random.default_rng(0)
    fl_rounds(model, client, partition, data, args, sampler, 1)  # warm-up (allocator, cudnn autotune)
    ratios, fl_times, central_times = [], [], []
    for _ in range(args.repeats):
        sync(args.device)
        t0 = time.perf_counter()
        steps = fl_rounds(model, client, partition, data, args, sampler, args.rounds)
        sync(args.device)
        t1 = time.perf_counter()
        centralized(client, data, args, steps)
        sync(args.device)
        t2 = time.perf_counter()
        fl_times.append(t1 - t0)
        central_times.append(t2 - t1)
        ratios.append((t1 - t0) / (t2 - t1))
    dev = torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else f"cpu x{torch.get_num_threads()} threads"
    print(f"device {dev}, torch {torch.__version__}, model {args.model}, {steps} SGD steps of batch {args.batch_size} "
          f"per timing ({args.rounds} rounds x {max(int(round(args.frac * args.num_clients)), 1)} clients)")
    print(f"FL {np.median(fl_times):.3f} s, centralized {np.median(central_times):.3f} s, "
          f"overhead ratio median {np.median(ratios):.3f} (all: {', '.join(f'{r:.3f}' for r in ratios)})")

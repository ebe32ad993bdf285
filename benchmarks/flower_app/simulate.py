"""Flower's side of benchmarks/vs_flower.py: the ServerApp (FedAvg of flwr.serverapp.strategy, Message API) and
a simulation of N SuperNodes on the Ray backend (flwr.simulation.run_simulation), in Flower's own venv.

    FLOWER_VENV/bin/python benchmarks/flower_app/simulate.py --data-dir /path/to/cifar10 --rounds 4 --out flower.json
    ... --actor-cpus 1 --ray-cpus 2     # one actor per core instead of Flower's default 2 CPUs per actor

The ServerApp evaluates the global model centrally on the whole test set after every round (evaluate_fn;
no federated evaluation: fraction_evaluate 0) and stamps the time when that evaluation ends, the same
point at which CleanFL's fedavg.py --eval-every 1 stamps elapsed_s. It writes to --out: those stamps,
the evaluation times, the final test accuracy, and which processes and torch thread counts ran the
clients (the actors' resources as they really were).
"""

import argparse
import json
import time

import flwr
import ray
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords
from flwr.simulation import run_simulation

from client_app import app as client_app
from task import Net, load_test, test


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", required=True, help="CIFAR-10 image folder (train/<class>/*, test/<class>/*)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--num-clients", type=int, default=100, help="SuperNodes, one IID partition each")
    p.add_argument("--frac", type=float, default=0.1, help="FedAvg fraction_train")
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=50)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.5)
    p.add_argument("--in-memory", action="store_true", help="decode the images once per process (task.Decoded)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial global model")
    p.add_argument("--actor-cpus", type=float, default=None, help="client_resources num_cpus (default: Flower's, 2)")
    p.add_argument("--ray-cpus", type=int, default=None, help="ray.init num_cpus (default: Ray's, all cores)")
    p.add_argument("--out", required=True, help="JSON file of the results")
    return p.parse_args()


def server_app(args, record):
    """The ServerApp; fills `record` (a dict) with the round stamps and results."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        torch.manual_seed(args.seed)
        # the test set once, not in every evaluation: its folder scan (or decoding) stays out of the rounds
        test_loader = load_test(args.data_dir, args.in_memory)
        clients = set()  # (pid, torch threads) of every client reply

        def collect(replies, weighting_key):  # FedAvg's metric averaging, after noting who ran each client
            clients.update((int(r["metrics"]["pid"]), int(r["metrics"]["threads"])) for r in replies)
            metrics = aggregate_metricrecords(replies, weighting_key)
            del metrics["pid"], metrics["threads"]  # an average of these means nothing
            return metrics

        def evaluate(server_round, arrays):
            if server_round == 0:  # FedAvg.start calls this before round 1; CleanFL does not test the initial model
                record["start"] = time.time()
                return None
            model = Net()
            model.load_state_dict(arrays.to_torch_state_dict())
            t = time.time()
            loss, acc = test(model, test_loader)
            record["eval_s"].append(time.time() - t)
            record["round_end"].append(time.time())
            return MetricRecord({"accuracy": acc, "loss": loss})

        strategy = FedAvg(fraction_train=args.frac, fraction_evaluate=0.0, train_metrics_aggr_fn=collect)
        train_config = ConfigRecord(
            {
                "data-dir": args.data_dir,
                "batch-size": args.batch_size,
                "local-epochs": args.local_epochs,
                "lr": args.lr,
                "momentum": args.momentum,
                "in-memory": args.in_memory,
            }
        )
        result = strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(Net().state_dict()),
            num_rounds=args.rounds,
            train_config=train_config,
            evaluate_fn=evaluate,
        )
        final = result.evaluate_metrics_serverapp[args.rounds]
        record.update(
            test_acc=final["accuracy"],
            test_loss=final["loss"],
            client_processes=len({pid for pid, _ in clients}),
            client_threads=sorted({threads for _, threads in clients}),
            server_threads=torch.get_num_threads(),
        )

    return app


def backend_config(args):
    """None (Flower's defaults) unless --actor-cpus or --ray-cpus asks for other resources."""
    config = {}
    if args.actor_cpus is not None:
        config["client_resources"] = {"num_cpus": args.actor_cpus, "num_gpus": 0.0}
    if args.ray_cpus is not None:
        config["init_args"] = {"num_cpus": args.ray_cpus}
    return config or None


if __name__ == "__main__":
    args = parse_args()
    record = {"round_end": [], "eval_s": [], "backend_config": backend_config(args)}
    run_simulation(
        server_app=server_app(args, record),
        client_app=client_app,
        num_supernodes=args.num_clients,
        backend_config=backend_config(args),
    )
    if "test_acc" not in record:  # a safety net: run_simulation re-raises a ServerApp's exception
        raise SystemExit("the ServerApp did not finish; see the log above")
    record.update(flwr=flwr.__version__, ray=ray.__version__, torch=torch.__version__)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)

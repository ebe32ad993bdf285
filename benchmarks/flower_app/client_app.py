"""The Flower ClientApp (Message API, flwr 1.42), as in Flower's quickstart-pytorch: load the received global
model, train it on this node's partition, reply with the weights and the number of examples (FedAvg's weight).
The training settings come in the message's ConfigRecord (run_simulation gives the apps no run config)."""

import os

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from task import Net, load_data
from task import train as train_fn

app = ClientApp()


@app.train()
def train(msg: Message, context: Context):
    config = msg.content["config"]
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    loader = load_data(
        config["data-dir"],
        context.node_config["partition-id"],
        context.node_config["num-partitions"],
        config["batch-size"],
        config["in-memory"],
    )
    loss = train_fn(model, loader, config["local-epochs"], config["lr"], config["momentum"])
    metrics = {
        "train_loss": loss,
        "num-examples": len(loader.dataset),
        # which process and how many torch threads ran this client: the run's actor count and threads per actor
        "pid": os.getpid(),
        "threads": torch.get_num_threads(),
    }
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord(metrics)})
    return Message(content=content, reply_to=msg)

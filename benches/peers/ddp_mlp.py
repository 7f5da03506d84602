"""PyTorch's side of `meshwork bench dp`: DDP over gloo on the same MLP (784-1024-1024-10,
ReLU, mean-squared error, SGD at 0.01), batch 64 per replica, one thread per process, against
one plain process.

Run (CPU wheel of torch from PyPI):

    python3 benches/peers/ddp_mlp.py --world 2 --steps 60

Prints one JSON line: samples/s of one plain process and of `world` DDP processes (3 warm-up
steps not timed), and their ratio.
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ranks import run_ranks

WARMUP = 3


def mlp():
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                         nn.Linear(1024, 10))


def train(model, steps, batch, rank):
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.rand(batch, 784, generator=gen)
    y = torch.rand(batch, 10, generator=gen)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    timed = 0.0
    for step in range(steps + WARMUP):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        opt.step()
        if step >= WARMUP:
            timed += time.perf_counter() - start
    return timed


def rank_main(rank, world, port, steps, batch, out):
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    timed = train(DDP(mlp()), steps, batch, rank)
    t = torch.tensor([timed], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == 0:
        out.put(t.item())
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=64)
    a = p.parse_args()
    torch.set_num_threads(1)
    one = a.batch * a.steps / train(mlp(), a.steps, a.batch, 0)
    [seconds] = run_ranks(rank_main, a.world, (a.steps, a.batch), "DDP")
    ddp = a.world * a.batch * a.steps / seconds
    print(json.dumps({"peer": "pytorch-ddp", "torch": torch.__version__, "world": a.world,
                      "batch_per_replica": a.batch, "one_process_samples_per_s": one,
                      "ddp_samples_per_s": ddp, "ddp_over_one": ddp / one}))


if __name__ == "__main__":
    main()

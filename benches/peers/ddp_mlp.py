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
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

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
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=rank_main, args=(r, a.world, port, a.steps, a.batch, out))
             for r in range(a.world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=600)
        if proc.is_alive():
            proc.kill()
    if out.empty():
        raise SystemExit("a DDP rank failed before rank 0 reported")
    if any(proc.exitcode != 0 for proc in procs):
        # gloo sometimes aborts a process while it tears down, after the timed steps.
        print("warning: a DDP rank exited with an error after reporting", file=sys.stderr)
    ddp = a.world * a.batch * a.steps / out.get()
    print(json.dumps({"peer": "pytorch-ddp", "torch": torch.__version__, "world": a.world,
                      "batch_per_replica": a.batch, "one_process_samples_per_s": one,
                      "ddp_samples_per_s": ddp, "ddp_over_one": ddp / one}))


if __name__ == "__main__":
    main()

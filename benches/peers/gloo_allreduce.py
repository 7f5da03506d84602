"""PyTorch's side of `meshwork bench allreduce --transport tcp`: gloo's all-reduce over
loopback TCP, one process per rank, f32 sums, busbw as nccl-tests defines it.

Run (CPU wheel of torch from PyPI):

    python3 benches/peers/gloo_allreduce.py --world 2 --bytes 16777216

Prints one JSON line per size: the median time of --iters all-reduces after 3 warm-up ones,
algbw = bytes / time and busbw = algbw · 2(n − 1)/n (GB/s, 10^9 bytes).
"""
import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank, world, port, sizes, iters, out):
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for nbytes in sizes:
        x = torch.ones(nbytes // 4, dtype=torch.float32)
        times = []
        for i in range(iters + 3):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(x)
            if i >= 3:
                times.append(time.perf_counter() - start)
        # The slowest rank's time is the op's time.
        t = torch.tensor([statistics.median(times)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if rank == 0:
            algbw = nbytes / t.item() / 1e9
            out.put({"peer": "gloo", "torch": torch.__version__, "world": world,
                     "bytes": nbytes, "time_s": t.item(), "algbw_gbs": algbw,
                     "busbw_gbs": algbw * 2 * (world - 1) / world})
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--bytes", type=int, action="append")
    p.add_argument("--iters", type=int, default=10)
    a = p.parse_args()
    sizes = a.bytes or [4096 << (2 * i) for i in range(8)]  # 4 KiB .. 64 MiB
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, a.world, port, sizes, a.iters, out))
             for r in range(a.world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=600)
        if proc.is_alive():
            proc.kill()
    if out.empty():
        raise SystemExit("a gloo rank failed before rank 0 reported")
    if any(proc.exitcode != 0 for proc in procs):
        # gloo sometimes aborts a process while it tears down, after the timed ops.
        print("warning: a gloo rank exited with an error after reporting", file=sys.stderr)
    while not out.empty():
        print(json.dumps(out.get()))


if __name__ == "__main__":
    main()

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
import statistics
import time

import torch
import torch.distributed as dist

from ranks import run_ranks


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
    for report in run_ranks(rank_main, a.world, (sizes, a.iters), "gloo"):
        print(json.dumps(report))


if __name__ == "__main__":
    main()

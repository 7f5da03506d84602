"""Starting a PyTorch peer's ranks: one spawned process per rank on this machine, a local
rendezvous port, and what rank 0 reports. Shared by ddp_mlp.py, gloo_allreduce.py and
gpt_ddp.py; each rank runs `target(rank, world, port, *args, out)` and puts its report on
`out`."""
import socket
import sys

import torch.multiprocessing as mp


def run_ranks(target, world, args, what, timeout=600):
    """Every report the ranks put on their queue, in order; exits naming `what` when none
    arrived. gloo sometimes aborts a process while it tears down, after the timed work: a
    report that arrived before such an abort is kept, with a warning."""
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=target, args=(r, world, port, *args, out)) for r in range(world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=timeout)
        if proc.is_alive():
            proc.kill()
    if out.empty():
        raise SystemExit(f"a {what} rank failed before rank 0 reported")
    if any(proc.exitcode != 0 for proc in procs):
        print(f"warning: a {what} rank exited with an error after reporting", file=sys.stderr)
    reports = []
    while not out.empty():
        reports.append(out.get())
    return reports

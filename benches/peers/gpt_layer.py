"""PyTorch's side of `meshwork bench layer`: the same GPT layer trained with SGD.

The layer is the one `meshwork bench tensor --tp 1` and `meshwork bench layer` train: a
LayerNorm, then pre-norm causal self-attention (query, key, value and output projections with
bias, `heads` heads) with its residual, then the pre-norm MLP (hidden -> 4 hidden -> hidden,
GELU, bias) with its residual, a mean-squared error against a fixed random target, SGD at
learning rate 0.01. Items are fixed random [seq, hidden] inputs and targets in [-1, 1).

Run (CPU wheel of torch from PyPI, one thread, the same shapes as meshwork's defaults):

    python3 benches/peers/gpt_layer.py --threads 1 --hidden 1024 --heads 16 --seq 64 --batch 8

Prints one JSON line: samples/s (median of --repeats runs of --steps timed steps after two
warm-up steps) and the thread count.
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Layer(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.norm0 = nn.LayerNorm(hidden)
        self.norm1 = nn.LayerNorm(hidden)
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.output = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        x = self.norm0(x)
        b, s, h = x.shape
        d = h // self.heads
        n = self.norm1(x)
        split = lambda t: t.view(b, s, self.heads, d).transpose(1, 2)
        q, k, v = split(self.query(n)), split(self.key(n)), split(self.value(n))
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.output(ctx.transpose(1, 2).reshape(b, s, h))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(11)
    gen = torch.Generator().manual_seed(23)
    x = torch.rand(a.batch, a.seq, a.hidden, generator=gen) * 2 - 1
    y = torch.rand(a.batch, a.seq, a.hidden, generator=gen) * 2 - 1
    runs = []
    for _ in range(a.repeats):
        model = Layer(a.hidden, a.heads)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        timed = 0.0
        for step in range(a.steps + 2):
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            if step >= 2:
                timed += time.perf_counter() - start
        runs.append(a.batch * a.steps / timed)
    print(json.dumps({
        "peer": "pytorch", "torch": torch.__version__, "threads": torch.get_num_threads(),
        "hidden": a.hidden, "heads": a.heads, "seq": a.seq, "batch": a.batch,
        "samples_per_s": statistics.median(runs),
    }))


if __name__ == "__main__":
    main()

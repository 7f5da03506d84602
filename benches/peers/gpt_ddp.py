"""PyTorch's side of `meshwork train --model gpt`: the same character-level GPT on the same
King James text, in the same data order, with the same optimizer, as DDP over gloo.

The model is meshwork's demo GPT (src/demo/gpt.rs, src/parallel/tensor/layers.rs): token and
position embeddings, `layers` x (pre-norm causal self-attention, pre-norm MLP d -> 4d -> d with
exact GELU), residuals, a final LayerNorm and an untied head without bias, the mean
next-character cross-entropy; no dropout; Burn's initialisation schemes. The data is
`CharCorpus` (src/data/text.rs): windows of `context + 1` characters every `context`, the
last tenth of the text for validation, and step s reads meshwork's `DistributedSampler` batch
(src/parallel/sampler.rs), rank r its contiguous share. Adam as Burn's `AdamConfig::new()`
(epsilon 1e-5), constant --lr, no clipping; validation as `mean_loss` (256 windows, batch 32).

Run (CPU wheel of torch from PyPI) beside `meshwork train --model gpt --dp 2 --steps 300`:

    python3 benches/peers/gpt_ddp.py --world 2 --steps 300

or let `meshwork bench gpt --pytorch python3` run it beside meshwork at both sizes and
dp 1 and 2.

Prints one JSON line: global windows/s over the steps after the first 3 (all --steps steps
train), the validation loss before and after, the global batch's first and last loss.
"""
import argparse
import gzip
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ranks import run_ranks

WARMUP = 3  # steps trained but not timed
VALIDATION_FRACTION = 0.1  # KJV_VALIDATION_FRACTION (src/demo/kjv.rs)
VALIDATION_WINDOWS = 256  # VALIDATION_WINDOWS (src/bin/meshwork/gpt_train.rs)
VALIDATION_BATCH = 32
MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def load_corpus(path):
    """Vocabulary size, training and validation tokens of the text (CharCorpus::new)."""
    with open(path, "rb") as f:
        raw = f.read()
    if path.endswith(".gz"):
        raw = gzip.decompress(raw)
    text = raw.decode("utf-8")  # bytes as they are: no newline translation
    chars = sorted(set(text))  # by code point, as CharVocab::new
    index = {c: i for i, c in enumerate(chars)}
    tokens = torch.tensor([index[c] for c in text], dtype=torch.long)
    cut = len(tokens) - math.floor(len(tokens) * VALIDATION_FRACTION)
    return len(chars), tokens[:cut].clone(), tokens[cut:].clone()


def windows(tokens, context):
    """Window i is tokens[i * context : i * context + context + 1] (TextWindows, stride context)."""
    return tokens.unfold(0, context + 1, context)


def epoch_order(n, seed, epoch):
    """DistributedSampler::epoch_order: Fisher-Yates over 0..n with SplitMix64."""
    state = seed ^ ((epoch * GOLDEN) & MASK64)
    order = list(range(n))
    for i in range(n - 1, 0, -1):
        state = (state + GOLDEN) & MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        z ^= z >> 31
        j = z % (i + 1)
        order[i], order[j] = order[j], order[i]
    return order


def chunk_range(length, world, index):
    """Replica `index`'s share of a global batch (mesh::chunk_range)."""
    base, extra = divmod(length, world)
    start = index * base + min(index, extra)
    return range(start, start + base + (1 if index < extra else 0))


def linear(d_in, d_out, bias=True):
    """Burn's default Linear: weight and bias from U(-1/sqrt(d_in), 1/sqrt(d_in))."""
    layer = nn.Linear(d_in, d_out, bias=bias)
    bound = 1.0 / math.sqrt(d_in)
    nn.init.uniform_(layer.weight, -bound, bound)
    if bias:
        nn.init.uniform_(layer.bias, -bound, bound)
    return layer


class Attention(nn.Module):
    """ParallelSelfAttention at tp 1: x + output(causal attention(norm(x)))."""

    def __init__(self, d_model, heads):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(d_model, eps=1e-5)
        self.query = linear(d_model, d_model)
        self.key = linear(d_model, d_model)
        self.value = linear(d_model, d_model)
        self.output = linear(d_model, d_model)

    def forward(self, x):
        b, s, d = x.shape
        h = self.norm(x)
        split = lambda t: t.view(b, s, self.heads, d // self.heads).transpose(1, 2)
        q, k, v = split(self.query(h)), split(self.key(h)), split(self.value(h))
        # softmax(q k^T / sqrt(head_dim)) v with the future masked (meshwork fills -1e9).
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.output(ctx.transpose(1, 2).reshape(b, s, d))


class Mlp(nn.Module):
    """ParallelMlp at tp 1: x + down(gelu(up(norm(x)))), exact GELU."""

    def __init__(self, d_model, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(d_model, eps=1e-5)
        self.up = linear(d_model, hidden)
        self.down = linear(hidden, d_model)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Gpt(nn.Module):
    """meshwork's demo `Gpt`: its forward is the mean next-token cross-entropy."""

    def __init__(self, vocab, context, d_model, heads, layers):
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Parameter(torch.empty(context, d_model))
        nn.init.normal_(self.tokens.weight, 0.0, 0.02)
        nn.init.normal_(self.positions, 0.0, 0.02)
        self.layers = nn.ModuleList(
            nn.ModuleList([Attention(d_model, heads), Mlp(d_model, 4 * d_model)])
            for _ in range(layers))
        self.norm = nn.LayerNorm(d_model, eps=1e-5)
        self.head = linear(d_model, vocab, bias=False)

    def forward(self, inputs, targets):
        x = self.tokens(inputs) + self.positions[: inputs.shape[1]]
        for attention, mlp in self.layers:
            x = mlp(attention(x))
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def mean_loss(model, val):
    """demo::gpt::mean_loss: batches of 32, each batch's loss weighted by its windows."""
    total, count = 0.0, 0
    for start in range(0, len(val), VALIDATION_BATCH):
        w = val[start:start + VALIDATION_BATCH]
        total += model(w[:, :-1], w[:, 1:]).item() * len(w)
        count += len(w)
    return total / count


def rank_main(rank, world, port, a, vocab, train_tokens, val, orders, out):
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(a.seed)
    model = Gpt(vocab, a.context, a.d_model, a.heads, a.layers)
    before = mean_loss(model, val) if rank == 0 else math.nan
    ddp = DDP(model)  # broadcasts rank 0's parameters; averages gradients over the ranks
    opt = torch.optim.Adam(ddp.parameters(), lr=a.lr, betas=(0.9, 0.999), eps=1e-5,
                           weight_decay=0.0)
    train = windows(train_tokens, a.context)
    per_epoch = len(train) // a.batch_size  # the last incomplete batch is dropped
    share = chunk_range(a.batch_size, world, rank)
    losses, timed = [], 0.0
    dist.barrier()
    for step in range(a.steps):
        start = time.perf_counter()
        epoch, batch = divmod(step, per_epoch)
        ids = orders[epoch, batch * a.batch_size:(batch + 1) * a.batch_size]
        w = train[ids[share.start:share.stop]]
        opt.zero_grad(set_to_none=True)
        loss = ddp(w[:, :-1], w[:, 1:])
        loss.backward()
        opt.step()
        losses.append(loss.detach())
        if step >= WARMUP:
            timed += time.perf_counter() - start
    t = torch.tensor([timed], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    # The global batch's loss: each rank's mean weighted by its share (the Supervisor's loss).
    ends = torch.stack([losses[0], losses[-1]]).double() * len(share) / a.batch_size
    dist.all_reduce(ends)
    if rank == 0:
        out.put({"timed_s": t.item(), "before": before, "after": mean_loss(model, val),
                 "first": ends[0].item(), "last": ends[1].item()})
    dist.destroy_process_group()


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=None,
                   help="global batch (default: 32 rounded to a multiple of --world)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text", default=os.path.join(here, "..", "..", "data", "kjv", "kjv.txt.gz"))
    a = p.parse_args()
    if a.batch_size is None:  # settings::fit_batch(32, world)
        a.batch_size = max((32 + a.world // 2) // a.world, 1) * a.world
    if a.batch_size % a.world or a.d_model % a.heads or a.steps <= WARMUP:
        raise SystemExit("--batch-size must divide by --world, --d-model by --heads, "
                         f"and --steps must exceed the {WARMUP} warm-up steps")
    vocab, train_tokens, val_tokens = load_corpus(a.text)
    val = windows(val_tokens, a.context)[:VALIDATION_WINDOWS].contiguous()
    n = len(windows(train_tokens, a.context))
    if n < a.batch_size:
        raise SystemExit(f"{n} training windows do not fill a batch of {a.batch_size}")
    epochs = (a.steps - 1) // (n // a.batch_size) + 1
    orders = torch.tensor([epoch_order(n, a.seed, e) for e in range(epochs)], dtype=torch.long)
    [r] = run_ranks(rank_main, a.world, (a, vocab, train_tokens, val, orders), "DDP",
                    timeout=3600)
    print(json.dumps({
        "peer": "pytorch-ddp", "torch": torch.__version__, "world": a.world, "steps": a.steps,
        "global_batch": a.batch_size, "vocab": vocab,
        "windows_per_s": a.batch_size * (a.steps - WARMUP) / r["timed_s"],
        "validation_loss_before": r["before"], "validation_loss_after": r["after"],
        "train_loss_first": r["first"], "train_loss_last": r["last"]}))


if __name__ == "__main__":
    main()

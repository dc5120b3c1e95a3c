"""nanoGPT's CPU run on character-level Shakespeare, in plain PyTorch: the reference that
`shakespeare.py` sets the Keras backends beside.

    python benchmarks/torch_gpt.py [--text FILE] [--iters 2000] [--seed 0] [--threads N]

nanoGPT's architecture (token + learned position embeddings, pre-LN blocks, causal
`scaled_dot_product_attention`, GELU MLP 4x wide, biases, final LayerNorm, logits tied to the
token embedding; normal(0, 0.02) init, residual projections 0.02 / sqrt(2 n_layer)) and its
documented CPU configuration: 4 layers, 4 heads, width 128, context 64, batch 12, 2,000
iterations, no dropout, ~0.80 M parameters; AdamW (betas 0.9, 0.99; weight decay 0.1 on the
2-D weights only), lr 1e-3 warmed up linearly over 100 iterations then cosine-decayed to 1e-4 at
the last one, gradients clipped to norm 1.0. Data as nanoGPT's
`data/shakespeare_char/prepare.py` (vocabulary `sorted(set(text))`, train = first 90%, val =
last 10%); batches are random windows at offsets drawn by `np.random.default_rng(seed)`
(`batch_offsets`), so another engine can train on the very same windows.

Printed: ms per step (median of the steps after the first 20), `train_seconds=` (wall time of
the iterations) and, last, `val_loss=`: the mean per-token cross-entropy over the whole val split
cut into non-overlapping 64-token windows, once at the end.
"""

import argparse
import math
import os
import statistics
import time

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

DEFAULT_TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared",
                            "data", "tinyshakespeare", "input.txt")
CONFIG = dict(n_layer=4, n_head=4, n_embd=128, block_size=64)
TRAIN = dict(batch_size=12, iters=2000, lr=1e-3, min_lr=1e-4, warmup=100, betas=(0.9, 0.99),
             weight_decay=0.1, grad_clip=1.0)


# ---------------------------------------------------------------------------------------------
# Data


def load_data(path):
    """(train ids, val ids, vocabulary) as nanoGPT's shakespeare_char/prepare.py."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    ids = np.array([index[c] for c in text], dtype=np.int64)
    n = int(len(ids) * 0.9)
    return ids[:n], ids[n:], chars


def batch_offsets(rng, n_train, block_size=64, batch_size=12):
    """One iteration's window offsets: nanoGPT's get_batch, drawn from a NumPy generator."""
    return rng.integers(0, n_train - block_size, size=batch_size)


def windows(data, offsets, block_size=64):
    """x = data[i:i+block], y = data[i+1:i+1+block] for each offset i."""
    x = np.stack([data[i:i + block_size] for i in offsets])
    y = np.stack([data[i + 1:i + 1 + block_size] for i in offsets])
    return torch.from_numpy(x), torch.from_numpy(y)


def val_windows(val, block_size=64):
    """The val split in non-overlapping windows at j = 0, block, 2 block, ... (j + block < len)."""
    return windows(val, range(0, len(val) - block_size, block_size), block_size)


# ---------------------------------------------------------------------------------------------
# Model


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.attn_proj = nn.Linear(n_embd, n_embd)
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.mlp_proj = nn.Linear(4 * n_embd, n_embd)

    def attention(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
                   for z in self.c_attn(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.attn_proj(y.transpose(1, 2).reshape(b, t, c))

    def forward(self, x):
        x = x + self.attention(self.ln_1(x))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, vocab_size, n_layer=4, n_head=4, n_embd=128, block_size=64):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        for module in self.modules():  # nanoGPT's _init_weights
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, 0.0, 0.02)
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)
        for block in self.blocks:  # the residual projections (nanoGPT's c_proj)
            for proj in (block.attn_proj, block.mlp_proj):
                nn.init.normal_(proj.weight, 0.0, 0.02 / math.sqrt(2 * n_layer))

    def num_params(self):
        """As nanoGPT counts them: the position embeddings left out (the tied head counts once)."""
        return sum(p.numel() for p in self.parameters()) - self.wpe.weight.numel()

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.T  # logits, head tied to the token embedding


def loss_fn(model, x, y):
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


# ---------------------------------------------------------------------------------------------
# Training


def learning_rate(it, iters=2000, lr=1e-3, min_lr=1e-4, warmup=100):
    """nanoGPT's get_lr: linear warm-up, then cosine decay to min_lr at `iters`."""
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    if it > iters:
        return min_lr
    coeff = 0.5 * (1.0 + math.cos(math.pi * (it - warmup) / (iters - warmup)))
    return min_lr + coeff * (lr - min_lr)


def optimizer(model, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1):
    """nanoGPT's configure_optimizers: decay on the 2-D tensors (matrices, embeddings) only."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW([
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ], lr=lr, betas=betas)


def train(model, train_ids, iters=2000, seed=0, batch_size=12, lr=1e-3, min_lr=1e-4,
          warmup=100, betas=(0.9, 0.99), weight_decay=0.1, grad_clip=1.0):
    """The training loop; returns each iteration's seconds (batch, forward, backward, update)."""
    block_size = model.wpe.weight.shape[0]
    opt = optimizer(model, lr, betas, weight_decay)
    rng = np.random.default_rng(seed)
    model.train()
    seconds = []
    for it in range(iters):
        start = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = learning_rate(it, iters, lr, min_lr, warmup)
        x, y = windows(train_ids, batch_offsets(rng, len(train_ids), block_size, batch_size),
                       block_size)
        loss = loss_fn(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        seconds.append(time.perf_counter() - start)
        if it % 200 == 0 or it == iters - 1:
            print(f"iter {it}: loss {loss.item():.4f}", flush=True)
    return seconds


@torch.no_grad()
def evaluate(model, val_ids, batch_size=256):
    """Mean per-token cross-entropy over the val split's non-overlapping windows."""
    model.eval()
    x, y = val_windows(val_ids, model.wpe.weight.shape[0])
    total = 0.0
    for i in range(0, len(x), batch_size):
        total += loss_fn(model, x[i:i + batch_size], y[i:i + batch_size]).item() * len(
            x[i:i + batch_size])
    return total / len(x)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text", default=DEFAULT_TEXT)
    parser.add_argument("--iters", type=int, default=TRAIN["iters"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    train_ids, val_ids, chars = load_data(args.text)
    model = GPT(len(chars), **CONFIG)
    print(f"vocabulary {len(chars)}, train {len(train_ids):,} / val {len(val_ids):,} tokens, "
          f"{model.num_params() / 1e6:.2f}M parameters, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads", flush=True)
    hyper = {k: v for k, v in TRAIN.items() if k != "iters"}
    start = time.perf_counter()
    seconds = train(model, train_ids, iters=args.iters, seed=args.seed, **hyper)
    wall = time.perf_counter() - start
    timed = seconds[20:] or seconds
    print(f"ms_per_step={1000 * statistics.median(timed):.2f}")
    print(f"train_seconds={wall:.2f}")
    print(f"val_loss={evaluate(model, val_ids):.4f}")


if __name__ == "__main__":
    main()

"""The GPT of ``--model gpt`` in PyTorch (CPU): the twin that mpisgd's GPT is measured against.

The same architecture (mpisgd.nn.gpt: pre-norm blocks, biases everywhere, GELU in its tanh form, no
weight tying), the same initial parameters (mpisgd's, materialised from the same --seed and copied in,
W transposed to PyTorch's (out, in)), the same data order (mpisgd.text's windows, batch t of an epoch is
mpisgd.data.epoch_permutation's perm[t*B:(t+1)*B]), the same recipe (mpisgd.schedule.Schedule's rate
per step; torch.optim.AdamW with weight decay on the 2-D tensors only), the same evaluation (the mean
loss per token over the whole validation set after each epoch, the test set at the end, eval mode).

    python benchmarks/gpt_torch.py train --data kjv.txt [mpisgd's options] --metrics-file t.jsonl
    python benchmarks/gpt_torch.py speed --data kjv.txt --steps 20 [--batch-size 32 --context 128]

``train`` prints and writes (--metrics-file) one JSON record per step and per epoch, as mpisgd's
metrics file; ``speed`` times training steps after a warm-up and prints tokens per second. One
thread (torch.set_num_threads) unless --threads says otherwise. docs/gpt.md has the comparison.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from mpisgd.app.options import parse_config  # noqa: E402
from mpisgd.config import at_least  # noqa: E402
from mpisgd.data import epoch_permutation  # noqa: E402
from mpisgd.nn.gpt import GPTShape, gpt  # noqa: E402
from mpisgd.schedule import Schedule, total_steps  # noqa: E402
from mpisgd.text import load_tokens  # noqa: E402


class Block(nn.Module):
    def __init__(self, s: GPTShape) -> None:
        super().__init__()
        self.heads = s.heads
        self.ln1 = nn.LayerNorm(s.width)
        self.qkv = nn.Linear(s.width, 3 * s.width)
        self.proj = nn.Linear(s.width, s.width)
        self.ln2 = nn.LayerNorm(s.width)
        self.fc = nn.Linear(s.width, 4 * s.width)
        self.fc_proj = nn.Linear(4 * s.width, s.width)
        self.drop = nn.Dropout(s.dropout)
        self.p = s.dropout

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (a.view(n, t, self.heads, d // self.heads).transpose(1, 2) for a in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.p if self.training else 0.0)
        return self.drop(self.proj(y.transpose(1, 2).contiguous().view(n, t, d)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.drop(self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh")))


class TorchGPT(nn.Module):
    def __init__(self, s: GPTShape) -> None:
        super().__init__()
        self.tok = nn.Embedding(s.vocab, s.width)
        self.pos = nn.Parameter(torch.zeros(s.context, s.width))
        self.drop = nn.Dropout(s.dropout)
        self.blocks = nn.ModuleList(Block(s) for _ in range(s.layers))
        self.ln = nn.LayerNorm(s.width)
        self.head = nn.Linear(s.width, s.vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok(ids) + self.pos[:ids.shape[1]])
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))

    def ordered(self) -> list[tuple[Any, bool]]:
        """Every parameter in mpisgd's flat order, and whether mpisgd stores it transposed (Linear's W)."""
        out: list[tuple[Any, bool]] = [(self.tok.weight, False), (self.pos, False)]
        blocks: list[Any] = list(self.blocks)
        for b in blocks:
            out += [(b.ln1.weight, False), (b.ln1.bias, False), (b.qkv.weight, True), (b.qkv.bias, False),
                    (b.proj.weight, True), (b.proj.bias, False), (b.ln2.weight, False), (b.ln2.bias, False),
                    (b.fc.weight, True), (b.fc.bias, False), (b.fc_proj.weight, True), (b.fc_proj.bias, False)]
        return out + [(self.ln.weight, False), (self.ln.bias, False), (self.head.weight, True),
                      (self.head.bias, False)]


def from_mpisgd(model: TorchGPT, s: GPTShape, seed: int) -> None:
    """Copy mpisgd's initial parameters (the same seed) into the twin."""
    mine = gpt(s).materialize(np, "float32", seed)
    shapes = [v for _, v in mine.named_parameters()]
    theirs = model.ordered()
    assert len(shapes) == len(theirs), (len(shapes), len(theirs))
    with torch.no_grad():
        for value, (p, transposed) in zip(shapes, theirs, strict=True):
            p.copy_(torch.from_numpy(np.ascontiguousarray(value.T if transposed else value)))


def batches(x: np.ndarray, y: np.ndarray, b: int) -> Any:
    for start in range(0, len(x), b):
        yield torch.from_numpy(np.asarray(x[start:start + b], np.int64)), \
            torch.from_numpy(np.asarray(y[start:start + b], np.int64))


@torch.no_grad()
def evaluate(model: TorchGPT, data: Any, b: int) -> tuple[float, float]:
    """(mean loss per token, token accuracy) over a whole set, in eval mode."""
    model.eval()
    total, right, n = 0.0, 0, 0
    for x, y in batches(data.images, data.labels, b):
        logits = model(x)
        total += float(F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1), reduction="sum"))
        right += int((logits.argmax(-1) == y).sum())
        n += y.numel()
    model.train()
    return total / n, right / n


def setup(argv: list[str]) -> tuple[Any, ...]:
    cfg = parse_config(["--model", "gpt", *argv], quiet=True)
    assert cfg.data is not None
    d = load_tokens(cfg.data, cfg.context, cfg.val_split)
    if cfg.limit_train:  # as mpisgd.app.run: the first N windows
        d.train = d.train.head(cfg.limit_train)
    if cfg.limit_test:
        d.test = d.test.head(cfg.limit_test)
    s = GPTShape(d.vocab.size, cfg.context, cfg.gpt_layers, cfg.gpt_heads, cfg.gpt_width, cfg.dropout)
    torch.manual_seed(cfg.seed)
    model = TorchGPT(s)
    from_mpisgd(model, s, cfg.seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    wd = cfg.weight_decay
    groups = [{"params": decay, "weight_decay": wd},
              {"params": rest, "weight_decay": wd if cfg.weight_decay_on == "all" else 0.0}]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    return cfg, d, model, opt


def train(argv: list[str], out: Any) -> None:
    cfg, d, model, opt = setup(argv)
    b = cfg.batch_size
    spe = len(d.train) // b
    n_steps = total_steps(cfg.epochs, spe, cfg.max_steps)
    sched = Schedule.from_config(cfg, 1, spe, n_steps)
    step, t_start = 0, time.perf_counter()
    for epoch in range(-(-n_steps // spe)):
        perm = epoch_permutation(len(d.train), cfg.seed, epoch)
        losses, t0 = [], time.perf_counter()
        for t in range(spe):
            if step >= n_steps:
                break
            idx = perm[t * b:(t + 1) * b]
            x = torch.from_numpy(np.asarray(d.train.images[idx], np.int64))
            y = torch.from_numpy(np.asarray(d.train.labels[idx], np.int64))
            lr = sched(step)
            for g in opt.param_groups:
                g["lr"] = lr
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.clip_grad_norm:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad_norm)
            opt.step()
            step += 1
            losses.append(float(loss.detach()))
            out({"kind": "step", "step": step, "epoch": epoch + 1, "lr": lr, "loss": losses[-1]})
        train_s = time.perf_counter() - t0
        val_loss, val_acc = evaluate(model, d.val, b) if d.val is not None else (float("nan"), float("nan"))
        out({"kind": "epoch", "epoch": epoch + 1, "step": step, "train_loss": float(np.mean(losses)),
             "val_loss": val_loss, "val_acc": val_acc, "val_bits_per_token": val_loss / math.log(2),
             "tokens_per_s": len(losses) * b * cfg.context / train_s, "epoch_time_s": train_s}, echo=True)
    test_loss, test_acc = evaluate(model, d.test, b)
    out({"kind": "test", "step": step, "test_loss": test_loss, "test_acc": test_acc,
         "test_bits_per_token": test_loss / math.log(2), "wall_s": time.perf_counter() - t_start}, echo=True)


def speed(argv: list[str], steps: int, warmup: int) -> None:
    cfg, d, model, opt = setup(argv)
    b = cfg.batch_size
    perm = epoch_permutation(len(d.train), cfg.seed, 0)
    times = []
    for step in range(warmup + steps):
        idx = perm[step * b:(step + 1) * b]
        x = torch.from_numpy(np.asarray(d.train.images[idx], np.int64))
        y = torch.from_numpy(np.asarray(d.train.labels[idx], np.int64))
        t0 = time.perf_counter()
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    med = float(np.median(times))
    print(json.dumps({"framework": "torch", "threads": torch.get_num_threads(), "batch": b, "context": cfg.context,
                      "step_ms_median": 1e3 * med, "tokens_per_s": b * cfg.context / med, "steps": steps}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("train", "speed"))
    parser.add_argument("--threads", type=at_least(1), default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument("--steps", type=at_least(1), default=20, help="speed: timed steps")
    parser.add_argument("--warmup", type=at_least(0), default=3, help="speed: untimed steps first")
    args, rest = parser.parse_known_args()
    metrics = None
    if "--metrics-file" in rest:
        i = rest.index("--metrics-file")
        metrics = open(rest[i + 1], "w")  # noqa: SIM115
        del rest[i:i + 2]
    torch.set_num_threads(args.threads)

    def out(record: dict[str, Any], echo: bool = False) -> None:
        if metrics is not None:
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
        if echo:
            print(json.dumps(record), flush=True)

    if args.mode == "train":
        train(rest, out)
    else:
        speed(rest, args.steps, args.warmup)


if __name__ == "__main__":
    main()

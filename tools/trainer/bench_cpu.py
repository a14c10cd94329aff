#!/usr/bin/python3
"""tutti-train against PyTorch on the CPU, in one run: the same GPT (trainer/gpt.hpp's), the same
batch, threads and optimizer, tokens per second of full training steps (forward, backward, AdamW).
Then data and tensor parallelism over the machine's cores against one rank with as many threads.

    /usr/bin/python3 tools/trainer/bench_cpu.py [--build build] [--steps 8] [--threads 2]

Prints each measurement and the ratios (tutti / PyTorch; parallel / one rank). PyTorch is Debian's
python3-torch (1.13); its step is the plain eager loop of nanoGPT.
"""
import argparse
import math
import os
import re
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--build", default="build")
p.add_argument("--steps", type=int, default=8)
p.add_argument("--warmup", type=int, default=2)
p.add_argument("--threads", type=int, default=os.cpu_count())
p.add_argument("--layers", type=int, default=6)
p.add_argument("--channels", type=int, default=384)
p.add_argument("--heads", type=int, default=6)
p.add_argument("--seq", type=int, default=256)
p.add_argument("--batch", type=int, default=8)
p.add_argument("--vocab", type=int, default=256)
a = p.parse_args()
V, T, L, NH, C, B = a.vocab, a.seq, a.layers, a.heads, a.channels, a.batch


def torch_tokens_per_s():
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    params = {"wte": 0.02 * torch.randn(V, C), "wpe": 0.02 * torch.randn(T, C), "lnf.weight": torch.ones(C),
              "lnf.bias": torch.zeros(C)}
    for l in range(L):
        h = f"h.{l}."
        params.update({h + "ln1.weight": torch.ones(C), h + "ln1.bias": torch.zeros(C),
                       h + "attn.qkv.weight": 0.02 * torch.randn(3 * C, C), h + "attn.qkv.bias": torch.zeros(3 * C),
                       h + "attn.proj.weight": 0.02 * torch.randn(C, C), h + "attn.proj.bias": torch.zeros(C),
                       h + "ln2.weight": torch.ones(C), h + "ln2.bias": torch.zeros(C),
                       h + "mlp.fc.weight": 0.02 * torch.randn(4 * C, C), h + "mlp.fc.bias": torch.zeros(4 * C),
                       h + "mlp.proj.weight": 0.02 * torch.randn(C, 4 * C), h + "mlp.proj.bias": torch.zeros(C)})
    for t in params.values():
        t.requires_grad_(True)
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
    hs = C // NH

    def loss_of(idx, targets):
        x = params["wte"][idx] + params["wpe"][:T]
        for l in range(L):
            h = f"h.{l}."
            y = F.layer_norm(x, (C,), params[h + "ln1.weight"], params[h + "ln1.bias"])
            qkv = F.linear(y, params[h + "attn.qkv.weight"], params[h + "attn.qkv.bias"])
            q, k, v = (t.view(B, T, NH, hs).transpose(1, 2) for t in qkv.split(C, dim=-1))
            att = ((q @ k.transpose(-2, -1)) / math.sqrt(hs)).masked_fill(~mask, float("-inf")).softmax(-1)
            y = (att @ v).transpose(1, 2).reshape(B, T, C)
            x = x + F.linear(y, params[h + "attn.proj.weight"], params[h + "attn.proj.bias"])
            y = F.layer_norm(x, (C,), params[h + "ln2.weight"], params[h + "ln2.bias"])
            y = F.gelu(F.linear(y, params[h + "mlp.fc.weight"], params[h + "mlp.fc.bias"]), approximate="tanh")
            x = x + F.linear(y, params[h + "mlp.proj.weight"], params[h + "mlp.proj.bias"])
        x = F.layer_norm(x, (C,), params["lnf.weight"], params["lnf.bias"])
        return F.cross_entropy((x @ params["wte"].t()).view(-1, V), targets.reshape(-1))

    decay = [t for t in params.values() if t.dim() == 2]
    rest = [t for t in params.values() if t.dim() != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.95))
    data = torch.randint(0, V, (a.steps + a.warmup, B, T + 1))
    t0 = None
    for s in range(a.steps + a.warmup):
        if s == a.warmup:
            t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_of(data[s, :, :T], data[s, :, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params.values(), 1.0)
        opt.step()
    return a.steps * B * T / (time.perf_counter() - t0)


def tutti_tokens_per_s(ranks, threads, extra):
    model = ["--layers", str(L), "--channels", str(C), "--heads", str(NH), "--seq", str(T), "--vocab", str(V),
             "--batch", str(B), "--steps", str(a.steps + a.warmup), "--warmup", "0", "--eval-every", "0",
             "--eval-batches", "1", "--threads", str(threads), "--out", "/tmp/tutti-bench-train"]
    cmd = [f"{a.build}/bin/tutti-train"] + model + extra
    if ranks > 1:
        cmd = [f"{a.build}/bin/tutti-run", "-n", str(ranks)] + cmd
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rates = [float(x) for x in re.findall(r"\|\s+([0-9.]+) tok/s", out)]
    rates = rates[a.warmup:]
    # The same measure as PyTorch's: tokens over the summed step times.
    return len(rates) / sum(1.0 / r for r in rates)


print(f"# GPT L{L} C{C} NH{NH} T{T} V{V}, batch {B}, {a.threads} thread(s), {a.steps} timed steps after {a.warmup}")
pt = torch_tokens_per_s()
print(f"pytorch {torch.__version__} 1 process: {pt:9.0f} tok/s")
tt = tutti_tokens_per_s(1, a.threads, [])
print(f"tutti-train 1 process:        {tt:9.0f} tok/s   ratio {tt / pt:.2f}x  (floor 1.0x)")
if a.threads >= 2:
    per = a.threads // 2
    dp = tutti_tokens_per_s(2, per, ["--dp", "2"])
    print(f"tutti-train dp2 ({per} thread each): {dp:9.0f} tok/s   ratio {dp / tt:.2f}x of 1 rank (floor 0.8x)")
    tp = tutti_tokens_per_s(2, per, ["--tp", "2"])
    print(f"tutti-train tp2 ({per} thread each): {tp:9.0f} tok/s   ratio {tp / tt:.2f}x of 1 rank (floor 0.8x)")

#!/usr/bin/python3
"""Writes tests/data/gpt_golden.bin: a tiny GPT in PyTorch (Debian's python3-torch) and what the
C++ trainer must reproduce from the same weights and batch: the logits and loss of one forward,
every gradient of one backward, and the losses and final weights of 10 AdamW steps with gradient
clipping.

    /usr/bin/python3 tools/trainer/make_golden.py [OUT]

The model is the one trainer/gpt.hpp describes, with the same parameter names and shapes: token and
position embeddings, pre-LayerNorm blocks (causal attention, tanh-GELU MLP), final LayerNorm, LM
head tied to the token embedding, mean cross-entropy. Weight decay applies to 2-D tensors only.

File format (little endian): b"TGLD", uint32 version 1, uint32 record count; then per record:
uint32 name length, the name, uint64 value count, float32 values.
"""
import math
import struct
import sys

import torch
import torch.nn.functional as F

V, T, L, NH, C, B = 32, 8, 2, 2, 16, 4
STEPS, LR, WD, BETAS, EPS, CLIP = 10, 1e-3, 0.1, (0.9, 0.95), 1e-8, 1.0


def names():
    out = [("wpe", (T, C)), ("wte", (V, C))]
    for l in range(L):
        h = f"h.{l}."
        out += [(h + "ln1.weight", (C,)), (h + "ln1.bias", (C,)), (h + "attn.proj.bias", (C,)),
                (h + "ln2.weight", (C,)), (h + "ln2.bias", (C,)), (h + "mlp.proj.bias", (C,)),
                (h + "attn.qkv.weight", (3 * C, C)), (h + "attn.qkv.bias", (3 * C,)),
                (h + "attn.proj.weight", (C, C)), (h + "mlp.fc.weight", (4 * C, C)),
                (h + "mlp.fc.bias", (4 * C,)), (h + "mlp.proj.weight", (C, 4 * C))]
    return out + [("lnf.weight", (C,)), ("lnf.bias", (C,))]


def init():
    g = torch.Generator().manual_seed(1234)
    p = {}
    for name, shape in names():
        if name.endswith("ln1.weight") or name.endswith("ln2.weight") or name == "lnf.weight":
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)  # not 1: the test sees LayerNorm's scale
        elif len(shape) == 2:
            t = 0.02 * torch.randn(shape, generator=g)
        else:
            t = 0.05 * torch.randn(shape, generator=g)  # biases not 0, so their gradients matter
        p[name] = t.float().requires_grad_(True)
    return p


def forward(p, idx, targets):
    hs = C // NH
    x = p["wte"][idx] + p["wpe"][:T]
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
    for l in range(L):
        h = f"h.{l}."
        a = F.layer_norm(x, (C,), p[h + "ln1.weight"], p[h + "ln1.bias"], eps=1e-5)
        qkv = a @ p[h + "attn.qkv.weight"].t() + p[h + "attn.qkv.bias"]
        q, k, v = qkv.split(C, dim=-1)
        q, k, v = (t.view(B, T, NH, hs).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hs)
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        x = x + y @ p[h + "attn.proj.weight"].t() + p[h + "attn.proj.bias"]
        m = F.layer_norm(x, (C,), p[h + "ln2.weight"], p[h + "ln2.bias"], eps=1e-5)
        m = F.gelu(m @ p[h + "mlp.fc.weight"].t() + p[h + "mlp.fc.bias"], approximate="tanh")
        x = x + m @ p[h + "mlp.proj.weight"].t() + p[h + "mlp.proj.bias"]
    x = F.layer_norm(x, (C,), p["lnf.weight"], p["lnf.bias"], eps=1e-5)
    logits = x @ p["wte"].t()
    return logits, F.cross_entropy(logits.view(-1, V), targets.reshape(-1))


def main():
    out_path = sys.argv[1] if len(sys.argv) > 1 else "tests/data/gpt_golden.bin"
    torch.manual_seed(0)
    seqs = torch.randint(0, V, (B, T + 1), generator=torch.Generator().manual_seed(99))
    idx, targets = seqs[:, :T], seqs[:, 1:]
    p = init()
    records = [("config", [V, T, L, NH, C, B, STEPS, LR, WD, BETAS[0], BETAS[1], EPS, CLIP]),
               ("tokens", seqs.flatten().tolist())]
    records += [("init." + n, p[n].detach().flatten().tolist()) for n, _ in names()]
    logits, loss = forward(p, idx, targets)
    loss.backward()
    first_loss = loss.item()
    records += [("logits", logits.detach().flatten().tolist()), ("loss", [first_loss])]
    records += [("grad." + n, p[n].grad.flatten().tolist()) for n, _ in names()]

    decay = [p[n] for n, s in names() if len(s) == 2]
    no_decay = [p[n] for n, s in names() if len(s) != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=BETAS, eps=EPS)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        _, loss = forward(p, idx, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(p.values()), CLIP)
        opt.step()
        losses.append(loss.item())
    records += [("losses", losses)]
    records += [("final." + n, p[n].detach().flatten().tolist()) for n, _ in names()]

    with open(out_path, "wb") as f:
        f.write(b"TGLD" + struct.pack("<II", 1, len(records)))
        for name, values in records:
            f.write(struct.pack("<I", len(name)) + name.encode() + struct.pack("<Q", len(values)))
            f.write(struct.pack(f"<{len(values)}f", *values))
    print(f"wrote {out_path}: {len(records)} records; loss {first_loss:.6f}, "
          f"losses {losses[0]:.6f} -> {losses[-1]:.6f}")


if __name__ == "__main__":
    main()

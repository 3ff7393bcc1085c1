"""Greedy decoding of a tiny random-weight decoder with a paged KV cache (vLLM-style block tables).

Each layer keeps one shared pool of pages per K and V; every sequence owns pages listed in its row
of the block table, allocated from a shuffled free list as it grows. Every step appends the new
token's (rotated) keys and values in place and attends through `flash_attn_with_kvcache(...,
block_table=...)`; the prompt's cache is filled the same way. The tokens are checked against
recomputing the whole prefix with `flash_attn_func` at every step.

    python benchmarks/example_paged_decode.py [--device cpu|mps] [--steps N]
"""

from __future__ import annotations

import argparse

import torch

from flashattn_mps import flash_attn_func, flash_attn_with_kvcache, mps_probe

VOCAB, DIM, HEADS, KV_HEADS, LAYERS, PAGE = 96, 64, 4, 2, 2, 8
HEAD_DIM = DIM // HEADS


class TinyDecoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(DIM, (HEADS + 2 * KV_HEADS) * HEAD_DIM) for _ in range(LAYERS))
        self.proj = torch.nn.ModuleList(torch.nn.Linear(HEADS * HEAD_DIM, DIM) for _ in range(LAYERS))
        self.head = torch.nn.Linear(DIM, VOCAB)

    def split(self, layer, x):
        q, k, v = self.qkv[layer](x).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
        return (
            q.unflatten(-1, (HEADS, HEAD_DIM)),
            k.unflatten(-1, (KV_HEADS, HEAD_DIM)),
            v.unflatten(-1, (KV_HEADS, HEAD_DIM)),
        )


def rotary_tables(positions, device):
    angles = torch.arange(positions, device=device)[:, None] / 10000 ** (
        torch.arange(0, HEAD_DIM, 2, device=device) / HEAD_DIM
    )
    return angles.cos(), angles.sin()


def rotate(x, cos, sin, start):  # GPT-NeoX layout, as rotary_interleaved=False
    half = HEAD_DIM // 2
    c, s = cos[start : start + x.shape[1]][None, :, None], sin[start : start + x.shape[1]][None, :, None]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], -1)


@torch.no_grad()
def full_recompute(model, tokens, cos, sin):
    x = model.embed(tokens)
    for layer in range(LAYERS):
        q, k, v = model.split(layer, x)
        out = flash_attn_func(rotate(q, cos, sin, 0), rotate(k, cos, sin, 0), v, causal=True)
        x = x + model.proj[layer](out.flatten(-2))
    return model.head(x[:, -1]).argmax(-1)


@torch.no_grad()
def paged_decode(model, prompt, steps, cos, sin, device, generator):
    batch, pages_per_sequence = prompt.shape[0], -(-(prompt.shape[1] + steps) // PAGE)
    pool = batch * pages_per_sequence + 4
    free = torch.randperm(pool, generator=generator).tolist()  # pages handed out in no particular order
    block_table = torch.tensor(
        [[free.pop() for _ in range(pages_per_sequence)] for _ in range(batch)], dtype=torch.int32, device=device
    )
    caches = [
        (
            torch.zeros(pool, PAGE, KV_HEADS, HEAD_DIM, device=device),
            torch.zeros(pool, PAGE, KV_HEADS, HEAD_DIM, device=device),
        )
        for _ in range(LAYERS)
    ]
    lengths = torch.zeros(batch, dtype=torch.int32, device=device)
    tokens, generated = prompt, []
    for _ in range(steps):
        x = model.embed(tokens)
        for layer, (k_cache, v_cache) in enumerate(caches):
            q, k, v = model.split(layer, x)
            out = flash_attn_with_kvcache(
                q,
                k_cache,
                v_cache,
                k,
                v,
                rotary_cos=cos,
                rotary_sin=sin,
                cache_seqlens=lengths,
                block_table=block_table,
                causal=True,
                rotary_interleaved=False,
            )
            x = x + model.proj[layer](out.flatten(-2))
        lengths += tokens.shape[1]
        tokens = model.head(x[:, -1]).argmax(-1, keepdim=True)
        generated.append(tokens)
    return torch.cat(generated, 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="mps" if mps_probe.usable() else "cpu")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = TinyDecoder().to(args.device).eval()
    prompt = torch.randint(0, VOCAB, (2, 11), device=args.device)
    cos, sin = rotary_tables(prompt.shape[1] + args.steps, args.device)
    generated = paged_decode(model, prompt, args.steps, cos, sin, args.device, torch.Generator().manual_seed(1))
    expected, tokens = [], prompt
    for _ in range(args.steps):
        tokens = torch.cat([tokens, full_recompute(model, tokens, cos, sin)[:, None]], 1)
    expected = tokens[:, prompt.shape[1] :]
    print("paged decode:", generated.tolist())
    print("recomputed:  ", expected.tolist())
    assert torch.equal(generated, expected), "paged decoding disagrees with recomputing the prefix"
    print("the paged cache decodes exactly the recomputed tokens")


if __name__ == "__main__":
    main()

"""The output error quantized K/V cost a Llama-like attention layer, per bits and group size.

    python benchmarks/quantization_error.py

A random-weight Llama-like layer (hidden 2048, 16 query heads on 4 kv heads of 128, transformers'
initialisation, rotary embedding on q and k), fed 1024 tokens of unit-normal hidden states: the
last 64 queries attend causally (bottom-right) to all 1024 keys, in float16. For each bits (8, 4)
and group size (32, 64, 128) the output over quantize_kv'd K and V is compared with the output
over the float16 K and V, both in float64 (the kernels compute the former within the project's
tolerance: tests/kernels/test_quantized.py): the error relative to the output's RMS, as RMS and
max. Random weights give keys without the outlier channels trained models have, so a second case
scales 4 of each head's 128 key channels by 20 (as measured in trained LLMs' keys): per-group
quantization along the head dim feels those most. The table in docs/quantization.md is this
script's output.
"""

from __future__ import annotations

import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding, apply_rotary_pos_emb

from flashattn_mps import quantize_kv


def layer_states(outlier_channels: bool):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=2048, num_attention_heads=16, num_key_value_heads=4, head_dim=128, max_position_embeddings=4096
    )
    attention = LlamaAttention(config, layer_idx=0)
    for proj in (attention.q_proj, attention.k_proj, attention.v_proj):
        torch.nn.init.normal_(proj.weight, std=config.initializer_range)
    x = torch.randn(1, 1024, config.hidden_size)
    positions = torch.arange(1024)[None]
    cos, sin = LlamaRotaryEmbedding(config)(x, positions)
    with torch.no_grad():
        q = attention.q_proj(x).unflatten(-1, (16, 128)).transpose(1, 2)
        k = attention.k_proj(x).unflatten(-1, (4, 128)).transpose(1, 2)
        v = attention.v_proj(x).unflatten(-1, (4, 128)).transpose(1, 2)
        if outlier_channels:
            k[..., [3, 40, 77, 101]] *= 20
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
    return q[:, :, -64:].half(), k.half(), v.half()


def attention64(q, k, v):
    k, v = (t.double().repeat_interleave(4, 1) for t in (k, v))
    scores = (q.double() @ k.transpose(-1, -2)) / 128**0.5
    l, s = q.shape[2], k.shape[2]
    visible = torch.arange(s)[None, :] <= torch.arange(l)[:, None] + (s - l)
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ v


def main():
    print("| keys | bits | group size | relative RMS error | relative max error |")
    print("|---|---|---|---|---|")
    for outliers in (False, True):
        q, k, v = layer_states(outliers)
        exact = attention64(q, k, v)
        rms = exact.pow(2).mean().sqrt()
        for bits in (8, 4):
            for group in (32, 64, 128):
                kq, vq = (quantize_kv(t, bits=bits, group_size=group).dequantize() for t in (k, v))
                error = attention64(q, kq, vq) - exact
                kind = "4 outlier channels x20" if outliers else "random weights"
                print(
                    f"| {kind} | {bits} | {group} | {(error.pow(2).mean().sqrt() / rms).item():.2e} | "
                    f"{(error.abs().max() / rms).item():.2e} |"
                )


if __name__ == "__main__":
    main()

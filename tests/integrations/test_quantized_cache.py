"""QuantizedKVCache with generate(): tiny random-weight Llama models (GQA and MHA) with the cache read
in place by the kernels, against the same model through torch's SDPA over a cache that dequantizes
first (the same storage policy), tokens and logits; the core's calls are counted to prove the
kernels read quantized K/V."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import max_error, needs_torch_2_6

needs_torch_2_6("transformers")  # before the imports: the tested releases need torch >= 2.6

import transformers  # noqa: E402

from flashattn_mps import _C  # noqa: E402
from flashattn_mps.integrations import transformers as fa_transformers  # noqa: E402
from flashattn_mps.integrations.transformers import QuantizedKVCache  # noqa: E402

NAME = fa_transformers.register(cpu=True)


@pytest.mark.parametrize("kv_heads, bits, residual", [(2, 8, 0), (4, 4, 3)])
def test_generate_matches_a_dequantizing_cache(kv_heads, bits, residual, monkeypatch):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
    )
    ours = transformers.LlamaForCausalLM(config).eval()
    reference = copy.deepcopy(ours)
    ours.set_attn_implementation(NAME)
    reference.set_attn_implementation("sdpa")
    input_ids = torch.randint(3, 64, (2, 9))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0  # left padding: the mask reaches the quantized rows too
    settings = dict(
        attention_mask=attention_mask,
        max_new_tokens=10,
        min_new_tokens=10,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    quantized_calls = []
    forward = _C.forward

    def counting(device, tensors, options, workspace=None):
        quantized_calls.append(tensors.get("k_scales") is not None and options[_C.OPTION_FIELDS.index("k_bits")] != 0)
        return forward(device, tensors, options, workspace)

    monkeypatch.setattr(_C, "forward", counting)
    with torch.no_grad():
        got = ours.generate(input_ids, past_key_values=QuantizedKVCache(bits, 32, residual), **settings)
        expected = reference.generate(
            input_ids, past_key_values=QuantizedKVCache(bits, 32, residual, dequantize=True), **settings
        )
    assert sum(quantized_calls) >= 2 * 9  # every layer's decode steps read the quantized store
    assert torch.equal(got.sequences, expected.sequences)
    for step, (logits, want) in enumerate(zip(got.logits, expected.logits)):
        assert max_error(logits, want.double()) < 1e-4, step


def test_layer_reorders_its_store_and_recent_rows_for_beam_search():
    layer = fa_transformers.QuantizedKVLayer(bits=8, group_size=32, residual_length=4)
    older, recent = torch.randn(2, 2, 5, 32), torch.randn(2, 2, 2, 32)
    layer.update(older, older)  # 5 rows >= 4: quantized into the store
    layer.update(recent, recent)  # 2 rows stay unquantized
    before_keys, _ = layer.update(recent[:, :, :0], recent[:, :, :0])
    layer.reorder_cache(torch.tensor([1, 0]))
    keys, values = layer.update(recent[:, :, :0], recent[:, :, :0])
    assert layer.get_seq_length() == 7 and keys.shape == (2, 2, 7, 32)
    assert torch.equal(keys.dequantize(), before_keys.dequantize().flip(0))
    assert torch.equal(values.recent, recent.flip(0))

"""Real models through flashattn_mps.integrations: tiny random-weight transformers and diffusers
models built from configs (nothing is downloaded), each compared with the library's own SDPA path
and a float64 copy, with the C core's calls counted to prove the kernels ran. CPU tensors run the
kernels on the CPU Metal device (cpu=True)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F

from helpers import max_error, needs_torch_2_6

needs_torch_2_6("transformers and diffusers")  # before the imports: the tested releases need torch >= 2.6

import diffusers  # noqa: E402
import transformers  # noqa: E402

from flashattn_mps.integrations import transformers as fa_transformers  # noqa: E402
from flashattn_mps.integrations.diffusers import MPSAttnProcessor, use_in  # noqa: E402

NAME = fa_transformers.register(cpu=True)
VOCAB = 64


def tiny_configs():
    small = dict(vocab_size=VOCAB, max_position_embeddings=64)
    decoder = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, **small)
    return {
        "llama_gqa": (transformers.LlamaForCausalLM, transformers.LlamaConfig(num_key_value_heads=2, **decoder)),
        "mistral_sliding_window": (
            transformers.MistralForCausalLM,
            transformers.MistralConfig(num_key_value_heads=2, sliding_window=4, **decoder),
        ),
        "gpt2": (
            transformers.GPT2LMHeadModel,
            transformers.GPT2Config(
                vocab_size=VOCAB,
                n_positions=64,
                n_embd=32,
                n_layer=2,
                n_head=4,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                bos_token_id=1,
                eos_token_id=2,
            ),
        ),
        "bart_encoder_decoder": (
            transformers.BartForConditionalGeneration,
            transformers.BartConfig(
                d_model=32,
                encoder_layers=2,
                decoder_layers=2,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=64,
                decoder_ffn_dim=64,
                dropout=0.0,
                attention_dropout=0.0,
                activation_dropout=0.0,
                **small,
            ),
        ),
        "bert_padding": (
            transformers.BertForMaskedLM,
            transformers.BertConfig(
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=64,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
                **small,
            ),
        ),
    }


def variant_configs():
    """Models whose attention SDPA cannot express, compared with transformers' "eager" attention:
    Gemma 2 (logit softcap; sliding and full layers) and GPT-OSS (sinks; sliding and full layers).
    Weights drawn wide enough (initializer_range) that the softcap bends the scores."""
    decoder = dict(
        vocab_size=VOCAB,
        max_position_embeddings=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        initializer_range=0.2,
        sliding_window=4,
        rope_parameters=dict(rope_type="default", rope_theta=1e4),
    )
    return {
        "gemma2_softcap": (
            transformers.Gemma2ForCausalLM,
            transformers.Gemma2Config(attn_logit_softcapping=2.0, query_pre_attn_scalar=8, **decoder),
        ),
        "gpt_oss_sinks": (
            transformers.GptOssForCausalLM,
            transformers.GptOssConfig(
                num_local_experts=4, num_experts_per_tok=2, experts_implementation="eager", **decoder
            ),
        ),
    }


CONFIGS = tiny_configs()
VARIANT_CONFIGS = variant_configs()
GENERATIVE = ["llama_gqa", "mistral_sliding_window", "gpt2", "bart_encoder_decoder"]


def models(name, reference_implementation="sdpa"):
    """(ours, reference float32, reference float64) with the same random weights: the reference is
    transformers' SDPA path, or its eager one for VARIANT_CONFIGS."""
    cls, config = {**CONFIGS, **VARIANT_CONFIGS}[name]
    torch.manual_seed(0)
    reference = cls(config).eval()
    reference.set_attn_implementation(reference_implementation)
    ours = copy.deepcopy(reference)
    ours.set_attn_implementation(NAME)
    return ours, reference, copy.deepcopy(reference).double()


def padded_batch(name, length=10):
    """Token ids (2, length) and a padding mask: row 1 padded (on the left for decoders, on the
    right for BERT and BART's encoder)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, length), generator=gen)
    mask = torch.ones(2, length, dtype=torch.long)
    if name in ("bert_padding", "bart_encoder_decoder"):
        mask[1, length - 4 :] = 0
    else:
        mask[1, :4] = 0
    inputs = dict(input_ids=ids, attention_mask=mask)
    if name == "bart_encoder_decoder":
        inputs["decoder_input_ids"] = ids[:, :6]
        return inputs, torch.ones(2, 6, dtype=torch.bool)
    return inputs, mask.bool()


def assert_close_to_golden(ours, reference, golden, what):
    """PyTorch's rule: error vs float64 <= max(1e-5, 5 x the float32 SDPA path's error)."""
    error, reference_error = max_error(ours, golden), max_error(reference, golden)
    assert error <= max(1e-5, 5 * reference_error), f"{what}: {error:.2e} vs sdpa's {reference_error:.2e}"


def no_fallback(caplog):
    assert "-> flashattn_mps kernels" in caplog.text and "-> torch's" not in caplog.text


def assert_training_step_matches(ours, reference, golden, inputs, valid, caplog, check_ours):
    """Logits at the valid positions and every parameter's gradient of a loss on them, in training
    mode (the configs have no dropout: the backward runs the kernels), against the float64 golden;
    check_ours(caplog) runs after our model's step."""
    results = []
    for model in (ours, reference, golden):
        model.train()
        model.zero_grad()
        with caplog.at_level(logging.DEBUG, logger="flashattn_mps"):
            logits = model(**inputs).logits
        logits[valid].square().mean().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results.append((logits.detach()[valid], grads))
        if model is ours:
            check_ours(caplog)
            caplog.clear()
    (logits, grads), (ref_logits, ref_grads), (gold_logits, gold_grads) = results
    assert_close_to_golden(logits, ref_logits, gold_logits, "logits")
    assert_close_to_golden(grads, ref_grads, gold_grads, "gradients")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_and_gradients_match_sdpa(name, core_calls, caplog):
    def check_ours(caplog):
        no_fallback(caplog)
        assert core_calls["forward"] > 0 and core_calls["backward"] == core_calls["forward"]
        assert core_calls["masked"] > 0  # the padding mask reached the kernels

    assert_training_step_matches(*models(name), *padded_batch(name), caplog, check_ours)


@pytest.mark.parametrize("name", GENERATIVE)
def test_greedy_generate_with_kv_cache_matches_sdpa(name, core_calls, caplog):
    ours, reference, _ = models(name)
    inputs, _ = padded_batch(name)
    inputs.pop("decoder_input_ids", None)
    settings = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, use_cache=True, pad_token_id=0)
    expected = reference.generate(**inputs, **settings)
    with caplog.at_level(logging.DEBUG, logger="flashattn_mps"):
        got = ours.generate(**inputs, **settings)
    no_fallback(caplog)
    assert torch.equal(got, expected)
    assert core_calls["forward"] >= 2 * 4  # 2 layers x (prefill + decode steps)


def test_cached_continuation_of_several_tokens(core_calls):
    """A KV cache continued by 3 tokens needs the bottom-right causal mask, which the registered
    mask function builds (attention_mask=None here cropped the keys)."""
    ours, reference, golden = models("llama_gqa")
    ids = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    logits = []
    for model in (ours, reference, golden):
        with torch.no_grad():
            cache = model(ids[:, :6], use_cache=True).past_key_values
            logits.append(model(ids[:, 6:], cache=cache, use_cache=True).logits)
    assert core_calls["masked"] >= 2  # the continuation's layers got the mask
    assert_close_to_golden(*logits, "continuation logits")


def test_unpadded_causal_calls_take_the_kernels_causal_path(core_calls):
    ours, reference, _ = models("llama_gqa")
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got, expected = ours(ids).logits, reference(ids).logits
    assert core_calls["forward"] == 2 and core_calls["masked"] == 0  # no L x S mask was built
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_from_pretrained_and_set_attn_implementation(tmp_path, core_calls):
    _, reference, _ = models("llama_gqa")
    reference.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=NAME)
    assert loaded.config._attn_implementation == NAME
    ids = torch.randint(3, VOCAB, (1, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-5)
    assert core_calls["forward"] == 2


def test_register_refuses_names_transformers_would_take_for_kernels():
    for name in ("flashattn_mps", "my/flash", "org/repo"):
        with pytest.raises(ValueError, match="flash-attn or Hub kernel"):
            fa_transformers.register(name)


class _Module(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 1


@pytest.mark.parametrize("name", sorted(VARIANT_CONFIGS))
def test_softcap_and_sinks_models_match_eager(name, core_calls, caplog):
    """Gemma 2 and GPT-OSS on the kernels (softcap, sinks and their sliding layers natively), padded
    batch, logits and every parameter's gradient (GPT-OSS's sinks included) against transformers'
    eager attention in float32 and float64."""
    ours, reference, golden = models(name, "eager")
    # Padding on the right, shorter than the window: transformers' eager attention in float64 turns a
    # row that sees only padding into NaN (its mask is finfo.min added to the scores) and spreads it.
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 8:] = 0

    def check_ours(caplog):
        assert "-> flashattn_mps kernels" in caplog.text and "materialised" not in caplog.text
        assert core_calls["forward"] == 2 and core_calls["backward"] == 2 and core_calls["masked"] == 2

    assert_training_step_matches(
        ours, reference, golden, dict(input_ids=ids, attention_mask=mask), mask.bool(), caplog, check_ours
    )
    if name == "gpt_oss_sinks":
        assert all(layer.self_attn.sinks.grad.abs().sum() > 0 for layer in ours.model.layers)


@pytest.mark.parametrize("name", ["gemma2_softcap", "gpt_oss_sinks", "mistral_sliding_window"])
def test_sliding_window_models_build_no_mask_without_padding(name, core_calls):
    """Unpadded prefill of 10 tokens with a window of 4: the kernels apply causal + window (and
    softcap, sinks) themselves: no L x S mask reaches them, and none is built (the mask function
    returns None)."""
    reference_implementation = "sdpa" if name in CONFIGS else "eager"
    ours, reference, golden = models(name, reference_implementation)
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(7))
    asked, real = [], fa_transformers.sdpa_mask

    def recording_sdpa_mask(**kwargs):  # what the registered mask function leaves to transformers
        mask = real(**kwargs)
        asked.append((kwargs["local_size"], mask))
        return mask

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fa_transformers, "sdpa_mask", recording_sdpa_mask)
        with torch.no_grad():
            logits = ours(ids).logits
    assert core_calls["forward"] == 2 and core_calls["masked"] == 0
    assert all(local_size is None and mask is None for local_size, mask in asked)  # the window never reached it
    with torch.no_grad():
        assert_close_to_golden(logits, reference(ids).logits, golden(ids).logits, "logits")


@pytest.mark.parametrize("name", sorted(VARIANT_CONFIGS))
@pytest.mark.parametrize("padded", [True, False])
def test_softcap_and_sinks_models_generate_like_eager(name, padded, core_calls):
    """Greedy decoding past the window with a KV cache: with padding through the masks, without it
    with no mask at all (decode steps take the window bottom-right, on the last key)."""
    ours, reference, _ = models(name, "eager")
    inputs, _ = padded_batch(name, length=6)
    if not padded:
        inputs = dict(input_ids=inputs["input_ids"][:1])
    settings = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)
    assert torch.equal(ours.generate(**inputs, **settings), reference.generate(**inputs, **settings))
    assert core_calls["forward"] == 2 * 6 and (core_calls["masked"] > 0) == padded


@pytest.mark.parametrize("q_length, causal", [(9, True), (1, True), (9, False), (1, False)])
def test_variants_where_the_kernels_do_not_take_the_call(q_length, causal, caplog):
    """CPU tensors without cpu=True: softcap, sinks and the window on materialised scores in torch,
    visibly, with the kernels' semantics (the kernels' own result with allow_cpu for comparison)."""
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 4, n, 8, generator=gen) for n in (q_length, 11, 11))
    k, v = k[:, :2], v[:, :2]
    module = _Module()
    module.is_causal = causal
    options = dict(sliding_window=3, softcap=1.5, s_aux=torch.tensor([0.5, -1.0, 2.0, 0.0]), scaling=0.9)
    with caplog.at_level(logging.DEBUG, logger="flashattn_mps"):
        fallback, _ = fa_transformers.attention_forward(module, q, k, v, None, **options)
    assert "materialised scores (torch)" in caplog.text
    kernels, _ = fa_transformers.attention_forward(module, q, k, v, None, allow_cpu=True, **options)
    golden, _ = fa_transformers.attention_forward(
        module, q.double(), k.double(), v.double(), None, **{**options, "s_aux": options["s_aux"].double()}
    )
    assert max_error(fallback, golden) < 1e-5 and max_error(kernels, golden) < 1e-5


@pytest.mark.parametrize("q_length, causal", [(10, True), (1, True), (10, False), (1, False)])
def test_sliding_window_without_a_mask(q_length, causal, core_calls):
    """Called without a mask (a module used on its own), sliding_window is still honoured, aligned
    as transformers' own sliding masks, by the kernels' band (no mask)."""
    from transformers.masking_utils import (
        sdpa_mask,
        sliding_window_bidirectional_mask_function,
        sliding_window_causal_mask_function,
    )

    gen = torch.Generator().manual_seed(5)
    kv_length, window = 10, 3
    q, k, v = (torch.randn(1, 2, n, 8, generator=gen) for n in (q_length, kv_length, kv_length))
    module = _Module()
    module.is_causal = causal
    out, _ = fa_transformers.attention_forward(module, q, k, v, None, sliding_window=window, allow_cpu=True)
    # transformers' flash-attention convention: window_size (window - 1, window - 1), the masks'
    # bidirectional window one less (ModernBERT passes its config's window + 1).
    function = (
        sliding_window_causal_mask_function(window)
        if causal
        else sliding_window_bidirectional_mask_function(window - 1)
    )
    mask = sdpa_mask(
        batch_size=1,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=kv_length - q_length,
        mask_function=function,
        allow_is_causal_skip=False,
    )
    golden = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask).transpose(1, 2)
    assert core_calls["forward"] == 1 and core_calls["masked"] == 0 and max_error(out, golden) < 1e-5


@pytest.mark.slow
def test_diffusers_unet_and_dit_match_sdpa_processor(core_calls, caplog):
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=8,
    ).eval()
    dit = diffusers.DiTTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        num_layers=2,
        sample_size=8,
        patch_size=2,
        num_embeds_ada_norm=10,
    ).eval()
    gen = torch.Generator().manual_seed(6)
    x, t, context = (
        torch.randn(2, 4, 8, 8, generator=gen),
        torch.tensor([10, 500]),
        torch.randn(2, 7, 32, generator=gen),
    )
    context_mask = torch.ones(2, 7, dtype=torch.bool)
    context_mask[1, 4:] = False  # padded text tokens: cross-attention masks
    runs = {
        "unet": (unet, lambda m: m(x.to(m.dtype), t, context.to(m.dtype), encoder_attention_mask=context_mask).sample),
        "dit": (dit, lambda m: m(x.to(m.dtype), timestep=t, class_labels=torch.tensor([1, 3])).sample),
    }
    for what, (model, run) in runs.items():
        ours = use_in(copy.deepcopy(model), cpu=True)
        processors = [
            m.processor for m in ours.modules() if isinstance(m, diffusers.models.attention_processor.Attention)
        ]
        assert processors and all(isinstance(p, MPSAttnProcessor) for p in processors)
        results = []
        for m in (ours, model, copy.deepcopy(model).double()):
            with caplog.at_level(logging.DEBUG, logger="flashattn_mps"):
                out = run(m)
            out.square().mean().backward()
            results.append((out.detach(), torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])))
            if m is ours:
                no_fallback(caplog)
                caplog.clear()
        (out, grads), (ref, ref_grads), (gold, gold_grads) = results
        assert_close_to_golden(out, ref, gold, f"{what} output")
        assert_close_to_golden(grads, ref_grads, gold_grads, f"{what} gradients")
    assert core_calls["forward"] > 0 and core_calls["backward"] > 0 and core_calls["masked"] > 0


@pytest.mark.slow
def test_compiled_model_fullgraph_dynamic(core_calls):
    from torch._dynamo.utils import counters

    ours, reference, _ = models("mistral_sliding_window")
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(ours, fullgraph=True, dynamic=True, backend="aot_eager")
    for length in (10, 13):  # one symbolic graph for both
        inputs, valid = padded_batch("mistral_sliding_window", length)
        with torch.no_grad():
            got, expected = compiled(**inputs).logits, reference(**inputs).logits
        torch.testing.assert_close(got[valid], expected[valid], rtol=1e-4, atol=1e-5)
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1
    assert core_calls["masked"] == 4  # 2 layers x 2 calls, padding and window masks inside the kernels


def test_training_dropout_runs_in_the_kernels(caplog):
    cls, config = CONFIGS["llama_gqa"]
    config = copy.deepcopy(config)
    config.attention_dropout = 0.5
    torch.manual_seed(0)
    model = cls(config).train()
    model.set_attn_implementation(NAME)
    with caplog.at_level(logging.DEBUG, logger="flashattn_mps"):
        model(torch.randint(3, VOCAB, (1, 6))).logits.sum().backward()
    assert "-> flashattn_mps kernels" in caplog.text and "dropout_p=0.5 (in the kernels)" in caplog.text
    assert "-> torch's" not in caplog.text


@pytest.mark.parametrize("name", ["gemma2_softcap", "gpt_oss_sinks"])
def test_packed_softcap_and_sinks_models_match_eager_per_sequence(name, core_calls):
    """Padding-free batches (position_ids restarting at 0) of Gemma 2 and GPT-OSS take the varlen
    kernels with their softcap, sinks and sliding layers (window 4, shorter than a sequence),
    forward and backward, matching eager attention on each sequence alone."""
    ours, reference, _ = models(name, "eager")
    lengths = [6, 1, 9]
    ids = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    logits = ours(torch.cat(ids)[None], position_ids=positions).logits[0]
    expected = torch.cat([reference(x[None]).logits[0] for x in ids])
    assert core_calls["forward"] == 2 and core_calls["masked"] == 0  # both layers, no mask built
    assert max_error(logits, expected) < 2e-4
    logits.square().mean().backward()
    torch.cat([reference(x[None]).logits[0] for x in ids]).square().mean().backward()
    assert core_calls["backward"] == 2
    ours_grads = dict(ours.named_parameters())
    for pname, p in reference.named_parameters():
        if p.grad is not None:
            assert max_error(ours_grads[pname].grad, p.grad) < 1e-4 * max(1.0, p.grad.abs().max().item()), pname


def test_modernbert_sliding_layers_run_without_a_mask(core_calls):
    """ModernBERT's bidirectional sliding layers (local_attention 4: keys at most 2 positions
    away; the module passes 3 as sliding_window) take the kernels' window with no L x S mask when
    nothing is padded, and match transformers' SDPA path (logits and gradients); with padding the
    mask is built as for "sdpa"."""
    config = transformers.ModernBertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        local_attention=4,
        global_attn_every_n_layers=3,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    reference = transformers.ModernBertModel(config).eval()
    reference.set_attn_implementation("sdpa")
    ours = copy.deepcopy(reference)
    ours.set_attn_implementation(NAME)
    ids = torch.randint(1, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))
    out = ours(ids).last_hidden_state
    assert core_calls["forward"] == 3 and core_calls["masked"] == 0
    expected = reference(ids).last_hidden_state
    assert max_error(out, expected) < 1e-5
    out.square().mean().backward()
    expected.square().mean().backward()
    theirs = dict(reference.named_parameters())
    for name, p in ours.named_parameters():
        if p.grad is not None:
            assert max_error(p.grad, theirs[name].grad) < 1e-5 * max(1.0, p.grad.abs().max().item()), name
    padded = torch.ones_like(ids)
    padded[1, 8:] = 0
    masked = core_calls["masked"]
    out = ours(ids, attention_mask=padded).last_hidden_state
    assert core_calls["masked"] > masked
    assert max_error(out, reference(ids, attention_mask=padded).last_hidden_state) < 1e-5

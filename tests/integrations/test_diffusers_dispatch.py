"""diffusers' dispatch-based transformers (Flux, SD3's joint attention, Wan, QwenImage,
HunyuanVideo and LTX, the last three with padded text masks) through use_in: tiny models built from configs, every attention call on the kernels
(the core's calls counted), outputs and every parameter's gradient against the model's native
backend (float64 golden; PyTorch's rule: error <= max(1e-5, 5 x the native same-dtype error)),
float32 and bfloat16; another model of the same class untouched; a model use_in cannot serve
refused before anything changes."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import max_error, needs_torch_2_6

needs_torch_2_6("diffusers")  # before the imports: the tested releases need torch >= 2.6

import diffusers  # noqa: E402

from flashattn_mps.integrations.diffusers import use_in  # noqa: E402


def _flux():
    model = diffusers.FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8],
    )
    gen = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(2, 16, 4, generator=gen),
        encoder_hidden_states=torch.randn(2, 7, 32, generator=gen),
        pooled_projections=torch.randn(2, 32, generator=gen),
        timestep=torch.tensor([0.3, 0.7]),
        img_ids=torch.randn(16, 3, generator=gen),
        txt_ids=torch.zeros(7, 3),
    )
    return model, inputs


def _sd3():
    model = diffusers.SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=32,
        caption_projection_dim=16,
        pooled_projection_dim=32,
        out_channels=4,
        pos_embed_max_size=8,
    )
    gen = torch.Generator().manual_seed(2)
    inputs = dict(
        hidden_states=torch.randn(2, 4, 8, 8, generator=gen),
        encoder_hidden_states=torch.randn(2, 5, 32, generator=gen),
        pooled_projections=torch.randn(2, 32, generator=gen),
        timestep=torch.tensor([10, 500]),
    )
    return model, inputs


def _wan():
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        rope_max_seq_len=32,
    )
    gen = torch.Generator().manual_seed(3)
    inputs = dict(
        hidden_states=torch.randn(2, 4, 2, 8, 8, generator=gen),
        timestep=torch.tensor([10, 500]),
        encoder_hidden_states=torch.randn(2, 6, 16, generator=gen),
    )
    return model, inputs


def _qwenimage():
    model = diffusers.QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=16,
        axes_dims_rope=(4, 6, 6),
    )
    gen = torch.Generator().manual_seed(4)
    text_mask = torch.ones(2, 7, dtype=torch.long)
    text_mask[1, 4:] = 0  # padded text tokens: the joint attention's mask
    inputs = dict(
        hidden_states=torch.randn(2, 16, 16, generator=gen),
        encoder_hidden_states=torch.randn(2, 7, 16, generator=gen),
        encoder_hidden_states_mask=text_mask,
        timestep=torch.tensor([0.3, 0.7]),
        img_shapes=[[(1, 4, 4)]] * 2,
    )
    return model, inputs


def _text_mask(dtype):
    mask = torch.ones(2, 6, dtype=dtype)
    mask[1, 3:] = 0
    return mask


def _hunyuan_video():
    model = diffusers.HunyuanVideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=1,
        num_single_layers=1,
        num_refiner_layers=1,
        patch_size=1,
        patch_size_t=1,
        text_embed_dim=16,
        pooled_projection_dim=8,
        rope_axes_dim=(2, 2, 4),
        guidance_embeds=False,
    )
    gen = torch.Generator().manual_seed(5)
    inputs = dict(
        hidden_states=torch.randn(2, 4, 1, 4, 4, generator=gen),
        timestep=torch.tensor([10, 500]),
        encoder_hidden_states=torch.randn(2, 6, 16, generator=gen),
        encoder_attention_mask=_text_mask(torch.bool),
        pooled_projections=torch.randn(2, 8, generator=gen),
    )
    return model, inputs


def _ltx():
    model = diffusers.LTXVideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        num_layers=1,
        caption_channels=16,
    )
    gen = torch.Generator().manual_seed(6)
    inputs = dict(
        hidden_states=torch.randn(2, 8, 4, generator=gen),
        encoder_hidden_states=torch.randn(2, 6, 16, generator=gen),
        timestep=torch.tensor([10, 500]),
        encoder_attention_mask=_text_mask(torch.long),
        num_frames=2,
        height=2,
        width=2,
    )
    return model, inputs


MODELS = {
    "flux": _flux,
    "sd3": _sd3,
    "wan": _wan,
    "qwenimage": _qwenimage,
    "hunyuan_video": _hunyuan_video,
    "ltx": _ltx,
}


def _run(model, inputs, dtype):
    model.zero_grad()
    cast = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}
    out = model(**cast).sample
    out.float().square().mean().backward()
    grads = torch.cat([p.grad.flatten().double() for p in model.parameters() if p.grad is not None])
    return out.detach().double(), grads


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dispatch_models_match_native(core_calls, name, dtype):
    torch.manual_seed(0)
    native, inputs = MODELS[name]()
    native = native.to(dtype)
    golden = copy.deepcopy(native).double()
    ours = use_in(copy.deepcopy(native), cpu=True)
    attention_modules = sum(hasattr(m, "processor") for m in ours.modules())
    out, grads = _run(ours, inputs, dtype)
    assert core_calls["forward"] == attention_modules and core_calls["backward"] == attention_modules
    ref, ref_grads = _run(native, inputs, dtype)
    assert core_calls["forward"] == attention_modules  # the native model did not reach the kernels
    gold, gold_grads = _run(golden, inputs, torch.float64)
    for what, got, reference, exact in (("output", out, ref, gold), ("gradients", grads, ref_grads, gold_grads)):
        error, reference_error = max_error(got, exact), max_error(reference, exact)
        assert error <= max(1e-5, 5 * reference_error), f"{name} {what}: {error:.2e} vs native {reference_error:.2e}"
    if name in ("qwenimage", "hunyuan_video", "ltx"):
        assert core_calls["masked"] > 0  # the text mask reached the kernels


def test_use_in_refuses_before_changing_anything():
    class ElsewhereProcessor:
        """Attention computed some other way: nothing use_in can route."""

        def __call__(self, attn, hidden_states, *args, **kwargs):
            return hidden_states

    model, _ = _flux()
    before = [m.processor for m in model.modules() if hasattr(m, "processor")]
    model.single_transformer_blocks[0].attn.set_processor(ElsewhereProcessor())
    before[-1] = model.single_transformer_blocks[0].attn.processor
    with pytest.raises(ValueError, match="single_transformer_blocks.0.attn .ElsewhereProcessor.: its __call__"):
        use_in(model)
    assert [m.processor for m in model.modules() if hasattr(m, "processor")] == before


def test_nothing_outside_the_model_changes_and_use_in_again_is_the_same(core_calls):
    from diffusers.models import attention_dispatch
    from diffusers.models.transformers import transformer_flux

    registry = attention_dispatch._AttentionBackendRegistry
    before = (
        transformer_flux.dispatch_attention_fn,
        attention_dispatch.dispatch_attention_fn,
        torch.nn.functional.scaled_dot_product_attention,
        registry._active_backend,
        dict(registry._backends),
    )
    model, inputs = _flux()
    processor_class = type(model.transformer_blocks[0].attn.processor)
    use_in(use_in(model), cpu=True)  # again, now for CPU tensors: the same served processors
    assert (
        transformer_flux.dispatch_attention_fn,
        attention_dispatch.dispatch_attention_fn,
        torch.nn.functional.scaled_dot_product_attention,
        registry._active_backend,
        dict(registry._backends),
    ) == before
    served = [m.processor for m in model.modules() if hasattr(m, "processor")]
    assert all(type(p).__bases__ == (processor_class,) and p.flashattn_mps_cpu for p in served)
    with torch.no_grad():
        model(**inputs)
    assert core_calls["forward"] == len(served)

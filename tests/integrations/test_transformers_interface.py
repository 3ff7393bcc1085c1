"""The transformers contract the integration mirrors: the parameters of transformers' own SDPA
attention function and SDPA mask builder, which ours stand in for. A transformers release that
renames, adds or drops one fails here, naming it and the version, before a model test fails less
clearly. (The model tests run on the installed transformers; `pip index versions transformers`
lists the newest release.)"""

from __future__ import annotations

import inspect

from helpers import needs_torch_2_6

needs_torch_2_6("transformers")  # before the imports: the tested releases need torch >= 2.6

import transformers  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.masking_utils import sdpa_mask  # noqa: E402

from flashattn_mps.integrations import transformers as fa_transformers  # noqa: E402


def _named(function) -> list:
    return [p.name for p in inspect.signature(function).parameters.values() if p.kind != p.VAR_KEYWORD]


def test_attention_function_takes_what_transformers_passes():
    theirs, ours = _named(sdpa_attention_forward), _named(fa_transformers.attention_forward)
    missing = [name for name in theirs if name not in ours]
    assert not missing, (
        f"transformers {transformers.__version__}'s sdpa_attention_forward takes {missing}, which "
        f"flashattn_mps's attention_forward ({ours}) does not"
    )
    # Models call the function with these positionally: (module, query, key, value, attention_mask).
    assert ours[:5] == theirs[:5], f"transformers {transformers.__version__}: positional parameters {theirs[:5]}"


def test_mask_function_takes_what_transformers_passes():
    theirs, ours = _named(sdpa_mask), _named(fa_transformers.attention_mask)
    # What ours reads by name (the rest travels on in **kwargs to transformers' own sdpa_mask).
    read = [
        "batch_size",
        "q_length",
        "kv_length",
        "q_offset",
        "kv_offset",
        "mask_function",
        "attention_mask",
        "local_size",
        "allow_is_causal_skip",
        "allow_is_bidirectional_skip",
        "device",
    ]
    missing = [name for name in read if name not in theirs]
    assert not missing, f"transformers {transformers.__version__}'s sdpa_mask no longer takes {missing}"
    assert ours[:9] == theirs[:9], (
        f"transformers {transformers.__version__}: sdpa_mask's leading parameters {theirs[:9]}"
    )

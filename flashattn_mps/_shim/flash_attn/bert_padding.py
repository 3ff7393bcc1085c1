"""flash-attn's flash_attn.bert_padding: moving between padded (batch, seqlen, ...) tensors and the
packed (total, ...) rows flash_attn_varlen_func takes, in torch ops (differentiable)."""

import torch


def index_first_axis(input, indices):
    """input[indices] along the first axis (rows of a (total, ...) tensor); gradients scatter back."""
    return input[indices]


def index_put_first_axis(values, indices, first_axis_dim):
    """A zero (first_axis_dim, ...) tensor with values written at rows `indices`."""
    output = values.new_zeros((first_axis_dim, *values.shape[1:]))
    return output.index_put((indices,), values)


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """hidden_states (batch, seqlen, ...) and attention_mask (batch, seqlen), nonzero for a valid
    token; unused_mask (batch, seqlen), nonzero for a token that is allocated but unused (kept in
    the packed rows, not counted as used). Returns (the selected rows (total, ...), their indices
    in the flattened (batch * seqlen) rows, cu_seqlens (batch + 1,) int32, the longest sequence
    (an int), the used tokens per sequence (batch,) int32)."""
    selected = attention_mask if unused_mask is None else attention_mask + unused_mask
    lengths = selected.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(selected.flatten(), as_tuple=False).flatten()
    longest = int(lengths.max()) if lengths.numel() else 0
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))
    rows = index_first_axis(hidden_states.reshape(-1, *hidden_states.shape[2:]), indices)
    return rows, indices, cu_seqlens, longest, used


def pad_input(hidden_states, indices, batch, seqlen):
    """The packed rows (total, ...) back at `indices` of a zero (batch, seqlen, ...) tensor."""
    output = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return output.reshape(batch, seqlen, *hidden_states.shape[1:])

"""Context-parallel attention over torch.distributed: a sequence sharded across processes (Macs).

Each rank holds a shard of the sequence dim of q, k and v, (B, H, L/P, E) or (H, L/P, E), and
`attention` returns this rank's rows of the attention over the whole sequence, differentiable in
q, k, v and sinks. Three methods, each as a pair of custom ops (forward with its log-sum-exp,
backward) with fake implementations, so `torch.compile(fullgraph=True)` traces a context-parallel
model:

- "allgather": K and V are gathered; each local chunk attends to the keys it can see with its
  diagonal moved to its global position (the core's diagonal offset, so causal, windows and ALiBi
  are exact); the backward gathers K and V again (only local shards are saved) and
  reduce-scatters dK, dV (float32) so each rank gets the sum of its rows.
- "ring": K/V blocks travel around the ring (batch_isend_irecv, the next block in flight while
  this one is computed); blocks merge by log-sum-exp in float32 (rows that see no key stay at
  -inf); sinks fold in once after the merge; the backward runs each block against the global out
  and lse, dK/dV accumulating in float32 as they travel back to their owner (float16 and bfloat16
  blocks run the backward in float32, so gradients round once, not once per block).
- "ulysses": all-to-all turns sequence shards into head shards over the whole sequence, one
  ordinary call runs, and all-to-all turns the result back; needs Hq % P == 0 and Hkv % P == 0.

Layouts: "zigzag" cuts the sequence into 2P chunks, rank r holding chunks r and 2P-1-r (causal
work balanced); "contiguous": rank r holds chunk r. `shard`, `unshard` and `positions` convert.

Gradients of replicated tensors (model weights, sinks) are partial per rank: each rank's backward
gives its rows' share. `all_reduce_gradients` sums them over the group; `average_loss` makes the
reported loss the group's mean while each rank's backward takes its share of it.

When the group's backend cannot take the tensors' device (gloo and MPS tensors: torch's
`Backend.backend_capability`), collectives go through CPU copies, blocking both ways.
"""

# No `from __future__ import annotations` here: torch 2.4's custom_op reads the ops' annotations as
# objects (it does not evaluate strings) and knows typing.List and typing.Tuple, not list and tuple.
import contextlib
import math
from typing import List, Optional, Tuple  # noqa: UP035

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ._core import backward_core, forward_core
from ._options import (
    AttentionOptions,
    check_alibi,
    check_causal_and_scale,
    check_sinks,
    check_softcap,
    check_window,
    given,
    scale_value,
)

METHODS = ("allgather", "ring", "ulysses")
LAYOUTS = ("zigzag", "contiguous")
_WHO = "flashattn_mps.distributed"


# ---------------------------------------------------------------------------------------------
# Groups, layouts and the collectives (staged through CPU when the backend cannot take the device)


def _group(group):
    return dist.group.WORLD if group is None else group


def _size_rank(group) -> tuple:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{_WHO}: torch.distributed is not initialized (call dist.init_process_group first)")
    group = _group(group)
    return dist.get_world_size(group), dist.get_rank(group)


def _check_layout(layout) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"{_WHO}: layout must be one of {LAYOUTS}, got {given(layout)}")


def _chunk_count(size: int, layout: str) -> int:
    return 2 * size if layout == "zigzag" else size


def _chunks_of(rank: int, size: int, layout: str) -> tuple:
    """The global chunk indices a rank holds, in its local order."""
    return (rank, 2 * size - 1 - rank) if layout == "zigzag" else (rank,)


def _check_length(length: int, size: int, layout: str, what: str) -> int:
    """The chunk length of a global sequence of `length`; raises when the chunks do not divide it."""
    chunks = _chunk_count(size, layout)
    if length % chunks:
        raise ValueError(
            f"{_WHO}: {what} {length} is not divisible by {chunks} ({layout} layout over a group of {size}"
            f"{', 2 chunks per rank' if layout == 'zigzag' else ''})"
        )
    return length // chunks


def _order(size: int, layout: str) -> list:
    """The global chunk index at each position of the ranks' shards concatenated in rank order."""
    return [c for r in range(size) for c in _chunks_of(r, size, layout)]


def _stages_through_cpu(t: torch.Tensor, group) -> bool:
    """Whether the group's backend cannot take t's device, so collectives use CPU copies."""
    if t.device.type == "cpu":
        return False
    backend = str(dist.get_backend(_group(group))).lower()
    devices = dist.Backend.backend_capability.get(backend, [])
    return t.device.type not in devices


def _to_wire(t: torch.Tensor, group) -> torch.Tensor:
    """t as the backend takes it: contiguous, on CPU when staged (a blocking copy)."""
    t = t.contiguous()
    return t.to("cpu") if _stages_through_cpu(t, group) else t


def _from_wire(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    # Blocking: a non-blocking CPU->MPS copy can read the CPU buffer after it is reused.
    return t if t.device == like.device else t.to(like.device, non_blocking=False)


def _all_gather(t: torch.Tensor, group) -> list:
    wire = _to_wire(t, group)
    parts = [torch.empty_like(wire) for _ in range(dist.get_world_size(_group(group)))]
    dist.all_gather(parts, wire, group=_group(group))
    return [_from_wire(p, t) for p in parts]


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    wire = _to_wire(t, group)
    wire = wire.clone() if wire is t else wire
    dist.all_reduce(wire, group=_group(group))
    return _from_wire(wire, t)


# torch 2.13 renamed reduce_scatter_tensor (now deprecated) to reduce_scatter_single.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _reduce_scatter(full: torch.Tensor, call) -> torch.Tensor:
    """full (B, H, L, D) in sequence order summed over the group; returns this rank's rows of the sum."""
    ordered = _scatter_order(full, 2, call.size, call.layout)
    b, h, length, d = ordered.shape
    parts = ordered.reshape(b, h, call.size, length // call.size, d).permute(2, 0, 1, 3, 4)
    # rank p's part first along dim 0, as reduce_scatter_tensor splits its input
    wire = _to_wire(parts.reshape(call.size * b, h, length // call.size, d), call.group)
    mine = torch.empty((b, h, length // call.size, d), dtype=wire.dtype, device=wire.device)
    _reduce_scatter_single(mine, wire, group=call.group)
    return _from_wire(mine, full)


def _all_to_all(parts: torch.Tensor, group) -> torch.Tensor:
    """parts (P, ...): part p goes to rank p; returns (P, ...) with part p from rank p."""
    wire = _to_wire(parts, group)
    received = torch.empty_like(wire)
    dist.all_to_all_single(received, wire, group=_group(group))
    return _from_wire(received, parts)


class _RingExchange:
    """Sends tensors to the next rank and receives as many from the previous one, started at once
    (batch_isend_irecv) and finished by wait(), so the caller computes meanwhile."""

    def __init__(self, tensors: list, group):
        group = _group(group)
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        following = dist.get_global_rank(group, (rank + 1) % size)
        preceding = dist.get_global_rank(group, (rank - 1) % size)
        self._like = tensors
        sent = [_to_wire(t, group) for t in tensors]
        self._received = [torch.empty_like(t) for t in sent]
        ops = [dist.P2POp(dist.isend, t, following, group) for t in sent]
        ops += [dist.P2POp(dist.irecv, t, preceding, group) for t in self._received]
        self._requests = dist.batch_isend_irecv(ops)
        self._sent = sent  # kept alive until the sends complete

    def wait(self) -> list:
        for request in self._requests:
            request.wait()
        return [_from_wire(t, like) for t, like in zip(self._received, self._like)]


def _check_same_everywhere(values: list, group, what: str) -> None:
    """Raises on every rank when some rank's values differ (one small all_gather), so a mismatch
    is an error, never a hang in a later collective."""
    mine = torch.tensor(values, dtype=torch.int64)
    rows = [p.tolist() for p in _all_gather(mine, group)]
    if any(row != rows[0] for row in rows):
        listed = "; ".join(f"rank {r}: {row}" for r, row in enumerate(rows))
        raise ValueError(f"{_WHO}: {what} differ across ranks ({listed})")


# ---------------------------------------------------------------------------------------------
# shard, unshard, positions


def _check_dim(x: torch.Tensor, dim: int) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{_WHO}: x must be a torch.Tensor, got {given(x)}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"{_WHO}: dim must be an int in [{-x.dim()}, {x.dim()}) for a {x.dim()}-D tensor, got {dim}")
    return dim % x.dim()


def shard(x: torch.Tensor, dim: int, group=None, layout: str = "zigzag") -> torch.Tensor:
    """This rank's part of the full tensor x along dim (a copy for zigzag, a view for contiguous)."""
    _check_layout(layout)
    dim = _check_dim(x, dim)
    size, rank = _size_rank(group)
    chunk = _check_length(x.shape[dim], size, layout, f"x's length along dim {dim},")
    parts = [x.narrow(dim, c * chunk, chunk) for c in _chunks_of(rank, size, layout)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _reorder(gathered: torch.Tensor, dim: int, size: int, layout: str) -> torch.Tensor:
    """The ranks' shards concatenated in rank order -> global order along dim."""
    if layout == "contiguous":
        return gathered
    chunk = gathered.shape[dim] // (2 * size)
    pieces = gathered.split(chunk, dim)
    position = {c: i for i, c in enumerate(_order(size, layout))}
    return torch.cat([pieces[position[c]] for c in range(2 * size)], dim)


def _scatter_order(full: torch.Tensor, dim: int, size: int, layout: str) -> torch.Tensor:
    """Global order -> the ranks' shards concatenated in rank order (the inverse of _reorder)."""
    if layout == "contiguous":
        return full
    chunk = full.shape[dim] // (2 * size)
    pieces = full.split(chunk, dim)
    return torch.cat([pieces[c] for c in _order(size, layout)], dim)


def unshard(x_local: torch.Tensor, dim: int, group=None, layout: str = "zigzag") -> torch.Tensor:
    """The full tensor along dim from every rank's part (an all_gather; shapes checked first)."""
    _check_layout(layout)
    dim = _check_dim(x_local, dim)
    size, _ = _size_rank(group)
    if layout == "zigzag" and x_local.shape[dim] % 2:
        raise ValueError(
            f"{_WHO}: a zigzag shard holds two equal chunks, got length {x_local.shape[dim]} along dim {dim}"
        )
    _check_same_everywhere([x_local.dim(), *x_local.shape], group, "unshard: the shapes of x_local")
    return _reorder(torch.cat(_all_gather(x_local, group), dim), dim, size, layout)


def positions(seq_len: int, group=None, layout: str = "zigzag", device=None) -> torch.Tensor:
    """The global positions (int64) of this rank's rows of a sequence of seq_len (position_ids)."""
    _check_layout(layout)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
        raise ValueError(f"{_WHO}: seq_len must be a non-negative int, got {given(seq_len)}")
    size, rank = _size_rank(group)
    chunk = _check_length(seq_len, size, layout, "seq_len")
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in _chunks_of(rank, size, layout)])


# ---------------------------------------------------------------------------------------------
# The blocks: one local chunk of queries against a run of keys, with its diagonal moved


def _block_options(base: AttentionOptions, causal: bool, window: tuple, offset: int) -> AttentionOptions:
    """base's options for query rows whose diagonal key (global position) is `offset` keys past the
    block's first key."""
    if not causal and window == (-1, -1) and base.alibi is None:
        return base._replace(causal=False, band=None)
    return base._replace(causal=causal, band=(0, window[0], window[1], offset))


def _visible(causal: bool, window: tuple, q_start: int, rows: int, k_start: int, keys: int) -> bool:
    """Whether any of rows [q_start, q_start + rows) sees any of keys [k_start, k_start + keys)."""
    left, right = window
    right = 0 if causal else right
    if right >= 0 and k_start > q_start + rows - 1 + right:
        return False
    return not (left >= 0 and k_start + keys - 1 < q_start - left)


class _Call:
    """One context-parallel call's geometry: the group, this rank's chunks and their global starts,
    the options."""

    def __init__(self, q, layout, group_name, causal, scale, window, softcap, alibi, sinks):
        self.group = _resolve_group(group_name)
        self.size, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.layout, self.causal, self.window = layout, causal, tuple(window)
        self.chunks = _chunks_of(self.rank, self.size, layout)
        self.chunk = q.shape[2] // len(self.chunks)
        self.seq_len = self.chunk * _chunk_count(self.size, layout)
        self.options = AttentionOptions(
            scale, causal, None, softcap, None if alibi is None else check_alibi(alibi, q), sinks
        )

    def starts(self) -> list:
        return [c * self.chunk for c in self.chunks]

    def rows(self, t: torch.Tensor, i: int) -> torch.Tensor:
        """Local chunk i of t along the sequence dim (2): a view."""
        return t.narrow(2, i * self.chunk, self.chunk)

    def starts_of(self, rank: int) -> list:
        return [c * self.chunk for c in _chunks_of(rank, self.size, self.layout)]


def _resolve_group(name: str):
    return dist.distributed_c10d._resolve_process_group(name)


def _group_name(group) -> str:
    return _group(group).group_name


# allgather -----------------------------------------------------------------------------------


def _allgather_forward(call: _Call, q, k, v):
    k_full = _reorder(torch.cat(_all_gather(k, call.group), 2), 2, call.size, call.layout)
    v_full = _reorder(torch.cat(_all_gather(v, call.group), 2), 2, call.size, call.layout)
    outs, lses = [], []
    for i, start in enumerate(call.starts()):
        end = start + call.chunk if call.causal else call.seq_len
        options = _block_options(call.options, call.causal, call.window, start)
        out, lse = forward_core(call.rows(q, i), k_full[:, :, :end], v_full[:, :, :end], None, options, True)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, 2), torch.cat(lses, 2)


def _allgather_backward(call: _Call, dout, q, k, v, out, lse):
    k_full = _reorder(torch.cat(_all_gather(k, call.group), 2), 2, call.size, call.layout)
    v_full = _reorder(torch.cat(_all_gather(v, call.group), 2), 2, call.size, call.layout)
    dk_full = torch.zeros(k_full.shape, dtype=torch.float32, device=k.device)
    dv_full = torch.zeros(v_full.shape, dtype=torch.float32, device=v.device)
    dqs, dsinks = [], None
    for i, start in enumerate(call.starts()):
        end = start + call.chunk if call.causal else call.seq_len
        options = _block_options(call.options, call.causal, call.window, start)
        grads = backward_core(
            call.rows(dout, i),
            call.rows(q, i),
            k_full[:, :, :end],
            v_full[:, :, :end],
            call.rows(out, i),
            call.rows(lse, i),
            None,
            options,
        )
        dqs.append(grads[0])
        dk_full[:, :, :end] += grads[1]
        dv_full[:, :, :end] += grads[2]
        if call.options.sinks is not None:
            dsinks = grads[3] if dsinks is None else dsinks + grads[3]
    dk, dv = _reduce_scatter(dk_full, call), _reduce_scatter(dv_full, call)
    return torch.cat(dqs, 2), dk.to(k.dtype), dv.to(v.dtype), dsinks


# ring ----------------------------------------------------------------------------------------


def _merge(out_acc, lse_acc, out, lse):
    """Two partial attentions of the same rows merged by log-sum-exp in float32; rows with no key in
    either stay at out 0, lse -inf."""
    total = torch.logaddexp(lse_acc, lse)
    finite = torch.where(torch.isneginf(total), torch.zeros_like(total), total)
    mine, theirs = torch.exp(lse_acc - finite), torch.exp(lse - finite)
    return out_acc * mine.unsqueeze(-1) + out.float() * theirs.unsqueeze(-1), total


def _fold_sinks(out, lse, sinks):
    """The sinks' logits joined to the merged softmax: lse' = log(exp(lse) + exp(sink))."""
    sink = sinks.view(1, -1, 1).expand_as(lse)
    total = torch.logaddexp(lse, sink)
    return out * torch.exp(lse - total).unsqueeze(-1), total


def _ring_forward(call: _Call, q, k, v):
    no_sinks = call.options._replace(sinks=None)
    n = len(call.chunks)
    shape = (*q.shape[:-1], v.shape[-1])
    out_acc = [torch.zeros((*shape[:2], call.chunk, shape[3]), dtype=torch.float32, device=q.device) for _ in range(n)]
    lse_acc = [torch.full(shape[:2] + (call.chunk,), -math.inf, device=q.device) for _ in range(n)]
    block_k, block_v = k, v
    for step in range(call.size):
        source = (call.rank - step) % call.size
        exchange = _RingExchange([block_k, block_v], call.group) if step < call.size - 1 else None
        for i, q_start in enumerate(call.starts()):
            for j, k_start in enumerate(call.starts_of(source)):
                if not _visible(call.causal, call.window, q_start, call.chunk, k_start, call.chunk):
                    continue
                options = _block_options(no_sinks, call.causal, call.window, q_start - k_start)
                out, lse = forward_core(
                    call.rows(q, i), call.rows(block_k, j), call.rows(block_v, j), None, options, True
                )
                out_acc[i], lse_acc[i] = _merge(out_acc[i], lse_acc[i], out, lse)
        if exchange is not None:
            block_k, block_v = exchange.wait()
    out, lse = torch.cat(out_acc, 2), torch.cat(lse_acc, 2)
    if call.options.sinks is not None:
        out, lse = _fold_sinks(out, lse, call.options.sinks)
    return out.to(q.dtype), lse


def _ring_backward(call: _Call, dout, q, k, v, out, lse):
    no_sinks = call.options._replace(sinks=None)
    n = len(call.chunks)
    # Half-precision blocks run in float32, so each gradient rounds once, not once per block.
    wide = torch.float32
    dout_w, q_w, out_w = dout.to(wide), q.to(wide), out.to(wide)
    dq = [torch.zeros(call.rows(q, i).shape, dtype=torch.float32, device=q.device) for i in range(n)]
    block_k, block_v = k, v
    block_dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    block_dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for step in range(call.size):
        source = (call.rank - step) % call.size
        exchange = _RingExchange([block_k, block_v], call.group) if step < call.size - 1 else None
        for i, q_start in enumerate(call.starts()):
            for j, k_start in enumerate(call.starts_of(source)):
                if not _visible(call.causal, call.window, q_start, call.chunk, k_start, call.chunk):
                    continue
                options = _block_options(no_sinks, call.causal, call.window, q_start - k_start)
                grads = backward_core(
                    call.rows(dout_w, i),
                    call.rows(q_w, i),
                    call.rows(block_k, j).to(wide),
                    call.rows(block_v, j).to(wide),
                    call.rows(out_w, i),
                    call.rows(lse, i),
                    None,
                    options,
                )
                dq[i] += grads[0]
                call.rows(block_dk, j).add_(grads[1])
                call.rows(block_dv, j).add_(grads[2])
        # dK and dV travel on with their block: after P moves they are back with its owner.
        if call.size > 1:
            block_dk, block_dv = _RingExchange([block_dk, block_dv], call.group).wait()
        if exchange is not None:
            block_k, block_v = exchange.wait()
    dsinks = None
    if call.options.sinks is not None:  # d lse_i / d sink = p_sink(i); out_i scales by -p_sink(i)
        delta = (dout.float() * out.float()).sum(-1)
        sink_prob = torch.exp(call.options.sinks.view(1, -1, 1) - lse)
        dsinks = -(sink_prob * delta).sum(dim=(0, 2))
    return torch.cat(dq, 2).to(q.dtype), block_dk.to(k.dtype), block_dv.to(v.dtype), dsinks


# ulysses -------------------------------------------------------------------------------------


def _heads_to_sequence(t: torch.Tensor, call: _Call) -> torch.Tensor:
    """(B, H, L/P, D) sequence shards -> (B, H/P, L, D): this rank's heads over the whole sequence."""
    b, h, rows, d = t.shape
    parts = t.reshape(b, call.size, h // call.size, rows, d).transpose(0, 1)
    received = _all_to_all(parts, call.group)  # (P source ranks, B, H/P, L/P, D)
    gathered = received.permute(1, 2, 0, 3, 4).reshape(b, h // call.size, call.size * rows, d)
    return _reorder(gathered, 2, call.size, call.layout)


def _sequence_to_heads(t: torch.Tensor, call: _Call) -> torch.Tensor:
    """The inverse of _heads_to_sequence: (B, H/P, L, D) -> (B, H, L/P, D)."""
    b, h_part, length, d = t.shape
    rows = length // call.size
    ordered = _scatter_order(t, 2, call.size, call.layout)
    parts = ordered.reshape(b, h_part, call.size, rows, d).permute(2, 0, 1, 3, 4)
    received = _all_to_all(parts, call.group)  # (P source ranks, B, H/P, L/P, D)
    return received.transpose(0, 1).reshape(b, call.size * h_part, rows, d)


def _head_slice(call: _Call, heads: int) -> slice:
    part = heads // call.size
    return slice(call.rank * part, (call.rank + 1) * part)


def _ulysses_options(call: _Call, heads: int) -> AttentionOptions:
    mine = _head_slice(call, heads)
    options = call.options
    alibi = None if options.alibi is None else options.alibi[:, mine]
    sinks = None if options.sinks is None else options.sinks[mine]
    band = None if call.window == (-1, -1) and alibi is None else (0, *call.window)
    return options._replace(band=band, alibi=alibi, sinks=sinks)


def _ulysses_forward(call: _Call, q, k, v):
    qh, kh, vh = (_heads_to_sequence(t, call) for t in (q, k, v))
    out, lse = forward_core(qh, kh, vh, None, _ulysses_options(call, q.shape[1]), True)
    lse = _sequence_to_heads(lse.unsqueeze(-1), call).squeeze(-1)
    return _sequence_to_heads(out, call), lse


def _ulysses_backward(call: _Call, dout, q, k, v, out, lse):
    qh, kh, vh, outh, douth = (_heads_to_sequence(t, call) for t in (q, k, v, out, dout))
    lseh = _heads_to_sequence(lse.unsqueeze(-1), call).squeeze(-1)
    options = _ulysses_options(call, q.shape[1])
    grads = backward_core(douth, qh, kh, vh, outh, lseh, None, options)
    dq, dk, dv = (_sequence_to_heads(g, call) for g in grads[:3])
    dsinks = None
    if options.sinks is not None:  # this rank's heads; the others' are theirs (summed by all-reduce)
        dsinks = torch.zeros(q.shape[1], dtype=torch.float32, device=q.device)
        dsinks[_head_slice(call, q.shape[1])] = grads[3]
    return dq, dk, dv, dsinks


_FORWARDS = {"allgather": _allgather_forward, "ring": _ring_forward, "ulysses": _ulysses_forward}
_BACKWARDS = {"allgather": _allgather_backward, "ring": _ring_backward, "ulysses": _ulysses_backward}


# ---------------------------------------------------------------------------------------------
# The ops


@torch.library.custom_op("flashattn_mps::context_parallel_forward", mutates_args=())
def context_parallel_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    alibi_slopes: Optional[torch.Tensor],
    sinks: Optional[torch.Tensor],
    method: str,
    layout: str,
    group_name: str,
    causal: bool,
    scale: float,
    window: List[int],  # noqa: UP006
    softcap: float,
) -> Tuple[torch.Tensor, torch.Tensor]:  # noqa: UP006
    """This rank's (out, float32 lse) of attention over the sequence sharded across the group."""
    call = _Call(q, layout, group_name, causal, scale, window, softcap, alibi_slopes, sinks)
    return _FORWARDS[method](call, q, k, v)


@context_parallel_forward.register_fake
def _(q, k, v, alibi_slopes, sinks, method, layout, group_name, causal, scale, window, softcap):
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("flashattn_mps::context_parallel_backward", mutates_args=())
def context_parallel_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    alibi_slopes: Optional[torch.Tensor],
    sinks: Optional[torch.Tensor],
    method: str,
    layout: str,
    group_name: str,
    causal: bool,
    scale: float,
    window: List[int],  # noqa: UP006
    softcap: float,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # noqa: UP006
    """(dq, dk, dv, dsinks) of context_parallel_forward's call; dsinks is this rank's partial sum
    (empty without sinks)."""
    call = _Call(q, layout, group_name, causal, scale, window, softcap, alibi_slopes, sinks)
    dq, dk, dv, dsinks = _BACKWARDS[method](call, dout.contiguous(), q, k, v, out, lse)
    return dq, dk, dv, (q.new_empty((0,), dtype=torch.float32) if dsinks is None else dsinks)


@context_parallel_backward.register_fake
def _(dout, q, k, v, out, lse, alibi_slopes, sinks, method, layout, group_name, causal, scale, window, softcap):
    dsinks = q.new_empty((0,), dtype=torch.float32) if sinks is None else q.new_empty(sinks.shape, dtype=torch.float32)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, alibi, sinks, *arguments = inputs
    ctx.save_for_backward(q, k, v, *output, alibi, sinks)
    ctx.arguments = arguments
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, dout, _dlse):
    if torch.is_grad_enabled():
        raise RuntimeError(f"{_WHO}: double backward is not supported (create_graph=True)")
    q, k, v, out, lse, alibi, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = context_parallel_backward(dout, q, k, v, out, lse, alibi, sinks, *ctx.arguments)
    return dq, dk, dv, None, (None if sinks is None else dsinks), None, None, None, None, None, None, None


context_parallel_forward.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------
# The public function


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    group=None,
    method: str = "allgather",
    layout: str = "zigzag",
    scale: Optional[float] = None,
    window_size=(-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
    return_lse: bool = False,
):
    """Attention over a sequence sharded across `group` (default: the world): q (B, Hq, L/P, E),
    k (B, Hkv, L/P, E), v (B, Hkv, L/P, Ev) (or 3-D without B) are this rank's shards in `layout`;
    returns this rank's rows of SDPA's result over the whole sequence (causal: SDPA's top-left over
    global positions), and with return_lse also their float32 log-sum-exp (B, Hq, L/P).
    window_size, softcap, alibi_slopes ((Hq,) or (B, Hq) float32) and sinks ((Hq,)) are
    flash_attention's, on global positions. Differentiable in q, k, v and sinks (the sinks'
    gradient is this rank's share: see all_reduce_gradients)."""
    if method not in METHODS:
        raise ValueError(f"{_WHO}: method must be one of {METHODS}, got {given(method)}")
    _check_layout(layout)
    size, _ = _size_rank(group)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{_WHO}: {name} must be a torch.Tensor, got {given(t)}")
    if not q.dim() == k.dim() == v.dim() or q.dim() not in (3, 4):
        raise ValueError(
            f"{_WHO}: q, k, v must all be 4-D (B, H, L/P, E) or all 3-D (H, L/P, E), got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    scale = scale_value(q.shape[-1], check_causal_and_scale(causal, scale))
    window = check_window(window_size, _WHO)
    softcap = check_softcap(softcap, _WHO)
    unbatched = q.dim() == 3
    if unbatched:
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    if q.shape[2] != k.shape[2] or k.shape[2] != v.shape[2]:
        raise ValueError(
            f"{_WHO}: q, k and v shards must hold the same rows of the sequence, got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    _check_length(q.shape[2] * size, size, layout, "the sequence length")
    if method == "ulysses" and (q.shape[1] % size or k.shape[1] % size):
        raise ValueError(
            f"{_WHO}: method='ulysses' exchanges heads: Hq ({q.shape[1]}) and Hkv ({k.shape[1]}) must be "
            f"divisible by the group size {size}"
        )
    if alibi_slopes is not None:
        check_alibi(alibi_slopes, q)
    if sinks is not None:
        check_sinks(sinks, q, _WHO)
    if not torch.compiler.is_compiling():
        _check_same_everywhere(
            [*q.shape, *k.shape, *v.shape, METHODS.index(method), LAYOUTS.index(layout), int(causal), *window],
            group,
            "the shapes of q, k, v (B, H, L/P, D each) or the method, layout, causal, window_size",
        )
    sinks32 = None if sinks is None else (sinks if sinks.dtype == torch.float32 else sinks.float())
    out, lse = context_parallel_forward(
        q, k, v, alibi_slopes, sinks32, method, layout, _group_name(group), causal, scale, list(window), softcap
    )
    if unbatched:
        out, lse = out.squeeze(0), lse.squeeze(0)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# Training helpers, the SDPA drop-in, inference, torch's context_parallel


def all_reduce_gradients(parameters, group=None) -> None:
    """Sums the .grad of replicated tensors (a module's parameters, sinks) over the group in place:
    after a context-parallel backward each rank holds only its rows' share."""
    if isinstance(parameters, torch.nn.Module):
        parameters = parameters.parameters()
    for p in parameters:
        if p.grad is not None:
            p.grad.copy_(_all_reduce(p.grad, group))


def average_loss(loss: torch.Tensor, group=None) -> torch.Tensor:
    """The group's mean of each rank's loss as the value, while each rank's backward takes 1/P of its
    own loss (the ranks' shares then add up under all_reduce_gradients). For losses that are means
    over equally many tokens per rank; otherwise sum per rank and divide by the global count."""
    size, _ = _size_rank(group)
    mean = _all_reduce(loss.detach(), group) / size
    return loss / size + (mean - loss.detach() / size)


@contextlib.contextmanager
def patch(group=None, method: str = "allgather", layout: str = "zigzag"):
    """Within the block, torch.nn.functional.scaled_dot_product_attention runs `attention` on this
    rank's shards (q, k, v the shards of the sequence dim -2, in `layout`): causal or full
    attention, GQA, scale. attn_mask (other than None) and dropout raise: a model's mask must be
    SDPA's is_causal, as transformers gives for a causal model without padding."""
    if method not in METHODS:
        raise ValueError(f"{_WHO}: method must be one of {METHODS}, got {given(method)}")
    _check_layout(layout)
    original = F.scaled_dot_product_attention

    def context_parallel_sdpa(
        query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
    ):
        if attn_mask is not None:
            raise ValueError(
                f"{_WHO}.patch: attn_mask {tuple(attn_mask.shape)} given; context-parallel attention takes "
                "is_causal or no mask (pass no attention_mask / padding to the model)"
            )
        if dropout_p != 0.0:
            raise ValueError(f"{_WHO}.patch: dropout_p must be 0 in context-parallel attention, got {dropout_p}")
        if query.shape[-3] != key.shape[-3] and not enable_gqa:
            raise ValueError(
                f"{_WHO}.patch: {query.shape[-3]} query heads on {key.shape[-3]} key heads need enable_gqa"
            )
        return attention(
            query, key, value, causal=bool(is_causal), group=group, method=method, layout=layout, scale=scale
        )

    F.scaled_dot_product_attention = context_parallel_sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def merge_attention(outs, lses):
    """Merges partial attentions of the same query rows over disjoint keys (a KV cache sharded
    across ranks): outs (each (..., H, D) or (..., H, L, D) alike), lses their float32 log-sum-exp
    (the out's shape without D). flash-attn's +inf lse of a row with no key is read as -inf. Returns
    (out in the first out's dtype, lse)."""
    out_acc = torch.zeros(outs[0].shape, dtype=torch.float32, device=outs[0].device)
    lse_acc = torch.full(lses[0].shape, -math.inf, device=lses[0].device)
    for out, lse in zip(outs, lses):
        out_acc, lse_acc = _merge(out_acc, lse_acc, out, lse.float().masked_fill(torch.isposinf(lse), -math.inf))
    return out_acc.to(outs[0].dtype), lse_acc


def kvcache_attention(q, k_cache_local, v_cache_local, cache_seqlens=None, group=None, **kwargs):
    """Decoding against a KV cache sharded across the group: each rank attends to its part with
    flash_attn_with_kvcache(..., return_softmax_lse=True) (kwargs pass through: softmax_scale,
    window_size (in the rank's own key positions), softcap, ...; not causal: a decoded token sees
    every cached key); the parts are gathered and merged by log-sum-exp. q (B, Lq, H, D) is the
    same on every rank. Returns (out (B, Lq, H, Dv), lse (B, H, Lq))."""
    from ._kvcache import flash_attn_with_kvcache

    if kwargs.get("causal"):
        raise ValueError(f"{_WHO}: kvcache_attention attends to every cached key; causal=True is not supported")
    out, lse = flash_attn_with_kvcache(
        q, k_cache_local, v_cache_local, cache_seqlens=cache_seqlens, return_softmax_lse=True, **kwargs
    )
    merged, merged_lse = merge_attention([o.transpose(1, 2) for o in _all_gather(out, group)], _all_gather(lse, group))
    return merged.transpose(1, 2), merged_lse


def register_torch_provider() -> None:
    """Would route torch's own context_parallel through these kernels; torch has no hook for it."""
    raise NotImplementedError(
        f"{_WHO}.register_torch_provider: torch {torch.__version__} has no hook for another attention "
        "implementation in context_parallel: torch.distributed.tensor.experimental._context_parallel "
        "dispatches only aten._scaled_dot_product_flash_attention, _efficient_attention and "
        "_cudnn_attention (the CUDA kernels; CPU and MPS SDPA use other aten ops) through a private "
        "table, and its collectives need a DeviceMesh backend that takes the tensors' device (none "
        "takes MPS). Use flashattn_mps.distributed.patch() or attention() instead."
    )

"""Attention that keeps the conversations of a pack apart.

A pack holds several conversations in one row:

    tokens      a0 a1 a2 b0 b1 c0 c1 c2 c3
    position    0  1  2  0  1  0  1  2  3
    cu_seqlens  [0, 3, 5, 9]

Token b1 may attend to b0 and itself, never to a0..a2: the mask is block-diagonal and causal inside
each block. Position ids that restart per conversation give each block the right rotary phases but
do not by themselves restrict attention, so the boundaries are passed explicitly, as the forward
kwargs `cu_seq_lens_q/k` (int32 cumulative lengths over the flattened [batch * seq] tokens) and
`max_length_q/k` (the longest conversation), which `transformers` hands down to the attention
function of every layer (`packed_attention_kwargs` builds them; beside them the loss head passes
`conversations_mask`, which spares `transformers` building a mask of its own).

`register_packed_attention()` makes the function available as `attn_implementation="ligertune_packed"`:

- with those kwargs and conversations all of one length (fixed-length rows, `bench step`'s
  synthetic batch): SDPA, causal, over the tokens cut into those rows, the layout for which SDPA
  has its fastest kernels (cuDNN's on Hopper, with grouped key/value heads in place);
- with those kwargs otherwise, on CUDA in fp16/bf16: `torch.nn.attention.varlen.varlen_attn`,
  FlashAttention's variable-length kernel inside PyTorch, which never forms the mask at all (where
  this torch's `varlen_attn` cannot take grouped key/value heads, the same kernel through aten's op,
  `_GroupedFlashVarlen`, rather than the heads repeated);
- with those kwargs where varlen cannot run (CPU, fp32, softcapped logits, attention dropout, no
  varlen_attn): `scaled_dot_product_attention` with the block-diagonal causal mask built from
  cu_seqlens;
- without them, with a padding mask or a KV cache (`generate()`): exactly `transformers`' sdpa
  attention with the mask the model built;
- without them and without any mask: conversations are split where the position ids do not go up
  by one (the rule `transformers` itself uses to detect packed rows), else plain causal attention.

Sliding-window layers (Mistral, Qwen2, Gemma 2/3) keep their window inside each conversation.

Preference packs (`ligertune.data.preference`) need more than blocks on the diagonal: a pair's
rejected answer attends to the prompt's rows and its own, not to the chosen answer between them.
Their kwargs (`preference_attention_kwargs`) add `key_index`, and the query and key boundaries
differ: segment s has the query rows `cu_seq_lens_q[s]:cu_seq_lens_q[s+1]` and the key rows
`key_index[cu_seq_lens_k[s]:cu_seq_lens_k[s+1]]`, causal aligned to the end (query j of a segment of
q queries and k keys sees keys 0 .. k - q + j, FlashAttention's convention):

    rows        p0 p1 p2 c0 c1 c2 r0 r1          positions 0 1 2 3 4 5 3 4
    segments    q: p0..c2               r0..r1
                k: p0 p1 p2 c0 c1 c2    p0..p2 r0..r1
    key_index   [0 1 2 3 4 5  0 1 2 6 7]

The function gathers the key and value rows by `key_index`, then runs the varlen kernel with the two
sets of boundaries (CUDA, half precision, where torch's `varlen_attn` runs FlashAttention, whose
causal mask is aligned to the end) or SDPA with the dense mask of queries x gathered keys
(`end_aligned_causal_mask`) everywhere else. A batch without `key_index` takes the paths above.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ligertune.devices import to_device

PACKED_ATTENTION = "ligertune_packed"
"""The `attn_implementation` name under which `register_packed_attention` installs this module."""

_VARLEN_DTYPES = (torch.float16, torch.bfloat16)
_VARLEN_MAX_HEAD_DIM = 256


def register_packed_attention() -> str:
    """Register the packed attention and its mask function with `transformers`; return the name.

    Both registries are `transformers`' own process-wide tables; registering again is harmless.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
    AttentionMaskInterface.register(PACKED_ATTENTION, packed_attention_mask)
    return PACKED_ATTENTION


# --------------------------------------------------------------------------------------------------
# The kwargs of a packed batch


def conversations_mask(device: torch.device | str) -> torch.Tensor:
    """The `attention_mask` to pass beside `packed_attention_kwargs`: a 4-D mask of no elements.

    `transformers` hands a 4-D mask to the attention function as it is, so with this one the model
    builds no mask and does not search the position ids for packed rows (its
    `find_packed_sequence_indices` ends in a device sync, which at every forward stalls the host
    until the previous micro-batch's work is done: 9% of `bench step`'s chat pass for a 1B model on
    an H100).
    `packed_attention_forward` reads it as no mask: cu_seqlens say where conversations end.
    """
    return torch.empty((0, 0, 0, 0), dtype=torch.bool, device=device)


def packed_attention_kwargs(
    cu_seqlens: torch.Tensor | Sequence[int],
    max_seqlen: int | None = None,
    *,
    total_tokens: int | None = None,
    device: torch.device | str | None = None,
) -> dict[str, Any]:
    """The forward kwargs that make a model with packed attention keep conversations apart.

    `cu_seqlens` are the cumulative conversation lengths over the flattened [batch * seq] tokens,
    starting at 0. When `total_tokens` is given and the last boundary falls short of it, the tokens
    left over (padding at the end) become one more segment of their own: a token outside every
    segment would get no attention output at all from the varlen kernel. The boundaries are checked
    and the longest segment found on the host: boundaries given as a list or a CPU tensor (as
    `collate` keeps them) cost no device synchronization, and are copied to `device` without
    waiting; boundaries already on a GPU are read back once. `max_seqlen`, when given, must cover
    the longest segment.
    """
    on_host = not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.device.type == "cpu"
    cu = torch.as_tensor(cu_seqlens).to(dtype=torch.int32)
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries; got shape {tuple(cu.shape)}")
    lengths = cu[1:] - cu[:-1]
    first, last, shortest, longest = torch.stack([cu[0], cu[-1], lengths.min(), lengths.max()]).tolist()
    if first != 0 or shortest < 0:
        raise ValueError(f"cu_seqlens must start at 0 and never decrease; got {cu.tolist()}")
    if total_tokens is not None:
        if last > total_tokens:
            raise ValueError(f"cu_seqlens ends at {last}, past the {total_tokens} tokens of the batch")
        if last < total_tokens:
            cu = torch.cat([cu, cu.new_tensor([total_tokens])])
            longest = max(longest, total_tokens - last)
    if max_seqlen is not None:
        if int(max_seqlen) < longest:
            raise ValueError(f"max_seqlen={int(max_seqlen)} is shorter than the longest segment ({longest})")
        longest = int(max_seqlen)
    if device is not None:
        cu = to_device(cu, device) if on_host else cu.to(device)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def preference_attention_kwargs(
    cu_seqlens_q: torch.Tensor | Sequence[int],
    cu_seqlens_k: torch.Tensor | Sequence[int],
    key_index: torch.Tensor | Sequence[int],
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    total_tokens: int,
    device: torch.device | str | None = None,
) -> dict[str, Any]:
    """The forward kwargs of a batch whose segments have their own key rows (preference packs).

    Segment s has the query rows `cu_seqlens_q[s]:cu_seqlens_q[s+1]` of the flattened batch and the
    key rows `key_index[cu_seqlens_k[s]:cu_seqlens_k[s+1]]`, causal aligned to the end (the module
    docstring draws a pair). Every row of the batch is a query of exactly one segment
    (`cu_seqlens_q` runs from 0 to `total_tokens`) and a segment has at least as many keys as
    queries, so every query sees at least one key. Checked on the host, as in
    `packed_attention_kwargs` (keep the boundaries on the host: `PreferenceBatch.to` does), then
    copied to `device` without waiting.
    """
    on_host = all(not isinstance(t, torch.Tensor) or t.device.type == "cpu"
                  for t in (cu_seqlens_q, cu_seqlens_k, key_index))
    cu_q = torch.as_tensor(cu_seqlens_q).to(dtype=torch.int32)
    cu_k = torch.as_tensor(cu_seqlens_k).to(dtype=torch.int32)
    index = torch.as_tensor(key_index).to(dtype=torch.int64)
    if cu_q.dim() != 1 or cu_q.numel() < 2 or cu_k.shape != cu_q.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must be 1-D, of the same length (at least 2); got "
                         f"shapes {tuple(cu_q.shape)} and {tuple(cu_k.shape)}")
    if index.dim() != 1:
        raise ValueError(f"key_index must be 1-D; got shape {tuple(index.shape)}")
    widths_q, widths_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    if int(cu_q[0]) != 0 or int(cu_k[0]) != 0 or int(widths_q.min()) < 0:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must start at 0 and never decrease")
    if int(cu_q[-1]) != total_tokens:
        raise ValueError(f"cu_seqlens_q ends at {int(cu_q[-1])}: every one of the {total_tokens} tokens "
                         "must be the query of a segment")
    if int(cu_k[-1]) != index.numel():
        raise ValueError(f"cu_seqlens_k ends at {int(cu_k[-1])}, key_index has {index.numel()} entries")
    if bool((widths_k < widths_q).any()):
        s = int((widths_k < widths_q).nonzero()[0])
        raise ValueError(f"segment {s} has {int(widths_q[s])} queries and only {int(widths_k[s])} keys")
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= total_tokens):
        raise ValueError(f"key_index must name rows 0 .. {total_tokens - 1}")
    longest_q, longest_k = int(widths_q.max()), int(widths_k.max())
    limits = ((max_seqlen_q, longest_q, "max_seqlen_q"), (max_seqlen_k, longest_k, "max_seqlen_k"))
    for given, longest, name in limits:
        if given is not None and int(given) < longest:
            raise ValueError(f"{name}={int(given)} is shorter than the longest segment ({longest})")
    longest_q = longest_q if max_seqlen_q is None else int(max_seqlen_q)
    longest_k = longest_k if max_seqlen_k is None else int(max_seqlen_k)
    if device is not None:
        move = (lambda t: to_device(t, device)) if on_host else (lambda t: t.to(device))
        cu_q, cu_k, index = move(cu_q), move(cu_k), move(index)
    return {"cu_seq_lens_q": cu_q, "cu_seq_lens_k": cu_k, "max_length_q": longest_q,
            "max_length_k": longest_k, "key_index": index}


# --------------------------------------------------------------------------------------------------
# The mask function


def packed_attention_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """The mask `transformers` builds once per forward for `packed_attention_forward`.

    A call without a padding mask and without cached tokens (training) gets no mask: the attention
    function draws the conversation boundaries itself, so no dense [batch, 1, seq, seq] mask is
    built only to be thrown away. Every other call (padding, `generate()` with a cache) gets
    `transformers`' sdpa mask, unchanged.
    """
    from transformers.masking_utils import sdpa_mask

    if kwargs.get("attention_mask") is None and _without_cached_tokens(kwargs):
        return None
    return sdpa_mask(*args, **kwargs)


def _without_cached_tokens(kwargs: dict[str, Any]) -> bool:
    """True when the keys are exactly the queries: no tokens from an earlier call are attended to."""
    kv_length, kv_offset = kwargs.get("kv_length"), kwargs.get("kv_offset", 0)
    if "q_length" in kwargs:
        q_length, q_offset = kwargs["q_length"], kwargs.get("q_offset", 0)
    elif "cache_position" in kwargs:  # the older signature of the mask functions
        q_length, q_offset = kwargs["cache_position"].shape[0], 0
    else:
        return False
    return (
        isinstance(q_offset, int) and q_offset == 0 and isinstance(kv_offset, int) and kv_offset == 0
        and kv_length == q_length
    )


# --------------------------------------------------------------------------------------------------
# The attention function


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention for `transformers` models: query [B, Hq, L, D], key/value [B, Hk, S, D] -> [B, L, Hq, D].

    See the module docstring for which path a call takes.
    """
    batch, _, q_len, head_dim = query.shape
    if attention_mask is not None and attention_mask.numel() == 0:
        attention_mask = None  # `conversations_mask`
    if scaling is None:
        scaling = head_dim**-0.5
    groups = query.shape[1] // key.shape[1]
    if attention_mask is not None or key.shape[2] != q_len:
        # A padding mask or cached keys: this is the model's own attention, unchanged.
        if softcap is None:
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            return sdpa_attention_forward(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                sliding_window=sliding_window, **kwargs,
            )
        return _masked_attention(query, key, value, attention_mask, scaling, dropout, softcap, groups), None

    if kwargs.get("key_index") is not None:
        args = (scaling, dropout, sliding_window, softcap, groups)
        return _gathered_attention(query, key, value, kwargs, *args), None
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is not None:
        max_len = kwargs.get("max_length_q")
        rows = equal_segments(cu_seqlens, max_len, batch * q_len)
        if rows and softcap is None and (sliding_window is None or sliding_window >= max_len):
            return _causal_rows(query, key, value, rows, scaling, dropout), None
        if _varlen_applies(query, dropout, softcap, sliding_window):
            out = _varlen_attention(query, key, value, cu_seqlens, max_len, scaling, sliding_window, groups)
            return out, None
        segments = segment_ids_from_cu_seqlens(cu_seqlens, batch, q_len)
    else:
        segments = segment_ids_from_position_ids(kwargs.get("position_ids"), batch, q_len)
    mask = block_causal_mask(segments, q_len, sliding_window, device=query.device)
    return _masked_attention(query, key, value, mask, scaling, dropout, softcap, groups), None


def equal_segments(cu_seqlens: torch.Tensor, max_len: int | None, total_tokens: int) -> int | None:
    """The number of segments when all of them have the same length, else None; never synchronizes.

    n segments of at most `max_len` tokens that add up to n * max_len tokens are all exactly
    max_len long, so the shapes alone decide (`max_len` is a host int, the longest segment).
    """
    if not isinstance(max_len, int) or max_len < 1:
        return None
    segments = cu_seqlens.numel() - 1
    return segments if segments * max_len == total_tokens else None


def _causal_rows(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: int, scaling: float, dropout: float
) -> torch.Tensor:
    """Causal SDPA with the flattened tokens cut into `rows` equal sequences: -> [B, L, Hq, D].

    This is the layout of plain [rows, len] batches, for which SDPA has its fastest kernels (cuDNN's
    on Hopper, with grouped key/value heads used in place). For the [B, L, H, D] memory that
    `transformers` hands over as [B, H, L, D], the split is a view.
    """
    batch, heads, seq_len, head_dim = query.shape

    def split(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2).reshape(rows, -1, x.shape[1], head_dim).transpose(1, 2)

    out = F.scaled_dot_product_attention(
        split(query), split(key), split(value), dropout_p=dropout, is_causal=True, scale=scaling,
        enable_gqa=key.shape[1] != heads,
    )
    return out.transpose(1, 2).reshape(batch, seq_len, heads, head_dim)


def segment_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, seq_len: int) -> torch.Tensor:
    """[batch, seq_len] conversation index of every token; tokens past the last boundary share one more."""
    flat = torch.arange(batch * seq_len, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), flat, right=True).view(batch, seq_len)


def segment_ids_from_position_ids(
    position_ids: torch.Tensor | None, batch: int, seq_len: int
) -> torch.Tensor | None:
    """[batch, seq_len] conversation index where position ids restart, or None for one conversation per row.

    A new conversation starts wherever the position does not follow the previous one by exactly 1,
    the rule `transformers` applies to position ids when it detects packed rows.
    """
    if position_ids is None or position_ids.shape[-1] != seq_len:
        return None
    position_ids = position_ids.expand(batch, seq_len)
    step = torch.diff(position_ids, dim=-1, prepend=position_ids[:, :1] - 1)
    segments = (step != 1).cumsum(dim=-1)
    if not bool(segments[:, -1].any()):
        return None
    return segments


def block_causal_mask(
    segments: torch.Tensor | None, seq_len: int, sliding_window: int | None = None, *, device: torch.device
) -> torch.Tensor | None:
    """Boolean [B or 1, 1, L, L] mask: query i sees key j iff j <= i, same segment, and i - j < window.

    None when that is plain causal attention (one segment, no window that bites), so that SDPA can
    take its `is_causal` fast path.
    """
    window_bites = sliding_window is not None and sliding_window < seq_len
    if segments is None and not window_bites:
        return None
    idx = torch.arange(seq_len, device=device)
    allowed = idx[None, :] <= idx[:, None]
    if window_bites:
        allowed = allowed & (idx[:, None] - idx[None, :] < sliding_window)
    allowed = allowed[None]
    if segments is not None:
        allowed = allowed & (segments[:, :, None] == segments[:, None, :])
    return allowed[:, None]


def end_aligned_causal_mask(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Boolean [1, 1, Tq, Tk] mask of varlen segments with their own key ranges, causal aligned to the end.

    Query i and key j of the same segment: i sees j iff j is no further from the segment's last key
    than i is from its last query (query t of q sees keys 0 .. k - q + t), and, with a window W,
    iff that distance differs by less than W (the positions of a preference answer continue from
    its prompt, so this is the position difference). `cu_seqlens_*` cover every query and key.
    """
    device = cu_seqlens_q.device
    cu_q, cu_k = cu_seqlens_q.long(), cu_seqlens_k.long()

    def to_end(cu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.arange(int(cu[-1]), device=device)
        segment = torch.searchsorted(cu[1:].contiguous(), idx, right=True)
        return segment, cu[segment + 1] - idx

    segment_q, back_q = to_end(cu_q)
    segment_k, back_k = to_end(cu_k)
    lag = back_k[None, :] - back_q[:, None]
    allowed = (segment_q[:, None] == segment_k[None, :]) & (lag >= 0)
    if sliding_window is not None:
        allowed = allowed & (lag < sliding_window)
    return allowed[None, None]


def _gathered_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kwargs: dict[str, Any],
    scaling: float,
    dropout: float,
    sliding_window: int | None,
    softcap: float | None,
    groups: int,
) -> torch.Tensor:
    """Attention of varlen segments with their own key rows (`preference_attention_kwargs`): -> [B, L, Hq, D].

    The tokens are flattened to one row, the key and value rows gathered by `key_index`, then the
    varlen kernel runs with the query and key boundaries, or SDPA with `end_aligned_causal_mask`.
    """
    batch, heads, q_len, head_dim = query.shape
    cu_q, cu_k, index = kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"], kwargs["key_index"]

    def one_row(x: torch.Tensor) -> torch.Tensor:  # [B, H, L, D] -> [1, H, B * L, D]
        return x.transpose(0, 1).reshape(1, x.shape[1], batch * q_len, head_dim) if batch > 1 else x

    query = one_row(query)
    key, value = one_row(key).index_select(2, index), one_row(value).index_select(2, index)
    if _varlen_applies(query, dropout, softcap, sliding_window) and _varlen_aligns_to_end(query.device):
        out = _varlen_attention(query, key, value, cu_q, kwargs.get("max_length_q"), scaling, sliding_window,
                                groups, cu_seqlens_k=cu_k, max_len_k=kwargs.get("max_length_k"))
    else:
        mask = end_aligned_causal_mask(cu_q, cu_k, sliding_window)
        out = _masked_attention(query, key, value, mask, scaling, dropout, softcap, groups)
    return out.reshape(batch, q_len, heads, head_dim)


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hk, S, D] -> [B, Hk * groups, S, D], each key/value head shared by `groups` query heads."""
    if groups == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, groups, s, d).reshape(b, h * groups, s, d)


def _masked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    dropout: float,
    softcap: float | None,
    groups: int,
) -> torch.Tensor:
    """softmax(q k^T * scaling [softcapped] + mask) v, causal when `mask` is None; -> [B, L, H, D].

    A boolean mask marks allowed pairs; a float mask is added to the scores (the `eager` convention).
    Every query sees at least itself, so no row of the softmax is empty.
    """
    key, value = _repeat_kv(key, groups), _repeat_kv(value, groups)
    q_len, kv_len = query.shape[2], key.shape[2]
    if softcap is None:
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
            is_causal=mask is None and q_len > 1 and q_len == kv_len,
        )
        return out.transpose(1, 2).contiguous()
    # Gemma 2 caps the attention logits at softcap * tanh(s / softcap); SDPA has no such option.
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    scores = softcap * torch.tanh(scores / softcap)
    if mask is None and q_len > 1:
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = F.dropout(probs, p=dropout, training=dropout > 0)
    return torch.matmul(probs, value).transpose(1, 2).contiguous()


# --------------------------------------------------------------------------------------------------
# The varlen (FlashAttention) path


@functools.cache
def _varlen_aligns_to_end(device: torch.device) -> bool:
    """Whether `varlen_attn` runs FlashAttention on `device`, whose causal mask is aligned to the end
    when a segment has more keys than queries (torch's `_flash_attention_forward`, FlashAttention 2).

    Some releases send it to cuDNN instead on some GPUs (`_should_use_cudnn`), whose alignment we do
    not rely on: segments with their own key rows then take SDPA with the explicit mask.
    """
    from torch.nn.attention import varlen

    uses_cudnn = getattr(varlen, "_should_use_cudnn", None)
    return uses_cudnn is None or not uses_cudnn(device.index if device.index is not None else 0)


@functools.cache
def _varlen_function() -> tuple[Callable | None, frozenset[str]]:
    """`varlen_attn` and the names of its parameters, or (None, {}) when this torch lacks it.

    Its signature moved between releases: torch 2.10 takes `is_causal`, later ones a FlashAttention
    `window_size` (causal is (-1, 0)), `scale` and, later still, `enable_gqa`.
    """
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, frozenset()
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def _varlen_applies(
    query: torch.Tensor, dropout: float, softcap: float | None, sliding_window: int | None
) -> bool:
    """Whether this call can take the varlen kernel (CUDA, half precision, no softcap or dropout)."""
    fn, params = _varlen_function()
    return (
        fn is not None
        and query.is_cuda
        and query.dtype in _VARLEN_DTYPES
        and query.shape[-1] <= _VARLEN_MAX_HEAD_DIM
        and softcap is None
        and dropout == 0.0
        and (sliding_window is None or "window_size" in params)
    )


def _varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_len: int | torch.Tensor | None,
    scaling: float,
    sliding_window: int | None,
    groups: int,
    *,
    cu_seqlens_k: torch.Tensor | None = None,
    max_len_k: int | None = None,
) -> torch.Tensor:
    """FlashAttention over the flattened tokens: [B, H, L, D] -> [B*L, H, D] -> [B, L, H, D].

    Keys and values have the query boundaries, or their own (`cu_seqlens_k`, `max_len_k`: key rows
    already gathered, [1, Hk, Tk, D]); causal is aligned to the end of each segment.
    """
    fn, params = _varlen_function()
    batch, heads, seq_len, head_dim = query.shape
    if max_len is None:
        max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    max_len = int(max_len)
    if cu_seqlens_k is None:
        cu_seqlens_k, max_len_k = cu_seqlens, max_len
    elif max_len_k is None:
        max_len_k = int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max())

    def flat(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2).reshape(-1, x.shape[1], head_dim)

    if "enable_gqa" not in params and groups > 1 and sliding_window is None and _grouped_flash_available():
        out = _GroupedFlashVarlen.apply(flat(query), flat(key), flat(value), cu_seqlens, cu_seqlens_k,
                                        max_len, int(max_len_k), scaling)
        return out.view(batch, seq_len, heads, head_dim)
    options: dict[str, Any] = {}
    if "enable_gqa" in params:
        options["enable_gqa"] = groups > 1
    else:
        key, value = _repeat_kv(key, groups), _repeat_kv(value, groups)
    if "scale" in params:
        options["scale"] = scaling
    else:
        # The kernel's own scale is 1/sqrt(D); fold the model's into the queries.
        query = query * (scaling * head_dim**0.5)
    if "window_size" in params:
        # `transformers`' window W lets a query see the W - 1 keys before it, and itself.
        options["window_size"] = (sliding_window - 1 if sliding_window else -1, 0)
    else:
        options["is_causal"] = True
    out = fn(flat(query), flat(key), flat(value), cu_seqlens, cu_seqlens_k, max_len, int(max_len_k),
             **options)
    return out.view(batch, seq_len, heads, head_dim)


@functools.cache
def _grouped_flash_available() -> bool:
    """Whether this torch has aten's FlashAttention 2 ops that `_GroupedFlashVarlen` calls."""
    aten = torch.ops.aten
    return hasattr(aten, "_flash_attention_forward") and hasattr(aten, "_flash_attention_backward")


class _GroupedFlashVarlen(torch.autograd.Function):
    """Causal FlashAttention 2 over varlen segments, the key and value heads read in place by their
    groups of query heads: q [T, Hq, D], k/v [Tk, Hk, D] -> [T, Hq, D].

    For the torches whose `varlen_attn` has no `enable_gqa` (2.10, 2.11), which would otherwise take
    the heads repeated: aten's kernel itself takes Hk < Hq, and sparing the repeated copies and their
    gradients' sum made attention alone 6-14% faster on an H200 (docs/PERF.md). Causal is aligned to
    the end of each segment, as in `varlen_attn`.
    """

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float):
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale
        )
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, rng, unused)
        ctx.lengths, ctx.scale = (max_q, max_k), scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, cu_q, cu_k, rng, unused = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad.contiguous(), q, k, v, out, lse, cu_q, cu_k, *ctx.lengths, 0.0, True, rng, unused,
            scale=ctx.scale,
        )
        return dq, dk, dv, None, None, None, None, None

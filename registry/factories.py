"""The two slot tables every runner uses: bs-axis (decode) and token-axis (prefill).

Every padded field says its policy here. The rule that keeps padding harmless: a padded
lane of an index (position, KV slot, row) is zero, and zero always names something safe
(position 0, the reserved KV slot 0, the reserved row 0 of `req_to_token`).
"""

from __future__ import annotations

from typing import Any

import torch

from registry.buffer_registry import BufferRegistry
from registry.policy import PaddingPolicy
from registry.slot import FillContext, GraphSlot

INDEX_LIKE_SLOTS = frozenset(
    {"input_ids", "positions", "out_cache_loc", "req_pool_indices", "lora_slots"}
)
"""Slots whose values index a table (embeddings, rope, KV pool, rows, adapter slots): zero is
a safe pad (adapter slot 0 is the base model: a padded token runs no adapter)."""

ZERO_PADDED_VALUE_SLOTS = frozenset({"input_embeds"})
"""The one documented exception to "ZERO means index": a zero embedding row is a harmless
padded token (it stays finite through RMSNorm and writes only to slot 0)."""

MUST_ZERO_SLOTS = frozenset({"positions", "out_cache_loc", "req_pool_indices"})
"""Indices whose padded lanes are read as addresses: any policy but ZERO would let a padded
lane write into a live KV slot or read a live row."""


def check_padding_invariants(registry: BufferRegistry) -> None:
    """Raise ValueError if a ZERO slot is not index-like, or an address slot is not ZERO."""
    for name in registry.slot_names():
        policy = registry.get_slot(name).padding_policy
        if policy is PaddingPolicy.ZERO and name not in INDEX_LIKE_SLOTS | ZERO_PADDED_VALUE_SLOTS:
            raise ValueError(
                f"slot {name!r} pads with ZERO but is not index-like; add it to "
                "INDEX_LIKE_SLOTS only if zero names a harmless entry, else pick another policy"
            )
        if name in MUST_ZERO_SLOTS and policy is not PaddingPolicy.ZERO:
            raise ValueError(
                f"slot {name!r} is an address and must pad with ZERO, not {policy.name}"
            )


def _tokens(max_bs: int, max_num_tokens: int) -> tuple[int, ...]:
    return (max_num_tokens,)


def _requests(max_bs: int, max_num_tokens: int) -> tuple[int, ...]:
    return (max_bs,)


def _scalar(max_bs: int, max_num_tokens: int) -> tuple[int, ...]:
    return (1,)


def _write_num_token_non_padded(buf: torch.Tensor, fb: Any, ctx: FillContext) -> None:
    # The live boundary: kernels that run on padded tokens mask everything past it.
    buf.fill_(ctx.raw_num_tokens)


def _num_token_non_padded_slot() -> GraphSlot:
    return GraphSlot(
        "num_token_non_padded",
        _scalar,
        torch.int32,
        axis="none",
        padding_policy=PaddingPolicy.KEEP_PAD,
        copy_from_fb=False,
        post_fill=_write_num_token_non_padded,
    )


def _lora_slots_slot() -> GraphSlot:
    # The adapter slot of each token (int32, 0 = the base model); a graph captured with it
    # runs the adapters, one captured without it runs none (its view carries None).
    return GraphSlot("lora_slots", _tokens, torch.int32, padding_policy=PaddingPolicy.ZERO)


def _input_embeds_slot(hidden_size: int, embed_dtype: torch.dtype | None) -> GraphSlot:
    if hidden_size <= 0 or embed_dtype is None:
        raise ValueError(
            "register_input_embeds needs hidden_size > 0 and an embed_dtype, "
            f"got {hidden_size} and {embed_dtype}"
        )
    # NOTE: copied from the batch (our model reads `fb.input_embeds`); sglang's graph
    # variant only zeroes it because its model writes the embeddings in-graph.
    return GraphSlot(
        "input_embeds",
        lambda max_bs, max_num_tokens: (max_num_tokens, hidden_size),  # [tokens, hidden]
        embed_dtype,
        axis="tokens",
        padding_policy=PaddingPolicy.ZERO,
    )


def _build(
    slots: list[GraphSlot],
    *,
    device: torch.device | str,
    max_bs: int,
    max_num_tokens: int,
    share_pool: bool,
    source: Any,
) -> BufferRegistry:
    registry = BufferRegistry(device, max_bs, max_num_tokens, share_pool=share_pool)
    for slot in slots:
        bind = None
        if source is not None:
            bind = getattr(source, slot.name, None)
            if not isinstance(bind, torch.Tensor):
                raise ValueError(f"slot {slot.name!r}: source has no tensor of that name to bind")
        registry.register_slot(slot, bind=bind)
    check_padding_invariants(registry)
    return registry


def build_decode_registry(
    *,
    device: torch.device | str,
    max_bs: int,
    max_num_tokens: int,
    seq_len_fill_value: int,
    cache_loc_dtype: torch.dtype = torch.int64,
    register_input_embeds: bool = False,
    hidden_size: int = 0,
    embed_dtype: torch.dtype | None = None,
    enable_num_token_non_padded: bool = False,
    needs_cpu_seq_lens: bool = True,
    register_lora_slots: bool = False,
    share_pool: bool = True,
    source: Any = None,
) -> BufferRegistry:
    """bs-axis registry for DECODE (and IDLE): one token per request, padded by requests.

    Padded requests read row 0 (`req_pool_indices` ZERO) with `seq_len_fill_value` tokens
    and write their one token to slot 0 (`out_cache_loc` ZERO). With `source`, every slot
    adopts the same-named tensor on it instead of allocating. `register_lora_slots`: the
    tokens' adapter slots (LoRA graphs).
    """
    sentinel = PaddingPolicy.FILL_SENTINEL
    slots = [
        # Padded ids are embedded but never sampled; any valid id left there will do.
        GraphSlot("input_ids", _tokens, torch.int64, axis="tokens"),
        GraphSlot("positions", _tokens, torch.int64, padding_policy=PaddingPolicy.ZERO),
        GraphSlot("out_cache_loc", _tokens, cache_loc_dtype, padding_policy=PaddingPolicy.ZERO),
        GraphSlot(
            "req_pool_indices",
            _requests,
            torch.int64,
            axis="bs",
            padding_policy=PaddingPolicy.ZERO,
        ),
        GraphSlot(
            "seq_lens",
            _requests,
            torch.int64,
            axis="bs",
            padding_policy=sentinel,
            pad_value=seq_len_fill_value,
        ),
    ]
    if needs_cpu_seq_lens:
        slots.append(
            GraphSlot(
                "seq_lens_cpu",
                _requests,
                torch.int64,
                axis="bs",
                device="cpu",  # the host mirror, for backends that plan on the host
                padding_policy=sentinel,
                pad_value=seq_len_fill_value,
            )
        )
    if enable_num_token_non_padded:
        slots.append(_num_token_non_padded_slot())
    if register_input_embeds:
        slots.append(_input_embeds_slot(hidden_size, embed_dtype))
    if register_lora_slots:
        slots.append(_lora_slots_slot())
    return _build(
        slots,
        device=device,
        max_bs=max_bs,
        max_num_tokens=max_num_tokens,
        share_pool=share_pool,
        source=source,
    )


def build_prefill_registry(
    *,
    device: torch.device | str,
    max_bs: int,
    max_num_tokens: int,
    cache_loc_dtype: torch.dtype = torch.int64,
    register_input_embeds: bool = False,
    hidden_size: int = 0,
    embed_dtype: torch.dtype | None = None,
    enable_num_token_non_padded: bool = False,
    register_lora_slots: bool = False,
    share_pool: bool = True,
    source: Any = None,
) -> BufferRegistry:
    """token-axis registry for EXTEND: padded by tokens, and the padded tokens are executed.

    Hence every token slot is ZERO: a padded token is token 0 at position 0 writing slot 0.
    Per-request fields (`req_pool_indices`, `seq_lens`, `extend_*`) are not staged here.
    """
    zero = PaddingPolicy.ZERO
    slots = [
        GraphSlot("input_ids", _tokens, torch.int64, padding_policy=zero),
        GraphSlot("positions", _tokens, torch.int64, padding_policy=zero),
        GraphSlot("out_cache_loc", _tokens, cache_loc_dtype, padding_policy=zero),
    ]
    if register_input_embeds:
        slots.append(_input_embeds_slot(hidden_size, embed_dtype))
    if enable_num_token_non_padded:
        slots.append(_num_token_non_padded_slot())
    if register_lora_slots:
        slots.append(_lora_slots_slot())
    return _build(
        slots,
        device=device,
        max_bs=max_bs,
        max_num_tokens=max_num_tokens,
        share_pool=share_pool,
        source=source,
    )

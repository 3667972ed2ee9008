"""The unit of work: one `ForwardBatch` per step, as a remote scheduler sends it.

Field names follow sglang's ForwardBatch so that anyone who knows it feels at home.
A batch is built on the host (from the wire or in-process), validated, completed with its
derived fields (:func:`executor.batch_prep.complete_batch`), then moved to the device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch

from executor.core.controls_types import DeferredMask, RowControl, VocabMask
from executor.core.errors import BatchValidationError
from executor.core.extras_types import RowOutputs
from executor.core.lora_types import RowAdapter
from ops.h2d_staging import StagedField
from ops.host_transfer import to_device


class ForwardMode(IntEnum):
    """What a step does. Values match the wire enum `model_executor.v1.ForwardMode`."""

    EXTEND = 1  # prefill, or a chunk of one, possibly after a cached prefix
    DECODE = 2  # one new token per request
    IDLE = 3  # an empty batch: no device work
    VERIFY = 4  # speculative decoding: EXTEND-shaped, every position scored (executor.speculative)

    def is_extend(self) -> bool:
        """EXTEND-shaped: VERIFY included (its batches are extends with drafts)."""
        return self is ForwardMode.EXTEND or self is ForwardMode.VERIFY

    def is_verify(self) -> bool:
        return self is ForwardMode.VERIFY

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE

    def is_idle(self) -> bool:
        return self is ForwardMode.IDLE


class LogprobsMode(IntEnum):
    """Which distribution a request's logprobs come from. Values match the wire enum
    `model_executor.v1.LogprobsMode`."""

    RAW = 0  # the model's: log-softmax of its logits
    PROCESSED = 1  # the one the sampler drew from (ops.sampling.processed_logprobs)


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling parameters. Temperature 0 (or below 1e-5) means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: disabled
    min_p: float = 0.0  # 0: disabled
    seed: int | None = None  # draws depend only on (seed, position) when set
    logprobs_mode: LogprobsMode = LogprobsMode.RAW


@dataclass
class SamplingBatch:
    """Sampling parameters of a whole batch, one entry per request ([bs] tensors on the host).

    `seeds` holds the 64-bit seed reinterpreted as int64; `has_seed` says which are set.
    """

    temperatures: torch.Tensor  # [bs] float32
    top_ps: torch.Tensor  # [bs] float32
    top_ks: torch.Tensor  # [bs] int64
    min_ps: torch.Tensor  # [bs] float32
    seeds: torch.Tensor  # [bs] int64
    has_seed: torch.Tensor  # [bs] bool
    processed: torch.Tensor  # [bs] bool: the request's logprobs are PROCESSED

    @classmethod
    def from_params(
        cls, params: list[SamplingParams] | tuple[SamplingParams, ...], bs: int
    ) -> SamplingBatch:
        """Build from `bs` entries, one entry (applies to all) or none (greedy for all).

        Any other count is built as given: validation refuses it with the batch's other rules.
        """
        if len(params) == 0:
            params = [SamplingParams()]
        if len(params) == 1 and bs != 1:
            params = list(params) * bs
        seeds = [(p.seed if p.seed is not None else 0) for p in params]
        return cls(
            temperatures=torch.tensor([p.temperature for p in params], dtype=torch.float32),
            top_ps=torch.tensor([p.top_p for p in params], dtype=torch.float32),
            top_ks=torch.tensor([p.top_k for p in params], dtype=torch.int64),
            min_ps=torch.tensor([p.min_p for p in params], dtype=torch.float32),
            seeds=torch.tensor([_as_int64(s) for s in seeds], dtype=torch.int64),
            has_seed=torch.tensor([p.seed is not None for p in params], dtype=torch.bool),
            processed=torch.tensor(
                [p.logprobs_mode is LogprobsMode.PROCESSED for p in params], dtype=torch.bool
            ),
        )

    @classmethod
    def greedy(cls, bs: int) -> SamplingBatch:
        """`SamplingParams()` for all `bs` requests, filled directly. Shared by every batch of
        that size (a step builds one per batch without sampling parameters): like the wire's
        tensors, a host batch's tensors are read, never written."""
        batch = _GREEDY.get(bs)
        if batch is None:
            batch = cls.filled_greedy(bs, torch.device("cpu"))
            batch.shared = True
            if len(_GREEDY) >= 1024:
                _GREEDY.clear()
            _GREEDY[bs] = batch
        return batch

    shared = False  # not a field: True on `greedy(bs)`'s shared batches only

    def is_shared_greedy(self) -> bool:
        """This is `greedy(bs)`'s shared batch (every request greedy, nothing to upload)."""
        return self.shared

    @classmethod
    def filled_greedy(cls, bs: int, device: torch.device) -> SamplingBatch:
        """`SamplingParams()` for `bs` requests, new tensors filled on `device`."""
        return cls(
            temperatures=torch.zeros(bs, dtype=torch.float32, device=device),
            top_ps=torch.ones(bs, dtype=torch.float32, device=device),
            top_ks=torch.zeros(bs, dtype=torch.int64, device=device),
            min_ps=torch.zeros(bs, dtype=torch.float32, device=device),
            seeds=torch.zeros(bs, dtype=torch.int64, device=device),
            has_seed=torch.zeros(bs, dtype=torch.bool, device=device),
            processed=torch.zeros(bs, dtype=torch.bool, device=device),
        )

    def to(self, device: torch.device) -> SamplingBatch:
        return SamplingBatch(
            **{
                f.name: to_device(getattr(self, f.name), device, "sampling")
                for f in dataclasses.fields(self)
            }
        )


_GREEDY: dict[int, SamplingBatch] = {}


def _as_int64(seed: int) -> int:
    """Reinterpret a seed in [-(2**63), 2**64) as a signed 64-bit integer."""
    if not -(2**63) <= seed < 2**64:
        raise BatchValidationError("sampling_params.seed", f"must fit in 64 bits, got {seed}")
    return seed - 2**64 if seed >= 2**63 else seed


@dataclass
class ForwardBatch:
    """One step's inputs. Tensors are 1-D unless noted; `T` = tokens in this step, `bs` = requests.

    The scheduler sends the required fields; :func:`executor.batch_prep.complete_batch` fills
    the derived ones (`positions`, `extend_start_loc`, the host mirrors).
    """

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor | None  # [T] token ids (None when input_embeds is given)
    req_pool_indices: torch.Tensor  # [bs] rows of req_to_token, 1..max_reqs
    seq_lens: torch.Tensor  # [bs] total length of each request AFTER this step
    out_cache_loc: torch.Tensor  # [T] KV slot of each new token, 1..kv_slots
    positions: torch.Tensor | None = (
        None  # [T]; default prefix + arange (EXTEND), seq_len - 1 (DECODE)
    )
    extend_prefix_lens: torch.Tensor | None = None  # [bs] EXTEND: tokens already cached
    extend_seq_lens: torch.Tensor | None = None  # [bs] EXTEND: new tokens per request
    extend_start_loc: torch.Tensor | None = None  # [bs] EXTEND: offset of each request in T
    seq_lens_cpu: torch.Tensor | None = None  # [bs] host mirror of seq_lens (None if not needed)
    seq_lens_sum: int | None = None  # sum(seq_lens) on the host (None with seq_lens_cpu)
    # NOTE: shape parameters, not host mirrors. The batch arrives on the host (from the wire)
    # and the executor reads it there anyway to validate it, so `complete_batch` also records
    # a static upper bound of the lengths: the largest one rounded up to an eighth of an
    # octave, capped at max_context_len (`graphs.buckets.length_bound`: at most 12.5% padding,
    # 8 distinct shapes per octave). Reading them is neither a read of `seq_lens_cpu` nor a
    # device-to-host transfer, so a backend with `needs_cpu_seq_lens = False` may size its
    # gathers and grids by them. Under graph capture backends use the static maximum
    # (max_context_len) instead, so that one captured graph serves every batch of its bucket.
    seq_len_bound: int | None = None  # >= max(seq_lens); None: unknown (use max_context_len)
    extend_len_bound: int | None = None  # EXTEND: >= max(extend_seq_lens); None otherwise
    extend_prefix_lens_cpu: list[int] | None = None  # host lists for per-request planning
    extend_seq_lens_cpu: list[int] | None = None
    input_embeds: torch.Tensor | None = None  # [T, hidden] instead of input_ids
    prefix_cache_loc: torch.Tensor | None = None  # EXTEND: [sum(prefix)] slots of a cached prefix
    # Host only: rows the scheduler freed since its last batch; their resident length drops to
    # 0 before this step runs (a freed row may be reused by a new request in the same batch).
    released_req_pool_indices: torch.Tensor | None = None  # [n]
    # Future-token references (overlap scheduling, executor.future_tokens): after sampling,
    # request i's token is stored in future slot future_token_slots[i]; a negative input id
    # -k reads the token stored in slot k. released_future_slots (host only) are freed first.
    future_token_slots: torch.Tensor | None = None  # [bs] slots 1..future_slots
    released_future_slots: torch.Tensor | None = None  # [n]
    future_refs: int = 0  # derived (complete_batch): how many input ids are references
    sampling: SamplingBatch | None = None  # None: greedy for every request
    # Sampling controls (executor.controls), host only: per-row controls this batch sets
    # (they last for the request), this step's vocab mask, or a mask that follows the batch.
    row_controls: tuple[RowControl, ...] = ()
    vocab_mask: VocabMask | None = None
    deferred_mask: DeferredMask | None = None
    # VERIFY: [bs] int32, n-gram size of the executor's prompt-lookup drafts per row (0: the
    # drafts are in input_ids).
    ngram_draft: torch.Tensor | None = None
    # Outputs beyond the next token (executor.extras), host only: one entry per asking row,
    # and the top-k alternatives per scored prompt position.
    row_outputs: tuple[RowOutputs, ...] = ()
    prompt_top_logprobs_num: int = 0
    # LoRA (executor.lora), host only: the adapter each named row uses from now on. Derived
    # at admission (the LoRA feature): [T] int32, the adapter slot of every token (0: the base
    # model); None when no row of the batch has an adapter (the step runs no LoRA work).
    row_adapters: tuple[RowAdapter, ...] = ()
    lora_slots: torch.Tensor | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # Set by the graph runners' registries: [1] int32, the real token count of a padded batch
    # (capture and replay compute it through the same fill, so they agree).
    num_token_non_padded: torch.Tensor | None = None
    # Set by the runner for the attention backend in use; one typed object per backend.
    attn_metadata: Any = None

    @property
    def num_tokens(self) -> int:
        return int(self.out_cache_loc.shape[0])

    def to(self, device: torch.device) -> ForwardBatch:
        """A copy whose device tensors live on `device`; host mirrors stay on the host.

        One counted upload per field (ops.host_transfer.to_device; syncs from pageable
        memory): for in-process use. The executor's step stages them all in one copy
        (`staged_fields` / `on_device`)."""
        if device.type == "cpu":
            return dataclasses.replace(self)
        moved: dict[str, Any] = {}
        for name in _DEVICE_FIELDS:
            value = getattr(self, name)
            if value is not None:
                moved[name] = to_device(value, device, name)
        if self.sampling is not None:
            moved["sampling"] = self.sampling.to(device)
        return dataclasses.replace(self, **moved)

    def staged_fields(self) -> list[StagedField]:
        """The host tensors a step uploads (`_DEVICE_FIELDS` and the sampling parameters),
        for one staged copy (ops.h2d_staging.H2DStaging). The shared all-greedy parameters
        (`SamplingBatch.greedy`) are not uploaded: the device keeps its own copy of them."""
        fields = [
            StagedField(name, value, value.dtype)
            for name in _DEVICE_FIELDS
            if (value := getattr(self, name)) is not None
        ]
        s = self.sampling
        if s is not None and not s.is_shared_greedy():
            for name in _SAMPLING_FIELDS:
                value = getattr(s, name)
                fields.append(StagedField(_SAMPLING_PREFIX + name, value, value.dtype))
        return fields

    @classmethod
    def create(cls, **fields: Any) -> ForwardBatch:
        """`ForwardBatch(**fields)` for the codec's path: the defaults, then `fields`, without
        the generated `__init__`'s per-field work (36 fields, every step). The names must be
        fields, and the required ones given."""
        if not (_FIELD_NAMES.issuperset(fields) and _REQUIRED.issubset(fields)):
            unknown, missing = fields.keys() - _FIELD_NAMES, _REQUIRED - fields.keys()
            raise TypeError(
                f"ForwardBatch: unknown field(s) {sorted(unknown)}, missing {sorted(missing)}"
            )
        new = object.__new__(cls)
        new.__dict__.update(_DEFAULTS, **fields)
        return new

    def replace(self, **changes: Any) -> ForwardBatch:
        """`dataclasses.replace(self, **changes)` for the step's path: a shallow copy without
        replace's walk over every field and `__init__` call (a batch is replaced three times
        a step). The names must be fields."""
        unknown = changes.keys() - _FIELD_NAMES
        if unknown:
            raise TypeError(f"ForwardBatch has no field(s) {sorted(unknown)}")
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__, **changes)
        return new

    def on_device(self, views: Sequence[torch.Tensor]) -> ForwardBatch:
        """A copy whose device fields are `views`: the staged copies of `staged_fields()`, in
        its order; host mirrors stay on the host. The shared all-greedy parameters, never
        staged, become the device's own copy of them."""
        it = iter(views)
        moved: dict[str, Any] = {
            name: next(it) for name in _DEVICE_FIELDS if getattr(self, name) is not None
        }
        s = self.sampling
        if s is not None:
            if s.is_shared_greedy():
                device = views[0].device if views else s.temperatures.device
                moved["sampling"] = _device_greedy(self.batch_size, device)
            else:
                moved["sampling"] = SamplingBatch(*(next(it) for _ in _SAMPLING_FIELDS))
        return self.replace(**moved)


_SAMPLING_PREFIX = "sampling."  # a label of the staged layout (ops.h2d_staging)
_SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingBatch))
_DEVICE_GREEDY: dict[tuple[int, torch.device], SamplingBatch] = {}


def _device_greedy(bs: int, device: torch.device) -> SamplingBatch:
    """`SamplingBatch.greedy(bs)` on `device`, made there once per size (a fill on the
    device, no upload) and shared, like the host one: never written."""
    batch = _DEVICE_GREEDY.get((bs, device))
    if batch is None:
        batch = SamplingBatch.filled_greedy(bs, device)
        if len(_DEVICE_GREEDY) >= 1024:
            _DEVICE_GREEDY.clear()
        _DEVICE_GREEDY[(bs, device)] = batch
    return batch


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(ForwardBatch))
_DEFAULTS = {
    f.name: f.default
    for f in dataclasses.fields(ForwardBatch)
    if f.default is not dataclasses.MISSING
}
_REQUIRED = _FIELD_NAMES - _DEFAULTS.keys()


@dataclass(frozen=True)
class TensorField:
    """One tensor field of `ForwardBatch`: whether the wire message carries it (the codec
    reads it) and whether a step stages it to the device (else it stays on the host)."""

    name: str
    wire: bool
    device: bool


# The one table of the batch's tensor fields: the codec decodes the `wire` ones, the step
# uploads the `device` ones (and the sampling parameters) in one staged copy. A new tensor
# field is one more row here.
TENSOR_FIELDS = (
    TensorField("input_ids", wire=True, device=True),
    TensorField("req_pool_indices", wire=True, device=True),
    TensorField("seq_lens", wire=True, device=True),
    TensorField("out_cache_loc", wire=True, device=True),
    TensorField("positions", wire=True, device=True),
    TensorField("extend_prefix_lens", wire=True, device=True),
    TensorField("extend_seq_lens", wire=True, device=True),
    TensorField("extend_start_loc", wire=False, device=True),  # derived (complete_batch)
    TensorField("prefix_cache_loc", wire=True, device=True),
    TensorField("released_req_pool_indices", wire=True, device=False),
    TensorField("input_embeds", wire=True, device=True),
    TensorField("future_token_slots", wire=True, device=True),
    TensorField("released_future_slots", wire=True, device=False),
    TensorField("ngram_draft", wire=True, device=True),
    TensorField("lora_slots", wire=False, device=True),  # derived (the LoRA feature's admit)
)
WIRE_TENSOR_FIELDS = tuple(f.name for f in TENSOR_FIELDS if f.wire)
_DEVICE_FIELDS = tuple(f.name for f in TENSOR_FIELDS if f.device)

from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    INT32: _ClassVar[DType]
    INT64: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]

class ForwardMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FORWARD_MODE_UNSPECIFIED: _ClassVar[ForwardMode]
    EXTEND: _ClassVar[ForwardMode]
    DECODE: _ClassVar[ForwardMode]
    IDLE: _ClassVar[ForwardMode]
    VERIFY: _ClassVar[ForwardMode]

class LogprobsMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOGPROBS_MODE_RAW: _ClassVar[LogprobsMode]
    LOGPROBS_MODE_PROCESSED: _ClassVar[LogprobsMode]

class Pooling(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOLING_LAST: _ClassVar[Pooling]
    POOLING_MEAN: _ClassVar[Pooling]

class KvKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_KIND_K: _ClassVar[KvKind]
    KV_KIND_V: _ClassVar[KvKind]

class NeedsCpuSeqLens(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NEEDS_CPU_SEQ_LENS_UNSPECIFIED: _ClassVar[NeedsCpuSeqLens]
    NEEDS_CPU_SEQ_LENS_AUTO: _ClassVar[NeedsCpuSeqLens]
    NEEDS_CPU_SEQ_LENS_ON: _ClassVar[NeedsCpuSeqLens]
    NEEDS_CPU_SEQ_LENS_OFF: _ClassVar[NeedsCpuSeqLens]

class GraphMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GRAPH_MODE_UNSPECIFIED: _ClassVar[GraphMode]
    GRAPH_MODE_NONE: _ClassVar[GraphMode]
    GRAPH_MODE_DECODE: _ClassVar[GraphMode]
    GRAPH_MODE_EXTEND: _ClassVar[GraphMode]
    GRAPH_MODE_BOTH: _ClassVar[GraphMode]
DTYPE_UNSPECIFIED: DType
INT32: DType
INT64: DType
FLOAT32: DType
BFLOAT16: DType
FLOAT16: DType
FORWARD_MODE_UNSPECIFIED: ForwardMode
EXTEND: ForwardMode
DECODE: ForwardMode
IDLE: ForwardMode
VERIFY: ForwardMode
LOGPROBS_MODE_RAW: LogprobsMode
LOGPROBS_MODE_PROCESSED: LogprobsMode
POOLING_LAST: Pooling
POOLING_MEAN: Pooling
KV_KIND_K: KvKind
KV_KIND_V: KvKind
NEEDS_CPU_SEQ_LENS_UNSPECIFIED: NeedsCpuSeqLens
NEEDS_CPU_SEQ_LENS_AUTO: NeedsCpuSeqLens
NEEDS_CPU_SEQ_LENS_ON: NeedsCpuSeqLens
NEEDS_CPU_SEQ_LENS_OFF: NeedsCpuSeqLens
GRAPH_MODE_UNSPECIFIED: GraphMode
GRAPH_MODE_NONE: GraphMode
GRAPH_MODE_DECODE: GraphMode
GRAPH_MODE_EXTEND: GraphMode
GRAPH_MODE_BOTH: GraphMode

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Ragged(_message.Message):
    __slots__ = ("values", "lengths")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    values: Tensor
    lengths: Tensor
    def __init__(self, values: _Optional[_Union[Tensor, _Mapping]] = ..., lengths: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "logprobs_mode")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_MODE_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    logprobs_mode: LogprobsMode
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., logprobs_mode: _Optional[_Union[LogprobsMode, str]] = ...) -> None: ...

class ForwardBatch(_message.Message):
    __slots__ = ("forward_mode", "input_ids", "req_pool_indices", "seq_lens", "out_cache_loc", "positions", "extend_prefix_lens", "extend_seq_lens", "prefix_cache_loc", "input_embeds", "sampling_params", "return_logprob", "top_logprobs_num", "released_req_pool_indices", "future_token_slots", "released_future_slots", "row_controls", "vocab_mask", "vocab_mask_rows", "vocab_mask_deferred", "ngram_draft", "row_outputs", "prompt_top_logprobs_num", "row_adapters")
    FORWARD_MODE_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    REQ_POOL_INDICES_FIELD_NUMBER: _ClassVar[int]
    SEQ_LENS_FIELD_NUMBER: _ClassVar[int]
    OUT_CACHE_LOC_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    EXTEND_PREFIX_LENS_FIELD_NUMBER: _ClassVar[int]
    EXTEND_SEQ_LENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_LOC_FIELD_NUMBER: _ClassVar[int]
    INPUT_EMBEDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_NUM_FIELD_NUMBER: _ClassVar[int]
    RELEASED_REQ_POOL_INDICES_FIELD_NUMBER: _ClassVar[int]
    FUTURE_TOKEN_SLOTS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FUTURE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    ROW_CONTROLS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_MASK_FIELD_NUMBER: _ClassVar[int]
    VOCAB_MASK_ROWS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_MASK_DEFERRED_FIELD_NUMBER: _ClassVar[int]
    NGRAM_DRAFT_FIELD_NUMBER: _ClassVar[int]
    ROW_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_NUM_FIELD_NUMBER: _ClassVar[int]
    ROW_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    forward_mode: ForwardMode
    input_ids: Tensor
    req_pool_indices: Tensor
    seq_lens: Tensor
    out_cache_loc: Tensor
    positions: Tensor
    extend_prefix_lens: Tensor
    extend_seq_lens: Tensor
    prefix_cache_loc: Tensor
    input_embeds: Tensor
    sampling_params: _containers.RepeatedCompositeFieldContainer[SamplingParams]
    return_logprob: bool
    top_logprobs_num: int
    released_req_pool_indices: Tensor
    future_token_slots: Tensor
    released_future_slots: Tensor
    row_controls: _containers.RepeatedCompositeFieldContainer[RowControls]
    vocab_mask: Tensor
    vocab_mask_rows: Tensor
    vocab_mask_deferred: bool
    ngram_draft: Tensor
    row_outputs: _containers.RepeatedCompositeFieldContainer[RowOutputs]
    prompt_top_logprobs_num: int
    row_adapters: _containers.RepeatedCompositeFieldContainer[RowAdapter]
    def __init__(self, forward_mode: _Optional[_Union[ForwardMode, str]] = ..., input_ids: _Optional[_Union[Tensor, _Mapping]] = ..., req_pool_indices: _Optional[_Union[Tensor, _Mapping]] = ..., seq_lens: _Optional[_Union[Tensor, _Mapping]] = ..., out_cache_loc: _Optional[_Union[Tensor, _Mapping]] = ..., positions: _Optional[_Union[Tensor, _Mapping]] = ..., extend_prefix_lens: _Optional[_Union[Tensor, _Mapping]] = ..., extend_seq_lens: _Optional[_Union[Tensor, _Mapping]] = ..., prefix_cache_loc: _Optional[_Union[Tensor, _Mapping]] = ..., input_embeds: _Optional[_Union[Tensor, _Mapping]] = ..., sampling_params: _Optional[_Iterable[_Union[SamplingParams, _Mapping]]] = ..., return_logprob: _Optional[bool] = ..., top_logprobs_num: _Optional[int] = ..., released_req_pool_indices: _Optional[_Union[Tensor, _Mapping]] = ..., future_token_slots: _Optional[_Union[Tensor, _Mapping]] = ..., released_future_slots: _Optional[_Union[Tensor, _Mapping]] = ..., row_controls: _Optional[_Iterable[_Union[RowControls, _Mapping]]] = ..., vocab_mask: _Optional[_Union[Tensor, _Mapping]] = ..., vocab_mask_rows: _Optional[_Union[Tensor, _Mapping]] = ..., vocab_mask_deferred: _Optional[bool] = ..., ngram_draft: _Optional[_Union[Tensor, _Mapping]] = ..., row_outputs: _Optional[_Iterable[_Union[RowOutputs, _Mapping]]] = ..., prompt_top_logprobs_num: _Optional[int] = ..., row_adapters: _Optional[_Iterable[_Union[RowAdapter, _Mapping]]] = ...) -> None: ...

class RowAdapter(_message.Message):
    __slots__ = ("req_pool_index", "adapter")
    REQ_POOL_INDEX_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    req_pool_index: int
    adapter: str
    def __init__(self, req_pool_index: _Optional[int] = ..., adapter: _Optional[str] = ...) -> None: ...

class LoraAdapter(_message.Message):
    __slots__ = ("name", "path", "slot", "rank", "target_modules", "load_seconds")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    slot: int
    rank: int
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    load_seconds: float
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., slot: _Optional[int] = ..., rank: _Optional[int] = ..., target_modules: _Optional[_Iterable[str]] = ..., load_seconds: _Optional[float] = ...) -> None: ...

class LoadLoraRequest(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class LoadLoraResponse(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: LoraAdapter
    def __init__(self, adapter: _Optional[_Union[LoraAdapter, _Mapping]] = ...) -> None: ...

class UnloadLoraRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadLoraResponse(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: LoraAdapter
    def __init__(self, adapter: _Optional[_Union[LoraAdapter, _Mapping]] = ...) -> None: ...

class HiddenOutput(_message.Message):
    __slots__ = ("pooling", "layer", "dtype")
    POOLING_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    pooling: Pooling
    layer: int
    dtype: DType
    def __init__(self, pooling: _Optional[_Union[Pooling, str]] = ..., layer: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class RowOutputs(_message.Message):
    __slots__ = ("req_pool_index", "prompt_logprobs", "logprob_start_len", "next_prompt_token", "score_token_ids", "hidden", "routed_experts")
    REQ_POOL_INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_START_LEN_FIELD_NUMBER: _ClassVar[int]
    NEXT_PROMPT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SCORE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    req_pool_index: int
    prompt_logprobs: bool
    logprob_start_len: int
    next_prompt_token: int
    score_token_ids: _containers.RepeatedScalarFieldContainer[int]
    hidden: HiddenOutput
    routed_experts: bool
    def __init__(self, req_pool_index: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ..., logprob_start_len: _Optional[int] = ..., next_prompt_token: _Optional[int] = ..., score_token_ids: _Optional[_Iterable[int]] = ..., hidden: _Optional[_Union[HiddenOutput, _Mapping]] = ..., routed_experts: _Optional[bool] = ...) -> None: ...

class SamplingControls(_message.Message):
    __slots__ = ("repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias", "min_tokens", "stop_token_ids", "banned_token_ids", "allowed_token_ids", "prompt_len")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BANNED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    banned_token_ids: _containers.RepeatedScalarFieldContainer[int]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_len: int
    def __init__(self, repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., banned_token_ids: _Optional[_Iterable[int]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., prompt_len: _Optional[int] = ...) -> None: ...

class RowControls(_message.Message):
    __slots__ = ("req_pool_index", "controls")
    REQ_POOL_INDEX_FIELD_NUMBER: _ClassVar[int]
    CONTROLS_FIELD_NUMBER: _ClassVar[int]
    req_pool_index: int
    controls: SamplingControls
    def __init__(self, req_pool_index: _Optional[int] = ..., controls: _Optional[_Union[SamplingControls, _Mapping]] = ...) -> None: ...

class DeferredMask(_message.Message):
    __slots__ = ("batch_id", "vocab_mask", "vocab_mask_rows")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_MASK_FIELD_NUMBER: _ClassVar[int]
    VOCAB_MASK_ROWS_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    vocab_mask: Tensor
    vocab_mask_rows: Tensor
    def __init__(self, batch_id: _Optional[int] = ..., vocab_mask: _Optional[_Union[Tensor, _Mapping]] = ..., vocab_mask_rows: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("batch_id", "batch", "deferred_mask")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_MASK_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    batch: ForwardBatch
    deferred_mask: DeferredMask
    def __init__(self, batch_id: _Optional[int] = ..., batch: _Optional[_Union[ForwardBatch, _Mapping]] = ..., deferred_mask: _Optional[_Union[DeferredMask, _Mapping]] = ...) -> None: ...

class ForwardStats(_message.Message):
    __slots__ = ("path", "batch_size", "padded_batch_size", "num_tokens", "padded_num_tokens", "timings_ns", "mode", "fill_registry", "fill_tensors", "fill_bytes", "fill_copy_calls", "d2h_syncs", "h2d_syncs", "h2d_copies", "control_rows", "draft_tokens", "accepted_drafts", "lora_rows", "host_gap_ns")
    class TimingsNsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ControlRowsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PATH_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    PADDED_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PADDED_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_NS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    FILL_REGISTRY_FIELD_NUMBER: _ClassVar[int]
    FILL_TENSORS_FIELD_NUMBER: _ClassVar[int]
    FILL_BYTES_FIELD_NUMBER: _ClassVar[int]
    FILL_COPY_CALLS_FIELD_NUMBER: _ClassVar[int]
    D2H_SYNCS_FIELD_NUMBER: _ClassVar[int]
    H2D_SYNCS_FIELD_NUMBER: _ClassVar[int]
    H2D_COPIES_FIELD_NUMBER: _ClassVar[int]
    CONTROL_ROWS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    LORA_ROWS_FIELD_NUMBER: _ClassVar[int]
    HOST_GAP_NS_FIELD_NUMBER: _ClassVar[int]
    path: str
    batch_size: int
    padded_batch_size: int
    num_tokens: int
    padded_num_tokens: int
    timings_ns: _containers.ScalarMap[str, int]
    mode: str
    fill_registry: str
    fill_tensors: int
    fill_bytes: int
    fill_copy_calls: int
    d2h_syncs: int
    h2d_syncs: int
    h2d_copies: int
    control_rows: _containers.ScalarMap[str, int]
    draft_tokens: int
    accepted_drafts: int
    lora_rows: int
    host_gap_ns: int
    def __init__(self, path: _Optional[str] = ..., batch_size: _Optional[int] = ..., padded_batch_size: _Optional[int] = ..., num_tokens: _Optional[int] = ..., padded_num_tokens: _Optional[int] = ..., timings_ns: _Optional[_Mapping[str, int]] = ..., mode: _Optional[str] = ..., fill_registry: _Optional[str] = ..., fill_tensors: _Optional[int] = ..., fill_bytes: _Optional[int] = ..., fill_copy_calls: _Optional[int] = ..., d2h_syncs: _Optional[int] = ..., h2d_syncs: _Optional[int] = ..., h2d_copies: _Optional[int] = ..., control_rows: _Optional[_Mapping[str, int]] = ..., draft_tokens: _Optional[int] = ..., accepted_drafts: _Optional[int] = ..., lora_rows: _Optional[int] = ..., host_gap_ns: _Optional[int] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ("batch_id", "next_token_ids", "next_token_logprobs", "top_logprob_ids", "top_logprobs", "stats", "accepted_tokens", "accepted_logprobs", "prompt_logprobs", "prompt_top_logprobs", "prompt_top_logprob_ids", "token_scores", "hidden_states", "routed_experts", "weight_version")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROB_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROB_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_SCORES_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    next_token_ids: Tensor
    next_token_logprobs: Tensor
    top_logprob_ids: Tensor
    top_logprobs: Tensor
    stats: ForwardStats
    accepted_tokens: Ragged
    accepted_logprobs: Ragged
    prompt_logprobs: Ragged
    prompt_top_logprobs: Ragged
    prompt_top_logprob_ids: Ragged
    token_scores: Ragged
    hidden_states: Ragged
    routed_experts: Ragged
    weight_version: str
    def __init__(self, batch_id: _Optional[int] = ..., next_token_ids: _Optional[_Union[Tensor, _Mapping]] = ..., next_token_logprobs: _Optional[_Union[Tensor, _Mapping]] = ..., top_logprob_ids: _Optional[_Union[Tensor, _Mapping]] = ..., top_logprobs: _Optional[_Union[Tensor, _Mapping]] = ..., stats: _Optional[_Union[ForwardStats, _Mapping]] = ..., accepted_tokens: _Optional[_Union[Ragged, _Mapping]] = ..., accepted_logprobs: _Optional[_Union[Ragged, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[Ragged, _Mapping]] = ..., prompt_top_logprobs: _Optional[_Union[Ragged, _Mapping]] = ..., prompt_top_logprob_ids: _Optional[_Union[Ragged, _Mapping]] = ..., token_scores: _Optional[_Union[Ragged, _Mapping]] = ..., hidden_states: _Optional[_Union[Ragged, _Mapping]] = ..., routed_experts: _Optional[_Union[Ragged, _Mapping]] = ..., weight_version: _Optional[str] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("model_name", "architecture", "vocab_size", "hidden_size", "dtype", "device", "max_reqs", "kv_slots", "max_context_len", "max_batch_size", "max_tokens_per_batch", "eos_token_ids", "attention_backend", "server_version", "model_spec", "bos_token_id", "runtime_config", "future_slots", "tp_size", "max_top_logprobs", "quantization", "weight_bytes", "graph_capture_disabled", "linear_kernel", "sampling_controls", "vocab_mask_words", "max_logit_bias", "max_control_token_ids", "deferred_mask_timeout_ms", "max_draft_tokens", "max_ngram", "max_score_token_ids", "max_prompt_logprob_bytes", "max_hidden_bytes", "max_output_bytes", "max_routed_expert_bytes", "routed_expert_layers", "routed_experts_top_k", "allow_input_embeds", "kv_layout", "setting_choices", "loras", "max_loras", "max_lora_rank", "max_lora_name_bytes", "lora_target_modules", "weight_version", "weight_update_limits", "memory")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MAX_REQS_FIELD_NUMBER: _ClassVar[int]
    KV_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_BATCH_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_SPEC_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_CONFIG_FIELD_NUMBER: _ClassVar[int]
    FUTURE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    GRAPH_CAPTURE_DISABLED_FIELD_NUMBER: _ClassVar[int]
    LINEAR_KERNEL_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_CONTROLS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_MASK_WORDS_FIELD_NUMBER: _ClassVar[int]
    MAX_LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTROL_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_MASK_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NGRAM_FIELD_NUMBER: _ClassVar[int]
    MAX_SCORE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_LOGPROB_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_HIDDEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_ROUTED_EXPERT_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERT_LAYERS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_TOP_K_FIELD_NUMBER: _ClassVar[int]
    ALLOW_INPUT_EMBEDS_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SETTING_CHOICES_FIELD_NUMBER: _ClassVar[int]
    LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_NAME_BYTES_FIELD_NUMBER: _ClassVar[int]
    LORA_TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_UPDATE_LIMITS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    dtype: str
    device: str
    max_reqs: int
    kv_slots: int
    max_context_len: int
    max_batch_size: int
    max_tokens_per_batch: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    attention_backend: str
    server_version: str
    model_spec: str
    bos_token_id: int
    runtime_config: RuntimeConfig
    future_slots: int
    tp_size: int
    max_top_logprobs: int
    quantization: str
    weight_bytes: int
    graph_capture_disabled: str
    linear_kernel: str
    sampling_controls: _containers.RepeatedScalarFieldContainer[str]
    vocab_mask_words: int
    max_logit_bias: int
    max_control_token_ids: int
    deferred_mask_timeout_ms: int
    max_draft_tokens: int
    max_ngram: int
    max_score_token_ids: int
    max_prompt_logprob_bytes: int
    max_hidden_bytes: int
    max_output_bytes: int
    max_routed_expert_bytes: int
    routed_expert_layers: _containers.RepeatedScalarFieldContainer[int]
    routed_experts_top_k: int
    allow_input_embeds: bool
    kv_layout: KvLayout
    setting_choices: _containers.RepeatedCompositeFieldContainer[SettingChoice]
    loras: _containers.RepeatedCompositeFieldContainer[LoraAdapter]
    max_loras: int
    max_lora_rank: int
    max_lora_name_bytes: int
    lora_target_modules: _containers.RepeatedScalarFieldContainer[str]
    weight_version: str
    weight_update_limits: WeightUpdateLimits
    memory: MemoryState
    def __init__(self, model_name: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., hidden_size: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., max_reqs: _Optional[int] = ..., kv_slots: _Optional[int] = ..., max_context_len: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., max_tokens_per_batch: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., attention_backend: _Optional[str] = ..., server_version: _Optional[str] = ..., model_spec: _Optional[str] = ..., bos_token_id: _Optional[int] = ..., runtime_config: _Optional[_Union[RuntimeConfig, _Mapping]] = ..., future_slots: _Optional[int] = ..., tp_size: _Optional[int] = ..., max_top_logprobs: _Optional[int] = ..., quantization: _Optional[str] = ..., weight_bytes: _Optional[int] = ..., graph_capture_disabled: _Optional[str] = ..., linear_kernel: _Optional[str] = ..., sampling_controls: _Optional[_Iterable[str]] = ..., vocab_mask_words: _Optional[int] = ..., max_logit_bias: _Optional[int] = ..., max_control_token_ids: _Optional[int] = ..., deferred_mask_timeout_ms: _Optional[int] = ..., max_draft_tokens: _Optional[int] = ..., max_ngram: _Optional[int] = ..., max_score_token_ids: _Optional[int] = ..., max_prompt_logprob_bytes: _Optional[int] = ..., max_hidden_bytes: _Optional[int] = ..., max_output_bytes: _Optional[int] = ..., max_routed_expert_bytes: _Optional[int] = ..., routed_expert_layers: _Optional[_Iterable[int]] = ..., routed_experts_top_k: _Optional[int] = ..., allow_input_embeds: _Optional[bool] = ..., kv_layout: _Optional[_Union[KvLayout, _Mapping]] = ..., setting_choices: _Optional[_Iterable[_Union[SettingChoice, _Mapping]]] = ..., loras: _Optional[_Iterable[_Union[LoraAdapter, _Mapping]]] = ..., max_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ..., max_lora_name_bytes: _Optional[int] = ..., lora_target_modules: _Optional[_Iterable[str]] = ..., weight_version: _Optional[str] = ..., weight_update_limits: _Optional[_Union[WeightUpdateLimits, _Mapping]] = ..., memory: _Optional[_Union[MemoryState, _Mapping]] = ...) -> None: ...

class WeightUpdateLimits(_message.Message):
    __slots__ = ("max_update_bytes", "chunk_bytes", "max_tensors", "max_name_bytes", "max_version_bytes", "path_updates", "group_updates", "max_group_timeout_s")
    MAX_UPDATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_TENSORS_FIELD_NUMBER: _ClassVar[int]
    MAX_NAME_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_VERSION_BYTES_FIELD_NUMBER: _ClassVar[int]
    PATH_UPDATES_FIELD_NUMBER: _ClassVar[int]
    GROUP_UPDATES_FIELD_NUMBER: _ClassVar[int]
    MAX_GROUP_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    max_update_bytes: int
    chunk_bytes: int
    max_tensors: int
    max_name_bytes: int
    max_version_bytes: int
    path_updates: bool
    group_updates: bool
    max_group_timeout_s: float
    def __init__(self, max_update_bytes: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., max_tensors: _Optional[int] = ..., max_name_bytes: _Optional[int] = ..., max_version_bytes: _Optional[int] = ..., path_updates: _Optional[bool] = ..., group_updates: _Optional[bool] = ..., max_group_timeout_s: _Optional[float] = ...) -> None: ...

class MemoryState(_message.Message):
    __slots__ = ("released", "kv_epoch", "weights_await_update", "bytes", "seconds")
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    KV_EPOCH_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_AWAIT_UPDATE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    released: _containers.RepeatedScalarFieldContainer[str]
    kv_epoch: int
    weights_await_update: bool
    bytes: int
    seconds: float
    def __init__(self, released: _Optional[_Iterable[str]] = ..., kv_epoch: _Optional[int] = ..., weights_await_update: _Optional[bool] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class SettingChoice(_message.Message):
    __slots__ = ("setting", "value", "reason")
    SETTING_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    setting: str
    value: str
    reason: str
    def __init__(self, setting: _Optional[str] = ..., value: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class KvLayout(_message.Message):
    __slots__ = ("num_layers", "kv_heads", "kv_heads_total", "head_dim", "dtype", "kv_slots", "bytes_per_slot", "tp_size", "max_transfer_slots", "max_transfer_runs", "chunk_bytes", "max_push_transfers", "transfer_memory")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_SLOTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_SLOT_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_TRANSFER_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MAX_TRANSFER_RUNS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_PUSH_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MEMORY_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    kv_heads: int
    kv_heads_total: int
    head_dim: int
    dtype: DType
    kv_slots: int
    bytes_per_slot: int
    tp_size: int
    max_transfer_slots: int
    max_transfer_runs: int
    chunk_bytes: int
    max_push_transfers: int
    transfer_memory: int
    def __init__(self, num_layers: _Optional[int] = ..., kv_heads: _Optional[int] = ..., kv_heads_total: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., kv_slots: _Optional[int] = ..., bytes_per_slot: _Optional[int] = ..., tp_size: _Optional[int] = ..., max_transfer_slots: _Optional[int] = ..., max_transfer_runs: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., max_push_transfers: _Optional[int] = ..., transfer_memory: _Optional[int] = ...) -> None: ...

class KvRuns(_message.Message):
    __slots__ = ("runs",)
    RUNS_FIELD_NUMBER: _ClassVar[int]
    runs: Tensor
    def __init__(self, runs: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class KvChunk(_message.Message):
    __slots__ = ("rank", "layer", "kind", "first", "count", "data", "crc32")
    RANK_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    rank: int
    layer: int
    kind: KvKind
    first: int
    count: int
    data: bytes
    crc32: int
    def __init__(self, rank: _Optional[int] = ..., layer: _Optional[int] = ..., kind: _Optional[_Union[KvKind, str]] = ..., first: _Optional[int] = ..., count: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ...) -> None: ...

class KvExportRequest(_message.Message):
    __slots__ = ("slots", "transfer_id")
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    slots: KvRuns
    transfer_id: int
    def __init__(self, slots: _Optional[_Union[KvRuns, _Mapping]] = ..., transfer_id: _Optional[int] = ...) -> None: ...

class KvTransferHeader(_message.Message):
    __slots__ = ("transfer_id", "layout", "num_slots", "token_ids", "num_chunks")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    layout: KvLayout
    num_slots: int
    token_ids: Tensor
    num_chunks: int
    def __init__(self, transfer_id: _Optional[int] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., num_slots: _Optional[int] = ..., token_ids: _Optional[_Union[Tensor, _Mapping]] = ..., num_chunks: _Optional[int] = ...) -> None: ...

class KvExportResponse(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: KvTransferHeader
    chunk: KvChunk
    def __init__(self, header: _Optional[_Union[KvTransferHeader, _Mapping]] = ..., chunk: _Optional[_Union[KvChunk, _Mapping]] = ...) -> None: ...

class KvImportHeader(_message.Message):
    __slots__ = ("transfer_id", "req_pool_index", "slots", "token_ids", "layout")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REQ_POOL_INDEX_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    req_pool_index: int
    slots: KvRuns
    token_ids: Tensor
    layout: KvLayout
    def __init__(self, transfer_id: _Optional[int] = ..., req_pool_index: _Optional[int] = ..., slots: _Optional[_Union[KvRuns, _Mapping]] = ..., token_ids: _Optional[_Union[Tensor, _Mapping]] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ...) -> None: ...

class KvImportRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: KvImportHeader
    chunk: KvChunk
    def __init__(self, header: _Optional[_Union[KvImportHeader, _Mapping]] = ..., chunk: _Optional[_Union[KvChunk, _Mapping]] = ...) -> None: ...

class KvImportResponse(_message.Message):
    __slots__ = ("transfer_id", "num_slots", "bytes", "replayed")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    num_slots: int
    bytes: int
    replayed: bool
    def __init__(self, transfer_id: _Optional[int] = ..., num_slots: _Optional[int] = ..., bytes: _Optional[int] = ..., replayed: _Optional[bool] = ...) -> None: ...

class KvPushTransfer(_message.Message):
    __slots__ = ("transfer_id", "source_slots", "target", "target_req_pool_index", "target_slots", "timeout_s")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    TARGET_REQ_POOL_INDEX_FIELD_NUMBER: _ClassVar[int]
    TARGET_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    source_slots: KvRuns
    target: str
    target_req_pool_index: int
    target_slots: KvRuns
    timeout_s: float
    def __init__(self, transfer_id: _Optional[int] = ..., source_slots: _Optional[_Union[KvRuns, _Mapping]] = ..., target: _Optional[str] = ..., target_req_pool_index: _Optional[int] = ..., target_slots: _Optional[_Union[KvRuns, _Mapping]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class KvPushRequest(_message.Message):
    __slots__ = ("transfers",)
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    transfers: _containers.RepeatedCompositeFieldContainer[KvPushTransfer]
    def __init__(self, transfers: _Optional[_Iterable[_Union[KvPushTransfer, _Mapping]]] = ...) -> None: ...

class KvTransferResult(_message.Message):
    __slots__ = ("transfer_id", "ok", "code", "message", "bytes", "seconds", "replayed")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    ok: bool
    code: str
    message: str
    bytes: int
    seconds: float
    replayed: bool
    def __init__(self, transfer_id: _Optional[int] = ..., ok: _Optional[bool] = ..., code: _Optional[str] = ..., message: _Optional[str] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., replayed: _Optional[bool] = ...) -> None: ...

class KvPushResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[KvTransferResult]
    def __init__(self, results: _Optional[_Iterable[_Union[KvTransferResult, _Mapping]]] = ...) -> None: ...

class WeightTensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class WeightUpdateHeader(_message.Message):
    __slots__ = ("weight_version", "tensors")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    weight_version: str
    tensors: _containers.RepeatedCompositeFieldContainer[WeightTensorSpec]
    def __init__(self, weight_version: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[WeightTensorSpec, _Mapping]]] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("tensor", "offset", "data", "crc32")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    tensor: int
    offset: int
    data: bytes
    crc32: int
    def __init__(self, tensor: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ...) -> None: ...

class WeightUpdateRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: WeightUpdateHeader
    chunk: WeightChunk
    def __init__(self, header: _Optional[_Union[WeightUpdateHeader, _Mapping]] = ..., chunk: _Optional[_Union[WeightChunk, _Mapping]] = ...) -> None: ...

class WeightUpdateResponse(_message.Message):
    __slots__ = ("weight_version", "num_tensors", "bytes", "stage_seconds", "swap_seconds")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    STAGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SWAP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    weight_version: str
    num_tensors: int
    bytes: int
    stage_seconds: float
    swap_seconds: float
    def __init__(self, weight_version: _Optional[str] = ..., num_tensors: _Optional[int] = ..., bytes: _Optional[int] = ..., stage_seconds: _Optional[float] = ..., swap_seconds: _Optional[float] = ...) -> None: ...

class UpdateWeightsFromPathRequest(_message.Message):
    __slots__ = ("path", "weight_version")
    PATH_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    path: str
    weight_version: str
    def __init__(self, path: _Optional[str] = ..., weight_version: _Optional[str] = ...) -> None: ...

class InitWeightsGroupRequest(_message.Message):
    __slots__ = ("master_address", "master_port", "rank_offset", "world_size", "backend", "group_name", "timeout_s")
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    backend: str
    group_name: str
    timeout_s: float
    def __init__(self, master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., rank_offset: _Optional[int] = ..., world_size: _Optional[int] = ..., backend: _Optional[str] = ..., group_name: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class InitWeightsGroupResponse(_message.Message):
    __slots__ = ("rank", "world_size", "backend")
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    rank: int
    world_size: int
    backend: str
    def __init__(self, rank: _Optional[int] = ..., world_size: _Optional[int] = ..., backend: _Optional[str] = ...) -> None: ...

class UpdateWeightsFromGroupRequest(_message.Message):
    __slots__ = ("weight_version", "tensors", "src_rank")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    SRC_RANK_FIELD_NUMBER: _ClassVar[int]
    weight_version: str
    tensors: _containers.RepeatedCompositeFieldContainer[WeightTensorSpec]
    src_rank: int
    def __init__(self, weight_version: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[WeightTensorSpec, _Mapping]]] = ..., src_rank: _Optional[int] = ...) -> None: ...

class DestroyWeightsGroupRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DestroyWeightsGroupResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReleaseMemoryRequest(_message.Message):
    __slots__ = ("tags",)
    TAGS_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tags: _Optional[_Iterable[str]] = ...) -> None: ...

class ResumeMemoryRequest(_message.Message):
    __slots__ = ("tags", "weights_from_update")
    TAGS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FROM_UPDATE_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.RepeatedScalarFieldContainer[str]
    weights_from_update: bool
    def __init__(self, tags: _Optional[_Iterable[str]] = ..., weights_from_update: _Optional[bool] = ...) -> None: ...

class RuntimeConfig(_message.Message):
    __slots__ = ("eager_input_no_copy", "needs_cpu_seq_lens", "graph_mode", "log_level", "trace_sample_ratio", "needs_cpu_seq_lens_effective", "graph_capture")
    EAGER_INPUT_NO_COPY_FIELD_NUMBER: _ClassVar[int]
    NEEDS_CPU_SEQ_LENS_FIELD_NUMBER: _ClassVar[int]
    GRAPH_MODE_FIELD_NUMBER: _ClassVar[int]
    LOG_LEVEL_FIELD_NUMBER: _ClassVar[int]
    TRACE_SAMPLE_RATIO_FIELD_NUMBER: _ClassVar[int]
    NEEDS_CPU_SEQ_LENS_EFFECTIVE_FIELD_NUMBER: _ClassVar[int]
    GRAPH_CAPTURE_FIELD_NUMBER: _ClassVar[int]
    eager_input_no_copy: bool
    needs_cpu_seq_lens: NeedsCpuSeqLens
    graph_mode: GraphMode
    log_level: str
    trace_sample_ratio: float
    needs_cpu_seq_lens_effective: bool
    graph_capture: str
    def __init__(self, eager_input_no_copy: _Optional[bool] = ..., needs_cpu_seq_lens: _Optional[_Union[NeedsCpuSeqLens, str]] = ..., graph_mode: _Optional[_Union[GraphMode, str]] = ..., log_level: _Optional[str] = ..., trace_sample_ratio: _Optional[float] = ..., needs_cpu_seq_lens_effective: _Optional[bool] = ..., graph_capture: _Optional[str] = ...) -> None: ...

class GetRuntimeConfigRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UpdateRuntimeConfigRequest(_message.Message):
    __slots__ = ("config",)
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    config: RuntimeConfig
    def __init__(self, config: _Optional[_Union[RuntimeConfig, _Mapping]] = ...) -> None: ...

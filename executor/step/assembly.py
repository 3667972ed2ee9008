"""`assemble_step`: the step and its features, in hook order, over an executor's model, KV
pool, future-token table and runner, and the KV data plane over the same pools and slot tokens.
A new feature is one more entry in the list here; `Step` names none of them
(`executor.core.features`)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from executor.config import ExecutorConfig
from executor.controls.step_controls import StepControls
from executor.core.errors import TestHooks
from executor.core.features import StepFeature
from executor.core.limits import BatchLimits
from executor.core.observer import ExecutorObserver
from executor.core.toggles import Toggles
from executor.extras.compute import PooledSums
from executor.extras.feature import Extras
from executor.future_tokens import FutureTokens, FutureTokenTable
from executor.kv_cache import KVPool, ReqToTokenPool
from executor.kv_transfer.engine import KVTransfer
from executor.kv_transfer.layout import KVLayout, KVTransferLimits
from executor.lora.adapters import LoraAdapters
from executor.model_runner import ModelRunner
from executor.models.decoder_model import DecoderModel
from executor.parallel.comm import TpComm
from executor.row_table import RowTable
from executor.sampling import Sampler
from executor.speculative.speculation import Speculation
from executor.step.step import Step
from executor.step.timeline import DeviceTimeline
from ops.h2d_staging import H2DStaging


@dataclass
class StepParts:
    controls: StepControls  # the sampling controls (their slot tokens serve the KV plane too)
    features: list[StepFeature]  # in hook order
    step: Step
    kv_transfer: KVTransfer  # this rank's heads of a request's K/V, out of and into the pool


def assemble_step(
    config: ExecutorConfig,
    limits: BatchLimits,
    *,
    model: DecoderModel,
    device: torch.device,
    pool: ReqToTokenPool,
    future: FutureTokenTable,
    lora: LoraAdapters | None,
    runner: ModelRunner,
    toggles: Toggles,
    hooks: TestHooks,
    comm: TpComm,
    observer: ExecutorObserver,
    lock: threading.RLock,
    kv_pool: KVPool,
    max_context_len: int,
) -> StepParts:
    mcfg = model.config
    sampler = Sampler(device, config.seed)
    controls = StepControls(
        limits,
        mcfg.eos_token_ids,
        device,
        deferred_mask_timeout_s=config.deferred_mask_timeout_s,
        req_to_token=pool.req_to_token,
        future_table=future.tokens,
    )
    row_table = RowTable(pool)
    features: list[StepFeature] = [
        Speculation(
            controls.slot_tokens,
            limits,
            pool=pool,
            future_table=future.tokens,
            tp_size=comm.size,
            generator=sampler.generator,
        ),
        row_table,
        FutureTokens(future),
        *([lora.rows] if lora is not None else []),
        Extras(
            limits,
            model,
            PooledSums(limits.max_reqs, mcfg.hidden_size, device),
            future_table=future.tokens,
            tp_size=comm.size,
        ),
        controls,
    ]
    step = Step(
        limits=limits,
        allow_custom_positions=config.allow_custom_positions,
        row_table=row_table,
        future=future,
        features=features,
        runner=runner,
        sampler=sampler,
        staging=H2DStaging(device),
        toggles=toggles,
        hooks=hooks,
        comm=comm,
        observer=observer,
        lock=lock,
        timeline=DeviceTimeline(device, config.simulated_step_ms),
    )
    kv_transfer = KVTransfer(
        pool,
        kv_pool,
        controls.slot_tokens,
        KVLayout(
            num_layers=mcfg.num_layers,
            kv_heads=model.plan.num_kv_heads,
            kv_heads_total=mcfg.num_kv_heads,
            head_dim=mcfg.head_dim,
            dtype=kv_pool.dtype,
            kv_slots=config.kv_slots,
            tp_size=comm.size,
        ),
        KVTransferLimits(max_slots=max_context_len, max_runs=max_context_len),
        lock,
        comm=comm,
    )
    return StepParts(controls, features, step, kv_transfer)

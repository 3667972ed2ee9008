"""A seeded structured fuzzer for `Forward` and the KV plane: valid EXTEND / DECODE / IDLE
batches from a scheduler-like generator (tests/random_batches.py), most of them mutated before
they are sent (wrong dtype / shape / byte length, out-of-range and negative indices, NaN / inf
embeddings, absurd sampling values, huge `top_logprobs_num`, released rows, wrong modes, an
extreme int64/int32/uint64 value in any integer field or tensor, bit flips and truncations of
the serialized message); with `kv_peer`, a share of ExportKV / ImportKV / PushKV messages
(tests/kv_fuzzer.py).

Properties, checked for every message against an in-process server:
- a batch is answered OK, INVALID_ARGUMENT or RESOURCE_EXHAUSTED, a KV message also
  FAILED_PRECONDITION, PERMISSION_DENIED or DATA_LOSS (never INTERNAL, never a crash);
- a refused message changes nothing: the row table, resident lengths and K/V of live rows
  (tests/state_util.py) are the same before and after; a KV message never changes them;
- the server stays SERVING.
`tests/test_fuzz.py` runs a few thousand messages; `benchmarks/fuzz.py` the long run.
"""

from __future__ import annotations

import copy
import random
import struct
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import numpy as np
import torch

from executor.batch_prep import make_idle_batch
from executor.core.limits import BatchLimits
from executor.service.codec import batch_to_proto, response_from_proto
from executor.service.server import RunningServer
from model_executor.v1 import executor_pb2 as pb
from tests.kv_fuzzer import KV_ALLOWED, KVFuzz, extreme_int
from tests.random_batches import BatchGenerator
from tests.state_util import state_digest

FORWARD = "/model_executor.v1.ModelExecutor/Forward"
ALLOWED = frozenset(
    {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
)
# Every Tensor field of the wire's ForwardBatch.
TENSORS = tuple(
    f.name
    for f in pb.ForwardBatch.DESCRIPTOR.fields
    if f.message_type is not None and f.message_type.full_name == pb.Tensor.DESCRIPTOR.full_name
)
_NP = {pb.INT32: "<i4", pb.INT64: "<i8", pb.FLOAT32: "<f4", pb.FLOAT16: "<f2"}


@dataclass
class FuzzReport:
    messages: int = 0
    codes: Counter[str] = field(default_factory=Counter)
    mutations: Counter[str] = field(default_factory=Counter)
    accepted_mutations: Counter[str] = field(default_factory=Counter)  # mutated, still valid
    violations: list[str] = field(default_factory=list)


class Fuzzer:
    """`kv_peer`: a peer the server's kv_peers lists where nothing listens; with it, a
    `kv_ratio` share of the messages are KV-plane calls (the server needs kv_transfer)."""

    def __init__(
        self, server: RunningServer, seed: int, kv_peer: str | None = None, kv_ratio: float = 0.1
    ) -> None:
        assert server.worker is not None
        self.server = server
        self.executor = server.worker.executor
        self.limits: BatchLimits = self.executor.limits
        self.seed = seed
        self.rng = random.Random(seed)
        self.generations = 0
        self.gen = self._fresh_generator()
        self.step = 0
        self.channel = grpc.insecure_channel(
            f"127.0.0.1:{server.port}",
            options=[("grpc.max_send_message_length", 1 << 30)],
        )
        self.forward = self.channel.unary_unary(FORWARD)  # bytes in, bytes out
        self.report = FuzzReport()
        self.mutators: dict[str, Callable[[pb.ForwardRequest], None]] = {
            "dtype": self._m_dtype,
            "shape": self._m_shape,
            "byte_length": self._m_byte_length,
            "index": self._m_index,
            "embeds_nan_inf": self._m_embeds,
            "sampling": self._m_sampling,
            "top_logprobs": self._m_top_logprobs,
            "released_rows": self._m_released,
            "mode": self._m_mode,
            "drop_field": self._m_drop,
            "extreme_int": lambda msg: extreme_int(msg, self.rng),
        }
        self.kv_ratio = kv_ratio if kv_peer else 0.0
        self.kv = (
            KVFuzz(self.channel, self.limits, kv_peer, self.rng) if kv_peer is not None else None
        )

    def _fresh_generator(self) -> BatchGenerator:
        self.generations += 1
        return BatchGenerator(
            seed=self.seed * 1000 + self.generations,
            limits=self.limits,
            max_request_len=min(300, self.limits.max_context_len),
        )

    def close(self) -> None:
        self.channel.close()

    # --- the loop ------------------------------------------------------------------------
    def run(self, messages: int, mutate_ratio: float = 0.75) -> FuzzReport:
        for _ in range(messages):
            self.one(mutate_ratio)
        self.resync()
        return self.report

    def one(self, mutate_ratio: float) -> None:
        if self.kv is not None and self.rng.random() < self.kv_ratio:
            self.one_kv()
            return
        saved = copy.deepcopy(self.gen)  # the generator's view if this batch is not applied
        fb = self.gen.next_batch(self.step)
        self.step += 1
        request = pb.ForwardRequest(batch_id=self.step, batch=batch_to_proto(fb))
        kind = "valid"
        if self.rng.random() < mutate_ratio:
            kind = self.rng.choice([*self.mutators, "bit_flip", "truncate"])
        if kind in self.mutators:
            self.mutators[kind](request)
        data = request.SerializeToString()
        if kind == "bit_flip":
            raw = bytearray(data)
            for _ in range(self.rng.randint(1, 4)):
                if raw:
                    raw[self.rng.randrange(len(raw))] ^= 1 << self.rng.randrange(8)
            data = bytes(raw)
        elif kind == "truncate":
            data = data[: self.rng.randrange(len(data))] if data else data
        self.report.messages += 1
        self.report.mutations[kind] += 1
        before = state_digest(self.executor)
        answer, code, details = self._call(data)
        self.report.codes[code.name] += 1
        if code not in ALLOWED:
            self.report.violations.append(f"message {self.step} ({kind}): {code.name} {details}")
        if code is not grpc.StatusCode.OK:
            if state_digest(self.executor) != before:
                self.report.violations.append(
                    f"message {self.step} ({kind}): refused, state changed"
                )
            self.gen = saved
            return
        if kind == "valid":
            assert answer is not None
            self.gen.observe(
                fb, response_from_proto(pb.ForwardResponse.FromString(answer)).next_token_ids
            )
            return
        # A mutation the executor accepted: legal, but its effect on rows is unknown here.
        self.report.accepted_mutations[kind] += 1
        self.resync()

    def one_kv(self) -> None:
        """One KV-plane message: whatever it answers, the state is unchanged."""
        assert self.kv is not None
        if self.kv.layout is None:
            info = pb.GetInfoResponse.FromString(
                self.channel.unary_unary("/model_executor.v1.ModelExecutor/GetInfo")(
                    pb.GetInfoRequest().SerializeToString(), timeout=60
                )
            )
            self.kv.layout = info.kv_layout
        live = [s for r in self.gen.reqs.values() for s in r.slots]
        kind, call = self.kv.message(live)
        self.step += 1
        self.report.messages += 1
        self.report.mutations[f"kv_{kind}"] += 1
        before = state_digest(self.executor)
        try:
            call()
            code, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as exc:
            code, details = exc.code(), str(exc.details())
        self.report.codes[code.name] += 1
        if code not in KV_ALLOWED:
            self.report.violations.append(f"message {self.step} (kv_{kind}): {code.name} {details}")
        if state_digest(self.executor) != before:
            self.report.violations.append(f"message {self.step} (kv_{kind}): state changed")

    def _call(self, data: bytes) -> tuple[bytes | None, grpc.StatusCode, str]:
        try:
            return self.forward(data, timeout=60), grpc.StatusCode.OK, ""
        except grpc.RpcError as exc:
            return None, exc.code(), str(exc.details())

    def resync(self) -> None:
        """Release every row on the server and start a fresh generator."""
        rows = torch.arange(1, self.limits.max_reqs + 1)
        idle = make_idle_batch()
        idle.released_req_pool_indices = rows
        request = pb.ForwardRequest(batch_id=0, batch=batch_to_proto(idle))
        self.forward(request.SerializeToString(), timeout=60)
        assert int(self.executor.req_to_token_pool.resident_lens.sum()) == 0
        self.gen = self._fresh_generator()

    # --- mutations (each on the parsed request) ------------------------------------------
    def _present(self, msg: pb.ForwardRequest) -> list[str]:
        return [n for n in TENSORS if msg.batch.HasField(n)]

    def _tensor(self, msg: pb.ForwardRequest) -> pb.Tensor | None:
        names = self._present(msg)
        return getattr(msg.batch, self.rng.choice(names)) if names else None

    def _m_dtype(self, msg: pb.ForwardRequest) -> None:
        t = self._tensor(msg)
        if t is not None:
            t.dtype = self.rng.choice([0, 1, 2, 3, 4, 5, 77])

    def _m_shape(self, msg: pb.ForwardRequest) -> None:
        t = self._tensor(msg)
        if t is None:
            return
        op = self.rng.randrange(4)
        if op == 0:
            t.shape.append(self.rng.choice([1, 2, 0]))
        elif op == 1 and t.shape:
            t.shape.pop()
        elif t.shape:
            i = self.rng.randrange(len(t.shape))
            t.shape[i] = self.rng.choice([0, -1, t.shape[i] + 1, t.shape[i] - 1, 2**40, 2**62])

    def _m_byte_length(self, msg: pb.ForwardRequest) -> None:
        t = self._tensor(msg)
        if t is None:
            return
        if t.data and self.rng.random() < 0.5:
            t.data = t.data[: self.rng.randrange(len(t.data))]
        else:
            t.data = t.data + bytes(self.rng.randint(1, 9))

    def _m_index(self, msg: pb.ForwardRequest) -> None:
        names = [n for n in self._present(msg) if n != "input_embeds"]
        if not names:
            return
        name = self.rng.choice(names)
        t = getattr(msg.batch, name)
        if t.dtype not in (pb.INT32, pb.INT64) or not t.data:
            return
        values = np.frombuffer(t.data, dtype=_NP[t.dtype]).copy()
        lim = self.limits
        bad = [-1, 0, lim.max_reqs + 1, lim.kv_slots + 1, lim.max_context_len + 1, lim.vocab_size]
        bad += [2**31 - 1, -(2**31)] + ([2**62, -(2**62)] if t.dtype == pb.INT64 else [])
        values[self.rng.randrange(len(values))] = self.rng.choice(bad)
        if self.rng.random() < 0.2 and len(values) > 1:  # a duplicate
            values[self.rng.randrange(len(values))] = values[0]
        t.data = values.tobytes()

    def _m_embeds(self, msg: pb.ForwardRequest) -> None:
        b = msg.batch
        if not b.HasField("input_embeds"):
            n = len(b.out_cache_loc.data) // (8 if b.out_cache_loc.dtype == pb.INT64 else 4)
            if n == 0:
                return
            rows = np.random.default_rng(self.rng.randrange(2**31)).standard_normal(
                (n, self.limits.hidden_size), dtype=np.float32
            )
            b.input_embeds.CopyFrom(pb.Tensor(dtype=pb.FLOAT32, shape=list(rows.shape)))
            b.input_embeds.data = rows.tobytes()
            b.ClearField("input_ids")
        t = b.input_embeds
        if t.dtype != pb.FLOAT32:
            return
        values = np.frombuffer(t.data, dtype="<f4").copy()
        for _ in range(self.rng.randint(1, 3)):
            values[self.rng.randrange(len(values))] = self.rng.choice(
                [np.nan, np.inf, -np.inf, 3e38]
            )
        t.data = values.tobytes()

    def _m_sampling(self, msg: pb.ForwardRequest) -> None:
        b = msg.batch
        bs = len(b.req_pool_indices.data) // (8 if b.req_pool_indices.dtype == pb.INT64 else 4)
        if self.rng.random() < 0.3:  # a wrong number of entries
            del b.sampling_params[:]
            for _ in range(bs + self.rng.choice([1, 2, -1 if bs > 2 else 1])):
                b.sampling_params.add()
            return
        if not b.sampling_params:
            b.sampling_params.add()
        p = self.rng.choice(list(b.sampling_params))
        absurd: dict[str, list[float]] = {
            "temperature": [-1.0, float("nan"), float("inf"), 1e30, -0.0],
            "top_p": [-0.5, 1.5, float("nan"), float("inf")],
            "top_k": [-5, 2**31 - 1, -(2**31)],
            "min_p": [-1.0, 2.0, float("nan")],
        }
        name = self.rng.choice(list(absurd))
        value = self.rng.choice(absurd[name])
        setattr(p, name, int(value) if name == "top_k" else value)
        if self.rng.random() < 0.3:
            p.seed = self.rng.choice([0, 2**64 - 1])

    def _m_top_logprobs(self, msg: pb.ForwardRequest) -> None:
        msg.batch.return_logprob = self.rng.random() < 0.8
        msg.batch.top_logprobs_num = self.rng.choice(
            [-1, self.limits.vocab_size + 1, 10**9, 2**31 - 1, -(2**31)]
        )

    def _m_released(self, msg: pb.ForwardRequest) -> None:
        b = msg.batch
        rows = (
            np.frombuffer(b.req_pool_indices.data, dtype=_NP[b.req_pool_indices.dtype]).tolist()
            if b.HasField("req_pool_indices") and b.req_pool_indices.dtype in _NP
            else []
        )
        choice = self.rng.randrange(4)
        if choice == 0 and rows:
            released = [rows[0]]  # a row of this batch
        elif choice == 1:
            released = [self.rng.choice([0, -3, self.limits.max_reqs + 1])]
        elif choice == 2:
            r = self.rng.randint(1, self.limits.max_reqs)
            released = [r, r]  # twice
        else:
            released = [self.rng.randint(1, self.limits.max_reqs)]  # maybe a live row: legal
        b.released_req_pool_indices.CopyFrom(
            pb.Tensor(
                dtype=pb.INT64,
                shape=[len(released)],
                data=struct.pack(f"<{len(released)}q", *released),
            )
        )

    def _m_mode(self, msg: pb.ForwardRequest) -> None:
        msg.batch.forward_mode = self.rng.choice([0, 1, 2, 3, 99])

    def _m_drop(self, msg: pb.ForwardRequest) -> None:
        names = self._present(msg)
        if names:
            msg.batch.ClearField(self.rng.choice(names))

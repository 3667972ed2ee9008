"""The soak run's core (benchmarks/soak.py is its command line; tests/test_soak.py a short run).

N concurrent schedulers drive one in-process server: most over a `ForwardStream` each, some
with unary `Forward` calls. Each owns its rows and slots and repeats a cycle: an EXTEND of two
fresh requests (random prompts; one greedy, one seeded sampling), a random number of DECODE
steps, then an IDLE batch releasing both rows. A cycle is generated from a seed, so its
tokens can be replayed: every scheduler keeps a running digest of its cycles' tokens (memory
stays flat however long the run), and afterwards each scheduler's cycles are replayed one by
one on an in-process executor, whose digest must be equal.

While it runs, the process's resident memory is sampled every `rss_every_s` seconds. At the
end the rows and slots gauges (`/metrics`) must be back to zero.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil
import torch

from executor.batch_prep import make_decode_batch, make_extend_batch, make_idle_batch
from executor.client.grpc_client import ExecutorClient, ForwardSession
from executor.config import ExecutorConfig
from executor.core.forward_batch import ForwardBatch, SamplingParams
from executor.core.outputs import ForwardOutput
from executor.model_executor import ModelExecutor
from tests.server_util import Scrape, running_server

ROWS_PER_SCHEDULER = 2
MAX_PROMPT = 16
MAX_DECODE = 16
SLOTS_PER_SCHEDULER = ROWS_PER_SCHEDULER * (MAX_PROMPT + MAX_DECODE)


def soak_config(base: ExecutorConfig, schedulers: int) -> ExecutorConfig:
    """Rows and slots for `schedulers`, each with its own."""
    return dataclasses.replace(
        base,
        max_reqs=schedulers * ROWS_PER_SCHEDULER,
        kv_slots=schedulers * SLOTS_PER_SCHEDULER,
        max_context_len=max(base.max_context_len or 0, MAX_PROMPT + MAX_DECODE + 1),
    )


@dataclass
class SchedulerRun:
    index: int
    unary: bool
    cycles: int = 0
    steps: int = 0
    digest: str = ""
    errors: list[str] = field(default_factory=list)


@dataclass
class SoakResult:
    seconds: float
    schedulers: list[SchedulerRun]
    rss_mib: list[float]  # samples, in order
    gauges_after: dict[str, float]
    replay_mismatches: list[int]  # schedulers whose replay digest differs

    @property
    def steps(self) -> int:
        return sum(s.steps for s in self.schedulers)

    @property
    def errors(self) -> list[str]:
        return [e for s in self.schedulers for e in s.errors]


def run_cycle(
    forward: Callable[[ForwardBatch], ForwardOutput], index: int, seed: int, digest: object
) -> int:
    """One cycle of scheduler `index` (rows and slots its own); feeds its tokens to `digest`
    (a hashlib object). The number of steps."""
    rng = random.Random(seed)
    rows = [index * ROWS_PER_SCHEDULER + r + 1 for r in range(ROWS_PER_SCHEDULER)]
    slot0 = index * SLOTS_PER_SCHEDULER + 1
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(1, MAX_PROMPT))] for _ in rows]
    sampling = [
        SamplingParams(),
        SamplingParams(temperature=0.9, top_p=0.9, seed=rng.randrange(2**32)),
    ]
    locs, next_slot = [], slot0
    for p in prompts:
        locs.append(list(range(next_slot, next_slot + len(p))))
        next_slot += len(p)
    lens = [len(p) for p in prompts]
    out = forward(
        make_extend_batch(
            input_ids=prompts, req_pool_indices=rows, out_cache_loc=locs, sampling=sampling
        )
    )
    last = out.next_token_ids.tolist()
    digest.update(repr(last).encode())  # type: ignore[attr-defined]
    steps = 1
    for _ in range(rng.randint(0, MAX_DECODE - 1)):
        lens = [n + 1 for n in lens]
        out = forward(
            make_decode_batch(
                input_ids=last,
                req_pool_indices=rows,
                seq_lens=lens,
                out_cache_loc=[next_slot, next_slot + 1],
                sampling=sampling,
            )
        )
        next_slot += 2
        last = out.next_token_ids.tolist()
        digest.update(repr(last).encode())  # type: ignore[attr-defined]
        steps += 1
    release = dataclasses.replace(
        make_idle_batch(), released_req_pool_indices=torch.tensor(rows, dtype=torch.int64)
    )
    forward(release)
    return steps + 1


def _cycle_seed(index: int, cycle: int) -> int:
    return index * 1_000_003 + cycle


def _scheduler(target: str, run: SchedulerRun, deadline: float) -> None:
    digest = hashlib.sha256()
    try:
        with ExecutorClient(target) as client:
            session: ForwardSession | None = None if run.unary else client.open_stream()

            def forward(batch: ForwardBatch) -> ForwardOutput:
                if session is None:
                    return client.forward(batch, timeout=120)
                session.send(batch)
                return session.recv()

            while time.monotonic() < deadline:
                run.steps += run_cycle(
                    forward, run.index, _cycle_seed(run.index, run.cycles), digest
                )
                run.cycles += 1
            if session is not None:
                session.close()
    except Exception as exc:  # recorded: the soak reports every error
        run.errors.append(f"scheduler {run.index}: {type(exc).__name__}: {exc}")
    run.digest = digest.hexdigest()


def replay(config: ExecutorConfig, runs: list[SchedulerRun]) -> list[int]:
    """Replay every scheduler's cycles serially in-process; the schedulers whose digest differs."""
    executor = ModelExecutor(config)
    mismatches = []
    for run in runs:
        digest = hashlib.sha256()
        for cycle in range(run.cycles):
            run_cycle(executor.forward, run.index, _cycle_seed(run.index, cycle), digest)
        if digest.hexdigest() != run.digest:
            mismatches.append(run.index)
    return mismatches


def soak(
    config: ExecutorConfig,
    *,
    streams: int,
    unary: int,
    seconds: float,
    rss_every_s: float = 5.0,
    progress: Callable[[str], None] | None = None,
) -> SoakResult:
    n = streams + unary
    config = soak_config(config, n)
    runs = [SchedulerRun(i, unary=i >= streams) for i in range(n)]
    process = psutil.Process()
    rss: list[float] = []
    # A stream holds one gRPC handler thread for its whole life: one per scheduler, plus room
    # (health, GetInfo); each scheduler's call counts against max_forward_calls.
    with running_server(
        config,
        queue_size=max(64, 2 * n),
        stream_window=2,
        rpc_threads=n + 4,
        max_forward_calls=n,
    ) as server:
        target = f"127.0.0.1:{server.port}"
        t0 = time.monotonic()
        deadline = t0 + seconds
        threads = [
            threading.Thread(target=_scheduler, args=(target, run, deadline), daemon=True)
            for run in runs
        ]
        for t in threads:
            t.start()
        next_sample = t0
        while alive := [t for t in threads if t.is_alive()]:
            if time.monotonic() >= next_sample:
                rss.append(process.memory_info().rss / 2**20)
                next_sample += rss_every_s
                if progress is not None:
                    progress(
                        f"{time.monotonic() - t0:.0f} s: {sum(r.steps for r in runs)} steps, "
                        f"rss {rss[-1]:.0f} MiB"
                    )
            alive[0].join(timeout=max(0.0, next_sample - time.monotonic()))
        elapsed = time.monotonic() - t0
        rss.append(process.memory_info().rss / 2**20)
        scrape = Scrape(server)
        gauges = {
            name: scrape.get(f"model_executor_{name}")
            for name in ("req_rows_used", "kv_slots_used", "queue_depth")
        }
    mismatches = replay(config, runs)
    return SoakResult(elapsed, runs, rss, gauges, mismatches)

"""JSON-schema constrained decode vs unconstrained decode, tokens/s at one batch size (issue 25).

    .venv/bin/python benchmarks/constrained_decode.py                   # SmolLM2-135M, bs 8
    .venv/bin/python benchmarks/constrained_decode.py --model tiny-random --repeats 1

The server runs in its own process (`python -m executor serve`). Both runs are the reference
scheduler overlapped on one ForwardStream (step N+1 is sent before step N's tokens are read),
greedy, `--bs` requests at once:

- constrained: every request has the JSON schema; each step is sent with a deferred mask and
  its mask (xgrammar, on this side) follows as soon as the previous tokens are read, so it is
  computed while the device runs the forward and waits for it only at sampling;
- unconstrained: the same prompts with no schema, each request stopped at the length its
  constrained run had (EOS ignored), so both runs step the same batch shapes.

The runs alternate (constrained first in even pairs), so a drift in the machine's speed lands
on both; tok/s is the best run of each, the ratio the median of the pairs'. Every constrained
answer is checked to parse as JSON. Besides tok/s it reports the scheduler's mask time per
step and the device's `sample` phase per step (which includes the wait for a deferred mask).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Run from a checkout: this tree's packages and generated stubs, and served.py beside this file.
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "proto"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from served import cpu_description, served

from executor.client.grammar import Grammars
from executor.client.grpc_client import ExecutorClient, ForwardSession
from executor.client.scheduler import ReferenceScheduler, Request
from executor.core.controls_types import VocabMask
from executor.core.forward_batch import ForwardBatch
from executor.core.outputs import ForwardOutput
from executor.models.loader import resolve_model_spec
from executor.models.tokenizer import Tokenizer, load_tokenizer

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "member": {"type": "boolean"},
        "plan": {"enum": ["free", "pro", "team"]},
    },
    "required": ["name", "age", "city", "member", "plan"],
}
PROMPTS = [
    "Describe a customer of a bakery as JSON.",
    "Give me a JSON record for a new library member.",
    "Invent a gym member and write them as JSON.",
    "A JSON profile of a cyclist from Lyon, please.",
    "Return a JSON user for a chess club.",
    "Make up a person who likes jazz, as JSON.",
    "A JSON object describing a retired teacher.",
    "Write a JSON customer record for an online shop.",
]


class RecordingPipe:
    """A ForwardSession that keeps every answer (their step timings)."""

    def __init__(self, session: ForwardSession) -> None:
        self.session = session
        self.answers: list[ForwardOutput] = []

    def send(self, batch: ForwardBatch) -> int:
        return self.session.send(batch)

    def send_mask(self, batch_id: int, mask: VocabMask) -> None:
        self.session.send_mask(batch_id, mask)

    def recv(self) -> ForwardOutput:
        out = self.session.recv()
        self.answers.append(out)
        return out


class TimedScheduler(ReferenceScheduler):
    """The reference scheduler, with the time its grammars take to fill masks."""

    mask_ns: int = 0

    def _mask(self, members: Sequence[Request], masked: Sequence[int]) -> VocabMask:
        t0 = time.perf_counter_ns()
        try:
            return super()._mask(members, masked)
        finally:
            self.mask_ns += time.perf_counter_ns() - t0


@dataclass
class Run:
    seconds: float
    outputs: list[list[int]]
    steps: list[ForwardOutput]
    mask_ns: int = 0

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    def per_step_ms(self, key: str) -> float:
        return statistics.mean(s.stats.timings_ns.get(key, 0) for s in self.steps) / 1e6


@dataclass
class Result:
    model: str
    bs: int
    constrained: list[Run] = field(default_factory=list)
    unconstrained: list[Run] = field(default_factory=list)

    @property
    def ratios(self) -> list[float]:
        """Constrained tok/s / unconstrained tok/s of each pair, ascending."""
        pairs = zip(self.constrained, self.unconstrained, strict=True)
        return sorted(c.tok_s / u.tok_s for c, u in pairs)

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)


def generate_once(
    client: ExecutorClient,
    prompts: list[list[int]],
    *,
    grammars: Grammars | None,
    lengths: list[int] | None,
    max_new_tokens: int,
) -> Run:
    """One overlapped run on a fresh stream: with `grammars`, every request under SCHEMA;
    else each request runs `lengths[i]` tokens."""
    info = client.info().info
    session = client.open_stream()
    pipe = RecordingPipe(session)
    scheduler = TimedScheduler(
        client.retrying(), info.limits, info.eos_token_ids, overlap=True, pipe=pipe,
        grammars=grammars,
    )  # fmt: skip
    reqs = [
        scheduler.add_request(
            p,
            max_new_tokens=lengths[i] if lengths else max_new_tokens,
            ignore_eos=grammars is None,
            json_schema=SCHEMA if grammars is not None else None,
        )
        for i, p in enumerate(prompts)
    ]
    t0 = time.perf_counter()
    scheduler.run()
    seconds = time.perf_counter() - t0
    session.close()
    return Run(seconds, [r.output_ids for r in reqs], pipe.answers, scheduler.mask_ns)


def measure(
    client: ExecutorClient,
    tok: Tokenizer,
    *,
    model: str,
    bs: int,
    repeats: int,
    max_new_tokens: int,
    chat: bool = True,
) -> Result:
    info = client.info().info
    grammars = Grammars(tok, info.vocab_size)
    texts = [PROMPTS[i % len(PROMPTS)] for i in range(bs)]
    if chat and tok.chat_template:
        texts = [tok.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    prompts = [tok.encode(t) for t in texts]
    result = Result(model, bs)
    # Warm both paths (and compile the schema) before anything is timed.
    warm = generate_once(client, prompts, grammars=grammars, lengths=None, max_new_tokens=8)
    generate_once(client, prompts, grammars=None, lengths=None, max_new_tokens=8)
    lengths = [max(len(o), 1) for o in warm.outputs]

    def constrained() -> Run:
        run = generate_once(
            client, prompts, grammars=grammars, lengths=None, max_new_tokens=max_new_tokens
        )
        for out in run.outputs:
            if len(out) < max_new_tokens:  # the grammar ended it: complete JSON
                json.loads(tok.decode(out))
        lengths[:] = [max(len(o), 1) for o in run.outputs]  # greedy: the same every run
        return run

    def unconstrained() -> Run:
        return generate_once(
            client, prompts, grammars=None, lengths=lengths, max_new_tokens=max_new_tokens
        )

    for i in range(repeats):
        if i % 2 == 0:  # alternate which runs first; the first pair learns the lengths
            con = constrained()
            unc = unconstrained()
        else:
            unc = unconstrained()
            con = constrained()
        result.constrained.append(con)
        result.unconstrained.append(unc)
    return result


def table(results: list[Result]) -> str:
    lines = [
        "| model | bs | unconstrained tok/s | constrained tok/s | ratio of the best | ratio: "
        "median (range) of pairs | device ms/step unconstrained / constrained | sample ms/step "
        "unconstrained / constrained | mask ms/step (scheduler) | tokens per request |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        con = max(r.constrained, key=lambda x: x.tok_s)
        unc = max(r.unconstrained, key=lambda x: x.tok_s)
        lines.append(
            f"| {r.model} | {r.bs} | {unc.tok_s:.1f} | {con.tok_s:.1f} | "
            f"{con.tok_s / unc.tok_s:.2f} | {r.ratio:.2f} ({r.ratios[0]:.2f}-{r.ratios[-1]:.2f}) | "
            f"{unc.per_step_ms('total'):.1f} / {con.per_step_ms('total'):.1f} | "
            f"{unc.per_step_ms('sample'):.2f} / {con.per_step_ms('sample'):.2f} | "
            f"{con.mask_ns / 1e6 / max(len(con.steps), 1):.2f} | {con.tokens / r.bs:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--bs", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=4, help="constrained/unconstrained pairs")
    parser.add_argument(
        "--server-threads",
        type=int,
        default=0,
        help="torch (OpenMP) threads of the server; 0 = torch's default (one per core). On a "
        "CPU device the scheduler, which computes the masks, shares the cores with it",
    )
    parser.add_argument("--cache-dir", default="")
    parser.add_argument("--server-args", default="", help="more `serve` flags")
    args = parser.parse_args()
    model_name, cpu_flags = cpu_description()
    print(f"machine: {model_name} ({os.cpu_count()} cores; {cpu_flags}); load {os.getloadavg()}")
    flags = ["--model", args.model, "--max-reqs", "64", "--kv-slots", "16384",
             "--max-context-len", "1024", *shlex.split(args.server_args)]  # fmt: skip
    if args.cache_dir:
        flags += ["--cache-dir", args.cache_dir]
    env = {"OMP_NUM_THREADS": str(args.server_threads)} if args.server_threads else None
    with served(flags, env=env) as server:
        remote = server.client.info()
        info = remote.info
        tok = load_tokenizer(
            resolve_model_spec(remote.model_spec), info.vocab_size, info.bos_token_id,
            info.eos_token_ids, Path(args.cache_dir) if args.cache_dir else None,
        )  # fmt: skip
        print(f"server ready in {server.ready_s:.0f} s; {args.repeats} pairs; greedy; "
              f"max {args.max_new_tokens} new tokens; server threads "
              f"{args.server_threads or 'default'}\n")  # fmt: skip
        result = measure(
            server.client, tok, model=args.model, bs=args.bs, repeats=args.repeats,
            max_new_tokens=args.max_new_tokens,
        )  # fmt: skip
    print(table([result]))
    sample = tok.decode(result.constrained[0].outputs[0])
    print(f"\nfirst constrained answer: {sample}")
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()

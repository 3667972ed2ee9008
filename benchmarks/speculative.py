"""Speculative decoding by prompt lookup: tokens/s with `--speculate K` against plain decode.

    .venv/bin/python benchmarks/speculative.py                       # SmolLM2, bs 1, K 4
    .venv/bin/python benchmarks/speculative.py --graph-mode extend   # VERIFY on the piecewise path
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/speculative.py --step-paths 20   # VERIFY: eager vs piecewise

The server runs in its own process (`python -m executor serve`, see served.py); the reference
scheduler drives it through gRPC at batch size 1, greedy, one prompt at a time. Two prompt
sets, each through the model's chat template:

- input-grounded: summarise, rewrite, extract from a given text of a few hundred tokens (the
  answer copies spans of the text, which prompt lookup drafts);
- free-form: questions with no text to copy from (drafts rarely right: the switch-off policy
  is what keeps this set from getting slower).

Per prompt, plain and speculative runs alternate (which goes first alternates too), so a
drift in the machine's speed lands on both. Both give the same greedy tokens where the forward
is exact across step shapes (float weights); where activations are quantized (the qmm kernel,
SmolLM2's default GGUF) a VERIFY step's logits differ from a DECODE step's by the rounding of
tiny float differences, and two runs may part at a close call: the row counts the runs whose
tokens are equal and gives where the others parted.
Reported per set: tokens/s of each mode (all the set's tokens over all its seconds, median over
the repeats), the speed-up (median of the repeats' ratios, and their range), the mean accepted
length (tokens a VERIFY step yielded: accepted drafts + 1) and the share of decode steps that
were VERIFY steps (the rest: DECODE, drafting switched off). From the steps' own timings, the
device ms of a DECODE and of a VERIFY step (`forward`: the model; `total`: validate .. sample).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "proto"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from executor.client.grpc_client import ExecutorClient
from executor.client.scheduler import ReferenceScheduler
from executor.client.speculation import DEFAULT_NGRAM, SpeculationPolicy
from executor.core.forward_batch import ForwardBatch, ForwardMode
from executor.core.outputs import ForwardOutput

TEXT = (
    "The town of Aldermere sits on the eastern shore of Lake Corran, about forty kilometres "
    "north of the city of Brenford. It was founded in 1821 by a group of timber merchants led "
    "by Margaret Ellison, who built the first sawmill on the Corran River. For most of the "
    "nineteenth century the town lived from wood: logs were floated down the river in spring "
    "and cut into planks at the mill, then shipped across the lake to Brenford. In 1874 the "
    "railway reached Aldermere, and the town grew from 900 to 3,400 people in twenty years. "
    "The sawmill closed in 1958 after a fire destroyed its main building. Since then the town "
    "has turned to tourism. Every summer about 60,000 visitors come for the lake, the hiking "
    "trails of the Corran Hills and the Aldermere Music Festival, which was started in 1979 "
    "by the violinist Thomas Hale. The old mill was rebuilt in 2004 as a museum of the timber "
    "trade; it is open from May to October and entry is free for children under twelve. "
    "Today Aldermere has about 5,200 residents, two schools, a small hospital and a ferry that "
    "crosses the lake to Brenford four times a day. The town council, led by mayor Priya Nandi "
    "since 2019, plans a new cycle path along the shore, to be finished in 2027."
)
GROUNDED = [
    f"Here is a text:\n\n{TEXT}\n\nSummarise the text above in three sentences.",
    f"Here is a text:\n\n{TEXT}\n\nRewrite the text above in simpler English, keeping every fact.",
    f"Here is a text:\n\n{TEXT}\n\nList every year mentioned in the text above, each with the "
    "event that happened in it.",
    f"Here is a text:\n\n{TEXT}\n\nExtract the names of all the people in the text above and "
    "say what each of them did.",
    f"Here is a text:\n\n{TEXT}\n\nCopy the sentences of the text above that mention the sawmill.",
]
FREE_FORM = [
    "Write a short story about a dragon who is afraid of the dark.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me three ideas for a vegetarian dinner, with a sentence about each.",
    "What are the advantages and disadvantages of working from home?",
    "Write a poem about the sea in autumn.",
]


@dataclass
class Run:
    """One prompt's generation: its tokens, seconds and the steps' answers."""

    tokens: list[int]
    seconds: float
    first_token_s: float  # the prefill's answer
    steps: list[tuple[ForwardMode, ForwardOutput]] = field(default_factory=list)

    def decode_steps(self) -> list[tuple[ForwardMode, ForwardOutput]]:
        return [(m, o) for m, o in self.steps if m in (ForwardMode.DECODE, ForwardMode.VERIFY)]


class Recording:
    """A forward callable that keeps every step's mode and answer (their timings)."""

    def __init__(self, client: ExecutorClient) -> None:
        self.forward = client.retrying()
        self.steps: list[tuple[ForwardMode, ForwardOutput]] = []
        self.prefilled_at = 0.0

    def __call__(self, batch: ForwardBatch) -> ForwardOutput:
        out = self.forward(batch)
        self.steps.append((batch.forward_mode, out))
        if batch.forward_mode is ForwardMode.EXTEND:
            self.prefilled_at = time.perf_counter()
        return out


def generate_one(
    client: ExecutorClient,
    prompt: Sequence[int],
    new_tokens: int,
    speculate: int,
    ngram: int,
    policy: SpeculationPolicy | None = None,
    eos: Sequence[int] = (),
) -> Run:
    recording = Recording(client)
    limits = client.info().info.limits
    scheduler = ReferenceScheduler(recording, limits, eos, speculation=policy)
    req = scheduler.add_request(prompt, max_new_tokens=new_tokens, speculate=speculate, ngram=ngram)
    t0 = time.perf_counter()
    scheduler.run()
    end = time.perf_counter()
    return Run(req.output_ids, end - t0, recording.prefilled_at - t0, recording.steps)


@dataclass
class SetResult:
    """A prompt set's figures over the repeats."""

    name: str
    plain_rates: list[float]  # decode tokens/s: the tokens after the first over their seconds
    spec_rates: list[float]
    ratios: list[float]
    e2e_ratios: list[float]  # the same with the prefill (time to the first token) counted
    accept_length: float  # tokens per VERIFY step
    verify_share: float  # VERIFY steps / decode steps
    step_ms: dict[str, float]  # "decode forward", "verify total", ... (medians)
    parted: list[int | None] = field(default_factory=list)  # per run pair: the first differing
    # token's index, None where both gave the same tokens

    def equal_tokens(self) -> str:
        same = sum(p is None for p in self.parted)
        where = sorted(p for p in self.parted if p is not None)
        return f"{same}/{len(self.parted)}" + (f" (parted at {where})" if where else "")

    def row(self) -> str:
        r = sorted(self.ratios)
        return (
            f"| {self.name} | {self.equal_tokens()} | {statistics.median(self.plain_rates):.1f} | "
            f"{statistics.median(self.spec_rates):.1f} | {statistics.median(r):.2f}x "
            f"({r[0]:.2f}-{r[-1]:.2f}) | {statistics.median(self.e2e_ratios):.2f}x | "
            f"{self.accept_length:.2f} | "
            f"{100 * self.verify_share:.0f}% | "
            f"{self.step_ms.get('decode forward', 0):.1f} / {self.step_ms.get('decode total', 0):.1f}"
            f" | {self.step_ms.get('verify forward', 0):.1f} / "
            f"{self.step_ms.get('verify total', 0):.1f} |"
        )


HEADER = (
    "| prompts | equal tokens | plain decode tok/s | speculative decode tok/s | speed-up (range) | "
    "speed-up with prefill | mean accepted length | VERIFY share | "
    "DECODE ms forward / total | VERIFY ms forward / total |\n"
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def measure_set(
    client: ExecutorClient,
    name: str,
    prompts: list[list[int]],
    *,
    new_tokens: int,
    speculate: int,
    ngram: int,
    repeats: int,
    policy: SpeculationPolicy | None = None,
    eos: Sequence[int] = (),
    verbose: bool = False,
) -> SetResult:
    plain_rates, spec_rates, ratios, e2e_ratios = [], [], [], []
    spec_runs: list[Run] = []
    plain_runs: list[Run] = []
    parted: list[int | None] = []
    for rep in range(repeats):
        seconds = {0: 0.0, speculate: 0.0}
        decode_s = {0: 0.0, speculate: 0.0}
        tokens = {0: 0, speculate: 0}
        for i, prompt in enumerate(prompts):
            order = (0, speculate) if (rep + i) % 2 == 0 else (speculate, 0)
            done = {
                k: generate_one(client, prompt, new_tokens, k, ngram, policy, eos) for k in order
            }
            parted.append(_first_difference(done[0].tokens, done[speculate].tokens))
            for k, run in done.items():
                seconds[k] += run.seconds
                decode_s[k] += run.seconds - run.first_token_s
                tokens[k] += len(run.tokens)
            plain_runs.append(done[0])
            spec_runs.append(done[speculate])
            if verbose:
                steps = done[speculate].decode_steps()
                gained = [
                    int(o.accepted_lengths[0]) if o.accepted_lengths is not None else 0
                    for m, o in steps
                ]
                print(
                    f"  {name} [{i}] {len(done[0].tokens)} tokens: plain "
                    f"{done[0].seconds:.2f} s, speculative {done[speculate].seconds:.2f} s; "
                    f"tokens per step (0: DECODE) {gained}",
                    flush=True,
                )
        plain_rates.append((tokens[0] - len(prompts)) / decode_s[0])
        spec_rates.append((tokens[speculate] - len(prompts)) / decode_s[speculate])
        ratios.append(spec_rates[-1] / plain_rates[-1])
        e2e_ratios.append(seconds[0] / seconds[speculate])
    verify = [o for r in spec_runs for m, o in r.decode_steps() if m is ForwardMode.VERIFY]
    decode = [o for r in plain_runs for m, o in r.decode_steps() if m is ForwardMode.DECODE]
    all_decode = [s for r in spec_runs for s in r.decode_steps()]
    gained = [n for o in verify for n in o.accepted_lengths.tolist()]  # type: ignore[union-attr]
    step_ms = {}
    for label, outs in (("decode", decode), ("verify", verify)):
        for key in ("forward", "total"):
            if outs:
                step_ms[f"{label} {key}"] = statistics.median(
                    o.stats.timings_ns.get(key, 0) / 1e6 for o in outs
                )
    return SetResult(
        name,
        plain_rates,
        spec_rates,
        ratios,
        e2e_ratios,
        accept_length=statistics.mean(gained) if gained else 0.0,
        verify_share=len(verify) / max(1, len(all_decode)),
        step_ms=step_ms,
        parted=parted,
    )


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The index of the first token where `a` and `b` differ (one ending first counts), or None."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def encode_prompts(client: ExecutorClient, texts: list[str], cache_dir: str) -> list[list[int]]:
    from executor.models.loader import resolve_model_spec
    from executor.models.tokenizer import load_tokenizer

    remote = client.info()
    tok = load_tokenizer(
        resolve_model_spec(remote.model_spec),
        remote.info.vocab_size,
        remote.info.bos_token_id,
        remote.info.eos_token_ids,
        Path(cache_dir).expanduser() if cache_dir else None,
    )
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]


def step_paths(model: str, steps: int, k: int, context: int, cache_dir: str) -> None:
    """In one process (both under the same load): the ms of a bs-1 VERIFY step of k drafts on
    the eager path and on the piecewise-graph path (`graph_mode` extend, compiled pieces), and
    of a DECODE step (eager), alternating step by step; the executor's `forward` timing."""
    import dataclasses as dc

    from executor.batch_prep import make_decode_batch, make_extend_batch
    from executor.config import ExecutorConfig
    from executor.model_executor import ModelExecutor

    def config(**graphs: object) -> ExecutorConfig:
        return ExecutorConfig(
            model=model,
            max_reqs=4,
            kv_slots=4096,
            max_context_len=2048,
            cache_dir=cache_dir,
            **graphs,  # type: ignore[arg-type]
        )

    executors = {
        "eager": ModelExecutor(config(graph_mode="none")),
        # One token bucket of k + 1: VERIFY steps are not padded.
        "piecewise": ModelExecutor(
            config(
                graph_mode="extend", piecewise_token_sizes=str(k + 1), piecewise_max_tokens=k + 1
            )
        ),
    }
    prompt = [(7 * i) % 500 + 10 for i in range(context)]
    held = dict.fromkeys(executors, context)  # the row's length on each executor
    next_slot = dict.fromkeys(executors, context + 1)  # fresh slots only, never reused
    for ex in executors.values():
        ex.forward(
            make_extend_batch(
                input_ids=[prompt],
                req_pool_indices=[1],
                out_cache_loc=[list(range(1, context + 1))],
            )
        )

    def one_step(name: str, mode: ForwardMode) -> ForwardOutput:
        n = k + 1 if mode is ForwardMode.VERIFY else 1
        slots = list(range(next_slot[name], next_slot[name] + n))
        next_slot[name] += n
        if mode is ForwardMode.DECODE:
            batch = make_decode_batch(
                input_ids=[5], req_pool_indices=[1], seq_lens=[held[name] + 1], out_cache_loc=slots
            )
        else:
            batch = dc.replace(
                make_extend_batch(
                    input_ids=[[5] * n],
                    req_pool_indices=[1],
                    out_cache_loc=[slots],
                    prefix_lens=[held[name]],
                ),
                forward_mode=ForwardMode.VERIFY,
            )
        out = executors[name].forward(batch)
        held[name] += n if out.accepted_lengths is None else int(out.accepted_lengths[0])
        return out

    ms: dict[str, list[float]] = {"DECODE eager": [], "VERIFY eager": [], "VERIFY piecewise": []}
    paths: dict[str, set[str]] = {key: set() for key in ms}
    for i in range(steps + 2):
        for key, name, mode in (
            ("DECODE eager", "eager", ForwardMode.DECODE),
            ("VERIFY eager", "eager", ForwardMode.VERIFY),
            ("VERIFY piecewise", "piecewise", ForwardMode.VERIFY),
        ):
            out = one_step(name, mode)
            if i >= 2:  # two warm-up rounds
                ms[key].append(out.stats.timings_ns["forward"] / 1e6)
                paths[key].add(out.stats.path)
    print(f"bs 1, {context}-token context, k {k}, {steps} steps each, alternating:")
    print("| step | path | forward ms (median) | min |\n|---|---|---:|---:|")
    for key, values in ms.items():
        print(
            f"| {key} | {', '.join(sorted(paths[key]))} | {statistics.median(values):.1f} | "
            f"{min(values):.1f} |"
        )


def main() -> None:
    from served import cpu_description, served  # benchmarks/served.py (the script's folder)

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--speculate", type=int, default=4)
    parser.add_argument("--ngram", type=int, default=DEFAULT_NGRAM)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sets", default="grounded,free-form")
    parser.add_argument("--verbose", action="store_true", help="a line per prompt and repeat")
    parser.add_argument(
        "--step-paths",
        type=int,
        default=0,
        metavar="STEPS",
        help="instead: time STEPS bs-1 VERIFY steps on the eager and the piecewise path (and "
        "DECODE) in this process, alternating",
    )
    parser.add_argument(
        "--graph-mode", default="none", help="the server's --graph-mode (extend: piecewise VERIFY)"
    )
    parser.add_argument(
        "--server-threads",
        type=int,
        default=1,
        help="the server's torch threads (0: torch's default, one per core: on a loaded "
        "2-core machine its OpenMP threads then wait on each other)",
    )
    default = SpeculationPolicy()
    parser.add_argument("--min-accepted", type=float, default=default.min_accepted)
    parser.add_argument("--min-steps", type=int, default=default.min_steps)
    parser.add_argument("--retry-after", type=int, default=default.retry_after)
    parser.add_argument("--cache-dir", default="")
    parser.add_argument("--server-args", default="", help="more `serve` flags")
    args = parser.parse_args()
    model_name, cpu_flags = cpu_description()
    print(f"machine: {model_name} ({os.cpu_count()} cores; {cpu_flags}); load {os.getloadavg()}")
    if args.step_paths:
        step_paths(args.model, args.step_paths, args.speculate, 367, args.cache_dir)
        print(f"\nload after: {os.getloadavg()}")
        return
    print(
        f"model {args.model}, bs 1, greedy, EOS honoured, up to {args.new_tokens} new tokens; "
        f"--speculate {args.speculate} --ngram {args.ngram}; graph mode {args.graph_mode}; "
        f"{args.repeats} repeats, plain and speculative alternating per prompt\n"
    )
    flags = [
        "--model", args.model, "--max-reqs", "8", "--kv-slots", "8192",
        "--max-context-len", "2048", "--graph-mode", args.graph_mode,
        *shlex.split(args.server_args),
    ]  # fmt: skip
    if args.cache_dir:
        flags += ["--cache-dir", args.cache_dir]
    env = {"OMP_NUM_THREADS": str(args.server_threads)} if args.server_threads else None
    sets = {"grounded": GROUNDED, "free-form": FREE_FORM}
    policy = dataclasses.replace(
        default,
        min_accepted=args.min_accepted,
        min_steps=args.min_steps,
        window=max(default.window, args.min_steps),
        retry_after=args.retry_after,
    )
    print(f"policy: {policy}; server threads {args.server_threads or 'default'}\n")
    with served(flags, env=env) as server:
        client = server.client
        eos = client.info().info.eos_token_ids
        print(HEADER)
        for name in args.sets.split(","):
            prompts = encode_prompts(client, sets[name], args.cache_dir)
            for k in (0, args.speculate):  # warm both paths
                generate_one(client, prompts[0], 8, k, args.ngram)
            result = measure_set(
                client,
                f"{name} ({len(prompts)}, {statistics.mean(len(p) for p in prompts):.0f} tokens)",
                prompts,
                new_tokens=args.new_tokens,
                speculate=args.speculate,
                ngram=args.ngram,
                repeats=args.repeats,
                policy=policy,
                eos=eos,
                verbose=args.verbose,
            )
            print(result.row(), flush=True)
    print(f"\nload after: {os.getloadavg()}")


if __name__ == "__main__":
    main()

"""One greedy llama.cpp stream's token-to-token times, as JSON on stdout (no other imports
than llama-cpp-python, so it runs in whichever interpreter has it: `vs_llamacpp.py
--llama-python`).

    python benchmarks/llamacpp_stream.py MODEL.gguf --prompt 128 --steps 64 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=args.model,
        n_ctx=args.prompt + args.steps + 8,
        n_threads=args.threads,
        n_batch=args.prompt,
        verbose=False,
    )
    tokens = [(17 * j) % 1000 + 100 for j in range(args.prompt)]
    times, last = [], time.perf_counter()
    for n, _tok in enumerate(llm.generate(tokens, top_k=1, temp=0.0, reset=True)):
        now = time.perf_counter()
        if n > 0:  # the first token closes the prefill
            times.append(now - last)
        last = now
        if n == args.steps:
            break
    ms = [t * 1e3 for t in times[2:]]
    print(json.dumps({"median_ms": statistics.median(ms), "min_ms": min(ms)}))


if __name__ == "__main__":
    main()

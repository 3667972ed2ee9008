"""The soak run: N concurrent schedulers (default 64 over ForwardStream plus 8 unary) drive one
in-process server for `--seconds`, then every scheduler's tokens are compared with a serial
in-process replay (tests/soak.py has the details).

    PYTHONPATH=.:proto .venv/bin/python benchmarks/soak.py                      # tiny-random, 10 min
    PYTHONPATH=.:proto .venv/bin/python benchmarks/soak.py --model smollm2 --seconds 120
    PYTHONPATH=.:proto .venv/bin/python benchmarks/soak.py --simulated-step-ms 1 --seconds 120

`--simulated-step-ms D` serves the stand-in accelerator: steps are launched ahead of the one
running (the pipelined device thread, which a CPU model's synchronous forward leaves off).

Reports the steps, resident memory (first / last / max of the samples, and the growth after
the first tenth of the run, when caches and allocator pools are warm) and the rows / slots /
queue gauges after the releases. Exits 1 on any error, a replay mismatch, a gauge not back to
zero, or memory growth above --max-rss-growth-mib. Results in docs/reliability.md.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

import structlog

from tests.server_util import tiny_config
from tests.soak import soak


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--unary", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--rss-every-s", type=float, default=5.0)
    ap.add_argument("--max-rss-growth-mib", type=float, default=64.0)
    ap.add_argument("--simulated-step-ms", type=float, default=0.0, help="the stand-in's D")
    args = ap.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    config = tiny_config(
        Path(tempfile.mkdtemp(prefix="soak-")),
        model=args.model,
        simulated_step_ms=args.simulated_step_ms,
    )
    result = soak(
        config,
        streams=args.streams,
        unary=args.unary,
        seconds=args.seconds,
        rss_every_s=args.rss_every_s,
        progress=lambda line: print(line, flush=True),
    )
    rss = result.rss_mib
    warm = rss[max(1, len(rss) // 10)] if len(rss) > 1 else rss[0]
    growth = rss[-1] - warm
    cycles = sum(r.cycles for r in result.schedulers)
    print(
        f"model {args.model}: {args.streams} stream + {args.unary} unary schedulers, {result.seconds:.0f} s"
    )
    per = sorted(r.cycles for r in result.schedulers)
    print(
        f"steps {result.steps} ({result.steps / result.seconds:.1f}/s), request pairs {cycles} "
        f"(per scheduler: min {per[0]}, median {per[len(per) // 2]}, max {per[-1]})"
    )
    print(
        f"rss MiB: first {rss[0]:.0f}, after warm-up {warm:.0f}, last {rss[-1]:.0f}, "
        f"max {max(rss):.0f} ({len(rss)} samples); growth after warm-up {growth:+.1f}"
    )
    print(f"gauges after releases: {result.gauges_after}")
    print(f"errors: {len(result.errors)}; replay mismatches: {result.replay_mismatches}")
    for e in result.errors[:10]:
        print("  " + e)
    ok = (
        not result.errors
        and not result.replay_mismatches
        and all(v == 0 for v in result.gauges_after.values())
        and growth <= args.max_rss_growth_mib
    )
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

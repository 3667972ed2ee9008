"""How long a background load of saved compiled steps holds the GIL at a stretch (issue 36).

    python benchmarks/load_stalls.py --cache-dir DIR     # DIR: a server's warm --cache-dir

An executor at defaults (the default model) is built on DIR, warmed up and its heap frozen, as
`serve` does; then its background capture runs (the compile worker's, or the load of the
steps DIR holds) while a probe thread sleeps 1 ms at a time and records how late it wakes. A
late wake is a stretch in which another thread held the GIL, and a step's thread would have
waited as long for it. The longest stretches are listed with the capture thread's stack at
their end (where it was when it let the GIL go: inside or just after the call that held it).
Run it on a cache dir that holds the current tree's steps (a `serve` on it reached the
compiled path), or it compiles them first (minutes).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "proto"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from executor.config import ExecutorConfig
from executor.model_executor import ModelExecutor
from executor.service import heap
from ops import triton_off

LATE_S = 0.02  # a wake this late records the other threads' stacks


def stack_line(frame: object) -> str:
    frames = traceback.extract_stack(frame)[-6:]  # type: ignore[arg-type]
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in reversed(frames))


def triton_loaded() -> bool:
    return "libtriton" in Path("/proc/self/maps").read_text()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    config = ExecutorConfig(model=args.model, cache_dir=args.cache_dir)
    triton_off.keep_out_on_cpu(config.device)  # as `serve`
    ex = ModelExecutor(config)
    ex.warmup()
    heap.freeze()  # as `serve`, and its refreeze once the capture ends
    ex.control.graph_mode_listener = heap.refreeze
    wakes: list[float] = []
    late: list[tuple[float, float, list[str]]] = []
    stop = threading.Event()
    t0 = time.perf_counter()

    def probe() -> None:
        own = {threading.get_ident(), main_thread}
        while not stop.is_set():
            t = time.perf_counter()
            time.sleep(0.001)
            lateness = time.perf_counter() - t - 0.001
            wakes.append(lateness)
            if lateness > LATE_S:
                stacks = [
                    stack_line(f) for tid, f in sys._current_frames().items() if tid not in own
                ]
                late.append((t - t0, lateness, stacks))

    main_thread = threading.get_ident()
    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    mode = ex.control.start_background()
    if mode is None:
        raise SystemExit("nothing to capture in the background at these settings")
    ex.control.wait_for_capture(None)
    stop.set()
    prober.join()
    print(f"capture ({mode}) {time.perf_counter() - t0:.2f} s; graph mode {ex.toggles.graph_mode}")
    resident = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    print(f"resident set after it: {resident / 2**20:.0f} MiB; triton imported: {triton_loaded()}")
    ordered = sorted(wakes)
    print(
        f"probe wakes: {len(ordered)}, late p50 {ordered[len(ordered) // 2] * 1e3:.2f} ms, "
        f"p99 {ordered[int(len(ordered) * 0.99)] * 1e3:.2f} ms, max {ordered[-1] * 1e3:.1f} ms"
    )
    for at, lateness, stacks in sorted(late, key=lambda x: -x[1])[: args.top]:
        print(f"at {at:7.2f} s: {lateness * 1e3:6.1f} ms")
        for line in stacks:
            if "_monitor" not in line and "_populate" not in line:  # tqdm's, the KV commit's
                print(f"    {line}")


if __name__ == "__main__":
    main()

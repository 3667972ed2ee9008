"""A background capture compiles off the step's path (issue 36).

Each bucket's compile phase runs without the step lock (steps complete while it runs, eagerly,
and the runtime config says "capturing"); only its capture - the runs - holds the lock. A
whole compiled step is keyed by what it was traced from, saved in the cache dir, loaded by a
restart instead of compiled, and used only once its first output matches the eager step's.
The compile worker's failures come back as a reason (the capture then compiles itself).
"""

from __future__ import annotations

import gc
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from executor import model_executor
from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.config import ExecutorConfig
from executor.core.names import EAGER_KERNELS, INDUCTOR
from executor.graphs import compile_job, step_graph
from executor.graphs.artifacts import ArtifactStore, fingerprint
from executor.graphs.compile_cache import use_compile_caches
from executor.graphs.compile_job import CompileJob, compile_in_worker
from executor.graphs.decode_runner import DecodeGraphRunner
from executor.graphs.graph import GraphCaptureError
from executor.graphs.step_graph import StepCall, StepCompiledGraph
from executor.graphs.step_threads import LOAD_SWITCH_S
from executor.model_executor import ModelExecutor
from executor.service import heap
from executor.service.runtime_config import RuntimeConfigUpdate, RuntimeControl
from executor.step import graph_control
from tests.lock_util import is_held
from tests.test_graphs import _prefill

MakeExecutor = Callable[..., ModelExecutor]


def _count_capture_rules(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The tags of the steps run under the capture rules from now on (they still run)."""
    ruled: list[str] = []
    real_rules = step_graph.check_capture_rules

    def rules(call: StepCall) -> None:
        ruled.append(call.tag)
        real_rules(call)

    monkeypatch.setattr(step_graph, "check_capture_rules", rules)
    return ruled


def _runtime_control(ex: ModelExecutor) -> RuntimeControl:
    return RuntimeControl(
        ex, trace_sample_ratio=0.0, set_trace_sample_ratio=lambda _: None, on_change=lambda c: None
    )


@pytest.mark.slow
def test_steps_complete_while_a_bucket_compiles_and_only_the_capture_holds_the_lock(
    make_executor: MakeExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compile held open (as a minutes-long one is): the step lock is free, steps run
    eagerly, GetRuntimeConfig says capturing; the compile phase yields to the steps (the
    `IdleGate`'s hook is on), the capture that follows holds the lock (the hook off) and the
    graph serves once installed."""
    ex = make_executor(graph_mode="none", graph_batch_sizes="1,2")
    compiling, release = threading.Event(), threading.Event()
    lock_held: dict[str, list[bool]] = {"compile": [], "capture": []}
    real_compile, real_capture = DecodeGraphRunner._compile_one, DecodeGraphRunner._capture_one

    switch: list[float] = []
    interval = sys.getswitchinterval()
    hooks: dict[str, list[object]] = {"compile": [], "capture": []}

    def compile_one(self: DecodeGraphRunner, bs: int) -> None:
        lock_held["compile"].append(is_held(ex.control.step_lock))
        hooks["compile"].append(sys.getprofile())
        switch.append(sys.getswitchinterval())  # short GIL turns: steps get it back in time
        compiling.set()
        assert release.wait(30)
        real_compile(self, bs)

    def capture_one(self: DecodeGraphRunner, bs: int) -> None:
        lock_held["capture"].append(is_held(ex.control.step_lock))
        hooks["capture"].append(sys.getprofile())
        real_capture(self, bs)

    monkeypatch.setattr(DecodeGraphRunner, "_compile_one", compile_one)
    monkeypatch.setattr(DecodeGraphRunner, "_capture_one", capture_one)
    control = _runtime_control(ex)
    answer = control.update(RuntimeConfigUpdate(graph_mode="decode"))
    assert (answer.graph_mode, answer.graph_capture) == ("none", "capturing graph_mode=decode")
    assert compiling.wait(30)
    # The compile is running: steps take the lock and complete, eagerly.
    _prefill(ex, [1], [3], first_slot=1)
    step = make_decode_batch(input_ids=[5], req_pool_indices=[1], seq_lens=[4], out_cache_loc=[9])
    assert ex.forward(step).stats.path == "eager"
    assert control.current().graph_capture == "capturing graph_mode=decode"
    # ... with every intra-op thread: nothing compiles beside them (the stand-in's compile
    # phase is this thread's, which waits for the steps); a failed compile worker's C++
    # compiles here would hold a core (`StepThreads`).
    threads = ex.runner.step_threads
    assert threads.reserved == 0 and torch.get_num_threads() == threads.full
    release.set()
    assert ex.control.wait_for_capture(60)
    assert control.current().graph_capture == "idle" and ex.toggles.graph_mode == "decode"
    assert lock_held == {"compile": [False, False], "capture": [True, True]}
    gate = ex.runner.idle_gate
    assert hooks == {"compile": [gate._hook, gate._hook], "capture": [None, None]}
    assert not gate._on  # (the capture thread ended its `yielding`)
    assert switch == [pytest.approx(LOAD_SWITCH_S)] * 2 and sys.getswitchinterval() == interval
    step = make_decode_batch(input_ids=[6], req_pool_indices=[1], seq_lens=[5], out_cache_loc=[10])
    assert ex.forward(step).stats.path == "full_graph"
    assert threads.reserved == 0 and torch.get_num_threads() == threads.full


def test_whole_steps_check_one_eager_step_and_let_a_waiting_step_in_between_graphs(
    make_executor: MakeExecutor, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A bucket's whole compiled steps, smallest KV bucket first: only the first runs the
    eager step under the capture rules, the next is checked against its output; a step that
    waited for the lock during the first runs before the next graph (the lock is let go)."""
    monkeypatch.setattr(step_graph, "compile_step", lambda call, compiler=INDUCTOR: call.fn)
    monkeypatch.setattr(graph_control, "compile_in_worker", lambda job, stop, pause=None: None)
    ruled = _count_capture_rules(monkeypatch)
    ex = make_executor(  # (a cache dir of its own: no step saved by another test is loaded)
        graph_mode="none",
        graph_backend="compiled_step",
        graph_batch_sizes="1",
        cache_dir=str(tmp_path),
    )
    _prefill(ex, [1], [3], first_slot=1)
    step = make_decode_batch(input_ids=[5], req_pool_indices=[1], seq_lens=[4], out_cache_loc=[9])
    order: list[str] = []
    forward = ex.runner.forward

    def counted(fb: Any) -> Any:  # a step's forward, under the lock
        order.append("step")
        return forward(fb)

    monkeypatch.setattr(ex.runner, "forward", counted)
    stepper: list[threading.Thread] = []
    real_capture = StepCompiledGraph.capture

    def capture(self: StepCompiledGraph, fn: Any, reference: Any = None) -> None:
        order.append(fn.tag)
        if not stepper:  # the first graph, the lock held: a step arrives and waits for it
            stepper.append(threading.Thread(target=ex.forward, args=(step,), daemon=True))
            stepper[0].start()
            time.sleep(0.2)
        real_capture(self, fn, reference)

    monkeypatch.setattr(StepCompiledGraph, "capture", capture)
    control = _runtime_control(ex)
    control.update(RuntimeConfigUpdate(graph_mode="decode"))
    assert ex.control.wait_for_capture(60) and ex.toggles.graph_mode == "decode"
    stepper[0].join(30)
    assert order == ["decode-bs1-kv256", "step", "decode-bs1-kv1024"]
    assert ruled == ["decode-bs1-kv256"]
    [graphs] = ex.runner.decode_graphs.captured.values()  # type: ignore[union-attr]
    first, second = (graphs[False, kv].graph for kv in (256, 1024))
    assert isinstance(second, StepCompiledGraph) and second.reference is first.reference


def test_a_cpu_capture_pass_walks_no_heap(
    make_executor: MakeExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A capture pass on a CPU backend runs no full collection (it holds the interpreter lock,
    stalling the steps a server runs meanwhile, for as long as the heap takes to walk) and
    leaves the heap unfrozen; the graphs serve."""
    collections: list[tuple[Any, ...]] = []
    monkeypatch.setattr(gc, "collect", lambda *args: collections.append(args) or 0)
    ex = make_executor(graph_mode="none", graph_batch_sizes="1,2", piecewise_token_sizes="16")
    frozen = gc.get_freeze_count()
    ex.control.set_graph_mode("both")
    assert collections == [] and gc.get_freeze_count() == frozen
    _prefill(ex, [1], [3], first_slot=1)
    step = make_decode_batch(input_ids=[5], req_pool_indices=[1], seq_lens=[4], out_cache_loc=[9])
    assert ex.forward(step).stats.path == "full_graph"


@pytest.mark.slow
def test_a_restart_loads_the_saved_compiled_steps_instead_of_compiling(
    make_executor: MakeExecutor, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cache_dir: Path
) -> None:
    """The first start compiles the bs-1 step and saves it under cache_dir/graphs; a second
    start on the same cache dir loads it (a compile there would raise) and it serves the
    eager tokens. Its own cache dir holds the saved steps; inductor's caches are the run's
    (the same step's generated C++ is built once a run: the default server's compile,
    tests/test_auto_choices.py, compiles it too)."""
    monkeypatch.setattr(
        model_executor, "use_compile_caches", lambda _dir: use_compile_caches(cache_dir)
    )
    settings: dict[str, Any] = {
        "graph_mode": "decode",
        "graph_backend": "compiled_step",
        "graph_batch_sizes": "1",
        "max_context_len": 64,
        "max_reqs": 32,  # with kv_slots, the shapes of the default server's (tiny_config)
        "kv_slots": 8192,
        "cache_dir": str(tmp_path),
    }
    first = make_executor(**settings)
    [saved] = (tmp_path / "graphs").glob("decode-bs1-kv64-*.aot")

    def no_compile(call: StepCall) -> Any:
        raise AssertionError(f"compiled {call.tag} again")

    monkeypatch.setattr(step_graph, "compile_step", no_compile)
    second = make_executor(**settings)
    assert second.runner.decode_graphs is not None
    [[graph]] = [
        [c.graph for c in kv.values()] for kv in second.runner.decode_graphs.captured.values()
    ]
    assert isinstance(graph, StepCompiledGraph) and graph.loaded
    eager = make_executor(graph_mode="none", max_context_len=64)
    for ex in (first, second, eager):
        _prefill(ex, [1], [4], first_slot=1)
    step = make_decode_batch(input_ids=[7], req_pool_indices=[1], seq_lens=[5], out_cache_loc=[9])
    outs = [ex.forward(step, return_logits=True) for ex in (first, second, eager)]
    assert [o.stats.path for o in outs] == ["full_graph", "full_graph", "eager"]
    assert torch.equal(outs[0].next_token_ids, outs[2].next_token_ids)
    assert torch.equal(outs[1].next_token_ids, outs[2].next_token_ids)
    assert saved.exists()
    # A server's background capture finds them saved: no compile worker, a load.
    monkeypatch.setattr(graph_control, "compile_in_worker", no_worker)
    third = make_executor(**{**settings, "graph_mode": "auto"})
    assert third.control.start_background() == "decode"
    assert third.control.wait_for_capture(120) and third.toggles.graph_mode == "decode"
    assert third.runner.decode_graphs is not None
    [[graph]] = [
        [c.graph for c in kv.values()] for kv in third.runner.decode_graphs.captured.values()
    ]
    assert isinstance(graph, StepCompiledGraph) and graph.loaded


def no_worker(job: CompileJob, stop: threading.Event, pause: object = None) -> str | None:
    raise AssertionError("a compile worker started for saved graphs")


def _call(out: torch.Tensor, scale: float) -> StepCall:
    def step(x: torch.Tensor, o: torch.Tensor) -> None:
        o.copy_(x * scale)

    return StepCall(step, (torch.arange(4.0), out), out, "toy")


class _Store(ArtifactStore):
    """Returns `loaded` for every key; records what was discarded."""

    def __init__(self, loaded: Callable[..., None]) -> None:
        super().__init__(Path("/nonexistent"))
        self.loaded, self.discarded = loaded, []

    def load(self, tag: str, key: str) -> Any:
        return self.loaded

    def discard(self, tag: str, key: str) -> None:
        self.discarded.append(tag)


def test_a_loaded_step_that_disagrees_with_the_eager_step_is_dropped() -> None:
    out = torch.zeros(4)
    wrong = _Store(lambda x, o: o.fill_(123.0))
    graph = StepCompiledGraph(wrong)
    graph.compile(_call(out, 2.0))
    assert graph.loaded
    with pytest.raises(GraphCaptureError, match="differs from the eager step"):
        graph.capture(_call(out, 2.0))
    assert wrong.discarded == ["toy"]
    right = _Store(lambda x, o: o.copy_(x * 2.0))
    graph = StepCompiledGraph(right)
    graph.capture(_call(out, 2.0))  # compiles (here: loads) first when compile did not run
    graph.replay()
    assert out.tolist() == [0.0, 2.0, 4.0, 6.0] and right.discarded == []


def test_a_torch_without_aot_compile_compiles_the_step_at_its_first_call_unsaved(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Older torch (no `aot_compile`): the step is compiled by plain torch.compile at its first
    call (in capture), runs with the step's buffers, and nothing is saved for a restart."""
    compiled: list[Callable[[], None]] = []

    def isolated(fn: Callable[[], None], **_: object) -> Callable[[], None]:
        compiled.append(fn)  # as torch.compile: the same callable, compiled when first called
        return fn

    monkeypatch.setattr(step_graph, "compile_step", lambda call, compiler: None)
    monkeypatch.setattr(step_graph, "compile_isolated", isolated)
    store = ArtifactStore(tmp_path)
    out = torch.zeros(4)
    graph = StepCompiledGraph(store)
    graph.compile(_call(out, 3.0))
    graph.capture(_call(out, 3.0))
    graph.replay()
    assert out.tolist() == [0.0, 3.0, 6.0, 9.0] and len(compiled) == 1
    assert not graph.loaded and list(tmp_path.iterdir()) == []


def test_the_key_follows_the_structure_not_the_state(make_executor: MakeExecutor) -> None:
    """Two executors built alike give a bucket's step the same key, whatever their scratch
    state; another KV cache size gives another key."""

    def key(ex: ModelExecutor) -> str:
        runner = ex.runner._decode_runner(ex.toggles.needs_cpu_seq_lens)
        runner._prepare_capture()
        return runner._bucket_call(1, runner.kv_buckets[0], False, stage=False).key()

    a, b = make_executor(graph_mode="none"), make_executor(graph_mode="none")
    a.forward(make_extend_batch(input_ids=[[3, 4]], req_pool_indices=[1], out_cache_loc=[[1, 2]]))
    assert key(a) == key(b)
    assert key(make_executor(graph_mode="none", kv_slots=4096)) != key(a)
    assert fingerprint((torch.zeros(2, 3),)) != fingerprint((torch.zeros(3, 2),))


@pytest.mark.slow
def test_a_failed_compile_worker_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's exit code and the end of its output come back as the reason (the capture
    then compiles in the server); a shutdown kills it."""
    job = CompileJob(
        ExecutorConfig(model="tiny-random", device="cpu", cache_dir=str(tmp_path)),
        ("decode",),
        needs_cpu_seq_lens=False,
    )
    job_back = CompileJob.from_json(job.to_json())
    assert job_back == job
    failing = [sys.executable, "-c", "import sys; print('no compiler here'); sys.exit(3)"]
    monkeypatch.setattr(compile_job, "worker_command", lambda job, result: failing)
    reason = compile_in_worker(job, threading.Event())
    assert reason is not None and "exited with 3" in reason and "no compiler here" in reason
    sleeping = [sys.executable, "-c", "import time; time.sleep(60)"]
    monkeypatch.setattr(compile_job, "worker_command", lambda job, result: sleeping)
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    assert compile_in_worker(job, stop) == "stopped: the server is shutting down"


def test_under_batch_invariant_a_compiled_step_must_equal_the_eager_step_bitwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With dynamo's eager backend (batch_invariant) a compiled step one ulp off the eager
    step is refused, where inductor's tolerance keeps it."""
    off = lambda x, o: o.copy_(torch.nextafter(x * 2.0, torch.tensor(99.0)))  # noqa: E731
    monkeypatch.setattr(step_graph, "compile_step", lambda call, compiler: off)
    out = torch.zeros(4)
    StepCompiledGraph(compiler=INDUCTOR).capture(_call(out, 2.0))
    with pytest.raises(GraphCaptureError, match="must be equal"):
        StepCompiledGraph(compiler=EAGER_KERNELS).capture(_call(out, 2.0))


class _Saved(ArtifactStore):
    """A store whose saved steps (files written here) load as `x * 2`."""

    def load(self, tag: str, key: str) -> Any:
        return lambda x, o: o.copy_(x * 2.0)


class _Compiled:
    def save_compiled_function(self, path: str) -> None:
        Path(path).write_bytes(b"a compiled step")


def test_a_step_checked_once_runs_its_eager_step_without_the_capture_rules_after(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A saved step's first capture runs the eager step under the capture rules and marks
    the step checked; a later capture (a restart) runs it without them; saving the step again,
    or dropping it, clears the mark."""
    ruled = _count_capture_rules(monkeypatch)
    store, out = _Saved(tmp_path), torch.zeros(4)
    key = _call(out, 2.0).key()
    store.save("toy", key, _Compiled())
    assert store.has("toy", key) and not store.checked("toy", key)
    StepCompiledGraph(store).capture(_call(out, 2.0))
    assert ruled == ["toy"] and store.checked("toy", key)
    restarted = StepCompiledGraph(store)
    restarted.capture(_call(out, 2.0))
    assert ruled == ["toy"] and restarted.loaded and out.tolist() == [0.0, 2.0, 4.0, 6.0]
    store.save("toy", key, _Compiled())
    assert not store.checked("toy", key)
    store.mark_checked("toy", key)
    store.discard("toy", key)
    assert not store.has("toy", key) and list(tmp_path.iterdir()) == []
    store.mark_checked("toy", key)  # nothing saved: nothing marked
    assert list(tmp_path.iterdir()) == []


def test_the_compile_worker_checks_the_smallest_kv_bucket_it_compiled(
    make_executor: MakeExecutor, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The worker's compile phase (`store_only`) checks each batch size's smallest KV bucket
    as a capture would (the eager step under the capture rules, the outputs compared) and
    marks it: the server's capture then runs that eager step without the rules' slow mode."""

    class Step(_Compiled):  # "compiled": the step itself, saved as a file
        def __init__(self, fn: Callable[..., None]) -> None:
            self.fn = fn

        def __call__(self, *args: Any) -> None:
            self.fn(*args)

    monkeypatch.setattr(step_graph, "compile_step", lambda call, compiler=INDUCTOR: Step(call.fn))
    ruled = _count_capture_rules(monkeypatch)
    ex = make_executor(
        graph_mode="none",
        graph_backend="compiled_step",
        graph_batch_sizes="1",
        cache_dir=str(tmp_path),  # (its own: the suite's other steps are saved in the shared one)
    )
    factory, store = ex.runner.graph_factory, ex.runner.graph_factory.store
    assert store is not None
    factory.store_only = True  # as in the compile worker
    assert ex.runner._decode_runner(needs_cpu_seq_lens=False).compile_only() == {}
    assert ruled == ["decode-bs1-kv256"]
    saved = sorted(p.stem for p in store.directory.glob("*.aot"))
    assert [s.split("-")[2] for s in saved] == ["kv1024", "kv256"]
    assert sorted(p.stem for p in store.directory.glob("*.checked")) == saved[1:]


def test_a_failed_worker_leaves_the_compile_here_with_one_intra_op_thread_fewer(
    make_executor: MakeExecutor, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The worker failed: this process compiles, its C++ compiles beside the steps, which run
    with one intra-op thread fewer meanwhile (`StepThreads`), and all of them again after."""
    monkeypatch.setattr(step_graph, "compile_step", lambda call, compiler=INDUCTOR: call.fn)
    monkeypatch.setattr(
        graph_control, "compile_in_worker", lambda job, stop, pause=None: "exited with 3"
    )
    ex = make_executor(
        graph_mode="none",
        graph_backend="compiled_step",
        graph_batch_sizes="1",
        cache_dir=str(tmp_path),
    )
    threads, reserved = ex.runner.step_threads, []
    real_compile = DecodeGraphRunner._compile_one

    def compile_one(self: DecodeGraphRunner, bs: int) -> None:
        reserved.append(threads.reserved)
        real_compile(self, bs)

    monkeypatch.setattr(DecodeGraphRunner, "_compile_one", compile_one)
    control = _runtime_control(ex)
    control.update(RuntimeConfigUpdate(graph_mode="decode"))
    assert ex.control.wait_for_capture(60) and ex.toggles.graph_mode == "decode"
    assert reserved == [1] and threads.reserved == 0


def test_a_graph_mode_changed_in_the_update_itself_freezes_what_it_loaded(
    make_executor: MakeExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mode changed by the update itself, not by a background capture's listener (tensor
    parallel captures run in step on every rank; a mode that needs no capture): the update
    freezes the heap again (`heap.refreeze`; a no-op outside `serve`)."""
    ex = make_executor(graph_mode="decode", graph_batch_sizes="1")
    frozen: list[str] = []
    monkeypatch.setattr(heap, "refreeze", lambda: frozen.append(ex.toggles.graph_mode))
    control = _runtime_control(ex)
    control.update(RuntimeConfigUpdate(log_level="info"))
    assert frozen == []  # nothing of the graphs changed
    control.update(RuntimeConfigUpdate(graph_mode="none"))
    assert frozen == ["none"]


@pytest.mark.parametrize("compiles_here", [False, True], ids=["loads", "compiles-here"])
def test_a_load_runs_with_no_automatic_collection_until_its_listener_froze_it(
    make_executor: MakeExecutor, monkeypatch: pytest.MonkeyPatch, compiles_here: bool
) -> None:
    """Loading what a worker compiled (or a cache dir saved) adds a few hundred thousand
    objects, which each collection of the oldest generation would walk holding the GIL: the
    collector is off from the load until the listener (`serve`: `heap.refreeze`) has run.
    A capture that compiles here (minutes) leaves it on."""
    monkeypatch.setattr(
        graph_control.GraphControl, "_compile_in_worker", lambda s, m: compiles_here
    )
    ex = make_executor(graph_mode="none", graph_batch_sizes="1")
    seen: dict[str, bool] = {}
    capture_for = ex.runner.capture_for

    def recorded(*args: Any, **kwargs: Any) -> Any:
        seen["load"] = gc.isenabled()
        return capture_for(*args, **kwargs)

    monkeypatch.setattr(ex.runner, "capture_for", recorded)
    control = _runtime_control(ex)
    refreeze = control._capture_ended
    monkeypatch.setattr(
        ex.control,
        "graph_mode_listener",
        lambda: (seen.update(listener=gc.isenabled()), refreeze()),
    )
    assert gc.isenabled()
    control.update(RuntimeConfigUpdate(graph_mode="decode"))
    assert ex.control.wait_for_capture(120)
    assert ex.toggles.graph_mode == "decode"
    assert seen == {"load": compiles_here, "listener": compiles_here}
    assert gc.isenabled()

"""`GraphControl`: the runtime toggles and graph capture, changed between two steps.

It is the only writer of :class:`executor.core.toggles.Toggles`. Every change is checked first
and refused with `ToggleRefusedError` (nothing changed) when the executor cannot honour it;
then it is applied whole. A graph mode that needs a capture captures now, or with
`background` on a thread of its own while steps keep running on the current path: the
compiles first, in a compile worker process (`executor.compile_worker`) when the graph
backend compiles, then each bucket's load and compile phase without the step lock, and only
its capture runs (warm-up, checks) under it; the new mode is installed between two steps.

Under tensor parallelism rank 0 broadcasts each change (every rank captures in step, since
a capture runs collectives) and the workers apply it through the same `apply_toggles`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import ExitStack, nullcontext

import structlog
import torch

from attention import decide_needs_cpu_seq_lens
from attention.base import AttentionBackend
from executor.config import ExecutorConfig
from executor.core.errors import ToggleRefusedError
from executor.core.names import INDUCTOR, GraphMode, SeqLensPolicy
from executor.core.observer import ExecutorObserver
from executor.core.toggles import CaptureState, Toggles
from executor.graphs.capture import CaptureReport
from executor.graphs.compile_job import CompileJob, compile_in_worker
from executor.graphs.settings import background_graph_mode, resolve_graph_mode
from executor.graphs.step_threads import collections_paused, short_gil_turns
from executor.info import SettingChoice
from executor.model_runner import ModelRunner
from executor.parallel import broadcast
from executor.parallel.comm import TpComm
from executor.parallel.leader import TpLeader
from ops.device_scope import device_scope, on_own_device

log = structlog.get_logger(__name__)


class GraphControl:
    """Changes the toggles and captures graphs; not thread-safe except where it says so."""

    def __init__(
        self,
        toggles: Toggles,
        runner: ModelRunner,
        attn_backend: AttentionBackend,
        *,
        config: ExecutorConfig,
        device: torch.device,
        observer: ExecutorObserver,
        comm: TpComm,
    ) -> None:
        self.toggles = toggles
        self.runner = runner
        self.attn_backend = attn_backend
        self.config = config
        self.device = device
        self.observer = observer
        self.comm = comm
        self.leader: TpLeader | None = None  # rank 0 of a group, once it serves
        # A step and a background capture's bucket never overlap: both hold it.
        # Re-entrant: the device thread holds it over a whole step (and the next batch's
        # staging while the step runs), taking it again in each phase.
        self.step_lock = threading.RLock()
        runner.idle_gate.guard(self.step_lock)  # a capture thread holding it never waits
        self.capture_reports: list[CaptureReport] = []
        # Called (on the capture thread) when a background capture ends, either way.
        self.graph_mode_listener: Callable[[], None] | None = None
        self._capture_thread: threading.Thread | None = None
        self._background_since: float | None = None  # monotonic start of the one running
        # Raises when the model may not run now (its memory is released): no capture then.
        self.memory_guard: Callable[[], None] = lambda: None

    def start(self) -> None:
        """Capture what the start-up graph mode needs (on every rank, in the same order)."""
        mode = self.toggles.graph_mode
        if mode is not GraphMode.NONE:
            self._record_captures(self.runner.enable_graphs(mode))

    def _background_mode(self) -> str | None:
        return background_graph_mode(
            self.config, self.device, self.attn_backend.graph_capture_refusal()
        )

    def start_background(self) -> str | None:
        """`graph_mode=auto` on a CPU: capture `background_graph_mode` on a thread of its own
        while steps run eagerly; installed between two steps once every bucket is compiled.
        Returns the mode it captures, or None (nothing to do)."""
        target = self._background_mode()
        if target is None or self.toggles.graph_mode is not GraphMode.NONE:
            return None
        self.apply_toggles(graph_mode=target, background_capture=True)
        return target

    def choices(self) -> tuple[SettingChoice, ...]:
        """What graph_mode and graph_backend became here, and why (GetInfo)."""
        cfg = self.config
        backend = self.runner.graph_factory.backend
        background = self._background_mode()
        refusal = self.attn_backend.graph_capture_refusal()
        if cfg.graph_mode != "auto":
            mode_reason = "configured"
        elif refusal is not None:
            mode_reason = (
                f"auto: none, attention_backend={self.attn_backend.name} cannot be captured in "
                f"a graph ({refusal}): every step runs eagerly"
            )
        elif cfg.batch_invariant:
            how = (
                "CUDA graphs replay the same batch-invariant kernels"
                if self.device.type == "cuda"
                else "its graphs compile with dynamo's eager backend, which runs the eager "
                "kernels (inductor's fused ones would change the logits), so a graph saves no "
                "kernel time on a CPU and is not compiled in the background"
            )
            mode_reason = (
                "auto: none under batch_invariant; graph_mode decode, extend or both keeps the "
                f"logits bitwise equal: {how}"
            )
        elif background is not None:
            mode_reason = (
                f"auto: on a CPU, none at start-up, then {background} captured in the "
                f"background by the server while it serves (graph_capture: "
                f"{self.toggles.graph_capture})"
            )
        elif self.device.type == "cuda":
            mode_reason = "auto: graphs on CUDA"
        else:
            mode_reason = f"auto: none on a CPU with graph_backend={cfg.graph_backend}"
        if cfg.graph_backend != "auto":
            backend_reason = "configured"
        elif backend == "cuda":
            backend_reason = "auto: CUDA graphs on CUDA"
        elif backend == "compiled_step":
            buckets = (
                self.runner.graph_settings.decode_buckets if self.runner.graph_settings else []
            )
            when = (
                "compiled in the background"
                if background is not None
                else "when a runtime graph_mode turns DECODE graphs on"
            )
            backend_reason = (
                f"auto: whole-step inductor graphs for DECODE batch sizes {buckets}, the CPU "
                f"path measured faster than eager ({when})"
            )
        else:
            backend_reason = "auto: inductor's layer halves on a CPU"
        if backend in ("compiled", "compiled_step") and cfg.batch_invariant:
            backend_reason += (
                "; batch_invariant: compiled with dynamo's eager backend (the eager kernels, "
                "not inductor's), whole steps not saved"
            )
        return (
            SettingChoice("graph_mode", str(self.toggles.graph_mode), mode_reason),
            SettingChoice("graph_backend", backend, backend_reason),
        )

    # --- the host-lengths decision --------------------------------------------------------
    def check_needs_cpu_seq_lens(self, policy: str, graph_mode: str | None = None) -> bool:
        """The effective `needs_cpu_seq_lens` for `policy` (auto | on | off) under
        `graph_mode` (default: the current one); ToggleRefusedError where something in use
        needs the host lengths and `policy` is off. Changes nothing."""
        mode = self.toggles.graph_mode if graph_mode is None else GraphMode(graph_mode)
        try:
            return decide_needs_cpu_seq_lens(
                SeqLensPolicy(policy), [self.attn_backend], piecewise_mode=mode.piecewise_mode
            )
        except ValueError as exc:
            raise ToggleRefusedError(str(exc)) from None

    def set_needs_cpu_seq_lens(self, policy: str) -> bool:
        """Re-decide whether batches carry `seq_lens_cpu` for `policy`; the effective value.

        Raises ToggleRefusedError (and changes nothing) where `off` is impossible. Call it
        again after a graph-mode change: enabling the piecewise path turns `auto` on.
        """
        effective = self.check_needs_cpu_seq_lens(policy)
        self.toggles.seq_lens_policy = SeqLensPolicy(policy)
        self.toggles.needs_cpu_seq_lens = effective
        return effective

    def set_eager_input_no_copy(self, enabled: bool) -> None:
        """Run the next eager steps on the batch's own tensors (True) or staged (False)."""
        self.toggles.eager_input_no_copy = enabled

    # --- graph mode -----------------------------------------------------------------------
    @on_own_device
    def set_graph_mode(self, mode: str, *, background: bool = False) -> list[CaptureReport]:
        """Switch graph paths between two batches; a runner turned on for the first time is
        captured now. Refused (ToggleRefusedError, nothing changed) when the mode cannot be
        honoured: decode graphs with a backend that cannot be captured, or the piecewise path
        while needs_cpu_seq_lens is forced off, or while a background capture runs.

        With `background`, a mode that needs a capture captures on a background thread, bucket
        by bucket, while steps keep running on the current path between two buckets; the
        capture state says CAPTURING until the new mode is in use (then IDLE, or FAILED).
        Returns the reports of a capture done here ([] in the background)."""
        if self.leader is not None and not self.leader.lock.locked():
            raise ToggleRefusedError(
                "graph_mode: under tensor parallelism change it through apply_toggles, which "
                "has every rank capture in step"
            )
        target = self._resolve_graph_mode(mode)
        if self.toggles.capture is CaptureState.CAPTURING:
            raise ToggleRefusedError(
                f"graph_mode={target}: a graph capture is in progress "
                f"({self.toggles.graph_capture}); retry when GetRuntimeConfig's graph_capture "
                "is no longer 'capturing'"
            )
        reason = self.attn_backend.graph_capture_refusal()
        if target.decode_graphs and reason is not None:
            raise ToggleRefusedError(
                f"graph_mode={target}: attention backend {self.attn_backend.name!r} cannot be "
                f"captured in a graph{f' ({reason})' if reason else ''}"
            )
        try:
            needs = self.check_needs_cpu_seq_lens(self.toggles.seq_lens_policy, target)
        except ToggleRefusedError as e:
            raise ToggleRefusedError(f"graph_mode={target}: {e}") from e
        if self.runner.needs_capture(target):
            try:
                self.memory_guard()
            except RuntimeError as e:
                raise ToggleRefusedError(f"graph_mode={target}: {e}") from e
        if background and self.runner.needs_capture(target):
            self._capture_in_background(target, needs)
            return []
        reports = self.runner.enable_graphs(target)
        self._use_graph_mode(target, needs, reports)
        return reports

    def _resolve_graph_mode(self, mode: str) -> GraphMode:
        if mode == "auto":
            mode = resolve_graph_mode(
                self.config.replace(graph_mode="auto"),
                self.device,
                self.attn_backend.graph_capture_refusal(),
            )
        try:
            return GraphMode(mode)
        except ValueError:
            names = ", ".join(GraphMode)
            raise ToggleRefusedError(
                f"graph_mode must be one of auto, {names}, got {mode!r}"
            ) from None

    def _use_graph_mode(self, mode: GraphMode, needs: bool, reports: list[CaptureReport]) -> None:
        self._record_captures(reports)
        self.toggles.graph_mode = mode
        self.toggles.needs_cpu_seq_lens = needs
        log.info("graph mode changed", graph_mode=str(mode), captured=[r.kind for r in reports])

    def _capture_in_background(self, mode: GraphMode, needs: bool) -> None:
        """Capture what `mode` needs on a thread of its own; install it between two steps."""
        self.toggles.capture, self.toggles.capture_target = CaptureState.CAPTURING, mode
        self._background_since = time.monotonic()
        log.info("graph capture started in the background", graph_mode=str(mode))

        def body() -> None:
            # On a CPU, the compile worker stops while steps run (`CompilePause`), and this
            # thread's own work, the load of what it compiled, waits for them too (`IdleGate`;
            # it holds the step lock only to run and install each graph). If the worker
            # failed, this thread compiles, and its C++ compiles take a core beside the steps:
            # they run with one intra-op thread fewer then (`StepThreads`). A load runs with
            # no automatic collection until the listener (`serve`'s heap) froze what it added.
            threads, cpu = self.runner.step_threads, self.device.type == "cpu"
            with device_scope(self.device), ExitStack() as paused:
                try:
                    # short GIL turns: a step's thread gets the GIL back in time to say it runs
                    with (
                        short_gil_turns(),
                        self.runner.idle_gate.yielding() if cpu else nullcontext(),
                    ):
                        compiles_here = self._compile_in_worker(mode)
                        threads.reserved = 1 if cpu and compiles_here else 0
                        if cpu and not compiles_here:
                            paused.enter_context(collections_paused())
                        captured = self.runner.capture_for(
                            mode, progress=False, lock=self.step_lock
                        )
                except BaseException as e:  # a shutdown (StartupCancelled) or a bug
                    self.toggles.capture_error = f"{type(e).__name__}: {e}"
                    self._background_since = None  # (with the state: a scrape sees both)
                    self.toggles.capture = CaptureState.FAILED
                    log.error("background graph capture failed", graph_mode=str(mode), error=str(e))
                else:
                    with self.step_lock:  # between two steps
                        self.runner.install(captured)
                        self._use_graph_mode(mode, needs, captured.reports)
                        self._background_since = None
                        self.toggles.capture = CaptureState.IDLE
                finally:
                    threads.reserved = 0
                if self.graph_mode_listener is not None:
                    self.graph_mode_listener()

        self._capture_thread = threading.Thread(target=body, name="graph-capture", daemon=True)
        self._capture_thread.start()

    def _compile_in_worker(self, mode: GraphMode) -> bool:
        """A compiling graph backend: compile `mode`'s buckets in a worker process into the
        caches, which the capture then loads. Whether the capture compiles in this process
        (off the step lock still, but sharing this process's CPU): where the worker failed,
        and for dynamo's eager backend (batch_invariant), whose trace leaves no cache to load."""
        factory = self.runner.graph_factory
        settings = self.runner.graph_settings
        runners = self.runner.missing_runners(mode)
        if not factory.compiles or settings is None or not runners:
            return False
        if factory.compiler != INDUCTOR:
            return True
        if self.runner.all_saved(runners, self.step_lock):
            log.info("compiled graphs saved in the cache dir: loading them", runners=runners)
            return False
        job = CompileJob(
            self.config.replace(
                graph_mode="none",
                graph_backend=factory.backend,
                graph_batch_sizes=",".join(map(str, settings.decode_buckets)),
                piecewise_token_sizes=",".join(map(str, settings.piecewise_buckets)),
            ),
            runners,
            self.toggles.needs_cpu_seq_lens,
        )
        pause = self.runner.compile_pause if self.device.type == "cpu" else None
        reason = compile_in_worker(job, factory.stop, pause)
        if reason is not None:
            log.warning("compile worker failed: the capture compiles here", reason=reason)
        return reason is not None

    def background_capture_seconds(self) -> float:
        """How long the background capture now running has run; 0.0 when none runs. Any
        thread (a metrics scrape)."""
        since = self._background_since
        return 0.0 if since is None else time.monotonic() - since

    def wait_for_capture(self, timeout: float | None = None) -> bool:
        """Wait for a background capture to end; False if it is still running. Any thread."""
        thread = self._capture_thread
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()

    def _record_captures(self, reports: list[CaptureReport]) -> None:
        self.capture_reports.extend(reports)
        for r in reports:
            self.observer.on_graph_capture(r.kind, r.seconds, ok=not r.failed)
        poisoned = self.runner.graph_factory.poisoned
        if poisoned is not None and any(r.poisoned for r in reports):
            log.error("graph capture disabled, graph paths run eagerly", reason=poisoned)
            self.observer.on_graph_capture_disabled(poisoned)

    # --- all at once ----------------------------------------------------------------------
    @on_own_device
    def apply_toggles(
        self,
        *,
        eager_input_no_copy: bool | None = None,
        needs_cpu_seq_lens: str | None = None,
        graph_mode: str | None = None,
        background_capture: bool = False,
    ) -> None:
        """Apply the given toggles (None keeps a value) all together or not at all.

        Every check runs before anything changes; then the graph mode (which may capture, and
        raises ToggleRefusedError with nothing changed if it cannot), then the host-lengths
        decision under the new graph mode, then the eager path.

        With `background_capture` (the server's runtime config), a graph mode that needs a
        capture captures in the background (`set_graph_mode`); the host-lengths decision for
        it is taken when it is installed, so `needs_cpu_seq_lens` cannot change in the same
        update (refused, nothing changed).
        """
        t = self.toggles
        policy = t.seq_lens_policy if needs_cpu_seq_lens is None else needs_cpu_seq_lens
        target = self._resolve_graph_mode(t.graph_mode if graph_mode is None else graph_mode)
        self.check_needs_cpu_seq_lens(policy, target)  # raises before any change
        changes_graph = target != t.graph_mode
        if t.capture is CaptureState.CAPTURING and (changes_graph or policy != t.seq_lens_policy):
            raise ToggleRefusedError(
                f"a graph capture is in progress ({t.graph_capture}): graph_mode and "
                "needs_cpu_seq_lens cannot change until it ends"
            )
        # Not under tensor parallelism: every rank captures in step, inside the leader's lock.
        background = (
            background_capture
            and not self.comm.enabled
            and changes_graph
            and self.runner.needs_capture(target)
        )
        if background and policy != t.seq_lens_policy:
            raise ToggleRefusedError(
                f"graph_mode={target} captures in the background: change "
                "needs_cpu_seq_lens in a separate update"
            )
        if self.leader is not None:  # every rank applies it (a capture runs collectives)
            with self.leader.holding():
                self.leader.send(
                    broadcast.Command(
                        broadcast.TOGGLES,
                        toggles={
                            "eager_input_no_copy": eager_input_no_copy,
                            "needs_cpu_seq_lens": needs_cpu_seq_lens,
                            "graph_mode": graph_mode,
                        },
                    )
                )
                self._apply(policy, target, eager_input_no_copy, background=False)
            return
        self._apply(policy, target, eager_input_no_copy, background=background)

    def _apply(
        self,
        policy: str,
        target: GraphMode,
        eager_input_no_copy: bool | None,
        *,
        background: bool,
    ) -> None:
        if target != self.toggles.graph_mode:
            self.set_graph_mode(target, background=background)
        if not background:
            self.set_needs_cpu_seq_lens(policy)
        if eager_input_no_copy is not None:
            self.set_eager_input_no_copy(eager_input_no_copy)

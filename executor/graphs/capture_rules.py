"""The host-read guard: inside a device step, tensor data reaches the host only through `to_host`.

On CUDA an uncounted `.item()` or `.tolist()` on the forward path is a hidden device
sync; on a CPU device it is free and invisible, and device tensors and host mirrors are
the very same objects (`ForwardBatch.to(cpu)` moves nothing). So the guard does not ask
"which device is this tensor on?" - it asks "was this read declared?" (`ops.host_reads`):

- `to_host(tensor, reason)` runs inside `counted_transfer`, and its result is marked
  as host data; anything computed only from marked tensors is marked too.
- A read of a host mirror is declared by wrapping it in `host_mirror_read`; the declaration
  covers CPU tensors only, so on CUDA it can never hide a real device read.
- Every other data read inside the guarded region fails at once with `HostReadError`
  naming the op: `.item()`, `.tolist()`, `.numpy()`, `.cpu()`, `bool()/int()/float()`,
  formatting, `in`, a `.to()`/`.copy_()` from a device to the host, and (one level down, in
  the dispatcher) the ops that synchronize on CUDA because their output shape depends on
  data: `nonzero`, boolean indexing, `masked_select`, `unique`, `repeat_interleave` without
  `output_size`, ...

Limitation: on a CPU device `.to("cpu")` cannot be told from an upload `.to(device)`, so
only `.cpu()` and real cross-device copies are caught there.

In capture mode (a stand-in for CUDA graph capture, checked on every CPU capture by
`graph.check_capture_rules`) it also refuses what CUDA capture refuses on the way in: a
host-to-device copy from pageable (non-pinned) memory and an explicit
`torch.cuda.synchronize()`, `Stream.synchronize()` or `Event.synchronize()`.

:class:`ForbiddenValue` is the companion for fields nothing may read at all (the tests put it
in `seq_lens_cpu` / `seq_lens_sum` when the mirror is off).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, NoReturn

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary

from ops.host_reads import HostReadError, is_pinned, refuse_in_capture
from ops.host_reads import state as _state

__all__ = ["ForbiddenValue", "HostReadError", "HostReadGuard"]


def _refuse_sync(original: Callable[..., Any], what: str) -> Callable[..., Any]:
    def refusing(*args: Any, **kwargs: Any) -> Any:
        refuse_in_capture(what)
        return original(*args, **kwargs)

    refusing.__wrapped__ = original  # type: ignore[attr-defined]
    return refusing


class _SyncPatch:
    """While a capture guard is active anywhere, CUDA's explicit synchronizations refuse on
    the threads that hold one (other threads call through unchanged)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._saved: list[tuple[Any, str, Any]] = []

    def acquire(self) -> None:
        with self._lock:
            self._users += 1
            if self._users > 1:
                return
            for owner, name, what in (
                (torch.cuda, "synchronize", "torch.cuda.synchronize()"),
                (torch.cuda.Stream, "synchronize", "Stream.synchronize()"),
                (torch.cuda.Event, "synchronize", "Event.synchronize()"),
            ):
                original = getattr(owner, name)
                self._saved.append((owner, name, original))
                setattr(owner, name, _refuse_sync(original, what))

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users > 0:
                return
            for owner, name, original in reversed(self._saved):
                setattr(owner, name, original)
            self._saved.clear()


_sync_patch = _SyncPatch()


# Python-level reads of tensor data (seen by the function mode).
_READS: dict[Callable[..., Any], str] = {
    torch.Tensor.item: "Tensor.item()",
    torch.Tensor.tolist: "Tensor.tolist()",
    torch.Tensor.numpy: "Tensor.numpy()",
    torch.Tensor.cpu: "Tensor.cpu()",
    torch.Tensor.__bool__: "bool(tensor)",
    torch.Tensor.__int__: "int(tensor)",
    torch.Tensor.__float__: "float(tensor)",
    torch.Tensor.__complex__: "complex(tensor)",
    torch.Tensor.__index__: "operator.index(tensor)",
    torch.Tensor.__format__: "format(tensor)",
    torch.Tensor.__repr__: "repr(tensor)",
    torch.Tensor.__str__: "str(tensor)",
    torch.Tensor.__array__: "numpy.asarray(tensor)",
    torch.Tensor.__contains__: "`x in tensor`",
}
_MOVES: dict[Callable[..., Any], str] = {
    torch.Tensor.to: "Tensor.to(cpu)",
    torch.Tensor.copy_: "Tensor.copy_() into a host tensor",
}

# aten ops that read data on the host, or whose output shape depends on data (a sync on
# CUDA), by overload packet name.
_SYNC_OPS = frozenset(
    {
        "item",
        "_local_scalar_dense",
        "is_nonzero",
        "equal",
        "nonzero",
        "argwhere",
        "masked_select",
        "_unique",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "unique_dim_consecutive",
        "bincount",
        "histc",
    }
)


def _tensors(args: Any, kwargs: Any) -> list[torch.Tensor]:
    flat, _ = tree_flatten((args, kwargs or {}))
    return [t for t in flat if isinstance(t, torch.Tensor)]


def _is_host_move(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Does this `.to()` / `.copy_()` move data from a device to the host?"""
    if func is torch.Tensor.copy_:
        dst, src = args[0], args[1]
        return bool(dst.device.type == "cpu" and src.device.type != "cpu")
    src = args[0]
    if src.device.type == "cpu":
        return False
    device, *_ = torch._C._nn._parse_to(*args[1:], **kwargs)
    return device is not None and device.type == "cpu"


_UPLOADS: dict[Callable[..., Any], str] = {
    torch.Tensor.to: "Tensor.to(device)",
    torch.Tensor.copy_: "Tensor.copy_() into a device tensor",
    torch.Tensor.cuda: "Tensor.cuda()",
}


def _upload_source(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> torch.Tensor | None:
    """The host tensor a `.to()` / `.copy_()` / `.cuda()` uploads to a device, or None."""
    if func is torch.Tensor.copy_:
        dst, src = args[0], args[1]
        if isinstance(src, torch.Tensor) and src.device.type == "cpu" and dst.device.type != "cpu":
            return src
        return None
    src = args[0]
    if src.device.type != "cpu":
        return None
    if func is torch.Tensor.cuda:
        return src
    device, *_ = torch._C._nn._parse_to(*args[1:], **kwargs)
    return src if device is not None and device.type != "cpu" else None


class _FunctionGuard(TorchFunctionMode):
    def __init__(self, guard: HostReadGuard) -> None:
        super().__init__()
        self.guard = guard

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        op = _READS.get(func)
        if op is None and func in _MOVES and _is_host_move(func, args, kwargs):
            op = _MOVES[func]
        if self.guard.capture and func in _UPLOADS:
            src = _upload_source(func, args, kwargs)
            if src is not None and not is_pinned(src):
                self.guard.fail(f"{_UPLOADS[func]} from pageable (non-pinned) host memory", src)
        if op is not None and _state.transfer_depth == 0:
            subject = args[0]
            if self.guard.allows(subject):
                _state.allowed_depth += 1
                try:
                    return func(*args, **kwargs)
                finally:
                    _state.allowed_depth -= 1
            self.guard.fail(op, subject)
        out = func(*args, **kwargs)
        self.guard.propagate(args, kwargs, out)
        return out


class _DispatchGuard(TorchDispatchMode):
    def __init__(self, guard: HostReadGuard) -> None:
        super().__init__()
        self.guard = guard

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if _state.transfer_depth == 0 and _state.allowed_depth == 0:
            op = self._sync_op(func, args, kwargs)
            if op is not None:
                tensors = _tensors(args, kwargs)
                if not all(self.guard.allows(t) for t in tensors):
                    self.guard.fail(op, tensors[0] if tensors else None)
        return func(*args, **kwargs)

    @staticmethod
    def _sync_op(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        name = func.overloadpacket.__name__
        if name in _SYNC_OPS:
            return f"aten.{name}"
        if name == "repeat_interleave" and kwargs.get("output_size") is None:
            return "aten.repeat_interleave without output_size"
        if name in ("index", "index_put", "index_put_"):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                for i in indices
            ):
                return f"aten.{name} with a boolean mask"
        if name in ("_to_copy", "copy_", "to"):
            tensors = _tensors(args, kwargs)
            device = kwargs.get("device")
            if name == "copy_" and len(tensors) >= 2:
                if tensors[0].device.type == "cpu" and tensors[1].device.type != "cpu":
                    return "aten.copy_ from a device to the host"
            elif (
                device is not None
                and torch.device(device).type == "cpu"
                and tensors
                and tensors[0].device.type != "cpu"
            ):
                return f"aten.{name} to the host"
        return None


class HostReadGuard:
    """Context manager: fail on any host read not covered by `to_host` or a declaration.

    Thread-local: it guards the thread that enters it (the device worker). Violations are
    raised at once as :class:`HostReadError` and also kept in `violations`.

    With `capture=True` it stands for CUDA graph capture: even counted transfers and declared
    host-mirror reads are refused, since a captured graph cannot wait for the host.
    """

    def __init__(self, *, capture: bool = False) -> None:
        self.capture = capture
        self.host_tensors: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self.violations: list[str] = []
        self._modes: tuple[_FunctionGuard, _DispatchGuard] | None = None

    def __enter__(self) -> HostReadGuard:
        self._modes = (_FunctionGuard(self), _DispatchGuard(self))
        _state.guards.append(self)
        if self.capture:
            _sync_patch.acquire()
        self._modes[0].__enter__()
        self._modes[1].__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._modes is not None
        try:
            self._modes[1].__exit__(*exc)
            self._modes[0].__exit__(*exc)
        finally:
            _state.guards.remove(self)
            if self.capture:
                _sync_patch.release()
            self._modes = None

    def allows(self, tensor: Any) -> bool:
        if not isinstance(tensor, torch.Tensor):
            return True
        if tensor in self.host_tensors:
            return True
        return bool(_state.mirror_names) and tensor.device.type == "cpu"

    def propagate(self, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Results computed only from host-marked tensors are host data too."""
        inputs = _tensors(args, kwargs)
        if not inputs or not all(t in self.host_tensors for t in inputs):
            return
        for t in _tensors(out, None):
            self.host_tensors[t] = True

    def fail(self, op: str, subject: Any) -> NoReturn:
        what = (
            f"a {subject.device.type} tensor of shape {list(subject.shape)}"
            if isinstance(subject, torch.Tensor)
            else "a tensor"
        )
        if self.capture:
            message = (
                f"capture-unsafe op: {op} on {what} during graph capture. A captured graph "
                "cannot read device data on the host, wait for the host (synchronize, "
                "uploads from pageable memory) or allocate a data-dependent size; move "
                "the op out of the captured region or run this path eagerly."
            )
        else:
            message = (
                f"uncounted host read: {op} on {what} inside a guarded device step. "
                "Device data must leave through ops.host_transfer.to_host(tensor, reason); "
                "a read of a host mirror must be declared with "
                "ops.host_reads.host_mirror_read(name)."
            )
        self.violations.append(message)
        raise HostReadError(message)


class ForbiddenValue:
    """Stands in for a field nothing may read: any use raises :class:`HostReadError`.

    Only identity survives (`value is None` is False, so a consumer that checks for the
    mirror and then uses it fails too); `repr` works so a failing test can print the batch.
    """

    __slots__ = ("_what",)

    def __init__(self, what: str) -> None:
        object.__setattr__(self, "_what", what)

    def _fail(self, *args: object, **kwargs: object) -> NoReturn:
        raise HostReadError(f"{object.__getattribute__(self, '_what')} was read, but must not be")

    def __getattr__(self, name: str) -> NoReturn:
        self._fail()

    def __repr__(self) -> str:
        return f"<forbidden {object.__getattribute__(self, '_what')}>"

    __bool__ = __len__ = __iter__ = __int__ = __index__ = __float__ = _fail
    __getitem__ = __contains__ = __call__ = __hash__ = _fail
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _fail
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _fail
    __truediv__ = __floordiv__ = __array__ = _fail

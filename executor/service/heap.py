"""A serving process's long-lived heap kept out of Python's cyclic garbage collector.

A full collection walks every object the collector tracks while holding the interpreter lock,
so a step that meets one waits for the whole heap: after start-up that is torch's and the
model's objects, and after a compiled step is loaded, inductor's code too. `freeze` collects
what is not frozen yet, then moves every object alive into the permanent generation
(`gc.freeze`), which collections skip: from then on a collection walks only what the process
allocated since. `serve` freezes twice: once its imports are done, without the collection
(the imports' objects are alive but for a few dozen: a full walk of them is start-up time
for nothing), then once the model is loaded and warmed, before it serves, after a collection
of only what the start-up added. `refreeze` freezes what a later install added
(a background graph capture's compiled step) without a collection: the load ran with the
collector off (`graphs.step_threads.collections_paused`), so all it added is in the youngest
generation, and even a collection of that one would walk all of it (the load's garbage cycles
stay). A frozen object is still freed when its last reference goes; only a cycle among frozen
objects is never collected. Neither call counts the frozen objects (`gc.get_freeze_count`
walks the whole permanent generation, holding the GIL as long as a collection of it would).

The state is the process's (the collector's is): only a process's own entry point freezes
(`serve`, a tensor-parallel worker), never a library caller such as an in-process test server.
"""

from __future__ import annotations

import gc

_frozen = False


def freeze(*, collect: bool = True) -> None:
    """Collect what is not frozen yet (`collect`; without it, a garbage cycle alive now is
    kept for the process's life), then freeze everything alive now."""
    global _frozen
    if collect:
        gc.collect()
    gc.freeze()
    _frozen = True


def refreeze() -> None:
    """In a process that froze its heap: freeze what was added since, without a collection
    (microseconds: the young generations join the permanent one); elsewhere nothing."""
    if _frozen:
        gc.freeze()


def frozen() -> bool:
    return _frozen


def thaw() -> None:
    """Back to an ordinary heap (every frozen object collectable again)."""
    global _frozen
    gc.unfreeze()
    _frozen = False

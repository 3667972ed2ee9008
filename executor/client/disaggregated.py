"""Disaggregated serving with the reference scheduler: prefill on executor A, decode on B.

Each prompt is prefilled on A (a `ReferenceScheduler` of A, the request's first token sampled
there); then A pushes the prompt's KV straight into a row and slots B's scheduler reserved
(`PushKV`: the bytes never pass through here), and B's scheduler decodes the request from
there as if it had prefilled it. `migrate` moves a running request the same way between two
steps. The push happens right after A's step, before A's next batch, so the slots A's
scheduler just freed still hold the KV (A is told about the freed row with that next batch).

A failed push raises `TransferFailed` (the transfer's status and message) after freeing what
B reserved: B's cache was left as it was. Not with overlap, speculation, sampling controls or
JSON schemas (the executor's row state for those does not travel with the KV).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from executor.client.grpc_client import ExecutorClient
from executor.client.kv_client import KVClient, PushSpec, TransferResult
from executor.client.requests import Request, check_request
from executor.client.scheduler import ReferenceScheduler
from executor.core.forward_batch import SamplingParams


def reserve(sched: ReferenceScheduler, num_slots: int) -> tuple[int, list[int]] | None:
    """A row and `num_slots` slots of `sched` for a request arriving with its KV; None: no
    room now. Releases `sched` owes its executor are sent first: a row or slot freed by the
    scheduler but not yet released is still live on the executor."""
    sched.flush_releases()
    if len(sched.running) >= sched.limits.max_batch_size or not sched.allocator.can_admit(
        num_slots
    ):
        return None
    return sched.allocator.alloc_row(), sched.allocator.alloc_slots(num_slots)


def adopt(sched: ReferenceScheduler, req: Request) -> None:
    """`sched` decodes `req` from here on: its executor holds the KV of the first
    `num_computed` tokens in `req.row` / `req.slots` (imported); `output_ids[-1]` is next."""
    if sched.overlap or req.draft is not None or req.controls is not None:
        raise ValueError("an adopted request runs without overlap, speculation or controls")
    sched.running.append(req)


def detach(sched: ReferenceScheduler, req: Request) -> None:
    """`sched` stops running `req` (it moved): its row and slots are freed, the row released
    to the executor with the next batch."""
    sched.running.remove(req)
    sched.allocator.free(req.row, req.slots)
    sched.released_rows.append(req.row)


PUSH_ATTEMPTS = 3  # a push that timed out or lost its answer is sent again (exactly once)


class TransferFailed(RuntimeError):
    """A KV push between the executors failed; nothing was written on the target."""

    def __init__(self, result: TransferResult) -> None:
        super().__init__(f"KV push {result.transfer_id} failed: {result.code}: {result.message}")
        self.result = result


def migrate(
    req: Request,
    source: ReferenceScheduler,
    source_kv: KVClient,
    dest: ReferenceScheduler,
    dest_address: str,
) -> TransferResult:
    """Move running `req` from `source` to `dest` between two steps: `dest` reserves a row and
    the request's whole budget of slots, the source executor pushes the KV of its
    `num_computed` tokens there, then `dest` decodes it. On a failed push `req` stays on
    `source` and `dest` frees its reservation (TransferFailed)."""
    if not req.prefilled or req.finished:
        raise ValueError("only a prefilled, unfinished request migrates")
    budget = len(req.prompt_ids) + req.max_new_tokens - 1
    reserved = reserve(dest, budget)
    if reserved is None:
        raise RuntimeError(f"the destination has no room for {budget} slots and a row now")
    row, slots = reserved
    n = req.num_computed
    [result] = source_kv.push(
        [PushSpec(req.slots[:n], dest_address, row, slots[:n])], attempts=PUSH_ATTEMPTS
    )
    if not result.ok:
        dest.allocator.free(row, slots)
        raise TransferFailed(result)
    detach(source, req)
    req.row, req.slots = row, slots
    adopt(dest, req)
    return result


@dataclass
class _Pending:
    """A user's request while its prefill runs on A (`prefill` is A's one-token request)."""

    user: Request
    prefill: Request


@dataclass
class DisaggregatedScheduler:
    """`prefill`/`decode`: clients of executors A and B; `decode_address`: B as A reaches it
    (the push goes from A to B directly)."""

    prefill: ExecutorClient
    decode: ExecutorClient
    decode_address: str
    eos_token_ids: Sequence[int] = ()
    transfers: list[TransferResult] = field(default_factory=list)

    def __post_init__(self) -> None:
        info_a, info_b = self.prefill.info().info, self.decode.info().info
        self.a = ReferenceScheduler(self.prefill.retrying(), info_a.limits, self.eos_token_ids)
        self.b = ReferenceScheduler(self.decode.retrying(), info_b.limits, self.eos_token_ids)
        self._pending: dict[int, _Pending] = {}  # A's request id -> the user's request
        self._rids = 0

    def add_request(
        self,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int = 32,
        sampling: SamplingParams | None = None,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
        on_token: Callable[[Request, int], None] | None = None,
    ) -> Request:
        check_request(prompt_ids, max_new_tokens, self.b.limits)
        stops = set(stop_token_ids or ())
        if not ignore_eos:
            stops |= set(self.eos_token_ids)
        pre = self.a.add_request(
            prompt_ids,
            max_new_tokens=1,
            sampling=sampling,
            stop_token_ids=sorted(stops),
            ignore_eos=True,  # `stops` already holds the EOS ids when they count
        )
        self._rids += 1
        user = Request(
            rid=self._rids,
            prompt_ids=list(prompt_ids),
            max_new_tokens=max_new_tokens,
            sampling=sampling or SamplingParams(),
            stop_token_ids=frozenset(stops),
            on_token=on_token,
        )
        self._pending[pre.rid] = _Pending(user, pre)
        return user

    def run(self) -> None:
        """Prefill on A and decode on B, interleaved, until every request finished."""
        while self.a.has_work() or self.b.has_work():
            if self.a.has_work():
                for pre in self.a.step():
                    self._hand_over(self._pending.pop(pre.rid))
            if self.b.has_work():
                self.b.step()
        self.a.flush_releases()
        self.b.flush_releases()

    def _hand_over(self, p: _Pending) -> None:
        """A's prefill finished: its first token is the user's; push the KV to B."""
        user, pre = p.user, p.prefill
        if pre.finish_reason == "stop":  # the first token was a stop token
            user.finish_reason = "stop"
            return
        token = pre.output_ids[0]
        user.output_ids.append(token)
        if user.on_token is not None:
            user.on_token(user, token)
        if user.max_new_tokens == 1:
            user.finish_reason = "length"
            return
        budget = len(user.prompt_ids) + user.max_new_tokens - 1
        reserved = reserve(self.b, budget)
        while reserved is None:  # B is full: decode there until a request frees room
            if not self.b.has_work():
                raise RuntimeError(f"the decode executor cannot hold a request of {budget} slots")
            self.b.step()
            reserved = reserve(self.b, budget)
        row, slots = reserved
        n = len(user.prompt_ids)
        # NOTE: A's scheduler freed `pre`'s slots, but A's executor holds them until A's next
        # batch releases the row: the push reads them before that batch.
        spec = PushSpec(pre.slots[:n], self.decode_address, row, slots[:n])
        [result] = self.prefill.kv.push([spec], attempts=PUSH_ATTEMPTS)
        self.transfers.append(result)
        if not result.ok:
            self.b.allocator.free(row, slots)
            raise TransferFailed(result)
        user.row, user.slots, user.num_computed = row, slots, n
        adopt(self.b, user)

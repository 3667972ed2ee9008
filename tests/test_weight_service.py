"""Weight updates and memory over gRPC (a real server on loopback): the three transports
equal a fresh executor on the new weights; each refusal has its status and changes nothing;
64 steps in flight around an update each name the weights their logits came from."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from executor.batch_prep import make_extend_batch
from executor.client.grpc_client import ExecutorClient
from executor.model_executor import ModelExecutor
from executor.models.tiny_random import TINY_CONFIGS, tiny_random_weights
from executor.parallel.group import free_port
from executor.service.server import RunningServer
from executor.service.weights_codec import spec_to_proto, tensor_spec
from executor.weights.writer import digest
from model_executor.v1 import executor_pb2 as pb
from ops.checksum import checksum
from tests.server_util import Scrape, running_server
from tests.weights_util import config, greedy, new_weights, saved

# Every test here loads an executor or starts a server: over half a second each.
pytestmark = pytest.mark.slow

TOKEN = "operator-secret"


@pytest.fixture(scope="module")
def updated(
    tmp_path_factory: pytest.TempPathFactory, cache_dir: Path
) -> tuple[dict[str, torch.Tensor], list[list[int]], Path]:
    """The new weights, the greedy tokens of a fresh executor started on them, and where they
    are saved (the root path updates may read)."""
    root = tmp_path_factory.mktemp("weights-root")
    tensors = new_weights()
    ref = ModelExecutor(config(cache_dir, str(saved(root, "tiny-random", tensors))))
    return tensors, greedy(ref), root


@pytest.fixture
def server(tmp_path: Path, cache_dir: Path, updated: Any) -> Iterator[RunningServer]:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    with running_server(
        config(cache_dir),
        runtime_config_token_file=str(token_file),
        weight_update_root=str(updated[2]),
        weight_group_addresses="127.0.0.1",
        stream_window=64,
        queue_size=128,
    ) as srv:
        yield srv


@pytest.fixture
def client(server: RunningServer) -> Iterator[ExecutorClient]:
    with ExecutorClient(f"127.0.0.1:{server.port}", token=TOKEN) as c:
        yield c


def _remote_greedy(client: ExecutorClient) -> list[list[int]]:
    return greedy(_Remote(client))


class _Remote:
    def __init__(self, client: ExecutorClient) -> None:
        self.forward = client.forward
        self.limits = client.info().info.limits


def test_stream_update_equals_a_fresh_executor(
    server: RunningServer, client: ExecutorClient, updated: Any
) -> None:
    tensors, want, _ = updated
    result = client.weights.update(tensors.items(), version="step-7")
    assert result.version == "step-7" and result.num_tensors == len(tensors)
    assert _remote_greedy(client) == want
    info = client.info().info
    assert info.weight_version == "step-7"
    scrape = Scrape(server)
    assert scrape.get("model_executor_weight_version_info", version="step-7") == 1
    assert scrape.get("model_executor_weight_updates_total", transport="stream", outcome="ok") == 1
    assert info.weight_update_max_tensors == len(tiny_random_weights(TINY_CONFIGS["tiny-random"]))


def test_path_update_is_confined_to_the_root(
    client: ExecutorClient, updated: Any, tmp_path: Path
) -> None:
    tensors, want, _ = updated
    outside = saved(tmp_path, "tiny-random", tensors)
    with pytest.raises(grpc.RpcError) as refused:
        client.weights.update_from_path(str(outside))
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.RpcError) as escaped:
        client.weights.update_from_path("../" + outside.parent.name + "/" + outside.name)
    assert escaped.value.code() == grpc.StatusCode.PERMISSION_DENIED
    result = client.weights.update_from_path("tiny-random-updated", version="disk")
    assert result.version == "disk"
    assert _remote_greedy(client) == want


def test_group_update_equals_a_fresh_executor_and_a_refusal_never_hangs(
    client: ExecutorClient, updated: Any
) -> None:
    tensors, want, _ = updated
    with client.weights.open_group("127.0.0.1", free_port(), world_size=2, timeout_s=60) as group:
        bad = {"model.layers.0.mlp.down_proj.weight": torch.zeros(3, 3)}
        with pytest.raises(grpc.RpcError) as refused:
            group.update(bad.items())
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        result = group.update(tensors.items(), version="nccl-or-gloo")
        assert result.version == "nccl-or-gloo"
    assert _remote_greedy(client) == want


def _stream(
    tensors: dict[str, torch.Tensor], corrupt: bool = False
) -> Iterator[pb.WeightUpdateRequest]:
    """An UpdateWeights stream made of protobuf messages (the client helper serializes its
    own); `corrupt`: the last chunk's first byte flipped after its CRC was taken."""
    specs = [spec_to_proto(tensor_spec(n, t)) for n, t in tensors.items()]
    yield pb.WeightUpdateRequest(header=pb.WeightUpdateHeader(tensors=specs))
    for i, t in enumerate(tensors.values()):
        data = t.numpy().tobytes()
        for offset in range(0, len(data), 1024):
            part = data[offset : offset + 1024]
            crc = checksum(part)
            if corrupt and i == len(tensors) - 1:
                part = b"\xff" + part[1:]
            chunk = pb.WeightChunk(tensor=i, offset=offset, data=part, crc32=crc)
            yield pb.WeightUpdateRequest(chunk=chunk)


def test_each_refusal_has_its_status_and_leaves_the_weights(
    server: RunningServer, client: ExecutorClient
) -> None:
    assert server.executor is not None
    before = digest(server.executor.model)
    norm = {
        "model.norm.weight": torch.full((64,), 2.0),
        "model.layers.1.input_layernorm.weight": torch.ones(64),
    }
    md = [("authorization", f"Bearer {TOKEN}")]
    cases: list[tuple[str, Any, grpc.StatusCode]] = [
        (
            "corrupted chunk",
            lambda: client.stub.UpdateWeights(_stream(norm, corrupt=True), metadata=md),
            grpc.StatusCode.DATA_LOSS,
        ),
        (
            "unknown name",
            lambda: client.weights.update({"model.layers.7.norm.weight": torch.ones(64)}.items()),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            "wrong shape",
            lambda: client.weights.update({"model.norm.weight": torch.ones(65)}.items()),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            "missing token",
            lambda: client.stub.UpdateWeights(_stream(norm)),
            grpc.StatusCode.UNAUTHENTICATED,
        ),
    ]
    for what, call, code in cases:
        with pytest.raises(grpc.RpcError) as refused:
            call()
        assert refused.value.code() == code, (what, refused.value.details())
    client.weights.release(["weights"])
    with pytest.raises(grpc.RpcError) as released:
        client.weights.update(norm.items())
    assert released.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    scrape = Scrape(server)  # four refused updates (the tokenless call never reached one)
    assert (
        scrape.get("model_executor_weight_updates_total", transport="stream", outcome="failed") == 4
    )
    assert scrape.get("model_executor_memory_released", tag="weights") == 1
    batch = make_extend_batch(input_ids=[[1, 2]], req_pool_indices=[1], out_cache_loc=[[1, 2]])
    with pytest.raises(grpc.RpcError) as step:
        client.forward(batch)
    assert step.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert client.info().info.memory.released == ("weights",)  # type: ignore[union-attr]
    state = client.weights.resume(["weights"])
    assert state.released == () and state.kv_epoch == 0
    assert digest(server.executor.model) == before
    assert client.info().info.weight_version == "0"


def test_64_steps_in_flight_each_name_the_weights_they_ran_on(
    server: RunningServer, client: ExecutorClient, updated: Any, cache_dir: Path
) -> None:
    """Each step prefills its own prompt on row 1 (released by the next step) with logprobs;
    every answer must equal, token and logprob, what the weights it names give."""
    tensors = updated[0]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (6,), generator=g).tolist() for _ in range(64)]
    batches = [_prefill(p, i) for i, p in enumerate(prompts)]
    refs = {"0": ModelExecutor(config(cache_dir))}
    refs["v1"] = ModelExecutor(config(cache_dir))
    refs["v1"].weights.swap(
        refs["v1"].weights.stage(
            refs["v1"].weights.plan(
                [tensor_spec(n, t) for n, t in tensors.items()], "v1", max_bytes=1 << 40
            ),
            list(tensors.values()),
        )
    )
    session = client.open_stream()
    for b in batches[:24]:
        session.send(b)
    outs = [session.recv()]  # one step ran on the old weights before the update began
    updater = threading.Thread(target=lambda: client.weights.update(tensors.items(), version="v1"))
    updater.start()
    for b in batches[24:56]:  # up to 55 steps in flight while the update is staged and swapped
        session.send(b)
    updater.join()
    for b in batches[56:]:  # sent after it answered: these run on the new weights
        session.send(b)
    outs += [session.recv() for _ in batches[1:]]
    session.close()
    versions = [o.weight_version for o in outs]
    assert versions == sorted(versions) and set(versions) == {"0", "v1"}, versions
    for i, (out, b) in enumerate(zip(outs, batches, strict=True)):
        ref = refs[out.weight_version].forward(b)
        other = refs["v1" if out.weight_version == "0" else "0"].forward(b)
        assert out.next_token_ids.tolist() == ref.next_token_ids.tolist(), i
        assert out.next_token_logprobs is not None and ref.next_token_logprobs is not None
        assert torch.allclose(out.next_token_logprobs, ref.next_token_logprobs, atol=1e-5), i
        # ... which the other weights would not have given
        assert other.next_token_logprobs is not None
        assert out.next_token_ids.tolist() != other.next_token_ids.tolist() or not torch.allclose(
            out.next_token_logprobs, other.next_token_logprobs, atol=1e-5
        ), i


def _prefill(prompt: list[int], i: int):  # type: ignore[no-untyped-def]
    base = 1 + (i % 2) * len(prompt)
    batch = make_extend_batch(
        input_ids=[prompt],
        req_pool_indices=[1 + i % 2],
        out_cache_loc=[list(range(base, base + len(prompt)))],
    )
    batch.return_logprob = True
    if i:  # the previous step's row: released before this one runs
        batch.released_req_pool_indices = torch.tensor([1 + (i - 1) % 2])
    return batch


# SmolLM2 three times (transformers, the server, a fresh executor): the gate runs each
# transport on tiny-random (above) and the resident-set release on a medium-random model
# (tests/test_memory_release.py).
@pytest.mark.long
def test_smollm2_float32_updates_by_each_transport_equal_a_fresh_executor(
    tmp_path: Path, cache_dir: Path, hf_smollm2: torch.nn.Module
) -> None:
    """Perturbed weights built with transformers, its state dict saved (as a trainer saves a
    checkpoint): read by the server from its root, streamed, and broadcast over a weights
    group, each gives a fresh executor's greedy tokens on them. Between two transports the
    weights are released (the resident set drops by >= 90% of them before the call answers)
    and resumed from the model file (the start-up tokens again)."""
    from safetensors.torch import save_file

    from executor.weights.memory import resident_bytes

    hf = hf_smollm2  # shared: perturbed copies, the model itself unchanged
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # by storage: the tied head is the perturbed embedding
        moved = {
            p.data_ptr(): p + torch.randn(p.shape, generator=g) * 0.02 * p.std()
            for p in hf.parameters()
        }
    root = tmp_path / "root"
    hf.config.save_pretrained(root / "step-1")  # transformers will not save a GGUF-loaded model
    state = {  # a trainer's state dict
        n: moved.get(t.data_ptr(), t).detach().clone() for n, t in hf.state_dict().items()
    }
    save_file(state, str(root / "step-1" / "model.safetensors"))
    del moved
    smol = config(cache_dir, "smollm2", quantization="none", kv_slots=2048, max_context_len=512)
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 9690, 28, 216, 29, 30]]
    want = greedy(ModelExecutor(smol.replace(model=str(root / "step-1"))), 12, prompts)
    token = tmp_path / "token"
    token.write_text(TOKEN)
    with (
        running_server(
            smol,
            runtime_config_token_file=str(token),
            weight_update_root=str(root),
            weight_group_addresses="127.0.0.1",
        ) as srv,
        ExecutorClient(f"127.0.0.1:{srv.port}", token=TOKEN) as client,
    ):
        before = greedy(_Remote(client), 12, prompts)
        weights = client.weights
        transports = {
            "path": lambda: weights.update_from_path("step-1", version="path"),
            "stream": lambda: weights.update(state.items(), version="stream"),
            "group": lambda: _group_update(client, state),
        }
        for i, (name, call) in enumerate(transports.items()):
            if i:
                rss = resident_bytes()
                freed = weights.release(["weights"]).nbytes
                assert rss - resident_bytes() >= 0.9 * freed > 500 << 20, (rss, freed)
                weights.resume(["weights"])
                assert greedy(_Remote(client), 12, prompts) == before, name
            result = call()
            assert result.num_tensors == len(state)  # the tied head's copy too (ignored)
            assert client.info().info.weight_version == result.version == name
            assert greedy(_Remote(client), 12, prompts) == want != before, name


def _group_update(client: ExecutorClient, state: dict[str, torch.Tensor]) -> Any:
    with client.weights.open_group("127.0.0.1", free_port(), world_size=2, timeout_s=120) as g:
        return g.update(state.items(), version="group")


def test_caps_are_in_getinfo_and_refused_from_the_header(client: ExecutorClient) -> None:
    md = [("authorization", f"Bearer {TOKEN}")]
    caps = client.stub.GetInfo(pb.GetInfoRequest(), metadata=md).weight_update_limits
    model = tiny_random_weights(TINY_CONFIGS["tiny-random"])
    assert caps.max_tensors == len(model) and caps.chunk_bytes == 4 << 20
    assert caps.max_update_bytes >= sum(4 * t.numel() for t in model.values())
    assert (caps.max_name_bytes, caps.max_version_bytes) == (256, 128)
    assert caps.path_updates and caps.group_updates and caps.max_group_timeout_s == 600
    join = pb.InitWeightsGroupRequest(
        master_address="127.0.0.1", master_port=1, rank_offset=1, world_size=2, timeout_s=601
    )
    with pytest.raises(grpc.RpcError) as stalls:
        client.stub.InitWeightsGroup(join, metadata=md)
    assert stalls.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert stalls.value.details().startswith("timeout_s: ")
    spec = pb.WeightTensorSpec(name="model.norm.weight", dtype=pb.FLOAT32, shape=[64])
    too_many = pb.WeightUpdateHeader(tensors=[spec] * (caps.max_tensors + 1))
    long_version = pb.WeightUpdateHeader(weight_version="v" * 129, tensors=[spec])
    for header, code, field in (
        (too_many, grpc.StatusCode.RESOURCE_EXHAUSTED, "tensors: "),
        (long_version, grpc.StatusCode.INVALID_ARGUMENT, "weight_version: "),
    ):
        with pytest.raises(grpc.RpcError) as refused:
            client.stub.UpdateWeights(iter([pb.WeightUpdateRequest(header=header)]), metadata=md)
        assert refused.value.code() == code and field in refused.value.details()
    assert client.info().info.weight_version == "0"


def test_a_stream_that_fails_midway_changes_nothing(
    server: RunningServer, client: ExecutorClient, updated: Any
) -> None:
    """Cut short, a chunk out of order or past the last tensor, the caller gone: DATA_LOSS /
    CANCELLED, the weights and the version as they were; the whole update then goes in."""
    assert server.executor is not None
    before, md = digest(server.executor.model), [("authorization", f"Bearer {TOKEN}")]
    tensors = updated[0]
    whole = list(_stream(tensors))
    swapped = [whole[0], whole[2], whole[1], *whole[3:]]
    extra = pb.WeightChunk(tensor=len(tensors), offset=0, data=b"x", crc32=checksum(b"x"))
    past = [*whole, pb.WeightUpdateRequest(chunk=extra)]
    for what, requests in (("cut short", whole[:-1]), ("out of order", swapped), ("past", past)):
        with pytest.raises(grpc.RpcError) as refused:
            client.stub.UpdateWeights(iter(requests), metadata=md)
        assert refused.value.code() == grpc.StatusCode.DATA_LOSS, what
        assert "chunk" in refused.value.details() or "ended" in refused.value.details()
    gone = threading.Event()

    def stalls() -> Iterator[pb.WeightUpdateRequest]:
        yield from whole[:-1]
        gone.wait(30)

    call = client.stub.UpdateWeights.future(stalls(), metadata=md)
    time.sleep(0.5)
    call.cancel()
    gone.set()
    assert call.cancelled()
    assert digest(server.executor.model) == before
    assert client.info().info.weight_version == "0"
    # The caller has its CANCELLED at once; the server's handler ends (and lets the next
    # weight call in) when it next reads the stream: until then, "retry when it has answered".
    deadline = time.monotonic() + 30
    while True:
        try:
            answer = client.weights.update(tensors.items(), version="whole")
            break
        except grpc.RpcError as e:
            busy = e.code() == grpc.StatusCode.FAILED_PRECONDITION and "in progress" in str(
                e.details()
            )
            if not busy or time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    assert answer.version == "whole"
    assert _remote_greedy(client) == updated[1]


def test_a_stream_that_fails_after_an_update_leaves_that_updates_weights(
    server: RunningServer, client: ExecutorClient, updated: Any
) -> None:
    """The next stream lands in the memory the last one staged in (`StagingArena`): one that
    fails midway, having overwritten nearly all of it, leaves the weights the last update
    wrote (nothing of the model points into the staging memory); a release lets it go."""
    assert server.executor is not None
    control, md = server.executor.weights, [("authorization", f"Bearer {TOKEN}")]
    tensors, want, _ = updated
    assert client.weights.update(tensors.items(), version="first").version == "first"
    after, held = digest(server.executor.model), control.staging.nbytes
    assert held >= sum(t.nbytes for t in tensors.values())
    with pytest.raises(grpc.RpcError) as refused:  # every tensor but the last chunk's bytes
        client.stub.UpdateWeights(_stream(new_weights(seed=2), corrupt=True), metadata=md)
    assert refused.value.code() == grpc.StatusCode.DATA_LOSS
    assert digest(server.executor.model) == after
    assert _remote_greedy(client) == want
    assert control.staging.nbytes == held
    client.weights.release(["kv_cache"])
    assert control.staging.nbytes == 0
    client.weights.resume(["kv_cache"])
    assert _remote_greedy(client) == want


def test_a_group_transfer_that_fails_midway_changes_nothing(
    server: RunningServer, client: ExecutorClient, updated: Any
) -> None:
    """The trainer stops after one tensor: the executor's receive times out, the weights and
    the version stay, and the group refuses further updates until formed again."""
    assert server.executor is not None
    before, tensors = digest(server.executor.model), updated[0]
    group = client.weights.open_group("127.0.0.1", free_port(), world_size=2, timeout_s=3)
    pairs = list(tensors.items())
    request = pb.UpdateWeightsFromGroupRequest(
        weight_version="half", tensors=[spec_to_proto(tensor_spec(n, t)) for n, t in pairs]
    )
    md = [("authorization", f"Bearer {TOKEN}")]
    call = client.stub.UpdateWeightsFromGroup.future(request, metadata=md)
    assert group.group.verdict(0, 1) == 0
    group.group.broadcast(pairs[0][1].contiguous(), 0)  # ... and nothing more
    with pytest.raises(grpc.RpcError) as failed:
        call.result(timeout=60)
    assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "weights group failed" in failed.value.details()
    assert digest(server.executor.model) == before
    assert client.info().info.weight_version == "0"
    with pytest.raises(grpc.RpcError) as broken:
        client.stub.UpdateWeightsFromGroup(request, metadata=md)
    assert broken.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    group.close()


def test_retries_apply_nothing_twice(client: ExecutorClient, updated: Any) -> None:
    """A batch retried after an update is answered from the retry memory with the version it
    ran on; an update retried after a lost answer leaves the same weights and version."""
    tensors = updated[0]
    batch = _logprob_prefill(3, 100)
    first = client.forward(batch, batch_id=4242)
    client.weights.update(tensors.items(), version="v1")
    retried = client.forward(batch, batch_id=4242)
    assert retried.weight_version == first.weight_version == "0"
    assert retried.next_token_logprobs is not None and first.next_token_logprobs is not None
    assert torch.equal(retried.next_token_logprobs, first.next_token_logprobs)
    again = client.forward(_logprob_prefill(4, 200), batch_id=4243)  # a new id runs, on v1
    assert again.weight_version == "v1" and again.next_token_logprobs is not None
    assert not torch.equal(again.next_token_logprobs, first.next_token_logprobs)
    assert client.weights.update(tensors.items(), version="v1").version == "v1"
    assert client.info().info.weight_version == "v1"
    assert _remote_greedy(client) == updated[1]


def _logprob_prefill(row: int, slot: int):  # type: ignore[no-untyped-def]
    batch = make_extend_batch(
        input_ids=[[5, 6, 7, 8]],
        req_pool_indices=[row],
        out_cache_loc=[list(range(slot, slot + 4))],
    )
    batch.return_logprob = True
    return batch


def test_a_group_receives_into_the_arena_it_is_given_the_same_memory_each_update() -> None:
    """Two gloo members in this process: the receiver's tensors are carved from its staging
    arena, the next update's from the same memory (no fresh pages); without one, each
    tensor gets memory of its own."""
    from executor.weights.group import GroupSpec, WeightsGroup
    from executor.weights.staging import StagingArena

    port = free_port()
    sent = [torch.randn(3, 5), torch.randn(7), torch.randn(2, 2, 2)]
    shapes = [(tuple(t.shape), t.dtype) for t in sent]
    members: dict[int, WeightsGroup] = {}

    def join(rank: int) -> None:
        spec = GroupSpec("127.0.0.1", port, rank, 2, timeout_s=60)
        members[rank] = WeightsGroup(spec, torch.device("cpu"))

    joining = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in joining:
        t.start()
    for t in joining:
        t.join(60)

    def send_three_times() -> None:
        for _ in range(3):
            members[0].send(sent, 0)

    sender = threading.Thread(target=send_three_times)
    sender.start()
    arena = StagingArena()
    rounds = [list(members[1].receive(shapes, 0, arena)) for _ in range(2)]
    fresh = list(members[1].receive(shapes, 0))
    sender.join(60)
    for received in (*rounds, fresh):
        assert all(torch.equal(a, b) for a, b in zip(received, sent, strict=True))
    [first, second] = [[t.data_ptr() for t in r] for r in rounds]
    assert first == second and arena.nbytes >= sum(t.nbytes for t in sent)
    assert len({t.untyped_storage().data_ptr() for t in rounds[0]}) == 1  # one buffer
    assert len({t.untyped_storage().data_ptr() for t in fresh}) == len(sent)
    for member in members.values():
        member.close()

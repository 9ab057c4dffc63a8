"""A ParameterReceiver's life beside a trainer: a real receiver, a real SharedMemoryEngine and
`sync_weights` on a tiny bf16 megatron-core model (one gloo rank, CPU, as the CPU example of
docs/weight-sync.md). A closed receiver takes nothing more (its open connections end with it: the
trainer's engine reconnects to the receiver started at the address since); a parameter replaced in
the receiver's dict between syncs gets the next sync's bytes, or, in another dtype, the sync is
refused before any bucket; bad keys and addresses are one sentence; a trainer that exits without
`engine.close()` leaves no bucket file in /dev/shm."""
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import FIXTURES, ROOT, raising_at

TINY = FIXTURES / "qwen3-tiny"  # untied, bf16
SYNC = dict(dtype=torch.bfloat16, bucket_bytes=64 << 10)  # the receivers hold bf16; several buckets


@pytest.fixture(scope="module")
def chunks(tmp_path_factory):
    """The tiny model in bf16 (its norms float32) on one gloo rank, torn down after the module."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    from mconv import Layout
    from mconv.live import build_model, load_hf_weights

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "current_device", lambda: "cpu")  # megatron-core on the CPU
        store = tmp_path_factory.mktemp("store")
        dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
        parallel_state.initialize_model_parallel()
        initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        try:
            model = build_model(TINY, Layout(), dtype=torch.bfloat16, use_cpu_initialization=True)
            load_hf_weights(model, TINY)
            yield model
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def checkpoint():
    return load_file(TINY / "model.safetensors")


def zeros(checkpoint: dict) -> dict:
    return {name: torch.zeros_like(t) for name, t in checkpoint.items()}


def holds(params: dict, expected: dict) -> bool:
    """Whether `params` holds `expected`'s tensors bit for bit."""
    return params.keys() == expected.keys() and all(
        params[n].dtype == t.dtype and torch.equal(params[n].view(torch.uint8), t.view(torch.uint8))
        for n, t in expected.items())


def replace_and_move(params: dict, replaced: str, moved: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Give `params[replaced]` another tensor and `params[moved]` another storage (`.data = ...`),
    both zeros of the same kind, and zero the old ones: returns (old tensor, old storage)."""
    old, old_storage = params[replaced], params[moved].data
    params[replaced] = torch.zeros_like(old)
    params[moved].data = torch.zeros_like(old_storage)
    old.zero_()
    old_storage.zero_()
    return old, old_storage


def serving_threads(address: str) -> list[threading.Thread]:
    """The live threads that accept or serve connections at `address` (shm.AuthListener names them)."""
    return [t for t in threading.enumerate() if t.name in (f"mconv-serve {address}", f"mconv-accept {address}")]


def test_a_closed_receiver_takes_nothing_more(chunks, checkpoint, tmp_path):
    """close() ends the connections open at that time, not just the listener: the trainer's next
    sync finds nothing at the address (it synced into the closed receiver before, its version
    moving on), then, once a second receiver listens there, a verified sync of new weights (the
    model's, doubled: exact in bf16) reaches the second receiver bit for bit (the checksums were
    read from the first before), and the first keeps what it held at its close."""
    from mconv import MconvError
    from mconv.live.sync import SharedMemoryEngine, sync_weights
    from mconv.transport.receiver import ParameterReceiver

    address, key = str(tmp_path / "engine.sock"), os.urandom(32)
    first = ParameterReceiver(zeros(checkpoint), address, key)
    first.start()
    engine = SharedMemoryEngine(address, key, timeout=30)
    second, parameters = None, []
    try:
        sync_weights(chunks, TINY, engine, version=1, **SYNC)
        assert first.version == "1" and holds(first.params, checkpoint)
        assert serving_threads(address)  # the accepting thread, and the engine's connection's
        first.close()
        assert not serving_threads(address)

        doubled = {name: t * 2 for name, t in checkpoint.items()}
        parameters = [p for chunk in chunks for p in chunk.parameters()]
        for p in parameters:
            p.data.mul_(2)  # new weights (the module's model is halved back below: exact)
        with pytest.raises(MconvError, match=f"^weight sync 2 refused before any bucket was sent: rank 0: nothing "
                                             f"listens at {address}: no such socket file"):
            sync_weights(chunks, TINY, engine, version=2, **SYNC)
        second = ParameterReceiver(zeros(checkpoint), address, key)
        second.start()
        sync_weights(chunks, TINY, engine, version=3, verify=True, **SYNC)
        assert second.version == "3" and holds(second.params, doubled)
        assert first.version == "1" and holds(first.params, checkpoint)
    finally:
        for p in parameters:
            p.data.mul_(0.5)
        engine.close()
        first.close()
        if second is not None:
            second.close()


def test_close_aborts_an_update_and_ends_a_waiting_start(tmp_path):
    """close() in the middle of an update aborts it (its lock released, the failure saying the
    receiver was closed), and a trainer's `start` waiting for the lock (generation holds it) does
    not hold close() up: close() returns at once, and that trainer finds nothing at the address."""
    import time

    from mconv import MconvError
    from mconv.live.sync import SharedMemoryEngine
    from mconv.transport.receiver import ParameterReceiver

    address = str(tmp_path / "engine.sock")
    receiver = ParameterReceiver({"w": torch.zeros(4)}, address, b"key")
    receiver.start()
    engine = SharedMemoryEngine(address, b"key", timeout=30)
    engine.start("v1")
    receiver.close()
    # (nothing was loaded: the weights, and so the version, are as they were)
    assert receiver.version is None and not receiver.lock.locked()
    assert receiver.failure == "the receiver was closed in the middle of update v1"
    with pytest.raises(RuntimeError, match=r"did not answer 'finish': the connection closed \(its receiver was closed, "
                                           r"or its process ended\)$"):  # (it was "EOFError: ")
        engine.finish("v1")
    engine.close()

    receiver = ParameterReceiver({"w": torch.zeros(4)}, address, b"key")
    receiver.start()
    engine = SharedMemoryEngine(address, b"key", timeout=30)
    engine.expected()  # connected
    refused = []

    def start():
        try:
            engine.start("v2")
        except MconvError as e:
            refused.append(str(e))
    waiting = threading.Thread(target=start)
    with receiver.lock:  # generation
        waiting.start()
        time.sleep(0.3)  # the start request waits for the lock
        started = time.monotonic()
        receiver.close()
        assert time.monotonic() - started < 2 and not serving_threads(address)
    waiting.join(30)
    assert refused == [f"nothing listens at {address}: no such socket file (start the receiver first)"]
    assert receiver.version is None
    engine.close()


def test_a_failing_check_after_start_ends_the_update(chunks, checkpoint, tmp_path):
    """The receiver asks `changed()` after it answered `start`: if that raises, the update is failed
    there (the trainer's next request says so), the lock let go, and the next sync is exact."""
    from mconv import MconvError
    from mconv.live.sync import SharedMemoryEngine, sync_weights
    from mconv.transport.receiver import ParameterReceiver

    class Flaky(ParameterReceiver):
        broken = False

        def changed(self):
            if self.broken and self._session is not None:  # (asked at `expected` too: not then)
                raise RuntimeError("the engine's parameters cannot be read now")
            return super().changed()

    address, key = str(tmp_path / "engine.sock"), os.urandom(32)
    receiver = Flaky(zeros(checkpoint), address, key)
    receiver.start()
    engine = SharedMemoryEngine(address, key, timeout=30)
    try:
        sync_weights(chunks, TINY, engine, version=1, **SYNC)
        receiver.broken = True
        with pytest.raises(MconvError, match="^weight sync 2 failed; its update was aborted: rank 0: .*RuntimeError: "
                                             r"the engine's parameters cannot be read now\)$"):
            sync_weights(chunks, TINY, engine, version=2, **SYNC)  # (the trainer's abort of it taken: no second line)
        # (failed before any bucket was loaded: the weights, and the version, still sync 1's)
        assert not receiver.lock.locked() and receiver.version == "1" and "cannot be read now" in receiver.failure
        receiver.broken = False
        sync_weights(chunks, TINY, engine, version=3, verify=True, **SYNC)
        assert holds(receiver.params, checkpoint)
        with pytest.raises(MconvError, match=r"version='failed:3': a receiver marks a failed update so \(its "
                                             r"`version`\); give another$"):
            sync_weights(chunks, TINY, engine, version="failed:3", **SYNC)
        assert receiver.version == "3"
    finally:
        engine.close()
        receiver.close()


def test_params_replaced_between_syncs_are_noticed(chunks, checkpoint, tmp_path):
    """A tensor of the receiver's `params` replaced after a sync takes the next sync's bytes, and the
    old one none (the copy plans targeted the old before), as does one given a new storage
    (`param.data = ...`); in float32, either way, the next sync is refused before any bucket, with
    the dtype message (the receiver described its model once: it was not refused before), also
    after a sync refused once its engine was asked for the model, before the change. A tensor
    replaced after the trainer checked the model and before the update's start gets the bytes."""
    from mconv import MconvError
    from mconv.live.sync import SharedMemoryEngine, sync_weights
    from mconv.transport.receiver import ParameterReceiver

    address, key = str(tmp_path / "engine.sock"), os.urandom(32)
    params = zeros(checkpoint)
    params["model.embed_tokens.weight"] = torch.nn.Parameter(params["model.embed_tokens.weight"])  # (requires grad)
    receiver = ParameterReceiver(params, address, key)
    receiver.start()
    engine = SharedMemoryEngine(address, key, timeout=30)
    replaced, moved = "model.norm.weight", "model.layers.0.mlp.down_proj.weight"
    try:
        sync_weights(chunks, TINY, engine, version=1, **SYNC)
        assert holds({n: t.detach() for n, t in params.items()}, checkpoint)
        old, old_storage = replace_and_move(params, replaced, moved)
        sync_weights(chunks, TINY, engine, version=2, **SYNC)
        assert holds(params, checkpoint)
        assert not old.any() and not old_storage.any()

        for name, make_float32 in ((moved, lambda: setattr(params[moved], "data", params[moved].data.float())),
                                   (replaced, lambda: params.__setitem__(replaced, params[replaced].float()))):
            # a sync refused after rank 0 sent its `expected` request ahead (Engine.ask_expected): that
            # reply, the model before the change below, is not taken as the next sync's answer
            with pytest.raises(MconvError, match="bucket_bytes"):
                sync_weights(chunks, TINY, engine, version="3a", dtype=torch.bfloat16, bucket_bytes=0)
            make_float32()
            with torch.no_grad():
                for t in params.values():
                    t.zero_()
            with pytest.raises(MconvError, match=r"^weight sync 3 refused before any bucket was sent: rank 0: the "
                                                 rf"trainer's model does not match the engine's: {name} is sent as "
                                                 r"bfloat16, the engine holds float32: "):
                sync_weights(chunks, TINY, engine, version=3, **SYNC)
            assert receiver.version == "2" and not any(t.any() for t in params.values())
            assert not receiver.lock.locked()
            params[name].data = params[name].data.bfloat16()  # (a new storage again)
        sync_weights(chunks, TINY, engine, version=4, verify=True, **SYNC)
        assert holds(params, checkpoint)

        old = params[replaced]

        def start_after_a_change(version, **kwargs):  # between the trainer's check and the update's start
            params[replaced] = torch.zeros_like(old)
            return SharedMemoryEngine.start(engine, version, **kwargs)

        engine.start = start_after_a_change
        old.zero_()
        sync_weights(chunks, TINY, engine, version=5, verify=True, **SYNC)
        assert holds(params, checkpoint) and not old.any()  # (the plans into the old tensor went first)
        del engine.start
    finally:
        engine.close()
        receiver.close()


def test_an_engine_the_trainer_writes_into_gets_every_tensor_once(chunks, checkpoint):
    """An engine that offers its own tensors (`Engine.targets`, as IPCEngine does for a
    ParameterReceiver(direct=True) on its GPU) gets each bucket copied straight into them, no
    buffer packed: after a sync its tensors hold the checkpoint bit for bit, every HF name written
    once, the engine flushed once, after its last bucket; a second sync of new weights (doubled:
    exact in bf16) too, with verify=True comparing what the engine holds with the tensors copied
    (a byte the engine changes after the copies is named). With quantize="fp8" the buckets with
    weights to quantize are packed as ever and the others written: together, iter_hf_weights'
    FP8 tensors. A name the engine has no tensor for is one sentence, and the update aborted."""
    from mconv import MconvError
    from mconv.live import iter_hf_weights
    from mconv.live.sync import sync_weights
    from mconv.live.sync.engines import Engine
    from mconv.transport.flat import checksums

    class Direct(Engine):
        def __init__(self, params):
            super().__init__()
            self.params, self.written, self.packed, self.events = params, [], [], []

        def targets(self, device):
            return self.params

        def update(self, bucket):
            self.events.append("update")
            self.written += [name for name, _ in bucket.written]
            for name, t in bucket:
                if name not in dict(bucket.written):
                    self.params[name].copy_(t)
                    self.packed.append(name)

        def flush(self):
            self.events.append("flush")

        def abort(self, version, reason):
            self.events.append(f"abort: {reason}")

        def checksums(self, names):
            return checksums([(name, self.params[name]) for name in names])

    engine = Direct(zeros(checkpoint))
    result = sync_weights(chunks, TINY, engine, version=1, **SYNC)
    assert holds(engine.params, checkpoint) and result.buckets > 3 and result.bytes == sum(
        t.nbytes for t in checkpoint.values())
    assert sorted(engine.written) == sorted(checkpoint) and not engine.packed and not engine._buffers
    assert engine.events == ["update"] * result.buckets + ["flush"]
    parameters = [p for chunk in chunks for p in chunk.parameters()]
    try:
        for p in parameters:
            p.data.mul_(2)
        engine.written, engine.events = [], []
        sync_weights(chunks, TINY, engine, version=2, verify=True, **SYNC)
        assert holds(engine.params, {name: t * 2 for name, t in checkpoint.items()})
        assert sorted(engine.written) == sorted(checkpoint) and engine.events[-1] == "flush"
    finally:
        for p in parameters:
            p.data.mul_(0.5)

    spoilt = "model.layers.1.mlp.down_proj.weight"
    engine.flush = lambda: engine.params[spoilt].view(-1)[3].add_(1)  # after the copies: verify must see it
    with pytest.raises(MconvError, match=rf"^weight sync 2b is not verified: rank 0: the engine holds other bytes "
                                         rf"than were sent for {spoilt} \(1 of {len(checkpoint)} tensors\)$"):
        sync_weights(chunks, TINY, engine, version="2b", verify=True, **SYNC)

    exported = {name: t.clone() for named in iter_hf_weights(chunks, TINY, dtype=torch.bfloat16, quantize="fp8")
                for name, t in named}
    engine = Direct({name: torch.zeros_like(t) for name, t in exported.items()})
    sync_weights(chunks, TINY, engine, version=3, quantize="fp8", **SYNC)
    assert holds(engine.params, exported)
    assert engine.packed and engine.written and sorted(engine.packed + engine.written) == sorted(exported)

    engine = Direct({name: t for name, t in zeros(checkpoint).items() if name != "model.norm.weight"})
    engine.discard = lambda: engine.events.append("discard")
    with pytest.raises(MconvError, match=r"^weight sync 4 failed; its update was aborted: rank 0: the engine has no "
                                         r"tensor model.norm.weight to write into$"):
        sync_weights(chunks, TINY, engine, version=4, **SYNC)
    assert engine.events[-2] == "discard" and engine.events[-1].startswith("abort: ") and "flush" not in engine.events


def test_the_direct_protocol_follows_a_receiver_whose_params_change(chunks, checkpoint, tmp_path, monkeypatch):
    """The direct route's requests between a real IPCEngine and a real ParameterReceiver(direct=True),
    with CUDA IPC's share and attach stood in for by one process's own tensors (the receiver's
    storages handed over as they are): the trainer writes each bucket into the receiver's
    parameters, the receiver counts them at `finish`; a parameter replaced and another moved to a
    new storage between syncs (same names, shapes and dtypes) make the trainer map them anew, and
    the next sync reaches the new tensors, not the old ones (a digest of names, shapes and dtypes
    alone missed it); a sync failing mid-way is aborted, leaves nothing queued, and the next is
    exact and verified; a parameter replaced between the trainer's check and the update's start
    fails that update (the trainer writes where it mapped), and the next is exact, as is one after
    the trainer's parameters moved (the receiver is told the same buckets); a parameter made
    non-contiguous is refused before any bucket (the
    engine's version kept); parameters that cannot be shared are refused when the receiver is
    made."""
    from mconv import MconvError
    from mconv.live.sync import IPCEngine, core, sync_weights
    from mconv.transport import cuda_ipc, receiver as receiver_module
    from mconv.transport.receiver import ParameterReceiver

    shared = {}

    def share(whole):
        shared[len(shared)] = whole
        return {"handle": str(len(shared) - 1), "offset_bytes": 0}
    monkeypatch.setattr(cuda_ipc, "share", share)
    monkeypatch.setattr(cuda_ipc, "attach", lambda share, device: shared[int(share["handle"])])

    def contiguous(params):  # CPU tensors stand in for CUDA ones: only the rest of the check
        for name, t in params.items():
            if not t.is_contiguous():
                raise ValueError(f"direct=True: parameter {name} is not contiguous")
    monkeypatch.setattr(receiver_module, "_check_shareable", contiguous)

    class Engine(IPCEngine):
        def check_device(self, device):
            pass

    address, key = str(tmp_path / "engine.sock"), os.urandom(32)
    params = zeros(checkpoint)
    receiver = ParameterReceiver(params, address, key, direct=True)
    receiver.start()
    engine = Engine(address, key, timeout=30)
    replaced, moved = "model.norm.weight", "model.layers.0.mlp.down_proj.weight"
    try:
        sync_weights(chunks, TINY, engine, version=1, **SYNC)
        assert holds(params, checkpoint) and receiver.version == "1"
        assert "targets" in engine._carried and not engine._buffers  # written, never packed
        old, old_storage = replace_and_move(params, replaced, moved)
        sync_weights(chunks, TINY, engine, version=2, **SYNC)
        assert holds(params, checkpoint) and not old.any() and not old_storage.any()

        original = core._stage_buckets
        monkeypatch.setattr(core, "_stage_buckets", raising_at(original, 2, RuntimeError("injected failure")))
        for t in params.values():
            t.zero_()
        with pytest.raises(MconvError, match="^weight sync 3 failed; its update was aborted: rank 0: RuntimeError: "
                                             "injected failure$"):
            sync_weights(chunks, TINY, engine, version=3, **SYNC)
        assert receiver.version == "failed:3" and not engine._written and not receiver.lock.locked()
        monkeypatch.setattr(core, "_stage_buckets", original)
        sync_weights(chunks, TINY, engine, version=4, verify=True, **SYNC)
        assert holds(params, checkpoint) and receiver.version == "4"

        def start_after_a_change(version, **kwargs):  # between the trainer's check and the update's start
            params[replaced] = torch.zeros_like(params[replaced])
            return Engine.start(engine, version, **kwargs)

        engine.start = start_after_a_change
        with pytest.raises(MconvError, match=r"^weight sync 4b failed; its update was aborted: rank 0: .*the engine's "
                                             r"model changed \(a parameter replaced, moved, added or removed\) after "
                                             r"the trainer checked it, before update 4b began: sync again"):
            sync_weights(chunks, TINY, engine, version="4b", **SYNC)
        del engine.start
        assert receiver.version == "failed:4b" and not params[replaced].any()
        sync_weights(chunks, TINY, engine, version="4c", verify=True, **SYNC)
        assert holds(params, checkpoint) and receiver.version == "4c"
        # the trainer's parameters moved (an offload by `param.data = ...`): planned anew, the same
        # buckets named to the receiver as before (no layout sent again, nothing kept twice)
        known = len(engine._layouts), len(engine._written_entries)
        for parameter in (p for chunk in chunks for p in chunk.parameters()):
            parameter.data = parameter.data.clone()
        sync_weights(chunks, TINY, engine, version="4d", verify=True, **SYNC)
        assert holds(params, checkpoint) and (len(engine._layouts), len(engine._written_entries)) == known
        params[moved] = torch.zeros(params[moved].shape[::-1], dtype=params[moved].dtype).t()  # not contiguous
        with pytest.raises(MconvError, match=rf"^weight sync 5 refused before any bucket was sent: .*direct=True: "
                                             rf"parameter {moved} is not contiguous"):
            sync_weights(chunks, TINY, engine, version=5, **SYNC)
        assert receiver.version == "4d"  # the engine's weights are the last sync's, whole
    finally:
        engine.close()
        receiver.close()
    monkeypatch.undo()
    with pytest.raises(ValueError, match="^direct=True: parameter lm_head.weight is on cpu; a trainer "
                                         "writes only into contiguous CUDA parameters$"):
        ParameterReceiver(zeros(checkpoint), str(tmp_path / "other.sock"), key, direct=True)
    assert not (tmp_path / "other.sock").exists()  # refused before listening


def test_bad_keys_and_addresses_are_one_sentence(tmp_path):
    """A receiver refuses an empty key (any client would pass the handshake) and a str key, an empty
    address (it listened at a temporary path of multiprocessing's choosing), an address that is
    taken and a Unix path longer than the OS allows, params that are no dict of tensors and a
    timeout that is no positive number, each in one sentence saying what to do (a too-long path
    was "[Errno None] cannot listen at ...: None"), and a URL; the trainer's engine given an empty
    or too-long address, a URL or a port beyond 65535 (an OverflowError from socket) says so too,
    and one connecting to a receiver never started says to start it."""
    from mconv import MconvError
    from mconv.live.sync import SharedMemoryEngine
    from mconv.transport.receiver import ParameterReceiver

    params = {"w": torch.zeros(4)}
    with pytest.raises(ValueError) as empty:
        ParameterReceiver(params, str(tmp_path / "a.sock"), b"")
    message = ("authkey is empty, so any process could connect: give a secret key, the same to the receiver and the "
               "trainer's engine (e.g. bytes.fromhex of `openssl rand -hex 32`)")
    assert str(empty.value) == message
    with pytest.raises(MconvError) as empty:
        SharedMemoryEngine(str(tmp_path / "a.sock"), b"")
    assert str(empty.value) == "SharedMemoryEngine: " + message
    with pytest.raises(TypeError, match=r"^authkey is a str; give the key as bytes \(e.g. bytes.fromhex\(hex_key\), "
                                        r"or a str's .encode\(\)\)$"):
        ParameterReceiver(params, str(tmp_path / "a.sock"), "key")
    assert not (tmp_path / "a.sock").exists()
    with pytest.raises(ValueError, match=r'^address is empty: give a Unix socket path or "host:port"$'):
        ParameterReceiver(params, "", b"key")
    with pytest.raises(MconvError, match=r"^the engine's address is empty: give its receiver's Unix socket path or "
                                         r'"host:port"$'):
        SharedMemoryEngine("", b"key", timeout=5).expected()
    with pytest.raises(ValueError, match=r'^http://localhost:8000 is a URL: a receiver listens at a Unix socket path '
                                         r'or "host:port"$'):
        ParameterReceiver(params, "http://localhost:8000", b"key")
    with pytest.raises(MconvError, match=r"^http://localhost:8000 is a URL: give the receiver's Unix socket path or "
                                         r"\"host:port\" \(a vLLM server's HTTP address is VLLMServerEngine's\)$"):
        SharedMemoryEngine("http://localhost:8000", b"key", timeout=5).expected()
    with pytest.raises(MconvError, match=r"^localhost:99999: no port 99999 \(0-65535\)$"):
        SharedMemoryEngine("localhost:99999", b"key", timeout=5).expected()

    with pytest.raises(TypeError, match=r"^params: give a dict of HF name \(str\) -> the engine's tensor, not list$"):
        ParameterReceiver([torch.zeros(4)], str(tmp_path / "a.sock"), b"key")
    with pytest.raises(TypeError, match=r"^params: .*, not one with 'w' -> NoneType$"):
        ParameterReceiver({"w": None}, str(tmp_path / "a.sock"), b"key")
    with pytest.raises(TypeError, match=r"^params: w is on the meta device \(no memory to write into\)"):
        ParameterReceiver({"w": torch.empty(4, device="meta")}, str(tmp_path / "a.sock"), b"key")
    with pytest.raises(TypeError, match=r"^params: w and v lie at one address \(one would hold the other's bytes\)"):
        ParameterReceiver({"w": params["w"], "v": params["w"][:2]}, str(tmp_path / "a.sock"), b"key")
    for timeout in (0, -1, "x"):
        with pytest.raises(ValueError, match=rf"^timeout={timeout!r}: give the seconds an update may stay silent"):
            ParameterReceiver(params, str(tmp_path / "a.sock"), b"key", timeout=timeout)

    taken = ParameterReceiver(params, str(tmp_path / "a.sock"), b"key")
    try:
        with pytest.raises(OSError) as in_use:
            ParameterReceiver(params, str(tmp_path / "a.sock"), b"key")
        assert str(in_use.value) == (f"cannot listen at {tmp_path / 'a.sock'}: address already in use (another "
                                     "receiver listens there: close it, or give this one another address)")
        # made and never started: it accepts the connection and answers nothing
        with pytest.raises(RuntimeError, match=r"did not answer 'expected': no answer from .* within 2 s "
                                               r"while connecting: .*\(a receiver made but not started: call its "
                                               r"start\(\); or another service\)$"):
            SharedMemoryEngine(str(tmp_path / "a.sock"), b"key", timeout=2).expected()
        taken.start()
        with pytest.raises(RuntimeError, match="^this receiver is serving already: start\\(\\) once$"):
            taken.start()
    finally:
        taken.close()
    with pytest.raises(RuntimeError, match=r"^this receiver was closed: make another \(at the same address if you "):
        taken.start()
    long = "/tmp/" + "d" * 120 + ".sock"
    with pytest.raises(OSError) as too_long:
        ParameterReceiver(params, long, b"key")
    reason = ("the path is 130 bytes, longer than the OS allows for a Unix socket (about 107): give the receiver and "
              "the trainer's engine a shorter one (e.g. in /tmp)")
    assert str(too_long.value) == f"cannot listen at {long}: {reason}"
    with pytest.raises(MconvError) as engine_side:
        SharedMemoryEngine(long, b"key", timeout=5).expected()
    assert str(engine_side.value) == f"nothing can listen at {long}: {reason}"


def test_bucket_files_go_when_the_trainer_exits_without_close(tmp_path):
    """A trainer process whose SharedMemoryEngine made its bucket buffers (files in /dev/shm) and
    that exits normally without engine.close() leaves no file (they stayed, holding memory, until
    another process's next bucket file); a forked child that exits normally meanwhile leaves its
    parent's file in place."""
    script = textwrap.dedent("""
        import os, sys
        import torch
        from mconv.live.sync import SharedMemoryEngine

        engine = SharedMemoryEngine("unused.sock", b"key")
        engine.buffer(0, 4096, torch.device("cpu"))
        path = engine._shared[0].path
        child = os.fork()
        if child == 0:
            sys.exit(0)  # a normal exit: runs the finalizers it inherited
        os.waitpid(child, 0)
        print(path, os.path.exists(path), flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    path, after_child = done.stdout.split()
    assert Path(path).name.startswith("mconv-bucket-") and after_child == "True"
    assert not os.path.exists(path)

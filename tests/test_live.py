"""The live-engine API on real megatron-core GPTModels (gloo processes): load_hf_weights gives
transformers' logits; iter_hf_weights yields every HF tensor bit-identically, exactly once per
pipeline stage, nothing else; save_hf_weights writes the same bytes as mcore2hf."""
import filecmp
from pathlib import Path

import pytest
import torch

from mconv import Layout, MconvError, hf2mcore, mcore2hf
from mconv.converter.hf_io import HFCheckpoint
from mconv.converter.transforms import padded_vocab_size
from mconv.live import iter_hf_weights, load_hf_weights, save_hf_weights
from tests.conftest import FIXTURES
from tests.megatron_oracle import MegatronRun, hf_logits, megatron_logits, read_config
from tests.ranks import start_ranks

TOKENS = list(range(7, 80, 6))
TINY_DIR = FIXTURES / "qwen3-tiny"


@pytest.mark.slow
@pytest.mark.parametrize("fixture,sizes", [
    ("qwen3-tiny", dict(tp=2)),
    ("qwen3-tiny", dict(pp=2, vpp=2)),
    ("qwen3-tiny-tied", dict(tp=2, pp=2)),
    ("qwen3-moe-tiny", dict(tp=2, ep=2, etp=1)),
    ("qwen3-moe-tiny", dict(pp=2, ep=2)),
])
def test_live_load_export_and_save(tmp_path, fixture, sizes):
    hf_dir = FIXTURES / fixture
    config = read_config(hf_dir)
    out = tmp_path / "live"
    out.mkdir()
    run = MegatronRun(tmp_path / "unused", config, **sizes, tokens=TOKENS, live_hf=hf_dir, live_out=out,
                      padded_vocab=padded_vocab_size(config["vocab_size"], 128, sizes.get("tp", 1)))
    logits = megatron_logits(run, tmp_path)
    assert (logits - hf_logits(hf_dir, TOKENS)).abs().max().item() < 1e-4

    assert_every_hf_tensor_once(out, run, hf_dir)

    # mcore2hf of the same model at the same layout writes the same bytes (the live model holds fp32
    # parameters, so compare with a checkpoint converted from an fp32 copy of the HF model).
    fp32 = tmp_path / "fp32"
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).save_pretrained(fp32)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (hf_dir / name).exists():
            (fp32 / name).write_bytes((hf_dir / name).read_bytes())
    hf2mcore(fp32, tmp_path / "ckpt", Layout(**sizes), fmt="torch", progress=False)
    mcore2hf(tmp_path / "ckpt", tmp_path / "offline", max_shard_bytes=100_000, progress=False)
    offline = sorted(p.name for p in (tmp_path / "offline").iterdir())
    assert offline == sorted(p.name for p in (out / "saved").iterdir())
    match, mismatch, errors = filecmp.cmpfiles(tmp_path / "offline", out / "saved", offline, shallow=False)
    assert not mismatch and not errors


def assert_every_hf_tensor_once(out, run: MegatronRun, hf_dir) -> None:
    """What the worker's iter_hf_weights wrote to `out`: each rank yields every tensor of its pipeline
    stage once (the ranks of a stage the same ones), the stages together every tensor of `hf_dir`
    exactly once, bit-identical to it (float32 where the model is), and gather_pp the whole model."""
    source = HFCheckpoint(hf_dir)
    by_stage: dict[int, dict[str, torch.Tensor]] = {}
    for rank in range(run.world):
        result = torch.load(out / f"rank{rank}.pt")
        names = [name for bucket in result["buckets"] for name, _ in bucket]
        assert len(names) == len(set(names)), "a tensor was yielded twice"
        tensors = {name: t for bucket in result["buckets"] for name, t in bucket}
        stage = by_stage.setdefault(result["pp"], tensors)
        assert stage.keys() == tensors.keys()  # every rank of a stage yields the same tensors
        assert len(torch.load(out / f"all{rank}.pt")) == len(source.tensors)  # gather_pp: the whole model
        if run.pp > 1:  # a cast refused on one stage reaches every rank (no rank hangs)
            assert (out / f"refused{rank}.txt").read_text() == \
                "cannot cast model.norm.weight to float16: values up to 1e+30 are beyond float16's range (65504)"
    seen = [name for stage in by_stage.values() for name in stage]
    assert sorted(seen) == sorted(source.tensors)  # each HF tensor from exactly one stage, nothing else
    for stage in by_stage.values():
        for name, tensor in stage.items():
            expected = source.read(name)
            assert tensor.dtype == torch.float32 or tensor.dtype == expected.dtype
            assert torch.equal(tensor.to(expected.dtype).reshape(-1).view(torch.uint8),
                               expected.reshape(-1).view(torch.uint8)), name


def test_staged_load_casts_and_places_every_piece(tmp_path):
    """The GPU load path (staging buffers, device-side placement), run on the CPU: a float32 model
    loaded from bfloat16 files, every HF tensor exact after the round trip through iter_hf_weights;
    iter_hf_weights(dtype=float16) of a value beyond float16's range is refused, naming the tensor."""
    run = MegatronRun(tmp_path, read_config(FIXTURES / "qwen3-moe-tiny"), padded_vocab=384)
    out = tmp_path / "out.pt"
    start_ranks(_staged_worker, args=(run, out), nprocs=1)
    assert torch.load(out) == "exact"


def _staged_worker(rank, run, out):
    import warnings

    warnings.filterwarnings("ignore")
    import mconv.live
    from tests.megatron_oracle import one_process_gpt

    with one_process_gpt(run) as model:
        mconv.live.load.STAGE_BYTES = 30_000  # many batches, and pieces larger than a batch
        mconv.live.load_hf_weights([model], FIXTURES / "qwen3-moe-tiny", staged=True)
        source = HFCheckpoint(FIXTURES / "qwen3-moe-tiny")
        names = []
        for bucket in mconv.live.iter_hf_weights([model], FIXTURES / "qwen3-moe-tiny", dtype=torch.bfloat16):
            for name, tensor in bucket:
                assert torch.equal(tensor, source.read(name)), name
                names.append(name)
        assert sorted(names) == sorted(source.tensors)
        with torch.no_grad():  # a value float16 cannot hold: the cast is refused, naming the tensor
            model.embedding.word_embeddings.weight[0, 0] = 1e30
        with pytest.raises(MconvError, match=r"^cannot cast model.embed_tokens.weight to float16: values up to "
                                             r"1e\+30 are beyond float16's range \(65504\)$"):
            list(mconv.live.iter_hf_weights([model], FIXTURES / "qwen3-moe-tiny", dtype=torch.float16))
        torch.save("exact", out)


@pytest.mark.parametrize("call,message", [
    (lambda: next(iter_hf_weights([], TINY_DIR)), "model_chunks is empty; pass the list of this rank's"),
    (lambda: next(iter_hf_weights(torch.nn.Linear(2, 2), TINY_DIR)), "model_chunks is a Linear; pass the list"),
    (lambda: next(iter_hf_weights([None], TINY_DIR)), "model_chunks is a list of NoneType; pass the list"),
    (lambda: next(iter_hf_weights([torch.nn.Linear(2, 2)], TINY_DIR, bucket_bytes=0)),
     "bucket_bytes=0 is not an integer of at least 1"),
    (lambda: next(iter_hf_weights([torch.nn.Linear(2, 2)], TINY_DIR, bucket_bytes="1MB")),
     "bucket_bytes='1MB' is not an integer of at least 1"),
    (lambda: next(iter_hf_weights([torch.nn.Linear(2, 2)], TINY_DIR, dtype=torch.int8)),
     "dtype=torch.int8 is not a dtype mconv writes"),
    (lambda: load_hf_weights([torch.nn.Linear(2, 2)], {"architectures": ["Qwen3ForCausalLM"]}),
     "a config dict holds no weights; pass the HF model directory or hub name"),
    (lambda: save_hf_weights([torch.nn.Linear(2, 2)], "/tmp/never-written", {"architectures": ["Qwen3ForCausalLM"]}),
     "a config dict holds no tokenizer or side files"),
])
def test_live_arguments_are_checked_before_the_model(call, message):
    """Arguments that are no model chunks, bucket size, dtype or HF directory are one MconvError
    naming them, before the model is looked at (they were IndexError, TypeError, OSError; int8
    zeroed the weights)."""
    with pytest.raises(MconvError, match=message):
        call()


def _moved_parameters_worker(rank: int, store: str) -> None:
    import gc

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    from torch.multiprocessing.reductions import StorageWeakRef

    from safetensors.torch import load_file

    from mconv.live import build_model, clear_cache, load_hf_weights, schedule
    from mconv.live.sync import sync_weights
    from tests.megatron_oracle import _cpu_shims

    _cpu_shims()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=1)
    ps.initialize_model_parallel(1)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    moe = FIXTURES / "qwen3-moe-tiny"
    chunks = build_model(moe, Layout(), dtype=torch.float32, use_cpu_initialization=True)
    load_hf_weights(chunks, moe)
    checkpoint = {name: t.float() for name, t in load_file(moe / "model.safetensors").items()}  # the oracle
    sync_weights(chunks, moe, lambda bucket: None, bucket_bytes=100_000)

    def moved_and_alive() -> int:
        """How many of the parameters' storages outlive the parameters' move to new ones."""
        parameters = list(chunks[0].parameters())
        old = [StorageWeakRef(p.untyped_storage()) for p in parameters]
        for parameter in parameters:
            parameter.data = parameter.data.clone()  # as an offload does: `param.data = param.data.to("cpu")`
        gc.collect()
        return sum(not ref.expired() for ref in old)

    assert moved_and_alive() == len(list(chunks[0].parameters()))  # the cached plan's views hold them
    with torch.no_grad():
        for parameter in chunks[0].parameters():
            parameter.add_(1)  # (in the new storages: the old ones, which the cached plan reads, keep the old values)
    sent = {}
    # plans anew for the moved ones (found moved up front: schedule._prepared_for_sync), and sends their values
    sync_weights(chunks, moe, lambda bucket: sent.update((name, t.clone()) for name, t in bucket),
                 bucket_bytes=100_000)
    assert sent.keys() == checkpoint.keys()
    assert all(torch.equal(sent[name], t + 1) for name, t in checkpoint.items())  # every value the new one
    clear_cache(chunks)
    assert moved_and_alive() == 0

    # One parameter moved, none of those a sync checks up front: found before its bucket,
    # the model planned anew there, its new values sent.
    sync_weights(chunks, moe, lambda bucket: None, bucket_bytes=100_000)
    planned = schedule._LIVE_CACHE[chunks[0]]
    sampled = {id(p) for p in planned.up_front.tensors}  # (one of each bucket's, and all of the first's)
    parameter = next(p for p in chunks[0].parameters() if id(p) not in sampled and p.numel())
    parameter.data = parameter.data + 1
    sent.clear()
    sync_weights(chunks, moe, lambda bucket: sent.update((name, t.clone()) for name, t in bucket),
                 bucket_bytes=100_000)
    assert schedule._LIVE_CACHE[chunks[0]].live is not planned.live
    del planned
    # (two moves: the checkpoint's values + 2 in the tensors that parameter holds, + 1 in every other)
    moved = sorted(name for name, t in checkpoint.items() if torch.equal(sent[name], t + 2))
    assert sent.keys() == checkpoint.keys() and moved
    assert all(torch.equal(sent[name], t + 1) for name, t in checkpoint.items() if name not in moved)

    # An offload in place not undone (the storage freed): one sentence naming the parameter, then,
    # loaded back, a sync as before
    del sent
    storage = parameter.untyped_storage()
    size = storage.nbytes()
    storage.resize_(0)
    # (found at its bucket, as the parameter moved above: the sync fails there)
    with pytest.raises(MconvError, match=r"^weight sync \S+ failed; its update was aborted: rank 0: model chunk "
                                         r"0: \S+ has no memory \(its storage was freed in place, an offload's "
                                         r"untyped_storage\(\).resize_\(0\)\): load it back first$"):
        sync_weights(chunks, moe, lambda bucket: None, bucket_bytes=100_000)
    storage.resize_(size)
    sync_weights(chunks, moe, lambda bucket: None, bucket_bytes=100_000)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def test_clear_cache_lets_moved_parameters_go(tmp_path):
    """mconv's cached plan of a model (kept between syncs while no parameter moves) holds views of
    the parameters: storages the parameters left (an offload that replaces `param.data`) stay
    alive until the next sync plans anew, or until `clear_cache(model_chunks)`, after which none
    does (GPU memory a colocated trainer frees for the rollout). A sync after they moved sends
    their new values, and so does one after a single parameter moved (found as the sync comes to
    its bucket: the parameters are checked bucket by bucket, one of each up front); a parameter
    whose storage was freed in place and not loaded back is refused in one sentence naming it."""
    start_ranks(_moved_parameters_worker, args=(str(tmp_path / "store"),), nprocs=1)


def _misuse_worker(rank: int, store: str, where: str) -> None:
    """Two TP ranks misusing the live API as a trainer might (new-user pass)."""
    import json
    import shutil

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    from mconv.live import build_model
    from tests.megatron_oracle import _cpu_shims

    _cpu_shims()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    ps.initialize_model_parallel(2)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    said = {}

    def error(call) -> str | None:
        try:
            call()
        except MconvError as e:
            return str(e)
        return None

    chunks = build_model(TINY_DIR, Layout(tp=2), dtype=torch.float32, use_cpu_initialization=True)
    load_hf_weights(chunks, TINY_DIR)
    # a path missing on one rank only: every rank raises its error (rank 0 hung in the first gather)
    mine = TINY_DIR if rank == 0 else Path(where) / "missing-on-rank-1"
    said["one rank's path"] = error(lambda: list(iter_hf_weights(chunks, mine)))
    # the model's own directory as save_hf_weights' output: refused, the input unchanged
    copy = Path(where) / "input"
    if rank == 0:
        shutil.copytree(TINY_DIR, copy)
    dist.barrier()
    before = (copy / "model.safetensors").read_bytes()
    said["output is the input"] = error(lambda: save_hf_weights(chunks, copy, copy))
    said["input unchanged"] = (copy / "model.safetensors").read_bytes() == before
    # parameters on the meta device (a lazy init not materialized): refused by load, export and sync alike
    layernorm = chunks[0].decoder.final_layernorm
    norm = layernorm.weight
    layernorm.weight = torch.nn.Parameter(torch.empty_like(norm, device="meta"))
    said["meta load"] = error(lambda: load_hf_weights(chunks, TINY_DIR))
    said["meta export"] = error(lambda: list(iter_hf_weights(chunks, TINY_DIR)))
    layernorm.weight = norm
    said["bare module"] = error(lambda: load_hf_weights(chunks[0], TINY_DIR))
    said["tied config"] = error(lambda: load_hf_weights(chunks, FIXTURES / "qwen3-tiny-tied"))
    said["threads"] = error(lambda: load_hf_weights(chunks, TINY_DIR, threads=0))
    said["gather_pp"] = error(lambda: list(iter_hf_weights(chunks, TINY_DIR, gather_pp="yes")))
    said["after"] = sum(len(bucket) for bucket in iter_hf_weights(chunks, TINY_DIR))  # (the ranks still agree)
    (Path(where) / f"rank{rank}.json").write_text(json.dumps(said))
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def test_live_misuse_is_one_sentence_on_every_rank(tmp_path):
    """What a trainer may get wrong with the live API, at TP2 (new-user pass): a path missing on
    one rank is one MconvError on every rank, naming it, not a hang in the first gather; a model
    directory given as save_hf_weights' output and its input is refused, the input unchanged; a
    parameter on the meta device is named (it was exported as a meta tensor, or left unloaded);
    a bare module, threads=0 and a gather_pp that is no bool are refused by name; a tied config for
    an untied model says so."""
    import json

    start_ranks(_misuse_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    said = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    missing = tmp_path / "missing-on-rank-1"
    for rank in said:
        assert rank["one rank's path"] is not None and f"{missing} does not exist" in rank["one rank's path"]
        assert rank["output is the input"] == (f"output {tmp_path / 'input'} overlaps the input "
                                               f"{(tmp_path / 'input').resolve()}; choose another output directory")
        assert rank["input unchanged"] is True
        for call in ("meta load", "meta export"):
            assert rank[call] == ("model chunk 0: decoder.final_layernorm.weight is on the meta device (no values: "
                                  "a lazy initialization not materialized); materialize the model first"), rank[call]
        assert rank["bare module"].startswith("model_chunks is a GPTModel; pass the list"), rank["bare module"]
        assert rank["tied config"].endswith("(the HF config's tie_word_embeddings is True: no output layer of "
                                            "its own)"), rank["tied config"]  # (the tied fixture has 2 layers)
        assert rank["threads"] == "threads=0 is not an integer of at least 1", rank["threads"]
        assert rank["gather_pp"] == "gather_pp='yes' is not True or False", rank["gather_pp"]
        assert rank["after"] == 47


def _one_replica_worker(rank: int, store: str, where: str) -> None:
    """Two data-parallel replicas of a dense model at TP1: only rank 0 exports."""
    import datetime
    import json

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    from mconv.live import build_model
    from tests.megatron_oracle import _cpu_shims

    _cpu_shims()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    ps.initialize_model_parallel(1)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    chunks = build_model(TINY_DIR, Layout(), dtype=torch.float32, use_cpu_initialization=True)
    exported = sum(len(bucket) for bucket in iter_hf_weights(chunks, TINY_DIR)) if rank == 0 else 0
    (Path(where) / f"rank{rank}.json").write_text(json.dumps(exported))
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def test_one_data_parallel_replica_exports_alone(tmp_path):
    """iter_hf_weights agrees only over the groups its gathers use: at TP1 one data-parallel replica
    exports while the other does not call it (review: an agreement over every rank made it wait)."""
    start_ranks(_one_replica_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    assert (tmp_path / "rank0.json").read_text() == "47"

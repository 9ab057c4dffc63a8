"""What the offline conversions share (the progress bar, the torchrun protocol, refusing a Megatron
checkpoint where an HF model is expected) and `verify`'s comparison of two HF models or adapters;
the conversions themselves are `hf2mcore.py` and `mcore2hf.py`."""
from __future__ import annotations

import json
from pathlib import Path

from tqdm import tqdm

from mconv.converter import megatron_io as mio
from mconv.converter.adapter_dir import compare_adapters, is_adapter
from mconv.converter.hf_experts import stacked_expert
from mconv.converter.hf_io import HFCheckpoint, tensor_difference
from mconv.converter.hub import check_revision, is_local, resolve_model
from mconv.converter.output import SharedStaging, write_errors
from mconv.converter.parallel import TorchrunTeam
from mconv.errors import MconvError


def _bar(total: int, description: str, progress: bool) -> tqdm:
    """A bytes progress bar on stderr, shown only when `progress` and stderr is a terminal (tqdm's
    disable=None: a bar written to a log file leaves carriage-return fragments in it). Decimal
    units: tqdm names its prefixes k, M, G whatever the divisor, so 1000 makes `MB` mean MB."""
    return tqdm(total=total, desc=description, unit="B", unit_scale=True, unit_divisor=1000,
                disable=None if progress else True, leave=False)


def refuse_megatron(path: str | Path, why: str) -> None:
    """Refuse a Megatron checkpoint (save or iteration directory) given where an HF model is expected,
    a common mix-up of the two directions: MconvError `PATH is a Megatron checkpoint; <why>`."""
    path = Path(path)
    if ((path / mio.TRACKER).is_file() or (path / "metadata.json").is_file()
            or any(path.glob(f"mp_rank_*/{mio.RANK_FILE}"))):
        raise MconvError(f"{path} is a Megatron checkpoint; {why}")


# HF names of the multi-token-prediction layers kept outside the decoder (Qwen3.5 / Qwen3.6 / Qwen3-Next)
MTP_PREFIX = "mtp."


def _kept_per_expert(metadata: dict, name: str) -> bool:
    """Whether the HF experts tensor `name` was per expert in hf2mcore's input (mconv.json, hf2mcore's
    _expert_forms)."""
    key = "hf_mtp_experts" if name.startswith(MTP_PREFIX) else "hf_experts"
    return metadata.get(key) == "per_expert"


def _run_team(team: TorchrunTeam, out: Path, overwrite: bool, prepare, finish, write_share, total: int,
              label: str, progress: bool) -> None:
    """The torchrun protocol: rank 0 prepares a staging directory every rank can compute the name
    of; all ranks write their shares; rank 0 finishes and renames it into place."""
    shared = SharedStaging(out, "torchrun", overwrite)
    staging = shared.path
    prepared = {}

    def first():
        if team.rank == 0:
            shared.make()
            prepared["writer"] = prepare(staging)

    def last():
        if team.rank == 0:
            finish(prepared["writer"], staging)
            shared.commit()

    def step(name: str, action) -> None:
        def guarded():  # a failed write (full disk...) stops every rank with one sentence
            with write_errors(out, staging):
                action()
        team.step(name, guarded)

    try:
        step("prepared", first)
        with _bar(total, f"{label} (rank {team.rank})", progress and team.rank == 0) as bar:
            step("written", lambda: write_share(staging, bar.update))
        step("finished", last)
    except BaseException:
        if team.rank == 0:
            shared.remove()
        raise


QUANTIZATION_MEANING = ("quant_method", "fmt", "weight_block_size", "activation_scheme", "scale_fmt")


def compare_hf(a: str | Path, b: str | Path, progress: bool = False,
               revision: str | None = None) -> tuple[int, int, list[str]]:
    """Compare two HF models (directories or hub names) tensor by tensor (names, dtypes, shapes,
    bytes), one tensor in memory at a time; or two PEFT adapters (adapter_dir.compare_adapters).
    `revision` applies to each of them that is a hub name (MconvError where neither is). Returns
    (tensors, bytes, differences). MconvError for a Megatron checkpoint, or an adapter compared
    with a model."""
    check_revision(revision, a, b)
    for path in (a, b):
        refuse_megatron(path, "verify compares HF models (convert it with `mconv mcore2hf` first)")
    dirs = [resolve_model(x, None if is_local(x) else revision, progress=progress) for x in (a, b)]
    adapters = [is_adapter(d) for d in dirs]
    if all(adapters):
        return compare_adapters(*dirs)
    if any(adapters):
        adapter, model = (a, b) if adapters[0] else (b, a)
        raise MconvError(f"{adapter} is a PEFT adapter and {model} is not; verify compares two models or two adapters")
    with HFCheckpoint(dirs[0]) as left, HFCheckpoint(dirs[1]) as right:
        only = [(name, this.dir) for this, other in ((left, right), (right, left))
                for name in sorted(this.tensors.keys() - other.tensors.keys())]
        differences = [f"{name}: only in {where}" for name, where in only]
        # the per-expert view hides how stacked experts are stored: a stacked tensor stored in another
        # form is a difference (verify compares what is stored), said once its experts' values are known
        forms = {name: [side.stacked.get(name) for side in (left, right)]
                 for name in sorted(left.stacked.keys() | right.stacked.keys())}
        forms = {name: shapes for name, shapes in forms.items() if shapes[0] != shapes[1]}
        # FP8 bytes mean what quantization_config says (method, format, block size, scale format): equal
        # bytes under different settings are different weights. Which modules it keeps in 16-bit shows
        # in the tensors themselves.
        settings = [{key: (side.config.get("quantization_config") or {}).get(key) for key in QUANTIZATION_MEANING}
                    for side in (left, right)]
        # the settings first: an FP8 model against its bf16 twin differs in every weight, which says less
        differences[:0] = [f"config.json quantization_config.{key}: {json.dumps(settings[0][key])} vs "
                           f"{json.dumps(settings[1][key])}" for key in QUANTIZATION_MEANING
                           if settings[0][key] != settings[1][key]] + _setting_differences(left, right)
        at = len(differences)  # (the stacked experts' lines go before the tensors' own)
        common = sorted(left.tensors.keys() & right.tensors.keys())
        differing = [name for name, _ in only]
        total = 0
        with _bar(sum(left.tensors[n].nbytes for n in common), "verify", progress) as bar:
            for name in common:
                x, y = left.read(name), right.read(name)
                difference = tensor_difference(name, x, y)
                if difference:
                    differences.append(difference)
                    differing.append(name)
                total += x.nbytes
                bar.update(x.nbytes)
        differences[at:at] = _form_differences(forms, differing)
        return len(common), total, differences


def _form_differences(forms: dict[str, list], differing: list[str]) -> list[str]:
    """One line per stacked expert tensor stored in another form (`forms`: name -> its two stored
    shapes, None for per-expert tensors), saying whether its experts' values (`differing`: the
    per-expert names that differ) are the same."""
    stacks_differing = {view[0] for view in map(stacked_expert, differing) if view}
    lines = []
    for name, shapes in forms.items():
        a, b = (f"{list(s)}" if s else "per-expert tensors" for s in shapes)
        outcome = ("its experts' values differ (listed apart)" if name in stacks_differing else
                   "the same values, stored differently")
        lines.append(f"{name}: stored as {a} vs {b} (stacked experts in another orientation or form): {outcome}")
    return lines


def _token_ids(config: dict) -> dict:
    """config.json's `*_token_id` keys, at the top level and in text_config (as `text_config.KEY`)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return {f"{prefix}{key}": value for prefix, block in (("", config), ("text_config.", text))
            for key, value in block.items() if key.endswith("_token_id")}


def _setting_differences(left: HFCheckpoint, right: HFCheckpoint) -> list[str]:
    """The model settings two HF models differ in, as mconv's table for their architecture reads
    config.json (its `dims`: sizes, rotary embedding, norm epsilon, tied embeddings, MoE layers...),
    so that one setting spelled two ways (transformers 4.x and 5.x keys) is no difference; their
    architectures where they differ; the special token ids (every `*_token_id` key, at the top level
    and in text_config: the table does not read them, the engines do); and the generation config
    and tokenizer files (hf_config.side_file_differences). Where the table refuses either config
    (a setting mconv cannot carry, such as another activation), the two config.json objects are
    compared key by key instead."""
    from mconv.converter.hf_config import side_file_differences
    from mconv.mappings import architecture_for

    differences = []
    try:
        archs = [architecture_for(side.config) for side in (left, right)]
        if archs[0] is not archs[1]:
            differences.append(f"config.json architectures: {archs[0].name} vs {archs[1].name}")
        else:
            dims = [_flat(vars(archs[0].dims(side.config))) for side in (left, right)]
            for key in sorted(dims[0].keys() | dims[1].keys()):
                if dims[0].get(key) != dims[1].get(key):
                    differences.append(f"config.json, as mconv reads it for {archs[0].name}: {key} "
                                       f"{dims[0].get(key)!r:.80} vs {dims[1].get(key)!r:.80}")
        tokens = [_token_ids(side.config) for side in (left, right)]
        differences += [f"config.json {key}: {json.dumps(tokens[0].get(key))[:80]} vs "
                        f"{json.dumps(tokens[1].get(key))[:80]}" for key in sorted(tokens[0].keys() | tokens[1].keys())
                        if tokens[0].get(key) != tokens[1].get(key)]
    except MconvError:  # not one mconv reads: the files as JSON, every top-level key
        configs = [side.config for side in (left, right)]
        differences += [f"config.json {key}: {json.dumps(configs[0].get(key))[:80]} vs "
                        f"{json.dumps(configs[1].get(key))[:80]}"
                        for key in sorted(configs[0].keys() | configs[1].keys())
                        if configs[0].get(key) != configs[1].get(key)]
    return differences + side_file_differences(left.dir, right.dir)


def _flat(settings: dict, prefix: str = "") -> dict:
    """`settings` with nested dicts' entries as "outer.inner" keys (one line per setting that differs)."""
    flat = {}
    for key, value in settings.items():
        flat.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return flat

"""Parallel layout: the rank grid and where each layer lives (TP, PP, VPP, uneven pipelines, EP, ETP)."""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Iterator

from mconv.converter.options import MAX_PARALLEL_SIZE, option
from mconv.errors import MconvError


def count(n: int, noun: str) -> str:
    """`n` and `noun`, plural unless n is one: `1 layer`, `2 layers`, `0 layers`."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


@dataclass(frozen=True)
class Rank:
    """One legacy-format rank file: the tensor, pipeline and expert parallel ranks of the process
    that writes it, and the expert-tensor-parallel rank whose expert shards it holds."""

    tp: int
    pp: int
    ep: int = 0
    etp: int = 0


@dataclass(frozen=True)
class Layout:
    """A Megatron job's parallel layout, in Megatron-LM's terms: TP, PP, VPP (virtual pipeline
    chunks per PP rank), EP, ETP (expert tensor parallel; MoE parallel folding), an uneven
    pipeline's first and last stage layers, and the vocabulary divisor (make_vocab_size_divisible_by:
    the vocabulary is padded to a multiple of it times TP). `check_sizes` / `check_legacy` raise
    MconvError naming the option that does not fit; what fits a model is the planner's
    (`planner.validate_layout`)."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1  # virtual pipeline chunks per PP rank
    ep: int = 1
    etp: int = 1
    first_stage_layers: int | None = None  # megatron-core num_layers_in_first_pipeline_stage
    last_stage_layers: int | None = None  # megatron-core num_layers_in_last_pipeline_stage
    vocab_divisor: int = 128  # make_vocab_size_divisible_by

    def __post_init__(self):
        """Sizes are integers (a checkpoint's saved args may hold anything); `check_sizes` and
        `validate` check their values."""
        for name, value in vars(self).items():
            if value is None and name.endswith("_stage_layers"):
                continue
            # The vocabulary divisor may be a whole padded vocabulary (a torch_dist checkpoint's
            # embedding rows, as DistCheckpoint reads it): bounded like config.json's vocab_size.
            limit = 2**31 if name == "vocab_divisor" else MAX_PARALLEL_SIZE
            if not isinstance(value, int) or isinstance(value, bool) or abs(value) > limit:
                raise MconvError(f"{option(name)} is {value!r}: give a whole number up to {limit:,}")

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        text = f"TP{self.tp} PP{self.pp}"
        if self.vpp > 1:
            text += f" VPP{self.vpp}"
        if self.ep > 1 or self.etp > 1:
            text += f" EP{self.ep} ETP{self.etp}"
        stages = [f"{which} stage {count(n, 'layer')}" for which, n in (("first", self.first_stage_layers),
                                                                        ("last", self.last_stage_layers)) if n is not None]
        if stages:
            text += f" ({', '.join(stages)})"
        return text

    def ranks(self) -> Iterator[Rank]:
        """The rank files of a legacy checkpoint.

        Megatron-LM writes one file per (tp, ep) pair, from the processes whose data-parallel or
        expert-data-parallel rank is 0. Within a pipeline stage megatron-core numbers processes
        tp-fastest in the dense grid and etp-fastest, then ep, in the expert grid, so process i
        has tp rank i % tp, etp rank i % etp, ep rank (i // etp) % ep, and the writers are the
        processes i < max(tp, etp * ep). With ETP != TP some (tp, ep) pairs have no file.
        """
        for pp in range(self.pp):
            for i in range(max(self.tp, self.etp * self.ep)):
                yield Rank(i % self.tp, pp, (i // self.etp) % self.ep, i % self.etp)

    def rank_dir(self, rank: Rank) -> str:
        """Megatron-LM's legacy directory name for a rank (the PP part only when PP>1, EP only when EP>1)."""
        name = f"mp_rank_{rank.tp:02d}"
        if self.pp > 1:
            name += f"_{rank.pp:03d}"
        if self.ep > 1:
            name += f"_{rank.ep:03d}"
        return name

    def check_sizes(self) -> None:
        for name in ("tp", "pp", "vpp", "ep", "etp", "vocab_divisor"):
            if getattr(self, name) < 1:
                raise MconvError(f"{option(name)} must be a positive integer, got {getattr(self, name)}")
        if self.vocab_divisor * self.tp > 2**31:  # the vocabulary is padded to a multiple of both
            raise MconvError(f"{option('vocab_divisor')} is {self.vocab_divisor:,}: at {option('tp', self.tp)} the "
                             f"vocabulary is padded to a multiple of {self.vocab_divisor * self.tp:,}; give a "
                             f"divisor up to {2**31 // self.tp:,}")

    def check_legacy(self) -> None:
        """The legacy (`torch`) format's own rule; megatron-core and torch_dist take any ETP."""
        if self.tp % self.etp:
            raise MconvError(f"{option('etp', self.etp)} does not divide {option('tp', self.tp)}: Megatron-LM's "
                             f"legacy format ({option('fmt', 'torch')}) keeps one expert shard per (tp, ep) rank "
                             f"file, which needs tp % etp == 0; {option('fmt', 'torch_dist')} takes any etp")

    def validate(self, num_layers: int) -> None:
        self.check_sizes()
        self.check_pipeline()
        self.stage_layer_counts(num_layers)

    def check_pipeline(self) -> None:
        """What a pipeline layout needs whatever the model: VPP and uneven stages only with PP > 1."""
        if self.vpp > 1 and self.pp == 1:
            raise MconvError(f"{option('vpp')} needs {option('pp')} > 1: virtual pipeline chunks interleave "
                             "pipeline stages")
        if self.pp == 1 and (self.first_stage_layers is not None or self.last_stage_layers is not None):
            raise MconvError(f"{option('first_stage_layers')}/{option('last_stage_layers')} need {option('pp')} > 1")

    def stage_layer_counts(self, num_layers: int) -> list[int]:
        """Layers per pipeline stage, with megatron-core's rules for uneven first/last stages."""
        fixed = {0: self.first_stage_layers, self.pp - 1: self.last_stage_layers}
        fixed = {stage: n for stage, n in fixed.items() if n is not None}
        if len(fixed) == 1 and self.pp == 1:
            fixed = {}
        middle = [s for s in range(self.pp) if s not in fixed]
        remaining = num_layers - sum(fixed.values())
        if any(n < 1 for n in fixed.values()):
            raise MconvError(f"{option('first_stage_layers')}/{option('last_stage_layers')} must be at least 1")
        given = " and ".join(option(f"{'first' if stage == 0 else 'last'}_stage_layers", n) for stage, n in fixed.items())
        if remaining < 0:
            raise MconvError(f"{given}: {count(sum(fixed.values()), 'layer')} on the first/last pipeline stages, "
                             f"more than the model's {num_layers}")
        if middle and remaining == 0:
            raise MconvError(f"{given}: all {count(num_layers, 'layer')} of the model on the first/last pipeline "
                             f"stages, none left for the {count(len(middle), 'other stage')} of {option('pp', self.pp)}")
        if middle and remaining % len(middle):
            left = f"{given} leaves {count(remaining, 'layer')}, which" if fixed else count(remaining, 'layer')
            raise MconvError(f"{left} cannot be split evenly over "
                             f"{count(len(middle), 'pipeline stage')} (num_layers={num_layers}, {option('pp', self.pp)})")
        if not middle and self.vpp > 1:
            # get_transformer_layer_offset divides by the number of middle stages under VPP
            # (ZeroDivisionError in megatron-core 0.19.2), so no trainer can build this layout.
            raise MconvError(f"{option('vpp')} with both {option('first_stage_layers')} and {option('last_stage_layers')} "
                             f"needs a middle pipeline stage ({option('pp', 3)} or more, got {option('pp', self.pp)}): "
                             "megatron-core cannot place it")
        if not middle and remaining:
            raise MconvError(f"the first and last stages hold {count(sum(fixed.values()), 'layer')}, "
                             f"but the model has {num_layers}")
        counts = [fixed.get(s, remaining // len(middle) if middle else 0) for s in range(self.pp)]
        for stage, layers in enumerate(counts):
            if layers % self.vpp:
                raise MconvError(f"pipeline stage {stage} holds {count(layers, 'layer')}, "
                                 f"not divisible by {option('vpp', self.vpp)}")
        return counts

    def chunk_layers(self, num_layers: int) -> list[list[range]]:
        """Global layer range of each model chunk, indexed [pp][vpp]."""
        per_chunk = [count // self.vpp for count in self.stage_layer_counts(num_layers)]
        round_size = sum(per_chunk)
        return [[range(v * round_size + sum(per_chunk[:p]), v * round_size + sum(per_chunk[:p + 1]))
                 for v in range(self.vpp)] for p in range(self.pp)]


def parse_layout_string(text: str) -> dict[str, int]:
    """Parse an AReaL-style layout, e.g. 'attn:d1p4t2c2|ffn:d1p4t1e4' (attention dp/pp/tp/cp, expert
    dp/pp/tp/ep) or a single 'd2p2t4', into tp/pp/ep/etp sizes. DP and CP do not change weights."""
    sections = {}
    for part in text.split("|"):
        name, _, body = part.rpartition(":")
        name = name.strip() or "attn"
        if name not in ("attn", "ffn") or name in sections:
            raise MconvError(f"--layout {text!r}: expected 'attn:...' and optionally '|ffn:...', got {part!r}")
        pairs = re.findall(r"([a-z])(\d+)", body.strip())
        if not pairs or "".join(k + v for k, v in pairs) != body.strip():
            raise MconvError(f"--layout {text!r}: {part!r} is not a list of sizes such as d1p4t2c2")
        allowed = "dptc" if name == "attn" else "dpte"
        sizes = {}
        for key, value in pairs:
            if key not in allowed or key in sizes:
                raise MconvError(f"--layout {text!r}: {name} takes the sizes {', '.join(allowed)} once each, not {key!r}")
            sizes[key] = int(value)
            if sizes[key] < 1:
                raise MconvError(f"--layout {text!r}: {name} {key}{value}: every size is at least 1")
        sections[name] = {k: sizes.get(k, 1) for k in allowed}
    attn = sections.get("attn")
    if attn is None:
        raise MconvError(f"--layout {text!r} has no attention part")
    ffn = sections.get("ffn", {"d": attn["d"] * attn["c"], "p": attn["p"], "t": attn["t"], "e": 1})
    if ffn["p"] != attn["p"]:
        raise MconvError(f"--layout {text!r}: attention pp {attn['p']} and expert pp {ffn['p']} must agree")
    attn_world = attn["d"] * attn["p"] * attn["t"] * attn["c"]
    ffn_world = ffn["d"] * ffn["p"] * ffn["t"] * ffn["e"]
    if attn_world != ffn_world:
        raise MconvError(f"--layout {text!r}: the attention part uses {attn_world} processes and the expert "
                         f"part {ffn_world}; they must be the same world")
    return {"tp": attn["t"], "pp": attn["p"], "ep": ffn["e"], "etp": ffn["t"]}

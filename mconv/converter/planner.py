"""The planner: (architecture table, HF config, layout, spec) -> every tensor of every rank.

Planning is pure: no tensor is read. The plan says, for each Megatron tensor of each rank and
model chunk, which HF tensors and which pieces of them it is made of. The export side
(Megatron -> HF) is the same plan read the other way round.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace


from mconv.converter.layout import Layout, Rank
from mconv.converter.options import SPECS, option
from mconv.converter.transforms import EXTRA_STATE, ShardLayout, padded_vocab_size
from mconv.errors import MconvError
from mconv.mappings.schema import FIRST, LAST, Architecture, Rule

STAGE_ORDER = {FIRST: 0, None: 1, LAST: 2}  # HF output order: embedding, layers, head


@dataclass(frozen=True)
class TensorTask:
    """One Megatron tensor of one rank's model chunk."""

    megatron: str  # name in the chunk's state dict (layer index local to the chunk)
    rule: Rule
    hf: tuple[str, ...]  # global HF names
    hf_shapes: tuple[tuple[int, ...], ...]
    shard: ShardLayout | None  # None for `_extra_state` entries
    order: tuple  # sorts HF output: (stage position, global layer, expert, rule position)

    @property
    def shape(self) -> tuple[int, ...] | None:
        return None if self.shard is None else self.shard.shape(self.hf_shapes)


@dataclass
class RankPlan:
    """One rank file's work: its Rank (tp, pp, ep, etp) and, per model chunk (VPP), the TensorTasks
    it holds."""

    rank: Rank
    chunks: list[list[TensorTask]]


@dataclass(frozen=True)
class ShardSource:
    """Where one group rank's shard of an HF tensor group lives in a Megatron checkpoint."""

    rank: Rank
    chunk: int
    megatron: str
    shard: ShardLayout


@dataclass
class ExportTask:
    """HF tensors made from one Megatron tensor's shards (several HF tensors for fused kinds)."""

    hf: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    sources: list[ShardSource] = field(default_factory=list)
    order: tuple = ()


@dataclass(repr=False)
class Plan:
    """What a conversion of one model at one layout does: the architecture's table applied to its
    config (`dims`: the sizes the table reads) at `layout` and `spec` ("local" or "te" names), as
    one RankPlan per rank file (every Megatron tensor each holds, with the slice of which HF tensors
    it is). make_plan builds it; MconvError there for a layout the model does not fit."""

    arch: Architecture
    config: dict
    dims: SimpleNamespace
    layout: Layout
    spec: str
    ranks: list[RankPlan]

    def __repr__(self) -> str:  # the fields hold the whole config and every tensor of every rank
        return f"Plan({self.arch.name}, {self.layout.describe()}, spec {self.spec}, {len(self.ranks)} rank files)"

    @property
    def padded_vocab(self) -> int:
        """The vocabulary as Megatron pads it: a multiple of vocab_divisor times TP (rows)."""
        return padded_vocab_size(self.dims.vocab, self.layout.vocab_divisor, self.layout.tp)

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every HF tensor the model has, with its shape."""
        shapes = {}
        for rank_plan in self.ranks:
            for chunk in rank_plan.chunks:
                for task in chunk:
                    shapes.update(zip(task.hf, task.hf_shapes))
        return shapes

    def exports(self) -> list[ExportTask]:
        """The HF tensor groups in output order, each with the shards it is rebuilt from: one per
        rank of the group that splits it (TP or ETP), taken from the first rank file holding it;
        replicated tensors from group rank 0 only."""
        groups: dict[tuple[str, ...], ExportTask] = {}
        slots: dict[tuple[str, ...], dict[int, ShardSource]] = {}
        for rank_plan in self.ranks:
            for v, chunk in enumerate(rank_plan.chunks):
                for task in chunk:
                    if task.shard is None or not task.rule.exported:
                        continue
                    groups.setdefault(task.hf, ExportTask(task.hf, task.hf_shapes, order=task.order))
                    slot = group_rank(task.rule, rank_plan.rank)
                    if slot == 0 or not task.rule.kind.replicated:
                        slots.setdefault(task.hf, {}).setdefault(
                            slot, ShardSource(rank_plan.rank, v, task.megatron, task.shard))
        for key, group in groups.items():
            group.sources = [slots[key][slot] for slot in sorted(slots[key])]
        return sorted(groups.values(), key=lambda g: g.order)


def group_rank(rule: Rule, rank: Rank) -> int:
    """`rank`'s place in the group that splits `rule`'s tensors: its ETP rank for expert weights
    split by ETP (parallel folding), else its TP rank."""
    return rank.etp if rule.group == "etp" else rank.tp


def group_size(rule: Rule, layout: Layout) -> int:
    """How many ranks split `rule`'s tensors at `layout`: ETP for expert weights split by ETP, else TP."""
    return layout.etp if rule.group == "etp" else layout.tp


def _size(token: str, dims: SimpleNamespace, name: str) -> int:
    try:
        return int(token) if token.isdigit() else getattr(dims, token)
    except AttributeError as e:
        raise MconvError(f"internal: the table's shape for {name} names unknown dimension {e.name}") from None


def _sections(token: str, dims: SimpleNamespace, name: str) -> tuple[int, tuple[int, ...]]:
    """A shape's first dimension as (groups, section sizes within a group): `a+b+c` is the sections
    a, b, c one after the other, `n*(a+b)` n groups of them (rows [n x [a; b]])."""
    groups, _, inner = token.rpartition("*(")
    inner = inner.removesuffix(")") if groups else token
    return (_size(groups, dims, name) if groups else 1), tuple(_size(t, dims, name) for t in inner.split("+"))


def table_shape(spec: str, dims: SimpleNamespace, name: str) -> tuple[int, ...]:
    """A table's shape (space-separated dims attributes, integers or sections, see mappings.schema) for `dims`."""
    first, *rest = spec.split()
    groups, sections = _sections(first, dims, name)
    return (groups * sum(sections), *(_size(part, dims, name) for part in rest))


def validate_layout(dims: SimpleNamespace, layout: Layout, arch_check=None) -> None:
    """Whether the model (`dims`) fits `layout` as Megatron-LM would build it: stages that divide
    its layers, heads and query groups divisible by TP, experts by EP, the expert FFN by ETP, no
    expert layout for a dense model, and the architecture's own rules (`arch_check(dims, layout)`).
    MconvError naming the option and the size that does not fit."""
    experts = getattr(dims, "experts", 0)
    # A dense model's MLP is split as attention is: an expert layout of EP 1 and ETP 1 or TP (the
    # ffn part of --layout, which defaults to the attention part) says nothing more.
    if not experts and (layout.ep > 1 or layout.etp not in (1, layout.tp)):
        raise MconvError(f"the model has no experts, so the expert layout EP {layout.ep} ETP {layout.etp} "
                         f"({option('ep')}/{option('etp')}, or the e and t of {option('layout')}'s ffn part) does not apply: "
                         "leave them out")
    layout.validate(dims.layers)
    for what, value in (("num_attention_heads", getattr(dims, "heads", None)),
                        ("num_key_value_heads (query groups)", getattr(dims, "groups", None))):
        if value is not None and value % layout.tp:
            raise MconvError(f"{what}={value} is not divisible by {option('tp', layout.tp)}")
    if arch_check is not None:
        arch_check(dims, layout)
    if experts and experts % layout.ep:
        raise MconvError(f"{experts} experts are not divisible by {option('ep', layout.ep)}")
    if experts and dims.moe_ffn % layout.etp:
        raise MconvError(f"the expert MLP size (moe_intermediate_size={dims.moe_ffn}) is not divisible "
                         f"by {option('etp', layout.etp)}")


def model_dims(arch: Architecture, config: dict, mtp: bool = False) -> SimpleNamespace:
    """`arch.dims(config)` with `mtp_layers`, how many multi-token-prediction layers are converted:
    all `hf_mtp_layers` of the model with `mtp` (megatron-core's MTP block), else none (the table's
    `dropped` names them). Raises MconvError for `mtp` on a model without MTP layers."""
    dims = arch.dims(config)
    available = getattr(dims, "hf_mtp_layers", 0)
    if mtp and not available:
        raise MconvError(f"{option('mtp', True)}: {arch.name} as config.json describes it has no multi-token-prediction layers "
                         "(num_nextn_predict_layers, or mtp_num_hidden_layers, is 0 or absent, or mconv's table has no MTP "
                         "rules for it)")
    dims.mtp_layers = available if mtp else 0
    return dims


def make_plan(arch: Architecture, config: dict, layout: Layout, spec: str, mtp: bool = False) -> Plan:
    """Every rank file of the layout (see Layout.ranks); with `mtp`, the model's multi-token-prediction
    layers too (see model_dims)."""
    if spec not in SPECS:
        raise MconvError(f"{option('spec')} must be one of {', '.join(SPECS)}, got {spec!r}")
    dims = model_dims(arch, config, mtp)
    validate_layout(dims, layout, arch.check_layout)
    ranks = [plan_rank(arch, dims, layout, spec, rank) for rank in layout.ranks()]
    return Plan(arch, config, dims, layout, spec, ranks)


def plan_rank(arch: Architecture, dims: SimpleNamespace, layout: Layout, spec: str, rank: Rank) -> RankPlan:
    """The tensors of one rank's model chunks: embedding on the first chunk, then the chunk's
    layers in rule order, then the final norm and output layer on the last chunk."""
    ctx = SimpleNamespace(**vars(dims), **layout.to_dict())
    rules = [r for r in arch.rules if spec in r.specs]
    placed = {FIRST: (0, 0), LAST: (layout.pp - 1, layout.vpp - 1)}
    chunks = []
    for v, layers in enumerate(layout.chunk_layers(dims.layers)[rank.pp]):
        chunk = []
        for stage in (FIRST, None, LAST):
            for position, rule in enumerate(rules):
                if rule.stage != stage:
                    continue
                if stage is None:
                    for layer in layers:
                        if rule.when is None or rule.when(ctx, layer):
                            chunk += _layer_tasks(rule, ctx, layout, rank, spec, position, layer,
                                                  layer - layers.start)
                elif placed[stage] == (rank.pp, v):
                    chunk += _stage_tasks(rule, ctx, layout, rank, spec, position)
        chunks.append(chunk)
    return RankPlan(rank, chunks)


def _stage_tasks(rule: Rule, ctx: SimpleNamespace, layout: Layout, rank: Rank, spec: str,
                 position: int) -> list[TensorTask]:
    """A rule outside the decoder layers: one tensor, or one per index of its `repeat`. A rule repeated
    over layers kept outside the decoder (`repeat` names a base: megatron-core's MTP layers) is a layer
    rule of HF layer base + index: `when` takes that layer, experts are expanded."""
    if rule.repeat is None:
        return [_task(rule, ctx, layout, rank, spec, position)] if rule.when is None or rule.when(ctx) else []
    field_name, count, *base = rule.repeat
    tasks = []
    for index in range(getattr(ctx, count)):
        if not base:
            if rule.when is None or rule.when(ctx):
                tasks.append(_task(rule, ctx, layout, rank, spec, position, index={field_name: index}))
            continue
        layer = getattr(ctx, base[0]) + index
        if rule.when is None or rule.when(ctx, layer):
            tasks += _layer_tasks(rule, ctx, layout, rank, spec, position, layer, None, {field_name: index})
    return tasks


def _layer_tasks(rule: Rule, ctx: SimpleNamespace, layout: Layout, rank: Rank, spec: str, position: int,
                 layer: int, local_layer: int | None, index: dict | None = None) -> list[TensorTask]:
    """A layer rule's tensors; for expert rules one per local expert of the rank's EP rank."""
    if "{expert}" not in rule.megatron_name(spec):
        return [_task(rule, ctx, layout, rank, spec, position, layer, local_layer, index=index)]
    per_rank = ctx.experts // layout.ep
    return [_task(rule, ctx, layout, rank, spec, position, layer, local_layer, rank.ep * per_rank + local, local,
                  index) for local in range(per_rank)]


def _task(rule: Rule, ctx: SimpleNamespace, layout: Layout, rank: Rank, spec: str, position: int,
          layer: int | None = None, local_layer: int | None = None, expert: int | None = None,
          local_expert: int | None = None, index: dict | None = None) -> TensorTask:
    index = index or {}
    megatron = rule.megatron_name(spec).format(layer=local_layer, expert=local_expert, **index)
    hf = tuple(name.format(layer=layer, expert=expert, **index) for name in rule.hf)
    hf_shapes = tuple(table_shape(shape, ctx, name) for name, shape in zip(hf, rule.hf.values()))
    shard = None
    if rule.kind is not EXTRA_STATE:
        heads, groups, head_dim = (getattr(ctx, name, None) for name in rule.qkv_dims)
        params = dict(name=megatron, heads=heads, groups=groups, head_dim=head_dim, vocab_divisor=layout.vocab_divisor,
                      sections=[_sections(shape.split()[0], ctx, name) for name, shape in zip(hf, rule.hf.values())])
        shard = rule.kind.layout(hf_shapes, group_rank(rule, rank), group_size(rule, layout), params)
    order = (STAGE_ORDER[rule.stage], layer or next(iter(index.values()), 0) or 0, expert or 0, position)
    return TensorTask(megatron, rule, hf, hf_shapes, shard, order)

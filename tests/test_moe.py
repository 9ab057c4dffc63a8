"""Qwen3-MoE: expert parallelism, the legacy rank grid under MoE parallel folding, byte-exact round
trips over EP/ETP and both expert layouts, EP ranks reading only their experts, bad inputs."""
import math
from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fixtures.make_fixtures import make_qwen3_moe
from mconv import Layout, MconvError, hf2mcore, mcore2hf
from mconv.converter.hf_io import HFCheckpoint
from mconv.converter.layout import parse_layout_string
from tests.conftest import FIXTURES, load_rank_file
from tests.test_errors import assert_refused, legacy, mconv
from tests.test_roundtrip import assert_bit_identical, read_all

MOE = FIXTURES / "qwen3-moe-tiny"


def megatron_writers(tp, pp, ep, etp):
    """(tp, pp, ep, etp) of every process that writes a legacy rank file, from megatron-core's own
    RankGenerator and Megatron-LM's rule (data-parallel rank 0 or expert-data-parallel rank 0)."""
    from megatron.core.parallel_state import RankGenerator

    world = pp * math.lcm(tp, etp * ep)
    dense = RankGenerator(tp=tp, ep=1, dp=world // (tp * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    expert = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")

    def position(generator, token):
        where = {}
        for group in generator.get_ranks(token):
            for index, rank in enumerate(group):
                where[rank] = index
        return where

    t, d, p = position(dense, "tp"), position(dense, "dp"), position(dense, "pp")
    et, e, ed = position(expert, "tp"), position(expert, "ep"), position(expert, "dp")
    return {(t[r], p[r], e[r], et[r]) for r in range(world) if d[r] == 0 or ed[r] == 0}


@pytest.mark.parametrize("tp,pp,ep,etp", [(1, 1, 1, 1), (2, 1, 2, 1), (2, 1, 2, 2), (4, 2, 2, 1), (2, 1, 4, 1),
                                          (4, 1, 2, 2), (1, 2, 8, 1), (4, 1, 1, 1), (8, 1, 2, 4)])
def test_rank_grid_matches_megatron(tp, pp, ep, etp):
    ours = {(r.tp, r.pp, r.ep, r.etp) for r in Layout(tp=tp, pp=pp, ep=ep, etp=etp).ranks()}
    assert ours == megatron_writers(tp, pp, ep, etp)
    assert len({(tp_, pp_, ep_) for tp_, pp_, ep_, _ in ours}) == len(ours)  # one writer per file


@st.composite
def moe_case(draw):
    experts = draw(st.sampled_from([4, 8]))
    ep = draw(st.sampled_from([e for e in (1, 2, 4, 8) if experts % e == 0]))
    tp = draw(st.sampled_from([1, 2]))
    etp = draw(st.sampled_from([e for e in (1, 2) if tp % e == 0]))
    layers = draw(st.integers(2, 4))
    pp = draw(st.sampled_from([p for p in (1, 2) if layers % p == 0]))
    model = dict(num_experts=experts, num_hidden_layers=layers, moe_intermediate_size=16 * etp,
                 mlp_only_layers=sorted(draw(st.sets(st.integers(0, layers - 1), max_size=1))),
                 decoder_sparse_step=draw(st.sampled_from([1, 2])), hidden_size=32, head_dim=8,
                 intermediate_size=16 * tp, vocab_size=draw(st.integers(40, 200)),
                 tie_word_embeddings=draw(st.booleans()))
    return model, Layout(tp=tp, pp=pp, ep=ep, etp=etp), draw(st.sampled_from(["local", "te"]))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=moe_case(), seed=st.integers(0, 2**16))
def test_moe_round_trip_is_bit_identical(tmp_path_factory, case, seed):
    model, layout, spec = case
    tmp = tmp_path_factory.mktemp("moe")
    hf = make_qwen3_moe(tmp / "hf", seed=seed, tokenizer=False, **model)
    hf2mcore(hf, tmp / "megatron", layout, spec=spec, fmt="torch", progress=False)
    mcore2hf(tmp / "megatron", tmp / "back", progress=False)
    assert_bit_identical(read_all(hf), read_all(tmp / "back"))


def test_expert_names_per_spec(tmp_path):
    import torch

    hf2mcore(MOE, tmp_path / "te", Layout(ep=2), spec="te", fmt="torch", progress=False)
    hf2mcore(MOE, tmp_path / "local", Layout(ep=2), spec="local", fmt="torch", progress=False)
    te = load_rank_file(tmp_path / "te/release/mp_rank_00_001/model_optim_rng.pt")["model"]
    local = load_rank_file(tmp_path / "local/release/mp_rank_00_001/model_optim_rng.pt")["model"]
    assert "decoder.layers.0.mlp.experts.linear_fc1.weight3" in te and "decoder.layers.0.mlp.experts.linear_fc1._extra_state" in te
    assert "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight" in local
    assert "decoder.layers.0.mlp.experts.local_experts.4.linear_fc2.weight" not in local  # 8 experts / EP2
    # EP rank 1 holds global experts 4..7 as local 0..3
    hf = HFCheckpoint(MOE)
    assert torch.equal(local["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"],
                       hf.read("model.layers.0.mlp.experts.4.down_proj.weight"))
    # layer 1 is dense (mlp_only_layers): fused pre-MLP norm under TE, no router
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in te and "decoder.layers.1.mlp.router.weight" not in te
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in te


def test_each_ep_rank_reads_only_its_experts(tmp_path, monkeypatch):
    reads = defaultdict(int)  # HF tensor -> bytes read
    # Every read ends in one of these: `read_into` (`read`, pieces read into their rows) or
    # `byte_range` (pieces that are byte ranges of the files, copied from there).
    original_read, original_range = HFCheckpoint.read_into, HFCheckpoint.byte_range

    def counting_read(self, name, dim, start, stop, out):
        original_read(self, name, dim, start, stop, out)
        reads[name] += out.nbytes

    def counting_range(self, name, start, stop):
        found = original_range(self, name, start, stop)
        reads[name] += found[2] if found else 0
        return found

    monkeypatch.setattr(HFCheckpoint, "read_into", counting_read)
    monkeypatch.setattr(HFCheckpoint, "byte_range", counting_range)
    layout = Layout(tp=2, ep=4, etp=1)
    summary = hf2mcore(MOE, tmp_path / "m", layout, fmt="torch", progress=False)
    hf = HFCheckpoint(MOE)
    experts = {name: info for name, info in hf.tensors.items() if ".mlp.experts." in name}
    assert experts
    for name, info in experts.items():
        # 4 rank files (one per EP rank, ETP1): each expert is read by exactly one of them, once.
        assert reads[name] == info.nbytes, name
    assert len(summary.plan.ranks) == 4


def test_layout_string_equals_flags():
    assert parse_layout_string("attn:d1p4t2c2|ffn:d1p4t1e4") == {"tp": 2, "pp": 4, "ep": 4, "etp": 1}
    assert parse_layout_string("d2p2t4") == {"tp": 4, "pp": 2, "ep": 1, "etp": 4}
    with pytest.raises(MconvError, match=r"^--layout 'attn:d1p1t0\|ffn:d1p1t1e2': attn t0: every size is at least 1$"):
        parse_layout_string("attn:d1p1t0|ffn:d1p1t1e2")


def test_layout_string_conversion_matches_flags(tmp_path):
    assert legacy(MOE, tmp_path / "a", "--layout", "attn:d2p2t2c1|ffn:d1p2t1e4").exit_code == 0
    assert legacy(MOE, tmp_path / "b", "--tp", "2", "--pp", "2", "--ep", "4").exit_code == 0
    for a in sorted((tmp_path / "a" / "release").iterdir()):
        b = tmp_path / "b" / "release" / a.name
        import torch
        sa, sb = (load_rank_file(x / "model_optim_rng.pt")["model"] for x in (a, b))
        assert sa.keys() == sb.keys() and all(sa[k] is None or torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("options,fragment", [
    (["--ep", "3"], "8 experts are not divisible by --ep 3"),
    (["--tp", "2", "--etp", "2", "--ep", "2"], None),
    (["--tp", "1", "--etp", "2", "--format", "torch"], "--etp 2 does not divide --tp 1: Megatron-LM's legacy format"),
    (["--layout", "attn:d1p2t2|ffn:d1p4t1e2"], "attention pp 2 and expert pp 4 must agree"),
    (["--layout", "attn:d1p1t2|ffn:d1p1t1e4"], "uses 2 processes and the expert part 4"),
    (["--layout", "attn:d1p1t2x3"], "sizes d, p, t, c"),
    (["--layout", "attn:d1p1t2", "--tp", "2"], "--layout replaces --tp"),
])
def test_bad_moe_options(tmp_path, options, fragment):
    result = mconv("hf2mcore", MOE, tmp_path / "out", "-q", *options)
    if fragment is None:
        assert result.exit_code == 0
    else:
        assert_refused(result, tmp_path / "out", fragment)


def test_etp_must_divide_expert_mlp(tmp_path):
    hf = make_qwen3_moe(tmp_path / "hf", tokenizer=False, moe_intermediate_size=25, num_hidden_layers=2)
    assert_refused(mconv("hf2mcore", hf, tmp_path / "out", "--tp", "2", "--etp", "2", "-q"),
                   tmp_path / "out", "moe_intermediate_size=25", "--etp 2")


@pytest.mark.parametrize("options", [["--ep", "2"], ["--etp", "2"], ["--layout", "attn:d1p1t2|ffn:d1p1t1e2"],
                                     ["--layout", "attn:d2p1t2|ffn:d1p1t4e1"]])
def test_ep_on_dense_model_is_refused(tmp_path, options):
    """Named for what it is (not as a broken ETP/TP rule, which --etp 2 at TP1 would also break),
    with the values and both ways of giving them (flags or --layout's ffn part)."""
    assert_refused(mconv("hf2mcore", FIXTURES / "qwen3-tiny", tmp_path / "out", *options), tmp_path / "out",
                   "the model has no experts, so the expert layout EP", "--layout's ffn part")


@pytest.mark.parametrize("layout,files", [("d1p1t2", 2), ("attn:d1p2t2|ffn:d1p2t2e1", 4), ("attn:d2p1t2|ffn:d4p1t1e1", 2)])
def test_a_dense_model_takes_a_layout_whose_ffn_part_follows_attention(tmp_path, layout, files):
    """--layout 'd1p1t2' makes the ffn part t2 as well; for a dense model that is its MLP's TP."""
    result = mconv("hf2mcore", FIXTURES / "qwen3-tiny", tmp_path / "out", "--layout", layout, "--format", "torch", "-q")
    assert result.exit_code == 0, result.output
    assert len(list((tmp_path / "out" / "release").iterdir())) == files


def test_torch_dist_takes_an_etp_that_does_not_divide_tp(tmp_path):
    """megatron-core's expert grid is its own (parallel_state: only the world size must divide):
    the legacy format's tp % etp rule does not apply to torch_dist, which stores global tensors."""
    from tests.conftest import assert_hf_bits_equal, hf_tensors

    assert mconv("hf2mcore", MOE, tmp_path / "ckpt", "--tp", "1", "--etp", "2", "-q").exit_code == 0
    assert mconv("mcore2hf", tmp_path / "ckpt", tmp_path / "back", "-q").exit_code == 0
    assert_hf_bits_equal(hf_tensors(MOE), tmp_path / "back")


def test_checkpoint_missing_one_expert(tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    hf = shutil.copytree(MOE, tmp_path / "hf")
    tensors = load_file(hf / "model.safetensors")
    del tensors["model.layers.3.mlp.experts.5.up_proj.weight"]
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    assert_refused(mconv("hf2mcore", hf, tmp_path / "out", "--ep", "2"), tmp_path / "out",
                   "model.layers.3.mlp.experts.5.up_proj.weight", "missing")


def test_megatron_checkpoint_missing_one_expert(tmp_path):
    import torch

    assert legacy(MOE, tmp_path / "m", "--ep", "2").exit_code == 0
    path = tmp_path / "m/release/mp_rank_00_001/model_optim_rng.pt"
    state = load_rank_file(path)
    del state["model"]["decoder.layers.2.mlp.experts.local_experts.1.linear_fc1.weight"]
    torch.save(state, path)
    assert_refused(mconv("mcore2hf", tmp_path / "m", tmp_path / "out"), tmp_path / "out",
                   "decoder.layers.2.mlp.experts.local_experts.1.linear_fc1.weight", "missing")


def test_inspect_shows_moe_settings(tmp_path):
    assert legacy(MOE, tmp_path / "m", "--ep", "2").exit_code == 0
    result = mconv("inspect", tmp_path / "m")
    for fragment in ("8 experts, top 2, expert ffn 32", "router top-k, then softmax over them (norm_topk_prob true)"):
        assert fragment in result.output, result.output

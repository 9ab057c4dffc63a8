"""copies.CopyPlan: the batched copy kernel (run here by Triton's CPU interpreter, as on a GPU it is
compiled) against torch's own `copy_`, byte for byte, and its replanning when tensors move."""
import pytest
import torch

from mconv.transport.copies import CopyPlan

pytest.importorskip("triton")


def _sources(generator: torch.Generator) -> list[torch.Tensor]:
    """Mixed dtypes, sizes not a multiple of 16 bytes, one larger than a kernel program's chunk, an
    empty one and a transposed (non-contiguous) one."""
    shapes = [((33,), torch.float32), ((7, 5), torch.bfloat16), ((130, 70), torch.float16), ((1,), torch.uint8),
              ((9000,), torch.float32), ((0, 4), torch.bfloat16), ((64, 3), torch.int64)]
    out = []
    for shape, dtype in shapes:
        bits = torch.randint(-2**31, 2**31 - 1, shape, generator=generator, dtype=torch.int64)
        out.append(bits.to(torch.int32).view(torch.uint8)[..., ::4].contiguous().view(dtype)[..., :shape[-1]]
                   if dtype.itemsize == 1 else (bits % 1000).to(dtype))
    out.append(torch.randn(8, 4, generator=generator, dtype=torch.float64).t())
    return out


def _destinations(sources: list[torch.Tensor], first_byte: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Views of one byte buffer, back to back from `first_byte` (each at a multiple of its element
    size, so some 16-byte aligned and some not), as a flat bucket's entries are."""
    buffer = torch.zeros(first_byte + sum(s.numel() * s.element_size() + 8 for s in sources), dtype=torch.uint8)
    views, at = [], first_byte
    for s in sources:
        at = -(-at // s.element_size()) * s.element_size()
        n = s.numel() * s.element_size()
        views.append(buffer[at:at + n].view(s.dtype).view(s.shape))
        at += n
    return buffer, views


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


@pytest.mark.parametrize("first_byte", [0, 1, 6])
def test_batched_copies_equal_torch_copies(first_byte):
    generator = torch.Generator().manual_seed(first_byte)
    sources = _sources(generator)
    buffer, views = _destinations(sources, first_byte)
    expected_buffer, expected = _destinations(sources, first_byte)
    for dst, src in zip(expected, sources):
        dst.copy_(src)
    plan = CopyPlan(views, sources, kernel=True)
    plan.run(sources)
    assert plan.kernel_copies == len(sources) - 2  # all but the empty and the transposed one, by the kernel
    assert torch.equal(buffer, expected_buffer)
    # out of the buffer again (unaligned sources), and new sources of the same dtypes and shapes into it
    back = [torch.empty_like(s, memory_format=torch.contiguous_format) for s in sources]
    CopyPlan(back, views, kernel=True).run(views)
    assert all(torch.equal(_bytes(b), _bytes(s)) for b, s in zip(back, sources))
    again = _sources(generator)
    for dst, src in zip(expected, again):
        dst.copy_(src)
    plan.run(again)
    assert torch.equal(buffer, expected_buffer)


def test_a_plan_follows_tensors_that_move():
    generator = torch.Generator().manual_seed(0)
    sources = [torch.randn(40, 40, generator=generator) for _ in range(3)]
    targets = [torch.zeros(40, 40) for _ in range(3)]
    plan = CopyPlan(targets, sources, kernel=True)
    plan.run(sources)
    assert all(torch.equal(t, s) for t, s in zip(targets, sources))
    # a source that lost its 16-byte alignment: replanned into the unaligned launch, still exact
    odd = torch.randn(40 * 40 + 1, generator=generator)[1:].view(40, 40)
    moved = [odd, sources[1] + 1, sources[2] * 2]
    plan.run(moved)
    assert all(torch.equal(t, s) for t, s in zip(targets, moved))
    assert [aligned for _, aligned in plan._launches] == [True, False]
    # at the same address as the last run's source, no longer contiguous (a square transpose) or with
    # torch's negative bit: replanned through torch's copy
    for changed in (moved[1].t(), torch._neg_view(moved[1])):
        again = CopyPlan(targets, moved, kernel=True)
        again.run(moved)
        again.run([odd, changed, moved[2]])
        assert torch.equal(targets[1], changed)
    # a source in a new place that is not contiguous
    plan.run(sources)
    moved = [odd, torch.randn(40, 40, generator=generator).t(), sources[2] * 2]
    plan.run(moved)
    assert all(torch.equal(t, s) for t, s in zip(targets, moved))
    # a destination freed in place: refused (torch's own copy would write into freed memory), and
    # once it is allocated again (elsewhere) the copy lands there
    storage = targets[1].untyped_storage()
    size = storage.nbytes()
    storage.resize_(0)
    with pytest.raises(ValueError, match="copy 1's destination .* freed in place"):
        plan.run(sources)
    storage.resize_(size)
    plan.run(sources)
    assert all(torch.equal(t, s) for t, s in zip(targets, sources))


def test_plans_refuse_what_they_cannot_copy():
    a, b = torch.zeros(4), torch.zeros(4, dtype=torch.float64)
    with pytest.raises(ValueError, match="float64"):
        CopyPlan([a], [b])
    with pytest.raises(ValueError, match=r"a copy from torch.float32 \[2\] into torch.float32 \[4\]"):
        CopyPlan([a], [torch.ones(4)], kernel=True).run([torch.ones(2)])
    with pytest.raises(ValueError, match="1 sources for 2 destinations"):
        CopyPlan([a, a], [a])
    with pytest.raises(ValueError, match="keeps no sources"):
        CopyPlan([a], [torch.ones(4)]).run()
    kept = CopyPlan([a], [torch.ones(4)], fixed_sources=True)
    kept.run()
    assert torch.equal(a, torch.ones(4))


def test_vouched_sources_are_read_where_they_were():
    """`unchanged` sources are taken as the first run's tensors, in place (their current bytes),
    whatever a later run passes in their place; the other sources are followed where they move."""
    generator = torch.Generator().manual_seed(1)
    kept, moving = torch.randn(32, 32, generator=generator), torch.randn(32, 32, generator=generator)
    targets = [torch.zeros(32, 32), torch.zeros(32, 32)]
    plan = CopyPlan(targets, [kept, moving], kernel=True, unchanged=[0])
    plan.run([kept, moving])
    kept.add_(1)  # in place: the next run copies the new values
    moved = torch.randn(32, 32, generator=generator)
    plan.run([torch.zeros(32, 32), moved])  # (position 0 vouched: what is passed there is not read)
    assert torch.equal(targets[0], kept) and torch.equal(targets[1], moved)


def test_a_destination_that_requires_grad_takes_the_bytes():
    """A parameter that requires grad (a receiver's nn.Parameter) is copied into as bytes, outside
    autograd (torch's own in-place copy into it would refuse)."""
    destination, source = torch.nn.Parameter(torch.zeros(8)), torch.arange(8.0)
    CopyPlan([destination], [source]).run([source])
    assert torch.equal(destination.detach(), source)

"""SlotStacks: the per-layer stacks with room, written in the kernel's layout and read back exactly."""

import pytest
import torch

from hf_deltazip.delta import PackedModule
from hf_deltazip.kernels import PackedFields, SlotStacks, build_row_segments

N, K = 48, 256


def packed(seed, bits=4, group_size=32, two_four=False):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (N, K), generator=gen)
    groups = K // group_size if group_size > 0 else 1
    scales = torch.rand(N, groups, generator=gen) * 0.01 + 0.001
    zeros = torch.full((N, groups), 2 ** (bits - 1))
    mask = None
    if two_four:  # keep the two largest of every four
        mask = torch.zeros(N, K, dtype=torch.bool)
        mask.view(N, K // 4, 4)[..., :2] = True
        codes = torch.where(mask, codes, zeros.repeat_interleave(K // groups, 1))
    return PackedModule.from_codes(codes, scales, zeros, mask, bits=bits, group_size=group_size, symmetric=True,
                                   two_four=two_four)


def fields(p):
    return PackedFields(p.qweight, p.scales, p.zeros, p.positions, p.bits, p.group_size, p.sparsity)


@pytest.mark.parametrize("kernel_layout", [True, False])
def test_written_deltas_read_back_exactly_and_rooms_are_reused(kernel_layout, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # apply() runs the Triton kernel, interpreted
    a, b, c = packed(1), packed(2, bits=2, group_size=-1, two_four=True), packed(3)
    stacks = SlotStacks([(0, fields(a)), (1, fields(b))], K, N, "cpu", capacity=3, kernel_layout=kernel_layout)
    if kernel_layout:
        assert stacks.where(0)[0].stack.layout_block > 0, "a 4-bit delta of this shape gets the planar layout"
        assert stacks.where(1)[0].stack.positions is None, "2:4 is held as dense codes"
    for slot, p in ((0, a), (1, b)):
        assert torch.equal(stacks.codes(slot), p.dense_codes())
        f = stacks.file_fields(slot)
        back = PackedModule(kind="linear", shape=(N, K), bits=f.bits, group_size=f.group_size, symmetric=True,
                            sparsity=f.sparsity, transposed=False, qweight=f.qweight, scales=f.scales, zeros=f.zeros,
                            positions=f.positions)
        assert torch.equal(back.dequantize(), p.dequantize())
    assert stacks.write(0, fields(c)) is None, "slot 0 is taken"
    assert stacks.remove(0) and not stacks.remove(0)
    assert stacks.write(2, fields(c)) is not None  # into the room slot 0 left
    assert torch.equal(stacks.codes(2), c.dense_codes())
    # the tables a captured step reads: slot + 1 -> index, membership per class
    rows = torch.tensor([3, 0, 2, 2])  # slot + 1 of each row: slot 2, base, slot 1, slot 1
    x = torch.randn(4, K)
    w = torch.randn(N, K) * 0.02
    y = stacks.apply(x, w, None, rows)
    for r, slot in enumerate([2, -1, 1, 1]):
        want = x[r] @ w.T if slot < 0 else x[r] @ (w + stacks_delta(stacks, slot)).T
        torch.testing.assert_close(y[r], want, rtol=1e-4, atol=1e-4)
    # one segment table on slot ids for every layer of a step: planar stacks translate slots in the kernel
    slots = (rows - 1).to(torch.int32)
    shared = stacks.apply(x, w, None, rows, (slots, build_row_segments(slots)))
    torch.testing.assert_close(shared, y, rtol=1e-5, atol=1e-5)
    # the split route: the base's product first, then every class adds its rows' deltas in place (rows of the
    # base and of the other class untouched)
    for seg in (None, (slots, build_row_segments(slots))):
        base = x @ w.T
        out = base.clone()
        assert stacks.accumulate(x, out, rows, seg) is out
        torch.testing.assert_close(out, y, rtol=1e-5, atol=1e-5)
        assert torch.equal(out[1], base[1])


def stacks_delta(stacks, slot):
    c, i = stacks.where(slot)
    return c.stack.dequantize(i)


def test_gather_rows_reads_each_rows_delta_rows():
    a, b = packed(4, bits=4, group_size=64), packed(5, bits=4, group_size=64)
    stacks = SlotStacks([(0, fields(a)), (3, fields(b))], K, N, "cpu", kernel_layout=False)
    ids = torch.tensor([[1, 5, 47], [0, 0, 2], [9, 8, 7]])
    slot_plus_one = torch.tensor([1, 0, 4])
    got = stacks.gather_rows(slot_plus_one, ids)
    assert torch.equal(got[1], torch.zeros(3, K))
    torch.testing.assert_close(got[0], a.dequantize()[ids[0]])
    torch.testing.assert_close(got[2], b.dequantize()[ids[2]])
    planar = SlotStacks([(0, fields(a))], K, N, "cpu", kernel_layout=True)
    with pytest.raises(ValueError, match="file layout"):
        planar.gather_rows(slot_plus_one[:1], ids[:1])

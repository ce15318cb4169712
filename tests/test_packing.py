import math

import pytest
import torch

from hf_deltazip.packing import (
    check_2of4_mask,
    compress_2of4,
    compute_qparams,
    dequantize,
    expand_2of4,
    pack_bitmask,
    pack_bits,
    pack_codes,
    packed_nbytes,
    quantize,
    unpack_bitmask,
    unpack_bits,
    unpack_codes,
)

from dz_factory import packed_module, two_four_mask

SHAPES = [(1, 1), (3, 7), (5, 33), (2, 64), (7, 129)]


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("shape", SHAPES)
def test_pack_bits_round_trip(bits, shape):
    gen = torch.Generator().manual_seed(bits * 100 + shape[1])
    codes = torch.randint(0, 2**bits, shape, generator=gen, dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (shape[0], math.ceil(shape[1] * bits / 8))
    assert torch.equal(unpack_bits(packed, bits, shape[1]), codes)


def test_pack_bits_layout_is_little_endian_within_bytes():
    # codes 1, 2, 3, 0 at 2 bits -> 0b00_11_10_01
    assert pack_bits(torch.tensor([[1, 2, 3, 0, 3]]), 2).tolist() == [[0b00111001, 0b11]]
    assert pack_bits(torch.tensor([[0xA, 0x5]]), 4).tolist() == [[0x5A]]
    # as 32-bit words: 16 two-bit codes per word, code i at bit 2i
    codes = torch.arange(16).remainder(4).reshape(1, 16)
    word = pack_bits(codes, 2).view(torch.int32).item() & 0xFFFFFFFF
    assert all((word >> (2 * i)) & 3 == i % 4 for i in range(16))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("shape", SHAPES)
def test_pack_codes_round_trip(bits, shape):
    gen = torch.Generator().manual_seed(bits + shape[1])
    codes = torch.randint(0, 2**bits, shape, generator=gen, dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape[-1] == packed_nbytes(shape[1], bits)
    assert torch.equal(unpack_codes(packed, bits, shape[1]), codes)


def test_three_bit_codes_are_two_planes():
    codes = torch.tensor([[5, 2, 7, 0, 1, 6, 3, 4]], dtype=torch.uint8)
    packed = pack_codes(codes, 3)
    assert torch.equal(packed[:, :2], pack_bits(codes & 3, 2))
    assert torch.equal(packed[:, 2:], pack_bits(codes >> 2, 1))


def test_out_of_range_codes_are_rejected():
    with pytest.raises(ValueError, match="out of range"):
        pack_codes(torch.tensor([[4]]), 2)
    with pytest.raises(ValueError, match="out of range"):
        pack_codes(torch.tensor([[8]]), 3)
    with pytest.raises(ValueError, match="bits must be one of"):
        pack_codes(torch.tensor([[1]]), 5)
    with pytest.raises(ValueError, match="need"):
        unpack_bits(torch.zeros(1, 3, dtype=torch.uint8), 4, 8)


@pytest.mark.parametrize("shape", [(1, 4), (3, 12), (5, 68)])
def test_2of4_round_trip(shape):
    gen = torch.Generator().manual_seed(shape[1])
    values = torch.randn(shape, generator=gen)
    mask = two_four_mask(*shape, gen)
    kept, positions = compress_2of4(values, mask)
    assert kept.shape == (shape[0], shape[1] // 2) and int(positions.max()) <= 3
    grouped = positions.reshape(shape[0], -1, 2)
    assert bool((grouped[..., 0] < grouped[..., 1]).all())
    assert torch.equal(expand_2of4(kept, positions, shape[1]), values * mask)


def test_bad_2of4_masks_are_rejected():
    with pytest.raises(ValueError, match="multiple of 4"):
        check_2of4_mask(torch.ones(2, 6, dtype=torch.bool))
    mask = torch.tensor([[True, True, True, False]])
    with pytest.raises(ValueError, match="exactly 2"):
        check_2of4_mask(mask)


def test_bitmask_round_trip():
    gen = torch.Generator().manual_seed(3)
    mask = torch.rand(5, 37, generator=gen) > 0.5
    packed = pack_bitmask(mask)
    assert packed.shape == (5, 5)
    assert torch.equal(unpack_bitmask(packed, 37), mask)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group_size", [-1, 32])
@pytest.mark.parametrize("symmetric", [True, False])
def test_grid_error_is_within_half_a_step(bits, group_size, symmetric):
    gen = torch.Generator().manual_seed(bits)
    w = torch.randn(6, 72, generator=gen) * 1e-3
    scales, zeros = compute_qparams(w, bits, group_size, symmetric)
    assert scales.shape == zeros.shape == (6, 1 if group_size == -1 else 3)
    codes = quantize(w, scales, zeros, bits, group_size)
    assert int(codes.max()) < 2**bits
    err = (dequantize(codes, scales, zeros, group_size) - w).abs()
    step = scales.repeat_interleave(72 if group_size == -1 else group_size, 1)[:, :72]
    if symmetric:  # GPTQ's symmetric grid clips the top code: allow one step there
        assert bool((err <= step * 1.0001).all())
    else:
        assert bool((err <= step * 0.5001).all())
    # zero is on every grid exactly
    zero_codes = quantize(torch.zeros_like(w), scales, zeros, bits, group_size)
    assert bool((dequantize(zero_codes, scales, zeros, group_size) == 0).all())


def test_tiny_scales_are_stored_in_float32():
    w = torch.full((2, 32), 1e-7)
    w[:, 0] = -1e-7
    scales, _ = compute_qparams(w, 4, -1, True)
    m = packed_module(2, 32, 4, -1, True, "dense", torch.Generator().manual_seed(0), scale=1e-7)
    assert m.scales.dtype == torch.float32
    assert packed_module(2, 32, 4, -1, True, "dense", torch.Generator().manual_seed(0)).scales.dtype == torch.float16


@pytest.mark.parametrize("layout", ["dense", "2:4", "bitmask"])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_packed_module_layouts_decode_the_same_delta(layout, bits):
    gen = torch.Generator().manual_seed(bits)
    m = packed_module(12, 40, bits, 32, False, layout, gen)
    dense = m.to_dense_layout().dequantize()
    assert torch.equal(m.dequantize(), dense)
    mask = m.kept_mask()
    if layout == "dense":
        assert mask is None
    else:
        assert bool((dense[~mask] == 0).all())
        if layout == "2:4":
            check_2of4_mask(mask)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group_size", [-1, 32, 64])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (5, 33), (4, 64), (6, 130)])
def test_quantize_and_dequantize_use_each_columns_own_group(bits, group_size, shape):
    """Against the grid written out column by column (the last group short where K is not a whole number of
    groups): the codes and the dequantized values, bit for bit, contiguous, in every output dtype."""
    n, k = shape
    gen = torch.Generator().manual_seed(bits * 1000 + k + group_size)
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen) * 3
    scales, zeros = compute_qparams(w, bits, group_size, symmetric=bits != 3)
    col_group = [0 if group_size == -1 else j // group_size for j in range(k)]
    s = scales[:, col_group]
    z = zeros.float()[:, col_group]
    want = (torch.round(w / s) + z).clamp(0, 2**bits - 1).to(torch.uint8)
    codes = quantize(w, scales, zeros, bits, group_size)
    assert torch.equal(codes, want) and codes.is_contiguous()
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        got = dequantize(codes, scales, zeros, group_size, dtype)
        assert torch.equal(got, ((want.float() - z) * s).to(dtype)) and got.is_contiguous()


def test_unpacked_codes_are_contiguous_where_the_last_byte_is_partial():
    codes = torch.tensor([[1, 2, 3], [3, 0, 1]], dtype=torch.uint8)
    out = unpack_bits(pack_bits(codes, 2), 2, 3)
    assert torch.equal(out, codes) and out.is_contiguous() and out.dtype == torch.uint8


def test_packing_speed_bench_runs_on_a_small_matrix(tmp_path):
    import json

    from hf_deltazip.bench import packing_speed

    out = tmp_path / "speed.json"
    assert packing_speed.main(["--shape", "64x256", "--rank", "4", "--repeats", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["shape"] == [64, 256] and result["rank"] == 4
    assert all(result[f"{step}_s"] > 0 for step in ("quantize", "dequantize", "pack_bits", "unpack_bits",
                                                    "lowrank_rebuild"))

"""The architecture matrix: every decoder family hf-deltazip claims, as a tiny float32 pair on the CPU.

For each family two fine-tunes of one base are compressed, saved and loaded into one ``DeltaModel``:
``a`` with 4-bit deltas and quantized embeddings, ``b`` with 8-bit deltas and the embeddings stored
exactly (``embeddings="exact"``: on tied models the LM head must follow the input embedding). A mixed
batch (rows ``a``, base, ``b``) must give, row by row, exactly what each merged model gives alone, in
the forward pass and in greedy generation. The comparisons are bit-exact: a row's computation is the
merged model's (same weights, same ops), only gathered per row.

Mixture-of-experts models (transformers 5 stores experts as fused 3-D tensors) are refused with an
error that names ``skip_modules``; with it their expert deltas are stored exactly and served.
"""

import copy
import logging

import pytest
import torch

from hf_deltazip import DeltaModel, DeltaZipConfig, UnsupportedModelError, compress

from model_factory import MATRIX_ARCHS, MATRIX_VOCAB, MOE_ARCHS, calibration_ids, matrix_finetune, matrix_model

EXPERTS = ["*.mlp.experts"]  # the fused expert tensors of mixtral / qwen2_moe / qwen3_moe, stored exactly
SETTINGS = {
    "a": dict(bits=4, group_size=32),
    "b": dict(bits=8, group_size=32, embeddings="exact"),
}
ROWS = ["a", None, "b"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Models this small run fastest on one thread (and far faster on a busy CI machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _compress(arch, finetune, **settings):
    cfg = DeltaZipConfig(n_samples=4, seq_len=16, **settings)
    return compress(matrix_model(arch), finetune, cfg, calibration=calibration_ids(n=4, length=16, vocab=MATRIX_VOCAB),
                    progress=False)


def _left_padded(lengths=(9, 6, 8), seed=11):
    """Prompts of different lengths, left-padded with 0, and their attention mask."""
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = calibration_ids(n=1, length=n, seed=seed + i, vocab=MATRIX_VOCAB - 3)[0] + 3
        mask[i, width - n:] = 1
    return ids, mask


@pytest.mark.parametrize("arch", MATRIX_ARCHS)
def test_mixed_batch_rows_equal_each_merged_model(arch, tmp_path):
    model = DeltaModel(copy.deepcopy(matrix_model(arch)))
    skip = EXPERTS if arch in MOE_ARCHS else []
    for i, (name, settings) in enumerate(SETTINGS.items()):
        _compress(arch, matrix_finetune(arch, i + 1), skip_modules=skip, **settings).save_pretrained(tmp_path / name)
        model.load_delta(tmp_path / name, delta_name=name)
    refs = {None: matrix_model(arch), **{n: model.merge_and_unload(n) for n in SETTINGS}}

    ids = calibration_ids(n=3, length=10, seed=7, vocab=MATRIX_VOCAB)
    with torch.no_grad():
        mixed = model(input_ids=ids, delta_names=ROWS).logits
        for i, name in enumerate(ROWS):
            # bit for bit the merged model's row, batched one of two ways: alone (a MoE layer's expert
            # batches depend on how the other rows route), or in the same batch (some dense models, e.g.
            # Falcon in transformers 5.24, give a row other last bits in a batch of 3 than alone)
            alone = refs[name](input_ids=ids[i : i + 1]).logits[0]
            batched = refs[name](input_ids=ids).logits[i]
            exact = torch.equal(mixed[i], alone) or torch.equal(mixed[i], batched)
            if arch in MOE_ARCHS and not exact:
                # how transformers groups tokens per expert (and so the summation order) depends on the other
                # rows' routing and on its expert implementation: a fresh install (2026-12-02) gave qwen2_moe
                # rows 4e-9 away from both references, no delta involved in the difference. A row routed
                # through the wrong delta is off by 1e-2 and more.
                torch.testing.assert_close(mixed[i], alone, rtol=1e-5, atol=1e-6)
            else:
                assert exact, (arch, name, (mixed[i] - alone).abs().max(), (mixed[i] - batched).abs().max())
            # the delta matters: the same row through the base differs
            assert name is None or not torch.equal(alone, refs[None](input_ids=ids[i : i + 1]).logits[0])
        # the merged models are the fine-tunes up to the compression error
        ft = matrix_finetune(arch, 2)(input_ids=ids[2:]).logits[0]
        assert (refs["b"](input_ids=ids[2:]).logits[0] - ft).abs().max() < 0.05 * ft.abs().max(), arch

    ids, mask = _left_padded()
    new = 6
    out = model.generate(ids, attention_mask=mask, delta_names=ROWS, max_new_tokens=new, do_sample=False, pad_token_id=0)
    for i, name in enumerate(ROWS):
        ref = refs[name].generate(ids[i : i + 1], attention_mask=mask[i : i + 1], max_new_tokens=new,
                                  do_sample=False, pad_token_id=0)[0]
        # a row that stopped at EOS before the others is padded in the batch
        assert torch.equal(out[i, : ref.shape[0]], ref), (arch, name, out[i], ref)
        assert bool((out[i, ref.shape[0]:] == 0).all()), (arch, name, out[i], ref)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_changed_fused_experts_are_refused_unless_skipped(arch):
    with pytest.raises(UnsupportedModelError, match=r"mlp\.experts\.gate_up_proj is a 3-D parameter .*"
                                                    r"Pass skip_modules=\['\*\.mlp\.experts'\]"):
        _compress(arch, matrix_finetune(arch, 1), bits=4, group_size=32)
    # experts the fine-tune left alone need nothing stored: no error, no expert tensors in the delta
    ft = copy.deepcopy(matrix_finetune(arch, 1))
    base = dict(matrix_model(arch).named_parameters())
    with torch.no_grad():
        for name, p in ft.named_parameters():
            if ".experts." in name:
                p.copy_(base[name])
    delta = _compress(arch, ft, bits=4, group_size=32)
    assert delta.params and not any(".experts." in n for n in delta.params)
    # skipped, they are stored exactly
    delta = _compress(arch, matrix_finetune(arch, 1), bits=4, group_size=32, skip_modules=EXPERTS)
    stored = {n: t for n, t in delta.params.items() if ".experts." in n}
    assert stored and all(torch.equal(t, matrix_finetune(arch, 1).get_parameter(n)) for n, t in stored.items())


@pytest.mark.parametrize("arch", ["gpt2", "opt"])
def test_calibration_longer_than_the_context_is_clamped(arch, caplog):
    """Learned positions end at the context: the default seq_len=512 is cut to it, with a warning."""
    base = matrix_model(arch, max_position_embeddings=32)
    ft = copy.deepcopy(base)
    with torch.no_grad():
        for p in ft.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.01)
    stream = calibration_ids(n=1, length=200, vocab=MATRIX_VOCAB)[0]
    with caplog.at_level(logging.WARNING, logger="hf_deltazip"):
        delta = compress(base, ft, DeltaZipConfig(n_samples=4, group_size=32), calibration=stream, progress=False)
    assert "seq_len=512 tokens are longer than the model's context of 32 positions" in caplog.text
    assert "DeltaZipConfig(seq_len=32)" in caplog.text
    assert delta.header["extra"]["calibration_tokens"] == 4 * 32
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_deltazip"):  # a seq_len that fits: used as it is, no warning
        delta = compress(base, ft, DeltaZipConfig(n_samples=4, seq_len=24, group_size=32), calibration=stream,
                         progress=False)
    assert delta.header["extra"]["calibration_tokens"] == 4 * 24 and "context" not in caplog.text

"""The consistency recipe end to end on a tiny pair: trajectories, training, a compressed delta, a report."""

import copy
import functools

import pytest
import torch

from hf_deltazip import DeltaModel, DeltaZipConfig, DeltaZipError
from hf_deltazip.cllm import (ConsistencyConfig, Trajectory, collect_trajectories, consistency_delta, mean_nll,
                              train_consistency)
from hf_deltazip.decoding import jacobi_generate

from model_factory import matrix_model

CYCLE = 120


def counting_ids(n, length, seed):
    """Rows counting up from a random start: 3, 4, ..., 122, 3, ..."""
    start = torch.randint(0, CYCLE, (n, 1), generator=torch.Generator().manual_seed(seed))
    return 3 + (start + torch.arange(length)) % CYCLE


@functools.lru_cache(maxsize=None)
def counting_finetune():
    """The base llama fine-tuned to count: a clear task gain, and about one token per Jacobi step."""
    model = copy.deepcopy(matrix_model("llama"))
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for step in range(40):
        ids = counting_ids(16, 20, seed=step)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def test_trajectories_end_at_the_greedy_output_and_start_every_block_on_it():
    ft = counting_finetune()
    prompts = counting_ids(2, 4, seed=1)
    trajectories = collect_trajectories(ft, prompts, block_size=6, max_new_tokens=12, pad_token_id=0)
    for prompt, t in zip(prompts, trajectories):
        greedy = ft.generate(prompt[None], do_sample=False, max_new_tokens=12, pad_token_id=0)[0, 4:].tolist()
        assert t.prompt == prompt.tolist() and t.output == greedy
        assert t.blocks and all(block[0] == t.output[start] and len(block) == 6 for start, block in t.blocks)


def test_consistency_delta_accepts_more_tokens_per_forward_and_keeps_greedy_output(tmp_path):
    base, ft = matrix_model("llama"), counting_finetune()
    prompts = counting_ids(2, 4, seed=500)
    config = ConsistencyConfig(block_size=8, max_new_tokens=16, steps=35, batch_size=8, lr=6e-3, consistency_weight=2.0,
                               lr_schedule="constant", warmup_steps=0)
    report = consistency_delta(base, ft, prompts, eval_ids=counting_ids(4, 20, seed=900), config=config,
                               delta_config=DeltaZipConfig(bits=8, group_size=32, seq_len=24), output_dir=tmp_path,
                               pad_token_id=0)
    assert report.tpf_finetune < 1.2
    assert report.tpf_consistency > report.tpf_finetune + 0.3, report.summary()
    assert report.tpf_delta > report.tpf_finetune + 0.3, report.summary()
    # gain kept is measured for the model and its 8-bit delta, which loses little of it
    assert report.nll_finetune < report.nll_base and abs(report.gain_kept_delta - report.gain_kept) < 0.1, report.summary()
    assert "tokens per forward" in report.summary() and set(report.as_dict()) >= {"gain_kept", "tpf_delta"}
    # what was saved loads back: the delta on the base decodes exactly as the in-memory one
    dm = DeltaModel.from_pretrained(tmp_path / "delta", base=copy.deepcopy(base))
    ids = prompts[:1]
    ref = dm.generate(ids, do_sample=False, max_new_tokens=10, pad_token_id=0)
    assert torch.equal(dm.generate(ids, decoding="jacobi", jacobi_block_size=8, max_new_tokens=10, pad_token_id=0), ref)
    assert abs(mean_nll(dm, counting_ids(4, 20, seed=900)) - report.nll_delta) < 1e-4
    assert (tmp_path / "model" / "config.json").exists()

    # the trained model accepts several tokens in one step: an end-of-sequence token among them ends the row there
    student, prompt = report.model, prompts[:1]
    run = jacobi_generate(student, prompt, block_size=8, max_new_tokens=16, pad_token_id=0, min_accept=None,
                          return_dict_in_generate=True, record_trajectories=True)
    starts = [start for _, start, _ in run.stats.trajectories] + [run.stats.new_tokens[0] - 1]
    first = next(s for s, nxt in zip(starts, starts[1:]) if nxt - s >= 2)  # a step that accepted 2+ tokens
    eos = int(run.sequences[0, 4 + first + 1])  # the first of them
    ref = student.generate(prompt, do_sample=False, max_new_tokens=16, pad_token_id=0, eos_token_id=eos)
    out = jacobi_generate(student, prompt, block_size=8, max_new_tokens=16, pad_token_id=0, eos_token_id=eos,
                          min_accept=None)
    assert torch.equal(out, ref) and out.shape[1] == 4 + first + 2


def test_bad_settings_and_empty_trajectories_are_refused():
    with pytest.raises(DeltaZipError, match="block_size"):
        ConsistencyConfig(block_size=1)
    with pytest.raises(DeltaZipError, match="steps"):
        ConsistencyConfig(steps=0)
    with pytest.raises(DeltaZipError, match="no Jacobi block"):
        train_consistency(matrix_model("llama"), [Trajectory([5, 6], [7], [])])
    with pytest.raises(DeltaZipError, match="prompts"):
        collect_trajectories(matrix_model("llama"), [[]])


def test_learning_rate_schedules_warm_up_then_hold_or_fall_to_zero(monkeypatch):
    """lr_factor: a linear warm-up, then 1 (constant) or a half cosine that ends near zero; train_consistency
    steps the optimizer at exactly those rates."""
    from hf_deltazip.cllm import lr_factor

    const = ConsistencyConfig(steps=10, lr_schedule="constant", warmup_steps=3)
    assert [round(lr_factor(const, s), 4) for s in range(10)] == [0.25, 0.5, 0.75] + [1.0] * 7
    cos = ConsistencyConfig(steps=200, lr_schedule="cosine", warmup_steps=20)
    f = [lr_factor(cos, s) for s in range(200)]
    assert f[19] < f[20] and f[20] > 0.99 and f[-1] < 1e-3
    assert all(a >= b for a, b in zip(f[20:], f[21:]))

    seen = []
    real_step = torch.optim.AdamW.step

    def spy(self, *a, **k):
        seen.append(self.param_groups[0]["lr"])
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", spy)
    ft = counting_finetune()
    traj = collect_trajectories(ft, counting_ids(2, 4, seed=3), block_size=4, max_new_tokens=8, pad_token_id=0)
    cfg = ConsistencyConfig(block_size=4, max_new_tokens=8, steps=5, batch_size=2, lr=1e-3, lr_schedule="cosine",
                            warmup_steps=1)
    train_consistency(ft, traj, cfg)
    assert seen == pytest.approx([1e-3 * lr_factor(cfg, s) for s in range(5)])


def test_default_config_is_the_measured_recipe():
    """The defaults are the recipe BENCHMARKS.md section 9 measured: cosine to zero, peak 2e-5, batches of 16, 200
    steps, a tenth of them warming up; a shorter run keeps a tenth as warm-up instead of being refused."""
    cfg = ConsistencyConfig()
    assert (cfg.lr_schedule, cfg.lr, cfg.batch_size, cfg.steps, cfg.warmup_steps) == ("cosine", 2e-5, 16, 200, 20)
    assert ConsistencyConfig(steps=10).warmup_steps == 1
    assert ConsistencyConfig(steps=5).warmup_steps == 0


def test_bad_schedules_are_refused():
    with pytest.raises(DeltaZipError, match="lr_schedule"):
        ConsistencyConfig(lr_schedule="linear")
    with pytest.raises(DeltaZipError, match="warmup_steps"):
        ConsistencyConfig(steps=10, warmup_steps=10)


def test_distilled_autoregressive_loss_is_zero_for_the_teacher_itself_and_trains():
    """ar_loss="distill": KL from the fine-tune's own distribution at the labelled positions: exactly zero for
    an identical copy, positive for another model; a short run with it still raises tokens per forward."""
    from hf_deltazip.cllm import _distill_loss, _examples, tokens_per_forward

    ft = counting_finetune()
    traj = collect_trajectories(ft, counting_ids(2, 4, seed=7), block_size=6, max_new_tokens=12, pad_token_id=0)
    _, ar = _examples(traj)
    assert _distill_loss(copy.deepcopy(ft), ft, ar, 0).item() == pytest.approx(0.0, abs=1e-6)
    assert _distill_loss(matrix_model("llama"), ft, ar, 0).item() > 0.1
    with pytest.raises(DeltaZipError, match="ar_loss"):
        ConsistencyConfig(ar_loss="kl")

    prompts = counting_ids(2, 4, seed=500)
    traj = collect_trajectories(ft, prompts, block_size=8, max_new_tokens=16, pad_token_id=0)
    ft.train()  # the teacher runs in eval mode during training and gets its mode back
    cfg = ConsistencyConfig(block_size=8, max_new_tokens=16, steps=35, batch_size=8, lr=6e-3, consistency_weight=2.0,
                            lr_schedule="constant", warmup_steps=0, ar_loss="distill")
    student = train_consistency(ft, traj, cfg, pad_token_id=0)
    assert ft.training
    ft.eval()
    before = tokens_per_forward(ft, prompts, block_size=8, max_new_tokens=16, pad_token_id=0)
    after = tokens_per_forward(student, prompts, block_size=8, max_new_tokens=16, pad_token_id=0)
    assert after > before + 0.3, (before, after)

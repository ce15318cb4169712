"""Progress bars: ours show when asked (and can be turned off); other libraries' are silenced by the demo."""

import huggingface_hub.utils as hub_utils
import torch
import transformers
import transformers.utils.logging as hf_logging

from hf_deltazip.bench import pairs
from hf_deltazip.delta import CompressedDelta
from hf_deltazip.bench.demo import quiet_other_libraries

from dz_factory import small_delta
from model_factory import VOCAB, base_model


def _save_and_load_a_model(tmp_path):
    base_model("llama").save_pretrained(tmp_path)
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path)


def test_quiet_other_libraries_silences_transformers_and_restores_its_state(tmp_path, capfd):
    _save_and_load_a_model(tmp_path / "loud")
    assert "Loading weights" in capfd.readouterr().err  # transformers shows bars by default
    verbosity = hf_logging.get_verbosity()
    with quiet_other_libraries():
        assert not hf_logging.is_progress_bar_enabled() and hub_utils.are_progress_bars_disabled()
        _save_and_load_a_model(tmp_path / "quiet")
        hf_logging.get_logger("transformers").warning("a warning nobody asked for")
    assert capfd.readouterr().err == ""
    assert hf_logging.is_progress_bar_enabled() and not hub_utils.are_progress_bars_disabled()
    assert hf_logging.get_verbosity() == verbosity


def test_quiet_other_libraries_keeps_bars_off_that_were_off():
    hub_utils.disable_progress_bars()
    try:
        with quiet_other_libraries():
            pass
        assert hub_utils.are_progress_bars_disabled()
    finally:
        hub_utils.enable_progress_bars()


def _batches(steps):
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (2, 8), generator=gen)
        yield ids, torch.ones_like(ids), torch.ones(2, 8)


def test_training_shows_a_bar_unless_turned_off(capsys):
    model = pairs.tiny_model("llama", VOCAB, hidden_size=32, num_layers=1)
    pairs._train(model, _batches(3), 3, 1e-3, 0.0, torch.device("cpu"), lambda _: None, "base", progress=True)
    err = capsys.readouterr().err
    assert "training base" in err and "/3" in err and "loss=" in err  # tqdm redraws at most every 0.1 s
    pairs._train(model, _batches(3), 3, 1e-3, 0.0, torch.device("cpu"), lambda _: None, "base", progress=False)
    assert capsys.readouterr().err == ""


def test_reading_a_delta_shows_a_bar_unless_turned_off(tmp_path, capsys):
    small_delta().save_pretrained(tmp_path / "d")
    CompressedDelta.from_pretrained(tmp_path / "d", progress=True)
    assert "reading d" in capsys.readouterr().err
    CompressedDelta.from_pretrained(tmp_path / "d", progress=False)
    assert capsys.readouterr().err == ""

"""Deltas, modules and configs show themselves briefly (repr) and as tables (notebooks); a delta read
back from disk has the summary it was saved with."""

import dataclasses
import json
import re

import pytest

from hf_deltazip import DeltaZipConfig, compress
from hf_deltazip.config import CONFIG_NAME
from hf_deltazip.delta import BYTE_CATEGORIES, CompressedDelta, delta_bytes_report
from hf_deltazip.display import delta_table_html, format_bytes
from hf_deltazip.format import DZ_FILENAME, DeltaZipFile

from dz_factory import small_delta
from model_factory import base_model, calibration_ids, finetune

TENSOR_DUMP = re.compile(r"tensor\(|\[\[|dtype=torch")


@pytest.fixture(scope="module")
def compressed():
    config = DeltaZipConfig(bits=3, sparsity="2:4", group_size=32, n_samples=8, seq_len=24)
    return compress(base_model("llama"), finetune("llama", 1), config, calibration=calibration_ids(), progress=False)


def test_config_repr_names_the_main_and_the_changed_settings_only():
    assert repr(DeltaZipConfig()) == "DeltaZipConfig(bits=4, sparsity=None, group_size=128)"
    config = DeltaZipConfig(bits=2, sparsity="2:4", group_size=-1, seed=3, overrides={"*.lm_head": {"bits": 4}})
    text = repr(config)
    assert text == ("DeltaZipConfig(bits=2, sparsity='2:4', group_size=-1, overrides={'*.lm_head': {'bits': 4}}, "
                    "seed=3)")
    assert eval(text, {"DeltaZipConfig": DeltaZipConfig}) == config


def test_config_html_lists_every_setting_and_marks_the_changed_ones():
    page = DeltaZipConfig(bits=2)._repr_html_()
    assert page.count("<tr>") == 1 + len(dataclasses.fields(DeltaZipConfig))  # header row + one per field
    assert "<td>bits</td><td>2</td><td>changed</td>" in page
    assert "<td>group_size</td><td>128</td><td></td>" in page
    assert "Bits per kept delta weight" in page


def test_packed_module_repr_is_one_short_line(compressed):
    name = "model.layers.0.mlp.up_proj"
    mod = compressed.modules[name]
    text = repr(mod)
    assert "\n" not in text and len(text) < 120 and not TENSOR_DUMP.search(text)
    n, k = mod.shape
    assert text == f"PackedModule(linear [{n}, {k}], 3-bit, group 32, symmetric, 2:4, {format_bytes(mod.nbytes)})"
    page = mod._repr_html_()
    for role, t in mod.tensors().items():
        assert f"<td>{role}</td><td>uint8</td>" in page or f"<td>{role}</td><td>float" in page
        assert f">{t.numel() * t.element_size()}</td>" in page


def test_delta_repr_is_short_and_shows_settings_bytes_and_ratio(compressed):
    text = repr(compressed)
    assert len(text) < 1000, len(text)
    assert not TENSOR_DUMP.search(text)
    assert "DeltaZipConfig(bits=3, sparsity='2:4', group_size=32" in text
    s = compressed.summary
    total = s["packed_bytes"] + s["exact_param_bytes"]
    assert f"{format_bytes(total)} in memory" in text
    assert f"{s['ratio_before_zstd']:.2f}x before zstd" in text
    errors = s["relative_error"]
    worst = max(errors, key=errors.get)
    assert f"worst {errors[worst]:.4g} ({worst})" in text
    assert f"{len(compressed.modules)} modules, {len(compressed.params)} exact parameters" in text


def test_delta_html_has_a_table_of_bytes_by_category(compressed):
    page = compressed._repr_html_()
    cats = compressed.bytes_by_category()
    assert list(cats) == list(BYTE_CATEGORIES)
    assert sum(cats.values()) == compressed.summary["packed_bytes"] + compressed.summary["exact_param_bytes"]
    assert cats["masks"] > 0 and cats["embeddings and head"] > 0  # 2:4 positions; quantized embeddings
    assert "<caption>bytes by category (in memory)</caption>" in page
    for cat, n in cats.items():
        assert f"<td>{cat}</td><td style=\"text-align:right\">{n}</td>" in page
    assert "<td>sparsity</td><td>&#x27;2:4&#x27;</td>" in page
    assert "before zstd" in page and "tensor(" not in page


def test_summary_survives_a_save_and_load(compressed, tmp_path):
    timings = ("seconds", "steps", "layers")  # not saved: the same inputs give the same file
    before = {k: v for k, v in compressed.summary.items() if k not in ("stored_bytes", "ratio", *timings)}
    assert set(before["relative_error"]) == set(compressed.modules)
    assert before["modules"]["model.layers.1.self_attn.q_proj"]["sparsity"] == "2:4"
    compressed.save_pretrained(tmp_path)
    again = CompressedDelta.from_pretrained(tmp_path)
    for key, value in before.items():
        assert again.summary[key] == value, key  # per-module errors and layouts, bytes and device
    assert not set(timings) & set(again.summary)
    on_disk = (tmp_path / DZ_FILENAME).stat().st_size + (tmp_path / CONFIG_NAME).stat().st_size
    assert again.summary["stored_bytes"] == compressed.summary["stored_bytes"] == on_disk
    assert again.summary["ratio"] == pytest.approx(delta_bytes_report(tmp_path)["ratio"])
    assert f"{again.summary['ratio']:.2f}x on disk" in repr(again)


def test_a_file_without_saved_errors_still_gets_a_summary(tmp_path):
    delta = small_delta()
    delta.save_pretrained(tmp_path)
    with DeltaZipFile(tmp_path / DZ_FILENAME) as dz:
        assert "summary" not in dz.header["extra"]  # nothing the compressor measured: nothing stored
    again = CompressedDelta.from_pretrained(tmp_path)
    assert again.summary["relative_error"] == {}
    assert again.summary["modules"] == {name: mod.info() for name, mod in delta.modules.items()}
    assert again.summary["modules"]["model.layers.0.mlp.down_proj"]["sparsity"] == "bitmask"
    assert "error" not in repr(again)


def test_saving_keeps_the_caller_header_unchanged(compressed, tmp_path):
    extra = json.dumps(compressed.header["extra"], sort_keys=True)
    compressed.save_pretrained(tmp_path)
    assert json.dumps(compressed.header["extra"], sort_keys=True) == extra


def test_delta_table_html_escapes_and_aligns():
    page = delta_table_html([{"delta": "<b>", "bits": 4, "where": None}], caption="loaded deltas")
    assert page.startswith("<table><caption>loaded deltas</caption><thead><tr><th>delta</th><th>bits</th>")
    assert "<td>&lt;b&gt;</td>" in page and '<td style="text-align:right">4</td>' in page and "<td>-</td>" in page

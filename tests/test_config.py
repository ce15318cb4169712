import json

import pytest

from hf_deltazip import DeltaZipConfig, DeltaZipConfigError
from hf_deltazip.config import CONFIG_NAME


def test_defaults_and_round_trip(tmp_path):
    config = DeltaZipConfig(bits=2, sparsity="2:4", group_size=64, overrides={"*.lm_head": {"bits": 8}})
    path = config.save_pretrained(tmp_path)
    assert path.name == CONFIG_NAME
    again = DeltaZipConfig.from_pretrained(tmp_path)
    assert again == config
    assert json.loads(path.read_text())["format_version"] == 1


def test_fraction_sparsity_round_trips(tmp_path):
    config = DeltaZipConfig(sparsity=0.5, group_size=-1, symmetric=False)
    config.save_pretrained(tmp_path)
    assert DeltaZipConfig.from_pretrained(tmp_path / CONFIG_NAME) == config


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"bits": 5}, "bits must be one of [2, 3, 4, 8]"),
        ({"bits": True}, "bits must be one of"),
        ({"sparsity": "1:4"}, '"2:4"'),
        ({"sparsity": 1.0}, "fraction"),
        ({"group_size": 100}, "power of two from 32 to 1024"),
        ({"group_size": 2048}, "power of two"),
        ({"damp": 0}, "damp"),
        ({"block_size": 0}, "block_size must be a positive integer"),
        ({"embeddings": "fp8"}, "embeddings must be one of ['quantize', 'exact']"),
        ({"zstd_level": 30}, "zstd_level"),
        ({"target_modules": "q_proj"}, "glob patterns"),
        ({"overrides": {"*.q_proj": {"bits": 7}}}, "overrides['*.q_proj'].bits"),
        ({"overrides": {"*.q_proj": {"colour": 1}}}, "unknown settings ['colour']"),
        ({"format_version": 99}, "upgrade hf-deltazip"),
    ],
)
def test_invalid_values_name_the_allowed_ones(kwargs, fragment):
    with pytest.raises(DeltaZipConfigError) as err:
        DeltaZipConfig(**kwargs)
    assert fragment in str(err.value)


def test_unknown_keys_warn_and_are_ignored(tmp_path):
    data = DeltaZipConfig().to_dict()
    data["future_knob"] = 3
    (tmp_path / CONFIG_NAME).write_text(json.dumps(data))
    with pytest.warns(UserWarning, match="future_knob"):
        config = DeltaZipConfig.from_pretrained(tmp_path)
    assert config == DeltaZipConfig()


def test_overrides_resolve_in_order():
    config = DeltaZipConfig(
        bits=2, overrides={"*.mlp.*": {"bits": 4, "group_size": 64}, "*.down_proj": {"bits": 8}}
    )
    assert config.for_module("model.layers.0.self_attn.q_proj").bits == 2
    up = config.for_module("model.layers.0.mlp.up_proj")
    assert (up.bits, up.group_size) == (4, 64)
    down = config.for_module("model.layers.0.mlp.down_proj")
    assert (down.bits, down.group_size) == (8, 64)


def test_target_and_skip_patterns():
    config = DeltaZipConfig(target_modules=["*.mlp.*"], skip_modules=["*.layers.1.*"])
    assert config.is_target("model.layers.0.mlp.up_proj") is True
    assert config.is_target("model.layers.0.self_attn.q_proj") is False
    assert config.is_target("model.layers.1.mlp.up_proj") is False
    assert DeltaZipConfig().is_target("anything") is None


def test_missing_and_corrupt_config_files(tmp_path):
    with pytest.raises(DeltaZipConfigError, match="not found"):
        DeltaZipConfig.from_pretrained(tmp_path)
    (tmp_path / CONFIG_NAME).write_text("{not json")
    with pytest.raises(DeltaZipConfigError, match="not valid JSON"):
        DeltaZipConfig.from_pretrained(tmp_path)

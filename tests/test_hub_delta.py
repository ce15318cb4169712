"""Real deltas through the test Hub: push_to_hub, deltazip push, DeltaModel.from_pretrained by repo id."""

import copy
import uuid

import torch
from huggingface_hub import HfApi, ModelCard

from hf_deltazip import DeltaModel, DeltaZipConfig, compress
from hf_deltazip.cli import main
from hf_deltazip.delta import resolve_recorded_base

from model_factory import base_model, calibration_ids, finetune


def make_delta(seed=1):
    cfg = DeltaZipConfig(bits=4, group_size=32, n_samples=4, seq_len=16)
    return compress(base_model("llama"), finetune("llama", seed), cfg, calibration=calibration_ids(n=4, length=16), progress=False)


def test_push_to_hub_then_load_by_repo_id(hub_server, tmp_path):
    repo = f"tester/tiny-delta-{uuid.uuid4().hex[:8]}"
    delta = make_delta()
    first = delta.push_to_hub(repo, token=hub_server.token, quality={"gain_kept": 0.97})
    files = set(HfApi().list_repo_files(repo, token=hub_server.token))
    assert {"deltazip_config.json", "delta.dz", "README.md"} <= files
    card = ModelCard.load(repo, token=hub_server.token)
    assert card.data.library_name == "hf-deltazip" and "DeltaModel.from_pretrained" in card.text

    cache = tmp_path / "cache"
    local = tmp_path / "local"
    delta.save_pretrained(local)
    ids = calibration_ids(n=2, length=8, seed=4)
    by_id = DeltaModel.from_pretrained(repo, base=copy.deepcopy(base_model("llama")), token=hub_server.token, cache_dir=cache)
    by_path = DeltaModel.from_pretrained(local, base=copy.deepcopy(base_model("llama")))
    with torch.no_grad():
        assert torch.equal(by_id(input_ids=ids, delta_names=["default", None]).logits,
                           by_path(input_ids=ids, delta_names=["default", None]).logits)

    # a second push moves main; a load pinned to the first commit still gets the first delta
    make_delta(seed=2).push_to_hub(repo, token=hub_server.token)
    pinned = DeltaModel(copy.deepcopy(base_model("llama")))
    pinned.load_delta(repo, delta_name="v1", revision=first.oid, token=hub_server.token, cache_dir=cache)
    pinned.load_delta(repo, delta_name="v2", token=hub_server.token, cache_dir=cache)
    with torch.no_grad():
        v1 = pinned(input_ids=ids, delta_names=["v1", "v1"]).logits
        v2 = pinned(input_ids=ids, delta_names=["v2", "v2"]).logits
        assert torch.equal(v1, by_path(input_ids=ids, delta_names=["default", "default"]).logits)
        assert not torch.equal(v1, v2)


def test_a_hub_base_is_recorded_by_repo_id_and_commit(hub_server, tmp_path):
    repo = f"tester/tiny-base-{uuid.uuid4().hex[:8]}"
    base_model("llama").save_pretrained(tmp_path / "base")
    api = HfApi()
    api.create_repo(repo, token=hub_server.token)
    commit = api.upload_folder(folder_path=tmp_path / "base", repo_id=repo, token=hub_server.token).oid
    cfg = DeltaZipConfig(bits=4, group_size=32)
    delta = compress(repo, finetune("llama", 1), cfg, calibration=None, progress=False, token=hub_server.token,
                     cache_dir=tmp_path / "cache")
    assert (delta.header["base_model"], delta.header["base_source"]) == (repo, "hub")
    assert delta.header["base_revision"] == commit
    assert resolve_recorded_base(delta.header) == repo


def test_cli_push_leaves_the_folder_as_it_was(hub_server, tmp_path, capsys):
    folder = tmp_path / "d"
    make_delta().save_pretrained(folder)
    before = sorted(p.name for p in folder.iterdir())
    repo = f"tester/cli-delta-{uuid.uuid4().hex[:8]}"
    assert main(["push", str(folder), repo, "--token", hub_server.token]) == 0
    assert "commit" in capsys.readouterr().out
    assert sorted(p.name for p in folder.iterdir()) == before  # the card went to a staging copy
    assert "README.md" in HfApi().list_repo_files(repo, token=hub_server.token)
    assert main(["push", str(tmp_path), repo, "--token", hub_server.token]) == 2
    assert "deltazip_config.json" in capsys.readouterr().err

"""Push, pull and model cards, with the real huggingface_hub client against the local test Hub.

The Hub is ``tests/hub_server.py``, started by the ``hub_server`` fixture of ``conftest.py`` on the
``HF_ENDPOINT`` that conftest sets before huggingface_hub is imported.
"""

import json
import os
import re
import uuid
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import CommitOperationAdd, HfApi, ModelCard
from huggingface_hub import constants as hf_constants

from hf_deltazip.errors import DeltaZipError, DeltaZipFormatError, HubError
from hf_deltazip.hub import (
    DeltaFileMissingError,
    HubConnectionError,
    HubOfflineError,
    HubPermissionError,
    HubRepoNotFoundError,
    HubRevisionNotFoundError,
    NotADeltaFolderError,
    NotADeltaRepoError,
    download_delta,
    render_model_card,
    upload_delta_folder,
)

REPO_ROOT = Path(__file__).resolve().parent.parent

CARD_DATA = {
    "repo_id": "tester/chat-delta",
    "base_model": "tester/tiny-base",
    "base_revision": "0123456789abcdef0123456789abcdef01234567",
    "finetuned_model": "tester/tiny-chat",
    "bits": 2,
    "sparsity": "2:4",
    "group_size": 128,
    "total_bytes": 5_123_456,
    "ratio": 9.87,
    "library_version": "0.1.0",
}


# --- helpers ------------------------------------------------------------------------------------
def make_delta_folder(path: Path, seed: int = 0, **extra_files: bytes) -> Path:
    """A fake delta: an empty config, a few KB of random bytes as delta.dz, a model card."""
    path.mkdir(parents=True)
    (path / "deltazip_config.json").write_text("{}")
    (path / "delta.dz").write_bytes(os.urandom(4096 + seed))
    render_model_card(CARD_DATA).save(path / "README.md")
    for name, content in extra_files.items():
        (path / name).write_bytes(content)
    return path


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def push_raw_files(hub, repo_id: str, files: dict[str, bytes]) -> str:
    """Make a repo that hf-deltazip did not write, with the plain client."""
    api = HfApi()
    api.create_repo(repo_id, token=hub.token)
    operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=data) for name, data in files.items()]
    return api.create_commit(repo_id, operations, commit_message="raw files", token=hub.token).oid


@pytest.fixture
def repo_id():
    return f"tester/delta-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def delta_folder(tmp_path):
    return make_delta_folder(tmp_path / "delta")


@pytest.fixture
def cache_dir(tmp_path):
    return tmp_path / "cache"


@pytest.fixture
def go_offline(monkeypatch):
    """Call to switch huggingface_hub to offline mode for the rest of the test.

    huggingface_hub reads HF_HUB_OFFLINE once, at import, into ``huggingface_hub.constants``. Versions
    1.x and 2.x consult ``constants.HF_HUB_OFFLINE`` on every request, so patching it is what setting
    the variable before import would have done; 0.x bakes it into its per-thread HTTP sessions, which
    ``reset_sessions`` rebuilds.
    """
    from huggingface_hub import utils as hf_utils

    reset_sessions = getattr(hf_utils, "reset_sessions", lambda: None)

    def switch():
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
        reset_sessions()

    yield switch
    reset_sessions()  # sessions made from now on see the constant that monkeypatch restores


# --- push and pull ------------------------------------------------------------------------------
def test_push_then_pull_into_a_fresh_cache_gives_the_same_bytes(hub_server, delta_folder, repo_id, cache_dir):
    info = upload_delta_folder(delta_folder, repo_id, token=hub_server.token, commit_message="First delta")

    assert re.fullmatch(r"[0-9a-f]{40}", info.oid)
    assert info.oid == hub_server.branch_sha(repo_id)
    assert info.commit_url.endswith(f"/{repo_id}/commit/{info.oid}")

    folder = download_delta(repo_id, cache_dir=cache_dir)
    assert folder.name == info.oid and cache_dir in folder.parents
    assert folder_bytes(folder) == folder_bytes(delta_folder)
    assert ModelCard.load(folder / "README.md").data.library_name == "hf-deltazip"


def test_a_second_push_moves_main_but_not_a_pinned_download(hub_server, tmp_path, repo_id, cache_dir):
    first_folder = make_delta_folder(tmp_path / "v1", seed=1)
    second_folder = make_delta_folder(tmp_path / "v2", seed=2)
    first = upload_delta_folder(first_folder, repo_id, token=hub_server.token)
    pinned = download_delta(repo_id, revision=first.oid, cache_dir=cache_dir)

    second = upload_delta_folder(second_folder, repo_id, token=hub_server.token)

    assert second.oid != first.oid and hub_server.branch_sha(repo_id) == second.oid
    assert folder_bytes(download_delta(repo_id, revision=first.oid, cache_dir=cache_dir)) == folder_bytes(first_folder)
    assert folder_bytes(pinned) == folder_bytes(first_folder)
    assert folder_bytes(download_delta(repo_id, cache_dir=cache_dir)) == folder_bytes(second_folder)


def test_pushing_an_unchanged_folder_makes_no_new_commit(hub_server, delta_folder, repo_id):
    first = upload_delta_folder(delta_folder, repo_id, token=hub_server.token)
    again = upload_delta_folder(delta_folder, repo_id, token=hub_server.token)
    assert again.oid == first.oid == hub_server.branch_sha(repo_id)


def test_push_to_a_new_branch_and_as_a_pull_request(hub_server, tmp_path, repo_id, cache_dir):
    main_folder = make_delta_folder(tmp_path / "main", seed=1)
    branch_folder = make_delta_folder(tmp_path / "branch", seed=2)
    pr_folder = make_delta_folder(tmp_path / "pr", seed=3)
    main = upload_delta_folder(main_folder, repo_id, token=hub_server.token)

    on_branch = upload_delta_folder(branch_folder, repo_id, revision="int4-experiment", token=hub_server.token)
    pr = upload_delta_folder(pr_folder, repo_id, create_pr=True, token=hub_server.token)

    assert hub_server.branch_sha(repo_id, "int4-experiment") == on_branch.oid
    assert hub_server.branch_sha(repo_id) == main.oid  # neither touched main
    assert pr.pr_url is not None and pr.pr_revision == "refs/pr/1"
    branch_copy = download_delta(repo_id, revision="int4-experiment", cache_dir=cache_dir)
    assert folder_bytes(branch_copy) == folder_bytes(branch_folder)
    assert folder_bytes(download_delta(repo_id, revision=pr.oid, cache_dir=cache_dir)) == folder_bytes(pr_folder)


def test_pushing_to_a_commit_sha_is_refused(hub_server, delta_folder, repo_id):
    with pytest.raises(HubError, match="branch name"):
        upload_delta_folder(delta_folder, repo_id, revision="a" * 40, token=hub_server.token)


def test_download_fetches_only_what_a_delta_needs(hub_server, tmp_path, repo_id, cache_dir):
    folder = make_delta_folder(
        tmp_path / "delta", **{"tokenizer_config.json": b"{}", "optimizer.pt": os.urandom(64)}
    )
    upload_delta_folder(folder, repo_id, token=hub_server.token)

    files = folder_bytes(download_delta(repo_id, cache_dir=cache_dir))

    assert set(files) == {"deltazip_config.json", "delta.dz", "README.md", "tokenizer_config.json"}


def test_a_download_cut_off_midway_is_retried_and_intact(hub_server, delta_folder, repo_id, cache_dir):
    if int(huggingface_hub.__version__.split(".")[0]) < 1:
        pytest.skip("huggingface_hub < 1.0 does not retry a download cut off midway")
    upload_delta_folder(delta_folder, repo_id, token=hub_server.token)
    hub_server.interrupt_download("delta.dz", after_bytes=1000)
    seen = len(hub_server.requests)

    folder = download_delta(repo_id, cache_dir=cache_dir)  # huggingface_hub waits 1 s, then retries

    assert (folder / "delta.dz").read_bytes() == (delta_folder / "delta.dz").read_bytes()
    gets = [r for r in hub_server.requests[seen:] if r.path.endswith("/delta.dz") and r.method == "GET"]
    assert len(gets) == 2


def test_the_test_hub_serves_byte_ranges(hub_server, delta_folder, repo_id):
    """What a client resuming a download asks for (huggingface_hub sends ``Range: bytes=N-``)."""
    import urllib.request

    info = upload_delta_folder(delta_folder, repo_id, token=hub_server.token)
    content = (delta_folder / "delta.dz").read_bytes()
    url = f"{hub_server.url}/{repo_id}/resolve/{info.oid}/delta.dz"
    request = urllib.request.Request(url, headers={"Range": "bytes=1000-"})
    with urllib.request.urlopen(request) as response:
        assert response.status == 206
        assert response.headers["Content-Range"] == f"bytes 1000-{len(content) - 1}/{len(content)}"
        assert response.headers["X-Repo-Commit"] == info.oid
        assert response.read() == content[1000:]


def test_a_local_folder_is_returned_as_it_is(delta_folder):
    assert download_delta(delta_folder) == delta_folder
    assert download_delta(str(delta_folder)) == delta_folder
    with pytest.raises(NotADeltaFolderError, match="a file, not a folder"):
        download_delta(delta_folder / "delta.dz")


# --- offline ------------------------------------------------------------------------------------
def test_offline_download_is_served_from_the_cache(hub_server, delta_folder, repo_id, cache_dir, go_offline):
    info = upload_delta_folder(delta_folder, repo_id, token=hub_server.token)
    online = download_delta(repo_id, cache_dir=cache_dir)
    go_offline()
    seen = len(hub_server.requests)

    assert download_delta(repo_id, cache_dir=cache_dir) == online
    assert download_delta(repo_id, revision=info.oid, cache_dir=cache_dir) == online
    assert download_delta(repo_id, cache_dir=cache_dir, local_files_only=True) == online
    assert hub_server.requests[seen:] == []  # not a single request


def test_offline_download_of_an_uncached_delta_says_how_to_fix_it(hub_server, delta_folder, repo_id, cache_dir,
                                                                   go_offline):
    upload_delta_folder(delta_folder, repo_id, token=hub_server.token)
    go_offline()
    with pytest.raises(HubOfflineError, match="run once online or unset HF_HUB_OFFLINE"):
        download_delta(repo_id, cache_dir=cache_dir)


def test_local_files_only_without_a_cached_copy_fails_clearly(hub_server, delta_folder, repo_id, cache_dir):
    upload_delta_folder(delta_folder, repo_id, token=hub_server.token)
    with pytest.raises(HubOfflineError, match="local_files_only=True"):
        download_delta(repo_id, cache_dir=cache_dir, local_files_only=True)


def test_an_unreachable_hub_without_a_cached_copy_fails_clearly(hub_server, repo_id, cache_dir, monkeypatch):
    import socket

    with socket.socket() as sock:  # a port that nothing listens on
        sock.bind(("127.0.0.1", 0))
        dead_endpoint = f"http://127.0.0.1:{sock.getsockname()[1]}"
    monkeypatch.setattr(hf_constants, "ENDPOINT", dead_endpoint)

    with pytest.raises(HubConnectionError, match="Cannot reach the Hub") as caught:
        download_delta(repo_id, cache_dir=cache_dir)
    assert dead_endpoint in str(caught.value)


# --- what can go wrong --------------------------------------------------------------------------
def test_a_missing_repo_names_the_fix(hub_server, cache_dir):
    with pytest.raises(HubRepoNotFoundError, match=r"check the name, or pass token= for a private repo"):
        download_delta("tester/no-such-delta", cache_dir=cache_dir)


def test_a_string_that_is_neither_a_folder_nor_a_repo_id(tmp_path, cache_dir):
    with pytest.raises(HubRepoNotFoundError, match="neither an existing local folder nor a valid Hub repo id"):
        download_delta(str(tmp_path / "not" / "there"), cache_dir=cache_dir)


@pytest.mark.parametrize("revision", ["no-such-branch", "0" * 40])
def test_a_missing_revision(hub_server, delta_folder, repo_id, cache_dir, revision):
    upload_delta_folder(delta_folder, repo_id, token=hub_server.token)
    with pytest.raises(HubRevisionNotFoundError, match=f"Revision '{revision}' not found"):
        download_delta(repo_id, revision=revision, cache_dir=cache_dir)


def test_a_repo_that_is_not_a_delta(hub_server, repo_id, cache_dir):
    push_raw_files(hub_server, repo_id, {"config.json": b"{}", "model.safetensors": b"\0" * 64})
    with pytest.raises(NotADeltaRepoError, match="has no deltazip_config.json: it is not an hf-deltazip delta"):
        download_delta(repo_id, cache_dir=cache_dir)


def test_a_delta_repo_without_its_dz_file(hub_server, repo_id, cache_dir):
    push_raw_files(hub_server, repo_id, {"deltazip_config.json": b"{}"})
    with pytest.raises(DeltaFileMissingError, match="no .dz file") as caught:
        download_delta(repo_id, cache_dir=cache_dir)
    assert not isinstance(caught.value, NotADeltaRepoError)


def test_a_private_repo_is_invisible_without_the_right_token(hub_server, delta_folder, repo_id, tmp_path):
    upload_delta_folder(delta_folder, repo_id, private=True, token=hub_server.token)
    stranger = hub_server.add_user(f"stranger-{uuid.uuid4().hex[:6]}")

    with pytest.raises(HubRepoNotFoundError, match="pass token="):
        download_delta(repo_id, cache_dir=tmp_path / "anonymous")
    with pytest.raises(HubRepoNotFoundError):
        download_delta(repo_id, token=stranger, cache_dir=tmp_path / "stranger")
    folder = download_delta(repo_id, token=hub_server.token, cache_dir=tmp_path / "owner")
    assert folder_bytes(folder) == folder_bytes(delta_folder)


def test_a_push_without_write_access_is_refused(hub_server, delta_folder, repo_id):
    stranger = hub_server.add_user(f"stranger-{uuid.uuid4().hex[:6]}")
    with pytest.raises(HubPermissionError, match="token"):
        upload_delta_folder(delta_folder, repo_id)  # no token at all
    with pytest.raises(HubPermissionError, match="write access"):
        upload_delta_folder(delta_folder, repo_id, token=stranger)  # someone else's namespace


@pytest.mark.parametrize(
    "files, problem",
    [
        (None, "not a folder"),
        ({"delta.dz": b"\0"}, "no deltazip_config.json"),
        ({"deltazip_config.json": b"{}", "README.md": b"hi"}, "no .dz file"),
    ],
)
def test_pushing_a_folder_that_is_not_a_delta_is_refused(tmp_path, files, problem):
    folder = tmp_path / "folder"
    if files is not None:
        folder.mkdir()
        for name, data in files.items():
            (folder / name).write_bytes(data)
    with pytest.raises(NotADeltaFolderError, match=problem) as caught:
        upload_delta_folder(folder, "tester/never-created", token="unused")
    assert isinstance(caught.value, HubError) and isinstance(caught.value, DeltaZipFormatError)
    assert isinstance(caught.value, DeltaZipError)


# --- model card ---------------------------------------------------------------------------------
def test_the_model_card_has_valid_front_matter_and_a_usage_snippet(tmp_path):
    card = render_model_card(CARD_DATA)
    card.save(tmp_path / "README.md")
    loaded = ModelCard.load(tmp_path / "README.md")

    assert loaded.data.base_model == "tester/tiny-base"
    assert loaded.data.library_name == "hf-deltazip"
    assert {"hf-deltazip", "delta-compression", "2-bit"} <= set(loaded.data.tags)
    body = loaded.text
    assert "from hf_deltazip import DeltaModel" in body
    assert 'model = DeltaModel.from_pretrained("tester/chat-delta", base="tester/tiny-base")' in body
    assert "model.generate(" in body
    assert "2:4" in body and "128" in body and "9.9×" in body and "5,123,456 bytes" in body
    assert "Quality was not measured" in body


def test_the_usage_snippet_is_valid_python(tmp_path):
    body = render_model_card(CARD_DATA).text
    snippet = re.search(r"```python\n(.*?)```", body, re.S).group(1)
    compile(snippet, "README.md", "exec")


def test_the_model_card_shows_quality_figures_when_given():
    card = render_model_card({**CARD_DATA, "bits": 4, "sparsity": 0.5, "quality": {"gain_kept": 0.9312, "kl": 0.0123}})
    assert "4-bit" in card.data.tags and "sparse" in card.data.tags
    assert "| Gain kept | 0.9312 |" in card.text
    assert "0.0123" in card.text
    assert "not measured" not in card.text
    assert "50%" in card.text


def test_a_card_without_repo_id_or_base_is_refused():
    with pytest.raises(HubError, match="base_model"):
        render_model_card({"repo_id": "tester/x"})


def test_the_template_is_the_one_in_model_cards():
    assert (REPO_ROOT / "model_cards" / "delta_card.md").is_file()
    custom = render_model_card(CARD_DATA, template_path=REPO_ROOT / "model_cards" / "delta_card.md")
    assert str(custom) == str(render_model_card(CARD_DATA))
    assert json.loads(json.dumps(custom.data.to_dict()))["library_name"] == "hf-deltazip"

"""Push and pull hf-deltazip deltas on the Hugging Face Hub, and write their model cards.

A delta folder holds ``deltazip_config.json``, one or more ``.dz`` files, optionally the fine-tune's
tokenizer files and ``generation_config.json``, and a ``README.md`` model card. This module moves such
folders to and from the Hub through ``huggingface_hub`` (its cache, resumable downloads, revision
pinning and offline mode all apply) and turns every failure into a :class:`~hf_deltazip.errors.HubError`
whose message names the fix.

* :func:`upload_delta_folder` pushes a folder as one commit.
* :func:`download_delta` returns a local folder for a Hub repo id (or a local path).
* :func:`render_model_card` fills ``model_cards/delta_card.md``.

The Hub endpoint comes from ``HF_ENDPOINT``, read by ``huggingface_hub`` when it is imported.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from huggingface_hub import (
    CommitInfo,
    CommitOperationAdd,
    HfApi,
    ModelCard,
    ModelCardData,
    snapshot_download,
    try_to_load_from_cache,
)
from huggingface_hub import constants as hf_constants
from huggingface_hub import errors as hf_errors

from .errors import DeltaZipFormatError, HubError

__all__ = [
    "DELTA_CONFIG_NAME",
    "DELTA_FILE_PATTERNS",
    "DeltaFileMissingError",
    "HubConnectionError",
    "HubOfflineError",
    "HubPermissionError",
    "HubRepoNotFoundError",
    "HubRevisionNotFoundError",
    "NotADeltaFolderError",
    "NotADeltaRepoError",
    "default_card_template",
    "download_delta",
    "render_model_card",
    "upload_delta_folder",
]

#: The file that marks a folder (or a Hub repo) as an hf-deltazip delta.
DELTA_CONFIG_NAME = "deltazip_config.json"

#: What :func:`download_delta` fetches: the config, the ``.dz`` files, the model card, and what the
#: fine-tune may carry beside its weights (tokenizer files, generation settings).
DELTA_FILE_PATTERNS: tuple[str, ...] = (
    DELTA_CONFIG_NAME,
    "*.dz",
    "README.md",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "*.tiktoken",
    "chat_template.jinja",
    "chat_template.json",
)

#: Never uploaded: version-control folders and the metadata ``huggingface_hub`` keeps in a local dir.
_SKIPPED_PARTS = frozenset({".git", ".cache", "__pycache__", ".DS_Store"})

#: Where the card template may be: inside the installed package (pyproject maps model_cards/ to
#: hf_deltazip.model_cards), or at the root of a source checkout.
_CARD_TEMPLATE_CANDIDATES = (
    Path(__file__).resolve().parent / "model_cards" / "delta_card.md",
    Path(__file__).resolve().parent.parent / "model_cards" / "delta_card.md",
)

_COMMIT_SHA = re.compile(r"[0-9a-f]{40}")


# --- errors -------------------------------------------------------------------------------------
class HubRepoNotFoundError(HubError):
    """The repository does not exist, or it is private and the token cannot see it."""


class HubRevisionNotFoundError(HubError):
    """The repository exists but has no such branch, tag or commit."""


class DeltaFileMissingError(HubError):
    """A file that a delta needs is not in the repository at this revision."""


class NotADeltaRepoError(DeltaFileMissingError):
    """The repository has no ``deltazip_config.json``: it is not an hf-deltazip delta."""


class NotADeltaFolderError(DeltaZipFormatError, HubError):
    """A local folder given to :func:`upload_delta_folder` is not a delta folder."""


class HubOfflineError(HubError):
    """Offline (``HF_HUB_OFFLINE=1`` or ``local_files_only=True``) and the delta is not in the cache."""


class HubConnectionError(HubError):
    """The Hub cannot be reached and the delta is not in the cache."""


class HubPermissionError(HubError):
    """The Hub refused the token: missing, invalid, without write access, or the repo is gated."""


# --- push ---------------------------------------------------------------------------------------
def upload_delta_folder(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool | None = None,
    revision: str | None = None,
    commit_message: str | None = None,
    token: str | bool | None = None,
    create_pr: bool = False,
) -> CommitInfo:
    """Upload a delta folder to a Hub model repo, as one commit.

    The repo is created if it does not exist, and the branch ``revision`` if it is given and missing
    (starting from ``main``). Every file of the folder is uploaded, subfolders included, except
    ``.git``, ``.cache`` and ``__pycache__``; symbolic links are followed, so a folder returned by
    :func:`download_delta` can be pushed again. Files identical to the ones already in the repo are
    skipped by ``huggingface_hub``; when nothing changed, no commit is made and the returned info
    points at the current head.

    Args:
        folder: the delta folder: it must hold ``deltazip_config.json`` and at least one ``.dz`` file.
        repo_id: ``"namespace/name"``; a bare ``"name"`` goes under the token's user.
        private: make a new repo private (``None``: the Hub's default). Ignored if the repo exists.
        revision: the branch to commit to (default ``main``); created from ``main`` if missing.
            Must be a branch name, not a commit sha.
        commit_message: the commit title (default ``"Upload hf-deltazip delta"``).
        token: a Hub token with write access; ``None`` uses the saved login or ``HF_TOKEN``.
        create_pr: open a pull request against ``revision`` instead of committing to it.

    Returns:
        The :class:`huggingface_hub.CommitInfo` of the commit: ``.oid`` is its sha (pin downloads
        to it), ``.commit_url`` its page, ``.pr_url`` the pull request when ``create_pr=True``.

    Raises:
        NotADeltaFolderError: ``folder`` is not a folder, or lacks ``deltazip_config.json`` or a
            ``.dz`` file.
        HubPermissionError: no token, an invalid one, or one without write access to the namespace.
        HubRepoNotFoundError: the repo is private and the token cannot see it.
        HubConnectionError / HubOfflineError: the Hub cannot be reached, or offline mode is on.
        HubError: any other refusal from the Hub (the message carries the Hub's reason).

    Example:
        >>> from hf_deltazip.hub import upload_delta_folder
        >>> info = upload_delta_folder("out/llama-chat-delta", "me/llama-chat-delta", private=True)
        >>> info.oid  # the commit sha, to pin downloads with download_delta(..., revision=info.oid)
        '3c2f25d61e6be8973d3f5c704c63598ef4f08035'
    """
    folder = Path(folder).expanduser()
    files = _delta_folder_files(folder)
    if revision is not None and _COMMIT_SHA.fullmatch(revision):
        raise HubError(
            f"revision={revision!r} is a commit sha, but a push needs a branch name: pass a branch "
            "(it is created if missing), or leave revision=None to push to main."
        )
    api = HfApi(library_name="hf-deltazip", library_version=_library_version())
    try:
        repo_url = api.create_repo(repo_id, private=private, exist_ok=True, token=token)
        repo_id = getattr(repo_url, "repo_id", None) or repo_id
        if revision is not None and revision != hf_constants.DEFAULT_REVISION:
            api.create_branch(repo_id, branch=revision, exist_ok=True, token=token)
        operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(path)) for name, path in files]
        # create_commit, not upload_folder: newer upload_folder may split a folder into several commits.
        return api.create_commit(
            repo_id,
            operations,
            commit_message=commit_message or "Upload hf-deltazip delta",
            revision=revision,
            create_pr=create_pr,
            token=token,
        )
    except Exception as err:
        mapped = _hub_error(err, repo_id=repo_id, revision=revision, pushing=True)
        if mapped is None:
            raise
        raise mapped from err


def _delta_folder_files(folder: Path) -> list[tuple[str, Path]]:
    """The files of a delta folder as ``(path in repo, local path)``, after checking it is one."""
    if not folder.is_dir():
        raise NotADeltaFolderError(folder, "not a folder: pass the folder that save_pretrained wrote")
    if not (folder / DELTA_CONFIG_NAME).is_file():
        raise NotADeltaFolderError(
            folder, f"no {DELTA_CONFIG_NAME}: this is not an hf-deltazip delta folder (write one with save_pretrained)"
        )
    files = []
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if _SKIPPED_PARTS.intersection(relative.parts) or not path.is_file():
            continue
        files.append((relative.as_posix(), path))
    if not any(name.endswith(".dz") for name, _ in files):
        raise NotADeltaFolderError(
            folder, "no .dz file: the delta weights are missing (save the delta again with save_pretrained)"
        )
    return files


# --- pull ---------------------------------------------------------------------------------------
def download_delta(
    repo_id_or_path: str | os.PathLike,
    *,
    revision: str | None = None,
    token: str | bool | None = None,
    cache_dir: str | os.PathLike | None = None,
    local_files_only: bool | None = None,
) -> Path:
    """Return a local folder holding a delta, downloading it from the Hub if needed.

    An existing local folder is returned as it is (its content is checked when it is loaded).
    Anything else is a Hub repo id, fetched with ``huggingface_hub.snapshot_download`` into its
    cache: only the files a delta needs (:data:`DELTA_FILE_PATTERNS`) are downloaded, files already
    cached are not fetched again, a transfer cut off midway is retried (resumed with a ``Range`` request
    where the client can), a commit sha pins the exact version, and with ``HF_HUB_OFFLINE=1`` (or
    ``local_files_only=True``) the cached copy is used without any network call. When the Hub cannot
    be reached, a cached copy is used if there is one.

    Args:
        repo_id_or_path: a local delta folder, or a Hub repo id such as ``"org/llama-chat-delta"``.
        revision: a branch, tag or commit sha (default ``main``). Ignored for a local folder.
        token: a Hub token for private repos; ``None`` uses the saved login or ``HF_TOKEN``.
        cache_dir: the ``huggingface_hub`` cache to use (default ``HF_HUB_CACHE``).
        local_files_only: ``True`` to use only the cache; ``None``/``False`` to go online when possible.

    Returns:
        The local folder (in the cache, a snapshot named after the commit sha). Treat it as read-only.

    Raises:
        HubRepoNotFoundError: no such repo, or it is private and ``token`` cannot see it, or the
            string is neither a folder nor a valid repo id.
        NotADeltaFolderError: the string names a local file rather than a folder.
        HubRevisionNotFoundError: the repo has no such branch, tag or commit.
        NotADeltaRepoError: the repo has no ``deltazip_config.json``.
        DeltaFileMissingError: the repo has a config but no ``.dz`` file.
        HubOfflineError: offline and the delta (at this revision) is not cached.
        HubConnectionError: the Hub cannot be reached and the delta is not cached.
        HubPermissionError: the repo is gated, or the token was refused.
        HubError: any other failure of the Hub.

    Example:
        >>> from hf_deltazip.hub import download_delta
        >>> folder = download_delta("org/llama-chat-delta", revision="3c2f25d61e6be8973d3f5c704c63598ef4f08035")
        >>> sorted(p.name for p in folder.iterdir())
        ['README.md', 'delta.dz', 'deltazip_config.json']
    """
    local = Path(repo_id_or_path).expanduser()
    if local.is_dir():
        return local
    if local.is_file():
        raise NotADeltaFolderError(local, "a file, not a folder: pass the delta folder that holds it")
    repo_id = str(repo_id_or_path)
    try:
        snapshot = snapshot_download(
            repo_id,
            revision=revision,
            token=token,
            cache_dir=cache_dir,
            local_files_only=bool(local_files_only),
            allow_patterns=list(DELTA_FILE_PATTERNS),
            library_name="hf-deltazip",
            library_version=_library_version(),
        )
    except Exception as err:
        mapped = _hub_error(err, repo_id=repo_id, revision=revision, local_files_only=bool(local_files_only))
        if mapped is None:
            raise
        raise mapped from err
    folder = Path(snapshot)
    where = f"{repo_id!r} (revision {revision or 'main'!r})"
    if not (folder / DELTA_CONFIG_NAME).is_file():
        raise NotADeltaRepoError(
            f"{where} has no {DELTA_CONFIG_NAME}: it is not an hf-deltazip delta. Check the repo id and "
            "revision; a delta is pushed with CompressedDelta.push_to_hub or `deltazip push`."
        )
    if not any(folder.rglob("*.dz")):
        raise DeltaFileMissingError(
            f"{where} has {DELTA_CONFIG_NAME} but no .dz file: the delta weights are missing. Push the "
            "complete delta folder again, or pick a revision that has them."
        )
    return folder


def cached_commit(
    repo_id: str, revision: str | None = None, *, cache_dir: str | os.PathLike | None = None
) -> str | None:
    """The commit sha that a model just loaded from the Hub as ``repo_id`` at ``revision`` came from.

    Read from ``huggingface_hub``'s cache (which maps branches and tags to the commit last fetched),
    without a network call. ``None`` when the cache does not know it.
    """
    if revision is not None and _COMMIT_SHA.fullmatch(revision):
        return revision
    try:
        path = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache_dir, revision=revision)
    except (hf_errors.HFValidationError, OSError, ValueError):
        return None
    if not isinstance(path, str):
        return None
    commit = Path(path).parent.name
    return commit if _COMMIT_SHA.fullmatch(commit) else None


# --- model card ---------------------------------------------------------------------------------
_QUALITY_LABELS = {
    "gain_kept": "Gain kept",
    "token_agreement": "Greedy-token agreement with the fine-tune",
    "kl": "KL(fine-tune ‖ compressed)",
    "nll_base": "Mean token NLL, base",
    "nll_finetune": "Mean token NLL, fine-tune",
    "nll_compressed": "Mean token NLL, compressed",
}


def render_model_card(card_data: Mapping[str, Any], template_path: str | os.PathLike | None = None) -> ModelCard:
    """Fill the delta model card template.

    The card's YAML front matter holds ``base_model``, ``library_name: hf-deltazip``,
    ``pipeline_tag: text-generation`` and tags (``hf-deltazip``, ``delta-compression``, ``<bits>-bit``,
    ``sparse`` when pruned). The body says what the delta is, its compression settings, its size and
    compression ratio, its quality figures (or that they were not measured), and how to load it.

    Args:
        card_data: the facts to show. Keys:

            * ``repo_id`` (required): where the delta lives, e.g. ``"org/llama-chat-delta"``.
            * ``base_model`` (required): the base model's repo id.
            * ``base_revision``: the base commit the delta was made against.
            * ``finetuned_model``: the fine-tune the delta rebuilds.
            * ``bits`` (int), ``sparsity`` (``"2:4"``, a fraction pruned such as ``0.5``, or ``0``/None),
              ``group_size`` (int, or None for one scale per output row).
            * ``total_bytes`` (int): bytes needed to rebuild the fine-tune from the base.
            * ``ratio`` (float): 16-bit bytes of the fine-tune / ``total_bytes``.
            * ``quality`` (dict, optional): metric name -> value, e.g. ``{"gain_kept": 0.93}``.
            * ``library_version``: the hf-deltazip version that wrote the delta (default: this one).
            * optional extras: ``license``, ``description`` (a paragraph about the fine-tune),
              ``tokenizer`` (where the usage snippet loads the tokenizer from; default ``base_model``).

            Every key is also passed to the template as a variable.
        template_path: a Jinja template to use instead of ``model_cards/delta_card.md``.

    Returns:
        A :class:`huggingface_hub.ModelCard`; ``card.save(folder / "README.md")`` writes it.

    Raises:
        HubError: ``repo_id`` or ``base_model`` is missing, or the template cannot be found.

    Example:
        >>> card = render_model_card({"repo_id": "me/chat-delta", "base_model": "me/base", "bits": 2,
        ...                           "sparsity": "2:4", "group_size": 128, "total_bytes": 51_200_000,
        ...                           "ratio": 9.8})
        >>> card.data.library_name
        'hf-deltazip'
        >>> card.save("out/chat-delta/README.md")
    """
    missing = [key for key in ("repo_id", "base_model") if not card_data.get(key)]
    if missing:
        raise HubError(f"card_data lacks {', '.join(missing)}: the model card needs the delta's repo id and its base")
    template = Path(template_path) if template_path is not None else default_card_template()
    if not template.is_file():
        raise HubError(f"Model card template not found: {template}. Pass template_path= to a Jinja markdown file.")

    facts = dict(card_data)
    repo_id, base_model = str(facts["repo_id"]), str(facts["base_model"])
    bits, sparsity, group_size = facts.get("bits"), facts.get("sparsity"), facts.get("group_size")
    tags = ["hf-deltazip", "delta-compression"]
    if bits:
        tags.append(f"{int(bits)}-bit")
    if sparsity not in (None, 0, 0.0, "", "none", "dense"):
        tags.append("sparse")
    metadata = ModelCardData(
        base_model=base_model,
        library_name="hf-deltazip",
        pipeline_tag="text-generation",
        tags=tags,
        license=facts.get("license"),
    )
    quality = facts.get("quality") or {}
    variables = {
        **facts,
        "repo_id": repo_id,
        "repo_name": repo_id.rstrip("/").rsplit("/", 1)[-1],
        "base_model": base_model,
        "base_revision": facts.get("base_revision"),
        "finetuned_model": facts.get("finetuned_model"),
        "description": facts.get("description"),
        "tokenizer": facts.get("tokenizer") or base_model,
        "bits_text": f"{int(bits)} bits per weight" if bits else "not recorded",
        "sparsity_text": _describe_sparsity(sparsity),
        "group_size_text": _describe_group_size(group_size),
        "size_text": _describe_bytes(facts.get("total_bytes")),
        "ratio_text": f"{float(facts['ratio']):.1f}×" if facts.get("ratio") else "not recorded",
        "quality_rows": [(_QUALITY_LABELS.get(str(k), str(k)), _describe_number(v)) for k, v in quality.items()],
        "library_version": facts.get("library_version") or _library_version(),
    }
    # Variables take priority over the card data's own keys of the same name (base_model, tags...).
    return ModelCard.from_template(metadata, template_path=str(template), **variables)


def default_card_template() -> Path:
    """The path of ``delta_card.md``, the template :func:`render_model_card` uses by default."""
    for candidate in _CARD_TEMPLATE_CANDIDATES:
        if candidate.is_file():
            return candidate
    try:  # an install layout that the candidates above do not cover (e.g. an editable install)
        from importlib.resources import files

        resource = files("hf_deltazip.model_cards") / "delta_card.md"
        if resource.is_file():
            return Path(str(resource))
    except (ImportError, TypeError, OSError):
        pass
    return _CARD_TEMPLATE_CANDIDATES[0]


def _describe_sparsity(sparsity: Any) -> str:
    if sparsity in (None, 0, 0.0, "", "none", "dense"):
        return "none (dense)"
    if isinstance(sparsity, str):
        if sparsity.startswith("lowrank:"):
            return f"low-rank, {sparsity.split(':', 1)[1]} bits per weight"
        return f"{sparsity} structured" if ":" in sparsity else sparsity
    value = float(sparsity)
    fraction = value if value <= 1 else value / 100
    return f"{fraction:.0%} of the delta's weights pruned (unstructured)"


def _describe_group_size(group_size: Any) -> str:
    if group_size in (None, 0, -1):
        return "one scale per output row"
    return f"{int(group_size)} inputs per scale"


def _describe_bytes(total: Any) -> str:
    if not total:
        return "not recorded"
    total = int(total)
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if total >= size:
            return f"{total / size:.2f} {unit} ({total:,} bytes)"
    return f"{total:,} bytes"


def _describe_number(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


# --- helpers ------------------------------------------------------------------------------------
def _library_version() -> str:
    from ._version import __version__

    return __version__


def _offline_mode() -> bool:
    is_offline = getattr(hf_constants, "is_offline_mode", None)
    return bool(is_offline() if callable(is_offline) else getattr(hf_constants, "HF_HUB_OFFLINE", False))


def _is_network_error(err: BaseException) -> bool:
    """A transport failure (refused, reset, timed out), whichever HTTP library the client uses."""
    if isinstance(err, (ConnectionError, TimeoutError)):
        return True
    return any(
        cls.__module__.split(".")[0] in ("httpx", "httpx2", "httpcore", "requests", "urllib3")
        and cls.__name__
        in ("TransportError", "NetworkError", "TimeoutException", "ConnectionError", "Timeout", "ChunkedEncodingError")
        for cls in type(err).__mro__
    )


def _causes(err: BaseException):
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def _hub_error(
    err: Exception,
    *,
    repo_id: str,
    revision: str | None,
    pushing: bool = False,
    local_files_only: bool = False,
) -> HubError | None:
    """Translate a ``huggingface_hub`` (or transport) failure into a HubError that names the fix.

    Returns None for an error that is not about the Hub, which the caller re-raises untouched.
    """
    endpoint = hf_constants.ENDPOINT
    where = f"{repo_id!r}" + (f" (revision {revision!r})" if revision else "")
    remote_entry_missing = getattr(hf_errors, "RemoteEntryNotFoundError", hf_errors.EntryNotFoundError)

    if isinstance(err, HubError):
        return err
    if isinstance(err, hf_errors.LocalEntryNotFoundError):
        # snapshot_download could not reach the Hub (or was told not to) and the cache has no copy.
        causes = (c for c in _causes(err) if not isinstance(c, hf_errors.LocalEntryNotFoundError))
        cause = next(causes, None)
        if isinstance(cause, hf_errors.OfflineModeIsEnabled) or _offline_mode():
            return HubOfflineError(
                f"{where} is not in the local cache and offline mode is on (HF_HUB_OFFLINE=1): "
                "run once online or unset HF_HUB_OFFLINE."
            )
        if local_files_only or cause is None:
            return HubOfflineError(
                f"{where} is not in the local cache and local_files_only=True: run once online "
                "(local_files_only=False) to cache it."
            )
        if isinstance(cause, hf_errors.HfHubHTTPError):
            status = getattr(getattr(cause, "response", None), "status_code", "an error")
            return HubError(
                f"The Hub at {endpoint} answered {status} for {where} and it is not in the local cache: "
                f"try again later. ({cause})"
            )
        return HubConnectionError(
            f"Cannot reach the Hub at {endpoint} ({type(cause).__name__}) and {where} is not in the local "
            "cache: check your network connection (or HF_ENDPOINT), or run once online to cache it."
        )
    if isinstance(err, hf_errors.OfflineModeIsEnabled):
        return HubOfflineError(
            f"Cannot {'push' if pushing else 'download'} {where}: offline mode is on (HF_HUB_OFFLINE=1). "
            "Unset HF_HUB_OFFLINE to reach the Hub."
        )
    if isinstance(err, hf_errors.GatedRepoError):
        return HubPermissionError(
            f"{where} is gated: accept its access conditions on the Hub, then pass token= of that account."
        )
    if isinstance(err, hf_errors.RepositoryNotFoundError):
        also = "" if pushing else " (and there is no local folder of that name)"
        return HubRepoNotFoundError(
            f"Repository {repo_id!r} not found on {endpoint}{also}: check the name, or pass token= for a "
            "private repo."
        )
    if isinstance(err, hf_errors.RevisionNotFoundError):
        return HubRevisionNotFoundError(
            f"Revision {revision or 'main'!r} not found in {repo_id!r}: check the branch, tag or commit sha "
            f"(HfApi().list_repo_refs({repo_id!r}) lists the branches)."
        )
    if isinstance(err, remote_entry_missing):
        return DeltaFileMissingError(f"A file is missing from {where}: {err}")
    if isinstance(err, hf_errors.HFValidationError):
        if pushing:
            return HubError(f"{repo_id!r} is not a valid repo id: use 'namespace/name'. ({err})")
        return HubRepoNotFoundError(
            f"{repo_id!r} is neither an existing local folder nor a valid Hub repo id ('namespace/name'): "
            "check the path, or the name."
        )
    if isinstance(err, hf_errors.HfHubHTTPError):
        status = getattr(getattr(err, "response", None), "status_code", None)
        server_message = getattr(err, "server_message", None) or str(err).strip().splitlines()[0]
        if status == 401:
            return HubPermissionError(
                f"The Hub refused the token for {where} (401 {server_message}): pass token= with a valid "
                "token, or log in with `hf auth login`."
            )
        if status == 403:
            return HubPermissionError(
                f"The token cannot {'write to' if pushing else 'read'} {where} (403 {server_message}): use a "
                "token with write access to that namespace."
            )
        return HubError(f"The Hub at {endpoint} failed on {where} ({status}): {server_message}")
    if _is_network_error(err):
        return HubConnectionError(
            f"Cannot reach the Hub at {endpoint} ({type(err).__name__}: {err}): check your network "
            "connection (or HF_ENDPOINT)."
        )
    return None


# --- push with a generated card -----------------------------------------------------------------
def delta_card_data(folder: str | os.PathLike, repo_id: str, quality: Mapping[str, Any] | None = None) -> dict:
    """The facts :func:`render_model_card` shows, read from a saved delta folder."""
    from .format.folder import delta_bytes_report, load_folder_config

    report = delta_bytes_report(folder)
    header = report["header"]
    config = load_folder_config(folder, header)  # the card shows what the .dz holds, never a contradicting JSON
    return {
        "repo_id": repo_id,
        "base_model": header.base_model or "unknown",
        "base_revision": header.base_revision,
        "finetuned_model": header.finetuned_model,
        "bits": config.bits,
        "sparsity": config.sparsity,
        "group_size": None if config.group_size == -1 else config.group_size,
        "total_bytes": report["total_bytes"],
        "ratio": report["ratio"],
        "quality": dict(quality) if quality else None,
        "library_version": header.library_version,
    }


def push_delta_folder(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool | None = None,
    revision: str | None = None,
    commit_message: str | None = None,
    token: str | bool | None = None,
    create_pr: bool = False,
    quality: Mapping[str, Any] | None = None,
) -> CommitInfo:
    """Upload a delta folder with a generated model card (``README.md``) as one commit.

    The folder itself is not modified: the card is written into a staging copy (hard links where
    possible). A ``README.md`` already in the folder is uploaded as it is.

    Args:
        folder: a folder written by ``CompressedDelta.save_pretrained``.
        repo_id, private, revision, commit_message, token, create_pr: as :func:`upload_delta_folder`.
        quality: quality figures for the card (e.g. ``{"gain_kept": 0.96}``).

    Returns:
        The commit's :class:`huggingface_hub.CommitInfo`.

    Example:
        >>> push_delta_folder("out/chat-delta", "me/chat-delta", quality={"gain_kept": 0.97})
    """
    import shutil
    import tempfile

    folder = Path(folder).expanduser()
    _delta_folder_files(folder)
    with tempfile.TemporaryDirectory(prefix="deltazip-push-") as tmp:
        stage = Path(tmp) / "delta"
        shutil.copytree(folder, stage, copy_function=_link_or_copy)
        if not (stage / "README.md").exists():
            render_model_card(delta_card_data(folder, repo_id, quality)).save(stage / "README.md")
        return upload_delta_folder(stage, repo_id, private=private, revision=revision,
                                   commit_message=commit_message, token=token, create_pr=create_pr)


def _link_or_copy(src, dst):
    import shutil

    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst

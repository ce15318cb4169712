"""Shared pytest setup.

The Hub settings below must be in the environment before anything imports ``huggingface_hub`` or
``transformers``: both read them once, at import time. pytest imports this file before any test module.
"""

import atexit
import importlib
import os
import shutil
import socket
import sys
import tempfile
import warnings

import pytest

# --- a local Hub for every test (see tests/hub_server.py) -------------------------------------
with socket.socket() as _sock:
    _sock.bind(("127.0.0.1", 0))
    HUB_PORT = _sock.getsockname()[1]

_HF_HOME = tempfile.mkdtemp(prefix="hf-deltazip-tests-")
atexit.register(shutil.rmtree, _HF_HOME, ignore_errors=True)
os.environ.update(
    HF_ENDPOINT=f"http://127.0.0.1:{HUB_PORT}",
    HF_HOME=_HF_HOME,
    HF_HUB_CACHE=os.path.join(_HF_HOME, "hub"),
    HF_HUB_DISABLE_TELEMETRY="1",
    HF_HUB_DISABLE_XET="1",
)
for _name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.pop(_name, None)
if "huggingface_hub" in sys.modules:
    warnings.warn("huggingface_hub was imported before tests/conftest.py: it may not use the test Hub")

# `python -m pytest` from the repository root puts the root on sys.path, where kernels/ would hide the Hugging Face
# `kernels` package that transformers 5.25+ imports; importing hf_deltazip first takes the root off the path.
importlib.import_module("hf_deltazip")


@pytest.fixture(scope="session")
def hub_server():
    """The local Hub on ``HF_ENDPOINT``: ``.url``, ``.token`` (user ``tester``), ``.add_user(name)``."""
    try:
        from hub_server import HubServer  # tests/ on sys.path (pytest's default import mode)
    except ImportError:
        from tests.hub_server import HubServer

    with HubServer(port=HUB_PORT) as server:
        yield server

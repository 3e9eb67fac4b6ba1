"""One version, written once (`cosyvoice_triton.__version__`), read everywhere: the wheel's metadata
(pyproject.toml reads the attribute), `cosyvoice-triton --version`, and the gateway's `/readyz` and `/v1/models`
(the latter through the official `openai` client). CHANGELOG.md has a section for it."""
from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import cosyvoice_triton
from cosyvoice_triton.cli import main
from cosyvoice_triton.server import free_port
from cosyvoice_triton.targets import TritonTarget

REPO_ROOT = Path(__file__).resolve().parents[1]
VERSION = cosyvoice_triton.__version__


def test_the_version_is_semantic_and_pyproject_reads_it():
    assert re.fullmatch(r"\d+\.\d+\.\d+", VERSION)
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "cosyvoice_triton.__version__"}
    changelog = (REPO_ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in changelog and re.search(rf"^## \[{re.escape(VERSION)}\] - \d{{4}}-\d\d-\d\d$",
                                                         changelog, re.M)


def test_cosyvoice_triton_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"cosyvoice-triton {VERSION}"
    run = subprocess.run([sys.executable, "-m", "cosyvoice_triton.cli", "--version"], capture_output=True,
                         text=True, timeout=120, check=True)
    assert run.stdout.strip() == f"cosyvoice-triton {VERSION}"


def test_the_gateway_says_its_version_on_readyz_and_v1_models(tmp_path):
    """No Triton server is needed for either answer: /readyz says the version while it waits (503), and
    OpenAI's model list is static."""
    from openai import OpenAI

    from cosyvoice_triton.gateway.config import GatewayConfig
    from cosyvoice_triton.gateway.testing import GatewayThread

    nowhere = TritonTarget.parse(f"grpc://127.0.0.1:{free_port()}")  # nothing listens: never ready
    config = GatewayConfig(triton=(nowhere,), voice_store=str(tmp_path / "voices.sqlite"), home=tmp_path,
                           default_voice=False, shutdown_timeout_s=2.0)
    with GatewayThread(config) as gateway:
        status, body = gateway.get_json("/readyz")
        assert status == 503 and body["version"] == VERSION
        client = OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
        models = client.models.list()
        assert [m.id for m in models.data] == ["cosyvoice2"] and models.data[0].owned_by == "cosyvoice-triton"
        status, body = gateway.get_json("/v1/models")
        assert status == 200 and body["version"] == VERSION and body["data"][0]["version"] == VERSION

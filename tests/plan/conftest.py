"""Fixtures of the planners' tests: a checkpoint directory with Mixtral-8x7B's config.json alone, and a hardware
profile file of an H100 machine."""

import json

import pytest

from checks import H100, MIXTRAL_CONFIG


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral")
    (path / "config.json").write_text(json.dumps(MIXTRAL_CONFIG))
    return path


@pytest.fixture(scope="module")
def h100_json(tmp_path_factory):
    path = tmp_path_factory.mktemp("hw") / "h100.json"
    path.write_text(json.dumps(H100))
    return path

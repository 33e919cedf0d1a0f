"""Bake the template with cookiecutter's own API into temporary directories."""

from __future__ import annotations

from pathlib import Path

import pytest
from cookiecutter.main import cookiecutter

TEMPLATE = Path(__file__).resolve().parents[1]


def bake(output_dir: Path, **context) -> Path:
    """Bake with these answers (the rest default) and return the generated project's directory."""
    return Path(cookiecutter(str(TEMPLATE), no_input=True, extra_context=context, output_dir=str(output_dir)))


@pytest.fixture
def baker(tmp_path):
    return lambda **context: bake(tmp_path, **context)


@pytest.fixture(scope="session")
def default_project(tmp_path_factory) -> Path:
    """The default bake, shared by the tests that only read it."""
    return bake(tmp_path_factory.mktemp("default"))

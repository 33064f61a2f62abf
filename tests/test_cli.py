"""The `neuronlocal` command and the docs it keeps in sync."""

from __future__ import annotations

from pathlib import Path

from neuronlocal import cli
from neuronlocal.core.config import env_table_markdown


def test_info(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "trn2.3xlarge" in out and "24.0 GiB" in out


def test_demo(capsys):
    assert cli.main(["demo"]) == 0
    assert "neuron matches CPU" in capsys.readouterr().out


def test_readme_env_table_is_current():
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert env_table_markdown() in readme

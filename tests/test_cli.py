"""The `neuronlocal` command and the docs it keeps in sync."""

from __future__ import annotations

from pathlib import Path

import pytest

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


# ---- bad input: exit 2 and one line, for every command ----------------------------------------

_BAD_CONFIG = {"model_type": "llama", "num_attention_heads": 0, "hidden_size": 64,
               "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 100}


def _exit_and_output(argv: list[str], capsys) -> tuple[int, list[str]]:
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse's own exit
        code = int(e.code or 0)
    captured = capsys.readouterr()
    return code, [ln for ln in (captured.out + captured.err).splitlines() if ln.strip()]


@pytest.mark.parametrize("fields", [{"num_attention_heads": 0}, {"hidden_size": -64},
                                    {"num_hidden_layers": 1e400}, {"vocab_size": "many"},
                                    {"num_key_value_heads": 2**70}])
@pytest.mark.parametrize("command", ["check", "estimate"])
def test_a_config_with_impossible_sizes_is_bad_input(tmp_path, capsys, command, fields):
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**_BAD_CONFIG, "num_attention_heads": 4, **fields}))
    argv = ["check", "--config", str(path)] if command == "check" else ["estimate", str(path)]
    code, lines = _exit_and_output(argv, capsys)
    assert code == 2, lines
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    assert lines[0].startswith("error: ") and str(path) in lines[0], lines
    assert next(iter(fields)) in lines[0], lines


@pytest.mark.parametrize(("args", "needle"), [
    (["--price-per-hour", "-5"], "--price-per-hour"),
    (["--price-per-hour", "nan"], "--price-per-hour"),
    (["--price-per-hour", "inf"], "--price-per-hour"),
    (["--seq", "999999999999"], "--seq"),
    (["--seq", "0"], "--seq"),
    (["--global-batch", "0"], "--global-batch"),
    (["--batch", "-1"], "--batch"),
    (["--ctx", "-1"], "--ctx"),
    (["--tp", "0"], "--tp"),
    (["--nodes", "99999999999999999999"], "--nodes"),
    (["--instance", "trn1.32xlarge", "--lnc", "2"], "LNC=2"),
])
def test_estimate_options_out_of_range_are_one_line_exit_2(capsys, args, needle):
    code, lines = _exit_and_output(["estimate", "llama-3.1-8b", *args], capsys)
    assert code == 2, lines
    assert len(lines) == 1 and needle in lines[0], lines


@pytest.mark.parametrize("args", [["--jobs", "0"], ["--timeout", "nan"], ["--timeout", "-1"],
                                  ["--max-memory", "inf"], ["--task", "nope"]])
def test_support_options_out_of_range_are_one_line_exit_2(capsys, monkeypatch, args):
    from neuronlocal.support import matrix

    monkeypatch.setattr(matrix, "run_one", lambda *a, **k: pytest.fail("ran a model"))
    code, lines = _exit_and_output(["support", *args], capsys)
    assert code == 2, lines
    assert len(lines) == 1 and args[0] in lines[0], lines


@pytest.mark.parametrize("args", [["ops", "--list", "host"], ["info"], ["env"]])
def test_a_reader_that_closes_the_pipe_is_no_traceback(args):
    """`neuronlocal ops --list host | true`: the reader is gone before the output is; the
    command ends quietly with a shell's SIGPIPE status, as `ls | true` does."""
    import os
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)  # the reader went away
    r = subprocess.run([sys.executable, "-m", "neuronlocal", *args], stdout=write,
                       stderr=subprocess.PIPE, text=True, timeout=120)
    os.close(write)
    assert "Traceback" not in r.stderr and "BrokenPipeError" not in r.stderr, r.stderr
    assert r.returncode == 141


def test_a_model_the_estimate_cannot_build_is_one_short_line(capsys):
    """T5 is no causal LM: transformers' error lists every model type (3 KB); the command
    says it in one short line and exits 2."""
    assert cli.main(["estimate", "t5"]) == 2
    err = capsys.readouterr()
    lines = [ln for ln in (err.out + err.err).splitlines() if ln.strip()]
    assert len(lines) == 1 and len(lines[0]) < 400, lines
    assert "cannot run T5Config" in lines[0]


@pytest.mark.parametrize("command", [["estimate"], ["check", "--config"]])
def test_a_deeply_nested_config_is_one_line_exit_2(tmp_path, capsys, command):
    """A config.json nested 5000 deep (code walking it would hit the recursion limit) is
    refused as input, in one line."""
    cfg = tmp_path / "config.json"
    cfg.write_text('{"model_type": "llama", "x": ' + "[" * 5000 + "]" * 5000 + "}")
    assert cli.main([*command, str(cfg)]) == 2
    err = capsys.readouterr()
    lines = [ln for ln in (err.out + err.err).splitlines() if ln.strip()]
    assert len(lines) == 1 and "nested" in lines[0], lines

"""`moeserve tune`: its help, and the one-line errors it gives before timing anything (no GPU here: the search
itself is tests/kernels/test_autotune.py with a fake GPU, and test_gpu_autotune.py on one)."""

import pytest
import torch

from moeserve.cli import main


def test_tune_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["tune", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--tokens" in out and "--out" in out and "MOESERVE_TUNE" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error of a machine without CUDA")
def test_tune_without_a_gpu_says_so(expect_cli_error, tmp_path):
    expect_cli_error(["tune"], "needs a CUDA GPU")
    expect_cli_error(["tune", "--out", tmp_path / "h200.json"], "needs a CUDA GPU")  # nothing written


@pytest.mark.parametrize("argv,message", [(["--bits", "5"], "--bits takes"), (["--bits", "4,x"], "--bits takes"),
                                          (["--tokens", "0"], "--tokens must be positive"),
                                          (["--rank", "-1"], "--rank must be 0 or more"),
                                          (["--budget", "0"], "--budget must be"),
                                          (["--model", "/nonexistent/model"], "does not exist")])
def test_tune_names_bad_options(expect_cli_error, argv, message):
    expect_cli_error(["tune", *argv], message)

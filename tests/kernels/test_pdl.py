"""Programmatic dependent launch (kernels/triton/pdl.py): where it is switched off."""

import pytest
import torch

pytest.importorskip("triton")


def test_dependent_launch_stays_off_where_it_cannot_run(monkeypatch):
    """PDL needs CUDA on Hopper or later, compiled kernels and no MOESERVE_PDL=0: elsewhere the kernels get PDL=False
    and no launch option (griddepcontrol does not exist before sm_90)."""
    from moeserve.kernels.triton.pdl import ENV, dependent_launch, pdl_enabled

    assert dependent_launch(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl_enabled(torch.device("cuda", 0))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv(ENV, "0")
    assert dependent_launch(torch.device("cuda", 0)) == {"PDL": False}

"""Shared pytest configuration: the ``gpu`` marker, skipped automatically without a CUDA GPU."""

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU (skipped when torch.cuda.is_available() is False)")


def pytest_collection_modifyitems(config, items):
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture
def stand_in_kernels(monkeypatch):
    """The ops' CUDA code paths on CPU tensors (tests/stand_in_kernels.py): (gemm, gemm_softmax) stand-ins."""
    import stand_in_kernels

    from tile_ops.ops import fastpath

    yield stand_in_kernels.install(monkeypatch)
    fastpath.clear()  # the stand-ins' plans must not outlive them

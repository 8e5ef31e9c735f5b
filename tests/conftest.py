"""Shared test configuration.

The real control plane comes from `devcluster.pytest_plugin` (loaded with
`-p devcluster.pytest_plugin` by the Makefile, or by integration/conftest.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO

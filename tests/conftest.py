"""Tests marked `verify` are the long matrix: `make verify` runs them (RECSYS_VERIFY=1), `make test` skips them."""

import os

import pytest


def pytest_collection_modifyitems(config, items):
    if os.environ.get("RECSYS_VERIFY"):
        return
    skip = pytest.mark.skip(reason="part of `make verify` (RECSYS_VERIFY=1)")
    for item in items:
        if "verify" in item.keywords:
            item.add_marker(skip)

"""Tests marked `verify` are the long matrix: `make verify` runs them (RECSYS_VERIFY=1), `make test` skips them."""

import os

import pytest


def pytest_collection_modifyitems(config, items):
    if os.environ.get("RECSYS_VERIFY"):
        return
    skip = pytest.mark.skip(reason="part of `make verify` (RECSYS_VERIFY=1)")
    for item in items:
        # The marker itself, not item.keywords: keywords also hold the names of
        # parent nodes, so a checkout in a folder named "verify" skipped everything.
        if item.get_closest_marker("verify") is not None:
            item.add_marker(skip)

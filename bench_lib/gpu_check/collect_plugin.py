"""A pytest plugin (``-p bench_lib.gpu_check.collect_plugin``) that writes every collected
test's kind to ``--test-kinds-out FILE`` (JSON ``{node id: kind}``), so that one collection
tells ``shards.deal_shards`` what each test file weighs. Loaded only by that collection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

OPTION = "--test-kinds-out"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(OPTION, metavar="FILE", help="write each collected test's kind here")


def kind_of(item: pytest.Item) -> str:
    """``skip`` (skipped at collection: it costs nothing), else its heaviest marker of
    ``slow``, ``gpu``, ``integration``, else ``unit``."""
    if item.get_closest_marker("skip") is not None:
        return "skip"
    for marker in ("slow", "gpu", "integration"):
        if item.get_closest_marker(marker) is not None:
            return marker
    return "unit"


@pytest.hookimpl(trylast=True)  # after conftest's hook has marked what skips here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    out = config.getoption(OPTION)
    if out:
        Path(out).write_text(json.dumps({item.nodeid: kind_of(item) for item in items}))

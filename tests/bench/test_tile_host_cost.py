"""``benchmarks/tile_host_cost.py``: the rows are the tiles they say (direct, packed N tensors each)."""

from __future__ import annotations

from typing import Any

import pytest


def test_rows_are_direct_and_packed_tiles_of_the_asked_size(capsys: pytest.CaptureFixture[str], load_benchmark: Any) -> None:
    module = load_benchmark("tile_host_cost")
    assert module.main(["--tile", "64", "--tiles", "3", "--segments", "4", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:3] for line in out.splitlines()[2:]}
    assert rows == {"direct": ["3", "0"], "packed4": ["3", "3"]}, out


def test_copies_both_prints_each_packed_row_with_each_route_and_restores_the_default(
        capsys: pytest.CaptureFixture[str], load_benchmark: Any) -> None:
    from mixprec.optim import _parts

    module = load_benchmark("tile_host_cost")
    assert module.main(["--tile", "64", "--tiles", "2", "--segments", "4", "--steps", "2", "--copies", "both"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines()[2:]] == ["direct", "packed4/one-op", "packed4/foreach"], out
    assert frozenset({"cpu"}) == _parts._ONE_OP_COPY_DEVICES  # the one setting both modules read

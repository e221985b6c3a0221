"""Which ranks send telemetry and which one hears the service's commands, per ``report_ranks``."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from fp8guard.agent.distributed import command_rank, reports


@pytest.mark.parametrize(("choice", "kinds", "expected"), [
    ("all", ["te"], [True, True, True, True]),
    ("zero", ["emulation"], [True, False, False, False]),
    # TE all-reduces amaxes over the data-parallel group: the replicas' data is rank 0's
    ("auto", ["te"], [True, False, False, False]),
    ("auto", ["torchao"], [True, True, True, True]),
    ("auto", ["emulation", "te"], [True, False, False, False]),
    ([1, 3], ["te"], [False, True, False, True]),
])
def test_which_ranks_report(choice: str | list[int], kinds: list[str], expected: list[bool]) -> None:
    assert [reports(choice, rank, kinds) for rank in range(4)] == expected


def test_commands_travel_from_the_lowest_reporting_rank_in_the_world() -> None:
    assert command_rank("auto", 8) == command_rank("all", 8) == command_rank("zero", 8) == 0
    assert command_rank([3, 1], 4) == 1
    assert command_rank([7, 5], 6) == 5  # rank 7 is not in a world of 6
    assert command_rank([9], 4) == 0  # none inside the world: rank 0, as without the list

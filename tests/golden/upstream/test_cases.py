"""The cases of upstream's propagation test files that autoshard expresses, each checked
against its CHECK lines, against upstream's own pass where `mlir-opt-22` is installed, and,
where autoshard keeps another answer, by the bytes both answers move (`harness`)."""

import pytest

from . import (
    forward_backward_sharding_propagation,
    forward_sharding_propagation,
    sharding_propagation,
)
from .harness import assert_fewer_bytes, assert_ours, assert_upstream, needs_mlir_opt

CASES = {
    f"{file}/{name}": case
    for file, module in (
        ("sharding-propagation", sharding_propagation),
        ("forward-sharding-propagation", forward_sharding_propagation),
        ("forward-backward-sharding-propagation", forward_backward_sharding_propagation),
    )
    for name, case in module.CASES.items()
}


@pytest.mark.parametrize("name", CASES)
def test_propagate_gives_upstream_checks(name, tmp_path):
    assert_ours(CASES[name], tmp_path)


@needs_mlir_opt
@pytest.mark.parametrize("name", CASES)
def test_upstream_pass_gives_its_checks_and_ours(name, tmp_path):
    assert_upstream(CASES[name], tmp_path)


@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case.ours])
def test_where_autoshard_differs_it_moves_fewer_bytes(name, tmp_path):
    assert_fewer_bytes(CASES[name], tmp_path)

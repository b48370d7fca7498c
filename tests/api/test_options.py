"""The plan request's options module: its docstring example is the canonical form's promise,
so it runs as a test (CI runs no doctests otherwise)."""

from __future__ import annotations

import doctest

from service import options


def test_module_doctest_holds() -> None:
    result = doctest.testmod(options)
    assert (result.attempted, result.failed) == (4, 0)


def test_an_axis_named_pp_asks_for_a_pipeline_as_the_flag_does() -> None:
    from pathlib import Path

    from autoshard.search.pipelined import PipelineAsk

    pp = options.PlanOptions(mesh="dp=2,pp=4", dims=(("batch", 8),)).request(Path("m.onnx"))
    assert pp.pipeline == PipelineAsk(1)
    plain = options.PlanOptions(mesh="dp=2,tp=4", dims=(("batch", 8),)).request(Path("m.onnx"))
    assert plain.pipeline is None

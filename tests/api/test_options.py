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


def test_the_pipeline_fields_ask_what_the_flags_do() -> None:
    """`pipeline_axis` names the axis as `--pipeline-axis` does, `pipeline=auto` lets the
    search decide; both survive the stored form (`to_json`), and a request without them
    keeps the job id it had before the fields."""
    from pathlib import Path

    from autoshard.cost.schedule import Schedule
    from autoshard.search.pipelined import AutoPipeline, PipelineAsk

    def asked(**fields: str) -> options.PlanOptions:
        return options.parse_options({"mesh": "4x2", "mode": "training", **fields}, 600)

    by_axis = asked(pipeline_axis="0", schedule="gpipe")
    assert by_axis.request(Path("m.onnx")).pipeline == PipelineAsk(0, Schedule.parse("gpipe"))
    auto = asked(pipeline="auto")
    assert auto.request(Path("m.onnx")).pipeline == AutoPipeline(None, None)
    for given in (by_axis, auto):
        assert options.PlanOptions.from_json(given.to_json()) == given
    plain = asked()
    assert plain == asked(pipeline="none") and "pipeline" not in plain.to_json()
    assert plain.job_id("0" * 64) == asked(pipeline="none").job_id("0" * 64)

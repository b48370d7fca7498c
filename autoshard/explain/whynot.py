"""Why not another sharding (`autoshard explain PLAN.json --model MODEL --why-not NAME=SPEC`),
or a standard recipe (`--why-not zero`: `search.recipes`): the plan's search asked again with
that sharding (the recipe's layout) pinned, and the best plan with it (the *target*) compared
with the chosen one; a recipe's answer also gives its price beside the plan (the plan
document's `recipes`) and how the plan differs from it.

The request is the plan's own (`pipeline.plan_request`: model, cluster and budget, objective,
time limit, annotations) plus one required annotation: value NAME produced as SPEC (the
sharding text annotations use, `[[0], []]`), or for op NAME, each of its results as the
sharding option SPEC writes it. The verdict:

- CHOSEN CHEAPER: the target's objective is higher, as it must be when the plan is optimal;
- TARGET CHEAPER: lower (possible when the plan was not proven optimal: a gap, a time limit);
- SAME COST: equal (a tie, or the plan already does it);
- INFEASIBLE: no plan has it. No option of the op's rule writes it (told before any solve,
  with what the op can write), it contradicts the plan's annotations, or no plan with it fits
  the memory budget (told with the lowest budget that does).

with the objective, memory peak and communication deltas, and the ops and weights whose
sharding changed, by repeated layer (`diff.diff_plans`, the same as `autoshard diff`).
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from autoshard.annotations import Annotation, AnnotationError, check_annotations
from autoshard.document.plan_document import PlanDocument
from autoshard.document.recipes import versus
from autoshard.errors import ShardingError
from autoshard.explain.diff import change_lines, cost_lines, diff_plans
from autoshard.explain.saved import ExplainError, Saved, resolve
from autoshard.ir.graph import Graph
from autoshard.mesh import Mesh
from autoshard.pipeline import load_graph, plan_request
from autoshard.rules import IteratorType, OpRule, rule_for
from autoshard.rules.base import ring_loops
from autoshard.search.candidates import candidates, option_writes
from autoshard.search.options import Objective
from autoshard.search.problem import SearchError
from autoshard.search.recipes import (
    RecipeError,
    megatron_splits,
    parse_recipe,
    recipe_layout,
)
from autoshard.search.solver.outcome import InfeasibleError
from autoshard.sharding import Sharding, ShardingOption
from autoshard.units import format_bytes, format_seconds

SHOWN = 8
"""How many of the shardings an op can write an INFEASIBLE verdict lists."""


class Verdict(enum.StrEnum):
    CHOSEN_CHEAPER = "CHOSEN CHEAPER"
    TARGET_CHEAPER = "TARGET CHEAPER"
    SAME_COST = "SAME COST"
    INFEASIBLE = "INFEASIBLE"


@dataclass(frozen=True)
class Target:
    """What to pin: the annotations saying it, or why no rule allows it (`refused`)."""

    text: str
    name: str
    kind: str  # "value", "op" or "recipe"
    annotations: tuple[Annotation, ...] = ()
    refused: str = ""


_TARGET = re.compile(r"(?P<name>.+?)\s*=\s*(?P<spec>\[.*)", re.DOTALL)


def parse_target(
    graph: Graph, mesh: Mesh, text: str, parameters: Mapping[str, str] | None = None
) -> Target:
    """`NAME=SPEC` for the model (NAME also a source parameter's name, SPEC then over the
    exported weight's dims): a bad name or spec is one line naming it (and the closest
    names); a spec no rule allows is a Target with the reason it is `refused`."""
    match = _TARGET.fullmatch(text.strip())
    if match is None:
        raise ExplainError(f"--why-not {text!r} is not NAME=SHARDING (e.g. 'x=[[0], []]')")
    name, spec = match["name"], match["spec"]
    kind, name = resolve(graph, name, f"--why-not {text!r}: ", parameters)
    if kind == "value":
        try:
            sharding = Sharding.parse(spec)
        except ShardingError as error:
            raise AnnotationError(f"--why-not {name}: {error}") from None
        annotation = Annotation(name, sharding)
        check_annotations([annotation], {name: graph.values[name].shape}, mesh)
        return Target(text, name, kind, (annotation,), _value_refused(graph, mesh, annotation))
    op = graph.op_by_name[name]
    rule = rule_for(op, graph)
    if rule is None:
        return Target(text, name, kind, refused=f"op {name} ({op.type}) has no sharding rule: "
                      "it is computed replicated")  # fmt: skip
    option = _option(rule, mesh, name, spec)
    refused = _loops_refused(rule, option, mesh, f"op {name} ({op.type})")
    pins = () if refused else tuple(
        Annotation(y, option_writes(rule, option, j)) for j, y in enumerate(op.outputs) if y
    )  # fmt: skip
    return Target(text, name, kind, pins, refused)


def _option(rule: OpRule, mesh: Mesh, name: str, spec: str) -> ShardingOption:
    """SPEC as a sharding option of the op: its loops' mesh axes (each at most once, as the
    sharding text requires), axes of the mesh."""
    try:
        option = ShardingOption.parse(spec, len(rule.loops))
    except ShardingError as error:
        raise AnnotationError(f"--why-not {name}: {error}") from None
    for home, ring in ring_loops(option):
        if (home, ring) not in rule.ring:
            axis = min(set(option.loops[home]) & set(option.loops[ring]))
            raise AnnotationError(
                f"--why-not {name}: mesh axis {axis} splits on dims {home} and {ring} in {spec}"
            )
    used = [a for axes in option.loops for a in axes]
    for axis in used:
        if axis >= mesh.ndim:
            raise AnnotationError(
                f"--why-not {name}: unknown mesh axis {axis} in {spec}; mesh {mesh} has axes "
                f"0..{mesh.ndim - 1}"
            )
    return option


def _loops_refused(rule: OpRule, option: ShardingOption, mesh: Mesh, op: str) -> str:
    for index, (loop, axes) in enumerate(zip(rule.loops, option.loops, strict=True)):
        if not axes:
            continue
        if loop.kind is IteratorType.INVALID:
            return f"no rule option: loop d{index} of {op} ({loop}) cannot be split"
        devices = mesh.group_size(axes)
        if loop.size % devices:
            return (
                f"no rule option: loop d{index} of {op} has {loop.size} iterations, not "
                f"divisible over mesh axes {list(axes)} ({devices} devices)"
            )
    return ""


def _value_refused(graph: Graph, mesh: Mesh, annotation: Annotation) -> str:
    """Why no option of the value's producer writes the annotated sharding ("" if one does)."""
    name, sharding = annotation.value, annotation.sharding
    if name in graph.constants:
        return f"{name} is a constant computed while planning: it is held replicated"
    producer = graph.producer(name)
    if producer is None:
        return ""  # a weight or graph input may be held in any sharding that fits it
    rule, about = rule_for(producer, graph), f"op {producer.name} ({producer.type})"
    if rule is None:
        return "" if sharding == Sharding() else (
            f"no rule option: {about} has no sharding rule and computes {name} replicated"
        )  # fmt: skip
    out = producer.outputs.index(name)
    writes = list(dict.fromkeys(option_writes(rule, c, out) for c in candidates(rule, mesh)))
    if sharding in writes:
        return ""
    rank = len(graph.values[name].shape)
    shown = ", ".join(s.text(rank) for s in writes[:SHOWN])
    more = f" and {len(writes) - SHOWN} more" if len(writes) > SHOWN else ""
    return (
        f"no rule option: no option of {about} writes {name} as {sharding.text(rank)}; it can "
        f"write {shown}{more}"
    )


def _measure(document: PlanDocument, objective: Objective) -> float:
    cost = document.cost
    if cost is None:
        raise ExplainError("the plan has no cost block: plan it again")
    return float(cost.objective if objective is Objective.TIME else cost.comm_bytes_per_device)


def recipe_target(saved: Saved, text: str) -> Target:
    """A recipe named by `text` (`search.recipes`): its annotations on the saved plan's
    model and mesh, or why it does not apply; a name of no recipe of the plan's mode is one
    line naming those that are."""
    training = saved.document.training is not None
    try:
        recipe = parse_recipe(text, training, f"--why-not {text!r}")
    except RecipeError as error:
        raise ExplainError(f"{error}; or give NAME=SHARDING (e.g. 'x=[[0], []]')") from None
    request, mesh = saved.request, saved.cluster.mesh
    forward = load_graph(request.model_path, request.dims, None)
    layout = recipe_layout(saved.graph, megatron_splits(forward, mesh), mesh, recipe)
    return Target(text, str(recipe), "recipe", layout.annotations, layout.refused)


def _recipe_answer(saved: Saved, target: Target) -> dict[str, Any]:
    """A recipe's price beside the plan (the plan document's `recipes`) and how the plan
    differs from it, in a line."""
    block = saved.document.recipes
    row = block.row(target.name) if block is not None else None
    if block is None or row is None:
        return {"recipe": None, "versus": None}
    return {"recipe": row.to_json(), "versus": versus(block.plan, row)}


def why_not(saved: Saved, text: str) -> tuple[dict[str, Any], PlanDocument | None]:
    """The answer as JSON, and the target plan's document (None when INFEASIBLE). `text` is
    NAME=SHARDING, or a recipe's name: the plan's search asked again with the recipe's layout
    pinned, the answer adding its price beside the plan (`recipes`)."""
    if "=" in text:
        target = parse_target(saved.graph, saved.cluster.mesh, text, saved.parameters)
    else:
        target = recipe_target(saved, text)
    answer: dict[str, Any] = {
        "why_not": target.text, "name": target.name, "kind": target.kind,
        "annotations": [a.to_json() for a in target.annotations],
    }  # fmt: skip
    refused = target.refused
    document = None
    if not refused:
        request = saved.request
        asked = dataclasses.replace(
            request, annotations=(*request.annotations, *target.annotations)
        )
        try:
            document = plan_request(asked).document
        except InfeasibleError as error:
            refused = f"memory: {error}"
        except AnnotationError as error:  # the plan's own annotation pins it otherwise
            refused = f"the plan's annotations contradict it: {error}"
        except SearchError as error:  # it contradicts the plan's own annotations
            own = "; ".join(map(str, request.annotations))
            refused = f"{error}, with the plan's annotations {own}" if own else str(error)
    if target.kind == "recipe":
        answer |= _recipe_answer(saved, target)
    if document is None:
        return answer | {"verdict": str(Verdict.INFEASIBLE), "reason": refused}, None
    objective = saved.request.objective
    chosen, best = _measure(saved.document, objective), _measure(document, objective)
    delta = best - chosen
    if abs(delta) <= 1e-9 * max(abs(chosen), abs(best)):
        verdict = Verdict.SAME_COST
    else:
        verdict = Verdict.CHOSEN_CHEAPER if delta > 0 else Verdict.TARGET_CHEAPER
    diff = diff_plans(saved.document, document)
    answer |= {
        "verdict": str(verdict), "reason": None,
        "objective": {"measure": "time_s" if objective is Objective.TIME
                      else "comm_bytes_per_device", "chosen": chosen, "target": best,
                      "delta": delta},
        "cost": diff["cost"],
        "solver": document.solver.to_json() if document.solver is not None else None,
        "changed": diff["changed"], "collectives": diff["collectives"],
    }  # fmt: skip
    return answer, document


def why_not_text(answer: Mapping[str, Any]) -> str:
    """The answer for a terminal."""
    lines = [f"why not {answer['why_not']}: {answer['verdict']}"]
    if answer.get("recipe"):
        row = answer["recipe"]
        fits = {True: "fits", False: "does not fit the budget", None: "may fit"}[row["fits"]]
        least = "at least " if row.get("memory_at_least") else ""
        if row["refused"] is None:
            lines.append(
                f"  recipe {row['name']} ({row['title']}) priced beside the plan: "
                f"{format_seconds(row['step_time_s'])}, "
                f"{least}{format_bytes(row['memory_bytes_per_device'])} per device, {fits}"
            )
        lines.append(f"  {answer['versus']}")
    if answer["verdict"] == Verdict.INFEASIBLE:
        return "\n".join([*lines, f"  {answer['reason']}"])
    objective = answer["objective"]
    share = objective["delta"] / objective["chosen"] if objective["chosen"] else 0.0
    solver = answer["solver"]
    lines.append(
        f"  the best plan with it costs {share:+.1%} ({solver['status']}, gap {solver['gap']:.2%});"
        " chosen -> target:"
    )
    diff = {k: answer[k] for k in ("cost", "changed", "collectives")}
    lines += [f"  {line}" for line in cost_lines(diff)]
    lines += change_lines(diff, "  ")
    return "\n".join(lines)

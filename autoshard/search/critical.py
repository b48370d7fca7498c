"""The answer ranked on the step's critical path: the searched plan against each recipe's.

The search minimizes compute plus every collective at its full time (its objective, an upper
bound of the step), but a training step runs its communication beside its compute
(`cost.overlap`): FSDP's gathers are prefetched under the layers' compute and gradient syncs
bucketed under the backward, while ZeRO's gather of the updated weights follows the optimizer
with nothing left to hide it. So a plan cheaper by the objective can be slower as it runs.

The standard recipes (`search.recipe_prices`) are each priced in the plan's own search, at
their fastest program by the objective. Each that fits the budget, proven its recipe's fastest
(`RecipePrice.choice`), is lowered and priced as the plan is (`cost.price`, the same schedule:
the document's step time), and the fastest step answers; the searched plan on ties, so an
answer only moves where a recipe is faster. A recipe whose compute alone is no faster than the
answer so far is not lowered: a step's critical path runs all its compute, one op after
another; nor is one whose program is the searched plan's. The memory checked is the lowered
program's, as the search's own plan's is.

Worked example (`Overlap` defaults), compute 20 ms in either plan: the searched plan holds the
weights whole and the optimizer state split (ZeRO-1/2): a reduce-scatter of the gradients,
3 ms, bucketed under the backward but for its last bucket, 1 ms, and an all-gather of the
updated weights, 3 ms, after the optimizer with nothing left to hide it: objective 26 ms,
step 24 ms. FSDP sends 9 ms (a gather in the forward and in the backward, a reduce-scatter):
objective 29 ms; but its gathers run a layer ahead under compute, all but the first layer's
of each pass, 1 ms, and its reduce-scatter in the same buckets: step 22 ms. FSDP's plan
answers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from autoshard.cost.cluster import Cluster
from autoshard.cost.price import Cost, price
from autoshard.deadline import NEVER, Deadline
from autoshard.ir.graph import Graph
from autoshard.passes.lower import lower_measured
from autoshard.search.budget import Planned
from autoshard.search.recipe_prices import RecipePrice
from autoshard.search.recipes import Recipe
from autoshard.training.options import Overlap
from autoshard.units import format_seconds


@dataclass(frozen=True)
class Answer:
    """The plan that answers (`planned`): the search's (`recipe` None), or the recipe's whose
    step is faster on the critical path, with the story's sentence saying why (`words`), and
    the recipes not compared for want of time (`unpriced`)."""

    planned: Planned
    recipe: Recipe | None = None
    words: str = ""
    unpriced: tuple[Recipe, ...] = ()


def fastest_answer(
    graph: Graph, cluster: Cluster, planned: Planned, prices: Sequence[RecipePrice],
    overlap: Overlap | None, deadline: Deadline = NEVER,
) -> Answer:  # fmt: skip
    """The fastest on the step's critical path of `planned` (the search's plan of `graph` on
    `cluster`) and each fitting recipe of `prices` (the module docstring); `overlap` how the
    step runs (None: not scheduled, its step time its objective). Where `deadline` passes, the
    recipes left are not lowered (`Answer.unpriced`)."""
    best: tuple[Planned, Recipe] | None = None
    fastest = planned.cost.step_time_s
    unpriced: list[Recipe] = []
    for candidate in _candidates(prices):
        if candidate.compute_time_s >= fastest or candidate.choice == planned.solution.choice:
            continue  # its critical path runs all of its compute; or it is the searched plan
        if deadline.passed():
            unpriced.append(candidate.recipe)
            continue
        plan = planned.search.plan(graph, cluster, candidate.choice)
        program, usage = lower_measured(graph, plan)
        if usage.peak > cluster.memory:
            continue
        cost = price(program, graph, cluster, usage, overlap)
        if cost.step_time_s < fastest:
            fastest = cost.step_time_s
            best = (
                dataclasses.replace(planned, plan=plan, program=program, cost=cost, usage=usage),
                candidate.recipe,
            )
    if best is None:
        return Answer(planned, unpriced=tuple(unpriced))
    answered, recipe = best
    return Answer(answered, recipe, answer_words(recipe, answered.cost, planned.cost),
                  tuple(unpriced))  # fmt: skip


def _candidates(prices: Sequence[RecipePrice]) -> list[RecipePrice]:
    """The recipes whose program is proven their fastest and fits the budget, in order."""
    return [p for p in prices if not p.refused and p.fits is True and p.choice]


def answer_words(recipe: Recipe, mine: Cost, searched: Cost) -> str:
    """The story's sentence on a recipe's plan answering: `Answered with the <label> recipe's
    plan (<recipe>): <its step> a step on its critical path against <the searched plan's> for
    the searched plan, <the difference> faster; ...`, with what each hides of its
    communication."""
    t = format_seconds
    told = (
        f"Answered with the {recipe.label} recipe's plan ({recipe}): {t(mine.step_time_s)} a "
        f"step on its critical path against {t(searched.step_time_s)} for the searched plan, "
        f"{t(searched.step_time_s - mine.step_time_s)} faster"
    )
    if searched.objective <= mine.objective:
        told += (
            f", though the searched plan costs less by the search's measure, compute plus "
            f"every collective at its full time ({t(searched.objective)} against "
            f"{t(mine.objective)})"
        )
    return (
        f"{told}: {t(_hidden(mine))} of its {t(mine.comm_time_s)} of communication runs "
        f"under compute, against {t(_hidden(searched))} of {t(searched.comm_time_s)}."
    )


def _hidden(cost: Cost) -> float:
    return cost.schedule.hidden_s if cost.schedule is not None else 0.0

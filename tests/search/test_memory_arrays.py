"""The memory rows' array forms against the rows written out: spans of rows (`Spans`) and the
indicators worked out level by level (`IndicatorTable`), each summed or evaluated by hand."""

import numpy as np

from autoshard.search.memory.assembly import _events, _mark_spans
from autoshard.search.memory.rows import Chosen, Indicator, IndicatorTable, Spans


def _random_rows(rng: np.random.Generator) -> list[list[tuple[int, int]]]:
    """Rows of (key, amount) terms, ascending by key, that repeat the row before in part: a
    term dropped, a new one, an amount changed, a key twice in one row, an empty row."""
    rows, row = [], [(k, int(rng.integers(-5, 9))) for k in sorted(rng.choice(12, 5, False))]
    for _ in range(40):
        kept = [term for term in row if rng.random() < 0.85]
        kept = [(k, a + 1) if rng.random() < 0.1 else (k, a) for k, a in kept]
        if rng.random() < 0.5:
            kept.append((int(rng.integers(12)), int(rng.integers(-5, 9))))
        row = sorted(kept) if rng.random() < 0.95 else []
        rows.append(row)
    return rows


def _arrays(rows):
    """The rows as `Spans.of` takes them: each row's start, then every term's key and amount."""
    starts = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)
    keys = np.array([k for r in rows for k, _ in r], np.int64)
    amounts = np.array([a for r in rows for _, a in r], np.int64)
    return starts, keys, amounts


def test_spans_sum_each_row_and_weigh_each_term_as_the_rows_written_out():
    rng = np.random.default_rng(0)
    for _ in range(30):
        rows = _random_rows(rng)
        starts, keys, amounts = _arrays(rows)
        spans = Spans.of(starts, keys, amounts)
        assert len(spans.key) < len(keys)  # consecutive rows share terms
        values = rng.integers(-(10**12), 10**12, 12)
        by_hand = [sum(int(values[k]) * a for k, a in r) for r in rows]
        assert spans.sums(values[spans.key] * spans.amount).tolist() == by_hand
        weights = rng.random(len(rows))
        per_key = np.zeros(12)
        for w, r in zip(weights, rows, strict=True):
            for k, a in r:
                per_key[k] += w * a
        weighed = np.bincount(spans.key, spans.weights(weights) * spans.amount, minlength=12)
        np.testing.assert_allclose(weighed, per_key, rtol=1e-12, atol=1e-12)


def test_spans_are_alike_whatever_the_keys_width():
    # Keys of 16 bits are sorted by radix, wider ones by merging: one order either way.
    rng = np.random.default_rng(1)
    for _ in range(10):
        rows = _random_rows(rng)
        starts, keys, amounts = _arrays(rows)
        narrow, wide = Spans.of(starts, keys, amounts), Spans.of(starts, keys + 70_000, amounts)
        assert wide.key.tolist() == (narrow.key + 70_000).tolist()
        for field in ("amount", "first", "last"):
            assert getattr(wide, field).tolist() == getattr(narrow, field).tolist()


def test_the_spans_of_indicator_events_are_those_of_the_rows_they_make():
    """Random indicator terms over spans of slots (one term ending where another of its
    indicator starts, terms cancelling out), rows kept at some slots: the spans worked out
    from the events are those `Spans.of` finds in the rows written out slot by slot."""
    rng = np.random.default_rng(1)
    for _ in range(30):
        slots, count = 40, int(rng.integers(0, 25))
        firsts = rng.integers(0, slots, count)
        lasts = np.minimum(firsts + rng.integers(0, 12, count), slots - 1)
        keys, amounts = rng.integers(0, 6, count), rng.choice([-4, -2, 2, 3, 4], count)
        kept = sorted(rng.choice(slots, int(rng.integers(1, slots)), False).tolist())
        rows = []
        for slot in kept:
            live = np.zeros(6, np.int64)
            np.add.at(live, keys[(firsts <= slot) & (slot <= lasts)],
                      amounts[(firsts <= slot) & (slot <= lasts)])  # fmt: skip
            rows.append([(k, int(live[k])) for k in np.flatnonzero(live)])
        made = _mark_spans(_events(firsts, lasts, keys, amounts), kept)
        written = Spans.of(*_arrays(rows))
        for field in ("key", "amount", "first", "last", "rows"):
            assert np.array_equal(getattr(made, field), getattr(written, field)), field


def test_no_terms_make_no_spans():
    spans = Spans.of(np.zeros(4, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
    assert len(spans.key) == 0
    assert spans.sums(np.zeros(0, np.int64)).tolist() == [0, 0, 0]


def _holds(literal: Chosen | int, indicators: list[Indicator], choice: list[int]) -> bool:
    if isinstance(literal, Chosen):
        return choice[literal.group] in literal.choices
    found = [_holds(lit, indicators, choice) for lit in indicators[literal].literals]
    return all(found) if indicators[literal].every else any(found)


def test_the_indicator_table_evaluates_nested_ands_and_ors_as_written():
    rng = np.random.default_rng(1)
    sizes = [3, 5, 2, 4]
    for _ in range(20):
        indicators: list[Indicator] = []
        for _ in range(30):
            literals: list[Chosen | int] = []
            for _ in range(int(rng.integers(0, 4))):
                if indicators and rng.random() < 0.4:
                    literals.append(int(rng.integers(len(indicators))))
                else:
                    g = int(rng.integers(len(sizes)))
                    picked = rng.choice(sizes[g], int(rng.integers(0, sizes[g] + 1)), False)
                    literals.append(Chosen(g, frozenset(picked.tolist())))
            indicators.append(Indicator(bool(rng.random() < 0.5), tuple(literals)))
        table = IndicatorTable(indicators)
        for _ in range(10):
            choice = [int(rng.integers(n)) for n in sizes]
            by_hand = [_holds(i, indicators, choice) for i in range(len(indicators))]
            assert table.values(choice).tolist() == by_hand

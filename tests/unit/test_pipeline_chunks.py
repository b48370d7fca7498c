"""An interleaved schedule's chunks placed by the price: each position's layers as the
balanced split gives them (at least one per chunk), spread over its chunks so that the chunk
with the embedding or the head holds fewer; evenly where the ends cost nothing."""

import pytest

from autoshard.cost.cluster import make_cluster
from autoshard.cost.schedule import Schedule, ScheduleKind
from autoshard.search.pipelined import (
    LayerCosts,
    PipelineAsk,
    balanced_split,
    place_chunks,
    price_stages,
    split_layers,
)

INTERLEAVED = Schedule(ScheduleKind.INTERLEAVED, 2)


def _costs(embed_s: float, head_s: float) -> LayerCosts:
    """A stage's model of 2 layers of 1 s each (forward only), the ends as given."""
    return LayerCosts(forward=(embed_s, 1.0, 1.0, head_s), backward=(0.0,) * 4,
                      update=(0.0,) * 4, held=(0,) * 4, activations=(0,) * 4, send_bytes=0,
                      training=False)  # fmt: skip


def test_the_head_s_chunk_holds_fewer_layers():
    # 10 layers of 1 s, the head 3 s, 2 positions: 7 and 3 layers (7 s, 3 + 3 s); position 1's
    # 3 go 2 to chunk 1 and 1 to chunk 3 (which runs the head: 4 s), position 0's 4 and 3.
    priced = price_stages(_costs(0.0, 3.0), make_cluster("pp=2,dp=2"),
                          PipelineAsk(0, INTERLEAVED), 10, 2)  # fmt: skip
    assert [s.layers for s in priced.stages] == [range(0, 7), range(7, 10)]
    assert priced.chunks == (range(0, 4), range(4, 6), range(6, 9), range(9, 10))

    def chunk(start, stop, stage, forward_s):
        compute = {"forward_s": forward_s, "backward_s": 0.0, "weight_s": 0.0}
        return {"layers": [start, stop], "stage": stage, "compute": compute}

    assert priced.to_json()["chunks"] == [
        chunk(0, 4, 0, 4.0), chunk(4, 6, 1, 2.0), chunk(6, 9, 0, 3.0), chunk(9, 10, 1, 4.0),
    ]  # fmt: skip
    # Each position's layers are its chunks'; the even split would give position 1 five
    # layers and the head: 8 s against 7.
    for s, stage in enumerate(priced.stages):
        assert len(stage.layers) == sum(len(c) for c in priced.chunks[s::2])
    assert [len(c) for c in split_layers(10, 4)[1::2]] == [3, 2]


def test_each_chunk_runs_at_its_own_time():
    """The same plan's forward, 2 micro-batches: chunks of 4, 2, 3 and 1 + 3 s (virtual stages
    0..3). Stage 0: F0.0 [0, 4], F1.0 [4, 8]; stage 1: F0.0 [4, 6], F1.0 [8, 10]; stage 0's
    chunk 2: F0.1 [8, 11], F1.1 [11, 14]; stage 1's chunk 3 (the head): F0.1 [11, 15], F1.1
    [15, 19]. Step 19 s; each stage's time halved over its chunks (3.5 and 3 s) would say 17."""
    priced = price_stages(_costs(0.0, 3.0), make_cluster("pp=2,dp=2"),
                          PipelineAsk(0, INTERLEAVED), 10, 2)  # fmt: skip
    assert [t.forward for t in priced.chunk_times] == [4.0, 2.0, 3.0, 4.0]
    assert [s.forward_s for s in priced.stages] == [7.0, 6.0]
    assert priced.step_s == 19.0


@pytest.mark.parametrize(
    ("layers", "stages"), [(n, p) for n in range(4, 17) for p in (2, 3, 4) if 2 * p <= n]
)
def test_free_ends_split_evenly(layers, stages):
    """Where the embedding and the head cost nothing the chunks are the even split's."""
    split = balanced_split(layers, stages, 1.0, 0.0, 0.0, least=2)
    assert place_chunks(split, 2, 1.0, 0.0, 0.0) == split_layers(layers, stages * 2)


def test_every_position_holds_a_layer_per_chunk():
    # 4 layers, 2 positions of 2 chunks, a head worth 10 layers: still 2 layers a position.
    split = balanced_split(4, 2, 1.0, 0.0, 10.0, least=2)
    assert [len(r) for r in split] == [2, 2]
    assert place_chunks(split, 2, 1.0, 0.0, 10.0) == tuple(range(c, c + 1) for c in range(4))

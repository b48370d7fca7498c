"""The step's schedule (`cost.overlap`) on a 2-layer toy, every figure worked out by hand.

The toy: forward ops A1, A2 (4 s each) read weights gathered by G1, G2 (3 s each, FSDP);
backward ops B2, B1 (8 s each) compute the layers' gradients, 10 MiB each, synced by S2, S1
(2 s each, one link) into GradSync markers (0 s); the optimizer's U1, U2 (1 s each) read the
synced gradients. Serially: 2·3 + 2·4 + 2·8 + 2·2 + 2·1 = 36 s.
"""

from __future__ import annotations

import pytest

from autoshard.cost.overlap import Kernel, Link, Role, Transfer, schedule
from autoshard.training.options import Overlap, TrainingError

MIB = 2**20


def toy() -> list[Kernel | Transfer]:
    def gather(n: int) -> Transfer:
        return Transfer(f"w{n}", f"w{n}.full", 3.0, Link.SCALE_UP, Role.PREFETCH, "forward",
                        reader=f"A{n}")  # fmt: skip

    def sync(n: int) -> list[Kernel | Transfer]:
        return [
            Transfer(f"g{n}", f"g{n}.sum", 2.0, Link.SCALE_UP, Role.GRADIENT, "gradient_sync",
                     size=10 * MIB, reader=f"S{n}"),
            Kernel(f"S{n}", "gradient_sync", 0.0, (f"g{n}.sum",), (f"g{n}.synced",),
                   passthrough=True),
        ]  # fmt: skip

    return [
        gather(1),
        Kernel("A1", "forward", 4.0, ("x", "w1.full"), ("h",), matmul=True),
        gather(2),
        Kernel("A2", "forward", 4.0, ("h", "w2.full"), ("y",), matmul=True),
        Kernel("B2", "backward", 8.0, ("y", "h"), ("g2", "dh"), matmul=True),
        *sync(2),
        Kernel("B1", "backward", 8.0, ("dh", "x"), ("g1",), matmul=True),
        *sync(1),
        Kernel("U1", "optimizer", 1.0, ("g1.synced", "w1"), ("w1'",)),
        Kernel("U2", "optimizer", 1.0, ("g2.synced", "w2"), ("w2'",)),
    ]


def phases(found) -> dict[str, tuple[float, float]]:
    return {name: (p.exposed_s, p.hidden_s) for name, p in found.phases.items()}


def test_no_overlap_is_compute_plus_communication():
    found = schedule(toy(), Overlap(enabled=False), slowdown=0.1)
    assert found.step_time_s == 36.0
    assert found.slowdown_s == 0.0
    assert phases(found)["forward"] == (6.0, 0.0)
    assert phases(found)["gradient_sync"] == (4.0, 0.0)


def test_nothing_ahead_and_one_bucket_is_serial_too():
    # G1 0-3, A1 3-7, G2 7-10, A2 10-14, B2 14-22, B1 22-30; the 20 MiB of gradients stay
    # in one 25 MiB bucket until U1 reads g1: S2 30-32, S1 32-34, U1 34-35, U2 35-36.
    found = schedule(toy(), Overlap(prefetch=0), slowdown=0.1)
    assert found.step_time_s == 36.0
    assert found.spans == ((0.0, 3.0), (7.0, 10.0), (30.0, 32.0), (32.0, 34.0))
    assert phases(found) == {"forward": (6.0, 0.0), "backward": (0.0, 0.0),
                             "gradient_sync": (4.0, 0.0), "optimizer": (0.0, 0.0)}  # fmt: skip


def test_fsdp_prefetch_hides_the_next_layers_gather():
    # Both gathers issued at the forward's start: G1 0-3, G2 3-6 under A1 (3-7); A2 7-11;
    # then as above from 11: B2 11-19, B1 19-27, S2 27-29, S1 29-31, U1 31-32, U2 32-33.
    found = schedule(toy(), Overlap(prefetch=1), slowdown=0.0)
    assert found.step_time_s == 33.0
    assert found.spans[:2] == ((0.0, 3.0), (3.0, 6.0))
    assert phases(found)["forward"] == (3.0, 3.0)
    assert phases(found)["gradient_sync"] == (4.0, 0.0)


def test_prefetch_two_ahead_is_the_same_on_two_layers():
    assert schedule(toy(), Overlap(prefetch=2), slowdown=0.0).step_time_s == 33.0


@pytest.mark.parametrize("bucket_mb", [10.0, 0.0])
def test_bucketed_gradient_sync_runs_during_the_backward(bucket_mb):
    # A 10 MiB bucket closes with each gradient: S2 19-21 under B1 (19-27), S1 27-29 exposed
    # (nothing left to compute), U1 29-30, U2 30-31.
    found = schedule(toy(), Overlap(prefetch=1, bucket_mb=bucket_mb), slowdown=0.0)
    assert found.step_time_s == 31.0
    assert found.spans[2:] == ((19.0, 21.0), (27.0, 29.0))
    assert phases(found)["gradient_sync"] == (2.0, 2.0)
    assert found.exposed_s + found.hidden_s == 10.0  # all the communication, once


def test_overlapped_kernels_slow_down():
    # s = 0.1: A1 (3-7 at full speed) runs 3 s beside G2: ends 7.3; A2 7.3-11.3; B2 11.3-19.3;
    # S2 19.3-21.3 beside B1, which ends 19.3 + 8 + 0.2 = 27.5; S1 27.5-29.5, U1, U2: 31.5.
    found = schedule(toy(), Overlap(prefetch=1, bucket_mb=10.0), slowdown=0.1)
    assert found.step_time_s == pytest.approx(31.5, abs=1e-12)
    assert found.slowdown_s == pytest.approx(0.5, abs=1e-12)
    assert phases(found)["forward"] == pytest.approx((3.0, 3.0))


def test_async_tp_runs_a_gather_inside_its_matmul():
    # A 2 s all_gather into A2 (a matmul): on the critical path A2 waits for it (11 -> 13);
    # with async TP it runs beside A2 (7-9 at 0 slowdown): the step is the 33 s of prefetch.
    tp = Transfer("h", "h.full", 2.0, Link.SCALE_UP, Role.ASYNC_TP, "forward", joined="A2",
                  reader="A2")  # fmt: skip
    found = toy()
    found.insert(3, tp)
    found[4] = Kernel("A2", "forward", 4.0, ("h.full", "w2.full"), ("y",), matmul=True)
    assert schedule(found, Overlap(), slowdown=0.0).step_time_s == 35.0
    assert schedule(found, Overlap(async_tp=True), slowdown=0.0).step_time_s == 33.0


def test_a_network_collective_runs_beside_a_scale_up_one():
    a = Transfer("x", "x.1", 2.0, Link.SCALE_UP, phase="forward", reader="A")
    b = Transfer("x", "x.2", 3.0, Link.NETWORK, phase="forward", reader="A")
    found = [a, b, Kernel("A", "forward", 1.0, ("x.1", "x.2"), ("y",))]
    assert schedule(found, Overlap(), slowdown=0.0).step_time_s == 4.0  # max(2, 3) + 1


@pytest.mark.parametrize(
    "given, message",
    [({"prefetch": -1}, "prefetch must be at least 0, got -1"),
     ({"bucket_mb": -2.0}, "bucket MB must be a finite number >= 0, got -2.0")],
)  # fmt: skip
def test_bad_overlap_options_say_what(given, message):
    with pytest.raises(TrainingError, match=message):
        Overlap(**given)

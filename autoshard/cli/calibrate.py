"""`autoshard calibrate`: measure this machine's device (and links, given ranks) and write a
cluster file for `plan --cluster`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from autoshard.cli.commands import emit
from autoshard.errors import AutoshardError


def cmd_calibrate(args: argparse.Namespace) -> int:
    from autoshard.cost.measure.calibrate import calibrate
    from autoshard.files import write_atomic
    from autoshard.run import measure

    def progress(message: str) -> None:
        print(f"autoshard: {message}", file=sys.stderr, flush=True)

    ranks = measure.check_ranks(args.ranks)
    backend = args.backend or measure.default_backend()
    if ranks:
        measure.check_backend(ranks, backend)
    probe = None
    if args.torch:
        from autoshard.cost.measure.probes import TorchProbe

        try:
            import torch  # noqa: F401
        except ImportError:
            message = "calibrate --torch needs torch: pip install 'autoshard[run]'"
            raise AutoshardError(message) from None

        probe = TorchProbe("cuda" if measure.cuda_devices() else "cpu")
    calibration = calibrate(args.quick, progress, probe)
    if ranks:
        sizes, repeats = (measure.QUICK_SIZES, 5) if args.quick else (measure.SIZES, 10)
        links = measure.measure_links(ranks, backend, sizes, repeats, progress=progress)
        calibration = calibration.with_links(links)
    else:
        progress("links not measured (--ranks 0, or no torch): the host's copy rate stands in")
    data = calibration.to_json()
    write_atomic(Path(args.out), (json.dumps(data, indent=2) + "\n").encode())
    if args.json:
        emit(data)
    else:
        print(f"cluster file written to {args.out}: plan with --cluster {args.out} --mesh N")
    return 0

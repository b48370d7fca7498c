"""Ctrl-C: at any phase of `autoshard plan`, CP-SAT's solve included, it stops within a second,
says `autoshard: interrupted`, exits 130 and leaves no output file, whole or partial."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from ortools.sat.python import cp_model

from autoshard.cli.main import main
from autoshard.search.solver.cp_sat import deterministic_solver, run_solver

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"
# At its lowest budget, bert's last CP-SAT solve (on all its choices) takes seconds.
BERT_AT_ITS_LOWEST = [str(MODELS / "bert.onnx"), "--mesh", "2x4", "--dim", "batch=8",
                      "--dim", "seq=128", "--memory", "743633"]  # fmt: skip
# The decoder's problem takes seconds of Python to build.
DECODER = [str(MODELS / "decoder_32l_shape_only.onnx"), "--mesh", "2x4x8", "--dim", "batch=8",
           "--dim", "seq=2048"]  # fmt: skip
STARTING_S = 300  # to reach the phase: generous, for a loaded machine
STOPPING_S = 3.0  # from SIGINT to exit; measured 0.2-0.3 s on 2 busy cores


def ctrl_c_as_a_shell_gives_it() -> None:
    """The child's SIGINT as a user's shell leaves it, whatever this process inherited or was
    left with by earlier tests (an ignored or blocked SIGINT is inherited through exec)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupted_plan(flags: list[str], phase: str, out: Path) -> tuple[float, str]:
    """`autoshard plan` sent SIGINT once a progress line matches `phase`: the seconds from
    the signal to its exit, and its stderr; it must exit 130."""
    out.mkdir()
    command = [sys.executable, "-m", "autoshard", "plan", *flags, "-v",
               "-o", str(out / "plan.json"), "--html", str(out / "plan.html")]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=ctrl_c_as_a_shell_gives_it,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + STARTING_S
        while not seen or not re.search(phase, seen[-1]):
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.0))
            assert line is not None, f"ended before {phase!r}:\n{''.join(seen)}"
            seen.append(line)
        sent = time.monotonic()
        process.send_signal(signal.SIGINT)
        code = process.wait(timeout=STARTING_S)
        took = time.monotonic() - sent
    finally:
        process.kill()
        process.wait()
    reader.join(timeout=10)
    while (line := lines.get_nowait()) is not None:
        seen.append(line)
    err = "".join(seen)
    assert code == 130, err
    return took, err


@pytest.mark.parametrize(
    "flags, phase",
    [(BERT_AT_ITS_LOWEST, r"CP-SAT on all \d+ choices; objective"),
     (DECODER, r"search: building the problem")],
    ids=["in-cp-sat", "building-the-problem"],
)  # fmt: skip
def test_an_interrupt_stops_the_plan_at_once(flags, phase, tmp_path: Path) -> None:
    """The objective line comes from CP-SAT's callback: the solve is running when the signal
    comes. It stops the solve (CP-SAT runs in C++, where Python takes no signal) and writes
    nothing, not even a temporary file."""
    out = tmp_path / "out"
    took, err = interrupted_plan(flags, phase, out)
    assert err.endswith("autoshard: interrupted\n"), err
    assert "--time-limit" not in err and "Traceback" not in err
    assert took < STOPPING_S, f"{took:.2f} s from SIGINT to exit"
    assert list(out.iterdir()) == []


AFTER_A_SOLVE = """
import os, signal, time
from ortools.sat.python import cp_model
from autoshard.search.solver.cp_sat import deterministic_solver, run_solver
model = cp_model.CpModel()
model.maximize(model.new_int_var(0, 3, "x"))
assert run_solver(deterministic_solver(1.0), model, None) == cp_model.OPTIMAL
try:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)
    print("not interrupted")
except KeyboardInterrupt:
    print("interrupted")
"""


def test_a_solve_leaves_ctrl_c_to_python() -> None:
    """CP-SAT's own SIGINT catch, on by default, leaves SIGINT at its default once the solve
    returns: a later Ctrl-C killed the process without a word."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-c", AFTER_A_SOLVE],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=ctrl_c_as_a_shell_gives_it,
    )
    assert (run.returncode, run.stdout) == (0, "interrupted\n"), run.stderr


def test_a_solve_in_another_thread_runs_there() -> None:
    """In a thread other than the main one, where Python delivers no signal, the solve runs
    in place."""
    model = cp_model.CpModel()
    model.maximize(model.new_int_var(0, 3, "x"))
    statuses: list[cp_model.CpSolverStatus] = []
    worker = threading.Thread(
        target=lambda: statuses.append(run_solver(deterministic_solver(1.0), model, None))
    )
    worker.start()
    worker.join(timeout=60)
    assert statuses == [cp_model.OPTIMAL]


def test_an_interrupt_while_the_report_is_drawn_writes_neither_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The report is drawn before the plan is written: no plan is left without its report."""

    def interrupted(*args: object, **kwargs: object) -> str:
        raise KeyboardInterrupt

    monkeypatch.setattr("autoshard.html.plan_html", interrupted)
    flags = [str(MODELS / "mlp.onnx"), "--mesh", "2x2", "--dim", "batch=8", "-q"]
    out = tmp_path / "out"
    out.mkdir()
    code = main(["plan", *flags, "-o", str(out / "plan.json"), "--html", str(out / "plan.html")])
    assert (code, capsys.readouterr().err) == (130, "autoshard: interrupted\n")
    assert list(out.iterdir()) == []


CONSOLE_SCRIPT = "import sys; from autoshard.cli import main; sys.exit(main())"
"""What the `autoshard` console script runs (pyproject.toml's `autoshard.cli:main`)."""


def _importing(pid: int) -> bool:
    """Whether process `pid` has loaded numpy's C core: it is inside the command line's
    imports (numpy comes first of them; onnx, ortools and the planner follow)."""
    try:
        return "_multiarray_umath" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


TRIES = 8
"""Interrupts per entry: where in the imports one lands varies; numpy's core, interrupted in
its C init, raised an ImportError instead of KeyboardInterrupt in about 1 try in 20."""


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/PID/maps")
@pytest.mark.parametrize(
    "entry", [["-c", CONSOLE_SCRIPT], ["-m", "autoshard"]], ids=["console-script", "python-m"]
)
def test_an_interrupt_while_importing_says_so(entry: list[str], tmp_path: Path) -> None:
    """SIGINT while the command line is still being imported (numpy loaded, the rest not yet)
    ends like any other interrupt: one line, exit 130, no traceback."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, *entry, "plan", *DECODER, "-o", str(tmp_path / "plan.json")]
    for _ in range(TRIES):
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            preexec_fn=ctrl_c_as_a_shell_gives_it,
        )
        try:
            deadline = time.monotonic() + 60
            while not _importing(process.pid) and process.poll() is None:
                assert time.monotonic() < deadline, "numpy never loaded"
                time.sleep(0.001)
            process.send_signal(signal.SIGINT)
            out, err = process.communicate(timeout=60)
        finally:
            process.kill()
            process.wait()
        assert (process.returncode, out, err) == (130, "", "autoshard: interrupted\n")
        assert list(tmp_path.iterdir()) == []

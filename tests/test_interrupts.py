"""Ctrl-C and SIGTERM lose nothing: at any moment of a run (start-up, a round, a checkpoint being written) the
command exits 130 / 143 with the resume hint, the folder keeps a valid checkpoint of the last finished round and says
"interrupted", and ``--resume`` ends where an uninterrupted run ends."""

from __future__ import annotations

import itertools
import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import read_metrics, set_args, wait_for_checkpoint

from fedhog import checkpoint as checkpoint_module
from fedhog import cli, interrupts, server_app
from fedhog.checkpoint import (
    CHECKPOINT,
    PREVIOUS,
    Checkpoint,
    CheckpointError,
    checkpointed_rounds,
    load_checkpoint,
    save_checkpoint,
)

SETTINGS = ["dataset=\"digits\"", "model=\"logreg\"", "population=10", "sampling-rate=0.5", "rounds=6",
            "partitioner=\"iid\"", "privacy-seed=3", "noise-multiplier=0.7", "clipping-norm=2.0"]
CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


def _checkpoint(round_: int) -> Checkpoint:
    return Checkpoint(round=round_, model={"w": torch.full((2, 3), float(round_))},
                      accountant={"releases": round_, "backend": None}, job_id="0" * 32,
                      rounds=[{"round": r} for r in range(1, round_ + 1)])


# --- the checkpoint file ---------------------------------------------------------
@pytest.mark.parametrize("step", ["keep-previous", "write-new"])
def test_a_checkpoint_write_cut_short_leaves_the_last_one_in_place(tmp_path, monkeypatch, step):
    save_checkpoint(tmp_path, _checkpoint(1))
    save_checkpoint(tmp_path, _checkpoint(2))

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    target = "_keep_previous" if step == "keep-previous" else "atomic_write"
    monkeypatch.setattr(checkpoint_module, target, killed)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, _checkpoint(3))
    assert load_checkpoint(tmp_path).round == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([CHECKPOINT, PREVIOUS])


def test_the_previous_checkpoint_is_a_copy_not_the_current_file_moved(tmp_path):
    save_checkpoint(tmp_path, _checkpoint(1))
    save_checkpoint(tmp_path, _checkpoint(2))
    save_checkpoint(tmp_path, _checkpoint(3))
    assert load_checkpoint(tmp_path).round == 3
    assert torch.load(tmp_path / PREVIOUS, weights_only=True)["round"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([CHECKPOINT, PREVIOUS])  # no temporary left


# --- the signal handling -----------------------------------------------------------
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_inside_a_deferred_block_is_raised_when_it_ends(signum):
    reached_end = False
    # the statements are the point: the signal must be raised when the deferred block ends, not inside it
    with interrupts.handled(), pytest.raises((KeyboardInterrupt, SystemExit)) as raised, interrupts.deferred():  # noqa: PT012
        os.kill(os.getpid(), signum)
        time.sleep(0.05)  # the handler runs here, and must not raise
        reached_end = True
    assert reached_end and interrupts.interrupt_exit_code(raised.value) == CODES[signum]


def test_other_exceptions_are_not_interrupts():
    assert interrupts.interrupt_exit_code(SystemExit(1)) is None
    assert interrupts.interrupt_exit_code(RuntimeError("x")) is None


# --- whole runs, in this process ---------------------------------------------------------
def _sets(results: Path) -> list[str]:
    return set_args(*SETTINGS, f'results-dir="{results}"')


class _LateSignals:
    """Record SIGINT/SIGTERM instead of raising, around a run: a timer that fires after the run ended is harmless."""

    def __enter__(self) -> _LateSignals:
        self.seen: list[int] = []
        self.previous = {s: signal.signal(s, lambda signum, frame: self.seen.append(signum))
                         for s in interrupts.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)


class _Checkpoints:
    """The moments the run's rounds are checkpointed, as events: a signal can be aimed inside a chosen round."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.times: list[float] = []
        self.written: dict[int, threading.Event] = {}
        original = server_app.save_checkpoint

        def recorded(directory: Path, checkpoint: Checkpoint) -> Path:
            path = original(directory, checkpoint)
            self.times.append(time.perf_counter())
            self.written.setdefault(checkpoint.round, threading.Event()).set()
            return path

        monkeypatch.setattr(server_app, "save_checkpoint", recorded)

    def reset(self) -> None:
        self.times.clear()
        self.written.clear()

    def event(self, round_: int) -> threading.Event:
        return self.written.setdefault(round_, threading.Event())


def _interrupted_run(engine: str, results: Path, signum: int, after_round: int, delay: float,
                     checkpoints: _Checkpoints, capsys) -> tuple[int, str, bool]:
    """``fedhog run`` with ``signum`` sent to this process ``delay`` s after round ``after_round`` is checkpointed
    (0: after the run starts): exit code, stderr, whether it fired."""
    fired = threading.Event()
    lock = threading.Lock()
    done = False
    checkpoints.reset()
    anchor = checkpoints.event(after_round)
    if after_round == 0:
        anchor.set()

    def fire() -> None:
        if not anchor.wait(timeout=120):
            return
        time.sleep(delay)
        with lock:
            if not done:
                os.kill(os.getpid(), signum)
                fired.set()

    capsys.readouterr()
    with _LateSignals():
        timer = threading.Thread(target=fire, daemon=True)
        timer.start()
        code = cli.main(["run", "--engine", engine, *_sets(results)])
        with lock:
            done = True
        anchor.set()  # a run that stopped before its anchor round releases the timer, which then does nothing
        timer.join()
        time.sleep(0.05)  # a signal sent just before `done` is handled by now
    return code, capsys.readouterr().err, fired.is_set()


def _same_results(reference: Path, resumed: Path) -> None:
    a = read_metrics(reference)
    b = read_metrics(resumed)
    assert b["status"] == "finished"
    assert [r["round"] for r in b["rounds"]] == [r["round"] for r in a["rounds"]]
    assert [r["accuracy"] for r in b["rounds"]] == [r["accuracy"] for r in a["rounds"]]
    assert [r["epsilon"] for r in b["rounds"]] == pytest.approx([r["epsilon"] for r in a["rounds"]], rel=1e-12)
    final_a, final_b = (torch.load(d / "final_model.pt") for d in (reference, resumed))
    for key in final_a:
        torch.testing.assert_close(final_a[key], final_b[key], rtol=0, atol=1e-6)


def _check_interrupted(results: Path, code: int, err: str, signum: int) -> int:
    """The checks every interrupted run must pass; the round its checkpoint holds (0: none)."""
    assert code == CODES[signum], err
    assert "Traceback" not in err, err
    assert f"continue with: fedhog run --resume {results}" in " ".join(err.split()), err
    document = read_metrics(results)
    assert document["status"] == "interrupted"
    leftovers = [p.name for p in results.iterdir() if p.name.startswith(".")]
    assert leftovers == [], leftovers
    try:
        checkpoint = load_checkpoint(results)
    except CheckpointError:
        assert not (results / CHECKPOINT).exists()
        assert "starts again from round 1" in err
        return 0
    # the round's metrics and its checkpoint are written together: an interrupt never separates them
    assert [r["round"] for r in checkpointed_rounds(results, checkpoint)] == list(range(1, checkpoint.round + 1))
    assert len(document.get("rounds", [])) == checkpoint.round
    return checkpoint.round


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_an_interrupt_during_a_checkpoint_write_waits_for_it(tmp_path, monkeypatch, capsys, one_thread):
    """SIGINT arrives while round 2's checkpoint is being written: that checkpoint is completed, then the run stops."""
    written = checkpoint_module.atomic_write

    def slow_write(path: Path, data: bytes) -> None:
        if path.name == CHECKPOINT and torch.load(__import__("io").BytesIO(data), weights_only=True)["round"] == 2:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        written(path, data)

    monkeypatch.setattr(checkpoint_module, "atomic_write", slow_write)
    results = tmp_path / "run"
    code = cli.main(["run", "--engine", "inprocess", *_sets(results)])
    err = capsys.readouterr().err
    assert _check_interrupted(results, code, err, signal.SIGINT) == 2
    assert "rounds 1–2 are kept" in err


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_while_the_folder_is_claimed_leaves_a_resumable_run(tmp_path, monkeypatch, capsys, signum,
                                                                        one_thread):
    """The signal lands while the results folder is being claimed: the claim completes, the folder says
    "interrupted" with the resume hint, and ``--resume`` runs the whole run to the reference's end."""
    from fedhog.engines import claim_run as real_claim

    def claim_then_signal(*args, **kwargs):
        claimed = real_claim(*args, **kwargs)
        os.kill(os.getpid(), signum)
        time.sleep(0.05)  # the handler has run by now: deferred, so raised when the claim's block ends
        return claimed

    monkeypatch.setattr(cli, "claim_run", claim_then_signal)
    results = tmp_path / "run"
    code = cli.main(["run", "--engine", "inprocess", *_sets(results)])
    err = capsys.readouterr().err
    assert _check_interrupted(results, code, err, signum) == 0
    assert "no round had finished" in " ".join(err.split())
    monkeypatch.undo()
    assert cli.main(["run", "--resume", str(results)]) == 0, capsys.readouterr().err
    reference = tmp_path / "reference"
    assert cli.main(["run", "--engine", "inprocess", *_sets(reference)]) == 0
    _same_results(reference, results)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["inprocess", "vectorized"])
def test_interrupts_at_random_moments_lose_nothing(tmp_path, engine, capsys, monkeypatch, one_thread):
    """Fault injection: SIGINT or SIGTERM at 10 random moments of a run; every one resumes to the reference.

    Each moment is drawn inside a chosen phase (start-up, or round k) of a timed run, so the rounds are covered
    however much of the run the start-up takes on the machine (on a fast one the rounds are a sliver of it)."""
    checkpoints = _Checkpoints(monkeypatch)
    reference = tmp_path / "reference"
    assert cli.main(["run", "--engine", engine, *_sets(reference)]) == 0  # also pays the one-time costs (data, imports)
    checkpoints.reset()
    started = time.perf_counter()  # how long each phase lasts once they are paid: the moments are drawn within it
    assert cli.main(["run", "--engine", engine, *_sets(tmp_path / "timed")]) == 0
    rounds = len(checkpoints.times)
    moments = [started, *checkpoints.times]
    phases = [b - a for a, b in itertools.pairwise(moments)]  # start-up with round 1, then each round
    rng = random.Random(23)
    anchors = [attempt % rounds for attempt in range(10)]  # every phase at least once
    rng.shuffle(anchors)
    seen_rounds, fired_count = set(), 0
    for attempt, after_round in enumerate(anchors):
        results = tmp_path / f"attempt-{attempt}"
        signum = rng.choice(interrupts.SIGNALS)
        delay = rng.uniform(0, phases[after_round])
        code, err, fired = _interrupted_run(engine, results, signum, after_round, delay, checkpoints, capsys)
        if fired and not (results / "metrics.json").exists():  # it landed before the folder was claimed
            assert code == CODES[signum] and "Traceback" not in err, err
            assert "interrupted before the run started" in " ".join(err.split()), err
            fired_count += 1
            seen_rounds.add(0)
            assert cli.main(["run", "--engine", engine, *_sets(results)]) == 0  # nothing to resume: run it again
            _same_results(reference, results)
            continue
        finished = read_metrics(results)["status"] == "finished"
        if not fired or finished:  # the run finished first (or the signal came while its summary was printed)
            assert code == (CODES[signum] if fired else 0), err
            _same_results(reference, results)
            continue
        fired_count += 1
        seen_rounds.add(_check_interrupted(results, code, err, signum))
        assert cli.main(["run", "--resume", str(results)]) == 0, capsys.readouterr().err
        _same_results(reference, results)
    assert fired_count >= 5 and len(seen_rounds) >= 3, f"too few interrupts landed: {fired_count}, {seen_rounds}"


@pytest.mark.slow
@pytest.mark.subprocess
def test_ctrl_c_on_the_simulation_engine_keeps_only_the_runs_own_rounds(tmp_path, capsys, one_thread):
    """Flower's engine: the clients die before the ServerApp on Ctrl-C; the round they were in must not be kept
    (it used to be recorded and checkpointed as 'every sampled client failed', and the resume diverged)."""
    import subprocess
    import sys
    import tempfile

    reference = tmp_path / "reference"
    assert cli.main(["run", "--engine", "inprocess", *_sets(reference)]) == 0
    broken = tmp_path / "broken"
    with tempfile.TemporaryDirectory(prefix="ray", dir="/tmp") as ray:
        env = {**os.environ, "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "OMP_NUM_THREADS": "1",
               "RAY_TMPDIR": os.environ.get("RAY_TMPDIR", ray)}
        command = [sys.executable, "-m", "fedhog.cli", "run", "--engine", "simulation"]
        victim = subprocess.Popen([*command, *_sets(broken)], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        wait_for_checkpoint(victim, broken, 1, poll=0.1)  # interrupt once a round is checkpointed
        victim.send_signal(signal.SIGINT)
        output = victim.communicate(timeout=120)[0]
        kept = _check_interrupted(broken, victim.returncode, output, signal.SIGINT)
        assert 1 <= kept < 6
        document = read_metrics(broken)
        assert all(not r["rejections"] for r in document["rounds"]), document["rounds"]
        assert not (broken / ".stop-requested").exists()
        resumed = subprocess.run([*command, "--resume", str(broken)], env=env, capture_output=True, text=True,
                                 timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    a = read_metrics(reference)
    b = read_metrics(broken)
    assert b["resumed_after_round"] == kept
    assert [r["clients_accepted"] for r in b["rounds"]] == [r["clients_accepted"] for r in a["rounds"]]
    assert [r["epsilon"] for r in b["rounds"]] == pytest.approx([r["epsilon"] for r in a["rounds"]], rel=1e-12)
    assert [r["accuracy"] for r in b["rounds"]] == pytest.approx([r["accuracy"] for r in a["rounds"]], abs=1e-9)

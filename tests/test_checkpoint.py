"""Checkpoints: atomic, validated, and a killed run resumes as if it never stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch
from helpers import read_metrics, set_args, wait_for_checkpoint

from fedhog.checkpoint import CHECKPOINT, PREVIOUS, Checkpoint, CheckpointError, load_checkpoint, save_checkpoint


def _checkpoint(round_: int) -> Checkpoint:
    return Checkpoint(round=round_, model={"w": torch.full((2, 3), float(round_))},
                      accountant={"releases": round_, "backend": None}, job_id="0" * 32,
                      rounds=[{"round": r, "epsilon": 0.1 * r} for r in range(1, round_ + 1)])


def test_round_trip_and_previous_is_kept(tmp_path):
    save_checkpoint(tmp_path, _checkpoint(1))
    save_checkpoint(tmp_path, _checkpoint(2))
    loaded = load_checkpoint(tmp_path)
    assert loaded.round == 2 and torch.equal(loaded.model["w"], torch.full((2, 3), 2.0))
    assert loaded.rounds[-1] == {"round": 2, "epsilon": 0.2}
    assert torch.load(tmp_path / PREVIOUS, weights_only=True)["round"] == 1


@pytest.mark.parametrize("damage", ["truncate", "garbage", "not-a-checkpoint"])
def test_a_damaged_checkpoint_is_a_clear_error_and_the_previous_stays(tmp_path, damage):
    save_checkpoint(tmp_path, _checkpoint(1))
    save_checkpoint(tmp_path, _checkpoint(2))
    path = tmp_path / CHECKPOINT
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "garbage":
        path.write_bytes(b"\x00not a zip at all")
    else:
        torch.save({"something": "else"}, path)
    with pytest.raises(CheckpointError, match=f"{CHECKPOINT} is corrupt.*{PREVIOUS}"):
        load_checkpoint(tmp_path)
    assert torch.load(tmp_path / PREVIOUS, weights_only=True)["round"] == 1


def test_resume_without_a_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match=r"no checkpoint.pt"):
        load_checkpoint(tmp_path)


SETTINGS = ["dataset=\"digits\"", "model=\"logreg\"", "population=10", "sampling-rate=0.5", "rounds=6",
            "partitioner=\"iid\"", "privacy-seed=3", "noise-multiplier=0.7", "clipping-norm=2.0"]


def _command(env, *args: str, results) -> subprocess.Popen:
    argv = [sys.executable, "-m", "fedhog.cli", "run", "--engine", "inprocess", *args]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _settings(results) -> list[str]:
    return set_args(*SETTINGS, f'results-dir="{results}"')


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: the run that was never stopped."""
    folder = tmp_path_factory.mktemp("reference")
    env = {**os.environ, "FEDHOG_CACHE": str(folder / "cache"), "OMP_NUM_THREADS": "1"}
    whole = folder / "whole"
    reference = _command(env, *_settings(whole), results=whole)
    assert reference.wait(timeout=300) == 0, reference.communicate()[0]
    return whole, env


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGINT, signal.SIGTERM], ids=["kill", "int", "term"])
def test_a_killed_run_resumes_to_the_same_result(tmp_path, uninterrupted, signum):
    whole, env = uninterrupted
    broken = tmp_path / "broken"

    victim = _command(env, *_settings(broken), results=broken)
    wait_for_checkpoint(victim, broken, 2)  # kill it once two rounds are checkpointed
    victim.send_signal(signum)
    output = victim.communicate(timeout=120)[0]
    killed_after = load_checkpoint(broken).round
    assert killed_after < 6, "the run finished before it could be killed"
    if signum != signal.SIGKILL:  # a signal fedhog can handle: its exit code, the hint, the folder marked
        assert victim.returncode == 128 + signum, output
        assert "terminate called" not in output and "Traceback" not in output, output
        assert f"continue with: fedhog run --resume {broken}" in " ".join(output.split()), output
        assert read_metrics(broken)["status"] == "interrupted"
        assert load_checkpoint(broken).round == killed_after  # no round lost by the interrupt itself

    resumed = _command(env, "--resume", str(broken), results=broken)
    assert resumed.wait(timeout=300) == 0, resumed.communicate()[0]

    a = read_metrics(whole)
    b = read_metrics(broken)
    assert b["resumed_after_round"] == killed_after
    assert [r["round"] for r in b["rounds"]] == list(range(1, 7))
    assert b["summary"]["epsilon"] == pytest.approx(a["summary"]["epsilon"], rel=1e-12)
    assert [r["accuracy"] for r in b["rounds"]] == [r["accuracy"] for r in a["rounds"]]
    final_a = torch.load(whole / "final_model.pt")
    final_b = torch.load(broken / "final_model.pt")
    for key in final_a:
        torch.testing.assert_close(final_a[key], final_b[key], rtol=0, atol=1e-6)

"""IdleSweeper over a real Token2WavScheduler whose clock the test sets: frees abandoned streams, then wakes."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from cosyvoice_triton.models.flow import FlowModel
from cosyvoice_triton.models.hift import HiFTGenerator
from cosyvoice_triton.token2wav.idle_sweeper import IdleSweeper
from cosyvoice_triton.token2wav.stream import FlowPrompt
from cosyvoice_triton.token2wav.scheduler import ChunkRequest, Token2WavScheduler
from polling import wait_until

pytestmark = pytest.mark.timeout(120)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def models(golden_model_dir) -> tuple[FlowModel, HiFTGenerator]:
    return FlowModel.from_model_dir(golden_model_dir), HiFTGenerator.from_model_dir(golden_model_dir)


@pytest.fixture
def scheduler(models) -> Token2WavScheduler:
    """An scheduler with stream s0 opened at clock 0 and s1 at clock 5 (each idle 10 s later)."""
    scheduler = Token2WavScheduler(*models, idle_timeout_s=10.0, clock=FakeClock())
    rng = torch.Generator().manual_seed(0)
    for i in range(2):
        scheduler.clock.now = 5.0 * i
        prompt = FlowPrompt(torch.randint(0, 6561, (1, 6), dtype=torch.int32, generator=rng),
                            torch.randn(1, 12, 80, generator=rng), torch.randn(1, 192, generator=rng))
        (audio,) = scheduler.run([ChunkRequest(f"s{i}", list(range(10 + i, 20 + i)), False, prompt, seed=i)])
        assert isinstance(audio, np.ndarray)
    assert scheduler.stats.active_streams == 2
    return scheduler


class Wakes:
    def __init__(self, fail: bool = False) -> None:
        self.count = 0
        self.fail = fail

    def __call__(self) -> None:
        self.count += 1
        if self.fail:
            raise RuntimeError("the server is shutting down")


def test_sweep_once_frees_idle_streams_then_wakes(scheduler):
    wakes = Wakes()
    sweeper = IdleSweeper(scheduler.sweep_idle, wakes, interval_s=1.0)
    scheduler.clock.now = 9.0
    assert sweeper.sweep_once() == [] and wakes.count == 0  # nothing idle yet: no wake
    scheduler.clock.now = 20.5
    assert sorted(sweeper.sweep_once()) == ["s0", "s1"] and wakes.count == 1  # one wake for both
    assert scheduler.stats.active_streams == 0 and scheduler.stats.freed["idle"] == 2
    assert sweeper.sweep_once() == [] and wakes.count == 1


def test_the_lock_is_held_while_freeing_not_while_waking(scheduler):
    lock = threading.Lock()
    held = []

    def free_idle():
        held.append(("free", lock.locked()))
        return scheduler.sweep_idle()

    sweeper = IdleSweeper(free_idle, lambda: held.append(("wake", lock.locked())), interval_s=1.0, lock=lock)
    scheduler.clock.now = 11.0
    assert sweeper.sweep_once() == ["s0"]
    assert held == [("free", True), ("wake", False)]


def test_the_timer_sweeps_until_stopped_and_survives_a_failed_wake(scheduler):
    wakes, lock = Wakes(fail=True), threading.Lock()  # the lock: the scheduler has one caller at a time
    sweeper = IdleSweeper(scheduler.sweep_idle, wakes, interval_s=0.01, lock=lock)
    sweeper.start()
    try:
        with lock:
            scheduler.clock.now = 10.5
        wait_until(lambda: wakes.count == 1, 30)  # s0 freed by the timer, nobody calling the scheduler
        assert scheduler.stats.freed["idle"] == 1 and scheduler.stats.active_streams == 1
        with lock:
            scheduler.clock.now = 15.5
        wait_until(lambda: wakes.count == 2, 30)  # the failed wake did not end the timer
    finally:
        sweeper.stop()
    assert scheduler.stats.freed["idle"] == 2 and scheduler.stats.active_streams == 0
    assert not sweeper._thread.is_alive()


def test_interval_must_be_positive():
    with pytest.raises(ValueError):
        IdleSweeper(lambda: [], lambda: None, interval_s=0)

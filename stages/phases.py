"""Where a unit of RL work's time goes: named phases on the wall clock, and how busy the GPU was
in each, as nvidia-smi would show it (the record's names: core/metrics.py ROLLOUT_PHASES).

`Clock.phase(name)` times a phase; `Clock.add(name, seconds)` counts a part measured inside one
(ZeRO-3's weight gathering, offloaded models' moves). On a GPU whose utilisation NVML can read
(torch.cuda.utilization: the nvidia-ml-py package) a background thread reads it every SAMPLE_S
and files each reading under the phase running at the time; a phase's busy share is the mean of
its readings. NVML's figure is the share of its own last sample period (1/6 s to 1 s, by GPU) in
which a kernel ran, so a phase much shorter than that period partly reads its neighbours. A phase
with no reading, and every phase on a CPU or without NVML, is None: never a made-up number.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("stages")

SAMPLE_S = 0.05  # NVML's own sample period is longer (1/6 s and up): reading faster only repeats it


def nvml_reader(device) -> Callable[[], float] | None:
    """A function reading the GPU's utilisation as a 0-1 share, or None (a CPU, or NVML unreadable:
    no nvidia-ml-py, no driver access), said once in the log."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    try:
        torch.cuda.utilization(device)
    except Exception as err:  # noqa: BLE001 -- ModuleNotFoundError without pynvml, NVMLError_* from the driver
        log.info("GPU busy share not measured: NVML unreadable (%s: %s)", type(err).__name__, err)
        return None
    return lambda: torch.cuda.utilization(device) / 100.0


class Clock:
    """The seconds of each named phase (and part) since the last `take`, and the GPU's readings in each.
    `read_busy`: a 0-1 utilisation reader (nvml_reader), None where there is none."""

    def __init__(self, read_busy: Callable[[], float] | None = None, sample_s: float = SAMPLE_S):
        self.seconds: dict[str, float] = {}
        self.readings: dict[str, list[float]] = {}
        self._sample_s = sample_s
        self._stack: list[str] = []  # the phases entered and not left, innermost last
        self._since = 0.0  # when the innermost phase was last entered or resumed
        self._lock = threading.Lock()  # the sampling thread files readings while `take` reads them
        self._stop = threading.Event()
        self._thread = None
        if read_busy is not None:
            self._thread = threading.Thread(target=self._sample, args=(read_busy,), name="gpu-busy", daemon=True)
            self._thread.start()

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time spent inside counts to `name`; phases nest, and a nested phase's time counts to it
        alone, not to the phase around it: the phases of a unit add up to its wall time."""
        now = time.perf_counter()
        if self._stack:
            self.add(self._stack[-1], now - self._since)
        self._stack.append(name)
        self._since = now
        try:
            yield
        finally:
            now = time.perf_counter()
            self.add(name, now - self._since)
            self._stack.pop()
            self._since = now

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def busy(self, name: str) -> float | None:
        """Mean GPU utilisation (0-1) read during the phase; None without readings."""
        values = self.readings.get(name)
        return sum(values) / len(values) if values else None

    def busy_overall(self) -> float | None:
        values = [v for part in self.readings.values() for v in part]
        return sum(values) / len(values) if values else None

    def take(self) -> tuple[dict[str, float], dict[str, float | None]]:
        """(seconds per phase, busy share per phase and "overall") since the last take; starts afresh."""
        with self._lock:
            busy = {name: self.busy(name) for name in self.readings}
            busy["overall"] = self.busy_overall()
            self.readings = {}
        seconds, self.seconds = self.seconds, {}
        return seconds, busy

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)

    def _sample(self, read: Callable[[], float]) -> None:
        while not self._stop.wait(self._sample_s):
            try:
                name = self._stack[-1]
            except IndexError:  # between phases
                continue
            try:
                value = read()
            except Exception as err:  # noqa: BLE001 -- NVML gone mid-run: stop reading rather than guess
                log.warning("GPU busy share: NVML reading failed (%s); no more readings", err)
                return
            with self._lock:
                self.readings.setdefault(name, []).append(value)

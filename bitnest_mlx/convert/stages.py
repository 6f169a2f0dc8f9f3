"""Wall time and peak resident memory per conversion stage (read, calibrate, quantize, write,
draft_vocab).

The process's peak RSS (`getrusage`) only says the maximum so far, so a sampling thread reads the
current memory every `interval` seconds and charges it to the stage running then; the peak is
reported beside. The memory is the process's RSS plus its children's (the quantization workers')
private pages: the pages a worker shares, the libraries mainly, are the converter's too, and a
sum of RSS would count them twice. Stages may be entered many times (once per layer); their
times add up.
"""

from __future__ import annotations

import resource
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

STAGES = ("read", "calibrate", "quantize", "write", "draft_vocab")
_PAGE = 4096


def _statm_rss(pid: str) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):  # the process has just exited
        return 0


def _private(pid: str) -> int:
    """A process's resident pages that no other process maps."""
    try:
        lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    except OSError:  # the process has just exited
        return 0
    fields = (line.split() for line in lines)
    return sum(int(f[1]) * 1024 for f in fields if f[0] in ("Private_Clean:", "Private_Dirty:"))


def _children() -> list[str]:
    """This process's child pids (Linux), e.g. the quantization workers."""
    out = []
    for task in Path("/proc/self/task").glob("*"):
        try:
            out += (task / "children").read_text().split()
        except OSError:
            pass
    return out


def current_rss() -> int:
    """Resident bytes of this process and the private ones of its children now (Linux /proc;
    elsewhere this process's peak so far)."""
    if Path("/proc/self/statm").is_file():
        return _statm_rss("self") + sum(_private(pid) for pid in _children())
    return peak_rss()


def peak_rss() -> int:
    """Peak resident bytes of this process so far (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class Stages:
    """`with stages("calibrate"): ...` times a stage and samples its RSS; `report()` is the
    manifest's and the CLI's record: per stage seconds and peak GB, the total, the process peak.
    """

    def __init__(self, interval: float = 0.1):
        self.seconds = dict.fromkeys(STAGES, 0.0)
        self.peak = dict.fromkeys(STAGES, 0)
        self.current: str | None = None
        self.entered: list[str] = []
        self.start = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(interval,), daemon=True)
        self._thread.start()

    def _sample(self, interval: float) -> None:
        while not self._stop.wait(interval):
            stage = self.current
            if stage is not None:
                self.peak[stage] = max(self.peak[stage], current_rss())

    @contextmanager
    def __call__(self, stage: str):
        assert stage in STAGES, stage
        outer, self.current = self.current, stage
        if stage not in self.entered:
            self.entered.append(stage)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.peak[stage] = max(self.peak[stage], current_rss())
            self.seconds[stage] += time.perf_counter() - t0
            self.current = outer

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def report(self) -> dict:
        """The stages entered so far (the manifest's record is written before `draft_vocab`)."""
        gb = 1e9
        return {
            "stages": {
                s: {
                    "seconds": round(self.seconds[s], 1),
                    "peak_rss_gb": round(self.peak[s] / gb, 3),
                }
                for s in STAGES
                if s in self.entered
            },
            "seconds": round(time.perf_counter() - self.start, 1),
            # The kernel's high-water mark and our samples count pages a little differently.
            "peak_rss_gb": round(max(peak_rss(), *self.peak.values()) / gb, 3),
        }

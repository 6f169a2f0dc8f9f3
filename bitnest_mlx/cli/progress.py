"""Progress bars on stderr for long work, shown only on a terminal (tqdm turns itself off when
stderr is a file or a pipe, so logs and tests see none)."""

from __future__ import annotations

from tqdm import tqdm


class StageBars:
    """A `progress(stage, done, total)` callback (evaluation.Progress): one bar per stage,
    the previous one closed when the next stage starts."""

    def __init__(self) -> None:
        self.stage: str | None = None
        self.bar: tqdm | None = None

    def __call__(self, stage: str, done: int, total: int) -> None:
        if stage != self.stage:
            self.close()
            self.stage = stage
            self.bar = tqdm(total=total, desc=stage, leave=False, disable=None)
        self.bar.n = done
        self.bar.refresh()
        if done >= total:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.bar, self.stage = None, None

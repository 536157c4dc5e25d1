"""Where the host's time goes, in every thread: a background thread samples ``sys._current_frames()`` at a
fixed interval and counts, per thread, the innermost frame (self time) and every frame on the stack
(inclusive time). cProfile sees only the thread it runs in; a training step's backward hooks run on the
autograd engine's device thread, so a sampler is what shows them.

    with StackSampler(interval=0.001) as sampler:
        ...  # the steps to look at
    print(sampler.report(top=30))
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from types import FrameType, TracebackType


def _where(frame: FrameType) -> str:
    code = frame.f_code
    path = code.co_filename
    for marker in ("site-packages/", "src/", "lib/python3"):
        cut = path.rfind(marker)
        if cut >= 0:
            path = path[cut + len(marker) :]
            break
    return f"{path}:{code.co_name}"


class StackSampler:
    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self.samples: Counter[int] = Counter()  # per thread ident: samples taken while it had a frame
        self.self_time: dict[int, Counter[str]] = {}
        self.inclusive: dict[int, Counter[str]] = {}
        self.names: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._switch = 0.005
        self.elapsed = 0.0

    def __enter__(self) -> StackSampler:
        # The sampler needs the GIL to read the stacks: with the default 5 ms switch interval a thread busy
        # in Python would be seen only when it releases the GIL (in torch's calls), biasing the counts.
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(self.interval / 4)
        self._start = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.elapsed = time.perf_counter() - self._start
        sys.setswitchinterval(self._switch)

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval):
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                if ident not in self.names:  # named while alive: a thread may end before the report
                    self.names.update((t.ident, t.name) for t in threading.enumerate() if t.ident is not None)
                self.samples[ident] += 1
                self.self_time.setdefault(ident, Counter())[_where(frame)] += 1
                seen: set[str] = set()
                inclusive = self.inclusive.setdefault(ident, Counter())
                f: FrameType | None = frame
                while f is not None:
                    key = _where(f)
                    if key not in seen:  # recursion counts once per sample
                        seen.add(key)
                        inclusive[key] += 1
                    f = f.f_back

    def report(self, top: int = 30, focus: str = "ds_strategy") -> str:
        lines = [f"stack samples every {1e3 * self.interval:g} ms over {self.elapsed:.2f} s"]
        for ident, count in self.samples.most_common():
            name = self.names.get(ident, f"thread {ident}")
            lines.append(f"\n== {name}: {count} samples ==")
            lines.append("-- self (innermost frame) --")
            lines += [f"{n:7d} {100 * n / count:5.1f}%  {k}" for k, n in self.self_time[ident].most_common(top)]
            lines.append("-- inclusive (anywhere on the stack) --")
            lines += [f"{n:7d} {100 * n / count:5.1f}%  {k}" for k, n in self.inclusive[ident].most_common(top)]
            focused = [(k, n) for k, n in self.inclusive[ident].most_common() if focus in k]
            if focused:
                lines.append(f"-- inclusive, every frame of {focus} --")
                lines += [f"{n:7d} {100 * n / count:5.1f}%  {k}" for k, n in focused]
        return "\n".join(lines)

"""The online cost fits of the speculation length (runtime.serve.spec_length): seconds against rows or slots.

LinearCost is an exponentially weighted least-squares line; GroupedCost fits a line through per-group medians
(a group: one number of draft tokens, or one batch size), so a group seen rarely keeps its say beside one seen
every step and one slow first run (a CUDA graph captured, a shape planned) does not move it. Both keep the
intercept and the slope >= 0, and with one x seen take the cost as proportional: more rows never look free.
"""

from __future__ import annotations

import numpy as np

DECAY = 0.98  # weight of the past per observation in LinearCost
GROUP_WINDOW = 9  # a cost group's cost: the median of its last this many observations


class LinearCost:
    """seconds ~ a + b * x, exponentially weighted least squares with a and b kept >= 0."""

    def __init__(self, decay: float = DECAY):
        self.decay = decay
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self.count = 0

    def observe(self, x: float, seconds: float) -> None:
        d = self.decay
        self._w = d * self._w + 1.0
        self._x = d * self._x + x
        self._y = d * self._y + seconds
        self._xx = d * self._xx + x * x
        self._xy = d * self._xy + x * seconds
        self.count += 1

    def line(self) -> tuple[float, float]:
        """(a, b). With a single x seen so far the slope is unknown: the cost is taken as proportional
        (a = 0), which never makes more rows look free."""
        return _line(self._w, self._x, self._y, self._xx, self._xy)

    def predict(self, x):
        a, b = self.line()
        return a + b * np.asarray(x, dtype=np.float64)


def _line(w, sx, sy, sxx, sxy) -> tuple[float, float]:
    if not w:
        return 0.0, 0.0
    mx, my = sx / w, sy / w
    var = sxx / w - mx * mx
    if var <= 1e-9 * max(mx * mx, 1.0):
        return 0.0, (my / mx if mx > 0 else 0.0)
    b = (sxy / w - mx * my) / var
    if b < 0:
        return max(my, 0.0), 0.0
    a = my - b * mx
    if a < 0:
        return 0.0, my / mx if mx > 0 else b
    return a, b


class GroupedCost:
    """seconds ~ a + b * x fitted through per-group costs (a group: one G, or one batch size).

    A group's cost is the median of its last GROUP_WINDOW observations (x: their mean), and its weight in the
    fit is bounded, so a group seen rarely (the probe steps of a bucket that decodes plainly, the plain steps
    a drafting bucket explores) keeps its say next to one seen every step, and a first run does not: a path
    meeting a new shape (a CUDA graph captured, ONNX Runtime planning a new window) costs several steps once.
    One group alone: proportional (LinearCost's rule)."""

    def __init__(self, window: int = GROUP_WINDOW):
        self.window = window
        self.groups: dict = {}  # key -> [x mean, seconds median, weight]
        self._seen: dict = {}  # key -> its recent (x, seconds), at most `window`
        self.count = 0
        self._line: tuple[float, float] | None = None  # cached until the next observation
        self._spread = 0

    def observe(self, key, x: float, seconds: float) -> None:
        self._line = None
        recent = self._seen.setdefault(key, [])
        recent.append((float(x), float(seconds)))
        if len(recent) > self.window:
            del recent[0]
        ys = sorted(r[1] for r in recent)
        mid = len(ys) // 2
        median = ys[mid] if len(ys) % 2 else 0.5 * (ys[mid - 1] + ys[mid])
        self.groups[key] = [sum(r[0] for r in recent) / len(recent), median, float(len(recent))]
        self.count += 1

    def line(self) -> tuple[float, float]:
        if self._line is None:
            w = sx = sy = sxx = sxy = 0.0
            for x, y, weight in self.groups.values():
                w += weight
                sx += weight * x
                sy += weight * y
                sxx += weight * x * x
                sxy += weight * x * y
            self._line = _line(w, sx, sy, sxx, sxy)
            self._spread = len({round(g[0], 6) for g in self.groups.values()})
        return self._line

    def predict(self, x: float) -> float:
        a, b = self.line()
        return a + b * x

    def predict_at(self, key, x: float) -> float:
        """The cost at x of group `key`: its own mean moved along the fit's slope where it was measured
        (a group may run another code path than its neighbours: a GPU engine's single-token decode
        graph with CUDA graphs against its batched graph for verification rows), else the fit."""
        g = self.groups.get(key)
        if g is None:
            return self.predict(x)
        _, b = self.line()
        return max(g[1] + b * (x - g[0]), 0.0)

    @property
    def spread(self) -> int:
        """Distinct x values seen (2 or more: the slope is measured, not assumed)."""
        self.line()
        return self._spread

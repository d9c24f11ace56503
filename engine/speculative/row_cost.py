"""What one more row costs a decode step, measured as the engine runs, and how many
drafts are worth their rows (plain Python: the scheduler imports no torch).

A verify row costs nearly a decode row: where a step reads its weights once for all
its rows (small batches on a CPU, most GPU decode steps) extra rows are nearly free,
and where it is compute-bound (a CPU batch of 8) each row costs about a row's share
of the step. Drafts pay only in the first case, so the proposers ask this model.

The engine loop reports each decode-only step (every entry one token plus its
drafts): its rows and its seconds. Per row count the seconds are a moving average;
a line t(rows) = base + per_row * rows is fitted to those averages by least
squares, each weighted by how often its row count was seen (at most WEIGHT_CAP).

The j-th draft of a request is kept with probability p**j (p: the request's share of
kept drafts, shrunk towards the engine's). Adding it to a step of `rows` rows gains
p**j tokens for per_row seconds, while the step makes rows / t(rows) tokens a second:
it is worth its row while p**j >= per_row * rows / t(rows). A step of 1 row whose
rows cost a tenth of it takes drafts kept one time in ten; a compute-bound batch of
8 takes none unless they are kept nearly always, so speculation turns itself off
where it would lose.

Until two row counts have been seen MIN_SAMPLES times each the line is unknown and
every allowed draft is taken (the drafts themselves vary the row counts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

SMOOTHING = 0.2
"""Weight of a new step in its row count's moving average."""
MIN_SAMPLES = 3
"""Steps a row count needs before it counts towards the line."""
WEIGHT_CAP = 20
"""A row count's largest weight in the fit (counts seen often do not drown the rest)."""
PRIOR_DRAFTS = 4
"""Drafts' worth of the engine's acceptance a request's own estimate starts from."""


@dataclass
class RowCost:
    """Decode steps' seconds by row count, and the line fitted to them."""

    averages: dict[int, float] = field(default_factory=dict)
    """rows -> moving average of a decode step's seconds."""
    samples: dict[int, int] = field(default_factory=dict)
    """rows -> decode steps of that many rows seen."""

    def record(self, rows: int, seconds: float) -> None:
        """A decode-only step of `rows` rows took `seconds`."""
        if rows <= 0 or seconds <= 0.0:
            return
        seen = self.samples.get(rows, 0)
        average = self.averages.get(rows, seconds)
        self.averages[rows] = seconds if seen == 0 else \
            (1.0 - SMOOTHING) * average + SMOOTHING * seconds
        self.samples[rows] = seen + 1

    def line(self) -> tuple[float, float] | None:
        """(base, per_row) seconds of the fitted line (per_row never below 0), or None
        before two row counts have MIN_SAMPLES steps each."""
        points = [(rows, self.averages[rows], min(seen, WEIGHT_CAP))
                  for rows, seen in self.samples.items() if seen >= MIN_SAMPLES]
        if len(points) < 2:
            return None
        total = sum(w for _, _, w in points)
        mean_x = sum(w * x for x, _, w in points) / total
        mean_y = sum(w * y for _, y, w in points) / total
        spread = sum(w * (x - mean_x) ** 2 for x, _, w in points)
        slope = max(0.0, sum(w * (x - mean_x) * (y - mean_y) for x, y, w in points) / spread)
        return mean_y - slope * mean_x, slope

    def drafts_worth(self, acceptance: float, rows: int, most: int) -> int:
        """How many drafts (0..most) one request's rows are worth in a step of `rows`
        decode rows, each kept with probability acceptance**j (module docstring)."""
        fitted = self.line()
        if fitted is None or most <= 0:
            return max(0, most)
        base, per_row = fitted
        step = base + per_row * rows
        if step <= 0.0:
            return most
        threshold = per_row * rows / step
        worth, kept = 0, 1.0
        while worth < most:
            kept *= acceptance
            if kept < threshold:
                break
            worth += 1
        return worth


def acceptance_of(accepted: int, proposed: int, engine_accepted: int,
                  engine_proposed: int) -> float:
    """A request's chance to keep a draft: its own kept share, starting from the
    engine's (PRIOR_DRAFTS drafts' worth of it; 1/2 before any verify step)."""
    prior = (engine_accepted + 1) / (engine_proposed + 2)
    return (accepted + PRIOR_DRAFTS * prior) / (proposed + PRIOR_DRAFTS)

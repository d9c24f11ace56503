"""PNG charts for the benchmark reports (matplotlib, headless)."""

from __future__ import annotations


def bar_chart(values: dict[str, float], ylabel: str, title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    bars = axes.bar(list(values), list(values.values()), color="#4a78b5")
    axes.bar_label(bars, fmt="%.0f")
    axes.set_ylabel(ylabel)
    axes.set_title(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def line_chart(series: dict[str, dict[float, float]], xlabel: str, ylabel: str, title: str,
               path: str) -> None:
    """One line per series: {name: {x: y}}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    for name, points in series.items():
        xs = sorted(points)
        axes.plot(xs, [points[x] for x in xs], marker="o", label=name)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.set_title(title, fontsize=10)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)

"""The figure helpers every picture of bin/plot.py uses (matplotlib, imported only when drawing)."""

from __future__ import annotations


def pyplot():
  """matplotlib's pyplot, drawing to files only (the Agg backend)."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=import-outside-toplevel
  return plt


def panels(plt, count: int, width: float, height: float):
  """A figure of `count` panels, up to 3 a row, the unused ones hidden; (figure, the panels in order)."""
  cols = min(3, count)
  rows = -(-count // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows),
                           dpi=100, squeeze=False)
  for ax in axes.flat[count:]:
    ax.set_visible(False)
  return fig, list(axes.flat[:count])


def save(plt, fig, out: str, **layout) -> None:
  """Lays the figure out (`layout`: tight_layout's arguments), writes it to `out` and frees it."""
  fig.tight_layout(**layout)
  fig.savefig(out)
  plt.close(fig)

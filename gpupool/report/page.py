"""The HTML page of ``gpupool report``: one self-contained file (plotly.js inlined, no network).

The page is HTML5: a summary table, then one ``<section>`` per plot with a heading, a sentence on
how to read it, and the plot's ``<div id="plot-...">`` (or a note saying why there is no plot).
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass

import plotly.graph_objects as go
import plotly.io as pio

_PLOT_CONFIG = {"displaylogo": False, "responsive": True}

_CSS = """
body { font-family: system-ui, sans-serif; margin: 24px 32px; color: #222; background: #fff; }
h1 { margin: 0 0 4px 0; font-size: 24px; }
.meta { color: #666; margin: 0 0 16px 0; }
table.summary { border-collapse: collapse; margin-bottom: 24px; }
table.summary td { padding: 3px 14px 3px 0; border-bottom: 1px solid #eee; }
table.summary td.v { text-align: right; font-variant-numeric: tabular-nums; }
section { margin: 0 0 28px 0; }
section h2 { font-size: 18px; margin: 0 0 4px 0; }
section p.how { color: #555; margin: 0 0 6px 0; max-width: 70em; }
p.empty { color: #8a6d00; background: #fff8e1; padding: 8px 12px; }
"""


@dataclass(frozen=True, slots=True)
class Section:
    """One part of the page.

    Attributes:
        div_id: id of the plot's ``<div>`` (``plot-...``), unique in the page.
        heading: the section's ``<h2>`` (plain text).
        how_to_read: one or two sentences under it (plain text).
        figure: the plot, or ``None`` when there is no data.
        empty_note: shown instead of the plot when ``figure`` is ``None`` (plain text).
    """

    div_id: str
    heading: str
    how_to_read: str
    figure: go.Figure | None
    empty_note: str = ""


def render_page(
    title: str, meta: str, summary: Sequence[tuple[str, str]], sections: Sequence[Section]
) -> str:
    """The whole HTML document. ``title``, ``meta`` and the ``(label, value)`` summary rows are
    plain text (escaped here). plotly.js is inlined once, before the first plot. Raises
    ``ValueError`` if two sections share a ``div_id``."""
    ids = [s.div_id for s in sections]
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate section ids: {ids}")
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="meta">{html.escape(meta)}</p>',
        '<table class="summary">',
        *(f'<tr><td>{html.escape(k)}</td><td class="v">{html.escape(v)}</td></tr>' for k, v in summary),
        "</table>",
    ]
    js_included = False
    for s in sections:
        parts.append(f'<section id="{html.escape(s.div_id)}-section">')
        parts.append(f"<h2>{html.escape(s.heading)}</h2>")
        parts.append(f'<p class="how">{html.escape(s.how_to_read)}</p>')
        if s.figure is None:
            parts.append(f'<p class="empty">{html.escape(s.empty_note)}</p>')
        else:
            parts.append(
                pio.to_html(
                    s.figure,
                    full_html=False,
                    include_plotlyjs=not js_included,
                    div_id=s.div_id,
                    config=_PLOT_CONFIG,
                    default_width="100%",
                    default_height=f"{s.figure.layout.height or 450}px",
                )
            )
            js_included = True
        parts.append("</section>")
    parts.append("</body></html>")
    return "\n".join(parts)

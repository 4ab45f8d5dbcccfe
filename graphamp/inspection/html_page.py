"""The one HTML skeleton both report pages use (export's and the doctor's): style, escaping, numbers.

Pages stand alone: no network, no script, styles inline.
"""

from __future__ import annotations

import html
import math

__all__ = ["PAGE_STYLE", "escape", "format_number", "render_page", "section"]

PAGE_STYLE = """
body { font-family: Helvetica, Arial, sans-serif; margin: 2em; color: #222; max-width: 1200px; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; font-size: 0.9em; }
td, th { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; }
th { background: #f2f2f2; } td.n { text-align: right; }
code { background: #f4f4f4; padding: 0 0.2em; }
.picture { overflow: auto; max-height: 80vh; border: 1px solid #ccc; }
.swatch { display: inline-block; width: 0.9em; height: 0.9em; border: 1px solid #888; vertical-align: middle; }
"""


def render_page(title: str, sections: list[str], extra_style: str = "") -> str:
    """A whole page: `<h1>` is the title, then the sections (HTML already escaped by their makers)."""
    title = escape(title)
    return (
        f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>{title}</title>\n'
        f"<style>{PAGE_STYLE}{extra_style}</style>\n</head>\n<body>\n<h1>{title}</h1>\n"
        + "\n".join(sections) + "\n</body>\n</html>\n"
    )


def section(title: str, body: str, empty: str) -> str:
    """`<h2>title</h2>` and its body (HTML); with no body, the paragraph "None: `empty`"."""
    return f"<h2>{escape(title)}</h2>\n" + (body or f"<p>None: {escape(empty)}</p>")


def escape(text) -> str:
    return html.escape(str(text))


def format_number(value) -> str:
    """3 significant digits: plain from 0.01 to 1000, exponent outside; '-' for not measured."""
    if value is None:
        return "-"
    if not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return f"{value:.3g}" if value == 0 or 0.01 <= abs(value) < 1000 else f"{value:.2e}"

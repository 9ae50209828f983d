"""The report's `index.html`: one self-contained, offline page.

No external CSS, scripts or fonts: the style is inline and every figure is
a relative `<img src="NAME.png">` beside its `NAME.json`, so the folder can
be copied, zipped or opened from disk without a network.
"""

import html
import pathlib

from keras_avae.training.atomic_files import _atomic_write_text

_STYLE = """
body { font-family: sans-serif; max-width: 72em; margin: 2em auto; padding: 0 1em; color: #222; line-height: 1.45; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; }
h2 { font-size: 1.25em; border-bottom: 1px solid #ccc; padding-bottom: 0.2em; margin-top: 2em; }
table.info { border-collapse: collapse; margin: 1em 0; }
table.info th { text-align: left; padding: 0.15em 1.2em 0.15em 0; font-weight: 600; vertical-align: top; }
table.info td { padding: 0.15em 0; }
figure { margin: 0.8em 0; }
figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption, p.note { color: #444; font-size: 0.95em; }
p.note { background: #f6f6f6; padding: 0.5em 0.8em; border-left: 3px solid #bbb; }
a.data { font-size: 0.9em; }
nav ul { columns: 2; }
"""


def _escape(value):
    return html.escape(str(value), quote=True)


def render_page(title, info, figures, notes=()):
    """The HTML text of a report page.

    Args:
        title: the page's heading (e.g. the model's name).
        info: dict of header rows (label -> value), shown in order.
        figures: list of figure records (see `artifacts.save_figure`):
            `"name"`, `"title"`, `"caption"`, `"png"`, `"json"`.
        notes: list of `(title, text)` for figures left out, each shown as
            a section saying why.

    Returns:
        The page as a string.

    Example:

    >>> record = {"name": "kl", "title": "KL", "caption": "Bars.", "png": "kl.png", "json": "kl.json"}
    >>> page = render_page("m", {"weights": "pretrained"}, [record])
    >>> '<img src="kl.png"' in page and 'href="kl.json"' in page
    True
    """
    lines = [
        "<!DOCTYPE html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        f"<title>keras-avae report: {_escape(title)}</title>",
        f"<style>{_STYLE}</style>",
        "</head>",
        "<body>",
        f"<h1>keras-avae report: {_escape(title)}</h1>",
        '<table class="info">',
    ]
    lines += [f"<tr><th>{_escape(key)}</th><td>{_escape(value)}</td></tr>" for key, value in info.items()]
    lines.append("</table>")
    sections = [(f["name"], f["title"]) for f in figures] + [
        (f"note-{i}", f"{title} (left out)") for i, (title, _) in enumerate(notes)
    ]
    lines.append("<nav><ul>")
    lines += [f'<li><a href="#{_escape(anchor)}">{_escape(text)}</a></li>' for anchor, text in sections]
    lines.append("</ul></nav>")
    for record in figures:
        lines += [
            f'<section id="{_escape(record["name"])}">',
            f"<h2>{_escape(record['title'])}</h2>",
            "<figure>",
            f'<img src="{_escape(record["png"])}" alt="{_escape(record["title"])}">',
            f"<figcaption>{_escape(record['caption'])} "
            f'<a class="data" href="{_escape(record["json"])}">The numbers drawn ({_escape(record["json"])})</a>'
            "</figcaption>",
            "</figure>",
            "</section>",
        ]
    for i, (note_title, text) in enumerate(notes):
        lines += [
            f'<section id="note-{i}">',
            f"<h2>{_escape(note_title)}</h2>",
            f'<p class="note">{_escape(text)}</p>',
            "</section>",
        ]
    lines += ["</body>", "</html>", ""]
    return "\n".join(lines)


def write_page(out_dir, title, info, figures, notes=()):
    """Writes `out_dir/index.html` (see `render_page`) and returns its path.

    Args:
        out_dir: the report folder, holding the figures' files.
        title: the page's heading.
        info: dict of header rows.
        figures: list of figure records.
        notes: list of `(title, text)` for figures left out.

    Returns:
        The `pathlib.Path` of `index.html`.

    Example:

    >>> write_page(".", "m", {"images": 8}, []).name
    'index.html'
    """
    out_dir = pathlib.Path(out_dir)
    missing = [f[key] for f in figures for key in ("png", "json") if not (out_dir / f[key]).is_file()]
    if missing:
        raise FileNotFoundError(f"The page would reference files that {str(out_dir)!r} lacks. Received: {missing}")
    path = out_dir / "index.html"
    _atomic_write_text(path, render_page(title, info, figures, notes))
    return path

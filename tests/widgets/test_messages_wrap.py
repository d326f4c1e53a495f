"""Messages a notebook shows (a config error, a decoded sample) wrap between words: JupyterLab's output ``pre``
breaks long lines at any character (``word-break: break-all``: "di/vides", "for/m"); ``say`` / ``text_block``
show them as preformatted lines that override it, a list item's continuation indented under its text."""

from __future__ import annotations

from html.parser import HTMLParser

from workbench.config import ConfigError, preset
from workbench.plots.tables import say, text_block


class _Lines(HTMLParser):
    def __init__(self):
        super().__init__()
        self.lines: list[tuple[dict, str]] = []
        self._style = None

    def handle_starttag(self, tag, attrs):
        if tag == "pre":
            self._style = {k.strip(): v.strip() for k, v in (d.split(":", 1) for d in dict(attrs)["style"].split(";") if ":" in d)}
            self.lines.append((self._style, ""))

    def handle_data(self, data):
        if self._style is not None:
            style, text = self.lines[-1]
            self.lines[-1] = (style, text + data)

    def handle_endtag(self, tag):
        if tag == "pre":
            self._style = None


def _error() -> str:
    try:
        preset("moe-tiny", **{"parallel.expert_parallel": 3, "parallel.nproc_per_node": 3}).check()
    except ConfigError as e:
        return str(e)
    raise AssertionError("the layout should be refused")


def test_a_config_error_shows_as_lines_that_wrap_between_words():
    text = _error()
    block = text_block(text)
    assert str(block) == text  # print / text exports / papermill's text: the message itself
    parser = _Lines()
    parser.feed(block._repr_html_())
    assert [t for _, t in parser.lines] == text.split("\n")  # one preformatted line per line, nothing lost
    for style, line in parser.lines:
        # each line overrides JupyterLab's `.jp-OutputArea-output pre {word-break: break-all}` on the element
        assert style["white-space"] == "pre-wrap" and style["word-break"] == "normal", style
        indent = len(line) - len(line.lstrip()) + (2 if line.lstrip().startswith("- ") else 0)
        # a wrapped list item continues under its text, not under its dash
        assert style["padding-left"] == f"{indent}ch" and style["text-indent"] == f"-{indent}ch", (line, style)


def test_say_prints_outside_a_notebook(capsys):
    say("global_batch_size 4 is not divisible", "by 6")
    assert capsys.readouterr().out == "global_batch_size 4 is not divisible by 6\n"

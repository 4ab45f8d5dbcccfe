"""pyflakes over the code a newcomer edits: unused imports, undefined names and the like fail the suite."""

from pathlib import Path

# Imported, not skipped when missing: a lint that skips itself would pass unseen (pyflakes is in the test extra).
import pyflakes.api as pyflakes_api

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("graphamp", "tests", "benchmarks", "examples")


class _Collected:
    """A pyflakes reporter that keeps each finding as one `file:line: message` line."""

    def __init__(self):
        self.lines = []

    def flake(self, message):
        self.lines.append(str(message))

    def syntaxError(self, filename, msg, lineno, offset, text):
        self.lines.append(f"{filename}:{lineno}: {msg}")

    def unexpectedError(self, filename, msg):
        self.lines.append(f"{filename}: {msg}")


def test_pyflakes_finds_nothing():
    reporter = _Collected()
    paths = list(pyflakes_api.iterSourceCode([str(ROOT / folder) for folder in FOLDERS]))
    assert paths, "no Python files found under " + ", ".join(FOLDERS)
    for path in paths:
        pyflakes_api.checkPath(path, reporter)
    assert not reporter.lines, "pyflakes findings (fix them; pyflakes ignores `# noqa`):\n" + "\n".join(reporter.lines)

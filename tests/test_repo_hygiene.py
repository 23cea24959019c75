"""The repository stands alone: what its text refers to exists, papers are cited by name,
and no path of a particular machine is written down.

Scans the files ``git ls-files`` lists (text files only) for

(a) references to repository files that do not exist: the background notes the project
    started from (which are not part of it), ``docs/...md`` paths, ``results/...`` paths,
    and relative links in README.md and docs/**/*.md;
(b) papers cited by an opaque file name (``NNN_<16 hex digits>.txt``) instead of authors,
    title, year and arXiv id;
(c) absolute paths of a machine (a checkout, a home directory).

A ``results/`` or ``docs/`` reference may name a family of files: ``{a,b}`` alternatives,
``[optional]`` parts, ``*`` and ``<placeholder>``/``{placeholder}`` parts match
anything, and the reference stands if one existing file or directory matches. Outputs of
``--quick`` runs (a name with ``_quick``) are scratch and need not be committed. ``results/x.json at 1945fa9`` (a file
as it was at a commit) is history, not a reference. Pages under ``docs/reference/`` are
generated when the site is built (docs/_hooks/api_reference.py) and count as present.
"""

from __future__ import annotations

import fnmatch
import itertools
import os
import posixpath
import re
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ("docs/reference/",)
"""Paths the docs build generates (the API reference)."""

SELF = Path(__file__).resolve().relative_to(ROOT).as_posix()
"""This file, which spells out the patterns it looks for, is not scanned."""

BACKGROUND_NOTES = re.compile(r"\b(DESIGN|ALGORITHMS)\.md\b")
OPAQUE_PAPER = re.compile(r"\b\d{3}_[0-9a-f]{16}\.txt\b")
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work/|root/|home/[A-Za-z0-9_.-]+|Users/)")
DOCS_PATH = re.compile(r"(?<![\w./-])docs/[\w./{},*<>-]*\.md\b")
RESULTS_PATH = re.compile(r"(?<![\w./-])results/(?:[\w./{},*<>-]|\[[\w.,-]*\])*( at [0-9a-f]{7,40}\b)?")
MD_LINK = re.compile(r"\]\(<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")


@lru_cache(maxsize=1)
def tracked() -> dict[str, str]:
    """path -> text of every tracked text file (binary files and unreadable ones skipped)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout ({e})")
    files = {}
    for name in out.decode().split("\0"):
        path = ROOT / name
        if not name or name == SELF or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue
        try:
            files[name] = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
    return files


@lru_cache(maxsize=1)
def existing() -> frozenset[str]:
    """Every tracked file and every directory above one, as repository-relative paths."""
    paths = set()
    for name in subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                               check=True).stdout.decode().split("\0"):
        if name:
            paths.add(name)
            parts = name.split("/")
            paths.update("/".join(parts[:i]) for i in range(1, len(parts)))
    return frozenset(paths)


def _expansions(ref: str) -> list[str]:
    """``a{b,c}d`` -> [abd, acd]; a brace without a comma is a placeholder (``*``)."""
    parts = re.split(r"(\{[^{}]*\})", ref)
    choices = []
    for part in parts:
        if part.startswith("{") and part.endswith("}"):
            choices.append(part[1:-1].split(",") if "," in part else ["*"])
        else:
            choices.append([part])
    return ["".join(c) for c in itertools.product(*choices)]


def _exists(ref: str) -> bool:
    """Whether a path reference names an existing tracked file or directory (patterns:
    see the module docstring)."""
    ref = ref.rstrip("/.,;:")
    if ref.startswith(GENERATED):
        return True
    ref = re.sub(r"\[([^\[\]]*)\]", r"{,\1}", re.sub(r"<[^<>]*>", "*", ref))  # [x]: optional
    for candidate in _expansions(ref):
        candidate = candidate.rstrip("/")
        if any(ch in candidate for ch in "*?["):
            if any(fnmatch.fnmatchcase(p, candidate) for p in existing()):
                return True
        elif candidate in existing():
            return True
    return False


def _prose(text: str) -> str:
    """Markdown without its fenced code blocks (links there are examples, not links)."""
    out, code = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            code = not code
            continue
        if not code:
            out.append(line)
    return "\n".join(out)


def _problems(pattern: re.Pattern, check) -> list[str]:
    found = []
    for name, text in tracked().items():
        for m in pattern.finditer(text):
            if check(name, m):
                line = text.count("\n", 0, m.start()) + 1
                found.append(f"{name}:{line}: {m.group(0)}")
    return found


def test_no_reference_to_the_background_notes():
    """The notes the project started from are not in it: nothing may point at them."""
    assert _problems(BACKGROUND_NOTES, lambda name, m: True) == []


def test_docs_paths_exist():
    assert _problems(DOCS_PATH, lambda name, m: not _exists(m.group(0))) == []


def test_results_paths_exist():
    def missing(name: str, m: re.Match) -> bool:
        if m.group(1) or "_quick" in m.group(0):  # the file as it was at a commit; a --quick run's output
            return False
        return not _exists(m.group(0))

    assert _problems(RESULTS_PATH, missing) == []


def test_markdown_links_resolve():
    """Relative links in README.md and the docs pages point at files that exist."""
    broken = []
    for name, text in tracked().items():
        if not (name == "README.md" or (name.startswith("docs/") and name.endswith(".md"))):
            continue
        for m in MD_LINK.finditer(_prose(text)):
            target = m.group(1)
            if re.match(r"^([a-z][a-z0-9+.-]*:|#|/)", target, re.IGNORECASE):
                continue  # a URL, an anchor on the same page, or site-absolute
            path = posixpath.normpath(posixpath.join(posixpath.dirname(name), target.split("#")[0]))
            if path.startswith("../") or not _exists(path):
                broken.append(f"{name}: ({target})")
    assert broken == []


def test_papers_cited_by_name_not_file():
    assert _problems(OPAQUE_PAPER, lambda name, m: True) == []


def test_no_absolute_machine_paths():
    assert _problems(MACHINE_PATH, lambda name, m: True) == []


def test_patterns_catch_what_they_should():
    """The checks above are only as good as their patterns."""
    assert BACKGROUND_NOTES.search("see " + "DESIGN" + ".md") and BACKGROUND_NOTES.search("(" + "ALGORITHMS" + ".md)")
    assert OPAQUE_PAPER.search("003_" + "a50797d291873d18" + ".txt")
    assert MACHINE_PATH.search("python at /" + "work/main/.venv") and not MACHINE_PATH.search("https://x.org/work/a")
    assert MACHINE_PATH.search("/home/alice/x") and MACHINE_PATH.search("cd /Users/bob")
    assert MACHINE_PATH.search("under /" + "root/x") and not MACHINE_PATH.search("~/root/x")
    assert _exists("results/fleet/fleet.md") and not _exists("results/fleet/missing.md")
    assert _exists("results/fusion_table.{json,md,png}") and _exists("results/evidence/<name>.md")
    assert not _exists("results/nothing_{a,b}.md")
    assert _exists("results/poisoning/poisoning[_two].md") and not _exists("results/poisoning/x[_two].md")
    assert _exists("docs/reference/cloud/rounds.md")


def test_make_test_runs_the_nats_cluster_tests_alone_and_then_the_rest():
    """`make test` runs the test files that start a NATS cluster (the Makefile's
    ``CLUSTER_TESTS``, conftest's ``CLUSTER_TEST_FILES``) in a pytest of their own, then every
    other test on xdist workers (two targets under ``make -k``: both run, and each recipe is
    one command, which a signal to make reaches), and fails if either part failed."""
    from tests.conftest import CLUSTER_TEST_FILES

    text = (ROOT / "Makefile").read_text()
    listed = re.search(r"^CLUSTER_TESTS := (.+)$", text, re.M).group(1).split()
    assert sorted(Path(p).name for p in listed) == sorted(CLUSTER_TEST_FILES)
    def recipe(target: str) -> str:
        return text.split(f"\n{target}: ", 1)[1].split("\n\n", 1)[0]

    assert "$(MAKE) -k test-cluster test-rest" in recipe("test")  # both parts run; either failing fails
    assert recipe("test-cluster").endswith("-m pytest -q $(CLUSTER_TESTS)")
    assert recipe("test-rest").endswith("-m pytest -q -n 3 --dist loadgroup $(addprefix --ignore=,$(CLUSTER_TESTS))")


def test_the_nats_cluster_tests_share_one_xdist_worker_when_run_with_others(tmp_path):
    """Run with others on xdist (``pytest -n 2 --dist loadgroup`` over the whole suite), the
    tests that start a NATS cluster must share one worker, or two clusters run at once and
    drop their clients. Two such tests
    in a scratch ``test_cluster.py``, grouped by this suite's own hook, must land on the same
    worker."""
    pytest.importorskip("xdist")
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_collection_modifyitems  # noqa: F401\n")
    (tmp_path / "test_cluster.py").write_text("def test_a():\n    pass\n\n\ndef test_b():\n    pass\n")
    out = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v", "-p",
                          "no:cacheprovider", "-c", os.devnull, "--rootdir", str(tmp_path), str(tmp_path)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    passed = [line for line in out.splitlines() if "PASSED" in line]
    assert len(passed) == 2 and all("@nats-cluster" in line for line in passed), out[-2000:]
    assert len({line.split("]")[0] for line in passed}) == 1, out[-2000:]  # "[gw0] ..." on both


def test_make_install_installs_the_packages_the_native_build_names():
    """The Makefile's NATIVE_PACKAGES (what `make install` installs) are exactly
    ``fedmoe.native.PACKAGES`` (what a failed native build tells the user to install)."""
    from fedmoe.native import PACKAGES

    text = (ROOT / "Makefile").read_text()
    listed = re.search(r"^NATIVE_PACKAGES := (.+)$", text, re.M).group(1).split()
    assert listed == list(PACKAGES)
    assert "$(NATIVE_PACKAGES)" in text.split("$(STAMP): pyproject.toml", 1)[1].split("\n\n", 1)[0]

"""The project's files speak only of the product: no text about the tools or the circumstances of the people who
built it (a remote-run tool and its calls, a GPU lent to a task, work sessions and helpers, the brief, issue
numbers) and no absolute paths of a build machine. Each pattern is checked against sample strings, so a
pattern that stops matching fails here too; then every tracked text file is read line by line and the hits are
listed as file:line.

Upstream references of other projects stay fine when written in full (`triton-inference-server/server#8882`).
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from conftest import REPO_ROOT

THIS_FILE = Path(__file__).resolve().relative_to(REPO_ROOT).as_posix()


# name -> (pattern, samples it must catch, samples it must spare)
PATTERNS: dict[str, tuple[re.Pattern, list[str], list[str]]] = {
    "a remote-run tool": (
        re.compile(r"(?i)\bdevice (?:tool|machine|image)\b|(?<![\w.])run\(command=|\bcarry=\["),
        ['through the device tool: run(command="bash perf/gpu_bench.sh", timeout_s=600)',
         "add carry=[\"wheels\"]", "the device image has them"],
        ["subprocess.run(command, capture_output=True)", "a device that has no tool", "carry the margin"]),
    "$OUT as a folder": (
        re.compile(r"\$\{?OUT\}?(?![\w])|environ(?:\.get)?\(\s*[\"']OUT[\"']|environ\[[\"']OUT[\"']\]"),
        ["goes to $OUT/gpu_bench when OUT is set", 'Path(os.environ["OUT"])', 'os.environ.get("OUT")',
         "mkdir -p ${OUT}"],
        ['mkdir -p "$OUT_DIR"', "$OUTPUT", "$COSYVOICE_PERF_RESULTS/gpu-<time>"]),
    "lent or lend": (
        re.compile(r"(?i)\b(?:lent|lend|lends|lending)\b"),
        ["No GPU has been lent to this project", "on a lent GPU", "lend me a GPU"],
        ["excellent", "silent", "a length", "blend"]),
    "an issue number": (
        re.compile(r"(?i)\bissues? #?\d+|\b(?:prs?|pull requests?|fixe[sd]|closes|see) #\d+"),
        ["(issue 25)", "issue 12's flow section", "issues 24 and 25", "see #37", "fixed in issue #12", "PR #3"],
        ["triton-inference-server/server#8882", "color: #333", "an issue with the flow", "tissue 4"]),
    "the issue or the brief": (
        re.compile(r"(?i)\bthe issue(?:'s)?\b|\bthe brief\b"),
        ["the issue's targets", "what the brief asks", "against the issue's floors"],
        ["an issue with the flow", "in brief, it is"]),
    "a work session": (
        re.compile(r"(?i)\b(?:this|previous|earlier|other|another|next|last) sessions?\b|\bsessions?' work\b"),
        ["this session's kind", "other sessions' work", "in the previous session", "another session ran"],
        ["a WebSocket session's segment", "an InferenceSession", "aiohttp.ClientSession()",
         "the session's shared tritonserver", "scope='session'"]),
    "a helper or coordinator as a person": (
        re.compile(r"(?i:\b(?:other|another) helpers?\b|\bhelpers?' (?:tests|work)\b|\bthe coordinator\b)"
                   r"|\b[Hh]elper [A-Z]\b"),
        ["other helpers' tests ran beside it", "helper A's per-voice cache", "the coordinator runs it"],
        ["# ---- helpers ----", "onnx.helper.make_node", "Helpers for tests", "the ONNX session helper and the"]),
    "a build machine's path": (
        re.compile(r"(?<![\w.~-])/(?:work|root)/|(?<![\w.~-])/home/\w+/|(?<![\w.~-])/tmp/\w"),
        ["--model-dir /work/full_model/full", "/root/models", "/home/alice/CosyVoice", "--model-dir /tmp/full",
         'default="/tmp/cosyvoice"'],
        ["https://example.com/work/x", "runs/work/", "build/gpu-site", "~/work/x", "$TMPDIR"]),
}

EXEMPT = {THIS_FILE}  # it names the patterns and their samples
# Unit tests may pass a path such as /tmp/unused.sqlite that nothing opens: no default of the product.
EXEMPT_PATTERNS = {"a build machine's path": re.compile(r"^tests/[^/]+\.py$")}


def tracked_text_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    return [name for name in listed.stdout.split("\0") if name and name not in EXEMPT]


def read_text(name: str) -> str | None:
    path = REPO_ROOT / name
    if not path.is_file():  # deleted in the working tree, not yet committed
        return None
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def hits(name: str, text: str) -> list[str]:
    found = []
    for line_number, line in enumerate(text.splitlines(), 1):
        for label, (pattern, _, _) in PATTERNS.items():
            if label in EXEMPT_PATTERNS and EXEMPT_PATTERNS[label].search(name):
                continue
            if pattern.search(line):
                found.append(f"{name}:{line_number}: [{label}] {line.strip()[:160]}")
    return found


@pytest.mark.parametrize("label", list(PATTERNS))
def test_each_pattern_catches_its_samples_and_spares_the_product_words(label):
    pattern, must_match, must_not_match = PATTERNS[label]
    assert [s for s in must_match if not pattern.search(s)] == [], f"{label} misses these"
    assert [s for s in must_not_match if pattern.search(s)] == [], f"{label} catches these"


def test_hits_name_the_file_and_line():
    text = "fine\nmeasured beside the other helpers' tests on /work/full_model (issue 25)\n"
    found = hits("perf/RESULTS.md", text)
    assert len(found) == 3 and all(f.startswith("perf/RESULTS.md:2: ") for f in found), found
    placeholder = 'model_config("llm", voice_store="/tmp/unused.sqlite")'
    assert hits("tests/test_triton_units.py", placeholder) == [] and len(hits("perf/bench.py", placeholder)) == 1


def test_the_repository_speaks_only_of_the_product():
    found = [hit for name in tracked_text_files() if (text := read_text(name)) is not None
             for hit in hits(name, text)]
    assert found == [], "text about the people or tools that built the project:\n" + "\n".join(found)

"""Every promise the user's documentation makes is pinned by a test: tests/PROMISES.md maps
each sentence of the README and of the docs pages below that says "never", "always",
"refuses", "exits N", "bit-identical" or "the same as" to the tests that fail when it is
broken, and this test fails when a promise has no entry, an entry no promise, or an entry
names a test that does not exist."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMISES = ROOT / "tests" / "PROMISES.md"
DOCUMENTS = ("README.md", "docs/reliability.md", "docs/training.md", "docs/rules.md")
PROMISE_WORDS = re.compile(r"\bnever\b|\balways\b|\brefuse[sd]?\b|\bexits? \d|bit-identical"
                           r"|the same as", re.I)
SENTENCE_BREAK = re.compile(r"(?<=[.!?:;])\s+(?=[A-Z`(*])|\n\n|\n- |\n\| ")


def promises(document: str) -> list[str]:
    """The document's sentences (code blocks left out) that make a promise, one line each."""
    text = re.sub(r"```.*?```", "", (ROOT / document).read_text(), flags=re.S)
    sentences = (" ".join(s.split()) for s in SENTENCE_BREAK.split(text))
    return [s for s in sentences if PROMISE_WORDS.search(s)]


def entries() -> dict[str, list[str]]:
    """PROMISES.md's entries: the quoted fragment of a promise -> the tests that pin it."""
    found: dict[str, list[str]] = {}
    current = None
    for line in PROMISES.read_text().splitlines():
        quoted = re.match(r'^- "(.+)"$', line)
        test = re.match(r"^  - (tests/\S+\.py::\w+)", line)
        if quoted:
            current = " ".join(quoted.group(1).split())
            assert current not in found, f"PROMISES.md lists {current!r} twice"
            found[current] = []
        elif test and current is not None:
            found[current].append(test.group(1))
    return found


def test_every_promise_has_an_entry_and_every_entry_a_promise():
    listed = entries()
    made = [(doc, sentence) for doc in DOCUMENTS for sentence in promises(doc)]
    missing = [f"{doc}: {sentence[:120]}" for doc, sentence in made
               if not any(fragment in sentence for fragment in listed)]
    assert not missing, "promises without an entry in tests/PROMISES.md:\n" + "\n".join(missing)
    stale = [fragment for fragment in listed
             if not any(fragment in sentence for _, sentence in made)]
    assert not stale, "entries of tests/PROMISES.md no document promises now:\n" + \
        "\n".join(stale)


def test_every_entry_names_tests_that_exist():
    problems = []
    for fragment, tests in entries().items():
        if not tests:
            problems.append(f"{fragment[:80]!r}: no test")
        for test in tests:
            path, _, name = test.partition("::")
            source = ROOT / path
            if not source.is_file() or not re.search(rf"^def {name}\(", source.read_text(),
                                                     re.M):
                problems.append(f"{fragment[:80]!r}: {test} does not exist")
    assert not problems, "\n".join(problems)

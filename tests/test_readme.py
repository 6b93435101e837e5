"""The README and the docs pages it runs stay true: every code block in them is marked (run, output,
file or skip with a reason), and every command a CPU can run does run, in document order, from one
folder outside the repository with the installed command, and prints what the page shows
(scripts/readme_outputs.py runs them; `make readme` rewrites the output blocks from such a run). The
README's first screens stay short and lead to every docs page; the links between the pages resolve."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import sys
import textwrap
from collections.abc import Iterator

import pytest

from tests.conftest import ROOT, env

_spec = importlib.util.spec_from_file_location("readme_outputs", os.path.join(ROOT, "scripts", "readme_outputs.py"))
readme = sys.modules.setdefault("readme_outputs", importlib.util.module_from_spec(_spec))  # dataclasses look it up
_spec.loader.exec_module(readme)


def _document_blocks() -> list:
    """The blocks of every document that runs (README.md first), in the order they run."""
    return readme.parse_all(readme.read_documents())


# ---- In process: the markers, and the pieces of the runner that need no process -------------------
def test_every_block_that_could_run_is_marked_and_every_skip_says_why():
    blocks = _document_blocks()
    assert [b.source for b in blocks][0] == "README.md" and {b.source for b in blocks} == set(readme.DOCUMENTS)
    assert readme.lint(blocks) == []
    kinds = {b.kind for b in blocks}
    assert {"run", "output", "file", "skip"} <= kinds
    bash = [b for b in blocks if b.lang == "bash"]
    assert bash and all(b.kind in ("run", "skip") for b in bash)
    assert all(b.opts["reason"].strip() for b in blocks if b.kind == "skip")


def test_make_demo_is_the_train_command_that_the_readme_runs():
    """The skip of `make demo` says the README runs the same command elsewhere: it does."""
    with open(os.path.join(ROOT, "Makefile"), encoding="utf-8") as f:
        recipe = f.read().split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    (make_train,) = [ln.strip() for ln in recipe.splitlines() if " train " in ln]
    make_train = make_train.replace("$(VENV)/bin/", "").replace("$(NPROC)", "2").replace("config/mnist5k_fast.yaml",
                                                                                        "mnist5k_fast")
    (demo,) = [b for b in _document_blocks() if b.opts.get("id") == "demo"]
    assert demo.source == "README.md" and make_train in readme.bash_commands(demo.body)
    (skip,) = [b for b in _document_blocks() if b.kind == "skip" and "make demo" in "\n".join(b.body)]
    assert "As a package" in skip.opts["reason"]


SAMPLE = textwrap.dedent('''\
    # A README

    ```bash
    unmarked --command
    ```

    <!-- readme:skip -->
    ```bash
    no reason given
    ```

    <!-- readme:skip reason="  " -->
    ```python
    print("blank reason")
    ```

    <!-- readme:runn -->
    ```bash
    typo in the marker
    ```

    <!-- readme:output of=nowhere -->
    ```
    an excerpt of a run that does not exist
    ```

    <!-- readme:run id=first color=red -->
    ```bash
    echo unknown option
    ```

    ```
    $ a transcript nobody marked
    ```

    ```
    plain text: a layout, needs no marker
    ```

    <!-- readme:run id=ok -->
    ```python
    print("fine")
    ```

    <!-- readme:output of=ok grep=fine -->
    ```
    fine
    ```
    ''')


def test_lint_names_each_unmarked_block_and_each_bad_marker_by_line():
    problems = readme.lint(readme.parse(SAMPLE))
    assert problems == [
        "README.md:3: ```bash block without a readme:run/file/output/skip marker",
        'README.md:8: readme:skip without a reason: write reason="why this cannot run in the test"',
        'README.md:13: readme:skip without a reason: write reason="why this cannot run in the test"',
        "README.md:18: unknown marker readme:runn (use one of run, file, output, skip)",
        "README.md:23: readme:output of=nowhere: no readme:run block has id=nowhere",
        "README.md:28: readme:run takes no option color (it takes id)",
        "README.md:32: ``` block without a readme:run/file/output/skip marker",
    ]


def test_a_marker_must_stand_on_the_line_just_above_its_block():
    text = '<!-- readme:run -->\n\n```bash\nls\n```\n'
    unmarked = "README.md:3: ```bash block without a readme:run/file/output/skip marker"
    assert readme.lint(readme.parse(text)) == [unmarked]
    assert readme.lint(readme.parse(text.replace("\n\n", "\n"))) == []


def test_bash_blocks_split_into_commands_continuations_joined_comments_dropped():
    body = ["# a comment", "distribuuuu train --cfg x.yaml \\", "    OUT_DIR runs/a   # why", "", "ls runs/a"]
    assert readme.bash_commands(body) == ["distribuuuu train --cfg x.yaml OUT_DIR runs/a   # why", "ls runs/a"]


def test_a_transcript_pairs_each_command_with_the_lines_under_it():
    body = ["$ first --x", "out 1", "out 2", "$ second", "", "out 3"]
    assert readme.transcript(body) == [("first --x", ["out 1", "out 2"]), ("second", ["", "out 3"])]


def test_structure_ignores_numbers_and_spacing_but_not_words_or_lines():
    old = ["model step    73.01   18.78   877  random batch", "", "[21:06:23] done: 98.90% | wall 0:00:09"]
    same = ["model step  25.4  2.6  2515  random batch", "[09:01:02] done: 9.5% | wall 0:01:42"]
    assert readme.normalise(old) == readme.normalise(same)
    assert readme.normalise(old) != readme.normalise(["model step 1 2 3 random batch, cached", old[2]])
    assert readme.normalise(old) != readme.normalise(old[:1])


def test_excerpts_select_from_a_line_on_and_by_pattern():
    output = "log 1\nbench: x\nrow 1\nwrote y\n"
    assert readme.excerpt(output, {"from": "^bench:"}) == ["bench: x", "row 1", "wrote y"]
    assert readme.excerpt(output, {"from": "^bench:", "grep": "row|wrote"}) == ["row 1", "wrote y"]
    assert readme.excerpt(output, {"from": "^nothing"}) == []


def test_paths_of_the_run_folder_and_the_repository_are_made_neutral(tmp_path):
    text = f"wrote {tmp_path}/runs/a/x.json in {tmp_path}; configs in {readme.ROOT}/distribuuuu/configs"
    assert readme._portable(text, str(tmp_path)) == "wrote runs/a/x.json in .; configs in <repo>/distribuuuu/configs"


def test_drift_is_reported_and_rewrite_replaces_only_the_output_blocks():
    blocks = readme.parse(SAMPLE)
    excerpt_block = blocks[-1]
    changed = {excerpt_block.key: [(None, ["fine, and a line more"])]}
    assert readme._drift(excerpt_block, [(None, ["fine"])]) == []
    (problem,) = readme._drift(excerpt_block, changed[excerpt_block.key])
    assert problem.startswith(f"README.md:{excerpt_block.line}: the output of `ok` changed")
    assert "+fine, and a line more" in problem
    new = readme.rewrite(SAMPLE, blocks, changed)
    assert new == SAMPLE.replace("```\nfine\n```", "```\nfine, and a line more\n```")
    transcript = "<!-- readme:output -->\n```\n$ cmd\nold 1\nold 2\n```\ntail\n"
    (block,) = readme.parse(transcript)
    assert readme.rewrite(transcript, [block], {block.key: [("cmd", ["new"])]}) == (
        "<!-- readme:output -->\n```\n$ cmd\nnew\n```\ntail\n")


def test_the_script_lints_a_readme_without_running_it(tmp_path, capsys):
    good, bad = tmp_path / "good.md", tmp_path / "bad.md"
    good.write_text("<!-- readme:skip reason=\"needs a GPU\" -->\n```bash\nnvidia-smi\n```\n")
    bad.write_text("```bash\nnvidia-smi\n```\n")
    assert readme.main(["--lint", "--readme", str(good)]) == 0
    assert readme.main(["--lint", "--readme", str(bad)]) == 1
    assert "bad.md:1: ```bash block without a readme:run/file/output/skip marker" in capsys.readouterr().out


def test_blocks_of_several_documents_are_named_by_file_and_rewritten_each_in_its_own():
    first = "<!-- readme:run id=a -->\n```bash\necho a\n```\n<!-- readme:output of=b -->\n```\nold b\n```\n"
    second = "text\n<!-- readme:run id=b -->\n```bash\necho b\n```\n<!-- readme:output of=a -->\n```\nold a\n```\n"
    blocks = readme.parse_all({"README.md": first, "docs/page.md": second})
    assert [b.where() for b in blocks] == ["README.md:2", "README.md:6", "docs/page.md:3", "docs/page.md:7"]
    assert readme.lint(blocks) == []  # an excerpt may name a run of another document
    fresh = {blocks[1].key: [(None, ["new b"])], blocks[3].key: [(None, ["new a"])]}
    assert readme.rewrite(first, blocks, fresh, "README.md") == first.replace("old b", "new b")
    assert readme.rewrite(second, blocks, fresh, "docs/page.md") == second.replace("old a", "new a")
    twice = readme.parse_all({"README.md": first, "docs/page.md": first})
    assert "docs/page.md:2: readme:run id=a is used twice (first at README.md:2)" in readme.lint(twice)


def _readme_first_screens() -> tuple[str, str]:
    """The README before its "## Where to go next" heading, and that section (up to the next heading)."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    assert "\n## Where to go next\n" in text
    first, rest = text.split("\n## Where to go next\n", 1)
    return first, re.split(r"^## ", rest, maxsplit=1, flags=re.M)[0]


def test_the_readme_takes_at_most_1500_words_before_where_to_go_next():
    first, _ = _readme_first_screens()
    assert len(first.split()) <= 1500, f"{len(first.split())} words before '## Where to go next' (wc -w)"


def test_where_to_go_next_links_every_docs_page_and_every_page_that_runs():
    _, section = _readme_first_screens()
    linked = set(re.findall(r"\]\(([^)#\s]+)\)", section))
    pages = {*readme.DOCUMENTS[1:], *glob.glob("docs/*.md", root_dir=ROOT), "tutorial/README.md"}
    assert all(os.path.exists(os.path.join(ROOT, p)) for p in readme.DOCUMENTS)
    assert pages - linked == set(), f"pages the README's 'Where to go next' does not link: {sorted(pages - linked)}"


def _anchors(text: str) -> Iterator[str]:
    """GitHub's anchors of a markdown text's headings: lower case, punctuation dropped, spaces as `-`."""
    seen: dict[str, int] = {}
    for title in re.findall(r"^#{1,6}\s+(.*?)\s*$", _prose(text), re.M):
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        yield slug if seen[slug] == 0 else f"{slug}-{seen[slug]}"


def _prose(text: str) -> str:
    """A markdown text without its fenced blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def broken_links(root: str, documents: list[str]) -> list[str]:
    """`doc: target` for each relative link of the documents whose file, or heading anchor, does not exist."""
    bad = []
    for doc in documents:
        with open(os.path.join(root, doc), encoding="utf-8") as f:
            text = re.sub(r"`[^`\n]*`", "", _prose(f.read()))
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(root, os.path.dirname(doc), path)) if path else os.path.join(root, doc)
            if not os.path.exists(full):
                bad.append(f"{doc}: {target} (no such file)")
            elif anchor and full.endswith(".md"):
                with open(full, encoding="utf-8") as f:
                    if anchor not in set(_anchors(f.read())):
                        bad.append(f"{doc}: {target} (no such heading)")
    return bad


def test_every_link_of_the_readme_and_the_docs_resolves_to_a_file_and_heading():
    documents = ["README.md", *sorted(glob.glob("docs/*.md", root_dir=ROOT)), "tutorial/README.md"]
    assert broken_links(ROOT, documents) == []


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n## Who started me? (the order)\n")
    (tmp_path / "README.md").write_text("[ok](docs/a.md#who-started-me-the-order) [web](https://x.org/#y)\n"
                                        "[gone](docs/b.md) [moved](docs/a.md#a-section) [here](#nothing)\n"
                                        "```\n[in code](nowhere.md)\n```\n")
    assert broken_links(str(tmp_path), ["README.md"]) == [
        "README.md: docs/b.md (no such file)", "README.md: docs/a.md#a-section (no such heading)",
        "README.md: #nothing (no such heading)"]


# ---- The real thing: every README command that a CPU can run ---------------------------------------
@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_every_cpu_command_of_the_documents_runs_and_prints_what_they_show(tmp_path):
    folder = tmp_path / "user"
    folder.mkdir()
    assert not str(folder).startswith(ROOT + os.sep)  # a user's folder, not the checkout
    assert os.path.exists(os.path.join(os.path.dirname(sys.executable), "distribuuuu"))  # what runs
    blocks = _document_blocks()
    report = readme.run_readme(blocks, str(folder), env=env())
    assert not report.failures, "\n\n".join(report.failures)
    assert not report.drift, "output blocks no longer match (make readme rewrites them):\n\n" + "\n\n".join(
        report.drift)
    # Every block meant to run did, every output block was generated, and none is empty.
    ran = {r.block.key for r in report.results}
    assert ran == {b.key for b in blocks if b.kind == "run" or (b.kind == "output" and "of" not in b.opts)}
    assert set(report.generated) == {b.key for b in blocks if b.kind == "output"}
    assert all(lines for parts in report.generated.values() for _, lines in parts)
    assert {b.key for b in report.skipped} == {b.key for b in blocks if b.kind == "skip"}
    assert (folder / "runs" / "demo" / "checkpoints" / "best.pth").exists()
    # The demo's promise (README, config/mnist5k_fast.yaml): >= 98% best val top-1 on the real digits; the own
    # folder's run stopped at its TRAIN.TARGET_TOP1.
    with open(folder / "runs" / "demo" / "metrics.jsonl", encoding="utf-8") as f:
        val = [r for r in map(json.loads, f) if r.get("split") == "val"]
    assert val and val[-1]["n"] == 1000 and max(r["top1"] for r in val) >= 98.0, val
    with open(folder / "runs" / "digits" / "metrics.jsonl", encoding="utf-8") as f:
        own = [r for r in map(json.loads, f) if r.get("split") == "val"]
    assert own and own[-1]["n"] == 179 and own[-1]["top1"] >= 95.0, own


@pytest.mark.e2e
def test_the_script_fails_on_drift_and_on_a_wrong_status_and_write_repairs_the_text(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PYTHONPATH", ROOT)  # the commands import this checkout's package
    page = tmp_path / "page.md"
    stale = ("<!-- readme:output status=2 -->\n```\n$ distribuuuu config MODEL.ARHC resnet50\n"
             "error: unknown key MODEL.ARHC\n```\n")
    page.write_text(stale)
    assert readme.main(["--readme", str(page)]) == 1
    now = "error: unknown config key MODEL.ARHC (did you mean MODEL.ARCH?) in the command line"
    assert f"-error: unknown key MODEL.ARHC\n+{now}" in capsys.readouterr().err
    assert readme.main(["--write", "--readme", str(page)]) == 0
    assert page.read_text() == stale.replace("error: unknown key MODEL.ARHC", now)
    assert readme.main(["--readme", str(page)]) == 0
    wrong_status = page.read_text().replace("status=2", "status=0")
    page.write_text(wrong_status)
    assert readme.main(["--write", "--readme", str(page)]) == 1
    assert "`distribuuuu config MODEL.ARHC resnet50` exited 2 (wanted 0)" in capsys.readouterr().err
    assert page.read_text() == wrong_status  # a failing command: nothing is rewritten

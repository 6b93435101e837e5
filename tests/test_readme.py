"""The README stays true: every code block in it is marked (run, output, file or
skip with a reason), and every command a CPU can run does run, in order, from a folder outside the
repository with the installed command, and prints what the README shows (scripts/readme_outputs.py
runs them; `make readme` rewrites the output blocks from such a run)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import textwrap

import pytest

from tests.conftest import ROOT, env

_spec = importlib.util.spec_from_file_location("readme_outputs", os.path.join(ROOT, "scripts", "readme_outputs.py"))
readme = sys.modules.setdefault("readme_outputs", importlib.util.module_from_spec(_spec))  # dataclasses look it up
_spec.loader.exec_module(readme)


def _readme_blocks() -> list:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return readme.parse(f.read())


# ---- In process: the markers, and the pieces of the runner that need no process -------------------
def test_every_readme_block_that_could_run_is_marked_and_every_skip_says_why():
    blocks = _readme_blocks()
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
    (demo,) = [b for b in _readme_blocks() if b.opts.get("id") == "demo"]
    assert make_train in readme.bash_commands(demo.body)
    (skip,) = [b for b in _readme_blocks() if b.kind == "skip" and "make demo" in "\n".join(b.body)]
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
    changed = {excerpt_block.line: [(None, ["fine, and a line more"])]}
    assert readme._drift(excerpt_block, [(None, ["fine"])]) == []
    (problem,) = readme._drift(excerpt_block, changed[excerpt_block.line])
    assert problem.startswith(f"README.md:{excerpt_block.line}: the output of `ok` changed")
    assert "+fine, and a line more" in problem
    new = readme.rewrite(SAMPLE, blocks, changed)
    assert new == SAMPLE.replace("```\nfine\n```", "```\nfine, and a line more\n```")
    transcript = "<!-- readme:output -->\n```\n$ cmd\nold 1\nold 2\n```\ntail\n"
    (block,) = readme.parse(transcript)
    assert readme.rewrite(transcript, [block], {block.line: [("cmd", ["new"])]}) == (
        "<!-- readme:output -->\n```\n$ cmd\nnew\n```\ntail\n")


def test_the_script_lints_a_readme_without_running_it(tmp_path, capsys):
    good, bad = tmp_path / "good.md", tmp_path / "bad.md"
    good.write_text("<!-- readme:skip reason=\"needs a GPU\" -->\n```bash\nnvidia-smi\n```\n")
    bad.write_text("```bash\nnvidia-smi\n```\n")
    assert readme.main(["--lint", "--readme", str(good)]) == 0
    assert readme.main(["--lint", "--readme", str(bad)]) == 1
    assert "bad.md:1: ```bash block without a readme:run/file/output/skip marker" in capsys.readouterr().out


# ---- The real thing: every README command that a CPU can run ---------------------------------------
@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_every_cpu_command_of_the_readme_runs_and_prints_what_the_readme_shows(tmp_path):
    folder = tmp_path / "user"
    folder.mkdir()
    assert not str(folder).startswith(ROOT + os.sep)  # a user's folder, not the checkout
    assert os.path.exists(os.path.join(os.path.dirname(sys.executable), "distribuuuu"))  # what runs
    blocks = _readme_blocks()
    report = readme.run_readme(blocks, str(folder), env=env())
    assert not report.failures, "\n\n".join(report.failures)
    assert not report.drift, "README output blocks no longer match (make readme rewrites them):\n\n" + "\n\n".join(
        report.drift)
    # Every block meant to run did, every output block was generated, and none is empty.
    ran = {r.block.line for r in report.results}
    assert ran == {b.line for b in blocks if b.kind == "run" or (b.kind == "output" and "of" not in b.opts)}
    assert set(report.generated) == {b.line for b in blocks if b.kind == "output"}
    assert all(lines for parts in report.generated.values() for _, lines in parts)
    assert {b.line for b in report.skipped} == {b.line for b in blocks if b.kind == "skip"}
    assert (folder / "runs" / "demo" / "checkpoints" / "best.pth").exists()
    # The demo's promise (README, config/mnist5k_fast.yaml): >= 98% best val top-1 on the real digits.
    with open(folder / "runs" / "demo" / "metrics.jsonl", encoding="utf-8") as f:
        val = [r for r in map(json.loads, f) if r.get("split") == "val"]
    assert val and val[-1]["n"] == 1000 and max(r["top1"] for r in val) >= 98.0, val


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

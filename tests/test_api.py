"""The public Python API (docs/api.md): what `mklang` exports, its keywords and results,
and the example script that embeds it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.examples import HITL

import mklang

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
APPROVAL = HITL / "approval" / "approval.mk"
APPROVALS = HITL / "approval" / "scenarios.yaml"
EMBED = EXAMPLES / "api" / "embed.py"


def parked(tmp_path: Path) -> tuple[Path, mklang.RunResult]:
    """The approval machine, parked on its human question in a checkpoint."""
    checkpoint = tmp_path / "cp.json"
    result = mklang.run(APPROVAL, script=APPROVALS, scenario="ask-then-publish", checkpoint=checkpoint, hitl=True)
    return checkpoint, result


def test_every_public_name_resolves_and_is_documented():
    reference = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    for name in mklang.__all__:
        assert getattr(mklang, name) is not None
        assert not (ROOT / "mklang" / f"{name}.py").exists(), f"the submodule mklang.{name} would hide mklang.{name}"
        assert f"`{name}" in reference, f"docs/api.md does not document {name}"
    with pytest.raises(AttributeError, match="no attribute 'session_start'"):
        mklang.session_start  # noqa: B018


def test_importing_mklang_loads_no_engine_provider_or_store():
    code = "import sys, mklang; print(sorted(m for m in sys.modules if m.startswith('mklang')))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert eval(loaded.stdout) == ["mklang", "mklang.version"]


@pytest.mark.parametrize(
    ("call", "keyword"),
    [
        (lambda: mklang.run(APPROVAL, set={"approval.answer": "yes"}), "set"),
        (lambda: mklang.resume("nowhere.json", set_values={"approval.answer": "yes"}), "set_values"),
        (lambda: mklang.batch(APPROVAL, [], store="nowhere", budget=3), "budget"),
        (lambda: mklang.check(APPROVAL, strict=True), "strict"),
    ],
)
def test_a_wrong_keyword_is_a_type_error_before_anything_runs(call, keyword):
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{keyword}'"):
        call()


def test_a_reply_mapping_answers_a_parked_escalation(tmp_path):
    checkpoint, first = parked(tmp_path)
    assert (first.status, first.reason, first.reply_to) == ("suspended", "escalated", "approval.answer")
    # No provider or script given: the checkpoint is answered as the run was (the scenario it recorded).
    done = mklang.resume(checkpoint, reply={"approval.answer": "yes, ship it"})
    assert (done.status, done.result) == ("done", "https://status.example.com/posts/118")
    assert done.context["approval"]["answer"] == "yes, ship it"


def test_a_misspelled_reply_is_refused_and_another_path_leaves_the_question_pending(tmp_path):
    checkpoint, _ = parked(tmp_path)
    with pytest.raises(mklang.CheckpointError, match=r"approval\.answer"):
        mklang.resume(checkpoint, reply={"approval.anwser": "yes"})
    asked_again = mklang.resume(checkpoint, reply={"note": "later"})
    assert (asked_again.status, asked_again.reason, asked_again.context["note"]) == ("suspended", "escalated", "later")
    done = mklang.resume(checkpoint, reply={"approval.answer": "yes"})
    assert done.status == "done"


def test_without_a_checkpoint_a_budget_halts_the_run():
    research = EXAMPLES / "plan-execute"
    halted = mklang.run(
        research / "research.mk", script=research / "scenarios.yaml", scenario="plan-search-answer", max_tokens=150
    )
    assert (halted.status, halted.error, halted.at) == ("halted", "cost-exhausted", "gather")


def test_check_returns_each_finding_at_its_line_and_column(tmp_path):
    broken = tmp_path / "broken.mk"
    broken.write_text(
        'mklang 0.4\nmachine broken\nentry a\nbudget 3\n\nstate a {\n  structure "A word."\n  prompt "Hi"\n  output x\n  otherwise -> b\n}\n',
        encoding="utf-8",
    )
    (finding,) = [d for d in mklang.check(broken) if d.severity == "error" and d.code == "unknown-target"]
    assert (finding.file, finding.line, finding.col) == (str(broken), 10, 3)
    assert finding.message == '"b" is not a state (or END)'
    # A machine object is checked as it is; a file that cannot be read says why, nothing is raised.
    assert mklang.check(mklang.load(APPROVAL)) == mklang.check(APPROVAL)
    (missing,) = mklang.check(tmp_path / "missing.mk")
    assert (missing.code, missing.line, missing.col) == ("unreadable", 1, 1)
    with pytest.raises(mklang.LoadError) as refused:
        mklang.load(broken)
    assert [d.code for d in refused.value.diagnostics] == ["unknown-target", "no-path-to-end"]


def test_batch_returns_one_outcome_per_input_in_order_and_writes_them(tmp_path):
    inputs = [{"id": "ops", "audience": "operators"}, {"id": "all", "audience": "all customers"}]
    options = dict(script=APPROVALS, scenario="approved-answer-given-up-front", store=tmp_path / "runs")
    outcomes = mklang.batch(APPROVAL, inputs, out=tmp_path / "out.jsonl", **options)
    assert [(o.run, o.status, o.result) for o in outcomes] == [
        ("ops", "done", "https://status.example.com/posts/118"),
        ("all", "done", "https://status.example.com/posts/118"),
    ]
    lines = (tmp_path / "out.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["id"] for line in lines] == ["ops", "all"]
    # Again with the same inputs: the batch is done already, nothing runs twice.
    assert mklang.batch(APPROVAL, inputs, **options) == outcomes


class Echo:
    """A provider of the caller's own: every answer is the word it was built with."""

    def __init__(self, word: str):
        self.word = word
        self.closed = False

    def produce(self, system: str, user: str, tier: str, reason: bool) -> mklang.Produced:
        return mklang.Produced(self.word, None, mklang.Usage(3, 2))

    def judge(self, conditions, output, reasoning, context, tier) -> mklang.Verdict:
        return mklang.Verdict(0, mklang.Usage(1, 1))

    def close(self) -> None:
        self.closed = True


def test_a_provider_object_answers_with_the_callers_tools_and_stays_open(tmp_path):
    provider = Echo("Quiet night")
    seen: list[list[str]] = []

    class States:
        def emit(self, event: mklang.Event) -> None:
            if isinstance(event, mklang.StateEntered):
                seen.append([level.state for level in event.path])

    done = mklang.run(
        APPROVAL,
        {"approval": {"answer": "yes"}},
        provider=provider,
        tools={"publish": lambda args: f"posted: {args['text']}"},
        observer=States(),
    )
    assert (done.status, done.result) == ("done", "posted: Quiet night")
    assert seen == [["draft"], ["decide"], ["publish"]]  # the path of every state entered
    assert provider.closed is False  # the caller's provider is the caller's to close


@pytest.mark.parametrize("keyword", ["script", "scenario"])
def test_a_provider_object_cannot_be_combined_with_what_builds_one(keyword):
    given = {"script": APPROVALS, "scenario": "approved"}
    with pytest.raises(mklang.UsageError, match=rf"{keyword}= builds a provider"):
        mklang.run(APPROVAL, provider=Echo("x"), **{keyword: given[keyword]})


def test_the_embedding_example_runs_offline_and_says_what_happened():
    """Each line pins a run of the example (a durable run a token budget suspends and a larger
    one finishes, a parked decision an answer decides, a batch): its end, spend and paid calls.
    The question's id is random: it reads as Q."""
    done = subprocess.run([sys.executable, str(EMBED)], capture_output=True, text=True, cwd=ROOT, check=False)
    assert (done.returncode, done.stderr) == (0, "")
    assert re.sub(r"question [0-9a-f]{16}", "question Q", done.stdout).splitlines() == [
        "check: 0 findings",
        "run: suspended (cost-exhausted) at gather, 200 tokens, calls: judge 1, produce 1",
        "resume: done, 400 tokens, calls: judge 1, produce 1, tool 2",
        "answer: Annual plans are refundable within 30 days of purchase [1]; "
        "refunds reach the card within 5 business days [2].",
        "run: suspended (escalated) at draft, 0 tokens, calls: produce 1",
        "ask: Publish this announcement? ['approve', 'revise', 'reject'] -> approval",
        "refused: 'maybe' is not a choice of question Q: approve, revise, reject",
        "resume: done, 0 tokens, calls: tool 1",
        "published: https://status.example.com/posts/118",
        "batch: ops suspended (escalated)",
        "batch: all suspended (escalated)",
    ]


# Where the strict check keeps its cache, apart from the project's own `mypy` run (other flags), so
# a second check (CI runs this one before the tests) only rereads what changed.
STRICT_CACHE = ROOT / ".mypy_cache" / "strict"


def test_the_embedding_example_passes_mypy_strict():
    pytest.importorskip("mypy")
    checked = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(STRICT_CACHE), str(EMBED.relative_to(ROOT))],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr

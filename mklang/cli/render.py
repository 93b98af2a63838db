"""Rich rendering of run results for people; JSON for scripts.

Results go to stdout, progress and diagnostics to stderr. Every text that a
model, a tool, a server or a checkpoint file supplied passes `printable`, so
no escape sequence reaches the terminal; JSON output is the exact data.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Literal, Self

from rich.console import Console, ConsoleDimensions
from rich.live import Live
from rich.text import Text
from rich.tree import Tree

from mklang.syntax.diagnostics import color_allowed
from mklang.terminal import printable

if TYPE_CHECKING:
    from mklang.engine.events import Event

# Rich drops colours under NO_COLOR but keeps bold: without a colour system it prints plain text.
_COLOR_SYSTEM: Literal["auto"] | None = "auto" if color_allowed() else None
# The width of a line written anywhere but a terminal: as good as unbounded.
UNBOUNDED = 100_000


def _size(console: Console) -> ConsoleDimensions:
    """A terminal's size; elsewhere (a pipe, a file, a CI log) lines are not cut at 80 columns."""
    size = Console.size.fget(console)  # type: ignore[attr-defined]
    return size if console.is_terminal else ConsoleDimensions(UNBOUNDED, size.height)


class _Output(Console):
    size = property(_size, Console.size.fset)  # type: ignore[attr-defined]


stdout = _Output(highlight=False, soft_wrap=True, color_system=_COLOR_SYSTEM)
stderr = _Output(stderr=True, highlight=False, color_system=_COLOR_SYSTEM)

_STATUS_STYLE = {"done": "bold green", "halted": "bold red", "suspended": "bold yellow", "failed": "bold red"}


def _short(value: Any, width: int = 70) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    text = printable(" ".join(text.split()))
    return text if len(text) <= width else text[: width - 1] + "…"


def _add_steps(tree: Tree, trace: list[dict[str, Any]]) -> None:
    for step in trace:
        target = step.get("to") or "■"
        label = Text()
        label.append(f"{step['step']:>3} ", style="dim")
        label.append(printable(step["state"]), style="bold cyan")
        label.append(f" ─{printable(str(step['policy']))}→ ", style="magenta" if step["policy"] != "ok" else "dim")
        label.append(printable(str(target)), style="cyan")
        if step.get("gate"):
            label.append(f"  [{printable(str(step.get('gate_via')))}] {_short(step['gate'], 40)}", style="dim")
        if step.get("decision_tainted"):
            label.append("  judged over outside data", style="yellow")
        if step.get("untrusted_control_flow"):
            label.append("  ⚠ untrusted control flow", style="bold red")
        node = tree.add(label)
        if "branches" in step:
            for index, branch in enumerate(step["branches"]):
                node.add(Text(f"[{index}] {_short(branch.get('output'))}", style="green"))
        elif "output" in step:
            node.add(Text(_short(step["output"]), style="green"))
        if step.get("sub_trace"):
            _add_steps(node.add(Text("call", style="dim")), step["sub_trace"])


def render_result(data: dict[str, Any], console: Console = stdout) -> None:
    """A run's document (`RunResult.to_json`, or a stored run's from `mklang show`) for people:
    a summary line, the trace as a tree, spend, the result or the question it waits on."""
    status = str(data["status"])
    head = Text()
    head.append(printable(status), style=_STATUS_STYLE.get(status, "bold"))
    why = data.get("reason") or data.get("error")
    if why:
        why = f"{why}: {data['detail']}" if data.get("detail") else why  # `cost-exhausted: tokens 1,204 of 1,000`
        head.append(f"  {printable(str(why))}", style="red" if status in ("halted", "failed") else "yellow")
    if data.get("at"):
        head.append(f"  at {printable(str(data['at']))}")
    console.print(head)
    if data.get("interrupted"):
        console.print(Text(printable(str(data["interrupted"])), style="yellow"))
    if "trace" in data:
        tree = Tree(Text("trace", style="bold"))
        _add_steps(tree, data["trace"])
        console.print(tree)
    usage = data.get("usage")
    if usage:
        console.print(
            f"usage: {usage['input_tokens']} in + {usage['output_tokens']} out tokens"
            + (f", ${usage['cost_usd']:.4f}" if usage["cost_usd"] else "")
        )
    if data.get("calls"):
        console.print("calls paid by this process: " + ", ".join(f"{kind} {n}" for kind, n in data["calls"].items()))
    if status == "done":
        console.print(Text("result: ", style="bold") + Text(_short(data.get("result"), 2000)))
    question = data.get("question")
    if status == "suspended" and question:
        render_question(question, data.get("ask"), console)
    elif status == "suspended" and data.get("ask"):
        console.print(
            Text("ask: ", style="bold yellow")
            + Text(printable(str(data["ask"])))
            + Text(f"  (reply with --set {printable(str(data.get('reply_to')))}=...)", style="dim")
        )


def render_question(question: dict[str, Any], ask: str | None, console: Console) -> None:
    """A pending human decision: what it asks, its choices, what it shows, its id and deadline."""
    from mklang.engine.decisions import answer_hint

    console.print(
        Text("decision: ", style="bold yellow")
        + Text(printable(str(ask or "")))
        + Text(f"  ({printable(answer_hint(question))})", style="dim")
    )
    shown = f", showing {question['show']}" if question.get("show") else ""
    deadline = f", deadline {question['deadline']}" if question.get("deadline") else ", no deadline"
    console.print(Text(f"  question {question['question']}{shown}{deadline}", style="dim"))


class Display:
    """A rich display on stderr, shown while the `with` block runs and gone after it."""

    def __init__(self, shown: Any):
        self._shown = shown  # a rich Live or Progress

    def __enter__(self) -> Self:
        self._shown.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._shown.__exit__(*exc)


class LiveView(Display):
    """The current state, steps and tokens against their budgets, on a terminal: an event sink
    that shows each state entered outside fan-out branches, and under it the last line of the
    answer its model call is writing, as the provider streams it (ADR 0060: the view asks for
    the deltas' text, which the run's result shows anyway). The token budget is the one the run
    starts or resumes under, as its first event says."""

    stream_text = True

    def __init__(self) -> None:
        self.max_tokens: int | None = None
        self.live = Live(Text(""), console=stderr, transient=True, refresh_per_second=8)
        self._state = Text("")
        self._answer = ""  # the answer streaming now, outside fan-out branches
        super().__init__(self.live)

    def emit(self, event: Event) -> None:
        from mklang.engine.events import ModelDelta, ModelFinished, RunResumed, RunStarted, StateEntered

        if isinstance(event, (RunStarted, RunResumed)):
            self.max_tokens = event.max_tokens
        if event.in_branch:
            return
        if isinstance(event, ModelDelta) and event.text is not None:
            self._answer = (self._answer if event.offset else "") + event.text  # 0: a retried call starts anew
        elif isinstance(event, ModelFinished):
            self._answer = ""
        elif isinstance(event, StateEntered):
            path = printable(" › ".join(f"{level.machine}:{level.state}" for level in event.path))
            budget = f"/{self.max_tokens}" if self.max_tokens else ""
            self._state = Text(f"▶ {path}   steps {event.steps}/{event.budget}   tokens {event.spent.tokens}{budget}")
        else:
            return
        self.live.update(self._shown_now())

    def _shown_now(self) -> Text:
        if not self._answer.strip():
            return self._state
        last = printable(self._answer.rstrip().rsplit("\n", 1)[-1])
        width = max(10, stderr.width - 4)
        tail = last if len(last) <= width else "…" + last[-(width - 1) :]
        return Text.assemble(self._state, "\n  ", (tail, "dim"))


def render_checkpoint(summary: dict[str, Any], console: Console = stdout) -> None:
    """`mklang show` for people."""
    head = Text()
    head.append(printable(str(summary["status"])), style=_STATUS_STYLE.get(summary["status"], "bold yellow"))
    for key in ("reason", "error"):
        if summary.get(key):
            head.append(f"  {printable(str(summary[key]))}")
    if summary.get("at"):
        head.append(f"  at {printable(str(summary['at']))}")
    console.print(head)
    if summary["status"] == "failed":  # unreadable or unverified: nothing it holds is shown as its state
        _render_host(summary, console)
        return
    if summary.get("detail"):
        console.print(Text(printable(summary["detail"]), style="dim"))
    if summary.get("interrupted"):
        console.print(Text(printable(summary["interrupted"]), style="yellow"))
    chain = Tree(Text(printable(f"frames of {summary['machine']['name']}"), style="bold"))
    node = chain
    for frame in summary["frames"]:
        node = node.add(
            Text(
                printable(
                    f"{frame['machine']} at {frame['state']}   steps {frame['steps']}/{frame['budget']}"
                    f" ({frame['remaining']} left)"
                )
            )
        )
    console.print(chain)
    for ancestor in summary.get("lineage", []):
        inherited = ancestor["inherited"]
        if ancestor["migration"]:
            console.print(Text(printable(f"migrated to a new machine version at step {ancestor['step']}"), style="dim"))
            continue
        console.print(
            Text(
                printable(
                    f"forked from {ancestor['checkpoint']} (run {ancestor['run_id']}) at step {ancestor['step']}: "
                    f"inherited {inherited['input_tokens'] + inherited['output_tokens']} tokens, "
                    f"${inherited['cost_usd']}"
                ),
                style="dim",
            )
        )
    for acted in summary.get("actions", []):
        console.print(Text(printable(action_line(acted)), style="dim"))
    for label, key in (("tokens", "tokens"), ("dollars", "cost_usd")):
        spend = summary[key]
        limit = "(no budget)" if spend["budget"] is None else f"of {spend['budget']} ({spend['remaining']} left)"
        console.print(f"{label}: {spend['spent']} {limit}")
    if summary["last_steps"]:
        tree = Tree(Text("last steps", style="bold"))
        _add_steps(tree, summary["last_steps"])
        console.print(tree)
    if summary.get("question"):
        render_question(summary["question"], summary.get("ask"), console)
    elif summary.get("ask"):
        console.print(Text("ask: ", style="bold yellow") + Text(printable(summary["ask"])))
    if summary.get("ran_out"):
        console.print(Text(summary["ran_out"], style="yellow"))
    if summary.get("continue_with"):
        console.print(Text("continue with: ", style="bold") + Text(printable(summary["continue_with"])), soft_wrap=True)
    _render_host(summary, console)
    if not summary["resumable"]:
        console.print(Text("this run has finished and cannot be resumed", style="dim"))


def _render_host(summary: dict[str, Any], console: Console) -> None:
    """Whether the file is signed with this user's key, and the host settings it records."""
    signed = summary["signature"]["seal"] == "signed"
    note = "" if signed else " (resume needs --trust; the settings below are then ignored)"
    console.print(Text(f"checkpoint {summary['signature']['text']}{note}", style="green" if signed else "yellow"))
    for name, value in summary["host"].items():
        console.print(Text(f"  recorded {name}: {value}", style="dim"))


def render_scenarios(outcomes: list, console: Console = stdout) -> None:
    """`mklang test` for people: PASS or FAIL per scenario; for a failure, what differed
    in which part, and why that run ended."""
    from mklang.scenarios import ending

    failed = 0
    for scenario, parts in outcomes:
        broken = [part for part in parts if part.problems]
        failed += bool(broken)
        mark = Text("FAIL", style="red") if broken else Text("PASS", style="green")
        console.print(mark + Text(f" {printable(scenario.name)}"))
        for part in broken:
            prefix = "" if part.label == "run" else f"{part.label}: "
            for problem in part.problems:
                console.print(Text(printable(f"     {prefix}{problem}")))
            console.print(Text(printable(f"     {prefix}{ending(part.result)}"), style="dim"))
    console.print(f"{len(outcomes) - failed} passed, {failed} failed")


RUN_COLUMNS = ("RUN", "MACHINE", "STATUS", "REASON OR QUESTION", "SPEND", "STARTED (UTC)", "UPDATED (UTC)")


def render_runs(runs: list[dict[str, Any]], console: Console = stdout) -> None:
    """`mklang runs` for people: a header, then one aligned line per run (as `runs --format json` lists them)."""
    if not runs:
        console.print("no runs", highlight=False)
        return

    def when(iso: str | None) -> str:
        return iso.replace("T", " ").removesuffix("+00:00") if iso else "-"

    def spend(run: dict[str, Any]) -> str:
        return f"{run['tokens']} tok" + (f" ${run['cost_usd']:.4f}" if run["cost_usd"] else "")

    rows = [
        [
            _short(run["run"], 40),  # a newline in a name read from a row fakes no line
            _short(run["machine"] or "?", 24),
            run["status"] or "?",
            _short(run["reason"] or "", 50),
            spend(run),
            when(run["started"]),
            when(run["updated"]),
        ]
        for run in runs
    ]
    widths = [max(len(cells[index]) for cells in [list(RUN_COLUMNS), *rows]) for index in range(len(RUN_COLUMNS))]
    console.print(
        Text(
            "  ".join(name.ljust(width) for name, width in zip(RUN_COLUMNS, widths, strict=True)).rstrip(), style="bold"
        )
    )
    for cells in rows:
        line = Text()
        for index, (cell, width) in enumerate(zip(cells, widths, strict=True)):
            line.append(
                cell.ljust(width) + ("  " if index < len(cells) - 1 else ""),
                style=_STATUS_STYLE.get(cell, "") if index == 2 else "",
            )
        line.rstrip()
        console.print(line, soft_wrap=True)


def render_batch(totals: dict[str, Any], console: Console = stdout) -> None:
    """The closing line of `mklang batch` for people."""
    counts = ", ".join(f"{totals[key]} {key}" for key in ("done", "halted", "suspended", "pending", "failed"))
    usage = totals["usage"]
    tokens = usage["input_tokens"] + usage["output_tokens"]
    console.print(f"{totals['items']} runs: {counts}; tokens {tokens}", highlight=False)


class BatchProgress(Display):
    """A progress bar of finished runs with done/halted/suspended/failed counts, on a terminal."""

    def __init__(self, total: int, *, visible: bool):
        from rich.progress import Progress

        self.counts: dict[str, int] = {}
        self._progress = Progress(console=stderr, transient=True, disable=not visible)
        self._task = self._progress.add_task("runs", total=total)
        super().__init__(self._progress)

    def __call__(self, outcome: Any) -> None:
        self.counts[outcome.status] = self.counts.get(outcome.status, 0) + 1
        self._progress.update(self._task, advance=1, description=self._counts())

    def waiting(self, idle: float) -> None:
        """Workers have reported no run for `idle` seconds: say so after a few."""
        shown = self._counts()
        if idle >= 5:
            shown = f"{shown}  waiting for workers ({idle:.0f}s)".strip()
        self._progress.update(self._task, description=shown)

    def _counts(self) -> str:
        return "  ".join(f"{key} {value}" for key, value in sorted(self.counts.items()))


def action_line(acted: dict[str, Any]) -> str:
    """An operator's action as `show` prints it: `cancelled from the console at T`."""
    if acted["action"] == "cancel":
        return f"cancelled from the {acted['by']} at {acted['at']}"
    raised = ", ".join(f"{name} {value}" for name, value in acted.get("budgets", {}).items())
    return f"budgets raised from the {acted['by']} at {acted['at']}: {raised}"

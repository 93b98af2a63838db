"""Machines that the graph tests draw: the SPEC's triage built from the model, a run of it, and a
big generated machine."""

from __future__ import annotations

from mklang.model import Call, Gate, Machine, Produce, State, ToolUse


def triage() -> Machine:
    """The SPEC section 2 machine, built directly from the model."""
    return Machine(
        name="triage",
        entry="classify",
        budget=25,
        states=[
            State(
                name="classify",
                face=Produce(prompt="Classify {{ticket.body}}", structure="One word."),
                output="category",
                gates=[
                    Gate(when='the category is "billing"', hook="amount_ok", target="draft"),
                    Gate(when="the category is bug", target="lookup"),
                    Gate(target="draft"),
                ],
            ),
            State(
                name="lookup",
                face=ToolUse(tool="search_kb", input={"query": "{{ticket.body}}"}),
                output="kb",
                gates=[
                    Gate(when="no facts; none at all", policy="escalate", target="draft", ask="Handle it?"),
                    Gate(target="draft"),
                ],
            ),
            State(
                name="draft",
                face=Produce(prompt="Reply to {{ticket.body}}", structure="A reply."),
                output="draft",
                gates=[
                    Gate(when="the reply resolves the request", target="END"),
                    Gate(when="the reply has gaps", policy="repair", repair=2, target="draft"),
                    Gate(policy="fail"),
                ],
            ),
            State(
                name="per_chunk",
                face=Call(machine="summarize_doc", input={"text": "{{item}}"}),
                over="chunks",
                output="summaries",
                gates=[Gate(target="END")],
            ),
            State(
                name="vote",
                face=Produce(prompt="Vote", structure="yes or no"),
                sample=3,
                output="votes",
                gates=[Gate(target="END")],
            ),
        ],
    )


RUN = {
    "status": "done",
    "trace": [
        {"step": 1, "state": "classify", "policy": "ok", "to": "draft", "gate": "otherwise"},
        {"step": 2, "state": "draft", "policy": "repair", "to": "draft", "gate": "the reply has gaps"},
        {"step": 3, "state": "draft", "policy": "ok", "to": "END", "gate": "the reply resolves the request"},
    ],
}


def big_machine(states: int = 55) -> str:
    """A machine with repair self-loops, jumps back and forward, fail gates, and END."""
    out = ["machine big", "entry s0", "budget 500", ""]
    for i in range(states):
        out += [f"state s{i} {{", '  structure "One line."', f'  prompt "Say {i}"', f"  output o{i}"]
        if i % 7 == 3:
            out.append(f'  when "it is still bad {i}" repair 2 -> s{i}')
        if i % 5 == 2 and i > 4:
            out.append(f'  when "go back {i}" -> s{i - 4}')
        if i % 6 == 1 and i + 3 < states:
            out.append(f'  when "jump {i}" -> s{i + 3}')
        if i % 9 == 4:
            out.append(f'  when "broken {i}" fail')
        out += [f"  otherwise -> {f's{i + 1}' if i + 1 < states else 'END'}", "}", ""]
    return "\n".join(out)

# plan_execute: plan a task as a list of steps, carry out every step, then
# report. `plan` writes a JSON list of steps to `plan` (repaired once when
# it misses part of the goal; a reply that is not a list halts with a
# state-error); `execute` carries out each step concurrently into
# `results`; `summarize` reports in `summary` (the result) and fails when
# the outcomes fall short. Reads `goal`; writes `plan`, `results` and
# `summary`.
mklang 0.4
machine plan_execute
entry plan
budget 20
result summary

context {
  goal: ""
}

state plan {
  tier reasoning
  reason
  structure "A JSON array of 2 to 6 short, independent steps."
  prompt "Plan how to reach this goal: {{goal}}"
  parse list
  output plan
  when "the plan misses part of the goal" repair 1 -> plan
  otherwise -> execute
}

state execute {
  over plan
  structure "The outcome of this step only."
  prompt """
    Goal: {{goal}}
    Whole plan:
    {{plan}}
    Carry out step {{index}}: {{item}}
    """
  output results
  otherwise -> summarize
}

state summarize {
  structure "A short report: what was done and the answer to the goal."
  prompt """
    Goal: {{goal}}
    Step outcomes:
    {{results}}
    """
  output summary
  when "the outcomes fall short of the goal" fail
  otherwise -> END
}

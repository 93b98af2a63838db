# self_refine: improve a draft by alternating critique and revision.
# `draft` writes a first version, `critique` lists what keeps it from the
# criteria (or says NONE), and `refine` rewrites it from the critique. The
# repair budget caps the revisions at three; after that the last draft
# stands. Reads `task` and `criteria`; writes `draft` (the result) and
# `critique`.
mklang 0.4
machine self_refine
entry draft
budget 10
result draft

context {
  task: ""
  criteria: "clear, correct and concise"
}

state draft {
  structure "The requested text only."
  prompt """
    Task: {{task}}
    It should be {{criteria}}.
    """
  output draft
  otherwise -> critique
}

state critique {
  tier reasoning
  structure "A bulleted list of concrete problems with the draft, or the single word NONE."
  prompt """
    Task: {{task}}
    Criteria: {{criteria}}
    Draft:
    {{draft}}
    List what keeps the draft from meeting the criteria.
    """
  output critique
  when "the critique lists problems with the draft" repair 3 -> refine
  otherwise -> END
}

state refine {
  structure "The requested text only."
  prompt """
    Task: {{task}}
    Criteria: {{criteria}}
    Draft:
    {{draft}}
    Critique:
    {{critique}}
    Rewrite the draft, fixing every problem the critique lists.
    """
  output draft
  otherwise -> critique
}

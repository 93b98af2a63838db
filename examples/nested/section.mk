# section.mk: write the next section of a briefing and have it fact-checked.
#
# Called by brief.mk; calls fact_check.mk. A section the check finds wrong
# is rewritten once, with the check's note. Reads `subject` and `written`
# (the sections so far); writes `section` (the result) and `review`.
mklang 0.4
machine section
entry write
budget 6
result section

context {
  subject: ""
  written: []
}

state write {
  structure "A heading line, then one paragraph of at most 80 words."
  prompt """
    Write the next section of a briefing on {{subject}}.
    Sections already written:
    {{written}}
    Notes of the last fact check, if any: {{review.note}}
    """
  output section
  otherwise -> check
}

state check {
  call fact_check { claim: "{{section}}" }
  output review
  when "the review found a factual error" repair 1 -> write
  otherwise -> END
}

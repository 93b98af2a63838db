# fact_check.mk: check the facts of a passage against a reference search.
#
# Called by section.mk. Reads `claim`; writes `evidence` and `review` (the
# result: a JSON object with a verdict and a note). Fails when the evidence
# can neither support nor refute the passage.
mklang 0.4
machine fact_check
entry lookup
budget 4
tier fast
result review

context {
  claim: ""
}

tool search_facts read_only "Search a reference encyclopedia. Input: {query}. Returns matching passages."

state lookup {
  tool search_facts { query: "{{claim}}" }
  output evidence
  otherwise -> review
}

state review {
  structure "A JSON object with the keys verdict (supported, error or unknown) and note (one sentence)."
  prompt """
    Passage: {{claim}}
    Evidence: {{evidence}}
    Is every fact in the passage supported by the evidence?
    """
  parse json
  output review
  when "the verdict is unknown" fail
  otherwise -> END
}

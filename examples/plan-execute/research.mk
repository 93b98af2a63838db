# research.mk: answer a question by plan-and-execute.
#
# A planner lists the wiki searches the question needs, every search runs
# (side by side), and a writer answers from the findings. If the findings
# cannot answer the question the planner tries once more with what it
# learned. Reads `question`; writes `plan`, `findings` and `report` (the
# result).
mklang 0.4
machine research
entry plan
budget 20
result report

context {
  question: ""
}

tool lookup read_only "Search the internal wiki. Input: {query}. Returns the best matching paragraph."

state plan {
  tier reasoning
  reason
  structure "A JSON array of 2 to 4 search queries, most important first."
  prompt """
    Plan the wiki searches needed to answer: {{question}}
    Findings of earlier searches, if any:
    {{findings}}
    """
  parse list
  output plan
  max_visits 2
  when "the plan has more than 4 queries" repair 1 -> plan
  otherwise -> gather
}

state gather {
  over plan
  tool lookup { query: "{{item}}" }
  output findings
  when "the findings cannot answer the question" -> plan
  otherwise -> write
}

state write {
  structure "An answer of at most 100 words that cites the findings it uses as [1], [2], ..."
  prompt """
    Question: {{question}}
    Findings:
    {{findings}}
    """
  output report
  otherwise -> END
}

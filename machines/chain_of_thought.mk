# chain_of_thought: answer a question by reasoning step by step first.
# `think` writes numbered steps of reasoning, `conclude` states the answer
# they reach, and a judge checks that the answer follows from them; a
# mistake in the reasoning sends the run back to `think` once, with repair
# feedback naming the failed condition. Reads `question`; writes `thoughts`
# and `answer` (the result).
mklang 0.4
machine chain_of_thought
entry think
budget 6
result answer

context {
  question: ""
}

state think {
  tier reasoning
  structure "Numbered steps of reasoning, one per line. No final answer yet."
  prompt """
    Question: {{question}}
    Think it through step by step.
    """
  output thoughts
  otherwise -> conclude
}

state conclude {
  tier fast
  structure "The final answer only, on one line."
  prompt """
    Question: {{question}}
    Reasoning:
    {{thoughts}}
    State the final answer this reasoning reaches.
    """
  output answer
  when "the answer follows from the reasoning" -> END
  when "the reasoning contains a mistake" repair 1 -> think
  otherwise fail
}

# self_consistency: ask the same question five times independently, then
# keep the answer most samples reach. `sample_answers` runs the samples
# concurrently into `candidates`; `aggregate` writes the majority answer to
# `answer` (the result) and fails when no two candidates agree. Reads
# `question`; writes `candidates` and `answer`.
mklang 0.4
machine self_consistency
entry sample_answers
budget 8
result answer

context {
  question: ""
}

state sample_answers {
  sample 5
  structure "At most five lines of reasoning, then the final answer alone on the last line."
  prompt """
    Sample {{index}}: answer on your own.
    {{question}}
    """
  output candidates
  otherwise -> aggregate
}

state aggregate {
  tier fast
  structure "The majority final answer only, on one line."
  prompt """
    Question: {{question}}
    Independent candidate answers:
    {{candidates}}
    Which final answer do most candidates reach?
    """
  output answer
  when "no two candidates reach the same final answer" fail
  otherwise -> END
}

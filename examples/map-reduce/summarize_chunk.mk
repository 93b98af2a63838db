# summarize_chunk.mk: summarize one section of a document in one sentence.
#
# Called by digest.mk for each section. Reads `text` and `position` (the
# section's 0-based index); writes `summary` (the result).
mklang 0.4
machine summarize_chunk
entry summarize
budget 3
tier fast
result summary

context {
  text: ""
  position: 0
}

state summarize {
  structure "One sentence."
  prompt "Summarize section {{position}} in one sentence: {{text}}"
  output summary
  otherwise -> END
}

# digest.mk: summarize a long document by map-reduce.
#
# The document is cut into sections, every section is summarized by the
# sibling machine summarize_chunk.mk (one call per section, run side by
# side), and the summaries are combined into one digest. Reads `document`;
# writes `sections`, `summaries` and `digest` (the result).
mklang 0.4
machine digest
entry split
budget 20
result digest

context {
  document: ""
}

state split {
  tier fast
  structure "A JSON array of strings: the document cut into self-contained sections, in order."
  prompt "Split this document into sections: {{document}}"
  parse list
  output sections
  when "the list is empty" fail
  otherwise -> summarize
}

state summarize {
  over sections
  call summarize_chunk { text: "{{item}}", position: "{{index}}" }
  output summaries
  otherwise -> combine
}

state combine {
  structure "One paragraph of at most 120 words."
  prompt """
    Combine these section summaries into one digest, in order:
    {{summaries}}
    """
  output digest
  when "the digest covers every summary" -> END
  when "the digest leaves a summary out" repair 1 -> combine
  otherwise fail
}

# report.mk: outline a short report, draft its sections side by side, and
# assemble them. With a slow model this takes a few seconds, long enough to
# kill it in the middle (see demo.py).
#
# Reads `topic`; writes `sections`, `drafts` and `report` (the result).
mklang 0.4
machine report
entry outline
budget 10
result report

context {
  topic: "how a city cut its water losses by half"
}

state outline {
  structure "A JSON array of four section titles, in reading order."
  prompt "Outline a four-section report on {{topic}}."
  parse list
  output sections
  when "the outline has four distinct sections" -> draft
  otherwise fail
}

state draft {
  over sections
  structure "One paragraph of at most 60 words."
  prompt "Write the section '{{item}}' of a report on {{topic}}."
  output drafts
  otherwise -> assemble
}

state assemble {
  structure "The sections in order, then a two-sentence conclusion."
  prompt """
    Assemble these sections into one report on {{topic}}:
    {{drafts}}
    """
  output report
  when "the report reads as one piece" -> END
  otherwise fail
}

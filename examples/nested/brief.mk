# brief.mk: build a short briefing one checked section at a time.
#
# Each visit of `add_section` calls section.mk, which writes a section and
# calls fact_check.mk on it (two levels of calls), and appends the checked
# section to `sections`. Reads `subject`; writes `sections` (the result).
mklang 0.4
machine brief
entry add_section
budget 10
result sections

context {
  subject: "the history of the metric system"
  sections: []
}

state add_section {
  call section { subject: "{{subject}}", written: "{{sections}}" }
  accumulate
  output sections
  max_visits 3
  when "the sections cover the subject well" -> END
  otherwise -> add_section
}

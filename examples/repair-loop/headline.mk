# headline.mk: write a headline and repair it until it is short and true.
#
# A host hook measures the length (no model call); the judge checks the
# claim against the article. Each kind of problem has its own repair
# budget, and every retry is told which condition the previous headline
# failed. Reads `article` and `max_chars`; writes `headline` (the result).
mklang 0.4
machine headline
entry write
budget 10
result headline

context {
  article: ""
  max_chars: 70
}

hook too_long "True when the headline is longer than max_chars characters."

state write {
  structure "One headline, no quotes, no trailing period."
  prompt """
    Write a headline of at most {{max_chars}} characters for this article:
    {{article}}
    """
  output headline
  max_visits 6
  when "the headline is too long" hook too_long repair 2 -> write
  when "the headline claims something the article does not say" repair 2 -> write
  when "the headline is accurate and specific" -> END
  otherwise fail
}

# triage.mk: route a support ticket to a drafted reply.
#
# Billing tickets within the refund limit go straight to a reply; larger
# refunds and bugs the knowledge base knows nothing about go to a human
# first. Reads `ticket.body` and `ticket.amount`; writes `category`, `kb`,
# `decision` and `draft` (the result).
mklang 0.4
machine triage
entry classify
budget 25
result draft

context {
  ticket: { body: "", amount: 0 }
  manual: { answer: "" }
}

tool search_kb read_only "Look up knowledge-base facts. Input: {query}. Returns the matching facts, or nothing."
hook amount_ok "True for a billing ticket whose amount is at most 100."

state classify {
  tier fast
  structure "One word: bug, billing or other."
  prompt "Classify this support ticket: {{ticket.body}}"
  output category
  when "a billing ticket within the refund limit" hook amount_ok -> draft
  when "the category is billing" escalate -> review ask "A refund above the limit was requested: approve it?" reply_to manual.answer
  when "the category is bug" -> lookup
  otherwise -> draft
}

state lookup {
  tool search_kb { query: "{{ticket.body}}" }
  output kb
  when "the observation has no facts" escalate -> review ask "The knowledge base has nothing on this bug: how should we answer?" reply_to manual.answer
  otherwise -> draft
}

state review {
  structure "One line: what happens to the ticket."
  prompt """
    A support reviewer answered about this ticket.
    Ticket: {{ticket.body}}
    Reviewer: {{manual.answer}}
    Decide what happens to the ticket.
    """
  output decision
  otherwise -> draft
}

state draft {
  tier reasoning
  reason
  structure "A courteous reply to the customer, at most 150 words."
  prompt """
    Reply to this ticket: {{ticket.body}}
    Knowledge-base facts: {{kb}}
    Decision on the case: {{decision}}
    """
  output draft
  max_visits 4
  when "the reply resolves the request" -> END
  when "the reply has gaps" repair 2 -> draft
  otherwise fail
}

# refund.mk: route a customer ticket; paying money back is the effect that
# a judge misled by the ticket must not choose on its own.
mklang 0.4
machine refund
entry classify
budget 12

context { ticket: { body: "", amount: 0 } }

tool issue_refund "Pay the customer back. Input: {amount}. Returns a receipt."
tool search_kb read_only "Look up the refund policy. Input: {query}."
hook within_policy "True when the ticket's amount is within the refund policy."

state classify {
  structure "One word: refund, policy, confirm, human, delegate or recheck."
  prompt "Route this ticket: {{ticket}}"
  output category
  when "the ticket asks for a refund" -> pay
  when "the ticket asks about the policy" -> lookup
  when "the refund needs a policy check" -> confirm
  when "a human must approve the refund" escalate -> pay ask "Refund this ticket?"
  when "another team pays refunds of this kind" -> delegate
  when "a human must approve, then the ticket is routed again" escalate -> recheck ask "Approve?"
  when "finance checks refunds of this kind first" -> delegate_checked
  otherwise fail
}

state recheck {
  structure "One word: pay or stop."
  prompt "The reviewer said {{human.reply}}. Route {{ticket}} again."
  output decision
  when "the refund goes ahead" -> pay
  otherwise fail
}

state lookup {
  tool search_kb { query: "{{ticket.body}}" }
  output policy
  otherwise -> END
}

state confirm {
  structure "One sentence."
  prompt "Summarise the refund request: {{ticket}}"
  output summary
  when "the amount is within the policy" hook within_policy -> pay
  otherwise fail
}

state delegate {
  call payout { amount: "{{ticket.amount}}" }
  output payout
  otherwise -> END
}

state delegate_checked {
  call checked_payout { amount: "{{ticket.amount}}" }
  output checked
  otherwise -> pay
}

state pay {
  tool issue_refund { amount: "{{ticket.amount}}" }
  output receipt
  otherwise -> END
}

# checked_payout.mk: finance pays a refund once its own hook confirms it.
mklang 0.4
machine checked_payout
entry review
budget 4

context { amount: 0 }

tool issue_refund "Pay the customer back. Input: {amount}. Returns a receipt."
hook within_policy "True when the amount is within the refund policy."

state review {
  structure "One sentence."
  prompt "Review a refund of {{amount}}."
  output review
  when "the amount is within the policy" hook within_policy -> pay
  otherwise fail
}

state pay {
  tool issue_refund { amount: "{{amount}}" }
  output receipt
  otherwise -> END
}

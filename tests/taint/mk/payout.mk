# payout.mk: the finance team's side of a refund, called by refund.mk.
mklang 0.4
machine payout
entry pay
budget 3

context { amount: 0 }

tool issue_refund "Pay the customer back. Input: {amount}. Returns a receipt."

state pay {
  tool issue_refund { amount: "{{amount}}" }
  output receipt
  otherwise -> END
}

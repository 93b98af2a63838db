# review.mk: the sub-machine crash.mk calls; it writes to the ledger too.
mklang 0.4
machine review
entry read
budget 5
result review

context {
  text: ""
}

tool record "Append a note to the ledger. Input: {note}."

state read {
  structure "A one-line review."
  prompt "Review {{text}}"
  output review
  when "the review is fine" -> stamp
  otherwise -> stamp
}

state stamp {
  tool record { note: "{{review}}" }
  output stamp
  otherwise -> END
}

# crash.mk: a run with every kind of step in flight, for the kill -9 tests:
# a judged gate, a fan-out over four items, a nested call whose result is
# judged, host tools at both levels.
mklang 0.4
machine crash
entry plan
budget 20

context {
  items: ["alpha", "beta", "gamma", "delta"]
}

tool record "Append a note to the ledger. Input: {note}."

state plan {
  structure "A one-line plan."
  prompt "Plan the work on {{items}}"
  output plan
  when "the plan is ready" -> work
  otherwise -> work
}

state work {
  over items
  structure "One line about the item."
  prompt "Work on {{item}} following {{plan}}"
  output results
  otherwise -> check
}

state check {
  call review { text: "{{results}}" }
  output review
  when "the review is usable" -> note
  otherwise -> note
}

state note {
  tool record { note: "{{review}}" }
  output receipt
  otherwise -> wrap
}

state wrap {
  structure "A final line."
  prompt "Wrap up {{receipt}} and {{review}}"
  output final
  when "the summary is complete" -> END
  otherwise -> END
}

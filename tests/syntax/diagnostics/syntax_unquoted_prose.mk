# expect: syntax
machine m
entry a
budget 10

state a {
  structure "One word."
  prompt Classify this ticket
  output o
  otherwise -> END
}

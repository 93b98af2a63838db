# expect: missing-field
machine m
entry a

state a {
  tool t
  output o
  otherwise -> END
}

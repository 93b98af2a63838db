# expect: syntax
machine m
entry a
budget 10

state a {
  structure "s
  prompt "p"
  output o
  otherwise -> END
}

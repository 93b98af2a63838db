# expect: unknown-entry
machine m
entry start
budget 10

state a {
  structure "s"
  prompt "p"
  output o
  otherwise -> END
}

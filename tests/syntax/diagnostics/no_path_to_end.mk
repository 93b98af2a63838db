# expect: no-path-to-end
machine m
entry a
budget 10

state a {
  structure "s"
  prompt "p"
  output o
  otherwise -> a
}

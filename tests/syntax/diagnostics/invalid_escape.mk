# expect: invalid-string
machine m
entry a
budget 10

state a {
  structure "a \q b"
  prompt "p"
  output o
  otherwise -> END
}

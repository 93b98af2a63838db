# expect: two-faces
machine m
entry a
budget 10

state a {
  structure "s"
  prompt "p"
  call helper
  output o
  otherwise -> END
}

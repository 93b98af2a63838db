# expect: no-face, no-output
machine m
entry a
budget 10

state a {
  tier fast
  otherwise -> END
}

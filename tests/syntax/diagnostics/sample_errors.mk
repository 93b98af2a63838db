# expect: sample-too-small, sample-with-over
machine m
entry a
budget 10

context { xs: [1, 2] }

state a {
  sample 1
  over xs
  structure "s"
  prompt "p"
  output o
  otherwise -> END
}

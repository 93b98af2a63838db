# expect: budget-infeasible
machine m
entry a
budget 3

state a {
  sample 5
  structure "s"
  prompt "p"
  output o
  otherwise -> END
}

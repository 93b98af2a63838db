# expect: unknown-target, unreachable-state
machine m
entry a
budget 10

state a {
  structure "s"
  prompt "p"
  output o
  when "done" -> END
  otherwise -> reveiw
}

state review {
  structure "s"
  prompt "p"
  output r
  otherwise -> END
}

# expect: syntax
machine m
entry a
budget 10

state a {
  structure "s"
  prompt "p"
  output o
  when "too long" repair -> a
  otherwise -> END
}
